// sample.cu: token sampling on the device, one row of logits per thread block (CPU oracle:
// k3-engine `sampler.rs`, whose order this follows: penalties -> grammar mask -> greedy, or
// temperature -> top-k -> top-p -> min-p -> draw; logprobs from the raw logits). The uniform
// draw `u` comes from the host (the sequence's seeded generator), so with the same `u` the
// device picks the CPU sampler's token except where float rounding moves a boundary.
//
//   sample_prep      work = logits with the grammar mask applied (-inf where refused)
//   sample_penalize  repetition / presence / frequency penalties on work (sparse, one entry
//                    per distinct token of prompt + output, with its count in the output),
//                    then the logit bias (sparse (token, bias) entries) added
//   sample_rows      per row: raw log-sum-exp, greedy argmax, or the filtered distribution
//                    and the draw; the token's raw logprob and the top-n raw logprobs
//
// The kept set of the filters is a prefix of the order (p desc, index asc): its size K is
// min(top_k, K_p, K_m) (at least 1), found by bisection on the bits of p (p >= 0, so the
// bits order like the values) over a candidate list: the elements with p >= pmax * 2^-3(j+1)
// for the smallest j whose candidates decide the filters and fit in shared memory, else the
// whole row in global memory. Sums are f64 with a fixed reduction tree (deterministic).
// Shapes: logits, work F32 [B, V]; rows [B]; out [B].

#define SAMPLE_CAP 4096
#define SAMPLE_LEVELS 8
#define SAMPLE_TOPN 20
#define SAMPLE_NONE 0x7fffffff

struct SampleRow {  // 64 bytes; mirrors k3_core::cuda::sample::SampleRow
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    float rep;
    float pres;
    float freq;
    float u;
    int n_logprobs;
    int pen_off;
    int pen_len;
    int mask_off;  // -1: no mask
    int mask_words;
    int bias_off;  // logit-bias pairs (token, f32 bits) in pens
    int bias_len;
    int pad0;
};

struct SampleOut {  // 168 bytes; mirrors k3_core::cuda::sample::SampleOut
    int token;
    float logprob;
    int top_ids[SAMPLE_TOPN];
    float top_lps[SAMPLE_TOPN];
};

extern "C" __global__ void sample_prep(const float* logits, float* work, const SampleRow* rows, const unsigned* masks, int V) {
    const int r = blockIdx.y;
    const int mo = rows[r].mask_off, mw = rows[r].mask_words;
    const long long base = (long long)r * V;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < V; i += gridDim.x * blockDim.x) {
        float v = logits[base + i];
        if (mo >= 0) {
            const int w = i >> 5;
            const unsigned word = w < mw ? masks[mo + w] : 0u;
            if (!((word >> (i & 31)) & 1u)) v = -K3_INF;
        }
        work[base + i] = v;
    }
}

extern "C" __global__ void sample_penalize(float* work, const SampleRow* rows, const unsigned* pens, int V) {
    const SampleRow R = rows[blockIdx.x];
    float* w = work + (long long)blockIdx.x * V;
    for (int j = threadIdx.x; j < R.pen_len; j += blockDim.x) {
        const unsigned t = pens[2 * (R.pen_off + j)], c = pens[2 * (R.pen_off + j) + 1];
        if (t >= (unsigned)V) continue;
        float l = w[t];
        if (R.rep != 1.0f) l = l > 0.0f ? l / R.rep : l * R.rep;
        if (c > 0) l -= R.pres + R.freq * (float)c;
        w[t] = l;
    }
    if (R.bias_len == 0) return;  // uniform over the block
    __syncthreads();               // a biased token may also be a penalized one
    for (int j = threadIdx.x; j < R.bias_len; j += blockDim.x) {
        const unsigned t = pens[2 * (R.bias_off + j)];
        if (t < (unsigned)V) w[t] += __uint_as_float(pens[2 * (R.bias_off + j) + 1]);
    }
}

// ---- block helpers beside common.cuh's (blockDim.x a multiple of 32; every thread gets the result) ----

