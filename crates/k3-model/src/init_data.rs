//! The bytes of a `k3 init` checkpoint (around-backbone §1.1–§1.5, §2.2): which value
//! distribution each tensor of [`weights::tensor_table`] gets ([`plan`]) and the chunked,
//! seeded generation of its bytes ([`stream`]); `init.rs` lays them out in files.
//!
//! Each tensor is generated in chunks of [`CHUNK`] values, each chunk from its own RNG seeded by
//! the checkpoint seed, the tensor name and the chunk index, so the bytes do not depend on
//! threads or shard layout. An MXFP4 pair (`weight_packed`, `weight_scale`) quantizes one normal
//! `[rows, cols]` matrix: the packed half's pass keeps each chunk's scale bytes for the scale
//! half (written after it), which then needs no second pass over the normals; a scale chunk
//! not kept (the scale half written first, or by another thread's checkpoint) is regenerated,
//! with the same bytes.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{LazyLock, Mutex, MutexGuard};

use half::bf16;
use indicatif::ProgressBar;
use k3_core::DType;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;

use crate::config::Config;
use crate::init::{ExpertFormat, InitOptions};
use crate::weights::{self, Component, Kind, TensorSpec};

/// Elements per generated chunk (each chunk has its own RNG stream).
pub const CHUNK: usize = 1 << 20;

#[derive(Clone, Copy, Debug)]
enum Dist {
    Normal {
        mean: f32,
        std: f32,
    },
    Uniform {
        lo: f32,
        hi: f32,
    },
    /// `ln U(lo, hi)` (KDA `A_log`: decay rates e^A in [1, 16]).
    LnUniform {
        lo: f32,
        hi: f32,
    },
}

/// The distribution of a float tensor, by name and shape.
fn dist_for(spec: &TensorSpec, hidden: usize) -> Dist {
    let n = &spec.name;
    let fan_in = spec.shape.iter().skip(1).product::<usize>().max(1) as f32;
    if n.ends_with("self_attn.A_log") {
        Dist::LnUniform { lo: 1.0, hi: 16.0 }
    } else if n.ends_with("dt_bias") {
        Dist::Uniform { lo: -2.0, hi: -0.2 }
    } else if n.ends_with("e_score_correction_bias") || n.ends_with("k_norm.bias") {
        Dist::Normal { mean: 0.0, std: 0.02 }
    } else if n.ends_with("norm.weight") || n.ends_with("layernorm.weight") || n.ends_with(".norm0.weight") || n.ends_with(".norm1.weight") {
        Dist::Normal { mean: 1.0, std: 0.1 }
    } else if n.ends_with("_conv1d.weight") {
        Dist::Normal { mean: 0.0, std: 0.6 / fan_in.sqrt() }
    } else if n.ends_with("_res_proj.weight") {
        Dist::Normal { mean: 0.0, std: 1.0 / (hidden as f32).sqrt() }
    } else if spec.component == Component::Embedding {
        Dist::Normal { mean: 0.0, std: 1.0 }
    } else if n.ends_with("pos_emb.weight") {
        Dist::Normal { mean: 0.0, std: 0.02 }
    } else {
        Dist::Normal { mean: 0.0, std: 1.0 / fan_in.sqrt() }
    }
}

