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
//!
//! Experts off the GPU (issue 23, `offload`): a layer whose routed experts are in host memory
//! or on disk uploads none of them. Its forward copies `z` and the routes into page-locked
//! memory behind the router, enqueues the shared experts' down-projection, and while the GPU
//! runs that the CPU computes the routed sum from the mapped (or cached) MXFP4 weights with
//! int8 activations (`layers::experts`, the same code as the CPU model's); the sum goes back
//! up and the layer goes on. Only latent rows cross PCIe. Such a forward waits on the host, so
//! a model with these layers is not captured in CUDA graphs ([`CudaModel::capturable`]).
//! Shapes: `x` BF16 `[N, H]`; logits F32 `[N, E]`; ids/weights `[N, k]`; z BF16 `[N, lat]`;
//! routed sum F32 `[N, lat]`; output F32 `[N, H]`.

use std::sync::{Arc, Mutex};

use k3_core::comm::nccl::CudaGroup;
use k3_core::cuda::moe::{experts_forward, route, ExpertFormat, ExpertWeights};
use k3_core::cuda::ops::{add_assign, cast, rms_norm_cols, shift_i32};
use k3_core::cuda::pinned::Pinned;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::ffn::Mlp;
use super::upload::{matrix, terr, u8_bytes, vector, write_float};
use super::{lin, lin_many};
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::layers::experts::{Kernel, RoutedExperts, Weights};
use crate::layers::moe::Expert;
use crate::offload::ExpertCache;
use crate::placement::Tier;
use crate::source::{Source, Tensors};

/// Where a layer's routed experts are computed.
pub enum Routed {
    /// Uploaded; the grouped expert kernels.
    Gpu(ExpertWeights),
    /// In host memory or on disk; computed by the CPU, `stage` the page-locked landing area of
    /// `z` and the routes.
    Cpu { experts: RoutedExperts, stage: Mutex<Option<Pinned>> },
}

