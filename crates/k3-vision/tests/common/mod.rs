//! Shared helpers for the vision golden tests: fixture paths, reference tensors, metrics.
#![allow(dead_code)]

use std::path::PathBuf;

use k3_model::checkpoint::{open_tensors_only, Checkpoint};

pub const TOL: f64 = 5e-5;

#[path = "../../../../tests/support/golden.rs"]
mod golden;
pub use golden::*;
#[path = "../../../../tests/support/numeric.rs"]
mod numeric;
/// Max over rows of ‖a_r − b_r‖₂ / ‖b_r‖₂ (the workspace's shared `tests/support/numeric.rs`).
pub use numeric::max_rel_l2;

/// `vision_small_f32`: in the full golden set only (`K3_GOLDEN_DIR`), not in `tests/golden/`.
pub fn vision_fixture() -> PathBuf {
    fixture("vision_small_f32")
}

pub const IMAGES: [&str; 3] = ["v0_rgba_resize.png", "v1_rgb_wide_resize.png", "v2_la_alpha.png"];

pub struct Reference(pub Checkpoint);

impl Reference {
    pub fn open() -> Reference {
        let p = vision_fixture().join("reference.safetensors");
        Reference(open_tensors_only(&p).unwrap_or_else(|e| panic!("opening {}: {e}", p.display())))
    }
    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let t = self.0.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        (t.shape().to_vec(), t.to_f32().unwrap().into_owned())
    }
    pub fn i64(&self, name: &str) -> Vec<i64> {
        self.0.tensor(name).unwrap().as_i64().unwrap().into_owned()
    }
    pub fn grid(&self, name: &str) -> [usize; 3] {
        let g = self.i64(name);
        [g[0] as usize, g[1] as usize, g[2] as usize]
    }
}

pub fn meta() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(vision_fixture().join("meta.json")).unwrap()).unwrap()
}

pub fn assert_close(what: &str, got: &[f32], want: &[f32], width: usize) -> f64 {
    let r = max_rel_l2(got, want, width);
    eprintln!("{what}: max per-row rel-L2 {r:.3e}");
    assert!(r <= TOL, "{what}: max per-row rel-L2 {r:.3e} > {TOL:.0e}");
    r
}
