//! Prefix caching (issue 21): a warm engine's outputs equal a cold engine's, bit for bit on the
//! CPU — every logits row each output token was sampled from, and the greedy tokens — on three
//! models: a random K3-layout model (`tiny`, f32 weights), a random K3.1 model with gated DSA
//! (`tiny_dsa`, indexer top-8, bf16 weights) and the golden MXFP4 fixture `k3_small_mxfp4` (and,
//! with `--ignored` and the full golden set, the f32 fixtures of K3 and K3.1 DSA).
//!
//! Cases: hits 0, 1, 63, 64, 65 tokens past a grid point; prompts ending exactly on a grid
//! point (the re-send resumes one cell earlier: the last prompt token is always computed);
//! exact re-sends; the branch point found at admission (second sighting, snapshot taken during
//! that prefill, third request hits); A→B→A; many concurrent requests sharing and diverging from
//! one prefix; cancellations; eviction under a tiny pool; own input rows (images); bf16 KDA
//! states. Each warm run is compared with a cold engine of the same configuration running the
//! same request alone (concurrent runs by their tokens: see
//! `concurrent_logits_follow_the_schedule_not_the_cache`). `mutants_are_caught` corrupts
//! restored snapshots (recurrent state, conv tails, a latent value, the indexer keys) and checks
//! that the comparison then fails, so these tests can fail. `live_sequences_share_prefix_pages`:
//! live sequences resumed from one prefix hold the pool's latent and indexer-key pages by
//! reference, private pages where they diverge, and are charged for them once.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k3_engine::dist::runner::ThreadRunner;
use k3_engine::prefix::{KdaSnap, SegLayer, Segment, SnapLayer};
use k3_engine::{Engine, EngineConfig, PrefixConfig, Request, SamplingParams};
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::kda::{StateBuf, StateDType};
use k3_model::layers::pages::StoredPage;
use k3_model::model::LayerState;
use k3_model::{Checkpoint, Model};

#[path = "../../../tests/support/golden.rs"]
mod golden;
#[path = "support/prefix_run.rs"]
mod prefix_run;
#[path = "support/recorder.rs"]
mod recorder;
use prefix_run::{prompt_ids, run, run_reqs, Out};
use recorder::{Log, Mutate, Rec};

const GRID: usize = 128;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mutant {
    None,
    State,
    Conv,
    Latent,
    IndexKey,
}

thread_local! {
    /// The engines this test thread makes have free cuts (`free_cuts_warm_equal_cold`): their
    /// runner says it is not bit-reproducible, as the GPU runner does (`Runner::exact_cuts`), and
    /// the cache then prefills in chunks from snapshot point to snapshot point.
    static FREE_CUTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What `mutant` does to a CPU runner's restore (`None`: nothing).
fn mutation(mutant: Mutant) -> Option<Mutate> {
    let f = move |cells: &mut Vec<Segment>, snap: &mut KdaSnap| {
        let kda = snap
            .layers
            .iter_mut()
            .filter_map(|l| match l {
                SnapLayer::Cpu(k) => Some(k),
                _ => None,
            })
            .next_back();
        match (mutant, kda) {
            (Mutant::State, Some(k)) => match &mut k.s {
                StateBuf::F32(v) => v[7] += 0.25,
                StateBuf::Bf16(v) => v[7] ^= 0x40,
            },
            (Mutant::Conv, Some(k)) => k.conv[1].iter_mut().for_each(|x| *x = 0.0),
            (Mutant::Latent, _) => {
                // One value of one cached latent row.
                let last = cells.last_mut().unwrap();
                if let Some(SegLayer::Mla { latent, .. }) = last.layers.iter_mut().rev().find(|l| matches!(l, SegLayer::Mla { .. })) {
                    // A corrupted copy of the page (the pool's own page stays as it was).
                    let mut v = latent.values().to_vec();
                    *v.last_mut().unwrap() += 0.5;
                    *latent = StoredPage::from_values(v);
                }
            }
            (Mutant::IndexKey, _) => {
                // Every indexer key negated (a nudge to one key may leave the top-k selection,
                // and so the output, unchanged).
                for c in cells.iter_mut() {
                    for l in &mut c.layers {
                        if let SegLayer::Mla { index_keys, .. } = l {
                            *index_keys = StoredPage::from_values(index_keys.values().iter().map(|x| -x).collect());
                        }
                    }
                }
            }
            _ => {}
        }
    };
    (mutant != Mutant::None).then(|| Box::new(f) as Mutate)
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("k3-prefix-test-{}-{name}", std::process::id()))
}

