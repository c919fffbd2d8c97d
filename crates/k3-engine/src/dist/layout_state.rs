//! A sequence state of a parallel layout, rank by rank (the prefix cache on ranks as threads,
//! issue 21): how the cache's one stored state ([`Capture`]: grid cells of MLA/DSA rows, a KDA
//! snapshot) is joined from every rank's part after a capture ([`join`]) and cut into each
//! rank's part for a restore ([`part`]), and the byte form a part travels in (the answer to
//! [`Command::Capture`], the payload of [`Command::Restore`]).
//!
//! What a rank holds of a sequence (text-backbone §3.8, §4; `k3_model::parallel`): its
//! `SeqState` has a slot for every layer of the model, filled for its stage's layers only. A KDA
//! layer's conv tails `[3][K−1, D_r]` and recurrent state `[nh_r, hd, hd]` cover the rank's
//! heads `tp_share(nh)` — all heads with `--tp 1`, so the ranks of an expert-parallel stage hold
//! equal copies; an MLA/DSA layer's latent rows `[n, r + dr]` and indexer keys `[n, id]` are
//! whole on every rank of its stage (equal copies). So the stored state keeps:
//! - per MLA/DSA layer, the rows of its stage's first rank (one copy);
//! - per KDA layer, its stage's first rank's state with `--tp 1` ([`SnapLayer::Cpu`]), else
//!   every rank's heads in tensor-parallel order ([`SnapLayer::Ranks`]).
//!
//! A restore gives each rank its stage's layers (the rows, its own heads) and, for the other
//! layers, the empty states a fresh state has. Between threads the parts are not encoded: the
//! stored rows are the first rank's own pages, and every part of the stage holds those same
//! pages (`StoredPage` handles), which each rank's restore takes by reference. Each rank checks that its part has its shapes
//! (`prefix::state::restore`). The layout is in the cache's digest (`ThreadRunner::prefix_support`),
//! so a state is never restored into another layout.
//!
//! Byte form (little-endian; `f32s` / `u16s` / `bytes`: `u64:n` then `n` values):
//!
//! ```text
//! capture  u64:from u64:to  u32:cells  cells × { u32:layers  layers × seg }  u8:has_snap  [snap]
//! seg      u8:0 (KDA) | u8:1 f32s:latent f32s:index_keys
//! snap     u64:at  u32:layers  layers × { u8:0 (MLA) | u8:1 kda | u8:2 bytes:conv bytes:state
//!                                       | u8:3 u32:n  n × kda }
//! kda      f32s:conv[0] f32s:conv[1] f32s:conv[2]  u8:0 f32s:state | u8:1 u16s:state (bf16)
//! ```
//!
//! A KDA state travels without its verify snapshots (a capture follows a plain forward, which
//! keeps none). A device runner's cell (device pages, `Segment::pages`) never travels: on a
//! multi-process GPU layout every rank keeps its own parts in its own process (`dist::kept`).
//!
//! [`Command::Capture`]: super::step::Command::Capture
//! [`Command::Restore`]: super::step::Command::Restore

use k3_model::layers::kda::{KdaState, StateBuf, StateDType};
use k3_model::layers::pages::StoredPage;
use k3_model::parallel::Parallel;
use k3_model::Config;

use super::step::{bad, Reader};
use crate::error::{EngineError, Result};
use crate::prefix::{Capture, KdaSnap, SegLayer, Segment, SnapLayer};

