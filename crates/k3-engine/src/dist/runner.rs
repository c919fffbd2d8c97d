//! The runner interface the engine drives, and ranks as threads on the CPU.
//!
//! - [`Runner`]: where the engine's forwards run. The engine plans a [`Step`] (which sequences,
//!   which new tokens) and the runner returns the logits `[B, vocab]` (each sequence's last
//!   row, in step order); per-sequence model state lives in the runner, keyed by sequence id.
//!   Three implementations: [`ThreadRunner`] over one CPU model (one rank), the same over a
//!   parallel layout (ranks as threads), and the GPU runner (`crate::gpu`, feature `cuda`).
//!   [`load`] picks one from the flags. Speculative decoding adds [`Runner::verify`] (every
//!   row's logits, each a single decode step's) and [`Runner::rollback`], the prefix cache
//!   [`Runner::capture`] and [`Runner::restore`]: the CPU runner has them on one rank and on
//!   every layout of ranks as threads, the GPU runner on one GPU, the multi-process runner
//!   (`dist::process`) with every rank keeping its own parts (`dist::kept`); the latter says
//!   why it does not speculate ([`Runner::speculation`]).
//!   Draft models run beside the target on the CPU runner of one rank: the MTP layer
//!   ([`Runner::enable_mtp`]) or a separate model ([`Runner::enable_draft`], `dist::draft`),
//!   both drafting through [`Runner::draft`].
//! - [`Worker`] (`dist::worker`): one rank's model and its map sequence id → `SeqState`;
//!   [`Worker::apply`] drops the released states, creates a state on a sequence's first sight,
//!   embeds the tokens (or takes the step's own rows) and runs `Model::forward_varlen`. Every
//!   rank applies the same steps in the same order, so their collectives pair up.
//! - [`RankWorker`]: what the worker loop drives — one rank that applies steps and the other
//!   [`Command`]s (verify, rollback, capture, restore, release, and the prefix cache's keep,
//!   resume and forget between processes): the CPU [`Worker`], or the GPU runner of a rank ≠ 0
//!   (`crate::gpu`), which runs plain steps and the prefix cache's commands and refuses verify
//!   and rollback.
//! - [`serve`]: a non-leader rank's loop: the next command from a [`StepSource`] (a channel of
//!   commands between threads, [`ChannelSource`]: encoded, but a restore as a value so that
//!   its cache pages arrive by reference; the control plane between processes,
//!   `dist::process::ControlSource`), apply it, reply with the outcome ([`Answer`]: the state
//!   bytes, a capture's part), until the source ends.
//! - [`ThreadRunner`] (`dist::threads`): rank 0 on the calling thread, the other ranks as
//!   threads running [`serve`]; on a pipeline layout it overlaps the stages of successive
//!   steps ([`Runner::depth`], [`Runner::submit`], [`Runner::collect`]).

use k3_model::capacity::KvDtype;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use k3_model::layers::kda::StateDType;
use k3_model::offload::OffloadOptions;
use k3_model::parallel::Parallel;
use k3_model::{Checkpoint, Config, Model, ModelError, SeqState};

pub use super::kept::Kept;
pub use super::step::{Command, Step, StepSeq};
pub use super::threads::ThreadRunner;
pub use super::worker::Worker;
use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::gpu::load_gpu;
use crate::prefix::{Capture, KdaSnap, Segment};
use crate::sample_rows::{self, RowsFn};
use crate::sampler::Sampled;

