//! Routed experts off the memory map (issue 23, the CPU side): the disk tier's expert cache and
//! the int8-activation kernel, against the CPU model.
//!
//! - Experts read from disk through the cache (`--experts-on disk`) = the memory-mapped model
//!   bit for bit (same f32 kernels on the same bytes), for F32, BF16 and MXFP4 experts sharded
//!   over several files, with a budget small enough to evict inside a step, and from threads
//!   sharing one cache.
//! - The int8-activation kernel (`Kernel::Q8`, the host tier beside a GPU) ≈ the f32 experts
//!   (per-row relative L2), and equal bit for bit whether tokens come batched or one by one and
//!   whether the weights are mapped or streamed.
//! - Errors name the flag, file or tensor: a budget below one token's experts, a shard cut short
//!   after opening, a scale byte of 255, a missing expert tensor.

use std::path::Path;
use std::sync::Arc;

use k3_model::init::{init, ExpertFormat, FloatDType, InitOptions, Overrides};
use k3_model::layers::experts::Kernel;
use k3_model::layers::moe::ExpertSource;
use k3_model::model::Ffn;
use k3_model::offload::{self, moe_layers, CacheOptions, DirectIo, ExpertCache};
use k3_model::{Checkpoint, ForwardOpts, Model};
use rand::{Rng, SeedableRng};

/// A `k3 init` checkpoint of the tiny config, sharded in ~`shard` bytes; `set` overrides fields.
fn checkpoint(dir: &Path, experts: ExpertFormat, shard: u64, set: &[(&str, serde_json::Value)]) {
    let mut ov = Overrides::default();
    for (k, v) in set {
        ov.set.push((k.to_string(), v.clone()));
    }
    let opts = InitOptions { seed: 23, dtype: FloatDType::F32, experts, shard_size: Some(shard) };
    init(k3_model::config::builtin_config("tiny").unwrap(), &ov, dir, &opts).unwrap();
}

fn streamed(ck: &Checkpoint, budget: u64, direct: DirectIo, kernel: Kernel) -> (Model, Arc<ExpertCache>) {
    let opts = CacheOptions { budget_bytes: budget, readers: 3, direct_io: direct };
    let cache = Arc::new(ExpertCache::open(ck, &moe_layers(&ck.config), 0..ck.config.text.num_experts, &opts).unwrap());
    let m = Model::load_with(ck, &ExpertSource { cache: Some(cache.clone()), kernel }).unwrap();
    (m, cache)
}

/// The smallest budget the cache takes: one token's experts (top-k of the largest).
fn smallest_budget(ck: &Checkpoint) -> u64 {
    offload::smallest_budget(ck, &moe_layers(&ck.config), 0..ck.config.text.num_experts).unwrap()
}

