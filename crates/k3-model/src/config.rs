//! `config.json` → validated [`Config`] (text-backbone §1, around-backbone §1.1).
//!
//! Two layers, as candle does it: a serde mirror of the file ([`RawConfig`], [`RawTextConfig`],
//! field names exactly as in `config.json`, unknown keys ignored) and a validated [`Config`]
//! whose invariants every later stage may rely on. Layer lists in the file are 1-based; the
//! validated [`Config::layers`] schedule is 0-based. The release nests `quantization_config`
//! inside `text_config` (read there first, then at the top level). A bare text config (a file
//! whose top level has `hidden_size`) is accepted too.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{field, ModelError, Result};

/// `eos_token_id` may be one id or a list.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct LinearAttnConfig {
    pub num_heads: usize,
    pub head_dim: usize,
    pub short_conv_kernel_size: usize,
    #[serde(default)]
    pub use_full_rank_gate: Option<bool>,
    #[serde(default)]
    pub gate_lower_bound: Option<f32>,
    pub kda_layers: Vec<usize>,
    pub full_attn_layers: Vec<usize>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct DsaConfig {
    pub dsa_layers: Vec<usize>,
    pub index_num_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    #[serde(default = "one")]
    pub index_topk_freq: usize,
    #[serde(default)]
    pub index_skip_topk_offset: Option<i64>,
    #[serde(default)]
    pub index_k_norm_type: Option<String>,
}
fn one() -> usize {
    1
}

#[derive(Clone, Debug, Deserialize, Serialize, Default)]
pub struct QuantizationConfig {
    #[serde(default)]
    pub quant_method: Option<String>,
    #[serde(default)]
    pub format: Option<String>,
    #[serde(default)]
    pub ignore: Vec<String>,
    #[serde(default)]
    pub config_groups: Option<serde_json::Value>,
    #[serde(default)]
    pub quantization_status: Option<String>,
}

/// Mirror of `text_config` (model_type `kimi_linear`).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct RawTextConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default = "situ_beta")]
    pub activation_situ_beta: f32,
    #[serde(default = "situ_linear_beta")]
    pub activation_situ_linear_beta: f32,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    #[serde(default)]
    pub mla_use_nope: Option<bool>,
    #[serde(default)]
    pub mla_use_output_gate: Option<bool>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default = "one")]
    pub first_k_dense_replace: usize,
    #[serde(default = "one")]
    pub moe_layer_freq: usize,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    #[serde(default)]
    pub num_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: usize,
    #[serde(default = "yes")]
    pub latent_moe_use_norm: bool,
    #[serde(default)]
    pub moe_router_activation_func: Option<String>,
    #[serde(default = "yes")]
    pub moe_renormalize: bool,
    #[serde(default = "unit")]
    pub routed_scaling_factor: f32,
    #[serde(default)]
    pub use_grouped_topk: Option<bool>,
    #[serde(default)]
    pub num_expert_group: Option<usize>,
    #[serde(default)]
    pub topk_group: Option<usize>,
    #[serde(default)]
    pub topk_method: Option<String>,
    #[serde(default)]
    pub num_nextn_predict_layers: Option<usize>,
    pub attn_res_block_size: usize,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub dtype: Option<String>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    pub linear_attn_config: LinearAttnConfig,
    #[serde(default)]
    pub dsa_config: Option<DsaConfig>,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
}
fn situ_beta() -> f32 {
    4.0
}
fn situ_linear_beta() -> f32 {
    25.0
}
fn default_eps() -> f32 {
    1e-6
}
fn yes() -> bool {
    true
}
fn unit() -> f32 {
    1.0
}

