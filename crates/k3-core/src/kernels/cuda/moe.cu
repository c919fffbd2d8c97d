// moe.cu: Stable LatentMoE routed experts (text-backbone §7.2–7.5; MXFP4 per around-backbone §2).
// Launchers and the API contract are in cuda/moe.rs; the CPU oracle is k3-model layers/moe.rs.
// Shapes: T tokens, E experts, k = top-k, L = latent width, F = expert intermediate width,
// n_pairs = T·k (pair p = t·k + j). Expert weights are contiguous by expert:
//   w13 [E, 2F, L] (rows 0..F gate w1, F..2F up w3), w2 [E, L, F]; BF16 or MXFP4 (packed
//   U8 [.., cols/2], low nibble = even column, e2m1; scale U8 [.., cols/32], E8M0 2^(s-127)).
// `meta` (I32) is the grouping table built by moe_group (decode) or the host (prefill):
//   [0] n_active | active_expert[amax] | group_start[amax] | group_count[amax] | pair_list[n_pairs]
// pair_list holds the valid pairs sorted by expert, stable by pair index (= token order).

#define MOE_WARPS 8    // warps per block of the grouped GEMV kernels

// e2m1 nibble -> f32 bits of value·2^-126 (exact; 0.5·2^-126 is an f32 subnormal).
__device__ __forceinline__ float e2m1_scaled(unsigned int w, int i) {
    unsigned int x = w >> (4 * i);
    return __uint_as_float(((x & 7u) << 22) | ((x & 8u) << 28));
}

// 2^(s-127) exactly (s = 0 is subnormal).
__device__ __forceinline__ float e8m0(unsigned int s) {
    return __uint_as_float(s == 0 ? 0x00400000u : (s << 23));
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float situ(float g, float u, float beta, float lbeta) {
    return beta * tanhf(g / beta) * sigmoidf_(g) * (lbeta * tanhf(u / lbeta));
}

// ---- router: one block per token --------------------------------------------------------
// smem: s[E], key[E], taken[E] (int).
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                     int E, int k, int renorm, int* __restrict__ ids, float* __restrict__ wts) {
    extern __shared__ float sm[];
    float* s = sm;
    float* key = sm + E;
    int* taken = (int*)(sm + 2 * E);
    __shared__ float rk[32];
    __shared__ int ri[32];
    __shared__ int chosen[64];
    const int t = blockIdx.x;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = sigmoidf_(logits[(long long)t * E + e]);
        s[e] = v;
        float kk = v + bias[e];
        key[e] = (kk != kk) ? -K3_INF : kk;
        taken[e] = 0;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = 0; j < k; j++) {
        float bk = -K3_INF;
        int bi = 0x7fffffff;
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            if (taken[e]) continue;
            float kk = key[e];
            if (kk > bk || (kk == bk && e < bi)) { bk = kk; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ok = __shfl_xor_sync(0xffffffffu, bk, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ok > bk || (ok == bk && oi < bi)) { bk = ok; bi = oi; }
        }
        if (lane == 0) { rk[warp] = bk; ri[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int q = 1; q < nw; q++)
                if (rk[q] > bk || (rk[q] == bk && ri[q] < bi)) { bk = rk[q]; bi = ri[q]; }
            taken[bi] = 1;
            chosen[j] = bi;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum += s[chosen[j]];
        for (int j = 0; j < k; j++) {
            float v = s[chosen[j]];
            ids[(long long)t * k + j] = chosen[j];
            wts[(long long)t * k + j] = renorm ? v / sum : v;
        }
    }
}

