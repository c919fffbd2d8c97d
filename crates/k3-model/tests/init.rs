//! `k3 init` → load round trips (around-backbone §1–§2): f32, bf16, MXFP4 experts, sharded
//! output; determinism, realistic scales, atomic writes, overrides.

use std::path::Path;

use k3_core::DType;
use k3_model::config::builtin_config;
use k3_model::init::{init, prepare_config, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::weights::{tensor_table, Kind};
use k3_model::{Checkpoint, Config, ForwardOpts, Model};
use serde_json::json;

fn opts(dtype: FloatDType, experts: ExpertFormat) -> InitOptions {
    InitOptions { seed: 7, dtype, experts, shard_size: None }
}

fn make(name: &str, dir: &Path, o: &InitOptions) -> Checkpoint {
    init(builtin_config(name).unwrap(), &Overrides::default(), dir, o).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    ck.check().unwrap();
    ck
}

/// Loads the model and runs 12 tokens; returns the logits after checking they are finite and
/// neither saturated nor vanishing.
fn forward(ck: &Checkpoint) -> Vec<f32> {
    let m = Model::load(ck).unwrap();
    let toks: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % m.config.text.vocab_size as u32).collect();
    let mut st = m.new_state();
    let logits = m.forward(&toks, &mut st, ForwardOpts::default(), None).unwrap();
    assert_eq!(logits.len(), 12 * m.config.text.vocab_size);
    assert!(logits.iter().all(|x| x.is_finite()), "non-finite logits");
    let mean = logits.iter().sum::<f32>() / logits.len() as f32;
    let std = (logits.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / logits.len() as f32).sqrt();
    assert!((0.05..20.0).contains(&std), "logit std {std}: activations saturate or vanish");
    logits
}

#[test]
fn f32_round_trip() {
    let d = tempfile::tempdir().unwrap();
    let ck = make("tiny", &d.path().join("m"), &opts(FloatDType::F32, ExpertFormat::Float(FloatDType::F32)));
    let table = tensor_table(&ck.config);
    assert_eq!(ck.names().len(), table.len());
    for s in &table {
        let e = ck.entry(&s.name).unwrap();
        assert_eq!(e.dtype, DType::F32, "{}", s.name);
        assert_eq!(e.shape, s.shape, "{}", s.name);
    }
    assert!(!ck.config.experts_mxfp4());
    forward(&ck);
}

#[test]
fn bf16_round_trip_keeps_the_release_f32_tensors() {
    let d = tempfile::tempdir().unwrap();
    let ck = make("tiny", &d.path().join("m"), &opts(FloatDType::BF16, ExpertFormat::Float(FloatDType::BF16)));
    for s in tensor_table(&ck.config) {
        let want = if s.kind == Kind::Float32 { DType::F32 } else { DType::BF16 };
        assert_eq!(ck.entry(&s.name).unwrap().dtype, want, "{}", s.name);
    }
    // A_log [num_heads], values ln U(1, 16); dt_bias in [-2, -0.2]; norms ≈ 1.
    let p = "language_model.model.layers.0.self_attn.";
    let a = ck.tensor(&format!("{p}A_log")).unwrap();
    assert_eq!(a.shape(), &[4]);
    assert!(a.as_f32().unwrap().iter().all(|x| (0.0..=16f32.ln()).contains(x)));
    assert!(ck.tensor(&format!("{p}dt_bias")).unwrap().as_f32().unwrap().iter().all(|x| (-2.0..=-0.2).contains(x)));
    let n = ck.tensor("language_model.model.norm.weight").unwrap().to_f32().unwrap().into_owned();
    assert!((n.iter().sum::<f32>() / n.len() as f32 - 1.0).abs() < 0.1);
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("m/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["text_config"]["dtype"], "bfloat16");
    assert!(cfg["text_config"]["quantization_config"].is_null());
    forward(&ck);
}

#[test]
fn mxfp4_experts_round_trip() {
    let d = tempfile::tempdir().unwrap();
    let ck = make("tiny", &d.path().join("m"), &opts(FloatDType::BF16, ExpertFormat::Mxfp4));
    assert!(ck.config.experts_mxfp4());
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("m/config.json")).unwrap()).unwrap();
    assert_eq!(cfg["text_config"]["quantization_config"]["format"], "mxfp4-pack-quantized");
    assert!(cfg.get("quantization_config").is_none(), "the release nests quantization_config in text_config only");
    let p = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.";
    let packed = ck.tensor(&format!("{p}weight_packed")).unwrap();
    let scale = ck.tensor(&format!("{p}weight_scale")).unwrap();
    assert_eq!((packed.dtype(), packed.shape()), (DType::U8, &[32usize, 16][..]));
    assert_eq!(scale.shape(), &[32, 1]);
    // N(0, 1/fan_in) quantised per 32-block: scales around 2^-7..2^-5 (release: 112..122).
    assert!(scale.as_u8().unwrap().iter().all(|&s| (116..=124).contains(&s)), "{:?}", scale.as_u8().unwrap());
    let m = k3_core::kernels::cpu::matmul::Matrix::mxfp4(packed, scale).unwrap();
    let w = m.to_f32();
    let rms = (w.iter().map(|x| x * x).sum::<f32>() / w.len() as f32).sqrt();
    assert!((0.1..0.3).contains(&rms), "expert weight rms {rms}, expected ≈ 1/sqrt(32)");
    forward(&ck);
}

