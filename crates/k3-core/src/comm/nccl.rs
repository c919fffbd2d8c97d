//! NCCL on a device stream (feature `cuda`): [`CudaGroup`], the device-side twin of
//! [`Group`](super::Group). Its verbs take [`CudaTensor`]s and are enqueued on the device's one
//! compute stream, so they order with every kernel and capture into CUDA graphs
//! ([`crate::cuda::capture`]; run each collective once eagerly first: NCCL connects on first use).
//! [`CudaGroup::single`] is world 1 (every verb returns at once, no library needed);
//! [`CudaGroup::nccl`] joins an NCCL communicator, one rank per process, whose 128-byte id comes
//! from [`nccl_unique_id`] on one rank (that process hosts NCCL's bootstrap root until all joined).
//!
//! Shapes (n = elements per rank, W = world): `all_reduce_sum` x [n] in place; `all_gather`
//! x [n] → out [W·n] in rank order; `reduce_scatter` x [W·n] → out [n], part `rank` of the sum;
//! `broadcast` x [n] in place from `root`; `send`/`recv` x [n]. Dtypes F32, BF16, F16, I32, I64, U8.
//!
//! Library: cudarc's NCCL loader (`nccl` + `dynamic-loading`) never tries `libnccl.so.2`, the name
//! NVIDIA's packages and pip's `nvidia-nccl-cu*` wheels ship, and panics on a missing library or
//! symbol. So this file dlopens the library itself and binds what it uses with `dlsym`, typed with
//! cudarc's `nccl::sys` structs; no cudarc `nccl` function is called, so nothing can panic. Search
//! order: `$K3_NCCL_LIB` (the file or its folder), the loader's path (`libnccl.so.2`, `libnccl.so`),
//! then CUDA, conda and Python folders (`…/site-packages/nvidia/nccl/lib`). `ncclGetVersion` is
//! checked first: NCCL ≥ 2.18 is required.
//!
//! Faults: communicators are non-blocking (`ncclConfig_t.blocking = 0`), so no NCCL call blocks
//! the host. Init, in-progress launches and [`CudaGroup::wait`]/[`CudaGroup::barrier`] poll
//! `ncclCommGetAsyncError`; a watchdog thread polls it too, and an event recorded after each eager
//! verb. On an NCCL error (a peer's socket closed, say) or when the oldest unfinished verb is older
//! than `K3_NCCL_TIMEOUT_S` (default 180 s), the communicator is aborted (`ncclCommAbort`, which
//! also makes its spinning kernels exit, so even a plain stream synchronise returns) and this and
//! every later call returns [`CoreError::Comm`] naming the call, the rank and the reason. Graph
//! replays are not seen: call [`CudaGroup::watch`] or `wait` after launching one that holds
//! collectives. One thread should issue a group's calls.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::{path::PathBuf, thread::JoinHandle, time::Duration, time::Instant};

use cudarc::driver::{result as dres, sys as dsys, CudaEvent};
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};

use crate::cuda::{derr, lock, CudaDevice, CudaTensor};
use crate::{CoreError, DType, Result};

// ---- the library ----

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
    fn dladdr(addr: *const c_void, info: *mut [*const c_void; 4]) -> c_int;
}
const RTLD_NOW: c_int = 2;
/// NCCL 2.18.0: non-blocking init, finalize and bf16 are all older.
const MIN_VERSION: i32 = 21800;
const IN_PROGRESS: c_int = 7;
const SUM: c_int = 0;
const HOW_TO_GET: &str = "install NCCL 2.18 or newer (pip install nvidia-nccl-cu13 — or -cu12 —, the distribution's \
     libnccl2 package, or NVIDIA's tarball), or set K3_NCCL_LIB to the file or its folder";

type Res = c_int; // ncclResult_t (an int in C; kept raw so an unknown code is no UB)
type Stream = *mut c_void; // cudaStream_t = CUstream
type Comm = ncclComm_t;
type Buf = *const c_void;
type BufMut = *mut c_void;

