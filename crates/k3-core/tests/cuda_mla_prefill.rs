//! Parity suite for the explicit-form prefill attention (`cuda::mla::mla_prefill_attend`,
//! `mla_prefill.cu`) against an f32 CPU reference written here (the explicit branch of k3-model
//! `layers/mla.rs`: per head, keys `[k_nope | k_pe]`, values `v`, causal within each sequence).
//!
//! Shapes: N packed rows of several fresh sequences, nh heads, K3's head dims (qk 128 + 64, v
//! 128); k_pe in a paged latent cache (BF16 rows, and FP8 `fp8_ds_mla` rows whose k_pe is BF16)
//! with non-contiguous page ids. Random bf16-representable inputs (seed printed; `K3_TEST_SEED=N`
//! replays); the output is poisoned first. Tolerance: relative L2 5e-3 (P and the output rounded
//! to BF16, f32 elsewhere); both cache formats give bit-identical outputs.
//! Timing (printed, never asserted): one sequence of 4096 rows, 96 heads, beside its tensor-core
//! arithmetic (the causal pairs × 96 heads × 320 MACs).
//! Without a GPU every test prints `skipped` and passes (fails with `K3_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, paging, poisoned, prefill_rows, rng, rvec, say, slot, up, up_i32};

use k3_core::cuda::mla::{mla_prefill_attend, PagedBatch, PAGE, PREFILL_DIMS};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::fp8::LatentFp8;
use k3_core::kernels::cpu::act::softmax_inplace;
use k3_core::kernels::cpu::matmul::dot;
use k3_core::DType;

const TOL: f64 = 5e-3;
const R: usize = 512;

struct Problem {
    nh: usize,
    lens: Vec<usize>,
    q: Vec<f32>,   // [N, nh, 192]
    kv: Vec<f32>,  // [N, nh, 256]
    kpe: Vec<f32>, // [N, 64]
}

fn reference(p: &Problem, scale: f32) -> Vec<f32> {
    let (dn, dr, dv) = PREFILL_DIMS;
    let (nh, dk) = (p.nh, dn + dr);
    let n: usize = p.lens.iter().sum();
    let mut out = vec![0f32; n * nh * dv];
    let mut start = 0;
    for &len in &p.lens {
        for i in start..start + len {
            for h in 0..nh {
                let qh = &p.q[(i * nh + h) * dk..][..dk];
                let mut pr: Vec<f32> = (start..=i)
                    .map(|j| {
                        let kn = &p.kv[(j * nh + h) * (dn + dv)..][..dn];
                        (dot(&qh[..dn], kn) + dot(&qh[dn..], &p.kpe[j * dr..][..dr])) * scale
                    })
                    .collect();
                softmax_inplace(&mut pr);
                let o = &mut out[(i * nh + h) * dv..][..dv];
                for (j, pj) in (start..=i).zip(&pr) {
                    let v = &p.kv[(j * nh + h) * (dn + dv) + dn..][..dv];
                    o.iter_mut().zip(v).for_each(|(a, &b)| *a += pj * b);
                }
            }
        }
        start += len;
    }
    out
}