/// The three models (built once per test binary).
fn model(name: &str) -> Arc<Model> {
    static MODELS: Mutex<Vec<(String, Arc<Model>)>> = Mutex::new(Vec::new());
    let mut all = MODELS.lock().unwrap();
    if let Some((_, m)) = all.iter().find(|(n, _)| n == name) {
        return m.clone();
    }
    let ck = match name {
        golden if golden.starts_with("k3") => Checkpoint::open(&golden::fixture(golden)).unwrap(),
        base => {
            let dir = tmp(base);
            let dtype = if base == "tiny" { FloatDType::F32 } else { FloatDType::BF16 };
            let o = InitOptions { seed: 21, dtype, experts: ExpertFormat::Float(dtype), shard_size: None };
            init(k3_model::config::builtin_config(base).unwrap(), &Overrides::default(), &dir, &o).unwrap();
            let ck = Checkpoint::open(&dir).unwrap();
            let _ = std::fs::remove_dir_all(&dir); // the map stays valid
            ck
        }
    };
    let m = Arc::new(Model::load(&ck).unwrap());
    all.push((name.to_string(), m.clone()));
    m
}

const MODELS: [&str; 3] = ["tiny", "tiny_dsa", "k3_small_mxfp4"];

fn cfg(mem: usize) -> EngineConfig {
    EngineConfig { max_batch: 8, max_step_tokens: 1024, prefix: Some(PrefixConfig::new(GRID, mem)), ..Default::default() }
}

fn engine(name: &str, mem: usize, mutant: Mutant) -> (Engine, Log) {
    let log: Log = Default::default();
    let mut r = Rec::new(ThreadRunner::single(model(name), Default::default()), &log);
    r.mutate = mutation(mutant);
    r.exact_cuts = FREE_CUTS.with(|f| f.get()).then_some(false);
    (Engine::with_runner(Box::new(r), None, cfg(mem)), log)
}

/// A deterministic prompt of `n` ids from `seed`.
fn ids(name: &str, seed: u32, n: usize) -> Vec<u32> {
    prompt_ids(model(name).config.text.vocab_size as u32, seed, n)
}

/// The same request on a fresh engine.
fn cold(name: &str, prompt: &[u32], n: usize) -> Out {
    let (mut e, log) = engine(name, 1 << 30, Mutant::None);
    let out = run(&mut e, &log, &[prompt.to_vec()], n, &[]).pop().unwrap().unwrap();
    assert_eq!(out.cached, 0);
    out
}

/// `prompt` on the warm engine `e`: equal to a cold start, with `cached` tokens restored.
fn check_warm(name: &str, e: &mut Engine, log: &Log, prompt: &[u32], cached: usize, what: &str) {
    let warm = run(e, log, &[prompt.to_vec()], 5, &[]).pop().unwrap().unwrap();
    let c = cold(name, prompt, 5);
    assert_eq!(warm.cached, cached, "{name} {what}: cached tokens");
    assert_eq!(warm.tokens, c.tokens, "{name} {what}: greedy tokens");
    assert!(warm.rows == c.rows, "{name} {what}: logits rows are not bit-equal to a cold start");
}

#[test]
fn hits_past_a_grid_point_equal_cold() {
    MODELS.iter().for_each(|m| hits_past_a_grid_point(m));
}

