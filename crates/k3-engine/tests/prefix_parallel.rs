//! The prefix cache on parallel layouts (issue 21 on ranks as threads, `dist::layout_state`):
//! a warm engine over `--tp 2`, `--ep 2`, `--pp 2` and `--tp 2 --pp 2` equals a cold engine of
//! the same layout bit for bit — every logits row each output token was sampled from, and the
//! greedy tokens — for hits at, 1, 63, 64 and 65 tokens past a grid point, a divergence one
//! token before a grid point (the branch point then snapshotted, and hit by the next request),
//! prompts ending on a grid point (exact re-send, one token more), and concurrent requests
//! sharing and diverging from one prefix (by tokens: see prefix.rs's
//! `concurrent_logits_follow_the_schedule_not_the_cache`). Models: `k3 init`'s tiny (4 KDA
//! heads, its KDA layers all on the first stage of `--pp 2`) on every layout, tiny K3.1 DSA on
//! `--tp 2 --pp 2`, and the golden MXFP4 fixture (3 heads: an uneven 2 + 1 split; KDA layers on
//! both stages) on `--tp 2` and `--pp 2`.
//!
//! Mutants, each seen to make the comparison fail: one rank's KDA heads perturbed, the two
//! ranks' heads swapped (restored to the wrong rank), a KDA state and a latent row of the second
//! pipeline stage perturbed. A swap of uneven head shares is refused by the rank, and a state
//! stored by one layout is refused by another (the cache's digest names the layout, too).
//!
//! Shared pages on every rank (`k3_model::layers::pages`, `dist::threads`): the pool keeps each
//! stage's first rank's own latent / indexer-key pages and every rank of the stage restores them
//! by reference; live sequences diverge into pages of their own; a rollback into a shared page
//! copies it; memory is charged once; warm = cold bit for bit throughout (the last three tests).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use k3_engine::dist::runner::{Runner, Step, StepSeq, ThreadRunner};
use k3_engine::prefix::{Capture, KdaSnap, SegLayer, Segment, SnapLayer};
use k3_engine::{Engine, EngineConfig, PrefixConfig, Request, SamplingParams};
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::kda::{StateBuf, StateDType};
use k3_model::layers::pages::{Page, StoredPage};
use k3_model::model::LayerState;
use k3_model::{Checkpoint, Parallel};

#[path = "../../../tests/support/golden.rs"]
mod golden;
#[path = "support/prefix_run.rs"]
mod prefix_run;
#[path = "support/recorder.rs"]
mod recorder;
use prefix_run::{prompt_ids, run, Out};
use recorder::{Log, Mutate, Rec};

const GRID: usize = 128;

fn par(tp: usize, ep: Option<usize>, pp: usize) -> Parallel {
    Parallel::new(tp, ep, pp).unwrap()
}

/// `--tp 2` (experts whole, ep = tp), `--ep 2` alone, `--pp 2`, `--tp 2 --pp 2`.
fn layouts() -> [Parallel; 4] {
    [par(2, None, 1), par(1, Some(2), 1), par(1, None, 2), par(2, None, 2)]
}

/// The checkpoints (made or opened once per test binary).
fn ck(name: &str) -> Arc<Checkpoint> {
    static CKS: Mutex<Vec<(String, Arc<Checkpoint>)>> = Mutex::new(Vec::new());
    let mut all = CKS.lock().unwrap();
    if let Some((_, c)) = all.iter().find(|(n, _)| n == name) {
        return c.clone();
    }
    let ck = match name {
        "k3_small_mxfp4" => Checkpoint::open(&golden::fixture(name)).unwrap(),
        base => {
            let dir: PathBuf = std::env::temp_dir().join(format!("k3-prefix-par-test-{}-{base}", std::process::id()));
            let dtype = if base == "tiny" { FloatDType::F32 } else { FloatDType::BF16 };
            let o = InitOptions { seed: 21, dtype, experts: ExpertFormat::Float(dtype), shard_size: None };
            init(k3_model::config::builtin_config(base).unwrap(), &Overrides::default(), &dir, &o).unwrap();
            let ck = Checkpoint::open(&dir).unwrap();
            let _ = std::fs::remove_dir_all(&dir); // the map stays valid
            ck
        }
    };
    let ck = Arc::new(ck);
    all.push((name.to_string(), ck.clone()));
    ck
}