/// Uploads the problem; returns the output of the kernel over a BF16 and over an FP8 cache.
fn run(dev: &CudaDevice, r: &mut impl rand::Rng, p: &Problem, scale: f32) -> (Vec<f32>, Vec<f32>, f64) {
    let (dn, dr, dv) = PREFILL_DIMS;
    let (bt, mp, pages) = paging(r, &p.lens);
    let (rs, rp) = prefill_rows(&p.lens);
    let n = rs.len();
    let (btt, rst, rpt) = (up_i32(dev, vec![p.lens.len(), mp], &bt), up_i32(dev, vec![n], &rs), up_i32(dev, vec![n], &rp));
    let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
    // Latent rows: random latent (unused here), the row's k_pe; the FP8 rows carry the same k_pe.
    let w = R + dr;
    let lay = LatentFp8 { r: R, dr };
    let mut lat = rvec(r, pages * PAGE * w, 0.05, 1.0);
    let mut rows8 = vec![0u8; pages * PAGE * lay.row_bytes()];
    for i in 0..n {
        let s = slot(&bt, mp, rs[i] as usize, rp[i] as usize);
        lat[s * w + R..(s + 1) * w].copy_from_slice(&p.kpe[i * dr..(i + 1) * dr]);
    }
    for (row, out) in lat.chunks(w).zip(rows8.chunks_mut(lay.row_bytes())) {
        lay.encode(row, out);
    }
    let c16 = up(dev, DType::BF16, vec![pages, PAGE, w], &lat);
    let c8 = CudaTensor::from_pod(dev, DType::U8, vec![pages, PAGE, lay.row_bytes()], &rows8).expect("upload");
    let q = up(dev, DType::BF16, vec![n, p.nh * (dn + dr)], &p.q);
    let kv = up(dev, DType::BF16, vec![n, p.nh * (dn + dv)], &p.kv);
    let mut outs = Vec::new();
    let mut ms = 0.0;
    for cache in [&c16, &c8] {
        let out = poisoned(dev, DType::BF16, vec![n, p.nh * dv]);
        mla_prefill_attend(&q, &kv, cache, R, &batch, p.nh, scale, &out).expect("prefill attend");
        if n >= 4096 {
            let (a, b) = (dev.new_event(true).expect("event"), dev.new_event(true).expect("event"));
            a.record(&dev.stream()).expect("record");
            for _ in 0..10 {
                mla_prefill_attend(&q, &kv, cache, R, &batch, p.nh, scale, &out).expect("prefill attend");
            }
            b.record(&dev.stream()).expect("record");
            b.synchronize().expect("sync");
            ms = a.elapsed_ms(&b).expect("elapsed") as f64 / 10.0;
        }
        outs.push(out.to_f32_vec().expect("read"));
    }
    let b8 = outs.pop().expect("fp8");
    (outs.pop().expect("bf16"), b8, ms)
}

fn problem(r: &mut impl rand::Rng, nh: usize, lens: &[usize]) -> Problem {
    let (dn, dr, dv) = PREFILL_DIMS;
    let n: usize = lens.iter().sum();
    Problem { nh, lens: lens.to_vec(), q: rvec(r, n * nh * (dn + dr), 0.05, 1.0), kv: rvec(r, n * nh * (dn + dv), 0.05, 1.0), kpe: rvec(r, n * dr, 0.05, 1.0) }
}

#[test]
fn prefill_attend_matches_explicit_reference() {
    let Some(dev) = device("prefill_attend_matches_explicit_reference") else { return };
    let mut r = rng("prefill_attend_matches_explicit_reference");
    let scale = 1.0 / 192f32.sqrt();
    // Sequences that start and end inside a 64-row block, one row, exact multiples, several per block.
    for (nh, lens) in [(3usize, vec![1usize, 63, 64, 65, 200]), (2, vec![130]), (5, vec![7, 9, 3, 70, 1, 2])] {
        let p = problem(&mut r, nh, &lens);
        let want = reference(&p, scale);
        let (g16, g8, _) = run(&dev, &mut r, &p, scale);
        check(&format!("prefill nh={nh} lens={lens:?} (bf16 cache)"), &g16, &want, TOL);
        assert!(g16.iter().zip(&g8).all(|(a, b)| a.to_bits() == b.to_bits()), "the FP8 cache's k_pe is the BF16 one: same output");
    }
}

#[test]
fn prefill_attend_timing() {
    let Some(dev) = device("prefill_attend_timing") else { return };
    let mut r = rng("prefill_attend_timing");
    let (nh, t) = (96usize, 4096usize);
    let p = problem(&mut r, nh, &[t]);
    let (_, _, ms) = run(&dev, &mut r, &p, 0.07);
    let macs = (t * (t + 1) / 2 * nh * 320) as f64;
    say(&format!("  TIMING mla_prefill_attend T={t} nh={nh}: {ms:.3} ms = {:.0} TFLOP/s of causal tensor-core work", 2.0 * macs / (ms * 1e-3) / 1e12));
}
