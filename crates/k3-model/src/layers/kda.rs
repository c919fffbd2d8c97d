//! The KDA token mixer (text-backbone §3): projections, causal short conv + SiLU, L2 norms,
//! q scaling, β = σ(b), the lower-bounded decay gate, the delta-rule core
//! (`k3_core::kernels::cpu::kda`, chunked for prefill, recurrent for decode), per-head output
//! RMSNorm × σ(g_proj x), `o_proj`.
//!
//! Shapes: `x` `[T, H]`; `D = num_heads · head_dim`; q/k/v/g `[T, D]` = `[T, nh, hd]`;
//! state: conv tails `[K−1, D]` for q, k, v (raw pre-conv inputs) and `S` `[nh, hd, hd]`.

use k3_core::kernels::cpu::act::{sigmoid, silu};
use k3_core::kernels::cpu::kda::{kda_chunked, kda_recurrent, KdaDims};
use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::kernels::cpu::norm::{l2_norm_inplace, rms_norm_inplace};

use super::{lin, matrix, vector};
use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::source::{Source, Tensors};

/// Storage of the recurrent state. f32 is the reference (spec §3.8); bf16 halves the state's
/// memory and is **approximate**: the state is rounded to bf16 after every forward call, so
/// long decodes drift from the f32 result (engines report ~1e-3 relative).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum StateDType {
    #[default]
    F32,
    Bf16,
}

/// The recurrent state `[nh, hd, hd]` in its storage dtype.
#[derive(Clone, Debug)]
pub enum StateBuf {
    F32(Vec<f32>),
    /// bf16 bits.
    Bf16(Vec<u16>),
}

/// Per-sequence KDA state of one layer.
#[derive(Clone, Debug)]
pub struct KdaState {
    /// Last `K−1` raw projected inputs of q, k, v: `[3][K−1, D]`.
    pub conv: [Vec<f32>; 3],
    /// Recurrent state `[nh, hd, hd]`.
    pub s: StateBuf,
    /// After a [`KdaMode::Verify`] call of `T` tokens: the state after each of its first
    /// `T − 1` tokens (the live state is the one after all `T`), so that a rejected draft
    /// rolls back by a copy (`SeqState::rollback`). Empty after any other call.
    pub snapshots: Vec<KdaSnapshot>,
}

/// The conv tails and the recurrent state after one token of a verify call.
#[derive(Clone, Debug)]
pub struct KdaSnapshot {
    pub conv: [Vec<f32>; 3],
    pub s: StateBuf,
}

impl KdaState {
    pub fn new(cfg: &Config) -> Self {
        Self::with_dtype(cfg, StateDType::F32)
    }
    pub fn with_dtype(cfg: &Config, dtype: StateDType) -> Self {
        Self::with_heads(cfg, cfg.text.linear_attn_config.num_heads, dtype)
    }
    /// The state of `heads` of the layer's heads (a tensor-parallel rank's share).
    pub fn with_heads(cfg: &Config, heads: usize, dtype: StateDType) -> Self {
        let la = &cfg.text.linear_attn_config;
        let d = heads * la.head_dim;
        let tail = (la.short_conv_kernel_size - 1) * d;
        let n = heads * la.head_dim * la.head_dim;
        let s = match dtype {
            StateDType::F32 => StateBuf::F32(vec![0.0; n]),
            StateDType::Bf16 => StateBuf::Bf16(vec![0; n]),
        };
        KdaState { conv: [vec![0.0; tail], vec![0.0; tail], vec![0.0; tail]], s, snapshots: Vec::new() }
    }
    /// Bytes of the live state and of any verify snapshots it holds.
    pub fn bytes(&self) -> usize {
        let one = |s: &StateBuf, conv: &[Vec<f32>; 3]| {
            let s = match s {
                StateBuf::F32(v) => 4 * v.len(),
                StateBuf::Bf16(v) => 2 * v.len(),
            };
            s + 4 * conv.iter().map(Vec::len).sum::<usize>()
        };
        one(&self.s, &self.conv) + self.snapshots.iter().map(|x| one(&x.s, &x.conv)).sum::<usize>()
    }
}

/// Which form of the core to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KdaMode {
    /// Chunked for T > 1, recurrent for T = 1 (what engines do).
    Auto,
    Recurrent,
    Chunked,
    /// Speculative verification: the recurrent form one token at a time — exactly what `T`
    /// single decode steps compute, a bf16 state rounded after each token as a decode step
    /// rounds it — keeping the state after each token in [`KdaState::snapshots`].
    Verify,
}

