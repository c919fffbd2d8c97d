//! `--speculative mtp` through the engine on the CPU runner (issue 22; around-backbone §5.1):
//! `k3 init` checkpoints of the tiny config with `num_nextn_predict_layers = 1` (random weights,
//! F32) —
//!
//! - greedy: the output equals plain greedy decoding's, tokens and log-probabilities bit for bit,
//!   for k = 1..4 with three requests batched (admitted while others decode), and drafts are
//!   both accepted and rejected (so the rollback runs);
//! - every draft the engine asked for — across chunked prefill, batching, a cancelled request, a
//!   greedy and a sampled request — has the logits `tests/support/mtp_ref.rs` (an f64 reference
//!   of §5.1 fed the target's hidden rows of the whole context) gives: the draft layer's state
//!   followed each sequence through its prefill chunks, verify steps and rollbacks;
//! - the prefix cache: a second turn resumed from the cache drafts exactly as when it runs cold
//!   (its draft state is captured and restored with the cells), and a restore whose entry lacks
//!   the draft state decodes without drafts, with plain decoding's output;
//! - sampling: with the MTP layer's `q`, the joint distribution of four sampled tokens over many
//!   seeds matches the model's exact distribution (χ² at the 0.001 level).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k3_engine::dist::runner::ThreadRunner;
use k3_engine::engine::ProposerFactory;
use k3_engine::spec::model::ModelProposer;
use k3_engine::spec::{Draft, DraftModel, Proposer, SpecConfig, SpecMethod};
use k3_engine::{Engine, EngineConfig, PrefixConfig, Request, Result, Sampler, SamplingParams};
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::mtp::MtpState;
use k3_model::{Checkpoint, ForwardOpts, Model};

#[path = "support/chi2.rs"]
mod chi2;
#[path = "support/drive.rs"]
mod drive;
#[path = "../../../tests/support/mtp_ref.rs"]
mod mtp_ref;
#[path = "support/recorder.rs"]
mod recorder;
use drive::{drive, greedy_sweep, plain_solo, Out};
use mtp_ref::MtpRef;

/// The tiny config with one MTP layer and a vocabulary of `vocab` ids (small, so that a random
/// draft layer's guesses are accepted now and then).
fn mtp_model(vocab: usize) -> (tempfile::TempDir, Checkpoint, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let mut ov = Overrides::default();
    ov.set.push(("num_nextn_predict_layers".into(), serde_json::json!(1)));
    ov.set.push(("vocab_size".into(), serde_json::json!(vocab)));
    let f = FloatDType::F32;
    let src = k3_model::config::builtin_config("tiny").unwrap();
    init(src, &ov, dir.path(), &InitOptions { seed: 7, dtype: f, experts: ExpertFormat::Float(f), shard_size: None }).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let m = Arc::new(Model::load(&ck).unwrap());
    (dir, ck, m)
}

const VOCAB: usize = 4;

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + seed * 5 + i * i) % VOCAB as u32).collect()
}

fn mtp_cfg(k: usize, adaptive: bool) -> EngineConfig {
    EngineConfig { spec: SpecConfig { method: SpecMethod::Mtp, num_tokens: k, adaptive }, ..Default::default() }
}

/// Three greedy requests admitted at steps 0, 1, 3 — their prefills alone, their decode rows
/// (drafted or not) verified together — equal each request decoded plainly alone, for k = 1..4.
#[test]
fn greedy_equals_plain() {
    let (_d, _ck, m) = mtp_model(VOCAB);
    let reqs: Vec<Request> = (0..3).map(|i| Request { ignore_eos: true, ..Request::new(prompt(9 + 5 * i, i as u32), SamplingParams::greedy(), 24) }).collect();
    let solo: Vec<Out> = reqs.iter().map(|r| plain_solo(&m, r)).collect();
    let (drafted, accepted) = greedy_sweep(&m, &reqs, &solo, |k| mtp_cfg(k, true));
    eprintln!("greedy: drafted {drafted}, accepted {accepted}");
    assert!(accepted > 0 && accepted < drafted, "drafted {drafted}, accepted {accepted}: both outcomes must occur");
}

