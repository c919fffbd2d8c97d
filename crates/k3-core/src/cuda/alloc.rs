//! The caching device allocator: freed blocks go back to a per-device pool instead of to the
//! driver, so the steady state of a model step makes no `cuMemAlloc`/`cuMemFree` calls (each
//! of which can synchronise the device).
//!
//! Sizes are rounded to a class (512 B steps up to 1 MiB, then 2 MiB steps); a request takes
//! the smallest cached block of at least its class and at most 1/8 larger (so a big block is
//! not wasted on a small request). Reuse is safe without events because every user of a
//! device enqueues on that device's one compute stream (see `cuda/mod.rs`): a block freed
//! while kernels still read it is only handed to work enqueued after them. When the driver
//! runs out of memory, the pool is synchronised, emptied back to the driver, and the
//! allocation is retried once.

use std::collections::{BTreeMap, HashSet};

use cudarc::driver::{result as dres, sys as dsys};

use super::{derr, lock, CudaDevice};
use crate::{CoreError, Result};

const SMALL_STEP: usize = 512;
const SMALL_MAX: usize = 1 << 20;
const LARGE_STEP: usize = 2 << 20;

/// Allocator counters for one device.
#[derive(Clone, Copy, Debug, Default)]
pub struct AllocStats {
    /// Bytes (rounded to classes) held by live buffers.
    pub in_use_bytes: usize,
    /// Bytes held in the pool, ready for reuse.
    pub cached_bytes: usize,
    /// Highest `in_use_bytes` seen.
    pub peak_in_use_bytes: usize,
    /// `cuMemAlloc` calls made.
    pub driver_allocs: u64,
    /// Requests served from the pool.
    pub cache_hits: u64,
}

/// The per-device free lists, by block size.
#[derive(Default)]
pub(crate) struct Pool {
    free: BTreeMap<usize, Vec<dsys::CUdeviceptr>>,
    stats: AllocStats,
    /// While a CUDA graph is being captured: every block handed out or returned since the
    /// capture began (the graph may address any of them; see [`Pool::end_capture`]).
    capture: Option<HashSet<dsys::CUdeviceptr>>,
}

/// The size class a request of `bytes` is rounded to.
pub(crate) fn class_of(bytes: usize) -> usize {
    if bytes <= SMALL_MAX {
        bytes.max(1).div_ceil(SMALL_STEP) * SMALL_STEP
    } else {
        bytes.div_ceil(LARGE_STEP) * LARGE_STEP
    }
}

impl Pool {
    /// A cached block of at least `class` bytes and at most `class + class/8`.
    fn take(&mut self, class: usize) -> Option<(dsys::CUdeviceptr, usize)> {
        let limit = class + class / 8;
        let size = *self.free.range(class..=limit).next()?.0;
        let list = self.free.get_mut(&size)?;
        let ptr = list.pop()?;
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.stats.cached_bytes -= size;
        self.stats.cache_hits += 1;
        Some((ptr, size))
    }

    fn put(&mut self, ptr: dsys::CUdeviceptr, size: usize) {
        if let Some(c) = &mut self.capture {
            c.insert(ptr);
        }
        self.free.entry(size).or_default().push(ptr);
        self.stats.cached_bytes += size;
        self.stats.in_use_bytes = self.stats.in_use_bytes.saturating_sub(size);
    }

    /// Starts recording the blocks a graph capture touches.
    pub(crate) fn begin_capture(&mut self) {
        self.capture = Some(HashSet::new());
    }

    /// Ends recording and takes out of the free lists every block the capture touched: the
    /// graph's kernels may read or write them on every replay, so they belong to the graph
    /// until it is dropped ([`Pool::give_back`]). Blocks still held by live tensors stay theirs.
    pub(crate) fn end_capture(&mut self) -> Vec<(dsys::CUdeviceptr, usize)> {
        let Some(touched) = self.capture.take() else { return Vec::new() };
        let mut held = Vec::new();
        for (&size, list) in self.free.iter_mut() {
            list.retain(|p| {
                let keep = !touched.contains(p);
                if !keep {
                    held.push((*p, size));
                }
                keep
            });
        }
        self.free.retain(|_, l| !l.is_empty());
        for &(_, size) in &held {
            self.stats.cached_bytes -= size;
        }
        held
    }

    /// Returns blocks a dropped graph held to the free lists.
    pub(crate) fn give_back(&mut self, blocks: Vec<(dsys::CUdeviceptr, usize)>) {
        for (p, size) in blocks {
            self.free.entry(size).or_default().push(p);
            self.stats.cached_bytes += size;
        }
    }

    fn note_in_use(&mut self, size: usize) {
        self.stats.in_use_bytes += size;
        self.stats.peak_in_use_bytes = self.stats.peak_in_use_bytes.max(self.stats.in_use_bytes);
    }

