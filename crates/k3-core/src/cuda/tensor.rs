//! [`CudaTensor`]: a dtype, a shape and a [`CudaBuffer`] on one device — the device-side twin
//! of [`Tensor`], with host↔device and device↔device copies.
//!
//! Clones share the buffer (like a CPU `Tensor`'s `Arc`). Ops take their output as
//! `&CudaTensor` and write device memory through it; passing the same tensor as input and
//! output is how an op runs in place. All copies are enqueued on the device's compute stream:
//! host→device returns once the host data has been staged (the host slice may be dropped
//! at once), device→host waits for the copy to land.

use std::sync::Arc;

use cudarc::driver::result as dres;
use half::{bf16, f16};

use super::{derr, CudaBuffer, CudaDevice};
use crate::{CoreError, DType, Device, Result, Tensor};

#[derive(Clone)]
pub struct CudaTensor {
    buf: Arc<CudaBuffer>,
    dtype: DType,
    shape: Vec<usize>,
}

impl std::fmt::Debug for CudaTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaTensor({}, {:?}, cuda:{})", self.dtype, self.shape, self.buf.device().ordinal())
    }
}

impl CudaTensor {
    /// A tensor with undefined contents.
    pub fn uninit(dev: &CudaDevice, dtype: DType, shape: Vec<usize>) -> Result<Self> {
        let bytes = shape.iter().product::<usize>() * dtype.size_in_bytes();
        Ok(CudaTensor { buf: Arc::new(dev.alloc(bytes)?), dtype, shape })
    }

    /// A tensor of zeros.
    pub fn zeros(dev: &CudaDevice, dtype: DType, shape: Vec<usize>) -> Result<Self> {
        let t = Self::uninit(dev, dtype, shape)?;
        t.fill_bytes(0)?;
        Ok(t)
    }

    /// A copy of a CPU tensor (any dtype; mapped or owned bytes).
    pub fn from_host(dev: &CudaDevice, t: &Tensor) -> Result<Self> {
        let out = Self::uninit(dev, t.dtype(), t.shape().to_vec())?;
        out.write_bytes(t.bytes())?;
        Ok(out)
    }

    /// A copy of f32 host data.
    pub fn from_f32(dev: &CudaDevice, shape: Vec<usize>, data: &[f32]) -> Result<Self> {
        Self::from_pod(dev, DType::F32, shape, data)
    }

    /// A copy of bf16 host data.
    pub fn from_bf16(dev: &CudaDevice, shape: Vec<usize>, data: &[bf16]) -> Result<Self> {
        Self::from_pod(dev, DType::BF16, shape, data)
    }

    /// A copy of `data` viewed as `dtype` (its byte size must match the shape).
    pub fn from_pod<T: bytemuck::Pod>(dev: &CudaDevice, dtype: DType, shape: Vec<usize>, data: &[T]) -> Result<Self> {
        let out = Self::uninit(dev, dtype, shape)?;
        out.write_bytes(bytemuck::cast_slice(data))?;
        Ok(out)
    }

