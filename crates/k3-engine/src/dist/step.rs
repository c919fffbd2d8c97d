//! The messages rank 0 sends every rank of a parallel layout: the per-step message, so that all
//! ranks run the same forward in lockstep (their collectives pair up), and the other commands of
//! the worker loop (`dist::runner::serve`) — the verify forward and rollback of speculative
//! decoding, the capture and restore of the prefix cache. This file and `layout_state.rs` (a
//! sequence state cut into the ranks' parts) are the whole command set.
//!
//! A [`Step`] lists, in the order of the packed batch, each planned sequence's id and new
//! tokens (one for a decode step, more for a prefill chunk), with the chunk's own input rows
//! `[tokens, hidden]` when the request brought them (`prompt_embeds`: image features spliced
//! in); whether only each sequence's last row of logits is wanted; and the sequences released
//! since the last step, whose states every rank drops first. Ranks embed the other tokens
//! themselves, so a decode step of `B` sequences is `B · 16` bytes, not `B · hidden · 4`.
//!
//! A [`Command`] is a step run as a plain or a verify forward, a rollback, a capture (every rank
//! answers with its part of the sequence's state), a restore (each rank gets its own part), a
//! release (states dropped at once, between steps; a release while steps are in flight rides on
//! the next step instead) or the page size of the CPU cache pages (the prefix cache's grid, so
//! that every rank's captured cells are whole pages: `k3_model::layers::pages`). Between
//! processes the prefix cache uses three more (`dist::kept`): keep (capture this rank's part
//! and keep it here under a key), resume (restore a sequence from the parts kept under keys)
//! and forget (drop the parts kept under keys).
//! Every rank applies the commands in the order rank 0 sent them and answers each one.
//!
//! The byte form ([`Command::encode`] / [`Command::decode`]) is what goes over a channel between
//! threads (but a restore: `dist::runner::Sent`) and over the control plane
//! (`k3_core::comm::control`) between processes.
//! Little-endian throughout:
//!
//! ```text
//! "K3ST" u8:version u8:command
//! 0 forward, 1 verify:  u8:flags(bit 0 = last_only)
//!                       u32:released  released × u64:id
//!                       u32:seqs      seqs × { u64:id  u32:n  n × u32:token  u8:has_rows  [u32:m  m × f32] }
//! 2 rollback:           u64:id  u64:drop
//! 3 capture:            u64:id  u64:from  u64:grid  u8:kda
//! 4 restore:            u64:id  state (layout_state's byte form of a capture)
//! 5 release:            u32:ids  ids × u64:id
//! 6 page rows:          u64:rows
//! 7 keep:               u64:id  u64:from  u64:grid  u8:kda  u64:key
//! 8 resume:             u64:id  u32:cells  cells × u64:key  u64:snapshot key
//! 9 forget:             u32:keys  keys × u64:key
//! ```
//!
//! Decoding checks every count against the bytes left before it allocates and rejects trailing
//! bytes, so a truncated or corrupt frame is an [`EngineError::Step`], never a panic or a huge
//! allocation. A worker's answer ([`Reply`]) crosses the control plane as [`encode_reply`]'s
//! bytes (between threads it is passed as it is).

use super::layout_state;
use super::runner::{Answer, Failure, Reply};
use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::prefix::Capture;

const MAGIC: &[u8; 4] = b"K3ST";
const VERSION: u8 = 4;

/// One planned sequence of a step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepSeq {
    pub id: SeqId,
    /// The new tokens (≥ 1).
    pub tokens: Vec<u32>,
    /// The chunk's own input rows `[tokens.len(), hidden]`, replacing its token embeddings.
    pub rows: Option<Vec<f32>>,
}

/// One batched forward, as every rank receives it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Step {
    /// The packed batch, in order.
    pub seqs: Vec<StepSeq>,
    /// Logits of each sequence's last row only (`[B, vocab]`) instead of every row.
    pub last_only: bool,
    /// Sequences finished or cancelled since the last step: their states are dropped first.
    pub released: Vec<SeqId>,
}

