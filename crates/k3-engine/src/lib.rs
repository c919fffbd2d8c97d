//! k3-engine: what turns the model into a generator.
//!
//! - [`sampler`]: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.
//! - [`stop`]: stop strings on streamed text.
//! - [`grammar`]: grammar-constrained decoding (llguidance): token masks for JSON Schema, regex,
//!   choice and Lark constraints, computed off the critical path.
//! - [`gpu`]: the GPU runner (feature `cuda`): the model on one CUDA device, decode graphs.
//! - [`dist`]: ranks, launch and the per-step message of a parallel layout.
//! - [`prefix`]: KDA-aware prefix caching (a radix tree of grid cells, snapshots, a bounded pool).
//! - [`engine`]: per-sequence state and the continuous-batching scheduler ([`Engine::step`]).
//! - [`spec`]: speculative decoding — n-gram and suffix proposers, acceptance, adaptive drafts.
//!
//! The server talks to this crate only, never to model internals.

pub mod dist;
pub mod engine;
pub mod error;
pub mod gpu;
pub mod grammar;
pub mod prefix;
pub mod sample_rows;
pub mod sampler;
pub mod spec;
pub mod stop;

pub use engine::{Engine, EngineConfig, Event, FinishReason, Request, SeqId, SeqStats};
pub use error::{EngineError, Result};
pub use grammar::{Constraint, GrammarEnv, GrammarSpec};
pub use prefix::{PrefixConfig, PrefixStats};
pub use sampler::{Sampled, Sampler, SamplingParams};
pub use spec::{SpecConfig, SpecMethod, SpecStats};
