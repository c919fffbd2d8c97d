//! Token sampling on the device (kernels in `kernels/cuda/sample.cu`; the CPU oracle is
//! k3-engine's `sampler.rs`, whose order and semantics the kernels follow): penalties, the
//! grammar mask, greedy or temperature / top-k / top-p / min-p and the draw, the token's raw
//! logprob and the top-n raw logprobs — one row of logits per thread block, so only
//! [`SampleOut`]s (168 bytes a row) come back to the host, through page-locked memory.
//!
//! Shape legend: logits F32 `[B, V]` on the device; `rows` one [`SampleRow`] per logits row;
//! `pens` pairs `(token, count in the output)` (each row's slice `pen_off..pen_off + pen_len`,
//! one pair per distinct token of prompt + output) and `(token, f32 bits of its logit bias)`
//! (each row's slice `bias_off..bias_off + bias_len`); `masks` the rows' allowed-id bit words
//! (bit `t % 32` of word `t / 32`, a row's words from `mask_off`, `mask_off = -1` for none).
//! The uniform draw `u` of each row comes from the host's seeded generator, so a request's
//! seed gives the same tokens on the GPU as on the CPU up to float rounding at a boundary.

use super::pinned::Pinned;
use super::{kargs, CudaDevice, CudaTensor};
use crate::kernels::cuda::SAMPLE;
use crate::{CoreError, DType, Result};

/// The most top logprobs a row can ask for.
pub const MAX_LOGPROBS: usize = 20;

/// One row's sampling parameters (the kernel's `SampleRow`, 64 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleRow {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: i32,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// The uniform draw in [0, 1) (unused when greedy).
    pub u: f32,
    /// Top logprobs to report (0..=20).
    pub n_logprobs: i32,
    /// This row's penalty pairs in `pens`: from pair `pen_off`, `pen_len` of them.
    pub pen_off: i32,
    pub pen_len: i32,
    /// This row's mask words in `masks` from `mask_off` (−1: no mask), `mask_words` of them.
    pub mask_off: i32,
    pub mask_words: i32,
    /// This row's logit-bias pairs in `pens`, `(token, f32 bits of the bias)`: from pair
    /// `bias_off`, `bias_len` of them (added after the penalties).
    pub bias_off: i32,
    pub bias_len: i32,
    pub pad: i32,
}

impl Default for SampleRow {
    fn default() -> Self {
        SampleRow {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            u: 0.0,
            n_logprobs: 0,
            pen_off: 0,
            pen_len: 0,
            mask_off: -1,
            mask_words: 0,
            bias_off: 0,
            bias_len: 0,
            pad: 0,
        }
    }
}

/// One row's result (the kernel's `SampleOut`, 168 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleOut {
    pub token: i32,
    /// log p(token) under the raw logits.
    pub logprob: f32,
    /// The best `n_logprobs` ids by raw logit (−1 past the end), best first.
    pub top_ids: [i32; MAX_LOGPROBS],
    pub top_lps: [f32; MAX_LOGPROBS],
}

/// The device sampler: scratch on the device and a page-locked landing area, reused per step.
pub struct Sampler {
    dev: CudaDevice,
    pinned: Option<Pinned>,
}

impl Sampler {
    pub fn new(dev: &CudaDevice) -> Self {
        Sampler { dev: dev.clone(), pinned: None }
    }

    /// Samples one token for every row of `logits` (F32 `[B, V]`, this device) as `rows` say;
    /// enqueued after the work that wrote the logits, then waits for the results.
    pub fn sample(&mut self, logits: &CudaTensor, rows: &[SampleRow], pens: &[u32], masks: &[u32]) -> Result<Vec<SampleOut>> {
        const OP: &str = "cuda sample";
        let dev = self.dev.clone();
        if logits.dtype() != DType::F32 || logits.shape().len() != 2 || !logits.cuda_device().same(&dev) {
            return Err(CoreError::Shape { op: OP, detail: format!("logits {logits:?} must be F32 [B, V] on device {}", dev.ordinal()) });
        }
        let (b, v) = (logits.shape()[0], logits.shape()[1]);
        if rows.len() != b {
            return Err(CoreError::Shape { op: OP, detail: format!("{} sampling rows for {b} rows of logits", rows.len()) });
        }
        if b == 0 {
            return Ok(Vec::new());
        }
        check_rows(rows, pens.len() / 2, masks.len()).map_err(|detail| CoreError::Shape { op: OP, detail })?;
        let v32 = i32::try_from(v).map_err(|_| CoreError::Shape { op: OP, detail: format!("vocabulary {v} exceeds i32") })?;
        let b32 = u32::try_from(b).map_err(|_| CoreError::Shape { op: OP, detail: format!("{b} rows") })?;
        let work = CudaTensor::uninit(&dev, DType::F32, vec![b, v])?;
        let rows_d = CudaTensor::from_pod(&dev, DType::U8, vec![std::mem::size_of_val(rows)], rows)?;
        let pens_d = CudaTensor::from_pod(&dev, DType::U8, vec![4 * pens.len().max(1)], nonempty(pens))?;
        let masks_d = CudaTensor::from_pod(&dev, DType::U8, vec![4 * masks.len().max(1)], nonempty(masks))?;
        let out = CudaTensor::uninit(&dev, DType::U8, vec![b * std::mem::size_of::<SampleOut>()])?;
        let (lp, wp, rp, pp, mp, op) = (logits.ptr(), work.ptr(), rows_d.ptr(), pens_d.ptr(), masks_d.ptr(), out.ptr());
        let gx = v.div_ceil(256 * 8).clamp(1, 64) as u32;
        dev.launch(SAMPLE, "sample_prep", (gx, b32, 1), (256, 1, 1), 0, &mut kargs![lp, wp, rp, mp, v32])?;
        if !pens.is_empty() {
            dev.launch(SAMPLE, "sample_penalize", (b32, 1, 1), (256, 1, 1), 0, &mut kargs![wp, rp, pp, v32])?;
        }
        dev.launch(SAMPLE, "sample_rows", (b32, 1, 1), (1024, 1, 1), 0, &mut kargs![lp, wp, rp, op, v32])?;
        let bytes = out.byte_len();
        let pinned = self.landing(bytes)?;
        pinned.download(0, &out)?;
        dev.synchronize()?;
        Ok(bytemuck::pod_collect_to_vec::<u8, SampleOut>(pinned.bytes(0, bytes)?))
    }

