// kda.cu: Kimi Delta Attention on the GPU (text-backbone §3.2-3.8), head_dim 128, chunk 64.
// CPU oracles: kernels/cpu/kda.rs (core) and k3-model layers/kda.rs (conv, norms, gates).
//
// Prefill is two kernels over packed variable-length sequences:
//  * kda_chunk_prep, one block per (chunk, head), all chunks in parallel: causal conv + SiLU
//    (reading the conv state for a sequence's first chunk), L2 norms, q scale, beta, the
//    lower-bounded gate, the cumulative log-decay G (f32), A_kk and A_qk with tensor cores
//    (bf16 mma.sync m16n8k16, f32 accumulate) using per-16-row reference points so that no
//    exponent is positive beyond +75, the exact inverse (I - A_kk)^-1 in f32 (16x16 diagonal
//    blocks by substitution, off-diagonal blocks by block substitution), then w and u with
//    tensor cores. It writes one 74240-byte record per (chunk, head): w, u, q*e^G, (k*e^(G_last-G))^T,
//    A_qk (bf16, 16-byte units XOR-swizzled by row so fragment loads hit 32 banks) and e^G_last.
//  * kda_chunk_scan, one block per (sequence, head): the state S (128x128 f32) lives in mma
//    accumulators across chunks; per chunk v' = u - w S, o = (q e^G) S + A_qk v',
//    S = e^G_last S + (k e^(G_last-G))^T v', then RMSNorm x sigmoid(gate) and the bf16 output.
//    Records stream in through cp.async, double-buffered. It also writes the final state, the
//    new conv state and (optionally) the state after every chunk.
// Conv and recurrent states live in a pool of slots ([S, 3, 3, D] bf16, [S, H, 128, 128] f32);
// the tables carry each sequence's slot, so the kernels only index the pool by it.
// Decode is in kda_decode.cu.

