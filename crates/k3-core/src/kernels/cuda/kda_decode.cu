// kda_decode.cu: the KDA decode step (text-backbone §3.8: conv-state shift, §3.2-3.3 gates,
// one step of the §3.4 recurrence, §3.6 output norm and gate), head_dim 128, state f32 in place.
// CPU oracle: kernels/cpu/kda.rs `kda_recurrent` plus k3-model layers/kda.rs.
// Three shapes of the same step (kda.rs `DecodeKernel` picks one):
//  - kda_decode / kda_decode_split{,4,8}: one block (256 threads) per (head, sequence, NS-th of
//    the 128 value columns), NS = 1, 2, 4, 8; for NS > 1 the NS blocks of a head form a cluster
//    and exchange the output RMSNorm's partial sums of squares through distributed shared
//    memory (the columns of S are independent in the recurrence). Small batches: more SMs.
//  - kda_decode_stream: persistent, one block per SM walking (sequence, head) items; a producer
//    thread streams each item's state and inputs into a 3-stage shared-memory ring by bulk copy
//    (TMA) and writes the updated state back the same way. Large batches: bandwidth.
// States live in a pool of S slots: sequence b (input / output row b) uses slot slots[b]
// (device i32 [B], filled before a graph replay); a slot outside [0, S) makes the kernel skip
// that sequence without writing anything. State f32 [S][H][128 k][128 v], conv state bf16
// [S][3 (q,k,v)][3 taps, oldest first][D], raw inputs bf16 [B][D], D = H * 128.

#define KD 128

// One channel's short conv + SiLU (§3.2): weights w (4 taps), the 3 stored raw inputs t0..t2
// (oldest first) and the current raw input x.
__device__ __forceinline__ float conv_silu(float4 w, bf16_t t0, bf16_t t1, bf16_t t2, bf16_t x) {
    return silu_ftz(w.x * bf16_to_f32(t0) + w.y * bf16_to_f32(t1) + w.z * bf16_to_f32(t2) + w.w * bf16_to_f32(x));
}

// The per-channel decay exp(g) with the lower-bounded gate (§3.3).
__device__ __forceinline__ float decay(float lower_bound, float a_log, bf16_t graw, float dt_bias) {
    return exp_ftz(lower_bound * sigmoid_ftz(exp_ftz(a_log) * (bf16_to_f32(graw) + dt_bias)));
}

// Two bf16 taps in one register, and the shifted taps (kept pair, then x) stored at c (stride D).
__device__ __forceinline__ unsigned keep2(bf16_t t1, bf16_t t2) {
    return (unsigned)t1 | ((unsigned)t2 << 16);
}
__device__ __forceinline__ void shift_taps(bf16_t* c, long long D, unsigned k, bf16_t x) {
    c[0] = (bf16_t)(k & 0xffffu);
    c[D] = (bf16_t)(k >> 16);
    c[2 * D] = x;
}

__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ void fma4(float4& a, float k, float4 b) {
    a.x += k * b.x; a.y += k * b.y; a.z += k * b.z; a.w += k * b.w;
}
__device__ __forceinline__ void scale4(float4& a, float e) {
    a.x *= e; a.y *= e; a.z *= e; a.w *= e;
}
__device__ __forceinline__ float4 shfl_xor4(float4 v, int m) {
    return make_float4(__shfl_xor_sync(0xffffffffu, v.x, m), __shfl_xor_sync(0xffffffffu, v.y, m),
                       __shfl_xor_sync(0xffffffffu, v.z, m), __shfl_xor_sync(0xffffffffu, v.w, m));
}

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Stores v at the address of `p` in the shared memory of cluster block `rank`.
__device__ __forceinline__ void st_peer_f32(float* p, unsigned rank, float v) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(r), "f"(v) : "memory");
}

#define DECODE_ARGS                                                                                                   \
    const bf16_t *__restrict__ qr, const bf16_t *__restrict__ kr, const bf16_t *__restrict__ vr,                       \
        const bf16_t *__restrict__ graw, const bf16_t *__restrict__ braw, const bf16_t *__restrict__ gate,             \
        const float *__restrict__ convw, const float *__restrict__ a_log, const float *__restrict__ dt_bias,           \
        const float *__restrict__ onorm_w, bf16_t *__restrict__ conv_state, float *__restrict__ state,                 \
        const int *__restrict__ slots, bf16_t *__restrict__ out, int H, int nslots, float lower_bound, float eps
