//! One plain forward of a planned step and what comes out of it: the rows each sequence samples
//! (its draw, penalties and grammar mask), then, per sampled token, positions advance, the
//! prefix states the step wrote are published, and [`push_token`] turns the token into an
//! [`Event`] — the text it releases and whether it ends the sequence (a stop token or string, a
//! complete grammar, `max_tokens`, the context limit, a grammar error). The speculative step
//! (`spec/engine_step.rs`) and the pipelined one (`dist/engine_step.rs`) use the same pieces.
//!
//! Shapes: a step's logits are `[plan.len(), vocab]`, one row per planned sequence.

use std::time::Instant;

use k3_tokenizer::Tokenizer;

use super::{Engine, Event, FinishReason, Sequence};
use crate::dist::runner::{Step, StepSeq};
use crate::error::{EngineError, Result};
use crate::grammar::MaskPool;
use crate::sample_rows::{self, RowSample};
use crate::sampler::{penalty_pairs, Sampled};
use crate::stop::StopCheck;

impl Engine {
    /// One plain forward of `plan` (running index, new tokens): positions advance, the prefix
    /// states it wrote are published, and every entry at the end of its prompt or decoding
    /// emits its next token into `events` (indices of finished ones into `finished`). The
    /// plain step, and the prefill part of a speculative one (`spec::engine_step`). The runner
    /// samples where the logits are (`Runner::forward_sample`): the rows to sample — draws,
    /// penalties, grammar masks — are made while its forward runs.
    pub(super) fn plain_forward(&mut self, plan: &[(usize, Vec<u32>)], limit: usize, events: &mut Vec<Event>, finished: &mut Vec<usize>) -> Result<()> {
        if self.wants_all_rows(plan) {
            return self.all_rows_forward(plan, limit, events, finished);
        }
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
    pub(super) fn take_logits(
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
    pub(super) fn step_seq(&self, i: usize, toks: &[u32]) -> StepSeq {
        let h = self.runner.config().text.hidden_size;
        let s = &self.running[i];
        let rows = match (&s.req.prompt_embeds, s.done < s.req.prompt.len()) {
            (Some(e), true) => Some(e[s.done * h..(s.done + toks.len()) * h].to_vec()),
            _ => None,
        };
        StepSeq { id: s.id, tokens: toks.to_vec(), rows }
    }

    /// Removes the finished running sequences (indices into `running`) and frees them.
    pub(super) fn reap(&mut self, mut finished: Vec<usize>) {
        finished.sort_unstable();
        finished.dedup();
        for i in finished.into_iter().rev() {
            let mut s = self.running.remove(i);
            self.finished_stats.push((s.id, std::mem::take(&mut s.stats)));
            self.free(s);
        }
    }
}

/// Samples `s`'s next token from `lg` on the host, through its grammar's mask when it has one;
/// the grammar's error when the mask failed (the token is then sampled unmasked).
pub(super) fn sample_next(s: &mut Sequence, lg: &[f32]) -> (Sampled, Option<String>) {
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
pub(super) fn push_token(
    s: &mut Sequence,
    sampled: Sampled,
    mut error: Option<String>,
    tokenizer: Option<&Tokenizer>,
    eos: &[u32],
    limit: usize,
    masks: Option<&MaskPool>,
) -> Event {
    let tok = sampled.token;
    let mut prompt_logprobs = None;
    if s.output.is_empty() {
        s.stats.ttft = s.admitted.elapsed();
        if s.req.params.prompt_logprobs.is_some() {
            prompt_logprobs = Some(std::mem::take(&mut s.prompt_lps));
        }
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
            prompt_logprobs,
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
    Event { seq: s.id, token: tok, text, sampled, finish, error: None, cached_tokens: s.stats.cached_tokens, prompt_logprobs }
}
