//! MXFP4 (compressed-tensors `mxfp4-pack-quantized`) decode — around-backbone §2.2.
//!
//! Logical weight `[out, in]`; `packed[o, i/2]` holds column `i` in its low nibble when `i` is
//! even and its high nibble when odd; nibble bit 3 is the sign, bits 0..2 index
//! `{0, .5, 1, 1.5, 2, 3, 4, 6}`; `scale[o, i/32]` is an E8M0 exponent: factor `2^(s−127)`.
//! Nibble 8 decodes to −0.0. Scale byte 255 (NaN in the OCP MX spec) is rejected.

use crate::{CoreError, Result};

/// e2m1 value of each nibble 0..15 (nibble 8 is −0.0).
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// `2^(s−127)` as an exact f32 (exact for every s in 0..=254; s = 0 is subnormal).
#[inline]
pub fn e8m0_to_f32(s: u8) -> f32 {
    if s == 0 {
        // 2^-127 is subnormal in f32: 2^-149 · 2^22, bit pattern 0x0040_0000.
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((s as u32) << 23)
    }
}

/// Checks every scale byte; 255 is NaN in the MX spec and never valid in a checkpoint.
pub fn check_scales(scale: &[u8]) -> Result<()> {
    if let Some(p) = scale.iter().position(|&s| s == 255) {
        return Err(CoreError::Msg(format!("MXFP4 scale byte 255 (NaN in the OCP MX spec) at flat index {p}: the checkpoint is corrupt")));
    }
    Ok(())
}

/// Decodes one row (`cols` logical values) into `out`. `packed` is that row's `cols/2` bytes,
/// `scale` its `cols/32` bytes.
#[inline]
pub fn decode_row(packed: &[u8], scale: &[u8], out: &mut [f32]) {
    for (g, (chunk, &s)) in packed.chunks_exact(16).zip(scale).enumerate() {
        let f = e8m0_to_f32(s);
        let o = &mut out[g * 32..g * 32 + 32];
        for (j, &b) in chunk.iter().enumerate() {
            o[2 * j] = E2M1[(b & 0x0F) as usize] * f;
            o[2 * j + 1] = E2M1[(b >> 4) as usize] * f;
        }
    }
}

