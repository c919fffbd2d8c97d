//! The accept loop: HTTP/1.1 connections served by hyper with a header read timeout, a bounded
//! graceful shutdown, and OpenAI-shaped bodies on the errors hyper answers by itself.
//!
//! Each accepted socket is served by `hyper::server::conn::http1` with
//! [`ServerConfig::read_timeout`] as its header read timeout (a client that sends half a request
//! head is disconnected; the body side is timed by [`crate::server::read_body`]). On shutdown the
//! listener closes, idle connections close, and requests in flight get
//! [`ServerConfig::shutdown_timeout`] to finish before the loop returns anyway — so SIGTERM ends
//! the process even when a client never finishes its request.
//!
//! Errors hyper raises before a request reaches the router — a malformed head or
//! `Content-Length` (400), a URI over hyper's limit (414), too many or too large headers (431) —
//! are answered by hyper with an empty body. [`ErrorBodies`] wraps the socket and rewrites
//! exactly those responses (status 400/414/431 with `content-length: 0`, which the router never
//! produces: its errors always carry a JSON body) into OpenAI's error shape.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;

use crate::error::Result;
use crate::server::ServerConfig;

/// Serves `router` on `listener` until `shutdown` resolves, then drains for at most
/// `cfg.shutdown_timeout`.
pub async fn serve_connections(listener: TcpListener, router: Router, cfg: &ServerConfig, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(cfg.read_timeout.max(Duration::from_millis(1)));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // Out of file descriptors and the like: wait instead of spinning.
                        eprintln!("k3 serve: accepting a connection failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let conn = http.serve_connection(TokioIo::new(ErrorBodies::new(stream)), TowerToHyperService::new(router.clone()));
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
            _ = &mut shutdown => break,
        }
    }
    drop(listener);
    let grace = cfg.shutdown_timeout;
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        eprintln!("k3 serve: requests still open after {} s; closing them", grace.as_secs_f32());
    }
    Ok(())
}

/// A socket whose writes of hyper's own empty 400/414/431 answers become JSON error bodies.
pub struct ErrorBodies<T> {
    inner: T,
    pending: Vec<u8>,
    written: usize,
}

impl<T> ErrorBodies<T> {
    pub fn new(inner: T) -> Self {
        ErrorBodies { inner, pending: Vec::new(), written: 0 }
    }
}

impl<T: AsyncWrite + Unpin> ErrorBodies<T> {
    /// Writes out a rewritten response before anything else.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ErrorBodies<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ErrorBodies<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        if let Some(r) = rewrite(buf) {
            this.pending = r;
            if let Poll::Ready(Err(e)) = this.drain(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.drain(cx))?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}

/// hyper's body-less automatic answer, as a response with an OpenAI error body; `None` for
/// every other write.
fn rewrite(buf: &[u8]) -> Option<Vec<u8>> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    if end + 4 != buf.len() {
        return None;
    }
    let head = std::str::from_utf8(&buf[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let code: u16 = status_line.strip_prefix("HTTP/1.1 ").or_else(|| status_line.strip_prefix("HTTP/1.0 "))?.get(..3)?.parse().ok()?;
    let headers: Vec<&str> = lines.collect();
    if !headers.iter().any(|h| h.eq_ignore_ascii_case("content-length: 0")) {
        return None;
    }
    let (message, kind) = match code {
        400 => ("the request could not be parsed: a malformed request line or header, or an invalid Content-Length", "bad_request"),
        414 => ("the request URI is too long", "uri_too_long"),
        431 => ("the request headers are too large (too many, or too long)", "request_header_fields_too_large"),
        _ => return None,
    };
    let body = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": kind}}).to_string();
    let mut out = format!("{status_line}\r\n");
    for h in headers.iter().filter(|h| !h.to_ascii_lowercase().starts_with("content-length:")) {
        out.push_str(h);
        out.push_str("\r\n");
    }
    out.push_str(&format!("content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()));
    Some(out.into_bytes())
}

#[cfg(test)]
mod tests {
    use super::rewrite;

    #[test]
    fn only_empty_parse_errors_are_rewritten() {
        let r = rewrite(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n").expect("rewritten");
        let t = String::from_utf8(r).unwrap();
        let (head, body) = t.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431") && head.contains("connection: close") && head.contains("content-type: application/json"), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(rewrite(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n").is_none());
        assert!(rewrite(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n{}").is_none());
    }
}
