//! `k3 bench serve --base-url URL [--max-concurrency C] [--num-prompts N] [--input-len I]
//! [--output-len O] [--json]`: a load generator for an OpenAI-compatible server (`k3 serve`,
//! or any server with `/v1/completions`), in the spirit of `vllm bench serve` (issue 20).
//!
//! N requests of I random token ids each (ids below the server's `vocab_size` from
//! `/v1/models`, or `--vocab-size`) go to `/v1/completions` with `max_tokens` O,
//! `ignore_eos`, greedy, streaming with `stream_options.include_usage`, at most C at a time.
//! Per request: TTFT (send → first chunk with text), the gaps between chunks (ITL), TPOT
//! ((latency − TTFT) / (output tokens − 1), output tokens from the final usage chunk), errors
//! (HTTP status, a stream that ends without `[DONE]`, a connection error) counted, not fatal.
//! Reported: p50 / p90 / p99 (and mean) of each, request and token throughput over the wall
//! time. `--json` prints one object (`ttft_ms`, `tpot_ms`, `itl_ms` with `p50`, `p90`, `p99`,
//! `mean`; `output_tokens_per_s`, `requests_ok`, `requests_failed`, ...). A progress bar on a
//! terminal while it runs. Plain HTTP (hyper's client); no TLS.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

#[derive(clap::Args, Clone, Debug)]
pub struct ServeBenchArgs {
    /// The server, e.g. http://127.0.0.1:8000 (requests go to BASE/v1/completions).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Requests in flight at once (default: all of them).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Requests in all.
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Prompt tokens per request (random token ids).
    #[arg(long, default_value_t = 256)]
    pub input_len: usize,
    /// Generated tokens per request (`max_tokens`, with `ignore_eos`).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// The model name to send (default: the first of the server's /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Prompt ids are drawn below this (default: `vocab_size` from /v1/models).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Bearer token (the server's --api-key).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// One request's measurements, or why it failed.
#[derive(Debug, Default)]
struct Outcome {
    error: Option<String>,
    ttft: f64,
    latency: f64,
    itl: Vec<f64>,
    output_tokens: usize,
}

/// `(status, body)` of a request (the whole body).
async fn call(client: &HttpClient, req: hyper::Request<Full<Bytes>>) -> Result<(hyper::StatusCode, Vec<u8>)> {
    let resp = client.request(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes().to_vec();
    Ok((status, body))
}

fn request(a: &ServeBenchArgs, method: hyper::Method, path: &str, body: Option<&Value>) -> Result<hyper::Request<Full<Bytes>>> {
    let url = format!("{}{path}", a.base_url.trim_end_matches('/'));
    let mut b = hyper::Request::builder().method(method).uri(&url).header("content-type", "application/json");
    if let Some(k) = &a.api_key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let bytes = body.map(|v| Bytes::from(v.to_string())).unwrap_or_default();
    b.body(Full::new(bytes)).with_context(|| format!("--base-url {}: not a valid URL ({url})", a.base_url))
}

/// One streamed completion (see the module doc).
async fn one(client: HttpClient, req: hyper::Request<Full<Bytes>>) -> Outcome {
    let t0 = Instant::now();
    let mut o = Outcome::default();
    let fail = |mut o: Outcome, e: String| {
        o.error = Some(e);
        o
    };
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => return fail(o, format!("connection: {e}")),
    };
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body.collect().await.map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned()).unwrap_or_default();
        return fail(o, format!("HTTP {status}: {}", text.chars().take(300).collect::<String>()));
    }
    let (mut buf, mut last, mut done, mut chunks) = (Vec::<u8>::new(), None::<f64>, false, 0usize);
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => return fail(o, format!("reading the stream: {e}")),
        };
        let Some(data) = frame.data_ref() else { continue };
        buf.extend_from_slice(data);
        // Server-sent events: `data: …` lines, events separated by a blank line.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let now = t0.elapsed().as_secs_f64();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(payload) = line.strip_prefix("data:").map(str::trim) else { continue };
                if payload == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = match serde_json::from_str(payload) {
                    Ok(v) => v,
                    Err(e) => return fail(o, format!("a stream chunk is not JSON ({e}): {payload}")),
                };
                if let Some(err) = v.get("error") {
                    return fail(o, format!("error in the stream: {err}"));
                }
                if let Some(n) = v.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
                    o.output_tokens = n as usize;
                }
                let text = v.pointer("/choices/0/text").and_then(Value::as_str).unwrap_or("");
                let has_token = !text.is_empty() || v.pointer("/choices/0/finish_reason").is_some_and(|f| !f.is_null());
                if has_token && v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                    chunks += 1;
                    match last {
                        None => o.ttft = now,
                        Some(t) => o.itl.push(now - t),
                    }
                    last = Some(now);
                }
            }
        }
    }
    o.latency = t0.elapsed().as_secs_f64();
    if !done {
        return fail(o, "the stream ended without `data: [DONE]`".into());
    }
    if chunks == 0 {
        return fail(o, "the stream carried no tokens".into());
    }
    if o.output_tokens == 0 {
        return fail(o, "no usage.completion_tokens in the stream (the server ignored stream_options.include_usage)".into());
    }
    o
}

