//! Launchers for the CUDA KDA kernels (`kernels/cuda/kda.cu`, text-backbone §3.2–3.8):
//! [`kda_prefill`] (chunked form, chunk 64, variable-length packed sequences, fused from the
//! raw projections to the gated, normed output) and [`kda_decode`] (one token per sequence,
//! state updated in place). Head dim 128 (K3's), any number of heads.
//!
//! Tensors (all on one device; `N` packed tokens, `B` sequences, `D = H·128`):
//! raw projections `q, k, v, g` (f_b output) and `gate` (g_proj output) BF16 `[N, D]`, beta
//! logits BF16 `[N, H]`; weights F32: conv `[3, D, 4]` (q, k, v; tap 3 multiplies the current
//! token), `A_log` `[H]`, `dt_bias` `[D]`, `o_norm` `[128]`; per-sequence state: conv tails
//! BF16 `[B, 3, 3, D]` (q/k/v, 3 raw pre-conv inputs oldest first) and the recurrent state F32
//! `[B, H, 128, 128]` (`S[k, v]`), both read and updated in place; output BF16 `[N, D]`.
//!
//! Prefill runs two kernels: `kda_chunk_prep` over every (chunk, head) in parallel, writing a
//! 74 240-byte record per (chunk, head) to a workspace from the caching allocator, then
//! `kda_chunk_scan` over every (sequence, head), passing the state from chunk to chunk.
//! `chunk_states`, when given (F32 `[num_chunks(lens), H, 128, 128]`), receives the state
//! after each chunk (chunks numbered sequence by sequence), for prefix caching.

use super::{derr, kargs, CudaDevice, CudaTensor, Event};
use crate::kernels::cuda::{KDA, KDA_DECODE};
use crate::{CoreError, DType, Result};

/// Head dimension the kernels are built for.
pub const HEAD_DIM: usize = 128;
/// Chunk length of the prefill kernels.
pub const CHUNK: usize = 64;
const REC_BYTES: usize = 74_240;
const PREP_SMEM: u32 = 202_496;
const SCAN_SMEM: u32 = 202_752;
const OP: &str = "cuda kda";

/// The per-layer KDA weights the kernels read.
pub struct KdaWeights<'a> {
    /// F32 `[3, D, 4]`: q, k, v depthwise conv kernels.
    pub conv: &'a CudaTensor,
    /// F32 `[H]`.
    pub a_log: &'a CudaTensor,
    /// F32 `[D]`.
    pub dt_bias: &'a CudaTensor,
    /// F32 `[128]`, shared by all heads.
    pub o_norm: &'a CudaTensor,
    /// K3: −5.
    pub lower_bound: f32,
    /// Output RMSNorm eps (K3: 1e-5).
    pub eps: f32,
}

/// The raw per-token inputs (BF16): projections before the conv, gate inputs before activation.
pub struct KdaInputs<'a> {
    pub q: &'a CudaTensor,
    pub k: &'a CudaTensor,
    pub v: &'a CudaTensor,
    /// `f_b_proj(f_a_proj x)`, `[N, D]`.
    pub g: &'a CudaTensor,
    /// `b_proj x`, `[N, H]`.
    pub beta: &'a CudaTensor,
    /// `g_proj x`, the output gate before the sigmoid, `[N, D]`.
    pub gate: &'a CudaTensor,
}

/// Number of 64-token chunks of a batch with these sequence lengths.
pub fn num_chunks(lens: &[usize]) -> usize {
    lens.iter().map(|l| l.div_ceil(CHUNK)).sum()
}

fn bad(detail: String) -> CoreError {
    CoreError::Shape { op: OP, detail }
}

