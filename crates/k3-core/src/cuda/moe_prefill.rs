//! The routed experts' prefill path of [`super::moe`] (text-backbone §7.3–7.5; MXFP4 per
//! around-backbone §2), taken for T > `mma_max_tokens`: the routing is read on the host (NOT
//! capturable) and the valid (token, slot) pairs are sorted by expert, stable by pair index.
//! Three ways to run the experts' GEMMs, chosen by [`PrefillMode`]
//! (`K3_MOE_PREFILL=loop|loop-serial|batched|grouped`):
//! - **loop** (default): one expert at a time — gather its rows, two cuBLASLt GEMMs with f32
//!   output, SiTU-GLU rounded to BF16 between them, scatter to the pair rows. MXFP4 experts are
//!   dequantized to BF16 scratch one expert ahead on the device's side stream, into two slots
//!   taken in turn, so the memory-bound dequantization runs under the compute-bound GEMMs
//!   ([`Scratch`]: events order each slot's dequant before its GEMMs and its GEMMs before its
//!   next dequant). `loop-serial` dequantizes each expert in line on the compute stream (the
//!   form before the overlap, for A/B timing); both run the same kernels on the same data, so
//!   their outputs are the same bits.
//! - **batched** (opt-in, MXFP4 experts; BF16 experts take the loop): the loop over units of
//!   `K3_MOE_PREFILL_GROUP` experts (default 2) taken in order of their row counts, each unit's
//!   GEMMs one strided-batched cuBLAS call over its experts' rows padded to the unit's largest
//!   count (padding rows zeroed, never scattered), so one launch holds the tiles of several
//!   experts instead of each expert's partial last wave; dequantized one unit ahead as the loop.
//! - **grouped** (opt-in; it lost on the H200, 2026-12-05: a T = 4096 prefill of `k3r4mx`, 4
//!   real-width layers × 64 MXFP4 experts, spent 87.7 ms in the MoE FFN against the loop's 63.2
//!   ms — cuBLAS 13.1's grouped kernels are slower than its per-shape GEMMs here): every
//!   pair's latent row gathered once in expert order; chunks of experts (MXFP4 weights dequantized to a BF16 scratch of at most [`SCRATCH_BYTES`], BF16
//!   experts used in place), each chunk one `cublasGemmGroupedBatchedEx` per GEMM — one launch
//!   fills the GPU with all the chunk's tiles instead of each expert's partial last wave. cuBLAS's
//!   grouped GEMM writes BF16 (it has no BF16 → F32 form), so `h = z·W13ᵀ` and `y = act·W2ᵀ` are
//!   rounded to BF16 (as vLLM's and SGLang's fused MoE do); SiTU-GLU reads `h` in f32 and rounds
//!   `act` to BF16; the combine reads each pair's `y` row where the sort put it. When cuBLAS
//!   refuses the call, the process says so once and takes the loop.
//!
//! Shapes: T tokens, k slots, P valid pairs, `n_e` pairs of expert e, L latent width, F expert
//! width; `zs` `[P, L]`, `h` `[rows, 2F]`, `act` `[rows, F]`, `y` `[P, L]` (rows: a chunk's pairs).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};

use super::moe::{f32_experts, ExpertFormat, ExpertWeights, Pairs};
use super::{blas, kargs, CudaDevice, CudaTensor, Event, Stream};
use crate::kernels::cuda::MOE;
use crate::{DType, Result};

/// Most bytes of dequantized (BF16) MXFP4 experts held at once by the grouped path (default).
pub const SCRATCH_BYTES: usize = 1 << 30;
/// The scratch cap in force (tests set a small one to run several chunks).
static SCRATCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(SCRATCH_BYTES);

/// Sets the grouped path's MXFP4 scratch cap (`None`: [`SCRATCH_BYTES`]); at least one expert is
/// always held.
pub fn set_prefill_scratch(bytes: Option<usize>) {
    SCRATCH.store(bytes.unwrap_or(SCRATCH_BYTES), Relaxed);
}