/// A draft the engine asked for: the context, the drafted tokens, each position's logits, the
/// distributions returned.
type Asked = (Vec<u32>, Vec<u32>, Vec<Vec<f32>>, Option<Vec<Vec<f32>>>);

/// The MTP proposer, keeping every draft's context, tokens and logits.
struct Tapped {
    inner: ModelProposer,
    log: Arc<Mutex<Vec<Asked>>>,
}

/// A draft model that hands its logits to `log` on their way to the proposer.
struct Tap<'a> {
    inner: &'a mut dyn DraftModel,
    log: &'a mut Vec<Vec<f32>>,
}

impl DraftModel for Tap<'_> {
    fn run(&mut self, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize> {
        let log = &mut *self.log;
        self.inner.run(next, k, &mut |lg: &[f32]| {
            log.push(lg.to_vec());
            choose(lg)
        })
    }
}

impl Proposer for Tapped {
    fn propose(&mut self, context: &[u32], k: usize) -> Draft {
        self.inner.propose(context, k)
    }
    fn propose_on(&mut self, context: &[u32], k: usize, model: &mut dyn DraftModel) -> Result<Draft> {
        let mut lgs = Vec::new();
        let d = self.inner.propose_on(context, k, &mut Tap { inner: model, log: &mut lgs })?;
        self.log.lock().unwrap().push((context.to_vec(), d.tokens.clone(), lgs, d.probs.clone()));
        Ok(d)
    }
}

fn tapped(log: &Arc<Mutex<Vec<Asked>>>) -> ProposerFactory {
    let log = log.clone();
    Arc::new(move |r: &Request| Box::new(Tapped { inner: ModelProposer::new(&r.params), log: log.clone() }) as Box<dyn Proposer>)
}

/// Every recorded draft against the reference: the target's hidden rows of the context from
/// one fresh forward, the draft layer's rows computed from scratch. A sampled draft (`sampled`:
/// its request's parameters) carries `q`, the sampling distribution of its logits.
fn check_drafts(m: &Model, r: &MtpRef, asked: &[Asked], sampled: Option<&SamplingParams>, what: &str) {
    assert!(!asked.is_empty(), "{what}: nothing was drafted");
    for (c, (ctx, toks, lgs, probs)) in asked.iter().enumerate() {
        assert_eq!(lgs.len(), toks.len(), "{what}: one logits row per draft");
        if let (Some(q), Some(p)) = (probs, sampled) {
            assert_eq!(q.len(), toks.len(), "{what}: one q per sampled draft");
            for (q, lg) in q.iter().zip(lgs) {
                assert!(*q == Sampler::new(p.clone()).distribution(lg), "{what}: draft {c}: q is not the sampling distribution of the draft logits");
            }
        }
        let n = ctx.len() - 1;
        let mut st = m.new_state();
        st.mtp = Some(MtpState::new(m.config.text.hidden_size));
        m.forward(&ctx[..n], &mut st, ForwardOpts::default(), None).unwrap();
        let hid: Vec<Vec<f64>> = st.mtp.unwrap().hidden.chunks_exact(m.config.text.hidden_size).map(|r| r.iter().map(|&x| x as f64).collect()).collect();
        let want = r.draft_logits(ctx, &hid, toks);
        for (i, (g, w)) in lgs.iter().zip(&want).enumerate() {
            let scale = w.iter().fold(0f64, |a, x| a.max(x.abs())).max(1.0);
            let d = g.iter().zip(w).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
            assert!(d <= 5e-5 * scale, "{what}: draft {c} (context of {} tokens), position {i}: max |Δ| {d:.3e} against the reference", ctx.len());
        }
    }
}

