//! Server metrics, shared between the HTTP handlers and the scheduler thread, and their
//! Prometheus text rendering for `GET /metrics`.
//!
//! Counters and gauges are atomics; the per-(endpoint, status) request counts and the two
//! latency histograms (time to first token, inter-token latency) sit behind small mutexes that
//! are held only for an increment.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds (seconds) of the latency histogram buckets.
const BUCKETS: [f64; 14] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

#[derive(Default)]
struct HistInner {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// A cumulative Prometheus histogram.
#[derive(Default)]
pub struct Histogram(Mutex<HistInner>);

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let v = d.as_secs_f64();
        if let Ok(mut h) = self.0.lock() {
            for (i, b) in BUCKETS.iter().enumerate() {
                if v <= *b {
                    h.counts[i] += 1;
                }
            }
            h.count += 1;
            h.sum += v;
        }
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.0.lock().map(|h| h.count).unwrap_or(0)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        if let Ok(h) = self.0.lock() {
            for (b, c) in BUCKETS.iter().zip(h.counts) {
                let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
            }
            let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", h.count, h.sum, h.count);
        }
    }
}

/// All server metrics.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    /// Requests admitted to the scheduler and not finished yet (running + queued).
    pub live: AtomicUsize,
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub state_bytes: AtomicUsize,
    /// Sequences cancelled because their client went away (or a stop string ended them).
    pub cancelled: AtomicU64,
    /// Batched steps run.
    pub steps: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Speculative decoding's counters (the engine's totals, copied after each step).
    pub spec: Mutex<k3_engine::SpecStats>,
    /// The engine's prefix-cache counters as of its last step (`None`: the cache is off).
    pub prefix: Mutex<Option<k3_engine::PrefixStats>>,
    /// The expert cache (routed experts read from disk), when there is one.
    pub experts: Mutex<Option<k3_model::offload::CacheStats>>,
}

