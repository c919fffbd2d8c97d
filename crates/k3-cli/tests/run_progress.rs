//! `k3 run` shows a prefill progress bar for a long prompt on a terminal, and nothing extra
//! when stderr is not one (issue 28, item 15).

use std::process::Command;

#[test]
fn prefill_progress_on_a_terminal_only() {
    let ids: Vec<String> = (0..400).map(|i| ((i * 37 + 5) % 4000).to_string()).collect();
    let ids = ids.join(",");
    let bin = env!("CARGO_BIN_EXE_k3");
    let cmd = format!("{bin} run --ids {ids} --prefill-chunk 2 --max-tokens 2 --temperature 0");
    let o = Command::new("script").args(["-qec", &cmd, "/dev/null"]).env_remove("K3_MODEL_DIR").output();
    let Ok(o) = o else { panic!("`script` (util-linux) is needed to give k3 a terminal") };
    let tty = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{tty}");
    // The bar moves: some drawn position between 0 and 400.
    let moved = tty.match_indices("/400 tokens").any(|(i, _)| {
        let n: String = tty[..i].chars().rev().take_while(char::is_ascii_digit).collect::<Vec<_>>().into_iter().rev().collect();
        n.parse::<u32>().is_ok_and(|n| n > 0)
    });
    assert!(tty.contains("prefill") && moved, "no moving prefill bar on a terminal:\n{tty}");
    let plain = Command::new(bin)
        .args(["run", "--ids", &ids, "--prefill-chunk", "2", "--max-tokens", "2", "--temperature", "0"])
        .env_remove("K3_MODEL_DIR")
        .output()
        .unwrap();
    assert!(plain.status.success());
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(!err.contains("tokens ETA") && !err.contains("loading"), "progress output without a terminal: {err}");
    assert!(err.contains("400 prompt tokens"), "{err}");
}
