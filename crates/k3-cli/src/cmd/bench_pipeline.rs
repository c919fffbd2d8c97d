//! `k3 bench --tp T --pp P [--batch B] [--prompt-len L] [--gen-len G] [--model DIR]`: a
//! pipeline layout's ranks as threads (CPU), pipelined steps (one per stage in flight) against
//! one step at a time, in one process (issue 26).
//!
//! Both runs serve the same B greedy requests (random prompts of L tokens, G tokens each,
//! `ignore_eos`) through the engine with continuous batching; each depth runs twice, in
//! alternation, and the faster run of each is kept. Reported per depth: wall seconds, output
//! tokens/s, steps, and whether every sequence's tokens equal the one-step-at-a-time run's
//! (they must: each sequence runs the same forwards in the same order, only the grouping of
//! sequences into steps differs).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{bail, Result};
use k3_engine::dist::runner::ThreadRunner;
use k3_engine::{Engine, EngineConfig, Request, SamplingParams};
use k3_model::{Checkpoint, Parallel};
use rand::{Rng, SeedableRng};

use super::bench::Args;

/// One run: wall seconds, engine steps, and each request's tokens.
type Run = (f64, usize, BTreeMap<u64, Vec<u32>>);

fn run_once(ck: &Checkpoint, par: Parallel, depth: usize, prompts: &[Vec<u32>], gen: usize) -> Result<Run> {
    let runner = ThreadRunner::start(ck, par, Default::default())?;
    let cfg = EngineConfig { max_batch: prompts.len(), pipeline_depth: Some(depth), ..Default::default() };
    let mut e = Engine::with_runner(Box::new(runner), None, cfg);
    let t0 = Instant::now();
    for p in prompts {
        e.add(Request { ignore_eos: true, ..Request::new(p.clone(), SamplingParams::greedy(), gen) })?;
    }
    let (mut steps, mut out) = (0, BTreeMap::<u64, Vec<u32>>::new());
    while e.has_work() {
        for ev in e.step()? {
            out.entry(ev.seq).or_default().push(ev.token);
        }
        steps += 1;
    }
    Ok((t0.elapsed().as_secs_f64(), steps, out))
}

pub fn bench_pipeline(a: &Args, par: Parallel) -> Result<()> {
    let (b, l, g) = (a.run.batch, a.run.prompt_len, a.run.gen_len);
    if par.pp < 2 {
        bail!("--pp {}: pipelined steps need at least 2 stages (the bench compares them with one step at a time)", par.pp);
    }
    if b == 0 || l == 0 || g == 0 {
        bail!("--prompt-len, --gen-len and --batch must be ≥ 1");
    }
    let dir = a.model.dir()?;
    let ck = Checkpoint::open(&dir)?;
    if l + g > ck.config.max_context() {
        bail!("--prompt-len + --gen-len = {} exceeds the model's context limit {}", l + g, ck.config.max_context());
    }
    let vocab = ck.config.text.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let prompts: Vec<Vec<u32>> = (0..b).map(|_| (0..l).map(|_| rng.random_range(0..vocab)).collect()).collect();
    let depths = [1, par.pp];
    let mut best: [Option<Run>; 2] = [None, None];
    for _round in 0..2 {
        for (k, &d) in depths.iter().enumerate() {
            let r = run_once(&ck, par, d, &prompts, g)?;
            if best[k].as_ref().is_none_or(|x| r.0 < x.0) {
                best[k] = Some(r);
            }
        }
    }
    let [Some(one), Some(piped)] = best else { unreachable!("two rounds ran") };
    let tokens = b * g;
    let same = one.2 == piped.2;
    let row = |d: usize, r: &(f64, usize, BTreeMap<u64, Vec<u32>>)| serde_json::json!({ "depth": d, "wall_s": r.0, "output_tokens_per_s": tokens as f64 / r.0, "steps": r.1 });
    let j = serde_json::json!({
        "model": dir.display().to_string(), "tp": par.tp, "ep": par.ep, "pp": par.pp,
        "threads": rayon::current_num_threads(), "batch": b, "prompt_len": l, "gen_len": g,
        "one_step_at_a_time": row(1, &one), "pipelined": row(par.pp, &piped),
        "speedup": one.0 / piped.0, "same_tokens": same,
    });
    if a.json {
        println!("{}", serde_json::to_string(&j)?);
    } else {
        println!("model      {}  --tp {} --ep {} --pp {} as threads ({} worker threads)", dir.display(), par.tp, par.ep, par.pp, rayon::current_num_threads());
        println!("workload   {b} requests × ({l} prompt + {g} generated) tokens, greedy, best of 2");
        for (name, d, r) in [("one step at a time", 1, &one), ("pipelined", par.pp, &piped)] {
            println!("{name:<20} depth {d}: {:.2} s, {:.1} tok/s, {} steps", r.0, tokens as f64 / r.0, r.1);
        }
        println!("speed-up   {:.2}×   same tokens: {same}", one.0 / piped.0);
    }
    if !same {
        bail!("the pipelined run's tokens differ from one step at a time");
    }
    Ok(())
}
