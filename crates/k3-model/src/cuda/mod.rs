//! The Kimi K3 / K3.1 Pro text model on one NVIDIA GPU (feature `cuda`): the same network as
//! `model.rs` (text-backbone §2–§8), with weights uploaded from the memory-mapped checkpoint
//! (float matrices as BF16, MXFP4 experts as they are stored) and every op on the device: cuBLAS
//! GEMMs for the projections, k3rs's kernels for the rest (`k3_core::cuda`). The residual stream
//! (AttnRes partial sum and completed blocks) is F32; GEMM inputs are BF16; per-sequence state
//! lives in pools (`state.rs`). One forward serves prefill chunks and decode steps of many
//! sequences packed row-wise; decode steps can be replayed from a CUDA graph (`graph.rs`).
//!
//! Shapes: tokens `[N]` packed over `B` sequences; stream F32 `[N, H]`; logits F32 `[N or B, vocab]`.

mod bench;
mod ffn;
mod graph;
mod kda;
mod mla;
mod moe;
mod state;
mod upload;

use k3_core::cuda::blas::{gemm, Algo, GemmOptions, Layout};
use k3_core::cuda::gemv::{gemv, gemv_fits};
use k3_core::cuda::ops::{attn_res_norm, gather_rows, ResUpdate};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

pub use graph::DecodeGraph;
pub use state::{CacheConfig, CudaSeqState};

use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn as FfnKind, LayerSpec, Mixer as MixerKind};
use crate::error::{ModelError, Result};
use crate::weights::{layer_prefix, LM_HEAD, TEXT};
use state::{Free, Step, StepHost};

thread_local! {
    /// Set while a decode graph is warmed up and captured: its GEMM shapes recur on every replay,
    /// so their cuBLASLt algorithms are chosen by timing (see `graph.rs`).
    pub(crate) static TUNE_GEMMS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Rows of `x` up to which [`lin_many`] runs k3rs's GEMV rather than cuBLASLt. Measured on the
/// H200 (`cuda_bench gemv-suite`): at one row the GEMV is faster on every K3 projection shape
/// (e.g. the fused KDA input projections 0.165 vs 0.183 ms, the lm_head 0.523 vs 0.536 ms); from
/// two rows cuBLAS's tensor cores win on some shapes (o_proj 0.060 vs 0.051 ms at two rows).
const GEMV_ROWS: usize = 1;

/// `out[N, rows(w)] = x[N, K] · wᵀ` as `dtype` (BF16 weights, f32 accumulation). One row (a
/// batch-1 decode step) runs k3rs's GEMV, which streams the weight at HBM speed. More rows run cuBLASLt:
/// eager calls use its heuristic choice (N changes from call to call — prefill chunks, batch
/// sizes — and timing candidates for every new N would cost more than it saves), decode graphs
/// time them once.
pub(crate) fn lin(x: &CudaTensor, w: &CudaTensor, dtype: DType) -> Result<CudaTensor> {
    let [out] = lin_many(x, [(w, dtype)])?;
    Ok(out)
}

/// Several products of one input, `out_i = x · w_iᵀ` as `dtype_i`: one GEMV launch for one row
/// (the sibling projections of a layer share it), else one cuBLAS GEMM each.
pub(crate) fn lin_many<const K: usize>(x: &CudaTensor, ws: [(&CudaTensor, DType); K]) -> Result<[CudaTensor; K]> {
    let rows = x.numel() / x.last_dim().max(1);
    let mut outs = Vec::with_capacity(K);
    for (w, dt) in &ws {
        outs.push(CudaTensor::uninit(x.cuda_device(), *dt, vec![rows, w.shape()[0]])?);
    }
    let weights = ws.map(|(w, _)| w);
    if rows <= GEMV_ROWS && gemv_fits(x, &weights) {
        let pairs: Vec<(&CudaTensor, &CudaTensor)> = weights.iter().copied().zip(&outs).collect();
        gemv(x, &pairs)?;
    } else {
        let algo = if TUNE_GEMMS.with(|t| t.get()) { Algo::Tuned } else { Algo::Heuristic };
        for (w, out) in weights.iter().zip(&outs) {
            gemm(x, w, out, Layout::BT, GemmOptions { algo, ..Default::default() })?;
        }
    }
    match outs.try_into() {
        Ok(a) => Ok(a),
        Err(_) => unreachable!("one output was pushed per weight"),
    }
}

/// One AttnRes (norm, proj) pair folded into its pseudo-query `c` (F32 `[H]`).
pub struct AttnRes {
    pub c: CudaTensor,
    pub eps: f32,
}

impl AttnRes {
    fn load(dev: &CudaDevice, ck: &Checkpoint, prefix: &str, h: usize, eps: f32) -> Result<Self> {
        let cpu = crate::layers::attn_res::AttnRes::load(ck, prefix, h, eps)?;
        Ok(AttnRes { c: upload::f32s(dev, &cpu.c, vec![h], prefix)?, eps })
    }
}

pub enum Mixer {
    Kda(kda::Kda),
    Mla(mla::Mla),
}

pub enum Ffn {
    Dense(ffn::Mlp),
    Moe(moe::Moe),
}

pub struct Layer {
    pub spec: LayerSpec,
    pub self_attention_res: AttnRes,
    pub input_layernorm: CudaTensor,
    pub mixer: Mixer,
    pub mlp_res: AttnRes,
    pub post_attention_layernorm: CudaTensor,
    pub ffn: Ffn,
}

/// Storage and arithmetic precision of the GPU model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Weights and activations BF16 (f32 accumulation, F32 residual stream, MXFP4 experts as
    /// stored): the serving precision, every fast kernel.
    #[default]
    Bf16,
    /// Weights and activations F32 (MXFP4 experts decoded to f32 in the kernel): the reference
    /// precision, for checking the GPU against f32 references such as the golden fixtures. It
    /// runs plain kernels (f32 cuBLAS GEMMs without TF32, the recurrent KDA kernel, an f32 attend
    /// over an F32 latent cache, per-pair expert products): correct, not fast.
    F32,
}

