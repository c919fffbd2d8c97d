//! Routed experts read from disk when the router chooses them (issue 23's disk tier): a bounded
//! cache of whole experts in host memory, filled by a pool of reader threads straight from the
//! checkpoint's own safetensors files (around-backbone §1.2 for where a tensor lies, §2.2 for
//! the MXFP4 pair). Nothing is converted: an expert's `w1`, `w3`, `w2` (MXFP4 `weight_packed` +
//! `weight_scale`, or dense `weight`) are read as stored, the adjacent ones of a shard in one
//! read, and become [`Matrix`] views of the read buffer (`Tensor::shared`).
//!
//! - **Reads**: `pread` on a pool of `readers` threads; with O_DIRECT by default where the
//!   file system takes it (page-aligned reads into page-aligned buffers, so the page cache does
//!   not keep a second copy of what this cache holds), buffered otherwise ([`DirectIo`]).
//! - **Read-ahead**: [`ExpertCache::prefetch`] queues the misses and returns at once (call it as
//!   soon as the router has chosen); [`ExpertCache::fetch`] yields the experts in the order they
//!   arrive, so computing the first overlaps reading the rest.
//! - **Bound**: experts are evicted least recently used once the bytes held (and being read)
//!   pass the budget; an expert a caller still holds or waits for is never evicted, so a step
//!   whose experts exceed the budget still runs, and the cache shrinks back after it.
//! - **Errors** name the tensor and the file (a short read: the file is truncated; a scale byte
//!   of 255: the checkpoint is corrupt) and are returned to every caller that asks for it.
//!
//! Keys are `(layer, expert)` with global expert ids.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;

use super::read::{open_direct, read_expert, Place, ShardFile};
use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};
use crate::layers::moe::Expert;

/// Whether reads bypass the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectIo {
    /// O_DIRECT where the file system takes it, buffered where not.
    Auto,
    /// O_DIRECT or an error.
    On,
    /// Buffered reads through the page cache.
    Off,
}

#[derive(Clone, Debug)]
pub struct CacheOptions {
    /// Bytes of experts held (and being read) at once before eviction.
    pub budget_bytes: u64,
    /// Reader threads (reads in flight at once).
    pub readers: usize,
    pub direct_io: DirectIo,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions { budget_bytes: 8 << 30, readers: 8, direct_io: DirectIo::Auto }
    }
}

/// What the cache did so far (`k3 run --json`, `/metrics`, `k3 bench`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CacheStats {
    /// Experts asked for by [`ExpertCache::fetch`].
    pub requests: u64,
    /// … found in memory.
    pub hits: u64,
    /// … already being read (by a prefetch or another fetch).
    pub in_flight: u64,
    /// … read for the request.
    pub misses: u64,
    /// Experts read, and their bytes (as stored).
    pub reads: u64,
    pub bytes_read: u64,
    /// Seconds the readers spent in `pread`, summed over readers.
    pub read_seconds: f64,
    /// Seconds callers spent waiting for an expert to arrive.
    pub wait_seconds: f64,
    pub evictions: u64,
    pub resident_bytes: u64,
    pub peak_resident_bytes: u64,
    pub budget_bytes: u64,
    /// Reads that went through O_DIRECT, and through the page cache.
    pub direct_reads: u64,
    pub buffered_reads: u64,
}

impl CacheStats {
    /// Hits over requests (0 before any request).
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.hits as f64 / self.requests as f64
        }
    }
}

type Key = (usize, usize);

enum Slot {
    Loading,
    /// `used`: handed out at least once (a prefetched expert not yet used goes last).
    Ready {
        expert: Arc<Expert>,
        tick: u64,
        used: bool,
    },
    Failed(String),
}

struct State {
    slots: HashMap<Key, Slot>,
    queue: VecDeque<Key>,
    /// Keys callers wait for (never evicted), with how many wait.
    wanted: HashMap<Key, usize>,
    tick: u64,
    stats: CacheStats,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    /// A slot became ready or failed.
    arrived: Condvar,
    /// The queue has work, or shutdown.
    work: Condvar,
    files: Vec<ShardFile>,
    places: HashMap<Key, Place>,
}

