//! Engine behaviour on the golden K3 fixture `k3_small_mxfp4` (and the golden tokenizer for
//! text): greedy generation equals argmax over full passes; concurrent requests under continuous
//! batching equal running them alone; seeds reproduce; stop strings cut the text; cancel frees state;
//! context and parameter errors come before any work.

use std::sync::Arc;

use k3_engine::{Engine, EngineConfig, FinishReason, Request, SamplingParams};
use k3_model::{Checkpoint, ForwardOpts, Model};
use k3_tokenizer::Tokenizer;

#[path = "../../../tests/support/golden.rs"]
mod golden;
use golden::{fixture, golden_path};

fn model(name: &str) -> Arc<Model> {
    Arc::new(Model::load(&Checkpoint::open(&fixture(name)).unwrap()).unwrap())
}

fn engine(cfg: EngineConfig) -> Engine {
    let tok = Tokenizer::from_dir(&golden_path("tokenizer")).unwrap();
    Engine::new(model("k3_small_mxfp4"), Some(Arc::new(tok)), cfg)
}

const PROMPT: [u32; 9] = [5, 17, 200, 3, 99, 42, 7, 300, 12];

#[test]
fn greedy_equals_full_pass_argmax() {
    let mut e = engine(EngineConfig::default());
    let (out, fin, stats) = e.generate(Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 12), |_| {}).unwrap();
    assert_eq!(fin, FinishReason::Length);
    assert_eq!(out.len(), 12);
    assert_eq!(stats.output_tokens, 12);
    // Reference: recompute the whole sequence each time and take the argmax.
    let m = model("k3_small_mxfp4");
    let mut seq = PROMPT.to_vec();
    for &tok in &out {
        let lg = m.forward(&seq, &mut m.new_state(), ForwardOpts { last_only: true, ..Default::default() }, None).unwrap();
        assert_eq!(k3_engine::sampler::argmax(&lg) as u32, tok);
        seq.push(tok);
    }
}

#[test]
fn continuous_batching_equals_solo() {
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| PROMPT.iter().map(|&t| (t + 31 * i) % 384).cycle().take(4 + 9 * i as usize).collect()).collect();
    let solo: Vec<Vec<u32>> =
        prompts.iter().map(|p| engine(EngineConfig::default()).generate(Request::new(p.clone(), SamplingParams::greedy(), 8), |_| {}).unwrap().0).collect();
    // Small chunks and a small budget force interleaved prefill and decode.
    let mut e = engine(EngineConfig { max_batch: 3, prefill_chunk: 5, max_step_tokens: 8, ..Default::default() });
    let ids: Vec<u64> = prompts.iter().map(|p| e.add(Request::new(p.clone(), SamplingParams::greedy(), 8)).unwrap()).collect();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    let mut steps = 0;
    while e.has_work() {
        assert!(e.num_running() <= 3);
        for ev in e.step().unwrap() {
            got[ids.iter().position(|&i| i == ev.seq).unwrap()].push(ev.token);
        }
        steps += 1;
        assert!(steps < 1000);
    }
    assert_eq!(got, solo);
    assert_eq!(e.state_bytes(), 0);
}

#[test]
fn seeds_reproduce() {
    let p = SamplingParams { temperature: 1.0, top_p: 0.9, seed: Some(11), ..Default::default() };
    let a = engine(EngineConfig::default()).generate(Request::new(PROMPT.to_vec(), p.clone(), 16), |_| {}).unwrap().0;
    let b = engine(EngineConfig::default()).generate(Request::new(PROMPT.to_vec(), p, 16), |_| {}).unwrap().0;
    assert_eq!(a, b);
}

#[test]
fn stop_string_cuts_text() {
    let mut e = engine(EngineConfig::default());
    let mut full = String::new();
    e.generate(Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 24), |ev| full.push_str(&ev.text)).unwrap();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 8, "need some text: {full:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let want = &full[..full.find(&stop).unwrap()];
    let mut req = Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 24);
    req.stop = vec![stop.clone()];
    let mut text = String::new();
    let (_, fin, _) = e.generate(req, |ev| text.push_str(&ev.text)).unwrap();
    assert_eq!(fin, FinishReason::Stop);
    assert_eq!(text, want, "stop {stop:?}");
}

#[test]
fn stop_token_ends_generation() {
    let mut e = engine(EngineConfig::default());
    let first = e.generate(Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 3), |_| {}).unwrap().0;
    let mut req = Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 10);
    req.stop_token_ids = vec![first[1]];
    let (out, fin, _) = e.generate(req, |_| {}).unwrap();
    assert_eq!(fin, FinishReason::Stop);
    assert_eq!(out, first[..2].to_vec());
}

#[test]
fn cancel_frees_state() {
    let mut e = engine(EngineConfig::default());
    let a = e.add(Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 50)).unwrap();
    e.step().unwrap();
    assert!(e.state_bytes() > 0);
    assert!(e.cancel(a));
    assert_eq!(e.state_bytes(), 0);
    assert!(!e.has_work());
}

