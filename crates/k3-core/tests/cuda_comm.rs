//! GPU tests of the device communicator `comm::nccl::CudaGroup`: world 1 (the no-library
//! variant and real NCCL) with graph capture, and multi-process parity at 2, 4 and 8 ranks on
//! ONE GPU. The test binary re-executes itself (the ignored test `comm_child`) as one process
//! per rank, each with its own `NCCL_HOSTID` (how NCCL 2.28 lets several ranks share a GPU:
//! they then talk over sockets, slow but exact); rank 0 makes the NCCL id and hands it over in
//! a file. Children inherit the environment unchanged apart from `NCCL_HOSTID`,
//! `K3_COMM_CHILD` (mode:rank:world:dir) and, in the fault tests, `K3_NCCL_TIMEOUT_S`.
//!
//! Values are small integers, so every sum is exact in f32, bf16 and i32 and results are
//! compared bit for bit: all_reduce [4099], all_gather [4099] → [W·4099], reduce_scatter
//! [W·1031] → [1031], broadcast [4099] from rank W−1, a ring send/recv [2053] in one group, a
//! plain send 0 → 1; eagerly, then the same calls captured into one CUDA graph and replayed
//! on fresh inputs. The fault tests kill one rank (SIGKILL) or let it hang, and require every
//! other rank to exit with an error naming the call within its timeout.
//!
//! Without a GPU (or without libnccl.so.2) each GPU test prints `skipped: …` and returns;
//! `K3_REQUIRE_CUDA=1` turns that into a failure. `K3_COMM_WORLDS=2,4` narrows the worlds.
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::nccl_id::exchange_id;
use cuda_common::{device, say, skip};

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use half::bf16;
use k3_core::comm::nccl::{nccl_library, nccl_unique_id, CudaGroup};
use k3_core::cuda::{capture, ops, CudaDevice, CudaTensor};
use k3_core::{CoreError, DType};

/// One GPU test at a time (they spawn processes on the same device).
static GPU: Mutex<()> = Mutex::new(());

fn gpu_lock() -> std::sync::MutexGuard<'static, ()> {
    GPU.lock().unwrap_or_else(|e| e.into_inner())
}

/// The GPU and a loadable NCCL, or `None` after saying why.
fn nccl_device(test: &str) -> Option<CudaDevice> {
    let dev = device(test)?;
    match nccl_library() {
        Ok((path, v)) => {
            say(&format!("{test}: NCCL {v} from {path}"));
            Some(dev)
        }
        Err(CoreError::CudaUnavailable(why)) => skip(test, "NCCL is unavailable", "NCCL unavailable", &why),
        Err(e) => panic!("{test}: {e}"),
    }
}

// ---- process helpers ----

