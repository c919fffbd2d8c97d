//! The Kimi K3 / K3.1 Pro text model on the CPU: embedding → 93 (or `num_hidden_layers`)
//! decoder layers joined by Block Attention Residuals → output mix → final RMSNorm → untied
//! `lm_head` (text-backbone §2, §6.2, §8). One forward serves full prefill, chunked prefill
//! and decode: it consumes `T` new tokens of one sequence and advances its [`SeqState`].
//!
//! Shapes: tokens `[T]`; stream rows `[T, H]`; logits `[T, vocab]` (or `[1, vocab]` when only the
//! last position is asked for).
//!
//! The same code is one rank of a parallel layout (`parallel.rs`): a rank holds its stage's
//! layers and its shards of them, and the forward makes the layout's collectives — the
//! embedding sum and the two reductions per layer over the tensor-parallel group (the second
//! inside `Moe::forward_in`), the vocabulary gather of the logits, the residual state sent
//! between stages. On one process every group is world 1 and those calls return at once.

use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::kernels::cpu::norm::rms_norm_inplace;

use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn as FfnKind, LayerSpec, Mixer as MixerKind};
use crate::error::{ModelError, Result};
use crate::layers::attn_res::{AttnRes, Residual};
use crate::layers::ffn::Mlp;
use crate::layers::kda::{Kda, KdaMode, KdaState, StateDType};
use crate::layers::mla::{Mla, MlaCache, MlaForm};
use crate::layers::moe::{ExpertSource, Moe};
use crate::layers::mtp::{Mtp, MtpState};
use crate::layers::pages::PageSet;
use crate::layers::{lin, matrix, vector};
use crate::parallel::{Groups, RankPlan};
use crate::source::Source;
use crate::weights::{layer_prefix, LM_HEAD, TEXT};

pub enum Mixer {
    Kda(Kda),
    Mla(Mla),
}

pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

pub struct Layer {
    pub spec: LayerSpec,
    pub self_attention_res: AttnRes,
    pub input_layernorm: Vec<f32>,
    pub mixer: Mixer,
    pub mlp_res: AttnRes,
    pub post_attention_layernorm: Vec<f32>,
    pub ffn: Ffn,
}

/// Per-layer state of one sequence.
#[derive(Clone, Debug)]
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

/// Everything one sequence carries between forward calls.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub layers: Vec<LayerState>,
    /// Tokens consumed so far.
    pub pos: usize,
    /// The MTP draft layer's state, when this sequence drafts with it (`crate::draft`): the
    /// forward then keeps the target's pre-final-norm hidden rows here.
    pub mtp: Option<MtpState>,
}

impl SeqState {
    pub fn new(cfg: &Config) -> Self {
        Self::with_kda_state(cfg, StateDType::F32)
    }

    /// A state whose KDA recurrent states are stored as `dtype` (bf16 is approximate).
    pub fn with_kda_state(cfg: &Config, dtype: StateDType) -> Self {
        let layers = cfg
            .layers
            .iter()
            .map(|l| match l.mixer {
                MixerKind::Kda => LayerState::Kda(KdaState::with_dtype(cfg, dtype)),
                _ => LayerState::Mla(MlaCache::default()),
            })
            .collect();
        SeqState { layers, pos: 0, mtp: None }
    }
    /// This (new, empty) state with its MLA/DSA caches in pages of `rows` rows (the prefix
    /// cache's grid, so that its captures and restores share whole pages: `layers::pages`).
    pub fn with_page_rows(mut self, rows: usize) -> Self {
        for l in &mut self.layers {
            if let LayerState::Mla(c) = l {
                debug_assert!(c.latent.rows() == 0, "pages are sized before the first row");
                *c = MlaCache::with_page_rows(rows);
            }
        }
        self
    }

    /// Bytes this state holds alone: its KDA states and MTP state, and its cache pages that
    /// no prefix-cache pool holds and `seen` has not counted yet (pages shared by several
    /// sequences count once per `seen`; see `layers::pages`).
    pub fn bytes_once(&self, seen: &mut PageSet) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => s.bytes(),
                LayerState::Mla(c) => c.bytes_once(seen),
            })
            .sum();
        layers + self.mtp.as_ref().map_or(0, MtpState::bytes)
    }

    /// Bytes of the caches and states (shared pages included).
    pub fn bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(s) => s.bytes(),
                LayerState::Mla(c) => c.bytes(),
            })
            .sum();
        layers + self.mtp.as_ref().map_or(0, MtpState::bytes)
    }
}

