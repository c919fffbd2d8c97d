//! End-to-end HTTP tests against an in-process server whose backend is the scripted engine
//! double: XTML → `reasoning_content` / `tool_calls` (streaming and not), server-side stop
//! strings, OpenAI error shapes and statuses, API keys, the bounded queue (429), client
//! disconnects freeing state, engine failures failing one request only, and `/metrics`.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use k3_server::{spawn_background, BackgroundServer, Scripted, ServerConfig};
use k3_tokenizer::Tokenizer;
use serde_json::{json, Value};

const TOOL_OUT: &str = "Need the weather tool.<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"unit\" type=\"string\"<|sep|>c<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
const PLAIN_OUT: &str =
    "Hi there.<|close|>think<|sep|><|open|>response<|sep|>Hello! How can I help?<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>";
const STOP_OUT: &str = "alpha beta STOP gamma delta<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>";

fn script(tok: Arc<Tokenizer>) -> k3_server::backend::Script {
    Box::new(move |prompt: &[u32]| {
        let text = tok.decode(prompt, true).unwrap_or_default();
        if text.contains("KEY_PANIC") {
            panic!("scripted engine failure");
        }
        let out = if text.contains("KEY_WEATHER") {
            TOOL_OUT.to_owned()
        } else if text.contains("KEY_STOP") {
            STOP_OUT.to_owned()
        } else if text.contains("KEY_LONG") {
            format!("{}<|end_of_msg|>", "word ".repeat(400))
        } else {
            PLAIN_OUT.to_owned()
        };
        tok.encode(&out, true)
    })
}

fn start(cfg: ServerConfig, step_delay: Duration) -> BackgroundServer {
    let tok = tokenizer();
    let mut b = Scripted::new(tok.clone(), script(tok.clone()));
    b.max_batch = cfg.max_batch;
    b.step_delay = step_delay;
    b.max_context = 512;
    spawn_background(Box::new(b), tok, cfg).expect("server starts")
}

fn cfg() -> ServerConfig {
    ServerConfig { served_model_name: "scripted".into(), max_body_bytes: 64 << 10, max_batch: 4, max_queue: 4, ..Default::default() }
}

fn weather_request(stream: bool) -> Value {
    json!({
        "model": "scripted", "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "KEY_WEATHER in Paris?"}]}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "tool_choice": "auto",
    })
}

#[test]
fn n_choices_each_parse_their_tool_calls_with_their_own_ids() {
    let srv = start(cfg(), Duration::ZERO);
    let mut body = weather_request(false);
    body["n"] = json!(3);
    let v = post(srv.addr, "/v1/chat/completions", &body).json();
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{v}");
    let mut ids = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i as u64);
        assert_eq!(c["finish_reason"], "tool_calls");
        assert_eq!(c["message"]["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\", \"unit\": \"c\"}");
        ids.push(c["message"]["tool_calls"][0]["id"].as_str().unwrap().to_owned());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 3, "tool call ids repeat across choices: {ids:?}");
    let one = post(srv.addr, "/v1/chat/completions", &weather_request(false)).json();
    assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), 3 * one["usage"]["completion_tokens"].as_u64().unwrap());
    // Streamed: every choice gets its role chunk, its call and its finish.
    let mut body = weather_request(true);
    body["n"] = json!(2);
    let r = post(srv.addr, "/v1/chat/completions", &body);
    let (mut roles, mut calls, mut finishes) = ([0; 2], [0; 2], [0; 2]);
    for d in r.sse().iter().filter(|d| d.as_str() != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            roles[i] += (c["delta"]["role"] == "assistant") as usize;
            calls[i] += c["delta"]["tool_calls"].is_array() as usize;
            finishes[i] += (c["finish_reason"] == "tool_calls") as usize;
        }
    }
    assert_eq!((roles, calls, finishes), ([1, 1], [1, 1], [1, 1]));
}

