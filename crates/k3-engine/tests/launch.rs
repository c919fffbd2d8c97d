//! The multi-process launcher (`k3_engine::dist::launch`) with real processes on loopback, no
//! GPU: the launcher re-executes the current binary with the same arguments for a node's other
//! ranks, so this test binary plays every rank itself. [`rank_main`] does nothing unless
//! `K3_LAUNCH_TEST` names a scenario; the driver tests start "node" processes as
//! `<this binary> rank_main --exact --nocapture --test-threads=1` with that variable (a node's
//! children inherit both, plus `RANK`, ..., so they take `World::start`'s environment path).
//! Every rank then answers rank 0 over the control plane with its rank, local rank, node and
//! the payload it received; rank 0 checks each answer and prints `K3_LAUNCH_OK`. Covered: one
//! node starting its three local ranks; two "nodes" on one machine forming one node-major world;
//! a torchrun-style world of processes the test starts itself; a digest mismatch refused by
//! rank; a child that exits with an error before the rendezvous (on rank 0's node or on a
//! worker node) or after it, reported by rank within a measured bound; the flag/variable errors that need no process; and the digest
//! changing with the layout. Every process is bounded: the driver kills a node's whole process
//! group when it overruns (and after it ends, for any child it left).
#![cfg(unix)]

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use k3_engine::dist::launch::{world_digest, NodeArgs, World};
use k3_engine::EngineError;
use k3_model::Parallel;

/// The scenario a rank process plays; unset in a plain `cargo test` run.
const SCENARIO: &str = "K3_LAUNCH_TEST";
/// How long any one node process may run before the driver kills its process group.
const NODE_LIMIT: Duration = Duration::from_secs(30);
/// The rendezvous timeout the ranks run under (`K3_RENDEZVOUS_TIMEOUT_S`).
const RENDEZVOUS_S: u64 = 10;

// ---------------------------------------------------------------------------------------------
// The rank side.

/// The entry of every rank process. Does nothing unless `K3_LAUNCH_TEST` is set; then plays
/// that scenario and panics (failing the process) on anything unexpected.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    if let Err(why) = play(&scenario) {
        panic!("K3_LAUNCH_FAIL rank {}: {why}", std::env::var("RANK").unwrap_or_else(|_| "(first of its node)".into()));
    }
}

fn env_num(k: &str) -> Option<usize> {
    std::env::var(k).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{k}={v} is not a number")))
}

/// The rank this process will be when a launcher (or a node's first process) set `RANK`.
fn env_rank() -> Option<usize> {
    env_num("RANK")
}

fn play(scenario: &str) -> Result<(), String> {
    let fault_rank = env_num("K3_LAUNCH_FAULT_RANK");
    let me = env_rank();
    if scenario == "exit_before" && me.is_some() && me == fault_rank {
        std::process::exit(3);
    }
    let par = Parallel::new(env_num("K3_LAUNCH_TP").unwrap_or(1), None, 1).map_err(|e| e.to_string())?;
    let node = NodeArgs {
        nnodes: env_num("K3_LAUNCH_NNODES").unwrap_or(1),
        node_rank: env_num("K3_LAUNCH_NODE_RANK").unwrap_or(0),
        master_addr: std::env::var("K3_LAUNCH_MASTER").ok(),
    };
    let digest = if scenario == "digest" && me.is_some() && me == fault_rank { "digest-of-another-build" } else { "digest-of-this-build" };
    let nonce = format!("payload-of-rank-0-pid-{}", std::process::id());
    let world = World::start(par, &node, digest, |k| std::env::var(k).ok(), || Ok(nonce.clone().into_bytes())).map_err(|e| e.to_string())?;
    let rank = world.rank();
    if let Some(r) = me {
        if r != rank {
            return Err(format!("RANK={r} but the world says rank {rank}"));
        }
    }
    if world.control.world() != par.world() {
        return Err(format!("a world of {} ranks, the layout has {}", world.control.world(), par.world()));
    }
    if !world.payload().starts_with(b"payload-of-rank-0-pid-") {
        return Err(format!("payload {:?} is not rank 0's", String::from_utf8_lossy(world.payload())));
    }
    if scenario == "exit_after" && Some(rank) == fault_rank {
        std::process::exit(3);
    }
    let (tx, failures) = mpsc::channel::<String>();
    world.on_child_failure(move |why| {
        let _ = tx.send(why.to_string());
    });
    let node_rank = env_num("K3_LAUNCH_NODE_RANK").unwrap_or(0);
    let exchange = if world.control.is_leader() { lead(&world, nonce.as_bytes()) } else { work(&world, node_rank) };
    if let Err(e) = &exchange {
        // A rank this process started that died is the likely cause: say so when the watcher
        // saw it (it polls every 100 ms).
        if let Ok(why) = failures.recv_timeout(Duration::from_secs(5)) {
            eprintln!("K3_LAUNCH_CHILD_FAILURE {why}");
        }
        eprintln!("K3_LAUNCH_EXCHANGE_ERROR rank {rank}: {e}");
    }
    let finished = world.finish(Duration::from_secs(10)).map_err(|e| format!("finish: {e}"));
    match (exchange, finished) {
        (Ok(()), Ok(())) => {}
        (Err(e), Ok(())) => return Err(e),
        (Ok(()), Err(f)) => return Err(f),
        (Err(e), Err(f)) => return Err(format!("{e}; {f}")),
    }
    println!("K3_LAUNCH_OK rank={rank} world={}", par.world());
    Ok(())
}

