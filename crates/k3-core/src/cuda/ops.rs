//! Launchers for k3rs's own CUDA kernels (`kernels/cuda/*.cu`): RMSNorm, sigmoid, SiLU,
//! SiTU-GLU, row softmax and f32↔bf16 casts. Each takes its inputs and its output as
//! [`CudaTensor`]s of one device, checks dtypes and shapes, and enqueues one kernel on the
//! device's compute stream. F32 and BF16 storage are supported; arithmetic is f32. The same
//! tensor may be passed as input and output (in place). The CPU functions of the same names
//! in `kernels::cpu` are the oracle (`tests/cuda_ops.rs`).

use super::{kargs, CudaTensor};
use crate::kernels::cuda::{ACT, ATTN_RES, COPY, NORM, SOFTMAX};
use crate::{CoreError, DType, Result};

/// Threads per block of the elementwise kernels.
const EW_BLOCK: u32 = 256;

fn suffix(op: &'static str, t: &CudaTensor) -> Result<&'static str> {
    match t.dtype() {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => Err(CoreError::DType { op, dtype: d.to_string() }),
    }
}

/// Errors unless every tensor is on `first`'s device, has its dtype, and (for `same_shape`)
/// its shape.
fn check_like(op: &'static str, first: &CudaTensor, others: &[&CudaTensor]) -> Result<()> {
    for o in others {
        if !o.cuda_device().same(first.cuda_device()) || o.dtype() != first.dtype() || o.shape() != first.shape() {
            return Err(CoreError::Shape { op, detail: format!("{o:?} does not match {first:?} (same device, dtype and shape needed)") });
        }
    }
    Ok(())
}

fn rows_of(op: &'static str, x: &CudaTensor) -> Result<(i32, u32)> {
    let d = x.last_dim();
    let rows = x.numel().checked_div(d).unwrap_or(0);
    let d32 = i32::try_from(d).map_err(|_| CoreError::Shape { op, detail: format!("row width {d} exceeds i32") })?;
    let r32 =
        u32::try_from(rows).ok().filter(|&r| r < (1 << 31)).ok_or_else(|| CoreError::Shape { op, detail: format!("{rows} rows exceed the grid limit") })?;
    Ok((d32, r32))
}

/// Threads per block for a block-per-row kernel over rows of `work` items.
fn row_block(work: usize) -> u32 {
    (work.div_ceil(32) * 32).clamp(32, 512) as u32
}

/// `out = x / sqrt(mean(x²) + eps) · w` over the last dimension; `w` has that width.
pub fn rms_norm(x: &CudaTensor, w: &CudaTensor, eps: f32, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda rms_norm";
    check_like(OP, x, &[out])?;
    let sfx = suffix(OP, x)?;
    let (d, rows) = rows_of(OP, x)?;
    if w.dtype() != x.dtype() || w.numel() != d as usize || !w.cuda_device().same(x.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("weight {w:?} must be {} [{d}] on the same device as {x:?}", x.dtype()) });
    }
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let vec = 16 / x.dtype().size_in_bytes();
    let aligned = [x.ptr(), w.ptr(), out.ptr()].iter().all(|p| p % 16 == 0);
    // vec is 4 or 8: a power of two.
    let vectorised = aligned && (d as usize) & (vec - 1) == 0;
    let (name, work) = match (sfx, vectorised) {
        ("f32", true) => ("rms_norm_f32_v", d as usize / vec),
        ("f32", false) => ("rms_norm_f32", d as usize),
        (_, true) => ("rms_norm_bf16_v", d as usize / vec),
        (_, false) => ("rms_norm_bf16", d as usize),
    };
    let (xp, wp, op) = (x.ptr(), w.ptr(), out.ptr());
    x.cuda_device().launch(NORM, name, (rows, 1, 1), (row_block(work), 1, 1), 0, &mut kargs![xp, wp, op, d, eps])
}

fn unary(op: &'static str, kernel: [&'static str; 2], x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    check_like(op, x, &[out])?;
    let name = if suffix(op, x)? == "f32" { kernel[0] } else { kernel[1] };
    let n = x.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = x.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let (xp, op_) = (x.ptr(), out.ptr());
    dev.launch(ACT, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, op_, n])
}

