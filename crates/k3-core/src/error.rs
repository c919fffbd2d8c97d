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
    /// No usable CUDA driver or GPU on this machine (library absent, no device, driver too
    /// old). Callers fall back to the CPU or skip; every other CUDA failure is `Device`.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A collective, point-to-point transfer or rendezvous failed: a peer rank died, timed out
    /// or disagreed. `op` names the call (`all_reduce_sum`, `rendezvous`, …), `msg` which rank and why.
    #[error("{op}: {msg}")]
    Comm { op: &'static str, msg: String },
}

pub type Result<T> = std::result::Result<T, CoreError>;
