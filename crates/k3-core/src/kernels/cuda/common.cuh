// common.cuh: prepended to every k3rs CUDA source before NVRTC compiles it (see
// kernels/cuda/mod.rs). No system headers: NVRTC needs none of the toolkit's include files,
// so bf16 is handled as raw `unsigned short` bits here instead of via <cuda_bf16.h>.

typedef unsigned short bf16_t;

#define K3_INF __int_as_float(0x7f800000)

// bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}

// f32 -> bf16, round to nearest even; NaN stays a quiet NaN. Same rule as the `half` crate.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Load / store one element of either storage type as f32.
__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, long long i, float v) { p[i] = f32_to_bf16(v); }

// Any type __shfl_xor_sync takes (float, double, int, ...).
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum / max for blockDim.x a multiple of 32 (<= 1024). Every thread gets the result.
// `scratch` is 32 elements of shared memory (block_sum: of its type T, any warp_sum type;
// block_max: floats); the call ends with the scratch free for reuse.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nw) ? scratch[lane] : (T)0;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = (lane < nw) ? scratch[lane] : -K3_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ---- FP8 E4M3 (the cache formats of k3-core `fp8.rs`, which these must match bit for bit):
// f32 -> e4m3 rounds to nearest even and saturates to +-448 (NaN -> 0x7f); e4m3 -> f32 is exact.
__device__ __forceinline__ unsigned char f32_to_e4m3(float x) {
    const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
    const float a = fabsf(x);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (!(a <= 448.0f)) return (unsigned char)(sign | 0x7eu);
    if (a < 0.015625f) return (unsigned char)(sign | (unsigned)__float2int_rn(a * 512.0f));  // subnormal: m * 2^-9
    unsigned u = __float_as_uint(a);
    u = (u + 0x7ffffu + ((u >> 20) & 1u)) & 0xfff00000u;  // round the mantissa to 3 bits
    const unsigned v = ((((u >> 23) - 120u) << 3) | ((u >> 20) & 7u));
    return (unsigned char)(sign | min(v, 0x7eu));
}
__device__ __forceinline__ float e4m3_to_f32(unsigned b) {
    const unsigned e = (b >> 3) & 15u, m = b & 7u;
    const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    return (b & 0x80u) ? -v : v;
}
// The power-of-two scale of a tile with largest magnitude `amax` (k3-core `fp8::tile_scale`).
__device__ __forceinline__ float e4m3_tile_scale(float amax) {
    const float t = amax / 448.0f;
    if (!(t > 0.0f)) return 1.0f;
    if (t < 1.17549435e-38f) return 1.17549435e-38f;
    const unsigned bits = __float_as_uint(t);
    unsigned e = bits >> 23;
    if (bits & 0x7fffffu) e++;
    return __uint_as_float(min(e, 254u) << 23);
}

