//! `--speculative draft` through the engine on the CPU runner (issue 22): a separate draft model
//! (`spec::draft::DraftSpec`) whose per-sequence states the runner keeps beside the target's
//! (`dist::draft`) — the embedded k3-nano and `k3 init` checkpoints of the tiny configs:
//!
//! - greedy: the output equals plain greedy decoding's, tokens and log-probabilities bit for bit,
//!   for k = 1..4 with three requests batched (admitted while others decode), with a draft model
//!   of another config and seed (drafts both accepted and rejected, so rollbacks run), and
//!   k3-nano with a random draft of its vocabulary (nearly every draft rejected);
//! - self-draft: k3-nano as its own draft — every chained draft logits row equals, bit for bit,
//!   the target's verify row at the same position (the draft state followed the target through
//!   chunked prefill, batching, verify steps and rollbacks; a penalised request makes drafts
//!   fail so that the rollbacks run), every greedy draft is accepted (k + 1 tokens per step),
//!   and a cancelled request's draft state is freed;
//! - the prefix cache: a resumed second turn drafts exactly as cold (the draft state is captured
//!   and restored with the cells); an entry without it decodes without drafts;
//! - sampling with the draft model's `q`: the joint distribution of four sampled tokens over many
//!   seeds matches the model's exact distribution (χ² at the 0.001 level);
//! - errors: a vocabulary mismatch names both vocab sizes and `--draft-model`; a missing draft
//!   model, a parallel layout: the engine decodes plainly and says why.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use k3_engine::dist::runner::ThreadRunner;
use k3_engine::spec::draft::DraftSpec;
use k3_engine::spec::{SpecConfig, SpecMethod};
use k3_engine::{Engine, EngineConfig, PrefixConfig, Request, SamplingParams};
use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::{Checkpoint, Model, Parallel};

#[path = "support/chi2.rs"]
mod chi2;
#[path = "support/drive.rs"]
mod drive;
#[path = "support/recorder.rs"]
mod recorder;
use drive::{drive, greedy_sweep, plain_solo, Out};
use recorder::{Entry, Timeline};

/// A `k3 init` checkpoint of built-in `config` (random F32 weights) with `vocab` ids.
fn init_model(config: &str, seed: u64, vocab: usize) -> (tempfile::TempDir, Checkpoint, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let mut ov = Overrides::default();
    ov.set.push(("vocab_size".into(), serde_json::json!(vocab)));
    let f = FloatDType::F32;
    init(
        k3_model::config::builtin_config(config).unwrap(),
        &ov,
        dir.path(),
        &InitOptions { seed, dtype: f, experts: ExpertFormat::Float(f), shard_size: None },
    )
    .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let m = Arc::new(Model::load(&ck).unwrap());
    (dir, ck, m)
}

fn nano() -> Arc<Model> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano");
    Arc::new(Model::load(&Checkpoint::open(&dir).unwrap()).unwrap())
}

/// A small vocabulary, so that a random draft model's guesses are accepted now and then.
const VOCAB: usize = 4;

fn prompt(len: usize, seed: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + seed * 5 + i * i) % vocab).collect()
}

fn draft_cfg(k: usize, draft: &Arc<Model>) -> EngineConfig {
    EngineConfig {
        spec: SpecConfig { method: SpecMethod::Draft, num_tokens: k, adaptive: true },
        draft: Some(DraftSpec::new(draft.clone(), "the draft")),
        ..Default::default()
    }
}

fn greedy(p: Vec<u32>, max: usize) -> Request {
    Request { ignore_eos: true, ..Request::new(p, SamplingParams::greedy(), max) }
}

