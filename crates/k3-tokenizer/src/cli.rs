//! Command logic for `k3 tokenize`, `k3 detokenize`, `k3 render-chat` and `k3 parse-output` (issue 6).
//!
//! Each command is a `clap::Args` struct plus a `run_*` function that returns the JSON object to
//! print on stdout; the `k3` binary only has to flatten the struct into a subcommand, call the
//! function and print the value (exiting non-zero with the error's message on `Err`).
//! `--tokenizer DIR` names the directory holding `tiktoken.model` and `tokenizer_config.json`;
//! when it is omitted, `$K3_TOKENIZER_DIR` and then `$K3_MODEL_DIR` are used (the binary may also
//! fill the field from its model directory before calling).

use crate::chat::ChatRequest;
use crate::error::{Error, Result};
use crate::parser::parse_output;
use crate::tokenizer::Tokenizer;
use crate::xtml::render_chat;
use clap::ArgAction;
use serde_json::{json, Value};
use std::io::Read;
use std::path::{Path, PathBuf};

/// `k3 tokenize`: text → `{"ids": [...]}`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TokenizeArgs {
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Recognise special-token names in the text (otherwise they are plain text).
    #[arg(long)]
    pub allow_special: bool,
    /// The text to encode.
    #[arg(value_name = "TEXT", conflicts_with = "file", required_unless_present = "file")]
    pub text: Option<String>,
    /// Read the text from a file (`-` for stdin).
    #[arg(long, value_name = "PATH")]
    pub file: Option<PathBuf>,
}

/// `k3 detokenize`: ids → `{"text": ...}`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DetokenizeArgs {
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Drop ids marked `"special": true` in tokenizer_config.json.
    #[arg(long)]
    pub skip_special: bool,
    /// Comma-separated token ids, e.g. `1,2,3`.
    #[arg(long, value_name = "IDS", allow_hyphen_values = true)]
    pub ids: String,
}

/// `k3 render-chat`: chat request → `{"text": ..., "ids": [...]}`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RenderChatArgs {
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// OpenAI-style chat request JSON (`-` for stdin).
    #[arg(long, value_name = "FILE.json")]
    pub request: PathBuf,
}

/// `k3 parse-output`: generated ids → `{"reasoning_content", "content", "tool_calls"}`.
#[derive(Debug, Clone, clap::Args)]
pub struct ParseOutputArgs {
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Comma-separated generated ids (after the generation stub).
    #[arg(long, value_name = "IDS", allow_hyphen_values = true)]
    pub ids: String,
    /// Whether the prompt had thinking on (output starts inside the think channel).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = ArgAction::Set)]
    pub thinking: bool,
    /// Whether the request declared tools (with tool_choice other than none).
    #[arg(long, value_name = "BOOL", default_value_t = false, action = ArgAction::Set)]
    pub tools_declared: bool,
}

/// Loads the tokenizer named by `--tokenizer`, `$K3_TOKENIZER_DIR` or `$K3_MODEL_DIR`.
pub fn load_tokenizer(dir: Option<&Path>) -> Result<Tokenizer> {
    let dir = match dir {
        Some(d) => d.to_path_buf(),
        None => ["K3_TOKENIZER_DIR", "K3_MODEL_DIR"]
            .iter()
            .find_map(std::env::var_os)
            .map(PathBuf::from)
            .ok_or_else(|| Error::Cli("no tokenizer: pass --tokenizer DIR (or set K3_MODEL_DIR)".into()))?,
    };
    Tokenizer::from_dir(&dir)
}

/// Reads a file, or stdin for `-`.
fn read_input(path: &Path) -> Result<String> {
    if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// Parses `1,2,3` (spaces and surrounding `[` `]` allowed).
pub fn parse_ids(list: &str) -> Result<Vec<u32>> {
    let inner = list.trim().trim_start_matches('[').trim_end_matches(']');
    inner
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().map_err(|_| Error::Cli(format!("--ids: {s:?} is not a token id"))))
        .collect()
}

/// `k3 tokenize`.
pub fn run_tokenize(args: &TokenizeArgs) -> Result<Value> {
    let tok = load_tokenizer(args.tokenizer.as_deref())?;
    let text = match (&args.text, &args.file) {
        (Some(t), None) => t.clone(),
        (None, Some(f)) => read_input(f)?,
        _ => return Err(Error::Cli("give exactly one of TEXT or --file PATH".into())),
    };
    Ok(json!({ "ids": tok.encode(&text, args.allow_special) }))
}

/// `k3 detokenize`.
pub fn run_detokenize(args: &DetokenizeArgs) -> Result<Value> {
    let tok = load_tokenizer(args.tokenizer.as_deref())?;
    let ids = parse_ids(&args.ids)?;
    Ok(json!({ "text": tok.decode(&ids, args.skip_special)? }))
}

/// `k3 render-chat`.
pub fn run_render_chat(args: &RenderChatArgs) -> Result<Value> {
    let tok = load_tokenizer(args.tokenizer.as_deref())?;
    let request = ChatRequest::from_json_str(&read_input(&args.request)?)?;
    let rendered = render_chat(&tok, &request)?;
    Ok(json!({ "text": rendered.text, "ids": rendered.ids }))
}

/// `k3 parse-output`.
pub fn run_parse_output(args: &ParseOutputArgs) -> Result<Value> {
    let tok = load_tokenizer(args.tokenizer.as_deref())?;
    let ids = parse_ids(&args.ids)?;
    // Refused like `detokenize` refuses it: the parser would otherwise drop the id silently.
    if let Some(&id) = ids.iter().find(|&&id| tok.token_bytes(id).is_none()) {
        return Err(Error::UnknownId { id, vocab_size: tok.vocab_size() });
    }
    let parsed = parse_output(&tok, &ids, args.thinking, args.tools_declared);
    let calls: Vec<Value> = parsed.tool_calls.iter().map(|c| json!({ "name": c.name, "arguments": c.arguments })).collect();
    Ok(json!({
        "reasoning_content": parsed.reasoning_content,
        "content": parsed.content,
        "tool_calls": calls,
    }))
}
