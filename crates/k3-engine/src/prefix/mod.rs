//! KDA-aware prefix caching (issue 21): a finished or running request's prefill leaves the
//! sequence state at grid points in a bounded pool, and a later request with the same prefix
//! resumes there instead of prefilling it again — with outputs equal, bit for bit on the CPU,
//! to a cold start.
//!
//! **Why a grid.** A KDA layer's state cannot be rolled back or cut out of a longer one, so a
//! hit needs the state at exactly the resume point; and the CPU forward's rows depend on how a
//! prompt is cut into forward calls (the chunked KDA core runs 64-token chunks from the call's
//! start, MLA takes its explicit form for a call into an empty cache, and a GEMM of ≤ 4 rows
//! takes the GEMV path, whose sums round differently) — though not, beyond that, on the other
//! rows of the step (measured: a row of `linear` is bit-equal for every M ≥ 5, and for every
//! M ≤ 4). So with the cache on, prefill is cut at every multiple of `grid` tokens and nowhere
//! else (a chunk that does not fit the step's budget waits for the next step instead of being
//! cut short), snapshots exist only at grid points, and a warm run from grid point `g` makes
//! exactly the forward calls a cold run makes after `g`.
//!
//! **What is stored** ([`state`], [`tree`]): per grid cell the MLA latent and DSA indexer-key
//! rows (one copy, shared by every deeper prefix), per chosen grid point a KDA snapshot (state +
//! conv tails of every KDA layer). Snapshots are taken at: every `interval` tokens; the branch
//! point found at admission (the request's cells match the tree deeper than its deepest
//! snapshot: a second sighting, so the state there is taken during this prefill); and the
//! prompt's last grid points `⌊P/grid⌋·grid` and `⌊(P−1)/grid⌋·grid` (an extension resp. an exact
//! re-send resumes there). They are written by the prefill itself and published right after the
//! step that wrote them returned, so a cancelled or failed request never leaves half-written
//! state. Generated tokens are never cached: decode rows are computed one token at a time,
//! which rounds differently from a prefill of the same tokens, so a resume there could not
//! equal a cold start.
//!
//! **Resume rule**: the deepest snapshot at a position ≤ P − 1 (the last prompt token is always
//! computed, it gives the first logits); the request's state is rebuilt from the pool's cells
//! and snapshot — its latent and indexer-key pages are the pool's own, shared by reference (on
//! the CPU and the GPU: `state`'s "Shared pages"), its KDA state a copy — and its cache grows
//! from there in pages of its own. On the GPU the cells' pages are device pages: when a request
//! cannot be admitted for want of them, the engine has the cache give back cells
//! ([`PrefixCache::evict_for_room`]), sparing the ones the request resumes from.
//!
//! **Concurrent prefills of one prefix**: a request whose cells a running sequence is still
//! prefilling, deeper than anything it could resume from now, waits before admission until that
//! prefill has written them (which then also snapshots there) and resumes from its state, rather
//! than computing the same cells beside it ([`PrefixCache::wait_for`]).

pub mod state;
pub mod tree;

use std::hash::{Hash, Hasher};

use serde::Serialize;

use crate::dist::runner::Runner;
use crate::engine::SeqId;
use crate::error::Result;
pub use state::{Capture, KdaSnap, SegLayer, Segment, SnapLayer};
pub use tree::CellKey;
use tree::{NodeId, Tree};

/// How the cache is set up (`k3 serve --prefix-cache-grid --prefix-cache-mem`).
#[derive(Clone, Debug)]
pub struct PrefixConfig {
    /// Tokens per grid cell: prefill cuts here and snapshots sit here.
    pub grid: usize,
    /// Bytes the pool may hold (segments + snapshots).
    pub mem_bytes: usize,
    /// A KDA snapshot every this many tokens (a multiple of `grid`), besides branch points and
    /// prompt ends.
    pub interval: usize,
}

impl PrefixConfig {
    /// The default grid in tokens.
    pub const GRID: usize = 128;

    /// `grid` and `mem_bytes` with an interval of 4 cells.
    pub fn new(grid: usize, mem_bytes: usize) -> PrefixConfig {
        PrefixConfig { grid, mem_bytes, interval: 4 * grid }
    }
}

/// Counters for `/metrics` and the tests.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PrefixStats {
    /// Requests looked up at admission.
    pub lookups: u64,
    /// Of those, the ones that resumed from a snapshot.
    pub hits: u64,
    /// Prompt tokens not prefilled thanks to a hit.
    pub hit_tokens: u64,
    /// Lookups whose cells matched deeper than any snapshot (the branch point is taken then).
    pub kv_only_matches: u64,
    /// KDA snapshots published.
    pub snapshots: u64,
    /// Snapshots and cells evicted.
    pub evictions: u64,
    /// Admissions put off by a step because a running prefill was writing the same prefix.
    pub deferred: u64,
    /// Bytes held by the pool now (host memory: the CPU's cells, KDA snapshots).
    pub pool_bytes: u64,
    /// Device cache pages held by the pool's cells now, each counted once (GPU).
    pub pool_pages: u64,
    /// Snapshots held now.
    pub pool_snapshots: u64,
}

