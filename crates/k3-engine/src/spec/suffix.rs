//! Suffix drafting (SuffixDecoding-style, no weights): a suffix automaton over this request's
//! tokens (prompt + output, extended as they arrive) and one over the engine's finished
//! requests (their prompts and outputs, separated; shared by all sequences, bounded). A step
//! drafts what followed the longest suffix of the context that occurs earlier — in the request
//! itself or in the history, whichever match is longer — and drafts more after a longer match
//! (up to `2 · match length`, at most k).
//!
//! The automaton: states with `len`, suffix `link`, transitions (a short sorted list), and the
//! first end position of each state's strings, built online in amortised O(1) per token
//! (Blumer et al.). In the request's own automaton the longest suffix that occurs earlier is
//! the suffix link of the last state; against the history the context's last [`WINDOW`] tokens
//! are walked as matching statistics.

use std::sync::{Arc, Mutex};

use super::{Draft, Proposer};

/// Separates requests in the history.
const SEP: u32 = u32::MAX;
/// Tokens of the context matched against the history.
pub const WINDOW: usize = 32;
/// Shortest match that drafts.
pub const MIN_MATCH: usize = 2;
/// History tokens kept (a suffix automaton has at most twice as many states); past this the
/// history starts over.
pub const HISTORY_CAP: usize = 1 << 18;

#[derive(Clone, Debug)]
struct State {
    len: u32,
    link: u32,
    first_end: u32,
    /// (token, state), sorted by token.
    next: Vec<(u32, u32)>,
}

/// A suffix automaton over a token string.
#[derive(Clone, Debug)]
pub struct SuffixIndex {
    tokens: Vec<u32>,
    st: Vec<State>,
    last: u32,
}

impl Default for SuffixIndex {
    fn default() -> Self {
        SuffixIndex { tokens: Vec::new(), st: vec![State { len: 0, link: u32::MAX, first_end: 0, next: Vec::new() }], last: 0 }
    }
}

impl SuffixIndex {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    fn go(&self, s: u32, c: u32) -> Option<u32> {
        let n = &self.st[s as usize].next;
        n.binary_search_by_key(&c, |e| e.0).ok().map(|i| n[i].1)
    }
    fn set(&mut self, s: u32, c: u32, to: u32) {
        let n = &mut self.st[s as usize].next;
        match n.binary_search_by_key(&c, |e| e.0) {
            Ok(i) => n[i].1 = to,
            Err(i) => n.insert(i, (c, to)),
        }
    }

    /// Appends one token.
    pub fn push(&mut self, c: u32) {
        let pos = self.tokens.len() as u32;
        self.tokens.push(c);
        let cur = self.st.len() as u32;
        self.st.push(State { len: self.st[self.last as usize].len + 1, link: 0, first_end: pos, next: Vec::new() });
        let mut p = self.last;
        while p != u32::MAX && self.go(p, c).is_none() {
            self.set(p, c, cur);
            p = self.st[p as usize].link;
        }
        if p != u32::MAX {
            let q = self.go(p, c).unwrap_or(0);
            if self.st[p as usize].len + 1 == self.st[q as usize].len {
                self.st[cur as usize].link = q;
            } else {
                let clone = self.st.len() as u32;
                let mut cl = self.st[q as usize].clone();
                cl.len = self.st[p as usize].len + 1;
                self.st.push(cl);
                while p != u32::MAX && self.go(p, c) == Some(q) {
                    self.set(p, c, clone);
                    p = self.st[p as usize].link;
                }
                self.st[q as usize].link = clone;
                self.st[cur as usize].link = clone;
            }
        }
        self.last = cur;
    }

    /// The longest suffix of the whole string that also ends earlier: (end of its first
    /// occurrence, length).
    pub fn repeated_suffix(&self) -> Option<(usize, usize)> {
        let l = self.st[self.last as usize].link;
        if l == u32::MAX || l == 0 {
            return None;
        }
        let s = &self.st[l as usize];
        Some((s.first_end as usize, s.len as usize))
    }

    /// The longest suffix of `ctx` occurring in this string: (end of its first occurrence, length).
    pub fn longest_match(&self, ctx: &[u32]) -> Option<(usize, usize)> {
        let (mut s, mut l) = (0u32, 0usize);
        for &c in ctx {
            while s != 0 && self.go(s, c).is_none() {
                s = self.st[s as usize].link;
                l = self.st[s as usize].len as usize;
            }
            match self.go(s, c) {
                Some(t) => {
                    s = t;
                    l += 1;
                }
                None => l = 0,
            }
        }
        (l > 0).then(|| (self.st[s as usize].first_end as usize, l))
    }

