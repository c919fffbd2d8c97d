//! The sharding plan: `--tp`, `--ep` and `--pp` turned into what each rank holds and computes
//! (`docs/parallel.md` has the layout tensor by tensor and the collectives per layer).
//!
//! The world is `pp` pipeline stages of `S = max(tp, ep)` ranks each; global rank
//! `r = stage · S + local`. Stage `s` runs a contiguous run of decoder layers (the first stage
//! also the embedding, the last the output AttnRes, norm and `lm_head`). Inside a stage:
//! - attention (KDA and MLA/DSA heads), the dense FFN, the shared experts, the embedding and
//!   `lm_head` (by vocabulary) are split over the `tp` ranks (`tp` is 1 or `S`);
//! - routed experts are whole on their expert-parallel owner (`ep` is 1 or `S`); with `ep = 1`
//!   and `tp > 1` each expert's intermediate dim is split instead;
//! - the router, the latent down/up projections, AttnRes and every norm are replicated, so the
//!   residual stream (the AttnRes block bank) is the same on every rank of a stage.
//!
//! Splits are uneven when the counts do not divide ([`k3_core::comm::part`]): 3 heads over
//! `--tp 2` are 2 + 1. Which slice of which tensor a rank holds comes from the [`Split`]
//! column of the weight table ([`RankPlan::shard`]), so the CPU model, the GPU model and
//! `k3 inspect` agree by construction.

use std::ops::Range;
use std::sync::Arc;

use k3_core::comm::{part, Group, HostGroup, Single};
use serde::Serialize;

use crate::checkpoint::Checkpoint;
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::model::Model;
use crate::weights::{Component, Split, TensorSpec};

/// A parallel layout: tensor-, expert- and pipeline-parallel degrees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Parallel {
    pub tp: usize,
    pub ep: usize,
    pub pp: usize,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel::SINGLE
    }
}

impl Parallel {
    /// One rank holding everything.
    pub const SINGLE: Parallel = Parallel { tp: 1, ep: 1, pp: 1 };

    /// From the `--tp`, `--ep`, `--pp` flags; `ep` defaults to `tp` (experts whole on the
    /// same ranks that split the attention, as the H200 recipes of vLLM and SGLang run K3).
    pub fn new(tp: usize, ep: Option<usize>, pp: usize) -> Result<Parallel> {
        let ep = ep.unwrap_or(tp);
        for (flag, v) in [("--tp", tp), ("--ep", ep), ("--pp", pp)] {
            if v == 0 {
                return Err(ModelError::Input(format!("{flag} 0: parallel degrees start at 1")));
            }
        }
        let s = tp.max(ep);
        if (tp != 1 && tp != s) || (ep != 1 && ep != s) {
            return Err(ModelError::Input(format!(
                "--tp {tp} --ep {ep}: the ranks of a stage either all split the attention or none do, and the same for the experts; use --tp {s} --ep {s}, --tp 1 --ep {s} or --tp {s} --ep 1"
            )));
        }
        Ok(Parallel { tp, ep, pp })
    }

    /// Ranks per pipeline stage, `max(tp, ep)`.
    pub fn stage_ranks(&self) -> usize {
        self.tp.max(self.ep)
    }

    /// Ranks in the world, `pp · max(tp, ep)`.
    pub fn world(&self) -> usize {
        self.pp * self.stage_ranks()
    }

    /// Checks the layout against the model (every stage needs a layer).
    pub fn check(&self, cfg: &Config) -> Result<()> {
        let l = cfg.layers.len();
        if self.pp > l {
            return Err(ModelError::Input(format!("--pp {}: the model has only {l} decoder layers, so at most --pp {l} stages", self.pp)));
        }
        Ok(())
    }

    /// The plan of global rank `rank`.
    pub fn rank(&self, cfg: &Config, rank: usize) -> Result<RankPlan> {
        self.check(cfg)?;
        let (s, w) = (self.stage_ranks(), self.world());
        if rank >= w {
            return Err(ModelError::Input(format!("rank {rank} is outside a world of {w} ranks (--tp {} --ep {} --pp {})", self.tp, self.ep, self.pp)));
        }
        let (stage, local) = (rank / s, rank % s);
        Ok(RankPlan {
            par: *self,
            rank,
            stage,
            local,
            tp_rank: if self.tp > 1 { local } else { 0 },
            ep_rank: if self.ep > 1 { local } else { 0 },
            layers: part(cfg.layers.len(), self.pp, stage),
            num_experts: cfg.text.num_experts,
        })
    }

