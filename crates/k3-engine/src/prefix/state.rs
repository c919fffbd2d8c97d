//! What the prefix cache stores of a sequence, and how a CPU [`SeqState`] is cut into it and
//! rebuilt from it (text-backbone §3.8 KDA state, §4/§5 MLA latent and DSA indexer-key caches).
//!
//! A sequence's state at token `g` is, per layer: for a KDA layer the recurrent state
//! `[nh, hd, hd]` and the conv tails `[3][K−1, D]` (both *at* `g`, so they are snapshotted whole:
//! [`KdaSnap`]); for an MLA/DSA layer the append-only latent rows `[g, r + dr]` and indexer keys
//! `[g, id]`, so rows `[from, to)` of one grid cell are enough once the cells before it are
//! stored ([`Segment`]). Restoring at `g` concatenates the segments of cells `0..g/grid` and
//! copies in the KDA snapshot taken at `g`: the restored state is equal, value for value, to the
//! one the prefill that wrote them had at `g` (the cache copies; it never recomputes).

use k3_model::model::LayerState;
use k3_model::SeqState;

use crate::error::{EngineError, Result};

/// One layer's rows of a token span `[from, to)`.
#[derive(Clone, Debug)]
pub enum SegLayer {
    /// A KDA layer: nothing per token.
    Kda,
    /// `latent` `[to − from, r + dr]`, `index_keys` `[to − from, id]` (empty without DSA).
    Mla { latent: Vec<f32>, index_keys: Vec<f32> },
}

/// The MLA/DSA rows of one token span, every layer.
#[derive(Clone, Debug)]
pub struct Segment {
    pub layers: Vec<SegLayer>,
}

impl Segment {
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                SegLayer::Kda => 0,
                SegLayer::Mla { latent, index_keys } => 4 * (latent.len() + index_keys.len()),
            })
            .sum()
    }
}

/// Every KDA layer's state and conv tails at one token count (`None` for the MLA layers).
#[derive(Clone, Debug)]
pub struct KdaSnap {
    pub at: usize,
    pub layers: Vec<Option<k3_model::layers::kda::KdaState>>,
}

impl KdaSnap {
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|s| s.bytes()).sum()
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

fn rows_per_token(len: usize, pos: usize, l: usize, what: &str) -> Result<usize> {
    if pos == 0 || !len.is_multiple_of(pos) {
        return Err(EngineError::Internal(format!("layer {l}: {len} {what} values for {pos} cached tokens")));
    }
    Ok(len / pos)
}

/// Cuts `st` (which has consumed exactly `st.pos` tokens) into the cells `[from, st.pos)` of
/// `grid` tokens, and snapshots its KDA layers when `kda`.
pub fn capture(st: &SeqState, from: usize, grid: usize, kda: bool) -> Result<Capture> {
    let to = st.pos;
    if grid == 0 || from > to || !from.is_multiple_of(grid) || !to.is_multiple_of(grid) {
        return Err(EngineError::Internal(format!("capture [{from}, {to}) is not on the grid of {grid} tokens")));
    }
    let n = (to - from) / grid;
    let mut cells: Vec<Segment> = (0..n).map(|_| Segment { layers: Vec::with_capacity(st.layers.len()) }).collect();
    for (l, layer) in st.layers.iter().enumerate() {
        match layer {
            LayerState::Kda(_) => cells.iter_mut().for_each(|c| c.layers.push(SegLayer::Kda)),
            LayerState::Mla(c) => {
                let w = rows_per_token(c.latent.len(), to, l, "latent")?;
                let iw = if c.index_keys.is_empty() { 0 } else { rows_per_token(c.index_keys.len(), to, l, "indexer-key")? };
                for (k, cell) in cells.iter_mut().enumerate() {
                    let (a, b) = (from + k * grid, from + (k + 1) * grid);
                    cell.layers.push(SegLayer::Mla { latent: c.latent[a * w..b * w].to_vec(), index_keys: c.index_keys[a * iw..b * iw].to_vec() });
                }
            }
        }
    }
    let kda = kda.then(|| KdaSnap {
        at: to,
        layers: st
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => Some(s.clone()),
                LayerState::Mla(_) => None,
            })
            .collect(),
    });
    Ok(Capture { from, to, cells, kda })
}

/// Rebuilds the state at `snap.at` into `fresh` (a new, empty state of the same model): the
/// segments of every cell before it, in order, and the KDA snapshot.
pub fn restore(mut fresh: SeqState, cells: &[&Segment], snap: &KdaSnap) -> Result<SeqState> {
    if fresh.pos != 0 || snap.layers.len() != fresh.layers.len() || cells.iter().any(|c| c.layers.len() != fresh.layers.len()) {
        return Err(EngineError::Internal("prefix restore: the stored state was made for another model".into()));
    }
    for (l, layer) in fresh.layers.iter_mut().enumerate() {
        match (layer, &snap.layers[l]) {
            (LayerState::Kda(s), Some(k)) => *s = k.clone(),
            (LayerState::Mla(c), None) => {
                for cell in cells {
                    let SegLayer::Mla { latent, index_keys } = &cell.layers[l] else {
                        return Err(EngineError::Internal(format!("prefix restore: layer {l} is MLA but a stored segment is not")));
                    };
                    c.latent.extend_from_slice(latent);
                    c.index_keys.extend_from_slice(index_keys);
                }
            }
            _ => return Err(EngineError::Internal(format!("prefix restore: layer {l} does not match the stored snapshot"))),
        }
    }
    fresh.pos = snap.at;
    Ok(fresh)
}
