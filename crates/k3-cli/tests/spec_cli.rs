//! `k3 run --speculative ngram|suffix|mtp|off` (issue 22): on the embedded k3-nano the greedy
//! ids equal plain decoding's (on one rank and on `--tp 2`, ranks as threads), `--json` reports
//! `accepted_per_step`, `draft_acceptance` and the acceptance per position, and bad values are
//! errors naming their flag; `mtp` drafts on a `k3 init` checkpoint with an MTP layer and says
//! why not on k3-nano; `draft --draft-model DIR` drafts with a separate model (k3-nano as its
//! own draft accepts every draft; a `k3 init` draft of k3-nano's vocabulary keeps the ids), and
//! a missing or mismatched draft model is an error naming `--draft-model`.

use std::process::{Command, Output};

use serde_json::Value;

fn k3(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_k3")).args(args).output().expect("run k3")
}

fn nano() -> String {
    format!("{}/../../models/k3-nano", env!("CARGO_MANIFEST_DIR"))
}

fn run_json(method: &str, extra: &[&str]) -> Value {
    let nano = nano();
    let mut args = vec!["run", "--model", &nano, "--temperature", "0", "-n", "40", "--json", "--speculative", method, "--num-speculative-tokens", "5"];
    args.extend_from_slice(extra);
    args.push("KING EDWARD.\nI know not what I think");
    let o = k3(&args);
    assert!(o.status.success(), "k3 {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn greedy_ids_equal_plain_and_json_reports_acceptance() {
    let plain = run_json("off", &[]);
    assert_eq!(plain["accepted_per_step"], 1.0);
    assert!(plain["draft_acceptance"].is_null());
    for m in ["ngram", "suffix"] {
        let v = run_json(m, &[]);
        assert_eq!(v["ids"], plain["ids"], "{m}: ids differ from plain greedy decoding");
        assert_eq!(v["speculating"], true);
        let aps = v["accepted_per_step"].as_f64().unwrap();
        assert!(aps >= 1.0, "{m}: {aps}");
        let per = v["acceptance_per_position"].as_array().unwrap();
        assert!(per.len() <= 5);
        if v["drafted_tokens"].as_u64().unwrap() > 0 {
            let a = v["draft_acceptance"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&a));
        }
    }
}

/// Ranks as threads (`--tp 2`): every rank verifies its shard; the ids equal plain greedy
/// decoding's on the same layout.
#[test]
fn speculates_on_a_parallel_layout() {
    let plain = run_json("off", &["--tp", "2"]);
    let v = run_json("ngram", &["--tp", "2"]);
    assert_eq!(v["speculating"], true, "{v}");
    assert!(v["drafted_tokens"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["ids"], plain["ids"], "--tp 2: ids differ from plain greedy decoding");
}

#[test]
fn bad_values_name_the_flag() {
    let nano = nano();
    for (args, flag) in
        [(vec!["--speculative", "bogus"], "--speculative"), (vec!["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens")]
    {
        let mut a = vec!["run", "--model", &nano, "-n", "2"];
        a.extend(args);
        a.push("hi");
        let o = k3(&a);
        assert!(!o.status.success());
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(flag), "{a:?}: {e}");
    }
}

/// `--speculative mtp`: on a `k3 init` checkpoint with an MTP layer (`--set
/// num_nextn_predict_layers=1`) it drafts and keeps plain greedy decoding's ids; on k3-nano,
/// which has none, a note names `num_nextn_predict_layers` and decoding stays plain.
#[test]
fn mtp_drafts_where_the_checkpoint_has_the_layer() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    let m = m.to_str().unwrap();
    let o = k3(&["init", "--config", "tiny", "--dtype", "f32", "--set", "num_nextn_predict_layers=1", "--out", m]);
    assert!(o.status.success(), "k3 init: {}", String::from_utf8_lossy(&o.stderr));
    let run = |model: &str, method: &str, ids: &str| {
        let args = ["run", "--model", model, "--temperature", "0", "-n", "12", "--json", "--speculative", method, "--ids", ids];
        let o = k3(&args);
        assert!(o.status.success(), "k3 {args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
        (serde_json::from_slice::<Value>(&o.stdout).unwrap(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (plain, _) = run(m, "off", "5,9,12,3,5,9");
    let (v, _) = run(m, "mtp", "5,9,12,3,5,9");
    assert_eq!(v["speculating"], true);
    assert!(v["drafted_tokens"].as_u64().unwrap() > 0);
    assert_eq!(v["ids"], plain["ids"]);
    let (v, note) = run(&nano(), "mtp", "5,9,12");
    assert_eq!(v["speculating"], false);
    assert!(note.contains("num_nextn_predict_layers"), "{note}");
}

/// `--speculative draft --draft-model DIR`: k3-nano as its own draft accepts every greedy draft
/// (k + 1 tokens per step but for the last), a random `k3 init` draft of k3-nano's vocabulary
/// still gives plain greedy decoding's ids; the flags must come together, and a draft of another
/// vocabulary is refused naming both vocab sizes.
#[test]
fn draft_model_drafts_and_bad_flags_are_named() {
    let nano = nano();
    let plain = run_json("off", &[]);
    let v = run_json("draft", &["--draft-model", &nano]);
    assert_eq!(v["speculating"], true, "{v}");
    assert_eq!(v["ids"], plain["ids"], "self-draft: ids differ from plain greedy decoding");
    assert_eq!(v["draft_acceptance"], 1.0, "{v}");
    let aps = v["accepted_per_step"].as_f64().unwrap();
    assert!(aps > 5.0, "k = 5, every draft accepted: {aps}");
    let d = tempfile::tempdir().unwrap();
    let same = d.path().join("same");
    let other = d.path().join("other");
    for (dir, vocab) in [(&same, "4352"), (&other, "256")] {
        let o = k3(&["init", "--config", "tiny", "--dtype", "f32", "--set", &format!("vocab_size={vocab}"), "--out", dir.to_str().unwrap()]);
        assert!(o.status.success(), "k3 init: {}", String::from_utf8_lossy(&o.stderr));
    }
    let v = run_json("draft", &["--draft-model", same.to_str().unwrap()]);
    assert_eq!(v["speculating"], true, "{v}");
    assert!(v["drafted_tokens"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["ids"], plain["ids"], "a random draft model: ids differ from plain greedy decoding");
    let bad: [(Vec<&str>, &[&str]); 3] = [
        (vec!["--speculative", "draft"], &["--draft-model"]),
        (vec!["--speculative", "ngram", "--draft-model", &nano], &["--draft-model", "--speculative draft"]),
        (vec!["--speculative", "draft", "--draft-model", other.to_str().unwrap()], &["--draft-model", "vocab_size is 256", "is 4352"]),
    ];
    for (args, says) in bad {
        let mut a = vec!["run", "--model", &nano, "-n", "2"];
        a.extend(&args);
        a.push("hi");
        let o = k3(&a);
        assert!(!o.status.success(), "{a:?} succeeded");
        let e = String::from_utf8_lossy(&o.stderr);
        for s in says {
            assert!(e.contains(s), "{a:?}: {e}");
        }
    }
}
