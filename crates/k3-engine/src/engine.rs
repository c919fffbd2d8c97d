//! The engine: owns the model, the tokenizer and the live sequences, and advances them with a
//! continuous-batching scheduler. Each [`Engine::step`] runs ONE batched forward pass that
//! holds a decode token for every running sequence (up to `max_batch`) plus prefill chunks of
//! waiting sequences within the step's token budget, so long prompts are prefilled in chunks
//! interleaved with decoding and never stall running streams. Sequences join and leave the
//! batch at token boundaries; a cancelled sequence's state is dropped at once.
//!
//! The forwards run on a [`Runner`] (`dist::runner`): one CPU model, the ranks of a parallel
//! layout as threads, or the GPU. The engine plans each step as a [`Step`] (sequence ids and
//! their new tokens, a prefill chunk's own input rows) and samples from the logits it returns;
//! the model state of each sequence lives in the runner.
//!
//! A request with a [`Constraint`] samples only the ids its grammar allows (`grammar`): the
//! next mask is computed on a worker while the forward runs, the sampled id is committed, and a
//! grammar that is complete ends the sequence (`Stop`). A grammar failure ends it with
//! [`Event::error`] set.
//!
//! With speculative decoding on ([`EngineConfig::spec`], `crate::spec`), decode steps draft
//! tokens and verify them in one forward (`spec/engine_step.rs`). On a runner that overlaps
//! steps (a pipeline layout, [`Runner::depth`] > 1) a step per stage is in flight, each over
//! other sequences (`dist/engine_step.rs`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k3_model::{Config, Model};
use k3_tokenizer::Tokenizer;
use serde::Serialize;

use crate::dist::runner::{Runner, Step, StepSeq, ThreadRunner};
use crate::error::{param, EngineError, Result};
use crate::gpu::GpuRunner;
use crate::grammar::{Constraint, Guide, GuideStats, MaskPool};
use crate::prefix::{Admission, PrefixCache, PrefixConfig, PrefixStats};
use crate::sample_rows::{self, RowSample};
use crate::sampler::{penalty_pairs, Sampled, Sampler, SamplingParams};
use crate::spec::{SpecConfig, SpecMethod, SpecStats};
use crate::stop::{StopCheck, StopMatcher};

#[path = "dist/engine_step.rs"]
mod pipe_step;
#[path = "spec/engine_step.rs"]
mod spec_step;
pub use spec_step::ProposerFactory;

pub type SeqId = u64;

/// Most mask worker threads (one mask per constrained sequence is in flight at a time).
const MASK_THREADS: usize = 4;

/// A generation request (token ids in).
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    /// Stop strings (matched on the decoded text; needs a tokenizer).
    pub stop: Vec<String>,
    /// Extra stop token ids, in addition to the model's `eos_token_id`s.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Input rows `[prompt.len(), hidden]` to use instead of the prompt's token embeddings
    /// (e.g. with projected image features spliced in at `<|media_pad|>` positions).
    pub prompt_embeds: Option<Arc<Vec<f32>>>,
    /// The grammar the output must follow (compiled by a [`crate::GrammarEnv`] of this model's
    /// vocabulary).
    pub constraint: Option<Constraint>,
}