/// A prefill chunk, a second chunk, then decode steps: every logit row.
fn run(m: &Model, toks: &[u32]) -> Vec<f32> {
    let opts = ForwardOpts::default();
    let mut st = m.new_state();
    let mut out = m.forward(&toks[..9], &mut st, opts, None).unwrap();
    out.extend(m.forward(&toks[9..20], &mut st, opts, None).unwrap());
    for &t in &toks[20..] {
        out.extend(m.forward(&[t], &mut st, opts, None).unwrap());
    }
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn disk_tier_equals_the_mapped_model_bit_for_bit() {
    let toks: Vec<u32> = (0..28).map(|i| (i * 37 + 5) % 256).collect();
    for (what, fmt) in [("f32", ExpertFormat::Float(FloatDType::F32)), ("bf16", ExpertFormat::Float(FloatDType::BF16)), ("mxfp4", ExpertFormat::Mxfp4)] {
        let dir = tempfile::tempdir().unwrap();
        checkpoint(dir.path(), fmt, 60_000, &[]);
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert!(ck.files.len() > 2, "{what}: the experts should span several shards");
        let want = run(&Model::load(&ck).unwrap(), &toks);
        // A budget of exactly one token's experts: a prefill chunk routes to more, so the cache
        // evicts inside steps and holds pinned experts past its budget while they are used.
        let budget = smallest_budget(&ck);
        for direct in [DirectIo::Auto, DirectIo::Off] {
            let (m, cache) = streamed(&ck, budget, direct, Kernel::Exact);
            let got = run(&m, &toks);
            assert_eq!(bits(&got), bits(&want), "{what} {direct:?}: streamed experts differ from the mapped ones");
            let s = cache.stats();
            // Read-ahead at routing time: a step's fetch finds its experts arrived or on their way.
            assert!(s.reads > 0 && s.evictions > 0 && s.hits + s.in_flight > s.misses, "{what} {direct:?}: {s:?}");
            assert_eq!(s.requests, s.hits + s.in_flight + s.misses, "{s:?}");
            assert_eq!(s.reads, s.direct_reads + s.buffered_reads, "{s:?}");
            assert!(s.resident_bytes <= s.budget_bytes, "{what}: {} bytes held after the steps, budget {}", s.resident_bytes, s.budget_bytes);
            if direct == DirectIo::Off {
                assert_eq!(s.direct_reads, 0);
            }
            eprintln!(
                "{what} {direct:?}: {} reads ({} O_DIRECT), hit rate {:.2}, {} evictions, peak {} of budget {}",
                s.reads,
                s.direct_reads,
                s.hit_rate(),
                s.evictions,
                s.peak_resident_bytes,
                s.budget_bytes
            );
        }
    }
}

#[test]
fn threads_sharing_one_small_cache_get_the_mapped_logits() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), ExpertFormat::Mxfp4, 60_000, &[]);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let mapped = Model::load(&ck).unwrap();
    let (m, cache) = streamed(&ck, smallest_budget(&ck), DirectIo::Auto, Kernel::Exact);
    let seqs: Vec<Vec<u32>> = (0..4).map(|s| (0..24).map(|i| ((i * 29 + s * 71 + 3) % 256) as u32).collect()).collect();
    let want: Vec<Vec<f32>> = seqs.iter().map(|t| run(&mapped, t)).collect();
    let m = Arc::new(m);
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, t) in seqs.iter().enumerate() {
        let (m, t, tx) = (m.clone(), t.clone(), tx.clone());
        std::thread::spawn(move || tx.send((i, run(&m, &t))).unwrap());
    }
    for _ in 0..seqs.len() {
        // A deadlock in the cache fails here instead of hanging the suite.
        let (i, got) = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("a thread did not finish within 120 s: the expert cache deadlocked");
        assert_eq!(bits(&got), bits(&want[i]), "sequence {i}");
    }
    let s = cache.stats();
    assert!(s.resident_bytes <= s.budget_bytes && s.evictions > 0, "{s:?}");
}

#[test]
fn q8_kernel_is_close_to_f32_and_batch_invariant() {
    // Wider experts than tiny's (8 and 6 blocks of 32: whole and partial groups of four).
    let dir = tempfile::tempdir().unwrap();
    let set = [("routed_expert_hidden_size", serde_json::json!(256)), ("moe_intermediate_size", serde_json::json!(192))];
    checkpoint(dir.path(), ExpertFormat::Mxfp4, 1 << 20, &set);
    let ck = Checkpoint::open(dir.path()).unwrap();
    // Layer by layer on the same inputs (through a whole random model, an int8 rounding can flip
    // a later layer's top-k choice, which says nothing about the kernel).
    let exact = Model::load(&ck).unwrap();
    let q8 = Model::load_with(&ck, &ExpertSource { cache: None, kernel: Kernel::Q8 }).unwrap();
    let (q8_streamed, _cache) = streamed(&ck, u64::MAX, DirectIo::Auto, Kernel::Q8);
    let (lat, h) = (256, ck.config.text.hidden_size);
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let t = 12;
    for ((le, lq), ls) in exact.layers.iter().zip(&q8.layers).zip(&q8_streamed.layers) {
        let (Ffn::Moe(me), Ffn::Moe(mq), Ffn::Moe(ms)) = (&le.ffn, &lq.ffn, &ls.ffn) else { continue };
        let x: Vec<f32> = (0..t * h).map(|_| rng.random_range(-1.0..1.0)).collect();
        let z: Vec<f32> = (0..t * lat).map(|_| rng.random_range(-2.0..2.0)).collect();
        let routes = me.route(&x, t).unwrap();
        let want = me.routed.forward(&z, t, &routes).unwrap();
        let got = mq.routed.forward(&z, t, &routes).unwrap();
        for tok in 0..t {
            let (w, g) = (&want[tok * lat..(tok + 1) * lat], &got[tok * lat..(tok + 1) * lat]);
            let (num, den) = w.iter().zip(g).fold((0f64, 0f64), |(n, d), (a, b)| (n + ((a - b) as f64).powi(2), d + (*a as f64).powi(2)));
            // Two int8 roundings (z, then the SiTU-GLU output) of ~0.4% each.
            assert!((num / den).sqrt() < 2e-2, "layer {}, token {tok}: rel L2 {}", me.routed.layer, (num / den).sqrt());
        }
        assert_eq!(bits(&ms.routed.forward(&z, t, &routes).unwrap()), bits(&got), "streamed Q8 differs from mapped Q8");
        for tok in 0..t {
            let one = mq.routed.forward(&z[tok * lat..(tok + 1) * lat], 1, &routes[tok..tok + 1]).unwrap();
            assert_eq!(bits(&one), bits(&got[tok * lat..(tok + 1) * lat]), "token {tok}: alone differs from batched");
        }
    }
}

