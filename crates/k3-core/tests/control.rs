//! The TCP control plane over loopback: ranks as threads of this process, 127.0.0.1 only,
//! free ports from the OS, short timeouts so that a broken build fails instead of hanging.

use std::collections::HashMap;
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use k3_core::comm::control::{self, digest, lead, node_specs, rendezvous, rendezvous_with, Control, Options, WorldSpec};

/// A port that was free a moment ago (for tests where the workers must start first).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A bound listener and its address (no race: rank 0 keeps it).
fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

fn spec(rank: usize, world: usize, master: &str) -> WorldSpec {
    WorldSpec::new(rank, world, 0, 1, master).unwrap()
}

fn opts(timeout_ms: u64, io_ms: u64) -> Options {
    let mut o = Options::new(Duration::from_millis(timeout_ms));
    o.io_timeout = Duration::from_millis(io_ms);
    o.heartbeat = Some(Duration::from_millis(50));
    o
}

fn err(r: k3_core::Result<impl Sized>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// Starts ranks 1..world as threads running `work` on their `Control`, then rank 0 on a
/// listener it bound first; returns rank 0's control and the workers' join handles.
fn world_of<T: Send + 'static>(
    world: usize,
    o: &Options,
    work: impl Fn(Control) -> T + Send + Sync + Clone + 'static,
) -> (Control, Vec<thread::JoinHandle<T>>) {
    let (l, master) = listener();
    let workers = (1..world)
        .map(|r| {
            let (s, o, work) = (spec(r, world, &master), o.clone(), work.clone());
            thread::spawn(move || work(rendezvous_with(&s, "d", None, &o).unwrap()))
        })
        .collect();
    let leader = lead(l, &spec(0, world, &master), "d", Some(vec![7; 128]), o).unwrap();
    (leader, workers)
}

#[test]
fn four_ranks_rendezvous_steps_replies_shutdown() {
    let master = format!("127.0.0.1:{}", free_port());
    let specs: Vec<WorldSpec> = (0..2).flat_map(|n| node_specs(2, n, 2, &master).unwrap()).collect();
    assert_eq!(specs.iter().map(|s| (s.rank, s.local_rank)).collect::<Vec<_>>(), [(0, 0), (1, 1), (2, 0), (3, 1)]);
    let nccl_id: Vec<u8> = (0..128).collect();
    let d = digest(&[b"k3 0.1", b"config", b"checkpoint"]);
    // Workers start first and retry until rank 0 listens.
    let workers: Vec<_> = specs[1..]
        .iter()
        .cloned()
        .map(|s| {
            let (d, id) = (d.clone(), nccl_id.clone());
            thread::spawn(move || {
                let c = rendezvous(&s, &d, None, Duration::from_secs(5)).unwrap();
                assert_eq!((c.rank(), c.world(), c.is_leader()), (s.rank, 4, false));
                assert_eq!(c.payload(), Some(&id[..]));
                let mut seen = 0u64;
                while let Some(msg) = c.recv().unwrap() {
                    let i = u64::from_le_bytes(msg[..8].try_into().unwrap());
                    assert_eq!(i, seen, "frames arrive in order");
                    assert_eq!(msg.len(), frame_len(i));
                    assert!(msg[8..].iter().all(|&b| b == i as u8));
                    c.send_to_leader(format!("rank {} ack {i}", c.rank()).as_bytes()).unwrap();
                    seen += 1;
                }
                assert_eq!(c.recv().unwrap(), None, "recv after the stop stays None");
                seen
            })
        })
        .collect();
    thread::sleep(Duration::from_millis(150));
    let leader = rendezvous(&specs[0], &d, Some(nccl_id.clone()), Duration::from_secs(5)).unwrap();
    assert_eq!(leader.payload(), Some(&nccl_id[..]));
    for i in 0..100u64 {
        let mut msg = i.to_le_bytes().to_vec();
        msg.resize(frame_len(i), i as u8);
        leader.broadcast(&msg).unwrap();
        let replies = leader.gather().unwrap();
        let want: Vec<Vec<u8>> = (1..4).map(|r| format!("rank {r} ack {i}").into_bytes()).collect();
        assert_eq!(replies, want);
    }
    leader.shutdown().unwrap();
    assert!(leader.broadcast(b"late").is_err(), "no broadcast after shutdown");
    for w in workers {
        assert_eq!(w.join().unwrap(), 100);
    }
}

