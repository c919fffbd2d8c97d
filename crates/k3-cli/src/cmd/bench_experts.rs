//! `k3 bench --op experts [BATCHES...] --model DIR` (issue 23): one MoE layer's routed experts
//! computed by the CPU, as beside a GPU trunk — the host tier (mapped MXFP4 weights, int8
//! activations) and the disk tier (read through the expert cache with O_DIRECT where the file
//! system takes it) — per decode step of B tokens, each beside its floor measured in the same
//! process: the bytes of the distinct experts the step touches ÷ this machine's parallel memory
//! read bandwidth (host tier), resp. ÷ the disk's read bandwidth measured on the checkpoint's
//! own files with the same reader count (disk tier).
//!
//! Routes are drawn uniformly (top-k distinct experts per token, fresh each step): random
//! weights route no better, and uniform routing is the worst case for the cache.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_model::layers::experts::{Kernel, RoutedExperts};
use k3_model::layers::moe::{ExpertSource, Route};
use k3_model::model::Ffn;
use k3_model::offload::{expert_bytes, moe_layers, smallest_budget, CacheOptions, DirectIo, ExpertCache};
use k3_model::{Checkpoint, Model};
use rand::{Rng, SeedableRng};

use super::bench::{median_of, memory_bandwidth, Args, Tier};

/// Steps timed per batch size and tier (the median is reported).
const REPEATS: usize = 7;

