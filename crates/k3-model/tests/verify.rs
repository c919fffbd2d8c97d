//! Speculative verification (`verify.rs`, issue 22) is exact on the CPU: verifying `k` drafts
//! after a prefill gives, for every position, the bit-identical logits of the single decode
//! step at that position, and rolling back to `j` accepted tokens leaves the state bytes of
//! `j + 1` decode steps — for k = 1..8, every j, alone and with several sequences (and a plain
//! decode row) in one call. Models: the golden K3 MXFP4 fixture, and `k3 init` checkpoints of
//! the tiny configs (F32, BF16 weights, MXFP4 experts, K3.1 DSA with a top-k small enough to
//! select; the K3 / K3.1 DSA f32 golden fixtures as ignored full-golden tests), also with bf16
//! KDA states. The reference is what the engine does without
//! speculation: a chunked (`Auto`) prefill, then one-token forwards.

mod common;

use common::*;
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::kda::StateDType;
use k3_model::{Checkpoint, ForwardOpts, Model, SeqState};

const K: usize = 8;

fn toks(n: usize, seed: u32, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 53 + seed * 97 + 7) % vocab).collect()
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The decode reference after `prompt`: logits `[K+1][vocab]` of feeding `next` one at a time,
/// and the state bytes after each.
fn reference(m: &Model, prefilled: &SeqState, next: &[u32]) -> (Vec<Vec<f32>>, Vec<Vec<u8>>) {
    let mut st = prefilled.clone();
    let (mut lg, mut bytes) = (Vec::new(), Vec::new());
    for &t in next {
        lg.push(m.forward(&[t], &mut st, ForwardOpts::default(), None).unwrap());
        bytes.push(st.to_bytes());
    }
    (lg, bytes)
}

fn check_model(m: &Model, what: &str, kda: StateDType) {
    let v = m.config.text.vocab_size;
    let vocab = v as u32;
    // Three sequences with prompts of different lengths (the DSA top-k must select).
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| toks(11 + 5 * i, i as u32, vocab)).collect();
    let nexts: Vec<Vec<u32>> = (0..3).map(|i| toks(K + 1, 40 + i as u32, vocab)).collect();
    let mut pre = Vec::new();
    let mut refs = Vec::new();
    for (p, nx) in prompts.iter().zip(&nexts) {
        let mut st = m.new_state_with(kda);
        m.forward(p, &mut st, ForwardOpts::default(), None).unwrap();
        refs.push(reference(m, &st, nx));
        pre.push(st);
    }
    // One sequence at a time, every k and every accepted count j.
    for k in 1..=K {
        let (lg, bytes) = &refs[0];
        let mut st = pre[0].clone();
        let emb = m.embed(&nexts[0][..=k]).unwrap();
        let out = m.forward_verify(emb, &[k + 1], &mut [&mut st]).unwrap();
        for i in 0..=k {
            assert!(bits_eq(&out[i * v..(i + 1) * v], &lg[i]), "{what}: k={k}: logits of position {i} differ from its decode step");
        }
        for j in 0..=k {
            let mut s = st.clone();
            s.rollback(k - j).unwrap();
            assert!(s.to_bytes() == bytes[j], "{what}: k={k}, rolled back to {j} accepted: state differs from {} decode steps", j + 1);
            assert_eq!(s.pos, prompts[0].len() + j + 1);
            // The rolled-back state decodes on exactly like the reference.
            if j < k {
                let lg2 = m.forward(&[nexts[0][j + 1]], &mut s, ForwardOpts::default(), None).unwrap();
                assert!(bits_eq(&lg2, &lg[j + 1]), "{what}: k={k}, j={j}: the next decode step after the rollback differs");
            }
        }
        // Only the last call's snapshots exist: dropping more is refused, nothing changes.
        let mut s = st.clone();
        assert!(s.rollback(k + 1).is_err());
        assert!(s.to_bytes() == st.to_bytes());
    }
    // A batch: k = 3, a plain decode row, k = 8 — each row equals its own decode step.
    let ks = [3usize, 0, 8];
    let mut states: Vec<SeqState> = pre.clone();
    let all: Vec<u32> = ks.iter().zip(&nexts).flat_map(|(&k, nx)| nx[..=k].to_vec()).collect();
    let lens: Vec<usize> = ks.iter().map(|k| k + 1).collect();
    let out = {
        let mut refs_mut: Vec<&mut SeqState> = states.iter_mut().collect();
        m.forward_verify(m.embed(&all).unwrap(), &lens, &mut refs_mut).unwrap()
    };
    let mut row = 0;
    for (s, &k) in ks.iter().enumerate() {
        for i in 0..=k {
            assert!(bits_eq(&out[row * v..(row + 1) * v], &refs[s].0[i]), "{what}: batch: sequence {s} position {i} differs");
            row += 1;
        }
        let j = k / 2;
        states[s].rollback(k - j).unwrap();
        assert!(states[s].to_bytes() == refs[s].1[j], "{what}: batch: sequence {s} rolled back to {j}");
    }
}

fn tiny(config: &str, dtype: FloatDType, experts: ExpertFormat, topk: Option<usize>) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let mut ov = Overrides::default();
    if let Some(k) = topk {
        ov.set.push(("dsa_config.index_topk".into(), serde_json::json!(k)));
    }
    init(k3_model::config::builtin_config(config).unwrap(), &ov, dir.path(), &InitOptions { seed: 5, dtype, experts, shard_size: None }).unwrap();
    let m = Model::load(&Checkpoint::open(dir.path()).unwrap()).unwrap();
    (dir, m)
}

#[test]
fn golden_k3_small_mxfp4() {
    let m = Model::load(&Checkpoint::open(&fixture("k3_small_mxfp4")).unwrap()).unwrap();
    check_model(&m, "k3_small_mxfp4", StateDType::F32);
    check_model(&m, "k3_small_mxfp4, bf16 KDA state", StateDType::Bf16);
}

#[test]
fn tiny_f32() {
    let (_d, m) = tiny("tiny", FloatDType::F32, ExpertFormat::Float(FloatDType::F32), None);
    check_model(&m, "tiny f32", StateDType::F32);
}

#[test]
fn tiny_bf16_mxfp4_experts() {
    let (_d, m) = tiny("tiny", FloatDType::BF16, ExpertFormat::Mxfp4, None);
    check_model(&m, "tiny bf16 + mxfp4", StateDType::F32);
}

#[test]
fn tiny_dsa_selecting() {
    let (_d, m) = tiny("tiny_dsa", FloatDType::F32, ExpertFormat::Float(FloatDType::F32), Some(6));
    check_model(&m, "tiny_dsa top-6", StateDType::F32);
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_f32_k3_and_k31_dsa() {
    for name in ["k3_small_f32", "k31_small_dsa_f32"] {
        let m = Model::load(&Checkpoint::open(&fixture(name)).unwrap()).unwrap();
        check_model(&m, name, StateDType::F32);
    }
}
