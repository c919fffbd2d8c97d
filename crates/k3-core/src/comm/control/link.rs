//! One control-plane connection ([`Link`]) and the frame format on it: `kind: u8 | seq: u64 LE
//! | len: u32 LE | body`. The module doc of [`super`] lists the kinds and what each carries.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Options;
use crate::{CoreError, Result};

const HEADER: usize = 13;
pub(super) const HELLO: u8 = 1;
pub(super) const GO: u8 = 2;
pub(super) const REJECT: u8 = 3;
pub(super) const DATA: u8 = 4;
pub(super) const PING: u8 = 5;
pub(super) const STOP: u8 = 6;
pub(super) const ABORT: u8 = 7;

/// One TCP connection between `me` and `peer`, its halves locked separately.
pub(super) struct Link {
    me: usize,
    peer: usize,
    tx: Mutex<Half>,
    rx: Mutex<Half>,
    sock: TcpStream,
}

struct Half {
    s: TcpStream,
    /// Frames sent or received so far (data, stop, abort): the next frame's number.
    frames: u64,
    last: Instant,
}

impl Link {
    pub(super) fn new(me: usize, peer: usize, s: TcpStream, opts: &Options) -> Result<Link> {
        let setup = || -> io::Result<Link> {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(opts.io_timeout))?;
            s.set_write_timeout(Some(opts.io_timeout))?;
            let half = |s| Half { s, frames: 0, last: Instant::now() };
            Ok(Link { me, peer, tx: Mutex::new(half(s.try_clone()?)), rx: Mutex::new(half(s.try_clone()?)), sock: s.try_clone()? })
        };
        setup().map_err(|e| CoreError::Comm { op: "rendezvous", msg: format!("rank {me}: setting up the link to rank {peer}: {e}") })
    }

    /// A ping, if nothing went out for `every` and no send is in progress (a busy link is not
    /// idle, and the heartbeat must never wait behind a broadcast).
    pub(super) fn ping_if_idle(&self, every: Duration) {
        if let Ok(mut h) = self.tx.try_lock() {
            if h.last.elapsed() >= every {
                let seq = h.frames;
                let _ = write_frame(&mut h.s, PING, seq, &[]);
                h.last = Instant::now();
            }
        }
    }

    /// Whether the peer is gone, without consuming anything: its end of the stream or a reset
    /// is waiting (a process that died), or its next frame is an abort. `None` when the link
    /// looks alive, or a `recv` holds it (that `recv` will see the same thing).
    pub(super) fn gone(&self, io_timeout: Duration) -> Option<String> {
        let h = self.rx.try_lock().ok()?;
        let mut head = [0u8; 1];
        // SO_RCVTIMEO is the socket's (shared by the halves): only a receiver changes it, and
        // the lock held keeps the others out.
        h.s.set_read_timeout(Some(Duration::from_millis(1))).ok()?;
        let r = h.s.peek(&mut head);
        let _ = h.s.set_read_timeout(Some(io_timeout));
        let (me, peer, n) = (self.me, self.peer, h.frames);
        match r {
            Ok(0) => Some(format!("rank {me}: rank {peer} closed its connection before frame {n} (its process exited)")),
            Ok(_) if head[0] == ABORT => Some(format!("rank {peer} sent an abort as frame {n}")),
            Ok(_) => None,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => None,
            Err(e) => Some(format!("rank {me}: the connection to rank {peer} failed before frame {n}: {e}")),
        }
    }

    /// Half-closes the connection: the peer reads what was sent, then the end of the stream.
    pub(super) fn close(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Write);
    }

    pub(super) fn send(&self, kind: u8, body: &[u8], opts: &Options) -> std::result::Result<(), String> {
        let mut h = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let n = h.frames;
        write_frame(&mut h.s, kind, n, body)
            .map_err(|e| format!("rank {}: could not send frame {n} to rank {}: {}", self.me, self.peer, io_why(&e, opts.io_timeout)))?;
        h.frames += 1;
        h.last = Instant::now();
        Ok(())
    }

    /// The next data, stop or abort frame (pings skipped); an abort is returned as the error.
    pub(super) fn recv(&self, opts: &Options) -> std::result::Result<(u8, u64, Vec<u8>), String> {
        let mut h = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let (me, peer, n) = (self.me, self.peer, h.frames);
        loop {
            let (kind, seq, body) =
                read_frame(&mut h.s, opts.max_frame).map_err(|e| format!("rank {me}: waiting for frame {n} from rank {peer}: {}", e.why(opts.io_timeout)))?;
            if kind == PING {
                continue;
            }
            if seq != n {
                return Err(format!("rank {me}: rank {peer} sent frame {seq} where frame {n} was due (a corrupt stream)"));
            }
            h.frames += 1;
            if kind == ABORT {
                return Err(format!("rank {peer} aborted at frame {n}: {}", String::from_utf8_lossy(&body)));
            }
            return Ok((kind, seq, body));
        }
    }
}

/// A frame read failure: the socket's, or a frame that breaks the format.
pub(super) enum FrameErr {
    Io(io::Error),
    Bad(String),
}

impl FrameErr {
    pub(super) fn why(&self, timeout: Duration) -> String {
        match self {
            FrameErr::Io(e) => io_why(e, timeout),
            FrameErr::Bad(m) => m.clone(),
        }
    }
}

pub(super) fn write_frame(s: &mut TcpStream, kind: u8, seq: u64, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| io::Error::new(ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut head = [0u8; HEADER];
    head[0] = kind;
    head[1..9].copy_from_slice(&seq.to_le_bytes());
    head[9..].copy_from_slice(&len.to_le_bytes());
    if body.len() <= 64 << 10 {
        // One write, so a small frame leaves as one segment under TCP_NODELAY.
        let mut frame = Vec::with_capacity(HEADER + body.len());
        frame.extend_from_slice(&head);
        frame.extend_from_slice(body);
        s.write_all(&frame)
    } else {
        s.write_all(&head)?;
        s.write_all(body)
    }
}

pub(super) fn read_frame(s: &mut TcpStream, max: usize) -> std::result::Result<(u8, u64, Vec<u8>), FrameErr> {
    let mut head = [0u8; HEADER];
    s.read_exact(&mut head).map_err(FrameErr::Io)?;
    let kind = head[0];
    let seq = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(head[9..].try_into().expect("4 bytes")) as usize;
    if !(HELLO..=ABORT).contains(&kind) {
        return Err(FrameErr::Bad(format!("unknown frame kind {kind} (a corrupt stream, or not a k3 control peer)")));
    }
    if len > max {
        return Err(FrameErr::Bad(format!("a {len}-byte frame exceeds the {max}-byte limit (Options::max_frame)")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(FrameErr::Io)?;
    Ok((kind, seq, body))
}

pub(super) fn io_why(e: &io::Error, timeout: Duration) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => {
            "the connection closed (the peer exited or crashed)".to_string()
        }
        ErrorKind::WouldBlock | ErrorKind::TimedOut => {
            format!("nothing for {timeout:?} (the peer is stuck, or its machine or the network is down)")
        }
        _ => e.to_string(),
    }
}
