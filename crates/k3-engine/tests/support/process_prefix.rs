//! The prefix cache over the control plane (issue 21, `dist::kept`): warm = cold on rank 0 and
//! the worker's logits = rank 0's at every step, evictions forgotten on both ranks, the
//! worker's mutant caught, a failed resume and a receipt mismatch stopping the world (see the
//! parent file's doc).

use super::*;

const GRID: usize = 16;

/// One request at a time (the script runs them so): the worker then has one state slot, and a
/// state released on rank 0 but not dropped on the worker before a resume fails its resume.
fn prefix_cfg(mem: usize) -> EngineConfig {
    EngineConfig { max_batch: 1, max_step_tokens: 1024, prefix: Some(PrefixConfig::new(GRID, mem)), ..Default::default() }
}

/// `prompt` alone on a fresh one-rank engine with the cache on (cut on the grid as the warm one).
fn cold(m: &Arc<Model>, prompt: &[u32]) -> prefix_run::Out {
    let log = recorder::Log::default();
    let r = recorder::Rec::new(ThreadRunner::single(m.clone(), StateDType::F32), &log);
    let mut e = Engine::with_runner(Box::new(r), None, prefix_cfg(1 << 30));
    prefix_run::run(&mut e, &log, &[prompt.to_vec()], 4, &[]).pop().unwrap().unwrap()
}

/// The prefix-cache script over the control plane (see the module doc): per request
/// (warm out, cold out); whether the worker's logits and state bytes equalled rank 0's at every
/// step; the cache's counters; the worker loop's outcome.
#[allow(clippy::type_complexity)]
fn prefix_script(m: Arc<Model>, spoil: Spoil, mem: usize) -> (Vec<(prefix_run::Out, prefix_run::Out)>, bool, k3_engine::PrefixStats, k3_engine::Result<()>) {
    within(120, "the prefix cache over the control plane", move || {
        let v = m.config.text.vocab_size as u32;
        let rows = recorder::Log::default();
        let mut w = world_with(&m, None, None, prefix_cfg(mem), Some((&rows, spoil)));
        assert!(w.engine.prefix_status().unwrap().is_some(), "the prefix cache is on over the process runner");
        let a = prefix_run::prompt_ids(v, 1, 2 * GRID + 10); // snapshot at 32, its last grid point
        let mut prompts = vec![a.clone()];
        for d in [0, 1, 7] {
            let mut b = a[..2 * GRID + d].to_vec();
            b.extend(prefix_run::prompt_ids(v, 100 + d as u32, 5));
            prompts.push(b); // resumes at 32: at the grid point, 1 and 7 past it
        }
        let mut before = a[..2 * GRID - 1].to_vec();
        before.extend(prefix_run::prompt_ids(v, 7, 12)); // branch at 16, snapshotted there
        prompts.push(before);
        let mut again = a[..GRID + 9].to_vec();
        again.extend(prefix_run::prompt_ids(v, 8, 4)); // resumes at the branch point
        prompts.push(again);
        let outs =
            prompts.iter().map(|p| (prefix_run::run_held(&mut w.engine, &rows, std::slice::from_ref(p), 4).pop().unwrap().unwrap(), cold(&m, p))).collect();
        let stats = w.engine.prefix_status().unwrap().unwrap();
        drop(w.engine);
        w.finish.wait(Duration::from_secs(10)).unwrap();
        let worker = w.worker.recv_timeout(Duration::from_secs(10)).expect("the worker's loop ends");
        let (l, wl) = (w.leader_log.lock().unwrap(), w.worker_log.lock().unwrap());
        assert_eq!(l.len(), wl.len(), "the worker applied every step");
        let same = l.iter().zip(wl.iter()).all(|(a, b)| a.0 == b.0 && a.1 == b.1);
        (outs, same, stats, worker)
    })
}

