//! Speculative decoding (issue 22): draft tokens from a proposer, verify them all in one
//! batched forward, keep the longest accepted prefix plus one token from the target model.
//!
//! - [`SpecConfig`] / [`SpecMethod`]: `--speculative ngram|suffix|mtp|draft|off`,
//!   `--num-speculative-tokens K`.
//! - Proposers ([`Proposer`]): [`ngram::NgramProposer`] (prompt lookup over the prompt and the
//!   output so far) and [`suffix::SuffixProposer`] (a suffix automaton over the request and over
//!   the engine's finished requests), with no extra weights; [`model::ModelProposer`] over a
//!   draft model: the checkpoint's MTP layer (`num_nextn_predict_layers > 0`, around-backbone
//!   §5.1) or a separate draft model of the same family ([`draft::DraftSpec`], `--draft-model`).
//!   A draft model runs where the target runs — its per-sequence state beside the target's in
//!   the runner, so that it advances, rolls back, is prefix-cached and freed with it — and the
//!   proposer reaches it through [`DraftModel`] ([`Proposer::propose_on`]): it chooses each
//!   draft token from the draft logits (argmax when greedy, a draw from `q` when sampling) and
//!   returns the `q`s in [`Draft::probs`].
//! - [`accept`]: greedy acceptance (the target's argmax must equal the draft: output identical to
//!   plain decoding) and rejection sampling (accept `d` with `min(1, p(d)/q(d))`, on reject draw
//!   from `max(p − q, 0)` normalised — for a deterministic proposer `q` is one-hot, so accept
//!   with `p(d)` and draw from `p` with `d` zeroed): the emitted tokens are distributed as plain
//!   sampling.
//! - [`Adaptive`]: per sequence, the number of drafts follows the acceptance (one more after a
//!   fully accepted step, accepted + 1 after a partial one), and speculation pauses for a
//!   sequence whose drafts keep failing (a back-off that doubles while they keep failing).
//! - The engine side (`engine/spec_step.rs`): drafted sequences and plain ones share one verify
//!   forward (`Runner::verify`: every row's logits equal a single decode step's, KDA states
//!   kept per token), then `Runner::rollback` drops each sequence's rejected tail — a copy of
//!   the KDA snapshot and a truncation of the MLA/DSA caches (`k3_model::verify`), and of the
//!   MTP layer's cache (`k3_model::draft`) or the draft model's state (`dist::draft`) when one
//!   drafts.
//!
//! Runners: the CPU runner verifies, on one rank and on every layout of ranks as threads (each
//! rank runs the verify forward on its shard and keeps its per-token KDA states; the rollback
//! is a command every rank applies: `dist::step::Command`); so does the runner of one GPU. A
//! multi-process (GPU) layout does not yet; on it the engine decodes plainly and
//! [`Engine::speculating`] says why. The MTP draft layer and a separate draft model run on the
//! CPU runner of one rank only (`Runner::enable_mtp`, `Runner::enable_draft`).
//!
//! [`Engine::speculating`]: crate::Engine::speculating

pub mod accept;
pub mod draft;
pub mod model;
pub mod ngram;
pub mod suffix;

use serde::Serialize;

use crate::error::{EngineError, Result};

/// Most drafts per step and sequence.
pub const MAX_SPEC_TOKENS: usize = 16;

/// Which proposer drafts tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMethod {
    #[default]
    Off,
    /// Prompt lookup: the tokens that followed the last earlier occurrence of the context's
    /// final n-gram (n = 4 down to 2).
    Ngram,
    /// The longest suffix of the context that occurs earlier in this request or in a finished
    /// one (suffix automata), and what followed it there.
    Suffix,
    /// The checkpoint's MTP draft layer, chained (`model::ModelProposer`).
    Mtp,
    /// A separate draft model (`--draft-model`, `draft::DraftSpec`), chained decode steps
    /// (`model::ModelProposer`).
    Draft,
}

