//! Launchers for the CUDA KDA kernels (text-backbone §3.2–3.8): [`kda_prefill`] (variable-length
//! packed sequences, fused from the raw projections to the gated, normed output; its CUDA-graph
//! capturable form [`kda_prefill_tables`] reads the sequence tables from a device tensor the
//! caller fills from [`kda_tables`]) and [`kda_decode`] (one token per sequence, state updated
//! in place). Any number of heads; head
//! dim `hd = D / H` from 1 to 128, taken from the shapes. Head dim 128 (K3's) runs the
//! fast kernels (`kernels/cuda/kda.cu`: chunked prefill, chunk 64; `kda_decode.cu`); the other
//! head dims run `kda_general.cu`, the recurrent form token by token, one block per
//! (sequence, head). The caller never chooses. Every BF16 tensor below may instead be F32 (all
//! of them together: the reference precision); F32 always runs the general kernel.
//!
//! Tensors (all on one device; `N` packed tokens, `B` sequences, `S ≥ B` pool slots, `D = H·hd`):
//! raw projections `q, k, v, g` (f_b output) and `gate` (g_proj output) BF16 `[N, D]`, beta
//! logits BF16 `[N, H]`; weights F32: conv `[3, D, 4]` (q, k, v; tap 3 multiplies the current
//! token), `A_log` `[H]`, `dt_bias` `[D]`, `o_norm` `[hd]`; the state POOL: conv tails BF16
//! `[S, 3, 3, D]` (q/k/v, 3 raw pre-conv inputs oldest first) and the recurrent state F32
//! `[S, H, hd, hd]` (`S[k, v]`); sequence `b` reads and updates slot `slots[b]` in place, every
//! other slot is left untouched; output BF16 `[N, D]`.
//!
//! Prefill at hd 128 runs two kernels: `kda_chunk_prep` over every (chunk, head) in parallel,
//! writing a 74 240-byte record per (chunk, head) to a workspace from the caching allocator, then
//! `kda_chunk_scan` over every (sequence, head), passing the state from chunk to chunk.
//! `chunk_states`, when given (F32 `[num_chunks(lens), H, hd, hd]`), receives the state after
//! each 64-token chunk (chunks numbered sequence by sequence), for prefix caching.

use super::{derr, kargs, CudaDevice, CudaTensor, Event};
use crate::kernels::cuda::{Source, KDA, KDA_DECODE, KDA_GENERAL};
use crate::{CoreError, DType, Result};

/// Head dimension the fast kernels are built for; other head dims run the general kernel.
pub const HEAD_DIM: usize = 128;
/// Chunk length of the prefill kernels (and of `chunk_states`).
pub const CHUNK: usize = 64;
const REC_BYTES: usize = 74_240;
const PREP_SMEM: u32 = 111_872; // PREP_SMEM_BYTES in kda.cu: two blocks per SM
const SCAN_SMEM: u32 = 203_296; // SCAN_SMEM_BYTES in kda.cu
const OP: &str = "cuda kda";

/// The per-layer KDA weights the kernels read.
pub struct KdaWeights<'a> {
    /// F32 `[3, D, 4]`: q, k, v depthwise conv kernels.
    pub conv: &'a CudaTensor,
    /// F32 `[H]`.
    pub a_log: &'a CudaTensor,
    /// F32 `[D]`.
    pub dt_bias: &'a CudaTensor,
    /// F32 `[hd]`, shared by all heads.
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

/// Shapes of one call, from the operands.
#[derive(Clone, Copy)]
struct Dims {
    h: usize,
    hd: usize,
    /// Pool slots `S`.
    nslots: usize,
    /// Storage type of the raw inputs, conv state and output: BF16, or F32 (general kernel only).
    io: DType,
}

impl Dims {
    /// Whether the head-dim-128 fast kernels serve this call.
    fn fast(&self) -> bool {
        self.hd == HEAD_DIM && self.io == DType::BF16
    }
}

