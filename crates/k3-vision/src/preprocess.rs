//! Image preprocessing of `KimiK3VisionProcessor` (around-backbone §4): decode → resize plan
//! (§4.2, never upscales; limits from the model directory's `preprocessor_config.json`) →
//! Pillow-exact resize in the image's own mode → transparent-background fill (chessboard) →
//! pad right/bottom with black to multiples of `patch·merge` → normalise with mean/std →
//! patchify (§4.3).
//!
//! Shape legend: `W×H` original pixels; `new_w×new_h` resized; `h = (new_h+pad_h)/14`,
//! `w = (new_w+pad_w)/14` patches; `pixel_values` f32 `[h·w, 3, 14, 14]` (patches row-major over
//! the grid, each patch channel-first); `grid_thw = [1, h, w]`.
//!
//! Modes follow Pillow's reading of the file: PNG grey/RGB/palette/1-bit, with or without alpha
//! or a `tRNS` key; JPEG grey/RGB; WebP RGB/RGBA. Sixteen-bit PNG samples keep their high byte,
//! as Pillow's `;16B` raw modes do (16-bit grey, Pillow's `I;16`, is read the same way here).

use std::path::Path;

use serde::Deserialize;

use crate::error::{Result, VisionError};
use crate::resample::{resize_bicubic, resize_nearest, Raster};

/// Pillow's `DecompressionBombError` threshold (2 × `MAX_IMAGE_PIXELS`): larger images are refused.
pub const MAX_PIXELS: u64 = 2 * 89_478_485;
/// Largest image file read.
pub const MAX_FILE_BYTES: u64 = 256 << 20;

/// `merge_kernel_size` is an int in the processor config and a pair in `vision_config`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MergeKernel {
    One(usize),
    Two([usize; 2]),
}

impl MergeKernel {
    pub fn square(&self) -> Option<usize> {
        match *self {
            MergeKernel::One(k) => Some(k),
            MergeKernel::Two([a, b]) => (a == b).then_some(a),
        }
    }
}

/// `transparent_bg_config` (defaults as the reference dataclass).
#[derive(Clone, Debug, Deserialize)]
pub struct TransparentBg {
    #[serde(default = "black")]
    pub pattern: String,
    #[serde(default = "sixteen")]
    pub chessboard_square_size: usize,
    #[serde(default = "yes")]
    pub chessboard_square_on_top_left: bool,
    #[serde(default = "u8_255")]
    pub chessboard_white_value: u8,
    #[serde(default = "u8_200")]
    pub chessboard_gray_value: u8,
}
fn black() -> String {
    "black".into()
}
fn sixteen() -> usize {
    16
}
fn yes() -> bool {
    true
}
fn u8_255() -> u8 {
    255
}
fn u8_200() -> u8 {
    200
}
fn before_resize() -> String {
    "before_resize".into()
}

/// `preprocessor_config.json → media_proc_cfg`. The limits are always read from the file.
#[derive(Clone, Debug, Deserialize)]
pub struct ProcessorConfig {
    pub patch_size: usize,
    pub merge_kernel_size: MergeKernel,
    pub in_patch_limit: usize,
    pub patch_limit_on_one_side: usize,
    #[serde(default)]
    pub fixed_output_tokens: Option<usize>,
    pub image_mean: [f64; 3],
    pub image_std: [f64; 3],
    #[serde(default)]
    pub transparent_bg_config: Option<TransparentBg>,
    #[serde(default = "before_resize")]
    pub transparent_bg_fill_stage: String,
    /// Video (around-backbone §3.6, K2.5-style chunks; see `video`): frames sampled per second
    /// (capped at the clip's own rate).
    #[serde(default = "two")]
    pub sample_fps: f64,
    /// Patch budget of one video frame (`None`: `in_patch_limit`).
    #[serde(default)]
    pub in_patch_limit_each_frame: Option<usize>,
    /// Patch budget of one video chunk, shared by its frames (`None`: no chunk budget).
    #[serde(default)]
    pub in_patch_limit_video: Option<usize>,
    /// Frames per video chunk (one tower sample with `t` ≤ this).
    #[serde(default = "four")]
    pub temporal_merge_kernel_size: usize,
}
fn two() -> f64 {
    2.0
}
fn four() -> usize {
    4
}

