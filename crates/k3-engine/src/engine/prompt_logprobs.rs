//! Prompt log-probabilities (`SamplingParams::prompt_logprobs`: OpenAI's `echo` with
//! `logprobs`, vLLM's `prompt_logprobs`): a step that holds a prefill chunk of such a request
//! asks the runner for every row's logits (`Step::last_only = false`), records for each row the
//! log-probability of the prompt token that follows it (with the top alternatives, from the
//! raw `log_softmax` as every reported logprob), then samples the step's last rows on the host
//! as a plain step does. Only runners that return every row outside verification
//! ([`crate::dist::runner::Runner::all_row_logits`]: the CPU ranks as threads, the one-process
//! GPU runner) take such requests; the prefix cache is bypassed for them (a resumed prefix has
//! no logits).
//!
//! While such a prefill is planned a step prefills at most 256 tokens in all (`schedule.rs`):
//! the other prefills' rows come back too.
//!
//! Shapes: the step's logits `[N, vocab]` for its N tokens, sequence after sequence; the rows
//! handed to sampling `[plan.len(), vocab]`, each entry's last row.

use std::time::Instant;

use super::{Engine, Event};
use crate::dist::runner::Step;
use crate::error::{EngineError, Result};
use crate::sampler::{log_softmax, report, SamplingParams};

impl Engine {
    /// Whether `plan` (running index, new tokens) holds a prefill chunk of a request that
    /// wants prompt logprobs.
    pub(super) fn wants_all_rows(&self, plan: &[(usize, Vec<u32>)]) -> bool {
        plan.iter().any(|(i, _)| self.running[*i].scores_prompt())
    }

    /// [`Engine::plain_forward`] with every row's logits: prompt logprobs recorded, then the
    /// last rows sampled on the host.
    pub(super) fn all_rows_forward(&mut self, plan: &[(usize, Vec<u32>)], limit: usize, events: &mut Vec<Event>, finished: &mut Vec<usize>) -> Result<()> {
        let t0 = Instant::now();
        let seqs = plan.iter().map(|(i, toks)| self.step_seq(*i, toks)).collect();
        let logits = self.runner.forward(Step { seqs, last_only: false, released: Vec::new() })?;
        let vocab = self.runner.config().text.vocab_size;
        let n: usize = plan.iter().map(|(_, t)| t.len()).sum();
        if logits.len() != n * vocab {
            return Err(EngineError::Internal(format!("the runner returned {} logits for a step of {n} rows of vocabulary {vocab}", logits.len())));
        }
        let mut last = Vec::with_capacity(plan.len() * vocab);
        let mut off = 0;
        for (i, toks) in plan {
            let rows = &logits[off * vocab..(off + toks.len()) * vocab];
            off += toks.len();
            last.extend_from_slice(&rows[(toks.len() - 1) * vocab..]);
            let s = &mut self.running[*i];
            let Some(top) = s.req.params.prompt_logprobs.filter(|_| s.scores_prompt()) else { continue };
            // Row j holds the logits after prompt token done + j: they score the next one.
            let report_params = SamplingParams { logprobs: Some(top), ..SamplingParams::greedy() };
            for (j, row) in rows.chunks_exact(vocab).enumerate() {
                if let Some(&next) = s.req.prompt.get(s.done + j + 1) {
                    s.prompt_lps.push(report(&report_params, &log_softmax(row), next));
                }
            }
        }
        let plan: Vec<(usize, usize)> = plan.iter().map(|(i, t)| (*i, t.len())).collect();
        self.take_logits(&plan, &last, t0, limit, events, finished)
    }
}