#[test]
fn tool_calls_and_reasoning_non_streaming() {
    let srv = start(cfg(), Duration::ZERO);
    let r = post(srv.addr, "/v1/chat/completions", &weather_request(false));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    assert_eq!(c["message"]["reasoning_content"], "Need the weather tool.");
    assert_eq!(c["message"]["content"], "Let me check.");
    let calls = c["message"]["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\", \"unit\": \"c\"}");
    assert!(calls[0]["id"].as_str().is_some_and(|id| id.starts_with("call_")));
    let tok = tokenizer();
    let n_out = tok.encode(TOOL_OUT, true).len() as u64;
    assert_eq!(v["usage"]["completion_tokens"], n_out);
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 10);
    assert_eq!(v["object"], "chat.completion");
    // Ids differ between responses.
    let r2 = post(srv.addr, "/v1/chat/completions", &weather_request(false)).json();
    assert_ne!(r2["choices"][0]["message"]["tool_calls"][0]["id"], calls[0]["id"]);
}

#[test]
fn tool_calls_and_reasoning_streaming() {
    let srv = start(cfg(), Duration::ZERO);
    let r = post(srv.addr, "/v1/chat/completions", &weather_request(true));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = r.sse();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("chunk JSON")).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut reasoning, mut content, mut calls, mut finish) = (String::new(), String::new(), vec![], None);
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        let Some(ch) = c["choices"].get(0) else { continue };
        let d = &ch["delta"];
        reasoning += d["reasoning_content"].as_str().unwrap_or("");
        content += d["content"].as_str().unwrap_or("");
        if let Some(tc) = d["tool_calls"].as_array() {
            calls.extend(tc.iter().cloned());
        }
        if !ch["finish_reason"].is_null() {
            finish = ch["finish_reason"].as_str().map(str::to_owned);
        }
    }
    assert_eq!(reasoning, "Need the weather tool.");
    assert_eq!(content, "Let me check.");
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\", \"unit\": \"c\"}");
    assert!(calls[0]["id"].is_string());
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], tokenizer().encode(TOOL_OUT, true).len() as u64);
    assert!(chunks.last().is_some_and(|c| c["choices"].as_array().is_some_and(Vec::is_empty)));
}

#[test]
fn plain_reasoning_then_content_and_tool_choice_none() {
    let srv = start(cfg(), Duration::ZERO);
    let v = post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]})).json();
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "Hi there.");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello! How can I help?");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // tool_choice none: the tools channel is dropped and no tool_calls are reported.
    let mut req = weather_request(false);
    req["tool_choice"] = json!("none");
    let v = post(srv.addr, "/v1/chat/completions", &req).json();
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn stop_strings_cut_content_and_cancel() {
    let srv = start(cfg(), Duration::ZERO);
    let req = json!({
        "messages": [{"role": "user", "content": "KEY_STOP"}], "stop": ["STOP"],
        "chat_template_kwargs": {"thinking": false},
    });
    let v = post(srv.addr, "/v1/chat/completions", &req).json();
    assert_eq!(v["choices"][0]["message"]["content"], "alpha beta ", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let r = post(srv.addr, "/v1/chat/completions", &sreq);
    let content: String = r
        .sse()
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(content, "alpha beta ");
    // max_tokens cuts with finish_reason length.
    let v = post(
        srv.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "KEY_STOP"}], "max_tokens": 2, "chat_template_kwargs": {"thinking": false}}),
    )
    .json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[test]
