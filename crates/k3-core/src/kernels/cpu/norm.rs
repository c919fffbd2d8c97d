//! Normalisations over the last dimension, f32: RMSNorm (statistic on the mean of squares,
//! eps inside the sqrt), LayerNorm with gain and bias (biased variance), and the KDA L2 norm
//! (eps added to the SUM of squares, text-backbone §3.3).

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) · w` for each row of width `w.len()`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// In-place RMSNorm.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ms = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    }
}

/// In-place LayerNorm with gain `w` and bias `b` (biased variance).
pub fn layer_norm_inplace(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let mu = xr.iter().sum::<f32>() / d as f32;
        let var = xr.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &g), &bb) in xr.iter_mut().zip(w).zip(b) {
            *v = (*v - mu) * inv * g + bb;
        }
    }
}

/// In-place L2 normalisation of each `d`-wide row: `x / sqrt(Σx² + eps)`.
pub fn l2_norm_inplace(x: &mut [f32], d: usize, eps: f32) {
    for xr in x.chunks_exact_mut(d) {
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
        xr.iter_mut().for_each(|v| *v *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn rms_and_layer_norm() {
        let x = [3.0f32, 4.0];
        let mut o = [0.0; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut o);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6);
        let mut y = [1.0f32, 3.0];
        layer_norm_inplace(&mut y, &[1.0, 1.0], &[0.5, 0.5], 0.0);
        assert!((y[0] + 0.5).abs() < 1e-6 && (y[1] - 1.5).abs() < 1e-6);
        let mut z = [3.0f32, 4.0];
        l2_norm_inplace(&mut z, 2, 0.0);
        assert!((z[0] - 0.6).abs() < 1e-6);
    }
}