    /// Every rank's plan, rank 0 first.
    pub fn plans(&self, cfg: &Config) -> Result<Vec<RankPlan>> {
        (0..self.world()).map(|r| self.rank(cfg, r)).collect()
    }
}

/// What one rank holds: its coordinates and its decoder layers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankPlan {
    pub par: Parallel,
    /// Global rank.
    pub rank: usize,
    pub stage: usize,
    /// Index inside the stage, `0..max(tp, ep)`.
    pub local: usize,
    pub tp_rank: usize,
    pub ep_rank: usize,
    /// Global indices of this stage's decoder layers.
    pub layers: Range<usize>,
    /// Routed experts per MoE layer (`num_experts`), what expert parallelism divides.
    pub num_experts: usize,
}

/// The slice of one tensor that a rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shard {
    Whole,
    /// Rows `[a, b)` of dim 0.
    Rows(Range<usize>),
    /// Columns `[a, b)` of dim 1.
    Cols(Range<usize>),
}

impl RankPlan {
    /// The plan of a single process holding the whole model.
    pub fn single(cfg: &Config) -> RankPlan {
        Parallel::SINGLE.rank(cfg, 0).expect("a one-rank layout fits every model")
    }

    pub fn first_stage(&self) -> bool {
        self.stage == 0
    }
    pub fn last_stage(&self) -> bool {
        self.stage + 1 == self.par.pp
    }
    pub fn holds_layer(&self, l: usize) -> bool {
        self.layers.contains(&l)
    }

    /// This rank's share of `n` tensor-parallel units (heads, FFN columns, vocabulary rows).
    pub fn tp_share(&self, n: usize) -> Range<usize> {
        part(n, self.par.tp, self.tp_rank)
    }

    /// This rank's share of `n` rows split over every rank of its stage (the router and the
    /// latent down-projection, [`crate::weights::Split::StageRows`]).
    pub fn stage_share(&self, n: usize) -> Range<usize> {
        part(n, self.par.stage_ranks(), self.local)
    }

    /// The intermediate width of the routed experts this rank holds: the whole
    /// `moe_intermediate_size` with expert parallelism; without it, this rank's share of it
    /// (whole 32-value blocks for MXFP4 experts, matching the split of `w1`/`w3` rows and `w2`
    /// block columns in the tensor table).
    pub fn expert_inter(&self, cfg: &Config) -> usize {
        let fi = cfg.text.moe_intermediate_size;
        if self.par.ep > 1 {
            return fi;
        }
        let unit = if cfg.experts_mxfp4() { 32 } else { 1 };
        self.tp_share(fi / unit).len() * unit
    }

    /// The routed experts this rank computes (all of them without expert parallelism).
    pub fn experts(&self, n: usize) -> Range<usize> {
        part(n, self.par.ep, self.ep_rank)
    }

    /// Whether the shared experts (and the dense FFN) are split over the same ranks as the
    /// routed experts, so that the MoE's one reduction can carry their partial sums too.
    pub fn shared_in_moe_reduce(&self) -> bool {
        self.par.tp == self.par.stage_ranks()
    }

    /// The global rank of stage `stage`'s rank with this rank's index in its stage.
    pub fn peer_in_stage(&self, stage: usize) -> usize {
        stage * self.par.stage_ranks() + self.local
    }

