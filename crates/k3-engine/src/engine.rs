//! The engine: owns the model, the tokenizer and the live sequences, and advances them with a
//! continuous-batching scheduler. Each [`Engine::step`] runs ONE batched forward pass that
//! holds a decode token for every running sequence (up to `max_batch`) plus prefill chunks of
//! waiting sequences within the step's token budget, so long prompts are prefilled in chunks
//! interleaved with decoding and never stall running streams. Sequences join and leave the
//! batch at token boundaries; a cancelled sequence's state is dropped at once.
//!
//! The forwards run on a [`Runner`] (`dist::runner`): one CPU model, the ranks of a parallel
//! layout as threads, or the GPU. The engine plans each step as a
//! [`Step`](crate::dist::runner::Step) (sequence ids and their new tokens, a prefill chunk's own
//! input rows) and samples from the logits it returns; the model state of each sequence lives in
//! the runner.
//!
//! A request with a [`Constraint`](crate::grammar::Constraint) samples only the ids its grammar
//! allows (`grammar`): the next mask is computed on a worker while the forward runs, the sampled
//! id is committed, and a grammar that is complete ends the sequence (`Stop`). A grammar failure
//! ends it with [`Event::error`] set.
//!
//! With speculative decoding on ([`EngineConfig::spec`], `crate::spec`), decode steps draft
//! tokens and verify them in one forward (`spec/engine_step.rs`). On a runner that overlaps
//! steps (a pipeline layout, [`Runner::depth`] > 1) a step per stage is in flight, each over
//! other sequences (`dist/engine_step.rs`).
//!
//! Files: this one holds the engine and a sequence's state, its constructors and [`Engine::step`];
//! `engine/request.rs` what goes in and comes out ([`Request`], [`Event`], [`FinishReason`],
//! [`SeqStats`]); `engine/schedule.rs` a request's checks, admission and each step's plan;
//! `engine/forward.rs` the plain forward and how a sampled token becomes an [`Event`] (stop,
//! length and grammar checks), shared with the speculative and pipelined steps.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use k3_model::{Config, Model};
use k3_tokenizer::Tokenizer;

use crate::dist::runner::{Runner, ThreadRunner};
use crate::error::{EngineError, Result};
use crate::gpu::GpuRunner;
use crate::grammar::{Guide, MaskPool};
use crate::prefix::{Admission, PrefixCache, PrefixConfig, PrefixStats};
use crate::sampler::{Sampled, Sampler};
use crate::spec::{SpecConfig, SpecMethod};
use crate::stop::StopMatcher;

mod forward;
#[path = "dist/engine_step.rs"]
mod pipe_step;
mod prompt_logprobs;
mod request;
mod schedule;
#[path = "spec/engine_step.rs"]
mod spec_step;
pub use request::{Event, FinishReason, Request, SeqStats};
pub use spec_step::ProposerFactory;

pub type SeqId = u64;

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
    /// Prompt log-probabilities gathered while prefilling (`params.prompt_logprobs`).
    prompt_lps: Vec<Sampled>,
}

impl Sequence {
    /// Whether it wants prompt logprobs and still has prompt to prefill: a step that holds it
    /// brings every row's logits back (`engine/prompt_logprobs.rs`).
    fn scores_prompt(&self) -> bool {
        self.req.params.prompt_logprobs.is_some() && self.done < self.req.prompt.len()
    }
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

    /// Frees a sequence's state in the runner.
    fn free(&mut self, s: Sequence) {
        self.spec.finished(&s, self.config.spec.method);
        self.runner.release(s.id);
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