/// Small frames (8..308 bytes), with one over 64 KiB every tenth (the two-write path).
fn frame_len(i: u64) -> usize {
    match i % 10 {
        3 => 200_000,
        _ => 8 + (i as usize * 37) % 300,
    }
}

#[test]
fn digest_mismatch_names_the_rank_on_both_sides() {
    let (l, master) = listener();
    let o = opts(2000, 1000);
    let good = digest(&[b"build a"]);
    let bad = digest(&[b"build b"]);
    let w2 = {
        let (s, o, bad) = (spec(2, 3, &master), o.clone(), bad.clone());
        thread::spawn(move || err(rendezvous_with(&s, &bad, None, &o)))
    };
    let e0 = err(lead(l, &spec(0, 3, &master), &good, None, &o));
    let e2 = w2.join().unwrap();
    for e in [&e0, &e2] {
        assert!(e.contains("rank 2") && e.contains(&good) && e.contains(&bad), "{e}");
    }
    assert!(e2.contains("refused"), "{e2}");
}

#[test]
fn duplicate_rank_and_world_mismatch_are_refused() {
    let o = opts(2000, 1000);
    let (l, master) = listener();
    let w = {
        let (s, o) = (spec(1, 3, &master), o.clone());
        thread::spawn(move || err(rendezvous_with(&s, "d", None, &o)))
    };
    let w2 = {
        let (s, o) = (spec(1, 3, &master), o.clone());
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(100));
            err(rendezvous_with(&s, "d", None, &o))
        })
    };
    let e = err(lead(l, &spec(0, 3, &master), "d", None, &o));
    assert!(e.contains("rank 1 connected twice"), "{e}");
    assert!(w.join().unwrap().contains("connected twice"));
    assert!(w2.join().unwrap().contains("connected twice"));

    let (l, master) = listener();
    let w = {
        let (s, o) = (spec(1, 2, &master), o.clone());
        thread::spawn(move || err(rendezvous_with(&s, "d", None, &o)))
    };
    let e = err(lead(l, &spec(0, 3, &master), "d", None, &o));
    assert!(e.contains("rank 1") && e.contains("world of 2") && e.contains("with 3"), "{e}");
    assert!(w.join().unwrap().contains("world of 2"));
}

#[test]
fn a_missing_rank_times_out_naming_it() {
    let (l, master) = listener();
    let o = opts(400, 1000);
    let ws: Vec<_> = [1, 3]
        .into_iter()
        .map(|r| {
            let (s, o) = (spec(r, 4, &master), o.clone());
            thread::spawn(move || err(rendezvous_with(&s, "d", None, &o)))
        })
        .collect();
    let t = Instant::now();
    let e = err(lead(l, &spec(0, 4, &master), "d", None, &o));
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(e.contains("[2]") && e.contains("never arrived"), "{e}");
    for w in ws {
        let e = w.join().unwrap();
        assert!(e.contains("[2]") && e.contains("refused"), "{e}");
    }
    // A worker with no rank 0 at all gives up at its own timeout.
    let master = format!("127.0.0.1:{}", free_port());
    let t = Instant::now();
    let e = err(rendezvous_with(&spec(1, 2, &master), "d", None, &opts(300, 300)));
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(e.contains("rank 1 could not reach rank 0") && e.contains(&master), "{e}");
}

#[test]
fn a_stray_connection_does_not_break_the_rendezvous() {
    let (l, master) = listener();
    let mut junk = TcpStream::connect(&master).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let (s, o) = (spec(1, 2, &master), opts(3000, 1000));
    let w = thread::spawn(move || rendezvous_with(&s, "d", None, &o).unwrap().recv().unwrap());
    let c = lead(l, &spec(0, 2, &master), "d", None, &opts(3000, 1000)).unwrap();
    c.broadcast(b"hi").unwrap();
    assert_eq!(w.join().unwrap().as_deref(), Some(&b"hi"[..]));
}

