//! Gated MLA and K3.1's gated DSA on the GPU (text-backbone §4, §5), always in the **absorbed**
//! form over the paged latent cache: `W_uk` is folded into the query by a per-head batched GEMM,
//! the attention core (`k3_core::cuda::mla::mla_attend`) runs in the `r + dr` latent space, and
//! `W_uv` is applied per head after it. DSA layers first score every cached position with the
//! indexer and keep the top-k (`k3_core::cuda::dsa`), so their core reads `index_topk` latents
//! whatever the context. Same weights, same names as `layers/mla.rs` and `layers/dsa.rs`.
//!
//! On a tensor-parallel rank `nh` is its share of the heads (q_b/kv_b/g rows, o_proj columns);
//! the latent projections, the latent cache and the indexer are whole on every rank, and the
//! output is a partial `o_proj` sum.
//!
//! Shapes: `x` BF16 `[N, H]`; `c_q` `[N, q_lora]`; `q` `[N, nh, dn+dr]`; absorbed query
//! `[N, nh, r+dr]`; latent output `[N, nh, r]`; `o` `[N, nh, dv]`; output F32 `[N, H]`.

use k3_core::cuda::blas::{gemm_strided_batched, Layout, Strided};
use k3_core::cuda::dsa::{index_key_append, index_scores, topk};
use k3_core::cuda::mla::{mla_attend, mla_cache_append, mla_prefill_attend, PagedBatch, PAGE, PREFILL_DIMS};
use k3_core::cuda::ops::{copy_strided, rms_norm_cols, sigmoid_mul};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::fp8::{KeyFp8, LatentFp8};
use k3_core::DType;

use super::state::Step;
use super::upload::{matrix, vector};
use super::{lin, lin_many};
use crate::capacity::KvDtype;
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::source::Source;

/// Rows from which a fresh prefill attends in the explicit form (fewer: the absorbed kernel).
const EXPLICIT_MIN_ROWS: usize = 64;
/// MLA q/kv latent norm eps (the class default, §4 DISAGREEMENT note; as `layers/mla.rs`).
const LATENT_EPS: f32 = 1e-6;

/// K3.1's lightning indexer on the GPU.
pub struct Indexer {
    pub wq_b: CudaTensor,
    pub wk: CudaTensor,
    pub k_norm_weight: CudaTensor,
    pub k_norm_bias: CudaTensor,
    /// `weights_proj` pre-multiplied by `1/(sqrt(ih)·sqrt(id))`.
    pub weights_proj: CudaTensor,
    /// F32 `[P, PAGE, id]`.
    pub key_cache: CudaTensor,
    heads: usize,
    pub(crate) head_dim: usize,
    topk: usize,
    eps: f32,
}

pub struct Mla {
    pub q_a_proj: CudaTensor,
    pub q_a_layernorm: CudaTensor,
    pub q_b_proj: CudaTensor,
    pub kv_a_proj_with_mqa: CudaTensor,
    pub kv_a_layernorm: CudaTensor,
    pub kv_b_proj: CudaTensor,
    pub g_proj: CudaTensor,
    pub o_proj: CudaTensor,
    pub indexer: Option<Indexer>,
    /// BF16 `[P, PAGE, r + dr]`.
    pub cache: CudaTensor,
    nh: usize,
    dn: usize,
    pub(crate) dr: usize,
    dv: usize,
    pub(crate) r: usize,
}

