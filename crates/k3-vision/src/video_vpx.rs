//! libvpx's VP8 and VP9 decoders for WebM clips ([`crate::video_webm`]; the `vp9` feature): the
//! owner of one `vpx_codec_ctx_t`, picture buffers handed to libvpx by this module so that no
//! picture larger than the track's declared size gets memory, and the conversion of a decoded
//! `vpx_image_t` to RGB bytes.
//!
//! Memory: a VP9 stream may change its frame size at any frame (key frames, intra-only frames,
//! inter frames with an explicit size) up to libvpx's build limit (Debian: 16384×16384, about
//! 400 MB a picture, 15 pictures alive). Every VP9 picture buffer comes from [`get_fb`], which
//! refuses one larger than a picture of the track's `PixelWidth × PixelHeight` can need, so the
//! decoder fails instead. VP8 changes size only at key frames, whose size is read from their
//! header (RFC 6386 §9.1) before libvpx sees them.
//!
//! Colour: 4:2:0, 4:2:2, 4:4:0 and 4:4:4, 8 to 12 bits (scaled to 8), the BT.601 (also when
//! unknown), BT.709, SMPTE 240M or BT.2020 matrix in studio or full range, or VP9's sRGB (planes
//! G, B, R). BT.601 studio range, what WebM encoders write by default, is OpenH264's conversion
//! for the MP4 path.
//!
//! Shape legend: a picture is `W×H` luma samples and chroma planes of `⌈W/2^sx⌉ × ⌈H/2^sy⌉`
//! (`sx`, `sy` the chroma shifts); the output is `W·H·3` RGB bytes, row-major.

use std::ffi::CStr;
use std::marker::PhantomData;
use std::os::raw::{c_int, c_uint, c_void};
use std::ptr;

use vpx_sys as vpx;

use crate::preprocess::{Decoded, Mode};
use crate::resample::Raster;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codec {
    Vp8,
    Vp9,
}

/// What [`get_fb`] may hand out, and what it refused.
struct Buffers {
    limit: usize,
    refused: Option<usize>,
}

/// The most bytes a libvpx picture buffer of a `w×h` frame needs: 4:4:4 at 16 bits a sample
/// (6 bytes a pixel), frame sizes rounded up to 8, a 160-pixel border on every side (the
/// encoder's; the decoder's is 32), the stride rounded to 32, and slack for alignment.
pub(crate) fn picture_buffer_limit(w: usize, h: usize) -> usize {
    let (aw, ah) = (w.div_ceil(8) * 8, h.div_ceil(8) * 8);
    6usize.saturating_mul((aw + 320 + 32).saturating_mul(ah + 320)).saturating_add(4096)
}

/// libvpx's picture-buffer callback (VP9): a zeroed buffer of `min_size` bytes, owned through
/// `fb.priv_` until [`release_fb`], or -1 (the frame fails to decode) past the limit.
unsafe extern "C" fn get_fb(priv_: *mut c_void, min_size: vpx::size_t, fb: *mut vpx::vpx_codec_frame_buffer_t) -> c_int {
    // SAFETY: `priv_` is the `Buffers` registered with this callback, alive as long as the
    // decoder (it is dropped after `vpx_codec_destroy`); `fb` is libvpx's, valid for this call.
    let (b, fb) = unsafe { (&mut *(priv_ as *mut Buffers), &mut *fb) };
    let n = min_size as usize;
    if n > b.limit {
        b.refused = Some(n);
        return -1;
    }
    let mut buf = Box::new(vec![0u8; n]);
    fb.data = buf.as_mut_ptr();
    fb.size = min_size;
    fb.priv_ = Box::into_raw(buf) as *mut c_void;
    0
}

/// libvpx's release callback: frees what [`get_fb`] handed out (also at `vpx_codec_destroy`).
unsafe extern "C" fn release_fb(_priv: *mut c_void, fb: *mut vpx::vpx_codec_frame_buffer_t) -> c_int {
    // SAFETY: `fb.priv_` is null or the `Box<Vec<u8>>` leaked by `get_fb` for this buffer.
    unsafe {
        let fb = &mut *fb;
        if !fb.priv_.is_null() {
            drop(Box::from_raw(fb.priv_ as *mut Vec<u8>));
            fb.priv_ = ptr::null_mut();
            fb.data = ptr::null_mut();
        }
    }
    0
}