fn ids(name: &str, seed: u32, n: usize) -> Vec<u32> {
    prompt_ids(ck(name).config.text.vocab_size as u32, seed, n)
}

fn engine_grid(name: &str, p: Parallel, grid: usize, mutate: Option<Mutate>) -> (Engine, Log) {
    let log: Log = Default::default();
    let mut r = Rec::new(ThreadRunner::start(&ck(name), p, StateDType::F32).unwrap(), &log);
    r.mutate = mutate;
    let cfg = EngineConfig { max_batch: 8, max_step_tokens: 1024, prefix: Some(PrefixConfig::new(grid, 1 << 30)), ..Default::default() };
    (Engine::with_runner(Box::new(r), None, cfg), log)
}

fn engine(name: &str, p: Parallel) -> (Engine, Log) {
    engine_grid(name, p, GRID, None)
}

/// `prompt` alone on a fresh engine of the same layout.
fn cold(name: &str, p: Parallel, prompt: &[u32], n: usize) -> Out {
    let (mut e, log) = engine(name, p);
    let out = run(&mut e, &log, &[prompt.to_vec()], n, &[]).pop().unwrap().unwrap();
    assert_eq!(out.cached, 0);
    out
}

/// `prompt` on the warm engine `e`: equal to a cold start, with `cached` tokens restored.
fn check_warm(name: &str, p: Parallel, e: &mut Engine, log: &Log, prompt: &[u32], cached: usize, what: &str) {
    let warm = run(e, log, &[prompt.to_vec()], 4, &[]).pop().unwrap().unwrap();
    let c = cold(name, p, prompt, 4);
    assert_eq!(warm.cached, cached, "{name} {p:?} {what}: cached tokens");
    assert_eq!(warm.tokens, c.tokens, "{name} {p:?} {what}: greedy tokens");
    assert!(warm.rows == c.rows, "{name} {p:?} {what}: logits rows are not bit-equal to a cold start");
}

/// Hits at and past a grid point, and a divergence just before one (first sighting: cold, its
/// branch point snapshotted; the next request resumes there).
fn around_a_grid_point(name: &str, p: Parallel, offsets: &[usize]) {
    let (mut e, log) = engine(name, p);
    let a = ids(name, 1, 2 * GRID + 80); // snapshot at 256, its prompt's last grid point
    run(&mut e, &log, std::slice::from_ref(&a), 2, &[]);
    for &d in offsets {
        let mut b = a[..2 * GRID + d].to_vec();
        b.extend(ids(name, 100 + d as u32, 9));
        check_warm(name, p, &mut e, &log, &b, 2 * GRID, &format!("{d} past the grid point"));
    }
    let mut before = a[..2 * GRID - 1].to_vec();
    before.extend(ids(name, 7, 20));
    check_warm(name, p, &mut e, &log, &before, 0, "one token before the grid point (branch at 128)");
    let mut again = a[..GRID + 72].to_vec();
    again.extend(ids(name, 8, 5));
    check_warm(name, p, &mut e, &log, &again, GRID, "resumes at the branch point");
    let st = e.prefix_status().unwrap().unwrap();
    assert!(st.kv_only_matches >= 1 && st.hits as usize > offsets.len(), "{st:?}");
}

/// A prompt ending on a grid point: the exact re-send resumes a cell earlier (its last token is
/// always computed), one token more resumes at its end.
fn prompt_ends(name: &str, p: Parallel) {
    let (mut e, log) = engine(name, p);
    let c = ids(name, 2, 3 * GRID);
    run(&mut e, &log, std::slice::from_ref(&c), 2, &[]);
    check_warm(name, p, &mut e, &log, &c, 2 * GRID, "exact re-send of a grid-aligned prompt");
    let mut c1 = c.clone();
    c1.push(7);
    check_warm(name, p, &mut e, &log, &c1, 3 * GRID, "prompt end + 1");
}

