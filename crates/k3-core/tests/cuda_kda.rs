//! Parity suite for the CUDA KDA kernels (`cuda::kda`): chunked prefill and fused decode at
//! head dim 128, the general recurrent kernel at head dims 32, 64 and 96 (prefill and decode) and
//! 16, 48 (prefill and decode), 8 and 100 (prefill),
//! against a CPU reference of the whole KDA token mixer after the projections (causal conv +
//! SiLU with conv state, L2 norms, q scale, β = σ(b), the lower-bounded gate, the delta-rule
//! core from `kernels::cpu::kda` — recurrent, the normative definition, and chunked — then
//! RMSNorm × σ(gate)), in f32 the same way as k3-model's `layers/kda.rs`, from the CPU kernels of
//! `kernels::cpu` (SiLU, σ, the L2 norm and RMSNorm; only the causal conv is written here).
//!
//! States live in a pool of slots: every case gives its sequences non-identity slots in a larger
//! pool (e.g. `[3, 0, 5]` of 7) and checks that the slots no sequence uses stay bit-identical.
//! Inputs are fresh random non-zero bf16 values (seed printed; `K3_TEST_SEED=N` replays),
//! with non-zero initial recurrent and conv states; outputs are poisoned with NaN first.
//! Tolerances (relative L2): output 5e-3 everywhere (bf16 output rounding; at head dim 128 also
//! bf16 tensor-core operands in the chunk form); head-dim-128 prefill state 5e-3 vs the f32
//! recurrence; decode state and the general kernel's prefill state 1e-4 (f32 throughout); the
//! conv state must match exactly.
//! The capturable prefill (device tables) and its CUDA-graph replay equal `kda_prefill` bit for bit,
//! and so does one that runs fewer rows than its tables' layout (`kda_tables_within`).
//! Without a GPU every test prints `skipped: no CUDA driver (...)` and passes; with
//! `K3_REQUIRE_CUDA=1` that case fails instead.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{device, poisoned, rel_l2, rng, rvec, say, up};

use k3_core::cuda::kda::{self, KdaInputs, KdaWeights};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::kernels::cpu::act::{sigmoid, silu};
use k3_core::kernels::cpu::kda::{kda_chunked, kda_recurrent, KdaDims};
use k3_core::kernels::cpu::norm::{l2_norm_inplace, rms_norm_inplace};
use k3_core::DType;
use rand::Rng;

const TOL_OUT: f64 = 5e-3;
const TOL_STATE: f64 = 5e-3;
const TOL_F32_STATE: f64 = 1e-4;

fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(got, want);
    say(&format!("  {what:<58} rel L2 {e:.2e} (tol {tol:.0e})"));
    assert!(e <= tol, "{what}: relative L2 error {e:.3e} > {tol:.0e}");
}

/// Slots for `b` sequences and the pool size: `[3, 0, 5]` of 7 for three, else the even slots
/// 2b, 2b−2, …, 2 of a pool of 2b + 1 (slot 0 and the odd slots stay unused).
fn slots_for(b: usize) -> (Vec<usize>, usize) {
    if b == 3 {
        return (vec![3, 0, 5], 7);
    }
    ((0..b).map(|i| 2 * b - 2 * i).collect(), 2 * b + 1)
}

fn slot_tensor(dev: &CudaDevice, slots: &[usize]) -> CudaTensor {
    let v: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
    CudaTensor::from_pod(dev, DType::I32, vec![v.len()], &v).expect("slots")
}

/// One random problem: `lens` packed sequences, `h` heads of `hd`, sequence b in pool slot
/// `slots[b]` of `npool`.
struct Problem {
    h: usize,
    hd: usize,
    lens: Vec<usize>,
    slots: Vec<usize>,
    npool: usize,
    raw: [Vec<f32>; 3], // q, k, v raw [N, D]
    g: Vec<f32>,        // [N, D]
    beta: Vec<f32>,     // [N, H] logits
    gate: Vec<f32>,     // [N, D]
    conv_w: Vec<f32>,   // [3, D, 4]
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    o_norm: Vec<f32>, // [hd]
    conv0: Vec<f32>,  // [S, 3, 3, D]
    s0: Vec<f32>,     // [S, H, hd, hd]
}