impl ProcessorConfig {
    /// Reads `DIR/preprocessor_config.json` (its `media_proc_cfg` object, or a bare one).
    pub fn from_model_dir(dir: &Path) -> Result<ProcessorConfig> {
        Self::from_file(&dir.join("preprocessor_config.json"))
    }

    pub fn from_file(path: &Path) -> Result<ProcessorConfig> {
        let bad = |msg: String| VisionError::Config { path: path.display().to_string(), msg };
        let s = std::fs::read_to_string(path)
            .map_err(|e| bad(format!("cannot read it ({e}); the model directory must hold the image processor's preprocessor_config.json")))?;
        let v: serde_json::Value = serde_json::from_str(&s).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let cfg = v.get("media_proc_cfg").cloned().unwrap_or(v);
        let c: ProcessorConfig =
            serde_json::from_value(cfg).map_err(|e| bad(format!("`media_proc_cfg` does not match the KimiK3VisionProcessor schema: {e}")))?;
        c.validate().map_err(bad)?;
        Ok(c)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.patch_size == 0 || self.in_patch_limit == 0 || self.patch_limit_on_one_side == 0 {
            return Err("patch_size, in_patch_limit and patch_limit_on_one_side must be > 0".into());
        }
        match self.merge_kernel_size.square() {
            Some(k) if k > 0 => {}
            _ => return Err(format!("merge_kernel_size {:?} must be one positive size (square kernel)", self.merge_kernel_size)),
        }
        if self.fixed_output_tokens.is_some() {
            return Err("fixed_output_tokens is set; only null (tokens from the grid) is supported, as in the release".into());
        }
        if !(self.sample_fps > 0.0 && self.sample_fps.is_finite()) {
            return Err(format!("sample_fps {} must be a positive number of frames per second", self.sample_fps));
        }
        if self.temporal_merge_kernel_size == 0 || self.in_patch_limit_each_frame == Some(0) || self.in_patch_limit_video == Some(0) {
            return Err("temporal_merge_kernel_size, in_patch_limit_each_frame and in_patch_limit_video must be > 0".into());
        }
        if self.image_std.iter().any(|&s| s == 0.0 || !s.is_finite()) {
            return Err(format!("image_std {:?} must be finite and non-zero", self.image_std));
        }
        if !matches!(self.transparent_bg_fill_stage.as_str(), "before_resize" | "after_resize") {
            return Err(format!("transparent_bg_fill_stage `{}` is not before_resize or after_resize", self.transparent_bg_fill_stage));
        }
        if let Some(t) = &self.transparent_bg_config {
            if !matches!(t.pattern.as_str(), "white" | "black" | "gray" | "chessboard") {
                return Err(format!("transparent_bg_config.pattern `{}` is not white, black, gray or chessboard", t.pattern));
            }
            if t.pattern == "chessboard" && t.chessboard_square_size == 0 {
                return Err("transparent_bg_config.chessboard_square_size must be > 0".into());
            }
        }
        Ok(())
    }

    /// The merge kernel side (2 in the release).
    pub fn merge(&self) -> usize {
        self.merge_kernel_size.square().unwrap_or(2)
    }
}

/// `navit_resize_image`'s answer for one image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResizePlan {
    pub new_width: usize,
    pub new_height: usize,
    pub pad_width: usize,
    pub pad_height: usize,
    pub num_tokens: usize,
    /// `(t, h, w)` in patches.
    pub grid_thw: [usize; 3],
}

/// The resize plan (§4.2) of a `width × height` image. Errors where the reference asserts.
pub fn resize_plan(width: usize, height: usize, cfg: &ProcessorConfig) -> Result<ResizePlan> {
    resize_plan_within(width, height, cfg, cfg.in_patch_limit)
}

