//! Benchmark support for the GPU model: [`CudaModel::fill_context`] gives a sequence a long
//! context without prefilling it, so the cost of a decode step at 16K–512K tokens can be
//! measured in seconds. The values are random (one random page per layer, repeated), which is
//! all a timing needs: attention, the DSA indexer and top-k do the same work whatever the
//! values. Logits after a filled context are meaningless.

use half::bf16;
use k3_core::cuda::mla::PAGE;
use k3_core::fp8::{KeyFp8, LatentFp8};
use k3_core::DType;
use rand::{Rng, SeedableRng};

use super::{CudaModel, CudaSeqState, Mixer};
use crate::error::Result;

impl CudaModel {
    /// Makes `seq` (a fresh sequence) hold `n` tokens of random cached latents and indexer keys in
    /// every MLA/DSA layer; KDA states stay zero. For benchmarks only.
    pub fn fill_context(&mut self, seq: &mut CudaSeqState, n: usize, seed: u64) -> Result<()> {
        let copies = self.free.write(seq, seq.pos, n)?;
        self.copy_pages(&copies)?;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for l in &self.layers {
            let Mixer::Mla(m) = &l.mixer else { continue };
            let w = m.r + m.dr;
            let vals: Vec<f32> = (0..PAGE * w).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let bytes: Vec<u8> = match m.cache.dtype() {
                DType::U8 => {
                    let lay = LatentFp8 { r: m.r, dr: m.dr };
                    let mut b = vec![0u8; PAGE * lay.row_bytes()];
                    for (row, out) in vals.chunks(w).zip(b.chunks_mut(lay.row_bytes())) {
                        lay.encode(row, out);
                    }
                    b
                }
                _ => bytemuck::cast_slice(&vals.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).to_vec(),
            };
            for p in seq.pages.ids() {
                m.cache.write_at(p as usize * bytes.len(), &bytes)?;
            }
            if let Some(ix) = &m.indexer {
                let id = ix.head_dim;
                let keys: Vec<f32> = (0..PAGE * id).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let kb: Vec<u8> = match ix.key_cache.dtype() {
                    DType::U8 => {
                        let lay = KeyFp8 { id };
                        let mut b = vec![0u8; PAGE * lay.row_bytes()];
                        for (key, out) in keys.chunks(id).zip(b.chunks_mut(lay.row_bytes())) {
                            lay.encode(key, out);
                        }
                        b
                    }
                    _ => bytemuck::cast_slice(&keys).to_vec(),
                };
                for p in seq.pages.ids() {
                    ix.key_cache.write_at(p as usize * kb.len(), &kb)?;
                }
            }
        }
        seq.pos = n;
        self.dev.synchronize()?;
        Ok(())
    }
}
