//! The `k3` binary on bad input and in bad conditions (issue 28: items 8, 13–16 and the serve
//! shutdown of item 2): each exits non-zero with one clear message naming the flag, variable,
//! file or id — or, for `k3 serve`, exits within its shutdown timeout.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn k3() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_k3"));
    c.env_remove("K3_MODEL_DIR").env_remove("K3_TOKENIZER_DIR");
    c
}

fn fails(c: &mut Command) -> String {
    let o: Output = c.output().expect("run k3");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "k3 succeeded: {}{err}", String::from_utf8_lossy(&o.stdout));
    err
}

#[path = "../../../tests/support/golden.rs"]
mod golden;

fn tokenizer_dir() -> PathBuf {
    golden::repo_golden().join("tokenizer")
}

/// Item 13: `parse-output` refuses an id outside the vocabulary, as `detokenize` does.
#[test]
fn parse_output_refuses_unknown_ids() {
    let tok = tokenizer_dir();
    let e = fails(k3().args(["parse-output", "--tokenizer"]).arg(&tok).args(["--ids", "39,99999"]));
    assert!(e.contains("99999") && e.contains("outside the vocabulary"), "{e}");
    let d = fails(k3().args(["detokenize", "--tokenizer"]).arg(&tok).args(["--ids", "39,99999"]));
    assert_eq!(e, d);
}

/// Item 14: a `--set` typo is refused with the nearest key and nothing is written.
#[test]
fn init_refuses_unknown_set_keys() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("m");
    let e = fails(k3().args(["init", "--config", "tiny", "--out"]).arg(&out).args(["--set", "vocab_sise=512"]));
    assert!(e.contains("vocab_sise") && e.contains("did you mean `vocab_size`"), "{e}");
    assert!(!out.exists());
}

/// Item 14: a wrong `K3_MODEL_DIR` is an error (no fall-back to k3-nano); so is a `--model`
/// that does not exist or is a file.
#[test]
fn wrong_model_locations_are_errors() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("nope");
    let e = fails(k3().env("K3_MODEL_DIR", &missing).args(["run", "-n", "1", "hi"]));
    assert!(e.contains("K3_MODEL_DIR") && e.contains("nope") && e.contains("no such directory"), "{e}");
    let empty = d.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let e = fails(k3().env("K3_MODEL_DIR", &empty).args(["run", "-n", "1", "hi"]));
    assert!(e.contains("config.json"), "{e}");
    let e = fails(k3().args(["run", "-n", "1", "--model"]).arg(&missing).arg("hi"));
    assert!(e.contains("--model") && e.contains("no such directory"), "{e}");
    let file = d.path().join("config.json");
    std::fs::write(&file, "{}").unwrap();
    let e = fails(k3().args(["bench", "--gen-len", "1", "--model"]).arg(&file));
    assert!(e.contains("--model") && e.contains("is a file"), "{e}");
}

/// Item 16: `bench --help` describes both modes and every op; an unknown op says so.
#[test]
fn bench_help_and_unknown_ops() {
    let o = k3().args(["bench", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&o.stdout);
    for w in ["model mode", "gemv ROWS COLS", "dsa [CONTEXTS...]", "gemm M N K", "rmsnorm ROWS DIM", "copy BYTES"] {
        assert!(help.contains(w), "`{w}` missing from bench --help:\n{help}");
    }
    assert!(!help.contains("cuda needs `--op`"), "{help}");
    let e = fails(k3().args(["bench", "--op", "foo", "1", "2"]));
    assert!(e.contains("--op `foo`") && e.contains("unknown op") && e.contains("gemv") && e.contains("dsa"), "{e}");
    let e = fails(k3().args(["bench", "--device", "cuda", "--op", "foo"]));
    assert!(e.contains("unknown op") && e.contains("gemm"), "{e}");
}

/// Item 8: a port in use is reported once, naming the address.
#[test]
fn port_in_use_is_reported_once() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let e = fails(k3().args(["serve", "--port", &port]));
    assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    assert_eq!(e.matches("os error").count(), 1, "the OS error is printed more than once: {e}");
}

/// Item 15: `k3 init` shows a progress bar on a terminal (run under `script`, a pty), and
/// prints no bar when stderr is not a terminal.
#[test]
fn init_progress_on_a_terminal_only() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("tty");
    let cmd = format!("{} init --config tiny --out {} --dtype f32", env!("CARGO_BIN_EXE_k3"), out.display());
    let o = Command::new("script").args(["-qec", &cmd, "/dev/null"]).env_remove("K3_MODEL_DIR").output();
    let Ok(o) = o else { panic!("`script` (util-linux) is needed to give k3 a terminal") };
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{tty}");
    assert!(tty.contains("k3 init") && tty.contains("B/"), "no progress bar on a terminal:\n{tty}");
    let plain = k3().args(["init", "--config", "tiny", "--dtype", "f32", "--out"]).arg(d.path().join("pipe")).output().unwrap();
    assert!(plain.status.success());
    assert!(String::from_utf8_lossy(&plain.stderr).trim().is_empty(), "{}", String::from_utf8_lossy(&plain.stderr));
}

/// Item 2: SIGTERM ends `k3 serve` within `--shutdown-timeout` even while a client holds a
/// half-sent request open.
#[test]
fn sigterm_exits_with_a_half_sent_request_open() {
    let mut child = k3()
        .args(["serve", "--port", "0", "--read-timeout", "600", "--shutdown-timeout", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn k3 serve");
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let url = loop {
        match lines.next() {
            Some(Ok(l)) => {
                if let Some(u) = l.split_whitespace().find(|w| w.starts_with("http://")) {
                    break u.trim_start_matches("http://").to_owned();
                }
            }
            _ => {
                let _ = child.kill();
                panic!("k3 serve did not print its address");
            }
        }
    };
    let mut s = std::net::TcpStream::connect(&url).expect("connect");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let st = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t0.elapsed() > Duration::from_secs(10) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("k3 serve was still running 10 s after SIGTERM");
    }
    drop(s);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

/// `--kv-cache-dtype` names the fix: it applies to the GPU, fp8 needs the bf16 precision, and an
/// unknown format lists the choices.
#[test]
fn kv_cache_dtype_is_checked() {
    let e = fails(k3().args(["run", "-n", "1", "--kv-cache-dtype", "fp8", "hi"]));
    assert!(e.contains("--kv-cache-dtype") && e.contains("--device cuda"), "{e}");
    let nano = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    let e = fails(k3().args(["logits", "--ids", "1,2", "--out", "/dev/null", "--kv-cache-dtype", "fp8", "--model"]).arg(&nano));
    assert!(e.contains("--kv-cache-dtype") && e.contains("--device cuda"), "{e}");
    let e = fails(k3().args(["run", "-n", "1", "--device", "cuda", "--precision", "f32", "--kv-cache-dtype", "fp8", "hi"]));
    assert!(e.contains("--kv-cache-dtype fp8") && e.contains("--precision bf16"), "{e}");
    let e = fails(k3().args(["run", "-n", "1", "--device", "cuda", "--kv-cache-dtype", "fp4", "hi"]));
    assert!(e.contains("fp4") && e.contains("bf16, fp8"), "{e}");
}
