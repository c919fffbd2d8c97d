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
// Selection by rank: expert e is chosen in slot r when exactly r experts order before it
// (higher key, or equal key and lower id; NaN keys count as -inf), r < k. Every thread ranks its
// experts against all E keys in shared memory (broadcast reads), so there is no k-round loop of
// block-wide argmaxes. smem: s[E], key[E] (floats; the launcher sizes 3E).
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                     int E, int k, int renorm, int* __restrict__ ids, float* __restrict__ wts) {
    extern __shared__ float sm[];
    float* s = sm;
    float* key = sm + E;
    __shared__ int chosen[64];
    const int t = blockIdx.x;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float v = sigmoidf_(logits[(long long)t * E + e]);
        s[e] = v;
        float kk = v + bias[e];
        key[e] = (kk != kk) ? -K3_INF : kk;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        const float kk = key[e];
        int rank = 0;
        for (int q = 0; q < E; q++) {
            const float o = key[q];
            rank += (o > kk) | ((o == kk) & (q < e));
        }
        if (rank < k) chosen[rank] = e;
    }
    __syncthreads();
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

// MINB: blocks per SM the register budget is sized for (4 at one token, no spills: more
// 16-byte weight loads in flight per SM at one token).
#define MOE_GEMV(NAME, MX, W13, NT, IN, MINB)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(const IN* x, const int* meta, int amax, int k,             \
            const unsigned char* w, const unsigned char* ws, int rows, int cols, float beta, float lbeta, float* out) { \
        grouped_gemv<MX, W13, NT>(x, meta, amax, k, w, ws, rows, cols, beta, lbeta, out);                               \
    }
MOE_GEMV(moe_w13_mxfp4_nt1, true, true, 1, bf16_t, 4)
MOE_GEMV(moe_w13_mxfp4_nt2, true, true, 2, bf16_t, 2)
MOE_GEMV(moe_w13_mxfp4_nt4, true, true, 4, bf16_t, 2)
MOE_GEMV(moe_w13_bf16_nt1, false, true, 1, bf16_t, 4)
MOE_GEMV(moe_w13_bf16_nt2, false, true, 2, bf16_t, 2)
MOE_GEMV(moe_w13_bf16_nt4, false, true, 4, bf16_t, 2)
MOE_GEMV(moe_w2_mxfp4_nt1, true, false, 1, float, 4)
MOE_GEMV(moe_w2_mxfp4_nt2, true, false, 2, float, 2)
MOE_GEMV(moe_w2_mxfp4_nt4, true, false, 4, float, 2)
MOE_GEMV(moe_w2_bf16_nt1, false, false, 1, float, 4)
MOE_GEMV(moe_w2_bf16_nt2, false, false, 2, float, 2)
MOE_GEMV(moe_w2_bf16_nt4, false, false, 4, float, 2)

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

// The grouped prefill's combine: pair p = t·k + j reads its BF16 expert output at row pos[p] of y
// (the pairs in expert order; -1: no valid expert), same summation order as moe_combine.
extern "C" __global__ void moe_combine_sorted(const bf16_t* __restrict__ y, const int* __restrict__ pos, const float* __restrict__ wts,
                                              int T, int k, int L, float scaling, float* __restrict__ out) {
    long long n = (long long)T * L;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long t = i / L, l = i - t * L;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            int r = pos[t * k + j];
            if (r >= 0) acc = fmaf(wts[t * k + j], bf16_to_f32(y[(long long)r * L + l]), acc);
        }
        out[i] = acc * scaling;
    }
}

