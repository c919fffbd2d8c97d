//! Parity suite for the vision tower's kernels (`cuda::vision`, `vision.cu`) against f64 CPU
//! references written here from the formulas of around-backbone §3.4–§3.7 (the tower itself is
//! checked against k3-vision's CPU path in `crates/k3-vision/tests/cuda_vision.rs`).
//!
//! - `vit_rope`: random cos/sin tables and patch positions (the kernel only indexes them), F32
//!   in place and BF16 out; V must come through unchanged.
//! - `vit_attention`: samples of 1..70 rows packed, 3 heads of dim 8, block-diagonal: F32 and
//!   BF16 through the default dispatch (BF16 → the fused kernel) and the cuBLAS form with score
//!   budgets forcing slices of 1..n rows (and a remainder slice).
//! - `vit_flash_attention` (the fused kernel, `vit_attn.cu`): samples of 1, 63, 64, 65, 300 and
//!   1000 rows packed out of order (around its 64-key tiles and 64/128-row query tiles) at head
//!   dim 128 (K3) and 24 (the golden `vision_small_f32` tower: qkv 48 / 2 heads), BF16 and F32
//!   out, every query-tile shape; scores rising along the keys (a rescale every tile, and one
//!   every few tiles under the lazy threshold); a sample's rows bit-identical alone and packed;
//!   unsupported head dims refused by name and taken by `vit_attention`'s cuBLAS form instead.
//! - `vit_merge`: grids with t = 1..4 against the space-to-depth + temporal mean formula.
//! - `vit_gelu_tanh`, `vit_gelu_erf`: the tanh formula and tabulated exact GELU values.
//! - The BF16 tower's forms (issue 24) against the unfused compositions they replace:
//!   `vit_rope_bf16_inplace` bit for bit the cast to F32 + `vit_rope`; BF16-in `vit_gelu_tanh`
//!   and `vit_rms_norm_bf16` within one bf16 step of the F32-in kernel / `rms_norm_cols`.
//!
//! Outputs are poisoned (NaN) first. Tolerances: F32 relative L2 1e-5 (1e-6 for elementwise);
//! BF16 outputs 1e-2 (one bf16 rounding of outputs and, for attention, of P and the inputs). The
//! fused kernel is held per (row, head) — a single wrong row cannot hide in a global norm — to
//! [`TOL_FLASH_BF16`] (P and the output rounded to bf16, 2^-9 each) and [`TOL_FLASH_F32`] (P
//! only); its inputs are bf16 values, so the f64 reference sees exactly what the kernel reads.
//! Without a GPU every test prints `skipped` and passes (fails with `K3_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, max_rel_l2, poisoned, rng, rvec, say, up, up_i32};

use k3_core::cuda::vision::{
    flash_supports, vit_attention, vit_attention_sliced, vit_flash_attention, vit_flash_attention_tiled, vit_gelu_erf, vit_gelu_tanh, vit_merge,
    vit_rms_norm_bf16, vit_rope, vit_rope_bf16_inplace, FlashTile,
};
use k3_core::DType;
use rand::Rng;

const TOL_F32: f64 = 1e-5;
const TOL_BF16: f64 = 1e-2;
/// Per (row, head) relative L2 of the fused kernel, BF16 out.
const TOL_FLASH_BF16: f64 = 1e-2;
/// Per (row, head) relative L2 of the fused kernel, F32 out.
const TOL_FLASH_F32: f64 = 6e-3;

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

/// Samples around the fused kernel's tiles (64 keys; 64 or 128 query rows), packed out of order.
const FLASH_LENS: [usize; 6] = [300, 1, 65, 1000, 63, 64];

/// The largest per-(row, head) relative L2 of `out` against `want`, asserting `tol`.
fn check_rows(what: &str, out: &k3_core::cuda::CudaTensor, want: &[f32], hd: usize, tol: f64) {
    let e = max_rel_l2(&out.to_f32_vec().unwrap(), want, hd);
    say(&format!("  {what:<60} max per-(row, head) rel L2 {e:.2e} (tol {tol:.1e})"));
    assert!(e <= tol, "{what}: max per-(row, head) relative L2 {e:.3e} > {tol:.1e}");
}

