//! Times `cuda::moe::experts_forward` at real K3 dims (L = 3584, F = 3072, top-16) with 64
//! experts per layer, MXFP4 and BF16, T = 1, 16, 64, 4096 (random distinct routing): CUDA
//! events, 5 warm-up calls, median of 50 (10 for T = 4096). Prints time and the bandwidth
//! achieved on the weight bytes actually read (distinct active experts × 3·F·L weights).
//! Usage: `cargo run --release --features cuda -p k3-core --example moe_bench [E]`.

use k3_core::cuda::bench::{random_tensor, time_calls};
use k3_core::cuda::moe::{experts_forward, ExpertFormat, ExpertWeights};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

fn main() -> k3_core::Result<()> {
    let dev = CudaDevice::new(0)?;
    println!("{}", dev.info());
    let e: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(64);
    let (l, f, k) = (3584usize, 3072usize, 16usize);
    for format in [ExpertFormat::Mxfp4, ExpertFormat::Bf16] {
        let w = match format {
            ExpertFormat::Mxfp4 => {
                let bytes = |shape: Vec<usize>, v: u8| -> k3_core::Result<CudaTensor> {
                    let t = CudaTensor::uninit(&dev, DType::U8, shape)?;
                    t.fill_bytes(v)?;
                    Ok(t)
                };
                ExpertWeights {
                    format,
                    num_experts: e,
                    latent: l,
                    inter: f,
                    w13: bytes(vec![e, 2 * f, l / 2], 0x3A)?,
                    w13_scale: Some(bytes(vec![e, 2 * f, l / 32], 120)?),
                    w2: bytes(vec![e, l, f / 2], 0xB1)?,
                    w2_scale: Some(bytes(vec![e, l, f / 32], 120)?),
                }
            }
            // The loop times the two serving formats only (F32 is the reference precision).
            _ => ExpertWeights {
                format,
                num_experts: e,
                latent: l,
                inter: f,
                w13: random_tensor(&dev, DType::BF16, vec![e, 2 * f, l], 1)?,
                w13_scale: None,
                w2: random_tensor(&dev, DType::BF16, vec![e, l, f], 2)?,
                w2_scale: None,
            },
        };
        let per_expert = match format {
            ExpertFormat::Mxfp4 => 3.0 * (f * l) as f64 * (0.5 + 1.0 / 32.0),
            _ => 3.0 * (f * l) as f64 * 2.0,
        };
        for t in [1usize, 16, 64, 4096] {
            // Random distinct experts per token (xorshift).
            let mut s = 0x9E3779B97F4A7C15u64 ^ t as u64;
            let mut ids = Vec::with_capacity(t * k);
            for _ in 0..t {
                let mut row: Vec<i32> = Vec::new();
                while row.len() < k {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    let c = (s % e as u64) as i32;
                    if !row.contains(&c) {
                        row.push(c);
                    }
                }
                ids.extend(row);
            }
            let mut seen = vec![false; e];
            ids.iter().for_each(|&i| seen[i as usize] = true);
            let active = seen.iter().filter(|&&b| b).count();
            let idd = CudaTensor::from_pod(&dev, DType::I32, vec![t, k], &ids)?;
            let wd = CudaTensor::from_f32(&dev, vec![t, k], &vec![1.0 / k as f32; t * k])?;
            let z = random_tensor(&dev, DType::BF16, vec![t, l], 3)?;
            let out = CudaTensor::uninit(&dev, DType::F32, vec![t, l])?;
            let reps = if t > 64 { 10 } else { 50 };
            let ms = time_calls(&dev, 5, reps, || experts_forward(&z, &idd, &wd, &w, 4.0, 25.0, 2.5, &out))?;
            let med = ms[ms.len() / 2];
            let bytes = active as f64 * per_expert;
            println!(
                "{format:?} E={e} T={t:>4}: {active:>3} active experts, {:>8.1} µs median (min {:>8.1}), weights {:>7.1} MB -> {:>6.0} GB/s",
                med * 1e3,
                ms[0] * 1e3,
                bytes / 1e6,
                bytes / (med * 1e-3) / 1e9
            );
        }
    }
    Ok(())
}
