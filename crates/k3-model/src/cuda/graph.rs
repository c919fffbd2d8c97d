//! Steps replayed from CUDA graphs (issue 13: 93 layers must not pay launch overhead per
//! token), and the one capture routine they share (`capture_body`: an eager warm-up, then the
//! capture). Each graph owns its step's device tables and its output buffers; a replay writes
//! the new step's tables into them, launches the graph and reads the outputs.
//!
//! - [`DecodeGraph`], per batch size `B` and block-table width (the most pages a sequence may
//!   have while it is used): the decode step; logits `[B, vocab]`.
//! - [`VerifyGraph`], per batch size `B` and rows per sequence `T` (= k + 1, issue 22): the
//!   speculative verify step (`verify.rs`), KDA checkpoints included; logits `[B·T, vocab]`, the
//!   checkpoints and the KDA layers' kept inputs, which the eager rollback reads. A sequence
//!   with fewer rows is padded to `T` with its last token; the padding rows run on its own state
//!   and are undone by [`CudaModel::rollback`] (drop 0 for a sequence keeping all its own
//!   rows), which every padded sequence needs before its next step; their logits are not
//!   returned. The KDA prefill reads its sequence tables from the step (k3-core
//!   `kda_prefill_tables`), so it is capturable; the step is never `fresh` (the absorbed MLA
//!   form, as an eager verify, whose cache is never empty). [`VerifyRun::Eager`] runs a graph's
//!   step eagerly: the reference a replay equals bit for bit. GEMM algorithms are cuBLASLt's
//!   heuristic choice, as in the eager verify step (decode graphs time theirs). A verify graph
//!   captured with `rollback` carries the **rollback graph** of its step (`RollbackGraph`: `verify.rs`'s batched
//!   rollback over the graph's own checkpoints and kept inputs, its slots, kept rows and
//!   restore targets in two device tables written before each replay; `RollbackRun::Replay`).
//!
//! Capture needs the kernels compiled and the GEMM plans chosen beforehand, so one eager warm-up
//! step runs first on the pools' scratch slot and page (never given to a sequence). DSA layers
//! score `width · PAGE` positions per row in the graph (rows beyond a sequence's length are
//! skipped by the kernels), so the width bounds the context the graph serves. A verify step of
//! `B·T` rows is capturable while every MoE layer's experts take the device-grouped path for
//! that many rows (`k3_core::cuda::moe::capturable`); [`CudaModel::verify_capturable`] says why
//! not otherwise.

use k3_core::cuda::kda::{kda_tables, kda_tables_within};
use k3_core::cuda::mla::PAGE;
use k3_core::cuda::ops::gather_rows;
use k3_core::cuda::{capture, CudaTensor, Graph};
use k3_core::DType;

use super::stage::Residual;
use super::state::{Step, StepHost};
use super::verify::VerifyLayers;
use super::{CudaModel, CudaSeqState, Ffn, Input};
use crate::error::{ModelError, Result};

pub struct DecodeGraph {
    batch: usize,
    width: usize,
    step: Step,
    /// `None` except on rank 0 and the last pipeline stage.
    logits: Option<CudaTensor>,
    /// A held graph (rank 0's pipelined steps, `pipe.rs`): the residual state its stage
    /// leaves, sent on outside the graph.
    pub(crate) held: Option<Residual>,
    graph: Graph,
}

impl DecodeGraph {
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Replays the captured step as it is (same tables): for timing.
    pub fn replay(&self) -> k3_core::Result<()> {
        self.graph.launch()
    }
    /// Longest context (tokens) a sequence may reach while decoding through this graph.
    pub fn max_context(&self) -> usize {
        self.width * PAGE
    }
}

impl CudaModel {
    /// Captures the decode step of `batch` sequences whose contexts stay within `max_context`
    /// tokens. On a parallel rank the graph holds the step's NCCL calls: drop it before the
    /// model (whose communicators it uses).
    pub fn capture_decode(&mut self, batch: usize, max_context: usize) -> Result<DecodeGraph> {
        self.capture_with(batch, max_context, false)
    }

