//! Where the tests find their golden data — one file shared by every crate's tests (each
//! includes it with `#[path = ".../tests/support/golden.rs"] mod golden;`).
//!
//! The default is the repository's own `tests/golden/`, a verbatim subset of Moonshot's
//! `shared/golden` (see `tests/golden/README.md`): the tokenizer and chat cases, the manifest,
//! the `k3_small_mxfp4` model fixture and `shared/spec/k3-configs.json`, so a fresh clone tests
//! itself. `K3_GOLDEN_DIR=/path/to/shared/golden` points every lookup at a complete copy instead
//! (nothing else is read beside it). The fixtures the repository does not carry
//! (`k3_small_f32`, `k31_small_dsa_f32`, `vision_small_f32`) are used only by tests marked
//! `#[ignore = "full golden set ..."]`, run by `K3_GOLDEN_DIR=... cargo test -- --ignored`
//! (`.ci/run` does so); they fail, never pass, when their data is missing.
#![allow(dead_code)]

use std::path::PathBuf;

/// What `tests/golden/` carries (everything else needs `K3_GOLDEN_DIR`).
pub const IN_REPO: &[&str] =
    &["manifest.json", "k3-configs.json", "tokenizer", "chat", "k3_small_mxfp4", "vision_small_f32 (configs, meta.json and PNGs only)"];

/// The repository's `tests/golden/`.
pub fn repo_golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden")
}

/// `$K3_GOLDEN_DIR` when set (a complete copy of `shared/golden`), else [`repo_golden`].
pub fn golden_dir() -> PathBuf {
    match std::env::var_os("K3_GOLDEN_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => repo_golden(),
    }
}

/// `rel` inside [`golden_dir`]; panics with where it looked and what to do when it is absent.
pub fn golden_path(rel: &str) -> PathBuf {
    let p = golden_dir().join(rel);
    if !p.exists() {
        let why = match std::env::var_os("K3_GOLDEN_DIR") {
            Some(d) if !d.is_empty() => {
                format!("K3_GOLDEN_DIR is {} but it holds no `{rel}`: point it at a complete copy of shared/golden", PathBuf::from(d).display())
            }
            _ => format!(
                "the repository's tests/golden carries only {IN_REPO:?}; this test needs the full golden set: \
                 K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"
            ),
        };
        panic!("golden data {} not found: {why}", p.display());
    }
    p
}

/// A golden fixture directory (e.g. `k3_small_mxfp4`).
pub fn fixture(name: &str) -> PathBuf {
    let d = golden_path(name);
    assert!(d.is_dir(), "golden fixture {} is not a directory", d.display());
    d
}

/// `shared/spec/k3-configs.json`, as copied into `tests/golden/` (always the repository's copy;
/// `.ci/run` checks it against `shared/spec` when that is present).
pub fn spec_configs_path() -> PathBuf {
    repo_golden().join("k3-configs.json")
}
