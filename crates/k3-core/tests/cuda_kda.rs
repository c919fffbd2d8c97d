//! Parity suite for the CUDA KDA kernels (`cuda::kda`): chunked prefill and fused decode
//! against a CPU reference of the whole KDA token mixer after the projections (causal conv +
//! SiLU with conv state, L2 norms, q scale, β = σ(b), the lower-bounded gate, the delta-rule
//! core from `kernels::cpu::kda` — recurrent, the normative definition, and chunked — then
//! RMSNorm × σ(gate)), written here in f32 the same way as k3-model's `layers/kda.rs`.
//!
//! Inputs are fresh random non-zero bf16 values (seed printed; `K3_TEST_SEED=N` replays),
//! with non-zero initial recurrent and conv states; outputs are poisoned with NaN first.
//! Tolerances (relative L2): prefill output and state vs the f32 recurrence 5e-3 (bf16
//! tensor-core operands inside the chunk form, bf16 output), decode output 5e-3 (bf16 output
//! rounding) and decode state 1e-4 (f32 throughout); the conv state must match exactly.
//! Without a GPU every test prints `skipped: no CUDA driver (...)` and passes; with
//! `K3_REQUIRE_CUDA=1` that case fails instead.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{device, rng, say};

use half::bf16;
use k3_core::cuda::kda::{self, DecodeKernel, KdaInputs, KdaWeights, HEAD_DIM};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::kernels::cpu::kda::{kda_chunked, kda_recurrent, KdaDims};
use k3_core::DType;
use rand::Rng;

const TOL_OUT: f64 = 5e-3;
const TOL_STATE: f64 = 5e-3;
const TOL_DECODE_STATE: f64 = 1e-4;
const HD: usize = HEAD_DIM;

/// Uniform in ±[lo, hi), bf16-representable.
fn rvec(r: &mut impl Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| bf16::from_f32(r.random_range(lo..hi) * if r.random::<bool>() { 1.0 } else { -1.0 }).to_f32()).collect()
}

fn up(dev: &CudaDevice, dtype: DType, shape: Vec<usize>, v: &[f32]) -> CudaTensor {
    let t = match dtype {
        DType::F32 => CudaTensor::from_f32(dev, shape, v),
        _ => CudaTensor::from_bf16(dev, shape, &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()),
    };
    t.expect("upload")
}

fn poisoned(dev: &CudaDevice, dtype: DType, shape: Vec<usize>) -> CudaTensor {
    let t = CudaTensor::uninit(dev, dtype, shape).expect("alloc");
    t.fill_bytes(0xFF).expect("poison");
    t
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("non-finite value at element {i} of {} (unwritten or invalid output)", got.len());
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    if den == 0.0 { num.sqrt() } else { (num / den).sqrt() }
}

fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(got, want);
    say(&format!("  {what:<58} rel L2 {e:.2e} (tol {tol:.0e})"));
    assert!(e <= tol, "{what}: relative L2 error {e:.3e} > {tol:.0e}");
}

/// One random problem: `lens` packed sequences, `h` heads.
struct Problem {
    h: usize,
    lens: Vec<usize>,
    raw: [Vec<f32>; 3], // q, k, v raw [N, D]
    g: Vec<f32>,        // [N, D]
    beta: Vec<f32>,     // [N, H] logits
    gate: Vec<f32>,     // [N, D]
    conv_w: Vec<f32>,   // [3, D, 4]
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>,
    conv0: Vec<f32>, // [B, 3, 3, D]
    s0: Vec<f32>,    // [B, H, 128, 128]
}

impl Problem {
    fn new(r: &mut impl Rng, h: usize, lens: &[usize]) -> Self {
        let d = h * HD;
        let (n, b) = (lens.iter().sum::<usize>(), lens.len());
        Problem {
            h,
            lens: lens.to_vec(),
            raw: [rvec(r, n * d, 0.05, 1.0), rvec(r, n * d, 0.05, 1.0), rvec(r, n * d, 0.05, 1.0)],
            g: rvec(r, n * d, 0.01, 3.0),
            beta: rvec(r, n * h, 0.01, 3.0),
            gate: rvec(r, n * d, 0.01, 3.0),
            conv_w: rvec(r, 3 * d * 4, 0.05, 0.8),
            a_log: rvec(r, h, 0.01, 1.0),
            dt_bias: rvec(r, d, 0.01, 2.0),
            o_norm: rvec(r, HD, 0.5, 1.5),
            conv0: rvec(r, b * 9 * d, 0.05, 1.0),
            s0: rvec(r, b * h * HD * HD, 0.001, 0.3),
        }
    }
}

