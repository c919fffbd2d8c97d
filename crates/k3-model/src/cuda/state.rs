//! GPU-side per-sequence state (feature `cuda`): the pools every sequence's state lives in, and
//! the per-step index tables the kernels read.
//!
//! - KDA layers: one **slot** per live sequence in each KDA layer's pools — conv tails BF16
//!   `[S, 3, 3, D]` and recurrent state F32 `[S, H, hd, hd]` (text-backbone §3.8); the slot is the
//!   same in every layer.
//! - MLA / DSA layers: a **paged** latent cache BF16 `[P, PAGE, r + dr]` per layer (normed latent
//!   then raw `k_pe`, §4) and for DSA the indexer-key cache F32 `[P, PAGE, id]` (§5); with
//!   `--kv-cache-dtype fp8` both are U8 rows in the FP8 layouts of k3-core `fp8`. A sequence
//!   holds a block table of page ids (the same ids in every layer), reference-counted with the
//!   prefix cache's cells ([`crate::device_pages`]): it grows by whole pages, shares the pages
//!   of a restored prefix, and copies a page only where it writes rows someone else reads.
//! - [`Step`]: what one packed forward needs on the device — token ids, each row's sequence and
//!   absolute position, the block table `[B, max_pages]`, the KDA slots, the rows whose logits
//!   are wanted (and, in a verify graph, the KDA prefill's sequence tables).

use k3_core::cuda::mla::PAGE;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use crate::capacity::KvDtype;
use crate::device_pages::{PageCopy, PagePool, PageRef, PageTable};
use crate::error::{ModelError, Result};

/// How much state the pools hold.
#[derive(Clone, Copy, Debug)]
pub struct CacheConfig {
    /// Live sequences at once (KDA slots).
    pub max_seqs: usize,
    /// Cached tokens across all sequences (MLA pages × PAGE).
    pub max_tokens: usize,
    /// Latent and indexer-key cache format: BF16 (indexer keys F32), or FP8 (`fp8_ds_mla`
    /// latents and FP8 keys, k3-core `fp8`).
    pub kv_cache_dtype: KvDtype,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig { max_seqs: 8, max_tokens: 1 << 16, kv_cache_dtype: KvDtype::Bf16 }
    }
}

/// One live sequence's place in the pools. Created by `CudaModel::new_sequence`, returned with
/// `CudaModel::release`.
#[derive(Debug)]
pub struct CudaSeqState {
    /// KDA slot (same in every KDA layer).
    pub slot: usize,
    /// Latent-cache pages, in order (same ids in every MLA/DSA layer), some perhaps shared.
    pub pages: PageTable,
    /// Tokens consumed so far.
    pub pos: usize,
}

/// The free KDA slots and the page pool. The pools hold one extra slot and one extra page,
/// never handed out: the scratch a warm-up or capture pass of a CUDA graph writes to.
#[derive(Debug)]
pub(crate) struct Free {
    pub slots: Vec<usize>,
    pub pages: PagePool,
    /// The scratch page, held here for good.
    scratch: PageRef,
    pub max_seqs: usize,
    pub max_pages: usize,
}

impl Free {
    pub fn new(c: &CacheConfig) -> Self {
        let max_pages = c.max_tokens.div_ceil(PAGE).max(1);
        let pages = PagePool::new(max_pages + 1, PAGE);
        let scratch = pages.take().expect("a new pool has free pages");
        Free { slots: (0..c.max_seqs).rev().collect(), pages, scratch, max_seqs: c.max_seqs, max_pages }
    }

    /// Slots in each KDA pool (the last one is scratch).
    pub fn pool_slots(&self) -> usize {
        self.max_seqs + 1
    }
    /// Pages in each latent pool (one is scratch).
    pub fn pool_pages(&self) -> usize {
        self.max_pages + 1
    }
    /// Pages held by sequences or prefix-cache cells (each counted once; not the scratch page).
    pub fn pages_in_use(&self) -> usize {
        self.pages.live() - 1
    }
    /// A sequence living only in the scratch slot and page (for graph warm-up and capture).
    pub fn scratch(&self) -> CudaSeqState {
        CudaSeqState { slot: self.max_seqs, pages: PageTable::single(self.scratch.clone()), pos: 0 }
    }