/// Declares [`Api`] (the entry points used, as `dlsym` finds them) and its binder.
macro_rules! api {
    ($($field:ident = $name:literal: fn($($arg:ty),*) -> $ret:ty;)*) => {
        struct Api { path: String, version: i32, $($field: unsafe extern "C" fn($($arg),*) -> $ret,)* }
        /// SAFETY: `h` is a dlopen handle of libnccl; the types are nccl.h's (2.18 and later).
        unsafe fn bind(h: *mut c_void, path: String, version: i32) -> std::result::Result<Api, String> {
            Ok(Api { $($field: unsafe { sym(h, &path, $name)? },)* path, version })
        }
    };
}
api! {
    get_unique_id = "ncclGetUniqueId": fn(*mut ncclUniqueId) -> Res;
    init_rank_config = "ncclCommInitRankConfig": fn(*mut Comm, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> Res;
    async_error = "ncclCommGetAsyncError": fn(Comm, *mut Res) -> Res;
    abort = "ncclCommAbort": fn(Comm) -> Res;
    finalize = "ncclCommFinalize": fn(Comm) -> Res;
    destroy = "ncclCommDestroy": fn(Comm) -> Res;
    error_string = "ncclGetErrorString": fn(Res) -> *const c_char;
    last_error = "ncclGetLastError": fn(Comm) -> *const c_char;
    all_reduce = "ncclAllReduce": fn(Buf, BufMut, usize, c_int, c_int, Comm, Stream) -> Res;
    all_gather = "ncclAllGather": fn(Buf, BufMut, usize, c_int, Comm, Stream) -> Res;
    reduce_scatter = "ncclReduceScatter": fn(Buf, BufMut, usize, c_int, c_int, Comm, Stream) -> Res;
    broadcast = "ncclBroadcast": fn(Buf, BufMut, usize, c_int, c_int, Comm, Stream) -> Res;
    send = "ncclSend": fn(Buf, usize, c_int, c_int, Comm, Stream) -> Res;
    recv = "ncclRecv": fn(BufMut, usize, c_int, c_int, Comm, Stream) -> Res;
    group_start = "ncclGroupStart": fn() -> Res;
    group_end = "ncclGroupEnd": fn() -> Res;
}

fn cstr(p: *const c_char) -> String {
    // SAFETY: NCCL and libdl return NUL-terminated strings that live at least this long.
    if p.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn open(path: &str) -> std::result::Result<*mut c_void, String> {
    let c = CString::new(path).map_err(|_| format!("{path}: not a valid path"))?;
    // SAFETY: dlopen runs the library's initialisers (libnccl's only set up globals); dlerror's
    // message is read at once.
    let h = unsafe { dlopen(c.as_ptr(), RTLD_NOW) };
    if h.is_null() {
        Err(cstr(unsafe { dlerror() }))
    } else {
        Ok(h)
    }
}

/// SAFETY: `T` must be the function-pointer type of `name`'s C declaration.
unsafe fn sym<T: Copy>(h: *mut c_void, path: &str, name: &str) -> std::result::Result<T, String> {
    let c = CString::new(name).expect("symbol names have no NUL");
    let p = unsafe { dlsym(h, c.as_ptr()) };
    if p.is_null() {
        return Err(format!("{path} has no symbol {name} (not an NCCL library, or too old)"));
    }
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, T>(&p) })
}

/// Folders where NCCL is commonly installed, most specific first (pip's wheels put it in
/// `<site-packages>/nvidia/nccl/lib/libnccl.so.2`).
fn search_dirs() -> Vec<PathBuf> {
    let env = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    let ls = |d: PathBuf| std::fs::read_dir(d).into_iter().flatten().flatten().map(|e| e.path());
    let mut dirs: Vec<PathBuf> =
        ["CONDA_PREFIX", "CUDA_HOME", "CUDA_PATH"].iter().filter_map(|v| env(v)).flat_map(|p| [p.join("lib"), p.join("lib64")]).collect();
    dirs.extend(
        ["/usr/local/cuda/lib64", "/usr/local/nccl/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/lib"]
            .map(PathBuf::from),
    );
    let mut sites: Vec<PathBuf> = std::env::var("PYTHONPATH").unwrap_or_default().split(':').filter(|s| !s.is_empty()).map(PathBuf::from).collect();
    let mut roots: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(|v| env(v)).collect();
    if let Some(h) = env("HOME") {
        roots.push(h.join(".local"));
        roots.extend(ls(h.join(".pyenv/versions")));
    }
    roots.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    roots.extend(ls("/opt".into()).flat_map(|p| [p.join(".venv"), p.join("venv"), p]));
    for lib in roots.iter().flat_map(|r| [r.join("lib"), r.join("lib64")]) {
        let pys = ls(lib).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3")));
        sites.extend(pys.flat_map(|p| [p.join("site-packages"), p.join("dist-packages")]));
    }
    sites.push("/usr/lib/python3/dist-packages".into());
    dirs.extend(sites.into_iter().map(|s| s.join("nvidia/nccl/lib")));
    dirs
}