#define KD 128
#define KC 64
#define LDF 132  // f32 row stride of [64][128] smem tiles
#define LDA 68   // f32 row stride of [64][64] smem tiles
#define REC_W 0
#define REC_U 8192
#define REC_QG 16384
#define REC_KT 24576
#define REC_AQK 32768
#define REC_GL_BYTES 73728
#define REC_BYTES 74240
#define LST 136  // bf16 row stride of S^T in smem
#define LVT 72   // bf16 row stride of v'^T in smem

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float lo_bf16(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_bf16(unsigned u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float sigm(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// Element (r, c) of a swizzled bf16 tile with `rowlen` (64 or 128) columns.
__device__ __forceinline__ int swz(int r, int c, int rowlen) {
    return r * rowlen + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp16(void* sdst, const void* gsrc) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(sdst)), "l"(gsrc));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ------------------------------------------------------------------------------------------
// Prefill, stage 1: one block (PT = 512 threads) per (chunk, head); chunks[i] = {tok0, n, slot,
// pos0} (slot: the sequence's pool slot of the conv state). One block fills an SM's shared memory, so 16 warps hide the latencies of each phase.
#define PT 512
extern "C" __global__ void __launch_bounds__(PT, 1)
kda_chunk_prep(const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
               const bf16_t* __restrict__ graw, const bf16_t* __restrict__ braw,
               const float* __restrict__ convw, const float* __restrict__ a_log,
               const float* __restrict__ dt_bias, const bf16_t* __restrict__ conv_state,
               const int4* __restrict__ chunks, unsigned char* __restrict__ work, int H, float lower_bound) {
    extern __shared__ __align__(16) float smem[];
    float* sq = smem;                 // q (normed, scaled)         [64][LDF]
    float* sk = sq + KC * LDF;        // k (normed)
    float* sv = sk + KC * LDF;        // v
    float* se = sv + KC * LDF;        // G, then e^(G_i - G_ref(i))  (<= 1, >= e^-75)
    float* sA = se + KC * LDF;        // A_kk (negative form, strictly lower)   [64][LDA]
    float* sM = sA + KC * LDA;        // (I - A_kk)^-1
    float* sQK = sM + KC * LDA;       // A_qk (j <= i)
    float* sGR = sQK + KC * LDA;      // G at the 4 reference rows 0,16,32,48 [4][128]
    float* sER = sGR + 4 * KD;        // e^G_ref                               [4][128]
    float* sKL = sER + 4 * KD;        // e^(G_last - G_ref)                    [4][128]
    float* sF = sKL + 4 * KD;         // e^(G_ref(I) - G_ref(J)), I > J        [6][128]
    float* sT = sF + 6 * KD;          // block-substitution scratch            [768]
    float* sGL = sT + 768;            // G_last [128]
    float* sTot = sGL + KD;           // quarter-chunk totals [4][128]
    float* sBeta = sTot + 4 * KD;     // [64]

    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int4 ch = chunks[blockIdx.x];
    const int tok0 = ch.x, n = ch.y, slot = ch.z, pos0 = ch.w;
    const int h = blockIdx.y, D = H * KD;
    unsigned char* rec = work + ((long long)blockIdx.x * H + h) * REC_BYTES;
    bf16_t* rb = reinterpret_cast<bf16_t*>(rec);

    for (int i = tid; i < 3 * KC * LDA; i += PT) sA[i] = 0.0f;  // sA, sM, sQK

    // --- conv + SiLU, gate and the local cumulative sum: thread = (quarter = 16-row block, channel).
    const int c = tid & 127, qt = tid >> 7, r0 = qt * 16, col = h * KD + c;
    // All raw loads of a tensor are issued before any use (unconditional, clamped addresses):
    // with one block per SM, serialised loads would leave the SM idle for most of the kernel.
    // No branches around the loads either: a load whose value meets a branch merge is waited
    // for there. Rows before the sequence start come from the conv state; both candidates are
    // loaded, each clamped to a valid address (the tap index to 0..2: unclamped, later chunks
    // read far past the conv state), and one is selected.
    auto load_raw = [&](const bf16_t* X, int which, bf16_t* xr) {
#pragma unroll
        for (int i = 3; i < 19; i++) xr[i] = X[(long long)(tok0 + min(r0 - 3 + i, n - 1)) * D + col];
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int r = r0 - 3 + i;
            const bf16_t a = X[(long long)max(tok0 + min(r, n - 1), 0) * D + col];
            const bf16_t b = conv_state[(((long long)slot * 3 + which) * 3 + min(max(3 + pos0 + r, 0), 2)) * D + col];
            xr[i] = pos0 + r >= 0 ? a : b;
        }
    };
    auto conv_rows = [&](int which, const bf16_t* xr, float* dst) {
        const float* w = convw + ((long long)which * D + col) * 4;
        const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int r = r0 + i;
            const float y = w0 * bf16_to_f32(xr[i]) + w1 * bf16_to_f32(xr[i + 1]) + w2 * bf16_to_f32(xr[i + 2]) + w3 * bf16_to_f32(xr[i + 3]);
            dst[r * LDF + c] = r < n ? __fdividef(y, 1.0f + __expf(-y)) : 0.0f;
        }
    };
    {
        bf16_t xa[19], xb[19];
        load_raw(qr, 0, xa);
        load_raw(kr, 1, xb);
        conv_rows(0, xa, sq);
        load_raw(vr, 2, xa);
        conv_rows(1, xb, sk);
        bf16_t* xg = xb;  // gate inputs of rows r0..r0+15 (clamped)
#pragma unroll
        for (int i = 0; i < 16; i++) xg[i] = graw[(long long)(tok0 + min(r0 + i, n - 1)) * D + col];
        conv_rows(2, xa, sv);
        const float aexp = __expf(a_log[h]), dtb = dt_bias[col];
        float run = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int r = r0 + i;
            run += r < n ? lower_bound * sigm(aexp * (bf16_to_f32(xg[i]) + dtb)) : 0.0f;
            se[r * LDF + c] = run;
        }
        sTot[qt * KD + c] = run;
    }
    if (tid < KC) sBeta[tid] = tid < n ? sigm(bf16_to_f32(braw[(long long)(tok0 + tid) * H + h])) : 0.0f;
    __syncthreads();
    {
        float base = 0.0f;
        for (int j = 0; j < qt; j++) base += sTot[j * KD + c];
        // This quarter is block qt; its reference row is its first row.
        const float gr = se[r0 * LDF + c] + base;
        sGR[qt * KD + c] = gr;
        if (qt == 3) sGL[c] = se[63 * LDF + c] + base;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int r = r0 + i;
            se[r * LDF + c] = __expf(se[r * LDF + c] + base - gr);
        }
    }
    // L2 norms: one warp per row, 4 rows per warp.
    for (int r = wp * 4; r < wp * 4 + 4; r++) {
        float4 a = *reinterpret_cast<float4*>(&sq[r * LDF + 4 * lane]);
        float4 b = *reinterpret_cast<float4*>(&sk[r * LDF + 4 * lane]);
        const float qs = warp_sum(a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w);
        const float ks = warp_sum(b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w);
        const float qi = 0.08838834764831845f / sqrtf(qs + 1e-6f), ki = 1.0f / sqrtf(ks + 1e-6f);
        a.x *= qi; a.y *= qi; a.z *= qi; a.w *= qi;
        b.x *= ki; b.y *= ki; b.z *= ki; b.w *= ki;
        *reinterpret_cast<float4*>(&sq[r * LDF + 4 * lane]) = a;
        *reinterpret_cast<float4*>(&sk[r * LDF + 4 * lane]) = b;
    }
    __syncthreads();
    if (tid < KD) {
        for (int I = 0; I < 4; I++) {
            sER[I * KD + tid] = __expf(sGR[I * KD + tid]);
            sKL[I * KD + tid] = __expf(sGL[tid] - sGR[I * KD + tid]);
        }
    } else if (tid < 2 * KD) {
        const int cc = tid - KD;
        int p = 0;
        for (int I = 1; I < 4; I++)
            for (int J = 0; J < I; J++, p++) sF[p * KD + cc] = __expf(sGR[I * KD + cc] - sGR[J * KD + cc]);
    }
    __syncthreads();

    // --- A_kk and A_qk, 16x16 blocks (I >= J), 20 tasks over 8 warps.
    for (int tk = wp; tk < 20; tk += PT / 32) {
        const int p = tk >> 1, mat = tk & 1;
        const int I = p >= 6 ? 3 : p >= 3 ? 2 : p >= 1 ? 1 : 0, J = p - I * (I + 1) / 2;
        const float* X = mat ? sq : sk;
        const float* F = I > J ? sF + (I * (I - 1) / 2 + J) * KD : nullptr;
        float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 2
        for (int ks = 0; ks < 8; ks++) {
            unsigned a[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int row = I * 16 + g + 8 * (q & 1), cl = ks * 16 + 2 * t + 8 * (q >> 1);
                const float2 x = *reinterpret_cast<const float2*>(&X[row * LDF + cl]);
                const float2 e = *reinterpret_cast<const float2*>(&se[row * LDF + cl]);
                a[q] = pack_bf16(x.x * e.x, x.y * e.y);
            }
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const int j = J * 16 + nt * 8 + g;
                unsigned b[2];
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int cl = ks * 16 + 2 * t + 8 * hh;
                    const float2 x = *reinterpret_cast<const float2*>(&sk[j * LDF + cl]);
                    const float2 e = *reinterpret_cast<const float2*>(&se[j * LDF + cl]);
                    float f0 = __fdividef(x.x, e.x), f1 = __fdividef(x.y, e.y);
                    if (F) { f0 *= F[cl]; f1 *= F[cl + 1]; }
                    b[hh] = pack_bf16(f0, f1);
                }
                mma_bf16(acc[nt], a, b[0], b[1]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int i = I * 16 + g + 8 * (q >> 1), j = J * 16 + nt * 8 + 2 * t + (q & 1);
                if (mat == 0) sA[i * LDA + j] = j < i ? -sBeta[i] * acc[nt][q] : 0.0f;
                else sQK[i * LDA + j] = j <= i ? acc[nt][q] : 0.0f;
            }
    }
    __syncthreads();

    // --- M = (I - A_kk)^-1 in f32: diagonal 16x16 blocks by forward substitution ...
    if (tid < 64) {
        const int I = tid >> 4, cc = tid & 15;
        float X[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float s = i == cc ? 1.0f : 0.0f;
#pragma unroll
            for (int j = 0; j < i; j++) s += sA[(I * 16 + i) * LDA + I * 16 + j] * X[j];
            X[i] = s;
        }
#pragma unroll
        for (int i = 0; i < 16; i++) sM[(I * 16 + i) * LDA + I * 16 + cc] = X[i];
    }
    __syncthreads();
    // ... then block (I, J), I > J: M_IJ = M_II · Σ_{K=J}^{I-1} A_IK M_KJ, by distance I - J.
    for (int d = 1; d < 4; d++) {
        const int np = 4 - d;
        for (int e = tid; e < np * 256; e += PT) {
            const int J = e >> 8, I = J + d, r = (e >> 4) & 15, cc = e & 15;
            float s = 0.0f;
            for (int K = J; K < I; K++)
#pragma unroll
                for (int m = 0; m < 16; m++) s += sA[(I * 16 + r) * LDA + K * 16 + m] * sM[(K * 16 + m) * LDA + J * 16 + cc];
            sT[e] = s;
        }
        __syncthreads();
        for (int e = tid; e < np * 256; e += PT) {
            const int J = e >> 8, I = J + d, r = (e >> 4) & 15, cc = e & 15;
            float s = 0.0f;
#pragma unroll
            for (int m = 0; m < 16; m++) s += sM[(I * 16 + r) * LDA + I * 16 + m] * sT[(e & ~255) + m * 16 + cc];
            sM[(I * 16 + r) * LDA + J * 16 + cc] = s;
        }
        __syncthreads();
    }

    // --- w = M (beta e^G k), u = M (beta v): warp = (row tile, w|u), 16 column tiles each.
    {
        const int mt = wp & 3, isu = (wp >> 2) & 1, n0 = (wp >> 3) * 8;
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        for (int ks = 0; ks <= mt; ks++) {
            unsigned a[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int row = mt * 16 + g + 8 * (q & 1), cl = ks * 16 + 2 * t + 8 * (q >> 1);
                const float2 x = *reinterpret_cast<const float2*>(&sM[row * LDA + cl]);
                a[q] = pack_bf16(x.x, x.y);
            }
            const int j0 = ks * 16 + 2 * t;
            const float be[4] = {sBeta[j0], sBeta[j0 + 1], sBeta[j0 + 8], sBeta[j0 + 9]};
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const int d = (n0 + nt) * 8 + g;
                float y[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int j = j0 + (q & 1) + 8 * (q >> 1);
                    y[q] = isu ? be[q] * sv[j * LDF + d] : be[q] * sk[j * LDF + d] * se[j * LDF + d] * sER[ks * KD + d];
                }
                mma_bf16(acc[nt], a, pack_bf16(y[0], y[1]), pack_bf16(y[2], y[3]));
            }
        }
        bf16_t* dst = rb + (isu ? REC_U : REC_W);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = mt * 16 + g + 8 * hh, cl = (n0 + nt) * 8 + 2 * t;
                *reinterpret_cast<unsigned*>(&dst[swz(row, cl, KD)]) = pack_bf16(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
            }
    }
    // --- q e^G [64][128], (k e^(G_last - G))^T [128][64], A_qk [64][64], e^G_last [128].
    for (int e = tid; e < 1024; e += PT) {
        const int row = e >> 4, u = e & 15;
        float f[8];
#pragma unroll
        for (int x = 0; x < 8; x++) {
            const int d = u * 8 + x;
            f[x] = sq[row * LDF + d] * se[row * LDF + d] * sER[(row >> 4) * KD + d];
        }
        st_vec(rb + REC_QG + row * KD + ((u ^ (row & 7)) << 3), f);
    }
    for (int e = tid; e < 1024; e += PT) {
        const int d = e & 127, u = e >> 7;
        float f[8];
#pragma unroll
        for (int x = 0; x < 8; x++) {
            const int j = u * 8 + x;
            f[x] = __fdividef(sk[j * LDF + d], se[j * LDF + d]) * sKL[(j >> 4) * KD + d];
        }
        st_vec(rb + REC_KT + d * KC + ((u ^ (d & 7)) << 3), f);
    }
    for (int e = tid; e < 512; e += PT) {
        const int row = e >> 3, u = e & 7;
        float f[8];
#pragma unroll
        for (int x = 0; x < 8; x++) f[x] = sQK[row * LDA + u * 8 + x];
        st_vec(rb + REC_AQK + row * KC + ((u ^ (row & 7)) << 3), f);
    }
    if (tid < KD) reinterpret_cast<float*>(rec + REC_GL_BYTES)[tid] = __expf(sGL[tid]);
}

