//! Shared helpers for the golden tests: the golden data (`tests/golden/` or `$K3_GOLDEN_DIR`,
//! through the workspace's `tests/support/golden.rs`) and loading the tokenizer.
#![allow(dead_code)]

use k3_tokenizer::Tokenizer;

#[path = "../../../../tests/support/golden.rs"]
mod golden;
pub use golden::*;

pub fn load_json(rel: &str) -> serde_json::Value {
    let path = golden_path(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn tokenizer() -> Tokenizer {
    let dir = golden_path("tokenizer");
    Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("{e}"))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Like [`load_json`] but keeps object key order.
pub fn load_ordered(rel: &str) -> k3_tokenizer::json::Json {
    let path = golden_path(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
