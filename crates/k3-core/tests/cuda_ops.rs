//! Op-parity suite for the CUDA path, in the spirit of llama.cpp's `test-backend-ops`: every
//! CUDA op against the CPU op of the same name (`kernels::cpu`, the oracle) on fresh random
//! non-zero inputs, several shapes including odd ones, compared by relative L2 error
//! ‖gpu − cpu‖ / ‖cpu‖ within the tolerances stated below. Outputs are poisoned with NaN
//! before each op, and a NaN anywhere fails, so an unwritten element cannot pass.
//!
//! Without a CUDA driver or GPU each test prints `skipped: no CUDA driver (...)` and returns
//! (CPU-only CI); with `K3_REQUIRE_CUDA=1` that case fails instead, so a GPU run cannot pass
//! by skipping. The random seed is printed; `K3_TEST_SEED=N` replays it.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, poisoned, rng, say, up};

use half::bf16;
use k3_core::cuda::blas::{self, Algo, Backend, GemmOptions, Layout};
use k3_core::cuda::pinned::Staging;
use k3_core::cuda::{self, bench, ops, CudaDevice, CudaTensor};
use k3_core::kernels::cpu::{act, matmul, norm};
use k3_core::{CoreError, DType, Tensor};
use rand::Rng;

/// f32 storage: only rounding-order differences between CPU and GPU.
const TOL_F32: f64 = 1e-5;
/// bf16 storage: the output is rounded to bf16 (at most half an ulp, 2⁻⁸ relative, per
/// element; ≈ 1.6e-3 relative L2 on random data), and an f32 result a hair either side of a
/// rounding boundary can land one ulp (2⁻⁷) apart: 8e-3 bounds both; a wrong kernel is ≫ 1e-2.
const TOL_BF16: f64 = 8e-3;
/// Row reductions in f32 (softmax, RMSNorm) against the CPU oracle: the CPU sums a row
/// sequentially in f32, whose own error grows about linearly with d (5.6e-5 measured at
/// d = 65536 on the H200, 1.5e-6 at d = 1000); the GPU's tree sum is far closer to exact, which the f64 check below ([`TOL_F32`] against an f64 reference)
/// pins down independently of row length.
fn tol_f32_rows(d: usize) -> f64 {
    TOL_F32.max(2e-9 * d as f64)
}
/// bf16 GEMM inputs with an f32 output: accumulation order only.
const TOL_GEMM_BF16_F32OUT: f64 = 1e-4;

/// Values with |v| in [lo, hi), random sign: never zero.
fn rand_vec(r: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi) * if r.random::<bool>() { 1.0 } else { -1.0 }).collect()
}

fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

fn tol_for(d: DType) -> f64 {
    if d == DType::F32 {
        TOL_F32
    } else {
        TOL_BF16
    }
}

/// Softmax rows of width `d` computed in f64 (all -inf row -> zeros), rounded to f32.
fn softmax_f64(x: &[f32], d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v as f64));
        if m == f64::NEG_INFINITY {
            out.extend(std::iter::repeat_n(0f32, d));
            continue;
        }
        let s: f64 = row.iter().map(|&v| (v as f64 - m).exp()).sum();
        out.extend(row.iter().map(|&v| ((v as f64 - m).exp() / s) as f32));
    }
    out
}

/// RMSNorm computed in f64, rounded to f32.
fn rms_norm_f64(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| (v as f64 * inv * g as f64) as f32));
    }
    out
}

#[test]
fn no_driver_is_an_error_not_a_panic() {
    let libs = cuda::library_report();
    match cuda::probe() {
        Ok(n) => {
            assert!(n >= 1);
            let e = CudaDevice::new(n + 7).unwrap_err();
            assert!(matches!(e, CoreError::CudaUnavailable(_)), "{e}");
        }
        Err(CoreError::CudaUnavailable(why)) => {
            assert!(why.contains("libcuda") || why.contains("GPU") || why.contains("cuInit"), "{why}");
            assert!(matches!(CudaDevice::new(0), Err(CoreError::CudaUnavailable(_))));
            say(&format!("no_driver_is_an_error_not_a_panic: no CUDA here ({why}); libraries {libs:?}"));
        }
        Err(e) => panic!("probe returned the wrong error kind: {e}"),
    }
}

