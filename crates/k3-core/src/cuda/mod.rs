//! The CUDA device path (feature `cuda`): one [`CudaDevice`] per GPU with its context, its
//! compute stream, a caching allocator, the NVRTC-compiled kernel modules and the cuBLAS(Lt)
//! handles; [`CudaTensor`] for data on it; [`ops`] and [`blas`] for the kernels; [`bench`] for
//! timing them.
//!
//! Everything is loaded at run time (cudarc `dynamic-loading`): the binary links no CUDA
//! library and builds on a machine without CUDA. cudarc *panics* on the first call into a
//! library it cannot load, so every entry point here first checks the library is present
//! ([`probe`], [`library_report`]) and returns [`CoreError::CudaUnavailable`] (no driver or
//! no GPU) or [`CoreError::Device`] (NVRTC/cuBLAS missing, any CUDA error) instead.
//!
//! Ordering model: every op of a device is enqueued on that device's one compute stream, so
//! ops run in call order and buffers returned to the caching allocator can be reused at once.
//! Work put on an extra [`Stream`] must be joined back ([`Stream::wait`] on an [`Event`])
//! before the tensors it touched are dropped. Launch errors are checked on every launch; in
//! debug builds (or with `K3_CUDA_SYNC=1`) the stream is also synchronised after each launch
//! so a faulting kernel is reported by name.

mod alloc;
pub mod bench;
pub mod blas;
mod compile;
pub mod dsa;
pub mod gemv;
mod graph;
pub mod kda;
pub mod mla;
pub mod moe;
mod moe_prefill;
pub mod ops;
pub mod pinned;
pub mod sample;
mod tensor;
pub mod vision;

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{result as dres, sys as dsys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};

pub use alloc::{AllocStats, CudaBuffer};
pub use graph::{capture, Graph};
pub use tensor::CudaTensor;

use crate::kernels::cuda::Source;
use crate::{CoreError, Device, Result};

/// Maps any CUDA library error to [`CoreError::Device`] with what was being done.
pub(crate) fn derr<E: fmt::Display>(what: &str) -> impl FnOnce(E) -> CoreError + '_ {
    move |e| CoreError::Device(format!("{what}: {e}"))
}

/// Locks a mutex, ignoring poisoning (the guarded caches stay consistent across panics).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which of the four dynamically loaded libraries the loader can find (checked once).
#[derive(Clone, Copy, Debug)]
pub struct Libraries {
    pub driver: bool,
    pub nvrtc: bool,
    pub cublas: bool,
    pub cublaslt: bool,
}

