//! Checkpoint loader errors (around-backbone §1.2–§1.5): each names its culprit; the MXFP4
//! golden tile decodes bit-exactly (around-backbone §2.2); the golden checkpoints check clean.

mod common;
use std::path::{Path, PathBuf};

use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::kernels::cpu::mxfp4;
use k3_model::config::builtin_config;
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::{Checkpoint, Model};
use safetensors::{Dtype, SafeTensors};

type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn make(name: &str, dir: &Path, experts: ExpertFormat, shard_size: Option<u64>) -> PathBuf {
    let o = InitOptions { seed: 3, dtype: FloatDType::BF16, experts, shard_size };
    init(builtin_config(name).unwrap(), &Overrides::default(), dir, &o).unwrap();
    dir.to_path_buf()
}

/// Rewrites a safetensors file after `f` edits its tensor list.
fn rewrite(path: &Path, f: impl FnOnce(&mut Vec<Entry>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<Entry> = st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    f(&mut v);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        v.iter().map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The error of `Checkpoint::open(dir)` then `check()` then `Model::load`.
fn load_err(dir: &Path) -> String {
    let r = Checkpoint::open(dir).and_then(|ck| {
        ck.check()?;
        Model::load(&ck).map(|_| ())
    });
    match r {
        Ok(()) => panic!("{} loaded without error", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_names(e: &str, words: &[&str]) {
    for w in words {
        assert!(e.contains(w), "error `{e}` does not mention `{w}`");
    }
}

const Q: &str = "language_model.model.layers.0.self_attn.q_proj.weight";

#[test]
fn missing_config_json() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny", &d.path().join("m"), ExpertFormat::Float(FloatDType::BF16), None);
    std::fs::remove_file(m.join("config.json")).unwrap();
    assert_names(&load_err(&m), &["config.json", "missing", m.to_str().unwrap()]);
}

#[test]
fn missing_weights_and_missing_shard() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny", &d.path().join("m"), ExpertFormat::Mxfp4, Some(30_000));
    let shard = m.join("model-00002-of-").to_string_lossy().into_owned();
    let victim = std::fs::read_dir(&m).unwrap().map(|e| e.unwrap().path()).find(|p| p.to_string_lossy().starts_with(&shard)).unwrap();
    std::fs::remove_file(&victim).unwrap();
    let e = load_err(&m);
    assert_names(&e, &[victim.file_name().unwrap().to_str().unwrap(), "absent", "model.safetensors.index.json"]);
    let d2 = tempfile::tempdir().unwrap();
    std::fs::copy(m.join("config.json"), d2.path().join("config.json")).unwrap();
    assert_names(&load_err(d2.path()), &["model.safetensors", "neither"]);
}

#[test]
fn missing_tensor_names_it_and_its_shape() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny", &d.path().join("m"), ExpertFormat::Float(FloatDType::BF16), None);
    rewrite(&m.join("model.safetensors"), |v| v.retain(|t| t.0 != Q));
    assert_names(&load_err(&m), &[Q, "missing", "[64, 64]"]);
}

#[test]
fn wrong_shape_and_wrong_dtype() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny", &d.path().join("m"), ExpertFormat::Float(FloatDType::BF16), None);
    rewrite(&m.join("model.safetensors"), |v| {
        let t = v.iter_mut().find(|t| t.0 == Q).unwrap();
        t.2 = vec![32, 128];
    });
    assert_names(&load_err(&m), &[Q, "[32, 128]", "[64, 64]"]);
    let g = "language_model.model.layers.2.block_sparse_moe.gate.weight";
    rewrite(&m.join("model.safetensors"), |v| {
        let q = v.iter_mut().find(|t| t.0 == Q).unwrap();
        q.2 = vec![64, 64];
        let t = v.iter_mut().find(|t| t.0 == g).unwrap();
        t.1 = Dtype::U8;
        t.2 = vec![8, 128];
    });
    assert_names(&load_err(&m), &[g, "dtype U8", "BF16"]);
}

#[test]
fn unexpected_tensor_inside_a_layer() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny_dsa", &d.path().join("m"), ExpertFormat::Float(FloatDType::BF16), None);
    Checkpoint::open(&m).unwrap().check().unwrap();
    let bias = "language_model.model.layers.3.self_attn.indexer.wk.bias";
    rewrite(&m.join("model.safetensors"), |v| v.push((bias.into(), Dtype::BF16, vec![16], vec![0; 32])));
    assert_names(&load_err(&m), &[bias, "unexpected"]);
}

#[test]
fn truncated_or_corrupt_header() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny", &d.path().join("m"), ExpertFormat::Float(FloatDType::BF16), None);
    let f = m.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    // Cut inside the header.
    std::fs::write(&f, &bytes[..100]).unwrap();
    assert_names(&load_err(&m), &[f.to_str().unwrap(), "header"]);
    // Cut inside the data.
    std::fs::write(&f, &bytes[..bytes.len() - 1000]).unwrap();
    assert_names(&load_err(&m), &[f.to_str().unwrap(), "truncated"]);
    // Garbage in the header JSON.
    let mut bad = bytes.clone();
    bad[8..40].copy_from_slice(&[b'#'; 32]);
    std::fs::write(&f, &bad).unwrap();
    assert_names(&load_err(&m), &[f.to_str().unwrap(), "corrupt"]);
    // A header length past the end of the file.
    let mut bad = bytes.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&f, &bad).unwrap();
    assert_names(&load_err(&m), &[f.to_str().unwrap(), "header"]);
    std::fs::write(&f, b"").unwrap();
    assert_names(&load_err(&m), &[f.to_str().unwrap()]);
}