/// Where the engine's forwards run (see the module doc).
pub trait Runner: Send {
    /// The model's config.
    fn config(&self) -> &Config;
    /// Token embeddings `[ids.len(), hidden]` (for splicing image features into a prompt).
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>>;
    /// Whether a sequence of `tokens` tokens (prompt + generation) can ever be served; the
    /// capacity in tokens when not (the GPU's latent cache).
    fn fits(&self, tokens: usize) -> std::result::Result<(), usize> {
        let _ = tokens;
        Ok(())
    }
    /// Reserves room for sequence `id` of up to `tokens` tokens before its first step, of which
    /// its first `shared` will be restored from the prefix cache (held by reference, no room of
    /// their own); `false` while the room is promised to running sequences or held by the
    /// prefix cache's device pages (it waits, or the engine has the cache give some back).
    fn admit(&mut self, id: SeqId, tokens: usize, shared: usize) -> Result<bool> {
        let _ = (id, tokens, shared);
        Ok(true)
    }
    /// Whether [`Runner::admit`] would take a sequence of `tokens` tokens resuming past
    /// `shared` if the prefix cache let go of every device page only its cells hold (so that
    /// evicting cells can make room); `false` where the cells hold no device pages (the CPU).
    fn admits_after_eviction(&self, tokens: usize, shared: usize) -> bool {
        let _ = (tokens, shared);
        false
    }
    /// The device cache pages sequence `id`'s block table maps, in token order (inspection: the
    /// tests check which pages sequences and the prefix cache share); `None` where the runner
    /// has no paged device cache or the sequence no state.
    fn cache_pages(&self, id: SeqId) -> Option<Vec<u32>> {
        let _ = id;
        None
    }
    /// Frees sequence `id`'s state (finished or cancelled).
    fn release(&mut self, id: SeqId);
    /// One batched forward: logits `[B, vocab]` with `step.last_only` (else `[N, vocab]`).
    fn forward(&mut self, step: Step) -> Result<Vec<f32>>;
    /// Whether [`Runner::forward`] returns every row's logits (`last_only = false`) outside
    /// verification (prompt logprobs need them).
    fn all_row_logits(&self) -> bool {
        false
    }
    /// Whether [`Runner::forward_sample`] samples on this runner's device (only token ids and
    /// logprobs come back from it), rather than on the host from downloaded logits.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// One batched forward (last rows) whose rows are sampled where the logits are: `rows` is
    /// called once the forward is under way and gives one entry per step sequence (`None`:
    /// nothing to sample). The default runs [`Runner::forward`] and the host sampler.
    fn forward_sample(&mut self, step: Step, rows: &mut RowsFn<'_>) -> Result<Vec<Option<Sampled>>> {
        let n = step.seqs.len();
        let logits = self.forward(step)?;
        let rows = rows();
        let vocab = self.config().text.vocab_size;
        if logits.len() != n * vocab || rows.len() != n {
            return Err(EngineError::Internal(format!(
                "{} logits and {} sampling rows for a step of {n} sequences of vocabulary {vocab}",
                logits.len(),
                rows.len()
            )));
        }
        Ok(sample_rows::on_host(&logits, vocab, &rows))
    }
    /// Steps this runner can have in flight at once: the pipeline stages when it overlaps
    /// them (a step's later stages run while rank 0 starts the next), else 1. With more than
    /// one the engine drives [`Runner::submit`] and [`Runner::collect`] instead of `forward`,
    /// each step holding other sequences.
    fn depth(&self) -> usize {
        1
    }
    /// Starts `step` (sequences no step in flight holds) and returns once rank 0's part of it
    /// is under way; [`Runner::collect`] returns its logits, steps in submit order.
    fn submit(&mut self, step: Step) -> Result<()> {
        let _ = step;
        Err(EngineError::Internal("this runner does not overlap steps (depth 1): use forward".into()))
    }
    /// The logits of the oldest submitted step (as [`Runner::forward`] returns them).
    fn collect(&mut self) -> Result<Vec<f32>> {
        Err(EngineError::Internal("this runner does not overlap steps (depth 1): use forward".into()))
    }
    /// Bytes held by live sequence states (on a parallel layout, every rank's, as last reported).
    fn state_bytes(&self) -> usize;
    /// Aborts this runner's collectives with `why` (a peer failed: whatever waits on it stops).
    fn abort(&self, why: &str) {
        let _ = why;
    }
    /// [`Runner::abort`] as a handle another thread can call while `forward` runs (a monitor
    /// that sees a peer process die mid-step); `None` when the runner has no collectives.
    fn aborter(&self) -> Option<Aborter> {
        None
    }
    /// Where the routed experts are, when not all where the model runs (a start-up line).
    fn experts_summary(&self) -> Option<String> {
        None
    }
    /// What the expert cache of routed experts read from disk did so far (`--experts-on disk`;
    /// `None` without one).
    fn expert_cache_stats(&self) -> Option<k3_model::offload::CacheStats> {
        None
    }
    /// Whether [`Runner::verify`] works here (speculative decoding, `crate::spec`); why not.
    fn speculation(&self) -> std::result::Result<(), String> {
        Err(NO_SPECULATION.into())
    }
    /// The verify forward of speculative decoding: logits `[N, vocab]` of every row, each equal
    /// to the single decode step at its position, keeping each sequence's state after every
    /// token for [`Runner::rollback`].
    fn verify(&mut self, step: Step) -> Result<Vec<f32>> {
        let _ = step;
        Err(EngineError::Unsupported(NO_SPECULATION.into()))
    }
    /// Drops the last `drop` tokens of sequence `id`'s last verify forward (0: keeps them all).
    fn rollback(&mut self, id: SeqId, drop: usize) -> Result<()> {
        let _ = (id, drop);
        Err(EngineError::Unsupported(NO_SPECULATION.into()))
    }
    /// Turns the checkpoint's MTP draft layer on for every sequence state made from now on
    /// (`--speculative mtp`): its per-sequence state then lives beside the target's, advances
    /// with every forward, rolls back, is captured for the prefix cache and freed with it. Why
    /// not, when this runner cannot.
    fn enable_mtp(&mut self) -> std::result::Result<(), String> {
        Err(NO_MTP.into())
    }
    /// Runs `draft`, a separate draft model with the target's vocabulary, beside the target
    /// (`--speculative draft`, `dist::draft`): every sequence seen from now on gets a state of
    /// it, which consumes what the target consumes, rolls back, is captured for the prefix
    /// cache and freed with the target's. Why not, when this runner cannot.
    fn enable_draft(&mut self, draft: Arc<Model>) -> std::result::Result<(), String> {
        let _ = draft;
        Err(NO_DRAFT_MODEL.into())
    }
    /// Sequence `id`'s chained drafts from its draft model — the separate one when enabled
    /// (`k3_model::draft_model`), else the MTP layer (`k3_model::draft`): up to `k` positions
    /// after its consumed tokens, the first fed `next`; `choose` gets each position's logits
    /// `[vocab]` and returns the token fed to the next one (`None`: stop). Returns the tokens
    /// chosen (0 when the sequence has no draft state, e.g. after a prefix-cache restore
    /// without one).
    fn draft(&mut self, id: SeqId, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        let _ = (id, next, k, choose);
        Err(EngineError::Unsupported(NO_MTP.into()))
    }
    /// Prefix caching (`crate::prefix`): `Ok(layout)` (a digest input: the layout and state
    /// dtypes) when this runner can capture and restore sequence states, else why it cannot —
    /// the engine then runs without the cache and says so.
    fn prefix_support(&self) -> std::result::Result<String, String> {
        Err("this runner cannot capture or restore sequence states (the CPU runners and the one-GPU runner can)".into())
    }
    /// Whether a sequence's rows are bit-reproducible and depend on where its prompt is cut
    /// into forward calls (the CPU): the prefix cache then cuts prefill on its grid only, so a
    /// warm start equals a cold one bit for bit. The GPU runner's rows vary from run to run
    /// anyway (float atomics), so it says `false` and prefills in long chunks.
    fn exact_cuts(&self) -> bool {
        true
    }
    /// Sizes the pages of the MLA/DSA caches of the sequences made from now on to `rows`
    /// tokens (the prefix cache's grid: a captured cell is then one whole page, which the pool
    /// and every sequence restored from it share instead of copying; `prefix::state`). A runner
    /// with caches of its own layout ignores it (the GPU's pools).
    fn set_page_rows(&mut self, rows: usize) {
        let _ = rows;
    }
    /// Sequence `id`'s state on the CPU (rank 0's part on a parallel layout), for inspection
    /// (the tests check which cache pages sequences share); `None` where the runner keeps no
    /// CPU state or the sequence has none.
    fn seq_state(&self, id: SeqId) -> Option<&SeqState> {
        let _ = id;
        None
    }
    /// Sequence `id`'s state after the step just run (it holds exactly its grid-aligned token
    /// count): latent rows from `from` on, cut into grid cells, and its KDA states if `kda`.
    fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        let _ = (id, from, grid, kda);
        Err(EngineError::Unsupported("this runner cannot capture sequence states".into()))
    }
    /// Gives the new sequence `id` the state at `snap.at`: `cells` (the latent rows of every
    /// grid cell before it, in order) and `snap`.
    fn restore(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        let _ = (id, cells, snap);
        Err(EngineError::Unsupported("this runner cannot restore sequence states".into()))
    }
}