    /// Which slice of `spec` this rank holds; `None` when it holds none of it (another stage's
    /// layer, another owner's expert).
    pub fn shard(&self, spec: &TensorSpec) -> Option<Shard> {
        let on_stage = match (spec.layer, spec.component) {
            (_, Component::Mtp) => self.last_stage(), // the MTP draft layers sit with the head
            (Some(l), _) => self.holds_layer(l),
            (None, Component::Embedding | Component::VisionTower | Component::MmProjector) => self.first_stage(),
            (None, _) => self.last_stage(),
        };
        if !on_stage {
            return None;
        }
        let ep = self.par.ep > 1;
        if let (Some(e), true) = (spec.expert, ep) {
            if !self.experts(self.num_experts).contains(&e) {
                return None;
            }
        }
        let split = |dim: usize, unit: usize| {
            let r = self.tp_share(spec.shape[dim] / unit);
            r.start * unit..r.end * unit
        };
        Some(match spec.split {
            Split::Replicated => Shard::Whole,
            Split::StageRows(u) => {
                let r = self.stage_share(spec.shape[0] / u);
                Shard::Rows(r.start * u..r.end * u)
            }
            Split::ExpertRows(_) | Split::ExpertCols(_) if ep => Shard::Whole,
            Split::Rows(u) | Split::ExpertRows(u) => Shard::Rows(split(0, u)),
            Split::Cols(u) | Split::ExpertCols(u) => Shard::Cols(split(1, u)),
        })
    }

    /// Bytes of `spec` (stored as `bytes` in the checkpoint) that this rank holds.
    pub fn shard_bytes(&self, spec: &TensorSpec, bytes: u64) -> u64 {
        match self.shard(spec) {
            None => 0,
            Some(Shard::Whole) => bytes,
            Some(Shard::Rows(r)) => bytes * r.len() as u64 / spec.shape[0].max(1) as u64,
            Some(Shard::Cols(c)) => bytes * c.len() as u64 / spec.shape[1].max(1) as u64,
        }
    }
}

/// The groups one rank's forward talks to.
#[derive(Clone)]
pub struct Groups {
    /// The stage's tensor-parallel ranks (attention heads, dense FFN, vocabulary): the
    /// reduction after each mixer and the `lm_head` gather.
    pub tp: Arc<dyn Group>,
    /// All ranks of the stage: the MoE's one reduction (routed partials, plus the shared
    /// experts' when they are split over the same ranks).
    pub stage: Arc<dyn Group>,
    /// Every rank: the residual state sent between pipeline stages and the logits sent back.
    pub world: Arc<dyn Group>,
}

impl Groups {
    /// A process that holds the whole model: every collective returns at once.
    pub fn single() -> Groups {
        Groups { tp: Arc::new(Single), stage: Arc::new(Single), world: Arc::new(Single) }
    }

    /// The groups of every rank of `par`, as threads of this process (rank 0 first).
    pub fn host(par: Parallel) -> Vec<Groups> {
        let s = par.stage_ranks();
        let world = HostGroup::create(par.world());
        let mut out = Vec::with_capacity(par.world());
        for st in 0..par.pp {
            for (local, g) in HostGroup::create(s).into_iter().enumerate() {
                let stage: Arc<dyn Group> = Arc::new(g);
                let tp: Arc<dyn Group> = if par.tp > 1 { stage.clone() } else { Arc::new(Single) };
                out.push(Groups { tp, stage, world: Arc::new(world[st * s + local].clone()) });
            }
        }
        out
    }

    /// Fails every peer's pending and future calls (a rank that errors calls this so the
    /// others stop waiting for it).
    pub fn abort(&self, why: &str) {
        self.tp.abort(why);
        self.stage.abort(why);
        self.world.abort(why);
    }
}

/// The GPU model's groups (feature `cuda`): the three roles of [`Groups`], as NCCL
/// communicators on the model's device (one process per rank). A role of one rank is
/// [`CudaGroup::single`], whose verbs return at once.
#[cfg(feature = "cuda")]
#[derive(Clone)]
pub struct CudaGroups {
    pub tp: Arc<k3_core::comm::nccl::CudaGroup>,
    pub stage: Arc<k3_core::comm::nccl::CudaGroup>,
    pub world: Arc<k3_core::comm::nccl::CudaGroup>,
}

#[cfg(feature = "cuda")]
impl CudaGroups {
    /// One process that holds the whole model.
    pub fn single() -> CudaGroups {
        let one = Arc::new(k3_core::comm::nccl::CudaGroup::single());
        CudaGroups { tp: one.clone(), stage: one.clone(), world: one }
    }