/// What admission found for one request.
#[derive(Clone, Debug, Default)]
pub struct Admission {
    /// Prompt tokens restored (0: a cold start).
    pub resume: usize,
    /// Grid points where this request's prefill takes a KDA snapshot beyond the regular ones:
    /// its branch point, and the points requests waiting for this prefill will resume at.
    pub snap_at: Vec<usize>,
    /// The keys of the prompt's whole grid cells (computed once: hashing a cell's own input
    /// rows is not free).
    pub keys: Vec<CellKey>,
}

/// The cache: the tree and pool, the model digest and the counters.
pub struct PrefixCache {
    pub cfg: PrefixConfig,
    /// Prefill is cut on the grid only (the runner's rows depend on where a prompt is cut, and
    /// it is bit-reproducible: the CPU). Else chunks run to the next snapshot point (see
    /// [`PrefixCache::chunk`]).
    exact_cuts: bool,
    digest: u64,
    tree: Tree,
    stats: PrefixStats,
}

/// A stable 64-bit hash (the std SipHash with its fixed keys).
fn hash64(v: &impl Hash) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// The key of cell `k` of a prompt (its ids, and the hash of its own input rows if any).
fn cell_key(prompt: &[u32], rows: Option<&[f32]>, h: usize, grid: usize, k: usize) -> CellKey {
    let span = k * grid..(k + 1) * grid;
    let rows = rows.map_or(0, |r| {
        let bits: Vec<u32> = r[span.start * h..span.end * h].iter().map(|x| x.to_bits()).collect();
        hash64(&bits) | 1
    });
    CellKey { tokens: prompt[span].into(), rows }
}

impl PrefixCache {
    /// A cache for the model described by `digest_of` (its config, cache dtypes and layout:
    /// entries of another model or dtype never match).
    pub fn new(cfg: PrefixConfig, digest_of: &str) -> PrefixCache {
        PrefixCache { cfg, exact_cuts: true, digest: hash64(&digest_of), tree: Tree::default(), stats: PrefixStats::default() }
    }

    /// A cache for a runner that is not bit-reproducible from run to run (the GPU's float
    /// atomics), so cutting prefill on every grid point buys nothing: chunks run from grid
    /// point to snapshot point, and regular snapshots are at least `SPARSE_INTERVAL` cells
    /// apart (a snapshot of the real K3's KDA layers is ~90 MB).
    pub fn with_free_cuts(mut cfg: PrefixConfig, digest_of: &str) -> PrefixCache {
        cfg.interval = cfg.interval.max(Self::SPARSE_INTERVAL * cfg.grid);
        PrefixCache { exact_cuts: false, ..Self::new(cfg, digest_of) }
    }

