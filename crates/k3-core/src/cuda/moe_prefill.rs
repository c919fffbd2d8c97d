//! The routed experts' prefill path of [`super::moe`] (text-backbone §7.3–7.5; MXFP4 per
//! around-backbone §2), taken for T > `mma_max_tokens`: the routing is read on the host (NOT
//! capturable) and the valid (token, slot) pairs are sorted by expert, stable by pair index.
//! Two ways to run the experts' GEMMs, chosen by [`PrefillMode`] (`K3_MOE_PREFILL=loop|grouped`):
//! - **loop** (default): one expert at a time — gather its rows, two cuBLASLt GEMMs with f32
//!   output, SiTU-GLU rounded to BF16 between them, scatter to the pair rows.
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

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use super::moe::{f32_experts, ExpertFormat, ExpertWeights, Pairs};
use super::{blas, kargs, CudaDevice, CudaTensor};
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
    /// One expert at a time, f32 output.
    Loop,
}

/// 0: not read yet; 1 grouped; 2 loop; 3 grouped refused by cuBLAS (loop from then on).
static MODE: AtomicU8 = AtomicU8::new(0);

/// Forces the prefill path's mode for the process (`None`: back to `K3_MOE_PREFILL`, default
/// loop). For A/B timing and tests.
pub fn set_prefill_mode(mode: Option<PrefillMode>) {
    MODE.store(
        match mode {
            None => 0,
            Some(PrefillMode::Grouped) => 1,
            Some(PrefillMode::Loop) => 2,
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
                Ok(other) => {
                    eprintln!("k3: K3_MOE_PREFILL={other:?} is neither \"loop\" nor \"grouped\"; using loop");
                    2
                }
            };
            MODE.store(v, Relaxed);
            v
        }
        v => v,
    };
    if m == 1 {
        PrefillMode::Grouped
    } else {
        PrefillMode::Loop
    }
}

