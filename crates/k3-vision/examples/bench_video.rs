//! Benchmark (not a test): decoding + preprocessing of a synthetic H.264 clip (OpenH264-encoded
//! here, muxed into MP4) through `video::preprocess_video_bytes` at the K3 processor settings
//! (`sample_fps` 8, 16384 patches per frame, chunks of 4), against OpenH264's bare decode of the
//! same clip measured in the same process (every frame decoded, none converted: the floor of
//! this path, since every frame must be decoded).
//!
//! `cargo run --release -p k3-vision --example bench_video -- [--frames 32] [--size 448] [--fps 8] [--iters 3]`
//! (`--fps 8`: all 32 frames sampled; `--frames 120 --fps 30`: 4 s of 30 fps, 32 frames sampled)

use std::time::Instant;

use k3_vision::preprocess::ProcessorConfig;
use k3_vision::video::{preprocess_video_bytes, VideoLimits};

fn arg(name: &str, default: usize) -> usize {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[path = "../tests/support/h264_clip.rs"]
mod h264_clip;

/// A moving gradient with texture, so frames are not trivially compressible.
fn textured(i: usize, s: usize) -> Vec<u8> {
    (0..s * s)
        .flat_map(|p| {
            let (x, y) = (p % s, p / s);
            [((x + 4 * i) % 256) as u8, ((y * 3 + i) % 256) as u8, ((x ^ y) % 256) as u8]
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (frames, size, fps, iters) = (arg("--frames", 32), arg("--size", 448), arg("--fps", 8), arg("--iters", 3));
    let bytes = h264_clip::mp4_clip(frames, fps as f64, size, size, &|i| textured(i, size))?;
    let cfg: ProcessorConfig = serde_json::from_value(serde_json::json!({
        "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
        "fixed_output_tokens": null, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "transparent_bg_fill_stage": "after_resize",
        "in_patch_limit_each_frame": 16384, "sample_fps": 8.0, "temporal_merge_kernel_size": 4
    }))?;
    let info = k3_vision::video_decode::probe(&bytes, "bench.mp4", usize::MAX, u64::MAX)?;
    // Every frame decoded, only the last converted to RGB: the decoder's own cost.
    let last = [info.num_frames - 1];
    println!("clip: {frames} frames {size}x{size} at {fps} fps, {} bytes of H.264; {} rayon threads", bytes.len(), rayon::current_num_threads());
    let (mut tdec, mut tpre) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..iters {
        let t0 = Instant::now();
        k3_vision::video_decode::decode_frames(&bytes, "bench.mp4", &info, &last, &mut |_, _| Ok(()))?;
        tdec = tdec.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        let v = preprocess_video_bytes(&bytes, "bench.mp4", &cfg, &VideoLimits::default())?;
        tpre = tpre.min(t0.elapsed().as_secs_f64());
        std::hint::black_box(&v);
    }
    let v = preprocess_video_bytes(&bytes, "bench.mp4", &cfg, &VideoLimits::default())?;
    let toks: usize = v.chunks.iter().map(|c| c.plan.num_tokens).sum();
    println!(
        "decode only (OpenH264, every frame): {:.1} ms ({:.0} frames/s)\npreprocess (decode + sample + RGB + resize + patchify): {:.1} ms = {:.2}× the decode; {} sampled frames, {} chunks, grid {:?}, {toks} video tokens",
        tdec * 1e3,
        frames as f64 / tdec,
        tpre * 1e3,
        tpre / tdec,
        v.chunks.iter().map(|c| c.frames.len()).sum::<usize>(),
        v.chunks.len(),
        v.chunks[0].grid_thw
    );
    Ok(())
}