/// CPU reference: (output [N, D], conv state, state, states after each chunk).
fn cpu_reference(p: &Problem, chunked: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (h, d) = (p.h, p.h * HD);
    let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
    let (mut out, mut conv, mut st, mut chunk_states) = (Vec::new(), p.conv0.clone(), p.s0.clone(), Vec::new());
    let mut r0 = 0;
    for (bi, &t) in p.lens.iter().enumerate() {
        // conv + SiLU with the conv-state tail, then the new tail.
        let mut qkv: Vec<Vec<f32>> = Vec::new();
        for which in 0..3 {
            let tail = &mut conv[(bi * 3 + which) * 3 * d..][..3 * d];
            let mut xs = tail.to_vec();
            xs.extend_from_slice(&p.raw[which][r0 * d..(r0 + t) * d]);
            let w = &p.conv_w[which * d * 4..][..d * 4];
            let y: Vec<f32> = (0..t * d)
                .map(|i| {
                    let (row, c) = (i / d, i % d);
                    let a: f32 = (0..4).map(|j| w[c * 4 + j] * xs[(row + j) * d + c]).sum();
                    a * sig(a)
                })
                .collect();
            tail.copy_from_slice(&xs[t * d..]);
            qkv.push(y);
        }
        let (mut q, mut k, v) = (qkv[0].clone(), qkv[1].clone(), qkv[2].clone());
        for row in 0..t * h {
            let (qs, ks) = (&mut q[row * HD..][..HD], &mut k[row * HD..][..HD]);
            let qi = 1.0 / (qs.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt() / (HD as f32).sqrt();
            let ki = 1.0 / (ks.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
            qs.iter_mut().for_each(|x| *x *= qi);
            ks.iter_mut().for_each(|x| *x *= ki);
        }
        let g: Vec<f32> = (0..t * d).map(|i| -5.0 * sig(p.a_log[(i % d) / HD].exp() * (p.g[r0 * d + i] + p.dt_bias[i % d]))).collect();
        let beta: Vec<f32> = p.beta[r0 * h..(r0 + t) * h].iter().map(|&x| sig(x)).collect();
        let s = &mut st[bi * h * HD * HD..][..h * HD * HD];
        let mut o = vec![0f32; t * d];
        // Chunk by chunk (equal to one call: the state carries over), snapshotting S.
        let mut c0 = 0;
        while c0 < t {
            let n = 64.min(t - c0);
            let dims = KdaDims { t: n, h, dk: HD, dv: HD };
            let sl = |x: &Vec<f32>, w: usize| x[c0 * w..(c0 + n) * w].to_vec();
            let core = if chunked { kda_chunked } else { kda_recurrent };
            core(&sl(&q, d), &sl(&k, d), &sl(&v, d), &sl(&g, d), &sl(&beta, h), s, &mut o[c0 * d..(c0 + n) * d], dims);
            chunk_states.extend_from_slice(s);
            c0 += n;
        }
        for row in 0..t * h {
            let orow = &mut o[row * HD..][..HD];
            let inv = 1.0 / (orow.iter().map(|x| x * x).sum::<f32>() / HD as f32 + 1e-5).sqrt();
            let (tt, hh) = (row / h, row % h);
            for (dd, x) in orow.iter_mut().enumerate() {
                *x *= inv * p.o_norm[dd] * sig(p.gate[(r0 + tt) * d + hh * HD + dd]);
            }
        }
        out.extend_from_slice(&o);
        r0 += t;
    }
    (out, conv, st, chunk_states)
}

struct Gpu {
    t: Vec<CudaTensor>, // q k v g beta gate conv a_log dt o_norm
}

impl Gpu {
    fn new(dev: &CudaDevice, p: &Problem, rows: std::ops::Range<usize>) -> Self {
        let (h, d) = (p.h, p.h * HD);
        let n = rows.len();
        let bf = |v: &Vec<f32>, w: usize| up(dev, DType::BF16, vec![n, w], &v[rows.start * w..rows.end * w]);
        Gpu {
            t: vec![
                bf(&p.raw[0], d),
                bf(&p.raw[1], d),
                bf(&p.raw[2], d),
                bf(&p.g, d),
                bf(&p.beta, h),
                bf(&p.gate, d),
                up(dev, DType::F32, vec![3, d, 4], &p.conv_w),
                up(dev, DType::F32, vec![h], &p.a_log),
                up(dev, DType::F32, vec![d], &p.dt_bias),
                up(dev, DType::F32, vec![HD], &p.o_norm),
            ],
        }
    }
    fn inputs(&self) -> KdaInputs<'_> {
        KdaInputs { q: &self.t[0], k: &self.t[1], v: &self.t[2], g: &self.t[3], beta: &self.t[4], gate: &self.t[5] }
    }
    fn weights(&self) -> KdaWeights<'_> {
        KdaWeights { conv: &self.t[6], a_log: &self.t[7], dt_bias: &self.t[8], o_norm: &self.t[9], lower_bound: -5.0, eps: 1e-5 }
    }
}

