//! `k3 bench --device cuda --op gemm|copy|rmsnorm`: the timing logic, as a library function
//! so the CLI and `examples/cuda_bench.rs` share it.
//!
//! Method (the same as `torch_ref.py` uses for PyTorch, so the two are comparable): inputs are
//! random and non-zero; `warmup` untimed calls (module compilation, handle creation and GEMM
//! autotuning happen there); then `repeats` calls enqueued back to back with a timing event
//! between each pair and no host synchronisation in between; the per-call time is the median
//! of those event intervals. GEMM counts 2·M·N·K flops; copy and RMSNorm count bytes read
//! plus bytes written.

use std::fmt;

use half::bf16;

use super::blas::{self, Algo, Backend, GemmOptions, Layout};
use super::{ops, CudaDevice, CudaTensor};
use crate::{CoreError, DType, Result};

/// One benchmark case.
#[derive(Clone, Debug, PartialEq)]
pub enum BenchOp {
    /// `out[M,N] = a[M,K] · op(b)` in `dtype` (BF16: f32 accumulate, bf16 out).
    Gemm { m: usize, n: usize, k: usize, dtype: DType, layout: Layout, opts: GemmOptions },
    /// Device-to-device `cuMemcpyDtoDAsync` of `bytes`.
    Copy { bytes: usize },
    /// RMSNorm of `[rows, dim]` in `dtype`.
    RmsNorm { rows: usize, dim: usize, dtype: DType },
    /// The decode GEMV (`cuda::gemv`): BF16 `x [m, k]` · BF16 `w [n, k]`ᵀ → F32 `[m, n]`.
    Gemv { m: usize, n: usize, k: usize },
}

impl BenchOp {
    /// From the CLI's words: `gemm [M N K]` (default 8192³, bf16, `a · bᵀ`, cuBLASLt tuned),
    /// `copy [BYTES]` (default 2 GiB), `rmsnorm [ROWS DIM]` (default 16384 × 7168, bf16),
    /// `gemv M N K` (decode GEMV, M ≤ 8).
    pub fn from_cli(op: &str, dims: &[usize]) -> Result<Self> {
        let bad = |want: &str| CoreError::Msg(format!("bench {op}: expected {want}, got {dims:?}"));
        Ok(match op {
            "gemm" => {
                let [m, n, k] = match dims {
                    [] => [8192; 3],
                    [m, n, k] => [*m, *n, *k],
                    _ => return Err(bad("M N K")),
                };
                BenchOp::Gemm { m, n, k, dtype: DType::BF16, layout: Layout::BT, opts: GemmOptions::default() }
            }
            "copy" => match dims {
                [] => BenchOp::Copy { bytes: 2 << 30 },
                [b] => BenchOp::Copy { bytes: *b },
                _ => return Err(bad("BYTES")),
            },
            "rmsnorm" => match dims {
                [] => BenchOp::RmsNorm { rows: 16384, dim: 7168, dtype: DType::BF16 },
                [r, d] => BenchOp::RmsNorm { rows: *r, dim: *d, dtype: DType::BF16 },
                _ => return Err(bad("ROWS DIM")),
            },
            "gemv" => match dims {
                [m, n, k] => BenchOp::Gemv { m: *m, n: *n, k: *k },
                _ => return Err(bad("M N K")),
            },
            _ => return Err(CoreError::Msg(format!("unknown bench op `{op}`: use gemm, gemv, copy or rmsnorm"))),
        })
    }

    fn describe(&self) -> (String, String) {
        match self {
            BenchOp::Gemm { m, n, k, dtype, layout, opts } => {
                let lay = if *layout == Layout::BT { "a·bT" } else { "a·b" };
                let be = match (opts.backend, opts.algo) {
                    (Backend::Cublas, _) => "cublas",
                    (Backend::Lt, Algo::Heuristic) => "lt-heur",
                    (Backend::Lt, Algo::Tuned) => "lt-tuned",
                    (Backend::Lt, Algo::Auto) => "lt-auto",
                };
                (format!("gemm {dtype} {lay} {be}"), format!("M={m} N={n} K={k}"))
            }
            BenchOp::Copy { bytes } => ("copy d2d".into(), format!("{:.2} GiB", *bytes as f64 / (1u64 << 30) as f64)),
            BenchOp::RmsNorm { rows, dim, dtype } => (format!("rmsnorm {dtype}"), format!("{rows}x{dim}")),
            BenchOp::Gemv { m, n, k } => ("gemv bf16 a·bT".into(), format!("M={m} N={n} K={k}")),
        }
    }
}

/// What one benchmark measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub op: String,
    pub shape: String,
    pub warmup: usize,
    pub repeats: usize,
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// Floating-point operations per call (GEMM), else 0.
    pub flops: f64,
    /// Bytes read + written per call (copy, RMSNorm; GEMM: each operand once).
    pub bytes: f64,
}

impl BenchReport {
    /// TFLOP/s at the median time.
    pub fn tflops(&self) -> f64 {
        self.flops / (self.median_ms * 1e-3) / 1e12
    }
    /// GB/s (10⁹ bytes) at the median time.
    pub fn gbps(&self) -> f64 {
        self.bytes / (self.median_ms * 1e-3) / 1e9
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:<24} {:<22} median {:>9.4} ms (min {:.4}, max {:.4}, n={})", self.op, self.shape, self.median_ms, self.min_ms, self.max_ms, self.repeats)?;
        if self.flops > 0.0 {
            write!(f, "  {:>7.1} TFLOP/s", self.tflops())
        } else {
            write!(f, "  {:>7.1} GB/s", self.gbps())
        }
    }
}

