//! One NCCL communicator of a [`CudaGroup`](super::CudaGroup) (feature `cuda`) and its fault
//! handling: the state lock every NCCL call holds, the completion event recorded after eager
//! verbs and the pending verb's clock, the abort (performed by whoever holds the lock next when
//! another thread asked for it), and the watchdog thread that polls NCCL's asynchronous error
//! and the timeout every 50 ms (the parent module's "Faults" paragraph says what callers see).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::{thread::JoinHandle, time::Duration, time::Instant};

use cudarc::driver::{result as dres, sys as dsys, CudaEvent};

use super::library::{async_state, err_string, poll, Api, Comm, Res, Stream, IN_PROGRESS};
use crate::cuda::{derr, lock, CudaDevice, CudaTensor};
use crate::{CoreError, Result};

/// `comm` is null once aborted or destroyed; `pending` is the oldest eager verb not yet seen
/// complete and when it was enqueued; inside `in_group` open groups verbs record no event (NCCL
/// launches them at the group's end).
pub(super) struct State {
    pub(super) comm: Comm,
    pub(super) failed: Option<String>,
    pub(super) pending: Option<(&'static str, Instant)>,
    pub(super) in_group: usize,
}
// SAFETY: an NCCL communicator may be used from any thread; every use holds the `State` lock.
unsafe impl Send for State {}

/// One communicator; `event` is recorded on the compute stream after eager verbs (complete =
/// everything before it done); `stop` ends the watchdog thread `dog`.
pub(super) struct Nccl {
    pub(super) api: &'static Api,
    pub(super) dev: CudaDevice,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) timeout: Duration,
    pub(super) event: CudaEvent,
    pub(super) st: Mutex<State>,
    pub(super) stop: AtomicBool,
    pub(super) dog: Mutex<Option<JoinHandle<()>>>,
    /// One f32 for [`CudaGroup::barrier`](super::CudaGroup::barrier).
    pub(super) scratch: CudaTensor,
    /// An abort asked for while another thread held `st` (e.g. waiting for a launch that
    /// connects to a dead peer): that thread's poll stops at `abort_asked`, and whoever holds
    /// the lock next performs the abort ([`Nccl::state`]), so NCCL is never called on the
    /// communicator from two threads.
    pub(super) abort_asked: AtomicBool,
    pub(super) abort_why: Mutex<Option<String>>,
}

