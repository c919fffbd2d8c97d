//! OpenAI's `n` and `logit_bias` through HTTP on the real engine with the embedded k3-nano:
//! choice `i` of a seeded `n`-request is the answer of a single request seeded `seed + i`
//! (chat and completions, streamed and not, with the prefix cache on and off), greedy choices
//! are the greedy answer, usage counts the prompt once and every choice's tokens; a bias of
//! −100 bans the greedy token and +100 forces one; a bad `n` or `logit_bias` is a 400 naming
//! it.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use common::*;
use k3_engine::PrefixConfig;
use k3_server::BackgroundServer;
use k3_tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Capacity 8 (4 running + 4 queued): the bound a too-large `n` meets.
fn start(prefix: Option<PrefixConfig>) -> BackgroundServer {
    nano_server(prefix, 4, 4)
}

fn chat(extra: Value) -> Value {
    let mut b = json!({"model": "k3-nano", "messages": [{"role": "user", "content": "Tell me about the sea, the ships and the storms."}],
        "reasoning_effort": "none", "max_tokens": 10, "temperature": 1.0, "top_k": 40});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

/// A streamed chat answer, per choice index: (content, finish_reason); and the usage chunk.
fn stream_choices(addr: SocketAddr, body: &Value) -> (BTreeMap<u64, (String, String)>, Value) {
    let r = post(addr, "/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (mut out, mut usage) = (BTreeMap::<u64, (String, String)>::new(), Value::Null);
    let data = r.sse();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        for c in v["choices"].as_array().unwrap() {
            let e = out.entry(c["index"].as_u64().unwrap()).or_default();
            assert!(e.1.is_empty(), "a chunk after choice {}'s finish: {v}", c["index"]);
            e.0.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(f) = c["finish_reason"].as_str() {
                e.1 = f.to_owned();
            }
        }
    }
    (out, usage)
}

#[test]
fn choice_i_is_the_single_answer_seeded_seed_plus_i() {
    for srv in [start(None), start(Some(PrefixConfig::new(PrefixConfig::GRID, 64 << 20)))] {
        let many = post(srv.addr, "/v1/chat/completions", &chat(json!({"n": 3, "seed": 40}))).json();
        let choices = many["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3, "{many}");
        let mut completion = 0;
        let mut messages = Vec::new();
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i as u64);
            let one = post(srv.addr, "/v1/chat/completions", &chat(json!({"seed": 40 + i}))).json();
            assert_eq!(c["message"], one["choices"][0]["message"], "choice {i} vs a single request seeded {}", 40 + i);
            assert_eq!(c["finish_reason"], one["choices"][0]["finish_reason"]);
            assert_eq!(many["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"], "the prompt counts once");
            completion += one["usage"]["completion_tokens"].as_u64().unwrap();
            messages.push(c["message"].clone());
        }
        assert_eq!(many["usage"]["completion_tokens"].as_u64().unwrap(), completion);
        assert!(messages[0] != messages[1] || messages[1] != messages[2], "three seeds, one answer: the seeds were not offset");

        // Streamed: the same choices, interleaved by index, then one usage chunk.
        let (streamed, usage) = stream_choices(srv.addr, &chat(json!({"n": 3, "seed": 40, "stream": true, "stream_options": {"include_usage": true}})));
        assert_eq!(streamed.len(), 3);
        for (i, (text, finish)) in &streamed {
            let c = &choices[*i as usize];
            assert_eq!(text.as_str(), c["message"]["content"].as_str().unwrap_or(""), "streamed choice {i}");
            assert_eq!(finish.as_str(), c["finish_reason"].as_str().unwrap());
        }
        assert_eq!(usage["completion_tokens"].as_u64().unwrap(), completion, "{usage}");
    }
}