impl Request {
    pub fn new(prompt: Vec<u32>, params: SamplingParams, max_tokens: usize) -> Self {
        Request { prompt, params, max_tokens, stop: Vec::new(), stop_token_ids: Vec::new(), ignore_eos: false, prompt_embeds: None, constraint: None }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    Cancelled,
}

/// One generated token of one sequence.
#[derive(Clone, Debug)]
pub struct Event {
    pub seq: SeqId,
    pub token: u32,
    /// Text released by this token (may be empty while UTF-8 or a possible stop string is pending).
    pub text: String,
    pub sampled: Sampled,
    /// Set on the sequence's last event.
    pub finish: Option<FinishReason>,
    /// Prompt tokens restored from the prefix cache instead of prefilled.
    pub cached_tokens: usize,
    /// The output constraint failed (its message); set with `finish`, and `token` is not part
    /// of a valid output.
    pub error: Option<String>,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most sequences decoding at once.
    pub max_batch: usize,
    /// Largest prefill chunk of one sequence per step.
    pub prefill_chunk: usize,
    /// Token budget of one step (decode tokens + prefill chunk tokens).
    pub max_step_tokens: usize,
    /// Storage of the KDA recurrent states (bf16 halves them; approximate).
    pub kda_state: k3_model::layers::kda::StateDType,
    /// The prefix cache (`crate::prefix`); `None`: off. With it, prefill is cut on its grid on
    /// the CPU (`prefill_chunk` is then unused); on the GPU chunks of up to `prefill_chunk` end
    /// at its snapshot points.
    pub prefix: Option<PrefixConfig>,
    /// Speculative decoding (`--speculative`, `--num-speculative-tokens`); off by default.
    pub spec: SpecConfig,
    /// The separate draft model of `--speculative draft` (`--draft-model`).
    pub draft: Option<crate::spec::draft::DraftSpec>,
    /// Most steps in flight at once on a runner that overlaps them (`--pipeline-depth`; the
    /// runner's depth, its pipeline stages, when `None`; 1 runs one step at a time).
    pub pipeline_depth: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_batch: 32,
            prefill_chunk: 512,
            max_step_tokens: 1024,
            kda_state: Default::default(),
            prefix: None,
            spec: Default::default(),
            draft: None,
            pipeline_depth: None,
        }
    }
}

/// Per-sequence timing, for `k3 run` / `k3 bench` and the server's metrics.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SeqStats {
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Time from admission to the first generated token.
    pub ttft: Duration,
    /// Mask cost of a constrained sequence (zero otherwise).
    pub mask: GuideStats,
    /// Prompt tokens restored from the prefix cache.
    pub cached_tokens: usize,
    /// Drafts and acceptance of the decode steps (speculative decoding).
    pub spec: SpecStats,
}

struct Sequence {
    id: SeqId,
    req: Request,
    /// Tokens the runner has consumed (its model state lives in the runner).
    pos: usize,
    /// Prompt tokens already prefilled.
    done: usize,
    output: Vec<u32>,
    sampler: Sampler,
    utf8: k3_tokenizer::stream::Utf8Stream,
    stop: StopMatcher,
    stats: SeqStats,
    admitted: Instant,
    guide: Option<Guide>,
    /// What the prefix cache found at admission.
    prefix: Admission,
    /// The proposer and draft count when this sequence speculates.
    spec: Option<spec_step::SeqSpec>,
    /// A submitted step holds it (pipelined steps): not planned again until collected.
    in_flight: bool,
}

pub struct Engine {
    /// Where the forwards run (and the model's config and embedding rows come from).
    pub runner: Box<dyn Runner>,
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub config: EngineConfig,
    running: Vec<Sequence>,
    waiting: VecDeque<Sequence>,
    finished_stats: Vec<(SeqId, SeqStats)>,
    next_id: SeqId,
    /// Mask workers, started with the first constrained request.
    masks: Option<MaskPool>,
    /// The prefix cache, when configured and the runner supports it.
    prefix: Option<PrefixCache>,
    /// Why the configured prefix cache is off (the runner cannot capture states).
    prefix_off: Option<String>,
    /// Speculative decoding's engine-wide part (request history, a plugged-in proposer).
    spec: spec_step::EngineSpec,
    /// Submitted steps not yet collected, oldest first (pipelined steps).
    flight: VecDeque<pipe_step::Flight>,
}

impl Engine {
    /// An engine over one CPU model (on the calling thread).
    pub fn new(model: Arc<Model>, tokenizer: Option<Arc<Tokenizer>>, config: EngineConfig) -> Self {
        let runner = ThreadRunner::single(model, config.kda_state);
        Self::with_runner(Box::new(runner), tokenizer, config)
    }

