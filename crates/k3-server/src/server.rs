//! The HTTP side: shared state, the router, the auth + request-counting middleware, body
//! reading with a size limit, the small endpoints (`/v1/models`, `/health`, `/metrics`), SSE
//! plumbing, and start-up ([`serve`], [`spawn_background`] for tests).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use k3_engine::GrammarEnv;
use k3_tokenizer::Tokenizer;
use k3_vision::VisionModel;
use tokio::sync::mpsc;

use crate::backend::Backend;
use crate::error::{bad_param, Result, ServerError};
use crate::media::MediaLimits;
use crate::metrics::Metrics;
use crate::scheduler::SchedulerHandle;

/// Server settings (from `k3 serve` flags, or set directly by tests).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub served_model_name: String,
    pub api_key: Option<String>,
    /// Requests running at once (the backend's batch size).
    pub max_batch: usize,
    /// Requests allowed to wait beyond `max_batch` before answering 429.
    pub max_queue: usize,
    /// Context limit enforced by the server (clipped to the model's).
    pub max_model_len: Option<usize>,
    pub max_body_bytes: usize,
    /// Directory that local image paths (`file://` or plain) must resolve inside; `None`
    /// refuses local paths (images then come as `data:` URIs only).
    pub allowed_local_media_path: Option<PathBuf>,
    /// Largest encoded image accepted, in bytes.
    pub max_image_bytes: usize,
    /// Pixels (width × height) being decoded at once across all requests; an image waits for
    /// its share, so concurrent large images cannot multiply the decoding memory (≈ 6 bytes per
    /// pixel at the peak). One image larger than the budget decodes alone.
    pub max_decode_pixels: u64,
    /// Frames sampled from one video at most (`--max-video-frames`); more is a 400.
    pub max_video_frames: usize,
    /// How long a client may take to send its request head, and may stay silent while sending
    /// its body (the whole body must arrive within 4× this); 408 or a closed connection after.
    pub read_timeout: Duration,
    /// On shutdown, how long open requests get to finish before the server exits anyway.
    pub shutdown_timeout: Duration,
    /// Enforce `tool_choice: "auto"` (the default with tools) with the tools-block grammar:
    /// once the model opens a tools block, only declared tools with valid arguments. `false`
    /// (`--no-tool-grammar`) leaves `auto` to the model; `required` and named choices are
    /// enforced either way.
    pub tool_grammar: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served_model_name: "k3".into(),
            api_key: None,
            max_batch: 32,
            max_queue: 64,
            max_model_len: None,
            max_body_bytes: 4 << 20,
            allowed_local_media_path: None,
            max_image_bytes: 20 << 20,
            max_decode_pixels: k3_vision::preprocess::MAX_PIXELS,
            max_video_frames: k3_vision::video::VideoLimits::default().max_frames,
            read_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(10),
            tool_grammar: true,
        }
    }
}

pub struct Inner {
    pub sched: SchedulerHandle,
    pub tok: Arc<Tokenizer>,
    pub cfg: ServerConfig,
    /// The context limit in force: min(model, --max-model-len).
    pub max_context: usize,
    pub vocab: usize,
    pub created: u64,
    /// The vision tower, when the model has one (image parts are refused otherwise).
    pub vision: Option<Arc<VisionModel>>,
    /// Where images may come from (the local directory canonicalised at start-up).
    pub media: MediaLimits,
    /// The token trie output constraints compile against, or why there is none (a model whose
    /// vocabulary does not cover the tokenizer: the server runs, constrained requests are 400s).
    pub grammar: std::result::Result<Arc<GrammarEnv>, String>,
}

pub type AppState = Arc<Inner>;

pub fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A response id unique within this process (and very likely across restarts).
pub fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("{prefix}-{:x}{:04x}", t, N.fetch_add(1, Relaxed) & 0xffff)
}

impl Inner {
    /// 404 unless `model` is absent or the served name.
    pub fn check_model(&self, model: Option<&str>) -> Result<()> {
        match model {
            Some(m) if m != self.cfg.served_model_name => Err(ServerError::NotFound {
                message: format!("the model `{m}` does not exist; this server serves `{}`", self.cfg.served_model_name),
                param: Some("model".into()),
                code: "model_not_found",
            }),
            _ => Ok(()),
        }
    }

    /// Checks the prompt against the context and resolves `max_tokens`: without one, the rest
    /// of the context (OpenAI's behaviour); with one that prompt + `max_tokens` cannot hold, a
    /// 400 naming `max_tokens_param`.
    pub fn prepare_prompt(&self, ids: Vec<u32>, max_tokens: Option<usize>, param: &str, max_tokens_param: &str) -> Result<(Vec<u32>, usize)> {
        if ids.is_empty() {
            return Err(bad_param(param, "the prompt is empty"));
        }
        if ids.len() >= self.max_context {
            return Err(ServerError::BadRequest {
                message: format!(
                    "this model's maximum context length is {} tokens, but the prompt has {} tokens (at least one more is needed for the completion)",
                    self.max_context,
                    ids.len()
                ),
                param: Some(param.into()),
                code: Some("context_length_exceeded"),
            });
        }
        let room = self.max_context - ids.len();
        match max_tokens {
            Some(n) if n > room => Err(ServerError::BadRequest {
                message: format!(
                    "`{max_tokens_param}` is {n}, but this model's maximum context length is {} tokens and the prompt has {}: at most {room} tokens can be generated; lower `{max_tokens_param}` (or omit it to use the rest of the context)",
                    self.max_context,
                    ids.len()
                ),
                param: Some(max_tokens_param.into()),
                code: Some("context_length_exceeded"),
            }),
            Some(n) => Ok((ids, n)),
            None => Ok((ids, room)),
        }
    }
}

