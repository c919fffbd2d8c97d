// softmax.cu: numerically stable softmax over the last dimension, one thread block per row
// (CPU oracle: kernels/cpu/act.rs `softmax_inplace`). A row that is all -inf becomes all zeros.
// Three passes over the row (max, sum of exp, write); in-place (y == x) is allowed.

template <typename T>
__device__ __forceinline__ void softmax_row(const T* x, T* y, int d) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * d;
    const T* xr = x + base;
    T* yr = y + base;
    float m = -K3_INF;
    for (int i = threadIdx.x; i < d; i += blockDim.x) m = fmaxf(m, ld(xr, i));
    m = block_max(m, scratch);
    if (m == -K3_INF) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) st(yr, i, 0.0f);
        return;
    }
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += expf(ld(xr, i) - m);
    s = block_sum(s, scratch);
    const float inv = 1.0f / s;
    for (int i = threadIdx.x; i < d; i += blockDim.x) st(yr, i, expf(ld(xr, i) - m) * inv);
}

extern "C" __global__ void softmax_f32(const float* x, float* y, int d) { softmax_row(x, y, d); }
extern "C" __global__ void softmax_bf16(const bf16_t* x, bf16_t* y, int d) { softmax_row(x, y, d); }
