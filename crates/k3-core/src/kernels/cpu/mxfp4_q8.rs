//! MXFP4 weights × int8 activations on the CPU (issue 23: routed experts computed by the CPU
//! from host memory while a GPU holds the trunk) — around-backbone §2.2 for the weight format.
//! Not the oracle path: the activations are rounded to int8, so results differ from
//! `mxfp4::dot_row` by the activation rounding (≤ half a step of each 32-block's scale).
//!
//! An activation vector `x [cols]` is quantized per 32-value block `b` to `q = round(x / d_b)`
//! with `d_b = max|x_b| / 127` ([`quantize`]). A weight nibble maps to the integer `2·e2m1`
//! (−12..12), so one block's dot product is an exact integer sum `Σ w·q`, scaled by
//! `d_b · 2^(s−127) / 2`; only the 32-to-1 block sums round.
//!
//! Layout of `q` (the order the packed nibbles unpack to: low nibble = even column): blocks in
//! groups of four; a group holds its blocks' even columns (16 per block, block after block),
//! then their odd columns; a last group of `n < 4` blocks is laid out the same way with `n`.
//! One 64-byte load of packed weights (four blocks) then lines up with one 64-byte load of even
//! and one of odd activations.
//!
//! Kernels, chosen at run time:
//! - AVX-512 VNNI: nibbles through `vpshufb` to `w + 12` (unsigned 0..24), `vpdpbusd` into an
//!   accumulator preloaded with `−12 · Σq` per 4-byte lane ([`Q8::nbias`]), so the integer block
//!   sums are exact with no sign juggling; four int32 lanes per block, scaled in f32 per lane.
//! - AVX2: `pshufb` + `sign` + `maddubs` + `madd` per block (the llama.cpp q8 trick).
//! - Portable: the same integer block sums in plain Rust.
//!
//! Shapes: weight `[rows, cols]` as `packed [rows, cols/2]`, `scale [rows, cols/32]`; `cols` a
//! multiple of 32.

use rayon::prelude::*;

use super::mxfp4::e8m0_to_f32;
use crate::{CoreError, Result};

/// Software prefetch distance in bytes of packed weights (rows are contiguous, so it runs into
/// the next row): one core streamed MXFP4 from DRAM ~1.9× faster with a prefetch here (a Xeon
/// 8592-class VM: 6.5 → 12 GB/s on one thread, `vpdpbusd` kernel). The AVX-512 kernel
/// prefetches 4096 B ahead into L2 (see [`Hint`]) since the 16-core H100 hosts' sweep of
/// 2026-12-06 (README, "One GPU host"); the AVX2 kernel, not measured there, keeps 2048 B into
/// L1. `K3_Q8_PREFETCH=BYTES` overrides it (read once; for tuning on another machine — with
/// every core streaming, memory latency grows).
#[cfg(target_arch = "x86_64")]
const PF: usize = 2048;
#[cfg(target_arch = "x86_64")]
const PF_AVX512: usize = 4096;

/// The prefetch distance in force: [`PF_AVX512`] / [`PF`] by kernel, or `K3_Q8_PREFETCH`.
#[cfg(target_arch = "x86_64")]
fn pf() -> usize {
    static D: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *D.get_or_init(|| {
        let default = if has_avx512_vnni() { PF_AVX512 } else { PF };
        std::env::var("K3_Q8_PREFETCH").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    })
}

/// Which cache level the software prefetch fills (`K3_Q8_PREFETCH_HINT`, read once): `t1` (L2:
/// no L1 fill buffer held while the line comes, so more lines can be in flight per core; the
/// AVX-512 kernel's default), `t0` (L1; the AVX2 kernel's default, and the AVX-512 one's before
/// 2026-12-06), `t2`, `nta`, or `t1+t0` (L2 at the prefetch distance and L1 at an eighth of
/// it). For tuning on a machine whose every core streams experts.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hint {
    T0,
    T1,
    T2,
    Nta,
    T1T0,
}

