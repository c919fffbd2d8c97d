//! `k3 vision --model DIR --image PATH --out FILE.safetensors`
//!
//! Runs one image through preprocessing, the MoonViT3d tower, the `sd2_tpool` merger and the
//! projector (around-backbone §3–§4) and writes every stage: `pixel_values` f32 `[n,3,14,14]`,
//! `grid_thw` i64 `[3]`, `vit_out` f32 `[h·w, C]`, `merged` f32 `[(h/2)(w/2), 4, C]`, `projected`
//! f32 `[(h/2)(w/2), text_hidden]`. The file is written to a temporary name and renamed.

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
    #[arg(long)]
    pub image: PathBuf,
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
    let f = vm.encode_image(&a.image)?;
    write_atomic(&a.out, &f.to_safetensors()?)?;
    let [t, h, w] = f.grid_thw;
    eprintln!("wrote {} (grid {t}x{h}x{w}, {} image tokens × {})", a.out.display(), f.num_tokens, vm.spec.text_hidden);
    Ok(())
}