#[test]
fn mxfp4_scale_byte_255_is_rejected() {
    let d = tempfile::tempdir().unwrap();
    let m = make("tiny", &d.path().join("m"), ExpertFormat::Mxfp4, None);
    let s = "language_model.model.layers.2.block_sparse_moe.experts.5.w1.weight_scale";
    rewrite(&m.join("model.safetensors"), |v| v.iter_mut().find(|t| t.0 == s).unwrap().3[3] = 255);
    assert_names(&load_err(&m), &["experts.5.w1.weight_scale", "255"]);
}

#[test]
fn mxfp4_golden_tile_decodes_bit_exactly() {
    let p = common::golden_path("k3_small_mxfp4/mxfp4_unit.safetensors");
    let ck = k3_model::checkpoint::open_tensors_only(&p).unwrap();
    let (packed, scale) = (ck.tensor("weight_packed").unwrap(), ck.tensor("weight_scale").unwrap());
    let want: Vec<u32> = ck.tensor("decoded").unwrap().as_f32().unwrap().iter().map(|x| x.to_bits()).collect();
    assert_eq!(want.len(), 8 * 64);
    let got = mxfp4::decode(packed.as_u8().unwrap(), scale.as_u8().unwrap(), 8, 64).unwrap();
    assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
    let neg0 = got.iter().filter(|x| x.to_bits() == 0x8000_0000).count();
    assert_eq!(neg0, 32, "nibble 8 must decode to -0.0");
    let m = Matrix::mxfp4(packed, scale).unwrap();
    assert_eq!(m.to_f32().iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
}

#[test]
fn golden_checkpoints_check_clean_and_are_mapped() {
    checkpoints_check_clean(&["k3_small_mxfp4"]);
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_checkpoints_check_clean_full_set() {
    checkpoints_check_clean(&["k3_small_f32", "k31_small_dsa_f32", "vision_small_f32"]);
}

fn checkpoints_check_clean(fixtures: &[&str]) {
    for &f in fixtures {
        let ck = Checkpoint::open(&common::fixture(f)).unwrap();
        ck.check().unwrap_or_else(|e| panic!("{f}: {e}"));
        let name = ck.names()[0].to_string();
        assert!(ck.tensor(&name).unwrap().is_mapped());
    }
}

/// A tiny checkpoint with one MTP draft layer (`layers.5.*`, around-backbone §5.1).
fn make_mtp(dir: &Path) -> PathBuf {
    let mut ov = Overrides::default();
    ov.set.push(("num_nextn_predict_layers".into(), serde_json::json!(1)));
    let o = InitOptions { seed: 3, dtype: FloatDType::BF16, experts: ExpertFormat::Float(FloatDType::BF16), shard_size: None };
    init(builtin_config("tiny").unwrap(), &ov, dir, &o).unwrap();
    dir.to_path_buf()
}

const EH: &str = "language_model.model.layers.5.eh_proj.weight";

#[test]
fn mtp_layer_loads_and_a_missing_tensor_is_named() {
    let d = tempfile::tempdir().unwrap();
    let m = make_mtp(&d.path().join("m"));
    let model = Model::load(&Checkpoint::open(&m).unwrap()).unwrap();
    assert_eq!(model.mtp.as_ref().map(|x| x.index), Some(5));
    for gone in [EH, "language_model.model.layers.5.block_sparse_moe.experts.3.w2.weight", "language_model.model.layers.5.shared_head.head.weight"] {
        let d2 = tempfile::tempdir().unwrap();
        let m2 = make_mtp(&d2.path().join("m"));
        rewrite(&m2.join("model.safetensors"), |v| v.retain(|e| e.0 != gone));
        assert_names(&load_err(&m2), &[gone, "missing", "num_nextn_predict_layers"]);
    }
}

/// MTP tensors in a checkpoint whose config declares none are refused, naming one; the optional
/// extras of an MTP layer (a shared `embed_tokens`, AttnRes names) are tolerated and unread.
#[test]
fn mtp_tensors_need_the_config_and_extras_are_tolerated() {
    let d = tempfile::tempdir().unwrap();
    let m = make_mtp(&d.path().join("m"));
    let cfg_path = m.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["text_config"]["num_nextn_predict_layers"] = serde_json::json!(0);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert_names(&load_err(&m), &["language_model.model.layers.5.", "unexpected"]);
    let d2 = tempfile::tempdir().unwrap();
    let m2 = make_mtp(&d2.path().join("m"));
    rewrite(&m2.join("model.safetensors"), |v| {
        let h = (Dtype::BF16, vec![64], vec![0u8; 128]);
        for n in ["embed_tokens.weight", "self_attention_res_norm.weight", "mlp_res_proj.weight"] {
            v.push((format!("language_model.model.layers.5.{n}"), h.0, h.1.clone(), h.2.clone()));
        }
    });
    let ck = Checkpoint::open(&m2).unwrap();
    ck.check().unwrap();
    assert!(Model::load(&ck).unwrap().mtp.is_some());
}
