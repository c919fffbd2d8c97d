//! `k3 inspect`: the facts of a config (and optionally an opened checkpoint) as one
//! serialisable [`Report`] — text-backbone §1–§2 (schedule), §3.8 (KDA state), §5.2/§5.8 (DSA
//! indexer, caches), §9 (dtypes); around-backbone §1.4–§1.5 (tensors, F32 list, byte totals) and
//! §2.1–§2.4 (MXFP4 at 4.25 bits/weight, vLLM's FP8 cache layouts).
//!
//! Everything is derived from [`weights::tensor_table`], so names, shapes and counts live in
//! one place. Conventions:
//! - **Active parameters** are what one text token touches: every tensor except the embedding
//!   table (a row lookup), the vision tower and projector (image tokens only), and only
//!   `num_experts_per_token / num_experts` of the routed experts. This is the convention of the
//!   published 104.2B figure.
//! - **Disk bytes as shipped**: BF16 for every float tensor, F32 for the tensors the release keeps
//!   F32 ([`Kind::Float32`]: conv weights, `A_log`, `dt_bias`, `o_norm`, router bias), routed
//!   experts as the config says (MXFP4 `weight_packed` + `weight_scale`, i.e. 4.25 bits/weight),
//!   and `A_log` zero-padded to a multiple of 128 entries as the release stores it ([128] for 96
//!   heads). For the K3 config plus its `vision_config` this reproduces the release's
//!   1,560,860,324,864 bytes exactly.
//! - **Caches**: MLA latent `kv_lora_rank + qk_rope_head_dim` values per token per full-attention
//!   layer, plus `index_head_dim` indexer-key values per DSA layer (K3.1). BF16 = 2 bytes per
//!   value; FP8 = vLLM's `fp8_ds_mla` (656 B) + indexer (132 B) layouts.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::capacity::KvDtype;
use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn, LayerSpec, Mixer};
use crate::weights::{self, Component, Kind, TensorSpec};

/// One run of consecutive layers of the same kind.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Run {
    pub first: usize,
    pub last: usize,
    pub mixer: Mixer,
    pub ffn: Ffn,
}

/// One tensor of an example layer (name relative to `language_model.model.layers.{l}.`).
#[derive(Clone, Debug, Serialize)]
pub struct WeightShape {
    pub name: String,
    pub shape: Vec<usize>,
    /// Dtype as shipped: `BF16`, `F32` or `U8` (MXFP4).
    pub dtype: &'static str,
}

/// The weights of the first layer of one (mixer, ffn) kind.
#[derive(Clone, Debug, Serialize)]
pub struct LayerKind {
    pub mixer: Mixer,
    pub ffn: Ffn,
    /// How many layers have this kind.
    pub count: usize,
    pub example_layer: usize,
    /// Routed experts are listed once, as `experts.{e}.…`, for `num_experts` experts.
    pub weights: Vec<WeightShape>,
}

/// Parameters of one component.
#[derive(Clone, Debug, Serialize)]
pub struct ComponentParams {
    pub component: Component,
    pub total: u64,
    pub active: u64,
    pub disk_bytes: u64,
}

