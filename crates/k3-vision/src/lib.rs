//! k3-vision: the image and video path of Kimi K3 (around-backbone §1.1 `vision_config`, §3
//! MoonViT3d tower, `sd2_tpool` merger, PatchMergerMLPV2 projector and interleaving, §4
//! preprocessing, §3.6 video chunks).
//!
//! Shape legend: an image of original size `W×H` becomes `pixel_values` `[h·w, 3, 14, 14]` with
//! `grid_thw = [1, h, w]`; the tower gives `vit_out` `[h·w, C]`; the merger `merged`
//! `[(h/2)(w/2), 4, C]`; the projector `projected` `[(h/2)(w/2), text_hidden]`, which replaces the
//! image's `N = (h/2)(w/2)` `<|media_pad|>` rows of the text embedding, in order.
//!
//! - [`preprocess`]: decode, resize plan, Pillow-exact resize ([`resample`]), chessboard fill,
//!   pad, normalise, patchify; limits from `preprocessor_config.json`.
//! - [`tower`], [`merger`], [`projector`]: the three model stages; [`row_cache`] keeps each
//!   image size's position rows (host and GPU).
//! - [`prompt`]: the media block, pad runs and the one-pad-per-image expansion.
//! - [`video`], [`video_decode`]: video sampling, per-frame resize, chunks of up to 4 frames (one
//!   sample of grid `(t, h, w)` each) and their prompt blocks; MP4/H.264, GIF, WebP decoding,
//!   and with the `vp9` feature WebM/Matroska with VP8 or VP9 (`video_webm`, `video_vpx`).
//! - [`VisionModel`]: load from a [`Checkpoint`], [`VisionModel::encode_image`],
//!   [`VisionModel::encode_video`], and [`splice`].
//! - With the `cuda` feature, [`cuda`]: the three stages on a GPU; a model given one
//!   ([`VisionModel::attach_cuda`]) runs every encode there, several samples packed per call.
//!   [`VisionModel::pending`] and [`VisionModel::complete`] split preprocessing from the stages
//!   (the server preprocesses on a blocking thread and runs the GPU stages on its engine thread).

#[cfg(feature = "cuda")]
pub mod cuda;

/// Whether `--device cuda` also puts the vision tower on the GPU: yes (its tests passed on an
/// H200 on 2026-12-05) unless `K3_VISION_GPU=0`, which keeps the tower on the CPU and splices
/// its features into the GPU text model's input.
pub fn gpu_tower_enabled() -> bool {
    std::env::var("K3_VISION_GPU").map_or(true, |v| v != "0")
}
pub mod error;
pub mod merger;
pub mod preprocess;
pub mod projector;
pub mod prompt;
pub mod resample;
pub mod row_cache;
pub mod tower;
pub mod video;
pub mod video_decode;
#[cfg(feature = "vp9")]
mod video_vpx;
#[cfg(feature = "vp9")]
mod video_webm;

use std::path::Path;

use k3_model::config::VisionConfig;
use k3_model::{Checkpoint, Model};

use error::input;
pub use error::{Result, VisionError};
pub use preprocess::{ProcessorConfig, ResizePlan};
pub use projector::Projector;
pub use prompt::MediaTokens;
pub use tower::{TowerDims, VisionTower};

/// Everything one image goes through, stage by stage.
#[derive(Clone, Debug)]
pub struct ImageFeatures {
    /// f32 `[h·w, 3, ps, ps]`.
    pub pixel_values: Vec<f32>,
    pub grid_thw: [usize; 3],
    /// Original `(W, H)`, when the features came from an image file.
    pub orig_size: Option<(usize, usize)>,
    /// `[t·h·w, C]` after `final_layernorm`.
    pub vit_out: Vec<f32>,
    /// `[(h/2)(w/2), 4, C]`.
    pub merged: Vec<f32>,
    /// `[(h/2)(w/2), text_hidden]`.
    pub projected: Vec<f32>,
    /// `(h/2)(w/2)`: the number of `<|media_pad|>` this image fills.
    pub num_tokens: usize,
}

