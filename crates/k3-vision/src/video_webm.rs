//! WebM and Matroska clips with VP8 or VP9 video for the video path ([`crate::video_decode`];
//! k3-vision's `vp9` feature): the container through the pure-Rust `matroska-demuxer`, the
//! frames through libvpx ([`crate::video_vpx`]). The first video track is read; other tracks
//! (audio, subtitles) are skipped.
//!
//! Before the demuxer sees a file, [`check_ebml`] walks its element tree: every element's ID and
//! size are well-formed and it ends inside its parent (an unknown size only for a Segment or a
//! Cluster, as live recorders such as browsers' MediaRecorder write them), nesting stays under
//! 32 levels, and the chain of SeekHeads that the demuxer follows only moves forward. The
//! demuxer follows a SeekHead's pointer to another SeekHead without remembering where it has
//! been, so a SeekHead that points back at itself hangs it (the test's mutant); every other
//! size it reads it checks against the stream.
//!
//! Frame rate: FFmpeg's Matroska demuxer (hence decord, the reference's reader) reports a
//! track's `DefaultDuration` as `avg_frame_rate = av_reduce(1e9, DefaultDuration, 30000)`; that
//! rate is used when the block timestamps agree with it (within one tick of the timestamp
//! scale), else the timestamps' mean rate `(F − 1) / (t_last − t_first)`.
//!
//! Shape legend: `F` visible frames of the first video track, each `W×H` (the track's
//! `PixelWidth × PixelHeight`); VP8 and VP9 show frames in decoding order.

use std::io::Cursor;

use matroska_demuxer::{Frame, MatroskaFile, TrackType};

use crate::error::Result;
use crate::preprocess::Decoded;
use crate::video_decode::{err, ClipInfo, Offer, CONVERT};
use crate::video_vpx::{Codec, VpxDecoder};

const SEGMENT: u32 = 0x1853_8067;
const CLUSTER: u32 = 0x1F43_B675;
const SEEK_HEAD: u32 = 0x114D_9B74;
const SEEK: u32 = 0x4DBB;
const SEEK_ID: u32 = 0x53AB;
const SEEK_POSITION: u32 = 0x53AC;
const CRC32: u32 = 0xBF;

/// Master elements whose children the demuxer reads (EBML header, Segment, SeekHead, Seek,
/// Info, Tracks, TrackEntry, Video, Audio, Colour, MasteringMetadata, ContentEncodings,
/// ContentEncoding, ContentCompression, ContentEncryption, ContentEncAESSettings, Cluster,
/// BlockGroup, Cues, CuePoint, CueTrackPositions, Chapters, EditionEntry, ChapterAtom,
/// ChapterDisplay, Tags, Tag, Targets, SimpleTag).
const MASTERS: [u32; 29] = [
    0x1A45_DFA3,
    SEGMENT,
    SEEK_HEAD,
    SEEK,
    0x1549_A966,
    0x1654_AE6B,
    0xAE,
    0xE0,
    0xE1,
    0x55B0,
    0x55D0,
    0x6D80,
    0x6240,
    0x5034,
    0x5035,
    0x47E7,
    CLUSTER,
    0xA0,
    0x1C53_BB6B,
    0xBB,
    0xB7,
    0x1043_A770,
    0x45B9,
    0xB6,
    0x80,
    0x1254_C367,
    0x7373,
    0x63C0,
    0x67C8,
];

fn id_name(id: u32) -> &'static str {
    match id {
        0x1A45_DFA3 => " (EBML header)",
        SEGMENT => " (Segment)",
        CLUSTER => " (Cluster)",
        SEEK_HEAD => " (SeekHead)",
        0x1549_A966 => " (Info)",
        0x1654_AE6B => " (Tracks)",
        0xAE => " (TrackEntry)",
        0xA3 => " (SimpleBlock)",
        0xA0 => " (BlockGroup)",
        0x1C53_BB6B => " (Cues)",
        _ => "",
    }
}