pub struct Moe {
    /// This rank's rows of the router; `routed_expert_down_proj` likewise (`plan.stage_share`).
    pub gate: CudaTensor,
    pub e_score_correction_bias: CudaTensor,
    pub routed_expert_down_proj: CudaTensor,
    pub routed_expert_norm: Option<CudaTensor>,
    pub routed_expert_up_proj: CudaTensor,
    pub shared_experts: Option<Mlp>,
    /// This rank's routed experts (global ids `first_expert..first_expert + count`).
    pub routed: Routed,
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
    /// expert's share of the intermediate dim) on `tier` — uploaded, mapped for the CPU, or read
    /// through `cache` — and its share of the shared experts.
    pub fn load(dev: &CudaDevice, ck: &Source<'_>, cfg: &Config, l: usize, dt: DType, tier: Tier, cache: Option<&Arc<ExpertCache>>) -> Result<Self> {
        let t = &cfg.text;
        let (h, e, lat) = (t.hidden_size, t.num_experts, t.routed_expert_hidden_size);
        let p = format!("{}block_sparse_moe.", crate::weights::layer_prefix(l));
        let mx = cfg.experts_mxfp4();
        let plan = &ck.plan;
        let mine = plan.experts(e);
        let fi = plan.expert_inter(cfg);
        let on_cpu = |weights: Weights| Routed::Cpu { experts: RoutedExperts::new(cfg, plan, l, weights, Kernel::Q8), stage: Mutex::new(None) };
        let routed = match tier {
            Tier::Gpu => {
                let (w13, w13_scale) = upload_experts(dev, ck, &p, mine.clone(), &["w1", "w3"], fi, lat, mx, dt)?;
                let (w2, w2_scale) = upload_experts(dev, ck, &p, mine.clone(), &["w2"], lat, fi, mx, dt)?;
                let format = match (mx, dt) {
                    (true, _) => ExpertFormat::Mxfp4,
                    (false, DType::F32) => ExpertFormat::F32,
                    (false, _) => ExpertFormat::Bf16,
                };
                Routed::Gpu(ExpertWeights { format, num_experts: mine.len(), latent: lat, inter: fi, w13, w13_scale, w2, w2_scale })
            }
            Tier::Host => on_cpu(Weights::Mapped(cpu_experts(ck, &p, mine.clone(), fi, lat, mx)?)),
            Tier::Disk => match cache {
                Some(c) if c.covers(l) && fi == t.moe_intermediate_size => on_cpu(Weights::Streamed(c.clone())),
                Some(_) if fi != t.moe_intermediate_size => {
                    return Err(ModelError::Input(format!(
                        "layer {l}: experts read from disk must be whole on each rank, but this layout splits their intermediate width ({fi} of {}): use --ep",
                        t.moe_intermediate_size
                    )))
                }
                _ => return Err(ModelError::Internal(format!("layer {l} is placed on disk but no expert cache covers it"))),
            },
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
            routed,
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
        let (r, shared) = match &self.routed {
            Routed::Gpu(experts) => {
                // Global ids to this rank's: other ranks' experts fall outside 0..E_local and add nothing.
                shift_i32(&ids, -(self.first_expert as i32))?;
                let r = CudaTensor::uninit(dev, DType::F32, z.shape().to_vec())?; // [N, lat]
                experts_forward(&z, &ids, &wts, experts, self.beta, self.linear_beta, self.scaling, &r)?;
                // The shared experts' output is complete on every rank, or a partial sum over the stage.
                (r, shared.map(|(sh, g, u)| sh.down(&g, &u)).transpose()?) // F32 [N, H]
            }
            Routed::Cpu { experts, stage } => {
                let mut stage = stage.lock().unwrap_or_else(|p| p.into_inner());
                let landed = self.land(&z, &ids, &wts, &mut stage)?;
                // The GPU runs the shared experts while the CPU computes the routed ones.
                let shared = shared.map(|(sh, g, u)| sh.down(&g, &u)).transpose()?;
                let r = self.routed_on_cpu(experts, &landed, stage.as_ref())?;
                (r, shared)
            }
        };
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
        let sh = self.shared_experts.as_ref().map_or(0, |m| m.weight_bytes());
        let trunk = (self.gate.byte_len() + self.routed_expert_down_proj.byte_len() + self.routed_expert_up_proj.byte_len()) as u64 + sh;
        let Routed::Gpu(e) = &self.routed else { return trunk };
        let per_expert =
            (e.w13.byte_len() + e.w2.byte_len() + e.w13_scale.as_ref().map_or(0, |t| t.byte_len()) + e.w2_scale.as_ref().map_or(0, |t| t.byte_len()))
                / e.num_experts.max(1);
        // This rank's expected share of the top_k routed pairs.
        trunk + (per_expert * self.top_k * e.num_experts / self.num_experts.max(1)) as u64
    }

    /// Whether this layer's routed experts are computed by the CPU (not capturable in a graph).
    pub fn on_cpu(&self) -> bool {
        matches!(self.routed, Routed::Cpu { .. })
    }

    /// Whether a step of `n` rows through this layer can be captured in a CUDA graph: its routed
    /// experts on the GPU and their kernels' path for `n` rows capturable (k3-core
    /// `moe::capturable`; `reference`: the F32 reference precision).
    pub fn capturable_rows(&self, n: usize, reference: bool) -> bool {
        match &self.routed {
            Routed::Gpu(w) => k3_core::cuda::moe::capturable(n, w.num_experts, self.top_k, reference),
            Routed::Cpu { .. } => false,
        }
    }

    /// Enqueues the copies of `z` `[N, lat]`, `ids` and `wts` `[N, k]` into the landing area
    /// (grown as needed) and records an event after them: `(event, z offset, ids offset, wts
    /// offset)`.
    fn land(&self, z: &CudaTensor, ids: &CudaTensor, wts: &CudaTensor, stage: &mut Option<Pinned>) -> Result<Landed> {
        let dev = z.cuda_device();
        let (zb, ib, wb) = (z.byte_len(), ids.byte_len(), wts.byte_len());
        let need = zb + ib + wb;
        if stage.as_ref().is_none_or(|p| p.len() < need) {
            *stage = None;
            *stage = Some(Pinned::new(dev, need.next_power_of_two())?);
        }
        let p = stage.as_mut().ok_or_else(|| ModelError::Internal("no landing area".into()))?;
        p.download(0, z)?;
        p.download(zb, ids)?;
        p.download(zb + ib, wts)?;
        let ev = dev.new_event(false)?;
        ev.record(&dev.stream())?;
        Ok(Landed { event: ev, n: z.shape()[0], z_dtype: z.dtype(), offsets: [0, zb, zb + ib] })
    }

    /// Waits for the landed rows, computes this rank's routed sum on the CPU (scaled, as the
    /// GPU kernel leaves it) and uploads it: F32 `[N, lat]`.
    fn routed_on_cpu(&self, experts: &RoutedExperts, l: &Landed, stage: Option<&Pinned>) -> Result<CudaTensor> {
        let p = stage.ok_or_else(|| ModelError::Internal("no landing area".into()))?;
        l.event.synchronize()?;
        let (n, lat, k) = (l.n, experts.latent, self.top_k);
        let zb = p.bytes(l.offsets[0], l.offsets[1] - l.offsets[0])?;
        let z: Vec<f32> = match l.z_dtype {
            DType::F32 => bytemuck::pod_collect_to_vec(zb),
            _ => bytemuck::pod_collect_to_vec::<u8, half::bf16>(zb).iter().map(|v| v.to_f32()).collect(),
        };
        let ids: Vec<i32> = bytemuck::pod_collect_to_vec(p.bytes(l.offsets[1], n * k * 4)?);
        let wts: Vec<f32> = bytemuck::pod_collect_to_vec(p.bytes(l.offsets[2], n * k * 4)?);
        let routes: Vec<crate::layers::moe::Route> = (0..n).map(|i| (0..k).map(|j| (ids[i * k + j] as usize, wts[i * k + j])).collect()).collect();
        let mut r = experts.forward(&z, n, &routes)?;
        r.iter_mut().for_each(|v| *v *= self.scaling);
        Ok(CudaTensor::from_f32(self.gate.cuda_device(), vec![n, lat], &r)?)
    }
}

/// `z`, the ids and the weights of one step in the landing area, and the event after them.
struct Landed {
    event: k3_core::cuda::Event,
    n: usize,
    z_dtype: DType,
    offsets: [usize; 3],
}

/// A layer's experts `experts` as CPU matrices over the memory map (host tier), every MXFP4
/// scale byte checked now (the CPU computes with them) and every page asked for at once
/// (`Tensor::advise_willneed`), so the first steps do not fault them in from disk one by one.
fn cpu_experts(ck: &Source<'_>, p: &str, experts: std::ops::Range<usize>, fi: usize, lat: usize, mx: bool) -> Result<Vec<Expert>> {
    use k3_core::kernels::cpu::matmul::Matrix;
    let m = |name: String, rows: usize, cols: usize| -> Result<Matrix> {
        if mx {
            let (pn, sn) = (format!("{name}weight_packed"), format!("{name}weight_scale"));
            let (pt, st) = (ck.tensor(&pn)?, ck.tensor(&sn)?);
            pt.advise_willneed();
            Matrix::mxfp4(pt, st).map_err(|e| ModelError::Tensor { name: sn, msg: e.to_string() })
        } else {
            let n = format!("{name}weight");
            let t = ck.tensor(&n)?;
            t.advise_willneed();
            if t.shape() != [rows, cols] {
                return Err(ModelError::Tensor { name: n, msg: format!("has shape {:?}, expected [{rows}, {cols}]", t.shape()) });
            }
            Matrix::dense(t).map_err(|e| ModelError::Tensor { name: n, msg: e.to_string() })
        }
    };
    experts
        .map(|ex| {
            let q = format!("{p}experts.{ex}.");
            Ok(Expert { w1: m(format!("{q}w1."), fi, lat)?, w3: m(format!("{q}w3."), fi, lat)?, w2: m(format!("{q}w2."), lat, fi)? })
        })
        .collect()
}
