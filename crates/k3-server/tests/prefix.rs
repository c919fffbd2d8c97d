//! The prefix cache through HTTP on the real engine with the embedded k3-nano (issue 21): a
//! repeated long prompt reports `usage.prompt_tokens_details.cached_tokens` (chat and completions,
//! streamed and not) and answers what a server without the cache answers, token for token; the
//! prefix-cache counters appear on `/metrics`.

mod common;

use common::*;
use k3_engine::PrefixConfig;
use k3_server::BackgroundServer;
use serde_json::{json, Value};

fn start(prefix: Option<PrefixConfig>) -> BackgroundServer {
    nano_server(prefix, 8, 32)
}

const SYSTEM: &str = "You are the prompter of a company of players. When an actor forgets a line, you give him the \
next words of the speech, no more, in the manner of the play; you never explain, you never apologise, and you \
keep to the verse. The company plays Romeo and Juliet, Hamlet, Macbeth and The Tempest this season; the \
prompt book for each play is open before you, and you follow the scene as it is spoken. ";

fn chat_body(user: &str, stream: bool) -> Value {
    json!({"model": "k3-nano", "messages": [{"role": "system", "content": SYSTEM.repeat(2)}, {"role": "user", "content": user}],
        "reasoning_effort": "none", "max_tokens": 12, "temperature": 0, "stream": stream, "stream_options": {"include_usage": true}})
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"].as_u64().expect("usage.prompt_tokens_details.cached_tokens")
}

/// The streamed text and the final usage chunk of a chat stream.
fn stream_chat(addr: std::net::SocketAddr, body: &Value) -> (String, Value) {
    let r = post(addr, "/v1/chat/completions", body);
    let mut text = String::new();
    let mut usage = Value::Null;
    for d in r.sse() {
        if d == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&d).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, usage)
}

#[test]
fn repeated_prefix_reports_cached_tokens_and_equals_cold() {
    let warm = start(Some(PrefixConfig::new(PrefixConfig::GRID, 256 << 20)));
    let cold = start(None);
    let body = chat_body("ROMEO. But soft, what light", false);
    let first = post(warm.addr, "/v1/chat/completions", &body).json();
    let p = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(p > 2 * PrefixConfig::GRID as u64, "the prompt must span grid cells: {p} tokens");
    assert_eq!(cached(&first["usage"]), 0, "a cold start caches nothing");
    let again = post(warm.addr, "/v1/chat/completions", &body).json();
    let c = cached(&again["usage"]);
    assert_eq!(c, (p - 1) / PrefixConfig::GRID as u64 * PrefixConfig::GRID as u64, "an exact re-send resumes at the last grid point before its last token");
    let want = post(cold.addr, "/v1/chat/completions", &body).json();
    assert_eq!(cached(&want["usage"]), 0);
    for v in [&first, &again] {
        assert_eq!(v["choices"][0]["message"], want["choices"][0]["message"]);
    }
    // Another question after the same system prompt: a hit on the shared prefix (the branch
    // point found at admission is snapshotted by the first such request, so from the second on).
    let (text, usage) = stream_chat(warm.addr, &chat_body("JULIET. O Romeo, Romeo", true));
    let (text_cold, _) = stream_chat(cold.addr, &chat_body("JULIET. O Romeo, Romeo", true));
    assert_eq!(text, text_cold);
    let (text2, usage2) = stream_chat(warm.addr, &chat_body("HAMLET. To be, or not", true));
    assert_eq!(text2, stream_chat(cold.addr, &chat_body("HAMLET. To be, or not", true)).0);
    assert!(cached(&usage) + cached(&usage2) >= PrefixConfig::GRID as u64, "{usage} {usage2}");
    // Completions, streamed and not.
    let prompt = SYSTEM.repeat(3);
    let cbody = |stream: bool| json!({"model": "k3-nano", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream, "stream_options": {"include_usage": true}});
    let a = post(warm.addr, "/v1/completions", &cbody(false)).json();
    let b = post(warm.addr, "/v1/completions", &cbody(false)).json();
    assert!(cached(&b["usage"]) >= PrefixConfig::GRID as u64, "{}", b["usage"]);
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_eq!(b["choices"][0]["text"], post(cold.addr, "/v1/completions", &cbody(false)).json()["choices"][0]["text"]);
    let s = post(warm.addr, "/v1/completions", &cbody(true));
    let last: Value =
        s.sse().iter().rev().filter(|d| d.as_str() != "[DONE]").map(|d| serde_json::from_str::<Value>(d).unwrap()).find(|v| !v["usage"].is_null()).unwrap();
    assert!(cached(&last["usage"]) >= PrefixConfig::GRID as u64, "{last}");
    // The counters.
    let m = get(warm.addr, "/metrics").text();
    assert!(metric(&m, "k3_prefix_cache_lookups_total") >= 7.0, "{m}");
    assert!(metric(&m, "k3_prefix_cache_hits_total") >= 3.0, "{m}");
    assert!(metric(&m, "k3_prefix_cache_hit_tokens_total") >= 3.0 * PrefixConfig::GRID as f64, "{m}");
    assert!(metric(&m, "k3_prefix_cache_pool_bytes") > 0.0, "{m}");
    assert!(metric(&m, "k3_prefix_cache_snapshots_total") >= 1.0, "{m}");
    assert_eq!(metric(&m, "k3_prefix_cache_evictions_total"), 0.0, "{m}");
    let mc = get(cold.addr, "/metrics").text();
    assert!(!mc.contains("k3_prefix_cache"), "no counters without the cache");
}
