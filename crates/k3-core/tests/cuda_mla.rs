//! Parity suite for the CUDA MLA kernels (`cuda::mla`, text-backbone §4) and the strided
//! batched GEMM (`cuda::blas::gemm_strided_batched`) in its MLA absorb / un-absorb use,
//! against f32 CPU references written here (the absorbed branch of k3-model `layers/mla.rs`,
//! with the dot product and softmax of `kernels::cpu`).
//!
//! Shapes: N packed rows, nh heads, r latent, dr rope, W = r + dr; paged BF16 cache
//! `[pages, 64, W]` with non-contiguous page ids. Inputs are random bf16-representable values
//! (seed printed; `K3_TEST_SEED=N` replays); outputs are poisoned with NaN first.
//! Tolerances: cache append — k_pe bit-exact, latent within 1 bf16 ulp of the bf16-rounded
//! f32 reference and at least 99 % bit-exact (summation order may move the f32 value across a
//! rounding boundary); attend — relative L2 5e-3 (bf16 output rounding, f32 everywhere else),
//! and 1e-5 for the reference precision (F32 q, cache and out: the plain f32 kernel);
//! batched GEMM — relative L2 5e-3 for BF16 output, 1e-5 for F32 output.
//! Timings (printed, never asserted): decode at real dims, batch 1, contexts 4096 and 131072.
//! Without a GPU every test prints `skipped` and passes (fails with `K3_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, paging, poisoned, prefill_rows, rng, rvec, say, slot, time_attend, up, up_i32};

use half::bf16;
use k3_core::cuda::blas::{gemm_strided_batched, Layout, Strided};
use k3_core::cuda::mla::{mla_attend, mla_cache_append, PagedBatch, PAGE};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::kernels::cpu::act::softmax_inplace;
use k3_core::kernels::cpu::matmul::dot;
use k3_core::DType;
use rand::seq::SliceRandom;
use rand::Rng;

const TOL_ATTEND: f64 = 5e-3;
/// The reference precision (F32 q, cache, out): summation order only.
const TOL_F32: f64 = 1e-5;