/// Opens libnccl, checks its version, binds the symbols. `Err((unavailable, message))`.
fn load() -> std::result::Result<Api, (bool, String)> {
    let (h, path) = if let Some(p) = std::env::var_os("K3_NCCL_LIB").filter(|s| !s.is_empty()) {
        let p = PathBuf::from(p);
        let f = if p.is_dir() { p.join("libnccl.so.2") } else { p }.to_string_lossy().into_owned();
        (open(&f).map_err(|e| (true, format!("K3_NCCL_LIB: cannot load {f}: {e}; {HOW_TO_GET}")))?, f)
    } else {
        let files = search_dirs().into_iter().flat_map(|d| [d.join("libnccl.so.2"), d.join("libnccl.so")]).filter(|f| f.is_file());
        let mut names = ["libnccl.so.2", "libnccl.so"].map(String::from).into_iter().chain(files.map(|f| f.to_string_lossy().into_owned()));
        names.find_map(|n| open(&n).ok().map(|h| (h, n))).ok_or_else(|| {
            (true, format!("libnccl.so.2 (NCCL) was not found on the loader's path, in the CUDA and conda folders, or in any Python nvidia/nccl/lib folder; {HOW_TO_GET}"))
        })?
    };
    // SAFETY: ncclGetVersion's C type; dladdr fills {file name, base, symbol, address}.
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> Res = sym(h, &path, "ncclGetVersion").map_err(|e| (false, e))?;
        let mut info = [std::ptr::null(); 4];
        let path = if dladdr(get_version as *const c_void, &mut info) != 0 && !info[0].is_null() { cstr(info[0] as *const c_char) } else { path };
        let mut version = 0;
        if get_version(&mut version) != 0 || version < MIN_VERSION {
            return Err((false, format!("{path} is NCCL {} but k3rs needs 2.18 or newer; {HOW_TO_GET}", version_string(version))));
        }
        bind(h, path, version).map_err(|e| (false, e))
    }
}

fn version_string(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
}

fn api(op: &'static str) -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, (bool, String)>> = OnceLock::new();
    match API.get_or_init(load) {
        Ok(a) => Ok(a),
        Err((true, m)) => Err(CoreError::CudaUnavailable(m.clone())),
        Err((false, m)) => Err(CoreError::Comm { op, msg: m.clone() }),
    }
}

/// The loaded NCCL library: (its file, its version as "2.28.3"). Loads it on first use.
pub fn nccl_library() -> Result<(String, String)> {
    let a = api("nccl_library")?;
    Ok((a.path.clone(), version_string(a.version)))
}

/// A fresh NCCL unique id (`ncclGetUniqueId`): the bytes every rank passes to
/// [`CudaGroup::nccl`]. The calling process hosts the bootstrap root until the ranks joined.
pub fn nccl_unique_id() -> Result<[u8; 128]> {
    let a = api("nccl_unique_id")?;
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: out-parameter of the declared type.
    let r = unsafe { (a.get_unique_id)(&mut id) };
    if r != 0 {
        return Err(CoreError::Comm { op: "nccl_unique_id", msg: format!("ncclGetUniqueId failed: {}", err_string(a, r, std::ptr::null_mut())) });
    }
    Ok(id.internal.map(|c| c as u8))
}

/// `K3_NCCL_TIMEOUT_S` (seconds, fractions allowed), default 180.
pub fn nccl_timeout() -> Duration {
    let s = std::env::var("K3_NCCL_TIMEOUT_S").ok().and_then(|s| s.parse::<f64>().ok()).filter(|s| *s > 0.0);
    s.map(Duration::from_secs_f64).unwrap_or(Duration::from_secs(180))
}

fn err_string(a: &Api, r: Res, comm: Comm) -> String {
    // SAFETY: both return static or per-communicator strings; `comm` is null or live.
    let (s, last) = unsafe { (cstr((a.error_string)(r)), cstr((a.last_error)(comm))) };
    if last.is_empty() {
        s
    } else {
        format!("{s} ({last})")
    }
}

/// `ncclCommGetAsyncError` folded into one code: 0, IN_PROGRESS or an error.
fn async_state(api: &Api, comm: Comm) -> Res {
    let mut e: Res = 0;
    // SAFETY: a live communicator and an out-parameter.
    let r = unsafe { (api.async_error)(comm, &mut e) };
    if r != 0 {
        r
    } else {
        e
    }
}

