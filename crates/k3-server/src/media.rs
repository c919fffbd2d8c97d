//! Image and video parts of chat requests (around-backbone §3.6, §3.9, §6.4): finding them,
//! reading their bytes, running the vision tower, and splicing the features into the prompt's
//! input rows.
//!
//! A video part is `{"type": "video_url", "video_url": {"url": URL}}` (or `{"type": "video",
//! "video": URL}`), URL as for images, holding MP4/H.264, animated GIF or animated WebP (and
//! WebM/Matroska with VP8 or VP9 in a build with the `vp9` feature; without it a WebM part is a
//! 400 saying how to convert it); it is sampled and cut into chunks of up to 4 frames
//! (`k3_vision::video`), each chunk one tower sample rendered as
//! `{hh:mm:ss.fff}<|media_begin|>video<|media_content|>` + N pads + `<|media_end|>`. A video
//! over `--max-video-frames` sampled frames is a 400 naming its part.
//!
//! An image part is `{"type": "image_url", "image_url": {"url": URL}}` (the URL may also be given
//! as a bare string, and `{"type": "image", "image": URL}` is read the same way). URL is either
//! a `data:` URI with base64 PNG/JPEG/WebP bytes, or — only when the server was started with
//! `--allowed-local-media-path DIR` — a `file://` URL or plain path that resolves (symlinks and
//! `..` included) inside DIR; relative paths are taken relative to DIR. Remote `http(s)` URLs
//! are not fetched. Every failure (bad base64, unsupported or corrupt image, a disallowed path,
//! an image too large, images sent to a model without a vision tower) is a 400 naming
//! `messages[i].content[j].image_url`.
//!
//! The features of every image of a request are computed on a blocking thread
//! ([`encode_images`], called through `tokio::task::spawn_blocking`), never on the async
//! runtime. Decoding holds the image's pixels (read from its header) of the server-wide
//! [`DecodeBudget`] until the pixels are resized, so concurrent large images wait instead of
//! multiplying the decoding memory. Text that spells the image placeholder beside image parts
//! is refused at its own field. Each image's part renders as `<|media_begin|>image WxH<|media_content|>` + N ×
//! `<|media_pad|>` + `<|media_end|>` ([`image_prompts`]); on the engine thread, [`splice_prep`]
//! takes the backend's token embeddings of the rendered ids and replaces the pad rows with the
//! projected features, in order, to give the request's `prompt_embeds`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use base64::Engine as _;
use k3_tokenizer::xtml::IMAGE_PLACEHOLDER;
use k3_vision::video::VideoLimits;
use k3_vision::{preprocess, prompt::image_prompt_text, splice, ImageFeatures, VideoFeatures, VisionError, VisionModel};
use serde_json::Value;

use crate::error::{bad_param, Result, ServerError};
use crate::scheduler::Prep;

/// One image or video part of a request.
#[derive(Clone, Debug)]
pub struct ImagePart {
    /// The field it came from, e.g. `messages[1].content[0].image_url`.
    pub field: String,
    pub url: String,
    pub video: bool,
}

/// The features of one media part.
#[derive(Clone, Debug)]
pub enum MediaFeatures {
    Image(ImageFeatures),
    Video(VideoFeatures),
}

/// Where the server may read images from, and how large they may be.
#[derive(Clone, Debug)]
pub struct MediaLimits {
    /// Canonical directory local paths must resolve inside; `None`: local paths are refused.
    pub allowed_local_media_path: Option<PathBuf>,
    /// Largest encoded image or video, in bytes.
    pub max_image_bytes: usize,
    /// Frames sampled per video, source frames, pixels per frame.
    pub video: VideoLimits,
    /// Pixels decoded at once, across requests.
    pub decode: DecodeBudget,
}

/// A pixel budget shared by every image decode of the server: a decode of `w × h` pixels waits
/// (on its blocking thread) until that many are free, so N concurrent large images cannot
/// take N times the decoding memory. An image larger than the whole budget takes all of it.
#[derive(Clone, Debug)]
pub struct DecodeBudget {
    state: Arc<(Mutex<u64>, Condvar)>,
    total: u64,
}

/// Pixels held by one decode; released on drop.
pub struct DecodePermit {
    budget: DecodeBudget,
    pixels: u64,
}

