//! `k3 vision --model DIR --image PATH --out FILE.safetensors`
//! `k3 vision --model DIR --video PATH --out FILE.safetensors`
//!
//! Runs one image through preprocessing, the MoonViT3d tower, the `sd2_tpool` merger and the
//! projector (around-backbone §3–§4) and writes every stage: `pixel_values` f32 `[n,3,14,14]`,
//! `grid_thw` i64 `[3]`, `vit_out` f32 `[h·w, C]`, `merged` f32 `[(h/2)(w/2), 4, C]`, `projected`
//! f32 `[(h/2)(w/2), text_hidden]`. A video writes those per chunk as `chunk{c}.…` (grid
//! `(t, h, w)`, t ≤ 4) plus `time_s` f32 `[chunks]` and `frames` i64 `[chunks, 4]` (source frame
//! indices, −1 past a short chunk). The file is written to a temporary name and renamed.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use k3_model::Checkpoint;
use k3_vision::VisionModel;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (config.json with vision_config, safetensors, preprocessor_config.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Image file (PNG, JPEG or WebP).
    #[arg(long, required_unless_present = "video", conflicts_with = "video")]
    pub image: Option<PathBuf>,
    /// Video file (MP4/H.264, animated GIF or WebP; WebM/VP8/VP9 in a build with `--features vp9`).
    #[arg(long)]
    pub video: Option<PathBuf>,
    /// Frames sampled from the video at most.
    #[arg(long, default_value_t = k3_vision::video::VideoLimits::default().max_frames)]
    pub max_video_frames: usize,
    /// Output .safetensors path.
    #[arg(long)]
    pub out: PathBuf,
}

/// Writes `bytes` to `path` atomically (temporary file in the same directory, then rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().with_context(|| format!("--out {} has no file name", path.display()))?;
    let tmp = dir.join(format!(".{}.tmp.{}", name.to_string_lossy(), std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()));
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    let ck = Checkpoint::open(&a.model)?;
    ck.check()?;
    let vm = VisionModel::load(&ck)?;
    if let Some(v) = &a.video {
        let limits = k3_vision::video::VideoLimits { max_frames: a.max_video_frames, ..Default::default() };
        let f = vm.encode_video(v, &limits)?;
        write_atomic(&a.out, &f.to_safetensors()?)?;
        let pads: usize = f.chunks.iter().map(|c| c.2.num_tokens).sum();
        let i = &f.info;
        eprintln!(
            "wrote {} ({} {}x{}, {} frames at {:.3} fps; {} chunks, {pads} video tokens × {})",
            a.out.display(),
            i.format,
            i.width,
            i.height,
            i.num_frames,
            i.fps,
            f.chunks.len(),
            vm.spec.text_hidden
        );
        return Ok(());
    }
    let Some(image) = &a.image else { anyhow::bail!("give --image PATH or --video PATH") };
    let f = vm.encode_image(image)?;
    write_atomic(&a.out, &f.to_safetensors()?)?;
    let [t, h, w] = f.grid_thw;
    eprintln!("wrote {} (grid {t}x{h}x{w}, {} image tokens × {})", a.out.display(), f.num_tokens, vm.spec.text_hidden);
    Ok(())
}
