//! `Tensor`: a dtype, a shape and bytes. Weights are views into a memory-mapped checkpoint
//! (no copy at load; pages are read when a kernel touches them); small computed tensors own
//! their bytes. Activations inside the CPU model are plain `Vec<f32>` with shape comments —
//! this type is for weights and for data crossing crate boundaries.

use std::borrow::Cow;
use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

use crate::{CoreError, DType, Device, Result};

/// Where the bytes of a CPU tensor live.
#[derive(Clone)]
pub enum Storage {
    /// `len` bytes starting at `start` inside a shared memory map.
    Mapped { map: Arc<Mmap>, start: usize, len: usize },
    /// `len` bytes at byte `start` of words owned by the tensor, or shared by several tensors
    /// read into one buffer (an expert's weights read from disk, `k3-model` `offload`); words
    /// keep the bytes 8-byte aligned so any dtype can be viewed in place when `start` is.
    Owned { words: Arc<Vec<u64>>, start: usize, len: usize },
}

#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {:?})", self.dtype, self.shape)
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    /// A view of `len` bytes at `start` of a memory map. Checks that the byte count matches.
    pub fn mapped(dtype: DType, shape: Vec<usize>, map: Arc<Mmap>, start: usize, len: usize) -> Result<Self> {
        let want = numel(&shape) * dtype.size_in_bytes();
        if want != len || start + len > map.len() {
            return Err(CoreError::Shape {
                op: "Tensor::mapped",
                detail: format!("{dtype} {shape:?} needs {want} bytes, the file holds {len} at offset {start}"),
            });
        }
        Ok(Tensor { dtype, shape, storage: Storage::Mapped { map, start, len } })
    }

    /// A tensor owning a copy of `bytes`.
    pub fn from_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Result<Self> {
        let want = numel(&shape) * dtype.size_in_bytes();
        if want != bytes.len() {
            return Err(CoreError::Shape { op: "Tensor::from_bytes", detail: format!("{dtype} {shape:?} needs {want} bytes, got {}", bytes.len()) });
        }
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Ok(Tensor { dtype, shape, storage: Storage::Owned { words: Arc::new(words), start: 0, len: bytes.len() } })
    }

    /// A view of `len` bytes at byte `start` of a shared word buffer (no copy). Checks that the
    /// byte count matches and that the range lies inside the buffer.
    pub fn shared(dtype: DType, shape: Vec<usize>, words: Arc<Vec<u64>>, start: usize, len: usize) -> Result<Self> {
        let want = numel(&shape) * dtype.size_in_bytes();
        if want != len || start + len > words.len() * 8 {
            return Err(CoreError::Shape {
                op: "Tensor::shared",
                detail: format!("{dtype} {shape:?} needs {want} bytes, the buffer holds {len} at offset {start} of {}", words.len() * 8),
            });
        }
        Ok(Tensor { dtype, shape, storage: Storage::Owned { words, start, len } })
    }

    pub fn from_f32(shape: Vec<usize>, data: &[f32]) -> Result<Self> {
        Self::from_bytes(DType::F32, shape, bytemuck::cast_slice(data))
    }

    pub fn from_bf16(shape: Vec<usize>, data: &[bf16]) -> Result<Self> {
        Self::from_bytes(DType::BF16, shape, bytemuck::cast_slice(data))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    pub fn device(&self) -> Device {
        Device::Cpu
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    /// True when the bytes are a view into a memory map (not copied).
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    /// Asks the kernel to start reading a memory-mapped tensor's pages into memory now
    /// (`madvise(MADV_WILLNEED)`, Unix; asynchronous, a no-op for owned bytes): for weights the
    /// CPU will compute with that would otherwise fault in from disk a page at a time.
    pub fn advise_willneed(&self) {
        #[cfg(unix)]
        if let Storage::Mapped { map, start, len } = &self.storage {
            // A refused advice only loses the read-ahead.
            let _ = map.advise_range(memmap2::Advice::WillNeed, *start, *len);
        }
    }

    /// The raw bytes, wherever they live.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mapped { map, start, len } => &map[*start..*start + *len],
            Storage::Owned { words, start, len } => &bytemuck::cast_slice::<u64, u8>(words)[*start..*start + *len],
        }
    }

    /// Same bytes, another shape with the same element count.
    pub fn reshape(&self, shape: Vec<usize>) -> Result<Self> {
        if numel(&shape) != self.numel() {
            return Err(CoreError::Shape { op: "reshape", detail: format!("{:?} -> {shape:?} changes the element count", self.shape) });
        }
        Ok(Tensor { dtype: self.dtype, shape, storage: self.storage.clone() })
    }

    /// The elements `[0, n)` (in element units) as a new view: used to take the first
    /// `num_heads` entries of a zero-padded `A_log`.
    pub fn narrow_flat(&self, n: usize) -> Result<Self> {
        if n > self.numel() {
            return Err(CoreError::Shape { op: "narrow_flat", detail: format!("{n} > {}", self.numel()) });
        }
        let len = n * self.dtype.size_in_bytes();
        let storage = match &self.storage {
            Storage::Mapped { map, start, .. } => Storage::Mapped { map: map.clone(), start: *start, len },
            Storage::Owned { words, start, .. } => Storage::Owned { words: words.clone(), start: *start, len },
        };
        Ok(Tensor { dtype: self.dtype, shape: vec![n], storage })
    }

    /// Rows `[r0, r0 + n)` of dim 0 (any rank ≥ 1): a view of the same memory map or buffer, no
    /// copy. This is how a rank takes its heads or vocabulary rows.
    pub fn narrow_rows(&self, r0: usize, n: usize) -> Result<Self> {
        let rows = *self.shape.first().ok_or_else(|| CoreError::Shape { op: "narrow_rows", detail: "a 0-d tensor has no rows".into() })?;
        if r0 + n > rows {
            return Err(CoreError::Shape { op: "narrow_rows", detail: format!("rows {r0}..{} of {:?}", r0 + n, self.shape) });
        }
        let row_bytes = numel(&self.shape[1..]) * self.dtype.size_in_bytes();
        let mut shape = self.shape.clone();
        shape[0] = n;
        match &self.storage {
            Storage::Mapped { map, start, .. } => {
                Ok(Tensor { dtype: self.dtype, shape, storage: Storage::Mapped { map: map.clone(), start: start + r0 * row_bytes, len: n * row_bytes } })
            }
            Storage::Owned { words, start, .. } => {
                Ok(Tensor { dtype: self.dtype, shape, storage: Storage::Owned { words: words.clone(), start: start + r0 * row_bytes, len: n * row_bytes } })
            }
        }
    }

    /// Columns `[c0, c0 + n)` of a 2-D tensor, copied into an owned tensor (the rows of a
    /// row-parallel matrix are not contiguous in the file).
    pub fn narrow_cols(&self, c0: usize, n: usize) -> Result<Self> {
        let [rows, cols] = self.shape[..] else {
            return Err(CoreError::Shape { op: "narrow_cols", detail: format!("needs a 2-D tensor, got {:?}", self.shape) });
        };
        if c0 + n > cols {
            return Err(CoreError::Shape { op: "narrow_cols", detail: format!("columns {c0}..{} of {:?}", c0 + n, self.shape) });
        }
        let es = self.dtype.size_in_bytes();
        let src = self.bytes();
        let mut out = Vec::with_capacity(rows * n * es);
        for r in 0..rows {
            out.extend_from_slice(&src[(r * cols + c0) * es..(r * cols + c0 + n) * es]);
        }
        Self::from_bytes(self.dtype, vec![rows, n], &out)
    }

    fn typed<T: bytemuck::Pod>(&self, want: DType, op: &'static str) -> Result<Cow<'_, [T]>> {
        if self.dtype != want {
            return Err(CoreError::DType { op, dtype: self.dtype.to_string() });
        }
        let b = self.bytes();
        Ok(match bytemuck::try_cast_slice::<u8, T>(b) {
            Ok(s) => Cow::Borrowed(s),
            // Unaligned inside the file: copy (only small tensors end up here in practice).
            Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec::<u8, T>(b)),
        })
    }

    /// The elements as f32 (F32 viewed in place when aligned; BF16/F16 converted).
    pub fn to_f32(&self) -> Result<Cow<'_, [f32]>> {
        match self.dtype {
            DType::F32 => self.typed::<f32>(DType::F32, "to_f32"),
            DType::BF16 => Ok(Cow::Owned(self.typed::<bf16>(DType::BF16, "to_f32")?.iter().map(|v| v.to_f32()).collect())),
            DType::F16 => Ok(Cow::Owned(self.typed::<f16>(DType::F16, "to_f32")?.iter().map(|v| v.to_f32()).collect())),
            d => Err(CoreError::DType { op: "to_f32", dtype: d.to_string() }),
        }
    }
    pub fn as_f32(&self) -> Result<Cow<'_, [f32]>> {
        self.typed::<f32>(DType::F32, "as_f32")
    }
    pub fn as_bf16(&self) -> Result<Cow<'_, [bf16]>> {
        self.typed::<bf16>(DType::BF16, "as_bf16")
    }
    pub fn as_f16(&self) -> Result<Cow<'_, [f16]>> {
        self.typed::<f16>(DType::F16, "as_f16")
    }
    pub fn as_u8(&self) -> Result<&[u8]> {
        if self.dtype != DType::U8 {
            return Err(CoreError::DType { op: "as_u8", dtype: self.dtype.to_string() });
        }
        Ok(self.bytes())
    }
    pub fn as_i64(&self) -> Result<Cow<'_, [i64]>> {
        self.typed::<i64>(DType::I64, "as_i64")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn roundtrip_and_views() {
        let t = Tensor::from_f32(vec![2, 3], &[1., 2., 3., 4., 5., 6.]).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(&*t.as_f32().unwrap(), &[1., 2., 3., 4., 5., 6.]);
        assert_eq!(&*t.narrow_flat(2).unwrap().to_f32().unwrap(), &[1., 2.]);
        assert!(t.reshape(vec![4]).is_err());
        assert!(t.as_bf16().is_err());
        let b = Tensor::from_bf16(vec![2], &[bf16::from_f32(1.5), bf16::from_f32(-2.0)]).unwrap();
        assert_eq!(&*b.to_f32().unwrap(), &[1.5, -2.0]);
    }

    #[test]
    fn narrow_rows_and_cols() {
        let t = Tensor::from_f32(vec![3, 2, 2], &(0..12).map(|v| v as f32).collect::<Vec<_>>()).unwrap();
        let r = t.narrow_rows(1, 2).unwrap();
        assert_eq!(r.shape(), &[2, 2, 2]);
        assert_eq!(&*r.as_f32().unwrap(), &[4., 5., 6., 7., 8., 9., 10., 11.]);
        assert!(t.narrow_rows(2, 2).is_err());
        let m = Tensor::from_f32(vec![2, 4], &[0., 1., 2., 3., 4., 5., 6., 7.]).unwrap();
        let c = m.narrow_cols(1, 2).unwrap();
        assert_eq!(c.shape(), &[2, 2]);
        assert_eq!(&*c.as_f32().unwrap(), &[1., 2., 5., 6.]);
        assert_eq!(m.narrow_cols(4, 0).unwrap().numel(), 0);
        assert!(t.narrow_cols(0, 1).is_err());
    }

    #[test]
    fn shared_views() {
        let words = Arc::new((0..4u64).map(|i| i * 0x0101_0101_0101_0101).collect::<Vec<_>>()); // bytes 0×8, 1×8, 2×8, 3×8
        let t = Tensor::shared(DType::U8, vec![2, 4], words.clone(), 12, 8).unwrap();
        assert_eq!(t.as_u8().unwrap(), &[1, 1, 1, 1, 2, 2, 2, 2]);
        assert_eq!(t.narrow_rows(1, 1).unwrap().as_u8().unwrap(), &[2, 2, 2, 2]);
        assert!(Tensor::shared(DType::U8, vec![8], words.clone(), 28, 8).is_err(), "past the buffer");
        assert!(Tensor::shared(DType::F32, vec![3], words, 0, 8).is_err(), "wrong byte count");
    }
}
