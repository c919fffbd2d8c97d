//! `k3 bench`: speed and memory, measured in one process so figures read as ratios.
//!
//! Model mode (`--model DIR --prompt-len P --gen-len G [--batch B] [--threads N]`): load time,
//! prefill tok/s, decode tok/s (B sequences decoding together), peak RSS, cache bytes, and the
//! decode's achieved weight bandwidth (weight bytes a decode step reads ÷ step time) next to
//! this machine's memory bandwidth measured in the same run (a parallel read of a 1 GiB buffer
//! and a memcpy), so decode reads as a fraction of the limit.
//!
//! CPU op mode (`--op gemv ROWS COLS [TOKENS]`): the expert GEMV of every weight format (MXFP4,
//! BF16, F32) on the same shape, computing from the stored form, in GB/s of weights read, over
//! enough distinct matrices (≥ 1 GiB per format) that they stream from memory, not cache.
//!
//! Experts mode (`--op experts [BATCHES...] --model DIR`, issue 23): one MoE layer's routed
//! experts computed by the CPU from host memory and from disk, each beside its floor; see
//! `bench_experts.rs`.
//!
//! DSA mode (`--op dsa [CONTEXTS...] --model DIR`, a model with a DSA layer): per-token decode
//! cost of that layer over a filled cache at each context (default 4096 16384 65536), sparse
//! (its `index_topk`) against the same layer run dense, and the indexer alone — the sparse
//! attention core stays flat while the indexer grows linearly with the context.
//!
//! Speculative mode (`--speculative ngram,suffix`): speculative against plain greedy decoding on
//! text-repeating workloads, tokens/s and acceptance; see `bench_spec.rs`. With `--device cuda`
//! on the GPU runner, plus the verify step's cost against a plain step (`bench_spec_cuda.rs`).
//!
//! Pipeline mode (`--tp T --pp P`, P > 1): a pipeline layout's ranks as threads, pipelined
//! steps against one step at a time; see `bench_pipeline.rs`.
//!
//! Constrained mode (`--json-schema FILE`, with the model mode's flags): decode with and without
//! the schema as the output constraint in one run, and the per-token mask cost; see
//! `bench_grammar.rs`.
//!
//! GPU op mode (`--device cuda --op gemm M N K | copy BYTES | rmsnorm ROWS DIM`, feature `cuda`):
//! one GPU op timed with CUDA events after warm-up, median of repeats.
//!
//! GPU model mode (`--device cuda --model DIR [--prompt-len T] [--batches 1,16,64] [--context C]`):
//! the whole model on the GPU, see `bench_cuda.rs`.
//!
//! Serve mode (`k3 bench serve --base-url URL ...`): a load generator for a running server; see
//! `bench_serve.rs`.
//!
//! `--device` and `--op` pick the mode ([`Mode`]); each mode's flags are one group in [`Args`]
//! and one heading in `k3 bench --help`.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_model::{Checkpoint, ForwardOpts, Model, SeqState};

use super::args::{parse_device, ModelArgs};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

#[derive(clap::Args)]
#[command(after_help = BENCH_MODES, args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub sub: Option<BenchCommand>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// cpu | cuda (GPU 0; needs a k3 built with `--features cuda`). With --op: one op; without:
    /// the model.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub run: ModelMode,
    #[command(flatten)]
    pub gpu: GpuModelMode,
    #[command(flatten)]
    pub op: OpMode,
    #[command(flatten)]
    pub timing: GpuTiming,
    /// `--tp/--ep/--pp` with `--pp` > 1 (CPU): pipelined steps against one step at a time.
    #[command(flatten)]
    pub parallel: super::args::ParallelArgs,
}

/// `k3 bench SUBCOMMAND`.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Load an OpenAI-compatible server (`k3 serve`) with streaming completions: TTFT, TPOT,
    /// ITL percentiles and throughput (like `vllm bench serve`).
    Serve(super::bench_serve::ServeBenchArgs),
}

