//! `inspect` figures for the real configs (text-backbone §1–§5, around-backbone §1.4–§2.4):
//! parameters vs the published 2.78T / 104.2B, bytes on disk vs the release's tensors, caches.

use k3_model::config::{builtin_config, Config, Ffn, Mixer};
use k3_model::inspect::{report, report_with_checkpoint, runs};
use serde_json::json;

const GIB: u64 = 1 << 30;
/// The release's tensors (text-backbone §9, id 60408037768).
const RELEASE_BYTES: u64 = 1_560_860_324_864;
/// Of which vision tower + projector (168 tensors).
const VISION_BYTES: u64 = 894_717_952;

fn cfg(name: &str) -> Config {
    Config::from_json(builtin_config(name).unwrap()).unwrap()
}

/// around-backbone §1.1 `vision_config` (the spec's k3 entry carries only the text config).
fn with_vision() -> Config {
    let mut v = builtin_config("k3").unwrap();
    v["vision_config"] = json!({"patch_size": 14, "vt_hidden_size": 1024, "mm_hidden_size": 1024, "vt_num_hidden_layers": 27,
        "vt_num_attention_heads": 12, "qkv_hidden_size": 1536, "vt_intermediate_size": 4096, "init_pos_emb_height": 64,
        "init_pos_emb_width": 64, "init_pos_emb_time": 4, "merge_kernel_size": [2, 2], "text_hidden_size": 7168, "projector_ln_eps": 1e-5});
    Config::from_json(v).unwrap()
}

fn within(got: u64, want: f64, tol: f64) -> bool {
    ((got as f64 - want) / want).abs() <= tol
}

#[test]
fn k3_parameters_match_the_published_totals() {
    let r = report(&cfg("k3"));
    assert!(within(r.total_params, 2.78e12, 0.01), "{}", r.total_params);
    assert!(within(r.active_params, 104.2e9, 0.01), "{}", r.active_params);
    // Exact values from the tensor table (text only).
    assert_eq!(r.total_params, 2_779_484_476_000);
    assert_eq!(r.active_params, 104_189_612_640);
    let routed = r.params.iter().find(|c| serde_json::to_value(c.component).unwrap() == "routed_experts").unwrap();
    assert_eq!(routed.total, 92 * 896 * 3 * 3072 * 3584);
    assert_eq!(routed.active, routed.total * 16 / 896);
    let emb = r.params.iter().find(|c| serde_json::to_value(c.component).unwrap() == "embedding").unwrap();
    assert_eq!((emb.total, emb.active), (163_840 * 7168, 0));
}

#[test]
fn k3_bytes_on_disk_reproduce_the_release() {
    // Text only: the release minus its vision tower + projector.
    let r = report(&cfg("k3"));
    assert_eq!(r.disk_bytes, RELEASE_BYTES - VISION_BYTES);
    assert_eq!(r.tensor_count, 497_052);
    // With around-backbone §1.1's vision_config: exactly the release (497,220 tensors).
    let r = report(&with_vision());
    assert_eq!(r.disk_bytes, RELEASE_BYTES);
    assert_eq!(r.tensor_count, 497_220);
    assert!(within(r.total_params, 2.78e12, 0.01));
    // Vision is not touched by a text token: active unchanged.
    assert_eq!(r.active_params, 104_189_612_640);
    // MXFP4 experts: 17,547,264 bytes per expert (around-backbone §2.1).
    assert_eq!(r.disk_bytes_by_dtype["U8"], 92 * 896 * 17_547_264);
}

