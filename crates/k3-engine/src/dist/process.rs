//! Ranks as processes: the leader's runner and the workers' loop over the control plane
//! (`k3_core::comm::control`), one process per GPU (`docs/parallel.md`, "The runner").
//!
//! - [`ProcessRunner`]: rank 0's runner. Its own rank is a local [`Runner`] (the GPU runner of
//!   rank 0's shards; any runner in the tests); per step it [`Control::broadcast`]s the
//!   [`Step`]'s bytes (with the ids released since the last step), runs its own forward, then
//!   reads every worker's reply ([`Control::recv_from`], rank by rank, so each failure keeps
//!   its rank). Admission (`fits`/`admit`) is rank 0's alone: every rank's pools are equal and
//!   a worker only holds sequences rank 0 holds. A failure anywhere aborts rank 0's collectives
//!   and the control plane (every worker's next `recv` fails with the reason), is returned as
//!   `rank R failed: …` (the rank that failed on its own, not one that only saw a collective
//!   abort), and every later step fails with it at once. Dropping the runner shuts the world
//!   down: workers' `recv` returns `None` and they exit 0.
//!   The prefix cache runs here too: every rank keeps its own part of each stored state and
//!   rank 0's cache drives them by command (`dist::kept`). A world's loading (progress frames,
//!   "loaded" replies, rank 0's bar) is `dist::loading`, re-exported here.
//! - [`ControlSource`]: a worker's [`StepSource`] over its control link: the runner's
//!   [`serve`] loop, unchanged, drives any [`RankWorker`] (the GPU runner of a rank ≠ 0,
//!   the CPU `Worker` in the tests) from it. Replies are [`encode_reply`]'s bytes.
//! - [`launch`]: what `k3 run` / `k3 serve` call: one process's part of the runner for a
//!   [`RunnerSpec`]. One process (CPU, ranks as threads, or one GPU) is [`Role::Leader`] of
//!   `runner::load`'s runner; with `--device cuda` and several ranks, every process joins the
//!   world (`dist::launch`: the node's first process starts the others), loads its shards,
//!   and either leads ([`Role::Leader`], rank 0) or serves rank 0's steps until it shuts the
//!   world down ([`Role::Worker`], after the loop ended).
//!
//! The rendezvous digest covers the runner spec (pools, graphs, precision) as well as binary,
//! layout and checkpoint, so every rank's pools and decode-graph choice equal rank 0's: each
//! rank decides eager or graph, and when to capture, from the step alone, so the collectives
//! inside (a capture's warm-up step too) pair up.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use k3_core::comm::control::Control;
use k3_model::{Checkpoint, Config};

use super::kept::Ledger;
use super::launch::{NodeArgs, World};
pub use super::loading::{decode_progress, encode_progress, load_with_world_bar, worker_load, worker_ready, world_bar};
use super::monitor::{abort_grace, Monitor};
use super::runner::{self, panic_message, Answer, Command, Failure, RankWorker, Reply, Runner, RunnerSpec, Step, StepSource};
pub use super::step::{decode_reply, encode_reply};
use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::prefix::{Capture, KdaSnap, Segment};
use crate::sample_rows::RowsFn;
use crate::sampler::Sampled;

/// How long the end of a run waits for the ranks this process started.
pub const FINISH_LIMIT: Duration = Duration::from_secs(120);

/// A worker's steps from rank 0 over the control plane, its replies back.
pub struct ControlSource<'a> {
    pub control: &'a Control,
}

impl StepSource for ControlSource<'_> {
    fn next(&mut self) -> Result<Option<Command>> {
        match self.control.recv().map_err(|e| EngineError::Launch(format!("waiting for rank 0's next step: {e}")))? {
            Some(b) => Command::decode(&b).map(Some),
            None => Ok(None),
        }
    }
    fn reply(&mut self, r: Reply) -> Result<()> {
        self.control.send_to_leader(&encode_reply(&r)).map_err(|e| EngineError::Launch(format!("answering rank 0: {e}")))
    }
}

/// What the leader talks to the workers through, and how the world ends: a [`World`] (its
/// `finish` also waits for the ranks this process started) or a bare [`Control`] (tests).
pub trait Plane: Send + Sync {
    fn control(&self) -> &Control;
    /// Shuts the world down (workers' `recv` returns `None`), then waits for this process's
    /// children where it has any.
    fn finish(self: Box<Self>) -> Result<()>;
}

