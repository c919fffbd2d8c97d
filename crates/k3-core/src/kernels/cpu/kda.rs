//! The KDA (Kimi Delta Attention) core on the CPU: text-backbone §3.4 (recurrent, the
//! normative definition) and §3.5 (chunkwise, chunk 64, UT transform; used for prefill).
//! Both take the same inputs and update the same state, so they are interchangeable.
//!
//! Shapes (one sequence): `q`, `k`, `g` `[T, H, Dk]` (q, k already L2-normed, q scaled; `g` is
//! the log-space decay, ≤ 0), `v` `[T, H, Dv]`, `beta` `[T, H]`, state `s` `[H, Dk, Dv]`,
//! output `o` `[T, H, Dv]`. Everything f32; heads run in parallel (rayon).

use rayon::prelude::*;

/// Chunk length of the chunkwise form.
pub const CHUNK: usize = 64;

/// Dimensions of one call.
#[derive(Clone, Copy, Debug)]
pub struct KdaDims {
    pub t: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
}

/// One head's inputs (strided views into the `[T, H, ·]` buffers).
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    h: usize,
    d: KdaDims,
}

impl Head<'_> {
    #[inline]
    fn qk(&self, t: usize) -> usize {
        (t * self.d.h + self.h) * self.d.dk
    }
    #[inline]
    fn vi(&self, t: usize) -> usize {
        (t * self.d.h + self.h) * self.d.dv
    }
}

fn run_heads(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], s: &mut [f32], o: &mut [f32], d: KdaDims, f: fn(&Head, &mut [f32], &mut [f32])) {
    assert_eq!(q.len(), d.t * d.h * d.dk);
    assert_eq!(v.len(), d.t * d.h * d.dv);
    assert_eq!(s.len(), d.h * d.dk * d.dv);
    // Per-head output scratch [T, Dv], scattered into o afterwards.
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); d.h];
    s.par_chunks_mut(d.dk * d.dv).zip(outs.par_iter_mut()).enumerate().for_each(|(h, (sh, oh))| {
        *oh = vec![0f32; d.t * d.dv];
        let head = Head { q, k, v, g, beta, h, d };
        f(&head, sh, oh);
    });
    for (h, oh) in outs.iter().enumerate() {
        for t in 0..d.t {
            o[(t * d.h + h) * d.dv..][..d.dv].copy_from_slice(&oh[t * d.dv..][..d.dv]);
        }
    }
}

/// §3.4: for each token, decay → delta correction → write → read.
pub fn kda_recurrent(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], s: &mut [f32], o: &mut [f32], d: KdaDims) {
    run_heads(q, k, v, g, beta, s, o, d, recurrent_head);
}

fn recurrent_head(hd: &Head, s: &mut [f32], out: &mut [f32]) {
    let KdaDims { dk, dv, .. } = hd.d;
    let mut u = vec![0f32; dv];
    for t in 0..hd.d.t {
        let (qi, vi) = (hd.qk(t), hd.vi(t));
        let (qt, kt, gt, vt) = (&hd.q[qi..qi + dk], &hd.k[qi..qi + dk], &hd.g[qi..qi + dk], &hd.v[vi..vi + dv]);
        let b = hd.beta[t * hd.d.h + hd.h];
        // S ← S ⊙ exp(g)[:, None]
        for (a, &gg) in gt.iter().enumerate() {
            let e = gg.exp();
            s[a * dv..(a + 1) * dv].iter_mut().for_each(|x| *x *= e);
        }
        // u = v − Sᵀ k
        u.copy_from_slice(vt);
        for (a, &ka) in kt.iter().enumerate() {
            for (uu, &sv) in u.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                *uu -= ka * sv;
            }
        }
        // S ← S + β k uᵀ ;  o = Sᵀ q
        let ot = &mut out[t * dv..(t + 1) * dv];
        ot.iter_mut().for_each(|x| *x = 0.0);
        for a in 0..dk {
            let (bk, qa) = (b * kt[a], qt[a]);
            let row = &mut s[a * dv..(a + 1) * dv];
            for ((sv, &uu), oo) in row.iter_mut().zip(&u).zip(ot.iter_mut()) {
                *sv += bk * uu;
                *oo += qa * *sv;
            }
        }
    }
}

/// §3.5: the chunkwise form (chunk 64). Equal to [`kda_recurrent`] up to f32 rounding.
pub fn kda_chunked(q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32], s: &mut [f32], o: &mut [f32], d: KdaDims) {
    run_heads(q, k, v, g, beta, s, o, d, chunked_head);
}

