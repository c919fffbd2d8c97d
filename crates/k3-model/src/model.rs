//! The Kimi K3 / K3.1 Pro text model on the CPU: embedding → 93 (or `num_hidden_layers`)
//! decoder layers joined by Block Attention Residuals → output mix → final RMSNorm → untied
//! `lm_head` (text-backbone §2, §6.2, §8). One forward serves full prefill, chunked prefill
//! and decode: it consumes `T` new tokens of one sequence and advances its [`SeqState`].
//!
//! Shapes: tokens `[T]`; stream rows `[T, H]`; logits `[T, vocab]` (or `[1, vocab]` when only the
//! last position is asked for).

use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::kernels::cpu::norm::rms_norm_inplace;

use crate::checkpoint::Checkpoint;
use crate::config::{Config, Ffn as FfnKind, LayerSpec, Mixer as MixerKind};
use crate::error::{ModelError, Result};
use crate::layers::attn_res::AttnRes;
use crate::layers::ffn::Mlp;
use crate::layers::kda::{Kda, KdaMode, KdaState, StateDType};
use crate::layers::mla::{Mla, MlaCache, MlaForm};
use crate::layers::moe::Moe;
use crate::layers::{lin, matrix, vector};
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
        SeqState { layers, pos: 0 }
    }
    /// Bytes held by the caches and states.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| match l { LayerState::Kda(s) => s.bytes(), LayerState::Mla(c) => c.bytes() }).sum()
    }
}

/// How to run one forward call.
#[derive(Clone, Copy, Debug)]
pub struct ForwardOpts {
    pub kda: KdaMode,
    pub mla: MlaForm,
    /// Compute logits only for the last position.
    pub last_only: bool,
}

impl Default for ForwardOpts {
    fn default() -> Self {
        ForwardOpts { kda: KdaMode::Auto, mla: MlaForm::Auto, last_only: false }
    }
}

/// Receives named intermediates (`blk.3.attn_in`, ...) as `[T, width]` f32 rows.
pub type Trace<'a> = Option<&'a mut dyn FnMut(&str, &[f32], usize)>;

pub struct Model {
    pub config: Config,
    pub embed_tokens: Matrix,
    pub layers: Vec<Layer>,
    pub output_attn_res: AttnRes,
    pub norm: Vec<f32>,
    pub lm_head: Matrix,
}

impl Model {
    /// Builds the model from an opened checkpoint (checked against the tensor table first).
    pub fn load(ck: &Checkpoint) -> Result<Model> {
        Self::load_opts(ck, true)
    }

    /// The model as the engine's source of the config and embedding rows beside a GPU model
    /// (`k3 run` / `k3 serve --device cuda`): the same views, but the MXFP4 scale bytes are not
    /// scanned here — the GPU upload checks every one of them as it copies them — so a
    /// memory-mapped checkpoint's scales are read once at start-up, not twice.
    pub fn load_for_gpu(ck: &Checkpoint) -> Result<Model> {
        Self::load_opts(ck, false)
    }

