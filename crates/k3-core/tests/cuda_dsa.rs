//! Parity suite for the CUDA DSA kernels (`cuda::dsa`, text-backbone §5.3–5.6) against f32
//! CPU references written here (`index_scores`, `select_topk` of k3-model `layers/dsa.rs`).
//!
//! Shapes: N packed rows, ih index heads, id index dim; F32 key cache `[pages, 64, id]` with
//! non-contiguous page ids; scores `[N, L]`. Random inputs (seed printed; `K3_TEST_SEED=N`
//! replays); outputs poisoned with NaN / -1 first. Tolerances: key append relative L2 1e-5
//! (f32, summation order only); index scores relative L2 1e-5 per row, entries past `row_pos`
//! must stay untouched (NaN); top-k must equal a naive full sort by (score desc, position
//! desc) exactly, with many ties (scores quantised to a few values, ±0.0 mixed).
//! Timings (printed, never asserted): top-k of one row of 131072 and 1048576 candidates.
//! Without a GPU every test prints `skipped` and passes (fails with `K3_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{device, paging, poisoned, prefill_rows, rel_l2, rng, rvec, say, slot, up_i32};

use half::bf16;
use k3_core::cuda::dsa::{index_key_append, index_scores, topk};
use k3_core::cuda::mla::{PagedBatch, PAGE};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;
use rand::Rng;

fn up_f32(dev: &CudaDevice, shape: Vec<usize>, v: &[f32]) -> CudaTensor {
    CudaTensor::from_f32(dev, shape, v).expect("upload")
}