// ------------------------------------------------------------------------------------------
// Prefill, stage 2: one block (256 threads) per (sequence, head); seqs[b] = {tok0, len, chunk0,
// slot} (the sequence's pool slot of both states; its chunk count is ceil(len / 64)). Warp wp owns S rows (k index) 16wp..16wp+15 in accS, and for the output the row
// tile wp&3 and the column half wp>>2.
// Stores the pair (c0, c1) = C-fragment elements (row, col), (row, col + 1), row = base + g,
// transposed as bf16 into dst[col][row]: lanes g and g^1 swap one value so that each stores
// one 32-bit word of two consecutive rows. All 32 lanes must call it.
__device__ __forceinline__ void st_frag_t(bf16_t* dst, int ld, int row, int col, float c0, float c1, int g) {
    const bool odd = g & 1;
    const float x = __shfl_xor_sync(0xffffffffu, odd ? c0 : c1, 4);
    if (!odd) *reinterpret_cast<unsigned*>(&dst[col * ld + row]) = pack_bf16(c0, x);
    else *reinterpret_cast<unsigned*>(&dst[(col + 1) * ld + row - 1]) = pack_bf16(x, c1);
}

__device__ __forceinline__ unsigned ld_rec(const bf16_t* base, int r, int c, int rowlen) {
    return *reinterpret_cast<const unsigned*>(&base[swz(r, c, rowlen)]);
}

