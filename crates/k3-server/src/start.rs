//! `k3 serve`'s start-up: [`ServeOptions`] (plain values; the flags are parsed by the `k3`
//! binary) and [`run_serve`], the entry point it calls.
//!
//! Loads the model on the runner the flags ask for (one CPU model, the ranks of a `--tp/--ep/--pp`
//! layout as threads, one GPU, or with `--device cuda` one process per GPU;
//! `k3_engine::dist::process::launch`: only rank 0 goes on to serve, the other ranks run rank
//! 0's steps until it stops, then exit 0), the tokenizer, by default the model directory's `tiktoken.model`, and
//! the vision tower when `config.json` has a `vision_config`),
//! starts the engine on its scheduler thread, binds `--host:--port` (loopback by default) and
//! serves until Ctrl-C / SIGTERM (or a rank of its world fails: then it stops and exits with
//! that rank's error), then gives open requests `--shutdown-timeout` seconds. The line `k3 serve: listening on http://ADDR` is printed to
//! stdout once the socket is bound, so scripts can wait for it.

use std::path::PathBuf;
use std::sync::Arc;

use k3_engine::dist::launch::NodeArgs;
use k3_engine::dist::process::{self, Finish, Role, FINISH_LIMIT};
use k3_engine::dist::runner::RunnerSpec;
use k3_engine::spec::draft::DraftSpec;
use k3_engine::{Engine, EngineConfig, PrefixConfig};
use k3_model::layers::kda::StateDType;
use k3_model::{Checkpoint, Parallel};
use k3_tokenizer::Tokenizer;
use k3_vision::VisionModel;

use crate::conn::serve_connections;
use crate::error::{Result, ServerError};
use crate::server::{build_with_vision, ServerConfig};

/// What `k3 serve` starts: the model, the runner, the listener and the server's limits. The
/// `k3` binary fills it from its flags (`crates/k3-cli/src/cmd/serve.rs`, where each field's
/// flag is documented); this crate has no command-line parser.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Model directory (config.json + safetensors).
    pub model: PathBuf,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json); `None`: the model directory.
    pub tokenizer: Option<PathBuf>,
    pub host: String,
    /// 0 picks a free port (the bound address is printed).
    pub port: u16,
    pub max_batch: usize,
    pub max_queue: usize,
    pub max_model_len: Option<usize>,
    pub api_key: Option<String>,
    /// `None`: the model directory's name.
    pub served_model_name: Option<String>,
    pub prefill_chunk: usize,
    pub max_step_tokens: usize,
    pub kda_state: StateDType,
    /// Speculative decoding (`--speculative`, `--num-speculative-tokens`).
    pub spec: k3_engine::SpecConfig,
    /// `--draft-model`: the separate draft model of `--speculative draft`.
    pub draft_model: Option<PathBuf>,
    pub max_body_bytes: usize,
    pub allowed_local_media_path: Option<PathBuf>,
    pub max_image_bytes: usize,
    pub max_decode_pixels: u64,
    pub max_video_frames: usize,
    /// Seconds (validated here: positive and finite).
    pub read_timeout: f64,
    pub shutdown_timeout: f64,
    /// See [`ServerConfig::tool_grammar`].
    pub tool_grammar: bool,
    /// `None` for the CPU, `Some(ordinal)` for GPU `cuda:N`.
    pub device: Option<usize>,
    /// GPU only: tokens the latent caches hold across all sequences.
    pub max_cache_tokens: usize,
    /// GPU only: replay decode steps as CUDA graphs.
    pub cuda_graphs: bool,
    /// GPU only: the f32 reference precision instead of bf16.
    pub gpu_f32: bool,
    /// GPU: `--kv-cache-dtype`.
    pub kv_cache_dtype: k3_model::capacity::KvDtype,
    /// The prefix cache (`--prefix-cache-grid`, `--prefix-cache-mem`); `None`: `--no-prefix-cache`.
    pub prefix_cache: Option<PrefixConfig>,
    /// Steps in flight at once on a pipeline layout (`--pipeline-depth`; `None`: one per stage).
    pub pipeline_depth: Option<usize>,
    /// Where the routed experts are (`--experts-on`, `--gpu-mem`, the expert cache).
    pub offload: k3_model::offload::OffloadOptions,
}

