//! How the tests compare numbers — one file shared by every crate's tests (each includes it
//! with `#[path = ".../tests/support/numeric.rs"] mod numeric;`, or through its `common` module).
//!
//! Relative L2 error `‖got − want‖₂ / ‖want‖₂` in f64 (the absolute L2 norm where `want` is all
//! zeros), over a whole buffer or per row, and the largest absolute difference. A non-finite
//! value in `got` panics, naming the element: it could never pass a tolerance, and for an output
//! poisoned with NaN before the kernel ran it means the element was never written.
#![allow(dead_code)]

/// `‖got − want‖₂ / ‖want‖₂` (or `‖got‖₂` when `want` is all zeros), in f64.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("non-finite value at element {i} of {} (unwritten or invalid output)", got.len());
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w as f64).powi(2);
        den += (w as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// [`rel_l2`] of each `width`-wide row.
pub fn row_rel_l2(got: &[f32], want: &[f32], width: usize) -> Vec<f64> {
    assert_eq!(got.len(), want.len(), "length mismatch");
    assert!(width > 0 && got.len().is_multiple_of(width), "{} values are not rows of {width}", got.len());
    got.chunks_exact(width).zip(want.chunks_exact(width)).map(|(g, w)| rel_l2(g, w)).collect()
}

/// The largest [`rel_l2`] over the `width`-wide rows.
pub fn max_rel_l2(got: &[f32], want: &[f32], width: usize) -> f64 {
    row_rel_l2(got, want, width).into_iter().fold(0.0, f64::max)
}

/// `max |got − want|` over the elements.
pub fn max_abs(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    got.iter().zip(want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}
