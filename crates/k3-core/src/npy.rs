//! Writing `.npy` files (NumPy format 1.0, little-endian f32, C order) for `k3 logits`.
//! Written to a temporary file beside the target and renamed, so nothing half-written is left.

use std::io::Write;
use std::path::Path;

use crate::{CoreError, Result};

pub fn npy_bytes_f32(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_s}, }}");
    // Pad so that magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Writes `data` with `shape` to `path` atomically (temp file + rename).
pub fn write_npy_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let n: usize = shape.iter().product();
    if n != data.len() {
        return Err(CoreError::Shape { op: "write_npy_f32", detail: format!("shape {shape:?} vs {} values", data.len()) });
    }
    let io = |e| CoreError::Io { path: path.display().to_string(), source: e };
    let tmp = path.with_extension("npy.partial");
    let mut f = std::fs::File::create(&tmp).map_err(io)?;
    f.write_all(&npy_bytes_f32(shape, data)).map_err(io)?;
    f.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_aligned() {
        let b = super::npy_bytes_f32(&[2, 3], &[0.0; 6]);
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        assert_eq!(b.len(), 10 + hl + 24);
        assert!(std::str::from_utf8(&b[10..10 + hl]).unwrap().contains("'shape': (2, 3)"));
    }
}
