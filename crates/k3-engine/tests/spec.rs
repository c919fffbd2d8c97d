//! Speculative decoding through the engine (issue 22), on the CPU runner:
//!
//! - greedy with n-gram / suffix drafts, k = 1..8, emits plain greedy decoding's tokens, and
//!   every emitted token's logits row is bit-identical to plain decoding's (a recording runner
//!   keeps every row the engine received) — on the golden K3 MXFP4 fixture and `k3 init`
//!   checkpoints of the tiny configs (F32, MXFP4 experts, K3.1 DSA with a selecting top-k),
//!   with the K3 / K3.1 f32 golden fixtures as ignored full-golden tests;
//! - continuous batching: requests admitted while others decode, drafted and plain rows in one
//!   verify forward, each sequence = its solo plain run, bit for bit;
//! - sampling: with a proposer that drafts the second most likely token (accepted often, not
//!   always), the joint distribution of four sampled tokens over many seeds matches the
//!   model's exact distribution (χ² at the 0.001 level), as plain sampling's does;
//! - parallel layouts (ranks as threads: `--tp 2`, `--pp 2`, `--tp 2 --pp 2`): greedy with
//!   k = 1 and 4, alone and with continuous batching, = plain greedy on the same layout bit for
//!   bit; a verify then a rollback leaves every rank's state byte-equal to plain decode steps'.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use k3_engine::dist::layout_state::encode_capture;
use k3_engine::dist::runner::{Runner, Step, StepSeq, ThreadRunner};
use k3_engine::spec::{Draft, Proposer, SpecConfig, SpecMethod};
use k3_engine::{Engine, EngineConfig, Event, Request, Result, SamplingParams};
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::kda::StateDType;
use k3_model::{Checkpoint, Config, Model, Parallel};

#[path = "../../../tests/support/golden.rs"]
mod golden;
use golden::fixture;
#[path = "support/chi2.rs"]
mod chi2;
#[path = "support/replay.rs"]
mod replay;
use replay::replay;

/// One forward the engine ran: (sequence, rows of logits it got) in step order, and the logits.
type Call = (Vec<(u64, usize)>, Vec<f32>);

/// A runner that records every logits row it returns.
struct Rec {
    inner: ThreadRunner,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Rec {
    fn record(&self, step: &Step, logits: &[f32]) {
        let rows = step.seqs.iter().map(|s| (s.id, if step.last_only { 1 } else { s.tokens.len() })).collect();
        self.calls.lock().unwrap().push((rows, logits.to_vec()));
    }
}

impl Runner for Rec {
    fn config(&self) -> &Config {
        self.inner.config()
    }
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.inner.embed(ids)
    }
    fn release(&mut self, id: u64) {
        self.inner.release(id)
    }
    fn forward(&mut self, step: Step) -> Result<Vec<f32>> {
        let out = self.inner.forward(step.clone())?;
        self.record(&step, &out);
        Ok(out)
    }
    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }
    fn speculation(&self) -> std::result::Result<(), String> {
        self.inner.speculation()
    }
    fn verify(&mut self, step: Step) -> Result<Vec<f32>> {
        let out = self.inner.verify(step.clone())?;
        self.record(&step, &out);
        Ok(out)
    }
    fn rollback(&mut self, id: u64, drop: usize) -> Result<()> {
        self.inner.rollback(id, drop)
    }
}

/// A sequence's emitted tokens and, for each, the logits row it was chosen from.
type Trace = HashMap<u64, Vec<(u32, Vec<f32>)>>;

/// Drives an engine over one rank of `model` to the end (see [`drive_on`]).
fn drive(model: &Arc<Model>, cfg: EngineConfig, reqs: &[Request], at: &[usize]) -> (Vec<u64>, Trace, Vec<k3_engine::SeqStats>) {
    drive_on(ThreadRunner::single(model.clone(), cfg.kda_state), cfg, reqs, at)
}