#[test]
fn flash_attention_matches_f64_reference() {
    let test = "flash_attention_matches_f64_reference";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let l: usize = FLASH_LENS.iter().sum();
    // K3's head dim, and the golden vision_small_f32 tower's (qkv_hidden_size 48 / 2 heads).
    for (heads, hd) in [(2, 128), (2, 24)] {
        let dq = heads * hd;
        let qkv = rvec(&mut r, l * 3 * dq, 0.05, 1.5);
        let want = attention_ref(&qkv, &FLASH_LENS, heads, hd);
        let x = up(&dev, DType::BF16, vec![l, 3 * dq], &qkv);
        for (dt, tol) in [(DType::BF16, TOL_FLASH_BF16), (DType::F32, TOL_FLASH_F32)] {
            let out = poisoned(&dev, dt, vec![l, dq]);
            vit_flash_attention(&x, heads, &FLASH_LENS, &out).unwrap();
            check_rows(&format!("vit_flash_attention hd {hd}, {dt} out"), &out, &want, hd, tol);
        }
        if hd == 128 {
            for tile in FlashTile::ALL {
                let out = poisoned(&dev, DType::BF16, vec![l, dq]);
                vit_flash_attention_tiled(&x, heads, &FLASH_LENS, &out, tile).unwrap();
                check_rows(&format!("vit_flash_attention hd 128, {tile:?}"), &out, &want, hd, TOL_FLASH_BF16);
            }
        }
        // The tower's entry point takes the fused kernel for BF16: the same bits.
        let (a, b) = (poisoned(&dev, DType::BF16, vec![l, dq]), poisoned(&dev, DType::BF16, vec![l, dq]));
        vit_attention(&x, heads, &FLASH_LENS, &a).unwrap();
        vit_flash_attention(&x, heads, &FLASH_LENS, &b).unwrap();
        assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "vit_attention BF16 at hd {hd} must run the fused kernel");
    }
}

/// Scores that rise along the keys, so a row's running max moves: head 0 by far more than the
/// lazy threshold (2^8) every 64-key tile, head 1 by less, so it rescales only every few tiles
/// and its unnormalised probabilities grow past 1 in between. Half the rows see the scores fall
/// instead (their max is the first key; they never rescale), mixed within every warp.
#[test]
fn flash_attention_rescales_when_the_max_grows() {
    let test = "flash_attention_rescales_when_the_max_grows";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let (heads, hd) = (2, 128);
    let dq = heads * hd;
    let lens = [700, 130];
    let l: usize = lens.iter().sum();
    let mut qkv = rvec(&mut r, l * 3 * dq, 0.05, 0.5);
    let mut off = 0;
    for &n in &lens {
        for i in 0..n {
            let row = &mut qkv[(off + i) * 3 * dq..(off + i + 1) * 3 * dq];
            let sign = if r.random::<bool>() { 4.0 } else { -4.0 };
            // Score change per key: slope·100/n nats, for n = 700 head 0 0.17 (16 per tile in
            // base 2: a rescale every tile), head 1 0.017 (1.6 per tile: one every ~5 tiles).
            for (h, slope) in [(0, 1.2f32), (1, 0.12)] {
                row[h * hd] = sign;
                row[dq + h * hd] = half::bf16::from_f32(slope * i as f32 * (hd as f32).sqrt() / 4.0 / n as f32 * 100.0).to_f32();
            }
        }
        off += n;
    }
    let want = attention_ref(&qkv, &lens, heads, hd);
    let x = up(&dev, DType::BF16, vec![l, 3 * dq], &qkv);
    for (dt, tol) in [(DType::BF16, TOL_FLASH_BF16), (DType::F32, TOL_FLASH_F32)] {
        let out = poisoned(&dev, dt, vec![l, dq]);
        vit_flash_attention(&x, heads, &lens, &out).unwrap();
        check_rows(&format!("vit_flash_attention rising scores, {dt} out"), &out, &want, hd, tol);
    }
}