/// [`resize_plan`] with the patch budget `limit` in place of `in_patch_limit` (video frames use
/// `in_patch_limit_each_frame`).
pub fn resize_plan_within(width: usize, height: usize, cfg: &ProcessorConfig, limit: usize) -> Result<ResizePlan> {
    if width == 0 || height == 0 {
        return Err(crate::error::input(format!("image size {width}x{height} is empty")));
    }
    let (ps, mk, l, s) = (cfg.patch_size, cfg.merge(), limit, cfg.patch_limit_on_one_side);
    let s1 = (l as f64 / (((width / ps).max(1) as f64) * ((height / ps).max(1) as f64))).sqrt();
    let s2 = (s * ps) as f64 / width as f64;
    let s3 = (s * ps) as f64 / height as f64;
    let scale = 1.0f64.min(s1).min(s2).min(s3);
    let new_w = (((width as f64 * scale) as usize).max(1)).min(s * ps);
    let new_h = (((height as f64 * scale) as usize).max(1)).min(s * ps);
    let factor = mk * ps;
    let pad_w = (factor - new_w % factor) % factor;
    let pad_h = (factor - new_h % factor) % factor;
    let (th, tw) = ((new_h + pad_h) / factor, (new_w + pad_w) / factor);
    if th * mk > s || tw * mk > s {
        return Err(crate::error::input(format!(
            "image {width}x{height} gives {th}x{tw} tokens, over patch_limit_on_one_side {s} (the reference asserts here)"
        )));
    }
    Ok(ResizePlan {
        new_width: new_w,
        new_height: new_h,
        pad_width: pad_w,
        pad_height: pad_h,
        num_tokens: th * tw,
        grid_thw: [1, (new_h + pad_h) / ps, (new_w + pad_w) / ps],
    })
}

/// How Pillow would hold the decoded image (its mode), which decides the resize filter and
/// the transparency handling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `1`: NEAREST resize, no alpha.
    Bilevel,
    /// `L` (optionally with a `tRNS` grey key that becomes alpha 0 after the resize).
    L {
        key: Option<u8>,
    },
    LA,
    /// `RGB` (a `tRNS` colour key is ignored: the reference returns RGB images unchanged).
    Rgb,
    Rgba,
    /// `P`: NEAREST resize on the palette indices; `alpha` when the file has `tRNS`.
    Palette {
        alpha: bool,
    },
}

/// A decoded image: pixels plus the mode Pillow would give it.
#[derive(Clone, Debug)]
pub struct Decoded {
    pub mode: Mode,
    /// Bands: L/1 → 1, LA → 2, RGB and palette without alpha → 3, RGBA and palette with alpha → 4.
    pub raster: Raster,
}

/// The processor's output for one image.
#[derive(Clone, Debug)]
pub struct Preprocessed {
    /// f32 `[h·w, 3, ps, ps]`.
    pub pixel_values: Vec<f32>,
    pub grid_thw: [usize; 3],
    /// Original `(width, height)` (what the prompt's `image WxH` names).
    pub orig_size: (usize, usize),
    pub plan: ResizePlan,
}

fn img_err(name: &str, msg: impl Into<String>) -> VisionError {
    VisionError::Image { path: name.to_string(), msg: msg.into() }
}

/// Reads and preprocesses the image file at `path`.
pub fn preprocess_file(path: &Path, cfg: &ProcessorConfig) -> Result<Preprocessed> {
    let (name, bytes) = read_media_file(path, MAX_FILE_BYTES)?;
    preprocess_bytes(&bytes, &name, cfg)
}

/// The name and bytes of a regular file of at most `limit` bytes (an image or a video).
pub fn read_media_file(path: &Path, limit: u64) -> Result<(String, Vec<u8>)> {
    let name = path.display().to_string();
    let meta = std::fs::metadata(path).map_err(|e| img_err(&name, format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(img_err(&name, "is not a regular file"));
    }
    if meta.len() > limit {
        return Err(img_err(&name, format!("is enormous: {} bytes, over the {} MiB limit", meta.len(), limit >> 20)));
    }
    let bytes = std::fs::read(path).map_err(|e| img_err(&name, format!("cannot read it: {e}")))?;
    Ok((name, bytes))
}

/// Original size and resize plan of an image file, from its header alone (for rendering the
/// prompt block `image WxH` and its N pads before any pixel is decoded).
pub fn plan_file(path: &Path, cfg: &ProcessorConfig) -> Result<((usize, usize), ResizePlan)> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| img_err(&name, format!("cannot read it: {e}")))?;
    let fmt = image::guess_format(&bytes)
        .map_err(|_| img_err(&name, "is not a recognised image (corrupt, or not an image at all); supported formats are PNG, JPEG and WebP"))?;
    if !matches!(fmt, image::ImageFormat::Png | image::ImageFormat::Jpeg | image::ImageFormat::WebP) {
        return Err(img_err(&name, format!("format {fmt:?} is unsupported; supported formats are PNG, JPEG and WebP")));
    }
    let (w, h) = image::ImageReader::with_format(std::io::Cursor::new(&bytes), fmt)
        .into_dimensions()
        .map_err(|e| img_err(&name, format!("corrupt or truncated {fmt:?} data: {e}")))?;
    let (w, h) = (w as usize, h as usize);
    if w == 0 || h == 0 {
        return Err(img_err(&name, format!("is zero-sized ({w}x{h})")));
    }
    Ok(((w, h), resize_plan(w, h, cfg).map_err(|e| img_err(&name, e.to_string()))?))
}

