//! `k3 init`: random-weight checkpoints in the release format — around-backbone §1.1–§1.5
//! (nested `config.json`, names, prefixes, shards `model-0000N-of-0000M.safetensors` + index,
//! F32 tensors) and §2.2 (MXFP4 `weight_packed`/`weight_scale`); value ranges follow the golden
//! fixtures' recipe (golden/README.md: weights N(0, 1/fan_in), logit std ≈ 1).
//!
//! Every tensor of [`crate::weights::tensor_table`] is written, in the dtype the release uses for it:
//! float tensors in `--dtype` (F32 or BF16), the release's F32 tensors always F32, routed experts
//! as float or MXFP4 (normal weights quantised per 32-block, so scale bytes land around 2^-7 like
//! the release's 112..122). `A_log` is written `[num_heads]` (unpadded, as the fixtures do).
//!
//! Output is streamed: the safetensors header is computed from the known shapes, then the data
//! is generated chunk by chunk (each chunk from its own seeded RNG, so the bytes depend only on
//! the seed and the tensor name, not on threads or shard layout) and written through a buffer.
//! Memory use is a few chunks, whatever the checkpoint size. Everything goes to a temporary
//! directory beside `--out`, renamed into place only when complete; on error it is removed.

use std::io::Write;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use k3_core::DType;
use serde_json::{json, Value};

use crate::config::{builtin_config, Config};
use crate::error::{ModelError, Result};
pub use crate::init_data::{e2m1_code, quantize_block};
use crate::init_data::{forget_kept_scales, plan, stream, Planned};

/// Float storage for the trunk (and for unquantised experts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDType {
    F32,
    BF16,
}

impl FloatDType {
    pub(crate) fn dtype(self) -> DType {
        match self {
            FloatDType::F32 => DType::F32,
            FloatDType::BF16 => DType::BF16,
        }
    }
    fn config_name(self) -> &'static str {
        match self {
            FloatDType::F32 => "float32",
            FloatDType::BF16 => "bfloat16",
        }
    }
}

/// How routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertFormat {
    Float(FloatDType),
    /// compressed-tensors `mxfp4-pack-quantized` (and `quantization_config` in `text_config`).
    Mxfp4,
}

#[derive(Clone, Debug)]
pub struct InitOptions {
    pub seed: u64,
    pub dtype: FloatDType,
    pub experts: ExpertFormat,
    /// Start a new shard before a tensor that would take a shard past this many bytes
    /// (writes `model.safetensors.index.json`); `None` writes one `model.safetensors`.
    pub shard_size: Option<u64>,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions { seed: 0, dtype: FloatDType::BF16, experts: ExpertFormat::Float(FloatDType::BF16), shard_size: None }
    }
}

/// Changes to the source config, for "real width, few layers" checkpoints.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// New layer count; the first N layers keep their kinds, and when that leaves no
    /// full-attention layer although the source has some, the last layer becomes one (as K3's
    /// layer 93). `dsa_layers` follows `full_attn_layers`.
    pub num_hidden_layers: Option<usize>,
    /// New expert count; `num_experts_per_token` is capped at it.
    pub num_experts: Option<usize>,
    /// Any other `text_config` field: `(dotted.key, value)`, applied last.
    pub set: Vec<(String, Value)>,
}

/// What [`init`] wrote.
#[derive(Clone, Debug)]
pub struct InitSummary {
    pub dir: PathBuf,
    pub tensors: usize,
    /// Weight files, in order (`model.safetensors` or the shards).
    pub files: Vec<String>,
    /// Bytes of tensor data.
    pub data_bytes: u64,
}

fn cfg_err(msg: impl Into<String>) -> ModelError {
    ModelError::Config { path: "k3 init --config".into(), msg: msg.into() }
}

/// Reads `--config`: a path to a `config.json`, or a built-in name (`k3`, `k3_1_pro`, ...).
pub fn load_source_config(arg: &str) -> Result<Value> {
    let p = Path::new(arg);
    if p.is_file() {
        let s = std::fs::read_to_string(p).map_err(|e| ModelError::Io { path: arg.into(), source: e })?;
        return serde_json::from_str(&s).map_err(|e| ModelError::Config { path: arg.into(), msg: format!("not valid JSON: {e}") });
    }
    builtin_config(arg)
}

