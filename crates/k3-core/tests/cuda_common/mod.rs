//! Shared by the CUDA parity suites (`cuda_*.rs`): the device-or-skip rule, the printed
//! (replayable) seed, messages that bypass the harness's output capture, and the upload /
//! poison / relative-L2 helpers every suite uses.
#![allow(dead_code)]

pub mod nccl_id;

use std::io::Write;

use half::bf16;
use k3_core::cuda::mla::PAGE;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::{CoreError, DType};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

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

// ---- helpers shared by the parity suites ----

pub fn rvec(r: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32(r.random_range(lo..hi) * if r.random::<bool>() { 1.0 } else { -1.0 }).to_f32()).collect()
}

pub fn up(dev: &CudaDevice, dtype: DType, shape: Vec<usize>, v: &[f32]) -> CudaTensor {
    let t = match dtype {
        DType::F32 => CudaTensor::from_f32(dev, shape, v),
        _ => CudaTensor::from_bf16(dev, shape, &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()),
    };
    t.expect("upload")
}

pub fn up_i32(dev: &CudaDevice, shape: Vec<usize>, v: &[i32]) -> CudaTensor {
    CudaTensor::from_pod(dev, DType::I32, shape, v).expect("upload i32")
}

pub fn poisoned(dev: &CudaDevice, dtype: DType, shape: Vec<usize>) -> CudaTensor {
    let t = CudaTensor::uninit(dev, dtype, shape).expect("alloc");
    t.fill_bytes(0xFF).expect("poison");
    t
}

pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("non-finite value at element {i} of {} (unwritten or invalid output)", got.len());
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

pub fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(got, want);
    say(&format!("  {what:<60} rel L2 {e:.2e} (tol {tol:.0e})"));
    assert!(e <= tol, "{what}: relative L2 error {e:.3e} > {tol:.0e}");
}

/// Sequences of the given context lengths in a shuffled page pool: (block table [B, max_pages], pages).
pub fn paging(r: &mut impl Rng, lens: &[usize]) -> (Vec<i32>, usize, usize) {
    let max_pages = lens.iter().map(|l| l.div_ceil(PAGE)).max().unwrap_or(1).max(1);
    let total: usize = lens.iter().map(|l| l.div_ceil(PAGE)).sum::<usize>() + 3;
    let mut ids: Vec<i32> = (0..total as i32).collect();
    ids.shuffle(r);
    let mut bt = vec![0i32; lens.len() * max_pages];
    let mut next = 0;
    for (b, &l) in lens.iter().enumerate() {
        for p in 0..l.div_ceil(PAGE) {
            bt[b * max_pages + p] = ids[next];
            next += 1;
        }
    }
    (bt, max_pages, total)
}

pub fn slot(bt: &[i32], max_pages: usize, seq: usize, pos: usize) -> usize {
    bt[seq * max_pages + pos / PAGE] as usize * PAGE + pos % PAGE
}

/// Rows of a packed prefill of sequences of `lens` tokens: every position of every sequence, as
/// (row_seq, row_pos).
pub fn prefill_rows(lens: &[usize]) -> (Vec<i32>, Vec<i32>) {
    lens.iter().enumerate().flat_map(|(b, &l)| (0..l).map(move |p| (b as i32, p as i32))).unzip()
}