/// Preprocesses encoded image bytes; `name` is used in error messages.
pub fn preprocess_bytes(bytes: &[u8], name: &str, cfg: &ProcessorConfig) -> Result<Preprocessed> {
    let dec = decode(bytes, name)?;
    let (w, h) = (dec.raster.w, dec.raster.h);
    let plan = resize_plan(w, h, cfg).map_err(|e| img_err(name, e.to_string()))?;
    let rgb = resize_and_fill(&dec, plan.new_width, plan.new_height, cfg);
    let pixel_values = pad_normalize_patchify(&rgb, &plan, cfg);
    Ok(Preprocessed { pixel_values, grid_thw: plan.grid_thw, orig_size: (w, h), plan })
}

/// The PNG facts Pillow's mode depends on: colour type, bit depth, and the `tRNS` chunk.
struct PngInfo {
    color_type: u8,
    bit_depth: u8,
    trns: Option<Vec<u8>>,
}

fn png_info(b: &[u8]) -> Option<PngInfo> {
    let mut p = 8;
    let (mut color_type, mut bit_depth, mut trns) = (None, 0, None);
    while p + 8 <= b.len() {
        let len = u32::from_be_bytes([b[p], b[p + 1], b[p + 2], b[p + 3]]) as usize;
        let ty = &b[p + 4..p + 8];
        let data = b.get(p + 8..p + 8 + len)?;
        match ty {
            b"IHDR" if data.len() >= 13 => {
                bit_depth = data[8];
                color_type = Some(data[9]);
            }
            b"tRNS" => trns = Some(data.to_vec()),
            b"IDAT" | b"IEND" => break,
            _ => {}
        }
        p += 12 + len;
    }
    Some(PngInfo { color_type: color_type?, bit_depth, trns })
}

/// `(width, height)` of PNG, JPEG or WebP bytes from their header alone (nothing decoded),
/// refusing empty, unrecognised, unsupported, zero-sized and enormous images.
pub fn dimensions(bytes: &[u8], name: &str) -> Result<(u32, u32)> {
    header(bytes, name).map(|(_, w, h)| (w, h))
}

fn header(bytes: &[u8], name: &str) -> Result<(image::ImageFormat, u32, u32)> {
    use image::ImageFormat as F;
    if bytes.is_empty() {
        return Err(img_err(name, "is empty (0 bytes): not an image"));
    }
    let fmt = image::guess_format(bytes)
        .map_err(|_| img_err(name, "is not a recognised image (corrupt, or not an image at all); supported formats are PNG, JPEG and WebP"))?;
    if !matches!(fmt, F::Png | F::Jpeg | F::WebP) {
        return Err(img_err(name, format!("format {fmt:?} is unsupported; supported formats are PNG, JPEG and WebP")));
    }
    let corrupt = |e: image::ImageError| img_err(name, format!("corrupt or truncated {fmt:?} data: {e}"));
    let (w, h) = image::ImageReader::with_format(std::io::Cursor::new(bytes), fmt).into_dimensions().map_err(corrupt)?;
    if w == 0 || h == 0 {
        return Err(img_err(name, format!("is zero-sized ({w}x{h})")));
    }
    if w as u64 * h as u64 > MAX_PIXELS {
        return Err(img_err(
            name,
            format!("is enormous: {w}x{h} = {} pixels, over the {MAX_PIXELS}-pixel limit (Pillow's decompression-bomb limit)", w as u64 * h as u64),
        ));
    }
    Ok((fmt, w, h))
}

