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
use k3_model::cuda::{CacheConfig, CudaModel, CudaSeqState, Input};
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
