//! Where `--model` points when it is not given: an embedded model. `k3 serve` (a chat server)
//! defaults to the chat model k3-chat, and to k3-nano where k3-chat is not found; `k3 run` and
//! `k3 bench` (plain text continuation) default to k3-nano. The model is looked up (1) in
//! `$K3_MODEL_DIR` (when set it must be a model directory: an error otherwise, not a
//! fall-back), (2) next to the executable (`<exe dir>/models/NAME`, then
//! `<exe dir>/../../models/NAME` for `target/{debug,release}/k3` inside a checkout), and (3) in
//! the source tree the binary was built from (`models/NAME` of this repository), for each
//! candidate NAME in turn.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

pub const NANO: &str = "models/k3-nano";
pub const CHAT: &str = "models/k3-chat";

/// What the default model is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Use {
    /// Plain text continuation (`k3 run`, `k3 bench`): k3-nano.
    Text,
    /// Chat (`k3 serve`): k3-chat, else k3-nano.
    Chat,
}

pub fn resolve_model_dir(given: Option<&Path>) -> Result<PathBuf> {
    resolve_model_dir_for(given, Use::Text)
}

pub fn resolve_model_dir_for(given: Option<&Path>, what: Use) -> Result<PathBuf> {
    if let Some(p) = given {
        return check_dir("--model", p);
    }
    // An explicit K3_MODEL_DIR is used or refused, never silently replaced by k3-nano.
    if let Some(d) = std::env::var_os("K3_MODEL_DIR").filter(|d| !d.is_empty()) {
        return check_dir("K3_MODEL_DIR", Path::new(&d));
    }
    let names: &[&str] = match what {
        Use::Text => &[NANO],
        Use::Chat => &[CHAT, NANO],
    };
    let mut tried = Vec::new();
    for name in names {
        if let Ok(exe) = std::env::current_exe() {
            if let Some(dir) = exe.parent() {
                tried.push(dir.join(name));
                tried.push(dir.join("../..").join(name));
            }
        }
        tried.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(name));
    }
    for t in &tried {
        if t.join("config.json").is_file() {
            return Ok(t.clone());
        }
    }
    bail!(
        "no --model given and no embedded model was found (looked in: {}); pass --model DIR or set K3_MODEL_DIR",
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