/// What rank 0 tells every rank to do next (see the module doc).
#[derive(Clone, Debug)]
pub enum Command {
    /// A plain forward of the step.
    Forward(Step),
    /// The verify forward of speculative decoding (`Model::forward_verify`): each rank keeps
    /// its sequences' KDA states after every token for a later [`Command::Rollback`].
    Verify(Step),
    /// Drop the last `drop` tokens of sequence `id`'s last verify forward.
    Rollback { id: SeqId, drop: usize },
    /// Answer with this rank's part of sequence `id`'s state: its latent rows `[from, pos)` cut
    /// into cells of `grid` tokens, and its KDA states when `kda` (`Runner::capture`).
    Capture { id: SeqId, from: usize, grid: usize, kda: bool },
    /// Make sequence `id` anew from this rank's part of a stored state (`Runner::restore`):
    /// `part.cells` (every cell before the snapshot) and `part.kda` (the snapshot).
    Restore { id: SeqId, part: Capture },
    /// Drop these sequences' states now.
    Release(Vec<SeqId>),
    /// Make the MLA/DSA caches of new states in pages of this many rows (`Runner::set_page_rows`).
    PageRows(usize),
    /// [`Command::Capture`], but this rank keeps its part (`dist::kept`): cell `k` under
    /// `key + k`, the KDA snapshot under `key + cells`; it answers with a receipt.
    Keep { id: SeqId, from: usize, grid: usize, kda: bool, key: u64 },
    /// Make sequence `id` anew from this rank's kept parts: the cells under `cells`, in order,
    /// and the snapshot under `snap`.
    Resume { id: SeqId, cells: Vec<u64>, snap: u64 },
    /// Drop the parts kept under these keys.
    Forget(Vec<u64>),
}

impl Step {
    /// The byte form of this step as a plain forward ([`Command::Forward`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = header(0);
        self.put(&mut b);
        b
    }

    /// The byte form of this step as a verify forward ([`Command::Verify`]).
    pub fn encode_verify(&self) -> Vec<u8> {
        let mut b = header(1);
        self.put(&mut b);
        b
    }

    fn put(&self, b: &mut Vec<u8>) {
        let toks: usize = self.seqs.iter().map(|s| 17 + 4 * s.tokens.len() + s.rows.as_ref().map_or(0, |r| 4 + 4 * r.len())).sum();
        b.reserve(9 + 8 * self.released.len() + toks);
        b.push(self.last_only as u8);
        b.extend_from_slice(&(self.released.len() as u32).to_le_bytes());
        for id in &self.released {
            b.extend_from_slice(&id.to_le_bytes());
        }
        b.extend_from_slice(&(self.seqs.len() as u32).to_le_bytes());
        for s in &self.seqs {
            b.extend_from_slice(&s.id.to_le_bytes());
            b.extend_from_slice(&(s.tokens.len() as u32).to_le_bytes());
            for t in &s.tokens {
                b.extend_from_slice(&t.to_le_bytes());
            }
            match &s.rows {
                None => b.push(0),
                Some(r) => {
                    b.push(1);
                    b.extend_from_slice(&(r.len() as u32).to_le_bytes());
                    for x in r {
                        b.extend_from_slice(&x.to_le_bytes());
                    }
                }
            }
        }
    }

    fn take(r: &mut Reader<'_>) -> Result<Step> {
        let flags = r.u8("the flags")?;
        if flags > 1 {
            return Err(bad(format!("unknown flags {flags:#04x}")));
        }
        let n = r.count(8, "released ids")?;
        let released = (0..n).map(|_| r.u64("a released id")).collect::<Result<Vec<_>>>()?;
        let n = r.count(13, "sequences")?;
        let mut seqs = Vec::with_capacity(n);
        for i in 0..n {
            let id = r.u64("a sequence id")?;
            let t = r.count(4, "tokens")?;
            let tokens = (0..t).map(|_| r.u32("a token")).collect::<Result<Vec<_>>>()?;
            let rows = match r.u8("the rows flag")? {
                0 => None,
                1 => {
                    let m = r.count(4, "row values")?;
                    Some(r.take(4 * m, "row values")?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
                }
                f => return Err(bad(format!("sequence {i}: rows flag {f} (0 or 1)"))),
            };
            seqs.push(StepSeq { id, tokens, rows });
        }
        Ok(Step { seqs, last_only: flags & 1 == 1, released })
    }

    /// Rows in the packed batch.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

fn header(kind: u8) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(MAGIC);
    b.push(VERSION);
    b.push(kind);
    b
}

