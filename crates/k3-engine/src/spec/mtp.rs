//! The MTP proposer (`--speculative mtp`, around-backbone §5.1): drafts with the checkpoint's
//! MTP layer, which runs in the runner beside the target (`k3_model::draft`; the runner keeps
//! its per-sequence state with the target's, so it rolls back, is prefix-cached and freed
//! with it). Each draft position's logits `[vocab]` come back here and the token is chosen:
//!
//! - greedy requests (`temperature = 0`): the argmax; the draft is one-hot (`Draft::probs` =
//!   `None`), and acceptance keeps the output equal to plain greedy decoding's;
//! - sampled requests: `q` = the request's sampling distribution (temperature, top-k, top-p,
//!   min-p; no penalties) of the MTP logits, the draft drawn from `q` with the proposer's own
//!   generator (seeded from the request's seed), and `q` returned in `Draft::probs`, so
//!   rejection sampling (`accept`) keeps plain sampling's distribution.
//!
//! Chained: the chosen token is fed to the next position, with the layer's pre-norm output in
//! place of the target's hidden state.

use super::accept::draw;
use super::{Draft, DraftModel, Proposer};
use crate::error::Result;
use crate::sampler::{argmax, Sampler, SamplingParams};

/// Mixed into a request's seed for the proposer's own draws (so they are not the acceptance's).
const SEED_MIX: u64 = 0x6d74_705f_6472_6166;

pub struct MtpProposer {
    /// The request's sampling parameters; its seed mixed (see [`SEED_MIX`]).
    sampler: Sampler,
}

impl MtpProposer {
    pub fn new(params: &SamplingParams) -> MtpProposer {
        MtpProposer { sampler: Sampler::new(SamplingParams { seed: params.seed.map(|s| s ^ SEED_MIX), ..params.clone() }) }
    }
}

impl Proposer for MtpProposer {
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