#[cfg(target_arch = "x86_64")]
fn hint() -> Hint {
    static H: std::sync::OnceLock<Hint> = std::sync::OnceLock::new();
    *H.get_or_init(|| match std::env::var("K3_Q8_PREFETCH_HINT").as_deref().map(str::trim) {
        Ok("t0") => Hint::T0,
        Ok("t2") => Hint::T2,
        Ok("nta") => Hint::Nta,
        Ok("t1+t0") => Hint::T1T0,
        Ok("t1") => Hint::T1,
        Err(_) | Ok("") => default_hint(),
        Ok(other) => {
            let d = default_hint();
            eprintln!("k3: K3_Q8_PREFETCH_HINT={other:?} is none of t0, t1, t2, nta, t1+t0; using the default ({d:?})");
            d
        }
    })
}

/// The kernel's default [`Hint`]: L2 for AVX-512 VNNI, L1 otherwise.
#[cfg(target_arch = "x86_64")]
fn default_hint() -> Hint {
    if has_avx512_vnni() {
        Hint::T1
    } else {
        Hint::T0
    }
}

/// The software prefetch of the weight line `pf` bytes past `at` (and, for `t1+t0`, of the
/// line `pf / 8` past it into L1). Prefetches never fault, so the address may run past the row.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch(at: *const u8, pf: usize, h: Hint) {
    use std::arch::x86_64::*;
    let p = at.wrapping_add(pf) as *const i8;
    // SAFETY: a prefetch is a hint; it reads nothing and cannot fault.
    unsafe {
        match h {
            Hint::T0 => _mm_prefetch::<_MM_HINT_T0>(p),
            Hint::T1 => _mm_prefetch::<_MM_HINT_T1>(p),
            Hint::T2 => _mm_prefetch::<_MM_HINT_T2>(p),
            Hint::Nta => _mm_prefetch::<_MM_HINT_NTA>(p),
            Hint::T1T0 => {
                _mm_prefetch::<_MM_HINT_T1>(p);
                _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(pf / 8) as *const i8);
            }
        }
    }
}

/// `2·e2m1` of each nibble as a signed byte.
const LUT2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Where block `b` of `nb` blocks keeps its 16 even and 16 odd activations in [`Q8::q`].
#[inline]
pub fn block_offsets(b: usize, nb: usize) -> (usize, usize) {
    let (g, i) = (b / 4, b % 4);
    let in_group = (nb - 4 * g).min(4);
    (g * 128 + i * 16, g * 128 + in_group * 16 + i * 16)
}

/// One activation vector in int8 blocks (see the module doc for the order).
#[derive(Clone, Debug)]
pub struct Q8 {
    /// `cols` values in the grouped even/odd order of [`block_offsets`].
    pub q: Vec<i8>,
    /// Per block: `d_b / 2` (the ½ undoes the doubled nibble table).
    pub half_d: Vec<f32>,
    /// Per block, repeated for its four 32-bit lanes: `d_b / 2` (`cols/8` values, block-major).
    pub half_d_lanes: Vec<f32>,
    /// Per 32-bit lane of a block (4 even + 4 odd bytes: lane `j` covers even and odd bytes
    /// `4j..4j+4` of the block): `−12 · Σq` over those 8 bytes, so that `Σ (w + 12)·q` over the
    /// lane's bytes plus it is `Σ w·q` (`cols/8` values, block-major).
    pub nbias: Vec<i32>,
}

impl Q8 {
    pub fn cols(&self) -> usize {
        self.q.len()
    }
}

/// Quantizes `x` (length a multiple of 32) to [`Q8`].
pub fn quantize(x: &[f32]) -> Result<Q8> {
    if !x.len().is_multiple_of(32) {
        return Err(CoreError::Shape { op: "mxfp4_q8::quantize", detail: format!("{} values: a multiple of 32 is needed", x.len()) });
    }
    let nb = x.len() / 32;
    let mut q = vec![0i8; x.len()];
    let mut half_d = Vec::with_capacity(nb);
    let mut half_d_lanes = Vec::with_capacity(nb * 4);
    let mut nbias = Vec::with_capacity(nb * 4);
    for (b, xb) in x.chunks_exact(32).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let (eo, oo) = block_offsets(b, nb);
        for j in 0..16 {
            q[eo + j] = (xb[2 * j] * inv).round().clamp(-127.0, 127.0) as i8;
            q[oo + j] = (xb[2 * j + 1] * inv).round().clamp(-127.0, 127.0) as i8;
        }
        for lane in 0..4 {
            let s: i32 = (0..4).map(|k| q[eo + 4 * lane + k] as i32 + q[oo + 4 * lane + k] as i32).sum();
            nbias.push(-12 * s);
            half_d_lanes.push(d * 0.5);
        }
        half_d.push(d * 0.5);
    }
    Ok(Q8 { q, half_d, half_d_lanes, nbias })
}

