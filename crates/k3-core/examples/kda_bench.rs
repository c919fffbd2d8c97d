//! KDA timing on the GPU: the fused chunked prefill (B = 1, H = 96, K = V = 128, T = 4096 and
//! 16384) and the fused decode step (batch 1, 4, 16 and 64, captured in a CUDA graph, each
//! beside a graph-replayed copy of the same state bytes), with the copy ceiling measured in the
//! same process. States: slot 0 (prefill) and slots 0..B (decode) of a
//! pool of exactly B. Timing as in `scripts/gpu/kda_fla_bench.py` for fla:
//! random non-zero bf16 inputs, warm-up, CUDA events, median. Prefill: one event pair around
//! each call; decode: 100 graph replays between two events, per-step mean, median of 30.
//!
//! `kda_bench [--dump DIR]`: with `--dump`, the T = 4096 inputs and our output are written to
//! DIR as raw little-endian files for the Python script's cross-check against fla.

use std::error::Error;
use std::io::Write;

use half::bf16;
use k3_core::cuda::kda::{self, KdaInputs, KdaWeights};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

const H: usize = 96;
const HD: usize = 128;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        // Uniform in ±[0.05, 1).
        let u = (self.0 >> 40) as f32 / (1u64 << 24) as f32;
        let m = 0.05 + 0.95 * u;
        if self.0 & 1 == 0 {
            m
        } else {
            -m
        }
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
}