#[test]
fn cache_errors_name_the_flag_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), ExpertFormat::Mxfp4, 60_000, &[]);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let layers = moe_layers(&ck.config);
    let e = ExpertCache::open(&ck, &layers, 0..8, &CacheOptions { budget_bytes: 100, ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("--expert-cache-mem") && e.contains("2 experts"), "{e}");

    // A scale byte of 255 in one expert, written after the checkpoint was opened.
    let name = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_scale";
    let ent = ck.entry(name).unwrap().clone();
    let cache = ExpertCache::open(&ck, &layers, 0..8, &CacheOptions::default()).unwrap();
    let path = &ck.files[ent.shard];
    let mut bytes = std::fs::read(path).unwrap();
    bytes[ent.start] = 255;
    std::fs::write(path, &bytes).unwrap();
    let e = cache.fetch(2, &[5]).unwrap().next_ready().err().unwrap().to_string();
    assert!(e.contains(name) && e.contains("255"), "{e}");
    // The other experts still read.
    assert_eq!(cache.fetch(2, &[4]).unwrap().next_ready().unwrap().unwrap().len(), 1);

    // A shard cut short after opening.
    let name = "language_model.model.layers.4.block_sparse_moe.experts.7.w2.weight_packed";
    let ent = ck.entry(name).unwrap().clone();
    let f = std::fs::OpenOptions::new().write(true).open(&ck.files[ent.shard]).unwrap();
    f.set_len(ent.start as u64 + 3).unwrap();
    let e = cache.fetch(4, &[7]).unwrap().next_ready().err().unwrap().to_string();
    assert!(e.contains(&ck.files[ent.shard].display().to_string()) && e.contains("truncated"), "{e}");
    drop(cache);

    // A layer that declares an expert the files lack.
    let e = ExpertCache::open(&ck, &layers, 0..9, &CacheOptions::default()).err().unwrap().to_string();
    assert!(e.contains("experts.8.w1.weight_packed") && e.contains("missing"), "{e}");
}

#[test]
fn gpu_placement_from_the_flags() {
    use k3_model::capacity::KvDtype;
    use k3_model::offload::{gpu_offload, OffloadOptions};
    use k3_model::placement::Tier;
    let dir = tempfile::tempdir().unwrap();
    checkpoint(dir.path(), ExpertFormat::Mxfp4, 60_000, &[]);
    let ck = Checkpoint::open(dir.path()).unwrap();
    let layers = moe_layers(&ck.config);
    let plan = |o: OffloadOptions| gpu_offload(&ck, &o, KvDtype::Bf16, 0..8);
    // Nothing asked: every expert on the GPU, no cache.
    let p = plan(OffloadOptions::default()).unwrap();
    assert!(p.tiers.is_empty() && p.cache.is_none() && layers.iter().all(|&l| p.tier(l) == Tier::Gpu));
    // Forced tiers: the disk tier's cache covers exactly the MoE layers.
    let p = plan(OffloadOptions { experts_on: Some(Tier::Disk), ..Default::default() }).unwrap();
    assert_eq!(p.cpu_layers(), layers.len());
    assert_eq!(p.cache.as_ref().unwrap().layers(), &layers[..]);
    let p = plan(OffloadOptions { experts_on: Some(Tier::Host), ..Default::default() }).unwrap();
    assert!(p.cache.is_none() && layers.iter().all(|&l| p.tier(l) == Tier::Host));
    // The planner: a budget that holds the tiny trunk and every expert keeps them on the GPU; one
    // below the reserve is refused naming the flags.
    let gib = 1u64 << 30;
    let p = plan(OffloadOptions { gpu_mem: Some(64 * gib), host_mem: Some(gib), ..Default::default() }).unwrap();
    assert!(p.tiers.values().all(|t| *t == Tier::Gpu), "{:?}", p.tiers);
    let e = plan(OffloadOptions { gpu_mem: Some(gib), ..Default::default() }).err().unwrap().to_string();
    assert!(e.contains("--gpu-mem") && e.contains("reserve"), "{e}");
}
