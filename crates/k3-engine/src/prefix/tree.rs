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

use std::collections::HashMap;

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
