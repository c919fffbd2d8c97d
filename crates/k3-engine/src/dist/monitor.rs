//! The leader's step monitor (`docs/parallel.md`, "A rank that dies"): ONE thread per
//! [`super::process::ProcessRunner`], started with it and joined when it drops, that watches
//! the workers' control links while rank 0 is inside a step and sleeps on a condition variable
//! between steps (no thread is spawned per step).
//!
//! While armed ([`Monitor::watch`]) it polls `probe` (a peek at every worker's link,
//! `Control::dead_worker`) every 10 ms. A worker that died or aborted mid-step aborts rank 0's
//! collectives (`abort`, on a thread of its own: the abort may itself be what never returns),
//! so rank 0 stops waiting in them and the gather that follows names that worker — instead of
//! waiting out the collective's timeout (a killed rank's peers in NCCL over sockets may not see
//! it at all). If the step has still not ended `grace` after the abort, this process cannot get
//! its GPU back (on one H200 with NCCL over sockets, `ncclCommAbort` was seen to spin for good
//! once a peer was SIGKILLed mid-launch), so it says why on stderr and exits with status 70 —
//! what PyTorch's NCCL watchdog does too — rather than hang its clients.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::runner::Aborter;

/// A dead worker's rank and why (what `Control::dead_worker` returns).
pub type Probe = Box<dyn Fn() -> Option<(usize, String)> + Send>;

const POLL: Duration = Duration::from_millis(10);

/// The exit status when a step cannot be stopped after a peer died.
pub const EXIT_STUCK: i32 = 70;

#[derive(Default)]
struct Arm {
    /// Bumped by every [`Monitor::watch`]: a detection belongs to one step.
    step: u64,
    armed: bool,
    stop: bool,
}

#[derive(Default)]
struct Inner {
    arm: Mutex<Arm>,
    wake: Condvar,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Arm> {
        self.arm.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Whether step `step` is still running.
    fn running(&self, step: u64) -> bool {
        let a = self.lock();
        a.armed && a.step == step && !a.stop
    }
}

/// See the module doc.
pub struct Monitor {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Starts the monitor thread (idle until the first [`Monitor::watch`]).
    pub fn start(probe: Probe, abort: Aborter, grace: Duration) -> Monitor {
        let inner = Arc::new(Inner::default());
        let i = inner.clone();
        let thread = std::thread::Builder::new().name("k3-monitor".into()).spawn(move || watch_loop(&i, probe, abort, grace)).ok();
        Monitor { inner, thread }
    }

    /// Runs rank 0's part of a step (`f`) with the monitor armed.
    pub fn watch<T>(&self, f: impl FnOnce() -> T) -> T {
        {
            let mut a = self.inner.lock();
            a.step += 1;
            a.armed = true;
        }
        self.inner.wake.notify_all();
        // Disarmed on the way out, a panic in `f` included.
        struct Disarm<'a>(&'a Inner);
        impl Drop for Disarm<'_> {
            fn drop(&mut self) {
                self.0.lock().armed = false;
            }
        }
        let _d = Disarm(&self.inner);
        f()
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.inner.lock().stop = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch_loop(inner: &Inner, probe: Probe, abort: Aborter, grace: Duration) {
    loop {
        let step = {
            let mut a = inner.lock();
            while !a.armed && !a.stop {
                a = inner.wake.wait(a).unwrap_or_else(|p| p.into_inner());
            }
            if a.stop {
                return;
            }
            a.step
        };
        while inner.running(step) {
            if let Some((rank, why)) = probe() {
                stop_step(inner, step, &abort, grace, &format!("rank {rank} failed: {why}"));
                break;
            }
            std::thread::sleep(POLL);
        }
        // Wait for the next step (a step that is still armed here is skipped, not re-watched
        // in a spin: its detection is done).
        let mut a = inner.lock();
        while a.armed && a.step == step && !a.stop {
            a = inner.wake.wait_timeout(a, POLL).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// Aborts rank 0's collectives for `why`, then gives the step `grace` to end before exiting.
fn stop_step(inner: &Inner, step: u64, abort: &Aborter, grace: Duration, why: &str) {
    k3_core::trace(|| format!("rank 0: mid-step: {why}: aborting rank 0's collectives"));
    let (a, msg) = (abort.clone(), why.to_string());
    let _ = std::thread::Builder::new().name("k3-abort".into()).spawn(move || a(&msg));
    let t0 = Instant::now();
    while inner.running(step) {
        if t0.elapsed() > grace {
            eprintln!(
                "k3: {why}; rank 0 is still inside the step {:.0} s after aborting its collectives, so the GPU work waiting on that rank cannot be stopped: exiting (status {EXIT_STUCK})",
                grace.as_secs_f64()
            );
            std::process::exit(EXIT_STUCK);
        }
        std::thread::sleep(POLL);
    }
}

/// How long the monitor waits for rank 0's step to end after aborting it: 10 s, or
/// `K3_ABORT_GRACE_S`.
pub fn abort_grace() -> Duration {
    let s = std::env::var("K3_ABORT_GRACE_S").ok().and_then(|v| v.parse::<f64>().ok()).filter(|s| *s > 0.0).unwrap_or(10.0);
    Duration::from_secs_f64(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The probe runs only while a step is armed; a detection aborts that step once.
    #[test]
    fn probes_only_inside_steps_and_aborts_once() {
        let probes = Arc::new(AtomicUsize::new(0));
        let dead = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let aborts = Arc::new(Mutex::new(Vec::<String>::new()));
        let (p, d, ab) = (probes.clone(), dead.clone(), aborts.clone());
        let m = Monitor::start(
            Box::new(move || {
                p.fetch_add(1, Ordering::SeqCst);
                d.load(Ordering::SeqCst).then(|| (3, "its link closed".to_string()))
            }),
            Arc::new(move |why: &str| ab.lock().unwrap().push(why.to_string())),
            Duration::from_secs(30),
        );
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(probes.load(Ordering::SeqCst), 0, "no probe between steps");
        m.watch(|| std::thread::sleep(Duration::from_millis(60)));
        let n = probes.load(Ordering::SeqCst);
        assert!(n >= 1, "probed during the step");
        std::thread::sleep(Duration::from_millis(60));
        assert!(probes.load(Ordering::SeqCst) <= n + 1, "stopped probing after the step");
        dead.store(true, Ordering::SeqCst);
        m.watch(|| {
            let t0 = Instant::now();
            while aborts.lock().unwrap().is_empty() && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(*aborts.lock().unwrap(), vec!["rank 3 failed: its link closed".to_string()]);
        drop(m); // joins the thread
    }
}