/// Bytes of an oversized body read and discarded before answering 413, so that a client that
/// sends its whole body before reading the answer sees the 413 rather than a reset connection.
const DRAIN_CAP: u64 = 64 << 20;

/// Reads a body up to `cfg.max_body_bytes` (413 beyond), within `cfg.read_timeout` between
/// chunks and 4× that overall (408 otherwise: a client that stops sending cannot hold a handler).
pub async fn read_body(headers: &HeaderMap, body: Body, cfg: &ServerConfig) -> Result<Vec<u8>> {
    let idle = cfg.read_timeout;
    let whole = tokio::time::Instant::now() + idle * 4;
    let slow = || {
        ServerError::Timeout(format!(
            "the request body did not arrive in time (no data for {} s, or not all of it within {} s)",
            idle.as_secs_f32(),
            (idle * 4).as_secs_f32()
        ))
    };
    let limit = cfg.max_body_bytes;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64 + DRAIN_CAP) {
        return Err(ServerError::TooLarge { limit });
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut seen = 0u64;
    loop {
        let next = tokio::time::timeout_at(whole.min(tokio::time::Instant::now() + idle), stream.next());
        let Some(chunk) = next.await.map_err(|_| slow())? else { break };
        let c = chunk.map_err(|e| crate::error::bad_request(format!("could not read the request body: {e}")))?;
        seen += c.len() as u64;
        if seen > limit as u64 + DRAIN_CAP {
            break;
        }
        if seen <= limit as u64 {
            buf.extend_from_slice(&c);
        }
    }
    if seen > limit as u64 {
        return Err(ServerError::TooLarge { limit });
    }
    Ok(buf)
}

/// One SSE `data:` event.
pub fn sse_data(v: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub const SSE_DONE: &str = "data: [DONE]\n\n";

/// A `text/event-stream` response fed by `rx`.
pub fn sse_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<Bytes, Infallible>(b), rx)) });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/event-stream"));
    h.insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-cache"));
    resp
}