/// Looks for libcuda, libnvrtc, libcublas and libcublasLt without calling into them.
/// `nvrtcVersion` (major, minor) when libnvrtc loads.
pub(crate) fn nvrtc_version() -> Option<(i32, i32)> {
    if !library_report().nvrtc {
        return None;
    }
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: out-parameter query; the library is present (checked above).
    let ok = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    (ok == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((a, b))
}

pub fn library_report() -> Libraries {
    static L: OnceLock<Libraries> = OnceLock::new();
    // SAFETY: these only try to dlopen candidate file names; nothing is called.
    *L.get_or_init(|| unsafe {
        Libraries {
            driver: dsys::is_culib_present(),
            nvrtc: cudarc::nvrtc::sys::is_culib_present(),
            cublas: cudarc::cublas::sys::is_culib_present(),
            cublaslt: cudarc::cublaslt::sys::is_culib_present(),
        }
    })
}

/// Compiles one kernel source with NVRTC to a cubin for compute capability `cc`, without a GPU
/// (NVRTC needs no driver): how CI checks that every `.cu` file still compiles. Returns the
/// cubin's size in bytes.
pub fn compile_check(src: crate::kernels::cuda::Source, cc: (i32, i32)) -> Result<usize> {
    Ok(compile::cubin(src, cc)?.len())
}

/// Errors unless `lib` is present; `what` names it in the message.
pub(crate) fn require(present: bool, what: &str) -> Result<()> {
    if present {
        Ok(())
    } else {
        Err(CoreError::Device(format!(
            "{what} could not be loaded: install the CUDA 13 runtime libraries (or a matching \
             cuda-toolkit) so that the dynamic loader finds {what} (ldconfig or LD_LIBRARY_PATH); see docs/gpu.md"
        )))
    }
}

/// Checks that the driver library loads, initialises, and sees at least one GPU. Returns the
/// number of GPUs. Never panics; `CudaUnavailable` when there is no driver or no device.
pub fn probe() -> Result<usize> {
    static R: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    let r = R.get_or_init(|| {
        if !library_report().driver {
            return Err("libcuda.so (the NVIDIA driver) was not found by the dynamic loader".to_string());
        }
        dres::init().map_err(|e| format!("cuInit failed: {e} (driver present but unusable)"))?;
        let n = dres::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
        if n <= 0 {
            return Err("the driver loads but reports no GPU".to_string());
        }
        Ok(n as usize)
    });
    r.clone().map_err(CoreError::CudaUnavailable)
}

/// What a device and the loaded libraries report about themselves.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: i32,
    pub total_mem: usize,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    /// `nvrtcVersion` (major, minor) when libnvrtc loads.
    pub nvrtc_version: Option<(i32, i32)>,
    /// `cublasLtGetVersion` (e.g. 130100 for 13.1.0) when libcublasLt loads.
    pub cublaslt_version: Option<usize>,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (ma, mi) = self.compute_capability;
        write!(
            f,
            "cuda:{} {} (sm_{ma}{mi}, {} SMs, {:.1} GiB), driver CUDA {}.{}",
            self.ordinal,
            self.name,
            self.multiprocessors,
            self.total_mem as f64 / (1u64 << 30) as f64,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        )?;
        if let Some((a, b)) = self.nvrtc_version {
            write!(f, ", NVRTC {a}.{b}")?;
        }
        if let Some(v) = self.cublaslt_version {
            write!(f, ", cuBLASLt {}.{}.{}", v / 10000, (v / 100) % 100, v % 100)?;
        }
        Ok(())
    }
}

/// A GPU: context, compute stream, allocator, compiled modules, BLAS handles. Cheap to clone
/// (shared); [`CudaDevice::new`] returns the same instance for the same ordinal.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    info: DeviceInfo,
    pub(crate) pool: Mutex<alloc::Pool>,
    funcs: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    pub(crate) blas: Mutex<Option<blas::Blas>>,
    /// [`CudaDevice::side_stream`], once created.
    side: Mutex<Option<Stream>>,
    sync_each_launch: bool,
    /// Set while a graph capture is under way: launches are recorded, not run, so the debug
    /// per-launch synchronisation must be skipped (it is illegal during capture).
    pub(crate) capturing: std::sync::atomic::AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Best effort: no error can be reported from drop.
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        if let Some(side) = lock(&self.side).as_ref() {
            let _ = side.synchronize();
        }
        lock(&self.blas).take();
        lock(&self.pool).release_all();
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice({})", self.inner.info)
    }
}

