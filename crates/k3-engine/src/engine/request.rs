//! What goes into the engine and what comes out: a generation [`Request`] (token ids, sampling
//! parameters, stops, optional input rows and grammar), the [`Event`] of each generated token
//! with its [`FinishReason`], and a finished sequence's [`SeqStats`]. Re-exported from
//! [`crate::engine`] (and the crate root), where the engine that consumes them lives.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::SeqId;
use crate::grammar::{Constraint, GuideStats};
use crate::sampler::{Sampled, SamplingParams};
use crate::spec::SpecStats;

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
    /// On the first event of a request with `params.prompt_logprobs`: prompt tokens 1.. each
    /// with its log-probability (and top alternatives) given the tokens before it (the first
    /// prompt token has none); `None` otherwise.
    pub prompt_logprobs: Option<Vec<Sampled>>,
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