    /// An engine whose forwards run on `gpu`.
    pub fn with_gpu(gpu: GpuRunner, tokenizer: Option<Arc<Tokenizer>>, config: EngineConfig) -> Self {
        Self::with_runner(Box::new(gpu), tokenizer, config)
    }

    /// An engine whose forwards run on `runner` (e.g. `dist::runner::load`'s).
    pub fn with_runner(mut runner: Box<dyn Runner>, tokenizer: Option<Arc<Tokenizer>>, config: EngineConfig) -> Self {
        // `--speculative mtp` / `draft`: every sequence state carries the MTP layer's or the
        // draft model's (so prefix-cache cells hold its rows whichever request wrote them);
        // constrained requests keep it without drafting.
        let model_off = match (config.spec.method, &config.draft) {
            (SpecMethod::Mtp, _) => runner.enable_mtp().err(),
            (SpecMethod::Draft, Some(d)) => runner.enable_draft(d.model.clone()).err(),
            (SpecMethod::Draft, None) => {
                Some("--speculative draft needs --draft-model DIR (a K3-family checkpoint with the target's vocabulary); decoding without speculation".into())
            }
            _ => None,
        };
        let (prefix, prefix_off) = match (&config.prefix, runner.prefix_support()) {
            (None, _) => (None, None),
            (Some(c), Ok(layout)) => {
                let digest = format!("{:?} | {layout}", runner.config());
                let cache = match runner.exact_cuts() {
                    true => PrefixCache::new(c.clone(), &digest),
                    false => PrefixCache::with_free_cuts(c.clone(), &digest),
                };
                // A cell = one whole cache page: the pool and the sequences share it.
                runner.set_page_rows(c.grid);
                (Some(cache), None)
            }
            (Some(_), Err(why)) => (None, Some(why)),
        };
        Engine {
            runner,
            tokenizer,
            config,
            running: Vec::new(),
            waiting: VecDeque::new(),
            finished_stats: Vec::new(),
            next_id: 1,
            masks: None,
            prefix,
            prefix_off,
            spec: spec_step::EngineSpec::new(model_off),
            flight: VecDeque::new(),
        }
    }

    /// The prefix cache's counters when it is on; why it is off when it was asked for but the
    /// runner cannot capture states; `Ok(None)` when it was not asked for.
    pub fn prefix_status(&self) -> std::result::Result<Option<PrefixStats>, &str> {
        match (&self.prefix, &self.prefix_off) {
            (Some(c), _) => Ok(Some(c.stats())),
            (None, Some(why)) => Err(why),
            (None, None) => Ok(None),
        }
    }

    /// The model's config.
    pub fn model_config(&self) -> &Config {
        self.runner.config()
    }