/// Greedy with a draft model = plain greedy, bit for bit: three requests admitted at steps 0,
/// 1, 3 (their decode rows verified together), k = 1..4, a draft of another config (DSA) and
/// seed; then k3-nano with a random draft of its vocabulary.
#[test]
fn greedy_equals_plain() {
    let (_a, _, target) = init_model("tiny", 7, VOCAB);
    let (_b, _, draft) = init_model("tiny_dsa", 11, VOCAB);
    let reqs: Vec<Request> = (0..3).map(|i| greedy(prompt(9 + 5 * i, i as u32, VOCAB as u32), 24)).collect();
    let solo: Vec<Out> = reqs.iter().map(|r| plain_solo(&target, r)).collect();
    let (drafted, accepted) = greedy_sweep(&target, &reqs, &solo, |k| draft_cfg(k, &draft));
    eprintln!("tiny + tiny_dsa draft: drafted {drafted}, accepted {accepted}");
    assert!(accepted > 0 && accepted < drafted, "drafted {drafted}, accepted {accepted}: both outcomes must occur");

    let nano = nano();
    let v = nano.config.text.vocab_size;
    let (_c, _, rand) = init_model("tiny", 3, v);
    let reqs: Vec<Request> = (0..2).map(|i| greedy(prompt(12 + 7 * i, 3 + i as u32, 4000), 16)).collect();
    let solo: Vec<Out> = reqs.iter().map(|r| plain_solo(&nano, r)).collect();
    let mut e = Engine::new(nano.clone(), None, EngineConfig { max_batch: 2, ..draft_cfg(3, &rand) });
    let (outs, stats) = drive(&mut e, &reqs, &[0, 2], &[None; 2]);
    assert_eq!(outs, solo, "k3-nano with a random draft: output differs from plain decoding");
    assert!(stats.iter().flatten().all(|s| s.spec.drafted > 0), "{stats:?}");
}

/// Every draft call of each sequence against the verify step that followed it: the chained
/// logits row j (fed `d_j`, or `next` for j = 0) must equal the target's verify row j bit for
/// bit — a self-draft's state equals the target's. Returns the number of draft calls.
fn check_self_draft(t: &Timeline, what: &str) -> usize {
    let t = t.lock().unwrap();
    let mut calls = 0;
    for (id, entries) in t.iter() {
        for (i, e) in entries.iter().enumerate() {
            let Entry::Drafted(d) = e else { continue };
            let Some(Entry::Verified(v)) = entries.get(i + 1) else { panic!("{what}: sequence {id}: a draft call not followed by its verify step") };
            assert_eq!(v.len(), d.len() + 1, "{what}: sequence {id}: verify rows");
            for (j, (a, b)) in d.iter().zip(v).enumerate() {
                let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{what}: sequence {id}, draft call {i}, position {j}: the draft's logits differ from the target's (max |Δ| {diff:e})"
                );
            }
            calls += 1;
        }
    }
    calls
}

/// k3-nano as its own draft, k = 1..4: three requests batched with chunked prefill — greedy,
/// greedy with a repetition penalty (the draft's argmax ignores it, so drafts fail and the
/// rollbacks run), sampled (cancelled mid-way) — every draft row equals the target's verify row
/// bit for bit; the plain greedy request accepts every draft and emits k + 1 tokens per step.
#[test]
fn self_draft_follows_the_target_exactly() {
    let m = nano();
    let pr = |s: u32| -> Vec<u32> { prompt(11 + s as usize, s, 4000) };
    let plain = greedy(pr(1), 61); // 60 tokens after the first: a multiple of k + 1 for k = 1..4
    let penalised = Request { ignore_eos: true, ..Request::new(pr(2), SamplingParams { repetition_penalty: 1.3, ..SamplingParams::greedy() }, 30) };
    let sampled = Request { ignore_eos: true, ..Request::new(pr(3), SamplingParams { temperature: 0.8, top_k: 40, seed: Some(5), ..Default::default() }, 61) };
    let reqs = [plain.clone(), penalised.clone(), sampled];
    // The reference: the same schedule without speculation (prefill chunks packed alike).
    let sched = EngineConfig { prefill_chunk: 5, max_batch: 3, ..Default::default() };
    let (reference, _) = drive(&mut Engine::new(m.clone(), None, sched.clone()), &reqs, &[0, 1, 2], &[None, None, Some(6)]);
    for k in 1..=4 {
        let timeline: Timeline = Arc::default();
        let mut rec = recorder::Rec::new(ThreadRunner::single(m.clone(), Default::default()), &Default::default());
        rec.timeline = Some(timeline.clone());
        let mut e = Engine::with_runner(Box::new(rec), None, EngineConfig { spec: draft_cfg(k, &m).spec, draft: draft_cfg(k, &m).draft, ..sched.clone() });
        assert_eq!(e.speculating(), Ok(true));
        let (outs, stats) = drive(&mut e, &reqs, &[0, 1, 2], &[None, None, Some(6)]);
        // Tokens: plain batched decode rows are not row-exact (log-probabilities differ in the
        // last bits from the verify rows'; `greedy_equals_plain` checks the bits solo).
        let toks = |o: &[Out]| o.iter().map(|o| o.iter().map(|x| x.0).collect::<Vec<_>>()).collect::<Vec<_>>();
        assert_eq!(toks(&outs[..2]), toks(&reference[..2]), "k={k}: greedy tokens differ from plain decoding on the same schedule");
        assert!(stats[2].is_none() && outs[2].len() < 61, "the sampled request was cancelled");
        let calls = check_self_draft(&timeline, &format!("k={k}"));
        let (p, q) = (stats[0].as_ref().unwrap(), stats[1].as_ref().unwrap());
        eprintln!("k={k}: {calls} draft calls; plain {:?}; penalised drafted {}, accepted {}", p.spec, q.spec.drafted, q.spec.accepted);
        assert_eq!(p.spec.accepted, p.spec.drafted, "k={k}: a self-draft's greedy drafts are all accepted");
        assert_eq!(p.spec.accepted_per_step(), (k + 1) as f64, "k={k}: k + 1 tokens per step");
        assert_eq!(p.spec.per_position, vec![[60 / (k as u64 + 1), 60 / (k as u64 + 1)]; k]);
        assert!(q.spec.accepted < q.spec.drafted, "k={k}: the penalised request must reject drafts ({:?})", q.spec);
    }
}