impl Metrics {
    /// Counts one answered request. Unknown paths share one label so cardinality stays bounded.
    pub fn count_request(&self, path: &str, status: u16) {
        let known = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics"];
        let label = if known.contains(&path) { path } else { "other" };
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((label.to_owned(), status)).or_insert(0) += 1;
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self, model: &str) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# HELP k3_requests_total HTTP requests answered, by endpoint and status.\n# TYPE k3_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((path, status), n) in m.iter() {
                let _ = writeln!(o, "k3_requests_total{{endpoint=\"{path}\",status=\"{status}\"}} {n}");
            }
        }
        let mut put = |name: &str, ty: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {ty}\n{name}{{model=\"{model}\"}} {v}");
        };
        put("k3_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens.load(Relaxed));
        put("k3_generation_tokens_total", "counter", "Generated tokens.", self.generation_tokens.load(Relaxed));
        put("k3_queue_depth", "gauge", "Sequences waiting for a batch slot.", self.waiting.load(Relaxed) as u64);
        put("k3_running_sequences", "gauge", "Sequences in the running batch.", self.running.load(Relaxed) as u64);
        put("k3_requests_live", "gauge", "Requests admitted and not finished (running + queued).", self.live.load(Relaxed) as u64);
        put("k3_state_bytes", "gauge", "Bytes held by live sequence states (a cache page several sequences share counted once; the prefix-cache pool's pages counted in its pool-bytes gauge only).", self.state_bytes.load(Relaxed) as u64);
        put("k3_cancelled_total", "counter", "Sequences cancelled (client gone or stop string).", self.cancelled.load(Relaxed));
        put("k3_engine_steps_total", "counter", "Batched engine steps.", self.steps.load(Relaxed));
        if let Some(p) = self.prefix.lock().ok().and_then(|p| p.clone()) {
            put("k3_prefix_cache_lookups_total", "counter", "Requests looked up in the prefix cache at admission.", p.lookups);
            put("k3_prefix_cache_hits_total", "counter", "Requests that resumed from a prefix-cache snapshot.", p.hits);
            put("k3_prefix_cache_hit_tokens_total", "counter", "Prompt tokens restored from the prefix cache instead of prefilled.", p.hit_tokens);
            put(
                "k3_prefix_cache_kv_only_matches_total",
                "counter",
                "Lookups whose prefix matched deeper than any snapshot (a branch point snapshot is taken).",
                p.kv_only_matches,
            );
            put("k3_prefix_cache_snapshots_total", "counter", "KDA snapshots published.", p.snapshots);
            put("k3_prefix_cache_evictions_total", "counter", "Snapshots and cells evicted from the pool.", p.evictions);
            put("k3_prefix_cache_deferred_total", "counter", "Admission steps put off because a running prefill was writing the same prefix.", p.deferred);
            put("k3_prefix_cache_pool_bytes", "gauge", "Bytes of host memory held by the prefix-cache pool (CPU latent cells + KDA snapshots).", p.pool_bytes);
            put("k3_prefix_cache_pool_pages", "gauge", "GPU cache pages held by the prefix-cache pool's cells, each counted once.", p.pool_pages);
            put("k3_prefix_cache_pool_snapshots", "gauge", "KDA snapshots held by the pool.", p.pool_snapshots);
        }
        if let Some(c) = self.experts.lock().ok().and_then(|c| c.clone()) {
            put("k3_expert_cache_requests_total", "counter", "Routed experts asked of the expert cache (experts read from disk).", c.requests);
            put("k3_expert_cache_hits_total", "counter", "Of those, found in memory.", c.hits);
            put("k3_expert_cache_in_flight_total", "counter", "Of those, already being read (by read-ahead or another step).", c.in_flight);
            put("k3_expert_cache_reads_total", "counter", "Experts read from disk.", c.reads);
            put("k3_expert_cache_read_bytes_total", "counter", "Bytes of experts read from disk.", c.bytes_read);
            put("k3_expert_cache_evictions_total", "counter", "Experts evicted from the cache.", c.evictions);
            put("k3_expert_cache_resident_bytes", "gauge", "Bytes of experts held (and being read).", c.resident_bytes);
            put("k3_expert_cache_wait_microseconds_total", "counter", "Time steps waited for experts to arrive.", (c.wait_seconds * 1e6) as u64);
        }
        if let Ok(s) = self.spec.lock() {
            put("k3_spec_decode_steps_total", "counter", "Sequence decode steps under speculative decoding (one per sequence per step).", s.steps);
            put("k3_spec_emitted_tokens_total", "counter", "Tokens those decode steps emitted.", s.emitted);
            put("k3_spec_draft_tokens_total", "counter", "Drafted tokens verified.", s.drafted);
            put("k3_spec_accepted_tokens_total", "counter", "Drafted tokens accepted.", s.accepted);
            let _ = writeln!(
                o,
                "# HELP k3_spec_accepted_per_step Tokens emitted per sequence decode step (1 without speculation).\n# TYPE k3_spec_accepted_per_step gauge\nk3_spec_accepted_per_step{{model=\"{model}\"}} {}",
                s.accepted_per_step()
            );
            let _ = writeln!(
                o,
                "# HELP k3_spec_draft_acceptance Accepted / drafted tokens.\n# TYPE k3_spec_draft_acceptance gauge\nk3_spec_draft_acceptance{{model=\"{model}\"}} {}",
                s.draft_acceptance()
            );
            let _ =
                writeln!(o, "# HELP k3_spec_position_drafted_total Drafts at each draft position (0-based).\n# TYPE k3_spec_position_drafted_total counter");
            for (i, p) in s.per_position.iter().enumerate() {
                let _ = writeln!(o, "k3_spec_position_drafted_total{{model=\"{model}\",position=\"{i}\"}} {}", p[0]);
            }
            let _ =
                writeln!(o, "# HELP k3_spec_position_accepted_total Drafts accepted at each draft position.\n# TYPE k3_spec_position_accepted_total counter");
            for (i, p) in s.per_position.iter().enumerate() {
                let _ = writeln!(o, "k3_spec_position_accepted_total{{model=\"{model}\",position=\"{i}\"}} {}", p[1]);
            }
        }
        self.ttft.render(&mut o, "k3_time_to_first_token_seconds", "Time from admission to the first generated token.");
        self.itl.render(&mut o, "k3_inter_token_latency_seconds", "Time between consecutive tokens of one sequence.");
        o
    }
}