    /// The page-locked landing area, grown to at least `bytes`.
    fn landing(&mut self, bytes: usize) -> Result<&mut Pinned> {
        if self.pinned.as_ref().is_none_or(|p| p.len() < bytes) {
            self.pinned = None;
            self.pinned = Some(Pinned::new(&self.dev, bytes.next_power_of_two())?);
        }
        self.pinned.as_mut().ok_or_else(|| CoreError::Device("no landing area".into()))
    }
}

/// At least one element (a kernel argument must point at an allocation).
fn nonempty(x: &[u32]) -> &[u32] {
    if x.is_empty() {
        &[0]
    } else {
        x
    }
}

/// Every row's slices lie inside `pens` (pairs) and `masks` (words); parameters in range.
pub fn check_rows(rows: &[SampleRow], pairs: usize, words: usize) -> std::result::Result<(), String> {
    for (i, r) in rows.iter().enumerate() {
        let pen_end = (r.pen_off as i64) + (r.pen_len as i64);
        if r.pen_off < 0 || r.pen_len < 0 || pen_end > pairs as i64 {
            return Err(format!("row {i}: penalty pairs {}..{pen_end} outside the {pairs} given", r.pen_off));
        }
        let bias_end = (r.bias_off as i64) + (r.bias_len as i64);
        if r.bias_off < 0 || r.bias_len < 0 || bias_end > pairs as i64 {
            return Err(format!("row {i}: logit-bias pairs {}..{bias_end} outside the {pairs} given", r.bias_off));
        }
        if r.mask_off >= 0 && (r.mask_words < 0 || r.mask_off as i64 + r.mask_words as i64 > words as i64) {
            return Err(format!("row {i}: mask words {}..{} outside the {words} given", r.mask_off, r.mask_off as i64 + r.mask_words as i64));
        }
        if !(0..=MAX_LOGPROBS as i32).contains(&r.n_logprobs) {
            return Err(format!("row {i}: {} top logprobs (at most {MAX_LOGPROBS})", r.n_logprobs));
        }
        if !(r.temperature >= 0.0
            && r.temperature.is_finite()
            && r.top_p > 0.0
            && r.top_p <= 1.0
            && (0.0..=1.0).contains(&r.min_p)
            && (0.0..1.0).contains(&r.u))
        {
            return Err(format!("row {i}: temperature {} top_p {} min_p {} u {} out of range", r.temperature, r.top_p, r.min_p, r.u));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_kernel() {
        assert_eq!(std::mem::size_of::<SampleRow>(), 64);
        assert_eq!(std::mem::size_of::<SampleOut>(), 168);
    }

    #[test]
    fn row_slices_are_checked() {
        let ok = SampleRow { pen_off: 1, pen_len: 2, mask_off: 0, mask_words: 4, ..Default::default() };
        assert!(check_rows(&[ok], 3, 4).is_ok());
        assert!(check_rows(&[ok], 2, 4).unwrap_err().contains("penalty pairs 1..3"));
        assert!(check_rows(&[ok], 3, 3).unwrap_err().contains("mask words 0..4"));
        let bad = SampleRow { n_logprobs: 21, ..Default::default() };
        assert!(check_rows(&[bad], 0, 0).unwrap_err().contains("21 top logprobs"));
        let bad = SampleRow { u: 1.0, temperature: 1.0, ..Default::default() };
        assert!(check_rows(&[bad], 0, 0).is_err());
    }
}