#[test]
fn cache_append_matches_rms_norm() {
    let Some(dev) = device("cache_append_matches_rms_norm") else { return };
    let mut r = rng("cache_append_matches_rms_norm");
    for &(rr, dr) in &[(32usize, 8usize), (512, 64)] {
        let w = rr + dr;
        let lens = [1usize, 64, 65, 130];
        let (bt, mp, pages) = paging(&mut r, &lens);
        // Rows: every position of each sequence (a packed prefill).
        let (rs, rp) = prefill_rows(&lens);
        let n = rs.len();
        let ckv = rvec(&mut r, n * w, 0.01, 2.0);
        let kv_norm: Vec<f32> = (0..rr).map(|_| r.random_range(0.5f32..1.5)).collect();
        let eps = 1e-6f32;
        for dt in [DType::F32, DType::BF16] {
            let (btt, rst, rpt) = (up_i32(&dev, vec![lens.len(), mp], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
            let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
            let cache = poisoned(&dev, DType::BF16, vec![pages, PAGE, w]);
            mla_cache_append(&up(&dev, dt, vec![n, w], &ckv), &up(&dev, DType::F32, vec![rr], &kv_norm), eps, &batch, &cache).expect("append");
            let got = cache.to_f32_vec().expect("read");
            let (mut exact, mut total) = (0usize, 0usize);
            for i in 0..n {
                let x = &ckv[i * w..(i + 1) * w];
                let ms = x[..rr].iter().map(|v| v * v).sum::<f32>() / rr as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                let row = &got[slot(&bt, mp, rs[i] as usize, rp[i] as usize) * w..][..w];
                for d in 0..w {
                    let want = bf16::from_f32(if d < rr { x[d] * inv * kv_norm[d] } else { x[d] });
                    let g = bf16::from_f32(row[d]);
                    if d >= rr {
                        assert_eq!(g.to_bits(), want.to_bits(), "k_pe row {i} dim {d}");
                    } else {
                        let ulps = (g.to_bits() as i32 - want.to_bits() as i32).abs();
                        assert!(ulps <= 1, "latent row {i} dim {d}: got {g} want {want}");
                        exact += (ulps == 0) as usize;
                        total += 1;
                    }
                }
            }
            let frac = exact as f64 / total as f64;
            say(&format!("  append r={rr} dr={dr} {dt}: latent bit-exact {:.4} of {total}", frac));
            assert!(frac >= 0.99, "too many 1-ulp differences: {frac}");
        }
    }
}

/// One attend problem: rows (seq, pos, optional selection) over a random paged cache.
struct Attend {
    nh: usize,
    r: usize,
    w: usize,
    bt: Vec<i32>,
    mp: usize,
    cache: Vec<f32>, // [pages, PAGE, w]
    rows: Vec<(usize, usize, Option<Vec<i32>>)>,
    q: Vec<f32>, // [N, nh, w]
}

fn reference(p: &Attend, scale: f32) -> Vec<f32> {
    let (nh, r, w) = (p.nh, p.r, p.w);
    let mut out = vec![0f32; p.rows.len() * nh * r];
    for (i, (seq, pos, sel)) in p.rows.iter().enumerate() {
        let keys: Vec<usize> = match sel {
            Some(s) => s.iter().map(|&v| v as usize).collect(),
            None => (0..=*pos).collect(),
        };
        for h in 0..nh {
            let qh = &p.q[(i * nh + h) * w..][..w];
            let mut prob: Vec<f32> = keys.iter().map(|&s| dot(qh, &p.cache[slot(&p.bt, p.mp, *seq, s) * w..][..w]) * scale).collect();
            softmax_inplace(&mut prob);
            let o = &mut out[(i * nh + h) * r..][..r];
            for (&s, &pe) in keys.iter().zip(&prob) {
                let row = &p.cache[slot(&p.bt, p.mp, *seq, s) * w..][..r];
                o.iter_mut().zip(row).for_each(|(a, &b)| *a += pe * b);
            }
        }
    }
    out
}

fn run_attend(dev: &CudaDevice, p: &Attend, scale: f32, what: &str) {
    run_attend_as(dev, p, scale, what, DType::BF16)
}

/// [`run_attend`] with q, cache and out stored as `dt`: F32 is the reference precision (the plain
/// f32 kernel), held to f32 tolerance.
fn run_attend_as(dev: &CudaDevice, p: &Attend, scale: f32, what: &str, dt: DType) {
    let n = p.rows.len();
    let pages = p.cache.len() / (PAGE * p.w);
    let rs: Vec<i32> = p.rows.iter().map(|x| x.0 as i32).collect();
    let rp: Vec<i32> = p.rows.iter().map(|x| x.1 as i32).collect();
    let b = p.bt.len() / p.mp;
    let (btt, rst, rpt) = (up_i32(dev, vec![b, p.mp], &p.bt), up_i32(dev, vec![n], &rs), up_i32(dev, vec![n], &rp));
    let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
    let cache = up(dev, dt, vec![pages, PAGE, p.w], &p.cache);
    let q = up(dev, dt, vec![n, p.nh, p.w], &p.q);
    let out = poisoned(dev, dt, vec![n, p.nh, p.r]);
    let has_sel = p.rows.iter().any(|x| x.2.is_some());
    let sel_t = has_sel.then(|| {
        let k = p.rows.iter().map(|x| x.2.as_ref().map_or(0, Vec::len)).max().unwrap_or(0).max(1) + 2;
        // Entries past the count hold an out-of-range sentinel: reading one would fault or be wrong.
        let mut idx = vec![i32::MAX; n * k];
        let mut cnt = vec![0i32; n];
        for (i, x) in p.rows.iter().enumerate() {
            let s = x.2.as_ref().expect("all rows selected");
            idx[i * k..i * k + s.len()].copy_from_slice(s);
            cnt[i] = s.len() as i32;
        }
        (up_i32(dev, vec![n, k], &idx), up_i32(dev, vec![n], &cnt))
    });
    let sel = sel_t.as_ref().map(|(a, b)| (a, b));
    let want = reference(p, scale);
    out.fill_bytes(0xFF).expect("poison");
    mla_attend(&q, &cache, &batch, sel, p.r, scale, &out).expect("attend");
    check(&format!("{what} {dt}"), &out.to_f32_vec().expect("read"), &want, if dt == DType::F32 { TOL_F32 } else { TOL_ATTEND });
}

fn problem(r: &mut impl Rng, nh: usize, rr: usize, dr: usize, lens: &[usize], rows_per_seq: usize, select: bool) -> Attend {
    let w = rr + dr;
    let (bt, mp, pages) = paging(r, lens);
    let cache = rvec(r, pages * PAGE * w, 0.05, 1.0);
    let mut rows = Vec::new();
    for (b, &l) in lens.iter().enumerate() {
        for pos in l.saturating_sub(rows_per_seq)..l {
            let sel = select.then(|| {
                let mut all: Vec<i32> = (0..=pos as i32).collect();
                all.shuffle(r);
                let c = r.random_range(1..=all.len().min(40));
                let mut s = all[..c].to_vec();
                s.sort_unstable();
                s
            });
            rows.push((b, pos, sel));
        }
    }
    let q = rvec(r, rows.len() * nh * w, 0.05, 1.0);
    Attend { nh, r: rr, w, bt, mp, cache, rows, q }
}

#[test]
fn attend_dense_and_selected_tiny_and_wide() {
    let Some(dev) = device("attend_dense_and_selected_tiny_and_wide") else { return };
    let mut r = rng("attend_dense_and_selected_tiny_and_wide");
    // The 1000-long sequence makes the launcher split the keys (combine path) at tiny dims too.
    let lens = [1usize, 64, 65, 200, 130, 1000];
    for &(nh, rr, dr) in &[(3usize, 32usize, 8usize), (5, 520, 16), (2, 1040, 8)] {
        let scale = 1.0 / ((rr / 4 + dr) as f32).sqrt();
        for rows_per_seq in [1usize, 7] {
            for select in [false, true] {
                let p = problem(&mut r, nh, rr, dr, &lens, rows_per_seq, select);
                run_attend(&dev, &p, scale, &format!("nh={nh} r={rr} dr={dr} rows/seq={rows_per_seq} sel={select}"));
            }
        }
    }
}

/// The reference precision: F32 q, cache and out (the plain f32 attend), dense and selected,
/// one and several rows per sequence, at tiny, real and wide latent widths.
#[test]
fn attend_f32_reference_precision() {
    let Some(dev) = device("attend_f32_reference_precision") else { return };
    let mut r = rng("attend_f32_reference_precision");
    for &(nh, rr, dr, lens) in &[(3usize, 32usize, 8usize, &[1usize, 64, 200][..]), (4, 512, 64, &[1, 300]), (2, 1040, 8, &[130])] {
        let scale = 1.0 / ((rr / 4 + dr) as f32).sqrt();
        for (rows_per_seq, select) in [(1usize, false), (5, false), (1, true), (5, true)] {
            let p = problem(&mut r, nh, rr, dr, lens, rows_per_seq, select);
            run_attend_as(&dev, &p, scale, &format!("nh={nh} r={rr} dr={dr} rows/seq={rows_per_seq} sel={select}"), DType::F32);
        }
    }
}

#[test]
fn attend_real_dims() {
    let Some(dev) = device("attend_real_dims") else { return };
    let mut r = rng("attend_real_dims");
    let (nh, rr, dr) = (96usize, 512usize, 64usize);
    let scale = 1.0 / 192f32.sqrt();
    // Decode: one row per sequence (splits + combine), lengths crossing pages.
    let p = problem(&mut r, nh, rr, dr, &[1, 100, 4099], 1, false);
    run_attend(&dev, &p, scale, "real decode lens [1,100,4099]");
    let p = problem(&mut r, nh, rr, dr, &[1, 3000], 1, true);
    run_attend(&dev, &p, scale, "real decode selected");
    // Prefill of one sequence: 96 rows x 6 head groups fill the GPU (one split, direct write).
    let p = problem(&mut r, nh, rr, dr, &[96], 96, false);
    run_attend(&dev, &p, scale, "real prefill 96 rows");
}

#[test]
fn attend_decode_timing() {
    let Some(dev) = device("attend_decode_timing") else { return };
    let mut r = rng("attend_decode_timing");
    let (nh, rr, dr) = (96usize, 512usize, 64usize);
    let w = rr + dr;
    let pattern = rvec(&mut r, 4099 * w, 0.05, 1.0);
    // (sequences, context, rows per sequence): decode at batch 1 and 64, and a 4096-row prefill.
    for (b, ctx, rows) in [(1usize, 4096usize, 1usize), (1, 131072, 1), (64, 4096, 1), (1, 4096, 4096)] {
        let pages_per = ctx / PAGE;
        let pages = b * pages_per;
        let cache_v: Vec<bf16> = (0..pages * PAGE * w).map(|i| bf16::from_f32(pattern[i % pattern.len()])).collect();
        let cache = CudaTensor::from_bf16(&dev, vec![pages, PAGE, w], &cache_v).expect("cache");
        let bt: Vec<i32> = (0..pages as i32).rev().collect();
        let n = b * rows;
        let rs: Vec<i32> = (0..n).map(|i| (i / rows) as i32).collect();
        let rp: Vec<i32> = (0..n).map(|i| (ctx - rows + i % rows) as i32).collect();
        let (btt, rst, rpt) = (up_i32(&dev, vec![b, pages_per], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let qv: Vec<f32> = (0..n * nh * w).map(|i| pattern[(i * 7 + 3) % pattern.len()]).collect();
        let q = up(&dev, DType::BF16, vec![n, nh, w], &qv);
        let out = poisoned(&dev, DType::BF16, vec![n, nh, rr]);
        let us = time_attend(&dev, &q, &cache, &batch, rr, &out, if rows > 1 { 3 } else { 20 });
        let gbs = (pages * PAGE * w * 2) as f64 / (us * 1e-6) / 1e9;
        say(&format!("  TIMING mla_attend nh=96 r=512 dr=64: {b} seq x {rows} rows, ctx {ctx}: {us:.1} us ({gbs:.0} GB/s of cache)"));
    }
}

#[test]
fn strided_batched_gemm_absorb_and_unabsorb() {
    let Some(dev) = device("strided_batched_gemm_absorb_and_unabsorb") else { return };
    let mut r = rng("strided_batched_gemm_absorb_and_unabsorb");
    for &(n, nh, dn, dv, rr, dr) in &[(5usize, 3usize, 16usize, 16usize, 32usize, 8usize), (37, 8, 128, 128, 512, 64)] {
        let q = rvec(&mut r, n * nh * (dn + dr), 0.05, 1.0); // [N, nh, dn+dr]
        let kvb = rvec(&mut r, nh * (dn + dv) * rr, 0.01, 0.2); // [nh*(dn+dv), r]
        let o_lat = rvec(&mut r, n * nh * rr, 0.05, 1.0); // [N, nh, r]
        let (qt, kt, ot) = (
            up(&dev, DType::BF16, vec![n, nh, dn + dr], &q),
            up(&dev, DType::BF16, vec![nh * (dn + dv), rr], &kvb),
            up(&dev, DType::BF16, vec![n, nh, rr], &o_lat),
        );
        // Absorb: q_abs[:, h, :r] = q_nope_h [N, dn] · W_uk_h [dn, r].
        let mut want = vec![0f32; n * nh * rr];
        for i in 0..n {
            for h in 0..nh {
                for j in 0..dn {
                    let qv = q[(i * nh + h) * (dn + dr) + j];
                    let wr = &kvb[(h * (dn + dv) + j) * rr..][..rr];
                    want[(i * nh + h) * rr..][..rr].iter_mut().zip(wr).for_each(|(a, &b)| *a += qv * b);
                }
            }
        }
        for out_dt in [DType::BF16, DType::F32] {
            let c = poisoned(&dev, out_dt, vec![n, nh, rr + dr]);
            gemm_strided_batched(
                &dev,
                n,
                rr,
                dn,
                nh,
                Strided { ptr: qt.ptr(), ld: nh * (dn + dr), stride: dn + dr },
                Strided { ptr: kt.ptr(), ld: rr, stride: (dn + dv) * rr },
                Layout::B,
                Strided { ptr: c.ptr(), ld: nh * (rr + dr), stride: rr + dr },
                DType::BF16,
                out_dt,
            )
            .expect("absorb gemm");
            let got_all = c.to_f32_vec().expect("read");
            let got: Vec<f32> = (0..n * nh).flat_map(|ih| got_all[ih * (rr + dr)..][..rr].to_vec()).collect();
            let tol = if out_dt == DType::F32 { 1e-5 } else { 5e-3 };
            check(&format!("absorb N={n} nh={nh} dn={dn} r={rr} -> {out_dt}"), &got, &want, tol);
            // The q_pe columns were not touched (still NaN).
            assert!((0..n * nh).all(|ih| got_all[ih * (rr + dr) + rr].is_nan()), "absorb wrote outside its view");
        }
        // Un-absorb: o[:, h, :] = o_lat_h [N, r] · W_uv_hᵀ (W_uv_h [dv, r]).
        let mut want = vec![0f32; n * nh * dv];
        for i in 0..n {
            for h in 0..nh {
                let ol = &o_lat[(i * nh + h) * rr..][..rr];
                for j in 0..dv {
                    let wr = &kvb[(h * (dn + dv) + dn + j) * rr..][..rr];
                    want[(i * nh + h) * dv + j] = ol.iter().zip(wr).map(|(a, b)| a * b).sum();
                }
            }
        }
        for out_dt in [DType::BF16, DType::F32] {
            let c = poisoned(&dev, out_dt, vec![n, nh, dv]);
            gemm_strided_batched(
                &dev,
                n,
                dv,
                rr,
                nh,
                Strided { ptr: ot.ptr(), ld: nh * rr, stride: rr },
                Strided { ptr: kt.ptr() + (dn * rr * 2) as u64, ld: rr, stride: (dn + dv) * rr },
                Layout::BT,
                Strided { ptr: c.ptr(), ld: nh * dv, stride: dv },
                DType::BF16,
                out_dt,
            )
            .expect("unabsorb gemm");
            let tol = if out_dt == DType::F32 { 1e-5 } else { 5e-3 };
            check(&format!("un-absorb N={n} nh={nh} r={rr} dv={dv} -> {out_dt}"), &c.to_f32_vec().expect("read"), &want, tol);
        }
    }
}