impl SpecMethod {
    /// Parses `--speculative`'s value; the error names the flag.
    pub fn parse(s: &str) -> Result<SpecMethod> {
        match s {
            "off" | "none" => Ok(SpecMethod::Off),
            "ngram" => Ok(SpecMethod::Ngram),
            "suffix" => Ok(SpecMethod::Suffix),
            "mtp" => Ok(SpecMethod::Mtp),
            "draft" => Ok(SpecMethod::Draft),
            "eagle" => Err(EngineError::Unsupported(
                "--speculative eagle: EAGLE heads are not built (a checkpoint's MTP layer is: --speculative mtp; a separate draft model: --speculative draft --draft-model DIR)".into(),
            )),
            _ => Err(EngineError::Unsupported(format!("--speculative: `{s}` is not one of ngram, suffix, mtp, draft, off"))),
        }
    }
}

/// Speculative decoding settings of an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Most drafts per sequence and step (the adaptive count starts here).
    pub num_tokens: usize,
    /// Adapt the count to the acceptance (off: always `num_tokens` when a draft is found).
    pub adaptive: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig { method: SpecMethod::Off, num_tokens: 4, adaptive: true }
    }
}

impl SpecConfig {
    /// From the flags; the errors name the flag.
    pub fn from_flags(method: &str, num_tokens: usize) -> Result<SpecConfig> {
        let method = SpecMethod::parse(method)?;
        if !(1..=MAX_SPEC_TOKENS).contains(&num_tokens) {
            return Err(EngineError::Unsupported(format!("--num-speculative-tokens: {num_tokens} is outside 1..={MAX_SPEC_TOKENS}")));
        }
        Ok(SpecConfig { method, num_tokens, ..Default::default() })
    }
    pub fn enabled(&self) -> bool {
        self.method != SpecMethod::Off
    }
}

/// Drafted tokens, and the draft distribution of each (`[k][vocab]`; `None`: a deterministic
/// proposer, one-hot at the token).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub probs: Option<Vec<Vec<f32>>>,
}

/// Drafts tokens continuing a sequence. `context` is the prompt then the output so far (the
/// last token is the one the next forward consumes first).
pub trait Proposer: Send {
    /// Up to `k` drafted tokens (fewer or none when nothing fits).
    fn propose(&mut self, context: &[u32], k: usize) -> Draft;
    /// What the engine calls: [`Proposer::propose`], or, for a proposer backed by a draft model,
    /// drafts from `model` (this sequence's draft model in the runner).
    fn propose_on(&mut self, context: &[u32], k: usize, model: &mut dyn DraftModel) -> Result<Draft> {
        let _ = model;
        Ok(self.propose(context, k))
    }
}

/// One sequence's draft model where the target runs (the MTP layer in the CPU runner).
pub trait DraftModel {
    /// Runs up to `k` chained draft positions after the sequence's consumed tokens, the first fed
    /// `next`: `choose` gets each position's logits `[vocab]` and returns the token fed to the
    /// next position (`None`: stop). Returns the tokens chosen.
    fn run(&mut self, next: u32, k: usize, choose: &mut dyn FnMut(&[f32]) -> Option<u32>) -> Result<usize>;
}

/// Speculation counters of one sequence (or summed over several), for `k3 run --json`, the
/// bench and `/metrics`.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct SpecStats {
    /// Decode steps (forwards that gave this sequence new tokens after its prefill).
    pub steps: u64,
    /// Decode steps that carried drafts.
    pub spec_steps: u64,
    /// Tokens emitted by decode steps.
    pub emitted: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Per draft position i (0-based): drafts proposed there, drafts accepted there.
    pub per_position: Vec<[u64; 2]>,
}

impl SpecStats {
    /// Emitted tokens per decode step (1.0 without speculation).
    pub fn accepted_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.emitted as f64 / self.steps as f64
        }
    }
    /// Accepted drafts / drafted tokens.
    pub fn draft_acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
    /// One decode step that drafted `drafted`, accepted `accepted` and emitted `emitted`.
    pub fn record(&mut self, drafted: usize, accepted: usize, emitted: usize) {
        self.steps += 1;
        self.emitted += emitted as u64;
        if drafted > 0 {
            self.spec_steps += 1;
            self.drafted += drafted as u64;
            self.accepted += accepted as u64;
            if self.per_position.len() < drafted {
                self.per_position.resize(drafted, [0, 0]);
            }
            for (i, p) in self.per_position.iter_mut().enumerate().take(drafted) {
                p[0] += 1;
                p[1] += u64::from(i < accepted);
            }
        }
    }
    /// Adds another's counters.
    pub fn add(&mut self, o: &SpecStats) {
        self.steps += o.steps;
        self.spec_steps += o.spec_steps;
        self.emitted += o.emitted;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        if self.per_position.len() < o.per_position.len() {
            self.per_position.resize(o.per_position.len(), [0, 0]);
        }
        for (a, b) in self.per_position.iter_mut().zip(&o.per_position) {
            a[0] += b[0];
            a[1] += b[1];
        }
    }
}