    pub fn take_slot(&mut self) -> Result<usize> {
        self.slots.pop().ok_or_else(|| {
            ModelError::Capacity(format!("all {} sequence slots are in use: finish a sequence or raise CacheConfig.max_seqs (--max-seqs)", self.max_seqs))
        })
    }

    /// Makes tokens `[from, to)` of `seq` writable: grows its pages to cover them and gives it a
    /// copy of each page it would write that others read (`device_pages`). Returns the device
    /// copies to make first.
    pub fn write(&mut self, seq: &mut CudaSeqState, from: usize, to: usize) -> Result<Vec<PageCopy>> {
        seq.pages.write(&self.pages, from, to)
    }

    /// Returns the slot; the pages go back as their last holder lets go.
    pub fn release(&mut self, seq: CudaSeqState) {
        self.slots.push(seq.slot);
    }
}

/// Device tables of one packed step over `B` sequences and `N` rows.
pub(crate) struct Step {
    pub n: usize,
    pub lens: Vec<usize>,
    /// I32 `[N]` token ids (absent when the step starts from embeddings).
    pub tokens: Option<CudaTensor>,
    /// I32 `[N]`.
    pub row_seq: CudaTensor,
    /// I32 `[N]`.
    pub row_pos: CudaTensor,
    /// I32 `[B, max_pages]`.
    pub block_table: CudaTensor,
    /// KDA slots: host and I32 `[B]`.
    pub slots_host: Vec<u32>,
    pub slots: CudaTensor,
    /// Every sequence has exactly one row (decode kernels, graph capture).
    pub decode: bool,
    /// Upper bound of `row_pos + 1` over the rows (the width of DSA score rows).
    pub max_len: usize,
    /// I32 `[B]`: each sequence's last row (for last-position logits).
    pub last_rows: CudaTensor,
    /// Every sequence starts at position 0 (a fresh prefill: no cached context).
    pub fresh: bool,
    /// A verify step: each KDA layer pushes its raw inputs here (`verify.rs`).
    pub keep: Option<std::sync::Mutex<Vec<super::verify::KdaKept>>>,
    /// A verify graph's step: the KDA prefill's sequence tables on the device (k3-core
    /// `kda_tables`), rewritten before each replay (`graph.rs`); `None`: uploaded per layer.
    pub kda_tables: Option<CudaTensor>,
}

fn i32s(dev: &CudaDevice, v: &[i32], shape: Vec<usize>) -> Result<CudaTensor> {
    Ok(CudaTensor::from_pod(dev, DType::I32, shape, v)?)
}

/// Host-side contents of a [`Step`]'s tables.
pub(crate) struct StepHost {
    pub row_seq: Vec<i32>,
    pub row_pos: Vec<i32>,
    pub block_table: Vec<i32>,
    pub width: usize,
    pub slots: Vec<i32>,
    pub last_rows: Vec<i32>,
    pub max_len: usize,
    pub fresh: bool,
}

impl StepHost {
    /// Tables for sequences `seqs` consuming `lens` new rows each; the block table is `width`
    /// pages wide (at least every sequence's page count).
    pub fn build(seqs: &[&CudaSeqState], lens: &[usize], width: usize) -> StepHost {
        let mut h = StepHost {
            row_seq: vec![],
            row_pos: vec![],
            block_table: vec![0; seqs.len() * width],
            width,
            slots: vec![],
            last_rows: vec![],
            max_len: 0,
            fresh: seqs.iter().all(|s| s.pos == 0),
        };
        let mut r = 0;
        for (b, (s, &n)) in seqs.iter().zip(lens).enumerate() {
            for j in 0..n {
                h.row_seq.push(b as i32);
                h.row_pos.push((s.pos + j) as i32);
            }
            r += n;
            h.last_rows.push(r as i32 - 1);
            h.max_len = h.max_len.max(s.pos + n);
            for (k, p) in s.pages.ids().enumerate().take(width) {
                h.block_table[b * width + k] = p as i32;
            }
            h.slots.push(s.slot as i32);
        }
        h
    }