/// What an opened checkpoint directory holds.
#[derive(Clone, Debug, Serialize)]
pub struct CheckpointFacts {
    pub dir: String,
    pub files: usize,
    pub tensors: usize,
    /// Size of the weight files (headers included).
    pub file_bytes: u64,
    /// Bytes of tensor data, by dtype (`BF16`, `F32`, `U8`, ...).
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// Resident memory of this process after opening (VmRSS); far below `file_bytes` because
    /// the weights are memory-mapped, not copied.
    pub resident_bytes: Option<u64>,
    /// Seconds for `Checkpoint::open` and `Model::load`, and the peak resident memory (VmHWM)
    /// afterwards — filled in by `k3 inspect --load`.
    pub open_seconds: Option<f64>,
    pub load_seconds: Option<f64>,
    pub peak_resident_bytes: Option<u64>,
    /// Resident memory split: anonymous (heap: copies, decoded data) vs file-backed (touched
    /// pages of the memory-mapped weights), from `RssAnon` / `RssFile`.
    pub resident_anon_bytes: Option<u64>,
    pub resident_file_bytes: Option<u64>,
    /// `None` when the checkpoint matches the config's tensor table, else the first problem.
    pub check_error: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub num_hidden_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub dsa: bool,
    pub experts_mxfp4: bool,
    pub kda_layers: usize,
    pub mla_layers: usize,
    pub dsa_layers: usize,
    pub dense_ffn_layers: usize,
    pub moe_layers: usize,
    /// MTP draft layers (`num_nextn_predict_layers`), each `(checkpoint layer index, FFN)`:
    /// gated MLA + that FFN with a plain residual (around-backbone §5.1).
    pub mtp_layers: Vec<(usize, Ffn)>,
    pub attn_res_block_size: usize,
    /// 0-based layers where an AttnRes block starts.
    pub attn_res_block_starts: Vec<usize>,
    pub schedule: Vec<Run>,
    pub layers: Vec<LayerSpec>,
    pub layer_kinds: Vec<LayerKind>,
    pub params: Vec<ComponentParams>,
    pub total_params: u64,
    pub active_params: u64,
    pub tensor_count: usize,
    pub disk_bytes: u64,
    pub disk_bytes_by_dtype: BTreeMap<String, u64>,
    pub max_position_embeddings: usize,
    /// Values per token per full-attention layer (`kv_lora_rank + qk_rope_head_dim`).
    pub mla_latent_values_per_token_per_layer: usize,
    pub mla_bytes_per_token_per_layer_bf16: u64,
    /// Indexer-key values per token per DSA layer (`index_head_dim`; 0 without DSA).
    pub indexer_key_values_per_token_per_layer: usize,
    pub indexer_bytes_per_token_per_layer_bf16: u64,
    /// All layers: MLA latents + indexer keys, BF16.
    pub kv_bytes_per_token_bf16: u64,
    /// All layers: 656 B MLA + 132 B indexer per token per layer (vLLM FP8 layouts).
    pub kv_bytes_per_token_fp8: u64,
    pub kv_bytes_at_max_context_bf16: u64,
    pub kv_bytes_at_max_context_fp8: u64,
    /// KDA recurrent state, `num_heads × head_dim × head_dim` f32 per KDA layer.
    pub kda_recurrent_state_bytes_per_sequence: u64,
    /// KDA short-conv tails, `3 × num_heads·head_dim × (kernel − 1)` bf16 per KDA layer.
    pub kda_conv_state_bytes_per_sequence: u64,
    /// Recurrent + conv state.
    pub kda_state_bytes_per_sequence: u64,
    pub checkpoint: Option<CheckpointFacts>,
}

/// Bytes a tensor takes as shipped (see the module note).
pub fn shipped_bytes(spec: &TensorSpec) -> u64 {
    let n: u64 = spec.shape.iter().map(|&d| d as u64).product();
    match spec.kind {
        Kind::Float => 2 * n,
        Kind::Float32 if spec.name.ends_with("self_attn.A_log") => 4 * n.next_multiple_of(128),
        Kind::Float32 => 4 * n,
        Kind::Mxfp4Packed | Kind::Mxfp4Scale => n,
    }
}

/// Cache bytes per token of one sequence over `layers`: `mla` per full-attention layer plus
/// `indexer` more per DSA layer (KDA layers keep a fixed-size state instead).
pub fn cache_bytes_per_token(layers: &[LayerSpec], mla: u64, indexer: u64) -> u64 {
    layers
        .iter()
        .map(|l| match l.mixer {
            Mixer::Kda => 0,
            Mixer::Mla => mla,
            Mixer::Dsa => mla + indexer,
        })
        .sum()
}