#[test]
fn prefill_parity() {
    const T: &str = "kda prefill_parity";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    // Includes a long sequence (chunks far from the sequence start) and sequences shorter than
    // the conv width.
    let cases: [(usize, &[usize]); 8] = [(2, &[1]), (2, &[64]), (3, &[100]), (2, &[2, 64, 130, 7]), (4, &[200]), (1, &[1, 1, 3]), (8, &[129, 300, 65]), (2, &[1000, 3])];
    for (h, lens) in cases {
        let p = Problem::new(&mut r, h, lens);
        let (d, b, n) = (h * HD, lens.len(), lens.iter().sum::<usize>());
        let x = Gpu::new(&dev, &p, 0..n);
        let conv = up(&dev, DType::BF16, vec![b, 3, 3, d], &p.conv0);
        let st = up(&dev, DType::F32, vec![b, h, HD, HD], &p.s0);
        let out = poisoned(&dev, DType::BF16, vec![n, d]);
        let nc = kda::num_chunks(lens);
        let cs = poisoned(&dev, DType::F32, vec![nc, h, HD, HD]);
        kda::kda_prefill(&x.inputs(), &x.weights(), lens, &conv, &st, &out, Some(&cs)).expect("kda_prefill");
        let (o_ref, conv_ref, s_ref, cs_ref) = cpu_reference(&p, false);
        let what = format!("H={h} lens={lens:?}");
        check(&format!("{what} out vs recurrent"), &out.to_f32_vec().expect("out"), &o_ref, TOL_OUT);
        check(&format!("{what} state vs recurrent"), &st.to_f32_vec().expect("state"), &s_ref, TOL_STATE);
        check(&format!("{what} chunk states vs recurrent"), &cs.to_f32_vec().expect("cs"), &cs_ref, TOL_STATE);
        assert_eq!(conv.to_f32_vec().expect("conv"), conv_ref, "{what}: conv state differs");
        let (o_chk, _, s_chk, _) = cpu_reference(&p, true);
        check(&format!("{what} out vs chunked"), &out.to_f32_vec().expect("out"), &o_chk, TOL_OUT);
        check(&format!("{what} state vs chunked"), &st.to_f32_vec().expect("state"), &s_chk, TOL_STATE);
    }
}

#[test]
fn prefill_without_chunk_states_matches() {
    const T: &str = "kda prefill_without_chunk_states";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    let (h, lens) = (3usize, [70usize, 5]);
    let p = Problem::new(&mut r, h, &lens);
    let (d, n) = (h * HD, 75);
    let x = Gpu::new(&dev, &p, 0..n);
    let conv = up(&dev, DType::BF16, vec![2, 3, 3, d], &p.conv0);
    let st = up(&dev, DType::F32, vec![2, h, HD, HD], &p.s0);
    let out = poisoned(&dev, DType::BF16, vec![n, d]);
    kda::kda_prefill(&x.inputs(), &x.weights(), &lens, &conv, &st, &out, None).expect("kda_prefill");
    let (o_ref, _, s_ref, _) = cpu_reference(&p, false);
    check("H=3 lens=[70, 5] out, no chunk states", &out.to_f32_vec().expect("out"), &o_ref, TOL_OUT);
    check("H=3 lens=[70, 5] state, no chunk states", &st.to_f32_vec().expect("state"), &s_ref, TOL_STATE);
}

