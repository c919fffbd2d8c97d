//! Elementwise activations and softmax (f32).
//! SiTU-GLU is text-backbone §7.4: `β·tanh(g/β)·σ(g) · λ·tanh(u/λ)` with β = 4, λ = 25.

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// SiTU-GLU of one gate/up pair.
#[inline]
pub fn situ_glu(g: f32, u: f32, beta: f32, linear_beta: f32) -> f32 {
    beta * (g / beta).tanh() * sigmoid(g) * (linear_beta * (u / linear_beta).tanh())
}

/// `out[i] = situ_glu(gate[i], up[i])` over equal-length slices.
pub fn situ_glu_slice(gate: &[f32], up: &[f32], out: &mut [f32], beta: f32, linear_beta: f32) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = situ_glu(g, u, beta, linear_beta);
    }
}

/// In-place numerically stable softmax. An all-`-inf` row becomes all zeros.
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        x.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let mut s = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn situ_matches_formula() {
        let (g, u) = (1.3f32, -7.0f32);
        let want = 4.0 * (g / 4.0).tanh() / (1.0 + (-g).exp()) * 25.0 * (u / 25.0).tanh();
        assert!((situ_glu(g, u, 4.0, 25.0) - want).abs() < 1e-6);
        // Soft caps: large inputs saturate at β and λ.
        assert!((situ_glu(1e4, 1e4, 4.0, 25.0) - 100.0).abs() < 1e-3);
    }
    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, f32::NEG_INFINITY, 0.5];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[2], 0.0);
    }
}
