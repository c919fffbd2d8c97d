//! A small least-recently-used cache of per-grid tables, bounded by bytes: the tower's resized
//! position rows (around-backbone §3.2; `tower.rs`) on the host and, with the `cuda` feature,
//! their uploaded copies on the GPU (`cuda.rs`). Images of one size share one entry, so a call of
//! eight 1024² images computes (and uploads) the `[74·74, C]` rows once instead of eight times.
//!
//! Shape legend: a key is a sample's grid `[t, h, w]`; an entry is that sample's rows `[t·h·w, C]`
//! (what is added to its patch embeddings), `bytes` its size.

use std::sync::{Mutex, MutexGuard};

/// The guard of `m`, also after a panic elsewhere poisoned it (the caches stay consistent:
/// every update is one push or remove).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bytes of cached rows a tower keeps per cache (host and GPU each): 256 MiB holds the rows of
/// about eleven 1024² image sizes at C = 1024 (22.4 MB each); an entry larger than the cap is
/// computed per call and not kept.
pub const ROW_CACHE_BYTES: usize = 256 << 20;

pub struct RowCache<T> {
    /// Least recently used first.
    entries: Vec<([usize; 3], T, usize)>,
    bytes: usize,
    cap: usize,
}

impl<T: Clone> RowCache<T> {
    pub fn new(cap: usize) -> RowCache<T> {
        RowCache { entries: Vec::new(), bytes: 0, cap }
    }

    /// The entry of `key`, now the most recently used.
    pub fn get(&mut self, key: [usize; 3]) -> Option<T> {
        let i = self.entries.iter().position(|e| e.0 == key)?;
        let e = self.entries.remove(i);
        let v = e.1.clone();
        self.entries.push(e);
        Some(v)
    }

    /// Keeps `value` (of `bytes`) under `key` unless it alone is over the cap, dropping the
    /// least recently used entries until the total fits.
    pub fn insert(&mut self, key: [usize; 3], value: T, bytes: usize) {
        if bytes > self.cap {
            return;
        }
        if let Some(i) = self.entries.iter().position(|e| e.0 == key) {
            self.bytes -= self.entries.remove(i).2;
        }
        while self.bytes + bytes > self.cap && !self.entries.is_empty() {
            self.bytes -= self.entries.remove(0).2;
        }
        self.entries.push((key, value, bytes));
        self.bytes += bytes;
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Keys held, least recently used first.
    pub fn keys(&self) -> Vec<[usize; 3]> {
        self.entries.iter().map(|e| e.0).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_within_the_byte_cap() {
        let mut c = RowCache::new(100);
        c.insert([1, 1, 1], 'a', 40);
        c.insert([1, 1, 2], 'b', 40);
        assert_eq!(c.get([1, 1, 1]), Some('a'));
        c.insert([1, 2, 1], 'c', 40);
        assert_eq!(c.keys(), vec![[1, 1, 1], [1, 2, 1]], "b was the least recently used");
        assert_eq!(c.bytes(), 80);
        c.insert([2, 1, 1], 'd', 101);
        assert_eq!((c.get([2, 1, 1]), c.bytes()), (None, 80), "an entry over the cap is not kept");
        c.insert([1, 2, 1], 'e', 70);
        assert_eq!((c.keys(), c.get([1, 2, 1]), c.bytes()), (vec![[1, 2, 1]], Some('e'), 70), "a key inserted again replaces its entry");
    }
}