impl Plane for World {
    fn control(&self) -> &Control {
        &self.control
    }
    fn finish(self: Box<Self>) -> Result<()> {
        World::finish(*self, FINISH_LIMIT)
    }
}

impl Plane for Control {
    fn control(&self) -> &Control {
        self
    }
    fn finish(self: Box<Self>) -> Result<()> {
        self.shutdown().map_err(|e| EngineError::Launch(format!("shutting the world down: {e}")))
    }
}

#[derive(Default)]
struct Shared {
    plane: RwLock<Option<Box<dyn Plane>>>,
    outcome: Mutex<Option<std::result::Result<(), String>>>,
    failed: AtomicBool,
}

impl Shared {
    fn end(&self) {
        let plane = self.plane.write().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(p) = plane {
            let r = p.finish().map_err(|e| e.to_string());
            self.outcome.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(r);
        }
    }
}

/// The end of a leader's world, for the command that started it: whether it stopped at a
/// failure, and [`Finish::wait`] for the shutdown once the engine is gone.
pub struct Finish(Option<Arc<Shared>>);

impl Finish {
    /// Nothing to finish (one process).
    pub fn none() -> Finish {
        Finish(None)
    }
    /// The world stopped at a rank's failure (a server stops serving then).
    pub fn failed(&self) -> bool {
        self.0.as_ref().is_some_and(|s| s.failed.load(Ordering::Acquire))
    }
    /// Waits up to `limit` for the runner to be dropped (it shuts the world down), then shuts
    /// it down itself (after any step in flight); the shutdown's outcome: a rank this process
    /// started that failed, or the failure the world stopped at.
    pub fn wait(&self, limit: Duration) -> Result<()> {
        let Some(s) = &self.0 else { return Ok(()) };
        let t0 = Instant::now();
        while s.outcome.lock().unwrap_or_else(|p| p.into_inner()).is_none()
            && s.plane.read().unwrap_or_else(|p| p.into_inner()).is_some()
            && t0.elapsed() < limit
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        s.end();
        let out = s.outcome.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or(Ok(()));
        out.map_err(EngineError::Launch)
    }
}

/// Rank 0's runner over a world of processes (see the module doc).
pub struct ProcessRunner {
    pub(super) local: Box<dyn Runner>,
    shared: Arc<Shared>,
    world: usize,
    pub(super) released: Vec<SeqId>,
    peer_bytes: Vec<usize>,
    failed: Option<Failure>,
    /// Watches the workers' links during each step (`monitor`); none when the local runner
    /// has no collectives to abort.
    monitor: Option<Monitor>,
    /// Steps submitted and not collected (pipelined steps, [`Runner::submit`]).
    pub(super) in_flight: usize,
    /// The keys of the prefix-cache parts the workers keep (`dist::kept`).
    pub(super) ledger: Arc<Mutex<Ledger>>,
    /// Why the prefix cache stays off on this layout, if it does (GPU ranks with K3_DIST_PREFIX=0).
    prefix_off: Option<String>,
}

impl ProcessRunner {
    /// Rank 0's runner: `local` runs rank 0's shards, `plane` reaches ranks `1..world`.
    pub fn new(local: Box<dyn Runner>, plane: Box<dyn Plane>) -> (ProcessRunner, Finish) {
        let world = plane.control().world();
        let shared = Arc::new(Shared { plane: RwLock::new(Some(plane)), ..Default::default() });
        let monitor = local.aborter().map(|abort| {
            let s = shared.clone();
            // A read lock per peek: rank 0's step holds another, and only the world's end writes.
            let probe = move || s.plane.read().unwrap_or_else(|p| p.into_inner()).as_ref().and_then(|p| p.control().dead_worker());
            Monitor::start(Box::new(probe), abort, abort_grace())
        });
        let r = ProcessRunner {
            local,
            shared: shared.clone(),
            world,
            released: Vec::new(),
            peer_bytes: vec![0; world],
            failed: None,
            monitor,
            in_flight: 0,
            ledger: Default::default(),
            prefix_off: None,
        };
        (r, Finish(Some(shared)))
    }