/// How the prefill path runs the experts' GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillMode {
    /// One grouped cuBLAS GEMM per chunk of experts, BF16 output.
    Grouped,
    /// One expert at a time, f32 output; MXFP4 experts dequantized one ahead on the side
    /// stream (the default).
    Loop,
    /// [`PrefillMode::Loop`] with each expert dequantized in line on the compute stream.
    LoopSerial,
    /// The overlapped loop over units of [`prefill_group`] experts, one strided-batched GEMM
    /// per unit and GEMM (MXFP4 experts).
    Batched,
}

/// 0: not read yet; 1 grouped; 2 loop; 3 grouped refused by cuBLAS (loop from then on); 4
/// loop-serial; 5 batched.
static MODE: AtomicU8 = AtomicU8::new(0);

/// Forces the prefill path's mode for the process (`None`: back to `K3_MOE_PREFILL`, default
/// loop). For A/B timing and tests.
pub fn set_prefill_mode(mode: Option<PrefillMode>) {
    MODE.store(
        match mode {
            None => 0,
            Some(PrefillMode::Grouped) => 1,
            Some(PrefillMode::Loop) => 2,
            Some(PrefillMode::LoopSerial) => 4,
            Some(PrefillMode::Batched) => 5,
        },
        Relaxed,
    );
}

/// The mode the prefill path takes now (`Loop` also after cuBLAS refused the grouped GEMM).
pub fn prefill_mode() -> PrefillMode {
    let m = match MODE.load(Relaxed) {
        0 => {
            let v = match std::env::var("K3_MOE_PREFILL").as_deref() {
                Ok("grouped") => 1,
                Ok("loop") | Err(_) => 2,
                Ok("loop-serial") => 4,
                Ok("batched") => 5,
                Ok(other) => {
                    eprintln!("k3: K3_MOE_PREFILL={other:?} is none of \"loop\", \"loop-serial\", \"batched\", \"grouped\"; using loop");
                    2
                }
            };
            MODE.store(v, Relaxed);
            v
        }
        v => v,
    };
    match m {
        1 => PrefillMode::Grouped,
        4 => PrefillMode::LoopSerial,
        5 => PrefillMode::Batched,
        _ => PrefillMode::Loop,
    }
}

/// Experts per unit of [`PrefillMode::Batched`]: 0 = not read yet.
static GROUP: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets the batched mode's experts per unit (`None`: back to `K3_MOE_PREFILL_GROUP`, default 2).
pub fn set_prefill_group(n: Option<usize>) {
    GROUP.store(n.map_or(0, |n| n.max(1)), Relaxed);
}

