// mla.cu: gated MLA in the absorbed form over a paged latent cache (text-backbone §4; CPU
// oracle: k3-model layers/mla.rs `attend`, absorbed branch). Shapes: N packed rows, nh heads,
// latent width r, rope width dr, W = r + dr; cache BF16 [num_pages, PAGE=64, W] (normed c_kv
// then raw k_pe); block_table I32 [B, max_pages]; row_seq / row_pos I32 [N]; q BF16
// [N, nh, W] (absorbed: q_lat | q_pe); out BF16 [N, nh, r]; optional selection sel_idx I32
// [N, K] with sel_count I32 [N].
//
// `mla_cache_append_*`: one block per row, RMSNorm of the latent in f32, stored as BF16
// (`_f32c`: stored F32, the reference precision, read by `mla_attend_f32` at the end).
// `mla_attend_tc` (r <= 512, the K3 case): flash-decoding on tensor cores with cp.async
// double-buffered key tiles, described at the kernel. `mla_attend_p2` / `_p4` (512 < r <= 1024 / <= 2048, CUDA cores, f32 P):
// block (row, head group of <= HGM heads, key split); each 32-key tile is gathered from the pages into
// shared memory once and used by every head of the group; scores in f32 (q pre-scaled by
// scale*log2 e, exp2), online softmax, the latent accumulator (2P dims per thread) in
// registers. With one split a block writes `out` directly; otherwise it writes (m, l, acc)
// partials and `mla_combine` merges them.

#define MLA_PAGE 64
#define MLA_TILE 32
#define MLA_THREADS 256
#define MLA_LOG2E 1.4426950408889634f

template <typename T, typename C>
__device__ __forceinline__ void mla_cache_append_row(const T* __restrict__ ckv, const float* __restrict__ kv_norm, float eps,
                                                     const int* __restrict__ block_table, int max_pages,
                                                     const int* __restrict__ row_seq, const int* __restrict__ row_pos,
                                                     C* __restrict__ cache, int r, int dr) {
    __shared__ float scratch[32];
    const int i = blockIdx.x, w = r + dr;
    const T* x = ckv + (long long)i * w;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < r; d += blockDim.x) {
        float v = ld(x, d);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)r + eps);
    const int pos = row_pos[i];
    const int page = block_table[(long long)row_seq[i] * max_pages + pos / MLA_PAGE];
    C* dst = cache + ((long long)page * MLA_PAGE + pos % MLA_PAGE) * w;
    for (int d = threadIdx.x; d < w; d += blockDim.x) {
        float v = ld(x, d);
        st(dst, d, d < r ? v * inv * kv_norm[d] : v);
    }
}

extern "C" __global__ void mla_cache_append_f32(const float* ckv, const float* kv_norm, float eps, const int* bt, int mp,
                                                const int* rs, const int* rp, bf16_t* cache, int r, int dr) {
    mla_cache_append_row<float, bf16_t>(ckv, kv_norm, eps, bt, mp, rs, rp, cache, r, dr);
}
// F32 cache (the reference precision): F32 rows in, F32 cache.
extern "C" __global__ void mla_cache_append_f32c(const float* ckv, const float* kv_norm, float eps, const int* bt, int mp,
                                                 const int* rs, const int* rp, float* cache, int r, int dr) {
    mla_cache_append_row<float, float>(ckv, kv_norm, eps, bt, mp, rs, rp, cache, r, dr);
}
extern "C" __global__ void mla_cache_append_bf16(const bf16_t* ckv, const float* kv_norm, float eps, const int* bt, int mp,
                                                 const int* rs, const int* rp, bf16_t* cache, int r, int dr) {
    mla_cache_append_row<bf16_t, bf16_t>(ckv, kv_norm, eps, bt, mp, rs, rp, cache, r, dr);
}

