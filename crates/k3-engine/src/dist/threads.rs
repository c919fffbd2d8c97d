//! Ranks as threads on the CPU (`k3 run --tp N --device cpu`, and the tests of every layout):
//! [`ThreadRunner`], the engine's [`Runner`] over them.
//!
//! Rank 0 is a [`Worker`] on the calling thread (it gets the logits: on a pipeline layout the
//! last stage sends them to it); ranks 1.. are threads running [`serve`] over a channel of
//! encoded steps ([`Sent`]; a restore goes as a value). A rank that fails or panics aborts the
//! layout's groups, so no rank waits on it; the caller gets the failing rank's own error
//! ([`EngineError::Rank`]), and every later step fails with it at once. Dropping the runner ends the threads.
//!
//! On a pipeline layout (`--pp P`, P > 1) the runner overlaps steps ([`Runner::depth`] = P):
//! [`Runner::submit`] sends the step to every rank and runs rank 0's part of it — its stage's
//! layers, the residual state sent on — and returns; the later stages work on that step while
//! rank 0 runs its part of the next one. [`Runner::collect`] receives the oldest step's logits
//! from the last stage and every rank's answer to it (steps complete in submit order: every
//! rank applies them in that order and point-to-point messages keep it).
//!
//! Speculative decoding and the prefix cache run on every layout (the engine then runs one
//! step at a time): [`Runner::verify`] sends the step as a verify forward to every rank, each
//! keeping its shard's per-token KDA states; [`Runner::rollback`] is a command every rank
//! applies; [`Runner::capture`] gathers every rank's part of a sequence's state and joins them,
//! [`Runner::restore`] cuts a stored state into the ranks' parts and sends each its own
//! (`dist::layout_state`). Every rank's MLA latent / indexer-key caches are reference-counted
//! pages of the grid ([`Runner::set_page_rows`] reaches every rank), and a capture's parts and a
//! restore's part cross between threads as values, not bytes: the pool keeps each stage's first
//! rank's own pages, and every rank of that stage restores those same pages by reference, so a
//! prefix's rows exist once per stage whatever the number of ranks and sequences holding them
//! (`k3_model::layers::pages`: appends and truncations never write a page held elsewhere; the
//! stage's first rank charges the pages its stage shares). Rank 0 runs its part of a rollback,
//! capture or restore first, so a refused one changes nothing anywhere; a peer that fails one
//! stops the layout. A sequence
//! released between steps is dropped on every rank at once ([`Command::Release`]); one released
//! while steps are in flight, with the next step.

use std::collections::{HashSet, VecDeque};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use k3_model::layers::kda::StateDType;
use k3_model::parallel::{Groups, Parallel};
use k3_model::{Checkpoint, Config, Model, SeqState};

use super::layout_state;
use super::runner::{guarded, serve, Aborter, Answer, ChannelSource, Command, Failure, Fault, RankOptions, RankWorker, Reply, Runner, Sent, Step, Worker};
use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::prefix::{Capture, KdaSnap, Segment};

struct Peer {
    rank: usize,
    steps: Option<Sender<Sent>>,
    replies: Receiver<Reply>,
    thread: Option<JoinHandle<Result<()>>>,
    state_bytes: usize,
}

/// Rank 0 on the calling thread, the other ranks of the layout (none for one rank) as threads.
pub struct ThreadRunner {
    leader: Worker,
    peers: Vec<Peer>,
    /// Unsharded token embeddings for [`Runner::embed`] (rank 0's model on one rank).
    embedder: Arc<Model>,
    /// Released since the last step, for the peers (rank 0 drops states at once).
    released: Vec<SeqId>,
    /// The failure that stopped the layout.
    failed: Option<Failure>,
    /// Steps submitted and not yet collected, oldest first: rank 0's logits when it had them
    /// at once (one stage), `None` while they are still to come from the last stage.
    flight: VecDeque<Option<Vec<f32>>>,
}

impl ThreadRunner {
    /// One rank: the whole model on the calling thread.
    pub fn single(model: Arc<Model>, kda: StateDType) -> ThreadRunner {
        Self::single_with(model, kda, RankOptions::default())
    }

    /// Every rank of `par` loaded from `ck` over in-process groups, ranks 1.. started as threads.
    pub fn start(ck: &Checkpoint, par: Parallel, kda: StateDType) -> Result<ThreadRunner> {
        Self::start_with_fault(ck, par, kda, None)
    }

    /// [`ThreadRunner::start`] with a deliberate [`Fault`] (for tests of the failure path).
    #[doc(hidden)]
    pub fn start_with_fault(ck: &Checkpoint, par: Parallel, kda: StateDType, fault: Option<Fault>) -> Result<ThreadRunner> {
        Self::start_with(ck, par, kda, RankOptions { fault, ..Default::default() })
    }

