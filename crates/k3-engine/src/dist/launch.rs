//! One process per rank (`docs/parallel.md`, "Launch"). [`World::start`] puts this process in
//! its place in a multi-process world and returns once every rank has checked in:
//!
//! - **Started by a launcher** (torchrun, Slurm, Kubernetes, or a node's first k3 process): the
//!   environment says which rank this is (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ... — read by
//!   `k3_core::comm::control::WorldSpec::from_env`).
//! - **Otherwise** this process is the first of its node (`--nnodes N --node-rank R
//!   --master-addr HOST:PORT`; one node by default) and starts the node's other ranks: the same
//!   binary with the same arguments and the environment unchanged, plus those variables. On a
//!   single node without `--master-addr` rank 0 listens on a free loopback port.
//!
//! Then the TCP rendezvous (`comm::control`): every rank sends a digest of the binary, the
//! layout, `config.json` and the checkpoint's shard headers, so ranks running different builds
//! or checkpoints refuse to start before any weight moves; rank 0 hands out its payload (the
//! NCCL ids of the world's communicators). The node's first process watches the ranks it
//! started: one that exits before the world has formed ends [`World::start`] at once with an
//! error naming it (it can never check in, so the rendezvous would otherwise wait out its
//! timeout); one that exits with an error later runs [`World::on_child_failure`] (which aborts
//! this process's communicators, so the others see their peers fail within the NCCL timeout),
//! and [`World::finish`] reports it by rank.

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use k3_core::comm::control::{self, node_specs, Control, WorldSpec};
use k3_model::{Checkpoint, Parallel};

use crate::error::{EngineError, Result};

/// How long the rendezvous waits for every rank (`K3_RENDEZVOUS_TIMEOUT_S`, default 300 s:
/// loading is after it, but a rank's binary may start slowly on a busy node).
pub fn rendezvous_timeout() -> Duration {
    let s = std::env::var("K3_RENDEZVOUS_TIMEOUT_S").ok().and_then(|v| v.trim().parse::<f64>().ok()).filter(|v| *v > 0.0).unwrap_or(300.0);
    Duration::from_secs_f64(s)
}

/// The node flags of a launch (`k3 ... --nnodes --node-rank --master-addr`).
#[derive(Clone, Debug)]
pub struct NodeArgs {
    pub nnodes: usize,
    pub node_rank: usize,
    /// `HOST:PORT` rank 0 listens on; needed with more than one node.
    pub master_addr: Option<String>,
}

impl Default for NodeArgs {
    fn default() -> Self {
        NodeArgs { nnodes: 1, node_rank: 0, master_addr: None }
    }
}

fn launch_err(msg: impl Into<String>) -> EngineError {
    EngineError::Launch(msg.into())
}

