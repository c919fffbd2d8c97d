//! The request script the runner tests share (`dist.rs`, `process.rs`): five concurrent greedy
//! requests of 4..40 tokens, one with its own input rows, through an engine configured to
//! prefill in small chunks between decode steps. Events come back as (sequence, token,
//! finished).

use std::sync::Arc;

use k3_engine::{Engine, EngineConfig, Event, Request, SamplingParams};

/// Small batches and chunks, so prefill chunks interleave with decode steps.
pub fn cfg() -> EngineConfig {
    EngineConfig { max_batch: 3, prefill_chunk: 5, max_step_tokens: 8, ..Default::default() }
}

/// Adds the script's five requests to `e` (sequence ids 1..=5 on a fresh engine).
pub fn add_script(e: &mut Engine) {
    let prompts: Vec<Vec<u32>> = (0..5u32).map(|i| (0..4 + 9 * i).map(|j| (5 + 31 * i + 17 * j) % 384).collect()).collect();
    for (i, p) in prompts.iter().enumerate() {
        let mut req = Request::new(p.clone(), SamplingParams::greedy(), 6 + i);
        if i == 2 {
            let rows: Vec<f32> = e.embed(p).unwrap().iter().map(|x| -x * 1.5).collect();
            req.prompt_embeds = Some(Arc::new(rows));
        }
        e.add(req).unwrap();
    }
}

/// Runs the script to the end on `e`; every step keeps within `e.config.max_batch`.
pub fn run_all(e: &mut Engine) -> Vec<(u64, u32, bool)> {
    add_script(e);
    let mut events = Vec::new();
    let mut steps = 0;
    while e.has_work() {
        assert!(e.num_running() <= e.config.max_batch);
        events.extend(e.step().unwrap().iter().map(|ev: &Event| (ev.seq, ev.token, ev.finish.is_some())));
        steps += 1;
        assert!(steps < 1000);
    }
    events
}