/// The modes, as README's `k3` section lists them.
const BENCH_MODES: &str = "\
Modes:
  k3 bench serve --base-url URL [--max-concurrency C] [--num-prompts N] [--input-len I] [--output-len O]   load a server
  k3 bench [--model DIR] --prompt-len P --gen-len G [--batch B] [--threads N]
  k3 bench --json-schema FILE [--model DIR] [--prompt-len P --gen-len G --batch B]   constrained decoding overhead
  k3 bench --speculative ngram,suffix[,draft --draft-model DIR] [--num-speculative-tokens K] [--gen-len G]   speculative vs plain decoding
  k3 bench --device cuda --speculative ngram,suffix [--batches 1,16 --context C]   the same on the GPU + verify step costs
  k3 bench --tp T --pp P [--batch B --prompt-len L --gen-len G]   pipelined steps vs one at a time (ranks as threads)
  k3 bench --op gemv 3072 3584                     expert GEMV: MXFP4 vs BF16 vs F32, GB/s
  k3 bench --op dsa 4096 16384 65536 --model DIR   DSA layer per-token cost vs dense
  k3 bench --op experts 1 4 16 --model DIR         routed experts on the CPU: host memory and disk vs floors
  k3 bench --device cuda --model DIR --prompt-len 4096 --batches 1,16,64 --context 512 [--profile]
  k3 bench --device cuda --model DIR --offload gpu,cpu,disk [--batches 1,4 --expert-cache-mem 16GiB]   experts off the GPU
  k3 bench --device cuda --op gemm 8192 8192 8192  one GPU op (gemm | gemv | copy | rmsnorm)
  k3 bench --device cuda --op dsa 16384 131072 524288 --model DIR   DSA decode vs context
The GPU modes need a k3 built with --features cuda.";

/// The model mode (no --op), on the CPU and the GPU.
#[derive(clap::Args)]
#[command(next_help_heading = "Model mode (no --op)")]
pub struct ModelMode {
    /// Prompt tokens prefilled per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// CPU: tokens decoded per sequence.
    #[arg(long, default_value_t = 32)]
    pub gen_len: usize,
    /// CPU: sequences decoding together.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// CPU: time decode with and without this JSON Schema as the output constraint (through the
    /// engine, sampling at temperature 1) and report the per-token mask cost.
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<std::path::PathBuf>,
    /// Compare these speculative methods (comma separated: ngram,suffix,mtp,draft) with plain
    /// greedy decoding on text-repeating workloads (`bench_spec.rs`).
    #[arg(long, value_name = "METHODS")]
    pub speculative: Option<String>,
    /// With --speculative: most drafted tokens per step.
    #[arg(long, default_value_t = 4, value_name = "K")]
    pub num_speculative_tokens: usize,
    /// With --speculative …,draft: the draft model's directory (the target's vocab_size).
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<std::path::PathBuf>,
}

/// The model mode on the GPU (`--device cuda`, no --op; `bench_cuda.rs`).
#[derive(clap::Args)]
#[command(next_help_heading = "GPU model mode (--device cuda, no --op)")]
pub struct GpuModelMode {
    /// Decode batch sizes, comma separated.
    #[arg(long, default_value = "1,16,64")]
    pub batches: String,
    /// Tokens already in each sequence's cache when decode is timed.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Also time each sublayer of one eager batch-1 decode step and of one eager prefill of
    /// --prompt-len tokens (CUDA events).
    #[arg(long)]
    pub profile: bool,
    /// Latent / indexer-key cache format: bf16, fp8 (`fp8_ds_mla` + FP8 indexer keys).
    #[arg(long, default_value = "bf16", value_name = "bf16|fp8")]
    pub kv_cache_dtype: String,
    /// Experts off the GPU (issue 23): the model with every MoE layer's routed experts on each
    /// of these tiers in turn (comma separated: gpu,cpu,disk), parity against the first, eager
    /// decode steps beside the tiers' floors (`bench_offload_cuda.rs`).
    #[arg(long, value_name = "TIERS")]
    pub offload: Option<String>,
    /// With --offload disk: bytes of experts the cache holds (e.g. 16GiB) [default: 8GiB].
    #[arg(long, value_name = "SIZE", value_parser = k3_engine::prefix::parse_bytes)]
    pub expert_cache_mem: Option<usize>,
}