/// Builds the nested release-schema `config.json` the checkpoint will carry: overrides applied,
/// `quantization_config` set (MXFP4) or cleared, `dtype` set; validated.
pub fn prepare_config(source: Value, ov: &Overrides, opts: &InitOptions) -> Result<Value> {
    let Value::Object(src) = source else { return Err(cfg_err("the config is not a JSON object")) };
    let src: serde_json::Map<String, Value> = src.into_iter().filter(|(k, _)| !k.starts_with('_')).collect();
    let mut top = if src.contains_key("text_config") {
        src
    } else {
        let mut m = serde_json::Map::new();
        m.insert("architectures".into(), json!(["KimiK3ForConditionalGeneration"]));
        m.insert("model_type".into(), json!("kimi_k3"));
        for k in ["bos_token_id", "eos_token_id", "pad_token_id"] {
            if let Some(v) = src.get(k) {
                m.insert(k.into(), v.clone());
            }
        }
        m.insert("tie_word_embeddings".into(), json!(false));
        m.insert("text_config".into(), Value::Object(src));
        m
    };
    top.remove("quantization_config");
    let dtype = opts.dtype.config_name();
    top.insert("dtype".into(), json!(dtype));
    if top.contains_key("torch_dtype") {
        top.insert("torch_dtype".into(), json!(dtype));
    }
    let Some(Value::Object(t)) = top.get_mut("text_config") else { return Err(cfg_err("`text_config` is not an object")) };
    t.insert("dtype".into(), json!(dtype));
    if t.contains_key("torch_dtype") {
        t.insert("torch_dtype".into(), json!(dtype));
    }
    if let Some(n) = ov.num_hidden_layers {
        relayer(t, n)?;
    }
    if let Some(e) = ov.num_experts {
        t.insert("num_experts".into(), json!(e));
        let k = t.get("num_experts_per_token").and_then(Value::as_u64).unwrap_or(1).min(e as u64);
        t.insert("num_experts_per_token".into(), json!(k));
    }
    let known = known_keys(t);
    for (key, v) in &ov.set {
        check_key(&known, key)?;
        set_dotted(t, key, v.clone())?;
    }
    let q = match opts.experts {
        ExpertFormat::Mxfp4 => builtin_config("k3")?
            .get("text_config")
            .and_then(|t| t.get("quantization_config"))
            .cloned()
            .ok_or_else(|| cfg_err("built-in k3 config has no quantization_config"))?,
        ExpertFormat::Float(_) => Value::Null,
    };
    t.insert("quantization_config".into(), q);
    let out = Value::Object(top);
    Config::from_json(out.clone())?;
    Ok(out)
}