#[test]
fn warm_equals_cold_on_every_layout() {
    for p in layouts() {
        around_a_grid_point("tiny", p, &[0, 1, 63, 64, 65]);
        prompt_ends("tiny", p);
    }
}

#[test]
fn warm_equals_cold_dsa_and_mxfp4() {
    around_a_grid_point("tiny_dsa", par(2, None, 2), &[0, 65]);
    for p in [par(2, None, 1), par(1, None, 2)] {
        around_a_grid_point("k3_small_mxfp4", p, &[1, 64]);
    }
}

/// Six requests at once sharing a prefix and diverging inside its third cell and after it, one
/// cancelled mid-prefill: every greedy output equals its cold run alone on the same layout.
#[test]
fn concurrent_requests_share_and_diverge() {
    let name = "tiny";
    for p in [par(2, None, 1), par(2, None, 2)] {
        let (mut e, log) = engine(name, p);
        let sys = ids(name, 3, 2 * GRID + 60);
        run(&mut e, &log, std::slice::from_ref(&sys), 1, &[]);
        let prompts: Vec<Vec<u32>> = (0..6)
            .map(|k| {
                let mut q = sys[..2 * GRID + 10 * k].to_vec();
                q.extend(ids(name, 60 + k as u32, 15 + 40 * k));
                q
            })
            .collect();
        let outs = run(&mut e, &log, &prompts, 5, &[(3, 1)]);
        for (k, (q, o)) in prompts.iter().zip(&outs).enumerate() {
            let Some(o) = o else { continue };
            assert_eq!(o.cached, 2 * GRID, "{p:?} request {k}");
            assert_eq!(o.tokens, cold(name, p, q, 5).tokens, "{p:?} concurrent request {k}");
        }
        assert!(outs[3].is_none());
    }
}

/// What a mutant does to the stored state before a restore.
#[derive(Clone, Copy, Debug)]
enum Mutant {
    /// One value of rank 1's heads of the last KDA layer (`--tp 2`).
    RankHeads,
    /// The ranks' heads of every KDA layer swapped: each rank gets its peer's part.
    SwapRanks,
    /// One value of the last KDA layer's state (on `--pp 2`, a second-stage layer).
    LastKda,
    /// One value of the last MLA layer's latent rows (on `--pp 2`, the second stage's).
    LastLatent,
}

fn mutation(m: Mutant) -> Mutate {
    Box::new(move |cells: &mut Vec<Segment>, snap: &mut KdaSnap| {
        let bump = |s: &mut StateBuf| match s {
            StateBuf::F32(v) => v[5] += 0.25,
            StateBuf::Bf16(v) => v[5] ^= 0x40,
        };
        match m {
            Mutant::RankHeads => match snap.layers.iter_mut().rev().find(|l| matches!(l, SnapLayer::Ranks(_))) {
                Some(SnapLayer::Ranks(v)) => bump(&mut v[1].s),
                _ => panic!("no KDA layer split over ranks"),
            },
            Mutant::SwapRanks => snap.layers.iter_mut().for_each(|l| {
                if let SnapLayer::Ranks(v) = l {
                    v.swap(0, 1);
                }
            }),
            Mutant::LastKda => match snap.layers.iter_mut().rev().find(|l| matches!(l, SnapLayer::Cpu(_))) {
                Some(SnapLayer::Cpu(k)) => bump(&mut k.s),
                _ => panic!("no KDA layer"),
            },
            Mutant::LastLatent => match cells.last_mut().unwrap().layers.iter_mut().rev().find(|l| matches!(l, SegLayer::Mla { .. })) {
                Some(SegLayer::Mla { latent, .. }) => {
                    // A corrupted copy of the page (the pool's own page stays as it was).
                    let mut v = latent.values().to_vec();
                    *v.last_mut().unwrap() += 0.5;
                    *latent = StoredPage::from_values(v);
                }
                _ => panic!("no MLA layer"),
            },
        }
    })
}

