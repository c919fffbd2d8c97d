// mla_prefill.cu: causal attention of a fresh prefill in MLA's explicit (unabsorbed) form
// (text-backbone §4; CPU oracle: k3-model layers/mla.rs `attend`, explicit branch). For K3's
// head dims: qk = k_nope 128 | k_pe 64 (192), v 128. Shapes: N packed rows, nh heads;
// q BF16 [N, nh, 192] (q_nope | q_pe, as q_b_proj writes it); kv BF16 [N, nh, 256] (k_nope | v,
// kv_b_proj of the normed latent); k_pe (64 BF16, shared by the heads) read from the rows the
// step just appended to the paged latent cache (row_bytes per token, k_pe at byte pe_off: BF16
// or fp8_ds_mla rows); row_seq / row_pos I32 [N]; out BF16 [N, nh, 128].
//
// Fresh prefill: each sequence's rows are contiguous and at positions 0, 1, ...; key j (a
// packed row) is visible to row i when row_seq[j] == row_seq[i] and row_pos[j] <= row_pos[i].
// Explicit costs (192 + 128) MACs per (row, key, head) where the absorbed form costs 576 + 512.
//
// Flash attention on tensor cores (mma.sync m16n8k16 bf16, f32 accumulate): block (64 query
// rows, one head), 4 warps of 16 rows; 64-key tiles of K and V double-buffered with cp.async;
// Q fragments stay in registers; S, the online softmax (base 2, MUFU ex2) and P stay in registers, P
// feeding the P·V product as A fragments. Heaviest blocks (the last rows) are launched first.

#define MP_Q 64
#define MP_K 64
#define MP_DN 128
#define MP_DK 192
#define MP_DV 128
#define MP_THREADS 128
#define MP_QS (MP_DK + 8)
#define MP_VS (MP_DV + 8)

extern "C" __global__ void __launch_bounds__(MP_THREADS) mla_prefill_attend(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kv, const unsigned char* __restrict__ cache, int row_bytes, int pe_off,
    const int* __restrict__ block_table, int max_pages, const int* __restrict__ row_seq, const int* __restrict__ row_pos, int n, int nh,
    float scale_log2, bf16_t* __restrict__ out) {
    extern __shared__ __align__(16) unsigned char smem_mp[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem_mp);  // [64][QS]
    bf16_t* ks = qs + MP_Q * MP_QS;                    // [2][64][QS]
    bf16_t* vs = ks + 2 * MP_K * MP_QS;                // [2][64][VS]
    int* kseq = reinterpret_cast<int*>(vs + 2 * MP_K * MP_VS);  // [2][64]
    int* kpos = kseq + 2 * MP_K;                                // [2][64]

    const int h = blockIdx.y, i0 = (gridDim.x - 1 - blockIdx.x) * MP_Q;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int kstart = i0 - row_pos[i0], kend = min(n, i0 + MP_Q);
    const long long kv_ld = (long long)nh * 2 * MP_DN;

    for (int v = tid; v < MP_Q * (MP_DK / 8); v += MP_THREADS) {
        const int rr = v / (MP_DK / 8), c = (v % (MP_DK / 8)) * 8, row = i0 + rr;
        cp_async16(qs + rr * MP_QS + c, row < n ? (const void*)(q + ((long long)row * nh + h) * MP_DK + c) : (const void*)q, row < n ? 16 : 0);
    }
    auto issue = [&](int buf, int t0) {
        bf16_t* kb = ks + buf * MP_K * MP_QS;
        bf16_t* vb = vs + buf * MP_K * MP_VS;
        // Per key: 16 chunks of k_nope, 16 of v, 8 of k_pe (16 bytes each).
        for (int v = tid; v < MP_K * 40; v += MP_THREADS) {
            const int t = v / 40, c = v % 40, j = t0 + t;
            const bool ok = j < kend;
            if (c < 16) {
                cp_async16(kb + t * MP_QS + c * 8, ok ? (const void*)(kv + j * kv_ld + (long long)h * 2 * MP_DN + c * 8) : (const void*)kv, ok ? 16 : 0);
            } else if (c < 32) {
                cp_async16(vb + t * MP_VS + (c - 16) * 8, ok ? (const void*)(kv + j * kv_ld + (long long)h * 2 * MP_DN + MP_DN + (c - 16) * 8) : (const void*)kv,
                           ok ? 16 : 0);
            } else {
                const void* src = cache;
                if (ok) {
                    const int ps = row_pos[j], page = block_table[(long long)row_seq[j] * max_pages + ps / 64];
                    src = cache + ((long long)page * 64 + ps % 64) * row_bytes + pe_off + (c - 32) * 16;
                }
                cp_async16(kb + t * MP_QS + MP_DN + (c - 32) * 8, src, ok ? 16 : 0);
            }
        }
        if (tid < MP_K) {
            const int j = t0 + tid;
            kseq[buf * MP_K + tid] = j < kend ? row_seq[j] : -1;
            kpos[buf * MP_K + tid] = j < kend ? row_pos[j] : 0x7fffffff;
        }
        cp_async_commit();
    };

    // This thread's two rows (g and g + 8 of its warp's 16).
    int rseq[2], rpos[2];
#pragma unroll
    for (int r2 = 0; r2 < 2; r2++) {
        const int row = i0 + 16 * warp + g + 8 * r2;
        rseq[r2] = row < n ? row_seq[row] : -2;
        rpos[r2] = row < n ? row_pos[row] : -1;
    }
    const int ntiles = (kend - kstart + MP_K - 1) / MP_K;
    issue(0, kstart);  // the Q copies join this first group

    unsigned qf[MP_DK / 16][4];
    float o[MP_DV / 8][4];
#pragma unroll
    for (int j = 0; j < MP_DV / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-K3_INF, -K3_INF}, l[2] = {0.0f, 0.0f};

    for (int it = 0; it < ntiles; it++) {
        const int buf = it & 1, t0 = kstart + it * MP_K;
        if (it + 1 < ntiles) {
            issue(buf ^ 1, t0 + MP_K);
            cp_async_wait_1();
        } else {
            cp_async_wait_0();
        }
        __syncthreads();
        if (it == 0) {
#pragma unroll
            for (int kk = 0; kk < MP_DK / 16; kk++)
                ldsm_x4(qf[kk], qs + (16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8) * MP_QS + kk * 16 + (lane >> 4) * 8);
        }
        const bf16_t* kb = ks + buf * MP_K * MP_QS;
        const bf16_t* vb = vs + buf * MP_K * MP_VS;
        // S [16 rows, 64 keys] = Q K^T.
        float s[MP_K / 8][4];
#pragma unroll
        for (int nt = 0; nt < MP_K / 8; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < MP_DK / 16; kk += 2) {
                unsigned b[4];
                ldsm_x4(b, kb + (nt * 8 + (lane & 7)) * MP_QS + kk * 16 + (lane >> 3) * 8);
                mma_bf16(s[nt], qf[kk], b[0], b[1]);
                mma_bf16(s[nt], qf[kk + 1], b[2], b[3]);
            }
        }
        // Mask, online softmax (base 2).
        const int* sq = kseq + buf * MP_K;
        const int* sp = kpos + buf * MP_K;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int nt = 0; nt < MP_K / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = nt * 8 + 2 * t4 + (e & 1), r2 = e >> 1;
                const bool ok = sq[key] == rseq[r2] && sp[key] <= rpos[r2];
                s[nt][e] = ok ? s[nt][e] * scale_log2 : -K3_INF;
                mx[r2] = fmaxf(mx[r2], s[nt][e]);
            }
        float mu[2];
