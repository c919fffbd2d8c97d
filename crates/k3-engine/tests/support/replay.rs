//! The replay proposer the speculative tests share (`spec.rs` on the CPU, `cuda_spec.rs` on the
//! GPU): it drafts a request's plain output with every third drafted position wrong and no
//! draft at every fourth output position, so accepted, rejected and plain rows all occur.

use std::collections::HashMap;
use std::sync::Arc;

use k3_engine::engine::ProposerFactory;
use k3_engine::spec::{Draft, Proposer};
use k3_engine::Request;

/// Drafts `out` (the plain run's continuation of a prompt of `prompt_len` tokens).
pub struct Replay {
    pub prompt_len: usize,
    pub out: Arc<Vec<u32>>,
    pub vocab: u32,
}

impl Proposer for Replay {
    fn propose(&mut self, context: &[u32], k: usize) -> Draft {
        let p = context.len() - self.prompt_len;
        if p % 4 == 1 {
            return Draft::default();
        }
        let tokens = (p..(p + k).min(self.out.len())).map(|i| if i % 3 == 2 { (self.out[i] + 1) % self.vocab } else { self.out[i] }).collect();
        Draft { tokens, probs: None }
    }
}

/// A factory of [`Replay`] proposers for requests whose plain output is in `plain` (by prompt).
pub fn replay(plain: HashMap<Vec<u32>, Vec<u32>>, vocab: u32) -> ProposerFactory {
    let plain = Arc::new(plain);
    Arc::new(move |r: &Request| Box::new(Replay { prompt_len: r.prompt.len(), out: Arc::new(plain[&r.prompt].clone()), vocab }) as Box<dyn Proposer>)
}