/// Joins every rank's capture of one sequence (`parts[r]`: rank `r`'s) into the layout's stored
/// state (see the module doc).
pub fn join(par: Parallel, cfg: &Config, mut parts: Vec<Capture>) -> Result<Capture> {
    let plans = par.plans(cfg)?;
    let layers = cfg.layers.len();
    if parts.len() != plans.len() {
        return Err(EngineError::Internal(format!("{} captured parts for a layout of {} ranks", parts.len(), plans.len())));
    }
    let (from, to, n, with_snap) = (parts[0].from, parts[0].to, parts[0].cells.len(), parts[0].kda.is_some());
    for (r, p) in parts.iter().enumerate() {
        let shaped = p.cells.iter().all(|c| c.layers.len() == layers) && p.kda.as_ref().is_none_or(|s| s.layers.len() == layers && s.at == to);
        if p.from != from || p.to != to || p.cells.len() != n || p.kda.is_some() != with_snap || !shaped {
            return Err(EngineError::Internal(format!(
                "rank {r} captured [{}, {}) in {} cells (snapshot: {}) where rank 0 captured [{from}, {to}) in {n} cells (snapshot: {with_snap}), or for another model",
                p.from,
                p.to,
                p.cells.len(),
                p.kda.is_some()
            )));
        }
    }
    let mut cells: Vec<Segment> = (0..n).map(|_| Segment { layers: Vec::with_capacity(layers), pages: None, mtp: None, draft: None, remote: None }).collect();
    let mut snap = Vec::with_capacity(layers);
    for l in 0..layers {
        // The ranks of the stage that runs layer `l`, in the order of their index in it.
        let holders: Vec<usize> = plans.iter().filter(|p| p.holds_layer(l)).map(|p| p.rank).collect();
        let owner = *holders.first().ok_or_else(|| EngineError::Internal(format!("layer {l} is on no rank of the layout")))?;
        for (cell, c) in cells.iter_mut().zip(&mut parts[owner].cells) {
            cell.layers.push(std::mem::replace(&mut c.layers[l], SegLayer::Kda));
        }
        if !with_snap {
            continue;
        }
        let mut take = |r: usize| parts[r].kda.as_mut().map_or(SnapLayer::Mla, |s| std::mem::replace(&mut s.layers[l], SnapLayer::Mla));
        snap.push(match take(owner) {
            SnapLayer::Cpu(first) if par.tp > 1 => {
                let mut heads = vec![first];
                for &r in &holders[1..] {
                    match take(r) {
                        SnapLayer::Cpu(k) => heads.push(k),
                        _ => return Err(EngineError::Internal(format!("layer {l}: rank {r} captured no KDA state where rank {owner} did"))),
                    }
                }
                SnapLayer::Ranks(heads)
            }
            s @ (SnapLayer::Cpu(_) | SnapLayer::Mla) => s,
            _ => return Err(EngineError::Internal(format!("layer {l}: rank {owner} captured a device runner's snapshot"))),
        });
    }
    let kda = with_snap.then_some(KdaSnap { at: to, layers: snap, mtp_hidden: None, draft: None, remote: None });
    Ok(Capture { from, to, cells, kda })
}

