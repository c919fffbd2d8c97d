//! Launchers for k3rs's own CUDA kernels (`kernels/cuda/*.cu`): RMSNorm, sigmoid, SiLU,
//! SiTU-GLU, row softmax and f32↔bf16 casts. Each takes its inputs and its output as
//! [`CudaTensor`]s of one device, checks dtypes and shapes, and enqueues one kernel on the
//! device's compute stream. F32 and BF16 storage are supported; arithmetic is f32. The same
//! tensor may be passed as input and output (in place). The CPU functions of the same names
//! in `kernels::cpu` are the oracle (`tests/cuda_ops.rs`).

use super::{kargs, CudaTensor};
use crate::kernels::cuda::{ACT, NORM, SOFTMAX};
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
    let r32 = u32::try_from(rows).ok().filter(|&r| r < (1 << 31)).ok_or_else(|| CoreError::Shape { op, detail: format!("{rows} rows exceed the grid limit") })?;
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
