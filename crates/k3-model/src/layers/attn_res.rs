//! Block Attention Residuals (text-backbone §6): the mixing operator that replaces the
//! residual stream. Per token, sources `v_0..v_n` (`[H]` each) are mixed with
//! `p = softmax_i( (v_i · c) / sqrt(mean(v_i²) + eps) )`, `c = norm_weight ⊙ proj_weight`,
//! `Mix = Σ p_i v_i` over the RAW sources, all in f32. [`Residual`] is the block bookkeeping
//! (§6.2): which sources a sublayer sees, and the state a pipeline stage hands the next one.

use k3_core::comm::Group;

use crate::error::{ModelError, Result};
use crate::source::Tensors;

/// One (norm, proj) pair, folded into its pseudo-query `c = a ⊙ w` at load.
pub struct AttnRes {
    pub c: Vec<f32>,
    pub eps: f32,
}

impl AttnRes {
    /// Loads `{prefix}_norm.weight` [H] and `{prefix}_proj.weight` [1, H].
    pub fn load<S: Tensors + ?Sized>(ck: &S, prefix: &str, h: usize, eps: f32) -> Result<Self> {
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

/// The residual state between sublayers (§6.2), rows `[T, H]` each: the completed blocks
/// `b_0 …` (`b_0` is the embedding), the running partial sum `P` of the open block, and the
/// FFN output not yet added to `P`. Layer `l` opens a block when `l % block_size == 0`.
pub struct Residual {
    pub blocks: Vec<Vec<f32>>,
    pub p: Vec<f32>,
    pub pending: Option<Vec<f32>>,
}

impl Residual {
    /// The state before the first layer: `P` is the embedding.
    pub fn new(emb: Vec<f32>) -> Residual {
        Residual { blocks: Vec::new(), p: emb, pending: None }
    }

    /// Adds the pending FFN output into `P`.
    pub fn settle(&mut self) {
        if let Some(d) = self.pending.take() {
            self.p.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        }
    }

    /// Before layer `l`'s mixer: settles, closes the block when `l` starts one, and returns the
    /// mixer's sources (the blocks before `l`'s and `P`).
    pub fn mixer_sources(&mut self, l: usize, block: usize) -> Vec<&[f32]> {
        self.settle();
        if l.is_multiple_of(block) {
            self.blocks.push(self.p.clone());
        }
        self.sources(l.div_ceil(block))
    }

    /// Adds the mixer output `a` (a new block starts from it) and returns the FFN's sources.
    pub fn ffn_sources(&mut self, l: usize, block: usize, a: Vec<f32>) -> Vec<&[f32]> {
        if l.is_multiple_of(block) {
            self.p = a;
        } else {
            self.p.iter_mut().zip(&a).for_each(|(x, y)| *x += y);
        }
        self.sources(l.div_ceil(block) + usize::from(l.is_multiple_of(block)))
    }

    /// After the last layer: every block and the settled `P`.
    pub fn output_sources(&mut self) -> Vec<&[f32]> {
        self.settle();
        self.sources(self.blocks.len())
    }

    fn sources(&self, blocks: usize) -> Vec<&[f32]> {
        let mut s: Vec<&[f32]> = self.blocks[..blocks].iter().map(Vec::as_slice).collect();
        s.push(&self.p);
        s
    }

    /// Sends the state to rank `to` of `world` (the next pipeline stage): one message
    /// `[blocks, has_pending]` then the rows.
    pub fn send(&self, world: &dyn Group, to: usize) -> Result<()> {
        let mut msg = vec![self.blocks.len() as f32, f32::from(u8::from(self.pending.is_some()))];
        for b in &self.blocks {
            msg.extend_from_slice(b);
        }
        msg.extend_from_slice(&self.p);
        if let Some(d) = &self.pending {
            msg.extend_from_slice(d);
        }
        Ok(world.send(to, &msg)?)
    }

    /// Receives the state of `rows` values per tensor from rank `from` (the previous stage).
    pub fn recv(world: &dyn Group, from: usize, rows: usize) -> Result<Residual> {
        let msg = world.recv(from)?;
        let bad = || {
            ModelError::Internal(format!("pipeline: the residual state from rank {from} has {} values, which is not a state of {rows}-value rows", msg.len()))
        };
        let (nb, pend) = match msg.get(..2) {
            Some(&[nb, pend]) => (nb as usize, pend != 0.0),
            _ => return Err(bad()),
        };
        if msg.len() != 2 + rows * (nb + 1 + usize::from(pend)) {
            return Err(bad());
        }
        let mut it = msg[2..].chunks_exact(rows.max(1)).map(<[f32]>::to_vec);
        let mut next = || it.next().unwrap_or_default();
        let blocks = (0..nb).map(|_| next()).collect();
        let p = next();
        let pending = pend.then(next);
        Ok(Residual { blocks, p, pending })
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
