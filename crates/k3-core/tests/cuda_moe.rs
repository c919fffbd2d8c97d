//! Parity suite for the CUDA routed-MoE kernels (`cuda::moe`, text-backbone §7.2–7.5): the
//! router top-k against a CPU copy of k3-model's `Moe::route` (random logits, heavy ties,
//! renormalize on and off), and `experts_forward` against an f32 CPU reference of
//! `Moe::forward`'s routed part (grouped experts, dot products and SiTU-GLU from `kernels::cpu`, weighted
//! sum, routed scaling), MXFP4 weights decoded with `kernels::cpu::mxfp4::decode`.
//!
//! Inputs are fresh random values (seed printed; `K3_TEST_SEED=N` replays), z bf16-representable;
//! routings include an expert chosen by every token and experts chosen by none; outputs are
//! poisoned with NaN first. Tolerances: router ids exact, weights relative L2 1e-5 (device
//! `expf`); experts device-grouped path (T ≤ `mma_max_tokens`) relative L2 5e-3: the tensor-core path (T ≥ 2)
//! rounds the SiTU-GLU intermediate to bf16 (the W2 operand; measured 1.2e-3..2.1e-3), T = 1
//! runs the CUDA-core GEMV (f32 intermediate; `K3_MOE_DECODE=gemv|mma` forces one path for
//! every T); prefill path (above it, cuBLAS with the SiTU-GLU intermediate rounded to bf16;
//! grouped: the GEMM outputs too) 5e-3; `experts_mid` runs T = 200 and 700 through both (the cut
//! set below and above it), the prefill path grouped (MXFP4 in several chunks) and looped, and the
//! overlapped loop (MXFP4 dequantized on a side stream) gives the serial loop's bits, also with
//! either stream delayed so that a missing event wait would show. The decode path is
//! also captured into a CUDA graph and replayed (not under `K3_CUDA_SYNC=1`, whose per-launch
//! sync cannot be captured). Without a GPU every test prints
//! `skipped: no CUDA driver (...)` and passes; with `K3_REQUIRE_CUDA=1` that case fails.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{check, device, poisoned, rng, say};

use half::bf16;
use k3_core::cuda::moe::{self, ExpertFormat, ExpertWeights, PrefillMode};
use k3_core::cuda::{kda, CudaDevice, CudaTensor};
use k3_core::kernels::cpu::act::{sigmoid, situ_glu};
use k3_core::kernels::cpu::matmul::dot;
use k3_core::kernels::cpu::mxfp4;
use k3_core::DType;
use rand::Rng;

const TOL_DECODE: f64 = 5e-3;
const TOL_PREFILL: f64 = 5e-3;
const BETA: f32 = 4.0;
const LBETA: f32 = 25.0;

