//! From the serde mirror to a validated [`Config`] (text-backbone §1, §3–§5, §7;
//! around-backbone §1.1, §2.2): every field the model reads is checked (positive sizes, value
//! ranges, the variants k3rs implements, the 1-based layer lists covering every layer exactly
//! once, DSA and MXFP4 consistency, the vision tower's widths), each error naming the field and
//! the K3 value, then the 0-based layer schedule is built.

use super::{Config, Ffn, LayerSpec, Mixer, QuantizationConfig, RawConfig, RawTextConfig, VisionConfig};
use crate::error::{field, Result};

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

impl Config {
    pub(super) fn validate(raw: RawConfig) -> Result<Config> {
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
}
