//! Speculative verification on the CPU model: the forward that scores `[last, d1..dk]` of a
//! sequence exactly as `k + 1` single decode steps would, and the rollback to the accepted
//! prefix (k3-engine's `spec` drives both; the issue is #22).
//!
//! Exactness, position by position (the reason each piece is what it is):
//! - every projection runs in row-exact mode (`k3_core::kernels::cpu::matmul::with_row_exact`):
//!   a row's result does not depend on how many rows share the call (a many-row call would
//!   otherwise take the GEMM, whose rows differ in the last bits from the decode GEMV's);
//! - KDA runs [`KdaMode::Verify`]: the recurrent form one token at a time (the chunked form is
//!   equal only up to rounding), with the conv tails and state kept after each token;
//! - MLA / DSA attend per query over the cache rows up to its own position (absorbed form, as a
//!   decode step), the DSA indexer scores the keys up to that position; norms, AttnRes and the
//!   MoE (tokens grouped by expert, each token's experts summed in expert order) are per row.
//!
//! Rollback ([`SeqState::rollback`]) of the last `drop` tokens of a verify call: each KDA layer
//! takes its snapshot after token `T − drop` (a copy), each MLA/DSA cache is truncated to the
//! kept length, `pos` goes back; an MTP draft state keeps its cache rows and hidden row up to
//! the kept length (`crate::draft`). Shapes: `emb` `[N, H]` packed as in `Model::forward_varlen`;
//! logits `[N, vocab]` (every row).

use k3_core::kernels::cpu::matmul::with_row_exact;

use crate::error::{ModelError, Result};
use crate::layers::kda::{KdaMode, StateBuf};
use crate::layers::mla::MlaForm;
use crate::model::{ForwardOpts, LayerState, Model, SeqState};

impl Model {
    /// The verify forward: like [`Model::forward_varlen`] over `lens[i]` new rows of sequence
    /// i, but every row's logits are those of a single decode step at its position (see the
    /// module doc), and each KDA layer keeps its state after every token for
    /// [`SeqState::rollback`]. Returns logits `[N, vocab]`. A plain decode row (`lens[i] = 1`)
    /// may share the call: it gets its batch-of-one logits.
    pub fn forward_verify(&self, emb: Vec<f32>, lens: &[usize], states: &mut [&mut SeqState]) -> Result<Vec<f32>> {
        let opts = ForwardOpts { kda: KdaMode::Verify, mla: MlaForm::Auto, last_only: false, defer_logits: false };
        with_row_exact(true, || self.forward_varlen(emb, lens, states, opts, None))
    }
}

impl SeqState {
    /// Forgets the last `drop` tokens of the last verify forward (`drop = 0`: all kept); then
    /// the state is the one `pos − drop` tokens would have left. Errors, changing nothing,
    /// when the last call did not keep that many snapshots (`drop` must be below its length).
    pub fn rollback(&mut self, drop: usize) -> Result<()> {
        if drop > self.pos {
            return Err(ModelError::Input(format!("rollback of {drop} tokens from a sequence of {}", self.pos)));
        }
        for (l, layer) in self.layers.iter().enumerate() {
            if let LayerState::Kda(k) = layer {
                // A layer this rank does not hold has an empty state and nothing to restore.
                if drop > 0 && !k.conv[0].is_empty() && drop > k.snapshots.len() {
                    return Err(ModelError::Input(format!(
                        "rollback of {drop} tokens: layer {l} kept {} snapshots (the last forward was not a verify call of more than {drop} tokens)",
                        k.snapshots.len()
                    )));
                }
            }
        }
        let keep = self.pos - drop;
        if let Some(m) = &self.mtp {
            m.check_rollback(keep)?;
        }
        for layer in &mut self.layers {
            match layer {
                LayerState::Kda(k) => {
                    if drop > 0 && !k.conv[0].is_empty() {
                        let at = k.snapshots.len() - drop;
                        let snap = k.snapshots.swap_remove(at);
                        k.conv = snap.conv;
                        k.s = snap.s;
                    }
                    k.snapshots.clear();
                }
                LayerState::Mla(c) => {
                    // Rows kept; a page shared with another sequence or the prefix-cache pool
                    // that keeps only some of its rows becomes a private copy (`pages.rs`).
                    c.latent.truncate_rows(keep);
                    c.index_keys.truncate_rows(keep);
                }
            }
        }
        if let Some(m) = self.mtp.as_mut() {
            m.rollback(keep)?; // cache rows 0..keep−1, the hidden row h_{keep−1} (crate::draft)
        }
        self.pos = keep;
        Ok(())
    }

    /// The live state as bytes (KDA conv tails and recurrent states, MLA latents and indexer
    /// keys, in layer order, then `pos`): equal bytes = equal states. Snapshots are left out.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.bytes() + 8);
        let f = |b: &mut Vec<u8>, v: &[f32]| v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        for layer in &self.layers {
            match layer {
                LayerState::Kda(k) => {
                    k.conv.iter().for_each(|c| f(&mut b, c));
                    match &k.s {
                        StateBuf::F32(s) => f(&mut b, s),
                        StateBuf::Bf16(s) => s.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes())),
                    }
                }
                LayerState::Mla(c) => {
                    c.latent.iter().chain(c.index_keys.iter()).for_each(|r| f(&mut b, r));
                }
            }
        }
        if let Some(m) = &self.mtp {
            // The draft layer's cache and the hidden row waiting for the next token.
            m.cache.latent.iter().for_each(|r| f(&mut b, r));
            f(&mut b, self.pos.checked_sub(1).and_then(|p| m.hidden_row(p)).unwrap_or_default());
        }
        b.extend_from_slice(&(self.pos as u64).to_le_bytes());
        b
    }
}