    /// [`CudaModel::capture_decode`] of rank 0's stage alone on a pipeline layout (`held`): the
    /// graph stops at the residual state, which [`DecodeGraph::send_held`] sends on later (the
    /// warm-up step runs whole, so its messages pair with the other ranks' warm-up).
    pub(crate) fn capture_with(&mut self, batch: usize, max_context: usize, held: bool) -> Result<DecodeGraph> {
        let (step, width) = self.scratch_step(batch, 1, max_context, "decode")?;
        let zeros = vec![0u32; batch];
        let input = Input::Tokens(&zeros);
        // The GEMM algorithms of these shapes are timed once: they recur on every replay.
        let warm = || self.run(&step, &input, true).map(drop);
        let (graph, (out, kept)) = self.capture_body(true, warm, || match held {
            true => Ok((None, Some(self.run_stage(&step, &input)?))),
            false => Ok((self.run(&step, &input, true)?, None)),
        })?;
        Ok(DecodeGraph { batch, width, step, logits: out, held: kept, graph })
    }

    /// The one capture routine: `warm` runs eagerly (compiles the kernels and chooses the GEMM
    /// plans — timed ones with `tune` — writing only scratch state), then what `body` enqueues
    /// is captured; its result (the graph's output tensors) comes back with the graph.
    fn capture_body<R>(&self, tune: bool, warm: impl FnOnce() -> Result<()>, body: impl FnOnce() -> Result<R>) -> Result<(Graph, R)> {
        super::TUNE_GEMMS.with(|t| t.set(tune));
        let warmed = warm().and_then(|_| Ok(self.dev.synchronize()?));
        let mut out = None;
        let graph = warmed.and_then(|_| {
            Ok(capture(&self.dev, || {
                out = Some(body().map_err(|e| k3_core::CoreError::Device(e.to_string()))?);
                Ok(())
            })?)
        });
        super::TUNE_GEMMS.with(|t| t.set(false));
        let graph = graph?;
        let out = out.ok_or_else(|| ModelError::Internal("graph capture did not run the step".into()))?;
        Ok((graph, out))
    }

    /// A graph's step of `batch` sequences of `rows` rows on the scratch slot and page, its
    /// block table wide enough for `max_context` tokens (capped at the model's limit): the step
    /// and the width in pages.
    fn scratch_step(&self, batch: usize, rows: usize, max_context: usize, what: &str) -> Result<(Step, usize)> {
        if !self.capturable() {
            return Err(ModelError::Input(format!(
                "{what} graphs need every routed expert on the GPU: this model computes some on the CPU (--experts-on cpu|disk); run without CUDA graphs"
            )));
        }
        if batch == 0 || batch > self.cache.max_seqs {
            return Err(ModelError::Input(format!("{what} graph batch {batch}: must be 1..={} (CacheConfig.max_seqs)", self.cache.max_seqs)));
        }
        let width = max_context.min(self.config.max_context()).div_ceil(PAGE).max(1);
        let scratch = self.free.scratch();
        let refs: Vec<&CudaSeqState> = (0..batch).map(|_| &scratch).collect();
        let lens = vec![rows; batch];
        let mut host = StepHost::build(&refs, &lens, width);
        host.max_len = width * PAGE;
        Ok((host.upload(&self.dev, &lens, Some(&vec![0u32; batch * rows]))?, width))
    }

    /// One decode token for each of `seqs` through `g`; returns logits `[B, vocab]` on the host
    /// (empty except on rank 0 and the last pipeline stage).
    pub fn decode_step(&mut self, g: &DecodeGraph, tokens: &[u32], seqs: &mut [&mut CudaSeqState]) -> Result<Vec<f32>> {
        Ok(match self.decode_step_device(g, tokens, seqs)? {
            Some(l) => l.to_f32_vec()?,
            None => Vec::new(),
        })
    }

    /// [`CudaModel::decode_step`] leaving the logits on the device: the graph's logits buffer
    /// F32 `[B, vocab]` (rank 0 and the last pipeline stage; `None` elsewhere), enqueued and
    /// not waited for, valid until the graph's next replay.
    pub fn decode_step_device(&mut self, g: &DecodeGraph, tokens: &[u32], seqs: &mut [&mut CudaSeqState]) -> Result<Option<CudaTensor>> {
        self.replay_step(g, tokens, seqs)?;
        Ok(g.logits.clone())
    }

    /// [`CudaModel::decode_step`] through a held graph (rank 0's pipelined steps): enqueues the
    /// step and returns; [`DecodeGraph::send_held`] sends its residual state on.
    pub(crate) fn decode_held(&mut self, g: &DecodeGraph, tokens: &[u32], seqs: &mut [&mut CudaSeqState]) -> Result<()> {
        if g.held.is_none() {
            return Err(ModelError::Internal("decode_held through a graph that sends its state itself".into()));
        }
        self.replay_step(g, tokens, seqs)
    }