/// Checks a weight `[rows, cols]` and tokens against each other (no scale bytes read).
pub fn check(packed: &[u8], scale: &[u8], rows: usize, cols: usize, xs: &[&Q8]) -> Result<()> {
    let bad = |d: String| Err(CoreError::Shape { op: "mxfp4_q8", detail: d });
    if !cols.is_multiple_of(32) || packed.len() != rows * cols / 2 || scale.len() != rows * cols / 32 {
        return bad(format!(
            "[{rows}, {cols}] needs {} packed and {} scale bytes, got {} and {}",
            rows * cols / 2,
            rows * cols / 32,
            packed.len(),
            scale.len()
        ));
    }
    if xs.iter().any(|x| x.q.len() != cols || x.half_d.len() != cols / 32 || x.nbias.len() != cols / 8 || x.half_d_lanes.len() != cols / 8) {
        return bad(format!("every token must have {cols} values for a [{rows}, {cols}] weight"));
    }
    Ok(())
}

/// `out[i·rows + r] = W[r] · x_i` for every row of one MXFP4 matrix and every quantized token
/// `xs[i]`, rows split over the rayon pool. Checks shapes and scale bytes.
pub fn gemv(packed: &[u8], scale: &[u8], rows: usize, cols: usize, xs: &[Q8], out: &mut [f32]) -> Result<()> {
    let xs: Vec<&Q8> = xs.iter().collect();
    check(packed, scale, rows, cols, &xs)?;
    if out.len() != xs.len() * rows {
        return Err(CoreError::Shape { op: "mxfp4_q8::gemv", detail: format!("{} tokens and {} outputs for {rows} rows", xs.len(), out.len()) });
    }
    super::mxfp4::check_scales(scale)?;
    const CHUNK: usize = 64;
    let parts: Vec<Vec<f32>> = (0..rows.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let (r0, r1) = (c * CHUNK, ((c + 1) * CHUNK).min(rows));
            let mut o = vec![0f32; (r1 - r0) * xs.len()];
            rows_into(packed, scale, cols, r0..r1, &xs, &mut o, r1 - r0);
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

/// Rows `rs` of a checked weight (see [`check`]; scale bytes already known not to be 255)
/// against every token, on the calling thread: `out[i·stride + (r − rs.start)] = W[r] · x_i`.
pub fn rows_into(packed: &[u8], scale: &[u8], cols: usize, rs: std::ops::Range<usize>, xs: &[&Q8], out: &mut [f32], stride: usize) {
    let (pr, sr) = (cols / 2, cols / 32);
    let mut d = [0f32; 4];
    for r in rs.clone() {
        let (p, s) = (&packed[r * pr..(r + 1) * pr], &scale[r * sr..(r + 1) * sr]);
        // Up to four tokens per pass over the row: its nibbles are decoded once for them.
        for (g, group) in xs.chunks(4).enumerate() {
            dots(p, s, group, &mut d[..group.len()]);
            for (j, v) in d[..group.len()].iter().enumerate() {
                out[(4 * g + j) * stride + r - rs.start] = *v;
            }
        }
    }
}

/// Which kernel [`dots`] runs on this CPU: `avx512-vnni`, `avx2` or `portable`.
pub fn kernel_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512_vnni() {
            return "avx512-vnni";
        }
        if super::has_avx2_fma() {
            return "avx2";
        }
    }
    "portable"
}

#[cfg(target_arch = "x86_64")]
fn has_avx512_vnni() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(|| {
        std::env::var_os("K3_NO_AVX512").is_none()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni")
    })
}

