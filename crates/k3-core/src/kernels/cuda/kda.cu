// kda.cu: Kimi Delta Attention on the GPU (text-backbone §3.2-3.8), head_dim 128, chunk 64.
// CPU oracles: kernels/cpu/kda.rs (core) and k3-model layers/kda.rs (conv, norms, gates).
//
// Prefill is two kernels over packed variable-length sequences (docs/kernels/kda.md has the
// design, the floors and the measurements):
//  * kda_chunk_prep, one 256-thread block per (chunk, head), two blocks per SM, all chunks in
//    parallel: causal conv + SiLU (reading the conv state for a sequence's first chunk), L2
//    norms, q scale, beta, the lower-bounded gate and its cumulative sum G (f32, log2 units),
//    A_kk and A_qk on tensor cores (bf16 mma.sync m16n8k16, f32 accumulate, ldmatrix operands)
//    with one reference row per 16-row block so that no factor exceeds e^75, the inverse
//    (I - A_kk)^-1 (16x16 diagonal blocks by f32 substitution, off-diagonal blocks by block
//    substitution on TF32 tensor cores), then w and u on tensor cores. It writes one 74240-byte
//    record per (chunk, head): w, u, q*e^G, (k*e^(G_last-G))^T, A_qk (bf16, 16-byte units
//    XOR-swizzled by row for ldmatrix) and e^G_last.
//  * kda_chunk_scan, one 512-thread block per (sequence, head): the state S (128x128 f32) lives
//    in mma accumulators across chunks; per chunk v' = u - w S, o = (q e^G) S + A_qk v',
//    S = e^G_last S + (k e^(G_last-G))^T v', then RMSNorm x sigmoid(gate) and the bf16 output.
//    Records arrive by bulk copy (TMA), double-buffered. The block's two halves (value columns
//    0-63, 64-127) share no S or v' data and sync on their own named barriers. It also writes the final state, the
//    new conv state and (optionally) the state after every chunk.
// Conv and recurrent states live in a pool of slots ([S, 3, 3, D] bf16, [S, H, 128, 128] f32);
// the tables carry each sequence's slot, so the kernels only index the pool by it.
// Decode is in kda_decode.cu.

#define KD 128
#define KC 64
#define LDA 68   // f32 row stride of [64][64] smem tiles
#define REC_W 0
#define REC_U 8192
#define REC_QG 16384
#define REC_KT 24576
#define REC_AQK 32768
#define REC_GL_BYTES 73728
#define REC_BYTES 74240

// Element (r, c) of a swizzled bf16 tile with `rowlen` (64 or 128) columns.
__device__ __forceinline__ int swz(int r, int c, int rowlen) {
    return r * rowlen + ((((c >> 3) ^ (r & 7))) << 3) + (c & 7);
}

// ------------------------------------------------------------------------------------------
// Prefill, stage 1: one block (PT = 256 threads, two blocks per SM) per (chunk, head);
// chunks[i] = {tok0, n, slot, pos0} (slot: the sequence's pool slot of the conv state).
// Phase 1 works on registers, thread = (channel pair c, c+1; quarter qt = rows 16qt..16qt+15):
// raw loads, gate and local cumulative sums, v (conv, SiLU, ×β → BV), and the row sums of
// squares of q and k (a first, approximate SiLU pass). After one barrier it reloads the raw q, k
// and gate inputs (from L2: holding them across the barrier would spill), recomputes q, k and
// the running gate sums exactly, normalises q and k and writes the bf16 operand tiles
// (below) and the record's q·e^G and (k·e^(G_last−G))ᵀ straight from registers. Then A_kk, A_qk
// (ldmatrix + mma, A_qk straight to the record), the f32 inverse, and w, u (mma, to the record).
// Operand tiles (bf16 [rows][128], 16-byte units XOR-swizzled by row), with r(I) = 16·I the
// reference row of 16-row block I:
//   QE, KE = q, k · e^(G_i − G_r(I))            (A operands of A_qk, A_kk; factor ≤ 1)
//   KB_I   = k_j · e^(G_r(I) − G_j), j < 16(I+1) (B operand of row block I; ≤ e^75 on the diagonal)
//   BK     = β_j k_j e^G_j, BV = β_j v_j        (B operands of w and u)
#define PT 256
#define SM_QE 0          // [64][128] bf16
#define SM_KE 16384      // [64][128] bf16
#define SM_KB 32768      // [160][128] bf16: KB_0 rows 0..15, KB_1 16..47, KB_2 48..95, KB_3 96..159
#define SM_BK 73728      // [64][128] bf16
#define SM_BV 90112      // [64][128] bf16
#define SM_SMALL 106496  // f32: sTot [4][128], sFirst [4][128], sN [2][2][64], sBeta [64]
#define PREP_SMEM_BYTES 111872
// After the A products the QE/KE/KB bytes hold f32 A_kk [64][LDA], M [64][LDA], scratch [3][16][16].