// FP8 cache (`fp8_ds_mla`, k3-core fp8.rs `LatentFp8`): row of `rb` bytes = e4m3 latent [r] |
// f32 scales [ceil(r/128)] | zeros to 16 B | bf16 k_pe [dr] at byte `pe` | zeros. One block of
// exactly 128 threads per row: thread t holds latent value 128 j + t of tile j; each tile's
// amax is a block max, its scale the power of two of `e4m3_tile_scale`.
template <typename T>
__device__ __forceinline__ void mla_cache_append_fp8_row(const T* __restrict__ ckv, const float* __restrict__ kv_norm, float eps,
                                                         const int* __restrict__ block_table, int max_pages,
                                                         const int* __restrict__ row_seq, const int* __restrict__ row_pos,
                                                         unsigned char* __restrict__ cache, int r, int dr, int pe, int rb) {
    __shared__ float scratch[32];
    const int i = blockIdx.x, w = r + dr, tid = threadIdx.x;
    const T* x = ckv + (long long)i * w;
    float ss = 0.0f;
    for (int d = tid; d < r; d += blockDim.x) {
        float v = ld(x, d);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)r + eps);
    const int pos = row_pos[i];
    const int page = block_table[(long long)row_seq[i] * max_pages + pos / MLA_PAGE];
    unsigned char* dst = cache + ((long long)page * MLA_PAGE + pos % MLA_PAGE) * rb;
    const int tiles = (r + 127) / 128;
    for (int j = 0; j < tiles; j++) {
        const int d = 128 * j + tid;
        const float v = d < r ? ld(x, d) * inv * kv_norm[d] : 0.0f;
        const float s = e4m3_tile_scale(block_max(fabsf(v), scratch));
        if (d < r) dst[d] = f32_to_e4m3(v * (1.0f / s));
        if (tid == 0) *reinterpret_cast<float*>(dst + r + 4 * j) = s;
    }
    for (int b = r + 4 * tiles + tid; b < pe; b += blockDim.x) dst[b] = 0;
    bf16_t* kpe = reinterpret_cast<bf16_t*>(dst + pe);
    for (int d = tid; d < dr; d += blockDim.x) kpe[d] = f32_to_bf16(ld(x, r + d));
    for (int b = pe + 2 * dr + tid; b < rb; b += blockDim.x) dst[b] = 0;
}

extern "C" __global__ void mla_cache_append_fp8_f32(const float* ckv, const float* kv_norm, float eps, const int* bt, int mp,
                                                    const int* rs, const int* rp, unsigned char* cache, int r, int dr, int pe, int rb) {
    mla_cache_append_fp8_row<float>(ckv, kv_norm, eps, bt, mp, rs, rp, cache, r, dr, pe, rb);
}
extern "C" __global__ void mla_cache_append_fp8_bf16(const bf16_t* ckv, const float* kv_norm, float eps, const int* bt, int mp,
                                                     const int* rs, const int* rp, unsigned char* cache, int r, int dr, int pe, int rb) {
    mla_cache_append_fp8_row<bf16_t>(ckv, kv_norm, eps, bt, mp, rs, rp, cache, r, dr, pe, rb);
}

