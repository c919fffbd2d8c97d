//! The built-in configs: `configs/k3-configs.json` embedded in the binary (`k3`, `k3_1_pro`,
//! `tiny`, `tiny_dsa`), listed by [`builtin_names`] and read as raw `config.json` values by
//! [`builtin_config`] (validate them with [`Config::from_json`](super::Config::from_json)).

use crate::error::{ModelError, Result};

/// `configs/k3-configs.json` (a copy of `shared/spec/k3-configs.json`), embedded in the binary.
pub const BUILTIN_CONFIGS: &str = include_str!("../../configs/k3-configs.json");

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
