// kda_general.cu: KDA for any head dim from 1 to 128 (text-backbone
// §3.2-3.8), in the recurrent form, token by token, exactly the spec's normative definition.
// Used by the launchers (cuda/kda.rs) for head dims other than 128 (fixtures 32, k3-nano 64,
// and any other the CPU model runs: 16, 48, ...);
// K3's head dim 128 runs the chunked / fused kernels of kda.cu and kda_decode.cu.
// CPU oracle: kernels/cpu/kda.rs `kda_recurrent` plus k3-model layers/kda.rs.
//
// One block per (sequence, head), R = NT / hd row groups of hd threads (thread = value column
// v, rows rg, rg + R, ...). Shapes (hd = head dim, D = H·hd): raw q, k, v, g, gate bf16 [N, D],
// beta logits bf16 [N, H]; conv weights f32 [3, D, 4]; A_log [H]; dt_bias [D]; o_norm [hd];
// conv state bf16 [S, 3, 3, D] and recurrent state f32 [S, H, hd, hd] (S[k, v]) indexed by the
// sequence's pool slot, both updated in place; out bf16 [N, D]; optional chunk_states
// f32 [chunks, H, hd, hd] (state after every 64-token chunk).
// Sequences: seqs[b] = {tok0, len, chunk0, slot} (prefill), or, when seqs is null, the decode
// form: sequence b is token row b (len 1) and its slot is slots[b]. A slot outside [0, S) makes
// the block return without writing anything.
// kda_general_f32: the same with every bf16 tensor above F32 (the reference precision; any head
// dim 1..128, 128 included). Block: R·hd threads (R = 256 / hd, rounded down). Sums over the hd
// channels run in the first ceil(hd / 32) warps, lanes past hd adding zero. Dynamic shared memory: hd·hd (state)
// + 5·hd + 256 + 16 floats.

#define KG_CHUNK 64

__device__ __forceinline__ float kg_sigm(float x) { return 1.0f / (1.0f + __expf(-x)); }

// T: storage type of the raw inputs, the conv state and the output (bf16_t, or float for the
// F32 reference precision); arithmetic is f32 either way.
__device__ __forceinline__ float kg_f(float x) { return x; }
__device__ __forceinline__ float kg_f(bf16_t x) { return bf16_to_f32(x); }

