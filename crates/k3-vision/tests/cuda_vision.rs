//! The MoonViT3d tower, `sd2_tpool` merger and projector on the GPU (`k3_vision::cuda`, issue 24)
//! against the CPU path (`tower.rs`, `merger.rs`, `projector.rs`) and the golden vision fixture.
//!
//! Tolerances, per-row relative L2 over every stage (`vit_out` rows of C, `merged` rows of 4·C,
//! `projected` rows of the text width; every row is RMS-normed or a mean of normed rows, so no
//! row is near zero):
//! - `Precision::F32` (f32 GEMMs without TF32, f32 everything): [`TOL_F32`] on random configs,
//!   the fixture's own 5e-5 (tests/golden.rs, `common::TOL`) on `vision_small_f32`. The only
//!   differences from the CPU are summation orders (cuBLAS vs the `gemm` crate, block
//!   reductions), `expf`/`tanhf` ulps, and the position and time rows added as one sum.
//! - `Precision::Bf16` (weights and every GEMM input BF16, f32 accumulation, the qkv and fc0
//!   GEMM outputs and the attention probabilities rounded to BF16 before RoPE, GELU and `P·V`;
//!   the residual stream f32): [`TOL_BF16`], a bound chosen from bf16's 2^-9
//!   relative rounding compounded over 2–3 random layers (not measured on a GPU when written:
//!   the test prints every measured figure). A wrong kernel (RoPE axis, a sample attending to
//!   another, a merge order) moves rows by O(1).
//!
//! Samples: images of several sizes packed in one call, and video chunks of t = 2, 3, 4 frames
//! (temporal sincos, joint attention over the frames, temporal mean), on three tower shapes:
//! the video tests' tiny tower (hd 24), a wider one (hd 16, 3 layers), and one with the
//! released head dim 128. BF16 attention runs the fused flash kernel at all three head dims,
//! F32 the cuBLAS form.
//!
//! Without a GPU every test prints `skipped` and passes; `K3_REQUIRE_CUDA=1` makes that a failure.
#![cfg(feature = "cuda")]

mod common;
use common::*;
#[path = "../../../tests/support/cuda.rs"]
mod cuda_support;
#[path = "support/video_common.rs"]
mod video_common;

use k3_core::cuda::CudaDevice;
use k3_model::Checkpoint;
use k3_vision::cuda::{CudaVision, Precision};
use k3_vision::{ImageFeatures, TowerDims, VisionModel};
use rand::Rng;

/// F32 reference precision on random configs.
const TOL_F32: f64 = 1e-4;
/// BF16 serving precision (see the module docs).
const TOL_BF16: f64 = 5e-2;

/// The video tests' tower, a wider one, and one with the released head dim (128).
const CONFIGS: [(TowerDims, usize); 3] = [
    (video_common::DIMS, 16),
    (TowerDims { hidden: 64, heads: 4, qkv: 64, intermediate: 96, layers: 3, patch: 14, pos_h: 5, pos_w: 5, pos_t: 4 }, 48),
    (TowerDims { hidden: 128, heads: 2, qkv: 256, intermediate: 256, layers: 2, patch: 14, pos_h: 8, pos_w: 6, pos_t: 4 }, 64),
];

/// Four images of different sizes and three video chunks (t = 2, 3, 4), packed in this order.
const GRIDS: [[usize; 3]; 7] = [[1, 4, 6], [1, 2, 2], [1, 6, 4], [1, 8, 10], [2, 4, 4], [3, 2, 6], [4, 6, 6]];

fn device(test: &str) -> Option<CudaDevice> {
    cuda_support::device(test)
}

fn model(d: TowerDims, th: usize, seed: u64) -> VisionModel {
    video_common::model_for(d, th, &video_common::weights_for(d, th, seed), video_common::processor(8.0))
}

/// Random pixels in [-1, 1] for each grid.
fn samples(rng: &mut impl Rng, grids: &[[usize; 3]]) -> Vec<(Vec<f32>, [usize; 3])> {
    grids.iter().map(|&g| ((0..g[0] * g[1] * g[2] * 588).map(|_| rng.random_range(-1.0f32..1.0)).collect(), g)).collect()
}

