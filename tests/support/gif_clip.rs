//! The animated GIF the server and CLI video tests send to the `vision_small_f32` fixture
//! (included with `#[path]`): six 56×42 frames of 100 ms (10 fps). At the fixture's sample_fps 8,
//! round(4.8) = 5 frames are sampled (0, 1, 2, 4, 5), in chunks of 4 and 1, 4 tokens each.

pub fn gif_clip() -> Vec<u8> {
    let mut out = Vec::new();
    {
        let mut enc = image::codecs::gif::GifEncoder::new(&mut out);
        for i in 0..6u32 {
            let buf = image::RgbaImage::from_fn(56, 42, |x, y| image::Rgba([(40 * i) as u8, (x * 4) as u8, (y * 6) as u8, 255]));
            enc.encode_frame(image::Frame::from_parts(buf, 0, 0, image::Delay::from_numer_denom_ms(100, 1))).expect("gif frame");
        }
    }
    out
}
