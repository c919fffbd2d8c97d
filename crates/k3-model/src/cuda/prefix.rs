//! Copies of a GPU sequence's state for the engine's prefix cache (issue 21; the engine's
//! `prefix` module decides what is stored and when; text-backbone §3.8 KDA state, §4/§5 MLA
//! latent and DSA indexer-key caches).
//!
//! Bytes leave and enter the device exactly as the pools store them — BF16 latent rows and F32
//! indexer keys, or the FP8 rows of `--kv-cache-dtype fp8`; BF16 conv tails and F32 recurrent
//! state — so a restored sequence is equal, byte for byte, to the one whose prefill wrote them.
//! Each read or write is one device↔host transfer through a staging buffer, the gather/scatter
//! between the staging buffer and the pages being device-to-device copies on the compute stream.
//!
//! Shapes: a layer's rows of a token span `[n, w]` bytes (`w` the pool's bytes per token); a KDA
//! layer's slot `[3, 3, D]` conv tails and `[nh, hd, hd]` state, as bytes.

use k3_core::cuda::mla::PAGE;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::{CudaModel, CudaSeqState, Mixer};
use crate::error::{ModelError, Result};

/// One layer's stored bytes, a pair: an MLA/DSA layer's (latent, indexer-key) rows of a token
/// span (keys empty without DSA), or a KDA layer's (conv tails, recurrent state).
pub type LayerBytes = (Vec<u8>, Vec<u8>);

/// [`LayerBytes`] borrowed.
pub type LayerRef<'a> = (&'a [u8], &'a [u8]);

/// A byte range of a device tensor.
type Range<'a> = (&'a CudaTensor, usize, usize);

/// Bytes per token of a paged pool `[P, PAGE, w]`.
fn row_bytes(pool: &CudaTensor) -> usize {
    pool.byte_len() / (pool.shape()[0] * PAGE).max(1)
}

/// The ranges of tokens `[from, to)` of `seq` in a paged pool, one per run inside a page.
fn token_ranges<'a>(pool: &'a CudaTensor, seq: &CudaSeqState, from: usize, to: usize, out: &mut Vec<Range<'a>>) {
    let w = row_bytes(pool);
    let mut t = from;
    while t < to {
        let n = (PAGE - t % PAGE).min(to - t);
        let page = seq.pages[t / PAGE] as usize;
        out.push((pool, (page * PAGE + t % PAGE) * w, n * w));
        t += n;
    }
}

/// One slot's bytes of a slot pool `[S, ...]`.
fn slot_range(pool: &CudaTensor, slot: usize) -> Range<'_> {
    let per = pool.byte_len() / pool.shape()[0];
    (pool, slot * per, per)
}

