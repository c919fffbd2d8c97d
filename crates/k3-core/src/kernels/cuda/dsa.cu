// dsa.cu: K3.1's lightning indexer and top-k selection (text-backbone §5.3–5.6; CPU oracle:
// k3-model layers/dsa.rs `index_scores`, `select_topk`). Shapes: N packed rows, ih index
// heads, id index dim; key cache F32 [num_pages, PAGE=64, id]; q F32 [N, ih, id]; a F32
// [N, ih] (already scaled); scores F32 [N, L]; block_table I32 [B, max_pages]; row_seq /
// row_pos I32 [N]; idx I32 [N, k]; count I32 [N].
//
// Top-k is a multi-block radix select over the unique key (ordered score << pb | pos, pb = bits(L-1)):
// per 11-bit digit, `dsa_topk_pass` (many blocks per row, shared-memory histogram, global
// atomics; the last block to finish finds the digit holding the k-th largest key).
// (`dsa_topk_hist` + `dsa_topk_select` are the same pass as two launches.) The exact k-th key T is known after all 32 + pb bits; then
// `dsa_topk_count` counts keys >= T per block and `dsa_topk_write` writes their positions in
// increasing order (block offsets from the counts, ballot scan inside a block).

#define DSA_PAGE 64
#define DSA_KEYS 128
#define DSA_BINS 2048

extern "C" __global__ void dsa_zero_i32(int* p, long long n) {
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x) p[j] = 0;
}

template <typename T>
__device__ __forceinline__ void index_key_append_row(const T* __restrict__ k, const float* __restrict__ lw, const float* __restrict__ lb,
                                                     float eps, const int* __restrict__ bt, int mp, const int* __restrict__ rs,
                                                     const int* __restrict__ rp, float* __restrict__ kc, int id) {
    __shared__ float scratch[32];
    const int i = blockIdx.x;
    const T* x = k + (long long)i * id;
    float s = 0.0f;
    for (int d = threadIdx.x; d < id; d += blockDim.x) s += ld(x, d);
    const float mu = block_sum(s, scratch) / (float)id;
    float v2 = 0.0f;
    for (int d = threadIdx.x; d < id; d += blockDim.x) {
        float c = ld(x, d) - mu;
        v2 += c * c;
    }
    const float var = block_sum(v2, scratch) / (float)id;
    const float inv = 1.0f / sqrtf(var + eps);
    const int pos = rp[i];
    const int page = bt[(long long)rs[i] * mp + pos / DSA_PAGE];
    float* dst = kc + ((long long)page * DSA_PAGE + pos % DSA_PAGE) * id;
    for (int d = threadIdx.x; d < id; d += blockDim.x) dst[d] = (ld(x, d) - mu) * inv * lw[d] + lb[d];
}

extern "C" __global__ void index_key_append_f32(const float* k, const float* lw, const float* lb, float eps, const int* bt, int mp,
                                                const int* rs, const int* rp, float* kc, int id) {
    index_key_append_row<float>(k, lw, lb, eps, bt, mp, rs, rp, kc, id);
}
extern "C" __global__ void index_key_append_bf16(const bf16_t* k, const float* lw, const float* lb, float eps, const int* bt, int mp,
                                                 const int* rs, const int* rp, float* kc, int id) {
    index_key_append_row<bf16_t>(k, lw, lb, eps, bt, mp, rs, rp, kc, id);
}

