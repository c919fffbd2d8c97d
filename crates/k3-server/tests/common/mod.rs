//! A minimal blocking HTTP/1.1 client for the integration tests (loopback only), with chunked
//! decoding and SSE splitting, plus helpers to start a server around a scripted backend or the
//! real engine with the embedded k3-nano.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use k3_tokenizer::Tokenizer;

#[path = "../../../../tests/support/golden.rs"]
mod golden;
pub use golden::*;

pub fn tokenizer() -> Arc<Tokenizer> {
    let dir = golden_path("tokenizer");
    Arc::new(Tokenizer::from_dir(&dir).unwrap_or_else(|e| panic!("golden tokenizer at {}: {e}", dir.display())))
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        self.text().split("\n\n").filter_map(|ev| ev.strip_prefix("data: ")).map(str::to_owned).collect()
    }
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    if !body.is_empty() {
        r.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    r.push_str("\r\n");
    let mut b = r.into_bytes();
    b.extend_from_slice(body);
    b
}

pub fn send(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    s.write_all(&request_bytes(method, path, headers, body)).expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    parse(&raw)
}

pub fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Resp {
    send(addr, "POST", path, &[], body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    send(addr, "GET", path, &[], b"")
}

pub fn parse(raw: &[u8]) -> Resp {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("no header end");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
    let headers: Vec<(String, String)> = lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())).collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        body = dechunk(&body);
    }
    Resp { status, headers, body }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).split(';').next().unwrap_or("0").trim(), 16).unwrap_or(0);
        if size == 0 || b.len() < eol + 2 + size {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[(eol + 4 + size).min(b.len())..];
    }
    out
}

/// A metric's value from the Prometheus text (first line starting with `name{` or `name `).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing in\n{text}"))
}

/// Opens a streaming chat request and returns the socket after the first bytes arrived (a 200).
pub fn open_stream(addr: SocketAddr, content: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    let body = serde_json::json!({"messages": [{"role": "user", "content": content}], "stream": true}).to_string();
    s.write_all(&request_bytes("POST", "/v1/chat/completions", &[], body.as_bytes())).expect("write");
    s.set_read_timeout(Some(Duration::from_secs(20))).ok();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).expect("first bytes");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&buf[..n]));
    s
}

/// The embedded k3-nano's directory.
pub fn nano_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano")
}

/// A server on the real engine (CPU, a batch of 8) with k3-nano, its prefix cache as given,
/// admitting `max_batch` running and `max_queue` queued requests.
pub fn nano_server(prefix: Option<k3_engine::PrefixConfig>, max_batch: usize, max_queue: usize) -> k3_server::BackgroundServer {
    let dir = nano_dir();
    let model = Arc::new(k3_model::Model::load(&k3_model::Checkpoint::open(&dir).unwrap()).unwrap());
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let engine = k3_engine::Engine::new(model, Some(tok.clone()), k3_engine::EngineConfig { max_batch: 8, prefix, ..Default::default() });
    let cfg = k3_server::ServerConfig { served_model_name: "k3-nano".into(), max_batch, max_queue, ..Default::default() };
    k3_server::spawn_background(Box::new(engine), tok, cfg).expect("server starts")
}
