//! The one error type of k3-core. Every variant says what was wrong and, where it can, the fix.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CoreError {
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("dtype {dtype} is not supported by {op}")]
    DType { op: &'static str, dtype: String },
    #[error("device error: {0}")]
    Device(String),
    #[error("I/O error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}")]
    Msg(String),
}

pub type Result<T> = std::result::Result<T, CoreError>;
