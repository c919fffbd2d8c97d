//! A GPU sequence's state for the engine's prefix cache (issue 21; the engine's `prefix`
//! module decides what is stored and when; text-backbone §3.8 KDA state, §4/§5 MLA latent and
//! DSA indexer-key caches).
//!
//! The MLA latent and DSA indexer-key rows stay where they are: a stored cell holds the pages
//! of the sequence that wrote it by reference (`device_pages`: [`PageTable::span`]), and a
//! restore maps the stored pages into the new sequence's block table ([`PageTable::join`]), so
//! nothing is copied; the page a resume point cuts is copied on the sequence's first write
//! (`CudaModel::grow`). A KDA layer's state is rewritten every token, so it is copied: its slot's
//! bytes leave and enter the device exactly as the pools store them (BF16 conv tails, F32
//! recurrent state) in one device↔host transfer through a staging buffer, the gather/scatter
//! between the staging buffer and the slots being device-to-device copies on the compute
//! stream. [`CudaModel::read_prefix`] also reads rows (for the tests: what a page holds).
//!
//! Shapes: a layer's rows of a token span `[n, w]` bytes (`w` the pool's bytes per token); a KDA
//! layer's slot `[3, 3, D]` conv tails and `[nh, hd, hd]` state, as bytes.

use k3_core::cuda::mla::PAGE;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::{CudaModel, CudaSeqState, Mixer};
use crate::device_pages::{PageSpan, PageTable};
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
        let page = seq.pages.pages()[t / PAGE].id() as usize;
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
    /// What a prefix cache of this model's states is made for (a digest input: cells of another
    /// layout, precision or cache format never match). One rank holds every layer; on a parallel
    /// layout each rank's process keeps its own parts (the engine's `dist::kept`).
    pub fn prefix_layout(&self) -> std::result::Result<String, String> {
        let p = self.plan.par;
        Ok(match p.world() {
            1 => format!("cuda, one rank, {} weights, {:?} caches", self.dtype, self.cache.kv_cache_dtype),
            _ => format!("cuda, tp {} ep {} pp {}, {} weights, {:?} caches", p.tp, p.ep, p.pp, self.dtype, self.cache.kv_cache_dtype),
        })
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

    /// Gives the new sequence `seq` (no token consumed yet) the state at token `at`: `spans`,
    /// stored cells covering `[0, at)` in order, mapped into its block table by reference, and
    /// `kda`, every KDA layer's slot at `at` (`None` for an MLA layer) as
    /// [`CudaModel::read_prefix`] returned it, written into its slot.
    pub fn map_prefix(&mut self, seq: &mut CudaSeqState, at: usize, spans: &[&PageSpan], kda: &[Option<LayerRef<'_>>]) -> Result<()> {
        let bad = |why: String| ModelError::Input(format!("prefix restore: {why}"));
        if seq.pos != 0 || !seq.pages.is_empty() {
            return Err(bad(format!("the sequence already holds {} tokens", seq.pos)));
        }
        if kda.len() != self.layers.len() {
            return Err(bad(format!("a snapshot of {} layers for a model of {}", kda.len(), self.layers.len())));
        }
        let pages = PageTable::join(spans, PAGE, at)?;
        if !pages.pages().iter().all(|p| self.free.pages.holds(p)) {
            return Err(bad("a stored page is of another model's cache (another runner's prefix cache)".into()));
        }
        let mut ranges = Vec::new();
        let mut bytes = Vec::new();
        for (li, l) in self.layers.iter().enumerate() {
            match (&l.mixer, &kda[li]) {
                (Mixer::Mla(_), None) => {}
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
        seq.pages = pages;
        seq.pos = at;
        Ok(())
    }
}
