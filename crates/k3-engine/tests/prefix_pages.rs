//! The GPU runner's page bookkeeping driven by the real engine, on the CPU (issue 21): a runner
//! that computes on the CPU (`ThreadRunner`, so outputs are checked bit for bit against a cold
//! engine) and keeps, beside it, a simulated device cache — the GPU runner's own pieces, with no
//! device: `k3_model::device_pages` block tables and page pool, `gpu::CacheBudget` admission, the
//! prefix cache's cells holding page spans (`prefix::state::capture_device`). Every forward makes
//! its rows writable in the block table first, as `CudaModel::grow` does, so a promise the budget
//! could not keep fails the step ("the GPU cache is full").
//!
//! Checked: cells hold pages by reference and live sequences resumed from them map the same
//! pages; pages in use are counted once and go back with their last holder; a request that needs
//! more pages than are free waits while running sequences hold the cache's pages, and is then
//! admitted by evicting the cache's cells, sparing the ones it resumes from; a resume the runner
//! refuses fails the step and gives the request's admission back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use k3_engine::dist::runner::{Runner, Step, ThreadRunner};
use k3_engine::gpu::CacheBudget;
use k3_engine::prefix::state::capture_device;
use k3_engine::prefix::{Capture, KdaSnap, Segment};
use k3_engine::{Engine, EngineConfig, EngineError, PrefixConfig, Request, SamplingParams};
use k3_model::config::Config;
use k3_model::device_pages::{PagePool, PageTable};
use k3_model::Model;

#[path = "support/prefix_run.rs"]
mod prefix_run;
#[path = "../../../tests/support/random_model.rs"]
mod random_model;
#[path = "support/recorder.rs"]
mod recorder;
use prefix_run::{prompt_ids, run, Out};
use recorder::{Log, Rec};

const GRID: usize = 64;
/// Rows per simulated page: cells end inside pages.
const ROWS: usize = 48;

/// A sequence's simulated device state: its block table, tokens written, the resume point it
/// was admitted with.
struct Seq {
    table: PageTable,
    pos: usize,
    shared: usize,
}

/// The CPU runner with a simulated device cache (see the module doc).
struct Paged {
    inner: Rec<ThreadRunner>,
    pool: PagePool,
    budget: CacheBudget,
    seqs: HashMap<u64, Seq>,
    /// Restores fail while set (a resume the runner refuses).
    refuse: Arc<AtomicBool>,
}

impl Runner for Paged {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    fn embed(&self, ids: &[u32]) -> k3_engine::Result<Vec<f32>> {
        self.inner.embed(ids)
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
    fn fits(&self, tokens: usize) -> Result<(), usize> {
        if self.budget.fits_ever(tokens) {
            Ok(())
        } else {
            Err(self.budget.tokens())
        }
    }
    fn admit(&mut self, id: u64, tokens: usize, shared: usize) -> k3_engine::Result<bool> {
        let seqs = &self.seqs;
        if !self.budget.try_admit(id, tokens, shared, self.pool.live(), |s| seqs.get(&s).map_or(0, |q| q.table.taken())) {
            return Ok(false);
        }
        self.seqs.insert(id, Seq { table: PageTable::default(), pos: 0, shared });
        self.inner.admit(id, tokens, shared)
    }
    fn release(&mut self, id: u64) {
        self.budget.release(id);
        self.seqs.remove(&id);
        self.inner.release(id)
    }
    fn forward(&mut self, step: Step) -> k3_engine::Result<Vec<f32>> {
        for s in &step.seqs {
            let q = self.seqs.get_mut(&s.id).expect("an admitted sequence");
            q.table.write(&self.pool, q.pos, q.pos + s.tokens.len())?;
            q.pos += s.tokens.len();
        }
        self.inner.forward(step)
    }
    fn prefix_support(&self) -> Result<String, String> {
        self.inner.prefix_support()
    }
    fn exact_cuts(&self) -> bool {
        false // as the GPU runner: chunks run from snapshot point to snapshot point
    }
    fn set_page_rows(&mut self, rows: usize) {
        self.inner.set_page_rows(rows)
    }
    fn capture(&mut self, id: u64, from: usize, grid: usize, kda: bool) -> k3_engine::Result<Capture> {
        let mut cap = self.inner.capture(id, from, grid, kda)?;
        let dev = capture_device(&self.seqs[&id].table, ROWS, Vec::new(), &[], from, cap.to, grid, false)?;
        for (c, d) in cap.cells.iter_mut().zip(dev.cells) {
            c.pages = d.pages;
        }
        Ok(cap)
    }
    fn restore(&mut self, id: u64, cells: &[&Segment], snap: &KdaSnap) -> k3_engine::Result<()> {
        if self.refuse.load(Ordering::Relaxed) {
            return Err(EngineError::Unsupported("injected restore fault".into()));
        }
        self.inner.restore(id, cells, snap)?;
        let spans: Vec<_> = cells.iter().map(|c| c.pages.as_ref().expect("a device cell")).collect();
        let q = self.seqs.get_mut(&id).expect("an admitted sequence");
        assert_eq!(q.shared, snap.at, "sequence {id} restores where it was admitted to");
        q.table = PageTable::join(&spans, ROWS, snap.at)?;
        q.pos = snap.at;
        Ok(())
    }
    fn admits_after_eviction(&self, tokens: usize, shared: usize) -> bool {
        let live = self.pool.live() - self.pool.reclaimable();
        self.budget.fits(tokens, shared, live, |s| self.seqs.get(&s).map_or(0, |q| q.table.taken()))
    }
    fn cache_pages(&self, id: u64) -> Option<Vec<u32>> {
        self.seqs.get(&id).map(|q| q.table.ids().collect())
    }
}

fn model() -> Arc<Model> {
    static M: std::sync::OnceLock<Arc<Model>> = std::sync::OnceLock::new();
    M.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        Arc::new(Model::load(&random_model::random(dir.path(), "tiny", 21, &[])).unwrap())
    })
    .clone()
}

