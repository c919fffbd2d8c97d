//! `k3 serve` as a child process for the CLI's end-to-end tests (each includes it with
//! `#[path = ".../tests/support/serve.rs"] mod serve;`): started on a free loopback port with
//! the caller's flags, its address read from the line it prints, killed when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
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