/// How to run one forward call.
#[derive(Clone, Copy, Debug)]
pub struct ForwardOpts {
    pub kda: KdaMode,
    pub mla: MlaForm,
    /// Compute logits only for the last position.
    pub last_only: bool,
    /// On rank 0 of a pipeline layout: return (no logits) once the residual state is sent to
    /// the next stage; the logits then come from [`Model::recv_logits`], so rank 0 can start
    /// the next step while the later stages run this one (the engine's pipelined steps).
    pub defer_logits: bool,
}

impl Default for ForwardOpts {
    fn default() -> Self {
        ForwardOpts { kda: KdaMode::Auto, mla: MlaForm::Auto, last_only: false, defer_logits: false }
    }
}

/// Receives named intermediates (`blk.3.attn_in`, ...) as `[T, width]` f32 rows.
pub type Trace<'a> = Option<&'a mut dyn FnMut(&str, &[f32], usize)>;

/// The output side of the last pipeline stage: the output AttnRes, the final norm and this
/// rank's vocabulary rows of the `lm_head`.
pub struct OutputHead {
    pub output_attn_res: AttnRes,
    pub norm: Vec<f32>,
    pub lm_head: Matrix,
}

/// The model on one rank: the decoder layers of its pipeline stage (global indices kept), its
/// shards of them, and the groups its collectives go to. On a single process it is the whole
/// model and every collective returns at once.
pub struct Model {
    pub config: Config,
    pub plan: RankPlan,
    pub groups: Groups,
    /// This rank's vocabulary rows (`plan.tp_share(vocab_size)`), on the first stage only.
    pub embed_tokens: Option<Matrix>,
    pub layers: Vec<Layer>,
    /// On the last stage only.
    pub head: Option<OutputHead>,
    /// The first MTP draft layer (`num_nextn_predict_layers > 0`), on a one-rank model only.
    pub mtp: Option<Mtp>,
}

impl Model {
    /// Builds the model from an opened checkpoint (checked against the tensor table first).
    pub fn load(ck: &Checkpoint) -> Result<Model> {
        Self::load_rank(ck, RankPlan::single(&ck.config), Groups::single(), true)
    }

    /// The model as the engine's source of the config and embedding rows beside a GPU model
    /// (`k3 run` / `k3 serve --device cuda`): the same views, but the MXFP4 scale bytes are not
    /// scanned here — the GPU upload checks every one of them as it copies them — so a
    /// memory-mapped checkpoint's scales are read once at start-up, not twice.
    pub fn load_for_gpu(ck: &Checkpoint) -> Result<Model> {
        Self::load_rank(ck, RankPlan::single(&ck.config), Groups::single(), false)
    }

    /// The embedding table alone, unsharded (a view of the memory map): no decoder layers, no
    /// output head, world-1 groups. For a caller beside a parallel layout (or a GPU model)
    /// that needs token embeddings, e.g. to splice image features into a prompt's input rows;
    /// [`Model::forward_varlen`] refuses it.
    pub fn load_embedding(ck: &Checkpoint) -> Result<Model> {
        let cfg = ck.config.clone();
        let plan = RankPlan::single(&cfg);
        let (h, v) = (cfg.text.hidden_size, cfg.text.vocab_size);
        let embed_tokens = Some(matrix(&Source::new(ck, plan.clone()), &format!("{TEXT}embed_tokens.weight"), v, h)?);
        Ok(Model { config: cfg, plan, groups: Groups::single(), embed_tokens, layers: Vec::new(), head: None, mtp: None })
    }

    /// One rank's model: only the tensors `plan` gives it are touched (row shards are views of
    /// the memory map, column shards copies). `scan_scales`: check every MXFP4 scale byte now.
    pub fn load_rank(ck: &Checkpoint, plan: RankPlan, groups: Groups, scan_scales: bool) -> Result<Model> {
        Self::load_rank_with(ck, plan, groups, scan_scales, &ExpertSource::default())
    }

    /// The whole model on one rank with its routed experts from `experts` (e.g. read from disk
    /// through an expert cache: `offload::cpu_source`).
    pub fn load_with(ck: &Checkpoint, experts: &ExpertSource) -> Result<Model> {
        Self::load_rank_with(ck, RankPlan::single(&ck.config), Groups::single(), true, experts)
    }

