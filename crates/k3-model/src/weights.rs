//! Where every tensor comes from: the one table of checkpoint names, shapes and kinds.
//!
//! text-backbone §3 (KDA), §4 (MLA), §5.2 (DSA indexer), §6 (AttnRes), §7 (MoE, dense FFN),
//! §8 (embedding, norm, lm_head); around-backbone §1.3–§1.5 (prefixes, vision tensors) and §2
//! (MXFP4 experts). The loader checks a checkpoint against [`tensor_table`], `k3 init` writes
//! exactly this table, and `k3 inspect` counts parameters from it — so a name lives in one place.
//! Each entry also says how the tensor is split across ranks ([`Split`]); `parallel.rs` turns
//! that into one rank's shard, and `source.rs` cuts it out of the memory map.
//!
//! MTP draft layers (around-backbone §5.1, `num_nextn_predict_layers` = n > 0): layer
//! `N + k` (`N = num_hidden_layers`, k < n) holds `enorm`, `hnorm`, `eh_proj` `[H, 2H]`,
//! `shared_head.{norm,head}` and one decoder layer (gated MLA + the FFN the layer rule gives,
//! no AttnRes), all of [`Component::Mtp`] and held by the last pipeline stage. The optional
//! `layers.{N+k}.embed_tokens.weight` and any `self_attention_res_*` / `mlp_res_*` there are
//! not in the table; the loader tolerates them (`Checkpoint::check_table`) and reads none.

use serde::Serialize;

use crate::config::{Config, Ffn, LayerSpec, Mixer};

/// Prefix of every text-backbone tensor.
pub const TEXT: &str = "language_model.model.";
/// The untied head.
pub const LM_HEAD: &str = "language_model.lm_head.weight";

/// Which part of the model a tensor belongs to (for parameter accounting).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    Embedding,
    Kda,
    Mla,
    DsaIndexer,
    AttnRes,
    LayerNorms,
    DenseFfn,
    MoeRouter,
    MoeLatent,
    SharedExperts,
    RoutedExperts,
    FinalNorm,
    LmHead,
    VisionTower,
    MmProjector,
    /// An MTP draft layer (every tensor of `layers.{N+k}.*`; not part of the target's forward).
    Mtp,
}

/// What the stored bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A float tensor: F32, BF16 or F16 are all accepted.
    Float,
    /// Kept F32 in the release (conv weights, `A_log`, `dt_bias`, `o_norm`, router bias).
    Float32,
    /// MXFP4 `weight_packed` (U8 `[out, in/2]`).
    Mxfp4Packed,
    /// MXFP4 `weight_scale` (U8 `[out, in/32]`).
    Mxfp4Scale,
}

/// How a tensor is divided among the ranks of a pipeline stage (`docs/parallel.md`). Units are
/// whole heads, vocabulary rows, FFN columns or MXFP4 blocks: the partition is over
/// `dim / unit` units by [`k3_core::comm::part`], so sibling tensors cut at the same heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Whole on every rank (norms, AttnRes, the low-rank `a` projections, the router's bias, the
    /// latent up-projection, the DSA indexer).
    Replicated,
    /// Dim 0 over all ranks of the pipeline stage (tensor- and expert-parallel alike), `unit`
    /// rows at a time: the router and the latent down-projection, whose row blocks the MoE
    /// all-gathers (one collective for both) instead of every rank reading them whole.
    StageRows(usize),
    /// Dim 0 over the tensor-parallel ranks, `unit` rows at a time (column-parallel
    /// projections by head, FFN rows, embedding and `lm_head` by vocabulary).
    Rows(usize),
    /// Dim 1 over the tensor-parallel ranks, `unit` columns at a time (the row-parallel
    /// matrices whose partial products are summed: `o_proj`, `down_proj`).
    Cols(usize),
    /// A routed expert's rows: the whole expert on its expert-parallel owner; with `--ep 1`,
    /// dim 0 over the tensor-parallel ranks like [`Split::Rows`].
    ExpertRows(usize),
    /// A routed expert's `w2`: whole on its owner; with `--ep 1`, like [`Split::Cols`].
    ExpertCols(usize),
}

#[derive(Clone, Debug, Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: Kind,
    pub component: Component,
    /// Layer index (0-based) for per-layer tensors.
    pub layer: Option<usize>,
    /// Routed expert id, for expert tensors.
    pub expert: Option<usize>,
    /// How ranks share it.
    pub split: Split,
}

