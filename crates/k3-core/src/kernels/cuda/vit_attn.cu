// vit_attn.cu: fused (flash) attention of the MoonViT3d tower (around-backbone §3.4; launcher
// cuda/vision.rs `vit_flash_attention`, oracle the f64 reference of tests/cuda_vision.rs and the
// cuBLAS path `vit_attention_sliced`). Bidirectional (no mask) attention of every row over the
// rows of its own sample, block-diagonal over the samples packed in one call.
//
// Shapes: L packed rows, nh heads of hd = Dq/nh (a multiple of 8, at most 128); qkv BF16
// [L, 3*Dq] after RoPE (Q | K | V, head h at columns h*hd of each third); out [L, Dq] (BF16 or
// F32), head h at columns h*hd. `tiles` I32 [T, 3]: per query tile (first row of its sample, one
// past the sample's last row, first query row of the tile), all rows absolute; grid (T, nh).
//
// FA2 on tensor cores: mma.sync m16n8k16 bf16 with f32 accumulation. A block holds BM = 16*WM*NW
// query rows of one head (NW warps, each owning WM m16 tiles of rows); keys and values stream in
// tiles of BN = 64 rows, double-buffered with cp.async. The head dim is padded to HD (16, 32, 64
// or 128) with zero-filled columns, which add nothing to Q.K and are never stored. S = Q.K^T
// stays in registers; the online softmax is in base 2 with the scale hd^-1/2 * log2(e) folded
// into one FMA per score, MUFU ex2, and lazy rescaling (below); P is rounded to bf16 straight
// into the A fragments of P.V (no shared-memory round trip); the row sums add the f32
// probabilities. Q is either loaded into registers once (QREG) or re-read from shared memory per
// key tile (when its fragments would not fit beside a 32-row accumulator). Shared rows are padded
// by 16 bytes, so ldmatrix and the cp.async stores are free of bank conflicts and every fragment
// address is a per-lane base plus an immediate. Only the last key tile of a sample is masked.
// Query tiles are ordered by the host (longest samples first); blockIdx.x walks the tiles of one
// head, so neighbouring blocks share that head's keys in L2.

// Keys per tile (the launcher's FLASH_KEYS, which sizes the shared memory).
#define VA_KEYS 64
// Lazy rescaling threshold (base-2 exponent): probabilities stay below 2^8 before normalisation.
#define VA_LAZY 8.0f