/// CPU copy of `Moe::route` for one token row.
fn route_ref(row: &[f32], bias: &[f32], k: usize, renorm: bool) -> Vec<(usize, f32)> {
    let s: Vec<f32> = row.iter().map(|&v| sigmoid(v)).collect();
    let mut idx: Vec<usize> = (0..row.len()).collect();
    let key = |i: usize| s[i] + bias[i];
    idx.sort_by(|&a, &b| key(b).partial_cmp(&key(a)).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    let sum: f32 = idx.iter().map(|&i| s[i]).sum();
    idx.into_iter().map(|i| (i, if renorm { s[i] / sum } else { s[i] })).collect()
}

fn run_route(dev: &CudaDevice, what: &str, logits: &[f32], bias: &[f32], t: usize, e: usize, k: usize, renorm: bool) {
    let lg = CudaTensor::from_f32(dev, vec![t, e], logits).unwrap();
    let bs = CudaTensor::from_f32(dev, vec![e], bias).unwrap();
    let ids = poisoned(dev, DType::I32, vec![t, k]);
    let wts = poisoned(dev, DType::F32, vec![t, k]);
    moe::route(&lg, &bs, k, renorm, &ids, &wts).unwrap();
    let got_ids: Vec<i32> = bytemuck::pod_collect_to_vec(&ids.to_bytes().unwrap());
    let got_w = wts.to_f32_vec().unwrap();
    let mut want_w = Vec::new();
    for tok in 0..t {
        let r = route_ref(&logits[tok * e..(tok + 1) * e], bias, k, renorm);
        for (j, &(id, w)) in r.iter().enumerate() {
            assert_eq!(got_ids[tok * k + j], id as i32, "{what}: token {tok} slot {j}");
            want_w.push(w);
        }
    }
    check(&format!("{what} weights"), &got_w, &want_w, 1e-5);
}

#[test]
fn route_matches_cpu() {
    let Some(dev) = device("route_matches_cpu") else { return };
    let mut r = rng("route_matches_cpu");
    for &(t, e, k) in &[(1usize, 6usize, 2usize), (37, 64, 8), (5, 896, 16)] {
        let logits: Vec<f32> = (0..t * e).map(|_| r.random_range(-4.0f32..4.0)).collect();
        let bias: Vec<f32> = (0..e).map(|_| r.random_range(-0.5f32..0.5)).collect();
        for renorm in [true, false] {
            run_route(&dev, &format!("route T={t} E={e} k={k} renorm={renorm}"), &logits, &bias, t, e, k, renorm);
        }
        // Heavy ties: three logit values, equal bias -> ties broken by the lower id.
        let tied: Vec<f32> = (0..t * e).map(|_| [-1.0f32, 0.0, 1.0][r.random_range(0..3)]).collect();
        run_route(&dev, &format!("route ties T={t} E={e} k={k}"), &tied, &vec![0.25; e], t, e, k, true);
    }
}

/// One random expert layer: device weights plus their f32 decode `[E, 2F, L]`, `[E, L, F]`.
struct Layer {
    w: ExpertWeights,
    w13: Vec<f32>,
    w2: Vec<f32>,
}

fn mxfp4_matrix(r: &mut impl Rng, rows: usize, cols: usize, s_lo: u8) -> (Vec<u8>, Vec<u8>) {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.random()).collect();
    let scale: Vec<u8> = (0..rows * cols / 32).map(|_| r.random_range(s_lo..s_lo + 3)).collect();
    (packed, scale)
}