#pragma unroll
        for (int r2 = 0; r2 < 2; r2++) {
            mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 1));
            mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 2));
            mu[r2] = mx[r2] == -K3_INF ? 0.0f : mx[r2];
            const float alpha = ex2_ftz(m[r2] - mu[r2]);
            m[r2] = mx[r2];
            l[r2] *= alpha;
#pragma unroll
            for (int j = 0; j < MP_DV / 8; j++) {
                o[j][2 * r2] *= alpha;
                o[j][2 * r2 + 1] *= alpha;
            }
        }
        unsigned pa[MP_K / 16][4];
#pragma unroll
        for (int nt = 0; nt < MP_K / 8; nt++) {
            const unsigned p01 = pack_bf16(ex2_ftz(s[nt][0] - mu[0]), ex2_ftz(s[nt][1] - mu[0]));
            const unsigned p23 = pack_bf16(ex2_ftz(s[nt][2] - mu[1]), ex2_ftz(s[nt][3] - mu[1]));
            l[0] += lo_bf16(p01) + hi_bf16(p01);
            l[1] += lo_bf16(p23) + hi_bf16(p23);
            pa[nt / 2][(nt & 1) * 2] = p01;
            pa[nt / 2][(nt & 1) * 2 + 1] = p23;
        }
        // O [16 rows, 128] += P V.
#pragma unroll
        for (int kk = 0; kk < MP_K / 16; kk++)
#pragma unroll
            for (int n2 = 0; n2 < MP_DV / 16; n2++) {
                unsigned b[4];
                ldsm_x4_t(b, vb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * MP_VS + n2 * 16 + (lane >> 4) * 8);
                mma_bf16(o[2 * n2], pa[kk], b[0], b[1]);
                mma_bf16(o[2 * n2 + 1], pa[kk], b[2], b[3]);
            }
        __syncthreads();
    }
#pragma unroll
    for (int r2 = 0; r2 < 2; r2++) {
        float lt = l[r2];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const float inv = lt > 0.0f ? 1.0f / lt : 0.0f;
        const int row = i0 + 16 * warp + g + 8 * r2;
        if (row < n) {
            bf16_t* dst = out + ((long long)row * nh + h) * MP_DV + 2 * t4;
#pragma unroll
            for (int j = 0; j < MP_DV / 8; j++) *reinterpret_cast<unsigned*>(dst + 8 * j) = pack_bf16(o[j][2 * r2] * inv, o[j][2 * r2 + 1] * inv);
        }
    }
}
