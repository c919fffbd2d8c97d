//! Shared helpers for the model tests: the golden fixtures (found by the workspace's shared
//! `tests/support/golden.rs`: `tests/golden/` or `$K3_GOLDEN_DIR`) and comparing logits at
//! the manifest's metrics (max_abs, per-position relative L2, top-1 agreement), with the
//! workspace's shared `tests/support/numeric.rs` (relative L2, max_abs).
#![allow(dead_code)]

use k3_model::Checkpoint;

#[path = "../../../../tests/support/golden.rs"]
mod golden;
pub use golden::*;
#[path = "../../../../tests/support/numeric.rs"]
mod numeric;
pub use numeric::*;

/// The reference file of a fixture (tokens_L*, logits_L*, decode_logits_L160).
pub fn reference(name: &str) -> Checkpoint {
    // Reuse the safetensors mapping of Checkpoint via a tiny directory view.
    RefFile::open(&fixture(name).join("reference.safetensors"))
}

pub struct RefFile;
impl RefFile {
    fn open(p: &std::path::Path) -> Checkpoint {
        k3_model::checkpoint::open_tensors_only(p).expect("reference.safetensors")
    }
}

pub fn tokens(r: &Checkpoint, l: usize) -> Vec<u32> {
    r.tensor(&format!("tokens_L{l}")).unwrap().as_i64().unwrap().iter().map(|&x| x as u32).collect()
}

pub fn ref_f32(r: &Checkpoint, name: &str) -> Vec<f32> {
    r.tensor(name).unwrap().as_f32().unwrap().into_owned()
}

#[derive(Debug)]
pub struct Cmp {
    pub max_abs: f32,
    pub max_rel_l2: f32,
    pub top1: f32,
}

pub fn compare(got: &[f32], want: &[f32], vocab: usize) -> Cmp {
    assert_eq!(got.len(), want.len());
    let mut c = Cmp { max_abs: 0.0, max_rel_l2: 0.0, top1: 0.0 };
    let rows = want.len() / vocab;
    let mut agree = 0;
    for (g, w) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)) {
        c.max_abs = c.max_abs.max(max_abs(g, w));
        c.max_rel_l2 = c.max_rel_l2.max(rel_l2(g, w) as f32);
        let am = |x: &[f32]| x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0;
        agree += usize::from(am(g) == am(w));
    }
    c.top1 = agree as f32 / rows as f32;
    c
}

/// The manifest tolerances for f32 engines.
pub fn assert_within(c: &Cmp, what: &str) {
    assert!(c.max_abs <= 1e-3 && c.max_rel_l2 <= 3e-4 && c.top1 >= 0.995, "{what}: {c:?} exceeds max_abs 1e-3 / rel_l2 3e-4 / top1 0.995");
}