// FP8 key cache (k3-core fp8.rs `KeyFp8`): row of `kb` bytes = e4m3 [id] | f32 scales
// [ceil(id/128)] | zeros to 4 B. One block of exactly 128 threads per row (value 128 j + t).
template <typename T>
__device__ __forceinline__ void index_key_append_fp8_row(const T* __restrict__ k, const float* __restrict__ lw, const float* __restrict__ lb,
                                                         float eps, const int* __restrict__ bt, int mp, const int* __restrict__ rs,
                                                         const int* __restrict__ rp, unsigned char* __restrict__ kc, int id, int kb) {
    __shared__ float scratch[32];
    const int i = blockIdx.x, tid = threadIdx.x;
    const T* x = k + (long long)i * id;
    float s = 0.0f;
    for (int d = tid; d < id; d += blockDim.x) s += ld(x, d);
    const float mu = block_sum(s, scratch) / (float)id;
    float v2 = 0.0f;
    for (int d = tid; d < id; d += blockDim.x) {
        float c = ld(x, d) - mu;
        v2 += c * c;
    }
    const float var = block_sum(v2, scratch) / (float)id;
    const float inv = 1.0f / sqrtf(var + eps);
    const int pos = rp[i];
    const int page = bt[(long long)rs[i] * mp + pos / DSA_PAGE];
    unsigned char* dst = kc + ((long long)page * DSA_PAGE + pos % DSA_PAGE) * kb;
    const int tiles = (id + 127) / 128;
    for (int j = 0; j < tiles; j++) {
        const int d = 128 * j + tid;
        const float v = d < id ? (ld(x, d) - mu) * inv * lw[d] + lb[d] : 0.0f;
        const float sc = e4m3_tile_scale(block_max(fabsf(v), scratch));
        if (d < id) dst[d] = f32_to_e4m3(v * (1.0f / sc));
        if (tid == 0) *reinterpret_cast<float*>(dst + id + 4 * j) = sc;
    }
    for (int b = id + 4 * tiles + tid; b < kb; b += blockDim.x) dst[b] = 0;
}

extern "C" __global__ void index_key_append_fp8_f32(const float* k, const float* lw, const float* lb, float eps, const int* bt, int mp,
                                                    const int* rs, const int* rp, unsigned char* kc, int id, int kb) {
    index_key_append_fp8_row<float>(k, lw, lb, eps, bt, mp, rs, rp, kc, id, kb);
}
extern "C" __global__ void index_key_append_fp8_bf16(const bf16_t* k, const float* lw, const float* lb, float eps, const int* bt, int mp,
                                                     const int* rs, const int* rp, unsigned char* kc, int id, int kb) {
    index_key_append_fp8_row<bf16_t>(k, lw, lb, eps, bt, mp, rs, rp, kc, id, kb);
}

// Grid (ceil(L / 128), N), 128 threads, one key per thread. Dynamic smem: keys f32
// [128][id+4] | q f32 [ih][id] | a f32 [ih].
// `kb` > 0: the cache is FP8 rows of kb bytes (decoded to f32 into the same shared tile).
template <bool FP8>
__device__ __forceinline__ void dsa_index_scores_impl(
    const float* __restrict__ q, const float* __restrict__ a, const void* __restrict__ kcv, const int* __restrict__ bt, int mp,
    const int* __restrict__ rs, const int* __restrict__ rp, float* __restrict__ scores, long long L, int ih, int id, int kb) {
    const float* kc = reinterpret_cast<const float*>(kcv);
    const unsigned char* kc8 = reinterpret_cast<const unsigned char*>(kcv);
    extern __shared__ __align__(16) float dsm[];
    const int i = blockIdx.y, tid = threadIdx.x, idp = id + 4;
    const int n = (int)min((long long)rp[i] + 1, L);  // a row never reads past its L scores
    const int s0 = blockIdx.x * DSA_KEYS;
    if (s0 >= n) return;
    float* ks = dsm;
    float* qs = ks + DSA_KEYS * idp;
    float* as = qs + ih * id;
    const long long seq_base = (long long)rs[i] * mp;
    for (int v = tid; v < ih * id / 4; v += DSA_KEYS)
        *reinterpret_cast<float4*>(qs + v * 4) = *reinterpret_cast<const float4*>(q + (long long)i * ih * id + v * 4);
    for (int h = tid; h < ih; h += DSA_KEYS) as[h] = a[(long long)i * ih + h];
    const int iv = id / 4;
    for (int v = tid; v < DSA_KEYS * iv; v += DSA_KEYS) {
        const int t = v / iv, c = (v % iv) * 4, s = s0 + t;
        float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s < n) {
            const int page = bt[seq_base + s / DSA_PAGE];
            const long long row = (long long)page * DSA_PAGE + s % DSA_PAGE;
            if constexpr (FP8) {
                const unsigned char* kr8 = kc8 + row * kb;
                const unsigned b = *reinterpret_cast<const unsigned*>(kr8 + c);
                const float sc = *reinterpret_cast<const float*>(kr8 + id + 4 * (c / 128));
                val = make_float4(e4m3_to_f32(b & 0xffu) * sc, e4m3_to_f32((b >> 8) & 0xffu) * sc, e4m3_to_f32((b >> 16) & 0xffu) * sc,
                                  e4m3_to_f32(b >> 24) * sc);
            } else {
                val = *reinterpret_cast<const float4*>(kc + row * id + c);
            }
        }
        *reinterpret_cast<float4*>(ks + t * idp + c) = val;
    }
    __syncthreads();
    const int s = s0 + tid;
    if (s >= n) return;
    const float* kr = ks + tid * idp;
    float total = 0.0f;
    for (int hb = 0; hb < ih; hb += 32) {
        const int hn = min(32, ih - hb);
        float acc[32];
#pragma unroll
        for (int h = 0; h < 32; h++) acc[h] = 0.0f;
        for (int c = 0; c < id; c += 4) {
            const float4 k4 = *reinterpret_cast<const float4*>(kr + c);
#pragma unroll
            for (int h = 0; h < 32; h++) {
                if (h < hn) {
                    const float4 q4 = *reinterpret_cast<const float4*>(qs + (hb + h) * id + c);
                    acc[h] = fmaf(q4.x, k4.x, fmaf(q4.y, k4.y, fmaf(q4.z, k4.z, fmaf(q4.w, k4.w, acc[h]))));
                }
            }
        }
#pragma unroll
        for (int h = 0; h < 32; h++)
            if (h < hn) total += as[hb + h] * fmaxf(acc[h], 0.0f);
    }
    scores[(long long)i * L + s] = total;
}

