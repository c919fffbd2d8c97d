//! The KDA token mixer on the GPU (text-backbone §3): the projections as cuBLAS GEMMs (BF16 out),
//! then one fused kernel from the raw projections to the gated, normed output
//! (`k3_core::cuda::kda`: chunked prefill — from device tables in a captured verify step — or
//! the one-token decode step that CUDA graphs capture), then `o_proj`. Same weights, same
//! names as `layers/kda.rs`.
//!
//! On a tensor-parallel rank the layer holds its heads only (`nh` = its share; the kernels take
//! the head count from the shapes) and its output is a partial `o_proj` sum.
//!
//! Shapes: `x` BF16 `[N, H]`; `D = nh · head_dim`; q/k/v/g/gate BF16 `[N, D]`, beta `[N, nh]`;
//! state in this layer's pools (see `state.rs`); output F32 `[N, H]`.

use k3_core::cuda::kda::{kda_decode, kda_prefill, kda_prefill_tables, KdaInputs, KdaWeights};
use k3_core::cuda::ops::scatter_rows;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::state::Step;
use super::upload::{f32s, matrix, vector};
use super::verify::KdaKept;
use super::{lin, lin_many};
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::source::{Source, Tensors};

pub struct Kda {
    pub q_proj: CudaTensor,
    pub k_proj: CudaTensor,
    pub v_proj: CudaTensor,
    /// F32 `[3, D, 4]`: the q, k, v depthwise conv kernels.
    pub conv1d: CudaTensor,
    pub b_proj: CudaTensor,
    pub f_a_proj: CudaTensor,
    pub f_b_proj: CudaTensor,
    /// F32 `[nh]`.
    pub a_log: CudaTensor,
    pub dt_bias: CudaTensor,
    pub g_proj: CudaTensor,
    pub o_norm: CudaTensor,
    pub o_proj: CudaTensor,
    /// Pools: conv tails BF16 (F32 in the reference precision) `[S, 3, 3, D]`, state F32 `[S, nh, hd, hd]`.
    pub conv_pool: CudaTensor,
    pub state_pool: CudaTensor,
    lower_bound: f32,
    eps: f32,
}

impl Kda {
    /// Layer `l`'s mixer: this rank's heads (all of them on one rank), pools for `max_seqs`.
    pub fn load(dev: &CudaDevice, ck: &Source<'_>, cfg: &Config, l: usize, max_seqs: usize, dt: DType) -> Result<Self> {
        let la = &cfg.text.linear_attn_config;
        let (h, hd, kernel) = (cfg.text.hidden_size, la.head_dim, la.short_conv_kernel_size);
        let nh = ck.plan.tp_share(la.num_heads).len();
        let d = nh * hd;
        let p = format!("{}self_attn.", crate::weights::layer_prefix(l));
        if kernel != 4 {
            return Err(ModelError::Field {
                field: "linear_attn_config.short_conv_kernel_size".into(),
                msg: format!("{kernel}: the CUDA KDA kernels are built for 4 (K3's)"),
            });
        }
        let mut conv = Vec::with_capacity(3 * d * 4);
        for x in ["q", "k", "v"] {
            conv.extend(crate::layers::vector(ck, &format!("{p}{x}_conv1d.weight"), d * kernel)?);
        }
        let a_log = ck.a_log(&format!("{p}A_log"), la.num_heads)?;
        Ok(Kda {
            q_proj: matrix(dev, ck, &format!("{p}q_proj.weight"), d, h, dt)?,
            k_proj: matrix(dev, ck, &format!("{p}k_proj.weight"), d, h, dt)?,
            v_proj: matrix(dev, ck, &format!("{p}v_proj.weight"), d, h, dt)?,
            conv1d: f32s(dev, &conv, vec![3, d, 4], &format!("{p}q/k/v_conv1d.weight"))?,
            b_proj: matrix(dev, ck, &format!("{p}b_proj.weight"), nh, h, dt)?,
            f_a_proj: matrix(dev, ck, &format!("{p}f_a_proj.weight"), hd, h, dt)?,
            f_b_proj: matrix(dev, ck, &format!("{p}f_b_proj.weight"), d, hd, dt)?,
            a_log: f32s(dev, &a_log, vec![nh], &format!("{p}A_log"))?,
            dt_bias: vector(dev, ck, &format!("{p}dt_bias"), d)?,
            g_proj: matrix(dev, ck, &format!("{p}g_proj.weight"), d, h, dt)?,
            o_norm: vector(dev, ck, &format!("{p}o_norm.weight"), hd)?,
            o_proj: matrix(dev, ck, &format!("{p}o_proj.weight"), h, d, dt)?,
            conv_pool: CudaTensor::zeros(dev, dt, vec![max_seqs, 3, 3, d])?,
            state_pool: CudaTensor::zeros(dev, DType::F32, vec![max_seqs, nh, hd, hd])?,
            lower_bound: la.gate_lower_bound.unwrap_or(-5.0),
            eps: cfg.text.rms_norm_eps,
        })
    }

