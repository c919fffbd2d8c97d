//! Stable LatentMoE routed experts on the GPU (text-backbone §7.2–7.5; MXFP4 per
//! around-backbone §2): the router's top-k ([`route`]) and the routed experts
//! ([`experts_forward`]). Kernels are in `kernels/cuda/moe.cu` and `moe_mma.cu` (tensor-core decode); the CPU oracle is k3-model's
//! `layers/moe.rs` (`route`, `expert_forward`, `forward`) with `kernels::cpu::mxfp4` and
//! `kernels::cpu::act::situ_glu`.
//!
//! Shapes: T tokens, E experts, k = top-k, L = latent width (`routed_expert_hidden_size`),
//! F = expert width (`moe_intermediate_size`); L and F multiples of 32.
//!
//! Device-grouped path (T ≤ [`mma_max_tokens`], capturable): `moe_group` (one block) counts the
//! (token, slot) pairs per expert on the device and writes the active experts (ascending id),
//! their group starts/sizes and the pairs sorted by expert (stable by token); grids are sized
//! for the worst case min(E, T·k) active experts (blocks of inactive slots exit at once).
//! T ≥ 2 (tensor cores, `moe_mma_*`): one block per (row tile, active expert), its 4 warps
//! splitting K; mma.m16n8k16 bf16 with f32 accumulation, weights as A (MXFP4 decoded to bf16
//! in registers, E8M0 scale applied exactly to each 32-column group's f32 partial), the
//! expert's tokens as B (8 per n-tile, up to [`DECODE_MAX_TOKENS`] per pass, more in further
//! passes); `w1`/`w3` tiles share a block so
//! SiTU-GLU is fused, the intermediate rounded to BF16 (the W2 operand). T = 1 (CUDA cores,
//! measured faster there): the grouped GEMV, 4 rows per warp, intermediate kept in f32. Each
//! chosen expert's weights are streamed from HBM once. Then a combine kernel sums the k slots
//! of each token in slot order (no atomics: deterministic) and applies `routed_scaling_factor`.
//!
//! Prefill path (T > [`mma_max_tokens`], NOT capturable: it reads the routing on the host):
//! `moe_prefill.rs` — the experts' GEMMs one expert at a time (`K3_MOE_PREFILL=loop`, the
//! default, MXFP4 dequantization overlapped on a side stream; `loop-serial` without), or grouped
//! into one cuBLAS call per chunk of experts (`grouped`).

pub use super::moe_prefill::{
    prefill_group, prefill_mode, set_prefill_group, set_prefill_mode, set_prefill_scratch, set_prefill_stall, PrefillMode, SCRATCH_BYTES,
};
use super::{derr, kargs, CudaTensor};
use crate::kernels::cuda::{MOE, MOE_MMA};
use crate::{CoreError, DType, Result};

