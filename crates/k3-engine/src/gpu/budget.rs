//! The GPU runner's admission accounting (`gpu.rs`): the fixed latent cache's pages in use —
//! each counted once however many sequences and prefix-cache cells hold it
//! (`k3_model::device_pages`) — plus the pages promised to admitted sequences and not taken yet.
//! A sequence is promised its worst case (prompt + `max_tokens`, capped at the context limit)
//! less the whole pages of the prefix it resumes past: those it holds by reference and never
//! writes (the page its resume point cuts, it copies on its first write, so that one stays
//! promised). So a step never runs out of pages half-way. Pure accounting, no device.

use std::collections::HashMap;

use crate::engine::SeqId;

/// Pages of the GPU cache in use and promised (see the module doc).
#[derive(Clone, Debug)]
pub struct CacheBudget {
    page: usize,
    total: usize,
    /// Pages each admitted sequence may take from the pool over its life.
    promised: HashMap<SeqId, usize>,
}

impl CacheBudget {
    /// A cache of `tokens` tokens in pages of `page` tokens.
    pub fn new(tokens: usize, page: usize) -> Self {
        let page = page.max(1);
        CacheBudget { page, total: tokens.div_ceil(page), promised: HashMap::new() }
    }
    /// Pages a sequence of `tokens` tokens needs.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page)
    }
    /// Whether a sequence of `tokens` tokens fits in the empty cache.
    pub fn fits_ever(&self, tokens: usize) -> bool {
        self.pages_for(tokens) <= self.total
    }
    /// Pages a sequence of up to `tokens` tokens takes from the pool when it resumes past the
    /// first `shared` (held by reference).
    pub fn need(&self, tokens: usize, shared: usize) -> usize {
        self.pages_for(tokens).saturating_sub(shared / self.page)
    }
    /// Whether a sequence of up to `tokens` tokens resuming past `shared` fits beside `live`
    /// pages in use and what the admitted sequences were promised and have not taken yet
    /// (`taken`: the pages each took so far).
    pub fn fits(&self, tokens: usize, shared: usize, live: usize, taken: impl Fn(SeqId) -> usize) -> bool {
        let owed: usize = self.promised.iter().map(|(&s, &p)| p.saturating_sub(taken(s))).sum();
        live + owed + self.need(tokens, shared) <= self.total
    }
    /// Admits sequence `id` when it [fits](CacheBudget::fits); whether it did.
    pub fn try_admit(&mut self, id: SeqId, tokens: usize, shared: usize, live: usize, taken: impl Fn(SeqId) -> usize) -> bool {
        let fits = self.fits(tokens, shared, live, taken);
        if fits {
            self.promised.insert(id, self.need(tokens, shared));
        }
        fits
    }
    /// Forgets a finished sequence's promise (its pages go back with its state).
    pub fn release(&mut self, id: SeqId) {
        self.promised.remove(&id);
    }
    /// Capacity in tokens.
    pub fn tokens(&self) -> usize {
        self.total * self.page
    }
}

#[cfg(test)]
mod tests {
    use super::CacheBudget;
    use k3_model::device_pages::{PagePool, PageTable};
    use std::collections::HashMap;

    #[test]
    fn cache_budget_counts_whole_pages() {
        let b = CacheBudget::new(640, 64); // 10 pages
        assert_eq!((b.pages_for(1), b.pages_for(64), b.pages_for(65)), (1, 1, 2));
        assert!(b.fits_ever(640) && !b.fits_ever(641));
        assert_eq!((b.need(300, 0), b.need(300, 128), b.need(300, 130), b.need(300, 127)), (5, 3, 3, 4));
        assert_eq!(b.tokens(), 640);
    }

    /// Sequences resumed from one cached prefix are promised their own pages only: the shared
    /// ones count once, as pages in use. Each then takes exactly what it was promised at most —
    /// the copy of the page its resume point cuts included — so the pool never runs dry.
    #[test]
    fn shared_prefix_pages_count_once_and_promises_hold() {
        let rows = 4;
        let pool = PagePool::new(10, rows);
        let mut b = CacheBudget::new(10 * rows, rows);
        let mut tables: HashMap<u64, PageTable> = HashMap::new();
        let taken = |t: &HashMap<u64, PageTable>| t.iter().map(|(&k, v)| (k, v.taken())).collect::<HashMap<_, _>>();
        // A prefills 8 tokens (2 pages) of a 20-token worst case; the cache takes its 2 cells.
        assert!(b.try_admit(1, 20, 0, pool.live(), |_| 0));
        let mut a = PageTable::default();
        a.write(&pool, 0, 8).unwrap();
        let cells = [a.span(rows, 0, 4).unwrap(), a.span(rows, 4, 8).unwrap()];
        tables.insert(1, a);
        let t = taken(&tables);
        assert!(!b.try_admit(9, 40, 0, pool.live(), |s| t[&s]), "A still has 3 pages coming: 2 + 3 + 10 > 10");
        b.release(1);
        tables.remove(&1);
        assert_eq!(pool.live(), 2, "the cells hold A's pages");
        // B and C resume past those 8 tokens with a 24-token worst case: 4 pages each, not 6.
        for id in [2, 3] {
            let t = taken(&tables);
            assert!(b.try_admit(id, 24, 8, pool.live(), |s| t[&s]), "sequence {id}: 2 + 4 + 4 ≤ 10");
            tables.insert(id, PageTable::join(&[&cells[0], &cells[1]], rows, 8).unwrap());
        }
        let t = taken(&tables);
        assert!(!b.try_admit(4, 24, 8, pool.live(), |s| t[&s]), "a third does not fit: 2 + 8 + 4 > 10");
        for id in [2, 3] {
            let tab = tables.get_mut(&id).unwrap();
            tab.write(&pool, 8, 24).unwrap();
            assert_eq!(tab.taken(), 4);
        }
        assert_eq!((pool.live(), pool.free()), (10, 0), "every promised page was there");
        // A resume point inside a page: its page is copied, and was promised.
        b.release(2);
        b.release(3);
        tables.clear();
        let cut = {
            let mut d = PageTable::default();
            assert!(b.try_admit(5, 8, 0, pool.live(), |_| 0));
            d.write(&pool, 0, 6).unwrap();
            b.release(5);
            d.span(rows, 0, 6).unwrap()
        };
        assert_eq!(b.need(16, 6), 3);
        assert!(b.try_admit(6, 16, 6, pool.live(), |_| 0));
        let mut e = PageTable::join(&[&cut], rows, 6).unwrap();
        assert_eq!(e.write(&pool, 6, 16).unwrap().len(), 1, "the cut page is copied");
        assert_eq!(e.taken(), b.need(16, 6), "and the copy was promised");
    }
}
