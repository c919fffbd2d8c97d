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

/// A shipped model's `crosscheck.safetensors` (its export script's PyTorch f32 logits):
/// prompts `ids_n` and logits `logits_n` at every position, or at the positions `pos_n` where
/// the file lists them. Each prompt's Rust logits must be within rel-L2 2e-5 and agree on
/// top-1 except where the reference's own top-2 margin is a float tie; at least 3 prompts.
pub fn check_crosscheck(dir: &std::path::Path, what: &str) {
    use k3_model::{ForwardOpts, Model};
    let ck = Checkpoint::open(dir).unwrap_or_else(|e| panic!("{what}: {e}"));
    let model = Model::load(&ck).unwrap();
    let vocab = model.config.text.vocab_size;
    let r = k3_model::checkpoint::open_tensors_only(&dir.join("crosscheck.safetensors")).expect("crosscheck.safetensors");
    let ints = |t: k3_core::Tensor| -> Vec<i64> { t.as_i64().unwrap().to_vec() };
    let mut n = 0;
    while let Ok(t) = r.tensor(&format!("ids_{n}")) {
        let ids: Vec<u32> = ints(t).iter().map(|&x| x as u32).collect();
        let want = ref_f32(&r, &format!("logits_{n}"));
        let mut st = model.new_state();
        let all = model.forward(&ids, &mut st, ForwardOpts::default(), None).unwrap();
        let pos: Vec<usize> = match r.tensor(&format!("pos_{n}")) {
            Ok(p) => ints(p).iter().map(|&x| x as usize).collect(),
            Err(_) => (0..ids.len()).collect(),
        };
        assert_eq!(want.len(), pos.len() * vocab, "logits_{n} is [len(pos_{n}), vocab]");
        let got: Vec<f32> = pos.iter().flat_map(|&p| all[p * vocab..(p + 1) * vocab].iter().copied()).collect();
        let c = compare(&got, &want, vocab);
        eprintln!("{what} prompt {n} ({} tokens, {} positions): {c:?}", ids.len(), pos.len());
        assert!(c.max_rel_l2 <= 2e-5, "prompt {n}: max rel-L2 {} > 2e-5", c.max_rel_l2);
        for (i, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
            let am = |x: &[f32]| x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0;
            let (ag, aw) = (am(g), am(w));
            assert!(ag == aw || (w[aw] - w[ag]).abs() < 1e-3, "prompt {n} position {}: top-1 {ag} vs reference {aw}", pos[i]);
        }
        n += 1;
    }
    assert!(n >= 3, "crosscheck.safetensors holds {n} prompts");
}