/// Tokens of one expert per tensor-core pass; T up to this always takes the device-grouped
/// path, so a decode graph of up to this many rows is capturable.
pub const DECODE_MAX_TOKENS: usize = 64;
/// Default cut of the device-grouped path, in (token, expert) pairs per expert: T·k ≤ this × E
/// ([`mma_max_tokens`]). Above it the per-expert cuBLAS path wins, as its fixed cost per active
/// expert (a dequantization, a gather, two GEMMs, a scatter, a host read of the routing) is
/// spread over enough tokens, while the tensor-core kernels take one more pass over an expert's
/// weights per 64 of its tokens. Measured on the H200 (4 real-width K3 layers, 64 MXFP4
/// experts, top-16; `scripts/gpu/spec_run.sh cut`), tensor-core vs per-expert path: a verify
/// step of 80 rows (20 pairs per expert) 17.1 vs 32.9 ms, of 144 rows (36) 26.4 vs 36.0 ms, a
/// prefill of 256 tokens (64) 26.7 vs 28.4 ms, of 512 tokens (128) 51.4 vs 31.2 ms.
pub const MMA_PAIRS_PER_EXPERT: usize = 64;
/// The forced cut in tokens: `usize::MAX` not read yet, 0 the default rule.
static MMA_MAX: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Largest T the device-grouped (tensor-core, capturable) path serves for `e` experts, top-`k`:
/// `MMA_PAIRS_PER_EXPERT · e / k`, or `K3_MOE_MMA_MAX_TOKENS` from the environment (read once),
/// or [`set_mma_max_tokens`]; never below [`DECODE_MAX_TOKENS`]. A larger T also takes the
/// prefill path when its pairs do not fit the grouping kernel's shared memory.
pub fn mma_max_tokens(e: usize, k: usize) -> usize {
    use std::sync::atomic::Ordering::Relaxed;
    let forced = match MMA_MAX.load(Relaxed) {
        usize::MAX => {
            let v = std::env::var("K3_MOE_MMA_MAX_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            MMA_MAX.store(v, Relaxed);
            v
        }
        v => v,
    };
    match forced {
        0 => MMA_PAIRS_PER_EXPERT * e / k.max(1),
        v => v,
    }
    .max(DECODE_MAX_TOKENS)
}

/// Whether [`experts_forward`] of `t` tokens over `e` experts, top-`k`, takes a CUDA-graph
/// capturable path: the device-grouped one (T ≤ [`DECODE_MAX_TOKENS`], or up to
/// [`mma_max_tokens`] while the grouping kernel's shared memory holds the pairs), or the
/// reference precision (`reference`: `z` F32), which always is.
pub fn capturable(t: usize, e: usize, k: usize, reference: bool) -> bool {
    reference || t <= DECODE_MAX_TOKENS || (t <= mma_max_tokens(e, k) && 4 * (3 * e + t * k) <= SMEM)
}

/// Sets the cut of [`mma_max_tokens`] to `t` tokens for the process (A/B timing and tests;
/// `None`: back to the default rule).
pub fn set_mma_max_tokens(t: Option<usize>) {
    MMA_MAX.store(t.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
}
/// Most tokens of one expert staged in shared memory per pass (kernels `*_nt{1,2,4}`).
const NT_MAX: usize = 4;
/// Dynamic shared-memory cap of the grouped GEMV kernels (two blocks fit one SM).
const GEMV_SMEM: usize = 100 * 1024;
/// Warps per block of the grouped GEMV kernels (`MOE_WARPS` in moe.cu).
const WARPS: usize = 8;
/// Shared memory a kernel may use without raising its limit.
const SMEM: usize = 48 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    Bf16,
    Mxfp4,
    /// F32 weights: only with F32 inputs (the reference precision, `moe_ref_*`).
    F32,
}

/// One layer's routed experts, stored contiguously by expert.
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    pub format: ExpertFormat,
    pub num_experts: usize,
    pub latent: usize,
    pub inter: usize,
    /// Bf16: BF16 `[E, 2F, L]`; Mxfp4: U8 `[E, 2F, L/2]`. Rows 0..F are w1 (gate), F..2F w3 (up).
    pub w13: CudaTensor,
    /// Mxfp4: U8 `[E, 2F, L/32]`.
    pub w13_scale: Option<CudaTensor>,
    /// Bf16: BF16 `[E, L, F]`; Mxfp4: U8 `[E, L, F/2]`.
    pub w2: CudaTensor,
    /// Mxfp4: U8 `[E, L, F/32]`.
    pub w2_scale: Option<CudaTensor>,
}

/// F32 expert weights reached a BF16 path (`experts_forward` routes them to the reference one).
pub(super) fn f32_experts() -> CoreError {
    shape_err("cuda moe::experts_forward", "F32 expert weights run only with F32 inputs (the reference precision)".into())
}

pub(super) fn shape_err(op: &'static str, detail: String) -> CoreError {
    CoreError::Shape { op, detail }
}

fn expect(op: &'static str, name: &str, t: &CudaTensor, dtype: DType, shape: &[usize], like: &CudaTensor) -> Result<()> {
    if t.dtype() != dtype || t.shape() != shape || !t.cuda_device().same(like.cuda_device()) {
        return Err(shape_err(op, format!("{name} is {t:?}; it must be {dtype} {shape:?} on the same device as the other operands")));
    }
    if !t.ptr().is_multiple_of(16) {
        return Err(shape_err(op, format!("{name} must be 16-byte aligned (allocate it as its own tensor)")));
    }
    Ok(())
}

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape_err(op, format!("{what} = {v} exceeds i32")))
}