/// The disk tier's expert cache (see the module doc). Dropping it stops its readers.
pub struct ExpertCache {
    shared: Arc<Shared>,
    readers: Vec<std::thread::JoinHandle<()>>,
    layers: Vec<usize>,
    experts: Range<usize>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ExpertCache {
    /// A cache over the routed experts `experts` (global ids) of the MoE `layers` of `ck`, whole
    /// experts (`moe_intermediate_size` rows): checks every tensor's presence, shape and dtype
    /// now (naming the first bad one) and starts the readers.
    pub fn open(ck: &Checkpoint, layers: &[usize], experts: Range<usize>, opts: &CacheOptions) -> Result<ExpertCache> {
        let t = &ck.config.text;
        let mut places = HashMap::new();
        let mut largest = 0u64;
        for &l in layers {
            for e in experts.clone() {
                let place = Place::of(ck, l, e)?;
                largest = largest.max(place.bytes());
                places.insert((l, e), place);
            }
        }
        let need = super::one_token(ck, largest);
        if !places.is_empty() && opts.budget_bytes < need {
            return Err(ModelError::Input(format!(
                "the expert cache budget (--expert-cache-mem) of {} bytes is below one token's {} experts of a layer ({need} bytes): give at least that, better several layers' worth",
                opts.budget_bytes, t.num_experts_per_token
            )));
        }
        let mut files = Vec::with_capacity(ck.files.len());
        for path in &ck.files {
            let io = |e| ModelError::Io { path: path.display().to_string(), source: e };
            let buffered = File::open(path).map_err(io)?;
            let direct = match opts.direct_io {
                DirectIo::Off => None,
                DirectIo::Auto => open_direct(path).ok(),
                DirectIo::On => Some(open_direct(path).map_err(|e| ModelError::Io {
                    path: format!("{} (O_DIRECT: the file system may not support it; use direct I/O off)", path.display()),
                    source: e,
                })?),
            };
            files.push(ShardFile { path: path.clone(), buffered, direct });
        }
        let state = State {
            slots: HashMap::new(),
            queue: VecDeque::new(),
            wanted: HashMap::new(),
            tick: 0,
            stats: CacheStats { budget_bytes: opts.budget_bytes, ..Default::default() },
            shutdown: false,
        };
        let shared = Arc::new(Shared { state: Mutex::new(state), arrived: Condvar::new(), work: Condvar::new(), files, places });
        let mut readers = Vec::new();
        for i in 0..opts.readers.max(1) {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("k3-expert-read-{i}"))
                .spawn(move || reader(&s))
                .map_err(|e| ModelError::Internal(format!("could not start an expert reader thread: {e}")))?;
            readers.push(h);
        }
        Ok(ExpertCache { shared, readers, layers: layers.to_vec(), experts })
    }

    /// The MoE layers whose experts this cache reads.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// Whether `layer`'s experts come from this cache.
    pub fn covers(&self, layer: usize) -> bool {
        self.layers.contains(&layer)
    }

    /// Bytes of one layer's experts as stored (the first covered layer's).
    pub fn expert_bytes(&self, layer: usize, expert: usize) -> u64 {
        self.shared.places.get(&(layer, expert)).map_or(0, Place::bytes)
    }

    /// One line for start-up messages: what is read, into how much memory, how.
    pub fn describe(&self) -> String {
        let sh = &self.shared;
        let direct = sh.files.iter().all(|f| f.direct.is_some());
        let b = lock(&sh.state).stats.budget_bytes as f64;
        let size = if b >= (1u64 << 30) as f64 { format!("{:.2} GiB", b / (1u64 << 30) as f64) } else { format!("{:.1} MiB", b / (1u64 << 20) as f64) };
        format!(
            "{} MoE layers' routed experts read from disk into a {size} cache ({} readers, {})",
            self.layers.len(),
            self.readers.len(),
            if direct { "O_DIRECT" } else { "buffered reads" }
        )
    }

    pub fn stats(&self) -> CacheStats {
        lock(&self.shared.state).stats.clone()
    }

    fn check_key(&self, layer: usize, e: usize) -> Result<()> {
        if self.shared.places.contains_key(&(layer, e)) {
            Ok(())
        } else {
            Err(ModelError::Internal(format!("expert {e} of layer {layer} is not in this expert cache (layers {:?}, experts {:?})", self.layers, self.experts)))
        }
    }

    /// Queues a read of every expert of `layer` in `experts` not in memory or on its way, and
    /// returns at once (read-ahead).
    pub fn prefetch(&self, layer: usize, experts: &[usize]) -> Result<()> {
        for &e in experts {
            self.check_key(layer, e)?;
        }
        let mut st = lock(&self.shared.state);
        for &e in experts {
            if !st.slots.contains_key(&(layer, e)) {
                self.enqueue(&mut st, (layer, e));
            }
        }
        Ok(())
    }

    /// The experts of `layer` in `experts` (distinct), as they arrive: a handle whose
    /// [`Fetch::next_ready`] yields those in memory, waiting for at least one.
    pub fn fetch(&self, layer: usize, experts: &[usize]) -> Result<Fetch<'_>> {
        for &e in experts {
            self.check_key(layer, e)?;
        }
        let mut st = lock(&self.shared.state);
        for &e in experts {
            let k = (layer, e);
            *st.wanted.entry(k).or_insert(0) += 1;
            st.stats.requests += 1;
            match st.slots.get(&k) {
                Some(Slot::Ready { .. }) => st.stats.hits += 1,
                Some(Slot::Loading) => st.stats.in_flight += 1,
                Some(Slot::Failed(_)) => {}
                None => {
                    st.stats.misses += 1;
                    self.enqueue(&mut st, k);
                }
            }
        }
        Ok(Fetch { cache: self, layer, pending: experts.to_vec() })
    }

    fn enqueue(&self, st: &mut State, k: Key) {
        let bytes = self.shared.places[&k].bytes();
        st.slots.insert(k, Slot::Loading);
        st.stats.resident_bytes += bytes;
        evict(st, &self.shared.places);
        st.stats.peak_resident_bytes = st.stats.peak_resident_bytes.max(st.stats.resident_bytes);
        st.queue.push_back(k);
        self.shared.work.notify_one();
    }
}