    /// Token embeddings `[ids.len(), hidden]` (the input rows into which image features are
    /// spliced before a request with its own rows is added).
    pub fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.runner.embed(ids)
    }

    /// Tokens a sequence can reach: its prompt plus `max_tokens`, capped at the context limit.
    fn worst_case(s: &Sequence, limit: usize) -> usize {
        (s.req.prompt.len() + s.req.max_tokens).min(limit)
    }

    /// Frees a sequence's state in the runner.
    fn free(&mut self, s: Sequence) {
        self.spec.finished(&s, self.config.spec.method);
        self.runner.release(s.id);
    }

    /// Validates and queues a request; errors come before any work is done.
    pub fn add(&mut self, req: Request) -> Result<SeqId> {
        req.params.validate()?;
        let cfg = self.runner.config();
        let limit = cfg.max_context();
        if req.prompt.is_empty() {
            return Err(param("prompt", "is empty"));
        }
        if req.max_tokens == 0 {
            return Err(param("max_tokens", "must be ≥ 1"));
        }
        if req.prompt.len() >= limit {
            return Err(EngineError::Context { prompt: req.prompt.len(), extra: String::new(), limit });
        }
        let vocab = cfg.text.vocab_size as u32;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t >= vocab) {
            return Err(param("prompt", format!("token id {bad} is outside the vocabulary ({vocab})")));
        }
        if let Some(e) = &req.prompt_embeds {
            let h = cfg.text.hidden_size;
            if e.len() != req.prompt.len() * h {
                return Err(param("prompt_embeds", format!("holds {} values; the prompt needs {} × hidden_size {h}", e.len(), req.prompt.len())));
            }
        }
        let need = (req.prompt.len() + req.max_tokens).min(limit);
        if let Err(cap) = self.runner.fits(need) {
            return Err(param("max_tokens", format!("prompt ({}) + max_tokens ({}) = {need} tokens exceed the GPU cache of {cap} tokens; lower max_tokens or start the server with a larger --max-cache-tokens", req.prompt.len(), req.max_tokens)));
        }
        if !req.stop.is_empty() && self.tokenizer.is_none() {
            return Err(param("stop", "stop strings need a tokenizer; this engine has none"));
        }
        let mut guide = None;
        if let Some(c) = &req.constraint {
            if c.vocab_size() != vocab as usize {
                return Err(param("constraint", format!("was compiled for a vocabulary of {} ids; the model has {vocab}", c.vocab_size())));
            }
            let mut stops = req.stop_token_ids.clone();
            if !req.ignore_eos {
                stops.extend(&cfg.eos_token_ids);
            }
            let pool = self.masks.get_or_insert_with(|| MaskPool::new(MASK_THREADS.min(std::thread::available_parallelism().map_or(1, |n| n.get()))));
            let mut g = Guide::new(c.clone(), stops);
            g.prefetch(pool); // the first mask computes while the prompt is prefilled
            guide = Some(g);
        }
        let id = self.next_id;
        self.next_id += 1;
        let h = cfg.text.hidden_size;
        let keys = self.prefix.as_ref().map(|pc| pc.keys(&req.prompt, req.prompt_embeds.as_deref().map(Vec::as_slice), h)).unwrap_or_default();
        let seq = Sequence {
            id,
            pos: 0,
            done: 0,
            output: Vec::new(),
            sampler: Sampler::new(req.params.clone()),
            utf8: Default::default(),
            stop: StopMatcher::new(req.stop.clone()),
            stats: SeqStats { prompt_tokens: req.prompt.len(), ..Default::default() },
            admitted: Instant::now(),
            spec: self.seq_spec(&req, guide.is_some()),
            guide,
            prefix: Admission { keys, ..Default::default() },
            req,
            in_flight: false,
        };
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Drops a sequence (running or waiting) and frees its state. Returns whether it existed.
    pub fn cancel(&mut self, id: SeqId) -> bool {
        let mut gone: Vec<Sequence> = self.running.extract_if(.., |s| s.id == id).collect();
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            gone.extend(self.waiting.remove(i));
        }
        let found = !gone.is_empty();
        for s in gone {
            self.free(s);
        }
        found
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.flight.is_empty()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Bytes held by all live sequence states (as the runner last knew them): cache pages that
    /// several sequences share count once, and the prefix-cache pool's pages not at all (its
    /// `pool_bytes` counts them).
    pub fn state_bytes(&self) -> usize {
        self.runner.state_bytes()
    }
    /// The runner (inspection: `Runner::seq_state`).
    pub fn runner(&self) -> &dyn Runner {
        self.runner.as_ref()
    }
    /// Stats of sequences finished since the last call.
    pub fn take_finished_stats(&mut self) -> Vec<(SeqId, SeqStats)> {
        std::mem::take(&mut self.finished_stats)
    }

    /// Runs one batched forward pass and returns the tokens it produced (pipelined: submits
    /// one step and, once the pipeline is full, collects the oldest).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let limit = self.runner.config().max_context();
        self.admit_waiting(limit)?;
        let depth = self.pipeline_depth();
        if depth > 1 {
            return self.pipe_step(depth, limit);
        }
        if self.running.is_empty() {
            return Ok(Vec::new());
        }
        let plan = self.plan_step(usize::MAX);
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        if self.speculating() == Ok(true) {
            return self.spec_run(plan, limit);
        }
        let (mut events, mut finished) = (Vec::new(), Vec::new());
        self.plain_forward(&plan, limit, &mut events, &mut finished)?;
        self.reap(finished);
        Ok(events)
    }

    /// Admits waiting sequences while there is room (and, on the GPU, a free state slot).
    fn admit_waiting(&mut self, limit: usize) -> Result<()> {
        let mut deferred = Vec::new();
        while self.running.len() < self.config.max_batch {
            match self.waiting.pop_front() {
                Some(mut s) => {
                    if let Some(pc) = self.prefix.as_mut() {
                        // A running prefill is writing this prompt's prefix: resume from it later.
                        let prefilling = self.running.iter().enumerate().filter(|(_, r)| r.done < r.req.prompt.len()).map(|(j, r)| (j, &r.prefix, r.done));
                        if let Some((j, at)) = pc.wait_for(&s.prefix.keys, s.req.prompt.len(), prefilling) {
                            let snap_at = &mut self.running[j].prefix.snap_at;
                            if !snap_at.contains(&at) {
                                snap_at.push(at);
                            }
                            deferred.push(s);
                            continue;
                        }
                    }
                    if !self.runner.admit(s.id, Self::worst_case(&s, limit))? {
                        // The runner's room is promised to running sequences: wait, in order.
                        self.waiting.push_front(s);
                        break;
                    }
                    if let Some(pc) = self.prefix.as_mut() {
                        s.prefix = pc.admit(&mut *self.runner, s.id, s.req.prompt.len(), std::mem::take(&mut s.prefix.keys))?;
                        (s.pos, s.done, s.stats.cached_tokens) = (s.prefix.resume, s.prefix.resume, s.prefix.resume);
                    }
                    self.running.push(s)
                }
                None => break,
            }
        }
        for s in deferred.into_iter().rev() {
            self.waiting.push_front(s);
        }
        Ok(())
    }

    /// The next step's plan (running index, new tokens) over the sequences no step in flight
    /// holds: up to `max_decode` decode tokens first, then prefill chunks within the budget.
    fn plan_step(&self, max_decode: usize) -> Vec<(usize, Vec<u32>)> {
        let mut budget = self.config.max_step_tokens.max(1);
        let mut plan: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, s) in self.running.iter().enumerate().filter(|(_, s)| !s.in_flight) {
            if s.done == s.req.prompt.len() && plan.len() < max_decode {
                if let Some(&last) = s.output.last() {
                    plan.push((i, vec![last]));
                    budget = budget.saturating_sub(1);
                }
            }
        }
        for (i, s) in self.running.iter().enumerate().filter(|(_, s)| !s.in_flight) {
            let left = s.req.prompt.len() - s.done;
            if left > 0 && budget > 0 {
                let n = match &self.prefix {
                    // On the cache's grid, never cut short (so chunk ends depend on positions only).
                    Some(pc) => match pc.chunk(
                        s.done,
                        s.req.prompt.len(),
                        &s.prefix,
                        budget,
                        self.config.prefill_chunk,
                        plan.iter().any(|(j, _)| self.running[*j].done < self.running[*j].req.prompt.len()),
                    ) {
                        Some(n) => n,
                        None => continue,
                    },
                    None => left.min(self.config.prefill_chunk).min(budget),
                };
                plan.push((i, s.req.prompt[s.done..s.done + n].to_vec()));
                budget = budget.saturating_sub(n);
            }
        }
        plan
    }

    /// One plain forward of `plan` (running index, new tokens): positions advance, the prefix
    /// states it wrote are published, and every entry at the end of its prompt or decoding
    /// emits its next token into `events` (indices of finished ones into `finished`). The
    /// plain step, and the prefill part of a speculative one (`spec::engine_step`). The runner
    /// samples where the logits are (`Runner::forward_sample`): the rows to sample — draws,
    /// penalties, grammar masks — are made while its forward runs.
    pub(super) fn plain_forward(&mut self, plan: &[(usize, Vec<u32>)], limit: usize, events: &mut Vec<Event>, finished: &mut Vec<usize>) -> Result<()> {
        let t0 = Instant::now();
        // The step every rank runs: ids and new tokens, and a prefill chunk's own input rows.
        let seqs = plan.iter().map(|(i, toks)| self.step_seq(*i, toks)).collect();
        let step = Step { seqs, last_only: true, released: Vec::new() };
        let mut errors: Vec<Option<String>> = vec![None; plan.len()];
        let sampled = {
            let (running, errs) = (&mut self.running, &mut errors);
            let mut rows = || plan.iter().zip(errs.iter_mut()).map(|((i, toks), e)| row_for(&mut running[*i], toks.len(), e)).collect();
            self.runner.forward_sample(step, &mut rows)?
        };
        let plan: Vec<(usize, usize)> = plan.iter().map(|(i, t)| (*i, t.len())).collect();
        self.take_sampled(&plan, sampled, errors, t0, limit, events, finished)
    }

    /// A completed step's logits `[plan.len(), vocab]` for `plan` (running index, tokens it
    /// consumed), started at `t0`, sampled on the host (pipelined steps).
    fn take_logits(
        &mut self,
        plan: &[(usize, usize)],
        logits: &[f32],
        t0: Instant,
        limit: usize,
        events: &mut Vec<Event>,
        finished: &mut Vec<usize>,
    ) -> Result<()> {
        let vocab = self.runner.config().text.vocab_size;
        if logits.len() != plan.len() * vocab {
            return Err(EngineError::Internal(format!("the runner returned {} logits for {} sequences of vocabulary {vocab}", logits.len(), plan.len())));
        }
        let mut errors: Vec<Option<String>> = vec![None; plan.len()];
        let rows: Vec<Option<RowSample>> = plan.iter().zip(errors.iter_mut()).map(|(&(i, n), e)| row_for(&mut self.running[i], n, e)).collect();
        let sampled = sample_rows::on_host(logits, vocab, &rows);
        self.take_sampled(plan, sampled, errors, t0, limit, events, finished)
    }

    /// A completed step's sampled tokens for `plan` (running index, tokens it consumed; one
    /// entry per row, `Some` for every row that ends its prompt or decodes, `errors` the
    /// grammar's), started at `t0`: positions advance, the prefix states it wrote are
    /// published, and every entry at the end of its prompt or decoding emits its next token.
    #[allow(clippy::too_many_arguments)]
    fn take_sampled(
        &mut self,
        plan: &[(usize, usize)],
        sampled: Vec<Option<Sampled>>,
        errors: Vec<Option<String>>,
        t0: Instant,
        limit: usize,
        events: &mut Vec<Event>,
        finished: &mut Vec<usize>,
    ) -> Result<()> {
        if sampled.len() != plan.len() {
            return Err(EngineError::Internal(format!("the runner sampled {} rows for a step of {} sequences", sampled.len(), plan.len())));
        }
        for &(i, n) in plan {
            self.running[i].pos += n;
        }
        // Publish the prefix states this completed step wrote (prompt grid points only).
        if let Some(pc) = self.prefix.as_mut() {
            for &(i, _) in plan {
                let s = &self.running[i];
                if s.done < s.req.prompt.len() {
                    pc.after_step(&mut *self.runner, s.id, s.req.prompt.len(), s.pos, &s.prefix)?;
                }
            }
        }
        let dt = t0.elapsed();
        let eos = self.runner.config().eos_token_ids.clone();
        for ((&(i, n), sm), error) in plan.iter().zip(sampled).zip(errors) {
            let s = &mut self.running[i];
            if s.done < s.req.prompt.len() {
                s.done += n;
                s.stats.prefill_time += dt;
                if s.done < s.req.prompt.len() {
                    continue; // more prompt to go: no token yet
                }
            } else {
                s.stats.decode_time += dt;
            }
            let sampled = sm.ok_or_else(|| EngineError::Internal(format!("the runner sampled no token for sequence {}", s.id)))?;
            let ev = push_token(s, sampled, error, self.tokenizer.as_deref(), &eos, limit, self.masks.as_ref());
            if ev.finish.is_some() {
                finished.push(i);
            }
            events.push(ev);
        }
        Ok(())
    }

    /// Running sequence `i`'s entry of a step with its new tokens `toks`, and a prefill
    /// chunk's own input rows.
    fn step_seq(&self, i: usize, toks: &[u32]) -> StepSeq {
        let h = self.runner.config().text.hidden_size;
        let s = &self.running[i];
        let rows = match (&s.req.prompt_embeds, s.done < s.req.prompt.len()) {
            (Some(e), true) => Some(e[s.done * h..(s.done + toks.len()) * h].to_vec()),
            _ => None,
        };
        StepSeq { id: s.id, tokens: toks.to_vec(), rows }
    }

    /// Removes the finished running sequences (indices into `running`) and frees them.
    fn reap(&mut self, mut finished: Vec<usize>) {
        finished.sort_unstable();
        finished.dedup();
        for i in finished.into_iter().rev() {
            let mut s = self.running.remove(i);
            self.finished_stats.push((s.id, std::mem::take(&mut s.stats)));
            self.free(s);
        }
    }

    /// Runs one request to completion, calling `on_event` per token. Returns the output
    /// tokens, the finish reason and the timing.
    pub fn generate(&mut self, req: Request, on_event: impl FnMut(&Event)) -> Result<(Vec<u32>, FinishReason, SeqStats)> {
        self.generate_with_progress(req, on_event, |_, _| {})
    }

    /// [`Engine::generate`] that also reports the prefill's progress after every step that
    /// prefilled part of the prompt: `on_prefill(tokens done, prompt tokens)`.
    pub fn generate_with_progress(
        &mut self,
        req: Request,
        mut on_event: impl FnMut(&Event),
        mut on_prefill: impl FnMut(usize, usize),
    ) -> Result<(Vec<u32>, FinishReason, SeqStats)> {
        let id = self.add(req)?;
        let mut out = Vec::new();
        loop {
            let evs = self.step()?;
            if let Some(s) = self.running.iter().find(|s| s.id == id) {
                on_prefill(s.done, s.req.prompt.len());
            }
            if evs.is_empty() && !self.has_work() {
                return Err(EngineError::UnknownSeq(id));
            }
            for e in evs.iter().filter(|e| e.seq == id) {
                if let Some(msg) = &e.error {
                    return Err(EngineError::Grammar(msg.clone()));
                }
                on_event(e);
                out.push(e.token);
                if let Some(f) = e.finish {
                    let stats = self.finished_stats.iter().rev().find(|(i, _)| *i == id).map(|(_, s)| s.clone()).unwrap_or_default();
                    return Ok((out, f, stats));
                }
            }
        }
    }
}