/// Polls a communicator nobody else uses until NCCL is done with it: `Ok` on success,
/// `Err(Some(code))` on an error, `Err(None)` after `limit`.
fn poll(api: &Api, comm: Comm, limit: Duration, cancel: &AtomicBool) -> std::result::Result<(), Option<Res>> {
    let t0 = Instant::now();
    loop {
        match async_state(api, comm) {
            0 => return Ok(()),
            IN_PROGRESS if t0.elapsed() > limit || cancel.load(Ordering::Acquire) => return Err(None),
            IN_PROGRESS => std::thread::sleep(Duration::from_millis(1)),
            bad => return Err(Some(bad)),
        }
    }
}

/// Spins briefly, then sleeps: cheap for µs-scale waits, idle for long ones.
fn pause(t0: Instant) {
    if t0.elapsed() < Duration::from_millis(2) {
        std::thread::yield_now()
    } else {
        std::thread::sleep(Duration::from_micros(500))
    }
}

// ---- the communicator ----

/// `comm` is null once aborted or destroyed; `pending` is the oldest eager verb not yet seen
/// complete and when it was enqueued; inside `in_group` open groups verbs record no event (NCCL
/// launches them at the group's end).
struct State {
    comm: Comm,
    failed: Option<String>,
    pending: Option<(&'static str, Instant)>,
    in_group: usize,
}
// SAFETY: an NCCL communicator may be used from any thread; every use holds the `State` lock.
unsafe impl Send for State {}

/// One communicator; `event` is recorded on the compute stream after eager verbs (complete =
/// everything before it done); `stop` ends the watchdog thread `dog`.
struct Nccl {
    api: &'static Api,
    dev: CudaDevice,
    rank: usize,
    world: usize,
    timeout: Duration,
    event: CudaEvent,
    st: Mutex<State>,
    stop: AtomicBool,
    dog: Mutex<Option<JoinHandle<()>>>,
    /// One f32 for [`CudaGroup::barrier`].
    scratch: CudaTensor,
    /// An abort asked for while another thread held `st` (e.g. waiting for a launch that
    /// connects to a dead peer): that thread's poll stops at `abort_asked`, and whoever holds
    /// the lock next performs the abort ([`Nccl::state`]), so NCCL is never called on the
    /// communicator from two threads.
    abort_asked: AtomicBool,
    abort_why: Mutex<Option<String>>,
}

impl Nccl {
    /// The state, locked, after performing an abort another thread asked for.
    fn state(&self) -> MutexGuard<'_, State> {
        let mut st = lock(&self.st);
        self.honor(&mut st);
        st
    }

    /// Performs an abort asked for while the lock was held (caller holds it).
    fn honor(&self, st: &mut State) {
        if self.abort_asked.load(Ordering::Acquire) && st.failed.is_none() {
            let why = lock(&self.abort_why).clone().unwrap_or_else(|| "aborted".into());
            self.fail(st, "abort", why);
        }
    }

    /// Aborts the communicator and remembers why (idempotent; inside an open group the abort
    /// waits for the group's end, which still needs the handle). Returns the error every call
    /// now gets. Caller holds the lock.
    fn fail(&self, st: &mut State, op: &'static str, why: String) -> CoreError {
        st.failed.get_or_insert(why);
        if !st.comm.is_null() && st.in_group == 0 {
            let _ = self.dev.bind();
            crate::trace(|| format!("NCCL rank {}/{}: {op}: ncclCommAbort ({})", self.rank, self.world, st.failed.as_deref().unwrap_or("")));
            // SAFETY: live communicator; no other call on it can run (we hold the lock).
            unsafe { (self.api.abort)(st.comm) };
            crate::trace(|| format!("NCCL rank {}/{}: {op}: aborted", self.rank, self.world));
            st.comm = std::ptr::null_mut();
        }
        self.failed_err(op, st).expect("failed is set")
    }

    fn failed_err(&self, op: &'static str, st: &State) -> Option<CoreError> {
        st.failed.as_ref().map(|why| CoreError::Comm { op, msg: format!("rank {} of {}: communicator unusable: {why}", self.rank, self.world) })
    }

    /// `Err` once the communicator has failed.
    fn live(&self, op: &'static str, st: &State) -> Result<()> {
        self.failed_err(op, st).map_or(Ok(()), Err)
    }

