//! WebM/Matroska video with VP9 and VP8 (k3-vision's `vp9` feature; `video_webm`, `video_vpx`):
//! the libvpx clips of tests/data (README there), checked frame by frame against the colours
//! they were made with; variants patched here (a live recorder's unknown sizes, no
//! `DefaultDuration`, lying frame sizes, another codec, a SeekHead loop); corrupt, truncated and
//! oversize files refused naming the request part; 300 seeded mutations under a watchdog.
//! Without the feature this target holds no test (tests/video.rs checks the refusal).
#![cfg(feature = "vp9")]

use k3_vision::video::{preprocess_video_bytes, timestamp, VideoLimits};

#[path = "support/video_common.rs"]
mod video_common;
use video_common::*;

fn clip(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}

fn find(b: &[u8], pat: &[u8]) -> usize {
    b.windows(pat.len()).position(|w| w == pat).unwrap_or_else(|| panic!("{pat:02x?} not in the clip"))
}

/// Overwrites the value of the first element `id` (with a 1-byte size field) after the track's
/// CodecID (FFmpeg writes the Video element after it), keeping its length.
fn set_track_uint(b: &mut [u8], id: &[u8], v: u64) {
    let codec = find(b, b"V_VP");
    let at = codec + b[codec..].windows(id.len() + 1).position(|w| &w[..id.len()] == id && w[id.len()] & 0x80 != 0).unwrap();
    let len = (b[at + id.len()] & 0x7F) as usize;
    let data = at + id.len() + 1;
    b[data..data + len].copy_from_slice(&v.to_be_bytes()[8 - len..]);
}

/// Rewrites the size field of the element whose ID starts at `at` (ID of `id_len` bytes) as
/// "unknown", keeping its length: what live recorders write.
fn make_size_unknown(b: &mut [u8], at: usize, id_len: usize) {
    let p = at + id_len;
    let len = b[p].leading_zeros() as usize + 1;
    b[p] = ((1u16 << (9 - len)) - 1) as u8;
    b[p + 1..p + len].iter_mut().for_each(|x| *x = 0xFF);
}

fn frames_of(v: &k3_vision::video::PreprocessedVideo) -> Vec<usize> {
    v.chunks.iter().flat_map(|c| c.frames.clone()).collect()
}

/// Every sampled frame's mean red is `red(source index)` within `tol`.
fn check_colours(v: &k3_vision::video::PreprocessedVideo, red: impl Fn(usize) -> f64, tol: f64) {
    for c in &v.chunks {
        for (j, &src) in c.frames.iter().enumerate() {
            let r = mean_red(&c.pixel_values, c.grid_thw, j, c.plan.new_width, c.plan.new_height);
            assert!((r - red(src)).abs() < tol, "frame {src}: mean red {r}, want {}", red(src));
        }
    }
}

#[test]
fn vp9_frames_are_sampled_timed_and_chunked() {
    let webm = clip("vp9_24f_12fps.webm");
    // 24 frames at 12 fps (DefaultDuration 83333333 ns, reduced as FFmpeg does), sampled at 8 fps:
    // round(24·8/12) = 16 frames in 4 chunks of 4, as the MP4 of the same shape.
    let v = preprocess_video_bytes(&webm, "clip.webm", &processor(8.0), &VideoLimits::default()).unwrap();
    assert_eq!((v.info.format, v.info.width, v.info.height, v.info.num_frames, v.info.fps), ("WebM/VP9", 64, 48, 24, 12.0));
    assert_eq!(frames_of(&v), vec![0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18, 20, 21, 23]);
    assert_eq!(v.chunks.iter().map(|c| c.grid_thw[0]).collect::<Vec<_>>(), vec![4, 4, 4, 4]);
    for c in &v.chunks {
        assert!((c.time_s - c.frames[0] as f64 / 12.0).abs() < 1e-12);
        assert_eq!(c.pixel_values.len(), c.grid_thw.iter().product::<usize>() * 588);
    }
    check_colours(&v, |i| 8.0 * i as f64, 4.0);

    // At 5 fps: round(10) frames, linspace(0, 23, 10) = 0, 2.56, 5.11, 7.67, …: chunks of 4, 4, 2.
    let v5 = preprocess_video_bytes(&webm, "clip.webm", &processor(5.0), &VideoLimits::default()).unwrap();
    assert_eq!(frames_of(&v5), vec![0, 3, 5, 8, 10, 13, 15, 18, 20, 23]);
    assert_eq!(v5.chunks.iter().map(|c| c.grid_thw[0]).collect::<Vec<_>>(), vec![4, 4, 2]);
    assert_eq!(v5.chunks.iter().map(|c| timestamp(c.time_s)).collect::<Vec<_>>(), vec!["00:00:00.000", "00:00:00.833", "00:00:01.666"]);
    check_colours(&v5, |i| 8.0 * i as f64, 4.0);

    // A live recording's layout (Segment and Cluster of unknown size): the same pixels.
    let mut live = webm.clone();
    for id in [[0x18, 0x53, 0x80, 0x67], [0x1F, 0x43, 0xB6, 0x75]] {
        let at = find(&live, &id);
        make_size_unknown(&mut live, at, 4);
    }
    let lv = preprocess_video_bytes(&live, "live.webm", &processor(8.0), &VideoLimits::default()).unwrap();
    assert_eq!(lv.info, v.info);
    assert!(lv.chunks.iter().zip(&v.chunks).all(|(a, b)| a.pixel_values == b.pixel_values && a.frames == b.frames));

    // Without DefaultDuration (its ID made unknown): the rate of the millisecond timestamps,
    // 23 intervals over 1.917 s.
    let mut vfr = webm.clone();
    let dd = find(&vfr, &[0x23, 0xE3, 0x83]);
    vfr[dd + 2] = 0x84;
    let info = k3_vision::video::probe_video(&vfr, "vfr.webm", &VideoLimits::default()).unwrap();
    assert_eq!(info.num_frames, 24);
    assert!((info.fps - 23.0 / 1.917).abs() < 1e-9, "{}", info.fps);
}