// Dynamic shared memory: qs f32 [HGM][W] | ks bf16 [TILE][W+8] | ps f32 [TILE][HGM] |
// m, l, alpha f32 [HGM] | rowoff i64 [TILE].
template <int P, int HGM>
__device__ __forceinline__ void mla_attend_block(const bf16_t* __restrict__ q, const bf16_t* __restrict__ cache,
                                                 const int* __restrict__ block_table, int max_pages,
                                                 const int* __restrict__ row_seq, const int* __restrict__ row_pos,
                                                 const int* __restrict__ sel_idx, const int* __restrict__ sel_count, int sel_k,
                                                 int nh, int r, int dr, float scale, int splits,
                                                 bf16_t* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int w = r + dr, wp = w + 8, wv = w / 8;
    float* qs = reinterpret_cast<float*>(smem);
    bf16_t* ks = reinterpret_cast<bf16_t*>(qs + HGM * w);
    float* ps = reinterpret_cast<float*>(ks + MLA_TILE * wp);
    float* m_s = ps + MLA_TILE * HGM;
    float* l_s = m_s + HGM;
    float* a_s = l_s + HGM;
    long long* rowoff = reinterpret_cast<long long*>(a_s + HGM + 2);  // 8-byte aligned (HGM even)

    const int i = blockIdx.x, h0 = blockIdx.y * HGM, split = blockIdx.z;
    const int hg = min(HGM, nh - h0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = sel_idx ? sel_count[i] : row_pos[i] + 1;
    int chunk = (n + splits - 1) / splits;
    chunk = (chunk + MLA_TILE - 1) / MLA_TILE * MLA_TILE;
    const int start = split * chunk, end = min(n, start + chunk);
    const long long seq_base = (long long)row_seq[i] * max_pages;

    // q of this head group, pre-scaled, f32.
    const float qscale = scale * MLA_LOG2E;
    for (int v = tid; v < hg * wv; v += MLA_THREADS) {
        int h = v / wv, c = (v % wv) * 8;
        float f[8];
        ld_vec(q + ((long long)i * nh + h0 + h) * w + c, f);
#pragma unroll
        for (int j = 0; j < 8; j++) f[j] *= qscale;
        st_vec(qs + h * w + c, f);
        st_vec(qs + h * w + c + 4, f + 4);
    }
    if (tid < HGM) {
        m_s[tid] = -K3_INF;
        l_s[tid] = 0.0f;
    }
    float acc[HGM][2 * P];
#pragma unroll
    for (int h = 0; h < HGM; h++)
#pragma unroll
        for (int j = 0; j < 2 * P; j++) acc[h][j] = 0.0f;

    for (int t0 = start; t0 < end; t0 += MLA_TILE) {
        __syncthreads();  // previous tile fully consumed (and q / m / l initialised)
        if (tid < MLA_TILE) {
            int j = t0 + tid;
            long long off = -1;
            if (j < end) {
                int pos = sel_idx ? sel_idx[(long long)i * sel_k + j] : j;
                int page = block_table[seq_base + pos / MLA_PAGE];
                off = ((long long)page * MLA_PAGE + pos % MLA_PAGE) * w;
            }
            rowoff[tid] = off;
        }
        __syncthreads();
        for (int v = tid; v < MLA_TILE * wv; v += MLA_THREADS) {
            int t = v / wv, c = (v % wv) * 8;
            long long off = rowoff[t];
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (off >= 0) val = *reinterpret_cast<const uint4*>(cache + off + c);
            *reinterpret_cast<uint4*>(ks + t * wp + c) = val;
        }
        __syncthreads();
        // Scores: lane = key, heads warp, warp+8, ...
        {
            const bool valid = t0 + lane < end;
            const bf16_t* kr = ks + lane * wp;
#pragma unroll
            for (int hh = 0; hh < (HGM + 7) / 8; hh++) {
                const int h = warp + 8 * hh;
                if (h < hg) {  // warp-uniform
                    const float* qr = qs + h * w;
                    float s = 0.0f;
                    for (int c = 0; c < w; c += 8) {
                        float kf[8], qf[8];
                        ld_vec(kr + c, kf);
                        ld_vec(qr + c, qf);
                        ld_vec(qr + c + 4, qf + 4);
#pragma unroll
                        for (int j = 0; j < 8; j++) s = fmaf(qf[j], kf[j], s);
                    }
                    if (!valid) s = -K3_INF;
                    const float m_old = m_s[h];
                    const float m_new = fmaxf(m_old, warp_max(s));
                    const float p = valid ? exp2f(s - m_new) : 0.0f;
                    const float psum = warp_sum(p);
                    ps[lane * HGM + h] = p;
                    __syncwarp();
                    if (lane == 0) {
                        const float alpha = exp2f(m_old - m_new);
                        a_s[h] = alpha;
                        m_s[h] = m_new;
                        l_s[h] = l_s[h] * alpha + psum;
                    }
                }
            }
        }
        __syncthreads();
        // Rescale and accumulate: dims 2*tid + 512*p (+0, +1).
        float al[HGM];
#pragma unroll
        for (int h = 0; h < HGM; h++) al[h] = h < hg ? a_s[h] : 0.0f;
#pragma unroll
        for (int h = 0; h < HGM; h++)
#pragma unroll
            for (int j = 0; j < 2 * P; j++) acc[h][j] *= al[h];
        const int tcount = min(MLA_TILE, end - t0);
        for (int t = 0; t < tcount; t++) {
            float pr[HGM];
#pragma unroll
            for (int h = 0; h < HGM; h += 4) {
                float4 v4 = *reinterpret_cast<const float4*>(ps + t * HGM + h);
                pr[h] = v4.x; pr[h + 1] = v4.y; pr[h + 2] = v4.z; pr[h + 3] = v4.w;
            }
#pragma unroll
            for (int pp = 0; pp < P; pp++) {
                const int d = 2 * tid + 2 * MLA_THREADS * pp;
                if (d < r) {
                    unsigned int kv = *reinterpret_cast<const unsigned int*>(ks + t * wp + d);
                    const float k0 = __uint_as_float(kv << 16), k1 = __uint_as_float(kv & 0xffff0000u);
#pragma unroll
                    for (int h = 0; h < HGM; h++) {
                        acc[h][2 * pp] = fmaf(pr[h], k0, acc[h][2 * pp]);
                        acc[h][2 * pp + 1] = fmaf(pr[h], k1, acc[h][2 * pp + 1]);
                    }
                }
            }
        }
    }
    __syncthreads();
    if (splits == 1) {
#pragma unroll
        for (int h = 0; h < HGM; h++) {
            if (h >= hg) break;
            const float l = l_s[h];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
            for (int pp = 0; pp < P; pp++) {
                const int d = 2 * tid + 2 * MLA_THREADS * pp;
                if (d < r) {
                    unsigned int o = (unsigned int)f32_to_bf16(acc[h][2 * pp] * inv) | ((unsigned int)f32_to_bf16(acc[h][2 * pp + 1] * inv) << 16);
                    *reinterpret_cast<unsigned int*>(out + ((long long)i * nh + h0 + h) * r + d) = o;
                }
            }
        }
    } else {
        const long long base = ((long long)i * splits + split) * nh + h0;
#pragma unroll
        for (int h = 0; h < HGM; h++) {
            if (h >= hg) break;
#pragma unroll
            for (int pp = 0; pp < P; pp++) {
                const int d = 2 * tid + 2 * MLA_THREADS * pp;
                if (d < r) *reinterpret_cast<float2*>(part_acc + (base + h) * r + d) = make_float2(acc[h][2 * pp], acc[h][2 * pp + 1]);
            }
        }
        if (tid < hg) *reinterpret_cast<float2*>(part_ml + (base + tid) * 2) = make_float2(m_s[tid], l_s[tid]);
    }
}

#define MLA_ATTEND_KERNEL(NAME, P, HGM)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MLA_THREADS) NAME(                                                         \
        const bf16_t* q, const bf16_t* cache, const int* bt, int mp, const int* rs, const int* rp, const int* si,           \
        const int* sc, int sk, int nh, int r, int dr, float scale, int splits, bf16_t* out, float* pa, float* pm) {         \
        mla_attend_block<P, HGM>(q, cache, bt, mp, rs, rp, si, sc, sk, nh, r, dr, scale, splits, out, pa, pm);             \
    }
