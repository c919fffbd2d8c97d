//! Where a layer's weights come from: the whole checkpoint, or one rank's shards of it.
//!
//! [`Tensors`] is what the layer loaders ask (`tensor(name)`, `a_log(name, heads)`); a
//! [`Checkpoint`] answers with whole tensors, a [`Source`] with the slice its [`RankPlan`]
//! gives this rank: row shards (heads, vocabulary rows, FFN rows) are views of the memory map,
//! column shards (the row-parallel `o_proj`/`down_proj`/`w2`) a copy of just those columns.
//! So no rank reads more of the checkpoint than it holds.

use std::collections::HashMap;

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
}

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
        let specs = table.into_iter().map(|s| (s.name.clone(), s)).collect();
        Source { ck, plan, specs }
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
