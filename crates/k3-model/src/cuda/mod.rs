//! The Kimi K3 / K3.1 Pro text model on one NVIDIA GPU (feature `cuda`): the same network as
//! `model.rs` (text-backbone §2–§8), with weights uploaded from the memory-mapped checkpoint
//! (float matrices as BF16, MXFP4 experts as they are stored) and every op on the device: cuBLAS
//! GEMMs for the projections, k3rs's kernels for the rest (`k3_core::cuda`). The residual stream
//! (AttnRes partial sum and completed blocks) is F32; GEMM inputs are BF16; per-sequence state
//! lives in pools (`state.rs`). One forward serves prefill chunks and decode steps of many
//! sequences packed row-wise; decode steps and speculative verify steps can be replayed from
//! CUDA graphs (`graph.rs`).
//!
//! Shapes: tokens `[N]` packed over `B` sequences; stream F32 `[N, H]`; logits F32 `[N or B, vocab]`.

mod bench;
mod ffn;
mod graph;
mod kda;
mod mla;
mod moe;
mod pipe;
mod prefix;
mod stage;
mod state;
mod upload;
mod verify;

use k3_core::cuda::blas::{gemm, Algo, GemmOptions, Layout};
use k3_core::cuda::gemv::{gemv, gemv_fits};
use k3_core::cuda::ops::{attn_res_norm, gather_rows, gather_rows_from, ResUpdate};
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

pub use graph::{DecodeGraph, VerifyGraph, VerifyRun};
pub use pipe::HeldStep;
pub use prefix::{LayerBytes, LayerRef};
pub use state::{CacheConfig, CudaSeqState};
pub use verify::RollbackRun;

