//! The routed experts of one Stable LatentMoE layer on the CPU (text-backbone §7.3–7.4): each
//! expert runs only on the tokens routed to it, `y = w2 · SiTU-GLU(w1 z, w3 z)`, and the layer's
//! routed sum is `r = Σ w_i y_i` (before `routed_scaling_factor`, the reduction over ranks and
//! the latent norm, which `moe.rs` applies).
//!
//! Two independent choices (issue 23):
//! - where the weights are — [`Weights::Mapped`], views of the memory-mapped checkpoint, or
//!   [`Weights::Streamed`], read from disk when routed into a bounded cache
//!   (`offload::cache`), computed in the order they arrive;
//! - how they are computed — [`Kernel::Exact`], the CPU model's f32 kernels (the oracle: the
//!   same bits whichever the weights' place), or [`Kernel::Q8`], MXFP4 × int8 activations
//!   (`kernels::cpu::mxfp4_q8`) for experts computed beside a GPU trunk: every token's latent
//!   row is quantized once for all its experts, then one parallel pass computes `w1`/`w3` rows
//!   of every expert in the step, and a second the `w2` rows.
//!
//! Results do not depend on the thread count or on how tokens are batched: every output row is
//! one token's dot products, and the weighted sum adds experts in id order.
//! Shapes: `z` `[T, lat]`; an expert's `w1`, `w3` `[inter, lat]`, `w2` `[lat, inter]`; `r`
//! `[T, lat]`.

use std::sync::Arc;

use k3_core::kernels::cpu::act::situ_glu_slice;
use k3_core::kernels::cpu::matmul::{row_exact, with_row_exact, Matrix};
use k3_core::kernels::cpu::mxfp4_q8::{quantize, rows_into, Q8};
use rayon::prelude::*;

use super::lin;
use super::moe::{Expert, Route};
use crate::error::{ModelError, Result};
use crate::offload::cache::ExpertCache;

/// Where a layer's routed experts are.
pub enum Weights {
    /// Views of the memory-mapped checkpoint: this rank's experts in order.
    Mapped(Vec<Expert>),
    /// Read from disk when routed.
    Streamed(Arc<ExpertCache>),
}

/// How the experts are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Kernel {
    /// The CPU model's f32 kernels (the oracle).
    #[default]
    Exact,
    /// MXFP4 × int8 activations (dense experts are computed as [`Kernel::Exact`]).
    Q8,
}

pub struct RoutedExperts {
    pub weights: Weights,
    /// The decoder layer (the cache's key).
    pub layer: usize,
    /// This rank's experts: global ids `first_expert..first_expert + count`.
    pub first_expert: usize,
    pub count: usize,
    pub latent: usize,
    /// Intermediate width of the experts this rank holds.
    pub inter: usize,
    pub kernel: Kernel,
    pub beta: f32,
    pub linear_beta: f32,
}

/// Weight rows per parallel work item of the [`Kernel::Q8`] passes (default; 64 before the
/// sweep of 2026-12-06, README "One GPU host").
const ROWS_PER_ITEM: usize = 128;

/// The rows per work item in force: [`ROWS_PER_ITEM`] or `K3_Q8_ROWS` (read once; for tuning:
/// longer items stream longer runs of one matrix per thread).
fn rows_per_item() -> usize {
    static R: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *R.get_or_init(|| std::env::var("K3_Q8_ROWS").ok().and_then(|v| v.trim().parse().ok()).filter(|&r| r > 0).unwrap_or(ROWS_PER_ITEM))
}

impl RoutedExperts {
    /// Layer `l`'s routed experts on the rank `plan` describes (its experts, their intermediate
    /// width), with `weights` and `kernel`.
    pub fn new(cfg: &crate::config::Config, plan: &crate::parallel::RankPlan, l: usize, weights: Weights, kernel: Kernel) -> RoutedExperts {
        let t = &cfg.text;
        let mine = plan.experts(t.num_experts);
        RoutedExperts {
            weights,
            layer: l,
            first_expert: mine.start,
            count: mine.len(),
            latent: t.routed_expert_hidden_size,
            inter: plan.expert_inter(cfg),
            kernel,
            beta: t.activation_situ_beta,
            linear_beta: t.activation_situ_linear_beta,
        }
    }

    /// One expert on `n` latent rows `z` `[n, lat]` → `[n, lat]` with the f32 kernels.
    pub fn expert_forward(&self, ex: &Expert, z: &[f32], n: usize) -> Result<Vec<f32>> {
        let g = lin(z, n, &ex.w1)?; // [n, fi]
        let u = lin(z, n, &ex.w3)?;
        let mut a = vec![0f32; g.len()];
        situ_glu_slice(&g, &u, &mut a, self.beta, self.linear_beta);
        lin(&a, n, &ex.w2)
    }

