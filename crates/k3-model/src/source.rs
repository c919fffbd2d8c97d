//! Where a layer's weights come from: the whole checkpoint, or one rank's shards of it.
//!
//! [`Tensors`] is what the layer loaders ask (`tensor(name)`, `a_log(name, heads)`); a
//! [`Checkpoint`] answers with whole tensors, a [`Source`] with the slice its [`RankPlan`]
//! gives this rank: row shards (heads, vocabulary rows, FFN rows) are views of the memory map,
//! column shards (the row-parallel `o_proj`/`down_proj`/`w2`) a copy of just those columns.
//! So no rank reads more of the checkpoint than it holds. On a terminal, rank 0's source
//! draws a progress bar over the bytes its plan holds (a real K3 rank loads ~100 GB); in a
//! world of processes every rank's source reports its bytes instead ([`Source::report_to`])
//! and rank 0 draws one bar for the whole world (`k3_engine::dist::process`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use k3_core::Tensor;

use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};
use crate::parallel::{RankPlan, Shard};
use crate::weights::{tensor_table, TensorSpec};

/// Named tensors for the layer loaders.
pub trait Tensors {
    /// The tensor `name` (or this rank's shard of it).
    fn tensor(&self, name: &str) -> Result<Tensor>;
    /// The `A_log` values of the heads this source serves, out of a layer of `num_heads`
    /// (the stored tensor may be zero-padded or `[1, 1, H, 1]`).
    fn a_log(&self, name: &str, num_heads: usize) -> Result<Vec<f32>>;
}

impl Tensors for Checkpoint {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        Checkpoint::tensor(self, name)
    }
    fn a_log(&self, name: &str, num_heads: usize) -> Result<Vec<f32>> {
        Checkpoint::a_log(self, name, num_heads)
    }
}

/// One rank's view of a checkpoint.
pub struct Source<'a> {
    pub ck: &'a Checkpoint,
    pub plan: RankPlan,
    specs: HashMap<String, TensorSpec>,
    /// Bytes handed out so far, over the bytes this rank holds (drawn on rank 0's terminal).
    progress: indicatif::ProgressBar,
    /// Where the bytes handed out so far are reported (a world's loading), with their count.
    report: Option<&'a LoadReport<'a>>,
    handed: AtomicU64,
}

/// Receives the bytes a rank's source has handed out so far (cumulative), as it loads.
pub type LoadReport<'a> = dyn Fn(u64) + Sync + 'a;

impl<'a> Source<'a> {
    pub fn new(ck: &'a Checkpoint, plan: RankPlan) -> Source<'a> {
        Self::from_table(ck, plan, tensor_table(&ck.config))
    }

    /// [`Source::new`] after [`Checkpoint::check_table`] on the same table (built once).
    pub fn checked(ck: &'a Checkpoint, plan: RankPlan) -> Result<Source<'a>> {
        let table = tensor_table(&ck.config);
        ck.check_table(&table)?;
        Ok(Self::from_table(ck, plan, table))
    }

    fn from_table(ck: &'a Checkpoint, plan: RankPlan, table: Vec<TensorSpec>) -> Source<'a> {
        let progress = indicatif::ProgressBar::hidden();
        let specs = table.into_iter().map(|s| (s.name.clone(), s)).collect();
        Source { ck, plan, specs, progress, report: None, handed: AtomicU64::new(0) }
    }

    /// Bytes of the checkpoint this rank's plan holds (what the loaders will be handed).
    pub fn held_bytes(&self) -> u64 {
        self.specs.values().map(|s| self.plan.shard_bytes(s, self.ck.entry(&s.name).map_or(0, |e| e.len as u64))).sum()
    }

    /// Draws a bar titled `what` over [`Source::held_bytes`] on stderr while the loaders read,
    /// on rank 0 only (other ranks share its terminal) and only when stderr is a terminal.
    pub fn show_progress(mut self, what: &str) -> Self {
        if self.plan.rank == 0 && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            let style = indicatif::ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            self.progress = indicatif::ProgressBar::new(self.held_bytes()).with_style(style).with_message(what.to_string());
        }
        self
    }

    /// Reports the bytes handed out to `r` (cumulative, after each tensor) instead of drawing a
    /// bar of its own; `None` leaves the source as it is.
    pub fn report_to(mut self, r: Option<&'a LoadReport<'a>>) -> Self {
        if r.is_some() {
            self.progress = indicatif::ProgressBar::hidden();
            self.report = r;
        }
        self
    }

    /// Ends the bar (a no-op when none is drawn).
    pub fn done(&self) {
        self.progress.finish_and_clear();
    }

    /// The whole checkpoint (a one-rank plan).
    pub fn whole(ck: &'a Checkpoint) -> Source<'a> {
        Self::new(ck, RankPlan::single(&ck.config))
    }

    fn spec(&self, name: &str) -> Result<&TensorSpec> {
        self.specs.get(name).ok_or_else(|| ModelError::Tensor {
            name: name.into(),
            msg: "is not in the K3 tensor table (a loader asked for a name the table does not define)".into(),
        })
    }

    fn shard(&self, spec: &TensorSpec) -> Result<Shard> {
        self.plan.shard(spec).ok_or_else(|| ModelError::Tensor {
            name: spec.name.clone(),
            msg: format!(
                "is not held by rank {} (stage {} of {}, layers {:?}): a loader asked for another rank's tensor",
                self.plan.rank, self.plan.stage, self.plan.par.pp, self.plan.layers
            ),
        })
    }
}

impl Tensors for Source<'_> {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        let spec = self.spec(name)?;
        let t = self.ck.tensor(name)?;
        let terr = |e: k3_core::CoreError| ModelError::Tensor { name: name.into(), msg: e.to_string() };
        let whole = self.ck.entry(name).map_or(0, |e| e.len as u64);
        let n = self.plan.shard_bytes(spec, whole);
        self.progress.inc(n);
        if let Some(r) = self.report {
            r(self.handed.fetch_add(n, Ordering::Relaxed) + n);
        }
        Ok(match self.shard(spec)? {
            Shard::Whole => t,
            Shard::Rows(r) => t.narrow_rows(r.start, r.len()).map_err(terr)?,
            Shard::Cols(c) => t.narrow_cols(c.start, c.len()).map_err(terr)?,
        })
    }

    fn a_log(&self, name: &str, num_heads: usize) -> Result<Vec<f32>> {
        let spec = self.spec(name)?;
        let all = self.ck.a_log(name, num_heads)?;
        Ok(match self.shard(spec)? {
            Shard::Rows(r) => all[r].to_vec(),
            _ => all,
        })
    }
}
