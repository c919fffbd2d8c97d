//! One rank of the CPU model as the runner drives it ([`Worker`]): its model and its map
//! sequence id → [`SeqState`] (with the MTP draft state when enabled), and a separate draft
//! model's states beside them when one is (`dist::draft`). [`Worker::apply`] drops
//! the released states, creates a state on a sequence's first sight, embeds the tokens (or
//! takes the step's own rows) and runs `Model::forward_varlen`; the other commands (`dist::step`) —
//! verify, rollback, capture, restore — act on the same states. Every rank of a layout applies
//! the same commands in the same order, so their collectives pair up (`runner.rs` has the
//! interface, `threads.rs` the ranks as threads).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k3_core::kernels::cpu::matmul::with_row_exact;
use k3_model::layers::kda::StateDType;
use k3_model::layers::mtp::MtpState;
use k3_model::layers::pages::{PageSet, PAGE_ROWS};
use k3_model::{ForwardOpts, Model, SeqState};

use super::draft::DraftSide;
use super::runner::{run_step, Failure, Fault, RankOptions, RankWorker, Step};
use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::prefix::{state as prefix_state, Capture, KdaSnap, Segment};

/// Which forward [`Worker::apply_with`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Plain,
    /// Rank 0 of a pipeline layout: the logits come later ([`Worker::recv_logits`]).
    Deferred,
    /// Every row's logits, each a single decode step's (`Model::forward_verify`).
    Verify,
}

/// One rank's model and the states of the sequences it has seen.
pub struct Worker {
    model: Arc<Model>,
    kda: StateDType,
    states: HashMap<SeqId, SeqState>,
    steps: usize,
    fault: Option<Fault>,
    /// Every projection row-exact (`with_row_exact`): a sequence's logits do not depend on
    /// which other sequences share its steps.
    batch_invariant: bool,
    /// New sequence states carry an MTP draft state (`Runner::enable_mtp`).
    mtp: bool,
    /// A separate draft model and its states (`Runner::enable_draft`).
    draft: Option<DraftSide>,
    /// Rows per page of the MLA/DSA caches of new states (`Runner::set_page_rows`).
    page_rows: usize,
}

impl Worker {
    pub fn new(model: Arc<Model>, kda: StateDType) -> Worker {
        Worker { model, kda, states: HashMap::new(), steps: 0, fault: None, batch_invariant: false, mtp: false, draft: None, page_rows: PAGE_ROWS }
    }

    /// This worker with [`RankOptions`] (a deliberate fault, batch invariance).
    pub fn with_options(mut self, o: RankOptions) -> Worker {
        self.fault = o.fault;
        self.batch_invariant = o.batch_invariant;
        self
    }

    /// The global rank.
    pub fn rank(&self) -> usize {
        self.model.plan.rank
    }
    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn model_arc(&self) -> Arc<Model> {
        self.model.clone()
    }
    /// The KDA state dtype of the states it makes.
    pub fn kda(&self) -> StateDType {
        self.kda
    }
    pub fn release(&mut self, id: SeqId) {
        self.states.remove(&id);
        if let Some(d) = self.draft.as_mut() {
            d.release(id);
        }
    }
    /// Bytes of the live sequence states (a draft model's included), each cache page once
    /// however many sequences share it, and none of the pages the prefix-cache pool holds (it
    /// counts them: `k3_model::layers::pages`). On a rank that is not its pipeline stage's
    /// first, no page held elsewhere: such a page came from the pool (a restore), which every
    /// rank of the stage restored alike from its first rank's captured pages, so that rank
    /// holds it too and charges it (the layout's ranks as threads charge it once).
    pub fn state_bytes(&self) -> usize {
        let mut seen = if self.model.plan.local == 0 { PageSet::new() } else { PageSet::leaving_shared() };
        self.states.values().map(|s| s.bytes_once(&mut seen)).sum::<usize>() + self.draft.as_ref().map_or(0, |d| d.bytes_once(&mut seen))
    }
    /// Sequence `id`'s state, if it has one.
    pub fn state(&self, id: SeqId) -> Option<&SeqState> {
        self.states.get(&id)
    }
    /// See [`Runner::set_page_rows`](super::runner::Runner::set_page_rows): the states made from
    /// now on (the draft model's too).
    pub fn set_page_rows(&mut self, rows: usize) {
        self.page_rows = rows.max(1);
        if let Some(d) = self.draft.as_mut() {
            d.set_page_rows(self.page_rows);
        }
    }
    /// See [`Runner::capture`] (with the draft model's state of the sequence, if any).
    pub fn capture(&self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        let st = self.states.get(&id).ok_or(EngineError::UnknownSeq(id))?;
        let mut cap = prefix_state::capture(st, from, grid, kda)?;
        if let Some(d) = &self.draft {
            d.capture(id, grid, &mut cap)?;
        }
        Ok(cap)
    }
    /// See [`Runner::restore`] (on a parallel layout: this rank's part, `dist::layout_state::part`).
    pub fn restore(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        let st = prefix_state::restore(self.new_seq_state(), cells, snap)?;
        if let Some(d) = self.draft.as_mut() {
            d.restore(id, cells, snap)?;
        }
        self.states.insert(id, st);
        Ok(())
    }

