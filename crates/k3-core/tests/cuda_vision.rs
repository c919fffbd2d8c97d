//! Parity suite for the vision tower's kernels (`cuda::vision`, `vision.cu`) against f64 CPU
//! references written here from the formulas of around-backbone §3.4–§3.7 (the tower itself is
//! checked against k3-vision's CPU path in `crates/k3-vision/tests/cuda_vision.rs`).
//!
//! - `vit_rope`: random cos/sin tables and patch positions (the kernel only indexes them), F32
//!   in place and BF16 out; V must come through unchanged.
//! - `vit_attention`: samples of 1..70 rows packed, 3 heads of dim 8, block-diagonal, with the
//!   default score budget and with one forcing slices of 1..n rows (and a remainder slice).
//! - `vit_merge`: grids with t = 1..4 against the space-to-depth + temporal mean formula.
//! - `vit_gelu_tanh`, `vit_gelu_erf`: the tanh formula and tabulated exact GELU values.
//!
//! Outputs are poisoned (NaN) first. Tolerances: F32 relative L2 1e-5 (1e-6 for elementwise);
//! BF16 outputs 1e-2 (one bf16 rounding of outputs and, for attention, of P and the inputs).
//! Without a GPU every test prints `skipped` and passes (fails with `K3_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, poisoned, rng, rvec, up, up_i32};

use k3_core::cuda::vision::{vit_attention, vit_attention_sliced, vit_gelu_erf, vit_gelu_tanh, vit_merge, vit_rope};
use k3_core::DType;
use rand::Rng;

const TOL_F32: f64 = 1e-5;
const TOL_BF16: f64 = 1e-2;

/// The rotation of §3.4 with given tables: pairs (2j, 2j+1) of each Q and K head, even j by the
/// column, odd j by the row, frequency j/2.
fn rope_ref(qkv: &[f32], pos: &[(usize, usize)], cs: &[f32], sn: &[f32], dq: usize, hd: usize) -> Vec<f32> {
    let nf = hd / 4;
    let mut out = qkv.to_vec();
    for (row, &(r, c)) in pos.iter().enumerate() {
        for e in (0..2 * dq).step_by(2) {
            let j = (e % hd) / 2;
            let p = if j.is_multiple_of(2) { c } else { r };
            let (co, si) = (cs[p * nf + j / 2], sn[p * nf + j / 2]);
            let at = row * 3 * dq + e;
            let (a, b) = (qkv[at], qkv[at + 1]);
            out[at] = a * co - b * si;
            out[at + 1] = a * si + b * co;
        }
    }
    out
}

#[test]
fn rope_rotates_q_and_k_by_patch_position() {
    let test = "rope_rotates_q_and_k_by_patch_position";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let (heads, hd, side) = (3, 16, 7);
    let dq = heads * hd;
    let l = 50;
    let pos: Vec<(usize, usize)> = (0..l).map(|_| (r.random_range(0..side), r.random_range(0..side))).collect();
    let cs = rvec(&mut r, side * hd / 4, 0.1, 1.0);
    let sn = rvec(&mut r, side * hd / 4, 0.1, 1.0);
    let qkv = rvec(&mut r, l * 3 * dq, 0.1, 2.0);
    let want = rope_ref(&qkv, &pos, &cs, &sn, dq, hd);
    let rc: Vec<i32> = pos.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
    let (rc, ct, st) = (up_i32(&dev, vec![l, 2], &rc), up(&dev, DType::F32, vec![side, hd / 4], &cs), up(&dev, DType::F32, vec![side, hd / 4], &sn));
    let x = up(&dev, DType::F32, vec![l, 3 * dq], &qkv);
    let out = poisoned(&dev, DType::BF16, vec![l, 3 * dq]);
    vit_rope(&x, &rc, &ct, &st, heads, &out).unwrap();
    check("vit_rope bf16 out", &out.to_f32_vec().unwrap(), &want, TOL_BF16);
    vit_rope(&x, &rc, &ct, &st, heads, &x).unwrap();
    let got = x.to_f32_vec().unwrap();
    check("vit_rope f32 in place", &got, &want, 1e-6);
    let v: Vec<f32> = (0..l).flat_map(|i| got[i * 3 * dq + 2 * dq..(i + 1) * 3 * dq].to_vec()).collect();
    let v0: Vec<f32> = (0..l).flat_map(|i| qkv[i * 3 * dq + 2 * dq..(i + 1) * 3 * dq].to_vec()).collect();
    assert_eq!(v, v0, "V is copied unchanged");
}

