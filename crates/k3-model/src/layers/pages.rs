//! Paged, reference-counted cache rows (issue 21): one sequence's MLA latent rows `[n, r + dr]`
//! or DSA indexer keys `[n, id]` (text-backbone §4, §5) as a list of pages of `page_rows` rows
//! each — every page full but the last — each an `Arc` that several sequences and the
//! engine's prefix-cache pool can hold at once.
//!
//! Append-only, and no write ever reaches a page another holder sees: appends go to the
//! sequence's own tail page (a tail page held elsewhere too is copied first: `Arc::make_mut`,
//! the copy-on-write of a sequence that diverges inside a page), and a truncation that ends
//! inside a page held elsewhere keeps a private copy of its kept rows. Reads
//! ([`PagedRows::row`], [`PagedRows::iter`]) give the rows, value for value, of the contiguous
//! `[n, w]` buffer the pages replace, so what is computed over them is unchanged bit for bit.
//!
//! Accounting: the pool holds its pages through [`StoredPage`]s, and counts their bytes
//! itself; while a page has one it is the pool's, and not charged to the sequences that share
//! it. [`PagedRows::bytes_once`] charges the other pages once per [`PageSet`], however many
//! sequences hold them. Pages are `Send + Sync`: on a parallel layout of ranks as threads the
//! ranks of one pipeline stage hold the same pages (`k3_engine::dist`), and a rank that leaves
//! the pages held elsewhere to its stage's first rank counts with [`PageSet::leaving_shared`].

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Rows per page of a state made without a prefix cache (with one: its grid).
pub const PAGE_ROWS: usize = 128;

/// One page: up to `page_rows` rows `[rows, w]`, and how many [`StoredPage`]s hold it.
#[derive(Debug, Default)]
pub struct Page {
    values: Vec<f32>,
    stored: AtomicUsize,
}

/// A copy is nobody's stored page.
impl Clone for Page {
    fn clone(&self) -> Page {
        Page { values: self.values.clone(), stored: AtomicUsize::new(0) }
    }
}

impl Page {
    pub fn new(values: Vec<f32>) -> Page {
        Page { values, stored: AtomicUsize::new(0) }
    }
    /// The rows, `[rows, w]`.
    pub fn values(&self) -> &[f32] {
        &self.values
    }
    /// Whether a store outside the sequences (the prefix-cache pool) holds it.
    pub fn is_stored(&self) -> bool {
        self.stored.load(Ordering::Relaxed) > 0
    }
}

/// A page as a store outside the sequences holds it (see the module doc).
#[derive(Debug)]
pub struct StoredPage(Arc<Page>);

impl StoredPage {
    pub fn new(page: Arc<Page>) -> StoredPage {
        page.stored.fetch_add(1, Ordering::Relaxed);
        StoredPage(page)
    }
    /// A new page of `values`, stored.
    pub fn from_values(values: Vec<f32>) -> StoredPage {
        StoredPage::new(Arc::new(Page::new(values)))
    }
    pub fn page(&self) -> &Arc<Page> {
        &self.0
    }
    pub fn values(&self) -> &[f32] {
        &self.0.values
    }
}

impl Clone for StoredPage {
    fn clone(&self) -> StoredPage {
        StoredPage::new(self.0.clone())
    }
}

