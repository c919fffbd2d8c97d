//! A separate draft model beside the target (`--speculative draft --draft-model DIR`, issue 22):
//! another K3-family checkpoint with the target's vocabulary, run on the CPU with its own
//! [`SeqState`] per sequence. k3-engine's runner (`dist::draft`) keeps those states and calls
//! the two methods here; the engine's proposer (`spec::model`) chooses the tokens.
//!
//! - [`Model::follow`]: the draft model consumes exactly the tokens the target consumed in a
//!   forward, in a forward of the same kind — prefill chunks packed as the target packed them,
//!   a verify step as a verify forward (`KdaMode::Verify`, row-exact, the KDA state kept after
//!   each token) — so the draft's state after it is the one the draft model would have after
//!   those same calls, and a verify step rolls back with `SeqState::rollback` (verify.rs)
//!   exactly as the target's does. With the target as its own draft the two states are equal
//!   bit for bit.
//! - [`Model::chain_draft`]: `k` chained one-token decode steps after the consumed tokens (the
//!   first fed `next`, each later one the token chosen from the previous logits), then the
//!   state is put back as it was (KDA conv tails and recurrent states copied before, MLA/DSA
//!   caches truncated, `pos` restored): the chain was made from drafts, and the verify step's
//!   [`Model::follow`] feeds the draft model the same tokens again.
//!
//! Shapes: `ids[i]` the tokens sequence i consumed; logits `[vocab]` per chained position.

use k3_core::kernels::cpu::matmul::with_row_exact;

use crate::error::Result;
use crate::layers::kda::{KdaMode, StateBuf};
use crate::layers::mla::MlaForm;
use crate::model::{ForwardOpts, LayerState, Model, SeqState};

/// A layer's state before a chain: a KDA layer's conv tails and recurrent state, an MLA/DSA
/// layer's cache lengths (its rows are append-only).
enum Saved {
    Kda([Vec<f32>; 3], StateBuf),
    Mla(usize, usize),
}

impl Model {
    /// The draft model consumes `ids[i]` into `states[i]`, as the target just did in a plain
    /// forward (`verify = false`; `row_exact` as the target's) or a verify forward (`verify`:
    /// row-exact, the KDA state kept after each token for `SeqState::rollback`). Only the
    /// states change (the logits of the last rows are computed and dropped).
    pub fn follow(&self, ids: &[&[u32]], states: &mut [&mut SeqState], verify: bool, row_exact: bool) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let toks: Vec<u32> = ids.concat();
        let lens: Vec<usize> = ids.iter().map(|t| t.len()).collect();
        let emb = self.embed(&toks)?;
        let kda = if verify { KdaMode::Verify } else { KdaMode::Auto };
        let opts = ForwardOpts { kda, mla: MlaForm::Auto, last_only: true, defer_logits: false };
        with_row_exact(verify || row_exact, || self.forward_varlen(emb, &lens, states, opts, None)).map(|_| ())
    }

    /// Up to `k` chained drafts after the tokens `st` consumed, the first position fed `next`:
    /// each position's logits `[vocab]` go to `choose`, which returns the token fed to the next
    /// position (`None`: stop). Returns the number of tokens chosen; `st` is then as before
    /// (see the module doc). Stops early at the draft model's context limit.
    pub fn chain_draft(&self, st: &mut SeqState, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        let (pos, k) = (st.pos, k.min(self.config.max_context().saturating_sub(st.pos)));
        if k == 0 {
            return Ok(0);
        }
        let saved: Vec<Saved> = st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => Saved::Kda(s.conv.clone(), s.s.clone()),
                LayerState::Mla(c) => Saved::Mla(c.latent.rows(), c.index_keys.rows()),
            })
            .collect();
        let out = (|| -> Result<usize> {
            let (mut tok, mut chosen) = (next, 0);
            let opts = ForwardOpts { last_only: true, ..Default::default() };
            for _ in 0..k {
                // One token: the decode step's form, row-exact as the target's verify rows are.
                let logits = with_row_exact(true, || self.forward(&[tok], st, opts, None))?;
                match choose(&logits) {
                    Some(d) => tok = d,
                    None => break,
                }
                chosen += 1;
            }
            Ok(chosen)
        })();
        for (l, s) in st.layers.iter_mut().zip(saved) {
            match (l, s) {
                (LayerState::Kda(st), Saved::Kda(conv, s)) => {
                    st.conv = conv;
                    st.s = s;
                    st.snapshots.clear();
                }
                (LayerState::Mla(c), Saved::Mla(n, m)) => {
                    c.latent.truncate_rows(n);
                    c.index_keys.truncate_rows(m);
                }
                _ => {} // `saved` was made from these layers: the kinds pair up
            }
        }
        st.pos = pos;
        out
    }
}