#[test]
fn grid_boundaries_and_resends_equal_cold() {
    MODELS.iter().for_each(|m| grid_boundaries_and_resends(m));
}

/// Free cuts (the GPU runner's mode: prefill chunks run from snapshot point to snapshot point,
/// several cells published per step, regular snapshots 16 cells apart). Where the request that
/// wrote the cells was cut as a cold run of the warm request is, warm and cold make the same
/// forward calls and stay bit-equal on the CPU: the hits past a grid point, and a prompt one
/// token past an earlier prompt's end. (Where the writer was cut elsewhere — a 384-token prompt
/// cut at its snapshot point 256, then resumed at 384 by a 385-token one that a cold run
/// prefills in one chunk — the rows differ by that cut's rounding; the GPU test bounds it.)
#[test]
fn free_cuts_warm_equal_cold() {
    FREE_CUTS.with(|f| f.set(true));
    for m in MODELS {
        hits_past_a_grid_point(m);
    }
    let (mut e, log) = engine(MODELS[0], 1 << 30, Mutant::None);
    let a = ids(MODELS[0], 9, 5 * GRID + 3);
    let out = run(&mut e, &log, std::slice::from_ref(&a), 2, &[]).pop().unwrap().unwrap();
    assert_eq!(out.cached, 0);
    let st = e.prefix_status().unwrap().unwrap();
    // One prompt of 643 tokens: chunks end at 512 (the 512-token chunk limit), 640 (its last
    // grid point) and 643; all five cells published, one snapshot (640).
    assert_eq!((st.snapshots, st.pool_snapshots), (1, 1), "{st:?}");
    assert!(st.pool_bytes > 0);
    // The same prompt plus one token resumes at 640.
    let mut a1 = a.clone();
    a1.push(3);
    check_warm(MODELS[0], &mut e, &log, &a1, 5 * GRID, "free cuts, prompt end + 1");
}

/// The same cases on the two f32 golden fixtures of the full set (K3 and K3.1 DSA).
#[test]
#[ignore = "full golden set: k3_small_f32 and k31_small_dsa_f32 (K3_GOLDEN_DIR)"]
fn golden_f32_fixtures_warm_equal_cold() {
    for name in ["k3_small_f32", "k31_small_dsa_f32"] {
        hits_past_a_grid_point(name);
        grid_boundaries_and_resends(name);
    }
}

fn hits_past_a_grid_point(name: &str) {
    {
        let (mut e, log) = engine(name, 1 << 30, Mutant::None);
        // A: 2 cells + 80 → snapshot at 256 (its prompt's last grid point).
        let a = ids(name, 1, 2 * GRID + 80);
        run(&mut e, &log, std::slice::from_ref(&a), 3, &[]);
        for d in [0usize, 1, 63, 64, 65] {
            // Shares 256 + d tokens with A, then diverges for 9 tokens: resumes at 256.
            let mut b = a[..2 * GRID + d].to_vec();
            b.extend(ids(name, 100 + d as u32, 9));
            check_warm(name, &mut e, &log, &b, 2 * GRID, &format!("{d} past the grid point"));
        }
        let st = e.prefix_status().unwrap().unwrap();
        assert!(st.hits >= 5 && st.hit_tokens >= 5 * 2 * GRID as u64, "{st:?}");
    }
}

