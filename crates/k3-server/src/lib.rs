//! k3-server: `k3 serve`, an OpenAI-compatible HTTP server over the k3 engine.
//!
//! The engine runs on one dedicated OS thread ([`scheduler`]) that drains new requests and
//! cancellations, runs one batched [`Backend::step`] for every running sequence, and routes the
//! tokens to each request's channel; requests join and leave the batch at token boundaries and
//! a client that disconnects has its sequence cancelled at once. The HTTP side ([`server`],
//! axum/tokio) serves `POST /v1/chat/completions` ([`chat`]: XTML rendering, output parsing into
//! `reasoning_content` / `content` / `tool_calls`, SSE streaming), `POST /v1/completions`
//! ([`completions`]), `GET /v1/models`, `POST /tokenize` and `/detokenize` ([`tokenize`]),
//! `GET /health` and `GET /metrics` ([`metrics`],
//! Prometheus text). Errors use OpenAI's JSON error shape ([`error`]), also for the ones hyper
//! raises before routing ([`conn`], which also times out slow clients and bounds the graceful
//! shutdown); tool and output-format options are validated in [`tools`] and enforced by the
//! grammar [`constrain`] builds (the XTML tool-call grammar in [`constrain_xtml`]). Image parts of chat
//! requests go through [`media`]: decoded and encoded by the `k3-vision` tower on a blocking
//! thread, then spliced into the prompt's input rows (from [`Backend::embed`]) on the engine
//! thread. This crate talks to `k3-engine`, `k3-tokenizer` and `k3-vision`; `k3-model` is used
//! just to load the model.
//!
//! [`backend::Scripted`] is an engine double emitting given token ids, for end-to-end tests of
//! the tool-call and reasoning paths.

pub mod backend;
pub mod chat;
pub mod choices;
pub mod completions;
pub mod conn;
pub mod constrain;
pub mod constrain_xtml;
pub mod error;
pub mod media;
pub mod metrics;
pub mod params;
pub mod scheduler;
pub mod server;
pub mod start;
pub mod tokenize;
pub mod tools;

pub use backend::{Backend, Scripted};
pub use error::{Result, ServerError};
pub use server::{build, build_with_vision, serve, spawn_background, spawn_background_with_vision, BackgroundServer, ServerConfig};
pub use start::{run_serve, ServeOptions};