impl Precision {
    /// The dtype of float weights and activations.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Bf16 => DType::BF16,
            Precision::F32 => DType::F32,
        }
    }
}

pub struct CudaModel {
    pub config: Config,
    pub dev: CudaDevice,
    pub embed_tokens: CudaTensor,
    pub layers: Vec<Layer>,
    pub output_attn_res: AttnRes,
    pub norm: CudaTensor,
    pub lm_head: CudaTensor,
    pub cache: CacheConfig,
    pub(crate) free: Free,
}

impl CudaModel {
    /// Uploads the checkpoint (checked against the tensor table first) to `dev`, with state
    /// pools sized by `cache`, in BF16 (the serving precision).
    pub fn load(ck: &Checkpoint, dev: &CudaDevice, cache: CacheConfig) -> Result<CudaModel> {
        Self::load_with(ck, dev, cache, Precision::Bf16)
    }

    /// [`CudaModel::load`] in the given precision.
    pub fn load_with(ck: &Checkpoint, dev: &CudaDevice, cache: CacheConfig, precision: Precision) -> Result<CudaModel> {
        ck.check()?;
        let dt = precision.dtype();
        let cfg = ck.config.clone();
        let t = &cfg.text;
        let (h, v, eps) = (t.hidden_size, t.vocab_size, t.rms_norm_eps);
        let free = Free::new(&cache);
        let layers = cfg
            .layers
            .iter()
            .map(|spec| {
                let l = spec.index;
                let p = layer_prefix(l);
                Ok(Layer {
                    spec: *spec,
                    self_attention_res: AttnRes::load(dev, ck, &format!("{p}self_attention_res"), h, eps)?,
                    input_layernorm: upload::vector(dev, ck, &format!("{p}input_layernorm.weight"), h)?,
                    mixer: match spec.mixer {
                        MixerKind::Kda => Mixer::Kda(kda::Kda::load(dev, ck, &cfg, l, free.pool_slots(), dt)?),
                        MixerKind::Mla => Mixer::Mla(mla::Mla::load(dev, ck, &cfg, l, false, free.pool_pages(), dt)?),
                        MixerKind::Dsa => Mixer::Mla(mla::Mla::load(dev, ck, &cfg, l, true, free.pool_pages(), dt)?),
                    },
                    mlp_res: AttnRes::load(dev, ck, &format!("{p}mlp_res"), h, eps)?,
                    post_attention_layernorm: upload::vector(dev, ck, &format!("{p}post_attention_layernorm.weight"), h)?,
                    ffn: match spec.ffn {
                        FfnKind::Dense => Ffn::Dense(ffn::Mlp::load(dev, ck, &format!("{p}mlp."), h, t.intermediate_size, t.activation_situ_beta, t.activation_situ_linear_beta, dt)?),
                        FfnKind::Moe => Ffn::Moe(moe::Moe::load(dev, ck, &cfg, l, dt)?),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let model = CudaModel {
            embed_tokens: upload::matrix(dev, ck, &format!("{TEXT}embed_tokens.weight"), v, h, dt)?,
            output_attn_res: AttnRes::load(dev, ck, &format!("{TEXT}output_attn_res"), h, eps)?,
            norm: upload::vector(dev, ck, &format!("{TEXT}norm.weight"), h)?,
            lm_head: upload::matrix(dev, ck, LM_HEAD, v, h, dt)?,
            layers,
            config: cfg,
            dev: dev.clone(),
            cache,
            free,
        };
        dev.synchronize()?;
        Ok(model)
    }

    /// A new, empty sequence (takes a KDA slot and zeroes its state).
    pub fn new_sequence(&mut self) -> Result<CudaSeqState> {
        let slot = self.free.take_slot()?;
        for l in &self.layers {
            if let Mixer::Kda(k) = &l.mixer {
                k.reset_slot(slot)?;
            }
        }
        Ok(CudaSeqState { slot, pages: Vec::new(), pos: 0 })
    }

    /// Returns a finished sequence's slot and pages to the pools.
    pub fn release(&mut self, seq: CudaSeqState) {
        self.free.release(seq);
    }

    /// Runs `tokens` of one sequence; logits `[T, vocab]` (or `[1, vocab]` with `last_only`).
    pub fn forward(&mut self, tokens: &[u32], seq: &mut CudaSeqState, last_only: bool) -> Result<Vec<f32>> {
        self.forward_varlen(Input::Tokens(tokens), &[tokens.len()], &mut [seq], last_only)
    }

    /// The packed forward: sequence i consumes `lens[i]` rows of `input`. Returns logits for every
    /// row, or each sequence's last row with `last_only`, as F32 on the host.
    pub fn forward_varlen(&mut self, input: Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState], last_only: bool) -> Result<Vec<f32>> {
        self.forward_traced(input, lens, seqs, last_only, None)
    }

    /// [`CudaModel::forward_varlen`] that also hands named intermediates to `trace` (the CPU
    /// model's names: `embed`, `blk.L.attn_in`, `blk.L.kda.out` / `blk.L.mla.out`, `blk.L.ffn_in`,
    /// `blk.L.ffn.out`, `output_norm`) as device tensors `[N, width]`.
    pub fn forward_traced(&mut self, input: Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState], last_only: bool, trace: GpuTrace<'_>) -> Result<Vec<f32>> {
        let step = self.prepare(&input, lens, seqs)?;
        let logits = self.run_traced(&step, &input, last_only, trace)?;
        for (s, &n) in seqs.iter_mut().zip(lens) {
            s.pos += n;
        }
        Ok(logits.to_f32_vec()?)
    }

    /// Errors on the first token id outside the vocabulary.
    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let v = self.config.text.vocab_size;
        match tokens.iter().enumerate().find(|(_, &x)| x as usize >= v) {
            Some((i, &tok)) => Err(ModelError::Input(format!("token id {tok} at row {i} is outside the vocabulary (vocab_size {v})"))),
            None => Ok(()),
        }
    }

    /// Checks that sequence i stays within `limit` tokens after `lens[i]` more (`what` names the
    /// limit in the error), then grows its pages to cover them.
    pub(crate) fn grow(&mut self, seqs: &mut [&mut CudaSeqState], lens: &[usize], limit: usize, what: &str) -> Result<()> {
        for (i, (s, &l)) in seqs.iter_mut().zip(lens).enumerate() {
            if s.pos + l > limit {
                return Err(ModelError::Input(format!("sequence {i}: {} tokens exceed {what}", s.pos + l)));
            }
            self.free.cover(s, s.pos + l)?;
        }
        Ok(())
    }

    /// Validates the inputs, grows the sequences' pages, and uploads the step tables (the block
    /// table as wide as the widest sequence).
    pub(crate) fn prepare(&mut self, input: &Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState]) -> Result<Step> {
        let h = self.config.text.hidden_size;
        let n: usize = lens.iter().sum();
        if n == 0 || lens.len() != seqs.len() || lens.contains(&0) {
            return Err(ModelError::Input(format!("{} sequences with lengths {lens:?}: every sequence needs at least one row", seqs.len())));
        }
        match input {
            Input::Tokens(t) => {
                if t.len() != n {
                    return Err(ModelError::Input(format!("{} tokens for {n} rows", t.len())));
                }
                self.check_tokens(t)?;
            }
            Input::Embeds(e) => {
                if e.len() != n * h {
                    return Err(ModelError::Input(format!("input rows: {} values for {n} rows of hidden_size {h}", e.len())));
                }
            }
        }
        let max = self.config.max_context();
        self.grow(seqs, lens, max, &format!("the context limit of {max} (max_position_embeddings)"))?;
        let refs: Vec<&CudaSeqState> = seqs.iter().map(|s| &**s).collect();
        let w = refs.iter().map(|s| s.pages.len()).max().unwrap_or(1).max(1);
        let host = StepHost::build(&refs, lens, w);
        let tokens = match input {
            Input::Tokens(t) => Some(*t),
            Input::Embeds(_) => None,
        };
        host.upload(&self.dev, lens, tokens)
    }

    /// Every layer on the step; returns the logits tensor F32 `[N or B, vocab]` on the device.
    /// Enqueues work only (no host synchronisation) when the input is token ids.
    pub(crate) fn run(&self, step: &Step, input: &Input<'_>, last_only: bool) -> Result<CudaTensor> {
        self.run_traced(step, input, last_only, None)
    }

    fn run_traced(&self, step: &Step, input: &Input<'_>, last_only: bool, mut trace: GpuTrace<'_>) -> Result<CudaTensor> {
        let mut emit = |name: &dyn Fn() -> String, t: &CudaTensor| -> Result<()> {
            if let Some(f) = trace.as_mut() {
                f(&name(), t)?;
            }
            Ok(())
        };
        let (h, n) = (self.config.text.hidden_size, step.n);
        let b = self.config.text.attn_res_block_size;
        let eps = self.config.text.rms_norm_eps;
        let dev = &self.dev;
        // The partial sum P starts as the embeddings.
        let p = CudaTensor::uninit(dev, DType::F32, vec![n, h])?; // [N, H]
        match (input, &step.tokens) {
            (Input::Tokens(_), Some(ids)) => gather_rows(&self.embed_tokens, ids, &p)?,
            (Input::Embeds(e), _) => p.write_bytes(bytemuck::cast_slice(e))?,
            _ => return Err(ModelError::Input("token ids missing from the step".into())),
        }
        emit(&|| "embed".into(), &p)?;
        let mut blocks: Vec<CudaTensor> = Vec::new();
        let mut d: Option<CudaTensor> = None;
        let x = CudaTensor::uninit(dev, self.lm_head.dtype(), vec![n, h])?; // normed mix, GEMM input (the weights' dtype)
        for layer in &self.layers {
            let l = layer.spec.index;
            let starts = l % b == 0;
            let nb = l.div_ceil(b);
            let snap = if starts { Some(CudaTensor::uninit(dev, DType::F32, vec![n, h])?) } else { None };
            let srcs: Vec<&CudaTensor> = blocks[..nb].iter().collect();
            let upd = if d.is_some() { ResUpdate::Add } else { ResUpdate::Keep };
            let ar = &layer.self_attention_res;
            attn_res_norm(&srcs, &p, upd, d.as_ref(), snap.as_ref(), &ar.c, ar.eps, &layer.input_layernorm, eps, &x)?;
            blocks.extend(snap);
            emit(&|| format!("blk.{l}.attn_in"), &x)?;
            let a = match &layer.mixer {
                Mixer::Kda(m) => m.forward(&x, step)?,
                Mixer::Mla(m) => m.forward(&x, step)?,
            };
            emit(&|| format!("blk.{l}.{}.out", if matches!(layer.mixer, Mixer::Kda(_)) { "kda" } else { "mla" }), &a)?;
            let nb2 = nb + usize::from(starts);
            let srcs: Vec<&CudaTensor> = blocks[..nb2].iter().collect();
            let upd = if starts { ResUpdate::Assign } else { ResUpdate::Add };
            let mr = &layer.mlp_res;
            attn_res_norm(&srcs, &p, upd, Some(&a), None, &mr.c, mr.eps, &layer.post_attention_layernorm, eps, &x)?;
            emit(&|| format!("blk.{l}.ffn_in"), &x)?;
            let out = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&x)?,
                Ffn::Moe(m) => m.forward(&x)?,
            };
            emit(&|| format!("blk.{l}.ffn.out"), &out)?;
            d = Some(out);
        }
        let srcs: Vec<&CudaTensor> = blocks.iter().collect();
        let upd = if d.is_some() { ResUpdate::Add } else { ResUpdate::Keep };
        let o = &self.output_attn_res;
        attn_res_norm(&srcs, &p, upd, d.as_ref(), None, &o.c, o.eps, &self.norm, eps, &x)?;
        emit(&|| "output_norm".into(), &x)?;
        if last_only {
            let nb = step.lens.len();
            let last = CudaTensor::uninit(dev, x.dtype(), vec![nb, h])?; // [B, H]
            gather_rows(&x, &step.last_rows, &last)?;
            lin(&last, &self.lm_head, DType::F32)
        } else {
            lin(&x, &self.lm_head, DType::F32)
        }
    }

    /// Weight bytes one decode token reads (every non-expert matrix, `top_k` routed experts per
    /// MoE layer, one embedding row, the whole `lm_head`): the numerator of decode bandwidth.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let mut total = (self.lm_head.byte_len() + self.embed_tokens.byte_len() / self.embed_tokens.shape()[0].max(1)) as u64;
        for l in &self.layers {
            total += match &l.mixer {
                Mixer::Kda(k) => k.weight_bytes(),
                Mixer::Mla(m) => m.weight_bytes(),
            };
            total += match &l.ffn {
                Ffn::Dense(m) => m.weight_bytes(),
                Ffn::Moe(m) => m.weight_bytes(),
            };
        }
        total
    }
}

/// Receives named intermediates as device tensors (see [`CudaModel::forward_traced`]).
pub type GpuTrace<'a> = Option<&'a mut dyn FnMut(&str, &CudaTensor) -> Result<()>>;

/// What a forward consumes: token ids, or input rows F32 `[N, H]` (embeddings with image
/// features spliced in).
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    Tokens(&'a [u32]),
    Embeds(&'a [f32]),
}