pub fn bench_experts(a: &Args) -> Result<()> {
    let batches: Vec<usize> = match a.op.op[1..].iter().map(|d| d.parse::<usize>()).collect::<std::result::Result<Vec<_>, _>>() {
        Ok(v) if v.is_empty() => vec![1, 4, 16],
        Ok(v) if v.iter().all(|&b| b > 0) => v,
        _ => bail!("--op experts [BATCHES...]: positive batch sizes (default 1 4 16)"),
    };
    let dir = a.model.dir()?;
    let ck = Checkpoint::open(&dir)?;
    let t = &ck.config.text;
    let (k, e_all) = (t.num_experts_per_token, t.num_experts);
    let layer = *moe_layers(&ck.config).first().with_context(|| format!("{}: the model has no MoE layer", dir.display()))?;
    if !ck.config.experts_mxfp4() {
        eprintln!("note: {} has dense experts: the int8-activation kernel takes MXFP4 only, so the f32 kernels run", dir.display());
    }
    let readers = 8;
    let (host_on, disk_on) = (a.op.tiers.contains(&Tier::Host), a.op.tiers.contains(&Tier::Disk));
    let (read_bw, _) = memory_bandwidth();
    let (disk_bw, direct) = if disk_on { disk_bandwidth(&ck, readers)? } else { (f64::NAN, false) };
    let host = Model::load_with(&ck, &ExpertSource { cache: None, kernel: Kernel::Q8 })?;
    let h = routed(&host, layer)?;
    let expert_bytes = expert_bytes(&ck, layer, 0)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    // Page the layer's experts in once, so the host tier reads memory, not the disk.
    let all: Vec<Route> = vec![(0..e_all).map(|e| (e, 1.0)).collect()];
    h.forward(&vec![0.5f32; h.latent], 1, &all)?;
    // The disk tier's cache holds one token's experts (its smallest budget): a step's other
    // experts are read, used and evicted, so each step reads nearly all it routes to.
    let budget = smallest_budget(&ck, &[layer], 0..e_all)?;
    let mut rows = Vec::new();
    for &b in &batches {
        // The disk tier's cache and model, only when it is timed.
        let disk_tier = match disk_on {
            true => {
                let opts = CacheOptions { budget_bytes: budget, readers, direct_io: DirectIo::Auto };
                let cache = std::sync::Arc::new(ExpertCache::open(&ck, &[layer], 0..e_all, &opts)?);
                let model = Model::load_with(&ck, &ExpertSource { cache: Some(cache.clone()), kernel: Kernel::Q8 })?;
                Some((cache, model))
            }
            false => None,
        };
        let disk = match &disk_tier {
            Some((cache, model)) => Some((cache, routed(model, layer)?)),
            None => None,
        };
        let (mut th, mut td, mut distinct, mut read) = (Vec::new(), Vec::new(), 0usize, 0u64);
        for _ in 0..REPEATS {
            let routes: Vec<Route> = (0..b).map(|_| pick(&mut rng, e_all, k)).collect();
            let z: Vec<f32> = (0..b * h.latent).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut ids: Vec<usize> = routes.iter().flatten().map(|p| p.0).collect();
            ids.sort_unstable();
            ids.dedup();
            distinct += ids.len();
            if host_on {
                let t0 = Instant::now();
                std::hint::black_box(h.forward(&z, b, &routes)?);
                th.push(t0.elapsed().as_secs_f64());
            }
            if let Some((cache, d)) = &disk {
                let before = cache.stats().bytes_read;
                let t0 = Instant::now();
                d.prefetch(&routes)?;
                std::hint::black_box(d.forward(&z, b, &routes)?);
                td.push(t0.elapsed().as_secs_f64());
                read += cache.stats().bytes_read - before;
            }
        }
        let bytes = distinct as f64 / REPEATS as f64 * expert_bytes as f64;
        // A tier not timed (`--tiers`) reports NaN here, null in the JSON.
        let med = |v: &mut Vec<f64>| if v.is_empty() { f64::NAN } else { median_of(v) };
        let (mh, md) = (med(&mut th), med(&mut td));
        let (fh, fd) = (bytes / read_bw / 1e9, read as f64 / REPEATS as f64 / disk_bw / 1e9);
        let s = disk.as_ref().map(|(cache, _)| cache.stats()).unwrap_or_default();
        rows.push(serde_json::json!({
            "batch": b, "distinct_experts": distinct as f64 / REPEATS as f64, "expert_bytes_per_step": bytes,
            "host_ms": mh * 1e3, "host_floor_ms": fh * 1e3, "host_over_floor": mh / fh,
            "disk_ms": md * 1e3, "disk_floor_ms": fd * 1e3, "disk_over_floor": md / fd, "disk_bytes_read_per_step": read as f64 / REPEATS as f64,
            "disk_hit_rate": s.hit_rate(), "disk_direct_reads": s.direct_reads, "disk_reads": s.reads,
        }));
    }
    let r = serde_json::json!({
        "op": "experts", "model": dir.display().to_string(), "layer": layer, "experts": e_all, "top_k": k, "expert_bytes": expert_bytes,
        "kernel": k3_core::kernels::cpu::mxfp4_q8::kernel_name(), "threads": rayon::current_num_threads(), "readers": readers,
        "memory_read_bandwidth_gb_s": read_bw, "disk_read_bandwidth_gb_s": disk_bw, "disk_o_direct": direct, "repeats": REPEATS, "results": rows,
    });
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    let disk = match disk_on {
        true => format!(", disk read {disk_bw:.2} GB/s ({}, {readers} readers)", if direct { "O_DIRECT" } else { "buffered" }),
        false => String::new(),
    };
    println!(
        "routed experts of layer {layer} on the CPU ({} experts of {:.1} MB, top-{k}; {} kernel, {} threads): memory read {read_bw:.2} GB/s{disk}",
        e_all,
        expert_bytes as f64 / 1e6,
        r["kernel"].as_str().unwrap_or(""),
        rayon::current_num_threads(),
    );
    println!("  batch  experts  host ms (floor, ×)      disk ms (floor, ×)      disk hit rate");
    for x in &rows {
        let f = |key: &str| x[key].as_f64().unwrap_or(f64::NAN);
        let tier = |t: &str| match x[format!("{t}_ms")].as_f64() {
            Some(ms) => format!("{ms:7.2} ({:6.2}, {:4.2}×)", f(&format!("{t}_floor_ms")), f(&format!("{t}_over_floor"))),
            None => format!("{:>23}", "(not timed)"),
        };
        let hit = if disk_on { format!("{:.0}%", 100.0 * f("disk_hit_rate")) } else { "—".into() };
        println!("  {:5}  {:7.1}  {}  {}  {hit}", x["batch"], f("distinct_experts"), tier("host"), tier("disk"));
    }
    Ok(())
}