/// Softmax attention of each sample's rows over its own keys, per head, in f64.
fn attention_ref(qkv: &[f32], lens: &[usize], heads: usize, hd: usize) -> Vec<f32> {
    let dq = heads * hd;
    let w3 = 3 * dq;
    let mut out = vec![0f32; lens.iter().sum::<usize>() * dq];
    let mut off = 0;
    for &n in lens {
        for h in 0..heads {
            for i in 0..n {
                let q = &qkv[(off + i) * w3 + h * hd..][..hd];
                let s: Vec<f64> = (0..n)
                    .map(|j| q.iter().zip(&qkv[(off + j) * w3 + dq + h * hd..][..hd]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (hd as f64).sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let v: f64 = (0..n).map(|j| e[j] / z * qkv[(off + j) * w3 + 2 * dq + h * hd + d] as f64).sum();
                    out[(off + i) * dq + h * hd + d] = v as f32;
                }
            }
        }
        off += n;
    }
    out
}

#[test]
fn attention_is_block_diagonal_over_packed_samples() {
    let test = "attention_is_block_diagonal_over_packed_samples";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let (heads, hd) = (3, 8);
    let dq = heads * hd;
    let lens = [5, 37, 1, 70, 16];
    let l: usize = lens.iter().sum();
    let qkv = rvec(&mut r, l * 3 * dq, 0.05, 1.5);
    let want = attention_ref(&qkv, &lens, heads, hd);
    for dt in [DType::F32, DType::BF16] {
        let x = up(&dev, dt, vec![l, 3 * dq], &qkv);
        let tol = if dt == DType::F32 { TOL_F32 } else { TOL_BF16 };
        let out = poisoned(&dev, dt, vec![l, dq]);
        vit_attention(&x, heads, &lens, &out).unwrap();
        check(&format!("vit_attention {dt}"), &out.to_f32_vec().unwrap(), &want, tol);
        // Score budgets of 1, 7 and 16 rows of the longest sample: several slices and a remainder.
        for rows in [1, 7, 16] {
            let out = poisoned(&dev, dt, vec![l, dq]);
            vit_attention_sliced(&x, heads, &lens, &out, rows * heads * 70 * 4).unwrap();
            check(&format!("vit_attention {dt}, slices of {rows} rows of 70"), &out.to_f32_vec().unwrap(), &want, tol);
        }
    }
    // Wrong lengths are refused, naming them.
    let x = up(&dev, DType::F32, vec![l, 3 * dq], &qkv);
    let e = vit_attention(&x, heads, &[5, 37], &poisoned(&dev, DType::F32, vec![l, dq])).unwrap_err().to_string();
    assert!(e.contains("sum to L"), "{e}");
}

#[test]
fn merge_is_space_to_depth_and_time_mean() {
    let test = "merge_is_space_to_depth_and_time_mean";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let c = 5;
    let grids = [[1, 4, 6], [2, 2, 2], [3, 6, 4], [4, 2, 8], [1, 2, 2]];
    let l: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
    let x = rvec(&mut r, l * c, 0.1, 3.0);
    let mut want = Vec::new();
    let mut off = 0;
    for &[t, h, w] in &grids {
        for big_r in 0..h / 2 {
            for cc in 0..w / 2 {
                for dy in 0..2 {
                    for dx in 0..2 {
                        for ch in 0..c {
                            let s: f64 = (0..t).map(|tau| x[(off + tau * h * w + (2 * big_r + dy) * w + 2 * cc + dx) * c + ch] as f64).sum();
                            want.push((s / t as f64) as f32);
                        }
                    }
                }
            }
        }
        off += t * h * w;
    }
    let n = want.len() / (4 * c);
    let xt = up(&dev, DType::F32, vec![l, c], &x);
    let out = poisoned(&dev, DType::F32, vec![n, 4 * c]);
    vit_merge(&xt, &grids, 2, 2, &out).unwrap();
    check("vit_merge", &out.to_f32_vec().unwrap(), &want, 1e-6);
    let e = vit_merge(&xt, &[[1, 3, 4]], 2, 2, &out).unwrap_err().to_string();
    assert!(e.contains("merge kernel") || e.contains("must be F32"), "{e}");
}

#[test]
fn gelus_match_their_formulas() {
    let test = "gelus_match_their_formulas";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let x = rvec(&mut r, 1000, 0.0, 6.0);
    let want: Vec<f32> = x
        .iter()
        .map(|&v| {
            let v = v as f64;
            (0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())) as f32
        })
        .collect();
    let xt = up(&dev, DType::F32, vec![1000], &x);
    for dt in [DType::F32, DType::BF16] {
        let out = poisoned(&dev, dt, vec![1000]);
        vit_gelu_tanh(&xt, &out).unwrap();
        check(&format!("vit_gelu_tanh {dt}"), &out.to_f32_vec().unwrap(), &want, if dt == DType::F32 { 1e-6 } else { TOL_BF16 });
    }
    // Exact GELU 0.5·u·(1 + erf(u/√2)) at tabulated points.
    let pts = [
        (1.0f32, 0.841_344_746_068_542_9f64),
        (-1.0, -0.158_655_253_931_457_05),
        (0.5, 0.345_731_230_637_006_6),
        (2.0, 1.954_499_736_103_641_6),
        (-3.0, -0.004_049_694_094_890_31),
        (0.0, 0.0),
    ];
    let u: Vec<f32> = pts.iter().map(|p| p.0).collect();
    let out = poisoned(&dev, DType::F32, vec![pts.len()]);
    vit_gelu_erf(&up(&dev, DType::F32, vec![pts.len()], &u), &out).unwrap();
    for (g, (u, w)) in out.to_f32_vec().unwrap().iter().zip(pts) {
        assert!((*g as f64 - w).abs() <= 1e-6 * w.abs().max(1e-3), "gelu_erf({u}) = {g}, want {w}");
    }
}
