//! NCCL on a device stream (feature `cuda`): [`CudaGroup`], the device-side twin of
//! [`Group`](super::Group). Its verbs take [`CudaTensor`]s and are enqueued on the device's one
//! compute stream, so they order with every kernel and capture into CUDA graphs
//! ([`crate::cuda::capture`]; run each collective once eagerly first: NCCL connects on first use).
//! [`CudaGroup::single`] is world 1 (every verb returns at once, no library needed);
//! [`CudaGroup::nccl`] joins an NCCL communicator, one rank per process, whose 128-byte id comes
//! from [`nccl_unique_id`] on one rank (that process hosts NCCL's bootstrap root until all joined).
//!
//! Shapes (n = elements per rank, W = world): `all_reduce_sum` x [n] in place; `all_gather`
//! x [n] → out [W·n] in rank order; `reduce_scatter` x [W·n] → out [n], part `rank` of the sum;
//! `broadcast` x [n] in place from `root`; `send`/`recv` x [n]. Dtypes F32, BF16, F16, I32, I64, U8.
//!
//! Library: NCCL is loaded at run time, never linked (`nccl/library.rs`; 2.18 or newer,
//! `$K3_NCCL_LIB` names it when it is not found).
//!
//! Faults: communicators are non-blocking (`ncclConfig_t.blocking = 0`), so no NCCL call blocks
//! the host. Init, in-progress launches and [`CudaGroup::wait`]/[`CudaGroup::barrier`] poll
//! `ncclCommGetAsyncError`; a watchdog thread polls it too, and an event recorded after each eager
//! verb. On an NCCL error (a peer's socket closed, say) or when the oldest unfinished verb is older
//! than `K3_NCCL_TIMEOUT_S` (default 180 s), the communicator is aborted (`ncclCommAbort`, which
//! also makes its spinning kernels exit, so even a plain stream synchronise returns) and this and
//! every later call returns [`CoreError::Comm`] naming the call, the rank and the reason. Graph
//! replays are not seen: call [`CudaGroup::watch`] or `wait` after launching one that holds
//! collectives. One thread should issue a group's calls.
//!
//! Files: this one holds [`CudaGroup`] and its verbs; `nccl/library.rs` finds, loads and binds
//! libnccl; `nccl/communicator.rs` is one communicator's state and its fault handling (abort,
//! the pending verb's clock, the watchdog thread).

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::sys as dsys;
use cudarc::nccl::sys::{ncclConfig_t, ncclUniqueId};

use crate::cuda::{derr, lock, CudaDevice, CudaTensor};
use crate::{CoreError, DType, Result};

mod communicator;
mod library;

use communicator::{watchdog, Nccl, State};
use library::{api, err_string, pause, poll, Buf, BufMut, Comm, IN_PROGRESS, SUM};
pub use library::{nccl_library, nccl_timeout, nccl_unique_id};

/// A group of ranks whose verbs run on device tensors (see the module docs); `None` is world 1.
pub struct CudaGroup {
    n: Option<Arc<Nccl>>,
}

impl CudaGroup {
    /// The world-1 group: every verb returns at once (a gather or scatter into another tensor
    /// enqueues one copy); there is no peer to send to.
    pub fn single() -> Self {
        CudaGroup { n: None }
    }

