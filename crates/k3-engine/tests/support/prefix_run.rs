//! The request driver the prefix-cache tests share (`prefix.rs` on one CPU rank,
//! `prefix_parallel.rs` on parallel layouts): deterministic prompts, and a run of concurrent
//! greedy requests to the end that returns each one's tokens, the logits rows they were
//! sampled from (as bits, from the recording runner's log) and its cached tokens.
#![allow(dead_code)]

use k3_engine::{Engine, Request, SamplingParams};

use super::recorder::Log;

/// A deterministic prompt of `n` ids below `vocab` from `seed`.
pub fn prompt_ids(vocab: u32, seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|j| (seed.wrapping_mul(2654435761).wrapping_add(j.wrapping_mul(40503)) >> 7) % vocab).collect()
}

/// One request's result: tokens, the logits rows they were sampled from, cached tokens.
#[derive(Debug, PartialEq)]
pub struct Out {
    pub tokens: Vec<u32>,
    pub rows: Vec<Vec<u32>>,
    pub cached: usize,
}

/// Runs `prompts` concurrently on `e` to the end; `cancel_at`: (index, step) pairs cancelled then.
pub fn run(e: &mut Engine, log: &Log, prompts: &[Vec<u32>], n: usize, cancel_at: &[(usize, usize)]) -> Vec<Option<Out>> {
    run_reqs(e, log, prompts.iter().map(|p| Request::new(p.clone(), SamplingParams::greedy(), n)).collect(), cancel_at)
}

/// [`run`] with whole requests.
pub fn run_reqs(e: &mut Engine, log: &Log, reqs: Vec<Request>, cancel_at: &[(usize, usize)]) -> Vec<Option<Out>> {
    let out = run_reqs_held(e, log, reqs, cancel_at);
    assert_eq!(e.state_bytes(), 0, "every sequence state freed");
    out
}

/// [`run`] without checking that every state is freed at the end (a multi-process runner's
/// workers drop the last ones with the next step).
pub fn run_held(e: &mut Engine, log: &Log, prompts: &[Vec<u32>], n: usize) -> Vec<Option<Out>> {
    run_reqs_held(e, log, prompts.iter().map(|p| Request::new(p.clone(), SamplingParams::greedy(), n)).collect(), &[])
}

fn run_reqs_held(e: &mut Engine, log: &Log, reqs: Vec<Request>, cancel_at: &[(usize, usize)]) -> Vec<Option<Out>> {
    let ids: Vec<u64> = reqs.into_iter().map(|r| e.add(r).unwrap()).collect();
    let mut toks: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    let mut cached = vec![0; ids.len()];
    let mut cancelled = vec![false; ids.len()];
    let mut step = 0;
    while e.has_work() {
        for &(i, at) in cancel_at {
            if at == step {
                assert!(e.cancel(ids[i]));
                cancelled[i] = true;
            }
        }
        for ev in e.step().unwrap() {
            let i = ids.iter().position(|&x| x == ev.seq).unwrap();
            toks[i].push(ev.token);
            cached[i] = ev.cached_tokens;
        }
        step += 1;
        assert!(step < 10_000);
    }
    let log = log.lock().unwrap();
    (0..ids.len())
        .map(|i| {
            (!cancelled[i]).then(|| {
                let all = &log[&ids[i]];
                let rows = all[all.len() - toks[i].len()..].iter().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect();
                Out { tokens: toks[i].clone(), rows, cached: cached[i] }
            })
        })
        .collect()
}