    /// Writes this step's tables into `g` and replays it (enqueued; no host synchronisation).
    fn replay_step(&mut self, g: &DecodeGraph, tokens: &[u32], seqs: &mut [&mut CudaSeqState]) -> Result<()> {
        if tokens.len() != g.batch || seqs.len() != g.batch {
            return Err(ModelError::Input(format!("decode graph for batch {} got {} tokens and {} sequences", g.batch, tokens.len(), seqs.len())));
        }
        self.check_tokens(tokens)?;
        let ones = vec![1; g.batch];
        self.grow(seqs, &ones, g.max_context(), &format!("the {} tokens this decode graph was captured for", g.max_context()))?;
        let refs: Vec<&CudaSeqState> = seqs.iter().map(|s| &**s).collect();
        let host = StepHost::build(&refs, &ones, g.width);
        let st = &g.step;
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        if let Some(t) = &st.tokens {
            t.write_bytes(bytemuck::cast_slice(&ids))?;
        }
        st.row_seq.write_bytes(bytemuck::cast_slice(&host.row_seq))?;
        st.row_pos.write_bytes(bytemuck::cast_slice(&host.row_pos))?;
        st.block_table.write_bytes(bytemuck::cast_slice(&host.block_table))?;
        st.slots.write_bytes(bytemuck::cast_slice(&host.slots))?;
        g.graph.launch()?;
        // The graph's NCCL calls are outside the communicators' view: start their watchdog clock.
        self.groups.watch("decode graph")?;
        for s in seqs.iter_mut() {
            s.pos += 1;
        }
        Ok(())
    }
}

impl DecodeGraph {
    /// Sends a held graph's residual state (its last replay's) to the next stage.
    pub(crate) fn send_held(&self, m: &CudaModel) -> Result<()> {
        match &self.held {
            Some(r) => r.send(m),
            None => Err(ModelError::Internal("send_held on a graph that sends its state itself".into())),
        }
    }
}

/// A captured verify step of `batch` sequences × `rows` rows (see the module doc).
pub struct VerifyGraph {
    /// Unique per capture: a verify step records the graph that replayed it, so that only that
    /// graph's rollback graph (which reads its buffers) rolls it back.
    pub(crate) id: u64,
    batch: usize,
    rows: usize,
    width: usize,
    step: Step,
    /// F32 `[batch · rows, vocab]`.
    logits: CudaTensor,
    /// Per KDA layer: the checkpoints and kept inputs the graph writes on every replay.
    layers: VerifyLayers,
    graph: Graph,
    /// `None` when captured without it (the runner captures it only while rollback graphs are
    /// on).
    pub(crate) rollback: Option<RollbackGraph>,
}

/// The batched rollback (`CudaModel::rollback_body`) of a verify graph's step, captured.
pub(crate) struct RollbackGraph {
    /// I32: `kda_tables_within(rows per sequence, kept rows, slots)`, written before a replay.
    pub tables: CudaTensor,
    /// I32 `[batch]`: the pool slot each sequence's checkpoint goes back to, −1 for none.
    pub restore: CudaTensor,
    /// `None` for a model without KDA layers (a rollback only moves `pos` back).
    pub graph: Option<Graph>,
}

/// Ids of verify graphs.
static NEXT_GRAPH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl VerifyGraph {
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Rows per sequence (k + 1 for k drafts).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Longest context (tokens, padding rows included) a sequence may reach through this graph.
    pub fn max_context(&self) -> usize {
        self.width * PAGE
    }
    /// Whether its rollback graph was captured with it.
    pub fn has_rollback(&self) -> bool {
        self.rollback.is_some()
    }
}

/// How [`CudaModel::verify_step`] runs a verify graph's step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyRun {
    /// Replays the graph.
    Replay,
    /// Runs the same step (padding, tables, GEMM plans) eagerly: what a replay must equal.
    Eager,
}

/// Each sequence's `lens[i]` tokens of `tokens` (packed), padded to `rows` with its last token.
pub(crate) fn pad_rows(tokens: &[u32], lens: &[usize], rows: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(lens.len() * rows);
    let mut at = 0;
    for &n in lens {
        let own = &tokens[at..at + n];
        out.extend_from_slice(own);
        out.extend(std::iter::repeat_n(own[n - 1], rows - n));
        at += n;
    }
    out
}

/// The rows of a padded step (`rows` per sequence) that are the sequences' own, in order.
pub(crate) fn own_rows(lens: &[usize], rows: usize) -> Vec<i32> {
    lens.iter().enumerate().flat_map(|(b, &n)| (b * rows..b * rows + n).map(|r| r as i32)).collect()
}

