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
        return Err(CoreError::Msg(format!(
            "MXFP4 scale byte 255 (NaN in the OCP MX spec) at flat index {p}: the checkpoint is corrupt"
        )));
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
    if cols % 32 != 0 || packed.len() != rows * cols / 2 || scale.len() != rows * cols / 32 {
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