extern "C" __global__ void __launch_bounds__(256, 1)
kda_chunk_scan(const unsigned char* __restrict__ work, const int4* __restrict__ seqs,
               const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
               bf16_t* __restrict__ conv_state, const bf16_t* __restrict__ gate,
               const float* __restrict__ onorm_w, float* __restrict__ state,
               float* __restrict__ chunk_states, bf16_t* __restrict__ out, int H, float eps) {
    extern __shared__ __align__(16) unsigned char smem_b[];
    unsigned char* stage0 = smem_b;
    bf16_t* sST = reinterpret_cast<bf16_t*>(smem_b + 2 * REC_BYTES);  // S^T [128][LST]
    bf16_t* sVT = sST + KD * LST;                                      // v'^T [128][LVT]
    float* sNorm = reinterpret_cast<float*>(sVT + KD * LVT);           // [2][64]
    float* sW = sNorm + 2 * KC;                                        // o_norm weight [128]

    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, D = H * KD;
    const int4 sq = seqs[blockIdx.x];
    const int tok0 = sq.x, len = sq.y, chunk0 = sq.z, slot = sq.w, nch = (len + KC - 1) / KC;
    const int mt = wp & 3, nh = wp >> 2;
    float* Sg = state + ((long long)slot * H + h) * (KD * KD);
    if (tid < KD) sW[tid] = onorm_w[tid];

    auto prefetch = [&](int cidx) {
        const unsigned char* src = work + ((long long)(chunk0 + cidx) * H + h) * REC_BYTES;
        unsigned char* dst = stage0 + (cidx & 1) * REC_BYTES;
        for (int i = tid; i < REC_BYTES / 16; i += 256) cp16(dst + 16 * i, src + 16 * i);
        cp_commit();
    };
    if (nch > 0) prefetch(0);

    float accS[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = wp * 16 + g + 8 * hh, cl = nt * 8 + 2 * t;
            const float2 v = *reinterpret_cast<const float2*>(&Sg[row * KD + cl]);
            accS[nt][2 * hh] = v.x;
            accS[nt][2 * hh + 1] = v.y;
            st_frag_t(sST, LST, row, cl, v.x, v.y, g);
        }

    for (int c = 0; c < nch; c++) {
        cp_wait_all();
        __syncthreads();
        if (c + 1 < nch) prefetch(c + 1);
        const unsigned char* st = stage0 + (c & 1) * REC_BYTES;
        const bf16_t* rW = reinterpret_cast<const bf16_t*>(st) + REC_W;
        const bf16_t* rU = reinterpret_cast<const bf16_t*>(st) + REC_U;
        const bf16_t* rQ = reinterpret_cast<const bf16_t*>(st) + REC_QG;
        const bf16_t* rK = reinterpret_cast<const bf16_t*>(st) + REC_KT;
        const bf16_t* rA = reinterpret_cast<const bf16_t*>(st) + REC_AQK;
        const float* rGL = reinterpret_cast<const float*>(st + REC_GL_BYTES);
        const int n = min(KC, len - c * KC);
        const long long trow = tok0 + (long long)c * KC;

        // Output-gate values for this warp's fragment, loaded early.
        unsigned gv[8][2];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = mt * 16 + g + 8 * hh, cl = h * KD + nh * 64 + nt * 8 + 2 * t;
                gv[nt][hh] = *reinterpret_cast<const unsigned*>(&gate[(trow + min(row, n - 1)) * D + cl]);
            }

        // v' = u - w S ; o = (q e^G) S
        float accV[8][4], accO[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) accV[nt][q] = accO[nt][q] = 0.0f;
#pragma unroll 2
        for (int ks = 0; ks < 8; ks++) {
            unsigned aw[4], aq[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int row = mt * 16 + g + 8 * (q & 1), cl = ks * 16 + 2 * t + 8 * (q >> 1);
                aw[q] = ld_rec(rW, row, cl, KD);
                aq[q] = ld_rec(rQ, row, cl, KD);
            }
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const bf16_t* bp = sST + (nh * 64 + nt * 8 + g) * LST + ks * 16 + 2 * t;
                const unsigned b0 = *reinterpret_cast<const unsigned*>(bp), b1 = *reinterpret_cast<const unsigned*>(bp + 8);
                mma_bf16(accV[nt], aw, b0, b1);
                mma_bf16(accO[nt], aq, b0, b1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = mt * 16 + g + 8 * hh, cl = nh * 64 + nt * 8 + 2 * t;
                const unsigned u = ld_rec(rU, row, cl, KD);
                st_frag_t(sVT, LVT, row, cl, lo_bf16(u) - accV[nt][2 * hh], hi_bf16(u) - accV[nt][2 * hh + 1], g);
            }
        __syncthreads();

        // o += A_qk v'  (causal: only key tiles <= the row tile)
        for (int ks = 0; ks <= mt; ks++) {
            unsigned a[4];
#pragma unroll
            for (int q = 0; q < 4; q++) a[q] = ld_rec(rA, mt * 16 + g + 8 * (q & 1), ks * 16 + 2 * t + 8 * (q >> 1), KC);
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const bf16_t* bp = sVT + (nh * 64 + nt * 8 + g) * LVT + ks * 16 + 2 * t;
                mma_bf16(accO[nt], a, *reinterpret_cast<const unsigned*>(bp), *reinterpret_cast<const unsigned*>(bp + 8));
            }
        }
        // S = e^G_last S + (k e^(G_last - G))^T v'
        {
            const float gl0 = rGL[wp * 16 + g], gl1 = rGL[wp * 16 + g + 8];
#pragma unroll
            for (int nt = 0; nt < 16; nt++) {
                accS[nt][0] *= gl0; accS[nt][1] *= gl0; accS[nt][2] *= gl1; accS[nt][3] *= gl1;
            }
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                unsigned a[4];
#pragma unroll
                for (int q = 0; q < 4; q++) a[q] = ld_rec(rK, wp * 16 + g + 8 * (q & 1), ks * 16 + 2 * t + 8 * (q >> 1), KC);
#pragma unroll
                for (int nt = 0; nt < 16; nt++) {
                    const bf16_t* bp = sVT + (nt * 8 + g) * LVT + ks * 16 + 2 * t;
                    mma_bf16(accS[nt], a, *reinterpret_cast<const unsigned*>(bp), *reinterpret_cast<const unsigned*>(bp + 8));
                }
            }
            float* cs = chunk_states ? chunk_states + ((long long)(chunk0 + c) * H + h) * (KD * KD) : nullptr;
#pragma unroll
            for (int nt = 0; nt < 16; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = wp * 16 + g + 8 * hh, cl = nt * 8 + 2 * t;
                    st_frag_t(sST, LST, row, cl, accS[nt][2 * hh], accS[nt][2 * hh + 1], g);
                    if (cs) *reinterpret_cast<float2*>(&cs[row * KD + cl]) = make_float2(accS[nt][2 * hh], accS[nt][2 * hh + 1]);
                }
        }
        // RMSNorm over the 128 values of a row (two warps hold a row) x o_norm x sigmoid(gate).
        float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            ss0 += accO[nt][0] * accO[nt][0] + accO[nt][1] * accO[nt][1];
            ss1 += accO[nt][2] * accO[nt][2] + accO[nt][3] * accO[nt][3];
        }
        ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1); ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
        ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1); ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
        if (t == 0) { sNorm[nh * KC + mt * 16 + g] = ss0; sNorm[nh * KC + mt * 16 + g + 8] = ss1; }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = mt * 16 + g + 8 * hh;
            if (row >= n) continue;
            const float inv = 1.0f / sqrtf((sNorm[row] + sNorm[KC + row]) * (1.0f / KD) + eps);
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const int cl = nh * 64 + nt * 8 + 2 * t;
                const unsigned gg = gv[nt][hh];
                const float y0 = accO[nt][2 * hh] * inv * sW[cl] * sigm(lo_bf16(gg));
                const float y1 = accO[nt][2 * hh + 1] * inv * sW[cl + 1] * sigm(hi_bf16(gg));
                *reinterpret_cast<unsigned*>(&out[(trow + row) * D + h * KD + cl]) = pack_bf16(y0, y1);
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = wp * 16 + g + 8 * hh, cl = nt * 8 + 2 * t;
            *reinterpret_cast<float2*>(&Sg[row * KD + cl]) = make_float2(accS[nt][2 * hh], accS[nt][2 * hh + 1]);
        }
    // New conv state: the last 3 raw inputs (older ones from the previous state when len < 3).
    if (tid < KD) {
        const int col = h * KD + tid;
        for (int which = 0; which < 3; which++) {
            const bf16_t* X = which == 0 ? qr : which == 1 ? kr : vr;
            bf16_t* cs = conv_state + ((long long)slot * 3 + which) * 3 * D + col;
            for (int k = 0; k < 3; k++) {
                const int p = len - 3 + k;
                cs[(long long)k * D] = p >= 0 ? X[(long long)(tok0 + p) * D + col] : cs[(long long)(k + len) * D];
            }
        }
    }
}
