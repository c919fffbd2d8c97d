//! Run-time compilation of the embedded CUDA C sources with NVRTC, straight to a cubin for
//! the device's exact architecture (`--gpu-architecture=sm_90` on an H200).
//!
//! Why a cubin and not PTX: PTX must be JIT-compiled by the driver, which rejects PTX of a
//! newer ISA than it knows (a newer libnvrtc than the driver fails at module load); a cubin
//! for `sm_XY` made by NVRTC of the same major CUDA version loads on any driver of that major
//! version, and skips the JIT. Each (module, architecture) is compiled once per process and
//! the cubin kept in a process-wide cache (a second GPU of the same kind reuses it); each
//! device keeps its loaded module (see `CudaDevice::function`).

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{result as nres, sys as nsys};

use super::{library_report, lock, require};
use crate::kernels::cuda::Source;
use crate::{CoreError, Result};

type Cache = Mutex<HashMap<(&'static str, (i32, i32)), Arc<Vec<u8>>>>;

/// The NVRTC options every k3rs kernel is built with (besides the architecture).
/// Precise division and square root are kept (NVRTC's default) so results track the CPU
/// oracle; `-std=c++17` for `if constexpr`.
const OPTIONS: [&str; 1] = ["-std=c++17"];

/// The cubin of `src` for compute capability `cc`, compiled on first request.
pub(crate) fn cubin(src: Source, cc: (i32, i32)) -> Result<Arc<Vec<u8>>> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(c) = lock(cache).get(&(src.name, cc)) {
        return Ok(c.clone());
    }
    require(library_report().nvrtc, "libnvrtc.so (NVRTC)")?;
    let bin = Arc::new(compile(src, cc)?);
    lock(cache).insert((src.name, cc), bin.clone());
    Ok(bin)
}

fn nerr(what: &str, src: Source) -> impl FnOnce(nres::NvrtcError) -> CoreError + '_ {
    move |e| CoreError::Device(format!("NVRTC {what} for {}.cu: {e}", src.name))
}

/// One NVRTC program; destroyed on drop.
struct Program(nsys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed only here.
        let _ = unsafe { nres::destroy_program(self.0) };
    }
}

fn compile(src: Source, cc: (i32, i32)) -> Result<Vec<u8>> {
    let text = CString::new(src.full_text()).map_err(|_| CoreError::Device(format!("{}.cu contains a NUL byte", src.name)))?;
    let name = CString::new(format!("{}.cu", src.name)).map_err(|_| CoreError::Device("bad module name".into()))?;
    let prog = Program(nres::create_program(&text, Some(&name)).map_err(nerr("create", src))?);
    let mut opts: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    opts.push(format!("--gpu-architecture=sm_{}{}", cc.0, cc.1));
    // SAFETY: prog is a live program; options are plain strings.
    if let Err(e) = unsafe { nres::compile_program(prog.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { nres::get_program_log(prog.0) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
        return Err(CoreError::Device(format!("NVRTC failed to compile {}.cu for sm_{}{} ({e}) with {opts:?}:\n{log}", src.name, cc.0, cc.1)));
    }
    let mut size = 0usize;
    // SAFETY: prog compiled successfully; out-parameter and a buffer of the reported size.
    unsafe { nsys::nvrtcGetCUBINSize(prog.0, &mut size) }.result().map_err(nerr("cubin size", src))?;
    let mut out = vec![0u8; size];
    // SAFETY: as above.
    unsafe { nsys::nvrtcGetCUBIN(prog.0, out.as_mut_ptr() as *mut c_char) }.result().map_err(nerr("get cubin", src))?;
    if out.is_empty() {
        return Err(CoreError::Device(format!("NVRTC returned an empty cubin for {}.cu", src.name)));
    }
    Ok(out)
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