/// Validated vision sizes: the tower's plus merge kernel, projector widths and eps.
#[derive(Clone, Copy, Debug)]
pub struct VisionSpec {
    pub tower: TowerDims,
    pub merge: (usize, usize),
    pub text_hidden: usize,
    pub projector_eps: f32,
}

impl VisionSpec {
    /// Reads `vision_config` (`text_hidden` defaults to the text model's width). Refuses variants
    /// other than the released MoonViT3d (RMSNorm, no biases, `divided_fixed`, `sd2_tpool`,
    /// `patchmergerv2`, `mlp2`, bilinear).
    pub fn from_config(vc: &VisionConfig, text_hidden: usize) -> Result<VisionSpec> {
        let bad = |msg: String| VisionError::Config { path: "config.json → vision_config".into(), msg };
        let want_str = [
            ("norm_type", "rmsnorm"),
            ("pos_emb_type", "divided_fixed"),
            ("merge_type", "sd2_tpool"),
            ("mm_projector_type", "patchmergerv2"),
            ("mlp_type", "mlp2"),
            ("pos_emb_interpolation_mode", "bilinear"),
        ];
        for (k, want) in want_str {
            if let Some(v) = vc.extra.get(k) {
                if v.as_str() != Some(want) {
                    return Err(bad(format!("`{k}` is {v}; k3rs implements the released MoonViT3d with `{want}`")));
                }
            }
        }
        for k in ["attn_bias", "linear_bias", "patch_embed_proj_bias"] {
            if let Some(v) = vc.extra.get(k) {
                if v.as_bool() != Some(false) {
                    return Err(bad(format!("`{k}` is {v}; the released tower has no biases (false)")));
                }
            }
        }
        let c = vc.vt_hidden_size;
        let heads = vc.vt_num_attention_heads;
        let qkv = vc.qkv_hidden_size.unwrap_or(c);
        if c == 0 || heads == 0 || vc.vt_intermediate_size == 0 || vc.patch_size == 0 {
            return Err(bad("vt_hidden_size, vt_num_attention_heads, vt_intermediate_size and patch_size must be > 0".into()));
        }
        if !qkv.is_multiple_of(heads) || !(qkv / heads).is_multiple_of(4) {
            return Err(bad(format!("qkv_hidden_size {qkv} / {heads} heads must give a head_dim divisible by 4 (2-D RoPE)")));
        }
        if let Some(m) = vc.mm_hidden_size {
            if m != c {
                return Err(bad(format!("mm_hidden_size {m} differs from vt_hidden_size {c}; the projector reads the tower's width")));
            }
        }
        let merge = match vc.merge_kernel_size.as_deref() {
            None => (2, 2),
            Some([a, b]) if *a > 0 && *b > 0 => (*a, *b),
            Some(m) => return Err(bad(format!("merge_kernel_size {m:?} must be two positive sizes"))),
        };
        let th = vc.text_hidden_size.unwrap_or(text_hidden);
        if th != text_hidden {
            return Err(bad(format!("text_hidden_size {th} differs from text_config.hidden_size {text_hidden}")));
        }
        let tower = TowerDims {
            hidden: c,
            heads,
            qkv,
            intermediate: vc.vt_intermediate_size,
            layers: vc.vt_num_hidden_layers,
            patch: vc.patch_size,
            pos_h: vc.init_pos_emb_height.unwrap_or(64),
            pos_w: vc.init_pos_emb_width.unwrap_or(64),
            pos_t: vc.init_pos_emb_time.unwrap_or(4),
        };
        Ok(VisionSpec { tower, merge, text_hidden: th, projector_eps: vc.projector_ln_eps.unwrap_or(1e-5) })
    }
}

