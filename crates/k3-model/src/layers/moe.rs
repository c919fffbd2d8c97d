//! Stable LatentMoE (text-backbone §7.2–7.5).
//!
//! Router: `s = σ(W_gate x)` in f32, top-k on `s + e_score_correction_bias` (bias only for the
//! choice), weights `s[sel] / Σ s[sel]`. Routed path in the latent space: `z = W_down x`
//! `[T, lat]`; each expert runs only on the tokens routed to it (tokens grouped by expert):
//! `y = w2 · SiTU-GLU(w1 z, w3 z)`; `r = Σ w_i y_i`, `r · routed_scaling_factor` (once),
//! `RMSNorm_lat(r)`, `W_up r` `[T, H]`. Plus the shared experts on the full-width `x`.
//! Expert weights are F32/BF16 or MXFP4, multiplied in place; where they are (mapped, or read
//! from disk when routed) and which kernel computes them is `experts.rs`.
//!
//! Parallel (`parallel.rs`): the router and the latent down-projection are split by rows over
//! the stage's ranks (each computes its block of the logits and of `z`; one all-gather joins
//! both), the up-projection is whole on every rank; a rank runs only its experts (`first_expert..`, or every expert's share of the intermediate
//! dim without expert parallelism), so its `r` is a partial sum. One all-reduce over the stage
//! adds the partials — of `r` and, when they are split over the same ranks, of the shared
//! experts' output in the same buffer — before the latent RMSNorm, which is not linear.

use std::sync::Arc;

use k3_core::comm::{part, Group, Single};
use k3_core::kernels::cpu::act::sigmoid;
use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::kernels::cpu::norm::rms_norm_inplace;

use super::experts::{Kernel, RoutedExperts, Weights};
use super::ffn::Mlp;
use super::{lin, matrix, vector};
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::offload::cache::ExpertCache;
use crate::source::{Source, Tensors};

pub struct Expert {
    pub w1: Matrix,
    pub w3: Matrix,
    pub w2: Matrix,
}

pub struct Moe {
    /// This rank's rows of the router (`plan.stage_share(num_experts)`); the down-projection
    /// likewise holds `plan.stage_share(routed_expert_hidden_size)` rows.
    pub gate: Matrix,
    pub e_score_correction_bias: Vec<f32>,
    pub routed_expert_down_proj: Matrix,
    pub routed_expert_norm: Option<Vec<f32>>,
    pub routed_expert_up_proj: Matrix,
    pub shared_experts: Option<Mlp>,
    /// This rank's routed experts (global ids `routed.first_expert..`): their weights (mapped
    /// or streamed) and kernel.
    pub routed: RoutedExperts,
    num_experts: usize,
    /// Width of the latent space (all ranks).
    latent: usize,
    /// Ranks of the stage, over which the router and down-projection rows are split.
    stage_ranks: usize,
    /// The shared experts' output is a partial sum to add up with the routed one.
    shared_in_reduce: bool,
    top_k: usize,
    renormalize: bool,
    scaling: f32,
    eps: f32,
}

/// Where a layer's routed experts come from and how they are computed (`Model::load_with`).
#[derive(Clone, Default)]
pub struct ExpertSource {
    /// Read the experts of the layers it covers from disk through this cache.
    pub cache: Option<Arc<ExpertCache>>,
    pub kernel: Kernel,
}

/// One token's routing: expert ids and their weights.
pub type Route = Vec<(usize, f32)>;

fn expert_matrix(ck: &Source<'_>, p: &str, rows: usize, cols: usize, mxfp4: bool, scan_scales: bool) -> Result<Matrix> {
    if mxfp4 {
        let (pn, sn) = (format!("{p}weight_packed"), format!("{p}weight_scale"));
        let wrap = if scan_scales { Matrix::mxfp4 } else { Matrix::mxfp4_unscanned };
        wrap(ck.tensor(&pn)?, ck.tensor(&sn)?).map_err(|e| {
            // A bad scale byte is the scale tensor's fault; a shape mismatch names the pair.
            let msg = e.to_string();
            let name = if msg.contains("scale byte") { sn } else { format!("{pn} / weight_scale") };
            ModelError::Tensor { name, msg }
        })
    } else {
        matrix(ck, &format!("{p}weight"), rows, cols)
    }
}

