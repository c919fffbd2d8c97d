//! What the prefix cache stores of a sequence, and how a CPU [`SeqState`] is cut into it and
//! rebuilt from it (text-backbone §3.8 KDA state, §4/§5 MLA latent and DSA indexer-key caches).
//!
//! A sequence's state at token `g` is, per layer: for a KDA layer the recurrent state
//! `[nh, hd, hd]` and the conv tails `[3][K−1, D]` (both *at* `g`, so they are snapshotted whole:
//! [`KdaSnap`]); for an MLA/DSA layer the append-only latent rows `[g, r + dr]` and indexer keys
//! `[g, id]`, so rows `[from, to)` of one grid cell are enough once the cells before it are
//! stored ([`Segment`]). Restoring at `g` appends the segments of cells `0..g/grid` and copies
//! in the KDA snapshot taken at `g`: the restored state is equal, value for value, to the one
//! the prefill that wrote them had at `g` (the cache never recomputes).
//!
//! **Shared pages.** On the CPU a sequence's latent and indexer-key caches are reference-counted
//! pages (`k3_model::layers::pages`), and the runner sizes them to the grid
//! (`Runner::set_page_rows`). A cell's rows are then one whole page of the sequence, and the
//! pool takes that page by reference (a [`StoredPage`]) instead of a copy; a restore hands the
//! new sequence the pool's pages by reference too. So the prefill that wrote a prefix, the
//! pool and every live sequence resumed from it hold one copy of its rows; each sequence
//! appends to pages of its own, and a write into a page held elsewhere copies it first. A cell
//! that is not one whole page (pages of another size) is copied, as before.
//!
//! An MTP draft state (`--speculative mtp`, `k3_model::draft`) rides along on the CPU: its cache
//! row `j` is made from `(h_j, t_{j+1})`, so a cell `[a, b)` stores the draft rows
//! `[a − 1, b − 1)` (`[0, b − 1)` for the first cell) — every one of them determined by the
//! tokens up to `b` — and a snapshot at `g` stores the hidden row `h_{g−1}` that waits for token
//! `g`. A restore from cells or a snapshot without them (none are written without MTP) leaves
//! the sequence without a draft state: it then decodes without drafts. A separate draft model's
//! state (`--speculative draft`, `dist::draft`) is a [`SeqState`] of its own at the same token
//! count: it is cut into the same cells and snapshot ([`Segment::draft`], [`KdaSnap::draft`]) by
//! the same functions, and restored likewise, or not at all when an entry lacks it.
//!
//! The CPU runner stores its f32 rows and [`KdaState`]s ([`SegLayer::Mla`], [`SnapLayer::Cpu`]).
//! The GPU runner shares its device pages the same way: a cell holds the pages of the sequence
//! that wrote it by reference ([`Segment::pages`], a `k3_model::device_pages` span; the same
//! page ids in every MLA/DSA layer), a restore maps them into the new sequence's block table,
//! and a write into a page someone else reads copies it first (on the device); its KDA snapshot
//! is the bytes of its slots, copied to host memory ([`SnapLayer::Raw`]). The digest keeps the
//! two runners apart.

use k3_model::device_pages::{PageSpan, PageTable};
use k3_model::layers::kda::{KdaState, StateBuf};
use k3_model::layers::pages::{PagedRows, StoredPage};
use k3_model::model::LayerState;
use k3_model::SeqState;

pub use crate::dist::kept::Remote;
use crate::error::{EngineError, Result};

/// One layer's rows of a token span `[from, to)`.
#[derive(Clone, Debug)]
pub enum SegLayer {
    /// A KDA layer: nothing per token.
    Kda,
    /// `latent` `[to − from, r + dr]`, `index_keys` `[to − from, id]` (empty without DSA, and
    /// both empty for a layer of another pipeline stage): one page each, shared with the
    /// sequences that hold it (see the module doc).
    Mla { latent: StoredPage, index_keys: StoredPage },
}

