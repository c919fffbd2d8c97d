//! The MoonViT3d ("MoonViT-V2") vision tower, around-backbone §3.1–§3.6.
//!
//! Shape legend: `L = Σ t·h·w` packed patches over the samples of one call; `C` = `vt_hidden_size`
//! (1024 released); `Dq` = `qkv_hidden_size` (1536), `nh` heads of `hd = Dq/nh` (128); `I` =
//! `vt_intermediate_size` (4096); `P = 3·ps·ps` (588). `pixel_values` `[L, 3, ps, ps]`, patch
//! rows `[L, C]`, `qkv` `[L, 3·Dq]` (Q | K | V, head-major within each), attention out `[L, Dq]`.
//!
//! - Patch embedding: `x = W_patch · flatten(p)` (no bias; flatten order (c, ky, kx)).
//! - Learned 2-D table `[H0, W0, C]`, resized to `(h, w)` like PyTorch
//!   `F.interpolate(mode="bilinear", align_corners=False)` (no antialias) on its channels-last view;
//!   for `t > 1` the fixed sin/cos time table is added per frame (sines first).
//! - Pre-norm blocks: `h = x + wo·Attn(RMSNorm(x))`, `x = h + fc1·gelu_tanh(fc0·RMSNorm(h))`;
//!   RMSNorm eps = f32::EPSILON (the reference builds `nn.RMSNorm` without eps).
//! - Attention: 2-D RoPE on adjacent channel pairs (even pair k/2 → column, odd → row,
//!   `f_k = 10000^(−4k/hd)`), scale `hd^−½`, bidirectional within a sample only.
//! - `final_layernorm` (an RMSNorm) closes the tower.
//!
//! Each grid's position rows (`[t·h·w, C]`) are computed once and cached, bounded in bytes
//! ([`VisionTower::sample_rows`], `row_cache.rs`): images of one size share them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use k3_core::kernels::cpu::act::softmax_inplace;
use k3_core::kernels::cpu::matmul::{linear, Matrix};
use k3_core::{DType, Tensor};
use rayon::prelude::*;

use crate::error::{input, Result, VisionError};
use crate::row_cache::{lock, RowCache, ROW_CACHE_BYTES};

/// The RoPE table of the reference covers grids up to 512 × 512 patches.
pub const ROPE_MAX_SIDE: usize = 512;
/// ViT RMSNorm eps (`torch.nn.RMSNorm` with `eps=None` on f32 accumulation).
pub const VIT_NORM_EPS: f32 = f32::EPSILON;
/// Query rows per attention task.
const Q_CHUNK: usize = 64;

/// Sizes of the tower (from `vision_config`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TowerDims {
    pub hidden: usize,
    pub heads: usize,
    pub qkv: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub patch: usize,
    pub pos_h: usize,
    pub pos_w: usize,
    pub pos_t: usize,
}

impl TowerDims {
    pub fn head_dim(&self) -> usize {
        self.qkv / self.heads
    }
}

pub struct Block {
    pub norm0: Vec<f32>,
    pub wqkv: Matrix,
    pub wo: Matrix,
    pub norm1: Vec<f32>,
    pub fc0: Matrix,
    pub fc1: Matrix,
}

pub struct VisionTower {
    pub dims: TowerDims,
    /// `[C, 3·ps·ps]`.
    pub patch_embed: Matrix,
    /// `[H0, W0, C]` as f32.
    pub pos_emb: Vec<f32>,
    /// The table is stored in bf16: round the resized table to bf16 as the reference does.
    pub pos_emb_bf16: bool,
    pub blocks: Vec<Block>,
    pub final_norm: Vec<f32>,
    /// [`VisionTower::sample_rows`] per grid `[t, h, w]`.
    rows: Mutex<RowCache<Arc<Vec<f32>>>>,
    /// Unique per loaded tower (what the GPU's copy of the rows was made from).
    id: u64,
}

/// The next [`VisionTower::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// Callback for named intermediates `[rows, width]`: `vit_patch_embed`, `vit_block{j}_out`.
pub type TowerTrace<'a> = Option<&'a mut dyn FnMut(&str, &[f32])>;

