//! The prefix-cache flags of `k3 serve` (issue 21; `k3_engine::prefix`): on by default with a
//! 128-token grid and a pool of an eighth of the machine's memory; `--no-prefix-cache` turns it
//! off. A bad value is a clap error naming its flag.

use k3_engine::PrefixConfig;

#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Prefix cache")]
pub struct PrefixArgs {
    /// Turn the prefix cache off (it is on by default: on the CPU — one rank or ranks as
    /// threads —, on one GPU, and on a multi-process GPU layout, where each rank keeps its own
    /// part of every stored state; K3_DIST_PREFIX=0 turns it off there only).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Bytes of host memory the prefix-cache pool may hold (latent cells + KDA snapshots; with
    /// --device cuda the cells are GPU cache pages, counted in --max-cache-tokens and evicted when
    /// a request needs them), e.g. 2GiB, 512MiB, 1073741824 [default: an eighth of the machine's
    /// memory].
    #[arg(long, value_name = "SIZE", value_parser = parse_mem)]
    pub prefix_cache_mem: Option<usize>,
    /// Prefix-cache grid in tokens: prefill is cut at its multiples (replacing
    /// --prefill-chunk) and snapshots sit on it, so a warm start computes exactly what a cold
    /// one does.
    #[arg(long, value_name = "TOKENS", default_value_t = PrefixConfig::GRID, value_parser = parse_grid)]
    pub prefix_cache_grid: usize,
}

fn parse_mem(s: &str) -> Result<usize, String> {
    k3_engine::prefix::parse_bytes(s)
}

fn parse_grid(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=1 << 20).contains(&n) => Ok(n),
        _ => Err(format!("{s:?}: give a number of tokens from 1 to 1048576")),
    }
}

impl PrefixArgs {
    /// The engine's prefix-cache config; `None` with `--no-prefix-cache`.
    pub fn config(&self) -> Option<PrefixConfig> {
        (!self.no_prefix_cache).then(|| PrefixConfig::new(self.prefix_cache_grid, self.prefix_cache_mem.unwrap_or_else(k3_engine::prefix::default_mem_bytes)))
    }
}