// (value, index): the larger value wins, the lower index on equal values; NaN never wins.
__device__ __forceinline__ bool s_better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ void s_block_argmax(float& bv, int& bi, float* shv, int* shi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (s_better(v, i, bv, bi)) bv = v, bi = i;
    }
    if (lane == 0) shv[warp] = bv, shi[warp] = bi;
    __syncthreads();
    bv = lane < nw ? shv[lane] : -K3_INF;
    bi = lane < nw ? shi[lane] : SAMPLE_NONE;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (s_better(v, i, bv, bi)) bv = v, bi = i;
    }
    __syncthreads();
}

// Exclusive prefix sum over the block in thread order; `total` gets the sum. `sh` holds 33.
template <typename T>
__device__ __forceinline__ T s_block_scan(T v, T* sh, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) sh[warp] = x;
    __syncthreads();
    if (warp == 0) {
        const T w = lane < nw ? sh[lane] : (T)0;
        T wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= o) wi += y;
        }
        sh[lane] = wi - w;
        if (lane == 31) sh[32] = wi;
    }
    __syncthreads();
    const T out = sh[warp] + x - v;
    total = sh[32];
    __syncthreads();
    return out;
}

// ---- candidate lists: n elements in index order; p(k) the probability, idx(k) the token ----

struct RowList {  // the whole row, probabilities in global memory
    const float* w;
    int n;
    __device__ __forceinline__ float p(int k) const { return w[k]; }
    __device__ __forceinline__ int idx(int k) const { return k; }
};

struct SharedList {  // the candidates, compacted into shared memory
    const float* cp;
    const int* ci;
    int n;
    __device__ __forceinline__ float p(int k) const { return cp[k]; }
    __device__ __forceinline__ int idx(int k) const { return ci[k]; }
};

struct Shared {
    double d[33];
    int i[33];
    float f[33];
};

// Sum of p (count) over the elements whose bits are >= b (gt: > b).
template <typename L>
__device__ double s_mass(const L& l, unsigned b, bool gt, Shared& sh) {
    double s = 0.0;
    for (int k = threadIdx.x; k < l.n; k += blockDim.x) {
        const float p = l.p(k);
        const unsigned pb = __float_as_uint(p);
        if (gt ? pb > b : pb >= b) s += (double)p;
    }
    return block_sum(s, sh.d);
}

template <typename L>
__device__ int s_count(const L& l, unsigned b, int mode, Shared& sh) {  // mode 0: >=, 1: >, 2: ==
    int c = 0;
    for (int k = threadIdx.x; k < l.n; k += blockDim.x) {
        const unsigned pb = __float_as_uint(l.p(k));
        c += mode == 0 ? pb >= b : mode == 1 ? pb > b : pb == b;
    }
    return block_sum(c, sh.i);
}

// The filters' kept set on list `l`: bits `vk` of the K-th value and how many elements equal to
// it are kept (the first ones in index order).
template <typename L>
__device__ void s_select(const L& l, const SampleRow& R, float pmax, unsigned& vk, int& keep_ties, Shared& sh) {
    const unsigned top = __float_as_uint(pmax);
    int K = l.n;
    if (R.top_k > 0 && R.top_k < K) K = R.top_k;
    bool from_p = false;
    unsigned vp = 0;
    int mp = 0;
    if (R.top_p < 1.0f && s_mass(l, 0u, false, sh) >= (double)R.top_p) {
        // The largest b with mass(p >= b) >= top_p is the value where the sorted sum crosses.
        unsigned lo = 0, hi = top;
        while (lo < hi) {
            const unsigned mid = lo + (hi - lo + 1) / 2;
            if (s_mass(l, mid, false, sh) >= (double)R.top_p) lo = mid;
            else hi = mid - 1;
        }
        const int cgt = s_count(l, lo, 1, sh), ties = s_count(l, lo, 2, sh);
        const double sgt = s_mass(l, lo, true, sh);
        const float v = __uint_as_float(lo);
        int m = ties;
        if (v > 0.0f) m = min(ties, max(1, (int)ceil(((double)R.top_p - sgt) / (double)v)));
        if (cgt + m < K) K = cgt + m, from_p = true;
        vp = lo, mp = m;
    }
    if (R.min_p > 0.0f) {
        const int km = s_count(l, __float_as_uint(R.min_p * pmax), 0, sh);
        if (km < K) K = km, from_p = false;
    }
    K = max(K, 1);
    if (from_p) {
        vk = vp, keep_ties = mp;
        return;
    }
    if (K >= l.n) {
        vk = 0, keep_ties = SAMPLE_NONE;
        return;
    }
    unsigned lo = 0, hi = top;
    while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        if (s_count(l, mid, 0, sh) >= K) lo = mid;
        else hi = mid - 1;
    }
    vk = lo;
    keep_ties = K - s_count(l, lo, 1, sh);
}

