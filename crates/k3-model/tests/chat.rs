//! Cross-check of the shipped k3-chat model (`models/k3-chat`, or `$K3_CHAT_MODEL_DIR`): the Rust
//! engine must reproduce the PyTorch training code's f32 logits stored in
//! `crosscheck.safetensors` (made by `tools/k3chat/export.py` from the exported bf16 weights, in
//! f32 on CPU with the naive KDA recurrence). Each entry holds a chat prompt rendered as the
//! server renders it plus the model's greedy continuation (`ids_i`), and the logits at its last
//! positions only (`pos_i`, `logits_i`), which keeps the file small.

mod common;
use common::*;
use std::path::PathBuf;

fn chat_dir() -> PathBuf {
    match std::env::var_os("K3_CHAT_MODEL_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-chat"),
    }
}

#[test]
fn chat_crosscheck() {
    check_crosscheck(&chat_dir(), "k3-chat");
}
