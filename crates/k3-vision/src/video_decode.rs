//! Video containers and codecs for the video path ([`crate::video`]): MP4 with H.264 (the `mp4`
//! demuxer and Cisco's OpenH264 through the `openh264` crate, built from source), animated GIF
//! and animated WebP (the `image` crate), and with the `vp9` feature WebM/Matroska with VP8 or
//! VP9 ([`crate::video_webm`]: `matroska-demuxer` and the system libvpx). Other codecs, and WebM
//! in a build without the feature, are refused with the command that converts them.
//!
//! Shape legend: a clip is `F` frames of `W×H` in presentation order, frame `i` at `i / fps`
//! seconds (`fps` the average rate, as decord reports it: `F / duration` for MP4, GIF and WebP;
//! WebM's in [`crate::video_webm`]). Frames are decoded one at a time and handed to a callback
//! only when wanted, so memory is one decoded frame plus what the callback keeps, never the
//! whole clip.

use std::io::Cursor;

use image::AnimationDecoder;
use openh264::formats::YUVSource;

use crate::error::{Result, VisionError};
use crate::preprocess::{Decoded, Mode};
use crate::resample::Raster;

/// Header facts of a clip, read before any frame is kept.
#[derive(Clone, Debug, PartialEq)]
pub struct ClipInfo {
    pub format: &'static str,
    pub width: usize,
    pub height: usize,
    /// Frames in the clip.
    pub num_frames: usize,
    /// Average frames per second.
    pub fps: f64,
}

pub(crate) fn err(name: &str, msg: impl Into<String>) -> VisionError {
    VisionError::Image { path: name.to_string(), msg: msg.into() }
}

pub(crate) const CONVERT: &str = "convert it with `ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT.mp4`";

/// The containers and codecs this build decodes, for error messages.
#[cfg(feature = "vp9")]
const SUPPORTED: &str = "MP4 with H.264, WebM/Matroska with VP8 or VP9, animated GIF, animated WebP";
#[cfg(not(feature = "vp9"))]
const SUPPORTED: &str = "MP4 with H.264, animated GIF, animated WebP";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Container {
    Mp4,
    Gif,
    WebP,
    #[cfg(feature = "vp9")]
    WebM,
}

fn container(bytes: &[u8], name: &str) -> Result<Container> {
    if bytes.is_empty() {
        return Err(err(name, "is empty (0 bytes): not a video"));
    }
    if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        return Ok(Container::Mp4);
    }
    if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        return Ok(Container::Gif);
    }
    if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        return Ok(Container::WebP);
    }
    if bytes.starts_with(&[0x1A, 0x45, 0xDF, 0xA3]) {
        #[cfg(feature = "vp9")]
        return Ok(Container::WebM);
        #[cfg(not(feature = "vp9"))]
        return Err(err(
            name,
            format!(
                "is WebM/Matroska, which this build does not decode (supported: {SUPPORTED}); {CONVERT}, or build k3 with `--features vp9` (VP8/VP9 through the system libvpx: `apt-get install libvpx-dev`)"
            ),
        ));
    }
    Err(err(name, format!("is not a recognised video (supported: {SUPPORTED})")))
}