pub struct VisionModel {
    pub spec: VisionSpec,
    pub tower: VisionTower,
    pub projector: Projector,
    pub processor: ProcessorConfig,
    /// `<|media_pad|>` id (`media_placeholder_token_id`, else 163605).
    pub pad_id: u32,
    /// The stages on a GPU, when attached: every encode runs there.
    #[cfg(feature = "cuda")]
    pub gpu: Option<cuda::CudaVision>,
}

impl VisionModel {
    /// Loads the tower and projector from `ck` and the processor config from its directory.
    pub fn load(ck: &Checkpoint) -> Result<VisionModel> {
        let vc = ck.config.vision_config.as_ref().ok_or_else(|| VisionError::Config {
            path: ck.dir.join("config.json").display().to_string(),
            msg: "has no `vision_config`: this checkpoint has no vision tower".into(),
        })?;
        let spec = VisionSpec::from_config(vc, ck.config.text.hidden_size)?;
        let processor = ProcessorConfig::from_model_dir(&ck.dir)?;
        let get = |n: &str| -> Result<k3_core::Tensor> { Ok(ck.tensor(n)?) };
        let pad_id = ck.config.media_placeholder_token_id.unwrap_or(MediaTokens::K3.pad);
        Self::from_parts(spec, processor, &get, pad_id)
    }

    /// Builds the model from any tensor source (`get(name)`), e.g. random weights for a benchmark.
    pub fn from_parts(spec: VisionSpec, processor: ProcessorConfig, get: &dyn Fn(&str) -> Result<k3_core::Tensor>, pad_id: u32) -> Result<VisionModel> {
        let bad = |msg: String| VisionError::Config { path: "preprocessor_config.json".into(), msg };
        if processor.patch_size != spec.tower.patch {
            return Err(bad(format!("patch_size {} differs from vision_config.patch_size {}", processor.patch_size, spec.tower.patch)));
        }
        if (processor.merge(), processor.merge()) != spec.merge {
            return Err(bad(format!("merge_kernel_size {} differs from vision_config.merge_kernel_size {:?}", processor.merge(), spec.merge)));
        }
        let tower = VisionTower::load(spec.tower, get)?;
        let merged = spec.tower.hidden * spec.merge.0 * spec.merge.1;
        let projector = Projector::load(get, merged, spec.text_hidden, spec.projector_eps)?;
        Ok(VisionModel {
            spec,
            tower,
            projector,
            processor,
            pad_id,
            #[cfg(feature = "cuda")]
            gpu: None,
        })
    }

    /// Uploads the tower and projector to `dev` in `precision`: from now on every encode runs
    /// there (the CPU weights stay for the host tables and as the oracle).
    #[cfg(feature = "cuda")]
    pub fn attach_cuda(&mut self, dev: &k3_core::cuda::CudaDevice, precision: cuda::Precision) -> Result<()> {
        self.gpu = Some(cuda::CudaVision::upload(self, dev, precision)?);
        Ok(())
    }

