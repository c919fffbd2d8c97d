//! Speculative verification on the GPU (`k3_model::cuda` `verify.rs`, issue 22): the verify step
//! and its rollback against the plain paths they stand for.
//!
//! For each model, after a 300-token prompt, a verify step of 6 drafted rows is rolled back to
//! keep j = 1, 3, 6 of them; then one more token is decoded. Checked, relative L2 per logits row:
//! - every verify row against the single decode step at its position (`decode`);
//! - the kept rows against a cold prefill of exactly those j rows, and the next token after the
//!   rollback against the next token after that cold prefill (`after`): the rolled-back state is
//!   the state of j rows;
//! - a mutant that moves `pos` back without restoring the KDA state (what a rollback that only
//!   truncated the latent caches would do) must land far outside the bound, so the check can fail;
//! - the errors: a rollback without a verify, twice, or of every row.
//!
//! Captured verify steps (`graph.rs`, a graph of 2 sequences × 5 rows) in three rounds — rows
//! [5, 5], [5, 2] and [1, 3], so sequences are padded, rolled back by [2, 0], [1, 0], [0, 2] —
//! against three twins primed alike: the same step run eagerly (`VerifyRun::Eager`: every
//! logits row, every position and the next token after the rounds bit for bit), the plain eager
//! verify (`forward_verify`, rows within the bound: padding and table width change the GEMM
//! shapes and the attention splits), and a cold prefill of each sequence's kept tokens (the next
//! token within the bound: the padding rows were undone). A step above the MoE's capturable cut
//! is refused with the reason.
//!
//! Rollback graphs (`RollbackRun`): from the same state, each round's verify step replayed from
//! a graph of 3 sequences × 5 rows and rolled back three ways — the per-sequence eager rollback
//! (the reference), the batched body run eagerly, and its rollback graph replayed — must leave
//! both KDA pools whole (every slot: conv tails and states) and the positions bit for bit alike,
//! and so the next token's logits. Rounds keep 1, all (a no-op), 3; a sequence left out of the
//! call, a padded one keeping 1, a padded one keeping all its own rows; 1-row sequences; the
//! step's sequences sit in slots other than their index in the step (an idle sequence holds slot
//! 0), so a restore into the wrong slot shows. The batched body after an eager `forward_verify`
//! of uneven rows equals the reference too; a replay of the rollback graph after a step that was
//! not that graph's replay is refused.
//!
//! Models: random K3-layout checkpoints with every expert routed (KDA head dim 32; BF16 and FP8
//! caches; K3.1 with DSA, indexer top-64 of ~300 keys) and k3-nano (trained; its GPU forward differs from run
//! to run by up to ~7e-3 per row). Bounds: 2e-2 (BF16 caches), 4e-2 (FP8): a verify row comes
//! from the chunked KDA form and multi-row GEMMs, a decode row from the recurrent step and the
//! GEMV, so they agree to BF16 rounding only. That rounding can flip the DSA selection where
//! two keys nearly tie at the top-k boundary: with top-8 one verify row of six stood 6.2e-2 from
//! its decode step (the others ≤ 1.2e-2), so the DSA model selects 64, where one flipped key
//! moves a row far less; the engine test `cuda_spec` runs top-8 for tokens. Without a GPU the test prints `skipped` and
//! passes; `K3_REQUIRE_CUDA=1` makes that a failure.
#![cfg(feature = "cuda")]

#[path = "../../../tests/support/cuda.rs"]
mod cuda;
#[path = "../../../tests/support/random_model.rs"]
mod random_model;

use cuda::{device, say};
use k3_model::capacity::KvDtype;
use k3_model::cuda::{CacheConfig, CudaModel, CudaSeqState, Input, RollbackRun, VerifyRun};
use k3_model::Checkpoint;
use random_model::random;
use serde_json::json;

/// The seed of the random checkpoints.
const SEED: u64 = 22;

const PROMPT: usize = 300;
const DRAFT: usize = 6;

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