impl Mla {
    /// Layer `l`'s attention: this rank's heads (all of them on one rank), a latent cache of
    /// `max_pages` pages.
    /// With `kv` FP8 the latent and indexer-key caches are U8 rows in k3-core `fp8`'s layouts.
    #[allow(clippy::too_many_arguments)]
    pub fn load(dev: &CudaDevice, ck: &Source<'_>, cfg: &Config, l: usize, dsa: bool, max_pages: usize, dt: DType, kv: KvDtype) -> Result<Self> {
        let t = &cfg.text;
        let (h, dn, dr, dv, r) = (t.hidden_size, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank);
        let nh = ck.plan.tp_share(t.num_attention_heads).len();
        let ql = t.q_lora_rank.unwrap_or(0);
        let p = format!("{}self_attn.", crate::weights::layer_prefix(l));
        if r % 8 != 0 || dr % 8 != 0 {
            return Err(ModelError::Field {
                field: "kv_lora_rank / qk_rope_head_dim".into(),
                msg: format!("{r} / {dr}: the CUDA MLA kernels need multiples of 8"),
            });
        }
        let fp8 = kv == KvDtype::Fp8;
        if fp8 && (dt == DType::F32 || r > 512) {
            return Err(ModelError::Field {
                field: "--kv-cache-dtype".into(),
                msg: format!(
                    "fp8 needs --precision bf16 and kv_lora_rank <= 512 (here {} and {r}): use --kv-cache-dtype bf16",
                    if dt == DType::F32 { "f32" } else { "bf16" }
                ),
            });
        }
        let indexer = match (&t.dsa_config, dsa) {
            (Some(d), true) => {
                let (ih, id) = (d.index_num_heads, d.index_head_dim);
                let scale = 1.0 / ((ih as f32).sqrt() * (id as f32).sqrt());
                let wp_name = format!("{p}indexer.weights_proj.weight");
                let wp: Vec<f32> = crate::layers::matrix(ck, &wp_name, ih, h)?.to_f32().iter().map(|v| v * scale).collect();
                let weights_proj = match dt {
                    DType::F32 => CudaTensor::from_f32(dev, vec![ih, h], &wp)?,
                    _ => CudaTensor::from_bf16(dev, vec![ih, h], &wp.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>())?,
                };
                Some(Indexer {
                    wq_b: matrix(dev, ck, &format!("{p}indexer.wq_b.weight"), ih * id, ql, dt)?,
                    wk: matrix(dev, ck, &format!("{p}indexer.wk.weight"), id, h, dt)?,
                    k_norm_weight: vector(dev, ck, &format!("{p}indexer.k_norm.weight"), id)?,
                    k_norm_bias: vector(dev, ck, &format!("{p}indexer.k_norm.bias"), id)?,
                    weights_proj,
                    key_cache: match fp8 {
                        true => CudaTensor::zeros(dev, DType::U8, vec![max_pages, PAGE, KeyFp8 { id }.row_bytes()])?,
                        false => CudaTensor::zeros(dev, DType::F32, vec![max_pages, PAGE, id])?,
                    },
                    heads: ih,
                    head_dim: id,
                    topk: d.index_topk,
                    eps: t.rms_norm_eps,
                })
            }
            _ => None,
        };
        Ok(Mla {
            q_a_proj: matrix(dev, ck, &format!("{p}q_a_proj.weight"), ql, h, dt)?,
            q_a_layernorm: vector(dev, ck, &format!("{p}q_a_layernorm.weight"), ql)?,
            q_b_proj: matrix(dev, ck, &format!("{p}q_b_proj.weight"), nh * (dn + dr), ql, dt)?,
            kv_a_proj_with_mqa: matrix(dev, ck, &format!("{p}kv_a_proj_with_mqa.weight"), r + dr, h, dt)?,
            kv_a_layernorm: vector(dev, ck, &format!("{p}kv_a_layernorm.weight"), r)?,
            kv_b_proj: matrix(dev, ck, &format!("{p}kv_b_proj.weight"), nh * (dn + dv), r, dt)?,
            g_proj: matrix(dev, ck, &format!("{p}g_proj.weight"), nh * dv, h, dt)?,
            o_proj: matrix(dev, ck, &format!("{p}o_proj.weight"), h, nh * dv, dt)?,
            indexer,
            cache: match fp8 {
                true => CudaTensor::zeros(dev, DType::U8, vec![max_pages, PAGE, LatentFp8 { r, dr }.row_bytes()])?,
                false => CudaTensor::zeros(dev, dt, vec![max_pages, PAGE, r + dr])?,
            },
            nh,
            dn,
            dr,
            dv,
            r,
        })
    }