// ---- grouping (decode path; one block of 1024 threads) ------------------------------------
// smem: cnt[E], start[E], arank[E], pid[n_pairs] (ints).
extern "C" __global__ void moe_group(const int* __restrict__ ids, int n_pairs, int E, int amax, int* __restrict__ meta) {
    extern __shared__ int gs[];
    int* cnt = gs;
    int* start = gs + E;
    int* arank = gs + 2 * E;
    int* pid = gs + 3 * E;
    __shared__ int wsum[2][32];
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int e = ids[p];
        pid[p] = e;
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    // Exclusive scans of cnt and (cnt > 0) over E: each thread a contiguous chunk.
    const int nt = blockDim.x, per = (E + nt - 1) / nt, lo = threadIdx.x * per;
    int hi = lo + per; if (hi > E) hi = E;
    int a = 0, b = 0;
    for (int e = lo; e < hi; e++) { a += cnt[e]; b += cnt[e] > 0; }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int ia = a, ib = b;
    for (int o = 1; o < 32; o <<= 1) {
        int xa = __shfl_up_sync(0xffffffffu, ia, o), xb = __shfl_up_sync(0xffffffffu, ib, o);
        if (lane >= o) { ia += xa; ib += xb; }
    }
    if (lane == 31) { wsum[0][warp] = ia; wsum[1][warp] = ib; }
    __syncthreads();
    if (warp == 0) {
        int va = lane < (nt >> 5) ? wsum[0][lane] : 0, vb = lane < (nt >> 5) ? wsum[1][lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            int xa = __shfl_up_sync(0xffffffffu, va, o), xb = __shfl_up_sync(0xffffffffu, vb, o);
            if (lane >= o) { va += xa; vb += xb; }
        }
        wsum[0][lane] = va; wsum[1][lane] = vb;  // inclusive per warp
    }
    __syncthreads();
    int ea = ia - a + (warp > 0 ? wsum[0][warp - 1] : 0);
    int eb = ib - b + (warp > 0 ? wsum[1][warp - 1] : 0);
    for (int e = lo; e < hi; e++) { start[e] = ea; arank[e] = eb; ea += cnt[e]; eb += cnt[e] > 0; }
    __syncthreads();
    int* act_e = meta + 1;
    int* g_start = meta + 1 + amax;
    int* g_count = meta + 1 + 2 * amax;
    int* pairs = meta + 1 + 3 * amax;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        if (cnt[e] > 0) {
            int r = arank[e];
            act_e[r] = e; g_start[r] = start[e]; g_count[r] = cnt[e];
        }
    }
    if (threadIdx.x == nt - 1) meta[0] = wsum[1][(nt >> 5) - 1];
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        int e = pid[p];
        if (e < 0 || e >= E) continue;
        int r = 0;
        for (int q = 0; q < p; q++) r += pid[q] == e;
        pairs[start[e] + r] = p;
    }
}