#[test]
fn key_append_and_index_scores() {
    let Some(dev) = device("key_append_and_index_scores") else { return };
    let mut r = rng("key_append_and_index_scores");
    for &(ih, id) in &[(8usize, 16usize), (32, 128), (40, 24)] {
        let lens = [1usize, 64, 65, 300];
        let (bt, mp, pages) = paging(&mut r, &lens);
        // Append every position of every sequence (a packed prefill), then score the last 3 rows of each.
        let (rs, rp) = prefill_rows(&lens);
        let n = rs.len();
        let k = rvec(&mut r, n * id, 0.01, 2.0);
        let lw = rvec(&mut r, id, 0.5, 1.5);
        let lb = rvec(&mut r, id, 0.0, 0.3);
        let eps = 1e-6f32;
        let (btt, rst, rpt) = (up_i32(&dev, vec![lens.len(), mp], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let mut keys = vec![0f32; pages * PAGE * id]; // reference cache
        for i in 0..n {
            let x = &k[i * id..(i + 1) * id];
            let mu = x.iter().sum::<f32>() / id as f32;
            let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / id as f32;
            let inv = 1.0 / (var + eps).sqrt();
            let s = slot(&bt, mp, rs[i] as usize, rp[i] as usize);
            for d in 0..id {
                keys[s * id + d] = (x[d] - mu) * inv * lw[d] + lb[d];
            }
        }
        let (lwt, lbt) = (up_f32(&dev, vec![id], &lw), up_f32(&dev, vec![id], &lb));
        for dt in [DType::F32, DType::BF16] {
            let kc = CudaTensor::zeros(&dev, DType::F32, vec![pages, PAGE, id]).expect("alloc");
            let kt = if dt == DType::F32 {
                up_f32(&dev, vec![n, id], &k)
            } else {
                CudaTensor::from_bf16(&dev, vec![n, id], &k.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).expect("up")
            };
            index_key_append(&kt, &lwt, &lbt, eps, &batch, &kc).expect("append");
            let e = rel_l2(&kc.to_f32_vec().expect("read"), &keys);
            say(&format!("  key append ih={ih} id={id} {dt}: rel L2 {e:.2e} (tol 1e-5)"));
            assert!(e <= 1e-5);
        }
        // Scores for the last 3 rows of each sequence.
        let kc = up_f32(&dev, vec![pages, PAGE, id], &keys);
        let sel: Vec<usize> = (0..n).filter(|&i| rp[i] as usize + 3 >= lens[rs[i] as usize]).collect();
        let m = sel.len();
        let srs: Vec<i32> = sel.iter().map(|&i| rs[i]).collect();
        let srp: Vec<i32> = sel.iter().map(|&i| rp[i]).collect();
        let l = *lens.iter().max().unwrap_or(&1) + 5;
        let q = rvec(&mut r, m * ih * id, 0.05, 1.0);
        let a = rvec(&mut r, m * ih, 0.01, 0.2);
        let (srst, srpt) = (up_i32(&dev, vec![m], &srs), up_i32(&dev, vec![m], &srp));
        let batch = PagedBatch { block_table: &btt, row_seq: &srst, row_pos: &srpt };
        let scores = poisoned(&dev, DType::F32, vec![m, l]);
        index_scores(&up_f32(&dev, vec![m, ih, id], &q), &up_f32(&dev, vec![m, ih], &a), &kc, &batch, &scores).expect("scores");
        let got = scores.to_f32_vec().expect("read");
        let mut worst = 0f64;
        for j in 0..m {
            let pos = srp[j] as usize;
            let want: Vec<f32> = (0..=pos)
                .map(|s| {
                    let key = &keys[slot(&bt, mp, srs[j] as usize, s) * id..][..id];
                    (0..ih).map(|h| a[j * ih + h] * q[(j * ih + h) * id..][..id].iter().zip(key).map(|(x, y)| x * y).sum::<f32>().max(0.0)).sum()
                })
                .collect();
            worst = worst.max(rel_l2(&got[j * l..j * l + pos + 1], &want));
            assert!(got[j * l + pos + 1..(j + 1) * l].iter().all(|v| v.is_nan()), "row {j}: entries past row_pos were written");
        }
        say(&format!("  index_scores ih={ih} id={id}: worst row rel L2 {worst:.2e} (tol 1e-5)"));
        assert!(worst <= 1e-5);
    }
}

/// `select_topk` by a full sort: (score desc, position desc), first k, increasing positions.
fn naive_topk(scores: &[f32], k: usize) -> Vec<i32> {
    let n = scores.len();
    if n <= k {
        return (0..n as i32).collect();
    }
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| scores[b].partial_cmp(&scores[a]).unwrap_or(std::cmp::Ordering::Equal).then(b.cmp(&a)));
    let mut v: Vec<i32> = idx[..k].iter().map(|&i| i as i32).collect();
    v.sort_unstable();
    v
}

fn run_topk(dev: &CudaDevice, rows: &[Vec<f32>], l: usize, k: usize) -> (Vec<i32>, Vec<i32>) {
    let n = rows.len();
    let mut flat = vec![f32::NAN; n * l];
    for (i, row) in rows.iter().enumerate() {
        flat[i * l..i * l + row.len()].copy_from_slice(row);
    }
    let rp: Vec<i32> = rows.iter().map(|x| x.len() as i32 - 1).collect();
    let rs: Vec<i32> = (0..n as i32).collect();
    let (btt, rst, rpt) = (up_i32(dev, vec![n, 1], &vec![0; n]), up_i32(dev, vec![n], &rs), up_i32(dev, vec![n], &rp));
    let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
    let idx = CudaTensor::uninit(dev, DType::I32, vec![n, k]).expect("alloc");
    idx.fill_bytes(0xFF).expect("poison");
    let cnt = CudaTensor::uninit(dev, DType::I32, vec![n]).expect("alloc");
    cnt.fill_bytes(0xFF).expect("poison");
    topk(&up_f32(dev, vec![n, l], &flat), &batch, k, &idx, &cnt).expect("topk");
    let i: Vec<i32> = bytemuck::pod_collect_to_vec(&idx.to_bytes().expect("read"));
    let c: Vec<i32> = bytemuck::pod_collect_to_vec(&cnt.to_bytes().expect("read"));
    (i, c)
}

#[test]
fn topk_matches_naive_sort_with_ties() {
    let Some(dev) = device("topk_matches_naive_sort_with_ties") else { return };
    let mut r = rng("topk_matches_naive_sort_with_ties");
    let k = 12;
    for quant in [true, false] {
        let lens = [1usize, 5, 11, 12, 13, 14, 40, 300, 5000, 100000];
        let rows: Vec<Vec<f32>> = lens
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|_| {
                        if quant {
                            // Few distinct values: 0 (as +0.0 or -0.0), ±1, ±2.5, 7.
                            [0.0f32, -0.0, 1.0, -1.0, 2.5, -2.5, 7.0][r.random_range(0..7)]
                        } else {
                            r.random_range(-3.0f32..3.0)
                        }
                    })
                    .collect()
            })
            .collect();
        let l = 100000 + 7;
        for kk in [k, 2048] {
            let (idx, cnt) = run_topk(&dev, &rows, l, kk);
            for (i, row) in rows.iter().enumerate() {
                let want = naive_topk(row, kk);
                assert_eq!(cnt[i] as usize, want.len(), "row {i} (n={}) k={kk}: count", row.len());
                assert_eq!(&idx[i * kk..i * kk + want.len()], &want[..], "row {i} (n={}) k={kk} quant={quant}", row.len());
            }
            say(&format!("  topk k={kk} quantised={quant}: {} rows (n = {lens:?}) match the naive sort", rows.len()));
        }
    }
    // A row with k = 2048 ties at the boundary: n = 1048576 quantised.
    let row: Vec<f32> = (0..1 << 20).map(|_| [0.0f32, 1.0, 2.0, 3.0][r.random_range(0..4)]).collect();
    let (idx, cnt) = run_topk(&dev, std::slice::from_ref(&row), row.len(), 2048);
    assert_eq!(cnt[0], 2048);
    assert_eq!(idx, naive_topk(&row, 2048), "n = 2^20 quantised");
    say("  topk n=1048576 k=2048 quantised matches");
}

