//! The CUDA test rules — one file shared by the CUDA suites of every crate (k3-core's
//! `tests/cuda_common/`, k3-model's `tests/cuda_model.rs`): the device-or-skip rule, the
//! printed (replayable) seed, and messages that bypass the harness's output capture.
#![allow(dead_code)]

use std::io::Write;

use k3_core::cuda::CudaDevice;
use k3_core::CoreError;
use rand::SeedableRng;

/// Straight to stderr, past the test harness's capture, so a skip is always visible.
pub fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// `None` after printing `{test}: skipped: {skipped} ({why})`, or a panic naming `missing` when
/// `K3_REQUIRE_CUDA=1` (a run on the GPU machine must not skip).
pub fn skip<T>(test: &str, missing: &str, skipped: &str, why: &str) -> Option<T> {
    if std::env::var("K3_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
        panic!("{test}: K3_REQUIRE_CUDA=1 but {missing}: {why}");
    }
    say(&format!("{test}: skipped: {skipped} ({why})"));
    None
}

/// The GPU, or `None` after printing `skipped: no CUDA driver (...)` — unless
/// `K3_REQUIRE_CUDA=1`, which turns the skip into a failure.
pub fn device(test: &str) -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(CoreError::CudaUnavailable(why)) => skip(test, "CUDA is unavailable", "no CUDA driver", &why),
        Err(e) => panic!("{test}: a CUDA driver is present but the device failed: {e}"),
    }
}

/// A fresh seed per run, printed; `K3_TEST_SEED=N` replays one.
pub fn rng(test: &str) -> rand::rngs::StdRng {
    let seed = std::env::var("K3_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1));
    say(&format!("{test}: seed {seed}"));
    rand::rngs::StdRng::seed_from_u64(seed)
}
