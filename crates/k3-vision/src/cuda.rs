//! The MoonViT3d tower, `sd2_tpool` merger and PatchMergerMLPV2 projector on one NVIDIA GPU
//! (feature `cuda`; around-backbone §3.1–§3.8, the same network as `tower.rs`, `merger.rs`,
//! `projector.rs`, which are its oracle in `tests/cuda_vision.rs`).
//!
//! Shape legend: `L = Σ t·h·w` packed patch rows over the samples of one call (NaViT packing:
//! samples never attend to each other), `C` tower width, `Dq` qkv width, `I` MLP width, `P =
//! 3·ps·ps`; `N = Σ (h/kh)(w/kw)` merged tokens, `K = kh·kw·C` projector width, `T` text width.
//!
//! Weights are uploaded once ([`CudaVision::upload`]) in the [`Precision`]'s dtype: BF16 for
//! serving (every GEMM input BF16, f32 accumulation), F32 for the reference (f32 GEMMs, no TF32).
//! The residual stream `x`, the norms' statistics, softmax and merge are f32 in both. F32 runs
//! one op per launch (`blocks_f32`); BF16 (`blocks_bf16`, issue 24) keeps every activation but
//! `x` in BF16 — the norms write the GEMM inputs as BF16, the qkv and fc0 GEMMs write BF16, RoPE
//! and GELU run in place on them, the wo and fc1 GEMMs add into `x` in their epilogue — and its
//! attention runs the fused flash kernel on the rotated BF16 `qkv`
//! (`k3_core::cuda::vision::vit_flash_attention`, head dims a multiple of 8 up to 128); F32's
//! runs the cuBLAS form (score GEMM, softmax, `P·V` GEMM). Tables are computed on the host
//! exactly as the CPU path does: each sample's position embedding plus time rows
//! ([`VisionTower::sample_rows`]; the CPU adds the two one after the other, here their sum is
//! added) is uploaded once per grid and kept on the device (`row_cache.rs`: images of one size
//! share it); the RoPE cos/sin table and each row's patch position are uploaded per call.
//! GEMMs run through cuBLAS (`Backend::Cublas`: any leading dimension, e.g. `P = 588`).
//!
//! Host side (issue 24: it was ~85% of a call): the samples' pixels go up part by part and the
//! features come back straight into each sample's `Vec`, both through one page-locked staging
//! buffer ([`Staging`], [`STAGING_BYTES`]) whose host copies are spread over rayon threads — no
//! packed pixel `Vec`, no whole-batch feature `Vec` and per-sample copies of it.

use std::sync::Mutex;

use half::bf16;
use k3_core::cuda::blas::{gemm, gemm_add, Backend, GemmOptions, Layout};
use k3_core::cuda::ops::{add_assign, cast, rms_norm_cols};
use k3_core::cuda::pinned::Staging;
use k3_core::cuda::vision::{vit_attention, vit_gelu_erf, vit_gelu_tanh, vit_merge, vit_rms_norm_bf16, vit_rope, vit_rope_bf16_inplace};
pub use k3_core::cuda::CudaDevice;
use k3_core::cuda::CudaTensor;
use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::staging::fresh_f32;
use k3_core::DType;
pub use k3_model::cuda::Precision;

use crate::error::{input, Result, VisionError};
use crate::row_cache::{lock, RowCache, ROW_CACHE_BYTES};
use crate::tower::{patch_positions, rope_side, rope_table, TowerDims, TowerTrace, VisionTower, VIT_NORM_EPS};
use crate::{Projector, VisionModel};

/// Packed rows per tower call at most: longer lists of samples are cut into several calls.
pub const PACK_ROWS: usize = 1 << 16;

/// Bytes of the page-locked staging buffer of each [`CudaVision`].
pub const STAGING_BYTES: usize = k3_core::staging::BUFFER_BYTES;

struct Block {
    norm0: CudaTensor,
    wqkv: CudaTensor,
    wo: CudaTensor,
    norm1: CudaTensor,
    fc0: CudaTensor,
    fc1: CudaTensor,
}

