//! The engine over a parallel layout (`dist::runner::ThreadRunner`: ranks as threads) equals
//! the engine over one model, on the golden K3 fixture `k3_small_mxfp4` (3 heads, 6 experts,
//! 6 layers, so most splits are uneven): the runner's logits for a scripted series of steps
//! (batched prefill, own input rows, decode, releases, every row or the last) match one rank's
//! at rel-L2 ≤ 1e-5 with the same argmax, and the engine with several concurrent sequences of
//! different lengths (chunked prefill interleaved with decode, one with its own rows) emits the
//! same tokens in the same order. A rank that fails or panics gives an error naming it, on
//! time, and the runner stays failed; bad layouts and multi-GPU are refused with the flag.

use std::sync::Arc;

use k3_engine::dist::runner::{self, Fault, Runner, RunnerSpec, Step, StepSeq, ThreadRunner};
use k3_engine::{Engine, EngineConfig, Request, SamplingParams};
use k3_model::layers::kda::StateDType;
use k3_model::{Checkpoint, Model, Parallel};

mod common;
use common::{cfg, run_all};
#[path = "../../../tests/support/golden.rs"]
mod golden;
#[path = "../../../tests/support/numeric.rs"]
mod numeric;
use numeric::rel_l2;
#[path = "../../../tests/support/timeout.rs"]
mod timeout;
use timeout::within;

fn ck() -> Checkpoint {
    Checkpoint::open(&golden::fixture("k3_small_mxfp4")).unwrap()
}

fn par(tp: usize, ep: Option<usize>, pp: usize) -> Parallel {
    Parallel::new(tp, ep, pp).unwrap()
}

/// tp 2 (experts whole, ep = tp), ep 2 alone, tp 2 with split experts, pp 2, tp 2 × pp 2, tp 3 × pp 2.
fn layouts() -> Vec<Parallel> {
    vec![par(2, None, 1), par(1, Some(2), 1), par(2, Some(1), 1), par(1, None, 2), par(2, None, 2), par(3, None, 2)]
}

fn seq(id: u64, tokens: &[u32]) -> StepSeq {
    StepSeq { id, tokens: tokens.to_vec(), rows: None }
}

/// A script of steps: batched prefill, a chunk with its own rows, decode, releases (through
/// `Runner::release` and through the step), a released id reused, every row's logits.
fn script(r: &mut dyn Runner) -> Vec<Vec<f32>> {
    let own: Vec<f32> = r.embed(&[9, 8, 7, 6]).unwrap().iter().enumerate().map(|(i, x)| x * 0.5 + (i % 7) as f32 * 0.01).collect();
    let mut out = Vec::new();
    let mut step =
        |r: &mut dyn Runner, seqs: Vec<StepSeq>, last_only: bool, released: Vec<u64>| out.push(r.forward(Step { seqs, last_only, released }).unwrap());
    step(r, vec![seq(1, &[5, 17, 200, 3, 99, 42, 7]), seq(2, &[300, 12, 1])], true, vec![]);
    step(r, vec![seq(1, &[11]), StepSeq { id: 2, tokens: vec![9, 8, 7, 6], rows: Some(own.clone()) }, seq(3, &[4, 4, 100, 250, 31])], true, vec![]);
    r.release(2);
    step(r, vec![seq(1, &[60]), seq(3, &[77])], true, vec![]);
    step(r, vec![seq(1, &[2, 3]), seq(3, &[9])], false, vec![]);
    step(r, vec![seq(3, &[1, 2, 3]), seq(2, &[10])], true, vec![3]); // 2 and 3 start afresh
    out
}

fn argmax(x: &[f32]) -> usize {
    k3_engine::sampler::argmax(x)
}

#[test]
fn runner_logits_equal_one_rank() {
    let ck = ck();
    let v = ck.config.text.vocab_size;
    let one = script(&mut ThreadRunner::single(Arc::new(Model::load(&ck).unwrap()), StateDType::F32));
    for p in layouts() {
        let mut r = ThreadRunner::start(&ck, p, StateDType::F32).unwrap();
        assert_eq!(r.world(), p.world());
        let got = script(&mut r);
        for (s, (g, w)) in got.iter().zip(&one).enumerate() {
            assert_eq!(g.len(), w.len(), "{p:?} step {s}");
            for (row, (gr, wr)) in g.chunks_exact(v).zip(w.chunks_exact(v)).enumerate() {
                let e = rel_l2(gr, wr);
                assert!(e <= 1e-5, "{p:?} step {s} row {row}: rel-L2 {e}");
                assert_eq!(argmax(gr), argmax(wr), "{p:?} step {s} row {row}: greedy token differs");
            }
        }
        assert!(r.state_bytes() > 0);
    }
}

#[test]
fn engine_on_threads_equals_plain_engine() {
    let ck = ck();
    let plain = run_all(&mut Engine::new(Arc::new(Model::load(&ck).unwrap()), None, cfg()));
    assert_eq!(plain.iter().filter(|e| e.2).count(), 5);
    for p in [par(2, None, 1), par(1, None, 2), par(2, None, 2)] {
        let mut e = Engine::with_runner(Box::new(ThreadRunner::start(&ck, p, StateDType::F32).unwrap()), None, cfg());
        assert_eq!(run_all(&mut e), plain, "{p:?}");
    }
}

#[test]
fn a_failing_rank_is_named_and_nothing_hangs() {
    let cases = [
        (par(2, None, 1), Fault { rank: 1, at_step: 2, panic: false }),
        (par(2, None, 1), Fault { rank: 1, at_step: 1, panic: true }),
        (par(1, None, 2), Fault { rank: 0, at_step: 3, panic: false }), // the leader; its peer waits in recv
        (par(2, None, 2), Fault { rank: 3, at_step: 2, panic: true }),  // the last stage; the first waits for logits
    ];
    for (p, fault) in cases {
        let what = format!("{p:?} {fault:?}");
        let (first, again) = within(120, &what, move || {
            let r = ThreadRunner::start_with_fault(&ck(), p, StateDType::F32, Some(fault)).unwrap();
            let mut e = Engine::with_runner(Box::new(r), None, EngineConfig::default());
            let first = e.generate(Request::new(vec![5, 17, 200, 3], SamplingParams::greedy(), 8), |_| {}).unwrap_err().to_string();
            e.add(Request::new(vec![1, 2], SamplingParams::greedy(), 2)).unwrap();
            let again = e.step().unwrap_err().to_string();
            drop(e); // joins the rank threads
            (first, again)
        });
        let rank = format!("rank {} failed", fault.rank);
        let why = if fault.panic { "panicked: injected panic" } else { "injected fault" };
        assert!(first.contains(&rank) && first.contains(why), "{what}: {first}");
        assert!(again.contains(&rank) && again.contains("stopped"), "{what}: {again}");
    }
}

#[test]
fn bad_layouts_and_multi_gpu_are_refused() {
    let ck = ck();
    let err = ThreadRunner::start(&ck, par(1, None, 9), StateDType::F32).err().unwrap().to_string();
    assert!(err.contains("--pp 9"), "{err}");
    let spec =
        RunnerSpec { par: par(2, None, 1), device: Some(0), kda_state: StateDType::F32, max_seqs: 1, max_cache_tokens: 64, cuda_graphs: false, gpu_f32: false };
    let err = runner::load(&ck, &spec).err().unwrap().to_string();
    assert!(err.contains("--tp 2") && err.contains("one process per GPU") && err.contains("docs/parallel.md"), "{err}");
}