    /// Overwrites the whole tensor with `bytes` from the host (exactly `byte_len()` bytes).
    pub fn write_bytes(&self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.byte_len() {
            return Err(CoreError::Shape { op: "CudaTensor::write_bytes", detail: format!("{self:?} holds {} bytes, got {}", self.byte_len(), bytes.len()) });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: the destination block holds at least byte_len() bytes; pageable host memory
        // is staged before the call returns, so `bytes` may be dropped afterwards.
        unsafe { dres::memcpy_htod_async(self.ptr(), bytes, dev.cu_stream()) }.map_err(derr("host-to-device copy"))
    }

    /// Writes `bytes` from the host at byte offset `offset` (the range must lie inside the tensor).
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        if offset.checked_add(bytes.len()).is_none_or(|end| end > self.byte_len()) {
            return Err(CoreError::Shape {
                op: "CudaTensor::write_at",
                detail: format!("{} bytes at offset {offset} overrun {self:?} ({} bytes)", bytes.len(), self.byte_len()),
            });
        }
        if bytes.is_empty() {
            return Ok(());
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: the destination range was checked to lie inside the block; pageable host
        // memory is staged before the call returns.
        unsafe { dres::memcpy_htod_async(self.ptr() + offset as u64, bytes, dev.cu_stream()) }.map_err(derr("host-to-device copy"))
    }

    /// Sets every byte to `byte` (0xFF poisons f32 and bf16 with NaN).
    pub fn fill_bytes(&self, byte: u8) -> Result<()> {
        if self.byte_len() == 0 {
            return Ok(());
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: the block holds at least byte_len() bytes.
        unsafe { dres::memset_d8_async(self.ptr(), byte, self.byte_len(), dev.cu_stream()) }.map_err(derr("cuMemsetD8Async"))
    }

    /// Sets `len` bytes from byte offset `offset` to `byte` (the range must lie inside the tensor).
    pub fn fill_range(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.byte_len()) {
            return Err(CoreError::Shape { op: "CudaTensor::fill_range", detail: format!("{len} bytes at offset {offset} overrun {self:?}") });
        }
        if len == 0 {
            return Ok(());
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: the range was checked to lie inside the block.
        unsafe { dres::memset_d8_async(self.ptr() + offset as u64, byte, len, dev.cu_stream()) }.map_err(derr("cuMemsetD8Async"))
    }

    /// Copies `src` (same dtype and element count, same device) into `self`.
    pub fn copy_from(&self, src: &CudaTensor) -> Result<()> {
        if src.dtype != self.dtype || src.numel() != self.numel() || !src.cuda_device().same(self.cuda_device()) {
            return Err(CoreError::Shape { op: "CudaTensor::copy_from", detail: format!("{src:?} into {self:?}") });
        }
        if self.byte_len() == 0 {
            return Ok(());
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: both blocks hold byte_len() bytes; ordered on the compute stream.
        unsafe { dres::memcpy_dtod_async(self.ptr(), src.ptr(), self.byte_len(), dev.cu_stream()) }.map_err(derr("device-to-device copy"))
    }

    /// Copies `len` bytes of `src` from byte offset `src_off` to byte offset `dst_off` of
    /// `self` (same device; both ranges must lie inside their tensors; dtypes may differ).
    pub fn copy_range(&self, dst_off: usize, src: &CudaTensor, src_off: usize, len: usize) -> Result<()> {
        let inside = |t: &CudaTensor, off: usize| off.checked_add(len).is_some_and(|end| end <= t.byte_len());
        if !inside(self, dst_off) || !inside(src, src_off) || !src.cuda_device().same(self.cuda_device()) {
            return Err(CoreError::Shape {
                op: "CudaTensor::copy_range",
                detail: format!("{len} bytes from offset {src_off} of {src:?} to offset {dst_off} of {self:?}"),
            });
        }
        if len == 0 {
            return Ok(());
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: both ranges were checked to lie inside their blocks; ordered on the compute stream.
        unsafe { dres::memcpy_dtod_async(self.ptr() + dst_off as u64, src.ptr() + src_off as u64, len, dev.cu_stream()) }.map_err(derr("device-to-device copy"))
    }

    /// The raw bytes, copied to the host (waits for all earlier work on the stream).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.byte_len()];
        if out.is_empty() {
            return Ok(out);
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: out has byte_len() bytes; the stream is synchronised before `out` is read.
        unsafe { dres::memcpy_dtoh_async(&mut out, self.ptr(), dev.cu_stream()) }.map_err(derr("device-to-host copy"))?;
        dev.synchronize()?;
        Ok(out)
    }

    /// A CPU [`Tensor`] with the same dtype, shape and bytes.
    pub fn to_host(&self) -> Result<Tensor> {
        Tensor::from_bytes(self.dtype, self.shape.clone(), &self.to_bytes()?)
    }

    /// Elements `[start, start + len)` of an F32 tensor, copied straight into a new host `Vec`
    /// (no staging `Vec<u8>`; waits for all earlier work on the stream).
    pub fn read_f32(&self, start: usize, len: usize) -> Result<Vec<f32>> {
        if self.dtype != DType::F32 {
            return Err(CoreError::DType { op: "CudaTensor::read_f32", dtype: self.dtype.to_string() });
        }
        if start.checked_add(len).is_none_or(|end| end > self.numel()) {
            return Err(CoreError::Shape { op: "CudaTensor::read_f32", detail: format!("elements {start}..+{len} of {self:?}") });
        }
        let mut out = vec![0f32; len];
        if len == 0 {
            return Ok(out);
        }
        let dev = self.buf.device();
        dev.bind()?;
        // SAFETY: the source range was checked to lie inside the block and `out` holds `len`
        // f32; the stream is synchronised before `out` is read.
        unsafe { dres::memcpy_dtoh_async(&mut out, self.ptr() + (start * 4) as u64, dev.cu_stream()) }.map_err(derr("device-to-host copy"))?;
        dev.synchronize()?;
        Ok(out)
    }

    /// The elements as f32 on the host (F32 as is; BF16/F16 widened exactly).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        if self.dtype == DType::F32 {
            return self.read_f32(0, self.numel());
        }
        let b = self.to_bytes()?;
        match self.dtype {
            DType::BF16 => Ok(bytemuck::pod_collect_to_vec::<u8, bf16>(&b).iter().map(|v| v.to_f32()).collect()),
            DType::F16 => Ok(bytemuck::pod_collect_to_vec::<u8, f16>(&b).iter().map(|v| v.to_f32()).collect()),
            d => Err(CoreError::DType { op: "CudaTensor::to_f32_vec", dtype: d.to_string() }),
        }
    }

    /// Same buffer, another shape with the same element count.
    pub fn reshape(&self, shape: Vec<usize>) -> Result<Self> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(CoreError::Shape { op: "CudaTensor::reshape", detail: format!("{:?} -> {shape:?} changes the element count", self.shape) });
        }
        Ok(CudaTensor { buf: self.buf.clone(), dtype: self.dtype, shape })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn byte_len(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }
    /// The device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }
    pub fn cuda_device(&self) -> &CudaDevice {
        self.buf.device()
    }
    pub fn device(&self) -> Device {
        self.buf.device().device()
    }
    /// Size of the last dimension (1 for a scalar).
    pub fn last_dim(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
}
