// vision.cu: the MoonViT3d tower's own kernels (around-backbone §3.2–§3.8; CPU oracle:
// k3-vision's tower.rs, merger.rs and projector.rs). The tower's GEMMs are cuBLAS calls and its
// RMSNorms norm.cu's `rms_norm_w_*`; what is left is here:
// - vit_rope_*: 2-D RoPE of Q and K (pairs (2j, 2j+1) of each head; even j -> column position,
//   odd j -> row position, frequency j/2), V copied; F32 qkv [L, 3*Dq] in, F32 or BF16 out.
// - vit_softmax_*: one block per row of F32 scores [rows, n]: softmax(scale * s), F32 or BF16 out.
// - vit_gelu_tanh_*, vit_gelu_erf_*: F32 in, F32 or BF16 out, elementwise (erf form in f64, as
//   the CPU).
// - vit_merge: sd2_tpool of one sample: F32 [t*h*w, C] -> F32 [(h/kh)*(w/kw), kh*kw*C], the
//   time mean summed in frame order and scaled by 1/t as the CPU does.
// Grid-stride loops over elements; all arithmetic f32 (f64 for erf).

#define VGRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// One thread per (row, pair) of the [L, 3*Dq] qkv: pairs = L * 3*Dq/2. `rc` holds each row's
// (row, column) patch position; cos/sin are [side, nf] with nf = hd/4. In place (out == qkv, F32)
// is allowed: each pair is read and written by one thread.
template <typename TO>
__device__ __forceinline__ void vit_rope_impl(const float* qkv, const int* __restrict__ rc,
                                              const float* __restrict__ cs, const float* __restrict__ sn,
                                              TO* out, long long rows, int dq, int hd) {
    const int w3 = 3 * dq, half = w3 / 2, nf = hd / 4;
    VGRID_STRIDE(i, rows * half) {
        const long long row = i / half;
        const int e = 2 * (int)(i % half);  // first column of the pair
        const long long at = row * w3 + e;
        const float a = qkv[at], b = qkv[at + 1];
        if (e >= 2 * dq) {  // V: copied
            st(out, at, a);
            st(out, at + 1, b);
        } else {
            const int j = (e % hd) / 2;
            const int pos = (j % 2 == 0) ? rc[2 * row + 1] : rc[2 * row];
            const int k = j / 2;
            const float co = cs[pos * nf + k], si = sn[pos * nf + k];
            st(out, at, __fsub_rn(__fmul_rn(a, co), __fmul_rn(b, si)));
            st(out, at + 1, __fadd_rn(__fmul_rn(a, si), __fmul_rn(b, co)));
        }
    }
}
extern "C" __global__ void vit_rope_f32(const float* qkv, const int* rc, const float* cs, const float* sn, float* out,
                                        long long rows, int dq, int hd) {
    vit_rope_impl(qkv, rc, cs, sn, out, rows, dq, hd);
}
extern "C" __global__ void vit_rope_bf16(const float* qkv, const int* rc, const float* cs, const float* sn, bf16_t* out,
                                         long long rows, int dq, int hd) {
    vit_rope_impl(qkv, rc, cs, sn, out, rows, dq, hd);
}

// Row softmax of scale * s over n columns: one block per row (blockDim a multiple of 32).
template <typename TO>
__device__ __forceinline__ void vit_softmax_impl(const float* __restrict__ s, TO* __restrict__ p, int n, float scale) {
    __shared__ float scratch[32];
    const float* row = s + (long long)blockIdx.x * n;
    TO* out = p + (long long)blockIdx.x * n;
    float m = -K3_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scale * row[j]);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) sum += expf(scale * row[j] - m);
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (int j = threadIdx.x; j < n; j += blockDim.x) st(out, j, expf(scale * row[j] - m) * inv);
}
extern "C" __global__ void vit_softmax_f32(const float* s, float* p, int n, float scale) { vit_softmax_impl(s, p, n, scale); }
extern "C" __global__ void vit_softmax_bf16(const float* s, bf16_t* p, int n, float scale) { vit_softmax_impl(s, p, n, scale); }

// PyTorch's gelu(approximate="tanh"), the ViT MLP's activation.
template <typename TO>
__device__ __forceinline__ void vit_gelu_tanh_impl(const float* __restrict__ x, TO* __restrict__ y, long long n) {
    const float beta = 0.7978845608028654f;  // sqrt(2/pi)
    VGRID_STRIDE(i, n) {
        const float v = x[i];
        const float inner = beta * (v + 0.044715f * (v * v * v));
        st(y, i, 0.5f * v * (1.0f + tanhf(inner)));
    }
}
extern "C" __global__ void vit_gelu_tanh_f32(const float* x, float* y, long long n) { vit_gelu_tanh_impl(x, y, n); }
extern "C" __global__ void vit_gelu_tanh_bf16(const float* x, bf16_t* y, long long n) { vit_gelu_tanh_impl(x, y, n); }

// Exact GELU 0.5*u*(1 + erf(u/sqrt 2)) in f64, the projector's activation.
template <typename TO>
__device__ __forceinline__ void vit_gelu_erf_impl(const float* __restrict__ x, TO* __restrict__ y, long long n) {
    VGRID_STRIDE(i, n) {
        const double u = (double)x[i];
        st(y, i, (float)(0.5 * u * (1.0 + erf(u * 0.70710678118654752440))));
    }
}
extern "C" __global__ void vit_gelu_erf_f32(const float* x, float* y, long long n) { vit_gelu_erf_impl(x, y, n); }
extern "C" __global__ void vit_gelu_erf_bf16(const float* x, bf16_t* y, long long n) { vit_gelu_erf_impl(x, y, n); }

// sd2_tpool of one sample of grid (t, h, w): out element (tok, dy*kw + dx, ch) is the mean over
// frames tau of x[tau*h*w + (kh*R + dy)*w + kw*Cc + dx, ch], tok = R*(w/kw) + Cc.
extern "C" __global__ void vit_merge(const float* __restrict__ x, float* __restrict__ out, int t, int h, int w,
                                     int kh, int kw, int c) {
    const int gw = w / kw;
    const long long n = (long long)(h / kh) * gw * kh * kw * c;
    const float inv = 1.0f / (float)t;
    VGRID_STRIDE(i, n) {
        const int ch = (int)(i % c);
        const int j = (int)((i / c) % (kh * kw));
        const long long tok = i / ((long long)c * kh * kw);
        const int dy = j / kw, dx = j % kw;
        const long long r = tok / gw, cc = tok % gw;
        const long long p0 = (kh * r + dy) * w + kw * cc + dx;
        float acc = 0.0f;
        for (int tau = 0; tau < t; tau++) acc += x[((long long)tau * h * w + p0) * c + ch];
        out[i] = t > 1 ? acc * inv : acc;
    }
}
