//! `k3 inspect <model-dir | config.json | name> [--json]` — the facts of a model
//! (text-backbone §1–§2, around-backbone §1.4–§2.4; see `k3_model::inspect` for the
//! conventions): layer schedule, weight shapes per layer kind, parameters (total and active per
//! token), bytes on disk as shipped, cache sizes. Given a model directory it also opens the
//! checkpoint (memory-mapped) and reports file size, bytes by dtype and resident memory.
//!
//! `--tp/--ep/--pp` and `--gpu-mem GiB` add the planner (`k3_model::capacity`): weight bytes per
//! rank, what is left for latent/indexer caches and KDA states (tokens, sequences at 128K and
//! 1M context), and `fits: true|false` with the reason. `--host-mem GiB` (or `--experts-on
//! gpu|cpu|disk`) plans one GPU host instead (`k3_model::placement`): the trunk on the GPU, each
//! MoE layer's routed experts on the GPU, in host memory or on disk, the bytes a decode token
//! reads from each, and with `--gpu-bw/--host-bw/--disk-bw GB/s` the floor of a token.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use k3_model::capacity::{capacity, Capacity, KvDtype, GIB};
use k3_model::config::{builtin_config, Config, Ffn, Mixer};
use k3_model::inspect::{peak_resident_bytes, report, report_with_checkpoint, resident_bytes, resident_split, Report};
use k3_model::placement::{place, Budget, Placement, Tier};
use k3_model::{Checkpoint, Model};

use super::args::ParallelArgs;

/// One H200's memory as the planner counts it when `--gpu-mem` is not given (GiB).
pub const H200_GIB: f64 = 139.0;

#[derive(clap::Args)]
pub struct Args {
    /// A model directory, a config.json, or a built-in config name (k3, k3_1_pro, tiny, tiny_dsa).
    pub model: PathBuf,
    /// Print JSON (stable field names) instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Also build the model (`Model::load`) and report open/load time and peak RSS.
    #[arg(long)]
    pub load: bool,
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// Memory of each GPU in GiB, for the planner (default 139, one H200). Giving it, or any
    /// of --tp/--ep/--pp above 1, adds the per-rank memory plan (with --host-mem: the
    /// one-GPU-host plan instead).
    #[arg(long, value_name = "GIB")]
    pub gpu_mem: Option<f64>,
    /// GiB per GPU kept for the CUDA context, GEMM workspaces and a prefill chunk's activations.
    #[arg(long, value_name = "GIB", default_value_t = 6.0)]
    pub reserve: f64,
    /// Cache layout the planner counts: bf16 (2 B per value) or fp8 (vLLM's 656 B MLA + 132 B indexer).
    #[arg(long, default_value = "bf16")]
    pub kv_cache_dtype: String,
    /// Host memory in GiB for routed experts: plans one GPU host (trunk on the GPU, experts on
    /// the GPU, in host memory or on disk) instead of a parallel layout.
    #[arg(long, value_name = "GIB")]
    pub host_mem: Option<f64>,
    /// With the one-host plan: every MoE layer's routed experts on this tier (default: the GPU
    /// while they fit, then host memory, then disk).
    #[arg(long, value_name = "gpu|cpu|disk")]
    pub experts_on: Option<String>,
    /// Bandwidths (GB/s) of the GPU's memory, host memory and the disk, for the one-host plan's
    /// per-token floor.
    #[arg(long, value_name = "GB/S")]
    pub gpu_bw: Option<f64>,
    #[arg(long, value_name = "GB/S")]
    pub host_bw: Option<f64>,
    #[arg(long, value_name = "GB/S")]
    pub disk_bw: Option<f64>,
}

