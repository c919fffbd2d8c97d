//! Synthetic H.264 clips in MP4 for the video tests and `examples/bench_video.rs` (one file,
//! included by both with `#[path]`): frames encoded by OpenH264 with frame skipping off (every
//! frame becomes a sample), muxed by the `mp4` writer at timescale 100·fps, 100 ticks a frame.

use std::io::Cursor;

/// An MP4 with one H.264 track of `n` frames `frame(i)` (RGB, `w × h`) at `fps`.
pub fn mp4_clip(n: usize, fps: f64, w: usize, h: usize, frame: &dyn Fn(usize) -> Vec<u8>) -> Result<Vec<u8>, Box<dyn std::error::Error>> {
    use openh264::formats::{RgbSliceU8, YUVBuffer};
    let ecfg = openh264::encoder::EncoderConfig::new().skip_frames(false).bitrate(openh264::encoder::BitRate::from_bps(8_000_000));
    let mut enc = openh264::encoder::Encoder::with_api_config(openh264::OpenH264API::from_source(), ecfg)?;
    let (mut sps, mut pps, mut samples) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let rgb = frame(i);
        let bs = enc.encode(&YUVBuffer::from_rgb8_source(RgbSliceU8::new(&rgb, (w, h))))?.to_vec();
        let mut avcc = Vec::new();
        for nal in openh264::nal_units(&bs) {
            let nal = nal.strip_prefix(&[0, 0, 0, 1][..]).or(nal.strip_prefix(&[0, 0, 1][..])).unwrap_or(nal);
            match nal[0] & 0x1f {
                7 => sps = nal.to_vec(),
                8 => pps = nal.to_vec(),
                _ => {
                    avcc.extend_from_slice(&(nal.len() as u32).to_be_bytes());
                    avcc.extend_from_slice(nal);
                }
            }
        }
        samples.push(avcc);
    }
    let cfg = mp4::Mp4Config { major_brand: "isom".parse()?, minor_version: 512, compatible_brands: vec!["isom".parse()?], timescale: 1000 };
    let mut wr = mp4::Mp4Writer::write_start(Cursor::new(Vec::new()), &cfg)?;
    let media_conf = mp4::MediaConfig::AvcConfig(mp4::AvcConfig { width: w as u16, height: h as u16, seq_param_set: sps, pic_param_set: pps });
    let timescale = (fps * 100.0).round() as u32;
    wr.add_track(&mp4::TrackConfig { track_type: mp4::TrackType::Video, timescale, language: "und".into(), media_conf })?;
    for (i, s) in samples.into_iter().enumerate() {
        let sample = mp4::Mp4Sample { start_time: i as u64 * 100, duration: 100, rendering_offset: 0, is_sync: i == 0, bytes: s.into() };
        wr.write_sample(1, &sample)?;
    }
    wr.write_end()?;
    Ok(wr.into_writer().into_inner())
}