fn grid_boundaries_and_resends(name: &str) {
    {
        let (mut e, log) = engine(name, 1 << 30, Mutant::None);
        // A ends exactly on a grid point (3 cells): snapshots at 384 and 256.
        let a = ids(name, 2, 3 * GRID);
        run(&mut e, &log, std::slice::from_ref(&a), 3, &[]);
        // Exact re-send: the last token must be computed, so it resumes at 256.
        check_warm(name, &mut e, &log, &a, 2 * GRID, "exact re-send of a grid-aligned prompt");
        // One token more: resumes at 384 (the prompt end of A).
        let mut a1 = a.clone();
        a1.push(7);
        check_warm(name, &mut e, &log, &a1, 3 * GRID, "prompt end + 1");
        // Re-send of a1: its own prompt-end snapshot (384 = ⌊(P−1)/g⌋·g).
        check_warm(name, &mut e, &log, &a1, 3 * GRID, "exact re-send");
        // The first 2 cells only: cells match to 128 but no snapshot there → cold, and the branch
        // point 128 is snapshotted during this prefill; the same request again hits at 128.
        let d = a[..2 * GRID].to_vec();
        check_warm(name, &mut e, &log, &d, 0, "branch point, first sighting");
        check_warm(name, &mut e, &log, &d, GRID, "branch point, second sighting");
        let st = e.prefix_status().unwrap().unwrap();
        assert!(st.kv_only_matches >= 1, "{st:?}");
    }
}

#[test]
fn interleaved_concurrent_and_cancelled_equal_cold() {
    for name in MODELS {
        let (mut e, log) = engine(name, 1 << 30, Mutant::None);
        let sys = ids(name, 3, 2 * GRID + 40);
        let user = |k: u32, n: usize| {
            let mut p = sys.clone();
            p.extend(ids(name, 50 + k, n));
            p
        };
        // A → B → A: B diverges from A inside the third cell.
        let (pa, pb) = (user(1, 150), user(2, 90));
        for (p, what) in [(&pa, "A"), (&pb, "B"), (&pa, "A again")] {
            let warm = run(&mut e, &log, std::slice::from_ref(p), 5, &[]).pop().unwrap().unwrap();
            let c = cold(name, p, 5);
            assert_eq!((&warm.tokens, &warm.rows), (&c.tokens, &c.rows), "{name} {what}");
        }
        // Eight concurrent requests sharing the prefix and diverging at different places, two of
        // them cancelled mid-prefill; chunked prefill interleaves with decode.
        let prompts: Vec<Vec<u32>> = (0..8).map(|k| user(10 + k, 20 + 37 * k as usize)).collect();
        let outs = run(&mut e, &log, &prompts, 6, &[(2, 1), (5, 3)]);
        for (k, (p, o)) in prompts.iter().zip(&outs).enumerate() {
            let Some(o) = o else { continue };
            assert!(o.cached >= 2 * GRID, "{name} request {k} cached {}", o.cached);
            assert_eq!(o.tokens, cold(name, p, 6).tokens, "{name} concurrent request {k}");
        }
        // After the cancellations the same prompts still equal a cold start.
        for k in [2usize, 5] {
            let warm = run(&mut e, &log, std::slice::from_ref(&prompts[k]), 6, &[]).pop().unwrap().unwrap();
            let c = cold(name, &prompts[k], 6);
            assert_eq!((&warm.tokens, &warm.rows), (&c.tokens, &c.rows), "{name} request {k} after its cancellation");
        }
    }
}

/// Requests that arrive together with one long shared prefix: the first prefills it, the others
/// wait for its cells (it snapshots where they branch off) and resume there.
#[test]
fn simultaneous_requests_share_one_prefill() {
    let name = "tiny_dsa";
    let (mut e, log) = engine(name, 1 << 30, Mutant::None);
    let sys = ids(name, 11, 2 * GRID + 60);
    let prompts: Vec<Vec<u32>> = (0..5)
        .map(|k| {
            let mut p = sys.clone();
            p.extend(ids(name, 90 + k, 10 + 7 * k as usize));
            p
        })
        .collect();
    let outs = run(&mut e, &log, &prompts, 4, &[]);
    for (k, (p, o)) in prompts.iter().zip(outs).enumerate() {
        let o = o.unwrap();
        assert_eq!(o.cached, if k == 0 { 0 } else { 2 * GRID }, "request {k}");
        assert_eq!(o.tokens, cold(name, p, 4).tokens, "request {k}");
    }
    let st = e.prefix_status().unwrap().unwrap();
    assert!(st.deferred > 0 && st.hits == 4, "{st:?}");
}