impl DecodeBudget {
    pub fn new(total: u64) -> Self {
        DecodeBudget { state: Arc::new((Mutex::new(0), Condvar::new())), total: total.max(1) }
    }

    /// Blocks until `pixels` (at most the whole budget) are free, and takes them.
    pub fn acquire(&self, pixels: u64) -> DecodePermit {
        let n = pixels.clamp(1, self.total);
        let (lock, cv) = &*self.state;
        let mut used = lock.lock().unwrap_or_else(|p| p.into_inner());
        while *used + n > self.total {
            used = cv.wait(used).unwrap_or_else(|p| p.into_inner());
        }
        *used += n;
        DecodePermit { budget: self.clone(), pixels: n }
    }

    /// Pixels being decoded now.
    pub fn in_use(&self) -> u64 {
        *self.state.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for DecodePermit {
    fn drop(&mut self) {
        let (lock, cv) = &*self.budget.state;
        let mut used = lock.lock().unwrap_or_else(|p| p.into_inner());
        *used -= self.pixels;
        cv.notify_all();
    }
}

/// The image and video parts of `messages`, in prompt order (the renderer's order).
pub fn find_images(messages: Option<&Value>) -> Result<Vec<ImagePart>> {
    let mut out = Vec::new();
    let Some(Value::Array(msgs)) = messages else {
        return Ok(out);
    };
    // Text that spells the renderer's image placeholder would take an image's slot (and shift
    // the error to the next image part): refuse it where it is, once images are present.
    let mut stray: Option<String> = None;
    for (i, m) in msgs.iter().enumerate() {
        let parts = match m.get("content") {
            Some(Value::Array(parts)) => parts,
            Some(Value::String(t)) => {
                if t.contains(IMAGE_PLACEHOLDER) {
                    stray.get_or_insert(format!("messages[{i}].content"));
                }
                continue;
            }
            _ => continue,
        };
        for (j, part) in parts.iter().enumerate() {
            let kind = part.get("type").and_then(Value::as_str);
            let key = match kind {
                Some("image_url") => "image_url",
                Some("image") if part.get("image").is_some() => "image",
                Some("image") => "image_url",
                Some("video_url") => "video_url",
                Some("video") if part.get("video").is_some() => "video",
                Some("video") => "video_url",
                _ => {
                    if part.get("text").and_then(Value::as_str).is_some_and(|t| t.contains(IMAGE_PLACEHOLDER)) {
                        stray.get_or_insert(format!("messages[{i}].content[{j}].text"));
                    }
                    continue;
                }
            };
            let field = format!("messages[{i}].content[{j}].{key}");
            let url = match part.get(key) {
                Some(Value::String(u)) => u.clone(),
                Some(Value::Object(o)) => match o.get("url") {
                    Some(Value::String(u)) => u.clone(),
                    _ => return Err(bad_param(field, "needs `url`: a data: URI (or a local path, if the server allows them)")),
                },
                _ => return Err(bad_param(field, "is required: an object with `url` (a data: URI or an allowed local path)")),
            };
            out.push(ImagePart { field, url, video: key.starts_with("video") });
        }
    }
    if let (Some(field), false) = (stray, out.is_empty()) {
        return Err(bad_param(field, format!("contains the image placeholder {IMAGE_PLACEHOLDER} as text; send images as image_url content parts")));
    }
    Ok(out)
}

fn too_large(field: &str, n: usize, limit: usize) -> ServerError {
    let what = if field.contains("video") { "video" } else { "image" };
    bad_param(field, format!("the {what} is {n} bytes, over the server's limit of {limit} bytes (--max-image-bytes)"))
}

const IMAGE_TYPES: &[&str] = &["image/png", "image/jpeg", "image/jpg", "image/webp"];
const VIDEO_TYPES: &[&str] = &["video/mp4", "image/gif", "image/webp", "video/webm", "video/quicktime"];

/// Decodes a `data:[<mediatype>][;base64],<data>` URI.
fn data_uri(field: &str, uri: &str, limit: usize, video: bool) -> Result<Vec<u8>> {
    let rest = &uri[5..];
    let Some((meta, data)) = rest.split_once(',') else {
        return Err(bad_param(field, "a data: URI needs a `,` before its data"));
    };
    let mut meta_parts = meta.split(';');
    let mime = meta_parts.next().unwrap_or("").trim().to_ascii_lowercase();
    if !meta_parts.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err(bad_param(field, "only base64 data: URIs are supported (`data:image/png;base64,...`)"));
    }
    if !mime.is_empty() && !video && !IMAGE_TYPES.contains(&mime.as_str()) {
        return Err(bad_param(field, format!("unsupported image type {mime:?}; supported formats are PNG, JPEG and WebP")));
    }
    if !mime.is_empty() && video && !VIDEO_TYPES.contains(&mime.as_str()) {
        return Err(bad_param(
            field,
            format!("unsupported video type {mime:?}; supported are MP4 (H.264), WebM (VP8/VP9, with the vp9 feature), animated GIF and animated WebP"),
        ));
    }
    let clean: Vec<u8> = data.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    if clean.len() / 4 * 3 > limit.saturating_add(3) {
        return Err(too_large(field, clean.len() / 4 * 3, limit));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&clean)
        .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(&clean))
        .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(clean.strip_suffix(b"==").or(clean.strip_suffix(b"=")).unwrap_or(&clean)))
        .map_err(|e| bad_param(field, format!("invalid base64 in the data: URI: {e}")))?;
    if bytes.is_empty() {
        return Err(bad_param(field, "the data: URI holds no bytes"));
    }
    if bytes.len() > limit {
        return Err(too_large(field, bytes.len(), limit));
    }
    Ok(bytes)
}