impl TensorSpec {
    /// Logical parameter count (an MXFP4 `weight_packed` counts 2 per byte, scales count 0).
    pub fn params(&self) -> u64 {
        let n: u64 = self.shape.iter().map(|&d| d as u64).product();
        match self.kind {
            Kind::Mxfp4Packed => 2 * n,
            Kind::Mxfp4Scale => 0,
            _ => n,
        }
    }
}

struct Table<'a> {
    out: &'a mut Vec<TensorSpec>,
    layer: Option<usize>,
    expert: Option<usize>,
    /// Every tensor added is [`Component::Mtp`] (an MTP layer's).
    mtp: bool,
}

impl Table<'_> {
    /// A replicated tensor.
    fn add(&mut self, name: String, shape: &[usize], kind: Kind, component: Component) {
        self.split(Split::Replicated, name, shape, kind, component);
    }
    fn split(&mut self, split: Split, name: String, shape: &[usize], kind: Kind, component: Component) {
        let component = if self.mtp { Component::Mtp } else { component };
        self.out.push(TensorSpec { name, shape: shape.to_vec(), kind, component, layer: self.layer, expert: self.expert, split });
    }
}

/// Name prefix of layer `l`'s tensors.
pub fn layer_prefix(l: usize) -> String {
    format!("{TEXT}layers.{l}.")
}

/// Every tensor of the text backbone (and the vision tower when configured), in a stable order.
pub fn tensor_table(cfg: &Config) -> Vec<TensorSpec> {
    let t = &cfg.text;
    let (h, v) = (t.hidden_size, t.vocab_size);
    let mut out = Vec::new();
    let mut tb = Table { out: &mut out, layer: None, expert: None, mtp: false };
    use Component as C;
    use Kind::*;
    tb.split(Split::Rows(1), format!("{TEXT}embed_tokens.weight"), &[v, h], Float, C::Embedding);
    for spec in &cfg.layers {
        tb.layer = Some(spec.index);
        decoder_layer(&mut tb, cfg, spec, true);
    }
    tb.layer = None;
    tb.add(format!("{TEXT}norm.weight"), &[h], Float, C::FinalNorm);
    tb.add(format!("{TEXT}output_attn_res_norm.weight"), &[h], Float, C::AttnRes);
    tb.add(format!("{TEXT}output_attn_res_proj.weight"), &[1, h], Float, C::AttnRes);
    tb.split(Split::Rows(1), LM_HEAD.to_string(), &[v, h], Float, C::LmHead);
    tb.mtp = true;
    for k in 0..cfg.mtp_layers() {
        let spec = cfg.mtp_layer(k);
        let p = layer_prefix(spec.index);
        tb.layer = Some(spec.index);
        tb.add(format!("{p}enorm.weight"), &[h], Float, C::Mtp);
        tb.add(format!("{p}hnorm.weight"), &[h], Float, C::Mtp);
        tb.add(format!("{p}eh_proj.weight"), &[h, 2 * h], Float, C::Mtp);
        decoder_layer(&mut tb, cfg, &spec, false);
        tb.add(format!("{p}shared_head.norm.weight"), &[h], Float, C::Mtp);
        tb.split(Split::Rows(1), format!("{p}shared_head.head.weight"), &[v, h], Float, C::Mtp);
    }
    tb.mtp = false;
    tb.layer = None;
    if let Some(vc) = &cfg.vision_config {
        vision_table(&mut tb, vc, h);
    }
    out
}