/// Why a runner does not verify drafts (the default of [`Runner::speculation`]).
pub const NO_SPECULATION: &str =
    "speculative decoding needs per-token KDA states in the verify forward, which this runner does not keep (the CPU runners and the one-GPU runner do); decoding without speculation";

/// Why a runner has no MTP draft layer (the default of [`Runner::enable_mtp`]).
pub const NO_MTP: &str =
    "MTP drafting runs on the CPU runner of one rank only so far (not the GPU runner, not a parallel layout); decoding without speculation";

/// Why a runner has no separate draft model (the default of [`Runner::enable_draft`]).
pub const NO_DRAFT_MODEL: &str =
    "a separate draft model runs on the CPU runner of one rank only so far (not the GPU runner, not a parallel layout); decoding without speculation";

/// Aborts a runner's collectives from another thread (see [`Runner::aborter`]).
pub type Aborter = Arc<dyn Fn(&str) + Send + Sync>;

/// One rank that applies steps: what [`serve`] and [`run_step`] drive. Every rank of a layout
/// applies the same steps in the same order, so their collectives pair up. Besides steps, the
/// worker loop carries the other [`Command`]s (speculative decoding's verify and rollback, the
/// prefix cache's capture and restore); a rank worker that does not implement one refuses it
/// ([`NOT_ON_THIS_RANK`]), and the layout stops at that failure.
pub trait RankWorker {
    /// The global rank (named in failures).
    fn rank(&self) -> usize;
    /// Applies one step: drops the released states, makes states on first sight, runs the
    /// forward. Returns the logits where this rank gets them (may be empty).
    fn apply(&mut self, step: &Step) -> Result<Vec<f32>>;
    /// [`RankWorker::apply`] as a verify forward (see [`Runner::verify`]).
    fn verify(&mut self, step: &Step) -> Result<Vec<f32>> {
        let _ = step;
        Err(not_on_this_rank(self.rank(), "verify"))
    }
    /// See [`Runner::rollback`].
    fn rollback(&mut self, id: SeqId, drop: usize) -> Result<()> {
        let _ = (id, drop);
        Err(not_on_this_rank(self.rank(), "rollback"))
    }
    /// This rank's part of sequence `id`'s state (see [`Runner::capture`]).
    fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        let _ = (id, from, grid, kda);
        Err(not_on_this_rank(self.rank(), "capture"))
    }
    /// Drops these sequences' states (between steps; see [`Command::Release`]).
    fn drop_states(&mut self, ids: &[SeqId]) -> Result<()> {
        let _ = ids;
        Err(not_on_this_rank(self.rank(), "release"))
    }
    /// Sizes the cache pages of the states made from now on (see [`Runner::set_page_rows`]); a
    /// rank whose caches have a layout of their own ignores it.
    fn set_page_rows(&mut self, rows: usize) -> Result<()> {
        let _ = rows;
        Ok(())
    }
    /// Makes sequence `id` anew from this rank's part of a stored state (`dist::layout_state::part`).
    fn restore(&mut self, id: SeqId, part: &Capture) -> Result<()> {
        let _ = (id, part);
        Err(not_on_this_rank(self.rank(), "restore"))
    }
    /// Makes sequence `id` anew (its state made here when it has none) from parts this rank
    /// captured and kept itself (`dist::kept`): `cells` before the snapshot, in order, and `snap`.
    fn resume(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        let _ = (id, cells, snap);
        Err(not_on_this_rank(self.rank(), "resume"))
    }
    /// Aborts this rank's collectives, so that its peers stop waiting for it.
    fn abort(&self, why: &str);
    /// Bytes held by this rank's live sequence states.
    fn state_bytes(&self) -> usize;
}