fn layer(dev: &CudaDevice, r: &mut impl Rng, format: ExpertFormat, e: usize, l: usize, f: usize) -> Layer {
    match format {
        ExpertFormat::Mxfp4 => {
            // Scales around 2^-5 .. 2^-3 keep |w·z| sums of order one.
            let (p13, s13) = mxfp4_matrix(r, e * 2 * f, l, 120);
            let (p2, s2) = mxfp4_matrix(r, e * l, f, 120);
            let w13 = mxfp4::decode(&p13, &s13, e * 2 * f, l).unwrap();
            let w2 = mxfp4::decode(&p2, &s2, e * l, f).unwrap();
            let u8t = |shape: Vec<usize>, v: &[u8]| CudaTensor::from_pod(dev, DType::U8, shape, v).unwrap();
            Layer {
                w: ExpertWeights {
                    format,
                    num_experts: e,
                    latent: l,
                    inter: f,
                    w13: u8t(vec![e, 2 * f, l / 2], &p13),
                    w13_scale: Some(u8t(vec![e, 2 * f, l / 32], &s13)),
                    w2: u8t(vec![e, l, f / 2], &p2),
                    w2_scale: Some(u8t(vec![e, l, f / 32], &s2)),
                },
                w13,
                w2,
            }
        }
        ExpertFormat::F32 => {
            let mut rv = |n: usize, a: f32| -> Vec<f32> { (0..n).map(|_| r.random_range(-a..a)).collect() };
            let w13 = rv(e * 2 * f * l, 2.0 / (l as f32).sqrt());
            let w2 = rv(e * l * f, 2.0 / (f as f32).sqrt());
            let b = |shape: Vec<usize>, v: &[f32]| CudaTensor::from_f32(dev, shape, v).unwrap();
            Layer {
                w: ExpertWeights {
                    format,
                    num_experts: e,
                    latent: l,
                    inter: f,
                    w13: b(vec![e, 2 * f, l], &w13),
                    w13_scale: None,
                    w2: b(vec![e, l, f], &w2),
                    w2_scale: None,
                },
                w13,
                w2,
            }
        }
        ExpertFormat::Bf16 => {
            let mut rv = |n: usize, a: f32| -> Vec<f32> { (0..n).map(|_| bf16::from_f32(r.random_range(-a..a)).to_f32()).collect() };
            let w13 = rv(e * 2 * f * l, 2.0 / (l as f32).sqrt());
            let w2 = rv(e * l * f, 2.0 / (f as f32).sqrt());
            let b = |shape: Vec<usize>, v: &[f32]| CudaTensor::from_bf16(dev, shape, &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
            Layer {
                w: ExpertWeights {
                    format,
                    num_experts: e,
                    latent: l,
                    inter: f,
                    w13: b(vec![e, 2 * f, l], &w13),
                    w13_scale: None,
                    w2: b(vec![e, l, f], &w2),
                    w2_scale: None,
                },
                w13,
                w2,
            }
        }
    }
}

/// f32 reference of the routed experts: grouped by expert like `Moe::forward`.
fn experts_ref(ly: &Layer, z: &[f32], ids: &[i32], wts: &[f32], t: usize, k: usize, scaling: f32) -> Vec<f32> {
    let (l, f) = (ly.w.latent, ly.w.inter);
    let mut out = vec![0f32; t * l];
    for e in 0..ly.w.num_experts {
        let w1 = &ly.w13[e * 2 * f * l..];
        let w2 = &ly.w2[e * l * f..];
        for tok in 0..t {
            for j in 0..k {
                if ids[tok * k + j] != e as i32 {
                    continue;
                }
                let zt = &z[tok * l..(tok + 1) * l];
                let a: Vec<f32> = (0..f).map(|r| situ_glu(dot(&w1[r * l..][..l], zt), dot(&w1[(f + r) * l..][..l], zt), BETA, LBETA)).collect();
                for (o, row) in out[tok * l..(tok + 1) * l].iter_mut().zip(w2.chunks_exact(f)) {
                    *o += wts[tok * k + j] * dot(row, &a);
                }
            }
        }
    }
    out.iter_mut().for_each(|v| *v *= scaling);
    out
}

/// Routing with expert 0 in every token's slot 0 and the last two experts never chosen.
fn routing(r: &mut impl Rng, t: usize, e: usize, k: usize) -> (Vec<i32>, Vec<f32>) {
    let mut ids = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen = vec![0i32];
        while chosen.len() < k {
            let c = r.random_range(1..(e - 2).max(2)) as i32;
            if !chosen.contains(&c) {
                chosen.push(c);
            }
        }
        ids.extend(chosen);
    }
    let wts = (0..t * k).map(|_| r.random_range(0.05f32..1.0)).collect();
    (ids, wts)
}

