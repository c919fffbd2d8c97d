//! `k3 init`: random-weight checkpoints in the release format — around-backbone §1.1–§1.5
//! (nested `config.json`, names, prefixes, shards `model-0000N-of-0000M.safetensors` + index,
//! F32 tensors) and §2.2 (MXFP4 `weight_packed`/`weight_scale`); value ranges follow the golden
//! fixtures' recipe (golden/README.md: weights N(0, 1/fan_in), logit std ≈ 1).
//!
//! Every tensor of [`weights::tensor_table`] is written, in the dtype the release uses for it:
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

use half::bf16;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use k3_core::kernels::cpu::mxfp4::E2M1;
use k3_core::DType;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::config::{builtin_config, Config};
use crate::error::{ModelError, Result};
use crate::weights::{self, Component, Kind, TensorSpec};

/// Float storage for the trunk (and for unquantised experts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDType {
    F32,
    BF16,
}

impl FloatDType {
    fn dtype(self) -> DType {
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
// Values

/// Elements per generated chunk (each chunk has its own RNG stream).
const CHUNK: usize = 1 << 20;

#[derive(Clone, Copy, Debug)]
enum Dist {
    Normal {
        mean: f32,
        std: f32,
    },
    Uniform {
        lo: f32,
        hi: f32,
    },
    /// `ln U(lo, hi)` (KDA `A_log`: decay rates e^A in [1, 16]).
    LnUniform {
        lo: f32,
        hi: f32,
    },
}

/// The distribution of a float tensor, by name and shape.
fn dist_for(spec: &TensorSpec, hidden: usize) -> Dist {
    let n = &spec.name;
    let fan_in = spec.shape.iter().skip(1).product::<usize>().max(1) as f32;
    if n.ends_with("self_attn.A_log") {
        Dist::LnUniform { lo: 1.0, hi: 16.0 }
    } else if n.ends_with("dt_bias") {
        Dist::Uniform { lo: -2.0, hi: -0.2 }
    } else if n.ends_with("e_score_correction_bias") || n.ends_with("k_norm.bias") {
        Dist::Normal { mean: 0.0, std: 0.02 }
    } else if n.ends_with("norm.weight") || n.ends_with("layernorm.weight") || n.ends_with(".norm0.weight") || n.ends_with(".norm1.weight") {
        Dist::Normal { mean: 1.0, std: 0.1 }
    } else if n.ends_with("_conv1d.weight") {
        Dist::Normal { mean: 0.0, std: 0.6 / fan_in.sqrt() }
    } else if n.ends_with("_res_proj.weight") {
        Dist::Normal { mean: 0.0, std: 1.0 / (hidden as f32).sqrt() }
    } else if spec.component == Component::Embedding {
        Dist::Normal { mean: 0.0, std: 1.0 }
    } else if n.ends_with("pos_emb.weight") {
        Dist::Normal { mean: 0.0, std: 0.02 }
    } else {
        Dist::Normal { mean: 0.0, std: 1.0 / fan_in.sqrt() }
    }
}

fn sample(d: Dist, rng: &mut SmallRng) -> f32 {
    match d {
        Dist::Normal { mean, std } => mean + std * rng.sample::<f32, _>(StandardNormal),
        Dist::Uniform { lo, hi } => rng.random_range(lo..hi),
        Dist::LnUniform { lo, hi } => rng.random_range(lo..hi).ln(),
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_seed(seed: u64, name: &str) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    splitmix(seed ^ h)
}

fn chunk_rng(tensor_seed: u64, chunk: usize) -> SmallRng {
    SmallRng::seed_from_u64(splitmix(tensor_seed.wrapping_add(chunk as u64)))
}

/// Quantises 32 values to one E8M0 scale byte and 16 packed e2m1 bytes (low nibble = even
/// column; round to nearest magnitude, clip at 6).
pub fn quantize_block(v: &[f32], packed: &mut [u8]) -> u8 {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    // Scale so that amax / 2^e lies in [4, 8): the top codes (4, 6) are used, 6 clips.
    let e = if amax > 0.0 { amax.log2().floor() as i32 - 2 } else { -127 };
    let s = (e + 127).clamp(0, 254) as u8;
    let inv = 1.0 / k3_core::kernels::cpu::mxfp4::e8m0_to_f32(s);
    let code = |x: f32| -> u8 {
        let a = (x.abs() * inv).min(6.0);
        let mut best = 0u8;
        for c in 1..8u8 {
            if (E2M1[c as usize] - a).abs() < (E2M1[best as usize] - a).abs() {
                best = c;
            }
        }
        best | if x.is_sign_negative() && best != 0 { 8 } else { 0 }
    };
    for (j, p) in packed.iter_mut().enumerate() {
        *p = code(v[2 * j]) | (code(v[2 * j + 1]) << 4);
    }
    s
}

/// How one tensor's bytes are produced.
#[derive(Clone, Debug)]
enum Source {
    Float {
        dist: Dist,
        dtype: DType,
        numel: usize,
        seed: u64,
    },
    /// One half of an MXFP4 pair, generated from the same normal `[rows, cols]` matrix.
    Mxfp4 {
        scale: bool,
        rows: usize,
        cols: usize,
        std: f32,
        seed: u64,
    },
}

struct Planned {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    bytes: u64,
    src: Source,
}

fn plan(cfg: &Config, opts: &InitOptions) -> Vec<Planned> {
    let h = cfg.text.hidden_size;
    weights::tensor_table(cfg)
        .into_iter()
        .map(|s| {
            let numel: usize = s.shape.iter().product();
            let (dtype, src) = match s.kind {
                Kind::Mxfp4Packed | Kind::Mxfp4Scale => {
                    let rows = s.shape[0];
                    let cols = if s.kind == Kind::Mxfp4Packed { s.shape[1] * 2 } else { s.shape[1] * 32 };
                    let base = s.name.trim_end_matches("weight_packed").trim_end_matches("weight_scale");
                    (
                        DType::U8,
                        Source::Mxfp4 { scale: s.kind == Kind::Mxfp4Scale, rows, cols, std: 1.0 / (cols as f32).sqrt(), seed: name_seed(opts.seed, base) },
                    )
                }
                k => {
                    let dtype = match (k, s.expert, opts.experts) {
                        (Kind::Float32, _, _) => DType::F32,
                        (_, Some(_), ExpertFormat::Float(d)) => d.dtype(), // routed experts (an MTP layer's too)
                        _ => opts.dtype.dtype(),
                    };
                    (dtype, Source::Float { dist: dist_for(&s, h), dtype, numel, seed: name_seed(opts.seed, &s.name) })
                }
            };
            Planned { bytes: (numel * dtype.size_in_bytes()) as u64, name: s.name, shape: s.shape, dtype, src }
        })
        .collect()
}

/// The bytes of chunk `c` of a tensor (`None` past the end).
fn chunk_bytes(src: &Source, c: usize) -> Option<Vec<u8>> {
    match *src {
        Source::Float { dist, dtype, numel, seed } => {
            let start = c * CHUNK;
            if start >= numel {
                return None;
            }
            let n = CHUNK.min(numel - start);
            let mut rng = chunk_rng(seed, c);
            let mut out = Vec::with_capacity(n * dtype.size_in_bytes());
            for _ in 0..n {
                let x = sample(dist, &mut rng);
                match dtype {
                    DType::BF16 => out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes()),
                    _ => out.extend_from_slice(&x.to_le_bytes()),
                }
            }
            Some(out)
        }
        Source::Mxfp4 { scale, rows, cols, std, seed } => {
            let per = (CHUNK / cols).max(1);
            let r0 = c * per;
            if r0 >= rows {
                return None;
            }
            let nr = per.min(rows - r0);
            let mut rng = chunk_rng(seed, c);
            let mut row = vec![0f32; cols];
            let mut packed = vec![0u8; cols / 2];
            let mut out = Vec::with_capacity(nr * if scale { cols / 32 } else { cols / 2 });
            for _ in 0..nr {
                row.iter_mut().for_each(|x| *x = std * rng.sample::<f32, _>(StandardNormal));
                let mut scales = Vec::with_capacity(cols / 32);
                for (blk, p) in row.chunks_exact(32).zip(packed.chunks_exact_mut(16)) {
                    scales.push(quantize_block(blk, p));
                }
                out.extend_from_slice(if scale { &scales } else { &packed });
            }
            Some(out)
        }
    }
}

/// Streams one tensor's bytes into `w`, a few chunks at a time (generated in parallel).
fn stream(p: &Planned, w: &mut impl Write, pb: &ProgressBar) -> std::io::Result<u64> {
    let batch = rayon::current_num_threads().max(1) * 2;
    let mut written = 0u64;
    for first in (0..).step_by(batch) {
        let parts: Vec<Option<Vec<u8>>> = (first..first + batch).into_par_iter().map(|c| chunk_bytes(&p.src, c)).collect();
        let mut done = false;
        for part in parts {
            match part {
                Some(b) => {
                    w.write_all(&b)?;
                    written += b.len() as u64;
                    pb.inc(b.len() as u64);
                }
                None => done = true,
            }
        }
        if done {
            break;
        }
    }
    Ok(written)
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
    for (s, n) in shards.iter().zip(&names) {
        pb.set_message(n.clone());
        write_file(&tmp.path.join(n), s, &pb)?;
    }
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