/// Reads the clip's header: size, frame count and average rate (GIF and WebP are walked once,
/// one frame in memory at a time, since their frame count is not in a header). Refuses clips
/// over `max_source_frames` frames or `max_frame_pixels` pixels per frame before decoding them.
pub fn probe(bytes: &[u8], name: &str, max_source_frames: usize, max_frame_pixels: u64) -> Result<ClipInfo> {
    let kind = container(bytes, name)?;
    let info = match kind {
        Container::Mp4 => {
            let (rd, track) = mp4_track(bytes, name)?;
            let t = &rd.tracks()[&track];
            let n = t.sample_count() as usize;
            if t.timescale() == 0 {
                return Err(err(name, "MP4 video track has timescale 0 (corrupt header)"));
            }
            // The average rate over the sample durations (`stts`), as FFmpeg's `avg_frame_rate`;
            // the media header's duration may include an edit-list shift.
            let ticks: u64 = t.trak.mdia.minf.stbl.stts.entries.iter().map(|e| e.sample_count as u64 * e.sample_delta as u64).sum();
            let secs = if ticks > 0 { ticks as f64 / t.timescale() as f64 } else { t.duration().as_secs_f64() };
            let fps = if secs > 0.0 { n as f64 / secs } else { 0.0 };
            ClipInfo { format: "MP4/H.264", width: t.width() as usize, height: t.height() as usize, num_frames: n, fps }
        }
        Container::Gif | Container::WebP => {
            let (mut n, mut ms, mut size) = (0usize, 0f64, (0, 0));
            animation_frames(bytes, name, max_source_frames, max_frame_pixels, &mut |_, d, delay_ms| {
                n += 1;
                ms += delay_ms;
                size = (d.raster.w, d.raster.h);
                Ok(false)
            })?;
            // Browsers show zero-delay frames for 100 ms; so does this rate.
            let fps = if ms > 0.0 { n as f64 * 1000.0 / ms } else { 10.0 };
            let format = if kind == Container::Gif { "GIF" } else { "WebP" };
            ClipInfo { format, width: size.0, height: size.1, num_frames: n, fps }
        }
        #[cfg(feature = "vp9")]
        Container::WebM => crate::video_webm::probe(bytes, name, max_source_frames)?,
    };
    if info.num_frames == 0 {
        return Err(err(name, format!("{} video holds no frames", info.format)));
    }
    if info.width == 0 || info.height == 0 {
        return Err(err(name, format!("{} video is zero-sized ({}x{})", info.format, info.width, info.height)));
    }
    if !(info.fps.is_finite() && info.fps > 0.0) {
        return Err(err(name, format!("{} video has no usable duration (frame rate {})", info.format, info.fps)));
    }
    if info.num_frames > max_source_frames {
        return Err(err(name, format!("has {} frames, over the limit of {max_source_frames}", info.num_frames)));
    }
    let px = info.width as u64 * info.height as u64;
    if px > max_frame_pixels {
        return Err(err(name, format!("frames are {}x{} = {px} pixels, over the limit of {max_frame_pixels} per frame", info.width, info.height)));
    }
    Ok(info)
}

/// Decodes the clip in presentation order and calls `keep(i, frame)` for every `i` in `wanted`
/// (ascending); stops after the last wanted frame.
pub fn decode_frames(bytes: &[u8], name: &str, info: &ClipInfo, wanted: &[usize], keep: &mut dyn FnMut(usize, Decoded) -> Result<()>) -> Result<()> {
    let mut next = 0;
    // `make` converts the decoder's picture to pixels: called only for wanted frames.
    let mut offer = |i: usize, (w, h): (usize, usize), make: &mut dyn FnMut() -> Decoded| -> Result<bool> {
        if (w, h) != (info.width, info.height) {
            return Err(err(name, format!("frame {i} is {w}x{h}, the clip {}x{}: frame sizes must not change", info.width, info.height)));
        }
        if next < wanted.len() && wanted[next] == i {
            next += 1;
            keep(i, make())?;
        }
        Ok(next == wanted.len())
    };
    match container(bytes, name)? {
        Container::Mp4 => mp4_frames(bytes, name, &mut offer)?,
        Container::Gif | Container::WebP => animation_frames(bytes, name, usize::MAX, u64::MAX, &mut |i, d, _| {
            let size = (d.raster.w, d.raster.h);
            let mut d = Some(d);
            offer(i, size, &mut || d.take().expect("one frame is made once"))
        })?,
        #[cfg(feature = "vp9")]
        Container::WebM => crate::video_webm::frames(bytes, name, info, &mut offer)?,
    }
    if next < wanted.len() {
        return Err(err(name, format!("frame {} could not be decoded: the stream ends after fewer frames than its header counts", wanted[next])));
    }
    Ok(())
}

pub(crate) type Offer<'a> = dyn FnMut(usize, (usize, usize), &mut dyn FnMut() -> Decoded) -> Result<bool> + 'a;