// ---- grouped GEMV ------------------------------------------------------------------------
// Block (row tile, active slot). Each warp owns 4 weight rows of the slot's expert and dots
// them with every token of the group, NT tokens per pass (inputs staged in shared memory as
// f32, chunk-major so lanes read consecutive 16-byte words); the next weight chunk is loaded
// while the current one is used. MXFP4 inputs are staged ×2^64 and the 2^-126-scaled e2m1
// values used as is; results are rescaled by 2^62 at the end.
// W13: rows {f, f+1, F+f, F+f+1}, epilogue SiTU-GLU -> act[p, F] (f32). W2: rows l..l+3 -> y[p, L].
template <bool MX, bool W13, int NT, typename In>
__device__ __forceinline__ void grouped_gemv(const In* __restrict__ x, const int* __restrict__ meta, int amax, int k,
                                             const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws,
                                             int rows, int cols, float beta, float lbeta, float* __restrict__ out) {
    extern __shared__ float xs[];  // [NT][cols], chunk-major per token
    const int slot = blockIdx.y;
    if (slot >= meta[0]) return;
    const int e = meta[1 + slot], gstart = meta[1 + amax + slot], gcount = meta[1 + 2 * amax + slot];
    const int* pairs = meta + 1 + 3 * amax;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gw = blockIdx.x * MOE_WARPS + warp;
    int ob, rr[4];
    bool live;
    if (W13) {
        const int fh = rows / 2;
        ob = 2 * gw; live = ob < fh;
        if (!live) ob = 0;
        rr[0] = ob; rr[1] = ob + 1; rr[2] = fh + ob; rr[3] = fh + ob + 1;
    } else {
        ob = 4 * gw; live = ob < rows;
        if (!live) ob = 0;
        rr[0] = ob; rr[1] = ob + 1; rr[2] = ob + 2; rr[3] = ob + 3;
    }
    const int G = cols / 32;   // MXFP4 groups per row
    const int C8 = cols / 8;   // 16-byte chunks of a BF16 row
    const int nchunk = cols / 4;
    const float in_scale = MX ? 18446744073709551616.0f : 1.0f;  // 2^64
    const long long wrow = MX ? cols / 2 : (long long)cols * 2;  // bytes per weight row
    const uint4* wr[4];
    const unsigned char* sr[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        wr[r] = reinterpret_cast<const uint4*>(w + ((long long)e * rows + rr[r]) * wrow);
        sr[r] = MX ? ws + ((long long)e * rows + rr[r]) * G : nullptr;
    }
    for (int c0 = 0; c0 < gcount; c0 += NT) {
        const int nt = gcount - c0 < NT ? gcount - c0 : NT;
        __syncthreads();
        for (int i = threadIdx.x; i < nt * nchunk; i += blockDim.x) {
            int t = i / nchunk, q4 = i - t * nchunk;
            int p = pairs[gstart + c0 + t];
            long long src = W13 ? (long long)(p / k) * cols : (long long)p * cols;
            float v[4];
#pragma unroll
            for (int r = 0; r < 4; r++) v[r] = ld(x, src + 4 * q4 + r) * in_scale;
            int dst;
            if (MX) { int g = q4 >> 3, q = q4 & 7; dst = q * G + g; }
            else { int c = q4 >> 1, h = q4 & 1; dst = h * C8 + c; }
            *reinterpret_cast<float4*>(xs + (long long)t * cols + 4 * dst) = make_float4(v[0], v[1], v[2], v[3]);
        }
        __syncthreads();
        if (!live) continue;
        float acc[4][NT];
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int t = 0; t < NT; t++) acc[r][t] = 0.0f;
        const int nit = MX ? G : C8;
        uint4 cur[4];
        unsigned int cs[4] = {0, 0, 0, 0};
        if (lane < nit) {
#pragma unroll
            for (int r = 0; r < 4; r++) { cur[r] = __ldg(wr[r] + lane); if (MX) cs[r] = sr[r][lane]; }
        }
        for (int g = lane; g < nit; g += 32) {
            uint4 nxt[4];
            unsigned int ns[4] = {0, 0, 0, 0};
            if (g + 32 < nit) {
#pragma unroll
                for (int r = 0; r < 4; r++) { nxt[r] = __ldg(wr[r] + g + 32); if (MX) ns[r] = sr[r][g + 32]; }
            }
            if (MX) {
                float part[4][NT];
#pragma unroll
                for (int r = 0; r < 4; r++)
#pragma unroll
                    for (int t = 0; t < NT; t++) part[r][t] = 0.0f;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    float v[4][8];
#pragma unroll
                    for (int r = 0; r < 4; r++) {
                        unsigned int wq = q == 0 ? cur[r].x : q == 1 ? cur[r].y : q == 2 ? cur[r].z : cur[r].w;
#pragma unroll
                        for (int i = 0; i < 8; i++) v[r][i] = e2m1_scaled(wq, i);
                    }
#pragma unroll
                    for (int t = 0; t < NT; t++) {
                        if (t < nt) {
                            const float* xt = xs + (long long)t * cols;
                            float4 z0 = *reinterpret_cast<const float4*>(xt + 4 * ((2 * q) * G + g));
                            float4 z1 = *reinterpret_cast<const float4*>(xt + 4 * ((2 * q + 1) * G + g));
                            float zz[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
#pragma unroll
                            for (int r = 0; r < 4; r++) {
                                float s = part[r][t];
#pragma unroll
                                for (int i = 0; i < 8; i++) s = fmaf(v[r][i], zz[i], s);
                                part[r][t] = s;
                            }
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    float f = e8m0(cs[r]);
#pragma unroll
                    for (int t = 0; t < NT; t++) acc[r][t] = fmaf(part[r][t], f, acc[r][t]);
                }
            } else {
                float v[4][8];
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    unsigned int u[4] = {cur[r].x, cur[r].y, cur[r].z, cur[r].w};
#pragma unroll
                    for (int i = 0; i < 4; i++) { v[r][2 * i] = __uint_as_float(u[i] << 16); v[r][2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u); }
                }
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < nt) {
                        const float* xt = xs + (long long)t * cols;
                        float4 z0 = *reinterpret_cast<const float4*>(xt + 4 * g);
                        float4 z1 = *reinterpret_cast<const float4*>(xt + 4 * (C8 + g));
                        float zz[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
#pragma unroll
                        for (int r = 0; r < 4; r++) {
                            float s = acc[r][t];
#pragma unroll
                            for (int i = 0; i < 8; i++) s = fmaf(v[r][i], zz[i], s);
                            acc[r][t] = s;
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 4; r++) { cur[r] = nxt[r]; cs[r] = ns[r]; }
        }
        const float rescale = MX ? 4611686018427387904.0f : 1.0f;  // 2^62
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nt) {
                float o[4];
#pragma unroll
                for (int r = 0; r < 4; r++) o[r] = warp_sum(acc[r][t]) * rescale;
                if (lane == 0) {
                    int p = pairs[gstart + c0 + t];
                    if (W13) {
                        float* dst = out + (long long)p * (rows / 2) + ob;
                        dst[0] = situ(o[0], o[2], beta, lbeta);
                        dst[1] = situ(o[1], o[3], beta, lbeta);
                    } else {
                        float* dst = out + (long long)p * rows + ob;
#pragma unroll
                        for (int r = 0; r < 4; r++) dst[r] = o[r];
                    }
                }
            }
        }
    }
}