fn sample(d: Dist, rng: &mut SmallRng) -> f32 {
    match d {
        Dist::Normal { mean, std } => mean + std * rng.sample::<f32, _>(StandardNormal),
        Dist::Uniform { lo, hi } => rng.random_range(lo..hi),
        Dist::LnUniform { lo, hi } => rng.random_range(lo..hi).ln(),
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_seed(seed: u64, name: &str) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    splitmix(seed ^ h)
}

fn chunk_rng(tensor_seed: u64, chunk: usize) -> SmallRng {
    SmallRng::seed_from_u64(splitmix(tensor_seed.wrapping_add(chunk as u64)))
}

/// Quantises 32 values to one E8M0 scale byte and 16 packed e2m1 bytes (low nibble = even
/// column; round to nearest magnitude, clip at 6).
pub fn quantize_block(v: &[f32], packed: &mut [u8]) -> u8 {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    // Scale so that amax / 2^e lies in [4, 8): the top codes (4, 6) are used, 6 clips.
    let e = if amax > 0.0 { amax.log2().floor() as i32 - 2 } else { -127 };
    let s = (e + 127).clamp(0, 254) as u8;
    let inv = 1.0 / k3_core::kernels::cpu::mxfp4::e8m0_to_f32(s);
    for (j, p) in packed.iter_mut().enumerate() {
        *p = e2m1_code(v[2 * j] * inv) | (e2m1_code(v[2 * j + 1] * inv) << 4);
    }
    s
}

/// Midpoints between consecutive E2M1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6).
const E2M1_MID: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

/// The E2M1 code of `x` (already divided by the block scale): the nearest magnitude, a tie to
/// the smaller one, clipped at 6; sign bit 8 for a negative non-zero code.
pub fn e2m1_code(x: f32) -> u8 {
    let a = x.abs();
    let m = E2M1_MID.iter().map(|&t| u8::from(a > t)).sum::<u8>();
    m | if x.is_sign_negative() && m != 0 { 8 } else { 0 }
}

/// How one tensor's bytes are produced.
#[derive(Clone, Debug)]
enum Source {
    Float {
        dist: Dist,
        dtype: DType,
        numel: usize,
        seed: u64,
    },
    /// One half of an MXFP4 pair, generated from the same normal `[rows, cols]` matrix.
    Mxfp4 {
        scale: bool,
        rows: usize,
        cols: usize,
        std: f32,
        seed: u64,
    },
}

pub(crate) struct Planned {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) dtype: DType,
    pub(crate) bytes: u64,
    src: Source,
}

pub(crate) fn plan(cfg: &Config, opts: &InitOptions) -> Vec<Planned> {
    let h = cfg.text.hidden_size;
    weights::tensor_table(cfg)
        .into_iter()
        .map(|s| {
            let numel: usize = s.shape.iter().product();
            let (dtype, src) = match s.kind {
                Kind::Mxfp4Packed | Kind::Mxfp4Scale => {
                    let rows = s.shape[0];
                    let cols = if s.kind == Kind::Mxfp4Packed { s.shape[1] * 2 } else { s.shape[1] * 32 };
                    let base = s.name.trim_end_matches("weight_packed").trim_end_matches("weight_scale");
                    (
                        DType::U8,
                        Source::Mxfp4 { scale: s.kind == Kind::Mxfp4Scale, rows, cols, std: 1.0 / (cols as f32).sqrt(), seed: name_seed(opts.seed, base) },
                    )
                }
                k => {
                    let dtype = match (k, s.expert, opts.experts) {
                        (Kind::Float32, _, _) => DType::F32,
                        (_, Some(_), ExpertFormat::Float(d)) => d.dtype(), // routed experts (an MTP layer's too)
                        _ => opts.dtype.dtype(),
                    };
                    (dtype, Source::Float { dist: dist_for(&s, h), dtype, numel, seed: name_seed(opts.seed, &s.name) })
                }
            };
            Planned { bytes: (numel * dtype.size_in_bytes()) as u64, name: s.name, shape: s.shape, dtype, src }
        })
        .collect()
}

/// The bytes of chunk `c` of a tensor (`None` past the end).
fn chunk_bytes(src: &Source, c: usize) -> Option<Vec<u8>> {
    match *src {
        Source::Float { dist, dtype, numel, seed } => {
            let start = c * CHUNK;
            if start >= numel {
                return None;
            }
            let n = CHUNK.min(numel - start);
            let mut rng = chunk_rng(seed, c);
            let mut out = Vec::with_capacity(n * dtype.size_in_bytes());
            for _ in 0..n {
                let x = sample(dist, &mut rng);
                match dtype {
                    DType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
                    _ => out.extend_from_slice(&x.to_le_bytes()),
                }
            }
            Some(out)
        }
        Source::Mxfp4 { scale, rows, cols, std, seed } => {
            let per = (CHUNK / cols).max(1);
            let r0 = c * per;
            if r0 >= rows {
                return None;
            }
            let key = (seed, rows, cols, c);
            if scale {
                if let Some(kept) = lock_kept().remove(&key) {
                    return Some(kept);
                }
            }
            let nr = per.min(rows - r0);
            let mut rng = chunk_rng(seed, c);
            let mut row = vec![0f32; cols];
            let mut packed = vec![0u8; nr * cols / 2];
            let mut scales = Vec::with_capacity(nr * cols / 32);
            for pr in packed.chunks_exact_mut(cols / 2) {
                row.iter_mut().for_each(|x| *x = std * rng.sample::<f32, _>(StandardNormal));
                for (blk, p) in row.chunks_exact(32).zip(pr.chunks_exact_mut(16)) {
                    scales.push(quantize_block(blk, p));
                }
            }
            if scale {
                return Some(scales);
            }
            lock_kept().insert(key, scales);
            Some(packed)
        }
    }
}