/// `out = 1 / (1 + exp(-x))` elementwise.
pub fn sigmoid(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    unary("cuda sigmoid", ["sigmoid_f32", "sigmoid_bf16"], x, out)
}

/// `out = x · sigmoid(x)` elementwise.
pub fn silu(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    unary("cuda silu", ["silu_f32", "silu_bf16"], x, out)
}

/// SiTU-GLU (text-backbone §7.4): `out = β·tanh(g/β)·σ(g) · λ·tanh(u/λ)` elementwise over
/// equal-shaped `gate` and `up` (K3: β = 4, λ = 25).
pub fn situ_glu(gate: &CudaTensor, up: &CudaTensor, beta: f32, linear_beta: f32, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda situ_glu";
    check_like(OP, gate, &[up, out])?;
    let name = if suffix(OP, gate)? == "f32" { "situ_glu_f32" } else { "situ_glu_bf16" };
    let n = gate.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = gate.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let (gp, up_, op) = (gate.ptr(), up.ptr(), out.ptr());
    dev.launch(ACT, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![gp, up_, op, n, beta, linear_beta])
}

/// Numerically stable softmax over the last dimension; an all-`-inf` row becomes zeros.
pub fn softmax(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda softmax";
    check_like(OP, x, &[out])?;
    let name = if suffix(OP, x)? == "f32" { "softmax_f32" } else { "softmax_bf16" };
    let (d, rows) = rows_of(OP, x)?;
    if rows == 0 || d == 0 {
        return Ok(());
    }
    let (xp, op) = (x.ptr(), out.ptr());
    x.cuda_device().launch(SOFTMAX, name, (rows, 1, 1), (row_block(d as usize), 1, 1), 0, &mut kargs![xp, op, d])
}

/// Converts between F32 and BF16 (round to nearest even); same shape, same device.
pub fn cast(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda cast";
    if x.shape() != out.shape() || !x.cuda_device().same(out.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("{x:?} -> {out:?}") });
    }
    let name = match (x.dtype(), out.dtype()) {
        (DType::F32, DType::BF16) => "cast_f32_bf16",
        (DType::BF16, DType::F32) => "cast_bf16_f32",
        (a, b) if a == b => return if x.ptr() == out.ptr() { Ok(()) } else { out.copy_from(x) },
        (a, b) => return Err(CoreError::DType { op: OP, dtype: format!("{a} -> {b}") }),
    };
    let n = x.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = x.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let (xp, op) = (x.ptr(), out.ptr());
    dev.launch(ACT, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, op, n])
}

/// How [`attn_res_norm`] updates the partial sum `P` before mixing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResUpdate {
    /// Leave `P` as it is.
    Keep,
    /// `P += d`.
    Add,
    /// `P = d` (the first layer output of a new block).
    Assign,
}

/// Most completed blocks one mix can take (the kernel's source array).
pub const ATTN_RES_MAX_BLOCKS: usize = 63;
/// Up to this many rows, [`attn_res_norm`] runs its split form: three kernels over
/// (column slices × rows) instead of one block per row, so a decode step's few rows use many SMs.
const ATTN_RES_SPLIT_ROWS: usize = 16;
/// Columns per block of the split form (`ARES_SL` in attn_res.cu).
const ATTN_RES_SLICE: usize = 512;

