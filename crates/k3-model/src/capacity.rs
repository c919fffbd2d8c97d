//! Will a layout fit? Per-rank memory of a parallel layout (`k3 inspect --tp/--ep/--pp
//! --gpu-mem`), from the same weight table and plan the loaders use.
//!
//! Per rank: the weight bytes it holds as served (BF16 floats, the F32 tensors the release
//! keeps F32, MXFP4 experts as shipped: [`shipped_bytes`] of each tensor's shard, see
//! `parallel.rs`), a fixed reserve for the CUDA context, cuBLAS workspaces and the activations
//! of a prefill chunk, and what is left for the per-sequence state: the MLA latents and DSA
//! indexer keys of the stage's attention layers (replicated on every tensor-parallel rank) per
//! token, and the KDA recurrent states and conv tails of the rank's heads per sequence.

use serde::Serialize;

use k3_core::fp8::{KeyFp8, LatentFp8};

use crate::config::{Config, Mixer, RawTextConfig as TextConfig};
use crate::inspect::{cache_bytes_per_token, kda_state_bytes, shipped_bytes};
use crate::parallel::Parallel;
use crate::weights::tensor_table;

/// Bytes per GiB.
pub const GIB: f64 = (1u64 << 30) as f64;

/// The two context lengths the report counts sequences at.
pub const CONTEXTS: [u64; 2] = [131_072, 1_048_576];

/// The cache layout the planner assumes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    /// 2 bytes per latent / indexer-key value.
    #[default]
    Bf16,
    /// vLLM's `fp8_ds_mla` (656 B per token per layer) and FP8 indexer key (132 B); the
    /// layouts are `k3_core::fp8`'s.
    Fp8,
}

impl KvDtype {
    /// Bytes per token of one MLA/DSA layer's latent cache and of one DSA layer's indexer-key
    /// cache (0 without `dsa_config`).
    pub fn bytes_per_token(self, t: &TextConfig) -> (u64, u64) {
        let (r, dr) = (t.kv_lora_rank, t.qk_rope_head_dim);
        let id = t.dsa_config.as_ref().map_or(0, |d| d.index_head_dim);
        match self {
            KvDtype::Bf16 => (2 * (r + dr) as u64, 2 * id as u64),
            KvDtype::Fp8 => {
                let key = if id == 0 { 0 } else { KeyFp8 { id }.row_bytes() };
                (LatentFp8 { r, dr }.row_bytes() as u64, key as u64)
            }
        }
    }

    /// The `--kv-cache-dtype` value.
    pub fn parse(s: &str) -> Option<KvDtype> {
        match s {
            "bf16" | "auto" => Some(KvDtype::Bf16),
            "fp8" | "fp8_ds_mla" => Some(KvDtype::Fp8),
            _ => None,
        }
    }
}

/// One rank's memory.
#[derive(Clone, Debug, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub stage: usize,
    /// Global decoder layers `[first, end)`.
    pub layers: [usize; 2],
    pub weight_bytes: u64,
    /// GPU memory less weights and reserve (negative: the weights alone do not fit).
    pub free_bytes: i64,
    /// Latent + indexer-key cache bytes per token of one sequence, for this rank's layers.
    pub cache_bytes_per_token: u64,
    /// KDA recurrent state (f32) + conv tails (bf16) per sequence, for this rank's heads.
    pub kda_state_bytes_per_sequence: u64,
    /// Tokens of cache that fit in `free_bytes` (no KDA state counted).
    pub cache_tokens: u64,
    /// Sequences of 128K and of 1M tokens that fit (cache and KDA state).
    pub sequences_128k: u64,
    pub sequences_1m: u64,
}

/// The whole layout's answer.
#[derive(Clone, Debug, Serialize)]
pub struct Capacity {
    pub layout: Parallel,
    pub world: usize,
    pub gpu_mem_bytes: u64,
    pub reserve_bytes: u64,
    pub kv_cache_dtype: KvDtype,
    pub ranks: Vec<RankMemory>,
    /// The rank with the most weight bytes.
    pub max_weight_bytes: u64,
    /// Every rank holds its weights and at least one 128K-token sequence.
    pub fits: bool,
    pub reason: String,
}