// 16-byte vector loads/stores: 4 f32 or 8 bf16 per access.
__device__ __forceinline__ void ld_vec(const float* p, float* f) {
    float4 v = *reinterpret_cast<const float4*>(p);
    f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
}
__device__ __forceinline__ void ld_vec(const bf16_t* p, float* f) {
    uint4 r = *reinterpret_cast<const uint4*>(p);
    unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void st_vec(float* p, const float* f) {
    *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}
__device__ __forceinline__ void st_vec(bf16_t* p, const float* f) {
    unsigned int w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        w[i] = (unsigned int)f32_to_bf16(f[2 * i]) | ((unsigned int)f32_to_bf16(f[2 * i + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Approximate exp2 / reciprocal / reciprocal square root, one MUFU op each. The .ftz forms skip
// the denormal fix-ups that NVRTC's default (-ftz=false) wraps around __expf and __fdividef
// (several instructions per call; results below 2^-126 flush to zero instead).
#define K3_LOG2E 1.4426950408889634f
__device__ __forceinline__ float ex2_ftz(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float rcp_ftz(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float rsqrt_ftz(float x) {
    float r;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float exp_ftz(float x) { return ex2_ftz(x * K3_LOG2E); }
__device__ __forceinline__ float sigmoid_ftz(float x) { return rcp_ftz(1.0f + exp_ftz(-x)); }
__device__ __forceinline__ float silu_ftz(float x) { return x * rcp_ftz(1.0f + exp_ftz(-x)); }

// ---- Tensor cores (sm_80+): bf16 pairs, shared-memory addresses, ldmatrix, mma.sync.
// Two f32 as one bf16x2 word (round to nearest even), `lo` in the low half; and back.
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Four e4m3 (the bytes of `w`, lowest first) times the power-of-two `s` as four BF16 (two words,
// lowest first): exact, since e4m3 · 2^k fits BF16. sm_89+ converts in hardware (e4m3x2 -> f16x2).
__device__ __forceinline__ uint2 e4m3x4_to_bf16x4(unsigned w, float s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned h01, h23;
    asm("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi; }" : "=r"(h01), "=r"(h23) : "r"(w));
    float f0, f1, f2, f3;
    asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b; }" : "=f"(f0), "=f"(f1) : "r"(h01));
    asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b; }" : "=f"(f2), "=f"(f3) : "r"(h23));
#else
    const float f0 = e4m3_to_f32(w & 0xffu), f1 = e4m3_to_f32((w >> 8) & 0xffu), f2 = e4m3_to_f32((w >> 16) & 0xffu), f3 = e4m3_to_f32(w >> 24);
#endif
    return make_uint2(pack_bf16(f0 * s, f1 * s), pack_bf16(f2 * s, f3 * s));
}
__device__ __forceinline__ float lo_bf16(unsigned u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_bf16(unsigned u) { return __uint_as_float(u & 0xffff0000u); }
// Shared-memory address of a generic pointer, for PTX that takes one.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
// c[4] (an m16n8 f32 tile) += A (16x16 bf16 fragment, 4 words) · B (16x8, 2 words).
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8x8 bf16 matrices from shared memory (lane l gives the address of row l&7 of matrix
// l>>3); `_t` transposes each (B operands from row-major [k][n] tiles).
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
// 16-byte asynchronous global -> shared copies (zero-filled past `bytes`), in commit groups.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait_0() { asm volatile("cp.async.wait_group 0;\n" ::); }
// f32 rounded to TF32 (for mma .tf32 operands).
__device__ __forceinline__ unsigned tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
// acc[2][4] (a 16x16 C: two m16n8 tiles) += X · Y for f32 16x16 blocks in shared memory (row
// strides ldx, ldy), on tensor cores in TF32 (mma m16n8k8, f32 accumulate).
__device__ __forceinline__ void mma16_tf32(float (*acc)[4], const float* X, int ldx, const float* Y, int ldy, int g, int t) {
#pragma unroll
    for (int ks = 0; ks < 2; ks++) {
        const unsigned a0 = tf32(X[g * ldx + ks * 8 + t]), a1 = tf32(X[(g + 8) * ldx + ks * 8 + t]);
        const unsigned a2 = tf32(X[g * ldx + ks * 8 + t + 4]), a3 = tf32(X[(g + 8) * ldx + ks * 8 + t + 4]);
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            const unsigned b0 = tf32(Y[(ks * 8 + t) * ldy + nt * 8 + g]), b1 = tf32(Y[(ks * 8 + t + 4) * ldy + nt * 8 + g]);
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                         : "+f"(acc[nt][0]), "+f"(acc[nt][1]), "+f"(acc[nt][2]), "+f"(acc[nt][3])
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
        }
    }
}

// ---- mbarriers and bulk copies (TMA, sm_90). One thread arms a barrier with the byte count
// it expects (`mbar_expect_tx`, which is also its arrival) and issues `bulk_g2s` copies that
// complete on it; other arrivals are plain `mbar_arrive`s; waiters spin on the phase parity.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned ok = 0;
    while (!ok)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