MLA_ATTEND_KERNEL(mla_attend_p2, 2, 8)
MLA_ATTEND_KERNEL(mla_attend_p4, 4, 4)

// Merges the split partials: grid (N, nh), 128 threads, splits <= 1024.
// out = Σ_s e^(m_s-M) acc_s / Σ_s e^(m_s-M) l_s; the per-split weights are computed once.
extern "C" __global__ void __launch_bounds__(128) mla_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                                              int splits, int nh, int r, bf16_t* __restrict__ out) {
    __shared__ float wt[1024];
    __shared__ float scratch[32];
    const int i = blockIdx.x, h = blockIdx.y;
    float mx = -K3_INF;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) mx = fmaxf(mx, part_ml[(((long long)i * splits + s) * nh + h) * 2]);
    mx = block_max(mx, scratch);
    float lsum = 0.0f;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) {
        const float2 ml = *reinterpret_cast<const float2*>(part_ml + (((long long)i * splits + s) * nh + h) * 2);
        const float e = ml.y > 0.0f ? exp2f(ml.x - mx) : 0.0f;
        wt[s] = e;
        lsum += e * ml.y;
    }
    lsum = block_sum(lsum, scratch);  // also orders the wt writes before the reads below
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    const long long stride = (long long)nh * r;  // between consecutive splits
    for (int d = threadIdx.x * 4; d < r; d += blockDim.x * 4) {
        const float* p = part_acc + ((long long)i * splits * nh + h) * r + d;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int s = 0; s < splits; s++) {
            const float e = wt[s];
            if (e > 0.0f) {
                const float4 v = *reinterpret_cast<const float4*>(p + s * stride);
                a.x = fmaf(e, v.x, a.x); a.y = fmaf(e, v.y, a.y); a.z = fmaf(e, v.z, a.z); a.w = fmaf(e, v.w, a.w);
            }
        }
        const unsigned lo = (unsigned)f32_to_bf16(a.x * inv) | ((unsigned)f32_to_bf16(a.y * inv) << 16);
        const unsigned hi = (unsigned)f32_to_bf16(a.z * inv) | ((unsigned)f32_to_bf16(a.w * inv) << 16);
        *reinterpret_cast<uint2*>(out + ((long long)i * nh + h) * r + d) = make_uint2(lo, hi);
    }
}

