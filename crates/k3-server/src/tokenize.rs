//! `POST /tokenize` and `POST /detokenize`, vLLM's extensions for counting and inspecting
//! tokens without generating: `/tokenize` takes a `prompt` (as `/v1/completions` encodes it) or
//! chat `messages` (rendered to XTML exactly as `/v1/chat/completions` renders them, with the
//! same `tools`, thinking and template options) and answers `{"count", "max_model_len",
//! "tokens"}` (and `"token_strs"` with `return_token_strs`; `add_special_tokens: false` reads
//! special-token names in a `prompt` as plain text — no BOS is ever added, K3 has none in its
//! prompts); `/detokenize` takes `tokens` and
//! answers `{"prompt"}`. Image and video parts are refused here (their token count depends on
//! the image: send the chat request). Both need the API key when the server has one.

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use k3_tokenizer::{render_chat, ChatRequest};
use serde_json::{json, Value};

use crate::error::{bad_param, bad_request, Result};
use crate::params::{ids_of, parse_body, Fields};
use crate::server::{read_body, AppState};

/// Chat fields `/tokenize` accepts beside `messages` (the renderer's options).
const CHAT_OPTS: &[&str] = &[
    "tools",
    "tool_choice",
    "reasoning_effort",
    "chat_template_kwargs",
    "thinking",
    "enable_thinking",
    "thinking_effort",
    "add_generation_prompt",
    "response_format",
];

pub async fn tokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match run_tokenize(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub async fn detokenize(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match run_detokenize(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run_tokenize(s: AppState, headers: HeaderMap, body: Body) -> Result<Response> {
    let bytes = read_body(&headers, body, &s.cfg).await?;
    let obj = parse_body(&bytes)?;
    let f = Fields(&obj);
    for k in obj.keys() {
        if !["model", "prompt", "messages", "add_special_tokens", "return_token_strs"].contains(&k.as_str()) && !CHAT_OPTS.contains(&k.as_str()) {
            return Err(bad_param(k.clone(), "unrecognized request argument"));
        }
    }
    s.check_model(f.str("model")?)?;
    let strs = f.bool("return_token_strs")?.unwrap_or(false);
    let ids = match (f.get("prompt"), f.get("messages")) {
        (Some(_), Some(_)) => return Err(bad_request("give either `prompt` or `messages`, not both")),
        (None, None) => return Err(bad_param("prompt", "is required (or `messages` for a chat prompt)")),
        (Some(Value::String(t)), None) => s.tok.encode(t, f.bool("add_special_tokens")?.unwrap_or(true)),
        (Some(_), None) => return Err(bad_param("prompt", "must be a string")),
        (None, Some(_)) => {
            if let Some(k) = obj.keys().find(|k| k.as_str() == "add_special_tokens") {
                return Err(bad_param(k.clone(), "applies to `prompt`; a chat prompt is rendered with the chat format's specials"));
            }
            if let Some(p) = crate::media::find_images(f.get("messages"))?.first() {
                return Err(bad_param(&p.field, "image and video parts are not counted here (their tokens depend on the media): send the chat request"));
            }
            crate::chat::check_shapes(&f)?;
            let text = std::str::from_utf8(&bytes).map_err(|_| bad_param("messages", "not UTF-8"))?;
            let mut req = ChatRequest::from_json_str(text)?;
            req.set_image_prompts(None); // as the chat endpoint renders a text-only request
            render_chat(&s.tok, &req)?.ids
        }
    };
    let mut out = json!({"count": ids.len(), "max_model_len": s.max_context, "tokens": ids});
    if strs {
        out["token_strs"] = ids.iter().map(|&t| Value::String(s.piece(t))).collect();
    }
    Ok(axum::Json(out).into_response())
}

async fn run_detokenize(s: AppState, headers: HeaderMap, body: Body) -> Result<Response> {
    let bytes = read_body(&headers, body, &s.cfg).await?;
    let obj = parse_body(&bytes)?;
    let f = Fields(&obj);
    if let Some(k) = obj.keys().find(|k| !["model", "tokens"].contains(&k.as_str())) {
        return Err(bad_param(k.clone(), "unrecognized request argument"));
    }
    s.check_model(f.str("model")?)?;
    let ids = match f.get("tokens") {
        None => return Err(bad_param("tokens", "is required")),
        Some(Value::Array(a)) => ids_of(a).ok_or_else(|| bad_param("tokens", "token ids must be non-negative integers"))?,
        Some(_) => return Err(bad_param("tokens", "must be a list of token ids")),
    };
    let n = s.tok.vocab_size();
    if let Some(t) = ids.iter().find(|&&t| t as usize >= n) {
        return Err(bad_param("tokens", format!("token id {t} is outside the vocabulary ({n})")));
    }
    let text = s.tok.decode(&ids, false)?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}
