//! `k3 bench --device cuda --model DIR`: the whole model on one GPU (feature `cuda`), measured in
//! one process beside this GPU's own copy bandwidth so every figure reads as a ratio.
//!
//! Prefill: one sequence of `--prompt-len` tokens in one forward (after a warm-up forward that
//! compiles kernels), tokens/s by wall clock of the median of three (includes the last-row
//! logits copy). Decode, for each batch in `--batches`: B sequences prefilled with `--context`
//! tokens (above 16384 filled with random latents instead, `CudaModel::fill_context`), one
//! decode step captured as a CUDA graph, replayed `--repeats` times between CUDA
//! events (median); the same step end to end by wall clock as the server runs it (table upload +
//! replay + greedy sampling on the device + ids back, `decode_step_device` and
//! `k3_core::cuda::sample`), and with the logits downloaded instead (`decode_step`). The HBM floor of a step is the bytes it must move —
//! non-expert weights, the routed experts it touches (exact at batch 1; the expected number of
//! distinct experts for uniform routing above), KDA states read and written, latent and
//! indexer-key caches read — divided by the device-to-device copy bandwidth measured here.
//! `--profile` adds one eager batch-1 decode step and one eager prefill of `--prompt-len` tokens
//! timed sublayer by sublayer (CUDA events at the named intermediates; the `embed` mark includes
//! the step-table upload), the prefill also summed per kind of sublayer.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_core::cuda::bench::time_calls;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;
use k3_model::capacity::KvDtype;
use k3_model::config::Mixer;
use k3_model::cuda::{CacheConfig, CudaModel, CudaSeqState, Input};
use k3_model::Checkpoint;
use rand::{Rng, SeedableRng};

use super::bench::Args;

/// Longer `--context`s are filled with random cached latents (`CudaModel::fill_context`) instead
/// of prefilled: the same decode work, without minutes of quadratic prefill.
const PREFILL_CONTEXT_UP_TO: usize = 16384;

pub(crate) fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Device-to-device copy bandwidth (read + write bytes / s), median of 20 copies of 2 GiB.
pub(crate) fn copy_bandwidth(dev: &CudaDevice) -> Result<f64> {
    let bytes = 2usize << 30;
    let src = CudaTensor::uninit(dev, DType::U8, vec![bytes])?;
    src.fill_bytes(0x5A)?;
    let dst = CudaTensor::uninit(dev, DType::U8, vec![bytes])?;
    let ms = time_calls(dev, 5, 20, || dst.copy_from(&src))?;
    Ok(2.0 * bytes as f64 / (median(&ms) * 1e-3))
}

/// Bytes one decode step of `b` sequences at context `ctx` must move (see the module docs).
fn floor_bytes(m: &CudaModel, b: usize, ctx: usize) -> f64 {
    floor_bytes_rows(m, b, b, ctx)
}

/// [`floor_bytes`] of a step of `rows` tokens over `b` sequences (a verify step: the experts of
/// every row, each sequence's state and cache once).
pub(crate) fn floor_bytes_rows(m: &CudaModel, rows: usize, b: usize, ctx: usize) -> f64 {
    let t = &m.config.text;
    let mut bytes = m.weight_bytes_per_token() as f64;
    let (e, k) = (t.num_experts as f64, t.num_experts_per_token as f64);
    if rows > 1 && t.num_experts > 0 {
        // Extra distinct experts beyond the k counted once in weight_bytes_per_token.
        let distinct = e * (1.0 - (1.0 - k / e).powi(rows as i32));
        let per_expert = 3.0 * (t.moe_intermediate_size * t.routed_expert_hidden_size) as f64 * if m.config.experts_mxfp4() { 0.5 + 1.0 / 32.0 } else { 2.0 };
        let moe_layers = m.config.layers.iter().filter(|l| l.ffn == k3_model::config::Ffn::Moe).count() as f64;
        bytes += (distinct - k).max(0.0) * per_expert * moe_layers;
    }
    let la = &t.linear_attn_config;
    for l in &m.config.layers {
        bytes += b as f64
            * match l.mixer {
                Mixer::Kda => 2.0 * (la.num_heads * la.head_dim * la.head_dim * 4) as f64,
                Mixer::Mla => (ctx * (t.kv_lora_rank + t.qk_rope_head_dim) * 2) as f64,
                Mixer::Dsa => {
                    let d = t.dsa_config.as_ref();
                    let (id, topk) = d.map_or((0, 0), |d| (d.index_head_dim, d.index_topk));
                    (ctx * id * 4 + ctx.min(topk) * (t.kv_lora_rank + t.qk_rope_head_dim) * 2) as f64
                }
            };
    }
    bytes
}

