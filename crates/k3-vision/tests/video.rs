//! Video input (around-backbone §3.3, §3.6–3.7; K2.5's chunk recipe, `k3_vision::video`):
//! synthetic clips made here (H.264 in MP4 through OpenH264 and the `mp4` writer; animated GIF
//! through `image`), a random tiny tower, and a float64 reference of the tower and merger for
//! chunks of t = 1..4 frames.

use k3_core::Tensor;
use k3_vision::video::{preprocess_video_bytes, VideoLimits};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

#[path = "support/video_common.rs"]
mod video_common;
use video_common::*;

/// Frame `i` of the synthetic clips: red = 8·i, a green ramp across, blue constant.
fn frame_rgb(i: usize, w: usize, h: usize) -> Vec<u8> {
    (0..w * h).flat_map(|p| [(8 * i) as u8, (p % w * 255 / w) as u8, 90]).collect()
}

#[path = "support/h264_clip.rs"]
mod h264_clip;

/// An MP4 of `n` frames [`frame_rgb`] at `fps`.
fn mp4_clip(n: usize, fps: f64, w: usize, h: usize) -> Vec<u8> {
    h264_clip::mp4_clip(n, fps, w, h, &|i| frame_rgb(i, w, h)).unwrap()
}

/// An animated GIF of `n` frames, `delay_ms` each.
fn gif_clip(n: usize, delay_ms: u32, w: usize, h: usize) -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = image::codecs::gif::GifEncoder::new(&mut out);
        for i in 0..n {
            let rgba: Vec<u8> = frame_rgb(i, w, h).chunks(3).flat_map(|p| [p[0], p[1], p[2], 255]).collect();
            let buf = image::RgbaImage::from_raw(w as u32, h as u32, rgba).unwrap();
            enc.encode_frame(image::Frame::from_parts(buf, 0, 0, image::Delay::from_numer_denom_ms(delay_ms, 1))).unwrap();
        }
    }
    out
}

#[test]
fn mp4_frames_are_sampled_timed_and_chunked() {
    // 24 frames at 12 fps, sampled at 8 fps: round(24·8/12) = 16 frames in 4 chunks of 4.
    let clip = mp4_clip(24, 12.0, 64, 48);
    let v = preprocess_video_bytes(&clip, "clip.mp4", &processor(8.0), &VideoLimits::default()).unwrap();
    assert_eq!((v.info.width, v.info.height, v.info.num_frames), (64, 48, 24));
    assert!((v.info.fps - 12.0).abs() < 1e-9, "{}", v.info.fps);
    let frames: Vec<usize> = v.chunks.iter().flat_map(|c| c.frames.clone()).collect();
    assert_eq!(frames, vec![0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 20, 21, 23]);
    assert_eq!(v.chunks.len(), 4);
    for c in &v.chunks {
        assert_eq!(c.grid_thw[0], 4);
        assert!((c.time_s - c.frames[0] as f64 / 12.0).abs() < 1e-12);
        // The budget of 24 patches per frame: 64×48 → 4·4.58 … resized and padded to 28s.
        assert!(c.grid_thw[1] * c.grid_thw[2] <= 24 + 12, "{:?}", c.grid_thw);
        assert_eq!(c.pixel_values.len(), c.grid_thw.iter().product::<usize>() * 588);
        for (j, &src) in c.frames.iter().enumerate() {
            let r = mean_red(&c.pixel_values, c.grid_thw, j, c.plan.new_width, c.plan.new_height);
            assert!((r - 8.0 * src as f64).abs() < 6.0, "frame {src}: mean red {r}, want {}", 8 * src);
        }
    }
    // 25 frames: a last chunk of one frame, kept (not padded).
    let clip = mp4_clip(25, 25.0, 32, 32);
    let v = preprocess_video_bytes(&clip, "clip.mp4", &processor(5.0), &VideoLimits::default()).unwrap();
    let t: Vec<usize> = v.chunks.iter().map(|c| c.grid_thw[0]).collect();
    assert_eq!(t, vec![4, 1]);
    assert_eq!(v.chunks[1].frames, vec![24]);
    assert_eq!(k3_vision::video::timestamp(v.chunks[1].time_s), "00:00:00.960");
}

/// A High-profile x264 clip with B-frames (tests/data/README.md): decoded in presentation order
/// (frame i has red 5·i), at its average rate of 24 fps, not the media header's.
#[test]
fn b_frames_come_out_in_presentation_order() {
    let clip = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/x264_high_bframes.mp4")).unwrap();
    let v = preprocess_video_bytes(&clip, "x264_high_bframes.mp4", &processor(24.0), &VideoLimits::default()).unwrap();
    assert_eq!((v.info.num_frames, v.info.fps, v.info.width, v.info.height), (48, 24.0, 96, 64));
    let mut n = 0;
    for c in &v.chunks {
        for (j, &src) in c.frames.iter().enumerate() {
            let r = mean_red(&c.pixel_values, c.grid_thw, j, c.plan.new_width, c.plan.new_height);
            assert!((r - 5.0 * src as f64).abs() < 3.0, "frame {src}: mean red {r}, want {}", 5 * src);
            n += 1;
        }
    }
    assert_eq!(n, 48);
}

