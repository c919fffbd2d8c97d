//! The layers of the K3 text backbone, one file each, named as in the spec:
//! `attn_res` (§6), `kda` (§3), `mla` (§4), `dsa` (§5, the indexer and selection used by
//! `mla`), `moe` (§7.1–7.5), `experts` (its routed experts on the CPU: mapped or read from
//! disk, f32 or int8-activation kernels), `ffn` (the SiTU-GLU MLP: §7.5–7.6); `mtp`
//! (around-backbone §5.1, the MTP draft layer built from `mla` and `moe`).
//!
//! Activations are f32 `[T, ·]` row-major `Vec<f32>`; weights are `Matrix` views of the
//! checkpoint, used in place.

pub mod attn_res;
pub mod dsa;
pub mod experts;
pub mod ffn;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod mtp;
pub mod pages;

use k3_core::kernels::cpu::matmul::{linear, Matrix};

use crate::error::{ModelError, Result};
use crate::source::Tensors;

/// `y[T, out] = x[T, in] · Wᵀ` (zeros when `in` is 0: a rank that holds none of a split
/// matrix's columns contributes nothing to the sum).
pub(crate) fn lin(x: &[f32], t: usize, w: &Matrix) -> Result<Vec<f32>> {
    let mut y = vec![0f32; t * w.rows()];
    if w.cols() > 0 {
        linear(x, t, w, &mut y)?;
    }
    Ok(y)
}

/// A dense weight matrix (this rank's shard of it), checked to be `[rows, cols]`.
pub(crate) fn matrix<S: Tensors + ?Sized>(ck: &S, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    let t = ck.tensor(name)?;
    if t.shape() != [rows, cols] {
        return Err(ModelError::Tensor { name: name.into(), msg: format!("has shape {:?}, expected [{rows}, {cols}]", t.shape()) });
    }
    Matrix::dense(t).map_err(|e| ModelError::Tensor { name: name.into(), msg: e.to_string() })
}

/// A small float vector (norm weights, biases) as f32, checked to have `n` elements.
pub(crate) fn vector<S: Tensors + ?Sized>(ck: &S, name: &str, n: usize) -> Result<Vec<f32>> {
    let t = ck.tensor(name)?;
    if t.numel() != n {
        return Err(ModelError::Tensor { name: name.into(), msg: format!("has shape {:?}, expected {n} elements", t.shape()) });
    }
    Ok(t.to_f32().map_err(|e| ModelError::Tensor { name: name.into(), msg: e.to_string() })?.into_owned())
}
