//! Reference-counted pages of a device's paged caches (issue 21): the host-side bookkeeping of
//! the GPU's MLA latent and DSA indexer-key pools (`cuda/state.rs`; text-backbone §4, §5), with
//! no device in it, so that it is tested on the CPU. The device side only copies the pages this
//! module says to copy.
//!
//! A pool of `pages` pages of `rows` token rows each (the same page id in every MLA/DSA layer).
//! A [`PageRef`] is one holder's handle on a page: a sequence's block table ([`PageTable`]) or a
//! prefix-cache cell ([`PageSpan`]). A page goes back to the free list when its last handle
//! drops — a finished sequence, an evicted cell, whichever is last.
//!
//! **Who may write where.** Pages are append-only. The handle that took a page from the pool
//! (or copied it) is its *owner*; every other handle is a reader that relies on the page's first
//! `extent` rows, and the page's *sealed* mark is the largest extent ever handed out. A write of
//! rows `[from, to)` into a sequence's pages ([`PageTable::write`]) goes in place into a page
//! held by this handle alone, or into one it owns at rows at or past the sealed mark (the owner
//! appending after a prefix-cache cell took its first rows: nothing anyone reads changes);
//! otherwise the page is copied first into a new page of the sequence's own (copy-on-write: a
//! restored sequence whose resume point lies inside a page, a rollback below the sealed mark).
//! So the prefill that wrote a prefix, the cache's cells and every sequence resumed from them
//! hold one copy of its rows, and only the page a resume point cuts is ever copied.
//!
//! **Counting.** [`PagePool::live`] counts each page in use once, however many handles hold it;
//! [`PagePool::reclaimable`] the pages only prefix-cache cells hold (what evicting cells could
//! free); [`PageTable::taken`] the pages a sequence took from the pool (new and copied), which
//! the GPU runner's admission budget (`k3_engine::gpu::budget`) sets against what it promised.
//!
//! Shapes: a page is `[rows, w]` of each layer's pool `[P, rows, w]`; token `t` of a sequence
//! lies in its page `t / rows` at row `t % rows`.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{ModelError, Result};

/// The pool's per-page counts (see the module doc).
#[derive(Debug)]
struct Table {
    /// Handles per page.
    refs: Vec<u32>,
    /// Of those, prefix-cache handles.
    cached: Vec<u32>,
    /// Rows some reader relies on (the largest extent handed out since the page was taken).
    sealed: Vec<u32>,
    /// Free page ids; the next one taken is the last.
    free: Vec<u32>,
}

/// The pages of one device cache (see the module doc). Cloning gives another handle on the same
/// pool.
#[derive(Clone, Debug)]
pub struct PagePool {
    t: Arc<Mutex<Table>>,
    rows: usize,
}

fn lock(t: &Mutex<Table>) -> MutexGuard<'_, Table> {
    // The table's counts are updated under the lock in one piece: a panic elsewhere cannot
    // leave them half-written, so a poisoned lock is still consistent.
    t.lock().unwrap_or_else(|e| e.into_inner())
}

impl PagePool {
    /// `pages` free pages (ids `0..pages`, taken lowest first) of `rows` rows each.
    pub fn new(pages: usize, rows: usize) -> PagePool {
        let t = Table { refs: vec![0; pages], cached: vec![0; pages], sealed: vec![0; pages], free: (0..pages as u32).rev().collect() };
        PagePool { t: Arc::new(Mutex::new(t)), rows: rows.max(1) }
    }
    /// Token rows per page.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        lock(&self.t).refs.len()
    }
    /// Pages on the free list.
    pub fn free(&self) -> usize {
        lock(&self.t).free.len()
    }
    /// Pages in use, each counted once.
    pub fn live(&self) -> usize {
        let t = lock(&self.t);
        t.refs.len() - t.free.len()
    }
    /// Pages held by prefix-cache handles only: freed if the cache let them go.
    pub fn reclaimable(&self) -> usize {
        let t = lock(&self.t);
        t.refs.iter().zip(&t.cached).filter(|&(&r, &c)| r > 0 && r == c).count()
    }
    /// Handles on page `id` (0: free).
    pub fn holders(&self, id: u32) -> u32 {
        lock(&self.t).refs.get(id as usize).copied().unwrap_or(0)
    }
    /// Whether `p` is a handle on a page of this pool.
    pub fn holds(&self, p: &PageRef) -> bool {
        p.same_pool(&self.t)
    }
    /// A page of the pool's own, owned, or `None` when none is free.
    pub fn take(&self) -> Option<PageRef> {
        take(&self.t, &mut lock(&self.t))
    }
}

fn take(pool: &Arc<Mutex<Table>>, t: &mut Table) -> Option<PageRef> {
    let id = t.free.pop()?;
    t.refs[id as usize] = 1;
    t.sealed[id as usize] = 0;
    Some(PageRef { t: pool.clone(), id, owner: true, cache: false })
}

