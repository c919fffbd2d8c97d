//! Benchmark (not a test): images/s through preprocessing + the MoonViT3d tower for one
//! 1024×1024 PNG, with a random tower at the released widths (C 1024, qkv 1536, 12 heads,
//! MLP 4096) and few layers, at the released processor limits (65536 / 512 → grid 74×74).
//!
//! `cargo run --release -p k3-vision --example bench_tower -- [--layers N] [--iters N] [--size PX] [--bf16]`
//!
//! With `--features cuda` and `--cuda`: tower + merger + projector (to the text width 7168) on
//! GPU 0 in BF16 (`--f32`: the reference precision), `--batch B` copies of the image packed per
//! call, timed to the host copy of the features (CUDA work is asynchronous), beside the
//! arithmetic floor (GEMM and attention FLOPs at 989 dense BF16 TFLOP/s, an H100/H200's).
//! `cargo run --release -p k3-vision --features cuda --example bench_tower -- --cuda --layers 27 --batch 8`
//! `--video-frames N` (with `--cuda`) also times a clip end to end: an animated GIF of N frames
//! of 448×448 (`--video-size PX`) at the processor's 2 frames/s, decoded, sampled, chunked (4
//! frames per tower sample) and run through tower + merger + projector on the GPU.
//!
//! `--host-only` (no GPU needed): times the host side of one GPU call (`complete`) for
//! `--batch B` (default 8) copies of the image, piece by piece (see `mod host`); `--stages`
//! adds the downloads of the tower's and merger's outputs.
//!
//! `--attention` (with `--cuda`) also times one layer's attention alone at the same packed shape
//! (`B` samples of the image's patches, 12 heads of 128, random BF16 `qkv`): the fused kernel
//! (`vit_flash_attention`) in each of its tile shapes and the cuBLAS form
//! (`vit_attention_sliced`), as TFLOP/s (4·L²·Dq per sample) and the share of 989.

use std::collections::HashMap;
use std::time::Instant;

use k3_core::Tensor;
use k3_vision::preprocess::{preprocess_file, ProcessorConfig};
use k3_vision::{TowerDims, VisionModel, VisionSpec};
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
    let th = 7168;
    add("mm_projector.proj.0.weight".into(), vec![4 * c, 4 * c], 4 * c, &mut rng)?;
    add("mm_projector.proj.2.weight".into(), vec![th, 4 * c], 4 * c, &mut rng)?;
    add("mm_projector.post_norm.weight".into(), vec![th], 0, &mut rng)?;
    let spec = VisionSpec { tower: dims, merge: (2, 2), text_hidden: th, projector_eps: 1e-5 };
    let get =
        |n: &str| -> k3_vision::Result<Tensor> { w.get(n).cloned().ok_or_else(|| k3_vision::VisionError::Weight { name: n.into(), msg: "missing".into() }) };
    #[allow(unused_mut)]
    let mut vm = VisionModel::from_parts(spec, proc_cfg.clone(), &get, 163605)?;
    if std::env::args().any(|a| a == "--host-only") {
        return host::run(&vm, &path, arg("--batch", 8), iters.max(1));
    }
    #[cfg(feature = "cuda")]
    if std::env::args().any(|a| a == "--cuda") {
        cuda::run(&mut vm, &path, arg("--batch", 1), iters)?;
        let frames = arg("--video-frames", 0);
        if frames > 0 {
            cuda::video(&vm, frames, arg("--video-size", 448) as u32, iters)?;
        }
        return Ok(());
    }
    let tower = &vm.tower;

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

/// `--host-only`: the host side of one GPU call (`VisionModel::complete` → `CudaVision::encode`
/// → `tower_parts`) for `--batch B` copies of the image, piece by piece, without a GPU: as the
/// code runs it now, and the pieces as they were before (issue 24's profile) for comparison.
/// Device copies are not timed (no GPU); their host side is: the staging buffer's copies in
/// and out (`k3_core::staging`; a plain `Vec` stands in for the page-locked buffer).
mod host {
    use std::path::Path;
    use std::time::Instant;

