//! `k3 logits --model DIR (--ids 1,2,3 | --ids-file FILE) --out FILE.npy [--mode full|decode|chunked:N] [--trace DIR]`
//! `[--device cuda[:N] [--precision bf16|f32]] [--tp N] [--ep N] [--pp N]`
//!
//! `--tp/--ep/--pp` on the CPU run the ranks of that layout as threads of this process
//! (`k3_model::parallel::on_threads`): the same logits as one rank, within f32 rounding. With
//! `--device cuda[:N]` each rank is a process on GPU `N + LOCAL_RANK` (`k3_engine::dist::launch`):
//! started by torchrun/Slurm, or by this process for its node (`--nnodes --node-rank
//! --master-addr` for several nodes); rank 0 writes the file.
//!
//! Writes float32 logits `[T, vocab]` for every position. `full` runs one pass over the whole
//! sequence; `decode` feeds the tokens one at a time through the cache; `chunked:N` prefills in
//! chunks of N. `--trace DIR` dumps named intermediates (`blk.3.attn_in.npy`, ...) of the pass.
//! `--image P` (repeatable): the ids already hold each image's N `<|media_pad|>`; the images'
//! projected features replace the pad runs in order (around-backbone §3.9); a count mismatch fails.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use k3_model::{Checkpoint, ForwardOpts, Model};

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long, conflicts_with = "ids_file")]
    pub ids: Option<String>,
    /// File with token ids separated by commas or whitespace.
    #[arg(long)]
    pub ids_file: Option<PathBuf>,
    /// Output .npy path.
    #[arg(long)]
    pub out: PathBuf,
    /// full | decode | chunked:N
    #[arg(long, default_value = "full")]
    pub mode: String,
    /// Directory to dump named intermediates into (one .npy per name; CPU only).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Image file whose features fill the next `<|media_pad|>` run (repeat for several images).
    #[arg(long = "image")]
    pub images: Vec<PathBuf>,
    #[command(flatten)]
    pub device: super::args::DeviceArgs,
    /// GPU `--mode decode`: run the steps eagerly instead of replaying a CUDA graph.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    #[command(flatten)]
    pub precision: super::args::PrecisionArgs,
    #[command(flatten)]
    pub parallel: super::args::ParallelArgs,
    #[command(flatten)]
    pub launch: super::args::LaunchArgs,
}

/// Parses ids separated by commas and/or whitespace.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<u32>().with_context(|| format!("`{x}` is not a token id (non-negative integer)")))
        .collect()
}

/// The chunk size of a `--mode` value: `None` for a single full pass.
pub fn parse_mode(mode: &str) -> Result<Option<usize>> {
    match mode {
        "full" => Ok(None),
        "decode" => Ok(Some(1)),
        m => match m.strip_prefix("chunked:").map(str::parse::<usize>) {
            Some(Ok(n)) if n > 0 => Ok(Some(n)),
            _ => bail!("--mode `{m}` is not one of full, decode, chunked:N (N ≥ 1)"),
        },
    }
}

/// Logits of every position on the GPU: the sequence fed in pieces of `step` rows (decode steps
/// through a CUDA graph when `step` is 1 and `graphs`).
#[cfg(feature = "cuda")]
fn gpu_logits(a: &Args, ck: &Checkpoint, ord: usize, ids: &[u32], emb: Option<&[f32]>, step: usize) -> Result<Vec<f32>> {
    use k3_model::cuda::{CacheConfig, CudaModel};
    let dev = k3_core::cuda::CudaDevice::new(ord)?;
    let cache = CacheConfig { max_seqs: 1, max_tokens: ids.len() + 64, kv_cache_dtype: a.precision.kv_dtype(Some(ord))? };
    let mut m = CudaModel::load_with(ck, &dev, cache, gpu_precision(a.precision.gpu_f32(Some(ord))?))?;
    gpu_pieces(&mut m, ids, emb, step, !a.no_cuda_graphs)
}

#[cfg(feature = "cuda")]
fn gpu_precision(f32: bool) -> k3_model::cuda::Precision {
    if f32 {
        k3_model::cuda::Precision::F32
    } else {
        k3_model::cuda::Precision::Bf16
    }
}

