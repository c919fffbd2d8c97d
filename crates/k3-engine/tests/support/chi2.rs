//! The sampled-distribution check the speculative tests share (`spec.rs` with a fixed-draft
//! proposer, `mtp.rs` with the MTP layer's drafts): the exact distribution of every sequence of
//! `N` sampled tokens a top-k sampler can reach after a prompt (computed from the model, one
//! forward per context), and Pearson's χ² of observed sequence counts against it (cells
//! expected below 5 pooled), compared with the 0.001 point.
#![allow(dead_code)]

use std::collections::HashMap;

use k3_engine::{Sampler, SamplingParams};
use k3_model::{ForwardOpts, Model};

/// For each reachable output so far (`[]`, then every continuation), the tokens it may continue
/// with and their probabilities, most likely first.
pub type Exact = HashMap<Vec<u32>, Vec<(u32, f64)>>;

/// The exact distribution of `n` tokens sampled with `params` (a top-k sampler: every context's
/// support is small) after `prompt`.
pub fn exact(model: &Model, prompt: &[u32], params: &SamplingParams, n: usize) -> Exact {
    let mut exact = Exact::new();
    let mut frontier = vec![Vec::<u32>::new()];
    for _ in 0..n {
        let mut next = Vec::new();
        for out in frontier {
            let ctx: Vec<u32> = prompt.iter().chain(&out).copied().collect();
            let lg = model.forward(&ctx, &mut model.new_state(), ForwardOpts { last_only: true, ..Default::default() }, None).unwrap();
            let p = Sampler::new(params.clone()).distribution(&lg);
            let mut top: Vec<(u32, f64)> = p.iter().enumerate().filter(|x| *x.1 > 0.0).map(|(i, &x)| (i as u32, x as f64)).collect();
            top.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
            for &(t, _) in &top {
                next.push(out.iter().copied().chain([t]).collect());
            }
            exact.insert(out, top);
        }
        frontier = next;
    }
    exact
}

/// The upper 0.001 point of χ² with `df` degrees of freedom (Wilson–Hilferty).
pub fn chi2_crit(df: f64) -> f64 {
    let z = 3.090; // the normal's upper 0.001 point
    df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3)
}

/// χ² of `counts` (output sequences of `n` tokens over `runs` runs) against `exact`: the
/// statistic, the cells and the 0.001 point. Panics when a run left the reachable tree.
pub fn chi2(exact: &Exact, counts: &HashMap<Vec<u32>, u64>, n: usize, runs: u64) -> (f64, usize, f64) {
    let joint = |seq: &[u32]| -> f64 { (0..n).map(|i| exact[&seq[..i]].iter().find(|x| x.0 == seq[i]).map_or(0.0, |x| x.1)).product() };
    let (mut x2, mut cells, mut pool_e, mut pool_o) = (0.0, 0usize, 0.0, 0.0);
    let mut all: Vec<Vec<u32>> = vec![Vec::new()];
    for _ in 0..n {
        all = all.iter().flat_map(|o| exact[o].iter().map(move |x| o.iter().copied().chain([x.0]).collect::<Vec<u32>>())).collect();
    }
    let mut seen = 0;
    for s in &all {
        let ex = joint(s) * runs as f64;
        let ob = counts.get(s).copied().unwrap_or(0) as f64;
        seen += ob as u64;
        if ex < 5.0 {
            pool_e += ex;
            pool_o += ob;
        } else {
            x2 += (ob - ex).powi(2) / ex;
            cells += 1;
        }
    }
    assert_eq!(seen, runs, "a run produced a sequence outside the top-k tree");
    if pool_e > 0.0 {
        x2 += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    (x2, cells, chi2_crit((cells - 1) as f64))
}
