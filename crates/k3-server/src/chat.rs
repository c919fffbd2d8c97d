//! `POST /v1/chat/completions`.
//!
//! The request is validated field by field, rendered to XTML ids by `k3_tokenizer`, and
//! submitted to the scheduler with `<|end_of_msg|>` / `[EOS]` as stop tokens. Generated ids go
//! through the streaming [`OutputParser`], which splits them into `reasoning_content`,
//! `content` and `tool_calls`. Stop strings are matched here, on the parsed reasoning and
//! content text (one matcher per channel), so that a stop string never leaks XTML and never cuts
//! a marker; a match cancels the sequence at once. Non-streaming answers use the parser's
//! aggregate; streaming answers are SSE chunks in OpenAI's format ending with `data: [DONE]`.
//!
//! `response_format`, `tool_choice` and the `guided_*` extensions become a grammar
//! ([`crate::constrain`]) compiled before submission (a schema it cannot enforce is a 400 naming
//! its field) and enforced by the engine on every sampled token.
//!
//! Image parts ([`crate::media`]) are encoded before rendering; each renders as its media block
//! with N `<|media_pad|>` (counted in `usage.prompt_tokens`), and the request is submitted with
//! `prompt_embeds` built on the engine thread.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use k3_engine::stop::{StopCheck, StopMatcher};
use k3_engine::{Event, FinishReason, Request};
use k3_tokenizer::{render_chat, ChatRequest, OutputDelta, OutputParser, ParsedOutput, Tokenizer, ToolCall};
use k3_vision::VisionModel;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::error::{bad_param, Result, ServerError};
use crate::media;
use crate::params::{parse_body, usage, Fields, GenParams, StreamUsage};
use crate::scheduler::{Msg, Submitted};
use crate::server::{new_id, now_secs, read_body, sse_data, sse_response, AppState, SSE_DONE};

/// Chat-only fields (renderer options included: they may also sit at the top level).
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "response_format",
    "reasoning_effort",
    "chat_template_kwargs",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "parallel_tool_calls",
    "thinking",
    "enable_thinking",
    "thinking_effort",
    "add_generation_prompt",
    "response_schema",
    "modalities",
    "skip_special_tokens",
];

pub async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match run(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// Shape checks the renderer does not make (also `/tokenize`'s).
pub(crate) fn check_shapes(f: &Fields) -> Result<()> {
    match f.get("messages") {
        None => return Err(bad_param("messages", "is required")),
        Some(Value::Array(a)) if a.is_empty() => return Err(bad_param("messages", "must hold at least one message")),
        Some(Value::Array(_)) => {}
        Some(_) => return Err(bad_param("messages", "must be an array of message objects")),
    }
    crate::tools::check_chat_options(f)?;
    f.bool("parallel_tool_calls")?;
    f.bool("skip_special_tokens")?;
    Ok(())
}

async fn run(s: AppState, headers: HeaderMap, body: Body) -> Result<Response> {
    let bytes = read_body(&headers, body, &s.cfg).await?;
    let obj = parse_body(&bytes)?;
    let f = Fields(&obj);
    f.check_known(&[CHAT_FIELDS, crate::constrain::GUIDED_FIELDS].concat())?;
    let mut g = GenParams::read(&f, &["max_completion_tokens", "max_tokens"])?;
    s.check_model(g.model.as_deref())?;
    let n = crate::choices::read_n(&f, s.sched.capacity)?;
    check_shapes(&f)?;
    let want_logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top = f.usize("top_logprobs")?;
    if top.is_some_and(|n| n > 0) && !want_logprobs {
        return Err(bad_param("top_logprobs", "needs `logprobs: true`"));
    }
    if want_logprobs {
        g.sampling.logprobs = Some(top.unwrap_or(0));
    }
    // The renderer's own parse keeps key order (tool schemas are rendered as given).
    let text = std::str::from_utf8(&bytes).map_err(|_| bad_param("messages", "not UTF-8"))?;
    let mut req = ChatRequest::from_json_str(text)?;
    let opts = req.options()?;
    let thinking = opts.thinking;
    let tools = req.tools_declared();
    let constraint = match crate::constrain::chat_plan(&f, thinking, opts.add_generation_prompt, s.cfg.tool_grammar)? {
        Some(plan) => Some(crate::constrain::compile(s.grammar.as_ref().map_err(|e| crate::error::bad_request(e.clone()))?, plan).await?),
        None => None,
    };
    let (feats, vision) = images(&s, &f).await?;
    req.set_image_prompts((!feats.is_empty()).then(|| media::media_prompts(&feats)));
    let rendered = render_chat(&s.tok, &req)?;
    let prompt_tokens = rendered.ids.len();
    let (prompt, max_tokens) = s.prepare_prompt(rendered.ids, g.max_tokens, "messages", g.max_tokens_param)?;
    let mut stop_token_ids = g.stop_token_ids.clone();
    stop_token_ids.extend(["<|end_of_msg|>", "[EOS]"].iter().filter_map(|n| s.tok.special_id(n)));
    let request =
        Request { prompt, params: g.sampling.clone(), max_tokens, stop: Vec::new(), stop_token_ids, ignore_eos: g.ignore_eos, prompt_embeds: None, constraint };
    let prep = match vision {
        Some(v) if !feats.is_empty() => Some(media::splice_prep(feats, v)),
        _ => None,
    };
    let subs = crate::choices::submit_n(&s, request, prep, n).await?;
    let ctx = Ctx { id: new_id("chatcmpl"), created: now_secs(), prompt_tokens, thinking, tools, stop: g.stop, want_logprobs };
    if g.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(stream_task(s.clone(), subs, ctx, g.usage, tx));
        Ok(sse_response(rx))
    } else {
        collect(s, subs, ctx).await
    }
}