pub struct Kda {
    pub q_proj: Matrix,
    pub k_proj: Matrix,
    pub v_proj: Matrix,
    /// Conv weights `[3][D, K]` (q, k, v); `w[c, K−1]` multiplies the current token.
    pub conv1d: [Vec<f32>; 3],
    pub b_proj: Matrix,
    pub f_a_proj: Matrix,
    pub f_b_proj: Matrix,
    /// `exp(A_log[h])`, precomputed.
    pub a_exp: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub g_proj: Matrix,
    pub o_norm: Vec<f32>,
    pub o_proj: Matrix,
    nh: usize,
    hd: usize,
    kernel: usize,
    lower_bound: f32,
    eps: f32,
}

impl Kda {
    /// Loads layer `l`'s mixer: this rank's heads (all of them on one rank).
    pub fn load(ck: &Source<'_>, cfg: &Config, l: usize) -> Result<Self> {
        let la = &cfg.text.linear_attn_config;
        let (h, hd, kernel) = (cfg.text.hidden_size, la.head_dim, la.short_conv_kernel_size);
        let nh = ck.plan.tp_share(la.num_heads).len();
        let d = nh * hd;
        let p = format!("{}self_attn.", crate::weights::layer_prefix(l));
        let conv = |x: &str| vector(ck, &format!("{p}{x}_conv1d.weight"), d * kernel);
        Ok(Kda {
            q_proj: matrix(ck, &format!("{p}q_proj.weight"), d, h)?,
            k_proj: matrix(ck, &format!("{p}k_proj.weight"), d, h)?,
            v_proj: matrix(ck, &format!("{p}v_proj.weight"), d, h)?,
            conv1d: [conv("q")?, conv("k")?, conv("v")?],
            b_proj: matrix(ck, &format!("{p}b_proj.weight"), nh, h)?,
            f_a_proj: matrix(ck, &format!("{p}f_a_proj.weight"), hd, h)?,
            f_b_proj: matrix(ck, &format!("{p}f_b_proj.weight"), d, hd)?,
            a_exp: ck.a_log(&format!("{p}A_log"), la.num_heads)?.iter().map(|a| a.exp()).collect(),
            dt_bias: vector(ck, &format!("{p}dt_bias"), d)?,
            g_proj: matrix(ck, &format!("{p}g_proj.weight"), d, h)?,
            o_norm: vector(ck, &format!("{p}o_norm.weight"), hd)?,
            o_proj: matrix(ck, &format!("{p}o_proj.weight"), h, d)?,
            nh,
            hd,
            kernel,
            lower_bound: la.gate_lower_bound.unwrap_or(-5.0),
            eps: cfg.text.rms_norm_eps,
        })
    }

    /// `x` `[T, H]` → `[T, H]`, advancing `state` by T tokens. On a tensor-parallel rank the
    /// output is this rank's partial sum of `o_proj` (the model adds the ranks' up).
    pub fn forward(&self, x: &[f32], t: usize, state: &mut KdaState, mode: KdaMode) -> Result<Vec<f32>> {
        self.forward_varlen(x, &[t], &mut [state], mode)
    }

