//! Flag groups shared by several subcommands (flattened into their `Args` with
//! `#[command(flatten)]`), so a flag is spelled, documented and checked once: the model
//! directory, the device (`--device` is parsed here and nowhere else), the GPU precision,
//! the KDA state storage, sampling, the parallel layout and where a process sits in its world.

use k3_model::capacity::KvDtype;
use std::path::PathBuf;

use anyhow::{bail, Result};
use k3_core::Device;
use k3_engine::SamplingParams;
use k3_model::Parallel;

/// `--model DIR`, defaulting to the embedded k3-nano (`run`, `serve`, `bench`).
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Model directory (config.json + safetensors; default: the embedded k3-chat for `serve`, k3-nano otherwise).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

impl ModelArgs {
    /// The model directory: `--model`, or the embedded k3-nano (`model_dir::resolve_model_dir`).
    pub fn dir(&self) -> Result<PathBuf> {
        super::model_dir::resolve_model_dir(self.model.as_deref())
    }

    /// The model directory for chat: `--model`, or the embedded k3-chat (else k3-nano).
    pub fn chat_dir(&self) -> Result<PathBuf> {
        super::model_dir::resolve_model_dir_for(self.model.as_deref(), super::model_dir::Use::Chat)
    }
}

/// Parses a `--device` value: `None` for the CPU, `Some(ordinal)` for `cuda` / `cuda:N`
/// (the grammar of [`k3_core::Device`]).
pub fn parse_device(d: &str) -> Result<Option<usize>> {
    match d.parse::<Device>() {
        Ok(Device::Cpu) => Ok(None),
        Ok(Device::Cuda(n)) => Ok(Some(n)),
        Err(_) => bail!("--device `{d}`: use cpu, cuda or cuda:N"),
    }
}

/// `--speculative ngram|suffix|mtp|draft|off`, `--num-speculative-tokens K` and `--draft-model
/// DIR` (`run`, `serve`).
#[derive(clap::Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: ngram (prompt lookup over the prompt and output), suffix (suffix
    /// automata over the request and earlier requests), mtp (the checkpoint's MTP draft layer,
    /// `num_nextn_predict_layers > 0`; K3 ships none), draft (a separate draft model,
    /// --draft-model) or off. Greedy output is unchanged and sampling keeps its distribution.
    /// ngram/suffix: the CPU (one rank) and the GPU (one rank); mtp/draft: the CPU (one rank);
    /// elsewhere decoding stays plain and a note says why.
    #[arg(long, default_value = "off", value_name = "ngram|suffix|mtp|draft|off")]
    pub speculative: String,
    /// Most drafted tokens per sequence and step (1..=16; adapted to the acceptance).
    #[arg(long, default_value_t = 4, value_name = "K")]
    pub num_speculative_tokens: usize,
    /// With --speculative draft: the draft model's directory, a K3-family checkpoint the CPU
    /// model loads (k3-nano, a `k3 init` model, …) with the target's vocab_size. It runs on the
    /// CPU beside the target.
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<PathBuf>,
}

impl SpecArgs {
    /// The engine's setting; a bad value is an error naming its flag (`--speculative draft`
    /// without `--draft-model`, or `--draft-model` with another method, too).
    pub fn config(&self) -> Result<k3_engine::SpecConfig> {
        let c = k3_engine::SpecConfig::from_flags(&self.speculative, self.num_speculative_tokens)?;
        check_draft_flags(&self.speculative, self.draft_model.is_some())?;
        Ok(c)
    }

    /// The draft model of `--speculative draft` (`None` for the other methods), loaded and
    /// checked against the target `target` (its config; `target_name` names it).
    pub fn draft(&self, target: &k3_model::Config, target_name: &str) -> Result<Option<k3_engine::spec::draft::DraftSpec>> {
        self.config()?;
        match &self.draft_model {
            Some(dir) => Ok(Some(k3_engine::spec::draft::DraftSpec::load(dir, target, target_name)?)),
            None => Ok(None),
        }
    }
}

/// `--speculative` (one method, or a comma-separated list for `k3 bench`) and whether
/// `--draft-model` was given: they must come together.
pub fn check_draft_flags(methods: &str, draft_model: bool) -> Result<()> {
    let draft = methods.split(',').any(|m| m.trim() == "draft");
    match (draft, draft_model) {
        (true, false) => {
            bail!("--speculative draft needs --draft-model DIR: the draft model's directory (a K3-family checkpoint with the target's vocab_size)")
        }
        (false, true) => bail!("--draft-model is used by --speculative draft only (got --speculative {methods})"),
        _ => Ok(()),
    }
}

/// `--device cpu|cuda|cuda:N` (`run`, `logits`, `serve`).
#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArgs {
    /// cpu, or cuda / cuda:N to run the model on a GPU (needs a k3 built with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

impl DeviceArgs {
    /// `None` for the CPU, `Some(ordinal)` for a GPU.
    pub fn ordinal(&self) -> Result<Option<usize>> {
        parse_device(&self.device)
    }
}

