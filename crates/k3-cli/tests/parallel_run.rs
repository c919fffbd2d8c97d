//! `k3 run` and `k3 serve` over a parallel layout on the CPU (ranks as threads): the greedy
//! tokens of `k3 run --tp 2`, `--tp 1 --ep 2`, `--pp 2` and `--tp 2 --pp 2` on the golden
//! fixture are those of one rank; `k3 serve --tp 2` answers a chat completion with the same
//! message as `--tp 1` (the embedded k3-nano); `--device cuda` with several ranks in a build
//! without CUDA, node flags and `--precision` on the CPU, and a bad layout are refused naming
//! the flags (the GPU world itself: `scripts/gpu/parallel_serve.sh`).

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::{json, Value};

#[path = "../../../tests/support/golden.rs"]
mod golden;
#[path = "../../../tests/support/serve.rs"]
mod serve;

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3")).args(args).output().expect("run k3")
}

fn run_ids(extra: &[&str]) -> Vec<u64> {
    let model = golden::fixture("k3_small_mxfp4");
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--ids",
        "1,5,9,22,7,100,3,250,17,64,8,8,30",
        "-n",
        "12",
        "--temperature",
        "0",
        "--prefill-chunk",
        "5",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = k3(&args);
    assert!(o.status.success(), "k3 {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("k3 {args:?}: not JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)));
    v["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn run_on_any_layout_gives_the_one_rank_tokens() {
    let one = run_ids(&[]);
    assert_eq!(one.len(), 12);
    for extra in [&["--tp", "2"][..], &["--tp", "1", "--ep", "2"], &["--pp", "2"], &["--tp", "2", "--pp", "2"]] {
        assert_eq!(run_ids(extra), one, "k3 run {extra:?}");
    }
}

#[test]
fn multi_gpu_and_bad_layouts_are_refused() {
    let model = golden::fixture("k3_small_mxfp4");
    let m = model.to_str().unwrap();
    // With CUDA built in, --device cuda --tp 2 would start a real world of processes.
    let gpu: &[(&[&str], &str)] = if cfg!(feature = "cuda") { &[] } else { &[(&["--tp", "2", "--device", "cuda"], "no CUDA support")] };
    for (extra, want) in gpu.iter().copied().chain([
        (&["--tp", "2", "--ep", "4"][..], "--tp 4 --ep 4"),
        (&["--pp", "9"], "--pp 9"),
        (&["--nnodes", "2"], "add --device cuda"),
        (&["--precision", "f32"], "--precision applies to --device cuda"),
    ]) {
        let mut args = vec!["run", "--model", m, "--ids", "1,2", "-n", "2"];
        args.extend_from_slice(extra);
        let o = k3(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "k3 {args:?}: {err}");
    }
    if !cfg!(feature = "cuda") {
        let o = k3(&["serve", "--port", "0", "--tp", "2", "--device", "cuda"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains("no CUDA support") && err.contains("one process per GPU"), "k3 serve --tp 2 --device cuda: {err}");
    }
}

/// Starts `k3 serve` (the embedded k3-nano) with `extra`, returns it and its `host:port`.
fn serve(extra: &[&str]) -> (serve::Server, String) {
    serve::start(&[&["--served-model-name", "k3"], extra].concat(), Duration::from_secs(120))
}

#[test]
fn serve_tp2_answers_as_tp1() {
    let req = json!({
        "model": "k3", "messages": [{"role": "user", "content": "Hello! Who are you?"}],
        "max_tokens": 12, "temperature": 0, "reasoning_effort": "none", "logprobs": true, "top_logprobs": 2,
    });
    let answer = |extra: &[&str]| {
        let (_server, addr) = serve(extra);
        let v = serve::post(&addr, "/v1/chat/completions", &req);
        (
            v["choices"][0]["message"].clone(),
            v["choices"][0]["logprobs"]["content"].as_array().map(|c| c.iter().map(|t| t["token"].clone()).collect::<Vec<_>>()),
            v["usage"].clone(),
        )
    };
    let one = answer(&["--tp", "1"]);
    assert!(one.0["content"].as_str().is_some_and(|c| !c.is_empty()), "{:?}", one.0);
    assert_eq!(answer(&["--tp", "2"]), one);
    assert_eq!(answer(&["--tp", "2", "--pp", "2"]), one);
}
