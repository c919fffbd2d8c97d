//! k3-tokenizer (WIP)
mod bpe;
pub mod error;
pub mod json;
pub mod pretok;
pub mod stream;
pub mod tokenizer;
pub use error::{Error, Result};
pub use tokenizer::Tokenizer;
pub mod chat;
pub mod xtml;
pub mod parser;