    /// A new sequence state (with an MTP draft state when it is on).
    fn new_seq_state(&self) -> SeqState {
        let mut st = self.model.new_state_with(self.kda).with_page_rows(self.page_rows);
        if self.mtp {
            st.mtp = Some(MtpState::new(self.model.config.text.hidden_size));
        }
        st
    }

    /// See [`Runner::enable_mtp`].
    pub fn enable_mtp(&mut self) -> std::result::Result<(), String> {
        if self.model.mtp.is_none() {
            let n = self.model.config.mtp_layers();
            return Err(match n {
                0 => "this checkpoint has no MTP draft layer (config.json's num_nextn_predict_layers is 0, as in the K3 release); use ngram or suffix — decoding without speculation".into(),
                _ => format!("its MTP layer (num_nextn_predict_layers = {n}) is loaded on a one-rank model only; decoding without speculation"),
            });
        }
        self.mtp = true;
        Ok(())
    }

    /// See [`Runner::enable_draft`]: every sequence seen from now on gets a state of `draft`
    /// beside the target's. Why not, when the vocabularies differ.
    pub fn enable_draft(&mut self, draft: Arc<Model>) -> std::result::Result<(), String> {
        let (t, d) = (self.model.config.text.vocab_size, draft.config.text.vocab_size);
        if t != d {
            return Err(format!(
                "the draft model's vocab_size is {d}, the target's {t} (--draft-model must share the target's vocabulary); decoding without speculation"
            ));
        }
        let mut side = DraftSide::new(draft, self.kda);
        side.set_page_rows(self.page_rows);
        self.draft = Some(side);
        Ok(())
    }

    /// See [`Runner::draft`]: from the separate draft model when there is one, else the MTP layer.
    pub fn draft(&mut self, id: SeqId, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        let st = self.states.get_mut(&id).ok_or(EngineError::UnknownSeq(id))?;
        if let Some(d) = self.draft.as_mut() {
            return d.draft(id, st.pos, next, k, choose);
        }
        Ok(with_row_exact(self.batch_invariant, || self.model.mtp_draft(st, next, k, choose))?)
    }

    /// Applies one step (see the module doc). Returns the logits on the first and last
    /// pipeline stages, nothing on the stages between.
    pub fn apply(&mut self, step: &Step) -> Result<Vec<f32>> {
        self.apply_with(step, Pass::Plain)
    }

    /// [`Worker::apply`] on rank 0 of a pipeline layout: returns (no logits) once its stage's
    /// layers ran and the residual state is sent on; [`Worker::recv_logits`] gets the logits.
    pub fn submit(&mut self, step: &Step) -> Result<Vec<f32>> {
        self.apply_with(step, Pass::Deferred)
    }

    /// The logits of the oldest step [`Worker::submit`] started.
    pub fn recv_logits(&mut self) -> Result<Vec<f32>> {
        Ok(self.model.recv_logits()?)
    }

    /// [`Worker::apply`] as a verify forward (`Model::forward_verify`): every row's logits.
    pub fn verify(&mut self, step: &Step) -> Result<Vec<f32>> {
        self.apply_with(step, Pass::Verify)
    }

    /// Drops the last `drop` tokens of sequence `id`'s last verify forward (the draft model's
    /// state of it too).
    pub fn rollback(&mut self, id: SeqId, drop: usize) -> Result<()> {
        let st = self.states.get_mut(&id).ok_or(EngineError::UnknownSeq(id))?;
        st.rollback(drop)?;
        match self.draft.as_mut() {
            Some(d) => d.rollback(id, drop, st.pos),
            None => Ok(()),
        }
    }

