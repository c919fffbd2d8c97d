// kda_decode.cu: the KDA decode step (text-backbone §3.8: conv-state shift, §3.2-3.3 gates,
// one step of the §3.4 recurrence, §3.6 output norm and gate), head_dim 128, state f32 in place.
// CPU oracle: kernels/cpu/kda.rs `kda_recurrent` plus k3-model layers/kda.rs.
// Two kernels compute the same step: kda_decode (one block per head and sequence) and
// kda_decode_split (a 2-block cluster per head and sequence, 64 value columns each).
// States live in a pool of S slots: sequence b (input / output row b) uses slot slots[b]
// (device i32 [B], filled before a graph replay); a slot outside [0, S) makes its blocks
// return without writing anything.

#define KD 128

// One channel's short conv + SiLU (§3.2): taps = the 3 stored raw inputs of the channel (`cs`,
// stride D, oldest first) and the current raw input x3; `keep` receives the shifted taps the
// caller stores back.
__device__ __forceinline__ float conv_silu(const bf16_t* __restrict__ cs, long long D, const float* __restrict__ w, bf16_t x3, bf16_t keep[3]) {
    const bf16_t x0 = cs[0], x1 = cs[D], x2 = cs[2 * D];
    const float y = w[0] * bf16_to_f32(x0) + w[1] * bf16_to_f32(x1) + w[2] * bf16_to_f32(x2) + w[3] * bf16_to_f32(x3);
    keep[0] = x1; keep[1] = x2; keep[2] = x3;
    return silu_ftz(y);
}

// The per-channel decay exp(g) with the lower-bounded gate (§3.3).
__device__ __forceinline__ float decay(float lower_bound, float a_log, bf16_t graw, float dt_bias) {
    return exp_ftz(lower_bound * sigmoid_ftz(exp_ftz(a_log) * (bf16_to_f32(graw) + dt_bias)));
}

// ------------------------------------------------------------------------------------------
// Decode: one token per sequence; block (256 threads) per (head, sequence). Thread = (row
// group rg of 16 state rows, 4 consecutive columns). State f32 [S][H][128][128] in place,
// conv state bf16 [S][3][3][D] in place, both indexed by slot.
extern "C" __global__ void __launch_bounds__(256)
kda_decode(const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
           const bf16_t* __restrict__ graw, const bf16_t* __restrict__ braw, const bf16_t* __restrict__ gate,
           const float* __restrict__ convw, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
           const float* __restrict__ onorm_w, bf16_t* __restrict__ conv_state, float* __restrict__ state,
           const int* __restrict__ slots, bf16_t* __restrict__ out, int H, int nslots, float lower_bound, float eps) {
    __shared__ float sq[KD], sk[KD], sv[KD], se[KD], su[KD], red[8][KD], misc[16];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, cg = tid & 31, rg = tid >> 5;
    const int h = blockIdx.x, b = blockIdx.y, D = H * KD;
    const int sl = slots[b];
    if (sl < 0 || sl >= nslots) return;
    float4* S = reinterpret_cast<float4*>(state + ((long long)sl * H + h) * (KD * KD));
    float4 s[16];
#pragma unroll
    for (int r = 0; r < 16; r++) s[r] = S[(rg * 16 + r) * 32 + cg];

    if (tid < KD) {
        const int col = h * KD + tid;
        const long long row = (long long)b * D + col;
        float qq = 0.0f, kk = 0.0f;
        for (int which = 0; which < 3; which++) {
            const bf16_t* X = which == 0 ? qr : which == 1 ? kr : vr;
            bf16_t* cs = conv_state + ((long long)sl * 3 + which) * 3 * D + col;
            bf16_t keep[3];
            const float a = conv_silu(cs, D, convw + ((long long)which * D + col) * 4, X[row], keep);
            cs[0] = keep[0]; cs[D] = keep[1]; cs[2 * (long long)D] = keep[2];
            if (which == 0) { sq[tid] = a; qq = a * a; }
            else if (which == 1) { sk[tid] = a; kk = a * a; }
            else sv[tid] = a;
        }
        se[tid] = decay(lower_bound, a_log[h], graw[row], dt_bias[col]);
        qq = warp_sum(qq); kk = warp_sum(kk);
        if (lane == 0) { misc[wp] = qq; misc[4 + wp] = kk; }
    }
    __syncthreads();
    const float qi = 0.08838834764831845f / sqrtf(misc[0] + misc[1] + misc[2] + misc[3] + 1e-6f);
    const float ki = 1.0f / sqrtf(misc[4] + misc[5] + misc[6] + misc[7] + 1e-6f);
    const float beta = sigmoid_ftz(bf16_to_f32(braw[(long long)b * H + h]));
    float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const int row = rg * 16 + r;
        const float e = se[row], k = sk[row] * ki;
        s[r].x *= e; s[r].y *= e; s[r].z *= e; s[r].w *= e;
        p.x += k * s[r].x; p.y += k * s[r].y; p.z += k * s[r].z; p.w += k * s[r].w;
    }
    *reinterpret_cast<float4*>(&red[rg][4 * cg]) = p;
    __syncthreads();
    if (tid < KD) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc += red[i][tid];
        su[tid] = beta * (sv[tid] - acc);
    }
    __syncthreads();
    const float4 u = *reinterpret_cast<const float4*>(&su[4 * cg]);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const int row = rg * 16 + r;
        const float k = sk[row] * ki, q = sq[row] * qi;
        s[r].x += k * u.x; s[r].y += k * u.y; s[r].z += k * u.z; s[r].w += k * u.w;
        o.x += q * s[r].x; o.y += q * s[r].y; o.z += q * s[r].z; o.w += q * s[r].w;
        S[row * 32 + cg] = s[r];
    }
    *reinterpret_cast<float4*>(&red[rg][4 * cg]) = o;
    __syncthreads();
    if (tid < KD) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc += red[i][tid];
        const float ss = warp_sum(acc * acc);
        if (lane == 0) misc[8 + wp] = ss;
        su[tid] = acc;
    }
    __syncthreads();
    if (tid < KD) {
        const float inv = 1.0f / sqrtf((misc[8] + misc[9] + misc[10] + misc[11]) * (1.0f / KD) + eps);
        const long long row = (long long)b * D + h * KD + tid;
        out[row] = f32_to_bf16(su[tid] * inv * onorm_w[tid] * sigmoid_ftz(bf16_to_f32(gate[row])));
    }
}

