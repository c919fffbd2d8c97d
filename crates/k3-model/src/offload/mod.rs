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
mod read;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use crate::capacity::KvDtype;
use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn};
use crate::error::{ModelError, Result};
use crate::layers::experts::Kernel;
use crate::layers::moe::ExpertSource;
use crate::placement::{place, Budget, Tier};
pub use cache::{CacheOptions, CacheStats, DirectIo, ExpertCache};

/// The flags: `--experts-on`, `--gpu-mem` / `--host-mem` for the planner, the cache's.
#[derive(Clone, Debug, Default)]
pub struct OffloadOptions {
    /// Every MoE layer's routed experts on this tier.
    pub experts_on: Option<Tier>,
    /// GPU memory budget (bytes): the planner puts layers' experts on the GPU while they fit,
    /// then in host memory (`host_mem`), then on disk.
    pub gpu_mem: Option<u64>,
    /// Host memory for experts (bytes; default: what the machine has available).
    pub host_mem: Option<u64>,
    pub cache: CacheOptions,
}

impl OffloadOptions {
    /// Whether anything but "every expert where the model runs" was asked for.
    pub fn is_set(&self) -> bool {
        self.experts_on.is_some() || self.gpu_mem.is_some()
    }
}

/// What the GPU loader takes: each MoE layer's tier, the cache of those on disk.
#[derive(Clone, Default)]
pub struct GpuOffload {
    pub tiers: BTreeMap<usize, Tier>,
    pub cache: Option<Arc<ExpertCache>>,
}

impl GpuOffload {
    /// Layer `l`'s tier (the GPU unless placed elsewhere).
    pub fn tier(&self, l: usize) -> Tier {
        self.tiers.get(&l).copied().unwrap_or(Tier::Gpu)
    }
    /// Layers whose experts the CPU computes.
    pub fn cpu_layers(&self) -> usize {
        self.tiers.values().filter(|t| **t != Tier::Gpu).count()
    }
}

/// GiB the planner keeps free on the GPU for the context, workspaces and activations.
pub const GPU_RESERVE: u64 = 6 << 30;

/// Each MoE layer's tier for a model on one GPU (`experts` this rank's): `--experts-on` for all,
/// or the planner's choice within `--gpu-mem` (and `--host-mem`), and the expert cache of the
/// layers on disk.
pub fn gpu_offload(ck: &Checkpoint, o: &OffloadOptions, kv: KvDtype, experts: Range<usize>) -> Result<GpuOffload> {
    let layers = moe_layers(&ck.config);
    let tiers: BTreeMap<usize, Tier> = match (o.experts_on, o.gpu_mem) {
        (None, None) => return Ok(GpuOffload::default()),
        (Some(t), None) => layers.iter().map(|&l| (l, t)).collect(),
        (forced, Some(gpu_mem)) => {
            let host_mem = o.host_mem.unwrap_or_else(available_memory);
            let p = place(&ck.config, &Budget { gpu_mem, host_mem, reserve: GPU_RESERVE, kv, experts_on: forced, bandwidth: [None; 3] })?;
            if !p.fits {
                return Err(ModelError::Input(format!("--gpu-mem / --host-mem / --experts-on: {}", p.reason)));
            }
            p.layers.iter().map(|x| (x.layer, x.tier)).collect()
        }
    };
    let on_disk: Vec<usize> = tiers.iter().filter(|(_, t)| **t == Tier::Disk).map(|(l, _)| *l).collect();
    let cache = (!on_disk.is_empty()).then(|| ExpertCache::open(ck, &on_disk, experts, &o.cache)).transpose()?.map(Arc::new);
    Ok(GpuOffload { tiers, cache })
}

/// `MemAvailable` of this machine (Linux), else 0 (every expert the GPU cannot take then goes
/// to disk).
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("MemAvailable:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse::<u64>().ok()))
        .map_or(0, |kib| kib * 1024)
}

/// Bytes of expert `e` of layer `l` as stored (its tensors checked as the expert cache checks
/// them), without opening a cache: the benches' floors, a budget's minimum.
pub fn expert_bytes(ck: &Checkpoint, l: usize, e: usize) -> Result<u64> {
    Ok(read::Place::of(ck, l, e)?.bytes())
}

/// The smallest budget an expert cache over `experts` of `layers` takes: one token's experts
/// (`num_experts_per_token` of the largest, as the cache itself requires).
pub fn smallest_budget(ck: &Checkpoint, layers: &[usize], experts: Range<usize>) -> Result<u64> {
    let mut largest = 0;
    for &l in layers {
        for e in experts.clone() {
            largest = largest.max(expert_bytes(ck, l, e)?);
        }
    }
    Ok(one_token(ck, largest))
}

/// One token's experts of a layer whose largest expert is `largest` bytes.
fn one_token(ck: &Checkpoint, largest: u64) -> u64 {
    largest * ck.config.text.num_experts_per_token as u64
}

/// The MoE layers of a config, in order.
pub fn moe_layers(cfg: &Config) -> Vec<usize> {
    cfg.layers.iter().filter(|s| s.ffn == Ffn::Moe).map(|s| s.index).collect()
}

/// What the flags ask of the CPU backend's model: the [`ExpertSource`] whose cache covers
/// every MoE layer for `--experts-on disk`, mapped experts for `cpu` (or none given). `gpu` and
/// `--gpu-mem` are refused: the CPU backend has no GPU.
pub fn cpu_source(ck: &Checkpoint, o: &OffloadOptions, experts: Range<usize>) -> Result<ExpertSource> {
    if o.gpu_mem.is_some() {
        return Err(ModelError::Input("--gpu-mem places experts beside a GPU: add --device cuda, or use --experts-on disk on the CPU".into()));
    }
    match o.experts_on {
        None | Some(Tier::Host) => Ok(ExpertSource::default()),
        Some(Tier::Disk) => {
            let c = ExpertCache::open(ck, &moe_layers(&ck.config), experts, &o.cache)?;
            Ok(ExpertSource { cache: Some(Arc::new(c)), kernel: Kernel::Exact })
        }
        Some(Tier::Gpu) => {
            Err(ModelError::Input("--experts-on gpu needs --device cuda: on the CPU every expert is computed by the CPU (use cpu or disk)".into()))
        }
    }
}