// The draw: the first kept element (index order) with p > 0 whose inclusive prefix sum of kept
// p exceeds u * (kept total), as the CPU sampler walks it; `fallback` when rounding finds none.
// Each thread owns a contiguous chunk of the list, so thread order is index order.
template <typename L>
__device__ int s_draw(const L& l, unsigned vk, int keep_ties, float u, int fallback, Shared& sh, int* pick) {
    const int C = (l.n + blockDim.x - 1) / blockDim.x;
    const int a = min(l.n, (int)threadIdx.x * C), b = min(l.n, a + C);
    int ties = 0;
    for (int k = a; k < b; ++k) ties += __float_as_uint(l.p(k)) == vk;
    int all_ties;
    const int tb = s_block_scan(ties, sh.i, all_ties);
    double ls = 0.0;
    int tr = tb;
    for (int k = a; k < b; ++k) {
        const float p = l.p(k);
        const unsigned pb = __float_as_uint(p);
        if (pb > vk || (pb == vk && tr++ < keep_ties)) ls += (double)p;
    }
    double total;
    const double base = s_block_scan(ls, sh.d, total);
    const double target = (double)u * total;
    if (threadIdx.x == 0) *pick = SAMPLE_NONE;
    __syncthreads();
    if (ls > 0.0 && base <= target && target < base + ls) {
        double acc = base;
        int last = SAMPLE_NONE;
        tr = tb;
        for (int k = a; k < b; ++k) {
            const float p = l.p(k);
            const unsigned pb = __float_as_uint(p);
            if ((pb > vk || (pb == vk && tr++ < keep_ties)) && p > 0.0f) {
                acc += (double)p;
                last = l.idx(k);
                if (acc > target) break;
            }
        }
        if (last != SAMPLE_NONE) atomicMin(pick, last);
    }
    __syncthreads();
    const int t = *pick;
    __syncthreads();
    return t == SAMPLE_NONE ? fallback : t;
}

