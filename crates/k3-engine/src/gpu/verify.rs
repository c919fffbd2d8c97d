//! The GPU runner's speculative verify steps (issue 22; the model's side is k3-model
//! `cuda/verify.rs` and `cuda/graph.rs`): a step of `B` sequences whose longest has `T` rows
//! (`k + 1`) replays the verify graph of `(B, T)`, captured on first use (at most
//! [`MAX_GRAPHS`], the least recently used dropped first); sequences with fewer rows are padded
//! to `T`, and their padding is undone with the step's rollbacks (a drop-0 entry in
//! `rollbacks`, replaced by the engine's own rollback of the sequence). A step runs eagerly
//! (`CudaModel::forward_verify`) when graphs are off (the default: opt in with `K3_VERIFY_GRAPHS=1`; `--no-cuda-graphs`,
//! [`GpuRunner::set_verify_graphs`]), or — said once per reason on stderr — when it has its own
//! input rows (images), when the MoE cannot capture `B·T` rows, or when a padded sequence
//! would pass its cache reservation or the graphs' context. [`VerifyStats`] counts both kinds.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use k3_model::cuda::{CudaSeqState, Input, VerifyGraph, VerifyRun};

use super::imp::{GpuRunner, GpuSeq, Taken};
use super::VerifyStats;
use crate::engine::SeqId;
use crate::error::Result;

/// Verify graphs a runner keeps.
pub const MAX_GRAPHS: usize = 32;

/// The runner's verify graphs and their switch.
pub struct VerifyGraphs {
    on: bool,
    graphs: HashMap<(usize, usize), (VerifyGraph, u64)>,
    clock: u64,
    noted: HashSet<&'static str>,
    stats: Arc<VerifyStats>,
}

impl VerifyGraphs {
    /// Off unless `K3_VERIFY_GRAPHS=1`: on the H100 (2026-12-05) captured verify steps equal the
    /// same step run eagerly bit for bit and pass `cuda_spec`'s near-tie rule, but `k3 bench
    /// --speculative` on k3-nano's quote workload parted from plain greedy output with graphs
    /// (not eagerly), which is not traced yet.
    pub fn new() -> Self {
        let on = std::env::var("K3_VERIFY_GRAPHS").is_ok_and(|v| v.trim() == "1");
        VerifyGraphs { on, graphs: HashMap::new(), clock: 0, noted: HashSet::new(), stats: Arc::default() }
    }

    /// Drops every graph (before the model).
    pub fn clear(&mut self) {
        self.graphs.clear();
    }

    /// Prints `note: …` on stderr the first time a reason of this `kind` comes.
    fn note(&mut self, kind: &'static str, msg: impl FnOnce() -> String) {
        if self.noted.insert(kind) {
            eprintln!("note: {}", msg());
        }
    }
}

impl GpuRunner {
    /// Turns the capture of verify steps on or off (for A/B runs in one process); decode
    /// graphs off (`use_graphs`) turn it off too.
    pub fn set_verify_graphs(&mut self, on: bool) {
        self.verify_graphs.on = on;
        if !on {
            self.verify_graphs.clear();
        }
    }

    /// The counters of this runner's verify steps.
    pub fn verify_stats(&self) -> Arc<VerifyStats> {
        self.verify_graphs.stats.clone()
    }

    /// Applies the pending rollbacks (see `rollbacks`); the last verify step is then
    /// forgotten, as the states move on.
    pub(super) fn settle(&mut self) -> Result<()> {
        if self.rollbacks.is_empty() {
            self.model.end_verify();
            return Ok(());
        }
        let pending = std::mem::take(&mut self.rollbacks);
        let mut taken: Vec<(SeqId, GpuSeq, usize)> = pending.iter().filter_map(|&(id, d)| self.seqs.remove(&id).map(|s| (id, s, d))).collect();
        let out = {
            let mut refs: Vec<(&mut CudaSeqState, usize)> = taken.iter_mut().map(|(_, s, d)| (&mut s.state, *d)).collect();
            self.model.rollback(&mut refs)
        };
        self.seqs.extend(taken.into_iter().map(|(id, s, _)| (id, s)));
        self.model.end_verify();
        Ok(out?)
    }

    /// Why the step `t` (`b` sequences, at most `rows` rows each) runs eagerly, if it does:
    /// (kind, message) for a reason worth saying, `None` inside for graphs switched off.
    fn eager_reason(&self, t: &Taken, b: usize, rows: usize, ctx: usize) -> Option<Option<(&'static str, String)>> {
        if !self.use_graphs || !self.verify_graphs.on {
            return Some(None);
        }
        if t.emb.is_some() {
            return Some(Some(("rows", "verify steps with their own input rows (images) run eagerly, not from a CUDA graph".into())));
        }
        if let Err(why) = self.model.verify_capturable(b, rows) {
            return Some(Some(("shape", format!("a verify step of {b} sequences × {rows} rows runs eagerly, not from a CUDA graph: {why}"))));
        }
        let fits = t.seqs.iter().all(|(_, s)| s.state.pos + rows <= s.room.min(ctx));
        if !fits {
            return Some(Some((
                "context",
                format!(
                    "a verify step runs eagerly: a sequence padded to {rows} rows would pass its cache reservation or the {ctx} tokens of the verify graphs"
                ),
            )));
        }
        None
    }

    /// The verify step of the sequences `t` took (see the module doc): every row's logits.
    pub(super) fn verify_taken(&mut self, t: &mut Taken) -> Result<Vec<f32>> {
        let (b, rows) = (t.lens.len(), t.lens.iter().copied().max().unwrap_or(1));
        let ctx = self.model.cache.max_tokens.min(self.model.config.max_context());
        let eager = self.eager_reason(t, b, rows, ctx);
        let mut seqs: Vec<&mut CudaSeqState> = t.seqs.iter_mut().map(|(_, g)| &mut g.state).collect();
        if let Some(reason) = eager {
            if let Some((kind, msg)) = reason {
                self.verify_graphs.note(kind, || msg);
            }
            self.verify_graphs.stats.eager.fetch_add(1, Relaxed);
            let input = match &t.emb {
                Some(e) => Input::Embeds(e),
                None => Input::Tokens(&t.tokens),
            };
            return Ok(self.model.forward_verify(input, &t.lens, &mut seqs)?);
        }
        let vg = &mut self.verify_graphs;
        if !vg.graphs.contains_key(&(b, rows)) {
            if vg.graphs.len() >= MAX_GRAPHS {
                if let Some(&old) = vg.graphs.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k) {
                    vg.graphs.remove(&old);
                }
            }
            let g = self.model.capture_verify(b, rows, ctx)?;
            vg.graphs.insert((b, rows), (g, 0));
            vg.stats.captured.fetch_add(1, Relaxed);
        }
        vg.clock += 1;
        let Some((g, used)) = vg.graphs.get_mut(&(b, rows)) else {
            return Err(crate::error::EngineError::Internal(format!("the verify graph of {b} × {rows} rows is missing")));
        };
        *used = vg.clock;
        let out = self.model.verify_step(g, &t.tokens, &t.lens, &mut seqs, VerifyRun::Replay)?;
        vg.stats.replayed.fetch_add(1, Relaxed);
        for ((id, _), &n) in t.seqs.iter().zip(&t.lens) {
            if n < rows {
                self.rollbacks.push((*id, 0)); // the padding rows are undone with the step's rollbacks
            }
        }
        Ok(out)
    }
}