/// One rank of a multi-process GPU world: joins it, loads this rank's shards on GPU
/// `ord + LOCAL_RANK`, runs the same pieces as every other rank; rank 0 gets the logits.
#[cfg(feature = "cuda")]
fn gpu_rank_logits(a: &Args, ck: &Checkpoint, par: k3_model::Parallel, ord: usize, ids: &[u32], step: usize, f32: bool) -> Result<Option<Vec<f32>>> {
    use k3_engine::dist::launch::{load_gpu_rank, nccl_ids, world_digest, World};
    let digest = world_digest(ck, par)?;
    let world = World::start(par, &a.launch.node(), &digest, |k| std::env::var(k).ok(), || nccl_ids(par))?;
    let rank = world.rank();
    let cache = k3_model::cuda::CacheConfig { max_seqs: 1, max_tokens: ids.len() + 64, kv_cache_dtype: a.precision.kv_dtype(Some(ord))? };
    let mut m = load_gpu_rank(&world, ck, ord, cache, gpu_precision(f32), None)?;
    let out = gpu_pieces(&mut m, ids, None, step, !a.no_cuda_graphs).with_context(|| format!("rank {rank}"));
    if out.is_err() {
        m.groups.abort(&format!("rank {rank} failed"));
    }
    let out = out?;
    drop(m);
    world.finish(std::time::Duration::from_secs(120))?;
    Ok((rank == 0).then_some(out))
}

#[cfg(not(feature = "cuda"))]
fn gpu_rank_logits(_: &Args, _: &Checkpoint, _: k3_model::Parallel, _: usize, _: &[u32], _: usize, _: bool) -> Result<Option<Vec<f32>>> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}

/// Feeds `ids` through `m` in pieces of `step` rows (decode steps through a CUDA graph when
/// `step` is 1 and `graphs`), collecting the logits.
#[cfg(feature = "cuda")]
fn gpu_pieces(m: &mut k3_model::cuda::CudaModel, ids: &[u32], emb: Option<&[f32]>, step: usize, graphs: bool) -> Result<Vec<f32>> {
    use k3_model::cuda::Input;
    let h = m.config.text.hidden_size;
    let mut s = m.new_sequence()?;
    let mut out = Vec::with_capacity(ids.len() * m.config.text.vocab_size);
    let graph = if step == 1 && graphs && emb.is_none() { Some(m.capture_decode(1, ids.len() + 64)?) } else { None };
    for (ci, piece) in ids.chunks(step).enumerate() {
        let lg = match (&graph, emb) {
            (Some(g), _) => m.decode_step(g, piece, &mut [&mut s])?,
            (None, Some(e)) => m.forward_varlen(Input::Embeds(&e[ci * step * h..(ci * step + piece.len()) * h]), &[piece.len()], &mut [&mut s], false)?,
            (None, None) => m.forward(piece, &mut s, false)?,
        };
        out.extend(lg);
    }
    Ok(out)
}

#[cfg(not(feature = "cuda"))]
fn gpu_logits(_: &Args, _: &Checkpoint, _: usize, _: &[u32], _: Option<&[f32]>, _: usize) -> Result<Vec<f32>> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}

