//! Gated NoPE MLA (text-backbone §4) and, with an [`Indexer`], K3.1's gated DSA (§5.7):
//! the same attention restricted to the indexer's selected positions.
//!
//! `c_q = RMSNorm(W_qa x; 1e-6)`, `q = W_qb c_q` `[T, nh, dn+dr]`; `ckv = W_kva x`,
//! latent `c_kv = RMSNorm(ckv[:r]; 1e-6)` `[r]` and raw `k_pe = ckv[r:]` `[dr]` are the cache row
//! (`r + dr` values per token). Scores `(q_nope·k_nope + q_pe·k_pe)·(dn+dr)^-½`, softmax f32,
//! `out = Σ p v` `[T, nh, dv]`, `out ⊙ σ(W_g x)`, `W_o`. Two forms of the attention core:
//! **explicit** (expand `k_nope`, `v` with `kv_b_proj` for every cached row) and **absorbed**
//! (fold `W_uk` into q and `W_uv` after the sum, attend in the `r + dr` latent space).

use k3_core::kernels::cpu::act::{sigmoid, softmax_inplace};
use k3_core::kernels::cpu::matmul::{dot, Matrix};
use k3_core::kernels::cpu::norm::rms_norm_inplace;
use rayon::prelude::*;

use super::dsa::{index_scores_into, select_topk, Indexer};
use super::pages::{PageSet, PagedRows};
use super::{lin, matrix, vector};
use crate::config::Config;
use crate::error::Result;
use crate::source::Source;

/// Per-sequence cache of one MLA/DSA layer, in reference-counted pages that sequences with a
/// common prefix share (`pages.rs`).
#[derive(Clone, Debug, Default)]
pub struct MlaCache {
    /// `[n, r + dr]`: normed latent then raw `k_pe`, per cached token.
    pub latent: PagedRows,
    /// `[n, id]` indexer keys (DSA layers only).
    pub index_keys: PagedRows,
}