    /// Up to `k` tokens after position `end`, stopping at a request separator.
    pub fn after(&self, end: usize, k: usize) -> Vec<u32> {
        self.tokens[(end + 1).min(self.tokens.len())..].iter().take(k).take_while(|&&t| t != SEP).copied().collect()
    }
}

/// Finished requests' tokens, shared by the sequences of one engine.
pub type History = Arc<Mutex<SuffixIndex>>;

/// Adds a finished request (prompt then output) to the history.
pub fn remember(h: &History, prompt: &[u32], output: &[u32]) {
    let Ok(mut g) = h.lock() else { return };
    if g.len() + prompt.len() + output.len() + 1 > HISTORY_CAP {
        *g = SuffixIndex::default();
    }
    for &t in prompt.iter().chain(output) {
        g.push(t);
    }
    g.push(SEP);
}

pub struct SuffixProposer {
    own: SuffixIndex,
    history: Option<History>,
}

impl SuffixProposer {
    pub fn new(history: Option<History>) -> Self {
        SuffixProposer { own: SuffixIndex::default(), history }
    }
}

impl Proposer for SuffixProposer {
    fn propose(&mut self, context: &[u32], k: usize) -> Draft {
        for &t in &context[self.own.len().min(context.len())..] {
            self.own.push(t);
        }
        let mut best: Option<(usize, Vec<u32>)> = None;
        if let Some((end, l)) = self.own.repeated_suffix() {
            best = Some((l, self.own.after(end, k.min(2 * l))));
        }
        if let Some(h) = &self.history {
            if let Ok(g) = h.lock() {
                let w = &context[context.len().saturating_sub(WINDOW)..];
                if let Some((end, l)) = g.longest_match(w) {
                    if best.as_ref().is_none_or(|b| l > b.0) {
                        best = Some((l, g.after(end, k.min(2 * l))));
                    }
                }
            }
        }
        match best {
            Some((l, toks)) if l >= MIN_MATCH => Draft { tokens: toks, probs: None },
            _ => Draft::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: longest suffix of `s` that also ends earlier, and its first end.
    fn naive_repeated(s: &[u32]) -> Option<(usize, usize)> {
        let n = s.len();
        for l in (1..n).rev() {
            let suf = &s[n - l..];
            if let Some(e) = (l - 1..n - 1).find(|&e| &s[e + 1 - l..=e] == suf) {
                return Some((e, l));
            }
        }
        None
    }

    #[test]
    fn repeated_suffix_matches_brute_force() {
        let mut x = 7u64;
        for alpha in [2u64, 3, 5] {
            let mut idx = SuffixIndex::default();
            let mut s = Vec::new();
            for _ in 0..120 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let c = ((x >> 33) % alpha) as u32;
                s.push(c);
                idx.push(c);
                assert_eq!(idx.repeated_suffix(), naive_repeated(&s), "{s:?}");
            }
        }
    }

    #[test]
    fn drafts_from_request_and_history() {
        let h: History = Arc::new(Mutex::new(SuffixIndex::default()));
        remember(&h, &[10, 11, 12, 13, 14, 15, 16], &[17, 18]);
        let mut p = SuffixProposer::new(Some(h));
        // Only the history holds [12 13]: it drafts what followed (up to 2 · 2 tokens).
        assert_eq!(p.propose(&[1, 2, 12, 13], 8).tokens, vec![14, 15, 16, 17]);
        // The request repeats itself: [1 2 12 13 5 6 | 1 2 12 13] → 5 6 ... (own match is longer).
        assert_eq!(p.propose(&[1, 2, 12, 13, 5, 6, 1, 2, 12, 13], 3).tokens, vec![5, 6, 1]);
        // No match of length ≥ 2: nothing.
        assert!(SuffixProposer::new(None).propose(&[1, 2, 3], 4).tokens.is_empty());
        // A draft never runs past a request's end into the next.
        let h2: History = Arc::new(Mutex::new(SuffixIndex::default()));
        remember(&h2, &[4, 5], &[6]);
        remember(&h2, &[7], &[8]);
        assert_eq!(SuffixProposer::new(Some(h2)).propose(&[4, 5], 8).tokens, vec![6]);
    }
}