fn spawn(mode: &str, rank: usize, world: usize, dir: &Path, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut c = Command::new(exe);
    c.args(["comm_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("K3_COMM_CHILD", format!("{mode}:{rank}:{world}:{}", dir.display()))
        .env("NCCL_HOSTID", format!("k3rs-comm-test-rank{rank}"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join(format!("rank{rank}.out"))).expect("log"))
        .stderr(std::fs::File::create(dir.join(format!("rank{rank}.err"))).expect("log"));
    for (k, v) in env {
        c.env(k, v);
    }
    c.spawn().expect("spawning a rank")
}

fn log_of(dir: &Path, rank: usize) -> String {
    let read = |ext| std::fs::read_to_string(dir.join(format!("rank{rank}.{ext}"))).unwrap_or_default();
    format!("{}{}", read("out"), read("err"))
}

/// Waits for `ranks` (None = already reaped) until `deadline`; kills the rest. Per rank: the
/// exit code (None if killed) and when it exited.
fn wait_all(children: &mut [(usize, Child)], deadline: Instant) -> Vec<(usize, Option<i32>, Instant)> {
    let mut done: Vec<(usize, Option<i32>, Instant)> = Vec::new();
    while done.len() < children.len() {
        for (r, c) in children.iter_mut() {
            if done.iter().any(|d| d.0 == *r) {
                continue;
            }
            if let Ok(Some(st)) = c.try_wait() {
                done.push((*r, st.code(), Instant::now()));
            } else if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                done.push((*r, None, Instant::now()));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done.sort_by_key(|d| d.0);
    done
}

fn worlds() -> Vec<usize> {
    std::env::var("K3_COMM_WORLDS").ok().map(|s| s.split(',').filter_map(|w| w.trim().parse().ok()).collect()).unwrap_or(vec![2, 4, 8])
}

// ---- tests run by the harness ----

#[test]
fn missing_library_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = [(0, spawn("missing", 0, 1, dir.path(), &[("K3_NCCL_LIB", "/nonexistent/libnccl.so.2".into())]))];
    let r = wait_all(&mut c, Instant::now() + Duration::from_secs(60));
    assert_eq!(r[0].1, Some(0), "child failed:\n{}", log_of(dir.path(), 0));
    say(&format!("missing_library: {}", log_of(dir.path(), 0).lines().find(|l| l.contains("error:")).unwrap_or("?")));
}

#[test]
fn world1_verbs_and_graph_capture() {
    let _g = gpu_lock();
    let Some(dev) = nccl_device("world1_verbs_and_graph_capture") else { return };
    let n = 4099;
    let vals: Vec<f32> = (0..n).map(|i| (i % 17) as f32 - 8.0).collect();
    let x = CudaTensor::from_f32(&dev, vec![n], &vals).unwrap();
    let xb = CudaTensor::from_bf16(&dev, vec![n], &vals.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).unwrap();
    let out = CudaTensor::uninit(&dev, DType::F32, vec![n]).unwrap();
    let one = CudaTensor::from_f32(&dev, vec![n], &vec![1.0; n]).unwrap();
    let id = nccl_unique_id().expect("nccl id");
    let groups = [("single", CudaGroup::single()), ("nccl", CudaGroup::nccl(&dev, 0, 1, id).expect("NCCL world 1"))];
    for (name, g) in &groups {
        assert_eq!((g.rank(), g.world()), (0, 1));
        g.all_reduce_sum(&x).unwrap();
        g.all_reduce_sum(&xb).unwrap();
        g.broadcast(0, &x).unwrap();
        out.fill_bytes(0xFF).unwrap();
        g.all_gather(&x, &out).unwrap();
        assert_eq!(out.to_f32_vec().unwrap(), vals, "{name}: all_gather");
        out.fill_bytes(0xFF).unwrap();
        g.reduce_scatter(&x, &out).unwrap();
        assert_eq!(out.to_f32_vec().unwrap(), vals, "{name}: reduce_scatter");
        g.barrier().unwrap();
        g.wait("eager").unwrap();
        assert_eq!(x.to_f32_vec().unwrap(), vals, "{name}: all_reduce/broadcast at world 1 is the identity");
        assert_eq!(xb.to_f32_vec().unwrap(), vals, "{name}: bf16 all_reduce");
        assert!(matches!(g.send(1, &x), Err(CoreError::Comm { op: "send", .. })), "{name}: send to a missing rank");
        assert!(matches!(g.recv(0, &x), Err(CoreError::Comm { op: "recv", .. })), "{name}: recv from self");
        assert!(g.all_gather(&x, &x.reshape(vec![1, n]).unwrap()).is_ok(), "{name}: gather in place");
        // A graph of N × (add 1, all-reduce), then a gather into a poisoned output.
        let reps = 32;
        let graph = capture(&dev, || {
            for _ in 0..reps {
                ops::add_assign(&x, &one)?;
                g.all_reduce_sum(&x)?;
            }
            g.all_gather(&x, &out)
        })
        .expect("capture");
        for round in 1..=3 {
            out.fill_bytes(0xFF).unwrap();
            graph.launch().unwrap();
            g.wait("graph replay").unwrap();
            let want: Vec<f32> = vals.iter().map(|v| v + (round * reps) as f32).collect();
            assert_eq!(out.to_f32_vec().unwrap(), want, "{name}: replay {round}");
        }
        // Timing (information only): eager all-reduce + wait vs one replay per 32 ops.
        let t = Instant::now();
        for _ in 0..200 {
            g.all_reduce_sum(&x).unwrap();
        }
        g.wait("timing").unwrap();
        dev.synchronize().unwrap(); // `single` has nothing to wait for: the stream is the clock
        let eager = t.elapsed().as_secs_f64() / 200.0;
        let t = Instant::now();
        for _ in 0..20 {
            graph.launch().unwrap();
        }
        g.wait("timing").unwrap();
        dev.synchronize().unwrap();
        let replay = t.elapsed().as_secs_f64() / (20 * reps) as f64;
        say(&format!(
            "  world 1 {name:<6}: eager all_reduce {:.2} µs/op (enqueue rate, 16 KB f32); graph replay {:.2} µs per (add + all_reduce)",
            eager * 1e6,
            replay * 1e6
        ));
        x.write_bytes(bytemuck::cast_slice(&vals)).unwrap();
    }
}

#[test]
fn multi_process_parity() {
    let _g = gpu_lock();
    let Some(_dev) = nccl_device("multi_process_parity") else { return };
    for world in worlds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = Instant::now();
        let mut kids: Vec<_> = (0..world).map(|r| (r, spawn("parity", r, world, dir.path(), &[]))).collect();
        let res = wait_all(&mut kids, Instant::now() + Duration::from_secs(300));
        for (r, code, _) in &res {
            assert_eq!(*code, Some(0), "world {world}: rank {r} failed:\n{}", log_of(dir.path(), *r));
        }
        let line = log_of(dir.path(), 0).lines().find(|l| l.contains("parity ok")).unwrap_or("?").to_string();
        say(&format!("  world {world}: all {world} ranks passed in {:.1} s; {line}", t.elapsed().as_secs_f64()));
    }
}

/// Starts `world` ranks in `mode` (the last one is the victim), waits for the victim to be
/// ready, lets `act` at it, and checks that every other rank exits with code 3 (an error) within
/// `timeout_s` + slack, its message containing each of `needles`.
fn fault(mode: &str, world: usize, timeout_s: u64, kill: bool, needles: &[&str]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let env = [("K3_NCCL_TIMEOUT_S", timeout_s.to_string())];
    let mut kids: Vec<_> = (0..world).map(|r| (r, spawn(mode, r, world, dir.path(), &env))).collect();
    let victim = world - 1;
    let ready = dir.path().join("victim_ready");
    let t0 = Instant::now();
    while !ready.exists() {
        if t0.elapsed() > Duration::from_secs(120) || kids.iter_mut().any(|(_, c)| c.try_wait().ok().flatten().is_some()) {
            for (_, c) in kids.iter_mut() {
                let _ = c.kill();
            }
            panic!("{mode}: the ranks never got ready:\n{}", (0..world).map(|r| log_of(dir.path(), r)).collect::<String>());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let t_fault = Instant::now();
    if kill {
        kids[victim].1.kill().expect("SIGKILL");
        let _ = kids[victim].1.wait();
    }
    let (mut others, mut rest): (Vec<_>, Vec<_>) = kids.into_iter().partition(|(r, _)| *r != victim);
    let res = wait_all(&mut others, t_fault + Duration::from_secs(timeout_s + 30));
    for (_, c) in rest.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    for (r, code, at) in res {
        let log = log_of(dir.path(), r);
        let secs = at.duration_since(t_fault).as_secs_f64();
        assert_eq!(code, Some(3), "{mode}: rank {r} should have exited with an error (code 3), got {code:?} after {secs:.1} s:\n{log}");
        let msg = log.lines().find(|l| l.contains("error after")).unwrap_or("").to_string();
        for n in needles {
            assert!(msg.contains(n), "{mode}: rank {r}'s error does not mention {n:?}: {msg}\n{log}");
        }
        assert!(secs <= (timeout_s + 15) as f64, "{mode}: rank {r} took {secs:.1} s (timeout {timeout_s} s)");
        say(&format!("  {mode}: rank {r} exited {secs:.1} s after the fault: {msg}"));
    }
}

#[test]
fn killed_rank_fails_the_others() {
    let _g = gpu_lock();
    let Some(_dev) = nccl_device("killed_rank_fails_the_others") else { return };
    fault("kill", 4, 20, true, &["all_reduce_sum", "rank"]);
}

#[test]
fn hung_rank_times_out() {
    let _g = gpu_lock();
    let Some(_dev) = nccl_device("hung_rank_times_out") else { return };
    fault("hang", 2, 8, false, &["all_reduce_sum", "did not complete within 8 s"]);
}

// ---- the child side ----

#[test]
#[ignore = "one rank of a multi-process test; started by the tests above"]
fn comm_child() {
    let Ok(spec) = std::env::var("K3_COMM_CHILD") else { return };
    let p: Vec<&str> = spec.splitn(4, ':').collect();
    let (mode, rank, world, dir) = (p[0], p[1].parse::<usize>().unwrap(), p[2].parse::<usize>().unwrap(), PathBuf::from(p[3]));
    if mode == "missing" {
        match nccl_unique_id() {
            Err(CoreError::CudaUnavailable(m)) if m.contains("libnccl.so.2") && m.contains("/nonexistent") => println!("error: {m}"),
            other => panic!("expected CudaUnavailable naming libnccl.so.2 and the path, got {other:?}"),
        }
        return;
    }
    let dev = CudaDevice::new(0).expect("device");
    let id = exchange_id(rank, &dir);
    let g = CudaGroup::nccl(&dev, rank, world, id).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    match mode {
        "parity" => parity(&dev, &g),
        "kill" | "hang" => {
            let x = CudaTensor::zeros(&dev, DType::F32, vec![1024]).unwrap();
            g.all_reduce_sum(&x).unwrap();
            g.barrier().unwrap();
            if rank == world - 1 {
                std::fs::write(dir.join("victim_ready"), b"").unwrap();
                std::thread::sleep(Duration::from_secs(600));
                return;
            }
            let t0 = Instant::now();
            for _ in 0..1_000_000 {
                let r = g.all_reduce_sum(&x).and_then(|_| g.wait("all_reduce_sum"));
                if let Err(e) = r {
                    eprintln!("rank {rank}: error after {:.1} s: {e}", t0.elapsed().as_secs_f64());
                    std::process::exit(3);
                }
            }
            panic!("rank {rank}: every all-reduce succeeded although a peer stopped");
        }
        m => panic!("unknown mode {m}"),
    }
}

/// The buffers of one parity round and what each must hold afterwards.
struct Case {
    ar: CudaTensor,
    ar_bf16: CudaTensor,
    ar_i32: CudaTensor,
    ag_in: CudaTensor,
    ag_out: CudaTensor,
    rs_in: CudaTensor,
    rs_out: CudaTensor,
    bc: CudaTensor,
    ring_in: CudaTensor,
    ring_out: CudaTensor,
    p2p: CudaTensor,
}

const N: usize = 4099;
const M: usize = 1031;
const RING: usize = 2053;

fn ar_val(r: usize, i: usize, k: usize) -> f32 {
    ((i * 7 + r * 3 + k) % 11) as f32 - 5.0
}
fn ag_val(r: usize, i: usize, k: usize) -> f32 {
    (r * 10000 + i + k) as f32
}
fn rs_val(r: usize, j: usize, k: usize) -> f32 {
    ((j + r + k) % 13) as f32
}
fn bc_val(r: usize, i: usize, k: usize) -> f32 {
    (r * 100 + (i + k) % 100) as f32
}
fn ring_val(r: usize, i: usize, k: usize) -> f32 {
    (r * 1000 + (i + k) % 1000) as f32
}

impl Case {
    fn new(dev: &CudaDevice, w: usize) -> Case {
        let t = |d, n| CudaTensor::zeros(dev, d, vec![n]).unwrap();
        Case {
            ar: t(DType::F32, N),
            ar_bf16: t(DType::BF16, N),
            ar_i32: t(DType::I32, N),
            ag_in: t(DType::F32, N),
            ag_out: t(DType::F32, w * N),
            rs_in: t(DType::F32, w * M),
            rs_out: t(DType::F32, M),
            bc: t(DType::F32, N),
            ring_in: t(DType::F32, RING),
            ring_out: t(DType::F32, RING),
            p2p: t(DType::F32, N),
        }
    }

    /// Fills this rank's inputs for round `k` and poisons the outputs.
    fn fill(&self, r: usize, w: usize, k: usize) {
        let f = |t: &CudaTensor, v: Vec<f32>| t.write_bytes(bytemuck::cast_slice(&v)).unwrap();
        f(&self.ar, (0..N).map(|i| ar_val(r, i, k)).collect());
        let b: Vec<bf16> = (0..N).map(|i| bf16::from_f32(ar_val(r, i, k))).collect();
        self.ar_bf16.write_bytes(bytemuck::cast_slice(&b)).unwrap();
        let ints: Vec<i32> = (0..N).map(|i| ar_val(r, i, k) as i32 * 1000 + i as i32).collect();
        self.ar_i32.write_bytes(bytemuck::cast_slice(&ints)).unwrap();
        f(&self.ag_in, (0..N).map(|i| ag_val(r, i, k)).collect());
        f(&self.rs_in, (0..w * M).map(|j| rs_val(r, j, k)).collect());
        f(&self.bc, (0..N).map(|i| bc_val(r, i, k)).collect());
        f(&self.ring_in, (0..RING).map(|i| ring_val(r, i, k)).collect());
        f(&self.p2p, (0..N).map(|i| if r == 0 { ag_val(0, i, k) } else { -1.0 }).collect());
        for t in [&self.ag_out, &self.rs_out, &self.ring_out] {
            t.fill_bytes(0xFF).unwrap();
        }
    }

    /// Every verb once (the ring in one group).
    fn run(&self, g: &CudaGroup) -> k3_core::Result<()> {
        let (r, w) = (g.rank(), g.world());
        g.all_reduce_sum(&self.ar)?;
        g.all_reduce_sum(&self.ar_bf16)?;
        g.all_reduce_sum(&self.ar_i32)?;
        g.all_gather(&self.ag_in, &self.ag_out)?;
        g.reduce_scatter(&self.rs_in, &self.rs_out)?;
        g.broadcast(w - 1, &self.bc)?;
        g.group(|g| {
            g.send((r + 1) % w, &self.ring_in)?;
            g.recv((r + w - 1) % w, &self.ring_out)
        })?;
        match r {
            0 => g.send(1, &self.p2p),
            1 => g.recv(0, &self.p2p),
            _ => Ok(()),
        }
    }

    /// Compares every output with the host's exact answer for round `k`.
    fn check(&self, r: usize, w: usize, k: usize, what: &str) {
        let got = |t: &CudaTensor| t.to_f32_vec().unwrap();
        let sum = |i: usize| (0..w).map(|q| ar_val(q, i, k)).sum::<f32>();
        let want: Vec<f32> = (0..N).map(sum).collect();
        assert_eq!(got(&self.ar), want, "{what}: all_reduce_sum f32");
        assert_eq!(got(&self.ar_bf16), want, "{what}: all_reduce_sum bf16");
        let ints: Vec<i32> = bytemuck::pod_collect_to_vec(&self.ar_i32.to_bytes().unwrap());
        let want_i: Vec<i32> = (0..N).map(|i| (0..w).map(|q| ar_val(q, i, k) as i32 * 1000 + i as i32).sum()).collect();
        assert_eq!(ints, want_i, "{what}: all_reduce_sum i32");
        let want: Vec<f32> = (0..w).flat_map(|q| (0..N).map(move |i| ag_val(q, i, k))).collect();
        assert_eq!(got(&self.ag_out), want, "{what}: all_gather");
        let want: Vec<f32> = (0..M).map(|j| (0..w).map(|q| rs_val(q, r * M + j, k)).sum()).collect();
        assert_eq!(got(&self.rs_out), want, "{what}: reduce_scatter");
        let want: Vec<f32> = (0..N).map(|i| bc_val(w - 1, i, k)).collect();
        assert_eq!(got(&self.bc), want, "{what}: broadcast");
        let want: Vec<f32> = (0..RING).map(|i| ring_val((r + w - 1) % w, i, k)).collect();
        assert_eq!(got(&self.ring_out), want, "{what}: ring send/recv");
        if r < 2 {
            let want: Vec<f32> = (0..N).map(|i| ag_val(0, i, k)).collect();
            assert_eq!(got(&self.p2p), want, "{what}: send 0 -> 1");
        }
    }
}

fn parity(dev: &CudaDevice, g: &CudaGroup) {
    let (r, w) = (g.rank(), g.world());
    let c = Case::new(dev, w);
    let t = Instant::now();
    for k in 0..2 {
        c.fill(r, w, k);
        c.run(g).unwrap();
        g.wait("parity eager").unwrap();
        c.check(r, w, k, &format!("rank {r}/{w} eager round {k}"));
    }
    let eager = t.elapsed().as_secs_f64();
    g.barrier().unwrap();
    let graph = capture(dev, || c.run(g)).expect("capture");
    let t = Instant::now();
    for k in 2..5 {
        c.fill(r, w, k);
        graph.launch().unwrap();
        g.wait("parity graph replay").unwrap();
        c.check(r, w, k, &format!("rank {r}/{w} graph replay round {k}"));
    }
    g.barrier().unwrap();
    println!("rank {r}/{w}: parity ok: 2 eager rounds ({eager:.2} s) and 3 graph replays ({:.2} s) of 9 verbs, exact", t.elapsed().as_secs_f64());
}
