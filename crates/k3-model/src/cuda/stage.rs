//! What crosses ranks on the GPU besides the per-layer reductions (`docs/parallel.md`): the
//! residual state sent from one pipeline stage to the next, the vocabulary gather of the
//! logits over the tensor-parallel group, and the logits sent back from the last stage to the
//! first. All NCCL, on the compute stream, so a decode graph captures them too.
//!
//! Shapes: every residual tensor F32 `[N, H]` (`P`, the completed blocks, the pending FFN
//! output `d`); local logits F32 `[rows, V / tp]`; logits F32 `[rows, V]`.

use k3_core::cuda::ops::unblock;
use k3_core::cuda::CudaTensor;
use k3_core::DType;

use super::CudaModel;
use crate::error::Result;

/// The residual state between sublayers (text-backbone §6.2): the partial sum `P` of the open
/// block, the completed blocks (`b_0` is the embedding), and the FFN output not yet added.
pub(crate) struct Residual {
    pub p: CudaTensor,
    pub blocks: Vec<CudaTensor>,
    pub d: Option<CudaTensor>,
}

impl Residual {
    /// Receives the state the previous stage sends before this stage's first layer `l0`: by
    /// then `ceil(l0 / block_size)` blocks are complete and an FFN output is pending, so the
    /// shapes are known and no header is sent.
    pub fn recv(m: &CudaModel, n: usize) -> Result<Residual> {
        let (h, b) = (m.config.text.hidden_size, m.config.text.attn_res_block_size);
        let l0 = m.plan.layers.start;
        let new = || CudaTensor::uninit(&m.dev, DType::F32, vec![n, h]);
        let blocks = (0..l0.div_ceil(b)).map(|_| new()).collect::<k3_core::Result<Vec<_>>>()?;
        let (p, d) = (new()?, new()?);
        let from = m.plan.peer_in_stage(m.plan.stage - 1);
        m.groups.world.group(|w| {
            for t in blocks.iter().chain([&p, &d]) {
                w.recv(from, t)?;
            }
            Ok(())
        })?;
        Ok(Residual { p, blocks, d: Some(d) })
    }

    /// Sends the state to the next stage's rank with this rank's place in its stage.
    pub fn send(&self, m: &CudaModel) -> Result<()> {
        let to = m.plan.peer_in_stage(m.plan.stage + 1);
        m.groups.world.group(|w| {
            for t in self.blocks.iter().chain([&self.p]).chain(self.d.as_ref()) {
                w.send(to, t)?;
            }
            Ok(())
        })?;
        Ok(())
    }
}

/// Joins the tensor-parallel ranks' vocabulary shards `[rows, V / tp]` (rank order) into
/// `[rows, V]` on every rank of the group: one all-gather, then one kernel puts the blocks in
/// place.
pub(crate) fn gather_vocab(m: &CudaModel, local: CudaTensor) -> Result<CudaTensor> {
    let tp = m.groups.tp.world();
    if tp == 1 {
        return Ok(local);
    }
    let (rows, w) = (local.shape()[0], local.shape()[1]);
    let parts = CudaTensor::uninit(&m.dev, DType::F32, vec![tp, rows, w])?; // [tp, rows, V/tp]
    m.groups.tp.all_gather(&local, &parts)?;
    let out = CudaTensor::uninit(&m.dev, DType::F32, vec![rows, tp * w])?;
    unblock(&parts, &out)?;
    Ok(out)
}

/// On the last stage of several: sends the logits to the first stage's rank with this rank's
/// place in its stage (the engine samples there).
pub(crate) fn logits_to_first(m: &CudaModel, logits: &CudaTensor) -> Result<()> {
    if m.plan.par.pp > 1 {
        m.groups.world.send(m.plan.peer_in_stage(0), logits)?;
    }
    Ok(())
}

/// After a stage without the head has sent its state on: the first stage receives the logits
/// `[rows, V]` from the last one; the stages between return `None`.
pub(crate) fn logits_from_last(m: &CudaModel, rows: usize) -> Result<Option<CudaTensor>> {
    if !m.plan.first_stage() {
        return Ok(None);
    }
    let logits = CudaTensor::uninit(&m.dev, DType::F32, vec![rows, m.config.text.vocab_size])?;
    m.groups.world.recv(m.plan.peer_in_stage(m.plan.par.pp - 1), &logits)?;
    Ok(Some(logits))
}
