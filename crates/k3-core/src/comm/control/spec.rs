//! [`WorldSpec`]: which rank this process is, and where rank 0 listens, read from the
//! conventions launchers use: explicit flags (`--rank/--world/--master`, or a node's
//! `--nnodes/--node-rank/--master-addr` and its process count), torchrun and Kubernetes
//! (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and
//! Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, the tasks-per-node
//! lists, the node list). Every error names the flag or variable that was wrong and the fix.

use crate::{CoreError, Result};

/// The port rank 0 listens on when `MASTER_PORT` is not set (torchrun's default).
pub const DEFAULT_PORT: u16 = 29500;

/// One process's place in a world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldSpec {
    /// This process's rank, `0..world`. Rank 0 is the leader and listens on `master`.
    pub rank: usize,
    /// Number of processes in the world.
    pub world: usize,
    /// This process's index on its node, `0..local_world` (its GPU ordinal, usually).
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world: usize,
    /// `host:port` rank 0 listens on and every other rank connects to (`[v6]:port` for IPv6).
    pub master: String,
}

/// The names a source calls its fields by, so errors say `RANK=3 but WORLD_SIZE=2` or
/// `--rank 3 but --world 2`.
struct Names {
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
    master: &'static str,
    flags: bool,
}

const FLAGS: Names = Names { rank: "--rank", world: "--world", local_rank: "--local-rank", local_world: "--local-world", master: "--master", flags: true };
const TORCHRUN: Names =
    Names { rank: "RANK", world: "WORLD_SIZE", local_rank: "LOCAL_RANK", local_world: "LOCAL_WORLD_SIZE", master: "MASTER_ADDR/MASTER_PORT", flags: false };
const SLURM: Names = Names {
    rank: "SLURM_PROCID",
    world: "SLURM_NTASKS",
    local_rank: "SLURM_LOCALID",
    local_world: "SLURM_STEP_TASKS_PER_NODE",
    master: "MASTER_ADDR/MASTER_PORT or SLURM_STEP_NODELIST",
    flags: false,
};

impl Names {
    /// `RANK=3` or `--rank 3`.
    fn show(&self, name: &str, v: impl std::fmt::Display) -> String {
        if self.flags {
            format!("{name} {v}")
        } else {
            format!("{name}={v}")
        }
    }
}

fn bad(msg: String) -> CoreError {
    CoreError::Comm { op: "world spec", msg }
}

impl WorldSpec {
    /// The world of one process (no networking; [`super::rendezvous`] returns at once).
    pub fn single() -> WorldSpec {
        WorldSpec { rank: 0, world: 1, local_rank: 0, local_world: 1, master: "127.0.0.1:0".into() }
    }

    /// From explicit values (the hidden `k3 worker --rank --world --local-rank --local-world
    /// --master` flags); errors name those flags.
    pub fn new(rank: usize, world: usize, local_rank: usize, local_world: usize, master: &str) -> Result<WorldSpec> {
        let spec = WorldSpec { rank, world, local_rank, local_world, master: master.to_string() };
        spec.check(&FLAGS)?;
        Ok(spec)
    }