fn layer_list(t: &serde_json::Map<String, Value>, key: &str) -> Vec<u64> {
    t.get("linear_attn_config").and_then(|l| l.get(key)).and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

fn relayer(t: &mut serde_json::Map<String, Value>, n: usize) -> Result<()> {
    if n == 0 {
        return Err(cfg_err("--num-hidden-layers must be ≥ 1"));
    }
    let full_old = layer_list(t, "full_attn_layers");
    let mut full: Vec<u64> = (1..=n as u64).filter(|l| full_old.contains(l)).collect();
    if full.is_empty() && !full_old.is_empty() && n >= 2 {
        full.push(n as u64);
    }
    let kda: Vec<u64> = (1..=n as u64).filter(|l| !full.contains(l)).collect();
    t.insert("num_hidden_layers".into(), json!(n));
    let la = t.get_mut("linear_attn_config").and_then(Value::as_object_mut).ok_or_else(|| cfg_err("text_config.linear_attn_config is missing"))?;
    la.insert("kda_layers".into(), json!(kda));
    la.insert("full_attn_layers".into(), json!(full.clone()));
    if let Some(d) = t.get_mut("dsa_config").and_then(Value::as_object_mut) {
        d.insert("dsa_layers".into(), json!(full));
    }
    Ok(())
}

/// Every `text_config` key k3rs reads, dotted (`linear_attn_config.num_heads`): the serde
/// mirror of the built-in K3 and K3.1 Pro configs (every field, `null` when unset), plus the keys
/// already in the source config.
fn known_keys(t: &serde_json::Map<String, Value>) -> Vec<String> {
    fn walk(v: &Value, prefix: &str, out: &mut Vec<String>) {
        if let Value::Object(m) = v {
            for (k, x) in m {
                let p = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                walk(x, &p, out);
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for name in ["k3", "k3_1_pro"] {
        if let Some(text) = builtin_config(name).and_then(Config::from_json).ok().and_then(|c| serde_json::to_value(&c.text).ok()) {
            walk(&text, "", &mut out);
        }
    }
    walk(&Value::Object(t.clone()), "", &mut out);
    out.sort();
    out.dedup();
    out
}

/// Refuses a `--set` key that is no `text_config` field, suggesting the nearest one.
fn check_key(known: &[String], key: &str) -> Result<()> {
    if known.iter().any(|k| k == key) {
        return Ok(());
    }
    let near = known.iter().min_by_key(|k| edit_distance(k, key)).filter(|k| edit_distance(k, key) <= 3.max(key.len() / 3));
    let hint = match near {
        Some(k) => format!("did you mean `{k}`?"),
        None => "keys are text_config fields, dotted for nested ones (e.g. vocab_size, linear_attn_config.num_heads)".into(),
    };
    Err(cfg_err(format!("--set `{key}`: text_config has no field `{key}`; {hint}")))
}

/// Levenshtein distance (bytes).
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for j in 0..b.len() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != b[j])).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

fn set_dotted(t: &mut serde_json::Map<String, Value>, key: &str, v: Value) -> Result<()> {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().filter(|s| !s.is_empty()).ok_or_else(|| cfg_err(format!("--set `{key}`: empty key")))?;
    let mut cur = t;
    for p in parts {
        cur = cur.entry(p.to_string()).or_insert_with(|| json!({})).as_object_mut().ok_or_else(|| cfg_err(format!("--set `{key}`: `{p}` is not an object")))?;
    }
    cur.insert(last.to_string(), v);
    Ok(())
}

/// Prepares the config and writes the checkpoint to `out` (atomically).
pub fn init(source: Value, ov: &Overrides, out: &Path, opts: &InitOptions) -> Result<InitSummary> {
    let cfg_json = prepare_config(source, ov, opts)?;
    write_checkpoint(&cfg_json, out, opts)
}

// ---------------------------------------------------------------------------------------------
// Files

/// Removes the temporary directory unless the write completed.
struct TempDir {
    path: PathBuf,
    keep: bool,
}
impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |e| ModelError::Io { path: path.display().to_string(), source: e }
}

fn pretty(v: &Value) -> Result<Vec<u8>> {
    serde_json::to_vec_pretty(v).map_err(|e| ModelError::Internal(format!("cannot serialise JSON: {e}")))
}

/// The safetensors header for `tensors` laid out in this order (padded to 8 bytes).
fn header(tensors: &[&Planned]) -> Result<Vec<u8>> {
    let mut m = serde_json::Map::new();
    m.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut off = 0u64;
    for t in tensors {
        m.insert(t.name.clone(), json!({"dtype": t.dtype.safetensors_name(), "shape": t.shape, "data_offsets": [off, off + t.bytes]}));
        off += t.bytes;
    }
    let mut s = serde_json::to_vec(&Value::Object(m)).map_err(|e| ModelError::Internal(format!("cannot serialise a safetensors header: {e}")))?;
    while (8 + s.len()) % 8 != 0 {
        s.push(b' ');
    }
    Ok(s)
}

fn write_file(path: &Path, tensors: &[&Planned], pb: &ProgressBar) -> Result<()> {
    let f = std::fs::File::create(path).map_err(io(path))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    let h = header(tensors)?;
    w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io(path))?;
    w.write_all(&h).map_err(io(path))?;
    for t in tensors {
        let n = stream(t, &mut w, pb).map_err(io(path))?;
        if n != t.bytes {
            return Err(ModelError::Tensor { name: t.name.clone(), msg: format!("generated {n} bytes, expected {}", t.bytes) });
        }
    }
    let f = w.into_inner().map_err(|e| ModelError::Io { path: path.display().to_string(), source: e.into_error() })?;
    f.sync_all().map_err(io(path))
}