/// The MLA/DSA rows of one token span, every layer.
#[derive(Clone, Debug)]
pub struct Segment {
    /// Per layer (the CPU runners; empty for a device runner's cell).
    pub layers: Vec<SegLayer>,
    /// A device runner's cell: the device pages holding every MLA/DSA layer's rows of the span,
    /// by reference (see the module doc). They count in the device cache's pages, not in the
    /// pool's bytes.
    pub pages: Option<PageSpan>,
    /// The MTP draft layer's latent rows of the span, shifted by one (see the module doc).
    pub mtp: Option<Vec<f32>>,
    /// The separate draft model's rows of the span (see the module doc).
    pub draft: Option<Box<Segment>>,
    /// On a multi-process layout: the key under which the other ranks keep their parts of this
    /// cell in their own processes (`dist::kept`); `None` elsewhere.
    pub remote: Option<Remote>,
}

impl Segment {
    pub fn bytes(&self) -> usize {
        let rows: usize = self
            .layers
            .iter()
            .map(|l| match l {
                SegLayer::Kda => 0,
                SegLayer::Mla { latent, index_keys } => 4 * (latent.values().len() + index_keys.values().len()),
            })
            .sum();
        rows + self.mtp.as_ref().map_or(0, |m| 4 * m.len()) + self.draft.as_ref().map_or(0, |d| d.bytes())
    }
}

/// One layer of a [`KdaSnap`].
#[derive(Clone, Debug)]
pub enum SnapLayer {
    /// An MLA/DSA layer: its rows are in the segments.
    Mla,
    /// A KDA layer of the CPU runner: state and conv tails.
    Cpu(KdaState),
    /// A KDA layer of a CPU parallel layout whose ranks split its heads (`--tp` > 1): each
    /// rank's state and conv tails, in tensor-parallel order (`dist::layout_state`).
    Ranks(Vec<KdaState>),
    /// A KDA layer of a device runner: its slot's conv tails and recurrent state, as stored.
    Raw { conv: Vec<u8>, state: Vec<u8> },
}

/// Every KDA layer's state and conv tails at one token count.
#[derive(Clone, Debug)]
pub struct KdaSnap {
    pub at: usize,
    pub layers: Vec<SnapLayer>,
    /// The target's hidden row `h_{at−1}` for the MTP draft layer (see the module doc).
    pub mtp_hidden: Option<Vec<f32>>,
    /// The separate draft model's KDA states at `at` (see the module doc).
    pub draft: Option<Box<KdaSnap>>,
    /// On a multi-process layout: the key under which the other ranks keep their parts of this
    /// snapshot (`dist::kept`); `None` elsewhere.
    pub remote: Option<Remote>,
}

impl KdaSnap {
    pub fn bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| match l {
                SnapLayer::Mla => 0,
                SnapLayer::Cpu(s) => s.bytes(),
                SnapLayer::Ranks(v) => v.iter().map(KdaState::bytes).sum(),
                SnapLayer::Raw { conv, state } => conv.len() + state.len(),
            })
            .sum();
        layers + self.mtp_hidden.as_ref().map_or(0, |h| 4 * h.len()) + self.draft.as_ref().map_or(0, |d| d.bytes())
    }
}

/// What a runner hands the cache after a step: rows `[from, to)` cut into grid cells, and the
/// KDA snapshot at `to` when asked for.
#[derive(Clone, Debug)]
pub struct Capture {
    pub from: usize,
    pub to: usize,
    /// One segment per grid cell of `[from, to)`, in order.
    pub cells: Vec<Segment>,
    pub kda: Option<KdaSnap>,
}

/// Rows `[a, b)` of `rows` as the pool stores them: the sequence's own page when they are one
/// whole page of it (shared from now on), else a copy; nothing for an empty cache (a layer of
/// another stage, or indexer keys without DSA).
fn cell_page(rows: &PagedRows, a: usize, b: usize) -> StoredPage {
    let pr = rows.page_rows();
    match rows.rows() {
        0 => StoredPage::from_values(Vec::new()),
        _ if b - a == pr && a.is_multiple_of(pr) => StoredPage::new(rows.pages()[a / pr].clone()),
        _ => StoredPage::from_values(rows.copy_rows(a, b)),
    }
}