    pub(crate) fn stats(&self) -> AllocStats {
        self.stats
    }

    /// Frees every cached block to the driver. The caller has bound the context and made sure
    /// no enqueued work still uses them (synchronised the stream).
    pub(crate) fn release_all(&mut self) {
        for (_, list) in std::mem::take(&mut self.free) {
            for p in list {
                // SAFETY: p came from cuMemAlloc and no live buffer refers to it.
                let _ = unsafe { dres::free_sync(p) };
            }
        }
        self.stats.cached_bytes = 0;
    }
}

/// Device memory from the caching allocator; returns to the pool when dropped.
pub struct CudaBuffer {
    ptr: dsys::CUdeviceptr,
    len: usize,
    size: usize,
    dev: CudaDevice,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer({} bytes on cuda:{})", self.len, self.dev.ordinal())
    }
}

impl CudaBuffer {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Bytes requested (the block may be larger).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        lock(&self.dev.inner().pool).put(self.ptr, self.size);
    }
}

/// Allocates through `dev`'s pool (see the module docs).
pub(crate) fn alloc(dev: &CudaDevice, bytes: usize) -> Result<CudaBuffer> {
    let class = class_of(bytes);
    if let Some((ptr, size)) = {
        let mut pool = lock(&dev.inner().pool);
        let got = pool.take(class);
        if let Some((p, s)) = got {
            pool.note_in_use(s);
            if let Some(c) = &mut pool.capture {
                c.insert(p);
            }
        }
        got
    } {
        return Ok(CudaBuffer { ptr, len: bytes, size, dev: dev.clone() });
    }
    dev.bind()?;
    // SAFETY: plain allocation with the context bound.
    let ptr = match unsafe { dres::malloc_sync(class) } {
        Ok(p) => p,
        Err(e) if e.0 == dsys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
            dev.synchronize()?;
            lock(&dev.inner().pool).release_all();
            // SAFETY: as above.
            unsafe { dres::malloc_sync(class) }.map_err(|e| {
                let (free, total) = dev.mem_info().unwrap_or((0, 0));
                CoreError::Device(format!(
                    "out of device memory allocating {class} bytes on cuda:{} ({e}; {free} of {total} bytes free after emptying the cache)",
                    dev.ordinal()
                ))
            })?
        }
        Err(e) => return Err(derr(&format!("cuMemAlloc of {class} bytes"))(e)),
    };
    let mut pool = lock(&dev.inner().pool);
    if let Some(c) = &mut pool.capture {
        c.insert(ptr);
    }
    pool.stats.driver_allocs += 1;
    pool.note_in_use(class);
    Ok(CudaBuffer { ptr, len: bytes, size: class, dev: dev.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn classes_and_best_fit() {
        assert_eq!(class_of(0), 512);
        assert_eq!(class_of(513), 1024);
        assert_eq!(class_of(SMALL_MAX), SMALL_MAX);
        assert_eq!(class_of(SMALL_MAX + 1), 2 << 20);
        assert_eq!(class_of(5 << 20), 6 << 20);
        let mut p = Pool::default();
        p.put(0x1000, 1024);
        p.put(0x2000, 64 << 20);
        // A 512-byte request may not take the 1 KiB block (more than 1/8 larger)...
        assert!(p.take(512).is_none());
        // ...nor a 2 MiB request the 64 MiB block; exact and near fits are served.
        assert!(p.take(2 << 20).is_none());
        assert_eq!(p.take(1024), Some((0x1000, 1024)));
        assert_eq!(p.take(60 << 20), Some((0x2000, 64 << 20)));
        assert_eq!(p.stats().cached_bytes, 0);
        assert_eq!(p.stats().cache_hits, 2);
    }

    #[test]
    fn capture_keeps_touched_blocks_out_of_the_pool() {
        let mut p = Pool::default();
        p.put(0x1000, 1024);
        p.put(0x3000, 1024);
        p.begin_capture();
        // A block taken and returned during capture, and one only returned (freed) during it.
        let (a, _) = p.take(1024).expect("cached block");
        p.put(a, 1024);
        p.put(0x2000, 2048);
        let held = p.end_capture();
        let mut ptrs: Vec<_> = held.iter().map(|h| h.0).collect();
        ptrs.sort();
        let mut want = vec![a, 0x2000];
        want.sort();
        assert_eq!(ptrs, want);
        // The untouched block is still served; the held ones are not until given back.
        let other = if a == 0x1000 { 0x3000 } else { 0x1000 };
        assert_eq!(p.take(1024), Some((other, 1024)));
        assert!(p.take(1024).is_none());
        p.give_back(held);
        assert_eq!(p.take(2048), Some((0x2000, 2048)));
    }
}