    fn load_opts(ck: &Checkpoint, scan_scales: bool) -> Result<Model> {
        ck.check()?;
        let cfg = ck.config.clone();
        let t = &cfg.text;
        let (h, v, eps) = (t.hidden_size, t.vocab_size, t.rms_norm_eps);
        let layers = cfg
            .layers
            .iter()
            .map(|spec| {
                let l = spec.index;
                let p = layer_prefix(l);
                Ok(Layer {
                    spec: *spec,
                    self_attention_res: AttnRes::load(ck, &format!("{p}self_attention_res"), h, eps)?,
                    input_layernorm: vector(ck, &format!("{p}input_layernorm.weight"), h)?,
                    mixer: match spec.mixer {
                        MixerKind::Kda => Mixer::Kda(Kda::load(ck, &cfg, l)?),
                        MixerKind::Mla => Mixer::Mla(Mla::load(ck, &cfg, l, false)?),
                        MixerKind::Dsa => Mixer::Mla(Mla::load(ck, &cfg, l, true)?),
                    },
                    mlp_res: AttnRes::load(ck, &format!("{p}mlp_res"), h, eps)?,
                    post_attention_layernorm: vector(ck, &format!("{p}post_attention_layernorm.weight"), h)?,
                    ffn: match spec.ffn {
                        FfnKind::Dense => Ffn::Dense(Mlp::load(ck, &format!("{p}mlp."), h, t.intermediate_size, t.activation_situ_beta, t.activation_situ_linear_beta)?),
                        FfnKind::Moe => Ffn::Moe(Moe::load(ck, &cfg, l, scan_scales)?),
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Model {
            embed_tokens: matrix(ck, &format!("{TEXT}embed_tokens.weight"), v, h)?,
            output_attn_res: AttnRes::load(ck, &format!("{TEXT}output_attn_res"), h, eps)?,
            norm: vector(ck, &format!("{TEXT}norm.weight"), h)?,
            lm_head: matrix(ck, LM_HEAD, v, h)?,
            layers,
            config: cfg,
        })
    }

    pub fn new_state(&self) -> SeqState {
        SeqState::new(&self.config)
    }

    /// Embedding rows for `tokens` `[T]` → `[T, H]`; ids out of range are an input error.
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (v, h) = (self.config.text.vocab_size, self.config.text.hidden_size);
        let mut x = vec![0f32; tokens.len() * h];
        for (i, &tok) in tokens.iter().enumerate() {
            if tok as usize >= v {
                return Err(ModelError::Input(format!("token id {tok} at position {i} is outside the vocabulary (vocab_size {v})")));
            }
            self.embed_tokens.decode_rows(tok as usize, 1, &mut x[i * h..(i + 1) * h]);
        }
        Ok(x)
    }

    /// Runs `tokens` through the model, advancing `state`; returns logits `[T, vocab]`
    /// (`[1, vocab]` with `opts.last_only`).
    pub fn forward(&self, tokens: &[u32], state: &mut SeqState, opts: ForwardOpts, trace: Trace<'_>) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens to run".into()));
        }
        let emb = self.embed(tokens)?; // [T, H]
        self.forward_embeds(emb, state, opts, trace)
    }

    /// Like [`Model::forward`] but from input rows `emb` `[T, H]` (token embeddings, possibly with
    /// some rows replaced, e.g. by projected image features at `<|media_pad|>` positions).
    pub fn forward_embeds(&self, emb: Vec<f32>, state: &mut SeqState, opts: ForwardOpts, trace: Trace<'_>) -> Result<Vec<f32>> {
        let h = self.config.text.hidden_size;
        if emb.is_empty() || emb.len() % h != 0 {
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
        let emb = self.embed(&all)?;
        let logits = self.forward_varlen(emb, &lens, states, opts, None)?;
        let v = self.config.text.vocab_size;
        let mut out = Vec::with_capacity(lens.len());
        let mut r0 = 0;
        for &t in &lens {
            let rows = if opts.last_only { 1 } else { t };
            out.push(logits[r0 * v..(r0 + rows) * v].to_vec());
            r0 += rows;
        }
        Ok(out)
    }

    /// The packed forward: `emb` `[N, H]` holds `lens[i]` rows of sequence i.
    pub fn forward_varlen(&self, emb: Vec<f32>, lens: &[usize], states: &mut [&mut SeqState], opts: ForwardOpts, mut trace: Trace<'_>) -> Result<Vec<f32>> {
        let h = self.config.text.hidden_size;
        let t: usize = lens.iter().sum();
        if t == 0 || emb.len() != t * h || lens.len() != states.len() {
            return Err(ModelError::Input(format!("packed input: {} values for {t} rows of hidden_size {h} and {} sequences", emb.len(), states.len())));
        }
        let max = self.config.max_context();
        for (i, (&n, st)) in lens.iter().zip(states.iter()).enumerate() {
            if st.pos + n > max {
                return Err(ModelError::Input(format!("sequence {i}: {} tokens exceed the context limit of {max} (max_position_embeddings)", st.pos + n)));
            }
            if st.layers.len() != self.layers.len() {
                return Err(ModelError::Input(format!("sequence {i}: its state was made for another model ({} layers, this one has {})", st.layers.len(), self.layers.len())));
            }
        }
        let eps = self.config.text.rms_norm_eps;
        let b = self.config.text.attn_res_block_size;
        let mut emit = |name: &str, x: &[f32]| {
            if let Some(f) = trace.as_mut() {
                f(name, x, t);
            }
        };
        emit("embed", &emb);
        // Block AttnRes bookkeeping (§6.2): completed blocks and the running partial sum P.
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        let mut p = emb;
        let mut d: Option<Vec<f32>> = None;
        for layer in &self.layers {
            let l = layer.spec.index;
            if let Some(dd) = d.take() {
                p.iter_mut().zip(&dd).for_each(|(a, b)| *a += b);
            }
            if l % b == 0 {
                blocks.push(p.clone());
            }
            let nb = l.div_ceil(b);
            let mut srcs: Vec<&[f32]> = blocks[..nb].iter().map(Vec::as_slice).collect();
            srcs.push(&p);
            let mut hx = layer.self_attention_res.mix(&srcs, t);
            emit(&format!("blk.{l}.attn_res"), &hx);
            rms_norm_inplace(&mut hx, &layer.input_layernorm, eps);
            emit(&format!("blk.{l}.attn_in"), &hx);
            let mismatch = || ModelError::Input(format!("sequence state does not match layer {l}: it was made for another model"));
            let a = match &layer.mixer {
                Mixer::Kda(m) => {
                    let mut ss = states.iter_mut().map(|s| match &mut s.layers[l] { LayerState::Kda(k) => Ok(k), _ => Err(mismatch()) }).collect::<Result<Vec<_>>>()?;
                    m.forward_varlen(&hx, lens, &mut ss, opts.kda)?
                }
                Mixer::Mla(m) => {
                    let mut ss = states.iter_mut().map(|s| match &mut s.layers[l] { LayerState::Mla(c) => Ok(c), _ => Err(mismatch()) }).collect::<Result<Vec<_>>>()?;
                    m.forward_varlen(&hx, lens, &mut ss, opts.mla)?
                }
            };
            emit(&format!("blk.{l}.{}.out", if matches!(layer.mixer, Mixer::Kda(_)) { "kda" } else { "mla" }), &a);
            if l % b == 0 {
                p = a;
            } else {
                p.iter_mut().zip(&a).for_each(|(x, y)| *x += y);
            }
            let nb2 = nb + usize::from(l % b == 0);
            let mut srcs: Vec<&[f32]> = blocks[..nb2].iter().map(Vec::as_slice).collect();
            srcs.push(&p);
            let mut hf = layer.mlp_res.mix(&srcs, t);
            rms_norm_inplace(&mut hf, &layer.post_attention_layernorm, eps);
            emit(&format!("blk.{l}.ffn_in"), &hf);
            let out = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&hf, t)?,
                Ffn::Moe(m) => m.forward(&hf, t)?,
            };
            emit(&format!("blk.{l}.ffn.out"), &out);
            d = Some(out);
        }
        if let Some(dd) = d.take() {
            p.iter_mut().zip(&dd).for_each(|(a, b)| *a += b);
        }
        let mut srcs: Vec<&[f32]> = blocks.iter().map(Vec::as_slice).collect();
        srcs.push(&p);
        let mut hout = self.output_attn_res.mix(&srcs, t);
        rms_norm_inplace(&mut hout, &self.norm, eps);
        emit("output_norm", &hout);
        for (st, &n) in states.iter_mut().zip(lens) {
            st.pos += n;
        }
        if opts.last_only {
            // The last row of each sequence.
            let mut last = Vec::with_capacity(lens.len() * h);
            let mut r0 = 0;
            for &n in lens {
                r0 += n;
                last.extend_from_slice(&hout[(r0 - 1) * h..r0 * h]);
            }
            lin(&last, lens.len(), &self.lm_head)
        } else {
            lin(&hout, t, &self.lm_head)
        }
    }
}

impl Model {
    /// Weight bytes one decode token reads: every non-expert matrix of every layer, the
    /// `num_experts_per_token` routed experts of each MoE layer (their average size), one
    /// embedding row and the whole `lm_head`. Used to turn decode time into bandwidth.
    pub fn weight_bytes_per_token(&self) -> u64 {
        use crate::layers::moe::Expert;
        let m = |x: &Matrix| x.bytes() as u64;
        let mut total = m(&self.lm_head) + (self.embed_tokens.bytes() / self.embed_tokens.rows().max(1)) as u64;
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
                    let avg = e.experts.iter().map(ex).sum::<u64>() / e.experts.len().max(1) as u64;
                    let sh = e.shared_experts.as_ref().map_or(0, |f| m(&f.gate_proj) + m(&f.up_proj) + m(&f.down_proj));
                    m(&e.gate) + m(&e.routed_expert_down_proj) + m(&e.routed_expert_up_proj) + sh + avg * self.config.text.num_experts_per_token as u64
                }
            };
        }
        total
    }
}