/// One element header at `p`, read as the demuxer reads it (bytes below 0x10 before an ID are
/// skipped): its ID, its data size (`None`: unknown) and where its data starts.
fn header(b: &[u8], mut p: usize) -> std::result::Result<(u32, Option<u64>, usize), String> {
    while b.get(p).is_some_and(|&x| x < 0x10) {
        p += 1;
    }
    let at = p;
    let cut = || format!("the element header at byte {at} is cut short by the end of the file");
    let first = *b.get(p).ok_or_else(cut)?;
    let id_len = first.leading_zeros() as usize + 1;
    let id = b.get(p..p + id_len).ok_or_else(cut)?.iter().fold(0u32, |a, &x| a << 8 | x as u32);
    p += id_len;
    let s0 = *b.get(p).ok_or_else(cut)?;
    if s0 == 0 {
        return Err(format!("the element {id:#X} at byte {at} has an invalid size field"));
    }
    let len = s0.leading_zeros() as usize + 1;
    let bytes = b.get(p..p + len).ok_or_else(cut)?;
    let mask = if len == 8 { 0 } else { 0xFFu8 >> len };
    let v = bytes[1..].iter().fold((s0 & mask) as u64, |a, &x| a << 8 | x as u64);
    let unknown = v == (1u64 << (7 * len)) - 1;
    Ok((id, (!unknown).then_some(v), p + len))
}

/// Checks the element tree of `b` (see the module text); `Err` says where it is broken.
pub(crate) fn check_ebml(b: &[u8]) -> std::result::Result<(), String> {
    walk(b, 0, b.len(), 0)
}

fn walk(b: &[u8], mut off: usize, end: usize, depth: usize) -> std::result::Result<(), String> {
    if depth > 32 {
        return Err(format!("the elements at byte {off} nest deeper than 32 levels"));
    }
    while off < end {
        // Bytes below 0x10 are skipped before an ID (as the demuxer does); padding may end a file.
        while off < end && b[off] < 0x10 {
            off += 1;
        }
        if off == end {
            break;
        }
        let (id, size, body) = header(b, off)?;
        if body > end {
            return Err(format!("the element {id:#X}{} at byte {off} runs past the end of its parent", id_name(id)));
        }
        let next = match size {
            // A live Cluster's children follow as if they were the Cluster's siblings.
            None if id == CLUSTER => {
                off = body;
                continue;
            }
            None if id == SEGMENT => end,
            None => return Err(format!("the element {id:#X}{} at byte {off} has an unknown size (allowed for a Segment or a Cluster only)", id_name(id))),
            Some(s) if s > (end - body) as u64 => {
                let parent = if end == b.len() { "the file (cut short?)" } else { "its parent" };
                return Err(format!("the element {id:#X}{} at byte {off} has size {s}, past the end of {parent}: {} bytes left", id_name(id), end - body));
            }
            Some(s) => body + s as usize,
        };
        if id == SEGMENT {
            check_seek_heads(b, body, next)?;
        }
        if MASTERS.contains(&id) {
            walk(b, body, next, depth + 1)?;
        }
        off = next;
    }
    Ok(())
}

/// Follows the SeekHead chain as the demuxer does (the first element of the Segment after any
/// CRC-32 headers, then each SeekHead's first Seek entry that names a SeekHead, at
/// `segment data + SeekPosition`): every step must move forward.
fn check_seek_heads(b: &[u8], seg: usize, seg_end: usize) -> std::result::Result<(), String> {
    let mut at = seg;
    loop {
        let (id, _, body) = header(b, at)?;
        if id != CRC32 {
            break;
        }
        at = body;
    }
    loop {
        let Ok((SEEK_HEAD, size, body)) = header(b, at) else {
            return Ok(());
        };
        let end = size.map_or(seg_end, |s| body.saturating_add(s as usize).min(seg_end));
        let mut p = body;
        let mut next = None;
        while p < end && next.is_none() {
            let (id, size, data) = header(b, p)?;
            let stop = size.map_or(end, |s| data.saturating_add(s as usize).min(end));
            if id == SEEK {
                let (mut sid, mut pos, mut q) = (None, None, data);
                while q < stop {
                    let (cid, csize, cdata) = header(b, q)?;
                    let cend = csize.map_or(stop, |s| cdata.saturating_add(s as usize).min(stop));
                    let uint = || b.get(cdata..cend).unwrap_or_default().iter().fold(0u64, |a, &x| a.wrapping_shl(8) | x as u64);
                    match cid {
                        SEEK_ID if sid.is_none() => sid = Some(uint()),
                        SEEK_POSITION if pos.is_none() => pos = Some(uint()),
                        _ => {}
                    }
                    q = cend.max(cdata);
                    if csize.is_none() {
                        break;
                    }
                }
                if let (Some(s), Some(pos)) = (sid, pos) {
                    if s == SEEK_HEAD as u64 {
                        next = Some((seg as u64).saturating_add(pos));
                    }
                }
            }
            p = stop.max(data);
            if size.is_none() {
                break;
            }
        }
        match next {
            None => return Ok(()),
            Some(t) if t <= at as u64 => return Err(format!("the SeekHead at byte {at} points back to byte {t} (a loop)")),
            Some(t) if t >= b.len() as u64 => return Ok(()),
            Some(t) => at = t as usize,
        }
    }
}