#define MOE_GEMV(NAME, MX, W13, NT, IN)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 2) NAME(const IN* x, const int* meta, int amax, int k,             \
            const unsigned char* w, const unsigned char* ws, int rows, int cols, float beta, float lbeta, float* out) { \
        grouped_gemv<MX, W13, NT>(x, meta, amax, k, w, ws, rows, cols, beta, lbeta, out);                               \
    }
MOE_GEMV(moe_w13_mxfp4_nt1, true, true, 1, bf16_t)
MOE_GEMV(moe_w13_mxfp4_nt2, true, true, 2, bf16_t)
MOE_GEMV(moe_w13_mxfp4_nt4, true, true, 4, bf16_t)
MOE_GEMV(moe_w13_bf16_nt1, false, true, 1, bf16_t)
MOE_GEMV(moe_w13_bf16_nt2, false, true, 2, bf16_t)
MOE_GEMV(moe_w13_bf16_nt4, false, true, 4, bf16_t)
MOE_GEMV(moe_w2_mxfp4_nt1, true, false, 1, float)
MOE_GEMV(moe_w2_mxfp4_nt2, true, false, 2, float)
MOE_GEMV(moe_w2_mxfp4_nt4, true, false, 4, float)
MOE_GEMV(moe_w2_bf16_nt1, false, false, 1, float)
MOE_GEMV(moe_w2_bf16_nt2, false, false, 2, float)
MOE_GEMV(moe_w2_bf16_nt4, false, false, 4, float)

// ---- tensor-core grouped GEMM (decode) ----------------------------------------------------
// Block (row tile, active slot), MMA_WARPS warps. Each warp owns two 16-row A tiles of the
// slot's expert (W13: gate rows f0..f0+15 and up rows F+f0..; W2: rows r0..r0+31) and runs
// mma.m16n8k16 (bf16 in, f32 accumulate) over K = cols in 32-column groups (2 k-steps each),
// the tokens of the group as B, 8 per n-tile, up to NT n-tiles per pass (a group of more than
// 8·NT tokens makes further passes, re-reading the rows from L2). Lane (g = lane/4, t = lane%4)
// holds weight rows g and g+8 of each tile; within a 32-column group it owns columns
// 8t..8t+7 (K is permuted consistently in A and B; the reduction does not care):
//   BF16: one 16-byte load per row = both k-steps' A registers; B = the 16 bytes of the token
//         row at the same columns.
//   MXFP4: one u32 per row (8 nibbles n0..n7 = columns 8t+0..7) decoded to bf16 pairs
//         (n0,n4) (n1,n5) (n2,n6) (n3,n7) by shifts/masks as value·2^-126 then one bf16x2
//         multiply by 2^126 (exact: e2m1 values are exact in bf16); B is permuted the same way
//         with byte-permutes (W13 from z) or stored permuted by the W13 epilogue (W2 from act).
//         The E8M0 scale is applied in f32 to each group's MMA partial sum (exact power of 2).
// The next D groups' weights are in flight while a group is computed. W13 epilogue: SiTU-GLU
// -> act[p, F] rounded to bf16 (the W2 B operand); W2: y[p, L] (f32).
#define MMA_WARPS 4

