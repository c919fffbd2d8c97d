//! The leader's runner and a worker over a real control plane (`dist::process`): two
//! `Control`s on loopback (rank 0 leads, rank 1 joins), no GPU. There are no cross-process
//! CPU collectives, so each side holds the whole golden K3 fixture `k3_small_mxfp4` as a
//! world-1 CPU model — this checks the byte flow, not sharding (the sharded forward is
//! `tests/dist.rs` on threads and `scripts/gpu/parallel_serve.sh` on the GPU):
//!
//! - five concurrent requests (chunked prefill between decodes, own input rows, releases):
//!   the engine's tokens equal a plain engine's, and the worker computed bit-identical logits
//!   and held the same state bytes at every step — it received every step, created and
//!   dropped its states in rank 0's order;
//!   dropping the engine shuts the world down and the worker's loop ends `Ok` (exit 0);
//! - a worker that errors or panics: the step fails with `rank 1 failed: …`, later steps fail
//!   at once with it, the world reports the failure, the worker's loop ends with its error;
//! - rank 0 failing: the worker's loop ends with an error naming rank 0;
//! - a worker that vanishes mid-step (its socket closes unanswered): the step fails naming
//!   rank 1 at once, not after a timeout — also while rank 0 is stuck in the step's
//!   collectives (the monitor aborts them: a SIGKILLed rank's NCCL peers may never see it);
//! - a worker that cannot load: `wait_ready` reports it by rank;
//! - reply bytes round trip and bad ones are that rank's failure;
//! - the prefix cache (issue 21, `dist::kept`: each rank keeps its own parts): warm = cold bit
//!   for bit on rank 0 for hits at a grid point and past it and at a branch point, and the
//!   worker, resumed from the parts it kept itself, computes rank 0's logits bit for bit at
//!   every step; with a pool too small to keep anything every cell is forgotten on both
//!   ranks (rank 0 checks the worker's count at every forget). The mutant — the worker's kept
//!   KDA snapshot perturbed at resume — must break the worker's equality (checked in the test);
//!   a worker that fails a resume is named (`rank 1 failed`) and the world stops; the worker
//!   has rank 0's state slots (one), so a released state not dropped before a resume fails it
//!   (a GPU rank's `new_sequence` would); a worker whose kept part differs from rank 0's (no
//!   snapshot) stops the world at that keep's receipt check.

use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use k3_core::comm::control::{self, Control, Options, WorldSpec};
use k3_engine::dist::process::{self, decode_reply, encode_reply, ProcessRunner};
use k3_engine::dist::runner::{Aborter, Answer, Failure, RankWorker, Runner, Step, ThreadRunner, Worker};
use k3_engine::prefix::{Capture, KdaSnap, Segment, SnapLayer};
use k3_engine::{Engine, EngineConfig, EngineError, PrefixConfig, Request, SamplingParams};
use k3_model::layers::kda::{StateBuf, StateDType};
use k3_model::{Checkpoint, Config, Model};

mod common;
use common::{cfg, run_all};
#[path = "../../../tests/support/golden.rs"]
mod golden;
#[path = "support/prefix_run.rs"]
mod prefix_run;
#[path = "support/recorder.rs"]
mod recorder;
#[path = "../../../tests/support/timeout.rs"]
mod timeout;
use timeout::within;

fn model() -> Arc<Model> {
    Arc::new(Model::load(&Checkpoint::open(&golden::fixture("k3_small_mxfp4")).unwrap()).unwrap())
}

/// A world of two on loopback: (rank 0's control, rank 1's control).
fn pair() -> (Control, Control) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let mut opts = Options::new(Duration::from_secs(20));
    opts.io_timeout = Duration::from_secs(30);
    let (s0, s1) = (WorldSpec::new(0, 2, 0, 2, &addr).unwrap(), WorldSpec::new(1, 2, 1, 2, &addr).unwrap());
    let o = opts.clone();
    let join = std::thread::spawn(move || control::rendezvous_with(&s1, "test", None, &o).unwrap());
    let lead = control::lead(l, &s0, "test", None, &opts).unwrap();
    (lead, join.join().unwrap())
}

/// Per step: the logits and the bytes of the states held right after the forward.
type Log = Arc<Mutex<Vec<(Vec<f32>, usize)>>>;

