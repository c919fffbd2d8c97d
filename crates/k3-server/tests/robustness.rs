//! Bad clients and bad requests against an in-process server with the scripted backend (issue
//! 28, server items 1–8): a queued stream whose client leaves is cancelled at once; slow or
//! half-sent requests time out and cannot hold the shutdown; `tools`, `tool_choice`,
//! `response_format` (also inside `chat_template_kwargs`), `max_tokens` beyond the context and
//! `/v1/completions`' `logprobs` / nested prompts are 400s naming the parameter; a tokenizer
//! without the chat format's specials is refused at start-up; the errors hyper raises before
//! routing (400, 414, 431) carry OpenAI's JSON error body.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use k3_server::{spawn_background, BackgroundServer, Scripted, ServerConfig};
use k3_tokenizer::Tokenizer;
use serde_json::{json, Value};

const PLAIN_OUT: &str = "Hi.<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>";

fn start(cfg: ServerConfig, step_delay: Duration) -> BackgroundServer {
    let tok = tokenizer();
    let t = tok.clone();
    let script = Box::new(move |prompt: &[u32]| {
        let text = t.decode(prompt, true).unwrap_or_default();
        let out = if text.contains("KEY_LONG") { format!("{}<|end_of_msg|>", "word ".repeat(400)) } else { PLAIN_OUT.to_owned() };
        t.encode(&out, true)
    });
    let mut b = Scripted::new(tok.clone(), script);
    b.max_batch = cfg.max_batch;
    b.step_delay = step_delay;
    b.max_context = 512;
    spawn_background(Box::new(b), tok, cfg).expect("server starts")
}

fn cfg() -> ServerConfig {
    ServerConfig { served_model_name: "scripted".into(), max_batch: 4, max_queue: 4, ..Default::default() }
}

fn chat(extra: Value) -> Value {
    let mut v = json!({"messages": [{"role": "user", "content": "hi"}]});
    for (k, x) in extra.as_object().expect("object") {
        v[k] = x.clone();
    }
    v
}

/// A 400 whose `param` is `param`.
fn assert_400(addr: SocketAddr, path: &str, body: &Value, param: &str) {
    let r = post(addr, path, body);
    assert_eq!(r.status, 400, "{body}: {}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(v["error"]["param"], param, "{body}: {v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains(param)), "{v}");
}