    /// Takes every worker's "loaded" reply as [`load_with_world_bar`] read them (rank `i + 1`
    /// at `i`): a rank that could not load its shards is reported by rank before anything is
    /// served.
    pub fn take_ready(&mut self, replies: Vec<Reply>) -> Result<()> {
        let mut failures = Vec::new();
        for (i, r) in replies.into_iter().enumerate() {
            match r {
                Ok(a) => self.peer_bytes[i + 1] = a.state_bytes,
                Err(f) => failures.push(f),
            }
        }
        match failures.is_empty() {
            true => Ok(()),
            false => Err(self.stop(failures)),
        }
    }

    /// Waits for every worker's "loaded" reply (sent by [`worker_ready`]), so a rank that could
    /// not load its shards is reported by rank before anything is served.
    pub fn wait_ready(&mut self) -> Result<()> {
        let shared = self.shared.clone();
        let failures = {
            let guard = shared.plane.read().unwrap_or_else(|p| p.into_inner());
            let Some(plane) = guard.as_ref() else { return Err(EngineError::Launch("the world was already shut down".into())) };
            self.gather(plane.control())
        };
        match failures.is_empty() {
            true => Ok(()),
            false => Err(self.stop(failures)),
        }
    }

    /// Every worker's next reply; their failures (a dead link is its rank's).
    fn gather(&mut self, c: &Control) -> Vec<Failure> {
        self.gather_n(c, 1)
    }

    /// Every worker's next `n` replies (up to its first failure or a dead link); the failures.
    fn gather_n(&mut self, c: &Control, n: usize) -> Vec<Failure> {
        let mut failures = Vec::new();
        for rank in 1..self.world {
            for _ in 0..n {
                match c.recv_from(rank) {
                    Ok(b) => match decode_reply(&b, rank) {
                        Ok(a) => self.peer_bytes[rank] = a.state_bytes,
                        Err(f) => {
                            failures.push(f);
                            break;
                        }
                    },
                    Err(e) => {
                        failures.push(Failure { rank, msg: format!("no answer from its process: {e}"), aborted: false });
                        break;
                    }
                }
            }
        }
        failures
    }