// Shared tiles hold rows of HD bf16 padded by 8 (16 bytes): the 8 rows one ldmatrix phase reads
// (and the 8 chunks one cp.async phase writes) then fall in 8 distinct 16-byte bank groups.
template <int HD>
__device__ __forceinline__ int va_off(int row, int chunk) {
    return row * (HD + 8) + (chunk << 3);
}
template <int HD>
__host__ __device__ constexpr int va_rows_elems(int rows) {
    return rows * (HD + 8);
}
// Byte offset of (row, 16-byte chunk) in a shared tile, as va_off.
template <int HD>
__device__ __forceinline__ unsigned va_boff(int row, int chunk) { return (unsigned)va_off<HD>(row, chunk) * 2u; }
__device__ __forceinline__ void va_ldsm_x4(unsigned* r, unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void va_ldsm_x4_t(unsigned* r, unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// cp_async16 to a shared-window address.
__device__ __forceinline__ void cp_async16s(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void va_store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
__device__ __forceinline__ void va_store2(bf16_t* p, float a, float b) { *reinterpret_cast<unsigned*>(p) = pack_bf16(a, b); }

template <int HD, int WM, int NW, int BN, bool QREG, typename TO>
__device__ __forceinline__ void vit_flash_impl(const bf16_t* __restrict__ qkv, const int* __restrict__ tiles, int dq, int hd, float scale_log2,
                                               TO* __restrict__ out) {
    constexpr int BM = 16 * WM * NW, NT = 32 * NW, CH = HD / 8, KS = HD / 16, DT = HD / 8;
    extern __shared__ __align__(128) unsigned char smem_va[];
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem_va);  // [BM][HD]
    bf16_t* ks = qs + va_rows_elems<HD>(BM);           // [2][BN][HD]
    bf16_t* vs = ks + 2 * va_rows_elems<HD>(BN);    // [2][BN][HD]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int start = tiles[3 * blockIdx.x], end = tiles[3 * blockIdx.x + 1], q0 = tiles[3 * blockIdx.x + 2];
    const int h = blockIdx.y, hch = hd >> 3;
    const long long w3 = 3LL * dq;
    const bf16_t* qb = qkv + (long long)h * hd;
    const bf16_t* kb = qb + dq;
    const bf16_t* vb = qb + 2 * dq;

    // Copies of 16-byte chunks: thread tid moves chunk tid % CH of rows tid / CH + i * RPI. Rows past
    // the sample and columns past hd are zero-filled.
    constexpr int RPI = NT / CH;
    static_assert(NT % CH == 0 && BM % RPI == 0 && BN % RPI == 0, "tile rows must split evenly over the threads");
    const int lr = tid / CH, lc = tid % CH;
    const bool cok = lc < hch;
    const unsigned dst0 = va_boff<HD>(lr, lc);
#pragma unroll
    for (int i = 0; i < BM / RPI; i++) {
        const int row = q0 + lr + i * RPI;
        const bool ok = cok && row < end;
        cp_async16s(smem_u32(qs) + dst0 + i * RPI * (HD + 8) * 2, ok ? (const void*)(qb + row * w3 + lc * 8) : (const void*)qkv, ok ? 16 : 0);
    }
    auto issue = [&](int buf, int k0) {
        const unsigned kt = smem_u32(ks + buf * va_rows_elems<HD>(BN)) + dst0, vt = smem_u32(vs + buf * va_rows_elems<HD>(BN)) + dst0;
        const long long at0 = (long long)(k0 + lr) * w3 + lc * 8;
#pragma unroll
        for (int i = 0; i < BN / RPI; i++) {
            const bool ok = cok && k0 + lr + i * RPI < end;
            const long long at = at0 + (long long)i * RPI * w3;
            cp_async16s(kt + i * RPI * (HD + 8) * 2, ok ? (const void*)(kb + at) : (const void*)qkv, ok ? 16 : 0);
            cp_async16s(vt + i * RPI * (HD + 8) * 2, ok ? (const void*)(vb + at) : (const void*)qkv, ok ? 16 : 0);
        }
        cp_async_commit();
    };
    const int nkt = (end - start + BN - 1) / BN;
    issue(0, start);  // the Q copies join this first group

    unsigned qf[QREG ? WM : 1][QREG ? KS : 1][4];
    float o[WM][DT][4];
    float m[WM][2], l[WM][2];
#pragma unroll
    for (int mi = 0; mi < WM; mi++) {
#pragma unroll
        for (int j = 0; j < DT; j++) o[mi][j][0] = o[mi][j][1] = o[mi][j][2] = o[mi][j][3] = 0.0f;
        m[mi][0] = m[mi][1] = -K3_INF;
        l[mi][0] = l[mi][1] = 0.0f;
    }
    // This lane's ldmatrix addresses (byte offsets in the shared window): the A fragments of Q
    // (row arow, chunk acol of the warp's first 16 rows), the B fragments of K (keys (lane & 7) +
    // 8 * (lane >> 4), chunk (lane >> 3) & 1) and the transposed B fragments of V (as Q's).
    constexpr unsigned RB = (HD + 8) * 2;  // bytes per shared row
    const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4);
    const unsigned qa = smem_u32(qs) + va_boff<HD>(16 * warp * WM + arow, acol);
    const unsigned ka = va_boff<HD>((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1), vla = va_boff<HD>(arow, acol);

    for (int it = 0; it < nkt; it++) {
        const int buf = it & 1, k0 = start + it * BN;
        if (it + 1 < nkt) {
            issue(buf ^ 1, k0 + BN);
            cp_async_wait_1();
        } else {
            cp_async_wait_0();
        }
        __syncthreads();
        if constexpr (QREG) {
            if (it == 0) {
#pragma unroll
                for (int mi = 0; mi < WM; mi++)
#pragma unroll
                    for (int kk = 0; kk < KS; kk++) va_ldsm_x4(qf[mi][kk], qa + mi * 16 * RB + kk * 32);
            }
        }
        const unsigned kt = smem_u32(ks + buf * va_rows_elems<HD>(BN)) + ka, vt = smem_u32(vs + buf * va_rows_elems<HD>(BN)) + vla;

        // S [WM x 16 rows, 64 keys] = Q K^T.
        float s[WM][BN / 8][4];
#pragma unroll
        for (int mi = 0; mi < WM; mi++)
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            unsigned a[WM][4];
#pragma unroll
            for (int mi = 0; mi < WM; mi++) {
                if constexpr (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; e++) a[mi][e] = qf[mi][kk][e];
                } else {
                    va_ldsm_x4(a[mi], qa + mi * 16 * RB + kk * 32);
                }
            }
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt += 2) {
                // Keys nt*8..+15, dims kk*16..+15: b[0], b[1] for key tile nt; b[2], b[3] for nt+1.
                unsigned b[4];
                va_ldsm_x4(b, kt + nt * 8 * RB + kk * 32);
#pragma unroll
                for (int mi = 0; mi < WM; mi++) {
                    mma_bf16(s[mi][nt], a[mi], b[0], b[1]);
                    mma_bf16(s[mi][nt + 1], a[mi], b[2], b[3]);
                }
            }
        }
        // The last tile of a sample: keys past its end do not exist.
        const int kvalid = end - k0;
        if (kvalid < BN) {
#pragma unroll
            for (int mi = 0; mi < WM; mi++)
#pragma unroll
                for (int nt = 0; nt < BN / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (nt * 8 + 2 * t4 + (e & 1) >= kvalid) s[mi][nt][e] = -K3_INF;
        }
        // Online softmax in base 2; m is the running max times scale_log2. Lazy rescaling: a row
        // keeps its max until the tile's exceeds it by more than VA_LAZY (so P <= 2^VA_LAZY), and
        // the warp rescales O and l only when one of its rows moved (warp-uniform vote).
        unsigned pa[WM][BN / 16][4];
#pragma unroll
        for (int mi = 0; mi < WM; mi++) {
            float mx[2] = {-K3_INF, -K3_INF};
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) {
                mx[0] = fmaxf(mx[0], fmaxf(s[mi][nt][0], s[mi][nt][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[mi][nt][2], s[mi][nt][3]));
            }
#pragma unroll
            for (int r2 = 0; r2 < 2; r2++) {
                mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 1));
                mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 2));
                mx[r2] *= scale_log2;  // finite: every tile holds at least one key of the sample
            }
            if (__any_sync(0xffffffffu, mx[0] > m[mi][0] + VA_LAZY || mx[1] > m[mi][1] + VA_LAZY)) {
#pragma unroll
                for (int r2 = 0; r2 < 2; r2++) {
                    const float mn = fmaxf(m[mi][r2], mx[r2]);
                    const float alpha = ex2_ftz(m[mi][r2] - mn);  // 0 on the first tile (m = -inf)
                    m[mi][r2] = mn;
                    l[mi][r2] *= alpha;
#pragma unroll
                    for (int j = 0; j < DT; j++) {
                        o[mi][j][2 * r2] *= alpha;
                        o[mi][j][2 * r2 + 1] *= alpha;
                    }
                }
            }
            const float n0 = -m[mi][0], n1 = -m[mi][1];