impl CudaModel {
    /// Why a verify step of `batch` sequences × `rows` rows cannot be captured, if it cannot
    /// (it then runs eagerly: [`CudaModel::forward_verify`]).
    pub fn verify_capturable(&self, batch: usize, rows: usize) -> std::result::Result<(), String> {
        self.verify_support()?;
        if !self.capturable() {
            return Err("some routed experts are computed by the CPU (--experts-on cpu|disk)".into());
        }
        if batch == 0 || rows == 0 || rows > PAGE || batch > self.cache.max_seqs {
            return Err(format!(
                "{batch} sequences × {rows} rows: 1..={} sequences (CacheConfig.max_seqs) of 1..={PAGE} rows (the warm-up writes them to one scratch page)",
                self.cache.max_seqs
            ));
        }
        let n = batch * rows;
        let reference = self.dtype == DType::F32;
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                if !m.capturable_rows(n, reference) {
                    return Err(format!(
                        "{n} rows ({batch} sequences × {rows}) take the MoE's per-expert path, which reads the routing on the host (above k3_core::cuda::moe::mma_max_tokens; K3_MOE_MMA_MAX_TOKENS raises the cut)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Captures the verify step of `batch` sequences × `rows` rows whose contexts (padding rows
    /// included) stay within `max_context` tokens, and with `rollback` its rollback graph.
    pub fn capture_verify(&mut self, batch: usize, rows: usize, max_context: usize, rollback: bool) -> Result<VerifyGraph> {
        self.verify_capturable(batch, rows).map_err(|why| ModelError::Input(format!("verify graph of {batch} × {rows} rows: {why}")))?;
        let (mut step, width) = self.scratch_step(batch, rows, max_context, "verify")?;
        step.fresh = false;
        step.keep = Some(std::sync::Mutex::new(Vec::new()));
        let lens = vec![rows; batch];
        let slots = vec![self.free.scratch().slot as u32; batch];
        let tables = kda_tables(&lens, &slots)?;
        step.kda_tables = Some(CudaTensor::from_pod(&self.dev, DType::I32, vec![tables.len()], &tables)?);
        let zeros = vec![0u32; batch * rows];
        let input = Input::Tokens(&zeros);
        let warm = || self.verify_body(&step, &input).map(drop);
        let (graph, (logits, layers)) = self.capture_body(false, warm, || self.verify_body(&step, &input))?;
        let logits = logits.ok_or_else(|| ModelError::Internal("the verify graph has no logits".into()))?;
        let rollback = if rollback { Some(self.capture_rollback(batch, rows, &layers)?) } else { None };
        let id = NEXT_GRAPH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(VerifyGraph { id, batch, rows, width, step, logits, layers, graph, rollback })
    }

    /// The rollback graph of a verify graph's step (`layers`: its checkpoints and kept inputs).
    /// The warm-up restores nothing and runs no row: every sequence names the scratch slot with
    /// 0 rows, which the KDA kernels read and write back unchanged (several blocks doing so on one
    /// slot write the same bits).
    fn capture_rollback(&self, batch: usize, rows: usize, layers: &VerifyLayers) -> Result<RollbackGraph> {
        let caps = vec![rows; batch];
        let scratch = self.free.scratch().slot as u32;
        let t = kda_tables_within(&caps, &vec![0; batch], &vec![scratch; batch])?;
        let tables = CudaTensor::from_pod(&self.dev, DType::I32, vec![t.len()], &t)?;
        let restore = CudaTensor::from_pod(&self.dev, DType::I32, vec![batch], &vec![-1i32; batch])?;
        if layers.is_empty() {
            return Ok(RollbackGraph { tables, restore, graph: None });
        }
        let body = || self.rollback_body(layers, &caps, &tables, &restore);
        let (graph, ()) = self.capture_body(false, body, body)?;
        Ok(RollbackGraph { tables, restore, graph: Some(graph) })
    }

    /// The verify step through `g` (see the module doc): sequence i consumes `lens[i]` ≤
    /// `g.rows()` tokens of `tokens`; returns the logits of those rows `[Σ lens, vocab]` on the
    /// host, as [`CudaModel::forward_verify`] does, and remembers the step for
    /// [`CudaModel::rollback`] — which a sequence with fewer rows than the graph's needs (drop 0
    /// at least) before its next step.
    pub fn verify_step(&mut self, g: &VerifyGraph, tokens: &[u32], lens: &[usize], seqs: &mut [&mut CudaSeqState], how: VerifyRun) -> Result<Vec<f32>> {
        self.verify_support().map_err(ModelError::Input)?;
        self.verified = None;
        let (b, t) = (g.batch, g.rows);
        if lens.len() != b || seqs.len() != b || lens.iter().any(|&n| n == 0 || n > t) {
            return Err(ModelError::Input(format!("verify graph of {b} × {t} rows got {} sequences of {lens:?} rows (1..={t} each)", seqs.len())));
        }
        if tokens.len() != lens.iter().sum::<usize>() {
            return Err(ModelError::Input(format!("{} tokens for rows {lens:?}", tokens.len())));
        }
        self.check_tokens(tokens)?;
        let mut seen = vec![false; self.free.pool_slots()];
        for s in seqs.iter() {
            match seen.get_mut(s.slot) {
                Some(u) if !*u => *u = true,
                _ => return Err(ModelError::Input(format!("KDA slot {} is repeated or outside the pool", s.slot))),
            }
        }
        let full = vec![t; b];
        let padded = pad_rows(tokens, lens, t);
        self.grow(seqs, &full, g.max_context(), &format!("the {} tokens this verify graph was captured for", g.max_context()))?;
        let refs: Vec<&CudaSeqState> = seqs.iter().map(|s| &**s).collect();
        let mut host = StepHost::build(&refs, &full, g.width);
        host.max_len = g.width * PAGE;
        let slots: Vec<u32> = host.slots.iter().map(|&s| s as u32).collect();
        let tables = kda_tables(&full, &slots)?;
        let (logits, layers) = match how {
            VerifyRun::Replay => {
                let st = &g.step;
                let ids: Vec<i32> = padded.iter().map(|&x| x as i32).collect();
                let dev_tables = st.kda_tables.as_ref().ok_or_else(|| ModelError::Internal("a verify graph without KDA tables".into()))?;
                st.tokens.as_ref().ok_or_else(|| ModelError::Internal("a verify graph without token ids".into()))?.write_bytes(bytemuck::cast_slice(&ids))?;
                st.row_seq.write_bytes(bytemuck::cast_slice(&host.row_seq))?;
                st.row_pos.write_bytes(bytemuck::cast_slice(&host.row_pos))?;
                st.block_table.write_bytes(bytemuck::cast_slice(&host.block_table))?;
                st.slots.write_bytes(bytemuck::cast_slice(&host.slots))?;
                dev_tables.write_bytes(bytemuck::cast_slice(&tables))?;
                g.graph.launch()?;
                (g.logits.clone(), g.layers.clone())
            }
            VerifyRun::Eager => {
                let mut step = host.upload(&self.dev, &full, Some(&padded))?;
                step.fresh = false;
                step.keep = Some(std::sync::Mutex::new(Vec::new()));
                step.kda_tables = Some(CudaTensor::from_pod(&self.dev, DType::I32, vec![tables.len()], &tables)?);
                let (l, layers) = self.verify_body(&step, &Input::Tokens(&padded))?;
                (l.ok_or_else(|| ModelError::Internal("the verify step has no logits".into()))?, layers)
            }
        };
        for (s, &n) in seqs.iter_mut().zip(lens) {
            s.pos += n;
        }
        self.record_verify(seqs, &full, lens, layers, (how == VerifyRun::Replay).then_some(g.id));
        if lens == full.as_slice() {
            return Ok(logits.to_f32_vec()?);
        }
        let own = own_rows(lens, t);
        let ids = CudaTensor::from_pod(&self.dev, DType::I32, vec![own.len()], &own)?;
        let out = CudaTensor::uninit(&self.dev, DType::F32, vec![own.len(), logits.last_dim()])?;
        gather_rows(&logits, &ids, &out)?;
        Ok(out.to_f32_vec()?)
    }
}

#[cfg(test)]
mod tests {
    use super::{own_rows, pad_rows};

    #[test]
    fn padding_repeats_the_last_token_and_own_rows_skip_it() {
        assert_eq!(pad_rows(&[7, 8, 9, 4, 5], &[3, 1, 1], 3), vec![7, 8, 9, 4, 4, 4, 5, 5, 5]);
        assert_eq!(own_rows(&[3, 1, 2], 3), vec![0, 1, 2, 3, 6, 7]);
        assert_eq!(pad_rows(&[1, 2], &[2], 2), vec![1, 2]);
        assert_eq!(pad_rows(&[1, 2, 3], &[2, 1], 3), vec![1, 2, 2, 3, 3, 3]);
        assert_eq!(own_rows(&[2], 2), vec![0, 1]);
    }
}