    /// Polls NCCL's asynchronous error and the pending event once; aborts on an error or when
    /// the oldest pending verb is past the timeout. `Ok(true)` when nothing is pending.
    fn check(&self, st: &mut State, op: &'static str) -> Result<bool> {
        self.live(op, st)?;
        let bad = async_state(self.api, st.comm);
        let what = st.pending.map(|p| p.0).unwrap_or("the last call");
        if bad != 0 && bad != IN_PROGRESS {
            let why = format!("NCCL reported {} while {what} was in flight: a peer rank died or its connection failed", err_string(self.api, bad, st.comm));
            return Err(self.fail(st, op, why));
        }
        let Some((_, since)) = st.pending else { return Ok(true) };
        let _ = self.dev.bind();
        let not_ready = dsys::cudaError_enum::CUDA_ERROR_NOT_READY;
        // SAFETY: the event belongs to this device's context, bound above.
        match unsafe { dres::event::query(self.event.cu_event()) } {
            Ok(()) => {
                st.pending = None;
                Ok(true)
            }
            Err(e) if e.0 == not_ready && since.elapsed() <= self.timeout => Ok(false),
            Err(e) if e.0 == not_ready => {
                let why = format!(
                    "{what} did not complete within {:.0} s (a peer rank died, hangs, or never made the matching call; K3_NCCL_TIMEOUT_S sets the limit)",
                    self.timeout.as_secs_f64()
                );
                Err(self.fail(st, op, why))
            }
            Err(e) => Err(self.fail(st, op, format!("the device failed while {what} was in flight: {e}"))),
        }
    }

    /// Records the completion event after everything enqueued so far (unless capturing or
    /// inside a group) and starts the pending clock if it is not running.
    fn record(&self, st: &mut State, op: &'static str) -> Result<()> {
        if st.in_group == 0 && !self.dev.inner().capturing.load(Ordering::Relaxed) {
            self.event.record(&self.dev.inner().stream).map_err(derr("cuEventRecord"))?;
            st.pending.get_or_insert((op, Instant::now()));
        }
        Ok(())
    }

    /// Enqueues one NCCL call (`f` gets the communicator and the compute stream), then
    /// [`Nccl::finish`]es it.
    fn call(&self, op: &'static str, f: impl FnOnce(&Api, Comm, Stream) -> Res) -> Result<()> {
        let st = self.state();
        self.live(op, &st)?;
        self.dev.bind()?;
        let r = f(self.api, st.comm, self.dev.cu_stream() as Stream);
        self.finish(st, op, r)
    }

    /// After a call returned `r`: waits while NCCL reports the launch in progress (bounded; the
    /// lock is held, so the watchdog waits too), fails the group on an error other than a bad
    /// argument, records the event.
    fn finish(&self, mut st: MutexGuard<'_, State>, op: &'static str, r: Res) -> Result<()> {
        let r = if r == IN_PROGRESS { poll(self.api, st.comm, self.timeout, &self.abort_asked).map_or_else(|e| e.unwrap_or(IN_PROGRESS), |_| 0) } else { r };
        self.honor(&mut st);
        if let Some(e) = self.failed_err(op, &st) {
            return Err(e);
        }
        if r == IN_PROGRESS {
            let why = format!("{op} was still being launched after {:.0} s (peers missing; K3_NCCL_TIMEOUT_S sets the limit)", self.timeout.as_secs_f64());
            return Err(self.fail(&mut st, op, why));
        }
        if r != 0 {
            let msg = format!("rank {} of {}: {}", self.rank, self.world, err_string(self.api, r, st.comm));
            if r != 4 && r != 5 {
                // Not ncclInvalidArgument/ncclInvalidUsage: the communicator may be broken.
                self.fail(&mut st, op, format!("{op} failed: {msg}"));
            }
            return Err(CoreError::Comm { op, msg });
        }
        self.record(&mut st, op)
    }
}

/// Every 50 ms: NCCL's asynchronous error, and the pending verb against the timeout.
fn watchdog(n: Arc<Nccl>) {
    while !n.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        let mut st = n.state();
        if st.failed.is_none() {
            let _ = n.check(&mut st, "watchdog");
        }
    }
}

/// A group of ranks whose verbs run on device tensors (see the module docs); `None` is world 1.
pub struct CudaGroup {
    n: Option<Arc<Nccl>>,
}

impl CudaGroup {
    /// The world-1 group: every verb returns at once (a gather or scatter into another tensor
    /// enqueues one copy); there is no peer to send to.
    pub fn single() -> Self {
        CudaGroup { n: None }
    }