#pragma unroll
            for (int nt = 0; nt < BN / 8; nt++) {
                const float p0 = ex2_ftz(fmaf(s[mi][nt][0], scale_log2, n0)), p1 = ex2_ftz(fmaf(s[mi][nt][1], scale_log2, n0));
                const float p2 = ex2_ftz(fmaf(s[mi][nt][2], scale_log2, n1)), p3 = ex2_ftz(fmaf(s[mi][nt][3], scale_log2, n1));
                l[mi][0] += p0 + p1;
                l[mi][1] += p2 + p3;
                pa[mi][nt / 2][(nt & 1) * 2] = pack_bf16(p0, p1);
                pa[mi][nt / 2][(nt & 1) * 2 + 1] = pack_bf16(p2, p3);
            }
        }
        // O [WM x 16 rows, HD] += P V.
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
            for (int n2 = 0; n2 < HD / 16; n2++) {
                unsigned b[4];
                va_ldsm_x4_t(b, vt + kk * 16 * RB + n2 * 32);
#pragma unroll
                for (int mi = 0; mi < WM; mi++) {
                    mma_bf16(o[mi][2 * n2], pa[mi][kk], b[0], b[1]);
                    mma_bf16(o[mi][2 * n2 + 1], pa[mi][kk], b[2], b[3]);
                }
            }
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < WM; mi++)
#pragma unroll
        for (int r2 = 0; r2 < 2; r2++) {
            float lt = l[mi][r2];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            const float inv = 1.0f / lt;
            const int row = q0 + 16 * (warp * WM + mi) + g + 8 * r2;
            if (row < end) {
                TO* dst = out + (long long)row * dq + (long long)h * hd + 2 * t4;
#pragma unroll
                for (int j = 0; j < DT; j++)
                    if (8 * j + 2 * t4 < hd) va_store2(dst + 8 * j, o[mi][j][2 * r2] * inv, o[mi][j][2 * r2 + 1] * inv);
            }
        }
}