// ---- tensor-core attend (r <= 512, the K3 case): mma.sync m16n8k16 bf16, f32 accumulate ----
// Block (row, 16-head group, key split), 8 warps. Widths are padded to WK = round_up(W, 16) with
// zeros. 32-key tiles are double-buffered in shared memory: tile t+1 is gathered from the pages
// with cp.async (zero-filled past the keys and the row width) while tile t is computed. Scores
// S[16 heads, 32 keys] = Q K^T: warp w owns keys 8(w&3).. and the k-steps of half w>>2; the two
// halves are added in the softmax. Softmax per head over the tile in f32 (P stored as bf16; l sums
// the rounded P). Output O[16, r] += P V with V = the c_kv part of the key tile.
// (A synchronous 64-key-tile version measured slower at every shape timed on the H200 — one row
// at 4K / 128K context 41.8 / 530 µs vs 36.8 / 397 µs, 64 rows 1356 vs 901 µs — and was removed.)
// Dynamic smem: qs bf16 [16][WK+8] | ks bf16 [2][32][WK+8] | ss f32 [2][16][36] | pb bf16 [16][40] |
// m, l, alpha f32 [16] | rowoff i64 [2][32].
__device__ __forceinline__ void mma_bf16_16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned& r0, unsigned& r1, const void* p) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(a));
}

__device__ __forceinline__ unsigned ld_u32(const bf16_t* p) { return *reinterpret_cast<const unsigned*>(p); }

#define TC_TILE 32
#define TC_SS 36
#define TC_PS 40


