"""PyTorch reference figures for k3rs issue 10, timed exactly as k3_core::cuda::bench does:
random non-zero inputs, warm-up calls, then back-to-back calls with a CUDA event between each
pair (no host sync in between), median of the event intervals."""
import argparse
import sys
import torch

ap = argparse.ArgumentParser()
ap.add_argument("--warmup", type=int, default=10)
ap.add_argument("--repeats", type=int, default=50)
ap.add_argument("--gemm-only", action="store_true")
args = ap.parse_args()
WARMUP, REPEATS = args.warmup, args.repeats
dev = torch.device("cuda:0")


def rand(shape, dtype, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    mag = torch.rand(shape, device=dev, generator=g) * 0.95 + 0.05
    sign = torch.where(torch.rand(shape, device=dev, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


def time_calls(f, warmup=WARMUP, repeats=REPEATS):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    ev[0].record()
    for e in ev[1:]:
        f()
        e.record()
    torch.cuda.synchronize()
    ms = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(repeats))
    n = len(ms)
    med = ms[n // 2] if n % 2 else 0.5 * (ms[n // 2 - 1] + ms[n // 2])
    return med, ms[0], ms[-1]


def report(op, shape, t, flops=0.0, nbytes=0.0):
    med, lo, hi = t
    rate = f"{flops / (med * 1e-3) / 1e12:7.1f} TFLOP/s" if flops else f"{nbytes / (med * 1e-3) / 1e9:7.1f} GB/s"
    print(f"torch {op:<22} {shape:<22} median {med:9.4f} ms (min {lo:.4f}, max {hi:.4f}, n={REPEATS})  {rate}", flush=True)


print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}", flush=True)
for m, n, k in [(8192, 8192, 8192), (4096, 12288, 7168)]:
    a = rand((m, k), torch.bfloat16, 1)
    b = rand((k, n), torch.bfloat16, 2)  # [K, N]: torch.matmul(a, b)
    w = rand((n, k), torch.bfloat16, 3)  # [N, K]: torch.matmul(a, w.t()) (Linear layout)
    fl = 2.0 * m * n * k
    report("matmul bf16 a@b", f"M={m} N={n} K={k}", time_calls(lambda: torch.matmul(a, b)), flops=fl)
    report("matmul bf16 a@w.t()", f"M={m} N={n} K={k}", time_calls(lambda: torch.matmul(a, w.t())), flops=fl)
    del a, b, w
if args.gemm_only:
    sys.exit(0)
for nbytes in [2 << 30, 256 << 20]:
    src = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    report("copy d2d (copy_)", f"{nbytes / 2**30:.2f} GiB", time_calls(lambda: dst.copy_(src)), nbytes=2.0 * nbytes)
    del src, dst
rows, dim = 16384, 7168
for dt in [torch.bfloat16, torch.float32]:
    x = rand((rows, dim), dt, 4)
    wt = rand((dim,), dt, 5)
    f = lambda: torch.nn.functional.rms_norm(x, (dim,), wt, 1e-6)
    report(f"rms_norm {str(dt)[6:]}", f"{rows}x{dim}", time_calls(f), nbytes=x.element_size() * (2.0 * rows * dim + dim))
sys.stdout.flush()
