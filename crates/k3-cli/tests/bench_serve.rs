//! `k3 bench serve` (the load generator) against a real `k3 serve` of the embedded k3-nano on a
//! loopback port: every request succeeds and is counted, the percentiles are ordered and
//! consistent with the workload, the server's own counters saw exactly the requests and tokens
//! the generator reports; requests the server refuses are counted as failed with the server's
//! message; bad flags and an unreachable server are clear errors.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

#[path = "../../../tests/support/serve.rs"]
mod serve;

/// `k3 serve` of k3-nano on a free port; its base URL.
fn serve() -> (serve::Server, String) {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    let (server, addr) = serve::start(&["--model", model.to_str().expect("utf-8 path"), "--max-batch", "8"], Duration::from_secs(60));
    (server, format!("http://{addr}"))
}

fn bench(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_k3")).args(["bench", "serve"]).args(args).output().expect("run k3 bench serve");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let v = stdout.lines().last().and_then(|l| serde_json::from_str(l).ok()).unwrap_or(Value::Null);
    (out.status.success(), v, stderr)
}

#[test]
fn load_generator_against_k3_serve() {
    let (_server, base) = serve();
    let completions = "k3_requests_total{endpoint=\"/v1/completions\"";
    let (requests_before, tokens_before) = (serve::metric(&base, completions), serve::metric(&base, "k3_generation_tokens_total"));
    let (ok, v, err) = bench(&["--base-url", &base, "--num-prompts", "6", "--max-concurrency", "3", "--input-len", "12", "--output-len", "5", "--json"]);
    assert!(ok, "k3 bench serve failed: {err}");
    assert_eq!(v["requests_ok"], 6, "{v}");
    assert_eq!(v["requests_failed"], 0, "{v}");
    assert_eq!(v["total_output_tokens"], 30, "ignore_eos: every request generates --output-len tokens: {v}");
    for k in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"] {
        let (p50, p90, p99) = (v[k]["p50"].as_f64().unwrap(), v[k]["p90"].as_f64().unwrap(), v[k]["p99"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p90 && p90 <= p99, "{k}: {p50} {p90} {p99}");
    }
    assert!(v["ttft_ms"]["p99"].as_f64().unwrap() <= v["e2e_latency_ms"]["p99"].as_f64().unwrap());
    let tps = v["output_tokens_per_s"].as_f64().unwrap();
    let want = 30.0 / v["duration_s"].as_f64().unwrap();
    assert!((tps - want).abs() <= 1e-6 * want, "{tps} vs {want}");
    // The server saw exactly these requests and tokens.
    let seen = serve::metric(&base, completions) - requests_before;
    assert_eq!(seen, 6.0, "the server counted {seen} new completions");
    assert_eq!(serve::metric(&base, "k3_generation_tokens_total") - tokens_before, 30.0);

    // Prompt ids beyond the model's vocabulary: the server refuses each, the generator counts
    // them and names the server's reason, and exits non-zero as nothing was measured.
    let (ok, _, err) = bench(&["--base-url", &base, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--vocab-size", "100000000", "--json"]);
    assert!(!ok, "all requests failed yet it exited 0");
    assert!(err.contains("every request failed") && err.contains("HTTP 400") && err.contains("vocabulary"), "{err}");

    // A workload longer than the server's context is refused before any request.
    let (ok, _, err) = bench(&["--base-url", &base, "--input-len", "100000", "--output-len", "1"]);
    assert!(!ok && err.contains("max_model_len"), "{err}");
}

#[test]
fn bad_flags_and_no_server_are_clear_errors() {
    let (ok, _, err) = bench(&["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]);
    assert!(!ok && err.contains("cannot reach the server") && err.contains("--base-url"), "{err}");
    let (ok, _, err) = bench(&["--base-url", "https://example.com"]);
    assert!(!ok && err.contains("http://"), "{err}");
    let (ok, _, err) = bench(&["--num-prompts", "0"]);
    assert!(!ok && err.contains("--num-prompts"), "{err}");
}
