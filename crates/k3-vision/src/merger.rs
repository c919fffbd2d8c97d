//! The `sd2_tpool` patch merger, around-backbone §3.7: 2 × 2 space-to-depth plus a temporal mean.
//!
//! Shape legend: tower output of one sample `[t·h·w, C]`, viewed `[t, h/kh, kh, w/kw, kw, C]`
//! with indices `(τ, R, dy, Cc, dx, ch)` → mean over τ → `[(h/kh)·(w/kw), kh·kw, C]`. Entry
//! `dy·kw + dx` of a token holds patch `(kh·R + dy, kw·Cc + dx)`; tokens are row-major over
//! `(R, Cc)`. Flattened per token this is the projector's `kh·kw·C` input.

use rayon::prelude::*;

use crate::error::{input, Result};

/// Merges one sample's tower rows `x` `[t·h·w, c]` with a `kh × kw` kernel.
pub fn sd2_tpool(x: &[f32], grid: [usize; 3], c: usize, kh: usize, kw: usize) -> Result<Vec<f32>> {
    let [t, h, w] = grid;
    if kh == 0 || kw == 0 || h % kh != 0 || w % kw != 0 {
        return Err(input(format!("grid {h}x{w} is not a multiple of the {kh}x{kw} merge kernel")));
    }
    if t == 0 || x.len() != t * h * w * c {
        return Err(input(format!("merger input holds {} values; grid {:?} × width {c} needs {}", x.len(), grid, t * h * w * c)));
    }
    let (gh, gw) = (h / kh, w / kw);
    let mut out = vec![0f32; gh * gw * kh * kw * c];
    let inv = 1.0 / t as f32;
    out.par_chunks_mut(kh * kw * c).enumerate().for_each(|(tok, o)| {
        let (r, cc) = (tok / gw, tok % gw);
        for dy in 0..kh {
            for dx in 0..kw {
                let dst = &mut o[(dy * kw + dx) * c..(dy * kw + dx + 1) * c];
                for tau in 0..t {
                    let p = tau * h * w + (r * kh + dy) * w + cc * kw + dx;
                    dst.iter_mut().zip(&x[p * c..(p + 1) * c]).for_each(|(a, b)| *a += b);
                }
                if t > 1 {
                    dst.iter_mut().for_each(|a| *a *= inv);
                }
            }
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_dy_then_dx_and_time_is_averaged() {
        // grid (1, 2, 4), C = 1: patch value = 10·row + col.
        let x: Vec<f32> = (0..2).flat_map(|r| (0..4).map(move |c| (10 * r + c) as f32)).collect();
        let m = sd2_tpool(&x, [1, 2, 4], 1, 2, 2).unwrap();
        assert_eq!(m, vec![0.0, 1.0, 10.0, 11.0, 2.0, 3.0, 12.0, 13.0]);
        let two: Vec<f32> = x.iter().copied().chain(x.iter().map(|v| v + 2.0)).collect();
        let m2 = sd2_tpool(&two, [2, 2, 4], 1, 2, 2).unwrap();
        assert_eq!(m2, m.iter().map(|v| v + 1.0).collect::<Vec<_>>());
        assert!(sd2_tpool(&x, [1, 2, 3], 1, 2, 2).is_err());
    }
}