/// A byte-count bar on stderr; indicatif draws it only when stderr is a terminal.
fn progress(total: u64) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("k3 init {bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta} {msg}");
    pb.set_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    pb
}

/// Writes `config.json` and the weights described by `config_json` into `out`, atomically.
/// `out` must not exist, or be an empty directory.
pub fn write_checkpoint(config_json: &Value, out: &Path, opts: &InitOptions) -> Result<InitSummary> {
    let cfg = Config::from_json(config_json.clone())?;
    if out.exists() && std::fs::read_dir(out).map_err(io(out))?.next().is_some() {
        return Err(ModelError::Checkpoint {
            path: out.display().to_string(),
            msg: "exists and is not empty; k3 init will not overwrite it (remove it or pick another --out)".into(),
        });
    }
    let name = out.file_name().ok_or_else(|| ModelError::Input(format!("--out {} has no directory name", out.display())))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let tmp = TempDir { path: parent.join(format!(".{}.k3init-{}", name.to_string_lossy(), std::process::id())), keep: false };
    if tmp.path.exists() {
        std::fs::remove_dir_all(&tmp.path).map_err(io(&tmp.path))?;
    }
    std::fs::create_dir(&tmp.path).map_err(io(&tmp.path))?;

    let planned = plan(&cfg, opts);
    // Shards: greedy in table order (a layer's tensors stay together).
    let mut shards: Vec<Vec<&Planned>> = vec![Vec::new()];
    let mut cur = 0u64;
    for p in &planned {
        if let (Some(max), Some(last)) = (opts.shard_size, shards.last_mut()) {
            if !last.is_empty() && cur + p.bytes > max {
                shards.push(Vec::new());
                cur = 0;
            }
        }
        cur += p.bytes;
        if let Some(last) = shards.last_mut() {
            last.push(p);
        }
    }
    // Within a file: widest dtype first, so every tensor's data is aligned to its element size.
    for s in &mut shards {
        s.sort_by_key(|p| std::cmp::Reverse(p.dtype.size_in_bytes()));
    }
    let total = shards.len();
    let names: Vec<String> = if opts.shard_size.is_none() {
        vec!["model.safetensors".into()]
    } else {
        (1..=total).map(|i| format!("model-{i:05}-of-{total:06}.safetensors")).collect()
    };
    let data_bytes: u64 = planned.iter().map(|p| p.bytes).sum();
    let pb = progress(data_bytes);
    let written = shards.iter().zip(&names).try_for_each(|(s, n)| {
        pb.set_message(n.clone());
        write_file(&tmp.path.join(n), s, &pb)
    });
    forget_kept_scales();
    written?;
    pb.finish_and_clear();
    if opts.shard_size.is_some() {
        let mut wm = serde_json::Map::new();
        for (s, n) in shards.iter().zip(&names) {
            for p in s {
                wm.insert(p.name.clone(), json!(n));
            }
        }
        let idx = json!({"metadata": {"total_size": data_bytes}, "weight_map": wm});
        let path = tmp.path.join("model.safetensors.index.json");
        std::fs::write(&path, pretty(&idx)?).map_err(io(&path))?;
    }
    let cpath = tmp.path.join("config.json");
    std::fs::write(&cpath, pretty(config_json)?).map_err(io(&cpath))?;
    if out.exists() {
        std::fs::remove_dir(out).map_err(io(out))?;
    }
    std::fs::rename(&tmp.path, out).map_err(io(out))?;
    let mut tmp = tmp;
    tmp.keep = true;
    Ok(InitSummary { dir: out.to_path_buf(), tensors: planned.len(), files: names, data_bytes })
}