fn shape_err(name: &str, t: &Tensor, want: &[usize]) -> VisionError {
    VisionError::Weight { name: name.into(), msg: format!("has shape {:?}, expected {want:?} (from vision_config)", t.shape()) }
}

fn fetch(get: &dyn Fn(&str) -> Result<Tensor>, name: &str, want: &[usize]) -> Result<Tensor> {
    let t = get(name)?;
    if t.shape() != want {
        return Err(shape_err(name, &t, want));
    }
    if !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(VisionError::Weight { name: name.into(), msg: format!("has dtype {}, expected F32, BF16 or F16", t.dtype()) });
    }
    Ok(t)
}

fn mat(get: &dyn Fn(&str) -> Result<Tensor>, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
    Ok(Matrix::dense(fetch(get, name, &[rows, cols])?)?)
}

fn vec_f32(get: &dyn Fn(&str) -> Result<Tensor>, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    Ok(fetch(get, name, shape)?.to_f32()?.into_owned())
}

/// `x · rsqrt(mean(x²) + eps) · w` per row, rows in parallel.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let d = w.len();
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(o, r)| k3_core::kernels::cpu::norm::rms_norm(r, w, eps, o));
    out
}

/// PyTorch's `gelu(approximate="tanh")`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = std::f32::consts::SQRT_2 * std::f32::consts::FRAC_2_SQRT_PI * 0.5;
    let inner = BETA * (x + 0.044715 * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    if x.is_nan() {
        return x;
    }
    f32::from_bits((b.wrapping_add(0x7FFF + ((b >> 16) & 1))) & 0xFFFF_0000)
}

/// PyTorch's source index and weights for one output coordinate (align_corners = False).
fn bilinear_src(o: usize, in_n: usize, out_n: usize) -> (usize, usize, f32, f32) {
    if in_n == out_n {
        return (o, o, 1.0, 0.0);
    }
    let ratio = in_n as f32 / out_n as f32;
    let real = (ratio * (o as f32 + 0.5) - 0.5).max(0.0);
    let i0 = (real.floor() as usize).min(in_n - 1);
    let l1 = (real - i0 as f32).clamp(0.0, 1.0);
    let i1 = i0 + usize::from(i0 < in_n - 1);
    (i0, i1, 1.0 - l1, l1)
}