/// Cuts `st` (which has consumed exactly `st.pos` tokens) into the cells `[from, st.pos)` of
/// `grid` tokens, and snapshots its KDA layers when `kda`.
pub fn capture(st: &SeqState, from: usize, grid: usize, kda: bool) -> Result<Capture> {
    let to = st.pos;
    if grid == 0 || from > to || !from.is_multiple_of(grid) || !to.is_multiple_of(grid) {
        return Err(EngineError::Internal(format!("capture [{from}, {to}) is not on the grid of {grid} tokens")));
    }
    let n = (to - from) / grid;
    let mut cells: Vec<Segment> =
        (0..n).map(|_| Segment { layers: Vec::with_capacity(st.layers.len()), pages: None, mtp: None, draft: None, remote: None }).collect();
    for (l, layer) in st.layers.iter().enumerate() {
        match layer {
            LayerState::Kda(_) => cells.iter_mut().for_each(|c| c.layers.push(SegLayer::Kda)),
            LayerState::Mla(c) => {
                for (rows, what) in [(&c.latent, "latent"), (&c.index_keys, "indexer-key")] {
                    if rows.rows() != 0 && rows.rows() != to {
                        return Err(EngineError::Internal(format!("layer {l}: {} {what} rows for {to} cached tokens", rows.rows())));
                    }
                }
                for (k, cell) in cells.iter_mut().enumerate() {
                    let (a, b) = (from + k * grid, from + (k + 1) * grid);
                    cell.layers.push(SegLayer::Mla { latent: cell_page(&c.latent, a, b), index_keys: cell_page(&c.index_keys, a, b) });
                }
            }
        }
    }
    if let Some(m) = &st.mtp {
        if to > 0 && m.rows + 1 < to {
            return Err(EngineError::Internal(format!("capture at {to}: the MTP draft layer holds {} rows", m.rows)));
        }
        for (k, cell) in cells.iter_mut().enumerate() {
            let (a, b) = ((from + k * grid).saturating_sub(1), from + (k + 1) * grid - 1);
            cell.mtp = Some(m.cache.latent.copy_rows(a, b));
        }
    }
    let kda = kda.then(|| KdaSnap {
        at: to,
        layers: st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => SnapLayer::Cpu(s.clone()),
                LayerState::Mla(_) => SnapLayer::Mla,
            })
            .collect(),
        mtp_hidden: st.mtp.as_ref().and_then(|m| m.hidden_row(to.checked_sub(1)?)).map(<[f32]>::to_vec),
        draft: None,
        remote: None,
    });
    Ok(Capture { from, to, cells, kda })
}

/// Rebuilds the state at `snap.at` into `fresh` (a new, empty state of the same model): the
/// segments of every cell before it, in order, and the KDA snapshot. A KDA state must have
/// `fresh`'s shapes and dtype (on a parallel layout: this rank's heads).
pub fn restore(mut fresh: SeqState, cells: &[&Segment], snap: &KdaSnap) -> Result<SeqState> {
    if fresh.pos != 0 || snap.layers.len() != fresh.layers.len() || cells.iter().any(|c| c.layers.len() != fresh.layers.len()) {
        return Err(EngineError::Internal("prefix restore: the stored state was made for another model".into()));
    }
    for (l, layer) in fresh.layers.iter_mut().enumerate() {
        match (layer, &snap.layers[l]) {
            (LayerState::Kda(s), SnapLayer::Cpu(k)) => {
                let shape = |k: &KdaState| {
                    let s = match &k.s {
                        StateBuf::F32(v) => (v.len(), "f32"),
                        StateBuf::Bf16(v) => (v.len(), "bf16"),
                    };
                    (k.conv.each_ref().map(Vec::len), s)
                };
                if shape(s) != shape(k) {
                    return Err(EngineError::Internal(format!(
                        "prefix restore: layer {l}'s stored KDA state is not shaped as this rank's (its heads or state dtype differ: made for another model or layout)"
                    )));
                }
                *s = k.clone();
            }
            (LayerState::Mla(c), SnapLayer::Mla) => {
                // Each cell's page by reference (`PagedRows::push_page`: copied only where it
                // is not one whole page of this state); an empty one is a layer not held here.
                let grid = snap.at / cells.len().max(1);
                for cell in cells {
                    let SegLayer::Mla { latent, index_keys } = &cell.layers[l] else {
                        return Err(EngineError::Internal(format!("prefix restore: layer {l} is MLA but a stored segment is not")));
                    };
                    for (page, rows) in [(latent, &mut c.latent), (index_keys, &mut c.index_keys)] {
                        let n = page.values().len();
                        if n == 0 {
                            continue;
                        }
                        if grid == 0 || !n.is_multiple_of(grid) || (rows.width() != 0 && n != grid * rows.width()) {
                            return Err(EngineError::Internal(format!("prefix restore: layer {l}: a stored cell of {n} values for {grid} tokens")));
                        }
                        rows.push_page(page.page(), grid);
                    }
                }
                if (c.latent.rows() != 0 && c.latent.rows() != snap.at) || (c.index_keys.rows() != 0 && c.index_keys.rows() != snap.at) {
                    return Err(EngineError::Internal(format!("prefix restore: layer {l}: stored cells of {} rows for {} tokens", c.latent.rows(), snap.at)));
                }
            }
            _ => return Err(EngineError::Internal(format!("prefix restore: layer {l} does not match the stored snapshot"))),
        }
    }
    // The MTP draft state: from the cells and the snapshot when they carry it, else none.
    let stored = snap.mtp_hidden.as_ref().filter(|_| cells.iter().all(|c| c.mtp.is_some()));
    match (fresh.mtp.as_mut(), stored) {
        (Some(m), Some(hid)) if snap.at > 0 => {
            let rows: Vec<f32> = cells.iter().flat_map(|c| c.mtp.iter().flatten().copied()).collect();
            m.rows = snap.at - 1;
            if (m.rows > 0 && (rows.is_empty() || !rows.len().is_multiple_of(m.rows))) || hid.len() != m.width {
                return Err(EngineError::Internal("prefix restore: the stored MTP draft rows do not fit the model".into()));
            }
            m.cache.latent = PagedRows::default();
            m.cache.latent.push_rows(&rows, m.rows);
            m.hidden = hid.clone();
            m.hidden_from = snap.at - 1;
        }
        _ => fresh.mtp = None,
    }
    fresh.pos = snap.at;
    Ok(fresh)
}

