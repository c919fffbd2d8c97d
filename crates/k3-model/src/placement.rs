//! Where a model's parts go on one GPU host (issue 23's planner: `k3 inspect --gpu-mem G
//! --host-mem H [--experts-on gpu|cpu|disk]`), from the same weight table the loaders use
//! (around-backbone §1.4–§2, bytes as shipped: [`shipped_bytes`]).
//!
//! The *trunk* — every tensor but the routed experts (embeddings, attention, AttnRes, norms,
//! router, latent projections, shared experts, lm_head, a vision tower when configured) — stays
//! on the GPU, with the reserve and the state of one 128K-token sequence (latent / indexer-key
//! cache and KDA state, as `capacity.rs` counts them). The routed experts of each MoE layer go,
//! a whole layer at a time in layer order, to the first tier with room: the GPU, then host
//! memory (computed there by the CPU), then the checkpoint on disk (read per token; no cache
//! counted). `--experts-on` puts every layer on one tier instead, and says when it does not fit.
//!
//! Per-token bytes are those a batch-1 decode token reads: the trunk less the embedding table
//! (one row of it), plus `num_experts_per_token` experts of each MoE layer on that layer's tier.
//! With bandwidths given, the floor of a token is each tier's bytes ÷ its bandwidth, summed (the
//! tiers one after another) and as the slowest tier alone (perfect overlap).

use serde::Serialize;

use crate::capacity::{KvDtype, CONTEXTS, GIB};
use crate::config::{Config, Mixer};
use crate::error::{ModelError, Result};
use crate::inspect::{cache_bytes_per_token, kda_state_bytes, shipped_bytes};
use crate::weights::{tensor_table, Component};

/// Where a layer's routed experts live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Gpu,
    /// Host memory; the CPU computes these experts.
    Host,
    /// The checkpoint's files, read when the router chooses.
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

    /// The `--experts-on` value: `gpu`, `cpu` (or `host`), `disk`.
    pub fn parse(s: &str) -> Option<Tier> {
        match s {
            "gpu" => Some(Tier::Gpu),
            "cpu" | "host" => Some(Tier::Host),
            "disk" => Some(Tier::Disk),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Host => "cpu",
            Tier::Disk => "disk",
        }
    }
}

/// One MoE layer's routed experts.
#[derive(Clone, Debug, Serialize)]
pub struct LayerExperts {
    pub layer: usize,
    pub tier: Tier,
    /// All routed experts of the layer, as shipped.
    pub bytes: u64,
    /// The `num_experts_per_token` experts one decode token reads.
    pub bytes_per_token: u64,
}

/// What one tier holds and what a decode token reads from it.
#[derive(Clone, Debug, Serialize)]
pub struct TierTotal {
    pub tier: Tier,
    pub resident_bytes: u64,
    pub bytes_per_token: u64,
    /// Its budget (`--gpu-mem` less the reserve, `--host-mem`; none for the disk).
    pub budget_bytes: Option<u64>,
    /// Bytes per token ÷ the bandwidth given for the tier, in ms.
    pub floor_ms: Option<f64>,
}

/// The whole plan.
#[derive(Clone, Debug, Serialize)]
pub struct Placement {
    pub gpu_mem_bytes: u64,
    pub host_mem_bytes: u64,
    pub reserve_bytes: u64,
    pub kv_cache_dtype: KvDtype,
    /// `--experts-on`, when given.
    pub experts_on: Option<Tier>,
    /// Every tensor but the routed experts (on the GPU).
    pub trunk_bytes: u64,
    pub trunk_bytes_per_token: u64,
    /// One 128K-token sequence's latent / indexer-key cache and KDA state (on the GPU).
    pub sequence_bytes: u64,
    pub layers: Vec<LayerExperts>,
    pub tiers: Vec<TierTotal>,
    /// Per token with every tier's bandwidth given: the tiers in turn, and the slowest alone.
    pub floor_ms_serial: Option<f64>,
    pub floor_ms_overlapped: Option<f64>,
    pub fits: bool,
    pub reason: String,
}

/// Memory budgets and the optional bandwidths (bytes/s) of [`place`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Budget {
    pub gpu_mem: u64,
    pub host_mem: u64,
    pub reserve: u64,
    pub kv: KvDtype,
    pub experts_on: Option<Tier>,
    /// Bandwidths of the GPU's memory, host memory, the disk (bytes/s), each optional.
    pub bandwidth: [Option<f64>; 3],
}