/// Reads a local image, if `limits` allow its path (blocking).
fn local_file(field: &str, url: &str, limits: &MediaLimits) -> Result<Vec<u8>> {
    let Some(dir) = &limits.allowed_local_media_path else {
        return Err(bad_param(
            field,
            "local image paths are disabled on this server (start it with --allowed-local-media-path DIR); send the image as a data: URI",
        ));
    };
    let raw = match url.strip_prefix("file://") {
        Some(p) => p.strip_prefix("localhost").unwrap_or(p),
        None => url,
    };
    if raw.is_empty() {
        return Err(bad_param(field, "the local path is empty"));
    }
    let p = Path::new(raw);
    let joined = if p.is_absolute() { p.to_path_buf() } else { dir.join(p) };
    let canon = joined.canonicalize().map_err(|e| bad_param(field, format!("cannot open the local image {raw:?}: {e}")))?;
    if !canon.starts_with(dir) {
        return Err(bad_param(field, format!("the local path {raw:?} is outside the directory allowed by --allowed-local-media-path")));
    }
    let meta = std::fs::metadata(&canon).map_err(|e| bad_param(field, format!("cannot open the local image {raw:?}: {e}")))?;
    if !meta.is_file() {
        return Err(bad_param(field, format!("the local path {raw:?} is not a regular file")));
    }
    if meta.len() > limits.max_image_bytes as u64 {
        return Err(too_large(field, meta.len() as usize, limits.max_image_bytes));
    }
    std::fs::read(&canon).map_err(|e| bad_param(field, format!("cannot read the local image {raw:?}: {e}")))
}

/// The encoded bytes of one image part (blocking for local files).
pub fn image_bytes(part: &ImagePart, limits: &MediaLimits) -> Result<Vec<u8>> {
    let (f, url) = (part.field.as_str(), part.url.trim());
    let lower: String = url.chars().take(8).collect::<String>().to_ascii_lowercase();
    if lower.starts_with("data:") {
        data_uri(f, url, limits.max_image_bytes, part.video)
    } else if lower.starts_with("http://") || lower.starts_with("https://") {
        Err(bad_param(f, "remote image URLs are not fetched by this server; send the image as a data: URI"))
    } else if lower.starts_with("file://") || !url.contains("://") {
        local_file(f, url, limits)
    } else {
        Err(bad_param(f, "unsupported URL scheme; use a data: URI (or a local path, if the server allows them)"))
    }
}

