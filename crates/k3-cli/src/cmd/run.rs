//! `k3 run [--model DIR] [sampling flags] PROMPT`: generates a continuation and streams the
//! text to stdout as it is produced; prefill and decode tokens/s go to stderr (or, with
//! `--json`, one JSON object on stdout at the end). `--ids` takes token ids instead of text.
//! On a terminal, loading shows a spinner and a prompt longer than `--prefill-chunk` a prefill
//! progress bar (both on stderr, cleared before the text; nothing when stderr is not a TTY).
//! `--tp/--ep/--pp` run the ranks of that layout as threads (`--device cpu`), or with
//! `--device cuda` as one process per GPU (`k3_engine::dist::process::launch`: started by
//! torchrun/Slurm, or by this process for its node; `--nnodes --node-rank --master-addr` for
//! several nodes): rank 0 prints the text, the other ranks print nothing and exit 0 once it
//! is done. The tokens are those of one rank (within the precision's rounding on the GPU).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use k3_engine::dist::process::{self, Role, FINISH_LIMIT};
use k3_engine::dist::runner::RunnerSpec;
use k3_engine::{Engine, EngineConfig, Request};
use k3_model::{Checkpoint, Model};
use k3_tokenizer::Tokenizer;

use super::args::{DeviceArgs, ExpertArgs, KdaStateArgs, LaunchArgs, ModelArgs, ParallelArgs, PrecisionArgs, SamplingArgs, SpecArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokenizer directory (default: the model directory).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The prompt text.
    #[arg(required_unless_present = "ids")]
    pub prompt: Option<String>,
    /// Token ids instead of text (comma separated); output is printed as ids.
    #[arg(long, conflicts_with = "prompt")]
    pub ids: Option<String>,
    /// An image to put before the prompt (repeatable; needs a model with a vision tower).
    /// With --ids, the ids must already hold each image's run of <|media_pad|> ids.
    #[arg(long)]
    pub image: Vec<PathBuf>,
    /// A video to put before the prompt, after the images (repeatable; MP4/H.264, animated GIF
    /// or WebP, and WebM/VP8/VP9 in a build with `--features vp9`; sampled at the processor's
    /// sample_fps, chunks of 4 frames). With --ids, the ids must already hold each chunk's run of
    /// <|media_pad|> ids.
    #[arg(long)]
    pub video: Vec<PathBuf>,
    /// Frames sampled from one --video at most.
    #[arg(long, default_value_t = k3_vision::video::VideoLimits::default().max_frames)]
    pub max_video_frames: usize,
    /// Tokens to generate at most.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub max_tokens: usize,
    /// Stop string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub kda_state: KdaStateArgs,
    /// Prefill chunk size.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Print one JSON object (text, ids, timings) instead of streaming.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// GPU only: run decode steps eagerly instead of replaying a CUDA graph.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    #[command(flatten)]
    pub launch: LaunchArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
}

