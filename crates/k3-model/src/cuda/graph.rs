//! Decode steps replayed from a CUDA graph (issue 13: 93 layers must not pay launch overhead per
//! token). A [`DecodeGraph`] is captured for one batch size `B` and a block-table width (the most
//! pages a sequence may have while it is used): it owns the step's device tables and its logits
//! buffer; each [`CudaModel::decode_step`] writes the new tables into them, replays the graph and
//! reads the logits back.
//!
//! Capture needs the kernels compiled and the GEMM plans chosen beforehand, so one eager warm-up
//! step runs first on the pools' scratch slot and page (never given to a sequence). DSA layers
//! score `width · PAGE` positions per row in the graph (rows beyond a sequence's length are
//! skipped by the kernels), so the width bounds the context the graph serves.

use k3_core::cuda::mla::PAGE;
use k3_core::cuda::{capture, CudaTensor, Graph};

use super::stage::Residual;
use super::state::{Step, StepHost};
use super::{CudaModel, CudaSeqState, Input};
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
        if !self.capturable() {
            return Err(ModelError::Input(
                "decode graphs need every routed expert on the GPU: this model computes some on the CPU (--experts-on cpu|disk); run without CUDA graphs"
                    .into(),
            ));
        }
        if batch == 0 || batch > self.cache.max_seqs {
            return Err(ModelError::Input(format!("decode graph batch {batch}: must be 1..={} (CacheConfig.max_seqs)", self.cache.max_seqs)));
        }
        let width = max_context.min(self.config.max_context()).div_ceil(PAGE).max(1);
        let scratch = self.free.scratch();
        let refs: Vec<&CudaSeqState> = (0..batch).map(|_| &scratch).collect();
        let lens = vec![1; batch];
        let mut host = StepHost::build(&refs, &lens, width);
        host.max_len = width * PAGE;
        let zeros = vec![0u32; batch];
        let step = host.upload(&self.dev, &lens, Some(&zeros))?;
        let input = Input::Tokens(&zeros);
        // Warm-up: compiles kernels and times the GEMM algorithms of these shapes (writes only
        // scratch state); the capture then reuses the chosen plans.
        super::TUNE_GEMMS.with(|t| t.set(true));
        let warm = self.run(&step, &input, true).and_then(|o| {
            drop(o);
            Ok(self.dev.synchronize()?)
        });
        let (mut out, mut kept) = (None, None);
        let graph = warm.and_then(|_| {
            Ok(capture(&self.dev, || {
                let dev_err = |e: ModelError| k3_core::CoreError::Device(e.to_string());
                match held {
                    true => kept = Some(self.run_stage(&step, &input).map_err(dev_err)?),
                    false => out = Some(self.run(&step, &input, true).map_err(dev_err)?),
                }
                Ok(())
            })?)
        });
        super::TUNE_GEMMS.with(|t| t.set(false));
        let graph = graph?;
        if out.is_none() && kept.is_none() {
            return Err(ModelError::Internal("graph capture did not run the step".into()));
        }
        Ok(DecodeGraph { batch, width, step, logits: out.flatten(), held: kept, graph })
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
