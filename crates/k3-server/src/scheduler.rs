//! The scheduler thread: the one OS thread that owns the [`Backend`] (the model is CPU-bound
//! and parallel inside, so it must not run on the async runtime).
//!
//! Loop: block for a command while idle, otherwise drain the command channel (new requests,
//! cancellations); cancel every sequence whose client went away (its event receiver is dropped);
//! run one batched [`Backend::step`]; route each [`Event`] to its request's channel; update the
//! gauges and latency histograms. A failing or panicking step fails the sequences of that batch
//! only (they are cancelled and told so); the thread keeps serving. Requests join and leave the
//! running batch at token boundaries because every step re-reads the command channel.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as stdmpsc;
use std::sync::Arc;
use std::time::Instant;

use k3_engine::{Event, Request, SeqId};
use tokio::sync::{mpsc, oneshot};

use crate::backend::Backend;
use crate::error::{Result, ServerError};
use crate::metrics::Metrics;

/// What a request's handler receives.
#[derive(Debug)]
pub enum Msg {
    Token(Event),
    /// The engine failed for this sequence; no more messages follow.
    Failed(String),
}

/// Work done on the engine thread just before a request is added, with the backend at hand
/// (e.g. building `prompt_embeds` from the token embeddings and spliced image features).
pub type Prep = Box<dyn FnOnce(&dyn Backend, &mut Request) -> Result<()> + Send>;

enum Cmd {
    Add { req: Request, prep: Option<Prep>, tx: mpsc::UnboundedSender<Msg>, reply: oneshot::Sender<Result<SeqId>> },
    Cancel(SeqId),
}

struct Live {
    tx: mpsc::UnboundedSender<Msg>,
    admitted: Instant,
    last: Option<Instant>,
}

/// The handlers' side of the scheduler: cheap to clone.
#[derive(Clone)]
pub struct SchedulerHandle {
    cmd: stdmpsc::Sender<Cmd>,
    pub metrics: Arc<Metrics>,
    /// running + queued requests allowed before answering 429.
    pub capacity: usize,
}

/// A request handed to the engine thread, its acceptance not yet seen. Dropping it cancels the
/// sequence once added (the engine finds its answer and event receivers gone).
pub struct Pending {
    rx: mpsc::UnboundedReceiver<Msg>,
    answer: oneshot::Receiver<Result<SeqId>>,
}

impl Pending {
    /// Waits for the engine to add the request (its validation errors come back here).
    pub async fn accepted(self) -> Result<Submitted> {
        match self.answer.await {
            Ok(Ok(id)) => Ok(Submitted { id, rx: self.rx }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ServerError::Unavailable("the scheduler thread has stopped".into())),
        }
    }
}

/// A submitted request: its id and its event stream. Dropping it cancels the sequence.
pub struct Submitted {
    pub id: SeqId,
    pub rx: mpsc::UnboundedReceiver<Msg>,
}

impl SchedulerHandle {
    /// Starts the scheduler thread around `backend`.
    pub fn spawn(backend: Box<dyn Backend>, metrics: Arc<Metrics>, capacity: usize) -> Result<SchedulerHandle> {
        let (tx, rx) = stdmpsc::channel();
        let m = metrics.clone();
        std::thread::Builder::new()
            .name("k3-scheduler".into())
            .spawn(move || run(backend, rx, m))
            .map_err(|e| ServerError::Io { what: "spawning the scheduler thread".into(), source: e })?;
        Ok(SchedulerHandle { cmd: tx, metrics, capacity })
    }

    /// Admits a request unless the queue is full (429), then waits for the engine to accept it
    /// (validation errors come back here).
    pub async fn submit(&self, req: Request) -> Result<Submitted> {
        self.submit_with(req, None).await
    }

    /// 429 now if the queue is full (a cheap check before expensive request preparation).
    pub fn check_capacity(&self) -> Result<()> {
        let n = self.metrics.live.load(Relaxed);
        if n >= self.capacity {
            return Err(ServerError::Busy { live: n, retry_after: 1 });
        }
        Ok(())
    }

    /// [`Self::submit`], running `prep` on the engine thread before the request is added.
    pub async fn submit_with(&self, req: Request, prep: Option<Prep>) -> Result<Submitted> {
        self.send_with(req, prep)?.accepted().await
    }

