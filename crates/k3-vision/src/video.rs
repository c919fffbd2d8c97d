//! Video input (around-backbone §3.6–3.7): frame sampling, per-frame resize, chunks of
//! `temporal_merge_kernel_size` frames, and the prompt framing of each chunk.
//!
//! The K3 release processor refuses video; its tower takes `t > 1` (temporal sin/cos table,
//! joint attention over the frames, temporal mean in `sd2_tpool`). The recipe here is Kimi
//! K2.5's `video_chunk` processor (Moonshot's `kimi_k25_vision_processing.py`, which vLLM's
//! `kimi_k25.py` calls), the only published one for this tower:
//! - `fps' = min(sample_fps, fps)`, `n = max(round(F·fps'/fps), 1)` (ties to even), frame
//!   indices `round(linspace(0, F−1, n))` (ties to even);
//! - every frame resized as an image (§4.2) with the patch budget `in_patch_limit_each_frame`
//!   (else `in_patch_limit`; with `in_patch_limit_video`, `min(round(limit/t), budget)` per
//!   chunk of `t` frames), padded to multiples of `patch·merge`;
//! - chunks of `k = temporal_merge_kernel_size` consecutive sampled frames, the last one
//!   shorter (not padded); a chunk is one tower sample of grid `(t, h, w)`, `t ≤ k`;
//! - each chunk renders as `{hh:mm:ss.fff}<|media_begin|>video<|media_content|>` + N ×
//!   `<|media_pad|>` + `<|media_end|>`, the time of its first frame (`index / fps`, ms
//!   truncated), `N = (h/2)(w/2)` whatever `t` is.
//!
//! Shape legend: `F` source frames at `fps`; `n` sampled; chunk `c` holds `t_c` frames and
//! `pixel_values` `[t_c·h·w, 3, ps, ps]` (frame-major, then row, then column).

use crate::error::{input, Result, VisionError};
use crate::preprocess::{pad_normalize_patchify, resize_and_fill, resize_plan_within, ProcessorConfig, ResizePlan};
use crate::video_decode::{decode_frames, probe, ClipInfo};

/// Largest video file read from disk.
pub const MAX_VIDEO_FILE_BYTES: u64 = 1 << 30;

/// Bounds on one video, checked before any frame is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VideoLimits {
    /// Most frames sampled from one video (each chunk of 4 is one tower sample).
    pub max_frames: usize,
    /// Most frames in the source clip (every one is decoded).
    pub max_source_frames: usize,
    /// Largest source frame, in pixels.
    pub max_frame_pixels: u64,
}

impl Default for VideoLimits {
    fn default() -> Self {
        VideoLimits { max_frames: 256, max_source_frames: 100_000, max_frame_pixels: 4096 * 4096 }
    }
}

/// One chunk: one tower sample of up to `temporal_merge_kernel_size` frames.
#[derive(Clone, Debug)]
pub struct VideoChunk {
    /// Seconds of its first frame (`index / fps`).
    pub time_s: f64,
    /// Source indices of its frames.
    pub frames: Vec<usize>,
    /// f32 `[t·h·w, 3, ps, ps]`.
    pub pixel_values: Vec<f32>,
    pub grid_thw: [usize; 3],
    pub plan: ResizePlan,
}

/// A preprocessed clip.
#[derive(Clone, Debug)]
pub struct PreprocessedVideo {
    pub info: ClipInfo,
    pub chunks: Vec<VideoChunk>,
}

/// Python's `round` / NumPy's `round`: halves to even.
fn round_even(x: f64) -> f64 {
    x.round_ties_even()
}

/// The sampled frame indices of a clip of `num_frames` at `fps` (see the module text).
pub fn sample_indices(num_frames: usize, fps: f64, sample_fps: f64) -> Vec<usize> {
    if num_frames == 0 {
        return Vec::new();
    }
    let rate = sample_fps.min(fps);
    let n = (round_even(num_frames as f64 * rate / fps) as usize).max(1);
    if n == 1 {
        return vec![0];
    }
    // numpy.linspace(0, F−1, n): i·step, the last exactly F−1.
    let stop = (num_frames - 1) as f64;
    let step = stop / (n - 1) as f64;
    (0..n).map(|i| if i == n - 1 { num_frames - 1 } else { round_even(i as f64 * step) as usize }).collect()
}

/// `timestamp_as_str(t, "hh:mm:ss.fff")`: `strftime("%H:%M:%S")` of `t` seconds after the epoch
/// (UTC) and the milliseconds truncated.
pub fn timestamp(t: f64) -> String {
    let secs = t.floor() as u64;
    let ms = ((t - t.floor()) * 1000.0) as u64;
    format!("{:02}:{:02}:{:02}.{ms:03}", (secs / 3600) % 24, (secs / 60) % 60, secs % 60)
}

/// One chunk's block with `num_pads` pads.
pub fn chunk_prompt_text(time_s: f64, num_pads: usize) -> String {
    format!("{}<|media_begin|>video<|media_content|>{}<|media_end|>", timestamp(time_s), "<|media_pad|>".repeat(num_pads))
}

