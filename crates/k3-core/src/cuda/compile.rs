//! Run-time compilation of the embedded CUDA C sources with NVRTC, straight to a cubin for
//! the device's exact architecture (`--gpu-architecture=sm_90` on an H200).
//!
//! Why a cubin and not PTX: PTX must be JIT-compiled by the driver, which rejects PTX of a
//! newer ISA than it knows (a newer libnvrtc than the driver fails at module load); a cubin
//! for `sm_XY` made by NVRTC of the same major CUDA version loads on any driver of that major
//! version, and skips the JIT. Each (module, architecture) is compiled once per process and
//! the cubin kept in a process-wide cache (a second GPU of the same kind reuses it); each
//! device keeps its loaded module (see `CudaDevice::function`).
//!
//! Cubins are also kept on disk, so a new process does not pay NVRTC again (all modules take
//! seconds to compile): `$K3_KERNEL_CACHE`, else `$XDG_CACHE_HOME/k3rs/kernels`, else
//! `$HOME/.cache/k3rs/kernels`; `K3_KERNEL_CACHE=off` disables it. A file is named by the
//! module, the architecture and a hash of the full source text, the options and the NVRTC
//! version, so an edited kernel or another NVRTC never reads a stale cubin; it is written to a
//! temporary name and renamed, so a reader never sees half a file. Any cache error (unwritable
//! directory, unreadable file) only means compiling again.

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
    let file = disk_cache_dir().map(|d| d.join(format!("{}-sm{}{}-{:016x}.cubin", src.name, cc.0, cc.1, source_key(src, cc))));
    let bin = match file.as_ref().and_then(|f| std::fs::read(f).ok()).filter(|b| !b.is_empty()) {
        Some(b) => b,
        None => {
            let b = compile(src, cc)?;
            if let Some(f) = &file {
                store(f, &b);
            }
            b
        }
    };
    let bin = Arc::new(bin);
    lock(cache).insert((src.name, cc), bin.clone());
    Ok(bin)
}

/// Where cubins are kept across processes (see the module docs); `None` when disabled or no
/// home directory is known.
fn disk_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    match env("K3_KERNEL_CACHE") {
        Some(v) if v == "off" || v == "0" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => {
            env("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".cache"))).map(|c| c.join("k3rs").join("kernels"))
        }
    }
}

/// FNV-1a over everything that determines the cubin: source text, options, architecture and
/// the NVRTC version (stable across Rust versions, unlike `DefaultHasher`).
fn source_key(src: Source, cc: (i32, i32)) -> u64 {
    let nvrtc = super::nvrtc_version().unwrap_or((0, 0));
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let parts = [src.full_text(), OPTIONS.join(" "), format!("sm_{}{} nvrtc {}.{}", cc.0, cc.1, nvrtc.0, nvrtc.1)];
    for b in parts.iter().flat_map(|p| p.bytes().chain(std::iter::once(0u8))) {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename.
/// Failures are ignored: the cache is an optimisation.
fn store(path: &std::path::Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("cubin"), std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cuda::{MLA, NORM};

    #[test]
    fn cache_key_separates_source_and_architecture() {
        let k = source_key(NORM, (9, 0));
        assert_eq!(k, source_key(NORM, (9, 0)), "stable within a process");
        assert_ne!(k, source_key(NORM, (8, 0)));
        assert_ne!(k, source_key(MLA, (9, 0)));
    }

    #[test]
    fn store_writes_whole_files_and_leaves_no_temporary() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = d.path().join("sub").join("norm-sm90-0.cubin");
        store(&f, b"cubin bytes");
        assert_eq!(std::fs::read(&f).expect("read back"), b"cubin bytes");
        let names: Vec<_> = std::fs::read_dir(f.parent().expect("dir")).expect("list").map(|e| e.expect("entry").file_name()).collect();
        assert_eq!(names.len(), 1, "a temporary file was left behind: {names:?}");
    }
}