/// Drives an engine over `runner` to the end, adding `reqs[i]` before step `at[i]`; every event
/// gets its row.
fn drive_on(runner: ThreadRunner, cfg: EngineConfig, reqs: &[Request], at: &[usize]) -> (Vec<u64>, Trace, Vec<k3_engine::SeqStats>) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let v = runner.config().text.vocab_size;
    let rec = Rec { inner: runner, calls: calls.clone() };
    let mut e = Engine::with_runner(Box::new(rec), None, cfg);
    if let Some(f) = FACTORY.with(|c| c.borrow_mut().take()) {
        e.set_proposer(f);
    }
    let mut ids = vec![0u64; reqs.len()];
    let mut trace: Trace = HashMap::new();
    let mut stats = Vec::new();
    let mut step = 0;
    while step == 0 || e.has_work() || ids.contains(&0) {
        for (i, r) in reqs.iter().enumerate() {
            if at[i] == step {
                ids[i] = e.add(r.clone()).unwrap();
            }
        }
        let evs: Vec<Event> = e.step().unwrap();
        let made: Vec<Call> = std::mem::take(&mut *calls.lock().unwrap());
        let mut taken: HashMap<u64, usize> = HashMap::new();
        for ev in &evs {
            let k = taken.entry(ev.seq).or_default();
            let (rows, lg) = made.iter().find(|(r, _)| r.iter().any(|x| x.0 == ev.seq)).expect("an event without a forward");
            let off: usize = rows.iter().take_while(|x| x.0 != ev.seq).map(|x| x.1).sum::<usize>() + *k;
            trace.entry(ev.seq).or_default().push((ev.token, lg[off * v..(off + 1) * v].to_vec()));
            *k += 1;
        }
        stats.extend(e.take_finished_stats().into_iter().map(|x| x.1));
        step += 1;
        assert!(step < 2000);
    }
    assert_eq!(e.state_bytes(), 0);
    (ids, trace, stats)
}

fn spec_cfg(method: SpecMethod, k: usize) -> EngineConfig {
    EngineConfig { spec: SpecConfig { method, num_tokens: k, adaptive: true }, ..Default::default() }
}

/// A prompt that repeats itself, so that drafts are found.
fn prompt(vocab: u32, seed: u32) -> Vec<u32> {
    let unit: Vec<u32> = (0..5).map(|i| (seed * 31 + i * 57 + 3) % vocab).collect();
    unit.iter().cycle().take(17).copied().collect()
}

fn same_trace(a: &[(u32, Vec<f32>)], b: &[(u32, Vec<f32>)], what: &str) {
    assert_eq!(a.iter().map(|x| x.0).collect::<Vec<_>>(), b.iter().map(|x| x.0).collect::<Vec<_>>(), "{what}: tokens differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(x.1.iter().zip(&y.1).all(|(p, q)| p.to_bits() == q.to_bits()), "{what}: logits of token {i} differ");
    }
}

/// Like [`drive`] with a proposer factory.
fn drive_with(
    model: &Arc<Model>,
    cfg: EngineConfig,
    reqs: &[Request],
    at: &[usize],
    f: Option<k3_engine::engine::ProposerFactory>,
) -> (Vec<u64>, Trace, Vec<k3_engine::SeqStats>) {
    FACTORY.with(|c| *c.borrow_mut() = f);
    drive(model, cfg, reqs, at)
}

thread_local! {
    static FACTORY: std::cell::RefCell<Option<k3_engine::engine::ProposerFactory>> = const { std::cell::RefCell::new(None) };
}