/// A failure to inject at the `at`-th step (1-based).
#[derive(Clone, Copy)]
struct Inject {
    at: usize,
    panic: bool,
}

/// The worker side: the CPU worker playing control rank `rank`, recording its logits.
struct RecWorker {
    inner: Worker,
    rank: usize,
    log: Log,
    steps: usize,
    fault: Option<Inject>,
    /// What it does to a resume: nothing, or a mutant.
    spoil: Spoil,
    /// The GPU's state slots (`max_seqs`, rank 0's `max_batch`): a step or resume that would
    /// make this rank hold more states fails, as `new_sequence` does on a GPU rank (a released
    /// state not dropped before a resume takes a slot rank 0 has freed).
    slots: usize,
    /// The sequences this rank holds a state of.
    live: std::collections::HashSet<u64>,
}

impl RecWorker {
    fn new(inner: Worker, log: Log, fault: Option<Inject>, spoil: Spoil, slots: usize) -> RecWorker {
        RecWorker { inner, rank: 1, log, steps: 0, fault, spoil, slots, live: Default::default() }
    }

    /// Takes a state slot for sequence `id` (see `slots`).
    fn hold(&mut self, id: u64) -> k3_engine::Result<()> {
        self.live.insert(id);
        match self.live.len() <= self.slots {
            true => Ok(()),
            false => Err(EngineError::Internal(format!(
                "rank 1 would hold {} sequence states in {} slots (a released state not dropped)",
                self.live.len(),
                self.slots
            ))),
        }
    }
}

/// A worker's mutation of a resume (see the module doc).
#[derive(Clone, Copy, PartialEq)]
enum Spoil {
    None,
    /// Its kept KDA snapshot perturbed.
    Snapshot,
    /// Refused with an error.
    Refuse,
    /// Its captures keep no KDA snapshot where rank 0's do (a receipt that differs).
    Receipt,
}