// SiLU in one MUFU op (tanh.approx, ~2^-11 relative error): every SiLU output of the prep is
// rounded to bf16 (2^-9) right after, or only feeds the L2 norms' sums of squares.
__device__ __forceinline__ float silu_fast(float x) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * x));
    return 0.5f * x * (1.0f + t);
}
// 16 per-lane values summed over the warp; lane l returns the total of value
// ((l>>4)&1)*8 + ((l>>3)&1)*4 + ((l>>2)&1)*2 + ((l>>1)&1) (16 shuffles instead of 80).
__device__ __forceinline__ int red16_index(int l) { return ((l >> 4) & 1) * 8 + ((l >> 3) & 1) * 4 + ((l >> 2) & 1) * 2 + ((l >> 1) & 1); }
template <int W>
__device__ __forceinline__ void fold_half(float* v, int lane) {
    const bool up = lane & (2 * W);
#pragma unroll
    for (int i = 0; i < W; i++) {
        const float send = up ? v[i] : v[i + W], keep = up ? v[i + W] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, 2 * W);
    }
}
__device__ __forceinline__ float warp_reduce16(float* v, int lane) {
    fold_half<8>(v, lane);
    fold_half<4>(v, lane);
    fold_half<2>(v, lane);
    fold_half<1>(v, lane);
    return v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
}
__device__ __forceinline__ void st_u32(bf16_t* tile, int r, int c, float lo, float hi) {
    *reinterpret_cast<unsigned*>(&tile[swz(r, c, KD)]) = pack_bf16(lo, hi);
}

