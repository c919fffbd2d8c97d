//! Token sampling: penalties, logit bias, temperature, top-k, top-p, min-p, seeded randomness,
//! and top-n log-probabilities. Order (as vLLM applies them): repetition / presence / frequency
//! penalties on the logits → `logit_bias` added → greedy if `temperature == 0` → temperature →
//! top-k → top-p → min-p → draw. Log-probabilities are reported from the model's raw logits
//! (log-softmax).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{param, Result};

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 1 = off; > 1 discourages tokens already in the prompt or output.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted per occurrence of a token already generated.
    pub frequency_penalty: f32,
    /// Makes sampling reproducible.
    pub seed: Option<u64>,
    /// Return this many top log-probabilities per token (None = no logprobs).
    pub logprobs: Option<usize>,
    /// OpenAI's `logit_bias`: `(token, bias)` added to the token's logit after the penalties,
    /// ids ascending and distinct, biases in [−100, 100] (−100 in effect bans a token).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// Also report each prompt token's log-probability given the tokens before it, with this
    /// many top alternatives (OpenAI's `echo` with `logprobs`; vLLM's `prompt_logprobs`).
    /// Such a request is prefilled with every row's logits and never resumes from the prefix
    /// cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
            logit_bias: Vec::new(),
            prompt_logprobs: None,
        }
    }
}

/// The most `logit_bias` entries one request may give.
pub const MAX_LOGIT_BIAS: usize = 1024;

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }

    /// Checks ranges; the error names the parameter.
    pub fn validate(&self) -> Result<()> {
        let finite = |v: f32| v.is_finite();
        if !finite(self.temperature) || self.temperature < 0.0 || self.temperature > 100.0 {
            return Err(param("temperature", format!("{} is outside [0, 100]", self.temperature)));
        }
        if !finite(self.top_p) || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(param("top_p", format!("{} is outside (0, 1]", self.top_p)));
        }
        if !finite(self.min_p) || !(0.0..=1.0).contains(&self.min_p) {
            return Err(param("min_p", format!("{} is outside [0, 1]", self.min_p)));
        }
        if !finite(self.repetition_penalty) || self.repetition_penalty <= 0.0 || self.repetition_penalty > 10.0 {
            return Err(param("repetition_penalty", format!("{} is outside (0, 10]", self.repetition_penalty)));
        }
        if !finite(self.presence_penalty) || self.presence_penalty.abs() > 2.0 {
            return Err(param("presence_penalty", format!("{} is outside [-2, 2]", self.presence_penalty)));
        }
        if !finite(self.frequency_penalty) || self.frequency_penalty.abs() > 2.0 {
            return Err(param("frequency_penalty", format!("{} is outside [-2, 2]", self.frequency_penalty)));
        }
        if let Some(n) = self.logprobs {
            if n > 20 {
                return Err(param("top_logprobs", format!("{n} is more than 20")));
            }
        }
        if let Some(n) = self.prompt_logprobs {
            if n > 20 {
                return Err(param("prompt_logprobs", format!("{n} is more than 20")));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(param("logit_bias", format!("{} entries are more than {MAX_LOGIT_BIAS}", self.logit_bias.len())));
        }
        for (i, &(t, b)) in self.logit_bias.iter().enumerate() {
            if !finite(b) || b.abs() > 100.0 {
                return Err(param("logit_bias", format!("the bias {b} of token {t} is outside [-100, 100]")));
            }
            if i > 0 && self.logit_bias[i - 1].0 >= t {
                return Err(param("logit_bias", format!("token ids must be distinct and ascending (token {t} after {})", self.logit_bias[i - 1].0)));
            }
        }
        Ok(())
    }
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log p(token) under the raw model distribution.
    pub logprob: f32,
    /// The top-n (token, logprob) pairs, best first (empty unless `logprobs` was asked).
    pub top_logprobs: Vec<(u32, f32)>,
}

