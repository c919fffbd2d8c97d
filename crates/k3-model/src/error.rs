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
    #[error("input: {0}")]
    Input(String),
    #[error(transparent)]
    Core(#[from] k3_core::CoreError),
}

pub type Result<T> = std::result::Result<T, ModelError>;

pub(crate) fn field(field: &str, msg: impl Into<String>) -> ModelError {
    ModelError::Field { field: field.to_string(), msg: msg.into() }
}
