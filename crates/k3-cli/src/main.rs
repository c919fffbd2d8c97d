//! `k3`: the k3rs binary. One subcommand per file under `cmd/`; this file only parses and
//! dispatches. Errors are reported with their full cause chain and a non-zero exit code.

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
    /// Full-sequence logits for a list of token ids, written as a `[T, vocab]` f32 .npy.
    Logits(cmd::logits::Args),
    /// One image through preprocessing, vision tower, merger and projector, written as .safetensors.
    Vision(cmd::vision::Args),
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Logits(a) => cmd::logits::run(a),
        Command::Vision(a) => cmd::vision::run(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
