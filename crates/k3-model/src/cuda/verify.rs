//! Speculative verification on the GPU (issue 22; the CPU twin is `verify.rs` of the model):
//! the forward that scores `[last, d1..dk]` of each sequence in one packed step, and the exact
//! rollback of its KDA states to the accepted prefix.
//!
//! - [`CudaModel::forward_verify`]: before the step, each KDA layer copies the step's slots of
//!   its pools (conv tails, recurrent state) into a checkpoint (one row gather per pool); the
//!   step runs as a chunked-prefill forward with logits for every row, and each KDA layer keeps
//!   its raw per-token inputs (the six projections, which the fused kernel reads). MLA / DSA
//!   rows are appended as in any step.
//! - [`CudaModel::rollback`] / [`CudaModel::rollback_as`]: for the sequences that keep `j` of
//!   their `T` rows, each KDA layer restores the checkpoint and replays its recurrence over the
//!   `j` kept rows' saved inputs (the same kernel, outputs discarded) — so the state is the one a
//!   forward of exactly those `j` rows leaves, tails included, with no second pass of the
//!   network; MLA / DSA caches are truncated by moving `pos` back (their pages are append-only;
//!   later rows overwrite). Three forms, equal bit for bit ([`RollbackRun`]): per sequence (the
//!   reference: a copy per sequence and pool, the kept rows gathered), batched from device
//!   tables (per KDA layer one `scatter_rows` per pool by slot, then the KDA prefill over the kept
//!   rows where the verify step left them, `kda_tables_within`; a sequence the call leaves alone
//!   runs 0 rows and restores nothing), and that batched body replayed from the rollback graph
//!   captured with a verify graph.
//!
//! The same work captured in a CUDA graph per (batch, rows per sequence) — checkpoints
//! included; rows padded to the graph's count are undone by the rollback — is `graph.rs`'s
//! [`VerifyGraph`](super::VerifyGraph); `CudaModel::verify_body` is what both run, and
//! `CudaModel::rollback_body` what the batched rollback and its graph run.
//!
//! Every row's logits equal a decode step's within the GPU's rounding (the KDA rows come from the
//! chunked form; the CPU verify is the bit-exact one). One rank only: a parallel layout's state
//! is spread over ranks. Shapes: `B` step sequences, `N` rows; checkpoints `[B, 3·3·D]` and
//! `[B, nh·hd·hd]` per KDA layer; kept inputs `[N, D]` (beta `[N, nh]`); logits F32 `[N, vocab]`.

use k3_core::cuda::kda::{kda_tables_within, KdaInputs};
use k3_core::cuda::ops::gather_rows;
use k3_core::cuda::CudaTensor;
use k3_core::DType;

use super::graph::VerifyGraph;
use super::kda::Kda;
use super::state::{CudaSeqState, Step};
use super::{CudaModel, Input, Mixer};
use crate::error::{ModelError, Result};

/// One KDA layer's raw inputs of a verify step, as the fused kernel reads them.
#[derive(Clone)]
pub(crate) struct KdaKept {
    pub q: CudaTensor,
    pub k: CudaTensor,
    pub v: CudaTensor,
    pub g: CudaTensor,
    pub beta: CudaTensor,
    pub gate: CudaTensor,
}

/// Per KDA layer (in layer order) of a verify step: the checkpoint (conv tails, state) of the
/// step's slots and the kept inputs.
pub(crate) type VerifyLayers = Vec<(CudaTensor, CudaTensor, KdaKept)>;

/// What [`CudaModel::rollback`] needs of the last verify step.
pub(crate) struct Verified {
    /// Per step sequence: its KDA slot, first row, rows computed, rows that were its own (the
    /// rest pad a graph's step and are always rolled back), whether it was rolled back.
    slots: Vec<usize>,
    row0: Vec<usize>,
    lens: Vec<usize>,
    real: Vec<usize>,
    rolled: Vec<bool>,
    layers: VerifyLayers,
    /// The id of the verify graph whose replay this step was (its rollback graph reads the
    /// graph's own checkpoints and kept inputs), `None` for an eager step.
    graph: Option<u64>,
}