extern "C" __global__ void __launch_bounds__(DSA_KEYS) dsa_index_scores(const float* q, const float* a, const float* kc, const int* bt, int mp,
                                                                        const int* rs, const int* rp, float* scores, long long L, int ih, int id) {
    dsa_index_scores_impl<false>(q, a, kc, bt, mp, rs, rp, scores, L, ih, id, 0);
}
extern "C" __global__ void __launch_bounds__(DSA_KEYS) dsa_index_scores_fp8(const float* q, const float* a, const unsigned char* kc, const int* bt,
                                                                            int mp, const int* rs, const int* rp, float* scores, long long L,
                                                                            int ih, int id, int kb) {
    dsa_index_scores_impl<true>(q, a, kc, bt, mp, rs, rp, scores, L, ih, id, kb);
}

// ---- top-k ----

__device__ __forceinline__ unsigned long long dsa_key(float s, int pos, int pb) {
    unsigned int u = __float_as_uint(s);
    if ((u & 0x7fffffffu) == 0u) u = 0u;  // -0.0 ties with +0.0
    const unsigned int o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)o << pb) | (unsigned int)pos;
}

// state per row (u64 x2): [prefix, remaining rank]
extern "C" __global__ void dsa_topk_init(int* hist, unsigned long long* state, int k, int* done) {
    const int i = blockIdx.x;
    if (threadIdx.x == 0) done[i] = 0;
    for (int b = threadIdx.x; b < DSA_BINS; b += blockDim.x) hist[(long long)i * DSA_BINS + b] = 0;
    if (threadIdx.x == 0) {
        state[2 * i] = 0ull;
        state[2 * i + 1] = (unsigned long long)k;
    }
}

extern "C" __global__ void dsa_topk_hist(const float* __restrict__ scores, long long L, const int* __restrict__ rp, int k,
                                         int* __restrict__ hist, const unsigned long long* __restrict__ state, int shift, int width,
                                         int chunk, int pb) {
    __shared__ int sh[DSA_BINS];
    const int i = blockIdx.y;
    const int n = (int)min((long long)rp[i] + 1, L);  // a row never reads past its L scores
    const long long b0 = (long long)blockIdx.x * chunk;
    if (n <= k || b0 >= n) return;
    const int nb = 1 << width;
    for (int b = threadIdx.x; b < nb; b += blockDim.x) sh[b] = 0;
    __syncthreads();
    const int top = shift + width;
    const unsigned long long mask = top >= 64 ? 0ull : (~0ull << top);
    const unsigned long long want = state[2 * i] & mask;
    const long long e = min((long long)n, b0 + chunk);
    const float* row = scores + (long long)i * L;
    for (long long p = b0 + threadIdx.x; p < e; p += blockDim.x) {
        const unsigned long long key = dsa_key(row[p], (int)p, pb);
        if ((key & mask) == want) atomicAdd(&sh[(int)((key >> shift) & (unsigned long long)(nb - 1))], 1);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < nb; b += blockDim.x)
        if (sh[b]) atomicAdd(&hist[(long long)i * DSA_BINS + b], sh[b]);
}

