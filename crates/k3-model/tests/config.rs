//! Config validation (text-backbone §1–§2, around-backbone §1.1): every config of
//! `shared/spec/k3-configs.json` (copied to `tests/golden/`) and of the golden fixtures validates; every unsupported or
//! inconsistent config is rejected with a message that names the field.

mod common;
use common::{fixture, spec_configs_path};
use k3_model::config::{builtin_config, builtin_names, Config, Ffn, Mixer};
use serde_json::{json, Value};

fn shared_configs() -> serde_json::Map<String, Value> {
    let p = spec_configs_path();
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap()
}

#[test]
fn every_shared_config_validates() {
    let all = shared_configs();
    let names: Vec<&String> = all.keys().filter(|k| !k.starts_with('_')).collect();
    assert_eq!(names.len(), 4, "{names:?}");
    for name in names {
        let cfg = Config::from_json(all[name].clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(cfg.layers.len(), cfg.text.num_hidden_layers, "{name}");
    }
}

#[test]
fn embedded_copy_matches_the_shared_spec() {
    let embedded: Value = serde_json::from_str(k3_model::config::BUILTIN_CONFIGS).unwrap();
    assert_eq!(
        embedded,
        Value::Object(shared_configs()),
        "crates/k3-model/configs/k3-configs.json drifted from tests/golden/k3-configs.json (the copy of shared/spec/k3-configs.json)"
    );
    assert_eq!(builtin_names(), vec!["k3", "k3_1_pro", "tiny", "tiny_dsa"]);
    let e = builtin_config("k4").unwrap_err().to_string();
    assert!(e.contains("k4") && e.contains("k3_1_pro"), "{e}");
}

#[test]
fn golden_fixture_configs_validate() {
    fixture_configs_validate(&["k3_small_mxfp4", "vision_small_f32"]);
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_fixture_configs_validate_full_set() {
    fixture_configs_validate(&["k3_small_f32", "k31_small_dsa_f32"]);
}

fn fixture_configs_validate(fixtures: &[&str]) {
    for &f in fixtures {
        let cfg = Config::from_file(&fixture(f).join("config.json")).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert_eq!(cfg.layers.len(), 6);
        assert_eq!(cfg.is_dsa(), f.starts_with("k31"), "{f}");
        assert_eq!(cfg.experts_mxfp4(), f.ends_with("mxfp4"), "{f}");
        assert_eq!(cfg.vision_config.is_some(), f.starts_with("vision"), "{f}");
        let kinds: Vec<Mixer> = cfg.layers.iter().map(|l| l.mixer).collect();
        let full = if cfg.is_dsa() { Mixer::Dsa } else { Mixer::Mla };
        assert_eq!(kinds, vec![Mixer::Kda, Mixer::Kda, full, Mixer::Kda, Mixer::Kda, full], "{f}");
        // manifest: attn_res_block_starts_0indexed [0, 3]
        let starts: Vec<usize> = cfg.layers.iter().filter(|l| l.attn_res_block_start).map(|l| l.index).collect();
        assert_eq!(starts, vec![0, 3]);
    }
}

#[test]
fn k3_schedule() {
    let cfg = Config::from_json(builtin_config("k3").unwrap()).unwrap();
    let kda = cfg.layers.iter().filter(|l| l.mixer == Mixer::Kda).count();
    assert_eq!((kda, cfg.layers.len() - kda), (69, 24));
    assert!(
        cfg.layers[3].mixer == Mixer::Mla && cfg.layers[91].mixer == Mixer::Mla && cfg.layers[92].mixer == Mixer::Mla && cfg.layers[90].mixer == Mixer::Kda
    );
    assert_eq!(cfg.layers[0].ffn, Ffn::Dense);
    assert!(cfg.layers[1..].iter().all(|l| l.ffn == Ffn::Moe));
    let starts: Vec<usize> = cfg.layers.iter().filter(|l| l.attn_res_block_start).map(|l| l.index).collect();
    assert_eq!(starts, vec![0, 12, 24, 36, 48, 60, 72, 84]);
    assert!(cfg.experts_mxfp4());
    let k31 = Config::from_json(builtin_config("k3_1_pro").unwrap()).unwrap();
    assert_eq!(k31.layers.iter().filter(|l| l.mixer == Mixer::Dsa).count(), 24);
    assert_eq!(k31.layers.iter().filter(|l| l.mixer == Mixer::Mla).count(), 0);
}

#[test]
fn bare_text_config_is_accepted() {
    let nested = builtin_config("k3_1_pro").unwrap();
    let bare = nested["text_config"].clone();
    let a = Config::from_json(nested).unwrap();
    let b = Config::from_json(bare).unwrap();
    assert_eq!(a.layers, b.layers);
    assert!(b.experts_mxfp4() && b.is_dsa());
    assert_eq!(b.eos_token_ids, vec![163586]);
}

#[test]
fn null_optional_fields_are_accepted() {
    let mut v = builtin_config("tiny_dsa").unwrap();
    let t = &mut v["text_config"];
    t["dsa_config"]["index_skip_topk_offset"] = Value::Null;
    t["dsa_config"]["index_k_norm_type"] = Value::Null;
    t["quantization_config"] = Value::Null;
    t["num_key_value_heads"] = Value::Null;
    t["max_position_embeddings"] = Value::Null;
    t["linear_attn_config"]["use_full_rank_gate"] = Value::Null;
    v["media_placeholder_token_id"] = Value::Null;
    v["vision_config"] = Value::Null;
    let cfg = Config::from_json(v).unwrap();
    assert!(cfg.text.dsa_config.as_ref().unwrap().index_skip_topk_offset.is_none());
    assert!(!cfg.experts_mxfp4());
}

/// Applies `f` to the text config of `base` and returns the validation error.
fn err_of(base: &str, f: impl FnOnce(&mut Value)) -> String {
    let mut v = builtin_config(base).unwrap();
    f(&mut v);
    match Config::from_json(v) {
        Ok(_) => panic!("config was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_names(e: &str, words: &[&str]) {
    for w in words {
        assert!(e.contains(w), "error `{e}` does not mention `{w}`");
    }
}

#[test]
fn layer_lists_must_cover_every_layer_exactly_once() {
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["kda_layers"] = json!([1, 3]));
    assert_names(&e, &["linear_attn_config", "layer 2", "kda_layers", "full_attn_layers"]);
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["kda_layers"] = json!([1, 2, 3, 4]));
    assert_names(&e, &["full_attn_layers", "layer 4", "twice"]);
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["kda_layers"] = json!([0, 1, 2, 3]));
    assert_names(&e, &["kda_layers", "entry 0", "1-based"]);
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["full_attn_layers"] = json!([4, 5, 6]));
    assert_names(&e, &["full_attn_layers", "entry 6"]);
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["kda_layers"] = json!([1, 1, 2, 3]));
    assert_names(&e, &["kda_layers", "layer 1", "twice"]);
}