    /// `f` on rank 0's own runner under the monitor (a worker that dies mid-call aborts it),
    /// its error or panic as rank 0's [`Failure`].
    fn local_call<T>(&mut self, f: impl FnOnce(&mut dyn Runner) -> Result<T>) -> std::result::Result<T, Failure> {
        let local = &mut self.local;
        let run = move || catch_unwind(AssertUnwindSafe(|| f(&mut **local)));
        let out = match &self.monitor {
            Some(m) => m.watch(run),
            None => run(),
        };
        match out {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Failure { rank: 0, aborted: runner::is_abort(&e), msg: e.to_string() }),
            Err(p) => Err(Failure { rank: 0, aborted: false, msg: format!("panicked: {}", panic_message(p.as_ref())) }),
        }
    }

    /// Rank 0 failed with `f` while `owed` steps are unanswered by the workers: its
    /// collectives are aborted (workers inside a step stop and answer), their answers read, and
    /// the world stopped at the root cause.
    fn fail_local(&mut self, f: Failure, owed: usize) -> EngineError {
        self.local.abort(&format!("rank 0 failed: {}", f.msg));
        let shared = self.shared.clone();
        let mut failures = match shared.plane.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            Some(plane) => self.gather_n(plane.control(), owed),
            None => Vec::new(),
        };
        // A worker's own failure is the likelier cause of rank 0's (rank 0 then waited on it).
        failures.push(f);
        self.in_flight = 0;
        self.stop(failures)
    }

    /// Rank 0's outcome `out` of the oldest unanswered step and every worker's answer to it
    /// (`n` answers each); on a failure anywhere also the answers to the `later` steps in
    /// flight, and the world stops at the root cause.
    fn answers<T>(&mut self, out: std::result::Result<T, Failure>, n: usize, later: usize) -> Result<T> {
        let out = match out {
            Ok(v) => v,
            Err(f) => return Err(self.fail_local(f, n + later)),
        };
        let shared = self.shared.clone();
        let guard = shared.plane.read().unwrap_or_else(|p| p.into_inner());
        let Some(plane) = guard.as_ref() else { return Err(EngineError::Launch("the world has been shut down".into())) };
        let mut failures = self.gather_n(plane.control(), n);
        if failures.is_empty() {
            return Ok(out);
        }
        self.local.abort(&format!("rank {} failed: {}", failures[0].rank, failures[0].msg));
        failures.extend(self.gather_n(plane.control(), later));
        drop(guard); // `stop` takes the plane's lock itself
        self.in_flight = 0;
        Err(self.stop(failures))
    }

    pub(super) fn check(&self) -> Result<()> {
        match &self.failed {
            Some(f) => Err(EngineError::Rank { rank: f.rank, msg: format!("{} (the parallel layout stopped at this failure; restart it)", f.msg) }),
            None => Ok(()),
        }
    }

    /// Sends `step` (with the ids released since the last one) to every worker, after the
    /// prefix-cache keys dropped since the last command (`dist::kept`).
    fn broadcast(&mut self, step: &mut Step) -> Result<()> {
        self.forget_dropped()?;
        step.released.append(&mut self.released);
        self.send(&step.encode())
    }

    /// Sends `cmd` to every worker (no step in flight) and reads each one's answer (rank `i + 1`
    /// at `i`); a failure anywhere stops the world.
    pub(super) fn command(&mut self, cmd: &Command) -> Result<Vec<Answer>> {
        self.check()?;
        if self.in_flight > 0 {
            return Err(EngineError::Internal(format!("the {} command while {} submitted step(s) are not collected", cmd.name(), self.in_flight)));
        }
        self.send(&cmd.encode())?;
        let shared = self.shared.clone();
        let guard = shared.plane.read().unwrap_or_else(|p| p.into_inner());
        let Some(plane) = guard.as_ref() else { return Err(EngineError::Launch("the world has been shut down".into())) };
        let (mut answers, mut failures) = (Vec::new(), Vec::new());
        for rank in 1..self.world {
            match plane.control().recv_from(rank).map(|b| decode_reply(&b, rank)) {
                Ok(Ok(a)) => {
                    self.peer_bytes[rank] = a.state_bytes;
                    answers.push(a);
                }
                Ok(Err(f)) => failures.push(f),
                Err(e) => failures.push(Failure { rank, msg: format!("no answer from its process: {e}"), aborted: false }),
            }
        }
        drop(guard);
        match failures.is_empty() {
            true => Ok(answers),
            false => Err(self.stop(failures)),
        }
    }

    /// Sends a message's bytes to every worker.
    fn send(&mut self, bytes: &[u8]) -> Result<()> {
        let shared = self.shared.clone();
        let guard = shared.plane.read().unwrap_or_else(|p| p.into_inner());
        let Some(plane) = guard.as_ref() else { return Err(EngineError::Launch("the world has been shut down".into())) };
        if let Err(e) = plane.control().broadcast(bytes) {
            // Some workers may have the step and wait in its collectives: abort them.
            drop(guard);
            let msg = e.to_string();
            let rank = unreachable_peer(&msg).unwrap_or(0);
            return Err(self.stop(vec![Failure { rank, msg: format!("its process cannot be reached (rank 0 sending it a command: {msg})"), aborted: false }]));
        }
        Ok(())
    }

    /// Stops the world at `failures`: rank 0's collectives and the control plane are aborted
    /// with the root cause (the first rank that failed on its own, else the first failure).
    pub(super) fn stop(&mut self, failures: Vec<Failure>) -> EngineError {
        let f =
            failures.iter().find(|f| !f.aborted).or(failures.first()).cloned().unwrap_or(Failure { rank: 0, msg: "unknown failure".into(), aborted: false });
        let why = format!("rank {} failed: {}", f.rank, f.msg);
        self.local.abort(&why);
        if let Some(p) = self.shared.plane.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            p.control().abort(&why);
        }
        self.shared.outcome.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(Err(why));
        self.shared.failed.store(true, Ordering::Release);
        self.failed = Some(f.clone());
        f.into()
    }
}

