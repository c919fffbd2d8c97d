//! The MTP draft layer (around-backbone §5.1; vLLM's `KimiK3MTP` layout, **UNCONFIRMED**
//! against real weights: K3 ships none). Layer `N + k` of a checkpoint with
//! `num_nextn_predict_layers > 0` predicts the token after next from the target's state:
//!
//! - input row `j` (position j) pairs the target's **pre-final-norm** hidden state `h_j` with the
//!   embedding of the token after it, `t_{j+1}`:
//!   `x = eh_proj([RMSNorm_enorm(emb(t_{j+1})); RMSNorm_hnorm(h_j)])`, embedding **first**; at
//!   position 0 the embedding is zeroed (vLLM: "not needed by MTP");
//! - `x` goes through one decoder layer with a plain pre-norm residual (no AttnRes):
//!   `x += MLA(RMSNorm_in(x))`, `x += FFN(RMSNorm_post(x))` — gated NoPE MLA with its own latent
//!   cache ([`MtpState::cache`]), the FFN (LatentMoE, or dense) of the backbone's code;
//! - `logits = shared_head.head(RMSNorm_shared_head.norm(x))`; the **pre-norm** `x` is what a
//!   chained draft step feeds back in place of `h`.
//!
//! Shapes: token embeddings `e` and hidden rows `h` `[N, H]`, packed as the model's forward packs
//! sequences (`lens[i]` rows of sequence i); `eh_proj` `[H, 2H]`; output `x` `[N, H]`; logits
//! `[N, vocab]`. Norm eps `rms_norm_eps` (the MLA latent norms keep their 1e-6). The driver —
//! which rows exist, chained drafts, rollback — is `crate::draft`.

use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::kernels::cpu::norm::rms_norm_inplace;

use super::ffn::Mlp;
use super::mla::{Mla, MlaCache, MlaForm};
use super::moe::Moe;
use super::{lin, matrix, vector};
use crate::config::{Config, Ffn as FfnKind};
use crate::error::{ModelError, Result};
use crate::model::Ffn;
use crate::source::Source;
use crate::weights::layer_prefix;

/// One sequence's draft-layer state: the MTP layer's latent cache, whose row `j` was made from
/// `(h_j, t_{j+1})`, and the target's hidden rows it has not turned into cache rows yet (plus
/// those of the last forward, kept for a rollback).
#[derive(Clone, Debug)]
pub struct MtpState {
    /// `[rows, r + dr]` latent rows (positions `0..rows`).
    pub cache: MlaCache,
    /// Rows in `cache`.
    pub rows: usize,
    /// The target's pre-final-norm rows `[.., H]` of positions `hidden_from..`.
    pub hidden: Vec<f32>,
    pub hidden_from: usize,
    /// `H` (hidden_size).
    pub width: usize,
}

impl MtpState {
    /// An empty state for a model of hidden size `width`.
    pub fn new(width: usize) -> MtpState {
        MtpState { cache: MlaCache::default(), rows: 0, hidden: Vec::new(), hidden_from: 0, width: width.max(1) }
    }

    pub fn bytes(&self) -> usize {
        self.cache.bytes() + 4 * self.hidden.len()
    }

    /// Positions whose hidden rows are held: `hidden_from..hidden_end()`.
    pub fn hidden_end(&self) -> usize {
        self.hidden_from + self.hidden.len() / self.width
    }

    /// The hidden row of position `p`, if held.
    pub fn hidden_row(&self, p: usize) -> Option<&[f32]> {
        let h = self.width;
        (p >= self.hidden_from && p < self.hidden_end()).then(|| &self.hidden[(p - self.hidden_from) * h..(p - self.hidden_from + 1) * h])
    }

    /// Takes the target's hidden rows `rows` `[n, H]` of positions `from..from + n` (a forward
    /// just computed them): rows before the first position not yet in the cache are dropped.
    /// Returns false (nothing taken) when they do not continue the held rows: the state cannot
    /// follow this sequence any more.
    pub fn push_hidden(&mut self, rows: &[f32], from: usize) -> bool {
        if self.hidden.is_empty() {
            self.hidden_from = from;
        }
        if self.hidden_end() != from {
            return false;
        }
        let keep = self.rows.clamp(self.hidden_from, from);
        self.hidden.drain(..(keep - self.hidden_from) * self.width);
        self.hidden_from = keep;
        self.hidden.extend_from_slice(rows);
        true
    }

    /// Keeps the first `rows` cache rows.
    pub fn truncate(&mut self, rows: usize) {
        if rows < self.rows {
            self.cache.latent.truncate_rows(rows);
            self.rows = rows;
        }
    }

    /// Whether [`MtpState::rollback`] to `keep` tokens can be done.
    pub fn check_rollback(&self, keep: usize) -> Result<()> {
        if keep > 0 && self.hidden_row(keep - 1).is_none() {
            return Err(ModelError::Input(format!(
                "rollback to {keep} tokens: the MTP draft layer holds the hidden rows of positions {}..{} only",
                self.hidden_from,
                self.hidden_end()
            )));
        }
        Ok(())
    }