fn bf(dev: &CudaDevice, shape: Vec<usize>, v: &[f32]) -> Result<CudaTensor, Box<dyn Error>> {
    Ok(CudaTensor::from_bf16(dev, shape, &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median milliseconds of `f`, one event pair per call.
fn time_ms(dev: &CudaDevice, warm: usize, reps: usize, mut f: impl FnMut() -> k3_core::Result<()>) -> Result<f64, Box<dyn Error>> {
    for _ in 0..warm {
        f()?;
    }
    dev.synchronize()?;
    let s = dev.stream();
    let mut ts = Vec::new();
    for _ in 0..reps {
        let (a, b) = (dev.new_event(true)?, dev.new_event(true)?);
        a.record(&s)?;
        f()?;
        b.record(&s)?;
        b.synchronize()?;
        ts.push(a.elapsed_ms(&b)? as f64);
    }
    Ok(median(ts))
}

struct Layer {
    t: Vec<CudaTensor>,
}
impl Layer {
    fn new(dev: &CudaDevice, r: &mut Rng, n: usize, b: usize) -> Result<Self, Box<dyn Error>> {
        let d = H * HD;
        let mut t = Vec::new();
        for scale in [1.0f32, 1.0, 1.0, 3.0] {
            t.push(bf(dev, vec![n, d], &r.vec(n * d, scale))?);
        }
        t.push(bf(dev, vec![n, H], &r.vec(n * H, 3.0))?);
        t.push(bf(dev, vec![n, d], &r.vec(n * d, 3.0))?);
        t.push(CudaTensor::from_f32(dev, vec![3, d, 4], &r.vec(3 * d * 4, 0.8))?);
        t.push(CudaTensor::from_f32(dev, vec![H], &r.vec(H, 1.0))?);
        t.push(CudaTensor::from_f32(dev, vec![d], &r.vec(d, 2.0))?);
        t.push(CudaTensor::from_f32(dev, vec![HD], &r.vec(HD, 1.0).iter().map(|x| 1.0 + 0.5 * x).collect::<Vec<_>>())?);
        t.push(bf(dev, vec![b, 3, 3, d], &r.vec(b * 9 * d, 1.0))?);
        t.push(CudaTensor::from_f32(dev, vec![b, H, HD, HD], &r.vec(b * H * HD * HD, 0.1))?);
        t.push(CudaTensor::uninit(dev, DType::BF16, vec![n, d])?);
        Ok(Layer { t })
    }
    fn inputs(&self) -> KdaInputs<'_> {
        KdaInputs { q: &self.t[0], k: &self.t[1], v: &self.t[2], g: &self.t[3], beta: &self.t[4], gate: &self.t[5] }
    }
    fn weights(&self) -> KdaWeights<'_> {
        KdaWeights { conv: &self.t[6], a_log: &self.t[7], dt_bias: &self.t[8], o_norm: &self.t[9], lower_bound: -5.0, eps: 1e-5 }
    }
}

fn dump(dir: &str, name: &str, t: &CudaTensor) -> Result<(), Box<dyn Error>> {
    std::fs::create_dir_all(dir)?;
    std::fs::File::create(format!("{dir}/{name}.bin"))?.write_all(&t.to_bytes()?)?;
    Ok(())
}

/// One step captured in a CUDA graph: 50 warm replays, then 100 replays between two events;
/// the per-step mean, median over 30 such measurements.
fn graph_step_ms(dev: &CudaDevice, step: impl Fn() -> k3_core::Result<()>) -> Result<f64, Box<dyn Error>> {
    let graph = kda::capture(dev, &step)?;
    for _ in 0..50 {
        graph.launch()?;
    }
    let hundred = || (0..100).try_for_each(|_| graph.launch());
    Ok(time_ms(dev, 0, 30, hundred)? / 100.0)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("kda_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dump_dir = args.iter().position(|a| a == "--dump").and_then(|i| args.get(i + 1)).cloned();
    let dev = CudaDevice::new(0)?;
    println!("{}", dev.info());
    let d = H * HD;

    // Copy ceiling: 2 GiB device-to-device (bytes read + written).
    let n_copy = 1usize << 30;
    let (src, dst) = (CudaTensor::zeros(&dev, DType::U8, vec![n_copy])?, CudaTensor::zeros(&dev, DType::U8, vec![n_copy])?);
    let ms = time_ms(&dev, 5, 20, || dst.copy_from(&src))?;
    let copy_bw = 2.0 * n_copy as f64 / (ms * 1e-3);
    println!("copy 1 GiB d2d: {ms:.4} ms = {:.0} GB/s (read+write)", copy_bw / 1e9);
    drop((src, dst));

    let mut r = Rng(0x9e3779b97f4a7c15);
    for t in [4096usize, 16384] {
        let l = Layer::new(&dev, &mut r, t, 1)?;
        let run = || kda::kda_prefill(&l.inputs(), &l.weights(), &[t], &[0], &l.t[10], &l.t[11], &l.t[12], None);
        if t == 4096 {
            if let Some(dir) = &dump_dir {
                let names = ["q", "k", "v", "g", "beta", "gate", "conv_w", "a_log", "dt_bias", "o_norm", "conv0", "s0"];
                for (i, nm) in names.iter().enumerate() {
                    dump(dir, nm, &l.t[i])?;
                }
                run()?;
                dump(dir, "out", &l.t[12])?;
                dump(dir, "s1", &l.t[11])?;
                dump(dir, "conv1", &l.t[10])?;
            }
        }
        let ms = time_ms(&dev, 3, 20, run)?;
        let mut split = Vec::new();
        for _ in 0..5 {
            split.push(kda::kda_prefill_profiled(&l.inputs(), &l.weights(), &[t], &[0], &l.t[10], &l.t[11], &l.t[12], None)?);
        }
        let (prep, scan) = (median(split.iter().map(|x| x.0 as f64).collect()), median(split.iter().map(|x| x.1 as f64).collect()));
        println!("ours prefill T={t}: split prep {prep:.4} ms + scan {scan:.4} ms");
        let nc = kda::num_chunks(&[t]);
        let cs = CudaTensor::uninit(&dev, DType::F32, vec![nc, H, HD, HD])?;
        let ms_cs = time_ms(&dev, 2, 10, || kda::kda_prefill(&l.inputs(), &l.weights(), &[t], &[0], &l.t[10], &l.t[11], &l.t[12], Some(&cs)))?;
        let bytes = (t * d * 2 * 6 + t * H * 2 + 2 * H * HD * HD * 4) as f64;
        let flops = (nc * H) as f64 * 11.5e6 * (t as f64 / (nc * 64) as f64);
        println!(
            "ours prefill T={t}: {ms:.4} ms ({:.2} M tok/s); floors: bytes {:.3} GB -> {:.3} ms at copy bw, {:.0} GFLOP -> {:.3} ms at 790 TFLOP/s; achieved {:.0} GB/s, {:.0} TFLOP/s; with chunk states: {ms_cs:.4} ms",
            t as f64 / ms / 1e3,
            bytes / 1e9,
            bytes / copy_bw * 1e3,
            flops / 1e9,
            flops / 790e12 * 1e3,
            bytes / (ms * 1e-3) / 1e9,
            flops / (ms * 1e-3) / 1e12
        );
    }

    for b in [1usize, 4, 16, 64] {
        // Floor at this size: a device-to-device copy of the state bytes, replayed the same way.
        let n_state = b * H * HD * HD * 4;
        let (src, dst) = (CudaTensor::zeros(&dev, DType::U8, vec![n_state])?, CudaTensor::zeros(&dev, DType::U8, vec![n_state])?);
        let us = graph_step_ms(&dev, || dst.copy_from(&src))? * 1e3;
        println!("copy of the B={b} state ({:.1} MB) in a graph: {us:.2} us/step = {:.0} GB/s", n_state as f64 / 1e6, 2.0 * n_state as f64 / (us * 1e-6) / 1e9);
        drop((src, dst));
        let l = Layer::new(&dev, &mut r, b, b)?;
        // Identity slots over a pool of exactly B states.
        let slots = CudaTensor::from_pod(&dev, DType::I32, vec![b], &(0..b as i32).collect::<Vec<i32>>())?;
        let step = || kda::kda_decode(&l.inputs(), &l.weights(), &slots, &l.t[10], &l.t[11], &l.t[12]);
        step()?;
        let eager = time_ms(&dev, 20, 50, step)?;
        let ms = graph_step_ms(&dev, step)?;
        let bytes = (2 * b * H * HD * HD * 4 + b * d * 2 * 6 + b * 9 * d * 2 * 2) as f64;
        println!(
            "ours decode B={b}: graph {:.2} us/step, eager {:.2} us; state+io {:.1} MB -> {:.0} GB/s = {:.0}% of copy",
            ms * 1e3,
            eager * 1e3,
            bytes / 1e6,
            bytes / (ms * 1e-3) / 1e9,
            100.0 * bytes / (ms * 1e-3) / copy_bw
        );
    }
    Ok(())
}