impl CudaDevice {
    /// The process-wide device for `ordinal`, created on first use (context, stream,
    /// allocator). Errors cleanly when there is no driver, no such GPU, or a CUDA call fails.
    pub fn new(ordinal: usize) -> Result<Self> {
        static DEVICES: OnceLock<Mutex<HashMap<usize, CudaDevice>>> = OnceLock::new();
        let n = probe()?;
        if ordinal >= n {
            return Err(CoreError::CudaUnavailable(format!("cuda:{ordinal} requested but the driver reports {n} GPU(s)")));
        }
        let mut map = lock(DEVICES.get_or_init(Default::default));
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Self::create(ordinal)?;
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    /// The device for a [`Device`]: errors for `Device::Cpu`.
    pub fn for_device(device: Device) -> Result<Self> {
        match device {
            Device::Cuda(i) => Self::new(i),
            Device::Cpu => Err(CoreError::Device("CudaDevice::for_device called with Device::Cpu".into())),
        }
    }

    fn create(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(derr("creating the CUDA context"))?;
        // We do our own ordering (one compute stream); cudarc's per-slice event tracking is unused.
        // SAFETY: no cudarc CudaSlice is ever created on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(derr("creating the compute stream"))?;
        let attr = |a| ctx.attribute(a).map_err(derr("reading a device attribute"));
        use dsys::CUdevice_attribute as A;
        let cc = (attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?, attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?);
        let mut drv = 0i32;
        // SAFETY: plain out-parameter query; the driver library is loaded (probe()).
        unsafe { dsys::cuDriverGetVersion(&mut drv) }.result().map_err(derr("cuDriverGetVersion"))?;
        let libs = library_report();
        let nvrtc_version = nvrtc_version();
        // SAFETY: version query with no arguments; library present.
        let cublaslt_version = libs.cublaslt.then(|| unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() });
        let info = DeviceInfo {
            ordinal,
            name: ctx.name().map_err(derr("cuDeviceGetName"))?,
            compute_capability: cc,
            multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            total_mem: ctx.total_mem().map_err(derr("cuDeviceTotalMem"))?,
            driver_version: drv,
            nvrtc_version,
            cublaslt_version,
        };
        let sync_each_launch = cfg!(debug_assertions) || std::env::var("K3_CUDA_SYNC").is_ok_and(|v| v == "1");
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                ctx,
                stream,
                info,
                pool: Mutex::new(alloc::Pool::default()),
                funcs: Mutex::new(HashMap::new()),
                modules: Mutex::new(HashMap::new()),
                blas: Mutex::new(None),
                side: Mutex::new(None),
                sync_each_launch,
                capturing: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }
    pub fn ordinal(&self) -> usize {
        self.inner.info.ordinal
    }
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal())
    }
    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }
    pub(crate) fn same(&self, other: &CudaDevice) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Makes this device's context current on the calling thread (every entry point does).
    pub(crate) fn bind(&self) -> Result<()> {
        self.inner.ctx.bind_to_thread().map_err(derr("binding the CUDA context to this thread"))
    }

    /// The raw compute stream handle (for cuBLAS and memcpy calls).
    pub(crate) fn cu_stream(&self) -> dsys::CUstream {
        self.inner.stream.cu_stream()
    }

    /// Waits until everything enqueued on the compute stream has finished; reports any
    /// asynchronous kernel fault.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.inner.stream.synchronize().map_err(derr("synchronizing the compute stream"))
    }

    /// The compute stream every op of this device runs on.
    pub fn stream(&self) -> Stream {
        Stream { s: self.inner.stream.clone() }
    }

    /// This device's side stream (created on first use, then reused): the one extra stream the
    /// ops themselves use, e.g. the MoE prefill's weight dequantization beside its GEMMs. Work
    /// put on it is joined back to the compute stream by the op that put it there.
    pub(crate) fn side_stream(&self) -> Result<Stream> {
        let mut side = lock(&self.inner.side);
        if let Some(s) = &*side {
            return Ok(s.clone());
        }
        let s = self.new_stream()?;
        *side = Some(s.clone());
        Ok(s)
    }

    /// A new non-blocking stream on this device (for overlapping copies with compute).
    pub fn new_stream(&self) -> Result<Stream> {
        self.bind()?;
        Ok(Stream { s: self.inner.ctx.new_stream().map_err(derr("cuStreamCreate"))? })
    }

    /// A new event; `timing` events can measure elapsed time.
    pub fn new_event(&self, timing: bool) -> Result<Event> {
        self.bind()?;
        let flags = if timing { dsys::CUevent_flags::CU_EVENT_DEFAULT } else { dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        Ok(Event { e: self.inner.ctx.new_event(Some(flags)).map_err(derr("cuEventCreate"))? })
    }

    /// (free, total) device memory as the driver reports it.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        self.inner.ctx.mem_get_info().map_err(derr("cuMemGetInfo"))
    }

    /// Allocator counters (bytes in use, cached, peak, driver calls).
    pub fn alloc_stats(&self) -> AllocStats {
        lock(&self.inner.pool).stats()
    }

    /// Returns every cached (unused) block to the driver.
    pub fn empty_cache(&self) -> Result<()> {
        self.synchronize()?;
        lock(&self.inner.pool).release_all();
        Ok(())
    }

    /// Allocates `bytes` of device memory through the caching allocator (contents undefined).
    pub fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        alloc::alloc(self, bytes)
    }

    /// The function `func` of module `src`, compiling the module with NVRTC on first use.
    pub(crate) fn function(&self, src: Source, func: &'static str) -> Result<CudaFunction> {
        if let Some(f) = lock(&self.inner.funcs).get(&(src.name, func)) {
            return Ok(f.clone());
        }
        self.bind()?;
        let module = {
            let mut mods = lock(&self.inner.modules);
            match mods.get(src.name) {
                Some(m) => m.clone(),
                None => {
                    let cubin = compile::cubin(src, self.inner.info.compute_capability)?;
                    let ptx = cudarc::nvrtc::Ptx::from_binary(cubin.as_ref().clone());
                    let m = self.inner.ctx.load_module(ptx).map_err(derr(&format!("loading module {}", src.name)))?;
                    mods.insert(src.name, m.clone());
                    m
                }
            }
        };
        let f = module.load_function(func).map_err(derr(&format!("kernel {func} not found in {}.cu", src.name)))?;
        lock(&self.inner.funcs).insert((src.name, func), f.clone());
        Ok(f)
    }

    /// Launches `func` of `src` on the compute stream. `params` holds one pointer per kernel
    /// parameter, each pointing at a value of exactly the kernel's parameter type.
    pub(crate) fn launch(
        &self,
        src: Source,
        func: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.launch_on(&self.inner.stream, src, func, grid, block, smem, params)
    }

    /// [`CudaDevice::launch`] on `stream`: the compute stream, or an extra stream of this
    /// device, which the caller joins back before the buffers the kernel touches are dropped
    /// (see the module docs).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_on(
        &self,
        stream: &CudaStream,
        src: Source,
        func: &'static str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let f = self.function(src, func)?;
        self.bind()?;
        // SAFETY: the caller passes parameters matching the kernel's signature and device
        // pointers that stay allocated until the stream reaches this launch.
        unsafe { dres::launch_kernel(f.cu_function(), grid, block, smem, stream.cu_stream(), params) }.map_err(derr(&format!("launching {func}")))?;
        if self.inner.sync_each_launch && !self.inner.capturing.load(std::sync::atomic::Ordering::Relaxed) {
            stream.synchronize().map_err(derr(&format!("kernel {func} failed")))?;
        }
        Ok(())
    }

    /// A grid for a grid-stride elementwise kernel over `n` items with `block` threads.
    pub(crate) fn elementwise_grid(&self, n: usize, block: u32) -> u32 {
        let max_blocks = (self.inner.info.multiprocessors.max(1) as usize) * 16;
        n.div_ceil(block as usize).clamp(1, max_blocks) as u32
    }
}