/// The frame size of a VP8 key frame (RFC 6386 §9.1: a 3-byte tag whose bit 0 is 0, the start
/// code 9d 01 2a, then 14-bit width and height), `None` for other frames.
fn vp8_key_frame_size(d: &[u8]) -> Option<(usize, usize)> {
    if d.len() < 10 || d[0] & 1 != 0 || d[3..6] != [0x9d, 0x01, 0x2a] {
        return None;
    }
    let dim = |lo: u8, hi: u8| (u16::from_le_bytes([lo, hi]) & 0x3fff) as usize;
    Some((dim(d[6], d[7]), dim(d[8], d[9])))
}

/// One libvpx decoder for frames of the declared `size`.
pub(crate) struct VpxDecoder {
    ctx: Box<vpx::vpx_codec_ctx_t>,
    buffers: Box<Buffers>,
    codec: Codec,
    size: (usize, usize),
    iter: vpx::vpx_codec_iter_t,
}

impl VpxDecoder {
    pub(crate) fn new(codec: Codec, size: (usize, usize)) -> Result<Self, String> {
        let mut ctx = Box::<vpx::vpx_codec_ctx_t>::default();
        let cfg = vpx::vpx_codec_dec_cfg_t { threads: 1, w: 0, h: 0 };
        // SAFETY: `ctx` is zeroed and boxed (a stable address); the interface is libvpx's own.
        let rc = unsafe {
            let iface = match codec {
                Codec::Vp8 => vpx::vpx_codec_vp8_dx(),
                Codec::Vp9 => vpx::vpx_codec_vp9_dx(),
            };
            vpx::vpx_codec_dec_init_ver(&mut *ctx, iface, &cfg, 0, vpx::VPX_DECODER_ABI_VERSION as c_int)
        };
        if rc != vpx::VPX_CODEC_OK {
            // A failed init has already torn itself down: nothing to destroy.
            return Err(format!("libvpx refused to start ({rc:?}); is the system libvpx the version k3 was built against?"));
        }
        let mut d =
            VpxDecoder { ctx, buffers: Box::new(Buffers { limit: picture_buffer_limit(size.0, size.1), refused: None }), codec, size, iter: ptr::null() };
        if codec == Codec::Vp9 {
            let b: *mut Buffers = &mut *d.buffers;
            // SAFETY: the context is initialised and no frame has been decoded yet; `b` outlives it.
            let rc = unsafe { vpx::vpx_codec_set_frame_buffer_functions(&mut *d.ctx, Some(get_fb), Some(release_fb), b as *mut c_void) };
            if rc != vpx::VPX_CODEC_OK {
                return Err(d.error_text(rc));
            }
        }
        Ok(d)
    }

    fn error_text(&mut self, rc: vpx::vpx_codec_err_t) -> String {
        // SAFETY: the context is initialised; libvpx returns static or context-owned C strings.
        let (msg, detail) = unsafe {
            let m = vpx::vpx_codec_error(&mut *self.ctx);
            let d = vpx::vpx_codec_error_detail(&mut *self.ctx);
            let s = |p: *const std::os::raw::c_char| if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
            (s(m), s(d))
        };
        let msg = if msg.is_empty() { format!("{rc:?}") } else { msg };
        if detail.is_empty() {
            format!("libvpx: {msg}")
        } else {
            format!("libvpx: {msg} ({detail})")
        }
    }

    /// Decodes one container frame; its pictures come out of [`VpxDecoder::next_picture`].
    pub(crate) fn decode(&mut self, data: &[u8]) -> Result<(), String> {
        if self.codec == Codec::Vp8 {
            if let Some((w, h)) = vp8_key_frame_size(data) {
                if (w, h) != self.size {
                    return Err(format!("a VP8 key frame is {w}x{h}, the track header says {}x{}: frame sizes must not change", self.size.0, self.size.1));
                }
            }
        }
        self.send(data.as_ptr(), c_uint::try_from(data.len()).map_err(|_| "a frame of 4 GiB or more".to_string())?)
    }

