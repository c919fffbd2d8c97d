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
