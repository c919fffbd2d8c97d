//! `k3 serve`'s prefix-cache flags (issue 21): on by default and said so at start-up; off with
//! `--no-prefix-cache`; on for a parallel layout of ranks as threads too; a bad
//! `--prefix-cache-mem` or `--prefix-cache-grid` is an error naming the flag.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

fn k3() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_k3"));
    c.env_remove("K3_MODEL_DIR").env_remove("K3_TOKENIZER_DIR");
    c
}

/// Starts `k3 serve --port 0 ARGS` on k3-nano, waits for its address, stops it; returns stderr.
fn start_line(args: &[&str]) -> String {
    let mut child = k3().args(["serve", "--port", "0"]).args(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn k3 serve");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("listening on"), "{line}");
    child.kill().unwrap();
    let o = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn serve_says_whether_the_cache_is_on() {
    let on = start_line(&[]);
    assert!(on.contains("prefix cache on (grid 128 tokens, pool"), "{on}");
    let sized = start_line(&["--prefix-cache-mem", "64MiB", "--prefix-cache-grid", "64"]);
    assert!(sized.contains("prefix cache on (grid 64 tokens, pool 0.06 GiB)"), "{sized}");
    let off = start_line(&["--no-prefix-cache"]);
    assert!(off.contains("prefix cache off (--no-prefix-cache)"), "{off}");
    let tp = start_line(&["--tp", "2"]);
    assert!(tp.contains("prefix cache on (grid 128 tokens"), "ranks as threads capture their states too: {tp}");
}

#[test]
fn bad_values_name_their_flag() {
    for (args, flag) in [
        (["--prefix-cache-mem", "lots"], "--prefix-cache-mem"),
        (["--prefix-cache-mem", "3 parsecs"], "--prefix-cache-mem"),
        (["--prefix-cache-grid", "0"], "--prefix-cache-grid"),
    ] {
        let o = k3().args(["serve", "--port", "0"]).args(args).output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(flag), "{args:?}: {e}");
    }
}
