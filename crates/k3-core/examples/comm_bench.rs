//! NCCL collective latency through `comm::nccl::CudaGroup`: all-reduce, all-gather and
//! reduce-scatter of bf16 buffers of 1 KB … 1 MB at 1, 2, 4 and 8 ranks, eager and replayed from
//! a CUDA graph, median of many iterations, printed as one table.
//!
//! Sizes are the whole buffer (nccl-tests' convention): all-reduce S bytes in place,
//! all-gather S bytes out (S/W from each rank), reduce-scatter S bytes in (S/W to each rank).
//! "eager" = one call + `CudaGroup::wait` on the host, median over iterations; "graph" = one
//! replay of K captured calls + `wait`, divided by K, median over replays (K and the counts are
//! chosen by rank 0 from a warm-up and broadcast, so every rank makes the same calls).
//!
//! The program re-executes itself as one process per rank (env `K3_COMM_BENCH_CHILD`), each with
//! its own `NCCL_HOSTID` so that several ranks may share ONE GPU on NCCL 2.28: their collectives
//! then go over sockets (loopback), which is what one H200 can measure today — not NVLink.
//!
//! ```text
//! cargo run --release -p k3-core --features cuda --example comm_bench -- \
//!     [--ranks 1,2,4,8] [--sizes 1K,8K,64K,1M] [--budget-ms 800]
//! ```

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k3_core::comm::nccl::{nccl_library, CudaGroup};
use k3_core::cuda::{capture, CudaDevice, CudaTensor};
use k3_core::DType;

#[path = "../tests/cuda_common/nccl_id.rs"]
mod nccl_id;
use nccl_id::exchange_id;

struct Args {
    ranks: Vec<usize>,
    sizes: Vec<usize>,
    budget: Duration,
}

fn parse_size(s: &str) -> usize {
    let s = s.trim().to_ascii_uppercase();
    let (num, mul) = match s.strip_suffix('M') {
        Some(n) => (n, 1 << 20),
        None => match s.strip_suffix('K') {
            Some(n) => (n, 1 << 10),
            None => (s.as_str(), 1),
        },
    };
    num.parse::<usize>().unwrap_or_else(|_| panic!("bad size {s}")) * mul
}

fn args() -> Args {
    let mut a = Args { ranks: vec![1, 2, 4, 8], sizes: ["1K", "8K", "64K", "1M"].map(parse_size).to_vec(), budget: Duration::from_millis(800) };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let val = v.get(i + 1).cloned().unwrap_or_default();
        match v[i].as_str() {
            "--ranks" => a.ranks = val.split(',').map(|s| s.trim().parse().expect("--ranks 1,2,4,8")).collect(),
            "--sizes" => a.sizes = val.split(',').map(parse_size).collect(),
            "--budget-ms" => a.budget = Duration::from_millis(val.parse().expect("--budget-ms N")),
            "--bench" => {
                i += 1;
                continue;
            }
            o => panic!("unknown argument {o} (see the file's header)"),
        }
        i += 2;
    }
    a
}

fn human(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MB", b >> 20)
    } else if b >= 1 << 10 {
        format!("{} KB", b >> 10)
    } else {
        format!("{b} B")
    }
}