/// The uploaded tower, merger and projector.
pub struct CudaVision {
    pub dev: CudaDevice,
    pub precision: Precision,
    dims: TowerDims,
    merge: (usize, usize),
    /// `[C, P]`.
    patch_embed: CudaTensor,
    blocks: Vec<Block>,
    final_norm: CudaTensor,
    /// `[K, K]`, `[T, K]`, F32 `[T]`.
    w0: CudaTensor,
    w2: CudaTensor,
    post_norm: CudaTensor,
    eps: f32,
    /// Whether [`CudaVision::encode`] copies the tower's and merger's outputs to the host too
    /// (tests and traces; default) or only the projected features a prompt needs (serving: the
    /// two extra F32 downloads and their per-sample copies were most of a call's host time).
    pub keep_stages: bool,
    /// Every grid's position rows `[t·h·w, C]` on the device, made from the tower of the id.
    pos_rows: Mutex<(u64, RowCache<CudaTensor>)>,
    staging: Mutex<Staging>,
}

/// One sample's stages on the host: `vit_out` `[t·h·w, C]`, `merged` `[n, kh·kw·C]`,
/// `projected` `[n, T]`.
pub struct Stages {
    pub vit_out: Vec<f32>,
    pub merged: Vec<f32>,
    pub projected: Vec<f32>,
}

fn opts() -> GemmOptions {
    GemmOptions { backend: Backend::Cublas, ..Default::default() }
}

/// `out[M, N] = x[M, K] · w[N, K]ᵀ` as `dt`.
fn lin(x: &CudaTensor, w: &CudaTensor, dt: DType) -> Result<CudaTensor> {
    let rows = x.numel() / x.last_dim().max(1);
    let out = CudaTensor::uninit(x.cuda_device(), dt, vec![rows, w.shape()[0]])?;
    gemm(x, w, &out, Layout::BT, opts())?;
    Ok(out)
}

fn werr(name: &str) -> impl FnOnce(k3_core::CoreError) -> VisionError + '_ {
    move |e| VisionError::Weight { name: name.into(), msg: format!("uploading to the GPU: {e}") }
}

/// A weight `[rows, cols]` on the device as `dt` (BF16 bytes go up as they are).
fn matrix(dev: &CudaDevice, m: &Matrix, rows: usize, cols: usize, dt: DType, name: &str) -> Result<CudaTensor> {
    if m.rows() != rows || m.cols() != cols {
        return Err(VisionError::Weight { name: name.into(), msg: format!("is [{}, {}], expected [{rows}, {cols}]", m.rows(), m.cols()) });
    }
    if let (Matrix::Dense(t), DType::BF16) = (m, dt) {
        if t.dtype() == DType::BF16 {
            return CudaTensor::from_pod(dev, DType::BF16, vec![rows, cols], t.bytes()).map_err(werr(name));
        }
    }
    let v = m.to_f32();
    match dt {
        DType::F32 => CudaTensor::from_f32(dev, vec![rows, cols], &v),
        _ => CudaTensor::from_bf16(dev, vec![rows, cols], &v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>()),
    }
    .map_err(werr(name))
}

fn vector(dev: &CudaDevice, v: &[f32], name: &str) -> Result<CudaTensor> {
    CudaTensor::from_f32(dev, vec![v.len()], v).map_err(werr(name))
}

