//! `/metrics` speculative-decoding lines (issue 22): the engine's counters as the scheduler copies
//! them, rendered as Prometheus counters and gauges with one series per draft position; and the
//! real engine as a `Backend` reports its totals.

use std::sync::Arc;

use k3_engine::spec::{Draft, Proposer};
use k3_engine::{Engine, EngineConfig, Request, SamplingParams, SpecConfig, SpecMethod, SpecStats};
use k3_model::{Checkpoint, Model};
use k3_server::backend::Backend;
use k3_server::metrics::Metrics;

#[test]
fn spec_counters_render() {
    let m = Metrics::default();
    let mut s = SpecStats::default();
    s.record(4, 2, 3);
    s.record(0, 0, 1);
    *m.spec.lock().unwrap() = s;
    let out = m.render("nano");
    for line in [
        "k3_spec_decode_steps_total{model=\"nano\"} 2",
        "k3_spec_emitted_tokens_total{model=\"nano\"} 4",
        "k3_spec_draft_tokens_total{model=\"nano\"} 4",
        "k3_spec_accepted_tokens_total{model=\"nano\"} 2",
        "k3_spec_accepted_per_step{model=\"nano\"} 2",
        "k3_spec_draft_acceptance{model=\"nano\"} 0.5",
        "k3_spec_position_drafted_total{model=\"nano\",position=\"3\"} 1",
        "k3_spec_position_accepted_total{model=\"nano\",position=\"1\"} 1",
        "k3_spec_position_accepted_total{model=\"nano\",position=\"2\"} 0",
    ] {
        assert!(out.lines().any(|l| l == line), "missing `{line}` in:\n{out}");
    }
}

struct Repeat;

impl Proposer for Repeat {
    fn propose(&mut self, context: &[u32], k: usize) -> Draft {
        Draft { tokens: vec![context[context.len() - 1]; k.min(2)], probs: None }
    }
}

#[test]
fn engine_backend_reports_totals() {
    let dir = format!("{}/../../models/k3-nano", env!("CARGO_MANIFEST_DIR"));
    let model = Arc::new(Model::load(&Checkpoint::open(std::path::Path::new(&dir)).unwrap()).unwrap());
    let cfg = EngineConfig { spec: SpecConfig { method: SpecMethod::Ngram, num_tokens: 4, adaptive: true }, ..Default::default() };
    let mut e = Engine::new(model, None, cfg);
    // A proposer that always drafts (the last token twice), so that drafts are verified.
    e.set_proposer(Arc::new(|_r: &Request| Box::new(Repeat) as Box<dyn Proposer>));
    let p: Vec<u32> = [100u32, 200, 300, 400].iter().copied().cycle().take(24).collect();
    Backend::add(&mut e, Request::new(p, SamplingParams::greedy(), 24)).unwrap();
    let mut n = 0;
    while e.has_work() {
        n += Backend::step(&mut e).unwrap().len();
    }
    let s = Backend::spec_stats(&e);
    assert_eq!(s.emitted as usize, n - 1, "every token after the first comes from a decode step");
    assert!(s.drafted > 0);
}