/// KDA state bytes per sequence of `layers` KDA layers holding `heads` heads each:
/// `(recurrent state in f32, short-conv tails of q, k, v in bf16)`.
pub fn kda_state_bytes(cfg: &Config, heads: usize, layers: usize) -> (u64, u64) {
    let la = &cfg.text.linear_attn_config;
    let (h, hd, k1) = (heads as u64, la.head_dim as u64, la.short_conv_kernel_size.saturating_sub(1) as u64);
    (layers as u64 * h * hd * hd * 4, layers as u64 * 3 * h * hd * k1 * 2)
}

/// Dtype name as shipped.
pub fn shipped_dtype(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "BF16",
        Kind::Float32 => "F32",
        Kind::Mxfp4Packed | Kind::Mxfp4Scale => "U8",
    }
}

/// Compressed schedule: maximal runs of layers with the same mixer and FFN.
pub fn runs(layers: &[LayerSpec]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for l in layers {
        match out.last_mut() {
            Some(r) if r.mixer == l.mixer && r.ffn == l.ffn && r.last + 1 == l.index => r.last = l.index,
            _ => out.push(Run { first: l.index, last: l.index, mixer: l.mixer, ffn: l.ffn }),
        }
    }
    out
}

/// The report for a config alone.
pub fn report(cfg: &Config) -> Report {
    let t = &cfg.text;
    let table = weights::tensor_table(cfg);
    let count = |f: &dyn Fn(&LayerSpec) -> bool| cfg.layers.iter().filter(|l| f(l)).count();
    let (kda, mla, dsa) = (count(&|l| l.mixer == Mixer::Kda), count(&|l| l.mixer == Mixer::Mla), count(&|l| l.mixer == Mixer::Dsa));
    let dense = count(&|l| l.ffn == Ffn::Dense);

    let mut by_comp: BTreeMap<Component, ComponentParams> = BTreeMap::new();
    let mut disk_by_dtype: BTreeMap<String, u64> = BTreeMap::new();
    for s in &table {
        let e = by_comp.entry(s.component).or_insert(ComponentParams { component: s.component, total: 0, active: 0, disk_bytes: 0 });
        e.total += s.params();
        e.disk_bytes += shipped_bytes(s);
        *disk_by_dtype.entry(shipped_dtype(s.kind).to_string()).or_insert(0) += shipped_bytes(s);
    }
    // Active counts per component (routed experts summed first, then scaled, to stay exact).
    for c in by_comp.values_mut() {
        c.active = match c.component {
            // The MTP draft layers are not part of the target's forward.
            Component::Embedding | Component::VisionTower | Component::MmProjector | Component::Mtp => 0,
            Component::RoutedExperts => c.total * t.num_experts_per_token as u64 / t.num_experts as u64,
            _ => c.total,
        };
    }

    let layer_kinds = layer_kinds(cfg, &table);
    let lat = t.kv_lora_rank + t.qk_rope_head_dim;
    let idx = t.dsa_config.as_ref().map_or(0, |d| d.index_head_dim);
    let (b16, k16) = KvDtype::Bf16.bytes_per_token(t);
    let kv_bf16 = cache_bytes_per_token(&cfg.layers, b16, k16);
    let (b8, k8) = KvDtype::Fp8.bytes_per_token(t);
    let kv_fp8 = cache_bytes_per_token(&cfg.layers, b8, k8);
    let ctx = cfg.max_context() as u64;
    let (rec, conv) = kda_state_bytes(cfg, t.linear_attn_config.num_heads, kda);

    Report {
        num_hidden_layers: t.num_hidden_layers,
        hidden_size: t.hidden_size,
        vocab_size: t.vocab_size,
        dsa: cfg.is_dsa(),
        experts_mxfp4: cfg.experts_mxfp4(),
        kda_layers: kda,
        mla_layers: mla,
        dsa_layers: dsa,
        dense_ffn_layers: dense,
        moe_layers: cfg.layers.len() - dense,
        mtp_layers: (0..cfg.mtp_layers()).map(|k| cfg.mtp_layer(k)).map(|l| (l.index, l.ffn)).collect(),
        attn_res_block_size: t.attn_res_block_size,
        attn_res_block_starts: cfg.layers.iter().filter(|l| l.attn_res_block_start).map(|l| l.index).collect(),
        schedule: runs(&cfg.layers),
        layers: cfg.layers.clone(),
        layer_kinds,
        total_params: by_comp.values().map(|c| c.total).sum(),
        active_params: by_comp.values().map(|c| c.active).sum(),
        params: by_comp.into_values().collect(),
        tensor_count: table.len(),
        disk_bytes: disk_by_dtype.values().sum(),
        disk_bytes_by_dtype: disk_by_dtype,
        max_position_embeddings: cfg.max_context(),
        mla_latent_values_per_token_per_layer: lat,
        mla_bytes_per_token_per_layer_bf16: 2 * lat as u64,
        indexer_key_values_per_token_per_layer: idx,
        indexer_bytes_per_token_per_layer_bf16: 2 * idx as u64,
        kv_bytes_per_token_bf16: kv_bf16,
        kv_bytes_per_token_fp8: kv_fp8,
        kv_bytes_at_max_context_bf16: kv_bf16 * ctx,
        kv_bytes_at_max_context_fp8: kv_fp8 * ctx,
        kda_recurrent_state_bytes_per_sequence: rec,
        kda_conv_state_bytes_per_sequence: conv,
        kda_state_bytes_per_sequence: rec + conv,
        checkpoint: None,
    }
}