__device__ __forceinline__ void mma16816(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1,
                                         float c0, float c1, float c2, float c3) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

// bf16x2 x·2^126 (exact for the e2m1·2^-126 inputs, subnormal 0.5·2^-126 included).
__device__ __forceinline__ unsigned bf16x2_times_2p126(unsigned x) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(0x7E807E80u), "r"(0x80008000u));
    return d;
}

// 8 e2m1 nibbles (column i = nibble i) -> bf16 pairs r[j] = (col j, col j+4), exact.
__device__ __forceinline__ void e2m1x8_to_bf16(unsigned w, unsigned* r) {
    const unsigned M = 0x01C001C0u, S = 0x80008000u;
    r[0] = bf16x2_times_2p126(((w << 6) & M) | ((w << 12) & S));
    r[1] = bf16x2_times_2p126(((w << 2) & M) | ((w << 8) & S));
    r[2] = bf16x2_times_2p126(((w >> 2) & M) | ((w << 4) & S));
    r[3] = bf16x2_times_2p126(((w >> 6) & M) | (w & S));
}

// 4×4 transpose of u32 words across the lanes of a quad: in, x[j] = word j of lane t's
// 16 bytes; out, x[j] = word t of lane j's 16 bytes (two butterfly stages).
__device__ __forceinline__ void quad_transpose(unsigned* x, int t) {
    const bool o1 = t & 1, o2 = t & 2;
    unsigned sa = o1 ? x[0] : x[1], sb = o1 ? x[2] : x[3];
    unsigned ra = __shfl_xor_sync(0xffffffffu, sa, 1), rb = __shfl_xor_sync(0xffffffffu, sb, 1);
    if (o1) { x[0] = ra; x[2] = rb; } else { x[1] = ra; x[3] = rb; }
    sa = o2 ? x[0] : x[2]; sb = o2 ? x[1] : x[3];
    ra = __shfl_xor_sync(0xffffffffu, sa, 2); rb = __shfl_xor_sync(0xffffffffu, sb, 2);
    if (o2) { x[0] = ra; x[1] = rb; } else { x[2] = ra; x[3] = rb; }
}

// Stage unit: MXFP4 = 4 groups (128 columns; lane t loads group c0+t of each of its 4 rows,
// 16 bytes, and the u32 of the row's 4 scale bytes; after the copy the quad transposes so lane t
// holds word t of the 4 groups); BF16 = 1 group (lane t loads its 16 bytes of each row). The
// units stream through a per-warp ring of S stages in shared memory by cp.async; every lane
// reads back only the bytes it copied itself, so cp.async.wait_group alone orders them.
#define MMA_STAGES 6

