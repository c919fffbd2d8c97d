//! What the scheduler thread drives: the [`Backend`] trait, implemented by the real
//! [`k3_engine::Engine`] and by [`Scripted`], an engine double that emits given token ids.
//!
//! The scripted backend exists so that the XTML → `reasoning_content` / `tool_calls` path can be
//! tested end to end through HTTP with outputs a random-weight model would never produce. It
//! batches like the engine (one token per running sequence per [`Backend::step`]), honours
//! `max_tokens`, stop token ids and cancellation, and can be slowed down per step to exercise
//! queueing, back-pressure and client disconnects.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use k3_engine::{Engine, EngineError, Event, FinishReason, PrefixStats, Request, Sampled, SeqId};
use k3_tokenizer::{StreamDecoder, Tokenizer};

/// A continuous-batching generator, as the scheduler thread sees it.
pub trait Backend: Send + 'static {
    /// Validates and queues a request.
    fn add(&mut self, req: Request) -> Result<SeqId, EngineError>;
    /// One batched step; returns the tokens it produced.
    fn step(&mut self) -> Result<Vec<Event>, EngineError>;
    /// Drops a sequence and frees its state.
    fn cancel(&mut self, id: SeqId) -> bool;
    fn num_running(&self) -> usize;
    fn num_waiting(&self) -> usize;
    /// Bytes held by all live sequence states.
    fn state_bytes(&self) -> usize;
    /// The model's context limit in tokens.
    fn max_context(&self) -> usize;
    /// The model's vocabulary size (prompt ids must be below it).
    fn vocab_size(&self) -> usize;
    /// The input rows `[ids.len(), hidden]` of `ids` (the token embeddings), into which image
    /// features are spliced before a request with images is added. Backends without an
    /// embedding table refuse.
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        let _ = ids;
        Err(EngineError::Param {
            param: "messages",
            msg: "this backend cannot take image or video inputs: it has no token embeddings to splice their features into".into(),
        })
    }
    /// Speculative decoding's counters so far (none without it).
    fn spec_stats(&self) -> k3_engine::SpecStats {
        Default::default()
    }
    /// The prefix cache's counters, when it is on.
    fn prefix_stats(&self) -> Option<PrefixStats> {
        None
    }
    /// The expert cache's counters, when routed experts are read from disk.
    fn expert_cache_stats(&self) -> Option<k3_model::offload::CacheStats> {
        None
    }
}

impl Backend for Engine {
    fn add(&mut self, req: Request) -> Result<SeqId, EngineError> {
        Engine::add(self, req)
    }
    fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let ev = Engine::step(self);
        self.take_finished_stats(); // the server keeps its own timing; don't let these pile up
        ev
    }
    fn cancel(&mut self, id: SeqId) -> bool {
        Engine::cancel(self, id)
    }
    fn num_running(&self) -> usize {
        Engine::num_running(self)
    }
    fn num_waiting(&self) -> usize {
        Engine::num_waiting(self)
    }
    fn state_bytes(&self) -> usize {
        Engine::state_bytes(self)
    }
    fn max_context(&self) -> usize {
        self.model_config().max_context()
    }
    fn vocab_size(&self) -> usize {
        self.model_config().text.vocab_size
    }
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>, EngineError> {
        Engine::embed(self, ids)
    }
    fn spec_stats(&self) -> k3_engine::SpecStats {
        self.spec_totals().clone()
    }
    fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix_status().ok().flatten()
    }
    fn expert_cache_stats(&self) -> Option<k3_model::offload::CacheStats> {
        self.runner.expert_cache_stats()
    }
}

/// Chooses the output ids of a scripted request from its prompt ids.
pub type Script = Box<dyn Fn(&[u32]) -> Vec<u32> + Send>;

struct ScriptedSeq {
    id: SeqId,
    out: Vec<u32>,
    pos: usize,
    req: Request,
}

/// An engine double: each request emits the ids its [`Script`] returns, one per step.
pub struct Scripted {
    tok: Arc<Tokenizer>,
    script: Script,
    running: Vec<ScriptedSeq>,
    waiting: VecDeque<ScriptedSeq>,
    next_id: SeqId,
    /// Most sequences stepped at once.
    pub max_batch: usize,
    /// Sleep per step (to make streams slow enough to cancel or overflow).
    pub step_delay: Duration,
    /// Context limit reported to the server.
    pub max_context: usize,
    /// Bytes of "state" each live sequence holds (reported by `state_bytes`).
    pub bytes_per_seq: usize,
}

impl Scripted {
    pub fn new(tok: Arc<Tokenizer>, script: Script) -> Self {
        Scripted {
            tok,
            script,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 1,
            max_batch: 8,
            step_delay: Duration::ZERO,
            max_context: 4096,
            bytes_per_seq: 1 << 20,
        }
    }
}

impl Backend for Scripted {
    fn add(&mut self, req: Request) -> Result<SeqId, EngineError> {
        req.params.validate()?;
        if req.prompt.is_empty() {
            return Err(EngineError::Param { param: "prompt", msg: "is empty".into() });
        }
        if req.params.prompt_logprobs.is_some() {
            return Err(EngineError::Param { param: "prompt_logprobs", msg: "the scripted engine scores no prompts".into() });
        }
        if req.prompt.len() >= self.max_context {
            return Err(EngineError::Context { prompt: req.prompt.len(), extra: String::new(), limit: self.max_context });
        }
        let out = (self.script)(&req.prompt);
        if out.is_empty() {
            return Err(EngineError::Param { param: "prompt", msg: "the script has no output for this prompt".into() });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(ScriptedSeq { id, out, pos: 0, req });
        Ok(id)
    }

    fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        while self.running.len() < self.max_batch.max(1) {
            match self.waiting.pop_front() {
                Some(s) => self.running.push(s),
                None => break,
            }
        }
        if !self.step_delay.is_zero() && !self.running.is_empty() {
            std::thread::sleep(self.step_delay);
        }
        let mut events = Vec::new();
        for s in &mut self.running {
            let Some(&token) = s.out.get(s.pos) else {
                continue;
            };
            s.pos += 1;
            let is_stop = s.req.stop_token_ids.contains(&token);
            let finish = if is_stop || s.pos == s.out.len() {
                Some(FinishReason::Stop)
            } else if s.pos >= s.req.max_tokens {
                Some(FinishReason::Length)
            } else {
                None
            };
            let text = if is_stop {
                String::new()
            } else {
                let mut d = StreamDecoder::new(&self.tok, true);
                let mut t = d.push(token).unwrap_or_default();
                t.push_str(&d.finish());
                t
            };
            let sampled = Sampled { token, logprob: -0.25, top_logprobs: Vec::new() };
            if finish.is_some() {
                s.pos = s.out.len();
            }
            events.push(Event { seq: s.id, token, text, sampled, finish, error: None, cached_tokens: 0, prompt_logprobs: None });
        }
        self.running.retain(|s| s.pos < s.out.len());
        Ok(events)
    }

    fn cancel(&mut self, id: SeqId) -> bool {
        let before = self.running.len() + self.waiting.len();
        self.running.retain(|s| s.id != id);
        self.waiting.retain(|s| s.id != id);
        before != self.running.len() + self.waiting.len()
    }
    fn num_running(&self) -> usize {
        self.running.len()
    }
    fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    fn state_bytes(&self) -> usize {
        (self.running.len() + self.waiting.len()) * self.bytes_per_seq
    }
    fn max_context(&self) -> usize {
        self.max_context
    }
    fn vocab_size(&self) -> usize {
        self.tok.vocab_size()
    }
}
