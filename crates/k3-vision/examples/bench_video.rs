//! Benchmark (not a test): decoding + preprocessing of a synthetic H.264 clip (OpenH264-encoded
//! here, muxed into MP4) through `video::preprocess_video_bytes` at the K3 processor settings
//! (`sample_fps` 8, 16384 patches per frame, chunks of 4), against OpenH264's bare decode of the
//! same clip measured in the same process (every frame decoded, none converted: the floor of
//! this path, since every frame must be decoded).
//!
//! `cargo run --release -p k3-vision --example bench_video -- [--frames 32] [--size 448] [--fps 8] [--iters 3]`
//! (`--fps 8`: all 32 frames sampled; `--frames 120 --fps 30`: 4 s of 30 fps, 32 frames sampled)

use std::io::Cursor;
use std::time::Instant;

use k3_vision::preprocess::ProcessorConfig;
use k3_vision::video::{preprocess_video_bytes, VideoLimits};

fn arg(name: &str, default: usize) -> usize {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn clip(n: usize, fps: usize, s: usize) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    use openh264::formats::{RgbSliceU8, YUVBuffer};
    // Frame skipping off: every source frame is a sample.
    let ecfg = openh264::encoder::EncoderConfig::new().skip_frames(false).bitrate(openh264::encoder::BitRate::from_bps(8_000_000));
    let mut enc = openh264::encoder::Encoder::with_api_config(openh264::OpenH264API::from_source(), ecfg)?;
    let (mut sps, mut pps, mut samples) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        // A moving gradient with texture, so frames are not trivially compressible.
        let rgb: Vec<u8> = (0..s * s)
            .flat_map(|p| {
                let (x, y) = (p % s, p / s);
                [((x + 4 * i) % 256) as u8, ((y * 3 + i) % 256) as u8, ((x ^ y) % 256) as u8]
            })
            .collect();
        let bs = enc.encode(&YUVBuffer::from_rgb8_source(RgbSliceU8::new(&rgb, (s, s))))?.to_vec();
        let mut avcc = Vec::new();
        for nal in openh264::nal_units(&bs) {
            let nal = nal.strip_prefix(&[0, 0, 0, 1][..]).or(nal.strip_prefix(&[0, 0, 1][..])).unwrap_or(nal);
            match nal[0] & 0x1f {
                7 => sps = nal.to_vec(),
                8 => pps = nal.to_vec(),
                _ => {
                    avcc.extend_from_slice(&(nal.len() as u32).to_be_bytes());
                    avcc.extend_from_slice(nal);
                }
            }
        }
        samples.push(avcc);
    }
    let cfg = mp4::Mp4Config { major_brand: "isom".parse()?, minor_version: 512, compatible_brands: vec!["isom".parse()?], timescale: 1000 };
    let mut wr = mp4::Mp4Writer::write_start(Cursor::new(Vec::new()), &cfg)?;
    let media_conf = mp4::MediaConfig::AvcConfig(mp4::AvcConfig { width: s as u16, height: s as u16, seq_param_set: sps, pic_param_set: pps });
    wr.add_track(&mp4::TrackConfig { track_type: mp4::TrackType::Video, timescale: (fps * 100) as u32, language: "und".into(), media_conf })?;
    for (i, b) in samples.into_iter().enumerate() {
        wr.write_sample(1, &mp4::Mp4Sample { start_time: i as u64 * 100, duration: 100, rendering_offset: 0, is_sync: i == 0, bytes: b.into() })?;
    }
    wr.write_end()?;
    Ok(wr.into_writer().into_inner())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (frames, size, fps, iters) = (arg("--frames", 32), arg("--size", 448), arg("--fps", 8), arg("--iters", 3));
    let bytes = clip(frames, fps, size)?;
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