#[test]
fn mutants_are_caught() {
    for (name, p, m) in [
        ("tiny", par(2, None, 1), Mutant::RankHeads),
        ("tiny", par(2, None, 1), Mutant::SwapRanks),
        ("tiny", par(2, None, 2), Mutant::SwapRanks),
        ("k3_small_mxfp4", par(1, None, 2), Mutant::LastKda),
        ("k3_small_mxfp4", par(1, None, 2), Mutant::LastLatent),
    ] {
        let (mut e, log) = engine_grid(name, p, GRID, Some(mutation(m)));
        let a = ids(name, 4, 2 * GRID + 30);
        run(&mut e, &log, std::slice::from_ref(&a), 2, &[]);
        let warm = run(&mut e, &log, std::slice::from_ref(&a), 4, &[]).pop().unwrap().unwrap();
        assert_eq!(warm.cached, 2 * GRID);
        assert!(warm.rows != cold(name, p, &a, 4).rows, "{name} {p:?}: a corrupted restore ({m:?}) went unnoticed");
    }
}

/// One sequence of `n` prompt tokens through `r`, its state captured whole (one grid cell).
fn captured(r: &mut ThreadRunner, n: usize) -> k3_engine::prefix::Capture {
    let tokens = ids("k3_small_mxfp4", 5, n);
    r.forward(Step { seqs: vec![StepSeq { id: 1, tokens, rows: None }], last_only: true, released: vec![] }).unwrap();
    r.capture(1, 0, n, true).unwrap()
}

/// A stored state goes only into the layout that made it: the digest names the layout, and a
/// restore of another layout's state (or of uneven head shares on the wrong ranks) is refused
/// with an error, changing nothing.
#[test]
fn states_stay_in_their_layout() {
    let c = ck("k3_small_mxfp4");
    let start = |p| ThreadRunner::start(&c, p, StateDType::F32).unwrap();
    let mut digests: Vec<String> = layouts().into_iter().map(|p| start(p).prefix_support().unwrap()).collect();
    digests.push(ThreadRunner::single(Arc::new(k3_model::Model::load(&c).unwrap()), StateDType::F32).prefix_support().unwrap());
    assert!(digests[0].contains("--tp 2 --ep 2 --pp 1"), "{}", digests[0]);
    let mut unique = digests.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), digests.len(), "{digests:?}");
    // A --pp 2 state (every KDA layer whole) into --tp 2 (heads split): refused.
    let pp = captured(&mut start(par(1, None, 2)), 16);
    let mut tp = start(par(2, None, 1));
    let cells: Vec<&Segment> = pp.cells.iter().collect();
    let e = tp.restore(2, &cells, pp.kda.as_ref().unwrap()).unwrap_err().to_string();
    assert!(e.contains("another model or layout"), "{e}");
    // --tp 2's own state with the ranks' uneven shares (2 + 1 heads) swapped: refused by a rank.
    let mut own = captured(&mut tp, 16);
    for l in &mut own.kda.as_mut().unwrap().layers {
        if let SnapLayer::Ranks(v) = l {
            v.swap(0, 1);
        }
    }
    let cells: Vec<&Segment> = own.cells.iter().collect();
    let e = tp.restore(3, &cells, own.kda.as_ref().unwrap()).unwrap_err().to_string();
    assert!(e.contains("not shaped as this rank's"), "{e}");
}

/// The latent and indexer-key pages of a capture's cells, `[cell][layer]` (none for a KDA
/// layer, a layer of another stage, or indexer keys without DSA): the page objects the rank that
/// captured holds, or the pool's.
fn cell_pages(c: &Capture) -> Vec<Vec<Vec<Arc<Page>>>> {
    let pages = |l: &SegLayer| match l {
        SegLayer::Mla { latent, index_keys } => [latent, index_keys].into_iter().filter(|p| !p.values().is_empty()).map(|p| p.page().clone()).collect(),
        _ => Vec::new(),
    };
    c.cells.iter().map(|cell| cell.layers.iter().map(pages).collect()).collect()
}

