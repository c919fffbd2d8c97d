//! `k3 serve`: the command-line arguments and the entry point the `k3` binary calls.
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
use k3_engine::{Engine, EngineConfig};
use k3_model::{Checkpoint, Parallel};
use k3_tokenizer::Tokenizer;
use k3_vision::VisionModel;

use crate::conn::serve_connections;
use crate::error::{Result, ServerError};
use crate::server::{build_with_vision, ServerConfig};

/// `--kda-state f32|bf16`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaStateArg {
    F32,
    Bf16,
}

impl From<KdaStateArg> for k3_model::layers::kda::StateDType {
    fn from(a: KdaStateArg) -> Self {
        match a {
            KdaStateArg::F32 => Self::F32,
            KdaStateArg::Bf16 => Self::Bf16,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Model directory (config.json + safetensors); `k3 serve` defaults to the embedded k3-nano.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Tokenizer directory (tiktoken.model + tokenizer_config.json); default: the model directory.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port; 0 picks a free one (the bound address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Sequences decoded together in one batch.
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// Requests allowed to wait beyond --max-batch; more are answered 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Context limit in tokens (default: the model's).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1/* routes.
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model name clients send and /v1/models lists (default: the model directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Largest prefill chunk of one sequence per step.
    #[arg(long, default_value_t = 512)]
    pub prefill_chunk: usize,
    /// Token budget of one batched step (decode tokens + prefill chunks).
    #[arg(long, default_value_t = 2048)]
    pub max_step_tokens: usize,
    /// KDA recurrent-state storage: f32 (reference) or bf16 (half the memory, approximate).
    #[arg(long, value_enum, default_value = "f32")]
    pub kda_state: KdaStateArg,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Let chat requests name local images (`file://` URLs or plain paths) that resolve inside
    /// DIR; without it, images come as `data:` URIs only.
    #[arg(long, value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Largest image accepted, in bytes (after base64 decoding).
    #[arg(long, default_value_t = 20 << 20)]
    pub max_image_bytes: usize,
    /// Pixels (width × height) decoded at once across all requests; images beyond it wait.
    #[arg(long, default_value_t = k3_vision::preprocess::MAX_PIXELS)]
    pub max_decode_pixels: u64,
    /// Seconds a client may take to send its request head, or stay silent while sending its
    /// body (the whole body must arrive within 4× this).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub read_timeout: f64,
    /// Seconds open requests get to finish after Ctrl-C / SIGTERM before the server exits.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub shutdown_timeout: f64,
    /// cpu, or cuda / cuda:N to run the model on a GPU (needs a k3 built with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// GPU only: tokens the latent caches hold across all sequences.
    #[arg(long, default_value_t = 1 << 18)]
    pub max_cache_tokens: usize,
    /// GPU only: run decode steps eagerly instead of replaying CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// GPU precision: bf16 (the serving path) or f32 (the reference path: slow, for checks).
    #[arg(long)]
    pub precision: Option<String>,
}

/// Parses `--device`: `None` for the CPU, `Some(ordinal)` for `cuda` / `cuda:N`.
pub fn parse_device(d: &str) -> std::result::Result<Option<usize>, String> {
    match d {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => d.strip_prefix("cuda:").and_then(|n| n.parse().ok()).map(Some).ok_or_else(|| format!("--device `{d}`: use cpu, cuda or cuda:N")),
    }
}

/// Runs `k3 serve` until interrupted, the model laid out as `par` (`--tp/--ep/--pp`, parsed by
/// the `k3` binary's shared flag group), this process placed in its world by `node`
/// (`--nnodes --node-rank --master-addr`). A rank ≠ 0 returns once rank 0 has stopped.
pub fn run_serve(a: ServeArgs, par: Parallel, node: &NodeArgs) -> Result<()> {
    let model_dir = a.model.clone().ok_or_else(|| ServerError::Config("no --model given".into()))?;
    let ck = Checkpoint::open(&model_dir)?;
    let device = parse_device(&a.device).map_err(ServerError::Config)?;
    let gpu_f32 = match (a.precision.as_deref(), device) {
        (None, _) => false,
        (Some(_), None) => {
            return Err(ServerError::Config("--precision applies to --device cuda (the CPU model always computes in f32): drop it or add --device cuda".into()))
        }
        (Some("bf16"), Some(_)) => false,
        (Some("f32"), Some(_)) => true,
        (Some(p), Some(_)) => return Err(ServerError::Config(format!("--precision `{p}` is not one of bf16, f32"))),
    };
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
    let ecfg = EngineConfig {
        max_batch: a.max_batch,
        prefill_chunk: a.prefill_chunk.max(1),
        max_step_tokens: a.max_step_tokens.max(a.max_batch + 1),
        kda_state: a.kda_state.into(),
    };
    let spec = RunnerSpec {
        par,
        device,
        kda_state: ecfg.kda_state,
        max_seqs: a.max_batch,
        max_cache_tokens: a.max_cache_tokens,
        cuda_graphs: !a.no_cuda_graphs,
        gpu_f32,
    };
    let (runner, finish) = match process::launch(&ck, &spec, node) {
        Ok(Role::Leader(r, f)) => (r, f),
        Ok(Role::Worker) => return Ok(()), // rank 0 served; it has stopped
        Err(e) => return Err(ServerError::Config(if device.is_some() { format!("--device {}: {e}", a.device) } else { e.to_string() })),
    };
    let tok = Arc::new(Tokenizer::from_dir(&tok_dir)?);
    let vision = match ck.config.vision_config {
        Some(_) => Some(Arc::new(VisionModel::load(&ck).map_err(|e| ServerError::Config(format!("loading the vision tower: {e}")))?)),
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
    let engine = Engine::with_runner(runner, Some(tok.clone()), ecfg);
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
        read_timeout,
        shutdown_timeout,
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