fn expect(t: &CudaTensor, dev: &CudaDevice, dtype: DType, shape: &[usize], what: &str) -> Result<()> {
    if t.dtype() != dtype || t.shape() != shape || !t.cuda_device().same(dev) {
        return Err(bad(format!("{what}: expected {dtype} {shape:?} on {:?}, got {t:?}", dev.device())));
    }
    if !t.ptr().is_multiple_of(16) {
        return Err(bad(format!("{what}: device address not 16-byte aligned")));
    }
    Ok(())
}

/// Checks the shared operands; returns (H, D).
fn check(inp: &KdaInputs, w: &KdaWeights, n: usize, b: usize, conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor) -> Result<(usize, usize)> {
    let dev = inp.q.cuda_device();
    let h = inp.beta.shape().get(1).copied().ok_or_else(|| bad(format!("beta {:?} must be [N, H]", inp.beta)))?;
    if h == 0 || h > 65_535 {
        return Err(bad(format!("{h} heads")));
    }
    let d = h * HEAD_DIM;
    for (t, name) in [(inp.q, "q"), (inp.k, "k"), (inp.v, "v"), (inp.g, "g"), (inp.gate, "gate"), (out, "out")] {
        expect(t, dev, DType::BF16, &[n, d], name)?;
    }
    expect(inp.beta, dev, DType::BF16, &[n, h], "beta")?;
    expect(w.conv, dev, DType::F32, &[3, d, 4], "conv weights")?;
    expect(w.a_log, dev, DType::F32, &[h], "A_log")?;
    expect(w.dt_bias, dev, DType::F32, &[d], "dt_bias")?;
    expect(w.o_norm, dev, DType::F32, &[HEAD_DIM], "o_norm")?;
    expect(conv_state, dev, DType::BF16, &[b, 3, 3, d], "conv_state")?;
    expect(state, dev, DType::F32, &[b, h, HEAD_DIM, HEAD_DIM], "state")?;
    if n.checked_mul(d).is_none_or(|x| x > i32::MAX as usize / 2) {
        return Err(bad(format!("{n} tokens × {d} channels is too large")));
    }
    Ok((h, d))
}

/// Uploads `[i32; 4]` records as raw bytes.
fn upload_table(dev: &CudaDevice, rows: &[[i32; 4]]) -> Result<CudaTensor> {
    let flat: Vec<i32> = rows.iter().flatten().copied().collect();
    CudaTensor::from_pod(dev, DType::U8, vec![flat.len() * 4], &flat)
}

fn i32_of(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| bad(format!("{what} = {x} exceeds i32")))
}

/// Chunked prefill over the packed sequences of lengths `lens` (Σ lens = N rows of every
/// input). Updates `conv_state` and `state` in place, writes `out`, and, when given, the
/// state after every chunk into `chunk_states`.
pub fn kda_prefill(inp: &KdaInputs, w: &KdaWeights, lens: &[usize], conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor, chunk_states: Option<&CudaTensor>) -> Result<()> {
    prefill(inp, w, lens, conv_state, state, out, chunk_states, None)
}

/// [`kda_prefill`] with events around its two kernels; returns (prep ms, scan ms). For tuning.
#[allow(clippy::too_many_arguments)]
pub fn kda_prefill_profiled(inp: &KdaInputs, w: &KdaWeights, lens: &[usize], conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor, chunk_states: Option<&CudaTensor>) -> Result<(f32, f32)> {
    let dev = inp.q.cuda_device();
    let ev = [dev.new_event(true)?, dev.new_event(true)?, dev.new_event(true)?];
    prefill(inp, w, lens, conv_state, state, out, chunk_states, Some(&ev))?;
    ev[2].synchronize()?;
    Ok((ev[0].elapsed_ms(&ev[1])?, ev[1].elapsed_ms(&ev[2])?))
}