#[test]
fn eviction_under_a_small_pool_equals_cold() {
    let name = "k3_small_mxfp4";
    // About two snapshots' worth: eviction runs on nearly every publication.
    let (mut e0, log0) = engine(name, 1 << 30, Mutant::None);
    run(&mut e0, &log0, &[ids(name, 9, GRID + 1)], 1, &[]);
    let one = e0.prefix_status().unwrap().unwrap().pool_bytes as usize;
    let (mut e, log) = engine(name, 2 * one, Mutant::None);
    let prompts: Vec<Vec<u32>> = (0..6).map(|k| ids(name, 40 + k % 3, 3 * GRID + 5 + k as usize)).collect();
    for round in 0..2 {
        // Six at once: the greedy tokens equal each request's cold run alone (the logits can
        // differ in their last bits with the batch's composition, cache or no cache: see
        // `concurrent_logits_follow_the_schedule_not_the_cache`).
        let outs = run(&mut e, &log, &prompts, 4, &[]);
        for (p, o) in prompts.iter().zip(outs) {
            assert_eq!(o.unwrap().tokens, cold(name, p, 4).tokens, "round {round}");
        }
        // One at a time, bit for bit.
        for p in &prompts[..3] {
            let o = run(&mut e, &log, std::slice::from_ref(p), 4, &[]).pop().unwrap().unwrap();
            let c = cold(name, p, 4);
            assert_eq!((&o.tokens, &o.rows), (&c.tokens, &c.rows), "round {round}, alone");
        }
        let st = e.prefix_status().unwrap().unwrap();
        assert!(st.pool_bytes as usize <= 2 * one, "{st:?}");
        assert!(st.evictions > 0, "{st:?}");
    }
}

/// The control for the concurrent cases: a cold engine running requests together gives logits
/// that differ in their last bits from each request run alone (a step's packed rows decide
/// whether `linear` takes its GEMV path (≤ 4 rows) or its GEMM (≥ 5), which round differently),
/// while the tokens agree. So concurrent runs are compared by tokens; single runs bit for bit.
#[test]
fn concurrent_logits_follow_the_schedule_not_the_cache() {
    let name = "k3_small_mxfp4";
    let prompts: Vec<Vec<u32>> = (0..4).map(|k| ids(name, 70 + k, 30 + 50 * k as usize)).collect();
    let (mut e, log) = engine(name, 1 << 30, Mutant::None);
    let together = run(&mut e, &log, &prompts, 6, &[]);
    let mut differ = 0;
    for (p, o) in prompts.iter().zip(together) {
        let (o, c) = (o.unwrap(), cold(name, p, 6));
        assert_eq!(o.cached, 0);
        assert_eq!(o.tokens, c.tokens);
        differ += (o.rows != c.rows) as usize;
    }
    assert!(differ > 0, "batched rows were bit-equal to solo rows: the concurrent tests could compare logits too");
}

/// Own input rows (image features at `<|media_pad|>` ids: the same id for every image) are part
/// of the key: the same ids with other rows never hit; with the same rows they do, bit for bit.
#[test]
fn own_rows_are_keyed_by_content() {
    let name = "k3_small_mxfp4";
    let p = ids(name, 8, 2 * GRID + 20);
    let (mut e, log) = engine(name, 1 << 30, Mutant::None);
    let emb = e.embed(&p).unwrap();
    let h = model(name).config.text.hidden_size;
    let image = |scale: f32| {
        let mut r = emb.clone();
        r[10 * h..40 * h].iter_mut().for_each(|x| *x *= scale);
        Arc::new(r)
    };
    let req = |rows: Option<Arc<Vec<f32>>>| {
        let mut r = Request::new(p.clone(), SamplingParams::greedy(), 5);
        r.prompt_embeds = rows;
        r
    };
    let one = |e: &mut Engine, log: &Log, rows| run_reqs(e, log, vec![req(rows)], &[]).pop().unwrap().unwrap();
    let first = one(&mut e, &log, Some(image(1.5)));
    assert_eq!(first.cached, 0);
    assert_eq!(one(&mut e, &log, Some(image(-0.5))).cached, 0, "other rows, same ids: no hit");
    assert_eq!(one(&mut e, &log, None).cached, 0, "token embeddings, same ids: no hit");
    let again = one(&mut e, &log, Some(image(1.5)));
    assert_eq!(again.cached, 2 * GRID, "the same rows hit");
    let (mut c, clog) = engine(name, 1 << 30, Mutant::None);
    let cold = one(&mut c, &clog, Some(image(1.5)));
    assert_eq!((&again.tokens, &again.rows), (&cold.tokens, &cold.rows));
    assert_eq!((&first.tokens, &first.rows), (&cold.tokens, &cold.rows));
}