/// Mirror of `vision_config` (around-backbone §1.1, MoonViT3d).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct VisionConfig {
    pub patch_size: usize,
    #[serde(alias = "hidden_size")]
    pub vt_hidden_size: usize,
    #[serde(default)]
    pub mm_hidden_size: Option<usize>,
    pub vt_num_hidden_layers: usize,
    pub vt_num_attention_heads: usize,
    #[serde(default)]
    pub qkv_hidden_size: Option<usize>,
    pub vt_intermediate_size: usize,
    #[serde(default)]
    pub init_pos_emb_height: Option<usize>,
    #[serde(default)]
    pub init_pos_emb_width: Option<usize>,
    #[serde(default)]
    pub init_pos_emb_time: Option<usize>,
    #[serde(default)]
    pub merge_kernel_size: Option<Vec<usize>>,
    #[serde(default)]
    pub text_hidden_size: Option<usize>,
    #[serde(default)]
    pub projector_ln_eps: Option<f32>,
    /// Every other key, kept for the vision crate to read.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Mirror of the top-level `config.json`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct RawConfig {
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    #[serde(default)]
    pub model_type: Option<String>,
    pub text_config: RawTextConfig,
    #[serde(default)]
    pub vision_config: Option<VisionConfig>,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    #[serde(default)]
    pub media_placeholder_token_id: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mixer {
    Kda,
    Mla,
    Dsa,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ffn {
    Dense,
    Moe,
}

/// Head-dimension and width consistency (text-backbone §3–§5, §7; around-backbone §1.1, §2.2).
fn check_dims(t: &RawTextConfig, vision: Option<&VisionConfig>, q: Option<&QuantizationConfig>) -> Result<()> {
    if let Some(kv) = t.num_key_value_heads {
        if kv != t.num_attention_heads {
            return Err(field(
                "text_config.num_key_value_heads",
                format!("is {kv} but num_attention_heads is {}: MLA has one K/V head per query head (no GQA), so they must be equal", t.num_attention_heads),
            ));
        }
    }
    let mxfp4 = q.is_some_and(|q| q.format.as_deref() == Some("mxfp4-pack-quantized") || q.quant_method.as_deref() == Some("mxfp4"));
    if mxfp4 {
        for (f, v) in [("routed_expert_hidden_size", t.routed_expert_hidden_size), ("moe_intermediate_size", t.moe_intermediate_size)] {
            if v % 32 != 0 {
                return Err(field(
                    &format!("text_config.{f}"),
                    format!("is {v}: MXFP4 experts need both expert dimensions to be multiples of 32 (one E8M0 scale per 32 inputs)"),
                ));
            }
        }
    }
    if let Some(v) = vision {
        let heads = v.vt_num_attention_heads;
        let qkv = v.qkv_hidden_size.unwrap_or(v.vt_hidden_size);
        if heads == 0 || qkv % heads != 0 {
            return Err(field(
                "vision_config.qkv_hidden_size",
                format!("{qkv} is not divisible by vt_num_attention_heads {heads}: inconsistent vision head dimension"),
            ));
        }
        if let Some(th) = v.text_hidden_size {
            if th != t.hidden_size {
                return Err(field(
                    "vision_config.text_hidden_size",
                    format!("is {th} but text_config.hidden_size is {}: the projector must output the text width", t.hidden_size),
                ));
            }
        }
        if let Some(mm) = v.mm_hidden_size {
            if mm != v.vt_hidden_size {
                return Err(field("vision_config.mm_hidden_size", format!("is {mm} but vt_hidden_size is {}", v.vt_hidden_size)));
            }
        }
    }
    Ok(())
}

/// Deserialises the serde mirror, naming the JSON path and the expected type on a mismatch
/// (`text_config.hidden_size: invalid value: integer `-256`, expected a non-negative integer`).
fn from_value<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let msg = plain_types(&e.into_inner().to_string());
        match path.as_str() {
            "" | "." => ModelError::Config { path: "config.json".into(), msg: format!("does not match the Kimi K3 schema: {msg}") },
            _ => field(&path, msg),
        }
    })
}

/// serde's Rust type names in an error message, in words.
fn plain_types(msg: &str) -> String {
    let Some((head, ty)) = msg.rsplit_once("expected ") else { return msg.to_owned() };
    let words = match ty {
        "usize" | "u64" => "a non-negative integer",
        "u32" => "a non-negative integer below 2^32",
        "i64" => "an integer",
        "f32" | "f64" => "a number",
        "a boolean" => "true or false",
        "a sequence" => "a list",
        "struct LinearAttnConfig" | "struct DsaConfig" | "struct QuantizationConfig" | "struct VisionConfig" | "struct RawTextConfig" => "an object",
        _ => return msg.to_owned(),
    };
    format!("{head}expected {words} ({ty})")
}