    pub fn upload(&self, dev: &CudaDevice, lens: &[usize], tokens: Option<&[u32]>) -> Result<Step> {
        let n = self.row_seq.len();
        let b = lens.len();
        Ok(Step {
            n,
            lens: lens.to_vec(),
            tokens: tokens.map(|t| i32s(dev, &t.iter().map(|&x| x as i32).collect::<Vec<_>>(), vec![n])).transpose()?,
            row_seq: i32s(dev, &self.row_seq, vec![n])?,
            row_pos: i32s(dev, &self.row_pos, vec![n])?,
            block_table: i32s(dev, &self.block_table, vec![b, self.width])?,
            slots_host: self.slots.iter().map(|&s| s as u32).collect(),
            slots: i32s(dev, &self.slots, vec![b])?,
            decode: lens.iter().all(|&l| l == 1),
            max_len: self.max_len,
            last_rows: i32s(dev, &self.last_rows, vec![b])?,
            fresh: self.fresh,
            keep: None,
            kda_tables: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(f: &mut Free) -> CudaSeqState {
        CudaSeqState { slot: f.take_slot().unwrap(), pages: PageTable::default(), pos: 0 }
    }

    #[test]
    fn pages_are_taken_by_whole_pages_and_returned() {
        let mut f = Free::new(&CacheConfig { max_seqs: 2, max_tokens: 3 * PAGE, ..Default::default() });
        assert_eq!((f.pool_slots(), f.pool_pages(), f.pages_in_use()), (3, 4, 0), "one scratch slot and page beyond the configured ones");
        let mut a = seq(&mut f);
        f.write(&mut a, 0, 1).unwrap();
        f.write(&mut a, 1, PAGE).unwrap();
        assert_eq!(a.pages.len(), 1);
        f.write(&mut a, PAGE, PAGE + 1).unwrap();
        assert_eq!((a.pages.len(), f.pages_in_use()), (2, 2));
        let mut b = seq(&mut f);
        assert_ne!(a.slot, b.slot);
        f.write(&mut b, 0, PAGE).unwrap();
        let err = f.write(&mut b, PAGE, PAGE + 1).unwrap_err().to_string();
        assert!(err.contains("cache is full") && err.contains("max_tokens"), "{err}");
        assert!(f.take_slot().unwrap_err().to_string().contains("max_seqs"));
        let scratch = f.scratch();
        let s = scratch.pages.ids().next().unwrap();
        assert_eq!(scratch.slot, 2, "scratch is the extra slot");
        assert!(!a.pages.ids().any(|p| p == s) && !b.pages.ids().any(|p| p == s), "no sequence gets the scratch page");
        f.release(a);
        assert_eq!(f.pages_in_use(), 1, "a's pages went back with it");
        let mut c = seq(&mut f);
        f.write(&mut c, 0, 2 * PAGE).unwrap();
        assert_eq!(c.pages.len(), 2);
    }

    #[test]
    fn step_tables_place_every_row() {
        let pool = PagePool::new(8, PAGE);
        let (mut pa, mut pb) = (PageTable::default(), PageTable::default());
        pa.write(&pool, 0, PAGE + 1).unwrap();
        pb.write(&pool, 0, 3).unwrap();
        let a = CudaSeqState { slot: 4, pages: pa, pos: 63 };
        let b = CudaSeqState { slot: 1, pages: pb, pos: 0 };
        let h = StepHost::build(&[&a, &b], &[2, 3], 3);
        assert_eq!(h.row_seq, vec![0, 0, 1, 1, 1]);
        assert_eq!(h.row_pos, vec![63, 64, 0, 1, 2]);
        assert_eq!(h.block_table, vec![0, 1, 0, 2, 0, 0]);
        assert_eq!(h.slots, vec![4, 1]);
        assert_eq!(h.last_rows, vec![1, 4]);
        assert_eq!(h.max_len, 65);
    }
}
