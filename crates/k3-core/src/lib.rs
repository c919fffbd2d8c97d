//! k3-core: the small tensor layer k3rs stands on.
//!
//! - [`DType`], [`Shape`] helpers, [`Device`] (`Cpu` or `Cuda(ordinal)`), [`Tensor`] (a typed,
//!   shaped view of bytes that live in a memory map, an owned buffer, or — with the `cuda`
//!   feature — device memory).
//! - [`kernels::cpu`]: the CPU kernels on plain `&[f32]` slices (`gemm` + `rayon`), one file
//!   per op family; the model crate calls them by the same names as its layers.
//! - [`comm`]: the communicators the parallel model runs on (world-1, in-process threads,
//!   and NCCL with the `cuda` feature) and the TCP control plane that starts a world.
//! - [`staging`]: the host side of large staged host↔device copies (windows of a bounce
//!   buffer, copied in and out by rayon tasks).
//! - [`fp8`]: the FP8 (E4M3, tile-scaled) cache formats, defined on the CPU for the GPU kernels.
//! - [`kernels::cuda`] (feature `cuda`): the CUDA path, loaded at run time (cudarc).
//!
//! Imports point one way: this crate knows nothing of Kimi K3's config or checkpoint names.

pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod error;
pub mod fp8;
pub mod kernels;
pub mod npy;
pub mod staging;
pub mod tensor;

pub use device::Device;
pub use dtype::DType;
pub use error::{CoreError, Result};
pub use tensor::{Storage, Tensor};

/// `K3_TRACE=1`: one stderr line for each stage of a world's start and shutdown (rendezvous,
/// communicators, graphs, teardown, a peer lost mid-step), so a hang on a
/// machine without a debugger shows the stage it stopped in (seconds since the first trace
/// line). Off (one atomic load) otherwise.
pub fn trace(what: impl FnOnce() -> String) {
    use std::sync::OnceLock;
    static ON: OnceLock<Option<std::time::Instant>> = OnceLock::new();
    if let Some(t0) = ON.get_or_init(|| std::env::var_os("K3_TRACE").is_some_and(|v| v != "0").then(std::time::Instant::now)) {
        eprintln!("[k3 trace {:>8.3} s pid {}] {}", t0.elapsed().as_secs_f64(), std::process::id(), what());
    }
}