/// One op instead of the model (--op).
#[derive(clap::Args)]
#[command(next_help_heading = "Op mode (--op)")]
pub struct OpMode {
    /// The op and its dims. CPU: gemv ROWS COLS [TOKENS] | dsa [CONTEXTS...] (with --model) |
    /// experts [BATCHES...] (with --model).
    /// cuda: gemm M N K | gemv M N K | copy BYTES | rmsnorm ROWS DIM | dsa [CONTEXTS...] (with
    /// --model).
    #[arg(long, num_args = 1.., value_name = "OP DIMS")]
    pub op: Vec<String>,
    /// `--op experts`: the tiers timed — host (mapped weights in memory), disk (through the
    /// expert cache), or both.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "host,disk")]
    pub tiers: Vec<Tier>,
}

/// A tier of `--op experts`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Host,
    Disk,
}

/// CUDA-event timing of the GPU modes (--device cuda).
#[derive(clap::Args)]
#[command(next_help_heading = "GPU timing (--device cuda)")]
pub struct GpuTiming {
    /// Untimed runs before timing.
    #[arg(long, default_value_t = 20)]
    pub warmup: usize,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 50)]
    pub repeats: usize,
}

/// What one `k3 bench` invocation measures, from `--device` and `--op`.
enum Mode {
    CpuModel,
    CpuGemv,
    CpuDsa,
    CpuExperts,
    CudaModel,
    CudaOp,
    CudaDsa,
}

/// Peak and current resident memory in bytes (VmHWM, VmRSS), Linux only.
pub fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |k: &str| s.lines().find(|l| l.starts_with(k)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 1024;
    (get("VmHWM:"), get("VmRSS:"))
}