// ---- prefill helpers ---------------------------------------------------------------------
// MXFP4 [rows, cols] -> BF16 [rows, cols] of `groups` 32-value groups: one thread per packed
// 32-bit word (8 values), so a warp reads 128 contiguous bytes and writes 512 (coalesced).
extern "C" __global__ void moe_dequant(const unsigned char* __restrict__ packed, const unsigned char* __restrict__ scale,
                                       long long groups, bf16_t* __restrict__ out) {
    const unsigned int* __restrict__ words = reinterpret_cast<const unsigned int*>(packed);
    for (long long w = blockIdx.x * (long long)blockDim.x + threadIdx.x; w < 4 * groups; w += (long long)gridDim.x * blockDim.x) {
        const unsigned int p = words[w];
        const float f = e8m0(scale[w >> 2]) * 85070591730234615865843651857942052864.0f;  // 2^126
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = e2m1_scaled(p, i) * f;
        st_vec(out + 8 * w, v);
    }
}

// Busy-waits `ns` nanoseconds of the global timer on one thread (a test hook of the overlapped
// prefill loop, cuda/moe_prefill.rs: it delays one stream against the other so that a missing
// event wait shows as wrong bits).
extern "C" __global__ void moe_stall(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}

// Whether both pointers are 16-byte aligned (the vector paths below).
__device__ __forceinline__ bool aligned16(const void* a, const void* b) {
    return ((reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b)) & 15ull) == 0;
}

// zg[i, :] = z[pairs[i] / k, :] (BF16 rows of width L; one block per row, 16-byte copies when
// L is a multiple of 8).
extern "C" __global__ void moe_gather(const bf16_t* __restrict__ z, const int* __restrict__ pairs, int n, int k, int L, bf16_t* __restrict__ zg) {
    int i = blockIdx.x;
    if (i >= n) return;
    const bf16_t* src = z + (long long)(pairs[i] / k) * L;
    bf16_t* dst = zg + (long long)i * L;
    if ((L & 7) == 0 && aligned16(src, dst)) {
        for (int c = threadIdx.x; c < L / 8; c += blockDim.x) reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
        return;
    }
    for (int c = threadIdx.x; c < L; c += blockDim.x) dst[c] = src[c];
}

// act[r, f] = SiTU-GLU(h[r, f], h[r, F + f]) rounded to BF16 (the GEMM operand). Rows r step
// by gridDim.y, columns by the x grid (no division per element); 4 columns per thread when F
// is a multiple of 4.
extern "C" __global__ void moe_situ_split(const float* __restrict__ h, int n, int F, float beta, float lbeta, bf16_t* __restrict__ act) {
    const int c0 = blockIdx.x * blockDim.x + threadIdx.x, cs = gridDim.x * blockDim.x;
    for (int r = blockIdx.y; r < n; r += gridDim.y) {
        const float* g = h + (long long)r * 2 * F;
        bf16_t* o = act + (long long)r * F;
        if ((F & 3) == 0 && aligned16(g, g + F)) {
            for (int c = c0; c < F / 4; c += cs) {
                const float4 a = reinterpret_cast<const float4*>(g)[c], u = reinterpret_cast<const float4*>(g + F)[c];
                const unsigned int lo = (unsigned int)f32_to_bf16(situ(a.x, u.x, beta, lbeta)) | ((unsigned int)f32_to_bf16(situ(a.y, u.y, beta, lbeta)) << 16);
                const unsigned int hi = (unsigned int)f32_to_bf16(situ(a.z, u.z, beta, lbeta)) | ((unsigned int)f32_to_bf16(situ(a.w, u.w, beta, lbeta)) << 16);
                reinterpret_cast<uint2*>(o)[c] = make_uint2(lo, hi);
            }
        } else {
            for (int c = c0; c < F; c += cs) o[c] = f32_to_bf16(situ(g[c], g[F + c], beta, lbeta));
        }
    }
}

// The same from a BF16 h (the grouped prefill's GEMM output).
extern "C" __global__ void moe_situ_split_bf16(const bf16_t* __restrict__ h, int n, int F, float beta, float lbeta, bf16_t* __restrict__ act) {
    long long total = (long long)n * F;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / F, f = i - r * F;
        act[i] = f32_to_bf16(situ(bf16_to_f32(h[r * 2 * F + f]), bf16_to_f32(h[r * 2 * F + F + f]), beta, lbeta));
    }
}