/// Steps without drafts after a run of failed ones, at first (doubles while failures go on).
const BACKOFF_START: usize = 4;
const BACKOFF_MAX: usize = 256;
/// Consecutive drafted steps with nothing accepted before speculation pauses.
const FAILS_TO_PAUSE: usize = 3;

/// The per-sequence draft count (see the module doc).
#[derive(Clone, Debug)]
pub struct Adaptive {
    max: usize,
    k: usize,
    adaptive: bool,
    fails: usize,
    pause: usize,
    backoff: usize,
}

impl Adaptive {
    pub fn new(cfg: &SpecConfig) -> Adaptive {
        Adaptive { max: cfg.num_tokens, k: cfg.num_tokens, adaptive: cfg.adaptive, fails: 0, pause: 0, backoff: BACKOFF_START }
    }
    /// Drafts to ask for in the next step (0 while paused).
    pub fn next_k(&mut self) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        self.k
    }
    /// The outcome of a step that drafted `drafted` tokens and accepted `accepted`.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 || !self.adaptive {
            return;
        }
        self.k = if accepted == drafted { (self.k + 1).min(self.max) } else { (accepted + 1).min(self.max) };
        if accepted == 0 {
            self.fails += 1;
            if self.fails >= FAILS_TO_PAUSE {
                self.pause = self.backoff;
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                self.fails = 0;
            }
        } else {
            self.fails = 0;
            self.backoff = BACKOFF_START;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_and_name_the_flag() {
        assert_eq!(SpecConfig::from_flags("ngram", 5).unwrap().method, SpecMethod::Ngram);
        assert_eq!(SpecConfig::from_flags("off", 1).unwrap().method, SpecMethod::Off);
        let e = SpecConfig::from_flags("bogus", 4).unwrap_err().to_string();
        assert!(e.contains("--speculative") && e.contains("bogus"), "{e}");
        let e = SpecConfig::from_flags("suffix", 0).unwrap_err().to_string();
        assert!(e.contains("--num-speculative-tokens"), "{e}");
        assert_eq!(SpecConfig::from_flags("mtp", 4).unwrap().method, SpecMethod::Mtp);
        assert_eq!(SpecConfig::from_flags("draft", 4).unwrap().method, SpecMethod::Draft);
        let e = SpecConfig::from_flags("eagle", 4).unwrap_err().to_string();
        assert!(e.contains("not built"), "{e}");
    }

    #[test]
    fn adaptive_grows_shrinks_and_pauses() {
        let mut a = Adaptive::new(&SpecConfig { method: SpecMethod::Ngram, num_tokens: 6, adaptive: true });
        assert_eq!(a.next_k(), 6);
        a.update(6, 2);
        assert_eq!(a.next_k(), 3);
        a.update(3, 3);
        assert_eq!(a.next_k(), 4);
        for _ in 0..FAILS_TO_PAUSE {
            a.update(4, 0);
        }
        let paused = (0..BACKOFF_START).map(|_| a.next_k()).collect::<Vec<_>>();
        assert!(paused.iter().all(|&k| k == 0), "{paused:?}");
        assert_eq!(a.next_k(), 1);
    }

    #[test]
    fn stats_per_position() {
        let mut s = SpecStats::default();
        s.record(3, 1, 2);
        s.record(0, 0, 1);
        assert_eq!(s.per_position, vec![[1, 1], [1, 0], [1, 0]]);
        assert_eq!(s.accepted_per_step(), 1.5);
        assert!((s.draft_acceptance() - 1.0 / 3.0).abs() < 1e-12);
    }
}