/// Two turns through one engine with the prefix cache (grid 4): the second resumes from the
/// first's cells and drafts exactly (every draft logits row bit for bit) as it does cold; a
/// restore from entries stripped of the draft state drafts nothing and keeps plain output.
#[test]
fn prefix_cache_keeps_the_draft_state() {
    let (_a, _, target) = init_model("tiny", 7, VOCAB);
    let (_b, _, draft) = init_model("tiny_dsa", 11, VOCAB);
    let pc = Some(PrefixConfig::new(4, 64 << 20));
    let turn1 = greedy(prompt(14, 5, VOCAB as u32), 10);
    let out1 = plain_solo(&target, &turn1);
    let mut p2 = turn1.prompt.clone();
    p2.extend(out1.iter().map(|x| x.0));
    p2.extend([3, 1, 2]);
    let turn2 = greedy(p2, 12);
    // strip: the runner's restores lose the draft state (a mutation of what the cache hands it).
    let run = |turns: &[Request], strip: bool| {
        let timeline: Timeline = Arc::default();
        let mut rec = recorder::Rec::new(ThreadRunner::single(target.clone(), Default::default()), &Default::default());
        rec.timeline = Some(timeline.clone());
        if strip {
            rec.mutate = Some(Box::new(|cells: &mut Vec<k3_engine::prefix::Segment>, snap: &mut k3_engine::prefix::KdaSnap| {
                cells.iter_mut().for_each(|c| c.draft = None);
                snap.draft = None;
            }));
        }
        let mut e = Engine::with_runner(Box::new(rec), None, EngineConfig { prefix: pc.clone(), ..draft_cfg(3, &draft) });
        let mut outs = Vec::new();
        let mut stats = Vec::new();
        for t in turns {
            let (o, st) = drive(&mut e, std::slice::from_ref(t), &[0], &[None]);
            outs.push(o.into_iter().next().unwrap());
            stats.push(st.into_iter().next().unwrap().unwrap());
        }
        // The last turn's draft logits (its sequence has the highest id).
        let t = timeline.lock().unwrap();
        let last = t.keys().max().copied().unwrap();
        let drafts: Vec<Vec<u32>> =
            t[&last].iter().filter_map(|e| if let Entry::Drafted(d) = e { Some(d.iter().flatten().map(|x| x.to_bits()).collect()) } else { None }).collect();
        (outs, stats, drafts)
    };
    let (warm_out, warm, warm_drafts) = run(&[turn1.clone(), turn2.clone()], false);
    let (cold_out, cold, cold_drafts) = run(std::slice::from_ref(&turn2), false);
    assert!(warm[1].cached_tokens > 0 && cold[0].cached_tokens == 0, "the second turn resumes from the cache");
    assert!(warm[1].spec.drafted > 0 && warm_drafts.iter().any(|d| !d.is_empty()), "the resumed turn drafts");
    assert_eq!(warm_out[1], cold_out[0]);
    assert!(warm_drafts == cold_drafts, "the resumed turn drafts differently from a cold run");
    let (strip_out, strip, strip_drafts) = run(&[turn1, turn2], true);
    assert!(strip[1].cached_tokens > 0, "the stripped run resumes from the cache too");
    assert_eq!(strip[1].spec.drafted, 0, "a sequence restored without its draft state must not draft");
    assert!(strip_drafts.iter().all(Vec::is_empty), "draft calls of a sequence without a draft state return nothing");
    assert_eq!(strip_out[1], warm_out[1]);
}