template <typename T>
__device__ __forceinline__ void kda_general_impl(const T* __restrict__ qr, const T* __restrict__ kr, const T* __restrict__ vr,
            const T* __restrict__ graw, const T* __restrict__ braw, const T* __restrict__ gate,
            const float* __restrict__ convw, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
            const float* __restrict__ onorm_w, T* __restrict__ conv_state, float* __restrict__ state,
            float* __restrict__ chunk_states, const int4* __restrict__ seqs, const int* __restrict__ slots,
            T* __restrict__ out, int H, int hd, int nslots, float lower_bound, float eps) {
    extern __shared__ __align__(16) float smem[];
    float* S = smem;                 // [hd][hd]
    float* sq = S + hd * hd;         // [hd] q (normed, scaled)
    float* sk = sq + hd;             // [hd] k (normed)
    float* sv = sk + hd;             // [hd] v
    float* se = sv + hd;             // [hd] exp(g)
    float* su = se + hd;             // [hd] u / o
    float* red = su + hd;            // [R][hd], R·hd = blockDim.x <= 256
    float* misc = red + 256;         // [16]: q, k, o sums of squares per warp

    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5;
    const int b = blockIdx.x, h = blockIdx.y, D = H * hd;
    const int R = blockDim.x / hd, v = tid % hd, rg = tid / hd;
    int tok0, len, chunk0, slot;
    if (seqs) {
        const int4 s = seqs[b];
        tok0 = s.x; len = s.y; chunk0 = s.z; slot = s.w;
    } else {
        tok0 = b; len = 1; chunk0 = 0; slot = slots[b];
    }
    if (slot < 0 || slot >= nslots) return;

    float* Sg = state + ((long long)slot * H + h) * hd * hd;
    for (int i = tid; i < hd * hd; i += blockDim.x) S[i] = Sg[i];

    // Conv windows (the last 3 raw inputs, oldest first) of this thread's channel, q/k/v.
    const int col = h * hd + v;
    const bool chan = tid < hd;
    float w[3][4];
    T win[3][3];
    if (chan) {
#pragma unroll
        for (int which = 0; which < 3; which++) {
            const float* wp4 = convw + ((long long)which * D + col) * 4;
            for (int j = 0; j < 4; j++) w[which][j] = wp4[j];
            const T* cs = conv_state + ((long long)slot * 3 + which) * 3 * D + col;
            for (int j = 0; j < 3; j++) win[which][j] = cs[(long long)j * D];
        }
    }
    const float aexp = __expf(a_log[h]);
    const float dtb = chan ? dt_bias[col] : 0.0f;
    const float onw = chan ? onorm_w[v] : 0.0f;
    const float qscale = rsqrtf((float)hd);
    const int nw = (hd + 31) >> 5;  // warps holding the hd channels (warp-uniform: wp < nw)
    __syncthreads();

    for (int t = 0; t < len; t++) {
        const long long row = (long long)(tok0 + t);
        float gv = 0.0f, qsq = 0.0f, ksq = 0.0f;
        if (chan) {
            const T* X[3] = {qr, kr, vr};
            float a[3];
#pragma unroll
            for (int which = 0; which < 3; which++) {
                const T x3 = X[which][row * D + col];
                const float y = w[which][0] * kg_f(win[which][0]) + w[which][1] * kg_f(win[which][1]) +
                                w[which][2] * kg_f(win[which][2]) + w[which][3] * kg_f(x3);
                a[which] = y / (1.0f + __expf(-y));
                win[which][0] = win[which][1]; win[which][1] = win[which][2]; win[which][2] = x3;
            }
            sq[v] = a[0]; sk[v] = a[1]; sv[v] = a[2];
            se[v] = __expf(lower_bound * kg_sigm(aexp * (kg_f(graw[row * D + col]) + dtb)));
            gv = kg_sigm(kg_f(gate[row * D + col]));
            qsq = a[0] * a[0];
            ksq = a[1] * a[1];
        }
        if (wp < nw) {  // whole warps: a lane past hd adds zero
            const float qq = warp_sum(qsq), kk = warp_sum(ksq);
            if (lane == 0) { misc[wp] = qq; misc[4 + wp] = kk; }
        }
        __syncthreads();
        float qs = 0.0f, ks = 0.0f;
        for (int i = 0; i < nw; i++) { qs += misc[i]; ks += misc[4 + i]; }
        const float qi = qscale / sqrtf(qs + 1e-6f), ki = 1.0f / sqrtf(ks + 1e-6f);
        const float beta = kg_sigm(kg_f(braw[row * H + h]));
        // S <- S * exp(g)[:, None];  partial (S^T k)[v] over this thread's rows.
        float p = 0.0f;
        for (int r = rg; r < hd; r += R) {
            const float s = S[r * hd + v] * se[r];
            S[r * hd + v] = s;
            p += sk[r] * ki * s;
        }
        red[rg * hd + v] = p;
        __syncthreads();
        if (chan) {
            float acc = 0.0f;
            for (int i = 0; i < R; i++) acc += red[i * hd + v];
            su[v] = beta * (sv[v] - acc);
        }
        __syncthreads();
        // S <- S + k (beta u)^T;  partial (S^T q)[v].
        const float u = su[v];
        float o = 0.0f;
        for (int r = rg; r < hd; r += R) {
            const float s = S[r * hd + v] + sk[r] * ki * u;
            S[r * hd + v] = s;
            o += sq[r] * qi * s;
        }
        red[rg * hd + v] = o;
        __syncthreads();
        float ov = 0.0f;
        if (chan) {
            for (int i = 0; i < R; i++) ov += red[i * hd + v];
        }
        if (wp < nw) {
            const float ss = warp_sum(ov * ov);
            if (lane == 0) misc[8 + wp] = ss;
        }
        __syncthreads();
        if (chan) {
            float ss = 0.0f;
            for (int i = 0; i < nw; i++) ss += misc[8 + i];
            const float inv = 1.0f / sqrtf(ss / (float)hd + eps);
            st(out, row * D + col, ov * inv * onw * gv);
        }
        if (chunk_states && ((t + 1) % KG_CHUNK == 0 || t + 1 == len)) {
            float* cs = chunk_states + ((long long)(chunk0 + t / KG_CHUNK) * H + h) * hd * hd;
            for (int i = tid; i < hd * hd; i += blockDim.x) cs[i] = S[i];
        }
        // The next token overwrites sq..se and misc only after this barrier.
        __syncthreads();
    }
    for (int i = tid; i < hd * hd; i += blockDim.x) Sg[i] = S[i];
    if (chan) {
#pragma unroll
        for (int which = 0; which < 3; which++) {
            T* cs = conv_state + ((long long)slot * 3 + which) * 3 * D + col;
            for (int j = 0; j < 3; j++) cs[(long long)j * D] = win[which][j];
        }
    }
}

#define KDA_GENERAL_KERNEL(NAME, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                            \
        const T* qr, const T* kr, const T* vr, const T* graw, const T* braw, const T* gate, const float* convw,         \
        const float* a_log, const float* dt_bias, const float* onorm_w, T* conv_state, float* state,                    \
        float* chunk_states, const int4* seqs, const int* slots, T* out, int H, int hd, int nslots, float lower_bound,  \
        float eps) {                                                                                                   \
        kda_general_impl<T>(qr, kr, vr, graw, braw, gate, convw, a_log, dt_bias, onorm_w, conv_state, state,            \
                            chunk_states, seqs, slots, out, H, hd, nslots, lower_bound, eps);                          \
    }
KDA_GENERAL_KERNEL(kda_general, bf16_t)
KDA_GENERAL_KERNEL(kda_general_f32, float)