#[test]
fn vp8_frames_come_out_in_order() {
    let v = preprocess_video_bytes(&clip("vp8_10f_10fps.webm"), "clip.webm", &processor(10.0), &VideoLimits::default()).unwrap();
    assert_eq!((v.info.format, v.info.width, v.info.height, v.info.num_frames, v.info.fps), ("WebM/VP8", 48, 32, 10, 10.0));
    assert_eq!(frames_of(&v), (0..10).collect::<Vec<_>>());
    assert_eq!(v.chunks.iter().map(|c| c.grid_thw[0]).collect::<Vec<_>>(), vec![4, 4, 2]);
    check_colours(&v, |i| 20.0 * i as f64 + 10.0, 4.0);
}

/// A one-frame WebM gives exactly the image path's features for the same pixels.
#[test]
fn one_frame_webm_equals_the_image_path() {
    let w = weights();
    let vm = model(&w, processor(2.0));
    let webm = clip("vp9_one_frame.webm");
    let v = vm.encode_video_bytes(&webm, "one.webm", &VideoLimits::default()).unwrap();
    assert_eq!(v.chunks.len(), 1);
    let (_, frames, f) = &v.chunks[0];
    assert_eq!((frames.as_slice(), f.grid_thw[0]), (&[0usize][..], 1));
    let info = k3_vision::video_decode::probe(&webm, "one.webm", 10, 1 << 21).unwrap();
    assert_eq!((info.width, info.height, info.num_frames), (1280, 720, 1));
    let mut png = Vec::new();
    k3_vision::video_decode::decode_frames(&webm, "one.webm", &info, &[0], &mut |_, d| {
        // The four quadrants' colours survive the codec.
        let px = |x: usize, y: usize| &d.raster.data[(y * 1280 + x) * 3..][..3];
        for (x, y, want) in [(100, 100, [200, 40, 40]), (1100, 100, [40, 200, 40]), (100, 600, [40, 40, 200]), (1100, 600, [230, 230, 60])] {
            assert!(px(x, y).iter().zip(want).all(|(&a, b)| (a as i32 - b).abs() <= 3), "({x}, {y}): {:?} vs {want:?}", px(x, y));
        }
        image::ImageEncoder::write_image(image::codecs::png::PngEncoder::new(&mut png), &d.raster.data, 1280, 720, image::ExtendedColorType::Rgb8).unwrap();
        Ok(())
    })
    .unwrap();
    let img = vm.encode_bytes(&png, "frame.png").unwrap();
    assert_eq!(img.grid_thw, f.grid_thw);
    assert_eq!(img.pixel_values, f.pixel_values, "pixels");
    assert_eq!(img.projected, f.projected, "projected rows");
    assert_eq!(v.prompt_text().matches("<|media_pad|>").count(), f.num_tokens);
}