/// Block Attention Residuals (text-backbone §6) fused with the RMSNorm after it, per row of
/// width `H`: first `P` (F32 `[N, H]`) is updated in place by `update` with `d`, and copied to
/// `snap` when given (the snapshot that becomes a completed block); then the sources `blocks`
/// (F32 `[N, H]` each) followed by `P` are mixed with the pseudo-query `c` (F32 `[H]`) and
/// `eps_res`, and `out = RMSNorm(mix; w, eps)` (w F32 `[H]`) is written as BF16 or F32 `[N, H]`.
pub fn attn_res_norm(
    blocks: &[&CudaTensor],
    p: &CudaTensor,
    update: ResUpdate,
    d: Option<&CudaTensor>,
    snap: Option<&CudaTensor>,
    c: &CudaTensor,
    eps_res: f32,
    w: &CudaTensor,
    eps: f32,
    out: &CudaTensor,
) -> Result<()> {
    const OP: &str = "cuda attn_res_norm";
    if p.dtype() != DType::F32 {
        return Err(CoreError::DType { op: OP, dtype: format!("partial sum P must be F32, got {}", p.dtype()) });
    }
    let mut like: Vec<&CudaTensor> = blocks.to_vec();
    like.extend(d);
    like.extend(snap);
    check_like(OP, p, &like)?;
    if update != ResUpdate::Keep && d.is_none() {
        return Err(CoreError::Shape { op: OP, detail: "update Add/Assign needs the layer output d".into() });
    }
    if blocks.len() > ATTN_RES_MAX_BLOCKS {
        return Err(CoreError::Shape {
            op: OP,
            detail: format!("{} completed blocks exceed the kernel's {ATTN_RES_MAX_BLOCKS}; raise attn_res_block_size", blocks.len()),
        });
    }
    let (h, rows) = rows_of(OP, p)?;
    for (t, what) in [(c, "pseudo-query c"), (w, "norm weight")] {
        if t.dtype() != DType::F32 || t.numel() != h as usize || !t.cuda_device().same(p.cuda_device()) {
            return Err(CoreError::Shape { op: OP, detail: format!("{what} {t:?} must be F32 [{h}] on the same device as P") });
        }
    }
    if out.shape() != p.shape() || !out.cuda_device().same(p.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("out {out:?} must have P's shape {:?}", p.shape()) });
    }
    let name = match suffix(OP, out)? {
        "f32" => "attn_res_norm_f32",
        _ => "attn_res_norm_bf16",
    };
    if rows == 0 || h == 0 {
        return Ok(());
    }
    let mut srcs = [0u64; ATTN_RES_MAX_BLOCKS + 1];
    for (s, b) in srcs.iter_mut().zip(blocks) {
        *s = b.ptr();
    }
    let nsrc = blocks.len() as i32;
    let mode: i32 = match update {
        ResUpdate::Keep => 0,
        ResUpdate::Add => 1,
        ResUpdate::Assign => 2,
    };
    let (pp, dp, sp) = (p.ptr(), d.map_or(0, |t| t.ptr()), snap.map_or(0, |t| t.ptr()));
    let (cp, wp, op) = (c.ptr(), w.ptr(), out.ptr());
    let dev = p.cuda_device();
    let aligned = [pp, dp, sp, cp, wp, op].iter().chain(&srcs).all(|a| a % 16 == 0);
    if rows as usize <= ATTN_RES_SPLIT_ROWS && h % 4 == 0 && aligned {
        // Few rows (decode): spread each row over S blocks (see attn_res.cu, split form).
        let (n, slices) = (blocks.len() + 1, (h as usize).div_ceil(ATTN_RES_SLICE));
        let part = CudaTensor::uninit(dev, DType::F32, vec![rows as usize, slices, 2 * n])?; // [N, S, 2n]
        let mix = CudaTensor::uninit(dev, DType::F32, vec![rows as usize, h as usize])?; // [N, H]
        let msq = CudaTensor::uninit(dev, DType::F32, vec![rows as usize, slices])?; // [N, S]
        let (grid, block) = ((slices as u32, rows, 1), (ATTN_RES_SLICE as u32 / 4, 1, 1));
        let (part_p, mix_p, msq_p) = (part.ptr(), mix.ptr(), msq.ptr());
        dev.launch(ATTN_RES, "attn_res_stats", grid, block, 0, &mut kargs![srcs, nsrc, pp, dp, mode, sp, cp, part_p, h])?;
        dev.launch(ATTN_RES, "attn_res_mix", grid, block, 0, &mut kargs![srcs, nsrc, pp, eps_res, part_p, mix_p, msq_p, h])?;
        let scale = if name == "attn_res_norm_f32" { "attn_res_scale_f32" } else { "attn_res_scale_bf16" };
        return dev.launch(ATTN_RES, scale, grid, block, 0, &mut kargs![mix_p, msq_p, wp, eps, op, h]);
    }
    // mix[h] | sums[2 (B + 2)] | pw[B + 2] | scratch[32] | the 16 warps' partials [16][2n]
    // (attn_res.cu), B = ATTN_RES_MAX_BLOCKS, n = blocks + 1.
    let smem = ((h as usize + 3 * (ATTN_RES_MAX_BLOCKS + 2) + 32 + (512 / 32) * 2 * (blocks.len() + 1)) * 4) as u32;
    if smem > 48 * 1024 {
        return Err(CoreError::Shape { op: OP, detail: format!("hidden size {h} needs {smem} bytes of shared memory (48 KiB max)") });
    }
    dev.launch(ATTN_RES, name, (rows, 1, 1), (512, 1, 1), smem, &mut kargs![srcs, nsrc, pp, dp, mode, sp, cp, eps_res, wp, eps, op, h])
}

