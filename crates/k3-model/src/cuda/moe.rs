//! Stable LatentMoE on the GPU (text-backbone §7.2–7.5): router GEMM (F32 logits) and top-k
//! (`k3_core::cuda::moe::route`), latent down-projection, the routed experts read in place as
//! MXFP4 or BF16 with SiTU-GLU fused and the weighted, scaled combine
//! (`k3_core::cuda::moe::experts_forward`), the latent RMSNorm, the up-projection, plus the
//! shared experts. Same weights, same names as `layers/moe.rs`.
//!
//! On a parallel rank (`parallel.rs`) the router and the latent down-projection hold this rank's
//! rows of the stage's split (one NCCL group of two all-gathers joins the logits and `z`), the
//! up-projection is whole, the routed experts its own (`first_expert..`; ids are shifted so the others' add nothing) or
//! every expert's share of the intermediate dim, and one grouped NCCL reduction over the stage
//! sums the routed partials (and the shared experts' when they are split too).
//!
//! Expert weights are uploaded contiguously by expert (`w13` = each expert's w1 rows then its
//! w3 rows; `w2`), so a kernel finds expert e at a fixed stride.
//! Shapes: `x` BF16 `[N, H]`; logits F32 `[N, E]`; ids/weights `[N, k]`; z BF16 `[N, lat]`;
//! routed sum F32 `[N, lat]`; output F32 `[N, H]`.

use k3_core::comm::nccl::CudaGroup;
use k3_core::cuda::moe::{experts_forward, route, ExpertFormat, ExpertWeights};
use k3_core::cuda::ops::{add_assign, cast, rms_norm_cols, shift_i32};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::ffn::Mlp;
use super::upload::{matrix, terr, u8_bytes, vector, write_float};
use super::{lin, lin_many};
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::source::{Source, Tensors};

pub struct Moe {
    /// This rank's rows of the router; `routed_expert_down_proj` likewise (`plan.stage_share`).
    pub gate: CudaTensor,
    pub e_score_correction_bias: CudaTensor,
    pub routed_expert_down_proj: CudaTensor,
    pub routed_expert_norm: Option<CudaTensor>,
    pub routed_expert_up_proj: CudaTensor,
    pub shared_experts: Option<Mlp>,
    /// This rank's routed experts (global ids `first_expert..first_expert + experts.num_experts`).
    pub experts: ExpertWeights,
    pub first_expert: usize,
    /// Experts in the layer (all ranks).
    num_experts: usize,
    /// The shared experts' output is a partial sum, reduced together with the routed one.
    shared_in_reduce: bool,
    top_k: usize,
    renormalize: bool,
    scaling: f32,
    eps: f32,
    beta: f32,
    linear_beta: f32,
}

/// The `experts` of one layer, each one's `w{a}` (then `w{b}`), one after the other in one
/// device tensor (local index = position in `experts`).
fn upload_experts(
    dev: &CudaDevice,
    ck: &Source<'_>,
    p: &str,
    experts: std::ops::Range<usize>,
    parts: &[&str],
    rows: usize,
    cols: usize,
    mx: bool,
    dt: DType,
) -> Result<(CudaTensor, Option<CudaTensor>)> {
    let (np, e) = (parts.len(), experts.len());
    let first = format!("{p}experts.{}.{}.", experts.start, parts[0]);
    if mx {
        let packed = CudaTensor::uninit(dev, DType::U8, vec![e, np * rows, cols / 2]).map_err(terr(&first))?;
        let scale = CudaTensor::uninit(dev, DType::U8, vec![e, np * rows, cols / 32]).map_err(terr(&first))?;
        let (pb, sb) = (rows * cols / 2, rows * cols / 32);
        for (i, ex) in experts.clone().enumerate() {
            for (j, w) in parts.iter().enumerate() {
                let (pn, sn) = (format!("{p}experts.{ex}.{w}.weight_packed"), format!("{p}experts.{ex}.{w}.weight_scale"));
                let (pt, st) = (ck.tensor(&pn)?, ck.tensor(&sn)?);
                let sbytes = u8_bytes(&st, &sn, rows, cols / 32)?;
                k3_core::kernels::cpu::mxfp4::check_scales(sbytes).map_err(terr(&sn))?;
                packed.write_at((i * np + j) * pb, u8_bytes(&pt, &pn, rows, cols / 2)?).map_err(terr(&pn))?;
                scale.write_at((i * np + j) * sb, sbytes).map_err(terr(&sn))?;
            }
        }
        Ok((packed, Some(scale)))
    } else {
        let w = CudaTensor::uninit(dev, dt, vec![e, np * rows, cols]).map_err(terr(&first))?;
        let b = rows * cols * dt.size_in_bytes();
        for (i, ex) in experts.clone().enumerate() {
            for (j, part) in parts.iter().enumerate() {
                let n = format!("{p}experts.{ex}.{part}.weight");
                let t = ck.tensor(&n)?;
                if t.shape() != [rows, cols] {
                    return Err(ModelError::Tensor { name: n, msg: format!("has shape {:?}, expected [{rows}, {cols}]", t.shape()) });
                }
                write_float(&w, (i * np + j) * b, &t, &n, dt)?;
            }
        }
        Ok((w, None))
    }
}