/// Chunked prefill (5 tokens a chunk), a greedy and a sampled request batched, the sampled one
/// cancelled mid-way and a third admitted after: every draft matches the reference.
#[test]
fn drafts_follow_every_sequence() {
    let (_d, ck, m) = mtp_model(VOCAB);
    let r = MtpRef::load(&ck);
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut e = Engine::new(m.clone(), None, EngineConfig { prefill_chunk: 5, max_batch: 3, ..mtp_cfg(3, false) });
    e.set_proposer(tapped(&log));
    let sampled = SamplingParams { temperature: 0.9, top_k: 3, seed: Some(4), ..Default::default() };
    let reqs = [
        Request { ignore_eos: true, ..Request::new(prompt(13, 1), SamplingParams::greedy(), 20) },
        Request { ignore_eos: true, ..Request::new(prompt(11, 2), sampled.clone(), 40) },
        Request { ignore_eos: true, ..Request::new(prompt(7, 3), SamplingParams::greedy(), 12) },
    ];
    let (outs, stats) = drive(&mut e, &reqs, &[0, 1, 9], &[None, Some(8), None]);
    assert!(outs[1].len() < 40, "the sampled request was cancelled");
    let (d, a) = stats.iter().flatten().fold((0, 0), |x, s| (x.0 + s.spec.drafted, x.1 + s.spec.accepted));
    assert!(a > 0 && a < d, "drafted {d}, accepted {a}: both outcomes must occur");
    for s in stats.iter().flatten() {
        // Every decode step drafts but the last (no room left): the draft state never got lost.
        assert!(s.spec.spec_steps + 1 >= s.spec.steps, "a request stopped drafting: {:?}", s.spec);
    }
    let asked = log.lock().unwrap().clone();
    for r in &reqs {
        assert!(asked.iter().any(|a| a.0.starts_with(&r.prompt)), "every request drafted");
    }
    assert!(asked.iter().any(|a| a.3.is_some()) && asked.iter().any(|a| a.3.is_none()), "greedy and sampled drafts");
    check_drafts(&m, &r, &asked, Some(&sampled), "engine");
}

/// Two turns through one engine with the prefix cache (grid 4): the second resumes from the
/// first's cells and drafts exactly (tokens and logits bit for bit) as it does cold, matching
/// the reference; a restore from entries stripped of the draft state drafts nothing and keeps
/// plain decoding's output.
#[test]
fn prefix_cache_keeps_the_draft_state() {
    let (_d, ck, m) = mtp_model(VOCAB);
    let r = MtpRef::load(&ck);
    let pc = Some(PrefixConfig::new(4, 64 << 20));
    let turn1 = Request { ignore_eos: true, ..Request::new(prompt(14, 5), SamplingParams::greedy(), 10) };
    let turn2 = |out1: &Out| {
        let mut p = turn1.prompt.clone();
        p.extend(out1.iter().map(|x| x.0));
        p.extend([3, 1, 2]);
        Request { ignore_eos: true, ..Request::new(p, SamplingParams::greedy(), 12) }
    };
    // strip: the runner's restores lose the draft state (a mutation of what the cache hands it).
    let run = |turns: &[Request], strip: bool| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let rec_log = Default::default();
        let mut rec = recorder::Rec::new(ThreadRunner::single(m.clone(), Default::default()), &rec_log);
        if strip {
            rec.mutate = Some(Box::new(|cells: &mut Vec<k3_engine::prefix::Segment>, snap: &mut k3_engine::prefix::KdaSnap| {
                cells.iter_mut().for_each(|c| c.mtp = None);
                snap.mtp_hidden = None;
            }));
        }
        let mut e = Engine::with_runner(Box::new(rec), None, EngineConfig { prefix: pc.clone(), ..mtp_cfg(3, false) });
        e.set_proposer(tapped(&log));
        let mut outs = Vec::new();
        let mut cached = Vec::new();
        for t in turns {
            let (o, st) = drive(&mut e, std::slice::from_ref(t), &[0], &[None]);
            log.lock().unwrap().push((Vec::new(), Vec::new(), Vec::new(), None)); // a turn's end
            outs.push(o.into_iter().next().unwrap());
            let st = st[0].as_ref().unwrap();
            cached.push((st.cached_tokens, st.spec.drafted));
        }
        let asked = log.lock().unwrap().clone();
        (outs, cached, asked)
    };
    let out1 = plain_solo(&m, &turn1);
    let t2 = turn2(&out1);
    let (warm_out, warm, warm_asked) = run(&[turn1.clone(), t2.clone()], false);
    let (cold_out, cold, cold_asked) = run(std::slice::from_ref(&t2), false);
    assert!(warm[1].0 > 0 && cold[0].0 == 0, "the second turn resumes from the cache ({warm:?}, cold {cold:?})");
    assert!(warm[1].1 > 0, "the resumed turn drafts");
    assert_eq!(warm_out[1], cold_out[0]);
    // The second turn's drafts: after the first turn's end marker.
    let turn_of = |a: &[Asked], i: usize| -> Vec<Asked> { a.split(|x| x.0.is_empty()).nth(i).unwrap().to_vec() };
    let (w2, c2) = (turn_of(&warm_asked, 1), turn_of(&cold_asked, 0));
    let bits = |a: &[Asked]| a.iter().map(|x| (x.1.clone(), x.2.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>())).collect::<Vec<_>>();
    assert!(bits(&w2) == bits(&c2), "the resumed turn drafts differently from a cold run");
    check_drafts(&m, &r, &w2, None, "resumed turn");
    // Stripped of the draft state: no drafts after the resume, plain output.
    let (strip_out, strip, _) = run(&[turn1, t2], true);
    assert!(strip[1].0 > 0, "the stripped run resumes from the cache too");
    assert_eq!(strip[1].1, 0, "a sequence restored without its draft state must not draft");
    assert_eq!(strip_out[1], warm_out[1]);
}

