// moe_mma.cu: tensor-core decode kernels of the Stable LatentMoE routed experts (text-backbone
// §7.4–7.5; MXFP4 per around-backbone §2). Launchers in cuda/moe.rs (`decode_mma`); grouping
// (`moe_group`), combine and the CUDA-core kernels are in moe.cu, whose conventions this file
// shares: T tokens, k = top-k, L latent width, F expert width, n_pairs = T·k (pair p = t·k + j);
// w13 [E, 2F, L] (rows 0..F gate, F..2F up), w2 [E, L, F], BF16 or MXFP4 (U8 [.., cols/2], low
// nibble = even column, e2m1; scales U8 [.., cols/32], E8M0); `meta` (I32) =
//   [0] n_active | active_expert[amax] | group_start[amax] | group_count[amax] | pair_list[n_pairs].

// 2^(s-127) exactly (s = 0 is subnormal). Same as moe.cu.
__device__ __forceinline__ float e8m0(unsigned int s) {
    return __uint_as_float(s == 0 ? 0x00400000u : (s << 23));
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// SiTU-GLU of one (gate, up) pair; same formula as moe.cu / kernels::cpu::act::situ_glu.
__device__ __forceinline__ float situ(float g, float u, float beta, float lbeta) {
    return beta * tanhf(g / beta) * sigmoidf_(g) * (lbeta * tanhf(u / lbeta));
}

// ---- tensor-core grouped GEMM (decode) ----------------------------------------------------
// Block (row tile, active slot), MMA_WARPS warps splitting K (warp w takes stage units w,
// w + MMA_WARPS, ...; partial sums reduced through shared memory in warp order at the end:
// deterministic). The row tile is two 16-row A tiles of the slot's expert (W13: gate rows
// f0..f0+15 and up rows F+f0..; W2: rows r0..r0+31); mma.m16n8k16 (bf16 in, f32 accumulate),
// K in 32-column groups (2 k-steps each), the expert's tokens as B, 8 per n-tile, up to NT
// n-tiles per pass (a group of more than 8·NT tokens makes further passes). Lane (g = lane/4,
// t = lane%4) holds rows g and g+8 of each tile; within a 32-column group it owns columns
// 8t..8t+7 (K permuted identically in A and B; the reduction does not care):
//   BF16: one 16-byte load per row = both k-steps' A registers; B = the token row's 16 bytes
//         at the same columns.
//   MXFP4: 4 groups per unit; lane t loads group c0+t of its row (16 bytes) and the quad
//         transposes (shuffles) so lane t holds word t (8 nibbles = columns 8t..8t+7) of each
//         group; nibbles decode to bf16 pairs (n0,n4) (n1,n5) (n2,n6) (n3,n7) by shifts/masks
//         as value·2^-126, then one bf16x2 multiply by 2^126 (exact). B is permuted the same
//         way with byte-permutes (W13, from z) or stored permuted by the W13 epilogue (W2, act).
//         The E8M0 scale multiplies each group's f32 MMA partial (exact power of 2, no bf16
//         over/underflow concern).
// The next D units' weights are in flight (registers) while one is computed. W13 epilogue:
// SiTU-GLU -> act[p, F] rounded to bf16 (the W2 B operand); W2: y[p, L] (f32).
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

// Stage unit: MXFP4 = 4 groups (128 columns; lane t loads group c0+t of each of its rows, 16
// bytes, then the quad transposes so lane t holds word t of the 4 groups) + the 4 scale bytes
// of each row; BF16 = 1 group (lane t loads its 16 bytes directly).
template <bool MX> struct WBuf;
template <> struct WBuf<true> { uint4 w[2][2]; unsigned s[2][2]; };
template <> struct WBuf<false> { uint4 w[2][2]; };

template <bool MX, bool W13, int NT, int D>
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
    auto load = [&](WBuf<MX>& b, int u) {
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if constexpr (MX) {
                    const int c0 = 4 * u;
                    b.w[a][h] = c0 + t < G ? __ldg(wv[a][h] + c0) : make_uint4(0u, 0u, 0u, 0u);
                    if (s_aligned) {
                        b.s[a][h] = __ldg(reinterpret_cast<const unsigned*>(sq[a][h] + c0));
                    } else {
                        unsigned v = 0;
#pragma unroll
                        for (int j = 0; j < 4; j++) if (c0 + j < G) v |= (unsigned)__ldg(sq[a][h] + c0 + j) << (8 * j);
                        b.s[a][h] = v;
                    }
                } else {
                    b.w[a][h] = __ldg(wv[a][h] + 4 * u);
                }
            }
    };
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
        WBuf<MX> buf[D];
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int u = warp + d * MMA_WARPS;
            if (u < NU) load(buf[d], u);
        }
        for (int u0 = warp; u0 < NU; u0 += D * MMA_WARPS) {
#pragma unroll
            for (int d = 0; d < D; d++) {
                const int u = u0 + d * MMA_WARPS;
                if (u >= NU) break;
                WBuf<MX> cur = buf[d];
                if (u + D * MMA_WARPS < NU) load(buf[d], u + D * MMA_WARPS);
                if constexpr (MX) {
                    unsigned q[2][2][4];
#pragma unroll
                    for (int a = 0; a < 2; a++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            q[a][h][0] = cur.w[a][h].x; q[a][h][1] = cur.w[a][h].y; q[a][h][2] = cur.w[a][h].z; q[a][h][3] = cur.w[a][h].w;
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
                                sc[a][h] = e8m0((cur.s[a][h] >> (8 * j)) & 0xFFu);
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
                            mma16816(q, cur.w[a][0].x, cur.w[a][1].x, cur.w[a][0].y, cur.w[a][1].y, v.x, v.y, q[0], q[1], q[2], q[3]);
                            mma16816(q, cur.w[a][0].z, cur.w[a][1].z, cur.w[a][0].w, cur.w[a][1].w, v.z, v.w, q[0], q[1], q[2], q[3]);
                        }
                    }
                }
            }
        }
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