/// A KDA layer's slot as a device runner reads and writes it: (conv tails, recurrent state)
/// bytes; see `k3_model::cuda`'s `read_prefix` / `map_prefix`.
pub type RawLayer = (Vec<u8>, Vec<u8>);

/// [`RawLayer`] borrowed.
pub type RawRef<'a> = (&'a [u8], &'a [u8]);

/// A device runner's capture of tokens `[from, to)` of a sequence whose block table is `table`
/// (pages of `rows` tokens): one cell per grid cell, each holding its pages by reference; and
/// with `kda` the snapshot at `to` from `slots` (`slots[l]`: KDA layer `l`'s slot; what an
/// MLA/DSA layer's entry holds is not used; `is_kda[l]` says which).
pub fn capture_device(
    table: &PageTable,
    rows: usize,
    slots: Vec<Option<RawLayer>>,
    is_kda: &[bool],
    from: usize,
    to: usize,
    grid: usize,
    kda: bool,
) -> Result<Capture> {
    if grid == 0 || from > to || !from.is_multiple_of(grid) || !to.is_multiple_of(grid) || (kda && slots.len() != is_kda.len()) {
        return Err(EngineError::Internal(format!("capture [{from}, {to}) is not on the grid of {grid} tokens")));
    }
    let cells = (from..to)
        .step_by(grid)
        .map(|a| Ok(Segment { layers: Vec::new(), pages: Some(table.span(rows, a, a + grid)?), mtp: None, draft: None, remote: None }))
        .collect::<Result<Vec<_>>>()?;
    let kda = match kda {
        true => Some(KdaSnap {
            at: to,
            layers: slots
                .into_iter()
                .zip(is_kda)
                .enumerate()
                .map(|(l, (s, &k))| match (k, s) {
                    (true, Some((conv, state))) => Ok(SnapLayer::Raw { conv, state }),
                    (true, None) => Err(EngineError::Internal(format!("layer {l}: no KDA slot read"))),
                    (false, _) => Ok(SnapLayer::Mla), // its rows are in the cells' pages
                })
                .collect::<Result<_>>()?,
            mtp_hidden: None,
            draft: None,
            remote: None,
        }),
        false => None,
    };
    Ok(Capture { from, to, cells, kda })
}