/// A sample's rows are the same bits alone and packed between others (each query tile reads only
/// its own sample's keys, whatever the tile order).
#[test]
fn flash_attention_of_a_sample_does_not_depend_on_its_neighbours() {
    let test = "flash_attention_of_a_sample_does_not_depend_on_its_neighbours";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let (heads, hd) = (3, 128);
    let dq = heads * hd;
    let l: usize = FLASH_LENS.iter().sum();
    let qkv = rvec(&mut r, l * 3 * dq, 0.05, 1.5);
    let packed = poisoned(&dev, DType::BF16, vec![l, dq]);
    vit_flash_attention(&up(&dev, DType::BF16, vec![l, 3 * dq], &qkv), heads, &FLASH_LENS, &packed).unwrap();
    let packed = packed.to_bytes().unwrap();
    let mut off = 0;
    for &n in &FLASH_LENS {
        let alone = poisoned(&dev, DType::BF16, vec![n, dq]);
        vit_flash_attention(&up(&dev, DType::BF16, vec![n, 3 * dq], &qkv[off * 3 * dq..(off + n) * 3 * dq]), heads, &[n], &alone).unwrap();
        assert!(alone.to_bytes().unwrap() == packed[off * dq * 2..(off + n) * dq * 2], "sample of {n} rows at row {off} differs alone and packed");
        off += n;
    }
}