    /// Back to `keep` consumed tokens: cache rows `0..keep − 1` and hidden rows up to `keep`
    /// (the row `h_{keep−1}` must be held: errors, changing nothing, when it is not).
    pub fn rollback(&mut self, keep: usize) -> Result<()> {
        self.check_rollback(keep)?;
        self.truncate(keep.saturating_sub(1));
        self.hidden.truncate(keep.saturating_sub(self.hidden_from) * self.width);
        Ok(())
    }
}

/// The final norm and head of an MTP layer (`shared_head.*`).
pub struct SharedHead {
    pub norm: Vec<f32>,
    pub head: Matrix,
}

/// One MTP layer's weights (checkpoint names kept: `layers.{N+k}.<field>`).
pub struct Mtp {
    /// Its checkpoint layer index `N + k`.
    pub index: usize,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// `[H, 2H]`: columns `0..H` take the normed embedding, `H..2H` the normed hidden state.
    pub eh_proj: Matrix,
    pub input_layernorm: Vec<f32>,
    pub self_attn: Mla,
    pub post_attention_layernorm: Vec<f32>,
    pub ffn: Ffn,
    pub shared_head: SharedHead,
    eps: f32,
}

impl Mtp {
    /// Loads MTP layer `k` (a whole-model source: the draft runs on one rank).
    pub fn load(src: &Source<'_>, cfg: &Config, k: usize) -> Result<Mtp> {
        let t = &cfg.text;
        let (h, v, eps) = (t.hidden_size, t.vocab_size, t.rms_norm_eps);
        let spec = cfg.mtp_layer(k);
        let l = spec.index;
        let p = layer_prefix(l);
        if src.plan.par.world() != 1 {
            return Err(ModelError::Input(format!("MTP layer {l}: the draft layer runs on a one-rank model only")));
        }
        Ok(Mtp {
            index: l,
            enorm: vector(src, &format!("{p}enorm.weight"), h)?,
            hnorm: vector(src, &format!("{p}hnorm.weight"), h)?,
            eh_proj: matrix(src, &format!("{p}eh_proj.weight"), h, 2 * h)?,
            input_layernorm: vector(src, &format!("{p}input_layernorm.weight"), h)?,
            self_attn: Mla::load(src, cfg, l, false)?,
            post_attention_layernorm: vector(src, &format!("{p}post_attention_layernorm.weight"), h)?,
            ffn: match spec.ffn {
                FfnKind::Dense => {
                    Ffn::Dense(Mlp::load(src, &format!("{p}mlp."), h, t.intermediate_size, t.activation_situ_beta, t.activation_situ_linear_beta)?)
                }
                FfnKind::Moe => Ffn::Moe(Moe::load(src, cfg, l, true, &Default::default())?),
            },
            shared_head: SharedHead {
                norm: vector(src, &format!("{p}shared_head.norm.weight"), h)?,
                head: matrix(src, &format!("{p}shared_head.head.weight"), v, h)?,
            },
            eps,
        })
    }

    /// The layer over packed rows: token embeddings `e` `[N, H]` (rows at position 0 already
    /// zeroed by the caller), hidden rows `hid` `[N, H]`, `lens[i]` rows of sequence i appended to
    /// `caches[i]`. Returns the pre-norm output `x` `[N, H]`.
    pub fn forward_varlen(&self, e: &[f32], hid: &[f32], lens: &[usize], caches: &mut [&mut MlaCache]) -> Result<Vec<f32>> {
        let h = self.enorm.len();
        let n: usize = lens.iter().sum();
        if e.len() != n * h || hid.len() != n * h || lens.len() != caches.len() {
            return Err(ModelError::Internal(format!("MTP layer {}: {} embedding and {} hidden values for {n} rows of {h}", self.index, e.len(), hid.len())));
        }
        // [enorm(e); hnorm(h)] per row, embedding first.
        let mut cat = vec![0f32; n * 2 * h];
        for (r, row) in cat.chunks_exact_mut(2 * h).enumerate() {
            let (a, b) = row.split_at_mut(h);
            a.copy_from_slice(&e[r * h..(r + 1) * h]);
            rms_norm_inplace(a, &self.enorm, self.eps);
            b.copy_from_slice(&hid[r * h..(r + 1) * h]);
            rms_norm_inplace(b, &self.hnorm, self.eps);
        }
        let mut x = lin(&cat, n, &self.eh_proj)?; // [N, H]
        let mut a = x.clone();
        rms_norm_inplace(&mut a, &self.input_layernorm, self.eps);
        let a = self.self_attn.forward_varlen(&a, lens, caches, MlaForm::Auto)?;
        x.iter_mut().zip(&a).for_each(|(x, a)| *x += a);
        let mut f = x.clone();
        rms_norm_inplace(&mut f, &self.post_attention_layernorm, self.eps);
        let f = match &self.ffn {
            Ffn::Dense(m) => m.forward(&f, n)?,
            Ffn::Moe(m) => m.forward(&f, n)?,
        };
        x.iter_mut().zip(&f).for_each(|(x, f)| *x += f);
        Ok(x)
    }

    /// `shared_head.head(RMSNorm(x))` for `n` rows `x` `[n, H]` → `[n, vocab]`.
    pub fn logits(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut y = x.to_vec();
        rms_norm_inplace(&mut y, &self.shared_head.norm, self.eps);
        lin(&y, n, &self.shared_head.head)
    }
}