/// Router top-k: `s = sigmoid(logits)` (f32); choose the k experts with the largest `s + bias`
/// (ties → lower expert id), in descending order of that key; weight = `s / Σ_selected s` when
/// `renormalize`, else `s`. `logits` F32 `[T, E]`, `bias` F32 `[E]`, `ids` I32 `[T, k]`,
/// `weights` F32 `[T, k]`; 1 ≤ k ≤ min(E, 64). Capturable.
pub fn route(logits: &CudaTensor, bias: &CudaTensor, k: usize, renormalize: bool, ids: &CudaTensor, weights: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda moe::route";
    if logits.dtype() != DType::F32 || logits.shape().len() != 2 {
        return Err(shape_err(OP, format!("logits must be F32 [T, E], got {logits:?}")));
    }
    let (t, e) = (logits.shape()[0], logits.shape()[1]);
    if k == 0 || k > e || k > 64 {
        return Err(shape_err(OP, format!("k = {k} must be in 1..=min(E = {e}, 64)")));
    }
    if 12 * e > SMEM {
        return Err(shape_err(OP, format!("E = {e} experts exceed the router kernel's shared memory (at most {})", SMEM / 12)));
    }
    expect(OP, "bias", bias, DType::F32, &[e], logits)?;
    expect(OP, "ids", ids, DType::I32, &[t, k], logits)?;
    expect(OP, "weights", weights, DType::F32, &[t, k], logits)?;
    if t == 0 {
        return Ok(());
    }
    let dev = logits.cuda_device();
    let grid = u32::try_from(t).map_err(|_| shape_err(OP, format!("T = {t} exceeds the grid")))?;
    let (lp, bp, ip, wp) = (logits.ptr(), bias.ptr(), ids.ptr(), weights.ptr());
    let (e32, k32, rn) = (i32_of(OP, "E", e)?, k as i32, renormalize as i32);
    // One thread per expert up to 1024 (each ranks its experts against all E).
    let block = (e.div_ceil(32) * 32).clamp(32, 1024) as u32;
    dev.launch(MOE, "moe_route", (grid, 1, 1), (block, 1, 1), (12 * e) as u32, &mut kargs![lp, bp, e32, k32, rn, ip, wp])
}

impl ExpertWeights {
    /// Checks every tensor against the declared format and dims.
    fn validate(&self, op: &'static str, like: &CudaTensor) -> Result<()> {
        let (e, l, f) = (self.num_experts, self.latent, self.inter);
        if e == 0 || l == 0 || f == 0 || l % 32 != 0 || f % 32 != 0 {
            return Err(shape_err(op, format!("experts need E > 0 and L, F positive multiples of 32; got E = {e}, L = {l}, F = {f}")));
        }
        match self.format {
            ExpertFormat::Bf16 => {
                expect(op, "w13", &self.w13, DType::BF16, &[e, 2 * f, l], like)?;
                expect(op, "w2", &self.w2, DType::BF16, &[e, l, f], like)?;
            }
            ExpertFormat::F32 => {
                expect(op, "w13", &self.w13, DType::F32, &[e, 2 * f, l], like)?;
                expect(op, "w2", &self.w2, DType::F32, &[e, l, f], like)?;
            }
            ExpertFormat::Mxfp4 => {
                let missing = |n: &str| shape_err(op, format!("MXFP4 experts need {n} (U8 E8M0 scales)"));
                expect(op, "w13", &self.w13, DType::U8, &[e, 2 * f, l / 2], like)?;
                expect(op, "w13_scale", self.w13_scale.as_ref().ok_or_else(|| missing("w13_scale"))?, DType::U8, &[e, 2 * f, l / 32], like)?;
                expect(op, "w2", &self.w2, DType::U8, &[e, l, f / 2], like)?;
                expect(op, "w2_scale", self.w2_scale.as_ref().ok_or_else(|| missing("w2_scale"))?, DType::U8, &[e, l, f / 32], like)?;
            }
        }
        Ok(())
    }

    pub(super) fn scale_ptrs(&self) -> (u64, u64) {
        (self.w13_scale.as_ref().map_or(0, |s| s.ptr()), self.w2_scale.as_ref().map_or(0, |s| s.ptr()))
    }
}

