//! The engine over a parallel layout (`dist::runner::ThreadRunner`: ranks as threads) equals
//! the engine over one model, on the golden K3 fixture `k3_small_mxfp4` (3 heads, 6 experts,
//! 6 layers, so most splits are uneven): the runner's logits for a scripted series of steps
//! (batched prefill, own input rows, decode, releases, every row or the last) match one rank's
//! at rel-L2 ≤ 1e-5 with the same argmax, and the engine with several concurrent sequences of
//! different lengths (chunked prefill interleaved with decode, one with its own rows) emits the
//! same tokens in the same order. A rank that fails or panics gives an error naming it, on
//! time, and the runner stays failed; bad layouts and multi-GPU are refused with the flag.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use k3_engine::dist::runner::{self, Fault, RankOptions, Runner, RunnerSpec, Step, StepSeq, ThreadRunner};
use k3_engine::{Engine, EngineConfig, Request, SamplingParams};
use k3_model::layers::kda::StateDType;
use k3_model::{Checkpoint, Model, Parallel};

mod common;
use common::{add_script, cfg, run_all};
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
    // One step at a time: the same tokens in the same order.
    for (p, depth) in [(par(2, None, 1), None), (par(1, None, 2), Some(1)), (par(2, None, 2), Some(1))] {
        let mut e = Engine::with_runner(Box::new(ThreadRunner::start(&ck, p, StateDType::F32).unwrap()), None, EngineConfig { pipeline_depth: depth, ..cfg() });
        assert_eq!(run_all(&mut e), plain, "{p:?}");
    }
}

/// The tests of scheduling invariances (pipelined = one step at a time, a cancel leaves the
/// others unchanged): this random-weight fixture's router scores tie to the last bit, so a
/// sequence's tokens can depend on which others share its steps unless every projection is
/// row-exact, and on how its prompt is chunked — hence batch-invariant ranks and whole-prompt
/// prefill chunks.
fn invariant(ck: &Checkpoint, p: Parallel) -> ThreadRunner {
    ThreadRunner::start_with(ck, p, StateDType::F32, RankOptions { batch_invariant: true, ..Default::default() }).unwrap()
}

fn whole() -> EngineConfig {
    EngineConfig { prefill_chunk: 64, max_step_tokens: 128, ..cfg() }
}

/// The script's tokens per sequence on one batch-invariant rank, one step at a time.
fn plain_per_seq(ck: &Checkpoint) -> std::collections::BTreeMap<u64, Vec<(u32, bool)>> {
    let one = ThreadRunner::single_with(Arc::new(Model::load(ck).unwrap()), StateDType::F32, RankOptions { batch_invariant: true, ..Default::default() });
    per_seq(&run_all(&mut Engine::with_runner(Box::new(one), None, whole())))
}

/// Each sequence's tokens in order (and where it finished), whatever the interleaving.
fn per_seq(events: &[(u64, u32, bool)]) -> std::collections::BTreeMap<u64, Vec<(u32, bool)>> {
    let mut m = std::collections::BTreeMap::<u64, Vec<(u32, bool)>>::new();
    for &(s, t, f) in events {
        m.entry(s).or_default().push((t, f));
    }
    m
}

/// A runner that counts the steps in flight through it (submitted, not yet collected).
struct Counting {
    inner: ThreadRunner,
    now: usize,
    most: Arc<AtomicUsize>,
}