impl Problem {
    fn new(r: &mut impl Rng, h: usize, hd: usize, lens: &[usize], slots: &[usize], npool: usize) -> Self {
        let d = h * hd;
        let n = lens.iter().sum::<usize>();
        Problem {
            h,
            hd,
            lens: lens.to_vec(),
            slots: slots.to_vec(),
            npool,
            raw: [rvec(r, n * d, 0.05, 1.0), rvec(r, n * d, 0.05, 1.0), rvec(r, n * d, 0.05, 1.0)],
            g: rvec(r, n * d, 0.01, 3.0),
            beta: rvec(r, n * h, 0.01, 3.0),
            gate: rvec(r, n * d, 0.01, 3.0),
            conv_w: rvec(r, 3 * d * 4, 0.05, 0.8),
            a_log: rvec(r, h, 0.01, 1.0),
            dt_bias: rvec(r, d, 0.01, 2.0),
            o_norm: rvec(r, hd, 0.5, 1.5),
            conv0: rvec(r, npool * 9 * d, 0.05, 1.0),
            s0: rvec(r, npool * h * hd * hd, 0.001, 0.3),
        }
    }
    fn d(&self) -> usize {
        self.h * self.hd
    }
    fn pools(&self, dev: &CudaDevice) -> (CudaTensor, CudaTensor) {
        self.pools_as(dev, DType::BF16)
    }
    /// The pools with the conv tails stored as `io` (F32: the reference precision).
    fn pools_as(&self, dev: &CudaDevice, io: DType) -> (CudaTensor, CudaTensor) {
        let (h, hd, d, s) = (self.h, self.hd, self.d(), self.npool);
        (up(dev, io, vec![s, 3, 3, d], &self.conv0), up(dev, DType::F32, vec![s, h, hd, hd], &self.s0))
    }
}

/// CPU reference: (output [N, D], conv-state pool, state pool, states after each chunk).
fn cpu_reference(p: &Problem, chunked: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (h, hd, d) = (p.h, p.hd, p.d());
    let (mut out, mut conv, mut st, mut chunk_states) = (Vec::new(), p.conv0.clone(), p.s0.clone(), Vec::new());
    let mut r0 = 0;
    for (&t, &slot) in p.lens.iter().zip(&p.slots) {
        // conv + SiLU with the conv-state tail, then the new tail.
        let mut qkv: Vec<Vec<f32>> = Vec::new();
        for which in 0..3 {
            let tail = &mut conv[(slot * 3 + which) * 3 * d..][..3 * d];
            let mut xs = tail.to_vec();
            xs.extend_from_slice(&p.raw[which][r0 * d..(r0 + t) * d]);
            let w = &p.conv_w[which * d * 4..][..d * 4];
            let y: Vec<f32> = (0..t * d)
                .map(|i| {
                    let (row, c) = (i / d, i % d);
                    let a: f32 = (0..4).map(|j| w[c * 4 + j] * xs[(row + j) * d + c]).sum();
                    silu(a)
                })
                .collect();
            tail.copy_from_slice(&xs[t * d..]);
            qkv.push(y);
        }
        let (mut q, mut k, v) = (qkv[0].clone(), qkv[1].clone(), qkv[2].clone());
        l2_norm_inplace(&mut q, hd, 1e-6);
        l2_norm_inplace(&mut k, hd, 1e-6);
        let q_scale = 1.0 / (hd as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= q_scale);
        let g: Vec<f32> = (0..t * d).map(|i| -5.0 * sigmoid(p.a_log[(i % d) / hd].exp() * (p.g[r0 * d + i] + p.dt_bias[i % d]))).collect();
        let beta: Vec<f32> = p.beta[r0 * h..(r0 + t) * h].iter().map(|&x| sigmoid(x)).collect();
        let s = &mut st[slot * h * hd * hd..][..h * hd * hd];
        let mut o = vec![0f32; t * d];
        // Chunk by chunk (equal to one call: the state carries over), snapshotting S.
        let mut c0 = 0;
        while c0 < t {
            let n = 64.min(t - c0);
            let dims = KdaDims { t: n, h, dk: hd, dv: hd };
            let sl = |x: &Vec<f32>, w: usize| x[c0 * w..(c0 + n) * w].to_vec();
            let core = if chunked { kda_chunked } else { kda_recurrent };
            core(&sl(&q, d), &sl(&k, d), &sl(&v, d), &sl(&g, d), &sl(&beta, h), s, &mut o[c0 * d..(c0 + n) * d], dims);
            chunk_states.extend_from_slice(s);
            c0 += n;
        }
        rms_norm_inplace(&mut o, &p.o_norm, 1e-5);
        for (x, &gate) in o.iter_mut().zip(&p.gate[r0 * d..(r0 + t) * d]) {
            *x *= sigmoid(gate);
        }
        out.extend_from_slice(&o);
        r0 += t;
    }
    (out, conv, st, chunk_states)
}