/// Checks the shared operands (`n` token rows, `b` sequences).
fn check(inp: &KdaInputs, w: &KdaWeights, n: usize, b: usize, conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor) -> Result<Dims> {
    let dev = inp.q.cuda_device();
    let h = match inp.beta.shape() {
        [_, h] => *h,
        _ => return Err(bad(format!("beta {:?} must be [N, H]", inp.beta))),
    };
    if h == 0 || h > 65_535 {
        return Err(bad(format!("beta: {h} heads (1..=65535)")));
    }
    let d = match inp.q.shape() {
        [_, d] => *d,
        _ => return Err(bad(format!("q {:?} must be [N, D]", inp.q))),
    };
    let hd = d / h;
    if d % h != 0 || !(1..=128).contains(&hd) {
        return Err(bad(format!("q: D = {d} over H = {h} heads (from beta) must give a whole head dim from 1 to 128")));
    }
    let io = inp.q.dtype();
    if io != DType::BF16 && io != DType::F32 {
        return Err(bad(format!("q: {io} inputs (BF16, or F32 throughout)")));
    }
    for (t, name) in [(inp.q, "q"), (inp.k, "k"), (inp.v, "v"), (inp.g, "g"), (inp.gate, "gate"), (out, "out")] {
        expect(t, dev, io, &[n, d], name)?;
    }
    expect(inp.beta, dev, io, &[n, h], "beta")?;
    expect(w.conv, dev, DType::F32, &[3, d, 4], "conv weights")?;
    expect(w.a_log, dev, DType::F32, &[h], "A_log")?;
    expect(w.dt_bias, dev, DType::F32, &[d], "dt_bias")?;
    expect(w.o_norm, dev, DType::F32, &[hd], "o_norm")?;
    let nslots = conv_state.shape().first().copied().unwrap_or(0);
    if nslots < b || nslots > i32::MAX as usize {
        return Err(bad(format!("conv_state {conv_state:?}: the pool needs at least B = {b} slots [S, 3, 3, {d}]")));
    }
    expect(conv_state, dev, io, &[nslots, 3, 3, d], "conv_state")?;
    expect(state, dev, DType::F32, &[nslots, h, hd, hd], "state (same slot count as conv_state)")?;
    if n.checked_mul(d).is_none_or(|x| x > i32::MAX as usize / 2) {
        return Err(bad(format!("{n} tokens × {d} channels is too large")));
    }
    Ok(Dims { h, hd, nslots, io })
}

/// Host slots: one per sequence, below `nslots`, pairwise distinct.
fn check_slots(slots: &[u32], b: usize, nslots: usize) -> Result<()> {
    if slots.len() != b {
        return Err(bad(format!("slots: {} entries for {b} sequences", slots.len())));
    }
    let mut used = vec![false; nslots];
    for &s in slots {
        let Some(u) = used.get_mut(s as usize) else {
            return Err(bad(format!("slots: slot {s} outside the pool of {nslots}")));
        };
        if *u {
            return Err(bad(format!("slots: slot {s} given to two sequences")));
        }
        *u = true;
    }
    Ok(())
}

fn i32_of(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| bad(format!("{what} = {x} exceeds i32")))
}

/// The sequence and chunk tables of a prefill over `lens` with pool slots `slots`, as I32
/// records of 4: per sequence `{tok0, len, first chunk, slot}`, then per 64-token chunk
/// `{tok, n, slot, pos}` (sequence by sequence). The host contents of the `tables` tensor of
/// [`kda_prefill_tables`]; [`kda_prefill`] uploads the same records itself.
pub fn kda_tables(lens: &[usize], slots: &[u32]) -> Result<Vec<i32>> {
    kda_tables_within(lens, lens, slots)
}

/// [`kda_tables`] for a call of [`kda_prefill_tables`] laid out for `caps` (its `lens` argument:
/// the rows of sequence `b` are `caps[b]` rows at the caps' packed offsets) that runs only the
/// first `lens[b] ≤ caps[b]` rows of each sequence. A sequence with `lens[b] = 0` leaves its slot
/// as it is (the kernels read its states and write the same bits back); its slot must still be a
/// valid one, distinct from the others'. The chunk records past a sequence's `lens[b]` rows are
/// placeholders of one row inside its caps (computed into the workspace, never read). Same
/// record count as `kda_tables(caps, …)`, so one device tensor serves any `lens` within `caps`:
/// a captured rollback (k3-model `cuda/verify.rs`) keeps a different number of rows per replay.
pub fn kda_tables_within(caps: &[usize], lens: &[usize], slots: &[u32]) -> Result<Vec<i32>> {
    if slots.len() != caps.len() || lens.len() != caps.len() {
        return Err(bad(format!("slots: {} entries and {} lengths for {} sequences", slots.len(), lens.len(), caps.len())));
    }
    if let Some(b) = (0..caps.len()).find(|&b| lens[b] > caps[b]) {
        return Err(bad(format!("sequence {b}: {} rows within {} (lens must not pass caps)", lens[b], caps[b])));
    }
    let mut seqs = Vec::with_capacity(4 * caps.len());
    let mut chunks = Vec::with_capacity(4 * num_chunks(caps));
    let (mut tok, mut chunk0) = (0usize, 0usize);
    for ((&cap, &l), &slot) in caps.iter().zip(lens).zip(slots) {
        let slot = i32_of(slot as usize, "slot")?;
        seqs.extend([i32_of(tok, "token offset")?, i32_of(l, "length")?, i32_of(chunk0, "chunk")?, slot]);
        for c in 0..cap.div_ceil(CHUNK) {
            let n = l.saturating_sub(c * CHUNK).clamp(1, CHUNK);
            chunks.extend([i32_of(tok + c * CHUNK, "token")?, i32_of(n, "n")?, slot, i32_of(c * CHUNK, "pos")?]);
        }
        chunk0 += cap.div_ceil(CHUNK);
        tok += cap;
    }
    seqs.extend(chunks);
    Ok(seqs)
}

