//! The GPU half of `k3 bench --device cuda --speculative ...` (feature `cuda`; the workloads are
//! `bench_spec.rs`'s): what a verify step of `k + 1` rows per sequence costs against a plain
//! decode step, at each batch of `--batches` and `--context` tokens of context, on `--model` —
//! the ceiling of the speed-up (random weights accept nothing, so acceptance is measured on the
//! workloads instead).
//!
//! Per batch: the plain step as the server runs it (captured graph, logits downloaded) and
//! eager; the verify step for k = 1, 2, 4, 8, every row's logits downloaded, eager
//! (`CudaModel::forward_verify`) and replayed from its CUDA graph (`CudaModel::verify_step`,
//! as the GPU runner runs it; a shape the graph cannot capture prints why); and the rollback
//! that keeps only the first row (each KDA layer restores its checkpoint and replays one row):
//! eager per sequence after the eager step (`CudaModel::rollback`, the reference) and, beside
//! it, replayed from the verify graph's rollback graph after the replayed step
//! (`RollbackRun::Replay`, as the GPU runner runs it).
//! Wall-clock medians of `--repeats` (≤ 20) after `--warmup` (≤ 5); the sequences are moved
//! back to the same context after each call.
//! Beside each figure, its HBM floor (bytes ÷ the copy bandwidth measured here). `--profile`
//! adds, per batch, the GPU time of every sublayer of a step of 1 row per sequence beside one of
//! 5 rows (the verify of k = 4 without its checkpoints: where the extra rows cost).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_core::cuda::CudaDevice;
use k3_model::capacity::KvDtype;
use k3_model::cuda::{CacheConfig, CudaModel, CudaSeqState, Input, RollbackRun, VerifyRun};
use k3_model::Checkpoint;
use rand::{Rng, SeedableRng};

use super::bench::Args;
use super::bench_cuda::{copy_bandwidth, floor_bytes_rows, median, traced};

/// Draft counts timed.
const KS: [usize; 4] = [1, 2, 4, 8];

type Seqs = Vec<CudaSeqState>;

