//! MXFP4 weights × int8 activations on the CPU (issue 23: routed experts computed by the CPU
//! from the memory-mapped checkpoint while a GPU holds the trunk) — around-backbone §2.2 for the
//! weight format. Not the oracle path: the activations are rounded to int8, so results differ
//! from `mxfp4::dot_row` by the activation rounding (≤ half a step of each 32-block's scale).
//!
//! An activation vector `x [cols]` is quantized per 32-value block `b` to `q = round(x / d_b)`
//! with `d_b = max|x_b| / 127` ([`quantize`]), stored with each block's even columns first and
//! odd columns second, which is the order the packed nibbles unpack to (low nibble = even
//! column). A weight nibble maps to the integer `2·e2m1` (−12..12), so one block's dot product
//! is an exact integer sum `Σ w·q`, scaled by `d_b · 2^(s−127) / 2`; only the 32-to-1 block
//! sums round. AVX2: `pshufb` decodes 32 nibbles to signed bytes, `sign` + `maddubs` + `madd`
//! give eight int32 partial sums per block (the llama.cpp q8 trick), FMA accumulates them scaled.
//! Shapes: weight `[rows, cols]` as `packed [rows, cols/2]`, `scale [rows, cols/32]`; `cols` a
//! multiple of 32.

use rayon::prelude::*;

use super::mxfp4::e8m0_to_f32;
use crate::{CoreError, Result};

/// `2·e2m1` of each nibble as a signed byte.
const LUT2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// One activation vector in int8 blocks (see the module doc for the order).
#[derive(Clone, Debug)]
pub struct Q8 {
    /// `cols` values: per block, its 16 even columns then its 16 odd columns.
    pub q: Vec<i8>,
    /// Per block: `d_b / 2` (the ½ undoes the doubled nibble table).
    pub half_d: Vec<f32>,
}

/// Quantizes `x` (length a multiple of 32) to [`Q8`].
pub fn quantize(x: &[f32]) -> Result<Q8> {
    if !x.len().is_multiple_of(32) {
        return Err(CoreError::Shape { op: "mxfp4_q8::quantize", detail: format!("{} values: a multiple of 32 is needed", x.len()) });
    }
    let mut q = vec![0i8; x.len()];
    let mut half_d = Vec::with_capacity(x.len() / 32);
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let qb = &mut q[b * 32..b * 32 + 32];
        for j in 0..16 {
            qb[j] = (xb[2 * j] * inv).round().clamp(-127.0, 127.0) as i8;
            qb[16 + j] = (xb[2 * j + 1] * inv).round().clamp(-127.0, 127.0) as i8;
        }
        half_d.push(d * 0.5);
    }
    Ok(Q8 { q, half_d })
}

/// `out[i·rows + r] = W[r] · x_i` for every row of one MXFP4 matrix and every quantized token
/// `xs[i]`, rows split over the rayon pool.
pub fn gemv(packed: &[u8], scale: &[u8], rows: usize, cols: usize, xs: &[Q8], out: &mut [f32]) -> Result<()> {
    let bad = |d: String| Err(CoreError::Shape { op: "mxfp4_q8::gemv", detail: d });
    if !cols.is_multiple_of(32) || packed.len() != rows * cols / 2 || scale.len() != rows * cols / 32 {
        return bad(format!(
            "[{rows}, {cols}] needs {} packed and {} scale bytes, got {} and {}",
            rows * cols / 2,
            rows * cols / 32,
            packed.len(),
            scale.len()
        ));
    }
    if xs.iter().any(|x| x.q.len() != cols || x.half_d.len() != cols / 32) || out.len() != xs.len() * rows {
        return bad(format!("{} tokens of {cols} values and {} outputs for {rows} rows", xs.len(), out.len()));
    }
    super::mxfp4::check_scales(scale)?;
    let (pr, sr) = (cols / 2, cols / 32);
    const CHUNK: usize = 64;
    let parts: Vec<Vec<f32>> = (0..rows.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let (r0, r1) = (c * CHUNK, ((c + 1) * CHUNK).min(rows));
            let mut o = vec![0f32; (r1 - r0) * xs.len()];
            let mut d = [0f32; 4];
            for r in r0..r1 {
                let (p, s) = (&packed[r * pr..(r + 1) * pr], &scale[r * sr..(r + 1) * sr]);
                // Up to four tokens per pass over the row: its nibbles are decoded once for them.
                for (g, group) in xs.chunks(4).enumerate() {
                    dots(p, s, group, &mut d[..group.len()]);
                    for (j, v) in d[..group.len()].iter().enumerate() {
                        o[(4 * g + j) * (r1 - r0) + r - r0] = *v;
                    }
                }
            }
            o
        })
        .collect();
    for (c, part) in parts.iter().enumerate() {
        let (r0, n) = (c * CHUNK, part.len() / xs.len().max(1));
        for i in 0..xs.len() {
            out[i * rows + r0..i * rows + r0 + n].copy_from_slice(&part[i * n..(i + 1) * n]);
        }
    }
    Ok(())
}

