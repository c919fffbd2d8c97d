//! The recording runner the prefix-cache and draft-model tests share (`prefix.rs` on the CPU,
//! `cuda_prefix.rs` on the GPU, `mtp.rs` and `draft.rs` for the draft states): it forwards to a
//! real runner, records every plain forward's logits rows per sequence (so warm and cold runs
//! can be compared row by row) and, when given a [`Timeline`], every draft call's chained
//! logits and every verify step's rows per sequence, in order; and it hands what it restores to
//! a mutation first, and the runner to a hook after a restore (the tests' mutants corrupt the
//! restored state there, to show that the comparison can fail).
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k3_engine::dist::runner::{Runner, Step};
use k3_engine::prefix::{Capture, KdaSnap, Segment};
use k3_model::Config;

/// Every logits row per sequence id, in the order they were computed.
pub type Log = Arc<Mutex<HashMap<u64, Vec<Vec<f32>>>>>;

/// What a restore goes through before it reaches the inner runner (the cells, the snapshot).
pub type Mutate = Box<dyn Fn(&mut Vec<Segment>, &mut KdaSnap) + Send>;

/// What runs on the inner runner right after it restored a sequence (its id): the GPU tests'
/// mutants corrupt the restored device pages there.
pub type AfterRestore<R> = Box<dyn Fn(&mut R, u64) + Send>;

/// One call that concerned a sequence: its draft call's logits, one row per chained position,
/// or its rows of a verify step's logits (`1 + drafts`).
#[derive(Clone, Debug)]
pub enum Entry {
    Drafted(Vec<Vec<f32>>),
    Verified(Vec<Vec<f32>>),
}

/// Every sequence's [`Entry`]s, in call order.
pub type Timeline = Arc<Mutex<HashMap<u64, Vec<Entry>>>>;

/// `inner` recording into `log`; its restores pass `mutate`, then `after_restore`;
/// `exact_cuts` overrides the inner runner's answer when set.
pub struct Rec<R> {
    pub inner: R,
    pub log: Log,
    pub mutate: Option<Mutate>,
    pub after_restore: Option<AfterRestore<R>>,
    pub exact_cuts: Option<bool>,
    pub timeline: Option<Timeline>,
}

impl<R: Runner> Rec<R> {
    pub fn new(inner: R, log: &Log) -> Self {
        Rec { inner, log: log.clone(), mutate: None, after_restore: None, exact_cuts: None, timeline: None }
    }
}

impl<R: Runner> Runner for Rec<R> {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    fn embed(&self, ids: &[u32]) -> k3_engine::Result<Vec<f32>> {
        self.inner.embed(ids)
    }
    fn fits(&self, tokens: usize) -> Result<(), usize> {
        self.inner.fits(tokens)
    }
    fn admit(&mut self, id: u64, tokens: usize, shared: usize) -> k3_engine::Result<bool> {
        self.inner.admit(id, tokens, shared)
    }
    fn admits_after_eviction(&self, tokens: usize, shared: usize) -> bool {
        self.inner.admits_after_eviction(tokens, shared)
    }
    fn cache_pages(&self, id: u64) -> Option<Vec<u32>> {
        self.inner.cache_pages(id)
    }
    fn release(&mut self, id: u64) {
        self.inner.release(id)
    }
    fn forward(&mut self, step: Step) -> k3_engine::Result<Vec<f32>> {
        let ids: Vec<u64> = step.seqs.iter().map(|s| s.id).collect();
        let out = self.inner.forward(step)?;
        let v = self.config().text.vocab_size;
        let mut log = self.log.lock().unwrap();
        for (id, row) in ids.iter().zip(out.chunks_exact(v)) {
            log.entry(*id).or_default().push(row.to_vec());
        }
        Ok(out)
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
    fn prefix_support(&self) -> Result<String, String> {
        self.inner.prefix_support()
    }
    fn exact_cuts(&self) -> bool {
        self.exact_cuts.unwrap_or_else(|| self.inner.exact_cuts())
    }
    fn set_page_rows(&mut self, rows: usize) {
        self.inner.set_page_rows(rows)
    }
    fn seq_state(&self, id: u64) -> Option<&k3_model::SeqState> {
        self.inner.seq_state(id)
    }
    fn capture(&mut self, id: u64, from: usize, grid: usize, kda: bool) -> k3_engine::Result<Capture> {
        self.inner.capture(id, from, grid, kda)
    }
    fn speculation(&self) -> Result<(), String> {
        self.inner.speculation()
    }
    fn verify(&mut self, step: Step) -> k3_engine::Result<Vec<f32>> {
        let rows: Vec<(u64, usize)> = step.seqs.iter().map(|s| (s.id, s.tokens.len())).collect();
        let out = self.inner.verify(step)?;
        if let Some(t) = &self.timeline {
            let v = self.config().text.vocab_size;
            let mut rest = out.chunks_exact(v);
            let mut t = t.lock().unwrap();
            for (id, n) in rows {
                t.entry(id).or_default().push(Entry::Verified(rest.by_ref().take(n).map(<[f32]>::to_vec).collect()));
            }
        }
        Ok(out)
    }
    fn rollback(&mut self, id: u64, drop: usize) -> k3_engine::Result<()> {
        self.inner.rollback(id, drop)
    }
    fn enable_mtp(&mut self) -> Result<(), String> {
        self.inner.enable_mtp()
    }
    fn enable_draft(&mut self, draft: Arc<k3_model::Model>) -> Result<(), String> {
        self.inner.enable_draft(draft)
    }
    fn draft(&mut self, id: u64, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> k3_engine::Result<usize> {
        let Some(t) = &self.timeline else { return self.inner.draft(id, next, k, choose) };
        let mut rows = Vec::new();
        let n = self.inner.draft(id, next, k, &mut |lg: &[f32]| {
            rows.push(lg.to_vec());
            choose(lg)
        })?;
        t.lock().unwrap().entry(id).or_default().push(Entry::Drafted(rows));
        Ok(n)
    }
    fn restore(&mut self, id: u64, cells: &[&Segment], snap: &KdaSnap) -> k3_engine::Result<()> {
        match &self.mutate {
            None => self.inner.restore(id, cells, snap)?,
            Some(mutate) => {
                let mut snap = snap.clone();
                let mut cells: Vec<Segment> = cells.iter().map(|c| (*c).clone()).collect();
                mutate(&mut cells, &mut snap);
                let refs: Vec<&Segment> = cells.iter().collect();
                self.inner.restore(id, &refs, &snap)?
            }
        }
        if let Some(after) = &self.after_restore {
            after(&mut self.inner, id);
        }
        Ok(())
    }
}