impl CudaVision {
    /// Uploads `model`'s tower and projector to `dev` in `precision`.
    pub fn upload(model: &VisionModel, dev: &CudaDevice, precision: Precision) -> Result<CudaVision> {
        let (tw, pj): (&VisionTower, &Projector) = (&model.tower, &model.projector);
        let d = tw.dims;
        let dt = precision.dtype();
        let (c, q, i, p) = (d.hidden, d.qkv, d.intermediate, 3 * d.patch * d.patch);
        let n = |b: usize, s: &str| format!("vision_tower.encoder.blocks.{b}.{s}");
        let blocks = tw
            .blocks
            .iter()
            .enumerate()
            .map(|(b, blk)| {
                Ok(Block {
                    norm0: vector(dev, &blk.norm0, &n(b, "norm0.weight"))?,
                    wqkv: matrix(dev, &blk.wqkv, 3 * q, c, dt, &n(b, "wqkv.weight"))?,
                    wo: matrix(dev, &blk.wo, c, q, dt, &n(b, "wo.weight"))?,
                    norm1: vector(dev, &blk.norm1, &n(b, "norm1.weight"))?,
                    fc0: matrix(dev, &blk.fc0, i, c, dt, &n(b, "mlp.fc0.weight"))?,
                    fc1: matrix(dev, &blk.fc1, c, i, dt, &n(b, "mlp.fc1.weight"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let k = pj.in_width();
        Ok(CudaVision {
            dev: dev.clone(),
            precision,
            dims: d,
            merge: model.spec.merge,
            patch_embed: matrix(dev, &tw.patch_embed, c, p, dt, "vision_tower.patch_embed.proj.weight")?,
            blocks,
            final_norm: vector(dev, &tw.final_norm, "vision_tower.encoder.final_layernorm.weight")?,
            w0: matrix(dev, &pj.w0, k, k, dt, "mm_projector.proj.0.weight")?,
            w2: matrix(dev, &pj.w2, pj.out_width(), k, dt, "mm_projector.proj.2.weight")?,
            post_norm: vector(dev, &pj.post_norm, "mm_projector.post_norm.weight")?,
            eps: pj.eps,
            keep_stages: true,
            pos_rows: Mutex::new((tw.id(), RowCache::new(ROW_CACHE_BYTES))),
            staging: Mutex::new(Staging::new(dev, STAGING_BYTES)?),
        })
    }

    fn dtype(&self) -> DType {
        self.precision.dtype()
    }

    /// `x` as the GEMM input dtype (a cast copy for BF16, `x` itself for F32).
    fn gemm_input(&self, x: &CudaTensor) -> Result<CudaTensor> {
        if self.dtype() == DType::F32 {
            return Ok(x.clone());
        }
        let out = CudaTensor::uninit(&self.dev, self.dtype(), x.shape().to_vec())?;
        cast(x, &out)?;
        Ok(out)
    }

    /// The host slices `parts`, in order, into all of `dst` through the staging buffer.
    fn upload_f32(&self, dst: &CudaTensor, parts: &[&[f32]]) -> Result<()> {
        let bytes: Vec<&[u8]> = parts.iter().map(|p| bytemuck::cast_slice::<f32, u8>(p)).collect();
        Ok(lock(&self.staging).upload(dst, &bytes)?)
    }

    /// `src` F32 `[R, W]` on the host, cut into consecutive blocks of `rows[i]` rows (straight
    /// into each block's fresh `Vec` through the staging buffer; waits for the stream).
    pub fn download_rows(&self, src: &CudaTensor, rows: &[usize]) -> Result<Vec<Vec<f32>>> {
        if src.dtype() != DType::F32 {
            return Err(input(format!("download_rows takes F32 tensors, not {src:?}")));
        }
        let w = src.last_dim();
        let mut out: Vec<Vec<f32>> = rows.iter().map(|&r| fresh_f32(r * w)).collect();
        let mut bytes: Vec<&mut [u8]> = out.iter_mut().map(|v| bytemuck::cast_slice_mut::<f32, u8>(v)).collect();
        lock(&self.staging).download(src, &mut bytes)?;
        drop(bytes);
        Ok(out)
    }

    /// One sample's position rows on the device, `[t·h·w, C]` ([`VisionTower::sample_rows`],
    /// uploaded on the grid's first use and kept).
    fn sample_rows(&self, cpu: &VisionTower, grid: [usize; 3]) -> Result<CudaTensor> {
        let mut cache = lock(&self.pos_rows);
        if cache.0 != cpu.id() {
            *cache = (cpu.id(), RowCache::new(ROW_CACHE_BYTES));
        }
        if let Some(t) = cache.1.get(grid) {
            return Ok(t);
        }
        let (host, c) = (cpu.sample_rows(grid), self.dims.hidden);
        let t = CudaTensor::uninit(&self.dev, DType::F32, vec![host.len() / c, c])?;
        self.upload_f32(&t, &[&host])?;
        cache.1.insert(grid, t.clone(), t.byte_len());
        Ok(t)
    }

    /// What is added to the patch embeddings of the packed batch, F32 `[L, C]`: the samples'
    /// cached rows (one sample: its entry itself; several: copied side by side on the device).
    fn position_rows(&self, cpu: &VisionTower, grids: &[[usize; 3]], l: usize) -> Result<CudaTensor> {
        let rows = grids.iter().map(|&g| self.sample_rows(cpu, g)).collect::<Result<Vec<_>>>()?;
        if let [one] = rows.as_slice() {
            return Ok(one.clone());
        }
        let all = CudaTensor::uninit(&self.dev, DType::F32, vec![l, self.dims.hidden])?;
        let mut at = 0;
        for r in &rows {
            all.copy_range(at, r, 0, r.byte_len())?;
            at += r.byte_len();
        }
        Ok(all)
    }

    /// The tower on packed patches `pixels` `[L, 3, ps, ps]` of samples `grids` (checked as the
    /// CPU tower checks them, against `cpu`, whose host tables are used): F32 `[L, C]` after
    /// `final_layernorm`. `trace` receives `vit_patch_embed` and `vit_block{j}_out` (copied to
    /// the host; only when given).
    pub fn tower(&self, cpu: &VisionTower, pixels: &[f32], grids: &[[usize; 3]], trace: TowerTrace<'_>) -> Result<CudaTensor> {
        self.tower_parts(cpu, &[pixels], grids, trace)
    }

    /// [`Self::tower`] on the batch packed from the slices `parts` in order (uploaded one after
    /// the other, never concatenated on the host).
    pub fn tower_parts(&self, cpu: &VisionTower, parts: &[&[f32]], grids: &[[usize; 3]], mut trace: TowerTrace<'_>) -> Result<CudaTensor> {
        let l = cpu.check_parts(parts, grids)?;
        if cpu.dims != self.dims {
            return Err(input(format!("the GPU tower was uploaded for {:?}, the host tower is {:?}", self.dims, cpu.dims)));
        }
        let (d, dev, dt) = (self.dims, &self.dev, self.dtype());
        let (c, p, hd) = (d.hidden, 3 * d.patch * d.patch, d.head_dim());
        let px = {
            let px = CudaTensor::uninit(dev, DType::F32, vec![l, p])?;
            self.upload_f32(&px, parts)?;
            self.gemm_input(&px)?
        };
        let x = lin(&px, &self.patch_embed, DType::F32)?;
        drop(px);
        add_assign(&x, &self.position_rows(cpu, grids, l)?)?;
        if let Some(f) = trace.as_mut() {
            f("vit_patch_embed", &x.to_f32_vec()?);
        }
        let side = rope_side(grids);
        let (cos, sin) = rope_table(hd, side);
        let cos = CudaTensor::from_f32(dev, vec![side, hd / 4], &cos)?;
        let sin = CudaTensor::from_f32(dev, vec![side, hd / 4], &sin)?;
        let rc: Vec<i32> = patch_positions(grids).into_iter().flat_map(|(r, c)| [r as i32, c as i32]).collect();
        let rc = CudaTensor::from_pod(dev, DType::I32, vec![l, 2], &rc)?;
        let lens: Vec<usize> = grids.iter().map(|g| g[0] * g[1] * g[2]).collect();
        let tables = Tables { rc: &rc, cos: &cos, sin: &sin, lens: &lens };
        match dt {
            DType::F32 => self.blocks_f32(&x, &tables, &mut trace)?,
            _ => self.blocks_bf16(&x, &tables, &mut trace)?,
        }
        let out = CudaTensor::uninit(dev, DType::F32, vec![l, c])?;
        rms_norm_cols(&x, c, &self.final_norm, VIT_NORM_EPS, &out)?;
        Ok(out)
    }

    /// The blocks of the F32 reference on the residual stream `x` F32 `[L, C]`, one op per
    /// launch: every GEMM output F32, RoPE in place, GELU into a copy, residual adds after the GEMMs.
    fn blocks_f32(&self, x: &CudaTensor, r: &Tables<'_>, trace: &mut TowerTrace<'_>) -> Result<()> {
        let (d, dev, l) = (self.dims, &self.dev, x.shape()[0]);
        let hn = CudaTensor::uninit(dev, DType::F32, vec![l, d.hidden])?;
        for (j, b) in self.blocks.iter().enumerate() {
            rms_norm_cols(x, d.hidden, &b.norm0, VIT_NORM_EPS, &hn)?;
            let qkv = lin(&hn, &b.wqkv, DType::F32)?;
            vit_rope(&qkv, r.rc, r.cos, r.sin, d.heads, &qkv)?;
            let att = CudaTensor::uninit(dev, DType::F32, vec![l, d.qkv])?;
            vit_attention(&qkv, d.heads, r.lens, &att)?;
            drop(qkv);
            add_assign(x, &lin(&att, &b.wo, DType::F32)?)?;
            drop(att);
            rms_norm_cols(x, d.hidden, &b.norm1, VIT_NORM_EPS, &hn)?;
            let f = lin(&hn, &b.fc0, DType::F32)?;
            let g = CudaTensor::uninit(dev, DType::F32, vec![l, d.intermediate])?;
            vit_gelu_tanh(&f, &g)?;
            drop(f);
            add_assign(x, &lin(&g, &b.fc1, DType::F32)?)?;
            trace_block(trace, j, x)?;
        }
        Ok(())
    }

    /// The blocks in BF16 on the residual stream `x` F32 `[L, C]`, nine launches a block (issue
    /// 24: the elementwise passes were ~20% of a call): the norms write BF16 GEMM inputs straight
    /// from `x` (`vit_rms_norm_bf16`), the qkv and fc0 GEMMs write BF16 (f32 accumulation, one
    /// rounding), RoPE and GELU run in place on them, and the wo and fc1 GEMMs add into `x` in
    /// their epilogue (`gemm_add`, f32) — no F32 activation but `x`, no separate add or cast.
    fn blocks_bf16(&self, x: &CudaTensor, r: &Tables<'_>, trace: &mut TowerTrace<'_>) -> Result<()> {
        let (d, dev, l) = (self.dims, &self.dev, x.shape()[0]);
        let bf = |w: usize| CudaTensor::uninit(dev, DType::BF16, vec![l, w]);
        let (hn, qkv, att, f) = (bf(d.hidden)?, bf(3 * d.qkv)?, bf(d.qkv)?, bf(d.intermediate)?);
        for (j, b) in self.blocks.iter().enumerate() {
            vit_rms_norm_bf16(x, &b.norm0, VIT_NORM_EPS, &hn)?;
            gemm(&hn, &b.wqkv, &qkv, Layout::BT, opts())?;
            vit_rope_bf16_inplace(&qkv, r.rc, r.cos, r.sin, d.heads)?;
            vit_attention(&qkv, d.heads, r.lens, &att)?;
            gemm_add(&att, &b.wo, x, Layout::BT)?;
            vit_rms_norm_bf16(x, &b.norm1, VIT_NORM_EPS, &hn)?;
            gemm(&hn, &b.fc0, &f, Layout::BT, opts())?;
            vit_gelu_tanh(&f, &f)?;
            gemm_add(&f, &b.fc1, x, Layout::BT)?;
            trace_block(trace, j, x)?;
        }
        Ok(())
    }

    /// `sd2_tpool` of every sample of the tower's output `vit` F32 `[L, C]`: F32 `[N, K]`.
    pub fn merge(&self, vit: &CudaTensor, grids: &[[usize; 3]]) -> Result<CudaTensor> {
        let (kh, kw) = self.merge;
        check_merge(grids, kh, kw)?;
        let n: usize = grids.iter().map(|g| (g[1] / kh) * (g[2] / kw)).sum();
        let out = CudaTensor::uninit(&self.dev, DType::F32, vec![n, kh * kw * self.dims.hidden])?;
        vit_merge(vit, grids, kh, kw, &out)?;
        Ok(out)
    }

    /// The projector on merged tokens F32 `[N, K]`: F32 `[N, T]`.
    pub fn project(&self, merged: &CudaTensor) -> Result<CudaTensor> {
        let u = lin(&self.gemm_input(merged)?, &self.w0, DType::F32)?;
        let g = CudaTensor::uninit(&self.dev, self.dtype(), u.shape().to_vec())?;
        vit_gelu_erf(&u, &g)?;
        drop(u);
        let y = lin(&g, &self.w2, DType::F32)?;
        let th = self.post_norm.numel();
        let out = CudaTensor::uninit(&self.dev, DType::F32, y.shape().to_vec())?;
        rms_norm_cols(&y, th, &self.post_norm, self.eps, &out)?;
        Ok(out)
    }

    /// Every stage of each sample (`(pixels [t·h·w, 3, ps, ps], grid)`), the samples packed into
    /// tower calls of up to [`PACK_ROWS`] rows; per sample the host copies of its stages.
    pub fn encode(&self, cpu: &VisionTower, samples: &[(&[f32], [usize; 3])]) -> Result<Vec<Stages>> {
        let (kh, kw) = self.merge;
        let grids: Vec<[usize; 3]> = samples.iter().map(|s| s.1).collect();
        check_merge(&grids, kh, kw)?;
        let mut out = Vec::with_capacity(samples.len());
        let mut start = 0;
        while start < samples.len() {
            let mut end = start + 1;
            let mut rows = rows_of(grids[start]);
            while end < samples.len() && rows + rows_of(grids[end]) <= PACK_ROWS {
                rows += rows_of(grids[end]);
                end += 1;
            }
            let parts: Vec<&[f32]> = samples[start..end].iter().map(|s| s.0).collect();
            let g = &grids[start..end];
            let vit = self.tower_parts(cpu, &parts, g, None)?;
            let merged = self.merge(&vit, g)?;
            let projected = self.project(&merged)?;
            let rows: Vec<usize> = g.iter().map(|&grid| rows_of(grid)).collect();
            let tokens: Vec<usize> = g.iter().map(|grid| (grid[1] / kh) * (grid[2] / kw)).collect();
            let (vit, merged) = match self.keep_stages {
                true => (self.download_rows(&vit, &rows)?, self.download_rows(&merged, &tokens)?),
                false => (vec![Vec::new(); g.len()], vec![Vec::new(); g.len()]),
            };
            let projected = self.download_rows(&projected, &tokens)?;
            for ((vit_out, merged), projected) in vit.into_iter().zip(merged).zip(projected) {
                out.push(Stages { vit_out, merged, projected });
            }
            start = end;
        }
        Ok(out)
    }
}

/// The per-call tables every block's RoPE and attention read: each row's patch position `rc`
/// I32 `[L, 2]`, the `cos`/`sin` tables F32 `[side, hd/4]`, and the samples' row counts.
struct Tables<'a> {
    rc: &'a CudaTensor,
    cos: &'a CudaTensor,
    sin: &'a CudaTensor,
    lens: &'a [usize],
}

/// `vit_block{j}_out` to the trace, when there is one.
fn trace_block(trace: &mut TowerTrace<'_>, j: usize, x: &CudaTensor) -> Result<()> {
    if let Some(f) = trace.as_mut() {
        f(&format!("vit_block{j}_out"), &x.to_f32_vec()?);
    }
    Ok(())
}

fn rows_of(g: [usize; 3]) -> usize {
    g[0] * g[1] * g[2]
}

/// The CPU merger's refusal of a grid that is not a multiple of the merge kernel.
fn check_merge(grids: &[[usize; 3]], kh: usize, kw: usize) -> Result<()> {
    match grids.iter().find(|g| kh == 0 || kw == 0 || g[1] % kh != 0 || g[2] % kw != 0) {
        Some(g) => Err(input(format!("grid {}x{} is not a multiple of the {kh}x{kw} merge kernel", g[1], g[2]))),
        None => Ok(()),
    }
}
