//! `y = x Wᵀ` on the CPU for every weight format K3 ships, reading the weight in place.
//!
//! Shapes: `x` `[T, in]` f32 row-major, `W` `[out, in]` ([`Matrix`]), `y` `[T, out]` f32.
//! - F32 weights: one `gemm` call over the mapped bytes (or a GEMV for small `T`).
//! - BF16 / F16 / MXFP4 weights: rows are decoded to f32 in small per-thread tiles
//!   (`ROW_TILE` rows at a time, L2-resident) and multiplied there; nothing is expanded
//!   for the whole matrix. Small `T` (decode) takes a GEMV path that streams each row once.
//!
//! Accumulation is f32 throughout.

use half::{bf16, f16};
use rayon::prelude::*;

use super::mxfp4;
use crate::{CoreError, DType, Result, Tensor};

/// A 2-D weight `[rows = out, cols = in]` as stored in the checkpoint.
#[derive(Clone, Debug)]
pub enum Matrix {
    /// F32, BF16 or F16 bytes, row-major `[rows, cols]`.
    Dense(Tensor),
    /// MXFP4: `packed` U8 `[rows, cols/2]`, `scale` U8 `[rows, cols/32]`.
    Mxfp4 { packed: Tensor, scale: Tensor },
}

/// Up to this many token rows use the GEMV path (weights streamed once, dot per token).
const GEMV_MAX_T: usize = 4;
/// Weight rows decoded per tile on the GEMM path.
const ROW_TILE: usize = 256;