impl Runner for ProcessRunner {
    fn config(&self) -> &Config {
        self.local.config()
    }
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.local.embed(ids)
    }
    fn fits(&self, tokens: usize) -> std::result::Result<(), usize> {
        self.local.fits(tokens)
    }
    fn admit(&mut self, id: SeqId, tokens: usize, shared: usize) -> Result<bool> {
        self.local.admit(id, tokens, shared)
    }
    fn release(&mut self, id: SeqId) {
        self.local.release(id);
        self.released.push(id);
    }
    fn forward(&mut self, mut step: Step) -> Result<Vec<f32>> {
        self.check()?;
        if self.in_flight > 0 {
            return Err(EngineError::Internal(format!("a plain forward while {} submitted step(s) are not collected", self.in_flight)));
        }
        self.broadcast(&mut step)?;
        let out = self.local_call(move |l| l.forward(step));
        self.answers(out, 1, 0)
    }
    fn samples_on_device(&self) -> bool {
        self.local.samples_on_device()
    }
    fn forward_sample(&mut self, mut step: Step, rows: &mut RowsFn<'_>) -> Result<Vec<Option<Sampled>>> {
        self.check()?;
        if self.in_flight > 0 {
            return Err(EngineError::Internal(format!("a plain forward while {} submitted step(s) are not collected", self.in_flight)));
        }
        self.broadcast(&mut step)?;
        let out = self.local_call(move |l| l.forward_sample(step, rows));
        self.answers(out, 1, 0)
    }
    fn depth(&self) -> usize {
        self.local.depth()
    }
    fn submit(&mut self, mut step: Step) -> Result<()> {
        self.check()?;
        self.broadcast(&mut step)?;
        match self.local_call(move |l| l.submit(step)) {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(f) => {
                let owed = self.in_flight + 1;
                Err(self.fail_local(f, owed))
            }
        }
    }
    fn collect(&mut self) -> Result<Vec<f32>> {
        self.check()?;
        if self.in_flight == 0 {
            return Err(EngineError::Internal("collect without a submitted step".into()));
        }
        let out = self.local_call(|l| l.collect());
        self.in_flight -= 1;
        let later = self.in_flight;
        self.answers(out, 1, later)
    }
    fn state_bytes(&self) -> usize {
        self.local.state_bytes() + self.peer_bytes.iter().sum::<usize>()
    }
    fn abort(&self, why: &str) {
        self.local.abort(why);
    }
    fn speculation(&self) -> std::result::Result<(), String> {
        Err(format!("speculative decoding on a multi-process layout ({} processes) is not built yet: the worker loop carries the verify and rollback commands (dist::step::Command), but the GPU rank workers do not run them; decoding without speculation", self.world))
    }
    fn prefix_support(&self) -> std::result::Result<String, String> {
        if let Some(why) = &self.prefix_off {
            return Err(why.clone());
        }
        // Each rank keeps its own parts (`dist::kept`): rank 0's layout names the layout.
        self.local.prefix_support().map(|l| format!("{l}; {} processes, each keeping its own parts", self.world))
    }
    fn exact_cuts(&self) -> bool {
        self.local.exact_cuts()
    }
    /// Every rank's new states (a failure stops the world: the next call reports it).
    fn set_page_rows(&mut self, rows: usize) {
        self.local.set_page_rows(rows);
        let _ = self.command(&Command::PageRows(rows));
    }
    fn admits_after_eviction(&self, tokens: usize, shared: usize) -> bool {
        self.local.admits_after_eviction(tokens, shared)
    }
    fn cache_pages(&self, id: SeqId) -> Option<Vec<u32>> {
        self.local.cache_pages(id)
    }
    fn seq_state(&self, id: SeqId) -> Option<&k3_model::SeqState> {
        self.local.seq_state(id)
    }
    fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        self.keep(id, from, grid, kda)
    }
    fn restore(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        self.resume(id, cells, snap)
    }
}

impl Drop for ProcessRunner {
    fn drop(&mut self) {
        k3_core::trace(|| "rank 0: shutting the world down (stop to every worker)".into());
        self.shared.end();
        k3_core::trace(|| "rank 0: world shut down; dropping rank 0's model".into());
    }
}

/// The worker a failed send names (the control plane's `could not send frame N to rank P`).
fn unreachable_peer(msg: &str) -> Option<usize> {
    let rest = &msg[msg.find("to rank ")? + 8..];
    rest[..rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len())].parse().ok()
}

/// A worker's whole life after loading: [`runner::serve`] over its control link until rank 0
/// shuts the world down (`Ok`) or a step fails (its failure, already sent to rank 0).
pub fn work<W: RankWorker>(worker: W, c: &Control) -> Result<()> {
    runner::serve(worker, &mut ControlSource { control: c })
}

/// This process's part of the runner for `spec` (see the module doc).
pub enum Role {
    /// This process drives the engine: its runner, and the end of its world.
    Leader(Box<dyn Runner>, Finish),
    /// This process was a worker; rank 0 has shut the world down and its loop has ended.
    Worker,
}