impl Drop for StoredPage {
    fn drop(&mut self) {
        self.0.stored.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The pages already charged (by address), so that shared pages count once.
#[derive(Debug, Default)]
pub struct PageSet {
    seen: HashSet<usize>,
    /// Charge no page held elsewhere (another holder charges it).
    leave_shared: bool,
}

impl PageSet {
    pub fn new() -> PageSet {
        PageSet::default()
    }
    /// A set that charges only the pages nothing else holds: for a rank of a parallel layout
    /// whose shared pages are all held by another rank too, which charges them (the first rank
    /// of its pipeline stage: `k3_engine::dist::worker`).
    pub fn leaving_shared() -> PageSet {
        PageSet { seen: HashSet::new(), leave_shared: true }
    }
    /// Whether `p` is charged here: no store holds it, and it is held alone or (not leaving
    /// shared pages to another holder) seen for the first time.
    fn charges(&mut self, p: &Arc<Page>) -> bool {
        !p.is_stored() && (Arc::strong_count(p) == 1 || (!self.leave_shared && self.seen.insert(Arc::as_ptr(p) as usize)))
    }
}

/// One sequence's rows of one cache, in pages (see the module doc).
#[derive(Clone, Debug)]
pub struct PagedRows {
    /// Values per row (0 until the first rows come).
    width: usize,
    page_rows: usize,
    rows: usize,
    /// `rows.div_ceil(page_rows)` pages, all full but the last.
    pages: Vec<Arc<Page>>,
}

impl Default for PagedRows {
    fn default() -> PagedRows {
        PagedRows::with_page_rows(PAGE_ROWS)
    }
}

impl PagedRows {
    pub fn with_page_rows(page_rows: usize) -> PagedRows {
        PagedRows { width: 0, page_rows: page_rows.max(1), rows: 0, pages: Vec::new() }
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Values per row (0 before any row).
    pub fn width(&self) -> usize {
        self.width
    }
    pub fn page_rows(&self) -> usize {
        self.page_rows
    }
    pub fn pages(&self) -> &[Arc<Page>] {
        &self.pages
    }

    /// Row `s` (`s < rows`).
    pub fn row(&self, s: usize) -> &[f32] {
        let w = self.width;
        &self.pages[s / self.page_rows].values[(s % self.page_rows) * w..][..w]
    }

    /// Every row, in order.
    pub fn iter(&self) -> impl Iterator<Item = &[f32]> + '_ {
        let w = self.width.max(1);
        self.pages.iter().flat_map(move |p| p.values.chunks_exact(w))
    }

    /// The first `n` rows (`n ≤ rows`) as each page's contiguous run of them, in order.
    pub fn spans(&self, n: usize) -> impl Iterator<Item = &[f32]> + '_ {
        let (w, pr) = (self.width, self.page_rows);
        self.pages.iter().enumerate().take(n.div_ceil(pr)).map(move |(i, p)| &p.values[..(n - i * pr).min(pr) * w])
    }

    /// Rows `[a, b)` as one buffer `[b − a, w]`.
    pub fn copy_rows(&self, a: usize, b: usize) -> Vec<f32> {
        let mut v = Vec::with_capacity((b - a) * self.width);
        (a..b).for_each(|s| v.extend_from_slice(self.row(s)));
        v
    }

    /// Appends `n` rows `values` `[n, w]` (to the tail page, copied first when held
    /// elsewhere, then to new pages).
    pub fn push_rows(&mut self, values: &[f32], n: usize) {
        if n == 0 {
            return;
        }
        let w = values.len() / n;
        assert!(w * n == values.len() && w > 0 && (self.width == 0 || self.width == w), "{} values are not {n} rows of width {}", values.len(), self.width);
        self.width = w;
        let pr = self.page_rows;
        let mut rest = values;
        while !rest.is_empty() {
            let fill = self.rows % pr;
            if fill == 0 {
                self.pages.push(Arc::new(Page::new(Vec::with_capacity(pr * w))));
            }
            let take = (pr - fill).min(rest.len() / w);
            let tail = Arc::make_mut(self.pages.last_mut().expect("a tail page"));
            tail.values.extend_from_slice(&rest[..take * w]);
            rest = &rest[take * w..];
            self.rows += take;
        }
    }

    /// Appends the `n` rows of `page`: by reference when they make a whole page of this
    /// cache at a page boundary, else copied.
    pub fn push_page(&mut self, page: &Arc<Page>, n: usize) {
        let whole = n == self.page_rows && self.rows.is_multiple_of(self.page_rows) && page.values.len().is_multiple_of(n);
        let w = page.values.len().checked_div(n).unwrap_or(0);
        if whole && w > 0 && (self.width == 0 || self.width == w) {
            self.width = w;
            self.pages.push(page.clone());
            self.rows += n;
        } else {
            self.push_rows(&page.values, n);
        }
    }

    /// Keeps the first `rows` rows (a page held elsewhere that keeps only some of its rows is
    /// replaced by a private copy of them).
    pub fn truncate_rows(&mut self, rows: usize) {
        if rows >= self.rows {
            return;
        }
        let keep = rows.div_ceil(self.page_rows);
        self.pages.truncate(keep);
        let tail = (rows - keep.saturating_sub(1) * self.page_rows) * self.width;
        if let Some(last) = self.pages.last_mut().filter(|p| p.values.len() > tail) {
            match Arc::get_mut(last) {
                Some(p) => p.values.truncate(tail),
                None => *last = Arc::new(Page::new(last.values[..tail].to_vec())),
            }
        }
        self.rows = rows;
    }

    /// Bytes of the rows (shared or not).
    pub fn bytes(&self) -> usize {
        4 * self.rows * self.width
    }

    /// Bytes of the pages no [`StoredPage`] holds and `seen` has not counted yet (then
    /// counted there; see [`PageSet`]).
    pub fn bytes_once(&self, seen: &mut PageSet) -> usize {
        self.pages.iter().filter(|p| seen.charges(p)).map(|p| 4 * p.values.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, w: usize, seed: f32) -> Vec<f32> {
        (0..n * w).map(|i| seed + i as f32).collect()
    }

    /// Reads across pages give the contiguous buffer's rows for every cut of the appends.
    #[test]
    fn pages_read_as_the_contiguous_rows() {
        let (w, all) = (3, rows(23, 3, 0.5));
        for pr in [1, 4, 5, 23, 64] {
            for cut in [0, 1, 4, 9, 23] {
                let mut p = PagedRows::with_page_rows(pr);
                p.push_rows(&all[..cut * w], cut);
                p.push_rows(&all[cut * w..], 23 - cut);
                assert_eq!((p.rows(), p.pages().len()), (23, 23usize.div_ceil(pr)));
                assert_eq!(p.iter().flatten().copied().collect::<Vec<_>>(), all);
                assert!((0..23).all(|s| p.row(s) == &all[s * w..(s + 1) * w]));
                assert_eq!(p.copy_rows(5, 11), all[5 * w..11 * w]);
                for n in [0, 1, 5, 17, 23] {
                    assert_eq!(p.spans(n).flatten().copied().collect::<Vec<_>>(), all[..n * w], "spans({n})");
                }
                p.truncate_rows(10);
                assert_eq!(p.iter().flatten().copied().collect::<Vec<_>>(), all[..10 * w]);
                p.push_rows(&all[10 * w..], 13);
                assert_eq!(p.copy_rows(0, 23), all, "page rows {pr}, cut {cut}");
            }
        }
    }

    /// Two holders of one partly filled page: each one's append and truncation copies it, and
    /// the other's rows stay as they were.
    #[test]
    fn a_write_into_a_shared_page_copies_it() {
        let w = 2;
        let mut a = PagedRows::with_page_rows(4);
        a.push_rows(&rows(6, w, 0.0), 6); // pages: 4 rows + 2 rows
        let mut b = a.clone();
        assert!(a.pages().iter().zip(b.pages()).all(|(x, y)| Arc::ptr_eq(x, y)));
        b.push_rows(&rows(1, w, 100.0), 1);
        assert!(Arc::ptr_eq(&a.pages()[0], &b.pages()[0]), "the full page stays shared");
        assert!(!Arc::ptr_eq(&a.pages()[1], &b.pages()[1]), "the tail page is copied on write");
        assert_eq!(a.copy_rows(0, 6), rows(6, w, 0.0), "the other holder's rows are untouched");
        assert_eq!(b.row(6), &[100.0, 101.0]);
        // A truncation into a shared full page keeps a private copy of the kept rows.
        let mut c = a.clone();
        c.truncate_rows(3);
        assert!(!Arc::ptr_eq(&a.pages()[0], &c.pages()[0]));
        assert_eq!((a.rows(), a.copy_rows(0, 6)), (6, rows(6, w, 0.0)));
        c.push_rows(&rows(1, w, -9.0), 1);
        assert_eq!(a.row(3), &rows(6, w, 0.0)[6..8]);
        // A private page is cut in place.
        let before = Arc::as_ptr(&b.pages()[1]);
        b.truncate_rows(5);
        assert_eq!((Arc::as_ptr(&b.pages()[1]), b.rows()), (before, 5));
    }

    /// Whole pages are shared by reference; shared pages are charged once, stored ones not at all.
    #[test]
    fn shared_pages_are_charged_once() {
        let w = 2;
        let mut a = PagedRows::with_page_rows(4);
        a.push_rows(&rows(10, w, 0.0), 10);
        let mut b = PagedRows::with_page_rows(4);
        b.push_page(&a.pages()[0], 4);
        b.push_page(&a.pages()[1], 4);
        b.push_page(&a.pages()[2], 2); // a partial page: copied
        assert!(Arc::ptr_eq(&a.pages()[1], &b.pages()[1]) && !Arc::ptr_eq(&a.pages()[2], &b.pages()[2]));
        assert_eq!(b.copy_rows(0, 10), a.copy_rows(0, 10));
        let mut seen = PageSet::new();
        let both = a.bytes_once(&mut seen) + b.bytes_once(&mut seen);
        assert_eq!(both, 4 * w * (10 + 2), "two shared pages counted once");
        let stored: Vec<StoredPage> = a.pages()[..2].iter().cloned().map(StoredPage::new).collect();
        let mut seen = PageSet::new();
        assert_eq!(a.bytes_once(&mut seen) + b.bytes_once(&mut seen), 4 * w * (2 + 2), "the stored pages are the pool's");
        drop(stored);
        assert_eq!(a.bytes_once(&mut PageSet::new()), a.bytes());
        // A holder that leaves shared pages to another charges only its own: the two holders
        // together charge every page once.
        let (mut first, mut other) = (PageSet::new(), PageSet::leaving_shared());
        assert_eq!(b.bytes_once(&mut other), 4 * w * 2, "b's own partial page only");
        assert_eq!(a.bytes_once(&mut first) + b.bytes_once(&mut other), 4 * w * (10 + 2));
    }

    /// Threads holding one page (the ranks of a stage): each one's append copies it, and the
    /// page's rows stay as they were for the others.
    #[test]
    fn holders_on_threads_copy_on_write() {
        let w = 2;
        let mut a = PagedRows::with_page_rows(4);
        a.push_rows(&rows(4, w, 0.0), 4);
        let stored = StoredPage::new(a.pages()[0].clone());
        let copies: Vec<PagedRows> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|t| {
                    let mut mine = PagedRows::with_page_rows(4);
                    mine.push_page(stored.page(), 4);
                    s.spawn(move || {
                        mine.truncate_rows(3); // into the shared page: a private copy
                        mine.push_rows(&rows(2, w, 10.0 * (t + 1) as f32), 2);
                        mine
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(stored.values(), rows(4, w, 0.0), "the stored page is untouched");
        for (t, c) in copies.iter().enumerate() {
            assert!(!Arc::ptr_eq(&c.pages()[0], stored.page()));
            assert_eq!(c.copy_rows(0, 3), rows(3, w, 0.0));
            assert_eq!(c.copy_rows(3, 5), rows(2, w, 10.0 * (t + 1) as f32));
        }
    }
}
