//! OpenAI's `n`: several completions of one prompt, as `choices[0..n]` of one answer.
//!
//! A request with `n > 1` becomes `n` engine sequences submitted one after another
//! ([`submit_n`]), each with the request's sampling parameters and, when the request gives a
//! `seed`, the seed `seed + i` for choice `i` (vLLM's convention), so that choice `i` of an
//! `n`-request is the answer of a single request with that seed. The prompt is prefilled once
//! when the engine's prefix cache is on (sequences that arrive together wait for the one
//! prefilling the shared prompt and resume from it); image features are encoded once and the
//! input rows built on the engine thread for choice 0 are shared by the others. Usage counts
//! the prompt once, the completion tokens of every choice, and as `cached_tokens` the fewest any
//! choice restored. The handlers read the choices concurrently ([`next_event`] for streams), and
//! dropping a [`Submitted`] cancels its sequence, so a failed choice or a client gone cancels
//! them all.

use std::sync::{Arc, Mutex};

use futures_util::future::select_all;
use k3_engine::Request;

use crate::error::{bad_param, Result, ServerError};
use crate::scheduler::{Msg, Prep, Submitted};
use crate::server::AppState;

/// The most completions one request may ask for.
pub const MAX_N: usize = 16;

/// Reads `n` (default 1): a whole number in `1..=MAX_N` that the server's queue can hold.
pub fn read_n(f: &crate::params::Fields, capacity: usize) -> Result<usize> {
    let Some(n) = f.i64("n")? else { return Ok(1) };
    if n < 1 || n as usize > MAX_N {
        return Err(bad_param("n", format!("{n} is outside 1..={MAX_N}; send separate requests for more completions")));
    }
    let n = n as usize;
    if n > capacity {
        return Err(bad_param(
            "n",
            format!("{n} completions are more than this server runs and queues at once ({capacity}); ask for fewer or raise --max-queue"),
        ));
    }
    Ok(n)
}

/// Submits `n` copies of `req` (choice `i` seeded `seed + i` when the request has a seed, each
/// with a grammar matcher of its own). The rows `prep` builds for choice 0 (images spliced in)
/// are reused by the others. An error (e.g. 429 when the queue fills midway) drops the
/// sequences already submitted, which cancels them.
pub async fn submit_n(s: &AppState, req: Request, prep: Option<Prep>, n: usize) -> Result<Vec<Submitted>> {
    if n == 1 {
        return Ok(vec![s.sched.submit_with(req, prep).await?]);
    }
    let rows: Arc<Mutex<Option<Arc<Vec<f32>>>>> = Arc::new(Mutex::new(None));
    let shares = prep.is_some();
    let mut first = prep;
    let mut pending = Vec::with_capacity(n);
    for i in 0..n {
        let mut r = req.clone();
        r.params.seed = req.params.seed.map(|s| s.wrapping_add(i as u64));
        if i > 0 {
            r.constraint = req.constraint.as_ref().map(|c| c.fork());
        }
        let p: Option<Prep> = if let Some(p) = first.take() {
            // Choice 0 builds the rows (on the engine thread) and keeps them for the others.
            let keep = rows.clone();
            Some(Box::new(move |b, r: &mut Request| {
                p(b, r)?;
                *keep.lock().map_err(|_| poisoned())? = r.prompt_embeds.clone();
                Ok(())
            }))
        } else if shares {
            // Added after choice 0 on the engine thread, so its rows are there.
            let shared = rows.clone();
            Some(Box::new(move |_, r: &mut Request| {
                let rows = shared.lock().map_err(|_| poisoned())?.clone();
                r.prompt_embeds = Some(rows.ok_or_else(|| ServerError::Internal("choice 0's input rows are missing".into()))?);
                Ok(())
            }))
        } else {
            None
        };
        pending.push(s.sched.send_with(r, p)?);
    }
    // All n are on the engine's queue before the first is admitted, so the others wait for its
    // prefill of the shared prompt (with the prefix cache) instead of one step each.
    let mut subs = Vec::with_capacity(n);
    for p in pending {
        subs.push(p.accepted().await?);
    }
    Ok(subs)
}

fn poisoned() -> ServerError {
    ServerError::Internal("the shared input rows of a request's choices: lock poisoned".into())
}

/// The next message of any choice still open (`open[i]`), with its index; `None` for the
/// message when that choice's channel closed. Messages of one choice come in order.
pub async fn next_event(subs: &mut [Submitted], open: &[bool]) -> (usize, Option<Msg>) {
    let futs: Vec<_> = subs.iter_mut().enumerate().filter(|(i, _)| open[*i]).map(|(i, s)| Box::pin(async move { (i, s.rx.recv().await) })).collect();
    if futs.is_empty() {
        // Callers stop once every choice has finished; never wait on nothing.
        return (0, None);
    }
    select_all(futs).await.0
}