fn errors_have_openai_shape_and_status() {
    let srv = start(cfg(), Duration::ZERO);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let long = "many words ".repeat(400);
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", b"{\"messages\": [".to_vec(), 400, None),
        ("/v1/chat/completions", b"{\"messages\": \"\xff\xfe\"}".to_vec(), 400, None),
        ("/v1/chat/completions", b"[1, 2]".to_vec(), 400, None),
        ("/v1/chat/completions", json!({"messages": msgs, "bogus_field": 1}).to_string().into_bytes(), 400, Some("bogus_field")),
        ("/v1/chat/completions", json!({"messages": msgs, "temperature": "hot"}).to_string().into_bytes(), 400, Some("temperature")),
        ("/v1/chat/completions", json!({"messages": msgs, "top_p": 2.0}).to_string().into_bytes(), 400, Some("top_p")),
        ("/v1/chat/completions", json!({"messages": msgs, "temperature": -0.5}).to_string().into_bytes(), 400, Some("temperature")),
        ("/v1/chat/completions", json!({"messages": msgs, "presence_penalty": 9}).to_string().into_bytes(), 400, Some("presence_penalty")),
        ("/v1/chat/completions", json!({"messages": msgs, "logprobs": true, "top_logprobs": 50}).to_string().into_bytes(), 400, Some("top_logprobs")),
        ("/v1/chat/completions", json!({"messages": msgs, "max_tokens": -3}).to_string().into_bytes(), 400, Some("max_tokens")),
        ("/v1/chat/completions", json!({"messages": msgs, "n": 0}).to_string().into_bytes(), 400, Some("n")),
        ("/v1/chat/completions", json!({"messages": msgs, "stop": 5}).to_string().into_bytes(), 400, Some("stop")),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "stream_options": {"include_usage": "yes"}}).to_string().into_bytes(),
            400,
            Some("stream_options.include_usage"),
        ),
        ("/v1/chat/completions", json!({"messages": msgs, "reasoning_effort": "ultra"}).to_string().into_bytes(), 400, Some("reasoning_effort")),
        ("/v1/chat/completions", json!({"messages": msgs, "response_format": {"type": "xml"}}).to_string().into_bytes(), 400, Some("response_format.type")),
        ("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(), 400, Some("messages[0].role")),
        ("/v1/chat/completions", json!({"messages": []}).to_string().into_bytes(), 400, Some("messages")),
        ("/v1/chat/completions", json!({}).to_string().into_bytes(), 400, Some("messages")),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": long}]}).to_string().into_bytes(), 400, Some("messages")),
        ("/v1/chat/completions", json!({"model": "gpt-9", "messages": msgs}).to_string().into_bytes(), 404, Some("model")),
        ("/v1/chat/completions", vec![b' '; 70 << 10], 413, None),
        ("/v1/completions", json!({"prompt": {"a": 1}}).to_string().into_bytes(), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": [1, -2]}).to_string().into_bytes(), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": [99999999]}).to_string().into_bytes(), 400, Some("prompt")),
        ("/v1/completions", json!({"prompt": "x", "echo": true, "logprobs": 1}).to_string().into_bytes(), 400, Some("echo")),
        ("/v1/completions", json!({"prompt": "x", "min_p": 1.5}).to_string().into_bytes(), 400, Some("min_p")),
        ("/v1/nothing", b"{}".to_vec(), 404, None),
    ];
    for (path, body, status, param) in cases {
        let r = send(srv.addr, "POST", path, &[], &body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        assert_eq!(r.status, status, "{path} {shown}: {}", r.text());
        let v = r.json();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(), "{v}");
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{shown}: {v}");
        }
    }
    let r = send(srv.addr, "GET", "/v1/chat/completions", &[], b"");
    assert_eq!(r.status, 405);
    assert!(r.json()["error"]["message"].is_string());
    let v = post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": long}]})).json();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // Still serving after all that.
    assert_eq!(post(srv.addr, "/v1/chat/completions", &json!({"messages": msgs})).status, 200);
}