/// Why a rank worker refuses a command it does not implement (the GPU runner of a rank ≠ 0 of
/// a multi-process layout refuses verify and rollback).
pub const NOT_ON_THIS_RANK: &str =
    "is not built for this rank worker yet (only the CPU ranks verify and roll back; the GPU ranks of a multi-process layout do not)";

fn not_on_this_rank(rank: usize, what: &str) -> EngineError {
    EngineError::Unsupported(format!("rank {rank}: the {what} command {NOT_ON_THIS_RANK}"))
}

/// [`RankWorker::apply`] that turns an error or a panic into a [`Failure`] and aborts the
/// rank's collectives, so that its peers stop waiting for it.
pub fn run_step<W: RankWorker + ?Sized>(w: &mut W, step: &Step) -> std::result::Result<Vec<f32>, Failure> {
    guarded(w, |w| w.apply(step))
}

/// One [`Command`] on rank `w` (through [`guarded`]), `kept` its kept prefix-cache parts: its answer.
pub fn run_command<W: RankWorker + ?Sized>(w: &mut W, kept: &mut Kept, cmd: &Command) -> std::result::Result<Option<Capture>, Failure> {
    guarded(w, |w| match cmd {
        Command::Forward(s) => w.apply(s).map(|_| None),
        Command::Verify(s) => w.verify(s).map(|_| None),
        Command::Rollback { id, drop } => w.rollback(*id, *drop).map(|()| None),
        Command::Capture { id, from, grid, kda } => w.capture(*id, *from, *grid, *kda).map(Some),
        Command::Restore { id, part } => w.restore(*id, part).map(|()| None),
        Command::Release(ids) => w.drop_states(ids).map(|()| None),
        Command::PageRows(rows) => w.set_page_rows(*rows).map(|()| None),
        Command::Keep { id, from, grid, kda, key } => kept.keep(w, *id, *from, *grid, *kda, *key).map(Some),
        Command::Resume { id, cells, snap } => kept.resume(w, *id, cells, *snap).map(|()| None),
        Command::Forget(keys) => kept.forget(w.rank(), keys).map(Some),
    })
}