#[test]
fn a_dead_worker_fails_the_leaders_next_call_naming_it() {
    let o = opts(3000, 2000);
    let (leader, ws) = world_of(3, &o, |c: Control| {
        let msg = c.recv().unwrap().unwrap();
        if c.rank() == 1 {
            c.send_to_leader(&msg).unwrap();
            c.recv().unwrap()
        } else {
            None // rank 2 drops its connection without answering
        }
    });
    leader.broadcast(b"step").unwrap();
    let t = Instant::now();
    let e = err(leader.gather());
    assert!(t.elapsed() < Duration::from_secs(1), "a closed connection is seen at once");
    assert!(e.contains("rank 2") && e.contains("frame 0") && e.contains("closed"), "{e}");
    leader.shutdown().unwrap_or(());
    for w in ws {
        assert_eq!(w.join().unwrap(), None);
    }
}

#[test]
fn a_silent_worker_fails_the_leader_within_the_io_timeout() {
    let o = opts(3000, 300);
    let (leader, ws) = world_of(2, &o, |c: Control| {
        let _ = c.recv();
        thread::sleep(Duration::from_millis(800));
        c
    });
    leader.broadcast(b"step").unwrap();
    let t = Instant::now();
    let e = err(leader.recv_from(1));
    assert!(t.elapsed() < Duration::from_millis(700), "{:?}", t.elapsed());
    assert!(e.contains("rank 1") && e.contains("frame 0") && e.contains("nothing for"), "{e}");
    drop(ws);
}

#[test]
fn a_dead_leader_fails_the_workers_within_the_bound() {
    let o = opts(3000, 500);
    let (leader, ws) = world_of(3, &o, |c: Control| {
        assert_eq!(c.recv().unwrap().as_deref(), Some(&b"one"[..]));
        let t = Instant::now();
        let e = err(c.recv());
        (e, t.elapsed())
    });
    leader.broadcast(b"one").unwrap();
    drop(leader); // exits without a stop
    for w in ws {
        let (e, took) = w.join().unwrap();
        assert!(took < Duration::from_millis(400), "{took:?}");
        assert!(e.contains("rank 0") && e.contains("frame 1") && e.contains("closed"), "{e}");
    }

    // A leader that stays connected but goes silent (no pings): the worker's read times out.
    let mut quiet = opts(3000, 300);
    quiet.heartbeat = None;
    let (leader, ws) = world_of(2, &quiet, |c: Control| {
        let t = Instant::now();
        (err(c.recv()), t.elapsed())
    });
    let (e, took) = ws.into_iter().next().unwrap().join().unwrap();
    assert!(took < Duration::from_millis(900), "{took:?}");
    assert!(e.contains("rank 0") && e.contains("frame 0") && e.contains("nothing for"), "{e}");
    drop(leader);
}

#[test]
fn pings_keep_an_idle_world_alive() {
    let o = opts(3000, 300); // heartbeat 50 ms
    let (leader, ws) = world_of(2, &o, |c: Control| c.recv().unwrap());
    thread::sleep(Duration::from_millis(1000)); // idle for three I/O timeouts
    leader.broadcast(b"late step").unwrap();
    assert_eq!(ws.into_iter().next().unwrap().join().unwrap().as_deref(), Some(&b"late step"[..]));
}

#[test]
fn aborts_reach_the_other_side() {
    let o = opts(3000, 2000);
    let (leader, ws) = world_of(3, &o, |c: Control| {
        if c.rank() == 1 {
            c.abort("out of device memory");
            String::new()
        } else {
            err(c.recv())
        }
    });
    let e = err(leader.recv_from(1));
    assert!(e.contains("rank 1 aborted") && e.contains("out of device memory"), "{e}");
    leader.abort("rank 1 failed");
    let mut out: Vec<String> = ws.into_iter().map(|w| w.join().unwrap()).collect();
    let e2 = out.pop().unwrap();
    assert!(e2.contains("rank 0 aborted") && e2.contains("rank 1 failed"), "{e2}");
    assert!(leader.broadcast(b"x").is_err());
}

