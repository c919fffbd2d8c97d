//! The radix tree of the prefix cache and its bounded pool.
//!
//! Keys are token ids cut on the cache's grid: each edge is one whole grid cell (`grid` token
//! ids, plus a content hash of the cell's input rows when the request brought its own — image
//! features spliced in at `<|media_pad|>` ids, which are the same id for every image), under a
//! root per model digest. A sequence can only resume on the grid (that is where chunked
//! prefill cuts, so that warm and cold runs compute identically), so finer edges would never be
//! used. Each node owns its cell's MLA latent and DSA indexer-key rows (a [`Segment`], shared by
//! every descendant: a deeper restore concatenates the segments of its path) and at most one
//! KDA snapshot at its end. Nodes are tombstones when they hold no snapshot.
//!
//! The pool is bounded in bytes (segments + snapshots). Eviction takes, while over budget, the
//! candidate of least `recency × tokens saved per byte`: a snapshot (saved = its depth minus
//! the depth of the nearest snapshot above it, per snapshot byte; dropping it keeps the node)
//! or a leaf without a snapshot (saved = 0: it only serves to spot branch points; dropping it
//! frees its segment). Recency is `1 / (1 + ticks since last use)` on a logical clock.
//!
//! A device runner's cells hold pages of its device cache (`k3_model::device_pages`), which
//! count against the GPU's page budget, not against the pool's bytes: when a request cannot be
//! admitted for want of pages, [`Tree::evict_cell`] drops the least recently used leaf (with its
//! snapshot) among those whose pages nothing but the cache holds, one at a time, sparing the
//! path the request resumes on.

use std::collections::{HashMap, HashSet};

use super::state::{KdaSnap, Segment};

pub type NodeId = usize;

/// One edge: a grid cell's token ids and the hash of its own input rows (0 without).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CellKey {
    pub tokens: Box<[u32]>,
    pub rows: u64,
}

struct Node {
    parent: Option<NodeId>,
    key: CellKey,
    digest: u64,
    children: HashMap<CellKey, NodeId>,
    /// Tokens from the root to this node's end.
    depth: usize,
    seg: Segment,
    kda: Option<KdaSnap>,
    last_used: u64,
}

/// The tree and its pool (see the module doc).
#[derive(Default)]
pub struct Tree {
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
    roots: HashMap<(u64, CellKey), NodeId>,
    clock: u64,
    bytes: usize,
    snapshots: usize,
}