#[test]
fn cache_sizes() {
    let k3 = report(&cfg("k3"));
    assert_eq!(k3.mla_latent_values_per_token_per_layer, 576);
    assert_eq!(k3.kv_bytes_per_token_bf16, 24 * 1152);
    assert_eq!(k3.kv_bytes_at_max_context_bf16, 27 * GIB);
    assert_eq!(k3.kv_bytes_per_token_fp8, 24 * 656);
    let k31 = report(&cfg("k3_1_pro"));
    assert_eq!(k31.indexer_key_values_per_token_per_layer, 128);
    assert_eq!(k31.kv_bytes_at_max_context_bf16, 33 * GIB);
    assert_eq!(k31.kv_bytes_per_token_fp8, 24 * (656 + 132));
    assert_eq!(format!("{:.2}", k31.kv_bytes_at_max_context_fp8 as f64 / GIB as f64), "18.47");
    // KDA: 69 × 96×128×128 f32 ≈ 434 MB, conv tails 69 × 3·12288·3 bf16 ≈ 15 MB.
    assert_eq!(k3.kda_recurrent_state_bytes_per_sequence, 69 * 96 * 128 * 128 * 4);
    assert_eq!(k3.kda_recurrent_state_bytes_per_sequence / 1_000_000, 434);
    assert_eq!(k3.kda_conv_state_bytes_per_sequence / 1_000_000, 15);
    assert_eq!(k3.kda_state_bytes_per_sequence, k3.kda_recurrent_state_bytes_per_sequence + k3.kda_conv_state_bytes_per_sequence);
    // K3.1: DSA adds 7,438,592 indexer parameters per layer (text-backbone §5.2).
    assert_eq!(k31.total_params - k3.total_params, 24 * 7_438_592);
}

#[test]
fn schedule_and_layer_kinds() {
    let r = report(&cfg("k3_1_pro"));
    assert_eq!((r.kda_layers, r.mla_layers, r.dsa_layers, r.dense_ffn_layers, r.moe_layers), (69, 0, 24, 1, 92));
    assert_eq!(r.layers.len(), 93);
    assert_eq!(r.layers[3].mixer, Mixer::Dsa);
    let s = runs(&cfg("k3").layers);
    assert_eq!(s[0].first, 0);
    assert_eq!((s[0].mixer, s[0].ffn), (Mixer::Kda, Ffn::Dense));
    assert_eq!(s.last().map(|r| (r.first, r.last, r.mixer)), Some((91, 92, Mixer::Mla)));
    assert_eq!(r.layer_kinds.len(), 3);
    let dsa = r.layer_kinds.iter().find(|k| k.mixer == Mixer::Dsa).unwrap();
    assert_eq!(dsa.count, 24);
    assert!(dsa.weights.iter().any(|w| w.name == "self_attn.indexer.wq_b.weight" && w.shape == vec![4096, 1536]));
    assert!(dsa.weights.iter().any(|w| w.name == "block_sparse_moe.experts.{e}.w2.weight_scale" && w.shape == vec![3584, 96] && w.dtype == "U8"));
    let json = serde_json::to_value(&r).unwrap();
    for k in [
        "total_params",
        "active_params",
        "disk_bytes",
        "kv_bytes_per_token_bf16",
        "kv_bytes_at_max_context_bf16",
        "kv_bytes_at_max_context_fp8",
        "kda_state_bytes_per_sequence",
    ] {
        assert!(json[k].is_u64(), "{k}");
    }
    assert_eq!(json["layers"][3], json!({"index": 3, "mixer": "dsa", "ffn": "moe", "attn_res_block_start": false}));
}

#[test]
fn checkpoint_facts() {
    let d = tempfile::tempdir().unwrap();
    let o = k3_model::init::InitOptions { experts: k3_model::init::ExpertFormat::Mxfp4, ..Default::default() };
    k3_model::init::init(builtin_config("tiny").unwrap(), &Default::default(), &d.path().join("m"), &o).unwrap();
    let ck = k3_model::Checkpoint::open(&d.path().join("m")).unwrap();
    let r = report_with_checkpoint(&ck);
    let c = r.checkpoint.as_ref().unwrap();
    assert!(c.check_error.is_none(), "{:?}", c.check_error);
    assert_eq!(c.bytes_by_dtype.values().sum::<u64>(), ck.data_bytes());
    assert!(c.file_bytes > ck.data_bytes());
    assert!(c.resident_bytes.unwrap() > 0);
    // init writes A_log unpadded, otherwise exactly the shipped layout.
    let a_log_pad = 3 * (128 - 4) * 4;
    assert_eq!(ck.data_bytes() + a_log_pad, r.disk_bytes);
}