/// One holder's handle on a page (see the module doc). A clone is another reader of the same
/// kind (sequence or prefix cache), never an owner.
#[derive(Debug)]
pub struct PageRef {
    t: Arc<Mutex<Table>>,
    id: u32,
    owner: bool,
    cache: bool,
}

impl PageRef {
    /// The page id (its index in every layer's pool).
    pub fn id(&self) -> u32 {
        self.id
    }
    /// Whether this handle took the page from the pool (or copied it): it may append in place.
    pub fn is_owner(&self) -> bool {
        self.owner
    }
    /// Whether only prefix-cache handles hold the page.
    pub fn cache_only(&self) -> bool {
        let t = lock(&self.t);
        t.refs[self.id as usize] == t.cached[self.id as usize]
    }
    /// A reader's handle that relies on the page's first `extent` rows (`cache`: a prefix-cache
    /// cell's).
    fn reader(&self, extent: usize, cache: bool) -> PageRef {
        let mut t = lock(&self.t);
        let i = self.id as usize;
        t.refs[i] += 1;
        t.cached[i] += cache as u32;
        t.sealed[i] = t.sealed[i].max(extent as u32);
        PageRef { t: self.t.clone(), id: self.id, owner: false, cache }
    }
    /// Whether two handles are on one pool.
    fn same_pool(&self, other: &Arc<Mutex<Table>>) -> bool {
        Arc::ptr_eq(&self.t, other)
    }
}

impl Clone for PageRef {
    fn clone(&self) -> PageRef {
        let mut t = lock(&self.t);
        t.refs[self.id as usize] += 1;
        t.cached[self.id as usize] += self.cache as u32;
        PageRef { t: self.t.clone(), id: self.id, owner: false, cache: self.cache }
    }
}

impl PartialEq for PageRef {
    fn eq(&self, other: &PageRef) -> bool {
        self.id == other.id && Arc::ptr_eq(&self.t, &other.t)
    }
}

impl Drop for PageRef {
    fn drop(&mut self) {
        let mut t = lock(&self.t);
        let i = self.id as usize;
        t.refs[i] -= 1;
        t.cached[i] -= self.cache as u32;
        if t.refs[i] == 0 {
            t.sealed[i] = 0;
            t.free.push(self.id);
        }
    }
}

/// One sequence's block table: its pages in token order, and how many it took from the pool.
#[derive(Debug, Default)]
pub struct PageTable {
    pages: Vec<PageRef>,
    taken: usize,
}

/// What a write needs on the device: copy page `.0` into page `.1` (every layer's pool) before
/// the step that writes runs.
pub type PageCopy = (u32, u32);