/// The median of `v` (sorted in place; the upper middle for an even count).
pub(crate) fn median_of(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// (parallel read GB/s, memcpy GB/s counting read + write) over a 1 GiB buffer, best of 3.
pub fn memory_bandwidth() -> (f64, f64) {
    let n = (1usize << 30) / 4;
    let src: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let mut dst = vec![0f32; n];
    let (mut read, mut copy) = (0f64, 0f64);
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = src.par_chunks(1 << 16).map(sum8).sum();
        std::hint::black_box(s);
        read = read.max((n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        dst.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| d.copy_from_slice(s));
        std::hint::black_box(&dst);
        copy = copy.max((2 * n * 4) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    (read, copy)
}

/// Ops `--op` takes on each device.
const CPU_OPS: &[&str] = &["gemv", "dsa", "experts"];
const CUDA_OPS: &[&str] = &["gemm", "gemv", "copy", "rmsnorm", "dsa"];

pub fn run(a: Args) -> Result<()> {
    if let Some(BenchCommand::Serve(s)) = a.sub {
        return super::bench_serve::run(s);
    }
    if let Some(n) = a.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("--threads: the thread pool was already started")?;
    }
    let device = parse_device(&a.device);
    if let Some(op) = a.op.op.first() {
        let (known, list): (&[&str], &str) = match device {
            Ok(None) => (CPU_OPS, "gemv ROWS COLS [TOKENS] | dsa [CONTEXTS...] | experts [BATCHES...]"),
            _ => (CUDA_OPS, "gemm M N K | gemv M N K | copy BYTES | rmsnorm ROWS DIM | dsa [CONTEXTS...]"),
        };
        if !known.contains(&op.as_str()) {
            bail!("--op `{op}`: unknown op for --device {}; use {list} (or no --op for the model mode)", a.device);
        }
    }
    let op = a.op.op.first().map(String::as_str);
    let mode = match (device, op) {
        (Ok(None), None) => Mode::CpuModel,
        (Ok(None), Some("dsa")) => Mode::CpuDsa,
        (Ok(None), Some("experts")) => Mode::CpuExperts,
        (Ok(None), Some(_)) => Mode::CpuGemv,
        (Ok(Some(0)), None) => Mode::CudaModel,
        (Ok(Some(0)), Some("dsa")) => Mode::CudaDsa,
        (Ok(Some(0)), Some(_)) => Mode::CudaOp,
        _ => bail!("--device `{}`: use cpu or cuda", a.device),
    };
    if a.gpu.offload.is_some() && !matches!(mode, Mode::CudaModel) {
        bail!("--offload compares expert tiers of the model on a GPU: add --device cuda (no --op); on the CPU, `--op experts` times the CPU's tiers");
    }
    match mode {
        Mode::CpuModel => match (&a.run.json_schema, &a.run.speculative, a.parallel.parallel()?) {
            (Some(f), _, _) => super::bench_grammar::bench_grammar(&a, f),
            (None, Some(m), _) => super::bench_spec::bench_spec(&a, m, false),
            (None, None, Some(par)) => super::bench_pipeline::bench_pipeline(&a, par),
            (None, None, None) => bench_model(&a),
        },
        Mode::CpuDsa => bench_cpu_dsa(&a),
        Mode::CpuExperts => super::bench_experts::bench_experts(&a),
        Mode::CpuGemv => bench_cpu_gemv(&a),
        Mode::CudaModel => match (&a.run.speculative, &a.gpu.offload) {
            (Some(m), _) => super::bench_spec::bench_spec(&a, m, true),
            (None, Some(t)) => bench_cuda_offload(&a, t),
            (None, None) => bench_cuda_model(&a),
        },
        Mode::CudaDsa => bench_cuda_dsa(&a),
        Mode::CudaOp => bench_cuda_op(&a),
    }
}

fn bench_model(a: &Args) -> Result<()> {
    if a.run.prompt_len == 0 || a.run.gen_len == 0 || a.run.batch == 0 {
        bail!("--prompt-len, --gen-len and --batch must be ≥ 1");
    }
    let dir = a.model.dir()?;
    let t0 = Instant::now();
    let ck = Checkpoint::open(&dir)?;
    let model = Model::load(&ck)?;
    let load_s = t0.elapsed().as_secs_f64();
    let rss_after_load = rss().1;
    let vocab = model.config.text.vocab_size as u32;
    if a.run.prompt_len + a.run.gen_len > model.config.max_context() {
        bail!("--prompt-len + --gen-len = {} exceeds the model's context limit {}", a.run.prompt_len + a.run.gen_len, model.config.max_context());
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let prompts: Vec<Vec<u32>> = (0..a.run.batch).map(|_| (0..a.run.prompt_len).map(|_| rng.random_range(0..vocab)).collect()).collect();
    let mut states: Vec<SeqState> = (0..a.run.batch).map(|_| model.new_state()).collect();
    let opts = ForwardOpts { last_only: true, ..Default::default() };
    // Prefill each sequence (one pass each).
    let t = Instant::now();
    let mut next = Vec::with_capacity(a.run.batch);
    for (p, st) in prompts.iter().zip(states.iter_mut()) {
        let lg = model.forward(p, st, opts, None)?;
        next.push(argmax(&lg));
    }
    let prefill_s = t.elapsed().as_secs_f64();
    // Decode: all sequences one token per step, batched.
    let t = Instant::now();
    for _ in 0..a.run.gen_len {
        let toks: Vec<[u32; 1]> = next.iter().map(|&x| [x]).collect();
        let tk: Vec<&[u32]> = toks.iter().map(|x| x.as_slice()).collect();
        let mut refs: Vec<&mut SeqState> = states.iter_mut().collect();
        let lg = model.forward_batch(&tk, &mut refs, opts)?;
        next = lg.iter().map(|l| argmax(l)).collect();
    }
    let decode_s = t.elapsed().as_secs_f64();
    let step_s = decode_s / a.run.gen_len as f64;
    let bytes_per_step = model.weight_bytes_per_token();
    let achieved = bytes_per_step as f64 / step_s / 1e9;
    let cache_bytes: usize = states.iter().map(SeqState::bytes).sum();
    let (peak, _) = rss();
    let (read_bw, copy_bw) = memory_bandwidth();
    let r = serde_json::json!({
        "model": dir.display().to_string(),
        "threads": rayon::current_num_threads(),
        "batch": a.run.batch, "prompt_len": a.run.prompt_len, "gen_len": a.run.gen_len,
        "file_bytes": ck.file_bytes(), "load_s": load_s, "rss_after_load_bytes": rss_after_load,
        "prefill_tokens_per_s": (a.run.batch * a.run.prompt_len) as f64 / prefill_s,
        "decode_tokens_per_s": (a.run.batch * a.run.gen_len) as f64 / decode_s,
        "decode_step_ms": step_s * 1e3,
        "decode_weight_bytes_per_step": bytes_per_step,
        "decode_weight_bandwidth_gb_s": achieved,
        "memory_read_bandwidth_gb_s": read_bw,
        "memcpy_bandwidth_gb_s": copy_bw,
        "decode_fraction_of_read_bandwidth": achieved / read_bw,
        "cache_bytes": cache_bytes,
        "peak_rss_bytes": peak,
    });
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "model            {}  ({:.2} GB on disk, loaded in {:.2} s, RSS after load {:.2} GB)",
            dir.display(),
            ck.file_bytes() as f64 / 1e9,
            load_s,
            rss_after_load as f64 / 1e9
        );
        println!("threads          {}", rayon::current_num_threads());
        println!("prefill          {:.1} tok/s  ({} × {} tokens)", r["prefill_tokens_per_s"].as_f64().unwrap_or(0.0), a.run.batch, a.run.prompt_len);
        println!("decode           {:.2} tok/s  (batch {}, {:.1} ms/step)", r["decode_tokens_per_s"].as_f64().unwrap_or(0.0), a.run.batch, step_s * 1e3);
        println!(
            "decode bandwidth {:.2} GB/s of weights ({:.1} MB/step) = {:.0}% of measured read bandwidth {:.2} GB/s (memcpy {:.2} GB/s)",
            achieved,
            bytes_per_step as f64 / 1e6,
            100.0 * achieved / read_bw,
            read_bw,
            copy_bw
        );
        println!("cache            {:.2} MB for {} sequences at {} tokens", cache_bytes as f64 / 1e6, a.run.batch, a.run.prompt_len + a.run.gen_len);
        println!("peak RSS         {:.2} GB", peak as f64 / 1e9);
    }
    Ok(())
}

/// Sum with 8 independent accumulators (vectorises, so the read is memory-bound).
fn sum8(c: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for x in c.chunks_exact(8) {
        for i in 0..8 {
            acc[i] += x[i];
        }
    }
    acc.iter().sum::<f32>() + c.chunks_exact(8).remainder().iter().sum::<f32>()
}

fn bench_cpu_gemv(a: &Args) -> Result<()> {
    use k3_core::kernels::cpu::matmul::{linear, Matrix};
    use k3_core::kernels::cpu::mxfp4_q8;
    use k3_core::{DType, Tensor};
    let usage = "--op gemv ROWS COLS [TOKENS] (COLS a multiple of 32)";
    let (op, dims) = a.op.op.split_first().context(usage)?;
    let dims =
        dims.iter().map(|d| d.parse::<usize>().with_context(|| format!("--op dimension `{d}` is not a positive integer"))).collect::<Result<Vec<_>>>()?;
    if op != "gemv" || !(2..=3).contains(&dims.len()) || dims[1] % 32 != 0 || dims[0] == 0 {
        bail!("{usage}");
    }
    let (rows, cols, t) = (dims[0], dims[1], dims.get(2).copied().unwrap_or(1));
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let x: Vec<f32> = (0..t * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut y = vec![0f32; t * rows];
    let (read_bw, copy_bw) = memory_bandwidth();
    let mut results = Vec::new();
    for fmt in ["mxfp4", "mxfp4-q8", "bf16", "f32"] {
        let per = match fmt {
            "mxfp4" | "mxfp4-q8" => rows * cols / 2 + rows * cols / 32,
            "bf16" => rows * cols * 2,
            _ => rows * cols * 4,
        };
        let copies = ((1usize << 30) / per).max(2);
        let mats: Vec<Matrix> = (0..copies)
            .map(|_| -> Result<Matrix> {
                Ok(match fmt {
                    "mxfp4" | "mxfp4-q8" => {
                        let p: Vec<u8> = (0..rows * cols / 2).map(|_| rng.random()).collect();
                        let sc: Vec<u8> = (0..rows * cols / 32).map(|_| rng.random_range(116..124)).collect();
                        Matrix::mxfp4(Tensor::from_bytes(DType::U8, vec![rows, cols / 2], &p)?, Tensor::from_bytes(DType::U8, vec![rows, cols / 32], &sc)?)?
                    }
                    "bf16" => {
                        let w: Vec<half::bf16> = (0..rows * cols).map(|_| half::bf16::from_f32(rng.random_range(-0.05..0.05))).collect();
                        Matrix::dense(Tensor::from_bf16(vec![rows, cols], &w)?)?
                    }
                    _ => {
                        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-0.05..0.05)).collect();
                        Matrix::dense(Tensor::from_f32(vec![rows, cols], &w)?)?
                    }
                })
            })
            .collect::<Result<_>>()?;
        // One warm pass, then three timed passes over all copies; best pass.
        let mut best = f64::MAX;
        for pass in 0..4 {
            let t0 = Instant::now();
            for m in &mats {
                match (fmt, m) {
                    // int8 activations (quantized inside the timed call, as a caller would).
                    ("mxfp4-q8", Matrix::Mxfp4 { packed, scale }) => {
                        let qs = x.chunks_exact(cols).map(mxfp4_q8::quantize).collect::<k3_core::Result<Vec<_>>>()?;
                        mxfp4_q8::gemv(packed.bytes(), scale.bytes(), rows, cols, &qs, &mut y)?;
                    }
                    _ => linear(&x, t, m, &mut y)?,
                }
            }
            if pass > 0 {
                best = best.min(t0.elapsed().as_secs_f64());
            }
        }
        let gbs = (per * copies) as f64 / best / 1e9;
        let us = best / copies as f64 * 1e6;
        results.push(serde_json::json!({"format": fmt, "bytes_per_matrix": per, "matrices": copies, "us_per_gemv": us, "weights_gb_s": gbs, "fraction_of_read_bandwidth": gbs / read_bw}));
        drop(mats);
    }
    let r = serde_json::json!({"op": "gemv", "rows": rows, "cols": cols, "tokens": t, "threads": rayon::current_num_threads(), "memory_read_bandwidth_gb_s": read_bw, "memcpy_bandwidth_gb_s": copy_bw, "results": results});
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("gemv [{rows} × {cols}] · x[{t}]  ({} threads; memory read {read_bw:.2} GB/s, memcpy {copy_bw:.2} GB/s)", rayon::current_num_threads());
        for x in &results {
            println!(
                "  {:6} {:9.1} µs/GEMV  {:6.2} GB/s of weights  ({:.0}% of read bandwidth)",
                x["format"].as_str().unwrap_or(""),
                x["us_per_gemv"].as_f64().unwrap_or(0.0),
                x["weights_gb_s"].as_f64().unwrap_or(0.0),
                100.0 * x["fraction_of_read_bandwidth"].as_f64().unwrap_or(0.0)
            );
        }
    }
    Ok(())
}