impl Moe {
    /// Layer `l`'s MoE on this rank: its routed experts (or, without expert parallelism, every
    /// expert's share of the intermediate dim) and its share of the shared experts.
    pub fn load(dev: &CudaDevice, ck: &Source<'_>, cfg: &Config, l: usize, dt: DType) -> Result<Self> {
        let t = &cfg.text;
        let (h, e, lat) = (t.hidden_size, t.num_experts, t.routed_expert_hidden_size);
        let p = format!("{}block_sparse_moe.", crate::weights::layer_prefix(l));
        let mx = cfg.experts_mxfp4();
        let plan = &ck.plan;
        let mine = plan.experts(e);
        let fi = plan.expert_inter(cfg);
        let (w13, w13_scale) = upload_experts(dev, ck, &p, mine.clone(), &["w1", "w3"], fi, lat, mx, dt)?;
        let (w2, w2_scale) = upload_experts(dev, ck, &p, mine.clone(), &["w2"], lat, fi, mx, dt)?;
        let format = match (mx, dt) {
            (true, _) => ExpertFormat::Mxfp4,
            (false, DType::F32) => ExpertFormat::F32,
            (false, _) => ExpertFormat::Bf16,
        };
        let s = plan.par.stage_ranks();
        if e % s != 0 || lat % s != 0 {
            return Err(ModelError::Field {
                field: "text_config.num_experts / routed_expert_hidden_size".into(),
                msg: format!("{e} / {lat} do not split evenly over the stage's {s} ranks: the GPU all-gathers the router and latent blocks in equal parts"),
            });
        }
        let si = plan.tp_share(t.moe_intermediate_size * t.num_shared_experts).len();
        let shared = (t.num_shared_experts > 0)
            .then(|| Mlp::load(dev, ck, &format!("{p}shared_experts."), h, si, t.activation_situ_beta, t.activation_situ_linear_beta, dt))
            .transpose()?;
        Ok(Moe {
            gate: matrix(dev, ck, &format!("{p}gate.weight"), e / s, h, dt)?,
            e_score_correction_bias: vector(dev, ck, &format!("{p}gate.e_score_correction_bias"), e)?,
            routed_expert_down_proj: matrix(dev, ck, &format!("{p}routed_expert_down_proj.weight"), lat / s, h, dt)?,
            routed_expert_norm: t.latent_moe_use_norm.then(|| vector(dev, ck, &format!("{p}routed_expert_norm.weight"), lat)).transpose()?,
            routed_expert_up_proj: matrix(dev, ck, &format!("{p}routed_expert_up_proj.weight"), h, lat, dt)?,
            shared_experts: shared,
            experts: ExpertWeights { format, num_experts: mine.len(), latent: lat, inter: fi, w13, w13_scale, w2, w2_scale },
            first_expert: mine.start,
            num_experts: e,
            shared_in_reduce: plan.shared_in_moe_reduce(),
            top_k: t.num_experts_per_token,
            renormalize: t.moe_renormalize,
            scaling: t.routed_scaling_factor,
            eps: t.rms_norm_eps,
            beta: t.activation_situ_beta,
            linear_beta: t.activation_situ_linear_beta,
        })
    }