impl PageTable {
    /// The page ids, in token order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = u32> + '_ {
        self.pages.iter().map(PageRef::id)
    }
    pub fn pages(&self) -> &[PageRef] {
        &self.pages
    }
    pub fn len(&self) -> usize {
        self.pages.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
    /// Pages taken from the pool for this sequence so far (new ones and copies).
    pub fn taken(&self) -> usize {
        self.taken
    }
    /// One page only this table holds and owns, already taken (a graph's scratch sequence).
    pub fn single(page: PageRef) -> PageTable {
        PageTable { pages: vec![page], taken: 0 }
    }

    /// Makes rows `[from, to)` writable (see the module doc): copies the pages they fall in that
    /// others rely on into new pages, then adds pages up to `to`. Returns the device copies to
    /// make, in order, before the write. When the pool lacks the pages, nothing changes and the
    /// error says so.
    pub fn write(&mut self, pool: &PagePool, from: usize, to: usize) -> Result<Vec<PageCopy>> {
        if let Some(p) = self.pages.iter().find(|p| !p.same_pool(&pool.t) || p.cache) {
            return Err(ModelError::Internal(format!("a sequence's block table holds page {} of another pool or of the prefix cache", p.id)));
        }
        let r = pool.rows;
        let need = to.div_ceil(r);
        let mut t = lock(&pool.t);
        let mut copy = Vec::new();
        if from < to {
            for k in from / r..need.min(self.pages.len()) {
                let p = &mut self.pages[k];
                let (i, off) = (p.id as usize, if k == from / r { from % r } else { 0 });
                if t.refs[i] == 1 {
                    // Held here alone: nobody else reads it, so it is this table's to write.
                    p.owner = true;
                    t.sealed[i] = 0;
                } else if !(p.owner && off >= t.sealed[i] as usize) {
                    copy.push(k);
                }
            }
        }
        let grow = need.saturating_sub(self.pages.len());
        if t.free.len() < copy.len() + grow {
            return Err(ModelError::Capacity(format!(
                "the GPU cache is full ({} pages of {r} tokens, {} free, {} needed): finish sequences or raise CacheConfig.max_tokens (--max-cache-tokens)",
                t.refs.len(),
                t.free.len(),
                copy.len() + grow
            )));
        }
        let mut copies = Vec::with_capacity(copy.len());
        let mut old = Vec::with_capacity(copy.len());
        for k in copy {
            let new = take(&pool.t, &mut t).expect("counted free");
            copies.push((self.pages[k].id, new.id));
            old.push(std::mem::replace(&mut self.pages[k], new));
        }
        for _ in 0..grow {
            self.pages.push(take(&pool.t, &mut t).expect("counted free"));
        }
        self.taken += copies.len() + grow;
        drop(t);
        drop(old); // still held elsewhere (copied because of that): none is freed here
        Ok(copies)
    }

    /// The prefix-cache handles on the pages holding tokens `[from, to)` (`to` at most the
    /// tokens written): each relies on its page's rows up to `to`.
    pub fn span(&self, rows: usize, from: usize, to: usize) -> Result<PageSpan> {
        if from >= to || to.div_ceil(rows) > self.pages.len() {
            return Err(ModelError::Internal(format!("prefix capture of tokens [{from}, {to}) from a block table of {} pages of {rows}", self.pages.len())));
        }
        let pages = (from / rows..to.div_ceil(rows)).map(|k| self.pages[k].reader(to.min((k + 1) * rows) - k * rows, true)).collect();
        Ok(PageSpan { from, to, pages })
    }

    /// A new sequence's block table for tokens `[0, at)`, from `spans` that cover them in order:
    /// each page from the last span holding any of its rows (whose page holds every row of it up
    /// to that span's end: pages are append-only), by reference. Nothing is taken from the pool.
    pub fn join(spans: &[&PageSpan], rows: usize, at: usize) -> Result<PageTable> {
        let bad = |why: String| ModelError::Input(format!("prefix restore: {why}"));
        let mut end = 0;
        for s in spans {
            let want = (s.from / rows..s.to.div_ceil(rows)).len();
            if s.from != end || s.to <= s.from || s.pages.len() != want {
                return Err(bad(format!("a stored span of tokens [{}, {}) in {} pages after token {end}", s.from, s.to, s.pages.len())));
            }
            end = s.to;
        }
        if end != at {
            return Err(bad(format!("stored spans cover {end} tokens, not {at}")));
        }
        let mut pages: Vec<Option<&PageRef>> = vec![None; at.div_ceil(rows)];
        for s in spans {
            for (j, p) in s.pages.iter().enumerate() {
                pages[s.from / rows + j] = Some(p);
            }
        }
        let pages = pages.into_iter().enumerate().map(|(k, p)| p.expect("covered").reader(at.min((k + 1) * rows) - k * rows, false)).collect();
        Ok(PageTable { pages, taken: 0 })
    }
}

/// A prefix-cache cell's pages: those holding tokens `[from, to)` of the sequence it was taken
/// from (the first may start before `from`, the last end after `to`), by reference.
#[derive(Clone, Debug, PartialEq)]
pub struct PageSpan {
    pub from: usize,
    pub to: usize,
    pub pages: Vec<PageRef>,
}

