//! Every stage of the vision path against `vision_small_f32/reference.safetensors`
//! (README tolerances: pixels bit-exact, f32 per-row rel-L2 ≤ 5e-5, logits as the text fixtures).

mod common;

use common::*;
use k3_model::{Checkpoint, ForwardOpts, Model};
use k3_vision::preprocess::{preprocess_file, resize_plan, ProcessorConfig};
use k3_vision::prompt::{expand_pads, image_block_ids, image_prompt_text, MediaTokens};
use k3_vision::{splice, VisionModel};

fn processor() -> ProcessorConfig {
    ProcessorConfig::from_model_dir(&vision_fixture()).unwrap()
}

fn model() -> VisionModel {
    VisionModel::load(&Checkpoint::open(&vision_fixture()).unwrap()).unwrap()
}

#[test]
fn resize_plans_match_the_released_table() {
    let mut cfg = processor();
    cfg.in_patch_limit = 65536;
    cfg.patch_limit_on_one_side = 512;
    let m = meta();
    let rows = m["released_limit_resize_plans"].as_array().unwrap();
    assert_eq!(rows.len(), 16);
    for r in rows {
        let (w, h) = (r["orig_wh"][0].as_u64().unwrap() as usize, r["orig_wh"][1].as_u64().unwrap() as usize);
        let p = resize_plan(w, h, &cfg).unwrap();
        let g: Vec<usize> = r["grid_thw"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
        let want = (r["new_width"].as_u64(), r["new_height"].as_u64(), r["pad_width"].as_u64(), r["pad_height"].as_u64(), r["num_tokens"].as_u64());
        let got = (Some(p.new_width as u64), Some(p.new_height as u64), Some(p.pad_width as u64), Some(p.pad_height as u64), Some(p.num_tokens as u64));
        assert_eq!(got, want, "{w}x{h}");
        assert_eq!(p.grid_thw.to_vec(), g, "{w}x{h}");
    }
}

#[test]
fn limits_are_read_from_the_model_directory() {
    let cfg = processor();
    assert_eq!((cfg.in_patch_limit, cfg.patch_limit_on_one_side), (40, 10));
    for (i, img) in meta()["images"].as_array().unwrap().iter().enumerate() {
        let (w, h) = (img["size_wh"][0].as_u64().unwrap() as usize, img["size_wh"][1].as_u64().unwrap() as usize);
        let p = resize_plan(w, h, &cfg).unwrap();
        let rp = &img["resize_plan"];
        assert_eq!(p.new_width as u64, rp["new_width"].as_u64().unwrap(), "image {i}");
        assert_eq!(p.new_height as u64, rp["new_height"].as_u64().unwrap(), "image {i}");
        assert_eq!((p.pad_width as u64, p.pad_height as u64), (rp["pad_width"].as_u64().unwrap(), rp["pad_height"].as_u64().unwrap()), "image {i}");
        assert_eq!(p.num_tokens as u64, rp["num_tokens"].as_u64().unwrap(), "image {i}");
        // The header-only plan (for rendering the prompt block) agrees.
        let (orig, hp) = k3_vision::preprocess::plan_file(&vision_fixture().join(IMAGES[i]), &cfg).unwrap();
        assert_eq!((orig, hp), ((w, h), p), "image {i}");
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn preprocessed_pixels_are_bit_exact() {
    let (cfg, r) = (processor(), Reference::open());
    for (i, name) in IMAGES.iter().enumerate() {
        let p = preprocess_file(&vision_fixture().join(name), &cfg).unwrap();
        assert_eq!(p.grid_thw, r.grid(&format!("grid_thw_{i}")), "{name}: grid_thw");
        let (shape, want) = r.f32(&format!("pixel_values_{i}"));
        assert_eq!(shape, vec![p.grid_thw[1] * p.grid_thw[2], 3, 14, 14], "{name}");
        let diff = p.pixel_values.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let max = p.pixel_values.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{name}: {diff} of {} pixel values differ, max |Δ| {max}", want.len());
        assert_eq!(diff, 0, "{name}: pixel_values are not bit-exact (max |Δ| {max})");
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn position_table_resize_matches() {
    let (m, r) = (model(), Reference::open());
    for i in 0..3 {
        let g = r.grid(&format!("grid_thw_{i}"));
        let (_, want) = r.f32(&format!("pos_emb_{i}"));
        assert_close(&format!("pos_emb_{i}"), &m.tower.pos_embedding(g[1], g[2]), &want, 32);
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn batched_tower_matches_every_block_and_projector() {
    let (m, r) = (model(), Reference::open());
    let (_, pixels) = r.f32("pixel_values");
    let g = r.i64("grid_thws");
    let grids: Vec<[usize; 3]> = g.chunks(3).map(|c| [c[0] as usize, c[1] as usize, c[2] as usize]).collect();
    let mut seen = Vec::new();
    let mut trace = |name: &str, x: &[f32]| {
        let (_, want) = r.f32(name);
        assert_close(name, x, &want, 32);
        seen.push(name.to_string());
    };
    let projected = m.project_batch(&pixels, &grids, Some(&mut trace)).unwrap();
    assert_eq!(seen, vec!["vit_patch_embed", "vit_block0_out", "vit_block1_out"]);
    let vit = m.tower.forward(&pixels, &grids, None).unwrap();
    assert_close("vit_out", &vit, &r.f32("vit_out").1, 32);
    let all: Vec<f32> = projected.concat();
    assert_close("projected", &all, &r.f32("projected").1, 96);
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn per_image_tower_merger_projector_match() {
    let (m, r) = (model(), Reference::open());
    for i in 0..3 {
        let (_, pixels) = r.f32(&format!("pixel_values_{i}"));
        let f = m.encode_pixels(pixels, r.grid(&format!("grid_thw_{i}"))).unwrap();
        assert_close(&format!("vit_out_{i}"), &f.vit_out, &r.f32(&format!("vit_out_{i}")).1, 32);
        let (shape, want) = r.f32(&format!("merged_{i}"));
        assert_eq!(shape, vec![f.num_tokens, 4, 32]);
        assert_close(&format!("merged_{i}"), &f.merged, &want, 32);
        assert_close(&format!("projected_{i}"), &f.projected, &r.f32(&format!("projected_{i}")).1, 96);
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn png_to_projection_end_to_end() {
    let (m, r) = (model(), Reference::open());
    for (i, name) in IMAGES.iter().enumerate() {
        let f = m.encode_image(&vision_fixture().join(name)).unwrap();
        let w = meta()["images"][i]["size_wh"].clone();
        assert_eq!(f.orig_size.map(|(a, b)| vec![a as u64, b as u64]), Some(vec![w[0].as_u64().unwrap(), w[1].as_u64().unwrap()]));
        assert_close(&format!("{name} → projected_{i}"), &f.projected, &r.f32(&format!("projected_{i}")).1, 96);
        // The `k3 vision` file round-trips with the documented names and shapes.
        let bytes = f.to_safetensors().unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let n = f.num_tokens;
        let hw = f.grid_thw[1] * f.grid_thw[2];
        for (k, s) in
            [("pixel_values", vec![hw, 3, 14, 14]), ("grid_thw", vec![3]), ("vit_out", vec![hw, 32]), ("merged", vec![n, 4, 32]), ("projected", vec![n, 96])]
        {
            assert_eq!(st.tensor(k).unwrap().shape(), s.as_slice(), "{k}");
        }
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn prompt_expansion_and_text_match() {
    let (r, m) = (Reference::open(), meta());
    let hf: Vec<u32> = r.i64("input_ids_hf").iter().map(|&v| v as u32).collect();
    let want: Vec<u32> = r.i64("input_ids").iter().map(|&v| v as u32).collect();
    let counts: Vec<usize> = (0..3)
        .map(|i| {
            let g = r.grid(&format!("grid_thw_{i}"));
            k3_vision::prompt::num_image_tokens(g, 2, 2)
        })
        .collect();
    assert_eq!(counts, vec![12, 10, 4]);
    assert_eq!(expand_pads(&hf, 377, &counts).unwrap(), want);
    // Build the ids from the layout with the renderer's block function.
    let sp = &m["special_ids_tiny_vocab"];
    let tok = MediaTokens {
        begin: sp["media_begin"].as_u64().unwrap() as u32,
        content: sp["media_content"].as_u64().unwrap() as u32,
        end: sp["media_end"].as_u64().unwrap() as u32,
        pad: sp["media_pad"].as_u64().unwrap() as u32,
    };
    let ids_of = |v: &serde_json::Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    let mut built = Vec::new();
    let mut text = String::new();
    for part in m["prompt_layout"].as_array().unwrap() {
        if let Some(t) = part.get("text_ids") {
            built.extend(ids_of(t));
            text.push_str("<text>");
        } else {
            let i = part["image"].as_u64().unwrap() as usize;
            built.extend(image_block_ids(&tok, &ids_of(&part["framing_ids"]), counts[i]));
            let wh = &m["images"][i]["size_wh"];
            text.push_str(&image_prompt_text(wh[0].as_u64().unwrap() as usize, wh[1].as_u64().unwrap() as usize, 1));
        }
    }
    assert_eq!(built, want);
    assert_eq!(text, m["prompt_text_official"].as_str().unwrap());
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn spliced_embeddings_and_logits_match() {
    let ck = Checkpoint::open(&vision_fixture()).unwrap();
    let (lm, vm, r) = (Model::load(&ck).unwrap(), VisionModel::load(&ck).unwrap(), Reference::open());
    let ids: Vec<u32> = r.i64("input_ids").iter().map(|&v| v as u32).collect();
    assert_eq!(vm.pad_id, 377);
    let feats: Vec<Vec<f32>> = IMAGES.iter().map(|n| vm.encode_image(&vision_fixture().join(n)).unwrap().projected).collect();
    let views: Vec<&[f32]> = feats.iter().map(Vec::as_slice).collect();
    let mut emb = lm.embed(&ids).unwrap();
    splice(&mut emb, &ids, vm.pad_id, &views).unwrap();
    assert_close("inputs_embeds", &emb, &r.f32("inputs_embeds").1, 96);
    let mut st = lm.new_state();
    let logits = lm.forward_embeds(emb, &mut st, ForwardOpts::default(), None).unwrap();
    let (_, want) = r.f32("logits");
    let v = 384;
    let max_abs = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let rel = max_rel_l2(&logits, &want, v);
    let argmax = |x: &[f32]| x.iter().enumerate().fold((0, f32::MIN), |m, (i, &y)| if y > m.1 { (i, y) } else { m }).0;
    let agree = logits.chunks(v).zip(want.chunks(v)).filter(|(a, b)| argmax(a) == argmax(b)).count() as f64 / ids.len() as f64;
    eprintln!("logits: max_abs {max_abs:.3e}, max rel-L2 {rel:.3e}, top-1 {agree}");
    assert!(max_abs <= 1e-3 && rel <= 3e-4 && agree >= 0.995, "logits: max_abs {max_abs}, rel {rel}, top-1 {agree}");
}
