//! Every CUDA source of k3rs (`kernels::cuda::ALL`) compiles with NVRTC to an sm_90 cubin — no
//! GPU or driver needed, only libnvrtc (e.g. PyPI `nvidia-cuda-nvrtc` on the library path). CI
//! runs this with `K3_REQUIRE_NVRTC=1`, so a kernel that no longer compiles fails on a machine
//! that cannot run it. Without libnvrtc the test prints `skipped` and passes.
#![cfg(feature = "cuda")]

use k3_core::cuda::{compile_check, library_report};
use k3_core::kernels::cuda::ALL;

#[test]
fn every_kernel_source_compiles_for_sm_90() {
    if !library_report().nvrtc {
        assert!(
            std::env::var("K3_REQUIRE_NVRTC").map_or(true, |v| v != "1"),
            "K3_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (put its directory on LD_LIBRARY_PATH)"
        );
        eprintln!("every_kernel_source_compiles_for_sm_90: skipped: libnvrtc not found");
        return;
    }
    for src in ALL {
        match compile_check(src, (9, 0)) {
            Ok(bytes) => eprintln!("  {}.cu: {bytes} bytes of cubin", src.name),
            Err(e) => panic!("{}.cu does not compile: {e}", src.name),
        }
    }
}