    use k3_core::staging::{fresh_f32, gather, pieces, pieces_mut, scatter, windows, BUFFER_BYTES};
    use k3_vision::preprocess::preprocess_file;
    use k3_vision::tower::{patch_positions, rope_side, rope_table};
    use k3_vision::VisionModel;

    /// Best of `iters` runs of `f` in ms (after one warm-up run).
    fn time<T>(iters: usize, mut f: impl FnMut() -> T) -> f64 {
        std::hint::black_box(f());
        (0..iters)
            .map(|_| {
                let t0 = Instant::now();
                std::hint::black_box(f());
                t0.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// The host side of `Staging::upload` of `parts` (the DMA itself not included).
    fn staged_in(buf: &mut [u8], parts: &[&[u8]]) {
        let ins = pieces(parts);
        let lens: Vec<usize> = ins.iter().map(|p| p.len()).collect();
        for (i, j, _) in windows(&lens, buf.len()) {
            gather(buf, &ins[i..j]);
        }
    }

    /// The host side of `CudaVision::download_rows` into `blocks` fresh `Vec`s of `per` floats
    /// (`huge`: as it runs, with `fresh_f32`'s huge-page advice; else plain `vec!`).
    fn staged_out(buf: &[u8], blocks: usize, per: usize, huge: bool) -> Vec<Vec<f32>> {
        let mut out: Vec<Vec<f32>> = (0..blocks).map(|_| if huge { fresh_f32(per) } else { vec![0f32; per] }).collect();
        let mut bytes: Vec<&mut [u8]> = out.iter_mut().map(|v| bytemuck::cast_slice_mut::<f32, u8>(v)).collect();
        let mut outs = pieces_mut(&mut bytes);
        let lens: Vec<usize> = outs.iter().map(|p| p.len()).collect();
        for (i, j, _) in windows(&lens, buf.len()) {
            scatter(buf, &mut outs[i..j]);
        }
        drop(outs);
        out
    }

    pub fn run(vm: &VisionModel, path: &Path, batch: usize, iters: usize) -> Result<(), Box<dyn std::error::Error>> {
        let p = preprocess_file(path, &vm.processor)?;
        let g = p.grid_thw;
        let d = vm.spec.tower;
        let (c, th, k) = (d.hidden, vm.spec.text_hidden, d.hidden * vm.spec.merge.0 * vm.spec.merge.1);
        let (l, n) = (g[0] * g[1] * g[2], (g[1] / vm.spec.merge.0) * (g[2] / vm.spec.merge.1));
        let grids = vec![g; batch];
        let px: Vec<Vec<f32>> = (0..batch).map(|_| p.pixel_values.clone()).collect();
        let parts: Vec<&[f32]> = px.iter().map(|v| v.as_slice()).collect();
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l[l.find(':').map_or(0, |i| i + 1)..].trim().to_string()));
        println!(
            "host side of one GPU call: {batch} x grid {g:?} ({} rows, {} tokens), C {c}, text width {th}; {} rayon threads on {}; best of {iters} (ms)",
            batch * l,
            batch * n,
            rayon::current_num_threads(),
            cpu.unwrap_or_else(|| "?".into())
        );
        let mb = |floats: usize| floats as f64 * 4.0 / 1e6;
        let row = |name: &str, ms: f64| println!("  {name:<66} {ms:>9.2}");
        // `--stages` adds the tower's and merger's outputs to the projected features.
        let stages = std::env::args().any(|a| a == "--stages");
        let downloads: Vec<(&str, usize)> =
            [("vit_out", l * c), ("merged", n * k), ("projected", n * th)].into_iter().filter(|s| stages || s.0 == "projected").collect();
        let mut total = 0.0;
        let mut add = |name: &str, ms: f64| {
            row(name, ms);
            total += ms;
        };

        println!(" now:");
        add("check_parts", time(iters, || vm.tower.check_parts(&parts, &grids).map(|_| ())));
        add(
            "sample_rows per sample (cached per grid; GPU copy cached too)",
            time(iters, || grids.iter().map(|&g| vm.tower.sample_rows(g)).collect::<Vec<_>>()),
        );
        add("rope_table + patch_positions as i32", time(iters, || rope(d.head_dim(), &grids)));
        let mut buf = vec![1u8; BUFFER_BYTES];
        let bytes: Vec<&[u8]> = parts.iter().map(|p| bytemuck::cast_slice::<f32, u8>(p)).collect();
        add(&format!("pixels into the staging buffer ({:.0} MB)", mb(batch * px[0].len())), time(iters, || staged_in(&mut buf, &bytes)));
        for &(name, per) in &downloads {
            add(
                &format!("{name} out of the staging buffer into {batch} fresh Vecs ({:.0} MB)", mb(batch * per)),
                time(iters, || staged_out(&buf, batch, per, true)),
            );
        }
        row("total", total);
        let (name, per) = downloads[downloads.len() - 1];
        row(&format!("(the {name} without the huge-page advice: 4 KiB page faults)"), time(iters, || staged_out(&buf, batch, per, false)));
        row(&format!("first call of a new size only: pos_embedding {}x{}", g[1], g[2]), time(iters, || vm.tower.pos_embedding(g[1], g[2])));

        println!(" before (issue 24's profile):");
        total = 0.0;
        let mut add = |name: &str, ms: f64| {
            row(name, ms);
            total += ms;
        };
        add("check_input", time(iters, || vm.tower.check_input(&p.pixel_values, &[g]).map(|_| ())));
        add(
            &format!("pixels packed into one Vec ({:.0} MB)", mb(batch * px[0].len())),
            time(iters, || parts.iter().flat_map(|s| s.iter().copied()).collect::<Vec<f32>>()),
        );
        let old_pos = time(iters, || {
            let mut out = Vec::with_capacity(batch * l * c);
            for &[_, h, w] in &grids {
                out.extend_from_slice(&vm.tower.pos_embedding(h, w));
            }
            out
        });
        add(&format!("position_rows recomputed per call ({:.0} MB)", mb(batch * l * c)), old_pos);
        add("rope_table + patch_positions as i32", time(iters, || rope(d.head_dim(), &grids)));
        // `to_f32_vec` (the driver's copy into a fresh pageable Vec<u8> (a memcpy stands in),
        // `pod_collect_to_vec` into a Vec<f32>) and the per-sample copies.
        for &(name, per) in &downloads {
            let dev = vec![1f32; batch * per];
            let down = time(iters, || {
                let mut b = vec![0u8; dev.len() * 4];
                b.copy_from_slice(bytemuck::cast_slice(&dev));
                let all: Vec<f32> = bytemuck::pod_collect_to_vec(&b);
                drop(b);
                (0..batch).map(|i| all[i * per..(i + 1) * per].to_vec()).collect::<Vec<_>>()
            });
            add(&format!("{name}: to_f32_vec stand-in + per-sample copies ({:.0} MB)", mb(dev.len())), down);
        }
        row("total (plus uploading pixels and position rows from pageable memory)", total);
        Ok(())
    }

    fn rope(hd: usize, grids: &[[usize; 3]]) -> (Vec<f32>, Vec<f32>, Vec<i32>) {
        let (cos, sin) = rope_table(hd, rope_side(grids));
        (cos, sin, patch_positions(grids).into_iter().flat_map(|(r, c)| [r as i32, c as i32]).collect())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::Path;
    use std::time::Instant;

    use k3_vision::cuda::{CudaDevice, Precision};
    use k3_vision::preprocess::preprocess_file;
    use k3_vision::VisionModel;

    /// Dense BF16 tensor-core peak of an H100/H200 SXM, FLOP/s.
    const PEAK: f64 = 989e12;

    pub fn run(vm: &mut VisionModel, path: &Path, batch: usize, iters: usize) -> Result<(), Box<dyn std::error::Error>> {
        let precision = if std::env::args().any(|a| a == "--f32") { Precision::F32 } else { Precision::Bf16 };
        let dev = CudaDevice::new(0)?;
        vm.attach_cuda(&dev, precision)?;
        // As the server: only the projected features come back (`--stages`: the tower's and merger's too).
        vm.set_gpu_stages(std::env::args().any(|a| a == "--stages"));
        let d = vm.spec.tower;
        let p = preprocess_file(path, &vm.processor)?;
        let g = p.grid_thw;
        let (l, n) = (g[0] * g[1] * g[2], (g[1] / 2) * (g[2] / 2));
        let (gemm, attn) = sample_flops(vm, l, n);
        let flops = gemm + attn;
        println!("{dev:?}; {precision:?}; grid {g:?} ({l} patches, {n} tokens), {} layers, batch {batch}", d.layers);
        println!(
            "per image: {:.2} TFLOP ({:.2} GEMM + {:.2} attention) → floor {:.2} ms = {:.0} images/s at {:.0} TFLOP/s",
            flops / 1e12,
            gemm / 1e12,
            attn / 1e12,
            flops / PEAK * 1e3,
            PEAK / flops,
            PEAK / 1e12
        );
        let mut pend: Vec<_> = (0..batch).map(|_| vm.pending(p.pixel_values.clone(), g)).collect::<Result<_, _>>()?;
        let mut best = f64::INFINITY;
        for it in 0..=iters {
            pend.iter_mut().for_each(|f| f.projected.clear());
            let t0 = Instant::now();
            vm.complete(&mut pend.iter_mut().collect::<Vec<_>>())?;
            let s = t0.elapsed().as_secs_f64();
            let finite = pend.iter().all(|f| f.projected.iter().all(|v| v.is_finite()));
            println!("{} {:.2} ms for {batch} image(s) → {:.1} images/s, finite {finite}", if it == 0 { "warm-up" } else { "run" }, s * 1e3, batch as f64 / s);
            if it > 0 {
                best = best.min(s);
            }
        }
        println!("best: {:.1} images/s ({:.0}% of the floor's rate)", batch as f64 / best, 100.0 * (batch as f64 / best) / (PEAK / flops));
        if std::env::args().any(|a| a == "--attention") {
            attention(&dev, l, batch, d.heads, d.qkv, iters.max(3))?;
        }
        Ok(())
    }

    /// One layer's attention over `batch` packed samples of `l` rows, timed with CUDA events.
    fn attention(dev: &CudaDevice, l: usize, batch: usize, heads: usize, dq: usize, iters: usize) -> Result<(), Box<dyn std::error::Error>> {
        use k3_core::cuda::vision::{vit_attention_sliced, vit_flash_attention_tiled, FlashTile, SCORE_BYTES};
        use k3_core::cuda::CudaTensor;
        use k3_core::DType;
        use rand::{Rng, SeedableRng};

        let rows = l * batch;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let qkv: Vec<half::bf16> = (0..rows * 3 * dq).map(|_| half::bf16::from_f32(rng.random_range(-1.0f32..1.0))).collect();
        let qkv = CudaTensor::from_bf16(dev, vec![rows, 3 * dq], &qkv)?;
        let out = CudaTensor::uninit(dev, DType::BF16, vec![rows, dq])?;
        let lens = vec![l; batch];
        let flops = 4.0 * (l * l) as f64 * dq as f64 * batch as f64;
        let time = |f: &dyn Fn() -> k3_core::Result<()>| -> Result<f64, Box<dyn std::error::Error>> {
            f()?;
            let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
            e0.record(&dev.stream())?;
            for _ in 0..iters {
                f()?;
            }
            e1.record(&dev.stream())?;
            Ok(e0.elapsed_ms(&e1)? as f64 / iters as f64)
        };
        println!("attention alone: {batch} x {l} rows, {heads} heads of {}, {:.2} TFLOP per call", dq / heads, flops / 1e12);
        for tile in FlashTile::ALL {
            let ms = time(&|| vit_flash_attention_tiled(&qkv, heads, &lens, &out, tile))?;
            println!("  fused {tile:?}: {ms:.3} ms, {:.0} TFLOP/s ({:.0}% of {:.0})", flops / ms / 1e9, 100.0 * flops / ms / 1e9 / (PEAK / 1e12), PEAK / 1e12);
        }
        let ms = time(&|| vit_attention_sliced(&qkv, heads, &lens, &out, SCORE_BYTES))?;
        println!("  cuBLAS form: {ms:.3} ms, {:.0} TFLOP/s", flops / ms / 1e9);
        Ok(())
    }

    /// FLOPs of one sample of `l` patches giving `n` merged tokens through tower, merger and
    /// projector: (GEMMs, attention).
    fn sample_flops(vm: &VisionModel, l: usize, n: usize) -> (f64, f64) {
        let d = vm.spec.tower;
        let (c, q, i, k, th, lf) = (d.hidden as f64, d.qkv as f64, d.intermediate as f64, 4.0 * d.hidden as f64, vm.spec.text_hidden as f64, l as f64);
        let gemm = 2.0 * lf * (588.0 * c + d.layers as f64 * (3.0 * c * q + q * c + 2.0 * c * i)) + 2.0 * n as f64 * (k * k + k * th);
        (gemm, 4.0 * lf * lf * q * d.layers as f64)
    }

    /// A clip of `frames` frames of `size`² end to end (decode, sample, chunk, tower, merger,
    /// projector), timed per clip beside the tower's arithmetic floor.
    pub fn video(vm: &VisionModel, frames: usize, size: u32, iters: usize) -> Result<(), Box<dyn std::error::Error>> {
        use image::codecs::gif::GifEncoder;
        use image::{Delay, Frame, RgbaImage};
        let mut gif = Vec::new();
        {
            let mut enc = GifEncoder::new_with_speed(&mut gif, 30);
            for f in 0..frames as u32 {
                let img =
                    RgbaImage::from_fn(size, size, |x, y| image::Rgba([((x + 3 * f) % 256) as u8, ((y + 5 * f) % 256) as u8, ((x ^ y) % 256) as u8, 255]));
                enc.encode_frame(Frame::from_parts(img, 0, 0, Delay::from_numer_denom_ms(500, 1)))?;
            }
        }
        let limits = k3_vision::video::VideoLimits { max_frames: frames, ..Default::default() };
        let mut best = f64::INFINITY;
        for it in 0..=iters {
            let t0 = Instant::now();
            let v = vm.encode_video_bytes(&gif, "clip.gif", &limits)?;
            let s = t0.elapsed().as_secs_f64();
            let (mut flops, mut tokens, mut sampled) = (0.0, 0, 0);
            for (_, fr, p) in &v.chunks {
                let g = p.grid_thw;
                let n = p.projected.len() / vm.spec.text_hidden;
                let (gemm, attn) = sample_flops(vm, g[0] * g[1] * g[2], n);
                flops += gemm + attn;
                tokens += n;
                sampled += fr.len();
            }
            let finite = v.chunks.iter().all(|c| c.2.projected.iter().all(|x| x.is_finite()));
            println!(
                "{} clip {frames} frames {size}x{size} ({} bytes GIF): {sampled} frames sampled, {} chunks, {tokens} tokens: {:.1} ms end to end; tower floor {:.2} ms at {:.0} TFLOP/s; finite {finite}",
                if it == 0 { "warm-up" } else { "run" },
                gif.len(),
                v.chunks.len(),
                s * 1e3,
                flops / PEAK * 1e3,
                PEAK / 1e12
            );
            if it > 0 {
                best = best.min(s);
            }
        }
        println!("best clip: {:.1} ms ({:.1} frames/s end to end)", best * 1e3, frames as f64 / best);
        Ok(())
    }
}