#[test]
fn dsa_layers_must_equal_full_attn_layers() {
    let e = err_of("tiny_dsa", |v| v["text_config"]["dsa_config"]["dsa_layers"] = json!([5]));
    assert_names(&e, &["dsa_config.dsa_layers", "full_attn_layers"]);
    let e = err_of("k3_1_pro", |v| v["text_config"]["dsa_config"]["dsa_layers"] = json!([4, 8]));
    assert_names(&e, &["dsa_layers"]);
}

#[test]
fn index_topk_freq_must_be_one() {
    let e = err_of("k3_1_pro", |v| v["text_config"]["dsa_config"]["index_topk_freq"] = json!(4));
    assert_names(&e, &["index_topk_freq", "4"]);
}

#[test]
fn index_k_norm_type_must_be_layernorm() {
    let e = err_of("k3_1_pro", |v| v["text_config"]["dsa_config"]["index_k_norm_type"] = json!("rmsnorm"));
    assert_names(&e, &["index_k_norm_type", "rmsnorm", "layernorm"]);
}

#[test]
fn rope_mla_and_other_activations_are_unsupported() {
    let e = err_of("k3", |v| v["text_config"]["mla_use_nope"] = json!(false));
    assert_names(&e, &["mla_use_nope", "unsupported"]);
    let e = err_of("k3", |v| v["text_config"]["hidden_act"] = json!("silu"));
    assert_names(&e, &["hidden_act", "silu", "unsupported", "situ"]);
}