// FP8: the cache rows are `fp8_ds_mla` (rb bytes, k_pe at byte pe; see the append above). The
// raw rows of a tile are double-buffered instead (cp.async of rb bytes per key) and each tile is
// expanded once into one BF16 key tile — e4m3 · scale is exact in BF16 — before the same math:
// the result equals the BF16 kernel over the dequantized cache. Dynamic smem: qs | kt bf16
// [32][WK+8] | raw u8 [2][32][rb] | ss | pb | m, l, alpha | rowoff.
template <bool FP8, int MT>
__device__ __forceinline__ void mla_attend_tc_impl(
    const bf16_t* __restrict__ q, const unsigned char* __restrict__ cache, const int* __restrict__ block_table, int max_pages,
    const int* __restrict__ row_seq, const int* __restrict__ row_pos, const int* __restrict__ sel_idx,
    const int* __restrict__ sel_count, int sel_k, int nh, int r, int dr, float scale, int splits, bf16_t* __restrict__ out,
    float* __restrict__ part_acc, float* __restrict__ part_ml, int pe, int rb) {
    extern __shared__ __align__(16) unsigned char smem_tc[];
    const int w = r + dr, wk = (w + 15) / 16 * 16, kst = wk + 8, wv = wk / 8;
    const int row_bytes = FP8 ? rb : 2 * w, rv = row_bytes / 16;
    bf16_t* qs = reinterpret_cast<bf16_t*>(smem_tc);
    constexpr int HB = 16 * MT;  // heads per block: MT m16 tiles
    bf16_t* ks = qs + HB * kst;
    unsigned char* raw = reinterpret_cast<unsigned char*>(ks + (FP8 ? 1 : 2) * TC_TILE * kst);
    float* ss = reinterpret_cast<float*>(FP8 ? raw + 2 * TC_TILE * rb : raw);
    bf16_t* pb = reinterpret_cast<bf16_t*>(ss + 2 * HB * TC_SS);
    float* m_s = reinterpret_cast<float*>(pb + HB * TC_PS);
    float* l_s = m_s + HB;
    float* a_s = l_s + HB;
    long long* rowoff = reinterpret_cast<long long*>(a_s + HB);

    const int i = blockIdx.x, h0 = blockIdx.y * HB, split = blockIdx.z;
    const int hg = min(HB, nh - h0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;
    const int n = sel_idx ? sel_count[i] : row_pos[i] + 1;
    int chunk = (n + splits - 1) / splits;
    chunk = (chunk + 63) / 64 * 64;
    const int start = split * chunk, end = min(n, start + chunk);
    const long long seq_base = (long long)row_seq[i] * max_pages;
    const float qscale = scale * MLA_LOG2E;

    auto key_off = [&](int j) -> long long {  // byte offset of key j's row
        if (j >= end) return -1;
        const int pos = sel_idx ? sel_idx[(long long)i * sel_k + j] : j;
        const int page = block_table[seq_base + pos / MLA_PAGE];
        return ((long long)page * MLA_PAGE + pos % MLA_PAGE) * row_bytes;
    };
    auto issue = [&](int buf) {
        const long long* ro = rowoff + buf * TC_TILE;
        if constexpr (FP8) {
            unsigned char* rbuf = raw + buf * TC_TILE * rb;
            for (int v = tid; v < TC_TILE * rv; v += MLA_THREADS) {
                const int t = v / rv, c = (v % rv) * 16;
                const long long off = ro[t];
                cp_async16(rbuf + t * rb + c, off >= 0 ? (const void*)(cache + off + c) : (const void*)cache, off >= 0 ? 16 : 0);
            }
        } else {
            bf16_t* kb = ks + buf * TC_TILE * kst;
            for (int v = tid; v < TC_TILE * wv; v += MLA_THREADS) {
                const int t = v / wv, c = (v % wv) * 8;
                const long long off = ro[t];
                const bool ok = off >= 0 && c < w;
                cp_async16(kb + t * kst + c, ok ? (const void*)(cache + off + 2 * c) : (const void*)cache, ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
    // FP8: raw rows of `buf` -> the BF16 key tile (8 values per step; r, dr multiples of 8).
    auto expand = [&](int buf) {
        const unsigned char* rbuf = raw + buf * TC_TILE * rb;
        for (int v = tid; v < TC_TILE * wv; v += MLA_THREADS) {
            const int t = v / wv, c = (v % wv) * 8;
            const unsigned char* row = rbuf + t * rb;
            uint4 o = make_uint4(0u, 0u, 0u, 0u);
            if (c < r) {
                const uint2 b = *reinterpret_cast<const uint2*>(row + c);
                const float sc = *reinterpret_cast<const float*>(row + r + 4 * (c / 128));
                const uint2 lo = e4m3x4_to_bf16x4(b.x, sc), hi = e4m3x4_to_bf16x4(b.y, sc);
                o = make_uint4(lo.x, lo.y, hi.x, hi.y);
            } else if (c < w) {
                o = *reinterpret_cast<const uint4*>(row + pe + 2 * (c - r));
            }
            *reinterpret_cast<uint4*>(ks + t * kst + c) = o;
        }
    };

    for (int v = tid; v < HB * wv; v += MLA_THREADS) {
        const int h = v / wv, c = (v % wv) * 8;
        uint4 val = make_uint4(0u, 0u, 0u, 0u);
        if (h < hg && c < w) val = *reinterpret_cast<const uint4*>(q + ((long long)i * nh + h0 + h) * w + c);
        *reinterpret_cast<uint4*>(qs + h * kst + c) = val;
    }
    if (tid < HB) {
        m_s[tid] = -K3_INF;
        l_s[tid] = 0.0f;
    }
    if (tid < TC_TILE) rowoff[tid] = key_off(start + tid);
    __syncthreads();
    if (start < end) issue(0);

    float acc[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
    const int ksteps = wk / 16, half = (ksteps + 1) / 2;
    const int kh = warp >> 2, nbk = warp & 3;
    const int kbeg = kh * half * 16, kend = min(ksteps, (kh + 1) * half) * 16;

    for (int it = 0, t0 = start; t0 < end; it++, t0 += TC_TILE) {
        const int buf = it & 1;
        if (t0 + TC_TILE < end) {
            if (tid < TC_TILE) rowoff[(buf ^ 1) * TC_TILE + tid] = key_off(t0 + TC_TILE + tid);
            __syncthreads();
            issue(buf ^ 1);
            cp_async_wait_1();
        } else {
            cp_async_wait_0();
        }
        __syncthreads();
        if constexpr (FP8) {
            expand(buf);
            __syncthreads();
        }
        const bf16_t* kt = FP8 ? ks : ks + buf * TC_TILE * kst;
        {
            // The key fragments (B) are loaded once and used by every m16 tile of heads.
            float c4[MT][4], c5[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) c4[mt][0] = c4[mt][1] = c4[mt][2] = c4[mt][3] = c5[mt][0] = c5[mt][1] = c5[mt][2] = c5[mt][3] = 0.0f;
            const bf16_t* kb = kt + (8 * nbk + g) * kst + 2 * t4;
            int k0 = kbeg;
            for (; k0 + 32 <= kend; k0 += 32) {
                const unsigned b0 = ld_u32(kb + k0), b1 = ld_u32(kb + k0 + 8), b2 = ld_u32(kb + k0 + 16), b3 = ld_u32(kb + k0 + 24);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const bf16_t* qa = qs + (16 * mt + g) * kst + 2 * t4;
                    const bf16_t* qb = qa + 8 * kst;
                    mma_bf16_16816(c4[mt], ld_u32(qa + k0), ld_u32(qb + k0), ld_u32(qa + k0 + 8), ld_u32(qb + k0 + 8), b0, b1);
                    mma_bf16_16816(c5[mt], ld_u32(qa + k0 + 16), ld_u32(qb + k0 + 16), ld_u32(qa + k0 + 24), ld_u32(qb + k0 + 24), b2, b3);
                }
            }
            if (k0 < kend) {
                const unsigned b0 = ld_u32(kb + k0), b1 = ld_u32(kb + k0 + 8);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const bf16_t* qa = qs + (16 * mt + g) * kst + 2 * t4;
                    const bf16_t* qb = qa + 8 * kst;
                    mma_bf16_16816(c4[mt], ld_u32(qa + k0), ld_u32(qb + k0), ld_u32(qa + k0 + 8), ld_u32(qb + k0 + 8), b0, b1);
                }
            }
            float* sh = ss + kh * HB * TC_SS;
            const int col = 8 * nbk + 2 * t4;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const int ra = 16 * mt + g, rb2 = ra + 8;
                sh[ra * TC_SS + col] = c4[mt][0] + c5[mt][0];
                sh[ra * TC_SS + col + 1] = c4[mt][1] + c5[mt][1];
                sh[rb2 * TC_SS + col] = c4[mt][2] + c5[mt][2];
                sh[rb2 * TC_SS + col + 1] = c4[mt][3] + c5[mt][3];
            }
        }
        __syncthreads();
#pragma unroll
        for (int hh = 0; hh < 2 * MT; hh++) {
            const int h = 2 * MT * warp + hh;
            const bool valid = t0 + lane < end;
            const float s = valid ? (ss[h * TC_SS + lane] + ss[(HB + h) * TC_SS + lane]) * qscale : -K3_INF;
            const float m_old = m_s[h];
            const float m_new = fmaxf(m_old, warp_max(s));
            const bf16_t p = f32_to_bf16(exp2f(s - m_new));
            const float psum = warp_sum(bf16_to_f32(p));
            pb[h * TC_PS + lane] = p;
            __syncwarp();
            if (lane == 0) {
                const float alpha = exp2f(m_old - m_new);
                a_s[h] = alpha;
                m_s[h] = m_new;
                l_s[h] = l_s[h] * alpha + psum;
            }
        }
        __syncthreads();
        {
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const float al0 = a_s[16 * mt + g], al1 = a_s[16 * mt + g + 8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    acc[mt][j][0] *= al0; acc[mt][j][1] *= al0;
                    acc[mt][j][2] *= al1; acc[mt][j][3] *= al1;
                }
            }
            const int kmax = min(TC_TILE, end - t0);
            for (int k0 = 0; k0 < kmax; k0 += 16) {
                unsigned a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const bf16_t* pa = pb + (16 * mt + g) * TC_PS + k0 + 2 * t4;
                    a[mt][0] = ld_u32(pa);
                    a[mt][1] = ld_u32(pa + 8 * TC_PS);
                    a[mt][2] = ld_u32(pa + 8);
                    a[mt][3] = ld_u32(pa + 8 * TC_PS + 8);
                }
                const bf16_t* vrow = kt + (k0 + (lane & 15)) * kst;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const int d0 = 8 * (warp + 8 * j);
                    if (d0 < r) {
                        unsigned b0, b1;
                        ldmatrix_x2_trans(b0, b1, vrow + d0);
#pragma unroll
                        for (int mt = 0; mt < MT; mt++) mma_bf16_16816(acc[mt][j], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                    }
                }
            }
        }
        __syncthreads();
    }
    if (splits == 1) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int h = 16 * mt + g + 8 * hh;
                if (h < hg) {
                    const float l = l_s[h];
                    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        const int d = 8 * (warp + 8 * j) + 2 * t4;
                        if (d < r) {
                            const unsigned o = (unsigned)f32_to_bf16(acc[mt][j][2 * hh] * inv) | ((unsigned)f32_to_bf16(acc[mt][j][2 * hh + 1] * inv) << 16);
                            *reinterpret_cast<unsigned*>(out + ((long long)i * nh + h0 + h) * r + d) = o;
                        }
                    }
                }
            }
    } else {
        const long long base = ((long long)i * splits + split) * nh + h0;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int h = 16 * mt + g + 8 * hh;
                if (h < hg) {
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        const int d = 8 * (warp + 8 * j) + 2 * t4;
                        if (d < r) *reinterpret_cast<float2*>(part_acc + (base + h) * r + d) = make_float2(acc[mt][j][2 * hh], acc[mt][j][2 * hh + 1]);
                    }
                }
            }
        if (tid < hg) *reinterpret_cast<float2*>(part_ml + (base + tid) * 2) = make_float2(m_s[tid], l_s[tid]);
    }
}

