//! Opening a model directory: `config.json` + `model.safetensors`, or
//! `model.safetensors.index.json` + shards (around-backbone §1.2). Every file is memory-mapped;
//! tensors are views into the maps (nothing is copied at load; pages are read when a kernel
//! touches them). [`Checkpoint::check`] compares the files against [`weights::tensor_table`]
//! and reports the first problem by name: a missing tensor (with its expected shape), a wrong
//! shape or dtype, an unexpected tensor inside a layer, a missing shard.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k3_core::{DType, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::config::Config;
use crate::error::{ModelError, Result};
use crate::weights::{self, Kind, TensorSpec};

/// One tensor's place in the files.
#[derive(Clone, Debug)]
pub struct Entry {
    pub shard: usize,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub start: usize,
    pub len: usize,
}

pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Config,
    pub files: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    entries: HashMap<String, Entry>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |e| ModelError::Io { path: path.display().to_string(), source: e }
}

fn map_dtype(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::BF16 => DType::BF16,
        StDtype::F16 => DType::F16,
        StDtype::U8 => DType::U8,
        StDtype::I32 => DType::I32,
        StDtype::I64 => DType::I64,
        _ => return None,
    })
}

impl Checkpoint {
    /// Opens `dir` (config + weights). Does not check names: call [`Checkpoint::check`].
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let cfg_path = dir.join("config.json");
        if !cfg_path.is_file() {
            return Err(ModelError::Config {
                path: cfg_path.display().to_string(),
                msg: "missing: a model directory must contain config.json (and model.safetensors or model.safetensors.index.json)".into(),
            });
        }
        let config = Config::from_file(&cfg_path)?;
        let files = Self::weight_files(dir)?;
        let pb = if files.len() > 1 {
            let pb = indicatif::ProgressBar::new(files.len() as u64);
            pb.set_style(
                indicatif::ProgressStyle::with_template("opening shards {bar:30} {pos}/{len}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            pb
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut maps = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let (map, ents) = Self::open_file(f)?;
            for (name, mut e) in ents {
                e.shard = i;
                if entries.insert(name.clone(), e).is_some() {
                    return Err(ModelError::Checkpoint { path: f.display().to_string(), msg: format!("tensor `{name}` appears in more than one shard") });
                }
            }
            maps.push(Arc::new(map));
            pb.inc(1);
        }
        pb.finish_and_clear();
        Ok(Checkpoint { dir: dir.to_path_buf(), config, files, maps, entries })
    }

    fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            let s = std::fs::read_to_string(&index).map_err(io_err(&index))?;
            let v: serde_json::Value =
                serde_json::from_str(&s).map_err(|e| ModelError::Checkpoint { path: index.display().to_string(), msg: format!("not valid JSON: {e}") })?;
            let wm = v
                .get("weight_map")
                .and_then(|w| w.as_object())
                .ok_or_else(|| ModelError::Checkpoint { path: index.display().to_string(), msg: "has no `weight_map` object".into() })?;
            let mut names: Vec<String> = wm.values().filter_map(|x| x.as_str().map(str::to_string)).collect();
            names.sort();
            names.dedup();
            let mut files = Vec::new();
            for n in names {
                if n.contains('/') || n.contains("..") {
                    return Err(ModelError::Checkpoint { path: index.display().to_string(), msg: format!("shard name `{n}` is not a plain file name") });
                }
                let p = dir.join(&n);
                if !p.is_file() {
                    return Err(ModelError::Checkpoint {
                        path: p.display().to_string(),
                        msg: format!("shard named in {} is absent: download it or fix the index", index.display()),
                    });
                }
                files.push(p);
            }
            Ok(files)
        } else if single.is_file() {
            Ok(vec![single])
        } else {
            Err(ModelError::Checkpoint { path: dir.display().to_string(), msg: "holds neither model.safetensors nor model.safetensors.index.json".into() })
        }
    }

    fn open_file(path: &Path) -> Result<(Mmap, Vec<(String, Entry)>)> {
        let file = std::fs::File::open(path).map_err(io_err(path))?;
        // SAFETY: the map is read-only; k3rs never writes model files while they are open.
        let map = unsafe { Mmap::map(&file) }.map_err(io_err(path))?;
        let bad = |msg: String| ModelError::Checkpoint { path: path.display().to_string(), msg };
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| bad(format!("corrupt or truncated safetensors header: {e}")))?;
        let base = 8 + n;
        let mut out = Vec::new();
        for (name, info) in meta.tensors() {
            let dtype = map_dtype(info.dtype)
                .ok_or_else(|| bad(format!("tensor `{name}` has dtype {:?}, which k3rs does not read (F32, BF16, F16, U8, I64)", info.dtype)))?;
            let (s, e) = info.data_offsets;
            if base + e > map.len() {
                return Err(bad(format!("tensor `{name}` ends past the end of the file: the file is truncated")));
            }
            out.push((name, Entry { shard: 0, dtype, shape: info.shape.clone(), start: base + s, len: e - s }));
        }
        Ok((map, out))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }
    pub fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }
    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }
    /// Total bytes of tensor data in the files.
    pub fn data_bytes(&self) -> u64 {
        self.entries.values().map(|e| e.len as u64).sum()
    }
    /// Total size of the weight files.
    pub fn file_bytes(&self) -> u64 {
        self.maps.iter().map(|m| m.len() as u64).sum()
    }

    /// The tensor `name` as a view into its memory map.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let e = self.entries.get(name).ok_or_else(|| ModelError::Tensor { name: name.into(), msg: "missing from the checkpoint".into() })?;
        Ok(Tensor::mapped(e.dtype, e.shape.clone(), self.maps[e.shard].clone(), e.start, e.len)?)
    }

    /// Checks every tensor of the config's table: present, right shape, right dtype; and that no
    /// layer holds a tensor the table does not know (e.g. `self_attn.indexer.wk.bias`).
    pub fn check(&self) -> Result<()> {
        self.check_table(&weights::tensor_table(&self.config))
    }

    /// [`Checkpoint::check`] against a table the caller already built from this config.
    pub fn check_table(&self, table: &[TensorSpec]) -> Result<()> {
        for spec in table {
            self.check_one(spec)?;
        }
        let known: std::collections::HashSet<&str> = table.iter().map(|s| s.name.as_str()).collect();
        let has_vision = self.config.vision_config.is_some();
        let n = self.config.text.num_hidden_layers;
        // What an MTP layer may carry beyond the table (around-backbone §5.1), read by nothing.
        let mtp_extra = |name: &str| {
            (n..n + self.config.mtp_layers()).any(|l| {
                name.strip_prefix(&weights::layer_prefix(l))
                    .is_some_and(|rest| rest == "embed_tokens.weight" || rest.starts_with("self_attention_res_") || rest.starts_with("mlp_res_"))
            })
        };
        for name in self.names() {
            if known.contains(name) || mtp_extra(name) {
                continue;
            }
            let inside_layer = name.starts_with(&format!("{}layers.", weights::TEXT));
            let text = name.starts_with("language_model.");
            let vision = name.starts_with("vision_tower.") || name.starts_with("mm_projector.");
            if inside_layer || (text && !name.starts_with(&format!("{}layers.", weights::TEXT))) || (vision && has_vision) || !(text || vision) {
                return Err(ModelError::Tensor {
                    name: name.into(),
                    msg: format!("unexpected in {}: the config does not describe it (wrong config.json, or a checkpoint of another model)", self.dir.display()),
                });
            }
        }
        Ok(())
    }

    fn check_one(&self, spec: &TensorSpec) -> Result<()> {
        let Some(e) = self.entries.get(&spec.name) else {
            let why = match spec.component {
                weights::Component::Mtp => format!(
                    "; config.json declares num_nextn_predict_layers = {} (MTP draft layers at layers.{}..), so their tensors must be there: set it to 0 to load the model without them",
                    self.config.mtp_layers(),
                    self.config.text.num_hidden_layers
                ),
                _ => String::new(),
            };
            return Err(ModelError::Tensor { name: spec.name.clone(), msg: format!("missing from the checkpoint (expected shape {:?}){why}", spec.shape) });
        };
        let terr = |msg: String| ModelError::Tensor { name: spec.name.clone(), msg };
        let dtype_ok = match spec.kind {
            Kind::Float | Kind::Float32 => matches!(e.dtype, DType::F32 | DType::BF16 | DType::F16),
            Kind::Mxfp4Packed | Kind::Mxfp4Scale => e.dtype == DType::U8,
        };
        if !dtype_ok {
            let want = match spec.kind {
                Kind::Float | Kind::Float32 => "F32, BF16 or F16",
                _ => "U8 (MXFP4)",
            };
            return Err(terr(format!("has dtype {}, expected {want}", e.dtype)));
        }
        if spec.name.ends_with("self_attn.A_log") {
            return a_log_shape_ok(&e.shape, spec.shape[0])
                .then_some(())
                .ok_or_else(|| terr(format!("has shape {:?}; expected [{n}], a zero-padded [≥{n}] or [1, 1, {n}, 1]", e.shape, n = spec.shape[0])));
        }
        if e.shape != spec.shape {
            return Err(terr(format!("has shape {:?}, expected {:?}", e.shape, spec.shape)));
        }
        Ok(())
    }

    /// `A_log`'s first `num_heads` values (accepts unpadded, zero-padded and `[1,1,H,1]`).
    pub fn a_log(&self, name: &str, num_heads: usize) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        if !a_log_shape_ok(t.shape(), num_heads) {
            return Err(ModelError::Tensor { name: name.into(), msg: format!("has shape {:?}; expected [{num_heads}] or a padded form", t.shape()) });
        }
        Ok(t.to_f32()?[..num_heads].to_vec())
    }

    /// Per-dtype byte totals (for `k3 inspect`).
    pub fn bytes_by_dtype(&self) -> BTreeMap<String, u64> {
        let mut m = BTreeMap::new();
        for e in self.entries.values() {
            *m.entry(e.dtype.to_string()).or_insert(0) += e.len as u64;
        }
        m
    }
}

