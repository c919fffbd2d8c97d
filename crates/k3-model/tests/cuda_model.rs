//! The whole text model on the GPU (`k3_model::cuda::CudaModel`, issue 13) against the CPU
//! model and the golden fixtures.
//!
//! Tolerances are those of a bf16 engine, measured rather than assumed. On the GPU the weights
//! and every GEMM input are BF16; each rounding moves a value by up to 2^-9 relative, so the
//! named intermediates of a trained model sit at ~4e-3 from the f32 CPU model's (k3-nano, every
//! layer) and the logits at ~5e-3 typical. Two things are discrete and flip under any such
//! perturbation: the MoE expert choice at a near-tie and the DSA top-k at a near-tie; a flip
//! moves one position's logits by O(1). So model-level checks use the **median** per-position
//! relative L2 (a flip at a few positions does not pass a bug that moves every position), top-1
//! agreement on trained weights, and well-conditioned random models (every token routed to every
//! expert) where no flip can occur. The golden fixtures are f32 random models so ill-conditioned
//! that the f32 CPU model with its weights merely rounded to bf16 already misses their manifest
//! tolerance (max rel L2 0.44–1.09 per position, top-1 76–93%, measured), and the GPU, which
//! also rounds every activation, lands at 1–3× that baseline's median (measured 2.8e-2–5.8e-2,
//! top-1 down to 0.6 on 5 positions). No bf16 engine can meet the manifest tolerance on these
//! fixtures; the test prints both and asserts only what separates rounding from a wrong
//! computation (median ≤ max(0.15, 3× the baseline's); a wrong layer gives 0.5–1.4). The
//! manifest tolerance itself is met on the GPU by the reference precision (`Precision::F32`,
//! `golden_fixtures_on_gpu_f32`), as on the CPU by the f32 model (tests/golden.rs).
//!
//! - the three golden fixtures in the reference precision (`Precision::F32`) at the manifest
//!   tolerances: prefill, stepwise decode (eager and graph) and chunked prefill;
//! - the three golden fixtures in BF16 (KDA head dim 32: the general KDA kernel), full prefill;
//! - k3-nano (trained, bf16), GPU = CPU, and every named intermediate within 2e-2;
//! - random release-format checkpoints (`k3 init`) with top-k = all experts: K3's attention head
//!   dims (the explicit-form prefill attention); KDA head dim 128 (the chunked and fused decode
//!   kernels) with MXFP4 experts; a DSA model;
//! - FP8 latent and indexer-key caches: k3-nano and the DSA model within the same tolerances;
//! - on the GPU: stepwise decode (eager and CUDA-graph replay) and chunked prefill = full prefill;
//!   several sequences packed in one step = each run alone.
//!
//! Without a GPU every test prints `skipped` and passes; `K3_REQUIRE_CUDA=1` makes that a failure.
#![cfg(feature = "cuda")]

mod common;
use common::*;
#[path = "../../../tests/support/cuda.rs"]
mod cuda;
use cuda::device;
use k3_core::cuda::CudaDevice;
use k3_model::capacity::KvDtype;
use k3_model::config::builtin_config;
use k3_model::cuda::{CacheConfig, CudaModel, Input, Precision};
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::{Checkpoint, ForwardOpts, Model};
use serde_json::json;

/// Median per-position relative L2 of the logits, GPU vs CPU (bf16 vs f32 compute), trained weights.
const TOL_MEDIAN: f32 = 1.5e-2;
/// Golden fixtures on the GPU: the median per-position relative L2 that only a wrong
/// computation exceeds (see the module docs).
const GOLDEN_GROSS: f32 = 0.15;
/// The same for random-weight models, whose layers amplify rounding (measured: the final
/// hidden state at 2e-2 after 5 layers, every sublayer growing smoothly — no jump).
const TOL_RANDOM: f32 = 5e-2;
/// Top-1 agreement on trained weights.
const TOL_TOP1: f32 = 0.95;

