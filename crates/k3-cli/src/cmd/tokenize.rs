//! `k3 tokenize | detokenize | render-chat | parse-output`: thin wrappers over
//! `k3_tokenizer::cli`, printing its JSON on stdout (usable from scripts).

use anyhow::Result;

fn print(v: serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string(&v)?);
    Ok(())
}

pub fn tokenize(a: k3_tokenizer::cli::TokenizeArgs) -> Result<()> {
    print(k3_tokenizer::cli::run_tokenize(&a)?)
}
pub fn detokenize(a: k3_tokenizer::cli::DetokenizeArgs) -> Result<()> {
    print(k3_tokenizer::cli::run_detokenize(&a)?)
}
pub fn render_chat(a: k3_tokenizer::cli::RenderChatArgs) -> Result<()> {
    print(k3_tokenizer::cli::run_render_chat(&a)?)
}
pub fn parse_output(a: k3_tokenizer::cli::ParseOutputArgs) -> Result<()> {
    print(k3_tokenizer::cli::run_parse_output(&a)?)
}