/// Head dims the fused kernel does not take are refused by name, and `vit_attention` runs them
/// through cuBLAS instead; so are F32 inputs and tile shapes without a kernel.
#[test]
fn flash_attention_refuses_what_it_cannot_run() {
    let test = "flash_attention_refuses_what_it_cannot_run";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    assert!(flash_supports(128) && flash_supports(24) && flash_supports(8));
    assert!(!flash_supports(12) && !flash_supports(136) && !flash_supports(0));
    let lens = [9, 70];
    let l: usize = lens.iter().sum();
    let (heads, hd) = (2, 12);
    let dq = heads * hd;
    let qkv = rvec(&mut r, l * 3 * dq, 0.05, 1.5);
    let x = up(&dev, DType::BF16, vec![l, 3 * dq], &qkv);
    let out = poisoned(&dev, DType::BF16, vec![l, dq]);
    let e = vit_flash_attention(&x, heads, &lens, &out).unwrap_err().to_string();
    assert!(e.contains("head dim 12") && e.contains("multiple of 8"), "{e}");
    vit_attention(&x, heads, &lens, &out).unwrap();
    check("vit_attention BF16 hd 12 (cuBLAS form)", &out.to_f32_vec().unwrap(), &attention_ref(&qkv, &lens, heads, hd), TOL_BF16);
    let (heads, hd) = (2, 24);
    let dq = heads * hd;
    let qkv = rvec(&mut r, l * 3 * dq, 0.05, 1.5);
    let out = poisoned(&dev, DType::BF16, vec![l, dq]);
    let e = vit_flash_attention(&up(&dev, DType::F32, vec![l, 3 * dq], &qkv), heads, &lens, &out).unwrap_err().to_string();
    assert!(e.contains("must be BF16"), "{e}");
    let x = up(&dev, DType::BF16, vec![l, 3 * dq], &qkv);
    let e = vit_flash_attention_tiled(&x, heads, &lens, &out, FlashTile::Rows64Warps4).unwrap_err().to_string();
    assert!(e.contains("no fused kernel for head dim 24"), "{e}");
    let e = vit_flash_attention(&x, heads, &[9, 60], &out).unwrap_err().to_string();
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

/// The BF16 values of `t` as raw bits.
fn bits(t: &k3_core::cuda::CudaTensor) -> Vec<u16> {
    bytemuck::pod_collect_to_vec(&t.to_bytes().unwrap())
}

/// Largest distance in bf16 steps between two equal-length bit vectors (NaN counts as huge).
fn max_ulps(got: &[u16], want: &[u16]) -> u32 {
    let key = |b: u16| if b & 0x8000 != 0 { 0x8000 - (b & 0x7fff) as i32 } else { 0x8000 + b as i32 };
    let nan = |b: u16| (b & 0x7fff) > 0x7f80;
    got.iter().zip(want).map(|(&g, &w)| if nan(g) || nan(w) { u32::MAX } else { key(g).abs_diff(key(w)) }).max().unwrap_or(0)
}

/// `vit_rope_bf16_inplace` (the BF16 tower's RoPE on the qkv GEMM's BF16 output) is bit for bit
/// the unfused composition it replaces — the BF16 qkv cast to F32, then `vit_rope` into BF16 —
/// with V untouched, at head dims 16, 12 (not a multiple of 8) and 128, and near the f64 formula.
#[test]
fn rope_bf16_in_place_is_the_cast_then_rope() {
    let test = "rope_bf16_in_place_is_the_cast_then_rope";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    for (heads, hd, l) in [(3, 16, 50), (2, 12, 33), (2, 128, 70)] {
        let (dq, side) = (heads * hd, 9);
        let pos: Vec<(usize, usize)> = (0..l).map(|_| (r.random_range(0..side), r.random_range(0..side))).collect();
        let cs = rvec(&mut r, side * hd / 4, 0.1, 1.0);
        let sn = rvec(&mut r, side * hd / 4, 0.1, 1.0);
        let qkv = rvec(&mut r, l * 3 * dq, 0.1, 2.0);
        let rc: Vec<i32> = pos.iter().flat_map(|&(a, b)| [a as i32, b as i32]).collect();
        let (rc, ct, st) = (up_i32(&dev, vec![l, 2], &rc), up(&dev, DType::F32, vec![side, hd / 4], &cs), up(&dev, DType::F32, vec![side, hd / 4], &sn));
        let unfused = poisoned(&dev, DType::BF16, vec![l, 3 * dq]);
        vit_rope(&up(&dev, DType::F32, vec![l, 3 * dq], &qkv), &rc, &ct, &st, heads, &unfused).unwrap();
        let x = up(&dev, DType::BF16, vec![l, 3 * dq], &qkv);
        vit_rope_bf16_inplace(&x, &rc, &ct, &st, heads).unwrap();
        let what = format!("vit_rope_bf16_inplace heads {heads} hd {hd}");
        assert_eq!(bits(&x), bits(&unfused), "{what}: differs from the cast + vit_rope composition");
        check(&what, &x.to_f32_vec().unwrap(), &rope_ref(&qkv, &pos, &cs, &sn, dq, hd), TOL_BF16);
        let got = x.to_f32_vec().unwrap();
        assert!((0..l).all(|i| got[i * 3 * dq + 2 * dq..(i + 1) * 3 * dq] == qkv[i * 3 * dq + 2 * dq..(i + 1) * 3 * dq]), "{what}: V changed");
    }
    let (rc, t) = (up_i32(&dev, vec![2, 2], &[0; 4]), up(&dev, DType::F32, vec![1, 4], &[0.5; 4]));
    let e = vit_rope_bf16_inplace(&up(&dev, DType::F32, vec![2, 48], &[0.0; 96]), &rc, &t, &t, 1).unwrap_err().to_string();
    assert!(e.contains("BF16"), "{e}");
    let e = vit_rope_bf16_inplace(&up(&dev, DType::BF16, vec![2, 30], &[0.0; 60]), &rc, &t, &t, 2).unwrap_err().to_string();
    assert!(e.contains("multiple of 4"), "{e}");
}

/// BF16-in `vit_gelu_tanh` (in place on the fc0 GEMM's BF16 output, and into another tensor)
/// equals the F32 form on the same values rounded to BF16 (at most one bf16 step apart, were the
/// compiler to contract the two kernels' arithmetic differently), including the n % 8 tail.
#[test]
fn gelu_tanh_bf16_is_the_f32_form_rounded() {
    let test = "gelu_tanh_bf16_is_the_f32_form_rounded";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    for n in [5usize, 8, 1003, 4096 + 7] {
        let x = rvec(&mut r, n, 0.0, 6.0);
        let want = poisoned(&dev, DType::BF16, vec![n]);
        vit_gelu_tanh(&up(&dev, DType::F32, vec![n], &x), &want).unwrap();
        let (inplace, src, out) = (up(&dev, DType::BF16, vec![n], &x), up(&dev, DType::BF16, vec![n], &x), poisoned(&dev, DType::BF16, vec![n]));
        vit_gelu_tanh(&inplace, &inplace).unwrap();
        vit_gelu_tanh(&src, &out).unwrap();
        for (what, got) in [("in place", &inplace), ("out of place", &out)] {
            let u = max_ulps(&bits(got), &bits(&want));
            say(&format!("  vit_gelu_tanh bf16 -> bf16 {what} n {n}: max {u} bf16 steps from the f32 form"));
            assert!(u <= 1, "vit_gelu_tanh bf16 {what} n {n}: {u} bf16 steps from the f32 form rounded");
        }
        assert_eq!(bits(&src), bits(&up(&dev, DType::BF16, vec![n], &x)), "out of place must leave x alone");
    }
    let e = vit_gelu_tanh(&up(&dev, DType::BF16, vec![8], &[0.0; 8]), &poisoned(&dev, DType::F32, vec![8])).unwrap_err().to_string();
    assert!(e.contains("BF16"), "{e}");
}

/// `vit_rms_norm_bf16` (a warp per row) against `rms_norm_cols` F32 → BF16, which it replaces in
/// the BF16 tower: at most one bf16 step apart (only the mean square's summation order differs),
/// on widths of one float4, 64, 1024 (K3), 2048 (its widest) and row counts that leave a block
/// part-filled; widths it does not take (6, 2052) go to `rms_norm_cols` itself: equal bits.
#[test]
fn rms_norm_bf16_matches_rms_norm_cols() {
    let test = "rms_norm_bf16_matches_rms_norm_cols";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    for (rows, d) in [(3usize, 4usize), (37, 64), (37, 1024), (9, 2048), (5, 6), (4, 2052)] {
        let scale: Vec<f32> = (0..rows).map(|_| 10f32.powi(r.random_range(-2..3))).collect();
        let x: Vec<f32> = rvec(&mut r, rows * d, 0.0, 1.0).iter().enumerate().map(|(i, v)| v * scale[i / d]).collect();
        let w = rvec(&mut r, d, 0.5, 1.5);
        let (xt, wt) = (up(&dev, DType::F32, vec![rows, d], &x), up(&dev, DType::F32, vec![d], &w));
        let want = poisoned(&dev, DType::BF16, vec![rows, d]);
        k3_core::cuda::ops::rms_norm_cols(&xt, d, &wt, 1e-6, &want).unwrap();
        let got = poisoned(&dev, DType::BF16, vec![rows, d]);
        vit_rms_norm_bf16(&xt, &wt, 1e-6, &got).unwrap();
        let u = max_ulps(&bits(&got), &bits(&want));
        say(&format!("  vit_rms_norm_bf16 {rows} x {d}: max {u} bf16 steps from rms_norm_cols"));
        assert!(u <= if d % 4 == 0 && d <= 2048 { 1 } else { 0 }, "vit_rms_norm_bf16 {rows} x {d}: {u} bf16 steps from rms_norm_cols");
        let reference: Vec<f32> = x
            .chunks(d)
            .flat_map(|row| {
                let inv = 1.0 / (row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64 + 1e-6).sqrt();
                row.iter().zip(&w).map(move |(&v, &g)| (v as f64 * inv * g as f64) as f32)
            })
            .collect();
        check(&format!("vit_rms_norm_bf16 {rows} x {d}"), &got.to_f32_vec().unwrap(), &reference, TOL_BF16);
    }
    let e = vit_rms_norm_bf16(
        &up(&dev, DType::F32, vec![2, 8], &[1.0; 16]),
        &up(&dev, DType::F32, vec![8], &[1.0; 8]),
        1e-6,
        &poisoned(&dev, DType::F32, vec![2, 8]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("BF16"), "{e}");
}
