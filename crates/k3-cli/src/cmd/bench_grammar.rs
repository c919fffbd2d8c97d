//! `k3 bench --json-schema FILE [--model DIR] [--prompt-len P] [--gen-len G] [--batch B]`: the cost
//! of grammar-constrained decoding, in one process. The same B requests (random prompt ids,
//! temperature 1, seeds 1..B) run through the engine without a constraint and with the schema,
//! alternating three times (U C U C U C) so drift hits both; the unconstrained runs ignore the end of
//! sentence so they decode G tokens, the constrained ones end when the schema's value is
//! complete. Reported per decoded token: the median over decode steps (all sequences decoding)
//! of the step's wall time ÷ its tokens, the mask compute time (on the mask workers, overlapping the forward), the part of
//! it the sampler waited for (the critical-path cost), and the slowest mask; plus the schema's
//! compile time.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use k3_engine::{Engine, EngineConfig, GrammarEnv, GrammarSpec, Request, SamplingParams};
use k3_model::{Checkpoint, Model};
use k3_tokenizer::Tokenizer;
use rand::{Rng, SeedableRng};

use super::bench::{median_of, Args};

/// One pass: decode tokens, each decode step's wall time per token, and the summed mask counters.
#[derive(Default)]
struct Pass {
    tokens: usize,
    per_token: Vec<f64>,
    masks: usize,
    compute: Duration,
    wait: Duration,
    max: Duration,
}

fn one_pass(model: &Arc<Model>, tok: &Arc<Tokenizer>, prompts: &[Vec<u32>], gen: usize, c: Option<&k3_engine::Constraint>) -> Result<Pass> {
    let mut e = Engine::new(model.clone(), Some(tok.clone()), EngineConfig { max_batch: prompts.len(), ..Default::default() });
    for (i, p) in prompts.iter().enumerate() {
        let mut r = Request::new(p.clone(), SamplingParams { temperature: 1.0, seed: Some(i as u64 + 1), ..Default::default() }, gen);
        r.ignore_eos = c.is_none();
        r.constraint = c.cloned();
        e.add(r)?;
    }
    let mut pass = Pass::default();
    let mut started = vec![false; prompts.len()];
    while e.has_work() {
        let all_decoding = started.iter().all(|&s| s);
        let t = Instant::now();
        let evs = e.step()?;
        let dt = t.elapsed();
        if all_decoding && !evs.is_empty() {
            pass.per_token.push(dt.as_secs_f64() * 1e6 / evs.len() as f64);
            pass.tokens += evs.len();
        }
        for ev in &evs {
            if let Some(msg) = &ev.error {
                bail!("the constraint failed: {msg}");
            }
            started[(ev.seq - 1) as usize] = true;
        }
        for (_, st) in e.take_finished_stats() {
            pass.masks += st.mask.masks;
            pass.compute += st.mask.compute;
            pass.wait += st.mask.wait;
            pass.max = pass.max.max(st.mask.max);
        }
    }
    Ok(pass)
}

/// Rounds of (unconstrained, constrained) passes.
const ROUNDS: usize = 3;

pub fn bench_grammar(a: &Args, schema_file: &Path) -> Result<()> {
    if a.run.prompt_len == 0 || a.run.gen_len < 2 || a.run.batch == 0 {
        bail!("--prompt-len and --batch must be ≥ 1 and --gen-len ≥ 2");
    }
    let text = std::fs::read_to_string(schema_file).with_context(|| format!("--json-schema {}", schema_file.display()))?;
    let schema: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("--json-schema {}: not JSON", schema_file.display()))?;
    let dir = a.model.dir()?;
    let model = Arc::new(Model::load(&Checkpoint::open(&dir)?)?);
    let tok = Arc::new(Tokenizer::from_dir(&dir).with_context(|| format!("the tokenizer of {}", dir.display()))?);
    let cfg = &model.config;
    if a.run.prompt_len + a.run.gen_len > cfg.max_context() {
        bail!("--prompt-len + --gen-len exceeds the model's context limit {}", cfg.max_context());
    }
    let t = Instant::now();
    let env = GrammarEnv::new(tok.clone(), cfg.text.vocab_size, cfg.eos_token_ids[0])?;
    let env_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let c = env.compile(&GrammarSpec::json(schema)).map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", schema_file.display()))?;
    let compile_s = t.elapsed().as_secs_f64();
    let vocab = cfg.text.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let prompts: Vec<Vec<u32>> =
        (0..a.run.batch).map(|_| (0..a.run.prompt_len).map(|_| rng.random_range(0..tok.n_ranks() as u32).min(vocab - 1)).collect()).collect();
    let (mut free, mut cons) = (Pass::default(), Pass::default());
    for _ in 0..ROUNDS {
        let f = one_pass(&model, &tok, &prompts, a.run.gen_len, None)?;
        let g = one_pass(&model, &tok, &prompts, a.run.gen_len, Some(&c))?;
        for (acc, p) in [(&mut free, f), (&mut cons, g)] {
            acc.tokens += p.tokens;
            acc.per_token.extend(p.per_token);
            acc.masks += p.masks;
            acc.compute += p.compute;
            acc.wait += p.wait;
            acc.max = acc.max.max(p.max);
        }
    }
    if free.tokens == 0 || cons.tokens == 0 || cons.masks == 0 {
        bail!("no decode step was timed: raise --gen-len (the schema's values completed during the first step)");
    }
    let us = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n as f64;
    let free_us = median_of(&mut free.per_token);
    let cons_us = median_of(&mut cons.per_token);
    let r = serde_json::json!({
        "model": dir.display().to_string(), "schema": schema_file.display().to_string(),
        "threads": rayon::current_num_threads(), "batch": a.run.batch, "prompt_len": a.run.prompt_len, "gen_len": a.run.gen_len,
        "grammar_env_s": env_s, "schema_compile_s": compile_s,
        "unconstrained_decode_tokens": free.tokens, "constrained_decode_tokens": cons.tokens,
        "unconstrained_us_per_token": free_us, "constrained_us_per_token": cons_us,
        "overhead_us_per_token": cons_us - free_us, "overhead_fraction": cons_us / free_us - 1.0,
        "mask_compute_us_per_token": us(cons.compute, cons.masks), "mask_wait_us_per_token": us(cons.wait, cons.masks),
        "mask_max_us": cons.max.as_secs_f64() * 1e6,
    });
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "model {} · schema {} · batch {} · prompt {} · gen ≤ {} · {} threads",
            dir.display(),
            schema_file.display(),
            a.run.batch,
            a.run.prompt_len,
            a.run.gen_len,
            rayon::current_num_threads()
        );
        println!("token trie + factory {:.1} ms · schema compile {:.2} ms", env_s * 1e3, compile_s * 1e3);
        println!("decode, per token (median over steps of step wall time ÷ tokens): unconstrained {free_us:.0} µs ({} tokens) · constrained {cons_us:.0} µs ({} tokens) · overhead {:+.0} µs ({:+.1}%)", free.tokens, cons.tokens, cons_us - free_us, (cons_us / free_us - 1.0) * 100.0);
        println!(
            "mask per token: compute {:.0} µs (on the mask workers, overlapping the forward) · waited for {:.0} µs (critical path) · slowest {:.0} µs",
            us(cons.compute, cons.masks),
            us(cons.wait, cons.masks),
            cons.max.as_secs_f64() * 1e6
        );
    }
    Ok(())
}
