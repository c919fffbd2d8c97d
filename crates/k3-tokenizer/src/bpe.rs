//! Rank-based byte-pair encoding, tiktoken's algorithm (spec §6.1).
//!
//! There is no merges list: a word's bytes start as single-byte parts, and the adjacent pair whose
//! concatenation has the lowest rank is merged, the leftmost pair winning ties, until no adjacent
//! pair is a token. A word that is itself a token is returned at once. Short words use a simple
//! quadratic scan over a small array; long words (such as the 25,000-character runs the pre-split
//! allows) use a heap over a linked list, which picks the same pair at every step in
//! `O(n log n)`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Words at least this long (in bytes) take the heap-based merge.
const HEAP_THRESHOLD: usize = 96;

/// A small, fast multiplicative hasher for byte-string keys (FxHash style).
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// A `HashMap` with [`FxHasher`].
pub(crate) type FxHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// The mergeable ranks: token bytes → rank, plus a direct table for single bytes.
#[derive(Debug, Clone)]
pub(crate) struct Bpe {
    ranks: FxHashMap<Vec<u8>, u32>,
    byte_rank: [u32; 256],
}

impl Bpe {
    /// Builds from a complete rank map; `byte_rank[b]` must be the rank of the token `[b]`.
    pub(crate) fn new(ranks: FxHashMap<Vec<u8>, u32>, byte_rank: [u32; 256]) -> Self {
        Bpe { ranks, byte_rank }
    }

    #[inline]
    fn rank(&self, bytes: &[u8]) -> u32 {
        self.ranks.get(bytes).copied().unwrap_or(u32::MAX)
    }

    /// Appends the tokens of one pre-token `word` to `out`.
    pub(crate) fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        match word.len() {
            0 => {}
            1 => out.push(self.byte_rank[word[0] as usize]),
            _ => {
                if let Some(&r) = self.ranks.get(word) {
                    out.push(r);
                } else if word.len() < HEAP_THRESHOLD {
                    self.merge_small(word, out);
                } else {
                    self.merge_large(word, out);
                }
            }
        }
    }

    /// Quadratic merge over an array of part boundaries (fast for short words).
    fn merge_small(&self, word: &[u8], out: &mut Vec<u32>) {
        // bounds[i] = start of part i; pair_rank[i] = rank of parts i and i+1 joined.
        let n = word.len();
        let mut bounds: Vec<usize> = (0..=n).collect();
        let mut pair_rank: Vec<u32> = (0..n).map(|i| if i + 2 <= n { self.rank(&word[i..i + 2]) } else { u32::MAX }).collect();
        loop {
            let mut best = (u32::MAX, 0usize);
            for (i, &r) in pair_rank.iter().enumerate() {
                if r < best.0 {
                    best = (r, i);
                }
            }
            if best.0 == u32::MAX {
                break;
            }
            let i = best.1;
            bounds.remove(i + 1);
            pair_rank.remove(i + 1);
            let parts = bounds.len() - 1;
            pair_rank[i] = if i + 2 <= parts { self.rank(&word[bounds[i]..bounds[i + 2]]) } else { u32::MAX };
            if i > 0 {
                pair_rank[i - 1] = self.rank(&word[bounds[i - 1]..bounds[i + 1]]);
            }
        }
        for w in bounds.windows(2) {
            out.push(self.token_rank(&word[w[0]..w[1]]));
        }
    }

    /// Heap-based merge (`O(n log n)`) for long words; same choices as [`Bpe::merge_small`].
    fn merge_large(&self, word: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        let n = word.len();
        // Parts are identified by their start offset; next[s] is the start of the following part.
        let mut next: Vec<usize> = (1..=n).collect();
        let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
        let mut alive = vec![true; n];
        // Heap entries: (rank, left start, right start, end of right part).
        let mut heap: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            let r = self.rank(&word[i..i + 2]);
            if r != u32::MAX {
                heap.push(Reverse((r, i, i + 1, i + 2)));
            }
        }
        while let Some(Reverse((_, left, right, end))) = heap.pop() {
            if !alive[left] || next[left] != right || right >= n || !alive[right] || next[right] != end {
                continue; // stale entry
            }
            alive[right] = false;
            next[left] = end;
            if end < n {
                prev[end] = left;
                let after = next[end];
                let r = self.rank(&word[left..after]);
                if r != u32::MAX {
                    heap.push(Reverse((r, left, end, after)));
                }
            }
            let before = prev[left];
            if before != NONE {
                let r = self.rank(&word[before..end]);
                if r != u32::MAX {
                    heap.push(Reverse((r, before, left, end)));
                }
            }
        }
        let mut s = 0;
        while s < n {
            let e = next[s];
            out.push(self.token_rank(&word[s..e]));
            s = e;
        }
    }

    /// The rank of a part that the merge produced (always a token, or a single byte).
    #[inline]
    fn token_rank(&self, part: &[u8]) -> u32 {
        if part.len() == 1 {
            self.byte_rank[part[0] as usize]
        } else {
            self.rank(part)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Bpe {
        let mut ranks: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        let mut byte_rank = [0u32; 256];
        for b in 0..=255u8 {
            byte_rank[b as usize] = b as u32;
            ranks.insert(vec![b], b as u32);
        }
        for (i, t) in ["ab", "bc", "abc", "cd", "abcd", "aa", "aaaa"].iter().enumerate() {
            ranks.insert(t.as_bytes().to_vec(), 256 + i as u32);
        }
        Bpe::new(ranks, byte_rank)
    }

    #[test]
    fn small_and_large_merges_agree() {
        let bpe = toy();
        let mut rng = 0x1234_5678u64;
        for len in [2usize, 5, 17, 95, 96, 97, 300, 1000] {
            for _ in 0..20 {
                let word: Vec<u8> = (0..len)
                    .map(|_| {
                        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        b"abcd"[(rng >> 33) as usize % 4]
                    })
                    .collect();
                let (mut a, mut b) = (Vec::new(), Vec::new());
                bpe.merge_small(&word, &mut a);
                bpe.merge_large(&word, &mut b);
                assert_eq!(a, b, "{}", String::from_utf8_lossy(&word));
            }
        }
    }

    #[test]
    fn lowest_rank_first_leftmost_on_ties() {
        let bpe = toy();
        let mut out = Vec::new();
        bpe.encode_word(b"abcd", &mut out);
        assert_eq!(out, vec![260]); // whole word is a token
        out.clear();
        bpe.encode_word(b"aaaaa", &mut out);
        assert_eq!(out, vec![262, b'a' as u32]); // aa|aa|a -> aaaa|a
        out.clear();
        bpe.encode_word(b"bcab", &mut out);
        assert_eq!(out, vec![256 + 1, 256]); // "bc" then "ab" (both mergeable, no "bcab")
    }
}