#define DECODE_PASS qr, kr, vr, graw, braw, gate, convw, a_log, dt_bias, onorm_w, conv_state, state, slots, out, H, nslots, lower_bound, eps

// ------------------------------------------------------------------------------------------
// Column-split decode: block = (head h, sequence b, value columns c0..c0+COLS), 256 threads.
// Conv roles: thread (qk = tid / 128, channel ch = tid % 128): qk 0 = the q channel and its
// decay, qk 1 = the k channel and (ch < COLS) value channel c0 + ch. Recurrence: thread = (row
// group rg of RPT state rows, 4 consecutive columns cg); partial sums over rows are reduced in
// the warp by shuffles, then across the 8 warps in shared memory.
template <int NS>
__device__ __forceinline__ void decode_cols(DECODE_ARGS) {
    constexpr int COLS = KD / NS, CG = COLS / 4 < 32 ? COLS / 4 : 32, RG = 256 / CG, RPT = KD / RG;
    __shared__ float sq[KD], sk[KD], sv[COLS], se[KD], su[COLS], red[8][COLS], misc[16], part[NS];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, cg = tid % CG, rg = tid / CG;
    const int h = blockIdx.x / NS, c0 = (blockIdx.x % NS) * COLS, b = blockIdx.y, D = H * KD;
    const int ch = tid & 127, qk = tid >> 7, vch = c0 + (ch & (COLS - 1)), oc = c0 + (tid & (COLS - 1));
    const long long xo = (long long)b * D + h * KD;

    // Everything that does not depend on the slot is loaded first, overlapping the slot's load.
    const int sl = slots[b];
    const bf16_t xa = (qk ? kr : qr)[xo + ch], xv = vr[xo + vch], gr = graw[xo + ch];
    const float4 wa = ldg4(convw + ((long long)qk * D + h * KD + ch) * 4), wv = ldg4(convw + (2LL * D + h * KD + vch) * 4);
    const float dtb = dt_bias[h * KD + ch], al = a_log[h], bl = bf16_to_f32(braw[(long long)b * H + h]);
    const float gt = bf16_to_f32(gate[xo + oc]), onw = onorm_w[oc];
    if (sl < 0 || sl >= nslots) return;  // uniform over the cluster: its blocks read the same slot

    float4* S = reinterpret_cast<float4*>(state + ((long long)sl * H + h) * (KD * KD) + c0);
    float4 s[RPT];
#pragma unroll
    for (int r = 0; r < RPT; r++) s[r] = __ldcs(&S[(rg * RPT + r) * 32 + cg]);  // streamed: no reuse
    bf16_t* cs = conv_state + (long long)sl * 9 * D + h * KD;
    const bf16_t ta0 = cs[(qk * 3) * (long long)D + ch], ta1 = cs[(qk * 3 + 1) * (long long)D + ch], ta2 = cs[(qk * 3 + 2) * (long long)D + ch];
    const bf16_t tv0 = cs[6LL * D + vch], tv1 = cs[7LL * D + vch], tv2 = cs[8LL * D + vch];

    const unsigned ka = keep2(ta1, ta2), kv = keep2(tv1, tv2);  // the taps that stay, packed
    const float a = conv_silu(wa, ta0, ta1, ta2, xa);
    if (qk == 0) {
        sq[ch] = a;
        se[ch] = decay(lower_bound, al, gr, dtb);
    } else {
        sk[ch] = a;
        if (ch < COLS) sv[ch] = conv_silu(wv, tv0, tv1, tv2, xv);
    }
    const float ss = warp_sum(a * a);
    if (lane == 0) misc[wp] = ss;  // [0, 4): q, [4, 8): k
    __syncthreads();
    const float qi = 0.08838834764831845f / sqrtf(misc[0] + misc[1] + misc[2] + misc[3] + 1e-6f);
    const float ki = 1.0f / sqrtf(misc[4] + misc[5] + misc[6] + misc[7] + 1e-6f);
    const float beta = sigmoid_ftz(bl);

    // u = beta (v - (e ⊙ S)^T k)
    float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        const int row = rg * RPT + r;
        scale4(s[r], se[row]);
        fma4(p, sk[row] * ki, s[r]);
    }