/// The prefill path: the pairs' expert outputs, by the mode in force.
pub(super) fn prefill(z: &CudaTensor, ids: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, beta: f32, lbeta: f32) -> Result<Pairs> {
    if w.format == ExpertFormat::F32 {
        return Err(f32_experts());
    }
    let host_ids: Vec<i32> = bytemuck::pod_collect_to_vec(&ids.to_bytes()?);
    let (groups, pairs) = group_host(&host_ids, w.num_experts);
    if prefill_mode() == PrefillMode::Grouped {
        if let Some(p) = grouped(z, w, t, k, &groups, &pairs, beta, lbeta)? {
            return Ok(p);
        }
    }
    per_expert(z, w, t, k, &groups, &pairs, beta, lbeta)
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

/// Dequantizes expert `ex`'s MXFP4 W13 and W2 into the BF16 scratch slots at `w13d` / `w2d`.
fn dequant(dev: &CudaDevice, w: &ExpertWeights, ex: usize, w13d: u64, w2d: u64) -> Result<()> {
    let (s13, s2) = w.scale_ptrs();
    let (l, f) = (w.latent, w.inter);
    for (dst, src, scale, elems) in [(w13d, w.w13.ptr(), s13, (2 * f * l) as u64), (w2d, w.w2.ptr(), s2, (l * f) as u64)] {
        let (pk, sc, groups32) = (src + ex as u64 * elems / 2, scale + ex as u64 * elems / 32, (elems / 32) as i64);
        let grid = dev.elementwise_grid(4 * groups32 as usize, 256); // a thread per packed word
        dev.launch(MOE, "moe_dequant", (grid, 1, 1), (256, 1, 1), 0, &mut kargs![pk, sc, groups32, dst])?;
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
                    dequant(dev, w, ex, a, b)?;
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

/// The loop: one expert at a time, f32 GEMM outputs scattered to the pair rows `[T·k, L]`.
#[allow(clippy::too_many_arguments)]
fn per_expert(z: &CudaTensor, w: &ExpertWeights, t: usize, k: usize, groups: &[(usize, usize, usize)], pairs: &[i32], beta: f32, lbeta: f32) -> Result<Pairs> {
    let dev = z.cuda_device();
    let (l, f) = (w.latent, w.inter);
    let y = CudaTensor::uninit(dev, DType::F32, vec![t * k, l])?;
    if pairs.is_empty() {
        return Ok(Pairs { y, pos: None });
    }
    let pairs_d = CudaTensor::from_pod(dev, DType::I32, vec![pairs.len()], pairs)?;
    // MXFP4: each expert's weights are dequantized to BF16 [2F, L] and [L, F] scratch; BF16
    // experts are multiplied in place (their slices of the stacked weights).
    let scratch = match w.format {
        ExpertFormat::Mxfp4 => Some((CudaTensor::uninit(dev, DType::BF16, vec![2 * f, l])?, CudaTensor::uninit(dev, DType::BF16, vec![l, f])?)),
        _ => None,
    };
    let (k32, l32, f32_) = (k as i32, l as i32, f as i32);
    let st = |ptr: u64, ld: usize| blas::Strided { ptr, ld, stride: 0 };
    // Heuristic algorithm: the row count changes with every routing, and tuning each new shape
    // would time several candidates per expert per call.
    let heur = blas::GemmOptions { algo: blas::Algo::Heuristic, ..Default::default() };
    for &(ex, start, n) in groups {
        let pp = pairs_d.ptr() + 4 * start as u64;
        let n32 = n as i32;
        if let Some((w13e, w2e)) = &scratch {
            dequant(dev, w, ex, w13e.ptr(), w2e.ptr())?;
        }
        let zg = CudaTensor::uninit(dev, DType::BF16, vec![n, l])?;
        let (zp, zgp) = (z.ptr(), zg.ptr());
        dev.launch(MOE, "moe_gather", (n as u32, 1, 1), (256, 1, 1), 0, &mut kargs![zp, pp, n32, k32, l32, zgp])?;
        let h = CudaTensor::uninit(dev, DType::F32, vec![n, 2 * f])?;
        // h [n, 2F] = zg [n, L] · W13ᵀ (W13 [2F, L]), f32 out for the activation.
        match &scratch {
            Some((w13e, _)) => blas::gemm(&zg, w13e, &h, blas::Layout::BT, heur)?,
            None => {
                let w13p = w.w13.ptr() + (ex * 2 * f * l * 2) as u64;
                blas::gemm_strided_batched(dev, n, 2 * f, l, 1, st(zgp, l), st(w13p, l), blas::Layout::BT, st(h.ptr(), 2 * f), DType::BF16, DType::F32)?
            }
        }
        let act = CudaTensor::uninit(dev, DType::BF16, vec![n, f])?;
        let (hp, ap) = (h.ptr(), act.ptr());
        // Rows on the y grid, a row's columns (4 per thread) on x.
        let grid = ((if f % 4 == 0 { f / 4 } else { f }).div_ceil(256) as u32, n.min(65_535) as u32, 1);
        dev.launch(MOE, "moe_situ_split", grid, (256, 1, 1), 0, &mut kargs![hp, n32, f32_, beta, lbeta, ap])?;
        let yg = CudaTensor::uninit(dev, DType::F32, vec![n, l])?;
        // yg [n, L] = act [n, F] · W2ᵀ (W2 [L, F]).
        match &scratch {
            Some((_, w2e)) => blas::gemm(&act, w2e, &yg, blas::Layout::BT, heur)?,
            None => {
                let w2p = w.w2.ptr() + (ex * l * f * 2) as u64;
                blas::gemm_strided_batched(dev, n, l, f, 1, st(ap, f), st(w2p, f), blas::Layout::BT, st(yg.ptr(), l), DType::BF16, DType::F32)?
            }
        }
        let (ygp, yp) = (yg.ptr(), y.ptr());
        dev.launch(MOE, "moe_scatter", (n as u32, 1, 1), (256, 1, 1), 0, &mut kargs![ygp, pp, n32, l32, yp])?;
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
