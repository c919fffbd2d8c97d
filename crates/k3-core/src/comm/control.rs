//! The control plane: the TCP rendezvous that starts a multi-process world, and the byte
//! channel rank 0 drives it with afterwards. Plain `std::net`, blocking sockets, no runtime.
//!
//! A star, never a mesh: rank 0 (the leader) listens on [`WorldSpec::master`]; every other
//! rank (a worker) connects to it, retrying until the rendezvous timeout because rank 0 may
//! start later, and says hello. Rank 0 checks the hellos (no rank twice, the same world size,
//! the same protocol version, the same digest of binary + config + checkpoint), then answers
//! every worker with a go that carries rank 0's payload (the 128-byte NCCL id). After that the
//! leader [`Control::broadcast`]s one frame per step, workers [`Control::recv`] it and answer
//! with [`Control::send_to_leader`], which the leader reads with [`Control::recv_from`] or
//! [`Control::gather`]. [`Control::shutdown`] sends a stop, on which `recv` returns `None`.
//!
//! Wire format. Every message is one frame, `kind: u8 | seq: u64 LE | len: u32 LE | body`,
//! with `len` at most [`Options::max_frame`]. Kinds: 1 hello (body `"K3RSCTL\0" | version u32 |
//! rank u32 | world u32 | digest`, utf-8), 2 go (`0`, or `1 | payload`), 3 reject (utf-8
//! reason), 4 data, 5 ping, 6 stop, 7 abort (utf-8 reason). Integers are little-endian. `seq`
//! numbers a direction's data, stop and abort frames from 0 (errors call it "frame N"); a ping
//! carries the next number without using it. Hello, go and reject only occur in the rendezvous.
//!
//! Nothing waits forever: every read and write has [`Options::io_timeout`], and while the
//! leader is idle it pings each worker every [`Options::heartbeat`], so a worker's wait for the
//! next step is bounded too. A closed connection, a timeout, a bad frame or a peer's abort
//! becomes [`CoreError::Comm`] naming the peer's rank and the frame number. World 1 needs no
//! sockets: [`rendezvous`] returns at once and `broadcast`/`gather` have no one to talk to.

mod link;
mod spec;

pub use spec::{node_specs, WorldSpec, DEFAULT_PORT};

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{CoreError, Result};
use link::{io_why, read_frame, write_frame, Link, ABORT, DATA, GO, HELLO, REJECT, STOP};

/// Bumped whenever the frame layout or the hello changes; ranks of different versions refuse
/// each other in the rendezvous.
pub const PROTOCOL_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"K3RSCTL\0";
const MAX_DIGEST: usize = 256;

/// Time limits and the frame size limit of a [`Control`].
#[derive(Clone, Debug)]
pub struct Options {
    /// How long the rendezvous waits for every rank (and a worker for rank 0's socket).
    pub timeout: Duration,
    /// The longest any one read or write may block: a leader waiting on a reply, a worker
    /// waiting for the next frame (the leader's pings keep an idle link under it).
    pub io_timeout: Duration,
    /// How often an idle leader pings each worker; `None` sends no pings (then a worker's
    /// [`Control::recv`] fails after `io_timeout` of leader silence). An idle link can go up
    /// to two heartbeats without a ping, so keep the workers' `io_timeout` well above that.
    pub heartbeat: Option<Duration>,
    /// The largest frame body either side sends or accepts, in bytes (at most `u32::MAX`).
    pub max_frame: usize,
}

impl Options {
    /// Defaults, with a rendezvous timeout of `timeout`: I/O 120 s, heartbeat 2 s, 256 MiB.
    pub fn new(timeout: Duration) -> Options {
        Options { timeout, io_timeout: Duration::from_secs(120), heartbeat: Some(Duration::from_secs(2)), max_frame: 256 << 20 }
    }
}

impl Default for Options {
    fn default() -> Options {
        Options::new(Duration::from_secs(300))
    }
}