/// Scale chunks computed by a packed half's pass, kept for its scale half:
/// (seed, rows, cols, chunk) → bytes.
type Kept = HashMap<(u64, usize, usize, usize), Vec<u8>>;
static KEPT_SCALES: LazyLock<Mutex<Kept>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn lock_kept() -> MutexGuard<'static, Kept> {
    // A panic elsewhere while holding it leaves a map that is still valid.
    KEPT_SCALES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Drops every kept scale chunk (the end of a checkpoint: a scale half never written, after an
/// error, must not hold memory).
pub(crate) fn forget_kept_scales() {
    lock_kept().clear();
}

/// Streams one tensor's bytes into `w`, a few chunks at a time (generated in parallel).
pub(crate) fn stream(p: &Planned, w: &mut impl Write, pb: &ProgressBar) -> std::io::Result<u64> {
    let batch = rayon::current_num_threads().max(1) * 2;
    let mut written = 0u64;
    for first in (0..).step_by(batch) {
        let parts: Vec<Option<Vec<u8>>> = (first..first + batch).into_par_iter().map(|c| chunk_bytes(&p.src, c)).collect();
        let mut done = false;
        for part in parts {
            match part {
                Some(b) => {
                    w.write_all(&b)?;
                    written += b.len() as u64;
                    pb.inc(b.len() as u64);
                }
                None => done = true,
            }
        }
        if done {
            break;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_core::kernels::cpu::mxfp4::E2M1;

    /// The nearest-magnitude search `e2m1_code` replaces (ties to the smaller magnitude).
    fn code_by_search(x: f32) -> u8 {
        let a = x.abs().min(6.0);
        let mut best = 0u8;
        for c in 1..8u8 {
            if (E2M1[c as usize] - a).abs() < (E2M1[best as usize] - a).abs() {
                best = c;
            }
        }
        best | if x.is_sign_negative() && best != 0 { 8 } else { 0 }
    }

    #[test]
    fn e2m1_code_is_the_nearest_magnitude() {
        let mut xs: Vec<f32> = vec![0.0, -0.0, 6.0, 7.9, 100.0, f32::MIN_POSITIVE];
        for &m in E2M1_MID.iter().chain(E2M1.iter()) {
            for d in [-1e-6f32, 0.0, 1e-6] {
                xs.push(m + d);
                xs.push(-(m + d));
            }
        }
        let mut rng = SmallRng::seed_from_u64(7);
        xs.extend((0..100_000).map(|_| rng.random_range(-8.0f32..8.0)));
        for x in xs {
            assert_eq!(e2m1_code(x), code_by_search(x), "x = {x}");
        }
    }

    /// A scale half gives the same bytes whether its chunk was kept by the packed half's pass
    /// or generated again (the scale written first, or the kept chunk dropped).
    #[test]
    fn kept_scales_equal_regenerated_ones() {
        let (rows, cols, seed) = (40, 96, 0xfeed_u64 << 20);
        let src = |scale| Source::Mxfp4 { scale, rows, cols, std: 0.1, seed };
        let fresh: Vec<Vec<u8>> = (0..).map_while(|c| chunk_bytes(&src(true), c)).collect();
        let packed: Vec<Vec<u8>> = (0..).map_while(|c| chunk_bytes(&src(false), c)).collect();
        assert_eq!(fresh.len(), packed.len());
        assert!(lock_kept().contains_key(&(seed, rows, cols, 0)), "the packed pass keeps its scales");
        let kept: Vec<Vec<u8>> = (0..).map_while(|c| chunk_bytes(&src(true), c)).collect();
        assert_eq!(kept, fresh);
        assert!(!lock_kept().contains_key(&(seed, rows, cols, 0)), "a kept chunk is taken once");
        for (p, s) in packed.iter().zip(&fresh) {
            assert_eq!(p.len(), 16 * s.len());
        }
    }
}