impl Matrix {
    /// Wraps a dense 2-D tensor; checks the dtype.
    pub fn dense(t: Tensor) -> Result<Self> {
        if t.shape().len() != 2 || !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
            return Err(CoreError::Shape { op: "Matrix::dense", detail: format!("need a 2-D F32/BF16/F16 tensor, got {t:?}") });
        }
        Ok(Matrix::Dense(t))
    }

    /// Wraps an MXFP4 pair; checks shapes and that no scale byte is 255.
    pub fn mxfp4(packed: Tensor, scale: Tensor) -> Result<Self> {
        let m = Self::mxfp4_unscanned(packed, scale)?;
        if let Matrix::Mxfp4 { scale, .. } = &m {
            mxfp4::check_scales(scale.as_u8()?)?;
        }
        Ok(m)
    }

    /// [`Matrix::mxfp4`] without reading the scale bytes (shapes and dtypes still checked): for
    /// a holder that never computes with the matrix, or whose own loader checks the scales (the
    /// GPU upload), so a memory-mapped checkpoint's scales are not paged in twice.
    pub fn mxfp4_unscanned(packed: Tensor, scale: Tensor) -> Result<Self> {
        let (ps, ss) = (packed.shape(), scale.shape());
        let ok = packed.dtype() == DType::U8 && scale.dtype() == DType::U8 && ps.len() == 2 && ss.len() == 2 && ps[0] == ss[0] && ps[1] * 2 == ss[1] * 32;
        if !ok {
            return Err(CoreError::Shape { op: "Matrix::mxfp4", detail: format!("weight_packed {packed:?} and weight_scale {scale:?} do not describe one [out, in] MXFP4 matrix (packed [out, in/2], scale [out, in/32], both U8)") });
        }
        Ok(Matrix::Mxfp4 { packed, scale })
    }

    pub fn rows(&self) -> usize {
        match self {
            Matrix::Dense(t) => t.shape()[0],
            Matrix::Mxfp4 { packed, .. } => packed.shape()[0],
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            Matrix::Dense(t) => t.shape()[1],
            Matrix::Mxfp4 { packed, .. } => packed.shape()[1] * 2,
        }
    }
    /// Bytes of weight data (what one full pass over the matrix reads).
    pub fn bytes(&self) -> usize {
        match self {
            Matrix::Dense(t) => t.bytes().len(),
            Matrix::Mxfp4 { packed, scale } => packed.bytes().len() + scale.bytes().len(),
        }
    }
    /// Storage format name: `F32`, `BF16`, `F16` or `MXFP4`.
    pub fn format(&self) -> &'static str {
        match self {
            Matrix::Dense(t) => t.dtype().safetensors_name(),
            Matrix::Mxfp4 { .. } => "MXFP4",
        }
    }

    /// Decodes rows `[r0, r0 + n)` to f32 into `out` (`n * cols` values).
    pub fn decode_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        let c = self.cols();
        match self {
            Matrix::Dense(t) => {
                let b = &t.bytes()[r0 * c * t.dtype().size_in_bytes()..(r0 + n) * c * t.dtype().size_in_bytes()];
                match (t.dtype(), bytemuck::try_cast_slice::<u8, u16>(b)) {
                    // bf16 → f32 is a 16-bit shift; on aligned data this loop vectorises.
                    (DType::BF16, Ok(w)) => bf16_to_f32(w, &mut out[..n * c]),
                    (DType::F32, _) => out[..n * c].iter_mut().zip(b.chunks_exact(4)).for_each(|(o, x)| *o = f32::from_le_bytes([x[0], x[1], x[2], x[3]])),
                    (DType::BF16, Err(_)) => {
                        out[..n * c].iter_mut().zip(b.chunks_exact(2)).for_each(|(o, x)| *o = bf16::from_bits(u16::from_le_bytes([x[0], x[1]])).to_f32())
                    }
                    _ => out[..n * c].iter_mut().zip(b.chunks_exact(2)).for_each(|(o, x)| *o = f16::from_bits(u16::from_le_bytes([x[0], x[1]])).to_f32()),
                }
            }
            Matrix::Mxfp4 { packed, scale } => {
                let (p, s) = (packed.bytes(), scale.bytes());
                for r in 0..n {
                    let rr = r0 + r;
                    mxfp4::decode_row_fast(&p[rr * c / 2..(rr + 1) * c / 2], &s[rr * c / 32..(rr + 1) * c / 32], &mut out[r * c..(r + 1) * c]);
                }
            }
        }
    }

    /// The whole matrix as f32, bit-exact (MXFP4 nibble 8 gives −0.0); tests and reference
    /// paths only. Compute paths decode tiles with [`Matrix::decode_rows`], which may give +0.0.
    pub fn to_f32(&self) -> Vec<f32> {
        let (r, c) = (self.rows(), self.cols());
        let mut v = vec![0f32; r * c];
        match self {
            Matrix::Mxfp4 { packed, scale } => {
                let (p, s) = (packed.bytes(), scale.bytes());
                for i in 0..r {
                    mxfp4::decode_row(&p[i * c / 2..(i + 1) * c / 2], &s[i * c / 32..(i + 1) * c / 32], &mut v[i * c..(i + 1) * c]);
                }
            }
            Matrix::Dense(_) => self.decode_rows(0, r, &mut v),
        }
        v
    }
}

/// Dot product of two f32 slices (AVX2 + FMA when the CPU has them, chosen at run time).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::has_avx2_fma() {
            // SAFETY: the features were detected at run time.
            return unsafe { simd::dot_avx2(a, b) };
        }
    }
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

/// Dot product of f32 `a` with bf16 bits `b` (converted in registers).
#[inline]
pub fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::has_avx2_fma() {
            // SAFETY: the features were detected at run time.
            return unsafe { simd::dot_bf16_avx2(a, b) };
        }
    }
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * f32::from_bits((y[i] as u32) << 16);
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, &y)| x * f32::from_bits((y as u32) << 16)).sum::<f32>()
}

/// bf16 bits → f32.
#[inline]
pub fn bf16_to_f32(w: &[u16], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::has_avx2_fma() {
            // SAFETY: the features were detected at run time.
            return unsafe { simd::bf16_to_f32_avx2(w, out) };
        }
    }
    for (o, &x) in out.iter_mut().zip(w) {
        *o = f32::from_bits((x as u32) << 16);
    }
}