    /// Rank `rank` of `world` joins the communicator of `id` on `dev` (its context is bound to
    /// this thread first). Returns once every rank has joined, or errors after the timeout
    /// ([`nccl_timeout`], which then bounds every later call too).
    pub fn nccl(dev: &CudaDevice, rank: usize, world: usize, id: [u8; 128]) -> Result<Self> {
        const OP: &str = "nccl_init";
        let timeout = nccl_timeout();
        if world == 0 || rank >= world {
            return Err(CoreError::Comm { op: OP, msg: format!("rank {rank} does not exist in a world of {world}") });
        }
        let api = api(OP)?;
        dev.bind()?;
        const U: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
        let null = std::ptr::null();
        #[rustfmt::skip]
        let mut cfg = ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(), magic: 0xcafebeef, version: api.version as u32, blocking: 0,
            cgaClusterSize: U, minCTAs: U, maxCTAs: U, netName: null, splitShare: U, trafficClass: U, commName: null,
            collnetEnable: U, CTAPolicy: U, shrinkShare: U, nvlsCTAs: U, nChannelsPerNetPeer: U, nvlinkCentricSched: U,
            graphUsageMode: U, numRmaCtx: U, maxP2pPeers: U,
        };
        let uid = ncclUniqueId { internal: id.map(|b| b as c_char) };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: out-parameter; the config is filled as NCCL_CONFIG_INITIALIZER does (the
        // library reads at most its own struct size and only the fields of its version).
        let r = unsafe { (api.init_rank_config)(&mut comm, world as c_int, uid, rank as c_int, &mut cfg) };
        if let Err(bad) = if r == 0 || r == IN_PROGRESS { poll(api, comm, timeout, &AtomicBool::new(false)) } else { Err(Some(r)) } {
            let msg = match bad {
                Some(c) => format!("rank {rank} of {world}: ncclCommInitRankConfig failed: {}", err_string(api, c, comm)),
                None => format!("rank {rank} of {world}: not every rank joined within {:.0} s (a peer died, was not started, or holds another id; K3_NCCL_TIMEOUT_S sets the limit)", timeout.as_secs_f64()),
            };
            if !comm.is_null() {
                // SAFETY: the half-made communicator is ours alone.
                unsafe { (api.abort)(comm) };
            }
            return Err(CoreError::Comm { op: OP, msg });
        }
        let event = dev.inner().ctx.new_event(Some(dsys::CUevent_flags::CU_EVENT_DISABLE_TIMING)).map_err(derr("cuEventCreate"))?;
        let scratch = CudaTensor::zeros(dev, DType::F32, vec![1])?;
        let st = Mutex::new(State { comm, failed: None, pending: None, in_group: 0 });
        let n = Arc::new(Nccl {
            api,
            dev: dev.clone(),
            rank,
            world,
            timeout,
            event,
            st,
            stop: AtomicBool::new(false),
            dog: Mutex::new(None),
            scratch,
            abort_asked: AtomicBool::new(false),
            abort_why: Mutex::new(None),
        });
        let n2 = n.clone();
        let dog = std::thread::Builder::new().name(format!("k3-nccl-watchdog-{rank}")).spawn(move || watchdog(n2));
        *lock(&n.dog) = Some(dog.map_err(|e| CoreError::Comm { op: OP, msg: format!("starting the watchdog thread: {e}") })?);
        Ok(CudaGroup { n: Some(n) })
    }

    /// This rank's index in the group, `0..world()`.
    pub fn rank(&self) -> usize {
        self.n.as_ref().map_or(0, |n| n.rank)
    }

    /// Number of ranks in the group.
    pub fn world(&self) -> usize {
        self.n.as_ref().map_or(1, |n| n.world)
    }

    fn nccl_of(&self) -> Option<&Nccl> {
        self.n.as_deref()
    }

    /// The NCCL dtype of `t`, after checking it lives on this group's device.
    fn dtype_of(&self, op: &'static str, t: &CudaTensor) -> Result<c_int> {
        if let Some(n) = self.nccl_of().filter(|n| !t.cuda_device().same(&n.dev)) {
            return Err(CoreError::Comm { op, msg: format!("{t:?} is not on this group's device cuda:{}", n.dev.ordinal()) });
        }
        Ok(match t.dtype() {
            DType::U8 => 1,
            DType::I32 => 2,
            DType::I64 => 4,
            DType::F16 => 6,
            DType::F32 => 7,
            DType::BF16 => 9,
        })
    }