#[test]
fn the_prefix_cache_runs_over_the_control_plane() {
    let m = model();
    let (outs, same, stats, worker) = prefix_script(m.clone(), Spoil::None, 1 << 30);
    worker.expect("the worker's loop ends Ok");
    let want = [0, 2 * GRID, 2 * GRID, 2 * GRID, 0, GRID];
    for (i, ((warm, cold), cached)) in outs.iter().zip(want).enumerate() {
        assert_eq!(warm.cached, cached, "request {i}: cached tokens");
        assert_eq!(warm.tokens, cold.tokens, "request {i}: greedy tokens");
        assert!(warm.rows == cold.rows, "request {i}: rank 0's logits rows are not bit-equal to a cold start");
    }
    assert!(stats.hits == 4 && stats.kv_only_matches >= 1, "{stats:?}");
    assert!(same, "the worker, resumed from its own kept parts, computed other logits or held other states than rank 0");

    // A pool too small to keep anything: every cell and snapshot is forgotten on both ranks
    // (rank 0 checks the worker's count at each forget), and nothing is hit.
    let (outs, same, stats, worker) = prefix_script(m.clone(), Spoil::None, 1);
    worker.expect("the worker's loop ends Ok");
    assert!(outs.iter().all(|(w, c)| w.cached == 0 && w.rows == c.rows), "a cold start every time");
    assert!(stats.evictions > 0 && stats.hits == 0 && stats.pool_snapshots == 0, "{stats:?}");
    assert!(same);

    // The mutant: the worker's kept snapshot perturbed when it resumes. Rank 0's own part is
    // intact (its tokens still equal a cold start's), but the worker's logits must differ.
    let (outs, same, _, worker) = prefix_script(m.clone(), Spoil::Snapshot, 1 << 30);
    worker.expect("the worker's loop ends Ok");
    assert!(outs.iter().all(|(w, c)| w.rows == c.rows));
    assert!(!same, "a corrupted kept part went unseen: the comparison cannot fail");

    // A worker that fails a resume: the request fails naming rank 1, the world stops.
    let (err, worker) = within(60, "a worker failing a resume", move || {
        let rows = recorder::Log::default();
        let mut w = world_with(&m, None, None, prefix_cfg(1 << 30), Some((&rows, Spoil::Refuse)));
        let a = prefix_run::prompt_ids(m.config.text.vocab_size as u32, 1, 2 * GRID + 10);
        prefix_run::run_held(&mut w.engine, &rows, std::slice::from_ref(&a), 2);
        let err = w.engine.generate(Request::new(a, SamplingParams::greedy(), 2), |_| {}).unwrap_err().to_string();
        assert!(w.finish.failed(), "the world reports the failure");
        drop(w.engine);
        (err, w.worker.recv_timeout(Duration::from_secs(10)).expect("the worker's loop ends"))
    });
    assert!(err.contains("rank 1 failed") && err.contains("injected resume fault"), "{err}");
    assert!(worker.unwrap_err().to_string().contains("injected resume fault"));
}

/// A worker whose kept part differs from rank 0's (its capture has no KDA snapshot): rank 0's
/// receipt check stops the world at that keep, naming rank 1 and what differs, before its
/// cache holds a state the worker cannot resume; every later request fails at once with it.
#[test]
fn a_kept_part_unlike_rank_0s_stops_the_world_at_its_receipt() {
    let m = model();
    let (err, again, worker) = within(60, "a receipt that differs", move || {
        let rows = recorder::Log::default();
        let mut w = world_with(&m, None, None, prefix_cfg(1 << 30), Some((&rows, Spoil::Receipt)));
        let a = prefix_run::prompt_ids(m.config.text.vocab_size as u32, 1, 2 * GRID + 10);
        let err = w.engine.generate(Request::new(a.clone(), SamplingParams::greedy(), 2), |_| {}).unwrap_err().to_string();
        assert!(w.finish.failed(), "the world reports the failure");
        let again = w.engine.generate(Request::new(a, SamplingParams::greedy(), 2), |_| {}).unwrap_err().to_string();
        drop(w.engine);
        (err, again, w.worker.recv_timeout(Duration::from_secs(10)).expect("the worker's loop ends"))
    });
    assert!(err.contains("rank 1 failed") && err.contains("kept (from, to, cells, snapshot)") && err.contains("false"), "{err}");
    assert!(again.contains("kept (from, to, cells, snapshot)") && again.contains("restart it"), "{again}");
    assert!(worker.is_err(), "the worker's loop ends with the world's failure");
}