/// `--precision bf16|f32` of the GPU model (`run`, `logits`, `serve`).
#[derive(clap::Args, Clone, Debug)]
pub struct PrecisionArgs {
    /// GPU precision: bf16 (the serving path) or f32 (the reference path: F32 weights and
    /// activations, plain kernels; slow, for checks). The CPU computes in f32.
    #[arg(long)]
    pub precision: Option<String>,
    /// GPU latent and indexer-key cache format: bf16 (indexer keys f32), or fp8 — vLLM's
    /// `fp8_ds_mla` latent rows (656 B per token per layer in K3 instead of 1152) and 132-byte
    /// FP8 indexer keys; needs --precision bf16.
    #[arg(long, value_name = "bf16|fp8")]
    pub kv_cache_dtype: Option<String>,
}

impl PrecisionArgs {
    /// Whether the GPU model runs in f32, on `device` (from [`DeviceArgs::ordinal`]); the flag
    /// on the CPU is an error.
    pub fn gpu_f32(&self, device: Option<usize>) -> Result<bool> {
        match (self.precision.as_deref(), device) {
            (None, _) => Ok(false),
            (Some(_), None) => bail!("--precision applies to --device cuda (the CPU model always computes in f32): drop it or add --device cuda"),
            (Some("bf16"), Some(_)) => Ok(false),
            (Some("f32"), Some(_)) => Ok(true),
            (Some(p), Some(_)) => bail!("--precision `{p}` is not one of bf16, f32"),
        }
    }

    /// The `--kv-cache-dtype` on `device` (GPU only; fp8 needs the bf16 precision).
    pub fn kv_dtype(&self, device: Option<usize>) -> Result<KvDtype> {
        let Some(s) = self.kv_cache_dtype.as_deref() else { return Ok(KvDtype::Bf16) };
        let kv = KvDtype::parse(s).ok_or_else(|| anyhow::anyhow!("--kv-cache-dtype `{s}` is not one of bf16, fp8"))?;
        if device.is_none() {
            bail!("--kv-cache-dtype applies to --device cuda (the CPU model caches f32): drop it or add --device cuda");
        }
        if kv == KvDtype::Fp8 && self.gpu_f32(device)? {
            bail!("--kv-cache-dtype fp8 with --precision f32: the f32 reference path keeps f32 caches; use --precision bf16");
        }
        Ok(kv)
    }
}

/// `--kda-state f32|bf16`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KdaStateArg {
    F32,
    Bf16,
}

impl From<KdaStateArg> for k3_model::layers::kda::StateDType {
    fn from(a: KdaStateArg) -> Self {
        match a {
            KdaStateArg::F32 => Self::F32,
            KdaStateArg::Bf16 => Self::Bf16,
        }
    }
}

/// `--kda-state` (`run`, `serve`).
#[derive(clap::Args, Clone, Debug)]
pub struct KdaStateArgs {
    /// KDA recurrent-state storage: f32 (reference) or bf16 (half the memory, approximate).
    #[arg(long, value_enum, default_value = "f32")]
    pub kda_state: KdaStateArg,
}

/// Sampling: `--temperature --top-k --top-p --min-p --repetition-penalty --presence-penalty
/// --frequency-penalty --seed --logit-bias` (`run`).
#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Makes sampling reproducible.
    #[arg(long)]
    pub seed: Option<u64>,
    /// `ID=BIAS` added to token ID's logit after the penalties (repeatable; BIAS in [-100, 100],
    /// -100 in effect bans the token) — OpenAI's `logit_bias`.
    #[arg(long = "logit-bias", value_name = "ID=BIAS", value_parser = parse_bias, allow_negative_numbers = true)]
    pub logit_bias: Vec<(u32, f32)>,
}

/// `ID=BIAS` of `--logit-bias`.
fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, b) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected ID=BIAS, e.g. 1234=-100"))?;
    let id = id.trim().parse().map_err(|_| format!("{s:?}: the token id {id:?} is not a non-negative integer"))?;
    let b: f32 = b.trim().parse().map_err(|_| format!("{s:?}: the bias {b:?} is not a number"))?;
    if !b.is_finite() || b.abs() > 100.0 {
        return Err(format!("{s:?}: the bias must lie in [-100, 100]"));
    }
    Ok((id, b))
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logprobs: None,
            logit_bias: {
                let mut b = self.logit_bias.clone();
                b.sort_by_key(|e| e.0);
                b
            },
            prompt_logprobs: None,
        }
    }
}

/// The parallel layout: `--tp`, `--ep`, `--pp` (`docs/parallel.md`).
#[derive(clap::Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Tensor-parallel ranks per pipeline stage: attention heads, dense FFN, shared experts and
    /// the vocabulary are split over them.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Expert-parallel ranks per stage (default: --tp): routed experts whole on their owner.
    /// `--ep 1` with `--tp N` splits each expert's intermediate dim instead.
    #[arg(long)]
    pub ep: Option<usize>,
    /// Pipeline stages: contiguous runs of decoder layers, one after the other.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
}

impl ParallelArgs {
    pub fn layout(&self) -> Result<Parallel> {
        Ok(Parallel::new(self.tp, self.ep, self.pp)?)
    }
    /// The layout when it has more than one rank (`None` for one); bad values are an error.
    pub fn parallel(&self) -> Result<Option<Parallel>> {
        let p = self.layout()?;
        Ok((p.world() > 1).then_some(p))
    }
}