pub fn run(a: Args) -> Result<()> {
    let dir = a.model.dir()?;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let par = a.parallel.layout()?;
    let ck = Checkpoint::open(&dir)?;
    let device = a.device.ordinal()?;
    let gpu_f32 = a.precision.gpu_f32(device)?;
    let tok_dir = a.tokenizer.clone().unwrap_or_else(|| dir.clone());
    let tokenizer = if tok_dir.join("tiktoken.model").is_file() { Some(Arc::new(Tokenizer::from_dir(&tok_dir)?)) } else { None };
    let prompt: Vec<u32> = match (&a.ids, &a.prompt, &tokenizer) {
        (Some(ids), _, _) => super::logits::parse_ids(ids)?,
        (None, Some(text), Some(tk)) => tk.encode(text, false),
        (None, Some(_), None) => bail!("{} has no tiktoken.model: give --tokenizer DIR or --ids", tok_dir.display()),
        (None, None, _) => bail!("give a PROMPT or --ids"),
    };
    let (prompt, embeds) = if a.image.is_empty() && a.video.is_empty() {
        (prompt, None)
    } else {
        let limits = k3_vision::video::VideoLimits { max_frames: a.max_video_frames, ..Default::default() };
        // One process on one GPU: the tower runs there too (a parallel world's worker processes
        // also get here, and must not put it on rank 0's GPU; they keep the CPU tower).
        // `K3_VISION_GPU=0` keeps the tower on the CPU.
        let single = a.parallel.parallel()?.is_none() && !a.launch.is_set() && k3_vision::gpu_tower_enabled();
        let gpu = device.filter(|_| single).map(|n| (n, gpu_f32));
        let media = Media { images: &a.image, videos: &a.video, limits, gpu };
        let (ids, emb) = with_images(&ck, &Model::load_embedding(&ck)?, tokenizer.as_deref(), prompt, a.ids.is_some(), &media)?;
        (ids, Some(Arc::new(emb)))
    };
    let mut req = Request::new(prompt.clone(), a.sampling.params(), a.max_tokens);
    req.prompt_embeds = embeds;
    req.stop = a.stop.clone();
    let ids_mode = a.ids.is_some() || tokenizer.is_none();
    let mut ecfg = EngineConfig {
        max_batch: 1,
        prefill_chunk: a.prefill_chunk.max(1),
        max_step_tokens: a.prefill_chunk.max(1),
        kda_state: a.kda_state.kda_state.into(),
        spec: a.spec.config()?,
        draft: None,
        prefix: None,
        pipeline_depth: None,
    };
    let cache = (prompt.len() + a.max_tokens + 64).min(ck.config.max_context());
    let spec = RunnerSpec {
        par,
        device,
        kda_state: ecfg.kda_state,
        max_seqs: 1,
        max_cache_tokens: cache,
        cuda_graphs: !a.no_cuda_graphs,
        gpu_f32,
        kv_cache_dtype: a.precision.kv_dtype(device)?,
        offload: a.experts.options()?,
    };
    // A GPU load draws its own bar over the bytes it uploads (k3_model::Source::show_progress).
    let spinner = (tty && device.is_none()).then(|| {
        let sp = indicatif::ProgressBar::new_spinner();
        sp.set_message(format!("loading {}", dir.display()));
        sp.enable_steady_tick(std::time::Duration::from_millis(120));
        sp
    });
    let role = process::launch(&ck, &spec, &a.launch.node());
    if let Some(sp) = spinner {
        sp.finish_and_clear();
    }
    let (runner, world) = match role {
        Ok(Role::Leader(r, f)) => (r, f),
        Ok(Role::Worker) => return Ok(()), // rank 0 printed the text
        Err(e) if device.is_some() => return Err(anyhow::Error::new(e).context(format!("--device {}", a.device.device))),
        Err(e) => return Err(e.into()),
    };
    if let Some(x) = runner.experts_summary().filter(|_| !a.json) {
        eprintln!("note: {x}");
    }
    // `--speculative draft`: the draft model, on rank 0 only (it runs beside the target there).
    ecfg.draft = a.spec.draft(&ck.config, &dir.display().to_string())?;
    let mut engine = Engine::with_runner(runner, tokenizer.clone(), ecfg);
    if let Err(why) = engine.speculating() {
        eprintln!("note: --speculative {}: {why}", a.spec.speculative);
    }
    let mut text = String::new();
    let stdout = std::io::stdout();
    // On a terminal, a bar while a long prompt is prefilled (nothing when stderr is not a TTY).
    let bar = (std::io::IsTerminal::is_terminal(&std::io::stderr()) && prompt.len() > a.prefill_chunk.max(1)).then(|| {
        let pb = indicatif::ProgressBar::new(prompt.len() as u64);
        pb.set_style(
            indicatif::ProgressStyle::with_template("prefill {bar:30} {pos}/{len} tokens {per_sec} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    });
    let mut prefilled = |done: usize, _total: usize| {
        if let Some(pb) = &bar {
            pb.set_position(done as u64);
        }
    };
    let (out, finish, stats) = engine.generate_with_progress(
        req,
        |ev| {
            if let Some(pb) = &bar {
                pb.finish_and_clear();
            }
            if a.json {
                text.push_str(&ev.text);
            } else {
                let mut o = stdout.lock();
                let _ = if ids_mode { write!(o, "{} ", ev.token) } else { write!(o, "{}", ev.text) };
                let _ = o.flush();
            }
        },
        &mut prefilled,
    )?;
    let engine_spec = engine.speculating() == Ok(true);
    let experts = engine.runner.expert_cache_stats();
    k3_core::trace(|| format!("run: {} tokens generated; dropping the engine", out.len()));
    drop(engine); // shuts a world of processes down: its workers exit
    world.wait(FINISH_LIMIT)?;
    k3_core::trace(|| "run: the world has finished".into());
    let tps = |n: usize, d: std::time::Duration| if d.as_secs_f64() > 0.0 { n as f64 / d.as_secs_f64() } else { 0.0 };
    let prefill_tps = tps(stats.prompt_tokens, stats.prefill_time);
    let decode_tps = tps(stats.output_tokens.saturating_sub(1), stats.decode_time);
    if a.json {
        let v = serde_json::json!({
            "model": dir.display().to_string(), "prompt_tokens": prompt.len(), "ids": out, "text": text,
            "finish_reason": finish, "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
            "time_to_first_token_s": stats.ttft.as_secs_f64(),
            "speculative": a.spec.speculative, "speculating": engine_spec,
            // Plain decoding emits one token per step and drafts nothing.
            "accepted_per_step": if engine_spec { stats.spec.accepted_per_step() } else { 1.0 },
            "draft_acceptance": (stats.spec.drafted > 0).then(|| stats.spec.draft_acceptance()),
            "drafted_tokens": stats.spec.drafted, "accepted_tokens": stats.spec.accepted, "decode_steps": stats.spec.steps,
            "acceptance_per_position": stats.spec.per_position.iter().map(|p| if p[0] == 0 { 0.0 } else { p[1] as f64 / p[0] as f64 }).collect::<Vec<_>>(),
            "expert_cache": experts,
        });
        println!("{}", serde_json::to_string(&v).context("serialising the result")?);
    } else {
        println!();
        eprintln!(
            "[{} prompt tokens: prefill {:.1} tok/s | {} generated: decode {:.1} tok/s | finish: {:?}]",
            stats.prompt_tokens, prefill_tps, stats.output_tokens, decode_tps, finish
        );
        if let Some(c) = &experts {
            eprintln!(
                "[experts from disk: {} requested, hit rate {:.0}%, {} read ({:.2} GB in {:.2} s of reads, {} O_DIRECT), {:.2} s waited, {} evicted, peak {:.2} GB of {:.2} GB]",
                c.requests,
                100.0 * c.hit_rate(),
                c.reads,
                c.bytes_read as f64 / 1e9,
                c.read_seconds,
                c.direct_reads,
                c.wait_seconds,
                c.evictions,
                c.peak_resident_bytes as f64 / 1e9,
                c.budget_bytes as f64 / 1e9
            );
        }
        if engine_spec {
            eprintln!(
                "[speculative {}: {:.2} tokens per step, {} of {} drafts accepted ({:.0}%)]",
                a.spec.speculative,
                stats.spec.accepted_per_step(),
                stats.spec.accepted,
                stats.spec.drafted,
                100.0 * stats.spec.draft_acceptance()
            );
        }
    }
    Ok(())
}

/// `--image` and `--video` files.
struct Media<'a> {
    images: &'a [PathBuf],
    videos: &'a [PathBuf],
    limits: k3_vision::video::VideoLimits,
    /// Run the vision stages on GPU `.0` (`.1`: in f32), else on the CPU.
    gpu: Option<(usize, bool)>,
}

/// Encodes the images and videos, puts their blocks (`<|media_begin|>image WxH<|media_content|>`,
/// pads, `<|media_end|>`; per video chunk `hh:mm:ss.fff<|media_begin|>video…`) before the
/// text prompt (or checks the pads already in `--ids`), and returns the ids with their input
/// rows, the features spliced in at the pads.
fn with_images(ck: &Checkpoint, model: &Model, tok: Option<&Tokenizer>, prompt: Vec<u32>, ids_given: bool, media: &Media) -> Result<(Vec<u32>, Vec<f32>)> {
    use k3_vision::{prompt::image_prompt_text, splice, VisionModel};
    if ck.config.vision_config.is_none() {
        let flag = if media.images.is_empty() { "--video" } else { "--image" };
        bail!("{flag}: {} has no vision_config (this model has no vision tower)", ck.dir.display());
    }
    #[allow(unused_mut)]
    let mut vision = VisionModel::load(ck)?;
    #[cfg(not(feature = "cuda"))]
    let _ = media.gpu; // a build without CUDA has no --device cuda
    #[cfg(feature = "cuda")]
    if let Some((n, f32)) = media.gpu {
        let dev = k3_vision::cuda::CudaDevice::new(n).with_context(|| format!("--device cuda:{n}: the vision tower"))?;
        vision.attach_cuda(&dev, k3_engine::gpu::precision(f32)).with_context(|| format!("--device cuda:{n}: uploading the vision tower"))?;
    }
    let feats = media.images.iter().map(|p| vision.encode_image(p).with_context(|| format!("--image {}", p.display()))).collect::<Result<Vec<_>>>()?;
    let videos =
        media.videos.iter().map(|p| vision.encode_video(p, &media.limits).with_context(|| format!("--video {}", p.display()))).collect::<Result<Vec<_>>>()?;
    for (p, v) in media.videos.iter().zip(&videos) {
        let n: usize = v.chunks.iter().map(|c| c.1.len()).sum();
        eprintln!(
            "--video {}: {} {}x{}, {} frames at {:.3} fps → {n} sampled, {} chunks",
            p.display(),
            v.info.format,
            v.info.width,
            v.info.height,
            v.info.num_frames,
            v.info.fps,
            v.chunks.len()
        );
    }
    let ids = if ids_given {
        prompt
    } else {
        let tk = tok.context("--image/--video with a text prompt needs a tokenizer")?;
        let mut ids = Vec::new();
        for f in &feats {
            let (w, h) = f.orig_size.unwrap_or((0, 0));
            ids.extend(tk.encode(&image_prompt_text(w, h, f.num_tokens), true));
        }
        for v in &videos {
            ids.extend(tk.encode(&v.prompt_text(), true));
        }
        ids.extend(prompt);
        ids
    };
    let mut emb = model.embed(&ids)?;
    let mut views: Vec<&[f32]> = feats.iter().map(|f| f.projected.as_slice()).collect();
    views.extend(videos.iter().flat_map(|v| v.projected()));
    splice(&mut emb, &ids, vision.pad_id, &views)?;
    // The tower's GPU memory goes back to the driver before the text model is uploaded.
    #[cfg(feature = "cuda")]
    if let Some(dev) = vision.gpu.as_ref().map(|g| g.dev.clone()) {
        drop((feats, videos, vision));
        dev.empty_cache()?;
    }
    Ok((ids, emb))
}