__device__ __forceinline__ unsigned moe_smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void moe_cp16(void* dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(moe_smem_u32(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void moe_cp4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(moe_smem_u32(dst)), "l"(src));
}
__device__ __forceinline__ void moe_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void moe_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

template <bool MX, bool W13, int NT, int S>
__device__ __forceinline__ void grouped_mma(const bf16_t* __restrict__ x, const int* __restrict__ meta, int amax, int k,
                                            const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws,
                                            int rows, int cols, float beta, float lbeta, void* __restrict__ outp) {
    __shared__ float red[MMA_WARPS - 1][2 * NT * 4][32];
    const int slot = blockIdx.y;
    if (slot >= meta[0]) return;
    const int e = meta[1 + slot], gstart = meta[1 + amax + slot], gcount = meta[1 + 2 * amax + slot];
    const int* pairs = meta + 1 + 3 * amax;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int rb[2];
    if (W13) {
        const int f0 = 16 * blockIdx.x;
        if (f0 >= rows / 2) return;
        rb[0] = f0; rb[1] = rows / 2 + f0;
    } else {
        const int r0 = 32 * blockIdx.x;
        if (r0 >= rows) return;
        rb[0] = r0; rb[1] = r0 + 16;
    }
    const int G = cols / 32;
    const int U = MX ? 4 : 1;            // groups per stage unit
    const int NU = (G + U - 1) / U;      // units; warp w takes units w, w + MMA_WARPS, ...
    const bool s_aligned = (G & 3) == 0;
    const uint4* wv[2][2];
    const unsigned char* sq[2][2];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const long long row = (long long)e * rows + rb[a] + g + 8 * h;
            if (MX) {
                wv[a][h] = reinterpret_cast<const uint4*>(w + row * (cols / 2)) + t;  // group c at [c]
                sq[a][h] = ws + row * G;
            } else {
                wv[a][h] = reinterpret_cast<const uint4*>(w + row * cols * 2) + t;    // group c at [4c]
                sq[a][h] = nullptr;
            }
        }
    extern __shared__ uint4 ring[];  // [MMA_WARPS][S][4][32] uint4, then MX: [MMA_WARPS][S][4][32] u32
    uint4* wring = ring + warp * S * 128;
    unsigned* sring = reinterpret_cast<unsigned*>(ring + MMA_WARPS * S * 128) + warp * S * 128;
    auto issue = [&](int u, int st) {
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int ah = 2 * a + h;
                if constexpr (MX) {
                    const bool ok = 4 * u + t < G;
                    moe_cp16(wring + (st * 4 + ah) * 32 + lane, ok ? wv[a][h] + 4 * u : wv[a][h], ok ? 16 : 0);
                    if (s_aligned) moe_cp4(sring + (st * 4 + ah) * 32 + lane, sq[a][h] + 4 * u);
                } else {
                    moe_cp16(wring + (st * 4 + ah) * 32 + lane, wv[a][h] + 4 * u, 16);
                }
            }
    };
    const int nmine = warp < NU ? (NU - warp + MMA_WARPS - 1) / MMA_WARPS : 0;  // units of this warp
    for (int tc = 0; tc < gcount; tc += 8 * NT) {
        const int ntl = gcount - tc < 8 * NT ? gcount - tc : 8 * NT;
        const uint4* xr[NT];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            int j = tc + n * 8 + g;
            if (j >= gcount) j = tc;  // padding column: any valid row, result discarded
            const int p = pairs[gstart + j];
            xr[n] = reinterpret_cast<const uint4*>(x + (long long)(W13 ? p / k : p) * cols) + t;
        }
        float acc[2][NT][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[a][n][i] = 0.0f;
#pragma unroll
        for (int i = 0; i < S - 1; i++) {
            if (i < nmine) issue(warp + i * MMA_WARPS, i);
            moe_commit();
        }
        for (int i = 0; i < nmine; i++) {
            const int u = warp + i * MMA_WARPS, st = i % S;
            moe_wait<S - 2>();
            uint4 cw[2][2];
            unsigned cs[2][2];
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    cw[a][h] = wring[(st * 4 + 2 * a + h) * 32 + lane];
                    if (MX) {
                        if (s_aligned) cs[a][h] = sring[(st * 4 + 2 * a + h) * 32 + lane];
                        else {
                            unsigned v = 0;
                            for (int j = 0; j < 4; j++) if (4 * u + j < G) v |= (unsigned)__ldg(sq[a][h] + 4 * u + j) << (8 * j);
                            cs[a][h] = v;
                        }
                    }
                }
            if (i + S - 1 < nmine) issue(u + (S - 1) * MMA_WARPS, (i + S - 1) % S);
            moe_commit();
            {
                if constexpr (MX) {
                    unsigned q[2][2][4];
#pragma unroll
                    for (int a = 0; a < 2; a++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            q[a][h][0] = cw[a][h].x; q[a][h][1] = cw[a][h].y; q[a][h][2] = cw[a][h].z; q[a][h][3] = cw[a][h].w;
                            quad_transpose(q[a][h], t);
                        }
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const int c = 4 * u + j;
                        if (c >= G) break;
                        unsigned A[2][2][4];
                        float sc[2][2];
#pragma unroll
                        for (int a = 0; a < 2; a++)
#pragma unroll
                            for (int h = 0; h < 2; h++) {
                                e2m1x8_to_bf16(q[a][h][j], A[a][h]);
                                sc[a][h] = e8m0((cs[a][h] >> (8 * j)) & 0xFFu);
                            }
#pragma unroll
                        for (int n = 0; n < NT; n++) {
                            if (n * 8 >= ntl) break;
                            const uint4 v = __ldg(xr[n] + 4 * c);
                            unsigned b0 = v.x, b1 = v.y, b2 = v.z, b3 = v.w;
                            if (W13) {
                                b0 = prmt(v.x, v.z, 0x5410u); b1 = prmt(v.x, v.z, 0x7632u);
                                b2 = prmt(v.y, v.w, 0x5410u); b3 = prmt(v.y, v.w, 0x7632u);
                            }
#pragma unroll
                            for (int a = 0; a < 2; a++) {
                                float p[4];
                                mma16816(p, A[a][0][0], A[a][1][0], A[a][0][1], A[a][1][1], b0, b1, 0.0f, 0.0f, 0.0f, 0.0f);
                                mma16816(p, A[a][0][2], A[a][1][2], A[a][0][3], A[a][1][3], b2, b3, p[0], p[1], p[2], p[3]);
                                acc[a][n][0] = fmaf(p[0], sc[a][0], acc[a][n][0]);
                                acc[a][n][1] = fmaf(p[1], sc[a][0], acc[a][n][1]);
                                acc[a][n][2] = fmaf(p[2], sc[a][1], acc[a][n][2]);
                                acc[a][n][3] = fmaf(p[3], sc[a][1], acc[a][n][3]);
                            }
                        }
                    }
                } else {
                    const int c = u;
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        if (n * 8 >= ntl) break;
                        const uint4 v = __ldg(xr[n] + 4 * c);
#pragma unroll
                        for (int a = 0; a < 2; a++) {
                            float* q = acc[a][n];
                            mma16816(q, cw[a][0].x, cw[a][1].x, cw[a][0].y, cw[a][1].y, v.x, v.y, q[0], q[1], q[2], q[3]);
                            mma16816(q, cw[a][0].z, cw[a][1].z, cw[a][0].w, cw[a][1].w, v.z, v.w, q[0], q[1], q[2], q[3]);
                        }
                    }
                }
            }
        }
        moe_wait<0>();
        // Split-K reduction over the warps in a fixed order (deterministic), then the epilogue
        // by warp 0: acc[a][n][2h+i] = (row rb[a]+g+8h, token tc+8n+2t+i).
        if (warp > 0) {
#pragma unroll
            for (int a = 0; a < 2; a++)
#pragma unroll
                for (int n = 0; n < NT; n++)
#pragma unroll
                    for (int i = 0; i < 4; i++) red[warp - 1][(a * NT + n) * 4 + i][lane] = acc[a][n][i];
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int wq = 0; wq < MMA_WARPS - 1; wq++)
#pragma unroll
                for (int a = 0; a < 2; a++)