    /// [`Model::load_rank`] with the routed experts from `experts`.
    pub fn load_rank_with(ck: &Checkpoint, plan: RankPlan, groups: Groups, scan_scales: bool, experts: &ExpertSource) -> Result<Model> {
        let cfg = ck.config.clone();
        let src = Source::checked(ck, plan)?;
        let t = &cfg.text;
        let (h, v, eps) = (t.hidden_size, t.vocab_size, t.rms_norm_eps);
        let plan = &src.plan;
        let layers = cfg.layers[plan.layers.clone()]
            .iter()
            .map(|spec| {
                let l = spec.index;
                let p = layer_prefix(l);
                Ok(Layer {
                    spec: *spec,
                    self_attention_res: AttnRes::load(&src, &format!("{p}self_attention_res"), h, eps)?,
                    input_layernorm: vector(&src, &format!("{p}input_layernorm.weight"), h)?,
                    mixer: match spec.mixer {
                        MixerKind::Kda => Mixer::Kda(Kda::load(&src, &cfg, l)?),
                        MixerKind::Mla => Mixer::Mla(Mla::load(&src, &cfg, l, false)?),
                        MixerKind::Dsa => Mixer::Mla(Mla::load(&src, &cfg, l, true)?),
                    },
                    mlp_res: AttnRes::load(&src, &format!("{p}mlp_res"), h, eps)?,
                    post_attention_layernorm: vector(&src, &format!("{p}post_attention_layernorm.weight"), h)?,
                    ffn: match spec.ffn {
                        FfnKind::Dense => {
                            let inter = plan.tp_share(t.intermediate_size).len();
                            Ffn::Dense(Mlp::load(&src, &format!("{p}mlp."), h, inter, t.activation_situ_beta, t.activation_situ_linear_beta)?)
                        }
                        FfnKind::Moe => Ffn::Moe(Moe::load(&src, &cfg, l, scan_scales, experts)?),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let vl = plan.tp_share(v).len();
        let embed_tokens = plan.first_stage().then(|| matrix(&src, &format!("{TEXT}embed_tokens.weight"), vl, h)).transpose()?;
        let head = match plan.last_stage() {
            true => Some(OutputHead {
                output_attn_res: AttnRes::load(&src, &format!("{TEXT}output_attn_res"), h, eps)?,
                norm: vector(&src, &format!("{TEXT}norm.weight"), h)?,
                lm_head: matrix(&src, LM_HEAD, vl, h)?,
            }),
            false => None,
        };
        // Layers 1.. of a checkpoint with several are checked (the table) but not run: chained
        // drafts feed the first one back into itself (around-backbone §5.1; vLLM's rule for
        // more layers is not confirmed for K3).
        let mtp = (cfg.mtp_layers() > 0 && plan.par.world() == 1).then(|| Mtp::load(&src, &cfg, 0)).transpose()?;
        let plan = src.plan.clone();
        Ok(Model { embed_tokens, head, layers, config: cfg, plan, groups, mtp })
    }

    /// The cache the routed experts of some layer are read through (`--experts-on disk`).
    pub fn expert_cache(&self) -> Option<&std::sync::Arc<crate::offload::ExpertCache>> {
        self.layers.iter().find_map(|l| match &l.ffn {
            Ffn::Moe(m) => match &m.routed.weights {
                crate::layers::experts::Weights::Streamed(c) => Some(c),
                _ => None,
            },
            _ => None,
        })
    }

    /// A new, empty sequence state shaped for this rank (its KDA heads, its stage's layers).
    pub fn new_state(&self) -> SeqState {
        self.new_state_with(StateDType::F32)
    }

    /// [`Model::new_state`] with the KDA recurrent states stored as `dtype`.
    pub fn new_state_with(&self, dtype: StateDType) -> SeqState {
        let heads = self.plan.tp_share(self.config.text.linear_attn_config.num_heads).len();
        let layers = self
            .config
            .layers
            .iter()
            .map(|l| match l.mixer {
                MixerKind::Kda => LayerState::Kda(KdaState::with_heads(&self.config, if self.plan.holds_layer(l.index) { heads } else { 0 }, dtype)),
                _ => LayerState::Mla(MlaCache::default()),
            })
            .collect();
        SeqState { layers, pos: 0, mtp: None }
    }

    /// Embedding rows for `tokens` `[T]` → `[T, H]`; ids out of range are an input error. On
    /// a tensor-parallel rank each rank looks up its vocabulary rows and the rows are summed,
    /// so every rank of the group must call it.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (v, h) = (self.config.text.vocab_size, self.config.text.hidden_size);
        let Some(table) = &self.embed_tokens else {
            return Err(ModelError::Input(format!(
                "rank {} (pipeline stage {}) holds no embedding: only the first stage embeds tokens",
                self.plan.rank, self.plan.stage
            )));
        };
        let mine = self.plan.tp_share(v);
        let mut x = vec![0f32; tokens.len() * h];
        for (i, &tok) in tokens.iter().enumerate() {
            if tok as usize >= v {
                return Err(ModelError::Input(format!("token id {tok} at position {i} is outside the vocabulary (vocab_size {v})")));
            }
            if mine.contains(&(tok as usize)) {
                table.decode_rows(tok as usize - mine.start, 1, &mut x[i * h..(i + 1) * h]);
            }
        }
        self.groups.tp.all_reduce_sum(&mut x)?;
        Ok(x)
    }

    /// Runs `tokens` through the model, advancing `state`; returns logits `[T, vocab]`
    /// (`[1, vocab]` with `opts.last_only`).
    pub fn forward(&self, tokens: &[u32], state: &mut SeqState, opts: ForwardOpts, trace: Trace<'_>) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens to run".into()));
        }
        let emb = if self.plan.first_stage() { self.embed(tokens)? } else { Vec::new() }; // [T, H]
        self.forward_varlen(emb, &[tokens.len()], &mut [state], opts, trace)
    }

    /// Like [`Model::forward`] but from input rows `emb` `[T, H]` (token embeddings, possibly with
    /// some rows replaced, e.g. by projected image features at `<|media_pad|>` positions).
    pub fn forward_embeds(&self, emb: Vec<f32>, state: &mut SeqState, opts: ForwardOpts, trace: Trace<'_>) -> Result<Vec<f32>> {
        let h = self.config.text.hidden_size;
        if emb.is_empty() || !emb.len().is_multiple_of(h) {
            return Err(ModelError::Input(format!("input rows: {} values is not a positive multiple of hidden_size {h}", emb.len())));
        }
        let t = emb.len() / h;
        self.forward_varlen(emb, &[t], &mut [state], opts, trace)
    }

    /// One step for several sequences at once: `tokens[i]` are sequence i's new tokens (1 for a
    /// decode step, more for a prefill chunk). Weights are read once for all rows; each
    /// sequence attends over its own state. Returns logits per sequence (`[T_i, vocab]`, or
    /// `[1, vocab]` with `last_only`). Equal to running the sequences one by one.
    pub fn forward_batch(&self, tokens: &[&[u32]], states: &mut [&mut SeqState], opts: ForwardOpts) -> Result<Vec<Vec<f32>>> {
        if tokens.len() != states.len() {
            return Err(ModelError::Input(format!("{} token lists for {} sequence states", tokens.len(), states.len())));
        }
        if let Some(i) = tokens.iter().position(|t| t.is_empty()) {
            return Err(ModelError::Input(format!("sequence {i} of the batch has no tokens")));
        }
        let lens: Vec<usize> = tokens.iter().map(|t| t.len()).collect();
        let all: Vec<u32> = tokens.iter().flat_map(|t| t.iter().copied()).collect();
        let emb = if self.plan.first_stage() { self.embed(&all)? } else { Vec::new() };
        let logits = self.forward_varlen(emb, &lens, states, opts, None)?;
        let v = self.config.text.vocab_size;
        let mut out = Vec::with_capacity(lens.len());
        let mut r0 = 0;
        for &t in &lens {
            let rows = if opts.last_only { 1 } else { t };
            out.push(logits.get(r0 * v..(r0 + rows) * v).map(<[f32]>::to_vec).unwrap_or_default());
            r0 += rows;
        }
        Ok(out)
    }

    /// The packed forward: `emb` `[N, H]` holds `lens[i]` rows of sequence i (on the first
    /// pipeline stage; later stages pass an empty `emb` and receive the residual state from the
    /// stage before). Returns the logits on the ranks of the last stage and on rank 0 (which
    /// samples; unless `opts.defer_logits`), an empty vector on the other ranks.
    pub fn forward_varlen(&self, emb: Vec<f32>, lens: &[usize], states: &mut [&mut SeqState], opts: ForwardOpts, mut trace: Trace<'_>) -> Result<Vec<f32>> {
        let h = self.config.text.hidden_size;
        let t: usize = lens.iter().sum();
        let first = self.plan.first_stage();
        if self.layers.is_empty() {
            return Err(ModelError::Input("this model holds only the embedding table (Model::load_embedding): it has no layers to run".into()));
        }
        if t == 0 || (first && emb.len() != t * h) || lens.len() != states.len() {
            return Err(ModelError::Input(format!("packed input: {} values for {t} rows of hidden_size {h} and {} sequences", emb.len(), states.len())));
        }
        let max = self.config.max_context();
        for (i, (&n, st)) in lens.iter().zip(states.iter()).enumerate() {
            if st.pos + n > max {
                return Err(ModelError::Input(format!("sequence {i}: {} tokens exceed the context limit of {max} (max_position_embeddings)", st.pos + n)));
            }
            if st.layers.len() != self.config.layers.len() {
                return Err(ModelError::Input(format!(
                    "sequence {i}: its state was made for another model ({} layers, this one has {})",
                    st.layers.len(),
                    self.config.layers.len()
                )));
            }
        }
        let eps = self.config.text.rms_norm_eps;
        let b = self.config.text.attn_res_block_size;
        let mut emit = |name: &str, x: &[f32]| {
            if let Some(f) = trace.as_mut() {
                f(name, x, t);
            }
        };
        let (plan, g) = (&self.plan, &self.groups);
        let mut res = if first {
            emit("embed", &emb);
            Residual::new(emb)
        } else {
            Residual::recv(&*g.world, plan.peer_in_stage(plan.stage - 1), t * h)?
        };
        for layer in &self.layers {
            let l = layer.spec.index;
            let mut hx = layer.self_attention_res.mix(&res.mixer_sources(l, b), t);
            emit(&format!("blk.{l}.attn_res"), &hx);
            rms_norm_inplace(&mut hx, &layer.input_layernorm, eps);
            emit(&format!("blk.{l}.attn_in"), &hx);
            let mismatch = || ModelError::Input(format!("sequence state does not match layer {l}: it was made for another model"));
            let mut a = match &layer.mixer {
                Mixer::Kda(m) => {
                    let mut ss = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[l] {
                            LayerState::Kda(k) => Ok(k),
                            _ => Err(mismatch()),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    m.forward_varlen(&hx, lens, &mut ss, opts.kda)?
                }
                Mixer::Mla(m) => {
                    let mut ss = states
                        .iter_mut()
                        .map(|s| match &mut s.layers[l] {
                            LayerState::Mla(c) => Ok(c),
                            _ => Err(mismatch()),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    m.forward_varlen(&hx, lens, &mut ss, opts.mla)?
                }
            };
            g.tp.all_reduce_sum(&mut a)?; // reduction 1: the heads' partial o_proj sums
            emit(&format!("blk.{l}.{}.out", if matches!(layer.mixer, Mixer::Kda(_)) { "kda" } else { "mla" }), &a);
            let mut hf = layer.mlp_res.mix(&res.ffn_sources(l, b, a), t);
            rms_norm_inplace(&mut hf, &layer.post_attention_layernorm, eps);
            emit(&format!("blk.{l}.ffn_in"), &hf);
            let out = match &layer.ffn {
                Ffn::Dense(m) => {
                    let mut o = m.forward(&hf, t)?;
                    g.tp.all_reduce_sum(&mut o)?; // reduction 2 (dense layer)
                    o
                }
                Ffn::Moe(m) => m.forward_in(&hf, t, &*g.stage)?, // reduction 2 is inside
            };
            emit(&format!("blk.{l}.ffn.out"), &out);
            res.pending = Some(out);
        }
        for (st, &n) in states.iter_mut().zip(lens) {
            st.pos += n;
        }
        let Some(head) = &self.head else {
            res.send(&*g.world, plan.peer_in_stage(plan.stage + 1))?;
            // Rank 0 (it samples) gets the logits back from the last stage.
            return if plan.rank == 0 && !opts.defer_logits { self.recv_logits() } else { Ok(Vec::new()) };
        };
        let mut hout = head.output_attn_res.mix(&res.output_sources(), t);
        // The pre-final-norm rows of the sequences that draft with the MTP layer.
        let mut r0 = 0;
        for (st, &n) in states.iter_mut().zip(lens) {
            if let Some(m) = st.mtp.as_mut() {
                if !m.push_hidden(&hout[r0 * h..(r0 + n) * h], st.pos - n) {
                    st.mtp = None; // it no longer follows this sequence: drafting stops for it
                }
            }
            r0 += n;
        }
        rms_norm_inplace(&mut hout, &head.norm, eps);
        emit("output_norm", &hout);
        let rows = if opts.last_only { lens.len() } else { t };
        let x = if opts.last_only {
            // The last row of each sequence.
            let mut last = Vec::with_capacity(lens.len() * h);
            let mut r0 = 0;
            for &n in lens {
                r0 += n;
                last.extend_from_slice(&hout[(r0 - 1) * h..r0 * h]);
            }
            last
        } else {
            hout
        };
        let logits = gather_vocab(g.tp.all_gather(&lin(&x, rows, &head.lm_head)?)?, rows);
        if plan.par.pp > 1 && plan.peer_in_stage(0) == 0 {
            g.world.send(0, &logits)?;
        }
        Ok(logits)
    }

    /// On rank 0 of a pipeline layout: the logits of the oldest step run with
    /// [`ForwardOpts::defer_logits`] (the last stage sends them in step order).
    pub fn recv_logits(&self) -> Result<Vec<f32>> {
        let plan = &self.plan;
        if plan.rank != 0 || plan.par.pp == 1 {
            return Err(ModelError::Input(format!("rank {} of --pp {}: only rank 0 of a pipeline layout receives the logits", plan.rank, plan.par.pp)));
        }
        Ok(self.groups.world.recv(plan.peer_in_stage(plan.par.pp - 1))?)
    }
}

/// Joins the ranks' `[rows, v_r]` logits (vocabulary shards in rank order) into `[rows, V]`.
fn gather_vocab(parts: Vec<Vec<f32>>, rows: usize) -> Vec<f32> {
    if parts.len() == 1 {
        return parts.into_iter().next().unwrap_or_default();
    }
    let widths: Vec<usize> = parts.iter().map(|p| p.len() / rows.max(1)).collect();
    let mut out = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    for r in 0..rows {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p[r * w..(r + 1) * w]);
        }
    }
    out
}

impl Model {
    /// Weight bytes one decode token reads on this rank: every non-expert matrix it holds, its
    /// expected share of the `num_experts_per_token` routed experts of each MoE layer (their
    /// average size), one embedding row and its `lm_head` rows. Used to turn decode time into
    /// bandwidth.
    pub fn weight_bytes_per_token(&self) -> u64 {
        use crate::layers::experts::Weights;
        use crate::layers::moe::Expert;
        let m = |x: &Matrix| x.bytes() as u64;
        let mut total = self.head.as_ref().map_or(0, |o| m(&o.lm_head)) + self.embed_tokens.as_ref().map_or(0, |e| (e.bytes() / e.rows().max(1)) as u64);
        for layer in &self.layers {
            total += match &layer.mixer {
                Mixer::Kda(k) => [&k.q_proj, &k.k_proj, &k.v_proj, &k.b_proj, &k.f_a_proj, &k.f_b_proj, &k.g_proj, &k.o_proj].iter().map(|x| m(x)).sum::<u64>(),
                Mixer::Mla(a) => {
                    let ix = a.indexer.as_ref().map_or(0, |i| m(&i.wq_b) + m(&i.wk) + m(&i.weights_proj));
                    [&a.q_a_proj, &a.q_b_proj, &a.kv_a_proj_with_mqa, &a.kv_b_proj, &a.g_proj, &a.o_proj].iter().map(|x| m(x)).sum::<u64>() + ix
                }
            };
            total += match &layer.ffn {
                Ffn::Dense(f) => m(&f.gate_proj) + m(&f.up_proj) + m(&f.down_proj),
                Ffn::Moe(e) => {
                    let ex = |x: &Expert| m(&x.w1) + m(&x.w2) + m(&x.w3);
                    // The average expert this rank holds, times the share of routed pairs it gets.
                    let held = e.routed.mapped();
                    let avg = match &e.routed.weights {
                        Weights::Mapped(_) => held.iter().map(ex).sum::<u64>() / held.len().max(1) as u64,
                        Weights::Streamed(c) => c.expert_bytes(e.routed.layer, e.routed.first_expert),
                    };
                    let sh = e.shared_experts.as_ref().map_or(0, |f| m(&f.gate_proj) + m(&f.up_proj) + m(&f.down_proj));
                    m(&e.gate)
                        + m(&e.routed_expert_down_proj)
                        + m(&e.routed_expert_up_proj)
                        + sh
                        + avg * self.config.text.num_experts_per_token as u64 * e.routed.count as u64 / self.config.text.num_experts.max(1) as u64
                }
            };
        }
        total
    }
}