/// What a device runner restores `snap` from: the cells' page spans before it, in order, and
/// each layer's KDA slot (`None` for MLA layers), borrowed from the pool.
#[allow(clippy::type_complexity)]
pub fn restore_device<'a>(cells: &[&'a Segment], snap: &'a KdaSnap) -> Result<(Vec<&'a PageSpan>, Vec<Option<RawRef<'a>>>)> {
    let bad = || EngineError::Internal("prefix restore: the stored state was made for another model or runner".into());
    let spans = cells.iter().map(|c| c.pages.as_ref().filter(|_| c.layers.is_empty()).ok_or_else(bad)).collect::<Result<Vec<_>>>()?;
    let kda = snap
        .layers
        .iter()
        .map(|l| match l {
            SnapLayer::Mla => Ok(None),
            SnapLayer::Raw { conv, state } => Ok(Some((conv.as_slice(), state.as_slice()))),
            SnapLayer::Cpu(_) | SnapLayer::Ranks(_) => Err(bad()),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((spans, kda))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_model::device_pages::PagePool;

    /// A device capture of 3 cells of 4 tokens (pages of 8): each cell holds the pages of its
    /// tokens by reference (nothing copied, no page taken), the snapshot keeps the KDA slot,
    /// and a restore hands back the same spans and slot, in order.
    #[test]
    fn device_captures_hold_pages_and_restore_in_order() {
        let (grid, from, to, rows) = (4, 8, 20, 8);
        let pool = PagePool::new(4, rows);
        let mut table = PageTable::default();
        table.write(&pool, 0, to).unwrap();
        let slots = vec![Some((vec![1, 2], vec![3, 4, 5])), None];
        let cap = capture_device(&table, rows, slots, &[true, false], from, to, grid, true).unwrap();
        assert_eq!((cap.from, cap.to, cap.cells.len(), pool.live()), (8, 20, 3, 3));
        let ids: Vec<Vec<u32>> = cap.cells.iter().map(|c| c.pages.as_ref().unwrap().pages.iter().map(|p| p.id()).collect()).collect();
        assert_eq!(ids, vec![vec![1], vec![1], vec![2]], "tokens [8, 12) and [12, 16) lie in page 1, [16, 20) in page 2");
        assert_eq!((pool.holders(0), pool.holders(1), pool.holders(2)), (1, 3, 2));
        let snap = cap.kda.as_ref().unwrap();
        assert_eq!((snap.at, snap.bytes()), (20, 5));
        assert_eq!(cap.cells.iter().map(Segment::bytes).sum::<usize>(), 0, "device pages are not pool bytes");
        let refs: Vec<&Segment> = cap.cells.iter().collect();
        let (spans, kda) = restore_device(&refs, snap).unwrap();
        assert_eq!(kda, vec![Some((&[1u8, 2][..], &[3u8, 4, 5][..])), None]);
        assert_eq!(spans.iter().map(|s| (s.from, s.to)).collect::<Vec<_>>(), vec![(8, 12), (12, 16), (16, 20)]);
        drop(cap);
        assert_eq!((pool.holders(1), pool.holders(2)), (1, 1), "the cells let go of their pages");
        // Without the snapshot: the cells only; a span off the grid is refused, and so is a
        // snapshot without a KDA layer's slot.
        let cap = capture_device(&table, rows, vec![], &[true, false], 0, 4, 4, false).unwrap();
        assert!(cap.kda.is_none() && cap.cells.len() == 1);
        assert!(capture_device(&table, rows, vec![], &[true, false], 0, 6, 4, false).is_err());
        assert!(capture_device(&table, rows, vec![None, Some((vec![], vec![]))], &[true, false], 0, 4, 4, true).is_err());
        // A snapshot alone (every cell already stored, the snapshot missing): no cells.
        let cap = capture_device(&table, rows, vec![Some((vec![9], vec![8])), None], &[true, false], 8, 8, 4, true).unwrap();
        assert!(cap.cells.is_empty() && cap.kda.as_ref().unwrap().bytes() == 2);
        // A CPU cell or snapshot is not a device runner's.
        let cpu = Segment { layers: vec![SegLayer::Kda], pages: None, mtp: None, draft: None, remote: None };
        assert!(restore_device(&[&cpu], cap.kda.as_ref().unwrap()).is_err());
    }
}