    /// Cells between regular snapshots with free cuts.
    pub const SPARSE_INTERVAL: usize = 16;

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            pool_bytes: self.tree.bytes() as u64,
            pool_pages: self.tree.device_pages() as u64,
            pool_snapshots: self.tree.snapshots() as u64,
            ..self.stats.clone()
        }
    }

    /// The next prefill chunk of a sequence at `done` of its `prompt_len` prompt tokens
    /// (`adm`: its admission). With exact cuts: up to the next grid point, or `None` when that
    /// does not fit `budget` and the step already prefills something (it waits: a chunk is never
    /// cut short, so chunk ends depend on positions only). With free cuts: up to `max_chunk` and
    /// `budget`, ending at the first grid point inside where a snapshot is wanted.
    pub fn chunk(&self, done: usize, prompt_len: usize, adm: &Admission, budget: usize, max_chunk: usize, prefill_planned: bool) -> Option<usize> {
        let g = self.cfg.grid;
        let left = prompt_len - done;
        if self.exact_cuts {
            let n = (g - done % g).min(left);
            return (n <= budget || !prefill_planned).then_some(n);
        }
        let limit = left.min(budget).min(max_chunk).max(1);
        let first = (done / g + 1) * g;
        let snap = (first..=done + limit).step_by(g).find(|&p| self.wants_snapshot(p, prompt_len, adm));
        Some(snap.map_or(limit, |p| p - done))
    }

    /// The keys of a prompt's whole grid cells (`rows`: the request's own input rows, if any).
    pub fn keys(&self, prompt: &[u32], rows: Option<&[f32]>, h: usize) -> Vec<CellKey> {
        let g = self.cfg.grid;
        (0..prompt.len() / g).map(|k| cell_key(prompt, rows, h, g, k)).collect()
    }

    /// Whether a request (its cell `keys`, `prompt_len` tokens) should wait before admission for
    /// a running sequence's prefill: `running` gives (index, admission, tokens prefilled) of the
    /// sequences still prefilling. When one shares more cells with it than it could resume from
    /// now and has not prefilled them yet, returns (its index, the grid point to snapshot there):
    /// the request then resumes from its state instead of prefilling the same cells beside it.
    pub fn wait_for<'a>(
        &mut self,
        keys: &[CellKey],
        prompt_len: usize,
        running: impl IntoIterator<Item = (usize, &'a Admission, usize)>,
    ) -> Option<(usize, usize)> {
        let g = self.cfg.grid;
        let usable = &keys[..keys.len().min((prompt_len - 1) / g)];
        let path = self.tree.walk(self.digest, usable);
        let now = path.iter().rposition(|&n| self.tree.kda(n).is_some()).map_or(0, |i| (i + 1) * g);
        let common = |k: &[CellKey]| k.iter().zip(usable).take_while(|(a, b)| a == b).count() * g;
        let best = running.into_iter().map(|(j, a, done)| (j, common(&a.keys), done)).filter(|&(_, c, done)| c > now && done < c).max_by_key(|&(_, c, _)| c);
        let (j, at, _) = best?;
        self.stats.deferred += 1;
        Some((j, at))
    }

    /// The path of a request's usable cells (those it may resume past: ≤ P − 1 tokens) and the
    /// index in it of the deepest snapshot, if any.
    fn resume_path(&self, keys: &[CellKey], prompt_len: usize) -> (Vec<NodeId>, Option<usize>) {
        let last = (prompt_len - 1) / self.cfg.grid;
        let mut path = self.tree.walk(self.digest, keys);
        path.truncate(last);
        let at = path.iter().rposition(|&n| self.tree.kda(n).is_some());
        (path, at)
    }

    /// The tokens a request (its cell `keys`, `prompt_len` tokens) would resume past if admitted
    /// now (0: a cold start); [`PrefixCache::admit`] restores exactly there if nothing changes
    /// in between.
    pub fn hit(&self, keys: &[CellKey], prompt_len: usize) -> usize {
        self.resume_path(keys, prompt_len).1.map_or(0, |i| (i + 1) * self.cfg.grid)
    }

    /// Gives back one cell whose device pages only the cache holds (the GPU: a request waits
    /// for pages), sparing the cells a request with `keys` resumes past at `hit`; whether one
    /// went.
    pub fn evict_for_room(&mut self, keys: &[CellKey], hit: usize) -> bool {
        let keep = self.tree.walk(self.digest, &keys[..(hit / self.cfg.grid).min(keys.len())]);
        let gone = self.tree.evict_cell(&keep);
        self.stats.evictions += gone as u64;
        gone
    }

    /// Looks a request up at admission (its cell `keys` from [`PrefixCache::keys`]); when it
    /// resumes, rebuilds sequence `id`'s state in `runner` at the resume point.
    pub fn admit(&mut self, runner: &mut dyn Runner, id: SeqId, prompt_len: usize, keys: Vec<CellKey>) -> Result<Admission> {
        let g = self.cfg.grid;
        self.stats.lookups += 1;
        let (usable, at) = self.resume_path(&keys, prompt_len);
        let resume = at.map_or(0, |i| (i + 1) * g);
        let matched = usable.len() * g;
        let snap_at: Vec<usize> = (matched > resume).then_some(matched).into_iter().collect();
        if !snap_at.is_empty() {
            self.stats.kv_only_matches += 1;
        }
        if let Some(i) = at {
            let cells: Vec<&Segment> = usable[..=i].iter().map(|&n| self.tree.segment(n)).collect();
            let snap = self.tree.kda(usable[i]).expect("a snapshot node");
            runner.restore(id, &cells, snap)?;
            self.stats.hits += 1;
            self.stats.hit_tokens += resume as u64;
            self.tree.touch(&usable[..=i]);
        }
        Ok(Admission { resume, snap_at, keys })
    }

    /// Whether a KDA snapshot is taken at grid point `pos` of a prompt of `p` tokens.
    fn wants_snapshot(&self, pos: usize, p: usize, adm: &Admission) -> bool {
        let g = self.cfg.grid;
        pos.is_multiple_of(self.cfg.interval.max(g)) || pos == p / g * g || pos == (p - 1) / g * g || adm.snap_at.contains(&pos)
    }

    /// After a step that brought sequence `id` to `pos` of its `prompt_len` prompt tokens: on a
    /// grid point, publishes its cells up to `pos` that the tree lacks, and the KDA snapshot
    /// there if one is wanted and missing; then evicts down to the budget.
    pub fn after_step(&mut self, runner: &mut dyn Runner, id: SeqId, prompt_len: usize, pos: usize, adm: &Admission) -> Result<()> {
        let g = self.cfg.grid;
        if pos == 0 || !pos.is_multiple_of(g) || pos > prompt_len || pos / g > adm.keys.len() {
            return Ok(());
        }
        let keys = &adm.keys[..pos / g];
        let path = self.tree.walk(self.digest, keys);
        let want = self.wants_snapshot(pos, prompt_len, adm);
        let have_snap = path.len() == keys.len() && path.last().is_some_and(|&n| self.tree.kda(n).is_some());
        if path.len() == keys.len() && (!want || have_snap) {
            self.tree.touch(&path);
            return Ok(());
        }
        let from = path.len() * g;
        let cap = runner.capture(id, from, g, want && !have_snap)?;
        if cap.from != from || cap.to != pos || cap.cells.len() != keys.len() - path.len() {
            return Err(crate::error::EngineError::Internal(format!("the runner captured [{}, {}) for [{from}, {pos})", cap.from, cap.to)));
        }
        let mut parent: Option<NodeId> = path.last().copied();
        for (key, seg) in keys[path.len()..].iter().zip(cap.cells) {
            parent = Some(self.tree.insert(self.digest, parent, key.clone(), g, seg));
        }
        let node = parent.expect("at least one cell");
        if let Some(snap) = cap.kda {
            if self.tree.set_kda(node, snap) {
                self.stats.snapshots += 1;
            }
        }
        let mut touched = path;
        touched.push(node);
        self.tree.touch(&touched);
        self.stats.evictions += self.tree.evict_to(self.cfg.mem_bytes) as u64;
        Ok(())
    }
}