/// An engine over [`Paged`] with a simulated cache of `pages` pages, its log and page pool.
fn engine(pages: usize) -> (Engine, Log, PagePool) {
    let (e, log, pool, _) = engine_with(pages);
    (e, log, pool)
}

/// [`engine`] and the switch that makes its restores fail.
fn engine_with(pages: usize) -> (Engine, Log, PagePool, Arc<AtomicBool>) {
    let log: Log = Default::default();
    let refuse = Arc::new(AtomicBool::new(false));
    let pool = PagePool::new(pages, ROWS);
    let r = Paged {
        inner: Rec::new(ThreadRunner::single(model(), Default::default()), &log),
        pool: pool.clone(),
        budget: CacheBudget::new(pages * ROWS, ROWS),
        seqs: HashMap::new(),
        refuse: refuse.clone(),
    };
    let cfg = EngineConfig { max_batch: 8, max_step_tokens: 1024, prefix: Some(PrefixConfig::new(GRID, 1 << 30)), ..Default::default() };
    (Engine::with_runner(Box::new(r), None, cfg), log, pool, refuse)
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    prompt_ids(model().config.text.vocab_size as u32, seed, n)
}

fn cold(prompt: &[u32], n: usize) -> Out {
    let (mut e, log, _) = engine(64);
    run(&mut e, &log, &[prompt.to_vec()], n, &[]).pop().unwrap().unwrap()
}

fn pool_pages(e: &Engine) -> usize {
    e.prefix_status().unwrap().unwrap().pool_pages as usize
}

/// Cells hold the prefill's pages; sequences resumed from them map those pages (the cut one
/// copied on their first write); every page in use is counted once and goes back with its last
/// holder; the outputs are a cold engine's, bit for bit.
#[test]
fn sequences_and_cells_share_pages() {
    let (mut e, log, pool) = engine(64);
    let sys = ids(3, 2 * GRID + 20);
    let user = |k: u32| [sys.clone(), ids(40 + k, 10)].concat();
    let a = run(&mut e, &log, &[user(0)], 2, &[]).pop().unwrap().unwrap();
    assert_eq!(a, cold(&user(0), 2));
    // Cells [0, 64) and [64, 128) hold pages 0–2 (page 1 both; page 2 up to row 128, cut).
    assert_eq!((pool_pages(&e), pool.live()), (3, 3), "A's own pages went back, the cells' stayed");
    let (pb, pc) = (user(1), user(2));
    let (b, c) = (e.add(Request::new(pb.clone(), SamplingParams::greedy(), 3)).unwrap(), e.add(Request::new(pc.clone(), SamplingParams::greedy(), 3)).unwrap());
    e.step().unwrap();
    let (bp, cp) = (e.runner().cache_pages(b).unwrap(), e.runner().cache_pages(c).unwrap());
    assert_eq!(bp[..2], cp[..2], "the whole pages before 128 are shared");
    assert!(pool.holders(bp[0]) == 3 && pool.holders(bp[1]) == 4, "by the cells (page 1 by both), B and C");
    assert!(bp[2] != cp[2] && pool.holders(bp[2]) == 1, "the page 128 cuts was copied by each");
    assert_eq!(pool.live(), 3 + 2 * 2, "the shared pages once, plus each one's copy and next page");
    let mut toks: HashMap<u64, Vec<u32>> = HashMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            toks.entry(ev.seq).or_default().push(ev.token);
        }
    }
    assert_eq!(pool.live(), pool_pages(&e), "only the cells' pages are left");
    for (id, p) in [(b, &pb), (c, &pc)] {
        assert_eq!(toks[&id][..], cold(p, 3).tokens[1..], "sequence {id}");
    }
    let warm = run(&mut e, &log, std::slice::from_ref(&pb), 3, &[]).pop().unwrap().unwrap();
    assert_eq!(warm.cached, 2 * GRID);
    assert_eq!(warm, Out { cached: 2 * GRID, ..cold(&pb, 3) }, "warm = cold bit for bit");
}