#define MOE_MMA(NAME, MX, W13, NT, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS) NAME(const bf16_t* x, const int* meta, int amax, int k, \
            const unsigned char* w, const unsigned char* ws, int rows, int cols, float beta, float lbeta, void* out) {  \
        grouped_mma<MX, W13, NT, D>(x, meta, amax, k, w, ws, rows, cols, beta, lbeta, out);                            \
    }
MOE_MMA(moe_mma_w13_mxfp4_n1, true, true, 1, 2)
MOE_MMA(moe_mma_w13_mxfp4_n2, true, true, 2, 2)
MOE_MMA(moe_mma_w13_mxfp4_n4, true, true, 4, 1)
MOE_MMA(moe_mma_w13_mxfp4_n8, true, true, 8, 1)
MOE_MMA(moe_mma_w2_mxfp4_n1, true, false, 1, 2)
MOE_MMA(moe_mma_w2_mxfp4_n2, true, false, 2, 2)
MOE_MMA(moe_mma_w2_mxfp4_n4, true, false, 4, 1)
MOE_MMA(moe_mma_w2_mxfp4_n8, true, false, 8, 1)
MOE_MMA(moe_mma_w13_bf16_n1, false, true, 1, 4)
MOE_MMA(moe_mma_w13_bf16_n2, false, true, 2, 4)
MOE_MMA(moe_mma_w13_bf16_n4, false, true, 4, 2)
MOE_MMA(moe_mma_w13_bf16_n8, false, true, 8, 2)
MOE_MMA(moe_mma_w2_bf16_n1, false, false, 1, 4)
MOE_MMA(moe_mma_w2_bf16_n2, false, false, 2, 4)
MOE_MMA(moe_mma_w2_bf16_n4, false, false, 4, 2)
MOE_MMA(moe_mma_w2_bf16_n8, false, false, 8, 2)