impl Verified {
    /// The checked work of a rollback of `seqs` (see [`CudaModel::rollback_as`]): per step
    /// sequence rolled back, (its index in the step, rows kept).
    fn todo(&self, seqs: &[(&mut CudaSeqState, usize)]) -> Result<Vec<(usize, usize)>> {
        let mut todo: Vec<(usize, usize)> = Vec::new();
        for (s, drop) in seqs.iter() {
            let b = self.slots.iter().position(|&x| x == s.slot);
            if *drop == 0 && b.is_none_or(|b| self.real[b] == self.lens[b]) {
                continue;
            }
            let b = b.ok_or_else(|| ModelError::Input(format!("rollback of a sequence (KDA slot {}) that was not in the last verify step", s.slot)))?;
            if self.rolled[b] || *drop >= self.real[b] || todo.iter().any(|t| t.0 == b) {
                return Err(ModelError::Input(format!(
                    "rollback of {drop} rows of a verified sequence of {} rows{}: at least its first row stays, and a step is rolled back once",
                    self.real[b],
                    if self.rolled[b] { " rolled back already" } else { "" }
                )));
            }
            todo.push((b, self.real[b] - drop));
        }
        Ok(todo)
    }

    /// The batched rollback's device tables for `todo`: the KDA prefill's records
    /// (`kda_tables_within` of the step's rows, each sequence running its kept rows, 0 for one
    /// left alone) and the slot each sequence's checkpoint goes back to (−1: none).
    fn tables(&self, todo: &[(usize, usize)]) -> Result<(Vec<i32>, Vec<i32>)> {
        let (mut kept, mut restore) = (vec![0; self.slots.len()], vec![-1i32; self.slots.len()]);
        for &(b, j) in todo {
            kept[b] = j;
            restore[b] = self.slots[b] as i32;
        }
        let slots: Vec<u32> = self.slots.iter().map(|&s| s as u32).collect();
        Ok((kda_tables_within(&self.lens, &kept, &slots)?, restore))
    }
}

/// How [`CudaModel::rollback_as`] runs a rollback; every form leaves the same bits.
#[derive(Clone, Copy)]
pub enum RollbackRun<'g> {
    /// Eager, per sequence: each KDA layer copies each rolled-back sequence's checkpoint rows
    /// back (one copy per sequence and pool), gathers the kept rows' six inputs and runs the KDA
    /// prefill over them. The reference ([`CudaModel::rollback`]).
    PerSequence,
    /// Eager, all sequences at once from device tables (`CudaModel::rollback_body`): what a
    /// rollback graph's replay must equal.
    Batched,
    /// The batched body replayed from the rollback graph captured with `g`, whose replay
    /// (`VerifyRun::Replay`) must have been the last verify step.
    Replay(&'g VerifyGraph),
}

impl CudaModel {
    /// Why this model cannot verify drafts, if it cannot.
    pub fn verify_support(&self) -> std::result::Result<(), String> {
        match self.plan.par.world() {
            1 => Ok(()),
            w => Err(format!(
                "speculative decoding on a parallel GPU layout ({w} ranks) is not built yet: the KDA checkpoints and replays live on one rank; decoding without speculation"
            )),
        }
    }