/// Decodes a whole `[rows, cols]` matrix to f32 (for tests and reference paths only; the
/// engine computes from the packed form).
pub fn decode(packed: &[u8], scale: &[u8], rows: usize, cols: usize) -> Result<Vec<f32>> {
    if !cols.is_multiple_of(32) || packed.len() != rows * cols / 2 || scale.len() != rows * cols / 32 {
        return Err(CoreError::Shape {
            op: "mxfp4::decode",
            detail: format!("[{rows}, {cols}] needs {} packed and {} scale bytes, got {} and {}", rows * cols / 2, rows * cols / 32, packed.len(), scale.len()),
        });
    }
    check_scales(scale)?;
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        decode_row(&packed[r * cols / 2..(r + 1) * cols / 2], &scale[r * cols / 32..(r + 1) * cols / 32], &mut out[r * cols..(r + 1) * cols]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn scales_are_exact_powers_of_two() {
        for s in 0u8..=254 {
            assert_eq!(e8m0_to_f32(s) as f64, 2f64.powi(s as i32 - 127), "s={s}");
        }
    }
    #[test]
    fn low_nibble_is_even_column() {
        let mut packed = vec![0u8; 16];
        packed[0] = 0x91; // col0 = +0.5, col1 = -0.5
        let out = decode(&packed, &[127], 1, 32).unwrap();
        assert_eq!(out[0], 0.5);
        assert_eq!(out[1], -0.5);
        assert!(out[2] == 0.0 && out[2].is_sign_positive());
    }
    #[test]
    fn nibble_8_is_negative_zero_and_255_rejected() {
        let out = decode(&[0x88; 16], &[127], 1, 32).unwrap();
        assert!(out.iter().all(|v| *v == 0.0 && v.is_sign_negative()));
        let e = decode(&[0; 16], &[255], 1, 32).unwrap_err().to_string();
        assert!(e.contains("255"));
    }
}

/// `out[i] = Σ_c W[r, c] · x_i[c]` for one MXFP4 row and `xs.len()` token vectors, decoding
/// the row group by group in registers (AVX2 + FMA when available).
#[inline]
pub fn dot_row(packed: &[u8], scale: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::available() {
            // SAFETY: the features were detected at run time; slice lengths are checked inside.
            return unsafe { avx2::dot_row(packed, scale, xs, out) };
        }
    }
    let mut buf = [0f32; 32];
    out.iter_mut().for_each(|o| *o = 0.0);
    for (g, (chunk, &s)) in packed.chunks_exact(16).zip(scale).enumerate() {
        decode_row(chunk, &[s], &mut buf);
        for (o, x) in out.iter_mut().zip(xs) {
            *o += buf.iter().zip(&x[g * 32..g * 32 + 32]).map(|(a, b)| a * b).sum::<f32>();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    pub(crate) use super::super::has_avx2_fma as available;

    /// 2·E2M1 as signed bytes (so the table is integral); the 0.5 goes into the scale.
    const LUT2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

    /// The 32 weights of one group as four 8-lane vectors, multiplied by `f` (= scale / 2).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group(p: *const u8, f: f32) -> [__m256; 4] {
        let (w, fv) = (group_int(p), _mm256_set1_ps(f));
        [_mm256_mul_ps(w[0], fv), _mm256_mul_ps(w[1], fv), _mm256_mul_ps(w[2], fv), _mm256_mul_ps(w[3], fv)]
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// `scale / 2` for every E8M0 byte (the 0.5 undoes the doubled LUT).
    fn half_scales() -> &'static [f32; 256] {
        static T: OnceLock<[f32; 256]> = OnceLock::new();
        T.get_or_init(|| std::array::from_fn(|s| super::e8m0_to_f32(s as u8) * 0.5))
    }

    /// The 32 weights of one group as integers (2·E2M1) in four 8-lane f32 vectors.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group_int(p: *const u8) -> [__m256; 4] {
        let lut = _mm_loadu_si128(LUT2.as_ptr() as *const __m128i);
        let b = _mm_loadu_si128(p as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m));
        let hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m));
        let c0 = _mm_unpacklo_epi8(lo, hi);
        let c1 = _mm_unpackhi_epi8(lo, hi);
        [cvt_i8(c0), cvt_i8(_mm_srli_si128(c0, 8)), cvt_i8(c1), cvt_i8(_mm_srli_si128(c1, 8))]
    }

    /// Eight signed bytes (low half of `v`) → eight f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn cvt_i8(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    /// One group's unscaled products with `x` (32 lanes as four vectors), summed to 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn group_dot(p: *const u8, xv: &[__m256; 4]) -> __m256 {
        let w = group_int(p);
        let mut a = _mm256_mul_ps(w[0], xv[0]);
        a = _mm256_fmadd_ps(w[1], xv[1], a);
        a = _mm256_fmadd_ps(w[2], xv[2], a);
        _mm256_fmadd_ps(w[3], xv[3], a)
    }

    /// Two rows against one token: `out[j] = row_j · x`. The scale is applied once per group
    /// and the x loads are shared by both rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_rows2(p0: &[u8], s0: &[u8], p1: &[u8], s1: &[u8], x: &[f32]) -> [f32; 2] {
        let groups = s0.len().min(s1.len()).min(p0.len() / 16).min(p1.len() / 16).min(x.len() / 32);
        let hs = half_scales();
        let (mut t0, mut t1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for g in 0..groups {
            let xp = x.as_ptr().add(g * 32);
            let xv = [_mm256_loadu_ps(xp), _mm256_loadu_ps(xp.add(8)), _mm256_loadu_ps(xp.add(16)), _mm256_loadu_ps(xp.add(24))];
            t0 = _mm256_fmadd_ps(group_dot(p0.as_ptr().add(g * 16), &xv), _mm256_set1_ps(hs[s0[g] as usize]), t0);
            t1 = _mm256_fmadd_ps(group_dot(p1.as_ptr().add(g * 16), &xv), _mm256_set1_ps(hs[s1[g] as usize]), t1);
        }
        [hsum(t0), hsum(t1)]
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_row(packed: &[u8], scale: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        let groups = scale.len().min(packed.len() / 16);
        let mut acc = [_mm256_setzero_ps(); 4];
        let nt = xs.len().min(out.len()).min(4);
        for g in 0..groups {
            let w = group(packed.as_ptr().add(g * 16), half_scales()[scale[g] as usize]);
            for (i, x) in xs.iter().take(nt).enumerate() {
                let xp = x[g * 32..g * 32 + 32].as_ptr();
                let mut a = acc[i];
                a = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), a);
                a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), a);
                a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), a);
                a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), a);
                acc[i] = a;
            }
        }
        for i in 0..nt {
            out[i] = hsum(acc[i]);
        }
    }

    /// Decodes a whole row (used by the GEMM path's tile decode).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn decode_row(packed: &[u8], scale: &[u8], out: &mut [f32]) {
        let groups = scale.len().min(packed.len() / 16).min(out.len() / 32);
        for g in 0..groups {
            let w = group(packed.as_ptr().add(g * 16), half_scales()[scale[g] as usize]);
            let op = out[g * 32..g * 32 + 32].as_mut_ptr();
            for (j, v) in w.iter().enumerate() {
                _mm256_storeu_ps(op.add(8 * j), *v);
            }
        }
    }
}

/// Two rows against one token vector (the decode GEMV's inner step); `None` when the CPU lacks
/// AVX2 + FMA (callers then use [`dot_row`]).
#[inline]
pub fn dot_rows2(p0: &[u8], s0: &[u8], p1: &[u8], s1: &[u8], x: &[f32]) -> Option<[f32; 2]> {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::available() {
            // SAFETY: the features were detected at run time; lengths are bounded inside.
            return Some(unsafe { avx2::dot_rows2(p0, s0, p1, s1, x) });
        }
    }
    let _ = (p0, s0, p1, s1, x);
    None
}

/// Fast row decode for compute paths (−0.0 may come out as +0.0; values are otherwise exact).
#[inline]
pub fn decode_row_fast(packed: &[u8], scale: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::available() {
            // SAFETY: the features were detected at run time.
            return unsafe { avx2::decode_row(packed, scale, out) };
        }
    }
    decode_row(packed, scale, out)
}