    /// How many NCCL ids a world of `par` hands out: the world's (used when `pp > 1`), then
    /// one per stage.
    pub fn ids_needed(par: Parallel) -> usize {
        1 + par.pp
    }

    /// Joins this rank's communicators on `dev`, in the same order on every rank: the world
    /// (when there are several stages), then its stage (when the stage has several ranks).
    /// `ids` as [`CudaGroups::ids_needed`] orders them.
    pub fn nccl(dev: &k3_core::cuda::CudaDevice, plan: &RankPlan, ids: &[[u8; 128]]) -> Result<CudaGroups> {
        use k3_core::comm::nccl::CudaGroup;
        let par = plan.par;
        if ids.len() != Self::ids_needed(par) {
            return Err(ModelError::Input(format!("{} NCCL ids for a world of {} stages (expected {})", ids.len(), par.pp, Self::ids_needed(par))));
        }
        let s = par.stage_ranks();
        let world = match par.pp {
            1 => None,
            _ => Some(Arc::new(CudaGroup::nccl(dev, plan.rank, par.world(), ids[0])?)),
        };
        let stage = match s {
            1 => Arc::new(CudaGroup::single()),
            _ => Arc::new(CudaGroup::nccl(dev, plan.local, s, ids[1 + plan.stage])?),
        };
        let tp = if par.tp > 1 { stage.clone() } else { Arc::new(CudaGroup::single()) };
        let world = world.unwrap_or_else(|| stage.clone());
        Ok(CudaGroups { tp, stage, world })
    }

    /// Starts the watchdog's clock on work enqueued outside its view (a replayed CUDA graph).
    pub fn watch(&self, op: &'static str) -> Result<()> {
        for g in self.distinct() {
            g.watch(op)?;
        }
        Ok(())
    }

    /// Aborts every communicator (a rank that fails calls this so its peers stop waiting).
    pub fn abort(&self, why: &str) {
        for g in self.distinct() {
            g.abort(why);
        }
    }

    /// Each communicator once (the roles often share one: `tp` is `stage` at `--tp S`, `world`
    /// is `stage` with one pipeline stage).
    fn distinct(&self) -> Vec<&Arc<k3_core::comm::nccl::CudaGroup>> {
        let mut out: Vec<&Arc<k3_core::comm::nccl::CudaGroup>> = Vec::with_capacity(3);
        for g in [&self.tp, &self.stage, &self.world] {
            if !out.iter().any(|o| Arc::ptr_eq(o, g)) {
                out.push(g);
            }
        }
        out
    }
}

/// Runs `f` on every rank of `par` as threads of this process (the CPU model's parallel mode,
/// and the test of the plan): each thread loads its rank's model from `ck` over in-process
/// groups and calls `f` on it. A rank that fails aborts the groups, so the others stop at
/// their next collective; the error returned is the first rank's own failure (not a peer's
/// "aborted"). Results are in rank order.
pub fn on_threads<T: Send>(ck: &Checkpoint, par: Parallel, f: impl Fn(&Model) -> Result<T> + Sync) -> Result<Vec<T>> {
    let plans = par.plans(&ck.config)?;
    let groups = Groups::host(par);
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = plans
            .into_iter()
            .zip(groups)
            .map(|(plan, g)| {
                let f = &f;
                s.spawn(move || {
                    let rank = plan.rank;
                    let out = Model::load_rank(ck, plan, g.clone(), true).and_then(|m| f(&m));
                    if let Err(e) = &out {
                        g.abort(&format!("rank {rank} failed: {e}"));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(ModelError::Internal("a rank thread panicked".into())))).collect()
    });
    let aborted = |e: &ModelError| matches!(e, ModelError::Core(k3_core::CoreError::Comm { msg, .. }) if msg.contains("aborted"));
    if let Some(i) = results.iter().position(|r| r.as_ref().is_err_and(|e| !aborted(e))).or_else(|| results.iter().position(Result::is_err)) {
        return Err(results.into_iter().nth(i).and_then(Result::err).expect("an error at i"));
    }
    Ok(results.into_iter().map(|r| r.expect("no error")).collect())
}