    /// Ends the stream: pictures still held by the decoder come out next.
    pub(crate) fn flush(&mut self) -> Result<(), String> {
        self.send(ptr::null(), 0)
    }

    fn send(&mut self, data: *const u8, len: c_uint) -> Result<(), String> {
        self.buffers.refused = None;
        self.iter = ptr::null();
        // SAFETY: `data` is null (flush) or points to `len` readable bytes for this call.
        let rc = unsafe { vpx::vpx_codec_decode(&mut *self.ctx, data, len, ptr::null_mut(), 0) };
        if rc == vpx::VPX_CODEC_OK {
            return Ok(());
        }
        if let Some(n) = self.buffers.refused {
            return Err(format!(
                "a picture needs a {n}-byte buffer, more than a frame of the track's {}x{} can (at most {}): the stream's frames are larger than its header says",
                self.size.0, self.size.1, self.buffers.limit
            ));
        }
        Err(self.error_text(rc))
    }

    /// The next decoded picture of the last [`VpxDecoder::decode`] call, checked for a layout
    /// this module converts; valid until the next call on `self`.
    pub(crate) fn next_picture(&mut self) -> Result<Option<Picture<'_>>, String> {
        // SAFETY: the context is initialised; `iter` was reset by the last decode call.
        let img = unsafe { vpx::vpx_codec_get_frame(&mut *self.ctx, &mut self.iter) };
        if img.is_null() {
            return Ok(None);
        }
        // SAFETY: libvpx's image stays valid until the next decode call, which needs `&mut self`.
        // Enum-typed fields are read as integers, so an unlisted value is no undefined behaviour.
        let p = unsafe {
            Picture {
                fmt: ptr::addr_of!((*img).fmt).cast::<u32>().read(),
                cs: ptr::addr_of!((*img).cs).cast::<u32>().read(),
                full_range: ptr::addr_of!((*img).range).cast::<u32>().read() == 1,
                w: (*img).d_w as usize,
                h: (*img).d_h as usize,
                bit_depth: (*img).bit_depth,
                shift: ((*img).x_chroma_shift, (*img).y_chroma_shift),
                planes: [(*img).planes[0], (*img).planes[1], (*img).planes[2]],
                strides: [(*img).stride[0], (*img).stride[1], (*img).stride[2]],
                _life: PhantomData,
            }
        };
        p.check()?;
        Ok(Some(p))
    }
}

impl Drop for VpxDecoder {
    fn drop(&mut self) {
        // SAFETY: initialised in `new`; destroying releases the picture buffers through
        // `release_fb` while `self.buffers` is still alive (fields drop after this).
        unsafe {
            vpx::vpx_codec_destroy(&mut *self.ctx);
        }
    }
}

/// A decoded picture borrowed from its decoder.
pub(crate) struct Picture<'a> {
    fmt: u32,
    cs: u32,
    full_range: bool,
    w: usize,
    h: usize,
    bit_depth: c_uint,
    shift: (c_uint, c_uint),
    planes: [*mut u8; 3],
    strides: [c_int; 3],
    _life: PhantomData<&'a VpxDecoder>,
}

const HIGH_BIT_DEPTH: u32 = 0x800;

