//! The engine's speculative step (a child module of `engine`, issue 22): the step's plan as
//! `Engine::step` made it, then, for every decoding sequence, drafts from its proposer
//! appended to its one decode token; prefill chunks run in their own plain forward, and the
//! decode rows — drafted and plain sequences together — in one `Runner::verify` forward,
//! whose every row's logits are a single decode step's. Per sequence, the rows are accepted in
//! order (`spec::accept`): each accepted draft is emitted, then the target's token at the first
//! rejected position (or the bonus token after the last draft). Every emitted token passes
//! through the same stop / length checks as in plain decoding, so a sequence can finish
//! mid-draft. Then `Runner::rollback` drops the rejected tail of the survivors' states.
//!
//! Shapes: the verify step holds `1 + k_i` tokens of sequence i (`k_i` may be 0); its logits
//! are `[Σ (1 + k_i), vocab]`, sequence by sequence.

use std::sync::Arc;
use std::time::Instant;

use super::forward::{push_token, sample_next};
use super::{Engine, Event, Request, SeqId, Sequence};
use crate::dist::runner::{Runner, Step};
use crate::error::{EngineError, Result};
use crate::spec::accept::decide;
use crate::spec::model::ModelProposer;
use crate::spec::ngram::NgramProposer;
use crate::spec::suffix::{remember, History, SuffixProposer};
use crate::spec::{Adaptive, Draft, DraftModel, Proposer, SpecMethod, SpecStats};

/// Makes a request's proposer (a proposer of one's own, or a tap on the configured one; see
/// [`Engine::set_proposer`]).
pub type ProposerFactory = Arc<dyn Fn(&Request) -> Box<dyn Proposer> + Send + Sync>;

/// A speculating sequence's proposer and draft count.
pub(crate) struct SeqSpec {
    proposer: Box<dyn Proposer>,
    adapt: Adaptive,
}

/// The engine-wide part: finished requests for the suffix proposer, a plugged-in proposer.
#[derive(Default)]
pub(crate) struct EngineSpec {
    history: History,
    factory: Option<ProposerFactory>,
    /// Every speculative decode step's counters since the engine started.
    totals: SpecStats,
    /// Why `--speculative mtp` / `draft` cannot run on this runner (it then decodes plainly).
    model_off: Option<String>,
}

/// Sequence `id`'s draft model in the runner.
struct RunnerDraft<'a> {
    runner: &'a mut dyn Runner,
    id: SeqId,
}

impl DraftModel for RunnerDraft<'_> {
    fn run(&mut self, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        self.runner.draft(self.id, next, k, choose)
    }
}

impl EngineSpec {
    pub(crate) fn new(model_off: Option<String>) -> EngineSpec {
        EngineSpec { model_off, ..Default::default() }
    }

    /// A sequence leaves the engine: its tokens join the suffix proposer's history (kept for
    /// that method only).
    pub(crate) fn finished(&mut self, s: &Sequence, method: SpecMethod) {
        if method == SpecMethod::Suffix && self.factory.is_none() && s.spec.is_some() && !s.output.is_empty() {
            remember(&self.history, &s.req.prompt, &s.output);
        }
    }
}

impl Engine {
    /// Whether decode steps speculate: `Ok(false)` when `config.spec` is off, `Err(why)` when it
    /// is on but the runner cannot verify drafts (the engine then decodes plainly).
    pub fn speculating(&self) -> std::result::Result<bool, String> {
        if !self.config.spec.enabled() {
            return Ok(false);
        }
        if let Some(why) = &self.spec.model_off {
            return Err(why.clone());
        }
        self.runner.speculation().map(|()| true)
    }

    /// The speculation counters of every sequence since the engine started (for `/metrics`).
    pub fn spec_totals(&self) -> &SpecStats {
        &self.spec.totals
    }

    /// Uses `factory` for every later request's proposer instead of the configured method's
    /// (while `config.spec` is on). A draft model is configured instead (`--speculative mtp` /
    /// `draft`: the runner holds it); a factory may still wrap its proposer.
    pub fn set_proposer(&mut self, factory: ProposerFactory) {
        self.spec.factory = Some(factory);
    }

    /// The speculation state of a new request: none when off, unsupported, or constrained (a
    /// grammar mask is computed for one position at a time).
    pub(super) fn seq_spec(&self, req: &Request, constrained: bool) -> Option<SeqSpec> {
        if constrained || self.speculating() != Ok(true) {
            return None;
        }
        let proposer: Box<dyn Proposer> = match (&self.spec.factory, self.config.spec.method) {
            (Some(f), _) => f(req),
            (None, SpecMethod::Ngram) => Box::new(NgramProposer),
            (None, SpecMethod::Suffix) => Box::new(SuffixProposer::new(Some(self.spec.history.clone()))),
            (None, SpecMethod::Mtp | SpecMethod::Draft) => Box::new(ModelProposer::new(&req.params)),
            (None, SpecMethod::Off) => return None,
        };
        Some(SeqSpec { proposer, adapt: Adaptive::new(&self.config.spec) })
    }