fn layer_kinds(cfg: &Config, table: &[TensorSpec]) -> Vec<LayerKind> {
    let mut kinds: Vec<LayerKind> = Vec::new();
    for l in &cfg.layers {
        if let Some(k) = kinds.iter_mut().find(|k| k.mixer == l.mixer && k.ffn == l.ffn) {
            k.count += 1;
            continue;
        }
        let prefix = weights::layer_prefix(l.index);
        let weights = table
            .iter()
            .filter(|s| s.layer == Some(l.index) && s.expert.is_none_or(|e| e == 0))
            .map(|s| {
                let rel = s.name.strip_prefix(&prefix).unwrap_or(&s.name);
                WeightShape { name: rel.replace("experts.0.", "experts.{e}."), shape: s.shape.clone(), dtype: shipped_dtype(s.kind) }
            })
            .collect();
        kinds.push(LayerKind { mixer: l.mixer, ffn: l.ffn, count: 1, example_layer: l.index, weights });
    }
    kinds
}

/// The report for an opened checkpoint: the config's facts plus what the files hold.
pub fn report_with_checkpoint(ck: &Checkpoint) -> Report {
    let mut r = report(&ck.config);
    r.checkpoint = Some(CheckpointFacts {
        dir: ck.dir.display().to_string(),
        files: ck.files.len(),
        tensors: ck.names().len(),
        file_bytes: ck.file_bytes(),
        bytes_by_dtype: ck.bytes_by_dtype(),
        resident_bytes: resident_bytes(),
        open_seconds: None,
        load_seconds: None,
        peak_resident_bytes: None,
        resident_anon_bytes: proc_status_kb("RssAnon:"),
        resident_file_bytes: proc_status_kb("RssFile:"),
        check_error: ck.check().err().map(|e| e.to_string()),
    });
    r
}

fn proc_status_kb(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
}

/// Resident memory of this process (`VmRSS` of `/proc/self/status`), where the OS reports it.
pub fn resident_bytes() -> Option<u64> {
    proc_status_kb("VmRSS:")
}

/// Resident memory split `(anonymous, file-backed)` (`RssAnon`, `RssFile`).
pub fn resident_split() -> (Option<u64>, Option<u64>) {
    (proc_status_kb("RssAnon:"), proc_status_kb("RssFile:"))
}

/// Peak resident memory of this process (`VmHWM`), where the OS reports it.
pub fn peak_resident_bytes() -> Option<u64> {
    proc_status_kb("VmHWM:")
}