/// Whether every page `held` has is `want`'s page of the same cell and layer (the layers `held`
/// has none of skipped), and how many pages that was.
fn same_pages(held: &[Vec<Vec<Arc<Page>>>], want: &[Vec<Vec<Arc<Page>>>]) -> (bool, usize) {
    let pairs: Vec<(&Arc<Page>, &Vec<Arc<Page>>)> =
        held.iter().zip(want).flat_map(|(h, w)| h.iter().zip(w)).filter(|(h, _)| !h.is_empty()).flat_map(|(h, w)| h.iter().map(move |p| (p, w))).collect();
    let all = held
        .iter()
        .zip(want)
        .all(|(h, w)| h.iter().zip(w).all(|(h, w)| h.is_empty() || (h.len() == w.len() && h.iter().zip(w).all(|(x, y)| Arc::ptr_eq(x, y)))));
    (all, pairs.len())
}

/// One plain forward of `tokens` for sequence `id`: its last logits row, as bits.
fn forward(r: &mut ThreadRunner, id: u64, tokens: &[u32]) -> Vec<u32> {
    let out = r.forward(Step { seqs: vec![StepSeq { id, tokens: tokens.to_vec(), rows: None }], last_only: true, released: vec![] }).unwrap();
    out.iter().map(|x| x.to_bits()).collect()
}

/// A layout's runner with pages of `grid` rows (as an engine with the prefix cache sets it).
fn paged(name: &str, p: Parallel, grid: usize) -> ThreadRunner {
    let mut r = ThreadRunner::start(&ck(name), p, StateDType::F32).unwrap();
    r.set_page_rows(grid);
    r
}

/// Through the engine, with a grid of 64 (not the default page size: the runner sizes every
/// rank's pages to the grid): a sequence resumed at 256 holds the pool's own pages of its first
/// four cells in every MLA layer rank 0 holds, and so does the same sequence on every other rank
/// of rank 0's stage — the pool's handle plus one per rank of the stage, nobody else's (on
/// `--tp 2`, `--ep 2`: 3; on `--pp 2`: 2) — and a tail page of its own; its output equals a cold
/// engine's bit for bit. A runner that sends the peers their restored part as bytes (copies)
/// fails the count on `--tp 2` and `--ep 2`.
#[test]
fn the_pools_pages_are_held_by_every_rank_of_their_stage() {
    const G: usize = 64;
    for (name, p) in [("tiny", par(2, None, 1)), ("tiny", par(1, Some(2), 1)), ("k3_small_mxfp4", par(1, None, 2))] {
        let (mut e, log) = engine_grid(name, p, G, None);
        let a = ids(name, 3, 4 * G + 50); // a snapshot at 256
        run(&mut e, &log, std::slice::from_ref(&a), 2, &[]);
        let mut b = a[..4 * G + 10].to_vec();
        b.extend(ids(name, 4, 7));
        let id = e.add(Request::new(b.clone(), SamplingParams::greedy(), 3)).unwrap();
        let mut toks: Vec<u32> = e.step().unwrap().iter().map(|ev| ev.token).collect();
        assert_eq!(toks.len(), 1, "{name} {p:?}: one prefill step past 256");
        let st = e.runner().seq_state(id).expect("rank 0's state");
        let held: Vec<_> = st
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Mla(c) if c.latent.rows() > 0 => Some(&c.latent),
                _ => None,
            })
            .collect();
        assert!(!held.is_empty(), "{name} {p:?}");
        let holders = 1 + p.stage_ranks();
        for rows in held {
            assert_eq!((rows.page_rows(), rows.pages().len()), (G, 5), "{name} {p:?}");
            for pg in &rows.pages()[..4] {
                assert!(
                    pg.is_stored() && Arc::strong_count(pg) == holders,
                    "{name} {p:?}: the pool's page, held by {} handles (pool + every rank of the stage)",
                    Arc::strong_count(pg)
                );
            }
            assert!(!rows.pages()[4].is_stored() && Arc::strong_count(&rows.pages()[4]) == 1, "{name} {p:?}: its own tail page");
        }
        while e.has_work() {
            toks.extend(e.step().unwrap().iter().map(|ev| ev.token));
        }
        assert_eq!(e.prefix_status().unwrap().unwrap().hits, 1);
        let warm_rows: Vec<Vec<u32>> = log.lock().unwrap()[&id].iter().rev().take(3).rev().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect();
        let (mut c, clog) = engine_grid(name, p, G, None);
        let cold = run(&mut c, &clog, &[b], 3, &[]).pop().unwrap().unwrap();
        assert_eq!((toks, warm_rows), (cold.tokens, cold.rows), "{name} {p:?}: warm on shared pages = cold, bit for bit");
    }
}

