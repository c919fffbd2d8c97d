//! `k3 init --config <config.json | name> --out DIR [--seed N] [--dtype f32|bf16]
//! [--experts float|f32|bf16|mxfp4] [--shard-size BYTES] [--num-hidden-layers N]
//! [--num-experts E] [--set key=value ...]` — a random-weight checkpoint in the release format
//! (around-backbone §1–§2; see `k3_model::init`).

use std::path::PathBuf;

use anyhow::{bail, Result};
use k3_model::init::{init, load_source_config, ExpertFormat, FloatDType, InitOptions, Overrides};

#[derive(clap::Args)]
pub struct Args {
    /// A config.json (nested release schema or bare text config) or a built-in name: k3, k3_1_pro, tiny, tiny_dsa.
    #[arg(long)]
    pub config: String,
    /// Output directory (must not exist or be empty; written atomically).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Float tensors: f32 | bf16 (the release's F32 tensors stay F32).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Routed experts: float (same as --dtype) | f32 | bf16 | mxfp4.
    #[arg(long, default_value = "float")]
    pub experts: String,
    /// Shard the weights: a new shard starts before a tensor that would pass this many bytes.
    #[arg(long)]
    pub shard_size: Option<u64>,
    /// Keep the first N layers' kinds (the last becomes full attention if none would be).
    #[arg(long)]
    pub num_hidden_layers: Option<usize>,
    /// Routed experts per MoE layer (num_experts_per_token is capped at it).
    #[arg(long)]
    pub num_experts: Option<usize>,
    /// Set any text_config field, e.g. `--set vocab_size=32768 --set linear_attn_config.num_heads=8`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

fn float(s: &str) -> Result<FloatDType> {
    Ok(match s {
        "f32" | "float32" => FloatDType::F32,
        "bf16" | "bfloat16" => FloatDType::BF16,
        o => bail!("--dtype `{o}`: expected f32 or bf16"),
    })
}

pub fn run(a: Args) -> Result<()> {
    let dtype = float(&a.dtype)?;
    let experts = match a.experts.as_str() {
        "float" => ExpertFormat::Float(dtype),
        "mxfp4" => ExpertFormat::Mxfp4,
        o => ExpertFormat::Float(float(o).map_err(|_| anyhow::anyhow!("--experts `{o}`: expected float, f32, bf16 or mxfp4"))?),
    };
    let mut set = Vec::new();
    for kv in &a.set {
        let Some((k, v)) = kv.split_once('=') else { bail!("--set `{kv}`: expected KEY=VALUE") };
        let v = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_string()));
        set.push((k.to_string(), v));
    }
    let ov = Overrides { num_hidden_layers: a.num_hidden_layers, num_experts: a.num_experts, set };
    let opts = InitOptions { seed: a.seed, dtype, experts, shard_size: a.shard_size };
    let t0 = std::time::Instant::now();
    let s = init(load_source_config(&a.config)?, &ov, &a.out, &opts)?;
    println!(
        "wrote {} tensors, {} bytes of data in {} file(s) to {} in {:.1} s",
        s.tensors,
        s.data_bytes,
        s.files.len(),
        s.dir.display(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