fn a_log_shape_ok(shape: &[usize], nh: usize) -> bool {
    match shape {
        [n] => *n >= nh,
        [1, 1, n, 1] => *n == nh,
        _ => false,
    }
}

/// Opens a bare safetensors file (no config), e.g. a fixture's `reference.safetensors`.
/// The returned checkpoint has a placeholder config and must not be used to build a model.
pub fn open_tensors_only(path: &Path) -> Result<Checkpoint> {
    let (map, ents) = Checkpoint::open_file(path)?;
    let config = Config::from_json(serde_json::json!({
        "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "intermediate_size": 1,
        "num_attention_heads": 1, "q_lora_rank": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1,
        "qk_rope_head_dim": 0, "v_head_dim": 1, "num_experts": 1, "num_experts_per_token": 1,
        "moe_intermediate_size": 1, "routed_expert_hidden_size": 1, "attn_res_block_size": 1,
        "linear_attn_config": {"num_heads": 1, "head_dim": 1, "short_conv_kernel_size": 1,
            "gate_lower_bound": -5.0, "kda_layers": [1], "full_attn_layers": []}
    }))?;
    Ok(Checkpoint {
        dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
        config,
        files: vec![path.to_path_buf()],
        maps: vec![Arc::new(map)],
        entries: ents.into_iter().collect(),
    })
}
