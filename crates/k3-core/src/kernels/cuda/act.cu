// act.cu: elementwise activations and dtype casts (CPU oracle: kernels/cpu/act.rs).
// sigmoid(x) = 1 / (1 + exp(-x)); silu(x) = x * sigmoid(x);
// SiTU-GLU (text-backbone 7.4): beta*tanh(g/beta)*sigmoid(g) * lin_beta*tanh(u/lin_beta).
// Grid-stride loops over `n` elements; f32 math whatever the storage type. In-place (y == x)
// is allowed: each element is read and written by one thread.

__device__ __forceinline__ float k3_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

template <typename T>
__device__ __forceinline__ void sigmoid_impl(const T* x, T* y, long long n) {
    GRID_STRIDE(i, n) st(y, i, k3_sigmoid(ld(x, i)));
}
template <typename T>
__device__ __forceinline__ void silu_impl(const T* x, T* y, long long n) {
    GRID_STRIDE(i, n) {
        float v = ld(x, i);
        st(y, i, v * k3_sigmoid(v));
    }
}
template <typename T>
__device__ __forceinline__ void situ_glu_impl(const T* g, const T* u, T* y, long long n, float beta, float lin_beta) {
    GRID_STRIDE(i, n) {
        float gv = ld(g, i), uv = ld(u, i);
        st(y, i, beta * tanhf(gv / beta) * k3_sigmoid(gv) * (lin_beta * tanhf(uv / lin_beta)));
    }
}

extern "C" __global__ void sigmoid_f32(const float* x, float* y, long long n) { sigmoid_impl(x, y, n); }
extern "C" __global__ void sigmoid_bf16(const bf16_t* x, bf16_t* y, long long n) { sigmoid_impl(x, y, n); }
extern "C" __global__ void silu_f32(const float* x, float* y, long long n) { silu_impl(x, y, n); }
extern "C" __global__ void silu_bf16(const bf16_t* x, bf16_t* y, long long n) { silu_impl(x, y, n); }
extern "C" __global__ void situ_glu_f32(const float* g, const float* u, float* y, long long n, float beta, float lin_beta) {
    situ_glu_impl(g, u, y, n, beta, lin_beta);
}
extern "C" __global__ void situ_glu_bf16(const bf16_t* g, const bf16_t* u, bf16_t* y, long long n, float beta, float lin_beta) {
    situ_glu_impl(g, u, y, n, beta, lin_beta);
}

extern "C" __global__ void cast_f32_bf16(const float* x, bf16_t* y, long long n) {
    GRID_STRIDE(i, n) y[i] = f32_to_bf16(x[i]);
}
extern "C" __global__ void cast_bf16_f32(const bf16_t* x, float* y, long long n) {
    GRID_STRIDE(i, n) y[i] = bf16_to_f32(x[i]);
}

// Output gate: x = x * sigmoid(g), in place (MLA's gated output, text-backbone §4).
extern "C" __global__ void sigmoid_mul_bf16(bf16_t* x, const bf16_t* g, long long n) {
    GRID_STRIDE(i, n) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * k3_sigmoid(bf16_to_f32(g[i])));
}
extern "C" __global__ void sigmoid_mul_f32(float* x, const float* g, long long n) {
    GRID_STRIDE(i, n) x[i] = x[i] * k3_sigmoid(g[i]);
}
// y += x (f32), e.g. the shared experts' output onto the routed one.
extern "C" __global__ void add_f32(float* y, const float* x, long long n) {
    GRID_STRIDE(i, n) y[i] += x[i];
}