#[test]
fn gif_frames_follow_their_delays() {
    // 10 frames of 250 ms: 4 fps, sampled at 2 fps → 5 frames: linspace(0, 9, 5) = 0, 2.25, 4.5, 6.75, 9.
    let clip = gif_clip(10, 250, 40, 30);
    let v = preprocess_video_bytes(&clip, "clip.gif", &processor(2.0), &VideoLimits::default()).unwrap();
    assert!((v.info.fps - 4.0).abs() < 1e-9);
    let frames: Vec<usize> = v.chunks.iter().flat_map(|c| c.frames.clone()).collect();
    assert_eq!(frames, vec![0, 2, 4, 7, 9]);
    assert_eq!(v.chunks.iter().map(|c| c.time_s).collect::<Vec<_>>(), vec![0.0, 2.25]);
    let c = &v.chunks[1];
    let r = mean_red(&c.pixel_values, c.grid_thw, 0, c.plan.new_width, c.plan.new_height);
    assert!((r - 72.0).abs() < 4.0, "frame 9: mean red {r}");
}

/// A one-frame video gives exactly the image path's features for the same pixels.
#[test]
fn one_frame_video_equals_the_image_path() {
    let w = weights();
    let vm = model(&w, processor(2.0));
    for (clip, name) in [(mp4_clip(1, 10.0, 60, 44), "one.mp4"), (gif_clip(1, 100, 60, 44), "one.gif")] {
        let v = vm.encode_video_bytes(&clip, name, &VideoLimits::default()).unwrap();
        assert_eq!(v.chunks.len(), 1);
        let (_, frames, f) = &v.chunks[0];
        assert_eq!((frames.as_slice(), f.grid_thw[0]), (&[0usize][..], 1));
        // The same decoded frame as a PNG, through the image path.
        let info = k3_vision::video_decode::probe(&clip, name, 10, 1 << 20).unwrap();
        let mut png = Vec::new();
        k3_vision::video_decode::decode_frames(&clip, name, &info, &[0], &mut |_, d| {
            let ct = if d.raster.bands == 3 { image::ExtendedColorType::Rgb8 } else { image::ExtendedColorType::Rgba8 };
            image::ImageEncoder::write_image(image::codecs::png::PngEncoder::new(&mut png), &d.raster.data, d.raster.w as u32, d.raster.h as u32, ct).unwrap();
            Ok(())
        })
        .unwrap();
        let img = vm.encode_bytes(&png, "frame.png").unwrap();
        assert_eq!(img.grid_thw, f.grid_thw);
        assert_eq!(img.pixel_values, f.pixel_values, "{name}: pixels");
        assert_eq!(img.projected, f.projected, "{name}: projected rows");
        assert!(v.prompt_text().starts_with("00:00:00.000<|media_begin|>video<|media_content|><|media_pad|>"));
        assert_eq!(v.prompt_text().matches("<|media_pad|>").count(), f.num_tokens);
    }
}

// ---- float64 reference of §3.1–3.7 for one sample (h, w equal to the position table) ----

fn tensor64(w: &HashMap<String, Tensor>, n: &str) -> Vec<f64> {
    w[n].to_f32().unwrap().iter().map(|&x| x as f64).collect()
}

/// `y[r] = W · x[r]` with `W` `[out, in]`.
fn lin(x: &[f64], wt: &[f64], out: usize) -> Vec<f64> {
    let inn = wt.len() / out;
    x.chunks(inn).flat_map(|r| (0..out).map(move |o| r.iter().zip(&wt[o * inn..(o + 1) * inn]).map(|(a, b)| a * b).sum::<f64>())).collect()
}

fn rms(x: &[f64], g: &[f64]) -> Vec<f64> {
    let eps = f32::EPSILON as f64;
    x.chunks(g.len())
        .flat_map(|r| {
            let s = (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + eps).sqrt();
            r.iter().zip(g).map(move |(v, g)| v / s * g)
        })
        .collect()
}