/// The `q`-quantile (0..=1) of sorted `x`, linear between ranks (numpy's default); 0 when empty.
pub fn quantile(x: &[f64], q: f64) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    let pos = q.clamp(0.0, 1.0) * (x.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    x[lo] + (x[hi] - x[lo]) * (pos - lo as f64)
}

/// `{p50, p90, p99, mean}` of `x` seconds, in milliseconds.
fn summary_ms(mut x: Vec<f64>) -> Value {
    x.sort_by(f64::total_cmp);
    let mean = if x.is_empty() { 0.0 } else { x.iter().sum::<f64>() / x.len() as f64 };
    json!({ "p50": quantile(&x, 0.5) * 1e3, "p90": quantile(&x, 0.9) * 1e3, "p99": quantile(&x, 0.99) * 1e3, "mean": mean * 1e3 })
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    if a.num_prompts == 0 || a.input_len == 0 || a.output_len == 0 {
        bail!("--num-prompts, --input-len and --output-len must be ≥ 1");
    }
    if a.max_concurrency == Some(0) {
        bail!("--max-concurrency must be ≥ 1");
    }
    if !a.base_url.starts_with("http://") {
        bail!("--base-url {}: give an http:// URL (the load generator speaks plain HTTP)", a.base_url);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    rt.block_on(drive(a))
}

async fn drive(a: ServeBenchArgs) -> Result<()> {
    let client: HttpClient = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1024).build_http();
    // The server's model, context and vocabulary.
    let (status, body) = tokio::time::timeout(Duration::from_secs(30), call(&client, request(&a, hyper::Method::GET, "/v1/models", None)?))
        .await
        .with_context(|| format!("--base-url {}: no answer to GET /v1/models within 30 s", a.base_url))?
        .with_context(|| format!("--base-url {}: cannot reach the server (is it running?)", a.base_url))?;
    if !status.is_success() {
        bail!("--base-url {}: GET /v1/models answered HTTP {status}: {}", a.base_url, String::from_utf8_lossy(&body));
    }
    let models: Value = serde_json::from_slice(&body).with_context(|| format!("--base-url {}: /v1/models is not JSON", a.base_url))?;
    let first = models.pointer("/data/0").cloned().unwrap_or(Value::Null);
    let model = match (&a.model, first.get("id").and_then(Value::as_str)) {
        (Some(m), _) => m.clone(),
        (None, Some(id)) => id.to_string(),
        (None, None) => bail!("--base-url {}: /v1/models lists no model; give --model", a.base_url),
    };
    let vocab = match (a.vocab_size, first.get("vocab_size").and_then(Value::as_u64)) {
        (Some(v), _) => v,
        (None, Some(v)) => v as usize,
        (None, None) => bail!("the server's /v1/models gives no vocab_size: give --vocab-size (prompt ids are drawn below it)"),
    };
    if vocab == 0 {
        bail!("--vocab-size must be ≥ 1");
    }
    if let Some(ctx) = first.get("max_model_len").and_then(Value::as_u64) {
        if (a.input_len + a.output_len) as u64 > ctx {
            bail!("--input-len {} + --output-len {} exceed the server's max_model_len {ctx}", a.input_len, a.output_len);
        }
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let bodies: Vec<Value> = (0..a.num_prompts)
        .map(|_| {
            let ids: Vec<usize> = (0..a.input_len).map(|_| rng.random_range(0..vocab)).collect();
            json!({
                "model": model, "prompt": ids, "max_tokens": a.output_len, "temperature": 0.0, "ignore_eos": true,
                "stream": true, "stream_options": {"include_usage": true},
            })
        })
        .collect();
    let conc = a.max_concurrency.unwrap_or(a.num_prompts).min(a.num_prompts);
    let bar = indicatif::ProgressBar::new(a.num_prompts as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests  {elapsed_precise}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let gate = Arc::new(tokio::sync::Semaphore::new(conc));
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(bodies.len());
    for b in &bodies {
        let req = request(&a, hyper::Method::POST, "/v1/completions", Some(b))?;
        let (client, gate, bar) = (client.clone(), gate.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            let o = one(client, req).await;
            bar.inc(1);
            o
        }));
    }
    let mut outs = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await.unwrap_or_else(|e| Outcome { error: Some(format!("the request's task failed: {e}")), ..Default::default() }));
    }
    let wall = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    report(&a, &model, conc, wall, &outs)
}