#pragma unroll
    for (int m = CG; m < 32; m <<= 1) {
        const float4 t = shfl_xor4(p, m);
        p.x += t.x; p.y += t.y; p.z += t.z; p.w += t.w;
    }
    if (lane < CG) *reinterpret_cast<float4*>(&red[wp][4 * cg]) = p;
    __syncthreads();
    if (tid < COLS) {
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc += red[i][tid];
        su[tid] = beta * (sv[tid] - acc);
    }
    __syncthreads();

    // S += k u^T ; o = S^T q
    const float4 u = *reinterpret_cast<const float4*>(&su[4 * cg]);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < RPT; r++) {
        const int row = rg * RPT + r;
        fma4(s[r], sk[row] * ki, u);
        fma4(o, sq[row] * qi, s[r]);
        __stcs(&S[row * 32 + cg], s[r]);
    }
#pragma unroll
    for (int m = CG; m < 32; m <<= 1) {
        const float4 t = shfl_xor4(o, m);
        o.x += t.x; o.y += t.y; o.z += t.z; o.w += t.w;
    }
    if (lane < CG) *reinterpret_cast<float4*>(&red[wp][4 * cg]) = o;
    __syncthreads();
    float ov = 0.0f;
    if (tid < COLS)
#pragma unroll
        for (int i = 0; i < 8; i++) ov += red[i][tid];
    if (wp == 0 || tid < COLS) {
        const float sw = warp_sum(ov * ov);
        if (lane == 0) misc[8 + wp] = sw;
    }
    __syncthreads();
    float tot;
    if constexpr (NS == 1) {
        tot = misc[8] + misc[9] + misc[10] + misc[11];
    } else {
        // Every block pushes its partial into part[its rank] of every block of the cluster; after
        // the barrier all reads are local, so no block touches a peer's memory once it passed.
        // The barrier also orders every block's reads of the old conv taps before the writes below.
        if (tid < NS) st_peer_f32(&part[cluster_rank()], tid, COLS > 32 ? misc[8] + misc[9] : misc[8]);
        cluster_sync_all();
        tot = 0.0f;
#pragma unroll
        for (int i = 0; i < NS; i++) tot += part[i];
    }
    if (tid < COLS) {
        const float inv = 1.0f / sqrtf(tot * (1.0f / KD) + eps);
        out[xo + oc] = f32_to_bf16(ov * inv * onw * sigmoid_ftz(gt));
    }
    // Shifted conv taps: q / k channel ch by the block whose columns hold it, v by its owner.
    if (ch >= c0 && ch < c0 + COLS) shift_taps(cs + (qk * 3) * (long long)D + ch, D, ka, xa);
    if (qk == 1 && ch < COLS) shift_taps(cs + 6LL * D + vch, D, kv, xv);
}

// Grid (H, B): the whole state of a head in one block.
extern "C" __global__ void __launch_bounds__(256) kda_decode(DECODE_ARGS) { decode_cols<1>(DECODE_PASS); }
// Grid (NS·H, B), clusters of NS along x.
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(256, 3) kda_decode_split(DECODE_ARGS) { decode_cols<2>(DECODE_PASS); }
extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(256, 4) kda_decode_split4(DECODE_ARGS) { decode_cols<4>(DECODE_PASS); }
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256, 4) kda_decode_split8(DECODE_ARGS) { decode_cols<8>(DECODE_PASS); }

// ------------------------------------------------------------------------------------------
// Streaming decode: persistent, grid = min(B·H, SMs) blocks of 288 threads; block i walks the
// items j·gridDim.x + i (item = b·H + h). Warp 8's lane 0 is the producer: it fills stage
// j % 3 of the ring with item j's state (64 KB) and inputs by bulk copy (completing on full[s]),
// and once the 256 compute threads have arrived on done[s], stores the updated state back by
// bulk copy and refills the stage with item j + 3. Per stage (bytes):
#define DS_CS 65536  // after the state [128][128] f32: conv taps [3 (q,k,v)][3][128] bf16
#define DS_X 67840   // raw q, k, v [3][128] bf16
#define DS_G 68608   // raw gate g [128] bf16
#define DS_OG 68864  // output gate [128] bf16
#define DS_CW 69120  // conv weights [3][128][4] f32 (reused for the cross-warp sums once read)
#define DS_DT 75264  // dt_bias [128] f32
#define DS_STAGE 75776
#define DS_NST 3
// + full/done barriers, sq sk sv se su [128] f32, misc [16] f32, per-stage slot / beta / a_log.
#define DS_SMEM_BYTES (DS_NST * DS_STAGE + 2 * DS_NST * 8 + 5 * KD * 4 + 16 * 4 + 3 * DS_NST * 4)

