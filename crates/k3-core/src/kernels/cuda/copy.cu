// copy.cu: row gathers and strided copies the model needs between its GEMMs.
// gather_rows_*: out[i, :] = src[ids[i], :] for i < n (embedding lookup from a bf16 table into
// the f32 stream; picking each sequence's last row before lm_head). ids are I32 and were checked
// on the host. copy_strided_bf16: rows of `width` elements from src (row stride `ss`) to dst
// (row stride `ds`), e.g. q_pe from q [N·nh, dn+dr] into the absorbed query [N·nh, r+dr].

template <typename TI, typename TO>
__device__ __forceinline__ void gather_impl(const TI* __restrict__ src, const int* __restrict__ ids, TO* __restrict__ out, int n, int h) {
    for (int i = blockIdx.x; i < n; i += gridDim.x) {
        const long long s = (long long)ids[i] * h, o = (long long)i * h;
        for (int j = threadIdx.x; j < h; j += blockDim.x) st(out, o + j, ld(src, s + j));
    }
}

extern "C" __global__ void gather_rows_bf16_f32(const bf16_t* src, const int* ids, float* out, int n, int h) { gather_impl(src, ids, out, n, h); }
extern "C" __global__ void gather_rows_bf16_bf16(const bf16_t* src, const int* ids, bf16_t* out, int n, int h) { gather_impl(src, ids, out, n, h); }
extern "C" __global__ void gather_rows_f32_f32(const float* src, const int* ids, float* out, int n, int h) { gather_impl(src, ids, out, n, h); }

extern "C" __global__ void copy_strided_bf16(const bf16_t* src, long long ss, bf16_t* dst, long long ds, int rows, int width) {
    long long total = (long long)rows * width;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (long long)gridDim.x * blockDim.x) {
        long long r = k / width, c = k % width;
        dst[r * ds + c] = src[r * ss + c];
    }
}
