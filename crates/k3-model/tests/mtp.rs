//! The MTP draft layer (around-backbone §5.1; `layers/mtp.rs`, `draft.rs`) on `k3 init`
//! checkpoints of the tiny configs with `num_nextn_predict_layers = 1` (random weights):
//!
//! - the config and tensor table: K3 keeps 0 MTP layers; a declared one adds `layers.N.*`
//!   (`enorm`, `hnorm`, `eh_proj` `[H, 2H]`, MLA + FFN without AttnRes, `shared_head.*`);
//! - the drafts' logits — after a prefill in two chunks, chained for 4 positions, and again after
//!   a verify step rolled back — against `tests/support/mtp_ref.rs`, an f64 plain-loop reference
//!   of §5.1 fed the target's pre-final-norm hidden rows;
//! - verify `k` then roll back to `j` = `j + 1` decode steps, state bytes equal with the draft
//!   layer's cache and hidden row, and the drafts after both bit-identical.
//!
//! (Load errors — a missing MTP tensor named, MTP tensors without the config — are in
//! `tests/checkpoint.rs`.)

mod common;

use common::max_abs;
use k3_core::kernels::cpu::matmul::with_row_exact;
use k3_model::config::builtin_config;
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::mtp::MtpState;
use k3_model::weights::{tensor_table, Component};
use k3_model::{Checkpoint, Config, ForwardOpts, Model, SeqState};

#[path = "../../../tests/support/mtp_ref.rs"]
mod mtp_ref;
use mtp_ref::MtpRef;

fn mtp_model(config: &str, vocab: Option<usize>) -> (tempfile::TempDir, Checkpoint, Model) {
    let dir = tempfile::tempdir().unwrap();
    let mut ov = Overrides::default();
    ov.set.push(("num_nextn_predict_layers".into(), serde_json::json!(1)));
    if let Some(v) = vocab {
        ov.set.push(("vocab_size".into(), serde_json::json!(v)));
    }
    let f = FloatDType::F32;
    init(builtin_config(config).unwrap(), &ov, dir.path(), &InitOptions { seed: 11, dtype: f, experts: ExpertFormat::Float(f), shard_size: None }).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let m = Model::load(&ck).unwrap();
    (dir, ck, m)
}

fn state(m: &Model) -> SeqState {
    let mut st = m.new_state();
    st.mtp = Some(MtpState::new(m.config.text.hidden_size));
    st
}

/// A plain forward of `toks`, then the draft layer takes its rows (what the runner does).
fn step(m: &Model, st: &mut SeqState, toks: &[u32]) -> Vec<f32> {
    let lg = m.forward(toks, st, ForwardOpts::default(), None).unwrap();
    m.mtp_advance(&[toks], &mut [st]).unwrap();
    lg
}

/// Greedy chained drafts of `st` after `next`: the tokens and each position's logits.
fn drafts(m: &Model, st: &mut SeqState, next: u32, k: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (mut toks, mut lgs) = (Vec::new(), Vec::new());
    let n = m
        .mtp_draft(st, next, k, &mut |lg: &[f32]| {
            let d = lg.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32;
            lgs.push(lg.to_vec());
            toks.push(d);
            Some(d)
        })
        .unwrap();
    assert_eq!(n, k);
    (toks, lgs)
}

/// The target's pre-final-norm hidden rows of `toks` (one fresh forward), as f64.
fn hidden(m: &Model, toks: &[u32]) -> Vec<Vec<f64>> {
    let mut st = state(m);
    m.forward(toks, &mut st, ForwardOpts::default(), None).unwrap();
    let mt = st.mtp.unwrap();
    assert_eq!(mt.hidden_from, 0);
    mt.hidden.chunks_exact(m.config.text.hidden_size).map(|r| r.iter().map(|&x| x as f64).collect()).collect()
}

/// The drafts' logits against the reference for the context `ctx` (its last token is `next`).
fn check_against_reference(m: &Model, r: &MtpRef, ctx: &[u32], toks: &[u32], lgs: &[Vec<f32>], what: &str) {
    let want = r.draft_logits(ctx, &hidden(m, &ctx[..ctx.len() - 1]), toks);
    assert_eq!(want.len(), lgs.len());
    for (i, (g, w)) in lgs.iter().zip(&want).enumerate() {
        let w32: Vec<f32> = w.iter().map(|&x| x as f32).collect();
        let scale = w32.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = max_abs(g, &w32);
        assert!(d <= 5e-5 * scale.max(1.0), "{what}: draft position {i}: max |Δ| {d:.3e} against the reference (logits up to {scale:.2})");
    }
}