/// Prefill over the packed sequences of lengths `lens` (Σ lens = N rows of every input);
/// sequence `b` uses pool slot `slots[b]` (host values: checked to be below `S` and distinct).
/// Updates those slots of `conv_state` and `state` in place, writes `out`, and, when given, the
/// state after every 64-token chunk into `chunk_states`. Not capturable (uploads the sequence
/// tables from the host; [`kda_prefill_tables`] is the capturable form).
pub fn kda_prefill(
    inp: &KdaInputs,
    w: &KdaWeights,
    lens: &[usize],
    slots: &[u32],
    conv_state: &CudaTensor,
    state: &CudaTensor,
    out: &CudaTensor,
    chunk_states: Option<&CudaTensor>,
) -> Result<()> {
    prefill(inp, w, lens, Tables::Host(slots), conv_state, state, out, chunk_states, None)
}

/// [`kda_prefill`] reading its sequence tables from `tables`, I32 `[4 · (B + num_chunks(lens))]`
/// holding [`kda_tables`]`(lens, slots)`, which the caller writes before the call (or before a
/// graph replay): CUDA-graph capturable. `lens` (host) fixes the grids and the workspace, so a
/// graph serves one `lens`; the slots in the tables may change from replay to replay, and so may
/// the rows run per sequence within `lens` ([`kda_tables_within`]; 0 leaves the slot as it is).
/// They are not checked here: the caller passes distinct slots below `S` (as for [`kda_decode`]).
pub fn kda_prefill_tables(
    inp: &KdaInputs,
    w: &KdaWeights,
    lens: &[usize],
    tables: &CudaTensor,
    conv_state: &CudaTensor,
    state: &CudaTensor,
    out: &CudaTensor,
) -> Result<()> {
    prefill(inp, w, lens, Tables::Device(tables), conv_state, state, out, None, None)
}

