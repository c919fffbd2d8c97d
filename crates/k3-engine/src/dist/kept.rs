//! The prefix cache on a multi-process layout (issue 21; `dist::process`, one process per GPU):
//! every rank keeps its own part of each stored cell and KDA snapshot in its own process, under
//! a key that rank 0's cache holds.
//!
//! Why not the thread layout's way (every rank's part gathered into rank 0's stored state at
//! capture, cut and scattered at restore: `dist::layout_state`)? On the GPU a cell is the device
//! pages of the sequence that wrote it, held by reference (`k3_model::device_pages`), and a
//! restore maps those same pages into the new sequence's block table: a cell's rows never leave
//! the device. Each rank's rows are in its own GPU's pages, and only that rank can use them, so
//! gathering them to rank 0 would copy every cell through the host and the control plane (and
//! back on every hit) for nothing. Here the pages stay shared per rank, as on one GPU, and rank 0's
//! prefix cache (its tree, its budget, its eviction) decides everything for every rank:
//!
//! - capture ([`Command::Keep`]): rank 0 captures its own part first (its runner's usual
//!   capture: on the GPU device pages by reference, the KDA slots copied to the host), then
//!   every other rank captures its part and keeps it ([`Kept`]): cell `k` under `key + k`, the
//!   snapshot under `key + cells`, keys rank 0 hands out ([`Ledger`]). Each answers with a
//!   receipt (its span, cell count, whether it has the snapshot) that rank 0 checks against its
//!   own part; rank 0's cells and snapshot then carry a [`Remote`] handle of their key into the
//!   tree.
//! - restore ([`Command::Resume`]): rank 0 restores its own part (a refused one changes nothing
//!   anywhere), then every rank restores from its own kept parts under the keys the stored
//!   cells and snapshot name (states released since the last step are dropped on every rank
//!   first, so a rank's sequence slots are free where rank 0's are).
//! - eviction ([`Command::Forget`]): when rank 0's cache drops a cell or snapshot (an eviction,
//!   a capture it did not insert), the last clone of its [`Remote`] queues the key; rank 0 sends
//!   the queued keys before its next command or step, so every rank frees the same device pages
//!   before the next step allocates, as rank 0's admission counted. Each rank answers with the
//!   number of parts it keeps, which must equal the handles alive on rank 0 (else that rank's
//!   failure stops the layout).
//!
//! Every rank's page pool is rank 0's size and holds the same sequences and cells in the same
//! order, so rank 0's admission and eviction (decided on its own pages) hold on every rank. A
//! rank's kept KDA snapshots are host memory of its own process, its share of the state (its
//! heads, its stage's layers), as rank 0's pool holds rank 0's share; `--prefix-cache-mem`
//! bounds rank 0's. The engine runs one step at a time with the cache on
//! (`Engine::pipeline_depth`), so these commands never cross a pipelined step. The same code
//! runs the CPU rank workers of the tests (`tests/process.rs`: each keeps its CPU cells).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::process::ProcessRunner;
use super::runner::{Failure, RankWorker};
use super::step::Command;
use crate::engine::SeqId;
use crate::error::{EngineError, Result};
use crate::prefix::{Capture, KdaSnap, Segment};

/// Rank 0's account of the keys it handed out: the next key, the handles alive, and the keys
/// dropped since the ranks last heard (to send as [`Command::Forget`]).
#[derive(Debug, Default)]
pub struct Ledger {
    next: u64,
    live: usize,
    dropped: Vec<u64>,
}

/// A stored cell's or snapshot's key on the other ranks (see the module doc); cloned with the
/// cell, and the key queued for [`Command::Forget`] when the last clone is dropped.
#[derive(Clone, Debug)]
pub struct Remote(Arc<Handle>);

#[derive(Debug)]
struct Handle {
    key: u64,
    ledger: Arc<Mutex<Ledger>>,
}

impl Remote {
    fn new(key: u64, ledger: &Arc<Mutex<Ledger>>) -> Remote {
        ledger.lock().unwrap_or_else(|p| p.into_inner()).live += 1;
        Remote(Arc::new(Handle { key, ledger: ledger.clone() }))
    }
    /// The key the other ranks keep their parts under.
    pub fn key(&self) -> u64 {
        self.0.key
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let mut l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
        l.live -= 1;
        l.dropped.push(self.key);
    }
}

/// A rank's kept parts, by key (see the module doc): what its worker loop applies
/// [`Command::Keep`], [`Command::Resume`] and [`Command::Forget`] to.
#[derive(Default)]
pub struct Kept {
    cells: HashMap<u64, Segment>,
    snaps: HashMap<u64, KdaSnap>,
}

/// What a rank answers a keep with: its part's span, one empty cell per cell, and an empty
/// snapshot when it has one (nothing of the state itself travels).
fn receipt(c: &Capture) -> Capture {
    let cells = c.cells.iter().map(|_| Segment { layers: Vec::new(), pages: None, mtp: None, draft: None, remote: None }).collect();
    let kda = c.kda.as_ref().map(|s| KdaSnap { at: s.at, layers: Vec::new(), mtp_hidden: None, draft: None, remote: None });
    Capture { from: c.from, to: c.to, cells, kda }
}