fn rows_rel(a: &[f32], b: &[f32], vocab: usize) -> Vec<f64> {
    a.chunks_exact(vocab).zip(b.chunks_exact(vocab)).map(|(x, y)| rel(x, y)).collect()
}

fn max_rel(a: &[f32], b: &[f32], vocab: usize) -> f64 {
    rows_rel(a, b, vocab).into_iter().fold(0.0, f64::max)
}

/// A new sequence with the prompt prefilled.
fn primed(m: &mut CudaModel, prompt: &[u32]) -> CudaSeqState {
    let mut s = m.new_sequence().unwrap();
    m.forward(prompt, &mut s, true).unwrap();
    s
}

fn check(name: &str, ck: &Checkpoint, kv: KvDtype, bound: f64) {
    let dev = device("cuda_verify").unwrap();
    let mut m = CudaModel::load(ck, &dev, CacheConfig { max_seqs: 4, max_tokens: 4096, kv_cache_dtype: kv }).unwrap();
    let vocab = m.config.text.vocab_size;
    let v = vocab as u32;
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7919 + 13) % v).collect();
    let draft: Vec<u32> = (0..DRAFT as u32).map(|i| (i * 104_729 + 5) % v).collect();
    let next = [(v / 3) | 1];
    // Single decode steps over the draft: the rows a verify step stands for.
    let mut s = primed(&mut m, &prompt);
    let mut decode = Vec::new();
    for &t in &draft {
        decode.extend(m.forward(&[t], &mut s, true).unwrap());
    }
    m.release(s);
    for keep in [1, 3, DRAFT] {
        let mut s = primed(&mut m, &prompt);
        let rows = m.forward_verify(Input::Tokens(&draft), &[DRAFT], &mut [&mut s]).unwrap();
        assert_eq!(rows.len(), DRAFT * vocab);
        let per_row = rows_rel(&rows, &decode, vocab);
        let d = per_row.iter().copied().fold(0.0, f64::max);
        m.rollback(&mut [(&mut s, DRAFT - keep)]).unwrap();
        assert_eq!(s.pos, PROMPT + keep);
        let after = m.forward(&next, &mut s, true).unwrap();
        // Cold: exactly the kept rows, then the same next token.
        let mut c = primed(&mut m, &prompt);
        let cold_rows = m.forward(&draft[..keep], &mut c, false).unwrap();
        let cold_after = m.forward(&next, &mut c, true).unwrap();
        let (k, a) = (max_rel(&rows[..keep * vocab], &cold_rows, vocab), rel(&after, &cold_after));
        let per_row: Vec<String> = per_row.iter().map(|x| format!("{x:.1e}")).collect();
        say(&format!(
            "  {name}, keep {keep} of {DRAFT}: verify rows vs decode steps {d:.2e} (rows {}), vs a cold prefill {k:.2e}; next token after the rollback {a:.2e} (bound {bound:.0e})",
            per_row.join(" ")
        ));
        assert!(d <= bound && k <= bound && a <= bound, "{name}, keep {keep}: outside {bound}");
        if keep < DRAFT {
            // The mutant: the latent caches truncated, the KDA state left after all 6 rows.
            let mut x = primed(&mut m, &prompt);
            m.forward_verify(Input::Tokens(&draft), &[DRAFT], &mut [&mut x]).unwrap();
            x.pos -= DRAFT - keep;
            m.end_verify();
            let wrong = rel(&m.forward(&next, &mut x, true).unwrap(), &cold_after);
            say(&format!("  {name}, keep {keep}: mutant (KDA state not rolled back) {wrong:.2e}"));
            assert!(wrong > 5.0 * bound, "{name}: the mutant stays within 5x the bound ({wrong:.2e}): the check cannot fail");
            m.release(x);
        }
        m.release(s);
        m.release(c);
    }
    // Errors, changing nothing.
    let mut s = primed(&mut m, &prompt);
    assert!(m.rollback(&mut [(&mut s, 1)]).is_err(), "a rollback without a verify step");
    m.forward_verify(Input::Tokens(&draft[..3]), &[3], &mut [&mut s]).unwrap();
    assert!(m.rollback(&mut [(&mut s, 3)]).is_err(), "a rollback of every row");
    m.rollback(&mut [(&mut s, 1)]).unwrap();
    assert!(m.rollback(&mut [(&mut s, 1)]).is_err(), "a second rollback of one step");
    assert_eq!(s.pos, PROMPT + 2);
    m.release(s);
}

