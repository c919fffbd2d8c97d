//! `k3 run --experts-on disk` on the embedded k3-nano (issue 23, the CPU backend): the routed
//! experts read from the checkpoint into a small expert cache give the ids of the memory-mapped
//! run, `--json` reports the cache's counters, and bad values are errors naming their flag.

use std::process::{Command, Output};

use serde_json::Value;

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3")).args(args).output().expect("run k3")
}

fn nano() -> String {
    format!("{}/../../models/k3-nano", env!("CARGO_MANIFEST_DIR"))
}

fn run_json(extra: &[&str]) -> Value {
    let nano = nano();
    let mut args = vec!["run", "--model", &nano, "--temperature", "0", "-n", "24", "--json"];
    args.extend_from_slice(extra);
    args.push("KING EDWARD.\nI know not what I think");
    let o = k3(&args);
    assert!(o.status.success(), "k3 {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn experts_from_disk_give_the_mapped_ids() {
    let plain = run_json(&[]);
    assert!(plain["expert_cache"].is_null(), "{plain}");
    for io in ["auto", "buffered"] {
        let disk = run_json(&["--experts-on", "disk", "--expert-cache-mem", "512KiB", "--expert-readers", "2", "--expert-io", io]);
        assert_eq!(disk["ids"], plain["ids"], "--expert-io {io}");
        let c = &disk["expert_cache"];
        let n = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("expert_cache.{k} in {c}"));
        assert!(n("reads") > 0 && n("evictions") > 0, "{c}");
        assert_eq!(n("requests"), n("hits") + n("in_flight") + n("misses"), "{c}");
        assert_eq!(n("budget_bytes"), 512 << 10);
        assert!(n("resident_bytes") <= n("budget_bytes"), "{c}");
        if io == "buffered" {
            assert_eq!(n("direct_reads"), 0, "{c}");
        }
    }
    // Host memory is the CPU's own tier: the mapped run.
    assert_eq!(run_json(&["--experts-on", "cpu"])["ids"], plain["ids"]);
    // The text run says where the experts are, and what the cache did.
    let nano = nano();
    let o = k3(&["run", "--model", &nano, "-n", "4", "--experts-on", "disk", "--expert-cache-mem", "1GiB", "--expert-readers", "3", "ROMEO."]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success() && err.contains("routed experts read from disk into a 1.00 GiB cache (3 readers"), "{err}");
    assert!(err.contains("[experts from disk:") && err.contains("hit rate"), "{err}");
}

#[test]
fn bad_expert_flags_name_the_flag() {
    let nano = nano();
    let cases: &[(&[&str], &str)] = &[
        (&["--experts-on", "gpu"], "--device cuda"),
        (&["--experts-on", "fast"], "--experts-on"),
        (&["--gpu-mem", "24"], "--gpu-mem"),
        (&["--gpu-mem", "0", "--device", "cuda"], "--gpu-mem"),
        (&["--host-mem", "64"], "--gpu-mem"),
        (&["--expert-readers", "0", "--experts-on", "disk"], "--expert-readers"),
        (&["--expert-io", "mmap"], "--expert-io"),
        (&["--expert-cache-mem", "1KiB", "--experts-on", "disk"], "--expert-cache-mem"),
        (&["--experts-on", "disk", "--tp", "2"], "--experts-on"),
    ];
    for (flags, want) in cases {
        let mut args = vec!["run", "--model", &nano, "-n", "2"];
        args.extend_from_slice(flags);
        args.push("hi");
        let o = k3(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "k3 {args:?}: expected an error naming {want}, got {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[path = "../../../tests/support/serve.rs"]
mod serve;

#[test]
fn serve_with_experts_from_disk_answers_as_mapped_and_counts_reads() {
    let req = serde_json::json!({"model": "k3-nano", "prompt": "ROMEO.", "max_tokens": 12, "temperature": 0});
    let nano = nano();
    let answer = |extra: &[&str]| {
        let (_server, addr) = serve::start(&[&["--model", &nano, "--served-model-name", "k3-nano"], extra].concat(), std::time::Duration::from_secs(120));
        let v = serve::post(&addr, "/v1/completions", &req);
        (v["choices"][0]["text"].clone(), serve::metric(&addr, "k3_expert_cache_reads_total"), serve::metric(&addr, "k3_expert_cache_requests_total"))
    };
    let (plain, r0, _) = answer(&[]);
    assert!(plain.as_str().is_some_and(|t| !t.is_empty()), "{plain}");
    assert_eq!(r0, 0.0, "no expert cache without --experts-on disk");
    let (disk, reads, requests) = answer(&["--experts-on", "disk", "--expert-cache-mem", "1MiB"]);
    assert_eq!(disk, plain);
    assert!(reads > 0.0 && requests > 0.0, "reads {reads}, requests {requests}");
}

/// A fresh `k3 init --config tiny --experts mxfp4` checkpoint in a temporary directory.
fn tiny_mxfp4() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let o = k3(&["init", "--config", "tiny", "--out", dir.path().to_str().unwrap(), "--experts", "mxfp4"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dir
}

#[test]
fn bench_experts_reports_both_tiers_beside_their_floors() {
    let dir = tiny_mxfp4();
    let d = dir.path().to_str().unwrap();
    let o = k3(&["bench", "--op", "experts", "1", "3", "--model", d, "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.iter().map(|r| r["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    for r in rows {
        for key in ["host_ms", "host_floor_ms", "disk_ms", "disk_floor_ms", "expert_bytes_per_step"] {
            assert!(r[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {r}");
        }
        assert!(r["disk_reads"].as_u64().unwrap() > 0, "{r}");
    }
    assert!(v["memory_read_bandwidth_gb_s"].as_f64().unwrap() > 0.0 && v["disk_read_bandwidth_gb_s"].as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn bench_experts_times_only_the_tiers_asked_for() {
    let dir = tiny_mxfp4();
    let d = dir.path().to_str().unwrap();
    let o = k3(&["bench", "--op", "experts", "2", "--tiers", "host", "--model", d, "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let r = &v["results"][0];
    assert!(r["host_ms"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    assert!(r["disk_ms"].is_null() && r["disk_reads"].as_u64() == Some(0), "the disk tier ran: {r}");
    assert!(v["disk_read_bandwidth_gb_s"].is_null(), "{v}");
    // The text form says which tier was not timed.
    let o = k3(&["bench", "--op", "experts", "1", "--tiers", "disk", "--model", d]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("(not timed)"), "{text}");
    let o = k3(&["bench", "--op", "experts", "1", "--tiers", "tape", "--model", d]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--tiers"), "{}", String::from_utf8_lossy(&o.stderr));
}
