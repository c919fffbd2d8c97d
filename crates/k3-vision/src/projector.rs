//! The PatchMergerMLPV2 projector (`mm_projector`), around-backbone §3.8:
//! `e = RMSNorm(W2 · gelu_erf(W0 · m); post_norm, eps = projector_ln_eps)`, no biases, no pre-norm.
//!
//! Shape legend: merged tokens `m` `[N, kh·kw·C]` (4096 released); `W0` `[4·C, 4·C]`;
//! `W2` `[text_hidden, 4·C]` (7168 released); output `[N, text_hidden]`, the rows that replace
//! `<|media_pad|>`. The GELU is the exact erf form, not the tanh form of the ViT MLP.

use k3_core::kernels::cpu::matmul::{linear, Matrix};
use k3_core::Tensor;
use rayon::prelude::*;

use crate::error::{input, Result, VisionError};

pub struct Projector {
    pub w0: Matrix,
    pub w2: Matrix,
    pub post_norm: Vec<f32>,
    pub eps: f32,
}

/// `erf(x)` to f64 precision: Maclaurin series for |x| < 2.5, continued fraction for erfc beyond.
pub fn erf(x: f64) -> f64 {
    let a = x.abs();
    let r = if a < 2.5 {
        let (x2, mut term, mut sum) = (a * a, a, a);
        for n in 1..200 {
            term *= -x2 / n as f64;
            let add = term / (2 * n + 1) as f64;
            sum += add;
            if add.abs() < 1e-17 * sum.abs() {
                break;
            }
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else if a < 9.0 {
        // erfc(a) = exp(−a²)/√π · 1/(a + (1/2)/(a + 1/(a + (3/2)/(a + 2/(a + …))))).
        let mut f = a;
        for k in (1..=80).rev() {
            f = a + (k as f64 / 2.0) / f;
        }
        1.0 - (-a * a).exp() / (std::f64::consts::PI.sqrt() * f)
    } else {
        1.0
    };
    r.copysign(x)
}

/// Exact GELU `0.5·u·(1 + erf(u/√2))`.
#[inline]
pub fn gelu_erf(u: f32) -> f32 {
    let u = u as f64;
    (0.5 * u * (1.0 + erf(u * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

impl Projector {
    /// Loads `mm_projector.{proj.0, proj.2, post_norm}` through `get`.
    pub fn load(get: &dyn Fn(&str) -> Result<Tensor>, merged: usize, text_hidden: usize, eps: f32) -> Result<Projector> {
        let check = |name: &str, want: &[usize]| -> Result<Tensor> {
            let t = get(name)?;
            if t.shape() != want {
                return Err(VisionError::Weight { name: name.into(), msg: format!("has shape {:?}, expected {want:?} (from vision_config)", t.shape()) });
            }
            Ok(t)
        };
        Ok(Projector {
            w0: Matrix::dense(check("mm_projector.proj.0.weight", &[merged, merged])?)?,
            w2: Matrix::dense(check("mm_projector.proj.2.weight", &[text_hidden, merged])?)?,
            post_norm: check("mm_projector.post_norm.weight", &[text_hidden])?.to_f32()?.into_owned(),
            eps,
        })
    }

    pub fn in_width(&self) -> usize {
        self.w0.cols()
    }
    pub fn out_width(&self) -> usize {
        self.w2.rows()
    }

    /// `[n, in]` merged tokens → `[n, text_hidden]`.
    pub fn forward(&self, m: &[f32]) -> Result<Vec<f32>> {
        let k = self.in_width();
        if m.is_empty() || !m.len().is_multiple_of(k) {
            return Err(input(format!("projector input holds {} values, not a positive multiple of {k}", m.len())));
        }
        let n = m.len() / k;
        let mut u = vec![0f32; n * self.w0.rows()];
        linear(m, n, &self.w0, &mut u)?;
        u.par_iter_mut().for_each(|v| *v = gelu_erf(*v));
        let th = self.out_width();
        let mut y = vec![0f32; n * th];
        linear(&u, n, &self.w2, &mut y)?;
        Ok(crate::tower::rms_norm_rows(&y, &self.post_norm, self.eps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_reference_values() {
        // Values from the closed-form tables (Abramowitz & Stegun 7.1).
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.5, -0.966_105_146_475_310_7),
        ] {
            assert!((erf(x) - want).abs() < 1e-15, "erf({x}) = {} vs {want}", erf(x));
        }
        // Continuity across the series / continued-fraction switch.
        assert!((erf(2.5 - 1e-12) - erf(2.5)).abs() < 1e-12);
        // Exact GELU differs from the tanh form by a few 1e-4 near 1.
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_erf(1.0) - crate::tower::gelu_tanh(1.0)).abs() > 1e-4);
    }
}
