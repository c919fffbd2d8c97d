//! The engine's GPU runner: the model on one CUDA device (`k3_model::cuda::CudaModel`: the
//! whole model, or one rank's shards), its per-sequence states (by sequence id), and decode
//! steps replayed from CUDA graphs captured once per batch size; it implements the engine's
//! [`Runner`](crate::dist::runner::Runner) and, for the ranks ≠ 0 of a multi-process world,
//! [`RankWorker`](crate::dist::runner::RankWorker) (`GpuRunner::worker`: a sequence's state
//! is made on its first step, as the CPU worker does; rank 0 alone decides admission). Every
//! rank decides graph or eager, and captures, from the step alone (a decode step without own
//! rows, its batch size seen before or not), so all ranks make the same collective calls.
//! Speculative verify steps (one rank) replay graphs per (batch, rows per sequence): `gpu/verify.rs`.
//! With the `cuda` feature off, [`GpuRunner`] and [`GpuSeq`] are uninhabited types, so the
//! scheduler in `engine` has one code path and no `cfg` branches.
//!
//! Admission control: the GPU latent cache is a fixed number of pages. A sequence is admitted
//! only when its worst case — prompt + `max_tokens`, capped at the context limit, less the whole
//! pages of a prefix it resumes past — can be promised beside the pages in use in
//! [`CacheBudget`]; otherwise it waits (and the engine has the prefix cache give pages back). So
//! a step never runs out of pages half-way (which would fail every sequence of the batch), and a
//! request that could never fit is refused when it is added.
//!
//! Prefix caching: a captured cell holds the sequence's device pages by reference, a restore
//! maps the stored pages into the new sequence's block table (`k3_model::device_pages`; the KDA
//! slots are copied through the host), so a prefix's latent and indexer-key rows exist once on
//! the device whoever holds them. On a multi-process layout every rank does the same with its
//! own pages: a rank ≠ 0 keeps its parts in its process and resumes from them (`dist::kept`).

mod budget;
pub use budget::CacheBudget;

/// How a GPU runner's speculative verify steps ran (`gpu/verify.rs`); shared, so it can be read
/// while an engine owns the runner.
#[derive(Debug, Default)]
pub struct VerifyStats {
    /// Steps replayed from a verify graph.
    pub replayed: std::sync::atomic::AtomicU64,
    /// Steps run eagerly.
    pub eager: std::sync::atomic::AtomicU64,
    /// Verify graphs captured.
    pub captured: std::sync::atomic::AtomicU64,
    /// Rollbacks replayed from a verify graph's rollback graph.
    pub rollbacks_replayed: std::sync::atomic::AtomicU64,
    /// Rollbacks run eagerly, per sequence (after an eager verify step, or with
    /// `K3_ROLLBACK_GRAPHS=0`).
    pub rollbacks_eager: std::sync::atomic::AtomicU64,
}

#[cfg(feature = "cuda")]
mod verify;
#[cfg(feature = "cuda")]
pub use verify::MAX_GRAPHS as MAX_VERIFY_GRAPHS;

#[cfg(feature = "cuda")]
mod imp {
    use std::collections::HashMap;

    use std::collections::VecDeque;

    use k3_core::cuda::sample::Sampler as DeviceSampler;
    use k3_core::cuda::CudaTensor;
    use k3_model::capacity::KvDtype;
    use k3_model::cuda::{CudaModel, CudaSeqState, DecodeGraph, HeldStep, Input, Mixer};
    use k3_model::{Config, Model};

    use super::CacheBudget;
    use crate::dist::runner::{RankWorker, Runner, Step};
    use crate::engine::SeqId;
    use crate::error::{EngineError, Result};
    use crate::prefix::{state as prefix_state, Capture, KdaSnap, Segment};
    use crate::sample_rows::{self, RowsFn};
    use crate::sampler::Sampled;