/// Greedy: plain, then n-gram for k = 1..8, suffix for k = 3, 8 and the replay proposer for
/// k = 1..8 — every run's tokens and logits rows equal plain's; the replay runs must see drafts
/// both accepted and rejected, so the rollback is exercised.
fn greedy_equal(model: Arc<Model>, what: &str) {
    let vocab = model.config.text.vocab_size as u32;
    let req = Request::new(prompt(vocab, 1), SamplingParams::greedy(), 48);
    let (pi, plain, _) = drive(&model, EngineConfig::default(), std::slice::from_ref(&req), &[0]);
    let out: Vec<u32> = plain[&pi[0]].iter().map(|x| x.0).collect();
    let (mut drafted, mut accepted) = (0, 0);
    let runs: Vec<(SpecMethod, usize, bool)> = (1..=8)
        .map(|k| (SpecMethod::Ngram, k, false))
        .chain([(SpecMethod::Suffix, 3, false), (SpecMethod::Suffix, 8, false)])
        .chain((1..=8).map(|k| (SpecMethod::Ngram, k, true)))
        .collect();
    for (m, k, rp) in runs {
        let f = rp.then(|| replay(HashMap::from([(req.prompt.clone(), out.clone())]), vocab));
        let (si, spec, st) = drive_with(&model, spec_cfg(m, k), std::slice::from_ref(&req), &[0], f);
        same_trace(&spec[&si[0]], &plain[&pi[0]], &format!("{what}, {m:?} k={k} replay={rp}"));
        if rp {
            drafted += st[0].spec.drafted;
            accepted += st[0].spec.accepted;
        }
        assert!(st[0].spec.per_position.len() <= k);
    }
    assert!(drafted > 0 && accepted > 0 && accepted < drafted, "{what}: drafted {drafted}, accepted {accepted}: the test must see both");
}

fn tiny(config: &str, experts: ExpertFormat, topk: Option<usize>) -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let mut ov = Overrides::default();
    if let Some(k) = topk {
        ov.set.push(("dsa_config.index_topk".into(), serde_json::json!(k)));
    }
    init(k3_model::config::builtin_config(config).unwrap(), &ov, dir.path(), &InitOptions { seed: 21, dtype: FloatDType::F32, experts, shard_size: None })
        .unwrap();
    let m = Arc::new(Model::load(&Checkpoint::open(dir.path()).unwrap()).unwrap());
    (dir, m)
}

fn golden_model(name: &str) -> Arc<Model> {
    Arc::new(Model::load(&Checkpoint::open(&fixture(name)).unwrap()).unwrap())
}

#[test]
fn greedy_k3_small_mxfp4() {
    greedy_equal(golden_model("k3_small_mxfp4"), "k3_small_mxfp4");
}

#[test]
fn greedy_tiny_f32_and_mxfp4_experts() {
    let (_d, m) = tiny("tiny", ExpertFormat::Float(FloatDType::F32), None);
    greedy_equal(m, "tiny f32");
    let (_d, m) = tiny("tiny", ExpertFormat::Mxfp4, None);
    greedy_equal(m, "tiny mxfp4");
}