/// The first MoE layer's routed experts of `m` with index `layer`.
fn routed(m: &Model, layer: usize) -> Result<&RoutedExperts> {
    m.layers
        .iter()
        .find_map(|l| match &l.ffn {
            Ffn::Moe(x) if l.spec.index == layer => Some(&x.routed),
            _ => None,
        })
        .context("no MoE layer")
}

/// `k` distinct experts of `e`, weights summing to 1.
fn pick(rng: &mut impl Rng, e: usize, k: usize) -> Route {
    let mut ids = Vec::with_capacity(k);
    while ids.len() < k.min(e) {
        let x = rng.random_range(0..e);
        if !ids.contains(&x) {
            ids.push(x);
        }
    }
    ids.into_iter().map(|x| (x, 1.0 / k as f32)).collect()
}

/// Read bandwidth of the disk under the checkpoint (bytes/s ÷ 1e9), measured on its own files
/// as the cache reads them: `readers` threads each reading whole 16 MiB runs with one `pread`
/// into a page-aligned buffer (O_DIRECT where the file system takes it; whether it did); the
/// best of three passes over 1 GiB each, spread across the shards.
pub(crate) fn disk_bandwidth(ck: &Checkpoint, readers: usize) -> Result<(f64, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    // 16 MiB runs, or whole pages of the largest shard when it is smaller (tiny test models).
    let largest = ck.files.iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).max().unwrap_or(0);
    let block: u64 = (16u64 << 20).min(largest / 4096 * 4096);
    let direct = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&ck.files[0]).is_ok();
    let mut files = Vec::new();
    let mut blocks = Vec::new();
    for p in &ck.files {
        let mut o = std::fs::OpenOptions::new();
        o.read(true);
        if direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let f = o.open(p).with_context(|| format!("opening {}", p.display()))?;
        let len = f.metadata()?.len();
        if let Some(n) = len.checked_div(block) {
            blocks.extend((0..n).map(|i| (files.len(), i * block)));
        }
        files.push(f);
    }
    if blocks.is_empty() {
        bail!("the checkpoint's files are too small to time the disk");
    }
    let step = (blocks.len() / 192).max(1);
    let all: Vec<_> = blocks.into_iter().step_by(step).collect();
    let mut best = 0f64;
    for pass in 0..3 {
        let picked: Vec<_> = all.iter().skip(pass).step_by(3).take(64).copied().collect();
        best = best.max(read_blocks(&files, &picked, readers, block)?);
    }
    Ok((best, direct))
}

/// GB/s of `readers` threads reading `picked` (file, offset) blocks of `block` bytes.
fn read_blocks(files: &[std::fs::File], picked: &[(usize, u64)], readers: usize, block: u64) -> Result<f64> {
    use std::os::unix::fs::FileExt;
    const BLOCK_ALIGN: usize = 4096;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let hs: Vec<_> = (0..readers)
            .map(|_| {
                s.spawn(|| -> std::io::Result<u64> {
                    let mut words = vec![0u64; (block as usize + BLOCK_ALIGN) / 8];
                    let buf: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
                    let pad = (BLOCK_ALIGN - buf.as_ptr() as usize % BLOCK_ALIGN) % BLOCK_ALIGN;
                    let mut n = 0;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(f, off)) = picked.get(i) else { return Ok(n) };
                        n += files[f].read_at(&mut buf[pad..pad + block as usize], off)? as u64;
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(std::io::Error::other("a disk reader thread panicked")))).sum::<std::io::Result<u64>>()
    })?;
    Ok(total as f64 / t0.elapsed().as_secs_f64() / 1e9)
}