/// KDA states stored as bf16 (`--kda-state bf16`): the snapshot is their bits, so warm = cold.
#[test]
fn bf16_kda_state_warm_equals_cold() {
    let name = "tiny";
    let mk = || {
        let log: Log = Default::default();
        let r = Rec::new(ThreadRunner::single(model(name), StateDType::Bf16), &log);
        (Engine::with_runner(Box::new(r), None, cfg(1 << 30)), log)
    };
    let (mut e, log) = mk();
    let a = ids(name, 5, 2 * GRID + 70);
    run(&mut e, &log, std::slice::from_ref(&a), 2, &[]);
    let mut b = a[..2 * GRID + 64].to_vec();
    b.extend(ids(name, 6, 5));
    let warm = run(&mut e, &log, std::slice::from_ref(&b), 5, &[]).pop().unwrap().unwrap();
    let (mut c, clog) = mk();
    let cold = run(&mut c, &clog, std::slice::from_ref(&b), 5, &[]).pop().unwrap().unwrap();
    assert_eq!(warm.cached, 2 * GRID);
    assert_eq!((&warm.tokens, &warm.rows), (&cold.tokens, &cold.rows));
}

#[test]
fn mutants_are_caught() {
    for (name, m) in [("tiny", Mutant::State), ("tiny", Mutant::Conv), ("k3_small_mxfp4", Mutant::Latent), ("tiny_dsa", Mutant::IndexKey)] {
        let (mut e, log) = engine(name, 1 << 30, m);
        let a = ids(name, 4, 2 * GRID + 30);
        run(&mut e, &log, std::slice::from_ref(&a), 2, &[]);
        let warm = run(&mut e, &log, std::slice::from_ref(&a), 5, &[]).pop().unwrap().unwrap();
        assert_eq!(warm.cached, 2 * GRID);
        assert!(warm.rows != cold(name, &a, 5).rows, "{name}: a corrupted snapshot ({m:?}) went unnoticed");
    }
}

#[test]
fn off_unless_asked_for() {
    let e = Engine::with_runner(Box::new(ThreadRunner::single(model("tiny"), Default::default())), None, EngineConfig::default());
    assert_eq!(e.prefix_status(), Ok(None));
}