    /// This rank's mapped experts (empty when streamed).
    pub fn mapped(&self) -> &[Expert] {
        match &self.weights {
            Weights::Mapped(v) => v,
            Weights::Streamed(_) => &[],
        }
    }

    /// Starts reading the streamed experts `routes` chooses (nothing for mapped weights).
    pub fn prefetch(&self, routes: &[Route]) -> Result<()> {
        let Weights::Streamed(cache) = &self.weights else { return Ok(()) };
        let mut ids: Vec<usize> = routes.iter().flatten().map(|p| p.0).filter(|e| (self.first_expert..self.first_expert + self.count).contains(e)).collect();
        ids.sort_unstable();
        ids.dedup();
        cache.prefetch(self.layer, &ids)
    }

    /// `r` `[T, lat]`: the routed sum over this rank's experts of the tokens `routes` sends
    /// them (global ids; the others' add nothing), unscaled.
    pub fn forward(&self, z: &[f32], t: usize, routes: &[Route]) -> Result<Vec<f32>> {
        let lat = self.latent;
        if z.len() != t * lat || routes.len() != t {
            return Err(ModelError::Internal(format!("routed experts: z holds {} values and {} routes for {t} tokens of {lat}", z.len(), routes.len())));
        }
        // For each local expert, the (token, weight) pairs routed to it.
        let mut groups: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.count];
        for (tok, r) in routes.iter().enumerate() {
            for &(e, w) in r {
                if let Some(g) = e.checked_sub(self.first_expert).and_then(|i| groups.get_mut(i)) {
                    g.push((tok, w));
                }
            }
        }
        let used: Vec<usize> = (0..self.count).filter(|&e| !groups[e].is_empty()).collect();
        let quantized = (self.kernel == Kernel::Q8).then(|| quantize_rows(z, lat, &groups)).transpose()?;
        let mut outs: Vec<(usize, Vec<f32>)> = Vec::with_capacity(used.len());
        match &self.weights {
            Weights::Mapped(v) => {
                let batch: Vec<(usize, &Expert)> = used.iter().map(|&e| (e, &v[e])).collect();
                outs = self.compute(&batch, z, &groups, quantized.as_deref())?;
            }
            Weights::Streamed(cache) => {
                let ids: Vec<usize> = used.iter().map(|&e| e + self.first_expert).collect();
                let mut fetch = cache.fetch(self.layer, &ids)?;
                while let Some(arrived) = fetch.next_ready()? {
                    let batch: Vec<(usize, &Expert)> = arrived.iter().map(|(id, ex)| (id - self.first_expert, ex.as_ref())).collect();
                    outs.extend(self.compute(&batch, z, &groups, quantized.as_deref())?);
                }
                outs.sort_by_key(|o| o.0);
            }
        }
        let mut r = vec![0f32; t * lat];
        for (e, y) in outs {
            for (j, &(tok, w)) in groups[e].iter().enumerate() {
                r[tok * lat..(tok + 1) * lat].iter_mut().zip(&y[j * lat..(j + 1) * lat]).for_each(|(a, &b)| *a += w * b);
            }
        }
        Ok(r)
    }

    /// Every expert of `batch` on its tokens: `(local expert, y [n_e, lat])` in batch order.
    fn compute(&self, batch: &[(usize, &Expert)], z: &[f32], groups: &[Vec<(usize, f32)>], q: Option<&[Option<Q8>]>) -> Result<Vec<(usize, Vec<f32>)>> {
        let lat = self.latent;
        let q8 = |ex: &Expert| matches!((&ex.w1, &ex.w3, &ex.w2), (Matrix::Mxfp4 { .. }, Matrix::Mxfp4 { .. }, Matrix::Mxfp4 { .. }));
        match q {
            Some(q) if batch.iter().all(|(_, ex)| q8(ex)) => self.compute_q8(batch, groups, q),
            _ => {
                let exact = row_exact(); // carried to the worker threads (speculative verification)
                batch
                    .par_iter()
                    .map(|&(e, ex)| {
                        let zin: Vec<f32> = groups[e].iter().flat_map(|&(tok, _)| z[tok * lat..(tok + 1) * lat].iter().copied()).collect(); // [n_e, lat]
                        with_row_exact(exact, || self.expert_forward(ex, &zin, groups[e].len())).map(|y| (e, y))
                    })
                    .collect()
            }
        }
    }

    /// [`Kernel::Q8`]: pass 1 computes `w1`/`w3` rows of every expert in the batch for its
    /// tokens, pass 2 the `w2` rows on the quantized SiTU-GLU outputs.
    fn compute_q8(&self, batch: &[(usize, &Expert)], groups: &[Vec<(usize, f32)>], q: &[Option<Q8>]) -> Result<Vec<(usize, Vec<f32>)>> {
        let (lat, fi) = (self.latent, self.inter);
        let tokens: Vec<Vec<&Q8>> = batch.iter().map(|&(e, _)| groups[e].iter().filter_map(|&(tok, _)| q[tok].as_ref()).collect()).collect();
        if tokens.iter().zip(batch).any(|(ts, &(e, _))| ts.len() != groups[e].len()) {
            return Err(ModelError::Internal("routed experts: a routed token has no quantized row".into()));
        }
        let per = rows_per_item();
        let items = |rows: usize| -> Vec<(usize, usize)> { (0..batch.len()).flat_map(|b| (0..rows.div_ceil(per)).map(move |c| (b, c))).collect() };
        let span = |c: usize, rows: usize| (c * per, ((c + 1) * per).min(rows));
        // Pass 1: (g | u) for rows r0..r1 of w1 and w3, token-major.
        let gu: Vec<Vec<f32>> = items(fi)
            .into_par_iter()
            .map(|(b, c)| {
                let (r0, r1) = span(c, fi);
                let (ex, xs) = (batch[b].1, &tokens[b]);
                let mut o = vec![0f32; 2 * (r1 - r0) * xs.len()];
                let (og, ou) = o.split_at_mut((r1 - r0) * xs.len());
                mxfp4_rows(&ex.w1, lat, r0..r1, xs, og);
                mxfp4_rows(&ex.w3, lat, r0..r1, xs, ou);
                o
            })
            .collect();
        // SiTU-GLU per (expert, token), quantized for w2.
        let mut acts: Vec<Vec<Q8>> = Vec::with_capacity(batch.len());
        let mut it = gu.iter();
        for xs in &tokens {
            let n = xs.len();
            let (mut g, mut u) = (vec![0f32; n * fi], vec![0f32; n * fi]);
            for c in 0..fi.div_ceil(per) {
                let (r0, r1) = span(c, fi);
                let part = it.next().ok_or_else(|| ModelError::Internal("routed experts: pass 1 lost a part".into()))?;
                let w = r1 - r0;
                for i in 0..n {
                    g[i * fi + r0..i * fi + r1].copy_from_slice(&part[i * w..(i + 1) * w]);
                    u[i * fi + r0..i * fi + r1].copy_from_slice(&part[(n + i) * w..(n + i + 1) * w]);
                }
            }
            let mut a = vec![0f32; n * fi];
            situ_glu_slice(&g, &u, &mut a, self.beta, self.linear_beta);
            acts.push(a.chunks_exact(fi).map(quantize).collect::<k3_core::Result<_>>()?);
        }
        // Pass 2: y rows r0..r1 of w2, token-major.
        let ys: Vec<Vec<f32>> = items(lat)
            .into_par_iter()
            .map(|(b, c)| {
                let (r0, r1) = span(c, lat);
                let xs: Vec<&Q8> = acts[b].iter().collect();
                let mut o = vec![0f32; (r1 - r0) * xs.len()];
                mxfp4_rows(&batch[b].1.w2, fi, r0..r1, &xs, &mut o);
                o
            })
            .collect();
        let mut it = ys.iter();
        let mut out = Vec::with_capacity(batch.len());
        for (b, &(e, _)) in batch.iter().enumerate() {
            let n = acts[b].len();
            let mut y = vec![0f32; n * lat];
            for c in 0..lat.div_ceil(per) {
                let (r0, r1) = span(c, lat);
                let part = it.next().ok_or_else(|| ModelError::Internal("routed experts: pass 2 lost a part".into()))?;
                let w = r1 - r0;
                for i in 0..n {
                    y[i * lat + r0..i * lat + r1].copy_from_slice(&part[i * w..(i + 1) * w]);
                }
            }
            out.push((e, y));
        }
        Ok(out)
    }
}

/// Rows `rs` of an MXFP4 matrix with `cols` columns against `xs`, token-major into `out`.
fn mxfp4_rows(m: &Matrix, cols: usize, rs: std::ops::Range<usize>, xs: &[&Q8], out: &mut [f32]) {
    if let Matrix::Mxfp4 { packed, scale } = m {
        let w = rs.len();
        rows_into(packed.bytes(), scale.bytes(), cols, rs, xs, out, w);
    }
}

/// Each routed token's latent row quantized once (`None` for tokens no local expert takes).
fn quantize_rows(z: &[f32], lat: usize, groups: &[Vec<(usize, f32)>]) -> Result<Vec<Option<Q8>>> {
    let mut used = vec![false; z.len() / lat.max(1)];
    for g in groups {
        for &(tok, _) in g {
            used[tok] = true;
        }
    }
    used.par_iter()
        .enumerate()
        .map(|(tok, &u)| if u { quantize(&z[tok * lat..(tok + 1) * lat]).map(Some) } else { Ok(None) })
        .collect::<k3_core::Result<_>>()
        .map_err(Into::into)
}