fn wait_metrics(addr: SocketAddr, what: &str, limit: Duration, ok: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let m = get(addr, "/metrics").text();
        if ok(&m) {
            return m;
        }
        assert!(t0.elapsed() < limit, "timed out waiting for {what}:\n{m}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Item 1: `--max-batch 1 --max-queue 4`, a queued stream killed: cancelled while the running
/// request is still running (it used to wait for its first token), and its queue slot is free.
#[test]
fn queued_stream_disconnect_is_cancelled_at_once() {
    let srv = start(ServerConfig { max_batch: 1, max_queue: 4, ..cfg() }, Duration::from_millis(10));
    let running = open_stream(srv.addr, "KEY_LONG"); // ~4 s of tokens
    let queued = open_stream(srv.addr, "KEY_LONG");
    wait_metrics(srv.addr, "one queued", Duration::from_secs(5), |m| metric(m, "k3_queue_depth") == 1.0 && metric(m, "k3_running_sequences") == 1.0);
    drop(queued);
    // "At once" = while the running stream (~4 s of tokens) still runs, checked below; the
    // wait's bound leaves room for a loaded machine (1.5 s flaked under parallel builds).
    let m = wait_metrics(srv.addr, "the queued stream cancelled", Duration::from_millis(3000), |m| metric(m, "k3_cancelled_total") == 1.0);
    assert_eq!(metric(&m, "k3_queue_depth"), 0.0, "{m}");
    assert_eq!(metric(&m, "k3_running_sequences"), 1.0, "the first stream must still be running:\n{m}");
    assert_eq!(metric(&m, "k3_requests_live"), 1.0, "{m}");
    drop(running);
}

/// Item 2: a body that stops arriving is answered 408 after the read timeout; a half-sent
/// request head is disconnected; neither holds the shutdown past `shutdown_timeout`.
#[test]
fn slow_clients_time_out_and_shutdown_is_bounded() {
    let srv = start(ServerConfig { read_timeout: Duration::from_millis(700), shutdown_timeout: Duration::from_millis(500), ..cfg() }, Duration::ZERO);
    let mut s = TcpStream::connect(srv.addr).expect("connect");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{").expect("write");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let t0 = Instant::now();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    assert!(t0.elapsed() < Duration::from_secs(5), "the half-sent body was held {:?}", t0.elapsed());
    let r = parse(&raw);
    assert_eq!(r.status, 408, "{}", r.text());
    assert_eq!(r.json()["error"]["code"], "request_timeout");
    // Half a request head: the connection is closed.
    let mut s = TcpStream::connect(srv.addr).expect("connect");
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").expect("write");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let t0 = Instant::now();
    let _ = s.read_to_end(&mut Vec::new());
    assert!(t0.elapsed() < Duration::from_secs(5), "the half-sent head was held {:?}", t0.elapsed());
    drop(s);
    // Shutdown with a client that never finishes (and a server that would wait for it).
    let slow = ServerConfig { read_timeout: Duration::from_secs(600), shutdown_timeout: Duration::from_millis(500), ..cfg() };
    let srv = start(slow, Duration::ZERO);
    let mut hung = TcpStream::connect(srv.addr).expect("connect");
    hung.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{").expect("write");
    std::thread::sleep(Duration::from_millis(200));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(srv);
        let _ = tx.send(());
    });
    assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok(), "shutdown waited for a client that never finished its request");
    drop(hung);
}

/// Item 3: bad tool declarations, `tool_choice` and `response_format` are 400s naming the path.
#[test]
fn tools_tool_choice_and_response_format_are_validated() {
    let srv = start(cfg(), Duration::ZERO);
    let a = srv.addr;
    let p = "/v1/chat/completions";
    let weather =
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    assert_400(a, p, &chat(json!({"tools": [{"type": "bogus", "function": {"name": "f", "parameters": "notobject"}}]})), "tools[0].type");
    assert_400(a, p, &chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "notobject"}}]})), "tools[0].function.parameters");
    assert_400(
        a,
        p,
        &chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]})),
        "tools[0].function.parameters.type",
    );
    let nested = json!({"type": "object", "properties": {"x": {"type": "strnig"}}});
    assert_400(
        a,
        p,
        &chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested}}]})),
        "tools[0].function.parameters.properties.x.type",
    );
    assert_400(a, p, &chat(json!({"tools": [weather, {"function": {"name": "g"}}]})), "tools[1].type");
    assert_400(a, p, &chat(json!({"tools": [weather, weather]})), "tools[1].function.name");
    assert_400(a, p, &chat(json!({"tools": [{"type": "function"}]})), "tools[0].function");
    assert_400(a, p, &chat(json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}})), "tool_choice.function.name");
    assert_400(a, p, &chat(json!({"tools": [weather], "tool_choice": {}})), "tool_choice.type");
    assert_400(a, p, &chat(json!({"tool_choice": "required"})), "tool_choice");
    assert_400(a, p, &chat(json!({"tool_choice": 5})), "tool_choice");
    assert_400(a, p, &chat(json!({"response_format": {"type": "json_schema"}})), "response_format.json_schema");
    assert_400(a, p, &chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})), "response_format.json_schema.schema");
    assert_400(
        a,
        p,
        &chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}})),
        "response_format.json_schema.schema.type",
    );
    assert_400(a, p, &chat(json!({"response_format": {"type": "bogus"}})), "response_format.type");
    assert_400(a, p, &chat(json!({"response_format": "json"})), "response_format");
    // Valid requests still pass.
    let ok = |b: Value| {
        let r = post(a, p, &b);
        assert_eq!(r.status, 200, "{b}: {}", r.text());
    };
    ok(chat(json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})));
    ok(chat(json!({"tools": [weather], "tool_choice": "required"})));
    ok(chat(json!({"tool_choice": "none"})));
    ok(chat(
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "cat", "schema": {"type": "object", "properties": {"age": {"type": ["integer", "null"]}}, "required": ["age"]}}}}),
    ));
    ok(chat(json!({"response_format": {"type": "json_object"}})));
}