impl Command {
    /// The byte form (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let mut b;
        match self {
            Command::Forward(s) => return s.encode(),
            Command::Verify(s) => return s.encode_verify(),
            Command::Rollback { id, drop } => {
                b = header(2);
                b.extend_from_slice(&id.to_le_bytes());
                b.extend_from_slice(&(*drop as u64).to_le_bytes());
            }
            Command::Capture { id, from, grid, kda } => {
                b = header(3);
                for x in [*id, *from as u64, *grid as u64] {
                    b.extend_from_slice(&x.to_le_bytes());
                }
                b.push(*kda as u8);
            }
            Command::Restore { id, part } => {
                b = header(4);
                b.extend_from_slice(&id.to_le_bytes());
                layout_state::put_capture(&mut b, part);
            }
            Command::Release(ids) => {
                b = header(5);
                b.extend_from_slice(&(ids.len() as u32).to_le_bytes());
                ids.iter().for_each(|id| b.extend_from_slice(&id.to_le_bytes()));
            }
            Command::PageRows(rows) => {
                b = header(6);
                b.extend_from_slice(&(*rows as u64).to_le_bytes());
            }
            Command::Keep { id, from, grid, kda, key } => {
                b = header(7);
                for x in [*id, *from as u64, *grid as u64] {
                    b.extend_from_slice(&x.to_le_bytes());
                }
                b.push(*kda as u8);
                b.extend_from_slice(&key.to_le_bytes());
            }
            Command::Resume { id, cells, snap } => {
                b = header(8);
                b.extend_from_slice(&id.to_le_bytes());
                b.extend_from_slice(&(cells.len() as u32).to_le_bytes());
                cells.iter().chain([snap]).for_each(|k| b.extend_from_slice(&k.to_le_bytes()));
            }
            Command::Forget(keys) => {
                b = header(9);
                b.extend_from_slice(&(keys.len() as u32).to_le_bytes());
                keys.iter().for_each(|k| b.extend_from_slice(&k.to_le_bytes()));
            }
        }
        b
    }

    /// Parses [`Command::encode`]'s bytes; anything else is an error naming what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Command> {
        let mut r = Reader::new(bytes);
        if r.take(4, "the magic")? != MAGIC {
            return Err(bad("does not start with \"K3ST\" (not a step message)"));
        }
        let version = r.u8("the version")?;
        if version != VERSION {
            return Err(bad(format!("version {version}; this build reads version {VERSION} (are all ranks the same k3?)")));
        }
        let cmd = match r.u8("the command")? {
            0 => Command::Forward(Step::take(&mut r)?),
            1 => Command::Verify(Step::take(&mut r)?),
            2 => Command::Rollback { id: r.u64("a sequence id")?, drop: r.usize("the tokens to drop")? },
            c @ (3 | 7) => {
                let (id, from, grid) = (r.u64("a sequence id")?, r.usize("the first token")?, r.usize("the grid")?);
                let kda = match r.u8("the kda flag")? {
                    0 => false,
                    1 => true,
                    f => return Err(bad(format!("capture: kda flag {f} (0 or 1)"))),
                };
                match c {
                    3 => Command::Capture { id, from, grid, kda },
                    _ => Command::Keep { id, from, grid, kda, key: r.u64("the key")? },
                }
            }
            4 => Command::Restore { id: r.u64("a sequence id")?, part: layout_state::take_capture(&mut r)? },
            5 => {
                let n = r.count(8, "released ids")?;
                Command::Release((0..n).map(|_| r.u64("a released id")).collect::<Result<_>>()?)
            }
            6 => Command::PageRows(r.usize("the page rows")?),
            8 => {
                let id = r.u64("a sequence id")?;
                let n = r.count(8, "cell keys")?;
                let cells = (0..n).map(|_| r.u64("a cell key")).collect::<Result<_>>()?;
                Command::Resume { id, cells, snap: r.u64("the snapshot key")? }
            }
            9 => {
                let n = r.count(8, "keys")?;
                Command::Forget((0..n).map(|_| r.u64("a key")).collect::<Result<_>>()?)
            }
            c => {
                return Err(bad(format!(
                    "unknown command {c} (0 forward, 1 verify, 2 rollback, 3 capture, 4 restore, 5 release, 6 page rows, 7 keep, 8 resume, 9 forget)"
                )))
            }
        };
        r.end()?;
        Ok(cmd)
    }

    /// A short name for errors and traces.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Forward(_) => "forward",
            Command::Verify(_) => "verify",
            Command::Rollback { .. } => "rollback",
            Command::Capture { .. } => "capture",
            Command::Restore { .. } => "restore",
            Command::Release(_) => "release",
            Command::PageRows(_) => "page rows",
            Command::Keep { .. } => "keep",
            Command::Resume { .. } => "resume",
            Command::Forget(_) => "forget",
        }
    }
}

