//! The crate's one error type, and how it becomes an HTTP response.
//!
//! Every error a client can cause is answered in OpenAI's JSON error shape
//! `{"error": {"message", "type", "param", "code"}}` with a fitting status: 400 for malformed
//! or invalid requests (naming the parameter where there is one), 401 for a bad API key, 404 for
//! an unknown model or route, 408 for a body that stops arriving, 413 for an oversized body, 429 (with `Retry-After`) when the queue
//! is full, 503 when the engine is gone and 500 for engine failures. Start-up errors (`k3 serve`
//! with a bad `--model`) use the same enum.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use k3_engine::EngineError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ServerError {
    /// The request is invalid; `param` names the offending field when there is one.
    #[error("{message}")]
    BadRequest { message: String, param: Option<String>, code: Option<&'static str> },
    /// Missing or wrong `Authorization: Bearer` key.
    #[error("{0}")]
    Unauthorized(String),
    /// Unknown model or route.
    #[error("{message}")]
    NotFound { message: String, param: Option<String>, code: &'static str },
    /// The client did not send its request in time.
    #[error("{0}")]
    Timeout(String),
    /// The body is larger than the server accepts.
    #[error("the request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    /// Wrong HTTP method on a known route.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The queue is full; retry after this many seconds.
    #[error("the server is at capacity ({live} requests running or queued); retry later")]
    Busy { live: usize, retry_after: u64 },
    /// The engine thread is gone.
    #[error("the engine is unavailable: {0}")]
    Unavailable(String),
    /// The engine failed while running this request.
    #[error("engine failure: {0}")]
    Internal(String),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Tokenizer(#[from] k3_tokenizer::Error),
    #[error(transparent)]
    Model(#[from] k3_model::ModelError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// Bad command-line configuration.
    #[error("{0}")]
    Config(String),
}

pub type Result<T> = std::result::Result<T, ServerError>;

/// A 400 naming a request field.
pub fn bad_param(param: impl Into<String>, message: impl Into<String>) -> ServerError {
    let param = param.into();
    ServerError::BadRequest { message: format!("`{param}`: {}", message.into()), param: Some(param), code: None }
}

/// A 400 without a specific field.
pub fn bad_request(message: impl Into<String>) -> ServerError {
    ServerError::BadRequest { message: message.into(), param: None, code: None }
}

impl ServerError {
    /// Status, OpenAI error `type`, `param` and `code`.
    pub fn parts(&self) -> (StatusCode, &'static str, Option<String>, Option<String>) {
        use ServerError::*;
        let inv = "invalid_request_error";
        match self {
            BadRequest { param, code, .. } => (StatusCode::BAD_REQUEST, inv, param.clone(), code.map(str::to_owned)),
            Unauthorized(_) => (StatusCode::UNAUTHORIZED, "authentication_error", None, Some("invalid_api_key".into())),
            NotFound { param, code, .. } => (StatusCode::NOT_FOUND, inv, param.clone(), Some((*code).into())),
            TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, inv, None, Some("request_too_large".into())),
            Timeout(_) => (StatusCode::REQUEST_TIMEOUT, inv, None, Some("request_timeout".into())),
            MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, inv, None, None),
            Busy { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", None, Some("queue_full".into())),
            Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, None),
            Engine(EngineError::Param { param, .. }) => (StatusCode::BAD_REQUEST, inv, Some((*param).into()), None),
            Engine(EngineError::Context { .. }) => (StatusCode::BAD_REQUEST, inv, Some("messages".into()), Some("context_length_exceeded".into())),
            Tokenizer(k3_tokenizer::Error::InvalidRequest { field, .. }) => (StatusCode::BAD_REQUEST, inv, Some(field.clone()), None),
            Tokenizer(k3_tokenizer::Error::UnknownId { .. }) => (StatusCode::BAD_REQUEST, inv, Some("prompt".into()), None),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, None),
        }
    }

    /// The OpenAI error object (`{"error": {...}}`).
    pub fn to_json(&self) -> serde_json::Value {
        let (_, ty, param, code) = self.parts();
        serde_json::json!({"error": {"message": self.to_string(), "type": ty, "param": param, "code": code}})
    }
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        let (status, ..) = self.parts();
        let mut resp = (status, axum::Json(self.to_json())).into_response();
        if let ServerError::Busy { retry_after, .. } = self {
            if let Ok(v) = HeaderValue::from_str(&retry_after.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