    /// `x` BF16 `[N, H]` → F32 `[N, H]`, this rank's experts summed with the other ranks' of
    /// `stage` (one reduction, before the latent norm, which is not linear).
    pub fn forward(&self, x: &CudaTensor, stage: &CudaGroup) -> Result<CudaTensor> {
        let (n, dev) = (x.shape()[0], x.cuda_device());
        // The router, the latent down-projection and the shared experts' gate/up read the same x.
        let (bf, f32) = (x.dtype(), DType::F32); // bf: BF16, or F32 in the reference precision
        let (logits, z, shared) = match &self.shared_experts {
            Some(sh) => {
                let [logits, z, g, u] = lin_many(x, [(&self.gate, f32), (&self.routed_expert_down_proj, bf), (&sh.gate_proj, bf), (&sh.up_proj, bf)])?;
                (logits, z, Some((sh, g, u)))
            }
            None => {
                let [logits, z] = lin_many(x, [(&self.gate, f32), (&self.routed_expert_down_proj, bf)])?;
                (logits, z, None)
            }
        }; // this rank's blocks: logits F32 [N, E/S], z BF16 [N, lat/S]; g/u BF16 [N, I·shared]
        let [logits, z] = super::stage::gather_cols(stage, [logits, z])?; // [N, E], [N, lat]
        let ids = CudaTensor::uninit(dev, DType::I32, vec![n, self.top_k])?;
        let wts = CudaTensor::uninit(dev, DType::F32, vec![n, self.top_k])?;
        route(&logits, &self.e_score_correction_bias, self.top_k, self.renormalize, &ids, &wts)?;
        // Global ids to this rank's: other ranks' experts fall outside 0..E_local and add nothing.
        shift_i32(&ids, -(self.first_expert as i32))?;
        let r = CudaTensor::uninit(dev, DType::F32, z.shape().to_vec())?; // [N, lat]
        experts_forward(&z, &ids, &wts, &self.experts, self.beta, self.linear_beta, self.scaling, &r)?;
        // The shared experts' output is complete on every rank, or a partial sum over the stage.
        let shared = shared.map(|(sh, g, u)| sh.down(&g, &u)).transpose()?; // F32 [N, H]
        stage.group(|s| {
            s.all_reduce_sum(&r)?;
            match &shared {
                Some(y) if self.shared_in_reduce => s.all_reduce_sum(y),
                _ => Ok(()),
            }
        })?;
        let rn = CudaTensor::uninit(dev, bf, z.shape().to_vec())?;
        match &self.routed_expert_norm {
            Some(w) => rms_norm_cols(&r, r.last_dim(), w, self.eps, &rn)?,
            None => cast(&r, &rn)?,
        }
        let out = lin(&rn, &self.routed_expert_up_proj, DType::F32)?; // [N, H]
        if let Some(y) = shared {
            add_assign(&out, &y)?;
        }
        Ok(out)
    }

    /// Weight bytes one decode token reads: router, latent projections, shared experts and
    /// `top_k` routed experts.
    pub fn weight_bytes(&self) -> u64 {
        let e = &self.experts;
        let per_expert =
            (e.w13.byte_len() + e.w2.byte_len() + e.w13_scale.as_ref().map_or(0, |t| t.byte_len()) + e.w2_scale.as_ref().map_or(0, |t| t.byte_len()))
                / e.num_experts.max(1);
        let sh = self.shared_experts.as_ref().map_or(0, |m| m.weight_bytes());
        // This rank's expected share of the top_k routed pairs.
        let routed = (per_expert * self.top_k * e.num_experts / self.num_experts.max(1)) as u64;
        (self.gate.byte_len() + self.routed_expert_down_proj.byte_len() + self.routed_expert_up_proj.byte_len()) as u64 + sh + routed
    }
}