/// Rows `[τ]` of the fixed time table, width `d`: `concat(sin(τ·ω), cos(τ·ω))`,
/// `ω_k = 1/10000^(k/(d/2))` in f32, products and sin/cos in f64, stored as f32.
pub fn time_embedding(t: usize, d: usize) -> Vec<f32> {
    let half = d / 2;
    let omega: Vec<f32> = (0..half).map(|k| 1.0f32 / 10000f32.powf(k as f32 / (d as f32 / 2.0))).collect();
    let mut out = vec![0f32; t * d];
    for tau in 0..t {
        for k in 0..half {
            let a = tau as f64 * omega[k] as f64;
            out[tau * d + k] = a.sin() as f32;
            out[tau * d + half + k] = a.cos() as f32;
        }
    }
    out
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl VisionTower {
    /// Loads the tower's tensors through `get` (names as in the release: `vision_tower.…`).
    pub fn load(dims: TowerDims, get: &dyn Fn(&str) -> Result<Tensor>) -> Result<VisionTower> {
        let TowerDims { hidden: c, qkv, intermediate: i, patch: p, .. } = dims;
        let pe = fetch(get, "vision_tower.patch_embed.proj.weight", &[c, 3, p, p])?;
        let patch_embed = Matrix::dense(pe.reshape(vec![c, 3 * p * p])?)?;
        let pos = fetch(get, "vision_tower.patch_embed.pos_emb.weight", &[dims.pos_h, dims.pos_w, c])?;
        let pos_emb_bf16 = pos.dtype() == DType::BF16;
        let pos_emb = pos.to_f32()?.into_owned();
        let blocks = (0..dims.layers)
            .map(|b| {
                let n = format!("vision_tower.encoder.blocks.{b}.");
                Ok(Block {
                    norm0: vec_f32(get, &format!("{n}norm0.weight"), &[c])?,
                    wqkv: mat(get, &format!("{n}wqkv.weight"), 3 * qkv, c)?,
                    wo: mat(get, &format!("{n}wo.weight"), c, qkv)?,
                    norm1: vec_f32(get, &format!("{n}norm1.weight"), &[c])?,
                    fc0: mat(get, &format!("{n}mlp.fc0.weight"), i, c)?,
                    fc1: mat(get, &format!("{n}mlp.fc1.weight"), c, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let final_norm = vec_f32(get, "vision_tower.encoder.final_layernorm.weight", &[c])?;
        let (rows, id) = (Mutex::new(RowCache::new(ROW_CACHE_BYTES)), NEXT_ID.fetch_add(1, Ordering::Relaxed));
        Ok(VisionTower { dims, patch_embed, pos_emb, pos_emb_bf16, blocks, final_norm, rows, id })
    }

    /// Unique per loaded tower: what keys a copy of its [`Self::sample_rows`] elsewhere (the GPU's).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The position table resized to `(h, w)`, flattened row-major: `[h·w, C]`.
    pub fn pos_embedding(&self, h: usize, w: usize) -> Vec<f32> {
        let (c, ih, iw) = (self.dims.hidden, self.dims.pos_h, self.dims.pos_w);
        let src = &self.pos_emb;
        let mut out = vec![0f32; h * w * c];
        let cols: Vec<_> = (0..w).map(|x| bilinear_src(x, iw, w)).collect();
        out.par_chunks_mut(w * c).enumerate().for_each(|(y, orow)| {
            let (h0, h1, lh0, lh1) = bilinear_src(y, ih, h);
            for (x, &(w0, w1, lw0, lw1)) in cols.iter().enumerate() {
                let (w00, w01, w10, w11) = (lh0 * lw0, lh0 * lw1, lh1 * lw0, lh1 * lw1);
                let at = |r: usize, q: usize| &src[(r * iw + q) * c..(r * iw + q + 1) * c];
                let (a, b, cc, d) = (at(h0, w0), at(h0, w1), at(h1, w0), at(h1, w1));
                let o = &mut orow[x * c..(x + 1) * c];
                for ch in 0..c {
                    let v = a[ch] * w00 + b[ch] * w01 + cc[ch] * w10 + d[ch] * w11;
                    o[ch] = if self.pos_emb_bf16 { round_bf16(v) } else { v };
                }
            }
        });
        out
    }

    /// Checks a packed batch: returns `L`.
    pub fn check_input(&self, pixels: &[f32], grids: &[[usize; 3]]) -> Result<usize> {
        self.check_parts(&[pixels], grids)
    }

    /// [`Self::check_input`] of the batch packed from `parts` in order (not concatenated).
    pub fn check_parts(&self, parts: &[&[f32]], grids: &[[usize; 3]]) -> Result<usize> {
        let p = 3 * self.dims.patch * self.dims.patch;
        let values: usize = parts.iter().map(|x| x.len()).sum();
        let mut l = 0;
        for (i, &[t, h, w]) in grids.iter().enumerate() {
            if t == 0 || h == 0 || w == 0 {
                return Err(input(format!("grid_thw of sample {i} is {:?}: every side must be ≥ 1", [t, h, w])));
            }
            if h > ROPE_MAX_SIDE || w > ROPE_MAX_SIDE {
                return Err(input(format!("grid {h}x{w} of sample {i} exceeds the {ROPE_MAX_SIDE}x{ROPE_MAX_SIDE} RoPE table")));
            }
            if t > 1 && t > self.dims.pos_t {
                return Err(input(format!("sample {i} has {t} frames; the time table holds {} (init_pos_emb_time)", self.dims.pos_t)));
            }
            l += t * h * w;
        }
        if l == 0 || values != l * p {
            return Err(input(format!("pixel_values hold {values} values; the grids ask for {l} patches × {p}")));
        }
        Ok(l)
    }

    /// What is added to the patch embeddings of one sample of grid `[t, h, w]`, `[t·h·w, C]`:
    /// each frame's resized position table ([`Self::pos_embedding`]), plus for `t > 1` that frame's
    /// time row (summed, for the GPU tower; the CPU tower adds the two one after the other); cached per grid.
    pub fn sample_rows(&self, grid: [usize; 3]) -> Arc<Vec<f32>> {
        if let Some(r) = lock(&self.rows).get(grid) {
            return r;
        }
        let ([t, h, w], c) = (grid, self.dims.hidden);
        let rows = if t == 1 {
            self.pos_embedding(h, w)
        } else {
            let (pos, te) = (self.sample_rows([1, h, w]), time_embedding(t, c));
            let mut out = vec![0f32; t * h * w * c];
            out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
                let (tau, r) = (i / (h * w), i % (h * w));
                o.iter_mut().zip(&pos[r * c..(r + 1) * c]).zip(&te[tau * c..(tau + 1) * c]).for_each(|((o, a), b)| *o = a + b);
            });
            out
        };
        let rows = Arc::new(rows);
        lock(&self.rows).insert(grid, rows.clone(), rows.len() * 4);
        rows
    }

    /// [`Self::sample_rows`] of every sample of a packed batch, in order: `[L, C]`.
    pub fn position_rows(&self, grids: &[[usize; 3]]) -> Vec<f32> {
        let mut out = Vec::with_capacity(grids.iter().map(|g| g[0] * g[1] * g[2] * self.dims.hidden).sum());
        for &g in grids {
            out.extend_from_slice(&self.sample_rows(g));
        }
        out
    }

    /// Runs the tower on packed patches; returns `[L, C]` after `final_layernorm`.
    pub fn forward(&self, pixels: &[f32], grids: &[[usize; 3]], mut trace: TowerTrace<'_>) -> Result<Vec<f32>> {
        let l = self.check_input(pixels, grids)?;
        let c = self.dims.hidden;
        let mut x = vec![0f32; l * c];
        linear(pixels, l, &self.patch_embed, &mut x)?;
        let mut off = 0;
        for &[t, h, w] in grids {
            let pos = self.sample_rows([1, h, w]);
            let time = (t > 1).then(|| time_embedding(t, c));
            for tau in 0..t {
                let rows = &mut x[(off + tau * h * w) * c..(off + (tau + 1) * h * w) * c];
                rows.iter_mut().zip(pos.iter()).for_each(|(a, b)| *a += b);
                if let Some(te) = &time {
                    rows.par_chunks_mut(c).for_each(|r| r.iter_mut().zip(&te[tau * c..(tau + 1) * c]).for_each(|(a, b)| *a += b));
                }
            }
            off += t * h * w;
        }
        if let Some(f) = trace.as_mut() {
            f("vit_patch_embed", &x);
        }
        let rope = RopeTables::new(self.dims.head_dim(), grids);
        for (j, blk) in self.blocks.iter().enumerate() {
            self.block(blk, &mut x, l, grids, &rope)?;
            if let Some(f) = trace.as_mut() {
                f(&format!("vit_block{j}_out"), &x);
            }
        }
        Ok(rms_norm_rows(&x, &self.final_norm, VIT_NORM_EPS))
    }

    fn block(&self, b: &Block, x: &mut [f32], l: usize, grids: &[[usize; 3]], rope: &RopeTables) -> Result<()> {
        let d = self.dims;
        let hn = rms_norm_rows(x, &b.norm0, VIT_NORM_EPS);
        let mut qkv = vec![0f32; l * 3 * d.qkv];
        linear(&hn, l, &b.wqkv, &mut qkv)?;
        rope.apply(&mut qkv, d.qkv, grids);
        let att = attention(&qkv, d.qkv, d.heads, grids);
        let mut o = vec![0f32; l * d.hidden];
        linear(&att, l, &b.wo, &mut o)?;
        x.par_iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let hn = rms_norm_rows(x, &b.norm1, VIT_NORM_EPS);
        let mut f = vec![0f32; l * d.intermediate];
        linear(&hn, l, &b.fc0, &mut f)?;
        f.par_iter_mut().for_each(|v| *v = gelu_tanh(*v));
        linear(&f, l, &b.fc1, &mut o)?;
        x.par_iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        Ok(())
    }
}

/// The longest grid side of a packed batch: the RoPE table's rows.
pub fn rope_side(grids: &[[usize; 3]]) -> usize {
    grids.iter().map(|g| g[1].max(g[2])).max().unwrap_or(1)
}

/// The 2-D RoPE tables `(cos, sin)`, each `[side, hd/4]`: `f_k = 1/10000^(4k/hd)` in f32, angle
/// `pos·f_k` in f32, cos/sin in f64 stored as f32 (the GPU tower uploads these).
pub fn rope_table(hd: usize, side: usize) -> (Vec<f32>, Vec<f32>) {
    let nf = hd / 4;
    let freqs: Vec<f32> = (0..nf).map(|k| 1.0f32 / 10000f32.powf((4 * k) as f32 / hd as f32)).collect();
    let (mut cos, mut sin) = (vec![0f32; side * nf], vec![0f32; side * nf]);
    for p in 0..side {
        for k in 0..nf {
            let a = (p as f32 * freqs[k]) as f64;
            cos[p * nf + k] = a.cos() as f32;
            sin[p * nf + k] = a.sin() as f32;
        }
    }
    (cos, sin)
}

/// Each packed row's patch position `(row, column)` within its frame, samples and frames in order.
pub fn patch_positions(grids: &[[usize; 3]]) -> Vec<(usize, usize)> {
    let mut pos = Vec::new();
    for &[t, h, w] in grids {
        for _ in 0..t {
            for r in 0..h {
                for c in 0..w {
                    pos.push((r, c));
                }
            }
        }
    }
    pos
}

/// cos/sin per position and frequency (see [`rope_table`]).
struct RopeTables {
    nf: usize,
    /// `[max_side, nf]` cos and sin.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTables {
    fn new(hd: usize, grids: &[[usize; 3]]) -> RopeTables {
        let (cos, sin) = rope_table(hd, rope_side(grids));
        RopeTables { nf: hd / 4, cos, sin }
    }

    /// Rotates Q and K of every token in place (pairs `(2j, 2j+1)`; even j → column, odd → row).
    fn apply(&self, qkv: &mut [f32], dq: usize, grids: &[[usize; 3]]) {
        let pos = patch_positions(grids);
        let hd = 4 * self.nf;
        qkv.par_chunks_mut(3 * dq).zip(pos.par_iter()).for_each(|(row, &(r, c))| {
            for head in row[..2 * dq].chunks_exact_mut(hd) {
                for (j, pair) in head.chunks_exact_mut(2).enumerate() {
                    let (p, k) = if j % 2 == 0 { (c, j / 2) } else { (r, j / 2) };
                    let (co, si) = (self.cos[p * self.nf + k], self.sin[p * self.nf + k]);
                    let (a, b) = (pair[0], pair[1]);
                    pair[0] = a * co - b * si;
                    pair[1] = a * si + b * co;
                }
            }
        });
    }
}

/// Full bidirectional attention within each sample: `[L, 3·Dq]` → `[L, Dq]`.
fn attention(qkv: &[f32], dq: usize, heads: usize, grids: &[[usize; 3]]) -> Vec<f32> {
    let hd = dq / heads;
    let l: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
    let mut out = vec![0f32; l * dq];
    let mut tasks = Vec::new();
    let mut base = 0;
    for g in grids {
        let n = g[0] * g[1] * g[2];
        for h in 0..heads {
            for r0 in (0..n).step_by(Q_CHUNK) {
                tasks.push((base, n, h, r0, Q_CHUNK.min(n - r0)));
            }
        }
        base += n;
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let dst = SendPtr(out.as_mut_ptr());
    let rs = (3 * dq) as isize;
    tasks.into_par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, (base, n, h, r0, m)| {
        scores.resize(m * n, 0.0);
        let q = qkv[(base + r0) * 3 * dq + h * hd..].as_ptr();
        let k = qkv[base * 3 * dq + dq + h * hd..].as_ptr();
        let v = qkv[base * 3 * dq + 2 * dq + h * hd..].as_ptr();
        let d = dst;
        // SAFETY: every pointer stays inside `qkv`/`scores`/`out` for the given sizes and strides;
        // each task writes only rows [base+r0, base+r0+m) × columns [h·hd, (h+1)·hd) of `out`.
        unsafe {
            gemm::gemm(m, n, hd, scores.as_mut_ptr(), 1, n as isize, false, q, 1, rs, k, rs, 1, 0.0f32, scale, false, false, false, gemm::Parallelism::None);
        }
        scores.chunks_exact_mut(n).for_each(softmax_inplace);
        unsafe {
            let o = d.0.add((base + r0) * dq + h * hd);
            gemm::gemm(
                m,
                hd,
                n,
                o,
                1,
                dq as isize,
                false,
                scores.as_ptr(),
                1,
                n as isize,
                v,
                1,
                rs,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_attention(qkv: &[f32], dq: usize, heads: usize, n: usize) -> Vec<f32> {
        let hd = dq / heads;
        let mut out = vec![0f32; n * dq];
        for h in 0..heads {
            for i in 0..n {
                let q = &qkv[i * 3 * dq + h * hd..][..hd];
                let mut s: Vec<f32> =
                    (0..n).map(|j| q.iter().zip(&qkv[j * 3 * dq + dq + h * hd..][..hd]).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()).collect();
                softmax_inplace(&mut s);
                for j in 0..n {
                    for e in 0..hd {
                        out[i * dq + h * hd + e] += s[j] * qkv[j * 3 * dq + 2 * dq + h * hd + e];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn attention_matches_naive_and_keeps_samples_apart() {
        let (dq, heads) = (12, 2);
        let grids = [[1, 9, 10], [1, 2, 3]];
        let l = 96;
        let qkv: Vec<f32> = (0..l * 3 * dq).map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0).collect();
        let got = attention(&qkv, dq, heads, &grids);
        let a = naive_attention(&qkv[..90 * 3 * dq], dq, heads, 90);
        let b = naive_attention(&qkv[90 * 3 * dq..], dq, heads, 6);
        for (g, w) in got.iter().zip(a.iter().chain(&b)) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
    }

    /// A tower with only the patch embedding and position table (C 8, table 6×5), random values.
    fn tiny_tower(bf16: bool) -> VisionTower {
        let dims = TowerDims { hidden: 8, heads: 2, qkv: 8, intermediate: 8, layers: 0, patch: 2, pos_h: 6, pos_w: 5, pos_t: 4 };
        let get = |name: &str| -> Result<Tensor> {
            let shape = if name.ends_with("proj.weight") {
                vec![8, 3, 2, 2]
            } else if name.ends_with("pos_emb.weight") {
                vec![6, 5, 8]
            } else {
                vec![8]
            };
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| ((i * 7919 + name.len()) % 1000) as f32 / 333.0 - 1.5).collect();
            Ok(if bf16 { Tensor::from_bf16(shape, &v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>())? } else { Tensor::from_f32(shape, &v)? })
        };
        VisionTower::load(dims, &get).unwrap()
    }

    /// The position rows as computed before the cache (serial, per call): the oracle.
    fn serial_position_rows(tw: &VisionTower, grids: &[[usize; 3]]) -> Vec<f32> {
        let (c, ih, iw) = (tw.dims.hidden, tw.dims.pos_h, tw.dims.pos_w);
        let mut out = Vec::new();
        for &[t, h, w] in grids {
            let mut pos = vec![0f32; h * w * c];
            for y in 0..h {
                let (h0, h1, lh0, lh1) = bilinear_src(y, ih, h);
                for x in 0..w {
                    let (w0, w1, lw0, lw1) = bilinear_src(x, iw, w);
                    for ch in 0..c {
                        let at = |r: usize, q: usize| tw.pos_emb[(r * iw + q) * c + ch];
                        let v = at(h0, w0) * (lh0 * lw0) + at(h0, w1) * (lh0 * lw1) + at(h1, w0) * (lh1 * lw0) + at(h1, w1) * (lh1 * lw1);
                        pos[(y * w + x) * c + ch] = if tw.pos_emb_bf16 { round_bf16(v) } else { v };
                    }
                }
            }
            let te = time_embedding(t, c);
            for tau in 0..t {
                for r in pos.chunks_exact(c) {
                    out.extend(r.iter().zip(&te[tau * c..(tau + 1) * c]).map(|(a, b)| if t > 1 { a + b } else { *a }));
                }
            }
        }
        out
    }

    /// `None` when `got` has `want`'s length and bits, else where they part.
    fn first_diff(got: &[f32], want: &[f32]) -> Option<String> {
        match got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits()) {
            Some(i) => Some(format!("element {i}: {} vs {}", got[i], want[i])),
            None => (got.len() != want.len()).then(|| format!("{} values vs {}", got.len(), want.len())),
        }
    }

    /// The cached, parallel position rows are the serial computation's bits: cold and warm, for
    /// images and t = 2..3 chunks, transposed grids (4×6 vs 6×4), down- and upscaled tables, bf16
    /// and f32 tables, and with a cache so small that entries are evicted between calls.
    #[test]
    fn cached_position_rows_are_the_serial_computation() {
        let grids = [[1, 4, 6], [1, 6, 4], [2, 4, 6], [3, 2, 2], [1, 4, 6], [1, 6, 5], [1, 9, 11], [2, 9, 11]];
        for bf16 in [true, false] {
            let tw = tiny_tower(bf16);
            let want = serial_position_rows(&tw, &grids);
            assert_eq!(first_diff(&tw.position_rows(&grids), &want), None, "cold cache, bf16 {bf16}");
            assert_eq!(first_diff(&tw.position_rows(&grids), &want), None, "warm cache, bf16 {bf16}");
            assert_eq!(lock(&tw.rows).keys().len(), 8, "one entry per distinct grid, and [1, 2, 2] under [3, 2, 2]");
            for &g in &grids {
                assert_eq!(first_diff(&tw.sample_rows(g), &serial_position_rows(&tw, &[g])), None, "{g:?}");
            }
            // Room for one 9×11 grid's rows (and nothing beside them): evictions on every call.
            *lock(&tw.rows) = RowCache::new(9 * 11 * 8 * 4);
            for _ in 0..2 {
                assert_eq!(first_diff(&tw.position_rows(&grids), &want), None, "evicting cache, bf16 {bf16}");
                assert!(lock(&tw.rows).bytes() <= 9 * 11 * 8 * 4);
            }
        }
    }

    #[test]
    fn bilinear_identity_and_corners() {
        assert_eq!(bilinear_src(3, 8, 8), (3, 3, 1.0, 0.0));
        // Downscale 6 → 4: source 1.5·(o+0.5) − 0.5 → 0.25 for o = 0.
        let (i0, i1, l0, l1) = bilinear_src(0, 6, 4);
        assert_eq!((i0, i1), (0, 1));
        assert!((l1 - 0.25).abs() < 1e-7 && (l0 - 0.75).abs() < 1e-7);
        // Upscale clamps at the border.
        assert_eq!(bilinear_src(7, 4, 8).0, 3);
    }

    #[test]
    fn time_table_starts_with_sin0_cos0_and_gelu_is_tanh_form() {
        let t = time_embedding(2, 8);
        assert_eq!(&t[..8], &[0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        assert!((t[8] - 1f32.sin()).abs() < 1e-7);
        let x = 1.3f32;
        let want = 0.5 * x * (1.0 + ((2.0 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
        assert!((gelu_tanh(x) - want).abs() < 1e-6);
        assert_eq!(round_bf16(1.0 + 1.0 / 512.0), 1.0);
    }
}