/// Wall-clock median of `f` (`warm` untimed calls, then `reps`), each call preceded by `before`
/// and followed by `after`, outside the timer.
fn wall(
    m: &mut CudaModel,
    seqs: &mut Seqs,
    (warm, reps): (usize, usize),
    mut before: impl FnMut(&mut CudaModel, &mut Seqs) -> Result<()>,
    mut f: impl FnMut(&mut CudaModel, &mut Seqs) -> Result<()>,
    mut after: impl FnMut(&mut CudaModel, &mut Seqs) -> Result<()>,
) -> Result<f64> {
    let mut t = Vec::new();
    for i in 0..warm + reps {
        before(m, seqs)?;
        m.dev.synchronize()?;
        let t0 = Instant::now();
        f(m, seqs)?;
        m.dev.synchronize()?;
        if i >= warm {
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        after(m, seqs)?;
    }
    t.sort_by(f64::total_cmp);
    Ok(median(&t))
}

fn refs(seqs: &mut Seqs) -> Vec<&mut CudaSeqState> {
    seqs.iter_mut().collect()
}

/// Every sequence keeps only the first row of the last verify step (eager, per sequence).
fn keep_first(m: &mut CudaModel, seqs: &mut Seqs, rows: usize) -> Result<()> {
    keep_first_as(m, seqs, rows, RollbackRun::PerSequence)
}

/// [`keep_first`] run as `how` says.
fn keep_first_as(m: &mut CudaModel, seqs: &mut Seqs, rows: usize, how: RollbackRun<'_>) -> Result<()> {
    let mut r: Vec<(&mut CudaSeqState, usize)> = seqs.iter_mut().map(|s| (s, rows - 1)).collect();
    Ok(m.rollback_as(&mut r, how)?)
}

/// Moves every sequence back by one token (the context stays the same from call to call).
fn back(_: &mut CudaModel, seqs: &mut Seqs) -> Result<()> {
    seqs.iter_mut().for_each(|s| s.pos -= 1);
    Ok(())
}

fn nothing(_: &mut CudaModel, _: &mut Seqs) -> Result<()> {
    Ok(())
}

pub fn verify_costs(ck: &Checkpoint, a: &Args) -> Result<serde_json::Value> {
    let batches: Vec<usize> =
        a.gpu.batches.split(',').map(|s| s.trim().parse::<usize>().with_context(|| format!("--batches: `{s}` is not a batch size"))).collect::<Result<_>>()?;
    if batches.contains(&0) || a.gpu.context == 0 {
        bail!("--batches and --context must be ≥ 1");
    }
    let (ctx, wr) = (a.gpu.context, (a.timing.warmup.min(5), a.timing.repeats.clamp(1, 20)));
    let max_b = batches.iter().copied().max().unwrap_or(1);
    let kv = KvDtype::parse(&a.gpu.kv_cache_dtype).with_context(|| format!("--kv-cache-dtype `{}` is not one of bf16, fp8", a.gpu.kv_cache_dtype))?;
    let dev = CudaDevice::new(0)?;
    let bw = copy_bandwidth(&dev)?;
    let per_seq = ctx + KS[KS.len() - 1] + 2 + 64;
    let mut m = CudaModel::load(ck, &dev, CacheConfig { max_seqs: max_b + 2, max_tokens: (max_b + 2) * per_seq, kv_cache_dtype: kv })?;
    let vocab = m.config.text.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(22);
    let mut random = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    println!("verify     copy bw {:.0} GB/s; context {ctx}; wall-clock medians of {}", bw / 1e9, wr.1);
    let mut out = Vec::new();
    for &b in &batches {
        let mut seqs: Seqs = (0..b).map(|_| m.new_sequence()).collect::<k3_model::Result<_>>()?;
        for s in seqs.iter_mut() {
            let p = random(ctx);
            m.forward_varlen(Input::Tokens(&p), &[ctx], &mut [s], true)?;
        }
        let toks = random(b);
        let g = m.capture_decode(b, per_seq)?;
        let graph = wall(&mut m, &mut seqs, wr, nothing, |m, s| Ok(m.decode_step(&g, &toks, &mut refs(s)).map(|_| ())?), back)?;
        drop(g);
        let ones = vec![1; b];
        let eager = wall(&mut m, &mut seqs, wr, nothing, |m, s| Ok(m.forward_varlen(Input::Tokens(&toks), &ones, &mut refs(s), true).map(|_| ())?), back)?;
        let floor1 = floor_bytes_rows(&m, b, b, ctx) / bw * 1e3;
        println!("verify     B={b:>3}: plain decode step {graph:.3} ms (graph, logits downloaded), {eager:.3} ms eager; floor {floor1:.3} ms");
        let mut ks = Vec::new();
        for k in KS {
            let rows = k + 1;
            let (vt, lens) = (random(b * rows), vec![rows; b]);
            let run = |m: &mut CudaModel, s: &mut Seqs| -> Result<()> { Ok(m.forward_verify(Input::Tokens(&vt), &lens, &mut refs(s)).map(|_| ())?) };
            let verify = wall(&mut m, &mut seqs, wr, nothing, run, |m, s| {
                keep_first(m, s, rows)?;
                back(m, s)
            })?;
            // The rollback alone, keeping the first row: restore + a one-row replay per KDA layer.
            let rollback = wall(&mut m, &mut seqs, wr, run, |m, s| keep_first(m, s, rows), back)?;
            // The same step replayed from its graph, and its rollback from the rollback graph
            // (the GPU runner's way).
            let (captured, rollback_graph) = match m.verify_capturable(b, rows) {
                Ok(()) => {
                    let vg = m.capture_verify(b, rows, per_seq, true)?;
                    let replay =
                        |m: &mut CudaModel, s: &mut Seqs| -> Result<()> { Ok(m.verify_step(&vg, &vt, &lens, &mut refs(s), VerifyRun::Replay).map(|_| ())?) };
                    let undo = |m: &mut CudaModel, s: &mut Seqs| keep_first_as(m, s, rows, RollbackRun::Replay(&vg));
                    let v = wall(&mut m, &mut seqs, wr, nothing, replay, |m, s| {
                        undo(m, s)?;
                        back(m, s)
                    })?;
                    (Some(v), Some(wall(&mut m, &mut seqs, wr, replay, undo, back)?))
                }
                Err(why) => {
                    println!("verify     B={b:>3} k={k}: no graph ({why}); eager only");
                    (None, None)
                }
            };
            let floor = floor_bytes_rows(&m, b * rows, b, ctx) / bw * 1e3;
            let best = captured.unwrap_or(verify);
            let best_rollback = rollback_graph.unwrap_or(rollback);
            let graphed = captured.map_or(String::new(), |c| format!(", graph {c:.3} ms ({:.2}x eager)", c / verify));
            let rolled = rollback_graph.map_or(String::new(), |r| format!(", {r:.3} ms from its graph"));
            println!(
                "verify     B={b:>3} k={k}: eager {verify:.3} ms{graphed}; {:.2}x the plain graph step (floor {floor:.3} ms), rollback to 1 row {rollback:.3} ms eager{rolled}; break-even at {:.2} tokens per step",
                best / graph,
                (best + best_rollback) / graph
            );
            ks.push(serde_json::json!({"k": k, "verify_ms": verify, "verify_graph_ms": captured, "rollback_ms": rollback, "rollback_graph_ms": rollback_graph, "floor_ms": floor, "ratio_to_plain_graph": best / graph}));
        }
        if a.gpu.profile {
            profile_rows(&mut m, &mut seqs, 5, &mut random)?;
        }
        out.push(serde_json::json!({"batch": b, "plain_graph_ms": graph, "plain_eager_ms": eager, "plain_floor_ms": floor1, "verify": ks}));
        for s in seqs {
            m.release(s);
        }
    }
    Ok(serde_json::json!({"context": ctx, "copy_gb_s": bw / 1e9, "batches": out}))
}

/// Per sublayer (CUDA events), a step of 1 row per sequence beside one of `rows` rows per
/// sequence (the sequences moved back after each): the eager forwards (last-row logits).
fn profile_rows(m: &mut CudaModel, seqs: &mut Seqs, rows: usize, random: &mut impl FnMut(usize) -> Vec<u32>) -> Result<()> {
    let dev = m.dev.clone();
    let b = seqs.len();
    let run = |m: &mut CudaModel, seqs: &mut Seqs, r: usize, t: &[u32]| -> Result<Vec<(String, f64)>> {
        let lens = vec![r; b];
        traced(m, &dev, t, &lens, &mut refs(seqs))?; // warm-up of the shapes
        seqs.iter_mut().for_each(|s| s.pos -= r);
        let marks = traced(m, &dev, t, &lens, &mut refs(seqs))?;
        seqs.iter_mut().for_each(|s| s.pos -= r);
        Ok(marks)
    };
    let (one, many) = (run(m, seqs, 1, &random(b))?, run(m, seqs, rows, &random(b * rows))?);
    println!("profile    eager step of 1 vs {rows} rows per sequence, batch {b} (ms from the previous mark):");
    for ((name, a), (_, c)) in one.iter().zip(&many) {
        println!("  {name:<20} {a:8.4} {c:8.4}");
    }
    let sum = |v: &[(String, f64)]| v.iter().map(|x| x.1).sum::<f64>();
    println!("  {:<20} {:8.4} {:8.4}", "total", sum(&one), sum(&many));
    Ok(())
}