impl Kept {
    /// Parts kept (cells and snapshots).
    pub fn len(&self) -> usize {
        self.cells.len() + self.snaps.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`Command::Keep`] on rank `w`: its receipt.
    pub fn keep<W: RankWorker + ?Sized>(&mut self, w: &mut W, id: SeqId, from: usize, grid: usize, kda: bool, key: u64) -> Result<Capture> {
        let cap = w.capture(id, from, grid, kda)?;
        let r = receipt(&cap);
        let n = cap.cells.len() as u64;
        for (k, c) in (key..).zip(cap.cells) {
            self.cells.insert(k, c);
        }
        if let Some(s) = cap.kda {
            self.snaps.insert(key + n, s);
        }
        Ok(r)
    }

    /// [`Command::Resume`] on rank `w`.
    pub fn resume<W: RankWorker + ?Sized>(&self, w: &mut W, id: SeqId, cells: &[u64], snap: u64) -> Result<()> {
        let rank = w.rank();
        let missing = |k: u64| EngineError::Internal(format!("rank {rank} keeps no prefix-cache part under key {k} (rank 0's cache and this rank's disagree)"));
        let cells = cells.iter().map(|&k| self.cells.get(&k).ok_or_else(|| missing(k))).collect::<Result<Vec<_>>>()?;
        let snap = self.snaps.get(&snap).ok_or_else(|| missing(snap))?;
        w.resume(id, &cells, snap)
    }

    /// [`Command::Forget`]: its receipt, whose `to` is the number of parts still kept.
    pub fn forget(&mut self, rank: usize, keys: &[u64]) -> Result<Capture> {
        for k in keys {
            if self.cells.remove(k).is_none() && self.snaps.remove(k).is_none() {
                return Err(EngineError::Internal(format!(
                    "rank {rank} was told to forget key {k}, which it does not keep (rank 0's cache and this rank's disagree)"
                )));
            }
        }
        Ok(Capture { from: 0, to: self.len(), cells: Vec::new(), kda: None })
    }
}

/// Rank 0's side (see the module doc): the prefix methods of [`ProcessRunner`]'s runner.
impl ProcessRunner {
    /// Sends the keys rank 0's cache dropped since the last command (none while steps are in
    /// flight: the engine runs none with the cache on); checks every rank keeps what rank 0 holds.
    pub(super) fn forget_dropped(&mut self) -> Result<()> {
        if self.in_flight > 0 {
            return Ok(());
        }
        let (keys, live) = {
            let mut l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
            (std::mem::take(&mut l.dropped), l.live)
        };
        if keys.is_empty() {
            return Ok(());
        }
        let answers = self.command(&Command::Forget(keys))?;
        for (i, a) in answers.into_iter().enumerate() {
            let kept = a.capture.map(|c| c.to);
            if kept != Some(live) {
                let msg = format!("keeps {kept:?} prefix-cache parts where rank 0's cache holds {live} (a forget lost)");
                return Err(self.stop(vec![Failure { rank: i + 1, msg, aborted: false }]));
            }
        }
        Ok(())
    }

    /// `Runner::capture`: rank 0's part (for its cache), every other rank's kept.
    pub(super) fn keep(&mut self, id: SeqId, from: usize, grid: usize, kda: bool) -> Result<Capture> {
        self.forget_dropped()?;
        let mut cap = self.local.capture(id, from, grid, kda)?;
        let n = cap.cells.len() as u64;
        let key = {
            let mut l = self.ledger.lock().unwrap_or_else(|p| p.into_inner());
            let k = l.next;
            l.next += n + 1;
            k
        };
        let answers = self.command(&Command::Keep { id, from, grid, kda, key })?;
        for (i, a) in answers.into_iter().enumerate() {
            let got = a.capture.map(|c| (c.from, c.to, c.cells.len(), c.kda.is_some()));
            let want = (cap.from, cap.to, cap.cells.len(), cap.kda.is_some());
            if got != Some(want) {
                let msg = format!("kept (from, to, cells, snapshot) = {got:?} of sequence {id} where rank 0 captured {want:?}");
                return Err(self.stop(vec![Failure { rank: i + 1, msg, aborted: false }]));
            }
        }
        let ledger = self.ledger.clone();
        for (k, c) in (key..).zip(cap.cells.iter_mut()) {
            c.remote = Some(Remote::new(k, &ledger));
        }
        if let Some(s) = cap.kda.as_mut() {
            s.remote = Some(Remote::new(key + n, &ledger));
        }
        Ok(cap)
    }

    /// `Runner::restore`: rank 0's part, then every other rank's from its kept parts.
    pub(super) fn resume(&mut self, id: SeqId, cells: &[&Segment], snap: &KdaSnap) -> Result<()> {
        let not_ours =
            || EngineError::Internal("prefix restore: the stored state has no keys of this multi-process layout's ranks (made by another runner)".into());
        let keys = cells.iter().map(|c| c.remote.as_ref().map(Remote::key)).collect::<Option<Vec<_>>>().ok_or_else(not_ours)?;
        let snap_key = snap.remote.as_ref().map(Remote::key).ok_or_else(not_ours)?;
        self.check()?;
        self.local.restore(id, cells, snap)?;
        // States released since the last step go first (their sequence slots), then dropped keys.
        let released = std::mem::take(&mut self.released);
        if !released.is_empty() {
            self.command(&Command::Release(released))?;
        }
        self.forget_dropped()?;
        self.command(&Command::Resume { id, cells: keys, snap: snap_key })?;
        Ok(())
    }
}
