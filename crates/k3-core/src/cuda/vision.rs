//! Launchers for the MoonViT3d vision tower's own kernels (around-backbone §3.2–§3.8; kernels in
//! `kernels/cuda/vision.cu`, CPU oracle k3-vision's `tower.rs`, `merger.rs`, `projector.rs`):
//! 2-D RoPE, bidirectional attention within each packed sample (block-diagonal over the batch),
//! the two GELUs, the `sd2_tpool` merge, and the BF16 tower's own forms of RoPE (in place on
//! BF16 `qkv`), GELU (BF16 in place) and RMSNorm (F32 rows to BF16, a warp per row), which keep
//! its GEMM outputs BF16 (issue 24). The tower itself (weights, GEMMs) is k3-vision's `cuda.rs`.
//!
//! Shape legend: `L` packed patch rows over the samples of one call, `Dq` = `qkv_hidden_size`,
//! `nh` heads of `hd = Dq/nh`, `qkv` `[L, 3·Dq]` (Q | K | V, head-major within each), attention
//! out `[L, Dq]`; `C` the tower width; a sample of grid `(t, h, w)` has `t·h·w` rows.
//!
//! Attention ([`vit_attention`]) has two forms. BF16 `qkv` with a head dim the fused kernel takes
//! ([`flash_supports`]: a multiple of 8 up to 128; K3's is 128) runs [`vit_flash_attention`],
//! flash attention on tensor cores (`kernels/cuda/vit_attn.cu`): one launch for every sample,
//! head and 64- or 128-row query tile, scores and probabilities never leave registers. Everything
//! else (the F32 reference precision, other head dims) runs as the CPU does, one sample and one
//! slice of its query rows at a time ([`vit_attention_sliced`]): scores `S = Q·Kᵀ` for all heads
//! in one strided-batched cuBLAS GEMM (F32 out), `P = softmax(S/√hd)` (`vit_softmax_*`, F32 or
//! BF16 out), `O = P·V` in a second batched GEMM, query rows sliced so that the F32 scores of one
//! slice stay under [`SCORE_BYTES`]. Samples never see each other's keys in either form.

use super::blas::{gemm_strided_batched, Layout, Strided};
use super::{derr, kargs, CudaTensor};
use crate::kernels::cuda::{VISION, VIT_ATTN};
use crate::{CoreError, DType, Result};

/// Threads per block of the elementwise kernels.
const EW_BLOCK: u32 = 256;
/// Most bytes of F32 attention scores one query slice may hold (all heads).
pub const SCORE_BYTES: usize = 256 << 20;

fn out_suffix(op: &'static str, t: &CudaTensor) -> Result<&'static str> {
    match t.dtype() {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(CoreError::DType { op, dtype: format!("output {d} (F32 or BF16 needed)") }),
    }
}

fn same_dev(op: &'static str, a: &CudaTensor, others: &[&CudaTensor]) -> Result<()> {
    for o in others {
        if !o.cuda_device().same(a.cuda_device()) {
            return Err(CoreError::Shape { op, detail: format!("{o:?} is on another device than {a:?}") });
        }
    }
    Ok(())
}

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CoreError::Shape { op, detail: format!("{what} {v} exceeds i32") })
}