/// Checks the MP4 box tree before the demuxer sees it: every box (and the boxes inside the
/// containers the demuxer walks, down to the sample entries) has a size of at least its header
/// and ends inside its parent. The `mp4` crate loops forever on some malformed sizes (found by
/// mutating a valid file), so this check is what keeps a corrupt upload from hanging a worker.
fn check_boxes(b: &[u8], mut off: usize, end: usize, depth: usize, name: &str) -> Result<()> {
    const CONTAINERS: [&[u8; 4]; 11] = [b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta", b"mvex", b"moof", b"traf"];
    let bad = |off: usize, what: String| err(name, format!("is a corrupt MP4 file: the box at byte {off} {what}"));
    if depth > 16 {
        return Err(bad(off, "nests too deep".into()));
    }
    while off < end {
        if end - off < 8 {
            return Err(bad(off, format!("is cut short ({} bytes left in its parent)", end - off)));
        }
        let size32 = u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]) as u64;
        let ty: [u8; 4] = [b[off + 4], b[off + 5], b[off + 6], b[off + 7]];
        let (size, header) = match size32 {
            1 if end - off >= 16 => (u64::from_be_bytes(b[off + 8..off + 16].try_into().unwrap_or([0; 8])), 16u64),
            0 if depth == 0 => ((end - off) as u64, 8),
            s => (s, 8),
        };
        if size < header || size > (end - off) as u64 {
            return Err(bad(off, format!("(type {:?}) has size {size}, outside {header}..={}", String::from_utf8_lossy(&ty), end - off)));
        }
        let (body, next) = (off + header as usize, off + size as usize);
        if CONTAINERS.contains(&&ty) {
            check_boxes(b, body, next, depth + 1, name)?;
        } else if &ty == b"stsd" && next - body >= 8 {
            check_boxes(b, body + 8, next, depth + 1, name)?;
        } else if (&ty == b"avc1" || &ty == b"avc3") && next - body >= 78 {
            check_boxes(b, body + 78, next, depth + 1, name)?;
        }
        off = next;
    }
    Ok(())
}

fn mp4_track<'a>(bytes: &'a [u8], name: &str) -> Result<(mp4::Mp4Reader<Cursor<&'a [u8]>>, u32)> {
    check_boxes(bytes, 0, bytes.len(), 0, name)?;
    let rd = mp4::Mp4Reader::read_header(Cursor::new(bytes), bytes.len() as u64).map_err(|e| err(name, format!("is not a readable MP4 file: {e}")))?;
    let mut video: Vec<(u32, String)> = Vec::new();
    for (&id, t) in rd.tracks() {
        if matches!(t.track_type(), Ok(mp4::TrackType::Video)) {
            let codec = t.media_type().map(|m| m.to_string()).unwrap_or_else(|_| t.box_type().map(|b| b.to_string()).unwrap_or_else(|_| "unknown".into()));
            video.push((id, codec));
        }
    }
    video.sort();
    match video.iter().find(|(_, c)| c == "h264") {
        Some(&(id, _)) => Ok((rd, id)),
        None if video.is_empty() => Err(err(name, "MP4 file has no video track")),
        None => Err(err(name, format!("MP4 video codec {} is not decoded by this build (H.264 only); {CONVERT}", video[0].1))),
    }
}

/// Length-prefixed (AVCC) NAL units → Annex-B start codes.
fn annex_b(avcc: &[u8], out: &mut Vec<u8>) -> bool {
    out.clear();
    let mut p = 0;
    while p < avcc.len() {
        let Some(len) = avcc.get(p..p + 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize) else {
            return false;
        };
        let Some(nal) = avcc.get(p + 4..p + 4 + len) else {
            return false;
        };
        out.extend_from_slice(&[0, 0, 0, 1]);
        out.extend_from_slice(nal);
        p += 4 + len;
    }
    true
}

fn yuv_to_decoded(y: &openh264::decoder::DecodedYUV<'_>) -> Decoded {
    let (w, h) = y.dimensions();
    let mut rgb = vec![0u8; w * h * 3];
    y.write_rgb8(&mut rgb);
    Decoded { mode: Mode::Rgb, raster: Raster::new(w, h, 3, rgb) }
}