/// Every rank of a layout, inspected through its own part of a capture (its page objects): the
/// pool keeps each stage's first rank's own pages (on `--pp 2` rank 1's, on `--tp 2 --pp 2`
/// ranks 0's and 2's); two sequences restored from it hold those very pages on every rank, each
/// computes the next cell into a page of its own; a restored sequence costs its KDA states only
/// (the pool has its rows), and once the pool lets go of the pages they are charged once —
/// whatever the ranks and sequences holding them; the logits equal a cold runner's bit for bit.
/// `--tp 2` and `--pp 2` (tiny: every second-stage layer is MLA) and `--tp 2 --pp 2` (tiny DSA:
/// indexer-key pages too). Mutants seen failing: a restore sent to the peers as bytes; the peers
/// not told the page size; every rank charging the pages its stage shares.
#[test]
fn worker_ranks_share_pages_and_charge_them_once() {
    const G: usize = 64;
    for (name, p) in [("tiny", par(2, None, 1)), ("tiny", par(1, None, 2)), ("tiny_dsa", par(2, None, 2))] {
        let what = format!("{name} {p:?}");
        let plans = p.plans(&ck(name).config).unwrap();
        let mut r = paged(name, p, G);
        let (a, b, c) = (ids(name, 3, 4 * G), ids(name, 4, G), ids(name, 5, G));
        forward(&mut r, 1, &a);
        let pool = r.capture(1, 0, G, true).unwrap();
        let stored = cell_pages(&pool);
        // Each rank's pages of the four cells (none on the first stage of tiny's --pp 2: KDA only).
        let mut per_rank = Vec::new();
        for (plan, part) in plans.iter().zip(r.capture_parts(1, 0, G, false).unwrap()) {
            let (same, n) = same_pages(&cell_pages(&part), &stored);
            assert!(n == 0 || same == (plan.local == 0), "{what} rank {}: the pool keeps its stage's first rank's own pages", plan.rank);
            per_rank.push(n);
        }
        assert!(per_rank.iter().sum::<usize>() > 0, "{what}: no MLA layer");
        let pages_of = |rank: usize| per_rank[rank];
        r.release(99); // every rank answers with its state bytes as they are now
        let before = r.state_bytes();
        let kda: usize = r.capture_parts(1, 4 * G, G, true).unwrap().iter().map(|c| c.kda.as_ref().unwrap().bytes()).sum();
        let (cells, snap): (Vec<&Segment>, _) = (pool.cells.iter().collect(), pool.kda.as_ref().unwrap());
        r.restore(2, &cells, snap).unwrap();
        r.restore(3, &cells, snap).unwrap();
        assert_eq!(r.state_bytes(), before + 2 * kda, "{what}: a restored sequence is charged its KDA states only, on every rank");
        for (rank, part) in r.capture_parts(2, 0, G, false).unwrap().iter().enumerate() {
            let (same, n) = same_pages(&cell_pages(part), &stored);
            assert!(same && n == pages_of(rank), "{what} rank {rank}: the restored sequence holds the pool's pages");
        }
        let (wb, wc) = (forward(&mut r, 2, &b), forward(&mut r, 3, &c));
        let cold = |x: &[u32]| {
            let mut r = ThreadRunner::start(&ck(name), p, StateDType::F32).unwrap(); // default pages
            forward(&mut r, 1, &a);
            forward(&mut r, 1, x)
        };
        assert!(wb == cold(&b) && wc == cold(&c), "{what}: warm logits are not bit-equal to a cold runner's");
        let (pb, pc) = (r.capture_parts(2, 0, G, false).unwrap(), r.capture_parts(3, 0, G, false).unwrap());
        for (rank, (xb, xc)) in pb.iter().zip(&pc).enumerate() {
            let (xb, xc) = (cell_pages(xb), cell_pages(xc));
            assert!(same_pages(&xb[..4], &stored).0 && same_pages(&xc[..4], &stored).0, "{what} rank {rank}: the shared cells after a step");
            let (own, n) = same_pages(&xb[4..], &xc[4..]);
            assert!(n == pages_of(rank) / 4 && (n == 0 || !own), "{what} rank {rank}: each sequence's next cell is a page of its own");
        }
        drop((pb, pc));
        r.release(99);
        let held = r.state_bytes();
        let shared: usize = pool.cells.iter().map(Segment::bytes).sum(); // one copy per stage
        drop((stored, cells));
        drop(pool);
        r.release(99);
        assert_eq!(r.state_bytes(), held + shared, "{what}: pages the pool let go of are charged once");
        (1..=3).for_each(|id| r.release(id));
        assert_eq!(r.state_bytes(), 0, "{what}");
    }
}