fn main() {
    let a = args();
    if let Ok(spec) = std::env::var("K3_COMM_BENCH_CHILD") {
        let p: Vec<&str> = spec.splitn(3, ':').collect();
        child(&a, p[0].parse().unwrap(), p[1].parse().unwrap(), Path::new(p[2]));
        return;
    }
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("comm_bench: skipped: {e}");
            return;
        }
    };
    let (path, version) = match nccl_library() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("comm_bench: skipped: {e}");
            return;
        }
    };
    println!("comm_bench: {}", dev.info());
    println!("NCCL {version} from {path}");
    println!("ranks > 1 share this ONE GPU (a distinct NCCL_HOSTID per process), so their collectives go over");
    println!("sockets on loopback (NET/Socket): correctness-grade figures, not NVLink ones. bf16; size = whole buffer.");
    println!("eager = one call + wait (median); graph = one replay of K calls + wait, per call (median)\n");
    drop(dev);
    println!("{:>5}  {:<14} {:>7}  {:>12}  {:>12}  {:>14}", "ranks", "op", "size", "eager µs", "graph µs", "iters (K×reps)");
    let exe = std::env::current_exe().expect("own path");
    for &w in &a.ranks {
        let dir = std::env::temp_dir().join(format!("k3-comm-bench-{}-{w}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t0 = Instant::now();
        let mut kids: Vec<_> = (0..w)
            .map(|r| {
                let mut c = Command::new(&exe);
                c.args(std::env::args().skip(1))
                    .env("K3_COMM_BENCH_CHILD", format!("{r}:{w}:{}", dir.display()))
                    .stdin(Stdio::null())
                    .stdout(std::fs::File::create(dir.join(format!("rank{r}.out"))).unwrap())
                    .stderr(std::fs::File::create(dir.join(format!("rank{r}.err"))).unwrap());
                if w > 1 {
                    c.env("NCCL_HOSTID", format!("k3rs-bench-rank{r}"));
                }
                c.spawn().expect("spawning a rank")
            })
            .collect();
        let codes: Vec<_> = kids.iter_mut().map(|c| c.wait().map(|s| s.code())).collect();
        if std::env::var_os("K3_COMM_BENCH_LOGS").is_some() {
            // Rank 0's own output, e.g. NCCL_DEBUG=INFO lines (NCCL writes them to stdout).
            eprint!("{}", ["out", "err"].map(|e| std::fs::read_to_string(dir.join(format!("rank0.{e}"))).unwrap_or_default()).concat());
        }
        print!("{}", std::fs::read_to_string(dir.join("rows")).unwrap_or_default());
        if codes.iter().any(|c| !matches!(c, Ok(Some(0)))) {
            println!("{w} ranks: a rank failed ({codes:?}); rank 0 said:\n{}", std::fs::read_to_string(dir.join("rank0.err")).unwrap_or_default());
            for r in 1..w {
                eprint!("{}", std::fs::read_to_string(dir.join(format!("rank{r}.err"))).unwrap_or_default());
            }
        }
        println!("{:>5}  ({} ranks: {:.1} s wall, start-up included)", "", w, t0.elapsed().as_secs_f64());
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Rank 0's values to every rank (the plan every rank must follow).
fn agree(dev: &CudaDevice, g: &CudaGroup, v: [i32; 3]) -> [i32; 3] {
    let t = CudaTensor::from_pod(dev, DType::I32, vec![3], &v).unwrap();
    g.broadcast(0, &t).unwrap();
    g.wait("comm_bench plan").unwrap();
    bytemuck::pod_collect_to_vec::<u8, i32>(&t.to_bytes().unwrap()).try_into().unwrap()
}

fn child(a: &Args, rank: usize, world: usize, dir: &Path) {
    let dev = CudaDevice::new(0).expect("device");
    let id = exchange_id(rank, dir);
    let g = CudaGroup::nccl(&dev, rank, world, id).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let mut rows = String::new(); // rank 0's table rows, to a file (NCCL_DEBUG output shares stdout)
    for op in ["all_reduce_sum", "all_gather", "reduce_scatter"] {
        for &bytes in &a.sizes {
            let n = (bytes / 2).div_ceil(world) * world; // bf16 elements, a multiple of W
            let big = CudaTensor::zeros(&dev, DType::BF16, vec![n]).unwrap();
            let part = CudaTensor::zeros(&dev, DType::BF16, vec![n / world]).unwrap();
            let call = || match op {
                "all_reduce_sum" => g.all_reduce_sum(&big),
                "all_gather" => g.all_gather(&part, &big),
                _ => g.reduce_scatter(&big, &part),
            };
            let timed = |f: &dyn Fn()| {
                let t = Instant::now();
                f();
                g.wait(op).unwrap();
                t.elapsed().as_secs_f64()
            };
            let warm: Vec<f64> = (0..3).map(|_| timed(&|| call().unwrap())).collect();
            let t1 = median(warm).max(1e-7);
            let budget = a.budget.as_secs_f64() / 2.0;
            let plan = [(budget / t1).clamp(5.0, 2000.0) as i32, (5e-3 / t1).clamp(1.0, 64.0) as i32, 0];
            let plan = agree(&dev, &g, [plan[0], plan[1], (budget / (t1 * plan[1] as f64)).clamp(3.0, 500.0) as i32]);
            let (iters, k, reps) = (plan[0] as usize, plan[1] as usize, plan[2] as usize);
            g.barrier().unwrap();
            let eager = median((0..iters).map(|_| timed(&|| call().unwrap())).collect());
            g.barrier().unwrap();
            let graph = capture(&dev, || (0..k).try_for_each(|_| call())).expect("capture");
            timed(&|| graph.launch().unwrap());
            let replay = median((0..reps).map(|_| timed(&|| graph.launch().unwrap())).collect()) / k as f64;
            g.barrier().unwrap();
            if rank == 0 {
                rows += &format!(
                    "{world:>5}  {op:<14} {:>7}  {:>12.1}  {:>12.1}  {:>14}\n",
                    human(bytes),
                    eager * 1e6,
                    replay * 1e6,
                    format!("{iters} / {k}×{reps}")
                );
                std::fs::write(dir.join("rows"), &rows).unwrap();
            }
        }
    }
    g.barrier().unwrap();
}