/// Item 4: the renderer's copies in `chat_template_kwargs` get the same checks.
#[test]
fn chat_template_kwargs_do_not_bypass_the_checks() {
    let srv = start(cfg(), Duration::ZERO);
    let p = "/v1/chat/completions";
    assert_400(
        srv.addr,
        p,
        &chat(json!({"chat_template_kwargs": {"response_format": {"type": "bogus"}, "tool_choice": 5}})),
        "chat_template_kwargs.tool_choice",
    );
    assert_400(srv.addr, p, &chat(json!({"chat_template_kwargs": {"response_format": {"type": "bogus"}}})), "chat_template_kwargs.response_format.type");
    assert_400(
        srv.addr,
        p,
        &chat(json!({"chat_template_kwargs": {"response_format": {"type": "json_schema"}}})),
        "chat_template_kwargs.response_format.json_schema",
    );
    assert_400(srv.addr, p, &chat(json!({"chat_template_kwargs": {"thinking": "no"}})), "chat_template_kwargs.thinking");
    assert_eq!(post(srv.addr, p, &chat(json!({"chat_template_kwargs": {"thinking": false, "tool_choice": "none"}}))).status, 200);
}

/// Item 5: `max_tokens` that prompt + max_tokens cannot fit is a 400 naming it; without it the
/// request runs to the rest of the context.
#[test]
fn max_tokens_beyond_the_context_is_refused() {
    let srv = start(cfg(), Duration::ZERO);
    let p = "/v1/chat/completions";
    assert_400(srv.addr, p, &chat(json!({"max_tokens": 1_000_000_000_000u64})), "max_tokens");
    assert_400(srv.addr, p, &chat(json!({"max_completion_tokens": 600})), "max_completion_tokens");
    assert_400(srv.addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 1_000_000_000_000u64}), "max_tokens");
    let r = post(srv.addr, p, &chat(json!({"max_tokens": 400})));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(srv.addr, p, &chat(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(srv.addr, "/v1/completions", &json!({"prompt": "hi"}));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Item 6: `/v1/completions` names its own `logprobs` field, and refuses nested non-id prompts.
#[test]
fn completions_logprobs_and_nested_prompts() {
    let srv = start(cfg(), Duration::ZERO);
    let p = "/v1/completions";
    assert_400(srv.addr, p, &json!({"prompt": "hi", "logprobs": 21}), "logprobs");
    assert_400(srv.addr, p, &json!({"prompt": [["x"]]}), "prompt[0]");
    assert_400(srv.addr, p, &json!({"prompt": [[]]}), "prompt[0]");
    let r = post(srv.addr, p, &json!({"prompt": [[5, 6, 7]], "logprobs": 5}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r = post(srv.addr, p, &json!({"prompt": ["hi"]}));
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Item 7: a tokenizer without `<|end_of_msg|>` is refused when the server starts.
#[test]
fn tokenizer_without_the_chat_specials_is_refused_at_start() {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let model: String = (0u8..=255).map(|b| format!("{} {b}\n", b64.encode([b]))).collect();
    let added: Vec<(u32, String, bool)> =
        [(256, "[EOS]"), (257, "<|open|>"), (258, "<|close|>"), (259, "<|sep|>")].iter().map(|&(i, n)| (i, n.to_owned(), true)).collect();
    let tok = Arc::new(Tokenizer::from_parts(&model, &PathBuf::from("tiny.tiktoken"), &added).expect("tiny tokenizer"));
    let t = tok.clone();
    let b = Scripted::new(tok.clone(), Box::new(move |_: &[u32]| t.encode("ok", true)));
    let e = spawn_background(Box::new(b), tok, cfg()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("<|end_of_msg|>") && e.contains("tokenizer"), "{e}");
}

/// Item 8: the errors hyper answers before routing carry OpenAI's error body.
#[test]
fn pre_routing_errors_have_openai_bodies() {
    let srv = start(cfg(), Duration::ZERO);
    let raw = |req: Vec<u8>| {
        let mut s = TcpStream::connect(srv.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).ok();
        let _ = s.write_all(&req);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        parse(&out)
    };
    let long_uri = format!("GET /v1/models?{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
    let many: String = (0..200).map(|i| format!("X-H{i}: v\r\n")).collect();
    let cases = [
        (long_uri.into_bytes(), 414),
        (format!("GET /health HTTP/1.1\r\nHost: x\r\n{many}\r\n").into_bytes(), 431),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n".to_vec(), 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n".to_vec(), 400),
    ];
    for (req, status) in cases {
        let r = raw(req);
        assert_eq!(r.status, status, "{}", r.text());
        assert!(r.header("content-type").is_some_and(|c| c.starts_with("application/json")), "{:?}", r.headers);
        let v = r.json();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    assert_eq!(get(srv.addr, "/health").status, 200);
}