/// 2-D RoPE: `out` = `qkv` with every Q and K head rotated by its row's patch position, V copied.
/// `qkv` F32 `[L, 3·Dq]`; `out` F32 or BF16 `[L, 3·Dq]` (`qkv` itself for F32: in place); `rc` I32
/// `[L, 2]` each row's (patch row, patch column); `cos`, `sin` F32 `[side, hd/4]` with every
/// position of `rc` below `side` (device values are not read back: the caller builds both).
pub fn vit_rope(qkv: &CudaTensor, rc: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor, heads: usize, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda vit_rope";
    let (l, dq, hd) = rope_shapes(OP, qkv, DType::F32, rc, cos, sin, heads)?;
    if out.shape() != qkv.shape() || !out.cuda_device().same(qkv.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("out {out:?} must have qkv's shape {:?} on its device", qkv.shape()) });
    }
    let name = if out_suffix(OP, out)? == "f32" { "vit_rope_f32" } else { "vit_rope_bf16" };
    if l == 0 {
        return Ok(());
    }
    let dev = qkv.cuda_device();
    let grid = dev.elementwise_grid(l * 3 * dq / 2, EW_BLOCK);
    let (rows, dq32, hd32) = (l as i64, i32_of(OP, "Dq", dq)?, hd as i32);
    let (xp, rp, cp, sp, op) = (qkv.ptr(), rc.ptr(), cos.ptr(), sin.ptr(), out.ptr());
    dev.launch(VISION, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, rp, cp, sp, op, rows, dq32, hd32])
}

/// [`vit_rope`] in place on a BF16 `qkv` `[L, 3·Dq]` (the BF16 tower's qkv GEMM writes BF16):
/// Q and K rotated, V not touched — bit for bit the cast to F32 followed by [`vit_rope`] into
/// BF16, without the F32 copy. Same `rc`, `cos`, `sin` as [`vit_rope`].
pub fn vit_rope_bf16_inplace(qkv: &CudaTensor, rc: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor, heads: usize) -> Result<()> {
    const OP: &str = "cuda vit_rope_bf16_inplace";
    let (l, dq, hd) = rope_shapes(OP, qkv, DType::BF16, rc, cos, sin, heads)?;
    if !qkv.ptr().is_multiple_of(8) {
        return Err(CoreError::Shape { op: OP, detail: "qkv must start on an 8-byte boundary (pass a whole tensor)".into() });
    }
    if l == 0 {
        return Ok(());
    }
    let dev = qkv.cuda_device();
    let grid = dev.elementwise_grid(l * dq / 2, EW_BLOCK);
    let (rows, dq32, hd32) = (l as i64, i32_of(OP, "Dq", dq)?, hd as i32);
    let (xp, rp, cp, sp) = (qkv.ptr(), rc.ptr(), cos.ptr(), sin.ptr());
    dev.launch(VISION, "vit_rope_bf16_inplace", (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, rp, cp, sp, rows, dq32, hd32])
}

/// The checks of both RoPE forms: `qkv` `dt` `[L, 3·Dq]` with `Dq / heads` a multiple of 4, `rc`
/// I32 `[L, 2]`, `cos` and `sin` F32 `[side, hd/4]`, all on one device. Returns `(L, Dq, hd)`.
fn rope_shapes(
    op: &'static str,
    qkv: &CudaTensor,
    dt: DType,
    rc: &CudaTensor,
    cos: &CudaTensor,
    sin: &CudaTensor,
    heads: usize,
) -> Result<(usize, usize, usize)> {
    same_dev(op, qkv, &[rc, cos, sin])?;
    let (l, w3) = match qkv.shape() {
        [l, w] => (*l, *w),
        _ => return Err(CoreError::Shape { op, detail: format!("qkv {qkv:?} must be [L, 3·Dq]") }),
    };
    let dq = w3 / 3;
    if qkv.dtype() != dt || !w3.is_multiple_of(3) || heads == 0 || !dq.is_multiple_of(heads) || !(dq / heads).is_multiple_of(4) {
        return Err(CoreError::Shape { op, detail: format!("qkv {qkv:?} must be {dt} [L, 3·Dq] with Dq / {heads} heads a multiple of 4") });
    }
    let hd = dq / heads;
    if rc.dtype() != DType::I32 || rc.shape() != [l, 2] {
        return Err(CoreError::Shape { op, detail: format!("rc {rc:?} must be I32 [{l}, 2]") });
    }
    let nf = hd / 4;
    if cos.dtype() != DType::F32 || sin.dtype() != DType::F32 || cos.shape().len() != 2 || cos.shape()[1] != nf || sin.shape() != cos.shape() {
        return Err(CoreError::Shape { op, detail: format!("cos {cos:?} and sin {sin:?} must be F32 [side, {nf}]") });
    }
    Ok((l, dq, hd))
}