#[test]
fn device_info_copies_and_allocator() {
    let Some(dev) = device("device_info_copies_and_allocator") else { return };
    say(&format!("device: {}", dev.info()));
    let mut r = rng("device_info_copies_and_allocator");
    for n in [1usize, 3, 1000, 65_537] {
        let v = rand_vec(&mut r, n, 0.1, 10.0);
        let t = CudaTensor::from_f32(&dev, vec![n], &v).unwrap();
        assert_eq!(t.to_f32_vec().unwrap(), v, "host->device->host round trip, n={n}");
        let u = poisoned(&dev, DType::F32, vec![n]);
        u.copy_from(&t).unwrap();
        assert_eq!(u.to_host().unwrap().as_f32().unwrap().to_vec(), v, "device->device copy, n={n}");
        let h = Tensor::from_f32(vec![n], &v).unwrap();
        let w = CudaTensor::from_host(&dev, &h).unwrap();
        assert_eq!(w.to_bytes().unwrap(), h.bytes());
    }
    let z = CudaTensor::zeros(&dev, DType::BF16, vec![3, 5]).unwrap();
    assert!(z.to_f32_vec().unwrap().iter().all(|&v| v == 0.0));
    assert!(z.reshape(vec![4, 4]).is_err());
    assert!(z.write_bytes(&[0u8; 3]).is_err());
    // Caching allocator: a freed block is reused without a new driver allocation.
    let size = 3 << 20;
    drop(CudaTensor::uninit(&dev, DType::U8, vec![size]).unwrap());
    let before = dev.alloc_stats();
    let again = CudaTensor::uninit(&dev, DType::U8, vec![size]).unwrap();
    let after = dev.alloc_stats();
    assert_eq!(after.driver_allocs, before.driver_allocs, "same-size allocation should come from the cache");
    assert!(after.cache_hits > before.cache_hits);
    drop(again);
    // Streams and events order work across streams.
    let side = dev.new_stream().unwrap();
    let ev = dev.new_event(false).unwrap();
    ev.record(&dev.stream()).unwrap();
    side.wait(&ev).unwrap();
    side.synchronize().unwrap();
}

/// `Staging` (page-locked bounce buffer) moves uneven host slices into a tensor and back
/// through several buffer-fulls each way, bit for bit; `read_f32` reads a range; a size
/// mismatch is an error.
#[test]
fn staged_copies_and_ranges_round_trip() {
    let test = "staged_copies_and_ranges_round_trip";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    let lens = [0usize, 3, 262_144, 700_001, 1];
    let parts: Vec<Vec<f32>> = lens.iter().map(|&n| rand_vec(&mut r, n, -1.0, 1.0)).collect();
    let all = parts.concat();
    let t = poisoned(&dev, DType::F32, vec![all.len()]);
    let mut st = Staging::new(&dev, 1).unwrap();
    st.upload(&t, &parts.iter().map(|p| bytemuck::cast_slice::<f32, u8>(p)).collect::<Vec<_>>()).unwrap();
    assert_eq!(t.to_f32_vec().unwrap(), all, "upload through a 1 MiB buffer");
    let mut back: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
    st.download(&t, &mut back.iter_mut().map(|v| bytemuck::cast_slice_mut::<f32, u8>(v)).collect::<Vec<_>>()).unwrap();
    assert_eq!(back, parts, "download through a 1 MiB buffer");
    assert_eq!(t.read_f32(3, 5).unwrap(), all[3..8]);
    assert!(t.read_f32(all.len() - 1, 2).is_err());
    assert!(st.upload(&t, &[&[0u8; 4]]).is_err());
}

