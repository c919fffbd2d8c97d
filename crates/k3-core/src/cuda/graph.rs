//! CUDA graphs: capture the work a closure enqueues on a device's compute stream once, replay
//! it with one launch (the decode step of 93 layers without 93 layers of launch overhead).
//!
//! Capture is allocation-safe: temporaries the closure takes from the caching allocator keep the
//! addresses the graph baked in, so every block the capture touched (allocated or freed during
//! it) is held by the [`Graph`] and returned to the pool only when the graph is dropped. Tensors
//! created before the capture and used by it (weights, caches, input/output buffers) must
//! outlive the graph; their owner keeps them. Capture runs in relaxed mode so a first-time
//! `cuMemAlloc` inside it is legal (it is not recorded; only stream work is).

use std::sync::atomic::Ordering;

use cudarc::driver::sys::{CUdeviceptr, CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::{derr, lock, CudaDevice};
use crate::{CoreError, Result};

/// A captured, instantiated graph of one device's compute stream.
pub struct Graph {
    g: Option<cudarc::driver::CudaGraph>,
    dev: CudaDevice,
    held: Vec<(CUdeviceptr, usize)>,
}

// SAFETY: a graph and its executable are driver handles of one context, valid on any thread
// that has that context current; `launch` binds it first, and `Drop` synchronises the device.
unsafe impl Send for Graph {}

impl Graph {
    /// Enqueues one replay on the compute stream.
    pub fn launch(&self) -> Result<()> {
        self.dev.bind()?;
        match &self.g {
            Some(g) => g.launch().map_err(derr("cuGraphLaunch")),
            None => Err(CoreError::Device("graph already destroyed".into())),
        }
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // Replays may still be running: wait before the held blocks can be reused.
        let _ = self.dev.synchronize();
        self.g.take();
        lock(&self.dev.inner().pool).give_back(std::mem::take(&mut self.held));
    }
}

/// Captures what `f` enqueues on `dev`'s compute stream (nothing runs during capture). `f` must
/// not copy to or from the host or synchronise; it may allocate device temporaries.
pub fn capture(dev: &CudaDevice, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
    dev.synchronize()?;
    let stream = dev.inner().stream.clone();
    lock(&dev.inner().pool).begin_capture();
    if let Err(e) = stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) {
        lock(&dev.inner().pool).end_capture();
        return Err(derr("cuStreamBeginCapture")(e));
    }
    dev.inner().capturing.store(true, Ordering::Relaxed);
    let r = f();
    dev.inner().capturing.store(false, Ordering::Relaxed);
    let g = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(derr("cuStreamEndCapture"));
    let held = lock(&dev.inner().pool).end_capture();
    let mut graph = Graph { g: None, dev: dev.clone(), held };
    r?;
    graph.g = Some(g?.ok_or_else(|| CoreError::Device("stream capture produced an empty graph".into()))?);
    Ok(graph)
}