/// Samples `s`'s next token from `lg` on the host, through its grammar's mask when it has one;
/// the grammar's error when the mask failed (the token is then sampled unmasked).
fn sample_next(s: &mut Sequence, lg: &[f32]) -> (Sampled, Option<String>) {
    let mut error = None;
    let sampled = row(s, &mut error).on_host(lg);
    (sampled, error)
}

/// What sequence `s` samples after a step that gives it `n` more tokens: its [`row`] when the
/// step ends its prompt or decodes, `None` mid-prompt.
fn row_for(s: &mut Sequence, n: usize, error: &mut Option<String>) -> Option<RowSample> {
    (s.done + n >= s.req.prompt.len()).then(|| row(s, error))
}

/// `s`'s next token's sampling inputs (its draw is consumed here); `error` gets the grammar's
/// error when the mask failed (the token is then sampled unmasked).
fn row(s: &mut Sequence, error: &mut Option<String>) -> RowSample {
    let allowed = match &mut s.guide {
        None => None,
        Some(g) => match g.mask() {
            Ok(m) => Some(m.words().to_vec()),
            Err(e) => {
                *error = Some(e);
                None
            }
        },
    };
    let u = s.sampler.draw();
    let pairs = penalty_pairs(&s.sampler.params, &s.req.prompt, &s.output);
    RowSample { params: s.sampler.params.clone(), u, pairs, allowed }
}