impl Nccl {
    /// The state, locked, after performing an abort another thread asked for.
    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        let mut st = lock(&self.st);
        self.honor(&mut st);
        st
    }

    /// Performs an abort asked for while the lock was held (caller holds it).
    pub(super) fn honor(&self, st: &mut State) {
        if self.abort_asked.load(Ordering::Acquire) && st.failed.is_none() {
            let why = lock(&self.abort_why).clone().unwrap_or_else(|| "aborted".into());
            self.fail(st, "abort", why);
        }
    }

    /// Aborts the communicator and remembers why (idempotent; inside an open group the abort
    /// waits for the group's end, which still needs the handle). Returns the error every call
    /// now gets. Caller holds the lock.
    pub(super) fn fail(&self, st: &mut State, op: &'static str, why: String) -> CoreError {
        st.failed.get_or_insert(why);
        if !st.comm.is_null() && st.in_group == 0 {
            let _ = self.dev.bind();
            crate::trace(|| format!("NCCL rank {}/{}: {op}: ncclCommAbort ({})", self.rank, self.world, st.failed.as_deref().unwrap_or("")));
            // SAFETY: live communicator; no other call on it can run (we hold the lock).
            unsafe { (self.api.abort)(st.comm) };
            crate::trace(|| format!("NCCL rank {}/{}: {op}: aborted", self.rank, self.world));
            st.comm = std::ptr::null_mut();
        }
        self.failed_err(op, st).expect("failed is set")
    }

    fn failed_err(&self, op: &'static str, st: &State) -> Option<CoreError> {
        st.failed.as_ref().map(|why| CoreError::Comm { op, msg: format!("rank {} of {}: communicator unusable: {why}", self.rank, self.world) })
    }

    /// `Err` once the communicator has failed.
    pub(super) fn live(&self, op: &'static str, st: &State) -> Result<()> {
        self.failed_err(op, st).map_or(Ok(()), Err)
    }

    /// Polls NCCL's asynchronous error and the pending event once; aborts on an error or when
    /// the oldest pending verb is past the timeout. `Ok(true)` when nothing is pending.
    pub(super) fn check(&self, st: &mut State, op: &'static str) -> Result<bool> {
        self.live(op, st)?;
        let bad = async_state(self.api, st.comm);
        let what = st.pending.map(|p| p.0).unwrap_or("the last call");
        if bad != 0 && bad != IN_PROGRESS {
            let why = format!("NCCL reported {} while {what} was in flight: a peer rank died or its connection failed", err_string(self.api, bad, st.comm));
            return Err(self.fail(st, op, why));
        }
        let Some((_, since)) = st.pending else { return Ok(true) };
        let _ = self.dev.bind();
        let not_ready = dsys::cudaError_enum::CUDA_ERROR_NOT_READY;
        // SAFETY: the event belongs to this device's context, bound above.
        match unsafe { dres::event::query(self.event.cu_event()) } {
            Ok(()) => {
                st.pending = None;
                Ok(true)
            }
            Err(e) if e.0 == not_ready && since.elapsed() <= self.timeout => Ok(false),
            Err(e) if e.0 == not_ready => {
                let why = format!(
                    "{what} did not complete within {:.0} s (a peer rank died, hangs, or never made the matching call; K3_NCCL_TIMEOUT_S sets the limit)",
                    self.timeout.as_secs_f64()
                );
                Err(self.fail(st, op, why))
            }
            Err(e) => Err(self.fail(st, op, format!("the device failed while {what} was in flight: {e}"))),
        }
    }

    /// Records the completion event after everything enqueued so far (unless capturing or
    /// inside a group) and starts the pending clock if it is not running.
    pub(super) fn record(&self, st: &mut State, op: &'static str) -> Result<()> {
        if st.in_group == 0 && !self.dev.inner().capturing.load(Ordering::Relaxed) {
            self.event.record(&self.dev.inner().stream).map_err(derr("cuEventRecord"))?;
            st.pending.get_or_insert((op, Instant::now()));
        }
        Ok(())
    }

    /// Enqueues one NCCL call (`f` gets the communicator and the compute stream), then
    /// [`Nccl::finish`]es it.
    pub(super) fn call(&self, op: &'static str, f: impl FnOnce(&Api, Comm, Stream) -> Res) -> Result<()> {
        let st = self.state();
        self.live(op, &st)?;
        self.dev.bind()?;
        let r = f(self.api, st.comm, self.dev.cu_stream() as Stream);
        self.finish(st, op, r)
    }

    /// After a call returned `r`: waits while NCCL reports the launch in progress (bounded; the
    /// lock is held, so the watchdog waits too), fails the group on an error other than a bad
    /// argument, records the event.
    pub(super) fn finish(&self, mut st: MutexGuard<'_, State>, op: &'static str, r: Res) -> Result<()> {
        let r = if r == IN_PROGRESS { poll(self.api, st.comm, self.timeout, &self.abort_asked).map_or_else(|e| e.unwrap_or(IN_PROGRESS), |_| 0) } else { r };
        self.honor(&mut st);
        if let Some(e) = self.failed_err(op, &st) {
            return Err(e);
        }
        if r == IN_PROGRESS {
            let why = format!("{op} was still being launched after {:.0} s (peers missing; K3_NCCL_TIMEOUT_S sets the limit)", self.timeout.as_secs_f64());
            return Err(self.fail(&mut st, op, why));
        }
        if r != 0 {
            let msg = format!("rank {} of {}: {}", self.rank, self.world, err_string(self.api, r, st.comm));
            if r != 4 && r != 5 {
                // Not ncclInvalidArgument/ncclInvalidUsage: the communicator may be broken.
                self.fail(&mut st, op, format!("{op} failed: {msg}"));
            }
            return Err(CoreError::Comm { op, msg });
        }
        self.record(&mut st, op)
    }
}

/// Every 50 ms: NCCL's asynchronous error, and the pending verb against the timeout.
pub(super) fn watchdog(n: Arc<Nccl>) {
    while !n.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        let mut st = n.state();
        if st.failed.is_none() {
            let _ = n.check(&mut st, "watchdog");
        }
    }
}
