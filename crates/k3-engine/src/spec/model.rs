//! The proposer of a draft model (`--speculative mtp`: the checkpoint's MTP layer, around-backbone
//! §5.1; `--speculative draft`: a separate draft model, `spec::draft`). The draft model runs in
//! the runner beside the target (`k3_model::draft` / `k3_model::draft_model`; the runner keeps
//! its per-sequence state with the target's, so it rolls back, is prefix-cached and freed with
//! it). Each chained draft position's logits `[vocab]` come back here and the token is chosen:
//!
//! - greedy requests (`temperature = 0`): the argmax; the draft is one-hot (`Draft::probs` =
//!   `None`), and acceptance keeps the output equal to plain greedy decoding's;
//! - sampled requests: `q` = the request's sampling distribution (temperature, top-k, top-p,
//!   min-p; no penalties) of the draft logits, the draft drawn from `q` with the proposer's own
//!   generator (seeded from the request's seed), and `q` returned in `Draft::probs`, so
//!   rejection sampling (`accept`) keeps plain sampling's distribution.
//!
//! Chained: the chosen token is fed to the next position.

use super::accept::draw;
use super::{Draft, DraftModel, Proposer};
use crate::error::Result;
use crate::sampler::{argmax, Sampler, SamplingParams};

/// Mixed into a request's seed for the proposer's own draws (so they are not the acceptance's).
const SEED_MIX: u64 = 0x6d74_705f_6472_6166;

pub struct ModelProposer {
    /// The request's sampling parameters; its seed mixed (see [`SEED_MIX`]).
    sampler: Sampler,
}

impl ModelProposer {
    pub fn new(params: &SamplingParams) -> ModelProposer {
        ModelProposer { sampler: Sampler::new(SamplingParams { seed: params.seed.map(|s| s ^ SEED_MIX), ..params.clone() }) }
    }
}

impl Proposer for ModelProposer {
    /// Nothing without the draft model (the engine calls [`Proposer::propose_on`]).
    fn propose(&mut self, _context: &[u32], _k: usize) -> Draft {
        Draft::default()
    }

    fn propose_on(&mut self, context: &[u32], k: usize, model: &mut dyn DraftModel) -> Result<Draft> {
        let Some(&next) = context.last() else { return Ok(Draft::default()) };
        let greedy = self.sampler.params.temperature == 0.0;
        let (mut tokens, mut qs) = (Vec::with_capacity(k), Vec::new());
        let sampler = &mut self.sampler;
        model.run(next, k, &mut |logits: &[f32]| {
            let d = if greedy {
                argmax(logits)
            } else {
                let q = sampler.distribution(logits);
                let d = draw(sampler, &q);
                qs.push(q);
                d
            } as u32;
            tokens.push(d);
            Some(d)
        })?;
        Ok(Draft { tokens, probs: (!greedy).then_some(qs) })
    }
}