/// (median per-position relative L2, top-1 agreement).
fn median_cmp(got: &[f32], want: &[f32], vocab: usize) -> (f32, f32) {
    let mut rel: Vec<f32> = row_rel_l2(got, want, vocab).into_iter().map(|e| e as f32).collect();
    rel.sort_by(f32::total_cmp);
    (rel[rel.len() / 2], compare(got, want, vocab).top1)
}

/// Median per-position relative L2 ≤ `tol`, and top-1 ≥ `top1` when given (trained weights).
fn check(got: &[f32], want: &[f32], vocab: usize, tol: f32, top1: Option<f32>, what: &str) {
    let (med, t1) = median_cmp(got, want, vocab);
    eprintln!("{what}: median rel L2 {med:.2e}, top-1 {t1:.3}, {:?}", compare(got, want, vocab));
    assert!(med <= tol, "{what}: median per-position relative L2 {med:.3e} > {tol:.1e}");
    if let Some(t) = top1 {
        assert!(t1 >= t, "{what}: top-1 agreement {t1:.3} < {t}");
    }
}

fn gpu(ck: &Checkpoint, dev: &CudaDevice, seqs: usize, tokens: usize) -> CudaModel {
    CudaModel::load(ck, dev, CacheConfig { max_seqs: seqs, max_tokens: tokens, ..Default::default() }).expect("load on GPU")
}

/// GPU logits of `toks` fed in pieces of `step` (decode steps through a graph when `graph`).
fn run_pieces(m: &mut CudaModel, toks: &[u32], step: usize, graph: bool) -> Vec<f32> {
    let mut s = m.new_sequence().unwrap();
    let g = graph.then(|| m.capture_decode(1, toks.len() + 8).unwrap());
    let mut out = Vec::new();
    for piece in toks.chunks(step) {
        out.extend(match &g {
            Some(g) => m.decode_step(g, piece, &mut [&mut s]).unwrap(),
            None => m.forward(piece, &mut s, false).unwrap(),
        });
    }
    drop(g);
    m.release(s);
    out
}