    /// Rank `rank` of `world` joins the communicator of `id` on `dev` (its context is bound to
    /// this thread first). Returns once every rank has joined, or errors after the timeout
    /// ([`nccl_timeout`], which then bounds every later call too).
    pub fn nccl(dev: &CudaDevice, rank: usize, world: usize, id: [u8; 128]) -> Result<Self> {
        const OP: &str = "nccl_init";
        let timeout = nccl_timeout();
        if world == 0 || rank >= world {
            return Err(CoreError::Comm { op: OP, msg: format!("rank {rank} does not exist in a world of {world}") });
        }
        let api = api(OP)?;
        dev.bind()?;
        const U: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
        let null = std::ptr::null();
        #[rustfmt::skip]
        let mut cfg = ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(), magic: 0xcafebeef, version: api.version as u32, blocking: 0,
            cgaClusterSize: U, minCTAs: U, maxCTAs: U, netName: null, splitShare: U, trafficClass: U, commName: null,
            collnetEnable: U, CTAPolicy: U, shrinkShare: U, nvlsCTAs: U, nChannelsPerNetPeer: U, nvlinkCentricSched: U,
            graphUsageMode: U, numRmaCtx: U, maxP2pPeers: U,
        };
        let uid = ncclUniqueId { internal: id.map(|b| b as c_char) };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: out-parameter; the config is filled as NCCL_CONFIG_INITIALIZER does (the
        // library reads at most its own struct size and only the fields of its version).
        let r = unsafe { (api.init_rank_config)(&mut comm, world as c_int, uid, rank as c_int, &mut cfg) };
        if let Err(bad) = if r == 0 || r == IN_PROGRESS { poll(api, comm, timeout, &AtomicBool::new(false)) } else { Err(Some(r)) } {
            let msg = match bad {
                Some(c) => format!("rank {rank} of {world}: ncclCommInitRankConfig failed: {}", err_string(api, c, comm)),
                None => format!("rank {rank} of {world}: not every rank joined within {:.0} s (a peer died, was not started, or holds another id; K3_NCCL_TIMEOUT_S sets the limit)", timeout.as_secs_f64()),
            };
            if !comm.is_null() {
                // SAFETY: the half-made communicator is ours alone.
                unsafe { (api.abort)(comm) };
            }
            return Err(CoreError::Comm { op: OP, msg });
        }
        let event = dev.inner().ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(derr("cuEventCreate"))?;
        let scratch = CudaTensor::zeros(dev, DType::F32, vec![1])?;
        let st = Mutex::new(State { comm, failed: None, pending: None, in_group: 0 });
        let n = Arc::new(Nccl {
            api,
            dev: dev.clone(),
            rank,
            world,
            timeout,
            event,
            st,
            stop: AtomicBool::new(false),
            dog: Mutex::new(None),
            scratch,
            abort_asked: AtomicBool::new(false),
            abort_why: Mutex::new(None),
        });
        let n2 = n.clone();
        let dog = std::thread::Builder::new().name(format!("k3-nccl-watchdog-{rank}")).spawn(move || watchdog(n2));
        *lock(&n.dog) = Some(dog.map_err(|e| CoreError::Comm { op: OP, msg: format!("starting the watchdog thread: {e}") })?);
        Ok(CudaGroup { n: Some(n) })
    }

    /// This rank's index in the group, `0..world()`.
    pub fn rank(&self) -> usize {
        self.n.as_ref().map_or(0, |n| n.rank)
    }

    /// Number of ranks in the group.
    pub fn world(&self) -> usize {
        self.n.as_ref().map_or(1, |n| n.world)
    }

    fn nccl_of(&self) -> Option<&Nccl> {
        self.n.as_deref()
    }

    /// The NCCL dtype of `t`, after checking it lives on this group's device.
    fn dtype_of(&self, op: &'static str, t: &CudaTensor) -> Result<c_int> {
        if let Some(n) = self.nccl_of().filter(|n| !t.cuda_device().same(&n.dev)) {
            return Err(CoreError::Comm { op, msg: format!("{t:?} is not on this group's device cuda:{}", n.dev.ordinal()) });
        }
        Ok(match t.dtype() {
            DType::U8 => 1,
            DType::I32 => 2,
            DType::I64 => 4,
            DType::F16 => 6,
            DType::F32 => 7,
            DType::BF16 => 9,
        })
    }