#pragma unroll
                    for (int n = 0; n < NT; n++)
#pragma unroll
                        for (int i = 0; i < 4; i++) acc[a][n][i] += red[wq][(a * NT + n) * 4 + i][lane];
#pragma unroll
            for (int n = 0; n < NT; n++) {
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int j = tc + n * 8 + 2 * t + i;
                    if (j >= gcount) continue;
                    const long long p = pairs[gstart + j];
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        if (W13) {
                            const int F = rows / 2, f = rb[0] + g + 8 * h;
                            const int pos = MX ? (f & ~7) | ((f & 3) << 1) | ((f >> 2) & 1) : f;
                            const float v = situ(acc[0][n][2 * h + i], acc[1][n][2 * h + i], beta, lbeta);
                            reinterpret_cast<bf16_t*>(outp)[p * F + pos] = f32_to_bf16(v);
                        } else {
                            float* y = reinterpret_cast<float*>(outp) + p * rows;
#pragma unroll
                            for (int a = 0; a < 2; a++) y[rb[a] + g + 8 * h] = acc[a][n][2 * h + i];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
}

#define MOE_MMA(NAME, MX, W13, NT, S)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS) NAME(const bf16_t* x, const int* meta, int amax, int k, \
            const unsigned char* w, const unsigned char* ws, int rows, int cols, float beta, float lbeta, void* out) {  \
        grouped_mma<MX, W13, NT, S>(x, meta, amax, k, w, ws, rows, cols, beta, lbeta, out);                            \
    }