/// Reads and encodes every image and video (blocking: call from `spawn_blocking`). Each
/// decode holds its pixels of `limits.decode` (read from the header first: an image's, or one
/// video frame's) until its pixels are resized; the tower then runs outside the budget. With
/// the tower on the GPU ([`VisionModel::on_gpu`]) only the preprocessing runs here: the stages
/// are left pending for [`splice_prep`], which runs them on the engine thread (the text model
/// shares the GPU's one stream and captures CUDA graphs on it, so no other thread may use it).
pub fn encode_media(vision: &VisionModel, parts: &[ImagePart], limits: &MediaLimits) -> Result<Vec<MediaFeatures>> {
    let verr = |p: &ImagePart, e: VisionError| match e {
        VisionError::Image { msg, .. } => bad_param(&p.field, msg),
        VisionError::Input(msg) => bad_param(&p.field, msg),
        VisionError::Config { path, msg } => bad_param(&p.field, format!("videos are not accepted by this model: {path}: {msg}")),
        e => ServerError::Internal(format!("{}: the vision tower failed: {e}", p.field)),
    };
    parts
        .iter()
        .map(|p| {
            let bytes = image_bytes(p, limits)?;
            if p.video {
                let v = &limits.video;
                let info = k3_vision::video::probe_video(&bytes, &p.field, v).map_err(|e| verr(p, e))?;
                vision.check_video().map_err(|e| verr(p, e))?;
                let permit = limits.decode.acquire(info.width as u64 * info.height as u64);
                let pre = k3_vision::video::preprocess_probed(&bytes, &p.field, info, &vision.processor, v).map_err(|e| verr(p, e))?;
                drop((permit, bytes));
                let f = if vision.on_gpu() { vision.pending_video(pre) } else { vision.encode_video_chunks(pre) };
                return Ok(MediaFeatures::Video(f.map_err(|e| verr(p, e))?));
            }
            let (w, h) = preprocess::dimensions(&bytes, &p.field).map_err(|e| verr(p, e))?;
            let permit = limits.decode.acquire(w as u64 * h as u64);
            let pre = preprocess::preprocess_bytes(&bytes, &p.field, &vision.processor).map_err(|e| verr(p, e))?;
            drop((permit, bytes));
            let f = if vision.on_gpu() { vision.pending(pre.pixel_values, pre.grid_thw) } else { vision.encode_pixels(pre.pixel_values, pre.grid_thw) };
            let mut f = f.map_err(|e| verr(p, e))?;
            f.orig_size = Some(pre.orig_size);
            Ok(MediaFeatures::Image(f))
        })
        .collect()
}

/// One `image_prompts` entry per part: an image's block with its original size and N pads, or
/// a video's chunk blocks.
pub fn media_prompts(feats: &[MediaFeatures]) -> Vec<String> {
    feats
        .iter()
        .map(|f| match f {
            MediaFeatures::Image(f) => {
                let (w, h) = f.orig_size.unwrap_or((0, 0));
                image_prompt_text(w, h, f.num_tokens)
            }
            MediaFeatures::Video(v) => v.prompt_text(),
        })
        .collect()
}