/// A speculative rollback that ends inside a page the pool holds: every rank keeps a private
/// copy of the kept rows and the pool's page is untouched (its values, and the cells a restore
/// would get), the following step's logits equal a runner's that never shared (bit for bit), on
/// `--tp 2` and `--pp 2`. Mutants seen failing: the truncation keeping the shared page as it is;
/// the truncation cutting the shared page in place.
#[test]
fn a_rollback_into_a_shared_page_copies_it_on_every_rank() {
    const G: usize = 64;
    for p in [par(2, None, 1), par(1, None, 2)] {
        let name = "tiny";
        let (a, y) = (ids(name, 6, 4 * G), ids(name, 7, 5));
        // Prefill to 4G − 8, the last 8 tokens as a verify forward, 5 of them rolled back.
        let run = |r: &mut ThreadRunner, share: bool| {
            forward(r, 1, &a[..4 * G - 8]);
            r.verify(Step { seqs: vec![StepSeq { id: 1, tokens: a[4 * G - 8..].to_vec(), rows: None }], last_only: false, released: vec![] }).unwrap();
            let held = share.then(|| (r.capture(1, 0, G, false).unwrap(), r.capture_parts(1, 0, G, false).unwrap()));
            r.rollback(1, 5).unwrap();
            (held, forward(r, 1, &y))
        };
        let mut r = paged(name, p, G);
        let (held, warm) = run(&mut r, true);
        let (pool, then) = held.unwrap();
        let values = |c: &Capture| cell_pages(c).iter().flatten().flatten().map(|pg| pg.values().to_vec()).collect::<Vec<_>>();
        let before = {
            let mut cold = paged(name, p, G);
            forward(&mut cold, 1, &a[..4 * G - 8]);
            cold.verify(Step { seqs: vec![StepSeq { id: 1, tokens: a[4 * G - 8..].to_vec(), rows: None }], last_only: false, released: vec![] }).unwrap();
            values(&cold.capture(1, 0, G, false).unwrap())
        };
        assert_eq!(values(&pool), before, "{p:?}: the pool's pages after the rollback");
        let mut pages = 0; // tiny's first stage of --pp 2 has no MLA layer
        for (rank, (then, now)) in then.iter().zip(r.capture_parts(1, 0, G, false).unwrap()).enumerate() {
            let (then, now) = (cell_pages(then), cell_pages(&now));
            let (kept, n) = same_pages(&now[..3], &then[..3]);
            assert!(kept && n == 3 * then[3].iter().flatten().count(), "{p:?} rank {rank}: the whole pages before it stay shared");
            pages += n;
            assert!(
                now[3].iter().flatten().zip(then[3].iter().flatten()).all(|(x, y)| !Arc::ptr_eq(x, y)),
                "{p:?} rank {rank}: a private copy of the page it ends in"
            );
        }
        assert!(pages > 0, "{p:?}: no MLA layer");
        let (_, plain) = run(&mut ThreadRunner::start(&ck(name), p, StateDType::F32).unwrap(), false);
        assert!(warm == plain, "{p:?}: the step after the rollback differs from a runner that never shared");
    }
}