#[test]
fn config_and_table() {
    let k3 = Config::from_json(builtin_config("k3").unwrap()).unwrap();
    assert_eq!(k3.mtp_layers(), 0);
    assert!(tensor_table(&k3).iter().all(|s| s.component != Component::Mtp && !s.name.contains("layers.93.")));
    let mut v = builtin_config("tiny").unwrap();
    v["text_config"]["num_nextn_predict_layers"] = serde_json::json!(1);
    let cfg = Config::from_json(v).unwrap();
    let (h, n) = (cfg.text.hidden_size, cfg.text.num_hidden_layers);
    let mtp: Vec<_> = tensor_table(&cfg).into_iter().filter(|s| s.component == Component::Mtp).collect();
    let p = format!("language_model.model.layers.{n}.");
    let shape = |s: &str| mtp.iter().find(|t| t.name == format!("{p}{s}")).map(|t| t.shape.clone());
    assert_eq!(shape("eh_proj.weight"), Some(vec![h, 2 * h]));
    for s in ["enorm.weight", "hnorm.weight", "shared_head.norm.weight"] {
        assert_eq!(shape(s), Some(vec![h]), "{s}");
    }
    assert_eq!(shape("shared_head.head.weight"), Some(vec![cfg.text.vocab_size, h]));
    assert!(shape("self_attn.kv_b_proj.weight").is_some() && shape("block_sparse_moe.gate.weight").is_some());
    assert!(mtp.iter().all(|s| s.name.starts_with(&p) && !s.name.contains("_res_")), "no AttnRes in the MTP layer");
}

/// Prefill in two chunks, 4 chained drafts; then a verify step of `[next, d1..d4]` rolled back to
/// 2 accepted drafts, and 4 drafts again — each position's logits against the reference.
fn drafts_match_reference(config: &str) {
    let (_d, ck, m) = mtp_model(config, None);
    let r = MtpRef::load(&ck);
    let v = m.config.text.vocab_size as u32;
    let prompt: Vec<u32> = (0..13u32).map(|i| (i * 37 + 5) % v).collect();
    let mut st = state(&m);
    step(&m, &mut st, &prompt[..7]);
    step(&m, &mut st, &prompt[7..]);
    let next = 17 % v;
    let (toks, lgs) = drafts(&m, &mut st, next, 4);
    assert_eq!(st.mtp.as_ref().unwrap().rows, prompt.len() - 1, "the chained rows are dropped after drafting");
    let ctx: Vec<u32> = prompt.iter().copied().chain([next]).collect();
    check_against_reference(&m, &r, &ctx, &toks, &lgs, &format!("{config}: after the prefill"));
    // Verify [next, d1..d4], keep next, d1, d2 (roll back 2), then the target's token.
    let ver: Vec<u32> = [next].iter().chain(&toks).copied().collect();
    m.forward_verify(m.embed(&ver).unwrap(), &[ver.len()], &mut [&mut st]).unwrap();
    with_row_exact(true, || m.mtp_advance(&[&ver], &mut [&mut st])).unwrap();
    st.rollback(2).unwrap();
    let next2 = 29 % v;
    let (toks2, lgs2) = drafts(&m, &mut st, next2, 4);
    let ctx2: Vec<u32> = ctx.iter().chain(&toks[..2]).copied().chain([next2]).collect();
    check_against_reference(&m, &r, &ctx2, &toks2, &lgs2, &format!("{config}: after a verify step rolled back"));
}

#[test]
fn drafts_match_reference_tiny() {
    drafts_match_reference("tiny");
}

/// A K3.1-style config: the MTP layer is plain MLA (no DSA indexer) beside DSA layers.
#[test]
fn drafts_match_reference_tiny_dsa() {
    drafts_match_reference("tiny_dsa");
}

/// Verify k = 1..4 drafts, roll back to every j: the state bytes (the draft layer's cache and
/// hidden row included) equal those after j + 1 decode steps, and so do the next drafts.
#[test]
fn rollback_equals_decode_steps() {
    let (_d, _ck, m) = mtp_model("tiny", None);
    let v = m.config.text.vocab_size as u32;
    let prompt: Vec<u32> = (0..11u32).map(|i| (i * 53 + 7) % v).collect();
    let next: Vec<u32> = (0..5u32).map(|i| (i * 31 + 3) % v).collect();
    let mut pre = state(&m);
    step(&m, &mut pre, &prompt);
    let mut refs = Vec::new(); // (state bytes, next drafts' logits) after 1..=5 decode steps
    let mut st = pre.clone();
    for (i, &t) in next.iter().enumerate() {
        step(&m, &mut st, &[t]);
        let mut s2 = st.clone();
        refs.push((st.to_bytes(), drafts(&m, &mut s2, next.get(i + 1).copied().unwrap_or(1), 3).1));
    }
    for k in 1..=4 {
        for (j, (bytes, lgs)) in refs.iter().enumerate().take(k + 1) {
            let mut s = pre.clone();
            m.forward_verify(m.embed(&next[..=k]).unwrap(), &[k + 1], &mut [&mut s]).unwrap();
            with_row_exact(true, || m.mtp_advance(&[&next[..=k]], &mut [&mut s])).unwrap();
            s.rollback(k - j).unwrap();
            assert!(s.to_bytes() == *bytes, "k={k}, rolled back to {j}: state differs from {} decode steps", j + 1);
            let lg = drafts(&m, &mut s, next.get(j + 1).copied().unwrap_or(1), 3).1;
            assert!(lg.iter().flatten().map(|x| x.to_bits()).eq(lgs.iter().flatten().map(|x| x.to_bits())), "k={k}, j={j}: drafts differ");
        }
    }
}