#[test]
fn rms_norm_parity() {
    let Some(dev) = device("rms_norm_parity") else { return };
    let mut r = rng("rms_norm_parity");
    for dtype in [DType::F32, DType::BF16] {
        for (rows, d) in [(1usize, 1usize), (3, 7), (5, 128), (17, 1000), (2, 4097), (64, 7168)] {
            let mut x = rand_vec(&mut r, rows * d, 0.05, 3.0);
            let mut w = rand_vec(&mut r, d, 0.5, 1.5);
            if dtype == DType::BF16 {
                x = round_bf16(&x);
                w = round_bf16(&w);
            }
            let eps = 1e-6;
            let mut want = vec![0f32; rows * d];
            norm::rms_norm(&x, &w, eps, &mut want);
            let (gx, gw) = (up(&dev, dtype, vec![rows, d], &x), up(&dev, dtype, vec![d], &w));
            let out = poisoned(&dev, dtype, vec![rows, d]);
            ops::rms_norm(&gx, &gw, eps, &out).unwrap();
            let tol = if dtype == DType::F32 { tol_f32_rows(d) } else { TOL_BF16 };
            let got = out.to_f32_vec().unwrap();
            check(&format!("rms_norm {dtype} [{rows},{d}]"), &got, &want, tol);
            if dtype == DType::F32 {
                check(&format!("rms_norm {dtype} [{rows},{d}] vs f64"), &got, &rms_norm_f64(&x, &w, eps), TOL_F32);
            }
            // In place.
            ops::rms_norm(&gx, &gw, eps, &gx).unwrap();
            check(&format!("rms_norm in place {dtype} [{rows},{d}]"), &gx.to_f32_vec().unwrap(), &want, tol);
        }
    }
}

#[test]
fn sigmoid_silu_parity() {
    let Some(dev) = device("sigmoid_silu_parity") else { return };
    let mut r = rng("sigmoid_silu_parity");
    for dtype in [DType::F32, DType::BF16] {
        for n in [1usize, 7, 1000, 65_537, (1 << 20) + 3] {
            let mut x = rand_vec(&mut r, n, 0.01, 12.0);
            if dtype == DType::BF16 {
                x = round_bf16(&x);
            }
            let gx = up(&dev, dtype, vec![n], &x);
            let out = poisoned(&dev, dtype, vec![n]);
            ops::sigmoid(&gx, &out).unwrap();
            let want: Vec<f32> = x.iter().map(|&v| act::sigmoid(v)).collect();
            check(&format!("sigmoid {dtype} [{n}]"), &out.to_f32_vec().unwrap(), &want, tol_for(dtype));
            out.fill_bytes(0xFF).unwrap();
            ops::silu(&gx, &out).unwrap();
            let want: Vec<f32> = x.iter().map(|&v| act::silu(v)).collect();
            check(&format!("silu {dtype} [{n}]"), &out.to_f32_vec().unwrap(), &want, tol_for(dtype));
        }
    }
}

#[test]
fn situ_glu_parity() {
    let Some(dev) = device("situ_glu_parity") else { return };
    let mut r = rng("situ_glu_parity");
    let (beta, lin) = (4.0f32, 25.0f32);
    for dtype in [DType::F32, DType::BF16] {
        for shape in [vec![1usize], vec![3, 5], vec![7, 2048], vec![33, 3001]] {
            let n: usize = shape.iter().product();
            // Gate up to ±16 and up to ±80 exercise both soft caps (β = 4, λ = 25).
            let (mut g, mut u) = (rand_vec(&mut r, n, 0.01, 16.0), rand_vec(&mut r, n, 0.01, 80.0));
            if dtype == DType::BF16 {
                g = round_bf16(&g);
                u = round_bf16(&u);
            }
            let mut want = vec![0f32; n];
            act::situ_glu_slice(&g, &u, &mut want, beta, lin);
            let (gg, gu) = (up(&dev, dtype, shape.clone(), &g), up(&dev, dtype, shape.clone(), &u));
            let out = poisoned(&dev, dtype, shape.clone());
            ops::situ_glu(&gg, &gu, beta, lin, &out).unwrap();
            check(&format!("situ_glu {dtype} {shape:?}"), &out.to_f32_vec().unwrap(), &want, tol_for(dtype));
        }
    }
}