/// Decodes PNG, JPEG or WebP bytes into Pillow's mode and 8-bit pixels, refusing zero-sized and
/// enormous images before any pixel is decoded.
pub fn decode(bytes: &[u8], name: &str) -> Result<Decoded> {
    use image::{DynamicImage as D, ImageFormat as F};
    let (fmt, w, h) = header(bytes, name)?;
    let corrupt = |e: image::ImageError| img_err(name, format!("corrupt or truncated {fmt:?} data: {e}"));
    let mut r = image::ImageReader::with_format(std::io::Cursor::new(bytes), fmt);
    let mut limits = image::Limits::default();
    limits.max_alloc = Some(MAX_PIXELS * 8 + (64 << 20));
    r.limits(limits);
    let img = r.decode().map_err(corrupt)?;
    let (w, h) = (w as usize, h as usize);
    let info = if fmt == F::Png { png_info(bytes) } else { None };
    let hi = |v: &[u16]| -> Vec<u8> { v.iter().map(|&x| (x >> 8) as u8).collect() };
    let (bands, data) = match img {
        D::ImageLuma8(b) => (1, b.into_raw()),
        D::ImageLumaA8(b) => (2, b.into_raw()),
        D::ImageRgb8(b) => (3, b.into_raw()),
        D::ImageRgba8(b) => (4, b.into_raw()),
        D::ImageLuma16(b) => (1, hi(b.as_raw())),
        D::ImageLumaA16(b) => (2, hi(b.as_raw())),
        D::ImageRgb16(b) => (3, hi(b.as_raw())),
        D::ImageRgba16(b) => (4, hi(b.as_raw())),
        other => (4, other.to_rgba8().into_raw()),
    };
    let mut raster = Raster::new(w, h, bands, data);
    let mode = match (info, bands) {
        (Some(PngInfo { color_type: 3, .. }), b) => Mode::Palette { alpha: b == 4 },
        (Some(PngInfo { color_type: 0, bit_depth: 1, trns: None }), 1) => Mode::Bilevel,
        (Some(PngInfo { color_type: 0, bit_depth, trns: Some(t) }), 2) => {
            // Grey with a colour key: Pillow keeps `L` and applies the key after the resize.
            raster = Raster::new(w, h, 1, raster.data.chunks_exact(2).map(|p| p[0]).collect());
            let raw = u16::from_be_bytes([t.first().copied().unwrap_or(0), t.get(1).copied().unwrap_or(0)]);
            // Pillow keeps the raw `tRNS` value as the key (unscaled for low bit depths).
            let key = (bit_depth <= 8).then_some(raw as u8);
            if bit_depth == 1 {
                Mode::Bilevel
            } else {
                Mode::L { key }
            }
        }
        (Some(PngInfo { color_type: 2, trns: Some(_), .. }), 4) => {
            // RGB with a colour key: the reference leaves RGB images alone; drop the key alpha.
            raster = Raster::new(w, h, 3, raster.data.chunks_exact(4).flat_map(|p| [p[0], p[1], p[2]]).collect());
            Mode::Rgb
        }
        (_, 1) => Mode::L { key: None },
        (_, 2) => Mode::LA,
        (_, 3) => Mode::Rgb,
        _ => Mode::Rgba,
    };
    Ok(Decoded { mode, raster })
}

fn has_alpha(mode: Mode) -> bool {
    match mode {
        Mode::LA | Mode::Rgba => true,
        Mode::Palette { alpha } => alpha,
        Mode::L { key } => key.is_some(),
        _ => false,
    }
}

/// `[h, w, 4]` RGBA view of any mode (Pillow's `convert("RGBA")`, keys applied).
fn to_rgba(mode: Mode, r: &Raster) -> Vec<u8> {
    let mut out = Vec::with_capacity(r.w * r.h * 4);
    match r.bands {
        1 => {
            let key = if let Mode::L { key } = mode { key } else { None };
            for &v in &r.data {
                out.extend_from_slice(&[v, v, v, if key == Some(v) { 0 } else { 255 }]);
            }
        }
        2 => r.data.chunks_exact(2).for_each(|p| out.extend_from_slice(&[p[0], p[0], p[0], p[1]])),
        3 => r.data.chunks_exact(3).for_each(|p| out.extend_from_slice(&[p[0], p[1], p[2], 255])),
        _ => out.extend_from_slice(&r.data),
    }
    out
}

/// Pillow's `convert("RGB")` (alpha dropped, grey replicated).
fn to_rgb(r: &Raster) -> Vec<u8> {
    match r.bands {
        3 => r.data.clone(),
        1 => r.data.iter().flat_map(|&v| [v, v, v]).collect(),
        b => r.data.chunks_exact(b).flat_map(|p| if b == 2 { [p[0], p[0], p[0]] } else { [p[0], p[1], p[2]] }).collect(),
    }
}

