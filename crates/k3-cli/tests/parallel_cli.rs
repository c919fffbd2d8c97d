//! The parallel layout from the command line: `k3 logits --tp/--ep/--pp` on the CPU (ranks as
//! threads) writes the one-rank logits, bad layouts fail naming the flags, and the planner
//! (`k3 inspect --tp/--pp --gpu-mem --json`) answers `fits` for real K3; so does the one-GPU-host
//! plan (`k3 inspect --gpu-mem --host-mem [--experts-on] [--*-bw]`).

use std::process::{Command, Output};

use serde_json::Value;

#[path = "../../../tests/support/golden.rs"]
mod golden;

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3")).args(args).output().expect("run k3")
}

fn read_npy_f32(p: &std::path::Path) -> Vec<f32> {
    let b = std::fs::read(p).unwrap();
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hl..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
fn logits_are_the_same_on_any_layout() {
    let model = golden::fixture("k3_small_mxfp4");
    let dir = tempfile::tempdir().unwrap();
    let ids = "1,5,9,22,7,100,3,250,17,64";
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = vec!["logits", "--model", model.to_str().unwrap(), "--ids", ids, "--out", out.to_str().unwrap()];
        args.extend_from_slice(extra);
        let o = k3(&args);
        assert!(o.status.success(), "k3 {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        read_npy_f32(&out)
    };
    let one = run("one.npy", &[]);
    for extra in [&["--tp", "2"][..], &["--tp", "1", "--ep", "4"], &["--pp", "2", "--mode", "decode"], &["--tp", "2", "--pp", "3", "--mode", "chunked:3"]] {
        let got = run("par.npy", extra);
        assert_eq!(got.len(), one.len(), "{extra:?}");
        let (num, den) = got.iter().zip(&one).fold((0f64, 0f64), |(n, d), (a, b)| (n + ((a - b) as f64).powi(2), d + (*b as f64).powi(2)));
        assert!((num / den).sqrt() < 1e-5, "{extra:?}: rel-L2 {}", (num / den).sqrt());
    }
}

#[test]
fn bad_layouts_name_the_flags() {
    let model = golden::fixture("k3_small_mxfp4");
    let m = model.to_str().unwrap();
    for (extra, want) in [(&["--tp", "2", "--ep", "4"][..], "--tp 4 --ep 4"), (&["--pp", "9"], "--pp 9"), (&["--tp", "0"], "--tp 0")] {
        let mut args = vec!["logits", "--model", m, "--ids", "1,2", "--out", "/dev/null"];
        args.extend_from_slice(extra);
        let o = k3(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "k3 {args:?}: {err}");
    }
}

/// `k3 inspect k3 --json ARGS`'s object `key` (the command must succeed).
fn inspect_json(args: &[&str], key: &str) -> Value {
    let mut a = vec!["inspect", "k3", "--json"];
    a.extend_from_slice(args);
    let o = k3(&a);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice::<Value>(&o.stdout).unwrap()[key].clone()
}

#[test]
fn planner_answers_fits() {
    let fits = |args: &[&str]| inspect_json(args, "capacity");
    let c = fits(&["--tp", "8", "--pp", "2", "--gpu-mem", "139"]);
    assert_eq!(c["fits"], true, "{c}");
    assert_eq!(c["ranks"].as_array().unwrap().len(), 16);
    let c = fits(&["--tp", "8", "--gpu-mem", "139"]);
    assert_eq!(c["fits"], false);
    assert!(c["reason"].as_str().unwrap().contains("more than --gpu-mem"), "{c}");
    let o = k3(&["inspect", "k3", "--tp", "8", "--gpu-mem=-3"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--gpu-mem"));
}

#[test]
fn one_host_planner_places_the_experts() {
    let plan = |args: &[&str]| inspect_json(args, "placement");
    let p = plan(&["--gpu-mem", "139", "--host-mem", "1536", "--gpu-bw", "4000", "--host-bw", "200", "--disk-bw", "7"]);
    assert_eq!(p["fits"], true, "{p}");
    let tiers = p["tiers"].as_array().unwrap();
    let host = tiers.iter().find(|t| t["tier"] == "host").unwrap();
    assert!(host["resident_bytes"].as_u64().unwrap() > 1_300_000_000_000, "{host}");
    let floor = host["floor_ms"].as_f64().unwrap();
    assert!((floor - host["bytes_per_token"].as_f64().unwrap() / 200e9 * 1e3).abs() < 1e-6, "{host}");
    let p = plan(&["--gpu-mem", "139", "--host-mem", "256"]);
    let disk = p["tiers"].as_array().unwrap().iter().find(|t| t["tier"] == "disk").unwrap().clone();
    assert!(disk["resident_bytes"].as_u64().unwrap() > 0, "{disk}");
    let p = plan(&["--gpu-mem", "139", "--host-mem", "256", "--experts-on", "cpu"]);
    assert_eq!(p["fits"], false);
    assert!(p["reason"].as_str().unwrap().contains("--host-mem"), "{p}");
    // The table names every tier.
    let o = k3(&["inspect", "k3", "--gpu-mem", "139", "--host-mem", "1536"]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("one GPU host") && text.contains("fits: true"), "{text}");
    for (args, flag) in [
        (&["--host-mem", "100", "--experts-on", "nvme"][..], "--experts-on"),
        (&["--host-mem", "100", "--tp", "2"], "--tp"),
        (&["--gpu-bw", "3000"], "--gpu-bw"),
        (&["--host-mem", "100", "--disk-bw", "0"], "--disk-bw"),
        (&["--host-mem=-1"], "--host-mem"),
    ] {
        let mut a = vec!["inspect", "k3"];
        a.extend_from_slice(args);
        let o = k3(&a);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(flag), "{args:?}: {err}");
    }
}