    /// One sequence's place in the GPU pools and its cache reservation.
    pub struct GpuSeq {
        pub(in crate::gpu) state: CudaSeqState,
        /// Tokens it may reach within its reservation (whole pages).
        pub(in crate::gpu) room: usize,
        /// Tokens it was admitted to resume past from the prefix cache.
        shared: usize,
    }

    pub struct GpuRunner {
        /// Declared before `model`, so it drops first (fields drop in declaration order): a
        /// captured graph holds NCCL work of the model's communicators and must be destroyed
        /// before they are.
        graphs: HashMap<usize, DecodeGraph>,
        /// Rank 0 of a pipeline layout: the held decode graphs (its stage only, `pipe.rs` of the
        /// GPU model), by batch size. Dropped before `model` too.
        held_graphs: HashMap<usize, DecodeGraph>,
        /// Verify steps' graphs, by (batch, rows per sequence) (`gpu/verify.rs`). Dropped before
        /// `model` too.
        pub(in crate::gpu) verify_graphs: super::verify::VerifyGraphs,
        pub model: CudaModel,
        /// Replay decode steps from CUDA graphs (one captured per batch size on first use).
        pub use_graphs: bool,
        budget: CacheBudget,
        /// The embedding table on the host (a view of the map), for steps with their own rows.
        embedder: Model,
        pub(in crate::gpu) seqs: HashMap<SeqId, GpuSeq>,
        /// A rank ≠ 0: sequences get their state on first sight (rank 0 admitted them).
        on_sight: bool,
        /// Pipelined steps (rank 0 of a pipeline layout): the last submitted step, computed and
        /// not yet sent on, and the steps submitted and not collected, oldest first.
        held: Option<HeldStep>,
        flight: VecDeque<Slot>,
        /// Samples on the device from the step's logits (`Runner::forward_sample`).
        sampler: DeviceSampler,
        /// Rollbacks of the last verify step not applied yet (sequence, rows dropped; 0 for a
        /// sequence whose padding rows in a verify graph must be undone): applied together, one
        /// replay per KDA layer, before the next thing that touches the states.
        pub(in crate::gpu) rollbacks: Vec<(SeqId, usize)>,
    }

    /// A submitted step's logits: still to come from the last stage (its rows), or received
    /// early (before a capture, whose warm-up step must find no message of another step).
    enum Slot {
        Pending(usize),
        Ready(Vec<f32>),
    }

    impl Drop for GpuRunner {
        fn drop(&mut self) {
            k3_core::trace(|| format!("GPU runner: dropping {} decode graph(s), then the model and its communicators", self.graphs.len()));
            self.graphs.clear();
            self.held_graphs.clear();
            self.verify_graphs.clear();
        }
    }

    impl GpuRunner {
        pub fn new(model: CudaModel, embedder: Model, use_graphs: bool) -> Self {
            let budget = CacheBudget::new(model.cache.max_tokens, k3_core::cuda::mla::PAGE);
            let sampler = DeviceSampler::new(&model.dev);
            GpuRunner {
                model,
                use_graphs,
                graphs: HashMap::new(),
                held_graphs: HashMap::new(),
                verify_graphs: super::verify::VerifyGraphs::new(),
                budget,
                embedder,
                seqs: HashMap::new(),
                on_sight: false,
                held: None,
                flight: VecDeque::new(),
                sampler,
                rollbacks: Vec::new(),
            }
        }

        /// A rank ≠ 0 of a multi-process world: it applies rank 0's steps ([`RankWorker`]);
        /// a sequence's state is made the first time a step plans it, in step order. Its pools
        /// equal rank 0's and it only holds sequences rank 0 holds, so whatever rank 0 admitted
        /// fits here too.
        pub fn worker(model: CudaModel, embedder: Model, use_graphs: bool) -> Self {
            let mut r = Self::new(model, embedder, use_graphs);
            r.on_sight = true;
            r
        }