fn reference(w: &HashMap<String, Tensor>, pixels: &[f32], [t, h, wd]: [usize; 3]) -> Vec<f64> {
    let (c, dq, heads) = (DIMS.hidden, DIMS.qkv, DIMS.heads);
    let hd = dq / heads;
    let l = t * h * wd;
    let px: Vec<f64> = pixels.iter().map(|&v| v as f64).collect();
    let mut x = lin(&px, &tensor64(w, "vision_tower.patch_embed.proj.weight"), c);
    let pos = tensor64(w, "vision_tower.patch_embed.pos_emb.weight");
    for n in 0..l {
        let (tau, p) = (n / (h * wd), n % (h * wd));
        for k in 0..c {
            x[n * c + k] += pos[p * c + k];
            if t > 1 {
                // §3.3: concat(sin(τ·ω), cos(τ·ω)), ω_j = 10000^(−j/(C/2)).
                let j = k % (c / 2);
                let a = tau as f64 * 10000f64.powf(-(j as f64) / (c as f64 / 2.0));
                x[n * c + k] += if k < c / 2 { a.sin() } else { a.cos() };
            }
        }
    }
    for b in 0..DIMS.layers {
        let p = format!("vision_tower.encoder.blocks.{b}.");
        let hn = rms(&x, &tensor64(w, &format!("{p}norm0.weight")));
        let mut qkv = lin(&hn, &tensor64(w, &format!("{p}wqkv.weight")), 3 * dq);
        for n in 0..l {
            let (r, col) = ((n % (h * wd)) / wd, n % wd);
            for part in 0..2 {
                for head in 0..heads {
                    for j in 0..hd / 2 {
                        let (pp, k) = if j % 2 == 0 { (col, j / 2) } else { (r, j / 2) };
                        let a = pp as f64 * 10000f64.powf(-(4.0 * k as f64) / hd as f64);
                        let i0 = n * 3 * dq + part * dq + head * hd + 2 * j;
                        let (u, v) = (qkv[i0], qkv[i0 + 1]);
                        qkv[i0] = u * a.cos() - v * a.sin();
                        qkv[i0 + 1] = u * a.sin() + v * a.cos();
                    }
                }
            }
        }
        // Joint attention over all t·h·w patches of the sample.
        let mut att = vec![0f64; l * dq];
        for head in 0..heads {
            for i in 0..l {
                let q = &qkv[i * 3 * dq + head * hd..][..hd];
                let s: Vec<f64> =
                    (0..l).map(|j| q.iter().zip(&qkv[j * 3 * dq + dq + head * hd..][..hd]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()).collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..l {
                    for d in 0..hd {
                        att[i * dq + head * hd + d] += e[j] / z * qkv[j * 3 * dq + 2 * dq + head * hd + d];
                    }
                }
            }
        }
        let o = lin(&att, &tensor64(w, &format!("{p}wo.weight")), c);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let hn = rms(&x, &tensor64(w, &format!("{p}norm1.weight")));
        let f: Vec<f64> = lin(&hn, &tensor64(w, &format!("{p}mlp.fc0.weight")), DIMS.intermediate)
            .into_iter()
            .map(|u| 0.5 * u * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (u + 0.044715 * u * u * u)).tanh()))
            .collect();
        let o = lin(&f, &tensor64(w, &format!("{p}mlp.fc1.weight")), c);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    }
    let x = rms(&x, &tensor64(w, "vision_tower.encoder.final_layernorm.weight"));
    // §3.7: 2×2 space-to-depth, mean over τ; token (R, C), element (dy·2+dx)·C + ch.
    let (mh, mw) = (h / 2, wd / 2);
    let mut out = vec![0f64; mh * mw * 4 * c];
    for tau in 0..t {
        for r in 0..h {
            for col in 0..wd {
                let tok = (r / 2) * mw + col / 2;
                let sub = (r % 2) * 2 + col % 2;
                for ch in 0..c {
                    out[(tok * 4 + sub) * c + ch] += x[(tau * h * wd + r * wd + col) * c + ch] / t as f64;
                }
            }
        }
    }
    out
}

#[test]
fn chunks_of_one_to_four_frames_match_a_float64_reference() {
    let w = weights();
    let vm = model(&w, processor(2.0));
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for t in 1..=4 {
        let grid = [t, DIMS.pos_h, DIMS.pos_w];
        let pixels: Vec<f32> = (0..grid.iter().product::<usize>() * 588).map(|_| rng.random_range(-1.0..1.0)).collect();
        let f = vm.encode_pixels(pixels.clone(), grid).unwrap();
        let want = reference(&w, &pixels, grid);
        let err = f.merged.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt() / want.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(err < 1e-5, "t = {t}: merged rel-L2 {err:.2e}");
        assert_eq!(f.num_tokens, (DIMS.pos_h / 2) * (DIMS.pos_w / 2));
    }
}