impl Moe {
    /// `scan_scales`: check every MXFP4 scale byte now (off only when the experts are not
    /// computed with here, see `Model::load_for_gpu`). `source`: the experts of a layer its
    /// cache covers are streamed (not mapped).
    pub fn load(ck: &Source<'_>, cfg: &Config, l: usize, scan_scales: bool, source: &ExpertSource) -> Result<Self> {
        let t = &cfg.text;
        let (h, e, lat) = (t.hidden_size, t.num_experts, t.routed_expert_hidden_size);
        let p = format!("{}block_sparse_moe.", crate::weights::layer_prefix(l));
        let mx = cfg.experts_mxfp4();
        let plan = &ck.plan;
        let mine = plan.experts(e);
        let fi = plan.expert_inter(cfg);
        let weights = match &source.cache {
            Some(c) if c.covers(l) => {
                if fi != t.moe_intermediate_size {
                    return Err(ModelError::Input(format!(
                        "layer {l}: experts read from disk must be whole on each rank, but this layout splits their intermediate width ({fi} of {}): use expert parallelism (--ep) or one rank",
                        t.moe_intermediate_size
                    )));
                }
                Weights::Streamed(c.clone())
            }
            _ => Weights::Mapped(
                mine.clone()
                    .map(|ex| {
                        let q = format!("{p}experts.{ex}.");
                        Ok(Expert {
                            w1: expert_matrix(ck, &format!("{q}w1."), fi, lat, mx, scan_scales)?,
                            w3: expert_matrix(ck, &format!("{q}w3."), fi, lat, mx, scan_scales)?,
                            w2: expert_matrix(ck, &format!("{q}w2."), lat, fi, mx, scan_scales)?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        let si = plan.tp_share(t.moe_intermediate_size * t.num_shared_experts).len();
        let shared = (t.num_shared_experts > 0)
            .then(|| Mlp::load(ck, &format!("{p}shared_experts."), h, si, t.activation_situ_beta, t.activation_situ_linear_beta))
            .transpose()?;
        Ok(Moe {
            gate: matrix(ck, &format!("{p}gate.weight"), plan.stage_share(e).len(), h)?,
            e_score_correction_bias: vector(ck, &format!("{p}gate.e_score_correction_bias"), e)?,
            routed_expert_down_proj: matrix(ck, &format!("{p}routed_expert_down_proj.weight"), plan.stage_share(lat).len(), h)?,
            routed_expert_norm: t.latent_moe_use_norm.then(|| vector(ck, &format!("{p}routed_expert_norm.weight"), lat)).transpose()?,
            routed_expert_up_proj: matrix(ck, &format!("{p}routed_expert_up_proj.weight"), h, lat)?,
            shared_experts: shared,
            routed: RoutedExperts::new(cfg, plan, l, weights, source.kernel),
            num_experts: e,
            latent: lat,
            stage_ranks: plan.par.stage_ranks(),
            shared_in_reduce: plan.shared_in_moe_reduce(),
            top_k: t.num_experts_per_token,
            renormalize: t.moe_renormalize,
            scaling: t.routed_scaling_factor,
            eps: t.rms_norm_eps,
        })
    }

    /// The router logits `[T, E]` and the latent `z` `[T, lat]` of `x`: this rank's row blocks
    /// of both, joined over the stage by one all-gather (rank r's blocks are rows
    /// `part(E, S, r)` and `part(lat, S, r)`).
    pub fn front(&self, x: &[f32], t: usize, stage: &dyn Group) -> Result<(Vec<f32>, Vec<f32>)> {
        let logits = lin(x, t, &self.gate)?; // [T, E_r]
        let z = lin(x, t, &self.routed_expert_down_proj)?; // [T, lat_r]
        let (e, lat, s) = (self.num_experts, self.latent, self.stage_ranks);
        if s == 1 {
            return Ok((logits, z));
        }
        let mut mine = logits;
        mine.extend_from_slice(&z);
        let parts = stage.all_gather(&mine)?;
        if parts.len() != s {
            return Err(ModelError::Internal(format!("MoE all-gather over {} ranks: this layer's router is split over the stage's {s} ranks", parts.len())));
        }
        let (mut lg, mut zz) = (vec![0f32; t * e], vec![0f32; t * lat]);
        for (r, p) in parts.iter().enumerate() {
            let (er, lr) = (part(e, s, r), part(lat, s, r));
            if p.len() != t * (er.len() + lr.len()) {
                return Err(ModelError::Internal(format!("MoE all-gather: rank {r} sent {} values, expected {}", p.len(), t * (er.len() + lr.len()))));
            }
            let (pl, pz) = p.split_at(t * er.len());
            for tok in 0..t {
                lg[tok * e + er.start..tok * e + er.end].copy_from_slice(&pl[tok * er.len()..(tok + 1) * er.len()]);
                zz[tok * lat + lr.start..tok * lat + lr.end].copy_from_slice(&pz[tok * lr.len()..(tok + 1) * lr.len()]);
            }
        }
        Ok((lg, zz))
    }

    /// Router on a rank that holds the whole router: per token, the top-k experts by biased
    /// score, weighted by renormalised raw scores.
    pub fn route(&self, x: &[f32], t: usize) -> Result<Vec<Route>> {
        if self.stage_ranks > 1 {
            return Err(ModelError::Input(format!(
                "Moe::route needs the whole router; this rank holds 1/{} of its rows (forward_in joins them)",
                self.stage_ranks
            )));
        }
        Ok(self.route_logits(&lin(x, t, &self.gate)?))
    }

    /// [`Moe::route`] from the logits `[T, E]`.
    pub fn route_logits(&self, logits: &[f32]) -> Vec<Route> {
        let e = self.num_experts;
        logits
            .chunks_exact(e)
            .map(|row| {
                let s: Vec<f32> = row.iter().map(|&v| sigmoid(v)).collect();
                let mut idx: Vec<usize> = (0..e).collect();
                let key = |i: usize| s[i] + self.e_score_correction_bias[i];
                // Descending by biased score; ties to the lower expert id.
                idx.sort_by(|&a, &b| key(b).partial_cmp(&key(a)).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
                idx.truncate(self.top_k);
                let sum: f32 = idx.iter().map(|&i| s[i]).sum();
                idx.into_iter().map(|i| (i, if self.renormalize { s[i] / sum } else { s[i] })).collect()
            })
            .collect()
    }

    /// One expert on `n` latent rows `z` `[n, lat]` → `[n, lat]` (the f32 kernels).
    pub fn expert_forward(&self, ex: &Expert, z: &[f32], n: usize) -> Result<Vec<f32>> {
        self.routed.expert_forward(ex, z, n)
    }

    /// `x` `[T, H]` → `[T, H]` on a rank that holds the whole layer.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        self.forward_in(x, t, &Single)
    }

    /// `x` `[T, H]` → `[T, H]`, this rank's experts summed with the other ranks' of `stage`.
    pub fn forward_in(&self, x: &[f32], t: usize, stage: &dyn Group) -> Result<Vec<f32>> {
        let (logits, z) = self.front(x, t, stage)?; // [T, E], [T, lat]
        let routes = self.route_logits(&logits);
        // Experts on disk start arriving while the shared experts run.
        self.routed.prefetch(&routes)?;
        let shared = self.shared_experts.as_ref().map(|sh| sh.forward(x, t)).transpose()?; // [T, H]
        let mut r = self.routed.forward(&z, t, &routes)?; // [T, lat], this rank's experts
                                                          // The one reduction: [r | shared] in one buffer when both are partial sums.
        let shared = match shared {
            Some(s) if self.shared_in_reduce => {
                let mut buf = r;
                buf.extend_from_slice(&s);
                stage.all_reduce_sum(&mut buf)?;
                let s = buf.split_off(t * self.latent);
                r = buf;
                Some(s)
            }
            s => {
                stage.all_reduce_sum(&mut r)?;
                s
            }
        };
        r.iter_mut().for_each(|v| *v *= self.scaling);
        if let Some(nw) = &self.routed_expert_norm {
            rms_norm_inplace(&mut r, nw, self.eps);
        }
        let mut out = lin(&r, t, &self.routed_expert_up_proj)?;
        if let Some(s) = shared {
            out.iter_mut().zip(s).for_each(|(a, b)| *a += b);
        }
        Ok(out)
    }
}
