//! The one error type of k3-model. Messages name the file, field or tensor and say the fix.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("{path}: {msg}")]
    Config { path: String, msg: String },
    #[error("config field `{field}`: {msg}")]
    Field { field: String, msg: String },
    #[error("checkpoint {path}: {msg}")]
    Checkpoint { path: String, msg: String },
    #[error("tensor `{name}`: {msg}")]
    Tensor { name: String, msg: String },
    #[error("I/O error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
    /// The caller's input is invalid (a token outside the vocabulary, too many tokens for the
    /// context, a bad parallel layout): fix the input.
    #[error("input: {0}")]
    Input(String),
    /// A resource sized at load time is exhausted (every sequence slot in use, the GPU cache
    /// full): nothing is wrong with the input, and the call can succeed once sequences finish.
    #[error("capacity: {0}")]
    Capacity(String),
    /// A fault inside k3 (a broken invariant between its own parts, a rank that sent malformed
    /// data, a panicked thread): a bug, not something the caller sent.
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Core(#[from] k3_core::CoreError),
}

pub type Result<T> = std::result::Result<T, ModelError>;

pub(crate) fn field(field: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Field { field: field.to_string(), msg: msg.into() }
}