#[test]
fn verify_rows_and_rollback_equal_plain_paths() {
    let Some(_) = device("verify_rows_and_rollback_equal_plain_paths") else { return };
    let dir = tempfile::tempdir().unwrap();
    let nano = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    let nano = Checkpoint::open(&nano).unwrap();
    check("tiny, bf16 caches", &random(dir.path(), "tiny", SEED, &[]), KvDtype::Bf16, 2e-2);
    check("tiny, fp8 caches", &random(dir.path(), "tiny", SEED, &[]), KvDtype::Fp8, 4e-2);
    check("tiny_dsa, indexer top-64", &random(dir.path(), "tiny_dsa", SEED, &[("dsa_config.index_topk", json!(64))]), KvDtype::Bf16, 2e-2);
    check("k3-nano, bf16 caches", &nano, KvDtype::Bf16, 2e-2);
}

/// The bits of logits rows.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn check_graph(name: &str, ck: &Checkpoint, bound: f64) {
    const B: usize = 2;
    const T: usize = 5;
    let dev = device("cuda_verify graph").unwrap();
    let mut m = CudaModel::load(ck, &dev, CacheConfig { max_seqs: 8, max_tokens: 8192, kv_cache_dtype: KvDtype::Bf16 }).unwrap();
    let vocab = m.config.text.vocab_size;
    let v = vocab as u32;
    let prompts: Vec<Vec<u32>> =
        [PROMPT, PROMPT - 37].iter().enumerate().map(|(i, &n)| (0..n as u32).map(|j| (j * 7919 + 13 + i as u32) % v).collect()).collect();
    let g = m.capture_verify(B, T, 2048, true).unwrap();
    assert_eq!((g.batch(), g.rows()), (B, T));
    // Replayed, the graph's step run eagerly, the plain eager verify: three twins.
    let mut sets: Vec<Vec<CudaSeqState>> = (0..3).map(|_| prompts.iter().map(|p| primed(&mut m, p)).collect()).collect();
    let mut kept: Vec<Vec<u32>> = vec![Vec::new(); B];
    let rounds: [([usize; B], [usize; B]); 3] = [([5, 5], [2, 0]), ([5, 2], [1, 0]), ([1, 3], [0, 2])];
    for (r, (lens, drops)) in rounds.iter().enumerate() {
        let toks: Vec<u32> = (0..lens.iter().sum::<usize>() as u32).map(|i| (i * 104_729 + 5 + 977 * r as u32) % v).collect();
        let mut out = Vec::new();
        for (i, set) in sets.iter_mut().enumerate() {
            let mut refs: Vec<&mut CudaSeqState> = set.iter_mut().collect();
            out.push(match i {
                0 => m.verify_step(&g, &toks, lens, &mut refs, VerifyRun::Replay).unwrap(),
                1 => m.verify_step(&g, &toks, lens, &mut refs, VerifyRun::Eager).unwrap(),
                _ => m.forward_verify(Input::Tokens(&toks), lens, &mut refs).unwrap(),
            });
            let mut back: Vec<(&mut CudaSeqState, usize)> = set.iter_mut().zip(drops).map(|(s, &d)| (s, d)).collect();
            m.rollback(&mut back).unwrap();
        }
        assert_eq!(out[0].len(), lens.iter().sum::<usize>() * vocab, "{name}, round {r}: the sequences' own rows only");
        let same = bits(&out[0]) == bits(&out[1]);
        let d = max_rel(&out[0], &out[2], vocab);
        say(&format!(
            "  {name}, round {r}, rows {lens:?}, drops {drops:?}: replay = eager graph step bit for bit: {same}; vs forward_verify {d:.2e} (bound {bound:.0e})"
        ));
        assert!(same, "{name}, round {r}: the replayed verify step differs from the same step run eagerly");
        assert!(d <= bound, "{name}, round {r}: the graph's rows stand {d:.2e} from forward_verify's");
        let pos: Vec<Vec<usize>> = sets.iter().map(|set| set.iter().map(|s| s.pos).collect()).collect();
        assert!(pos[0] == pos[1] && pos[0] == pos[2], "{name}, round {r}: positions differ: {pos:?}");
        let mut at = 0;
        for (i, (&n, &d)) in lens.iter().zip(drops).enumerate() {
            kept[i].extend_from_slice(&toks[at..at + n - d]);
            at += n;
        }
    }
    // The next token: replayed vs eager graph step bit for bit, vs a cold prefill of the kept tokens within the bound.
    let next = [(v / 3) | 1];
    for i in 0..B {
        assert_eq!(sets[0][i].pos, prompts[i].len() + kept[i].len(), "{name}, sequence {i}: position after the rounds");
        let after: Vec<Vec<f32>> = sets.iter_mut().map(|set| m.forward(&next, &mut set[i], true).unwrap()).collect();
        let mut c = primed(&mut m, &prompts[i]);
        m.forward(&kept[i], &mut c, false).unwrap();
        let cold = m.forward(&next, &mut c, true).unwrap();
        let (a, p) = (rel(&after[0], &cold), rel(&after[2], &cold));
        say(&format!(
            "  {name}, sequence {i} ({} kept tokens): next token after the rounds vs a cold prefill {a:.2e} (forward_verify's {p:.2e})",
            kept[i].len()
        ));
        assert_eq!(bits(&after[0]), bits(&after[1]), "{name}, sequence {i}: the next token after replayed and eager graph steps differs");
        assert!(a <= bound, "{name}, sequence {i}: the state after the graph's steps is not the kept tokens' ({a:.2e} > {bound:.0e})");
        m.release(c);
    }
    for s in sets.into_iter().flatten() {
        m.release(s);
    }
    // Above the MoE's capturable cut: refused, naming the reason.
    let t = &m.config.text;
    let cut = k3_core::cuda::moe::mma_max_tokens(t.num_experts, t.num_experts_per_token);
    let (rows, batch) = (k3_core::cuda::mla::PAGE, cut / k3_core::cuda::mla::PAGE + 1);
    let why = m.verify_capturable(batch, rows).unwrap_err();
    assert!(why.contains("MoE"), "{batch} × {rows} rows, cut {cut}: {why}");
    assert!(m.capture_verify(batch, rows, 2048, true).is_err());
}

