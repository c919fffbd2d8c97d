//! Cross-check of the shipped k3-nano model (`models/k3-nano`): the Rust engine must reproduce
//! the PyTorch training code's f32 logits stored in `crosscheck.safetensors` (made by
//! `tools/k3nano/export.py` from the exported bf16 weights, computed in f32 on CPU with the
//! naive KDA recurrence). This proves the two implementations agree on real trained weights.

mod common;
use common::*;
use k3_model::{Checkpoint, ForwardOpts, Model};
use std::path::PathBuf;

fn nano_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano")
}

#[test]
fn nano_crosscheck() {
    let dir = nano_dir();
    let ck = Checkpoint::open(&dir).expect("models/k3-nano");
    let model = Model::load(&ck).unwrap();
    let vocab = model.config.text.vocab_size;
    let r = k3_model::checkpoint::open_tensors_only(&dir.join("crosscheck.safetensors")).expect("crosscheck.safetensors");
    let mut n = 0;
    while let Ok(t) = r.tensor(&format!("ids_{n}")) {
        let ids: Vec<u32> = t.as_i64().unwrap().iter().map(|&x| x as u32).collect();
        let want = ref_f32(&r, &format!("logits_{n}"));
        let mut st = model.new_state();
        let all = model.forward(&ids, &mut st, ForwardOpts::default(), None).unwrap();
        // `pos_n` (long prompts): the positions whose logits are stored; else every position
        let pos: Vec<usize> = match r.tensor(&format!("pos_{n}")) {
            Ok(p) => p.as_i64().unwrap().iter().map(|&x| x as usize).collect(),
            Err(_) => (0..ids.len()).collect(),
        };
        assert_eq!(want.len(), pos.len() * vocab, "logits_{n} is [len(pos_{n}), vocab]");
        let got: Vec<f32> = pos.iter().flat_map(|&p| all[p * vocab..(p + 1) * vocab].iter().copied()).collect();
        let c = compare(&got, &want, vocab);
        eprintln!("k3-nano prompt {n} ({} tokens, {} positions): {c:?}", ids.len(), pos.len());
        assert!(c.max_rel_l2 <= 2e-5, "prompt {n}: max rel-L2 {} > 2e-5", c.max_rel_l2);
        // top-1 must agree except where the reference's own top-2 margin is a float tie
        for (i, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
            let am = |x: &[f32]| x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0;
            let (ag, aw) = (am(g), am(w));
            assert!(ag == aw || (w[aw] - w[ag]).abs() < 1e-3, "prompt {n} position {}: top-1 {ag} vs reference {aw}", pos[i]);
        }
        n += 1;
    }
    assert!(n >= 3, "crosscheck.safetensors holds {n} prompts");
}
