//! The FP8 (E4M3) cache formats, defined on the CPU (around-backbone §2.4, text-backbone §5.8):
//! the GPU kernels that write and read them (`kernels/cuda/mla.cu`, `dsa.cu`) are tested
//! against these functions.
//!
//! Values are quantized in **tiles of 128**: each tile has one `f32` scale, a power of two chosen
//! so that the tile's largest magnitude fits E4M3's ±448 ([`tile_scale`]), and stores
//! `e4m3(x / scale)` (round to nearest even, saturating: NVIDIA's `__NV_SATFINITE`, as the
//! `float8` crate implements it); a value reads back as `e4m3 · scale`. A power-of-two scale
//! makes the division exact and every stored value exact in BF16.
//!
//! - [`LatentFp8`] — one token's MLA cache row, vLLM's `fp8_ds_mla`: the normed latent `c_kv`
//!   `[r]` as E4M3, its `ceil(r/128)` f32 scales, padding to 16 bytes, the raw `k_pe` `[dr]` as
//!   BF16 (unquantized), padding to 16 bytes. K3 (`r` 512, `dr` 64): 512 + 16 + 128 = **656 B**
//!   instead of 1152 in BF16.
//! - [`KeyFp8`] — one token's DSA indexer key `[id]`: E4M3 then the f32 scales, padded to 4
//!   bytes. K3.1 (`id` 128): **132 B** instead of 256 in BF16.

use float8::F8E4M3;
use half::bf16;

/// Values per scale.
pub const TILE: usize = 128;
/// E4M3's largest finite magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// `x` as E4M3 bits: round to nearest even, magnitudes beyond 448 saturate to ±448, NaN → 0x7f.
pub fn e4m3(x: f32) -> u8 {
    F8E4M3::from_f32(x).to_bits()
}

/// The value of E4M3 bits `b` (exact in f32).
pub fn e4m3_value(b: u8) -> f32 {
    F8E4M3::from_bits(b).to_f32()
}

/// The scale of a tile whose largest magnitude is `amax`: the smallest power of two `s` with
/// `amax / s <= 448` (computed from the bits of the f32 quotient `amax / 448`, the same way on
/// the GPU); 1 for an all-zero tile (or NaN), at least 2^-126 and at most 2^127.
pub fn tile_scale(amax: f32) -> f32 {
    let t = amax / E4M3_MAX;
    if t.is_nan() || t <= 0.0 {
        return 1.0;
    }
    if t < f32::MIN_POSITIVE {
        return f32::MIN_POSITIVE;
    }
    let bits = t.to_bits();
    let mut e = bits >> 23;
    if bits & 0x7f_ffff != 0 {
        e += 1;
    }
    f32::from_bits(e.min(254) << 23)
}

/// Quantizes `x` tile by tile: `q[j] = e4m3(x[j] / scales[j / 128])`.
pub fn encode_tiles(x: &[f32], q: &mut [u8], scales: &mut [f32]) {
    debug_assert_eq!(x.len(), q.len());
    debug_assert_eq!(scales.len(), x.len().div_ceil(TILE));
    for ((xt, qt), s) in x.chunks(TILE).zip(q.chunks_mut(TILE)).zip(scales.iter_mut()) {
        let amax = xt.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *s = tile_scale(amax);
        let inv = 1.0 / *s; // exact: a power of two
        for (o, v) in qt.iter_mut().zip(xt) {
            *o = e4m3(v * inv);
        }
    }
}

/// The values of tiles written by [`encode_tiles`].
pub fn decode_tiles(q: &[u8], scales: &[f32], out: &mut [f32]) {
    for ((qt, s), ot) in q.chunks(TILE).zip(scales).zip(out.chunks_mut(TILE)) {
        for (o, b) in ot.iter_mut().zip(qt) {
            *o = e4m3_value(*b) * s;
        }
    }
}

fn read_f32(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One token's MLA cache row in the `fp8_ds_mla` layout (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentFp8 {
    /// Latent width (`kv_lora_rank`).
    pub r: usize,
    /// `k_pe` width (`qk_rope_head_dim`).
    pub dr: usize,
}

impl LatentFp8 {
    pub fn tiles(&self) -> usize {
        self.r.div_ceil(TILE)
    }
    /// Byte offset of the f32 scales.
    pub fn scale_offset(&self) -> usize {
        self.r
    }
    /// Byte offset of the BF16 `k_pe`.
    pub fn pe_offset(&self) -> usize {
        (self.r + 4 * self.tiles()).next_multiple_of(16)
    }
    /// Bytes per token (a multiple of 16).
    pub fn row_bytes(&self) -> usize {
        (self.pe_offset() + 2 * self.dr).next_multiple_of(16)
    }

