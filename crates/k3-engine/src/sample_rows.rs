//! What each row of a step samples, handed to the runner so that sampling happens where the
//! logits are ([`crate::dist::runner::Runner::forward_sample`]): on the host by default
//! ([`RowSample::on_host`], the CPU sampler of `sampler.rs`), on the GPU for the GPU runner
//! (`k3_core::cuda::sample`: only token ids and logprobs cross PCIe, never `[B, vocab]` logits).
//!
//! A [`RowSample`] carries the request's parameters, the uniform draw its sampler consumed
//! (`Sampler::draw`), the penalties in sparse form (`penalty_pairs`: one pair per distinct
//! token) and the grammar's allowed-id words, so both samplers see exactly the same inputs.
//! With the `cuda` feature, [`pack`] lays a step's rows out for the kernels and [`unpack`]
//! reads a result back into a [`Sampled`].

use crate::sampler::{pick, Sampled, SamplingParams};

/// One row's sampling inputs.
#[derive(Clone, Debug, PartialEq)]
pub struct RowSample {
    pub params: SamplingParams,
    /// The uniform draw in [0, 1) the sequence's generator gave for this token (0 when greedy).
    pub u: f32,
    /// `(token, count in output)` pairs of the penalties (`sampler::penalty_pairs`).
    pub pairs: Vec<(u32, u32)>,
    /// The grammar's allowed ids (bit `t % 32` of word `t / 32`), when the request is constrained.
    pub allowed: Option<Vec<u32>>,
}

impl RowSample {
    /// Samples this row from its raw logits on the host.
    pub fn on_host(&self, logits: &[f32]) -> Sampled {
        pick(&self.params, logits, &self.pairs, self.allowed.as_deref(), self.u)
    }
}

/// Called by a runner once its forward is under way: the rows to sample, one per step entry
/// (`None` for a prefill chunk that does not end its prompt).
pub type RowsFn<'a> = dyn FnMut() -> Vec<Option<RowSample>> + 'a;

/// Samples `rows` from a step's logits `[rows.len(), vocab]` on the host.
pub fn on_host(logits: &[f32], vocab: usize, rows: &[Option<RowSample>]) -> Vec<Option<Sampled>> {
    rows.iter().zip(logits.chunks_exact(vocab)).map(|(r, lg)| r.as_ref().map(|r| r.on_host(lg))).collect()
}

#[cfg(feature = "cuda")]
pub use device::{pack, unpack};

#[cfg(feature = "cuda")]
mod device {
    use k3_core::cuda::sample::{SampleOut, SampleRow, MAX_LOGPROBS};

    use super::RowSample;
    use crate::sampler::Sampled;

    /// The kernels' inputs for a step's rows: one [`SampleRow`] each (a row that samples
    /// nothing is greedy and its result ignored), the penalty pairs flattened, the mask words.
    pub fn pack(rows: &[Option<RowSample>]) -> (Vec<SampleRow>, Vec<u32>, Vec<u32>) {
        let (mut out, mut pens, mut masks) = (Vec::with_capacity(rows.len()), Vec::new(), Vec::new());
        for r in rows {
            let Some(r) = r else {
                out.push(SampleRow::default());
                continue;
            };
            let p = &r.params;
            let mut row = SampleRow {
                temperature: p.temperature,
                top_k: p.top_k.min(i32::MAX as usize) as i32,
                top_p: p.top_p,
                min_p: p.min_p,
                repetition_penalty: p.repetition_penalty,
                presence_penalty: p.presence_penalty,
                frequency_penalty: p.frequency_penalty,
                u: r.u,
                n_logprobs: p.logprobs.unwrap_or(0).min(MAX_LOGPROBS) as i32,
                pen_off: (pens.len() / 2) as i32,
                pen_len: r.pairs.len() as i32,
                ..Default::default()
            };
            for &(t, c) in &r.pairs {
                pens.extend([t, c]);
            }
            row.bias_off = (pens.len() / 2) as i32;
            row.bias_len = p.logit_bias.len() as i32;
            for &(t, b) in &p.logit_bias {
                pens.extend([t, b.to_bits()]);
            }
            if let Some(m) = &r.allowed {
                row.mask_off = masks.len() as i32;
                row.mask_words = m.len() as i32;
                masks.extend_from_slice(m);
            }
            out.push(row);
        }
        (out, pens, masks)
    }