    /// Several sequences packed row-wise: `x` `[N, H]` with `lens` rows per sequence
    /// (`Σ lens = N`), each advancing its own state. Projections run once over all rows.
    pub fn forward_varlen(&self, x: &[f32], lens: &[usize], states: &mut [&mut KdaState], mode: KdaMode) -> Result<Vec<f32>> {
        let (nh, hd) = (self.nh, self.hd);
        let d = nh * hd;
        let n: usize = lens.iter().sum();
        let tail = (self.kernel - 1) * d;
        if let Some(i) = states.iter().position(|s| s.conv.iter().any(|c| c.len() != tail)) {
            return Err(ModelError::Input(format!(
                "sequence {i}: its KDA state is not the state of this layer's {nh} heads (made for another model or another rank)"
            )));
        }
        let mut q = lin(x, n, &self.q_proj)?; // [N, D]
        let mut k = lin(x, n, &self.k_proj)?;
        let mut v = lin(x, n, &self.v_proj)?;
        let beta: Vec<f32> = lin(x, n, &self.b_proj)?.into_iter().map(sigmoid).collect(); // [N, nh]
        let mut g = lin(&lin(x, n, &self.f_a_proj)?, n, &self.f_b_proj)?; // [N, D]
        for (i, gv) in g.iter_mut().enumerate() {
            let c = i % d;
            *gv = self.lower_bound * sigmoid(self.a_exp[c / hd] * (*gv + self.dt_bias[c]));
        }
        let mut o = vec![0f32; n * d]; // [N, nh, hd]
        let mut r0 = 0;
        for (&t, st) in lens.iter().zip(states.iter_mut()) {
            st.snapshots.clear();
            if mode == KdaMode::Verify {
                // One token at a time, as decode steps run; the state kept after each but the last.
                for j in 0..t {
                    self.core_rows(&mut q, &mut k, &mut v, &g, &beta, &mut o, r0 + j, 1, st, false);
                    if j + 1 < t {
                        st.snapshots.push(KdaSnapshot { conv: st.conv.clone(), s: st.s.clone() });
                    }
                }
            } else {
                let chunked = match mode {
                    KdaMode::Auto => t > 1,
                    KdaMode::Chunked => true,
                    KdaMode::Recurrent | KdaMode::Verify => false,
                };
                self.core_rows(&mut q, &mut k, &mut v, &g, &beta, &mut o, r0, t, st, chunked);
            }
            r0 += t;
        }
        rms_norm_inplace(&mut o, &self.o_norm, self.eps);
        let gate = lin(x, n, &self.g_proj)?; // [N, D]
        o.iter_mut().zip(&gate).for_each(|(a, &b)| *a *= sigmoid(b));
        lin(&o, n, &self.o_proj)
    }
}

impl Kda {
    /// Conv + SiLU, L2 norms, q scaling and the delta-rule core over rows `r0..r0 + t` of the
    /// packed `[N, D]` buffers (one sequence's), advancing `st`; the core's output into `o`.
    #[allow(clippy::too_many_arguments)]
    fn core_rows(
        &self,
        q: &mut [f32],
        k: &mut [f32],
        v: &mut [f32],
        g: &[f32],
        beta: &[f32],
        o: &mut [f32],
        r0: usize,
        t: usize,
        st: &mut KdaState,
        chunked: bool,
    ) {
        let (nh, hd) = (self.nh, self.hd);
        let d = nh * hd;
        let rows = r0 * d..(r0 + t) * d;
        for (i, buf) in [&mut *q, &mut *k, &mut *v].into_iter().enumerate() {
            short_conv(&mut buf[rows.clone()], t, d, &self.conv1d[i], self.kernel, &mut st.conv[i]);
        }
        let (qs, ks) = (&mut q[rows.clone()], &mut k[rows.clone()]);
        l2_norm_inplace(qs, hd, 1e-6); // [T, nh, hd]
        l2_norm_inplace(ks, hd, 1e-6);
        let scale = (hd as f32).powf(-0.5);
        qs.iter_mut().for_each(|x| *x *= scale);
        let dims = KdaDims { t, h: nh, dk: hd, dv: hd };
        let core = if chunked { kda_chunked } else { kda_recurrent };
        let (qs, ks, vs, gs, bs) = (&q[rows.clone()], &k[rows.clone()], &v[rows.clone()], &g[rows.clone()], &beta[r0 * nh..(r0 + t) * nh]);
        match &mut st.s {
            StateBuf::F32(s) => core(qs, ks, vs, gs, bs, s, &mut o[rows], dims),
            StateBuf::Bf16(bits) => {
                // Widen, run the f32 core, round back (round-to-nearest-even).
                let mut s: Vec<f32> = bits.iter().map(|&b| f32::from_bits((b as u32) << 16)).collect();
                core(qs, ks, vs, gs, bs, &mut s, &mut o[rows], dims);
                bits.iter_mut().zip(&s).for_each(|(b, &x)| *b = half::bf16::from_f32(x).to_bits());
            }
        }
    }
}

/// Causal depthwise conv (kernel K) + SiLU in place over `buf` `[T, D]`, using and updating the
/// `[K−1, D]` tail of raw inputs from earlier tokens.
pub fn short_conv(buf: &mut [f32], t: usize, d: usize, w: &[f32], kernel: usize, tail: &mut [f32]) {
    let km1 = kernel - 1;
    // [K−1 + T, D]: earlier raw inputs then this call's.
    let mut xs = Vec::with_capacity((km1 + t) * d);
    xs.extend_from_slice(tail);
    xs.extend_from_slice(buf);
    for r in 0..t {
        for c in 0..d {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += w[c * kernel + j] * xs[(r + j) * d + c];
            }
            buf[r * d + c] = silu(acc);
        }
    }
    tail.copy_from_slice(&xs[t * d..]);
}