#define MLA_ATTEND_TC_ARGS                                                                                               \
    const bf16_t *q, const unsigned char *cache, const int *block_table, int max_pages, const int *row_seq, const int *row_pos, \
        const int *sel_idx, const int *sel_count, int sel_k, int nh, int r, int dr, float scale, int splits, bf16_t *out,   \
        float *part_acc, float *part_ml
#define MLA_ATTEND_TC(NAME, FP8, MT)                                                                                          \
    extern "C" __global__ void __launch_bounds__(MLA_THREADS) NAME(MLA_ATTEND_TC_ARGS, int pe, int rb) {                   \
        mla_attend_tc_impl<FP8, MT>(q, cache, block_table, max_pages, row_seq, row_pos, sel_idx, sel_count, sel_k, nh, r, dr, \
                                    scale, splits, out, part_acc, part_ml, pe, rb);                                           \
    }
// 16 or 32 heads per block (32: half the key loads and FP8 expansions per head, twice the
// accumulator registers), over a BF16 or an FP8 cache.
MLA_ATTEND_TC(mla_attend_tc, false, 1)
MLA_ATTEND_TC(mla_attend_tc32, false, 2)
MLA_ATTEND_TC(mla_attend_tc_fp8, true, 1)
MLA_ATTEND_TC(mla_attend_tc32_fp8, true, 2)