    /// Runs `plan` (running index, new tokens) speculatively (see the module doc).
    pub(super) fn spec_run(&mut self, mut plan: Vec<(usize, Vec<u32>)>, limit: usize) -> Result<Vec<Event>> {
        let vocab = self.runner.config().text.vocab_size;
        let started = Instant::now(); // a decode step's time includes its drafting
                                      // Drafts for the decode entries (those past their prompt).
        let mut drafts: Vec<(usize, Draft)> = Vec::new();
        let (mut decode, mut prefill) = (Vec::new(), Vec::new());
        // Drafted rows count against the step's token budget, like the rest of the plan.
        let mut spare = self.config.max_step_tokens.saturating_sub(plan.iter().map(|p| p.1.len()).sum());
        for (i, toks) in plan.drain(..) {
            let s = &mut self.running[i];
            if s.done < s.req.prompt.len() {
                prefill.push((i, toks));
                continue;
            }
            let room = s.req.max_tokens.saturating_sub(s.output.len() + 1).min(limit.saturating_sub(s.pos + 1)).min(spare);
            let (mut d, mut q) = (Vec::new(), None);
            if let Some(sp) = &mut s.spec {
                let k = sp.adapt.next_k().min(room);
                if k > 0 {
                    let ctx: Vec<u32> = s.req.prompt.iter().chain(&s.output).copied().collect();
                    let dr = sp.proposer.propose_on(&ctx, k, &mut RunnerDraft { runner: &mut *self.runner, id: s.id })?;
                    d = dr.tokens;
                    d.truncate(k);
                    spare -= d.len();
                    q = dr.probs;
                    if q.as_ref().is_some_and(|q| q.len() < d.len() || q.iter().any(|q| q.len() != vocab)) {
                        return Err(EngineError::Internal(format!(
                            "the proposer's draft distributions do not cover its {} drafts of vocabulary {vocab}",
                            d.len()
                        )));
                    }
                    if let Some(bad) = d.iter().find(|&&t| t as usize >= vocab) {
                        return Err(EngineError::Internal(format!("the proposer drafted token {bad}, outside the vocabulary ({vocab})")));
                    }
                }
            }
            let mut t = toks;
            t.extend_from_slice(&d);
            decode.push((i, t));
            drafts.push((i, Draft { tokens: d, probs: q }));
        }
        let eos = self.runner.config().eos_token_ids.clone();
        let mut events = Vec::new();
        let mut finished = Vec::new();
        // Prefill chunks: a plain forward of their own (the prompt is computed as without
        // speculation; prefix states published as in `Engine::step`).
        if !prefill.is_empty() {
            self.plain_forward(&prefill, limit, &mut events, &mut finished)?;
        }
        if !decode.is_empty() {
            let seqs = decode.iter().map(|(i, toks)| self.step_seq(*i, toks)).collect();
            let rows: usize = decode.iter().map(|(_, t)| t.len()).sum();
            let logits = self.runner.verify(Step { seqs, last_only: false, released: Vec::new() })?;
            if logits.len() != rows * vocab {
                return Err(EngineError::Internal(format!("the runner's verify returned {} logits for {rows} rows of vocabulary {vocab}", logits.len())));
            }
            let dt = started.elapsed();
            let mut r0 = 0;
            for (i, Draft { tokens: d, probs: q }) in &drafts {
                let s = &mut self.running[*i];
                let n = d.len();
                let lgs: Vec<&[f32]> = logits[r0 * vocab..(r0 + n + 1) * vocab].chunks_exact(vocab).collect();
                r0 += n + 1;
                s.stats.decode_time += dt;
                let pos0 = s.pos;
                let (mut accepted, mut emitted, mut done) = (0, 0, false);
                for (j, lg) in lgs.iter().enumerate() {
                    let (ok, sampled, error) = if j < n {
                        let (ok, sm) = decide(&mut s.sampler, lg, &s.req.prompt, &s.output, d[j], q.as_ref().and_then(|q| q.get(j)).map(Vec::as_slice));
                        (ok, sm, None)
                    } else {
                        let (sm, e) = sample_next(s, lg);
                        (false, sm, e)
                    };
                    s.pos = pos0 + j + 1; // the tokens consumed when this one is emitted
                    let ev = push_token(s, sampled, error, self.tokenizer.as_deref(), &eos, limit, self.masks.as_ref());
                    emitted += 1;
                    done = ev.finish.is_some();
                    events.push(ev);
                    if done || !ok {
                        break;
                    }
                    accepted += 1;
                }
                s.stats.spec.record(n, accepted, emitted);
                self.spec.totals.record(n, accepted, emitted);
                if let Some(sp) = &mut s.spec {
                    sp.adapt.update(n, accepted);
                }
                if done {
                    finished.push(*i);
                } else {
                    // Keep `last` and the accepted drafts; drop the rest of the verified rows.
                    s.pos = pos0 + accepted + 1;
                    self.runner.rollback(s.id, n - accepted)?;
                }
            }
        }
        self.reap(finished);
        Ok(events)
    }
}
