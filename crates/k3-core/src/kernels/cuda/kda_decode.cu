// kda_decode.cu: the KDA decode step (text-backbone §3.8: conv-state shift, §3.2-3.3 gates,
// one step of the §3.4 recurrence, §3.6 output norm and gate), head_dim 128, state f32 in place.
// CPU oracle: kernels/cpu/kda.rs `kda_recurrent` plus k3-model layers/kda.rs.
// One block per (head, sequence) holds the head's 128x128 state in registers; docs/kernels/kda.md
// has the variants measured against it and dropped (column splits over clusters of 2-8 blocks,
// a persistent kernel streaming states through a TMA ring, warp-owned columns, 512 threads).
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

__device__ __forceinline__ unsigned pack2(float lo, float hi) { return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16); }
__device__ __forceinline__ float4 ldg4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ void fma4(float4& a, float k, float4 b) {
    a.x += k * b.x; a.y += k * b.y; a.z += k * b.z; a.w += k * b.w;
}
__device__ __forceinline__ void scale4(float4& a, float e) {
    a.x *= e; a.y *= e; a.z *= e; a.w *= e;
}

// Grid (H, B), 256 threads. Conv roles: thread (role = tid / 128, channel ch = tid % 128): role 0
// = the q channel and its decay, role 1 = the k and v channels. Recurrence: warp wp owns state
// rows 16wp..16wp+15, lane its 4 columns 4·lane..; per-warp partial sums over rows meet in shared
// memory and every thread sums the 8 partials of its own columns, so the step needs three
// barriers. State loads and stores carry no cache hint (evict-first .cs measured slower at batch
// 64 on the H200).
extern "C" __global__ void __launch_bounds__(256)
kda_decode(const bf16_t* __restrict__ qr, const bf16_t* __restrict__ kr, const bf16_t* __restrict__ vr,
           const bf16_t* __restrict__ graw, const bf16_t* __restrict__ braw, const bf16_t* __restrict__ gate,
           const float* __restrict__ convw, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
           const float* __restrict__ onorm_w, bf16_t* __restrict__ conv_state, float* __restrict__ state,
           const int* __restrict__ slots, bf16_t* __restrict__ out, int H, int nslots, float lower_bound, float eps) {
    __shared__ __align__(16) float sq[KD], sk[KD], sv[KD], se[KD], red[2][8][KD], misc[8];
    const int tid = threadIdx.x, lane = tid & 31, wp = tid >> 5, ch = tid & 127, role = tid >> 7;
    const int h = blockIdx.x, b = blockIdx.y, D = H * KD;
    const long long xo = (long long)b * D + h * KD;

    // Everything that does not depend on the slot is loaded first, overlapping the slot's load.
    const int sl = slots[b];
    const bf16_t xa = (role ? kr : qr)[xo + ch], xv = vr[xo + ch], gr = graw[xo + ch];
    const float4 wa = ldg4(convw + ((long long)role * D + h * KD + ch) * 4), wv = ldg4(convw + (2LL * D + h * KD + ch) * 4);
    const float dtb = dt_bias[h * KD + ch], al = a_log[h], bl = bf16_to_f32(braw[(long long)b * H + h]);
    const uint2 gt = *reinterpret_cast<const uint2*>(gate + xo + 4 * lane);  // warp 0: its 4 outputs' gates
    const float4 onw = ldg4(onorm_w + 4 * lane);
    if (sl < 0 || sl >= nslots) return;

    // The conv taps first: the conv and the q / k norms then overlap the state's arrival.
    bf16_t* cs = conv_state + (long long)sl * 9 * D + h * KD + ch;
    const bf16_t ta0 = cs[(role * 3) * (long long)D], ta1 = cs[(role * 3 + 1) * (long long)D], ta2 = cs[(role * 3 + 2) * (long long)D];
    // The v taps: role 1 only (it rewrites them below; role 0 reading them would race).
    const bf16_t tv0 = role ? cs[6LL * D] : ta0, tv1 = role ? cs[7LL * D] : ta1, tv2 = role ? cs[8LL * D] : ta2;
    float4* S = reinterpret_cast<float4*>(state + ((long long)sl * H + h) * (KD * KD));
    float4 s[16];
#pragma unroll
    for (int r = 0; r < 16; r++) s[r] = S[(wp * 16 + r) * 32 + lane];
    const float a = conv_silu(wa, ta0, ta1, ta2, xa);
    if (role == 0) {
        sq[ch] = a;
        se[ch] = decay(lower_bound, al, gr, dtb);
    } else {
        sk[ch] = a;
        sv[ch] = conv_silu(wv, tv0, tv1, tv2, xv);
        shift_taps(cs + 6LL * D, D, keep2(tv1, tv2), xv);
    }
    shift_taps(cs + (role * 3) * (long long)D, D, keep2(ta1, ta2), xa);
    const float ss = warp_sum(a * a);
    if (lane == 0) misc[wp] = ss;  // [0, 4): q, [4, 8): k
    __syncthreads();
    const float qi = 0.08838834764831845f / sqrtf(misc[0] + misc[1] + misc[2] + misc[3] + 1e-6f);
    const float ki = 1.0f / sqrtf(misc[4] + misc[5] + misc[6] + misc[7] + 1e-6f);

    // u = beta (v - (e ⊙ S)^T k), each thread for its own 4 columns
    float4 p = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const int row = wp * 16 + r;
        scale4(s[r], se[row]);
        fma4(p, sk[row] * ki, s[r]);
    }
    *reinterpret_cast<float4*>(&red[0][wp][4 * lane]) = p;
    __syncthreads();
    float4 u = *reinterpret_cast<const float4*>(&sv[4 * lane]);
#pragma unroll
    for (int w = 0; w < 8; w++) fma4(u, -1.0f, *reinterpret_cast<const float4*>(&red[0][w][4 * lane]));
    scale4(u, sigmoid_ftz(bl));

    // S += k u^T ; o = S^T q
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < 16; r++) {
        const int row = wp * 16 + r;
        fma4(s[r], sk[row] * ki, u);
        fma4(o, sq[row] * qi, s[r]);
        S[row * 32 + lane] = s[r];
    }
    *reinterpret_cast<float4*>(&red[1][wp][4 * lane]) = o;
    __syncthreads();
    if (wp != 0) return;
    o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < 8; w++) fma4(o, 1.0f, *reinterpret_cast<const float4*>(&red[1][w][4 * lane]));
    const float inv = 1.0f / sqrtf(warp_sum(o.x * o.x + o.y * o.y + o.z * o.z + o.w * o.w) * (1.0f / KD) + eps);
    const float y0 = o.x * inv * onw.x * sigmoid_ftz(lo_bf16(gt.x)), y1 = o.y * inv * onw.y * sigmoid_ftz(hi_bf16(gt.x));
    const float y2 = o.z * inv * onw.z * sigmoid_ftz(lo_bf16(gt.y)), y3 = o.w * inv * onw.w * sigmoid_ftz(hi_bf16(gt.y));
    *reinterpret_cast<uint2*>(out + xo + 4 * lane) = make_uint2(pack2(y0, y1), pack2(y2, y3));
}