impl Runner for Counting {
    fn config(&self) -> &k3_model::Config {
        self.inner.config()
    }
    fn embed(&self, ids: &[u32]) -> k3_engine::Result<Vec<f32>> {
        self.inner.embed(ids)
    }
    fn release(&mut self, id: u64) {
        self.inner.release(id)
    }
    fn forward(&mut self, step: Step) -> k3_engine::Result<Vec<f32>> {
        self.most.fetch_max(1, Ordering::Relaxed);
        self.inner.forward(step)
    }
    fn depth(&self) -> usize {
        self.inner.depth()
    }
    fn submit(&mut self, step: Step) -> k3_engine::Result<()> {
        self.now += 1;
        self.most.fetch_max(self.now, Ordering::Relaxed);
        self.inner.submit(step)
    }
    fn collect(&mut self) -> k3_engine::Result<Vec<f32>> {
        self.now -= 1;
        self.inner.collect()
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
}

#[test]
fn pipelined_steps_equal_one_step_at_a_time() {
    // The runner: two steps in flight (submit, submit, collect, collect) give the logits of
    // the same steps run one at a time, bit for bit, on every pipeline layout.
    let ck = ck();
    let a = || vec![seq(1, &[5, 17, 200, 3, 99]), seq(2, &[300, 12, 1])];
    let b = || vec![seq(3, &[4, 4, 100]), seq(4, &[7])];
    let a2 = || vec![seq(1, &[11]), seq(2, &[60])];
    let step = |seqs| Step { seqs, last_only: true, released: vec![] };
    for p in [par(1, None, 2), par(2, None, 2), par(1, None, 3), par(3, None, 2)] {
        let mut one = ThreadRunner::start(&ck, p, StateDType::F32).unwrap();
        let want: Vec<Vec<f32>> = [a(), b(), a2()].into_iter().map(|s| one.forward(step(s)).unwrap()).collect();
        let mut r = ThreadRunner::start(&ck, p, StateDType::F32).unwrap();
        assert_eq!(r.depth(), p.pp);
        r.submit(step(a())).unwrap();
        r.submit(step(b())).unwrap();
        let got_a = r.collect().unwrap();
        r.submit(step(a2())).unwrap();
        let got = [got_a, r.collect().unwrap(), r.collect().unwrap()];
        assert_eq!(got.as_slice(), want.as_slice(), "{p:?}: overlapped steps differ from one at a time");
        assert!(r.forward(step(vec![seq(5, &[1])])).is_ok(), "{p:?}: a plain step after the pipeline drained");
        r.submit(step(vec![seq(6, &[1])])).unwrap();
        let err = r.forward(step(vec![seq(7, &[1])])).unwrap_err().to_string();
        assert!(err.contains("not collected"), "{p:?}: {err}");
    }
    // The engine: with a step per stage in flight, every sequence's tokens equal the plain
    // engine's (the steps hold other groups of sequences, so only the interleaving differs),
    // and two steps really were in flight at once.
    let plain = plain_per_seq(&ck);
    for p in [par(1, None, 2), par(2, None, 2), par(1, None, 3)] {
        let most = Arc::new(AtomicUsize::new(0));
        let r = Counting { inner: invariant(&ck, p), now: 0, most: most.clone() };
        let mut e = Engine::with_runner(Box::new(r), None, whole());
        let got = per_seq(&run_all(&mut e));
        assert_eq!(got, plain, "{p:?}: pipelined tokens differ");
        let most = most.load(Ordering::Relaxed);
        assert!(most >= 2 && most <= p.pp, "{p:?}: at most {most} steps were in flight");
    }
    // --pipeline-depth 1: one step at a time on the same layout.
    let most = Arc::new(AtomicUsize::new(0));
    let r = Counting { inner: invariant(&ck, par(1, None, 2)), now: 0, most: most.clone() };
    let got = per_seq(&run_all(&mut Engine::with_runner(Box::new(r), None, EngineConfig { pipeline_depth: Some(1), ..whole() })));
    assert_eq!(got, plain);
    assert_eq!(most.load(Ordering::Relaxed), 1);
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
    let spec = RunnerSpec {
        par: par(2, None, 1),
        device: Some(0),
        kda_state: StateDType::F32,
        max_seqs: 1,
        max_cache_tokens: 64,
        cuda_graphs: false,
        gpu_f32: false,
        kv_cache_dtype: Default::default(),
        offload: Default::default(),
    };
    let err = runner::load(&ck, &spec).err().unwrap().to_string();
    assert!(err.contains("--tp 2") && err.contains("one process per GPU") && err.contains("docs/parallel.md"), "{err}");
    // Experts off the GPU are for one process: a layout says so, on either device.
    for device in [None, Some(0)] {
        let offload = k3_model::offload::OffloadOptions { experts_on: Some(k3_model::placement::Tier::Disk), ..Default::default() };
        let err = runner::load(&ck, &RunnerSpec { device, offload, ..spec.clone() }).err().unwrap().to_string();
        assert!(err.contains("--experts-on") && err.contains("--tp 2"), "{err}");
    }
}

#[test]
fn pipelined_cancellation_and_failures() {
    let ck = self::ck();
    // A sequence cancelled while its step is in flight: the others' tokens are unchanged.
    let plain = plain_per_seq(&ck);
    let mut e = Engine::with_runner(Box::new(invariant(&ck, par(1, None, 2))), None, whole());
    add_script(&mut e);
    let mut events = Vec::new();
    let (mut steps, mut cancelled) = (0, false);
    while e.has_work() {
        let evs: Vec<_> = e.step().unwrap().iter().map(|ev| (ev.seq, ev.token, ev.finish.is_some())).collect();
        // Sequence 3 decoding but not in this step's tokens: a step in flight holds it.
        if !cancelled && events.iter().filter(|ev: &&(u64, u32, bool)| ev.0 == 3).count() >= 2 && !evs.iter().any(|ev| ev.0 == 3) {
            assert!(e.cancel(3), "sequence 3 was running");
            cancelled = true;
        }
        events.extend(evs);
        steps += 1;
        assert!(steps < 1000);
    }
    assert!(cancelled, "sequence 3 was never held by a step in flight");
    let got = per_seq(&events);
    assert!(got[&3].len() < plain[&3].len(), "sequence 3 ran to its end despite the cancel");
    assert_eq!(got[&3][..], plain[&3][..got[&3].len()], "sequence 3 before its cancel");
    for id in [1, 2, 4, 5] {
        assert_eq!(got.get(&id), plain.get(&id), "sequence {id} changed when sequence 3 was cancelled mid-flight");
    }
    // A rank failing with several steps in flight: named, on time, and the engine stays failed.
    for (p, fault) in [
        (par(1, None, 2), Fault { rank: 1, at_step: 3, panic: false }), // the last stage; rank 0 is a step ahead
        (par(1, None, 2), Fault { rank: 0, at_step: 4, panic: true }),  // rank 0 while the last stage runs its step
        (par(2, None, 2), Fault { rank: 2, at_step: 2, panic: false }),
    ] {
        let what = format!("{p:?} {fault:?}");
        let (first, again) = within(120, &what, move || {
            let r = ThreadRunner::start_with_fault(&self::ck(), p, StateDType::F32, Some(fault)).unwrap();
            let mut e = Engine::with_runner(Box::new(r), None, cfg());
            for i in 0..3u32 {
                e.add(Request::new(vec![5 + i, 17, 200, 3], SamplingParams::greedy(), 8)).unwrap();
            }
            let first = loop {
                match e.step() {
                    Ok(_) => assert!(e.has_work(), "{fault:?} never fired"),
                    Err(err) => break err.to_string(),
                }
            };
            let again = e.step().unwrap_err().to_string();
            drop(e);
            (first, again)
        });
        let rank = format!("rank {} failed", fault.rank);
        assert!(first.contains(&rank), "{what}: {first}");
        assert!(again.contains(&rank) && again.contains("stopped"), "{what}: {again}");
    }
}
