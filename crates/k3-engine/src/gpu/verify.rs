//! The GPU runner's speculative verify steps (issue 22; the model's side is k3-model
//! `cuda/verify.rs` and `cuda/graph.rs`): a step of `B` sequences whose longest has `T` rows
//! (`k + 1`) replays the verify graph of `(B, T)`, captured on first use (at most
//! [`MAX_GRAPHS`], the least recently used dropped first); sequences with fewer rows are padded
//! to `T`, and their padding is undone with the step's rollbacks (a drop-0 entry in
//! `rollbacks`, replaced by the engine's own rollback of the sequence). A step runs eagerly
//! (`CudaModel::forward_verify`) when graphs are off (`K3_VERIFY_GRAPHS=0`; `--no-cuda-graphs`,
//! [`GpuRunner::set_verify_graphs`]), or — said once per reason on stderr — when it has its own
//! input rows (images), when the MoE cannot capture `B·T` rows, or when a padded sequence
//! would pass its cache reservation or the graphs' context. [`VerifyStats`] counts both kinds.
//! The step's rollbacks replay the rollback graph of the verify graph that ran it
//! (`RollbackRun::Replay`), or run eagerly per sequence (`RollbackRun::PerSequence`, the
//! reference) after an eager step or with `K3_ROLLBACK_GRAPHS=0` ([`GpuRunner::set_rollback_graphs`]).
//! `K3_VERIFY_CHECK=graph|eager` (a diagnostic, slow) runs each replayed step three ways from
//! the same state and prints how they differ ([`checked`]). Beside verification, the other step
//! that wants every row's logits: [`GpuRunner::all_rows`] (prompt logprobs), eager.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use k3_model::cuda::{CudaSeqState, Input, RollbackRun, VerifyGraph, VerifyRun};

use super::imp::{GpuRunner, GpuSeq, Taken};
use super::VerifyStats;
use crate::dist::runner::Step;
use crate::engine::SeqId;
use crate::error::{EngineError, Result};

/// Verify graphs a runner keeps.
pub const MAX_GRAPHS: usize = 32;

/// The runner's verify graphs and their switch.
pub struct VerifyGraphs {
    on: bool,
    /// Rollbacks of a replayed step through its rollback graph (unless `K3_ROLLBACK_GRAPHS=0`).
    rollback_on: bool,
    /// The graph whose replay was the last verify step (the sequences continue from it).
    last: Option<(usize, usize)>,
    graphs: HashMap<(usize, usize), (VerifyGraph, u64)>,
    clock: u64,
    noted: HashSet<&'static str>,
    stats: Arc<VerifyStats>,
    /// `K3_VERIFY_CHECK=graph|eager`: every replayed step is checked against the eager step
    /// ([`checked`]).
    check: Option<Continue>,
}

impl VerifyGraphs {
    /// On unless `K3_VERIFY_GRAPHS=0`. Traced on an H100 (2026-12-05, `K3_VERIFY_CHECK`): on
    /// k3-nano's quote workload, where greedy output with graphs had parted from plain, every
    /// replayed step's argmax equalled the eager verify's except at one near-tie (top-2 margin
    /// 4.8e-4 against a rounding difference of 8.8e-3 between the graph's step and the unpadded
    /// eager one) — the same parting any change of the step's shape can cause on the GPU.
    pub fn new() -> Self {
        let switch = |name: &str| std::env::var(name).map_or(true, |v| v.trim() != "0");
        // The rollback graphs: on since `cuda_verify` and `cuda_spec` passed on an H100
        // (2026-12-06); `K3_ROLLBACK_GRAPHS=0` runs every rollback eagerly per sequence.
        let rollback_on = switch("K3_ROLLBACK_GRAPHS");
        let on = switch("K3_VERIFY_GRAPHS");
        VerifyGraphs { on, rollback_on, last: None, graphs: HashMap::new(), clock: 0, noted: HashSet::new(), stats: Arc::default(), check: check_mode() }
    }