// ------------------------------------------------------------------------------------------
// Decode, split variant: a cluster of 2 blocks per (head, sequence), each owning 64 of the 128
// value columns (columns of S are independent in the recurrence); the output RMSNorm's sum of
// squares is exchanged through distributed shared memory. Half the registers per block, so
// 3 blocks share an SM, and twice the blocks at batch 1. Thread = (16 row groups of 8 rows,
// 16 groups of 4 columns). Grid (2H, B).
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ float ld_peer_f32(const float* p, unsigned rank) {
    unsigned a = smem_u32(p), r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
}

extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256, 3)
kda_decode_split(const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
                 const bf16_t* __restrict__ graw, const bf16_t* __restrict__ braw, const bf16_t* __restrict__ gate,
                 const float* __restrict__ convw, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                 const float* __restrict__ onorm_w, bf16_t* __restrict__ conv_state, float* __restrict__ state,
                 const int* __restrict__ slots, bf16_t* __restrict__ out, int H, int nslots, float lower_bound, float eps) {
    __shared__ float sq[KD], sk[KD], sv[64], se[KD], su[64], red[16][64], misc[16];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, cg = tid & 15, rg = tid >> 4;
    const int h = blockIdx.x >> 1, half = blockIdx.x & 1, b = blockIdx.y, D = H * KD;
    const int sl = slots[b];
    if (sl < 0 || sl >= nslots) return;  // both blocks of the cluster read the same slot
    const unsigned peer = cluster_rank() ^ 1u;
    float4* S = reinterpret_cast<float4*>(state + ((long long)sl * H + h) * (KD * KD)) + half * 16;
    float4 s[8];
#pragma unroll
    for (int r = 0; r < 8; r++) s[r] = __ldcs(&S[(rg * 8 + r) * 32 + cg]);  // streamed: no reuse

    // Conv for q, k (all 128 channels) and v (this block's 64); the conv-state writes wait
    // until both blocks have read the old taps (after the first cluster barrier).
    bf16_t keep[3][3];
    const int vc = half * 64 + (tid & 63);
    if (tid < KD) {
        const int col = h * KD + tid;
        const long long row = (long long)b * D + col;
        float qq = 0.0f, kk = 0.0f;
#pragma unroll
        for (int which = 0; which < 3; which++) {
            const bf16_t* X = which == 0 ? qr : which == 1 ? kr : vr;
            const int cc = which == 2 ? h * KD + vc : col;
            const bf16_t* cs = conv_state + ((long long)sl * 3 + which) * 3 * D + cc;
            const float a = conv_silu(cs, D, convw + ((long long)which * D + cc) * 4, X[(long long)b * D + cc], keep[which]);
            if (which == 0) { sq[tid] = a; qq = a * a; }
            else if (which == 1) { sk[tid] = a; kk = a * a; }
            else if (tid < 64) sv[tid] = a;
        }
        se[tid] = decay(lower_bound, a_log[h], graw[row], dt_bias[col]);
        qq = warp_sum(qq); kk = warp_sum(kk);
        if (lane == 0) { misc[wp] = qq; misc[4 + wp] = kk; }
    }
    __syncthreads();
    const float qi = 0.08838834764831845f / sqrtf(misc[0] + misc[1] + misc[2] + misc[3] + 1e-6f);
    const float ki = 1.0f / sqrtf(misc[4] + misc[5] + misc[6] + misc[7] + 1e-6f);
    const float beta = sigmoid_ftz(bf16_to_f32(braw[(long long)b * H + h]));
    float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int row = rg * 8 + r;
        const float e = se[row], k = sk[row] * ki;
        s[r].x *= e; s[r].y *= e; s[r].z *= e; s[r].w *= e;
        p.x += k * s[r].x; p.y += k * s[r].y; p.z += k * s[r].z; p.w += k * s[r].w;
    }
    *reinterpret_cast<float4*>(&red[rg][4 * cg]) = p;
    __syncthreads();
    if (tid < 64) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) acc += red[i][tid];
        su[tid] = beta * (sv[tid] - acc);
    }
    __syncthreads();
    const float4 u = *reinterpret_cast<const float4*>(&su[4 * cg]);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int row = rg * 8 + r;
        const float k = sk[row] * ki, q = sq[row] * qi;
        s[r].x += k * u.x; s[r].y += k * u.y; s[r].z += k * u.z; s[r].w += k * u.w;
        o.x += q * s[r].x; o.y += q * s[r].y; o.z += q * s[r].z; o.w += q * s[r].w;
        __stcs(&S[(rg * 8 + r) * 32 + cg], s[r]);
    }
    *reinterpret_cast<float4*>(&red[rg][4 * cg]) = o;
    __syncthreads();
    float ov = 0.0f;
    if (tid < 64) {
#pragma unroll
        for (int i = 0; i < 16; i++) ov += red[i][tid];
        const float ss = warp_sum(ov * ov);
        if (lane == 0) misc[8 + wp] = ss;
    }
    __syncthreads();
    if (tid == 0) misc[12] = misc[8] + misc[9];
    cluster_sync_all();  // both blocks: partial sums written, old conv taps read
    if (tid < 64) {
        const float tot = misc[12] + ld_peer_f32(&misc[12], peer);
        const float inv = 1.0f / sqrtf(tot * (1.0f / KD) + eps);
        const long long row = (long long)b * D + h * KD + vc;
        out[row] = f32_to_bf16(ov * inv * onorm_w[vc] * sigmoid_ftz(bf16_to_f32(gate[row])));
    }
    if (tid < KD) {
        // q, k taps: block `half` writes channels 64·half..64·half+63; v taps: its own 64.
        bf16_t* base = conv_state + (long long)sl * 9 * D + h * KD;
        if ((tid >> 6) == half)
#pragma unroll
            for (int which = 0; which < 2; which++) {
                bf16_t* cs = base + (long long)which * 3 * D + tid;
                cs[0] = keep[which][0]; cs[D] = keep[which][1]; cs[2 * (long long)D] = keep[which][2];
            }
        if (tid < 64) {
            bf16_t* cs = base + 6 * (long long)D + vc;
            cs[0] = keep[2][0]; cs[D] = keep[2][1]; cs[2 * (long long)D] = keep[2][2];
        }
    }
    cluster_sync_all();  // the peer may still be reading misc[12]
}