/// The one-GPU-host plan, when `--host-mem` or `--experts-on` asks for it.
fn host_plan(a: &Args, cfg: &Config) -> Result<Option<Placement>> {
    if a.host_mem.is_none() && a.experts_on.is_none() {
        for (flag, v) in [("--gpu-bw", a.gpu_bw), ("--host-bw", a.host_bw), ("--disk-bw", a.disk_bw)] {
            if v.is_some() {
                anyhow::bail!("{flag} is for the one-GPU-host plan: give --host-mem GiB (or --experts-on) with it");
            }
        }
        return Ok(None);
    }
    if a.parallel.layout()?.world() > 1 {
        anyhow::bail!("--host-mem / --experts-on plan one GPU host: drop --tp/--ep/--pp (or drop --host-mem for the parallel plan)");
    }
    let experts_on = match a.experts_on.as_deref() {
        None => None,
        Some(s) => Some(Tier::parse(s).ok_or_else(|| anyhow::anyhow!("--experts-on `{s}` is not one of gpu, cpu, disk"))?),
    };
    let gpu = a.gpu_mem.unwrap_or(H200_GIB);
    let host = a.host_mem.unwrap_or(0.0);
    for (flag, v, zero_ok) in [("--gpu-mem", gpu, false), ("--host-mem", host, true), ("--reserve", a.reserve, true)] {
        if !v.is_finite() || v < 0.0 || (!zero_ok && v == 0.0) {
            anyhow::bail!("{flag} {v}: give a positive number of GiB");
        }
    }
    let bw = |flag: &str, v: Option<f64>| -> Result<Option<f64>> {
        match v {
            Some(x) if !x.is_finite() || x <= 0.0 => anyhow::bail!("{flag} {x}: give a positive number of GB/s"),
            v => Ok(v.map(|x| x * 1e9)),
        }
    };
    let kv = KvDtype::parse(&a.kv_cache_dtype).ok_or_else(|| anyhow::anyhow!("--kv-cache-dtype `{}` is not one of bf16, fp8", a.kv_cache_dtype))?;
    let b = Budget {
        gpu_mem: (gpu * GIB) as u64,
        host_mem: (host * GIB) as u64,
        reserve: (a.reserve * GIB) as u64,
        kv,
        experts_on,
        bandwidth: [bw("--gpu-bw", a.gpu_bw)?, bw("--host-bw", a.host_bw)?, bw("--disk-bw", a.disk_bw)?],
    };
    Ok(Some(place(cfg, &b)?))
}

fn plan(a: &Args, cfg: &Config) -> Result<Option<Capacity>> {
    let par = a.parallel.layout()?;
    if par.world() == 1 && (a.gpu_mem.is_none() || a.host_mem.is_some() || a.experts_on.is_some()) {
        return Ok(None);
    }
    let mem = a.gpu_mem.unwrap_or(H200_GIB);
    for (flag, v) in [("--gpu-mem", mem), ("--reserve", a.reserve)] {
        if !v.is_finite() || v < 0.0 || (flag == "--gpu-mem" && v == 0.0) {
            anyhow::bail!("{flag} {v}: give a positive number of GiB");
        }
    }
    let kv = KvDtype::parse(&a.kv_cache_dtype).ok_or_else(|| anyhow::anyhow!("--kv-cache-dtype `{}` is not one of bf16, fp8", a.kv_cache_dtype))?;
    Ok(Some(capacity(cfg, par, (mem * GIB) as u64, (a.reserve * GIB) as u64, kv)?))
}

