// copy.cu: row gathers, row scatters and strided copies the model needs between its GEMMs.
// gather_rows_*: out[i, :] = src[ids[i] - first, :] for i < n, zero where ids[i] - first is
// outside 0..rows (embedding lookup from a bf16 table into the f32 stream, or from one
// tensor-parallel rank's vocabulary rows; picking each sequence's last row before lm_head). ids are I32 and were checked
// on the host. copy_strided_bf16: rows of `width` elements from src (row stride `ss`) to dst
// (row stride `ds`), e.g. q_pe from q [N·nh, dn+dr] into the absorbed query [N·nh, r+dr].

// Grid (column blocks of 8·blockDim, rows): each thread moves 8 consecutive elements, its 8 loads
// issued together, so a decode step's single row is spread over several blocks.
template <typename TI, typename TO>
__device__ __forceinline__ void gather_impl(const TI* __restrict__ src, const int* __restrict__ ids, TO* __restrict__ out, int n, int h, int first, int rows) {
    const int j0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (j0 >= h) return;
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const int r = ids[i] - first;
        const bool mine = r >= 0 && r < rows;
        const long long s = (long long)(mine ? r : 0) * h + j0, o = (long long)i * h + j0;
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = (mine && j0 + u < h) ? ld(src, s + u) : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; u++) if (j0 + u < h) st(out, o + u, v[u]);
    }
}

extern "C" __global__ void gather_rows_bf16_f32(const bf16_t* src, const int* ids, float* out, int n, int h, int first, int rows) { gather_impl(src, ids, out, n, h, first, rows); }
extern "C" __global__ void gather_rows_bf16_bf16(const bf16_t* src, const int* ids, bf16_t* out, int n, int h, int first, int rows) { gather_impl(src, ids, out, n, h, first, rows); }
extern "C" __global__ void gather_rows_f32_f32(const float* src, const int* ids, float* out, int n, int h, int first, int rows) { gather_impl(src, ids, out, n, h, first, rows); }

// scatter_rows_u{16,32}: dst[idx[i], :] = src[i, :] for i < n, rows of `w` words copied bit for
// bit; a row whose idx[i] is outside 0..rows is skipped (a sequence a rollback leaves alone).
// Grid (column blocks, rows i). Restores KDA checkpoints into their pool slots from a device
// table, so that a rollback is capturable (k3-model cuda/verify.rs).
template <typename W>
__device__ __forceinline__ void scatter_impl(const W* __restrict__ src, const int* __restrict__ idx, W* __restrict__ dst, int n, long long w, int rows) {
    for (int i = blockIdx.y; i < n; i += gridDim.y) {
        const int r = idx[i];
        if (r < 0 || r >= rows) continue;
        const W* s = src + (long long)i * w;
        W* d = dst + (long long)r * w;
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < w; j += (long long)gridDim.x * blockDim.x) d[j] = s[j];
    }
}
extern "C" __global__ void scatter_rows_u32(const unsigned* src, const int* idx, unsigned* dst, int n, long long w, int rows) { scatter_impl(src, idx, dst, n, w, rows); }
extern "C" __global__ void scatter_rows_u16(const unsigned short* src, const int* idx, unsigned short* dst, int n, long long w, int rows) { scatter_impl(src, idx, dst, n, w, rows); }

// x[i] += delta (i32): global expert ids to this rank's local ids (others fall outside 0..E_local).
extern "C" __global__ void shift_i32(int* x, int delta, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) x[i] += delta;
}

extern "C" __global__ void copy_strided_bf16(const bf16_t* src, long long ss, bf16_t* dst, long long ds, int rows, int width) {
    long long total = (long long)rows * width;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        long long r = k / width, c = k % width;
        dst[r * ds + c] = src[r * ss + c];
    }
}

extern "C" __global__ void copy_strided_f32(const float* src, long long ss, float* dst, long long ds, int rows, int width) {
    long long total = (long long)rows * width;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        long long r = k / width, c = k % width;
        dst[r * ds + c] = src[r * ss + c];
    }
}

// unblock_*: dst[t, r·w + c] = src[r, t, c] — rank-major all-gathered blocks [S, T, w] back to
// rows [T, S·w] (the column blocks of the router logits, the latent, the vocabulary).
template <typename T>
__device__ __forceinline__ void unblock_impl(const T* __restrict__ src, T* __restrict__ dst, int s, int t, int w) {
    const long long total = (long long)s * t * w;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        const long long c = k % w, rest = k / w;
        const long long row = rest % t, r = rest / t;
        dst[(row * s + r) * w + c] = src[k];
    }
}
extern "C" __global__ void unblock_f32(const float* src, float* dst, int s, int t, int w) { unblock_impl(src, dst, s, t, w); }
extern "C" __global__ void unblock_bf16(const bf16_t* src, bf16_t* dst, int s, int t, int w) { unblock_impl(src, dst, s, t, w); }