/// RMSNorm of the first `cols` columns of every row of `x` (F32 or BF16, any row width ≥ cols)
/// with an F32 weight `[cols]`, written to the first `cols` columns of `out`'s rows (F32 or BF16,
/// same row count). The other columns of `out` are untouched.
pub fn rms_norm_cols(x: &CudaTensor, cols: usize, w: &CudaTensor, eps: f32, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda rms_norm_cols";
    let (li, rows) = rows_of(OP, x)?;
    let (lo, rows_out) = rows_of(OP, out)?;
    if rows != rows_out || cols > li as usize || cols > lo as usize || !out.cuda_device().same(x.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("x {x:?}, out {out:?}: need equal row counts and rows of at least {cols} columns") });
    }
    if w.dtype() != DType::F32 || w.numel() != cols || !w.cuda_device().same(x.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("weight {w:?} must be F32 [{cols}]") });
    }
    let name = match (suffix(OP, x)?, suffix(OP, out)?) {
        ("f32", "f32") => "rms_norm_w_f32_f32",
        ("f32", _) => "rms_norm_w_f32_bf16",
        (_, "f32") => "rms_norm_w_bf16_f32",
        _ => "rms_norm_w_bf16_bf16",
    };
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let (xp, wp, op, d) = (x.ptr(), w.ptr(), out.ptr(), cols as i32);
    x.cuda_device().launch(NORM, name, (rows, 1, 1), (row_block(cols), 1, 1), 0, &mut kargs![xp, wp, op, d, li, lo, eps])
}

/// `x = x · σ(g)` elementwise, BF16 or F32, in place (the gated attention output).
pub fn sigmoid_mul(x: &CudaTensor, g: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda sigmoid_mul";
    check_like(OP, x, &[g])?;
    let name = if suffix(OP, x)? == "f32" { "sigmoid_mul_f32" } else { "sigmoid_mul_bf16" };
    let n = x.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = x.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let (xp, gp) = (x.ptr(), g.ptr());
    dev.launch(ACT, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, gp, n])
}