    /// `x` BF16 `[N, H]` → F32 `[N, H]`; appends the step's rows to the cache, then attends.
    pub(crate) fn forward(&self, x: &CudaTensor, step: &Step) -> Result<CudaTensor> {
        let (nh, dn, dr, dv, r) = (self.nh, self.dn, self.dr, self.dv, self.r);
        let (n, dev, bf) = (step.n, x.cuda_device(), x.dtype()); // bf: BF16, or F32 in the reference precision
        let es = bf.size_in_bytes() as u64;
        let batch = PagedBatch { block_table: &step.block_table, row_seq: &step.row_seq, row_pos: &step.row_pos };
        // c_q [N, q_lora] and c_kv [N, r+dr] stay F32 for their norms; the output gate [N, nh·dv].
        let [c_q_raw, ckv, gate] = lin_many(x, [(&self.q_a_proj, DType::F32), (&self.kv_a_proj_with_mqa, DType::F32), (&self.g_proj, bf)])?;
        let c_q = CudaTensor::uninit(dev, bf, c_q_raw.shape().to_vec())?;
        rms_norm_cols(&c_q_raw, c_q.last_dim(), &self.q_a_layernorm, LATENT_EPS, &c_q)?;
        let q = lin(&c_q, &self.q_b_proj, bf)?; // [N, nh, dn+dr]
        mla_cache_append(&ckv, &self.kv_a_layernorm, LATENT_EPS, &batch, &self.cache)?;
        let scale = ((dn + dr) as f32).powf(-0.5);
        if self.explicit_prefill(step, bf) {
            // A fresh prefill attends in the explicit form: k_nope | v = kv_b_proj(c_kv) per head.
            let c_kv = CudaTensor::uninit(dev, bf, vec![n, r])?; // [N, r], as the cache holds it
            rms_norm_cols(&ckv, r, &self.kv_a_layernorm, LATENT_EPS, &c_kv)?;
            let kv = lin(&c_kv, &self.kv_b_proj, bf)?; // [N, nh, dn+dv]
            let o = CudaTensor::uninit(dev, bf, vec![n, nh * dv])?; // [N, nh·dv]
            mla_prefill_attend(&q, &kv, &self.cache, r, &batch, nh, scale, &o)?;
            sigmoid_mul(&o, &gate)?;
            return lin(&o, &self.o_proj, DType::F32);
        }
        // Absorb W_uk: q_lat_h [N, r] = q_nope_h [N, dn] · W_uk_h [dn, r], into the first r
        // columns of each head's absorbed query; q_pe goes to the last dr.
        let q_abs = CudaTensor::uninit(dev, bf, vec![n, nh, r + dr])?; // [N, nh, r+dr]
        let wkv = self.kv_b_proj.ptr(); // [nh, dn+dv, r]
        let s = |ptr: u64, ld: usize, stride: usize| Strided { ptr, ld, stride };
        gemm_strided_batched(
            dev,
            n,
            r,
            dn,
            nh,
            s(q.ptr(), nh * (dn + dr), dn + dr),
            s(wkv, r, (dn + dv) * r),
            Layout::B,
            s(q_abs.ptr(), nh * (r + dr), r + dr),
            bf,
            bf,
        )?;
        copy_strided(dev, bf, q.ptr() + es * dn as u64, dn + dr, q_abs.ptr() + es * r as u64, r + dr, n * nh, dr)?;
        let sel = match &self.indexer {
            Some(ix) => Some(ix.select(x, &c_q, step, &batch)?),
            None => None,
        };
        let o_lat = CudaTensor::uninit(dev, bf, vec![n, nh, r])?; // [N, nh, r]
        mla_attend(&q_abs, &self.cache, &batch, sel.as_ref().map(|(i, c)| (i, c)), r, scale, &o_lat)?;
        // Un-absorb: o_h [N, dv] = o_lat_h [N, r] · W_uv_hᵀ (W_uv_h [dv, r]).
        let o = CudaTensor::uninit(dev, bf, vec![n, nh * dv])?; // [N, nh·dv]
        gemm_strided_batched(
            dev,
            n,
            dv,
            r,
            nh,
            s(o_lat.ptr(), nh * r, r),
            s(wkv + es * (dn * r) as u64, r, (dn + dv) * r),
            Layout::BT,
            s(o.ptr(), nh * dv, dv),
            bf,
            bf,
        )?;
        sigmoid_mul(&o, &gate)?;
        lin(&o, &self.o_proj, DType::F32)
    }

    /// Whether this step's attention runs in the explicit form (`mla_prefill_attend`): a fresh
    /// prefill (no cached context, not a decode step) of at least [`EXPLICIT_MIN_ROWS`] rows, BF16,
    /// K3's head dims, no DSA selection (`K3_MLA_PREFILL=absorbed` keeps the absorbed form).
    fn explicit_prefill(&self, step: &Step, bf: DType) -> bool {
        static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let off = *OFF.get_or_init(|| std::env::var("K3_MLA_PREFILL").is_ok_and(|v| v == "absorbed"));
        !off && step.fresh
            && !step.decode
            && step.n >= EXPLICIT_MIN_ROWS
            && bf == DType::BF16
            && self.indexer.is_none()
            && (self.dn, self.dr, self.dv) == PREFILL_DIMS
    }

    pub fn weight_bytes(&self) -> u64 {
        let ix = self.indexer.as_ref().map_or(0, |i| i.wq_b.byte_len() + i.wk.byte_len() + i.weights_proj.byte_len());
        ([&self.q_a_proj, &self.q_b_proj, &self.kv_a_proj_with_mqa, &self.kv_b_proj, &self.g_proj, &self.o_proj].iter().map(|t| t.byte_len()).sum::<usize>()
            + ix) as u64
    }
}

impl Indexer {
    /// Appends the step's index keys, scores every visible position and keeps the top-k per row:
    /// (indices I32 `[N, topk]`, counts I32 `[N]`). Rows with at most `topk` positions keep all.
    fn select(&self, x: &CudaTensor, c_q: &CudaTensor, step: &Step, batch: &PagedBatch) -> Result<(CudaTensor, CudaTensor)> {
        let (n, dev) = (step.n, x.cuda_device());
        let qi = lin(c_q, &self.wq_b, DType::F32)?; // [N, ih·id]
        let qi = qi.reshape(vec![n, self.heads, self.head_dim])?; // [N, ih, id]
        let [ki, a] = lin_many(x, [(&self.wk, DType::F32), (&self.weights_proj, DType::F32)])?; // [N, id], [N, ih] scaled
        index_key_append(&ki, &self.k_norm_weight, &self.k_norm_bias, self.eps, batch, &self.key_cache)?;
        let width = step.max_len.max(1);
        let scores = CudaTensor::uninit(dev, DType::F32, vec![n, width])?; // [N, L]
        index_scores(&qi, &a, &self.key_cache, batch, &scores)?;
        let idx = CudaTensor::uninit(dev, DType::I32, vec![n, self.topk])?;
        let count = CudaTensor::uninit(dev, DType::I32, vec![n])?;
        topk(&scores, batch, self.topk, &idx, &count)?;
        Ok((idx, count))
    }
}