        /// One packed step; `emb` replaces the token embeddings when given. Returns each
        /// sequence's last-row logits `[B, vocab]`.
        fn forward_packed(&mut self, tokens: &[u32], emb: Option<&[f32]>, lens: &[usize], seqs: &mut [&mut GpuSeq]) -> Result<Vec<f32>> {
            Ok(match self.device_packed(tokens, emb, lens, seqs)? {
                Some(l) => l.to_f32_vec().map_err(k3_model::ModelError::from)?,
                None => Vec::new(),
            })
        }

        /// [`GpuRunner::forward_packed`] leaving the logits `[B, vocab]` on the device (a graph's
        /// buffer or the eager step's tensor; `None` on a rank without logits), not waited for.
        fn device_packed(&mut self, tokens: &[u32], emb: Option<&[f32]>, lens: &[usize], seqs: &mut [&mut GpuSeq]) -> Result<Option<CudaTensor>> {
            let mut seqs: Vec<&mut CudaSeqState> = seqs.iter_mut().map(|s| &mut s.state).collect();
            let seqs = seqs.as_mut_slice();
            let decode = emb.is_none() && lens.iter().all(|&l| l == 1);
            if decode && self.use_graphs {
                let b = lens.len();
                let ctx = self.model.cache.max_tokens.min(self.model.config.max_context());
                if !self.graphs.contains_key(&b) {
                    let g = self.model.capture_decode(b, ctx)?;
                    self.graphs.insert(b, g);
                }
                if let Some(g) = self.graphs.get(&b) {
                    return Ok(self.model.decode_step_device(g, tokens, seqs)?);
                }
            }
            let input = match emb {
                Some(e) => Input::Embeds(e),
                None => Input::Tokens(tokens),
            };
            Ok(self.model.forward_device(input, lens, seqs)?)
        }

        /// [`GpuRunner::forward_packed`] of rank 0's stage alone, held (pipelined steps). A
        /// decode batch size seen for the first time is captured here; its warm-up step runs
        /// whole, so every step in flight is sent and its logits received first.
        fn held_packed(&mut self, tokens: &[u32], emb: Option<&[f32]>, lens: &[usize], seqs: &mut [&mut GpuSeq]) -> Result<HeldStep> {
            let mut seqs: Vec<&mut CudaSeqState> = seqs.iter_mut().map(|s| &mut s.state).collect();
            let seqs = seqs.as_mut_slice();
            let decode = emb.is_none() && lens.iter().all(|&l| l == 1);
            if decode && self.use_graphs {
                let b = lens.len();
                if !self.held_graphs.contains_key(&b) {
                    self.drain()?;
                    let ctx = self.model.cache.max_tokens.min(self.model.config.max_context());
                    let g = self.model.capture_decode_held(b, ctx)?;
                    self.held_graphs.insert(b, g);
                }
                if let Some(g) = self.held_graphs.get(&b) {
                    return Ok(self.model.decode_step_held(g, tokens, seqs)?);
                }
            }
            let input = match emb {
                Some(e) => Input::Embeds(e),
                None => Input::Tokens(tokens),
            };
            Ok(self.model.forward_held(input, lens, seqs)?)
        }

        /// Sends the held step on (`wait`: and lets the stream run it out, so that the next
        /// step may rewrite the tables it used).
        fn flush(&mut self, wait: bool) -> Result<()> {
            if let Some(h) = self.held.take() {
                let g = h.graph_batch().and_then(|b| self.held_graphs.get(&b));
                self.model.send_held(h, g)?;
                if wait {
                    self.model.dev.synchronize().map_err(k3_model::ModelError::from)?;
                }
            }
            Ok(())
        }

        /// Sends the held step and receives the logits of every step in flight (kept for
        /// `collect`): no message of an earlier step is outstanding afterwards.
        fn drain(&mut self) -> Result<()> {
            self.flush(true)?;
            for slot in self.flight.iter_mut() {
                if let Slot::Pending(rows) = *slot {
                    *slot = Slot::Ready(self.model.recv_logits(rows)?);
                }
            }
            Ok(())
        }