#[test]
fn top_k_cannot_exceed_num_experts() {
    let e = err_of("tiny", |v| v["text_config"]["num_experts_per_token"] = json!(9));
    assert_names(&e, &["num_experts_per_token", "9", "num_experts 8"]);
}

#[test]
fn inconsistent_head_dimensions_are_rejected() {
    let e = err_of("k3", |v| v["text_config"]["num_key_value_heads"] = json!(8));
    assert_names(&e, &["num_key_value_heads", "num_attention_heads"]);
    let e = err_of("k3", |v| v["text_config"]["routed_expert_hidden_size"] = json!(3590));
    assert_names(&e, &["routed_expert_hidden_size", "32"]);
    let e = err_of("k3", |v| v["text_config"]["moe_intermediate_size"] = json!(3000));
    assert_names(&e, &["moe_intermediate_size", "32"]);
    let vision = json!({"patch_size": 14, "vt_hidden_size": 1024, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 12,
                        "qkv_hidden_size": 1000, "vt_intermediate_size": 4096, "text_hidden_size": 7168});
    let e = err_of("k3", |v| v["vision_config"] = vision.clone());
    assert_names(&e, &["vision_config.qkv_hidden_size", "vt_num_attention_heads"]);
    let e = err_of("k3", |v| {
        v["vision_config"] = vision.clone();
        v["vision_config"]["qkv_hidden_size"] = json!(1536);
        v["vision_config"]["text_hidden_size"] = json!(2304);
    });
    assert_names(&e, &["vision_config.text_hidden_size", "7168"]);
}

#[test]
fn other_unsupported_fields_are_named() {
    for (k, val, word) in [
        ("model_type", json!("deepseek_v3"), "model_type"),
        ("tie_word_embeddings", json!(true), "tie_word_embeddings"),
        ("num_expert_group", json!(8), "num_expert_group"),
        ("hidden_size", json!(0), "hidden_size"),
    ] {
        let e = err_of("tiny", |v| v["text_config"][k] = val.clone());
        assert_names(&e, &[word]);
    }
    let e = err_of("tiny", |v| {
        v["text_config"]["linear_attn_config"].as_object_mut().unwrap().remove("gate_lower_bound");
    });
    assert_names(&e, &["gate_lower_bound"]);
    let e = err_of("tiny", |v| v["text_config"]["quantization_config"] = json!({"format": "nvfp4-pack-quantized"}));
    assert_names(&e, &["quantization_config.format", "nvfp4"]);
}

#[test]
fn errors_from_a_file_name_the_file_and_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    let mut v = builtin_config("tiny").unwrap();
    v["text_config"]["hidden_act"] = json!("gelu");
    std::fs::write(&p, v.to_string()).unwrap();
    let e = Config::from_file(&p).unwrap_err().to_string();
    assert_names(&e, &[p.to_str().unwrap(), "hidden_act", "gelu"]);
    std::fs::write(&p, "{\"text_config\": ").unwrap();
    let e = Config::from_file(&p).unwrap_err().to_string();
    assert_names(&e, &["config.json", "not valid JSON"]);
    std::fs::write(&p, "{\"foo\": 1}").unwrap();
    let e = Config::from_file(&p).unwrap_err().to_string();
    assert_names(&e, &["text_config", "hidden_size"]);
    let e = Config::from_file(&dir.path().join("absent.json")).unwrap_err().to_string();
    assert_names(&e, &["absent.json", "cannot read"]);
}