/// One worker's answer: `rank local_rank local_world node payload echo`.
fn answer(world: &World, node_rank: usize, echo: &[u8]) -> String {
    format!(
        "{} {} {} {} {} {}",
        world.rank(),
        world.spec.local_rank,
        world.spec.local_world,
        node_rank,
        String::from_utf8_lossy(world.payload()),
        String::from_utf8_lossy(echo)
    )
}

/// Rank 0: one broadcast, one gather; every rank answers as itself with rank 0's payload, on
/// the node and at the local rank a node-major numbering puts it.
fn lead(world: &World, payload: &[u8]) -> Result<(), String> {
    let c = &world.control;
    if world.payload() != payload {
        return Err("rank 0's own payload is not what its closure returned".into());
    }
    // Node-major: node `rank / per_node`, local rank `rank % per_node` (a torchrun-style world
    // says every process is its own node).
    let per_node = c.world() / env_num("K3_LAUNCH_NNODES").unwrap_or(1);
    let ping = format!("step-1-from-{}", std::process::id());
    c.broadcast(ping.as_bytes()).map_err(|e| e.to_string())?;
    let replies = c.gather().map_err(|e| e.to_string())?;
    for (i, r) in replies.iter().enumerate() {
        let rank = i + 1;
        let want = format!("{rank} {} {per_node} {} {} {ping}", rank % per_node, rank / per_node, String::from_utf8_lossy(payload));
        let got = String::from_utf8_lossy(r);
        if got != want {
            return Err(format!("rank {rank} answered {got:?}, expected {want:?}"));
        }
    }
    eprintln!("rank 0: every one of ranks 1..{} answered as itself", c.world());
    Ok(())
}

/// A worker: answer the one step, then wait for the stop.
fn work(world: &World, node_rank: usize) -> Result<(), String> {
    let c = &world.control;
    let step = c.recv().map_err(|e| e.to_string())?.ok_or("the world was stopped before the first step")?;
    c.send_to_leader(answer(world, node_rank, &step).as_bytes()).map_err(|e| e.to_string())?;
    match c.recv().map_err(|e| e.to_string())? {
        None => Ok(()),
        Some(f) => Err(format!("expected the stop, got a {}-byte frame", f.len())),
    }
}

// ---------------------------------------------------------------------------------------------
// The driver side.

/// A port that was free a moment ago (for a master address given on the command line).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A node process: this binary running [`rank_main`], output in files (a node's children write
/// to the same ones, and a file never blocks a writer), in its own process group.
struct Node {
    child: Child,
    out: PathBuf,
    err: PathBuf,
    t0: Instant,
}

/// How a node ended.
struct Ended {
    /// `None`: it overran [`NODE_LIMIT`] and was killed.
    status: Option<ExitStatus>,
    elapsed: Duration,
    stdout: String,
    stderr: String,
}