/// The largest per-row relative L2 of the three stages of `got` against `want`, asserting `tol`.
fn compare(what: &str, got: (&[f32], &[f32], &[f32]), want: &ImageFeatures, c: usize, th: usize, tol: f64) -> f64 {
    let r = [max_rel_l2(got.0, &want.vit_out, c), max_rel_l2(got.1, &want.merged, 4 * c), max_rel_l2(got.2, &want.projected, th)];
    eprintln!("{what}: max per-row rel-L2 vit_out {:.2e} merged {:.2e} projected {:.2e}", r[0], r[1], r[2]);
    for (stage, v) in ["vit_out", "merged", "projected"].iter().zip(r) {
        assert!(v <= tol, "{what}: {stage} max per-row rel-L2 {v:.3e} > {tol:.0e}");
    }
    r.into_iter().fold(0.0, f64::max)
}

fn gpu_matches_cpu(test: &str, precision: Precision, tol: f64) {
    let Some(dev) = device(test) else { return };
    let mut rng = cuda_support::rng(test);
    for (ci, &(d, th)) in CONFIGS.iter().enumerate() {
        let m = model(d, th, 100 + ci as u64);
        let s = samples(&mut rng, &GRIDS);
        let want: Vec<ImageFeatures> = s.iter().map(|(p, g)| m.encode_pixels(p.clone(), *g).unwrap()).collect();
        let gpu = CudaVision::upload(&m, &dev, precision).unwrap();
        let views: Vec<(&[f32], [usize; 3])> = s.iter().map(|(p, g)| (p.as_slice(), *g)).collect();
        let got = gpu.encode(&m.tower, &views).unwrap();
        assert_eq!(got.len(), GRIDS.len());
        let mut worst = 0f64;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("config {ci} ({precision:?}) sample {i} grid {:?}", GRIDS[i]);
            worst = worst.max(compare(&what, (&g.vit_out, &g.merged, &g.projected), w, d.hidden, th, tol));
        }
        eprintln!("{test}: config {ci}: worst per-row rel-L2 {worst:.3e} (bound {tol:.0e})");
    }
}

#[test]
fn packed_images_and_video_chunks_match_cpu_f32() {
    gpu_matches_cpu("packed_images_and_video_chunks_match_cpu_f32", Precision::F32, TOL_F32);
}

#[test]
fn packed_images_and_video_chunks_match_cpu_bf16() {
    gpu_matches_cpu("packed_images_and_video_chunks_match_cpu_bf16", Precision::Bf16, TOL_BF16);
}

/// A sample's outputs do not depend on what else is packed beside it: changing every other
/// sample's pixels (same grids, so the same GEMM shapes) leaves its rows unchanged.
#[test]
fn packed_samples_do_not_see_each_other() {
    let test = "packed_samples_do_not_see_each_other";
    let Some(dev) = device(test) else { return };
    let mut rng = cuda_support::rng(test);
    let (d, th) = CONFIGS[2];
    let m = model(d, th, 7);
    let gpu = CudaVision::upload(&m, &dev, Precision::F32).unwrap();
    let a = samples(&mut rng, &GRIDS);
    let mut b = samples(&mut rng, &GRIDS);
    b[4] = a[4].clone();
    let run = |s: &[(Vec<f32>, [usize; 3])]| gpu.encode(&m.tower, &s.iter().map(|(p, g)| (p.as_slice(), *g)).collect::<Vec<_>>()).unwrap();
    let (ra, rb) = (run(&a), run(&b));
    let r = max_rel_l2(&rb[4].projected, &ra[4].projected, th).max(max_rel_l2(&rb[4].vit_out, &ra[4].vit_out, d.hidden));
    eprintln!("{test}: video chunk t=2 with other neighbours: max per-row rel-L2 {r:.2e}");
    assert!(r <= 1e-6, "sample 4 changed by {r:.3e} when only the other samples changed");
    assert!(max_rel_l2(&rb[3].projected, &ra[3].projected, th) > 1e-2, "different pixels must give different features");
}