#[test]
fn api_key_is_required_on_v1_routes() {
    let srv = start(ServerConfig { api_key: Some("sekrit".into()), ..cfg() }, Duration::ZERO);
    let body = json!({"messages": [{"role": "user", "content": "hi"}]}).to_string();
    let r = send(srv.addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401);
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let r = send(srv.addr, "POST", "/v1/chat/completions", &[("Authorization", "Bearer wrong")], body.as_bytes());
    assert_eq!(r.status, 401);
    let r = send(srv.addr, "GET", "/v1/models", &[("Authorization", "Bearer sekrit")], b"");
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["data"][0]["id"], "scripted");
    let r = send(srv.addr, "POST", "/v1/chat/completions", &[("Authorization", "Bearer sekrit")], body.as_bytes());
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(get(srv.addr, "/health").status, 200);
    let r = send(srv.addr, "POST", "/tokenize", &[], br#"{"prompt": "hi"}"#);
    assert_eq!(r.status, 401, "/tokenize needs the key too");
    let r = send(srv.addr, "POST", "/detokenize", &[("Authorization", "Bearer sekrit")], br#"{"tokens": [1]}"#);
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn tokenize_counts_what_the_chat_renders_and_detokenize_inverts_it() {
    let srv = start(cfg(), Duration::ZERO);
    let tok = tokenizer();
    let text = "Hello, world! 1234 — ünïcode";
    let v = post(srv.addr, "/tokenize", &json!({"model": "scripted", "prompt": text, "return_token_strs": true})).json();
    let ids = tok.encode(text, true);
    assert_eq!(v["tokens"], json!(ids));
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["max_model_len"], 512);
    assert_eq!(v["token_strs"].as_array().unwrap().len(), ids.len());
    let back = post(srv.addr, "/detokenize", &json!({"tokens": ids})).json();
    assert_eq!(back["prompt"], text);
    // Chat messages: the count is the chat request's usage.prompt_tokens, options included.
    let req = weather_request(false);
    let mut t = req.clone();
    for k in ["model", "stream", "stream_options"] {
        t.as_object_mut().unwrap().remove(k);
    }
    let counted = post(srv.addr, "/tokenize", &t).json();
    let used = post(srv.addr, "/v1/chat/completions", &req).json();
    assert_eq!(counted["count"], used["usage"]["prompt_tokens"], "{counted}");
    t["reasoning_effort"] = json!("none");
    let off = post(srv.addr, "/tokenize", &t).json();
    assert_ne!(off["tokens"], counted["tokens"], "thinking off renders differently");
    // Bad input names the field.
    for (path, body, param) in [
        ("/tokenize", json!({"prompt": "a", "messages": []}), Value::Null),
        ("/tokenize", json!({}), json!("prompt")),
        ("/tokenize", json!({"messages": []}), json!("messages")),
        ("/tokenize", json!({"prompt": 5}), json!("prompt")),
        ("/tokenize", json!({"prompt": "a", "bogus": 1}), json!("bogus")),
        ("/tokenize", json!({"model": "other", "prompt": "a"}), json!("model")),
        (
            "/tokenize",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
            json!("messages[0].content[0].image_url"),
        ),
        ("/detokenize", json!({"tokens": [1, 999999999]}), json!("tokens")),
        ("/detokenize", json!({"tokens": "12"}), json!("tokens")),
        ("/detokenize", json!({}), json!("tokens")),
    ] {
        let r = post(srv.addr, path, &body);
        assert!(r.status == 400 || r.status == 404, "{path} {body}: {} {}", r.status, r.text());
        assert_eq!(r.json()["error"]["param"], param, "{path} {body}: {}", r.text());
    }
}

fn wait_metrics(addr: std::net::SocketAddr, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let m = get(addr, "/metrics").text();
        if ok(&m) {
            return m;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting for {what}:\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn disconnects_cancel_and_free_state() {
    let srv = start(ServerConfig { max_batch: 8, ..cfg() }, Duration::from_millis(5));
    let mut streams: Vec<TcpStream> = (0..6).map(|_| open_stream(srv.addr, "KEY_LONG")).collect();
    let m = wait_metrics(srv.addr, "6 running", |m| metric(m, "k3_running_sequences") == 6.0);
    assert_eq!(metric(&m, "k3_state_bytes"), 6.0 * (1 << 20) as f64);
    streams.truncate(3); // drop half the clients mid-stream
    let m = wait_metrics(srv.addr, "3 running", |m| metric(m, "k3_running_sequences") == 3.0);
    assert_eq!(metric(&m, "k3_state_bytes"), 3.0 * (1 << 20) as f64);
    assert!(metric(&m, "k3_cancelled_total") >= 3.0);
    drop(streams);
    wait_metrics(srv.addr, "0 running", |m| metric(m, "k3_running_sequences") == 0.0 && metric(m, "k3_state_bytes") == 0.0);
}

#[test]
fn full_queue_answers_429_with_retry_after() {
    let srv = start(ServerConfig { max_batch: 1, max_queue: 1, ..cfg() }, Duration::from_millis(5));
    let a = open_stream(srv.addr, "KEY_LONG");
    let b = open_stream(srv.addr, "KEY_LONG");
    let r = post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["type"], "rate_limit_error");
    wait_metrics(srv.addr, "one queued", |m| metric(m, "k3_queue_depth") == 1.0 && metric(m, "k3_running_sequences") == 1.0);
    drop((a, b));
    wait_metrics(srv.addr, "idle", |m| metric(m, "k3_requests_live") == 0.0);
    assert_eq!(post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]})).status, 200);
}

