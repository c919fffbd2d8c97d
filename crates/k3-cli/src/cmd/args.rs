//! Flag groups shared by several subcommands (flattened into their `Args` with
//! `#[command(flatten)]`), so a flag is spelled, documented and checked once.

use anyhow::Result;
use k3_model::Parallel;

/// The parallel layout: `--tp`, `--ep`, `--pp` (`docs/parallel.md`).
#[derive(clap::Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Tensor-parallel ranks per pipeline stage: attention heads, dense FFN, shared experts and
    /// the vocabulary are split over them.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Expert-parallel ranks per stage (default: --tp): routed experts whole on their owner.
    /// `--ep 1` with `--tp N` splits each expert's intermediate dim instead.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Pipeline stages: contiguous runs of decoder layers, one after the other.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
}

impl ParallelArgs {
    pub fn layout(&self) -> Result<Parallel> {
        Ok(Parallel::new(self.tp, self.ep, self.pp)?)
    }
    /// The layout when it has more than one rank (`None` for one); bad values are an error.
    pub fn parallel(&self) -> Result<Option<Parallel>> {
        let p = self.layout()?;
        Ok((p.world() > 1).then_some(p))
    }
}

/// Where this process sits in a multi-process (multi-GPU, multi-node) world:
/// `--nnodes/--node-rank/--master-addr`. Under torchrun, Slurm or Kubernetes the launcher's
/// environment (`RANK`, `WORLD_SIZE`, ...) is used instead and these are ignored.
#[derive(clap::Args, Clone, Debug)]
pub struct LaunchArgs {
    /// Nodes in the world; this node runs (tp·pp)/nnodes ranks, one process per GPU.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes (node 0 hosts rank 0).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// HOST:PORT of rank 0 (an address of node 0 and a free port), the same on every node;
    /// needed with --nnodes > 1.
    #[arg(long)]
    pub master_addr: Option<String>,
}

impl LaunchArgs {
    pub fn node(&self) -> k3_engine::dist::launch::NodeArgs {
        k3_engine::dist::launch::NodeArgs { nnodes: self.nnodes, node_rank: self.node_rank, master_addr: self.master_addr.clone() }
    }
}
