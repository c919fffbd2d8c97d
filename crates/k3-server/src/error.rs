//! The crate's one error type, and how it becomes an HTTP response.
//!
//! Every error a client can cause is answered in OpenAI's JSON error shape
//! `{"error": {"message", "type", "param", "code"}}` with a fitting status: 400 for malformed
//! or invalid requests (naming the parameter where there is one), 401 for a bad API key, 404 for
//! an unknown model or route, 408 for a body that stops arriving, 413 for an oversized body, 429 (with `Retry-After`) when the queue
//! is full, 503 when the engine is gone or a capacity sized at start-up is exhausted (with `Retry-After`), and 500 with
//! the fault's message for engine failures and internal faults (`EngineError::Internal`, `ModelError::Internal`). Start-up errors (`k3 serve`
//! with a bad `--model`) use the same enum.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use k3_engine::EngineError;
use k3_model::ModelError;
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
    Model(#[from] ModelError),
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
            // What the client sent, as the model judged it (at admission, the model sees only the request's data).
            Engine(EngineError::Model(ModelError::Input(_))) | Model(ModelError::Input(_)) => (StatusCode::BAD_REQUEST, inv, None, None),
            // A resource sized at start-up is exhausted: the same request can succeed later.
            Engine(EngineError::Model(ModelError::Capacity(_))) | Model(ModelError::Capacity(_)) => {
                (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, Some("capacity_exhausted".into()))
            }
            // A bug inside k3: never the client's fault.
            Internal(_) | Engine(EngineError::Internal(_)) | Engine(EngineError::Model(ModelError::Internal(_))) | Model(ModelError::Internal(_)) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, Some("internal_error".into()))
            }
            Tokenizer(k3_tokenizer::Error::InvalidRequest { field, .. }) => (StatusCode::BAD_REQUEST, inv, Some(field.clone()), None),
            Tokenizer(k3_tokenizer::Error::UnknownId { .. }) => (StatusCode::BAD_REQUEST, inv, Some("prompt".into()), None),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, None),
        }
    }

    /// Seconds after which the same request may succeed (`Retry-After`), for a full queue or an
    /// exhausted model capacity.
    fn retry_after(&self) -> Option<u64> {
        match self {
            ServerError::Busy { retry_after, .. } => Some(*retry_after),
            ServerError::Engine(EngineError::Model(ModelError::Capacity(_))) | ServerError::Model(ModelError::Capacity(_)) => Some(1),
            _ => None,
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
        if let Some(secs) = self.retry_after() {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_and_body(e: ServerError) -> (StatusCode, Option<String>, serde_json::Value) {
        let json = e.to_json();
        let resp = e.into_response();
        let retry = resp.headers().get(header::RETRY_AFTER).map(|v| v.to_str().unwrap().to_owned());
        (resp.status(), retry, json)
    }

    #[test]
    fn an_internal_fault_is_a_500_with_its_message() {
        for e in [
            ServerError::Engine(EngineError::Internal("sequence 7 is planned twice".into())),
            ServerError::Engine(EngineError::Model(ModelError::Internal("graph capture did not run the step".into()))),
            ServerError::Model(ModelError::Internal("a rank thread panicked".into())),
        ] {
            let msg = e.to_string();
            let (status, retry, json) = status_and_body(e);
            assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{msg}");
            assert_eq!(retry, None);
            assert_eq!(json["error"]["type"], "server_error");
            assert_eq!(json["error"]["code"], "internal_error");
            assert!(msg.contains("internal error: ") && json["error"]["message"] == msg, "{json}");
        }
    }

    #[test]
    fn exhausted_capacity_is_a_retryable_503() {
        let e = ServerError::Engine(EngineError::Model(ModelError::Capacity("all 4 sequence slots are in use".into())));
        let (status, retry, json) = status_and_body(e);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(retry.as_deref(), Some("1"));
        assert_eq!(json["error"]["code"], "capacity_exhausted");
        assert!(json["error"]["message"].as_str().unwrap().contains("sequence slots"), "{json}");
    }

    #[test]
    fn what_the_client_sent_stays_4xx() {
        let (status, _, json) = status_and_body(ServerError::Engine(EngineError::Param { param: "top_p", msg: "2 is outside (0, 1]".into() }));
        assert_eq!((status, json["error"]["param"].as_str()), (StatusCode::BAD_REQUEST, Some("top_p")));
        let (status, _, json) = status_and_body(ServerError::Engine(EngineError::Model(ModelError::Input("token id 9999 is outside the vocabulary".into()))));
        assert_eq!((status, json["error"]["type"].as_str()), (StatusCode::BAD_REQUEST, Some("invalid_request_error")));
        let (status, retry, _) = status_and_body(ServerError::Busy { live: 3, retry_after: 2 });
        assert_eq!((status, retry.as_deref()), (StatusCode::TOO_MANY_REQUESTS, Some("2")));
    }
}
