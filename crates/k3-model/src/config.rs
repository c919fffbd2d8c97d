//! `config.json` → validated [`Config`] (text-backbone §1, around-backbone §1.1).
//!
//! Two layers, as candle does it: a serde mirror of the file ([`RawConfig`], [`RawTextConfig`],
//! field names exactly as in `config.json`, unknown keys ignored) and a validated [`Config`]
//! whose invariants every later stage may rely on. Layer lists in the file are 1-based; the
//! validated [`Config::layers`] schedule is 0-based. The release nests `quantization_config`
//! inside `text_config` (read there first, then at the top level). A bare text config (a file
//! whose top level has `hidden_size`) is accepted too.
//!
//! Files: this one holds the validated [`Config`] and its layer schedule ([`LayerSpec`],
//! [`Mixer`], [`Ffn`]); `config/raw.rs` the serde mirror; `config/validate.rs` the checks from
//! the mirror to a [`Config`]; `config/builtin.rs` the configs embedded in the binary
//! ([`builtin_config`]).

use std::path::Path;

use serde::Serialize;

use crate::error::{ModelError, Result};

mod builtin;
mod raw;
mod validate;

pub use builtin::{builtin_config, builtin_names, BUILTIN_CONFIGS};
use raw::from_value;
pub use raw::{DsaConfig, LinearAttnConfig, QuantizationConfig, RawConfig, RawTextConfig, TokenIds, VisionConfig};

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
