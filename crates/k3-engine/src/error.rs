//! The one error type of k3-engine. Request errors name the offending parameter.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    /// A request parameter is out of range or inconsistent; `param` is its API name.
    #[error("invalid request parameter `{param}`: {msg}")]
    Param { param: &'static str, msg: String },
    #[error("prompt of {prompt} tokens{extra} exceeds the context limit of {limit} tokens")]
    Context { prompt: usize, extra: String, limit: usize },
    #[error("{0}")]
    Unsupported(String),
    /// An output constraint (grammar) that failed while generating.
    #[error("output constraint: {0}")]
    Grammar(String),
    #[error("unknown sequence id {0}")]
    UnknownSeq(u64),
    /// A per-step message (`dist::step`) that does not parse.
    #[error("step message: {0}")]
    Step(String),
    /// A rank of a parallel layout failed (its own error, not a peer's abort).
    #[error("rank {rank} failed: {msg}")]
    Rank { rank: usize, msg: String },
    /// Starting or joining a multi-process world (`dist::launch`): names the flag, variable or
    /// rank at fault.
    #[error("launch: {0}")]
    Launch(String),
    /// A fault inside the engine (a sequence planned twice, a runner that returned the wrong
    /// number of logits): a bug, not something the client sent.
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Model(#[from] k3_model::ModelError),
    #[error(transparent)]
    Tokenizer(#[from] k3_tokenizer::Error),
}

pub type Result<T> = std::result::Result<T, EngineError>;

pub(crate) fn param(param: &'static str, msg: impl Into<String>) -> EngineError {
    EngineError::Param { param, msg: msg.into() }
}