pub fn run(a: Args) -> Result<()> {
    let ids = match (&a.ids, &a.ids_file) {
        (Some(s), _) => parse_ids(s)?,
        (None, Some(f)) => parse_ids(&std::fs::read_to_string(f).with_context(|| format!("reading --ids-file {}", f.display()))?)?,
        (None, None) => bail!("give the tokens with --ids 1,2,3 or --ids-file FILE"),
    };
    if ids.is_empty() {
        bail!("no token ids given");
    }
    let chunk = parse_mode(&a.mode)?;
    let device = a.device.ordinal()?;
    if device.is_some() && a.trace.is_some() {
        bail!("--trace is CPU-only: drop --device or --trace");
    }
    let f32_gpu = a.precision.gpu_f32(device)?;
    a.precision.kv_dtype(device)?; // a bad --kv-cache-dtype fails before the checkpoint loads
    if device.is_none() && a.launch.is_set() {
        bail!("--nnodes/--node-rank/--master-addr start one process per GPU: add --device cuda (on the CPU, --tp/--ep/--pp run as threads of one process)");
    }
    let ck = Checkpoint::open(&a.model)?;
    let (vocab, hidden) = (ck.config.text.vocab_size, ck.config.text.hidden_size);
    let step = chunk.unwrap_or(ids.len());
    if let Some(par) = a.parallel.parallel()? {
        if a.trace.is_some() || !a.images.is_empty() {
            bail!("--trace and --image run on one rank: drop --tp/--ep/--pp, or drop them");
        }
        if let Some(ord) = device {
            if let Some(logits) = gpu_rank_logits(&a, &ck, par, ord, &ids, step, f32_gpu)? {
                k3_core::npy::write_npy_f32(&a.out, &[ids.len(), vocab], &logits).with_context(|| format!("writing {}", a.out.display()))?;
                eprintln!(
                    "wrote {} ({} × {vocab} f32; --tp {} --ep {} --pp {}: {} GPU ranks)",
                    a.out.display(),
                    ids.len(),
                    par.tp,
                    par.ep,
                    par.pp,
                    par.world()
                );
            }
            return Ok(());
        }
        let mut runs = k3_model::parallel::on_threads(&ck, par, |m| {
            let mut st = m.new_state();
            let mut out = Vec::with_capacity(ids.len() * vocab);
            for piece in ids.chunks(step) {
                out.extend(m.forward(piece, &mut st, ForwardOpts::default(), None)?);
            }
            Ok(out)
        })?;
        // Rank 0 is on the first stage, which gets the logits back from the last.
        let logits = runs.swap_remove(0);
        k3_core::npy::write_npy_f32(&a.out, &[ids.len(), vocab], &logits).with_context(|| format!("writing {}", a.out.display()))?;
        eprintln!("wrote {} ({} × {vocab} f32; --tp {} --ep {} --pp {}: {} ranks as threads)", a.out.display(), ids.len(), par.tp, par.ep, par.pp, par.world());
        return Ok(());
    }
    // The CPU model computes the CPU logits and, with --image, the token embeddings the image
    // features are spliced into; a GPU run without images does not load it.
    let cpu = if device.is_none() || !a.images.is_empty() { Some(Model::load(&ck)?) } else { None };
    let emb = match (&cpu, a.images.is_empty()) {
        (Some(model), false) => {
            let vm = k3_vision::VisionModel::load(&ck)?;
            let paths: Vec<&std::path::Path> = a.images.iter().map(PathBuf::as_path).collect();
            Some(k3_vision::embed_with_images(model, &vm, &ids, &paths)?)
        }
        _ => None,
    };
    let mut logits = Vec::with_capacity(ids.len() * vocab);
    if let Some(dir) = &a.trace {
        std::fs::create_dir_all(dir).with_context(|| format!("creating --trace dir {}", dir.display()))?;
    }
    let mut trace_err: Option<anyhow::Error> = None;
    let mut tracer = |name: &str, x: &[f32], t: usize| {
        if let Some(dir) = &a.trace {
            let path = dir.join(format!("{name}.npy"));
            if let Err(e) = k3_core::npy::write_npy_f32(&path, &[t, x.len() / t], x) {
                trace_err.get_or_insert(e.into());
            }
        }
    };
    match (device, &cpu) {
        (Some(ord), _) => logits = gpu_logits(&a, &ck, ord, &ids, emb.as_deref(), step)?,
        (None, Some(model)) => {
            let mut state = model.new_state();
            for (ci, piece) in ids.chunks(step).enumerate() {
                let tr: k3_model::model::Trace = if a.trace.is_some() && chunk.is_none() { Some(&mut tracer) } else { None };
                let out = match &emb {
                    None => model.forward(piece, &mut state, ForwardOpts::default(), tr)?,
                    Some(e) => {
                        model.forward_embeds(e[ci * step * hidden..(ci * step + piece.len()) * hidden].to_vec(), &mut state, ForwardOpts::default(), tr)?
                    }
                };
                logits.extend(out);
            }
        }
        (None, None) => bail!("internal: the CPU model was not loaded for a CPU run"),
    }
    if let Some(e) = trace_err {
        return Err(e.context("writing --trace output"));
    }
    k3_core::npy::write_npy_f32(&a.out, &[ids.len(), vocab], &logits).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {} ({} × {vocab} f32)", a.out.display(), ids.len());
    Ok(())
}