    fn apply_with(&mut self, step: &Step, pass: Pass) -> Result<Vec<f32>> {
        for id in &step.released {
            self.release(*id);
        }
        self.steps += 1;
        if let Some(f) = self.fault.filter(|f| f.rank == self.rank() && f.at_step == self.steps) {
            if f.panic {
                panic!("injected panic at step {}", self.steps);
            }
            return Err(EngineError::Unsupported(format!("injected fault at step {}", self.steps)));
        }
        if step.seqs.is_empty() {
            return Ok(Vec::new());
        }
        let h = self.model.config.text.hidden_size;
        let mut seen = HashSet::new();
        for s in &step.seqs {
            if s.tokens.is_empty() {
                return Err(EngineError::Internal(format!("sequence {} has no tokens", s.id)));
            }
            if !seen.insert(s.id) {
                return Err(EngineError::Internal(format!("sequence {} is planned twice", s.id)));
            }
            if let Some(r) = s.rows.as_ref().filter(|r| r.len() != s.tokens.len() * h) {
                return Err(EngineError::Internal(format!("sequence {}: {} row values for {} tokens of hidden_size {h}", s.id, r.len(), s.tokens.len())));
            }
        }
        // Input rows, on the first stage: the step's own rows, else the token embeddings (one
        // lookup for the step; on a tensor-parallel stage a collective, the same on every rank).
        let emb = if self.model.plan.first_stage() {
            let toks: Vec<u32> = step.seqs.iter().filter(|s| s.rows.is_none()).flat_map(|s| s.tokens.iter().copied()).collect();
            let looked_up = if toks.is_empty() { Vec::new() } else { self.model.embed(&toks)? };
            let mut emb = Vec::with_capacity(step.num_tokens() * h);
            let mut at = 0;
            for s in &step.seqs {
                match &s.rows {
                    Some(r) => emb.extend_from_slice(r),
                    None => {
                        let n = s.tokens.len() * h;
                        emb.extend_from_slice(&looked_up[at..at + n]);
                        at += n;
                    }
                }
            }
            emb
        } else {
            Vec::new()
        };
        let mut taken = Vec::with_capacity(step.seqs.len());
        for s in &step.seqs {
            taken.push(match self.states.remove(&s.id) {
                Some(st) => st,
                None => {
                    // First sight: the draft model's state starts with the target's.
                    if let Some(d) = self.draft.as_mut() {
                        d.start(s.id);
                    }
                    self.new_seq_state()
                }
            });
        }
        let lens: Vec<usize> = step.seqs.iter().map(|s| s.tokens.len()).collect();
        let out = {
            let mut refs: Vec<&mut SeqState> = taken.iter_mut().collect();
            let out = match pass {
                Pass::Verify => self.model.forward_verify(emb, &lens, &mut refs),
                _ => {
                    let opts = ForwardOpts { last_only: step.last_only, defer_logits: pass == Pass::Deferred, ..Default::default() };
                    with_row_exact(self.batch_invariant, || self.model.forward_varlen(emb, &lens, &mut refs, opts, None))
                }
            };
            // The MTP draft layer takes the rows this forward made (row-exact in a verify step,
            // as the target's rows are).
            match out {
                Ok(v) if self.mtp => {
                    let ids: Vec<&[u32]> = step.seqs.iter().map(|s| s.tokens.as_slice()).collect();
                    with_row_exact(pass == Pass::Verify || self.batch_invariant, || self.model.mtp_advance(&ids, &mut refs)).map(|()| v)
                }
                o => o,
            }
        };
        // The draft model consumes the same tokens in a forward of the same kind (`dist::draft`).
        let out = match (out, self.draft.as_mut()) {
            (Ok(v), Some(d)) => {
                let seqs: Vec<(SeqId, &[u32], usize)> = step.seqs.iter().zip(&taken).map(|(s, st)| (s.id, s.tokens.as_slice(), st.pos)).collect();
                d.follow(&seqs, pass == Pass::Verify, self.batch_invariant).map(|()| v)
            }
            (o, _) => o.map_err(EngineError::from),
        };
        for (s, st) in step.seqs.iter().zip(taken) {
            self.states.insert(s.id, st);
        }
        out
    }

    /// [`Worker::apply`] through [`run_step`]: an error or a panic becomes a [`Failure`] and
    /// aborts the rank's groups.
    pub fn run(&mut self, step: &Step) -> std::result::Result<Vec<f32>, Failure> {
        run_step(self, step)
    }
}

impl RankWorker for Worker {
    fn rank(&self) -> usize {
        Worker::rank(self)
    }
    fn apply(&mut self, step: &Step) -> Result<Vec<f32>> {
        Worker::apply(self, step)
    }
    fn verify(&mut self, step: &Step) -> Result<Vec<f32>> {
        Worker::verify(self, step)
    }
    fn rollback(&mut self, id: SeqId, drop: usize) -> Result<()> {
        Worker::rollback(self, id, drop)
    }
    fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        Worker::capture(self, id, from, grid, kda)
    }
    fn drop_states(&mut self, ids: &[SeqId]) -> Result<()> {
        ids.iter().for_each(|id| Worker::release(self, *id));
        Ok(())
    }
    fn set_page_rows(&mut self, rows: usize) -> Result<()> {
        Worker::set_page_rows(self, rows);
        Ok(())
    }
    fn restore(&mut self, id: SeqId, part: &Capture) -> Result<()> {
        let snap = part.kda.as_ref().ok_or_else(|| EngineError::Internal(format!("restore of sequence {id}: the part has no KDA snapshot")))?;
        let cells: Vec<&Segment> = part.cells.iter().collect();
        Worker::restore(self, id, &cells, snap)
    }
    fn resume(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        Worker::restore(self, id, cells, snap)
    }
    fn abort(&self, why: &str) {
        self.model.groups.abort(why);
    }
    fn state_bytes(&self) -> usize {
        Worker::state_bytes(self)
    }
}