impl Ended {
    fn ok(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }
    fn show(&self) -> String {
        format!("status {:?} after {:.1?}\n--- stdout\n{}\n--- stderr\n{}", self.status, self.elapsed, self.stdout, self.stderr)
    }
}

/// Starts a node playing `scenario` with `env` (launcher variables of the driver's own
/// environment removed first, so only `env` says what this process is).
fn node(scenario: &str, tag: &str, env: &[(&str, String)]) -> Node {
    let dir = std::env::temp_dir().join(format!("k3-launch-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (out, err) = (dir.join(format!("{tag}.out")), dir.join(format!("{tag}.err")));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["rank_main", "--exact", "--nocapture", "--test-threads=1"]);
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS"] {
        cmd.env_remove(k);
    }
    cmd.env(SCENARIO, scenario).env("K3_RENDEZVOUS_TIMEOUT_S", RENDEZVOUS_S.to_string()).env("RUST_BACKTRACE", "0");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null()).stdout(File::create(&out).unwrap()).stderr(File::create(&err).unwrap()).process_group(0);
    let t0 = Instant::now();
    let child = cmd.spawn().expect("starting a node process (this test binary)");
    Node { child, out, err, t0 }
}

impl Node {
    /// Waits for the node (at most [`NODE_LIMIT`]), then kills whatever is left of its process
    /// group (its children, if the node died without reaping them).
    fn wait(mut self) -> Ended {
        let status = loop {
            match self.child.try_wait().expect("waiting for a node") {
                Some(st) => break Some(st),
                None if self.t0.elapsed() > NODE_LIMIT => break None,
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let elapsed = self.t0.elapsed();
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", self.child.id())]).stderr(Stdio::null()).status();
        if status.is_none() {
            let _ = self.child.wait();
        }
        let read = |p: &PathBuf| {
            let mut s = String::new();
            let _ = File::open(p).and_then(|mut f| f.read_to_string(&mut s));
            s
        };
        let ended = Ended { status, elapsed, stdout: read(&self.out), stderr: read(&self.err) };
        for p in [&self.out, &self.err] {
            let _ = std::fs::remove_file(p);
        }
        // The last node of this test binary removes the folder (it fails while others use it).
        let _ = self.out.parent().map(std::fs::remove_dir);
        ended
    }
}

/// Asserts a node succeeded and every rank `ranks` printed its `K3_LAUNCH_OK` line (a rank that
/// never ran its scenario, e.g. a test filter that matched nothing, prints none).
fn assert_ok(e: &Ended, ranks: std::ops::Range<usize>, world: usize) {
    assert!(e.ok(), "the node failed: {}", e.show());
    for r in ranks {
        let line = format!("K3_LAUNCH_OK rank={r} world={world}");
        assert!(e.stdout.contains(&line), "no `{line}` in the node's output: {}", e.show());
    }
}

fn assert_failed_naming(e: &Ended, needles: &[&str]) {
    assert!(e.status.is_some(), "the node overran {NODE_LIMIT:?} and was killed: {}", e.show());
    assert!(!e.ok(), "the node succeeded but should have failed: {}", e.show());
    for n in needles {
        assert!(e.stderr.contains(n), "the node's error does not say {n:?}: {}", e.show());
    }
}

/// One process asks for 4 ranks and starts 3 local ones itself (a loopback free port).
#[test]
fn one_node_starts_its_local_ranks() {
    let e = node("exchange", "one_node", &[("K3_LAUNCH_TP", "4".into())]).wait();
    assert_ok(&e, 0..4, 4);
}

/// Two "nodes" on one machine (`--nnodes 2 --node-rank 0|1 --master-addr`), 4 ranks: each
/// starts one child, and the ranks are numbered node-major (rank 0 checks each answer's node).
#[test]
fn two_nodes_form_one_node_major_world() {
    let master = format!("127.0.0.1:{}", free_port());
    let env = |n: usize| {
        vec![("K3_LAUNCH_TP", "4".to_string()), ("K3_LAUNCH_NNODES", "2".into()), ("K3_LAUNCH_NODE_RANK", n.to_string()), ("K3_LAUNCH_MASTER", master.clone())]
    };
    // Node 1 first: its ranks must wait for rank 0's node.
    let n1 = node("exchange", "two_nodes_1", &env(1));
    let n0 = node("exchange", "two_nodes_0", &env(0));
    let (e0, e1) = (n0.wait(), n1.wait());
    assert_ok(&e0, 0..2, 4);
    assert_ok(&e1, 2..4, 4);
}

/// A torchrun-style world: the test starts every process with `RANK/WORLD_SIZE/MASTER_ADDR/
/// MASTER_PORT` (each its own node, `LOCAL_RANK` unset).
#[test]
fn torchrun_environment_forms_a_world() {
    let (n, port) = (3, free_port());
    let nodes: Vec<Node> = (0..n)
        .rev()
        .map(|r| {
            let env = [
                ("K3_LAUNCH_TP", n.to_string()),
                // Read by the ranks' check only (the environment path ignores node flags).
                ("K3_LAUNCH_NNODES", n.to_string()),
                ("K3_LAUNCH_NODE_RANK", r.to_string()),
                ("RANK", r.to_string()),
                ("WORLD_SIZE", n.to_string()),
                ("MASTER_ADDR", "127.0.0.1".into()),
                ("MASTER_PORT", port.to_string()),
            ];
            node("exchange", &format!("torchrun_{r}"), &env)
        })
        .collect();
    for (i, nd) in nodes.into_iter().enumerate() {
        let r = n - 1 - i;
        assert_ok(&nd.wait(), r..r + 1, n);
    }
}

/// Rank 1 passes another digest: rank 0 refuses the world and names rank 1 and both digests.
#[test]
fn a_different_digest_is_refused_by_rank() {
    let e = node("digest", "digest", &[("K3_LAUNCH_TP", "2".into()), ("K3_LAUNCH_FAULT_RANK", "1".into())]).wait();
    assert_failed_naming(&e, &["rank 1", "digest-of-another-build", "digest-of-this-build"]);
}

/// A child that exits with status 3 before the rendezvous: the node's first process fails at
/// once naming it, well before the rendezvous timeout.
#[test]
fn a_child_that_exits_before_the_rendezvous_is_named_at_once() {
    let e = node("exit_before", "exit_before", &[("K3_LAUNCH_TP", "4".into()), ("K3_LAUNCH_FAULT_RANK", "1".into())]).wait();
    assert_failed_naming(&e, &["rank 1 exited with exit status: 3"]);
    let bound = Duration::from_secs(RENDEZVOUS_S) / 2;
    assert!(e.elapsed < bound, "took {:.1?} (bound {bound:?}, the rendezvous timeout is {RENDEZVOUS_S} s): {}", e.elapsed, e.show());
}

/// Two nodes, and node 1's child (rank 3) exits with status 3 before the rendezvous: node 1's
/// first process (a worker, waiting for rank 0's go) fails at once naming rank 3; rank 0 gives
/// up at its own (shorter, here) rendezvous timeout, naming rank 3 as missing.
#[test]
fn a_child_on_a_worker_node_that_exits_early_is_named() {
    let master = format!("127.0.0.1:{}", free_port());
    let env = |n: usize| {
        vec![
            ("K3_LAUNCH_TP", "4".to_string()),
            ("K3_LAUNCH_NNODES", "2".into()),
            ("K3_LAUNCH_NODE_RANK", n.to_string()),
            ("K3_LAUNCH_MASTER", master.clone()),
            ("K3_LAUNCH_FAULT_RANK", "3".into()),
        ]
    };
    let mut env0 = env(0);
    env0.push(("K3_RENDEZVOUS_TIMEOUT_S", "3".into()));
    let n0 = node("exit_before", "worker_node_0", &env0);
    let n1 = node("exit_before", "worker_node_1", &env(1));
    let (e0, e1) = (n0.wait(), n1.wait());
    assert_failed_naming(&e1, &["rank 3 exited with exit status: 3"]);
    let bound = Duration::from_secs(RENDEZVOUS_S) / 2;
    assert!(e1.elapsed < bound, "node 1 took {:.1?} (bound {bound:?}): {}", e1.elapsed, e1.show());
    assert_failed_naming(&e0, &["rank(s) [3] of 4 never arrived"]);
}

/// A child that exits with status 3 after the rendezvous: rank 0's exchange fails, the watcher
/// (`World::on_child_failure`) and `World::finish` name rank 1, within a bound.
#[test]
fn a_child_that_exits_after_the_rendezvous_is_named() {
    let e = node("exit_after", "exit_after", &[("K3_LAUNCH_TP", "4".into()), ("K3_LAUNCH_FAULT_RANK", "1".into())]).wait();
    assert_failed_naming(
        &e,
        &[
            "K3_LAUNCH_CHILD_FAILURE rank 1 exited with exit status: 3",
            "K3_LAUNCH_FAIL rank (first of its node)",
            "finish: launch: rank 1 exited with exit status: 3",
        ],
    );
    let bound = Duration::from_secs(RENDEZVOUS_S);
    assert!(e.elapsed < bound, "took {:.1?} (bound {bound:?}): {}", e.elapsed, e.show());
}

// ---------------------------------------------------------------------------------------------
// Errors that need no process.

fn start_err(par: Parallel, node: &NodeArgs, env: &[(&str, &str)]) -> String {
    let map: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    match World::start(par, node, "d", |k| map.get(k).cloned(), || Ok(b"p".to_vec())) {
        Ok(w) => panic!("World::start succeeded as rank {} but should have failed", w.rank()),
        Err(e @ EngineError::Launch(_)) => e.to_string(),
        Err(e) => panic!("expected a launch error, got {e:?}"),
    }
}

#[test]
fn world_size_that_disagrees_with_the_layout_is_refused() {
    let env = [("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")];
    let e = start_err(Parallel::new(2, None, 1).unwrap(), &NodeArgs::default(), &env);
    assert!(e.contains("WORLD_SIZE=3") && e.contains("--tp 2") && e.contains("needs 2"), "{e}");
}

#[test]
fn several_nodes_need_a_master_address() {
    let e = start_err(Parallel::new(4, None, 1).unwrap(), &NodeArgs { nnodes: 2, node_rank: 0, master_addr: None }, &[]);
    assert!(e.contains("--nnodes 2") && e.contains("--master-addr"), "{e}");
}

#[test]
fn a_layout_that_does_not_split_over_the_nodes_is_refused() {
    let master = Some("127.0.0.1:1".to_string());
    let e = start_err(Parallel::new(3, None, 1).unwrap(), &NodeArgs { nnodes: 2, node_rank: 0, master_addr: master.clone() }, &[]);
    assert!(e.contains("--nnodes 2") && e.contains("3 ranks") && e.contains("split evenly"), "{e}");
    let e = start_err(Parallel::new(2, None, 1).unwrap(), &NodeArgs { nnodes: 0, node_rank: 0, master_addr: master.clone() }, &[]);
    assert!(e.contains("--nnodes 0"), "{e}");
    let e = start_err(Parallel::new(2, None, 1).unwrap(), &NodeArgs { nnodes: 2, node_rank: 2, master_addr: master }, &[]);
    assert!(e.contains("--node-rank 2") && e.contains("--nnodes 2"), "{e}");
}

#[test]
fn bad_launcher_variables_name_the_variable() {
    let e = start_err(Parallel::new(2, None, 1).unwrap(), &NodeArgs::default(), &[("RANK", "1")]);
    assert!(e.contains("WORLD_SIZE"), "{e}");
    let e = start_err(Parallel::new(2, None, 1).unwrap(), &NodeArgs::default(), &[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")]);
    assert!(e.contains("RANK=2") && e.contains("WORLD_SIZE=2"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// The digest.

#[path = "../../../tests/support/golden.rs"]
mod golden;

/// The rendezvous digest is stable for one binary, checkpoint and layout, and changes with the
/// layout.
#[test]
fn world_digest_names_the_layout() {
    let ck = k3_model::Checkpoint::open(&golden::fixture("k3_small_mxfp4")).unwrap();
    let tp2 = Parallel::new(2, None, 1).unwrap();
    let d = world_digest(&ck, tp2).unwrap();
    assert_eq!(d.len(), 64, "{d}");
    assert_eq!(d, world_digest(&ck, tp2).unwrap());
    assert_ne!(d, world_digest(&ck, Parallel::new(2, Some(1), 1).unwrap()).unwrap());
    assert_ne!(d, world_digest(&ck, Parallel::new(1, None, 2).unwrap()).unwrap());
}