async fn gate(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    let needs_key = path.starts_with("/v1/") || path == "/tokenize" || path == "/detokenize";
    let resp = match (&s.cfg.api_key, needs_key) {
        (Some(key), true) => {
            let got = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
            match got {
                Some(k) if constant_time_eq(k.trim().as_bytes(), key.as_bytes()) => next.run(req).await,
                Some(_) => ServerError::Unauthorized("incorrect API key provided".into()).into_response(),
                None => ServerError::Unauthorized("missing API key: send `Authorization: Bearer KEY`".into()).into_response(),
            }
        }
        _ => next.run(req).await,
    };
    s.metrics().count_request(&path, resp.status().as_u16());
    resp
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Inner {
    pub fn metrics(&self) -> &Metrics {
        &self.sched.metrics
    }

    /// Token `id`'s text as logprobs and `/tokenize` show it (bytes that are not UTF-8 on
    /// their own lossily; empty for an unknown id).
    pub fn piece(&self, id: u32) -> String {
        String::from_utf8_lossy(self.tok.token_bytes(id).unwrap_or_default()).into_owned()
    }
}

async fn models(State(s): State<AppState>) -> Response {
    let m = serde_json::json!({
        "object": "list",
        "data": [{
            "id": s.cfg.served_model_name, "object": "model", "created": s.created, "owned_by": "k3rs",
            "max_model_len": s.max_context,
            // The ids a prompt of token ids may hold (the tokenizer's and the model's, both).
            "vocab_size": s.vocab.min(s.tok.vocab_size()),
        }],
    });
    axum::Json(m).into_response()
}

async fn health(State(s): State<AppState>) -> Response {
    let m = s.metrics();
    let body = serde_json::json!({
        "status": "ok",
        "running": m.running.load(Relaxed),
        "waiting": m.waiting.load(Relaxed),
    });
    axum::Json(body).into_response()
}

async fn metrics_text(State(s): State<AppState>) -> Response {
    let text = s.metrics().render(&s.cfg.served_model_name);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn not_found(req: Request) -> Response {
    ServerError::NotFound { message: format!("no route for {}", req.uri().path()), param: None, code: "not_found" }.into_response()
}

async fn not_allowed() -> Response {
    ServerError::MethodNotAllowed.into_response()
}

/// Starts the scheduler thread around `backend` and builds the router (text only).
pub fn build(backend: Box<dyn Backend>, tok: Arc<Tokenizer>, cfg: ServerConfig) -> Result<Router> {
    build_with_vision(backend, tok, cfg, None)
}

/// The media limits in force; checks that the tokenizer's `<|media_pad|>` is the vision
/// model's pad id.
fn media_limits(tok: &Tokenizer, cfg: &ServerConfig, vision: Option<&VisionModel>) -> Result<MediaLimits> {
    // The chat format cannot be rendered or stopped without these: refuse to start rather than
    // failing every chat request.
    for name in ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"] {
        if tok.special_id(name).is_none() {
            return Err(ServerError::Config(format!(
                "the tokenizer has no special token {name}, which the Kimi K3 chat format needs; pass the model's own tokenizer (--tokenizer DIR with tiktoken.model and tokenizer_config.json)"
            )));
        }
    }
    if let Some(v) = vision {
        let pad = tok.special_id("<|media_pad|>");
        if pad != Some(v.pad_id) {
            return Err(ServerError::Config(format!(
                "the tokenizer's <|media_pad|> is {pad:?} but the model's media_placeholder_token_id is {}; images could not be spliced",
                v.pad_id
            )));
        }
    }
    let allowed = match &cfg.allowed_local_media_path {
        None => None,
        Some(d) => {
            let c = d.canonicalize().map_err(|e| ServerError::Config(format!("--allowed-local-media-path {}: {e}", d.display())))?;
            if !c.is_dir() {
                return Err(ServerError::Config(format!("--allowed-local-media-path {}: not a directory", d.display())));
            }
            Some(c)
        }
    };
    let video = k3_vision::video::VideoLimits { max_frames: cfg.max_video_frames, ..Default::default() };
    Ok(MediaLimits {
        allowed_local_media_path: allowed,
        max_image_bytes: cfg.max_image_bytes,
        video,
        decode: crate::media::DecodeBudget::new(cfg.max_decode_pixels),
    })
}

/// [`build`] with an optional vision tower for image parts in chat requests.
pub fn build_with_vision(backend: Box<dyn Backend>, tok: Arc<Tokenizer>, cfg: ServerConfig, vision: Option<Arc<VisionModel>>) -> Result<Router> {
    let media = media_limits(&tok, &cfg, vision.as_deref())?;
    let model_ctx = backend.max_context();
    let vocab = backend.vocab_size();
    let max_context = cfg.max_model_len.map_or(model_ctx, |m| m.min(model_ctx)).max(1);
    let capacity = cfg.max_batch.max(1) + cfg.max_queue;
    // The grammar's end of sentence stands for the request's stop tokens in masks.
    let eos = tok.special_id("[EOS]").or_else(|| tok.special_id("<|end_of_msg|>")).unwrap_or(0);
    let grammar = GrammarEnv::new(tok.clone(), vocab, eos).map(Arc::new).map_err(|e| format!("this model cannot take output constraints: {e}"));
    let sched = SchedulerHandle::spawn(backend, Arc::new(Metrics::default()), capacity)?;
    let state: AppState = Arc::new(Inner { sched, tok, cfg, max_context, vocab, created: now_secs(), vision, media, grammar });
    Ok(Router::new()
        .route("/v1/chat/completions", post(crate::chat::chat_completions))
        .route("/v1/completions", post(crate::completions::completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(crate::tokenize::tokenize))
        .route("/detokenize", post(crate::tokenize::detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), gate))
        .with_state(state))
}

/// Serves `router` on `listener` until `shutdown` resolves, with the default timeouts
/// ([`crate::conn::serve_connections`] takes them from a [`ServerConfig`]).
pub async fn serve(listener: tokio::net::TcpListener, router: Router, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Result<()> {
    crate::conn::serve_connections(listener, router, &ServerConfig::default(), shutdown).await
}

/// A server running on its own thread and runtime (for tests and embedding).
pub struct BackgroundServer {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for BackgroundServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds `127.0.0.1:0` and serves on a background thread.
pub fn spawn_background(backend: Box<dyn Backend>, tok: Arc<Tokenizer>, cfg: ServerConfig) -> Result<BackgroundServer> {
    spawn_background_with_vision(backend, tok, cfg, None)
}

/// [`spawn_background`] with an optional vision tower.
pub fn spawn_background_with_vision(
    backend: Box<dyn Backend>,
    tok: Arc<Tokenizer>,
    cfg: ServerConfig,
    vision: Option<Arc<VisionModel>>,
) -> Result<BackgroundServer> {
    let io = |what: &str| {
        let what = what.to_owned();
        move |source| ServerError::Io { what, source }
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(io("starting the runtime"))?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).map_err(io("binding 127.0.0.1:0"))?;
    let addr = listener.local_addr().map_err(io("reading the bound address"))?;
    let limits = cfg.clone();
    let router = build_with_vision(backend, tok, cfg, vision)?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("k3-http".into())
        .spawn(move || {
            let _ = rt.block_on(crate::conn::serve_connections(listener, router, &limits, async move {
                let _ = stopped.await;
            }));
            rt.shutdown_timeout(Duration::from_secs(1));
        })
        .map_err(io("spawning the server thread"))?;
    Ok(BackgroundServer { addr, stop: Some(stop), thread: Some(thread) })
}