/// Parses a byte size: `1073741824`, `512MiB`, `2GiB`, `1.5G`, `800M`, `64K` (K/M/G/T and their
/// `iB` forms are powers of 1024; a bare `B` suffix is bytes).
pub fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 2GiB, 512MiB, 1073741824)"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("{s:?}: unknown unit {u:?} (use K, M, G, T or KiB, MiB, GiB, TiB)")),
    };
    let v = x * mul as f64;
    if !v.is_finite() || v < 0.0 || v > usize::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(v as usize)
}

/// The default pool size: an eighth of the machine's memory (`MemTotal` in /proc/meminfo),
/// 1 GiB where that cannot be read.
pub fn default_mem_bytes() -> usize {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines().find(|l| l.starts_with("MemTotal:")).and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<usize>().ok()).map(|kb| kb * 1024)
    });
    total.map_or(1 << 30, |b| b / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("1073741824"), Ok(1 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5k"), Ok(1536));
        assert!(parse_bytes("lots").unwrap_err().contains("not a size"));
        assert!(parse_bytes("3 parsecs").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn chunks_stop_on_the_grid() {
        let c = PrefixCache::new(PrefixConfig::new(128, 1 << 20), "m");
        let a = Admission::default();
        assert_eq!(c.chunk(0, 300, &a, 1000, 4096, false), Some(128));
        assert_eq!(c.chunk(128, 300, &a, 1000, 4096, false), Some(128));
        assert_eq!(c.chunk(256, 300, &a, 1000, 4096, false), Some(44));
        assert_eq!(c.chunk(100, 300, &a, 1000, 4096, false), Some(28));
        // Never cut short: it waits unless it is the step's only prefill.
        assert_eq!(c.chunk(0, 300, &a, 50, 4096, true), None);
        assert_eq!(c.chunk(0, 300, &a, 50, 4096, false), Some(128));
    }

    #[test]
    fn free_cuts_run_to_the_next_snapshot_point() {
        let c = PrefixCache::with_free_cuts(PrefixConfig::new(128, 1 << 20), "m");
        assert_eq!(c.cfg.interval, 16 * 128);
        let a = Admission::default();
        // A 5000-token prompt: regular snapshots at 2048 and 4096, prompt ends at 4992 (both).
        assert_eq!(c.chunk(0, 5000, &a, 8192, 8192, false), Some(2048));
        assert_eq!(c.chunk(2048, 5000, &a, 8192, 8192, false), Some(2048));
        assert_eq!(c.chunk(4096, 5000, &a, 8192, 8192, false), Some(896));
        assert_eq!(c.chunk(4992, 5000, &a, 8192, 8192, false), Some(8));
        // The budget and the chunk limit cut anywhere; a branch point is a snapshot point.
        assert_eq!(c.chunk(0, 5000, &a, 1000, 8192, true), Some(1000));
        assert_eq!(c.chunk(1000, 5000, &a, 8192, 512, false), Some(512));
        let b = Admission { snap_at: vec![640], ..Default::default() };
        assert_eq!(c.chunk(0, 5000, &b, 8192, 8192, false), Some(640));
    }
}
