//! k3-model: the Kimi K3 / K3.1 Pro text model on top of k3-core.
//!
//! - [`config`]: `config.json` mirror → validated [`Config`].
//! - [`weights`]: the table of every checkpoint tensor (name, shape, kind, component).
//! - [`checkpoint`]: memory-mapped safetensors (single file or index + shards), checked
//!   against the table.
//! - [`inspect`]: parameter counts, bytes on disk, cache sizes (`k3 inspect`).
//! - [`init`]: random-weight checkpoints in the release format (`k3 init`).
//! - [`capacity`]: per-rank memory of a parallel layout (`k3 inspect --tp/--pp --gpu-mem`);
//!   [`placement`]: trunk and routed experts over GPU, host memory and disk on one GPU host
//!   (`k3 inspect --gpu-mem --host-mem`); [`offload`]: routed experts off the GPU — the disk
//!   tier's expert cache, and the options that pick each layer's tier.
//! - [`parallel`]: the sharding plan (`--tp/--ep/--pp` → what each rank holds) and the
//!   groups a rank's forward talks to; [`source`]: one rank's shards of a checkpoint.
//! - [`verify`]: speculative verification (the forward that scores drafts exactly as decode
//!   steps, the rollback to the accepted prefix); [`draft`]: the MTP draft layer beside the
//!   target (around-backbone §5.1; `layers::mtp` is the layer); [`draft_model`]: a separate
//!   draft model following the target's forwards, chained drafts.
//! - [`device_pages`]: the GPU cache's pages, reference-counted between sequences and the
//!   prefix cache (host-side bookkeeping: who holds a page, when a write copies it).
pub mod capacity;
pub mod checkpoint;
pub mod config;
pub mod device_pages;
pub mod error;
pub mod init;
mod init_data;
pub mod inspect;
pub mod offload;
pub mod parallel;
pub mod placement;
pub mod source;
pub mod weights;

pub use checkpoint::Checkpoint;
pub use config::Config;
pub use error::{ModelError, Result};
pub mod draft;
pub mod draft_model;
pub mod layers;
pub mod model;
pub mod verify;

pub use model::{ForwardOpts, Model, SeqState};
pub use parallel::{Groups, Parallel, RankPlan};
pub use source::Source;
#[cfg(feature = "cuda")]
pub mod cuda;
