//! A separate draft model on the CPU runner of one rank (`--speculative draft`, issue 22):
//! [`DraftSide`], the draft model and its [`SeqState`] per sequence, which the [`Worker`] keeps
//! beside the target's (`k3_model::draft_model` has the forwards).
//!
//! The draft state **follows the target eagerly**: every forward the worker runs for the target
//! — prefill chunks (packed as the target packed them), verify steps — is run by the draft model
//! on the same tokens in a forward of the same kind ([`DraftSide::follow`]), and a rollback of
//! the target rolls the draft back by the same count ([`DraftSide::rollback`], the verify
//! forward's per-token KDA snapshots). So after every step the draft has consumed exactly the
//! target's tokens, the state is the one the draft model itself would have after those calls,
//! and with the target as its own draft the two states are bit-identical (the tests' strongest
//! check). Why not lazily catch up before drafting: the catch-up forward would be one chunk of
//! mixed prefill and verified tokens, whose rows differ in rounding from the forwards the target
//! ran; the prefix cache could not store the draft state at its grid points either (the draft
//! would lag behind the target there). The price is the draft model's verify forward of the
//! `k + 1` verified rows, which repeats the `k` rows of the chain that drafted them.
//!
//! Drafting ([`DraftSide::draft`]): `k` chained one-token decode steps from the followed state,
//! put back afterwards (`Model::chain_draft`). A sequence whose tokens would pass the draft
//! model's context limit loses its draft state (it then decodes without drafts); so does one
//! restored from a prefix-cache entry without the draft's rows ([`DraftSide::restore`]).
//! Invariant, checked before each follow and draft: a draft state's `pos` is the target's.
//!
//! [`Worker`]: super::worker::Worker

use std::collections::HashMap;
use std::sync::Arc;

use k3_model::layers::kda::StateDType;
use k3_model::layers::pages::{PageSet, PAGE_ROWS};
use k3_model::{Model, SeqState};

use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::prefix::{state as prefix_state, Capture, KdaSnap, Segment};

/// The draft model and the draft state of each sequence that has one.
pub struct DraftSide {
    model: Arc<Model>,
    kda: StateDType,
    states: HashMap<SeqId, SeqState>,
    /// Rows per page of the MLA/DSA caches of new states (the target's).
    page_rows: usize,
}

/// The draft state of sequence `id` is not where the target's is: a bug.
fn lost(id: SeqId, draft: usize, target: usize) -> EngineError {
    EngineError::Internal(format!("sequence {id}: the draft model's state holds {draft} tokens, the target's {target}"))
}

impl DraftSide {
    pub fn new(model: Arc<Model>, kda: StateDType) -> DraftSide {
        DraftSide { model, kda, states: HashMap::new(), page_rows: PAGE_ROWS }
    }

    /// The MLA/DSA caches of the states made from now on in pages of `rows` rows.
    pub fn set_page_rows(&mut self, rows: usize) {
        self.page_rows = rows;
    }

    fn new_state(&self) -> SeqState {
        self.model.new_state_with(self.kda).with_page_rows(self.page_rows)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// A new sequence (the target's state is new too): an empty draft state.
    pub fn start(&mut self, id: SeqId) {
        self.states.insert(id, self.new_state());
    }

    pub fn release(&mut self, id: SeqId) {
        self.states.remove(&id);
    }

    /// Bytes of the draft states, pages counted as `SeqState::bytes_once` counts them.
    pub fn bytes_once(&self, seen: &mut PageSet) -> usize {
        self.states.values().map(|s| s.bytes_once(seen)).sum()
    }

    /// Whether sequence `id` has a draft state.
    pub fn has(&self, id: SeqId) -> bool {
        self.states.contains_key(&id)
    }

    /// After a target forward in which sequence `id` consumed `tokens` (its target `pos` now
    /// `pos`): the draft model consumes them too, every such sequence in one forward of the
    /// same kind (`verify`, `row_exact` as the target's). A sequence that would pass the draft
    /// model's context limit loses its draft state.
    pub fn follow(&mut self, seqs: &[(SeqId, &[u32], usize)], verify: bool, row_exact: bool) -> Result<()> {
        let max = self.model.config.max_context();
        let (mut ids, mut toks, mut taken) = (Vec::new(), Vec::new(), Vec::new());
        for &(id, t, pos) in seqs {
            let Some(st) = self.states.get(&id) else { continue };
            if st.pos + t.len() != pos {
                return Err(lost(id, st.pos, pos - t.len()));
            }
            if pos > max {
                self.states.remove(&id);
                continue;
            }
            let st = self.states.remove(&id).expect("a draft state");
            ids.push(id);
            toks.push(t);
            taken.push(st);
        }
        if ids.is_empty() {
            return Ok(());
        }
        let out = {
            let mut refs: Vec<&mut SeqState> = taken.iter_mut().collect();
            self.model.follow(&toks, &mut refs, verify, row_exact)
        };
        for (id, st) in ids.into_iter().zip(taken) {
            self.states.insert(id, st);
        }
        Ok(out?)
    }

    /// The target rolled sequence `id` back by `drop` tokens to `pos`: the draft state too.
    pub fn rollback(&mut self, id: SeqId, drop: usize, pos: usize) -> Result<()> {
        let Some(st) = self.states.get_mut(&id) else { return Ok(()) };
        if st.pos != pos + drop {
            return Err(lost(id, st.pos, pos + drop));
        }
        Ok(st.rollback(drop)?)
    }

    /// Sequence `id`'s chained drafts (the target has consumed `pos` tokens; see
    /// `Runner::draft`): 0 when it has no draft state.
    pub fn draft(&mut self, id: SeqId, pos: usize, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        let Some(st) = self.states.get_mut(&id) else { return Ok(0) };
        if st.pos != pos {
            return Err(lost(id, st.pos, pos));
        }
        Ok(self.model.chain_draft(st, next, k, choose)?)
    }

    /// Adds sequence `id`'s draft state to the target's capture `cap` (cut on the same grid of
    /// `grid` tokens, the snapshot at the same point), when it has one.
    pub fn capture(&self, id: SeqId, grid: usize, cap: &mut Capture) -> Result<()> {
        let Some(st) = self.states.get(&id) else { return Ok(()) };
        if st.pos != cap.to {
            return Err(lost(id, st.pos, cap.to));
        }
        let d = prefix_state::capture(st, cap.from, grid, cap.kda.is_some())?;
        for (cell, dc) in cap.cells.iter_mut().zip(d.cells) {
            cell.draft = Some(Box::new(dc));
        }
        if let (Some(k), Some(dk)) = (cap.kda.as_mut(), d.kda) {
            k.draft = Some(Box::new(dk));
        }
        Ok(())
    }

    /// Sequence `id` restored from the prefix cache: its draft state from the cells and the
    /// snapshot when all of them carry it, else none (it then decodes without drafts).
    pub fn restore(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        self.states.remove(&id);
        let dcells: Option<Vec<&Segment>> = cells.iter().map(|c| c.draft.as_deref()).collect();
        if let (Some(dcells), Some(dsnap)) = (dcells, snap.draft.as_deref()) {
            let st = prefix_state::restore(self.new_state(), &dcells, dsnap)?;
            self.states.insert(id, st);
        }
        Ok(())
    }
}