#[test]
fn engine_failure_fails_only_that_request() {
    let srv = start(cfg(), Duration::ZERO);
    let r = post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "KEY_PANIC"}]}));
    assert_eq!(r.status, 500, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "server_error");
    let r = post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(r.status, 200);
}

#[test]
fn metrics_and_small_endpoints() {
    let srv = start(cfg(), Duration::ZERO);
    assert_eq!(post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]})).status, 200);
    assert_eq!(post(srv.addr, "/v1/chat/completions", &json!({"messages": 1})).status, 400);
    let h = get(srv.addr, "/health");
    assert_eq!(h.json()["status"], "ok");
    let m = get(srv.addr, "/metrics");
    assert!(m.header("content-type").is_some_and(|c| c.starts_with("text/plain")));
    let t = m.text();
    assert!(t.contains("k3_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1"), "{t}");
    assert!(t.contains("k3_requests_total{endpoint=\"/v1/chat/completions\",status=\"400\"} 1"), "{t}");
    assert_eq!(metric(&t, "k3_generation_tokens_total"), tokenizer().encode(PLAIN_OUT, true).len() as f64);
    assert!(metric(&t, "k3_prompt_tokens_total") > 0.0);
    assert_eq!(metric(&t, "k3_time_to_first_token_seconds_count"), 1.0);
    assert!(metric(&t, "k3_inter_token_latency_seconds_count") >= 1.0);
    for name in ["k3_queue_depth", "k3_running_sequences", "k3_state_bytes"] {
        assert!(t.contains(&format!("# TYPE {name} gauge")), "{name}");
    }
}

#[test]
fn non_streaming_disconnect_cancels() {
    let srv = start(ServerConfig { max_batch: 8, ..cfg() }, Duration::from_millis(5));
    let mut s = TcpStream::connect(srv.addr).expect("connect");
    let body = json!({"messages": [{"role": "user", "content": "KEY_LONG"}]}).to_string();
    s.write_all(&request_bytes("POST", "/v1/chat/completions", &[], body.as_bytes())).expect("write");
    wait_metrics(srv.addr, "1 running", |m| metric(m, "k3_running_sequences") == 1.0);
    drop(s);
    let m = wait_metrics(srv.addr, "0 running", |m| metric(m, "k3_running_sequences") == 0.0);
    assert_eq!(metric(&m, "k3_cancelled_total"), 1.0);
    assert_eq!(metric(&m, "k3_state_bytes"), 0.0);
}
