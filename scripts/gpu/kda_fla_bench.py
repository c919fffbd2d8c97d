#!/usr/bin/env python3
"""flash-linear-attention 0.6.0 reference timings for KDA on the same shapes and with the same
method as crates/k3-core/examples/kda_bench.rs (CUDA events, warm, medians; decode as one step
captured in a CUDA graph, 100 replays between two events, median of 30), plus a cross-check
of our fused prefill output (dumped by `kda_bench --dump DIR`) against conv + fla chunk_kda +
RMSNorm x sigmoid(gate) in torch on the same inputs.  Usage: kda_fla_bench.py [DIR]
(FLA_DECODE_ONLY=1: the decode timings only, without chunk_kda's autotuning)"""
import os, sys
import numpy as np
import torch
import torch.nn.functional as F
from fla.ops.kda import chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

H, K = 96, 128
dev = "cuda"


def med(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def time_ms(f, warm=3, reps=20):
    for _ in range(warm):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return med(ts)


def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
    m = 0.05 + 0.95 * torch.rand(*shape, device=dev)
    s = torch.where(torch.rand(*shape, device=dev) < 0.5, -1.0, 1.0)
    return (m * s * scale).to(dtype)


def prefill(T):
    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K)
    g = rnd(1, T, H, K, scale=3.0)
    beta = torch.sigmoid(rnd(1, T, H, scale=3.0).float()).to(torch.bfloat16)
    A_log = rnd(H, dtype=torch.float32)
    dt_bias = rnd(H * K, scale=2.0, dtype=torch.float32)
    h0 = rnd(1, H, K, K, scale=0.1, dtype=torch.float32)
    f = lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True,
                          lower_bound=-5.0, A_log=A_log, dt_bias=dt_bias)
    return time_ms(f)


def decode(B):
    q, k, v = rnd(B, 1, H, K), rnd(B, 1, H, K), rnd(B, 1, H, K)
    g = rnd(B, 1, H, K, scale=3.0)
    beta = rnd(B, 1, H, scale=3.0)
    A_log = rnd(H, dtype=torch.float32)
    dt_bias = rnd(H * K, scale=2.0, dtype=torch.float32)
    st = rnd(B, H, K, K, scale=0.1, dtype=torch.float32)
    out = torch.empty_like(v)
    f = lambda: fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=st,
                                        inplace_final_state=True, use_qk_l2norm_in_kernel=True,
                                        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                        lower_bound=-5.0, out=out)
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        f()
    for _ in range(50):
        gr.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(100):
            gr.replay()
        b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / 100)
    return med(ts)


def load(d, name, dtype, shape):
    a = np.fromfile(os.path.join(d, name + ".bin"), dtype=np.uint16 if dtype == torch.bfloat16 else np.float32)
    t = torch.from_numpy(a.view(np.int16) if dtype == torch.bfloat16 else a).to(dev)
    return (t.view(torch.bfloat16) if dtype == torch.bfloat16 else t).reshape(shape)


def crosscheck(d, T=4096):
    D = H * K
    bf, f32 = torch.bfloat16, torch.float32
    raw = [load(d, n, bf, (T, D)) for n in ("q", "k", "v")]
    g, gate = load(d, "g", bf, (T, D)), load(d, "gate", bf, (T, D))
    beta = load(d, "beta", bf, (T, H))
    cw = load(d, "conv_w", f32, (3, D, 4)); a_log = load(d, "a_log", f32, (H,))
    dtb = load(d, "dt_bias", f32, (D,)); onw = load(d, "o_norm", f32, (K,))
    c0 = load(d, "conv0", bf, (3, 3, D)); s0 = load(d, "s0", f32, (1, H, K, K))
    ours = load(d, "out", bf, (T, D)).float()
    qkv = []
    for i in range(3):
        x = torch.cat([c0[i].float(), raw[i].float()], 0)  # [3+T, D]
        y = F.conv1d(x.t().unsqueeze(0), cw[i].unsqueeze(1), groups=D)[0].t()  # [T, D]
        qkv.append(F.silu(y).to(bf).view(1, T, H, K))
    o, _ = chunk_kda(qkv[0], qkv[1], qkv[2], g.view(1, T, H, K), torch.sigmoid(beta.float()).view(1, T, H),
                     initial_state=s0.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                     use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=a_log, dt_bias=dtb)
    o = o.float().view(T, H, K)
    y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * onw * torch.sigmoid(gate.float().view(T, H, K))
    y = y.view(T, D)
    rel = ((ours - y).norm() / y.norm()).item()
    print(f"cross-check T={T}: ours vs conv+fla chunk_kda+norm/gate (bf16 conv outputs) rel L2 {rel:.2e}")


if __name__ == "__main__":
    torch.manual_seed(0)
    print("torch", torch.__version__, torch.cuda.get_device_name())
    if len(sys.argv) > 1:
        crosscheck(sys.argv[1])
    for T in () if os.environ.get("FLA_DECODE_ONLY") else (4096, 16384):
        print(f"fla chunk_kda T={T}: {prefill(T):.4f} ms")
    for B in (1, 64):
        ms = decode(B)
        by = 2 * B * H * K * K * 4
        print(f"fla fused_recurrent_kda_fwd B={B}: graph {ms*1e3:.2f} us/step ({by/ms/1e6:.0f} GB/s state)")