#[test]
fn topk_timing() {
    let Some(dev) = device("topk_timing") else { return };
    let mut r = rng("topk_timing");
    for n in [131072usize, 1048576] {
        let row: Vec<f32> = (0..n).map(|_| r.random_range(-3.0f32..3.0)).collect();
        let (btt, rst, rpt) = (up_i32(&dev, vec![1, 1], &[0]), up_i32(&dev, vec![1], &[0]), up_i32(&dev, vec![1], &[n as i32 - 1]));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let scores = up_f32(&dev, vec![1, n], &row);
        let idx = CudaTensor::uninit(&dev, DType::I32, vec![1, 2048]).expect("alloc");
        let cnt = CudaTensor::uninit(&dev, DType::I32, vec![1]).expect("alloc");
        topk(&scores, &batch, 2048, &idx, &cnt).expect("warm-up");
        let (e0, e1) = (dev.new_event(true).expect("event"), dev.new_event(true).expect("event"));
        let iters = 20;
        e0.record(&dev.stream()).expect("record");
        for _ in 0..iters {
            topk(&scores, &batch, 2048, &idx, &cnt).expect("topk");
        }
        e1.record(&dev.stream()).expect("record");
        let ms = e0.elapsed_ms(&e1).expect("elapsed") / iters as f32;
        say(&format!("  TIMING topk k=2048 one row of {n}: {:.1} us", ms * 1e3));
        let got: Vec<i32> = bytemuck::pod_collect_to_vec(&idx.to_bytes().expect("read"));
        assert_eq!(got, naive_topk(&row, 2048));
    }
    // Indexer scores for one decode row at 131072 keys (real ih=32, id=128).
    let (ih, id, n) = (32usize, 128usize, 131072usize);
    let pages = n / PAGE;
    let kc = up_f32(&dev, vec![pages, PAGE, id], &(0..pages * PAGE * id).map(|i| ((i % 97) as f32 - 48.0) * 0.01).collect::<Vec<_>>());
    let bt: Vec<i32> = (0..pages as i32).collect();
    let (btt, rst, rpt) = (up_i32(&dev, vec![1, pages], &bt), up_i32(&dev, vec![1], &[0]), up_i32(&dev, vec![1], &[n as i32 - 1]));
    let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
    let (q, a) = (up_f32(&dev, vec![1, ih, id], &rvec(&mut r, ih * id, 0.05, 1.0)), up_f32(&dev, vec![1, ih], &rvec(&mut r, ih, 0.01, 0.2)));
    let scores = CudaTensor::uninit(&dev, DType::F32, vec![1, n]).expect("alloc");
    index_scores(&q, &a, &kc, &batch, &scores).expect("warm-up");
    let (e0, e1) = (dev.new_event(true).expect("event"), dev.new_event(true).expect("event"));
    e0.record(&dev.stream()).expect("record");
    for _ in 0..20 {
        index_scores(&q, &a, &kc, &batch, &scores).expect("scores");
    }
    e1.record(&dev.stream()).expect("record");
    let ms = e0.elapsed_ms(&e1).expect("elapsed") / 20.0;
    say(&format!("  TIMING index_scores ih=32 id=128 one row of {n} keys: {:.1} us", ms * 1e3));
}
