// attn_res.cu: Block Attention Residuals (text-backbone §6) fused with the running-sum update,
// the optional block snapshot, and the RMSNorm that follows every mix (CPU oracle:
// k3-model layers/attn_res.rs `AttnRes::mix` + kernels/cpu/norm.rs `rms_norm_inplace`).
//
// One thread block per token row (width h). Sources: `nsrc` completed blocks (f32 [N, h] each,
// addresses passed by value in AresSrcs) followed by the partial sum P (f32 [N, h]), which is
// first updated in place: mode 0 leaves P, mode 1 does P += d, mode 2 does P = d. When `snap`
// is not null the updated P is also copied there (a new completed block). Then, per source v:
// logit = (v·c) / sqrt(mean(v²) + eps_res), p = softmax(logits), m = Σ p·v (raw sources), and
// out = m / sqrt(mean(m²) + eps) · w (w f32), stored as OUT (bf16 for the next GEMM, or f32).
// Dynamic shared memory: h floats (the mix) + 3·(ARES_MAX+1) floats (per-source sums and
// weights) + 32 + (blockDim/32)·2·(nsrc+1) (each warp's partial sums).
// Deterministic: the per-source sums add the warps' partials in warp order (no float atomics),
// so a forward gives the same bits run after run.

#define ARES_MAX 64

struct AresSrcs { const float* p[ARES_MAX]; };

// Softmax over the n <= 65 source logits, one warp: logit_i = (v_i·c) / sqrt(mean(v_i²) + eps_res)
// from sums[2i] = v_i·c and sums[2i+1] = v_i·v_i; weights into pw[0..n).
__device__ __forceinline__ void ares_softmax(const float* sums, int n, int h, float eps_res, float* pw) {
    const int lane = threadIdx.x & 31;
    float lg[3], mx = -K3_INF;
    for (int k = 0; k < 3; k++) {
        int i = lane + 32 * k;
        lg[k] = (i < n) ? sums[2 * i] / sqrtf(sums[2 * i + 1] / (float)h + eps_res) : -K3_INF;
        mx = fmaxf(mx, lg[k]);
    }
    mx = warp_max(mx);
    float e[3], den = 0.0f;
    for (int k = 0; k < 3; k++) { e[k] = (lane + 32 * k < n) ? expf(lg[k] - mx) : 0.0f; den += e[k]; }
    den = warp_sum(den);
    __syncwarp();
    for (int k = 0; k < 3; k++) if (lane + 32 * k < n) pw[lane + 32 * k] = e[k] / den;
}

template <typename OUT>
__device__ void attn_res_norm_impl(AresSrcs srcs, int nsrc, float* __restrict__ P, const float* __restrict__ d, int mode,
                                   float* __restrict__ snap, const float* __restrict__ c, float eps_res,
                                   const float* __restrict__ w, float eps, OUT* __restrict__ out, int h) {
    extern __shared__ float sm[];
    float* mix = sm;                   // [h]
    float* sums = sm + h;              // [ARES_MAX + 1][2]: dot, sum of squares
    float* pw = sums + 2 * (ARES_MAX + 1);       // [ARES_MAX + 1]: softmax weights
    float* scratch = pw + ARES_MAX + 1;          // 32
    float* wpart = scratch + 32;                 // [nw][2n]: each warp's partial sums
    const long long base = (long long)blockIdx.x * h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int n = nsrc + 1;
    float* mine = wpart + warp * 2 * n;
    // The partial sum P: update, snapshot, and its dot / square sums.
    float dp = 0.0f, sp = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float v = P[base + j];
        if (mode == 1) v += d[base + j];
        else if (mode == 2) v = d[base + j];
        if (mode != 0) P[base + j] = v;
        if (snap) snap[base + j] = v;
        dp += v * c[j];
        sp += v * v;
    }
    dp = warp_sum(dp);
    sp = warp_sum(sp);
    if (lane == 0) { mine[2 * nsrc] = dp; mine[2 * nsrc + 1] = sp; }
    for (int i = 0; i < nsrc; i++) {
        const float* v = srcs.p[i] + base;
        float a = 0.0f, s = 0.0f;
        for (int j = threadIdx.x; j < h; j += blockDim.x) {
            float x = v[j];
            a += x * c[j];
            s += x * x;
        }
        a = warp_sum(a);
        s = warp_sum(s);
        if (lane == 0) { mine[2 * i] = a; mine[2 * i + 1] = s; }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * n; i += blockDim.x) {
        float t = 0.0f;
        for (int k = 0; k < nw; k++) t += wpart[k * 2 * n + i];  // warp order
        sums[i] = t;
    }
    __syncthreads();
    // Softmax over the n logits (n <= 65) in one warp, into pw.
    if (threadIdx.x < 32) ares_softmax(sums, n, h, eps_res, pw);
    __syncthreads();
    float ss = 0.0f;
    for (int j = threadIdx.x; j < h; j += blockDim.x) {
        float m = 0.0f;
        for (int i = 0; i < nsrc; i++) m += pw[i] * srcs.p[i][base + j];
        m += pw[nsrc] * P[base + j];
        mix[j] = m;
        ss += m * m;
    }
    (void)warp; (void)nw;
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int j = threadIdx.x; j < h; j += blockDim.x) st(out, base + j, mix[j] * inv * w[j]);
}