pub fn run(a: Args) -> Result<()> {
    let (r, cfg) = if a.model.is_dir() {
        let t0 = std::time::Instant::now();
        let ck = Checkpoint::open(&a.model).with_context(|| format!("opening {}", a.model.display()))?;
        let open_s = t0.elapsed().as_secs_f64();
        let mut r = report_with_checkpoint(&ck);
        if a.load {
            let t1 = std::time::Instant::now();
            let model = Model::load(&ck)?;
            let load_s = t1.elapsed().as_secs_f64();
            if let Some(c) = r.checkpoint.as_mut() {
                c.open_seconds = Some(open_s);
                c.load_seconds = Some(load_s);
                c.resident_bytes = resident_bytes();
                c.peak_resident_bytes = peak_resident_bytes();
                (c.resident_anon_bytes, c.resident_file_bytes) = resident_split();
            }
            drop(model);
        }
        (r, ck.config.clone())
    } else {
        let cfg = if a.model.is_file() { Config::from_file(&a.model)? } else { Config::from_json(builtin_config(&a.model.to_string_lossy())?)? };
        (report(&cfg), cfg)
    };
    let cap = plan(&a, &cfg)?;
    let host = host_plan(&a, &cfg)?;
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        if let Some(o) = v.as_object_mut() {
            if let Some(c) = &cap {
                o.insert("capacity".into(), serde_json::to_value(c)?);
            }
            if let Some(p) = &host {
                o.insert("placement".into(), serde_json::to_value(p)?);
            }
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", text(&r));
        if let Some(c) = &cap {
            print!("{}", capacity_text(c));
        }
        if let Some(p) = &host {
            print!("{}", placement_text(p));
        }
    }
    Ok(())
}

