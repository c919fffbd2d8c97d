//! Failing a test that hangs instead of waiting for it — shared by the tests that drive threads
//! or processes which might deadlock (each includes it with
//! `#[path = ".../tests/support/timeout.rs"] mod timeout;`).
#![allow(dead_code)]

use std::sync::mpsc;
use std::time::Duration;

/// Runs `f` on a thread and fails the test if it takes longer than `secs` (a hang).
pub fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).unwrap_or_else(|_| panic!("{what}: no answer within {secs} s (a hang, or the thread panicked)"))
}