#[test]
fn greedy_tiny_dsa_selecting() {
    let (_d, m) = tiny("tiny_dsa", ExpertFormat::Float(FloatDType::F32), Some(6));
    greedy_equal(m, "tiny_dsa top-6");
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn greedy_golden_f32_k3_and_k31_dsa() {
    greedy_equal(golden_model("k3_small_f32"), "k3_small_f32");
    greedy_equal(golden_model("k31_small_dsa_f32"), "k31_small_dsa_f32");
}

/// `logit_bias` reaches the verification: with greedy's first tokens banned and another one
/// favoured, speculative output (n-gram, suffix, the replay proposer's right and wrong drafts)
/// equals plain output under the same bias, which differs from the unbiased one.
#[test]
fn greedy_with_logit_bias_equals_plain() {
    let model = golden_model("k3_small_mxfp4");
    let vocab = model.config.text.vocab_size as u32;
    let p = prompt(vocab, 1);
    let (ui, unbiased, _) = drive(&model, EngineConfig::default(), &[Request::new(p.clone(), SamplingParams::greedy(), 32)], &[0]);
    let free: Vec<u32> = unbiased[&ui[0]].iter().map(|x| x.0).collect();
    let mut bias: Vec<(u32, f32)> = vec![(free[0], -100.0), (free[1], -100.0), (free[6], 2.5)];
    bias.sort_by_key(|b| b.0);
    bias.dedup_by_key(|b| b.0);
    let req = Request::new(p.clone(), SamplingParams { logit_bias: bias, ..SamplingParams::greedy() }, 32);
    let (pi, plain, _) = drive(&model, EngineConfig::default(), std::slice::from_ref(&req), &[0]);
    let out: Vec<u32> = plain[&pi[0]].iter().map(|x| x.0).collect();
    assert_ne!(out, free, "the bias must change the greedy output");
    for (m, k, rp) in [(SpecMethod::Ngram, 4, false), (SpecMethod::Suffix, 4, false), (SpecMethod::Ngram, 4, true)] {
        let f = rp.then(|| replay(HashMap::from([(req.prompt.clone(), out.clone())]), vocab));
        let (si, spec, _) = drive_with(&model, spec_cfg(m, k), std::slice::from_ref(&req), &[0], f);
        same_trace(&spec[&si[0]], &plain[&pi[0]], &format!("logit_bias, {m:?} k={k} replay={rp}"));
    }
}

/// Four requests admitted at steps 0, 1, 3, 4 (prefills alone, decodes batched with drafted
/// and plain rows together) = each request alone without speculation, bit for bit; with the
/// n-gram, suffix and replay proposers.
#[test]
fn continuous_batching_equals_solo_plain() {
    let model = golden_model("k3_small_mxfp4");
    let vocab = model.config.text.vocab_size as u32;
    let reqs: Vec<Request> = (0..4).map(|i| Request::new(prompt(vocab, 2 + i), SamplingParams::greedy(), 20 + 6 * i as usize)).collect();
    let solo: Vec<Vec<(u32, Vec<f32>)>> = reqs
        .iter()
        .map(|r| {
            let (pi, mut plain, _) = drive(&model, EngineConfig::default(), std::slice::from_ref(r), &[0]);
            plain.remove(&pi[0]).unwrap()
        })
        .collect();
    let outs: HashMap<Vec<u32>, Vec<u32>> = reqs.iter().zip(&solo).map(|(r, t)| (r.prompt.clone(), t.iter().map(|x| x.0).collect())).collect();
    for (m, k, rp) in [(SpecMethod::Ngram, 4, false), (SpecMethod::Suffix, 6, false), (SpecMethod::Ngram, 5, true)] {
        let f = rp.then(|| replay(outs.clone(), vocab));
        let (ids, spec, stats) = drive_with(&model, EngineConfig { max_batch: 4, ..spec_cfg(m, k) }, &reqs, &[0, 1, 3, 4], f);
        for (i, want) in solo.iter().enumerate() {
            same_trace(&spec[&ids[i]], want, &format!("{m:?} k={k} replay={rp}: batched request {i}"));
        }
        if rp {
            let (d, a): (u64, u64) = stats.iter().fold((0, 0), |x, s| (x.0 + s.spec.drafted, x.1 + s.spec.accepted));
            assert!(a > 0 && a < d, "drafted {d}, accepted {a}");
        }
    }
}

/// Drafts the second most likely token of each context in `tree` (keyed by the output so far).
struct Oracle {
    prompt_len: usize,
    tree: Arc<HashMap<Vec<u32>, u32>>,
}

impl Proposer for Oracle {
    fn propose(&mut self, context: &[u32], k: usize) -> Draft {
        let mut out: Vec<u32> = context[self.prompt_len..].to_vec();
        let mut d = Vec::new();
        while d.len() < k {
            let Some(&t) = self.tree.get(&out) else { break };
            d.push(t);
            out.push(t);
        }
        Draft { tokens: d, probs: None }
    }
}

#[test]
fn sampled_distribution_matches_plain() {
    const N: usize = 4; // tokens per run
    const RUNS: u64 = 2000;
    let model = golden_model("k3_small_mxfp4");
    let p0 = prompt(model.config.text.vocab_size as u32, 9);
    let params = SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() };
    // The exact distribution of every context the runs can reach (top-3 at each step).
    let exact = chi2::exact(&model, &p0, &params, N);
    let tree: Arc<HashMap<Vec<u32>, u32>> = Arc::new(exact.iter().filter(|(_, t)| t.len() > 1).map(|(o, t)| (o.clone(), t[1].0)).collect());
    let run = |spec: bool| {
        let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
        let (mut drafted, mut accepted) = (0, 0);
        for seed in 0..RUNS {
            let cfg = if spec { spec_cfg(SpecMethod::Ngram, 3) } else { EngineConfig::default() };
            let mut e = Engine::new(model.clone(), None, EngineConfig { spec: SpecConfig { adaptive: false, ..cfg.spec }, ..cfg });
            let tree = tree.clone();
            let pl = p0.len();
            e.set_proposer(Arc::new(move |_r: &Request| Box::new(Oracle { prompt_len: pl, tree: tree.clone() }) as Box<dyn Proposer>));
            let req = Request { ignore_eos: true, ..Request::new(p0.clone(), SamplingParams { seed: Some(seed), ..params.clone() }, N) };
            let (out, _, st) = e.generate(req, |_| {}).unwrap();
            drafted += st.spec.drafted;
            accepted += st.spec.accepted;
            *counts.entry(out).or_default() += 1;
        }
        (counts, drafted, accepted)
    };
    for spec in [false, true] {
        let (counts, drafted, accepted) = run(spec);
        if spec {
            assert!(accepted > 0 && accepted < drafted, "drafted {drafted}, accepted {accepted}: both outcomes must occur");
        }
        let (x2, cells, crit) = chi2::chi2(&exact, &counts, N, RUNS);
        assert!(x2 < crit, "speculative={spec}: χ² {x2:.1} over {cells} cells ≥ {crit:.1} (drafted {drafted}, accepted {accepted})");
        eprintln!("speculative={spec}: χ² {x2:.1} over {cells} cells (0.001 point {crit:.1}); drafted {drafted}, accepted {accepted}");
    }
}