/// Value ranges of the numeric fields the model reads (zero sizes are checked by `positive!`).
fn check_ranges(t: &RawTextConfig, vision: Option<&VisionConfig>) -> Result<()> {
    let pos = |f: &str, v: f32, k3: &str| -> Result<()> {
        if v.is_finite() && v > 0.0 {
            Ok(())
        } else {
            Err(field(f, format!("is {v}; it must be a positive number (K3: {k3})")))
        }
    };
    pos("text_config.rms_norm_eps", t.rms_norm_eps, "1e-5")?;
    pos("text_config.activation_situ_beta", t.activation_situ_beta, "4.0")?;
    pos("text_config.activation_situ_linear_beta", t.activation_situ_linear_beta, "25.0")?;
    pos("text_config.routed_scaling_factor", t.routed_scaling_factor, "1.0")?;
    if t.rms_norm_eps >= 1.0 {
        return Err(field("text_config.rms_norm_eps", format!("is {}; an epsilon must be small (K3: 1e-5)", t.rms_norm_eps)));
    }
    if t.max_position_embeddings == Some(0) {
        return Err(field("text_config.max_position_embeddings", "is 0; the context must hold at least one token (K3: 1048576)"));
    }
    if let Some(g) = t.linear_attn_config.gate_lower_bound {
        if !(g.is_finite() && g < 0.0) {
            return Err(field(
                "text_config.linear_attn_config.gate_lower_bound",
                format!("is {g}; the decay gate's lower bound must be a negative number (K3: -5.0)"),
            ));
        }
    }
    if let Some(v) = vision {
        for (f, n) in [
            ("patch_size", v.patch_size),
            ("vt_hidden_size", v.vt_hidden_size),
            ("vt_num_hidden_layers", v.vt_num_hidden_layers),
            ("vt_num_attention_heads", v.vt_num_attention_heads),
            ("vt_intermediate_size", v.vt_intermediate_size),
        ] {
            if n == 0 {
                return Err(field(&format!("vision_config.{f}"), "must be > 0"));
            }
        }
        for (f, n) in [("init_pos_emb_height", v.init_pos_emb_height), ("init_pos_emb_width", v.init_pos_emb_width), ("init_pos_emb_time", v.init_pos_emb_time)]
        {
            if n == Some(0) {
                return Err(field(&format!("vision_config.{f}"), "must be > 0"));
            }
        }
        if let Some(k) = &v.merge_kernel_size {
            if k.len() != 2 || k.contains(&0) {
                return Err(field("vision_config.merge_kernel_size", format!("is {k:?}; it must be two positive sizes, e.g. [2, 2]")));
            }
        }
        if let Some(e) = v.projector_ln_eps {
            pos("vision_config.projector_ln_eps", e, "1e-5")?;
        }
    }
    Ok(())
}

/// One decoder layer's kinds (0-based `index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LayerSpec {
    pub index: usize,
    pub mixer: Mixer,
    pub ffn: Ffn,
    /// True when this layer's attention input closes an AttnRes block (`index % B == 0`).
    pub attn_res_block_start: bool,
}

/// The validated model config. Text fields keep `config.json`'s names.
#[derive(Clone, Debug)]
pub struct Config {
    pub text: RawTextConfig,
    pub vision_config: Option<VisionConfig>,
    /// From `text_config.quantization_config`, else the top level.
    pub quantization_config: Option<QuantizationConfig>,
    /// Stop ids: top-level `eos_token_id`, else the text config's.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub media_placeholder_token_id: Option<u32>,
    pub layers: Vec<LayerSpec>,
}

impl Config {
    /// Reads and validates a `config.json` (nested release schema or bare text config).
    pub fn from_file(path: &Path) -> Result<Config> {
        let s = std::fs::read_to_string(path).map_err(|e| ModelError::Config {
            path: path.display().to_string(),
            msg: format!("cannot read it ({e}); a model directory must contain config.json"),
        })?;
        Self::from_json_str(&s).map_err(|e| match e {
            ModelError::Config { msg, .. } => ModelError::Config { path: path.display().to_string(), msg },
            ModelError::Field { field, msg } => ModelError::Config { path: path.display().to_string(), msg: format!("field `{field}`: {msg}") },
            e => e,
        })
    }