/// The patch budget of one frame of a chunk of `t` frames.
fn frame_budget(cfg: &ProcessorConfig, t: usize) -> usize {
    let l = cfg.in_patch_limit_each_frame.unwrap_or(cfg.in_patch_limit);
    match cfg.in_patch_limit_video {
        Some(v) => (round_even(v as f64 / t as f64) as usize).min(l).max(1),
        None => l,
    }
}

/// Decodes, samples, resizes and chunks a clip (MP4/H.264, animated GIF or WebP; WebM/VP8/VP9 with
/// the `vp9` feature); `name` names it in errors. Frames are decoded one at a time; only the
/// resized sampled frames are kept.
pub fn preprocess_video_bytes(bytes: &[u8], name: &str, cfg: &ProcessorConfig, limits: &VideoLimits) -> Result<PreprocessedVideo> {
    let info = probe_video(bytes, name, limits)?;
    preprocess_probed(bytes, name, info, cfg, limits)
}

/// The demuxer and decoder see untrusted bytes: a panic inside them is a refused video.
fn guarded<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(VisionError::Image { path: name.to_string(), msg: "the video could not be decoded (corrupt or unsupported stream)".into() }))
}

/// The clip's header facts, checked against `limits` (see [`probe`]); never panics.
pub fn probe_video(bytes: &[u8], name: &str, limits: &VideoLimits) -> Result<ClipInfo> {
    guarded(name, || probe(bytes, name, limits.max_source_frames, limits.max_frame_pixels))
}

/// [`preprocess_video_bytes`] of a clip already probed (a GIF or WebP probe walks every frame,
/// so a caller that probed first passes its answer here instead of probing twice).
pub fn preprocess_probed(bytes: &[u8], name: &str, info: ClipInfo, cfg: &ProcessorConfig, limits: &VideoLimits) -> Result<PreprocessedVideo> {
    guarded(name, || preprocess_inner(bytes, name, info, cfg, limits))
}

fn preprocess_inner(bytes: &[u8], name: &str, info: ClipInfo, cfg: &ProcessorConfig, limits: &VideoLimits) -> Result<PreprocessedVideo> {
    let bad = |msg: String| VisionError::Image { path: name.to_string(), msg };
    let idx = sample_indices(info.num_frames, info.fps, cfg.sample_fps);
    if idx.len() > limits.max_frames {
        return Err(bad(format!(
            "{} frames at {:.3} fps sample to {} frames at {} fps, over the limit of {} frames per video; send a shorter clip",
            info.num_frames,
            info.fps,
            idx.len(),
            cfg.sample_fps.min(info.fps),
            limits.max_frames
        )));
    }
    let k = cfg.temporal_merge_kernel_size;
    let mut chunks = Vec::with_capacity(idx.len().div_ceil(k));
    for group in idx.chunks(k) {
        let plan = resize_plan_within(info.width, info.height, cfg, frame_budget(cfg, group.len())).map_err(|e| bad(e.to_string()))?;
        let [_, h, w] = plan.grid_thw;
        chunks.push(VideoChunk {
            time_s: group[0] as f64 / info.fps,
            frames: group.to_vec(),
            pixel_values: Vec::with_capacity(group.len() * h * w * 3 * cfg.patch_size * cfg.patch_size),
            grid_thw: [group.len(), h, w],
            plan,
        });
    }
    let mut at = 0;
    decode_frames(bytes, name, &info, &idx, &mut |_, frame| {
        let c = &mut chunks[at / k];
        let rgb = resize_and_fill(&frame, c.plan.new_width, c.plan.new_height, cfg);
        c.pixel_values.extend(pad_normalize_patchify(&rgb, &c.plan, cfg));
        at += 1;
        Ok(())
    })?;
    if at != idx.len() {
        return Err(input(format!("{name}: {at} of {} sampled frames decoded", idx.len())));
    }
    Ok(PreprocessedVideo { info, chunks })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_follows_the_reference_rounding() {
        // 10 s at 30 fps, 2 fps wanted: 20 frames over 0..299.
        let i = sample_indices(300, 30.0, 2.0);
        assert_eq!(i.len(), 20);
        assert_eq!((i[0], i[1], i[19]), (0, 16, 299));
        // The clip's own rate caps the sampling rate: every frame once.
        assert_eq!(sample_indices(5, 1.0, 8.0), vec![0, 1, 2, 3, 4]);
        // round(2.5) = 2 (ties to even), so 5 frames at 4 fps sampled at 2 fps give 2.
        assert_eq!(sample_indices(5, 4.0, 2.0), vec![0, 4]);
        assert_eq!(sample_indices(1, 25.0, 2.0), vec![0]);
        // linspace(0, 6, 5) = 0, 1.5, 3, 4.5, 6 → 0, 2, 3, 4, 6.
        assert_eq!(sample_indices(7, 7.0, 5.0), vec![0, 2, 3, 4, 6]);
        assert!(sample_indices(0, 1.0, 1.0).is_empty());
    }

    #[test]
    fn timestamps_truncate_milliseconds() {
        assert_eq!(timestamp(0.0), "00:00:00.000");
        assert_eq!(timestamp(1.2509), "00:00:01.250");
        assert_eq!(timestamp(3725.5), "01:02:05.500");
        assert_eq!(chunk_prompt_text(0.5, 2), "00:00:00.500<|media_begin|>video<|media_content|><|media_pad|><|media_pad|><|media_end|>");
    }
}