impl Tree {
    /// Bytes held (segments + snapshots).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// KDA snapshots held.
    pub fn snapshots(&self) -> usize {
        self.snapshots
    }
    /// Nodes held.
    pub fn len(&self) -> usize {
        self.nodes.len() - self.free.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device cache pages the cells hold, each counted once.
    pub fn device_pages(&self) -> usize {
        let ids: HashSet<u32> = self.nodes.iter().flatten().filter_map(|n| n.seg.pages.as_ref()).flat_map(|s| s.pages.iter().map(|p| p.id())).collect();
        ids.len()
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("a live node id")
    }
    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id].as_mut().expect("a live node id")
    }

    /// The child of `parent` (a root of `digest` when `None`) along `key`.
    pub fn child(&self, digest: u64, parent: Option<NodeId>, key: &CellKey) -> Option<NodeId> {
        match parent {
            None => self.roots.get(&(digest, key.clone())).copied(),
            Some(p) => self.node(p).children.get(key).copied(),
        }
    }

    /// The nodes matching `keys` from the root, as far as they match.
    pub fn walk<'a>(&self, digest: u64, keys: impl IntoIterator<Item = &'a CellKey>) -> Vec<NodeId> {
        let mut path = Vec::new();
        for k in keys {
            match self.child(digest, path.last().copied(), k) {
                Some(n) => path.push(n),
                None => break,
            }
        }
        path
    }

    pub fn depth(&self, id: NodeId) -> usize {
        self.node(id).depth
    }
    pub fn segment(&self, id: NodeId) -> &Segment {
        &self.node(id).seg
    }
    pub fn kda(&self, id: NodeId) -> Option<&KdaSnap> {
        self.node(id).kda.as_ref()
    }

    /// Marks `ids` as used now.
    pub fn touch(&mut self, ids: &[NodeId]) {
        self.clock += 1;
        let now = self.clock;
        for &id in ids {
            self.node_mut(id).last_used = now;
        }
    }

    /// Adds the cell `key` with its rows under `parent`; `grid` tokens deeper.
    pub fn insert(&mut self, digest: u64, parent: Option<NodeId>, key: CellKey, grid: usize, seg: Segment) -> NodeId {
        if let Some(n) = self.child(digest, parent, &key) {
            return n;
        }
        self.clock += 1;
        let depth = parent.map_or(0, |p| self.depth(p)) + grid;
        self.bytes += seg.bytes();
        let node = Node { parent, key: key.clone(), digest, children: HashMap::new(), depth, seg, kda: None, last_used: self.clock };
        let id = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        match parent {
            None => {
                self.roots.insert((digest, key), id);
            }
            Some(p) => {
                self.node_mut(p).children.insert(key, id);
            }
        }
        id
    }

    /// Gives `id` its KDA snapshot (replacing none: the first one written stays). Returns
    /// whether it was added.
    pub fn set_kda(&mut self, id: NodeId, snap: KdaSnap) -> bool {
        if self.node(id).kda.is_some() {
            return false;
        }
        self.bytes += snap.bytes();
        self.snapshots += 1;
        self.node_mut(id).kda = Some(snap);
        true
    }

    /// Evicts (see the module doc) until at most `budget` bytes are held; returns how many
    /// snapshots and nodes went.
    pub fn evict_to(&mut self, budget: usize) -> usize {
        let mut n = 0;
        while self.bytes > budget {
            let Some((id, snap)) = self.victim() else { break };
            if snap {
                let s = self.node_mut(id).kda.take().map_or(0, |s| s.bytes());
                self.bytes -= s;
                self.snapshots -= 1;
            } else {
                self.remove_leaf(id);
            }
            n += 1;
        }
        n
    }

    /// Drops the least recently used leaf not in `keep` whose device pages only the cache holds
    /// (its snapshot with it), so that its pages go back to the device's free list. Returns
    /// whether one went.
    pub fn evict_cell(&mut self, keep: &[NodeId]) -> bool {
        let leaf = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| Some((id, n.as_ref()?)))
            .filter(|(id, n)| n.children.is_empty() && !keep.contains(id) && n.seg.pages.as_ref().is_some_and(|s| s.frees_pages()))
            .min_by_key(|(_, n)| n.last_used)
            .map(|(id, _)| id);
        let Some(id) = leaf else { return false };
        if let Some(s) = self.node_mut(id).kda.take() {
            self.bytes -= s.bytes();
            self.snapshots -= 1;
        }
        self.remove_leaf(id);
        true
    }

    /// The candidate of least score: `(node, true)` for a snapshot, `(leaf, false)` for a leaf
    /// without one.
    fn victim(&self) -> Option<(NodeId, bool)> {
        let mut best: Option<(f64, u64, NodeId, bool)> = None;
        for (id, node) in self.nodes.iter().enumerate() {
            let Some(node) = node else { continue };
            let recency = 1.0 / (1.0 + (self.clock - node.last_used) as f64);
            let cand = match &node.kda {
                Some(s) => {
                    let saved = node.depth - self.snapshot_above(id);
                    Some((recency * saved as f64 / s.bytes().max(1) as f64, true))
                }
                None if node.children.is_empty() => Some((0.0, false)),
                None => None,
            };
            if let Some((score, snap)) = cand {
                let better = best.is_none_or(|(b, used, _, _)| score < b || (score == b && node.last_used < used));
                if better {
                    best = Some((score, node.last_used, id, snap));
                }
            }
        }
        best.map(|(_, _, id, s)| (id, s))
    }

    /// Depth of the nearest snapshot strictly above `id` (0: the empty prefix).
    fn snapshot_above(&self, id: NodeId) -> usize {
        let mut p = self.node(id).parent;
        while let Some(i) = p {
            let n = self.node(i);
            if n.kda.is_some() {
                return n.depth;
            }
            p = n.parent;
        }
        0
    }

    fn remove_leaf(&mut self, id: NodeId) {
        let Some(node) = self.nodes[id].take() else { return };
        debug_assert!(node.children.is_empty() && node.kda.is_none());
        self.bytes -= node.seg.bytes();
        match node.parent {
            None => {
                self.roots.remove(&(node.digest, node.key));
            }
            Some(p) => {
                self.node_mut(p).children.remove(&node.key);
            }
        }
        self.free.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::state::SnapLayer;
    use k3_model::device_pages::{PagePool, PageTable};

    fn key(k: u32) -> CellKey {
        CellKey { tokens: vec![k].into(), rows: 0 }
    }

    fn snap(at: usize) -> KdaSnap {
        KdaSnap { at, layers: vec![SnapLayer::Raw { conv: vec![0; 10], state: vec![] }], mtp_hidden: None, draft: None, remote: None }
    }

    /// Device cells: pages counted once across cells; eviction for room takes the least
    /// recently used leaf whose pages only the cache holds (with its snapshot), never one a live
    /// sequence still holds nor one the caller keeps, and its pages go back to the free list.
    #[test]
    fn device_cells_are_evicted_for_room_where_that_frees_pages() {
        let (rows, grid) = (4, 6); // cells end inside pages: neighbours share one
        let pool = PagePool::new(16, rows);
        let mut tree = Tree::default();
        // Two prompts of 3 cells, sharing the first: cells [0, 6), then [6, 12), [12, 18) each.
        let mut tables = Vec::new();
        let mut leaves = Vec::new();
        for branch in 0..2u32 {
            let mut t = PageTable::default();
            t.write(&pool, 0, 3 * grid).unwrap();
            let mut parent = None;
            for c in 0..3 {
                let seg = Segment { layers: vec![], pages: Some(t.span(rows, c * grid, (c + 1) * grid).unwrap()), mtp: None, draft: None, remote: None };
                let k = if c == 0 { key(0) } else { key(10 * branch + c as u32) };
                parent = Some(tree.insert(7, parent, k, grid, seg));
            }
            leaves.push(parent.unwrap());
            tables.push(t);
        }
        assert!(tree.set_kda(leaves[0], snap(18)));
        // The shared first cell is branch 0's pages [0, 2); branch 1's own first cell went (it
        // was there already), so its pages 5 and 6 are held by its table and later cells only.
        assert_eq!((tree.len(), tree.device_pages(), pool.live()), (5, 9, 10));
        assert_eq!(tree.bytes(), 10, "device cells are not pool bytes; the snapshot is");
        // Both prompts' sequences still run: nothing can be freed.
        assert!(!tree.evict_cell(&[]));
        drop(tables.remove(0));
        tree.touch(&[leaves[0]]); // branch 0 used last
                                  // Branch 1's sequence still runs: only branch 0's leaf frees pages (kept: none go).
        assert!(!tree.evict_cell(&[leaves[0]]));
        let free = pool.free();
        assert!(tree.evict_cell(&[]));
        assert_eq!((tree.len(), tree.snapshots(), tree.bytes()), (4, 0, 0), "the leaf and its snapshot went");
        assert_eq!(pool.free(), free + 2, "its pages went back");
        drop(tables);
        // Now everything is the cache's alone: least recently used first — branch 0's second
        // cell, whose first page its parent holds too — down to nothing.
        let free = pool.free();
        assert!(tree.evict_cell(&[]));
        assert_eq!((tree.len(), pool.free()), (3, free + 1), "page 2 went back, not page 1");
        let mut n = 0;
        while tree.evict_cell(&[]) {
            n += 1;
        }
        assert_eq!((n, tree.len(), pool.live()), (3, 0, 0));
    }
}
