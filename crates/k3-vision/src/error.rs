//! The one error type of k3-vision (around-backbone §3–§4). Every variant names the culprit:
//! the image file, the config file and field, the tensor, or the prompt position.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum VisionError {
    /// A bad image: unreadable, corrupt, zero-sized, enormous or of an unsupported format.
    #[error("image {path}: {msg}")]
    Image { path: String, msg: String },
    /// `preprocessor_config.json` (or the `vision_config` of `config.json`) is missing or wrong.
    #[error("{path}: {msg}")]
    Config { path: String, msg: String },
    /// A vision weight is missing or has the wrong shape.
    #[error("vision tensor `{name}`: {msg}")]
    Weight { name: String, msg: String },
    /// Token ids and image features do not line up (pad counts, widths).
    #[error("image splice: {0}")]
    Splice(String),
    /// Bad input to a stage (grid, pixel count, shapes).
    #[error("vision input: {0}")]
    Input(String),
    #[error("I/O error on {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error(transparent)]
    Model(#[from] k3_model::ModelError),
    #[error(transparent)]
    Core(#[from] k3_core::CoreError),
}

pub type Result<T> = std::result::Result<T, VisionError>;

pub(crate) fn input(msg: impl Into<String>) -> VisionError {
    VisionError::Input(msg.into())
}