#[test]
fn softmax_parity() {
    let Some(dev) = device("softmax_parity") else { return };
    let mut r = rng("softmax_parity");
    for dtype in [DType::F32, DType::BF16] {
        for (rows, d) in [(1usize, 1usize), (3, 5), (7, 1000), (32, 4099), (4, 65_536)] {
            let mut x = rand_vec(&mut r, rows * d, 0.01, 8.0);
            if rows > 1 {
                // One row entirely -inf (becomes zeros) and one with a few -inf entries.
                x[..d].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
                x[d] = f32::NEG_INFINITY;
            }
            if dtype == DType::BF16 {
                x = round_bf16(&x);
            }
            let mut want = x.clone();
            want.chunks_exact_mut(d).for_each(act::softmax_inplace);
            let gx = up(&dev, dtype, vec![rows, d], &x);
            let out = poisoned(&dev, dtype, vec![rows, d]);
            ops::softmax(&gx, &out).unwrap();
            let got = out.to_f32_vec().unwrap();
            let tol = if dtype == DType::F32 { tol_f32_rows(d) } else { TOL_BF16 };
            check(&format!("softmax {dtype} [{rows},{d}]"), &got, &want, tol);
            if dtype == DType::F32 {
                check(&format!("softmax {dtype} [{rows},{d}] vs f64"), &got, &softmax_f64(&x, d), TOL_F32);
            }
            if rows > 1 {
                assert!(got[..d].iter().all(|&v| v == 0.0), "an all -inf row must become zeros");
            }
            ops::softmax(&gx, &gx).unwrap();
            check(&format!("softmax in place {dtype} [{rows},{d}]"), &gx.to_f32_vec().unwrap(), &want, tol);
        }
    }
}

#[test]
fn cast_is_round_to_nearest_even() {
    let Some(dev) = device("cast_is_round_to_nearest_even") else { return };
    let mut r = rng("cast_is_round_to_nearest_even");
    let n = 100_003;
    let mut x = rand_vec(&mut r, n, 1e-3, 1e4);
    x[0] = f32::INFINITY;
    x[1] = f32::NEG_INFINITY;
    x[2] = 1.0 + 1.0 / 256.0; // exactly halfway between two bf16 values: ties to even
    let gx = CudaTensor::from_f32(&dev, vec![n], &x).unwrap();
    let gb = poisoned(&dev, DType::BF16, vec![n]);
    ops::cast(&gx, &gb).unwrap();
    let got: Vec<u16> = bytemuck::pod_collect_to_vec(&gb.to_bytes().unwrap());
    let want: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    assert_eq!(got, want, "f32 -> bf16 must match half::bf16::from_f32 bit for bit");
    let back = poisoned(&dev, DType::F32, vec![n]);
    ops::cast(&gb, &back).unwrap();
    assert_eq!(back.to_f32_vec().unwrap(), round_bf16(&x));
    assert!(ops::cast(&gx, &CudaTensor::uninit(&dev, DType::U8, vec![n]).unwrap()).is_err());
}

/// CPU reference `x[M,K] · w[N,K]ᵀ` through `kernels::cpu::matmul::linear`.
fn cpu_linear(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let wm = matmul::Matrix::dense(Tensor::from_f32(vec![n, k], w).unwrap()).unwrap();
    let mut out = vec![0f32; m * n];
    matmul::linear(x, m, &wm, &mut out).unwrap();
    out
}