    /// One rank (the whole model on the calling thread) with [`RankOptions`].
    pub fn single_with(model: Arc<Model>, kda: StateDType, o: RankOptions) -> ThreadRunner {
        let leader = Worker::new(model.clone(), kda).with_options(o);
        ThreadRunner { leader, peers: Vec::new(), embedder: model, released: Vec::new(), failed: None, flight: VecDeque::new() }
    }

    /// [`ThreadRunner::start`] with [`RankOptions`].
    pub fn start_with(ck: &Checkpoint, par: Parallel, kda: StateDType, o: RankOptions) -> Result<ThreadRunner> {
        let plans = par.plans(&ck.config)?;
        let mut workers = Vec::with_capacity(plans.len());
        for (plan, groups) in plans.into_iter().zip(Groups::host(par)) {
            let rank = plan.rank;
            let model = Model::load_rank(ck, plan, groups, true).map_err(|e| EngineError::Rank { rank, msg: format!("loading its shards: {e}") })?;
            workers.push(Worker::new(Arc::new(model), kda).with_options(o));
        }
        let mut workers = workers.into_iter();
        let leader = workers.next().ok_or_else(|| EngineError::Unsupported("a parallel layout of no ranks".into()))?;
        let embedder = if par.world() == 1 { leader.model_arc() } else { Arc::new(Model::load_embedding(ck)?) };
        let mut peers = Vec::new();
        for w in workers {
            let rank = w.rank();
            let (step_tx, step_rx) = channel();
            let (reply_tx, reply_rx) = channel();
            let thread = std::thread::Builder::new()
                .name(format!("k3-rank-{rank}"))
                .spawn(move || serve(w, &mut ChannelSource { steps: step_rx, replies: reply_tx }))
                .map_err(|e| EngineError::Rank { rank, msg: format!("could not start its thread: {e}") })?;
            peers.push(Peer { rank, steps: Some(step_tx), replies: reply_rx, thread: Some(thread), state_bytes: 0 });
        }
        Ok(ThreadRunner { leader, peers, embedder, released: Vec::new(), failed: None, flight: VecDeque::new() })
    }

    /// Ranks in the layout.
    pub fn world(&self) -> usize {
        1 + self.peers.len()
    }

    fn check(&self) -> Result<()> {
        match &self.failed {
            Some(f) => Err(EngineError::Rank { rank: f.rank, msg: format!("{} (the parallel layout stopped at this failure; restart it)", f.msg) }),
            None => Ok(()),
        }
    }

    /// The layout, as the prefix cache's digest and the messages name it.
    fn layout(&self) -> String {
        let p = self.leader.model().plan.par;
        match self.peers.is_empty() {
            true => "one rank".into(),
            false => format!("ranks as threads --tp {} --ep {} --pp {}", p.tp, p.ep, p.pp),
        }
    }

    /// Refuses a command while submitted steps are not collected (the engine runs one step at a
    /// time when it speculates or caches prefixes).
    fn idle(&self, what: &str) -> Result<()> {
        self.check()?;
        match self.flight.is_empty() {
            true => Ok(()),
            false => Err(EngineError::Internal(format!("a {what} while {} submitted step(s) are not collected", self.flight.len()))),
        }
    }

    /// Sends every peer the same command's bytes; a peer that cannot be reached stops the layout.
    fn send(&mut self, bytes: Vec<u8>) -> Result<()> {
        let bytes = Arc::new(bytes);
        self.send_each(|_| Sent::Bytes(bytes.clone()))
    }

    /// Sends every peer its own command (`sent(rank)`); a peer that cannot be reached stops the
    /// layout.
    fn send_each(&mut self, mut sent: impl FnMut(usize) -> Sent) -> Result<()> {
        for i in 0..self.peers.len() {
            let p = &self.peers[i];
            let b = sent(p.rank);
            if p.steps.as_ref().is_none_or(|tx| tx.send(b).is_err()) {
                let f = Failure { rank: p.rank, msg: "its thread has stopped".into(), aborted: false };
                return Err(self.stop(vec![f]));
            }
        }
        Ok(())
    }

    /// Every peer's answer to the command just sent (rank 1.. in order), with rank 0's own
    /// outcome `mine`; a failure anywhere stops the layout.
    fn gather<T>(&mut self, mine: std::result::Result<T, Failure>) -> Result<(T, Vec<Answer>)> {
        let mut failures: Vec<Failure> = mine.as_ref().err().cloned().into_iter().collect();
        let mut answers = Vec::with_capacity(self.peers.len());
        for p in &mut self.peers {
            match p.replies.recv() {
                Ok(Ok(a)) => {
                    p.state_bytes = a.state_bytes;
                    answers.push(a);
                }
                Ok(Err(f)) => failures.push(f),
                Err(_) => failures.push(Failure { rank: p.rank, msg: "its thread stopped without answering".into(), aborted: false }),
            }
        }
        match (mine, failures.is_empty()) {
            (Ok(v), true) => Ok((v, answers)),
            _ => Err(self.stop(failures)),
        }
    }

