//! `k3 bench --speculative ngram,suffix[,mtp][,draft --draft-model DIR] [--num-speculative-tokens K] [--gen-len G] [--model DIR]`:
//! speculative decoding against plain decoding in one process (issue 22), greedy, on two
//! workloads that repeat text:
//!
//! - `quote`: a passage given twice, then its first words again, so the model goes on quoting;
//! - `chat`: three turns of a plain-text chat (`User:` / `Assistant:`), each turn's prompt holding
//!   the earlier turns and asking for the last answer again, through one engine (so the suffix
//!   proposer also sees the finished turns).
//!
//! Each method runs every workload in rounds (off, then each method, twice over, so drift hits
//! all). Reported per workload and method: decode tokens/s (tokens after the first ÷ wall time
//! after the first token, drafting and rollback included), tokens per decode step, draft
//! acceptance, acceptance at each draft position, and whether the tokens equal plain greedy
//! decoding's (they must on the CPU; on the GPU, whose rows are not bit-reproducible, they may
//! part at a near-tie). With `--device cuda` the engines run on the GPU runner (CUDA graphs),
//! each method twice: verify steps replayed from CUDA graphs (the default; how many were
//! replayed and how many ran eagerly is printed) and eagerly (`METHOD/eager`, the A/B in one
//! process); the step costs are `bench_spec_cuda.rs`'s, at `--batches`.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use k3_engine::gpu::VerifyStats;
use k3_engine::spec::draft::DraftSpec;
use k3_engine::{Engine, EngineConfig, Request, SamplingParams, SpecConfig, SpecStats};
use k3_model::{Checkpoint, Model};
use k3_tokenizer::Tokenizer;

use super::bench::Args;

/// A public-domain passage (Romeo and Juliet, II.2) — k3-nano was trained on Shakespeare.
const PASSAGE: &str = "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. Arise, fair sun, and kill the envious moon, Who is already sick and pale with grief, That thou her maid art far more fair than she.";

/// One workload's requests: (prompt text, continues the previous turn).
fn workload(name: &str) -> Vec<String> {
    match name {
        "quote" => vec![format!("{PASSAGE}\n\n{PASSAGE}\n\nROMEO. But soft, what light")],
        _ => vec![format!("User: Recite Romeo's lines.\nAssistant: {PASSAGE}\nUser: Again, word for word.\nAssistant:")],
    }
}

/// One workload through `e`: generated ids per turn, decode seconds, decode tokens, and stats.
fn run_workload(e: &mut Engine, tok: &Tokenizer, name: &str, gen: usize) -> Result<(Vec<Vec<u32>>, f64, usize, SpecStats)> {
    let mut prompts = workload(name);
    let turns = if name == "chat" { 3 } else { 1 };
    let (mut outs, mut secs, mut toks, mut st) = (Vec::new(), 0.0, 0usize, SpecStats::default());
    for t in 0..turns {
        let text = prompts[t].clone();
        let req = Request { ignore_eos: true, ..Request::new(tok.encode(&text, false), SamplingParams::greedy(), gen) };
        let t0 = Instant::now();
        let (out, _, s) = e.generate(req, |_| {})?;
        let wall = t0.elapsed().as_secs_f64();
        secs += wall - s.ttft.as_secs_f64();
        toks += out.len().saturating_sub(1);
        st.add(&s.spec);
        let answer = tok.decode(&out, true).unwrap_or_default();
        // The next turn holds this one and asks for the answer again.
        prompts.push(format!("{text}{answer}\nUser: Say that again.\nAssistant:"));
        outs.push(out);
    }
    Ok((outs, secs, toks, st))
}

/// One method's figures over the rounds: tokens/s per round, stats, the first difference from
/// plain greedy (turn, token), verify steps replayed and eager, rollbacks replayed and eager.
type Acc = (Vec<f64>, SpecStats, Option<(usize, usize)>, [u64; 4]);

/// Where `outs` first parts from `plain`: (turn, token index), `None` when they are equal.
fn first_difference(plain: &[Vec<u32>], outs: &[Vec<u32>]) -> Option<(usize, usize)> {
    if plain.len() != outs.len() {
        return Some((plain.len().min(outs.len()), 0));
    }
    plain.iter().zip(outs).enumerate().find_map(|(t, (p, o))| {
        let i = p.iter().zip(o).position(|(a, b)| a != b).or((p.len() != o.len()).then(|| p.len().min(o.len())))?;
        Some((t, i))
    })
}