/// Starts this process's part of the runner for `spec` (see the module doc).
pub fn launch(ck: &Checkpoint, spec: &RunnerSpec, node: &NodeArgs) -> Result<Role> {
    match (spec.device, spec.par.world() > 1) {
        (Some(ord), true) => launch_gpu(ck, spec, node, ord),
        _ => {
            if node.nnodes != 1 || node.node_rank != 0 || node.master_addr.is_some() {
                return Err(EngineError::Launch("--nnodes/--node-rank/--master-addr start one process per GPU: add --device cuda and --tp/--ep/--pp (on the CPU, --tp/--ep/--pp run as threads of one process)".into()));
            }
            Ok(Role::Leader(runner::load(ck, spec)?, Finish::none()))
        }
    }
}

/// What every rank must agree on besides binary, layout and checkpoint: the runner's pools,
/// graphs and precision (a mismatch would make the decode-graph choices or capacity differ).
pub fn spec_digest(spec: &RunnerSpec) -> String {
    format!(
        "max_seqs={} max_cache_tokens={} cuda_graphs={} gpu_f32={} kda={:?} kv={:?}",
        spec.max_seqs, spec.max_cache_tokens, spec.cuda_graphs, spec.gpu_f32, spec.kda_state, spec.kv_cache_dtype
    )
}

#[cfg(feature = "cuda")]
fn launch_gpu(ck: &Checkpoint, spec: &RunnerSpec, node: &NodeArgs, ord: usize) -> Result<Role> {
    use super::launch::{load_gpu_rank, nccl_ids, world_digest};
    use crate::gpu::{precision, GpuRunner};
    let par = spec.par;
    let digest = k3_core::comm::control::digest(&[world_digest(ck, par)?.as_bytes(), spec_digest(spec).as_bytes()]);
    let world = World::start(par, node, &digest, |k| std::env::var(k).ok(), || nccl_ids(par))?;
    let cache = k3_model::cuda::CacheConfig { max_seqs: spec.max_seqs, max_tokens: spec.max_cache_tokens, kv_cache_dtype: spec.kv_cache_dtype };
    let prec = precision(spec.gpu_f32);
    let load = |report: &k3_model::source::LoadReport<'_>| {
        load_gpu_rank(&world, ck, ord, cache, prec, Some(report)).and_then(|m| Ok((m, k3_model::Model::load_embedding(ck)?)))
    };
    if world.rank() != 0 {
        let (model, embedder) = worker_load(&world.control, load)?;
        let served = work(GpuRunner::worker(model, embedder, spec.cuda_graphs), &world.control);
        k3_core::trace(|| format!("rank {}: step loop ended ({}), model dropped", world.rank(), if served.is_ok() { "stop" } else { "failure" }));
        let finished = world.finish(FINISH_LIMIT);
        return served.and(finished).map(|_| Role::Worker);
    }
    let bar = world_bar(ck, par, ord)?;
    let (loaded, replies) = load_with_world_bar(&world.control, &bar, load);
    bar.finish_and_clear();
    let (model, embedder) = loaded?; // (the control plane is aborted then)
    let gpu = GpuRunner::new(model, embedder, spec.cuda_graphs);
    let (mut r, finish) = ProcessRunner::new(Box::new(gpu), Box::new(world));
    // The GPU ranks' side of `dist::kept`: on since `scripts/gpu/parallel_serve.sh prefix`
    // passed on an H100 (2026-12-06); `K3_DIST_PREFIX=0` turns it off for these layouts only.
    if std::env::var("K3_DIST_PREFIX").is_ok_and(|v| v.trim() == "0") {
        r.prefix_off = Some(format!("the prefix cache on a multi-process GPU layout ({} processes) is off: K3_DIST_PREFIX=0", r.world));
    }
    r.take_ready(replies)?;
    Ok(Role::Leader(Box::new(r), finish))
}

#[cfg(not(feature = "cuda"))]
fn launch_gpu(_: &Checkpoint, _: &RunnerSpec, _: &NodeArgs, _: usize) -> Result<Role> {
    Err(EngineError::Unsupported(
        "this build has no CUDA support (several ranks with --device cuda run one process per GPU): rebuild with `cargo build --release --features cuda`"
            .into(),
    ))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_failed_send_names_its_peer() {
        assert_eq!(super::unreachable_peer("broadcast: rank 0: could not send frame 3 to rank 12: broken pipe"), Some(12));
        assert_eq!(super::unreachable_peer("broadcast: the world was already shut down"), None);
    }
}