fn bench_cpu_dsa(a: &Args) -> Result<()> {
    use k3_model::layers::dsa::{index_scores_into, select_topk};
    use k3_model::layers::mla::{MlaCache, MlaForm};
    use k3_model::model::Mixer;
    let contexts: Vec<usize> = if a.op.op.len() > 1 {
        a.op.op[1..].iter().map(|d| d.parse::<usize>().with_context(|| format!("--op dsa context `{d}` is not a positive integer"))).collect::<Result<_>>()?
    } else {
        vec![4096, 16384, 65536]
    };
    let dir = a.model.dir()?;
    let mut model = Model::load(&Checkpoint::open(&dir)?)?;
    let t = &model.config.text;
    let (h, w) = (t.hidden_size, t.kv_lora_rank + t.qk_rope_head_dim);
    let li = model
        .layers
        .iter()
        .position(|l| matches!(&l.mixer, Mixer::Mla(m) if m.indexer.is_some()))
        .context("the model has no DSA layer (needs text_config.dsa_config)")?;
    let Mixer::Mla(m) = &mut model.layers[li].mixer else { bail!("layer {li} is not an attention layer") };
    let ix = m.indexer.take().context("DSA layer without indexer")?;
    let (topk, ih, id) = (ix.topk, ix.heads, ix.head_dim);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let x: Vec<f32> = (0..h).map(|_| rng.random_range(-1.0..1.0)).collect();
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        f()?;
        let mut v = Vec::new();
        for _ in 0..3 {
            let t0 = Instant::now();
            f()?;
            v.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        v.sort_by(|a, b| a.total_cmp(b));
        Ok(v[1])
    };
    let mut rows = Vec::new();
    for &ctx in &contexts {
        let mut cache = MlaCache::default();
        let lat: Vec<f32> = (0..ctx * w).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let keys: Vec<f32> = (0..ctx * id).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        cache.latent.push_rows(&lat, ctx);
        cache.index_keys.push_rows(&keys, ctx);
        let (n_lat, n_key) = (cache.latent.rows(), cache.index_keys.rows());
        // Dense: the layer without its indexer (attends to all ctx+1 positions).
        let dense = time(&mut || {
            m.forward(&x, 1, &mut cache, MlaForm::Absorbed)?;
            cache.latent.truncate_rows(n_lat);
            Ok(())
        })?;
        m.indexer = Some(ix.clone());
        let sparse = time(&mut || {
            m.forward(&x, 1, &mut cache, MlaForm::Absorbed)?;
            cache.latent.truncate_rows(n_lat);
            cache.index_keys.truncate_rows(n_key);
            Ok(())
        })?;
        let ixr = m.indexer.take().context("indexer")?;
        // The indexer alone: project, score ctx+1 keys, select top-k.
        let c_q: Vec<f32> = (0..ixr.wq_b.cols()).map(|_| rng.random_range(-1.0..1.0)).collect();
        let indexer = time(&mut || {
            let io = ixr.project(&x, &c_q, 1)?;
            let mut s = Vec::with_capacity(ctx + 1);
            cache.index_keys.spans(ctx).for_each(|span| index_scores_into(&io.q, &io.a, span, id, &mut s));
            std::hint::black_box(select_topk(&s, topk));
            Ok(())
        })?;
        rows.push(
            serde_json::json!({"context": ctx, "dense_ms": dense, "sparse_ms": sparse, "indexer_ms": indexer, "sparse_core_ms": (sparse - indexer).max(0.0)}),
        );
    }
    let r = serde_json::json!({"op": "dsa", "model": dir.display().to_string(), "layer": li, "index_topk": topk, "index_heads": ih, "threads": rayon::current_num_threads(), "rows": rows});
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("DSA layer {li} decode, one token (index_topk {topk}, {ih} index heads, {} threads)", rayon::current_num_threads());
        println!("{:>9} {:>12} {:>12} {:>12} {:>16}", "context", "dense ms", "sparse ms", "indexer ms", "sparse-indexer");
        for x in &rows {
            let g = |k: &str| x[k].as_f64().unwrap_or(0.0);
            println!(
                "{:>9} {:>12.2} {:>12.2} {:>12.2} {:>16.2}",
                x["context"].as_u64().unwrap_or(0),
                g("dense_ms"),
                g("sparse_ms"),
                g("indexer_ms"),
                g("sparse_core_ms")
            );
        }
    }
    Ok(())
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0 as u32
}