/// The video track to decode.
struct Track {
    number: u64,
    codec: Codec,
    format: &'static str,
    width: usize,
    height: usize,
    default_duration: Option<u64>,
    /// Nanoseconds per timestamp tick.
    scale: u64,
}

fn open<'a>(bytes: &'a [u8], name: &str) -> Result<(MatroskaFile<Cursor<&'a [u8]>>, Track)> {
    check_ebml(bytes).map_err(|m| err(name, format!("is a corrupt WebM/Matroska file: {m}")))?;
    let mkv = MatroskaFile::open(Cursor::new(bytes)).map_err(|e| err(name, format!("is not a readable WebM/Matroska file: {e}")))?;
    let webm = mkv.ebml_header().doc_type() == "webm";
    let Some(t) = mkv.tracks().iter().find(|t| t.track_type() == TrackType::Video) else {
        return Err(err(name, "WebM/Matroska file has no video track"));
    };
    let (codec, format) = match (t.codec_id(), webm) {
        ("V_VP9", true) => (Codec::Vp9, "WebM/VP9"),
        ("V_VP9", false) => (Codec::Vp9, "Matroska/VP9"),
        ("V_VP8", true) => (Codec::Vp8, "WebM/VP8"),
        ("V_VP8", false) => (Codec::Vp8, "Matroska/VP8"),
        (other, _) => return Err(err(name, format!("WebM/Matroska video codec {other} is not decoded by this build (VP8 and VP9 only); {CONVERT}"))),
    };
    if t.content_encodings().is_some_and(|e| !e.is_empty()) {
        return Err(err(name, format!("{format} track is compressed or encrypted (ContentEncoding), which this build does not decode; {CONVERT}")));
    }
    let v = t.video().ok_or_else(|| err(name, format!("{format} track has no Video element (no frame size)")))?;
    let px = |n: std::num::NonZeroU64| usize::try_from(n.get()).ok().filter(|&n| n <= 1 << 20);
    let (Some(width), Some(height)) = (px(v.pixel_width()), px(v.pixel_height())) else {
        return Err(err(name, format!("{format} track declares an impossible frame size {}x{}", v.pixel_width(), v.pixel_height())));
    };
    let track = Track {
        number: t.track_number().get(),
        codec,
        format,
        width,
        height,
        default_duration: t.default_duration().map(|d| d.get()),
        scale: mkv.info().timestamp_scale().get(),
    };
    Ok((mkv, track))
}

fn next_frame(mkv: &mut MatroskaFile<Cursor<&[u8]>>, f: &mut Frame, name: &str) -> Result<bool> {
    mkv.next_frame(f).map_err(|e| err(name, format!("corrupt or truncated WebM/Matroska data: {e}")))
}

/// `num/den` as the nearest fraction with both terms ≤ `max` (continued fractions, the last
/// term cut to fit when that is closer; FFmpeg's `av_reduce`).
fn reduce(num: u64, den: u64, max: u64) -> (u64, u64) {
    let (mut n, mut d) = (num as u128, den as u128);
    let max = max as u128;
    let (mut a0, mut a1) = ((0u128, 1u128), (1u128, 0u128));
    if n <= max && d <= max && d != 0 {
        let g = gcd(n, d);
        return ((n / g) as u64, (d / g) as u64);
    }
    while d != 0 {
        let x = n / d;
        let (an, ad) = (x * a1.0 + a0.0, x * a1.1 + a0.1);
        if an > max || ad > max {
            // The largest last term that keeps both terms ≤ max.
            let x = [(a0.0, a1.0), (a0.1, a1.1)].iter().filter_map(|&(a, b)| (max - a).checked_div(b)).min().unwrap_or(u128::MAX);
            if d * (2 * x * a1.1 + a0.1) > n * a1.1 {
                a1 = (x * a1.0 + a0.0, x * a1.1 + a0.1);
            }
            break;
        }
        (a0, a1) = (a1, (an, ad));
        (n, d) = (d, n - d * x);
    }
    (a1.0 as u64, a1.1 as u64)
}

fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The clip's average rate (module text); 0 when there is none.
fn rate(n: usize, first: u64, last: u64, t: &Track, segment_ticks: Option<f64>) -> f64 {
    let span_ns = last.saturating_sub(first) as f64 * t.scale as f64;
    if let Some(dd) = t.default_duration {
        if n < 2 || ((n - 1) as f64 * dd as f64 - span_ns).abs() <= t.scale as f64 {
            let (p, q) = reduce(1_000_000_000, dd, 30000);
            return if q == 0 { 0.0 } else { p as f64 / q as f64 };
        }
    }
    match n {
        0 => 0.0,
        // One frame: the segment's duration, else one frame a second (its time is 0 either way).
        1 => segment_ticks.filter(|&d| d > 0.0).map_or(1.0, |d| 1e9 / (d * t.scale as f64)),
        _ if span_ns > 0.0 => (n - 1) as f64 * 1e9 / span_ns,
        _ => 0.0,
    }
}

/// The clip's header facts; the blocks are walked once (without decoding) to count the frames
/// and read their timestamps, stopping past `max_source_frames`.
pub(crate) fn probe(bytes: &[u8], name: &str, max_source_frames: usize) -> Result<ClipInfo> {
    let (mut mkv, t) = open(bytes, name)?;
    let segment_ticks = mkv.info().duration();
    let (mut f, mut n, mut first, mut last) = (Frame::default(), 0usize, u64::MAX, 0u64);
    while next_frame(&mut mkv, &mut f, name)? {
        if f.track != t.number || f.is_invisible {
            continue;
        }
        n += 1;
        if n > max_source_frames {
            return Err(err(name, format!("has more than {max_source_frames} frames, over the limit")));
        }
        first = first.min(f.timestamp);
        last = last.max(f.timestamp);
    }
    let fps = rate(n, first, last, &t, segment_ticks);
    Ok(ClipInfo { format: t.format, width: t.width, height: t.height, num_frames: n, fps })
}

/// Every shown frame of the first video track, in order, offered one at a time. The decoder's
/// picture buffers are bounded by `info`'s frame size (which [`probe`]'s caller checked).
pub(crate) fn frames(bytes: &[u8], name: &str, info: &ClipInfo, offer: &mut Offer<'_>) -> Result<()> {
    let (mut mkv, t) = open(bytes, name)?;
    let codec = if t.codec == Codec::Vp9 { "VP9" } else { "VP8" };
    let mut dec = VpxDecoder::new(t.codec, (info.width, info.height)).map_err(|m| err(name, format!("cannot start the {codec} decoder: {m}")))?;
    let (mut f, mut block, mut shown) = (Frame::default(), 0usize, 0usize);
    let mut more = true;
    while more {
        more = next_frame(&mut mkv, &mut f, name)?;
        if more && f.track != t.number {
            continue;
        }
        block += more as usize;
        let sent = if more { dec.decode(&f.data) } else { dec.flush() };
        sent.map_err(|m| err(name, format!("corrupt {codec} data in video block {block}: {m}")))?;
        while let Some(p) = dec.next_picture().map_err(|m| err(name, format!("{codec} video block {block}: {m}")))? {
            if offer(shown, p.dimensions(), &mut || -> Decoded { p.to_decoded() })? {
                return Ok(());
            }
            shown += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_reduce_like_ffmpeg() {
        // 1e9 / 83333333 ns = 12.0000048 fps → 12/1; NTSC's 33366667 ns → 30000/1001.
        assert_eq!(reduce(1_000_000_000, 83_333_333, 30000), (12, 1));
        assert_eq!(reduce(1_000_000_000, 33_366_667, 30000), (30000, 1001));
        assert_eq!(reduce(1_000_000_000, 40_000_000, 30000), (25, 1));
        assert_eq!(reduce(6, 4, 30000), (3, 2));
    }

    #[test]
    fn element_headers_read_ids_sizes_and_unknown_sizes() {
        // Cluster, a 2-byte size 0x0435; then a Segment of unknown 8-byte size.
        let b = [0x1F, 0x43, 0xB6, 0x75, 0x44, 0x35];
        assert_eq!(header(&b, 0), Ok((CLUSTER, Some(0x435), 6)));
        let b = [0x18, 0x53, 0x80, 0x67, 0x01, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF];
        assert_eq!(header(&b, 0), Ok((SEGMENT, None, 12)));
        assert!(header(&b[..7], 0).unwrap_err().contains("cut short"));
        assert!(header(&[0xA3, 0x00], 0).unwrap_err().contains("invalid size"));
    }
}
