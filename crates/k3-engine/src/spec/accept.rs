//! Accepting drafted tokens against the target model's logits, one position at a time.
//!
//! Greedy (`temperature = 0`): the target's choice at the position — exactly what plain
//! decoding samples, penalties included — and the draft is accepted iff it is that token, so
//! the output is plain greedy decoding's.
//!
//! Sampling: standard speculative rejection sampling. With `p` the target distribution at the
//! position (after penalties, temperature, top-k/p, min-p: `Sampler::distribution`) and `q` the
//! draft's (one-hot at `d` for a deterministic proposer): accept `d` with probability
//! `min(1, p(d)/q(d))`; on rejection draw from `max(p − q, 0)` normalised — for a one-hot `q`,
//! `p` with `d` zeroed. Every emitted token is then distributed as `p` (Leviathan et al. 2023;
//! Chen et al. 2023), so speculative sampling has plain sampling's distribution, though not its
//! random stream (a seed gives other, equally distributed tokens). Log-probabilities reported
//! are those of the raw logits, as in plain sampling.

use crate::sampler::{argmax, log_softmax, Sampled, Sampler};

/// Decides draft `d` at one position. `logits` are the target's raw logits there, `prompt` and
/// `output` the tokens before it (the output including the drafts accepted before this one),
/// `q` the draft distribution (None: one-hot at `d`). Returns whether `d` was accepted and the
/// token emitted at this position (`d` itself when accepted).
pub fn decide(sampler: &mut Sampler, logits: &[f32], prompt: &[u32], output: &[u32], d: u32, q: Option<&[f32]>) -> (bool, Sampled) {
    if sampler.params.temperature == 0.0 {
        let s = sampler.sample(logits, prompt, output);
        return (s.token == d, s);
    }
    let raw_lp = log_softmax(logits);
    let mut l = logits.to_vec();
    sampler.apply_penalties(&mut l, prompt, output);
    let p = sampler.distribution(&l);
    let di = d as usize;
    let pd = p.get(di).copied().unwrap_or(0.0);
    let qd = q.map_or(1.0, |q| q.get(di).copied().unwrap_or(0.0));
    let u = sampler.uniform();
    if qd > 0.0 && u < (pd / qd).min(1.0) {
        return (true, sampler.report(&raw_lp, d));
    }
    // The residual max(p − q, 0).
    let mut r: Vec<f32> = match q {
        None => {
            let mut r = p.clone();
            if let Some(x) = r.get_mut(di) {
                *x = 0.0;
            }
            r
        }
        Some(q) => p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect(),
    };
    let total: f32 = r.iter().sum();
    if total <= 0.0 {
        r = p; // p = q: nothing to correct (a rejection then has probability 0 anyway)
    }
    let tok = draw(sampler, &r);
    (false, sampler.report(&raw_lp, tok as u32))
}

/// A draw from the unnormalised weights `w` (> 0 somewhere).
pub(crate) fn draw(sampler: &mut Sampler, w: &[f32]) -> usize {
    let total: f32 = w.iter().sum();
    let u = sampler.uniform() * total;
    let mut acc = 0f32;
    for (i, &x) in w.iter().enumerate() {
        acc += x;
        if x > 0.0 && u < acc {
            return i;
        }
    }
    argmax(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    /// Pearson's statistic of `counts` against probabilities `p` over `n` draws.
    fn chi2(counts: &[u64], p: &[f32], n: u64) -> f64 {
        counts.iter().zip(p).filter(|(_, &pi)| pi > 0.0).map(|(&c, &pi)| (c as f64 - n as f64 * pi as f64).powi(2) / (n as f64 * pi as f64)).sum()
    }

    /// One position: for every fixed draft token (a deterministic proposer, one-hot q) and for
    /// drafts drawn from a non-trivial q (a draft model), the emitted token is distributed as p
    /// (χ², 5 cells, df 4: 18.47 is the 0.001 point).
    #[test]
    fn emitted_token_is_distributed_as_target() {
        let logits = [1.0f32, 0.2, -0.5, 2.0, 0.0];
        let params = SamplingParams { temperature: 0.8, seed: Some(3), ..Default::default() };
        let p = Sampler::new(params.clone()).distribution(&logits);
        let qs: [Option<Vec<f32>>; 2] = [None, Some(vec![0.5, 0.1, 0.3, 0.05, 0.05])];
        for q in &qs {
            for d0 in 0..5u32 {
                let mut s = Sampler::new(params.clone());
                let mut drafter = Sampler::new(SamplingParams { seed: Some(100 + d0 as u64), ..Default::default() });
                let n = 20_000u64;
                let mut counts = [0u64; 5];
                let mut accepted = 0;
                for _ in 0..n {
                    // A draft model's token is drawn from its q.
                    let d = match q {
                        None => d0,
                        Some(q) => draw(&mut drafter, q) as u32,
                    };
                    let (acc, t) = decide(&mut s, &logits, &[], &[], d, q.as_deref());
                    counts[t.token as usize] += 1;
                    accepted += u64::from(acc);
                    assert!(!acc || t.token == d);
                }
                let x = chi2(&counts, &p, n);
                assert!(x < 18.47, "draft {d0}, q {q:?}: χ² {x:.1} (counts {counts:?}, p {p:?})");
                if q.is_none() {
                    // The acceptance rate is p(d).
                    let rate = accepted as f64 / n as f64;
                    assert!((rate - p[d0 as usize] as f64).abs() < 0.02, "draft {d0}: accepted {rate:.3}, p(d) = {}", p[d0 as usize]);
                }
            }
        }
    }

    #[test]
    fn greedy_accepts_only_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let logits = [0.1f32, 3.0, 2.9];
        assert!(decide(&mut s, &logits, &[], &[], 1, None).0);
        let (acc, t) = decide(&mut s, &logits, &[], &[], 2, None);
        assert!(!acc && t.token == 1);
        // Penalties apply as in plain sampling: a repetition penalty can move the argmax.
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() });
        let (acc, t) = decide(&mut s, &logits, &[], &[1], 2, None);
        assert!(acc && t.token == 2);
    }
}