/// One row against up to four quantized tokens: `out[i] = row · xs[i]`.
#[inline]
pub fn dots(packed: &[u8], scale: &[u8], xs: &[&Q8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let ok = xs.len() <= 4
            && out.len() >= xs.len()
            && xs.iter().all(|x| {
                x.q.len() == 2 * packed.len() && x.half_d.len() == scale.len() && x.nbias.len() == 4 * scale.len() && x.half_d_lanes.len() == 4 * scale.len()
            });
        if ok && packed.len() == 16 * scale.len() {
            if has_avx512_vnni() {
                // SAFETY: AVX-512 F/BW/VNNI detected at run time; lengths checked above.
                return unsafe { avx512::dots(packed, scale, xs, out) };
            }
            if super::has_avx2_fma() {
                // SAFETY: AVX2 + FMA detected at run time; lengths checked above.
                return unsafe { avx2::dots(packed, scale, xs, out) };
            }
        }
    }
    for (o, x) in out.iter_mut().zip(xs) {
        *o = dot_scalar(packed, scale, x);
    }
}

/// The exact integer sum of one block of a row against one token.
#[inline]
fn block_isum(p: &[u8], x: &Q8, b: usize, nb: usize) -> i32 {
    let (eo, oo) = block_offsets(b, nb);
    let mut isum = 0i32;
    for j in 0..16 {
        isum += LUT2[(p[j] & 0x0F) as usize] as i32 * x.q[eo + j] as i32;
        isum += LUT2[(p[j] >> 4) as usize] as i32 * x.q[oo + j] as i32;
    }
    isum
}

/// The portable form of one row of [`dots`] (same integer block sums; the float sum in block
/// order).
pub fn dot_scalar(packed: &[u8], scale: &[u8], x: &Q8) -> f32 {
    let nb = scale.len();
    let mut acc = 0f32;
    for (b, (p, &s)) in packed.chunks_exact(16).zip(scale).enumerate() {
        acc += block_isum(p, x, b, nb) as f32 * (x.half_d[b] * e8m0_to_f32(s));
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{block_isum, Q8};

    /// `2·e2m1 + 12` of each nibble: unsigned, for `vpdpbusd`'s unsigned operand.
    const LUT_U: [u8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

    /// Up to four tokens. Per group of four blocks: one 64-byte load of nibbles, two `vpshufb`
    /// (even and odd columns), per token two `vpdpbusd` into `nbias` → exact int32 per lane
    /// (four lanes a block), then `f32(lane) · d/2 · 2^(s−127)` accumulated per lane.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn dots(packed: &[u8], scale: &[u8], xs: &[&Q8], out: &mut [f32]) {
        let nb = scale.len();
        let groups = nb / 4;
        let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(LUT_U.as_ptr() as *const __m128i));
        let m = _mm512_set1_epi8(0x0F);
        // Lane l of a group belongs to block l / 4.
        let idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        let sub = _mm512_set1_epi32(0x0040_0000); // E8M0 0 = 2^-127, an f32 subnormal
        let mut acc = [[_mm512_setzero_ps(); 2]; 4];
        let (pf, h) = (super::pf(), super::hint());
        for g in 0..groups {
            let p = _mm512_loadu_si512(packed.as_ptr().add(g * 64) as *const __m512i);
            super::prefetch(packed.as_ptr().wrapping_add(g * 64), pf, h);
            let we = _mm512_shuffle_epi8(lut, _mm512_and_si512(p, m));
            let wo = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p, 4), m));
            // 2^(s−127) of the group's four scales, each on its block's four lanes.
            let s4 = _mm_cvtsi32_si128((scale.as_ptr().add(g * 4) as *const i32).read_unaligned());
            let s = _mm512_permutexvar_epi32(idx, _mm512_cvtepu8_epi32(s4));
            let bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(s, 23), _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()), sub);
            let ws = _mm512_castsi512_ps(bits);
            for (x, acc) in xs.iter().zip(&mut acc) {
                let qp = x.q.as_ptr().add(g * 128);
                let qe = _mm512_loadu_si512(qp as *const __m512i);
                let qo = _mm512_loadu_si512(qp.add(64) as *const __m512i);
                let nbias = _mm512_loadu_si512(x.nbias.as_ptr().add(g * 16) as *const __m512i);
                let d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(nbias, we, qe), wo, qo);
                let hd = _mm512_loadu_ps(x.half_d_lanes.as_ptr().add(g * 16));
                let a = &mut acc[g & 1];
                *a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(d), hd), ws, *a);
            }
        }
        for ((x, acc), o) in xs.iter().zip(&acc).zip(out.iter_mut()) {
            let mut v = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            // A last group of fewer than four blocks: block by block.
            for b in 4 * groups..nb {
                v += block_isum(&packed[b * 16..b * 16 + 16], x, b, nb) as f32 * (x.half_d[b] * super::e8m0_to_f32(scale[b]));
            }
            *o = v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{block_offsets, Q8};

    /// Up to four tokens; two accumulators per token (even and odd blocks) so that the FMA
    /// chains of one token overlap.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots(packed: &[u8], scale: &[u8], xs: &[&Q8], out: &mut [f32]) {
        let nb = scale.len();
        let lut = _mm_loadu_si128(super::LUT2.as_ptr() as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let (pf, h) = (super::pf(), super::hint());
        for b in 0..nb {
            let p = _mm_loadu_si128(packed.as_ptr().add(b * 16) as *const __m128i);
            if b % 4 == 0 {
                super::prefetch(packed.as_ptr().wrapping_add(b * 16), pf, h);
            }
            let lo = _mm_shuffle_epi8(lut, _mm_and_si128(p, m));
            let hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(p, 4), m));
            let w = _mm256_set_m128i(hi, lo); // even columns, then odd
            let aw = _mm256_sign_epi8(w, w); // |w|: maddubs needs one unsigned operand
            let ws = super::e8m0_to_f32(*scale.get_unchecked(b));
            let (eo, oo) = block_offsets(b, nb);
            for (x, acc) in xs.iter().zip(&mut acc) {
                let q = _mm256_loadu2_m128i(x.q.as_ptr().add(oo) as *const __m128i, x.q.as_ptr().add(eo) as *const __m128i);
                let prod = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(q, w)); // |w| · (q with w's sign)
                let isum = _mm256_madd_epi16(prod, ones); // 8 × int32
                let f = _mm256_set1_ps(*x.half_d.get_unchecked(b) * ws);
                let a = &mut acc[b & 1];
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, *a);
            }
        }
        for (acc, o) in acc.iter().zip(out.iter_mut()).take(xs.len()) {
            let v = _mm256_add_ps(acc[0], acc[1]);
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            *o = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
        }
    }
}