/// The second call over the same grids (position rows from the device cache, pixels and
/// features through the staging buffer again) gives the first call's bits, and a second CPU
/// tower of the same dims (another position table) is not served the first one's cached rows.
#[test]
fn warm_position_rows_give_the_cold_bits() {
    let test = "warm_position_rows_give_the_cold_bits";
    let Some(dev) = device(test) else { return };
    let mut rng = cuda_support::rng(test);
    let (d, th) = CONFIGS[1];
    let (m, other) = (model(d, th, 21), model(d, th, 22));
    let gpu = CudaVision::upload(&m, &dev, Precision::Bf16).unwrap();
    let s = samples(&mut rng, &GRIDS);
    let views: Vec<(&[f32], [usize; 3])> = s.iter().map(|(p, g)| (p.as_slice(), *g)).collect();
    let (cold, warm) = (gpu.encode(&m.tower, &views).unwrap(), gpu.encode(&m.tower, &views).unwrap());
    for (i, (a, b)) in cold.iter().zip(&warm).enumerate() {
        assert!(a.vit_out == b.vit_out && a.merged == b.merged && a.projected == b.projected, "sample {i}: the warm call differs");
    }
    let fresh = CudaVision::upload(&m, &dev, Precision::Bf16).unwrap();
    let want = fresh.encode(&other.tower, &views).unwrap();
    let got = gpu.encode(&other.tower, &views).unwrap();
    assert!(got.iter().zip(&want).all(|(a, b)| a.vit_out == b.vit_out), "rows cached from another tower were used");
    assert!(got[0].vit_out != cold[0].vit_out, "the two towers' position tables must differ");
}

/// A model with the GPU attached runs every encode there: `encode_pixels`, `pending` +
/// `complete` (the server's split), `project_batch` and a decoded video clip give what the
/// uploaded stages give, within the F32 tolerance of the CPU model's results.
#[test]
fn attached_model_encodes_images_and_videos_on_the_gpu() {
    let test = "attached_model_encodes_images_and_videos_on_the_gpu";
    let Some(dev) = device(test) else { return };
    let mut rng = cuda_support::rng(test);
    let (d, th) = CONFIGS[0];
    let cpu = model(d, th, 11);
    let mut m = model(d, th, 11);
    m.attach_cuda(&dev, Precision::F32).unwrap();
    assert!(m.on_gpu() && !cpu.on_gpu());
    let s = samples(&mut rng, &GRIDS);
    let want: Vec<ImageFeatures> = s.iter().map(|(p, g)| cpu.encode_pixels(p.clone(), *g).unwrap()).collect();
    // One at a time.
    for (i, (p, g)) in s.iter().enumerate() {
        let f = m.encode_pixels(p.clone(), *g).unwrap();
        assert_eq!(f.num_tokens, want[i].num_tokens);
        compare(&format!("encode_pixels {i}"), (&f.vit_out, &f.merged, &f.projected), &want[i], d.hidden, th, TOL_F32);
    }
    // Pending, then completed together (packed).
    let mut pend: Vec<ImageFeatures> = s.iter().map(|(p, g)| m.pending(p.clone(), *g).unwrap()).collect();
    assert!(pend.iter().all(|f| f.projected.is_empty()));
    m.complete(&mut pend.iter_mut().collect::<Vec<_>>()).unwrap();
    for (i, f) in pend.iter().enumerate() {
        compare(&format!("complete {i}"), (&f.vit_out, &f.merged, &f.projected), &want[i], d.hidden, th, TOL_F32);
    }
    // Serving's setting: only the projected features come back, the same bits.
    m.set_gpu_stages(false);
    let mut lean: Vec<ImageFeatures> = s.iter().map(|(p, g)| m.pending(p.clone(), *g).unwrap()).collect();
    m.complete(&mut lean.iter_mut().collect::<Vec<_>>()).unwrap();
    for (f, g) in lean.iter().zip(&pend) {
        assert!(f.vit_out.is_empty() && f.merged.is_empty(), "set_gpu_stages(false) still returned the stages");
        assert_eq!(f.projected, g.projected, "projected features differ without the stages");
    }
    m.set_gpu_stages(true);
    // One packed tower call through project_batch.
    let all: Vec<f32> = s.iter().flat_map(|x| x.0.iter().copied()).collect();
    let proj = m.project_batch(&all, &GRIDS, None).unwrap();
    for (i, p) in proj.iter().enumerate() {
        let r = max_rel_l2(p, &want[i].projected, th);
        assert!(r <= TOL_F32, "project_batch sample {i}: {r:.3e}");
    }
    // A decoded clip (an animated GIF: chunks of 4 and 1 frames).
    let gif = gif_clip::gif_clip();
    let limits = k3_vision::video::VideoLimits::default();
    let (vg, vc) = (m.encode_video_bytes(&gif, "clip.gif", &limits).unwrap(), cpu.encode_video_bytes(&gif, "clip.gif", &limits).unwrap());
    assert_eq!(vg.chunks.len(), vc.chunks.len());
    assert!(vc.chunks.iter().any(|c| c.2.grid_thw[0] > 1), "the clip must give a chunk of several frames");
    for (i, (g, c)) in vg.chunks.iter().zip(&vc.chunks).enumerate() {
        assert_eq!((g.0, &g.1, g.2.grid_thw), (c.0, &c.1, c.2.grid_thw));
        compare(&format!("video chunk {i} grid {:?}", c.2.grid_thw), (&g.2.vit_out, &g.2.merged, &g.2.projected), &c.2, d.hidden, th, TOL_F32);
    }
}