    /// Checks that `big` holds `world()` times `small`'s elements, same dtype; returns it.
    fn parts(&self, op: &'static str, small: &CudaTensor, big: &CudaTensor) -> Result<c_int> {
        let dt = self.dtype_of(op, small)?;
        if self.dtype_of(op, big)? != dt || big.numel() != small.numel() * self.world() {
            return Err(CoreError::Shape { op, detail: format!("{big:?} is not {} × {small:?}", self.world()) });
        }
        Ok(dt)
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<&Nccl> {
        let bad = || CoreError::Comm { op, msg: format!("rank {} of {}: peer {peer} is not another rank of this group", self.rank(), self.world()) };
        self.nccl_of().filter(|n| peer < n.world && peer != n.rank).ok_or_else(bad)
    }

    /// Element-wise sum over the ranks, in place. Every rank ends with the same values.
    pub fn all_reduce_sum(&self, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("all_reduce_sum", x)?;
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let p = x.ptr() as BufMut;
        // SAFETY (here and in the verbs below): the sizes were checked, and the caller's
        // tensors stay allocated until the stream has run the enqueued work.
        n.call("all_reduce_sum", |a, c, s| unsafe { (a.all_reduce)(p, p, x.numel(), dt, SUM, c, s) })
    }

    /// Every rank's `x` into `out` (`world()·x.numel()` elements), in rank order.
    pub fn all_gather(&self, x: &CudaTensor, out: &CudaTensor) -> Result<()> {
        let dt = self.parts("all_gather", x, out)?;
        let Some(n) = self.nccl_of() else { return copy_unless_same(x, out) };
        n.call("all_gather", |a, c, s| unsafe { (a.all_gather)(x.ptr() as Buf, out.ptr() as BufMut, x.numel(), dt, c, s) })
    }

    /// The element-wise sum of every rank's `x` (`world()·out.numel()` elements), cut into
    /// `world()` equal parts; part `rank()` lands in `out`.
    pub fn reduce_scatter(&self, x: &CudaTensor, out: &CudaTensor) -> Result<()> {
        let dt = self.parts("reduce_scatter", out, x)?;
        let Some(n) = self.nccl_of() else { return copy_unless_same(x, out) };
        n.call("reduce_scatter", |a, c, s| unsafe { (a.reduce_scatter)(x.ptr() as Buf, out.ptr() as BufMut, out.numel(), dt, SUM, c, s) })
    }

    /// Rank `root`'s `x` to every rank, in place.
    pub fn broadcast(&self, root: usize, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("broadcast", x)?;
        if root >= self.world() {
            return Err(CoreError::Comm { op: "broadcast", msg: format!("root {root} is not a rank of a world of {}", self.world()) });
        }
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let p = x.ptr() as BufMut;
        n.call("broadcast", |a, c, s| unsafe { (a.broadcast)(p, p, x.numel(), dt, root as c_int, c, s) })
    }

    /// Sends `x` to rank `to`; pairs with `to`'s `recv` (put both directions of an exchange in
    /// one [`CudaGroup::group`]).
    pub fn send(&self, to: usize, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("send", x)?;
        self.peer("send", to)?.call("send", |a, c, s| unsafe { (a.send)(x.ptr() as Buf, x.numel(), dt, to as c_int, c, s) })
    }

    /// Receives `x.numel()` elements from rank `from` into `x`.
    pub fn recv(&self, from: usize, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("recv", x)?;
        self.peer("recv", from)?.call("recv", |a, c, s| unsafe { (a.recv)(x.ptr() as BufMut, x.numel(), dt, from as c_int, c, s) })
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`, so the verbs it issues launch as
    /// one (needed for exchanges: a ring's send and recv together).
    pub fn group<R>(&self, f: impl FnOnce(&Self) -> Result<R>) -> Result<R> {
        const OP: &str = "group";
        let Some(n) = self.nccl_of() else { return f(self) };
        {
            let mut st = n.state();
            n.live(OP, &st)?;
            // SAFETY: no arguments.
            match unsafe { (n.api.group_start)() } {
                0 => st.in_group += 1,
                r => return Err(CoreError::Comm { op: OP, msg: format!("ncclGroupStart: {}", err_string(n.api, r, std::ptr::null_mut())) }),
            }
        }
        let out = f(self);
        let mut st = lock(&n.st);
        st.in_group -= 1;
        let _ = n.dev.bind();
        // SAFETY: closes the group opened above on this thread (always, so NCCL's per-thread
        // group depth stays balanced); an abort asked for meanwhile was deferred until here.
        let r = unsafe { (n.api.group_end)() };
        if let Some(why) = st.failed.clone() {
            return Err(n.fail(&mut st, OP, why));
        }
        n.finish(st, OP, r)?;
        out
    }

    /// Lets the watchdog bound everything enqueued so far (e.g. after a graph replay that holds
    /// this group's collectives): past the timeout the group fails naming `op`.
    pub fn watch(&self, op: &'static str) -> Result<()> {
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let mut st = n.state();
        n.live(op, &st)?;
        n.dev.bind()?;
        n.record(&mut st, op)
    }

    /// Waits until everything enqueued on the compute stream so far has finished, or errors
    /// naming `op` when a peer fails or the timeout passes (world 1 without NCCL: returns).
    pub fn wait(&self, op: &'static str) -> Result<()> {
        let Some(n) = self.nccl_of() else { return Ok(()) };
        self.watch(op)?;
        let t0 = Instant::now();
        while !n.check(&mut n.state(), op)? {
            pause(t0);
        }
        Ok(())
    }

    /// Returns when every rank has called it (a one-element all-reduce, then [`Self::wait`]).
    pub fn barrier(&self) -> Result<()> {
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let p = n.scratch.ptr() as BufMut;
        // SAFETY: one f32 of the group's own scratch tensor, in place.
        n.call("barrier", |a, c, s| unsafe { (a.all_reduce)(p, p, 1, 7, SUM, c, s) })?;
        self.wait("barrier")
    }

    /// Fails this rank's communicator at once with `why` (aborting it); its peers' pending and
    /// later calls then fail too (by NCCL's error or the timeout) instead of waiting forever.
    /// Never waits behind a thread that holds the communicator (one stuck launching a verb to a
    /// dead peer): it asks, and that thread stops polling and aborts.
    pub fn abort(&self, why: &str) {
        if let Some(n) = self.nccl_of() {
            lock(&n.abort_why).get_or_insert_with(|| format!("aborted: {why}"));
            n.abort_asked.store(true, Ordering::Release);
            if let Ok(mut st) = n.st.try_lock() {
                n.honor(&mut st);
            }
        }
    }
}

/// World 1's gather and scatter: a copy unless in place.
fn copy_unless_same(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    if x.ptr() == out.ptr() {
        Ok(())
    } else {
        out.copy_from(x)
    }
}

impl Drop for CudaGroup {
    /// Lets enqueued work finish (bounded), then finalizes (which flushes this rank's sends to
    /// its peers) and destroys; a failed or stuck communicator is aborted instead.
    fn drop(&mut self) {
        let Some(n) = self.nccl_of() else { return };
        let who = format!("NCCL rank {}/{}", self.rank(), self.world());
        crate::trace(|| format!("{who}: dropping the communicator"));
        n.stop.store(true, Ordering::Relaxed);
        if let Some(d) = lock(&n.dog).take() {
            let _ = d.join();
        }
        let healthy = self.wait("drop").is_ok();
        crate::trace(|| format!("{who}: watchdog joined, enqueued work done: {healthy}"));
        let mut st = lock(&n.st);
        let comm = std::mem::replace(&mut st.comm, std::ptr::null_mut());
        if comm.is_null() {
            return;
        }
        let _ = n.dev.bind();
        // SAFETY: the communicator is live and ours alone from here; the handle is not used again.
        unsafe {
            let r = if healthy { (n.api.finalize)(comm) } else { 1 };
            let polled = (r == 0 || r == IN_PROGRESS) && poll(n.api, comm, n.timeout.min(Duration::from_secs(30)), &n.abort_asked).is_ok();
            crate::trace(|| format!("{who}: finalize returned {r}, completed: {polled}"));
            if polled {
                (n.api.destroy)(comm);
            } else {
                (n.api.abort)(comm);
            }
        }
        crate::trace(|| format!("{who}: communicator {}", if healthy { "destroyed" } else { "aborted" }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NCCL (CI) the loader answers `CudaUnavailable` naming libnccl.so.2; with it, a
    /// version. Never a panic, GPU or not.
    #[test]
    fn library_lookup_never_panics() {
        match nccl_library() {
            Ok((path, v)) => eprintln!("NCCL {v} from {path}"),
            Err(CoreError::CudaUnavailable(m)) => assert!(m.contains("libnccl.so.2") && m.contains("K3_NCCL_LIB"), "{m}"),
            Err(e) => panic!("{e}"),
        }
        // Without a GPU this fails inside NCCL (or at the loader); it must not panic.
        let _ = nccl_unique_id();
        let g = CudaGroup::single();
        assert!(g.barrier().is_ok() && g.wait("test").is_ok() && (g.rank(), g.world()) == (0, 1));
    }
}
