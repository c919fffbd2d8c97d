//! The engine's GPU runner: the whole model on one CUDA device (`k3_model::cuda::CudaModel`),
//! its per-sequence states, and decode steps replayed from CUDA graphs captured once per batch
//! size. With the `cuda` feature off, [`GpuRunner`] and [`GpuSeq`] are uninhabited types, so the
//! scheduler in `engine.rs` has one code path and no `cfg` branches.
//!
//! Admission control: the GPU latent cache is a fixed number of pages. A sequence is admitted
//! only when its worst case — prompt + `max_tokens`, capped at the context limit — can be
//! reserved in [`CacheBudget`]; otherwise it waits. So a step never runs out of pages half-way
//! (which would fail every sequence of the batch), and a request that could never fit is refused
//! when it is added.

/// Pages of the GPU cache promised to admitted sequences (pure accounting, no device).
#[derive(Clone, Debug)]
pub struct CacheBudget {
    page: usize,
    total: usize,
    reserved: usize,
}

impl CacheBudget {
    /// A cache of `tokens` tokens in pages of `page` tokens.
    pub fn new(tokens: usize, page: usize) -> Self {
        let page = page.max(1);
        CacheBudget { page, total: tokens.div_ceil(page), reserved: 0 }
    }
    /// Pages a sequence of `tokens` tokens needs.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page)
    }
    /// Whether a sequence of `tokens` tokens fits in the empty cache.
    pub fn fits_ever(&self, tokens: usize) -> bool {
        self.pages_for(tokens) <= self.total
    }
    /// Reserves room for `tokens` tokens; the pages reserved, or `None` when they are not free now.
    pub fn try_reserve(&mut self, tokens: usize) -> Option<usize> {
        let p = self.pages_for(tokens);
        (self.reserved + p <= self.total).then(|| {
            self.reserved += p;
            p
        })
    }
    /// Returns a finished sequence's reservation.
    pub fn release(&mut self, pages: usize) {
        self.reserved = self.reserved.saturating_sub(pages);
    }
    /// Capacity in tokens.
    pub fn tokens(&self) -> usize {
        self.total * self.page
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;

    use k3_model::cuda::{CudaModel, CudaSeqState, DecodeGraph, Input};

    use super::CacheBudget;
    use crate::error::Result;

    /// One sequence's place in the GPU pools and its cache reservation.
    pub struct GpuSeq {
        state: CudaSeqState,
        pages: usize,
    }

    pub struct GpuRunner {
        pub model: CudaModel,
        /// Replay decode steps from CUDA graphs (one captured per batch size on first use).
        pub use_graphs: bool,
        graphs: HashMap<usize, DecodeGraph>,
        budget: CacheBudget,
    }

    impl GpuRunner {
        pub fn new(model: CudaModel, use_graphs: bool) -> Self {
            let budget = CacheBudget::new(model.cache.max_tokens, k3_core::cuda::mla::PAGE);
            GpuRunner { model, use_graphs, graphs: HashMap::new(), budget }
        }

        /// Whether a sequence of `tokens` tokens (prompt + generation) can ever be served.
        pub fn fits(&self, tokens: usize) -> std::result::Result<(), usize> {
            if self.budget.fits_ever(tokens) { Ok(()) } else { Err(self.budget.tokens()) }
        }

        /// A new sequence with room for `tokens` tokens, or `None` while the cache is promised to
        /// running sequences.
        pub fn new_seq(&mut self, tokens: usize) -> Result<Option<GpuSeq>> {
            let Some(pages) = self.budget.try_reserve(tokens) else { return Ok(None) };
            match self.model.new_sequence() {
                Ok(state) => Ok(Some(GpuSeq { state, pages })),
                Err(e) => {
                    self.budget.release(pages);
                    Err(e.into())
                }
            }
        }

        pub fn release(&mut self, s: GpuSeq) {
            self.budget.release(s.pages);
            self.model.release(s.state);
        }

        /// One packed step; `emb` replaces the token embeddings when given. Returns each
        /// sequence's last-row logits `[B, vocab]`.
        pub fn forward(&mut self, tokens: &[u32], emb: Option<&[f32]>, lens: &[usize], seqs: &mut [&mut GpuSeq]) -> Result<Vec<f32>> {
            let mut seqs: Vec<&mut CudaSeqState> = seqs.iter_mut().map(|s| &mut s.state).collect();
            let seqs = seqs.as_mut_slice();
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
        pub fn fits(&self, _: usize) -> std::result::Result<(), usize> {
            match *self {}
        }
        pub fn new_seq(&mut self, _: usize) -> Result<Option<GpuSeq>> {
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

#[cfg(test)]
mod tests {
    use super::CacheBudget;

    #[test]
    fn cache_budget_reserves_whole_pages_and_releases() {
        let mut b = CacheBudget::new(640, 64); // 10 pages
        assert_eq!(b.pages_for(1), 1);
        assert_eq!(b.pages_for(64), 1);
        assert_eq!(b.pages_for(65), 2);
        assert!(b.fits_ever(640) && !b.fits_ever(641));
        assert_eq!(b.try_reserve(300), Some(5));
        assert_eq!(b.try_reserve(300), Some(5));
        assert_eq!(b.try_reserve(1), None, "the cache is fully promised");
        b.release(5);
        assert_eq!(b.try_reserve(320), Some(5));
        assert_eq!(b.tokens(), 640);
    }
}
