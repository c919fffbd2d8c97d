//! Kimi K3 tokenizer, XTML chat format and output parsing (spec `around-backbone.md` §6–§7).
//!
//! No tensor code lives here. The pieces, one per module:
//! - [`tokenizer`]: loads `tiktoken.model` + `tokenizer_config.json`; tiktoken rank-BPE
//!   ([`bpe`] internally) after the Kimi pre-split and `pat_str` ([`pretok`]); encode with special
//!   names as plain text or recognised; decode with or without skipping specials.
//! - [`stream`]: incremental detokenisation that never emits broken UTF-8.
//! - [`chat`]: the OpenAI-style request and how its renderer options resolve.
//! - [`xtml`]: the prompt renderer (Moonshot `encoding_k3` semantics, segment by segment).
//! - [`parser`]: streaming and one-shot output parsing into reasoning, content and tool calls.
//! - [`json`]: an order-preserving JSON value with Python-compatible `json.dumps`.
//! - [`cli`]: the `k3 tokenize | detokenize | render-chat | parse-output` commands.
//!
//! # API used by the `k3` binary and the server
//!
//! ```text
//! Tokenizer::from_dir(dir: &Path) -> Result<Tokenizer>
//! Tokenizer::encode(&self, text: &str, allow_special: bool) -> Vec<u32>
//! Tokenizer::decode(&self, ids: &[u32], skip_special: bool) -> Result<String>
//! Tokenizer::special_id(&self, name: &str) -> Option<u32>
//! Tokenizer::vocab_size(&self) -> usize
//! StreamDecoder::new(&Tokenizer, skip_special: bool); .push(id) -> Result<String>; .finish() -> String
//! ChatRequest::from_json_str(&str) -> Result<ChatRequest>   (also impl serde::Deserialize)
//! render_chat(&Tokenizer, &ChatRequest) -> Result<Rendered { text, ids, segments }>
//! parse_output(&Tokenizer, ids: &[u32], thinking: bool, tools_declared: bool) -> ParsedOutput
//! OutputParser::new(&Tokenizer, thinking, tools_declared); .push(id) -> Vec<OutputDelta>; .finish()
//! cli::{run_tokenize, run_detokenize, run_render_chat, run_parse_output}(&Args) -> Result<serde_json::Value>
//! ```
//!
//! ```no_run
//! use k3_tokenizer::{parse_output, render_chat, ChatRequest, Tokenizer};
//! # fn main() -> k3_tokenizer::Result<()> {
//! let tok = Tokenizer::from_dir(std::path::Path::new("/models/kimi-k3"))?;
//! let req = ChatRequest::from_json_str(r#"{"messages": [{"role": "user", "content": "Hi"}]}"#)?;
//! let prompt = render_chat(&tok, &req)?;
//! let stop = tok.special_id("<|end_of_msg|>");
//! # let generated: Vec<u32> = vec![];
//! let out = parse_output(&tok, &generated, req.options()?.thinking, req.tools_declared());
//! # let _ = (prompt, stop, out); Ok(()) }
//! ```

mod bpe;
pub mod chat;
pub mod cli;
pub mod error;
pub mod json;
pub mod parser;
pub mod pretok;
pub mod stream;
pub mod tokenizer;
pub mod xtml;

pub use chat::{ChatRequest, RenderOptions};
pub use error::{Error, Result};
pub use parser::{parse_output, OutputDelta, OutputParser, ParsedOutput, ToolCall};
pub use stream::{StreamDecoder, Utf8Stream};
pub use tokenizer::Tokenizer;
pub use xtml::{image_prompt, render_chat, Rendered, Segment};
