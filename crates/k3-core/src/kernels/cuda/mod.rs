//! The CUDA C sources of k3rs's own kernels, embedded in the binary with `include_str!`.
//!
//! Each `.cu` file here is one op family; its stem matches the CPU file that is its oracle
//! (`norm.cu` ↔ `kernels/cpu/norm.rs`, `act.cu` ↔ `kernels/cpu/act.rs`; `softmax.cu` holds
//! the softmax of `act.rs`). `common.cuh` (bf16 bit conversions, 16-byte vector access, warp
//! and block reductions, `.ftz` exp/reciprocal/rsqrt, and the tensor-core helpers: bf16 pairs,
//! `ldmatrix`, `mma.sync` bf16/tf32) is prepended to every source, so no file includes a header and NVRTC
//! needs none of the toolkit's include directory. The sources are compiled at run time by
//! [`crate::cuda`] with NVRTC for the device's own architecture (`sm_90` on an H200) and the
//! resulting cubin is cached per process; see `docs/gpu.md` for why NVRTC rather than
//! ahead-of-time `nvcc`.

/// One CUDA C translation unit: a module name (also the cache key) and its source text.
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    pub code: &'static str,
}

/// Prepended to every source before compilation.
pub const COMMON: &str = include_str!("common.cuh");

/// RMSNorm (`rms_norm_{f32,bf16}[_v]`).
pub const NORM: Source = Source { name: "norm", code: include_str!("norm.cu") };
/// Sigmoid, SiLU, SiTU-GLU and dtype casts (`sigmoid_*`, `silu_*`, `situ_glu_*`, `cast_*`).
pub const ACT: Source = Source { name: "act", code: include_str!("act.cu") };
/// Row softmax (`softmax_{f32,bf16}`).
pub const SOFTMAX: Source = Source { name: "softmax", code: include_str!("softmax.cu") };

/// KDA chunked prefill (`kda_chunk_prep`, `kda_chunk_scan`).
pub const KDA: Source = Source { name: "kda", code: include_str!("kda.cu") };
/// KDA decode step at head dim 128 (`kda_decode`).
pub const KDA_DECODE: Source = Source { name: "kda_decode", code: include_str!("kda_decode.cu") };
/// KDA for head dims 32..=128 other than the fast kernels' 128: recurrent form (`kda_general`).
pub const KDA_GENERAL: Source = Source { name: "kda_general", code: include_str!("kda_general.cu") };

/// Block Attention Residuals mix fused with the following RMSNorm (`attn_res_norm_{bf16,f32}`).
pub const ATTN_RES: Source = Source { name: "attn_res", code: include_str!("attn_res.cu") };
/// Row gathers (embedding, last rows), row scatters by a device index (`scatter_rows_*`) and
/// strided copies (`gather_rows_*`, `copy_strided_bf16`).
pub const COPY: Source = Source { name: "copy", code: include_str!("copy.cu") };

/// Routed MoE experts: router top-k, grouping, grouped MXFP4/BF16 GEMV, prefill helpers (`moe_*`).
pub const MOE: Source = Source { name: "moe", code: include_str!("moe.cu") };
/// Routed MoE experts, tensor-core decode path (`moe_mma_{w13,w2}_{mxfp4,bf16}_n{1,2,4,8}`).
pub const MOE_MMA: Source = Source { name: "moe_mma", code: include_str!("moe_mma.cu") };

/// Decode-sized products of a few rows against up to 8 BF16 weights sharing them (`gemv_m{1..8}`).
pub const GEMV: Source = Source { name: "gemv", code: include_str!("gemv.cu") };

/// Absorbed MLA over a paged latent cache (`mla_cache_append_*`, `mla_attend_p*`, `mla_combine`).
pub const MLA: Source = Source { name: "mla", code: include_str!("mla.cu") };
/// Causal attention of a fresh prefill in MLA's explicit form (`mla_prefill_attend`).
pub const MLA_PREFILL: Source = Source { name: "mla_prefill", code: include_str!("mla_prefill.cu") };
/// DSA lightning indexer and radix top-k (`index_key_append_*`, `dsa_index_scores`, `dsa_topk_*`).
pub const DSA: Source = Source { name: "dsa", code: include_str!("dsa.cu") };

/// Token sampling: mask, penalties, greedy / top-k / top-p / min-p draw, logprobs (`sample_*`).
pub const SAMPLE: Source = Source { name: "sample", code: include_str!("sample.cu") };

/// The MoonViT3d tower's own kernels: 2-D RoPE, scaled row softmax, GELUs, the `sd2_tpool` merge
/// (`vit_*`; CPU oracle: k3-vision's tower, merger and projector).
pub const VISION: Source = Source { name: "vision", code: include_str!("vision.cu") };
/// The tower's fused bidirectional attention on tensor cores, block-diagonal over packed samples
/// (`vit_flash_h{16,32,64,128}_*`).
pub const VIT_ATTN: Source = Source { name: "vit_attn", code: include_str!("vit_attn.cu") };

/// Every source, for tools that want to compile them all up front.
pub const ALL: [Source; 17] =
    [NORM, ACT, SOFTMAX, KDA, KDA_DECODE, KDA_GENERAL, ATTN_RES, COPY, MOE, MOE_MMA, GEMV, MLA, MLA_PREFILL, DSA, SAMPLE, VISION, VIT_ATTN];

impl Source {
    /// The full text handed to NVRTC: [`COMMON`] followed by this file.
    pub fn full_text(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu ----\n{}", self.name, self.code)
    }
}