/// One decoder layer's tensors (mixer, norms, AttnRes when `attn_res`, FFN).
fn decoder_layer(tb: &mut Table<'_>, cfg: &Config, spec: &LayerSpec, attn_res: bool) {
    use Component as C;
    use Kind::*;
    let t = &cfg.text;
    let h = t.hidden_size;
    let l = spec.index;
    let p = layer_prefix(l);
    let a = format!("{p}self_attn.");
    match spec.mixer {
        Mixer::Kda => {
            let la = &t.linear_attn_config;
            let (nh, hd, k) = (la.num_heads, la.head_dim, la.short_conv_kernel_size);
            let d = nh * hd;
            let head = Split::Rows(hd);
            for x in ["q", "k", "v"] {
                tb.split(head, format!("{a}{x}_proj.weight"), &[d, h], Float, C::Kda);
                tb.split(head, format!("{a}{x}_conv1d.weight"), &[d, 1, k], Float32, C::Kda);
            }
            tb.split(Split::Rows(1), format!("{a}b_proj.weight"), &[nh, h], Float, C::Kda);
            tb.add(format!("{a}f_a_proj.weight"), &[hd, h], Float, C::Kda);
            tb.split(head, format!("{a}f_b_proj.weight"), &[d, hd], Float, C::Kda);
            tb.split(Split::Rows(1), format!("{a}A_log"), &[nh], Float32, C::Kda);
            tb.split(head, format!("{a}dt_bias"), &[d], Float32, C::Kda);
            tb.split(head, format!("{a}g_proj.weight"), &[d, h], Float, C::Kda);
            tb.add(format!("{a}o_norm.weight"), &[hd], Float32, C::Kda);
            tb.split(Split::Cols(hd), format!("{a}o_proj.weight"), &[h, d], Float, C::Kda);
        }
        Mixer::Mla | Mixer::Dsa => {
            let (nh, dn, dr, dv, r) = (t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim, t.kv_lora_rank);
            let q = t.q_lora_rank.unwrap_or(0);
            tb.add(format!("{a}q_a_proj.weight"), &[q, h], Float, C::Mla);
            tb.add(format!("{a}q_a_layernorm.weight"), &[q], Float, C::Mla);
            tb.split(Split::Rows(dn + dr), format!("{a}q_b_proj.weight"), &[nh * (dn + dr), q], Float, C::Mla);
            tb.add(format!("{a}kv_a_proj_with_mqa.weight"), &[r + dr, h], Float, C::Mla);
            tb.add(format!("{a}kv_a_layernorm.weight"), &[r], Float, C::Mla);
            tb.split(Split::Rows(dn + dv), format!("{a}kv_b_proj.weight"), &[nh * (dn + dv), r], Float, C::Mla);
            tb.split(Split::Rows(dv), format!("{a}g_proj.weight"), &[nh * dv, h], Float, C::Mla);
            tb.split(Split::Cols(dv), format!("{a}o_proj.weight"), &[h, nh * dv], Float, C::Mla);
            if spec.mixer == Mixer::Dsa {
                if let Some(d) = &t.dsa_config {
                    let (ih, id) = (d.index_num_heads, d.index_head_dim);
                    tb.add(format!("{a}indexer.wq_b.weight"), &[ih * id, q], Float, C::DsaIndexer);
                    tb.add(format!("{a}indexer.wk.weight"), &[id, h], Float, C::DsaIndexer);
                    tb.add(format!("{a}indexer.k_norm.weight"), &[id], Float, C::DsaIndexer);
                    tb.add(format!("{a}indexer.k_norm.bias"), &[id], Float, C::DsaIndexer);
                    tb.add(format!("{a}indexer.weights_proj.weight"), &[ih, h], Float, C::DsaIndexer);
                }
            }
        }
    }
    tb.add(format!("{p}input_layernorm.weight"), &[h], Float, C::LayerNorms);
    tb.add(format!("{p}post_attention_layernorm.weight"), &[h], Float, C::LayerNorms);
    if attn_res {
        for n in ["self_attention_res", "mlp_res"] {
            tb.add(format!("{p}{n}_norm.weight"), &[h], Float, C::AttnRes);
            tb.add(format!("{p}{n}_proj.weight"), &[1, h], Float, C::AttnRes);
        }
    }
    match spec.ffn {
        Ffn::Dense => {
            let i = t.intermediate_size;
            tb.split(Split::Rows(1), format!("{p}mlp.gate_proj.weight"), &[i, h], Float, C::DenseFfn);
            tb.split(Split::Rows(1), format!("{p}mlp.up_proj.weight"), &[i, h], Float, C::DenseFfn);
            tb.split(Split::Cols(1), format!("{p}mlp.down_proj.weight"), &[h, i], Float, C::DenseFfn);
        }
        Ffn::Moe => {
            let m = format!("{p}block_sparse_moe.");
            let (e, lat, fi) = (t.num_experts, t.routed_expert_hidden_size, t.moe_intermediate_size);
            tb.split(Split::StageRows(1), format!("{m}gate.weight"), &[e, h], Float, C::MoeRouter);
            tb.add(format!("{m}gate.e_score_correction_bias"), &[e], Float32, C::MoeRouter);
            tb.split(Split::StageRows(1), format!("{m}routed_expert_down_proj.weight"), &[lat, h], Float, C::MoeLatent);
            if t.latent_moe_use_norm {
                tb.add(format!("{m}routed_expert_norm.weight"), &[lat], Float, C::MoeLatent);
            }
            tb.add(format!("{m}routed_expert_up_proj.weight"), &[h, lat], Float, C::MoeLatent);
            if t.num_shared_experts > 0 {
                let si = fi * t.num_shared_experts;
                tb.split(Split::Rows(1), format!("{m}shared_experts.gate_proj.weight"), &[si, h], Float, C::SharedExperts);
                tb.split(Split::Rows(1), format!("{m}shared_experts.up_proj.weight"), &[si, h], Float, C::SharedExperts);
                tb.split(Split::Cols(1), format!("{m}shared_experts.down_proj.weight"), &[h, si], Float, C::SharedExperts);
            }
            for ex in 0..e {
                tb.expert = Some(ex);
                // Without EP the intermediate dim is split; MXFP4 cuts at whole 32-value blocks,
                // so w1/w3 rows go 32 at a time to match w2's block columns.
                let mx = cfg.experts_mxfp4();
                let block = if mx { 32 } else { 1 };
                for (w, o, i) in [("w1", fi, lat), ("w3", fi, lat), ("w2", lat, fi)] {
                    let n = format!("{m}experts.{ex}.{w}.");
                    // w2's packed bytes hold two values each: a block is 16 bytes, 1 scale.
                    let (packed, scale) = if w == "w2" {
                        (Split::ExpertCols(if mx { 16 } else { 1 }), Split::ExpertCols(1))
                    } else {
                        (Split::ExpertRows(block), Split::ExpertRows(block))
                    };
                    if mx {
                        tb.split(packed, format!("{n}weight_packed"), &[o, i / 2], Mxfp4Packed, C::RoutedExperts);
                        tb.split(scale, format!("{n}weight_scale"), &[o, i / 32], Mxfp4Scale, C::RoutedExperts);
                    } else {
                        tb.split(packed, format!("{n}weight"), &[o, i], Float, C::RoutedExperts);
                    }
                }
            }
            tb.expert = None;
        }
    }
}