/// Engine-thread work: the pending stages of every part run (on the GPU, all parts' samples
/// packed: [`VisionModel::complete`]), then the token embeddings of the prompt with the features
/// spliced in at the `pad_id` runs, set as the request's `prompt_embeds`.
pub fn splice_prep(mut feats: Vec<MediaFeatures>, vision: Arc<VisionModel>) -> Prep {
    let pad_id = vision.pad_id;
    Box::new(move |backend, req| {
        let mut pending: Vec<&mut ImageFeatures> = feats
            .iter_mut()
            .flat_map(|f| match f {
                MediaFeatures::Image(f) => vec![f],
                MediaFeatures::Video(v) => v.chunks.iter_mut().map(|c| &mut c.2).collect(),
            })
            .collect();
        vision.complete(&mut pending).map_err(|e| match e {
            VisionError::Input(msg) => bad_param("messages", msg),
            e => ServerError::Internal(format!("the vision tower failed: {e}")),
        })?;
        let mut emb = backend.embed(&req.prompt)?;
        let views: Vec<&[f32]> = feats
            .iter()
            .flat_map(|f| match f {
                MediaFeatures::Image(f) => vec![f.projected.as_slice()],
                MediaFeatures::Video(v) => v.projected(),
            })
            .collect();
        splice(&mut emb, &req.prompt, pad_id, &views).map_err(|e| bad_param("messages", e.to_string()))?;
        req.prompt_embeds = Some(Arc::new(emb));
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(url: &str) -> ImagePart {
        ImagePart { field: "messages[0].content[1].image_url".into(), url: url.into(), video: false }
    }

    fn limits(dir: Option<PathBuf>) -> MediaLimits {
        MediaLimits { allowed_local_media_path: dir, max_image_bytes: 64, video: VideoLimits::default(), decode: DecodeBudget::new(1 << 20) }
    }

    fn err(r: Result<Vec<u8>>) -> String {
        match r {
            Ok(_) => "ok".into(),
            Err(e) => format!("{} | {:?}", e, e.parts().2),
        }
    }

    #[test]
    fn data_uris() {
        let l = limits(None);
        assert_eq!(image_bytes(&part("data:image/png;base64,aGVsbG8="), &l).ok(), Some(b"hello".to_vec()));
        assert_eq!(image_bytes(&part("data:;base64,aGVsbG8"), &l).ok(), Some(b"hello".to_vec()));
        let e = err(image_bytes(&part("data:image/png;base64,@@@"), &l));
        assert!(e.contains("invalid base64") && e.contains("content[1].image_url"), "{e}");
        assert!(err(image_bytes(&part("data:image/gif;base64,aGVsbG8="), &l)).contains("unsupported image type"));
        assert!(err(image_bytes(&part("data:image/png,hello"), &l)).contains("only base64"));
        let big = format!("data:image/png;base64,{}", "A".repeat(200));
        assert!(err(image_bytes(&part(&big), &l)).contains("over the server's limit"));
        assert!(err(image_bytes(&part("https://x/y.png"), &l)).contains("remote image URLs"));
    }

    /// A stray placeholder in text is reported where it is, not at the next image part
    /// (issue 28, item 10); without images the text is left alone.
    #[test]
    fn stray_placeholder_is_named_where_it_is() {
        let img = serde_json::json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}});
        let msgs = serde_json::json!([{"role": "user", "content": [{"type": "text", "text": format!("look {IMAGE_PLACEHOLDER}")}, img]}]);
        let e = find_images(Some(&msgs)).unwrap_err();
        assert_eq!(e.parts().2.as_deref(), Some("messages[0].content[0].text"), "{e}");
        let msgs = serde_json::json!([{"role": "user", "content": format!("{IMAGE_PLACEHOLDER}")}, {"role": "user", "content": [img]}]);
        assert_eq!(find_images(Some(&msgs)).unwrap_err().parts().2.as_deref(), Some("messages[0].content"));
        let msgs = serde_json::json!([{"role": "user", "content": format!("{IMAGE_PLACEHOLDER}")}]);
        assert!(find_images(Some(&msgs)).unwrap().is_empty());
    }

    /// The budget holds concurrent decodes to its total: a second large image waits until the
    /// first releases its pixels; one larger than the budget takes all of it (issue 28, item 9).
    #[test]
    fn decode_budget_bounds_concurrent_pixels() {
        let b = DecodeBudget::new(100);
        let first = b.acquire(13000 * 13000);
        assert_eq!(b.in_use(), 100);
        let (tx, rx) = std::sync::mpsc::channel();
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            let p = b2.acquire(60);
            tx.send(b2.in_use()).unwrap();
            drop(p);
        });
        assert!(rx.recv_timeout(std::time::Duration::from_millis(200)).is_err(), "the second decode must wait");
        drop(first);
        assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap(), 60);
        t.join().unwrap();
        assert_eq!(b.in_use(), 0);
        let small = [b.acquire(30), b.acquire(30), b.acquire(40)];
        assert_eq!(b.in_use(), 100);
        drop(small);
    }

    #[test]
    fn local_paths() {
        let d = std::env::temp_dir().join(format!("k3-media-{}", std::process::id()));
        std::fs::create_dir_all(d.join("in")).expect("mkdir");
        std::fs::write(d.join("in/a.png"), b"abc").expect("write");
        std::fs::write(d.join("out.png"), b"abc").expect("write");
        let allowed = d.join("in").canonicalize().expect("canon");
        let l = limits(Some(allowed.clone()));
        assert!(err(image_bytes(&part(&d.join("in/a.png").display().to_string()), &limits(None))).contains("--allowed-local-media-path"));
        assert_eq!(image_bytes(&part(&format!("file://{}", d.join("in/a.png").display())), &l).ok(), Some(b"abc".to_vec()));
        assert_eq!(image_bytes(&part("a.png"), &l).ok(), Some(b"abc".to_vec()));
        assert!(err(image_bytes(&part("../out.png"), &l)).contains("outside"));
        assert!(err(image_bytes(&part(&d.join("out.png").display().to_string()), &l)).contains("outside"));
        assert!(err(image_bytes(&part("missing.png"), &l)).contains("cannot open"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
