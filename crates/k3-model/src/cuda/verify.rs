//! Speculative verification on the GPU (issue 22; the CPU twin is `verify.rs` of the model):
//! the forward that scores `[last, d1..dk]` of each sequence in one packed step, and the exact
//! rollback of its KDA states to the accepted prefix.
//!
//! - [`CudaModel::forward_verify`]: before the step, each KDA layer copies the step's slots of
//!   its pools (conv tails, recurrent state) into a checkpoint (one row gather per pool); the
//!   step runs as a chunked-prefill forward with logits for every row, and each KDA layer keeps
//!   its raw per-token inputs (the six projections, which the fused kernel reads). MLA / DSA
//!   rows are appended as in any step.
//! - [`CudaModel::rollback`]: for the sequences that keep `j` of their `T` rows, each KDA layer
//!   restores the checkpoint and replays its recurrence over the `j` kept rows' saved inputs
//!   (the same kernel, outputs discarded) — so the state is the one a forward of exactly those
//!   `j` rows leaves, tails included, with no second pass of the network; MLA / DSA caches are
//!   truncated by moving `pos` back (their pages are append-only; later rows overwrite).
//!
//! The same work captured in a CUDA graph per (batch, rows per sequence) — checkpoints
//! included; rows padded to the graph's count are undone by the rollback — is `graph.rs`'s
//! [`VerifyGraph`](super::VerifyGraph); `CudaModel::verify_body` is what both run.
//!
//! Every row's logits equal a decode step's within the GPU's rounding (the KDA rows come from the
//! chunked form; the CPU verify is the bit-exact one). One rank only: a parallel layout's state
//! is spread over ranks. Shapes: `B` step sequences, `N` rows; checkpoints `[B, 3·3·D]` and
//! `[B, nh·hd·hd]` per KDA layer; kept inputs `[N, D]` (beta `[N, nh]`); logits F32 `[N, vocab]`.

use k3_core::cuda::kda::KdaInputs;
use k3_core::cuda::ops::gather_rows;
use k3_core::cuda::CudaTensor;
use k3_core::DType;

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
        self.record_verify(seqs, lens, lens, layers);
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
    /// (packed in order), of which the first `real[i]` were its own and counted in its `pos`.
    pub(crate) fn record_verify(&mut self, seqs: &[&mut CudaSeqState], lens: &[usize], real: &[usize], layers: VerifyLayers) {
        let row0 = lens.iter().scan(0, |r, &n| Some(std::mem::replace(r, *r + n))).collect();
        self.verified = Some(Verified {
            slots: seqs.iter().map(|s| s.slot).collect(),
            row0,
            lens: lens.to_vec(),
            real: real.to_vec(),
            rolled: vec![false; lens.len()],
            layers,
        });
    }

    /// Drops the last `drop` rows of the last verify step from each `(sequence, drop)` (see the
    /// module doc); `drop = 0` keeps them all — and undoes the padding rows a verify graph added
    /// to the sequence (`graph.rs`), which every such sequence needs before its next step.
    /// Errors, changing nothing, for a sequence that was not in that step, was rolled back
    /// already, or would keep no row.
    pub fn rollback(&mut self, seqs: &mut [(&mut CudaSeqState, usize)]) -> Result<()> {
        let Some(rec) = self.verified.as_mut() else {
            return Err(ModelError::Input("rollback without a verify step before it".into()));
        };
        let mut todo: Vec<(usize, usize)> = Vec::new(); // (step sequence, rows kept)
        for (s, drop) in seqs.iter() {
            let b = rec.slots.iter().position(|&x| x == s.slot);
            if *drop == 0 && b.is_none_or(|b| rec.real[b] == rec.lens[b]) {
                continue;
            }
            let b = b.ok_or_else(|| ModelError::Input(format!("rollback of a sequence (KDA slot {}) that was not in the last verify step", s.slot)))?;
            if rec.rolled[b] || *drop >= rec.real[b] || todo.iter().any(|t| t.0 == b) {
                return Err(ModelError::Input(format!(
                    "rollback of {drop} rows of a verified sequence of {} rows{}: at least its first row stays, and a step is rolled back once",
                    rec.real[b],
                    if rec.rolled[b] { " rolled back already" } else { "" }
                )));
            }
            todo.push((b, rec.real[b] - drop));
        }
        if todo.is_empty() {
            return Ok(());
        }
        let rows: Vec<i32> = todo.iter().flat_map(|&(b, j)| (rec.row0[b]..rec.row0[b] + j).map(|r| r as i32)).collect();
        let ids = CudaTensor::from_pod(&self.dev, DType::I32, vec![rows.len()], &rows)?;
        let lens: Vec<usize> = todo.iter().map(|t| t.1).collect();
        let slots: Vec<u32> = todo.iter().map(|t| rec.slots[t.0] as u32).collect();
        let kda = self.layers.iter().filter_map(|l| match &l.mixer {
            Mixer::Kda(m) => Some(m),
            _ => None,
        });
        for (m, (conv, state, kept)) in kda.zip(&rec.layers) {
            for (ckpt, pool) in [(conv, &m.conv_pool), (state, &m.state_pool)] {
                let per = pool.byte_len() / pool.shape()[0];
                for &(b, _) in &todo {
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
        for &(b, _) in &todo {
            rec.rolled[b] = true;
        }
        for (s, drop) in seqs.iter_mut() {
            s.pos -= *drop;
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