impl Drop for ExpertCache {
    fn drop(&mut self) {
        lock(&self.shared.state).shutdown = true;
        self.shared.work.notify_all();
        for h in self.readers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Evicts least recently used experts that nobody holds or waits for until the bytes held fit
/// the budget (or nothing more can go); read-ahead that was never used goes only after every
/// used one.
fn evict(st: &mut State, places: &HashMap<Key, Place>) {
    while st.stats.resident_bytes > st.stats.budget_bytes {
        let victim = st
            .slots
            .iter()
            .filter_map(|(k, s)| match s {
                Slot::Ready { expert, tick, used } if Arc::strong_count(expert) == 1 && !st.wanted.contains_key(k) => Some((!*used, *tick, *k)),
                _ => None,
            })
            .min();
        let Some((_, _, k)) = victim else { break };
        st.slots.remove(&k);
        st.stats.resident_bytes -= places[&k].bytes();
        st.stats.evictions += 1;
    }
}

/// An expert handed out by [`Fetch::next_ready`]: its global id and weights.
pub type Arrived = (usize, Arc<Expert>);

/// The experts one [`ExpertCache::fetch`] asked for, handed out as they arrive.
pub struct Fetch<'a> {
    cache: &'a ExpertCache,
    layer: usize,
    pending: Vec<usize>,
}

impl Fetch<'_> {
    /// Every asked-for expert now in memory and not yet handed out (at least one: waits for
    /// it); `None` once all were handed out. An expert that failed to read fails the call.
    pub fn next_ready(&mut self) -> Result<Option<Vec<Arrived>>> {
        if self.pending.is_empty() {
            return Ok(None);
        }
        let sh = &self.cache.shared;
        let mut st = lock(&sh.state);
        loop {
            let mut out = Vec::new();
            let mut i = 0;
            while i < self.pending.len() {
                let k = (self.layer, self.pending[i]);
                st.tick += 1;
                let tick = st.tick;
                match st.slots.get_mut(&k) {
                    Some(Slot::Ready { expert, tick: t, used }) => {
                        *t = tick;
                        *used = true;
                        out.push((k.1, expert.clone()));
                        unwant(&mut st, k);
                        self.pending.swap_remove(i);
                    }
                    Some(Slot::Failed(msg)) => return Err(ModelError::Checkpoint { path: "expert cache".into(), msg: msg.clone() }),
                    Some(Slot::Loading) => i += 1,
                    None => {
                        // Cannot happen while wanted (never evicted); re-read rather than hang.
                        self.cache.enqueue(&mut st, k);
                        i += 1;
                    }
                }
            }
            if !out.is_empty() {
                out.sort_by_key(|p| p.0);
                return Ok(Some(out));
            }
            if st.shutdown {
                return Err(ModelError::Internal("the expert cache stopped while a step waited for an expert".into()));
            }
            let t0 = Instant::now();
            st = sh.arrived.wait(st).unwrap_or_else(|p| p.into_inner());
            st.stats.wait_seconds += t0.elapsed().as_secs_f64();
        }
    }
}

fn unwant(st: &mut State, k: Key) {
    if let Some(n) = st.wanted.get_mut(&k) {
        *n -= 1;
        if *n == 0 {
            st.wanted.remove(&k);
        }
    }
}

impl Drop for Fetch<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.cache.shared.state);
        for &e in &self.pending {
            unwant(&mut st, (self.layer, e));
        }
        evict(&mut st, &self.cache.shared.places);
    }
}

/// A reader thread: takes queued keys, reads them, publishes the result.
fn reader(sh: &Shared) {
    loop {
        let k = {
            let mut st = lock(&sh.state);
            loop {
                if st.shutdown {
                    return;
                }
                if let Some(k) = st.queue.pop_front() {
                    break k;
                }
                st = sh.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let t0 = Instant::now();
        let got = read_expert(&sh.files, &sh.places[&k]);
        let secs = t0.elapsed().as_secs_f64();
        let mut st = lock(&sh.state);
        st.stats.read_seconds += secs;
        match got {
            Ok((expert, direct)) => {
                st.stats.reads += 1;
                st.stats.bytes_read += sh.places[&k].bytes();
                if direct {
                    st.stats.direct_reads += 1;
                } else {
                    st.stats.buffered_reads += 1;
                }
                st.tick += 1;
                let tick = st.tick;
                st.slots.insert(k, Slot::Ready { expert: Arc::new(expert), tick, used: false });
            }
            Err(msg) => {
                st.stats.resident_bytes -= sh.places[&k].bytes();
                st.slots.insert(k, Slot::Failed(msg));
            }
        }
        evict(&mut st, &sh.places);
        sh.arrived.notify_all();
    }
}