/// One row against up to four quantized tokens: `out[i] = row · xs[i]`.
#[inline]
pub fn dots(packed: &[u8], scale: &[u8], xs: &[Q8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if super::has_avx2_fma() && xs.len() <= 4 {
            // SAFETY: AVX2 + FMA detected at run time; the lengths are bounded inside.
            return unsafe { avx2::dots(packed, scale, xs, out) };
        }
    }
    for (o, x) in out.iter_mut().zip(xs) {
        *o = dot_scalar(packed, scale, x);
    }
}

/// The portable form of one row of [`dots`] (same integer block sums; the float sum in block
/// order).
pub fn dot_scalar(packed: &[u8], scale: &[u8], x: &Q8) -> f32 {
    let mut acc = 0f32;
    for (b, (p, &s)) in packed.chunks_exact(16).zip(scale).enumerate() {
        let q = &x.q[b * 32..b * 32 + 32];
        let mut isum = 0i32;
        for j in 0..16 {
            isum += LUT2[(p[j] & 0x0F) as usize] as i32 * q[j] as i32;
            isum += LUT2[(p[j] >> 4) as usize] as i32 * q[16 + j] as i32;
        }
        acc += isum as f32 * (x.half_d[b] * e8m0_to_f32(s));
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Up to four tokens; two accumulators per token (even and odd blocks) so that the FMA
    /// chains of one token overlap.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(packed: &[u8], scale: &[u8], xs: &[super::Q8], out: &mut [f32]) {
        let n = xs.len().min(out.len()).min(4);
        let mut blocks = scale.len().min(packed.len() / 16);
        for x in &xs[..n] {
            blocks = blocks.min(x.half_d.len()).min(x.q.len() / 32);
        }
        let lut = _mm_loadu_si128(super::LUT2.as_ptr() as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        for b in 0..blocks {
            let p = _mm_loadu_si128(packed.as_ptr().add(b * 16) as *const __m128i);
            let lo = _mm_shuffle_epi8(lut, _mm_and_si128(p, m));
            let hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(p, 4), m));
            let w = _mm256_set_m128i(hi, lo); // even columns, then odd: the order of q
            let aw = _mm256_sign_epi8(w, w); // |w|: maddubs needs one unsigned operand
            let ws = super::e8m0_to_f32(*scale.get_unchecked(b));
            for (i, x) in xs[..n].iter().enumerate() {
                let q = _mm256_loadu_si256(x.q.as_ptr().add(b * 32) as *const __m256i);
                let prod = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, w)); // |w| · (q with w's sign)
                let isum = _mm256_madd_epi16(prod, ones); // 8 × int32
                let f = _mm256_set1_ps(*x.half_d.get_unchecked(b) * ws);
                let a = &mut acc[i][b & 1];
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, *a);
            }
        }
        for i in 0..n {
            let v = _mm256_add_ps(acc[i][0], acc[i][1]);
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            out[i] = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
        }
    }
}