/// Run-time-dispatched AVX2 + FMA variants of the hot loops (same results up to rounding).
#[cfg(target_arch = "x86_64")]
mod simd {
    pub(crate) use super::super::has_avx2_fma;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 32];
        let (ca, cb) = (a.chunks_exact(32), b.chunks_exact(32));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for i in 0..32 {
                acc[i] = x[i].mul_add(y[i], acc[i]);
            }
        }
        acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_bf16_avx2(a: &[f32], b: &[u16]) -> f32 {
        let mut acc = [0f32; 32];
        let (ca, cb) = (a.chunks_exact(32), b.chunks_exact(32));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (x, y) in ca.zip(cb) {
            for i in 0..32 {
                acc[i] = x[i].mul_add(f32::from_bits((y[i] as u32) << 16), acc[i]);
            }
        }
        acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, &y)| x * f32::from_bits((y as u32) << 16)).sum::<f32>()
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn bf16_to_f32_avx2(w: &[u16], out: &mut [f32]) {
        for (o, &x) in out.iter_mut().zip(w) {
            *o = f32::from_bits((x as u32) << 16);
        }
    }
}

thread_local! {
    /// Decoded weight tile of the GEMM path, one per worker thread.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Raw pointer that may be shared across rayon tasks writing disjoint elements.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `out[T, out] = x[T, in] · Wᵀ`. Errors on inconsistent shapes.
pub fn linear(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) -> Result<()> {
    let (n, k) = (w.rows(), w.cols());
    if x.len() != t * k || out.len() != t * n {
        return Err(CoreError::Shape { op: "linear", detail: format!("x has {} values for T={t} × in={k}; out has {} for T × out={n}", x.len(), out.len()) });
    }
    if t == 0 || n == 0 {
        return Ok(());
    }
    if row_exact() {
        return gemv_row_exact(x, t, w, out);
    }
    if t <= GEMV_MAX_T {
        return gemv(x, t, w, out);
    }
    if let Matrix::Dense(wt) = w {
        if wt.dtype() == DType::F32 {
            if let Ok(ws) = wt.as_f32() {
                // SAFETY: shapes checked above; strides describe x [t,k], Wᵀ [k,n], out [t,n].
                unsafe { gemm_f32(t, n, k, x, &ws, out.as_mut_ptr(), n, gemm::Parallelism::Rayon(0)) };
                return Ok(());
            }
        }
    }
    let dst = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(ROW_TILE)).into_par_iter().for_each(|b| {
        let r0 = b * ROW_TILE;
        let nr = ROW_TILE.min(n - r0);
        // A per-thread tile buffer, reused across calls (no page zeroing per task).
        TILE.with(|cell| {
            let mut tile = cell.borrow_mut();
            if tile.len() < nr * k {
                tile.resize(nr * k, 0.0);
            }
            w.decode_rows(r0, nr, &mut tile[..nr * k]);
            let d = dst;
            // SAFETY: each task writes only columns [r0, r0+nr) of out.
            unsafe { gemm_f32(t, nr, k, x, &tile[..nr * k], d.0.add(r0), n, gemm::Parallelism::None) };
        });
    });
    Ok(())
}