/// Live sequences resumed from one prefix hold the pool's latent and indexer-key pages
/// themselves, by reference (the same page objects: the pool's, B's and C's handles, nobody
/// else's), each computes the cell it diverges in into a page of its own, the shared pages are
/// charged once (to the pool, not to the sequences), and the outputs equal a cold start bit for
/// bit. A mutant that copies pages at restore (`PagedRows::push_page`) fails the first check;
/// one that charges the pool's pages to the sequences fails the memory check.
#[test]
fn live_sequences_share_prefix_pages() {
    let name = "tiny_dsa";
    let (mut e, log) = engine(name, 1 << 30, Mutant::None);
    let sys = ids(name, 12, 2 * GRID + 40);
    let user = |k: u32| {
        let mut p = sys.clone();
        p.extend(ids(name, 60 + k, 20));
        p
    };
    // A publishes the cells [0, 256) and the snapshot at 256; its state is freed at its end.
    run(&mut e, &log, &[user(0)], 2, &[]);
    let pool = e.prefix_status().unwrap().unwrap().pool_bytes;
    let (pb, pc) = (user(1), user(2));
    let (b, c) = (e.add(Request::new(pb.clone(), SamplingParams::greedy(), 4)).unwrap(), e.add(Request::new(pc.clone(), SamplingParams::greedy(), 4)).unwrap());
    let mut events = Vec::new();
    while events.len() < 2 {
        events.extend(e.step().unwrap()); // both prefilled: their first tokens
    }
    assert!(events.iter().all(|ev| ev.cached_tokens == 2 * GRID), "both resumed at 256");
    let (sb, sc) = (e.runner().seq_state(b).unwrap(), e.runner().seq_state(c).unwrap());
    let (mut shared_per_token, mut layers) = (0, 0);
    for (l, (lb, lc)) in sb.layers.iter().zip(&sc.layers).enumerate() {
        let (LayerState::Mla(cb), LayerState::Mla(cc)) = (lb, lc) else { continue };
        layers += 1;
        for (rb, rc, what) in [(&cb.latent, &cc.latent, "latent"), (&cb.index_keys, &cc.index_keys, "indexer-key")] {
            assert_eq!((rb.page_rows(), rb.pages().len(), rc.pages().len()), (GRID, 3, 3), "layer {l} {what}: pages of the grid");
            for k in 0..2 {
                let (x, y) = (&rb.pages()[k], &rc.pages()[k]);
                assert!(Arc::ptr_eq(x, y), "layer {l} {what} page {k}: B and C hold the same page");
                assert!(x.is_stored() && Arc::strong_count(x) == 3, "layer {l} {what} page {k}: held by the pool, B and C only");
            }
            // Cell 2 (B and C diverge inside it): a page of each one's own, the common rows
            // [256, 296) equal value for value.
            let (x, y) = (&rb.pages()[2], &rc.pages()[2]);
            assert!(!Arc::ptr_eq(x, y) && !x.is_stored() && Arc::strong_count(x) == 1 && Arc::strong_count(y) == 1, "layer {l} {what}: private tail pages");
            assert_eq!(rb.copy_rows(2 * GRID, sys.len()), rc.copy_rows(2 * GRID, sys.len()), "layer {l} {what}");
            assert_ne!(rb.copy_rows(sys.len(), sys.len() + 1), rc.copy_rows(sys.len(), sys.len() + 1), "layer {l} {what}: B and C diverge");
            shared_per_token += 4 * rb.width();
        }
    }
    assert!(layers > 0 && shared_per_token > 0);
    // Memory: each sequence is charged its own rows and KDA states, not the 256 shared rows
    // (the pool's bytes, unchanged: nothing new was published).
    let own = |st: &k3_model::SeqState| st.bytes() - 2 * GRID * shared_per_token;
    assert_eq!(e.state_bytes(), own(sb) + own(sc), "shared pages charged to the pool only");
    assert_eq!(e.prefix_status().unwrap().unwrap().pool_bytes, pool);
    // Run both to the end: the cold tokens (run together, their logits follow the batch's
    // composition: `concurrent_logits_follow_the_schedule_not_the_cache`); every state freed.
    while e.has_work() {
        events.extend(e.step().unwrap());
    }
    assert_eq!(e.state_bytes(), 0);
    for (id, p) in [(b, &pb), (c, &pc)] {
        let toks: Vec<u32> = events.iter().filter(|ev| ev.seq == id).map(|ev| ev.token).collect();
        assert_eq!(toks, cold(name, p, 4).tokens, "sequence {id}");
    }
    // Alone, on the same pages again: bit for bit.
    check_warm(name, &mut e, &log, &pb, 2 * GRID, "B alone on the shared pages");
}