/// The hex SHA-256 of `parts`, each prefixed by its length (so `["ab", "c"]` and `["a", "bc"]`
/// differ). Callers pass the binary version, the config and the checkpoint's identity.
pub fn digest(parts: &[&[u8]]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Starts this process's part of the world in `spec` with [`Options::new`]`(timeout)`; see
/// [`rendezvous_with`].
pub fn rendezvous(spec: &WorldSpec, digest: &str, payload: Option<Vec<u8>>, timeout: Duration) -> Result<Control> {
    rendezvous_with(spec, digest, payload, &Options::new(timeout))
}

/// Rank 0 binds `spec.master` and runs [`lead`]; every other rank connects to it and waits
/// for the go. `payload` is rank 0's to hand out (workers pass `None` and read theirs from
/// [`Control::payload`]). Every rank must pass the same `digest`. World 1 returns at once.
pub fn rendezvous_with(spec: &WorldSpec, digest: &str, payload: Option<Vec<u8>>, opts: &Options) -> Result<Control> {
    if spec.world == 1 {
        return Ok(Control::new(0, 1, payload, opts, Vec::new()));
    }
    if spec.rank != 0 {
        return join(spec, digest, opts);
    }
    let listener = TcpListener::bind(&spec.master)
        .map_err(|e| comm(format!("rank 0 cannot listen on {}: {e} (the port must be free and the host an address of rank 0's node)", spec.master)))?;
    lead(listener, spec, digest, payload, opts)
}

/// Rank 0's rendezvous on a listener the caller bound (a launcher that binds port 0, then
/// passes the real port to the workers it starts): accepts a hello from each of ranks
/// `1..world`, checks them, sends each the go with `payload`.
pub fn lead(listener: TcpListener, spec: &WorldSpec, digest: &str, payload: Option<Vec<u8>>, opts: &Options) -> Result<Control> {
    if spec.rank != 0 {
        return Err(comm(format!("lead is rank 0's; this process is rank {}", spec.rank)));
    }
    check_digest(digest)?;
    if payload.as_ref().is_some_and(|p| p.len() + 1 > opts.max_frame) {
        return Err(comm(format!("the payload does not fit in a {}-byte frame", opts.max_frame)));
    }
    let world = spec.world;
    let deadline = Instant::now() + opts.timeout;
    listener.set_nonblocking(true).map_err(|e| comm(format!("rank 0 listener: {e}")))?;
    let mut peers: Vec<Option<(TcpStream, SocketAddr)>> = (0..world).map(|_| None).collect();
    let mut arrived = 1;
    while arrived < world {
        let (mut s, addr) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
                    let msg = format!(
                        "timed out after {:?} at {}: rank(s) {missing:?} of {world} never arrived \
                         (were they started, with the same master address, and can they reach this port?)",
                        opts.timeout, spec.master
                    );
                    return Err(reject_all(&mut peers, msg));
                }
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(reject_all(&mut peers, format!("rank 0 accept on {}: {e}", spec.master))),
        };
        let left = deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(50), Duration::from_secs(5));
        if s.set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(Some(left)))
            .and_then(|_| s.set_write_timeout(Some(left)))
            .and_then(|_| s.set_nodelay(true))
            .is_err()
        {
            continue;
        }
        let hello = match read_frame(&mut s, MAX_DIGEST + 20) {
            Ok((HELLO, _, body)) if body.starts_with(MAGIC) => body,
            // Not one of ours (a port scan, a stray client): drop it and keep waiting.
            _ => continue,
        };
        let why = match parse_hello(&hello) {
            None => Some(format!("a malformed hello from {addr}")),
            Some((version, ..)) if version != PROTOCOL_VERSION => {
                Some(format!("the process at {addr} speaks control protocol v{version}, rank 0 v{PROTOCOL_VERSION}: run the same k3 build everywhere"))
            }
            Some((_, rank, w, _)) if w != world => {
                Some(format!("rank {rank} (at {addr}) was started with a world of {w}, rank 0 with {world}: give every rank the same world size"))
            }
            Some((_, rank, ..)) if rank == 0 || rank >= world => {
                Some(format!("the process at {addr} says it is rank {rank}, but rank 0 expects ranks 1..{world}"))
            }
            Some((_, rank, ..)) if peers[rank].is_some() => Some(format!(
                "rank {rank} connected twice (from {} and {addr}): two processes were given the same rank",
                peers[rank].as_ref().map_or(String::new(), |p| p.1.to_string())
            )),
            Some((_, rank, _, d)) if d != digest => {
                Some(format!("rank {rank} (at {addr}) has digest {d} but rank 0 has {digest}: binary, config or checkpoint differ between the ranks"))
            }
            Some(_) => None,
        };
        if let Some(why) = why {
            let _ = write_frame(&mut s, REJECT, 0, why.as_bytes());
            return Err(reject_all(&mut peers, why));
        }
        let rank = parse_hello(&hello).map_or(0, |h| h.1);
        peers[rank] = Some((s, addr));
        arrived += 1;
    }
    let mut go = vec![u8::from(payload.is_some())];
    go.extend_from_slice(payload.as_deref().unwrap_or_default());
    let mut links = Vec::with_capacity(world - 1);
    for (rank, p) in peers.iter_mut().enumerate().skip(1) {
        let (s, _) = p.as_mut().expect("every rank arrived");
        if let Err(e) = write_frame(s, GO, 0, &go) {
            let msg = format!("rank {rank}: could not send the go: {}", io_why(&e, opts.io_timeout));
            return Err(reject_all(&mut peers, msg));
        }
    }
    for (rank, p) in peers.into_iter().enumerate().skip(1) {
        let (s, _) = p.expect("every rank arrived");
        links.push(Link::new(0, rank, s, opts)?);
    }
    Ok(Control::new(0, world, payload, opts, links))
}