/// Where a prefill's sequence tables come from.
#[derive(Clone, Copy)]
enum Tables<'a> {
    /// Host slots: checked, the tables built and uploaded per call.
    Host(&'a [u32]),
    /// A device tensor of [`kda_tables`] records.
    Device(&'a CudaTensor),
}

/// [`kda_prefill`] with events around its kernels; returns (prep ms, scan ms) at head dim 128,
/// (general kernel ms, 0) otherwise. For tuning.
pub fn kda_prefill_profiled(
    inp: &KdaInputs,
    w: &KdaWeights,
    lens: &[usize],
    slots: &[u32],
    conv_state: &CudaTensor,
    state: &CudaTensor,
    out: &CudaTensor,
    chunk_states: Option<&CudaTensor>,
) -> Result<(f32, f32)> {
    let dev = inp.q.cuda_device();
    let ev = [dev.new_event(true)?, dev.new_event(true)?, dev.new_event(true)?];
    prefill(inp, w, lens, Tables::Host(slots), conv_state, state, out, chunk_states, Some(&ev))?;
    ev[2].synchronize()?;
    Ok((ev[0].elapsed_ms(&ev[1])?, ev[1].elapsed_ms(&ev[2])?))
}

fn prefill(
    inp: &KdaInputs,
    w: &KdaWeights,
    lens: &[usize],
    tables: Tables<'_>,
    conv_state: &CudaTensor,
    state: &CudaTensor,
    out: &CudaTensor,
    chunk_states: Option<&CudaTensor>,
    marks: Option<&[Event; 3]>,
) -> Result<()> {
    let n: usize = lens.iter().sum();
    let nb = lens.len();
    let dm = check(inp, w, n, nb, conv_state, state, out)?;
    let (h, hd) = (dm.h, dm.hd);
    let dev = inp.q.cuda_device().clone();
    let nc = num_chunks(lens);
    if let Some(cs) = chunk_states {
        expect(cs, &dev, DType::F32, &[nc, h, hd, hd], "chunk_states")?;
    }
    // The tables: uploaded here from checked host slots, or the caller's device tensor.
    let uploaded = match tables {
        Tables::Host(slots) => {
            check_slots(slots, nb, dm.nslots)?;
            Some(CudaTensor::from_pod(&dev, DType::I32, vec![4 * (nb + nc)], &kda_tables(lens, slots)?)?)
        }
        Tables::Device(t) => {
            if t.dtype() != DType::I32 || t.shape() != [4 * (nb + nc)] || !t.cuda_device().same(&dev) {
                return Err(bad(format!("tables: expected a device I32 [{}] tensor (kda_tables of {nb} sequences, {nc} chunks), got {t:?}", 4 * (nb + nc))));
            }
            None
        }
    };
    let table = match (&uploaded, tables) {
        (Some(t), _) | (None, Tables::Device(t)) => t,
        (None, Tables::Host(_)) => return Err(CoreError::Device("kda tables missing".into())),
    };
    if nb == 0 {
        return Ok(());
    }
    if nc > i32::MAX as usize || nb > 65_535 * 1024 {
        return Err(bad(format!("{nc} chunks / {nb} sequences exceed the grid")));
    }
    // Sequence records first, then the chunk records (read by the fast kernels only).
    let (sqt, ct) = (table.ptr(), table.ptr() + 16 * nb as u64);
    let (lb, eps) = (w.lower_bound, w.eps);
    let cs_ptr: u64 = chunk_states.map_or(0, |t| t.ptr());
    let mark = |i: usize| marks.map_or(Ok(()), |m| m[i].record(&dev.stream()));
    if !dm.fast() {
        mark(0)?;
        general(&dev, inp, w, dm, conv_state, state, cs_ptr, sqt, 0, out, nb)?;
        mark(1)?;
        mark(2)?;
        drop(uploaded);
        return Ok(());
    }
    let h32 = h as i32;
    if nc > 0 {
        let work = dev.alloc(nc * h * REC_BYTES)?;
        let (q, k, v, g, b, gate) = (inp.q.ptr(), inp.k.ptr(), inp.v.ptr(), inp.g.ptr(), inp.beta.ptr(), inp.gate.ptr());
        let (cw, al, dtb, onw) = (w.conv.ptr(), w.a_log.ptr(), w.dt_bias.ptr(), w.o_norm.ptr());
        let (cst, st, o, wk) = (conv_state.ptr(), state.ptr(), out.ptr(), work.ptr());
        big_smem(&dev, KDA, "kda_chunk_prep", PREP_SMEM)?;
        big_smem(&dev, KDA, "kda_chunk_scan", SCAN_SMEM)?;
        mark(0)?;
        dev.launch(KDA, "kda_chunk_prep", (nc as u32, h as u32, 1), (256, 1, 1), PREP_SMEM, &mut kargs![q, k, v, g, b, cw, al, dtb, cst, ct, wk, h32, lb])?;
        mark(1)?;
        dev.launch(
            KDA,
            "kda_chunk_scan",
            (nb as u32, h as u32, 1),
            (512, 1, 1),
            SCAN_SMEM,
            &mut kargs![wk, sqt, q, k, v, cst, gate, onw, st, cs_ptr, o, h32, eps],
        )?;
        mark(2)?;
        // The workspace and tables go back to the caching allocator; later users are ordered
        // after these kernels on the same stream.
        drop(work);
    }
    drop(uploaded);
    Ok(())
}

/// Launches `kda_general` over `nb` sequences: from the `seqs` table (prefill) or, with
/// `seqs == 0`, one token per sequence with slots from the device table `slots` (decode).
fn general(
    dev: &CudaDevice,
    inp: &KdaInputs,
    w: &KdaWeights,
    dm: Dims,
    conv_state: &CudaTensor,
    state: &CudaTensor,
    cs_ptr: u64,
    seqs: u64,
    slots: u64,
    out: &CudaTensor,
    nb: usize,
) -> Result<()> {
    let Dims { h, hd, nslots, io } = dm;
    let name = if io == DType::F32 { "kda_general_f32" } else { "kda_general" };
    let threads = (256 / hd) * hd;
    let smem = ((hd * hd + 5 * hd + 256 + 16) * 4) as u32;
    if smem > 48 * 1024 {
        big_smem(dev, KDA_GENERAL, name, smem)?;
    }
    if nb > i32::MAX as usize {
        return Err(bad(format!("{nb} sequences exceed the grid")));
    }
    let (q, k, v, g, b, gate) = (inp.q.ptr(), inp.k.ptr(), inp.v.ptr(), inp.g.ptr(), inp.beta.ptr(), inp.gate.ptr());
    let (cw, al, dtb, onw) = (w.conv.ptr(), w.a_log.ptr(), w.dt_bias.ptr(), w.o_norm.ptr());
    let (cst, st, o) = (conv_state.ptr(), state.ptr(), out.ptr());
    let (h32, hd32, ns32, lb, eps) = (h as i32, hd as i32, nslots as i32, w.lower_bound, w.eps);
    let mut args = kargs![q, k, v, g, b, gate, cw, al, dtb, onw, cst, st, cs_ptr, seqs, slots, o, h32, hd32, ns32, lb, eps];
    dev.launch(KDA_GENERAL, name, (nb as u32, h as u32, 1), (threads as u32, 1, 1), smem, &mut args)
}

/// Raises the dynamic shared-memory limit of `func` (once per device is enough; cheap).
fn big_smem(dev: &CudaDevice, src: Source, func: &'static str, bytes: u32) -> Result<()> {
    let f = dev.function(src, func)?;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).map_err(derr("raising the shared-memory limit of the KDA kernels"))
}