#[test]
fn sharded_output_matches_single_file() {
    let d = tempfile::tempdir().unwrap();
    let o = opts(FloatDType::BF16, ExpertFormat::Mxfp4);
    let single = make("tiny_dsa", &d.path().join("one"), &o);
    let sharded = make("tiny_dsa", &d.path().join("many"), &InitOptions { shard_size: Some(40_000), ..o.clone() });
    assert!(sharded.files.len() > 2, "{:?}", sharded.files);
    let n = sharded.files.len();
    let names: Vec<String> = sharded.files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names[0], "model-00001-of-".to_string() + &format!("{n:06}.safetensors"));
    let idx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(d.path().join("many/model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(idx["metadata"]["total_size"].as_u64().unwrap(), sharded.data_bytes());
    assert_eq!(idx["weight_map"].as_object().unwrap().len(), tensor_table(&sharded.config).len());
    assert!(!d.path().join("many/model.safetensors").exists());
    for name in single.names() {
        assert_eq!(single.tensor(name).unwrap().bytes(), sharded.tensor(name).unwrap().bytes(), "{name}");
    }
    assert_eq!(forward(&single), forward(&sharded));
}

#[test]
fn deterministic_for_a_seed() {
    let d = tempfile::tempdir().unwrap();
    let o = opts(FloatDType::BF16, ExpertFormat::Mxfp4);
    for (dir, seed) in [("a", 7), ("b", 7), ("c", 8)] {
        init(builtin_config("tiny").unwrap(), &Overrides::default(), &d.path().join(dir), &InitOptions { seed, ..o.clone() }).unwrap();
    }
    let read = |x: &str| std::fs::read(d.path().join(x).join("model.safetensors")).unwrap();
    assert_eq!(read("a"), read("b"));
    assert_ne!(read("a"), read("c"));
}

#[test]
fn writes_are_atomic() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "x").unwrap();
    let e = init(builtin_config("tiny").unwrap(), &Overrides::default(), &out, &InitOptions::default()).unwrap_err().to_string();
    assert!(e.contains("not empty") && e.contains(out.to_str().unwrap()), "{e}");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    // An invalid override fails before anything is written.
    let bad = Overrides { set: vec![("num_experts_per_token".into(), json!(99))], ..Default::default() };
    let e = init(builtin_config("tiny").unwrap(), &bad, &d.path().join("n"), &InitOptions::default()).unwrap_err().to_string();
    assert!(e.contains("num_experts_per_token"), "{e}");
    // An unwritable destination leaves no temporary directory behind.
    let ro = d.path().join("file");
    std::fs::write(&ro, "x").unwrap();
    assert!(init(builtin_config("tiny").unwrap(), &Overrides::default(), &ro.join("m"), &InitOptions::default()).is_err());
    let names: Vec<String> = std::fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.contains("k3init")), "{names:?}");
    // An existing empty directory is fine.
    std::fs::create_dir(d.path().join("empty")).unwrap();
    init(builtin_config("tiny").unwrap(), &Overrides::default(), &d.path().join("empty"), &InitOptions::default()).unwrap();
    assert!(d.path().join("empty/config.json").is_file());
}