    /// With the stages on a GPU: whether `complete` also returns `vit_out` and `merged` (the
    /// default) or only `projected` (`false`: what serving needs, less host work per call).
    pub fn set_gpu_stages(&mut self, keep: bool) {
        #[cfg(feature = "cuda")]
        if let Some(g) = &mut self.gpu {
            g.keep_stages = keep;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = keep;
    }

    /// Whether the stages run on a GPU.
    pub fn on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return true;
        }
        false
    }

    /// One sample's features with the stages not yet run (`vit_out`, `merged`, `projected`
    /// empty; `num_tokens` set): the grid is checked as the stages would check it.
    pub fn pending(&self, pixel_values: Vec<f32>, grid_thw: [usize; 3]) -> Result<ImageFeatures> {
        self.tower.check_input(&pixel_values, &[grid_thw])?;
        let (kh, kw) = self.spec.merge;
        if !grid_thw[1].is_multiple_of(kh) || !grid_thw[2].is_multiple_of(kw) {
            return Err(input(format!("grid {}x{} is not a multiple of the {kh}x{kw} merge kernel", grid_thw[1], grid_thw[2])));
        }
        let num_tokens = prompt::num_image_tokens(grid_thw, kh, kw);
        Ok(ImageFeatures { pixel_values, grid_thw, orig_size: None, vit_out: Vec::new(), merged: Vec::new(), projected: Vec::new(), num_tokens })
    }

    /// Runs the stages of every [`Self::pending`] entry of `feats` (entries with `projected`
    /// already set are left alone): on the GPU all of them packed, on the CPU one by one.
    pub fn complete(&self, feats: &mut [&mut ImageFeatures]) -> Result<()> {
        let mut todo: Vec<&mut ImageFeatures> = feats.iter_mut().filter(|f| f.projected.is_empty()).map(|f| &mut **f).collect();
        if todo.is_empty() {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            let samples: Vec<(&[f32], [usize; 3])> = todo.iter().map(|f| (f.pixel_values.as_slice(), f.grid_thw)).collect();
            let stages = gpu.encode(&self.tower, &samples)?;
            for (f, s) in todo.iter_mut().zip(stages) {
                (f.vit_out, f.merged, f.projected) = (s.vit_out, s.merged, s.projected);
            }
            return Ok(());
        }
        for f in todo.iter_mut() {
            let vit_out = self.tower.forward(&f.pixel_values, &[f.grid_thw], None)?;
            let (kh, kw) = self.spec.merge;
            let merged = merger::sd2_tpool(&vit_out, f.grid_thw, self.spec.tower.hidden, kh, kw)?;
            f.projected = self.projector.forward(&merged)?;
            (f.vit_out, f.merged) = (vit_out, merged);
        }
        Ok(())
    }

    /// Preprocesses the image file and runs every stage.
    pub fn encode_image(&self, path: &Path) -> Result<ImageFeatures> {
        let p = preprocess::preprocess_file(path, &self.processor)?;
        let mut f = self.encode_pixels(p.pixel_values, p.grid_thw)?;
        f.orig_size = Some(p.orig_size);
        Ok(f)
    }

    /// Preprocesses encoded image bytes (PNG, JPEG or WebP) and runs every stage; `name` names
    /// the image in error messages (e.g. the request field it came from).
    pub fn encode_bytes(&self, bytes: &[u8], name: &str) -> Result<ImageFeatures> {
        let p = preprocess::preprocess_bytes(bytes, name, &self.processor)?;
        let mut f = self.encode_pixels(p.pixel_values, p.grid_thw)?;
        f.orig_size = Some(p.orig_size);
        Ok(f)
    }

    /// Runs tower, merger and projector on one sample's patches `[t·h·w, 3, ps, ps]` (on the
    /// GPU when one is attached).
    pub fn encode_pixels(&self, pixel_values: Vec<f32>, grid_thw: [usize; 3]) -> Result<ImageFeatures> {
        if self.on_gpu() {
            let mut f = self.pending(pixel_values, grid_thw)?;
            self.complete(&mut [&mut f])?;
            return Ok(f);
        }
        let vit_out = self.tower.forward(&pixel_values, &[grid_thw], None)?;
        let (kh, kw) = self.spec.merge;
        let merged = merger::sd2_tpool(&vit_out, grid_thw, self.spec.tower.hidden, kh, kw)?;
        let projected = self.projector.forward(&merged)?;
        let num_tokens = prompt::num_image_tokens(grid_thw, kh, kw);
        Ok(ImageFeatures { pixel_values, grid_thw, orig_size: None, vit_out, merged, projected, num_tokens })
    }

    /// Batched path: one tower call over packed samples (images never attend to each other), then
    /// per-sample merge and one projector call. Returns the projected rows of each sample (on the
    /// GPU when one is attached; `trace` then gets the GPU's intermediates).
    pub fn project_batch(&self, pixel_values: &[f32], grids: &[[usize; 3]], trace: tower::TowerTrace<'_>) -> Result<Vec<Vec<f32>>> {
        #[cfg(feature = "cuda")]
        if let Some(gpu) = &self.gpu {
            let vit = gpu.tower(&self.tower, pixel_values, grids, trace)?;
            let tokens: Vec<usize> = grids.iter().map(|&g| prompt::num_image_tokens(g, self.spec.merge.0, self.spec.merge.1)).collect();
            return gpu.download_rows(&gpu.project(&gpu.merge(&vit, grids)?)?, &tokens);
        }
        let vit = self.tower.forward(pixel_values, grids, trace)?;
        let (c, (kh, kw)) = (self.spec.tower.hidden, self.spec.merge);
        let mut off = 0;
        let mut out = Vec::with_capacity(grids.len());
        for &g in grids {
            let n = g[0] * g[1] * g[2];
            let m = merger::sd2_tpool(&vit[off * c..(off + n) * c], g, c, kh, kw)?;
            out.push(self.projector.forward(&m)?);
            off += n;
        }
        Ok(out)
    }
}

