//! Pipelined steps: the engine's side of a runner that overlaps steps (a pipeline layout,
//! `Runner::depth` = `--pp` stages; `docs/parallel.md`, "Pipelined steps").
//!
//! With P stages and one step at a time, each stage idles while the other P − 1 run. Here up to
//! P steps are in flight, each over other sequences: the running sequences split into P groups
//! that take turns (a step takes at most ⌈decoding / P⌉ decode tokens, then prefill chunks of
//! sequences no step holds), so while the last stage runs step N the first runs step N + P − 1.
//! Each [`Engine::step`] submits one step and, once P are in flight (or nothing more can be
//! planned), collects the oldest and samples from it; a sequence is planned again only after
//! its step was collected, so every sequence's tokens are the ones one-step-at-a-time decoding
//! gives. A sequence cancelled while its step is in flight is dropped when the step comes back
//! (its state is released at once on rank 0 and, in step order, on the other ranks).
//!
//! With the prefix cache or speculative decoding on, steps run one at a time: a capture,
//! restore, verify or rollback (`dist::step::Command`) acts on every rank's state after the
//! step before it, so no step may be in flight then.

use std::time::Instant;

use super::{Engine, Event};
use crate::dist::runner::Step;
use crate::engine::SeqId;
use crate::error::{EngineError, Result};

/// A submitted step: its sequences (id, tokens consumed) and when it started.
pub(super) struct Flight {
    seqs: Vec<(SeqId, usize)>,
    t0: Instant,
}

impl Engine {
    /// Steps in flight at once: the runner's depth, capped by
    /// [`super::EngineConfig::pipeline_depth`]; 1 with the prefix cache or speculative decoding on.
    pub(super) fn pipeline_depth(&self) -> usize {
        if self.prefix.is_some() || self.speculating() == Ok(true) {
            return 1;
        }
        self.runner.depth().min(self.config.pipeline_depth.unwrap_or(usize::MAX)).max(1)
    }

    /// One pipelined step (see the module doc): submits a step when one can be planned and
    /// fewer than `depth` are in flight; collects the oldest when the pipeline is full or
    /// nothing more can be planned. The tokens of the collected step.
    pub(super) fn pipe_step(&mut self, depth: usize, limit: usize) -> Result<Vec<Event>> {
        if self.flight.len() < depth {
            let decoding = self.running.iter().filter(|s| s.done == s.req.prompt.len() && !s.output.is_empty()).count();
            let plan = self.plan_step(decoding.div_ceil(depth).max(1));
            if !plan.is_empty() {
                let seqs = plan.iter().map(|(i, toks)| self.step_seq(*i, toks)).collect();
                let held = plan
                    .iter()
                    .map(|(i, toks)| {
                        let s = &mut self.running[*i];
                        s.in_flight = true;
                        (s.id, toks.len())
                    })
                    .collect();
                if let Err(e) = self.runner.submit(Step { seqs, last_only: true, released: Vec::new() }) {
                    self.land_all();
                    return Err(e);
                }
                self.flight.push_back(Flight { seqs: held, t0: Instant::now() });
                if self.flight.len() < depth {
                    return Ok(Vec::new());
                }
            }
        }
        let Some(f) = self.flight.pop_front() else { return Ok(Vec::new()) };
        let logits = match self.runner.collect() {
            Ok(l) => l,
            Err(e) => {
                self.land_all();
                return Err(e);
            }
        };
        let vocab = self.runner.config().text.vocab_size;
        if logits.len() != f.seqs.len() * vocab {
            return Err(EngineError::Internal(format!(
                "the runner returned {} logits for a step of {} sequences of vocabulary {vocab}",
                logits.len(),
                f.seqs.len()
            )));
        }
        // The step's sequences still running (a cancelled one's row is dropped), by index.
        let (mut plan, mut rows) = (Vec::with_capacity(f.seqs.len()), Vec::with_capacity(logits.len()));
        for (&(id, n), lg) in f.seqs.iter().zip(logits.chunks_exact(vocab)) {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                self.running[i].in_flight = false;
                plan.push((i, n));
                rows.extend_from_slice(lg);
            }
        }
        let (mut events, mut finished) = (Vec::new(), Vec::new());
        self.take_logits(&plan, &rows, f.t0, limit, &mut events, &mut finished)?;
        self.reap(finished);
        Ok(events)
    }

    /// After a failed submit or collect: no step is in flight any more (the runner has
    /// stopped; a later step plans every running sequence again and gets the runner's error).
    fn land_all(&mut self) {
        self.flight.clear();
        for s in &mut self.running {
            s.in_flight = false;
        }
    }
}