#[test]
fn frames_over_the_limit_are_refused() {
    let mut small = opts(3000, 2000);
    small.max_frame = 1024;
    let (l, master) = listener();
    let w = {
        let (s, o) = (spec(1, 2, &master), small.clone());
        thread::spawn(move || {
            let c = rendezvous_with(&s, "d", None, &o).unwrap();
            assert!(c.send_to_leader(&[0; 1025]).is_err(), "the sender checks too");
            err(c.recv())
        })
    };
    let leader = lead(l, &spec(0, 2, &master), "d", None, &opts(3000, 2000)).unwrap();
    let big = opts(3000, 2000).max_frame;
    let e = err(leader.broadcast(&vec![0; big + 1]));
    assert!(e.contains("limit"), "{e}");
    leader.broadcast(&[1; 2000]).unwrap(); // fits rank 0's limit, not rank 1's
    let e = w.join().unwrap();
    assert!(e.contains("rank 1") && e.contains("2000-byte frame exceeds the 1024-byte limit"), "{e}");
}

#[test]
fn world_one_needs_no_sockets() {
    let c = rendezvous(&WorldSpec::single(), "d", Some(vec![1, 2]), Duration::from_millis(1)).unwrap();
    assert_eq!((c.rank(), c.world(), c.payload()), (0, 1, Some(&[1u8, 2][..])));
    c.broadcast(b"x").unwrap();
    assert!(c.gather().unwrap().is_empty());
    assert!(c.recv().is_err(), "rank 0 is not a worker");
    assert!(c.recv_from(1).is_err());
    c.shutdown().unwrap();
}

