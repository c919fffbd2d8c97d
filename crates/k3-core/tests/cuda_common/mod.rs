//! Shared by the CUDA parity suites (`cuda_*.rs`): the device-or-skip rule, the printed
//! (replayable) seed and messages past the harness's capture (`tests/support/cuda.rs`, shared
//! with k3-model's GPU tests), relative L2 (`tests/support/numeric.rs`, shared by every crate),
//! and the upload / poison / check helpers every suite uses.
#![allow(dead_code)]

pub mod nccl_id;

#[path = "../../../../tests/support/cuda.rs"]
mod cuda;
#[path = "../../../../tests/support/numeric.rs"]
mod numeric;
pub use cuda::*;
pub use numeric::*;

use half::bf16;
use k3_core::cuda::mla::{mla_attend, PagedBatch, PAGE};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;
use rand::seq::SliceRandom;
use rand::Rng;

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

pub fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(got, want);
    say(&format!("  {what:<60} rel L2 {e:.2e} (tol {tol:.1e})"));
    assert!(e <= tol, "{what}: relative L2 error {e:.3e} > {tol:.1e}");
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

/// Times `iters` calls of `mla_attend` with CUDA events; returns microseconds per call.
pub fn time_attend(dev: &CudaDevice, q: &CudaTensor, cache: &CudaTensor, batch: &PagedBatch, rr: usize, out: &CudaTensor, iters: usize) -> f64 {
    mla_attend(q, cache, batch, None, rr, 0.07, out).expect("warm-up");
    let (e0, e1) = (dev.new_event(true).expect("event"), dev.new_event(true).expect("event"));
    e0.record(&dev.stream()).expect("record");
    for _ in 0..iters {
        mla_attend(q, cache, batch, None, rr, 0.07, out).expect("attend");
    }
    e1.record(&dev.stream()).expect("record");
    let ms = e0.elapsed_ms(&e1).expect("elapsed") / iters as f32;
    assert!(out.to_f32_vec().expect("read").iter().all(|v| v.is_finite()));
    ms as f64 * 1e3
}