/// Reads and encodes the request's images and videos (on a blocking thread); returns their
/// features (stages pending when the tower is on the GPU) and the vision model they came from.
async fn images(s: &AppState, f: &Fields<'_>) -> Result<(Vec<media::MediaFeatures>, Option<Arc<VisionModel>>)> {
    let parts = media::find_images(f.get("messages"))?;
    let Some(first) = parts.first() else {
        return Ok((Vec::new(), None));
    };
    let Some(vision) = s.vision.clone() else {
        return Err(bad_param(&first.field, "images and videos are not accepted: this server has no vision tower for the model (no `vision_config` in config.json, or a tokenizer whose <|media_pad|> does not match); send text only"));
    };
    s.sched.check_capacity()?;
    let limits = s.media.clone();
    let v = vision.clone();
    let job = tokio::task::spawn_blocking(move || media::encode_media(&v, &parts, &limits));
    let feats = job.await.map_err(|e| ServerError::Internal(format!("the image encoder failed: {e}")))??;
    Ok((feats, Some(vision)))
}

struct Ctx {
    id: String,
    created: u64,
    prompt_tokens: usize,
    thinking: bool,
    tools: bool,
    stop: Vec<String>,
    want_logprobs: bool,
}

/// Parser + stop matching over one output.
struct ChatRun<'t> {
    tok: &'t Tokenizer,
    parser: OutputParser<'t>,
    /// Stop matchers for reasoning and content.
    stops: [StopMatcher; 2],
    has_stops: bool,
    stopped: bool,
    tokens: usize,
    /// Prompt tokens the engine restored from its prefix cache.
    cached: usize,
    reasoning: String,
    content: String,
    calls: Vec<ToolCall>,
}

impl<'t> ChatRun<'t> {
    /// The run of choice `index` (its tool calls' ids name the choice past the first).
    fn new(tok: &'t Tokenizer, ctx: &Ctx, index: usize) -> Self {
        let tail = ctx.id.rsplit('-').next().unwrap_or("0");
        let prefix = if index == 0 { format!("call_{tail}_") } else { format!("call_{tail}_{index}_") };
        ChatRun {
            tok,
            parser: OutputParser::new(tok, ctx.thinking, ctx.tools).with_id_prefix(prefix),
            stops: [StopMatcher::new(ctx.stop.clone()), StopMatcher::new(ctx.stop.clone())],
            has_stops: !ctx.stop.is_empty(),
            stopped: false,
            tokens: 0,
            cached: 0,
            reasoning: String::new(),
            content: String::new(),
            calls: Vec::new(),
        }
    }

    fn push(&mut self, ev: &Event) -> Vec<OutputDelta> {
        self.tokens += 1;
        self.cached = ev.cached_tokens;
        let d = self.parser.push(ev.token);
        self.filter(d)
    }

    fn finish(&mut self) -> Vec<OutputDelta> {
        let d = self.parser.finish();
        let mut out = self.filter(d);
        if !self.stopped {
            let r = self.stops[0].flush();
            let c = self.stops[1].flush();
            self.emit(&mut out, OutputDelta::Reasoning(r));
            self.emit(&mut out, OutputDelta::Content(c));
        }
        out
    }

    fn emit(&mut self, out: &mut Vec<OutputDelta>, d: OutputDelta) {
        match &d {
            OutputDelta::Reasoning(t) if t.is_empty() => return,
            OutputDelta::Content(t) if t.is_empty() => return,
            OutputDelta::Reasoning(t) => self.reasoning.push_str(t),
            OutputDelta::Content(t) => self.content.push_str(t),
            OutputDelta::ToolCall(c) => self.calls.push(c.clone()),
        }
        out.push(d);
    }