extern "C" __global__ void __launch_bounds__(PT, 2)
kda_chunk_prep(const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
               const bf16_t* __restrict__ graw, const bf16_t* __restrict__ braw,
               const float* __restrict__ convw, const float* __restrict__ a_log,
               const float* __restrict__ dt_bias, const bf16_t* __restrict__ conv_state,
               const int4* __restrict__ chunks, unsigned char* __restrict__ work, int H, float lower_bound) {
    extern __shared__ __align__(16) unsigned char sm[];
    bf16_t* sQE = reinterpret_cast<bf16_t*>(sm + SM_QE);
    bf16_t* sKE = reinterpret_cast<bf16_t*>(sm + SM_KE);
    bf16_t* sKB = reinterpret_cast<bf16_t*>(sm + SM_KB);
    bf16_t* sBK = reinterpret_cast<bf16_t*>(sm + SM_BK);
    bf16_t* sBV = reinterpret_cast<bf16_t*>(sm + SM_BV);
    float* sTot = reinterpret_cast<float*>(sm + SM_SMALL);  // quarter totals of the gate [4][128]
    float* sFirst = sTot + 4 * KD;                          // first row of each quarter's local sum [4][128]
    float* sN = sFirst + 4 * KD;                            // sums of squares [q|k][channel half][64]
    float* sBeta = sN + 4 * KC;                             // [64]
    float* sA = reinterpret_cast<float*>(sm);               // A_kk, negative form, strictly lower [64][LDA]
    float* sM = sA + KC * LDA;                              // (I - A_kk)^-1
    float* sT = sM + KC * LDA;                              // block-substitution scratch [3][16][16]

    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int4 ch = chunks[blockIdx.x];
    const int tok0 = ch.x, n = ch.y, slot = ch.z, pos0 = ch.w;
    const int h = blockIdx.y, D = H * KD;
    unsigned char* rec = work + ((long long)blockIdx.x * H + h) * REC_BYTES;
    bf16_t* rb = reinterpret_cast<bf16_t*>(rec);

    // ---- Phase 1: thread = (channels c, c+1; rows r0..r0+15). A warp covers 64 channels of a quarter.
    const int c = 2 * (tid & 63), qt = tid >> 6, r0 = qt * 16, col = h * KD + c, half = wp & 1;
    auto ld2 = [&](const bf16_t* X, long long row) { return *reinterpret_cast<const unsigned*>(&X[row * D + col]); };
    // Raw pre-conv rows r0-3 .. r0+15 (clamped, branch-free; rows before the sequence start come
    // from the conv state, the tap index clamped to 0..2 so both candidates are valid addresses).
    auto load_raw = [&](const bf16_t* X, int which, unsigned* xr) {
#pragma unroll
        for (int i = 3; i < 19; i++) xr[i] = ld2(X, tok0 + min(r0 - 3 + i, n - 1));
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int r = r0 - 3 + i;
            const unsigned a = ld2(X, max(tok0 + min(r, n - 1), 0));
            const unsigned b = ld2(conv_state + ((long long)slot * 3 + which) * 3 * D, min(max(3 + pos0 + r, 0), 2));
            xr[i] = pos0 + r >= 0 ? a : b;
        }
    };
    // Causal depthwise conv of row r0+i for both channels (tap 3 multiplies the current row).
    auto conv = [&](const unsigned* xr, int i, const float4& w0, const float4& w1, float& y0, float& y1) {
        y0 = w0.x * lo_bf16(xr[i]) + w0.y * lo_bf16(xr[i + 1]) + w0.z * lo_bf16(xr[i + 2]) + w0.w * lo_bf16(xr[i + 3]);
        y1 = w1.x * hi_bf16(xr[i]) + w1.y * hi_bf16(xr[i + 1]) + w1.z * hi_bf16(xr[i + 2]) + w1.w * hi_bf16(xr[i + 3]);
    };
    auto convw4 = [&](int which, int cc) { return *reinterpret_cast<const float4*>(&convw[((long long)which * D + cc) * 4]); };

    // The gate is kept in log2 units (G·log2 e) so that every decay factor is one ex2.
    const float aexp = exp_ftz(a_log[h]), lb2 = lower_bound * K3_LOG2E;
    const float2 dtb = *reinterpret_cast<const float2*>(&dt_bias[col]);
    // Rows past the chunk's end are masked by multiplying with 0 rather than by branches: a
    // branch per row would stop the compiler from overlapping the rows' MUFU latencies.
    auto gate = [&](unsigned x, float live, float& a0, float& a1) {
        a0 = lb2 * live * sigmoid_ftz(aexp * (lo_bf16(x) + dtb.x));
        a1 = lb2 * live * sigmoid_ftz(aexp * (hi_bf16(x) + dtb.y));
    };
    {
        unsigned xg[16], xv[19], xq[19], xk[19];
#pragma unroll
        for (int i = 0; i < 16; i++) xg[i] = ld2(graw, tok0 + min(r0 + i, n - 1));
        load_raw(vr, 2, xv);
        load_raw(qr, 0, xq);
        load_raw(kr, 1, xk);
        // beta: lane i < 16 computes row r0+i's, then broadcasts.
        const float bl = lane < 16 && r0 + lane < n ? sigmoid_ftz(bf16_to_f32(braw[(long long)(tok0 + min(r0 + lane, n - 1)) * H + h])) : 0.0f;
        if (half == 0 && lane < 16) sBeta[r0 + lane] = bl;
        // The gate's quarter totals and first rows (phase 1b recomputes the running sums).
        float run0 = 0.0f, run1 = 0.0f, f0 = 0.0f, f1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float a0, a1;
            gate(xg[i], r0 + i < n ? 1.0f : 0.0f, a0, a1);
            run0 += a0;
            run1 += a1;
            if (i == 0) { f0 = a0; f1 = a1; }
        }
        *reinterpret_cast<float2*>(&sTot[qt * KD + c]) = make_float2(run0, run1);
        *reinterpret_cast<float2*>(&sFirst[qt * KD + c]) = make_float2(f0, f1);
        const float4 wv0 = convw4(2, col), wv1 = convw4(2, col + 1);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            float y0, y1;
            conv(xv, i, wv0, wv1, y0, y1);
            const float be = __shfl_sync(0xffffffffu, bl, i);
            st_u32(sBV, r0 + i, c, be * silu_fast(y0), be * silu_fast(y1));
        }
        // Row sums of squares of SiLU(conv q), SiLU(conv k) for the L2 norms.
        auto sumsq = [&](int which, const unsigned(&xr)[19]) {
            const float4 w0 = convw4(which, col), w1 = convw4(which, col + 1);
            float ss[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float y0, y1;
                conv(xr, i, w0, w1, y0, y1);
                const float s0 = silu_fast(y0), s1 = silu_fast(y1);
                ss[i] = s0 * s0 + s1 * s1;
            }
            const float tot = warp_reduce16(ss, lane);
            if (!(lane & 1)) sN[(which * 2 + half) * KC + r0 + red16_index(lane)] = tot;
        };
        sumsq(0, xq);
        sumsq(1, xk);
    }
    __syncthreads();

    // ---- Phase 1b: exact q, k (raw inputs reloaded: they are in L2), normed; the operand tiles
    // and the record's q e^G, (k e^(G_last - G))^T, e^G_last.
    {
        float base0 = 0.0f, base1 = 0.0f;
        for (int j = 0; j < qt; j++) { base0 += sTot[j * KD + c]; base1 += sTot[j * KD + c + 1]; }
        const float g00 = sFirst[qt * KD + c], g01 = sFirst[qt * KD + c + 1];  // local G at row r0
        // Per column, relative to this quarter's reference G_r = G at row r0:
        // F_I = e^(G_r(I) - G_r) for the blocks I >= qt, eR = e^G_r, eL = e^(G_last - G_r).
        float F0[4] = {0.f, 0.f, 0.f, 0.f}, F1[4] = {0.f, 0.f, 0.f, 0.f}, gl0 = base0, gl1 = base1;
#pragma unroll
        for (int I = 0; I < 4; I++) {
            if (I >= qt) {
                F0[I] = ex2_ftz(gl0 + sFirst[I * KD + c] - base0 - g00);
                F1[I] = ex2_ftz(gl1 + sFirst[I * KD + c + 1] - base1 - g01);
                gl0 += sTot[I * KD + c];
                gl1 += sTot[I * KD + c + 1];
            }
        }
        const float gr0 = base0 + g00, gr1 = base1 + g01;
        const float eR0 = ex2_ftz(gr0), eR1 = ex2_ftz(gr1), eL0 = ex2_ftz(gl0 - gr0), eL1 = ex2_ftz(gl1 - gr1);
        if (qt == 0) *reinterpret_cast<float2*>(rec + REC_GL_BYTES + 4 * c) = make_float2(ex2_ftz(gl0), ex2_ftz(gl1));
        unsigned xg[16], xq[19], xk[19];
#pragma unroll
        for (int i = 0; i < 16; i++) xg[i] = ld2(graw, tok0 + min(r0 + i, n - 1));
        load_raw(qr, 0, xq);
        load_raw(kr, 1, xk);
        const float4 wq0 = convw4(0, col), wq1 = convw4(0, col + 1), wk0 = convw4(1, col), wk1 = convw4(1, col + 1);
        unsigned kt0[8], kt1[8];
        float pk0 = 0.0f, pk1 = 0.0f, run0 = 0.0f, run1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int r = r0 + i;
            const float live = r < n ? 1.0f : 0.0f;
            float a0, a1;
            gate(xg[i], live, a0, a1);
            run0 += a0;
            run1 += a1;
            const float d0 = run0 - g00, d1 = run1 - g01;  // G_i - G_r <= 0
            const float e0 = ex2_ftz(d0), e1 = ex2_ftz(d1), ei0 = ex2_ftz(-d0), ei1 = ex2_ftz(-d1);
            const float qi = live * 0.08838834764831845f * rsqrt_ftz(sN[r] + sN[KC + r] + 1e-6f);
            const float ki = live * rsqrt_ftz(sN[2 * KC + r] + sN[3 * KC + r] + 1e-6f);
            float y0, y1;
            conv(xq, i, wq0, wq1, y0, y1);
            const float q0 = silu_fast(y0) * qi * e0, q1 = silu_fast(y1) * qi * e1;
            st_u32(sQE, r, c, q0, q1);
            *reinterpret_cast<unsigned*>(&rb[REC_QG + swz(r, c, KD)]) = pack_bf16(q0 * eR0, q1 * eR1);
            conv(xk, i, wk0, wk1, y0, y1);
            const float k0 = silu_fast(y0) * ki, k1 = silu_fast(y1) * ki;
            const float be = sBeta[r];
            st_u32(sKE, r, c, k0 * e0, k1 * e1);
            st_u32(sBK, r, c, be * k0 * e0 * eR0, be * k1 * e1 * eR1);
            const float b0 = k0 * ei0, b1 = k1 * ei1;
#pragma unroll
            for (int I = 0; I < 4; I++) {
                const float x0 = b0 * F0[I], x1 = b1 * F1[I];  // F_qt = 1; F_I = 0 below qt (unused)
                if (I >= qt) st_u32(sKB, 8 * I * (I + 1) + r, c, x0, x1);
            }
            const float t0 = b0 * eL0, t1 = b1 * eL1;
            if (i & 1) {
                kt0[i >> 1] = pack_bf16(pk0, t0);
                kt1[i >> 1] = pack_bf16(pk1, t1);
            } else {
                pk0 = t0;
                pk1 = t1;
            }
        }