    /// A kernel result as the host sampler reports it (top logprobs only when asked for).
    pub fn unpack(o: &SampleOut, r: &RowSample) -> Sampled {
        let n = match r.params.logprobs {
            Some(n) if n > 0 => n.min(MAX_LOGPROBS),
            _ => 0,
        };
        let top_logprobs = o.top_ids.iter().zip(&o.top_lps).take(n).filter(|(&i, _)| i >= 0).map(|(&i, &lp)| (i as u32, lp)).collect();
        Sampled { token: o.token.max(0) as u32, logprob: o.logprob, top_logprobs }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use crate::sampler::SamplingParams;

        #[test]
        fn pack_lays_out_slices_in_row_order() {
            let a = RowSample {
                params: SamplingParams { temperature: 0.7, top_k: 5, repetition_penalty: 1.2, logprobs: Some(3), ..Default::default() },
                u: 0.25,
                pairs: vec![(4, 0), (9, 2)],
                allowed: Some(vec![0xff, 0x1]),
            };
            let b =
                RowSample { params: SamplingParams { logit_bias: vec![(6, -1.5)], ..SamplingParams::greedy() }, u: 0.0, pairs: vec![(1, 1)], allowed: None };
            let (rows, pens, masks) = pack(&[Some(a.clone()), None, Some(b)]);
            assert_eq!(rows.len(), 3);
            assert_eq!((rows[0].pen_off, rows[0].pen_len, rows[0].mask_off, rows[0].mask_words), (0, 2, 0, 2));
            assert_eq!((rows[0].bias_off, rows[0].bias_len), (2, 0));
            assert_eq!((rows[0].top_k, rows[0].n_logprobs, rows[0].u), (5, 3, 0.25));
            assert_eq!(rows[1], SampleRow::default());
            assert_eq!((rows[2].pen_off, rows[2].pen_len, rows[2].mask_off, rows[2].bias_off, rows[2].bias_len), (2, 1, -1, 3, 1));
            assert_eq!(pens, vec![4, 0, 9, 2, 1, 1, 6, (-1.5f32).to_bits()]);
            assert_eq!(masks, vec![0xff, 0x1]);
            assert!(k3_core::cuda::sample::check_rows(&rows, pens.len() / 2, masks.len()).is_ok());
            let mut o = SampleOut { token: 7, logprob: -0.5, top_ids: [-1; MAX_LOGPROBS], top_lps: [0.0; MAX_LOGPROBS] };
            o.top_ids[..4].copy_from_slice(&[7, 2, 3, 4]);
            o.top_lps[..4].copy_from_slice(&[-0.5, -1.0, -2.0, -3.0]);
            let s = unpack(&o, &a);
            assert_eq!((s.token, s.logprob), (7, -0.5));
            assert_eq!(s.top_logprobs, vec![(7, -0.5), (2, -1.0), (3, -2.0)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::Sampler;

    #[test]
    fn host_rows_equal_the_sampler() {
        let params = SamplingParams { temperature: 0.9, top_p: 0.8, repetition_penalty: 1.3, frequency_penalty: 0.1, seed: Some(5), ..Default::default() };
        let logits: Vec<f32> = (0..64).map(|i| ((i * 13) % 17) as f32 * 0.3).collect();
        let (prompt, output) = (vec![3u32, 9, 9], vec![12u32, 3]);
        let mut a = Sampler::new(params.clone());
        let mut b = Sampler::new(params.clone());
        for _ in 0..40 {
            let want = a.sample(&logits, &prompt, &output);
            let row = RowSample { params: params.clone(), u: b.draw(), pairs: crate::sampler::penalty_pairs(&params, &prompt, &output), allowed: None };
            let two: Vec<f32> = logits.iter().chain(&logits).copied().collect();
            let got = on_host(&two, 64, &[Some(row), None]);
            assert_eq!(got[0].as_ref(), Some(&want));
            assert!(got[1].is_none());
        }
    }
}
