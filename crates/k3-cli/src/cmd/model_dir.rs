//! Where `--model` points when it is not given: the embedded k3-nano model. It is looked up
//! (1) in `$K3_MODEL_DIR` (when set it must be a model directory: an error otherwise, not a
//! fall-back), (2) next to the executable (`<exe dir>/models/k3-nano`, then
//! `<exe dir>/../../models/k3-nano` for `target/{debug,release}/k3` inside a checkout), and (3) in
//! the source tree the binary was built from (`models/k3-nano` of this repository).

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

pub const NANO: &str = "models/k3-nano";

pub fn resolve_model_dir(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        return check_dir("--model", p);
    }
    // An explicit K3_MODEL_DIR is used or refused, never silently replaced by k3-nano.
    if let Some(d) = std::env::var_os("K3_MODEL_DIR").filter(|d| !d.is_empty()) {
        return check_dir("K3_MODEL_DIR", Path::new(&d));
    }
    let mut tried = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            tried.push(dir.join(NANO));
            tried.push(dir.join("../..").join(NANO));
        }
    }
    tried.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(NANO));
    for t in &tried {
        if t.join("config.json").is_file() {
            return Ok(t.clone());
        }
    }
    bail!(
        "no --model given and the embedded k3-nano model was not found (looked in: {}); pass --model DIR or set K3_MODEL_DIR",
        tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// `p` if it is a directory (the loader then names a missing `config.json`), else an error
/// naming `what` and `p`.
fn check_dir(what: &str, p: &Path) -> Result<PathBuf> {
    if !p.exists() {
        bail!("{what} {}: no such directory; give a model directory (config.json + safetensors)", p.display());
    }
    if !p.is_dir() {
        bail!("{what} {}: is a file, not a directory; give the model directory that holds config.json and the safetensors", p.display());
    }
    Ok(p.to_path_buf())
}
