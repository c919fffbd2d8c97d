//! The NCCL library of [`CudaGroup`](super::CudaGroup) (feature `cuda`): found, loaded and bound
//! at run time, plus the raw helpers the communicator polls NCCL with ([`async_state`], [`poll`],
//! [`err_string`]).
//!
//! Library: cudarc's NCCL loader (`nccl` + `dynamic-loading`) never tries `libnccl.so.2`, the name
//! NVIDIA's packages and pip's `nvidia-nccl-cu*` wheels ship, and panics on a missing library or
//! symbol. So this file dlopens the library itself and binds what it uses with `dlsym`, typed with
//! cudarc's `nccl::sys` structs; no cudarc `nccl` function is called, so nothing can panic. Search
//! order: `$K3_NCCL_LIB` (the file or its folder), the loader's path (`libnccl.so.2`, `libnccl.so`),
//! then CUDA, conda and Python folders (`…/site-packages/nvidia/nccl/lib`). `ncclGetVersion` is
//! checked first: NCCL ≥ 2.18 is required.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::{path::PathBuf, time::Duration, time::Instant};

use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};

use crate::{CoreError, Result};

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
    fn dladdr(addr: *const c_void, info: *mut [*const c_void; 4]) -> c_int;
}
const RTLD_NOW: c_int = 2;
/// NCCL 2.18.0: non-blocking init, finalize and bf16 are all older.
const MIN_VERSION: i32 = 21800;
pub(super) const IN_PROGRESS: c_int = 7;
pub(super) const SUM: c_int = 0;
const HOW_TO_GET: &str = "install NCCL 2.18 or newer (pip install nvidia-nccl-cu13 — or -cu12 —, the distribution's \
     libnccl2 package, or NVIDIA's tarball), or set K3_NCCL_LIB to the file or its folder";

pub(super) type Res = c_int; // ncclResult_t (an int in C; kept raw so an unknown code is no UB)
pub(super) type Stream = *mut c_void; // cudaStream_t = CUstream
pub(super) type Comm = ncclComm_t;
pub(super) type Buf = *const c_void;
pub(super) type BufMut = *mut c_void;

/// Declares [`Api`] (the entry points used, as `dlsym` finds them) and its binder.
macro_rules! api {
    ($($field:ident = $name:literal: fn($($arg:ty),*) -> $ret:ty;)*) => {
        pub(super) struct Api { pub(super) path: String, pub(super) version: i32, $(pub(super) $field: unsafe extern "C" fn($($arg),*) -> $ret,)* }
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

pub(super) fn api(op: &'static str) -> Result<&'static Api> {
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
/// [`CudaGroup::nccl`](super::CudaGroup::nccl). The calling process hosts the bootstrap root until the ranks joined.
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

pub(super) fn err_string(a: &Api, r: Res, comm: Comm) -> String {
    // SAFETY: both return static or per-communicator strings; `comm` is null or live.
    let (s, last) = unsafe { (cstr((a.error_string)(r)), cstr((a.last_error)(comm))) };
    if last.is_empty() {
        s
    } else {
        format!("{s} ({last})")
    }
}

/// `ncclCommGetAsyncError` folded into one code: 0, IN_PROGRESS or an error.
pub(super) fn async_state(api: &Api, comm: Comm) -> Res {
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
pub(super) fn poll(api: &Api, comm: Comm, limit: Duration, cancel: &AtomicBool) -> std::result::Result<(), Option<Res>> {
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
pub(super) fn pause(t0: Instant) {
    if t0.elapsed() < Duration::from_millis(2) {
        std::thread::yield_now()
    } else {
        std::thread::sleep(Duration::from_micros(500))
    }
}