extern "C" __global__ void attn_res_norm_bf16(AresSrcs srcs, int nsrc, float* P, const float* d, int mode, float* snap,
                                              const float* c, float eps_res, const float* w, float eps, bf16_t* out, int h) {
    attn_res_norm_impl(srcs, nsrc, P, d, mode, snap, c, eps_res, w, eps, out, h);
}
extern "C" __global__ void attn_res_norm_f32(AresSrcs srcs, int nsrc, float* P, const float* d, int mode, float* snap,
                                             const float* c, float eps_res, const float* w, float eps, float* out, int h) {
    attn_res_norm_impl(srcs, nsrc, P, d, mode, snap, c, eps_res, w, eps, out, h);
}

// ---- Split form for a few rows (decode): the same result from three short kernels whose grid is
// (S column slices of ARES_SL, rows) instead of one block per row, so a decode step's mix is
// spread over S SMs instead of walking 7168-wide rows on one. Needs h % 4 == 0 (float4 access).
//   attn_res_stats: P update + snapshot on the slice, per-source (v·c, v·v) slice partials
//                   -> part [rows, S, 2(nsrc+1)] (the 4 warps' partials added in warp order).
//   attn_res_mix:   every block reduces its row's partials, softmax, mix of its slice
//                   -> mix [rows, h] (f32) and its sum of squares -> msq [rows, S].
//   attn_res_scale: out = mix / sqrt(mean(mix²) + eps) · w on the slice.
#define ARES_SL 512
#define ARES_ST 128

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

extern "C" __global__ void __launch_bounds__(ARES_ST) attn_res_stats(AresSrcs srcs, int nsrc, float* __restrict__ P,
        const float* __restrict__ d, int mode, float* __restrict__ snap, const float* __restrict__ c,
        float* __restrict__ part, int h) {
    __shared__ float wpart[ARES_ST / 32][2 * (ARES_MAX + 1)];  // each warp's partial sums
    const int n = nsrc + 1, S = gridDim.x, s = blockIdx.x, row = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long base = (long long)row * h;
    const int j = s * ARES_SL + threadIdx.x * 4;
    const bool in = j < h;
    float4 cv = in ? ld4(c + j) : make_float4(0.f, 0.f, 0.f, 0.f);
    float4 v = in ? ld4(P + base + j) : cv;
    if (in && mode != 0) {
        float4 dv = ld4(d + base + j);
        if (mode == 1) { v.x += dv.x; v.y += dv.y; v.z += dv.z; v.w += dv.w; } else v = dv;
        *reinterpret_cast<float4*>(P + base + j) = v;
    }
    if (in && snap) *reinterpret_cast<float4*>(snap + base + j) = v;
    float a = in ? dot4(v, cv) : 0.0f, q = in ? dot4(v, v) : 0.0f;
    a = warp_sum(a); q = warp_sum(q);
    if (lane == 0) { wpart[warp][2 * nsrc] = a; wpart[warp][2 * nsrc + 1] = q; }
    for (int i0 = 0; i0 < nsrc; i0 += 4) {
        float4 x[4];  // four sources' loads in flight before any reduction
#pragma unroll
        for (int u = 0; u < 4; u++) x[u] = (in && i0 + u < nsrc) ? ld4(srcs.p[i0 + u] + base + j) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (i0 + u >= nsrc) break;
            float ai = warp_sum(dot4(x[u], cv)), qi = warp_sum(dot4(x[u], x[u]));
            if (lane == 0) { wpart[warp][2 * (i0 + u)] = ai; wpart[warp][2 * (i0 + u) + 1] = qi; }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * n; i += blockDim.x) {
        float t = 0.0f;
        for (int k = 0; k < ARES_ST / 32; k++) t += wpart[k][i];  // warp order
        part[((long long)row * S + s) * 2 * n + i] = t;
    }
}

