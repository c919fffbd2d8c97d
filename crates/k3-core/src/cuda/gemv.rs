//! Decode-sized matrix products: `out_s = x · W_sᵀ` for a few rows of `x` and up to
//! [`GEMV_MAX_OUTS`] BF16 weights that share that input, in one launch (`kernels/cuda/gemv.cu`).
//! At batch 1 a decode step is a chain of such products whose cost is reading the weights once;
//! this kernel streams them at HBM speed where a general GEMM library's M = 1 case does not, and
//! it fuses the sibling projections of a layer (KDA's q/k/v/β/gate-down/gate, the router + latent
//! down-projection + shared experts of LatentMoE) so each pays one launch. The oracle is the CPU
//! matmul (and cuBLAS beside it) in `tests/cuda_gemv.rs`.
//!
//! Shapes: x BF16 `[M, K]` with M ≤ [`GEMV_MAX_ROWS`]; W_s BF16 `[N_s, K]`; out_s `[M, N_s]`, F32 or
//! BF16 (each output its own). K a multiple of 8, every pointer 16-byte aligned
//! ([`gemv_fits`] says whether a call is served). Arithmetic f32.

use super::{kargs, CudaTensor};
use crate::kernels::cuda::GEMV;
use crate::{CoreError, DType, Result};

/// Most rows of `x` one launch serves (decode batches up to this size).
pub const GEMV_MAX_ROWS: usize = 8;
/// Most weights (outputs) one launch serves (`GEMV_MAX_SEGS` in gemv.cu).
pub const GEMV_MAX_OUTS: usize = 8;
/// Output rows per warp (`GEMV_R` in gemv.cu) and warps per block.
const R: usize = 2;
const WARPS: usize = 8;

/// The kernel's by-value segment table (`GemvSegs` in gemv.cu; same layout).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Segs {
    w: [u64; GEMV_MAX_OUTS],
    out: [u64; GEMV_MAX_OUTS],
    pad_end: [i32; GEMV_MAX_OUTS],
    rows: [i32; GEMV_MAX_OUTS],
    out_f32: [i32; GEMV_MAX_OUTS],
    nseg: i32,
}

/// Whether [`gemv`] serves `x` against these weights: BF16 everywhere, M ≤ [`GEMV_MAX_ROWS`],
/// at most [`GEMV_MAX_OUTS`] weights of `x`'s width, K a multiple of 8, 16-byte aligned.
pub fn gemv_fits(x: &CudaTensor, ws: &[&CudaTensor]) -> bool {
    let k = x.last_dim();
    let m = x.numel().checked_div(k).unwrap_or(0);
    x.dtype() == DType::BF16
        && (1..=GEMV_MAX_ROWS).contains(&m)
        && (1..=GEMV_MAX_OUTS).contains(&ws.len())
        && k.is_multiple_of(8)
        && k > 0
        && k <= i32::MAX as usize
        && x.ptr().is_multiple_of(16)
        && ws.iter().all(|w| {
            w.dtype() == DType::BF16 && w.shape().len() == 2 && w.shape()[1] == k && w.ptr().is_multiple_of(16) && w.cuda_device().same(x.cuda_device())
        })
}

/// `out_s = x · W_sᵀ` for each `(W_s, out_s)` in `outs`, one launch. Errors (naming the operand)
/// when the call is outside what [`gemv_fits`] accepts or an output is not `[M, N_s]` F32/BF16.
pub fn gemv(x: &CudaTensor, outs: &[(&CudaTensor, &CudaTensor)]) -> Result<()> {
    const OP: &str = "cuda gemv";
    let ws: Vec<&CudaTensor> = outs.iter().map(|(w, _)| *w).collect();
    if !gemv_fits(x, &ws) {
        let detail = format!(
            "x {x:?} against weights {:?}: needs BF16 x [M ≤ {GEMV_MAX_ROWS}, K % 8 == 0], 1..={GEMV_MAX_OUTS} BF16 weights [N, K], 16-byte aligned, one device",
            ws.iter().map(|w| w.shape().to_vec()).collect::<Vec<_>>()
        );
        return Err(CoreError::Shape { op: OP, detail });
    }
    let k = x.last_dim();
    let m = x.numel() / k;
    let mut s = Segs { nseg: outs.len() as i32, ..Default::default() };
    let mut end = 0usize;
    for (j, (w, o)) in outs.iter().enumerate() {
        let n = w.shape()[0];
        let f32_out = match o.dtype() {
            DType::F32 => 1,
            DType::BF16 => 0,
            d => return Err(CoreError::DType { op: OP, dtype: d.to_string() }),
        };
        if o.numel() != m * n || o.last_dim() != n || !o.cuda_device().same(x.cuda_device()) {
            return Err(CoreError::Shape { op: OP, detail: format!("output {j} is {o:?}, expected [{m}, {n}] on x's device") });
        }
        end += n.div_ceil(R) * R;
        let (e32, n32) = (i32::try_from(end), i32::try_from(n));
        let (Ok(e32), Ok(n32)) = (e32, n32) else { return Err(CoreError::Shape { op: OP, detail: format!("{end} output rows exceed i32") }) };
        (s.w[j], s.out[j], s.pad_end[j], s.rows[j], s.out_f32[j]) = (w.ptr(), o.ptr(), e32, n32, f32_out);
    }
    if end == 0 {
        return Ok(());
    }
    let blocks = end.div_ceil(R * WARPS) as u32;
    let name = ["gemv_m1", "gemv_m2", "gemv_m3", "gemv_m4", "gemv_m5", "gemv_m6", "gemv_m7", "gemv_m8"][m - 1];
    let (xp, k32) = (x.ptr(), k as i32);
    x.cuda_device().launch(GEMV, name, (blocks, 1, 1), ((WARPS * 32) as u32, 1, 1), 0, &mut kargs![xp, k32, s])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Rust table must match `GemvSegs` byte for byte: 8 + 8 pointers, 3 × 8 ints, nseg,
    /// padded to 8-byte alignment.
    #[test]
    fn segment_table_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<Segs>(), 16 * 8 + 3 * 8 * 4 + 4 + 4);
        assert_eq!(std::mem::align_of::<Segs>(), 8);
    }
}