pub struct Sampler {
    pub params: SamplingParams,
    rng: StdRng,
}

/// `log_softmax(x)[i]` for all i.
pub fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + x.iter().map(|v| ((v - m) as f64).exp()).sum::<f64>().ln() as f32;
    x.iter().map(|v| v - lse).collect()
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler { params, rng }
    }

    /// Applies the penalties in place. `prompt` and `output` are the sequence's tokens so far.
    pub fn apply_penalties(&self, logits: &mut [f32], prompt: &[u32], output: &[u32]) {
        apply_pairs(&self.params, logits, &penalty_pairs(&self.params, prompt, output));
    }

    /// The probability distribution after temperature, top-k, top-p and min-p (sums to 1).
    pub fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        distribution(&self.params, logits)
    }

    /// Picks the next token from raw `logits` given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Sampled {
        self.sample_masked(logits, prompt, output, None)
    }

    /// [`Sampler::sample`] among the ids `allowed` lets through (bit `t % 32` of word `t / 32`;
    /// ids past its end are refused): the others' logits become −∞ after the penalties, before
    /// temperature and the filters, so greedy takes the highest-logit allowed id and top-k/p,
    /// min-p act on the allowed ones. Logprobs stay those of the raw model distribution.
    pub fn sample_masked(&mut self, logits: &[f32], prompt: &[u32], output: &[u32], allowed: Option<&[u32]>) -> Sampled {
        let u = self.draw();
        pick(&self.params, logits, &penalty_pairs(&self.params, prompt, output), allowed, u)
    }

    /// The uniform draw the next token consumes: one from the generator when sampling, none
    /// (0) when greedy. A device sampler gets the same draws, so a seed means one thing on both.
    pub fn draw(&mut self) -> f32 {
        if self.params.temperature == 0.0 {
            0.0
        } else {
            self.rng.random()
        }
    }

    /// A uniform draw in [0, 1) from this sampler's generator (speculative acceptance).
    pub fn uniform(&mut self) -> f32 {
        self.rng.random()
    }

    /// `token` with its log-probability (and the top-n) under the raw logits' `log_softmax`.
    pub fn report(&self, raw_lp: &[f32], token: u32) -> Sampled {
        report(&self.params, raw_lp, token)
    }
}

/// The penalties' sparse form: `(token, count in output)` for each distinct token they touch —
/// every token of `prompt` and `output` when `repetition_penalty` ≠ 1, else those of `output`
/// when presence or frequency penalties are on, else none — in token order.
pub fn penalty_pairs(p: &SamplingParams, prompt: &[u32], output: &[u32]) -> Vec<(u32, u32)> {
    let rep = p.repetition_penalty != 1.0;
    if !rep && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
        return Vec::new();
    }
    let mut count = std::collections::BTreeMap::<u32, u32>::new();
    if rep {
        for &t in prompt {
            count.entry(t).or_insert(0);
        }
    }
    for &t in output {
        *count.entry(t).or_insert(0) += 1;
    }
    count.into_iter().collect()
}