fn chunked_head(hd: &Head, s: &mut [f32], out: &mut [f32]) {
    let KdaDims { dk, dv, .. } = hd.d;
    let c = CHUNK;
    let mut gc = vec![0f32; c * dk]; // [n, Dk] cumulative log-decay G
    let mut kc = vec![0f32; c * dk]; // [n, Dk] keys
    let mut qc = vec![0f32; c * dk];
    let mut a = vec![0f32; c * c]; // A_kk, strictly lower
    let mut w = vec![0f32; c * dk]; // M (e^G ⊙ k)
    let mut u = vec![0f32; c * dv]; // M v, then v' = u − w S
    let mut bt = vec![0f32; c];
    let mut snew = vec![0f32; dk * dv];
    let mut c0 = 0;
    while c0 < hd.d.t {
        let n = c.min(hd.d.t - c0);
        for i in 0..n {
            let qi = hd.qk(c0 + i);
            kc[i * dk..(i + 1) * dk].copy_from_slice(&hd.k[qi..qi + dk]);
            qc[i * dk..(i + 1) * dk].copy_from_slice(&hd.q[qi..qi + dk]);
            for x in 0..dk {
                gc[i * dk + x] = hd.g[qi + x] + if i > 0 { gc[(i - 1) * dk + x] } else { 0.0 };
            }
            bt[i] = hd.beta[(c0 + i) * hd.d.h + hd.h];
        }
        // A_kk[i,j] = −β_i Σ_d k_i k_j e^{G_i − G_j}, j < i (exponent ≤ 0: only evaluated there).
        for i in 0..n {
            for j in 0..i {
                let mut acc = 0f32;
                for x in 0..dk {
                    acc += kc[i * dk + x] * kc[j * dk + x] * (gc[i * dk + x] - gc[j * dk + x]).exp();
                }
                a[i * c + j] = -bt[i] * acc;
            }
        }
        // Forward substitution: X_i = β_i Y_i + Σ_{j<i} A[i,j] X_j for Y = e^G ⊙ k (→ w) and Y = v (→ u).
        for i in 0..n {
            let vi = hd.vi(c0 + i);
            for x in 0..dk {
                w[i * dk + x] = bt[i] * gc[i * dk + x].exp() * kc[i * dk + x];
            }
            for x in 0..dv {
                u[i * dv + x] = bt[i] * hd.v[vi + x];
            }
            for j in 0..i {
                let aij = a[i * c + j];
                if aij == 0.0 {
                    continue;
                }
                let (wl, wr) = w.split_at_mut(i * dk);
                for x in 0..dk {
                    wr[x] += aij * wl[j * dk + x];
                }
                let (ul, ur) = u.split_at_mut(i * dv);
                for x in 0..dv {
                    ur[x] += aij * ul[j * dv + x];
                }
            }
        }
        // v' = u − w S_prev
        for i in 0..n {
            for x in 0..dk {
                let wx = w[i * dk + x];
                if wx != 0.0 {
                    let srow = &s[x * dv..(x + 1) * dv];
                    for (uu, &sv) in u[i * dv..(i + 1) * dv].iter_mut().zip(srow) {
                        *uu -= wx * sv;
                    }
                }
            }
        }
        // o_i = (q_i ⊙ e^{G_i}) S_prev + Σ_{j≤i} (Σ_d q_i k_j e^{G_i − G_j}) v'_j
        for i in 0..n {
            let ot = &mut out[(c0 + i) * dv..(c0 + i + 1) * dv];
            for x in 0..dk {
                let qe = qc[i * dk + x] * gc[i * dk + x].exp();
                for (oo, &sv) in ot.iter_mut().zip(&s[x * dv..(x + 1) * dv]) {
                    *oo += qe * sv;
                }
            }
            for j in 0..=i {
                let mut acc = 0f32;
                for x in 0..dk {
                    acc += qc[i * dk + x] * kc[j * dk + x] * (gc[i * dk + x] - gc[j * dk + x]).exp();
                }
                for (oo, &uu) in ot.iter_mut().zip(&u[j * dv..(j + 1) * dv]) {
                    *oo += acc * uu;
                }
            }
        }
        // S = e^{G_last} ⊙ S_prev + Σ_j (e^{G_last − G_j} ⊙ k_j)ᵀ v'_j
        let gl = &gc[(n - 1) * dk..n * dk];
        for x in 0..dk {
            let e = gl[x].exp();
            let row = &mut snew[x * dv..(x + 1) * dv];
            for (sn, &sv) in row.iter_mut().zip(&s[x * dv..(x + 1) * dv]) {
                *sn = e * sv;
            }
            for j in 0..n {
                let kd = kc[j * dk + x] * (gl[x] - gc[j * dk + x]).exp();
                if kd != 0.0 {
                    for (sn, &uu) in row.iter_mut().zip(&u[j * dv..(j + 1) * dv]) {
                        *sn += kd * uu;
                    }
                }
            }
        }
        s.copy_from_slice(&snew);
        c0 += n;
    }
}
