//! Sharded = unsharded: the CPU model split by the plan (`parallel.rs`) over tensor, expert and
//! pipeline parallel ranks (threads over in-process groups) gives the logits of the one-rank
//! model, for a full prefill, a chunked prefill followed by decode steps, and a batch of two
//! sequences — and every intermediate a rank traces (`blk.L.kda.out`, `blk.L.ffn_in`, …) equals
//! the one-rank trace of the same name. f32 throughout: the only differences are the order of
//! the sums that a split reorders, so the bound is per-position relative L2 ≤ 1e-5.
//! Cases: the golden fixtures (K3, K3.1 DSA, MXFP4 experts; 3 heads, 6 experts, so most splits
//! are uneven) and `k3 init` checkpoints of the tiny configs in the release format.

mod common;

use std::path::Path;

use common::*;
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::parallel::{on_threads, Parallel};
use k3_model::{Checkpoint, ForwardOpts, Model, Result};

/// What one rank computes: full-prefill logits, chunked-prefill-then-decode logits, the logits
/// of a batch of two sequences, and the trace of the full prefill.
struct Run {
    full: Vec<f32>,
    stepped: Vec<f32>,
    batch: Vec<Vec<f32>>,
    trace: Vec<(String, Vec<f32>, usize)>,
}

fn scenario(m: &Model, toks: &[u32], chunk: usize) -> Result<Run> {
    let opts = ForwardOpts::default();
    let mut trace = Vec::new();
    let mut st = m.new_state();
    let mut rec = |name: &str, x: &[f32], t: usize| trace.push((name.to_string(), x.to_vec(), t));
    let full = m.forward(toks, &mut st, opts, Some(&mut rec))?;
    let mut st = m.new_state();
    let mut stepped = m.forward(&toks[..chunk], &mut st, opts, None)?;
    for &tk in &toks[chunk..] {
        stepped.extend(m.forward(&[tk], &mut st, opts, None)?);
    }
    let (a, b) = (&toks[..toks.len() / 2], &toks[3..toks.len() - 1]);
    let (mut sa, mut sb) = (m.new_state(), m.new_state());
    let batch = m.forward_batch(&[a, b], &mut [&mut sa, &mut sb], opts)?;
    Ok(Run { full, stepped, batch, trace })
}

fn rel_l2_rows(got: &[f32], want: &[f32], width: usize) -> f32 {
    max_rel_l2(got, want, width) as f32
}

/// Logits: the bound the issue sets for f32 (per position).
const BOUND: f32 = 1e-5;
/// Intermediates: the MoE output is the up-projection of the RMSNorm of `r = Σ w·y`, and where
/// the expert terms nearly cancel the norm enlarges the reordering error of the sum (seen up
/// to 1.2e-5 on MXFP4 experts); the logits after them still meet [`BOUND`].
const TRACE_BOUND: f32 = 1e-4;

/// Runs `layouts` on the checkpoint at `dir` and checks each against the one-rank model.
fn check_layouts(dir: &Path, toks: &[u32], chunk: usize, layouts: &[(usize, Option<usize>, usize)]) {
    let ck = Checkpoint::open(dir).unwrap();
    let single = scenario(&Model::load(&ck).unwrap(), toks, chunk).unwrap();
    let v = ck.config.text.vocab_size;
    for &(tp, ep, pp) in layouts {
        let par = Parallel::new(tp, ep, pp).unwrap();
        let what = format!("{} --tp {tp} --ep {} --pp {pp}", dir.display(), par.ep);
        let runs = on_threads(&ck, par, |m| scenario(m, toks, chunk)).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(runs.len(), par.world());
        for (r, run) in runs.iter().enumerate() {
            let plan = par.rank(&ck.config, r).unwrap();
            if r == 0 || plan.last_stage() {
                let e = rel_l2_rows(&run.full, &single.full, v);
                assert!(e <= BOUND, "{what} rank {r}: full prefill rel-L2 {e}");
                let e = rel_l2_rows(&run.stepped, &single.stepped, v);
                assert!(e <= BOUND, "{what} rank {r}: prefill {chunk} + decode rel-L2 {e}");
                for (i, (g, w)) in run.batch.iter().zip(&single.batch).enumerate() {
                    let e = rel_l2_rows(g, w, v);
                    assert!(e <= BOUND, "{what} rank {r}: batch sequence {i} rel-L2 {e}");
                }
                assert_eq!(compare(&run.full, &single.full, v).top1, 1.0, "{what} rank {r}: greedy tokens differ");
            } else {
                assert!(run.full.is_empty() && run.stepped.is_empty(), "{what} rank {r}: a rank that neither samples nor holds the head returned logits");
            }
            // Every trace of this rank equals the one-rank trace of that name.
            for (name, x, t) in &run.trace {
                let (_, want, _) =
                    single.trace.iter().find(|(n, _, _)| n == name).unwrap_or_else(|| panic!("{what} rank {r}: trace {name} has no one-rank twin"));
                let e = rel_l2_rows(x, want, x.len() / t);
                assert!(e <= TRACE_BOUND, "{what} rank {r}: trace {name} rel-L2 {e}");
            }
        }
        // Together the stages trace every name of the one-rank model.
        for (name, _, _) in &single.trace {
            assert!(runs.iter().any(|run| run.trace.iter().any(|(n, _, _)| n == name)), "{what}: no rank traced {name}");
        }
    }
}