/// Places `cfg`'s parts within `b` (see the module doc).
pub fn place(cfg: &Config, b: &Budget) -> Result<Placement> {
    for (i, bw) in b.bandwidth.iter().enumerate() {
        if bw.is_some_and(|x| !x.is_finite() || x <= 0.0) {
            return Err(ModelError::Input(format!("the {} bandwidth must be a positive number of GB/s", Tier::ALL[i].name())));
        }
    }
    let t = &cfg.text;
    let table = tensor_table(cfg);
    let (mut trunk, mut per_layer) = (0u64, std::collections::BTreeMap::<usize, u64>::new());
    let mut embed = 0u64;
    for s in &table {
        let n = shipped_bytes(s);
        match (s.component, s.layer) {
            (Component::RoutedExperts, Some(l)) => *per_layer.entry(l).or_default() += n,
            (Component::Embedding, _) => embed += n,
            _ => trunk += n,
        }
    }
    let vision: u64 = table.iter().filter(|s| matches!(s.component, Component::VisionTower | Component::MmProjector)).map(shipped_bytes).sum();
    let row = embed / t.vocab_size.max(1) as u64;
    let trunk_bytes_per_token = trunk - vision + row;
    let trunk_bytes = trunk + embed;
    let (mla, idx) = b.kv.bytes_per_token(t);
    let kda_layers = cfg.layers.iter().filter(|l| l.mixer == Mixer::Kda).count();
    let (rec, conv) = kda_state_bytes(cfg, t.linear_attn_config.num_heads, kda_layers);
    let sequence_bytes = CONTEXTS[0] * cache_bytes_per_token(&cfg.layers, mla, idx) + rec + conv;
    let (k, e) = (t.num_experts_per_token as u64, t.num_experts.max(1) as u64);
    let gib = |x: u64| x as f64 / GIB;

    let gpu_budget = b.gpu_mem.saturating_sub(b.reserve);
    let gpu_need = trunk_bytes + sequence_bytes;
    let (mut gpu_left, mut host_left) = (gpu_budget.saturating_sub(gpu_need), b.host_mem);
    let mut layers = Vec::with_capacity(per_layer.len());
    for (&layer, &bytes) in &per_layer {
        let auto = if bytes <= gpu_left {
            Tier::Gpu
        } else if bytes <= host_left {
            Tier::Host
        } else {
            Tier::Disk
        };
        let tier = b.experts_on.unwrap_or(auto);
        match tier {
            Tier::Gpu => gpu_left = gpu_left.saturating_sub(bytes),
            Tier::Host => host_left = host_left.saturating_sub(bytes),
            Tier::Disk => {}
        }
        layers.push(LayerExperts { layer, tier, bytes, bytes_per_token: bytes * k / e });
    }
    let on = |tier: Tier| layers.iter().filter(move |l| l.tier == tier);
    let mut tiers = Vec::new();
    for (i, tier) in Tier::ALL.into_iter().enumerate() {
        let (mut resident, mut per_token): (u64, u64) = (on(tier).map(|l| l.bytes).sum(), on(tier).map(|l| l.bytes_per_token).sum());
        if tier == Tier::Gpu {
            resident += gpu_need;
            per_token += trunk_bytes_per_token;
        }
        let budget = match tier {
            Tier::Gpu => Some(gpu_budget),
            Tier::Host => Some(b.host_mem),
            Tier::Disk => None,
        };
        let floor_ms = b.bandwidth[i].map(|bw| per_token as f64 / bw * 1e3);
        tiers.push(TierTotal { tier, resident_bytes: resident, bytes_per_token: per_token, budget_bytes: budget, floor_ms });
    }
    let floors: Option<Vec<f64>> = tiers.iter().map(|x| if x.bytes_per_token == 0 { Some(0.0) } else { x.floor_ms }).collect();
    let floor_ms_serial = floors.as_ref().map(|f| f.iter().sum());
    let floor_ms_overlapped = floors.as_ref().map(|f| f.iter().copied().fold(0.0, f64::max));

    let over = |x: &TierTotal| x.budget_bytes.is_some_and(|bud| x.resident_bytes > bud);
    let (fits, reason) = if gpu_need > gpu_budget {
        (
            false,
            format!(
                "the trunk ({:.1} GiB) and one 128K-token sequence ({:.1} GiB) need {:.1} GiB of the GPU, more than --gpu-mem {:.1} GiB less the {:.1} GiB reserve",
                gib(trunk_bytes),
                gib(sequence_bytes),
                gib(gpu_need),
                gib(b.gpu_mem),
                gib(b.reserve)
            ),
        )
    } else if let Some(x) = tiers.iter().find(|x| over(x)) {
        let flag = if x.tier == Tier::Gpu { "--gpu-mem less the reserve" } else { "--host-mem" };
        (
            false,
            format!(
                "--experts-on {} puts {:.1} GiB on the {}, more than {flag} ({:.1} GiB)",
                x.tier.name(),
                gib(x.resident_bytes),
                x.tier.name(),
                gib(x.budget_bytes.unwrap_or(0))
            ),
        )
    } else {
        let count = |tier| on(tier).count();
        (
            true,
            format!(
                "MoE layers' routed experts: {} on the GPU, {} in host memory, {} read from disk; a decode token reads {:.2} GB from the GPU, {:.2} GB from host memory, {:.2} GB from disk",
                count(Tier::Gpu),
                count(Tier::Host),
                count(Tier::Disk),
                tiers[0].bytes_per_token as f64 / 1e9,
                tiers[1].bytes_per_token as f64 / 1e9,
                tiers[2].bytes_per_token as f64 / 1e9
            ),
        )
    };
    Ok(Placement {
        gpu_mem_bytes: b.gpu_mem,
        host_mem_bytes: b.host_mem,
        reserve_bytes: b.reserve,
        kv_cache_dtype: b.kv,
        experts_on: b.experts_on,
        trunk_bytes,
        trunk_bytes_per_token,
        sequence_bytes,
        layers,
        tiers,
        floor_ms_serial,
        floor_ms_overlapped,
        fits,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::builtin_config;

    fn k3() -> Config {
        Config::from_json(builtin_config("k3").unwrap()).unwrap()
    }

    fn budget(gpu_gib: f64, host_gib: f64) -> Budget {
        Budget { gpu_mem: (gpu_gib * GIB) as u64, host_mem: (host_gib * GIB) as u64, reserve: (6.0 * GIB) as u64, ..Default::default() }
    }

    #[test]
    fn every_byte_is_placed_once_and_budgets_hold() {
        let cfg = k3();
        let all: u64 = tensor_table(&cfg).iter().map(shipped_bytes).sum();
        for (g, h) in [(139.0, 1536.0), (139.0, 256.0), (139.0, 0.0), (2000.0, 0.0)] {
            let p = place(&cfg, &budget(g, h)).unwrap();
            let resident: u64 = p.tiers.iter().map(|t| t.resident_bytes).sum();
            assert_eq!(resident, all + p.sequence_bytes, "gpu {g} host {h}");
            assert!(p.fits, "{}", p.reason);
            for t in &p.tiers {
                assert!(t.budget_bytes.is_none_or(|b| t.resident_bytes <= b), "{:?} over its budget", t.tier);
            }
            // Whole layers, in layer order: GPU layers first, then host, then disk.
            let order: Vec<usize> = p.layers.iter().map(|l| Tier::ALL.iter().position(|&t| t == l.tier).unwrap()).collect();
            assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
            assert_eq!(p.layers.len(), cfg.layers.iter().filter(|l| l.ffn == crate::config::Ffn::Moe).count());
        }
    }

    #[test]
    fn real_k3_on_one_h200() {
        let cfg = k3();
        let t = &cfg.text;
        let p = place(&cfg, &budget(139.0, 1536.0)).unwrap();
        // ~1.45 TB of MXFP4 experts cannot sit on a 139 GiB GPU: nearly all go to host memory.
        let host = &p.tiers[1];
        assert!(host.resident_bytes > 1_300_000_000_000, "{host:?}");
        assert_eq!(p.tiers[2].resident_bytes, 0);
        // A token reads num_experts_per_token / num_experts of every layer's experts.
        for l in &p.layers {
            assert_eq!(l.bytes_per_token, l.bytes * t.num_experts_per_token as u64 / t.num_experts as u64);
        }
        let experts_per_token: u64 = p.layers.iter().map(|l| l.bytes_per_token).sum();
        assert!((20e9..30e9).contains(&(experts_per_token as f64)), "{experts_per_token}");
        // Less host memory: the layers that no longer fit are read from disk.
        let q = place(&cfg, &budget(139.0, 256.0)).unwrap();
        assert!(q.tiers[2].resident_bytes > 0 && q.tiers[1].resident_bytes <= (256.0 * GIB) as u64);
    }

    #[test]
    fn forced_tiers_and_bandwidth_floors() {
        let cfg = k3();
        let mut b = budget(139.0, 512.0);
        b.experts_on = Some(Tier::Host);
        let p = place(&cfg, &b).unwrap();
        assert!(!p.fits && p.reason.contains("--host-mem"), "{}", p.reason);
        assert!(p.layers.iter().all(|l| l.tier == Tier::Host));
        b.experts_on = Some(Tier::Disk);
        b.bandwidth = [Some(4.0e12), Some(200e9), Some(7e9)];
        let p = place(&cfg, &b).unwrap();
        assert!(p.fits, "{}", p.reason);
        let disk = &p.tiers[2];
        assert!((disk.floor_ms.unwrap() - disk.bytes_per_token as f64 / 7e9 * 1e3).abs() < 1e-9);
        let serial = p.floor_ms_serial.unwrap();
        assert!((serial - p.tiers.iter().map(|t| t.floor_ms.unwrap()).sum::<f64>()).abs() < 1e-9);
        assert!(p.floor_ms_overlapped.unwrap() <= serial);
        b.experts_on = Some(Tier::Gpu);
        let p = place(&cfg, &b).unwrap();
        assert!(!p.fits && p.reason.contains("--gpu-mem"), "{}", p.reason);
        // The trunk alone does not fit a 24 GiB GPU.
        let p = place(&cfg, &budget(24.0, 256.0)).unwrap();
        assert!(!p.fits && p.reason.contains("the trunk"), "{}", p.reason);
        b.bandwidth[1] = Some(-1.0);
        assert!(place(&cfg, &b).unwrap_err().to_string().contains("cpu bandwidth"));
    }
}