/// Every frame of the first H.264 track, in presentation order: the decoder's k-th picture is
/// the k-th smallest presentation time (`start + composition offset`).
fn mp4_frames(bytes: &[u8], name: &str, offer: &mut Offer<'_>) -> Result<()> {
    let (mut rd, track) = mp4_track(bytes, name)?;
    let t = &rd.tracks()[&track];
    let sps = t.sequence_parameter_set().map_err(|e| err(name, format!("H.264 track has no SPS: {e}")))?.to_vec();
    let pps = t.picture_parameter_set().map_err(|e| err(name, format!("H.264 track has no PPS: {e}")))?.to_vec();
    let n = t.sample_count();
    // No flush after each packet: B-frames need the reorder buffer (openh264-rs #50, #64).
    let cfg = openh264::decoder::DecoderConfig::new().flush_after_decode(openh264::decoder::Flush::NoFlush);
    let mut dec = openh264::decoder::Decoder::with_api_config(openh264::OpenH264API::from_source(), cfg)
        .map_err(|e| err(name, format!("cannot start the H.264 decoder: {e}")))?;
    let mut head = Vec::with_capacity(sps.len() + pps.len() + 8);
    for ps in [&sps, &pps] {
        head.extend_from_slice(&[0, 0, 0, 1]);
        head.extend_from_slice(ps);
    }
    dec.decode(&head).map_err(|e| err(name, format!("corrupt H.264 parameter sets: {e}")))?;
    let mut out_index = 0;
    let mut nal = Vec::new();
    for s in 1..=n {
        let sample = rd
            .read_sample(track, s)
            .map_err(|e| err(name, format!("MP4 sample {s} cannot be read: {e}")))?
            .ok_or_else(|| err(name, format!("MP4 sample {s} is missing")))?;
        if !annex_b(&sample.bytes, &mut nal) {
            return Err(err(name, format!("MP4 sample {s} is corrupt (a NAL length runs past its end)")));
        }
        let pic = dec.decode(&nal).map_err(|e| err(name, format!("corrupt H.264 data in sample {s}: {e}")))?;
        if let Some(y) = pic {
            if offer(out_index, y.dimensions(), &mut || yuv_to_decoded(&y))? {
                return Ok(());
            }
            out_index += 1;
        }
    }
    let rest = dec.flush_remaining().map_err(|e| err(name, format!("corrupt H.264 data at the end of the stream: {e}")))?;
    for y in rest {
        if offer(out_index, y.dimensions(), &mut || yuv_to_decoded(&y))? {
            return Ok(());
        }
        out_index += 1;
    }
    Ok(())
}

/// Every composited frame of an animated GIF or WebP, with its delay in ms.
fn animation_frames(bytes: &[u8], name: &str, max_frames: usize, max_pixels: u64, f: &mut dyn FnMut(usize, Decoded, f64) -> Result<bool>) -> Result<()> {
    let kind = container(bytes, name)?;
    let corrupt = |e: image::ImageError| err(name, format!("corrupt or truncated {kind:?} data: {e}"));
    let frames = match kind {
        Container::Gif => {
            let d = image::codecs::gif::GifDecoder::new(Cursor::new(bytes)).map_err(corrupt)?;
            check_canvas(name, image::ImageDecoder::dimensions(&d), max_pixels)?;
            d.into_frames()
        }
        _ => {
            let d = image::codecs::webp::WebPDecoder::new(Cursor::new(bytes)).map_err(corrupt)?;
            check_canvas(name, image::ImageDecoder::dimensions(&d), max_pixels)?;
            if !d.has_animation() {
                return Err(err(name, "is a still WebP image, not an animation: send it as an image part"));
            }
            d.into_frames()
        }
    };
    for (i, fr) in frames.enumerate() {
        if i >= max_frames {
            return Err(err(name, format!("has more than {max_frames} frames, over the limit")));
        }
        let fr = fr.map_err(corrupt)?;
        let (num, den) = fr.delay().numer_denom_ms();
        let ms = if den == 0 { 0.0 } else { num as f64 / den as f64 };
        let ms = if ms <= 0.0 { 100.0 } else { ms };
        let buf = fr.into_buffer();
        let (w, h) = (buf.width() as usize, buf.height() as usize);
        let d = Decoded { mode: Mode::Rgba, raster: Raster::new(w, h, 4, buf.into_raw()) };
        if f(i, d, ms)? {
            return Ok(());
        }
    }
    Ok(())
}

fn check_canvas(name: &str, (w, h): (u32, u32), max_pixels: u64) -> Result<()> {
    if w as u64 * h as u64 > max_pixels {
        return Err(err(name, format!("frames are {w}x{h} = {} pixels, over the limit of {max_pixels} per frame", w as u64 * h as u64)));
    }
    Ok(())
}
