//! The random K3-layout checkpoints the GPU suites of k3-model and k3-engine share
//! (`cuda_verify.rs`, `cuda_prefix.rs`, `cuda_spec.rs`): KDA head dim 32 (the GPU's smallest)
//! and every token routed to every one of 4 experts, which makes the GPU forward run-to-run
//! deterministic (measured), BF16 weights and experts.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};

use k3_model::config::builtin_config;
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::Checkpoint;
use serde_json::json;

/// A random checkpoint from builtin config `base` under a new directory of `dir`, made with
/// `seed`; `set`: more `config.json` overrides.
pub fn random(dir: &std::path::Path, base: &str, seed: u64, set: &[(&str, serde_json::Value)]) -> Checkpoint {
    static N: AtomicUsize = AtomicUsize::new(0);
    let mut all = vec![("linear_attn_config.head_dim", json!(32)), ("num_experts", json!(4)), ("num_experts_per_token", json!(4))];
    all.extend(set.iter().cloned());
    let ov = Overrides { set: all.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(), ..Default::default() };
    write(&dir.join(format!("{base}-{}", N.fetch_add(1, Ordering::Relaxed))), base, seed, &ov)
}

/// `k3 init` of builtin config `base` with `ov` into `d` (BF16 weights and experts), opened.
fn write(d: &std::path::Path, base: &str, seed: u64, ov: &Overrides) -> Checkpoint {
    let o = InitOptions { seed, dtype: FloatDType::BF16, experts: ExpertFormat::Float(FloatDType::BF16), shard_size: None };
    init(builtin_config(base).unwrap(), ov, d, &o).unwrap();
    Checkpoint::open(d).unwrap()
}

/// A random checkpoint at K3's real widths (builtin `k3`: hidden 7168, KDA head dim 128, MLA)
/// cut to `layers` layers (the last one MLA, as K3's last), every layer MoE with 4 BF16 experts,
/// every token routed to all 4 (no top-k flip between runs), a vocabulary of 32768; ~4–5 GB.
pub fn real_width(dir: &std::path::Path, seed: u64, layers: usize) -> Checkpoint {
    let set = [("num_experts_per_token", json!(4)), ("first_k_dense_replace", json!(0)), ("vocab_size", json!(32768))];
    let ov = Overrides { num_hidden_layers: Some(layers), num_experts: Some(4), set: set.iter().map(|(k, v)| (k.to_string(), v.clone())).collect() };
    write(&dir.join(format!("k3-real-{layers}")), "k3", seed, &ov)
}