/// `y += x` elementwise, F32.
pub fn add_assign(y: &CudaTensor, x: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda add_assign";
    check_like(OP, y, &[x])?;
    if y.dtype() != DType::F32 {
        return Err(CoreError::DType { op: OP, dtype: y.dtype().to_string() });
    }
    let n = y.numel() as i64;
    if n == 0 {
        return Ok(());
    }
    let dev = y.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let (yp, xp) = (y.ptr(), x.ptr());
    dev.launch(ACT, "add_f32", (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![yp, xp, n])
}

/// `out[i, :] = src[ids[i], :]`: `src` `[R, H]` (BF16 → F32/BF16, or F32 → F32), `ids` I32 `[n]`
/// (values checked by the caller: device values are not read back), `out` `[n, H]`.
pub fn gather_rows(src: &CudaTensor, ids: &CudaTensor, out: &CudaTensor) -> Result<()> {
    gather_rows_from(src, ids, 0, out)
}

/// [`gather_rows`] where `src` holds rows `first..first + R` of a larger table (one
/// tensor-parallel rank's vocabulary rows): `out[i, :] = src[ids[i] - first, :]`, and zero for
/// ids outside that range (another rank's rows; the group's sum completes the lookup).
pub fn gather_rows_from(src: &CudaTensor, ids: &CudaTensor, first: usize, out: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda gather_rows";
    let h = src.last_dim();
    let n = ids.numel();
    if ids.dtype() != DType::I32
        || out.numel() != n * h
        || out.last_dim() != h
        || !ids.cuda_device().same(src.cuda_device())
        || !out.cuda_device().same(src.cuda_device())
    {
        return Err(CoreError::Shape { op: OP, detail: format!("src {src:?}, ids {ids:?} (I32 [n]), out {out:?} (must be [n, {h}])") });
    }
    let name = match (src.dtype(), out.dtype()) {
        (DType::BF16, DType::F32) => "gather_rows_bf16_f32",
        (DType::BF16, DType::BF16) => "gather_rows_bf16_bf16",
        (DType::F32, DType::F32) => "gather_rows_f32_f32",
        (a, b) => return Err(CoreError::DType { op: OP, dtype: format!("{a} -> {b}") }),
    };
    if n == 0 || h == 0 {
        return Ok(());
    }
    let rows = src.numel() / h;
    let (first32, rows32) = match (i32::try_from(first), i32::try_from(rows)) {
        (Ok(f), Ok(r)) => (f, r),
        _ => return Err(CoreError::Shape { op: OP, detail: format!("rows {first}..{} exceed i32", first + rows) }),
    };
    let (sp, ip, op, n32, h32) = (src.ptr(), ids.ptr(), out.ptr(), n as i32, h as i32);
    // Threads move 8 elements each; a row spans h / (8·128) column blocks (7 for H = 7168).
    let block = 128usize;
    let grid = (h.div_ceil(8 * block) as u32, n.min(65_535) as u32, 1);
    src.cuda_device().launch(COPY, name, grid, (block as u32, 1, 1), 0, &mut kargs![sp, ip, op, n32, h32, first32, rows32])
}

/// `dst[t, r·w + c] = src[r, t, c]`: rank-major all-gathered blocks `src` `[S, T, w]` back to
/// rows `dst` `[T, S·w]` (BF16 or F32, same dtype).
pub fn unblock(src: &CudaTensor, dst: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda unblock";
    let (s, t, w) = match src.shape() {
        [s, t, w] => (*s, *t, *w),
        _ => return Err(CoreError::Shape { op: OP, detail: format!("src {src:?} must be [S, T, w]") }),
    };
    if dst.shape() != [t, s * w] || dst.dtype() != src.dtype() || !dst.cuda_device().same(src.cuda_device()) {
        return Err(CoreError::Shape { op: OP, detail: format!("dst {dst:?} must be [{t}, {}] of {}", s * w, src.dtype()) });
    }
    let name = match src.dtype() {
        DType::F32 => "unblock_f32",
        DType::BF16 => "unblock_bf16",
        d => return Err(CoreError::DType { op: OP, dtype: d.to_string() }),
    };
    if src.numel() == 0 {
        return Ok(());
    }
    let big = |v: usize| i32::try_from(v).map_err(|_| CoreError::Shape { op: OP, detail: format!("{src:?} exceeds i32") });
    let (s32, t32, w32) = (big(s)?, big(t)?, big(w)?);
    let dev = src.cuda_device();
    let grid = dev.elementwise_grid(src.numel(), EW_BLOCK);
    let (sp, dp) = (src.ptr(), dst.ptr());
    dev.launch(COPY, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![sp, dp, s32, t32, w32])
}

/// `dst[idx[i], :] = src[i, :]` for every `i` whose `idx[i]` (device I32 `[n]`) lies in
/// `0..R`, bit for bit; other rows are skipped. `src` `[n, ...]` and `dst` `[R, ...]` have the same
/// dtype (2- or 4-byte elements) and row size. CUDA-graph capturable (the indices are read on the
/// device): a rollback restores its KDA checkpoints into their pool slots with it.
pub fn scatter_rows(src: &CudaTensor, idx: &CudaTensor, dst: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda scatter_rows";
    let n = idx.numel();
    let rows = dst.shape().first().copied().unwrap_or(0);
    let row_bytes = dst.byte_len().checked_div(rows).unwrap_or(0);
    if idx.dtype() != DType::I32
        || src.dtype() != dst.dtype()
        || src.shape().first() != Some(&n)
        || src.byte_len() != n * row_bytes
        || !idx.cuda_device().same(dst.cuda_device())
        || !src.cuda_device().same(dst.cuda_device())
    {
        return Err(CoreError::Shape { op: OP, detail: format!("src {src:?} (must be [n, ...] rows of dst's), idx {idx:?} (I32 [n]), dst {dst:?}") });
    }
    if n == 0 || row_bytes == 0 {
        return Ok(());
    }
    let fits = |w: usize| row_bytes.is_multiple_of(w) && src.ptr().is_multiple_of(w as u64) && dst.ptr().is_multiple_of(w as u64);
    let (name, word) = match (fits(4), fits(2)) {
        (true, _) => ("scatter_rows_u32", 4),
        (false, true) => ("scatter_rows_u16", 2),
        _ => return Err(CoreError::DType { op: OP, dtype: format!("{} (rows of {row_bytes} bytes; 2- or 4-byte words)", src.dtype()) }),
    };
    let (n32, r32) = match (i32::try_from(n), i32::try_from(rows)) {
        (Ok(a), Ok(b)) => (a, b),
        _ => return Err(CoreError::Shape { op: OP, detail: format!("{n} rows into {rows} exceed i32") }),
    };
    let w = (row_bytes / word) as i64;
    let dev = dst.cuda_device();
    let grid = ((w as usize).div_ceil(EW_BLOCK as usize).min(1024) as u32, n.min(65_535) as u32, 1);
    let (sp, ip, dp) = (src.ptr(), idx.ptr(), dst.ptr());
    dev.launch(COPY, name, grid, (EW_BLOCK, 1, 1), 0, &mut kargs![sp, ip, dp, n32, w, r32])
}

/// `x += delta` in place on an I32 tensor (global expert ids to one rank's local ids).
pub fn shift_i32(x: &CudaTensor, delta: i32) -> Result<()> {
    if x.dtype() != DType::I32 {
        return Err(CoreError::DType { op: "cuda shift_i32", dtype: x.dtype().to_string() });
    }
    let n = x.numel() as i64;
    if n == 0 || delta == 0 {
        return Ok(());
    }
    let dev = x.cuda_device();
    let grid = dev.elementwise_grid(n as usize, EW_BLOCK);
    let xp = x.ptr();
    dev.launch(COPY, "shift_i32", (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![xp, delta, n])
}

/// Copies `rows` rows of `width` BF16 elements from device address `src` (row stride `src_stride`
/// elements) to `dst` (row stride `dst_stride`). The caller guarantees both ranges lie inside
/// live tensors of `dev` (this is the raw form used to address a slice of a wider tensor).
pub fn copy_strided_bf16(dev: &super::CudaDevice, src: u64, src_stride: usize, dst: u64, dst_stride: usize, rows: usize, width: usize) -> Result<()> {
    copy_strided(dev, DType::BF16, src, src_stride, dst, dst_stride, rows, width)
}

/// [`copy_strided_bf16`] for elements of `dtype` (BF16 or F32); strides in elements.
pub fn copy_strided(dev: &super::CudaDevice, dtype: DType, src: u64, src_stride: usize, dst: u64, dst_stride: usize, rows: usize, width: usize) -> Result<()> {
    const OP: &str = "cuda copy_strided";
    let name = match dtype {
        DType::BF16 => "copy_strided_bf16",
        DType::F32 => "copy_strided_f32",
        d => return Err(CoreError::DType { op: OP, dtype: d.to_string() }),
    };
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let (ss, ds, r, w) = (src_stride as i64, dst_stride as i64, rows as i32, width as i32);
    let grid = dev.elementwise_grid(rows * width, EW_BLOCK);
    dev.launch(COPY, name, (grid, 1, 1), (EW_BLOCK, 1, 1), 0, &mut kargs![src, ss, dst, ds, r, w])
}