// y[pairs[i], :] = yg[i, :] (one block per row, 16-byte copies when L is a multiple of 4).
extern "C" __global__ void moe_scatter(const float* __restrict__ yg, const int* __restrict__ pairs, int n, int L, float* __restrict__ y) {
    int i = blockIdx.x;
    if (i >= n) return;
    const float* src = yg + (long long)i * L;
    float* dst = y + (long long)pairs[i] * L;
    if ((L & 3) == 0 && aligned16(src, dst)) {
        for (int c = threadIdx.x; c < L / 4; c += blockDim.x) reinterpret_cast<float4*>(dst)[c] = reinterpret_cast<const float4*>(src)[c];
        return;
    }
    for (int c = threadIdx.x; c < L; c += blockDim.x) dst[c] = src[c];
}

// ---- reference precision (F32 inputs; any T; capturable) -----------------------------------
// Expert weights F32, BF16 or MXFP4 (fmt 0 / 1 / 2), read element by element and used in f32.
// moe_ref_w13: one warp per (pair, f): act[p, f] = SiTU(w1_e[f]·z[t], w3_e[f]·z[t]), t = p / k.
// moe_ref_w2:  one warp per (pair, l): y[p, l] = w2_e[l]·act[p]. A pair whose id is outside 0..E
// writes zeros (moe_combine skips it anyway).
__device__ __forceinline__ float moe_wval(const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws, int fmt,
                                          long long row, int c, int cols) {
    if (fmt == 0) return reinterpret_cast<const float*>(w)[row * cols + c];
    if (fmt == 1) return bf16_to_f32(reinterpret_cast<const bf16_t*>(w)[row * cols + c]);
    const unsigned int b = w[row * (cols / 2) + c / 2];
    const unsigned int n = (c & 1) ? (b >> 4) : (b & 15u);
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = mag[n & 7u] * e8m0(ws[row * (cols / 32) + c / 32]);
    return (n & 8u) ? -v : v;
}

extern "C" __global__ void moe_ref_w13(const float* __restrict__ z, const int* __restrict__ ids, int n_pairs, int k, int E,
                                       const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws, int fmt,
                                       int F, int L, float beta, float lbeta, float* __restrict__ act) {
    const int lane = threadIdx.x & 31, f = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), p = blockIdx.y;
    if (f >= F || p >= n_pairs) return;
    const int e = ids[p];
    float g = 0.0f, u = 0.0f;
    if (e >= 0 && e < E) {
        const float* zt = z + (long long)(p / k) * L;
        const long long r1 = (long long)e * 2 * F + f, r3 = r1 + F;
        for (int c = lane; c < L; c += 32) {
            g = fmaf(moe_wval(w, ws, fmt, r1, c, L), zt[c], g);
            u = fmaf(moe_wval(w, ws, fmt, r3, c, L), zt[c], u);
        }
        g = warp_sum(g);
        u = warp_sum(u);
    }
    if (lane == 0) act[(long long)p * F + f] = (e >= 0 && e < E) ? situ(g, u, beta, lbeta) : 0.0f;
}

extern "C" __global__ void moe_ref_w2(const float* __restrict__ act, const int* __restrict__ ids, int n_pairs, int E,
                                      const unsigned char* __restrict__ w, const unsigned char* __restrict__ ws, int fmt,
                                      int F, int L, float* __restrict__ y) {
    const int lane = threadIdx.x & 31, l = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), p = blockIdx.y;
    if (l >= L || p >= n_pairs) return;
    const int e = ids[p];
    float a = 0.0f;
    if (e >= 0 && e < E) {
        const float* ap = act + (long long)p * F;
        const long long row = (long long)e * L + l;
        for (int c = lane; c < F; c += 32) a = fmaf(moe_wval(w, ws, fmt, row, c, F), ap[c], a);
        a = warp_sum(a);
    }
    if (lane == 0) y[(long long)p * L + l] = a;
}