MOE_MMA(moe_mma_w13_mxfp4_n1, true, true, 1, MMA_STAGES)
MOE_MMA(moe_mma_w13_mxfp4_n2, true, true, 2, MMA_STAGES)
MOE_MMA(moe_mma_w13_mxfp4_n4, true, true, 4, MMA_STAGES)
MOE_MMA(moe_mma_w13_mxfp4_n8, true, true, 8, MMA_STAGES)
MOE_MMA(moe_mma_w2_mxfp4_n1, true, false, 1, MMA_STAGES)
MOE_MMA(moe_mma_w2_mxfp4_n2, true, false, 2, MMA_STAGES)
MOE_MMA(moe_mma_w2_mxfp4_n4, true, false, 4, MMA_STAGES)
MOE_MMA(moe_mma_w2_mxfp4_n8, true, false, 8, MMA_STAGES)
MOE_MMA(moe_mma_w13_bf16_n1, false, true, 1, MMA_STAGES)
MOE_MMA(moe_mma_w13_bf16_n2, false, true, 2, MMA_STAGES)
MOE_MMA(moe_mma_w13_bf16_n4, false, true, 4, MMA_STAGES)
MOE_MMA(moe_mma_w13_bf16_n8, false, true, 8, MMA_STAGES)
MOE_MMA(moe_mma_w2_bf16_n1, false, false, 1, MMA_STAGES)
MOE_MMA(moe_mma_w2_bf16_n2, false, false, 2, MMA_STAGES)
MOE_MMA(moe_mma_w2_bf16_n4, false, false, 4, MMA_STAGES)
MOE_MMA(moe_mma_w2_bf16_n8, false, false, 8, MMA_STAGES)

// out[t, l] = scaling · Σ_j w[t, j] · y[t·k + j, l], j ascending; pairs with an invalid id add nothing.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ ids, const float* __restrict__ wts,
                                       int T, int k, int E, int L, float scaling, float* __restrict__ out) {
    long long n = (long long)T * L;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / L, l = i - t * L;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            int e = ids[t * k + j];
            if (e >= 0 && e < E) acc = fmaf(wts[t * k + j], y[(t * k + j) * L + l], acc);
        }
        out[i] = acc * scaling;
    }
}

// ---- prefill helpers ---------------------------------------------------------------------
// MXFP4 [rows, cols] -> BF16 [rows, cols] (one thread per 32-column group).
extern "C" __global__ void moe_dequant(const unsigned char* __restrict__ packed, const unsigned char* __restrict__ scale,
                                       long long groups, bf16_t* __restrict__ out) {
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < groups; g += (long long)gridDim.x * blockDim.x) {
        uint4 p = *reinterpret_cast<const uint4*>(packed + 16 * g);
        float f = e8m0(scale[g]) * 85070591730234615865843651857942052864.0f;  // 2^126
        unsigned int w4[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = e2m1_scaled(w4[q], i) * f;
            st_vec(out + 32 * g + 8 * q, v);
        }
    }
}

// zg[i, :] = z[pairs[i] / k, :] (BF16 rows of width L).
extern "C" __global__ void moe_gather(const bf16_t* __restrict__ z, const int* __restrict__ pairs, int n, int k, int L, bf16_t* __restrict__ zg) {
    int i = blockIdx.x;
    if (i >= n) return;
    long long src = (long long)(pairs[i] / k) * L;
    for (int c = threadIdx.x; c < L; c += blockDim.x) zg[(long long)i * L + c] = z[src + c];
}

// act[i, f] = SiTU-GLU(h[i, f], h[i, F + f]) rounded to BF16 (the GEMM operand).
extern "C" __global__ void moe_situ_split(const float* __restrict__ h, int n, int F, float beta, float lbeta, bf16_t* __restrict__ act) {
    long long total = (long long)n * F;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / F, f = i - r * F;
        act[i] = f32_to_bf16(situ(h[r * 2 * F + f], h[r * 2 * F + F + f], beta, lbeta));
    }
}

// y[pairs[i], :] = yg[i, :].
extern "C" __global__ void moe_scatter(const float* __restrict__ yg, const int* __restrict__ pairs, int n, int L, float* __restrict__ y) {
    int i = blockIdx.x;
    if (i >= n) return;
    long long dst = (long long)pairs[i] * L;
    for (int c = threadIdx.x; c < L; c += blockDim.x) y[dst + c] = yg[(long long)i * L + c];
}