/// A value of the wrong type or out of a type's range names its JSON path and the expected type
/// (issue 28, item 11): negative, string, float, null and 2^64 sizes; nested and bare configs.
#[test]
fn type_errors_name_the_json_path_and_the_expected_type() {
    let huge: Value = serde_json::from_str("18446744073709551616").unwrap();
    for (k, bad) in [
        ("hidden_size", json!(-256)),
        ("vocab_size", json!("512")),
        ("num_experts", json!(2.5)),
        ("kv_lora_rank", Value::Null),
        ("intermediate_size", huge.clone()),
    ] {
        let e = err_of("tiny", |v| v["text_config"][k] = bad.clone());
        assert_names(&e, &[&format!("text_config.{k}"), "expected a non-negative integer"]);
        assert!(!e.contains("schema: invalid"), "{e}");
    }
    let e = err_of("tiny", |v| v["text_config"]["rms_norm_eps"] = json!("small"));
    assert_names(&e, &["text_config.rms_norm_eps", "expected a number"]);
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["head_dim"] = json!(-1));
    assert_names(&e, &["text_config.linear_attn_config.head_dim", "-1", "non-negative integer"]);
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["kda_layers"][0] = json!("one"));
    assert_names(&e, &["text_config.linear_attn_config.kda_layers[0]", "non-negative integer"]);
    let e = err_of("tiny", |v| v["text_config"]["latent_moe_use_norm"] = json!(1));
    assert_names(&e, &["text_config.latent_moe_use_norm", "true or false"]);
    // A bare text config: the path starts at the top level.
    let mut bare = builtin_config("tiny").unwrap()["text_config"].clone();
    bare["num_attention_heads"] = json!(-8);
    let e = Config::from_json(bare).unwrap_err().to_string();
    assert_names(&e, &["`num_attention_heads`", "non-negative integer"]);
    // Through a file: the file, then the field.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    let mut v = builtin_config("tiny").unwrap();
    v["text_config"]["hidden_size"] = json!(-256);
    std::fs::write(&p, v.to_string()).unwrap();
    let e = Config::from_file(&p).unwrap_err().to_string();
    assert_names(&e, &[p.to_str().unwrap(), "text_config.hidden_size", "-256", "non-negative integer"]);
}

/// Numeric fields the model reads are range-checked (issue 28, item 12).
#[test]
fn numeric_fields_are_range_checked() {
    let cases: [(&str, Value, &str); 7] = [
        ("max_position_embeddings", json!(0), "max_position_embeddings"),
        ("rms_norm_eps", json!(-1.0), "rms_norm_eps"),
        ("rms_norm_eps", json!(0.0), "rms_norm_eps"),
        ("rms_norm_eps", json!(2.0), "rms_norm_eps"),
        ("activation_situ_beta", json!(-4.0), "activation_situ_beta"),
        ("activation_situ_linear_beta", json!(0), "activation_situ_linear_beta"),
        ("routed_scaling_factor", json!(-1), "routed_scaling_factor"),
    ];
    for (k, val, word) in cases {
        let e = err_of("tiny", |v| v["text_config"][k] = val.clone());
        assert_names(&e, &[&format!("text_config.{word}")]);
    }
    let e = err_of("tiny", |v| v["text_config"]["linear_attn_config"]["gate_lower_bound"] = json!(5.0));
    assert_names(&e, &["gate_lower_bound", "negative"]);
    let vision = json!({"patch_size": 0, "vt_hidden_size": 1024, "vt_num_hidden_layers": 2, "vt_num_attention_heads": 8, "vt_intermediate_size": 64});
    let e = err_of("tiny", |v| v["vision_config"] = vision.clone());
    assert_names(&e, &["vision_config.patch_size", "> 0"]);
}