/// `out[t] = scaling · Σ_j weights[t,j] · w2_e · SiTU-GLU(w1_e z[t], w3_e z[t])`, `e = ids[t,j]`,
/// f32 accumulation. `z` BF16 `[T, L]`, `ids` I32 `[T, k]`, `weights` F32 `[T, k]`, `out` F32
/// `[T, L]`. A slot whose id is outside 0..E contributes nothing. Deterministic (fixed
/// summation order, no float atomics); each chosen expert's weights are read once per call.
/// T ≤ [`mma_max_tokens`]: capturable (SiTU-GLU intermediate rounded to BF16 for T ≥ 2,
/// f32 at T = 1). T larger: the prefill path, NOT capturable (reads the routing on the host;
/// intermediate rounded to BF16). `z` F32 is the reference precision: any expert format (F32
/// experts only there), every product and the intermediate in f32, any T, capturable.
pub fn experts_forward(
    z: &CudaTensor,
    ids: &CudaTensor,
    weights: &CudaTensor,
    w: &ExpertWeights,
    beta: f32,
    linear_beta: f32,
    scaling: f32,
    out: &CudaTensor,
) -> Result<()> {
    const OP: &str = "cuda moe::experts_forward";
    let reference = z.dtype() == DType::F32;
    if !(z.dtype() == DType::BF16 || reference) || z.shape().len() != 2 || z.shape()[1] != w.latent {
        return Err(shape_err(OP, format!("z must be BF16 (or F32: reference precision) [T, L = {}], got {z:?}", w.latent)));
    }
    if w.format == ExpertFormat::F32 && !reference {
        return Err(f32_experts());
    }
    let t = z.shape()[0];
    w.validate(OP, z)?;
    if ids.shape().len() != 2 || ids.shape()[0] != t {
        return Err(shape_err(OP, format!("ids must be I32 [T = {t}, k], got {ids:?}")));
    }
    let k = ids.shape()[1];
    expect(OP, "ids", ids, DType::I32, &[t, k], z)?;
    expect(OP, "weights", weights, DType::F32, &[t, k], z)?;
    expect(OP, "out", out, DType::F32, &[t, w.latent], z)?;
    if t == 0 {
        return Ok(());
    }
    if k == 0 {
        return out.fill_bytes(0);
    }
    let pairs = if reference {
        reference_pairs(z, ids, w, t, k, beta, linear_beta)?
    } else if !capturable(t, w.num_experts, k, false) {
        super::moe_prefill::prefill(z, ids, w, t, k, beta, linear_beta)?
    } else if decode_kind(t) == DecodeKind::Gemv {
        decode(z, ids, w, t, k, beta, linear_beta)?
    } else {
        decode_mma(z, ids, w, t, k, beta, linear_beta)?
    };
    pairs.combine(ids, weights, w, t, k, scaling, out)
}

/// The reference precision: `moe_ref_w13` then `moe_ref_w2` over every (pair, row), weights read
/// in their stored format and used in f32, the SiTU-GLU intermediate kept in f32.
fn reference_pairs(z: &CudaTensor, ids: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, beta: f32, lbeta: f32) -> Result<Pairs> {
    const OP: &str = "cuda moe::experts_forward (reference)";
    let dev = z.cuda_device();
    let (e, l, f, n_pairs) = (w.num_experts, w.latent, w.inter, t * k);
    let np = u32::try_from(n_pairs).ok().filter(|&v| v <= 65_535).ok_or_else(|| shape_err(OP, format!("T·k = {n_pairs} pairs exceed the grid (65535)")))?;
    let act = CudaTensor::uninit(dev, DType::F32, vec![n_pairs, f])?;
    let y = CudaTensor::uninit(dev, DType::F32, vec![n_pairs, l])?;
    let fmt: i32 = match w.format {
        ExpertFormat::F32 => 0,
        ExpertFormat::Bf16 => 1,
        ExpertFormat::Mxfp4 => 2,
    };
    let (s13, s2) = w.scale_ptrs();
    let (zp, ip, ap, yp, w13p, w2p) = (z.ptr(), ids.ptr(), act.ptr(), y.ptr(), w.w13.ptr(), w.w2.ptr());
    let (np32, k32, e32, f32_, l32) = (n_pairs as i32, k as i32, i32_of(OP, "E", e)?, i32_of(OP, "F", f)?, i32_of(OP, "L", l)?);
    let block = (32 * WARPS as u32, 1, 1);
    dev.launch(
        MOE,
        "moe_ref_w13",
        (f.div_ceil(WARPS) as u32, np, 1),
        block,
        0,
        &mut kargs![zp, ip, np32, k32, e32, w13p, s13, fmt, f32_, l32, beta, lbeta, ap],
    )?;
    dev.launch(MOE, "moe_ref_w2", (l.div_ceil(WARPS) as u32, np, 1), block, 0, &mut kargs![ap, ip, np32, e32, w2p, s2, fmt, f32_, l32, yp])?;
    Ok(Pairs { y, pos: None })
}

