//! Moving checkpoint tensors (or one rank's shards of them, through [`Tensors`]) into GPU memory
//! (feature `cuda`): float matrices become BF16
//! (converted on the host when the file stores F32/F16; BF16 bytes go up as they are), or F32 in
//! the reference precision ([`super::Precision::F32`]), small
//! vectors (norm weights, biases, gates' constants) become F32, and MXFP4 expert bytes go up
//! unchanged. Every error names the tensor.

use half::bf16;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::source::Tensors;

/// Names the tensor in a device error.
pub(crate) fn terr(name: &str) -> impl FnOnce(k3_core::CoreError) -> ModelError + '_ {
    move |e| ModelError::Tensor { name: name.to_string(), msg: e.to_string() }
}

/// The tensor's values as BF16 bytes (no copy of the conversion when already BF16).
fn bf16_bytes(t: &Tensor, name: &str) -> Result<Vec<u8>> {
    match t.dtype() {
        DType::BF16 => Ok(t.bytes().to_vec()),
        DType::F32 | DType::F16 => {
            let f = t.to_f32().map_err(terr(name))?;
            let v: Vec<bf16> = f.par_iter().map(|&x| bf16::from_f32(x)).collect();
            Ok(bytemuck::cast_slice(&v).to_vec())
        }
        d => Err(ModelError::Tensor { name: name.into(), msg: format!("dtype {d} where a float tensor was expected") }),
    }
}

/// A float matrix `[rows, cols]` on the device as `dt` (BF16, or F32: the reference precision).
pub(crate) fn matrix<S: Tensors + ?Sized>(dev: &CudaDevice, ck: &S, name: &str, rows: usize, cols: usize, dt: DType) -> Result<CudaTensor> {
    let t = ck.tensor(name)?;
    if t.shape() != [rows, cols] {
        return Err(ModelError::Tensor { name: name.into(), msg: format!("has shape {:?}, expected [{rows}, {cols}]", t.shape()) });
    }
    let out = CudaTensor::uninit(dev, dt, vec![rows, cols]).map_err(terr(name))?;
    write_float(&out, 0, &t, name, dt)?;
    Ok(out)
}

/// Writes float tensor `t`'s values into `dst` at byte `offset`, stored as `dt` (BF16 or F32).
pub(crate) fn write_float(dst: &CudaTensor, offset: usize, t: &Tensor, name: &str, dt: DType) -> Result<()> {
    match dt {
        DType::F32 => dst.write_at(offset, bytemuck::cast_slice(&t.to_f32().map_err(terr(name))?)),
        _ => dst.write_at(offset, &bf16_bytes(t, name)?),
    }
    .map_err(terr(name))
}

/// A host f32 vector as an F32 device tensor of shape `shape`.
pub(crate) fn f32s(dev: &CudaDevice, v: &[f32], shape: Vec<usize>, name: &str) -> Result<CudaTensor> {
    CudaTensor::from_f32(dev, shape, v).map_err(terr(name))
}

/// A small float tensor of `n` elements as F32 `[n]` on the device.
pub(crate) fn vector<S: Tensors + ?Sized>(dev: &CudaDevice, ck: &S, name: &str, n: usize) -> Result<CudaTensor> {
    let v = crate::layers::vector(ck, name, n)?;
    f32s(dev, &v, vec![n], name)
}

/// Raw bytes of a U8 tensor (MXFP4 `weight_packed` / `weight_scale`) checked to be `[rows, cols]`.
pub(crate) fn u8_bytes<'a>(t: &'a Tensor, name: &str, rows: usize, cols: usize) -> Result<&'a [u8]> {
    if t.dtype() != DType::U8 || t.shape() != [rows, cols] {
        return Err(ModelError::Tensor { name: name.into(), msg: format!("is {} {:?}, expected U8 [{rows}, {cols}]", t.dtype(), t.shape()) });
    }
    Ok(t.bytes())
}
