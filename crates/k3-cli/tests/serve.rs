//! `k3 serve` end to end: starts the real binary on a free loopback port with the embedded
//! chat model k3-chat (its default, no `--model`) and drives it with the official `openai` Python client
//! (crates/k3-server/tests/py/openai_e2e.py): chat and completions, streaming and not, usage
//! counts equal to k3-tokenizer counts, stop strings, seeds, malformed inputs, a tool round trip
//! (call, tool result, answer; streamed and not), `tool_choice` required and named,
//! `response_format` json_schema, and the load test
//! (throughput at concurrency 1/8/32, RSS, cancelling half the clients). It needs python3 with the
//! `openai` package, so it is `#[ignore]`d in the default run (the summary counts it as ignored)
//! and run explicitly by `.ci/run` (`cargo test -p k3-cli --test serve -- --ignored`), where a
//! missing package is a failure, not a skip.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

#[path = "../../../tests/support/serve.rs"]
mod serve;

fn python_with_openai() -> bool {
    Command::new("python3").args(["-c", "import openai"]).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

#[test]
#[ignore = "needs python3 with the openai package (pip install openai): cargo test -p k3-cli --test serve -- --ignored"]
fn serve_with_openai_python_client() {
    assert!(
        python_with_openai(),
        "serve_with_openai_python_client: python3 with the `openai` package is not installed (pip install openai); this check cannot run"
    );
    // the default model of `k3 serve`: the embedded chat model (the script's tool checks need it)
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-chat");
    let key = "test-key-123";
    let (server, addr) =
        serve::start(&["--api-key", key, "--served-model-name", "k3-small", "--max-batch", "32", "--max-queue", "64"], Duration::from_secs(60));
    let (pid, base) = (server.0.id(), format!("http://{addr}"));

    let tok = k3_tokenizer::Tokenizer::from_dir(&model).expect("tokenizer");
    let messages = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]);
    let chat = k3_tokenizer::ChatRequest::from_json_str(&json!({"messages": messages}).to_string()).expect("chat request");
    let chat_tokens = k3_tokenizer::render_chat(&tok, &chat).expect("render").ids.len();
    let prompt = "Once upon a time, in a quiet village,";
    let cfg = json!({
        "base_url": base, "api_key": key, "model": "k3-small", "pid": pid,
        "chat": {"messages": messages, "prompt_tokens": chat_tokens},
        "completion": {"prompt": prompt, "prompt_tokens": tok.encode(prompt, true).len()},
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg_path = dir.path().join("cfg.json");
    std::fs::write(&cfg_path, cfg.to_string()).expect("write cfg");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../k3-server/tests/py/openai_e2e.py");
    let mut py = Command::new("python3").arg(&script).arg(&cfg_path).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn python3");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = py.try_wait().expect("wait python") {
            break Some(s);
        }
        if t0.elapsed() > Duration::from_secs(240) {
            let _ = py.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = py.wait_with_output().expect("python output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    drop(server);
    assert!(status.is_some(), "the Python e2e script timed out");
    assert!(status.is_some_and(|s| s.success()), "the Python e2e script failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