    /// From the environment, through `lookup` (`|k| std::env::var(k).ok()` in a binary, a map
    /// in tests). torchrun/Kubernetes variables win when `RANK` or `WORLD_SIZE` is set (torchrun
    /// inside an `srun` step sets both kinds, and its own are the real ones); then Slurm when
    /// `SLURM_PROCID` is set; otherwise `Ok(None)`: no launcher, a single process.
    pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<WorldSpec>> {
        let get = |k: &str| lookup(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        let num = |k: &str, fix: &str| -> Result<Option<usize>> {
            match get(k) {
                None => Ok(None),
                Some(v) => v.parse().map(Some).map_err(|_| bad(format!("{k}={v} is not a whole number: {fix}"))),
            }
        };
        if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            let n = &TORCHRUN;
            let rank = num("RANK", "set RANK to this process's rank, 0..WORLD_SIZE")?;
            let world = num("WORLD_SIZE", "set WORLD_SIZE to the number of processes")?;
            let (rank, world) = match (rank, world) {
                (Some(r), Some(w)) => (r, w),
                (Some(r), None) => return Err(bad(format!("RANK={r} is set but WORLD_SIZE is not: set WORLD_SIZE too"))),
                (None, Some(w)) => return Err(bad(format!("WORLD_SIZE={w} is set but RANK is not: set RANK too"))),
                (None, None) => unreachable!("one of them is set"),
            };
            let local_rank = num("LOCAL_RANK", "set LOCAL_RANK to this process's index on its node")?;
            let local_world = num("LOCAL_WORLD_SIZE", "set LOCAL_WORLD_SIZE to the number of processes on this node")?;
            let (local_rank, local_world) = match (local_rank, local_world) {
                (Some(l), Some(lw)) => (l, lw),
                // Kubernetes jobs often run one process per pod and set neither.
                (None, None) => (0, 1),
                (None, Some(lw)) => (0, lw),
                (Some(l), None) => {
                    return Err(bad(format!("LOCAL_RANK={l} is set but LOCAL_WORLD_SIZE is not: set LOCAL_WORLD_SIZE to the number of processes on this node")))
                }
            };
            let master = env_master(&get, None, world)?;
            let spec = WorldSpec { rank, world, local_rank, local_world, master };
            spec.check(n)?;
            return Ok(Some(spec));
        }
        if get("SLURM_PROCID").is_some() {
            let n = &SLURM;
            let rank = num("SLURM_PROCID", "run under srun, or set RANK/WORLD_SIZE instead")?.unwrap_or(0);
            let world = num("SLURM_NTASKS", "run under srun with --ntasks")?
                .ok_or_else(|| bad(format!("SLURM_PROCID={rank} is set but SLURM_NTASKS is not: launch with srun --ntasks N")))?;
            let local_rank = num("SLURM_LOCALID", "run under srun")?.unwrap_or(0);
            let node = num("SLURM_NODEID", "run under srun")?.unwrap_or(0);
            let local_world = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"]
                .into_iter()
                .find_map(|k| get(k).map(|v| (k, v)))
                .map(|(k, v)| tasks_on_node(&v, node).ok_or_else(|| bad(format!("{k}={v} has no entry for SLURM_NODEID={node}: expected a list like 4(x2),3"))))
                .transpose()?
                .ok_or_else(|| bad("SLURM_PROCID is set but no SLURM_STEP_TASKS_PER_NODE/SLURM_TASKS_PER_NODE: launch with srun".to_string()))?;
            let first = ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"].into_iter().find_map(&get).map(|v| first_host(&v));
            let master = env_master(&get, first, world)?;
            let spec = WorldSpec { rank, world, local_rank, local_world, master };
            spec.check(n)?;
            return Ok(Some(spec));
        }
        Ok(None)
    }

    /// True for rank 0, which listens, owns the scheduler and broadcasts each step.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }

    /// The consistency rules, worded with `n`'s names.
    fn check(&self, n: &Names) -> Result<()> {
        if self.world == 0 {
            return Err(bad(format!("{}: a world has at least one process", n.show(n.world, 0))));
        }
        if self.rank >= self.world {
            return Err(bad(format!("{} but {}: ranks run 0..{}", n.show(n.rank, self.rank), n.show(n.world, self.world), self.world)));
        }
        if self.local_world == 0 || self.local_world > self.world {
            return Err(bad(format!(
                "{} but {}: a node runs 1..={} of the world's processes",
                n.show(n.local_world, self.local_world),
                n.show(n.world, self.world),
                self.world
            )));
        }
        if self.local_rank >= self.local_world {
            return Err(bad(format!(
                "{} but {}: local ranks run 0..{}",
                n.show(n.local_rank, self.local_rank),
                n.show(n.local_world, self.local_world),
                self.local_world
            )));
        }
        if self.world > 1 {
            check_master(&self.master).map_err(|why| bad(format!("{} {:?}: {why}", n.master, self.master)))?;
        }
        Ok(())
    }
}

/// The spec of each process a node launches: `nnodes` nodes of `procs_per_node` processes
/// each, ranks numbered node-major (node `node_rank`'s process `i` is rank
/// `node_rank * procs_per_node + i`, local rank `i`). Errors name the `--nnodes`,
/// `--node-rank`, `--procs-per-node` and `--master-addr` flags.
pub fn node_specs(nnodes: usize, node_rank: usize, procs_per_node: usize, master: &str) -> Result<Vec<WorldSpec>> {
    if nnodes == 0 {
        return Err(bad("--nnodes 0: a world has at least one node".to_string()));
    }
    if procs_per_node == 0 {
        return Err(bad("--procs-per-node 0: each node runs at least one process".to_string()));
    }
    if node_rank >= nnodes {
        return Err(bad(format!("--node-rank {node_rank} but --nnodes {nnodes}: node ranks run 0..{nnodes}")));
    }
    let world = nnodes * procs_per_node;
    if world > 1 {
        check_master(master).map_err(|why| bad(format!("--master-addr {master:?}: {why}")))?;
    }
    Ok((0..procs_per_node)
        .map(|i| WorldSpec { rank: node_rank * procs_per_node + i, world, local_rank: i, local_world: procs_per_node, master: master.to_string() })
        .collect())
}