/// A runner that cannot verify: only the required methods, around one CPU rank.
struct NoVerify(ThreadRunner);

impl Runner for NoVerify {
    fn config(&self) -> &Config {
        self.0.config()
    }
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        self.0.embed(ids)
    }
    fn release(&mut self, id: u64) {
        self.0.release(id)
    }
    fn forward(&mut self, step: Step) -> Result<Vec<f32>> {
        self.0.forward(step)
    }
    fn state_bytes(&self) -> usize {
        self.0.state_bytes()
    }
}

/// A runner that cannot verify drafts: the engine says why and decodes plainly, giving plain
/// decoding's tokens.
#[test]
fn unsupported_runner_decodes_plainly() {
    let model = golden_model("k3_small_mxfp4");
    let runner = NoVerify(ThreadRunner::single(model.clone(), Default::default()));
    let mut e = Engine::with_runner(Box::new(runner), None, spec_cfg(SpecMethod::Ngram, 4));
    let why = e.speculating().unwrap_err();
    assert!(why.contains("decoding without speculation"), "{why}");
    let req = Request::new(prompt(model.config.text.vocab_size as u32, 1), SamplingParams::greedy(), 16);
    let (out, _, st) = e.generate(req.clone(), |_| {}).unwrap();
    let (plain, _, _) = Engine::new(model, None, EngineConfig::default()).generate(req, |_| {}).unwrap();
    assert_eq!(out, plain);
    assert_eq!(st.spec.drafted, 0);
    // Nor does it return every row's logits: a request for prompt logprobs is refused by name.
    let scored = Request::new(prompt(model_vocab(&e), 1), SamplingParams { prompt_logprobs: Some(1), ..SamplingParams::greedy() }, 4);
    let err = e.add(scored).unwrap_err().to_string();
    assert!(err.contains("prompt_logprobs") && err.contains("last row"), "{err}");
}

