//! Cross-check of the shipped k3-nano model (`models/k3-nano`): the Rust engine must reproduce
//! the PyTorch training code's f32 logits stored in `crosscheck.safetensors` (made by
//! `tools/k3nano/export.py` from the exported bf16 weights, computed in f32 on CPU with the
//! naive KDA recurrence). This proves the two implementations agree on real trained weights.

mod common;
use common::*;
use std::path::PathBuf;

fn nano_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano")
}

#[test]
fn nano_crosscheck() {
    check_crosscheck(&nano_dir(), "k3-nano");
}
