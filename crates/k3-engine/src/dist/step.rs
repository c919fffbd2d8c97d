//! The per-step message: what rank 0 tells every rank before one batched forward, so that all
//! ranks of a parallel layout run the same forward in lockstep (their collectives pair up).
//!
//! A [`Step`] lists, in the order of the packed batch, each planned sequence's id and new
//! tokens (one for a decode step, more for a prefill chunk), with the chunk's own input rows
//! `[tokens, hidden]` when the request brought them (`prompt_embeds`: image features spliced
//! in); whether only each sequence's last row of logits is wanted; and the sequences released
//! since the last step, whose states every rank drops first. Ranks embed the other tokens
//! themselves, so a decode step of `B` sequences is `B · 16` bytes, not `B · hidden · 4`.
//!
//! The byte form ([`Step::encode`] / [`Step::decode`]) is what goes over a channel between
//! threads today and over the control plane (`k3_core::comm::control`) between processes
//! later. Little-endian throughout:
//!
//! ```text
//! "K3ST" u8:version u8:flags(bit 0 = last_only)
//! u32:released  released × u64:id
//! u32:seqs      seqs × { u64:id  u32:n  n × u32:token  u8:has_rows  [u32:m  m × f32] }
//! ```
//!
//! Decoding checks every count against the bytes left before it allocates and rejects trailing
//! bytes, so a truncated or corrupt frame is an [`EngineError::Step`], never a panic or a huge
//! allocation.

use crate::engine::SeqId;
use crate::error::{EngineError, Result};

const MAGIC: &[u8; 4] = b"K3ST";
const VERSION: u8 = 1;

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

impl Step {
    /// The byte form (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let toks: usize = self.seqs.iter().map(|s| 17 + 4 * s.tokens.len() + s.rows.as_ref().map_or(0, |r| 4 + 4 * r.len())).sum();
        let mut b = Vec::with_capacity(14 + 8 * self.released.len() + toks);
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
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
        b
    }

    /// Parses [`Step::encode`]'s bytes; anything else is an error naming what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Step> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(4, "the magic")? != MAGIC {
            return Err(bad("does not start with \"K3ST\" (not a step message)"));
        }
        let version = r.u8("the version")?;
        if version != VERSION {
            return Err(bad(format!("version {version}; this build reads version {VERSION} (are all ranks the same k3?)")));
        }
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
        if r.at != bytes.len() {
            return Err(bad(format!("{} bytes after the end of the message", bytes.len() - r.at)));
        }
        Ok(Step { seqs, last_only: flags & 1 == 1, released })
    }

    /// Rows in the packed batch.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::Step(msg.into())
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let left = self.b.len() - self.at;
        if n > left {
            return Err(bad(format!("truncated at byte {} reading {what}: {n} bytes needed, {left} left", self.at)));
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().map_err(|_| bad(format!("reading {what}")))?))
    }
    /// A count of items of at least `min` bytes each, checked against the bytes left.
    fn count(&mut self, min: usize, what: &str) -> Result<usize> {
        let at = self.at;
        let n = self.u32(what)? as usize;
        let left = self.b.len() - self.at;
        if n.saturating_mul(min) > left {
            return Err(bad(format!("byte {at}: {n} {what} cannot fit in the {left} bytes left")));
        }
        Ok(n)
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

    #[test]
    fn round_trip() {
        for s in [sample(), Step::default(), Step { last_only: false, ..sample() }] {
            let b = s.encode();
            assert_eq!(Step::decode(&b).unwrap(), s);
        }
        // A decode step is 16 bytes per sequence plus the header.
        let d = Step { seqs: (0..8).map(|i| StepSeq { id: i, tokens: vec![i as u32], rows: None }).collect(), last_only: true, released: vec![] };
        assert_eq!(d.encode().len(), 14 + 8 * 17);
        assert_eq!(d.num_tokens(), 8);
    }

    #[test]
    fn bad_bytes_are_errors() {
        let b = sample().encode();
        // Every truncation fails, none panics.
        for n in 0..b.len() {
            let e = Step::decode(&b[..n]).unwrap_err().to_string();
            assert!(e.starts_with("step message"), "{n}: {e}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(Step::decode(&long).unwrap_err().to_string().contains("after the end"));
        let mut m = b.clone();
        m[0] = b'X';
        assert!(Step::decode(&m).unwrap_err().to_string().contains("K3ST"));
        let mut v = b.clone();
        v[4] = 9;
        assert!(Step::decode(&v).unwrap_err().to_string().contains("version 9"));
        let mut f = b.clone();
        f[5] = 4;
        assert!(Step::decode(&f).unwrap_err().to_string().contains("flags"));
        // A count far beyond the bytes left is refused before anything is allocated.
        let mut c = b.clone();
        c[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Step::decode(&c).unwrap_err().to_string().contains("cannot fit"), "{}", Step::decode(&c).unwrap_err());
        // Every single-byte corruption is an error or a different valid step, never a panic.
        for i in 0..b.len() {
            for x in [0u8, 1, 0x80, 0xff] {
                let mut y = b.clone();
                y[i] = x;
                let _ = Step::decode(&y);
            }
        }
    }
}