// One block of 1024 threads per row; thread t owns bins nb-1-2t and nb-2-2t (descending order).
extern "C" __global__ void __launch_bounds__(1024) dsa_topk_select(int* __restrict__ hist, unsigned long long* __restrict__ state,
                                                                   const int* __restrict__ rp, int k, int shift, int width) {
    __shared__ int wsum[32];
    const int i = blockIdx.x, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int n = rp[i] + 1;
    if (n <= k) return;
    const int nb = 1 << width;
    int* hr = hist + (long long)i * DSA_BINS;
    const int hi = nb - 1 - 2 * t, lo = hi - 1;
    const int c_hi = hi >= 0 ? hr[hi] : 0, c_lo = lo >= 0 ? hr[lo] : 0;
    const int local = c_hi + c_lo;
    // Every thread reads the remaining rank before the barrier: one thread rewrites it below,
    // and a warp that read it after that write could pick a second digit.
    const long long kk = (long long)state[2 * i + 1];
    int inc = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        int v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int v = wsum[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            int u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        wsum[lane] = v;
    }
    __syncthreads();
    inc += warp > 0 ? wsum[warp - 1] : 0;
    const int excl = inc - local;
    if (local > 0 && excl < kk && kk <= inc) {
        int digit, above;
        if (excl + c_hi >= kk) { digit = hi; above = excl; }
        else { digit = lo; above = excl + c_hi; }
        state[2 * i] |= (unsigned long long)digit << shift;
        state[2 * i + 1] = (unsigned long long)(kk - above);
    }
    __syncthreads();
    if (hi >= 0) hr[hi] = 0;
    if (lo >= 0) hr[lo] = 0;
}

// One radix pass fused with its digit selection: the histogram as in dsa_topk_hist, then the
// last block of the row to finish (threadfence + counter `done[i]`) scans the global
// histogram (256 threads x 8 bins, descending), updates the state, clears the bins and the
// counter for the next pass. Grid (blocks, N), 256 threads.
extern "C" __global__ void __launch_bounds__(256) dsa_topk_pass(const float* __restrict__ scores, long long L, const int* __restrict__ rp,
                                                                int k, int* __restrict__ hist, unsigned long long* __restrict__ state,
                                                                int* __restrict__ done, int shift, int width, int chunk, int pb) {
    __shared__ int sh[DSA_BINS];
    __shared__ int wsum[8];
    __shared__ int last;
    const int i = blockIdx.y, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int n = (int)min((long long)rp[i] + 1, L);  // a row never reads past its L scores
    const int nparts = (n + chunk - 1) / chunk;
    if (n <= k || (int)blockIdx.x >= nparts) return;
    const int nb = 1 << width;
    for (int b = t; b < nb; b += blockDim.x) sh[b] = 0;
    __syncthreads();
    const int top = shift + width;
    const unsigned long long mask = top >= 64 ? 0ull : (~0ull << top);
    const unsigned long long want = state[2 * i] & mask;
    const long long b0 = (long long)blockIdx.x * chunk;
    const long long e = min((long long)n, b0 + chunk);
    const float* row = scores + (long long)i * L;
    for (long long p = b0 + t; p < e; p += blockDim.x) {
        const unsigned long long key = dsa_key(row[p], (int)p, pb);
        if ((key & mask) == want) atomicAdd(&sh[(int)((key >> shift) & (unsigned long long)(nb - 1))], 1);
    }
    __syncthreads();
    int* hr = hist + (long long)i * DSA_BINS;
    for (int b = t; b < nb; b += blockDim.x)
        if (sh[b]) atomicAdd(&hr[b], sh[b]);
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(&done[i], 1) == nparts - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int hi = nb - 1 - 8 * t;
    int c[8], local = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        c[j] = hi - j >= 0 ? __ldcg(&hr[hi - j]) : 0;
        local += c[j];
    }
    const long long kk = (long long)state[2 * i + 1];  // before the barrier, as in dsa_topk_select
    int inc = local;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += v;
    }
    if (lane == 31) wsum[warp] = inc;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < 8; w++) inc += w < warp ? wsum[w] : 0;
    const int excl = inc - local;
    if (local > 0 && excl < kk && kk <= inc) {
        int cum = excl, digit = hi, above = excl;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (cum + c[j] >= kk) { digit = hi - j; above = cum; break; }
            cum += c[j];
        }
        state[2 * i] |= (unsigned long long)digit << shift;
        state[2 * i + 1] = (unsigned long long)(kk - above);
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (hi - j >= 0) hr[hi - j] = 0;
    if (t == 0) done[i] = 0;
}

