//! The MTP draft layer beside the target model (around-backbone §5.1; the layer itself is
//! `layers::mtp`): which of its rows exist when, chained drafts, and the rollback with the
//! target's state. k3-engine's `spec::model` proposer drives it through the runner.
//!
//! Row `j` of the draft layer's cache is made from `(h_j, t_{j+1})`: the target's pre-final-norm
//! hidden state at position `j` and the token after it. A sequence that has consumed `pos` tokens
//! therefore has cache rows `0..pos − 1`, and its hidden row `h_{pos−1}` waits for the next
//! token (invariant after every forward and rollback):
//!
//! - [`Model::mtp_advance`], after a forward that consumed tokens `pos0..pos`: the rows
//!   `rows..pos − 1` (the waiting one and the new ones but the last), in one packed call for
//!   every sequence of the step — prefill chunks and verify steps alike;
//! - [`Model::mtp_draft`]: row `pos − 1` from `(h_{pos−1}, next)`, its logits give draft 1; row
//!   `pos` from `(x_{pos−1}, d_1)` — the layer's own pre-norm output fed back — gives draft 2;
//!   and so on. The chained rows are dropped afterwards (they were made from drafts): the cache
//!   is back at `pos − 1` rows;
//! - `SeqState::rollback` (verify.rs): the target keeps `keep` tokens, the draft layer keeps
//!   cache rows `0..keep − 1` and the hidden row `h_{keep−1}` (the verify forward's rows are kept
//!   until then).
//!
//! Shapes: `ids[i]` the tokens sequence i consumed; embeddings and hidden rows `[n, H]`;
//! logits `[vocab]` per draft position.

use crate::error::{ModelError, Result};
use crate::layers::mla::MlaCache;
use crate::model::{Model, SeqState};

impl Model {
    /// After a forward in which sequence i consumed `ids[i]` (its `pos` already advanced), the
    /// draft layer takes the new rows of every sequence that has an MTP state (see the module
    /// doc). A sequence whose MTP state lost track (a gap in its rows) has it dropped: it then
    /// drafts nothing.
    pub fn mtp_advance(&self, ids: &[&[u32]], states: &mut [&mut SeqState]) -> Result<()> {
        let Some(mtp) = &self.mtp else { return Ok(()) };
        let h = self.config.text.hidden_size;
        let (mut toks, mut hid, mut zero, mut lens, mut which) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, (ids, st)) in ids.iter().zip(states.iter_mut()).enumerate() {
            let pos = st.pos;
            let Some(m) = st.mtp.as_mut() else { continue };
            let pos0 = pos - ids.len();
            // Rows rows..pos−1 need t_{rows+1}.. from this forward and h_rows.. held.
            let ok = m.rows + 1 >= pos0 && m.rows < pos && m.hidden_from <= m.rows && m.hidden_end() == pos;
            if !ok {
                st.mtp = None;
                continue;
            }
            let n = pos - 1 - m.rows;
            if n == 0 {
                continue;
            }
            for j in m.rows..pos - 1 {
                toks.push(ids[j + 1 - pos0]);
                hid.extend_from_slice(m.hidden_row(j).unwrap_or_default());
                zero.push(j == 0);
            }
            lens.push(n);
            which.push(i);
        }
        if lens.is_empty() {
            return Ok(());
        }
        let mut e = self.embed(&toks)?;
        zero_position_0(&mut e, &zero, h);
        let mut caches: Vec<&mut MlaCache> = Vec::with_capacity(which.len());
        for (i, st) in states.iter_mut().enumerate() {
            if which.contains(&i) {
                caches.push(&mut st.mtp.as_mut().expect("an MTP state").cache);
            }
        }
        mtp.forward_varlen(&e, &hid, &lens, &mut caches)?;
        for (&i, &n) in which.iter().zip(&lens) {
            if let Some(m) = states[i].mtp.as_mut() {
                m.rows += n;
            }
        }
        Ok(())
    }

    /// Chained drafts for `st` (which has consumed `st.pos` tokens; `next` is the token its next
    /// forward consumes first): up to `k` positions, each one's logits `[vocab]` handed to
    /// `choose`, which returns the token fed to the next position (`None`: stop). Returns the
    /// number of tokens chosen; 0 when the sequence has no MTP state (or the model no MTP layer).
    pub fn mtp_draft(&self, st: &mut SeqState, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        let h = self.config.text.hidden_size;
        let (Some(mtp), Some(m)) = (&self.mtp, st.mtp.as_mut()) else { return Ok(0) };
        let pos = st.pos;
        if pos == 0 || k == 0 {
            return Ok(0);
        }
        let c = m.rows;
        let Some(first) = m.hidden_row(pos - 1).filter(|_| c == pos - 1).map(<[f32]>::to_vec) else {
            return Err(ModelError::Internal(format!(
                "MTP draft at position {pos}: the draft layer holds {c} rows and hidden rows {}..{}",
                m.hidden_from,
                m.hidden_end()
            )));
        };
        let (mut tok, mut hid, mut chosen) = (next, first, 0);
        let out = (|| -> Result<()> {
            for i in 0..k {
                let mut e = self.embed(&[tok])?;
                zero_position_0(&mut e, &[pos - 1 + i == 0], h);
                let x = mtp.forward_varlen(&e, &hid, &[1], &mut [&mut m.cache])?;
                m.rows += 1;
                let logits = mtp.logits(&x, 1)?;
                match choose(&logits) {
                    Some(d) => tok = d,
                    None => break,
                }
                chosen += 1;
                hid = x;
            }
            Ok(())
        })();
        m.truncate(c); // the chained rows came from drafts
        out.map(|()| chosen)
    }
}

/// Zeroes the embedding rows of `e` `[n, H]` whose flag is set (the rows at position 0).
fn zero_position_0(e: &mut [f32], zero: &[bool], h: usize) {
    for (row, &z) in e.chunks_exact_mut(h).zip(zero) {
        if z {
            row.fill(0.0);
        }
    }
}