/// Builds the kernel-parameter array for [`CudaDevice::launch`] from local variables.
macro_rules! kargs {
    ($($a:expr),* $(,)?) => { [$((&$a) as *const _ as *mut ::std::ffi::c_void),*] };
}
pub(crate) use kargs;

/// A CUDA stream of one device.
#[derive(Clone)]
pub struct Stream {
    s: Arc<CudaStream>,
}

impl Stream {
    pub fn synchronize(&self) -> Result<()> {
        self.s.synchronize().map_err(derr("cuStreamSynchronize"))
    }
    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.s.wait(&event.e).map_err(derr("cuStreamWaitEvent"))
    }
    pub(crate) fn raw(&self) -> &CudaStream {
        &self.s
    }
}

/// A CUDA event.
pub struct Event {
    e: CudaEvent,
}

impl Event {
    /// Captures the work enqueued on `stream` so far.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.e.record(stream.raw()).map_err(derr("cuEventRecord"))
    }
    pub fn synchronize(&self) -> Result<()> {
        self.e.synchronize().map_err(derr("cuEventSynchronize"))
    }
    /// Milliseconds from `self` to `end` (both timing events, both recorded); waits for both.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.e.elapsed_ms(&end.e).map_err(derr("cuEventElapsedTime"))
    }
}