#[cfg(feature = "cuda")]
fn bench_cuda_op(a: &Args) -> Result<()> {
    use k3_core::cuda::bench::{bench_op, BenchOp};
    let Some((op, dims)) = a.op.op.split_first() else { bail!("--op gemm M N K | gemv M N K | copy BYTES | rmsnorm ROWS DIM") };
    let dims =
        dims.iter().map(|d| d.parse::<usize>().with_context(|| format!("--op dimension `{d}` is not a positive integer"))).collect::<Result<Vec<_>>>()?;
    let dev = k3_core::cuda::CudaDevice::new(0)?;
    let op = BenchOp::from_cli(op, &dims)?;
    let rep = bench_op(&dev, &op, a.timing.warmup, a.timing.repeats)?;
    println!("{rep}");
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda_op(_: &Args) -> Result<()> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}

#[cfg(feature = "cuda")]
use super::bench_cuda::{bench_cuda_dsa, bench_cuda_model};
#[cfg(feature = "cuda")]
use super::bench_offload_cuda::bench_offload as bench_cuda_offload;

#[cfg(not(feature = "cuda"))]
fn bench_cuda_offload(_: &Args, _: &str) -> Result<()> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda_model(_: &Args) -> Result<()> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}

#[cfg(not(feature = "cuda"))]
fn bench_cuda_dsa(_: &Args) -> Result<()> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}