#[test]
fn verify_graph_replays_equal_the_eager_step() {
    let Some(_) = device("verify_graph_replays_equal_the_eager_step") else { return };
    let dir = tempfile::tempdir().unwrap();
    let nano = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    check_graph("tiny", &random(dir.path(), "tiny", SEED, &[]), 2e-2);
    check_graph("tiny_dsa, indexer top-64", &random(dir.path(), "tiny_dsa", SEED, &[("dsa_config.index_topk", json!(64))]), 2e-2);
    check_graph("k3-nano", &Checkpoint::open(&nano).unwrap(), 2e-2);
}

/// Every KDA pool's bytes (conv tails and states of every slot, layer by layer).
fn pool_bytes(m: &CudaModel) -> Vec<Vec<u8>> {
    m.copy_kda_pools().unwrap().iter().map(|t| t.to_bytes().unwrap()).collect()
}

/// One rollback form's run of a round: the verify step's logits bits, the KDA pools after the
/// rollback, the positions, the next token's logits bits.
struct Rolled {
    verify: Vec<u32>,
    pools: Vec<Vec<u8>>,
    pos: Vec<usize>,
    next: Vec<u32>,
}

fn check_rollback_graph(name: &str, ck: &Checkpoint) {
    const B: usize = 3;
    const T: usize = 5;
    let dev = device("cuda_verify rollback graph").unwrap();
    let mut m = CudaModel::load(ck, &dev, CacheConfig { max_seqs: 8, max_tokens: 8192, kv_cache_dtype: KvDtype::Bf16 }).unwrap();
    let vocab = m.config.text.vocab_size;
    let v = vocab as u32;
    let prompt = |i: u32, n: u32| -> Vec<u32> { (0..n).map(|j| (j * 7919 + 13 + 31 * i) % v).collect() };
    // The idle sequence takes slot 0; the step's sequences, reversed, sit in slots 3, 2, 1.
    let idle = primed(&mut m, &prompt(9, 40));
    let mut seqs: Vec<CudaSeqState> = (0..B as u32).map(|i| primed(&mut m, &prompt(i, 200 + 41 * i))).collect();
    seqs.reverse();
    assert!(seqs.iter().enumerate().all(|(b, s)| s.slot != b), "slots {:?}", seqs.iter().map(|s| s.slot).collect::<Vec<_>>());
    let g = m.capture_verify(B, T, 2048, true).unwrap();
    // (rows per sequence, rows dropped; None: left out of the rollback call)
    let rounds: [([usize; B], [Option<usize>; B]); 4] = [
        ([5, 5, 5], [Some(4), Some(0), Some(2)]),
        ([5, 2, 4], [None, Some(1), Some(0)]),
        ([1, 5, 3], [Some(0), Some(3), Some(2)]),
        ([2, 5, 5], [Some(1), None, Some(4)]),
    ];
    let forms: [(&str, RollbackRun<'_>); 3] =
        [("per sequence", RollbackRun::PerSequence), ("batched", RollbackRun::Batched), ("graph", RollbackRun::Replay(&g))];
    for (r, (lens, drops)) in rounds.iter().enumerate() {
        let toks: Vec<u32> = (0..lens.iter().sum::<usize>() as u32).map(|i| (i * 104_729 + 7 + 613 * r as u32) % v).collect();
        let next: Vec<u32> = (0..B as u32).map(|i| (v / 3 + 17 * i + r as u32) % v).collect();
        let (pos0, saved) = (seqs.iter().map(|s| s.pos).collect::<Vec<_>>(), m.copy_kda_pools().unwrap());
        let mut got: Vec<Rolled> = Vec::new();
        for (_, how) in forms {
            m.restore_kda_pools(&saved).unwrap();
            seqs.iter_mut().zip(&pos0).for_each(|(s, &p)| s.pos = p);
            let out = m.verify_step(&g, &toks, lens, &mut seqs.iter_mut().collect::<Vec<_>>(), VerifyRun::Replay).unwrap();
            let mut back: Vec<(&mut CudaSeqState, usize)> = seqs.iter_mut().zip(drops).filter_map(|(s, d)| d.map(|d| (s, d))).collect();
            m.rollback_as(&mut back, how).unwrap();
            let pools = pool_bytes(&m);
            let pos = seqs.iter().map(|s| s.pos).collect();
            let after: Vec<f32> = seqs.iter_mut().zip(&next).flat_map(|(s, &t)| m.forward(&[t], s, true).unwrap()).collect();
            got.push(Rolled { verify: bits(&out), pools, pos, next: bits(&after) });
        }
        for (f, (what, _)) in forms.iter().enumerate().skip(1) {
            let (a, b) = (&got[0], &got[f]);
            assert!(a.verify == b.verify, "{name}, round {r}: the verify replay itself differs between runs from one state");
            let differ: Vec<usize> = (0..a.pools.len()).filter(|&i| a.pools[i] != b.pools[i]).collect();
            say(&format!(
                "  {name}, round {r}, rows {lens:?}, drops {drops:?}: {what} rollback vs per sequence: pools differing {differ:?} of {}, positions {:?} vs {:?}, next token bit for bit: {}",
                a.pools.len(),
                b.pos,
                a.pos,
                a.next == b.next
            ));
            assert!(differ.is_empty(), "{name}, round {r}: the {what} rollback leaves other KDA pool bits (pools {differ:?}, conv and state per KDA layer)");
            assert_eq!(a.pos, b.pos, "{name}, round {r}: positions after the {what} rollback");
            assert!(a.next == b.next, "{name}, round {r}: the next token's logits after the {what} rollback differ");
        }
    }
    // An eager verify of uneven rows: the batched body = the reference; its graph is refused.
    let (lens, drops) = ([5usize, 2, 4], [4usize, 0, 1]);
    let toks: Vec<u32> = (0..11u32).map(|i| (i * 7 + 1) % v).collect();
    let (pos0, saved) = (seqs.iter().map(|s| s.pos).collect::<Vec<_>>(), m.copy_kda_pools().unwrap());
    let mut after = Vec::new();
    for how in [RollbackRun::PerSequence, RollbackRun::Batched, RollbackRun::Replay(&g)] {
        m.restore_kda_pools(&saved).unwrap();
        seqs.iter_mut().zip(&pos0).for_each(|(s, &p)| s.pos = p);
        m.forward_verify(Input::Tokens(&toks), &lens, &mut seqs.iter_mut().collect::<Vec<_>>()).unwrap();
        let mut back: Vec<(&mut CudaSeqState, usize)> = seqs.iter_mut().zip(drops).collect();
        match how {
            RollbackRun::Replay(_) => {
                assert!(m.rollback_as(&mut back, how).is_err(), "{name}: a rollback graph replayed after an eager verify step");
                assert_eq!(
                    seqs.iter().map(|s| s.pos).collect::<Vec<_>>(),
                    pos0.iter().zip(lens).map(|(p, l)| p + l).collect::<Vec<_>>(),
                    "{name}: a refused rollback moved"
                );
            }
            _ => {
                m.rollback_as(&mut back, how).unwrap();
                after.push(pool_bytes(&m));
            }
        }
    }
    assert!(after[0] == after[1], "{name}: the batched rollback after an eager verify of rows {lens:?} differs from the reference");
    say(&format!("  {name}: after forward_verify of rows {lens:?}, drops {drops:?}: batched = per sequence bit for bit; the graph's replay refused"));
    // A verify graph captured without its rollback graph refuses a replayed rollback, moving
    // nothing; the eager reference still rolls its step back.
    drop(g);
    let plain = m.capture_verify(B, T, 2048, false).unwrap();
    assert!(!plain.has_rollback());
    let toks: Vec<u32> = (0..(B * T) as u32).map(|i| (i * 31 + 5) % v).collect();
    m.verify_step(&plain, &toks, &[T; B], &mut seqs.iter_mut().collect::<Vec<_>>(), VerifyRun::Replay).unwrap();
    let pos1: Vec<usize> = seqs.iter().map(|s| s.pos).collect();
    let mut back: Vec<(&mut CudaSeqState, usize)> = seqs.iter_mut().map(|s| (s, 1)).collect();
    assert!(m.rollback_as(&mut back, RollbackRun::Replay(&plain)).is_err(), "{name}: a rollback through a graph captured without one");
    assert_eq!(seqs.iter().map(|s| s.pos).collect::<Vec<_>>(), pos1, "{name}: a refused rollback moved");
    let mut back: Vec<(&mut CudaSeqState, usize)> = seqs.iter_mut().map(|s| (s, 1)).collect();
    m.rollback_as(&mut back, RollbackRun::PerSequence).unwrap();
    for s in seqs.into_iter().chain([idle]) {
        m.release(s);
    }
}

#[test]
fn rollback_graph_equals_the_eager_rollback() {
    let Some(_) = device("rollback_graph_equals_the_eager_rollback") else { return };
    let dir = tempfile::tempdir().unwrap();
    let nano = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    check_rollback_graph("tiny", &random(dir.path(), "tiny", SEED, &[]));
    check_rollback_graph("k3-nano", &Checkpoint::open(&nano).unwrap());
}