/// Full bidirectional attention within each sample of a packed batch: `qkv` `[L, 3·Dq]` (F32 or
/// BF16, after RoPE) → `out` `[L, Dq]` (same dtype). `lens` are the samples' row counts in
/// order (`Σ lens = L`); scale `hd^−½`. BF16 with a head dim [`flash_supports`] takes runs the
/// fused kernel ([`vit_flash_attention`]); the rest the cuBLAS form ([`vit_attention_sliced`]).
/// Both accumulate in f32 and round the probabilities `P` to the input dtype before `P·V`.
pub fn vit_attention(qkv: &CudaTensor, heads: usize, lens: &[usize], out: &CudaTensor) -> Result<()> {
    let hd = (qkv.last_dim() / 3).checked_div(heads).unwrap_or(0);
    if qkv.dtype() == DType::BF16 && out.dtype() == DType::BF16 && flash_supports(hd) && qkv.last_dim() == 3 * heads * hd {
        return vit_flash_attention(qkv, heads, lens, out);
    }
    vit_attention_sliced(qkv, heads, lens, out, SCORE_BYTES)
}

/// The checks both forms of [`vit_attention`] share: `qkv` `[L, 3·Dq]` with `Dq` a multiple of
/// `heads`, `out` `[L, Dq]` on the same device, `lens` positive and summing to `L`. Returns
/// `(L, Dq, hd)`.
fn attention_shapes(op: &'static str, qkv: &CudaTensor, heads: usize, lens: &[usize], out: &CudaTensor) -> Result<(usize, usize, usize)> {
    same_dev(op, qkv, &[out])?;
    let (l, w3) = match qkv.shape() {
        [l, w] => (*l, *w),
        _ => return Err(CoreError::Shape { op, detail: format!("qkv {qkv:?} must be [L, 3·Dq]") }),
    };
    let dq = w3 / 3;
    if !w3.is_multiple_of(3) || heads == 0 || !dq.is_multiple_of(heads) {
        return Err(CoreError::Shape { op, detail: format!("qkv {qkv:?}: width must be 3·Dq with Dq a multiple of {heads} heads") });
    }
    if out.shape() != [l, dq] {
        return Err(CoreError::Shape { op, detail: format!("out {out:?} must be [{l}, {dq}]") });
    }
    if lens.iter().sum::<usize>() != l || lens.contains(&0) {
        return Err(CoreError::Shape { op, detail: format!("sample lengths {lens:?} must be positive and sum to L = {l}") });
    }
    Ok((l, dq, dq / heads))
}

