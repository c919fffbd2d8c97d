//! The three golden model fixtures (`shared/golden/{k3_small_f32, k31_small_dsa_f32,
//! k3_small_mxfp4}`), full-sequence prefill at every length, at the manifest tolerances.

mod common;
use common::*;
use k3_model::{Checkpoint, ForwardOpts, Model};

fn run_fixture(name: &str) {
    let ck = Checkpoint::open(&fixture(name)).unwrap();
    let model = Model::load(&ck).unwrap();
    let r = reference(name);
    let vocab = model.config.text.vocab_size;
    for l in [5, 40, 160] {
        let toks = tokens(&r, l);
        let mut st = model.new_state();
        let got = model.forward(&toks, &mut st, ForwardOpts::default(), None).unwrap();
        let c = compare(&got, &ref_f32(&r, &format!("logits_L{l}")), vocab);
        eprintln!("{name} L{l}: {c:?}");
        assert_within(&c, &format!("{name} L{l}"));
    }
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn k3_small_f32() {
    run_fixture("k3_small_f32");
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn k31_small_dsa_f32() {
    run_fixture("k31_small_dsa_f32");
}

#[test]
fn k3_small_mxfp4() {
    run_fixture("k3_small_mxfp4");
}