/// The per-pair expert outputs, ready for [`Pairs::combine`]: `y` F32 `[T·k, L]` with row
/// p = t·k + j; or, with `pos` (the grouped prefill), `y` BF16 `[P, L]` in expert order, pair p's
/// row at `pos[p]` (I32 `[T·k]`, −1 for a slot without a valid expert).
pub(super) struct Pairs {
    pub(super) y: CudaTensor,
    pub(super) pos: Option<CudaTensor>,
}

impl Pairs {
    /// `out[t] = scaling · Σ_j w[t, j] · y(t·k + j)`, j ascending (deterministic).
    fn combine(&self, ids: &CudaTensor, weights: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, scaling: f32, out: &CudaTensor) -> Result<()> {
        let dev = out.cuda_device();
        let grid = dev.elementwise_grid(t * w.latent, 256);
        let (yp, ip, wp, op) = (self.y.ptr(), ids.ptr(), weights.ptr(), out.ptr());
        let (t32, k32, e32, l32) = (t as i32, k as i32, w.num_experts as i32, w.latent as i32);
        match &self.pos {
            None => dev.launch(MOE, "moe_combine", (grid, 1, 1), (256, 1, 1), 0, &mut kargs![yp, ip, wp, t32, k32, e32, l32, scaling, op]),
            Some(pos) => {
                let pp = pos.ptr();
                dev.launch(MOE, "moe_combine_sorted", (grid, 1, 1), (256, 1, 1), 0, &mut kargs![yp, pp, wp, t32, k32, l32, scaling, op])
            }
        }
    }
}

/// Tokens per shared-memory pass for inputs of width `cols` (f32 staging): 1, 2 or 4, the
/// fewest covering min(T, 4), halved while the staging would exceed [`GEMV_SMEM`].
fn tokens_per_pass(op: &'static str, t: usize, cols: usize) -> Result<usize> {
    let mut n = t.min(NT_MAX).next_power_of_two();
    while n > 1 && n * cols * 4 > GEMV_SMEM {
        n /= 2;
    }
    if cols * 4 > GEMV_SMEM {
        return Err(shape_err(op, format!("width {cols} is too wide for the decode kernels (at most {})", GEMV_SMEM / 4)));
    }
    Ok(n)
}

/// The grouped-GEMV kernel for (format, stage, tokens per pass).
fn gemv_kernel(format: ExpertFormat, w13: bool, nt: usize) -> Result<&'static str> {
    Ok(match (format, w13, nt) {
        (ExpertFormat::Mxfp4, true, 1) => "moe_w13_mxfp4_nt1",
        (ExpertFormat::Mxfp4, true, 2) => "moe_w13_mxfp4_nt2",
        (ExpertFormat::Mxfp4, true, _) => "moe_w13_mxfp4_nt4",
        (ExpertFormat::Bf16, true, 1) => "moe_w13_bf16_nt1",
        (ExpertFormat::Bf16, true, 2) => "moe_w13_bf16_nt2",
        (ExpertFormat::Bf16, true, _) => "moe_w13_bf16_nt4",
        (ExpertFormat::Mxfp4, false, 1) => "moe_w2_mxfp4_nt1",
        (ExpertFormat::Mxfp4, false, 2) => "moe_w2_mxfp4_nt2",
        (ExpertFormat::Mxfp4, false, _) => "moe_w2_mxfp4_nt4",
        (ExpertFormat::Bf16, false, 1) => "moe_w2_bf16_nt1",
        (ExpertFormat::Bf16, false, 2) => "moe_w2_bf16_nt2",
        (ExpertFormat::Bf16, false, _) => "moe_w2_bf16_nt4",
        (ExpertFormat::F32, ..) => return Err(f32_experts()),
    })
}