#[allow(clippy::too_many_arguments)]
fn prefill(inp: &KdaInputs, w: &KdaWeights, lens: &[usize], conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor, chunk_states: Option<&CudaTensor>, marks: Option<&[Event; 3]>) -> Result<()> {
    let n: usize = lens.iter().sum();
    let nb = lens.len();
    let (h, _d) = check(inp, w, n, nb, conv_state, state, out)?;
    let dev = inp.q.cuda_device().clone();
    let nc = num_chunks(lens);
    if let Some(cs) = chunk_states {
        expect(cs, &dev, DType::F32, &[nc, h, HEAD_DIM, HEAD_DIM], "chunk_states")?;
    }
    if nb == 0 {
        return Ok(());
    }
    if nc > i32::MAX as usize || nb > 65_535 * 1024 {
        return Err(bad(format!("{nc} chunks / {nb} sequences exceed the grid")));
    }
    let mut chunks = Vec::with_capacity(nc);
    let mut seqs = Vec::with_capacity(nb);
    let mut tok = 0usize;
    for (s, &l) in lens.iter().enumerate() {
        seqs.push([i32_of(tok, "token offset")?, i32_of(l, "length")?, i32_of(chunks.len(), "chunk")?, i32_of(l.div_ceil(CHUNK), "chunks")?]);
        for c in 0..l.div_ceil(CHUNK) {
            chunks.push([i32_of(tok + c * CHUNK, "token")?, i32_of((l - c * CHUNK).min(CHUNK), "n")?, i32_of(s, "seq")?, i32_of(c * CHUNK, "pos")?]);
        }
        tok += l;
    }
    let chunk_t = upload_table(&dev, &chunks)?;
    let seq_t = upload_table(&dev, &seqs)?;
    let h32 = h as i32;
    let (lb, eps) = (w.lower_bound, w.eps);
    let cs_ptr: u64 = chunk_states.map_or(0, |t| t.ptr());
    if nc > 0 {
        let work = dev.alloc(nc * h * REC_BYTES)?;
        let (q, k, v, g, b, gate) = (inp.q.ptr(), inp.k.ptr(), inp.v.ptr(), inp.g.ptr(), inp.beta.ptr(), inp.gate.ptr());
        let (cw, al, dtb, onw) = (w.conv.ptr(), w.a_log.ptr(), w.dt_bias.ptr(), w.o_norm.ptr());
        let (cst, st, o, ct, sqt, wk) = (conv_state.ptr(), state.ptr(), out.ptr(), chunk_t.ptr(), seq_t.ptr(), work.ptr());
        big_smem(&dev, "kda_chunk_prep", PREP_SMEM)?;
        big_smem(&dev, "kda_chunk_scan", SCAN_SMEM)?;
        let mark = |i: usize| marks.map_or(Ok(()), |m| m[i].record(&dev.stream()));
        mark(0)?;
        dev.launch(KDA, "kda_chunk_prep", (nc as u32, h as u32, 1), (512, 1, 1), PREP_SMEM, &mut kargs![q, k, v, g, b, cw, al, dtb, cst, ct, wk, h32, lb])?;
        mark(1)?;
        dev.launch(KDA, "kda_chunk_scan", (nb as u32, h as u32, 1), (256, 1, 1), SCAN_SMEM, &mut kargs![wk, sqt, q, k, v, cst, gate, onw, st, cs_ptr, o, h32, eps])?;
        mark(2)?;
        // The workspace and tables go back to the caching allocator; later users are ordered
        // after these kernels on the same stream.
        drop(work);
    }
    drop((chunk_t, seq_t));
    Ok(())
}

/// Raises the dynamic shared-memory limit of `func` (once per device is enough; cheap).
fn big_smem(dev: &CudaDevice, func: &'static str, bytes: u32) -> Result<()> {
    let f = dev.function(KDA, func)?;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).map_err(derr("raising the shared-memory limit of the KDA kernels"))
}

/// Which decode kernel runs (both compute the same step; see `kernels/cuda/kda.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeKernel {
    /// One block per (head, sequence), the whole 128×128 state in registers.
    Fused,
    /// A cluster of two blocks per (head, sequence), 64 value columns each; the output norm's
    /// sum of squares crosses over distributed shared memory. Needs sm_90.
    Split,
}

