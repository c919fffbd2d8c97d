//! Page-locked host memory of one device's context: the landing area of device-to-host copies
//! that are enqueued on the compute stream and read once the stream (or an event recorded after
//! them) is reached — the sampler's results (`sample.rs`), the latent rows and routes of the
//! experts the CPU computes beside the GPU (`k3-model` `cuda/moe.rs`, issue 23). Page-locked,
//! so the copies run asynchronously and at the link's full rate.
//!
//! [`Staging`]: a fixed page-locked bounce buffer for large copies between pageable host slices
//! and a device tensor (the vision tower's pixels and features, hundreds of MB per call): the
//! DMA runs at the link's rate and the host side of each chunk (the copy into or out of the
//! caller's memory, including its first-touch page faults) is spread over rayon threads
//! (`crate::staging`), instead of the driver's single-threaded staging of pageable memory.

use std::ffi::c_void;

use cudarc::driver::result as dres;

use super::{derr, CudaDevice, CudaTensor, Event};
use crate::staging::{gather, pieces, pieces_mut, scatter, windows, PIECE};
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

    /// Enqueues on the compute stream a copy of `len` bytes of `src` from its byte offset
    /// `src_at` to byte offset `at` (read them once the stream has passed the copy).
    pub fn download_range(&mut self, at: usize, src: &CudaTensor, src_at: usize, len: usize) -> Result<()> {
        let inside = |off: usize, n: usize| off.checked_add(len).is_some_and(|end| end <= n);
        if !inside(at, self.bytes) || !inside(src_at, src.byte_len()) || !src.cuda_device().same(&self.dev) {
            return Err(CoreError::Shape {
                op: "Pinned::download_range",
                detail: format!("{len} bytes from offset {src_at} of {src:?} to offset {at} of {} pinned bytes", self.bytes),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: both ranges were checked to lie inside their blocks; the caller reads the
        // destination only after the stream has passed the copy.
        unsafe {
            let dst = std::slice::from_raw_parts_mut((self.ptr as *mut u8).add(at), len);
            dres::memcpy_dtoh_async(dst, src.ptr() + src_at as u64, self.dev.cu_stream()).map_err(derr("device-to-host copy from pinned memory"))
        }
    }

    /// Enqueues on the compute stream a copy of bytes `[at, at + len)` to byte offset `dst_at`
    /// of `dst`. The bytes must stay unchanged until the stream has passed the copy.
    pub fn upload_range(&self, at: usize, dst: &CudaTensor, dst_at: usize, len: usize) -> Result<()> {
        let inside = |off: usize, n: usize| off.checked_add(len).is_some_and(|end| end <= n);
        if !inside(at, self.bytes) || !inside(dst_at, dst.byte_len()) || !dst.cuda_device().same(&self.dev) {
            return Err(CoreError::Shape {
                op: "Pinned::upload_range",
                detail: format!("{len} bytes from offset {at} of {} pinned bytes to offset {dst_at} of {dst:?}", self.bytes),
            });
        }
        if len == 0 {
            return Ok(());
        }
        self.dev.bind()?;
        // SAFETY: both ranges were checked to lie inside their blocks; the caller leaves the
        // source bytes alone until the stream has passed the copy.
        unsafe {
            let src = std::slice::from_raw_parts((self.ptr as *const u8).add(at), len);
            dres::memcpy_htod_async(dst.ptr() + dst_at as u64, src, self.dev.cu_stream()).map_err(derr("host-to-device copy from pinned memory"))
        }
    }

    /// Bytes `[at, at + len)` to fill, for [`Pinned::upload_range`]: only once no copy that
    /// reads or writes them is in flight (the stream, or an event recorded after it, passed).
    pub fn bytes_mut(&mut self, at: usize, len: usize) -> Result<&mut [u8]> {
        if at.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(CoreError::Shape { op: "Pinned::bytes_mut", detail: format!("{len} bytes at offset {at} of {}", self.bytes) });
        }
        // SAFETY: inside the allocation, borrowed mutably through `&mut self`.
        Ok(unsafe { std::slice::from_raw_parts_mut((self.ptr as *mut u8).add(at), len) })
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

/// A page-locked bounce buffer of fixed size for copies of any size between pageable host
/// slices and a device tensor, one buffer-full at a time (see the module doc).
pub struct Staging {
    pinned: Pinned,
    /// Recorded after the last copy that reads or writes the buffer.
    done: Event,
}

impl Staging {
    /// A staging buffer of `bytes` (at least one [`PIECE`]) in `dev`'s context.
    pub fn new(dev: &CudaDevice, bytes: usize) -> Result<Staging> {
        Ok(Staging { pinned: Pinned::new(dev, bytes.max(PIECE))?, done: dev.new_event(false)? })
    }

    /// The host slices `parts`, in order, into all of `dst` (their lengths must sum to its
    /// bytes). Returns with the last buffer-full's copy still in flight (the parts may be dropped
    /// at once: what is in flight reads the page-locked buffer).
    pub fn upload(&mut self, dst: &CudaTensor, parts: &[&[u8]]) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total != dst.byte_len() {
            return Err(CoreError::Shape { op: "Staging::upload", detail: format!("{total} host bytes into {dst:?} ({} bytes)", dst.byte_len()) });
        }
        let ins = pieces(parts);
        let lens: Vec<usize> = ins.iter().map(|p| p.len()).collect();
        let mut dst_at = 0;
        for (i, j, len) in windows(&lens, self.pinned.len()) {
            // The previous window's copy out of the buffer must be done before it is refilled.
            self.done.synchronize()?;
            gather(self.pinned.bytes_mut(0, len)?, &ins[i..j]);
            self.pinned.upload_range(0, dst, dst_at, len)?;
            self.done.record(&self.pinned.dev.stream())?;
            dst_at += len;
        }
        Ok(())
    }

    /// All of `src` into the host slices `outs`, in order (their lengths must sum to its bytes);
    /// waits for the copies (and so for all earlier work on the stream).
    pub fn download(&mut self, src: &CudaTensor, outs: &mut [&mut [u8]]) -> Result<()> {
        let total: usize = outs.iter().map(|o| o.len()).sum();
        if total != src.byte_len() {
            return Err(CoreError::Shape { op: "Staging::download", detail: format!("{src:?} ({} bytes) into {total} host bytes", src.byte_len()) });
        }
        let mut outs = pieces_mut(outs);
        let lens: Vec<usize> = outs.iter().map(|p| p.len()).collect();
        let mut src_at = 0;
        for (i, j, len) in windows(&lens, self.pinned.len()) {
            self.pinned.download_range(0, src, src_at, len)?;
            self.done.record(&self.pinned.dev.stream())?;
            self.done.synchronize()?;
            scatter(self.pinned.bytes(0, len)?, &mut outs[i..j]);
            src_at += len;
        }
        Ok(())
    }
}