/// Compares the pools: the used slots within `tol` (the conv state exactly), every other slot
/// bit-identical to its initial value.
fn check_pools(what: &str, p: &Problem, conv: &CudaTensor, st: &CudaTensor, conv_ref: &[f32], s_ref: &[f32], tol: f64) {
    check_slots(what, p, &p.slots, conv, st, conv_ref, s_ref, tol)
}

/// As [`check_pools`] when the kernel was given only the `used` slots of the problem.
fn check_slots(what: &str, p: &Problem, used: &[usize], conv: &CudaTensor, st: &CudaTensor, conv_ref: &[f32], s_ref: &[f32], tol: f64) {
    let (cg, sg) = (conv.to_f32_vec().expect("conv"), st.to_f32_vec().expect("state"));
    let (cw, sw) = (9 * p.d(), p.h * p.hd * p.hd);
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for slot in 0..p.npool {
        let (c, s) = (slot * cw..(slot + 1) * cw, slot * sw..(slot + 1) * sw);
        if used.contains(&slot) {
            assert_eq!(cg[c.clone()], conv_ref[c], "{what}: conv state of slot {slot} differs");
            got.extend_from_slice(&sg[s.clone()]);
            want.extend_from_slice(&s_ref[s]);
        } else {
            assert!(cg[c.clone()].iter().zip(&p.conv0[c]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: unused conv slot {slot} changed");
            assert!(sg[s.clone()].iter().zip(&p.s0[s]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: unused state slot {slot} changed");
        }
    }
    check(&format!("{what} state (slots {used:?} of {})", p.npool), &got, &want, tol);
}

struct Gpu {
    t: Vec<CudaTensor>, // q k v g beta gate conv a_log dt o_norm
}

impl Gpu {
    fn new(dev: &CudaDevice, p: &Problem, rows: std::ops::Range<usize>) -> Self {
        Self::new_as(dev, p, rows, DType::BF16)
    }
    /// The raw inputs stored as `io` (F32: the reference precision).
    fn new_as(dev: &CudaDevice, p: &Problem, rows: std::ops::Range<usize>, io: DType) -> Self {
        let (h, d) = (p.h, p.d());
        let n = rows.len();
        let bf = |v: &Vec<f32>, w: usize| up(dev, io, vec![n, w], &v[rows.start * w..rows.end * w]);
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
                up(dev, DType::F32, vec![p.hd], &p.o_norm),
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

/// One prefill case: output, pools and chunk states vs the recurrence (and, at head dim 128,
/// vs the CPU chunked form too).
fn prefill_case(dev: &CudaDevice, r: &mut impl Rng, h: usize, hd: usize, lens: &[usize]) {
    prefill_case_as(dev, r, h, hd, lens, DType::BF16)
}

/// [`prefill_case`] with inputs, conv tails and output stored as `io`. F32 (the reference
/// precision) runs the general kernel at every head dim and is held to f32 tolerances.
fn prefill_case_as(dev: &CudaDevice, r: &mut impl Rng, h: usize, hd: usize, lens: &[usize], io: DType) {
    let (slots, npool) = slots_for(lens.len());
    let p = Problem::new(r, h, hd, lens, &slots, npool);
    let (d, n) = (p.d(), lens.iter().sum::<usize>());
    let x = Gpu::new_as(dev, &p, 0..n, io);
    let (conv, st) = p.pools_as(dev, io);
    let out = poisoned(dev, io, vec![n, d]);
    let nc = kda::num_chunks(lens);
    let cs = poisoned(dev, DType::F32, vec![nc, h, hd, hd]);
    let su: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
    kda::kda_prefill(&x.inputs(), &x.weights(), lens, &su, &conv, &st, &out, Some(&cs)).expect("kda_prefill");
    let (o_ref, conv_ref, s_ref, cs_ref) = cpu_reference(&p, false);
    let what = format!("hd={hd} H={h} lens={lens:?} {io}");
    let f32_io = io == DType::F32;
    let tol_s = if hd == 128 && !f32_io { TOL_STATE } else { TOL_F32_STATE };
    let o_gpu = out.to_f32_vec().expect("out");
    check(&format!("{what} out vs recurrent"), &o_gpu, &o_ref, if f32_io { TOL_F32_STATE } else { TOL_OUT });
    check_pools(&format!("{what} vs recurrent"), &p, &conv, &st, &conv_ref, &s_ref, tol_s);
    check(&format!("{what} chunk states vs recurrent"), &cs.to_f32_vec().expect("cs"), &cs_ref, tol_s);
    if hd == 128 && !f32_io {
        let (o_chk, conv_chk, s_chk, _) = cpu_reference(&p, true);
        check(&format!("{what} out vs chunked"), &o_gpu, &o_chk, TOL_OUT);
        check_pools(&format!("{what} vs chunked"), &p, &conv, &st, &conv_chk, &s_chk, TOL_STATE);
    }
}

#[test]
fn prefill_parity() {
    const T: &str = "kda prefill_parity";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    // Includes a long sequence (chunks far from the sequence start) and sequences shorter than
    // the conv width.
    let cases: [(usize, &[usize]); 9] =
        [(2, &[1]), (2, &[64]), (3, &[100]), (2, &[2, 64, 130, 7]), (4, &[200]), (1, &[1, 1, 3]), (8, &[129, 300, 65]), (2, &[1000, 3]), (3, &[5, 70, 1])];
    for (h, lens) in cases {
        prefill_case(&dev, &mut r, h, 128, lens);
    }
}

/// The reference precision (F32 inputs, conv tails and output): the general kernel at head dims
/// 32 and 128, held to f32 tolerances against the recurrence.
#[test]
fn prefill_parity_f32() {
    const T: &str = "kda prefill_parity_f32";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for (h, hd, lens) in [(3usize, 32usize, &[5usize, 70][..]), (2, 128, &[1, 130]), (1, 128, &[64])] {
        prefill_case_as(&dev, &mut r, h, hd, lens, DType::F32);
    }
}

#[test]
fn prefill_parity_general_head_dims() {
    const T: &str = "kda prefill_parity_general_head_dims";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for hd in [32usize, 64] {
        let cases: [(usize, &[usize]); 7] = [(2, &[1]), (3, &[5]), (2, &[64]), (4, &[130]), (3, &[1, 5, 64, 130]), (2, &[2, 1, 3]), (5, &[70, 200])];
        for (h, lens) in cases {
            prefill_case(&dev, &mut r, h, hd, lens);
        }
    }
    prefill_case(&dev, &mut r, 2, 96, &[1, 66, 5]);
    // Head dims that are not a multiple of a warp (the CPU model runs any): 16 (R = 16 row
    // groups), 48 (two warps, the second half empty), 8 and 100.
    for hd in [16usize, 48, 8, 100] {
        prefill_case(&dev, &mut r, 3, hd, &[1, 5, 64, 130]);
    }
}

#[test]
fn prefill_without_chunk_states_matches() {
    const T: &str = "kda prefill_without_chunk_states";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for hd in [128usize, 64] {
        let (h, lens) = (3usize, [70usize, 5]);
        let p = Problem::new(&mut r, h, hd, &lens, &[1, 0], 3);
        let (d, n) = (p.d(), 75);
        let x = Gpu::new(&dev, &p, 0..n);
        let (conv, st) = p.pools(&dev);
        let out = poisoned(&dev, DType::BF16, vec![n, d]);
        kda::kda_prefill(&x.inputs(), &x.weights(), &lens, &[1, 0], &conv, &st, &out, None).expect("kda_prefill");
        let (o_ref, conv_ref, s_ref, _) = cpu_reference(&p, false);
        check(&format!("hd={hd} H=3 lens=[70, 5] out, no chunk states"), &out.to_f32_vec().expect("out"), &o_ref, TOL_OUT);
        check_pools(&format!("hd={hd} H=3 lens=[70, 5] no chunk states"), &p, &conv, &st, &conv_ref, &s_ref, if hd == 128 { TOL_STATE } else { TOL_F32_STATE });
    }
}

/// `steps` decode steps of `b` sequences; token s of sequence i is row s·b + i of `p`.
fn decode_reference(p: &Problem, b: usize, steps: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (h, d) = (p.h, p.d());
    // Reorder the problem into b sequences of `steps` tokens for the CPU.
    let reorder =
        |v: &Vec<f32>, w: usize| -> Vec<f32> { (0..b).flat_map(|i| (0..steps).flat_map(move |s| v[(s * b + i) * w..(s * b + i + 1) * w].to_vec())).collect() };
    let q = Problem {
        h,
        hd: p.hd,
        lens: vec![steps; b],
        slots: p.slots.clone(),
        npool: p.npool,
        raw: [reorder(&p.raw[0], d), reorder(&p.raw[1], d), reorder(&p.raw[2], d)],
        g: reorder(&p.g, d),
        beta: reorder(&p.beta, h),
        gate: reorder(&p.gate, d),
        conv_w: p.conv_w.clone(),
        a_log: p.a_log.clone(),
        dt_bias: p.dt_bias.clone(),
        o_norm: p.o_norm.clone(),
        conv0: p.conv0.clone(),
        s0: p.s0.clone(),
    };
    let (o_ref, conv_ref, s_ref, _) = cpu_reference(&q, false);
    // Back to step-major order: row s·b + i.
    let o_step: Vec<f32> =
        (0..steps).flat_map(|s| (0..b).map(move |i| (s, i))).flat_map(|(s, i)| o_ref[(i * steps + s) * d..(i * steps + s + 1) * d].to_vec()).collect();
    (o_step, conv_ref, s_ref)
}

#[test]
fn decode_parity() {
    const T: &str = "kda decode_parity";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    // (head dim, H, B); at 16 heads x 100 sequences the grid is 1600 blocks, several waves.
    let cases = [
        (128usize, 2usize, 1usize),
        (128, 3, 5),
        (128, 4, 64),
        (128, 3, 3),
        (128, 16, 100),
        (32, 2, 1),
        (32, 3, 5),
        (64, 2, 1),
        (64, 4, 5),
        (64, 2, 3),
        (96, 2, 5),
        (16, 3, 5),
        (48, 2, 3),
    ];
    for (hd, h, b) in cases {
        let steps = 3;
        let (slots, npool) = slots_for(b);
        let p = Problem::new(&mut r, h, hd, &vec![1; b * steps], &slots, npool);
        let d = p.d();
        let (conv, st) = p.pools(&dev);
        let sl = slot_tensor(&dev, &slots);
        let mut got = Vec::new();
        for s in 0..steps {
            let x = Gpu::new(&dev, &p, s * b..(s + 1) * b);
            let out = poisoned(&dev, DType::BF16, vec![b, d]);
            kda::kda_decode(&x.inputs(), &x.weights(), &sl, &conv, &st, &out).expect("kda_decode");
            got.extend(out.to_f32_vec().expect("out"));
        }
        let (o_ref, conv_ref, s_ref) = decode_reference(&p, b, steps);
        let what = format!("decode hd={hd} H={h} B={b}");
        check(&format!("{what} {steps} steps out"), &got, &o_ref, TOL_OUT);
        check_pools(&what, &p, &conv, &st, &conv_ref, &s_ref, TOL_F32_STATE);
    }
}

/// Sequences whose slot lies outside the pool are skipped (head dim 128 and the general kernel):
/// their output rows keep the poison, their would-be slots and every unused slot stay
/// bit-identical, and the other sequences of the batch are computed as usual.
#[test]
fn decode_skips_slots_outside_the_pool() {
    const T: &str = "kda decode_skips_slots_outside_the_pool";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for hd in [128usize, 64] {
        let (h, b) = (3usize, 5usize);
        // The reference runs all five sequences (slots 2, 5, 0, 6, 4); the kernel gets -1 and 7
        // (= the pool size) for sequences 1 and 3.
        let p = Problem::new(&mut r, h, hd, &[1; 5], &[2, 5, 0, 6, 4], 7);
        let d = p.d();
        let (conv, st) = p.pools(&dev);
        let sl = CudaTensor::from_pod(&dev, DType::I32, vec![b], &[2i32, -1, 0, 7, 4]).expect("slots");
        let x = Gpu::new(&dev, &p, 0..b);
        let out = poisoned(&dev, DType::BF16, vec![b, d]);
        kda::kda_decode(&x.inputs(), &x.weights(), &sl, &conv, &st, &out).expect("kda_decode");
        let what = format!("decode hd={hd} with slots [2, -1, 0, 7, 4]");
        let (o_ref, conv_ref, s_ref, _) = cpu_reference(&p, false);
        let (got, bytes) = (out.to_f32_vec().expect("out"), out.to_bytes().expect("out"));
        for i in [1usize, 3] {
            assert!(bytes[i * d * 2..(i + 1) * d * 2].iter().all(|&x| x == 0xFF), "{what}: output row {i} (slot outside the pool) was written");
        }
        let rows = |v: &[f32]| -> Vec<f32> { [0usize, 2, 4].iter().flat_map(|&i| v[i * d..(i + 1) * d].to_vec()).collect() };
        check(&format!("{what} out (rows 0, 2, 4)"), &rows(&got), &rows(&o_ref), TOL_OUT);
        check_slots(&what, &p, &[2, 0, 4], &conv, &st, &conv_ref, &s_ref, TOL_F32_STATE);
    }
}

/// A decode step captured once in a CUDA graph follows the slot table written before each replay.
#[test]
fn decode_graph_follows_slots() {
    const T: &str = "kda decode_graph_follows_slots";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for hd in [128usize, 64] {
        let (h, b) = (2usize, 2usize);
        // Two replays on the same inputs: slots [2, 0], then [1, 3] = four one-token sequences.
        let p1 = Problem::new(&mut r, h, hd, &[1, 1], &[2, 0, 1, 3], 4);
        let d = p1.d();
        let dup = |v: &Vec<f32>| [v.clone(), v.clone()].concat();
        let p = Problem {
            lens: vec![1; 4],
            raw: [dup(&p1.raw[0]), dup(&p1.raw[1]), dup(&p1.raw[2])],
            g: dup(&p1.g),
            beta: dup(&p1.beta),
            gate: dup(&p1.gate),
            ..p1
        };
        let x = Gpu::new(&dev, &p, 0..b);
        let (conv, st) = p.pools(&dev);
        let sl = slot_tensor(&dev, &[2, 0]);
        let out = poisoned(&dev, DType::BF16, vec![b, d]);
        // Warm-up (compiles and loads the module) on a scratch pool.
        let (conv_w, st_w) = p.pools(&dev);
        kda::kda_decode(&x.inputs(), &x.weights(), &sl, &conv_w, &st_w, &out).expect("warm-up");
        let graph = kda::capture(&dev, || kda::kda_decode(&x.inputs(), &x.weights(), &sl, &conv, &st, &out)).expect("capture");
        let mut got = Vec::new();
        for slots in [[2i32, 0], [1, 3]] {
            sl.write_bytes(bytemuck::cast_slice(&slots)).expect("slots");
            out.fill_bytes(0xFF).expect("poison");
            graph.launch().expect("replay");
            dev.synchronize().expect("sync");
            got.extend(out.to_f32_vec().expect("out"));
        }
        let (o_ref, conv_ref, s_ref, _) = cpu_reference(&p, false);
        check(&format!("graph decode hd={hd} out, slots [2, 0] then [1, 3]"), &got, &o_ref, TOL_OUT);
        check_pools(&format!("graph decode hd={hd}"), &p, &conv, &st, &conv_ref, &s_ref, TOL_F32_STATE);
    }
}

/// The capturable prefill (`kda_prefill_tables`: the sequence tables on the device) equals
/// `kda_prefill` bit for bit — output and both pools — eagerly, and replayed from a graph
/// captured while its tables named other slots (rewritten before the replay).
#[test]
fn prefill_from_device_tables_and_graph_equal_host_tables() {
    const T: &str = "kda prefill_from_device_tables_and_graph_equal_host_tables";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for hd in [128usize, 64] {
        let (h, lens, slots) = (2usize, [5usize, 3], [3u32, 1]);
        let p = Problem::new(&mut r, h, hd, &lens, &[3, 1], 5);
        let (d, n) = (p.d(), 8);
        let x = Gpu::new(&dev, &p, 0..n);
        let tables = |sl: &[u32]| {
            let t = kda::kda_tables(&lens, sl).expect("tables");
            CudaTensor::from_pod(&dev, DType::I32, vec![t.len()], &t).expect("upload")
        };
        // (output, conv pool, state pool) bytes after `f` on fresh pools.
        let run = |f: &dyn Fn(&CudaTensor, &CudaTensor, &CudaTensor)| -> Vec<Vec<u8>> {
            let (conv, st) = p.pools(&dev);
            let out = poisoned(&dev, DType::BF16, vec![n, d]);
            f(&conv, &st, &out);
            [out, conv, st].iter().map(|t| t.to_bytes().expect("download")).collect()
        };
        let host = run(&|c, s, o| kda::kda_prefill(&x.inputs(), &x.weights(), &lens, &slots, c, s, o, None).expect("kda_prefill"));
        let device = run(&|c, s, o| kda::kda_prefill_tables(&x.inputs(), &x.weights(), &lens, &tables(&slots), c, s, o).expect("kda_prefill_tables"));
        let graphed = run(&|c, s, o| {
            let t = tables(&[0, 4]);
            let graph = kda::capture(&dev, || kda::kda_prefill_tables(&x.inputs(), &x.weights(), &lens, &t, c, s, o)).expect("capture");
            t.write_bytes(bytemuck::cast_slice(&kda::kda_tables(&lens, &slots).expect("tables"))).expect("rewrite");
            graph.launch().expect("replay");
            dev.synchronize().expect("sync");
        });
        for (what, got) in [("device tables", &device), ("graph replay", &graphed)] {
            for (i, name) in ["output", "conv pool", "state pool"].iter().enumerate() {
                assert!(got[i] == host[i], "hd={hd}, {what}: the {name} differs from kda_prefill's");
            }
        }
        say(&format!("  hd={hd} lens={lens:?} slots {slots:?}: device tables and a graph captured with slots [0, 4] = kda_prefill, bit for bit"));
    }
}

/// A prefill from device tables laid out for `caps` that runs fewer rows per sequence
/// (`kda_tables_within`; a captured rollback's replay) equals `kda_prefill` over exactly those
/// rows gathered, bit for bit — both pools whole (a sequence of 0 rows leaves its slot as it
/// was) and the output rows it ran; with a second, placeholder chunk past 64 rows.
#[test]
fn prefill_within_caps_equals_prefill_of_the_rows_kept() {
    const T: &str = "kda prefill_within_caps_equals_prefill_of_the_rows_kept";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    let (caps, slots) = ([70usize, 3, 4], [3u32, 1, 0]);
    for hd in [128usize, 64] {
        let p = Problem::new(&mut r, 2, hd, &caps, &[3, 1, 0], 5);
        let (d, n) = (p.d(), caps.iter().sum::<usize>());
        let x = Gpu::new(&dev, &p, 0..n);
        for kept in [[66usize, 0, 4], [5, 3, 1]] {
            let t = kda::kda_tables_within(&caps, &kept, &slots).expect("tables");
            let t = CudaTensor::from_pod(&dev, DType::I32, vec![t.len()], &t).expect("upload");
            let (conv, st) = p.pools(&dev);
            let out = poisoned(&dev, DType::BF16, vec![n, d]);
            kda::kda_prefill_tables(&x.inputs(), &x.weights(), &caps, &t, &conv, &st, &out).expect("within caps");
            // The reference: the kept rows gathered, the sequences keeping none left out.
            let (mut rows, mut lens, mut sl, mut at) = (Vec::new(), Vec::new(), Vec::new(), 0);
            for b in 0..caps.len() {
                rows.extend((at..at + kept[b]).map(|i| i as i32));
                if kept[b] > 0 {
                    lens.push(kept[b]);
                    sl.push(slots[b]);
                }
                at += caps[b];
            }
            let ids = CudaTensor::from_pod(&dev, DType::I32, vec![rows.len()], &rows).expect("ids");
            let pick: Vec<CudaTensor> = x.t[..6]
                .iter()
                .map(|src| {
                    let o = CudaTensor::uninit(&dev, src.dtype(), vec![rows.len(), src.last_dim()]).expect("alloc");
                    k3_core::cuda::ops::gather_rows(src, &ids, &o).expect("gather");
                    o
                })
                .collect();
            let inp = KdaInputs { q: &pick[0], k: &pick[1], v: &pick[2], g: &pick[3], beta: &pick[4], gate: &pick[5] };
            let (conv_r, st_r) = p.pools(&dev);
            let out_r = poisoned(&dev, DType::BF16, vec![rows.len(), d]);
            kda::kda_prefill(&inp, &x.weights(), &lens, &sl, &conv_r, &st_r, &out_r, None).expect("kda_prefill");
            assert!(conv.to_bytes().unwrap() == conv_r.to_bytes().unwrap(), "hd={hd} kept {kept:?}: the conv pool differs");
            assert!(st.to_bytes().unwrap() == st_r.to_bytes().unwrap(), "hd={hd} kept {kept:?}: the state pool differs");
            let (o, o_r) = (out.to_bytes().unwrap(), out_r.to_bytes().unwrap());
            let ran: Vec<u8> = rows.iter().flat_map(|&i| o[i as usize * 2 * d..(i as usize + 1) * 2 * d].to_vec()).collect();
            assert!(ran == o_r, "hd={hd} kept {kept:?}: the output rows differ");
            say(&format!("  hd={hd} caps {caps:?} kept {kept:?}: = kda_prefill of the kept rows, bit for bit (pools and output)"));
        }
    }
}

#[test]
fn kda_rejects_bad_shapes() {
    const T: &str = "kda rejects_bad_shapes";
    let Some(dev) = device(T) else { return };
    let mut r = rng(T);
    for hd in [128usize, 64] {
        let p = Problem::new(&mut r, 2, hd, &[10], &[1], 2);
        let d = p.d();
        let x = Gpu::new(&dev, &p, 0..10);
        let (conv, st) = p.pools(&dev);
        let out = poisoned(&dev, DType::BF16, vec![10, d]);
        let pf = |lens: &[usize], slots: &[u32], out: &CudaTensor| kda::kda_prefill(&x.inputs(), &x.weights(), lens, slots, &conv, &st, out, None);
        // Lengths that do not add up to the rows, more sequences than slots, an f32 output.
        assert!(pf(&[9], &[1], &out).is_err());
        assert!(pf(&[5, 6], &[0, 1], &out).is_err());
        assert!(pf(&[4, 3, 3], &[0, 1, 1], &out).is_err());
        pf(&[5, 5], &[0, 1], &out).expect("two sequences in a pool of two");
        let out32 = poisoned(&dev, DType::F32, vec![10, d]);
        assert!(pf(&[10], &[1], &out32).is_err());
        // Slots: out of the pool, repeated, not one per sequence.
        assert!(pf(&[10], &[2], &out).is_err());
        assert!(pf(&[5, 5], &[1, 1], &out).is_err());
        assert!(pf(&[10], &[0, 1], &out).is_err());
        // o_norm of the wrong head dim; a state pool with another slot count than conv_state.
        let bad_norm = up(&dev, DType::F32, vec![2 * hd], &vec![1.0; 2 * hd]);
        let w = KdaWeights { o_norm: &bad_norm, ..x.weights() };
        let e = kda::kda_prefill(&x.inputs(), &w, &[10], &[1], &conv, &st, &out, None).expect_err("o_norm");
        assert!(e.to_string().contains("o_norm"), "{e}");
        let st3 = poisoned(&dev, DType::F32, vec![3, 2, hd, hd]);
        assert!(kda::kda_prefill(&x.inputs(), &x.weights(), &[10], &[1], &conv, &st3, &out, None).is_err());
        // Decode of one row: a 2-entry slot table, an f32 slot table, 10 rows for a 2-slot pool.
        let x1 = Gpu::new(&dev, &p, 0..1);
        let out1 = poisoned(&dev, DType::BF16, vec![1, d]);
        let sl1 = slot_tensor(&dev, &[1]);
        let e = kda::kda_decode(&x1.inputs(), &x1.weights(), &slot_tensor(&dev, &[1, 0]), &conv, &st, &out1).expect_err("slots [2]");
        assert!(e.to_string().contains("slots"), "{e}");
        let slf = up(&dev, DType::F32, vec![1], &[1.0]);
        assert!(kda::kda_decode(&x1.inputs(), &x1.weights(), &slf, &conv, &st, &out1).is_err());
        let sl10 = slot_tensor(&dev, &[0; 10]);
        assert!(kda::kda_decode(&x.inputs(), &x.weights(), &sl10, &conv, &st, &out).is_err());
        kda::kda_decode(&x1.inputs(), &x1.weights(), &sl1, &conv, &st, &out1).expect("a valid decode still works");
        pf(&[10], &[1], &out).expect("a valid call still works");
    }
}
