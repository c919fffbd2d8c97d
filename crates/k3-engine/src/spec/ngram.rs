//! Prompt-lookup drafting (n-gram matching, no weights): find the most recent earlier place
//! where the context's last `n` tokens occur (n from [`MAX_N`] down to [`MIN_N`]) and propose
//! the tokens that followed it there. Cost per step: one backward scan of the context, O(L·n)
//! in the worst case (L = prompt + output tokens). Repetitive text — a passage the model
//! reproduces, a chat re-quoting earlier turns — is where it drafts well.

use super::{Draft, Proposer};

/// Longest n-gram tried first.
pub const MAX_N: usize = 4;
/// Shortest n-gram that may match (1 would match almost anything).
pub const MIN_N: usize = 2;

#[derive(Clone, Debug, Default)]
pub struct NgramProposer;

/// The continuation after the latest earlier occurrence of `ctx`'s last n-gram, for the
/// longest n in `min_n..=max_n` that occurs; up to `k` tokens.
pub fn lookup(ctx: &[u32], k: usize, min_n: usize, max_n: usize) -> Vec<u32> {
    let len = ctx.len();
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let tail = &ctx[len - n..];
        // Latest start s < len − n with ctx[s..s+n] == tail (and something after it).
        for s in (0..len - n).rev() {
            if &ctx[s..s + n] == tail {
                let from = s + n;
                let to = (from + k).min(len);
                return ctx[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

impl Proposer for NgramProposer {
    fn propose(&mut self, context: &[u32], k: usize) -> Draft {
        Draft { tokens: lookup(context, k, MIN_N, MAX_N), probs: None }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_latest_longest_match() {
        // "1 2 3 9 9 | 1 2 3 7 8 | 1 2 3" → the latest occurrence of [1 2 3] is followed by 7 8.
        let ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(lookup(&ctx, 2, 2, 4), vec![7, 8]);
        assert_eq!(lookup(&ctx, 5, 2, 4), vec![7, 8, 1, 2, 3]);
        // No repeated bigram: nothing.
        assert!(lookup(&[1, 2, 3, 4], 3, 2, 4).is_empty());
        // A longer n wins over a more recent shorter one: [5 6 7] occurred at 0, [6 7] at 4.
        assert_eq!(lookup(&[5, 6, 7, 1, 6, 7, 2, 5, 6, 7], 1, 2, 4), vec![1]);
    }
}