// Kernel NAME: head dims up to HD, 16*WM*NW query rows per block of NW warps, at least MINB
// blocks per SM (the register cap), Q in registers or not, TO out.
#define VIT_FLASH(NAME, HD, WM, NW, QREG, MINB, TO)                                            \
    extern "C" __global__ void __launch_bounds__(32 * NW, MINB)                                \
        NAME(const bf16_t* qkv, const int* tiles, int dq, int hd, float scale_log2, TO* out) { \
        vit_flash_impl<HD, WM, NW, VA_KEYS, QREG, TO>(qkv, tiles, dq, hd, scale_log2, out);     \
    }

// Head dim 128 (the released tower): 128 rows of 4 warps x 32 rows (Q re-read from shared
// memory), the default; 64 rows of 4 warps x 16 and 128 rows of 8 warps x 16 (Q in registers).
VIT_FLASH(vit_flash_h128_r128w4_bf16, 128, 2, 4, false, 2, bf16_t)
VIT_FLASH(vit_flash_h128_r128w4_f32, 128, 2, 4, false, 2, float)
VIT_FLASH(vit_flash_h128_r64w4_bf16, 128, 1, 4, true, 2, bf16_t)
VIT_FLASH(vit_flash_h128_r128w8_bf16, 128, 1, 8, true, 1, bf16_t)
// Narrower heads (padded up to the next HD): 64 rows of 4 warps x 16, Q in registers.
VIT_FLASH(vit_flash_h64_r64w4_bf16, 64, 1, 4, true, 3, bf16_t)
VIT_FLASH(vit_flash_h64_r64w4_f32, 64, 1, 4, true, 3, float)
VIT_FLASH(vit_flash_h32_r64w4_bf16, 32, 1, 4, true, 4, bf16_t)
VIT_FLASH(vit_flash_h32_r64w4_f32, 32, 1, 4, true, 4, float)
VIT_FLASH(vit_flash_h16_r64w4_bf16, 16, 1, 4, true, 4, bf16_t)
VIT_FLASH(vit_flash_h16_r64w4_f32, 16, 1, 4, true, 4, float)
