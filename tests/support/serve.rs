//! `k3 serve` as a child process for the CLI's end-to-end tests (each includes it with
//! `#[path = ".../tests/support/serve.rs"] mod serve;`): started on a free loopback port with
//! the caller's flags, its address read from the line it prints, killed when dropped; a JSON
//! POST and a `/metrics` sample reader over plain HTTP/1.1.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// A running `k3 serve`; killed (and reaped) on drop.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `k3 serve --host 127.0.0.1 --port 0` with `extra` and waits up to `wait` for its
/// address line; the server and its `host:port`.
pub fn start(extra: &[&str], wait: Duration) -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["serve", "--host", "127.0.0.1", "--port", "0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn k3 serve");
    let stdout = child.stdout.take().expect("stdout");
    let server = Server(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(addr) = line.split_whitespace().find_map(|w| w.strip_prefix("http://")) {
                let _ = tx.send(addr.trim_end_matches('/').to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(wait).unwrap_or_else(|_| panic!("k3 serve {extra:?} printed no address within {wait:?}"));
    (server, addr)
}

/// POSTs `body` to `path` of `addr` (`host:port`) and returns the JSON answer (a non-200 fails).
pub fn post(addr: &str, path: &str, body: &serde_json::Value) -> serde_json::Value {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let b = body.to_string();
    write!(s, "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len())
        .expect("write");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The sum of the Prometheus samples at `addr` (`host:port` or a base URL) whose line starts
/// with `name`.
pub fn metric(addr: &str, name: &str) -> f64 {
    let addr = addr.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).expect("connect for /metrics");
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.lines().filter(|l| l.starts_with(name) && !l.starts_with('#')).filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok()).sum()
}