/// The cuBLAS form of [`vit_attention`] (any head dim, F32 or BF16), with query slices of at most
/// `score_bytes` of F32 scores (at least one row each): tests use a small budget to exercise the
/// slicing.
pub fn vit_attention_sliced(qkv: &CudaTensor, heads: usize, lens: &[usize], out: &CudaTensor, score_bytes: usize) -> Result<()> {
    const OP: &str = "cuda vit_attention";
    let dt = qkv.dtype();
    let sfx = out_suffix(OP, qkv)?;
    if out.dtype() != dt {
        return Err(CoreError::Shape { op: OP, detail: format!("out {out:?} must be {dt} like qkv") });
    }
    let (_, dq, hd) = attention_shapes(OP, qkv, heads, lens, out)?;
    let w3 = 3 * dq;
    let es = dt.size_in_bytes() as u64;
    let dev = qkv.cuda_device();
    let n_max = lens.iter().copied().max().unwrap_or(0);
    if n_max == 0 {
        return Ok(());
    }
    let slice = |n: usize| (score_bytes / (heads * n * 4)).clamp(1, n);
    let cap = lens.iter().map(|&n| heads * slice(n) * n).max().unwrap_or(0);
    let s = CudaTensor::uninit(dev, DType::F32, vec![cap])?;
    let p = CudaTensor::uninit(dev, dt, vec![cap])?;
    let softmax = if sfx == "f32" { "vit_softmax_f32" } else { "vit_softmax_bf16" };
    let scale = 1.0 / (hd as f32).sqrt();
    let (qp, op) = (qkv.ptr(), out.ptr());
    let mut off = 0usize;
    for &n in lens {
        let m_step = slice(n);
        let keys = qp + (off * w3 + dq) as u64 * es;
        let values = qp + (off * w3 + 2 * dq) as u64 * es;
        let n32 = i32_of(OP, "sample length", n)?;
        for r0 in (0..n).step_by(m_step) {
            let m = m_step.min(n - r0);
            let q = Strided { ptr: qp + ((off + r0) * w3) as u64 * es, ld: w3, stride: hd };
            let sv = Strided { ptr: s.ptr(), ld: n, stride: m * n };
            gemm_strided_batched(dev, m, n, hd, heads, q, Strided { ptr: keys, ld: w3, stride: hd }, Layout::BT, sv, dt, DType::F32)?;
            let rows = u32::try_from(heads * m).map_err(|_| CoreError::Shape { op: OP, detail: format!("{} score rows exceed u32", heads * m) })?;
            let block = (n.div_ceil(32) * 32).clamp(32, 512) as u32;
            let (sp, pp) = (s.ptr(), p.ptr());
            dev.launch(VISION, softmax, (rows, 1, 1), (block, 1, 1), 0, &mut kargs![sp, pp, n32, scale])?;
            let pv = Strided { ptr: p.ptr(), ld: n, stride: m * n };
            let o = Strided { ptr: op + ((off + r0) * dq) as u64 * es, ld: dq, stride: hd };
            gemm_strided_batched(dev, m, hd, n, heads, pv, Strided { ptr: values, ld: w3, stride: hd }, Layout::B, o, dt, dt)?;
        }
        off += n;
    }
    Ok(())
}

/// Query-tile shapes of the fused kernel at head dim 128 (narrower heads always use 64 rows of 4
/// warps × 16). The default is FlashAttention-2's choice for head dim 128 on sm_80/sm_90; the
/// others are there to be measured against it (`bench_tower --attention`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashTile {
    /// 128 query rows per block, 4 warps of 32 rows, Q re-read from shared memory per key tile.
    #[default]
    Rows128Warps4,
    /// 64 query rows per block, 4 warps of 16 rows, Q in registers.
    Rows64Warps4,
    /// 128 query rows per block, 8 warps of 16 rows, Q in registers.
    Rows128Warps8,
}

impl FlashTile {
    pub const ALL: [FlashTile; 3] = [FlashTile::Rows128Warps4, FlashTile::Rows64Warps4, FlashTile::Rows128Warps8];
}

/// Key rows per tile of the fused kernel (`VA_KEYS` in `vit_attn.cu`).
const FLASH_KEYS: usize = 64;

/// Whether the fused kernel takes head dim `hd`: a multiple of 8 (16-byte rows) up to 128.
pub fn flash_supports(hd: usize) -> bool {
    hd > 0 && hd.is_multiple_of(8) && hd <= 128
}

