//! The scheduler's side of the engine: [`Engine::add`] checks a request (every error before any
//! work is done) and queues it; each step first admits waiting sequences while the batch and
//! the runner have room (a prompt whose prefix a running prefill is writing waits for it), then
//! plans the step: decode tokens of the running sequences first, then prefill chunks within the
//! step's token budget (on the prefix cache's grid when it is on).
//!
//! A plan is a list of (index into `running`, new tokens).

use std::time::Instant;

use super::{Engine, Request, SeqId, SeqStats, Sequence};
use crate::error::{param, EngineError, Result};
use crate::grammar::{Guide, MaskPool};
use crate::prefix::Admission;
use crate::sampler::Sampler;
use crate::stop::StopMatcher;

/// Most mask worker threads (one mask per constrained sequence is in flight at a time).
const MASK_THREADS: usize = 4;

/// The most prompt tokens a step prefills while it holds a prefill of a request that wants
/// prompt logprobs (every row's logits `[vocab]` come back: 256 × 163,840 f32 = 168 MB for K3).
const PROMPT_LOGPROBS_ROWS: usize = 256;

impl Engine {
    /// Tokens a sequence can reach: its prompt plus `max_tokens`, capped at the context limit.
    fn worst_case(s: &Sequence, limit: usize) -> usize {
        (s.req.prompt.len() + s.req.max_tokens).min(limit)
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
        if let Some(&(bad, _)) = req.params.logit_bias.iter().find(|&&(t, _)| t >= vocab) {
            return Err(param("logit_bias", format!("token id {bad} is outside the vocabulary ({vocab})")));
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
        if req.params.prompt_logprobs.is_some() && (!self.runner.all_row_logits() || self.pipeline_depth() > 1) {
            return Err(param(
                "prompt_logprobs",
                "prompt logprobs (`echo` with `logprobs`) need every prompt row's logits, and this backend returns the last row's only: use the CPU backend or one GPU process, without pipelined stages",
            ));
        }
        // A request scoring its prompt needs every prompt row computed: no prefix-cache keys.
        let keys = match (&self.prefix, req.params.prompt_logprobs) {
            (Some(pc), None) => pc.keys(&req.prompt, req.prompt_embeds.as_deref().map(Vec::as_slice), h),
            _ => Vec::new(),
        };
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
            prompt_lps: Vec::new(),
        };
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Admits waiting sequences while there is room (and, on the GPU, a free state slot).
    pub(super) fn admit_waiting(&mut self, limit: usize) -> Result<()> {
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
                    let Some(hit) = self.reserve(&s, limit)? else {
                        // The runner's room is promised to running sequences: wait, in order.
                        self.waiting.push_front(s);
                        break;
                    };
                    if let Some(pc) = self.prefix.as_mut() {
                        let adm = pc.admit(&mut *self.runner, s.id, s.req.prompt.len(), std::mem::take(&mut s.prefix.keys));
                        let adm = adm.and_then(|a| match a.resume == hit {
                            true => Ok(a),
                            false => Err(EngineError::Internal(format!("sequence {} was reserved room to resume at {hit} but resumed at {}", s.id, a.resume))),
                        });
                        // A failed resume fails the step and drops the request: its admission
                        // (the runner's state, its promised pages) goes back with it.
                        s.prefix = match adm {
                            Ok(a) => a,
                            Err(e) => {
                                self.runner.release(s.id);
                                return Err(e);
                            }
                        };
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

    /// Reserves the runner's room for `s`, its worst case less the tokens it will resume past
    /// (the prefix cache's, held by reference): the resume point, or `None` while there is no
    /// room. Where the prefix cache's device pages (GPU) take room that evicting them would
    /// give, the cache gives cells back one at a time: first those `s` does not resume from, then
    /// those too (its resume point then moves back). Room that running sequences hold is waited
    /// for, without evicting anything.
    fn reserve(&mut self, s: &Sequence, limit: usize) -> Result<Option<usize>> {
        let tokens = Self::worst_case(s, limit);
        loop {
            let hit = self.prefix.as_ref().map_or(0, |pc| pc.hit(&s.prefix.keys, s.req.prompt.len()));
            if self.runner.admit(s.id, tokens, hit)? {
                return Ok(Some(hit));
            }
            let Some(pc) = self.prefix.as_mut() else { return Ok(None) };
            if !self.runner.admits_after_eviction(tokens, hit) || !(pc.evict_for_room(&s.prefix.keys, hit) || pc.evict_for_room(&s.prefix.keys, 0)) {
                return Ok(None);
            }
        }
    }

    /// The next step's plan (running index, new tokens) over the sequences no step in flight
    /// holds: up to `max_decode` decode tokens first, then prefill chunks within the budget.
    pub(super) fn plan_step(&self, max_decode: usize) -> Vec<(usize, Vec<u32>)> {
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
        // A step that scores a prompt brings every row's logits back (`prompt_logprobs.rs`),
        // its other prefills' rows too: bound its prefill rows.
        if self.running.iter().any(|s| !s.in_flight && s.scores_prompt()) {
            budget = budget.min(PROMPT_LOGPROBS_ROWS);
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
}