impl PageSpan {
    /// Whether dropping this span would free a page (only prefix-cache handles hold it).
    pub fn frees_pages(&self) -> bool {
        self.pages.iter().any(PageRef::cache_only)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Page rows in these tests.
    const R: usize = 4;

    fn ids(t: &PageTable) -> Vec<u32> {
        t.ids().collect()
    }

    /// A page goes back to the free list when its last holder drops, whichever that is; every
    /// page in use counts once however many hold it; the cache-only ones are reclaimable.
    #[test]
    fn pages_are_freed_by_their_last_holder_and_counted_once() {
        let pool = PagePool::new(6, R);
        let mut a = PageTable::default();
        assert!(a.write(&pool, 0, 10).unwrap().is_empty());
        assert_eq!((ids(&a), a.taken(), pool.live(), pool.free()), (vec![0, 1, 2], 3, 3, 3));
        let (c0, c1) = (a.span(R, 0, 6).unwrap(), a.span(R, 6, 10).unwrap());
        assert_eq!((c0.pages.len(), c1.pages.len()), (2, 2), "page 1 holds rows of both cells");
        assert_eq!((pool.holders(0), pool.holders(1), pool.holders(2)), (2, 3, 2));
        assert_eq!((pool.live(), pool.reclaimable()), (3, 0), "shared pages count once; the sequence still holds them");
        let b = PageTable::join(&[&c0, &c1], R, 10).unwrap();
        assert_eq!((ids(&b), b.taken(), pool.live()), (vec![0, 1, 2], 0, 3), "a restore takes nothing from the pool");
        drop(a);
        assert_eq!((pool.live(), pool.reclaimable()), (3, 0), "B still holds every page");
        drop(b);
        assert_eq!((pool.live(), pool.reclaimable()), (3, 3), "only the cells hold them now");
        assert!(c1.frees_pages());
        drop(c0);
        assert_eq!((pool.live(), pool.free(), pool.holders(0)), (2, 4, 0), "page 0 was the first cell's alone");
        drop(c1);
        assert_eq!((pool.live(), pool.free(), pool.reclaimable()), (0, 6, 0));
    }

    /// The prefill that wrote a prefix appends in place after a cell took its first rows; a
    /// sequence restored inside a page copies that page before its first write and shares the
    /// whole pages before it; a rollback below the rows a cell relies on copies too.
    #[test]
    fn copy_on_write_only_where_someone_else_reads() {
        let pool = PagePool::new(10, R);
        let mut a = PageTable::default();
        a.write(&pool, 0, 6).unwrap();
        let c0 = a.span(R, 0, 6).unwrap(); // a grid of 6: the cell ends inside page 1
        assert!(a.write(&pool, 6, 12).unwrap().is_empty(), "the owner appends past the cell's rows in place");
        assert_eq!((ids(&a), a.taken()), (vec![0, 1, 2], 3));
        // B resumes at 6: pages 0 and 1 by reference; its first write copies page 1 only.
        let mut b = PageTable::join(&[&c0], R, 6).unwrap();
        assert_eq!((ids(&b), b.taken()), (vec![0, 1], 0));
        assert!(b.pages().iter().all(|p| !p.is_owner()));
        let cp = b.write(&pool, 6, 7).unwrap();
        assert_eq!(cp, vec![(1, 3)], "page 1 copied into a page of B's own");
        assert_eq!((ids(&b), b.taken()), (vec![0, 3], 1));
        assert!(b.write(&pool, 7, 9).unwrap().is_empty(), "B owns its copy: in place, then a new page");
        assert_eq!((ids(&b), b.taken()), (vec![0, 3, 4], 2));
        // B's own cell of [6, 12) is on its copy; a restore through it takes B's page 1, not A's.
        b.write(&pool, 9, 12).unwrap();
        let c1 = b.span(R, 6, 12).unwrap();
        let c = PageTable::join(&[&c0, &c1], R, 12).unwrap();
        assert_eq!(ids(&c), vec![0, 3, 4], "each page from the last cell that holds rows of it");
        // A rollback of B into page 4, below the rows its cell relies on, copies the page.
        let sealed = b.write(&pool, 10, 11).unwrap();
        assert_eq!(sealed, vec![(4, 5)]);
        drop((c, c1));
        // Held alone, a page is written in place whoever took it.
        let mut d = PageTable::join(&[&c0], R, 6).unwrap();
        drop((a, c0));
        assert_eq!(pool.holders(1), 1);
        assert!(d.write(&pool, 6, 8).unwrap().is_empty(), "page 1 is D's alone now");
        assert!(d.pages()[1].is_owner() && d.taken() == 0);
    }

    /// A write the pool cannot serve changes nothing and names the flag to raise.
    #[test]
    fn a_full_pool_is_an_error_that_changes_nothing() {
        let pool = PagePool::new(3, R);
        let mut a = PageTable::default();
        a.write(&pool, 0, 6).unwrap();
        let c0 = a.span(R, 0, 6).unwrap();
        let mut b = PageTable::join(&[&c0], R, 6).unwrap();
        let e = b.write(&pool, 6, 9).unwrap_err().to_string();
        assert!(e.contains("cache is full") && e.contains("--max-cache-tokens") && e.contains("2 needed"), "{e}");
        assert_eq!((ids(&b), b.taken(), pool.free()), (vec![0, 1], 0, 1));
        assert_eq!(b.write(&pool, 6, 8).unwrap(), vec![(1, 2)]);
    }

    #[test]
    fn spans_and_joins_check_their_tokens() {
        let pool = PagePool::new(4, R);
        let mut a = PageTable::default();
        a.write(&pool, 0, 8).unwrap();
        assert!(a.span(R, 4, 12).is_err() && a.span(R, 4, 4).is_err());
        let (c0, c1) = (a.span(R, 0, 4).unwrap(), a.span(R, 4, 8).unwrap());
        assert!(PageTable::join(&[&c1], R, 4).unwrap_err().to_string().contains("after token 0"));
        assert!(PageTable::join(&[&c0], R, 8).unwrap_err().to_string().contains("cover 4 tokens, not 8"));
        let mut cut = c1.clone();
        cut.pages.pop();
        assert!(PageTable::join(&[&c0, &cut], R, 8).is_err());
        let mut foreign = PageTable::join(&[&c0, &c1], R, 8).unwrap();
        assert!(foreign.write(&PagePool::new(4, R), 8, 9).unwrap_err().to_string().contains("another pool"));
    }
}