/// Per-rank memory of `par` for `cfg` on GPUs of `gpu_mem` bytes, keeping `reserve` bytes aside.
pub fn capacity(cfg: &Config, par: Parallel, gpu_mem: u64, reserve: u64, kv: KvDtype) -> crate::Result<Capacity> {
    let table = tensor_table(cfg);
    let plans = par.plans(cfg)?;
    let t = &cfg.text;
    let (mla_tok, dsa_tok) = kv.bytes_per_token(t);
    let mut ranks = Vec::with_capacity(plans.len());
    for p in &plans {
        let weight_bytes: u64 = table.iter().map(|s| p.shard_bytes(s, shipped_bytes(s))).sum();
        let mine = &cfg.layers[p.layers.clone()];
        let cache_bytes_per_token = cache_bytes_per_token(mine, mla_tok, dsa_tok);
        let kda = mine.iter().filter(|l| l.mixer == Mixer::Kda).count();
        let (rec, conv) = kda_state_bytes(cfg, p.tp_share(t.linear_attn_config.num_heads).len(), kda);
        let kda_state = rec + conv;
        let free = gpu_mem as i64 - weight_bytes as i64 - reserve as i64;
        let room = free.max(0) as u64;
        let seqs = |ctx: u64| room.checked_div(ctx * cache_bytes_per_token + kda_state).unwrap_or(u64::MAX);
        ranks.push(RankMemory {
            rank: p.rank,
            stage: p.stage,
            layers: [p.layers.start, p.layers.end],
            weight_bytes,
            free_bytes: free,
            cache_bytes_per_token,
            kda_state_bytes_per_sequence: kda_state,
            cache_tokens: room.checked_div(cache_bytes_per_token).unwrap_or(u64::MAX),
            sequences_128k: seqs(CONTEXTS[0]),
            sequences_1m: seqs(CONTEXTS[1]),
        });
    }
    let max_weight_bytes = ranks.iter().map(|r| r.weight_bytes).max().unwrap_or(0);
    let gib = |b: f64| b / GIB;
    let worst_free = ranks.iter().min_by_key(|r| r.free_bytes).expect("a world has a rank");
    let worst_seq = ranks.iter().min_by_key(|r| r.sequences_128k).expect("a world has a rank");
    let (fits, reason) = if worst_free.free_bytes < 0 {
        let r = worst_free;
        (
            false,
            format!(
                "rank {} (stage {}) holds {:.1} GiB of weights; with the {:.1} GiB reserve that is {:.1} GiB more than --gpu-mem {:.1} GiB",
                r.rank,
                r.stage,
                gib(r.weight_bytes as f64),
                gib(reserve as f64),
                gib(-r.free_bytes as f64),
                gib(gpu_mem as f64)
            ),
        )
    } else if worst_seq.sequences_128k == 0 {
        let r = worst_seq;
        (
            false,
            format!(
                "rank {} (stage {}) has {:.1} GiB left after its weights and the reserve, less than one 128K-token sequence needs",
                r.rank,
                r.stage,
                gib(r.free_bytes as f64)
            ),
        )
    } else {
        let s1m = ranks.iter().map(|r| r.sequences_1m).min().unwrap_or(0);
        (
            true,
            format!(
                "every rank holds its weights (at most {:.1} GiB) with at least {:.1} GiB left: {} sequences of 128K tokens, or {s1m} of 1M",
                gib(max_weight_bytes as f64),
                gib(worst_free.free_bytes as f64),
                worst_seq.sequences_128k
            ),
        )
    };
    Ok(Capacity { layout: par, world: par.world(), gpu_mem_bytes: gpu_mem, reserve_bytes: reserve, kv_cache_dtype: kv, ranks, max_weight_bytes, fits, reason })
}