// The 256 compute threads' barrier (the producer warp never joins it).
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

extern "C" __global__ void __launch_bounds__(288, 1) kda_decode_stream(DECODE_ARGS, int nitems) {
    extern __shared__ __align__(128) unsigned char sm[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(sm + DS_NST * DS_STAGE);
    unsigned long long* done = full + DS_NST;
    float* sq = reinterpret_cast<float*>(done + DS_NST);
    float *sk = sq + KD, *sv = sk + KD, *se = sv + KD, *su = se + KD, *misc = su + KD;
    int* sslot = reinterpret_cast<int*>(misc + 16);
    float *sbeta = reinterpret_cast<float*>(sslot + DS_NST), *salog = sbeta + DS_NST;
    const int tid = threadIdx.x, D = H * KD;
    const int n = (nitems - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // items of this block
    if (tid == 0) {
        for (int i = 0; i < DS_NST; i++) {
            mbar_init(&full[i], 1);
            mbar_init(&done[i], 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (tid >= 256) {  // ---- producer
        if (tid != 256) return;
        auto issue = [&](int j, int sl) {
            const int it = blockIdx.x + j * gridDim.x, b = it / H, h = it - b * H, s = j % DS_NST;
            unsigned char* st = sm + s * DS_STAGE;
            sslot[s] = sl;
            sbeta[s] = bf16_to_f32(braw[it]);
            salog[s] = a_log[h];
            if (sl < 0 || sl >= nslots) {
                mbar_arrive(&full[s]);
                return;
            }
            unsigned long long* bar = &full[s];
            mbar_expect_tx(bar, DS_STAGE);
            const unsigned char* Sg = reinterpret_cast<const unsigned char*>(state + ((long long)sl * H + h) * (KD * KD));
#pragma unroll
            for (int i = 0; i < 4; i++) bulk_g2s(st + i * 16384, Sg + i * 16384, 16384, bar);
            const bf16_t* cs = conv_state + (long long)sl * 9 * D + h * KD;
#pragma unroll
            for (int i = 0; i < 9; i++) bulk_g2s(st + DS_CS + i * 256, cs + (long long)i * D, 256, bar);
            const long long xo = (long long)b * D + h * KD;
            bulk_g2s(st + DS_X, qr + xo, 256, bar);
            bulk_g2s(st + DS_X + 256, kr + xo, 256, bar);
            bulk_g2s(st + DS_X + 512, vr + xo, 256, bar);
            bulk_g2s(st + DS_G, graw + xo, 256, bar);
            bulk_g2s(st + DS_OG, gate + xo, 256, bar);
#pragma unroll
            for (int w = 0; w < 3; w++) bulk_g2s(st + DS_CW + w * 2048, convw + ((long long)w * D + h * KD) * 4, 2048, bar);
            bulk_g2s(st + DS_DT, dt_bias + h * KD, 512, bar);
        };
        const int pro = n < DS_NST ? n : DS_NST;
        for (int j = 0; j < pro; j++) issue(j, slots[(blockIdx.x + j * gridDim.x) / H]);
        for (int j = 0; j < n; j++) {
            const int s = j % DS_NST, it = blockIdx.x + j * gridDim.x;
            // The slot of the item that refills this stage, loaded while the stage is in use.
            const int nsl = j + DS_NST < n ? slots[(it + DS_NST * gridDim.x) / H] : 0;
            mbar_wait(&done[s], (j / DS_NST) & 1);
            const int sl = sslot[s];
            if (sl >= 0 && sl < nslots) {
                unsigned char* Sg = reinterpret_cast<unsigned char*>(state + ((long long)sl * H + it % H) * (KD * KD));
#pragma unroll
                for (int i = 0; i < 4; i++) bulk_s2g(Sg + i * 16384, sm + s * DS_STAGE + i * 16384, 16384);
                bulk_commit();
            }
            if (j + DS_NST < n) {
                bulk_wait_read<0>();  // the stage's state has left shared memory
                issue(j + DS_NST, nsl);
            }
        }
        bulk_wait_all();
        return;
    }

    // ---- compute: conv roles as in decode_cols (qk = tid / 128, channel ch); recurrence thread =
    // (warp wp: state rows 16wp..16wp+15, lane: columns 4·lane..4·lane+3).
    const int lane = tid & 31, wp = tid >> 5, ch = tid & 127, qk = tid >> 7;
    const float onw = onorm_w[ch];
    for (int j = 0; j < n; j++) {
        const int s = j % DS_NST, it = blockIdx.x + j * gridDim.x, h = it % H;
        unsigned char* st = sm + s * DS_STAGE;
        mbar_wait(&full[s], (j / DS_NST) & 1);
        const int sl = sslot[s];
        if (sl >= 0 && sl < nslots) {
            const bf16_t* cs = reinterpret_cast<const bf16_t*>(st + DS_CS);
            const bf16_t* x = reinterpret_cast<const bf16_t*>(st + DS_X);
            const float4* cw = reinterpret_cast<const float4*>(st + DS_CW);
            bf16_t* gcs = conv_state + (long long)sl * 9 * D + h * KD;
            const float a = conv_silu(cw[qk * KD + ch], cs[(qk * 3) * KD + ch], cs[(qk * 3 + 1) * KD + ch], cs[(qk * 3 + 2) * KD + ch], x[qk * KD + ch]);
            shift_taps(gcs + (qk * 3) * (long long)D + ch, D, keep2(cs[(qk * 3 + 1) * KD + ch], cs[(qk * 3 + 2) * KD + ch]), x[qk * KD + ch]);
            if (qk == 0) {
                sq[ch] = a;
                se[ch] = decay(lower_bound, salog[s], reinterpret_cast<const bf16_t*>(st + DS_G)[ch], reinterpret_cast<const float*>(st + DS_DT)[ch]);
            } else {
                sk[ch] = a;
                sv[ch] = conv_silu(cw[2 * KD + ch], cs[6 * KD + ch], cs[7 * KD + ch], cs[8 * KD + ch], x[2 * KD + ch]);
                shift_taps(gcs + 6LL * D + ch, D, keep2(cs[7 * KD + ch], cs[8 * KD + ch]), x[2 * KD + ch]);
            }
            const float ss = warp_sum(a * a);
            if (lane == 0) misc[wp] = ss;
            compute_sync();
            const float qi = 0.08838834764831845f / sqrtf(misc[0] + misc[1] + misc[2] + misc[3] + 1e-6f);
            const float ki = 1.0f / sqrtf(misc[4] + misc[5] + misc[6] + misc[7] + 1e-6f);
            const float beta = sigmoid_ftz(sbeta[s]);
            float4* S = reinterpret_cast<float4*>(st);
            float (*red)[KD] = reinterpret_cast<float (*)[KD]>(st + DS_CW);  // [8][128]
            float4 r4[16];
            float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int r = 0; r < 16; r++) {
                const int row = wp * 16 + r;
                r4[r] = S[row * 32 + lane];
                scale4(r4[r], se[row]);
                fma4(p, sk[row] * ki, r4[r]);
            }
            *reinterpret_cast<float4*>(&red[wp][4 * lane]) = p;
            compute_sync();
            if (tid < KD) {
                float acc = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) acc += red[i][tid];
                su[tid] = beta * (sv[tid] - acc);
            }
            compute_sync();
            const float4 u = *reinterpret_cast<const float4*>(&su[4 * lane]);
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int r = 0; r < 16; r++) {
                const int row = wp * 16 + r;
                fma4(r4[r], sk[row] * ki, u);
                fma4(o, sq[row] * qi, r4[r]);
                S[row * 32 + lane] = r4[r];
            }
            *reinterpret_cast<float4*>(&red[wp][4 * lane]) = o;
            fence_async_smem();  // the state tile is read next by the producer's bulk store
            compute_sync();
            float ov = 0.0f;
            if (tid < KD) {
#pragma unroll
                for (int i = 0; i < 8; i++) ov += red[i][tid];
                const float sw = warp_sum(ov * ov);
                if (lane == 0) misc[8 + wp] = sw;
            }
            compute_sync();
            if (tid < KD) {
                const float inv = 1.0f / sqrtf((misc[8] + misc[9] + misc[10] + misc[11]) * (1.0f / KD) + eps);
                const float gt = bf16_to_f32(reinterpret_cast<const bf16_t*>(st + DS_OG)[tid]);
                out[(long long)(it / H) * D + h * KD + tid] = f32_to_bf16(ov * inv * onw * sigmoid_ftz(gt));
            }
        }
        mbar_arrive(&done[s]);
    }
}