    /// Zeroes one slot's conv tails and recurrent state (a new sequence).
    pub fn reset_slot(&self, slot: usize) -> Result<()> {
        for t in [&self.conv_pool, &self.state_pool] {
            let per = t.byte_len() / t.shape()[0];
            t.fill_range(slot * per, per, 0)?;
        }
        Ok(())
    }

    /// `x` BF16 `[N, H]` → F32 `[N, H]`, advancing the step's sequences' states.
    pub(crate) fn forward(&self, x: &CudaTensor, step: &Step) -> Result<CudaTensor> {
        let bf = x.dtype(); // BF16, or F32 in the reference precision
        let ws = [(&self.q_proj, bf), (&self.k_proj, bf), (&self.v_proj, bf), (&self.b_proj, bf), (&self.f_a_proj, bf), (&self.g_proj, bf)];
        let [q, k, v, beta, g_low, gate] = lin_many(x, ws)?; // q/k/v/gate [N, D], beta [N, nh], g_low [N, hd]
        let g = lin(&g_low, &self.f_b_proj, bf)?; // [N, D]
        let o = CudaTensor::uninit(x.cuda_device(), bf, q.shape().to_vec())?;
        if let Some(keep) = &step.keep {
            // A verify step: the raw inputs, for a rollback's replay (`verify.rs`).
            let kept = KdaKept { q: q.clone(), k: k.clone(), v: v.clone(), g: g.clone(), beta: beta.clone(), gate: gate.clone() };
            keep.lock().map_err(|_| ModelError::Internal("a verify step's kept inputs were poisoned".into()))?.push(kept);
        }
        let inp = KdaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, gate: &gate };
        let w = self.weights();
        match (step.decode, &step.kda_tables) {
            (true, _) => kda_decode(&inp, &w, &step.slots, &self.conv_pool, &self.state_pool, &o)?,
            // A verify graph's step: the tables on the device, so that the step is capturable.
            (false, Some(t)) => kda_prefill_tables(&inp, &w, &step.lens, t, &self.conv_pool, &self.state_pool, &o)?,
            (false, None) => kda_prefill(&inp, &w, &step.lens, &step.slots_host, &self.conv_pool, &self.state_pool, &o, None)?,
        }
        lin(&o, &self.o_proj, DType::F32)
    }

    /// The recurrence alone over `inp` (the rows of sequences `lens` in slots `slots`), output
    /// discarded: a rollback's replay from a restored checkpoint (`verify.rs`).
    pub(crate) fn replay(&self, inp: &KdaInputs, lens: &[usize], slots: &[u32]) -> Result<()> {
        let o = CudaTensor::uninit(inp.q.cuda_device(), inp.q.dtype(), inp.q.shape().to_vec())?;
        Ok(kda_prefill(inp, &self.weights(), lens, slots, &self.conv_pool, &self.state_pool, &o, None)?)
    }

    /// The capturable rollback of this layer (`verify.rs`'s batched form): the checkpoint rows
    /// `conv` / `state` (`[B, ·]`, one per verify sequence) go back into the pool slots `restore`
    /// names (device I32 `[B]`; −1 skips a sequence), then the recurrence runs over the rows of
    /// `kept` that `tables` (device, `kda_tables_within(caps, kept rows, slots)`) names — the
    /// kept inputs laid out as the verify step computed them, `caps[b]` rows per sequence.
    pub(crate) fn rollback(
        &self,
        conv: &CudaTensor,
        state: &CudaTensor,
        restore: &CudaTensor,
        kept: &KdaKept,
        caps: &[usize],
        tables: &CudaTensor,
    ) -> Result<()> {
        for (ckpt, pool) in [(conv, &self.conv_pool), (state, &self.state_pool)] {
            scatter_rows(ckpt, restore, pool)?;
        }
        let inp = KdaInputs { q: &kept.q, k: &kept.k, v: &kept.v, g: &kept.g, beta: &kept.beta, gate: &kept.gate };
        let o = CudaTensor::uninit(inp.q.cuda_device(), inp.q.dtype(), inp.q.shape().to_vec())?;
        Ok(kda_prefill_tables(&inp, &self.weights(), caps, tables, &self.conv_pool, &self.state_pool, &o)?)
    }

    fn weights(&self) -> KdaWeights<'_> {
        KdaWeights { conv: &self.conv1d, a_log: &self.a_log, dt_bias: &self.dt_bias, o_norm: &self.o_norm, lower_bound: self.lower_bound, eps: self.eps }
    }

    /// Bytes of weights one decode token reads.
    pub fn weight_bytes(&self) -> u64 {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.b_proj, &self.f_a_proj, &self.f_b_proj, &self.g_proj, &self.o_proj]
            .iter()
            .map(|t| t.byte_len() as u64)
            .sum()
    }
}