thread_local! {
    /// Row-exact mode of this thread (see [`with_row_exact`]).
    static ROW_EXACT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether [`linear`] on this thread computes every row exactly as a one-row call would.
pub fn row_exact() -> bool {
    ROW_EXACT.with(|c| c.get())
}

/// Runs `f` with row-exact mode `on` on this thread (restored afterwards, also on a panic).
/// In row-exact mode every output row of [`linear`] is bit-identical to what a call with that
/// row alone (`T = 1`, the decode GEMV) gives, whatever `T` is: the per-row dot products of
/// the decode path, the weight read once per block of rows for all of them. Speculative
/// verification (`k3-engine`'s `spec`) runs in it, so verifying k drafts gives the logits of k
/// single decode steps. Work handed to other threads (rayon) must carry the flag itself.
pub fn with_row_exact<R>(on: bool, f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ROW_EXACT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(ROW_EXACT.with(|c| c.replace(on)));
    f()
}

/// One token row `x` against MXFP4 rows `lo..hi`: `dst[r] = W[r] · x` — the decode GEMV's
/// inner loop (two rows at a time sharing the loads of x, the rest one by one).
///
/// # Safety
/// `dst` must be valid for writes at `lo..hi`, written by no one else meanwhile.
unsafe fn mxfp4_rows_one(p: &[u8], sc: &[u8], k: usize, lo: usize, hi: usize, x: &[f32], dst: *mut f32) {
    let row = |r: usize| (&p[r * k / 2..(r + 1) * k / 2], &sc[r * k / 32..(r + 1) * k / 32]);
    let mut r = lo;
    while r + 1 < hi {
        let ((p0, s0), (p1, s1)) = (row(r), row(r + 1));
        let Some(v) = mxfp4::dot_rows2(p0, s0, p1, s1, x) else { break };
        *dst.add(r) = v[0];
        *dst.add(r + 1) = v[1];
        r += 2;
    }
    let mut o = [0f32; 1];
    for r in r..hi {
        mxfp4::dot_row(row(r).0, row(r).1, &[x], &mut o);
        *dst.add(r) = o[0];
    }
}

/// [`linear`] in row-exact mode: F32/BF16/F16 through the GEMV (its rows are independent for
/// any `T`); MXFP4 block by block, each token row through [`mxfp4_rows_one`] as at `T = 1`.
fn gemv_row_exact(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) -> Result<()> {
    let Matrix::Mxfp4 { packed, scale } = w else {
        return gemv(x, t, w, out);
    };
    const RB: usize = 16;
    let (n, k) = (w.rows(), w.cols());
    let (p, sc) = (packed.bytes(), scale.bytes());
    let dst = SendPtr(out.as_mut_ptr());
    (0..n.div_ceil(RB)).into_par_iter().for_each(|b| {
        let d = dst;
        let (lo, hi) = (b * RB, ((b + 1) * RB).min(n));
        for i in 0..t {
            // SAFETY: row i's elements lo..hi are written by exactly this task.
            unsafe { mxfp4_rows_one(p, sc, k, lo, hi, &x[i * k..(i + 1) * k], d.0.add(i * n)) };
        }
    });
    Ok(())
}

/// `dst[i*ld + j] = Σ_k x[i*k + kk] · w[j*k + kk]` for i < m, j < n.
unsafe fn gemm_f32(m: usize, n: usize, k: usize, x: &[f32], w: &[f32], dst: *mut f32, ld: usize, par: gemm::Parallelism) {
    gemm::gemm(m, n, k, dst, 1, ld as isize, false, x.as_ptr(), 1, k as isize, w.as_ptr(), k as isize, 1, 0.0f32, 1.0f32, false, false, false, par);
}

fn gemv(x: &[f32], t: usize, w: &Matrix, out: &mut [f32]) -> Result<()> {
    let (n, k) = (w.rows(), w.cols());
    const RB: usize = 16;
    let dst = SendPtr(out.as_mut_ptr());
    let f32_rows = match w {
        Matrix::Dense(wt) if wt.dtype() == DType::F32 => wt.as_f32().ok(),
        _ => None,
    };
    // bf16 rows read in place, converted inside the dot product (no row buffer).
    let bf16_rows: Option<&[u16]> = match w {
        Matrix::Dense(wt) if wt.dtype() == DType::BF16 => bytemuck::try_cast_slice::<u8, u16>(wt.bytes()).ok(),
        _ => None,
    };
    if let Matrix::Mxfp4 { packed, scale } = w {
        let (p, sc) = (packed.bytes(), scale.bytes());
        let xs: Vec<&[f32]> = (0..t).map(|i| &x[i * k..(i + 1) * k]).collect();
        (0..n.div_ceil(RB)).into_par_iter().for_each(|b| {
            let d = dst;
            let mut o = [0f32; GEMV_MAX_T];
            let (lo, hi) = (b * RB, ((b + 1) * RB).min(n));
            let row = |r: usize| (&p[r * k / 2..(r + 1) * k / 2], &sc[r * k / 32..(r + 1) * k / 32]);
            if t == 1 {
                // SAFETY: row 0's elements lo..hi are written by exactly this task.
                unsafe { mxfp4_rows_one(p, sc, k, lo, hi, xs[0], d.0) };
                return;
            }
            for r in lo..hi {
                mxfp4::dot_row(row(r).0, row(r).1, &xs, &mut o[..t]);
                for (i, &v) in o[..t].iter().enumerate() {
                    // SAFETY: element (i, r) is written by exactly this task.
                    unsafe { *d.0.add(i * n + r) = v };
                }
            }
        });
        return Ok(());
    }
    if let Some(wb) = bf16_rows {
        (0..n.div_ceil(RB)).into_par_iter().for_each(|b| {
            let d = dst;
            for r in b * RB..((b + 1) * RB).min(n) {
                let wr = &wb[r * k..(r + 1) * k];
                for i in 0..t {
                    // SAFETY: element (i, r) is written by exactly this task.
                    unsafe { *d.0.add(i * n + r) = dot_bf16(&x[i * k..(i + 1) * k], wr) };
                }
            }
        });
        return Ok(());
    }
    (0..n.div_ceil(RB)).into_par_iter().for_each_init(
        || vec![0f32; k],
        |row, b| {
            let d = dst;
            for r in b * RB..((b + 1) * RB).min(n) {
                let wr: &[f32] = match &f32_rows {
                    Some(ws) => &ws[r * k..(r + 1) * k],
                    None => {
                        w.decode_rows(r, 1, row);
                        row
                    }
                };
                for i in 0..t {
                    // SAFETY: element (i, r) is written by exactly this task.
                    unsafe { *d.0.add(i * n + r) = dot(&x[i * k..(i + 1) * k], wr) };
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn naive(x: &[f32], t: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut o = vec![0f32; t * n];
        for i in 0..t {
            for j in 0..n {
                o[i * n + j] = (0..k).map(|kk| x[i * k + kk] as f64 * w[j * k + kk] as f64).sum::<f64>() as f32;
            }
        }
        o
    }

    fn check(w: &Matrix, t: usize, seed: u64) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (n, k) = (w.rows(), w.cols());
        let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut y = vec![0f32; t * n];
        linear(&x, t, w, &mut y).unwrap();
        let r = naive(&x, t, &w.to_f32(), n, k);
        for (a, b) in y.iter().zip(&r) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b} (T={t}, {})", w.format());
        }
    }

    /// A random 67×96 weight matrix in every format (F32, BF16, F16, MXFP4), from `seed`.
    fn every_format(seed: u64) -> [Matrix; 4] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (n, k) = (67, 96);
        let wf: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let wh: Vec<f16> = wf.iter().map(|&v| f16::from_f32(v)).collect();
        let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.random()).collect();
        let scale: Vec<u8> = (0..n * k / 32).map(|_| rng.random_range(110..135)).collect();
        [
            Matrix::dense(Tensor::from_f32(vec![n, k], &wf).unwrap()).unwrap(),
            Matrix::dense(Tensor::from_bf16(vec![n, k], &wb).unwrap()).unwrap(),
            Matrix::dense(Tensor::from_bytes(DType::F16, vec![n, k], bytemuck::cast_slice(&wh)).unwrap()).unwrap(),
            Matrix::mxfp4(Tensor::from_bytes(DType::U8, vec![n, k / 2], &packed).unwrap(), Tensor::from_bytes(DType::U8, vec![n, k / 32], &scale).unwrap())
                .unwrap(),
        ]
    }

    #[test]
    fn all_formats_all_paths() {
        let mats = every_format(7);
        for w in &mats {
            for t in [1, 3, 5, 70, 130] {
                check(w, t, t as u64);
            }
        }
    }

    /// Row-exact mode: every row of a T-row call is bit-identical to that row alone (T = 1),
    /// for every format and for T on both sides of the GEMV/GEMM switch; outside the mode a
    /// many-row call is allowed to differ (it takes the GEMM), which is why the mode exists.
    #[test]
    fn row_exact_rows_equal_single_rows() {
        let mats = every_format(9);
        let (n, k) = (67, 96);
        let mut rng = rand::rngs::StdRng::seed_from_u64(10);
        for w in &mats {
            for t in [2, 4, 5, 9, 33] {
                let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let mut y = vec![0f32; t * n];
                with_row_exact(true, || linear(&x, t, w, &mut y)).unwrap();
                assert!(!row_exact(), "the mode is restored");
                for i in 0..t {
                    let mut one = vec![0f32; n];
                    linear(&x[i * k..(i + 1) * k], 1, w, &mut one).unwrap();
                    let same = one.iter().zip(&y[i * n..(i + 1) * n]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "row {i} of T={t} ({}) differs from the row alone", w.format());
                }
            }
        }
    }

    /// MXFP4 GEMV/GEMM over every scale exponent 0..=254 (incl. the subnormal 2^-127) equals
    /// dequantise-then-multiply (up to the exponents where the f32 sum itself overflows).
    #[test]
    fn mxfp4_every_scale_exponent() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (n, k) = (255, 64); // one row per exponent, two groups per row
        let packed: Vec<u8> = (0..n * k / 2).map(|_| rng.random()).collect();
        let scale: Vec<u8> = (0..n * k / 32).map(|i| (i / 2) as u8).collect();
        let w = Matrix::mxfp4(Tensor::from_bytes(DType::U8, vec![n, k / 2], &packed).unwrap(), Tensor::from_bytes(DType::U8, vec![n, k / 32], &scale).unwrap())
            .unwrap();
        let wf = w.to_f32();
        for t in [1, 2, 9] {
            let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut y = vec![0f32; t * n];
            linear(&x, t, &w, &mut y).unwrap();
            for i in 0..t {
                for r in 0..n {
                    let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * wf[r * k + c] as f64).sum();
                    // f32 accumulation error is bounded relative to Σ|x·w| (terms may cancel).
                    let mag: f64 = (0..k).map(|c| (x[i * k + c] as f64 * wf[r * k + c] as f64).abs()).sum();
                    let got = y[i * n + r] as f64;
                    if mag > 1e37 {
                        continue; // near the top exponents the f32 sum itself overflows
                    }
                    assert!((got - want).abs() <= 1e-6 * mag + 1e-44, "T={t} row {r} (scale byte {r}): {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn shape_errors() {
        let w = Matrix::dense(Tensor::from_f32(vec![2, 3], &[0.0; 6]).unwrap()).unwrap();
        let mut o = vec![0.0; 2];
        assert!(linear(&[0.0; 4], 1, &w, &mut o).unwrap_err().to_string().contains("linear"));
        let p = Tensor::from_bytes(DType::U8, vec![2, 16], &[0; 32]).unwrap();
        let s = Tensor::from_bytes(DType::U8, vec![2, 1], &[127, 255]).unwrap();
        assert!(Matrix::mxfp4(p.clone(), s.clone()).unwrap_err().to_string().contains("255"));
        // Unscanned: the scale bytes are left to the caller, the shapes are still checked.
        assert!(Matrix::mxfp4_unscanned(p.clone(), s).is_ok());
        let bad = Tensor::from_bytes(DType::U8, vec![2, 2], &[127; 4]).unwrap();
        assert!(Matrix::mxfp4_unscanned(p, bad).unwrap_err().to_string().contains("MXFP4"));
    }
}