/// Deterministic non-zero pseudo-random values in ±[0.05, 1) (xorshift; no `rand` needed).
fn random_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let mag = 0.05 + 0.95 * u;
            if s & 1 == 0 {
                mag
            } else {
                -mag
            }
        })
        .collect()
}

/// A random non-zero tensor of `dtype` (F32 or BF16) on `dev`.
pub fn random_tensor(dev: &CudaDevice, dtype: DType, shape: Vec<usize>, seed: u64) -> Result<CudaTensor> {
    let v = random_values(shape.iter().product(), seed);
    match dtype {
        DType::F32 => CudaTensor::from_f32(dev, shape, &v),
        DType::BF16 => CudaTensor::from_bf16(dev, shape, &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()),
        d => Err(CoreError::DType { op: "bench random_tensor", dtype: d.to_string() }),
    }
}

/// Times `f` as described in the module docs; returns sorted per-call milliseconds.
pub fn time_calls(dev: &CudaDevice, warmup: usize, repeats: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let repeats = repeats.max(1);
    let events = (0..=repeats).map(|_| dev.new_event(true)).collect::<Result<Vec<_>>>()?;
    let stream = dev.stream();
    events[0].record(&stream)?;
    for e in &events[1..] {
        f()?;
        e.record(&stream)?;
    }
    dev.synchronize()?;
    let mut ms = events.windows(2).map(|w| w[0].elapsed_ms(&w[1]).map(|v| v as f64)).collect::<Result<Vec<_>>>()?;
    ms.sort_by(f64::total_cmp);
    Ok(ms)
}

/// Runs one benchmark on `dev` (see the module docs for the method).
pub fn bench_op(dev: &CudaDevice, op: &BenchOp, warmup: usize, repeats: usize) -> Result<BenchReport> {
    let (name, shape) = op.describe();
    let (ms, flops, bytes) = match *op {
        BenchOp::Gemm { m, n, k, dtype, layout, opts } => {
            let a = random_tensor(dev, dtype, vec![m, k], 1)?;
            let b = random_tensor(dev, dtype, if layout == Layout::BT { vec![n, k] } else { vec![k, n] }, 2)?;
            let c = CudaTensor::uninit(dev, dtype, vec![m, n])?;
            let ms = time_calls(dev, warmup, repeats, || blas::gemm(&a, &b, &c, layout, opts))?;
            let sz = dtype.size_in_bytes() as f64;
            (ms, 2.0 * m as f64 * n as f64 * k as f64, sz * (m * k + n * k + m * n) as f64)
        }
        BenchOp::Copy { bytes } => {
            let src = CudaTensor::uninit(dev, DType::U8, vec![bytes])?;
            src.fill_bytes(0x5A)?;
            let dst = CudaTensor::uninit(dev, DType::U8, vec![bytes])?;
            let ms = time_calls(dev, warmup, repeats, || dst.copy_from(&src))?;
            (ms, 0.0, 2.0 * bytes as f64)
        }
        BenchOp::RmsNorm { rows, dim, dtype } => {
            let x = random_tensor(dev, dtype, vec![rows, dim], 3)?;
            let w = random_tensor(dev, dtype, vec![dim], 4)?;
            let y = CudaTensor::uninit(dev, dtype, vec![rows, dim])?;
            let ms = time_calls(dev, warmup, repeats, || ops::rms_norm(&x, &w, 1e-6, &y))?;
            (ms, 0.0, dtype.size_in_bytes() as f64 * (2 * rows * dim + dim) as f64)
        }
        BenchOp::Gemv { m, n, k } => {
            let x = random_tensor(dev, DType::BF16, vec![m, k], 1)?;
            let w = random_tensor(dev, DType::BF16, vec![n, k], 2)?;
            let y = CudaTensor::uninit(dev, DType::F32, vec![m, n])?;
            let ms = time_calls(dev, warmup, repeats, || super::gemv::gemv(&x, &[(&w, &y)]))?;
            // Reported as bandwidth (the weight dominates): bytes of x, w and y.
            (ms, 0.0, (2 * (m * k + n * k) + 4 * m * n) as f64)
        }
    };
    let median = if ms.len() % 2 == 1 { ms[ms.len() / 2] } else { 0.5 * (ms[ms.len() / 2 - 1] + ms[ms.len() / 2]) };
    Ok(BenchReport { op: name, shape, warmup, repeats: ms.len(), median_ms: median, min_ms: ms[0], max_ms: ms[ms.len() - 1], flops, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn cli_parsing_and_random_values() {
        assert!(matches!(BenchOp::from_cli("gemm", &[]).unwrap(), BenchOp::Gemm { m: 8192, n: 8192, k: 8192, .. }));
        assert!(matches!(BenchOp::from_cli("gemm", &[4096, 12288, 7168]).unwrap(), BenchOp::Gemm { m: 4096, n: 12288, k: 7168, .. }));
        assert_eq!(BenchOp::from_cli("copy", &[]).unwrap(), BenchOp::Copy { bytes: 2 << 30 });
        assert!(BenchOp::from_cli("gemm", &[1, 2]).is_err());
        assert!(BenchOp::from_cli("conv", &[]).unwrap_err().to_string().contains("conv"));
        let v = random_values(10_000, 5);
        assert!(v.iter().all(|x| x.abs() >= 0.05 && x.abs() < 1.0));
        assert!(v.iter().filter(|x| **x < 0.0).count() > 4000);
    }
}
