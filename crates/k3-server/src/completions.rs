//! `POST /v1/completions`: a raw prompt (a string, or a list of token ids; a one-element list
//! of either is accepted too) continued by the engine. Stop strings are matched by the engine
//! on the decoded text, so `text` never contains one. Legacy `logprobs: N` is supported, and so are
//! output constraints (`response_format`, `guided_*`: [`crate::constrain`]). `echo` puts the
//! prompt before the text, and with `logprobs` the prompt tokens' logprobs before the generated
//! ones (scored by the engine's `prompt_logprobs`: lm-evaluation-harness's loglikelihood
//! requests); `n` choices: [`crate::choices`].

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use k3_engine::{EngineError, Event, FinishReason, Request};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use crate::error::{bad_param, Result, ServerError};
use crate::params::{ids_of, parse_body, usage, Fields, GenParams, StreamUsage};
use crate::scheduler::{Msg, Submitted};
use crate::server::{new_id, now_secs, read_body, sse_data, sse_response, AppState, SSE_DONE};

const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "echo", "suffix"];

/// Most alternatives legacy `logprobs: N` returns (OpenAI allows 0..=5; the engine caps at 20).
const MAX_LOGPROBS: usize = 20;

pub async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match run(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The prompt ids of a `prompt` field.
fn prompt_ids(s: &AppState, v: Option<&Value>) -> Result<Vec<u32>> {
    let bad = || bad_param("prompt", "must be a string, a list of token ids, or a one-element list of either");
    match v {
        None => Err(bad_param("prompt", "is required")),
        Some(Value::String(t)) => Ok(s.tok.encode(t, true)),
        Some(Value::Array(a)) if a.is_empty() => Err(bad_param("prompt", "is empty")),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => prompt_ids(s, a.first()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => match &a[0] {
            Value::Array(inner) if !inner.is_empty() && inner.iter().all(Value::is_number) => prompt_ids(s, a.first()),
            _ => Err(bad_param("prompt[0]", "a nested prompt must be a list of token ids")),
        },
        Some(Value::Array(a)) if a.iter().all(Value::is_number) => {
            let ids = ids_of(a).ok_or_else(|| bad_param("prompt", "token ids must be non-negative integers"))?;
            let n = s.tok.vocab_size();
            match ids.iter().find(|&&t| t as usize >= n) {
                Some(t) => Err(bad_param("prompt", format!("token id {t} is outside the vocabulary ({n})"))),
                None => Ok(ids),
            }
        }
        Some(Value::Array(_)) => Err(bad_param("prompt", "batched prompts are not supported; send one prompt per request")),
        Some(_) => Err(bad()),
    }
}

async fn run(s: AppState, headers: HeaderMap, body: Body) -> Result<Response> {
    let bytes = read_body(&headers, body, &s.cfg).await?;
    let obj: Map<String, Value> = parse_body(&bytes)?;
    let f = Fields(&obj);
    f.check_known(&[COMPLETION_FIELDS, crate::constrain::GUIDED_FIELDS, &["response_format"]].concat())?;
    let mut g = GenParams::read(&f, &["max_tokens"])?;
    s.check_model(g.model.as_deref())?;
    let n = crate::choices::read_n(&f, s.sched.capacity)?;
    let echo = f.bool("echo")?.unwrap_or(false);
    if f.str("suffix")?.is_some_and(|x| !x.is_empty()) {
        return Err(bad_param("suffix", "is not supported"));
    }
    let logprobs = f.usize("logprobs")?;
    if let Some(n) = logprobs.filter(|&n| n > MAX_LOGPROBS) {
        return Err(bad_param("logprobs", format!("{n} is more than the {MAX_LOGPROBS} alternatives this endpoint returns (0..={MAX_LOGPROBS})")));
    }
    g.sampling.logprobs = logprobs;
    if echo {
        // The prompt's own logprobs, as the generated tokens' (`echo` with `logprobs`).
        g.sampling.prompt_logprobs = logprobs;
    }
    let constraint = match crate::constrain::completion_plan(&f)? {
        Some(plan) => Some(crate::constrain::compile(s.grammar.as_ref().map_err(|e| crate::error::bad_request(e.clone()))?, plan).await?),
        None => None,
    };
    let ids = prompt_ids(&s, f.get("prompt"))?;
    let prompt_tokens = ids.len();
    let echo = echo.then(|| Echo::new(&s, &ids));
    let (prompt, room) = s.prepare_prompt(ids, g.max_tokens, "prompt", g.max_tokens_param)?;
    // OpenAI's default for completions is 16 tokens (clipped to the context, not refused).
    let max_tokens = if g.max_tokens.is_some() { room } else { room.min(16) };
    let request = Request {
        prompt,
        params: g.sampling.clone(),
        max_tokens,
        stop: g.stop.clone(),
        stop_token_ids: g.stop_token_ids.clone(),
        prompt_embeds: None,
        ignore_eos: g.ignore_eos,
        constraint,
    };
    let subs = crate::choices::submit_n(&s, request, None, n).await.map_err(|e| match e {
        // The engine names its parameter; this client sent `echo` (with `logprobs`).
        ServerError::Engine(EngineError::Param { param: "prompt_logprobs", msg }) => bad_param("echo", format!("with `logprobs`: {msg}")),
        e => e,
    })?;
    let ctx = Ctx { id: new_id("cmpl"), created: now_secs(), prompt_tokens, logprobs: logprobs.is_some(), echo };
    if g.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(stream_task(s.clone(), subs, ctx, g.usage, tx));
        Ok(sse_response(rx))
    } else {
        collect(s, subs, ctx).await
    }
}

struct Ctx {
    id: String,
    created: u64,
    prompt_tokens: usize,
    logprobs: bool,
    /// `echo`: the prompt put before each choice's text (and its logprobs before the choice's).
    echo: Option<Echo>,
}

struct Echo {
    /// The prompt decoded one token at a time as generated text is (UTF-8 held back across
    /// tokens), so that `offsets` index into it.
    text: String,
    ids: Vec<u32>,
    /// Where each prompt token's text starts in `text`, in characters.
    offsets: Vec<usize>,
}

impl Echo {
    fn new(s: &AppState, ids: &[u32]) -> Echo {
        let mut utf8 = k3_tokenizer::stream::Utf8Stream::new();
        let (mut text, mut offsets, mut at) = (String::new(), Vec::with_capacity(ids.len()), 0usize);
        for &id in ids {
            offsets.push(at);
            let t = utf8.push(s.tok.token_bytes(id).unwrap_or_default());
            at += t.chars().count();
            text.push_str(&t);
        }
        text.push_str(&utf8.finish());
        Echo { text, ids: ids.to_vec(), offsets }
    }
}

impl Ctx {
    /// The echoed prompt's text and (with `logprobs`) its legacy logprobs — the first token
    /// has none (`null`) — from a choice's first event; `None` without `echo`.
    fn echoed(&self, s: &AppState, first: &Event) -> Option<(String, Value)> {
        let e = self.echo.as_ref()?;
        // (The engine attaches prompt logprobs to the first event whenever they were asked
        // for; a backend that cannot score prompts refuses such a request.)
        let lp = match (first.prompt_logprobs.as_deref().unwrap_or_default(), self.logprobs) {
            (lps, true) => {
                let piece = |id: u32| s.piece(id);
                let (mut lp, mut tops) = (vec![Value::Null], vec![Value::Null]);
                let tokens: Vec<String> = e.ids.iter().map(|&id| piece(id)).collect();
                for x in lps {
                    lp.push(json!(x.logprob));
                    tops.push(Value::Object(x.top_logprobs.iter().map(|&(id, l)| (piece(id), json!(l))).collect()));
                }
                lp.resize(e.ids.len(), Value::Null);
                tops.resize(e.ids.len(), Value::Null);
                json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": tops, "text_offset": e.offsets})
            }
            _ => Value::Null,
        };
        Some((e.text.clone(), lp))
    }
}

/// Two legacy logprobs objects, the second's arrays after the first's.
fn concat_logprobs(mut a: Value, b: Value) -> Value {
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[k].as_array_mut(), b[k].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

/// Legacy logprobs of a run of events (`text_offset` in characters, counted from `offset`, as
/// OpenAI counts them).
fn logprobs_json(s: &AppState, events: &[Event], mut offset: usize) -> Value {
    let piece = |id: u32| s.piece(id);
    let (mut tokens, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
    for e in events {
        tokens.push(piece(e.token));
        lps.push(e.sampled.logprob);
        let top: Map<String, Value> = e.sampled.top_logprobs.iter().map(|&(id, lp)| (piece(id), json!(lp))).collect();
        tops.push(Value::Object(top));
        offs.push(offset);
        offset += e.text.chars().count();
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
}

fn reason(f: Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Length) => "length",
        _ => "stop",
    }
}

/// Every choice's answer, read concurrently (a failed one fails the request and cancels the
/// others).
async fn collect(s: AppState, subs: Vec<Submitted>, ctx: Ctx) -> Result<Response> {
    let answers = futures_util::future::try_join_all(subs.into_iter().map(collect_choice)).await?;
    let completion = answers.iter().map(|(events, _)| events.len()).sum();
    let cached = answers.iter().map(|(events, _)| events.first().map_or(0, |e| e.cached_tokens)).min().unwrap_or(0);
    let choices: Vec<Value> = answers
        .iter()
        .enumerate()
        .map(|(i, (events, finish))| {
            let mut text: String = events.iter().map(|e| e.text.as_str()).collect();
            let mut logprobs = if ctx.logprobs { logprobs_json(&s, events, 0) } else { Value::Null };
            if let Some((echo, lp)) = events.first().and_then(|e| ctx.echoed(&s, e)) {
                logprobs = if ctx.logprobs { concat_logprobs(lp, logprobs_json(&s, events, echo.chars().count())) } else { Value::Null };
                text = echo + &text;
            }
            json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason(*finish)})
        })
        .collect();
    let body = json!({
        "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": s.cfg.served_model_name,
        "choices": choices,
        "usage": usage(ctx.prompt_tokens, completion, cached),
    });
    Ok(axum::Json(body).into_response())
}

