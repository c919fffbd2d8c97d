//! Cross-check of the shipped k3-chat model (`models/k3-chat`, or `$K3_CHAT_MODEL_DIR`): the Rust
//! engine must reproduce the PyTorch training code's f32 logits stored in
//! `crosscheck.safetensors` (made by `tools/k3chat/export.py` from the exported bf16 weights, in
//! f32 on CPU with the naive KDA recurrence). Each entry holds a chat prompt rendered as the
//! server renders it plus the model's greedy continuation (`ids_i`), and the logits at its last
//! positions only (`pos_i`, `logits_i`), which keeps the file small.

mod common;
use common::*;
use k3_model::{Checkpoint, ForwardOpts, Model};
use std::path::PathBuf;

fn chat_dir() -> PathBuf {
    match std::env::var_os("K3_CHAT_MODEL_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-chat"),
    }
}

#[test]
fn chat_crosscheck() {
    let dir = chat_dir();
    let ck = Checkpoint::open(&dir).expect("models/k3-chat");
    let model = Model::load(&ck).unwrap();
    let vocab = model.config.text.vocab_size;
    let r = k3_model::checkpoint::open_tensors_only(&dir.join("crosscheck.safetensors")).expect("crosscheck.safetensors");
    let ints = |name: &str| -> Vec<i64> { r.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}")).as_i64().unwrap().to_vec() };
    let mut n = 0;
    while r.tensor(&format!("ids_{n}")).is_ok() {
        let ids: Vec<u32> = ints(&format!("ids_{n}")).iter().map(|&x| x as u32).collect();
        let pos: Vec<usize> = ints(&format!("pos_{n}")).iter().map(|&x| x as usize).collect();
        let want = ref_f32(&r, &format!("logits_{n}"));
        assert_eq!(want.len(), pos.len() * vocab, "logits_{n} is [len(pos_{n}), vocab]");
        let mut st = model.new_state();
        let all = model.forward(&ids, &mut st, ForwardOpts::default(), None).unwrap();
        let got: Vec<f32> = pos.iter().flat_map(|&p| all[p * vocab..(p + 1) * vocab].iter().copied()).collect();
        let c = compare(&got, &want, vocab);
        eprintln!("k3-chat prompt {n} ({} tokens, {} positions): {c:?}", ids.len(), pos.len());
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