/// Runs `k3 serve` until interrupted, the model laid out as `par` (`--tp/--ep/--pp`, parsed by
/// the `k3` binary's shared flag group), this process placed in its world by `node`
/// (`--nnodes --node-rank --master-addr`). A rank ≠ 0 returns once rank 0 has stopped.
pub fn run_serve(a: ServeOptions, par: Parallel, node: &NodeArgs) -> Result<()> {
    let model_dir = a.model.clone();
    let ck = Checkpoint::open(&model_dir)?;
    let (device, gpu_f32) = (a.device, a.gpu_f32);
    let tok_dir = a.tokenizer.clone().unwrap_or_else(|| model_dir.clone());
    if a.max_batch == 0 {
        return Err(ServerError::Config("--max-batch must be at least 1".into()));
    }
    let secs = |flag: &str, v: f64| {
        if v.is_finite() && v > 0.0 && v < 1e6 {
            Ok(std::time::Duration::from_secs_f64(v))
        } else {
            Err(ServerError::Config(format!("{flag} {v}: give a positive number of seconds")))
        }
    };
    let read_timeout = secs("--read-timeout", a.read_timeout)?;
    let shutdown_timeout = secs("--shutdown-timeout", a.shutdown_timeout)?;
    let mut ecfg = EngineConfig {
        max_batch: a.max_batch,
        prefill_chunk: a.prefill_chunk.max(1),
        max_step_tokens: a.max_step_tokens.max(a.max_batch + 1),
        kda_state: a.kda_state,
        spec: a.spec,
        draft: None,
        prefix: a.prefix_cache.clone(),
        pipeline_depth: a.pipeline_depth,
    };
    let spec = RunnerSpec {
        par,
        device,
        kda_state: ecfg.kda_state,
        max_seqs: a.max_batch,
        max_cache_tokens: a.max_cache_tokens,
        cuda_graphs: a.cuda_graphs,
        gpu_f32,
        kv_cache_dtype: a.kv_cache_dtype,
        offload: a.offload.clone(),
    };
    let (runner, finish) = match process::launch(&ck, &spec, node) {
        Ok(Role::Leader(r, f)) => (r, f),
        Ok(Role::Worker) => return Ok(()), // rank 0 served; it has stopped
        Err(e) => {
            return Err(ServerError::Config(match device {
                Some(n) => format!("--device cuda:{n}: {e}"),
                None => e.to_string(),
            }))
        }
    };
    if let Some(dir) = &a.draft_model {
        // On rank 0 only: the draft model runs beside the target there.
        let d = DraftSpec::load(dir, &ck.config, &model_dir.display().to_string()).map_err(|e| ServerError::Config(e.to_string()))?;
        ecfg.draft = Some(d);
    }
    let tok = Arc::new(Tokenizer::from_dir(&tok_dir)?);
    let vision = match ck.config.vision_config {
        Some(_) => Some(Arc::new(load_vision(&ck, device, gpu_f32)?)),
        None => None,
    };
    // A tokenizer whose <|media_pad|> is not the model's pad id cannot carry images: serve text.
    let vision = vision.filter(|v| {
        let pad = tok.special_id("<|media_pad|>");
        let ok = pad == Some(v.pad_id);
        if !ok {
            eprintln!(
                "k3 serve: warning: the tokenizer's <|media_pad|> is {pad:?} but the model's media_placeholder_token_id is {}; image inputs are disabled",
                v.pad_id
            );
        }
        ok
    });
    if let Some(x) = runner.experts_summary() {
        eprintln!("k3 serve: {x}");
    }
    let engine = Engine::with_runner(runner, Some(tok.clone()), ecfg);
    match (engine.prefix_status(), &a.prefix_cache) {
        (Ok(Some(_)), Some(p)) => {
            eprintln!("k3 serve: prefix cache on (grid {} tokens, pool {:.2} GiB)", p.grid, p.mem_bytes as f64 / (1u64 << 30) as f64)
        }
        (Err(why), _) => eprintln!("k3 serve: prefix cache off: {why}"),
        _ => eprintln!("k3 serve: prefix cache off (--no-prefix-cache)"),
    }
    if let Err(why) = engine.speculating() {
        eprintln!("k3 serve: speculative decoding off: {why}");
    }
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        let canon = model_dir.canonicalize().unwrap_or_else(|_| model_dir.clone());
        canon.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "k3".into())
    });
    let cfg = ServerConfig {
        served_model_name: name,
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        max_model_len: a.max_model_len,
        max_body_bytes: a.max_body_bytes,
        allowed_local_media_path: a.allowed_local_media_path.clone(),
        max_image_bytes: a.max_image_bytes,
        max_decode_pixels: a.max_decode_pixels,
        max_video_frames: a.max_video_frames,
        read_timeout,
        shutdown_timeout,
        tool_grammar: a.tool_grammar,
    };
    let io = |what: String| move |source| ServerError::Io { what, source };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(io("starting the async runtime".into()))?;
    let finish_limit = shutdown_timeout + FINISH_LIMIT;
    let world = Arc::new(finish);
    let stopped = world.clone();
    let r: Result<()> = rt.block_on(async move {
        let router = build_with_vision(Box::new(engine), tok, cfg.clone(), vision)?;
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.map_err(io(format!("binding {addr} (--host/--port)")))?;
        let bound = listener.local_addr().map_err(io("reading the bound address".into()))?;
        println!("k3 serve: listening on http://{bound} (model `{}`)", cfg.served_model_name);
        serve_connections(listener, router, &cfg, shutdown_signal(stopped)).await?;
        eprintln!("k3 serve: stopped");
        Ok(())
    });
    // Image encodes still running on blocking threads must not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    // The engine goes when its scheduler thread sees the last handle gone; that shuts a world
    // of processes down (its workers exit), or this does after the limit.
    let failed = world.failed();
    let finished = world.wait(finish_limit);
    r?;
    finished.map_err(|e| if failed { ServerError::Engine(e) } else { ServerError::Config(format!("stopping the workers: {e}")) })
}

