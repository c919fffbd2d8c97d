//! Stable LatentMoE on the GPU (text-backbone §7.2–7.5): router GEMM (F32 logits) and top-k
//! (`k3_core::cuda::moe::route`), latent down-projection, the routed experts read in place as
//! MXFP4 or BF16 with SiTU-GLU fused and the weighted, scaled combine
//! (`k3_core::cuda::moe::experts_forward`), the latent RMSNorm, the up-projection, plus the
//! shared experts. Same weights, same names as `layers/moe.rs`.
//!
//! Expert weights are uploaded contiguously by expert (`w13` = each expert's w1 rows then its
//! w3 rows; `w2`), so a kernel finds expert e at a fixed stride.
//! Shapes: `x` BF16 `[N, H]`; logits F32 `[N, E]`; ids/weights `[N, k]`; z BF16 `[N, lat]`;
//! routed sum F32 `[N, lat]`; output F32 `[N, H]`.

use k3_core::cuda::moe::{experts_forward, route, ExpertFormat, ExpertWeights};
use k3_core::cuda::ops::{add_assign, cast, rms_norm_cols};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::ffn::Mlp;
use super::{lin, lin_many};
use super::upload::{matrix, terr, u8_bytes, vector, write_float};
use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::error::{ModelError, Result};

pub struct Moe {
    pub gate: CudaTensor,
    pub e_score_correction_bias: CudaTensor,
    pub routed_expert_down_proj: CudaTensor,
    pub routed_expert_norm: Option<CudaTensor>,
    pub routed_expert_up_proj: CudaTensor,
    pub shared_experts: Option<Mlp>,
    pub experts: ExpertWeights,
    top_k: usize,
    renormalize: bool,
    scaling: f32,
    eps: f32,
    beta: f32,
    linear_beta: f32,
}

/// Every expert's `w{a}` (then `w{b}`) of one layer, one after the other in one device tensor.
#[allow(clippy::too_many_arguments)]
fn upload_experts(dev: &CudaDevice, ck: &Checkpoint, p: &str, e: usize, parts: &[&str], rows: usize, cols: usize, mx: bool, dt: DType) -> Result<(CudaTensor, Option<CudaTensor>)> {
    let np = parts.len();
    let first = format!("{p}experts.0.{}.", parts[0]);
    if mx {
        let packed = CudaTensor::uninit(dev, DType::U8, vec![e, np * rows, cols / 2]).map_err(terr(&first))?;
        let scale = CudaTensor::uninit(dev, DType::U8, vec![e, np * rows, cols / 32]).map_err(terr(&first))?;
        let (pb, sb) = (rows * cols / 2, rows * cols / 32);
        for ex in 0..e {
            for (j, w) in parts.iter().enumerate() {
                let (pn, sn) = (format!("{p}experts.{ex}.{w}.weight_packed"), format!("{p}experts.{ex}.{w}.weight_scale"));
                let (pt, st) = (ck.tensor(&pn)?, ck.tensor(&sn)?);
                let sbytes = u8_bytes(&st, &sn, rows, cols / 32)?;
                k3_core::kernels::cpu::mxfp4::check_scales(sbytes).map_err(terr(&sn))?;
                packed.write_at((ex * np + j) * pb, u8_bytes(&pt, &pn, rows, cols / 2)?).map_err(terr(&pn))?;
                scale.write_at((ex * np + j) * sb, sbytes).map_err(terr(&sn))?;
            }
        }
        Ok((packed, Some(scale)))
    } else {
        let w = CudaTensor::uninit(dev, dt, vec![e, np * rows, cols]).map_err(terr(&first))?;
        let b = rows * cols * dt.size_in_bytes();
        for ex in 0..e {
            for (j, part) in parts.iter().enumerate() {
                let n = format!("{p}experts.{ex}.{part}.weight");
                let t = ck.tensor(&n)?;
                if t.shape() != [rows, cols] {
                    return Err(ModelError::Tensor { name: n, msg: format!("has shape {:?}, expected [{rows}, {cols}]", t.shape()) });
                }
                write_float(&w, (ex * np + j) * b, &t, &n, dt)?;
            }
        }
        Ok((w, None))
    }
}