/// The batched mode's experts per unit in force.
pub fn prefill_group() -> usize {
    match GROUP.load(Relaxed) {
        0 => {
            let n = std::env::var("K3_MOE_PREFILL_GROUP").ok().and_then(|v| v.trim().parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(2);
            GROUP.store(n, Relaxed);
            n
        }
        n => n,
    }
}

/// Test hook of the overlapped loop: nanoseconds each expert's dequantization waits on the side
/// stream, and each expert's GEMMs on the compute stream (0: none).
static STALL: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Delays the overlapped loop's side stream before each dequantization by `side_ns` and its
/// compute stream before each expert's GEMMs by `main_ns` (both 0: off, the default). For
/// tests: a missing event wait then shows as wrong bits instead of a rare race.
pub fn set_prefill_stall(side_ns: u64, main_ns: u64) {
    STALL[0].store(side_ns, Relaxed);
    STALL[1].store(main_ns, Relaxed);
}

/// The prefill path: the pairs' expert outputs, by the mode in force.
pub(super) fn prefill(z: &CudaTensor, ids: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, beta: f32, lbeta: f32) -> Result<Pairs> {
    if w.format == ExpertFormat::F32 {
        return Err(f32_experts());
    }
    let host_ids: Vec<i32> = bytemuck::pod_collect_to_vec(&ids.to_bytes()?);
    let (groups, pairs) = group_host(&host_ids, w.num_experts);
    let mode = prefill_mode();
    if mode == PrefillMode::Grouped {
        if let Some(p) = grouped(z, w, t, k, &groups, &pairs, beta, lbeta)? {
            return Ok(p);
        }
    }
    // Never under a graph capture (the host read above already forbids one), but a side stream
    // there would need its own fork/join into the capture: stay on the compute stream.
    let overlap = mode != PrefillMode::LoopSerial && !z.cuda_device().inner().capturing.load(Relaxed);
    let unit = if mode == PrefillMode::Batched && w.format == ExpertFormat::Mxfp4 { prefill_group() } else { 1 };
    per_expert(z, w, t, k, &groups, &pairs, beta, lbeta, overlap, unit)
}

/// Groups the valid pairs by expert on the host: (expert, start, count) ascending by expert,
/// and the pair list sorted by expert, stable by pair index.
pub(super) fn group_host(ids: &[i32], e: usize) -> (Vec<(usize, usize, usize)>, Vec<i32>) {
    let mut count = vec![0usize; e];
    for &id in ids {
        if id >= 0 && (id as usize) < e {
            count[id as usize] += 1;
        }
    }
    let mut start = vec![0usize; e];
    let mut acc = 0;
    for x in 0..e {
        start[x] = acc;
        acc += count[x];
    }
    let mut fill = start.clone();
    let mut pairs = vec![0i32; acc];
    for (p, &id) in ids.iter().enumerate() {
        if id >= 0 && (id as usize) < e {
            pairs[fill[id as usize]] = p as i32;
            fill[id as usize] += 1;
        }
    }
    let groups = (0..e).filter(|&x| count[x] > 0).map(|x| (x, start[x], count[x])).collect();
    (groups, pairs)
}

/// Where each pair's row lands in expert order: `pos[p]` = its index in `pairs`, −1 for a pair
/// without a valid expert.
fn positions(pairs: &[i32], n_pairs: usize) -> Vec<i32> {
    let mut pos = vec![-1i32; n_pairs];
    for (i, &p) in pairs.iter().enumerate() {
        pos[p as usize] = i as i32;
    }
    pos
}

/// Dequantizes expert `ex`'s MXFP4 W13 and W2 into the BF16 scratch slots at `w13d` / `w2d`,
/// on `stream`.
fn dequant(dev: &CudaDevice, stream: &Stream, w: &ExpertWeights, ex: usize, w13d: u64, w2d: u64) -> Result<()> {
    let (s13, s2) = w.scale_ptrs();
    let (l, f) = (w.latent, w.inter);
    for (dst, src, scale, elems) in [(w13d, w.w13.ptr(), s13, (2 * f * l) as u64), (w2d, w.w2.ptr(), s2, (l * f) as u64)] {
        let (pk, sc, groups32) = (src + ex as u64 * elems / 2, scale + ex as u64 * elems / 32, (elems / 32) as i64);
        let grid = dev.elementwise_grid(4 * groups32 as usize, 256); // a thread per packed word
        dev.launch_on(stream.raw(), MOE, "moe_dequant", (grid, 1, 1), (256, 1, 1), 0, &mut kargs![pk, sc, groups32, dst])?;
    }
    Ok(())
}

/// The grouped path; `None` when cuBLAS refuses the grouped GEMM (said once; the loop runs).
#[allow(clippy::too_many_arguments)]
fn grouped(
    z: &CudaTensor,
    w: &ExpertWeights,
    t: usize,
    k: usize,
    groups: &[(usize, usize, usize)],
    pairs: &[i32],
    beta: f32,
    lbeta: f32,
) -> Result<Option<Pairs>> {
    let dev = z.cuda_device();
    let (l, f, np) = (w.latent, w.inter, pairs.len());
    let pos = CudaTensor::from_pod(dev, DType::I32, vec![t * k], &positions(pairs, t * k))?;
    let y = CudaTensor::uninit(dev, DType::BF16, vec![np.max(1), l])?;
    if np == 0 {
        return Ok(Some(Pairs { y, pos: Some(pos) }));
    }
    let pairs_d = CudaTensor::from_pod(dev, DType::I32, vec![np], pairs)?;
    let zs = CudaTensor::uninit(dev, DType::BF16, vec![np, l])?;
    let (zp, pp, zsp, n32, k32, l32, f32_) = (z.ptr(), pairs_d.ptr(), zs.ptr(), np as i32, k as i32, l as i32, f as i32);
    dev.launch(MOE, "moe_gather", (np as u32, 1, 1), (256, 1, 1), 0, &mut kargs![zp, pp, n32, k32, l32, zsp])?;
    let expert_bytes = 3 * l * f * 2;
    let per_chunk = match w.format {
        ExpertFormat::Mxfp4 => (SCRATCH.load(Relaxed) / expert_bytes).clamp(1, groups.len()),
        _ => groups.len(),
    };
    let scratch = match w.format {
        ExpertFormat::Mxfp4 => {
            Some((CudaTensor::uninit(dev, DType::BF16, vec![per_chunk, 2 * f, l])?, CudaTensor::uninit(dev, DType::BF16, vec![per_chunk, l, f])?))
        }
        _ => None,
    };
    let rows_max = groups.chunks(per_chunk).map(|c| c.iter().map(|g| g.2).sum::<usize>()).max().unwrap_or(0);
    let h = CudaTensor::uninit(dev, DType::BF16, vec![rows_max, 2 * f])?;
    let act = CudaTensor::uninit(dev, DType::BF16, vec![rows_max, f])?;
    let bf = 2u64; // bytes per BF16 element
    for chunk in groups.chunks(per_chunk) {
        let r0 = chunk[0].1;
        let (mut p13, mut p2) = (Vec::with_capacity(chunk.len()), Vec::with_capacity(chunk.len()));
        for (i, &(ex, start, n)) in chunk.iter().enumerate() {
            let (w13p, w2p) = match &scratch {
                Some((w13s, w2s)) => {
                    let (a, b) = (w13s.ptr() + (i * 2 * f * l) as u64 * bf, w2s.ptr() + (i * l * f) as u64 * bf);
                    dequant(dev, &dev.stream(), w, ex, a, b)?;
                    (a, b)
                }
                None => (w.w13.ptr() + (ex * 2 * f * l) as u64 * bf, w.w2.ptr() + (ex * l * f) as u64 * bf),
            };
            let r = (start - r0) as u64;
            p13.push(blas::GroupedProblem { m: n, a: zsp + start as u64 * l as u64 * bf, b: w13p, c: h.ptr() + r * (2 * f) as u64 * bf });
            p2.push(blas::GroupedProblem { m: n, a: act.ptr() + r * f as u64 * bf, b: w2p, c: y.ptr() + start as u64 * l as u64 * bf });
        }
        // h [n_e, 2F] = zs_e [n_e, L] · W13_eᵀ, BF16 out.
        if let Err(e) = blas::gemm_grouped(dev, 2 * f, l, &p13, DType::BF16, DType::BF16) {
            if MODE.swap(3, Relaxed) != 3 {
                eprintln!("k3: grouped expert GEMMs unavailable ({e}); the MoE prefill runs one expert at a time");
            }
            return Ok(None);
        }
        let rows: usize = chunk.iter().map(|g| g.2).sum();
        let (hp, ap, rows32) = (h.ptr(), act.ptr(), rows as i32);
        let grid = dev.elementwise_grid(rows * f, 256);
        dev.launch(MOE, "moe_situ_split_bf16", (grid, 1, 1), (256, 1, 1), 0, &mut kargs![hp, rows32, f32_, beta, lbeta, ap])?;
        // y [n_e, L] = act_e [n_e, F] · W2_eᵀ, BF16 out, in expert order.
        blas::gemm_grouped(dev, l, f, &p2, DType::BF16, DType::BF16)?;
    }
    Ok(Some(Pairs { y, pos: Some(pos) }))
}

/// The loop's BF16 scratch for MXFP4 experts. Serial: one slot, each expert dequantized in line
/// on the compute stream. Overlapped: two slots; expert i+1 is dequantized into slot (i+1) % 2
/// on the device's side stream while expert i's GEMMs read slot i % 2 on the compute stream.
/// `ready[s]` (side, after a dequant into s) gates the GEMMs reading s; `free[s]` (compute,
/// after the last GEMM reading s) gates the next dequant into s. The slots are allocated on the
/// compute stream and both `free` recorded at once, so the side stream's first writes also wait
/// for the compute work that last used those blocks (and for the weights' uploads); the side
/// stream allocates nothing, and is joined back to the compute stream ([`Scratch::finish`], or
/// on drop after an error) before the slots return to the pool.
struct Scratch<'a> {
    dev: &'a CudaDevice,
    w: &'a ExpertWeights,
    /// (W13 `[U, 2F, L]`, W2 `[U, L, F]`) BF16 for a unit of up to U experts, one slot or two.
    slots: Vec<(CudaTensor, CudaTensor)>,
    side: Option<Side>,
}

