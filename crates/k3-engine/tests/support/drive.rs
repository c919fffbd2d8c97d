//! Driving an engine to the end, the draft-model tests share it (`mtp.rs`, `draft.rs`): requests
//! added and cancelled at given steps, every event's (token, log-probability bits) and the
//! stats per request, and every sequence state freed at the end (draft states too).
#![allow(dead_code)]

use std::sync::Arc;

use k3_engine::{Engine, EngineConfig, Event, Request, SeqStats};
use k3_model::Model;

/// (token, log-probability bits) of each event of one request.
pub type Out = Vec<(u32, u32)>;

/// Steps `e` to the end, adding `reqs[i]` before step `at[i]` and cancelling the `i`-th request
/// before step `cancel[i]` (if any); per request, its events and its stats (`None`: cancelled).
pub fn drive(e: &mut Engine, reqs: &[Request], at: &[usize], cancel: &[Option<usize>]) -> (Vec<Out>, Vec<Option<SeqStats>>) {
    let mut ids = vec![None; reqs.len()];
    let mut outs = vec![Out::new(); reqs.len()];
    let mut stats = vec![None; reqs.len()];
    let mut step = 0;
    while step == 0 || e.has_work() || ids.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate() {
            if at[i] == step {
                ids[i] = Some(e.add(r.clone()).unwrap());
            }
            if cancel[i] == Some(step) {
                assert!(e.cancel(ids[i].unwrap()));
            }
        }
        let evs: Vec<Event> = e.step().unwrap();
        for ev in evs {
            let i = ids.iter().position(|&x| x == Some(ev.seq)).unwrap();
            outs[i].push((ev.token, ev.sampled.logprob.to_bits()));
        }
        for (id, st) in e.take_finished_stats() {
            stats[ids.iter().position(|&x| x == Some(id)).unwrap()] = Some(st);
        }
        step += 1;
        assert!(step < 1000);
    }
    assert_eq!(e.state_bytes(), 0, "every sequence's state (the draft model's included) is freed");
    (outs, stats)
}

/// `r` decoded plainly, alone.
pub fn plain_solo(m: &Arc<Model>, r: &Request) -> Out {
    let mut e = Engine::new(m.clone(), None, EngineConfig::default());
    drive(&mut e, std::slice::from_ref(r), &[0], &[None]).0.remove(0)
}

/// Greedy `reqs` (admitted at steps 0, 1, 3) on engines of `m` configured by `cfg(k)` for
/// k = 1..4 (`max_batch` 3), each request's events equal to `solo`'s (decoded plainly alone);
/// the drafted and accepted tokens summed over every k.
pub fn greedy_sweep(m: &Arc<Model>, reqs: &[Request], solo: &[Out], cfg: impl Fn(usize) -> EngineConfig) -> (u64, u64) {
    let (mut drafted, mut accepted) = (0, 0);
    for k in 1..=4 {
        let mut e = Engine::new(m.clone(), None, EngineConfig { max_batch: 3, ..cfg(k) });
        assert_eq!(e.speculating(), Ok(true));
        let (outs, stats) = drive(&mut e, reqs, &[0, 1, 3], &[None; 3]);
        for (i, (o, s)) in outs.iter().zip(solo).enumerate() {
            assert_eq!(o, s, "k={k}: request {i}: tokens or log-probabilities differ from plain decoding");
        }
        for s in stats.iter().flatten() {
            assert!(s.spec.per_position.len() <= k);
            drafted += s.spec.drafted;
            accepted += s.spec.accepted;
        }
    }
    (drafted, accepted)
}