fn model_vocab(e: &Engine) -> u32 {
    e.runner.config().text.vocab_size as u32
}

/// Speculative decoding with the prefix cache on (issue 21): a second turn that resumes from the
/// first turn's cached prefix decodes with drafts exactly as it does without them — tokens and
/// log-probabilities bit for bit — and the prefix cache hits in both runs.
#[test]
fn with_prefix_cache_equals_plain_with_prefix_cache() {
    let model = golden_model("k3_small_mxfp4");
    let vocab = model.config.text.vocab_size as u32;
    let pc = Some(k3_engine::PrefixConfig::new(8, 64 << 20));
    let turn1 = Request::new(prompt(vocab, 4), SamplingParams::greedy(), 24);
    let run = |spec: bool, outs: Option<HashMap<Vec<u32>, Vec<u32>>>| {
        let cfg = if spec { spec_cfg(SpecMethod::Ngram, 4) } else { EngineConfig::default() };
        let mut e = Engine::new(model.clone(), None, EngineConfig { prefix: pc.clone(), ..cfg });
        if let Some(o) = outs {
            e.set_proposer(replay(o, vocab));
        }
        let mut got = Vec::new();
        let mut req = turn1.clone();
        for _ in 0..2 {
            let mut toks = Vec::new();
            let (out, _, st) = e.generate(req.clone(), |ev| toks.push((ev.token, ev.sampled.logprob.to_bits()))).unwrap();
            got.push((req.prompt.clone(), out.clone(), toks, st.spec.drafted));
            // The next turn: this one's prompt and answer, and a few more tokens.
            let mut p = req.prompt.clone();
            p.extend(&out);
            p.extend([7, 8, 9]);
            req = Request::new(p, SamplingParams::greedy(), 24);
        }
        let hits = e.prefix_status().unwrap().unwrap().hits;
        (got, hits)
    };
    let (plain, plain_hits) = run(false, None);
    let outs: HashMap<Vec<u32>, Vec<u32>> = plain.iter().map(|(p, o, _, _)| (p.clone(), o.clone())).collect();
    let (spec, spec_hits) = run(true, Some(outs));
    assert!(plain_hits > 0 && spec_hits > 0, "the second turn must resume from the cache ({plain_hits}, {spec_hits})");
    for (t, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(a.2, b.2, "turn {t}: tokens or log-probabilities differ");
        assert!(b.3 > 0, "turn {t}: nothing was drafted");
    }
}