#pragma unroll
        for (int cc = 0; cc < 2; cc++) {
            const int d = c + cc;
            bf16_t* row = rb + REC_KT + d * KC;
            *reinterpret_cast<uint4*>(row + (((2 * qt) ^ (d & 7)) << 3)) = cc ? make_uint4(kt1[0], kt1[1], kt1[2], kt1[3]) : make_uint4(kt0[0], kt0[1], kt0[2], kt0[3]);
            *reinterpret_cast<uint4*>(row + (((2 * qt + 1) ^ (d & 7)) << 3)) = cc ? make_uint4(kt1[4], kt1[5], kt1[6], kt1[7]) : make_uint4(kt0[4], kt0[5], kt0[6], kt0[7]);
        }
    }
    __syncthreads();

    // ---- Phase 2: A_kk and A_qk by 16x16 blocks (I >= J): 10 pairs over 8 warps, both products
    // of a pair share the B operand KB_I. A_qk goes straight to the record; A_kk waits for the barrier.
    float akk[2][2][4];
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const int p = wp + 8 * s;
        if (p >= 10) break;
        const int I = p < 4 ? 3 : p < 7 ? 2 : p < 9 ? 1 : 0, J = p < 4 ? p : p < 7 ? p - 4 : p < 9 ? p - 7 : 0;
        float aqk[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) akk[s][nt][q] = aqk[nt][q] = 0.0f;
        const int ar = I * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, br = 8 * I * (I + 1) + J * 16 + (lane >> 4) * 8 + (lane & 7);
