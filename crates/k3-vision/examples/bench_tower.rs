//! Benchmark (not a test): images/s through preprocessing + the MoonViT3d tower for one
//! 1024×1024 PNG, with a random tower at the released widths (C 1024, qkv 1536, 12 heads,
//! MLP 4096) and few layers, at the released processor limits (65536 / 512 → grid 74×74).
//!
//! `cargo run --release -p k3-vision --example bench_tower -- [--layers N] [--iters N] [--size PX] [--bf16]`

use std::collections::HashMap;
use std::time::Instant;

use k3_core::Tensor;
use k3_vision::preprocess::{preprocess_file, ProcessorConfig};
use k3_vision::{TowerDims, VisionTower};
use rand::{Rng, SeedableRng};

fn arg(name: &str, default: usize) -> usize {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let layers = arg("--layers", 2);
    let iters = arg("--iters", 3);
    let size = arg("--size", 1024) as u32;
    let bf16 = std::env::args().any(|a| a == "--bf16");
    let dims = TowerDims { hidden: 1024, heads: 12, qkv: 1536, intermediate: 4096, layers, patch: 14, pos_h: 64, pos_w: 64, pos_t: 4 };

    // A photo-like test image: smooth gradients plus noise (so the PNG is not trivially small).
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let img = image::RgbImage::from_fn(size, size, |x, y| {
        let n: u8 = rng.random_range(0..24);
        image::Rgb([(x * 255 / size) as u8 ^ n, (y * 255 / size) as u8, ((x + y) / 8 % 256) as u8 ^ n])
    });
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bench.png");
    img.save(&path)?;

    // The released processor settings (the library reads them from preprocessor_config.json).
    let proc_cfg: ProcessorConfig = serde_json::from_value(serde_json::json!({
        "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 65536, "patch_limit_on_one_side": 512,
        "fixed_output_tokens": null, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8, "chessboard_square_on_top_left": true,
            "chessboard_white_value": 255, "chessboard_gray_value": 180},
        "transparent_bg_fill_stage": "after_resize"
    }))?;

    // Random weights N(0, 1/fan_in), gains 1.
    let mut w: HashMap<String, Tensor> = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, fan_in: usize, rng: &mut rand::rngs::StdRng| -> Result<(), k3_core::CoreError> {
        let n: usize = shape.iter().product();
        let s = (1.0 / fan_in as f32).sqrt() * 1.7;
        let v: Vec<f32> = (0..n).map(|_| if fan_in == 0 { 1.0 } else { rng.random_range(-s..s) }).collect();
        let t = if bf16 { Tensor::from_bf16(shape, &v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>())? } else { Tensor::from_f32(shape, &v)? };
        w.insert(name, t);
        Ok(())
    };
    let (c, q, i) = (dims.hidden, dims.qkv, dims.intermediate);
    add("vision_tower.patch_embed.proj.weight".into(), vec![c, 3, 14, 14], 588, &mut rng)?;
    add("vision_tower.patch_embed.pos_emb.weight".into(), vec![64, 64, c], 4, &mut rng)?;
    for b in 0..layers {
        let p = format!("vision_tower.encoder.blocks.{b}.");
        add(format!("{p}norm0.weight"), vec![c], 0, &mut rng)?;
        add(format!("{p}norm1.weight"), vec![c], 0, &mut rng)?;
        add(format!("{p}wqkv.weight"), vec![3 * q, c], c, &mut rng)?;
        add(format!("{p}wo.weight"), vec![c, q], q, &mut rng)?;
        add(format!("{p}mlp.fc0.weight"), vec![i, c], c, &mut rng)?;
        add(format!("{p}mlp.fc1.weight"), vec![c, i], i, &mut rng)?;
    }
    add("vision_tower.encoder.final_layernorm.weight".into(), vec![c], 0, &mut rng)?;
    let get =
        |n: &str| -> k3_vision::Result<Tensor> { w.get(n).cloned().ok_or_else(|| k3_vision::VisionError::Weight { name: n.into(), msg: "missing".into() }) };
    let tower = VisionTower::load(dims, &get)?;

    println!(
        "image {size}x{size}, tower {layers} layers (C 1024, qkv 1536 / 12 heads, MLP 4096), weights {}, {} rayon threads",
        if bf16 { "bf16" } else { "f32" },
        rayon::current_num_threads()
    );
    let (mut tp, mut tt) = (0f64, 0f64);
    for it in 0..=iters {
        let t0 = Instant::now();
        let p = preprocess_file(&path, &proc_cfg)?;
        let t1 = Instant::now();
        let out = tower.forward(&p.pixel_values, &[p.grid_thw], None)?;
        let t2 = Instant::now();
        let (a, b) = ((t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64());
        let l = p.grid_thw[1] * p.grid_thw[2];
        println!(
            "{} grid {:?} ({l} patches): preprocess {:.3} s, tower {:.3} s ({:.3} s/layer), finite {}",
            if it == 0 { "warm-up" } else { "run" },
            p.grid_thw,
            a,
            b,
            b / layers as f64,
            out.iter().all(|v| v.is_finite())
        );
        if it > 0 {
            tp += a;
            tt += b;
        }
    }
    let n = iters.max(1) as f64;
    println!(
        "mean: preprocess {:.3} s, tower {:.3} s, total {:.3} s → {:.3} images/s ({layers}-layer tower); preprocessing alone {:.2} images/s",
        tp / n,
        tt / n,
        (tp + tt) / n,
        n / (tp + tt),
        n / tp
    );
    Ok(())
}
