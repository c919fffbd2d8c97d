//! Incremental inference on the golden fixtures: stepwise decode, chunked prefill (N = 1, 7,
//! 64) and prefill-64-then-decode all equal the full pass and the fixtures' own
//! `decode_logits_L160`, at the manifest tolerances.

mod common;
use common::*;
use k3_model::{Checkpoint, ForwardOpts, Model};

fn chunked(model: &Model, toks: &[u32], n: usize) -> Vec<f32> {
    let mut st = model.new_state();
    let mut out = Vec::new();
    for c in toks.chunks(n) {
        out.extend(model.forward(c, &mut st, ForwardOpts::default(), None).unwrap());
    }
    assert_eq!(st.pos, toks.len());
    out
}

fn run_fixture(name: &str) {
    let ck = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::load(&ck).unwrap();
    let r = reference(name);
    let v = model.config.text.vocab_size;
    let toks = tokens(&r, 160);
    let full = ref_f32(&r, "logits_L160");
    let dec_ref = ref_f32(&r, "decode_logits_L160");
    let dec = chunked(&model, &toks, 1);
    assert_within(&compare(&dec, &dec_ref, v), &format!("{name} decode vs decode_logits_L160"));
    assert_within(&compare(&dec, &full, v), &format!("{name} decode vs logits_L160"));
    for n in [7, 64] {
        assert_within(&compare(&chunked(&model, &toks, n), &full, v), &format!("{name} chunked:{n}"));
    }
    // Prefill 64, then decode the rest one token at a time.
    let mut st = model.new_state();
    let mut out = model.forward(&toks[..64], &mut st, ForwardOpts::default(), None).unwrap();
    for &tk in &toks[64..] {
        out.extend(model.forward(&[tk], &mut st, ForwardOpts::default(), None).unwrap());
    }
    assert_within(&compare(&out, &full, v), &format!("{name} prefill64+decode"));
}

#[test]
fn k3_small_f32_decode() {
    run_fixture("k3_small_f32");
}

#[test]
fn k31_small_dsa_f32_decode() {
    run_fixture("k31_small_dsa_f32");
}

#[test]
fn k3_small_mxfp4_decode() {
    run_fixture("k3_small_mxfp4");
}

#[test]
fn context_limit_is_checked_before_work() {
    let ck = Checkpoint::open(&fixture("k3_small_f32")).unwrap();
    let model = Model::load(&ck).unwrap();
    let mut st = model.new_state();
    st.pos = model.config.max_context();
    let e = model.forward(&[1], &mut st, ForwardOpts::default(), None).unwrap_err().to_string();
    assert!(e.contains("context limit"), "{e}");
    let e = model.forward(&[100_000], &mut model.new_state(), ForwardOpts::default(), None).unwrap_err().to_string();
    assert!(e.contains("100000") && e.contains("vocab"), "{e}");
}