/// Where this process sits in a multi-process (multi-GPU, multi-node) world:
/// `--nnodes/--node-rank/--master-addr`. Under torchrun, Slurm or Kubernetes the launcher's
/// environment (`RANK`, `WORLD_SIZE`, ...) is used instead and these are ignored.
#[derive(clap::Args, Clone, Debug)]
pub struct LaunchArgs {
    /// Nodes in the world; this node runs (tp·pp)/nnodes ranks, one process per GPU.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes (node 0 hosts rank 0).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// HOST:PORT of rank 0 (an address of node 0 and a free port), the same on every node;
    /// needed with --nnodes > 1.
    #[arg(long)]
    pub master_addr: Option<String>,
}

impl LaunchArgs {
    pub fn node(&self) -> k3_engine::dist::launch::NodeArgs {
        k3_engine::dist::launch::NodeArgs { nnodes: self.nnodes, node_rank: self.node_rank, master_addr: self.master_addr.clone() }
    }
    /// Whether any node flag differs from its default (one node, rank 0, no master).
    pub fn is_set(&self) -> bool {
        self.nnodes != 1 || self.node_rank != 0 || self.master_addr.is_some()
    }
}

/// Where the routed experts are (issue 23; `run`, `serve`): `--experts-on`, the planner's
/// `--gpu-mem` / `--host-mem`, and the disk tier's expert cache.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Routed experts")]
pub struct ExpertArgs {
    /// Every MoE layer's routed experts on one tier: gpu (uploaded; --device cuda), cpu (host
    /// memory, computed by the CPU; beside a GPU with int8 activations) or disk (read from the
    /// checkpoint when routed, into a bounded cache; on the CPU backend the same f32 kernels as
    /// the memory map, so the same output). Default: where the model runs.
    #[arg(long, value_name = "gpu|cpu|disk", value_parser = parse_tier)]
    pub experts_on: Option<k3_model::placement::Tier>,
    /// GPU memory budget in GiB (--device cuda): the planner keeps the trunk on the GPU and puts
    /// each MoE layer's experts on the GPU while they fit, then in host memory (--host-mem),
    /// then on disk (`k3 inspect DIR --gpu-mem G --host-mem H` prints the plan).
    #[arg(long, value_name = "GIB")]
    pub gpu_mem: Option<f64>,
    /// Host memory in GiB for experts, with --gpu-mem [default: the memory available now].
    #[arg(long, value_name = "GIB", requires = "gpu_mem")]
    pub host_mem: Option<f64>,
    /// Bytes of experts read from disk kept in memory, e.g. 64GiB [default: 8GiB].
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub expert_cache_mem: Option<usize>,
    /// Reads of experts in flight at once (reader threads).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub expert_readers: usize,
    /// Expert reads: direct (O_DIRECT, past the page cache), buffered, or auto (direct where
    /// the file system takes it).
    #[arg(long, value_name = "auto|direct|buffered", default_value = "auto", value_parser = parse_io)]
    pub expert_io: k3_model::offload::DirectIo,
}

fn parse_tier(s: &str) -> std::result::Result<k3_model::placement::Tier, String> {
    k3_model::placement::Tier::parse(s).ok_or_else(|| format!("{s:?}: use gpu, cpu or disk"))
}

fn parse_io(s: &str) -> std::result::Result<k3_model::offload::DirectIo, String> {
    use k3_model::offload::DirectIo;
    match s {
        "auto" => Ok(DirectIo::Auto),
        "direct" => Ok(DirectIo::On),
        "buffered" => Ok(DirectIo::Off),
        _ => Err(format!("{s:?}: use auto, direct or buffered")),
    }
}

fn parse_size(s: &str) -> std::result::Result<usize, String> {
    k3_engine::prefix::parse_bytes(s)
}

impl ExpertArgs {
    /// The engine's offload options; a bad value is an error naming its flag.
    pub fn options(&self) -> Result<k3_model::offload::OffloadOptions> {
        let gib = |flag: &str, v: Option<f64>| -> Result<Option<u64>> {
            match v {
                Some(x) if !x.is_finite() || x <= 0.0 => bail!("{flag} {x}: give a positive number of GiB"),
                v => Ok(v.map(|x| (x * (1u64 << 30) as f64) as u64)),
            }
        };
        if self.expert_readers == 0 || self.expert_readers > 256 {
            bail!("--expert-readers {}: give 1 to 256", self.expert_readers);
        }
        let mut cache = k3_model::offload::CacheOptions { readers: self.expert_readers, direct_io: self.expert_io, ..Default::default() };
        if let Some(b) = self.expert_cache_mem {
            cache.budget_bytes = b as u64;
        }
        Ok(k3_model::offload::OffloadOptions {
            experts_on: self.experts_on,
            gpu_mem: gib("--gpu-mem", self.gpu_mem)?,
            host_mem: gib("--host-mem", self.host_mem)?,
            cache,
        })
    }
}