/// A worker's rendezvous: connect (retrying), hello, wait for go or reject.
fn join(spec: &WorldSpec, digest: &str, opts: &Options) -> Result<Control> {
    check_digest(digest)?;
    let (rank, master) = (spec.rank, &spec.master);
    let deadline = Instant::now() + opts.timeout;
    let mut s = loop {
        let last = match connect_once(master, deadline) {
            Ok(s) => break s,
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(comm(format!(
                "rank {rank} could not reach rank 0 at {master} within {:?} ({last}): is rank 0 running, and is {master} its address?",
                opts.timeout
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut hello = MAGIC.to_vec();
    for v in [PROTOCOL_VERSION, rank as u32, spec.world as u32] {
        hello.extend_from_slice(&v.to_le_bytes());
    }
    hello.extend_from_slice(digest.as_bytes());
    // Rank 0 answers by its own deadline, which is at most `timeout` after we connected.
    let setup = s
        .set_nodelay(true)
        .and_then(|_| s.set_write_timeout(Some(opts.io_timeout)))
        .and_then(|_| s.set_read_timeout(Some(opts.timeout + Duration::from_secs(1))));
    if let Err(e) = setup.and_then(|_| write_frame(&mut s, HELLO, 0, &hello)) {
        return Err(comm(format!("rank {rank} could not say hello to rank 0 at {master}: {}", io_why(&e, opts.io_timeout))));
    }
    match read_frame(&mut s, opts.max_frame) {
        Ok((GO, _, body)) if !body.is_empty() => {
            let payload = (body[0] == 1).then(|| body[1..].to_vec());
            let link = Link::new(rank, 0, s, opts)?;
            Ok(Control::new(rank, spec.world, payload, opts, vec![link]))
        }
        Ok((REJECT, _, why)) => Err(comm(format!("rank 0 refused rank {rank}: {}", String::from_utf8_lossy(&why)))),
        Ok((kind, ..)) => Err(comm(format!("rank {rank}: rank 0 at {master} sent frame kind {kind} instead of the go"))),
        Err(e) => Err(comm(format!("rank {rank}: no go from rank 0 at {master}: {}", e.why(opts.timeout)))),
    }
}

/// The started world, from one rank's side. Rank 0 holds a link to every worker; a worker
/// holds its link to rank 0. Methods take `&self` (each link locks its own halves), so a
/// leader can broadcast from one thread while its heartbeat pings from another.
pub struct Control {
    rank: usize,
    world: usize,
    payload: Option<Vec<u8>>,
    opts: Options,
    /// Leader: ranks 1..world in order. Worker: one link, to rank 0.
    links: Vec<Arc<Link>>,
    /// Leader: shut down or aborted. Worker: got the stop.
    done: AtomicBool,
    /// Dropping it stops the heartbeat thread.
    beat: Mutex<Option<mpsc::Sender<()>>>,
}

impl Control {
    fn new(rank: usize, world: usize, payload: Option<Vec<u8>>, opts: &Options, links: Vec<Link>) -> Control {
        let links: Vec<Arc<Link>> = links.into_iter().map(Arc::new).collect();
        let beat = match opts.heartbeat {
            Some(every) if rank == 0 && !links.is_empty() => {
                let (tx, rx) = mpsc::channel::<()>();
                let links = links.clone();
                let spawned = std::thread::Builder::new().name("k3-control-ping".into()).spawn(move || {
                    while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
                        for l in &links {
                            l.ping_if_idle(every);
                        }
                    }
                });
                spawned.ok().map(|_| tx)
            }
            _ => None,
        };
        Control { rank, world, payload, opts: opts.clone(), links, done: AtomicBool::new(false), beat: Mutex::new(beat) }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks in the world.
    pub fn world(&self) -> usize {
        self.world
    }
    /// True on rank 0.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
    /// Rank 0's rendezvous payload (the NCCL id), the same bytes on every rank.
    pub fn payload(&self) -> Option<&[u8]> {
        self.payload.as_deref()
    }
    /// The options this control runs under.
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// Leader: sends `bytes` as one frame to every worker, in rank order.
    pub fn broadcast(&self, bytes: &[u8]) -> Result<()> {
        self.leader_only("broadcast")?;
        self.check_size("broadcast", bytes.len())?;
        for l in &self.links {
            l.send(DATA, bytes, &self.opts).map_err(|m| op("broadcast", m))?;
        }
        Ok(())
    }

    /// Leader: the next frame worker `rank` sent with [`Control::send_to_leader`].
    pub fn recv_from(&self, rank: usize) -> Result<Vec<u8>> {
        self.leader_only("recv_from")?;
        if rank == 0 || rank >= self.world {
            return Err(op("recv_from", format!("no worker rank {rank}: workers are 1..{}", self.world)));
        }
        let link = &self.links[rank - 1];
        match link.recv(&self.opts).map_err(|m| op("recv_from", m))? {
            (DATA, _, body) => Ok(body),
            (kind, n, _) => Err(op("recv_from", format!("rank {rank}: unexpected frame kind {kind} as frame {n}"))),
        }
    }

    /// Leader: the first worker (rank, why) whose process is gone or that aborted, seen
    /// without consuming a frame (a peek; links a `recv` holds are skipped). A leader blocked
    /// in a step's collectives calls it from a monitor thread, so a worker that died mid-step
    /// stops the step at once instead of at the collective's timeout.
    pub fn dead_worker(&self) -> Option<(usize, String)> {
        if !self.is_leader() {
            return None;
        }
        self.links.iter().enumerate().find_map(|(i, l)| l.gone(self.opts.io_timeout).map(|why| (i + 1, why)))
    }

    /// Leader: the next frame of every worker, ranks `1..world` in order (entry `i` is rank
    /// `i + 1`'s). Fails at the first worker that is dead, silent past the I/O timeout, or
    /// aborted.
    pub fn gather(&self) -> Result<Vec<Vec<u8>>> {
        self.leader_only("gather")?;
        (1..self.world).map(|r| self.recv_from(r).map_err(|e| rename(e, "gather"))).collect()
    }

    /// Worker: the leader's next frame, or `None` once the leader has shut the world down.
    /// Pings are skipped. Fails when rank 0's connection closes, it stays silent past the I/O
    /// timeout, or it aborts.
    pub fn recv(&self) -> Result<Option<Vec<u8>>> {
        self.worker_only("recv")?;
        if self.done.load(Ordering::Acquire) {
            return Ok(None);
        }
        match self.links[0].recv(&self.opts).map_err(|m| op("recv", m))? {
            (DATA, _, body) => Ok(Some(body)),
            (STOP, ..) => {
                self.done.store(true, Ordering::Release);
                Ok(None)
            }
            (kind, n, _) => Err(op("recv", format!("rank 0: unexpected frame kind {kind} as frame {n}"))),
        }
    }

    /// Worker: sends `bytes` (an ack, an error, a small result) as one frame to rank 0.
    pub fn send_to_leader(&self, bytes: &[u8]) -> Result<()> {
        self.worker_only("send_to_leader")?;
        self.check_size("send_to_leader", bytes.len())?;
        self.links[0].send(DATA, bytes, &self.opts).map_err(|m| op("send_to_leader", m))
    }

    /// Leader: sends every worker the stop frame (their `recv` returns `None`) and ends the
    /// heartbeat; later calls fail. A worker's shutdown does nothing. Tries every worker and
    /// returns the first failure.
    pub fn shutdown(&self) -> Result<()> {
        if !self.is_leader() || self.done.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.stop_heartbeat();
        self.send_all(STOP, b"").map_err(|m| op("shutdown", m))
    }

    /// Tells the peers this rank failed, with `why`: the leader makes every worker's `recv`
    /// fail, a worker makes the leader's next `recv_from` of it fail. Best effort, never blocks
    /// past the I/O timeout.
    pub fn abort(&self, why: &str) {
        let why = &why.as_bytes()[..why.len().min(self.opts.max_frame)];
        if self.is_leader() {
            if !self.done.swap(true, Ordering::AcqRel) {
                self.stop_heartbeat();
                let _ = self.send_all(ABORT, why);
            }
        } else if let Some(l) = self.links.first() {
            let _ = l.send(ABORT, why, &self.opts);
        }
    }

    fn send_all(&self, kind: u8, body: &[u8]) -> std::result::Result<(), String> {
        let mut first = Ok(());
        for l in &self.links {
            if let Err(m) = l.send(kind, body, &self.opts) {
                first = first.and(Err(m));
            }
        }
        first
    }

    fn stop_heartbeat(&self) {
        self.beat.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn leader_only(&self, name: &'static str) -> Result<()> {
        if !self.is_leader() {
            return Err(op(name, format!("{name} is rank 0's; this is rank {}", self.rank)));
        }
        if self.done.load(Ordering::Acquire) {
            return Err(op(name, "the world was already shut down or aborted".into()));
        }
        Ok(())
    }

    fn worker_only(&self, name: &'static str) -> Result<()> {
        if self.is_leader() {
            return Err(op(name, format!("{name} is a worker's; this is rank 0")));
        }
        Ok(())
    }

    fn check_size(&self, name: &'static str, len: usize) -> Result<()> {
        if len > self.opts.max_frame {
            return Err(op(name, format!("a {len}-byte frame exceeds the {}-byte limit (Options::max_frame)", self.opts.max_frame)));
        }
        Ok(())
    }
}

impl Drop for Control {
    /// Ends the heartbeat and half-closes every link, so peers see the end of the stream at
    /// once (after any frames already sent) instead of waiting out a timeout.
    fn drop(&mut self) {
        self.stop_heartbeat();
        for l in &self.links {
            l.close();
        }
    }
}

/// `(version, rank, world, digest)` of a hello body (magic already checked).
fn parse_hello(b: &[u8]) -> Option<(u32, usize, usize, &str)> {
    let word = |i: usize| Some(u32::from_le_bytes(b.get(8 + 4 * i..12 + 4 * i)?.try_into().ok()?));
    let digest = std::str::from_utf8(b.get(20..)?).ok()?;
    Some((word(0)?, word(1)? as usize, word(2)? as usize, digest))
}

fn connect_once(master: &str, deadline: Instant) -> std::result::Result<TcpStream, String> {
    let addrs = master.to_socket_addrs().map_err(|e| format!("cannot resolve {master}: {e}"))?;
    let mut last = format!("{master} resolves to no address");
    for a in addrs {
        let wait = deadline.saturating_duration_since(Instant::now()).clamp(Duration::from_millis(10), Duration::from_secs(2));
        match TcpStream::connect_timeout(&a, wait) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("last error: {e}"),
        }
    }
    Err(last)
}

/// Sends `msg` as a reject to every rank that already arrived; returns it as the error.
fn reject_all(peers: &mut [Option<(TcpStream, SocketAddr)>], msg: String) -> CoreError {
    for (s, _) in peers.iter_mut().flatten() {
        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = write_frame(s, REJECT, 0, msg.as_bytes());
    }
    comm(msg)
}

fn check_digest(digest: &str) -> Result<()> {
    if digest.len() > MAX_DIGEST {
        return Err(comm(format!("a {}-byte digest is over the {MAX_DIGEST}-byte limit: pass control::digest(..)", digest.len())));
    }
    Ok(())
}

fn comm(msg: String) -> CoreError {
    op("rendezvous", msg)
}

fn op(op: &'static str, msg: String) -> CoreError {
    CoreError::Comm { op, msg }
}

fn rename(e: CoreError, name: &'static str) -> CoreError {
    match e {
        CoreError::Comm { msg, .. } => CoreError::Comm { op: name, msg },
        e => e,
    }
}