/// `1234567` → `1,234,567`.
pub fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn human(n: u64) -> String {
    let f = n as f64;
    if f >= 1e12 {
        format!("{:.3}T", f / 1e12)
    } else if f >= 1e9 {
        format!("{:.2}B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.2}M", f / 1e6)
    } else {
        commas(n)
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn letter(m: Mixer, f: Ffn) -> char {
    let c = match m {
        Mixer::Kda => 'K',
        Mixer::Mla => 'M',
        Mixer::Dsa => 'S',
    };
    if f == Ffn::Dense {
        c.to_ascii_lowercase()
    } else {
        c
    }
}

/// The human-readable table.
pub fn text(r: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "layers        {} = {} KDA + {} MLA + {} DSA; FFN {} dense + {} MoE; experts {}",
        r.num_hidden_layers,
        r.kda_layers,
        r.mla_layers,
        r.dsa_layers,
        r.dense_ffn_layers,
        r.moe_layers,
        if r.experts_mxfp4 { "MXFP4" } else { "float" }
    );
    for (l, ffn) in &r.mtp_layers {
        let ffn = if *ffn == k3_model::config::Ffn::Moe { "MoE" } else { "dense FFN" };
        let _ = writeln!(s, "MTP           layer {l}: draft layer (MLA + {ffn}, plain residual; --speculative mtp)");
    }
    let _ = writeln!(s, "AttnRes       block size {}, blocks start at {:?}", r.attn_res_block_size, r.attn_res_block_starts);
    let _ = writeln!(s, "schedule      (K=KDA M=MLA S=DSA; lowercase = dense FFN, uppercase = MoE; one line per AttnRes block)");
    for (i, &b) in r.attn_res_block_starts.iter().enumerate() {
        let end = r.attn_res_block_starts.get(i + 1).copied().unwrap_or(r.num_hidden_layers);
        let row: String = r.layers[b..end].chunks(4).map(|c| c.iter().map(|l| letter(l.mixer, l.ffn)).collect::<String>()).collect::<Vec<_>>().join(" ");
        let _ = writeln!(s, "  {b:>4}..{:<4} {row}", end - 1);
    }
    for k in &r.layer_kinds {
        let _ = writeln!(s, "\nweights of layer {} ({:?} + {:?}, {} layers of this kind)", k.example_layer, k.mixer, k.ffn, k.count);
        for w in &k.weights {
            let _ = writeln!(s, "  {:<52} {:<16} {}", w.name, format!("{:?}", w.shape), w.dtype);
        }
    }
    let _ = writeln!(s, "\n{:<16} {:>20} {:>20} {:>20}", "component", "params", "active/token", "bytes as shipped");
    for c in &r.params {
        let _ = writeln!(
            s,
            "{:<16} {:>20} {:>20} {:>20}",
            serde_json::to_value(c.component).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
            commas(c.total),
            commas(c.active),
            commas(c.disk_bytes)
        );
    }
    let _ = writeln!(s, "{:<16} {:>20} {:>20} {:>20}", "total", commas(r.total_params), commas(r.active_params), commas(r.disk_bytes));
    let _ = writeln!(
        s,
        "                 ({} total, {} active per token — embedding lookup and vision excluded from active)",
        human(r.total_params),
        human(r.active_params)
    );
    let _ = writeln!(s, "disk by dtype   {}", r.disk_bytes_by_dtype.iter().map(|(k, v)| format!("{k} {}", commas(*v))).collect::<Vec<_>>().join(", "));
    let _ = writeln!(s, "\ncache (per sequence, max context {} tokens)", commas(r.max_position_embeddings as u64));
    let layers = |n: usize| format!("{n} layer{}", if n == 1 { "" } else { "s" });
    let _ = writeln!(
        s,
        "  MLA latent      {} values = {} B/token/layer bf16 ({})",
        r.mla_latent_values_per_token_per_layer,
        r.mla_bytes_per_token_per_layer_bf16,
        layers(r.mla_layers + r.dsa_layers)
    );
    if r.dsa {
        let _ = writeln!(
            s,
            "  indexer keys    {} values = {} B/token/layer bf16 ({})",
            r.indexer_key_values_per_token_per_layer,
            r.indexer_bytes_per_token_per_layer_bf16,
            layers(r.dsa_layers)
        );
    }
    let fp8 = if r.dsa { "656 B MLA + 132 B indexer per layer" } else { "656 B MLA per layer" };
    let _ = writeln!(s, "  all layers      {} B/token bf16, {} B/token fp8 ({fp8})", r.kv_bytes_per_token_bf16, r.kv_bytes_per_token_fp8);
    let _ = writeln!(
        s,
        "  at max context  {} bf16 ({} B), {} fp8 ({} B)",
        gib(r.kv_bytes_at_max_context_bf16),
        commas(r.kv_bytes_at_max_context_bf16),
        gib(r.kv_bytes_at_max_context_fp8),
        commas(r.kv_bytes_at_max_context_fp8)
    );
    let _ = writeln!(
        s,
        "  KDA state       {:.1} MB recurrent (f32) + {:.1} MB conv (bf16) = {:.1} MB per sequence",
        r.kda_recurrent_state_bytes_per_sequence as f64 / 1e6,
        r.kda_conv_state_bytes_per_sequence as f64 / 1e6,
        r.kda_state_bytes_per_sequence as f64 / 1e6
    );
    if let Some(c) = &r.checkpoint {
        let _ = writeln!(s, "\ncheckpoint {}: {} files, {} tensors", c.dir, c.files, c.tensors);
        let _ = writeln!(s, "  file size       {} B ({})", commas(c.file_bytes), gib(c.file_bytes));
        let _ = writeln!(
            s,
            "  resident (RSS)  {}",
            c.resident_bytes.map(|b| format!("{} B ({}) — weights are mapped, not copied", commas(b), gib(b))).unwrap_or_else(|| "unknown".into())
        );
        if let (Some(o), Some(l), Some(p)) = (c.open_seconds, c.load_seconds, c.peak_resident_bytes) {
            let _ = writeln!(s, "  load            open {o:.3} s, Model::load {l:.3} s, peak RSS {} B ({})", commas(p), gib(p));
            if let (Some(an), Some(fi)) = (c.resident_anon_bytes, c.resident_file_bytes) {
                let _ =
                    writeln!(s, "  after load      RSS anonymous {} B (heap), file-backed {} B (touched pages of the mapped weights)", commas(an), commas(fi));
            }
        }
        let _ = writeln!(s, "  data by dtype   {}", c.bytes_by_dtype.iter().map(|(k, v)| format!("{k} {}", commas(*v))).collect::<Vec<_>>().join(", "));
        let _ =
            writeln!(s, "  check           {}", c.check_error.as_deref().unwrap_or("ok: every tensor of the config is present with the right shape and dtype"));
    }
    s
}

/// The planner's table: one row per rank, then the verdict.
pub fn capacity_text(c: &Capacity) -> String {
    let g = |b: f64| format!("{:.1}", b / GIB);
    let p = &c.layout;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nparallel layout --tp {} --ep {} --pp {}: {} ranks; {} GiB per GPU, {} GiB reserve, {:?} cache",
        p.tp,
        p.ep,
        p.pp,
        c.world,
        g(c.gpu_mem_bytes as f64),
        g(c.reserve_bytes as f64),
        c.kv_cache_dtype
    );
    let _ = writeln!(
        s,
        "  {:>4} {:>5} {:>9} {:>11} {:>9} {:>11} {:>10} {:>13} {:>9} {:>8}",
        "rank", "stage", "layers", "weights GiB", "left GiB", "cache B/tok", "KDA MB/seq", "cache tokens", "seqs 128K", "seqs 1M"
    );
    for r in &c.ranks {
        let _ = writeln!(
            s,
            "  {:>4} {:>5} {:>9} {:>11} {:>9} {:>11} {:>10.1} {:>13} {:>9} {:>8}",
            r.rank,
            r.stage,
            format!("{}..{}", r.layers[0], r.layers[1]),
            g(r.weight_bytes as f64),
            g(r.free_bytes as f64),
            r.cache_bytes_per_token,
            r.kda_state_bytes_per_sequence as f64 / 1e6,
            commas(r.cache_tokens),
            r.sequences_128k,
            r.sequences_1m
        );
    }
    let _ = writeln!(s, "fits: {} — {}", c.fits, c.reason);
    s
}