/// A reply's bytes: `0 | u64 state bytes`, `3 | u64 state bytes | capture` (a capture's answer,
/// `dist::layout_state`'s byte form), or `1 | u8 aborted | utf-8 message`.
pub fn encode_reply(r: &Reply) -> Vec<u8> {
    match r {
        Ok(Answer { state_bytes, capture: None }) => [&[0u8][..], &(*state_bytes as u64).to_le_bytes()].concat(),
        Ok(Answer { state_bytes, capture: Some(c) }) => [&[3u8][..], &(*state_bytes as u64).to_le_bytes(), &layout_state::encode_capture(c)].concat(),
        Err(f) => [&[1u8, f.aborted as u8][..], f.msg.as_bytes()].concat(),
    }
}

/// Parses [`encode_reply`]'s bytes from worker `rank` (a bad frame is that rank's failure).
pub fn decode_reply(b: &[u8], rank: usize) -> Reply {
    let bad = |why: String| Failure { rank, msg: format!("sent a bad reply ({why}; are all ranks the same k3?)"), aborted: false };
    match b.split_first() {
        Some((0, rest)) => rest.try_into().map(|x| Answer::bytes(u64::from_le_bytes(x) as usize)).map_err(|_| bad(format!("{} bytes after an ok", rest.len()))),
        Some((3, rest)) if rest.len() >= 8 => {
            let (n, c) = rest.split_at(8);
            let state_bytes = u64::from_le_bytes(n.try_into().map_err(|_| bad("a short capture".into()))?) as usize;
            let capture = layout_state::decode_capture(c).map_err(|e| bad(format!("its capture: {e}")))?;
            Ok(Answer { state_bytes, capture: Some(capture) })
        }
        Some((1, rest)) => match rest.split_first() {
            Some((&a, msg)) if a <= 1 => Err(Failure { rank, msg: String::from_utf8_lossy(msg).into_owned(), aborted: a == 1 }),
            _ => Err(bad("a failure without its flag".into())),
        },
        Some((t, _)) => Err(bad(format!("tag {t}"))),
        None => Err(bad("empty".into())),
    }
}

pub(super) fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::Step(msg.into())
}