impl RankWorker for RecWorker {
    fn rank(&self) -> usize {
        self.rank
    }
    fn apply(&mut self, step: &Step) -> k3_engine::Result<Vec<f32>> {
        self.steps += 1;
        if let Some(f) = self.fault.filter(|f| f.at == self.steps) {
            if f.panic {
                panic!("injected worker panic");
            }
            return Err(EngineError::Unsupported("injected worker fault".into()));
        }
        step.released.iter().for_each(|id| _ = self.live.remove(id));
        step.seqs.iter().try_for_each(|s| self.hold(s.id))?;
        let out = self.inner.apply(step)?;
        self.log.lock().unwrap().push((out.clone(), self.inner.state_bytes()));
        Ok(out)
    }
    fn capture(&mut self, id: u64, from: usize, grid: usize, kda: bool) -> k3_engine::Result<Capture> {
        RankWorker::capture(&mut self.inner, id, from, grid, kda && self.spoil != Spoil::Receipt)
    }
    fn resume(&mut self, id: u64, cells: &[&Segment], snap: &KdaSnap) -> k3_engine::Result<()> {
        let mut snap = snap.clone();
        if self.spoil == Spoil::Refuse {
            return Err(EngineError::Unsupported("injected resume fault".into()));
        }
        if self.spoil == Spoil::Snapshot {
            let kda = snap.layers.iter_mut().find_map(|l| match l {
                SnapLayer::Cpu(k) => Some(k),
                _ => None,
            });
            match kda.map(|k| &mut k.s) {
                Some(StateBuf::F32(s)) => s[3] += 0.25,
                _ => panic!("the mutant found no f32 KDA state to perturb"),
            }
        }
        self.hold(id)?;
        RankWorker::resume(&mut self.inner, id, cells, &snap)
    }
    fn drop_states(&mut self, ids: &[u64]) -> k3_engine::Result<()> {
        ids.iter().for_each(|id| _ = self.live.remove(id));
        RankWorker::drop_states(&mut self.inner, ids)
    }
    fn set_page_rows(&mut self, rows: usize) -> k3_engine::Result<()> {
        RankWorker::set_page_rows(&mut self.inner, rows)
    }
    fn abort(&self, why: &str) {
        RankWorker::abort(&self.inner, why)
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
}

/// The leader's own rank: one CPU model, recording its logits, optionally failing.
struct RecRunner {
    inner: ThreadRunner,
    log: Log,
    steps: usize,
    fault: Option<usize>,
}

impl Runner for RecRunner {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    fn embed(&self, ids: &[u32]) -> k3_engine::Result<Vec<f32>> {
        self.inner.embed(ids)
    }
    fn release(&mut self, id: u64) {
        self.inner.release(id)
    }
    fn forward(&mut self, step: Step) -> k3_engine::Result<Vec<f32>> {
        self.steps += 1;
        if self.fault == Some(self.steps) {
            return Err(EngineError::Unsupported("injected leader fault".into()));
        }
        let out = self.inner.forward(step)?;
        self.log.lock().unwrap().push((out.clone(), self.inner.state_bytes()));
        Ok(out)
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
    fn prefix_support(&self) -> Result<String, String> {
        self.inner.prefix_support()
    }
    fn set_page_rows(&mut self, rows: usize) {
        self.inner.set_page_rows(rows)
    }
    fn capture(&mut self, id: u64, from: usize, grid: usize, kda: bool) -> k3_engine::Result<Capture> {
        self.inner.capture(id, from, grid, kda)
    }
    fn restore(&mut self, id: u64, cells: &[&Segment], snap: &KdaSnap) -> k3_engine::Result<()> {
        self.inner.restore(id, cells, snap)
    }
}

/// Rank 0's engine over a [`ProcessRunner`] and rank 1's loop on a thread (its result comes
/// back on the channel); the two logs.
struct World {
    engine: Engine,
    finish: process::Finish,
    worker: mpsc::Receiver<k3_engine::Result<()>>,
    leader_log: Log,
    worker_log: Log,
}

fn world(m: &Arc<Model>, worker_fault: Option<Inject>, leader_fault: Option<usize>) -> World {
    world_with(m, worker_fault, leader_fault, cfg(), None)
}

/// [`world`] with an engine configuration; with `rows` the engine's runner records every
/// sequence's logits rows there (`recorder::Rec`) and the worker spoils its resumes so.
fn world_with(m: &Arc<Model>, worker_fault: Option<Inject>, leader_fault: Option<usize>, config: EngineConfig, rows: Option<(&recorder::Log, Spoil)>) -> World {
    let (c0, c1) = pair();
    let (leader_log, worker_log) = (Log::default(), Log::default());
    let spoil = rows.map_or(Spoil::None, |r| r.1);
    let w = RecWorker::new(Worker::new(m.clone(), StateDType::F32), worker_log.clone(), worker_fault, spoil, config.max_batch);
    let (tx, worker) = mpsc::channel();
    std::thread::spawn(move || {
        let r = process::worker_ready(&c1, Ok(())).and_then(|_| process::work(w, &c1));
        let _ = tx.send(r);
    });
    let local = RecRunner { inner: ThreadRunner::single(m.clone(), StateDType::F32), log: leader_log.clone(), steps: 0, fault: leader_fault };
    let (mut r, finish) = ProcessRunner::new(Box::new(local), Box::new(c0));
    r.wait_ready().unwrap();
    let engine = match rows {
        None => Engine::with_runner(Box::new(r), None, config),
        Some((log, _)) => Engine::with_runner(Box::new(recorder::Rec::new(r, log)), None, config),
    };
    World { engine, finish, worker, leader_log, worker_log }
}

#[test]
fn leader_and_worker_apply_the_same_steps_and_shut_down() {
    let m = model();
    let plain = run_all(&mut Engine::new(m.clone(), None, cfg()));
    assert_eq!(plain.iter().filter(|e| e.2).count(), 5);
    let (got, worker, leader_log, worker_log) = within(120, "the process runner", move || {
        let mut w = world(&m, None, None);
        let got = run_all(&mut w.engine);
        // Rank 0 dropped every state; the worker drops the last ones with the next step.
        assert!(w.engine.state_bytes() > 0, "the worker's last reported state bytes count");
        drop(w.engine);
        w.finish.wait(Duration::from_secs(10)).unwrap();
        assert!(!w.finish.failed());
        let worker = w.worker.recv_timeout(Duration::from_secs(10)).expect("the worker's loop ends after the shutdown");
        (got, worker, w.leader_log, w.worker_log)
    });
    assert_eq!(got, plain, "the engine over the process runner emits the plain engine's tokens");
    worker.expect("the worker's loop ends Ok on the shutdown");
    let (l, w) = (leader_log.lock().unwrap(), worker_log.lock().unwrap());
    assert!(l.len() > 10, "{} steps", l.len());
    assert_eq!(l.len(), w.len(), "the worker applied every step");
    for (i, (a, b)) in l.iter().zip(w.iter()).enumerate() {
        assert!(a.0 == b.0, "step {i}: the worker's logits differ from rank 0's (a state made, kept or dropped out of order)");
        assert_eq!(a.1, b.1, "step {i}: the worker holds other states than rank 0 (a release not delivered)");
    }
}

#[test]
fn a_failing_worker_is_named_and_the_world_stops() {
    for panic in [false, true] {
        let m = model();
        let (first, again, failed, outcome, worker) = within(120, "a failing worker", move || {
            let mut w = world(&m, Some(Inject { at: 3, panic }), None);
            let first = w.engine.generate(Request::new(vec![5, 17, 200, 3], SamplingParams::greedy(), 8), |_| {}).unwrap_err().to_string();
            w.engine.add(Request::new(vec![1, 2], SamplingParams::greedy(), 2)).unwrap();
            let again = w.engine.step().unwrap_err().to_string();
            let failed = w.finish.failed();
            drop(w.engine);
            let outcome = w.finish.wait(Duration::from_secs(10)).unwrap_err().to_string();
            (first, again, failed, outcome, w.worker.recv_timeout(Duration::from_secs(10)).unwrap())
        });
        let why = if panic { "panicked: injected worker panic" } else { "injected worker fault" };
        assert!(first.contains("rank 1 failed") && first.contains(why), "{first}");
        assert!(again.contains("rank 1 failed") && again.contains("stopped"), "{again}");
        assert!(failed, "the world reports the failure (a server stops on it)");
        assert!(outcome.contains("rank 1 failed") && outcome.contains(why), "{outcome}");
        let worker = worker.unwrap_err().to_string();
        assert!(worker.contains(why), "{worker}");
    }
}

#[test]
fn a_failing_leader_stops_the_worker() {
    let m = model();
    let (err, worker) = within(120, "a failing leader", move || {
        let mut w = world(&m, None, Some(2));
        let err = w.engine.generate(Request::new(vec![5, 17, 200, 3], SamplingParams::greedy(), 8), |_| {}).unwrap_err().to_string();
        let worker = w.worker.recv_timeout(Duration::from_secs(30)).expect("the worker's loop ends on the abort");
        (err, worker)
    });
    assert!(err.contains("rank 0 failed") && err.contains("injected leader fault"), "{err}");
    let worker = worker.unwrap_err().to_string();
    assert!(worker.contains("rank 0") && worker.contains("injected leader fault"), "{worker}");
}

#[test]
fn a_vanished_worker_fails_the_step_at_once() {
    let m = model();
    let (err, took) = within(60, "a vanished worker", move || {
        let (c0, c1) = pair();
        std::thread::spawn(move || {
            process::worker_ready(&c1, Ok(())).unwrap();
            let _ = c1.recv(); // takes the first step, then dies without answering
            drop(c1);
        });
        let local = ThreadRunner::single(m, StateDType::F32);
        let (mut r, _finish) = ProcessRunner::new(Box::new(local), Box::new(c0));
        r.wait_ready().unwrap();
        let mut e = Engine::with_runner(Box::new(r), None, cfg());
        let t0 = Instant::now();
        let err = e.generate(Request::new(vec![5, 17, 200, 3], SamplingParams::greedy(), 8), |_| {}).unwrap_err().to_string();
        (err, t0.elapsed())
    });
    assert!(err.contains("rank 1 failed") && err.contains("no answer from its process"), "{err}");
    assert!(took < Duration::from_secs(10), "took {took:?}: the closed link must fail the step at once");
}

/// Rank 0's part of a step stuck in a collective whose peer is gone: `forward` returns only
/// when its aborter is called (or after 25 s, which the test counts as a failure).
struct Stuck {
    inner: ThreadRunner,
    aborted: Arc<Mutex<Option<String>>>,
    /// Its collectives ignore the abort (as `ncclCommAbort` spinning on a dead peer does).
    deaf: bool,
}

impl Runner for Stuck {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    fn embed(&self, ids: &[u32]) -> k3_engine::Result<Vec<f32>> {
        self.inner.embed(ids)
    }
    fn release(&mut self, id: u64) {
        self.inner.release(id)
    }
    fn forward(&mut self, _: Step) -> k3_engine::Result<Vec<f32>> {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(25) {
            if let Some(why) = self.aborted.lock().unwrap().clone() {
                return Err(EngineError::Unsupported(format!("aborted: {why}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Err(EngineError::Unsupported("the collective timed out after 25 s".into()))
    }
    fn state_bytes(&self) -> usize {
        0
    }
    fn aborter(&self) -> Option<Aborter> {
        let (flag, deaf) = (self.aborted.clone(), self.deaf);
        Some(Arc::new(move |why: &str| {
            if !deaf {
                *flag.lock().unwrap() = Some(why.to_string())
            }
        }))
    }
}

/// Rank 0 (its part of the step a [`Stuck`]) and a worker that takes the first step and dies
/// inside it; the step's error, how long it took, and the abort rank 0's collectives got.
fn worker_dies_mid_step(m: Arc<Model>, deaf: bool) -> (String, Duration, Option<String>) {
    let (c0, c1) = pair();
    std::thread::spawn(move || {
        process::worker_ready(&c1, Ok(())).unwrap();
        let _ = c1.recv(); // takes the step, then dies inside it
        std::thread::sleep(Duration::from_millis(200));
        drop(c1);
    });
    let aborted = Arc::new(Mutex::new(None));
    let local = Stuck { inner: ThreadRunner::single(m, StateDType::F32), aborted: aborted.clone(), deaf };
    let (mut r, _finish) = ProcessRunner::new(Box::new(local), Box::new(c0));
    r.wait_ready().unwrap();
    let mut e = Engine::with_runner(Box::new(r), None, cfg());
    let t0 = Instant::now();
    let err = e.generate(Request::new(vec![5, 17, 200, 3], SamplingParams::greedy(), 8), |_| {}).unwrap_err().to_string();
    let why = aborted.lock().unwrap().clone();
    (err, t0.elapsed(), why)
}

#[test]
fn a_worker_dying_while_rank_0_waits_in_a_collective_frees_it_at_once() {
    let m = model();
    let (err, took, why) = within(60, "a worker dying mid-collective", move || worker_dies_mid_step(m, false));
    assert!(err.contains("rank 1 failed"), "{err}");
    let why = why.expect("rank 0's collectives were never aborted");
    assert!(why.contains("rank 1") && why.contains("closed its connection"), "{why}");
    assert!(took < Duration::from_secs(5), "took {took:?}: the monitor must abort rank 0's collectives once rank 1 is gone");
}

/// When rank 0's collectives ignore the abort, the process exits 70 naming the dead rank after
/// the grace (`K3_ABORT_GRACE_S`, 1 s here) instead of hanging: run in a child process (this
/// test binary again, with `K3_TEST_DEAF_CHILD` set), since the exit ends the process.
#[test]
fn rank_0_stuck_after_the_abort_exits_70_naming_the_rank() {
    const NAME: &str = "rank_0_stuck_after_the_abort_exits_70_naming_the_rank";
    if std::env::var_os("K3_TEST_DEAF_CHILD").is_some() {
        let (err, took, _) = worker_dies_mid_step(model(), true);
        panic!("the child was not ended by the grace: its step returned after {took:?}: {err}");
    }
    let t0 = Instant::now();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
        .env("K3_TEST_DEAF_CHILD", "1")
        .env("K3_ABORT_GRACE_S", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(70), "{err}");
    assert!(err.contains("rank 1 failed") && err.contains("exiting (status 70)"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
}

#[test]
fn a_worker_that_cannot_load_is_named() {
    let m = model();
    let err = within(60, "a worker failing to load", move || {
        let (c0, c1) = pair();
        std::thread::spawn(move || {
            let loaded: k3_engine::Result<()> = Err(EngineError::Rank { rank: 1, msg: "loading its shards: out of memory".into() });
            let _ = process::worker_ready(&c1, loaded);
        });
        let (mut r, finish) = ProcessRunner::new(Box::new(ThreadRunner::single(m, StateDType::F32)), Box::new(c0));
        let err = r.wait_ready().unwrap_err().to_string();
        assert!(finish.failed());
        err
    });
    assert!(err.contains("rank 1 failed") && err.contains("out of memory"), "{err}");
}

#[test]
fn replies_round_trip_and_bad_ones_name_the_rank() {
    assert_eq!(decode_reply(&encode_reply(&Ok(Answer::bytes(12345))), 3).unwrap().state_bytes, 12345);
    // A capture's answer carries the rank's part (issue 21's prefix cache on a layout).
    let part = k3_engine::prefix::Capture { from: 4, to: 8, cells: Vec::new(), kda: None };
    let a = decode_reply(&encode_reply(&Ok(Answer { state_bytes: 77, capture: Some(part) })), 2).unwrap();
    assert_eq!((a.state_bytes, a.capture.as_ref().map(|c| (c.from, c.to))), (77, Some((4, 8))));
    let f = decode_reply(&encode_reply(&Err(Failure { rank: 3, msg: "boom ü".into(), aborted: true })), 3).unwrap_err();
    assert_eq!((f.rank, f.msg.as_str(), f.aborted), (3, "boom ü", true));
    for bad in [&[][..], &[0, 1, 2][..], &[7, 0][..], &[1][..], &[1, 9, b'x'][..], &[3, 0, 0, 0, 0, 0, 0, 0, 0, 1][..], &[3, 1][..]] {
        let f = decode_reply(bad, 5).unwrap_err();
        assert!(f.rank == 5 && f.msg.contains("bad reply") && !f.aborted, "{bad:?}: {f:?}");
    }
}

/// Pipelined steps over the control plane: rank 0's own runner is a `--pp 2` layout (ranks as
/// threads, depth 2), so the engine keeps two steps in flight through the `ProcessRunner`; the
/// worker (a world-1 model) must receive every step in order and answer each, and a worker
/// failing with steps in flight is named with nothing left hanging.
#[test]
fn pipelined_steps_over_the_control_plane() {
    use k3_engine::dist::runner::RankOptions;
    use k3_engine::EngineConfig;
    let inv = RankOptions { batch_invariant: true, ..Default::default() };
    let whole = EngineConfig { prefill_chunk: 64, max_step_tokens: 128, ..cfg() };
    let per_seq = |ev: &[(u64, u32, bool)]| {
        let mut m = std::collections::BTreeMap::<u64, Vec<u32>>::new();
        ev.iter().for_each(|&(s, t, _)| m.entry(s).or_default().push(t));
        m
    };
    let plain = per_seq(&run_all(&mut Engine::with_runner(Box::new(ThreadRunner::single_with(model(), StateDType::F32, inv)), None, whole.clone())));
    for fault in [None, Some(Inject { at: 3, panic: false })] {
        let whole = whole.clone();
        let (result, worker_steps, worker) = within(120, "pipelined steps over the control plane", move || {
            let (c0, c1) = pair();
            let log = Log::default();
            let inner = Worker::new(model(), StateDType::F32).with_options(inv);
            let w = RecWorker::new(inner, log.clone(), fault, Spoil::None, usize::MAX);
            let (tx, worker) = mpsc::channel();
            std::thread::spawn(move || {
                let r = process::worker_ready(&c1, Ok(())).and_then(|_| process::work(w, &c1));
                let _ = tx.send(r);
            });
            let ck = Checkpoint::open(&golden::fixture("k3_small_mxfp4")).unwrap();
            let local = ThreadRunner::start_with(&ck, k3_model::Parallel::new(1, None, 2).unwrap(), StateDType::F32, inv).unwrap();
            let (mut r, finish) = ProcessRunner::new(Box::new(local), Box::new(c0));
            r.wait_ready().unwrap();
            assert_eq!(r.depth(), 2);
            let mut e = Engine::with_runner(Box::new(r), None, whole);
            let result = match fault {
                None => Ok(run_all(&mut e)),
                Some(_) => {
                    for i in 0..3u32 {
                        e.add(Request::new(vec![5 + i, 17, 200, 3], SamplingParams::greedy(), 8)).unwrap();
                    }
                    loop {
                        match e.step() {
                            Ok(_) => assert!(e.has_work(), "the fault never fired"),
                            Err(err) => break Err(err.to_string()),
                        }
                    }
                }
            };
            drop(e);
            let _ = finish.wait(Duration::from_secs(10));
            let steps = log.lock().unwrap().len();
            (result, steps, worker.recv_timeout(Duration::from_secs(10)).expect("the worker's loop ends"))
        });
        match (fault, result) {
            (None, Ok(events)) => {
                assert_eq!(per_seq(&events), plain, "pipelined tokens over the process runner");
                assert!(worker_steps > 10, "the worker applied {worker_steps} steps");
                worker.expect("the worker's loop ends Ok on the shutdown");
            }
            (Some(_), Err(err)) => {
                assert!(err.contains("rank 1 failed") && err.contains("injected worker fault"), "{err}");
                assert!(worker.unwrap_err().to_string().contains("injected worker fault"));
            }
            (f, r) => panic!("fault {:?}: {r:?}", f.map(|f| f.at)),
        }
    }
}

/// One bar for the world's loading: a worker's progress frames reach rank 0 while rank 0
/// loads its own shards, the bar shows the sum, the worker's "loaded" reply comes back for
/// `take_ready`; a worker that fails to load is named; rank 0 failing to load aborts the plane
/// so nothing waits.
#[test]
fn loading_progress_reaches_rank_0s_world_bar() {
    let (got, replies, bar_at, worker) = within(60, "world loading bar", || {
        let (c0, c1) = pair();
        let w = std::thread::spawn(move || {
            process::worker_load(&c1, |report| {
                for b in [10u64, 20, 30] {
                    report(b);
                    std::thread::sleep(Duration::from_millis(300)); // past the throttle: each is sent
                }
                report(35); // sent as the last count before the reply
                Ok(())
            })
        });
        let bar = indicatif::ProgressBar::hidden();
        bar.set_length(100);
        let (got, replies) = process::load_with_world_bar(&c0, &bar, |report| {
            report(60);
            std::thread::sleep(Duration::from_millis(1200)); // the worker's frames arrive meanwhile
            Ok(7)
        });
        let bar_at = bar.position();
        let worker = w.join().unwrap();
        let local = ThreadRunner::single(model(), StateDType::F32);
        let (mut r, _finish) = ProcessRunner::new(Box::new(local), Box::new(c0));
        r.take_ready(replies.clone()).unwrap();
        (got.unwrap(), replies, bar_at, worker)
    });
    assert_eq!(got, 7);
    assert_eq!(bar_at, 95, "rank 0's 60 bytes + the worker's last count 35");
    assert!(replies.len() == 1 && replies[0].is_ok(), "{replies:?}");
    worker.unwrap();

    // A worker that cannot load: its failure is its reply, and take_ready names it.
    let err = within(60, "a worker failing to load", || {
        let (c0, c1) = pair();
        let w = std::thread::spawn(move || {
            process::worker_load(&c1, |report| -> k3_engine::Result<()> {
                report(5);
                Err(EngineError::Unsupported("no such GPU".into()))
            })
        });
        let (got, replies) = process::load_with_world_bar(&c0, &indicatif::ProgressBar::hidden(), |_| Ok(()));
        got.unwrap();
        assert!(w.join().unwrap().is_err());
        let local = ThreadRunner::single(model(), StateDType::F32);
        let (mut r, _finish) = ProcessRunner::new(Box::new(local), Box::new(c0));
        r.take_ready(replies).unwrap_err().to_string()
    });
    assert!(err.contains("rank 1 failed") && err.contains("no such GPU"), "{err}");

    // Rank 0 failing to load: the plane is aborted, the watcher and the worker end.
    let (err, worker) = within(60, "rank 0 failing to load", || {
        let (c0, c1) = pair();
        let w = std::thread::spawn(move || {
            let loaded = process::worker_load(&c1, |_| Ok(()));
            loaded.and_then(|_| c1.recv().map_err(|e| EngineError::Launch(e.to_string())).map(drop))
        });
        let (got, replies) = process::load_with_world_bar(&c0, &indicatif::ProgressBar::hidden(), |_| -> k3_engine::Result<()> {
            Err(EngineError::Unsupported("rank 0's GPU is gone".into()))
        });
        assert_eq!(replies.len(), 1);
        (got.unwrap_err().to_string(), w.join().unwrap())
    });
    assert!(err.contains("rank 0's GPU is gone"), "{err}");
    assert!(worker.unwrap_err().to_string().contains("rank 0's GPU is gone"));
}

#[path = "support/process_prefix.rs"]
mod process_prefix;