/// `fill_transparent_bg_with`: RGB stays; no alpha → RGB; else composite over the background
/// with `uint8_trunc(a·rgb + (1−a)·bg)`, `a = alpha/255` in f32.
fn fill(mode: Mode, r: &Raster, cfg: Option<&TransparentBg>) -> Raster {
    let (w, h) = (r.w, r.h);
    let rgb = match cfg {
        Some(t) if mode != Mode::Rgb && has_alpha(mode) => {
            let rgba = to_rgba(mode, r);
            let mut out = vec![0u8; w * h * 3];
            for y in 0..h {
                for x in 0..w {
                    let bg = match t.pattern.as_str() {
                        "white" => 255,
                        "black" => 0,
                        "gray" => 128,
                        _ => {
                            let sq = t.chessboard_square_size;
                            let gray_parity = usize::from(t.chessboard_square_on_top_left);
                            if (y / sq + x / sq) % 2 == gray_parity {
                                t.chessboard_gray_value
                            } else {
                                t.chessboard_white_value
                            }
                        }
                    } as f32;
                    let p = &rgba[(y * w + x) * 4..(y * w + x + 1) * 4];
                    let a = p[3] as f32 / 255.0f32;
                    for c in 0..3 {
                        let v = a * p[c] as f32 + (1.0f32 - a) * bg;
                        out[(y * w + x) * 3 + c] = v.clamp(0.0, 255.0) as u8;
                    }
                }
            }
            out
        }
        _ => to_rgb(r),
    };
    Raster::new(w, h, 3, rgb)
}

/// Resize (in the image's mode) and fill the transparent background, in the configured order.
pub fn resize_and_fill(dec: &Decoded, new_w: usize, new_h: usize, cfg: &ProcessorConfig) -> Raster {
    let bg = cfg.transparent_bg_config.as_ref();
    let nearest = matches!(dec.mode, Mode::Bilevel | Mode::Palette { .. });
    let resize = |mode: Mode, r: &Raster| if nearest && mode == dec.mode { resize_nearest(r, new_w, new_h) } else { resize_bicubic(r, new_w, new_h) };
    if cfg.transparent_bg_fill_stage == "after_resize" {
        let r = resize(dec.mode, &dec.raster);
        fill(dec.mode, &r, bg)
    } else {
        let r = fill(dec.mode, &dec.raster, bg);
        resize(Mode::Rgb, &r)
    }
}

/// Pad right/bottom with black, normalise `((u/255) − mean)·(1/std)` (the reference's f64/f32
/// steps), and patchify to `[h·w, 3, ps, ps]`.
pub fn pad_normalize_patchify(rgb: &Raster, plan: &ResizePlan, cfg: &ProcessorConfig) -> Vec<f32> {
    let ps = cfg.patch_size;
    let (gh, gw) = (plan.grid_thw[1], plan.grid_thw[2]);
    // Lookup per channel and byte value: x = f32(u/255.0); x = f32(x − mean); x = f32(x · (1/std)).
    let lut: Vec<[f32; 256]> = (0..3)
        .map(|c| {
            let inv = 1.0 / cfg.image_std[c];
            let mut t = [0f32; 256];
            for (u, v) in t.iter_mut().enumerate() {
                let x = (u as f64 / 255.0) as f32;
                let x = (x as f64 - cfg.image_mean[c]) as f32;
                *v = (x as f64 * inv) as f32;
            }
            t
        })
        .collect();
    let mut out = vec![0f32; gh * gw * 3 * ps * ps];
    use rayon::prelude::*;
    out.par_chunks_mut(3 * ps * ps).enumerate().for_each(|(n, patch)| {
        let (pr, pc) = (n / gw, n % gw);
        for c in 0..3 {
            for ky in 0..ps {
                for kx in 0..ps {
                    let (y, x) = (pr * ps + ky, pc * ps + kx);
                    let u = if y < rgb.h && x < rgb.w { rgb.data[(y * rgb.w + x) * 3 + c] } else { 0 };
                    patch[(c * ps + ky) * ps + kx] = lut[c][u as usize];
                }
            }
        }
    });
    out
}