impl ImageFeatures {
    /// The `k3 vision` file: `pixel_values` f32 `[n,3,ps,ps]`, `grid_thw` i64 `[3]`, `vit_out` f32
    /// `[h·w, C]`, `merged` f32 `[(h/2)(w/2), 4, C]`, `projected` f32 `[(h/2)(w/2), text_hidden]`.
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        serialize(self.stages(""))
    }

    /// The stages as `(name, dtype, shape, bytes)`, names prefixed with `prefix`.
    fn stages(&self, prefix: &str) -> Vec<Stage> {
        use safetensors::Dtype;
        let n = self.num_tokens.max(1);
        let patches = self.grid_thw.iter().product::<usize>().max(1);
        let c = self.vit_out.len() / patches;
        let ps = ((self.pixel_values.len() / (3 * patches)) as f64).sqrt().round() as usize;
        let grid: Vec<u8> = self.grid_thw.iter().flat_map(|&g| (g as i64).to_le_bytes()).collect();
        vec![
            (format!("{prefix}pixel_values"), Dtype::F32, vec![patches, 3, ps, ps], f32_bytes(&self.pixel_values)),
            (format!("{prefix}grid_thw"), Dtype::I64, vec![3], grid),
            (format!("{prefix}vit_out"), Dtype::F32, vec![patches, c], f32_bytes(&self.vit_out)),
            (format!("{prefix}merged"), Dtype::F32, vec![n, self.merged.len() / (n * c.max(1)), c], f32_bytes(&self.merged)),
            (format!("{prefix}projected"), Dtype::F32, vec![n, self.projected.len() / n], f32_bytes(&self.projected)),
        ]
    }
}