use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn as FfnKind, LayerSpec, Mixer as MixerKind};
use crate::device_pages;
use crate::error::{ModelError, Result};
use crate::parallel::{CudaGroups, RankPlan};
use crate::source::{Source, Tensors};
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
    fn load<S: Tensors + ?Sized>(dev: &CudaDevice, ck: &S, prefix: &str, h: usize, eps: f32) -> Result<Self> {
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
    Moe(Box<moe::Moe>),
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

/// The output side of the last pipeline stage: the output AttnRes, the final norm and this
/// rank's vocabulary rows of the `lm_head`.
pub struct Head {
    pub output_attn_res: AttnRes,
    pub norm: CudaTensor,
    pub lm_head: CudaTensor,
}

/// The model on one GPU: the whole model, or one rank of a parallel layout (`parallel.rs`):
/// its stage's layers (global indices kept), its shards of them, and the NCCL groups its
/// collectives go to — the same sites as the CPU model's (`model.rs`).
pub struct CudaModel {
    pub config: Config,
    pub dev: CudaDevice,
    pub plan: RankPlan,
    pub groups: CudaGroups,
    /// This rank's vocabulary rows (`plan.tp_share(vocab_size)`), on the first stage only.
    pub embed_tokens: Option<CudaTensor>,
    pub layers: Vec<Layer>,
    /// On the last stage only.
    pub head: Option<Head>,
    /// Float weights' and GEMM inputs' dtype (the precision's).
    pub dtype: DType,
    pub cache: CacheConfig,
    pub(crate) free: Free,
    /// The last verify step, for its rollback (`verify.rs`).
    pub(crate) verified: Option<verify::Verified>,
}

impl CudaModel {
    /// Uploads the checkpoint (checked against the tensor table first) to `dev`, with state
    /// pools sized by `cache`, in BF16 (the serving precision).
    pub fn load(ck: &Checkpoint, dev: &CudaDevice, cache: CacheConfig) -> Result<CudaModel> {
        Self::load_with(ck, dev, cache, Precision::Bf16)
    }

    /// [`CudaModel::load`] in the given precision.
    pub fn load_with(ck: &Checkpoint, dev: &CudaDevice, cache: CacheConfig, precision: Precision) -> Result<CudaModel> {
        Self::load_rank(ck, dev, RankPlan::single(&ck.config), CudaGroups::single(), cache, precision)
    }

    /// One rank's model on `dev`: only the tensors `plan` gives it are read and uploaded (row
    /// shards are views of the memory map, column shards copies of their columns).
    pub fn load_rank(ck: &Checkpoint, dev: &CudaDevice, plan: RankPlan, groups: CudaGroups, cache: CacheConfig, precision: Precision) -> Result<CudaModel> {
        Self::load_rank_reporting(ck, dev, plan, groups, cache, precision, None, &Default::default())
    }

    /// [`CudaModel::load_rank`] that reports the bytes it has read to `report` (a world's
    /// loading: rank 0 draws one bar for every rank) instead of drawing rank 0's own bar, with
    /// each MoE layer's routed experts on the tier `offload` gives it (issue 23): uploaded, or
    /// computed by the CPU from host memory or from disk through its cache (`cuda/moe.rs`).
    pub fn load_rank_reporting(
        ck: &Checkpoint,
        dev: &CudaDevice,
        plan: RankPlan,
        groups: CudaGroups,
        cache: CacheConfig,
        precision: Precision,
        report: Option<&crate::source::LoadReport<'_>>,
        offload: &crate::offload::GpuOffload,
    ) -> Result<CudaModel> {
        let dt = precision.dtype();
        let cfg = ck.config.clone();
        let t = &cfg.text;
        let (h, v, eps) = (t.hidden_size, t.vocab_size, t.rms_norm_eps);
        if v % plan.par.tp != 0 {
            return Err(ModelError::Field {
                field: "text_config.vocab_size".into(),
                msg: format!("{v} does not split evenly over --tp {}: the GPU gathers the logits in equal parts", plan.par.tp),
            });
        }
        let src = Source::checked(ck, plan)?.show_progress(&format!("uploading rank 0's weights to GPU {}", dev.ordinal())).report_to(report);
        let plan = &src.plan;
        let free = Free::new(&cache);
        let layers = cfg.layers[plan.layers.clone()]
            .iter()
            .map(|spec| {
                let l = spec.index;
                let p = layer_prefix(l);
                Ok(Layer {
                    spec: *spec,
                    self_attention_res: AttnRes::load(dev, &src, &format!("{p}self_attention_res"), h, eps)?,
                    input_layernorm: upload::vector(dev, &src, &format!("{p}input_layernorm.weight"), h)?,
                    mixer: match spec.mixer {
                        MixerKind::Kda => Mixer::Kda(kda::Kda::load(dev, &src, &cfg, l, free.pool_slots(), dt)?),
                        MixerKind::Mla => Mixer::Mla(mla::Mla::load(dev, &src, &cfg, l, false, free.pool_pages(), dt, cache.kv_cache_dtype)?),
                        MixerKind::Dsa => Mixer::Mla(mla::Mla::load(dev, &src, &cfg, l, true, free.pool_pages(), dt, cache.kv_cache_dtype)?),
                    },
                    mlp_res: AttnRes::load(dev, &src, &format!("{p}mlp_res"), h, eps)?,
                    post_attention_layernorm: upload::vector(dev, &src, &format!("{p}post_attention_layernorm.weight"), h)?,
                    ffn: match spec.ffn {
                        FfnKind::Dense => {
                            let inter = plan.tp_share(t.intermediate_size).len();
                            Ffn::Dense(ffn::Mlp::load(dev, &src, &format!("{p}mlp."), h, inter, t.activation_situ_beta, t.activation_situ_linear_beta, dt)?)
                        }
                        FfnKind::Moe => Ffn::Moe(Box::new(moe::Moe::load(dev, &src, &cfg, l, dt, offload.tier(l), offload.cache.as_ref())?)),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let vl = plan.tp_share(v).len();
        let embed_tokens = plan.first_stage().then(|| upload::matrix(dev, &src, &format!("{TEXT}embed_tokens.weight"), vl, h, dt)).transpose()?;
        let head = match plan.last_stage() {
            true => Some(Head {
                output_attn_res: AttnRes::load(dev, &src, &format!("{TEXT}output_attn_res"), h, eps)?,
                norm: upload::vector(dev, &src, &format!("{TEXT}norm.weight"), h)?,
                lm_head: upload::matrix(dev, &src, LM_HEAD, vl, h, dt)?,
            }),
            false => None,
        };
        let model =
            CudaModel { embed_tokens, head, layers, config: cfg, dev: dev.clone(), plan: src.plan.clone(), groups, dtype: dt, cache, free, verified: None };
        dev.synchronize()?;
        src.done();
        Ok(model)
    }

    /// The cache the routed experts of some layer are read through (experts on disk).
    pub fn expert_cache(&self) -> Option<&std::sync::Arc<crate::offload::ExpertCache>> {
        self.layers.iter().find_map(|l| match &l.ffn {
            Ffn::Moe(m) => match &m.routed {
                moe::Routed::Cpu { experts: crate::layers::experts::RoutedExperts { weights: crate::layers::experts::Weights::Streamed(c), .. }, .. } => {
                    Some(c)
                }
                _ => None,
            },
            _ => None,
        })
    }

    /// Where the routed experts are, for start-up messages, when any is off the GPU.
    pub fn experts_summary(&self) -> Option<String> {
        let (mut gpu, mut host, mut disk) = (0, 0, 0);
        for l in &self.layers {
            if let Ffn::Moe(m) = &l.ffn {
                match &m.routed {
                    moe::Routed::Gpu(_) => gpu += 1,
                    moe::Routed::Cpu { experts, .. } => match experts.weights {
                        crate::layers::experts::Weights::Mapped(_) => host += 1,
                        crate::layers::experts::Weights::Streamed(_) => disk += 1,
                    },
                }
            }
        }
        (host + disk > 0).then(|| {
            let cache = self.expert_cache().map_or(String::new(), |c| format!("; {}", c.describe()));
            format!(
                "routed experts of {gpu} MoE layers on the GPU, {host} in host memory and {disk} on disk, the latter two computed by the CPU (decode steps run eagerly, without CUDA graphs){cache}"
            )
        })
    }

    /// Whether a step can be captured in a CUDA graph: not when some layer's routed experts
    /// are computed by the CPU (its forward waits on the host).
    pub fn capturable(&self) -> bool {
        !self.layers.iter().any(|l| matches!(&l.ffn, Ffn::Moe(m) if m.on_cpu()))
    }

    /// A new, empty sequence (takes a KDA slot and zeroes its state).
    pub fn new_sequence(&mut self) -> Result<CudaSeqState> {
        let slot = self.free.take_slot()?;
        for l in &self.layers {
            if let Mixer::Kda(k) = &l.mixer {
                k.reset_slot(slot)?;
            }
        }
        Ok(CudaSeqState { slot, pages: Default::default(), pos: 0 })
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
    /// row, or each sequence's last row with `last_only`, as F32 on the host (on rank 0 and the
    /// ranks of the last pipeline stage; empty on the others). Every rank of a
    /// parallel layout must make the same call.
    pub fn forward_varlen(&mut self, input: Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState], last_only: bool) -> Result<Vec<f32>> {
        self.forward_traced(input, lens, seqs, last_only, None)
    }

    /// [`CudaModel::forward_varlen`] of each sequence's last row leaving the logits on the
    /// device: F32 `[B, vocab]` (rank 0 and the last pipeline stage; `None` elsewhere), enqueued
    /// and not waited for when the input is token ids.
    pub fn forward_device(&mut self, input: Input<'_>, lens: &[usize], seqs: &mut [&mut CudaSeqState]) -> Result<Option<CudaTensor>> {
        let step = self.prepare(&input, lens, seqs)?;
        let logits = self.run(&step, &input, true)?;
        for (s, &n) in seqs.iter_mut().zip(lens) {
            s.pos += n;
        }
        Ok(logits)
    }

    /// [`CudaModel::forward_varlen`] that also hands named intermediates to `trace` (the CPU
    /// model's names: `embed`, `blk.L.attn_in`, `blk.L.kda.out` / `blk.L.mla.out`, `blk.L.ffn_in`,
    /// `blk.L.ffn.out`, `output_norm`) as device tensors `[N, width]`.
    pub fn forward_traced(
        &mut self,
        input: Input<'_>,
        lens: &[usize],
        seqs: &mut [&mut CudaSeqState],
        last_only: bool,
        trace: GpuTrace<'_>,
    ) -> Result<Vec<f32>> {
        let step = self.prepare(&input, lens, seqs)?;
        let logits = self.run_traced(&step, &input, last_only, trace)?;
        for (s, &n) in seqs.iter_mut().zip(lens) {
            s.pos += n;
        }
        Ok(match logits {
            Some(l) => l.to_f32_vec()?,
            None => Vec::new(),
        })
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
    /// limit in the error), then makes its rows `[pos, pos + lens[i])` writable: grows its pages
    /// to cover them, and copies (on the stream, before the step) each page it would write that
    /// others read (`device_pages`: a prefix shared inside a page, a rollback into one).
    pub(crate) fn grow(&mut self, seqs: &mut [&mut CudaSeqState], lens: &[usize], limit: usize, what: &str) -> Result<()> {
        for (i, (s, &l)) in seqs.iter_mut().zip(lens).enumerate() {
            if s.pos + l > limit {
                return Err(ModelError::Input(format!("sequence {i}: {} tokens exceed {what}", s.pos + l)));
            }
        }
        for (s, &l) in seqs.iter_mut().zip(lens) {
            let copies = self.free.write(s, s.pos, s.pos + l)?;
            self.copy_pages(&copies)?;
        }
        Ok(())
    }

    /// Copies page `.0` into page `.1` of every MLA/DSA layer's latent and indexer-key pools (on
    /// the compute stream).
    pub(crate) fn copy_pages(&self, copies: &[device_pages::PageCopy]) -> Result<()> {
        for l in &self.layers {
            let Mixer::Mla(m) = &l.mixer else { continue };
            for pool in std::iter::once(&m.cache).chain(m.indexer.as_ref().map(|ix| &ix.key_cache)) {
                let per = pool.byte_len() / pool.shape()[0];
                for &(src, dst) in copies {
                    pool.copy_range(dst as usize * per, pool, src as usize * per, per)?;
                }
            }
        }
        Ok(())
    }

    /// The page pool of this model's MLA/DSA caches (its counts: the GPU runner's admission
    /// budget, the tests).
    pub fn page_pool(&self) -> &device_pages::PagePool {
        &self.free.pages
    }

    /// Pages held by sequences or prefix-cache cells, each counted once.
    pub fn pages_in_use(&self) -> usize {
        self.free.pages_in_use()
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

    /// Every layer on the step; returns the logits tensor F32 `[N or B, vocab]` on the device
    /// (on rank 0 and the ranks of the last pipeline stage; `None` on the others).
    /// Enqueues work only (no host synchronisation) when the input is token ids.
    pub(crate) fn run(&self, step: &Step, input: &Input<'_>, last_only: bool) -> Result<Option<CudaTensor>> {
        self.run_traced(step, input, last_only, None)
    }

    fn run_traced(&self, step: &Step, input: &Input<'_>, last_only: bool, mut trace: GpuTrace<'_>) -> Result<Option<CudaTensor>> {
        let res = self.stage_traced(step, input, &mut trace)?;
        let mut emit = |name: &dyn Fn() -> String, t: &CudaTensor| -> Result<()> {
            if let Some(f) = trace.as_mut() {
                f(&name(), t)?;
            }
            Ok(())
        };
        let (h, n) = (self.config.text.hidden_size, step.n);
        let eps = self.config.text.rms_norm_eps;
        let dev = &self.dev;
        let rows = if last_only { step.lens.len() } else { n };
        let Some(head) = &self.head else {
            res.send(self)?;
            return stage::logits_from_last(self, rows);
        };
        let x = CudaTensor::uninit(dev, self.dtype, vec![n, h])?; // [N, H]
        let srcs: Vec<&CudaTensor> = res.blocks.iter().collect();
        let upd = if res.d.is_some() { ResUpdate::Add } else { ResUpdate::Keep };
        let o = &head.output_attn_res;
        attn_res_norm(&srcs, &res.p, upd, res.d.as_ref(), None, &o.c, o.eps, &head.norm, eps, &x)?;
        emit(&|| "output_norm".into(), &x)?;
        let local = if last_only {
            let last = CudaTensor::uninit(dev, x.dtype(), vec![rows, h])?; // [B, H]
            gather_rows(&x, &step.last_rows, &last)?;
            lin(&last, &head.lm_head, DType::F32)?
        } else {
            lin(&x, &head.lm_head, DType::F32)?
        }; // [rows, V / tp]
        let logits = stage::gather_vocab(self, local)?;
        stage::logits_to_first(self, &logits)?;
        Ok(Some(logits))
    }

    /// This stage's part of the step: the embeddings (or the state the previous stage sends)
    /// through this stage's layers; the residual state after its last layer.
    fn stage_traced(&self, step: &Step, input: &Input<'_>, trace: &mut GpuTrace<'_>) -> Result<stage::Residual> {
        let mut emit = |name: &dyn Fn() -> String, t: &CudaTensor| -> Result<()> {
            if let Some(f) = trace.as_mut() {
                f(&name(), t)?;
            }
            Ok(())
        };
        let (h, n) = (self.config.text.hidden_size, step.n);
        let b = self.config.text.attn_res_block_size;
        let eps = self.config.text.rms_norm_eps;
        let (dev, g) = (&self.dev, &self.groups);
        // The residual state: P starts as the embeddings (or comes from the previous stage).
        let mut res = match &self.embed_tokens {
            Some(table) => {
                let p = CudaTensor::uninit(dev, DType::F32, vec![n, h])?; // [N, H]
                match (input, &step.tokens) {
                    (Input::Tokens(_), Some(ids)) => {
                        // Each rank looks up its vocabulary rows; the sum completes every row.
                        gather_rows_from(table, ids, self.plan.tp_share(self.config.text.vocab_size).start, &p)?;
                        g.tp.all_reduce_sum(&p)?;
                    }
                    (Input::Embeds(e), _) => p.write_bytes(bytemuck::cast_slice(e))?,
                    _ => return Err(ModelError::Internal("token ids missing from the step".into())),
                }
                emit(&|| "embed".into(), &p)?;
                stage::Residual { p, blocks: Vec::new(), d: None }
            }
            None => stage::Residual::recv(self, n)?,
        };
        let x = CudaTensor::uninit(dev, self.dtype, vec![n, h])?; // normed mix, GEMM input (the weights' dtype)
        for layer in &self.layers {
            let l = layer.spec.index;
            let starts = l % b == 0;
            let nb = l.div_ceil(b);
            let snap = if starts { Some(CudaTensor::uninit(dev, DType::F32, vec![n, h])?) } else { None };
            let srcs: Vec<&CudaTensor> = res.blocks[..nb].iter().collect();
            let upd = if res.d.is_some() { ResUpdate::Add } else { ResUpdate::Keep };
            let ar = &layer.self_attention_res;
            attn_res_norm(&srcs, &res.p, upd, res.d.as_ref(), snap.as_ref(), &ar.c, ar.eps, &layer.input_layernorm, eps, &x)?;
            res.blocks.extend(snap);
            emit(&|| format!("blk.{l}.attn_in"), &x)?;
            let a = match &layer.mixer {
                Mixer::Kda(m) => m.forward(&x, step)?,
                Mixer::Mla(m) => m.forward(&x, step)?,
            };
            g.tp.all_reduce_sum(&a)?; // reduction 1: the heads' partial o_proj sums
            emit(&|| format!("blk.{l}.{}.out", if matches!(layer.mixer, Mixer::Kda(_)) { "kda" } else { "mla" }), &a)?;
            let nb2 = nb + usize::from(starts);
            let srcs: Vec<&CudaTensor> = res.blocks[..nb2].iter().collect();
            let upd = if starts { ResUpdate::Assign } else { ResUpdate::Add };
            let mr = &layer.mlp_res;
            attn_res_norm(&srcs, &res.p, upd, Some(&a), None, &mr.c, mr.eps, &layer.post_attention_layernorm, eps, &x)?;
            emit(&|| format!("blk.{l}.ffn_in"), &x)?;
            let out = match &layer.ffn {
                Ffn::Dense(m) => {
                    let o = m.forward(&x)?;
                    g.tp.all_reduce_sum(&o)?; // reduction 2 (dense layer)
                    o
                }
                Ffn::Moe(m) => m.forward(&x, &g.stage)?, // reduction 2 is inside
            };
            emit(&|| format!("blk.{l}.ffn.out"), &out)?;
            res.d = Some(out);
        }
        Ok(res)
    }

    /// Weight bytes one decode token reads (every non-expert matrix, `top_k` routed experts per
    /// MoE layer, one embedding row, the whole `lm_head`): the numerator of decode bandwidth.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let head = self.head.as_ref().map_or(0, |o| o.lm_head.byte_len());
        let embed = self.embed_tokens.as_ref().map_or(0, |e| e.byte_len() / e.shape()[0].max(1));
        let mut total = (head + embed) as u64;
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