    pub fn from_json_str(s: &str) -> Result<Config> {
        let v: serde_json::Value =
            serde_json::from_str(s).map_err(|e| ModelError::Config { path: "config.json".into(), msg: format!("not valid JSON: {e}") })?;
        Self::from_json(v)
    }

    pub fn from_json(v: serde_json::Value) -> Result<Config> {
        let raw: RawConfig = if v.get("text_config").is_some() {
            from_value(v)?
        } else if v.get("hidden_size").is_some() {
            let text: RawTextConfig = from_value(v)?;
            RawConfig {
                architectures: None,
                model_type: None,
                vision_config: None,
                quantization_config: None,
                bos_token_id: text.bos_token_id,
                eos_token_id: text.eos_token_id.clone(),
                pad_token_id: text.pad_token_id,
                media_placeholder_token_id: None,
                text_config: text,
            }
        } else {
            return Err(ModelError::Config { path: "config.json".into(), msg: "has neither `text_config` nor `hidden_size`: not a Kimi K3 config".into() });
        };
        Self::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Config> {
        let t = raw.text_config;
        let n = t.num_hidden_layers;
        if let Some(mt) = &t.model_type {
            if mt != "kimi_linear" {
                return Err(field("text_config.model_type", format!("is `{mt}`; k3rs runs `kimi_linear` (the Kimi K3 text stack)")));
            }
        }
        macro_rules! positive {
            ($($f:ident),*) => {$(
                if t.$f == 0 { return Err(field(concat!("text_config.", stringify!($f)), "must be > 0")); }
            )*};
        }
        positive!(
            vocab_size,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            kv_lora_rank,
            qk_nope_head_dim,
            v_head_dim,
            attn_res_block_size,
            num_experts,
            num_experts_per_token,
            moe_intermediate_size,
            routed_expert_hidden_size,
            intermediate_size
        );
        check_ranges(&t, raw.vision_config.as_ref())?;
        if t.q_lora_rank.unwrap_or(0) == 0 {
            return Err(field("text_config.q_lora_rank", "must be set and > 0 (K3's MLA has a low-rank q path)"));
        }
        match t.hidden_act.as_deref() {
            Some("situ") | None => {}
            Some(a) => return Err(field("text_config.hidden_act", format!("`{a}` is unsupported: Kimi K3 uses `situ` (SiTU-GLU)"))),
        }
        if t.mla_use_nope == Some(false) {
            return Err(field("text_config.mla_use_nope", "false (RoPE MLA) is unsupported: Kimi K3 uses NoPE MLA (`mla_use_nope: true`)"));
        }
        if t.mla_use_output_gate == Some(false) {
            return Err(field("text_config.mla_use_output_gate", "false is unsupported: Kimi K3's MLA has a sigmoid output gate"));
        }
        if t.num_experts_per_token > t.num_experts {
            return Err(field("text_config.num_experts_per_token", format!("{} > num_experts {}", t.num_experts_per_token, t.num_experts)));
        }
        if let Some(a) = &t.moe_router_activation_func {
            if a != "sigmoid" {
                return Err(field("text_config.moe_router_activation_func", format!("`{a}` is unsupported: Kimi K3's router is `sigmoid`")));
            }
        }
        if let Some(m) = &t.topk_method {
            if m != "noaux_tc" {
                return Err(field("text_config.topk_method", format!("`{m}` is unsupported: Kimi K3 uses `noaux_tc`")));
            }
        }
        if t.num_expert_group.unwrap_or(1) != 1 || t.topk_group.unwrap_or(1) != 1 {
            return Err(field("text_config.num_expert_group", "grouped expert selection (num_expert_group/topk_group ≠ 1) is unsupported: K3 uses 1 and 1"));
        }
        if t.moe_layer_freq == 0 {
            return Err(field("text_config.moe_layer_freq", "must be ≥ 1"));
        }
        if t.tie_word_embeddings == Some(true) {
            return Err(field("text_config.tie_word_embeddings", "true is unsupported: K3 has an untied lm_head"));
        }
        let la = &t.linear_attn_config;
        if la.num_heads == 0 || la.head_dim == 0 {
            return Err(field("text_config.linear_attn_config.num_heads", "num_heads and head_dim must be > 0"));
        }
        if la.short_conv_kernel_size == 0 {
            return Err(field("text_config.linear_attn_config.short_conv_kernel_size", "must be ≥ 1"));
        }
        if la.use_full_rank_gate == Some(false) {
            return Err(field("text_config.linear_attn_config.use_full_rank_gate", "false is unsupported: K3's KDA output gate is a full-rank Linear"));
        }
        if la.gate_lower_bound.is_none() {
            return Err(field(
                "text_config.linear_attn_config.gate_lower_bound",
                "is missing: k3rs implements K3's lower-bounded decay gate (gate_lower_bound = -5.0); the unbounded Kimi-Linear-48B gate is not supported",
            ));
        }
        // Layer lists: 1-based, together covering 1..=n exactly once.
        let mut owner = vec![0u8; n];
        for (name, list, tag) in [("kda_layers", &la.kda_layers, 1u8), ("full_attn_layers", &la.full_attn_layers, 2u8)] {
            for &l in list.iter() {
                let f = format!("text_config.linear_attn_config.{name}");
                if l == 0 || l > n {
                    return Err(field(&f, format!("entry {l} is outside 1..={n} (the lists are 1-based layer numbers)")));
                }
                if owner[l - 1] != 0 {
                    return Err(field(&f, format!("layer {l} is listed twice (in kda_layers and full_attn_layers, or twice in one list)")));
                }
                owner[l - 1] = tag;
            }
        }
        if let Some(missing) = owner.iter().position(|&o| o == 0) {
            return Err(field(
                "text_config.linear_attn_config",
                format!("layer {} (1-based) is in neither kda_layers nor full_attn_layers; together they must cover 1..={n} exactly once", missing + 1),
            ));
        }
        if let Some(d) = &t.dsa_config {
            let mut a = d.dsa_layers.clone();
            let mut b = la.full_attn_layers.clone();
            a.sort_unstable();
            b.sort_unstable();
            if a != b {
                return Err(field(
                    "text_config.dsa_config.dsa_layers",
                    format!(
                        "{:?} differs from linear_attn_config.full_attn_layers {:?}; K3.1 makes every full-attention layer DSA",
                        d.dsa_layers, la.full_attn_layers
                    ),
                ));
            }
            if d.index_topk_freq != 1 {
                return Err(field(
                    "text_config.dsa_config.index_topk_freq",
                    format!("is {}; only 1 (every DSA layer runs its own indexer) is supported, as in vLLM and SGLang", d.index_topk_freq),
                ));
            }
            match d.index_k_norm_type.as_deref() {
                Some("layernorm") | None => {}
                Some(o) => return Err(field("text_config.dsa_config.index_k_norm_type", format!("`{o}` is unsupported: K3.1 uses `layernorm`"))),
            }
            if d.index_num_heads == 0 || d.index_head_dim == 0 || d.index_topk == 0 {
                return Err(field("text_config.dsa_config.index_num_heads", "index_num_heads, index_head_dim and index_topk must be > 0"));
            }
        }
        let quantization_config = t.quantization_config.clone().or(raw.quantization_config);
        if let Some(q) = &quantization_config {
            if let Some(f) = &q.format {
                if f != "mxfp4-pack-quantized" {
                    return Err(field(
                        "text_config.quantization_config.format",
                        format!("`{f}` is unsupported: k3rs reads `mxfp4-pack-quantized` routed experts"),
                    ));
                }
            }
        }
        check_dims(&t, raw.vision_config.as_ref(), quantization_config.as_ref())?;
        let b = t.attn_res_block_size;
        let dsa = t.dsa_config.is_some();
        let layers = (0..n)
            .map(|l| LayerSpec {
                index: l,
                mixer: if owner[l] == 1 {
                    Mixer::Kda
                } else if dsa {
                    Mixer::Dsa
                } else {
                    Mixer::Mla
                },
                ffn: if l >= t.first_k_dense_replace && l % t.moe_layer_freq == 0 { Ffn::Moe } else { Ffn::Dense },
                attn_res_block_start: l % b == 0,
            })
            .collect();
        let eos_token_ids = raw.eos_token_id.or(t.eos_token_id.clone()).map(|e| e.to_vec()).unwrap_or_default();
        Ok(Config {
            bos_token_id: raw.bos_token_id.or(t.bos_token_id),
            media_placeholder_token_id: raw.media_placeholder_token_id,
            vision_config: raw.vision_config,
            quantization_config,
            eos_token_ids,
            layers,
            text: t,
        })
    }

    /// Routed experts are stored as MXFP4 `weight_packed`/`weight_scale`.
    pub fn experts_mxfp4(&self) -> bool {
        self.quantization_config.as_ref().is_some_and(|q| q.format.as_deref() == Some("mxfp4-pack-quantized") || q.quant_method.as_deref() == Some("mxfp4"))
    }
    pub fn is_dsa(&self) -> bool {
        self.text.dsa_config.is_some()
    }
    /// KDA projection width `num_heads · head_dim`.
    pub fn kda_dim(&self) -> usize {
        self.text.linear_attn_config.num_heads * self.text.linear_attn_config.head_dim
    }
    /// Number of AttnRes blocks written (`ceil(num_hidden_layers / B)`).
    pub fn attn_res_blocks(&self) -> usize {
        self.text.num_hidden_layers.div_ceil(self.text.attn_res_block_size)
    }
    /// MTP draft layers (`num_nextn_predict_layers`; K3: 0). Their tensors sit at
    /// `layers.{num_hidden_layers + k}.*` (around-backbone §5.1).
    pub fn mtp_layers(&self) -> usize {
        self.text.num_nextn_predict_layers.unwrap_or(0)
    }
    /// The decoder layer of MTP layer `k` (0-based): checkpoint index `num_hidden_layers + k`,
    /// always gated MLA (vLLM builds it as a full-attention layer; no DSA indexer), its FFN by
    /// the same rule as the backbone's (`first_k_dense_replace`, `moe_layer_freq`), no AttnRes
    /// (`attn_res_block_start` is unused there).
    pub fn mtp_layer(&self, k: usize) -> LayerSpec {
        let (t, l) = (&self.text, self.text.num_hidden_layers + k);
        let ffn = if l >= t.first_k_dense_replace && l % t.moe_layer_freq == 0 { Ffn::Moe } else { Ffn::Dense };
        LayerSpec { index: l, mixer: Mixer::Mla, ffn, attn_res_block_start: false }
    }
    /// Context limit (`max_position_embeddings`, K3: 1,048,576).
    pub fn max_context(&self) -> usize {
        self.text.max_position_embeddings.unwrap_or(1 << 20)
    }
}

/// `configs/k3-configs.json` (a copy of `shared/spec/k3-configs.json`), embedded in the binary.
pub const BUILTIN_CONFIGS: &str = include_str!("../configs/k3-configs.json");

/// Names of the built-in configs (`k3`, `k3_1_pro`, `tiny`, `tiny_dsa`; keys starting with `_`
/// are notes, not configs).
pub fn builtin_names() -> Vec<String> {
    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(BUILTIN_CONFIGS)
        .map(|m| m.keys().filter(|k| !k.starts_with('_')).cloned().collect())
        .unwrap_or_default()
}

/// The built-in config `name` as raw JSON (notes — keys starting with `_` — removed).
pub fn builtin_config(name: &str) -> Result<serde_json::Value> {
    let all: serde_json::Map<String, serde_json::Value> = serde_json::from_str(BUILTIN_CONFIGS)
        .map_err(|e| ModelError::Config { path: "configs/k3-configs.json".into(), msg: format!("embedded file is not valid JSON: {e}") })?;
    match all.get(name) {
        Some(serde_json::Value::Object(m)) if !name.starts_with('_') => {
            Ok(serde_json::Value::Object(m.iter().filter(|(k, _)| !k.starts_with('_')).map(|(k, v)| (k.clone(), v.clone())).collect()))
        }
        _ => Err(ModelError::Config {
            path: name.into(),
            msg: format!("is neither a file nor a built-in config name (built-in: {})", builtin_names().join(", ")),
        }),
    }
}