impl Picture<'_> {
    pub(crate) fn dimensions(&self) -> (usize, usize) {
        (self.w, self.h)
    }

    fn high(&self) -> bool {
        self.fmt & HIGH_BIT_DEPTH != 0
    }

    fn check(&self) -> Result<(), String> {
        // I420, I422, I444, I440 and YV12, each at 8 bits or (with the flag) 16.
        if ![0x102, 0x105, 0x106, 0x107, 0x301].contains(&(self.fmt & !HIGH_BIT_DEPTH)) {
            return Err(format!("libvpx produced a picture of format {:#x}, which this build does not convert", self.fmt));
        }
        let depth_ok = if self.high() { (8..=16).contains(&self.bit_depth) } else { self.bit_depth == 8 };
        if !depth_ok || self.shift.0 > 1 || self.shift.1 > 1 || self.w == 0 || self.h == 0 {
            return Err(format!("libvpx produced a picture of {} bits, chroma shifts {:?}, {}x{}", self.bit_depth, self.shift, self.w, self.h));
        }
        let bytes = if self.high() { 2 } else { 1 };
        for p in 0..3 {
            let sx = if p == 0 { 0 } else { self.shift.0 };
            let row = ((self.w + (1 << sx) - 1) >> sx) * bytes;
            if self.planes[p].is_null() || self.strides[p] <= 0 || (self.strides[p] as usize) < row {
                return Err(format!("libvpx produced a picture with an unusable plane {p} (stride {})", self.strides[p]));
            }
        }
        Ok(())
    }

    /// Sample `(x, y)` of plane `p` on the 8-bit scale.
    fn sample(&self, p: usize, x: usize, y: usize) -> f32 {
        let row = y * self.strides[p] as usize;
        // SAFETY: `check` verified the plane and stride; `x`, `y` lie inside the plane's size.
        unsafe {
            if self.high() {
                let v = self.planes[p].add(row + 2 * x).cast::<u16>().read_unaligned();
                v as f32 / (1u32 << (self.bit_depth - 8)) as f32
            } else {
                *self.planes[p].add(row + x) as f32
            }
        }
    }

    /// The picture as RGB bytes.
    pub(crate) fn to_decoded(&self) -> Decoded {
        // (Kr, Kb) of the matrix: BT.709, SMPTE 240M, BT.2020; BT.601 otherwise (also unknown).
        let (kr, kb) = match self.cs {
            2 => (0.2126f32, 0.0722f32),
            4 => (0.212, 0.087),
            5 => (0.2627, 0.0593),
            _ => (0.299, 0.114),
        };
        let srgb = self.cs == 7;
        let (sx, sy) = (self.shift.0 as usize, self.shift.1 as usize);
        let mut rgb = Vec::with_capacity(self.w * self.h * 3);
        for y in 0..self.h {
            for x in 0..self.w {
                let (l, u, v) = (self.sample(0, x, y), self.sample(1, x >> sx, y >> sy), self.sample(2, x >> sx, y >> sy));
                let px = if srgb {
                    [v, l, u]
                } else {
                    let (l, cb, cr) = if self.full_range {
                        (l, u - 128.0, v - 128.0)
                    } else {
                        ((l - 16.0) * (255.0 / 219.0), (u - 128.0) * (255.0 / 224.0), (v - 128.0) * (255.0 / 224.0))
                    };
                    let (r, b) = (l + 2.0 * (1.0 - kr) * cr, l + 2.0 * (1.0 - kb) * cb);
                    [r, (l - kr * r - kb * b) / (1.0 - kr - kb), b]
                };
                rgb.extend(px.map(|c| c.round().clamp(0.0, 255.0) as u8));
            }
        }
        Decoded { mode: Mode::Rgb, raster: Raster::new(self.w, self.h, 3, rgb) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vp8_key_frame_sizes_are_read_from_the_header() {
        let mut key = vec![0x10, 0x02, 0x00, 0x9d, 0x01, 0x2a, 48, 0, 32, 0x40];
        assert_eq!(vp8_key_frame_size(&key), Some((48, 32)), "the top 2 bits are the scale, not the size");
        key[0] |= 1;
        assert_eq!(vp8_key_frame_size(&key), None, "an inter frame");
        assert_eq!(vp8_key_frame_size(&key[..9]), None);
    }

    #[test]
    fn the_buffer_limit_covers_a_frame_of_the_declared_size_only() {
        // libvpx's 8-bit 4:2:0 picture of 1280×720 with its 32-pixel border: 1.58 MB.
        let need_720p = (1280 + 64) * (720 + 64) * 3 / 2;
        assert!(picture_buffer_limit(1280, 720) > 2 * need_720p);
        assert!(picture_buffer_limit(16, 16) < need_720p);
    }
}