impl Moe {
    pub fn load(dev: &CudaDevice, ck: &Checkpoint, cfg: &Config, l: usize, dt: DType) -> Result<Self> {
        let t = &cfg.text;
        let (h, e, lat, fi) = (t.hidden_size, t.num_experts, t.routed_expert_hidden_size, t.moe_intermediate_size);
        let p = format!("{}block_sparse_moe.", crate::weights::layer_prefix(l));
        let mx = cfg.experts_mxfp4();
        let (w13, w13_scale) = upload_experts(dev, ck, &p, e, &["w1", "w3"], fi, lat, mx, dt)?;
        let (w2, w2_scale) = upload_experts(dev, ck, &p, e, &["w2"], lat, fi, mx, dt)?;
        let format = match (mx, dt) {
            (true, _) => ExpertFormat::Mxfp4,
            (false, DType::F32) => ExpertFormat::F32,
            (false, _) => ExpertFormat::Bf16,
        };
        let shared = (t.num_shared_experts > 0)
            .then(|| Mlp::load(dev, ck, &format!("{p}shared_experts."), h, fi * t.num_shared_experts, t.activation_situ_beta, t.activation_situ_linear_beta, dt))
            .transpose()?;
        Ok(Moe {
            gate: matrix(dev, ck, &format!("{p}gate.weight"), e, h, dt)?,
            e_score_correction_bias: vector(dev, ck, &format!("{p}gate.e_score_correction_bias"), e)?,
            routed_expert_down_proj: matrix(dev, ck, &format!("{p}routed_expert_down_proj.weight"), lat, h, dt)?,
            routed_expert_norm: t.latent_moe_use_norm.then(|| vector(dev, ck, &format!("{p}routed_expert_norm.weight"), lat)).transpose()?,
            routed_expert_up_proj: matrix(dev, ck, &format!("{p}routed_expert_up_proj.weight"), h, lat, dt)?,
            shared_experts: shared,
            experts: ExpertWeights { format, num_experts: e, latent: lat, inter: fi, w13, w13_scale, w2, w2_scale },
            top_k: t.num_experts_per_token,
            renormalize: t.moe_renormalize,
            scaling: t.routed_scaling_factor,
            eps: t.rms_norm_eps,
            beta: t.activation_situ_beta,
            linear_beta: t.activation_situ_linear_beta,
        })
    }

    /// `x` BF16 `[N, H]` → F32 `[N, H]`.
    pub fn forward(&self, x: &CudaTensor) -> Result<CudaTensor> {
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
        }; // logits F32 [N, E], z BF16 [N, lat], g/u BF16 [N, I·shared]
        let ids = CudaTensor::uninit(dev, DType::I32, vec![n, self.top_k])?;
        let wts = CudaTensor::uninit(dev, DType::F32, vec![n, self.top_k])?;
        route(&logits, &self.e_score_correction_bias, self.top_k, self.renormalize, &ids, &wts)?;
        let r = CudaTensor::uninit(dev, DType::F32, z.shape().to_vec())?; // [N, lat]
        experts_forward(&z, &ids, &wts, &self.experts, self.beta, self.linear_beta, self.scaling, &r)?;
        let rn = CudaTensor::uninit(dev, bf, z.shape().to_vec())?;
        match &self.routed_expert_norm {
            Some(w) => rms_norm_cols(&r, r.last_dim(), w, self.eps, &rn)?,
            None => cast(&r, &rn)?,
        }
        let out = lin(&rn, &self.routed_expert_up_proj, DType::F32)?; // [N, H]
        if let Some((sh, g, u)) = shared {
            add_assign(&out, &sh.down(&g, &u)?)?;
        }
        Ok(out)
    }

    /// Weight bytes one decode token reads: router, latent projections, shared experts and
    /// `top_k` routed experts.
    pub fn weight_bytes(&self) -> u64 {
        let e = &self.experts;
        let per_expert = (e.w13.byte_len() + e.w2.byte_len() + e.w13_scale.as_ref().map_or(0, |t| t.byte_len()) + e.w2_scale.as_ref().map_or(0, |t| t.byte_len())) / e.num_experts.max(1);
        let sh = self.shared_experts.as_ref().map_or(0, |m| m.weight_bytes());
        (self.gate.byte_len() + self.routed_expert_down_proj.byte_len() + self.routed_expert_up_proj.byte_len()) as u64 + sh + (per_expert * self.top_k) as u64
    }
}