/// Lets `name` use `smem` bytes of dynamic shared memory (needed above 48 KiB).
fn allow_smem(dev: &super::CudaDevice, name: &'static str, smem: usize) -> Result<()> {
    if smem > SMEM {
        use cudarc::driver::sys::CUfunction_attribute_enum as A;
        dev.function(MOE, name)?
            .set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(derr("raising the dynamic shared-memory limit"))?;
    }
    Ok(())
}

/// The decode paths' grouping (`moe_group`, one block): the `meta` table of moe.cu for the T·k
/// (token, slot) pairs over E experts, with room for min(E, T·k) active experts (`amax`).
fn group_pairs(op: &'static str, ids: &CudaTensor, e: usize, n_pairs: usize) -> Result<(CudaTensor, usize)> {
    let dev = ids.cuda_device();
    let amax = e.min(n_pairs);
    let group_smem = 4 * (3 * e + n_pairs);
    if group_smem > SMEM {
        return Err(shape_err(op, format!("E = {e} with T·k = {n_pairs} pairs exceeds the grouping kernel's shared memory")));
    }
    let meta = CudaTensor::uninit(dev, DType::I32, vec![1 + 3 * amax + n_pairs])?;
    let (ip, mp) = (ids.ptr(), meta.ptr());
    let (np32, e32, am32) = (n_pairs as i32, e as i32, amax as i32);
    dev.launch(MOE, "moe_group", (1, 1, 1), (1024, 1, 1), group_smem as u32, &mut kargs![ip, np32, e32, am32, mp])?;
    Ok((meta, amax))
}

fn decode(z: &CudaTensor, ids: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, beta: f32, lbeta: f32) -> Result<Pairs> {
    const OP: &str = "cuda moe::experts_forward (decode)";
    let dev = z.cuda_device();
    let (e, l, f) = (w.num_experts, w.latent, w.inter);
    let n_pairs = t * k;
    let (nt13, nt2) = (tokens_per_pass(OP, t, l)?, tokens_per_pass(OP, t, f)?);
    let (k13, k2) = (gemv_kernel(w.format, true, nt13)?, gemv_kernel(w.format, false, nt2)?);
    let (sm13, sm2) = (nt13 * l * 4, nt2 * f * 4);
    allow_smem(dev, k13, sm13)?;
    allow_smem(dev, k2, sm2)?;
    let (meta, amax) = group_pairs(OP, ids, e, n_pairs)?;
    let act = CudaTensor::uninit(dev, DType::F32, vec![n_pairs, f])?;
    let y = CudaTensor::uninit(dev, DType::F32, vec![n_pairs, l])?;
    let (mp, am32, k32) = (meta.ptr(), amax as i32, k as i32);
    let (s13, s2) = w.scale_ptrs();
    let (zp, ap, yp, w13p, w2p) = (z.ptr(), act.ptr(), y.ptr(), w.w13.ptr(), w.w2.ptr());
    let (f2, l32, f32_) = (2 * f as i32, l as i32, f as i32);
    let block = (32 * WARPS as u32, 1, 1);
    // W13: 2 output rows (4 weight rows) per warp; W2: 4 rows per warp.
    let g13 = (f.div_ceil(2 * WARPS) as u32, amax as u32, 1);
    dev.launch(MOE, k13, g13, block, sm13 as u32, &mut kargs![zp, mp, am32, k32, w13p, s13, f2, l32, beta, lbeta, ap])?;
    let g2 = (l.div_ceil(4 * WARPS) as u32, amax as u32, 1);
    dev.launch(MOE, k2, g2, block, sm2 as u32, &mut kargs![ap, mp, am32, k32, w2p, s2, l32, f32_, beta, lbeta, yp])?;
    Ok(Pairs { y, pos: None })
}

/// Which device-grouped kernels serve T ≤ [`mma_max_tokens`]: the CUDA-core grouped GEMV at T = 1
/// (measured faster there on the H200: 190 vs 211 µs MXFP4, 288 vs 353 µs BF16 at real dims),
/// the tensor-core grouped GEMM above. `K3_MOE_DECODE=gemv` or `=mma` forces one (read once;
/// for A/B timing).
#[derive(Clone, Copy, PartialEq, Eq)]
enum DecodeKind {
    Mma,
    Gemv,
}