/// TP, EP and PP alone and mixed; uneven splits where the fixture's counts do not divide.
const LAYOUTS: &[(usize, Option<usize>, usize)] = &[
    (2, None, 1),    // TP2 = EP2 over the same two ranks
    (4, None, 1),    // 3 heads over 4 ranks: one rank holds no attention head
    (2, Some(1), 1), // TP2, each expert's intermediate dim split
    (1, Some(2), 1), // attention replicated, experts whole on their owner
    (1, Some(4), 1),
    (1, Some(8), 1), // 6 experts over 8 ranks: two ranks own none
    (1, None, 2),    // PP2: the residual state crosses a stage
    (2, None, 2),
    (1, Some(2), 3),
];

fn golden(name: &str) {
    let r = reference(name);
    let toks = tokens(&r, 40);
    check_layouts(&fixture(name), &toks, 16, LAYOUTS);
    // And the sharded model still meets the fixture itself at the manifest tolerance.
    let ck = Checkpoint::open(&fixture(name)).unwrap();
    let want = ref_f32(&r, "logits_L40");
    let runs = on_threads(&ck, Parallel::new(2, None, 2).unwrap(), |m| scenario(m, &toks, 16)).unwrap();
    assert_within(&compare(&runs[0].full, &want, ck.config.text.vocab_size), &format!("{name} TP2×PP2 vs logits_L40"));
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_k3_small_f32() {
    golden("k3_small_f32");
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn golden_k31_small_dsa_f32() {
    golden("k31_small_dsa_f32");
}

#[test]
fn golden_k3_small_mxfp4() {
    golden("k3_small_mxfp4");
}

/// Real-format checkpoints of the tiny configs (4 heads, 8 experts, 2 shared experts, AttnRes
/// blocks of 2), F32 weights with F32 or MXFP4 experts, sharded over two files.
fn tiny(config: &str, experts: ExpertFormat, dsa_topk: Option<usize>) {
    let dir = tempfile::tempdir().unwrap();
    let mut ov = Overrides::default();
    if let Some(k) = dsa_topk {
        // A small top-k so that the 40-token run really selects.
        ov.set.push(("dsa_config.index_topk".into(), serde_json::json!(k)));
    }
    let opts = InitOptions { seed: 11, dtype: FloatDType::F32, experts, shard_size: Some(400_000) };
    init(k3_model::config::builtin_config(config).unwrap(), &ov, dir.path(), &opts).unwrap();
    let toks: Vec<u32> = (0..40).map(|i| (i * 53 + 7) % 256).collect();
    let layouts: &[(usize, Option<usize>, usize)] = &[(2, None, 1), (4, None, 1), (4, Some(1), 1), (1, Some(8), 1), (2, None, 2), (1, None, 5)];
    check_layouts(dir.path(), &toks, 9, layouts);
}

#[test]
fn tiny_f32_experts() {
    tiny("tiny", ExpertFormat::Float(FloatDType::F32), None);
}

#[test]
fn tiny_mxfp4_experts() {
    tiny("tiny", ExpertFormat::Mxfp4, None);
}

#[test]
fn tiny_dsa() {
    tiny("tiny_dsa", ExpertFormat::Float(FloatDType::F32), Some(6));
}

#[test]
fn bad_layouts_are_refused_with_the_fix() {
    let e = Parallel::new(2, Some(4), 1).unwrap_err().to_string();
    assert!(e.contains("--tp 4 --ep 4"), "{e}");
    let e = Parallel::new(0, None, 1).unwrap_err().to_string();
    assert!(e.contains("--tp 0"), "{e}");
    let ck = Checkpoint::open(&fixture("k3_small_mxfp4")).unwrap();
    let e = Parallel::new(1, None, 7).unwrap().check(&ck.config).unwrap_err().to_string();
    assert!(e.contains("only 6 decoder layers"), "{e}");
}

#[test]
fn a_failing_rank_stops_every_rank_with_its_own_error() {
    let ck = Checkpoint::open(&fixture("k3_small_mxfp4")).unwrap();
    let t0 = std::time::Instant::now();
    // Rank 1 feeds a token outside the vocabulary; rank 0 waits in the embedding's sum.
    let e = on_threads(&ck, Parallel::new(2, None, 1).unwrap(), |m| {
        let tok = if m.plan.rank == 1 { 100_000 } else { 1 };
        m.forward(&[tok], &mut m.new_state(), ForwardOpts::default(), None)
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("token id 100000"), "{e}");
    assert!(t0.elapsed().as_secs() < 60, "the failure took {:?}", t0.elapsed());
}
