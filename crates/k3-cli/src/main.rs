//! `k3`: the k3rs binary. One subcommand per file under `cmd/`; this file only parses and
//! dispatches. Errors are reported with their cause chain (each text once) and a non-zero exit code.

use clap::{Parser, Subcommand};

mod cmd;

#[derive(Parser)]
#[command(name = "k3", version, about = "Kimi K3 / K3.1 Pro inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (default model: the embedded k3-nano).
    Run(cmd::run::Args),
    /// Full-sequence logits for a list of token ids, written as a `[T, vocab]` f32 .npy.
    Logits(cmd::logits::Args),
    /// Measure prefill/decode speed, bandwidth and memory of a model, or one op (--op), on the CPU or a GPU.
    Bench(cmd::bench::Args),
    /// Encode text to token ids (JSON on stdout).
    Tokenize(k3_tokenizer::cli::TokenizeArgs),
    /// Decode token ids to text (JSON on stdout).
    Detokenize(k3_tokenizer::cli::DetokenizeArgs),
    /// Render an OpenAI chat request into XTML text and ids (JSON on stdout).
    RenderChat(k3_tokenizer::cli::RenderChatArgs),
    /// Parse generated ids into reasoning, content and tool calls (JSON on stdout).
    ParseOutput(k3_tokenizer::cli::ParseOutputArgs),
    /// Layer schedule, weight shapes, parameter counts, bytes on disk and cache sizes of a model.
    Inspect(cmd::inspect::Args),
    /// Write a random-weight checkpoint in the release format.
    Init(cmd::init::Args),
    /// OpenAI-compatible HTTP server with continuous batching.
    Serve(cmd::serve::Args),
    /// One image through preprocessing, vision tower, merger and projector, written as .safetensors.
    Vision(cmd::vision::Args),
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Logits(a) => cmd::logits::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Tokenize(a) => cmd::tokenize::tokenize(a),
        Command::Detokenize(a) => cmd::tokenize::detokenize(a),
        Command::RenderChat(a) => cmd::tokenize::render_chat(a),
        Command::ParseOutput(a) => cmd::tokenize::parse_output(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Init(a) => cmd::init::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Vision(a) => cmd::vision::run(a),
    };
    if let Err(e) = r {
        eprintln!("error: {}", chain(&e));
        std::process::exit(1);
    }
}

/// The error and its causes, `: `-joined, leaving out a cause whose text the message already
/// holds (an I/O error both quoted in the message and kept as its source is printed once).
fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if out.contains(&c) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&c);
    }
    out
}