fn report(a: &ServeBenchArgs, model: &str, conc: usize, wall: f64, outs: &[Outcome]) -> Result<()> {
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.error.is_none()).collect();
    let failed = outs.len() - ok.len();
    let out_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let tpot: Vec<f64> = ok.iter().filter(|o| o.output_tokens > 1).map(|o| (o.latency - o.ttft) / (o.output_tokens - 1) as f64).collect();
    let j = json!({
        "base_url": a.base_url, "model": model, "num_prompts": a.num_prompts, "max_concurrency": conc,
        "input_len": a.input_len, "output_len": a.output_len, "duration_s": wall,
        "requests_ok": ok.len(), "requests_failed": failed,
        "first_error": outs.iter().find_map(|o| o.error.clone()),
        "request_throughput_per_s": ok.len() as f64 / wall,
        "input_tokens_per_s": (ok.len() * a.input_len) as f64 / wall,
        "output_tokens_per_s": out_tokens as f64 / wall,
        "total_output_tokens": out_tokens,
        "ttft_ms": summary_ms(ok.iter().map(|o| o.ttft).collect()),
        "tpot_ms": summary_ms(tpot),
        "itl_ms": summary_ms(ok.iter().flat_map(|o| o.itl.iter().copied()).collect()),
        "e2e_latency_ms": summary_ms(ok.iter().map(|o| o.latency).collect()),
    });
    if a.json {
        println!("{}", serde_json::to_string(&j)?);
    } else {
        let f = |k: &str, q: &str| j[k][q].as_f64().unwrap_or(0.0);
        println!("server           {}  model {model}", a.base_url);
        println!("workload         {} requests × ({} prompt + {} generated) tokens, at most {conc} at a time", a.num_prompts, a.input_len, a.output_len);
        println!("requests         {} ok, {failed} failed, in {wall:.2} s ({:.2} req/s)", ok.len(), ok.len() as f64 / wall);
        println!("output tokens    {out_tokens} ({:.1} tok/s)", out_tokens as f64 / wall);
        for (name, k) in [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("latency", "e2e_latency_ms")] {
            println!("{name:<16} p50 {:.1} ms  p90 {:.1} ms  p99 {:.1} ms  mean {:.1} ms", f(k, "p50"), f(k, "p90"), f(k, "p99"), f(k, "mean"));
        }
        if let Some(e) = j["first_error"].as_str() {
            println!("first error      {e}");
        }
    }
    if ok.is_empty() {
        bail!("every request failed; the first: {}", outs.first().and_then(|o| o.error.clone()).unwrap_or_default());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_interpolate_like_numpy() {
        let x = [1.0, 2.0, 3.0, 4.0, 10.0];
        assert_eq!(quantile(&x, 0.5), 3.0);
        assert!((quantile(&x, 0.9) - 7.6).abs() < 1e-12); // numpy.percentile(x, 90) = 7.6
        assert!((quantile(&x, 0.99) - 9.76).abs() < 1e-12);
        assert_eq!(quantile(&x, 0.0), 1.0);
        assert_eq!(quantile(&x, 1.0), 10.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
        assert_eq!(quantile(&[5.0], 0.99), 5.0);
    }
}