/// The f32 value of a [`Q8`] (tests: the exact input the integer path computes on).
pub fn dequantize(x: &Q8) -> Vec<f32> {
    let mut out = vec![0f32; x.q.len()];
    for (b, d) in x.half_d.iter().enumerate() {
        for j in 0..16 {
            out[b * 32 + 2 * j] = x.q[b * 32 + j] as f32 * 2.0 * d;
            out[b * 32 + 2 * j + 1] = x.q[b * 32 + 16 + j] as f32 * 2.0 * d;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_matrix(r: &mut impl Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        ((0..rows * cols / 2).map(|_| r.random()).collect(), (0..rows * cols / 32).map(|_| r.random_range(110..135)).collect())
    }

    fn reference(packed: &[u8], scale: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f64> {
        let w = super::super::mxfp4::decode(packed, scale, rows, cols).unwrap();
        (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum()).collect()
    }

    #[test]
    fn integer_path_equals_the_f32_product_of_its_inputs() {
        // On the dequantized activations the only rounding left is the f32 sum of block sums.
        let mut r = rand::rngs::StdRng::seed_from_u64(23);
        let (rows, cols) = (37, 32 * 11);
        let (p, s) = random_matrix(&mut r, rows, cols);
        let x: Vec<f32> = (0..cols).map(|_| r.random_range(-3.0f32..3.0)).collect();
        let q = quantize(&x).unwrap();
        let want = reference(&p, &s, rows, cols, &dequantize(&q));
        let mut out = vec![0f32; rows];
        gemv(&p, &s, rows, cols, std::slice::from_ref(&q), &mut out).unwrap();
        let scal: Vec<f32> = (0..rows).map(|i| dot_scalar(&p[i * cols / 2..(i + 1) * cols / 2], &s[i * cols / 32..(i + 1) * cols / 32], &q)).collect();
        let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt() / (rows as f64).sqrt();
        for i in 0..rows {
            assert!((out[i] as f64 - want[i]).abs() <= 1e-5 * norm, "row {i}: {} vs {}", out[i], want[i]);
            assert!((scal[i] as f64 - want[i]).abs() <= 1e-5 * norm, "row {i} scalar: {} vs {}", scal[i], want[i]);
        }
    }

    #[test]
    fn close_to_the_f32_gemv_and_batched_equals_one_by_one() {
        let mut r = rand::rngs::StdRng::seed_from_u64(24);
        let (rows, cols, t) = (130, 32 * 8, 3);
        let (p, s) = random_matrix(&mut r, rows, cols);
        let xs: Vec<Vec<f32>> = (0..t).map(|_| (0..cols).map(|_| r.random_range(-1.0f32..1.0)).collect()).collect();
        let qs: Vec<Q8> = xs.iter().map(|x| quantize(x).unwrap()).collect();
        let mut out = vec![0f32; t * rows];
        gemv(&p, &s, rows, cols, &qs, &mut out).unwrap();
        for (i, x) in xs.iter().enumerate() {
            let want = reference(&p, &s, rows, cols, x);
            let (num, den) = want.iter().zip(&out[i * rows..(i + 1) * rows]).fold((0f64, 0f64), |(n, d), (w, o)| (n + (*o as f64 - w).powi(2), d + w * w));
            // int8 activations: ~0.4% of each block's largest value per element, averaging down.
            assert!((num / den).sqrt() < 1e-2, "token {i}: rel L2 {}", (num / den).sqrt());
            let mut one = vec![0f32; rows];
            gemv(&p, &s, rows, cols, std::slice::from_ref(&qs[i]), &mut one).unwrap();
            assert_eq!(one, out[i * rows..(i + 1) * rows], "token {i}: batched differs from alone");
        }
    }

    #[test]
    fn quantize_layout_zero_blocks_and_errors() {
        let mut x = vec![0f32; 64];
        x[0] = 1.0; // even column 0 of block 0
        x[1] = -0.5; // odd column 0 of block 0
        let q = quantize(&x).unwrap();
        assert_eq!((q.q[0], q.q[16]), (127, -64));
        assert_eq!(q.half_d[1], 0.0); // an all-zero block
        assert!(q.q[32..].iter().all(|&v| v == 0));
        assert!(quantize(&[0.0; 31]).is_err());
        let (p, s) = (vec![0u8; 16], vec![255u8]);
        assert!(gemv(&p, &s, 1, 32, std::slice::from_ref(&quantize(&[0.0; 32]).unwrap()), &mut [0.0]).unwrap_err().to_string().contains("255"));
        assert!(gemv(&p, &[127], 1, 32, std::slice::from_ref(&q), &mut [0.0]).is_err(), "64 values for a 32-column row");
    }
}