/// The kernel for head dim `hd` (padded to 16, 32, 64 or 128), `tile` and the output dtype, with
/// its query rows per block and threads per block.
fn flash_kernel(op: &'static str, hd: usize, tile: FlashTile, out: DType) -> Result<(&'static str, usize, u32)> {
    let bf = out == DType::BF16;
    let pad = [16, 32, 64, 128].into_iter().find(|&p| hd <= p).unwrap_or(0);
    Ok(match (pad, tile, bf) {
        (128, FlashTile::Rows128Warps4, true) => ("vit_flash_h128_r128w4_bf16", 128, 128),
        (128, FlashTile::Rows128Warps4, false) => ("vit_flash_h128_r128w4_f32", 128, 128),
        (128, FlashTile::Rows64Warps4, true) => ("vit_flash_h128_r64w4_bf16", 64, 128),
        (128, FlashTile::Rows128Warps8, true) => ("vit_flash_h128_r128w8_bf16", 128, 256),
        (64, FlashTile::Rows128Warps4, true) => ("vit_flash_h64_r64w4_bf16", 64, 128),
        (64, FlashTile::Rows128Warps4, false) => ("vit_flash_h64_r64w4_f32", 64, 128),
        (32, FlashTile::Rows128Warps4, true) => ("vit_flash_h32_r64w4_bf16", 64, 128),
        (32, FlashTile::Rows128Warps4, false) => ("vit_flash_h32_r64w4_f32", 64, 128),
        (16, FlashTile::Rows128Warps4, true) => ("vit_flash_h16_r64w4_bf16", 64, 128),
        (16, FlashTile::Rows128Warps4, false) => ("vit_flash_h16_r64w4_f32", 64, 128),
        _ => {
            return Err(CoreError::Shape {
                op,
                detail: format!("no fused kernel for head dim {hd} with tile {tile:?} and {out} output (head dim 128 with BF16 output takes every tile, other head dims the default)"),
            })
        }
    })
}

/// Fused flash attention on tensor cores (`vit_attn.cu`), the BF16 form of [`vit_attention`]:
/// `qkv` BF16 `[L, 3·Dq]` after RoPE → `out` `[L, Dq]`, BF16 or F32, each sample of `lens`
/// attending only to itself; `hd = Dq/heads` must satisfy [`flash_supports`]. Scores, the online
/// softmax (f32, base 2) and the row sums stay in registers; `P` is rounded to BF16 for `P·V`.
pub fn vit_flash_attention(qkv: &CudaTensor, heads: usize, lens: &[usize], out: &CudaTensor) -> Result<()> {
    vit_flash_attention_tiled(qkv, heads, lens, out, FlashTile::default())
}

/// [`vit_flash_attention`] with a chosen query-tile shape (head dim 128 and BF16 output for the
/// non-default ones).
pub fn vit_flash_attention_tiled(qkv: &CudaTensor, heads: usize, lens: &[usize], out: &CudaTensor, tile: FlashTile) -> Result<()> {
    const OP: &str = "cuda vit_flash_attention";
    if qkv.dtype() != DType::BF16 {
        return Err(CoreError::Shape { op: OP, detail: format!("qkv {qkv:?} must be BF16 [L, 3·Dq]") });
    }
    let (l, dq, hd) = attention_shapes(OP, qkv, heads, lens, out)?;
    if !flash_supports(hd) {
        return Err(CoreError::Shape {
            op: OP,
            detail: format!("head dim {hd} (Dq {dq} / {heads} heads) must be a multiple of 8 up to 128; use vit_attention_sliced"),
        });
    }
    let (name, rows, threads) = flash_kernel(OP, hd, tile, out.dtype())?;
    if !qkv.ptr().is_multiple_of(16) || !out.ptr().is_multiple_of(8) {
        return Err(CoreError::Shape { op: OP, detail: "qkv must start on a 16-byte boundary and out on an 8-byte one (pass whole tensors)".into() });
    }
    i32_of(OP, "L", l)?;
    if l == 0 {
        return Ok(());
    }
    // Query tiles (sample start, sample end, first row), the longest samples first.
    let mut off = 0;
    let mut samples: Vec<(usize, usize)> = lens
        .iter()
        .map(|&n| {
            off += n;
            (off - n, n)
        })
        .collect();
    samples.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
    let tiles: Vec<i32> = samples.iter().flat_map(|&(off, n)| (0..n).step_by(rows).flat_map(move |q| [off, off + n, off + q].map(|v| v as i32))).collect();
    let count = tiles.len() / 3;
    let gx = u32::try_from(count)
        .ok()
        .filter(|&v| v < i32::MAX as u32)
        .ok_or_else(|| CoreError::Shape { op: OP, detail: format!("{count} query tiles exceed the grid") })?;
    let gy = u32::try_from(heads).ok().filter(|&v| v <= 65535).ok_or_else(|| CoreError::Shape { op: OP, detail: format!("{heads} heads exceed the grid") })?;
    let dev = qkv.cuda_device();
    let table = CudaTensor::from_pod(dev, DType::I32, vec![count, 3], &tiles)?;
    let pad = [16, 32, 64, 128].into_iter().find(|&p| hd <= p).unwrap_or(128);
    let smem = (rows + 4 * FLASH_KEYS) * (pad + 8) * 2;
    let f = dev.function(VIT_ATTN, name)?;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(derr("raising the shared-memory limit of vit_flash_attention"))?;
    let (dq32, hd32) = (i32_of(OP, "Dq", dq)?, hd as i32);
    let scale_log2 = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    let (qp, tp, op) = (qkv.ptr(), table.ptr(), out.ptr());
    dev.launch(VIT_ATTN, name, (gx, gy, 1), (threads, 1, 1), smem as u32, &mut kargs![qp, tp, dq32, hd32, scale_log2, op])
}

