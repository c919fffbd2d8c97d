//! Page-locked host memory of one device's context: the landing area of device-to-host copies
//! that are enqueued on the compute stream and read once the stream (or an event recorded after
//! them) is reached — the sampler's results (`sample.rs`), the latent rows and routes of the
//! experts the CPU computes beside the GPU (`k3-model` `cuda/moe.rs`, issue 23). Page-locked,
//! so the copies run asynchronously and at the link's full rate.

use std::ffi::c_void;

use cudarc::driver::result as dres;

use super::{derr, CudaDevice, CudaTensor};
use crate::{CoreError, Result};

pub struct Pinned {
    dev: CudaDevice,
    ptr: *mut c_void,
    bytes: usize,
}

// SAFETY: the allocation is plain host memory owned by this value; writes go through &mut.
unsafe impl Send for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: `ptr` came from cuMemHostAlloc in this context and is freed once.
        let _ = unsafe { dres::free_host(self.ptr) };
    }
}

impl Pinned {
    /// `bytes` (at least 4096) of page-locked memory in `dev`'s context.
    pub fn new(dev: &CudaDevice, bytes: usize) -> Result<Pinned> {
        let bytes = bytes.max(4096);
        dev.bind()?;
        // SAFETY: a plain page-locked allocation in the bound context.
        let ptr = unsafe { dres::malloc_host(bytes, 0) }.map_err(derr("cuMemHostAlloc"))?;
        Ok(Pinned { dev: dev.clone(), ptr, bytes })
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Enqueues on the compute stream a copy of all of `src` to byte offset `at`. The bytes are
    /// there once the stream reaches the copy: synchronise it, or an event recorded after it.
    pub fn download(&mut self, at: usize, src: &CudaTensor) -> Result<()> {
        let n = src.byte_len();
        if at.checked_add(n).is_none_or(|end| end > self.bytes) || !src.cuda_device().same(&self.dev) {
            return Err(CoreError::Shape { op: "Pinned::download", detail: format!("{src:?} ({n} bytes) at offset {at} of {} pinned bytes", self.bytes) });
        }
        if n == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: the range lies inside the allocation; the caller reads it only after the
        // stream has passed the copy, and `src` stays allocated until then (stream-ordered).
        unsafe {
            let dst = std::slice::from_raw_parts_mut((self.ptr as *mut u8).add(at), n);
            dres::memcpy_dtoh_async(dst, src.ptr(), self.dev.cu_stream()).map_err(derr("device-to-host copy into pinned memory"))
        }
    }

    /// Bytes `[at, at + len)`: what the last copies into them left once they completed.
    pub fn bytes(&self, at: usize, len: usize) -> Result<&[u8]> {
        if at.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(CoreError::Shape { op: "Pinned::bytes", detail: format!("{len} bytes at offset {at} of {}", self.bytes) });
        }
        // SAFETY: inside the allocation; page-locked memory is initialised by the copies that
        // the caller waited for (and by nothing else: never read before a copy).
        Ok(unsafe { std::slice::from_raw_parts((self.ptr as *const u8).add(at), len) })
    }
}