fn vision_table(tb: &mut Table<'_>, vc: &crate::config::VisionConfig, text_hidden: usize) {
    use Component as C;
    let (c, p) = (vc.vt_hidden_size, vc.patch_size);
    let qkv = vc.qkv_hidden_size.unwrap_or(c);
    let (ph, pw) = (vc.init_pos_emb_height.unwrap_or(64), vc.init_pos_emb_width.unwrap_or(64));
    tb.add("vision_tower.patch_embed.proj.weight".into(), &[c, 3, p, p], Kind::Float, C::VisionTower);
    tb.add("vision_tower.patch_embed.pos_emb.weight".into(), &[ph, pw, c], Kind::Float, C::VisionTower);
    for b in 0..vc.vt_num_hidden_layers {
        let n = format!("vision_tower.encoder.blocks.{b}.");
        tb.add(format!("{n}norm0.weight"), &[c], Kind::Float, C::VisionTower);
        tb.add(format!("{n}wqkv.weight"), &[3 * qkv, c], Kind::Float, C::VisionTower);
        tb.add(format!("{n}wo.weight"), &[c, qkv], Kind::Float, C::VisionTower);
        tb.add(format!("{n}norm1.weight"), &[c], Kind::Float, C::VisionTower);
        tb.add(format!("{n}mlp.fc0.weight"), &[vc.vt_intermediate_size, c], Kind::Float, C::VisionTower);
        tb.add(format!("{n}mlp.fc1.weight"), &[c, vc.vt_intermediate_size], Kind::Float, C::VisionTower);
    }
    tb.add("vision_tower.encoder.final_layernorm.weight".into(), &[c], Kind::Float, C::VisionTower);
    let (mk, mk2) = vc.merge_kernel_size.as_ref().map(|m| (m.first().copied().unwrap_or(2), m.get(1).copied().unwrap_or(2))).unwrap_or((2, 2));
    let merged = c * mk * mk2;
    let th = vc.text_hidden_size.unwrap_or(text_hidden);
    tb.add("mm_projector.proj.0.weight".into(), &[merged, merged], Kind::Float, C::MmProjector);
    tb.add("mm_projector.proj.2.weight".into(), &[th, merged], Kind::Float, C::MmProjector);
    tb.add("mm_projector.post_norm.weight".into(), &[th], Kind::Float, C::MmProjector);
}