/// `f` on rank `w`, its error or panic turned into a [`Failure`] that aborts the rank's
/// collectives (what [`run_step`] does for a step).
pub fn guarded<W: RankWorker + ?Sized, T>(w: &mut W, f: impl FnOnce(&mut W) -> Result<T>) -> std::result::Result<T, Failure> {
    let rank = w.rank();
    let f = match catch_unwind(AssertUnwindSafe(|| f(w))) {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => Failure { rank, aborted: is_abort(&e), msg: e.to_string() },
        Err(p) => Failure { rank, aborted: false, msg: format!("panicked: {}", panic_message(p.as_ref())) },
    };
    w.abort(&format!("rank {} failed: {}", f.rank, f.msg));
    Err(f)
}

/// A deliberate failure, for the tests of the failure path: rank `rank` fails (or panics) at
/// its `at_step`-th step (1-based), before its forward, while its peers wait in theirs.
#[derive(Clone, Copy, Debug)]
pub struct Fault {
    pub rank: usize,
    pub at_step: usize,
    pub panic: bool,
}

/// How [`ThreadRunner::start_with`] starts its ranks.
#[derive(Clone, Copy, Debug, Default)]
pub struct RankOptions {
    /// A deliberate failure (tests of the failure path).
    pub fault: Option<Fault>,
    /// Row-exact projections on every rank, so that a sequence's logits are bit-identical
    /// whichever sequences share its steps (slower: the decode GEMV's per-row dot products for
    /// every row); the tests of scheduling invariances use it on this random-weight fixture,
    /// whose router scores tie to the last bit.
    pub batch_invariant: bool,
}

