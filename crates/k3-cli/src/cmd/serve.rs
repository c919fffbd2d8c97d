//! `k3 serve`: the OpenAI-compatible server. The flags live here (the shared groups from
//! `args.rs`: model, device, precision, KDA state, `--tp/--ep/--pp`, node); the start-up is
//! `k3_server::run_serve`, which takes them as plain `k3_server::ServeOptions`. Without
//! `--model` it serves the embedded chat model k3-chat (k3-nano where k3-chat is absent).

use std::path::PathBuf;

use super::args::{DeviceArgs, ExpertArgs, KdaStateArgs, LaunchArgs, ModelArgs, ParallelArgs, PrecisionArgs, SpecArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
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
    /// Token budget of one batched step (decode tokens + prefill chunks); default 2048 on the
    /// CPU, 8192 on a GPU (where one step of 8192 prefill tokens costs about as much per token as
    /// one of 1024 and keeps decodes waiting less: docs/gpu.md, "Serving under load").
    #[arg(long)]
    pub max_step_tokens: Option<usize>,
    #[command(flatten)]
    pub kda_state: KdaStateArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Let chat requests name local images (`file://` URLs or plain paths) that resolve inside
    /// DIR; without it, images come as `data:` URIs only.
    #[arg(long, value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Largest image or video accepted, in bytes (after base64 decoding).
    #[arg(long, default_value_t = 20 << 20)]
    pub max_image_bytes: usize,
    /// Pixels (width × height) decoded at once across all requests; images beyond it wait.
    #[arg(long, default_value_t = k3_vision::preprocess::MAX_PIXELS)]
    pub max_decode_pixels: u64,
    /// Frames sampled from one video at most (at the processor's sample_fps; chunks of 4 frames
    /// are one tower sample each); a longer video is refused with a 400.
    #[arg(long, default_value_t = k3_vision::video::VideoLimits::default().max_frames)]
    pub max_video_frames: usize,
    /// Seconds a client may take to send its request head, or stay silent while sending its
    /// body (the whole body must arrive within 4× this).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub read_timeout: f64,
    /// Seconds open requests get to finish after Ctrl-C / SIGTERM before the server exits.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub shutdown_timeout: f64,
    /// Leave `tool_choice: "auto"` to the model instead of enforcing the tools-block grammar
    /// (declared tools, arguments valid against their schemas); `required` and a named
    /// function are enforced either way.
    #[arg(long)]
    pub no_tool_grammar: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// GPU only: tokens the latent caches hold across all sequences.
    #[arg(long, default_value_t = 1 << 18)]
    pub max_cache_tokens: usize,
    /// GPU only: run decode steps eagerly instead of replaying CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    #[command(flatten)]
    pub precision: PrecisionArgs,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// Steps in flight at once on a pipeline layout (default: one per --pp stage, so every
    /// stage works on another group of sequences); 1 runs one step at a time.
    #[arg(long)]
    pub pipeline_depth: Option<usize>,
    #[command(flatten)]
    pub launch: LaunchArgs,
    #[command(flatten)]
    pub prefix: super::prefix_args::PrefixArgs,
    #[command(flatten)]
    pub experts: ExpertArgs,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let par = a.parallel.layout()?;
    if a.pipeline_depth == Some(0) {
        anyhow::bail!("--pipeline-depth 0: give 1 (one step at a time) up to --pp (a step per stage in flight)");
    }
    let model = a.model.chat_dir()?;
    let device = a.device.ordinal()?;
    let gpu_f32 = a.precision.gpu_f32(device)?;
    let opts = k3_server::ServeOptions {
        model,
        tokenizer: a.tokenizer,
        host: a.host,
        port: a.port,
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        max_model_len: a.max_model_len,
        api_key: a.api_key,
        served_model_name: a.served_model_name,
        prefill_chunk: a.prefill_chunk,
        max_step_tokens: a.max_step_tokens.unwrap_or(if device.is_some() { 8192 } else { 2048 }),
        kda_state: a.kda_state.kda_state.into(),
        spec: a.spec.config()?,
        draft_model: a.spec.draft_model.clone(),
        max_body_bytes: a.max_body_bytes,
        allowed_local_media_path: a.allowed_local_media_path,
        max_image_bytes: a.max_image_bytes,
        max_decode_pixels: a.max_decode_pixels,
        max_video_frames: a.max_video_frames,
        read_timeout: a.read_timeout,
        shutdown_timeout: a.shutdown_timeout,
        tool_grammar: !a.no_tool_grammar,
        device,
        max_cache_tokens: a.max_cache_tokens,
        cuda_graphs: !a.no_cuda_graphs,
        gpu_f32,
        kv_cache_dtype: a.precision.kv_dtype(device)?,
        prefix_cache: a.prefix.config(),
        pipeline_depth: a.pipeline_depth,
        offload: a.experts.options()?,
    };
    k3_server::run_serve(opts, par, &a.launch.node())?;
    Ok(())
}