#[test]
fn corrupt_truncated_lying_and_oversize_webms_are_refused() {
    let cfg = processor(2.0);
    let lim = VideoLimits::default();
    let field = "messages[0].content[1].video_url";
    let e = |b: &[u8], l: &VideoLimits| preprocess_video_bytes(b, field, &cfg, l).unwrap_err().to_string();
    let webm = clip("vp9_24f_12fps.webm");
    for cut in [8, 40, webm.len() / 3, webm.len() / 2, webm.len() - 20] {
        let m = e(&webm[..cut], &lim);
        assert!(m.contains(field), "cut at {cut}: {m}");
    }
    let m = e(&webm[..webm.len() / 2], &lim);
    assert!(m.contains("corrupt WebM/Matroska") && m.contains("past the end"), "{m}");
    let m = e(&[0x1A, 0x45, 0xDF, 0xA3, 1, 2, 3, 4], &lim);
    assert!(m.contains(field) && m.contains("WebM"), "{m}");

    // A Cluster longer than the file.
    let mut long = webm.clone();
    let c = find(&long, &[0x1F, 0x43, 0xB6, 0x75]);
    long[c + 4] = 0x7E;
    let m = e(&long, &lim);
    assert!(m.contains("(Cluster)") && m.contains("past the end"), "{m}");

    // Another codec, same length.
    let mut av1 = webm.clone();
    let at = find(&av1, b"V_VP9");
    av1[at..at + 5].copy_from_slice(b"V_AV1");
    let m = e(&av1, &lim);
    assert!(m.contains("V_AV1 is not decoded") && m.contains("ffmpeg"), "{m}");

    // Frame sizes that differ from the track header: a little (the frame check), a lot (the
    // picture buffers libvpx asks for are refused before it decodes into them), VP8 key frames
    // (read before decoding).
    let mut narrow = webm.clone();
    set_track_uint(&mut narrow, &[0xB0], 32);
    let m = e(&narrow, &lim);
    assert!(m.contains("frame 0 is 64x48, the clip 32x48"), "{m}");
    let mut tiny = clip("vp9_one_frame.webm");
    set_track_uint(&mut tiny, &[0xB0], 16);
    set_track_uint(&mut tiny, &[0xBA], 16);
    let m = e(&tiny, &lim);
    assert!(m.contains("larger than its header says") && m.contains("16x16"), "{m}");
    let mut vp8 = clip("vp8_10f_10fps.webm");
    set_track_uint(&mut vp8, &[0xB0], 40);
    let m = e(&vp8, &lim);
    assert!(m.contains("VP8 key frame is 48x32, the track header says 40x32"), "{m}");

    // Limits: sampled frames, source frames, pixels per frame.
    let m = e(&webm, &VideoLimits { max_frames: 1, ..lim });
    assert!(m.contains("over the limit of 1 frames"), "{m}");
    let m = e(&webm, &VideoLimits { max_source_frames: 10, ..lim });
    assert!(m.contains("more than 10 frames"), "{m}");
    let m = e(&webm, &VideoLimits { max_frame_pixels: 1000, ..lim });
    assert!(m.contains("64x48") && m.contains("over the limit"), "{m}");
}

/// A SeekHead whose Seek entry points back at itself: the demuxer would follow it forever.
#[test]
fn a_seek_head_loop_is_refused_not_followed() {
    let mut looped = clip("vp9_24f_12fps.webm");
    let seek_id = find(&looped, &[0x53, 0xAB, 0x84]) + 3;
    looped[seek_id..seek_id + 4].copy_from_slice(&[0x11, 0x4D, 0x9B, 0x74]);
    let pos = find(&looped, &[0x53, 0xAC, 0x81]) + 3;
    looped[pos] = 0; // SeekPosition 0: the SeekHead itself, the Segment's first element.
    let m = within(10, move || preprocess_video_bytes(&looped, "loop.webm", &processor(8.0), &VideoLimits::default()).map(|_| ()));
    let m = m.unwrap_err().to_string();
    assert!(m.contains("SeekHead") && m.contains("points back"), "{m}");
}

/// Corrupt WebMs end in an error or in frames, never in a hang or a panic: 300 seeded mutations
/// (bytes, runs of 0xff, truncations) of the VP9 clip.
#[test]
fn mutated_webms_never_hang_or_panic() {
    let webm = clip("vp9_24f_12fps.webm");
    let (ok, bad) = mutation_outcomes(webm, "mutated.webm", 2024);
    assert_eq!(ok + bad, 300);
    assert!(ok > 0 && bad > 0, "mutations must be refused sometimes, and survived sometimes ({ok} decoded)");
}