/// Applies penalties given as [`penalty_pairs`] in place: repetition (divide a positive logit,
/// multiply a negative one) on every pair, then presence + frequency × count on output tokens;
/// then adds `p.logit_bias` (ids past the logits are skipped: the engine refuses them at
/// admission).
pub fn apply_pairs(p: &SamplingParams, logits: &mut [f32], pairs: &[(u32, u32)]) {
    for &(t, c) in pairs {
        let Some(l) = logits.get_mut(t as usize) else { continue };
        if p.repetition_penalty != 1.0 {
            *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
        }
        if c > 0 && (p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) {
            *l -= p.presence_penalty + p.frequency_penalty * c as f32;
        }
    }
    for &(t, b) in &p.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// The probability distribution of `logits` after temperature, top-k, top-p and min-p.
pub fn distribution(p: &SamplingParams, logits: &[f32]) -> Vec<f32> {
    let scaled: Vec<f32> = logits.iter().map(|l| l / p.temperature).collect();
    let mut probs = log_softmax(&scaled).into_iter().map(f32::exp).collect::<Vec<_>>();
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].partial_cmp(&probs[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    let mut keep = order.len();
    if p.top_k > 0 {
        keep = keep.min(p.top_k);
    }
    if p.top_p < 1.0 {
        let mut acc = 0f64;
        for (i, &ix) in order.iter().enumerate().take(keep) {
            acc += probs[ix] as f64;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let thr = p.min_p * probs[order[0]];
        keep = order[..keep].iter().take_while(|&&ix| probs[ix] >= thr).count().max(1);
    }
    let mut mask = vec![false; probs.len()];
    order[..keep].iter().for_each(|&ix| mask[ix] = true);
    let total = order[..keep].iter().map(|&ix| probs[ix] as f64).sum::<f64>();
    for (pr, m) in probs.iter_mut().zip(mask) {
        *pr = if m { (*pr as f64 / total) as f32 } else { 0.0 };
    }
    probs
}

/// The host sampler proper (the device sampler's oracle): penalties `pairs`, the mask
/// `allowed`, then greedy, or the filtered distribution walked in id order to the uniform `u`.
pub fn pick(p: &SamplingParams, logits: &[f32], pairs: &[(u32, u32)], allowed: Option<&[u32]>, u: f32) -> Sampled {
    let raw_lp = log_softmax(logits);
    let mut l = logits.to_vec();
    apply_pairs(p, &mut l, pairs);
    if let Some(words) = allowed {
        apply_mask(&mut l, words);
    }
    let token = if p.temperature == 0.0 {
        argmax(&l)
    } else {
        let probs = distribution(p, &l);
        // f64 running sum: an f32 one drifts by ~1e-5 over a 163840-token vocabulary.
        let mut acc = 0f64;
        let mut pick = argmax(&probs);
        for (i, &pr) in probs.iter().enumerate() {
            acc += pr as f64;
            if pr > 0.0 && (u as f64) < acc {
                pick = i;
                break;
            }
        }
        pick
    };
    report(p, &raw_lp, token as u32)
}

/// `token` with its log-probability (and the top-n) under the raw logits' `log_softmax`.
pub fn report(p: &SamplingParams, raw_lp: &[f32], token: u32) -> Sampled {
    let top_logprobs = match p.logprobs {
        Some(n) if n > 0 => {
            let mut idx: Vec<usize> = (0..raw_lp.len()).collect();
            let n = n.min(idx.len());
            idx.select_nth_unstable_by(n - 1, |&a, &b| raw_lp[b].partial_cmp(&raw_lp[a]).unwrap_or(std::cmp::Ordering::Equal));
            idx.truncate(n);
            idx.sort_by(|&a, &b| raw_lp[b].partial_cmp(&raw_lp[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
            idx.into_iter().map(|i| (i as u32, raw_lp[i])).collect()
        }
        _ => Vec::new(),
    };
    Sampled { token, logprob: raw_lp[token as usize], top_logprobs }
}

/// Sets the logits of the ids whose bit in `words` is clear (and of those past its end) to −∞.
pub fn apply_mask(logits: &mut [f32], words: &[u32]) {
    for (c, chunk) in logits.chunks_mut(32).enumerate() {
        let w = words.get(c).copied().unwrap_or(0);
        if w == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if w >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Index of the largest value (lowest index on ties).
pub fn argmax(x: &[f32]) -> usize {
    x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(p: SamplingParams) -> Sampler {
        Sampler::new(SamplingParams { seed: Some(1), ..p })
    }

    #[test]
    fn greedy_takes_argmax() {
        let mut sm = s(SamplingParams::greedy());
        assert_eq!(sm.sample(&[0.1, 3.0, 2.9], &[], &[]).token, 1);
    }

    #[test]
    fn mask_restricts_greedy_and_sampling() {
        let logits: Vec<f32> = (0..70).map(|i| i as f32 * 0.1).collect();
        // Allow ids 3, 33 and 40 only: greedy takes 40 (the highest allowed), sampling never leaves them.
        let mut words = vec![0u32; 3];
        for t in [3usize, 33, 40] {
            words[t / 32] |= 1 << (t % 32);
        }
        let mut g = s(SamplingParams::greedy());
        assert_eq!(g.sample_masked(&logits, &[], &[], Some(&words)).token, 40);
        let mut r = s(SamplingParams { temperature: 5.0, ..Default::default() });
        for _ in 0..200 {
            let t = r.sample_masked(&logits, &[], &[], Some(&words)).token;
            assert!([3, 33, 40].contains(&t), "{t}");
        }
        // Ids past the mask's words are refused.
        let mut g = s(SamplingParams::greedy());
        assert_eq!(g.sample_masked(&logits, &[], &[], Some(&words[..1])).token, 3);
    }

    #[test]
    fn logit_bias_is_added_after_the_penalties() {
        let logits = [2.0f32, 1.0, 0.5, -1.0];
        // +100 forces a token under greedy, −100 bans the best one.
        let mut g = s(SamplingParams { logit_bias: vec![(3, 100.0)], ..SamplingParams::greedy() });
        assert_eq!(g.sample(&logits, &[], &[]).token, 3);
        let mut g = s(SamplingParams { logit_bias: vec![(0, -100.0)], ..SamplingParams::greedy() });
        assert_eq!(g.sample(&logits, &[], &[]).token, 1);
        // After the repetition penalty: 2.0 / 2 + 0.75 = 1.75 > 1.0 + 0.5; without the bias 1.0 < 1.5.
        let p = SamplingParams { repetition_penalty: 2.0, logit_bias: vec![(0, 0.75), (2, 1.0)], ..SamplingParams::greedy() };
        let mut l = logits.to_vec();
        apply_pairs(&p, &mut l, &penalty_pairs(&p, &[0], &[]));
        assert_eq!(l, vec![1.75, 1.0, 1.5, -1.0]);
        // Sampling never draws a banned token; logprobs stay the raw model's.
        let mut r = s(SamplingParams { temperature: 1.0, logit_bias: vec![(0, -100.0), (1, -100.0)], logprobs: Some(1), ..Default::default() });
        for _ in 0..200 {
            let t = r.sample(&logits, &[], &[]);
            assert!(t.token >= 2, "{t:?}");
            assert_eq!(t.top_logprobs[0].0, 0, "top logprob from the raw logits");
        }
        // Validation names the parameter.
        let bad = |b: Vec<(u32, f32)>| SamplingParams { logit_bias: b, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(bad(vec![(1, 101.0)]).contains("logit_bias"));
        assert!(bad(vec![(1, f32::NAN)]).contains("logit_bias"));
        assert!(bad(vec![(2, 1.0), (1, 1.0)]).contains("ascending"));
        assert!(bad(vec![(0, 1.0); MAX_LOGIT_BIAS + 1]).contains("more than"));
    }

    #[test]
    fn top_k_keeps_k() {
        let sm = s(SamplingParams { top_k: 2, ..Default::default() });
        let d = sm.distribution(&[1.0, 3.0, 2.0, 0.0]);
        assert_eq!(d.iter().filter(|p| **p > 0.0).count(), 2);
        assert!(d[1] > d[2] && d[0] == 0.0 && d[3] == 0.0);
        assert!((d.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_smallest_nucleus() {
        // probs ≈ [0.665, 0.245, 0.090]: top_p 0.7 keeps two.
        let sm = s(SamplingParams { top_p: 0.7, ..Default::default() });
        let d = sm.distribution(&[2.0, 1.0, 0.0]);
        assert!(d[0] > 0.0 && d[1] > 0.0 && d[2] == 0.0);
    }

    #[test]
    fn min_p_drops_unlikely() {
        let sm = s(SamplingParams { min_p: 0.2, ..Default::default() });
        // p ∝ e^[0, -1, -3]: relative to max 1, 0.37, 0.05 → third dropped.
        let d = sm.distribution(&[0.0, -1.0, -3.0]);
        assert!(d[1] > 0.0 && d[2] == 0.0);
    }

    #[test]
    fn temperature_sharpens() {
        let a = s(SamplingParams { temperature: 0.5, ..Default::default() }).distribution(&[1.0, 0.0]);
        let b = s(SamplingParams { temperature: 2.0, ..Default::default() }).distribution(&[1.0, 0.0]);
        assert!(a[0] > b[0]);
    }

    #[test]
    fn penalties() {
        let sm = s(SamplingParams { repetition_penalty: 2.0, presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() });
        let mut l = vec![4.0, -4.0, 1.0, 1.0];
        sm.apply_penalties(&mut l, &[0, 1], &[2, 2]);
        assert_eq!(l[0], 2.0); // positive / 2
        assert_eq!(l[1], -8.0); // negative × 2
        assert_eq!(l[2], 1.0 / 2.0 - 0.5 - 0.5); // repetition, presence, 2 × frequency
        assert_eq!(l[3], 1.0);
    }

    #[test]
    fn penalty_pairs_touch_each_distinct_token_once() {
        let p = SamplingParams { repetition_penalty: 1.5, presence_penalty: 0.3, frequency_penalty: 0.2, ..Default::default() };
        assert_eq!(penalty_pairs(&p, &[5, 1, 5], &[2, 1, 2, 2]), vec![(1, 1), (2, 3), (5, 0)]);
        let only_out = SamplingParams { presence_penalty: 0.3, ..Default::default() };
        assert_eq!(penalty_pairs(&only_out, &[5, 1], &[2, 2]), vec![(2, 2)]);
        assert!(penalty_pairs(&SamplingParams::default(), &[5], &[2]).is_empty());
        // Ids past the vocabulary are skipped, not a panic.
        let mut l = vec![1.0f32; 3];
        apply_pairs(&p, &mut l, &[(7, 2)]);
        assert_eq!(l, vec![1.0; 3]);
    }

    #[test]
    fn draw_consumes_the_generator_only_when_sampling() {
        let mut g = Sampler::new(SamplingParams { seed: Some(3), ..SamplingParams::greedy() });
        assert_eq!(g.draw(), 0.0);
        let mut a = s(SamplingParams::default());
        let mut b = s(SamplingParams::default());
        let logits: Vec<f32> = (0..40).map(|i| (i % 7) as f32 * 0.4).collect();
        // sample = pick with the draw it consumes: the same tokens from the same seed.
        for _ in 0..50 {
            let u = b.draw();
            assert!((0.0..1.0).contains(&u));
            assert_eq!(a.sample(&logits, &[], &[]).token, pick(&b.params, &logits, &[], None, u).token);
        }
    }

    #[test]
    fn seed_reproduces_and_logprobs_sorted() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let run = |seed| {
            let mut sm = Sampler::new(SamplingParams { seed: Some(seed), logprobs: Some(3), ..Default::default() });
            (0..20).map(|_| sm.sample(&logits, &[], &[]).token).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let mut sm = Sampler::new(SamplingParams { seed: Some(1), logprobs: Some(3), ..Default::default() });
        let out = sm.sample(&logits, &[], &[]);
        assert_eq!(out.top_logprobs.len(), 3);
        assert!(out.top_logprobs.windows(2).all(|w| w[0].1 >= w[1].1));
        let lp = log_softmax(&logits);
        assert!((out.logprob - lp[out.token as usize]).abs() < 1e-6);
    }

    #[test]
    fn validation_names_parameter() {
        let e = SamplingParams { top_p: 1.5, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("top_p"));
        let e = SamplingParams { temperature: -1.0, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("temperature"));
        assert!(SamplingParams::default().validate().is_ok());
    }
}
