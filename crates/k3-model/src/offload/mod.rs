//! Routed experts off the GPU (issue 23): the trunk of the model stays where it runs, and each
//! MoE layer's routed experts live on one tier — the GPU, host memory (computed there by the
//! CPU, `layers::experts` with the int8-activation kernel), or the checkpoint's files on disk,
//! read when the router chooses them into a bounded cache ([`cache`]). `placement.rs` plans the
//! tiers from the memory budgets (`k3 inspect --gpu-mem --host-mem`); this module turns a plan
//! (or a forced `--experts-on`) into what the loaders take.
//!
//! On the CPU backend every expert is computed by the CPU anyway; there `--experts-on disk`
//! reads the routed experts through the cache instead of the memory map (bounded memory,
//! O_DIRECT reads, read-ahead at routing time), with the same f32 kernels and so the same bits.

pub mod cache;

use std::sync::Arc;

use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn};
use crate::error::Result;
use crate::layers::experts::Kernel;
use crate::layers::moe::ExpertSource;
use crate::placement::Tier;
pub use cache::{CacheOptions, CacheStats, DirectIo, ExpertCache};

/// The MoE layers of a config, in order.
pub fn moe_layers(cfg: &Config) -> Vec<usize> {
    cfg.layers.iter().filter(|s| s.ffn == Ffn::Moe).map(|s| s.index).collect()
}

/// What `--experts-on` asks of the CPU backend's model: the [`ExpertSource`] whose cache covers
/// every MoE layer for `disk`, mapped experts for `cpu` (or none given). `gpu` is refused: the
/// CPU backend has no GPU to hold them.
pub fn cpu_source(ck: &Checkpoint, experts_on: Option<Tier>, cache: &CacheOptions, experts: std::ops::Range<usize>) -> Result<ExpertSource> {
    match experts_on {
        None | Some(Tier::Host) => Ok(ExpertSource::default()),
        Some(Tier::Disk) => {
            let c = ExpertCache::open(ck, &moe_layers(&ck.config), experts, cache)?;
            Ok(ExpertSource { cache: Some(Arc::new(c)), kernel: Kernel::Exact })
        }
        Some(Tier::Gpu) => Err(crate::error::ModelError::Input(
            "--experts-on gpu needs --device cuda: on the CPU every expert is computed by the CPU (use cpu or disk)".into(),
        )),
    }
}
