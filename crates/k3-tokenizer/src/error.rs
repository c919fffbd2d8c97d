//! The crate's single error type.
//!
//! Every fallible public function returns [`Result`]. Messages name the file, the line, the
//! request field or the token id that caused the problem, so that a CLI user can act on them
//! without reading source code. Nothing on a user-reachable path panics.

use std::path::PathBuf;

/// Errors from loading a tokenizer, encoding or decoding, rendering a chat request, and the CLI.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A line of `tiktoken.model` is not `base64(token_bytes) rank`.
    #[error("{path}:{line}: {reason}")]
    BadModelLine {
        /// The `tiktoken.model` path.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// The vocabulary as a whole is unusable (missing byte tokens, gaps in the ranks, ...).
    #[error("{path}: {reason}")]
    BadVocab {
        /// The offending file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// `tokenizer_config.json` is not valid or has an unexpected shape.
    #[error("{path}: {reason}")]
    BadConfig {
        /// The offending file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A token id outside the vocabulary was given to the decoder.
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownId {
        /// The id.
        id: u32,
        /// The vocabulary size (ranks + special block).
        vocab_size: usize,
    },
    /// A chat request is invalid; `field` names the request field at fault.
    #[error("invalid chat request: `{field}`: {reason}")]
    InvalidRequest {
        /// Dotted path of the request field, e.g. `messages[2].role`.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The tokenizer lacks a special token the chat format needs.
    #[error("the tokenizer has no special token {0} (is this a Kimi K3 tokenizer?)")]
    MissingSpecial(String),
    /// Invalid command-line input (bad `--ids` list, unreadable `--file`, ...).
    #[error("{0}")]
    Cli(String),
}

/// Shorthand for `std::result::Result<T, Error>`.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Builds an [`Error::InvalidRequest`].
    pub(crate) fn request(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::InvalidRequest { field: field.into(), reason: reason.into() }
    }
}