    /// Drops every graph (before the model).
    pub fn clear(&mut self) {
        self.graphs.clear();
        self.last = None;
    }

    /// Prints `note: …` on stderr the first time a reason of this `kind` comes.
    fn note(&mut self, kind: &'static str, msg: impl FnOnce() -> String) {
        if self.noted.insert(kind) {
            eprintln!("note: {}", msg());
        }
    }
}

impl GpuRunner {
    /// Every row's logits `[N, vocab]` of an eager step (prompt logprobs; one process: the
    /// model's `forward_varlen`, as `k3 logits --device cuda` runs it).
    pub(super) fn all_rows(&mut self, step: &Step) -> Result<Vec<f32>> {
        if self.model.plan.par.world() != 1 {
            return Err(EngineError::Internal("every row's logits are returned by a one-process GPU runner only".into()));
        }
        let mut t = self.take_step(step, true)?;
        let out = {
            let mut seqs: Vec<&mut CudaSeqState> = t.seqs.iter_mut().map(|(_, g)| &mut g.state).collect();
            let input = match &t.emb {
                Some(e) => Input::Embeds(e),
                None => Input::Tokens(&t.tokens),
            };
            self.model.forward_varlen(input, &t.lens, &mut seqs, false).map_err(EngineError::from)
        };
        self.seqs.extend(t.seqs);
        out
    }

    /// Turns the capture of verify steps on or off (for A/B runs in one process); decode
    /// graphs off (`use_graphs`) turn it off too.
    pub fn set_verify_graphs(&mut self, on: bool) {
        self.verify_graphs.on = on;
        if !on {
            self.verify_graphs.clear();
        }
    }

    /// Turns the rollback graphs on or off (off: every rollback eager, per sequence — the
    /// reference; for A/B runs in one process).
    pub fn set_rollback_graphs(&mut self, on: bool) {
        self.verify_graphs.rollback_on = on;
    }

    /// The counters of this runner's verify steps.
    pub fn verify_stats(&self) -> Arc<VerifyStats> {
        self.verify_graphs.stats.clone()
    }

    /// Applies the pending rollbacks (see `rollbacks`); the last verify step is then
    /// forgotten, as the states move on.
    pub(super) fn settle(&mut self) -> Result<()> {
        let last = self.verify_graphs.last.take();
        if self.rollbacks.is_empty() {
            self.model.end_verify();
            return Ok(());
        }
        let pending = std::mem::take(&mut self.rollbacks);
        let mut taken: Vec<(SeqId, GpuSeq, usize)> = pending.iter().filter_map(|&(id, d)| self.seqs.remove(&id).map(|s| (id, s, d))).collect();
        let vg = &self.verify_graphs;
        let graph = last.filter(|_| vg.rollback_on).and_then(|k| vg.graphs.get(&k)).map(|(g, _)| g).filter(|g| g.has_rollback());
        let how = graph.map_or(RollbackRun::PerSequence, RollbackRun::Replay);
        let counter = if graph.is_some() { &vg.stats.rollbacks_replayed } else { &vg.stats.rollbacks_eager };
        counter.fetch_add(1, Relaxed);
        let out = {
            let mut refs: Vec<(&mut CudaSeqState, usize)> = taken.iter_mut().map(|(_, s, d)| (&mut s.state, *d)).collect();
            self.model.rollback_as(&mut refs, how)
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
        self.verify_graphs.last = None;
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
            // The rollback graph only while they are on: it is memory and capture time otherwise.
            let g = self.model.capture_verify(b, rows, ctx, vg.rollback_on)?;
            vg.graphs.insert((b, rows), (g, 0));
            vg.stats.captured.fetch_add(1, Relaxed);
        }
        vg.clock += 1;
        let Some((g, used)) = vg.graphs.get_mut(&(b, rows)) else {
            return Err(crate::error::EngineError::Internal(format!("the verify graph of {b} × {rows} rows is missing")));
        };
        *used = vg.clock;
        vg.stats.replayed.fetch_add(1, Relaxed);
        let (out, graph_state) = match vg.check {
            None => (self.model.verify_step(g, &t.tokens, &t.lens, &mut seqs, VerifyRun::Replay)?, true),
            Some(go_on) => (checked(&mut self.model, g, &t.tokens, &t.lens, &mut seqs, go_on)?, go_on == Continue::Graph),
        };
        if graph_state {
            vg.last = Some((b, rows)); // its rollback graph rolls the step back
        }
        for ((id, _), &n) in t.seqs.iter().zip(&t.lens) {
            if n < rows && graph_state {
                self.rollbacks.push((*id, 0)); // the padding rows are undone with the step's rollbacks
            }
        }
        Ok(out)
    }
}

