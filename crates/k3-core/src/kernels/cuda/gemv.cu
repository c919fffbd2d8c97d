// gemv.cu: y = x · Wᵀ for a few rows of x (decode), BF16 weights streamed once at full HBM
// bandwidth. Several weights that share the input (q/k/v/gate projections, router + latent
// down-projection + shared experts) run as one launch: each is a "segment" with its own weight
// and output pointer, laid end to end along the output-row axis. Oracle: kernels/cpu/matmul.rs
// (through cuBLAS's result in tests/cuda_gemv.rs and the CPU matmul).
//
// x BF16 [M, K] (M = 1..8, row stride K); segment s: W_s BF16 [N_s, K] row-major, out_s [M, N_s]
// (F32 or BF16). K % 8 == 0 and every pointer 16-byte aligned (the launcher checks).
//
// Mapping: one warp computes GEMV_R consecutive output rows of one segment; lane l reads the
// 16-byte vectors l, l+32, ... of each of those weight rows (GEMV_U vectors per row in flight,
// loaded with an L1 no-allocate streaming hint), and each x vector it loads (L1-cached, shared
// by every warp) is used for all GEMV_R rows. f32 accumulation, warp-shuffle reduction.

#define GEMV_MAX_SEGS 8
#define GEMV_R 2
#define GEMV_U 4

struct GemvSegs {
    unsigned long long w[GEMV_MAX_SEGS];
    unsigned long long out[GEMV_MAX_SEGS];
    int pad_end[GEMV_MAX_SEGS];  // cumulative output rows through segment s, each rounded up to GEMV_R
    int rows[GEMV_MAX_SEGS];     // segment s's true row count N_s
    int out_f32[GEMV_MAX_SEGS];  // 1: F32 output, 0: BF16
    int nseg;
};

__device__ __forceinline__ uint4 ld_stream(const bf16_t* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// acc += dot(w, x) over one 16-byte vector pair (8 bf16 each).
__device__ __forceinline__ float dot8(uint4 w, uint4 x, float acc) {
    unsigned int a[4] = {w.x, w.y, w.z, w.w}, b[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc = fmaf(__uint_as_float(a[i] << 16), __uint_as_float(b[i] << 16), acc);
        acc = fmaf(__uint_as_float(a[i] & 0xffff0000u), __uint_as_float(b[i] & 0xffff0000u), acc);
    }
    return acc;
}

template <int M>
__device__ __forceinline__ void gemv_rows(const bf16_t* __restrict__ x, int K, const GemvSegs& s) {
    const int lane = threadIdx.x & 31;
    const int pair = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int row = pair * GEMV_R;  // first (padded) output row of this warp
    // This warp's segment, by unrolled compares so the table stays in registers.
    int seg = 0;
#pragma unroll
    for (int j = 0; j < GEMV_MAX_SEGS - 1; j++)
        if (j + 1 < s.nseg && row >= s.pad_end[j]) seg = j + 1;
    int start = 0, seg_rows = 0, f32out = 0, total = 0;
    unsigned long long wp = 0, op = 0;
#pragma unroll
    for (int j = 0; j < GEMV_MAX_SEGS; j++)
        if (j == seg) {
            start = j ? s.pad_end[j - 1] : 0;
            seg_rows = s.rows[j];
            wp = s.w[j]; op = s.out[j]; f32out = s.out_f32[j];
        }
#pragma unroll
    for (int j = 0; j < GEMV_MAX_SEGS; j++)
        if (j == s.nseg - 1) total = s.pad_end[j];
    const int r0 = row - start;
    if (row >= total || r0 >= seg_rows) return;
    const bf16_t* w = reinterpret_cast<const bf16_t*>(wp);
    const int nvec = K >> 3;
    float acc[GEMV_R][M];
#pragma unroll
    for (int r = 0; r < GEMV_R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = 0.0f;
    const bf16_t* wr[GEMV_R];
    bool valid[GEMV_R];
#pragma unroll
    for (int r = 0; r < GEMV_R; r++) {
        valid[r] = r0 + r < seg_rows;
        // An invalid row re-reads row r0 (always valid) and is never stored.
        wr[r] = w + (long long)(valid[r] ? r0 + r : r0) * K;
    }
    int i = lane;
    for (; i + (GEMV_U - 1) * 32 < nvec; i += GEMV_U * 32) {
        uint4 wv[GEMV_R][GEMV_U];
#pragma unroll
        for (int r = 0; r < GEMV_R; r++)
#pragma unroll
            for (int u = 0; u < GEMV_U; u++) wv[r][u] = ld_stream(wr[r] + (long long)(i + u * 32) * 8);
#pragma unroll
        for (int u = 0; u < GEMV_U; u++)
#pragma unroll
            for (int m = 0; m < M; m++) {
                uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (long long)m * K) + i + u * 32);
#pragma unroll
                for (int r = 0; r < GEMV_R; r++) acc[r][m] = dot8(wv[r][u], xv, acc[r][m]);
            }
    }
    for (; i < nvec; i += 32) {
        uint4 wv[GEMV_R];
#pragma unroll
        for (int r = 0; r < GEMV_R; r++) wv[r] = ld_stream(wr[r] + (long long)i * 8);
#pragma unroll
        for (int m = 0; m < M; m++) {
            uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (long long)m * K) + i);
#pragma unroll
            for (int r = 0; r < GEMV_R; r++) acc[r][m] = dot8(wv[r], xv, acc[r][m]);
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_R; r++)
#pragma unroll
        for (int m = 0; m < M; m++) acc[r][m] = warp_sum(acc[r][m]);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < GEMV_R; r++) {
            if (!valid[r]) continue;
#pragma unroll
            for (int m = 0; m < M; m++) {
                long long o = (long long)m * seg_rows + r0 + r;
                if (f32out) reinterpret_cast<float*>(op)[o] = acc[r][m];
                else reinterpret_cast<bf16_t*>(op)[o] = f32_to_bf16(acc[r][m]);
            }
        }
    }
}

#define GEMV_KERNEL(M)                                                                         \
    extern "C" __global__ void __launch_bounds__(256) gemv_m##M(const bf16_t* __restrict__ x, \
                                                                int K, const GemvSegs s) {     \
        gemv_rows<M>(x, K, s);                                                                 \
    }
GEMV_KERNEL(1)
GEMV_KERNEL(2)
GEMV_KERNEL(3)
GEMV_KERNEL(4)
GEMV_KERNEL(5)
GEMV_KERNEL(6)
GEMV_KERNEL(7)
GEMV_KERNEL(8)