/// The fixture's checkpoint with every float tensor rounded to bf16 (the release's F32 tensors
/// kept), written to `dir`: the f32 CPU model on it is the bf16 baseline.
fn bf16_copy(src: &std::path::Path, dir: &std::path::Path) -> Checkpoint {
    use safetensors::tensor::{Dtype, TensorView};
    let ck = Checkpoint::open(src).unwrap();
    let kinds: std::collections::HashMap<String, k3_model::weights::Kind> =
        k3_model::weights::tensor_table(&ck.config).into_iter().map(|t| (t.name, t.kind)).collect();
    let mut data: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    for name in ck.names() {
        let t = ck.tensor(name).unwrap();
        let float = kinds.get(name) == Some(&k3_model::weights::Kind::Float) && t.dtype() == k3_core::DType::F32;
        let (dt, bytes) = if float {
            let v: Vec<half::bf16> = t.to_f32().unwrap().iter().map(|&x| half::bf16::from_f32(x)).collect();
            (Dtype::BF16, bytemuck::cast_slice(&v).to_vec())
        } else {
            (
                match t.dtype() {
                    k3_core::DType::U8 => Dtype::U8,
                    k3_core::DType::BF16 => Dtype::BF16,
                    _ => Dtype::F32,
                },
                t.bytes().to_vec(),
            )
        };
        data.push((name.to_string(), t.shape().to_vec(), dt, bytes));
    }
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let views: Vec<(String, TensorView)> = data.iter().map(|(n, sh, dt, b)| (n.clone(), TensorView::new(*dt, sh.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    Checkpoint::open(dir).unwrap()
}

#[test]
fn golden_fixtures_on_gpu() {
    let Some(dev) = device("golden_fixtures_on_gpu") else { return };
    let d = tempfile::tempdir().unwrap();
    for name in ["k3_small_f32", "k31_small_dsa_f32", "k3_small_mxfp4"] {
        let ck = Checkpoint::open(&fixture(name)).unwrap();
        let base = Model::load(&bf16_copy(&fixture(name), &d.path().join(name))).unwrap();
        let mut m = gpu(&ck, &dev, 2, 512);
        let r = reference(name);
        let vocab = m.config.text.vocab_size;
        for l in [5, 40, 160] {
            let toks = tokens(&r, l);
            let want = ref_f32(&r, &format!("logits_L{l}"));
            let got = run_pieces(&mut m, &toks, toks.len(), false);
            let mut st = base.new_state();
            let b = base.forward(&toks, &mut st, ForwardOpts::default(), None).unwrap();
            let ((gm, gt), (bm, bt)) = (median_cmp(&got, &want, vocab), median_cmp(&b, &want, vocab));
            eprintln!("{name} L{l}: GPU median rel L2 {gm:.2e} top-1 {gt:.3} | CPU with bf16 weights {bm:.2e} top-1 {bt:.3}");
            // A wrong layer, weight layout or cache position moves every position by O(1)
            // (median 0.5–1.4); bf16 rounding on these fixtures gives ≤ 6e-2 (measured).
            let bound = (3.0 * bm).max(GOLDEN_GROSS);
            assert!(
                gm <= bound,
                "{name} L{l}: GPU median per-position relative L2 {gm:.3e} > {bound:.2} (bf16 baseline {bm:.3e}): not rounding, a wrong computation"
            );
        }
    }
}

/// The golden fixtures on the GPU in the reference precision (`Precision::F32`: F32 weights and
/// activations, the plain kernels) at the manifest's own tolerances: full prefill at every
/// length, stepwise decode (eager and CUDA-graph replay) against `decode_logits_L160`, and
/// chunks of 37 against the full prefill.
#[test]
fn golden_fixtures_on_gpu_f32() {
    let Some(dev) = device("golden_fixtures_on_gpu_f32") else { return };
    for name in ["k3_small_f32", "k31_small_dsa_f32", "k3_small_mxfp4"] {
        let ck = Checkpoint::open(&fixture(name)).unwrap();
        let mut m =
            CudaModel::load_with(&ck, &dev, CacheConfig { max_seqs: 2, max_tokens: 512, ..Default::default() }, Precision::F32).expect("load on GPU (F32)");
        let r = reference(name);
        let vocab = m.config.text.vocab_size;
        for l in [5, 40, 160] {
            let got = run_pieces(&mut m, &tokens(&r, l), l, false);
            let c = compare(&got, &ref_f32(&r, &format!("logits_L{l}")), vocab);
            eprintln!("{name} L{l} (GPU, F32): {c:?}");
            assert_within(&c, &format!("{name} L{l} on the GPU in F32"));
        }
        let toks = tokens(&r, 160);
        let dec_ref = ref_f32(&r, "decode_logits_L160");
        for (graph, what) in [(false, "eager"), (true, "graph")] {
            let c = compare(&run_pieces(&mut m, &toks, 1, graph), &dec_ref, vocab);
            eprintln!("{name} stepwise decode ({what}, GPU, F32) vs decode_logits_L160: {c:?}");
            assert_within(&c, &format!("{name} {what} decode on the GPU in F32"));
        }
        let c = compare(&run_pieces(&mut m, &toks, 37, false), &ref_f32(&r, "logits_L160"), vocab);
        eprintln!("{name} chunks of 37 (GPU, F32): {c:?}");
        assert_within(&c, &format!("{name} chunked prefill on the GPU in F32"));
    }
}

#[test]
fn gpu_decode_and_chunks_equal_prefill() {
    let Some(dev) = device("gpu_decode_and_chunks_equal_prefill") else { return };
    let d = tempfile::tempdir().unwrap();
    for (ck, n, what) in random_cases(d.path()) {
        let mut m = gpu(&ck, &dev, 2, 512);
        let vocab = m.config.text.vocab_size;
        let toks: Vec<u32> = (0..n).map(|i| ((i * 131 + 17) % vocab) as u32).collect();
        let full = run_pieces(&mut m, &toks, toks.len(), false);
        check(&run_pieces(&mut m, &toks, 1, false), &full, vocab, TOL_RANDOM, None, &format!("{what}: eager decode vs prefill"));
        check(&run_pieces(&mut m, &toks, 1, true), &full, vocab, TOL_RANDOM, None, &format!("{what}: graph decode vs prefill"));
        check(&run_pieces(&mut m, &toks, 37, false), &full, vocab, TOL_RANDOM, None, &format!("{what}: chunks of 37 vs prefill"));
    }
}

#[test]
fn gpu_batched_equals_one_by_one() {
    let Some(dev) = device("gpu_batched_equals_one_by_one") else { return };
    let d = tempfile::tempdir().unwrap();
    let (ck, _, _) = random_cases(d.path()).pop().unwrap();
    let mut m = gpu(&ck, &dev, 4, 2048);
    let vocab = m.config.text.vocab_size;
    let toks: Vec<u32> = (0..160).map(|i| ((i * 131 + 17) % vocab) as u32).collect();
    let lens = [1usize, 70, 33];
    let prompts: Vec<&[u32]> = lens
        .iter()
        .scan(0, |o, &n| {
            *o += n;
            Some(&toks[*o - n..*o])
        })
        .collect();
    // One by one: prefill, then 5 decode tokens each.
    let mut alone = Vec::new();
    for p in &prompts {
        let mut s = m.new_sequence().unwrap();
        let mut lg = m.forward(p, &mut s, true).unwrap();
        for j in 0..5 {
            lg = m.forward(&[toks[100 + j]], &mut s, true).unwrap();
        }
        alone.push(lg);
        m.release(s);
    }
    // Packed: one prefill step for all three, then 5 batched decode steps through a graph.
    let mut ss: Vec<_> = (0..3).map(|_| m.new_sequence().unwrap()).collect();
    let all: Vec<u32> = prompts.concat();
    let mut refs: Vec<_> = ss.iter_mut().collect();
    m.forward_varlen(Input::Tokens(&all), &lens, &mut refs, true).unwrap();
    let g = m.capture_decode(3, 256).unwrap();
    let mut lg = Vec::new();
    for j in 0..5 {
        let mut refs: Vec<_> = ss.iter_mut().collect();
        lg = m.decode_step(&g, &[toks[100 + j]; 3], &mut refs).unwrap();
    }
    for (i, a) in alone.iter().enumerate() {
        check(&lg[i * vocab..(i + 1) * vocab], a, vocab, TOL_MEDIAN, None, &format!("sequence {i} (len {}) batched vs alone", lens[i]));
    }
}

/// A random checkpoint from a builtin config with `set` overrides, bf16 weights.
fn random_model(dir: &std::path::Path, base: &str, set: &[(&str, serde_json::Value)], experts: ExpertFormat) -> Checkpoint {
    let ov = Overrides { set: set.iter().map(|(k, v)| (k.to_string(), v.clone())).collect(), ..Default::default() };
    init(builtin_config(base).unwrap(), &ov, dir, &InitOptions { seed: 11, dtype: FloatDType::BF16, experts, shard_size: None }).unwrap();
    Checkpoint::open(dir).unwrap()
}

fn gpu_vs_cpu(ck: &Checkpoint, dev: &CudaDevice, n: usize, tol: f32, top1: Option<f32>, what: &str) {
    gpu_vs_cpu_kv(ck, dev, n, tol, top1, what, KvDtype::Bf16)
}

/// [`gpu_vs_cpu`] with the GPU's latent / indexer-key caches in format `kv`.
fn gpu_vs_cpu_kv(ck: &Checkpoint, dev: &CudaDevice, n: usize, tol: f32, top1: Option<f32>, what: &str, kv: KvDtype) {
    let cpu = Model::load(ck).unwrap();
    let vocab = cpu.config.text.vocab_size;
    let toks: Vec<u32> = (0..n).map(|i| ((i * 131 + 17) % vocab) as u32).collect();
    let mut st = cpu.new_state();
    let want = cpu.forward(&toks, &mut st, ForwardOpts::default(), None).unwrap();
    let mut m = CudaModel::load(ck, dev, CacheConfig { max_seqs: 2, max_tokens: n + 64, kv_cache_dtype: kv }).expect("load on GPU");
    check(&run_pieces(&mut m, &toks, n, false), &want, vocab, tol, top1, &format!("{what}: GPU prefill vs CPU"));
    // The CPU model decoding the same tokens gives the same logits as its prefill (tested
    // elsewhere); the GPU decode graph must match it too.
    check(&run_pieces(&mut m, &toks, 1, true), &want, vocab, tol, top1, &format!("{what}: GPU graph decode vs CPU"));
}

/// Random models route every token to every expert (`num_experts_per_token = num_experts`), so
/// the bf16 rounding of the GPU cannot flip a discrete expert choice: the logits then move
/// continuously with the rounding and can be held to the bf16 tolerance. (With top-k < E a
/// random model is chaotic: a near-tie flip moves one position's logits by O(1).)
fn random_cases(dir: &std::path::Path) -> Vec<(Checkpoint, usize, &'static str)> {
    let all = |e: usize| [("num_experts", json!(e)), ("num_experts_per_token", json!(e))];
    let mut hd128 = vec![
        ("linear_attn_config.head_dim", json!(128)),
        ("linear_attn_config.num_heads", json!(2)),
        ("routed_expert_hidden_size", json!(64)),
        ("moe_intermediate_size", json!(64)),
    ];
    hd128.extend(all(4));
    // index_topk above the length: the GPU indexer scores and top-k run, and keep every position
    // (selection itself is checked exactly against a full sort in k3-core's cuda_dsa tests).
    let mut dsa = vec![("linear_attn_config.head_dim", json!(32)), ("dsa_config.index_topk", json!(256))];
    dsa.extend(all(4));
    // K3's attention head dims (qk 128 + 64, v 128): a fresh prefill of >= 64 rows attends in
    // the explicit form (mla_prefill_attend), the graph decode in the absorbed one.
    let mut k3_heads = vec![
        ("linear_attn_config.head_dim", json!(32)),
        ("qk_nope_head_dim", json!(128)),
        ("qk_rope_head_dim", json!(64)),
        ("v_head_dim", json!(128)),
        ("kv_lora_rank", json!(64)),
        ("num_attention_heads", json!(3)),
        ("num_key_value_heads", json!(3)),
    ];
    k3_heads.extend(all(4));
    // A KDA head dim below a warp and an odd head count (issue 20: every configuration the CPU
    // runs, the GPU runs): the general kernel with 16 row groups of 16 channels.
    let mut hd16 = vec![("linear_attn_config.head_dim", json!(16)), ("linear_attn_config.num_heads", json!(3))];
    hd16.extend(all(4));
    vec![
        (random_model(&dir.join("hd16"), "tiny", &hd16, ExpertFormat::Float(FloatDType::BF16)), 100, "tiny, KDA hd 16, 3 heads"),
        (random_model(&dir.join("k3heads"), "tiny", &k3_heads, ExpertFormat::Float(FloatDType::BF16)), 150, "tiny, K3 head dims (explicit prefill)"),
        (random_model(&dir.join("hd128"), "tiny", &hd128, ExpertFormat::Mxfp4), 150, "tiny, KDA hd 128, MXFP4"),
        (random_model(&dir.join("dsa"), "tiny_dsa", &dsa, ExpertFormat::Float(FloatDType::BF16)), 90, "tiny_dsa, KDA hd 32, indexer + top-256"),
    ]
}

#[test]
fn random_models_gpu_equals_cpu() {
    let Some(dev) = device("random_models_gpu_equals_cpu") else { return };
    let d = tempfile::tempdir().unwrap();
    for (ck, n, what) in random_cases(d.path()) {
        gpu_vs_cpu(&ck, &dev, n, TOL_RANDOM, None, what);
    }
}

#[test]
fn k3_nano_gpu_equals_cpu() {
    let Some(dev) = device("k3_nano_gpu_equals_cpu") else { return };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    gpu_vs_cpu(&Checkpoint::open(&dir).unwrap(), &dev, 120, TOL_MEDIAN, Some(TOL_TOP1), "k3-nano");
}

/// FP8 latent and indexer-key caches (`--kv-cache-dtype fp8`) keep the logits within the bf16
/// tolerances of the BF16-cache tests above, prefill and graph decode: k3-nano (trained, MLA)
/// and the DSA model (FP8 keys scored, FP8 latents attended).
#[test]
fn fp8_caches_keep_logits_within_bf16_tolerance() {
    let Some(dev) = device("fp8_caches_keep_logits_within_bf16_tolerance") else { return };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    gpu_vs_cpu_kv(&Checkpoint::open(&dir).unwrap(), &dev, 120, TOL_MEDIAN, Some(TOL_TOP1), "k3-nano, fp8 caches", KvDtype::Fp8);
    let d = tempfile::tempdir().unwrap();
    let (ck, n, what) = random_cases(d.path()).pop().expect("the DSA case");
    gpu_vs_cpu_kv(&ck, &dev, n, TOL_RANDOM, None, &format!("{what}, fp8 caches"), KvDtype::Fp8);
}

/// Every named intermediate of one GPU prefill against the CPU model's (relative L2 per tensor
/// ≤ `tol`), so a mismatch names the first layer and sublayer that differs.
fn traces_match(ck: &Checkpoint, dev: &CudaDevice, n: usize, tol: f64, what: &str) {
    use std::collections::HashMap;
    let cpu = Model::load(ck).unwrap();
    let vocab = cpu.config.text.vocab_size;
    let toks: Vec<u32> = (0..n).map(|i| ((i * 131 + 17) % vocab) as u32).collect();
    let mut want: HashMap<String, Vec<f32>> = HashMap::new();
    let mut st = cpu.new_state();
    let mut rec = |name: &str, x: &[f32], _t: usize| {
        want.insert(name.to_string(), x.to_vec());
    };
    cpu.forward(&toks, &mut st, ForwardOpts::default(), Some(&mut rec)).unwrap();
    let mut m = gpu(ck, dev, 1, n + 64);
    let mut s = m.new_sequence().unwrap();
    let mut got: Vec<(String, Vec<f32>)> = Vec::new();
    let mut rec = |name: &str, t: &k3_core::cuda::CudaTensor| -> k3_model::Result<()> {
        got.push((name.to_string(), t.to_f32_vec()?));
        Ok(())
    };
    m.forward_traced(Input::Tokens(&toks), &[n], &mut [&mut s], false, Some(&mut rec)).unwrap();
    let mut worst: Option<(String, f64)> = None;
    for (name, g) in &got {
        let w = want.get(name).unwrap_or_else(|| panic!("{what}: the CPU trace has no {name}"));
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in g.iter().zip(w) {
            num += ((a - b) as f64).powi(2);
            den += (*b as f64).powi(2);
        }
        let e = (num / den.max(1e-30)).sqrt();
        eprintln!("{what}: {name:<20} rel L2 {e:.2e}");
        if e > tol && worst.is_none() {
            worst = Some((name.clone(), e));
        }
    }
    assert!(worst.is_none(), "{what}: first intermediate beyond {tol:.0e}: {worst:?}");
}

#[test]
fn gpu_intermediates_match_cpu() {
    let Some(dev) = device("gpu_intermediates_match_cpu") else { return };
    let d = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    // Trained k3-nano: ~4e-3 per intermediate, one MoE near-tie flip reaches 2.7e-2 (measured);
    // random models amplify smoothly to ~2.6e-2 by the fifth layer.
    let mut cases: Vec<(Checkpoint, usize, String, f64)> = random_cases(d.path()).into_iter().map(|(c, n, w)| (c, n.min(70), w.to_string(), 5e-2)).collect();
    cases.push((Checkpoint::open(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano")).unwrap(), 70, "k3-nano".into(), 4e-2));
    for (ck, n, what, tol) in &cases {
        if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| traces_match(ck, &dev, *n, *tol, what))) {
            bad.push(format!("{what}: {:?}", e.downcast_ref::<String>()));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}
