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
// weights) + 32.

#define ARES_MAX 64

struct AresSrcs { const float* p[ARES_MAX]; };

template <typename OUT>
__device__ void attn_res_norm_impl(AresSrcs srcs, int nsrc, float* __restrict__ P, const float* __restrict__ d, int mode,
                                   float* __restrict__ snap, const float* __restrict__ c, float eps_res,
                                   const float* __restrict__ w, float eps, OUT* __restrict__ out, int h) {
    extern __shared__ float sm[];
    float* mix = sm;                   // [h]
    float* sums = sm + h;              // [ARES_MAX + 1][2]: dot, sum of squares
    float* pw = sums + 2 * (ARES_MAX + 1);       // [ARES_MAX + 1]: softmax weights
    float* scratch = pw + ARES_MAX + 1;          // 32
    const long long base = (long long)blockIdx.x * h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int n = nsrc + 1;
    for (int i = threadIdx.x; i < 2 * n; i += blockDim.x) sums[i] = 0.0f;
    __syncthreads();
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
    if (lane == 0) { atomicAdd(&sums[2 * nsrc], dp); atomicAdd(&sums[2 * nsrc + 1], sp); }
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
        if (lane == 0) { atomicAdd(&sums[2 * i], a); atomicAdd(&sums[2 * i + 1], s); }
    }
    __syncthreads();
    // Softmax over the n logits (n <= 65) in one warp, into pw.
    if (threadIdx.x < 32) {
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