/// `host:port` is well formed (a host, a port 1..=65535; IPv6 hosts in brackets).
fn check_master(master: &str) -> std::result::Result<(), String> {
    let fix = "give it as HOST:PORT, the address of rank 0's node and a free port, e.g. 10.0.0.1:29500";
    let Some((host, port)) = master.rsplit_once(':') else {
        return Err(format!("no port; {fix}"));
    };
    if host.is_empty() || (host.contains(':') && !(host.starts_with('[') && host.ends_with(']'))) {
        return Err(format!("bad host {host:?}; {fix} ([::1]:29500 for IPv6)"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("bad port {port:?}; {fix}")),
    }
}

/// `MASTER_ADDR` (or `fallback_host`) with `MASTER_PORT` (or [`DEFAULT_PORT`]). A world of
/// one needs neither.
fn env_master(get: &dyn Fn(&str) -> Option<String>, fallback_host: Option<String>, world: usize) -> Result<String> {
    let port = match get("MASTER_PORT") {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| bad(format!("MASTER_PORT={p} is not a port: set MASTER_PORT to a free port of rank 0's node (1..=65535)")))?,
    };
    let host = match get("MASTER_ADDR").or(fallback_host) {
        Some(h) => h,
        None if world == 1 => return Ok(WorldSpec::single().master),
        None => return Err(bad("MASTER_ADDR is not set: set MASTER_ADDR to the address of rank 0's node".to_string())),
    };
    // `MASTER_ADDR=host:port` with no MASTER_PORT is taken as the whole address.
    if get("MASTER_PORT").is_none() && check_master(&host).is_ok() {
        return Ok(host);
    }
    let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host };
    Ok(format!("{host}:{port}"))
}

/// Slurm's tasks-per-node list (`4(x2),3`: four tasks on each of the first two nodes, three
/// on the third) at node `node`.
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut seen = 0;
    for item in list.split(',') {
        let (count, times) = match item.split_once("(x") {
            Some((c, t)) => (c, t.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (item, 1),
        };
        let count = count.trim().parse::<usize>().ok()?;
        seen += times;
        if node < seen {
            return Some(count);
        }
    }
    None
}

/// The first host of a Slurm node list (`gpu[03-05,9],login1` → `gpu03`), which is where
/// rank 0 (task 0) runs under the default block distribution.
fn first_host(list: &str) -> String {
    let head = match (list.find(','), list.find('[')) {
        (Some(c), Some(b)) if c < b => &list[..c],
        (Some(c), None) => &list[..c],
        _ => list,
    };
    let Some((prefix, rest)) = head.split_once('[') else { return head.to_string() };
    let inside = rest.split(']').next().unwrap_or("");
    let suffix = rest.split_once(']').map(|(_, s)| s.split(',').next().unwrap_or("")).unwrap_or("");
    let first = inside.split(',').next().unwrap_or("").split('-').next().unwrap_or("");
    format!("{prefix}{first}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_lists() {
        assert_eq!(tasks_on_node("4(x2),3", 0), Some(4));
        assert_eq!(tasks_on_node("4(x2),3", 1), Some(4));
        assert_eq!(tasks_on_node("4(x2),3", 2), Some(3));
        assert_eq!(tasks_on_node("4(x2),3", 3), None);
        assert_eq!(tasks_on_node("8", 0), Some(8));
        assert_eq!(first_host("gpu[03-05,9],login1"), "gpu03");
        assert_eq!(first_host("node7,node8"), "node7");
        assert_eq!(first_host("a[1-2]-ib"), "a1-ib");
        assert_eq!(first_host("solo"), "solo");
    }

    #[test]
    fn master_forms() {
        assert!(check_master("10.0.0.1:29500").is_ok());
        assert!(check_master("[::1]:29500").is_ok());
        assert!(check_master("node0").is_err());
        assert!(check_master("::1:29500").is_err());
        assert!(check_master("h:0").is_err());
        assert!(check_master(":29500").is_err());
    }
}