/// The vision tower; with `--device cuda:N` (unless `K3_VISION_GPU=0`) uploaded to GPU N in the text
/// model's precision (its stages then run on the engine thread, between steps:
/// `media::splice_prep`); else on the CPU.
fn load_vision(ck: &k3_model::Checkpoint, device: Option<usize>, gpu_f32: bool) -> Result<VisionModel> {
    let err = |e: k3_vision::VisionError| ServerError::Config(format!("loading the vision tower: {e}"));
    #[allow(unused_mut)]
    let mut v = VisionModel::load(ck).map_err(err)?;
    #[cfg(feature = "cuda")]
    if let Some(n) = device.filter(|_| k3_vision::gpu_tower_enabled()) {
        let dev = k3_vision::cuda::CudaDevice::new(n).map_err(|e| ServerError::Config(format!("--device cuda:{n}: the vision tower: {e}")))?;
        v.attach_cuda(&dev, k3_engine::gpu::precision(gpu_f32))
            .map_err(|e| ServerError::Config(format!("--device cuda:{n}: uploading the vision tower: {e}")))?;
        // The server splices only the projected features.
        v.set_gpu_stages(false);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (device, gpu_f32);
    Ok(v)
}

/// Ctrl-C, SIGTERM, or the end of the world this server leads (a rank failed).
async fn shutdown_signal(world: Arc<Finish>) {
    let failed = async move {
        while !world.failed() {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        eprintln!("k3 serve: a rank of the parallel world failed; stopping");
    };
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {}, _ = failed => {} }
}