    /// `row` `[r + dr]` (normed latent, then raw `k_pe`) into `out` `[row_bytes]`.
    pub fn encode(&self, row: &[f32], out: &mut [u8]) {
        assert_eq!(row.len(), self.r + self.dr, "LatentFp8::encode: row of {} values, layout needs r + dr = {}", row.len(), self.r + self.dr);
        assert_eq!(out.len(), self.row_bytes(), "LatentFp8::encode: {} bytes, layout needs {}", out.len(), self.row_bytes());
        out.fill(0);
        let mut scales = vec![0.0f32; self.tiles()];
        encode_tiles(&row[..self.r], &mut out[..self.r], &mut scales);
        for (j, s) in scales.iter().enumerate() {
            out[self.r + 4 * j..self.r + 4 * j + 4].copy_from_slice(&s.to_le_bytes());
        }
        let pe = self.pe_offset();
        for (j, v) in row[self.r..].iter().enumerate() {
            out[pe + 2 * j..pe + 2 * j + 2].copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
        }
    }

    /// The `r + dr` values a row of bytes holds (what attention reads).
    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(bytes.len(), self.row_bytes(), "LatentFp8::decode: {} bytes, layout needs {}", bytes.len(), self.row_bytes());
        assert_eq!(out.len(), self.r + self.dr, "LatentFp8::decode: {} outputs, layout holds {}", out.len(), self.r + self.dr);
        let scales: Vec<f32> = (0..self.tiles()).map(|j| read_f32(bytes, self.r + 4 * j)).collect();
        decode_tiles(&bytes[..self.r], &scales, &mut out[..self.r]);
        let pe = self.pe_offset();
        for (j, o) in out[self.r..].iter_mut().enumerate() {
            *o = bf16::from_bits(u16::from_le_bytes([bytes[pe + 2 * j], bytes[pe + 2 * j + 1]])).to_f32();
        }
    }
}

/// One token's DSA indexer key in the FP8 layout (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyFp8 {
    /// Index head dim (`index_head_dim`).
    pub id: usize,
}

impl KeyFp8 {
    pub fn tiles(&self) -> usize {
        self.id.div_ceil(TILE)
    }
    /// Bytes per token (a multiple of 4).
    pub fn row_bytes(&self) -> usize {
        (self.id + 4 * self.tiles()).next_multiple_of(4)
    }
    /// Byte offset of the f32 scales.
    pub fn scale_offset(&self) -> usize {
        self.id
    }

    pub fn encode(&self, key: &[f32], out: &mut [u8]) {
        assert_eq!(key.len(), self.id, "KeyFp8::encode: key of {} values, layout needs {}", key.len(), self.id);
        assert_eq!(out.len(), self.row_bytes(), "KeyFp8::encode: {} bytes, layout needs {}", out.len(), self.row_bytes());
        out.fill(0);
        let mut scales = vec![0.0f32; self.tiles()];
        encode_tiles(key, &mut out[..self.id], &mut scales);
        for (j, s) in scales.iter().enumerate() {
            out[self.id + 4 * j..self.id + 4 * j + 4].copy_from_slice(&s.to_le_bytes());
        }
    }

    pub fn decode(&self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(bytes.len(), self.row_bytes(), "KeyFp8::decode: {} bytes, layout needs {}", bytes.len(), self.row_bytes());
        let scales: Vec<f32> = (0..self.tiles()).map(|j| read_f32(bytes, self.id + 4 * j)).collect();
        decode_tiles(&bytes[..self.id], &scales, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// E4M3 from its definition: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
    /// subnormal (m · 2^-9); S.1111.111 is NaN.
    fn e4m3_by_definition(b: u8) -> f32 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let (e, m) = (((b >> 3) & 15) as i32, (b & 7) as f32);
        if e == 15 && m == 7.0 {
            return f32::NAN;
        }
        s * if e == 0 { m * 2f32.powi(-9) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) }
    }

    #[test]
    fn e4m3_values_match_the_definition() {
        for b in 0..=255u8 {
            let (got, want) = (e4m3_value(b), e4m3_by_definition(b));
            assert!(got == want || (got.is_nan() && want.is_nan()), "bits {b:#04x}: {got} vs {want}");
        }
        assert_eq!(e4m3_value(0x7e), E4M3_MAX);
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // Every finite code round-trips; the midpoint between two neighbours goes to the even one.
        let finite: Vec<u8> = (0..=0x7eu8).collect();
        for &b in &finite {
            assert_eq!(e4m3(e4m3_value(b)), b, "{b:#04x}");
            assert_eq!(e4m3(-e4m3_value(b)), b | 0x80, "-{b:#04x}");
        }
        for w in finite.windows(2) {
            let (lo, hi) = (e4m3_value(w[0]), e4m3_value(w[1]));
            let mid = 0.5 * (lo + hi);
            let even = if w[0] & 1 == 0 { w[0] } else { w[1] };
            assert_eq!(e4m3(mid), even, "midpoint of {lo} and {hi}");
            assert_eq!(e4m3(lo + 0.26 * (hi - lo)), w[0]);
            assert_eq!(e4m3(lo + 0.74 * (hi - lo)), w[1]);
        }
        for x in [449.0, 470.0, 1e6, f32::INFINITY] {
            assert_eq!(e4m3(x), 0x7e, "{x} saturates to 448");
            assert_eq!(e4m3(-x), 0xfe);
        }
        assert_eq!(e4m3(2f32.powi(-10)), 0, "half the smallest subnormal ties to zero");
        assert_eq!(e4m3(f32::NAN) & 0x7f, 0x7f);
    }