/// `cuda`: on the GPU runner (`--device cuda`), else the CPU model.
pub fn bench_spec(a: &Args, methods: &str, cuda: bool) -> Result<()> {
    let dir = a.model.dir()?;
    let ck = Checkpoint::open(&dir)?;
    let model = if cuda { None } else { Some(Arc::new(Model::load(&ck)?)) };
    super::args::check_draft_flags(methods, a.run.draft_model.is_some())?;
    let draft = match &a.run.draft_model {
        Some(d) => Some(DraftSpec::load(d, &ck.config, &dir.display().to_string())?),
        None => None,
    };
    // The workloads need a tokenizer; the GPU's verify step costs do not (a `k3 init` checkpoint).
    let tok = match Tokenizer::from_dir(&dir).with_context(|| format!("the tokenizer of {}", dir.display())) {
        Ok(t) => Some(Arc::new(t)),
        Err(e) if cuda => {
            println!("workloads  skipped: {e:#}; the verify step costs below need no tokenizer");
            None
        }
        Err(e) => return Err(e),
    };
    // An engine, and on the GPU its runner's verify counters (`graphs`: verify steps captured).
    let engine = |spec: SpecConfig, graphs: bool| -> Result<(Engine, Option<Arc<VerifyStats>>)> {
        let cfg = EngineConfig { max_batch: 1, spec, draft: draft.clone(), ..Default::default() };
        Ok(match &model {
            Some(m) => (Engine::new(m.clone(), tok.clone(), cfg), None),
            None => {
                let mut r = k3_engine::gpu::load_gpu(&ck, 0, 4, 16384, k3_model::capacity::KvDtype::Bf16, true, false, &Default::default())?;
                r.set_verify_graphs(graphs);
                let stats = r.verify_stats();
                (Engine::with_runner(Box::new(r), tok.clone(), cfg), Some(stats))
            }
        })
    };
    // (method, verify graphs): on the GPU each method also with eager verify steps.
    let mut list = vec![(SpecConfig::default(), true)];
    for m in methods.split(',').filter(|m| !m.is_empty()) {
        let sc = SpecConfig::from_flags(m, a.run.num_speculative_tokens)?;
        list.push((sc, true));
        if cuda && sc.enabled() {
            list.push((sc, false));
        }
    }
    if list.len() < 2 {
        bail!("--speculative: give the methods to compare, e.g. ngram,suffix");
    }
    let gen = a.run.gen_len;
    let mut report = Vec::new();
    let workloads: &[&str] = if tok.is_some() { &["quote", "chat"] } else { &[] };
    for &w in workloads {
        let tok = tok.as_deref().context("a workload without a tokenizer")?;
        let mut plain: Option<Vec<Vec<u32>>> = None;
        let mut acc: Vec<Acc> = vec![(Vec::new(), SpecStats::default(), None, [0; 4]); list.len()];
        for _round in 0..2 {
            for (i, &(sc, graphs)) in list.iter().enumerate() {
                let (mut e, vs) = engine(sc, graphs)?;
                if let Err(why) = e.speculating() {
                    bail!("--speculative {}: {why}", format!("{:?}", sc.method).to_lowercase());
                }
                let (outs, secs, n, st) = run_workload(&mut e, tok, w, gen)?;
                match &plain {
                    None => plain = Some(outs),
                    Some(p) => acc[i].2 = acc[i].2.or(first_difference(p, &outs)),
                }
                acc[i].0.push(n as f64 / secs.max(1e-9));
                acc[i].1.add(&st);
                if let Some(v) = vs {
                    acc[i].3[0] += v.replayed.load(Relaxed);
                    acc[i].3[1] += v.eager.load(Relaxed);
                    acc[i].3[2] += v.rollbacks_replayed.load(Relaxed);
                    acc[i].3[3] += v.rollbacks_eager.load(Relaxed);
                }
            }
        }
        for (&(sc, graphs), (tps, st, diff, [replayed, eager, rb_replayed, rb_eager])) in list.iter().zip(acc) {
            let same = diff.is_none();
            let at = diff.map_or(String::new(), |(t, i)| format!(" (first at turn {t}, token {i})"));
            let mut m = if sc.enabled() { format!("{:?}", sc.method).to_lowercase() } else { "off".into() };
            if !graphs {
                m.push_str("/eager");
            }
            let verify = match cuda && sc.enabled() {
                true => format!(" | verify steps: {replayed} from graphs, {eager} eager; rollbacks: {rb_replayed} from graphs, {rb_eager} eager"),
                false => String::new(),
            };
            let per_pos: Vec<f64> = st.per_position.iter().map(|p| if p[0] == 0 { 0.0 } else { p[1] as f64 / p[0] as f64 }).collect();
            let mean = tps.iter().sum::<f64>() / tps.len() as f64;
            report.push(serde_json::json!({
                "workload": w, "method": m, "decode_tokens_per_s": mean, "rounds_tokens_per_s": tps,
                "accepted_per_step": if sc.enabled() { st.accepted_per_step() } else { 1.0 },
                "draft_acceptance": st.draft_acceptance(), "acceptance_per_position": per_pos, "identical_to_plain": same, "first_difference": diff,
                "verify_steps_replayed": replayed, "verify_steps_eager": eager, "rollbacks_replayed": rb_replayed, "rollbacks_eager": rb_eager,
            }));
            if !a.json {
                let rounds: Vec<String> = tps.iter().map(|x| format!("{x:.1}")).collect();
                println!(
                    "{w:6} {m:7} decode {mean:7.1} tok/s (rounds {}) | {:.2} tokens/step | acceptance {:.1}% | per position {:?} | identical to plain: {same}{at}{verify}",
                    rounds.join(", "),
                    if sc.enabled() { st.accepted_per_step() } else { 1.0 },
                    100.0 * st.draft_acceptance(),
                    per_pos.iter().map(|x| (x * 100.0).round() / 100.0).collect::<Vec<_>>()
                );
            }
        }
    }
    let Some(model) = model else {
        let costs = gpu_costs(&ck, a)?;
        if a.json {
            println!("{}", serde_json::to_string(&serde_json::json!({ "model": dir.display().to_string(), "gen_len": gen, "runs": report, "verify": costs }))?);
        }
        return Ok(());
    };
    let costs = step_costs(&model, a.run.num_speculative_tokens)?;
    if a.json {
        let c: Vec<_> = costs.iter().map(|(r, ms)| serde_json::json!({"rows": r, "ms": ms})).collect();
        println!(
            "{}",
            serde_json::to_string(
                &serde_json::json!({ "model": dir.display().to_string(), "gen_len": gen, "k": a.run.num_speculative_tokens, "runs": report, "verify_step_ms": c })
            )?
        );
    } else {
        let c: Vec<String> = costs.iter().map(|(r, ms)| format!("{r} rows {ms:.2} ms")).collect();
        println!("one sequence's step at 256 tokens of context (median of 15): plain decode {} | verify {}", c[0], c[1..].join(", "));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn gpu_costs(ck: &Checkpoint, a: &Args) -> Result<serde_json::Value> {
    super::bench_spec_cuda::verify_costs(ck, a)
}

#[cfg(not(feature = "cuda"))]
fn gpu_costs(_: &Checkpoint, _: &Args) -> Result<serde_json::Value> {
    bail!("this k3 was built without CUDA: rebuild with `cargo build --release --features cuda`")
}

/// Median wall time of one sequence's decode step (1 row) and of verify forwards of 2..=k+1 rows,
/// at 256 tokens of context.
fn step_costs(model: &Model, k: usize) -> Result<Vec<(usize, f64)>> {
    let v = model.config.text.vocab_size as u32;
    let ctx: Vec<u32> = (0..256u32).map(|i| (i * 37 + 11) % v).collect();
    let mut base = model.new_state();
    model.forward(&ctx, &mut base, k3_model::ForwardOpts { last_only: true, ..Default::default() }, None)?;
    let mut out = Vec::new();
    for rows in [1].into_iter().chain(2..=k + 1) {
        let toks: Vec<u32> = (0..rows as u32).map(|i| (i * 13 + 5) % v).collect();
        let mut times = Vec::new();
        for _ in 0..15 {
            let mut st = base.clone();
            let emb = model.embed(&toks)?;
            let t = Instant::now();
            if rows == 1 {
                model.forward_embeds(emb, &mut st, k3_model::ForwardOpts { last_only: true, ..Default::default() }, None)?;
            } else {
                model.forward_verify(emb, &[rows], &mut [&mut st])?;
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        out.push((rows, times[times.len() / 2]));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::first_difference;

    #[test]
    fn first_difference_names_the_turn_and_token() {
        let p = vec![vec![1, 2, 3], vec![4, 5]];
        assert_eq!(first_difference(&p, &p.clone()), None);
        assert_eq!(first_difference(&p, &[vec![1, 2, 3], vec![4, 6]]), Some((1, 1)));
        assert_eq!(first_difference(&p, &[vec![9, 2, 3], vec![4, 6]]), Some((0, 0)));
        assert_eq!(first_difference(&p, &[vec![1, 2], vec![4, 5]]), Some((0, 2)), "a shorter turn parts where it ends");
        assert_eq!(first_difference(&p, &[vec![1, 2, 3]]), Some((1, 0)), "a missing turn");
    }
}