/// A rank's failure as its leader learns it.
#[derive(Clone, Debug)]
pub struct Failure {
    pub rank: usize,
    pub msg: String,
    /// The rank stopped because a peer aborted the groups (not its own fault).
    pub aborted: bool,
}

impl From<Failure> for EngineError {
    fn from(f: Failure) -> Self {
        EngineError::Rank { rank: f.rank, msg: f.msg }
    }
}

/// A rank's answer to one command: its state bytes and, for a capture, its part.
#[derive(Clone, Debug, Default)]
pub struct Answer {
    pub state_bytes: usize,
    pub capture: Option<Capture>,
}

impl Answer {
    /// An answer that carries only the state bytes.
    pub fn bytes(state_bytes: usize) -> Answer {
        Answer { state_bytes, capture: None }
    }
}

/// A rank's answer to one command, or its failure.
pub type Reply = std::result::Result<Answer, Failure>;

/// A rank that stopped in a collective (aborted by a peer, or a peer died or never came):
/// usually a consequence of another rank's failure, so the leader reports that one first.
pub(crate) fn is_abort(e: &EngineError) -> bool {
    matches!(e, EngineError::Model(ModelError::Core(k3_core::CoreError::Comm { .. })))
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_else(|| "(no message)".into())
}

/// Where a non-leader rank gets its commands and sends its replies.
pub trait StepSource {
    /// The next command, or `None` once the leader has stopped.
    fn next(&mut self) -> Result<Option<Command>>;
    /// Answers the command just applied.
    fn reply(&mut self, r: Reply) -> Result<()>;
}

/// A command as the leader thread sends it to a peer thread ([`ChannelSource`]).
pub enum Sent {
    /// Its byte form, as between processes (steps and most commands: one encoding for every
    /// peer, and the codec the process layouts use is exercised by every thread layout).
    Bytes(Arc<Vec<u8>>),
    /// The command itself: a restore, whose part's latent / indexer-key pages then reach the
    /// peer by reference (the pool's pages, shared in-process: `k3_model::layers::pages`)
    /// rather than as copies decoded from bytes.
    Command(Command),
}

/// Commands over a channel from the leader thread ([`Sent`]), replies back over another (as
/// values: a capture's part keeps the peer's own pages).
pub struct ChannelSource {
    pub steps: Receiver<Sent>,
    pub replies: Sender<Reply>,
}

impl StepSource for ChannelSource {
    fn next(&mut self) -> Result<Option<Command>> {
        match self.steps.recv() {
            Ok(Sent::Bytes(b)) => Command::decode(&b).map(Some),
            Ok(Sent::Command(c)) => Ok(Some(c)),
            Err(_) => Ok(None), // the leader dropped its end
        }
    }
    fn reply(&mut self, r: Reply) -> Result<()> {
        // A leader that has gone is not this rank's error: its next `next` ends the loop.
        let _ = self.replies.send(r);
        Ok(())
    }
}