#[test]
fn decode_parity() {
    const T: &str = "kda decode_parity";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for (h, b, kernel) in [(2usize, 1usize, DecodeKernel::Fused), (3, 5, DecodeKernel::Fused), (4, 64, DecodeKernel::Fused), (2, 1, DecodeKernel::Split), (3, 5, DecodeKernel::Split), (4, 64, DecodeKernel::Split)] {
        let steps = 3;
        // Token s of sequence i is row s*b + i; the CPU runs each sequence as lens = [steps].
        let p = Problem::new(&mut r, h, &vec![1; b * steps]);
        let d = h * HD;
        let conv = up(&dev, DType::BF16, vec![b, 3, 3, d], &p.conv0[..b * 9 * d]);
        let st = up(&dev, DType::F32, vec![b, h, HD, HD], &p.s0[..b * h * HD * HD]);
        let mut outs = Vec::new();
        for s in 0..steps {
            let x = Gpu::new(&dev, &p, s * b..(s + 1) * b);
            let out = poisoned(&dev, DType::BF16, vec![b, d]);
            kda::kda_decode_with(&x.inputs(), &x.weights(), &conv, &st, &out, kernel).expect("kda_decode");
            outs.push(out.to_f32_vec().expect("out"));
        }
        // Reorder the problem into b sequences of `steps` tokens for the CPU.
        let reorder = |v: &Vec<f32>, w: usize| -> Vec<f32> {
            (0..b).flat_map(|i| (0..steps).flat_map(move |s| v[(s * b + i) * w..(s * b + i + 1) * w].to_vec())).collect()
        };
        let q = Problem {
            h,
            lens: vec![steps; b],
            raw: [reorder(&p.raw[0], d), reorder(&p.raw[1], d), reorder(&p.raw[2], d)],
            g: reorder(&p.g, d),
            beta: reorder(&p.beta, h),
            gate: reorder(&p.gate, d),
            conv_w: p.conv_w.clone(),
            a_log: p.a_log.clone(),
            dt_bias: p.dt_bias.clone(),
            o_norm: p.o_norm.clone(),
            conv0: p.conv0[..b * 9 * d].to_vec(),
            s0: p.s0[..b * h * HD * HD].to_vec(),
        };
        let (o_ref, conv_ref, s_ref, _) = cpu_reference(&q, false);
        let got: Vec<f32> = (0..b).flat_map(|i| (0..steps).flat_map(|s| outs[s][i * d..(i + 1) * d].to_vec()).collect::<Vec<_>>()).collect();
        check(&format!("decode {kernel:?} H={h} B={b} {steps} steps out"), &got, &o_ref, TOL_OUT);
        check(&format!("decode {kernel:?} H={h} B={b} state"), &st.to_f32_vec().expect("state"), &s_ref, TOL_DECODE_STATE);
        assert_eq!(conv.to_f32_vec().expect("conv"), conv_ref, "decode {kernel:?} H={h} B={b}: conv state differs");
    }
}

#[test]
fn kda_rejects_bad_shapes() {
    const T: &str = "kda rejects_bad_shapes";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    let p = Problem::new(&mut r, 2, &[10]);
    let x = Gpu::new(&dev, &p, 0..10);
    let conv = up(&dev, DType::BF16, vec![1, 3, 3, 256], &p.conv0);
    let st = up(&dev, DType::F32, vec![1, 2, HD, HD], &p.s0);
    let out = poisoned(&dev, DType::BF16, vec![10, 256]);
    // Lengths that do not add up to the rows, a state of the wrong batch, an f32 output.
    assert!(kda::kda_prefill(&x.inputs(), &x.weights(), &[9], &conv, &st, &out, None).is_err());
    assert!(kda::kda_prefill(&x.inputs(), &x.weights(), &[5, 5], &conv, &st, &out, None).is_err());
    let out32 = poisoned(&dev, DType::F32, vec![10, 256]);
    assert!(kda::kda_prefill(&x.inputs(), &x.weights(), &[10], &conv, &st, &out32, None).is_err());
    assert!(kda::kda_decode(&x.inputs(), &x.weights(), &conv, &st, &out).is_err());
    kda::kda_prefill(&x.inputs(), &x.weights(), &[10], &conv, &st, &out, None).expect("a valid call still works");
}