    /// The verify forward (see the module doc): sequence i consumes `lens[i]` rows of `input`;
    /// returns logits `[N, vocab]` for every row, and remembers what [`CudaModel::rollback`]
    /// needs (until the next verify). Eager; `graph.rs` has the captured form.
    pub fn forward_verify(&mut self, input: Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState]) -> Result<Vec<f32>> {
        self.verify_support().map_err(ModelError::Input)?;
        self.verified = None;
        let mut step = self.prepare(&input, lens, seqs)?;
        step.keep = Some(std::sync::Mutex::new(Vec::new()));
        let (logits, layers) = self.verify_body(&step, &input)?;
        for (s, &n) in seqs.iter_mut().zip(lens) {
            s.pos += n;
        }
        self.record_verify(seqs, lens, lens, layers, None);
        Ok(match logits {
            Some(l) => l.to_f32_vec()?,
            None => Vec::new(),
        })
    }

    /// The verify step's device work on `step` (made with `keep`), enqueued only — so it is
    /// captured as it is when the step's tables are on the device (`graph.rs`): each KDA layer's
    /// checkpoint of the step's slots, then the forward with every row's logits, the KDA layers'
    /// inputs kept.
    pub(crate) fn verify_body(&self, step: &Step, input: &Input<'_>) -> Result<(Option<CudaTensor>, VerifyLayers)> {
        let Some(keep) = &step.keep else {
            return Err(ModelError::Internal("a verify step made without keeping the KDA inputs".into()));
        };
        let b = step.lens.len();
        let mut ckpts = Vec::new();
        for layer in &self.layers {
            if let Mixer::Kda(m) = &layer.mixer {
                let take = |pool: &CudaTensor| -> Result<CudaTensor> {
                    let s = pool.shape()[0];
                    let per = pool.numel() / s;
                    let c = CudaTensor::uninit(&self.dev, pool.dtype(), vec![b, per])?;
                    gather_rows(&pool.reshape(vec![s, per])?, &step.slots, &c)?;
                    Ok(c)
                };
                ckpts.push((take(&m.conv_pool)?, take(&m.state_pool)?));
            }
        }
        let logits = self.run(step, input, false);
        let kept = std::mem::take(&mut *keep.lock().unwrap_or_else(|e| e.into_inner()));
        let logits = logits?;
        if kept.len() != ckpts.len() {
            return Err(ModelError::Internal(format!("the verify step kept the inputs of {} KDA layers of {}", kept.len(), ckpts.len())));
        }
        Ok((logits, ckpts.into_iter().zip(kept).map(|((c, s), k)| (c, s, k)).collect()))
    }

    /// Remembers a verify step for [`CudaModel::rollback`]: sequence i computed `lens[i]` rows
    /// (packed in order), of which the first `real[i]` were its own and counted in its `pos`;
    /// `graph`: the id of the verify graph that replayed it.
    pub(crate) fn record_verify(&mut self, seqs: &[&mut CudaSeqState], lens: &[usize], real: &[usize], layers: VerifyLayers, graph: Option<u64>) {
        let row0 = lens.iter().scan(0, |r, &n| Some(std::mem::replace(r, *r + n))).collect();
        self.verified = Some(Verified {
            slots: seqs.iter().map(|s| s.slot).collect(),
            row0,
            lens: lens.to_vec(),
            real: real.to_vec(),
            rolled: vec![false; lens.len()],
            layers,
            graph,
        });
    }

    /// Drops the last `drop` rows of the last verify step from each `(sequence, drop)` (see the
    /// module doc); `drop = 0` keeps them all — and undoes the padding rows a verify graph added
    /// to the sequence (`graph.rs`), which every such sequence needs before its next step.
    /// Errors, changing nothing, for a sequence that was not in that step, was rolled back
    /// already, or would keep no row. Eager, per sequence ([`RollbackRun::PerSequence`]).
    pub fn rollback(&mut self, seqs: &mut [(&mut CudaSeqState, usize)]) -> Result<()> {
        self.rollback_as(seqs, RollbackRun::PerSequence)
    }

    /// [`CudaModel::rollback`] run as `how` says; every form leaves the same state bits.
    pub fn rollback_as(&mut self, seqs: &mut [(&mut CudaSeqState, usize)], how: RollbackRun<'_>) -> Result<()> {
        let Some(rec) = self.verified.as_ref() else {
            return Err(ModelError::Input("rollback without a verify step before it".into()));
        };
        let todo = rec.todo(seqs)?;
        if todo.is_empty() {
            return Ok(());
        }
        match how {
            RollbackRun::PerSequence => self.rollback_per_sequence(rec, &todo)?,
            RollbackRun::Batched => {
                let (tables, restore) = rec.tables(&todo)?;
                let tables = CudaTensor::from_pod(&self.dev, DType::I32, vec![tables.len()], &tables)?;
                let restore = CudaTensor::from_pod(&self.dev, DType::I32, vec![restore.len()], &restore)?;
                self.rollback_body(&rec.layers, &rec.lens, &tables, &restore)?;
            }
            RollbackRun::Replay(g) => {
                if rec.graph != Some(g.id) {
                    return Err(ModelError::Input(format!(
                        "rollback through the graph of {} × {} rows: the last verify step was not a replay of that verify graph",
                        g.batch(),
                        g.rows()
                    )));
                }
                let Some(rb) = &g.rollback else {
                    return Err(ModelError::Input(format!(
                        "rollback through the graph of {} × {} rows: it was captured without its rollback graph",
                        g.batch(),
                        g.rows()
                    )));
                };
                if let Some(graph) = &rb.graph {
                    let (tables, restore) = rec.tables(&todo)?;
                    rb.tables.write_bytes(bytemuck::cast_slice(&tables))?;
                    rb.restore.write_bytes(bytemuck::cast_slice(&restore))?;
                    graph.launch()?;
                }
            }
        }
        if let Some(rec) = self.verified.as_mut() {
            for &(b, _) in &todo {
                rec.rolled[b] = true;
            }
        }
        for (s, drop) in seqs.iter_mut() {
            s.pos -= *drop;
        }
        Ok(())
    }

    /// The KDA layers, in layer order.
    fn kda_layers(&self) -> impl Iterator<Item = &Kda> {
        self.layers.iter().filter_map(|l| match &l.mixer {
            Mixer::Kda(m) => Some(m),
            _ => None,
        })
    }

    /// [`RollbackRun::PerSequence`]: restore the checkpoint rows sequence by sequence, gather
    /// the kept rows, replay them.
    fn rollback_per_sequence(&self, rec: &Verified, todo: &[(usize, usize)]) -> Result<()> {
        let rows: Vec<i32> = todo.iter().flat_map(|&(b, j)| (rec.row0[b]..rec.row0[b] + j).map(|r| r as i32)).collect();
        let ids = CudaTensor::from_pod(&self.dev, DType::I32, vec![rows.len()], &rows)?;
        let lens: Vec<usize> = todo.iter().map(|t| t.1).collect();
        let slots: Vec<u32> = todo.iter().map(|t| rec.slots[t.0] as u32).collect();
        for (m, (conv, state, kept)) in self.kda_layers().zip(&rec.layers) {
            for (ckpt, pool) in [(conv, &m.conv_pool), (state, &m.state_pool)] {
                let per = pool.byte_len() / pool.shape()[0];
                for &(b, _) in todo {
                    pool.copy_range(rec.slots[b] * per, ckpt, b * per, per)?;
                }
            }
            let pick = |t: &CudaTensor| -> Result<CudaTensor> {
                let out = CudaTensor::uninit(&self.dev, t.dtype(), vec![rows.len(), t.last_dim()])?;
                gather_rows(t, &ids, &out)?;
                Ok(out)
            };
            let (q, k, v, g, beta, gate) = (pick(&kept.q)?, pick(&kept.k)?, pick(&kept.v)?, pick(&kept.g)?, pick(&kept.beta)?, pick(&kept.gate)?);
            m.replay(&KdaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta, gate: &gate }, &lens, &slots)?;
        }
        Ok(())
    }

    /// The batched rollback's device work, enqueued only (so a graph captures it): per KDA layer
    /// of `layers` (a verify step's, `caps[b]` rows per sequence), the checkpoint rows scattered
    /// into the slots `restore` names, then the recurrence over the rows `tables` names
    /// (`Verified::tables`; both device I32, written before the call or the replay).
    pub(crate) fn rollback_body(&self, layers: &VerifyLayers, caps: &[usize], tables: &CudaTensor, restore: &CudaTensor) -> Result<()> {
        if self.kda_layers().count() != layers.len() {
            return Err(ModelError::Internal(format!("a rollback of {} KDA layers' checkpoints on a model of {}", layers.len(), self.kda_layers().count())));
        }
        for (m, (conv, state, kept)) in self.kda_layers().zip(layers) {
            m.rollback(conv, state, restore, kept, caps, tables)?;
        }
        Ok(())
    }

    /// Forgets the last verify step (its checkpoints and inputs); a later rollback errors.
    pub fn end_verify(&mut self) {
        self.verified = None;
    }

    /// Copies of every KDA layer's pools (conv tails, then recurrent states), so that one step
    /// can be run several ways from the same state (`K3_VERIFY_CHECK`, the runner's check of
    /// verify graphs against the eager step): [`CudaModel::restore_kda_pools`] puts them back.
    pub fn copy_kda_pools(&self) -> Result<Vec<CudaTensor>> {
        let mut out = Vec::new();
        for l in &self.layers {
            if let Mixer::Kda(m) = &l.mixer {
                for pool in [&m.conv_pool, &m.state_pool] {
                    let c = CudaTensor::uninit(&self.dev, pool.dtype(), pool.shape().to_vec())?;
                    c.copy_from(pool)?;
                    out.push(c);
                }
            }
        }
        Ok(out)
    }

    /// Writes back pools taken by [`CudaModel::copy_kda_pools`] (and forgets the last verify step).
    pub fn restore_kda_pools(&mut self, saved: &[CudaTensor]) -> Result<()> {
        self.verified = None;
        let pools: Vec<&CudaTensor> = self
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Kda(m) => Some([&m.conv_pool, &m.state_pool]),
                _ => None,
            })
            .flatten()
            .collect();
        if pools.len() != saved.len() {
            return Err(ModelError::Input(format!("{} saved KDA pools for {} pools", saved.len(), pools.len())));
        }
        for (p, s) in pools.into_iter().zip(saved) {
            p.copy_from(s)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{CudaSeqState, Verified};

    fn seq(slot: usize) -> CudaSeqState {
        CudaSeqState { slot, pages: Default::default(), pos: 100 }
    }

    /// The batched rollback's host tables: only the rolled-back sequences' checkpoints go back,
    /// each to its own slot; each sequence runs its kept rows where the step left them, and one
    /// left alone runs none.
    #[test]
    fn batched_tables_restore_and_replay_the_rolled_back_sequences_only() {
        // A graph's step of 3 sequences × 5 rows in slots 3, 2, 1; own rows 5, 2 (padded), 5.
        let rec = Verified {
            slots: vec![3, 2, 1],
            row0: vec![0, 5, 10],
            lens: vec![5; 3],
            real: vec![5, 2, 5],
            rolled: vec![false; 3],
            layers: Vec::new(),
            graph: Some(7),
        };
        let (mut a, mut b, mut c) = (seq(3), seq(2), seq(1));
        // Sequence 0 keeps 1 row, the padded one keeps its 2 own rows, sequence 2 is left out.
        let todo = rec.todo(&[(&mut a, 4), (&mut b, 0)]).unwrap();
        assert_eq!(todo, vec![(0, 1), (1, 2)]);
        let (tables, restore) = rec.tables(&todo).unwrap();
        assert_eq!(restore, vec![3, 2, -1]);
        // Per sequence {tok0, rows, first chunk, slot}, then per chunk {tok, n ≥ 1, slot, pos}.
        assert_eq!(tables, vec![0, 1, 0, 3, 5, 2, 1, 2, 10, 0, 2, 1, 0, 1, 3, 0, 5, 2, 2, 0, 10, 1, 1, 0]);
        // A full sequence keeping all its rows is no work; a sequence outside the step, or
        // dropping every row, is refused.
        assert!(rec.todo(&[(&mut c, 0)]).unwrap().is_empty());
        assert!(rec.todo(&[(&mut seq(5), 1)]).is_err());
        assert!(rec.todo(&[(&mut a, 5)]).is_err());
        assert!(rec.todo(&[(&mut a, 1), (&mut b, 3)]).is_err());
    }
}
