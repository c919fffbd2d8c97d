//! Benchmark support for the GPU model: [`CudaModel::fill_context`] gives a sequence a long
//! context without prefilling it, so the cost of a decode step at 16K–512K tokens can be
//! measured in seconds. The values are random (one random page per layer, repeated), which is
//! all a timing needs: attention, the DSA indexer and top-k do the same work whatever the
//! values. Logits after a filled context are meaningless.

use half::bf16;
use k3_core::cuda::mla::PAGE;
use rand::{Rng, SeedableRng};

use super::{CudaModel, CudaSeqState, Mixer};
use crate::error::Result;

impl CudaModel {
    /// Makes `seq` (a fresh sequence) hold `n` tokens of random cached latents and indexer keys in
    /// every MLA/DSA layer; KDA states stay zero. For benchmarks only.
    pub fn fill_context(&mut self, seq: &mut CudaSeqState, n: usize, seed: u64) -> Result<()> {
        self.free.cover(seq, n)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for l in &self.layers {
            let Mixer::Mla(m) = &l.mixer else { continue };
            let w = m.cache.shape()[2];
            let page: Vec<bf16> = (0..PAGE * w).map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
            let bytes: &[u8] = bytemuck::cast_slice(&page);
            for &p in &seq.pages {
                m.cache.write_at(p as usize * bytes.len(), bytes)?;
            }
            if let Some(ix) = &m.indexer {
                let id = ix.key_cache.shape()[2];
                let keys: Vec<f32> = (0..PAGE * id).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let kb: &[u8] = bytemuck::cast_slice(&keys);
                for &p in &seq.pages {
                    ix.key_cache.write_at(p as usize * kb.len(), kb)?;
                }
            }
        }
        seq.pos = n;
        self.dev.synchronize()?;
        Ok(())
    }
}