#[test]
fn gemm_parity() {
    let Some(dev) = device("gemm_parity") else { return };
    let mut r = rng("gemm_parity");
    let shapes = [(1usize, 67usize, 96usize), (5, 130, 200), (70, 257, 333), (128, 512, 1024), (33, 1000, 7168)];
    let cases = [(DType::BF16, DType::F32, TOL_GEMM_BF16_F32OUT), (DType::BF16, DType::BF16, TOL_BF16), (DType::F32, DType::F32, TOL_F32)];
    let opts = [
        GemmOptions { backend: Backend::Lt, algo: Algo::Auto },
        GemmOptions { backend: Backend::Lt, algo: Algo::Tuned },
        GemmOptions { backend: Backend::Cublas, algo: Algo::Auto },
    ];
    for &(m, n, k) in &shapes {
        for &(input, output, tol) in &cases {
            let mut x = rand_vec(&mut r, m * k, 0.05, 1.0);
            let mut w = rand_vec(&mut r, n * k, 0.05, 1.0);
            if input == DType::BF16 {
                x = round_bf16(&x);
                w = round_bf16(&w);
            }
            let want = cpu_linear(&x, &w, m, n, k);
            // w transposed to [K, N] for the `a · b` layout.
            let mut wt = vec![0f32; k * n];
            for (j, row) in w.chunks_exact(k).enumerate() {
                for (kk, &v) in row.iter().enumerate() {
                    wt[kk * n + j] = v;
                }
            }
            let gx = up(&dev, input, vec![m, k], &x);
            let gw = up(&dev, input, vec![n, k], &w);
            let gwt = up(&dev, input, vec![k, n], &wt);
            for o in opts {
                for (layout, b) in [(Layout::BT, &gw), (Layout::B, &gwt)] {
                    let out = poisoned(&dev, output, vec![m, n]);
                    blas::gemm(&gx, b, &out, layout, o).unwrap();
                    let what = format!("gemm {input}->{output} {layout:?} {:?}/{:?} M={m} N={n} K={k}", o.backend, o.algo);
                    check(&what, &out.to_f32_vec().unwrap(), &want, tol);
                }
            }
        }
    }
    // Leading batch dims on x flatten into M.
    let x = round_bf16(&rand_vec(&mut r, 2 * 3 * 64, 0.05, 1.0));
    let w = round_bf16(&rand_vec(&mut r, 40 * 64, 0.05, 1.0));
    let out = poisoned(&dev, DType::F32, vec![2, 3, 40]);
    blas::linear(&up(&dev, DType::BF16, vec![2, 3, 64], &x), &up(&dev, DType::BF16, vec![40, 64], &w), &out).unwrap();
    check("linear bf16->f32 x [2,3,64] · w [40,64]T", &out.to_f32_vec().unwrap(), &cpu_linear(&x, &w, 6, 40, 64), TOL_GEMM_BF16_F32OUT);
}

/// `scatter_rows`: rows land in the slots their index names, bit for bit (NaN payloads too),
/// rows indexed outside the destination are skipped and every other row is left alone; 4-byte
/// words (F32 rows) and 2-byte words (BF16 rows of an odd width).
#[test]
fn scatter_rows_moves_rows_to_their_slots() {
    let test = "scatter_rows_moves_rows_to_their_slots";
    let Some(dev) = device(test) else { return };
    let mut r = rng(test);
    for (dtype, width) in [(DType::F32, 3 * 1031), (DType::BF16, 7)] {
        let bytes = |n: usize, r: &mut rand::rngs::StdRng| -> Vec<u8> { (0..n * width * dtype.size_in_bytes()).map(|_| r.random()).collect() };
        let (dst0, src) = (bytes(6, &mut r), bytes(4, &mut r));
        let idx = [4i32, -1, 0, 6];
        let dst = CudaTensor::from_pod(&dev, dtype, vec![6, width], &dst0).unwrap();
        let s = CudaTensor::from_pod(&dev, dtype, vec![4, width], &src).unwrap();
        ops::scatter_rows(&s, &CudaTensor::from_pod(&dev, DType::I32, vec![4], &idx).unwrap(), &dst).unwrap();
        let row = width * dtype.size_in_bytes();
        let mut want = dst0.clone();
        for (i, &j) in idx.iter().enumerate() {
            if (0..6).contains(&j) {
                want[j as usize * row..][..row].copy_from_slice(&src[i * row..][..row]);
            }
        }
        assert!(dst.to_bytes().unwrap() == want, "{dtype}: scatter_rows moved the wrong bytes");
        let bad = CudaTensor::from_pod(&dev, DType::I32, vec![3], &idx[..3]).unwrap();
        assert!(ops::scatter_rows(&s, &bad, &dst).is_err(), "{dtype}: 3 indices for 4 rows");
        say(&format!("  scatter_rows {dtype} rows of {width}: indices {idx:?} into 6 rows, bit for bit"));
    }
}