        /// A step's sequences taken out of the map (their states made on first sight on a
        /// rank ≠ 0), its token ids, lengths and own rows, after dropping the released states
        /// and applying the pending rollbacks. `all_rows`: a verify step (every row's logits).
        pub(in crate::gpu) fn take_step(&mut self, step: &Step, all_rows: bool) -> Result<Taken> {
            for &id in &step.released {
                self.release(id);
            }
            self.settle()?;
            if !step.last_only && !all_rows {
                return Err(EngineError::Internal("the GPU runner returns last-row logits only (outside verify steps)".into()));
            }
            if self.on_sight {
                for s in &step.seqs {
                    if !self.seqs.contains_key(&s.id) {
                        let state = self.model.new_sequence()?;
                        self.seqs.insert(s.id, GpuSeq { state, room: 0, shared: 0 });
                    }
                }
            }
            let mut seen = std::collections::HashSet::new();
            if let Some(s) = step.seqs.iter().find(|s| !self.seqs.contains_key(&s.id) || !seen.insert(s.id)) {
                return Err(EngineError::Internal(format!("sequence {} has no GPU state or is planned twice", s.id)));
            }
            let tokens: Vec<u32> = step.seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
            let lens: Vec<usize> = step.seqs.iter().map(|s| s.tokens.len()).collect();
            // Own rows for some sequence: every sequence's rows go in (token embeddings for the rest).
            let emb = match step.seqs.iter().any(|s| s.rows.is_some()) {
                false => None,
                true => {
                    let mut e = Vec::new();
                    for s in &step.seqs {
                        match &s.rows {
                            Some(r) => e.extend_from_slice(r),
                            None => e.extend(self.embedder.embed(&s.tokens)?),
                        }
                    }
                    Some(e)
                }
            };
            let seqs = step.seqs.iter().filter_map(|s| self.seqs.remove(&s.id).map(|g| (s.id, g))).collect();
            Ok(Taken { tokens, lens, emb, seqs })
        }
    }

    /// A packed forward of the runner: token ids, own rows, lengths, the sequences.
    type Packed<R> = fn(&mut GpuRunner, &[u32], Option<&[f32]>, &[usize], &mut [&mut GpuSeq]) -> Result<R>;

    impl GpuRunner {
        /// `run` (a packed forward) on `step`'s sequences, taken out of the map and put back.
        fn on_step<R>(&mut self, step: &Step, run: Packed<R>) -> Result<R> {
            let mut t = self.take_step(step, false)?;
            let out = {
                let mut refs: Vec<&mut GpuSeq> = t.seqs.iter_mut().map(|(_, g)| g).collect();
                run(self, &t.tokens, t.emb.as_deref(), &t.lens, &mut refs)
            };
            self.seqs.extend(t.seqs);
            out
        }
    }

    /// [`GpuRunner::take_step`]'s parts of a step.
    pub(in crate::gpu) struct Taken {
        pub tokens: Vec<u32>,
        pub lens: Vec<usize>,
        pub emb: Option<Vec<f32>>,
        pub seqs: Vec<(SeqId, GpuSeq)>,
    }

