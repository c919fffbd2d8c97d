//! Block Attention Residuals (text-backbone §6): the mixing operator that replaces the
//! residual stream. Per token, sources `v_0..v_n` (`[H]` each) are mixed with
//! `p = softmax_i( (v_i · c) / sqrt(mean(v_i²) + eps) )`, `c = norm_weight ⊙ proj_weight`,
//! `Mix = Σ p_i v_i` over the RAW sources, all in f32. The block bookkeeping (which sources a
//! layer sees) lives in `model.rs`.

use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// One (norm, proj) pair, folded into its pseudo-query `c = a ⊙ w` at load.
pub struct AttnRes {
    pub c: Vec<f32>,
    pub eps: f32,
}

impl AttnRes {
    /// Loads `{prefix}_norm.weight` [H] and `{prefix}_proj.weight` [1, H].
    pub fn load(ck: &Checkpoint, prefix: &str, h: usize, eps: f32) -> Result<Self> {
        let a = super::vector(ck, &format!("{prefix}_norm.weight"), h)?;
        let w = super::vector(ck, &format!("{prefix}_proj.weight"), h)?;
        Ok(AttnRes { c: a.iter().zip(&w).map(|(x, y)| x * y).collect(), eps })
    }

    /// Mixes `sources` (each `[T, H]`) per token into `[T, H]`.
    pub fn mix(&self, sources: &[&[f32]], t: usize) -> Vec<f32> {
        let h = self.c.len();
        let mut out = vec![0f32; t * h];
        let mut p = vec![0f32; sources.len()];
        for r in 0..t {
            for (i, s) in sources.iter().enumerate() {
                let v = &s[r * h..(r + 1) * h];
                let (mut dot, mut ss) = (0f32, 0f32);
                for (&x, &c) in v.iter().zip(&self.c) {
                    dot += x * c;
                    ss += x * x;
                }
                p[i] = dot / (ss / h as f32 + self.eps).sqrt();
            }
            k3_core::kernels::cpu::act::softmax_inplace(&mut p);
            let o = &mut out[r * h..(r + 1) * h];
            for (s, &pi) in sources.iter().zip(&p) {
                for (oo, &x) in o.iter_mut().zip(&s[r * h..(r + 1) * h]) {
                    *oo += pi * x;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn mix_matches_naive_formula() {
        let ar = AttnRes { c: vec![0.5, -1.0, 2.0], eps: 1e-5 };
        let a = [1.0f32, 2.0, 3.0];
        let b = [-1.0f32, 0.5, 4.0];
        let out = ar.mix(&[&a, &b], 1);
        let logit = |v: &[f32]| {
            let dot: f64 = v.iter().zip(&ar.c).map(|(x, c)| (*x * *c) as f64).sum();
            let ms: f64 = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / 3.0;
            dot / (ms + 1e-5).sqrt()
        };
        let (la, lb) = (logit(&a), logit(&b));
        let pa = la.exp() / (la.exp() + lb.exp());
        for i in 0..3 {
            let want = pa * a[i] as f64 + (1.0 - pa) * b[i] as f64;
            assert!((out[i] as f64 - want).abs() < 1e-5);
        }
        // One source: the mix is that source unchanged.
        assert_eq!(ar.mix(&[&a], 1), a.to_vec());
    }
}