/// The f32 value of a [`Q8`] in column order (tests: the exact input the integer path computes
/// on).
pub fn dequantize(x: &Q8) -> Vec<f32> {
    let nb = x.half_d.len();
    let mut out = vec![0f32; x.q.len()];
    for (b, d) in x.half_d.iter().enumerate() {
        let (eo, oo) = block_offsets(b, nb);
        for j in 0..16 {
            out[b * 32 + 2 * j] = x.q[eo + j] as f32 * 2.0 * d;
            out[b * 32 + 2 * j + 1] = x.q[oo + j] as f32 * 2.0 * d;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_matrix(r: &mut impl Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
        // Scales around 2^0 with the subnormal 0 in the mix.
        let scale = (0..rows * cols / 32).map(|i| if i % 37 == 5 { 0 } else { r.random_range(110..135) }).collect();
        ((0..rows * cols / 2).map(|_| r.random()).collect(), scale)
    }

    fn reference(packed: &[u8], scale: &[u8], rows: usize, cols: usize, x: &[f32]) -> Vec<f64> {
        let w = super::super::mxfp4::decode(packed, scale, rows, cols).unwrap();
        (0..rows).map(|r| (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum()).collect()
    }

    #[test]
    fn integer_path_equals_the_f32_product_of_its_inputs() {
        // On the dequantized activations the only rounding left is the f32 sum of block sums.
        // 11 and 8 blocks: a partial last group and whole groups only.
        for (seed, nbk) in [(23u64, 11usize), (25, 8), (26, 1)] {
            let mut r = rand::rngs::StdRng::seed_from_u64(seed);
            let (rows, cols) = (37, 32 * nbk);
            let (p, s) = random_matrix(&mut r, rows, cols);
            let x: Vec<f32> = (0..cols).map(|_| r.random_range(-3.0f32..3.0)).collect();
            let q = quantize(&x).unwrap();
            let want = reference(&p, &s, rows, cols, &dequantize(&q));
            let mut out = vec![0f32; rows];
            gemv(&p, &s, rows, cols, std::slice::from_ref(&q), &mut out).unwrap();
            let scal: Vec<f32> = (0..rows).map(|i| dot_scalar(&p[i * cols / 2..(i + 1) * cols / 2], &s[i * cols / 32..(i + 1) * cols / 32], &q)).collect();
            let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt() / (rows as f64).sqrt();
            for i in 0..rows {
                assert!((out[i] as f64 - want[i]).abs() <= 1e-5 * norm, "{nbk} blocks, row {i} ({}): {} vs {}", kernel_name(), out[i], want[i]);
                assert!((scal[i] as f64 - want[i]).abs() <= 1e-5 * norm, "{nbk} blocks, row {i} scalar: {} vs {}", scal[i], want[i]);
            }
        }
    }

    #[test]
    fn close_to_the_f32_gemv_and_batched_equals_one_by_one() {
        let mut r = rand::rngs::StdRng::seed_from_u64(24);
        let (rows, cols, t) = (130, 32 * 10, 6);
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
    fn quantize_layout_bias_zero_blocks_and_errors() {
        let mut x = vec![0f32; 64];
        x[0] = 1.0; // even column 0 of block 0
        x[1] = -0.5; // odd column 0 of block 0
        x[34] = 2.0; // even column 1 of block 1
        let q = quantize(&x).unwrap();
        // Two blocks form one (partial) group: evens of blocks 0 and 1, then their odds.
        assert_eq!(block_offsets(0, 2), (0, 32));
        assert_eq!(block_offsets(1, 2), (16, 48));
        assert_eq!(block_offsets(5, 8), (128 + 16, 128 + 64 + 16));
        assert_eq!((q.q[0], q.q[32], q.q[17]), (127, -64, 127));
        assert_eq!(q.nbias[0], -12 * (127 - 64));
        assert_eq!(q.nbias[4], -12 * 127); // block 1, lane 0
        assert_eq!(q.half_d_lanes[..8], [q.half_d[0], q.half_d[0], q.half_d[0], q.half_d[0], q.half_d[1], q.half_d[1], q.half_d[1], q.half_d[1]]);
        let z = quantize(&[0.0; 32]).unwrap();
        assert_eq!(z.half_d[0], 0.0); // an all-zero block
        assert!(z.q.iter().all(|&v| v == 0));
        assert_eq!(dequantize(&q)[34], 2.0);
        assert!(quantize(&[0.0; 31]).is_err());
        let (p, s) = (vec![0u8; 16], vec![255u8]);
        assert!(gemv(&p, &s, 1, 32, std::slice::from_ref(&z), &mut [0.0]).unwrap_err().to_string().contains("255"));
        assert!(gemv(&p, &[127], 1, 32, std::slice::from_ref(&q), &mut [0.0]).is_err(), "64 values for a 32-column row");
    }

    #[test]
    fn every_kernel_gives_the_same_block_sums() {
        // The vector kernels against the portable one on the same inputs, 1..4 tokens.
        let mut r = rand::rngs::StdRng::seed_from_u64(27);
        let cols = 32 * 13;
        let (p, s) = random_matrix(&mut r, 1, cols);
        let qs: Vec<Q8> = (0..4).map(|_| quantize(&(0..cols).map(|_| r.random_range(-2.0f32..2.0)).collect::<Vec<_>>()).unwrap()).collect();
        let qs: Vec<&Q8> = qs.iter().collect();
        for n in 1..=4 {
            let mut out = [0f32; 4];
            dots(&p, &s, &qs[..n], &mut out[..n]);
            for i in 0..n {
                let want = dot_scalar(&p, &s, qs[i]);
                assert!((out[i] - want).abs() <= 1e-5 * want.abs().max(1.0), "{} vs portable, token {i} of {n}: {} vs {want}", kernel_name(), out[i]);
            }
        }
    }
}