/// `gemm_add` (`out += a · op(b)`, cuBLAS β = 1: the vision tower's residual adds) against the
/// CPU product plus what `out` held, every dtype pair and both layouts; `out` starts from random
/// values, so a GEMM that overwrites instead of adding fails by O(1).
#[test]
fn gemm_add_adds_the_product() {
    let Some(dev) = device("gemm_add_adds_the_product") else { return };
    let mut r = rng("gemm_add_adds_the_product");
    let cases = [(DType::BF16, DType::F32, TOL_GEMM_BF16_F32OUT), (DType::BF16, DType::BF16, TOL_BF16), (DType::F32, DType::F32, TOL_F32)];
    for (m, n, k) in [(5usize, 130usize, 200usize), (70, 257, 333)] {
        for &(input, output, tol) in &cases {
            let (x, w) = (round_bf16(&rand_vec(&mut r, m * k, 0.05, 1.0)), round_bf16(&rand_vec(&mut r, n * k, 0.05, 1.0)));
            let c0 = round_bf16(&rand_vec(&mut r, m * n, 1.0, 4.0));
            let want: Vec<f32> = cpu_linear(&x, &w, m, n, k).iter().zip(&c0).map(|(p, c)| p + c).collect();
            let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
            let gx = up(&dev, input, vec![m, k], &x);
            for (layout, b) in [(Layout::BT, up(&dev, input, vec![n, k], &w)), (Layout::B, up(&dev, input, vec![k, n], &wt))] {
                let out = up(&dev, output, vec![m, n], &c0);
                blas::gemm_add(&gx, &b, &out, layout).unwrap();
                check(&format!("gemm_add {input}->{output} {layout:?} M={m} N={n} K={k}"), &out.to_f32_vec().unwrap(), &want, tol);
            }
        }
    }
    let f = |shape: Vec<usize>| CudaTensor::zeros(&dev, DType::F32, shape).unwrap();
    assert!(blas::gemm_add(&f(vec![2, 8]), &f(vec![3, 7]), &f(vec![2, 3]), Layout::BT).is_err());
}

#[test]
fn ops_reject_bad_inputs() {
    let Some(dev) = device("ops_reject_bad_inputs") else { return };
    let f = |shape: Vec<usize>| CudaTensor::zeros(&dev, DType::F32, shape).unwrap();
    let b = |shape: Vec<usize>| CudaTensor::zeros(&dev, DType::BF16, shape).unwrap();
    assert!(ops::rms_norm(&f(vec![2, 8]), &f(vec![7]), 1e-6, &f(vec![2, 8])).is_err());
    assert!(ops::rms_norm(&f(vec![2, 8]), &b(vec![8]), 1e-6, &f(vec![2, 8])).is_err());
    assert!(ops::silu(&f(vec![4]), &b(vec![4])).is_err());
    assert!(ops::situ_glu(&f(vec![4]), &f(vec![5]), 4.0, 25.0, &f(vec![4])).is_err());
    assert!(ops::softmax(&CudaTensor::zeros(&dev, DType::U8, vec![4]).unwrap(), &CudaTensor::zeros(&dev, DType::U8, vec![4]).unwrap()).is_err());
    assert!(blas::linear(&b(vec![3, 8]), &b(vec![5, 9]), &f(vec![3, 5])).is_err());
    assert!(blas::linear(&b(vec![3, 8]), &f(vec![5, 8]), &f(vec![3, 5])).is_err());
    assert!(blas::matmul(&f(vec![3, 8]), &f(vec![8, 5]), &f(vec![3, 4])).is_err());
}

#[test]
fn bench_smoke() {
    let Some(dev) = device("bench_smoke") else { return };
    for (op, dims) in [("gemm", vec![256usize, 384, 512]), ("copy", vec![1 << 20]), ("rmsnorm", vec![64, 1000])] {
        let spec = bench::BenchOp::from_cli(op, &dims).unwrap();
        let rep = bench::bench_op(&dev, &spec, 2, 5).unwrap();
        say(&format!("  {rep}"));
        assert_eq!(rep.repeats, 5);
        assert!(rep.median_ms > 0.0 && rep.median_ms.is_finite() && rep.min_ms <= rep.median_ms && rep.median_ms <= rep.max_ms, "{rep}");
    }
}