/// Sampling with the MTP layer's drafts and `q`s: the joint distribution of 4 tokens (top-3)
/// over 1500 seeds matches the exact one, as plain sampling's does.
#[test]
fn sampled_distribution_matches_plain() {
    const N: usize = 4;
    const RUNS: u64 = 1500;
    let (_d, _ck, m) = mtp_model(VOCAB);
    let p0 = prompt(10, 9);
    let params = SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() };
    let exact = chi2::exact(&m, &p0, &params, N);
    for spec in [false, true] {
        let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
        let (mut drafted, mut accepted) = (0, 0);
        for seed in 0..RUNS {
            let cfg = if spec { mtp_cfg(3, false) } else { EngineConfig::default() };
            let mut e = Engine::new(m.clone(), None, cfg);
            let req = Request { ignore_eos: true, ..Request::new(p0.clone(), SamplingParams { seed: Some(seed), ..params.clone() }, N) };
            let (out, _, st) = e.generate(req, |_| {}).unwrap();
            drafted += st.spec.drafted;
            accepted += st.spec.accepted;
            *counts.entry(out).or_default() += 1;
        }
        if spec {
            assert!(accepted > 0 && accepted < drafted, "drafted {drafted}, accepted {accepted}: both outcomes must occur");
        }
        let (x2, cells, crit) = chi2::chi2(&exact, &counts, N, RUNS);
        eprintln!("mtp speculative={spec}: χ² {x2:.1} over {cells} cells (0.001 point {crit:.1}); drafted {drafted}, accepted {accepted}");
        assert!(x2 < crit, "speculative={spec}: χ² {x2:.1} over {cells} cells ≥ {crit:.1} (drafted {drafted}, accepted {accepted})");
    }
}

/// `--speculative mtp` on a checkpoint without an MTP layer: the engine says why (naming the
/// config field) and decodes plainly.
#[test]
fn without_an_mtp_layer_decodes_plainly() {
    let dir = tempfile::tempdir().unwrap();
    let f = FloatDType::F32;
    init(
        k3_model::config::builtin_config("tiny").unwrap(),
        &Overrides::default(),
        dir.path(),
        &InitOptions { seed: 7, dtype: f, experts: ExpertFormat::Float(f), shard_size: None },
    )
    .unwrap();
    let m = Arc::new(Model::load(&Checkpoint::open(dir.path()).unwrap()).unwrap());
    assert!(m.mtp.is_none());
    let mut e = Engine::new(m.clone(), None, mtp_cfg(3, true));
    let why = e.speculating().unwrap_err();
    assert!(why.contains("num_nextn_predict_layers"), "{why}");
    let req = Request::new(vec![5, 9, 12, 3], SamplingParams::greedy(), 8);
    let (out, _, st) = e.generate(req.clone(), |_| {}).unwrap();
    assert_eq!(st.spec.drafted, 0);
    assert_eq!(out, Engine::new(m, None, EngineConfig::default()).generate(req, |_| {}).unwrap().0);
}