/// Appends `sampled` to `s`'s output and makes its event: the text it releases, and whether it
/// ends the sequence (a stop token or string, a complete grammar, `max_tokens`, the context
/// limit `limit` for `s.pos` consumed tokens; a grammar `error`). The caller finishes the
/// sequence when the event's `finish` is set.
fn push_token(
    s: &mut Sequence,
    sampled: Sampled,
    mut error: Option<String>,
    tokenizer: Option<&Tokenizer>,
    eos: &[u32],
    limit: usize,
    masks: Option<&MaskPool>,
) -> Event {
    let tok = sampled.token;
    if s.output.is_empty() {
        s.stats.ttft = s.admitted.elapsed();
    }
    s.output.push(tok);
    s.stats.output_tokens += 1;
    let is_stop_tok = (!s.req.ignore_eos && eos.contains(&tok)) || s.req.stop_token_ids.contains(&tok);
    // Commit to the grammar (a stop id ends the sequence and is not part of it).
    let mut grammar_done = false;
    if let (Some(g), None, false) = (&mut s.guide, &error, is_stop_tok) {
        match g.commit(tok) {
            Ok(done) => grammar_done = done,
            Err(e) => error = Some(e),
        }
    }
    if let Some(e) = error {
        s.stats.mask = s.guide.as_ref().map(|g| g.stats.clone()).unwrap_or_default();
        return Event {
            seq: s.id,
            token: tok,
            text: String::new(),
            sampled,
            finish: Some(FinishReason::Stop),
            error: Some(e),
            cached_tokens: s.stats.cached_tokens,
        };
    }
    let mut text = String::new();
    let mut finish = None;
    if let Some(tk) = tokenizer {
        if !is_stop_tok && !tk.skips_on_decode(tok) {
            let piece = tk.token_bytes(tok).unwrap_or_default();
            match s.stop.push(&s.utf8.push(piece)) {
                StopCheck::Continue(t) => text = t,
                StopCheck::Stopped(t) => {
                    text = t;
                    finish = Some(FinishReason::Stop);
                }
            }
        }
    }
    if finish.is_none() {
        if is_stop_tok || grammar_done {
            finish = Some(FinishReason::Stop);
        } else if s.output.len() >= s.req.max_tokens || s.pos + 1 >= limit {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() && tokenizer.is_some() {
            let tail = s.utf8.finish();
            if let StopCheck::Stopped(t) = s.stop.push(&tail) {
                text.push_str(&t);
            } else {
                text.push_str(&s.stop.flush());
            }
        }
    }
    if let Some(g) = &mut s.guide {
        if finish.is_some() {
            s.stats.mask = g.stats.clone();
        } else if let Some(pool) = masks {
            g.prefetch(pool); // computes while the next forward runs
        }
    }
    Event { seq: s.id, token: tok, text, sampled, finish, error: None, cached_tokens: s.stats.cached_tokens }
}