/// One decode step for `B` sequences (each input has `B` rows): conv-state shift, gates, one
/// step of the recurrence on `state` in place, output norm and gate into `out` `[B, D]`.
/// Picks the kernel measured faster on the H200 (run 4, docs/kernels/kda.md): `Fused` at
/// batch 1 (6.54 vs 7.17 µs), `Split` from batch 2 on where sm_90 clusters exist (251 vs 275 µs
/// at batch 64).
pub fn kda_decode(inp: &KdaInputs, w: &KdaWeights, conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor) -> Result<()> {
    let nb = inp.q.shape().first().copied().unwrap_or(0);
    let split_ok = inp.q.cuda_device().info().compute_capability.0 >= 9;
    let kernel = if nb >= 2 && split_ok { DecodeKernel::Split } else { DecodeKernel::Fused };
    kda_decode_with(inp, w, conv_state, state, out, kernel)
}

/// [`kda_decode`] with an explicit kernel choice ([`DecodeKernel::Split`] needs compute
/// capability ≥ 9.0 and is refused below).
pub fn kda_decode_with(inp: &KdaInputs, w: &KdaWeights, conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor, kernel: DecodeKernel) -> Result<()> {
    let nb = inp.q.shape().first().copied().unwrap_or(0);
    let (h, _d) = check(inp, w, nb, nb, conv_state, state, out)?;
    if nb == 0 {
        return Ok(());
    }
    if nb > 65_535 {
        return Err(bad(format!("{nb} sequences exceed the grid")));
    }
    let dev = inp.q.cuda_device();
    let (q, k, v, g, b, gate) = (inp.q.ptr(), inp.k.ptr(), inp.v.ptr(), inp.g.ptr(), inp.beta.ptr(), inp.gate.ptr());
    let (cw, al, dtb, onw) = (w.conv.ptr(), w.a_log.ptr(), w.dt_bias.ptr(), w.o_norm.ptr());
    let (cst, st, o) = (conv_state.ptr(), state.ptr(), out.ptr());
    let (h32, lb, eps) = (h as i32, w.lower_bound, w.eps);
    let mut args = kargs![q, k, v, g, b, gate, cw, al, dtb, onw, cst, st, o, h32, lb, eps];
    match kernel {
        DecodeKernel::Fused => dev.launch(KDA_DECODE, "kda_decode", (h as u32, nb as u32, 1), (256, 1, 1), 0, &mut args),
        DecodeKernel::Split => {
            if dev.info().compute_capability.0 < 9 {
                return Err(CoreError::Device("kda_decode_split needs thread-block clusters (sm_90)".into()));
            }
            dev.launch(KDA_DECODE, "kda_decode_split", (2 * h as u32, nb as u32, 1), (256, 1, 1), 0, &mut args)
        }
    }
}

/// A CUDA graph captured from the device's compute stream (e.g. one decode step), replayed
/// with [`Graph::launch`]. The captured kernels keep their device addresses: the tensors they
/// use must outlive the graph.
pub struct Graph {
    g: cudarc::driver::CudaGraph,
}

impl Graph {
    /// Enqueues one replay on the compute stream.
    pub fn launch(&self) -> Result<()> {
        self.g.launch().map_err(derr("cuGraphLaunch"))
    }
}

/// Captures the work `f` enqueues on `dev`'s compute stream into a [`Graph`] (nothing runs
/// during capture). `f` must not allocate, copy to or from the host, or synchronise.
pub fn capture(dev: &CudaDevice, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    dev.synchronize()?;
    let stream = dev.inner().stream.clone();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(derr("cuStreamBeginCapture"))?;
    let r = f();
    let g = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(derr("cuStreamEndCapture"));
    r?;
    match g? {
        Some(g) => Ok(Graph { g }),
        None => Err(CoreError::Device("stream capture produced an empty graph".into())),
    }
}