    /// Checks that `big` holds `world()` times `small`'s elements, same dtype; returns it.
    fn parts(&self, op: &'static str, small: &CudaTensor, big: &CudaTensor) -> Result<c_int> {
        let dt = self.dtype_of(op, small)?;
        if self.dtype_of(op, big)? != dt || big.numel() != small.numel() * self.world() {
            return Err(CoreError::Shape { op, detail: format!("{big:?} is not {} × {small:?}", self.world()) });
        }
        Ok(dt)
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<&Nccl> {
        let bad = || CoreError::Comm { op, msg: format!("rank {} of {}: peer {peer} is not another rank of this group", self.rank(), self.world()) };
        self.nccl_of().filter(|n| peer < n.world && peer != n.rank).ok_or_else(bad)
    }

    /// Element-wise sum over the ranks, in place. Every rank ends with the same values.
    pub fn all_reduce_sum(&self, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("all_reduce_sum", x)?;
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let p = x.ptr() as BufMut;
        // SAFETY (here and in the verbs below): the sizes were checked, and the caller's
        // tensors stay allocated until the stream has run the enqueued work.
        n.call("all_reduce_sum", |a, c, s| unsafe { (a.all_reduce)(p, p, x.numel(), dt, SUM, c, s) })
    }

    /// Every rank's `x` into `out` (`world()·x.numel()` elements), in rank order.
    pub fn all_gather(&self, x: &CudaTensor, out: &CudaTensor) -> Result<()> {
        let dt = self.parts("all_gather", x, out)?;
        let Some(n) = self.nccl_of() else { return copy_unless_same(x, out) };
        n.call("all_gather", |a, c, s| unsafe { (a.all_gather)(x.ptr() as Buf, out.ptr() as BufMut, x.numel(), dt, c, s) })
    }

    /// The element-wise sum of every rank's `x` (`world()·out.numel()` elements), cut into
    /// `world()` equal parts; part `rank()` lands in `out`.
    pub fn reduce_scatter(&self, x: &CudaTensor, out: &CudaTensor) -> Result<()> {
        let dt = self.parts("reduce_scatter", out, x)?;
        let Some(n) = self.nccl_of() else { return copy_unless_same(x, out) };
        n.call("reduce_scatter", |a, c, s| unsafe { (a.reduce_scatter)(x.ptr() as Buf, out.ptr() as BufMut, out.numel(), dt, SUM, c, s) })
    }

    /// Rank `root`'s `x` to every rank, in place.
    pub fn broadcast(&self, root: usize, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("broadcast", x)?;
        if root >= self.world() {
            return Err(CoreError::Comm { op: "broadcast", msg: format!("root {root} is not a rank of a world of {}", self.world()) });
        }
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let p = x.ptr() as BufMut;
        n.call("broadcast", |a, c, s| unsafe { (a.broadcast)(p, p, x.numel(), dt, root as c_int, c, s) })
    }

    /// Sends `x` to rank `to`; pairs with `to`'s `recv` (put both directions of an exchange in
    /// one [`CudaGroup::group`]).
    pub fn send(&self, to: usize, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("send", x)?;
        self.peer("send", to)?.call("send", |a, c, s| unsafe { (a.send)(x.ptr() as Buf, x.numel(), dt, to as c_int, c, s) })
    }

    /// Receives `x.numel()` elements from rank `from` into `x`.
    pub fn recv(&self, from: usize, x: &CudaTensor) -> Result<()> {
        let dt = self.dtype_of("recv", x)?;
        self.peer("recv", from)?.call("recv", |a, c, s| unsafe { (a.recv)(x.ptr() as BufMut, x.numel(), dt, from as c_int, c, s) })
    }

    /// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`, so the verbs it issues launch as
    /// one (needed for exchanges: a ring's send and recv together).
    pub fn group<R>(&self, f: impl FnOnce(&Self) -> Result<R>) -> Result<R> {
        const OP: &str = "group";
        let Some(n) = self.nccl_of() else { return f(self) };
        {
            let mut st = n.state();
            n.live(OP, &st)?;
            // SAFETY: no arguments.
            match unsafe { (n.api.group_start)() } {
                0 => st.in_group += 1,
                r => return Err(CoreError::Comm { op: OP, msg: format!("ncclGroupStart: {}", err_string(n.api, r, std::ptr::null_mut())) }),
            }
        }
        let out = f(self);
        let mut st = lock(&n.st);
        st.in_group -= 1;
        let _ = n.dev.bind();
        // SAFETY: closes the group opened above on this thread (always, so NCCL's per-thread
        // group depth stays balanced); an abort asked for meanwhile was deferred until here.
        let r = unsafe { (n.api.group_end)() };
        if let Some(why) = st.failed.clone() {
            return Err(n.fail(&mut st, OP, why));
        }
        n.finish(st, OP, r)?;
        out
    }

    /// Lets the watchdog bound everything enqueued so far (e.g. after a graph replay that holds
    /// this group's collectives): past the timeout the group fails naming `op`.
    pub fn watch(&self, op: &'static str) -> Result<()> {
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let mut st = n.state();
        n.live(op, &st)?;
        n.dev.bind()?;
        n.record(&mut st, op)
    }

    /// Waits until everything enqueued on the compute stream so far has finished, or errors
    /// naming `op` when a peer fails or the timeout passes (world 1 without NCCL: returns).
    pub fn wait(&self, op: &'static str) -> Result<()> {
        let Some(n) = self.nccl_of() else { return Ok(()) };
        self.watch(op)?;
        let t0 = Instant::now();
        while !n.check(&mut n.state(), op)? {
            pause(t0);
        }
        Ok(())
    }

    /// Returns when every rank has called it (a one-element all-reduce, then [`Self::wait`]).
    pub fn barrier(&self) -> Result<()> {
        let Some(n) = self.nccl_of() else { return Ok(()) };
        let p = n.scratch.ptr() as BufMut;
        // SAFETY: one f32 of the group's own scratch tensor, in place.
        n.call("barrier", |a, c, s| unsafe { (a.all_reduce)(p, p, 1, 7, SUM, c, s) })?;
        self.wait("barrier")
    }

    /// Fails this rank's communicator at once with `why` (aborting it); its peers' pending and
    /// later calls then fail too (by NCCL's error or the timeout) instead of waiting forever.
    /// Never waits behind a thread that holds the communicator (one stuck launching a verb to a
    /// dead peer): it asks, and that thread stops polling and aborts.
    pub fn abort(&self, why: &str) {
        if let Some(n) = self.nccl_of() {
            lock(&n.abort_why).get_or_insert_with(|| format!("aborted: {why}"));
            n.abort_asked.store(true, Ordering::Release);
            if let Ok(mut st) = n.st.try_lock() {
                n.honor(&mut st);
            }
        }
    }
}

/// World 1's gather and scatter: a copy unless in place.
fn copy_unless_same(x: &CudaTensor, out: &CudaTensor) -> Result<()> {
    if x.ptr() == out.ptr() {
        Ok(())
    } else {
        out.copy_from(x)
    }
}

impl Drop for CudaGroup {
    /// Lets enqueued work finish (bounded), then finalizes (which flushes this rank's sends to
    /// its peers) and destroys; a failed or stuck communicator is aborted instead.
    fn drop(&mut self) {
        let Some(n) = self.nccl_of() else { return };
        let who = format!("NCCL rank {}/{}", self.rank(), self.world());
        crate::trace(|| format!("{who}: dropping the communicator"));
        n.stop.store(true, Ordering::Relaxed);
        if let Some(d) = lock(&n.dog).take() {
            let _ = d.join();
        }
        let healthy = self.wait("drop").is_ok();
        crate::trace(|| format!("{who}: watchdog joined, enqueued work done: {healthy}"));
        let mut st = lock(&n.st);
        let comm = std::mem::replace(&mut st.comm, std::ptr::null_mut());
        if comm.is_null() {
            return;
        }
        let _ = n.dev.bind();
        // SAFETY: the communicator is live and ours alone from here; the handle is not used again.
        unsafe {
            let r = if healthy { (n.api.finalize)(comm) } else { 1 };
            let polled = (r == 0 || r == IN_PROGRESS) && poll(n.api, comm, n.timeout.min(Duration::from_secs(30)), &n.abort_asked).is_ok();
            crate::trace(|| format!("{who}: finalize returned {r}, completed: {polled}"));
            if polled {
                (n.api.destroy)(comm);
            } else {
                (n.api.abort)(comm);
            }
        }
        crate::trace(|| format!("{who}: communicator {}", if healthy { "destroyed" } else { "aborted" }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without NCCL (CI) the loader answers `CudaUnavailable` naming libnccl.so.2; with it, a
    /// version. Never a panic, GPU or not.
    #[test]
    fn library_lookup_never_panics() {
        match nccl_library() {
            Ok((path, v)) => eprintln!("NCCL {v} from {path}"),
            Err(CoreError::CudaUnavailable(m)) => assert!(m.contains("libnccl.so.2") && m.contains("K3_NCCL_LIB"), "{m}"),
            Err(e) => panic!("{e}"),
        }
        // Without a GPU this fails inside NCCL (or at the loader); it must not panic.
        let _ = nccl_unique_id();
        let g = CudaGroup::single();
        assert!(g.barrier().is_ok() && g.wait("test").is_ok() && (g.rank(), g.world()) == (0, 1));
    }
}