pub fn bench_cuda_model(a: &Args) -> Result<()> {
    let dir = a.model.dir()?;
    let batches: Vec<usize> =
        a.gpu.batches.split(',').map(|s| s.trim().parse::<usize>().with_context(|| format!("--batches: `{s}` is not a batch size"))).collect::<Result<_>>()?;
    if batches.contains(&0) || a.run.prompt_len == 0 || a.gpu.context == 0 {
        bail!("--batches, --prompt-len and --context must be ≥ 1");
    }
    let max_b = batches.iter().copied().max().unwrap_or(1);
    let dev = CudaDevice::new(0)?;
    eprintln!("device: {}", dev.info());
    let t0 = Instant::now();
    let ck = Checkpoint::open(&dir)?;
    let kv = KvDtype::parse(&a.gpu.kv_cache_dtype).with_context(|| format!("--kv-cache-dtype `{}` is not one of bf16, fp8", a.gpu.kv_cache_dtype))?;
    let tokens = (max_b + 2) * (a.gpu.context.max(a.run.prompt_len) + a.timing.repeats + a.timing.warmup + 64);
    let cache = CacheConfig { max_seqs: max_b + 2, max_tokens: tokens, kv_cache_dtype: kv };
    let mut m = CudaModel::load(&ck, &dev, cache)?;
    let load_s = t0.elapsed().as_secs_f64();
    let vocab = m.config.text.vocab_size as u32;
    let layers = m.config.layers.len();
    let copy_bw = copy_bandwidth(&dev)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut prompt = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    // Prefill: a warm-up on one sequence, then the median of three timed ones.
    let p = prompt(a.run.prompt_len);
    let mut times = Vec::new();
    for i in 0..4 {
        let mut s = m.new_sequence()?;
        let t = Instant::now();
        m.forward(&p, &mut s, true)?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
        m.release(s);
    }
    times.sort_by(f64::total_cmp);
    let prefill_s = median(&times);
    println!(
        "model      {}  ({layers} layers, loaded to GPU in {load_s:.1} s; weight bytes per decode token {:.1} MB)",
        dir.display(),
        m.weight_bytes_per_token() as f64 / 1e6
    );
    println!("copy bw    {:.0} GB/s (device-to-device, read + write)", copy_bw / 1e9);
    println!("prefill    T={}: {:.1} ms, {:.0} tokens/s", a.run.prompt_len, prefill_s * 1e3, a.run.prompt_len as f64 / prefill_s);
    let mut out_rows = Vec::new();
    let mut sampler = k3_core::cuda::sample::Sampler::new(&dev);
    for &b in &batches {
        let mut seqs: Vec<CudaSeqState> = (0..b).map(|_| m.new_sequence()).collect::<k3_model::Result<_>>()?;
        if a.gpu.context > PREFILL_CONTEXT_UP_TO {
            for (i, s) in seqs.iter_mut().enumerate() {
                m.fill_context(s, a.gpu.context, i as u64)?;
            }
        } else {
            let ctx_tokens: Vec<Vec<u32>> = (0..b).map(|_| prompt(a.gpu.context)).collect();
            for (s, p) in seqs.iter_mut().zip(&ctx_tokens) {
                m.forward_varlen(Input::Tokens(p), &[p.len()], &mut [s], true)?;
            }
        }
        let g = m.capture_decode(b, a.gpu.context + a.timing.warmup + a.timing.repeats + 8)?;
        let toks: Vec<u32> = prompt(b);
        // End to end through decode_step (advances the sequences): logits downloaded.
        let mut wall = Vec::new();
        for i in 0..(a.timing.warmup.min(5) + a.timing.repeats.min(20)) {
            let mut refs: Vec<&mut CudaSeqState> = seqs.iter_mut().collect();
            let t = Instant::now();
            m.decode_step(&g, &toks, &mut refs)?;
            if i >= a.timing.warmup.min(5) {
                wall.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        // End to end as the server steps: replay, greedy sampling on the device, ids back.
        let mut sampled = Vec::new();
        let rows = vec![k3_core::cuda::sample::SampleRow::default(); b];
        for i in 0..(a.timing.warmup.min(5) + a.timing.repeats.min(20)) {
            let mut refs: Vec<&mut CudaSeqState> = seqs.iter_mut().collect();
            let t = Instant::now();
            let logits = m.decode_step_device(&g, &toks, &mut refs)?.context("no logits on this device")?;
            sampler.sample(&logits, &rows, &[], &[])?;
            if i >= a.timing.warmup.min(5) {
                sampled.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        sampled.sort_by(f64::total_cmp);
        wall.sort_by(f64::total_cmp);
        // Replays of the captured step alone, between CUDA events.
        let ms = time_calls(&dev, a.timing.warmup, a.timing.repeats, || g.replay())?;
        let step = median(&ms);
        let floor = floor_bytes(&m, b, a.gpu.context) / copy_bw * 1e3;
        println!(
            "decode     B={b:>3} ctx={}: graph {step:.3} ms/step = {:.3} ms/layer; floor {floor:.3} ms/step ({:.2}x); end to end {:.3} ms/step sampled on the GPU ({:.2}x the graph), {:.3} ms/step with the logits downloaded; {:.0} tokens/s",
            a.gpu.context,
            step / layers as f64,
            step / floor,
            median(&sampled),
            median(&sampled) / step,
            median(&wall),
            b as f64 / (step * 1e-3)
        );
        out_rows.push(serde_json::json!({"batch": b, "context": a.gpu.context, "graph_ms_per_step": step, "ms_per_layer": step / layers as f64, "floor_ms_per_step": floor, "ratio_to_floor": step / floor, "end_to_end_ms_per_step": median(&sampled), "end_to_end_host_logits_ms_per_step": median(&wall)}));
        drop(g);
        for s in seqs {
            m.release(s);
        }
    }
    if a.gpu.profile {
        profile_decode(&mut m, &dev, a.gpu.context)?;
        profile_prefill(&mut m, &dev, a.run.prompt_len)?;
    }
    if a.json {
        let r = serde_json::json!({"model": dir.display().to_string(), "layers": layers, "copy_gb_s": copy_bw / 1e9, "prefill_tokens": a.run.prompt_len, "prefill_tokens_per_s": a.run.prompt_len as f64 / prefill_s, "decode": out_rows});
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}

/// One eager decode step of one sequence at `ctx` tokens with a CUDA event at every named
/// intermediate (`forward_traced`): the GPU time of each AttnRes+norm, mixer and FFN, and of the
/// output norm + lm_head. Eager launches may add gaps a graph would not have; the sum is printed
/// beside the graph figure above.
fn profile_decode(m: &mut CudaModel, dev: &CudaDevice, ctx: usize) -> Result<()> {
    let vocab = m.config.text.vocab_size as u32;
    let p: Vec<u32> = (0..ctx as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut s = m.new_sequence()?;
    m.forward(&p, &mut s, true)?;
    m.forward(&[1], &mut s, true)?; // warm-up of the one-row shapes
    let marks = traced(m, dev, &[2], &[1], &mut [&mut s]);
    m.release(s);
    print_profile(&format!("one eager decode step, batch 1, ctx {ctx}"), &marks?)
}

/// The prefill of `t` tokens into an empty sequence, timed the same way as [`profile_decode`]
/// (the prefill figure above is this forward by wall clock), with the per-kind totals.
fn profile_prefill(m: &mut CudaModel, dev: &CudaDevice, t: usize) -> Result<()> {
    let vocab = m.config.text.vocab_size as u32;
    let p: Vec<u32> = (0..t as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut s = m.new_sequence()?;
    m.forward(&p, &mut s, true)?; // warm-up of the T-row shapes
    m.release(s);
    let mut s = m.new_sequence()?;
    let marks = traced(m, dev, &p, &[p.len()], &mut [&mut s]);
    m.release(s);
    let marks = marks?;
    print_profile(&format!("one eager prefill of T={t} tokens"), &marks)?;
    // Per kind (the mark's name after `blk.N.`): where the prefill goes.
    let mut kinds: Vec<(String, f64)> = Vec::new();
    for (name, ms) in &marks {
        let kind = name.splitn(3, '.').nth(2).unwrap_or(name).to_string();
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, v)) => *v += ms,
            None => kinds.push((kind, *ms)),
        }
    }
    let total: f64 = marks.iter().map(|(_, v)| v).sum();
    println!("profile    prefill T={t} by kind:");
    for (k, v) in &kinds {
        println!("  {k:<20} {v:8.3} ms  {:5.1}%", 100.0 * v / total);
    }
    Ok(())
}

/// One eager forward of `tokens` (`lens[i]` of them on `seqs[i]`) with a CUDA event at every
/// named intermediate; the ms from each mark to the next (the last one: the output norm to the
/// end, named `lm_head`).
pub(crate) fn traced(m: &mut CudaModel, dev: &CudaDevice, tokens: &[u32], lens: &[usize], seqs: &mut [&mut CudaSeqState]) -> Result<Vec<(String, f64)>> {
    use k3_core::cuda::Event;
    let start = dev.new_event(true)?;
    let mut marks: Vec<(String, Event)> = Vec::new();
    start.record(&dev.stream())?;
    let mut rec = |name: &str, _t: &CudaTensor| -> k3_model::Result<()> {
        let e = dev.new_event(true)?;
        e.record(&dev.stream())?;
        marks.push((name.to_string(), e));
        Ok(())
    };
    m.forward_traced(Input::Tokens(tokens), lens, seqs, true, Some(&mut rec))?;
    let end = dev.new_event(true)?;
    end.record(&dev.stream())?;
    end.synchronize()?;
    let mut out = Vec::with_capacity(marks.len() + 1);
    let mut prev = &start;
    for (name, e) in &marks {
        out.push((name.clone(), prev.elapsed_ms(e)? as f64));
        prev = e;
    }
    out.push(("lm_head".to_string(), prev.elapsed_ms(&end)? as f64));
    Ok(out)
}

fn print_profile(what: &str, marks: &[(String, f64)]) -> Result<()> {
    println!("profile    {what} (ms from the previous mark):");
    for (name, ms) in marks {
        println!("  {name:<20} {ms:8.4}");
    }
    println!("  {:<20} {:8.4}", "total", marks.iter().map(|(_, v)| v).sum::<f64>());
    Ok(())
}

/// `k3 bench --device cuda --op dsa [CONTEXTS...] --model DIR` (a model with DSA layers): the
/// decode step (batch 1, CUDA graph) at each context — default 16384 131072 524288 — over a
/// filled cache (`CudaModel::fill_context`), beside the DSA indexer alone (scores over every
/// cached key + top-k, the kernels of one DSA layer on the same shapes) times the number of DSA
/// layers: the step should grow only by what the indexer grows.
pub fn bench_cuda_dsa(a: &Args) -> Result<()> {
    use k3_core::cuda::dsa::{index_scores, topk};
    use k3_core::cuda::mla::{PagedBatch, PAGE};
    let dir = a.model.dir()?;
    let ctxs: Vec<usize> = if a.op.op.len() > 1 {
        a.op.op[1..].iter().map(|s| s.parse::<usize>().with_context(|| format!("--op dsa: `{s}` is not a context length"))).collect::<Result<_>>()?
    } else {
        vec![16384, 131072, 524288]
    };
    let dev = CudaDevice::new(0)?;
    let ck = Checkpoint::open(&dir)?;
    let Some(dsa) = ck.config.text.dsa_config.clone() else { bail!("{}: no dsa_config (give a K3.1-style model)", dir.display()) };
    let n_dsa = ck.config.layers.iter().filter(|l| l.mixer == Mixer::Dsa).count();
    let max_ctx = ctxs.iter().copied().max().unwrap_or(1);
    let kv = KvDtype::parse(&a.gpu.kv_cache_dtype).with_context(|| format!("--kv-cache-dtype `{}` is not one of bf16, fp8", a.gpu.kv_cache_dtype))?;
    let mut m = CudaModel::load(&ck, &dev, CacheConfig { max_seqs: 1, max_tokens: max_ctx + a.timing.warmup + a.timing.repeats + 64, kv_cache_dtype: kv })?;
    let (ih, id, k) = (dsa.index_num_heads, dsa.index_head_dim, dsa.index_topk);
    println!("model {} ({} layers, {n_dsa} DSA; indexer {ih}×{id}, top-{k})", dir.display(), m.config.layers.len());
    let mut first: Option<(f64, f64)> = None;
    for &c in &ctxs {
        let mut s = m.new_sequence()?;
        m.fill_context(&mut s, c, 3)?;
        let g = m.capture_decode(1, c + a.timing.warmup + a.timing.repeats + 16)?;
        // One real step writes this sequence's tables into the graph's buffers; the replays
        // then repeat that step (same position, same work).
        m.decode_step(&g, &[1], &mut [&mut s])?;
        let step = median(&time_calls(&dev, a.timing.warmup, a.timing.repeats, || g.replay())?);
        drop(g);
        m.release(s);
        // The indexer of one DSA layer alone, same shapes: one query over c keys.
        let pages = c.div_ceil(PAGE);
        let q = k3_core::cuda::bench::random_tensor(&dev, DType::F32, vec![1, ih, id], 1)?;
        let w = k3_core::cuda::bench::random_tensor(&dev, DType::F32, vec![1, ih], 2)?;
        let keys = k3_core::cuda::bench::random_tensor(&dev, DType::F32, vec![pages, PAGE, id], 3)?;
        let table = CudaTensor::from_pod(&dev, DType::I32, vec![1, pages], &(0..pages as i32).collect::<Vec<_>>())?;
        let zero = CudaTensor::from_pod(&dev, DType::I32, vec![1], &[0i32])?;
        let pos = CudaTensor::from_pod(&dev, DType::I32, vec![1], &[c as i32 - 1])?;
        let batch = PagedBatch { block_table: &table, row_seq: &zero, row_pos: &pos };
        let scores = CudaTensor::uninit(&dev, DType::F32, vec![1, c])?;
        let idx = CudaTensor::uninit(&dev, DType::I32, vec![1, k])?;
        let cnt = CudaTensor::uninit(&dev, DType::I32, vec![1])?;
        let ix = median(&time_calls(&dev, a.timing.warmup, a.timing.repeats, || {
            index_scores(&q, &w, &keys, &batch, &scores)?;
            topk(&scores, &batch, k, &idx, &cnt)
        })?);
        let (s0, i0) = *first.get_or_insert((step, ix));
        println!(
            "context {c:>8}: decode step {step:.3} ms (+{:.3} vs first); indexer {ix:.3} ms per DSA layer × {n_dsa} = {:.3} ms (+{:.3} vs first)",
            step - s0,
            ix * n_dsa as f64,
            (ix - i0) * n_dsa as f64
        );
    }
    Ok(())
}