type Stage = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn serialize(bufs: Vec<Stage>) -> Result<Vec<u8>> {
    use safetensors::tensor::TensorView;
    let views = bufs
        .iter()
        .map(|(k, d, s, b)| TensorView::new(*d, s.clone(), b).map(|v| (k.as_str(), v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| error::input(format!("serialising features: {e}")))?;
    safetensors::tensor::serialize(views, None).map_err(|e| error::input(format!("serialising features: {e}")))
}

/// Everything one video goes through: one [`ImageFeatures`] per chunk (grid `(t, h, w)`).
#[derive(Clone, Debug)]
pub struct VideoFeatures {
    pub info: video_decode::ClipInfo,
    /// `(seconds of the chunk's first frame, source frame indices, features)`.
    pub chunks: Vec<(f64, Vec<usize>, ImageFeatures)>,
}

impl VideoFeatures {
    /// The video's prompt: every chunk's block, in order, with its N pads.
    pub fn prompt_text(&self) -> String {
        self.chunks.iter().map(|(t, _, f)| video::chunk_prompt_text(*t, f.num_tokens)).collect()
    }

    /// Projected rows of every chunk, in order (what the pad runs take).
    pub fn projected(&self) -> Vec<&[f32]> {
        self.chunks.iter().map(|(_, _, f)| f.projected.as_slice()).collect()
    }

    /// The `k3 vision --video` file: `chunk{c}.{pixel_values,grid_thw,vit_out,merged,projected}`,
    /// `time_s` f32 `[chunks]` and `frames` i64 `[chunks, k]` (−1 past a short chunk's end).
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        use safetensors::Dtype;
        let k = self.chunks.iter().map(|c| c.1.len()).max().unwrap_or(1);
        let mut bufs: Vec<Stage> = Vec::new();
        for (i, (_, _, f)) in self.chunks.iter().enumerate() {
            bufs.extend(f.stages(&format!("chunk{i}.")));
        }
        let times: Vec<u8> = self.chunks.iter().flat_map(|c| (c.0 as f32).to_le_bytes()).collect();
        let frames: Vec<u8> = self.chunks.iter().flat_map(|c| (0..k).flat_map(|j| c.1.get(j).map_or(-1i64, |&x| x as i64).to_le_bytes())).collect();
        bufs.push(("time_s".into(), Dtype::F32, vec![self.chunks.len()], times));
        bufs.push(("frames".into(), Dtype::I64, vec![self.chunks.len(), k], frames));
        serialize(bufs)
    }
}

impl VisionModel {
    /// Decodes, samples and chunks a video (MP4/H.264, animated GIF or WebP; WebM with VP8/VP9
    /// with the `vp9` feature) and runs every stage on each chunk; `name` names the video in
    /// errors.
    pub fn encode_video_bytes(&self, bytes: &[u8], name: &str, limits: &video::VideoLimits) -> Result<VideoFeatures> {
        self.check_video()?;
        let v = video::preprocess_video_bytes(bytes, name, &self.processor, limits)?;
        self.encode_video_chunks(v)
    }

    /// Refuses video when the processor's chunk length is over the tower's time table.
    pub fn check_video(&self) -> Result<()> {
        let k = self.processor.temporal_merge_kernel_size;
        if k > 1 && k > self.spec.tower.pos_t {
            return Err(VisionError::Config {
                path: "preprocessor_config.json".into(),
                msg: format!("temporal_merge_kernel_size {k} is over the tower's time table (vision_config.init_pos_emb_time {})", self.spec.tower.pos_t),
            });
        }
        Ok(())
    }

    /// Runs every stage on each chunk of a preprocessed video (on the GPU all chunks packed).
    pub fn encode_video_chunks(&self, v: video::PreprocessedVideo) -> Result<VideoFeatures> {
        let mut f = self.pending_video(v)?;
        self.complete(&mut f.chunks.iter_mut().map(|c| &mut c.2).collect::<Vec<_>>())?;
        Ok(f)
    }

    /// A preprocessed video's chunks as [`Self::pending`] features (stages not run).
    pub fn pending_video(&self, v: video::PreprocessedVideo) -> Result<VideoFeatures> {
        let chunks = v.chunks.into_iter().map(|c| Ok((c.time_s, c.frames, self.pending(c.pixel_values, c.grid_thw)?))).collect::<Result<Vec<_>>>()?;
        Ok(VideoFeatures { info: v.info, chunks })
    }

    /// [`Self::encode_video_bytes`] of a file.
    pub fn encode_video(&self, path: &Path, limits: &video::VideoLimits) -> Result<VideoFeatures> {
        let (name, bytes) = preprocess::read_media_file(path, video::MAX_VIDEO_FILE_BYTES)?;
        self.encode_video_bytes(&bytes, &name, limits)
    }
}

/// Replaces the `pad_id` rows of `emb` `[T, H]` (`T = ids.len()`) with the image features, in
/// order: image 0's rows, then image 1's, …. Each entry of `features` is `[N_i, H]`. The pad
/// count must equal `Σ N_i`; when the pads form one run per image, each run must equal its
/// image's `N_i`; otherwise every run must be filled by whole images.
pub fn splice(emb: &mut [f32], ids: &[u32], pad_id: u32, features: &[&[f32]]) -> Result<()> {
    let t = ids.len();
    if t == 0 || !emb.len().is_multiple_of(t) {
        return Err(VisionError::Splice(format!("embedding holds {} values for {t} ids", emb.len())));
    }
    let h = emb.len() / t;
    let mut counts = Vec::with_capacity(features.len());
    for (i, f) in features.iter().enumerate() {
        if f.is_empty() || f.len() % h != 0 {
            return Err(VisionError::Splice(format!("image {i}: features hold {} values, not rows of the text width {h}", f.len())));
        }
        counts.push(f.len() / h);
    }
    let runs = prompt::pad_runs(ids, pad_id);
    let pads: usize = runs.iter().map(|r| r.1).sum();
    let need: usize = counts.iter().sum();
    let lens: Vec<usize> = runs.iter().map(|r| r.1).collect();
    if pads != need {
        return Err(VisionError::Splice(format!(
            "the ids hold {pads} <|media_pad|> (id {pad_id}) in runs {lens:?}, but the {} image(s) give {need} rows ({counts:?}); each image needs exactly its (h/2)·(w/2) pads",
            features.len()
        )));
    }
    if runs.len() == counts.len() {
        if let Some(i) = (0..counts.len()).find(|&i| lens[i] != counts[i]) {
            return Err(VisionError::Splice(format!(
                "pad run {i} (at position {}) has {} <|media_pad|>, but image {i} gives {} rows (runs {lens:?}, images {counts:?})",
                runs[i].0, lens[i], counts[i]
            )));
        }
    } else {
        // Every run must be filled by whole images: each run ends where some image ends.
        let mut ends: Vec<usize> = Vec::new();
        let mut acc = 0;
        for &c in &counts {
            acc += c;
            ends.push(acc);
        }
        let mut acc = 0;
        for (i, &l) in lens.iter().enumerate() {
            acc += l;
            if !ends.contains(&acc) {
                return Err(VisionError::Splice(format!(
                    "pad run {i} (at position {}) ends inside an image: runs {lens:?} cannot be filled by whole images {counts:?}",
                    runs[i].0
                )));
            }
        }
    }
    let mut rows = features.iter().flat_map(|f| f.chunks_exact(h));
    for (i, &id) in ids.iter().enumerate() {
        if id == pad_id {
            if let Some(r) = rows.next() {
                emb[i * h..(i + 1) * h].copy_from_slice(r);
            }
        }
    }
    Ok(())
}

/// Text embeddings of `ids` with each image's projected rows spliced into its `<|media_pad|>`
/// run, in order: what [`Model::forward_embeds`] takes for a prompt with images. `ids` must
/// already hold each image's N pads (see [`prompt::expand_pads`]).
pub fn embed_with_images(model: &Model, vision: &VisionModel, ids: &[u32], images: &[&Path]) -> Result<Vec<f32>> {
    let mut emb = model.embed(ids)?;
    let feats = images.iter().map(|p| vision.encode_image(p)).collect::<Result<Vec<_>>>()?;
    let views: Vec<&[f32]> = feats.iter().map(|f| f.projected.as_slice()).collect();
    splice(&mut emb, ids, vision.pad_id, &views).map_err(|e| match e {
        VisionError::Splice(m) => {
            let names: Vec<String> = images.iter().map(|p| p.display().to_string()).collect();
            VisionError::Splice(format!("{m} (images: {})", names.join(", ")))
        }
        e => e,
    })?;
    Ok(emb)
}