fn gelu(op: &'static str, names: [&'static str; 2], x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    same_dev(op, x, &[out])?;
    if x.dtype() != DType::F32 || out.shape() != x.shape() {
        return Err(CoreError::Shape { op, detail: format!("x {x:?} must be F32 and out {out:?} of its shape") });
    }
    let name = if out_suffix(op, out)? == "f32" { names[0] } else { names[1] };
    let n = x.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = x.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let (xp, yp) = (x.ptr(), out.ptr());
    dev.launch(VISION, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, yp, n])
}

/// `out = gelu_tanh(x)` (PyTorch's `approximate="tanh"`, the ViT MLP): F32 in, F32 or BF16 out;
/// or BF16 in and out (`out` may be `x`: in place; whole tensors, 16-byte aligned), each element
/// the BF16 rounding of the F32 form on its value.
pub fn vit_gelu_tanh(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda vit_gelu_tanh";
    if x.dtype() != DType::BF16 {
        return gelu(OP, ["vit_gelu_tanh_f32", "vit_gelu_tanh_bf16"], x, out);
    }
    same_dev(OP, x, &[out])?;
    if out.dtype() != DType::BF16 || out.shape() != x.shape() || !x.ptr().is_multiple_of(16) || !out.ptr().is_multiple_of(16) {
        return Err(CoreError::Shape { op: OP, detail: format!("x {x:?}: out {out:?} must be BF16 of its shape, both 16-byte aligned (whole tensors)") });
    }
    let n = x.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = x.cuda_device();
    let grid = dev.elementwise_grid((n as usize / 8).max(1), EW_BLOCK);
    let (xp, yp) = (x.ptr(), out.ptr());
    dev.launch(VISION, "vit_gelu_tanh_bf16_bf16", (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, yp, n])
}

/// Widest row `vit_rms_norm_bf16` holds in registers (`32 · 4 · VIT_NORM_V` in `vision.cu`).
const NORM_MAX_COLS: usize = 32 * 4 * 16;
/// Rows (warps) per block of `vit_rms_norm_bf16`.
const NORM_ROWS: u32 = 8;