    /// Applies the stop strings to the parser's deltas.
    fn filter(&mut self, deltas: Vec<OutputDelta>) -> Vec<OutputDelta> {
        let mut out = Vec::new();
        for d in deltas {
            if self.stopped {
                break;
            }
            if !self.has_stops {
                self.emit(&mut out, d);
                continue;
            }
            let (ch, text) = match d {
                OutputDelta::ToolCall(c) => {
                    let r = self.stops[0].flush();
                    let t = self.stops[1].flush();
                    self.emit(&mut out, OutputDelta::Reasoning(r));
                    self.emit(&mut out, OutputDelta::Content(t));
                    self.emit(&mut out, OutputDelta::ToolCall(c));
                    continue;
                }
                OutputDelta::Reasoning(t) => (0, t),
                OutputDelta::Content(t) => {
                    let r = self.stops[0].flush();
                    self.emit(&mut out, OutputDelta::Reasoning(r));
                    (1, t)
                }
            };
            let wrap = |t: String| if ch == 0 { OutputDelta::Reasoning(t) } else { OutputDelta::Content(t) };
            match self.stops[ch].push(&text) {
                StopCheck::Continue(t) => self.emit(&mut out, wrap(t)),
                StopCheck::Stopped(t) => {
                    self.emit(&mut out, wrap(t));
                    self.stopped = true;
                }
            }
        }
        out
    }

    /// The final message: the parser's aggregate (which may move text between channels at the
    /// end, spec rule 4), or what was emitted when a stop string cut the output.
    fn result(&self) -> ParsedOutput {
        if self.has_stops {
            ParsedOutput {
                reasoning_content: Some(self.reasoning.clone()).filter(|s| !s.is_empty()),
                content: Some(self.content.clone()).filter(|s| !s.is_empty()),
                tool_calls: self.calls.clone(),
            }
        } else {
            self.parser.result()
        }
    }

    fn finish_reason(&self, f: Option<FinishReason>) -> &'static str {
        match f {
            Some(FinishReason::Length) if !self.stopped => "length",
            _ if !self.calls.is_empty() => "tool_calls",
            _ => "stop",
        }
    }

    fn logprob_entry(&self, ev: &Event) -> Value {
        let piece = |id: u32| {
            let b = self.tok.token_bytes(id).unwrap_or_default();
            (String::from_utf8_lossy(b).into_owned(), b.to_vec())
        };
        let (t, b) = piece(ev.token);
        let top: Vec<Value> = ev
            .sampled
            .top_logprobs
            .iter()
            .map(|&(id, lp)| {
                let (t, b) = piece(id);
                json!({"token": t, "logprob": lp, "bytes": b})
            })
            .collect();
        json!({"token": t, "logprob": ev.sampled.logprob, "bytes": b, "top_logprobs": top})
    }
}

