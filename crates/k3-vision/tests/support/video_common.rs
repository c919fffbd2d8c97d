//! Helpers of the video tests (`video.rs`, `webm.rs`, `cuda_vision.rs`; included with `#[path]`): the tiny tower
//! and processor config, the mean red byte of a chunk's frame, a watchdog, and seeded mutations
//! of a clip.
#![allow(dead_code)]

use k3_core::Tensor;
use k3_vision::preprocess::ProcessorConfig;
use k3_vision::{TowerDims, VisionModel, VisionSpec};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

pub const DIMS: TowerDims = TowerDims { hidden: 32, heads: 2, qkv: 48, intermediate: 40, layers: 2, patch: 14, pos_h: 4, pos_w: 6, pos_t: 4 };

pub fn processor(sample_fps: f64) -> ProcessorConfig {
    serde_json::from_value(serde_json::json!({
        "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 24, "patch_limit_on_one_side": 16,
        "fixed_output_tokens": null, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": true,
            "chessboard_white_value": 255, "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize",
        "in_patch_limit_each_frame": 24, "sample_fps": sample_fps, "temporal_merge_kernel_size": 4
    }))
    .unwrap()
}

/// Random weights N-ish(0, 1/fan_in), norm gains around 1.
pub fn weights() -> HashMap<String, Tensor> {
    weights_for(DIMS, 16, 7)
}

/// [`weights`] of a tower of sizes `d` (patch 14, merge 2 × 2) and a projector to `text_hidden`.
pub fn weights_for(d: TowerDims, text_hidden: usize, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut w = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, fan_in: usize| {
        let n: usize = shape.iter().product();
        let s = (1.0 / fan_in.max(1) as f32).sqrt() * 1.7;
        let v: Vec<f32> = (0..n).map(|_| if fan_in == 0 { 1.0 + rng.random_range(-0.2..0.2) } else { rng.random_range(-s..s) }).collect();
        w.insert(name, Tensor::from_f32(shape, &v).unwrap());
    };
    let (c, q, i) = (d.hidden, d.qkv, d.intermediate);
    add("vision_tower.patch_embed.proj.weight".into(), vec![c, 3, 14, 14], 588);
    add("vision_tower.patch_embed.pos_emb.weight".into(), vec![d.pos_h, d.pos_w, c], 4);
    for b in 0..d.layers {
        let p = format!("vision_tower.encoder.blocks.{b}.");
        add(format!("{p}norm0.weight"), vec![c], 0);
        add(format!("{p}norm1.weight"), vec![c], 0);
        add(format!("{p}wqkv.weight"), vec![3 * q, c], c);
        add(format!("{p}wo.weight"), vec![c, q], q);
        add(format!("{p}mlp.fc0.weight"), vec![i, c], c);
        add(format!("{p}mlp.fc1.weight"), vec![c, i], i);
    }
    add("vision_tower.encoder.final_layernorm.weight".into(), vec![c], 0);
    add("mm_projector.proj.0.weight".into(), vec![4 * c, 4 * c], 4 * c);
    add("mm_projector.proj.2.weight".into(), vec![text_hidden, 4 * c], 4 * c);
    add("mm_projector.post_norm.weight".into(), vec![text_hidden], 0);
    w
}

pub fn model(w: &HashMap<String, Tensor>, cfg: ProcessorConfig) -> VisionModel {
    model_for(DIMS, 16, w, cfg)
}

/// The model of [`weights_for`]`(d, text_hidden, _)`.
pub fn model_for(d: TowerDims, text_hidden: usize, w: &HashMap<String, Tensor>, cfg: ProcessorConfig) -> VisionModel {
    let spec = VisionSpec { tower: d, merge: (2, 2), text_hidden, projector_eps: 1e-5 };
    let get = |n: &str| w.get(n).cloned().ok_or_else(|| k3_vision::VisionError::Weight { name: n.into(), msg: "missing".into() });
    VisionModel::from_parts(spec, cfg, &get, 163605).unwrap()
}

/// Mean red byte of frame `f` of a chunk (pixels inside the resized area only).
pub fn mean_red(pv: &[f32], grid: [usize; 3], f: usize, new_w: usize, new_h: usize) -> f64 {
    let (gh, gw) = (grid[1], grid[2]);
    let (mut s, mut n) = (0f64, 0usize);
    for y in 0..new_h {
        for x in 0..new_w {
            let patch = f * gh * gw + (y / 14) * gw + x / 14;
            let v = pv[patch * 588 + (y % 14) * 14 + x % 14] as f64;
            s += (v * 0.5 + 0.5) * 255.0;
            n += 1;
        }
    }
    s / n as f64
}

/// Runs `f` on a thread and fails if it has not returned within `secs` (a hang is a failure).
pub fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).expect("the video decode hung (or panicked)")
}

/// Preprocesses 300 seeded mutations of `clip` (random bytes, 0xff bytes and runs, one in five
/// also truncated) named `name`, under a 120 s watchdog; `(decoded, refused)`. A panic or a hang
/// fails the test.
pub fn mutation_outcomes(clip: Vec<u8>, name: &'static str, seed: u64) -> (usize, usize) {
    within(120, move || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (mut ok, mut bad) = (0, 0);
        for _ in 0..300 {
            let mut m = clip.clone();
            for _ in 0..rng.random_range(1..9) {
                let p = rng.random_range(0..m.len());
                let q = (p + rng.random_range(1..5)).min(m.len());
                match rng.random_range(0..3) {
                    0 => m[p] = rng.random(),
                    1 => m[p] = 0xff,
                    _ => m[p..q].iter_mut().for_each(|x| *x = 0xff),
                }
            }
            if rng.random_range(0..5) == 0 {
                m.truncate(rng.random_range(1..m.len()));
            }
            match k3_vision::video::preprocess_video_bytes(&m, name, &processor(8.0), &k3_vision::video::VideoLimits::default()) {
                Ok(_) => ok += 1,
                Err(_) => bad += 1,
            }
        }
        (ok, bad)
    })
}
