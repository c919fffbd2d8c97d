//! What crosses ranks on the GPU besides the per-layer reductions (`docs/parallel.md`): the
//! residual state sent from one pipeline stage to the next, the column-block gather
//! (`gather_cols`: the vocabulary shards of the logits over the tensor-parallel group, the
//! MoE's router and latent blocks over the stage), and the logits sent back from the last
//! stage to rank 0. All NCCL, on the compute stream, so a decode graph captures them too.
//!
//! Shapes: every residual tensor F32 `[N, H]` (`P`, the completed blocks, the pending FFN
//! output `d`); local logits F32 `[rows, V / tp]`; logits F32 `[rows, V]`.

use k3_core::comm::nccl::CudaGroup;
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
/// `[rows, V]` on every rank of the group.
pub(crate) fn gather_vocab(m: &CudaModel, local: CudaTensor) -> Result<CudaTensor> {
    let [out] = gather_cols(&m.groups.tp, [local])?;
    Ok(out)
}

/// Joins each rank's column block `[N, w_i]` of every tensor in `xs` (rank order) into whole
/// rows `[N, S·w_i]` on every rank of `g`: the all-gathers in one NCCL group (rank-major
/// `[S, N, w_i]`), then one `unblock` kernel each. World 1 returns `xs`.
pub(crate) fn gather_cols<const K: usize>(g: &CudaGroup, xs: [CudaTensor; K]) -> Result<[CudaTensor; K]> {
    let s = g.world();
    if s == 1 {
        return Ok(xs);
    }
    let all = xs.each_ref().map(|x| CudaTensor::uninit(x.cuda_device(), x.dtype(), vec![s, x.shape()[0], x.last_dim()]));
    let all = all.into_iter().collect::<k3_core::Result<Vec<_>>>()?;
    g.group(|g| xs.iter().zip(&all).try_for_each(|(x, a)| g.all_gather(x, a)))?;
    let mut out = Vec::with_capacity(K);
    for (x, a) in xs.iter().zip(&all) {
        let o = CudaTensor::uninit(x.cuda_device(), x.dtype(), vec![x.shape()[0], s * x.last_dim()])?;
        unblock(a, &o)?;
        out.push(o);
    }
    Ok(out.try_into().unwrap_or_else(|_| unreachable!("one output per input")))
}

/// On the last stage of several: the rank whose place in its stage is rank 0's sends the
/// logits to rank 0 (the engine samples there).
pub(crate) fn logits_to_first(m: &CudaModel, logits: &CudaTensor) -> Result<()> {
    if m.plan.par.pp > 1 && m.plan.peer_in_stage(0) == 0 {
        m.groups.world.send(0, logits)?;
    }
    Ok(())
}

/// After a stage without the head has sent its state on: rank 0 receives the logits
/// `[rows, V]` from the last stage; every other rank returns `None`.
pub(crate) fn logits_from_last(m: &CudaModel, rows: usize) -> Result<Option<CudaTensor>> {
    if m.plan.rank != 0 {
        return Ok(None);
    }
    let logits = CudaTensor::uninit(&m.dev, DType::F32, vec![rows, m.config.text.vocab_size])?;
    m.groups.world.recv(m.plan.peer_in_stage(m.plan.par.pp - 1), &logits)?;
    Ok(Some(logits))
}