/// One choice's events up to its last, and why it finished.
async fn collect_choice(mut sub: Submitted) -> Result<(Vec<Event>, Option<FinishReason>)> {
    let mut events = Vec::new();
    loop {
        match sub.rx.recv().await {
            Some(Msg::Token(ev)) => {
                let f = ev.finish;
                events.push(ev);
                if f.is_some() {
                    return Ok((events, f));
                }
            }
            Some(Msg::Failed(m)) => return Err(ServerError::Internal(m)),
            None => return Err(ServerError::Internal("the engine dropped the request".into())),
        }
    }
}

/// (completion tokens, fewest cached prompt tokens) over the choices so far, from each
/// choice's token `count` and `cached` prompt tokens (known once it has its first token).
fn so_far(count: &[usize], cached: &[usize]) -> (usize, usize) {
    (count.iter().sum(), cached.iter().zip(count).filter(|(_, &n)| n > 0).map(|(&c, _)| c).min().unwrap_or(0))
}

/// The SSE stream of every choice, interleaved as their tokens come (each chunk names its
/// choice's `index`); the usage chunk and `[DONE]` once all have finished.
async fn stream_task(s: AppState, mut subs: Vec<Submitted>, ctx: Ctx, su: StreamUsage, tx: mpsc::Sender<Bytes>) {
    let model = s.cfg.served_model_name.clone();
    let k = subs.len();
    let (mut count, mut cached, mut offset) = (vec![0usize; k], vec![0usize; k], vec![0usize; k]);
    let mut open = vec![true; k];
    while open.iter().any(|&o| o) {
        // A client gone while waiting drops `subs` here, which cancels the sequences at once.
        let (i, msg) = tokio::select! {
            m = crate::choices::next_event(&mut subs, &open) => m,
            _ = tx.closed() => return,
        };
        match msg {
            Some(Msg::Token(ev)) => {
                if count[i] == 0 {
                    if let Some((echo, lp)) = ctx.echoed(&s, &ev) {
                        // The echoed prompt first, in a chunk of its own.
                        offset[i] = echo.chars().count();
                        let mut c = json!({
                            "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": model,
                            "choices": [{"index": i, "text": echo, "logprobs": lp, "finish_reason": null}],
                        });
                        su.put(&mut c, ctx.prompt_tokens, so_far(&count, &cached));
                        if tx.send(sse_data(&c)).await.is_err() {
                            return;
                        }
                    }
                }
                count[i] += 1;
                cached[i] = ev.cached_tokens;
                let lp = if ctx.logprobs { logprobs_json(&s, std::slice::from_ref(&ev), offset[i]) } else { Value::Null };
                offset[i] += ev.text.chars().count();
                let mut c = json!({
                    "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": model,
                    "choices": [{"index": i, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish.map(|f| reason(Some(f)))}],
                });
                su.put(&mut c, ctx.prompt_tokens, so_far(&count, &cached));
                if tx.send(sse_data(&c)).await.is_err() {
                    return; // client gone: dropping `subs` cancels the sequences
                }
                if ev.finish.is_some() {
                    open[i] = false;
                }
            }
            Some(Msg::Failed(m)) => {
                let _ = tx.send(sse_data(&ServerError::Internal(m).to_json())).await;
                let _ = tx.send(Bytes::from_static(SSE_DONE.as_bytes())).await;
                return;
            }
            None => return,
        }
    }
    if su.on() {
        let (completion, least) = so_far(&count, &cached);
        let u = json!({
            "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": model,
            "choices": [], "usage": usage(ctx.prompt_tokens, completion, least),
        });
        let _ = tx.send(sse_data(&u)).await;
    }
    let _ = tx.send(Bytes::from_static(SSE_DONE.as_bytes())).await;
}