/// RMSNorm of F32 rows `x` `[R, d]` with an F32 weight `[d]` into BF16 `out` `[R, d]` (the BF16
/// tower's GEMM inputs): one warp per row, read once into registers with 16-byte loads, for
/// `d` a multiple of 4 up to 2048 and 16-byte aligned tensors; anything else goes to
/// [`ops::rms_norm_cols`](super::ops::rms_norm_cols), whose result this equals up to the
/// summation order of the mean square.
pub fn vit_rms_norm_bf16(x: &CudaTensor, w: &CudaTensor, eps: f32, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda vit_rms_norm_bf16";
    same_dev(OP, x, &[w, out])?;
    let d = x.last_dim();
    let rows = x.numel().checked_div(d).unwrap_or(0);
    if x.dtype() != DType::F32 || out.dtype() != DType::BF16 || w.dtype() != DType::F32 || out.shape() != x.shape() || w.numel() != d {
        return Err(CoreError::Shape { op: OP, detail: format!("x {x:?} must be F32 [R, d], w {w:?} F32 [d] and out {out:?} BF16 of x's shape") });
    }
    let fast = d.is_multiple_of(4) && d <= NORM_MAX_COLS && [x.ptr(), w.ptr(), out.ptr()].iter().all(|p| p.is_multiple_of(16));
    if !fast {
        return super::ops::rms_norm_cols(x, d, w, eps, out);
    }
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(rows.div_ceil(NORM_ROWS as usize)).map_err(|_| CoreError::Shape { op: OP, detail: format!("{rows} rows exceed the grid") })?;
    let (xp, wp, op, r, d32) = (x.ptr(), w.ptr(), out.ptr(), rows as i64, i32_of(OP, "d", d)?);
    x.cuda_device().launch(VISION, "vit_rms_norm_bf16", (blocks, 1, 1), (32 * NORM_ROWS, 1, 1), 0, &mut kargs![xp, wp, op, r, d32, eps])
}

/// `out = 0.5·x·(1 + erf(x/√2))` in f64 (the projector's exact GELU): F32 in, F32 or BF16 out.
pub fn vit_gelu_erf(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    gelu("cuda vit_gelu_erf", ["vit_gelu_erf_f32", "vit_gelu_erf_bf16"], x, out)
}

/// `sd2_tpool` of every sample: `x` F32 `[L, C]` (the tower's output, samples packed in order)
/// → `out` F32 `[Σ (h/kh)(w/kw), kh·kw·C]`, each sample's tokens in order; entry `dy·kw + dx` of
/// a token holds patch `(kh·R + dy, kw·Cc + dx)` averaged over the sample's `t` frames.
pub fn vit_merge(x: &CudaTensor, grids: &[[usize; 3]], kh: usize, kw: usize, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda vit_merge";
    same_dev(OP, x, &[out])?;
    let c = x.last_dim();
    let l: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
    let tokens: usize = grids.iter().map(|g| (g[1] / kh.max(1)) * (g[2] / kw.max(1))).sum();
    if x.dtype() != DType::F32 || out.dtype() != DType::F32 || x.numel() != l * c || out.shape() != [tokens, kh * kw * c] {
        return Err(CoreError::Shape { op: OP, detail: format!("x {x:?} must be F32 [{l}, C] and out {out:?} F32 [{tokens}, {}]", kh * kw * c) });
    }
    if let Some(g) = grids.iter().find(|g| kh == 0 || kw == 0 || g[0] == 0 || g[1] % kh != 0 || g[2] % kw != 0) {
        return Err(CoreError::Shape { op: OP, detail: format!("grid {g:?} is not a multiple of the {kh}x{kw} merge kernel") });
    }
    let dev = x.cuda_device();
    let (mut row, mut tok) = (0usize, 0usize);
    let (c32, kh32, kw32) = (i32_of(OP, "C", c)?, i32_of(OP, "kh", kh)?, i32_of(OP, "kw", kw)?);
    for &[t, h, w] in grids {
        let n_out = (h / kh) * (w / kw) * kh * kw * c;
        let xp = x.ptr() + (row * c * 4) as u64;
        let op = out.ptr() + (tok * kh * kw * c * 4) as u64;
        let (t32, h32, w32) = (i32_of(OP, "t", t)?, i32_of(OP, "h", h)?, i32_of(OP, "w", w)?);
        let grid = dev.elementwise_grid(n_out, EW_BLOCK);
        dev.launch(VISION, "vit_merge", (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, op, t32, h32, w32, kh32, kw32, c32])?;
        row += t * h * w;
        tok += (h / kh) * (w / kw);
    }
    Ok(())
}
