//! Rank 0's side of pipelined steps on the GPU (`docs/parallel.md`, "Pipelined steps"): on a
//! pipeline layout rank 0 computes a step's first stage and *holds* its residual state
//! ([`HeldStep`]) instead of sending it at once, receives the previous step's logits
//! ([`CudaModel::recv_logits`]), and only then sends the held state on. So rank 0's messages
//! with the other stages keep the order one step at a time gives (send N, receive N's logits,
//! send N + 1, ...), which NCCL's blocking point-to-point calls need on one stream, while its
//! compute of step N + 1 runs during the later stages' work on step N.
//!
//! Shapes: the held state as `stage::Residual` (F32 `[N, H]` tensors); logits F32 `[rows, V]`.

use super::graph::DecodeGraph;
use super::stage::{self, Residual};
use super::state::Step;
use super::{CudaModel, CudaSeqState, Input};
use crate::error::{ModelError, Result};

/// A step rank 0 computed and has not sent on yet ([`CudaModel::send_held`] sends it).
pub struct HeldStep(Held);

enum Held {
    /// An eager step: its residual state and its tables (kept until the state is sent).
    Eager(Residual, Step),
    /// A replay of the held decode graph of this batch size (its state lives in the graph).
    Graph(usize),
}

impl HeldStep {
    /// The batch size of the held decode graph it replayed; `None` for an eager step.
    pub fn graph_batch(&self) -> Option<usize> {
        match self.0 {
            Held::Graph(b) => Some(b),
            Held::Eager(..) => None,
        }
    }
}

impl CudaModel {
    /// Whether this rank holds steps (rank 0 of a layout of several stages).
    pub fn holds_steps(&self) -> bool {
        self.plan.rank == 0 && self.plan.par.pp > 1
    }

    fn check_holds(&self) -> Result<()> {
        match self.holds_steps() {
            true => Ok(()),
            false => Err(ModelError::Internal(format!("rank {} of --pp {}: only rank 0 of a pipeline layout holds steps", self.plan.rank, self.plan.par.pp))),
        }
    }

    /// The eager step of [`CudaModel::forward_varlen`] up to rank 0's residual state, held.
    pub fn forward_held(&mut self, input: Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState]) -> Result<HeldStep> {
        self.check_holds()?;
        let step = self.prepare(&input, lens, seqs)?;
        let res = self.run_stage(&step, &input)?;
        for (s, &n) in seqs.iter_mut().zip(lens) {
            s.pos += n;
        }
        Ok(HeldStep(Held::Eager(res, step)))
    }

    /// Captures rank 0's held decode graph of `batch` sequences (see `capture_with`).
    pub fn capture_decode_held(&mut self, batch: usize, max_context: usize) -> Result<DecodeGraph> {
        self.check_holds()?;
        self.capture_with(batch, max_context, true)
    }

    /// One decode token for each of `seqs` through the held graph `g`, held.
    pub fn decode_step_held(&mut self, g: &DecodeGraph, tokens: &[u32], seqs: &mut [&mut CudaSeqState]) -> Result<HeldStep> {
        self.check_holds()?;
        self.decode_held(g, tokens, seqs)?;
        Ok(HeldStep(Held::Graph(g.batch())))
    }

    /// Sends a held step's residual state to the next stage (`graph`: the held graph of
    /// [`HeldStep::graph_batch`] when it replayed one).
    pub fn send_held(&self, h: HeldStep, graph: Option<&DecodeGraph>) -> Result<()> {
        match (h.0, graph) {
            (Held::Eager(res, _step), _) => res.send(self),
            (Held::Graph(_), Some(g)) => g.send_held(self),
            (Held::Graph(b), None) => Err(ModelError::Internal(format!("the held decode graph of batch {b} is gone"))),
        }
    }

    /// Rank 0 of a pipeline layout: the oldest step's logits `[rows, V]` from the last stage,
    /// on the host.
    pub fn recv_logits(&self, rows: usize) -> Result<Vec<f32>> {
        self.check_holds()?;
        let l = stage::logits_from_last(self, rows)?.ok_or_else(|| ModelError::Internal("rank 0 received no logits".into()))?;
        Ok(l.to_f32_vec()?)
    }

    /// This stage's part of a step, up to its residual state (nothing sent).
    pub(crate) fn run_stage(&self, step: &Step, input: &Input<'_>) -> Result<Residual> {
        self.stage_traced(step, input, &mut None)
    }
}