#[test]
fn digests_are_hex_sha256_of_length_prefixed_parts() {
    let d = digest(&[b"ab", b"c"]);
    assert_eq!(d.len(), 64);
    assert!(d.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(d, digest(&[b"ab", b"c"]));
    assert_ne!(d, digest(&[b"a", b"bc"]));
    assert_ne!(d, digest(&[b"abc"]));
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| m.get(k).cloned()
}

fn env_err(pairs: &[(&str, &str)]) -> String {
    err(WorldSpec::from_env(env(pairs)))
}

#[test]
fn env_torchrun_and_kubernetes() {
    let s = WorldSpec::from_env(env(&[
        ("RANK", "5"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_RANK", "5"),
        ("LOCAL_WORLD_SIZE", "8"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29400"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(s, WorldSpec { rank: 5, world: 16, local_rank: 5, local_world: 8, master: "10.0.0.1:29400".into() });
    // A Kubernetes pod: one process, no LOCAL_*, default port.
    let s = WorldSpec::from_env(env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "k3-0.k3")])).unwrap().unwrap();
    assert_eq!((s.local_rank, s.local_world, s.master.as_str()), (0, 1, "k3-0.k3:29500"));
    let s = WorldSpec::from_env(env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "::1"), ("MASTER_PORT", "7")]));
    assert_eq!(s.unwrap().unwrap().master, "[::1]:7");
    let s = WorldSpec::from_env(env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h:1234")]));
    assert_eq!(s.unwrap().unwrap().master, "h:1234");
    // torchrun inside srun: torchrun's variables win.
    let s = WorldSpec::from_env(env(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "h"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]));
    assert_eq!(s.unwrap().unwrap().rank, 3);
    assert_eq!(WorldSpec::from_env(env(&[])).unwrap(), None);
    assert_eq!(WorldSpec::from_env(env(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap(), Some(WorldSpec::single()));
}

#[test]
fn env_slurm() {
    let s = WorldSpec::from_env(env(&[
        ("SLURM_PROCID", "5"),
        ("SLURM_NTASKS", "7"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_STEP_TASKS_PER_NODE", "4,3"),
        ("SLURM_STEP_NODELIST", "gpu[03-04]"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(s, WorldSpec { rank: 5, world: 7, local_rank: 1, local_world: 3, master: "gpu03:29500".into() });
    let s = WorldSpec::from_env(env(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_TASKS_PER_NODE", "4(x2)"),
        ("SLURM_JOB_NODELIST", "a,b"),
        ("MASTER_ADDR", "10.1.1.1"),
        ("MASTER_PORT", "4000"),
    ]));
    assert_eq!(s.unwrap().unwrap().master, "10.1.1.1:4000");
    let e = env_err(&[("SLURM_PROCID", "8"), ("SLURM_NTASKS", "8"), ("SLURM_TASKS_PER_NODE", "8"), ("SLURM_NODELIST", "n")]);
    assert!(e.contains("SLURM_PROCID=8 but SLURM_NTASKS=8"), "{e}");
    let e = env_err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8"), ("SLURM_NODEID", "2"), ("SLURM_TASKS_PER_NODE", "4(x2)")]);
    assert!(e.contains("SLURM_TASKS_PER_NODE=4(x2)") && e.contains("SLURM_NODEID=2"), "{e}");
    let e = env_err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_TASKS_PER_NODE", "1(x2)")]);
    assert!(e.contains("MASTER_ADDR"), "{e}");
}

#[test]
fn env_contradictions_name_the_variable_and_the_fix() {
    let m = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
    let with = |extra: &[(&'static str, &'static str)]| [&m[..], extra].concat();
    let e = env_err(&with(&[("RANK", "3"), ("WORLD_SIZE", "2")]));
    assert!(e.contains("RANK=3 but WORLD_SIZE=2") && e.contains("0..2"), "{e}");
    let e = env_err(&with(&[("RANK", "1")]));
    assert!(e.contains("WORLD_SIZE is not") && e.contains("set WORLD_SIZE"), "{e}");
    let e = env_err(&with(&[("RANK", "x"), ("WORLD_SIZE", "2")]));
    assert!(e.contains("RANK=x is not a whole number"), "{e}");
    let e = env_err(&with(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")]));
    assert!(e.contains("LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2"), "{e}");
    let e = env_err(&with(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")]));
    assert!(e.contains("LOCAL_WORLD_SIZE is not"), "{e}");
    let e = env_err(&with(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "8")]));
    assert!(e.contains("LOCAL_WORLD_SIZE=8 but WORLD_SIZE=4"), "{e}");
    let e = env_err(&[("RANK", "1"), ("WORLD_SIZE", "2")]);
    assert!(e.contains("MASTER_ADDR is not set"), "{e}");
    let e = env_err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "99999")]);
    assert!(e.contains("MASTER_PORT=99999"), "{e}");
}

#[test]
fn explicit_flags_and_node_layout() {
    let e = err(WorldSpec::new(3, 2, 0, 1, "h:1"));
    assert!(e.contains("--rank 3 but --world 2"), "{e}");
    let e = err(WorldSpec::new(1, 2, 0, 1, "h"));
    assert!(e.contains("--master") && e.contains("no port"), "{e}");
    assert!(WorldSpec::new(0, 1, 0, 1, "").is_ok(), "world 1 needs no master");
    let s = node_specs(2, 1, 4, "n0:29500").unwrap();
    assert_eq!(s.iter().map(|s| s.rank).collect::<Vec<_>>(), [4, 5, 6, 7]);
    assert!(s.iter().enumerate().all(|(i, s)| s.local_rank == i && s.local_world == 4 && s.world == 8));
    let e = err(node_specs(2, 2, 4, "n0:1"));
    assert!(e.contains("--node-rank 2 but --nnodes 2"), "{e}");
    let e = err(node_specs(2, 0, 4, "n0"));
    assert!(e.contains("--master-addr"), "{e}");
    assert!(node_specs(1, 0, 0, "n0:1").is_err());
    assert_eq!(control::DEFAULT_PORT, 29500);
}
