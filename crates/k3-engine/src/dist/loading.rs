//! A world's loading, as `k3 run` / `k3 serve` show it (`dist::process`, one process per GPU):
//! each worker's progress frames and "loaded" reply over the control plane, and rank 0's one
//! bar over the bytes every rank loads, so a rank that cannot load is reported by rank before
//! anything is served.

use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k3_core::comm::control::Control;
use k3_model::Checkpoint;

use super::runner::{panic_message, Answer, Failure, Reply};
use super::step::{decode_reply, encode_reply};
use crate::error::{EngineError, Result};

/// A worker's loading progress for rank 0's world bar: `2 | u64 bytes read so far`.
pub fn encode_progress(bytes: u64) -> Vec<u8> {
    [&[2u8][..], &bytes.to_le_bytes()].concat()
}

/// The bytes of an [`encode_progress`] frame; `None` for any other frame.
pub fn decode_progress(b: &[u8]) -> Option<u64> {
    match b.split_first() {
        Some((2, rest)) => rest.try_into().ok().map(u64::from_le_bytes),
        _ => None,
    }
}

/// A worker's "loaded" reply for [`ProcessRunner::wait_ready`](super::process::ProcessRunner::wait_ready): `Ok` once its shards are in,
/// its failure otherwise (and that failure is returned).
pub fn worker_ready<T>(c: &Control, loaded: Result<T>) -> Result<T> {
    let reply = match &loaded {
        Ok(_) => Ok(Answer::bytes(0)),
        Err(e) => Err(Failure { rank: c.rank(), msg: e.to_string(), aborted: false }),
    };
    let sent = c.send_to_leader(&encode_reply(&reply)).map_err(|e| EngineError::Launch(format!("telling rank 0 this rank is loaded: {e}")));
    let v = loaded?;
    sent?;
    Ok(v)
}

/// How often a loading worker reports its bytes to rank 0 (and the last count always).
const PROGRESS_EVERY: Duration = Duration::from_millis(250);

/// A worker's loading: `load` gets a reporter of the bytes read so far, which goes to rank 0
/// as progress frames (at most every 250 ms, and the last count before the reply); then the
/// "loaded" reply ([`worker_ready`]). Frames keep the link busy, so a long load is not taken
/// for a silent peer.
pub fn worker_load<T>(c: &Control, load: impl FnOnce(&k3_model::source::LoadReport<'_>) -> Result<T>) -> Result<T> {
    let state = Mutex::new((None::<Instant>, 0u64, 0u64)); // last sent, bytes so far, bytes sent
    let report = |bytes: u64| {
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        st.1 = bytes;
        if st.0.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY) {
            st.0 = Some(Instant::now());
            st.2 = bytes;
            let _ = c.send_to_leader(&encode_progress(bytes)); // a dead link fails the reply below
        }
    };
    let loaded = load(&report);
    let (_, now, sent) = *state.lock().unwrap_or_else(|p| p.into_inner());
    if now != sent {
        let _ = c.send_to_leader(&encode_progress(now));
    }
    worker_ready(c, loaded)
}

/// Rank 0's loading beside its workers': `load` runs here (with a reporter of rank 0's bytes)
/// while one thread per worker reads that worker's progress frames until its "loaded" reply;
/// `bar` (the world's bytes) shows the sum. Returns `load`'s result and each worker's reply
/// (rank `i + 1` at `i`), for [`ProcessRunner::take_ready`](super::process::ProcessRunner::take_ready); the caller ends the bar. When
/// `load` fails the control plane is aborted, so no thread waits on a worker.
pub fn load_with_world_bar<T>(
    c: &Control,
    bar: &indicatif::ProgressBar,
    load: impl FnOnce(&k3_model::source::LoadReport<'_>) -> Result<T>,
) -> (Result<T>, Vec<Reply>) {
    let world = c.world();
    let done: Vec<std::sync::atomic::AtomicU64> = (0..world).map(|_| Default::default()).collect();
    let show = |rank: usize, bytes: u64| {
        done[rank].store(bytes, Ordering::Relaxed);
        bar.set_position(done.iter().map(|d| d.load(Ordering::Relaxed)).sum());
    };
    std::thread::scope(|s| {
        let watchers: Vec<_> = (1..world)
            .map(|rank| {
                let show = &show;
                s.spawn(move || loop {
                    match c.recv_from(rank) {
                        Ok(b) => match decode_progress(&b) {
                            Some(bytes) => show(rank, bytes),
                            None => return decode_reply(&b, rank),
                        },
                        Err(e) => return Err(Failure { rank, msg: format!("no answer from its process while loading: {e}"), aborted: false }),
                    }
                })
            })
            .collect();
        let own = |bytes: u64| show(0, bytes);
        let loaded = load(&own);
        if let Err(e) = &loaded {
            c.abort(&format!("rank 0 failed: {e}"));
        }
        let replies = watchers
            .into_iter()
            .enumerate()
            .map(|(i, w)| {
                w.join().unwrap_or_else(|p| {
                    Err(Failure { rank: i + 1, msg: format!("its loading watcher panicked: {}", panic_message(p.as_ref())), aborted: false })
                })
            })
            .collect();
        (loaded, replies)
    })
}

/// Rank 0's bar over the bytes every rank of `par` loads (drawn when stderr is a terminal).
pub fn world_bar(ck: &Checkpoint, par: k3_model::Parallel, ordinal: usize) -> Result<indicatif::ProgressBar> {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return Ok(indicatif::ProgressBar::hidden());
    }
    let total: u64 = par.plans(&ck.config)?.into_iter().map(|p| k3_model::Source::new(ck, p).held_bytes()).sum();
    let style = indicatif::ProgressStyle::with_template("{msg} {bar:30} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    let what = format!("uploading {} ranks' weights (GPU {ordinal}.. on each node)", par.world());
    Ok(indicatif::ProgressBar::new(total).with_style(style).with_message(what))
}
