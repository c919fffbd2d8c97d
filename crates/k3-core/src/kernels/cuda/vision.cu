// vision.cu: the MoonViT3d tower's own kernels (around-backbone §3.2–§3.8; CPU oracle:
// k3-vision's tower.rs, merger.rs and projector.rs). The tower's GEMMs are cuBLAS calls and its
// RMSNorms norm.cu's `rms_norm_w_*`; what is left is here:
// - vit_rope_*: 2-D RoPE of Q and K (pairs (2j, 2j+1) of each head; even j -> column position,
//   odd j -> row position, frequency j/2), V copied; F32 qkv [L, 3*Dq] in, F32 or BF16 out.
//   vit_rope_bf16_inplace: the same rotation of a BF16 qkv in place (V not touched), 4 columns
//   (pairs j, j+1 of one frequency) per thread.
// - vit_rms_norm_bf16: RMSNorm of F32 rows of width d (a multiple of 4, at most 32*4*VIT_NORM_V)
//   to BF16, one warp per row held in registers (one read of x); the BF16 tower's GEMM inputs.
// - vit_softmax_*: one block per row of F32 scores [rows, n]: softmax(scale * s), F32 or BF16 out.
// - vit_gelu_tanh_*, vit_gelu_erf_*: F32 in, F32 or BF16 out, elementwise (erf form in f64, as
//   the CPU). vit_gelu_tanh_bf16_bf16: BF16 in and out (in place allowed), 8 per 16-byte access.
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

// In place on BF16 qkv [L, 3*Dq]: one thread per 4 columns e..e+3 of Q|K (e = 4k within a head:
// pair j = 2k by the column position, pair 2k+1 by the row position, both frequency k), one
// 8-byte access each way. The arithmetic is vit_rope_impl's on the same (bf16-exact) inputs,
// so the result is bit for bit the cast to F32 followed by vit_rope_bf16. V is not touched.
__device__ __forceinline__ void vit_rot_pair(unsigned& w, float co, float si) {
    const float a = lo_bf16(w), b = hi_bf16(w);
    w = (unsigned)f32_to_bf16(__fsub_rn(__fmul_rn(a, co), __fmul_rn(b, si))) |
        ((unsigned)f32_to_bf16(__fadd_rn(__fmul_rn(a, si), __fmul_rn(b, co))) << 16);
}
extern "C" __global__ void vit_rope_bf16_inplace(bf16_t* qkv, const int* __restrict__ rc, const float* __restrict__ cs,
                                                 const float* __restrict__ sn, long long rows, int dq, int hd) {
    const int quads = dq / 2, nf = hd / 4;  // 2*Dq columns of Q|K per row, 4 per thread
    VGRID_STRIDE(i, rows * quads) {
        const long long row = i / quads;
        const int e = 4 * (int)(i % quads);
        const int k = (e % hd) / 4;
        const int pc = rc[2 * row + 1], pr = rc[2 * row];
        uint2* at = reinterpret_cast<uint2*>(qkv + row * 3 * dq + e);
        uint2 v = *at;
        vit_rot_pair(v.x, cs[pc * nf + k], sn[pc * nf + k]);
        vit_rot_pair(v.y, cs[pr * nf + k], sn[pr * nf + k]);
        *at = v;
    }
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
__device__ __forceinline__ float vit_gelu_tanh_f(float v) {
    const float beta = 0.7978845608028654f;  // sqrt(2/pi)
    const float inner = beta * (v + 0.044715f * (v * v * v));
    return 0.5f * v * (1.0f + tanhf(inner));
}
template <typename TO>
__device__ __forceinline__ void vit_gelu_tanh_impl(const float* __restrict__ x, TO* __restrict__ y, long long n) {
    VGRID_STRIDE(i, n) st(y, i, vit_gelu_tanh_f(x[i]));
}
extern "C" __global__ void vit_gelu_tanh_f32(const float* x, float* y, long long n) { vit_gelu_tanh_impl(x, y, n); }
extern "C" __global__ void vit_gelu_tanh_bf16(const float* x, bf16_t* y, long long n) { vit_gelu_tanh_impl(x, y, n); }
// BF16 in and out (y == x allowed; both 16-byte aligned): 8 elements per access, the last
// n % 8 one by one. Each element is vit_gelu_tanh_bf16 of its f32 value.
extern "C" __global__ void vit_gelu_tanh_bf16_bf16(const bf16_t* x, bf16_t* y, long long n) {
    VGRID_STRIDE(i, n / 8) {
        float f[8];
        ld_vec(x + 8 * i, f);
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] = vit_gelu_tanh_f(f[j]);
        st_vec(y + 8 * i, f);
    }
    VGRID_STRIDE(i, n % 8) st(y, n / 8 * 8 + i, vit_gelu_tanh_f(ld(x, n / 8 * 8 + i)));
}

// RMSNorm of F32 rows to BF16, one warp per row (blockDim.x a multiple of 32): lane l holds the
// float4s l, l+32, ... of its row in registers, so x is read once; then out = x * inv * w with
// inv = 1/sqrt(mean(x^2) + eps), as norm.cu's rms_norm_w (only the summation order differs).
#define VIT_NORM_V 16
extern "C" __global__ void vit_rms_norm_bf16(const float* __restrict__ x, const float* __restrict__ w, bf16_t* __restrict__ out,
                                             long long rows, int d, float eps) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= rows) return;  // whole warps leave together
    const float* xr = x + row * d;
    float4 v[VIT_NORM_V];
    float ss = 0.0f;
#pragma unroll
    for (int t = 0; t < VIT_NORM_V; t++) {
        const int c = 4 * (lane + 32 * t);
        v[t] = c < d ? *reinterpret_cast<const float4*>(xr + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        ss += v[t].x * v[t].x + v[t].y * v[t].y + v[t].z * v[t].z + v[t].w * v[t].w;
    }
    ss = warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    bf16_t* yr = out + row * d;
#pragma unroll
    for (int t = 0; t < VIT_NORM_V; t++) {
        const int c = 4 * (lane + 32 * t);
        if (c < d) {
            const float4 g = *reinterpret_cast<const float4*>(w + c);
            *reinterpret_cast<uint2*>(yr + c) = make_uint2(pack_bf16(v[t].x * inv * g.x, v[t].y * inv * g.y), pack_bf16(v[t].z * inv * g.z, v[t].w * inv * g.w));
        }
    }
}

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
