// norm.cu: RMSNorm over the last dimension, one thread block per row (CPU oracle:
// kernels/cpu/norm.rs `rms_norm`). out = x / sqrt(mean(x^2) + eps) * w, f32 statistics.
// `_v` kernels use 16-byte accesses; the host picks them when d is a multiple of the vector
// width and every pointer is 16-byte aligned.

template <typename T, int VEC>
__device__ __forceinline__ void rms_norm_row(const T* __restrict__ x, const T* __restrict__ w,
                                             T* __restrict__ out, int d, float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * d;
    const T* xr = x + base;
    T* yr = out + base;
    float ss = 0.0f;
    if constexpr (VEC > 1) {
        for (int i = threadIdx.x * VEC; i < d; i += blockDim.x * VEC) {
            float f[VEC];
            ld_vec(xr + i, f);
#pragma unroll
            for (int j = 0; j < VEC; j++) ss += f[j] * f[j];
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float v = ld(xr, i);
            ss += v * v;
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    if constexpr (VEC > 1) {
        for (int i = threadIdx.x * VEC; i < d; i += blockDim.x * VEC) {
            float f[VEC], g[VEC];
            ld_vec(xr + i, f);
            ld_vec(w + i, g);
#pragma unroll
            for (int j = 0; j < VEC; j++) f[j] = f[j] * inv * g[j];
            st_vec(yr + i, f);
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) st(yr, i, ld(xr, i) * inv * ld(w, i));
    }
}

extern "C" __global__ void rms_norm_f32(const float* x, const float* w, float* out, int d, float eps) {
    rms_norm_row<float, 1>(x, w, out, d, eps);
}
extern "C" __global__ void rms_norm_f32_v(const float* x, const float* w, float* out, int d, float eps) {
    rms_norm_row<float, 4>(x, w, out, d, eps);
}
extern "C" __global__ void rms_norm_bf16(const bf16_t* x, const bf16_t* w, bf16_t* out, int d, float eps) {
    rms_norm_row<bf16_t, 1>(x, w, out, d, eps);
}
extern "C" __global__ void rms_norm_bf16_v(const bf16_t* x, const bf16_t* w, bf16_t* out, int d, float eps) {
    rms_norm_row<bf16_t, 8>(x, w, out, d, eps);
}

// RMSNorm with an f32 weight and any storage of input and output (the model's norms keep their
// weights in f32; activations are f32 or bf16): out = x / sqrt(mean(x^2) + eps) * w.
// One block per row of width d; rows are `ld_in` / `ld_out` elements apart, so a norm can
// cover the first d columns of a wider row (MLA's kv latent) and leave the rest alone.
template <typename TI, typename TO>
__device__ __forceinline__ void rms_norm_w_row(const TI* __restrict__ x, const float* __restrict__ w, TO* __restrict__ out,
                                               int d, int ld_in, int ld_out, float eps) {
    __shared__ float scratch[32];
    const TI* xr = x + (long long)blockIdx.x * ld_in;
    TO* yr = out + (long long)blockIdx.x * ld_out;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = ld(xr, i);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) st(yr, i, ld(xr, i) * inv * w[i]);
}

extern "C" __global__ void rms_norm_w_f32_f32(const float* x, const float* w, float* out, int d, int li, int lo, float eps) {
    rms_norm_w_row(x, w, out, d, li, lo, eps);
}
extern "C" __global__ void rms_norm_w_f32_bf16(const float* x, const float* w, bf16_t* out, int d, int li, int lo, float eps) {
    rms_norm_w_row(x, w, out, d, li, lo, eps);
}
extern "C" __global__ void rms_norm_w_bf16_bf16(const bf16_t* x, const float* w, bf16_t* out, int d, int li, int lo, float eps) {
    rms_norm_w_row(x, w, out, d, li, lo, eps);
}
extern "C" __global__ void rms_norm_w_bf16_f32(const bf16_t* x, const float* w, float* out, int d, int li, int lo, float eps) {
    rms_norm_w_row(x, w, out, d, li, lo, eps);
}
