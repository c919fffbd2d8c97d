//! CPU kernels on plain slices. Activations are f32 `[rows, cols]` row-major; weights are
//! [`Matrix`](matmul::Matrix) views of checkpoint bytes (F32, BF16, F16 or MXFP4) used in place.
//!
//! - `matmul`: `y = x Wᵀ` for every weight format (GEMM via `gemm` for many rows, a
//!   bandwidth-bound GEMV for few), multithreaded with `rayon`.
//! - `mxfp4`: the e2m1 + E8M0 decode (around-backbone §2.2); `mxfp4_q8`: MXFP4 × int8
//!   activations, for routed experts computed beside a GPU trunk (issue 23; not the oracle).
//! - `norm`: RMSNorm, LayerNorm, L2 norm.
//! - `kda`: the KDA delta-rule core, recurrent and chunkwise (text-backbone §3.4–3.5).
//! - `act`: sigmoid, SiLU, SiTU-GLU (text-backbone §7.4), softmax.

/// True when the CPU has AVX2 and FMA (checked once): the hand-vectorised loops of `matmul`
/// and `mxfp4` dispatch on it.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

pub mod act;
pub mod kda;
pub mod matmul;
pub mod mxfp4;
pub mod mxfp4_q8;
pub mod norm;