    impl Runner for GpuRunner {
        fn config(&self) -> &Config {
            &self.model.config
        }
        fn expert_cache_stats(&self) -> Option<k3_model::offload::CacheStats> {
            self.model.expert_cache().map(|c| c.stats())
        }
        fn experts_summary(&self) -> Option<String> {
            self.model.experts_summary()
        }
        fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
            Ok(self.embedder.embed(ids)?)
        }
        fn fits(&self, tokens: usize) -> std::result::Result<(), usize> {
            if self.budget.fits_ever(tokens) {
                Ok(())
            } else {
                Err(self.budget.tokens())
            }
        }
        fn admit(&mut self, id: SeqId, tokens: usize, shared: usize) -> Result<bool> {
            let seqs = &self.seqs;
            let taken = |s: SeqId| seqs.get(&s).map_or(0, |g| g.state.pages.taken());
            if self.seqs.contains_key(&id) || !self.budget.try_admit(id, tokens, shared, self.model.pages_in_use(), taken) {
                return Ok(false);
            }
            match self.model.new_sequence() {
                Ok(state) => {
                    let room = self.budget.pages_for(tokens) * k3_core::cuda::mla::PAGE;
                    self.seqs.insert(id, GpuSeq { state, room, shared });
                    Ok(true)
                }
                Err(e) => {
                    self.budget.release(id);
                    Err(e.into())
                }
            }
        }
        fn admits_after_eviction(&self, tokens: usize, shared: usize) -> bool {
            let live = self.model.pages_in_use() - self.model.page_pool().reclaimable();
            self.budget.fits(tokens, shared, live, |s| self.seqs.get(&s).map_or(0, |g| g.state.pages.taken()))
        }
        fn cache_pages(&self, id: SeqId) -> Option<Vec<u32>> {
            self.seqs.get(&id).map(|s| s.state.pages.ids().collect())
        }
        fn release(&mut self, id: SeqId) {
            self.rollbacks.retain(|r| r.0 != id);
            if let Some(s) = self.seqs.remove(&id) {
                self.budget.release(id);
                self.model.release(s.state);
            }
        }
        fn forward(&mut self, step: Step) -> Result<Vec<f32>> {
            if !self.flight.is_empty() || self.held.is_some() {
                return Err(EngineError::Internal(format!("a plain forward while {} submitted step(s) are not collected", self.flight.len())));
            }
            if !step.last_only {
                return self.all_rows(&step);
            }
            self.on_step(&step, Self::forward_packed)
        }
        fn all_row_logits(&self) -> bool {
            self.model.plan.par.world() == 1
        }
        fn samples_on_device(&self) -> bool {
            true
        }
        fn forward_sample(&mut self, step: Step, rows: &mut RowsFn<'_>) -> Result<Vec<Option<Sampled>>> {
            if !self.flight.is_empty() || self.held.is_some() {
                return Err(EngineError::Internal(format!("a plain forward while {} submitted step(s) are not collected", self.flight.len())));
            }
            let logits = self.on_step(&step, Self::device_packed)?;
            let rows = rows();
            let Some(logits) = logits else {
                return Err(EngineError::Internal(format!("rank {} has no logits to sample from", self.model.plan.rank)));
            };
            if rows.len() != step.seqs.len() || logits.shape().first() != Some(&rows.len()) {
                return Err(EngineError::Internal(format!(
                    "{} sampling rows for a step of {} sequences ({:?} logits)",
                    rows.len(),
                    step.seqs.len(),
                    logits.shape()
                )));
            }
            let (packed, pens, masks) = sample_rows::pack(&rows);
            let out = self.sampler.sample(&logits, &packed, &pens, &masks).map_err(k3_model::ModelError::from)?;
            Ok(rows.iter().zip(&out).map(|(r, o)| r.as_ref().map(|r| sample_rows::unpack(o, r))).collect())
        }
        fn depth(&self) -> usize {
            match self.model.holds_steps() {
                true => self.model.plan.par.pp,
                false => 1,
            }
        }
        fn submit(&mut self, step: Step) -> Result<()> {
            if self.depth() == 1 {
                return Err(EngineError::Internal("only rank 0 of a pipeline layout overlaps steps".into()));
            }
            if self.flight.len() >= self.depth() {
                return Err(EngineError::Internal(format!("{} steps in flight: the pipeline holds {}", self.flight.len() + 1, self.depth())));
            }
            // Filling the pipeline (no collect since the last submit): the held step goes on.
            self.flush(true)?;
            self.held = Some(self.on_step(&step, Self::held_packed)?);
            self.flight.push_back(Slot::Pending(step.seqs.len()));
            Ok(())
        }
        fn collect(&mut self) -> Result<Vec<f32>> {
            if self.flight.len() == 1 {
                self.flush(false)?; // the step collected is the one held: it goes on first
            }
            let slot = self.flight.pop_front().ok_or_else(|| EngineError::Internal("collect without a submitted step".into()))?;
            let logits = match slot {
                Slot::Ready(l) => l,
                Slot::Pending(rows) => self.model.recv_logits(rows)?,
            };
            // The oldest step's logits are in (the stream ran the held step's compute before
            // them): the held step goes on now, after that receive, as one step at a time orders.
            self.flush(false)?;
            Ok(logits)
        }
        fn state_bytes(&self) -> usize {
            0 // the states live in the device pools, sized at start-up
        }
        fn abort(&self, why: &str) {
            self.model.groups.abort(why);
        }
        fn aborter(&self) -> Option<crate::dist::runner::Aborter> {
            let groups = self.model.groups.clone();
            Some(std::sync::Arc::new(move |why: &str| groups.abort(why)))
        }
        fn speculation(&self) -> std::result::Result<(), String> {
            match self.model.holds_steps() {
                true => Err("speculative decoding on a pipeline layout is not built yet; decoding without speculation".into()),
                false => self.model.verify_support(),
            }
        }
        fn verify(&mut self, step: Step) -> Result<Vec<f32>> {
            if !self.flight.is_empty() || self.held.is_some() {
                return Err(EngineError::Internal(format!("a verify step while {} submitted step(s) are not collected", self.flight.len())));
            }
            let mut t = self.take_step(&step, true)?;
            let out = self.verify_taken(&mut t);
            self.seqs.extend(t.seqs);
            out
        }
        fn rollback(&mut self, id: SeqId, drop: usize) -> Result<()> {
            if !self.seqs.contains_key(&id) {
                return Err(EngineError::UnknownSeq(id));
            }
            if drop > 0 {
                // One entry per sequence: a verify graph's padding entry (drop 0) is replaced.
                match self.rollbacks.iter_mut().find(|r| r.0 == id) {
                    Some(r) => r.1 = drop,
                    None => self.rollbacks.push((id, drop)),
                }
            }
            Ok(())
        }
        fn prefix_support(&self) -> std::result::Result<String, String> {
            self.model.prefix_layout()
        }
        fn exact_cuts(&self) -> bool {
            false
        }
        fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
            self.settle()?;
            let seq = self.seqs.get(&id).ok_or(EngineError::UnknownSeq(id))?;
            let to = seq.state.pos;
            // The KDA slots only (no rows: the cells take the pages themselves).
            let slots = match kda {
                true => self.model.read_prefix(&seq.state, to, to, true)?,
                false => Vec::new(),
            };
            let is_kda: Vec<bool> = self.model.layers.iter().map(|l| matches!(l.mixer, Mixer::Kda(_))).collect();
            prefix_state::capture_device(&seq.state.pages, self.model.page_pool().rows(), slots, &is_kda, from, to, grid, kda)
        }
        fn restore(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
            let (spans, kda) = prefix_state::restore_device(cells, snap)?;
            let seq = self.seqs.get_mut(&id).ok_or(EngineError::UnknownSeq(id))?;
            if snap.at != seq.shared {
                return Err(EngineError::Internal(format!("sequence {id} was admitted to resume at {} but restores at {}", seq.shared, snap.at)));
            }
            Ok(self.model.map_prefix(&mut seq.state, snap.at, &spans, &kda)?)
        }
    }

    impl RankWorker for GpuRunner {
        fn rank(&self) -> usize {
            self.model.plan.rank
        }
        fn apply(&mut self, step: &Step) -> Result<Vec<f32>> {
            Runner::forward(self, step.clone())
        }
        fn drop_states(&mut self, ids: &[SeqId]) -> Result<()> {
            ids.iter().for_each(|&id| Runner::release(self, id));
            Ok(())
        }
        /// This rank's part, kept in this process (`dist::kept`): its own device pages by
        /// reference, its KDA slots copied to the host, as on one GPU.
        fn capture(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
            Runner::capture(self, id, from, grid, kda)
        }
        /// A new sequence (rank 0 admitted it) mapped onto this rank's kept pages, its KDA
        /// slots written from the kept snapshot; nothing is left of it when that fails.
        fn resume(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
            if self.seqs.contains_key(&id) {
                return Err(EngineError::Internal(format!("rank {}: resume of sequence {id}, which already has a state", self.model.plan.rank)));
            }
            self.settle()?;
            let state = self.model.new_sequence()?;
            self.seqs.insert(id, GpuSeq { state, room: 0, shared: snap.at });
            let out = Runner::restore(self, id, cells, snap);
            if out.is_err() {
                Runner::release(self, id);
            }
            out
        }
        fn abort(&self, why: &str) {
            self.model.groups.abort(why);
        }
        fn state_bytes(&self) -> usize {
            0
        }
    }

    /// Uploads the checkpoint to CUDA device `ordinal` with room for `max_seqs` live sequences
    /// and `max_tokens` cached tokens in caches of format `kv`, in bf16 (or f32 when `f32`);
    /// decode steps use CUDA graphs when `graphs` (and every routed expert is on the GPU: with
    /// experts off it, `offload`, steps run eagerly).
    pub fn load_gpu(
        ck: &k3_model::Checkpoint,
        ordinal: usize,
        max_seqs: usize,
        max_tokens: usize,
        kv: KvDtype,
        graphs: bool,
        f32: bool,
        offload: &k3_model::offload::OffloadOptions,
    ) -> Result<GpuRunner> {
        let dev = k3_core::cuda::CudaDevice::new(ordinal).map_err(k3_model::ModelError::from)?;
        let cache = k3_model::cuda::CacheConfig { max_seqs, max_tokens, kv_cache_dtype: kv };
        let off = k3_model::offload::gpu_offload(ck, offload, kv, 0..ck.config.text.num_experts)?;
        let plan = k3_model::RankPlan::single(&ck.config);
        let groups = k3_model::parallel::CudaGroups::single();
        let model = CudaModel::load_rank_reporting(ck, &dev, plan, groups, cache, precision(f32), None, &off)?;
        let graphs = graphs && model.capturable();
        Ok(GpuRunner::new(model, Model::load_embedding(ck)?, graphs))
    }

    /// The GPU precision of an `--precision f32` flag.
    pub fn precision(f32: bool) -> k3_model::cuda::Precision {
        if f32 {
            k3_model::cuda::Precision::F32
        } else {
            k3_model::cuda::Precision::Bf16
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use k3_model::capacity::KvDtype;
    use k3_model::Config;

    use crate::dist::runner::{Runner, Step};
    use crate::engine::SeqId;
    use crate::error::Result;

    /// Uninhabited without the `cuda` feature.
    pub enum GpuSeq {}
    /// Uninhabited without the `cuda` feature: no value exists, so no method ever runs.
    pub enum GpuRunner {}

    impl GpuRunner {
        pub fn set_verify_graphs(&mut self, _: bool) {
            match *self {}
        }
        pub fn verify_stats(&self) -> std::sync::Arc<super::VerifyStats> {
            match *self {}
        }
    }

    impl Runner for GpuRunner {
        fn config(&self) -> &Config {
            match *self {}
        }
        fn embed(&self, _: &[u32]) -> Result<Vec<f32>> {
            match *self {}
        }
        fn release(&mut self, _: SeqId) {
            match *self {}
        }
        fn forward(&mut self, _: Step) -> Result<Vec<f32>> {
            match *self {}
        }
        fn state_bytes(&self) -> usize {
            match *self {}
        }
    }

    /// Always an error: this build has no CUDA support.
    pub fn load_gpu(
        _: &k3_model::Checkpoint,
        _: usize,
        _: usize,
        _: usize,
        _: KvDtype,
        _: bool,
        _: bool,
        _: &k3_model::offload::OffloadOptions,
    ) -> Result<GpuRunner> {
        Err(crate::error::EngineError::Unsupported("this build has no CUDA support: rebuild with `cargo build --release --features cuda`".into()))
    }
}

#[cfg(feature = "cuda")]
pub use imp::precision;
pub use imp::{load_gpu, GpuRunner, GpuSeq};