    /// Admits a request against the queue (429 when full) and hands it to the engine thread
    /// without waiting; [`Pending::accepted`] waits for the engine's answer. Requests sent one
    /// after another are added (and their `prep`s run) in that order.
    pub fn send_with(&self, req: Request, prep: Option<Prep>) -> Result<Pending> {
        let cap = self.capacity;
        let admitted = self.metrics.live.fetch_update(Relaxed, Relaxed, |n| (n < cap).then_some(n + 1));
        if let Err(n) = admitted {
            return Err(ServerError::Busy { live: n, retry_after: 1 });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        if self.cmd.send(Cmd::Add { req, prep, tx, reply }).is_err() {
            self.metrics.live.fetch_sub(1, Relaxed);
            return Err(ServerError::Unavailable("the scheduler thread has stopped".into()));
        }
        Ok(Pending { rx, answer })
    }

    /// Cancels a sequence now (e.g. a stop string matched on the server side).
    pub fn cancel(&self, id: SeqId) {
        let _ = self.cmd.send(Cmd::Cancel(id));
    }
}

fn run(mut backend: Box<dyn Backend>, rx: stdmpsc::Receiver<Cmd>, metrics: Arc<Metrics>) {
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    loop {
        // Commands: block while idle, else drain without waiting.
        if live.is_empty() {
            match rx.recv() {
                Ok(cmd) => handle(cmd, &mut *backend, &mut live, &metrics),
                Err(_) => return, // every handle dropped: shut down
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(cmd, &mut *backend, &mut live, &metrics);
        }
        // Clients that went away: cancel their sequences at once.
        let gone: Vec<SeqId> = live.iter().filter(|(_, l)| l.tx.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            drop_seq(id, &mut *backend, &mut live, &metrics, true);
        }
        if !live.is_empty() {
            let r = catch_unwind(AssertUnwindSafe(|| backend.step()));
            metrics.steps.fetch_add(1, Relaxed);
            match r {
                Ok(Ok(events)) => route(events, &mut *backend, &mut live, &metrics),
                Ok(Err(e)) => fail_all(&e.to_string(), &mut *backend, &mut live, &metrics),
                Err(p) => {
                    let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                    fail_all(&format!("the engine panicked: {}", msg.unwrap_or_default()), &mut *backend, &mut live, &metrics)
                }
            }
        }
        metrics.running.store(backend.num_running(), Relaxed);
        metrics.waiting.store(backend.num_waiting(), Relaxed);
        metrics.state_bytes.store(backend.state_bytes(), Relaxed);
        if let Ok(mut s) = metrics.spec.lock() {
            *s = backend.spec_stats();
        }
        if let (Some(p), Ok(mut m)) = (backend.prefix_stats(), metrics.prefix.lock()) {
            *m = Some(p);
        }
        if let (Some(c), Ok(mut m)) = (backend.expert_cache_stats(), metrics.experts.lock()) {
            *m = Some(c);
        }
    }
}

fn handle(cmd: Cmd, backend: &mut dyn Backend, live: &mut HashMap<SeqId, Live>, metrics: &Metrics) {
    match cmd {
        Cmd::Add { mut req, prep, tx, reply } => {
            let prompt_len = req.prompt.len() as u64;
            let r = catch_unwind(AssertUnwindSafe(|| {
                if let Some(prep) = prep {
                    prep(&*backend, &mut req)?;
                }
                backend.add(req).map_err(ServerError::from)
            }));
            let r = match r {
                Ok(r) => r,
                Err(_) => Err(ServerError::Internal("the engine panicked while admitting the request".into())),
            };
            match r {
                Ok(id) => {
                    metrics.prompt_tokens.fetch_add(prompt_len, Relaxed);
                    live.insert(id, Live { tx, admitted: Instant::now(), last: None });
                    if reply.send(Ok(id)).is_err() {
                        drop_seq(id, backend, live, metrics, true);
                    }
                }
                Err(e) => {
                    metrics.live.fetch_sub(1, Relaxed);
                    let _ = reply.send(Err(e));
                }
            }
        }
        Cmd::Cancel(id) => {
            if live.contains_key(&id) {
                drop_seq(id, backend, live, metrics, true);
            }
        }
    }
}

/// Removes a live sequence from the backend and the table.
fn drop_seq(id: SeqId, backend: &mut dyn Backend, live: &mut HashMap<SeqId, Live>, metrics: &Metrics, cancel: bool) {
    if live.remove(&id).is_some() {
        metrics.live.fetch_sub(1, Relaxed);
        if cancel {
            let _ = catch_unwind(AssertUnwindSafe(|| backend.cancel(id)));
            metrics.cancelled.fetch_add(1, Relaxed);
        }
    }
}

fn route(events: Vec<Event>, backend: &mut dyn Backend, live: &mut HashMap<SeqId, Live>, metrics: &Metrics) {
    let now = Instant::now();
    for ev in events {
        let id = ev.seq;
        let finished = ev.finish.is_some();
        let Some(l) = live.get_mut(&id) else {
            continue;
        };
        metrics.generation_tokens.fetch_add(1, Relaxed);
        match l.last {
            None => metrics.ttft.observe(now - l.admitted),
            Some(t) => metrics.itl.observe(now - t),
        }
        l.last = Some(now);
        if let Some(e) = &ev.error {
            // The output constraint failed: the engine ended the sequence; the request fails.
            let _ = l.tx.send(Msg::Failed(format!("output constraint: {e}")));
            drop_seq(id, backend, live, metrics, false);
            continue;
        }
        let sent = l.tx.send(Msg::Token(ev)).is_ok();
        if finished {
            drop_seq(id, backend, live, metrics, false);
        } else if !sent {
            drop_seq(id, backend, live, metrics, true);
        }
    }
}

fn fail_all(msg: &str, backend: &mut dyn Backend, live: &mut HashMap<SeqId, Live>, metrics: &Metrics) {
    let ids: Vec<SeqId> = live.keys().copied().collect();
    for id in ids {
        if let Some(l) = live.get(&id) {
            let _ = l.tx.send(Msg::Failed(msg.to_owned()));
        }
        drop_seq(id, backend, live, metrics, true);
    }
}