#[test]
fn errors_before_work() {
    let mut e = engine(EngineConfig::default());
    let limit = e.model_config().max_context();
    let err = e.add(Request::new(vec![1; limit], SamplingParams::greedy(), 1)).unwrap_err().to_string();
    assert!(err.contains("context limit"), "{err}");
    let err = e.add(Request::new(vec![1], SamplingParams { top_k: 0, top_p: 0.0, ..Default::default() }, 1)).unwrap_err().to_string();
    assert!(err.contains("top_p"), "{err}");
    let err = e.add(Request::new(vec![1], SamplingParams::greedy(), 0)).unwrap_err().to_string();
    assert!(err.contains("max_tokens"), "{err}");
    let err = e.add(Request::new(vec![9999], SamplingParams::greedy(), 1)).unwrap_err().to_string();
    assert!(err.contains("9999"), "{err}");
    assert!(!e.has_work());
}

/// `prompt_logprobs`: every prompt token after the first gets the log-probability (and top
/// alternatives) that a full pass over the prompt gives it, whether the prompt is prefilled in
/// the default chunks or in chunks of 7 batched beside other sequences, and with the prefix cache on (such a
/// request never resumes from it); the generated tokens are those of the same request without.
#[test]
fn prompt_logprobs_equal_a_full_pass() {
    let m = model("k3_small_mxfp4");
    // 300 tokens: more than a step prefills of such a request (256).
    let prompt: Vec<u32> = PROMPT.iter().cycle().take(300).enumerate().map(|(i, &t)| (t + 7 * i as u32) % 384).collect();
    let rows = m.forward(&prompt, &mut m.new_state(), ForwardOpts { last_only: false, ..Default::default() }, None).unwrap();
    let v = m.config.text.vocab_size;
    let want: Vec<(f32, Vec<(u32, f32)>)> = (0..prompt.len() - 1)
        .map(|j| {
            let lp = k3_engine::sampler::log_softmax(&rows[j * v..(j + 1) * v]);
            let mut idx: Vec<usize> = (0..v).collect();
            idx.sort_by(|&a, &b| lp[b].partial_cmp(&lp[a]).unwrap().then(a.cmp(&b)));
            (lp[prompt[j + 1] as usize], idx[..3].iter().map(|&i| (i as u32, lp[i])).collect())
        })
        .collect();
    let params = SamplingParams { prompt_logprobs: Some(3), ..SamplingParams::greedy() };
    let plain = engine(EngineConfig::default()).generate(Request::new(prompt.clone(), SamplingParams::greedy(), 4), |_| {}).unwrap().0;
    let prefix = Some(k3_engine::PrefixConfig::new(16, 64 << 20));
    for (what, cfg) in [
        ("default chunks (256 + 44)", EngineConfig::default()),
        ("chunks of 7 beside another sequence", EngineConfig { max_batch: 2, prefill_chunk: 7, max_step_tokens: 16, ..Default::default() }),
        ("prefix cache on", EngineConfig { prefix: prefix.clone(), ..Default::default() }),
    ] {
        let mut e = engine(cfg);
        // Another sequence (and, with the cache, the same prompt cached first).
        e.generate(Request::new(prompt.clone(), SamplingParams::greedy(), 2), |_| {}).unwrap();
        let other = e.add(Request::new(PROMPT.to_vec(), SamplingParams::greedy(), 6)).unwrap();
        let id = e.add(Request::new(prompt.clone(), params.clone(), 4)).unwrap();
        let (mut got, mut out, mut cached) = (None, Vec::new(), usize::MAX);
        while e.has_work() {
            for ev in e.step().unwrap() {
                if ev.seq == id {
                    if out.is_empty() {
                        got = ev.prompt_logprobs.clone();
                        cached = ev.cached_tokens;
                    } else {
                        assert!(ev.prompt_logprobs.is_none(), "{what}: prompt logprobs come with the first token only");
                    }
                    out.push(ev.token);
                } else {
                    assert!(ev.seq != other || ev.prompt_logprobs.is_none(), "{what}: the other sequence asked for none");
                }
            }
        }
        assert_eq!(out, plain, "{what}: the generated tokens");
        assert_eq!(cached, 0, "{what}: a request scoring its prompt is not resumed from the cache");
        let got = got.unwrap_or_else(|| panic!("{what}: no prompt logprobs"));
        assert_eq!(got.len(), prompt.len() - 1, "{what}");
        for (j, (g, (lp, top))) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.token, prompt[j + 1], "{what}: position {j}");
            assert!((g.logprob - lp).abs() < 1e-4, "{what}: position {j}: {} vs {lp}", g.logprob);
            assert_eq!(g.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>(), top.iter().map(|t| t.0).collect::<Vec<_>>(), "{what}: position {j}");
        }
    }
    // Out of range: named.
    let e = engine(EngineConfig::default()).add(Request::new(prompt, SamplingParams { prompt_logprobs: Some(21), ..Default::default() }, 1)).unwrap_err();
    assert!(e.to_string().contains("prompt_logprobs"), "{e}");
}