/// The server's split with the tower on the CPU: `pending` (grid checked, stages empty) then
/// `complete` gives `encode_pixels`'s stages bit for bit, for images and t = 2..4 chunks alike;
/// and `position_rows` (what the GPU tower adds to the patch embeddings) is what the CPU tower
/// adds (zero pixels: the patch embedding is 0, so the traced rows are the additions alone).
#[test]
fn pending_then_complete_is_encode_pixels_and_position_rows_are_the_towers() {
    let vm = model(&weights(), processor(2.0));
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let grids = [[1, 4, 6], [2, 2, 4], [3, 4, 2], [4, 2, 2]];
    let px: Vec<Vec<f32>> = grids.iter().map(|g| (0..g[0] * g[1] * g[2] * 588).map(|_| rng.random_range(-1.0f32..1.0)).collect()).collect();
    let mut pend: Vec<_> = px.iter().zip(&grids).map(|(p, &g)| vm.pending(p.clone(), g).unwrap()).collect();
    assert!(pend.iter().all(|f| f.vit_out.is_empty() && f.projected.is_empty()));
    vm.complete(&mut pend.iter_mut().collect::<Vec<_>>()).unwrap();
    for ((f, p), &g) in pend.iter().zip(&px).zip(&grids) {
        let want = vm.encode_pixels(p.clone(), g).unwrap();
        assert_eq!((&f.vit_out, &f.merged, &f.projected, f.num_tokens), (&want.vit_out, &want.merged, &want.projected, want.num_tokens), "{g:?}");
    }
    assert!(vm.pending(vec![0.0; 3 * 5 * 588], [1, 3, 5]).unwrap_err().to_string().contains("merge kernel"));
    assert!(vm.pending(vec![0.0; 588], [1, 2, 2]).unwrap_err().to_string().contains("pixel_values hold 588"));
    let l: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
    let mut added = Vec::new();
    let mut trace = |name: &str, x: &[f32]| {
        if name == "vit_patch_embed" {
            added = x.to_vec();
        }
    };
    vm.tower.forward(&vec![0.0; l * 588], &grids, Some(&mut trace)).unwrap();
    assert_eq!(vm.tower.position_rows(&grids), added);
}

#[test]
fn corrupt_unsupported_and_oversize_videos_are_refused() {
    let cfg = processor(2.0);
    let lim = VideoLimits::default();
    let e = |b: &[u8], l: &VideoLimits| preprocess_video_bytes(b, "messages[0].content[1].video_url", &cfg, l).unwrap_err().to_string();
    let m = e(b"", &lim);
    assert!(m.contains("video_url") && m.contains("empty"), "{m}");
    assert!(e(b"hello, not a video at all", &lim).contains("not a recognised video"));
    // WebM without the `vp9` feature: refused with the two ways out (tests/webm.rs has it with).
    #[cfg(not(feature = "vp9"))]
    {
        let m = e(&[0x1A, 0x45, 0xDF, 0xA3, 1, 2, 3, 4], &lim);
        assert!(m.contains("WebM") && m.contains("ffmpeg") && m.contains("--features vp9"), "{m}");
    }
    let clip = mp4_clip(12, 12.0, 32, 32);
    for cut in [clip.len() / 3, clip.len() - 20] {
        let m = e(&clip[..cut], &lim);
        assert!(m.contains("video_url"), "{m}");
    }
    let mut broken = clip.clone();
    let mdat = broken.windows(4).position(|w| w == b"mdat").unwrap();
    for b in &mut broken[mdat + 40..mdat + 400] {
        *b ^= 0x5A;
    }
    let _ = preprocess_video_bytes(&broken, "broken.mp4", &cfg, &lim); // an error or noisy frames, never a panic
    let m = e(&clip, &VideoLimits { max_frames: 1, ..lim });
    assert!(m.contains("over the limit of 1 frames"), "{m}");
    let m = e(&clip, &VideoLimits { max_frame_pixels: 1000, ..lim });
    assert!(m.contains("32x32") && m.contains("over the limit"), "{m}");
    let m = e(&gif_clip(3, 100, 8, 8), &VideoLimits { max_source_frames: 2, ..lim });
    assert!(m.contains("over the limit"), "{m}");
}

/// Corrupt MP4s end in an error or in frames, never in a hang or a panic: the fuzzer-found file
/// that hung the demuxer, and 300 seeded mutations (bytes, runs of 0xff, truncations) of the
/// B-frame clip.
#[test]
fn mutated_mp4s_never_hang_or_panic() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/");
    let hang = std::fs::read(format!("{dir}corrupt_box_sizes.mp4")).unwrap();
    let e = within(10, move || preprocess_video_bytes(&hang, "corrupt_box_sizes.mp4", &processor(8.0), &VideoLimits::default()).map(|_| ()));
    assert!(e.unwrap_err().to_string().contains("corrupt MP4"));
    let clip = std::fs::read(format!("{dir}x264_high_bframes.mp4")).unwrap();
    let (ok, bad) = mutation_outcomes(clip, "mutated.mp4", 12345);
    assert_eq!(ok + bad, 300);
    assert!(bad > 0, "mutations must be refused sometimes");
}