#[test]
fn overrides_keep_the_layer_lists_consistent() {
    let o = opts(FloatDType::BF16, ExpertFormat::Mxfp4);
    let ov = Overrides { num_hidden_layers: Some(2), num_experts: Some(8), set: vec![("vocab_size".into(), json!(1024))] };
    let v = prepare_config(builtin_config("k3_1_pro").unwrap(), &ov, &o).unwrap();
    let cfg = Config::from_json(v.clone()).unwrap();
    assert_eq!(cfg.text.hidden_size, 7168);
    assert_eq!((cfg.text.num_experts, cfg.text.num_experts_per_token, cfg.text.vocab_size), (8, 8, 1024));
    let kinds: Vec<_> = cfg.layers.iter().map(|l| (l.mixer, l.ffn)).collect();
    use k3_model::config::{Ffn, Mixer};
    assert_eq!(kinds, vec![(Mixer::Kda, Ffn::Dense), (Mixer::Dsa, Ffn::Moe)]);
    assert_eq!(v["text_config"]["dsa_config"]["dsa_layers"], json!([2]));
    // Six layers of K3 keep K3's kinds: KDA KDA KDA MLA KDA KDA, plus none forced.
    let v = prepare_config(builtin_config("k3").unwrap(), &Overrides { num_hidden_layers: Some(6), ..Default::default() }, &o).unwrap();
    assert_eq!(v["text_config"]["linear_attn_config"]["full_attn_layers"], json!([4]));
    assert_eq!(v["text_config"]["linear_attn_config"]["kda_layers"], json!([1, 2, 3, 5, 6]));
    // A bare text config is wrapped in the nested release schema.
    let v = prepare_config(builtin_config("tiny").unwrap()["text_config"].clone(), &Overrides::default(), &o).unwrap();
    assert_eq!(v["model_type"], "kimi_k3");
    assert_eq!(v["text_config"]["model_type"], "kimi_linear");
}

#[test]
fn deeper_model_stays_in_range() {
    // 16 layers of the tiny shape: realistic scales keep the last layers' logits O(1).
    let d = tempfile::tempdir().unwrap();
    let ov = Overrides { num_hidden_layers: Some(16), ..Default::default() };
    let mut v = builtin_config("tiny").unwrap();
    v["text_config"]["linear_attn_config"]["full_attn_layers"] = json!([4, 5]);
    init(v, &ov, &d.path().join("m"), &opts(FloatDType::F32, ExpertFormat::Mxfp4)).unwrap();
    let ck = Checkpoint::open(&d.path().join("m")).unwrap();
    assert_eq!(ck.config.layers.len(), 16);
    forward(&ck);
}

/// `--set` keys must be text_config fields: a typo is refused with the nearest name (issue 28,
/// item 14), nested keys are checked too, and known keys still work.
#[test]
fn unknown_set_keys_are_refused_with_a_suggestion() {
    let src = builtin_config("tiny").unwrap();
    let opts = InitOptions::default();
    for (key, near) in [("vocab_sise", "vocab_size"), ("linear_attn_config.num_head", "linear_attn_config.num_heads"), ("hiden_size", "hidden_size")] {
        let ov = Overrides { set: vec![(key.into(), json!(512))], ..Default::default() };
        let e = prepare_config(src.clone(), &ov, &opts).unwrap_err().to_string();
        assert!(e.contains(&format!("`{key}`")) && e.contains(&format!("did you mean `{near}`")), "{e}");
    }
    let ov = Overrides { set: vec![("completely_unrelated_thing".into(), json!(1))], ..Default::default() };
    let e = prepare_config(src.clone(), &ov, &opts).unwrap_err().to_string();
    assert!(e.contains("no field `completely_unrelated_thing`"), "{e}");
    let ov = Overrides { set: vec![("vocab_size".into(), json!(512)), ("linear_attn_config.num_heads".into(), json!(2))], ..Default::default() };
    let v = prepare_config(src, &ov, &opts).unwrap();
    assert_eq!(v["text_config"]["vocab_size"], json!(512));
}