/// Rank `rank`'s part of a stored state (`cells` before the snapshot, `snap`), as its
/// `Worker::restore` takes it: its stage's layers, its own KDA heads, empty states (`kda`
/// dtype) for the layers of other stages.
pub fn part(par: Parallel, cfg: &Config, rank: usize, kda: StateDType, cells: &[&Segment], snap: &KdaSnap) -> Result<Capture> {
    let plan = par.rank(cfg, rank)?;
    let layers = cfg.layers.len();
    let bad = |why: String| EngineError::Internal(format!("prefix restore on rank {rank}: {why} (the stored state was made for another model or layout)"));
    if snap.layers.len() != layers || cells.iter().any(|c| c.layers.len() != layers) {
        return Err(bad(format!("a stored state of {} layers for a model of {layers}", snap.layers.len())));
    }
    let cells = cells
        .iter()
        .map(|c| Segment {
            layers: c
                .layers
                .iter()
                .enumerate()
                .map(|(l, x)| match x {
                    SegLayer::Mla { .. } if !plan.holds_layer(l) => {
                        SegLayer::Mla { latent: StoredPage::from_values(Vec::new()), index_keys: StoredPage::from_values(Vec::new()) }
                    }
                    x => x.clone(),
                })
                .collect(),
            pages: None,
            mtp: None,
            draft: None,
            remote: None,
        })
        .collect();
    let snap_layers = snap
        .layers
        .iter()
        .enumerate()
        .map(|(l, x)| match (plan.holds_layer(l), x) {
            (_, SnapLayer::Mla) => Ok(SnapLayer::Mla),
            (false, SnapLayer::Cpu(_) | SnapLayer::Ranks(_)) => Ok(SnapLayer::Cpu(KdaState::with_heads(cfg, 0, kda))),
            (true, SnapLayer::Cpu(k)) if par.tp == 1 => Ok(SnapLayer::Cpu(k.clone())),
            (true, SnapLayer::Ranks(v)) if par.tp > 1 && v.len() == par.tp => Ok(SnapLayer::Cpu(v[plan.tp_rank].clone())),
            _ => Err(bad(format!("layer {l}'s KDA snapshot is not one of this layout's"))),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Capture { from: 0, to: snap.at, cells, kda: Some(KdaSnap { at: snap.at, layers: snap_layers, mtp_hidden: None, draft: None, remote: None }) })
}

fn put_u64(b: &mut Vec<u8>, x: usize) {
    b.extend_from_slice(&(x as u64).to_le_bytes());
}

fn put_f32s(b: &mut Vec<u8>, v: &[f32]) {
    put_u64(b, v.len());
    b.reserve(4 * v.len());
    v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
}

fn put_bytes(b: &mut Vec<u8>, v: &[u8]) {
    put_u64(b, v.len());
    b.extend_from_slice(v);
}

fn put_kda(b: &mut Vec<u8>, k: &KdaState) {
    k.conv.iter().for_each(|c| put_f32s(b, c));
    match &k.s {
        StateBuf::F32(s) => {
            b.push(0);
            put_f32s(b, s);
        }
        StateBuf::Bf16(s) => {
            b.push(1);
            put_u64(b, s.len());
            s.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        }
    }
}

/// Appends `c`'s byte form (see the module doc).
pub fn put_capture(b: &mut Vec<u8>, c: &Capture) {
    put_u64(b, c.from);
    put_u64(b, c.to);
    b.extend_from_slice(&(c.cells.len() as u32).to_le_bytes());
    for cell in &c.cells {
        b.extend_from_slice(&(cell.layers.len() as u32).to_le_bytes());
        for l in &cell.layers {
            match l {
                SegLayer::Kda => b.push(0),
                SegLayer::Mla { latent, index_keys } => {
                    b.push(1);
                    put_f32s(b, latent.values());
                    put_f32s(b, index_keys.values());
                }
            }
        }
    }
    let Some(s) = &c.kda else { return b.push(0) };
    b.push(1);
    put_u64(b, s.at);
    b.extend_from_slice(&(s.layers.len() as u32).to_le_bytes());
    for l in &s.layers {
        match l {
            SnapLayer::Mla => b.push(0),
            SnapLayer::Cpu(k) => {
                b.push(1);
                put_kda(b, k);
            }
            SnapLayer::Raw { conv, state } => {
                b.push(2);
                put_bytes(b, conv);
                put_bytes(b, state);
            }
            SnapLayer::Ranks(v) => {
                b.push(3);
                b.extend_from_slice(&(v.len() as u32).to_le_bytes());
                v.iter().for_each(|k| put_kda(b, k));
            }
        }
    }
}

/// `c`'s byte form alone.
pub fn encode_capture(c: &Capture) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + c.cells.iter().map(Segment::bytes).sum::<usize>() + c.kda.as_ref().map_or(0, KdaSnap::bytes));
    put_capture(&mut b, c);
    b
}

/// Parses [`encode_capture`]'s bytes (all of them).
pub fn decode_capture(bytes: &[u8]) -> Result<Capture> {
    let mut r = Reader::new(bytes);
    let c = take_capture(&mut r)?;
    r.end()?;
    Ok(c)
}

