//! Standalone CUDA benchmark over `k3_core::cuda::bench` (the same function
//! `k3 bench --device cuda` calls), for measuring before the CLI exists.
//!
//! ```text
//! cargo build --release -p k3-core --features cuda --example cuda_bench
//! cuda_bench                                   # the standard suite (issue 10's figures)
//! cuda_bench gemm-suite                        # only the tuned bf16 GEMMs of the suite
//! cuda_bench gemv-suite                        # decode GEMV vs cuBLASLt at K3's projection shapes
//! cuda_bench gemm 4096 12288 7168              # one case: gemm M N K | gemv M N K | copy BYTES | rmsnorm ROWS DIM
//! cuda_bench --warmup 10 --repeats 50 copy 2147483648
//! ```

use k3_core::cuda::bench::{bench_op, BenchOp};
use k3_core::cuda::blas::{Algo, Backend, GemmOptions, Layout};
use k3_core::cuda::CudaDevice;
use k3_core::DType;

fn usage() -> ! {
    eprintln!("usage: cuda_bench [--warmup N] [--repeats N] [gemm-suite | gemv-suite | gemm M N K | gemv M N K | copy BYTES | rmsnorm ROWS DIM]");
    std::process::exit(2)
}

fn suite() -> Vec<BenchOp> {
    let mut v = Vec::new();
    let lt = |algo| GemmOptions { backend: Backend::Lt, algo };
    let cublas = GemmOptions { backend: Backend::Cublas, algo: Algo::Auto };
    for (m, n, k) in [(8192, 8192, 8192), (4096, 12288, 7168)] {
        for (layout, opts) in [
            (Layout::B, lt(Algo::Tuned)),
            (Layout::BT, lt(Algo::Tuned)),
            (Layout::B, lt(Algo::Heuristic)),
            (Layout::BT, lt(Algo::Heuristic)),
            (Layout::B, cublas),
            (Layout::BT, cublas),
        ] {
            v.push(BenchOp::Gemm { m, n, k, dtype: DType::BF16, layout, opts });
        }
    }
    v.push(BenchOp::Gemm { m: 4096, n: 4096, k: 4096, dtype: DType::F32, layout: Layout::BT, opts: lt(Algo::Auto) });
    v.push(BenchOp::Copy { bytes: 2 << 30 });
    v.push(BenchOp::Copy { bytes: 256 << 20 });
    v.push(BenchOp::RmsNorm { rows: 16384, dim: 7168, dtype: DType::BF16 });
    v.push(BenchOp::RmsNorm { rows: 16384, dim: 7168, dtype: DType::F32 });
    v.push(BenchOp::RmsNorm { rows: 1, dim: 7168, dtype: DType::BF16 });
    v
}

/// K3's decode projections at batch 1, 2, 4 and 8 (M N K), each as our GEMV beside cuBLASLt's GEMM
/// (F32 output, the heuristic's algorithm, as the model calls it): KDA q/k/v/gate fused
/// (4·12288 + 96 + 128 rows), `o_proj`, the LatentMoE input side (router 896 + latent 3584 +
/// shared gate/up 2·6144), its latent up-projection, and the lm_head.
fn gemv_suite() -> Vec<BenchOp> {
    let mut v = Vec::new();
    for m in [1, 2, 4, 8] {
        for (n, k) in [(49376, 7168), (7168, 12288), (16768, 7168), (7168, 3584), (163840, 7168)] {
            v.push(BenchOp::Gemv { m, n, k });
            v.push(BenchOp::Gemm { m, n, k, dtype: DType::BF16, layout: Layout::BT, opts: GemmOptions { backend: Backend::Lt, algo: Algo::Heuristic } });
        }
    }
    v
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let (mut warmup, mut repeats) = (10usize, 50usize);
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].clone();
        if flag == "--warmup" || flag == "--repeats" {
            let Some(v) = args.get(i + 1).and_then(|s| s.parse().ok()) else { usage() };
            if flag == "--warmup" {
                warmup = v
            } else {
                repeats = v
            }
            args.drain(i..i + 2);
        } else {
            i += 1;
        }
    }
    let ops = match args.split_first() {
        None => suite(),
        Some((op, _)) if op == "gemm-suite" => suite()
            .into_iter()
            .filter(|o| matches!(o, BenchOp::Gemm { dtype: DType::BF16, opts: GemmOptions { backend: Backend::Lt, algo: Algo::Tuned }, .. }))
            .collect(),
        Some((op, _)) if op == "gemv-suite" => gemv_suite(),
        Some((op, rest)) => {
            let dims: Option<Vec<usize>> = rest.iter().map(|s| s.parse().ok()).collect();
            let Some(dims) = dims else { usage() };
            match BenchOp::from_cli(op, &dims) {
                Ok(o) => vec![o],
                Err(e) => {
                    eprintln!("{e}");
                    usage()
                }
            }
        }
    };
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuda_bench: {e}");
            std::process::exit(1)
        }
    };
    println!("{}", dev.info());
    println!("method: {warmup} warm-up calls, then {repeats} back-to-back calls with CUDA events between them; median");
    let mut failed = false;
    for op in &ops {
        match bench_op(&dev, op, warmup, repeats) {
            Ok(r) => println!("{r}"),
            Err(e) => {
                failed = true;
                println!("{op:?}: FAILED: {e}")
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