#[test]
fn completions_n_and_greedy_choices() {
    let srv = start(Some(PrefixConfig::new(PrefixConfig::GRID, 64 << 20)));
    let body = |extra: Value| {
        let mut b = json!({"model": "k3-nano", "prompt": "Once upon a time, far beyond the hills,", "max_tokens": 8, "temperature": 0.9});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let many = post(srv.addr, "/v1/completions", &body(json!({"n": 2, "seed": 7, "logprobs": 1}))).json();
    for i in 0..2 {
        let one = post(srv.addr, "/v1/completions", &body(json!({"seed": 7 + i, "logprobs": 1}))).json();
        assert_eq!(many["choices"][i]["index"], i as u64);
        assert_eq!(many["choices"][i]["text"], one["choices"][0]["text"], "choice {i}");
        // The same tokens; their logprobs within batching's rounding (the choices decode in
        // one batch, the single request alone: the CPU's batched rows are not bit-exact).
        let (a, b) = (&many["choices"][i]["logprobs"], &one["choices"][0]["logprobs"]);
        assert_eq!(a["tokens"], b["tokens"], "choice {i}");
        for (x, y) in a["token_logprobs"].as_array().unwrap().iter().zip(b["token_logprobs"].as_array().unwrap()) {
            assert!((x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-4, "choice {i}: {a} vs {b}");
        }
    }
    let s = post(srv.addr, "/v1/completions", &body(json!({"n": 2, "seed": 7, "stream": true})));
    let mut texts = [String::new(), String::new()];
    for d in s.sse().iter().filter(|d| d.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        texts[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
    }
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(t.as_str(), many["choices"][i]["text"].as_str().unwrap(), "streamed choice {i}");
    }
    // vLLM's continuous usage: every chunk carries the usage so far, non-decreasing, ending at
    // the totals of the non-streamed answer.
    let s = post(
        srv.addr,
        "/v1/completions",
        &body(json!({"n": 2, "seed": 7, "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}})),
    );
    let chunks: Vec<Value> = s.sse().iter().filter(|d| d.as_str() != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    let counts: Vec<u64> = chunks.iter().map(|c| c["usage"]["completion_tokens"].as_u64().unwrap_or_else(|| panic!("a chunk without usage: {c}"))).collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert_eq!(counts[0], 1);
    assert_eq!(counts.last(), many["usage"]["completion_tokens"].as_u64().as_ref(), "{counts:?}");
    assert_eq!(chunks.len(), counts.last().copied().unwrap() as usize + 1, "one chunk per token, then the usage chunk");
    // Greedy: every choice is the greedy answer.
    let greedy = post(srv.addr, "/v1/completions", &body(json!({"temperature": 0}))).json();
    let two = post(srv.addr, "/v1/completions", &body(json!({"temperature": 0, "n": 2}))).json();
    for i in 0..2 {
        assert_eq!(two["choices"][i]["text"], greedy["choices"][0]["text"]);
    }
}

#[test]
fn a_bad_n_is_a_400_naming_it() {
    let srv = start(None);
    // Capacity here: max_batch 4 + max_queue 4 = 8.
    for (n, says) in [(json!(0), "outside"), (json!(17), "outside"), (json!(9), "--max-queue"), (json!("two"), "n")] {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let body = if path.ends_with("chat/completions") { chat(json!({"n": n})) } else { json!({"prompt": "hi", "n": n}) };
            let r = post(srv.addr, path, &body);
            assert_eq!(r.status, 400, "n = {n} on {path}: {}", r.text());
            let e = r.json();
            assert_eq!(e["error"]["param"], "n", "{e}");
            assert!(e["error"]["message"].as_str().unwrap().contains(says), "{e}");
        }
    }
    // Nothing was left running.
    let m = get(srv.addr, "/metrics").text();
    assert_eq!(metric(&m, "k3_requests_live"), 0.0, "{m}");
}

#[test]
fn logit_bias_bans_and_forces_tokens() {
    let srv = start(None);
    let tok = Tokenizer::from_dir(&nano_dir()).unwrap();
    let body =
        |bias: Value| json!({"model": "k3-nano", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 1, "logit_bias": bias});
    let plain = post(srv.addr, "/v1/completions", &body(Value::Null)).json();
    let first = plain["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap().to_owned();
    let first_id = tok.encode(&first, false);
    assert_eq!(first_id.len(), 1, "the greedy first token {first:?} is one id");
    // −100 on the greedy first token: another token comes first; the reported logprob of the
    // top alternative is still the raw model's (the banned token).
    let banned = post(srv.addr, "/v1/completions", &body(json!({first_id[0].to_string(): -100}))).json();
    assert_eq!(banned["choices"][0]["logprobs"]["top_logprobs"][0].as_object().unwrap().keys().next().unwrap(), &first, "{banned}");
    assert_ne!(banned["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap(), first, "{banned}");
    // +100 on one token: greedy repeats it.
    let forced_id = tok.encode(" Paris", false)[0];
    let forced = post(srv.addr, "/v1/completions", &body(json!({forced_id.to_string(): 100}))).json();
    assert_eq!(forced["choices"][0]["text"].as_str().unwrap(), tok.decode(&[forced_id; 4], false).unwrap(), "{forced}");
    // Chat too (the chat's stop ids are left alone: no bias on them).
    let chat = post(srv.addr, "/v1/chat/completions", &chat(json!({"temperature": 0, "max_tokens": 3, "logit_bias": {forced_id.to_string(): 100}}))).json();
    assert!(chat["choices"][0]["message"]["content"].as_str().unwrap().contains(tok.decode(&[forced_id; 3], false).unwrap().trim()), "{chat}");
    // Bad input: a 400 naming the key.
    for (bias, param) in [
        (json!({"abc": 1}), "logit_bias.abc"),
        (json!({"5": 200}), "logit_bias.5"),
        (json!({"5": "high"}), "logit_bias.5"),
        (json!({"99999999": 1}), "logit_bias"),
        (json!([1, 2]), "logit_bias"),
        (json!({"5": 1, "05": 2}), "logit_bias"),
    ] {
        let r = post(srv.addr, "/v1/completions", &body(bias.clone()));
        assert_eq!(r.status, 400, "{bias}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{bias}: {}", r.text());
    }
}

/// `echo` on `/v1/completions`: the prompt comes before the text and, with `logprobs`, the
/// prompt tokens' logprobs before the generated ones (the first `null`) — the logprob echo gives
/// a prompt token is the one a request ending just before it gives that token when it generates
/// it (lm-evaluation-harness's loglikelihood); such requests bypass the prefix cache.
#[test]
fn echo_puts_the_prompt_and_its_logprobs_first() {
    let srv = start(Some(PrefixConfig::new(PrefixConfig::GRID, 64 << 20)));
    let tok = Tokenizer::from_dir(&nano_dir()).unwrap();
    let a: Vec<u32> = tok.encode(&"Now is the winter of our discontent made glorious summer. ".repeat(3), false);
    let body = |prompt: &[u32], extra: Value| {
        let mut b = json!({"model": "k3-nano", "prompt": prompt, "max_tokens": 3, "temperature": 0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let first = post(srv.addr, "/v1/completions", &body(&a, json!({"logprobs": 2}))).json();
    let g = tok.encode(first["choices"][0]["logprobs"]["tokens"][0].as_str().unwrap(), false);
    assert_eq!(g.len(), 1);
    let lp_g = first["choices"][0]["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    // Twice: the second time the prompt's cells are in the cache, and must not be used.
    let ag: Vec<u32> = a.iter().copied().chain(g.iter().copied()).collect();
    for round in 0..2 {
        let v = post(srv.addr, "/v1/completions", &body(&ag, json!({"logprobs": 2, "echo": true}))).json();
        let c = &v["choices"][0];
        let text = c["text"].as_str().unwrap();
        assert!(text.starts_with(&tok.decode(&ag, false).unwrap()), "round {round}: {text:?}");
        let lp = &c["logprobs"];
        let n = ag.len() + 3;
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            assert_eq!(lp[k].as_array().unwrap().len(), n, "round {round}: {k}: {lp}");
        }
        assert!(lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
        let offs: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect();
        assert!(offs.windows(2).all(|w| w[0] <= w[1]), "{offs:?}");
        let echoed = lp["token_logprobs"][a.len()].as_f64().unwrap();
        assert!((echoed - lp_g).abs() < 1e-4, "round {round}: echo scores the token {echoed}, generating it gave {lp_g}");
        assert_eq!(lp["top_logprobs"][a.len()].as_object().unwrap().len(), 2);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "round {round}: {}", v["usage"]);
    }
    // Without logprobs: the text only. Streamed: the prompt in the first chunk.
    let plain = post(srv.addr, "/v1/completions", &body(&a, json!({}))).json();
    let echoed = post(srv.addr, "/v1/completions", &body(&a, json!({"echo": true}))).json();
    let prompt_text = tok.decode(&a, false).unwrap();
    assert_eq!(echoed["choices"][0]["text"].as_str().unwrap(), prompt_text.clone() + plain["choices"][0]["text"].as_str().unwrap());
    assert!(echoed["choices"][0]["logprobs"].is_null());
    let s = post(srv.addr, "/v1/completions", &body(&a, json!({"echo": true, "stream": true, "logprobs": 1})));
    let firstchunk: Value = serde_json::from_str(&s.sse()[0]).unwrap();
    assert_eq!(firstchunk["choices"][0]["text"].as_str().unwrap(), prompt_text);
    assert_eq!(firstchunk["choices"][0]["logprobs"]["tokens"].as_array().unwrap().len(), a.len());
    // Characters split across tokens: the echoed text is the prompt, and the offsets (in
    // characters) index into it, then go on into the generated text.
    let text = "héllo wörld, 世界 🌍 — ünïcode ☃";
    let v =
        post(srv.addr, "/v1/completions", &json!({"model": "k3-nano", "prompt": text, "max_tokens": 3, "temperature": 0, "echo": true, "logprobs": 1})).json();
    let c = &v["choices"][0];
    let out = c["text"].as_str().unwrap();
    assert!(out.starts_with(text), "{out:?}");
    let offs: Vec<usize> = c["logprobs"]["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap() as usize).collect();
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(offs.windows(2).all(|w| w[0] <= w[1]), "{offs:?}");
    assert!(offs[p - 1] < text.chars().count() && offs[p] == text.chars().count(), "{offs:?} for {} characters", text.chars().count());
    assert!(offs.iter().all(|&o| o <= out.chars().count()));
}