/// The ranks this process started, and the first failure among them (seen by a watcher thread).
struct Children {
    procs: Arc<Mutex<Vec<(usize, Child)>>>,
    failed: Arc<Mutex<Option<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// The watcher thread: joined before [`Children::wait`] returns, so what its callback holds
    /// (a rank's NCCL communicators) is released before the process goes on to exit.
    watcher: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Children {
    fn none() -> Children {
        Children { procs: Arc::default(), failed: Arc::default(), stop: Arc::default(), watcher: Mutex::new(None) }
    }

    /// Starts rank `spec.rank` as a copy of this process.
    fn spawn(&self, spec: &WorldSpec) -> Result<()> {
        let exe = std::env::current_exe().map_err(|e| launch_err(format!("finding this binary to start rank {}: {e}", spec.rank)))?;
        let (host, port) = spec.master.rsplit_once(':').unwrap_or((&spec.master, ""));
        let child = Command::new(&exe)
            .args(std::env::args_os().skip(1))
            .env("RANK", spec.rank.to_string())
            .env("WORLD_SIZE", spec.world.to_string())
            .env("LOCAL_RANK", spec.local_rank.to_string())
            .env("LOCAL_WORLD_SIZE", spec.local_world.to_string())
            .env("MASTER_ADDR", host.trim_start_matches('[').trim_end_matches(']'))
            .env("MASTER_PORT", port)
            .spawn()
            .map_err(|e| launch_err(format!("starting rank {} ({}): {e}", spec.rank, exe.display())))?;
        self.procs.lock().unwrap_or_else(|p| p.into_inner()).push((spec.rank, child));
        Ok(())
    }

    /// The first of these ranks that has exited (successfully or not), as `rank R exited with
    /// STATUS`.
    fn exited(&self) -> Option<String> {
        let mut procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        procs.iter_mut().find_map(|(rank, c)| match c.try_wait() {
            Ok(Some(st)) => Some(format!("rank {rank} exited with {st}")),
            Ok(None) => None,
            Err(e) => Some(format!("rank {rank}: checking on it failed: {e}")),
        })
    }

    /// Runs the rendezvous `run` on a thread while watching these ranks: one that exits before
    /// it ends can never check in, so that ends the wait at once with an error naming it. (A
    /// rank may also finish quickly right after its go; the rendezvous result is due then and
    /// wins if it comes within a second. A rendezvous thread left behind ends by its own
    /// timeout.)
    fn rendezvous(&self, run: impl FnOnce() -> k3_core::Result<Control> + Send + 'static) -> Result<Control> {
        let comm = |e: k3_core::CoreError| launch_err(e.to_string());
        if self.procs.lock().unwrap_or_else(|p| p.into_inner()).is_empty() {
            return run().map_err(comm);
        }
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("k3-rendezvous".into())
            .spawn(move || {
                let _ = tx.send(run());
            })
            .map_err(|e| launch_err(format!("starting the rendezvous thread: {e}")))?;
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => return r.map_err(comm),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(launch_err("the rendezvous thread panicked")),
            }
            if let Some(why) = self.exited() {
                return match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(Ok(c)) => Ok(c),
                    Ok(Err(e)) => Err(launch_err(format!("{e} ({why})"))),
                    Err(_) => Err(launch_err(format!("{why} before every rank had checked in: the world cannot form without it (its own output says why)"))),
                };
            }
        }
    }

    /// Polls the children every 100 ms; the first one to exit with an error is recorded and
    /// `on_fail` runs (it aborts this rank's communicators so it stops waiting for that peer).
    fn watch(&self, on_fail: impl Fn(&str) + Send + 'static) {
        let (procs, failed, stop) = (self.procs.clone(), self.failed.clone(), self.stop.clone());
        let h = std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut why = None;
                for (rank, c) in procs.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
                    if let Ok(Some(st)) = c.try_wait() {
                        if !st.success() {
                            why = Some(format!("rank {rank} exited with {st}"));
                        }
                    }
                }
                if let Some(w) = why {
                    failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(w.clone());
                    on_fail(&w);
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        *self.watcher.lock().unwrap_or_else(|p| p.into_inner()) = Some(h);
    }

    /// Stops the watcher and waits for its thread (at most one poll interval).
    fn stop_watching(&self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.watcher.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// Waits (up to `limit`) for every child; the first failure names its rank. Children still
    /// running after `limit` are killed.
    fn wait(&self, limit: Duration) -> Result<()> {
        self.stop_watching();
        let t0 = Instant::now();
        let mut procs = std::mem::take(&mut *self.procs.lock().unwrap_or_else(|p| p.into_inner()));
        let mut first: Option<String> = self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (rank, c) in procs.iter_mut() {
            loop {
                match c.try_wait() {
                    Ok(Some(st)) => {
                        if !st.success() {
                            first.get_or_insert(format!("rank {rank} exited with {st}"));
                        }
                        break;
                    }
                    Ok(None) if t0.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
                    Ok(None) => {
                        let _ = c.kill();
                        let _ = c.wait();
                        first.get_or_insert(format!("rank {rank} was still running {:.0} s after this rank finished, and was killed", limit.as_secs_f64()));
                        break;
                    }
                    Err(e) => {
                        first.get_or_insert(format!("rank {rank}: waiting for it failed: {e}"));
                        break;
                    }
                }
            }
        }
        match first {
            Some(w) => Err(launch_err(w)),
            None => Ok(()),
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        self.stop_watching();
        for (_, c) in self.procs.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// This process's place in a started world.
pub struct World {
    pub spec: WorldSpec,
    pub par: Parallel,
    /// The control plane to rank 0 (or, on rank 0, to every rank).
    pub control: Control,
    children: Children,
}

/// The digest every rank must agree on: this binary, the layout, `config.json` and each
/// shard's name, size and safetensors header (not the tensor bytes: reading 1.5 TB to start
/// would take minutes).
pub fn world_digest(ck: &Checkpoint, par: Parallel) -> Result<String> {
    let exe = std::env::current_exe().and_then(std::fs::read).map_err(|e| launch_err(format!("reading this binary for the rendezvous digest: {e}")))?;
    let layout = format!("tp={} ep={} pp={}", par.tp, par.ep, par.pp);
    let config = std::fs::read(ck.dir.join("config.json")).map_err(|e| launch_err(format!("reading {}: {e}", ck.dir.join("config.json").display())))?;
    let mut shards = Vec::new();
    for f in &ck.files {
        shards.extend_from_slice(f.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        shards.extend_from_slice(&safetensors_header(f)?);
    }
    Ok(control::digest(&[&exe, layout.as_bytes(), &config, &shards]))
}

/// A shard's size and header bytes (length prefix and JSON).
fn safetensors_header(path: &Path) -> Result<Vec<u8>> {
    let bad = |e: String| launch_err(format!("reading the header of {}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let size = f.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len).map_err(|e| bad(e.to_string()))?;
    let n = u64::from_le_bytes(len);
    if n > size.saturating_sub(8) || n > 1 << 30 {
        return Err(bad(format!("header length {n} does not fit the file of {size} bytes")));
    }
    let mut out = size.to_le_bytes().to_vec();
    out.extend_from_slice(&len);
    let mut hdr = vec![0u8; n as usize];
    f.read_exact(&mut hdr).map_err(|e| bad(e.to_string()))?;
    out.extend(hdr);
    Ok(out)
}

impl World {
    /// Joins (or starts) the world of `par` (see the module docs). `payload` runs on rank 0
    /// only, before the rendezvous answers, and its bytes reach every rank
    /// ([`World::payload`]). `lookup` reads the environment (`|k| std::env::var(k).ok()`).
    pub fn start(
        par: Parallel,
        node: &NodeArgs,
        digest: &str,
        lookup: impl Fn(&str) -> Option<String>,
        payload: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<World> {
        let n = par.world();
        let timeout = rendezvous_timeout();
        if let Some(spec) = WorldSpec::from_env(&lookup).map_err(|e| launch_err(e.to_string()))? {
            if spec.world != n {
                return Err(launch_err(format!(
                    "the launcher started {} processes (WORLD_SIZE={}) but --tp {} --ep {} --pp {} needs {n}: start {n}, or change the layout",
                    spec.world, spec.world, par.tp, par.ep, par.pp
                )));
            }
            let p = if spec.is_leader() { Some(payload()?) } else { None };
            let control = control::rendezvous(&spec, digest, p, timeout).map_err(|e| launch_err(e.to_string()))?;
            return Ok(World { spec, par, control, children: Children::none() });
        }
        if node.nnodes == 0 || !n.is_multiple_of(node.nnodes) {
            return Err(launch_err(format!("--nnodes {}: the layout's {n} ranks must split evenly over the nodes", node.nnodes)));
        }
        let ppn = n / node.nnodes;
        let (listener, master) = match (&node.master_addr, node.nnodes, node.node_rank) {
            (None, 1, _) => {
                let l = TcpListener::bind("127.0.0.1:0").map_err(|e| launch_err(format!("listening on a loopback port for the local ranks: {e}")))?;
                let a = l.local_addr().map_err(|e| launch_err(e.to_string()))?;
                (Some(l), a.to_string())
            }
            (None, _, _) => {
                return Err(launch_err(format!(
                    "--nnodes {} needs --master-addr HOST:PORT (rank 0's node and a free port, the same on every node)",
                    node.nnodes
                )))
            }
            (Some(m), _, 0) => {
                let l = TcpListener::bind(m)
                    .map_err(|e| launch_err(format!("--master-addr {m}: rank 0 cannot listen there: {e} (give an address of this node and a free port)")))?;
                (Some(l), m.clone())
            }
            (Some(m), _, _) => (None, m.clone()),
        };
        let specs = node_specs(node.nnodes, node.node_rank, ppn, &master).map_err(|e| launch_err(e.to_string()))?;
        let children = Children::none();
        for s in &specs[1..] {
            children.spawn(s)?;
        }
        let spec = specs[0].clone();
        let opts = control::Options::new(timeout);
        let (s, d) = (spec.clone(), digest.to_string());
        let control = match listener {
            Some(l) => {
                let p = payload()?;
                children.rendezvous(move || control::lead(l, &s, &d, Some(p), &opts))?
            }
            None => children.rendezvous(move || control::rendezvous_with(&s, &d, None, &opts))?,
        };
        Ok(World { spec, par, control, children })
    }

    pub fn rank(&self) -> usize {
        self.spec.rank
    }

    /// Rank 0's payload, as every rank received it.
    pub fn payload(&self) -> &[u8] {
        self.control.payload().unwrap_or_default()
    }

    /// Runs `on_fail` (with the reason) when a rank this process started exits with an error.
    pub fn on_child_failure(&self, on_fail: impl Fn(&str) + Send + 'static) {
        self.children.watch(on_fail);
    }

    /// The end of a run: rank 0 tells the workers to stop, and the node's first process waits
    /// for the ranks it started (up to `limit`). Any failure names its rank.
    pub fn finish(self, limit: Duration) -> Result<()> {
        if self.control.is_leader() {
            let _ = self.control.shutdown();
        }
        self.children.wait(limit)
    }
}

/// The NCCL ids rank 0 hands out for a GPU world of `par` (feature `cuda`): one per
/// communicator of `k3_model::parallel::CudaGroups::nccl`, concatenated.
#[cfg(feature = "cuda")]
pub fn nccl_ids(par: Parallel) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for _ in 0..k3_model::parallel::CudaGroups::ids_needed(par) {
        out.extend_from_slice(&k3_core::comm::nccl::nccl_unique_id().map_err(k3_model::ModelError::from)?);
    }
    Ok(out)
}

/// This rank's GPU model (feature `cuda`) on GPU `ordinal + LOCAL_RANK`: joins the
/// communicators with the ids in the world's payload, uploads only this rank's shards, and
/// has a rank this process started that exits with an error abort them. Errors name the rank
/// (and the GPU it could not open).
#[cfg(feature = "cuda")]
pub fn load_gpu_rank(
    world: &World,
    ck: &Checkpoint,
    ordinal: usize,
    cache: k3_model::cuda::CacheConfig,
    precision: k3_model::cuda::Precision,
    report: Option<&k3_model::source::LoadReport<'_>>,
) -> Result<k3_model::cuda::CudaModel> {
    use k3_model::parallel::CudaGroups;
    let (rank, local) = (world.rank(), world.spec.local_rank);
    let gpu = ordinal + local;
    let dev = k3_core::cuda::CudaDevice::new(gpu).map_err(|e| EngineError::Rank {
        rank,
        msg: format!("runs on GPU {gpu} (local rank {local}) and cannot open it: {e}; give this node one GPU per local rank, or start one process per node"),
    })?;
    let loaded = (|| -> Result<k3_model::cuda::CudaModel> {
        let ids: Vec<[u8; 128]> = world.payload().chunks_exact(128).map(|c| c.try_into().expect("128 bytes")).collect();
        let plan = world.par.plans(&ck.config)?.swap_remove(rank);
        let groups = CudaGroups::nccl(&dev, &plan, &ids)?;
        Ok(k3_model::cuda::CudaModel::load_rank_reporting(ck, &dev, plan, groups, cache, precision, report, &Default::default())?)
    })();
    let m = loaded.map_err(|e| EngineError::Rank { rank, msg: format!("loading its shards: {e}") })?;
    let groups = m.groups.clone();
    world.on_child_failure(move |why| groups.abort(why));
    Ok(m)
}