    /// Every rank's own part of sequence `id`'s state (rank order), as [`Runner::capture`] asks
    /// (what it joins; the tests compare ranks' states with it).
    pub fn capture_parts(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Vec<Capture>> {
        self.idle("capture")?;
        let mut parts = vec![self.leader.capture(id, from, grid, kda)?];
        if self.peers.is_empty() {
            return Ok(parts);
        }
        self.send(Command::Capture { id, from, grid, kda }.encode())?;
        let ((), answers) = self.gather(Ok(()))?;
        for (p, a) in self.peers.iter().zip(answers) {
            parts.push(a.capture.ok_or_else(|| EngineError::Internal(format!("rank {} answered a capture without its part", p.rank)))?);
        }
        Ok(parts)
    }

    /// Stops the layout at `failures`: aborts the groups (whatever waits in a collective
    /// stops) and closes the step channels (each peer ends after the steps it has), reads every
    /// other peer's remaining answers up to its failure or its end, and returns the root cause:
    /// the first rank that failed on its own, else the first failure. Every later call fails
    /// with it.
    fn stop(&mut self, mut failures: Vec<Failure>) -> EngineError {
        let first = failures.first().cloned().unwrap_or(Failure { rank: 0, msg: "unknown failure".into(), aborted: false });
        self.leader.model().groups.abort(&format!("rank {} failed: {}", first.rank, first.msg));
        let answered: HashSet<usize> = failures.iter().map(|f| f.rank).collect();
        for p in &mut self.peers {
            p.steps = None;
        }
        for p in self.peers.iter().filter(|p| !answered.contains(&p.rank)) {
            while let Ok(r) = p.replies.recv() {
                if let Err(f) = r {
                    failures.push(f);
                    break;
                }
            }
        }
        self.flight.clear();
        let f = failures.iter().find(|f| !f.aborted).or(failures.first()).cloned().unwrap_or(first);
        self.failed = Some(f.clone());
        f.into()
    }
}

impl Runner for ThreadRunner {
    fn all_row_logits(&self) -> bool {
        true
    }
    fn expert_cache_stats(&self) -> Option<k3_model::offload::CacheStats> {
        self.leader.model().expert_cache().map(|c| c.stats())
    }
    fn experts_summary(&self) -> Option<String> {
        self.leader.model().expert_cache().map(|c| c.describe())
    }
    fn config(&self) -> &Config {
        &self.leader.model().config
    }
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        Ok(self.embedder.embed(ids)?)
    }
    fn release(&mut self, id: SeqId) {
        self.leader.release(id);
        if self.peers.is_empty() {
            return;
        }
        self.released.push(id);
        // Between steps the peers drop it now (their state bytes then count live sequences
        // only); while steps are in flight it rides on the next step.
        if self.flight.is_empty() && self.failed.is_none() {
            let bytes = Command::Release(std::mem::take(&mut self.released)).encode();
            // A failure stops the layout; the next call reports it.
            let _ = self.send(bytes).and_then(|()| self.gather(Ok(())));
        }
    }
    fn forward(&mut self, step: Step) -> Result<Vec<f32>> {
        if !self.flight.is_empty() {
            return Err(EngineError::Internal(format!("a plain forward while {} submitted step(s) are not collected", self.flight.len())));
        }
        self.submit(step)?;
        self.collect()
    }
    fn depth(&self) -> usize {
        self.leader.model().plan.par.pp
    }
    fn submit(&mut self, mut step: Step) -> Result<()> {
        self.check()?;
        if self.flight.len() >= self.depth() {
            return Err(EngineError::Internal(format!("{} steps in flight: the pipeline holds {}", self.flight.len() + 1, self.depth())));
        }
        if !self.peers.is_empty() {
            step.released.append(&mut self.released);
            self.send(step.encode())?;
        }
        let defer = self.depth() > 1;
        match guarded(&mut self.leader, |w| if defer { w.submit(&step) } else { w.apply(&step) }) {
            Ok(v) => {
                self.flight.push_back((!defer).then_some(v));
                Ok(())
            }
            Err(f) => Err(self.stop(vec![f])),
        }
    }
    fn collect(&mut self) -> Result<Vec<f32>> {
        self.check()?;
        let Some(ready) = self.flight.pop_front() else { return Err(EngineError::Internal("collect without a submitted step".into())) };
        let out = match ready {
            Some(v) => Ok(v),
            None => guarded(&mut self.leader, Worker::recv_logits),
        };
        Ok(self.gather(out)?.0)
    }
    fn state_bytes(&self) -> usize {
        self.leader.state_bytes() + self.peers.iter().map(|p| p.state_bytes).sum::<usize>()
    }
    fn abort(&self, why: &str) {
        self.leader.model().groups.abort(why);
    }
    fn aborter(&self) -> Option<Aborter> {
        let groups = self.leader.model().groups.clone();
        Some(Arc::new(move |why: &str| groups.abort(why)))
    }
    fn speculation(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    fn verify(&mut self, mut step: Step) -> Result<Vec<f32>> {
        self.idle("verify step")?;
        if self.peers.is_empty() {
            return self.leader.verify(&step);
        }
        step.released.append(&mut self.released);
        self.send(step.encode_verify())?;
        let mine = guarded(&mut self.leader, |w| w.verify(&step));
        Ok(self.gather(mine)?.0)
    }
    fn rollback(&mut self, id: SeqId, drop: usize) -> Result<()> {
        self.idle("rollback")?;
        self.leader.rollback(id, drop)?;
        if !self.peers.is_empty() {
            self.send(Command::Rollback { id, drop }.encode())?;
            self.gather(Ok(()))?;
        }
        Ok(())
    }
    fn enable_mtp(&mut self) -> std::result::Result<(), String> {
        match self.peers.is_empty() {
            true => self.leader.enable_mtp(),
            false => Err(format!("MTP drafting on a parallel layout ({} ranks) is not built yet; decoding without speculation", self.world())),
        }
    }
    fn enable_draft(&mut self, draft: Arc<Model>) -> std::result::Result<(), String> {
        match self.peers.is_empty() {
            true => self.leader.enable_draft(draft),
            false => Err(format!("a separate draft model on a parallel layout ({} ranks) is not built yet; decoding without speculation", self.world())),
        }
    }
    fn draft(&mut self, id: SeqId, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        if !self.peers.is_empty() {
            return Err(EngineError::Unsupported("draft-model drafts on a parallel layout".into()));
        }
        self.leader.draft(id, next, k, choose)
    }
    fn prefix_support(&self) -> std::result::Result<String, String> {
        Ok(format!("cpu, {}, kda state {:?}", self.layout(), self.leader.kda()))
    }
    /// Every rank's states (see the module doc). A failure stops the layout (the next call
    /// reports it), and so does a change while steps are in flight (the engine sets it once,
    /// before its first step).
    fn set_page_rows(&mut self, rows: usize) {
        self.leader.set_page_rows(rows);
        if self.peers.is_empty() || self.failed.is_some() {
            return;
        }
        if let Err(e) = self.idle("page size change") {
            self.stop(vec![Failure { rank: 0, msg: e.to_string(), aborted: false }]);
            return;
        }
        let _ = self.send(Command::PageRows(rows).encode()).and_then(|()| self.gather(Ok(())));
    }
    fn seq_state(&self, id: SeqId) -> Option<&SeqState> {
        self.leader.state(id)
    }
    fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        let mut parts = self.capture_parts(id, from, grid, kda)?;
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        let m = self.leader.model();
        layout_state::join(m.plan.par, &m.config, parts)
    }
    fn restore(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        self.idle("restore")?;
        if self.peers.is_empty() {
            return self.leader.restore(id, cells, snap);
        }
        // Every rank's part first (a stored state of another layout is refused before anything
        // changes), rank 0's restored, then each peer's sent. The new state replaces any
        // released one of the same id, so that release no longer needs to reach the peers.
        let m = self.leader.model_arc();
        let mut parts =
            (0..self.world()).map(|r| layout_state::part(m.plan.par, &m.config, r, self.leader.kda(), cells, snap).map(Some)).collect::<Result<Vec<_>>>()?;
        let own = parts[0].take().expect("rank 0's part");
        RankWorker::restore(&mut self.leader, id, &own)?;
        self.released.retain(|&r| r != id);
        // As values: the part's pages reach the peer by reference (see the module doc).
        self.send_each(|r| parts[r].take().map_or_else(|| Sent::Bytes(Arc::default()), |part| Sent::Command(Command::Restore { id, part })))?;
        self.gather(Ok(()))?;
        Ok(())
    }
}

impl Drop for ThreadRunner {
    fn drop(&mut self) {
        // Closing the step channels ends every peer's loop once it has applied the steps it
        // has: none of them waits on rank 0 then (rank 0 ran its part of every submitted step,
        // and the host groups' sends never wait for their receiver).
        for p in &mut self.peers {
            p.steps = None;
        }
        for p in &mut self.peers {
            if let Some(t) = p.thread.take() {
                let _ = t.join();
            }
        }
    }
}
