//! The engine's GPU runner: the whole model on one CUDA device (`k3_model::cuda::CudaModel`),
//! its per-sequence states, and decode steps replayed from CUDA graphs captured once per batch
//! size. With the `cuda` feature off, [`GpuRunner`] and [`GpuSeq`] are uninhabited types, so the
//! scheduler in `engine.rs` has one code path and no `cfg` branches.

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;

    use k3_model::cuda::{CudaModel, CudaSeqState, DecodeGraph, Input};

    use crate::error::Result;

    /// One sequence's place in the GPU pools.
    pub type GpuSeq = CudaSeqState;

    pub struct GpuRunner {
        pub model: CudaModel,
        /// Replay decode steps from CUDA graphs (one captured per batch size on first use).
        pub use_graphs: bool,
        graphs: HashMap<usize, DecodeGraph>,
    }

    impl GpuRunner {
        pub fn new(model: CudaModel, use_graphs: bool) -> Self {
            GpuRunner { model, use_graphs, graphs: HashMap::new() }
        }

        pub fn new_seq(&mut self) -> Result<GpuSeq> {
            Ok(self.model.new_sequence()?)
        }

        pub fn release(&mut self, s: GpuSeq) {
            self.model.release(s);
        }

        /// One packed step; `emb` replaces the token embeddings when given. Returns each
        /// sequence's last-row logits `[B, vocab]`.
        pub fn forward(&mut self, tokens: &[u32], emb: Option<&[f32]>, lens: &[usize], seqs: &mut [&mut GpuSeq]) -> Result<Vec<f32>> {
            let decode = emb.is_none() && lens.iter().all(|&l| l == 1);
            if decode && self.use_graphs {
                let b = lens.len();
                let ctx = self.model.cache.max_tokens.min(self.model.config.max_context());
                if !self.graphs.contains_key(&b) {
                    let g = self.model.capture_decode(b, ctx)?;
                    self.graphs.insert(b, g);
                }
                if let Some(g) = self.graphs.get(&b) {
                    return Ok(self.model.decode_step(g, tokens, seqs)?);
                }
            }
            let input = match emb {
                Some(e) => Input::Embeds(e),
                None => Input::Tokens(tokens),
            };
            Ok(self.model.forward_varlen(input, lens, seqs, true)?)
        }

    }

    /// Uploads the checkpoint to CUDA device `ordinal` with room for `max_seqs` live sequences
    /// and `max_tokens` cached tokens; decode steps use CUDA graphs when `graphs`.
    pub fn load_gpu(ck: &k3_model::Checkpoint, ordinal: usize, max_seqs: usize, max_tokens: usize, graphs: bool) -> Result<GpuRunner> {
        let dev = k3_core::cuda::CudaDevice::new(ordinal).map_err(k3_model::ModelError::from)?;
        let model = CudaModel::load(ck, &dev, k3_model::cuda::CacheConfig { max_seqs, max_tokens })?;
        Ok(GpuRunner::new(model, graphs))
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use crate::error::Result;

    /// Uninhabited without the `cuda` feature.
    pub enum GpuSeq {}
    /// Uninhabited without the `cuda` feature: no value exists, so no method ever runs.
    pub enum GpuRunner {}

    impl GpuRunner {
        pub fn new_seq(&mut self) -> Result<GpuSeq> {
            match *self {}
        }
        pub fn release(&mut self, s: GpuSeq) {
            match s {}
        }
        pub fn forward(&mut self, _: &[u32], _: Option<&[f32]>, _: &[usize], _: &mut [&mut GpuSeq]) -> Result<Vec<f32>> {
            match *self {}
        }
    }

    /// Always an error: this build has no CUDA support.
    pub fn load_gpu(_: &k3_model::Checkpoint, _: usize, _: usize, _: usize, _: bool) -> Result<GpuRunner> {
        Err(crate::error::EngineError::Unsupported("this build has no CUDA support: rebuild with `cargo build --release --features cuda`".into()))
    }
}

pub use imp::{load_gpu, GpuRunner, GpuSeq};
