//! The GPU runner's admission accounting (`gpu.rs`): pages of the fixed latent cache promised to
//! admitted sequences, each its worst case (prompt + `max_tokens`, capped at the context limit).
//! Pure accounting, no device.

/// Pages of the GPU cache promised to admitted sequences (pure accounting, no device).
#[derive(Clone, Debug)]
pub struct CacheBudget {
    page: usize,
    total: usize,
    reserved: usize,
}

impl CacheBudget {
    /// A cache of `tokens` tokens in pages of `page` tokens.
    pub fn new(tokens: usize, page: usize) -> Self {
        let page = page.max(1);
        CacheBudget { page, total: tokens.div_ceil(page), reserved: 0 }
    }
    /// Pages a sequence of `tokens` tokens needs.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.page)
    }
    /// Whether a sequence of `tokens` tokens fits in the empty cache.
    pub fn fits_ever(&self, tokens: usize) -> bool {
        self.pages_for(tokens) <= self.total
    }
    /// Reserves room for `tokens` tokens; the pages reserved, or `None` when they are not free now.
    pub fn try_reserve(&mut self, tokens: usize) -> Option<usize> {
        let p = self.pages_for(tokens);
        (self.reserved + p <= self.total).then(|| {
            self.reserved += p;
            p
        })
    }
    /// Returns a finished sequence's reservation.
    pub fn release(&mut self, pages: usize) {
        self.reserved = self.reserved.saturating_sub(pages);
    }
    /// Capacity in tokens.
    pub fn tokens(&self) -> usize {
        self.total * self.page
    }
}

#[cfg(test)]
mod tests {
    use super::CacheBudget;

    #[test]
    fn cache_budget_reserves_whole_pages_and_releases() {
        let mut b = CacheBudget::new(640, 64); // 10 pages
        assert_eq!(b.pages_for(1), 1);
        assert_eq!(b.pages_for(64), 1);
        assert_eq!(b.pages_for(65), 2);
        assert!(b.fits_ever(640) && !b.fits_ever(641));
        assert_eq!(b.try_reserve(300), Some(5));
        assert_eq!(b.try_reserve(300), Some(5));
        assert_eq!(b.try_reserve(1), None, "the cache is fully promised");
        b.release(5);
        assert_eq!(b.try_reserve(320), Some(5));
        assert_eq!(b.tokens(), 640);
    }
}