    #[test]
    fn tile_scale_is_the_smallest_fitting_power_of_two() {
        assert_eq!(tile_scale(0.0), 1.0);
        assert_eq!(tile_scale(448.0), 1.0);
        assert_eq!(tile_scale(448.1), 2.0);
        assert_eq!(tile_scale(224.0), 0.5);
        assert_eq!(tile_scale(3.0), 2f32.powi(-7)); // 3 / 2^-7 = 384 <= 448 < 768
        for amax in [1e-30f32, 1e-3, 0.7, 1.0, 5.5, 1e4, 3e38] {
            let s = tile_scale(amax);
            assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{s} is a power of two");
            assert!(amax / s <= E4M3_MAX && (amax / s > E4M3_MAX / 2.0 || s == f32::MIN_POSITIVE), "amax {amax}: scale {s}");
        }
    }

    fn noise(n: usize, seed: u32, spread: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let u = x as f32 / u32::MAX as f32 - 0.5;
                u * spread * (1.0 + (i / TILE) as f32 * 7.0) // tiles of different ranges
            })
            .collect()
    }

    #[test]
    fn the_k3_layouts_are_vllms_sizes() {
        assert_eq!(LatentFp8 { r: 512, dr: 64 }.row_bytes(), 656);
        assert_eq!(LatentFp8 { r: 512, dr: 64 }.pe_offset(), 528);
        assert_eq!(KeyFp8 { id: 128 }.row_bytes(), 132);
        // Small models: still 16-byte rows with the k_pe aligned.
        let small = LatentFp8 { r: 24, dr: 8 };
        assert_eq!((small.pe_offset(), small.row_bytes()), (32, 48));
    }

    #[test]
    fn a_latent_row_reads_back_within_e4m3_precision() {
        for (r, dr) in [(512, 64), (24, 8), (200, 16)] {
            let lay = LatentFp8 { r, dr };
            let row = noise(r + dr, r as u32, 3.0);
            let mut bytes = vec![0u8; lay.row_bytes()];
            lay.encode(&row, &mut bytes);
            let mut back = vec![0.0f32; r + dr];
            lay.decode(&bytes, &mut back);
            for (j, (a, b)) in row.iter().zip(&back).enumerate() {
                if j < r {
                    // Half an E4M3 step: 2^-4 relative for normals, half of 2^-9·scale below.
                    let s = read_f32(&bytes, r + 4 * (j / TILE));
                    assert!((a - b).abs() <= a.abs() / 16.0 + s * 2f32.powi(-10), "r={r} latent {j}: {a} -> {b} (scale {s})");
                    assert_eq!(bf16::from_f32(*b).to_f32(), *b, "latent {j}: the read value is exact in bf16");
                } else {
                    assert_eq!(*b, bf16::from_f32(*a).to_f32(), "k_pe {j} is plain bf16");
                }
            }
            // The largest magnitude of each tile uses E4M3's top binade.
            for t in 0..lay.tiles() {
                let amax = row[t * TILE..((t + 1) * TILE).min(r)].iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s = read_f32(&bytes, r + 4 * t);
                assert!(amax / s > 224.0 && amax / s <= 448.0, "tile {t}: amax {amax}, scale {s}");
            }
        }
    }

    #[test]
    fn an_index_key_reads_back_within_e4m3_precision() {
        let lay = KeyFp8 { id: 128 };
        let key = noise(128, 9, 0.4);
        let mut bytes = vec![0u8; 132];
        lay.encode(&key, &mut bytes);
        let mut back = vec![0.0f32; 128];
        lay.decode(&bytes, &mut back);
        let s = read_f32(&bytes, 128);
        for (a, b) in key.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() / 16.0 + s * 2f32.powi(-10), "{a} -> {b}");
        }
        let dot = |u: &[f32], v: &[f32]| u.iter().zip(v).map(|(x, y)| x * y).sum::<f32>();
        let q = noise(128, 4, 1.0);
        let (exact, fp8) = (dot(&q, &key), dot(&q, &back));
        assert!((exact - fp8).abs() <= 0.03 * dot(&q.iter().map(|v| v.abs()).collect::<Vec<_>>(), &key.iter().map(|v| v.abs()).collect::<Vec<_>>()));
    }
}