/// The overlapped scratch's streams and events.
struct Side {
    stream: Stream,
    main: Stream,
    ready: [Event; 2],
    free: [Event; 2],
    join: Event,
}

impl Side {
    /// Makes the compute stream wait for all work queued on the side stream; when that cannot
    /// be enqueued, waits for the side stream on the host (the slots are about to be freed).
    fn join(&self) -> Result<()> {
        let r = self.join.record(&self.stream).and_then(|()| self.main.wait(&self.join));
        if r.is_err() {
            let _ = self.stream.synchronize();
        }
        r
    }
}

impl<'a> Scratch<'a> {
    /// The scratch for `w` in units of up to `unit` experts; overlapped, it starts dequantizing
    /// the unit `first` at once.
    fn new(dev: &'a CudaDevice, w: &'a ExpertWeights, overlap: bool, unit: usize, first: Option<&[usize]>) -> Result<Self> {
        let (l, f) = (w.latent, w.inter);
        let slot = || -> Result<(CudaTensor, CudaTensor)> {
            Ok((CudaTensor::uninit(dev, DType::BF16, vec![unit, 2 * f, l])?, CudaTensor::uninit(dev, DType::BF16, vec![unit, l, f])?))
        };
        let slots = (0..if overlap { 2 } else { 1 }).map(|_| slot()).collect::<Result<Vec<_>>>()?;
        let side = match overlap {
            true => {
                let ev = || dev.new_event(false);
                let s = Side { stream: dev.side_stream()?, main: dev.stream(), ready: [ev()?, ev()?], free: [ev()?, ev()?], join: ev()? };
                for e in &s.free {
                    e.record(&s.main)?;
                }
                Some(s)
            }
            false => None,
        };
        let me = Scratch { dev, w, slots, side };
        if let (Some(s), Some(exs)) = (&me.side, first) {
            me.issue(s, 0, exs)?;
        }
        Ok(me)
    }