__device__ __forceinline__ int dsa_block_count(int c, int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if (lane == 0) scratch[warp] = c;
    __syncthreads();
    c = lane < nw ? scratch[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    __syncthreads();
    return c;
}

extern "C" __global__ void dsa_topk_count(const float* __restrict__ scores, long long L, const int* __restrict__ rp, int k,
                                          const unsigned long long* __restrict__ state, int* __restrict__ counts, int nblk, int chunk, int pb) {
    __shared__ int scratch[32];
    const int i = blockIdx.y;
    const int n = (int)min((long long)rp[i] + 1, L);  // a row never reads past its L scores
    const long long b0 = (long long)blockIdx.x * chunk;
    if (n <= k) return;
    const unsigned long long T = state[2 * i];
    const long long e = min((long long)n, b0 + chunk);
    const float* row = scores + (long long)i * L;
    int c = 0;
    for (long long p = b0 + threadIdx.x; p < e; p += blockDim.x) c += dsa_key(row[p], (int)p, pb) >= T;
    c = dsa_block_count(c, scratch);
    if (threadIdx.x == 0) counts[(long long)i * nblk + blockIdx.x] = c;
}

// 256 threads per block.
extern "C" __global__ void dsa_topk_write(const float* __restrict__ scores, long long L, const int* __restrict__ rp, int k,
                                          const unsigned long long* __restrict__ state, const int* __restrict__ counts, int nblk,
                                          int chunk, int* __restrict__ idx, int* __restrict__ count, int pb) {
    __shared__ int scratch[32];
    __shared__ int wtot[8];
    const int i = blockIdx.y, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int n = (int)min((long long)rp[i] + 1, L);  // a row never reads past its L scores
    const long long b0 = (long long)blockIdx.x * chunk;
    const long long e = min((long long)n, b0 + chunk);
    int* out = idx + (long long)i * k;
    if (n <= k) {
        for (long long p = b0 + t; p < e; p += blockDim.x) out[p] = (int)p;
        if (blockIdx.x == 0 && t == 0) count[i] = n;
        return;
    }
    if (blockIdx.x == 0 && t == 0) {
        // k exactly when T is exact; the attend kernels read only `count` entries, so a wrong T
        // can never make them read an unwritten index.
        int tot = 0;
        for (int b = 0; b < nblk; b++) tot += counts[(long long)i * nblk + b];
        count[i] = min(k, tot);
    }
    if (b0 >= n) return;
    int off = 0;
    for (int b = t; b < blockIdx.x; b += blockDim.x) off += counts[(long long)i * nblk + b];
    off = dsa_block_count(off, scratch);
    const unsigned long long T = state[2 * i];
    const float* row = scores + (long long)i * L;
    for (long long base = b0; base < e; base += blockDim.x) {
        const long long p = base + t;
        const bool f = p < e && dsa_key(row[p], (int)p, pb) >= T;
        const unsigned int bal = __ballot_sync(0xffffffffu, f);
        const int before = __popc(bal & ((1u << lane) - 1u));
        if (lane == 0) wtot[warp] = __popc(bal);
        __syncthreads();
        int wo = 0, tot = 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            wo += w < warp ? wtot[w] : 0;
            tot += wtot[w];
        }
        // Exactly k keys are >= T (keys are unique); the bound keeps a wrong T from writing past the row.
        if (f && off + wo + before < k) out[off + wo + before] = (int)p;
        off += tot;
        __syncthreads();
    }
}