fn take_f32s(r: &mut Reader<'_>, what: &str) -> Result<Vec<f32>> {
    Ok(r.array(4, what)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn take_kda(r: &mut Reader<'_>) -> Result<KdaState> {
    let conv = [take_f32s(r, "conv tails")?, take_f32s(r, "conv tails")?, take_f32s(r, "conv tails")?];
    let s = match r.u8("the state dtype")? {
        0 => StateBuf::F32(take_f32s(r, "a recurrent state")?),
        1 => StateBuf::Bf16(r.array(2, "a bf16 recurrent state")?.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
        t => return Err(bad(format!("state dtype {t} (0 f32, 1 bf16)"))),
    };
    Ok(KdaState { conv, s, snapshots: Vec::new() })
}

/// Reads one capture's byte form from `r`.
pub(super) fn take_capture(r: &mut Reader<'_>) -> Result<Capture> {
    let (from, to) = (r.usize("the first token")?, r.usize("the end token")?);
    let n = r.count(4, "cells")?;
    let mut cells = Vec::with_capacity(n);
    for _ in 0..n {
        let m = r.count(1, "cell layers")?;
        let layers = (0..m)
            .map(|_| match r.u8("a cell layer's tag")? {
                0 => Ok(SegLayer::Kda),
                1 => Ok(SegLayer::Mla {
                    latent: StoredPage::from_values(take_f32s(r, "latent rows")?),
                    index_keys: StoredPage::from_values(take_f32s(r, "indexer keys")?),
                }),
                t => Err(bad(format!("cell layer tag {t} (0 KDA, 1 MLA)"))),
            })
            .collect::<Result<Vec<_>>>()?;
        cells.push(Segment { layers, pages: None, mtp: None, draft: None, remote: None });
    }
    let kda = match r.u8("the snapshot flag")? {
        0 => None,
        1 => {
            let at = r.usize("the snapshot's token")?;
            let m = r.count(1, "snapshot layers")?;
            let layers = (0..m)
                .map(|_| match r.u8("a snapshot layer's tag")? {
                    0 => Ok(SnapLayer::Mla),
                    1 => Ok(SnapLayer::Cpu(take_kda(r)?)),
                    2 => Ok(SnapLayer::Raw { conv: r.array(1, "conv tails")?.to_vec(), state: r.array(1, "a recurrent state")?.to_vec() }),
                    3 => {
                        let k = r.count(25, "ranks' KDA states")?;
                        Ok(SnapLayer::Ranks((0..k).map(|_| take_kda(r)).collect::<Result<_>>()?))
                    }
                    t => Err(bad(format!("snapshot layer tag {t} (0 MLA, 1 KDA, 2 raw, 3 ranks)"))),
                })
                .collect::<Result<Vec<_>>>()?;
            Some(KdaSnap { at, layers, mtp_hidden: None, draft: None, remote: None })
        }
        f => return Err(bad(format!("snapshot flag {f} (0 or 1)"))),
    };
    Ok(Capture { from, to, cells, kda })
}

#[cfg(test)]
mod tests {
    use super::*;
    use k3_model::config::builtin_config;
    use k3_model::layers::kda::KdaState;

    fn cfg() -> Config {
        Config::from_json(builtin_config("tiny").unwrap()).unwrap()
    }

    /// Rank `rank`'s capture of 2 cells of 2 tokens from token 4 on, with values that say where
    /// they come from (rank, layer, cell), as the ranks of `par` hold them.
    fn rank_capture(par: Parallel, cfg: &Config, rank: usize) -> Capture {
        let plan = par.rank(cfg, rank).unwrap();
        let heads = plan.tp_share(cfg.text.linear_attn_config.num_heads).len();
        let is_kda = |l: usize| matches!(cfg.layers[l].mixer, k3_model::config::Mixer::Kda);
        let stage_value = |l: usize, k: usize| (100 * l + k) as f32; // equal on every rank of a stage
        let cells = (0..2)
            .map(|k| Segment {
                layers: (0..cfg.layers.len())
                    .map(|l| match (is_kda(l), plan.holds_layer(l)) {
                        (true, _) => SegLayer::Kda,
                        (false, true) => SegLayer::Mla {
                            latent: StoredPage::from_values(vec![stage_value(l, k); 6]),
                            index_keys: StoredPage::from_values(vec![-stage_value(l, k); 2]),
                        },
                        (false, false) => SegLayer::Mla { latent: StoredPage::from_values(Vec::new()), index_keys: StoredPage::from_values(Vec::new()) },
                    })
                    .collect(),
                pages: None,
                mtp: None,
                draft: None,
                remote: None,
            })
            .collect();
        let layers = (0..cfg.layers.len())
            .map(|l| match is_kda(l) {
                true => {
                    let mut k = KdaState::with_heads(cfg, if plan.holds_layer(l) { heads } else { 0 }, StateDType::F32);
                    let tag = (1000 * plan.tp_rank + l) as f32; // a rank's own heads differ from its peers'
                    k.conv[1].iter_mut().for_each(|x| *x = tag);
                    if let StateBuf::F32(s) = &mut k.s {
                        s.iter_mut().enumerate().for_each(|(i, x)| *x = tag + i as f32);
                    }
                    SnapLayer::Cpu(k)
                }
                false => SnapLayer::Mla,
            })
            .collect();
        Capture { from: 4, to: 8, cells, kda: Some(KdaSnap { at: 8, layers, mtp_hidden: None, draft: None, remote: None }) }
    }

    /// Every layout's captures joined, then cut into the ranks' parts, give each rank its own
    /// state back (the bytes it captured), and the joined state keeps one copy of the rows.
    #[test]
    fn join_then_part_gives_each_rank_its_own() {
        let cfg = cfg();
        for par in [Parallel::new(2, None, 1), Parallel::new(1, Some(2), 1), Parallel::new(1, None, 2), Parallel::new(2, None, 2), Parallel::new(2, Some(1), 1)]
        {
            let par = par.unwrap();
            let parts: Vec<Capture> = (0..par.world()).map(|r| rank_capture(par, &cfg, r)).collect();
            let joined = join(par, &cfg, parts.clone()).unwrap();
            assert_eq!((joined.from, joined.to, joined.cells.len()), (4, 8, 2));
            let one: usize = (0..par.world()).filter(|&r| r % par.stage_ranks() == 0).map(|r| parts[r].cells.iter().map(Segment::bytes).sum::<usize>()).sum();
            assert_eq!(joined.cells.iter().map(Segment::bytes).sum::<usize>(), one, "{par:?}: one copy of the rows");
            // Through the byte form, as it travels.
            let joined = decode_capture(&encode_capture(&joined)).unwrap();
            let cells: Vec<&Segment> = joined.cells.iter().collect();
            for (r, want) in parts.iter().enumerate() {
                let got = part(par, &cfg, r, StateDType::F32, &cells, joined.kda.as_ref().unwrap()).unwrap();
                let want = Capture { from: 0, ..want.clone() };
                assert_eq!(encode_capture(&got), encode_capture(&want), "{par:?} rank {r}");
            }
        }
    }

    #[test]
    fn mismatched_parts_are_errors() {
        let cfg = cfg();
        let par = Parallel::new(2, None, 1).unwrap();
        let parts: Vec<Capture> = (0..2).map(|r| rank_capture(par, &cfg, r)).collect();
        assert!(join(par, &cfg, parts[..1].to_vec()).unwrap_err().to_string().contains("1 captured parts"));
        let mut short = parts.clone();
        short[1].cells.pop();
        assert!(join(par, &cfg, short).unwrap_err().to_string().contains("rank 1 captured"));
        // A one-rank snapshot (a plain KDA state) is not a --tp 2 layout's.
        let one = rank_capture(Parallel::SINGLE, &cfg, 0);
        let cells: Vec<&Segment> = one.cells.iter().collect();
        let e = part(par, &cfg, 0, StateDType::F32, &cells, one.kda.as_ref().unwrap()).unwrap_err().to_string();
        assert!(e.contains("another model or layout"), "{e}");
    }

    #[test]
    fn bad_bytes_are_errors() {
        let par = Parallel::new(2, None, 1).unwrap();
        let cfg = cfg();
        let mut c = join(par, &cfg, (0..2).map(|r| rank_capture(par, &cfg, r)).collect()).unwrap();
        c.cells[0].layers[0] = SegLayer::Mla { latent: StoredPage::from_values(vec![1.0, 2.0, 3.0]), index_keys: StoredPage::from_values(vec![]) };
        if let Some(SnapLayer::Ranks(v)) = c.kda.as_mut().unwrap().layers.first_mut() {
            v[1].s = StateBuf::Bf16(vec![7, 8]);
        }
        let b = encode_capture(&c);
        assert_eq!(encode_capture(&decode_capture(&b).unwrap()), b);
        for n in 0..b.len() {
            assert!(decode_capture(&b[..n]).unwrap_err().to_string().starts_with("step message"), "{n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_capture(&long).unwrap_err().to_string().contains("after the end"));
        // A length far beyond the bytes left is refused before anything is allocated.
        let mut huge = b.clone();
        huge[25..33].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_capture(&huge).is_err());
        for i in (0..b.len()).step_by(7) {
            let mut y = b.clone();
            y[i] ^= 0xff;
            let _ = decode_capture(&y);
        }
    }
}