#pragma unroll
        for (int ks = 0; ks < 8; ks++) {
            unsigned ak[4], aq[4], bb[4];
            ldsm_x4(ak, sKE + swz(ar, ks * 16 + (lane >> 4) * 8, KD));
            ldsm_x4(aq, sQE + swz(ar, ks * 16 + (lane >> 4) * 8, KD));
            ldsm_x4(bb, sKB + swz(br, ks * 16 + ((lane >> 3) & 1) * 8, KD));
            mma_bf16(akk[s][0], ak, bb[0], bb[1]);
            mma_bf16(akk[s][1], ak, bb[2], bb[3]);
            mma_bf16(aqk[0], aq, bb[0], bb[1]);
            mma_bf16(aqk[1], aq, bb[2], bb[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int i = I * 16 + g + 8 * hh, j = J * 16 + nt * 8 + 2 * t;
                *reinterpret_cast<unsigned*>(&rb[REC_AQK + swz(i, j, KC)]) =
                    pack_bf16(j <= i ? aqk[nt][2 * hh] : 0.0f, j + 1 <= i ? aqk[nt][2 * hh + 1] : 0.0f);
            }
    }
    __syncthreads();  // the operand tiles are dead: A_kk, M and the scratch reuse their bytes
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const int p = wp + 8 * s;
        if (p >= 10) break;
        const int I = p < 4 ? 3 : p < 7 ? 2 : p < 9 ? 1 : 0, J = p < 4 ? p : p < 7 ? p - 4 : p < 9 ? p - 7 : 0;
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int i = I * 16 + g + 8 * (q >> 1), j = J * 16 + nt * 8 + 2 * t + (q & 1);
                sA[i * LDA + j] = j < i ? -sBeta[i] * akk[s][nt][q] : 0.0f;
            }
    }
    __syncthreads();

    // ---- Phase 3: M = (I - A_kk)^-1 in f32: diagonal 16x16 blocks by forward substitution ...
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
    // ... then block (I, J), I > J: M_IJ = M_II · Σ_{K=J}^{I-1} A_IK M_KJ, by distance I - J,
    // one warp per block on tensor cores in TF32 (M is rounded to bf16 for w and u anyway).
    for (int d = 1; d < 4; d++) {
        if (wp < 4 - d) {
            const int J = wp, I = J + d;
            float* T = sT + wp * 256;  // this warp's Σ A_IK M_KJ [16][16]
            float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            for (int K = J; K < I; K++) mma16_tf32(acc, sA + I * 16 * LDA + K * 16, LDA, sM + K * 16 * LDA + J * 16, LDA, g, t);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                *reinterpret_cast<float2*>(&T[g * 16 + nt * 8 + 2 * t]) = make_float2(acc[nt][0], acc[nt][1]);
                *reinterpret_cast<float2*>(&T[(g + 8) * 16 + nt * 8 + 2 * t]) = make_float2(acc[nt][2], acc[nt][3]);
                acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
            }
            __syncwarp();
            mma16_tf32(acc, sM + I * 16 * LDA + I * 16, LDA, T, 16, g, t);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                *reinterpret_cast<float2*>(&sM[(I * 16 + g) * LDA + J * 16 + nt * 8 + 2 * t]) = make_float2(acc[nt][0], acc[nt][1]);
                *reinterpret_cast<float2*>(&sM[(I * 16 + g + 8) * LDA + J * 16 + nt * 8 + 2 * t]) = make_float2(acc[nt][2], acc[nt][3]);
            }
        }
        __syncthreads();
    }

    // ---- Phase 4: w = M BK, u = M BV; warp = (w|u, 32-column quarter), straight to the record.
    {
        const int isu = wp >> 2, cq = wp & 3;
        const bf16_t* Bt = isu ? sBV : sBK;
        bf16_t* dst = rb + (isu ? REC_U : REC_W);
#pragma unroll 1
        for (int mt = 0; mt < 4; mt++) {
            float acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
            for (int ks = 0; ks <= mt; ks++) {
                unsigned a[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int row = mt * 16 + g + 8 * (q & 1), cl = ks * 16 + 2 * t + 8 * (q >> 1);
                    const float2 x = *reinterpret_cast<const float2*>(&sM[row * LDA + cl]);
                    a[q] = pack_bf16(x.x, x.y);
                }
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    unsigned bb[4];
                    ldsm_x4_t(bb, Bt + swz(ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), cq * 32 + hf * 16 + (lane >> 4) * 8, KD));
                    mma_bf16(acc[2 * hf], a, bb[0], bb[1]);
                    mma_bf16(acc[2 * hf + 1], a, bb[2], bb[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = mt * 16 + g + 8 * hh, cl = cq * 32 + nt * 8 + 2 * t;
                    *reinterpret_cast<unsigned*>(&dst[swz(row, cl, KD)]) = pack_bf16(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
                }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Prefill, stage 2: one block (512 threads) per (sequence, head); seqs[b] = {tok0, len, chunk0,
// slot} (the sequence's pool slot of both states; its chunk count is ceil(len / 64)).
// Warp w owns S rows 16(w&7)..+15 × columns 64(w>>3)..+63 in accS (f32, across chunks), and
// for v' and o the row tile w&3 × columns 32(w>>2)..+31. S and v' are re-staged as bf16
// row-major tiles (S [128][LST], v' [64][LST]) and read back as B operands with ldmatrix.trans;
// the record's tiles are read with ldmatrix (they are stored swizzled for it).
#define ST 512
#define LST 136  // bf16 row stride of the S and v' tiles (272 B: ldmatrix rows hit distinct banks)
#define SCAN_SMEM_BYTES (2 * REC_BYTES + (KD + KC) * LST * 2 + 2 * 4 * KC * 4 + KD * 4 + 32)

// Records arrive by bulk copy (TMA, one issuing thread) completing on an mbarrier per stage
// (helpers in common.cuh), in four pieces of 18560 bytes (each a multiple of 16).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    mbar_expect_tx(bar, bytes);
#pragma unroll
    for (int i = 0; i < 4; i++)
        bulk_g2s(reinterpret_cast<unsigned char*>(dst) + i * (bytes / 4), reinterpret_cast<const unsigned char*>(src) + i * (bytes / 4), bytes / 4, bar);
}

__device__ __forceinline__ unsigned ld_rec(const bf16_t* base, int r, int c, int rowlen) {
    return *reinterpret_cast<const unsigned*>(&base[swz(r, c, rowlen)]);
}
// A operand (16x16 at row0, k0) of a swizzled record tile with `rowlen` columns.
__device__ __forceinline__ void lda_rec(unsigned* a, const bf16_t* tile, int row0, int k0, int rowlen, int lane) {
    ldsm_x4(a, tile + swz(row0 + (lane & 7) + ((lane >> 3) & 1) * 8, k0 + (lane >> 4) * 8, rowlen));
}
// B operands of two n-tiles (16 k x 16 n at k0, n0) from a row-major [k][LST] bf16 tile.
__device__ __forceinline__ void ldb_t(unsigned* b, const bf16_t* tile, int k0, int n0, int lane) {
    ldsm_x4_t(b, tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LST + n0 + (lane >> 4) * 8);
}

extern "C" __global__ void __launch_bounds__(ST, 1)
kda_chunk_scan(const unsigned char* __restrict__ work, const int4* __restrict__ seqs,
               const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
               bf16_t* __restrict__ conv_state, const bf16_t* __restrict__ gate,
               const float* __restrict__ onorm_w, float* __restrict__ state,
               float* __restrict__ chunk_states, bf16_t* __restrict__ out, int H, float eps) {
    extern __shared__ __align__(16) unsigned char smem_b[];
    unsigned char* stage0 = smem_b;
    bf16_t* sS = reinterpret_cast<bf16_t*>(smem_b + 2 * REC_BYTES);  // S (bf16) [128][LST]
    bf16_t* sV = sS + KD * LST;                                       // v' [64][LST]
    float* sNorm = reinterpret_cast<float*>(sV + KC * LST);           // [chunk & 1][4][64] row sums of squares
    float* sW = sNorm + 2 * 4 * KC;                                   // o_norm weight [128]
    unsigned long long* bars = reinterpret_cast<unsigned long long*>(sW + KD);  // full[2], empty[2]

    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, D = H * KD;
    const int4 sq = seqs[blockIdx.x];
    const int tok0 = sq.x, len = sq.y, chunk0 = sq.z, slot = sq.w, nch = (len + KC - 1) / KC;
    const int sr = wp & 7, sc = (wp >> 3) * 64;  // this warp's S rows 16sr.., columns sc..sc+63
    const int mt = wp & 3, oc = (wp >> 2) * 32;  // this warp's v'/o row tile and columns oc..oc+31
    float* Sg = state + ((long long)slot * H + h) * (KD * KD);
    if (tid < KD) sW[tid] = onorm_w[tid];
    if (tid == 0) {
        mbar_init(&bars[0], 1);
        mbar_init(&bars[1], 1);
        mbar_init(&bars[2], ST);
        mbar_init(&bars[3], ST);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // Thread 0 starts the bulk copy of chunk cidx's record into stage cidx & 1.
    auto prefetch = [&](int cidx) {
        if (tid == 0)
            bulk_load(stage0 + (cidx & 1) * REC_BYTES, work + ((long long)(chunk0 + cidx) * H + h) * REC_BYTES, REC_BYTES, &bars[cidx & 1]);
    };
    if (nch > 0) prefetch(0);

    float accS[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = sr * 16 + g + 8 * hh, cl = sc + nt * 8 + 2 * t;
            const float2 v = *reinterpret_cast<const float2*>(&Sg[row * KD + cl]);
            accS[nt][2 * hh] = v.x;
            accS[nt][2 * hh + 1] = v.y;
            *reinterpret_cast<unsigned*>(&sS[row * LST + cl]) = pack_bf16(v.x, v.y);
        }

    // The two halves of the block (warps 0-7: value columns 0-63, warps 8-15: 64-127) share no
    // S or v' data, so they meet only on their own named barriers (5, 6); rows meet for the output
    // norm (barriers 1-4). Record stage s is refilled once all 512 threads have arrived on
    // empty[s] after their last read of it.
    auto half_sync = [&]() { asm volatile("bar.sync %0, 256;" ::"r"(5 + (wp >> 3)) : "memory"); };
    for (int c = 0; c < nch; c++) {
        mbar_wait(&bars[c & 1], (c >> 1) & 1);
        if (c + 1 < nch) {
            if (tid == 0 && c >= 1) mbar_wait(&bars[2 + ((c + 1) & 1)], ((c - 1) >> 1) & 1);  // chunk c-1 is done with it
            prefetch(c + 1);
        }
        half_sync();  // this half's S tile (written by the previous chunk) is complete
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
        unsigned gv[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = mt * 16 + g + 8 * hh, cl = h * KD + oc + nt * 8 + 2 * t;
                gv[nt][hh] = *reinterpret_cast<const unsigned*>(&gate[(trow + min(row, n - 1)) * D + cl]);
            }

        // v' = u - w S ; o = (q e^G) S
        float accV[4][4], accO[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int q = 0; q < 4; q++) accV[nt][q] = accO[nt][q] = 0.0f;
#pragma unroll 2
        for (int ks = 0; ks < 8; ks++) {
            unsigned aw[4], aq[4], b[2][4];
            lda_rec(aw, rW, mt * 16, ks * 16, KD, lane);
            lda_rec(aq, rQ, mt * 16, ks * 16, KD, lane);
            ldb_t(b[0], sS, ks * 16, oc, lane);
            ldb_t(b[1], sS, ks * 16, oc + 16, lane);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                mma_bf16(accV[nt], aw, b[nt >> 1][2 * (nt & 1)], b[nt >> 1][2 * (nt & 1) + 1]);
                mma_bf16(accO[nt], aq, b[nt >> 1][2 * (nt & 1)], b[nt >> 1][2 * (nt & 1) + 1]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int row = mt * 16 + g + 8 * hh, cl = oc + nt * 8 + 2 * t;
                const unsigned u = ld_rec(rU, row, cl, KD);
                *reinterpret_cast<unsigned*>(&sV[row * LST + cl]) = pack_bf16(lo_bf16(u) - accV[nt][2 * hh], hi_bf16(u) - accV[nt][2 * hh + 1]);
            }
        half_sync();  // this half's v' columns are complete

        // o += A_qk v'  (causal: only key tiles <= the row tile)
        for (int ks = 0; ks <= mt; ks++) {
            unsigned a[4], b[2][4];
            lda_rec(a, rA, mt * 16, ks * 16, KC, lane);
            ldb_t(b[0], sV, ks * 16, oc, lane);
            ldb_t(b[1], sV, ks * 16, oc + 16, lane);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) mma_bf16(accO[nt], a, b[nt >> 1][2 * (nt & 1)], b[nt >> 1][2 * (nt & 1) + 1]);
        }
        // S = e^G_last S + (k e^(G_last - G))^T v'
        {
            const float gl0 = rGL[sr * 16 + g], gl1 = rGL[sr * 16 + g + 8];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                accS[nt][0] *= gl0; accS[nt][1] *= gl0; accS[nt][2] *= gl1; accS[nt][3] *= gl1;
            }
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                unsigned a[4];
                lda_rec(a, rK, sr * 16, ks * 16, KC, lane);
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    unsigned b[4];
                    ldb_t(b, sV, ks * 16, sc + np * 16, lane);
                    mma_bf16(accS[2 * np], a, b[0], b[1]);
                    mma_bf16(accS[2 * np + 1], a, b[2], b[3]);
                }
            }
            mbar_arrive(&bars[2 + (c & 1)]);  // this thread's last read of the record
            float* cs = chunk_states ? chunk_states + ((long long)(chunk0 + c) * H + h) * (KD * KD) : nullptr;
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = sr * 16 + g + 8 * hh, cl = sc + nt * 8 + 2 * t;
                    *reinterpret_cast<unsigned*>(&sS[row * LST + cl]) = pack_bf16(accS[nt][2 * hh], accS[nt][2 * hh + 1]);
                    if (cs) *reinterpret_cast<float2*>(&cs[row * KD + cl]) = make_float2(accS[nt][2 * hh], accS[nt][2 * hh + 1]);
                }
        }
        // RMSNorm over the 128 values of a row (four warps hold a row) x o_norm x sigmoid(gate).
        float ss0 = 0.0f, ss1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            ss0 += accO[nt][0] * accO[nt][0] + accO[nt][1] * accO[nt][1];
            ss1 += accO[nt][2] * accO[nt][2] + accO[nt][3] * accO[nt][3];
        }
        ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1); ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
        ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1); ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
        // Double-buffered by chunk parity: a warp can reach the next chunk's norm while a warp of
        // the other half still reads this one's (it cannot get two chunks ahead: this barrier).
        float* nrm = sNorm + (c & 1) * 4 * KC;
        if (t == 0) { nrm[(wp >> 2) * KC + mt * 16 + g] = ss0; nrm[(wp >> 2) * KC + mt * 16 + g + 8] = ss1; }
        // Only the four warps holding rows 16mt.. meet here (named barrier 1 + mt).
        asm volatile("bar.sync %0, 128;" ::"r"(1 + mt) : "memory");
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = mt * 16 + g + 8 * hh;
            if (row >= n) continue;
            const float inv = rsqrt_ftz((nrm[row] + nrm[KC + row] + nrm[2 * KC + row] + nrm[3 * KC + row]) * (1.0f / KD) + eps);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const int cl = oc + nt * 8 + 2 * t;
                const unsigned gg = gv[nt][hh];
                const float y0 = accO[nt][2 * hh] * inv * sW[cl] * sigmoid_ftz(lo_bf16(gg));
                const float y1 = accO[nt][2 * hh + 1] * inv * sW[cl + 1] * sigmoid_ftz(hi_bf16(gg));
                *reinterpret_cast<unsigned*>(&out[(trow + row) * D + h * KD + cl]) = pack_bf16(y0, y1);
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int row = sr * 16 + g + 8 * hh, cl = sc + nt * 8 + 2 * t;
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