/// One decode step for `B` sequences (each input has `B` rows): conv-state shift, gates, one
/// step of the recurrence on pool slot `slots[b]` of `state` / `conv_state` in place, output
/// norm and gate into `out` `[B, D]`. `slots` is a device I32 `[B]` tensor the caller fills
/// before the call (or before a graph replay); only its dtype and shape are checked here — the
/// slots must be distinct, and a slot outside `[0, S)` makes the kernel skip that sequence
/// (its output rows are left unwritten). CUDA-graph capturable. Head dim 128 runs `kda_decode`
/// (one block per head and sequence; docs/kernels/kda.md has the variants measured against it),
/// other head dims the general kernel.
pub fn kda_decode(inp: &KdaInputs, w: &KdaWeights, slots: &CudaTensor, conv_state: &CudaTensor, state: &CudaTensor, out: &CudaTensor) -> Result<()> {
    let nb = inp.q.shape().first().copied().unwrap_or(0);
    let dm = check(inp, w, nb, nb, conv_state, state, out)?;
    let dev = inp.q.cuda_device();
    if slots.dtype() != DType::I32 || slots.shape() != [nb] || !slots.cuda_device().same(dev) || !slots.ptr().is_multiple_of(4) {
        return Err(bad(format!("slots: expected a device I32 [{nb}] tensor (one pool slot per sequence) on {:?}, got {slots:?}", dev.device())));
    }
    if nb == 0 {
        return Ok(());
    }
    if nb > 65_535 {
        return Err(bad(format!("{nb} sequences exceed the grid")));
    }
    if !dm.fast() {
        return general(dev, inp, w, dm, conv_state, state, 0, 0, slots.ptr(), out, nb);
    }
    let h = dm.h;
    let (q, k, v, g, b, gate) = (inp.q.ptr(), inp.k.ptr(), inp.v.ptr(), inp.g.ptr(), inp.beta.ptr(), inp.gate.ptr());
    let (cw, al, dtb, onw) = (w.conv.ptr(), w.a_log.ptr(), w.dt_bias.ptr(), w.o_norm.ptr());
    let (cst, st, sl, o) = (conv_state.ptr(), state.ptr(), slots.ptr(), out.ptr());
    let (h32, ns32, lb, eps) = (h as i32, dm.nslots as i32, w.lower_bound, w.eps);
    let mut args = kargs![q, k, v, g, b, gate, cw, al, dtb, onw, cst, st, sl, o, h32, ns32, lb, eps];
    dev.launch(KDA_DECODE, "kda_decode", (h as u32, nb as u32, 1), (DECODE_THREADS, 1, 1), 0, &mut args)
}

const DECODE_THREADS: u32 = 256; // kda_decode.cu: __launch_bounds__(256)

// CUDA graphs live in `cuda/graph.rs`; re-exported here for the KDA decode callers.
pub use super::graph::{capture, Graph};