#[path = "../../../tests/support/gif_clip.rs"]
mod gif_clip;

/// Bad input is refused on the GPU path with the CPU path's messages, before any launch.
#[test]
fn bad_grids_are_refused_like_the_cpu() {
    let test = "bad_grids_are_refused_like_the_cpu";
    let Some(dev) = device(test) else { return };
    let (d, th) = CONFIGS[0];
    let m = model(d, th, 3);
    let gpu = CudaVision::upload(&m, &dev, Precision::Bf16).unwrap();
    let px = vec![0.5f32; 3 * 5 * 588];
    let e = gpu.encode(&m.tower, &[(&px, [1, 3, 5])]).err().expect("odd grid").to_string();
    assert!(e.contains("3x5") && e.contains("merge kernel"), "{e}");
    let e = gpu.encode(&m.tower, &[(&px[..588], [1, 2, 2])]).err().expect("short pixels").to_string();
    assert!(e.contains("pixel_values hold 588"), "{e}");
    let e = gpu.encode(&m.tower, &[(&vec![0f32; 5 * 4 * 588], [5, 2, 2])]).err().expect("too many frames").to_string();
    assert!(e.contains("5 frames") && e.contains("init_pos_emb_time"), "{e}");
}

/// The golden fixture on the GPU: every traced block and the final stages of the batched
/// tower, and each image's merged and projected rows, against `reference.safetensors`.
fn golden_on_gpu(test: &str, precision: Precision, tol: f64) {
    let Some(dev) = device(test) else { return };
    let mut m = VisionModel::load(&Checkpoint::open(&vision_fixture()).unwrap()).unwrap();
    m.attach_cuda(&dev, precision).unwrap();
    let r = Reference::open();
    let check = |what: &str, got: &[f32], want: &[f32], width: usize| {
        let e = max_rel_l2(got, want, width);
        eprintln!("{test}: {what}: max per-row rel-L2 {e:.3e}");
        assert!(e <= tol, "{what}: max per-row rel-L2 {e:.3e} > {tol:.0e}");
    };
    let (_, pixels) = r.f32("pixel_values");
    let grids: Vec<[usize; 3]> = r.i64("grid_thws").chunks(3).map(|c| [c[0] as usize, c[1] as usize, c[2] as usize]).collect();
    let c = m.spec.tower.hidden;
    let mut seen = Vec::new();
    let mut trace = |name: &str, x: &[f32]| {
        check(name, x, &r.f32(name).1, c);
        seen.push(name.to_string());
    };
    let projected = m.project_batch(&pixels, &grids, Some(&mut trace)).unwrap();
    assert_eq!(seen, vec!["vit_patch_embed", "vit_block0_out", "vit_block1_out"]);
    check("projected", &projected.concat(), &r.f32("projected").1, m.spec.text_hidden);
    for i in 0..3 {
        let (_, px) = r.f32(&format!("pixel_values_{i}"));
        let f = m.encode_pixels(px, r.grid(&format!("grid_thw_{i}"))).unwrap();
        check(&format!("vit_out_{i}"), &f.vit_out, &r.f32(&format!("vit_out_{i}")).1, c);
        check(&format!("merged_{i}"), &f.merged, &r.f32(&format!("merged_{i}")).1, c);
        check(&format!("projected_{i}"), &f.projected, &r.f32(&format!("projected_{i}")).1, m.spec.text_hidden);
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_fixture_on_gpu_f32() {
    golden_on_gpu("golden_fixture_on_gpu_f32", Precision::F32, TOL);
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_fixture_on_gpu_bf16() {
    golden_on_gpu("golden_fixture_on_gpu_bf16", Precision::Bf16, TOL_BF16);
}
