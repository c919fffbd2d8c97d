//! The serde mirror of `config.json` (text-backbone §1, around-backbone §1.1): [`RawConfig`] and
//! the objects it nests ([`RawTextConfig`], [`LinearAttnConfig`], [`DsaConfig`],
//! [`QuantizationConfig`], [`VisionConfig`]), field names exactly as in the file, unknown keys
//! ignored, defaults where the release omits a key. Nothing here is checked beyond its JSON
//! type: `config/validate.rs` turns a mirror into a [`Config`](super::Config). A type mismatch
//! names its JSON path and the expected type in words ([`from_value`]).

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

/// Deserialises the serde mirror, naming the JSON path and the expected type on a mismatch
/// (`text_config.hidden_size: invalid value: integer `-256`, expected a non-negative integer`).
pub(super) fn from_value<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T> {
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