impl MlaCache {
    /// An empty cache in pages of `page_rows` rows.
    pub fn with_page_rows(page_rows: usize) -> MlaCache {
        MlaCache { latent: PagedRows::with_page_rows(page_rows), index_keys: PagedRows::with_page_rows(page_rows) }
    }
    /// Bytes of its rows, shared pages included.
    pub fn bytes(&self) -> usize {
        self.latent.bytes() + self.index_keys.bytes()
    }
    /// Bytes of its pages that no pool holds and `seen` has not counted (`PagedRows::bytes_once`).
    pub fn bytes_once(&self, seen: &mut PageSet) -> usize {
        self.latent.bytes_once(seen) + self.index_keys.bytes_once(seen)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlaForm {
    /// Explicit for a prefill into an empty cache, absorbed otherwise (what engines do).
    Auto,
    Explicit,
    Absorbed,
}

pub struct Mla {
    pub q_a_proj: Matrix,
    pub q_a_layernorm: Vec<f32>,
    pub q_b_proj: Matrix,
    pub kv_a_proj_with_mqa: Matrix,
    pub kv_a_layernorm: Vec<f32>,
    pub kv_b_proj: Matrix,
    pub g_proj: Matrix,
    pub o_proj: Matrix,
    pub indexer: Option<Indexer>,
    nh: usize,
    dn: usize,
    dr: usize,
    dv: usize,
    r: usize,
}

/// MLA q/kv latent norm eps: Moonshot's code uses the class default 1e-6 (§4 DISAGREEMENT note).
const LATENT_EPS: f32 = 1e-6;

impl Mla {
    /// Loads layer `l`'s attention: this rank's heads; the latent projections and the indexer
    /// are whole on every rank (so is the latent cache).
    pub fn load(ck: &Source<'_>, cfg: &Config, l: usize, dsa: bool) -> Result<Self> {
        let t = &cfg.text;
        let (h, dn, dr, dv, r) = (t.hidden_size, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank);
        let nh = ck.plan.tp_share(t.num_attention_heads).len();
        let ql = t.q_lora_rank.unwrap_or(0);
        let p = format!("{}self_attn.", crate::weights::layer_prefix(l));
        let indexer = match (&t.dsa_config, dsa) {
            (Some(d), true) => Some(Indexer::load(ck, &p, d, h, ql, t.rms_norm_eps)?),
            _ => None,
        };
        Ok(Mla {
            q_a_proj: matrix(ck, &format!("{p}q_a_proj.weight"), ql, h)?,
            q_a_layernorm: vector(ck, &format!("{p}q_a_layernorm.weight"), ql)?,
            q_b_proj: matrix(ck, &format!("{p}q_b_proj.weight"), nh * (dn + dr), ql)?,
            kv_a_proj_with_mqa: matrix(ck, &format!("{p}kv_a_proj_with_mqa.weight"), r + dr, h)?,
            kv_a_layernorm: vector(ck, &format!("{p}kv_a_layernorm.weight"), r)?,
            kv_b_proj: matrix(ck, &format!("{p}kv_b_proj.weight"), nh * (dn + dv), r)?,
            g_proj: matrix(ck, &format!("{p}g_proj.weight"), nh * dv, h)?,
            o_proj: matrix(ck, &format!("{p}o_proj.weight"), h, nh * dv)?,
            indexer,
            nh,
            dn,
            dr,
            dv,
            r,
        })
    }

    /// `x` `[T, H]` → `[T, H]`; appends T rows to `cache` first, then attends causally.
    pub fn forward(&self, x: &[f32], t: usize, cache: &mut MlaCache, form: MlaForm) -> Result<Vec<f32>> {
        self.forward_varlen(x, &[t], &mut [cache], form)
    }

    /// Several sequences packed row-wise: `x` `[N, H]`, `lens` rows per sequence, each with
    /// its own cache. Projections run once over all rows; attention runs per sequence.
    pub fn forward_varlen(&self, x: &[f32], lens: &[usize], caches: &mut [&mut MlaCache], form: MlaForm) -> Result<Vec<f32>> {
        let (nh, dn, dr, dv, r) = (self.nh, self.dn, self.dr, self.dv, self.r);
        let w = r + dr;
        let n: usize = lens.iter().sum();
        let mut c_q = lin(x, n, &self.q_a_proj)?; // [N, q_lora]
        rms_norm_inplace(&mut c_q, &self.q_a_layernorm, LATENT_EPS);
        let q = lin(&c_q, n, &self.q_b_proj)?; // [N, nh, dn+dr]
        let mut ckv = lin(x, n, &self.kv_a_proj_with_mqa)?; // [N, r+dr]
        for row in ckv.chunks_exact_mut(w) {
            rms_norm_inplace(&mut row[..r], &self.kv_a_layernorm, LATENT_EPS);
        }
        let ix_out = match &self.indexer {
            Some(ix) => Some(ix.project(x, &c_q, n)?),
            None => None,
        };
        let mut o = vec![0f32; n * nh * dv]; // [N, nh, dv]
        let mut r0 = 0;
        for (&t, cache) in lens.iter().zip(caches.iter_mut()) {
            let past = cache.latent.rows();
            cache.latent.push_rows(&ckv[r0 * w..(r0 + t) * w], t);
            // Key set per new token: None = all of 0..=pos (dense / short-context DSA).
            let sel: Vec<Option<Vec<u32>>> = match (&self.indexer, &ix_out) {
                (Some(ix), Some(io)) => {
                    let (ih, id) = (ix.heads, ix.head_dim);
                    cache.index_keys.push_rows(&io.k[r0 * id..(r0 + t) * id], t);
                    let keys = &cache.index_keys;
                    (0..t)
                        .into_par_iter()
                        .map(|i| {
                            let (pos, row) = (past + i, r0 + i);
                            (pos + 1 > ix.topk).then(|| {
                                // Keys 0..=pos, page by page (each page's rows contiguous).
                                let (qi, ai) = (&io.q[row * ih * id..(row + 1) * ih * id], &io.a[row * ih..(row + 1) * ih]);
                                let mut s = Vec::with_capacity(pos + 1);
                                keys.spans(pos + 1).for_each(|span| index_scores_into(qi, ai, span, id, &mut s));
                                select_topk(&s, ix.topk)
                            })
                        })
                        .collect()
                }
                _ => vec![None; t],
            };
            let explicit = match form {
                MlaForm::Auto => past == 0,
                MlaForm::Explicit => true,
                MlaForm::Absorbed => false,
            };
            let qs = &q[r0 * nh * (dn + dr)..(r0 + t) * nh * (dn + dr)];
            let lat: Vec<&[f32]> = cache.latent.iter().collect();
            let heads = self.attend(qs, t, past, &lat, &sel, explicit)?;
            for (h, oh) in heads.iter().enumerate() {
                for i in 0..t {
                    o[((r0 + i) * nh + h) * dv..][..dv].copy_from_slice(&oh[i * dv..(i + 1) * dv]);
                }
            }
            r0 += t;
        }
        let gate = lin(x, n, &self.g_proj)?; // [N, nh·dv]
        o.iter_mut().zip(&gate).for_each(|(a, &b)| *a *= sigmoid(b));
        lin(&o, n, &self.o_proj)
    }

    /// Attention of one sequence's `t` new queries `q` `[t, nh, dn+dr]` over its cache
    /// `lat`: its `past + t` cache rows `[r + dr]` (looked up once across the pages); returns per-head outputs
    /// `[nh][t, dv]`.
    fn attend(&self, q: &[f32], t: usize, past: usize, lat: &[&[f32]], sel: &[Option<Vec<u32>>], explicit: bool) -> Result<Vec<Vec<f32>>> {
        let (nh, dn, dr, dv, r) = (self.nh, self.dn, self.dr, self.dv, self.r);
        let n = past + t;
        let scale = ((dn + dr) as f32).powf(-0.5);
        // The positions query i attends to: its DSA selection, or all of 0..=past+i (no allocation).
        let keys = |i: usize| {
            let chosen = sel[i].as_deref();
            let len = chosen.map_or(past + i + 1, <[u32]>::len);
            (0..len).map(move |j| chosen.map_or(j, |c| c[j] as usize))
        };
        Ok(if explicit {
            let ckv_all: Vec<f32> = lat.iter().flat_map(|row| row[..r].iter().copied()).collect(); // [n, r]
            let kv = lin(&ckv_all, n, &self.kv_b_proj)?; // [n, nh, dn+dv]
            (0..nh)
                .into_par_iter()
                .map(|h| {
                    let mut out = vec![0f32; t * dv];
                    for i in 0..t {
                        let qh = &q[(i * nh + h) * (dn + dr)..][..dn + dr];
                        let mut p: Vec<f32> = keys(i)
                            .map(|s| {
                                let kn = &kv[(s * nh + h) * (dn + dv)..][..dn];
                                (dot(&qh[..dn], kn) + dot(&qh[dn..], &lat[s][r..])) * scale
                            })
                            .collect();
                        softmax_inplace(&mut p);
                        let o = &mut out[i * dv..(i + 1) * dv];
                        for (s, &ps) in keys(i).zip(&p) {
                            let vv = &kv[(s * nh + h) * (dn + dv) + dn..][..dv];
                            o.iter_mut().zip(vv).for_each(|(a, &b)| *a += ps * b);
                        }
                    }
                    out
                })
                .collect()
        } else {
            (0..nh)
                .into_par_iter()
                .map(|h| {
                    // This head's kv_b rows: W_uk [dn, r] then W_uv [dv, r].
                    let mut wkv = vec![0f32; (dn + dv) * r];
                    self.kv_b_proj.decode_rows(h * (dn + dv), dn + dv, &mut wkv);
                    let (w_uk, w_uv) = wkv.split_at(dn * r);
                    let mut out = vec![0f32; t * dv];
                    let mut q_lat = vec![0f32; r];
                    let mut o_lat = vec![0f32; r];
                    for i in 0..t {
                        let qh = &q[(i * nh + h) * (dn + dr)..][..dn + dr];
                        // q_lat = W_ukᵀ q_nope  [r]
                        q_lat.iter_mut().for_each(|v| *v = 0.0);
                        for (j, &qj) in qh[..dn].iter().enumerate() {
                            q_lat.iter_mut().zip(&w_uk[j * r..(j + 1) * r]).for_each(|(a, &b)| *a += qj * b);
                        }
                        let mut p: Vec<f32> = keys(i)
                            .map(|s| {
                                let row = lat[s];
                                (dot(&q_lat, &row[..r]) + dot(&qh[dn..], &row[r..])) * scale
                            })
                            .collect();
                        softmax_inplace(&mut p);
                        o_lat.iter_mut().for_each(|v| *v = 0.0);
                        for (s, &ps) in keys(i).zip(&p) {
                            o_lat.iter_mut().zip(&lat[s][..r]).for_each(|(a, &b)| *a += ps * b);
                        }
                        for (j, o) in out[i * dv..(i + 1) * dv].iter_mut().enumerate() {
                            *o = dot(&w_uv[j * r..(j + 1) * r], &o_lat);
                        }
                    }
                    out
                })
                .collect()
        })
    }
}
