//! Parity suite for the small CUDA ops the GPU model is glued with (`cuda::ops`):
//! `attn_res_norm` (Block Attention Residuals + RMSNorm, text-backbone §6, with the partial-sum
//! update modes and the block snapshot), `rms_norm_cols` (f32 weight, prefix of wider rows, any
//! in/out storage), `gather_rows`, `copy_strided_bf16`, `sigmoid_mul`, `add_assign`, and the
//! capture-safe CUDA graph (temporaries allocated inside the capture stay the graph's).
//! References are f64 in the test. Tolerances: f32 outputs 1e-5 relative L2, bf16 outputs
//! 5e-3; gathers and copies exact. Random inputs, seed printed (`K3_TEST_SEED=N` replays).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, poisoned, rng, up};

use half::bf16;
use k3_core::cuda::ops::{self, ResUpdate};
use k3_core::cuda::{capture, CudaTensor};
use k3_core::DType;
use rand::Rng;

fn rv(r: &mut impl Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-2.0f32..2.0)).collect()
}
/// f64 AttnRes mix of `srcs` rows then RMSNorm with `w`.
fn attn_res_ref(srcs: &[Vec<f32>], c: &[f32], eps_res: f32, w: &[f32], eps: f32, rows: usize) -> Vec<f32> {
    let h = c.len();
    let mut out = Vec::with_capacity(rows * h);
    for r in 0..rows {
        let logits: Vec<f64> = srcs
            .iter()
            .map(|s| {
                let v = &s[r * h..(r + 1) * h];
                let dot: f64 = v.iter().zip(c).map(|(&x, &y)| x as f64 * y as f64).sum();
                let ms: f64 = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / h as f64;
                dot / (ms + eps_res as f64).sqrt()
            })
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let den: f64 = e.iter().sum();
        let mix: Vec<f64> = (0..h).map(|j| srcs.iter().zip(&e).map(|(s, p)| p / den * s[r * h + j] as f64).sum()).collect();
        let ms = mix.iter().map(|x| x * x).sum::<f64>() / h as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        out.extend(mix.iter().zip(w).map(|(x, &g)| (x * inv * g as f64) as f32));
    }
    out
}

