//! The built `k3` binary: `inspect --json` on the real K3 / K3.1 Pro configs (figures of
//! issue 2 / text-backbone §1–§5, around-backbone §2.4), `init` → `inspect` → `logits`, errors.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

#[path = "../../../tests/support/golden.rs"]
mod golden;

const GIB: f64 = (1u64 << 30) as f64;

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3")).args(args).output().expect("run k3")
}

fn ok(args: &[&str]) -> String {
    let o = k3(args);
    assert!(o.status.success(), "k3 {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn inspect_json(what: &str) -> Value {
    serde_json::from_str(&ok(&["inspect", what, "--json"])).unwrap()
}

fn shared_config(name: &str, dir: &Path) -> String {
    let src = golden::spec_configs_path();
    let text = std::fs::read_to_string(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    let all: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    let p = dir.join(format!("{name}.json"));
    std::fs::write(&p, all[name].to_string()).unwrap();
    p.to_string_lossy().into_owned()
}

#[test]
fn inspect_k3() {
    let d = tempfile::tempdir().unwrap();
    let j = inspect_json(&shared_config("k3", d.path()));
    let total = j["total_params"].as_f64().unwrap();
    let active = j["active_params"].as_f64().unwrap();
    assert!((total / 2.78e12 - 1.0).abs() < 0.01, "{total}");
    assert!((active / 104.2e9 - 1.0).abs() < 0.01, "{active}");
    // The release's 1,560,860,324,864 bytes minus its 894,717,952 vision bytes (the spec's k3
    // entry has no vision_config).
    assert_eq!(j["disk_bytes"].as_u64(), Some(1_560_860_324_864 - 894_717_952));
    assert_eq!(j["kv_bytes_per_token_bf16"].as_u64(), Some(24 * 1152));
    assert_eq!(j["kv_bytes_at_max_context_bf16"].as_f64().unwrap() / GIB, 27.0);
    let kda = j["kda_state_bytes_per_sequence"].as_f64().unwrap();
    assert!((kda / 1e6 - 449.4).abs() < 0.1, "{kda}");
    assert_eq!(j["kda_recurrent_state_bytes_per_sequence"].as_u64().unwrap() / 1_000_000, 434);
    let layers = j["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 93);
    assert_eq!((layers[0]["mixer"].as_str(), layers[0]["ffn"].as_str()), (Some("kda"), Some("dense")));
    assert_eq!((layers[92]["mixer"].as_str(), layers[92]["ffn"].as_str()), (Some("mla"), Some("moe")));
    assert_eq!(layers.iter().filter(|l| l["mixer"] == "kda").count(), 69);
    // The built-in name gives the same report; the table mentions the same totals.
    assert_eq!(inspect_json("k3"), j);
    let text = ok(&["inspect", "k3"]);
    assert!(text.contains("2,779,484,476,000") && text.contains("104,189,612,640") && text.contains("27.00 GiB"), "{text}");
}

#[test]
fn inspect_k3_1_pro() {
    let d = tempfile::tempdir().unwrap();
    let j = inspect_json(&shared_config("k3_1_pro", d.path()));
    assert!((j["total_params"].as_f64().unwrap() / 2.78e12 - 1.0).abs() < 0.01);
    assert!((j["active_params"].as_f64().unwrap() / 104.2e9 - 1.0).abs() < 0.01);
    assert_eq!(j["kv_bytes_per_token_bf16"].as_u64(), Some(24 * (1152 + 256)));
    assert_eq!(j["kv_bytes_at_max_context_bf16"].as_f64().unwrap() / GIB, 33.0);
    assert_eq!(format!("{:.2}", j["kv_bytes_at_max_context_fp8"].as_f64().unwrap() / GIB), "18.47");
    assert_eq!(j["layers"][92]["mixer"], "dsa");
    assert_eq!(j["layers"].as_array().unwrap().iter().filter(|l| l["mixer"] == "dsa").count(), 24);
    let text = ok(&["inspect", "k3_1_pro"]);
    assert!(text.contains("33.00 GiB") && text.contains("18.47 GiB"), "{text}");
}

#[test]
fn init_then_inspect_then_logits() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    let ms = m.to_str().unwrap();
    let out = ok(&["init", "--config", "tiny_dsa", "--out", ms, "--seed", "5", "--experts", "mxfp4", "--shard-size", "50000"]);
    assert!(out.contains("wrote"), "{out}");
    assert!(m.join("model.safetensors.index.json").is_file());
    let j = inspect_json(ms);
    let c = &j["checkpoint"];
    assert!(c["check_error"].is_null(), "{c}");
    assert!(c["files"].as_u64().unwrap() > 1);
    assert!(c["resident_bytes"].as_u64().unwrap() > 0);
    assert!(c["bytes_by_dtype"]["U8"].as_u64().unwrap() > 0);
    let npy = d.path().join("l.npy");
    ok(&["logits", "--model", ms, "--ids", "1,2,3,4,5", "--out", npy.to_str().unwrap()]);
    assert!(std::fs::metadata(&npy).unwrap().len() > 5 * 256 * 4);
    // Refuses to overwrite; bad arguments are reported.
    let o = k3(&["init", "--config", "tiny", "--out", ms]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not empty"));
    let o = k3(&["init", "--config", "tiny", "--out", d.path().join("x").to_str().unwrap(), "--dtype", "fp8"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--dtype"));
    // Few-layer, real-width config with overrides (config only: inspect the written config.json).
    let small = d.path().join("s");
    ok(&[
        "init",
        "--config",
        "tiny",
        "--out",
        small.to_str().unwrap(),
        "--num-hidden-layers",
        "2",
        "--num-experts",
        "4",
        "--set",
        "vocab_size=128",
        "--dtype",
        "f32",
    ]);
    let j = inspect_json(small.join("config.json").to_str().unwrap());
    assert_eq!(j["layers"].as_array().unwrap().len(), 2);
    assert_eq!(j["layers"][1]["mixer"], "mla");
    assert_eq!(j["vocab_size"], 128);
}

#[test]
fn inspect_errors_name_the_culprit() {
    let o = k3(&["inspect", "/nonexistent/k5.json"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("k5.json") && e.contains("k3_1_pro"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let o = k3(&["inspect", d.path().to_str().unwrap()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("config.json"));
}

/// Bad flags of `run`, `logits` and `bench` fail before any work, naming the flag or parameter.
#[test]
fn bad_flags_name_the_parameter() {
    let nano = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/k3-nano");
    let err = |args: &[&str]| {
        let o = k3(args);
        assert!(!o.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let e = err(&["run", "--model", nano, "--top-p", "1.5", "hi"]);
    assert!(e.contains("top_p"), "{e}");
    let e = err(&["run", "--model", nano, "--temperature", "-1", "hi"]);
    assert!(e.contains("temperature"), "{e}");
    let e = err(&["run", "--model", nano, "-n", "0", "hi"]);
    assert!(e.contains("max_tokens"), "{e}");
    let e = err(&["run", "--model", nano, "--logit-bias", "7", "hi"]);
    assert!(e.contains("--logit-bias") && e.contains("ID=BIAS"), "{e}");
    let e = err(&["run", "--model", nano, "--logit-bias", "7=500", "hi"]);
    assert!(e.contains("[-100, 100]"), "{e}");
    let e = err(&["run", "--model", nano, "--logit-bias", "99999999=1", "hi"]);
    assert!(e.contains("logit_bias") && e.contains("vocabulary"), "{e}");
    let e = err(&["logits", "--model", nano, "--ids", "1,2", "--out", "/tmp/never.npy", "--mode", "chunked:0"]);
    assert!(e.contains("--mode"), "{e}");
    let e = err(&["logits", "--model", nano, "--ids", "1,x", "--out", "/tmp/never.npy"]);
    assert!(e.contains("`x`"), "{e}");
    let e = err(&["logits", "--model", nano, "--ids", "1,2", "--out", "/tmp/never.npy", "--precision", "f32"]);
    assert!(e.contains("--precision") && e.contains("--device cuda"), "{e}");
    let e = err(&["logits", "--model", nano, "--ids", "1,2", "--out", "/tmp/never.npy", "--device", "cuda", "--precision", "f16"]);
    assert!(e.contains("--precision `f16`"), "{e}");
    let e = err(&["bench", "--model", nano, "--prompt-len", "0"]);
    assert!(e.contains("--prompt-len"), "{e}");
    let e = err(&["bench", "--model", nano, "--prompt-len", "10000", "--gen-len", "1"]);
    assert!(e.contains("context"), "{e}");
    let e = err(&["run", "--model", "/nonexistent/model", "hi"]);
    assert!(e.contains("/nonexistent/model"), "{e}");
    // --device: a bad name, and cuda where this build or machine has none, are errors that say
    // what to do (CI builds without the `cuda` feature and has no GPU).
    let e = err(&["run", "--model", nano, "--device", "gpu", "hi"]);
    assert!(e.contains("--device `gpu`") && e.contains("cuda:N"), "{e}");
    for args in [
        vec!["run", "--model", nano, "--device", "cuda", "hi"],
        vec!["logits", "--model", nano, "--ids", "1,2", "--out", "/tmp/never.npy", "--device", "cuda"],
        vec!["bench", "--model", nano, "--device", "cuda"],
    ] {
        let e = err(&args);
        assert!(e.contains("--features cuda") || e.contains("CUDA unavailable"), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{args:?}: {e}");
    }
}

/// `k3 run` on the embedded model: greedy generation is deterministic and prints timings.
#[test]
fn run_embedded_model_greedy() {
    let a = ok(&["run", "-n", "8", "--temperature", "0", "--json", "ROMEO."]);
    let b = ok(&["run", "-n", "8", "--temperature", "0", "--json", "ROMEO."]);
    let (va, vb): (Value, Value) = (serde_json::from_str(&a).unwrap(), serde_json::from_str(&b).unwrap());
    assert_eq!(va["ids"], vb["ids"]);
    assert_eq!(va["ids"].as_array().unwrap().len(), 8);
    assert!(va["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(!va["text"].as_str().unwrap().is_empty());
    // --logit-bias: +100 on one id makes greedy repeat it; −100 on the greedy first id bans it.
    let forced: Value = serde_json::from_str(&ok(&["run", "-n", "4", "--temperature", "0", "--json", "--logit-bias", "300=100", "ROMEO."])).unwrap();
    assert_eq!(forced["ids"], serde_json::json!([300, 300, 300, 300]));
    let first = va["ids"][0].as_u64().unwrap();
    let bias = format!("{first}=-100");
    let banned: Value = serde_json::from_str(&ok(&["run", "-n", "1", "--temperature", "0", "--json", "--logit-bias", &bias, "ROMEO."])).unwrap();
    assert_ne!(banned["ids"][0].as_u64().unwrap(), first);
}