fn run_experts(dev: &CudaDevice, r: &mut impl Rng, format: ExpertFormat, e: usize, k: usize, l: usize, f: usize, ts: &[usize]) {
    let ly = layer(dev, r, format, e, l, f);
    for &t in ts {
        let z: Vec<f32> = (0..t * l).map(|_| bf16::from_f32(r.random_range(-2.0f32..2.0)).to_f32()).collect();
        let (ids, wts) = routing(r, t, e, k);
        let zd = CudaTensor::from_bf16(dev, vec![t, l], &z.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
        let idd = CudaTensor::from_pod(dev, DType::I32, vec![t, k], &ids).unwrap();
        let wd = CudaTensor::from_f32(dev, vec![t, k], &wts).unwrap();
        let out = poisoned(dev, DType::F32, vec![t, l]);
        let scaling = 2.5;
        moe::experts_forward(&zd, &idd, &wd, &ly.w, BETA, LBETA, scaling, &out).unwrap();
        let want = experts_ref(&ly, &z, &ids, &wts, t, k, scaling);
        let tol = if t > moe::mma_max_tokens(e, k) { TOL_PREFILL } else { TOL_DECODE };
        check(&format!("experts {format:?} E={e} k={k} L={l} F={f} T={t}"), &out.to_f32_vec().unwrap(), &want, tol);
        // Deterministic: a second call gives the same bits.
        let again = poisoned(dev, DType::F32, vec![t, l]);
        moe::experts_forward(&zd, &idd, &wd, &ly.w, BETA, LBETA, scaling, &again).unwrap();
        assert_eq!(out.to_bytes().unwrap(), again.to_bytes().unwrap(), "T={t}: not deterministic");
    }
}

/// The reference precision: F32 inputs with F32, BF16 or MXFP4 weights, every T (one path for
/// all), against the f32 CPU reference at 1e-5 (summation order only); deterministic; capturable.
#[test]
fn experts_reference_precision_match_cpu() {
    let Some(dev) = device("experts_reference_precision_match_cpu") else { return };
    let mut r = rng("experts_reference_precision_match_cpu");
    let (e, k, l, f) = (12, 4, 96, 64);
    for format in [ExpertFormat::F32, ExpertFormat::Bf16, ExpertFormat::Mxfp4] {
        let ly = layer(&dev, &mut r, format, e, l, f);
        for t in [1usize, 5, 70] {
            let z: Vec<f32> = (0..t * l).map(|_| r.random_range(-2.0f32..2.0)).collect();
            let (ids, wts) = routing(&mut r, t, e, k);
            let zd = CudaTensor::from_f32(&dev, vec![t, l], &z).unwrap();
            let idd = CudaTensor::from_pod(&dev, DType::I32, vec![t, k], &ids).unwrap();
            let wd = CudaTensor::from_f32(&dev, vec![t, k], &wts).unwrap();
            let out = poisoned(&dev, DType::F32, vec![t, l]);
            moe::experts_forward(&zd, &idd, &wd, &ly.w, BETA, LBETA, 1.5, &out).unwrap();
            let want = experts_ref(&ly, &z, &ids, &wts, t, k, 1.5);
            check(&format!("reference precision: experts {format:?} T={t}"), &out.to_f32_vec().unwrap(), &want, 1e-5);
            let again = poisoned(&dev, DType::F32, vec![t, l]);
            moe::experts_forward(&zd, &idd, &wd, &ly.w, BETA, LBETA, 1.5, &again).unwrap();
            assert_eq!(out.to_bytes().unwrap(), again.to_bytes().unwrap(), "T={t}: not deterministic");
        }
        // F32 weights refuse BF16 inputs with an error naming the reference precision.
        if format == ExpertFormat::F32 {
            let zb = CudaTensor::from_bf16(&dev, vec![1, l], &vec![bf16::from_f32(0.5); l]).unwrap();
            let (idd, wd) =
                (CudaTensor::from_pod(&dev, DType::I32, vec![1, k], &[0i32, 1, 2, 3]).unwrap(), CudaTensor::from_f32(&dev, vec![1, k], &[0.25; 4]).unwrap());
            let e = moe::experts_forward(&zb, &idd, &wd, &ly.w, BETA, LBETA, 1.0, &poisoned(&dev, DType::F32, vec![1, l])).unwrap_err().to_string();
            assert!(e.contains("reference precision"), "{e}");
        }
    }
}

#[test]
fn experts_tiny_match_cpu() {
    let Some(dev) = device("experts_tiny_match_cpu") else { return };
    let mut r = rng("experts_tiny_match_cpu");
    for format in [ExpertFormat::Mxfp4, ExpertFormat::Bf16] {
        run_experts(&dev, &mut r, format, 6, 2, 64, 128, &[1, 3, 16, 64, 200]);
    }
}

#[test]
fn experts_mid_match_cpu() {
    let Some(dev) = device("experts_mid_match_cpu") else { return };
    let mut r = rng("experts_mid_match_cpu");
    // T = 200 through both paths: the tensor-core kernels in several passes, and the prefill
    // path both ways — grouped (a scratch of 20 experts: MXFP4 in several chunks, the last one
    // partial) and one expert at a time.
    moe::set_prefill_scratch(Some(20 * 3 * 512 * 256 * 2));
    // Batched in units of 3 (MXFP4; BF16 experts take the loop): the last unit partial, rows
    // padded to each unit's largest count.
    moe::set_prefill_group(Some(3));
    for (cut, mode) in [
        (4096, PrefillMode::Grouped),
        (moe::DECODE_MAX_TOKENS, PrefillMode::Grouped),
        (moe::DECODE_MAX_TOKENS, PrefillMode::Loop),
        (moe::DECODE_MAX_TOKENS, PrefillMode::Batched),
    ] {
        moe::set_mma_max_tokens(Some(cut));
        moe::set_prefill_mode(Some(mode));
        for format in [ExpertFormat::Mxfp4, ExpertFormat::Bf16] {
            run_experts(&dev, &mut r, format, 64, 8, 512, 256, &[1, 2, 3, 16, 64, 200, 700]);
        }
        assert_eq!(moe::prefill_mode(), mode, "the grouped prefill fell back to the loop (its reason is in the log)");
    }
    moe::set_mma_max_tokens(Some(moe::DECODE_MAX_TOKENS));
    for format in [ExpertFormat::Mxfp4, ExpertFormat::Bf16] {
        overlap_matches_serial(&dev, &mut r, format, 64, 8, 512, 256, &[200, 700]);
    }
    moe::set_prefill_mode(None);
    moe::set_prefill_group(None);
    moe::set_prefill_scratch(None);
    moe::set_mma_max_tokens(None);
}

/// The prefill loop overlapped (MXFP4 experts dequantized one ahead on the side stream, the
/// default) against the serial loop, bit for bit; for MXFP4 also with the side stream delayed
/// before each dequantization (a GEMM not waiting for its slot's dequant would read the slot's
/// previous expert, or nothing) and with the compute stream delayed before each expert's GEMMs
/// (a dequant not waiting for the GEMMs of its slot's previous expert would overwrite them).
/// BF16 experts go through the loop without dequantization: the same code both ways. The delays
/// expose a missing wait only without per-launch synchronisation (release builds without
/// `K3_CUDA_SYNC=1`, as `scripts/gpu/validate_run.sh` stages them); with it the test still passes.
#[allow(clippy::too_many_arguments)]
fn overlap_matches_serial(dev: &CudaDevice, r: &mut impl Rng, format: ExpertFormat, e: usize, k: usize, l: usize, f: usize, ts: &[usize]) {
    const STALL_NS: u64 = 500_000;
    let ly = layer(dev, r, format, e, l, f);
    for &t in ts {
        assert!(t > moe::mma_max_tokens(e, k), "T={t} must take the prefill path");
        let z: Vec<bf16> = (0..t * l).map(|_| bf16::from_f32(r.random_range(-2.0f32..2.0))).collect();
        let (ids, wts) = routing(r, t, e, k);
        let zd = CudaTensor::from_bf16(dev, vec![t, l], &z).unwrap();
        let idd = CudaTensor::from_pod(dev, DType::I32, vec![t, k], &ids).unwrap();
        let wd = CudaTensor::from_f32(dev, vec![t, k], &wts).unwrap();
        let run = |mode: PrefillMode, side_ns: u64, main_ns: u64| {
            moe::set_prefill_mode(Some(mode));
            moe::set_prefill_stall(side_ns, main_ns);
            let out = poisoned(dev, DType::F32, vec![t, l]);
            moe::experts_forward(&zd, &idd, &wd, &ly.w, BETA, LBETA, 2.5, &out).unwrap();
            moe::set_prefill_stall(0, 0);
            out.to_bytes().unwrap()
        };
        let serial = run(PrefillMode::LoopSerial, 0, 0);
        let stalls: &[(u64, u64)] = if format == ExpertFormat::Mxfp4 { &[(0, 0), (STALL_NS, 0), (0, STALL_NS)] } else { &[(0, 0)] };
        for &(side_ns, main_ns) in stalls {
            let overlapped = run(PrefillMode::Loop, side_ns, main_ns);
            let differ = serial.chunks_exact(4).zip(overlapped.chunks_exact(4)).filter(|(a, b)| a != b).count();
            assert_eq!(
                differ,
                0,
                "{format:?} T={t}: overlapped loop (side stall {side_ns} ns, compute stall {main_ns} ns) differs from the serial loop in {differ} of {} values",
                t * l
            );
        }
        say(&format!("prefill loop {format:?} T={t}: overlapped = serial, bit for bit"));
        // The batched mode's units go through the same slots and events: with either stream
        // delayed its output is the undelayed run's, bit for bit.
        if format == ExpertFormat::Mxfp4 {
            let plain = run(PrefillMode::Batched, 0, 0);
            for &(side_ns, main_ns) in &stalls[1..] {
                assert!(
                    run(PrefillMode::Batched, side_ns, main_ns) == plain,
                    "{format:?} T={t}: batched, side stall {side_ns} ns, compute stall {main_ns} ns: other bits"
                );
            }
            say(&format!("prefill batched {format:?} T={t}: stalled = unstalled, bit for bit"));
        }
    }
}

#[test]
fn experts_wide_match_cpu() {
    // Rows longer than one warp pass (L/32 = 48 MXFP4 groups, L/8 = 192 BF16 chunks).
    let Some(dev) = device("experts_wide_match_cpu") else { return };
    let mut r = rng("experts_wide_match_cpu");
    for format in [ExpertFormat::Mxfp4, ExpertFormat::Bf16] {
        run_experts(&dev, &mut r, format, 8, 3, 1536, 1024, &[1, 5, 64]);
    }
}

#[test]
fn experts_decode_is_graph_capturable() {
    let Some(dev) = device("experts_decode_is_graph_capturable") else { return };
    if std::env::var("K3_CUDA_SYNC").is_ok_and(|v| v == "1") {
        // The launcher synchronises after each launch in that mode, which a capture forbids.
        say("experts_decode_is_graph_capturable: not run under K3_CUDA_SYNC=1 (per-launch sync cannot be captured)");
        return;
    }
    let mut r = rng("experts_decode_is_graph_capturable");
    let (e, k, l, f, t) = (64, 8, 512, 256, 16);
    let ly = layer(&dev, &mut r, ExpertFormat::Mxfp4, e, l, f);
    let z: Vec<f32> = (0..t * l).map(|_| bf16::from_f32(r.random_range(-2.0f32..2.0)).to_f32()).collect();
    let logits: Vec<f32> = (0..t * e).map(|_| r.random_range(-4.0f32..4.0)).collect();
    let zd = CudaTensor::from_bf16(&dev, vec![t, l], &z.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()).unwrap();
    let lg = CudaTensor::from_f32(&dev, vec![t, e], &logits).unwrap();
    let bias = CudaTensor::zeros(&dev, DType::F32, vec![e]).unwrap();
    let idd = poisoned(&dev, DType::I32, vec![t, k]);
    let wd = poisoned(&dev, DType::F32, vec![t, k]);
    let out = poisoned(&dev, DType::F32, vec![t, l]);
    let step = || -> k3_core::Result<()> {
        moe::route(&lg, &bias, k, true, &idd, &wd)?;
        moe::experts_forward(&zd, &idd, &wd, &ly.w, BETA, LBETA, 1.5, &out)
    };
    step().unwrap(); // warm the caching allocator and the modules
    let want = out.to_f32_vec().unwrap();
    out.fill_bytes(0xFF).unwrap();
    let g = kda::capture(&dev, step).unwrap();
    g.launch().unwrap();
    dev.synchronize().unwrap();
    assert_eq!(out.to_f32_vec().unwrap(), want, "graph replay differs from the eager call");
    let ids: Vec<i32> = bytemuck::pod_collect_to_vec(&idd.to_bytes().unwrap());
    let wts = wd.to_f32_vec().unwrap();
    check("graph replay vs CPU (route + experts, MXFP4, T=16)", &want, &experts_ref(&ly, &z, &ids, &wts, t, k, 1.5), TOL_DECODE);
}
