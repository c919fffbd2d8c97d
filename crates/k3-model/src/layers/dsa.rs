//! K3.1 Pro's lightning indexer and top-k selection (text-backbone §5.3–5.6, §5.10).
//!
//! Per DSA layer and token: `qI = wq_b(c_q)` `[ih, id]` from the MLA's normed q latent,
//! `kI = LayerNorm(wk x)` `[id]` (gain + bias, f32, eps `rms_norm_eps`), head weights
//! `a = weights_proj x` `[ih]` (signed, no activation). Score of key `s ≤ t`:
//! `I[t,s] = Σ_h a[h] · ReLU(qI[h] · kI[s]) / (sqrt(ih)·sqrt(id))`. Selection keeps the
//! `min(index_topk, t+1)` best by `(I desc, s desc)` — ties go to the more recent position —
//! and is skipped entirely (all positions) when `t + 1 ≤ index_topk`.

use k3_core::kernels::cpu::matmul::{dot, Matrix};
use k3_core::kernels::cpu::norm::layer_norm_inplace;

use super::{lin, matrix, vector};
use crate::config::DsaConfig;
use crate::error::Result;
use crate::source::Tensors;

/// Cloning shares the mapped weights.
#[derive(Clone)]
pub struct Indexer {
    pub wq_b: Matrix,
    pub wk: Matrix,
    pub k_norm_weight: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    pub weights_proj: Matrix,
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
    pub eps: f32,
}

/// The indexer's per-token outputs for a chunk of `T` new tokens.
pub struct IndexerOut {
    /// `[T, ih, id]`
    pub q: Vec<f32>,
    /// `[T, id]` (appended to the indexer-key cache)
    pub k: Vec<f32>,
    /// `[T, ih]`, already multiplied by `1/(sqrt(ih)·sqrt(id))`
    pub a: Vec<f32>,
}

impl Indexer {
    pub fn load<S: Tensors + ?Sized>(ck: &S, p: &str, d: &DsaConfig, h: usize, q_lora: usize, eps: f32) -> Result<Self> {
        let (ih, id) = (d.index_num_heads, d.index_head_dim);
        Ok(Indexer {
            wq_b: matrix(ck, &format!("{p}indexer.wq_b.weight"), ih * id, q_lora)?,
            wk: matrix(ck, &format!("{p}indexer.wk.weight"), id, h)?,
            k_norm_weight: vector(ck, &format!("{p}indexer.k_norm.weight"), id)?,
            k_norm_bias: vector(ck, &format!("{p}indexer.k_norm.bias"), id)?,
            weights_proj: matrix(ck, &format!("{p}indexer.weights_proj.weight"), ih, h)?,
            heads: ih,
            head_dim: id,
            topk: d.index_topk,
            eps,
        })
    }

    /// Index queries, keys and scaled head weights for `t` tokens (`x` `[T, H]`, `c_q` `[T, q_lora]`).
    pub fn project(&self, x: &[f32], c_q: &[f32], t: usize) -> Result<IndexerOut> {
        let q = lin(c_q, t, &self.wq_b)?;
        let mut k = lin(x, t, &self.wk)?;
        layer_norm_inplace(&mut k, &self.k_norm_weight, &self.k_norm_bias, self.eps);
        let scale = 1.0 / ((self.heads as f32).sqrt() * (self.head_dim as f32).sqrt());
        let a = lin(x, t, &self.weights_proj)?.into_iter().map(|v| v * scale).collect();
        Ok(IndexerOut { q, k, a })
    }
}

/// Scores `I[s]` of one query (`q` `[ih, id]`, scaled weights `a` `[ih]`) against `keys` `[n, id]`.
pub fn index_scores(q: &[f32], a: &[f32], keys: &[f32], id: usize) -> Vec<f32> {
    let mut s = Vec::with_capacity(keys.len() / id);
    index_scores_into(q, a, keys, id, &mut s);
    s
}

/// [`index_scores`] appended to `out` (a paged cache's keys: one call per page's rows).
pub fn index_scores_into(q: &[f32], a: &[f32], keys: &[f32], id: usize, out: &mut Vec<f32>) {
    out.extend(keys.chunks_exact(id).map(|ks| q.chunks_exact(id).zip(a).map(|(qh, &ah)| ah * dot(qh, ks).max(0.0)).sum::<f32>()));
}

/// Positions of the `k` largest scores, ordered by `(score desc, position desc)`; all
/// positions when `scores.len() ≤ k`. Returned in increasing position order.
pub fn select_topk(scores: &[f32], k: usize) -> Vec<u32> {
    let n = scores.len();
    if n <= k {
        return (0..n as u32).collect();
    }
    let mut idx: Vec<u32> = (0..n as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        let (sa, sb) = (scores[*a as usize], scores[*b as usize]);
        // +0.0 == −0.0 under partial_cmp; NaN (never produced from finite inputs) sorts last.
        sb.partial_cmp(&sa).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(a))
    };
    idx.select_nth_unstable_by(k - 1, cmp);
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_relu_per_head_signed_weights() {
        // 2 heads × dim 2; key dot products: head0 = +1, head1 = −1 → ReLU drops head1.
        let q = [1.0, 0.0, -1.0, 0.0];
        let keys = [1.0, 5.0];
        let s = index_scores(&q, &[-2.0, 3.0], &keys, 2);
        assert_eq!(s, vec![-2.0]);
    }

    #[test]
    fn topk_prefers_higher_then_more_recent() {
        let scores = [0.0, 3.0, 0.0, 1.0, 0.0, 3.0];
        assert_eq!(select_topk(&scores, 3), vec![1, 3, 5]);
        // Ties at 0: the two most recent zeros win.
        assert_eq!(select_topk(&scores, 5), vec![1, 2, 3, 4, 5]);
        assert_eq!(select_topk(&[0.0, -0.0, 0.0], 2), vec![1, 2]);
        assert_eq!(select_topk(&scores, 10), (0..6).collect::<Vec<u32>>());
    }

    #[test]
    fn topk_matches_naive_sort() {
        let mut x = 12345u64;
        for n in [5usize, 17, 64, 200] {
            let scores: Vec<f32> = (0..n)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((x >> 40) % 7) as f32 - 3.0
                })
                .map(|v: f32| v.max(0.0))
                .collect();
            for k in [1, 3, n / 2, n - 1] {
                let mut naive: Vec<u32> = (0..n as u32).collect();
                naive.sort_by(|a, b| scores[*b as usize].partial_cmp(&scores[*a as usize]).unwrap().then(b.cmp(a)));
                let mut want = naive[..k].to_vec();
                want.sort();
                assert_eq!(select_topk(&scores, k), want, "n={n} k={k}");
            }
        }
    }
}