fn tool_call_json(c: &ToolCall) -> Value {
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

/// Every choice's answer, read concurrently (a failed one fails the request and cancels the
/// others).
async fn collect(s: AppState, subs: Vec<Submitted>, ctx: Ctx) -> Result<Response> {
    let answers = futures_util::future::try_join_all(subs.into_iter().enumerate().map(|(i, sub)| collect_choice(&s, sub, &ctx, i))).await?;
    let completion = answers.iter().map(|a| a.1).sum();
    let cached = answers.iter().map(|a| a.2).min().unwrap_or(0);
    let body = json!({
        "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": s.cfg.served_model_name,
        "choices": answers.into_iter().map(|a| a.0).collect::<Vec<_>>(),
        "usage": usage(ctx.prompt_tokens, completion, cached),
    });
    Ok(axum::Json(body).into_response())
}

/// Choice `index`: its JSON, its completion tokens and the prompt tokens it found cached.
async fn collect_choice(s: &AppState, mut sub: Submitted, ctx: &Ctx, index: usize) -> Result<(Value, usize, usize)> {
    let tok = s.tok.clone();
    let mut run = ChatRun::new(&tok, ctx, index);
    let mut logprobs = Vec::new();
    let finish = loop {
        match sub.rx.recv().await {
            Some(Msg::Token(ev)) => {
                run.push(&ev);
                if ctx.want_logprobs {
                    logprobs.push(run.logprob_entry(&ev));
                }
                if run.stopped {
                    s.sched.cancel(sub.id);
                    break None;
                }
                if ev.finish.is_some() {
                    break ev.finish;
                }
            }
            Some(Msg::Failed(m)) => return Err(crate::error::ServerError::Internal(m)),
            None => return Err(crate::error::ServerError::Internal("the engine dropped the request".into())),
        }
    };
    run.finish();
    let out = run.result();
    let calls: Vec<Value> = out.tool_calls.iter().map(tool_call_json).collect();
    let content = match &out.content {
        Some(c) => Value::String(c.clone()),
        None if calls.is_empty() && out.reasoning_content.is_none() => Value::String(String::new()),
        None => Value::Null,
    };
    let mut message = json!({"role": "assistant", "content": content, "reasoning_content": out.reasoning_content});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    let choice = json!({
        "index": index, "message": message,
        "logprobs": if ctx.want_logprobs { json!({"content": logprobs}) } else { Value::Null },
        "finish_reason": run.finish_reason(finish),
    });
    Ok((choice, run.tokens, run.cached))
}

fn delta_json(d: &OutputDelta) -> Value {
    match d {
        OutputDelta::Reasoning(t) => json!({"reasoning_content": t}),
        OutputDelta::Content(t) => json!({"content": t}),
        OutputDelta::ToolCall(c) => json!({"tool_calls": [{
            "index": c.index, "id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }]}),
    }
}

/// (completion tokens, fewest cached prompt tokens) over every choice so far.
fn so_far(runs: &[ChatRun]) -> (usize, usize) {
    // Cached tokens are known once a choice has its first token.
    (runs.iter().map(|r| r.tokens).sum(), runs.iter().filter(|r| r.tokens > 0).map(|r| r.cached).min().unwrap_or(0))
}

/// The SSE stream of every choice, interleaved as their tokens come (each chunk names its
/// choice's `index`); the usage chunk and `[DONE]` once all have finished.
async fn stream_task(s: AppState, mut subs: Vec<Submitted>, ctx: Ctx, su: StreamUsage, tx: mpsc::Sender<Bytes>) {
    let tok = s.tok.clone();
    let mut runs: Vec<ChatRun> = (0..subs.len()).map(|i| ChatRun::new(&tok, &ctx, i)).collect();
    let mut open = vec![true; subs.len()];
    let model = s.cfg.served_model_name.clone();
    // `so_far`: (completion tokens, cached tokens) of all choices, for continuous usage.
    let chunk = |i: usize, delta: Value, finish: Option<&str>, logprobs: Option<Value>, so_far: (usize, usize)| {
        let mut c = json!({
            "id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": model,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs.map(|l| json!({"content": [l]})), "finish_reason": finish}],
        });
        su.put(&mut c, ctx.prompt_tokens, so_far);
        sse_data(&c)
    };
    for i in 0..subs.len() {
        if tx.send(chunk(i, json!({"role": "assistant", "content": ""}), None, None, (0, 0))).await.is_err() {
            return;
        }
    }
    while open.iter().any(|&o| o) {
        // A client that goes away while its request waits (queued, or between tokens) drops
        // `subs` here, which cancels every sequence at once.
        let (i, msg) = tokio::select! {
            m = crate::choices::next_event(&mut subs, &open) => m,
            _ = tx.closed() => return,
        };
        let finish = match msg {
            Some(Msg::Token(ev)) => {
                let deltas = runs[i].push(&ev);
                let now = so_far(&runs);
                let run = &runs[i];
                let mut lp = ctx.want_logprobs.then(|| run.logprob_entry(&ev));
                if lp.is_some() && deltas.is_empty() && !run.stopped && tx.send(chunk(i, json!({}), None, lp.take(), now)).await.is_err() {
                    return;
                }
                for d in &deltas {
                    if tx.send(chunk(i, delta_json(d), None, lp.take(), now)).await.is_err() {
                        return; // client gone: dropping `subs` cancels the sequences
                    }
                }
                if run.stopped {
                    s.sched.cancel(subs[i].id);
                    None
                } else if ev.finish.is_some() {
                    ev.finish
                } else {
                    continue;
                }
            }
            Some(Msg::Failed(m)) => {
                let e = crate::error::ServerError::Internal(m);
                let _ = tx.send(sse_data(&e.to_json())).await;
                let _ = tx.send(Bytes::from_static(SSE_DONE.as_bytes())).await;
                return;
            }
            None => return,
        };
        open[i] = false;
        let now = so_far(&runs);
        for d in runs[i].finish() {
            if tx.send(chunk(i, delta_json(&d), None, None, now)).await.is_err() {
                return;
            }
        }
        let reason = runs[i].finish_reason(finish);
        if tx.send(chunk(i, json!({}), Some(reason), None, now)).await.is_err() {
            return;
        }
    }
    if su.on() {
        let (completion, cached) = so_far(&runs);
        let u = json!({
            "id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": model,
            "choices": [], "usage": usage(ctx.prompt_tokens, completion, cached),
        });
        let _ = tx.send(sse_data(&u)).await;
    }
    let _ = tx.send(Bytes::from_static(SSE_DONE.as_bytes())).await;
}