    /// Dequantizes the unit `exs` into slot `slot` on `stream` (expert j of the unit at index j).
    fn fill(&self, stream: &Stream, slot: usize, exs: &[usize]) -> Result<()> {
        let (l, f) = (self.w.latent, self.w.inter);
        let (w13, w2) = &self.slots[slot];
        for (j, &ex) in exs.iter().enumerate() {
            dequant(self.dev, stream, self.w, ex, w13.ptr() + (j * 2 * f * l * 2) as u64, w2.ptr() + (j * l * f * 2) as u64)?;
        }
        Ok(())
    }

    /// Queues the dequantization of the `j`-th unit in the loop, `exs`, on the side stream.
    fn issue(&self, s: &Side, j: usize, exs: &[usize]) -> Result<()> {
        s.stream.wait(&s.free[j % 2])?;
        stall(self.dev, &s.stream, STALL[0].load(Relaxed))?;
        self.fill(&s.stream, j % 2, exs)?;
        s.ready[j % 2].record(&s.stream)
    }

    /// The `i`-th unit's (`exs`) BF16 weights, ready for the compute stream's next op;
    /// overlapped, it first queues the dequantization of the next unit, `next`.
    fn weights(&self, i: usize, exs: &[usize], next: Option<&[usize]>) -> Result<&(CudaTensor, CudaTensor)> {
        let Some(s) = &self.side else {
            self.fill(&self.dev.stream(), 0, exs)?;
            return Ok(&self.slots[0]);
        };
        if let Some(nx) = next {
            self.issue(s, i + 1, nx)?;
        }
        s.main.wait(&s.ready[i % 2])?;
        stall(self.dev, &s.main, STALL[1].load(Relaxed))?;
        Ok(&self.slots[i % 2])
    }