// One row per block (blockDim.x = 1024). `work` holds the penalised, masked logits on entry and
// the probabilities of a sampled row on exit.
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* logits, float* work, const SampleRow* rows, SampleOut* out, int V) {
    __shared__ Shared sh;
    __shared__ float cand_p[SAMPLE_CAP];
    __shared__ int cand_i[SAMPLE_CAP];
    __shared__ int pick;
    const SampleRow R = rows[blockIdx.x];
    const float* x = logits + (long long)blockIdx.x * V;
    float* w = work + (long long)blockIdx.x * V;
    SampleOut* o = out + blockIdx.x;
    const int tid = threadIdx.x, nt = blockDim.x;

    // The raw maximum (logprobs) and the greedy pick (penalised, masked).
    float mx = -K3_INF, bv = -K3_INF;
    int bi = SAMPLE_NONE;
    for (int i = tid; i < V; i += nt) {
        mx = fmaxf(mx, x[i]);
        const float v = w[i];
        if (s_better(v, i, bv, bi)) bv = v, bi = i;
    }
    mx = block_max(mx, sh.f);
    s_block_argmax(bv, bi, sh.f, sh.i);
    const int greedy = (bv == -K3_INF || bi == SAMPLE_NONE) ? 0 : bi;
    const bool draw = R.temperature > 0.0f && bv > -K3_INF;
    const float T = R.temperature;
    const float ms = draw ? bv / T : 0.0f;  // the largest scaled logit

    double z = 0.0, zs = 0.0;
    for (int i = tid; i < V; i += nt) {
        z += exp((double)(x[i] - mx));
        if (draw) zs += exp((double)(w[i] / T - ms));
    }
    z = block_sum(z, sh.d);
    zs = block_sum(zs, sh.d);
    const float lse = mx + (float)log(z);

    int tok = greedy;
    if (draw) {
        const float lses = ms + (float)log(zs);
        const float pmax = expf(ms - lses);
        const bool filt = (R.top_k > 0 && R.top_k < V) || R.top_p < 1.0f || R.min_p > 0.0f;
        float cut[SAMPLE_LEVELS];
        int cnt[SAMPLE_LEVELS];
        double mass[SAMPLE_LEVELS];
#pragma unroll
        for (int j = 0; j < SAMPLE_LEVELS; ++j) cut[j] = pmax * exp2f(-3.0f * (float)(j + 1)), cnt[j] = 0, mass[j] = 0.0;
        const int C = (V + nt - 1) / nt;
        const int a = min(V, tid * C), b = min(V, a + C);
        for (int i = a; i < b; ++i) {
            const float p = expf(w[i] / T - lses);
            w[i] = p;
            if (filt) {
#pragma unroll
                for (int j = 0; j < SAMPLE_LEVELS; ++j)
                    if (p >= cut[j]) cnt[j] += 1, mass[j] += (double)p;
            }
        }
        __syncthreads();
        unsigned vk = 0;
        int keep_ties = SAMPLE_NONE;
        if (!filt) {
            tok = s_draw(RowList{w, V}, vk, keep_ties, R.u, greedy, sh, &pick);
        } else {
            // The fewest candidates that decide the filters and fit in shared memory.
            int js = -1, nc = 0, lc = 0;
#pragma unroll
            for (int j = 0; j < SAMPLE_LEVELS; ++j) {
                const int c = block_sum(cnt[j], sh.i);
                const double m = block_sum(mass[j], sh.d);
                if (js < 0 && c <= SAMPLE_CAP) {
                    const bool decided = (R.top_k > 0 && R.top_k < V && c >= R.top_k) || (R.top_p < 1.0f && m >= (double)R.top_p) ||
                                         (R.min_p > 0.0f && R.min_p * pmax >= cut[j]);
                    if (decided) js = j, nc = c, lc = cnt[j];
                }
            }
            if (js >= 0) {
                const float c = pmax * exp2f(-3.0f * (float)(js + 1));
                int total;
                int off = s_block_scan(lc, sh.i, total);
                for (int i = a; i < b; ++i) {
                    const float p = w[i];
                    if (p >= c) cand_p[off] = p, cand_i[off] = i, ++off;
                }
                __syncthreads();
                const SharedList l{cand_p, cand_i, nc};
                s_select(l, R, pmax, vk, keep_ties, sh);
                tok = s_draw(l, vk, keep_ties, R.u, greedy, sh, &pick);
            } else {
                const RowList l{w, V};
                s_select(l, R, pmax, vk, keep_ties, sh);
                tok = s_draw(l, vk, keep_ties, R.u, greedy, sh, &pick);
            }
        }
    }
    if (tid == 0) o->token = tok, o->logprob = x[tok] - lse;

    // The top-n raw logprobs: n passes, each the best (value desc, index asc) after the last.
    const int n = min(max(R.n_logprobs, 0), SAMPLE_TOPN);
    float pv = K3_INF;
    int pi = -1, k = 0;
    for (; k < n; ++k) {
        float v2 = -K3_INF;
        int i2 = SAMPLE_NONE;
        for (int i = tid; i < V; i += nt) {
            const float v = x[i];
            if ((v < pv || (v == pv && i > pi)) && s_better(v, i, v2, i2)) v2 = v, i2 = i;
        }
        s_block_argmax(v2, i2, sh.f, sh.i);
        if (i2 == SAMPLE_NONE) break;
        if (tid == 0) o->top_ids[k] = i2, o->top_lps[k] = v2 - lse;
        pv = v2, pi = i2;
    }
    if (tid == 0)
        for (; k < SAMPLE_TOPN; ++k) o->top_ids[k] = -1, o->top_lps[k] = 0.0f;
}