/// Speculative decoding on parallel layouts: every rank runs the verify forward on its shard
/// (row-exact projections; the host collectives sum each value in rank order whatever the row
/// count), so greedy with drafts equals plain greedy on the same layout, bit for bit — alone
/// (n-gram and replay drafts, k = 1 and 4) and with continuous batching (three requests
/// admitted at steps 0, 1 and 3 against each alone).
#[test]
fn parallel_layouts_greedy_equal_plain() {
    let ck = Checkpoint::open(&fixture("k3_small_mxfp4")).unwrap();
    let vocab = ck.config.text.vocab_size as u32;
    for p in [Parallel::new(2, None, 1).unwrap(), Parallel::new(1, None, 2).unwrap()] {
        let start = || ThreadRunner::start(&ck, p, StateDType::F32).unwrap();
        let reqs: Vec<Request> = (0..3).map(|i| Request::new(prompt(vocab, 1 + i), SamplingParams::greedy(), 24 + 4 * i as usize)).collect();
        let solo: Vec<Vec<(u32, Vec<f32>)>> = reqs
            .iter()
            .map(|r| {
                let (pi, mut plain, _) = drive_on(start(), EngineConfig::default(), std::slice::from_ref(r), &[0]);
                plain.remove(&pi[0]).unwrap()
            })
            .collect();
        let outs: HashMap<Vec<u32>, Vec<u32>> = reqs.iter().zip(&solo).map(|(r, t)| (r.prompt.clone(), t.iter().map(|x| x.0).collect())).collect();
        let (mut drafted, mut accepted) = (0, 0);
        for (k, rp) in [(1, false), (4, false), (1, true), (4, true)] {
            FACTORY.with(|c| *c.borrow_mut() = rp.then(|| replay(outs.clone(), vocab)));
            let (si, spec, st) = drive_on(start(), spec_cfg(SpecMethod::Ngram, k), &reqs[..1], &[0]);
            same_trace(&spec[&si[0]], &solo[0], &format!("{p:?} k={k} replay={rp}"));
            drafted += st[0].spec.drafted;
            accepted += st[0].spec.accepted;
        }
        assert!(accepted > 0 && accepted < drafted, "{p:?}: drafted {drafted}, accepted {accepted}: the test must see both");
        FACTORY.with(|c| *c.borrow_mut() = Some(replay(outs.clone(), vocab)));
        let (ids, spec, _) = drive_on(start(), EngineConfig { max_batch: 3, ..spec_cfg(SpecMethod::Ngram, 4) }, &reqs, &[0, 1, 3]);
        for (i, want) in solo.iter().enumerate() {
            same_trace(&spec[&ids[i]], want, &format!("{p:?}: batched request {i}"));
        }
    }
}

/// Every rank's state of sequence 1 (`n` tokens), captured whole (one cell), as bytes.
fn rank_states(r: &mut ThreadRunner, n: usize) -> Vec<Vec<u8>> {
    r.capture_parts(1, 0, n, true).unwrap().iter().map(encode_capture).collect()
}

/// Verify `[t, d1, d2, d3]` then roll back two tokens = decode steps of `t` and `d1`: every
/// rank's state (KDA conv tails and recurrent state of its heads and stage, latent rows,
/// indexer keys, position) byte for byte, on `--tp 2`, `--pp 2` and `--tp 2 --pp 2`; and the
/// next decode step's logits agree bit for bit.
#[test]
fn parallel_rollback_equals_plain_decode_on_every_rank() {
    let ck = Checkpoint::open(&fixture("k3_small_mxfp4")).unwrap();
    let step = |r: &mut ThreadRunner, toks: &[u32], verify: bool| {
        let s = Step { seqs: vec![StepSeq { id: 1, tokens: toks.to_vec(), rows: None }], last_only: !verify, released: vec![] };
        if verify {
            r.verify(s).unwrap()
        } else {
            r.forward(s).unwrap()
        }
    };
    let p0 = prompt(ck.config.text.vocab_size as u32, 3);
    for p in [Parallel::new(2, None, 1).unwrap(), Parallel::new(1, None, 2).unwrap(), Parallel::new(2, None, 2).unwrap()] {
        let (mut a, mut b) = (ThreadRunner::start(&ck, p, StateDType::F32).unwrap(), ThreadRunner::start(&ck, p, StateDType::F32).unwrap());
        step(&mut a, &p0, false);
        step(&mut b, &p0, false);
        step(&mut a, &[5, 17, 200, 33], true);
        a.rollback(1, 2).unwrap();
        step(&mut b, &[5], false);
        step(&mut b, &[17], false);
        let n = p0.len() + 2;
        let (sa, sb) = (rank_states(&mut a, n), rank_states(&mut b, n));
        assert_eq!(sa.len(), p.world());
        for (r, (x, y)) in sa.iter().zip(&sb).enumerate() {
            assert!(x == y, "{p:?} rank {r}: the state after verify + rollback differs from plain decoding's");
        }
        let (la, lb) = (step(&mut a, &[9], false), step(&mut b, &[9], false));
        assert!(la.iter().zip(&lb).all(|(x, y)| x.to_bits() == y.to_bits()), "{p:?}: the next step's logits differ");
    }
}