#[test]
fn attn_res_norm_parity() {
    let Some(dev) = device("attn_res_norm_parity") else { return };
    let mut r = rng("attn_res_norm_parity");
    // Up to 16 rows the split form runs (h % 4 == 0), else one block per row; both are covered.
    for (rows, h, nblocks) in [(1usize, 96usize, 0usize), (5, 96, 2), (3, 7168, 24), (16, 1000, 5), (1, 98, 1), (17, 256, 63)] {
        let blocks: Vec<Vec<f32>> = (0..nblocks).map(|_| rv(&mut r, rows * h)).collect();
        let (p0, d) = (rv(&mut r, rows * h), rv(&mut r, rows * h));
        let c: Vec<f32> = rv(&mut r, h).iter().map(|x| x * 0.2).collect();
        let w = rv(&mut r, h);
        let bt: Vec<CudaTensor> = blocks.iter().map(|b| up(&dev, DType::F32, vec![rows, h], b)).collect();
        let brefs: Vec<&CudaTensor> = bt.iter().collect();
        let (ct, wt, dt) = (up(&dev, DType::F32, vec![h], &c), up(&dev, DType::F32, vec![h], &w), up(&dev, DType::F32, vec![rows, h], &d));
        for (upd, out_dtype) in [(ResUpdate::Keep, DType::F32), (ResUpdate::Add, DType::BF16), (ResUpdate::Assign, DType::F32)] {
            let p = up(&dev, DType::F32, vec![rows, h], &p0);
            let snap = poisoned(&dev, DType::F32, vec![rows, h]);
            let out = poisoned(&dev, out_dtype, vec![rows, h]);
            ops::attn_res_norm(&brefs, &p, upd, Some(&dt), Some(&snap), &ct, 1e-6, &wt, 1e-5, &out).expect("attn_res_norm");
            let p1: Vec<f32> = match upd {
                ResUpdate::Keep => p0.clone(),
                ResUpdate::Add => p0.iter().zip(&d).map(|(a, b)| a + b).collect(),
                ResUpdate::Assign => d.clone(),
            };
            assert_eq!(p.to_f32_vec().unwrap(), p1, "P after {upd:?}");
            assert_eq!(snap.to_f32_vec().unwrap(), p1, "snapshot after {upd:?}");
            let mut srcs = blocks.clone();
            srcs.push(p1);
            let want = attn_res_ref(&srcs, &c, 1e-6, &w, 1e-5, rows);
            let tol = if out_dtype == DType::F32 { 1e-5 } else { 5e-3 };
            check(&format!("attn_res_norm rows {rows} h {h} blocks {nblocks} {upd:?} -> {out_dtype}"), &out.to_f32_vec().unwrap(), &want, tol);
            // Deterministic (the warps' partial sums are added in a fixed order, no float
            // atomics): the same call again gives the same bits.
            let first = out.to_bytes().unwrap();
            for _ in 0..8 {
                let p = up(&dev, DType::F32, vec![rows, h], &p0);
                ops::attn_res_norm(&brefs, &p, upd, Some(&dt), None, &ct, 1e-6, &wt, 1e-5, &out).expect("attn_res_norm");
                assert_eq!(out.to_bytes().unwrap(), first, "attn_res_norm rows {rows} h {h} blocks {nblocks} {upd:?}: not bit-reproducible");
            }
        }
    }
    // Too many blocks and a missing d are errors, not launches.
    let t = up(&dev, DType::F32, vec![1, 8], &[1.0; 8]);
    let many: Vec<&CudaTensor> = std::iter::repeat_n(&t, ops::ATTN_RES_MAX_BLOCKS + 1).collect();
    assert!(ops::attn_res_norm(
        &many,
        &t,
        ResUpdate::Keep,
        None,
        None,
        &up(&dev, DType::F32, vec![8], &[1.0; 8]),
        1e-6,
        &up(&dev, DType::F32, vec![8], &[1.0; 8]),
        1e-5,
        &t
    )
    .is_err());
    assert!(ops::attn_res_norm(
        &[],
        &t,
        ResUpdate::Add,
        None,
        None,
        &up(&dev, DType::F32, vec![8], &[1.0; 8]),
        1e-6,
        &up(&dev, DType::F32, vec![8], &[1.0; 8]),
        1e-5,
        &t
    )
    .is_err());
}