extern "C" __global__ void __launch_bounds__(ARES_ST) attn_res_mix(AresSrcs srcs, int nsrc, const float* __restrict__ P,
        float eps_res, const float* __restrict__ part, float* __restrict__ mix, float* __restrict__ msq, int h) {
    __shared__ float sums[2 * (ARES_MAX + 1)];
    __shared__ float pw[ARES_MAX + 1];
    __shared__ float scratch[32];
    const int n = nsrc + 1, S = gridDim.x, s = blockIdx.x, row = blockIdx.y;
    const long long base = (long long)row * h;
    for (int i = threadIdx.x; i < 2 * n; i += blockDim.x) {
        float t = 0.0f;
        for (int k = 0; k < S; k++) t += part[((long long)row * S + k) * 2 * n + i];
        sums[i] = t;
    }
    __syncthreads();
    if (threadIdx.x < 32) ares_softmax(sums, n, h, eps_res, pw);
    __syncthreads();
    const int j = s * ARES_SL + threadIdx.x * 4;
    float q = 0.0f;
    if (j < h) {
        float4 m = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
        for (int i = 0; i < nsrc; i++) {
            float4 x = ld4(srcs.p[i] + base + j);
            float p = pw[i];
            m.x += p * x.x; m.y += p * x.y; m.z += p * x.z; m.w += p * x.w;
        }
        float4 x = ld4(P + base + j);
        float p = pw[nsrc];
        m.x += p * x.x; m.y += p * x.y; m.z += p * x.z; m.w += p * x.w;
        *reinterpret_cast<float4*>(mix + base + j) = m;
        q = dot4(m, m);
    }
    q = block_sum(q, scratch);
    if (threadIdx.x == 0) msq[(long long)row * S + s] = q;
}

template <typename OUT>
__device__ void attn_res_scale_impl(const float* __restrict__ mix, const float* __restrict__ msq, const float* __restrict__ w,
                                    float eps, OUT* __restrict__ out, int h) {
    const int S = gridDim.x, s = blockIdx.x, row = blockIdx.y;
    float t = 0.0f;
    for (int k = 0; k < S; k++) t += msq[(long long)row * S + k];  // same order in every block
    const float inv = 1.0f / sqrtf(t / (float)h + eps);
    const long long base = (long long)row * h;
    const int j = s * ARES_SL + threadIdx.x * 4;
    if (j < h) {
        float4 m = ld4(mix + base + j), wv = ld4(w + j);
        st(out, base + j, m.x * inv * wv.x);
        st(out, base + j + 1, m.y * inv * wv.y);
        st(out, base + j + 2, m.z * inv * wv.z);
        st(out, base + j + 3, m.w * inv * wv.w);
    }
}
extern "C" __global__ void __launch_bounds__(ARES_ST) attn_res_scale_bf16(const float* mix, const float* msq, const float* w, float eps, bf16_t* out, int h) {
    attn_res_scale_impl(mix, msq, w, eps, out, h);
}
extern "C" __global__ void __launch_bounds__(ARES_ST) attn_res_scale_f32(const float* mix, const float* msq, const float* w, float eps, float* out, int h) {
    attn_res_scale_impl(mix, msq, w, eps, out, h);
}