/// A request that needs more pages than are free waits while a running sequence holds the
/// cache's pages (nothing is evicted for nothing); once they are the cache's alone, it is
/// admitted by evicting the cache's cells — not the ones it resumes from while others can go —
/// and every page is free again when it is done.
#[test]
fn admission_evicts_cells_for_room() {
    let pages = 12;
    let (mut e, log, pool) = engine(pages);
    let (p1, p2) = (ids(5, 2 * GRID + 10), ids(6, 2 * GRID + 10));
    run(&mut e, &log, std::slice::from_ref(&p1), 2, &[]);
    run(&mut e, &log, std::slice::from_ref(&p2), 2, &[]);
    assert_eq!((pool_pages(&e), pool.live()), (6, 6), "two prefixes of 3 pages each");
    // B resumes on p1 and runs; X (no hit) needs the whole cache.
    let b = e.add(Request::new([p1[..2 * GRID + 5].to_vec(), vec![1]].concat(), SamplingParams::greedy(), 4)).unwrap();
    let x = e.add(Request::new(ids(9, 10), SamplingParams::greedy(), pages * ROWS - 10)).unwrap();
    e.step().unwrap();
    let st = e.prefix_status().unwrap().unwrap();
    assert!(e.runner().cache_pages(b).is_some() && e.runner().cache_pages(x).is_none(), "X waits");
    assert_eq!((st.evictions, pool_pages(&e)), (0, 6), "the cells B holds are not reclaimable and p2's would not make room: none went");
    while e.runner().cache_pages(x).is_none() {
        e.step().unwrap();
    }
    let st = e.prefix_status().unwrap().unwrap();
    assert_eq!((st.evictions, pool_pages(&e)), (4, 0), "X was admitted by evicting every cell");
    assert!(e.cancel(x));
    assert_eq!(pool.free(), pages, "every page is free again");
    // The resume path is spared while other cells can go: C resumes on p1 in a cache full of
    // p1's and p2's cells, and needs p2's room.
    run(&mut e, &log, std::slice::from_ref(&p1), 2, &[]);
    run(&mut e, &log, std::slice::from_ref(&p2), 2, &[]);
    let pc = [p1[..2 * GRID + 5].to_vec(), vec![2]].concat();
    let room = pages * ROWS - 3 * ROWS + 2 * GRID / ROWS * ROWS; // all but p2's pages, with the hit
    let c = e.add(Request::new(pc.clone(), SamplingParams::greedy(), room - pc.len())).unwrap();
    let ev = e.step().unwrap();
    assert_eq!(ev.iter().find(|ev| ev.seq == c).map(|ev| ev.cached_tokens), Some(2 * GRID), "C resumed on p1's cells: p2's went");
    assert_eq!((e.prefix_status().unwrap().unwrap().evictions, pool_pages(&e)), (6, 3));
    assert!(e.cancel(c));
}

/// A resume the runner refuses fails the step and drops the request, and its admission goes
/// back with it: the state admitted for it and its promised pages are released, not leaked
/// (a GPU runner holds them from `admit` on); the engine then serves the prefix warm again.
#[test]
fn a_failed_resume_gives_its_admission_back() {
    let (mut e, log, pool, refuse) = engine_with(64);
    let p = ids(7, 2 * GRID + 10);
    run(&mut e, &log, std::slice::from_ref(&p), 2, &[]);
    let cells = pool.live();
    refuse.store(true, Ordering::Relaxed);
    let b = e.add(Request::new(p.clone(), SamplingParams::greedy(), 2)).unwrap();
    let err = e.step().unwrap_err().to_string();
    assert!(err.contains("injected restore fault"), "{err}");
    assert!(e.runner().cache_pages(b).is_none(), "sequence {b}'s admitted state was not released");
    assert!(!e.has_work() && pool.live() == cells, "only the cells' pages are held");
    refuse.store(false, Ordering::Relaxed);
    let warm = run(&mut e, &log, std::slice::from_ref(&p), 2, &[]).pop().unwrap().unwrap();
    assert_eq!(warm, Out { cached: 2 * GRID, ..cold(&p, 2) }, "warm = cold after the failure");
}