/// Reads a message's fields in order, each checked against the bytes left.
pub(super) struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(b: &'a [u8]) -> Reader<'a> {
        Reader { b, at: 0 }
    }
    pub(super) fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.b.len() - self.at;
        if n > left {
            return Err(bad(format!("truncated at byte {} reading {what}: {n} bytes needed, {left} left", self.at)));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    pub(super) fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    pub(super) fn u32(&mut self, what: &str) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    pub(super) fn u64(&mut self, what: &str) -> Result<u64> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().map_err(|_| bad(format!("reading {what}")))?))
    }
    pub(super) fn usize(&mut self, what: &str) -> Result<usize> {
        let at = self.at;
        let v = self.u64(what)?;
        usize::try_from(v).map_err(|_| bad(format!("byte {at}: {what} {v} does not fit this machine's usize")))
    }
    /// A count of items of at least `min` bytes each, checked against the bytes left.
    pub(super) fn count(&mut self, min: usize, what: &str) -> Result<usize> {
        let at = self.at;
        let n = self.u32(what)? as usize;
        let left = self.b.len() - self.at;
        if n.saturating_mul(min) > left {
            return Err(bad(format!("byte {at}: {n} {what} cannot fit in the {left} bytes left")));
        }
        Ok(n)
    }
    /// An array's bytes: `u64:n` then `n` items of `elem` bytes, checked against the bytes left.
    pub(super) fn array(&mut self, elem: usize, what: &str) -> Result<&'a [u8]> {
        let at = self.at;
        let n = self.u64(what)?;
        let left = self.b.len() - self.at;
        match usize::try_from(n).ok().and_then(|n| n.checked_mul(elem)).filter(|&b| b <= left) {
            Some(b) => self.take(b, what),
            None => Err(bad(format!("byte {at}: {n} {what} cannot fit in the {left} bytes left"))),
        }
    }
    /// Fails unless every byte was read.
    pub(super) fn end(&self) -> Result<()> {
        match self.at == self.b.len() {
            true => Ok(()),
            false => Err(bad(format!("{} bytes after the end of the message", self.b.len() - self.at))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Step {
        Step {
            seqs: vec![
                StepSeq { id: 7, tokens: vec![1, 2, 3], rows: None },
                StepSeq { id: u64::MAX, tokens: vec![u32::MAX], rows: Some(vec![0.5, -1.25, f32::MIN_POSITIVE, 3e38]) },
                StepSeq { id: 0, tokens: vec![9; 5], rows: Some(Vec::new()) },
            ],
            last_only: true,
            released: vec![4, 5, 1 << 40],
        }
    }

    /// A command's bytes decoded and encoded again are the same bytes.
    fn again(c: &Command) -> Vec<u8> {
        Command::decode(&c.encode()).unwrap().encode()
    }

    fn step_of(c: Command) -> Step {
        match c {
            Command::Forward(s) | Command::Verify(s) => s,
            c => panic!("not a step: {}", c.name()),
        }
    }

    #[test]
    fn round_trip() {
        for s in [sample(), Step::default(), Step { last_only: false, ..sample() }] {
            assert_eq!(step_of(Command::decode(&s.encode()).unwrap()), s);
            let v = Command::Verify(s.clone()).encode();
            assert!(matches!(Command::decode(&v).unwrap(), Command::Verify(ref x) if *x == s));
        }
        // A decode step is 16 bytes per sequence plus the header.
        let d = Step { seqs: (0..8).map(|i| StepSeq { id: i, tokens: vec![i as u32], rows: None }).collect(), last_only: true, released: vec![] };
        assert_eq!(d.encode().len(), 15 + 8 * 17);
        assert_eq!(d.num_tokens(), 8);
        for c in [
            Command::Rollback { id: 9, drop: 3 },
            Command::Capture { id: 1 << 50, from: 256, grid: 128, kda: true },
            Command::Release(vec![3, 1 << 60]),
            Command::PageRows(64),
            Command::Keep { id: 3, from: 128, grid: 64, kda: true, key: 1 << 40 },
            Command::Resume { id: 8, cells: vec![1, 2, 1 << 33], snap: 5 },
            Command::Resume { id: 8, cells: vec![], snap: 0 },
            Command::Forget(vec![7, 9]),
        ] {
            assert_eq!(again(&c), c.encode(), "{c:?}");
        }
        assert!(matches!(Command::decode(&Command::Rollback { id: 9, drop: 3 }.encode()).unwrap(), Command::Rollback { id: 9, drop: 3 }));
        assert!(matches!(Command::decode(&Command::PageRows(64).encode()).unwrap(), Command::PageRows(64)));
        let c = Command::decode(&Command::Capture { id: 4, from: 8, grid: 4, kda: false }.encode()).unwrap();
        assert!(matches!(c, Command::Capture { id: 4, from: 8, grid: 4, kda: false }), "{c:?}");
        let r = Command::Restore { id: 5, part: Capture { from: 0, to: 0, cells: Vec::new(), kda: None } };
        assert_eq!(again(&r), r.encode());
        let k = Command::decode(&Command::Keep { id: 3, from: 128, grid: 64, kda: false, key: 77 }.encode()).unwrap();
        assert!(matches!(k, Command::Keep { id: 3, from: 128, grid: 64, kda: false, key: 77 }), "{k:?}");
        let r = Command::decode(&Command::Resume { id: 8, cells: vec![1, 2], snap: 5 }.encode()).unwrap();
        assert!(matches!(r, Command::Resume { id: 8, ref cells, snap: 5 } if *cells == [1, 2]), "{r:?}");
        assert!(matches!(Command::decode(&Command::Forget(vec![4]).encode()).unwrap(), Command::Forget(ref k) if *k == [4]));
    }

    #[test]
    fn bad_bytes_are_errors() {
        let b = sample().encode();
        // Every truncation fails, none panics.
        for n in 0..b.len() {
            let e = Command::decode(&b[..n]).unwrap_err().to_string();
            assert!(e.starts_with("step message"), "{n}: {e}");
        }
        let err = |b: &[u8]| Command::decode(b).unwrap_err().to_string();
        let mut long = b.clone();
        long.push(0);
        assert!(err(&long).contains("after the end"));
        let mut m = b.clone();
        m[0] = b'X';
        assert!(err(&m).contains("K3ST"));
        let mut v = b.clone();
        v[4] = 9;
        assert!(err(&v).contains("version 9"));
        let mut k = b.clone();
        k[5] = 10;
        assert!(err(&k).contains("unknown command 10"));
        let mut f = b.clone();
        f[6] = 4;
        assert!(err(&f).contains("flags"));
        // A count far beyond the bytes left is refused before anything is allocated.
        let mut c = b.clone();
        c[7..11].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(err(&c).contains("cannot fit"), "{}", err(&c));
        let mut cap = Command::Capture { id: 1, from: 0, grid: 4, kda: true }.encode();
        *cap.last_mut().unwrap() = 2;
        assert!(err(&cap).contains("kda flag 2"));
        // A resume or forget whose key count runs past the bytes is refused before allocating.
        for mut c in [Command::Resume { id: 1, cells: vec![1, 2], snap: 3 }.encode(), Command::Forget(vec![1]).encode()] {
            let at = if c[5] == 8 { 14 } else { 6 };
            c[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
            assert!(err(&c).contains("cannot fit"), "{}", err(&c));
            let n = c.len();
            assert!(Command::decode(&c[..n - 1]).is_err());
        }
        // Every single-byte corruption is an error or a different valid command, never a panic.
        for i in 0..b.len() {
            for x in [0u8, 1, 0x80, 0xff] {
                let mut y = b.clone();
                y[i] = x;
                let _ = Command::decode(&y);
            }
        }
    }
}