#[test]
fn rms_norm_cols_gather_copy_gate_add() {
    let Some(dev) = device("rms_norm_cols_gather_copy_gate_add") else { return };
    let mut r = rng("rms_norm_cols_gather_copy_gate_add");
    // RMSNorm of the first 32 of 40 columns (MLA's latent + k_pe row), f32 -> bf16 and in place f32.
    let (rows, wide, cols) = (6, 40, 32);
    let x = rv(&mut r, rows * wide);
    let w = rv(&mut r, cols);
    let want: Vec<f32> = x
        .chunks_exact(wide)
        .flat_map(|row| {
            let ms = row[..cols].iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / cols as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            row[..cols].iter().zip(&w).map(move |(&v, &g)| (v as f64 * inv * g as f64) as f32).collect::<Vec<_>>()
        })
        .collect();
    let xt = up(&dev, DType::F32, vec![rows, wide], &x);
    let wt = up(&dev, DType::F32, vec![cols], &w);
    let out = poisoned(&dev, DType::BF16, vec![rows, cols]);
    ops::rms_norm_cols(&xt, cols, &wt, 1e-6, &out).unwrap();
    check("rms_norm_cols f32 [6,40] first 32 -> bf16", &out.to_f32_vec().unwrap(), &want, 5e-3);
    ops::rms_norm_cols(&xt, cols, &wt, 1e-6, &xt).unwrap();
    let back = xt.to_f32_vec().unwrap();
    let (head, tail): (Vec<f32>, Vec<f32>) =
        (back.chunks_exact(wide).flat_map(|r| r[..cols].to_vec()).collect(), back.chunks_exact(wide).flat_map(|r| r[cols..].to_vec()).collect());
    check("rms_norm_cols in place, f32", &head, &want, 1e-5);
    assert_eq!(tail, x.chunks_exact(wide).flat_map(|r| r[cols..].to_vec()).collect::<Vec<_>>(), "columns past `cols` must be untouched");
    // Gather rows of a bf16 table into f32, in the order of the ids (repeats allowed); widths
    // below one block's 1024 columns and above it, not a multiple of 8.
    let mut table = Vec::new();
    for h in [24usize, 2053] {
        let v = 50;
        table = rv(&mut r, v * h).iter().map(|&x| bf16::from_f32(x).to_f32()).collect::<Vec<f32>>();
        let ids: Vec<i32> = vec![3, 49, 0, 3, 17];
        let tt = up(&dev, DType::BF16, vec![v, h], &table);
        let it = CudaTensor::from_pod(&dev, DType::I32, vec![ids.len()], &ids).unwrap();
        let g = poisoned(&dev, DType::F32, vec![ids.len(), h]);
        ops::gather_rows(&tt, &it, &g).unwrap();
        let want: Vec<f32> = ids.iter().flat_map(|&i| table[i as usize * h..(i as usize + 1) * h].to_vec()).collect();
        assert_eq!(g.to_f32_vec().unwrap(), want, "gather_rows bf16 -> f32, H = {h}");
    }
    // Strided copy: columns 16..24 of [R, 24] into columns 32..40 of [R, 40].
    let src = up(&dev, DType::BF16, vec![5, 24], &table[..5 * 24]);
    let dst = poisoned(&dev, DType::BF16, vec![5, 40]);
    ops::copy_strided_bf16(&dev, src.ptr() + 32, 24, dst.ptr() + 64, 40, 5, 8).unwrap();
    let d = dst.to_f32_vec().unwrap();
    for row in 0..5 {
        assert_eq!(&d[row * 40 + 32..row * 40 + 40], &table[row * 24 + 16..row * 24 + 24], "copy_strided row {row}");
        assert!(d[row * 40..row * 40 + 32].iter().all(|v| v.is_nan()), "copy_strided wrote outside its columns");
    }
    // Gate and add.
    let (a, b) = (rv(&mut r, 300), rv(&mut r, 300));
    let at = up(&dev, DType::BF16, vec![300], &a);
    ops::sigmoid_mul(&at, &up(&dev, DType::BF16, vec![300], &b)).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| bf16::from_f32(x).to_f32() * (1.0 / (1.0 + (-bf16::from_f32(y).to_f32()).exp()))).collect();
    check("sigmoid_mul bf16", &at.to_f32_vec().unwrap(), &want, 5e-3);
    let yt = up(&dev, DType::F32, vec![300], &a);
    ops::add_assign(&yt, &up(&dev, DType::F32, vec![300], &b)).unwrap();
    assert_eq!(yt.to_f32_vec().unwrap(), a.iter().zip(&b).map(|(x, y)| x + y).collect::<Vec<_>>(), "add_assign");
}

#[test]
fn graph_keeps_its_temporaries() {
    let Some(dev) = device("graph_keeps_its_temporaries") else { return };
    // The captured work allocates a temporary, writes x+1 into it and copies it out. After the
    // capture, allocations of the same size must not get the temporary's block while the graph
    // lives, or a replay would overwrite them.
    let x = up(&dev, DType::F32, vec![1024], &vec![1.0; 1024]);
    let one = up(&dev, DType::F32, vec![1024], &vec![1.0; 1024]);
    let out = CudaTensor::uninit(&dev, DType::F32, vec![1024]).unwrap();
    let g = capture(&dev, || {
        let tmp = CudaTensor::uninit(&dev, DType::F32, vec![1024])?;
        tmp.copy_from(&x)?;
        ops::add_assign(&tmp, &one)?;
        out.copy_from(&tmp)
    })
    .expect("capture");
    let other = up(&dev, DType::F32, vec![1024], &vec![7.0; 1024]);
    g.launch().unwrap();
    g.launch().unwrap();
    assert_eq!(out.to_f32_vec().unwrap(), vec![2.0; 1024], "graph result");
    assert_eq!(other.to_f32_vec().unwrap(), vec![7.0; 1024], "a block allocated after the capture was overwritten by a replay");
}