/// The bytes of `ranges`, concatenated, in one device-to-host transfer.
fn gather(dev: &CudaDevice, ranges: &[Range<'_>]) -> Result<Vec<u8>> {
    let total: usize = ranges.iter().map(|r| r.2).sum();
    if total == 0 {
        return Ok(Vec::new());
    }
    let stage = CudaTensor::uninit(dev, DType::U8, vec![total])?;
    let mut o = 0;
    for &(t, off, len) in ranges {
        stage.copy_range(o, t, off, len)?;
        o += len;
    }
    Ok(stage.to_bytes()?)
}

/// Writes `bytes` (the concatenation of `ranges`' new contents) in one host-to-device transfer.
fn scatter(dev: &CudaDevice, bytes: &[u8], ranges: &[Range<'_>]) -> Result<()> {
    if bytes.len() != ranges.iter().map(|r| r.2).sum::<usize>() {
        return Err(ModelError::Input(format!("prefix restore: {} bytes for {} bytes of state", bytes.len(), ranges.iter().map(|r| r.2).sum::<usize>())));
    }
    if bytes.is_empty() {
        return Ok(());
    }
    let stage = CudaTensor::from_pod(dev, DType::U8, vec![bytes.len()], bytes)?;
    let mut o = 0;
    for &(t, off, len) in ranges {
        t.copy_range(off, &stage, o, len)?;
        o += len;
    }
    Ok(())
}

/// Splits `bytes` into pieces of `lens`.
fn split(mut bytes: Vec<u8>, lens: &[usize]) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(lens.len());
    for &n in lens.iter().rev() {
        out.push(bytes.split_off(bytes.len() - n));
    }
    out.reverse();
    out
}

impl CudaModel {
    /// Whether this model can hand its sequence states to a prefix cache: one rank holding
    /// every layer (a parallel layout's states are spread over ranks).
    pub fn prefix_layout(&self) -> std::result::Result<String, String> {
        match self.plan.par.world() {
            1 => Ok(format!("cuda, one rank, {} weights, {:?} caches", self.dtype, self.cache.kv_cache_dtype)),
            n => Err(format!("the prefix cache does not yet capture the states of a parallel layout ({n} GPU ranks)")),
        }
    }

    /// Every layer's state of `seq` for the prefix cache: rows `[from, to)` of each MLA/DSA
    /// layer's caches, and with `kda` each KDA layer's slot (`None` for a KDA layer without it).
    /// `seq` must hold at least `to` tokens. Waits for the step that wrote them.
    pub fn read_prefix(&self, seq: &CudaSeqState, from: usize, to: usize, kda: bool) -> Result<Vec<Option<LayerBytes>>> {
        if from > to || to > seq.pos || to > seq.pages.len() * PAGE {
            return Err(ModelError::Input(format!("prefix capture of tokens [{from}, {to}) from a sequence of {} tokens", seq.pos)));
        }
        let mut ranges = Vec::new();
        let mut lens = Vec::new();
        for l in &self.layers {
            let before = ranges.len();
            match &l.mixer {
                Mixer::Mla(m) => {
                    token_ranges(&m.cache, seq, from, to, &mut ranges);
                    lens.push(ranges[before..].iter().map(|r| r.2).sum());
                    let mid = ranges.len();
                    if let Some(ix) = &m.indexer {
                        token_ranges(&ix.key_cache, seq, from, to, &mut ranges);
                    }
                    lens.push(ranges[mid..].iter().map(|r| r.2).sum());
                }
                Mixer::Kda(k) if kda => {
                    ranges.push(slot_range(&k.conv_pool, seq.slot));
                    ranges.push(slot_range(&k.state_pool, seq.slot));
                    lens.extend([ranges[before].2, ranges[before + 1].2]);
                }
                Mixer::Kda(_) => {}
            }
        }
        let mut parts = split(gather(&self.dev, &ranges)?, &lens).into_iter();
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let stored = kda || matches!(l.mixer, Mixer::Mla(_));
            out.push(stored.then(|| (parts.next().unwrap_or_default(), parts.next().unwrap_or_default())));
        }
        Ok(out)
    }

    /// Gives the new sequence `seq` (no token consumed yet) the state at token `at`: `cells`,
    /// each the MLA/DSA rows of consecutive equal token spans covering `[0, at)` (one entry per
    /// layer, `None` for a KDA layer), and `kda`, every KDA layer's slot at `at` (`None` for an
    /// MLA layer), all as [`CudaModel::read_prefix`] returned them.
    pub fn write_prefix(&mut self, seq: &mut CudaSeqState, at: usize, cells: &[Vec<Option<LayerRef<'_>>>], kda: &[Option<LayerRef<'_>>]) -> Result<()> {
        let bad = |why: String| ModelError::Input(format!("prefix restore: {why}"));
        if seq.pos != 0 || !seq.pages.is_empty() {
            return Err(bad(format!("the sequence already holds {} tokens", seq.pos)));
        }
        let n = self.layers.len();
        if kda.len() != n || cells.iter().any(|c| c.len() != n) || (at > 0 && (cells.is_empty() || !at.is_multiple_of(cells.len()))) {
            return Err(bad(format!("{} cells for {at} tokens, made for another model", cells.len())));
        }
        self.free.cover(seq, at)?;
        let grid = if cells.is_empty() { 0 } else { at / cells.len() };
        let mut ranges = Vec::new();
        let mut bytes = Vec::new();
        for (li, l) in self.layers.iter().enumerate() {
            match (&l.mixer, &kda[li]) {
                (Mixer::Mla(m), None) => {
                    let keys = m.indexer.as_ref().map(|ix| &ix.key_cache);
                    for (c, cell) in cells.iter().enumerate() {
                        let Some((latent, index_keys)) = cell[li] else {
                            return Err(bad(format!("layer {li} is MLA but a stored cell is not")));
                        };
                        let (a, b) = (c * grid, (c + 1) * grid);
                        let want_keys = keys.map_or(0, |k| grid * row_bytes(k));
                        if latent.len() != grid * row_bytes(&m.cache) || index_keys.len() != want_keys {
                            return Err(bad(format!("layer {li}: a cell of {} + {} bytes for {grid} tokens", latent.len(), index_keys.len())));
                        }
                        token_ranges(&m.cache, seq, a, b, &mut ranges);
                        bytes.extend_from_slice(latent);
                        if let Some(k) = keys {
                            token_ranges(k, seq, a, b, &mut ranges);
                            bytes.extend_from_slice(index_keys);
                        }
                    }
                }
                (Mixer::Kda(k), Some((conv, state))) => {
                    let (c, s) = (slot_range(&k.conv_pool, seq.slot), slot_range(&k.state_pool, seq.slot));
                    if conv.len() != c.2 || state.len() != s.2 {
                        return Err(bad(format!("layer {li}: a KDA snapshot of {} + {} bytes for {} + {}", conv.len(), state.len(), c.2, s.2)));
                    }
                    ranges.extend([c, s]);
                    bytes.extend_from_slice(conv);
                    bytes.extend_from_slice(state);
                }
                _ => return Err(bad(format!("layer {li} does not match the stored snapshot"))),
            }
        }
        scatter(&self.dev, &bytes, &ranges)?;
        seq.pos = at;
        Ok(())
    }
}