fn decode_kind(t: usize) -> DecodeKind {
    static FORCED: std::sync::OnceLock<Option<DecodeKind>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("K3_MOE_DECODE").as_deref() {
        Ok("gemv") => Some(DecodeKind::Gemv),
        Ok("mma") => Some(DecodeKind::Mma),
        _ => None,
    });
    forced.unwrap_or(if t == 1 { DecodeKind::Gemv } else { DecodeKind::Mma })
}

/// Warps per block of the tensor-core kernels (`MMA_WARPS` in moe.cu).
const MMA_WARPS: usize = 4;
/// The tensor-core kernel for (format, stage, n-tiles of 8 tokens per pass).
fn mma_kernel(format: ExpertFormat, w13: bool, nt: usize) -> &'static str {
    const NAMES: [[[&str; 4]; 2]; 2] = [
        [
            ["moe_mma_w2_bf16_n1", "moe_mma_w2_bf16_n2", "moe_mma_w2_bf16_n4", "moe_mma_w2_bf16_n8"],
            ["moe_mma_w13_bf16_n1", "moe_mma_w13_bf16_n2", "moe_mma_w13_bf16_n4", "moe_mma_w13_bf16_n8"],
        ],
        [
            ["moe_mma_w2_mxfp4_n1", "moe_mma_w2_mxfp4_n2", "moe_mma_w2_mxfp4_n4", "moe_mma_w2_mxfp4_n8"],
            ["moe_mma_w13_mxfp4_n1", "moe_mma_w13_mxfp4_n2", "moe_mma_w13_mxfp4_n4", "moe_mma_w13_mxfp4_n8"],
        ],
    ];
    let i = match nt {
        1 => 0,
        2 => 1,
        4 => 2,
        _ => 3,
    };
    NAMES[(format == ExpertFormat::Mxfp4) as usize][w13 as usize][i]
}

/// Tensor-core decode: `moe_group`, then the W13 grouped GEMM with SiTU-GLU (intermediate
/// `act` BF16 `[T·k, F]`, column-permuted within each 8 for MXFP4), then the W2 grouped GEMM.
/// Grids depend on shapes only (worst case min(E, T·k) active experts); capturable.
fn decode_mma(z: &CudaTensor, ids: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, beta: f32, lbeta: f32) -> Result<Pairs> {
    const OP: &str = "cuda moe::experts_forward (decode)";
    let dev = z.cuda_device();
    let (e, l, f) = (w.num_experts, w.latent, w.inter);
    let n_pairs = t * k;
    // n-tiles of 8 tokens per pass: covers min(T, 64) tokens (an expert has at most T tokens
    // when each token's ids are distinct; larger groups take further passes).
    let nt = t.min(DECODE_MAX_TOKENS).div_ceil(8).next_power_of_two();
    if w.format == ExpertFormat::F32 {
        return Err(f32_experts());
    }
    let (k13, k2) = (mma_kernel(w.format, true, nt), mma_kernel(w.format, false, nt));
    let (meta, amax) = group_pairs(OP, ids, e, n_pairs)?;
    let act = CudaTensor::uninit(dev, DType::BF16, vec![n_pairs, f])?;
    let y = CudaTensor::uninit(dev, DType::F32, vec![n_pairs, l])?;
    let (mp, am32, k32) = (meta.ptr(), amax as i32, k as i32);
    let (s13, s2) = w.scale_ptrs();
    let (zp, ap, yp, w13p, w2p) = (z.ptr(), act.ptr(), y.ptr(), w.w13.ptr(), w.w2.ptr());
    let (f2, l32, f32_) = (2 * f as i32, l as i32, f as i32);
    let block = (32 * MMA_WARPS as u32, 1, 1);
    // One block per (row tile, active slot), its warps splitting K: W13 16 output features
    // (gate + up tiles), W2 32 output rows.
    let g13 = (f.div_ceil(16) as u32, amax as u32, 1);
    dev.launch(MOE_MMA, k13, g13, block, 0, &mut kargs![zp, mp, am32, k32, w13p, s13, f2, l32, beta, lbeta, ap])?;
    let g2 = (l.div_ceil(32) as u32, amax as u32, 1);
    dev.launch(MOE_MMA, k2, g2, block, 0, &mut kargs![ap, mp, am32, k32, w2p, s2, l32, f32_, beta, lbeta, yp])?;
    Ok(Pairs { y, pos: None })
}