/// Which run of a checked step (`K3_VERIFY_CHECK=graph|eager`) the sequences continue from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continue {
    Graph,
    Eager,
}

/// `K3_VERIFY_CHECK`: unset, or which run continues.
fn check_mode() -> Option<Continue> {
    match std::env::var("K3_VERIFY_CHECK").ok()?.trim() {
        "graph" | "1" => Some(Continue::Graph),
        "eager" => Some(Continue::Eager),
        _ => None,
    }
}

/// A diagnostic (`K3_VERIFY_CHECK`): the verify step through `g` is run three ways from the same
/// state — replayed, the graph's step run eagerly, and the plain eager verify
/// (`forward_verify`, unpadded) — the KDA pools and positions restored between runs; one line
/// on stderr compares each with the plain eager one (max |Δ logit|, rows whose argmax differs,
/// the eager top-2 margin there). The run named by `go_on` goes last, so the sequences continue
/// from its state, and its logits are returned.
fn checked(
    model: &mut k3_model::cuda::CudaModel,
    g: &VerifyGraph,
    tokens: &[u32],
    lens: &[usize],
    seqs: &mut [&mut CudaSeqState],
    go_on: Continue,
) -> Result<Vec<f32>> {
    let pos0: Vec<usize> = seqs.iter().map(|s| s.pos).collect();
    let saved = model.copy_kda_pools()?;
    let run = |model: &mut k3_model::cuda::CudaModel, which: u8, seqs: &mut [&mut CudaSeqState]| -> Result<Vec<f32>> {
        for (s, &p) in seqs.iter_mut().zip(&pos0) {
            s.pos = p;
        }
        model.restore_kda_pools(&saved)?;
        Ok(match which {
            0 => model.verify_step(g, tokens, lens, seqs, VerifyRun::Replay)?,
            1 => model.verify_step(g, tokens, lens, seqs, VerifyRun::Eager)?,
            _ => model.forward_verify(Input::Tokens(tokens), lens, seqs)?,
        })
    };
    let order: [u8; 3] = match go_on {
        Continue::Graph => [2, 1, 0],
        Continue::Eager => [0, 1, 2],
    };
    let mut outs: [Vec<f32>; 3] = Default::default();
    for w in order {
        outs[w as usize] = run(model, w, seqs)?;
    }
    let vocab = outs[2].len() / lens.iter().sum::<usize>().max(1);
    let argmax = |r: &[f32]| r.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0;
    let mut line = format!("verify-check pos {pos0:?} rows {lens:?}:");
    for (name, o) in [("replay", &outs[0]), ("graph-eager", &outs[1])] {
        let max = o.iter().zip(&outs[2]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let mut differ = Vec::new();
        for (r, (a, b)) in o.chunks(vocab).zip(outs[2].chunks(vocab)).enumerate() {
            let (ia, ib) = (argmax(a), argmax(b));
            if ia != ib {
                let mut s: Vec<f32> = b.to_vec();
                s.sort_by(|x, y| y.total_cmp(x));
                differ.push(format!("row {r}: {ia} vs {ib} (eager margin {:.2e})", s[0] - s[1]));
            }
        }
        line.push_str(&format!(" {name} max|Δ| {max:.3e}, argmax differs {differ:?};"));
    }
    eprintln!("{line}");
    let last = *order.last().unwrap_or(&0) as usize;
    Ok(std::mem::take(&mut outs[last]))
}