/// Sampling with the draft model's drafts and `q`s: the joint distribution of 4 tokens (top-3)
/// over 1000 seeds matches the exact one.
#[test]
fn sampled_distribution_matches_plain() {
    const N: usize = 4;
    const RUNS: u64 = 1000;
    let (_a, _, target) = init_model("tiny", 7, VOCAB);
    let (_b, _, draft) = init_model("tiny_dsa", 11, VOCAB);
    let p0 = prompt(10, 9, VOCAB as u32);
    let params = SamplingParams { temperature: 1.0, top_k: 3, ..Default::default() };
    let exact = chi2::exact(&target, &p0, &params, N);
    let mut counts: HashMap<Vec<u32>, u64> = HashMap::new();
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..RUNS {
        let mut e = Engine::new(target.clone(), None, EngineConfig { max_batch: 1, ..draft_cfg(3, &draft) });
        let req = Request { ignore_eos: true, ..Request::new(p0.clone(), SamplingParams { seed: Some(seed), ..params.clone() }, N) };
        let (out, _, st) = e.generate(req, |_| {}).unwrap();
        drafted += st.spec.drafted;
        accepted += st.spec.accepted;
        *counts.entry(out).or_default() += 1;
    }
    assert!(accepted > 0 && accepted < drafted, "drafted {drafted}, accepted {accepted}: both outcomes must occur");
    let (x2, cells, crit) = chi2::chi2(&exact, &counts, N, RUNS);
    eprintln!("draft model: χ² {x2:.1} over {cells} cells (0.001 point {crit:.1}); drafted {drafted}, accepted {accepted}");
    assert!(x2 < crit, "χ² {x2:.1} over {cells} cells ≥ {crit:.1} (drafted {drafted}, accepted {accepted})");
}

/// A draft model of another vocabulary is refused naming both vocab sizes and the flag (when
/// loaded, and if one reaches the runner anyway); `--speculative draft` without a draft model
/// and on a parallel layout decodes plainly and says why.
#[test]
fn errors_name_the_flag_and_plain_decoding_stays() {
    let (dir, ck, target) = init_model("tiny", 7, 8);
    let (ddir, _, other) = init_model("tiny", 8, VOCAB);
    let e = DraftSpec::load(ddir.path(), &target.config, "the target").unwrap_err().to_string();
    assert!(e.contains("--draft-model") && e.contains("vocab_size is 4") && e.contains("is 8"), "{e}");
    assert!(DraftSpec::load(dir.path(), &target.config, "the target").is_ok());
    let e = DraftSpec::load(&dir.path().join("missing"), &target.config, "the target").unwrap_err().to_string();
    assert!(e.contains("--draft-model"), "{e}");
    let req = greedy(vec![5, 1, 7, 3], 8);
    let plain = Engine::new(target.clone(), None, EngineConfig::default()).generate(req.clone(), |_| {}).unwrap().0;
    let cases: Vec<(Engine, &str)> = vec![
        (Engine::new(target.clone(), None, draft_cfg(3, &other)), "vocab_size"),
        (Engine::new(target.clone(), None, EngineConfig { draft: None, ..draft_cfg(3, &target) }), "--draft-model"),
        (
            Engine::with_runner(
                Box::new(ThreadRunner::start(&ck, Parallel::new(2, None, 1).unwrap(), Default::default()).unwrap()),
                None,
                draft_cfg(3, &target),
            ),
            "parallel layout",
        ),
    ];
    for (mut e, says) in cases {
        let why = e.speculating().unwrap_err();
        assert!(why.contains(says), "{why}");
        let (out, _, st) = e.generate(req.clone(), |_| {}).unwrap();
        assert_eq!(st.spec.drafted, 0);
        assert_eq!(out, plain, "{says}: plain decoding's output");
    }
}