// ---- F32 reference attend (the reference precision; any r + dr): q, cache and out F32. -------
// Block (row, head), MLA_F32_T threads. Keys in tiles of MLA_F32_T, one key per thread for the
// score (q from shared memory), online softmax in f32 with expf, then every thread accumulates
// latent dims d = tid, tid + T, ... over the tile's keys. Straightforward on purpose: it serves
// small models and the golden fixtures, where exactness matters and speed does not.
#define MLA_F32_T 128
#define MLA_F32_RPT 16  // latent dims per thread: r <= 2048

extern "C" __global__ void __launch_bounds__(MLA_F32_T) mla_attend_f32(
    const float* __restrict__ q, const float* __restrict__ cache, const int* __restrict__ block_table, int max_pages,
    const int* __restrict__ row_seq, const int* __restrict__ row_pos, const int* __restrict__ sel_idx,
    const int* __restrict__ sel_count, int sel_k, int nh, int r, int dr, float scale, float* __restrict__ out) {
    extern __shared__ float fs[];
    float* qs = fs;                                                        // [W]
    float* ps = qs + r + dr;                                               // [T]
    long long* off = reinterpret_cast<long long*>(ps + MLA_F32_T + 2);     // [T] (8-byte aligned: W even)
    __shared__ float scratch[32];
    const int i = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, w = r + dr;
    const float* qr = q + ((long long)i * nh + h) * w;
    for (int d = tid; d < w; d += MLA_F32_T) qs[d] = qr[d];
    const int nkeys = sel_idx ? sel_count[i] : row_pos[i] + 1;
    const long long seq_base = (long long)row_seq[i] * max_pages;
    float acc[MLA_F32_RPT];
#pragma unroll
    for (int j = 0; j < MLA_F32_RPT; j++) acc[j] = 0.0f;
    float m = -K3_INF, l = 0.0f;
    __syncthreads();
    for (int t0 = 0; t0 < nkeys; t0 += MLA_F32_T) {
        const int t = t0 + tid;
        float s = -K3_INF;
        long long o = -1;
        if (t < nkeys) {
            const int pos = sel_idx ? sel_idx[(long long)i * sel_k + t] : t;
            const int page = block_table[seq_base + pos / MLA_PAGE];
            o = ((long long)page * MLA_PAGE + pos % MLA_PAGE) * w;
            float a = 0.0f;
            for (int d = 0; d < w; d++) a = fmaf(qs[d], cache[o + d], a);
            s = a * scale;
        }
        off[tid] = o;
        const float m_new = fmaxf(m, block_max(s, scratch));
        const float p = (t < nkeys) ? expf(s - m_new) : 0.0f;
        ps[tid] = p;
        const float alpha = expf(m - m_new);  // m = -inf on the first tile: alpha = 0, acc = 0
        l = l * alpha + block_sum(p, scratch);
        m = m_new;
        __syncthreads();
        const int tc = min(MLA_F32_T, nkeys - t0);
#pragma unroll
        for (int j = 0; j < MLA_F32_RPT; j++) {
            const int d = tid + j * MLA_F32_T;
            if (d < r) {
                float a = acc[j] * alpha;
                for (int k = 0; k < tc; k++) a = fmaf(ps[k], cache[off[k] + d], a);
                acc[j] = a;
            }
        }
        __syncthreads();
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    float* orow = out + ((long long)i * nh + h) * r;
#pragma unroll
    for (int j = 0; j < MLA_F32_RPT; j++) {
        const int d = tid + j * MLA_F32_T;
        if (d < r) orow[d] = acc[j] * inv;
    }
}