/// A non-leader rank's loop: apply each command from `source` and reply, until the source ends
/// (`Ok`) or this rank fails (its failure, after replying it and aborting its groups).
pub fn serve<W: RankWorker>(mut worker: W, source: &mut dyn StepSource) -> Result<()> {
    let mut kept = Kept::default();
    loop {
        let cmd = match source.next() {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(()),
            Err(e) => {
                let f = Failure { rank: worker.rank(), msg: e.to_string(), aborted: false };
                worker.abort(&format!("rank {} failed: {}", f.rank, f.msg));
                source.reply(Err(f.clone()))?;
                return Err(f.into());
            }
        };
        match run_command(&mut worker, &mut kept, &cmd) {
            Ok(capture) => source.reply(Ok(Answer { state_bytes: worker.state_bytes(), capture }))?,
            Err(f) => {
                source.reply(Err(f.clone()))?;
                return Err(f.into());
            }
        }
    }
}

/// What [`load`] builds.
#[derive(Clone, Debug)]
pub struct RunnerSpec {
    /// `--tp/--ep/--pp`.
    pub par: Parallel,
    /// `None` for the CPU, `Some(ordinal)` for a CUDA device.
    pub device: Option<usize>,
    pub kda_state: StateDType,
    /// GPU: live sequences at once.
    pub max_seqs: usize,
    /// GPU: tokens the latent caches hold.
    pub max_cache_tokens: usize,
    /// GPU: replay decode steps from CUDA graphs.
    pub cuda_graphs: bool,
    /// GPU: the f32 reference precision instead of bf16 (`--precision f32`).
    pub gpu_f32: bool,
    /// GPU: the latent / indexer-key cache format (`--kv-cache-dtype`).
    pub kv_cache_dtype: KvDtype,
    /// Where the routed experts are (`--experts-on`, `--gpu-mem`, the expert cache's flags).
    pub offload: OffloadOptions,
}

/// The runner for `spec` in this process: one CPU model, ranks as threads, or the model on one
/// GPU. A layout of several ranks on the GPU is refused here: it runs one process per GPU,
/// which `dist::process::launch` starts (`k3 run` / `k3 serve` call that).
pub fn load(ck: &Checkpoint, spec: &RunnerSpec) -> Result<Box<dyn Runner>> {
    let p = spec.par;
    Ok(match (spec.device, p.world() > 1) {
        (None, false) => {
            let experts = k3_model::offload::cpu_source(ck, &spec.offload, 0..ck.config.text.num_experts)?;
            Box::new(ThreadRunner::single(Arc::new(Model::load_with(ck, &experts)?), spec.kda_state))
        }
        (None, true) if spec.offload.is_set() => return Err(no_offload(p)),
        (None, true) => Box::new(ThreadRunner::start(ck, p, spec.kda_state)?),
        (Some(ord), false) => Box::new(load_gpu(ck, ord, spec.max_seqs, spec.max_cache_tokens, spec.kv_cache_dtype, spec.cuda_graphs, spec.gpu_f32, &spec.offload)?),
        (Some(_), true) if spec.offload.is_set() => return Err(no_offload(p)),
        (Some(_), true) => {
            return Err(EngineError::Unsupported(format!(
                "--tp {} --ep {} --pp {} with --device cuda runs one process per GPU: start it with dist::process::launch (k3 run / k3 serve do; see docs/parallel.md), not in one process",
                p.tp, p.ep, p.pp
            )))
        }
    })
}

/// Why a parallel layout refuses `--experts-on` / `--gpu-mem`.
pub fn no_offload(p: Parallel) -> EngineError {
    EngineError::Unsupported(format!(
        "--experts-on / --gpu-mem place experts off the GPU of one process; with --tp {} --ep {} --pp {} every rank holds its experts itself (drop those flags, or run one rank)",
        p.tp, p.ep, p.pp
    ))
}