/// The one-GPU-host plan as text: each tier's bytes and per-token reads, the MoE layers per
/// tier (runs of consecutive layers), the floor when bandwidths were given, and the verdict.
pub fn placement_text(p: &Placement) -> String {
    let g = |b: u64| format!("{:.1}", b as f64 / GIB);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\none GPU host: {} GiB GPU ({} GiB reserve), {} GiB host memory, {:?} cache{}",
        g(p.gpu_mem_bytes),
        g(p.reserve_bytes),
        g(p.host_mem_bytes),
        p.kv_cache_dtype,
        p.experts_on.map_or(String::new(), |t| format!(", --experts-on {}", t.name()))
    );
    let _ = writeln!(
        s,
        "  trunk (all but the routed experts) {} GiB and one 128K-token sequence {} GiB on the GPU; a token reads {:.2} GB of the trunk",
        g(p.trunk_bytes),
        g(p.sequence_bytes),
        p.trunk_bytes_per_token as f64 / 1e9
    );
    let _ = writeln!(s, "  {:<5} {:>12} {:>11} {:>13} {:>10}  MoE layers", "tier", "resident GiB", "budget GiB", "GB per token", "floor ms");
    for t in &p.tiers {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for l in p.layers.iter().filter(|l| l.tier == t.tier) {
            match runs.last_mut() {
                Some(r) if r.1 + 1 == l.layer => r.1 = l.layer,
                _ => runs.push((l.layer, l.layer)),
            }
        }
        let runs: Vec<String> = runs.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
        let _ = writeln!(
            s,
            "  {:<5} {:>12} {:>11} {:>13.2} {:>10}  {}",
            t.tier.name(),
            g(t.resident_bytes),
            t.budget_bytes.map_or("-".to_string(), g),
            t.bytes_per_token as f64 / 1e9,
            t.floor_ms.map_or("-".to_string(), |f| format!("{f:.2}")),
            if runs.is_empty() { "none".to_string() } else { runs.join(", ") }
        );
    }
    if let (Some(a), Some(b)) = (p.floor_ms_serial, p.floor_ms_overlapped) {
        let _ =
            writeln!(s, "  floor per decode token: {a:.2} ms with the tiers in turn ({:.2} tok/s), {b:.2} ms fully overlapped ({:.2} tok/s)", 1e3 / a, 1e3 / b);
    }
    let _ = writeln!(s, "fits: {} — {}", p.fits, p.reason);
    s
}