    /// Marks the `i`-th expert's slot free once the compute stream's work so far (its GEMMs) is done.
    fn release(&self, i: usize) -> Result<()> {
        match &self.side {
            Some(s) => s.free[i % 2].record(&s.main),
            None => Ok(()),
        }
    }

    /// Joins the side stream back to the compute stream.
    fn finish(mut self) -> Result<()> {
        match self.side.take() {
            Some(s) => s.join(),
            None => Ok(()),
        }
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        // After an error: the slots (dropped after this) must not return to the pool while a
        // dequantization may still write them. No error can be reported from drop.
        if let Some(s) = self.side.take() {
            let _ = s.join();
        }
    }
}

/// The test hook's delay of `ns` nanoseconds on `stream` (nothing when 0).
fn stall(dev: &CudaDevice, stream: &Stream, ns: u64) -> Result<()> {
    if ns == 0 {
        return Ok(());
    }
    let ns = ns.min(i64::MAX as u64) as i64;
    dev.launch_on(stream.raw(), MOE, "moe_stall", (1, 1, 1), (1, 1, 1), 0, &mut kargs![ns])
}

/// The loop: one unit of experts at a time (one expert, or up to `unit` MXFP4 experts in
/// order of their row counts, see [`PrefillMode::Batched`]), f32 GEMM outputs scattered to the
/// pair rows `[T·k, L]`; MXFP4 weights dequantized one unit ahead on the side stream when
/// `overlap`.
#[allow(clippy::too_many_arguments)]
fn per_expert(
    z: &CudaTensor,
    w: &ExpertWeights,
    t: usize,
    k: usize,
    groups: &[(usize, usize, usize)],
    pairs: &[i32],
    beta: f32,
    lbeta: f32,
    overlap: bool,
    unit: usize,
) -> Result<Pairs> {
    let dev = z.cuda_device();
    let (l, f) = (w.latent, w.inter);
    let y = CudaTensor::uninit(dev, DType::F32, vec![t * k, l])?;
    if pairs.is_empty() {
        return Ok(Pairs { y, pos: None });
    }
    let pairs_d = CudaTensor::from_pod(dev, DType::I32, vec![pairs.len()], pairs)?;
    // No more experts per unit than have rows, nor than the grouped path's scratch cap allows
    // in the two slots (at least one).
    let unit = unit.min(groups.len()).min(SCRATCH.load(Relaxed) / (2 * 3 * l * f * 2).max(1)).max(1);
    // Units: one expert each, or (batched) up to `unit` experts of similar row counts.
    let mut order: Vec<(usize, usize, usize)> = groups.to_vec();
    if unit > 1 {
        order.sort_by_key(|g| std::cmp::Reverse(g.2)); // stable: equal counts keep expert order
    }
    let units: Vec<&[(usize, usize, usize)]> = order.chunks(unit).collect();
    let ids: Vec<Vec<usize>> = units.iter().map(|u| u.iter().map(|g| g.0).collect()).collect();
    // MXFP4: each unit's weights are dequantized to BF16 [U, 2F, L] and [U, L, F] scratch; BF16
    // experts are multiplied in place (their slices of the stacked weights).
    let scratch = match w.format {
        ExpertFormat::Mxfp4 => Some(Scratch::new(dev, w, overlap, unit, ids.first().map(Vec::as_slice))?),
        _ => None,
    };
    let (k32, l32, f32_) = (k as i32, l as i32, f as i32);
    let st = |ptr: u64, ld: usize, stride: usize| blas::Strided { ptr, ld, stride };
    // Heuristic algorithm: the row count changes with every routing, and tuning each new shape
    // would time several candidates per expert per call.
    let heur = blas::GemmOptions { algo: blas::Algo::Heuristic, ..Default::default() };
    for (i, u) in units.iter().enumerate() {
        let (nu, rows) = (u.len(), u.iter().map(|g| g.2).max().unwrap_or(0)); // rows: the unit's padded count
        let wts = match &scratch {
            Some(s) => Some(s.weights(i, &ids[i], ids.get(i + 1).map(Vec::as_slice))?),
            None => None,
        };
        // out [rows, n] = a [rows, kd] · B_eᵀ for each expert e of the unit, f32 out; B_e [n, kd]
        // from the scratch slot `slot` (MXFP4) or, for a one-expert unit of BF16 experts, the
        // stacked weights `stacked` in place. A slot of one expert takes the cuBLASLt heuristic
        // GEMM, the loop's own.
        let unit_gemm = |a: &CudaTensor, slot: Option<&CudaTensor>, stacked: &CudaTensor, n: usize, kd: usize, out: &CudaTensor| -> Result<()> {
            match slot {
                Some(b) if unit == 1 => blas::gemm(a, &b.reshape(vec![n, kd])?, out, blas::Layout::BT, heur),
                _ => {
                    let b = slot.map_or(stacked.ptr() + (u[0].0 * n * kd * 2) as u64, |b| b.ptr());
                    let (sa, sb, so) = (st(a.ptr(), kd, rows * kd), st(b, kd, n * kd), st(out.ptr(), n, rows * n));
                    blas::gemm_strided_batched(dev, rows, n, kd, nu, sa, sb, blas::Layout::BT, so, DType::BF16, DType::F32)
                }
            }
        };
        // zg [U, rows, L]: each expert's rows at its block, padding rows zeroed.
        let zg = CudaTensor::uninit(dev, DType::BF16, vec![nu * rows, l])?;
        if u.iter().any(|g| g.2 < rows) {
            zg.fill_bytes(0)?;
        }
        for (j, &(_, start, n)) in u.iter().enumerate() {
            let (zp, pp, n32, zgp) = (z.ptr(), pairs_d.ptr() + 4 * start as u64, n as i32, zg.ptr() + (j * rows * l * 2) as u64);
            dev.launch(MOE, "moe_gather", (n as u32, 1, 1), (256, 1, 1), 0, &mut kargs![zp, pp, n32, k32, l32, zgp])?;
        }
        let h = CudaTensor::uninit(dev, DType::F32, vec![nu * rows, 2 * f])?;
        // h [rows, 2F] = zg [rows, L] · W13ᵀ (W13 [2F, L]) per expert of the unit.
        unit_gemm(&zg, wts.map(|x| &x.0), &w.w13, 2 * f, l, &h)?;
        let act = CudaTensor::uninit(dev, DType::BF16, vec![nu * rows, f])?;
        let (hp, ap, r32) = (h.ptr(), act.ptr(), (nu * rows) as i32);
        // Rows on the y grid, a row's columns (4 per thread) on x.
        let grid = ((if f % 4 == 0 { f / 4 } else { f }).div_ceil(256) as u32, (nu * rows).min(65_535) as u32, 1);
        dev.launch(MOE, "moe_situ_split", grid, (256, 1, 1), 0, &mut kargs![hp, r32, f32_, beta, lbeta, ap])?;
        let yg = CudaTensor::uninit(dev, DType::F32, vec![nu * rows, l])?;
        // yg [rows, L] = act [rows, F] · W2ᵀ (W2 [L, F]) per expert of the unit.
        unit_gemm(&act, wts.map(|x| &x.1), &w.w2, l, f, &yg)?;
        if let Some(s) = &scratch {
            s.release(i)?; // the W2 GEMM was the slot's last reader
        }
        for (j, &(_, start, n)) in u.iter().enumerate() {
            let (ygp, pp, n32, yp) = (yg.ptr() + (j * rows * l * 4) as u64, pairs_d.ptr() + 4 * start as u64, n as i32, y.ptr());
            dev.launch(MOE, "moe_scatter", (n as u32, 1, 1), (256, 1, 1), 0, &mut kargs![ygp, pp, n32, l32, yp])?;
        }
    }
    if let Some(s) = scratch {
        s.finish()?;
    }
    Ok(Pairs { y, pos: None })
}

#[cfg(test)]
mod tests {
    use super::{group_host, positions};
    #[test]
    fn host_grouping_is_stable_and_skips_invalid_ids() {
        let (g, p) = group_host(&[2, 0, 2, -1, 0, 9], 3);
        assert_eq!(g, vec![(0, 0, 2), (2, 2, 2)]);
        assert_eq!(p, vec![1, 4, 0, 2]);
        assert_eq!(positions(&p, 6), vec![2, 0, 3, -1, 1, -1]);
    }
}
