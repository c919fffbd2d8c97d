//! Launchers for gated MLA in the absorbed form over a paged latent cache (text-backbone §4;
//! kernels in `kernels/cuda/mla.cu`, CPU oracle k3-model `layers/mla.rs`, absorbed branch of
//! `attend`).
//!
//! Shape legend: `N` packed rows (tokens of possibly several sequences), `B` sequences, `nh`
//! heads, `r` latent width (`kv_lora_rank`), `dr` rope width, `W = r + dr`; the cache of one
//! layer is BF16 `[num_pages, PAGE, W]` (normed `c_kv` then raw `k_pe` per token), or FP8: U8
//! `[num_pages, PAGE, row_bytes]` in vLLM's `fp8_ds_mla` layout (k3-core `fp8::LatentFp8`, 656 B
//! for K3), addressed through a block table of page ids. `r` and `dr` must be multiples of 8 (16-byte rows), and
//! `r <= 2048`.
//!
//! Both functions are CUDA-graph capturable: no host sync, no device reads on the host; the
//! split partials of [`mla_attend`] come from [`CudaTensor::uninit`].

use super::{derr, kargs, CudaDevice, CudaTensor};
use crate::fp8::{self, LatentFp8};
use crate::kernels::cuda::{MLA, MLA_PREFILL};
use crate::{CoreError, DType, Result};

/// Tokens per cache page.
pub const PAGE: usize = 64;
const OP_APPEND: &str = "cuda mla_cache_append";
const OP_ATTEND: &str = "cuda mla_attend";
/// Keys per tile of the CUDA-core and (double-buffered) tensor-core attend kernels, and their
/// block size.
const TILE: usize = 32;
const TC_TILE: usize = 32;
const THREADS: u32 = 256;
/// A split covers at least this many keys.
const MIN_SPLIT_KEYS: usize = 256;

/// Describes one packed step over paged caches (all I32 device tensors, prepared by the caller
/// before the step).
pub struct PagedBatch<'a> {
    /// I32 `[B, max_pages]`: page ids of each sequence, in order.
    pub block_table: &'a CudaTensor,
    /// I32 `[N]`: which sequence (row of `block_table`) each packed row belongs to.
    pub row_seq: &'a CudaTensor,
    /// I32 `[N]`: absolute position of each packed row's token in its sequence.
    pub row_pos: &'a CudaTensor,
}

impl PagedBatch<'_> {
    /// Validates dtypes, ranks and devices; returns (N, max_pages).
    pub(crate) fn check(&self, op: &'static str, dev: &CudaDevice) -> Result<(usize, usize)> {
        for (name, t) in [("block_table", self.block_table), ("row_seq", self.row_seq), ("row_pos", self.row_pos)] {
            if t.dtype() != DType::I32 {
                return Err(CoreError::DType { op, dtype: format!("{name} is {} (I32 needed)", t.dtype()) });
            }
            if !t.cuda_device().same(dev) {
                return Err(CoreError::Shape { op, detail: format!("{name} {t:?} is on another device") });
            }
        }
        if self.block_table.shape().len() != 2 {
            return Err(CoreError::Shape { op, detail: format!("block_table {:?} must be [B, max_pages]", self.block_table) });
        }
        let n = self.row_seq.numel();
        if self.row_seq.shape().len() != 1 || self.row_pos.shape() != [n] {
            return Err(CoreError::Shape { op, detail: format!("row_seq {:?} and row_pos {:?} must both be [N]", self.row_seq, self.row_pos) });
        }
        Ok((n, self.block_table.shape()[1]))
    }
}

pub(crate) fn same_dev(op: &'static str, dev: &CudaDevice, ts: &[(&str, &CudaTensor)]) -> Result<()> {
    for (name, t) in ts {
        if !t.cuda_device().same(dev) {
            return Err(CoreError::Shape { op, detail: format!("{name} {t:?} is on another device") });
        }
    }
    Ok(())
}

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CoreError::Shape { op, detail: format!("{what} = {v} exceeds i32") })
}

fn aligned16(op: &'static str, ts: &[(&str, &CudaTensor)]) -> Result<()> {
    for (name, t) in ts {
        if !t.ptr().is_multiple_of(16) {
            return Err(CoreError::Shape { op, detail: format!("{name} must start on a 16-byte boundary (pass a whole tensor, not an offset view)") });
        }
    }
    Ok(())
}

/// Cache geometry: (num_pages, W) after checking `cache` is BF16 (or F32, the reference
/// precision) `[num_pages, PAGE, W]`.
fn cache_dims(op: &'static str, cache: &CudaTensor) -> Result<(usize, usize)> {
    if !matches!(cache.dtype(), DType::BF16 | DType::F32) || cache.shape().len() != 3 || cache.shape()[1] != PAGE {
        return Err(CoreError::Shape {
            op,
            detail: format!("cache {cache:?} must be BF16 (or F32) [num_pages, {PAGE}, r+dr], or U8 [num_pages, {PAGE}, fp8 row bytes]"),
        });
    }
    Ok((cache.shape()[0], cache.shape()[2]))
}

/// The FP8 layout of a U8 cache `[num_pages, PAGE, row_bytes]` holding `r + dr = w` values per
/// token (`None` for a BF16 / F32 cache).
fn fp8_layout(op: &'static str, cache: &CudaTensor, r: usize, w: usize) -> Result<Option<LatentFp8>> {
    if cache.dtype() != DType::U8 {
        return Ok(None);
    }
    if r == 0 || r >= w {
        return Err(CoreError::Shape { op, detail: format!("r = {r} with {w} values per token: need 0 < r < r + dr") });
    }
    let lay = LatentFp8 { r, dr: w - r };
    if cache.shape() != [cache.shape()[0], PAGE, lay.row_bytes()] {
        return Err(CoreError::Shape {
            op,
            detail: format!("FP8 cache {cache:?} must be U8 [num_pages, {PAGE}, {}] for r = {r}, dr = {}", lay.row_bytes(), w - r),
        });
    }
    Ok(Some(lay))
}

/// Bytes per token of a latent cache row: BF16 `2 (r + dr)`, F32 `4 (r + dr)`, FP8
/// [`LatentFp8::row_bytes`] (`fp8_ds_mla`: 656 for K3).
pub fn cache_row_bytes(dtype: DType, r: usize, dr: usize) -> usize {
    match dtype {
        DType::U8 => LatentFp8 { r, dr }.row_bytes(),
        d => d.size_in_bytes() * (r + dr),
    }
}

/// Appends N rows to a layer's latent cache: `cache[page(row_seq,row_pos)][row_pos % PAGE] =
/// [ RMSNorm(ckv[i, :r]) * kv_norm (eps), ckv[i, r:] (raw k_pe) ]` stored BF16 (f32 statistics).
/// `ckv` F32 or BF16 `[N, r+dr]`, `kv_norm` F32 `[r]`, cache BF16 `[num_pages, PAGE, r+dr]`; or
/// the reference precision: `ckv` and the cache both F32.
/// Rows whose page entry or position is out of range are the caller's error (not checked on the device).
pub fn mla_cache_append(ckv: &CudaTensor, kv_norm: &CudaTensor, eps: f32, batch: &PagedBatch, cache: &CudaTensor) -> Result<()> {
    const OP: &str = OP_APPEND;
    let dev = ckv.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    same_dev(OP, dev, &[("kv_norm", kv_norm), ("cache", cache)])?;
    if cache.dtype() == DType::U8 {
        return append_fp8(ckv, kv_norm, eps, batch, cache);
    }
    let (_, w) = cache_dims(OP, cache)?;
    let r = kv_norm.numel();
    if kv_norm.dtype() != DType::F32 || kv_norm.shape().len() != 1 || r == 0 || r >= w {
        return Err(CoreError::Shape { op: OP, detail: format!("kv_norm {kv_norm:?} must be F32 [r] with 0 < r < cache width {w}") });
    }
    let dr = w - r;
    if !r.is_multiple_of(8) || !dr.is_multiple_of(8) {
        return Err(CoreError::Shape { op: OP, detail: format!("r = {r} and dr = {dr} must be multiples of 8") });
    }
    if ckv.shape() != [n, w] {
        return Err(CoreError::Shape { op: OP, detail: format!("ckv {ckv:?} must be [N={n}, r+dr={w}]") });
    }
    let name = match (ckv.dtype(), cache.dtype()) {
        (DType::F32, DType::BF16) => "mla_cache_append_f32",
        (DType::BF16, DType::BF16) => "mla_cache_append_bf16",
        (DType::F32, DType::F32) => "mla_cache_append_f32c",
        (d, c) => return Err(CoreError::DType { op: OP, dtype: format!("ckv {d} into a {c} cache (F32 or BF16 into BF16, or F32 into F32)") }),
    };
    if n == 0 {
        return Ok(());
    }
    let rows = u32::try_from(n).map_err(|_| CoreError::Shape { op: OP, detail: format!("{n} rows exceed the grid") })?;
    let (mp, r32, dr32) = (i32_of(OP, "max_pages", max_pages)?, r as i32, dr as i32);
    let (cp, kp, bt, rs, rp, cc) = (ckv.ptr(), kv_norm.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), cache.ptr());
    dev.launch(MLA, name, (rows, 1, 1), (128, 1, 1), 0, &mut kargs![cp, kp, eps, bt, mp, rs, rp, cc, r32, dr32])
}

/// [`mla_cache_append`] into an FP8 cache (U8 `[num_pages, PAGE, row_bytes]`, `fp8_ds_mla`):
/// the normed latent quantized per 128-value tile with a power-of-two scale, `k_pe` BF16
/// (k3-core `fp8::LatentFp8`, which the kernel matches bit for bit).
fn append_fp8(ckv: &CudaTensor, kv_norm: &CudaTensor, eps: f32, batch: &PagedBatch, cache: &CudaTensor) -> Result<()> {
    const OP: &str = OP_APPEND;
    let dev = ckv.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    let r = kv_norm.numel();
    if kv_norm.dtype() != DType::F32 || kv_norm.shape().len() != 1 || ckv.shape().len() != 2 || ckv.shape()[0] != n {
        return Err(CoreError::Shape { op: OP, detail: format!("kv_norm {kv_norm:?} must be F32 [r] and ckv {ckv:?} [N={n}, r+dr]") });
    }
    let w = ckv.shape()[1];
    let lay = fp8_layout(OP, cache, r, w)?.expect("a U8 cache");
    if !r.is_multiple_of(8) || !lay.dr.is_multiple_of(8) {
        return Err(CoreError::Shape { op: OP, detail: format!("r = {r} and dr = {} must be multiples of 8", lay.dr) });
    }
    let name = match ckv.dtype() {
        DType::F32 => "mla_cache_append_fp8_f32",
        DType::BF16 => "mla_cache_append_fp8_bf16",
        d => return Err(CoreError::DType { op: OP, dtype: format!("ckv {d} into an FP8 cache (F32 or BF16)") }),
    };
    if n == 0 {
        return Ok(());
    }
    let rows = u32::try_from(n).map_err(|_| CoreError::Shape { op: OP, detail: format!("{n} rows exceed the grid") })?;
    let (mp, r32, dr32, pe, rb) = (i32_of(OP, "max_pages", max_pages)?, r as i32, lay.dr as i32, lay.pe_offset() as i32, lay.row_bytes() as i32);
    let (cp, kp, bt, rs, rp, cc) = (ckv.ptr(), kv_norm.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), cache.ptr());
    // Exactly 128 threads: one value of every 128-value tile per thread (mla.cu).
    dev.launch(MLA, name, (rows, 1, 1), (fp8::TILE as u32, 1, 1), 0, &mut kargs![cp, kp, eps, bt, mp, rs, rp, cc, r32, dr32, pe, rb])
}

/// Heads per block of the tensor-core kernel: 16 or 32 (`K3_MLA_HEADS_PER_BLOCK`, read once;
/// default 16). 32 loads (and, over an FP8 cache, expands) each key tile once per 32 heads.
fn tc_heads() -> usize {
    static H: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *H.get_or_init(|| match std::env::var("K3_MLA_HEADS_PER_BLOCK").as_deref() {
        Ok("32") => 32,
        _ => 16,
    })
}

/// Kernel variant for latent width `r`: (name, heads per block).
fn variant(r: usize) -> Option<(&'static str, usize)> {
    match r {
        0..=512 => Some(("mla_attend_tc", tc_heads())),
        513..=1024 => Some(("mla_attend_p2", 8)),
        1025..=2048 => Some(("mla_attend_p4", 4)),
        _ => None,
    }
}

/// Dynamic shared memory of the attend kernels (layouts in `mla.cu`).
fn attend_smem(name: &str, w: usize, hgm: usize, fp8: Option<LatentFp8>) -> usize {
    if name == "mla_attend_tc" {
        let kst = w.div_ceil(16) * 16 + 8;
        let keys = match fp8 {
            Some(l) => TC_TILE * kst * 2 + 2 * TC_TILE * l.row_bytes(), // one BF16 tile + two raw ones
            None => 2 * TC_TILE * kst * 2,
        };
        // qs | keys | ss [2][HB][36] f32 | pb [HB][40] bf16 | m, l, alpha [HB] f32 | rowoff
        hgm * kst * 2 + keys + 2 * hgm * 36 * 4 + hgm * 40 * 2 + 3 * hgm * 4 + 2 * TC_TILE * 8
    } else {
        hgm * w * 4 + TILE * (w + 8) * 2 + (35 * hgm + 2) * 4 + TILE * 8
    }
}

/// Number of key splits: about one wave of blocks (two per SM), each split >= MIN_SPLIT_KEYS
/// keys (more splits cost partial-accumulator traffic: splits·nh·r·8 bytes per row).
fn num_splits(dev: &CudaDevice, base_blocks: usize, max_keys: usize) -> usize {
    let target = 2 * dev.info().multiprocessors.max(1) as usize;
    let want = target.div_ceil(base_blocks.max(1));
    want.min(max_keys.div_ceil(MIN_SPLIT_KEYS)).clamp(1, 1024)
}

/// Absorbed attention core. `q` BF16 `[N, nh, r+dr]` is the absorbed query per head
/// `[q_lat (r) | q_pe (dr)]`. Row i, head h attends to positions `0..=row_pos[i]` of sequence
/// `row_seq[i]` (the cache already holds them), or, when `sel` = (`sel_idx` I32 `[N, K]`,
/// `sel_count` I32 `[N]`) is given, to the positions `sel_idx[i, 0..sel_count[i]]`.
/// `score = (q_lat·c_kv[s] + q_pe·k_pe[s]) * scale`; softmax in f32;
/// `out[i,h,:] = Σ p_s c_kv[s]` BF16 `[N, nh, r]` (the caller multiplies by `W_uv`).
/// Flash-decoding: keys are split across blocks when rows × head groups do not fill the GPU.
/// For `r <= 512` scores and `P·V` run on tensor cores (bf16 operands, P rounded to bf16, f32
/// accumulation); larger `r` uses a CUDA-core kernel (f32 P). With `q`, the cache and `out` all
/// F32 (the reference precision) a plain f32 kernel runs instead (`mla_attend_f32`, r ≤ 2048).
pub fn mla_attend(
    q: &CudaTensor,
    cache: &CudaTensor,
    batch: &PagedBatch,
    sel: Option<(&CudaTensor, &CudaTensor)>,
    r: usize,
    scale: f32,
    out: &CudaTensor,
) -> Result<()> {
    const OP: &str = OP_ATTEND;
    let dev = q.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    same_dev(OP, dev, &[("cache", cache), ("out", out)])?;
    // Values per token: the cache's width, or for an FP8 cache (U8 rows) the query's.
    let w = if cache.dtype() == DType::U8 { q.shape().get(2).copied().unwrap_or(0) } else { cache_dims(OP, cache)?.1 };
    if r == 0 || r >= w || !r.is_multiple_of(8) || !(w - r).is_multiple_of(8) {
        return Err(CoreError::Shape { op: OP, detail: format!("r = {r} with cache width {w}: r and dr = width - r must be positive multiples of 8") });
    }
    let fp8 = fp8_layout(OP, cache, r, w)?;
    if q.dtype() == DType::F32 && fp8.is_none() {
        return attend_f32(q, cache, batch, sel, r, scale, out);
    }
    if !matches!(cache.dtype(), DType::BF16 | DType::U8) || q.dtype() != DType::BF16 {
        return Err(CoreError::DType {
            op: OP,
            dtype: format!("{} cache with a {} query (a BF16 query over a BF16 or FP8 cache, or q, cache and out F32)", cache.dtype(), q.dtype()),
        });
    }
    let (name, hgm) = variant(r).ok_or_else(|| CoreError::Shape { op: OP, detail: format!("r = {r} > 2048 is not supported by the attend kernel") })?;
    if fp8.is_some() && name != "mla_attend_tc" {
        return Err(CoreError::Shape {
            op: OP,
            detail: format!("an FP8 latent cache needs r <= 512 (the tensor-core kernel); r = {r}: use --kv-cache-dtype bf16"),
        });
    }
    if q.dtype() != DType::BF16 || q.shape().len() != 3 || q.shape()[0] != n || q.shape()[2] != w {
        return Err(CoreError::Shape { op: OP, detail: format!("q {q:?} must be BF16 [N={n}, nh, r+dr={w}]") });
    }
    let nh = q.shape()[1];
    if out.dtype() != DType::BF16 || out.shape() != [n, nh, r] {
        return Err(CoreError::Shape { op: OP, detail: format!("out {out:?} must be BF16 [N={n}, nh={nh}, r={r}]") });
    }
    let (sel_idx, sel_count, sel_k) = selection(dev, sel, n)?;
    aligned16(OP, &[("q", q), ("cache", cache)])?;
    if n == 0 || nh == 0 {
        return Ok(());
    }
    let max_keys = if sel.is_some() { sel_k } else { max_pages * PAGE };
    if max_keys == 0 {
        return out.fill_bytes(0);
    }
    let groups = nh.div_ceil(hgm);
    let rows = u32::try_from(n).ok().filter(|&v| v < (1 << 31)).ok_or_else(|| CoreError::Shape { op: OP, detail: format!("{n} rows exceed the grid") })?;
    let splits = num_splits(dev, n * groups, max_keys);
    let smem = attend_smem(name, w, hgm, fp8);
    if smem > 227 * 1024 {
        return Err(CoreError::Shape { op: OP, detail: format!("cache width {w} needs {smem} bytes of shared memory (> 227 KiB)") });
    }
    let kname = match (name, hgm, fp8.is_some()) {
        ("mla_attend_tc", 32, true) => "mla_attend_tc32_fp8",
        ("mla_attend_tc", 32, false) => "mla_attend_tc32",
        ("mla_attend_tc", _, true) => "mla_attend_tc_fp8",
        _ => name,
    };
    let f = dev.function(MLA, kname)?;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(derr("raising the shared-memory limit of mla_attend"))?;
    let (part_acc, part_ml) = if splits > 1 {
        (Some(CudaTensor::uninit(dev, DType::F32, vec![n, splits, nh, r])?), Some(CudaTensor::uninit(dev, DType::F32, vec![n, splits, nh, 2])?))
    } else {
        (None, None)
    };
    let pa = part_acc.as_ref().map_or(0, |t| t.ptr());
    let pm = part_ml.as_ref().map_or(0, |t| t.ptr());
    let (mp, sk, nh32, r32, dr32, sp32) =
        (i32_of(OP, "max_pages", max_pages)?, i32_of(OP, "K", sel_k)?, i32_of(OP, "nh", nh)?, r as i32, (w - r) as i32, splits as i32);
    let (qp, cp, bt, rs, rp, op) = (q.ptr(), cache.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), out.ptr());
    let grid = (rows, groups as u32, splits as u32);
    if name == "mla_attend_tc" {
        // The tensor-core kernels take the FP8 layout's offsets (zeros over a BF16 cache).
        let (pe, rb) = fp8.map_or((0, 0), |l| (l.pe_offset() as i32, l.row_bytes() as i32));
        let args = &mut kargs![qp, cp, bt, mp, rs, rp, sel_idx, sel_count, sk, nh32, r32, dr32, scale, sp32, op, pa, pm, pe, rb];
        dev.launch(MLA, kname, grid, (THREADS, 1, 1), smem as u32, args)?;
    } else {
        let args = &mut kargs![qp, cp, bt, mp, rs, rp, sel_idx, sel_count, sk, nh32, r32, dr32, scale, sp32, op, pa, pm];
        dev.launch(MLA, kname, grid, (THREADS, 1, 1), smem as u32, args)?;
    }
    if splits > 1 {
        dev.launch(MLA, "mla_combine", (rows, nh as u32, 1), (128, 1, 1), 0, &mut kargs![pa, pm, sp32, nh32, r32, op])?;
    }
    Ok(())
}

/// The attend's optional selection (`sel_idx` I32 `[N, K]`, `sel_count` I32 `[N]`) as kernel
/// arguments (idx, count, K); zeros without one.
fn selection(dev: &CudaDevice, sel: Option<(&CudaTensor, &CudaTensor)>, n: usize) -> Result<(u64, u64, usize)> {
    const OP: &str = OP_ATTEND;
    let Some((si, sc)) = sel else { return Ok((0, 0, 0)) };
    same_dev(OP, dev, &[("sel_idx", si), ("sel_count", sc)])?;
    if si.dtype() != DType::I32 || sc.dtype() != DType::I32 || si.shape().len() != 2 || si.shape()[0] != n || sc.shape() != [n] {
        return Err(CoreError::Shape { op: OP, detail: format!("selection {si:?}, {sc:?} must be I32 [N={n}, K] and I32 [N]") });
    }
    Ok((si.ptr(), sc.ptr(), si.shape()[1]))
}

/// The reference-precision attend: `q` F32 `[N, nh, r+dr]`, cache F32, `out` F32 `[N, nh, r]`,
/// same function as [`mla_attend`] (one block per row and head, see `mla_attend_f32` in mla.cu).
fn attend_f32(
    q: &CudaTensor,
    cache: &CudaTensor,
    batch: &PagedBatch,
    sel: Option<(&CudaTensor, &CudaTensor)>,
    r: usize,
    scale: f32,
    out: &CudaTensor,
) -> Result<()> {
    const OP: &str = OP_ATTEND;
    let dev = q.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    let (_, w) = cache_dims(OP, cache)?;
    if cache.dtype() != DType::F32 || q.shape().len() != 3 || q.shape()[0] != n || q.shape()[2] != w || r == 0 || r >= w || r > 2048 {
        return Err(CoreError::Shape {
            op: OP,
            detail: format!("reference precision: q {q:?} must be F32 [N={n}, nh, {w}] over an F32 cache (got {cache:?}), 0 < r = {r} < {w}, r ≤ 2048"),
        });
    }
    let nh = q.shape()[1];
    if out.dtype() != DType::F32 || out.shape() != [n, nh, r] {
        return Err(CoreError::Shape { op: OP, detail: format!("out {out:?} must be F32 [N={n}, nh={nh}, r={r}]") });
    }
    let (sel_idx, sel_count, sel_k) = selection(dev, sel, n)?;
    if n == 0 || nh == 0 {
        return Ok(());
    }
    const T: usize = 128; // MLA_F32_T
    let smem = ((w + T + 2) * 4 + T * 8) as u32;
    if smem > 48 * 1024 {
        return Err(CoreError::Shape { op: OP, detail: format!("cache width {w} is too wide for the reference attend") });
    }
    let rows = u32::try_from(n).map_err(|_| CoreError::Shape { op: OP, detail: format!("{n} rows exceed the grid") })?;
    let (mp, sk, nh32, r32, dr32) = (i32_of(OP, "max_pages", max_pages)?, i32_of(OP, "K", sel_k)?, i32_of(OP, "nh", nh)?, r as i32, (w - r) as i32);
    let (qp, cp, bt, rs, rp, op) = (q.ptr(), cache.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), out.ptr());
    dev.launch(
        MLA,
        "mla_attend_f32",
        (rows, nh as u32, 1),
        (T as u32, 1, 1),
        smem,
        &mut kargs![qp, cp, bt, mp, rs, rp, sel_idx, sel_count, sk, nh32, r32, dr32, scale, op],
    )
}

/// Head dims of the explicit prefill kernel: `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`
/// (K3's and K3.1's).
pub const PREFILL_DIMS: (usize, usize, usize) = (128, 64, 128);

/// Causal attention of a **fresh prefill** (every sequence of the step starts at position 0 and
/// its rows are contiguous, in order) in MLA's explicit form, on tensor cores (`mla_prefill.cu`):
/// row i, head h attends to the rows j of its sequence with `row_pos[j] <= row_pos[i]`, keys
/// `[k_nope_h(j) | k_pe(j)]`, values `v_h(j)`; `out[i, h] = softmax(scale · q_h(i) · k)ᵀ v` in f32
/// (P rounded to BF16). `q` BF16 `[N, nh·192]` (q_nope 128 | q_pe 64 per head), `kv` BF16
/// `[N, nh·256]` (k_nope 128 | v 128 per head: `kv_b_proj` of the normed latent), `k_pe` from the
/// rows this step appended to `cache` (BF16 `[pages, PAGE, r + 64]`, or FP8 U8 rows), `out` BF16
/// `[N, nh·128]`. Costs 320 MACs per (row, key, head) against the absorbed form's 1088.
pub fn mla_prefill_attend(
    q: &CudaTensor,
    kv: &CudaTensor,
    cache: &CudaTensor,
    r: usize,
    batch: &PagedBatch,
    nh: usize,
    scale: f32,
    out: &CudaTensor,
) -> Result<()> {
    const OP: &str = "cuda mla_prefill_attend";
    let dev = q.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    same_dev(OP, dev, &[("kv", kv), ("cache", cache), ("out", out)])?;
    let (dn, dr, dv) = PREFILL_DIMS;
    for (name, t, w) in [("q", q, dn + dr), ("kv", kv, dn + dv), ("out", out, dv)] {
        if t.dtype() != DType::BF16 || t.numel() != n * nh * w {
            return Err(CoreError::Shape { op: OP, detail: format!("{name} {t:?} must be BF16 [N={n}, nh={nh} x {w}]") });
        }
    }
    let (row_bytes, pe_off) = match fp8_layout(OP, cache, r, r + dr)? {
        Some(l) => (l.row_bytes(), l.pe_offset()),
        None => {
            let (_, w) = cache_dims(OP, cache)?;
            if cache.dtype() != DType::BF16 || w != r + dr {
                return Err(CoreError::Shape { op: OP, detail: format!("cache {cache:?} must be BF16 [pages, {PAGE}, r + {dr} = {}] (or FP8)", r + dr) });
            }
            (2 * w, 2 * r)
        }
    };
    aligned16(OP, &[("q", q), ("kv", kv), ("cache", cache), ("out", out)])?;
    if n == 0 || nh == 0 {
        return Ok(());
    }
    const Q_ROWS: usize = 64;
    let smem = (Q_ROWS * (dn + dr + 8) + 2 * 64 * (dn + dr + 8) + 2 * 64 * (dv + 8)) * 2 + 4 * 64 * 4;
    let f = dev.function(MLA_PREFILL, "mla_prefill_attend")?;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(derr("raising the shared-memory limit of mla_prefill_attend"))?;
    let gx = u32::try_from(n.div_ceil(Q_ROWS)).map_err(|_| CoreError::Shape { op: OP, detail: format!("{n} rows exceed the grid") })?;
    let gy = u32::try_from(nh).ok().filter(|&v| v <= 65535).ok_or_else(|| CoreError::Shape { op: OP, detail: format!("{nh} heads exceed the grid") })?;
    let (rb, po, mp, n32, nh32) = (row_bytes as i32, pe_off as i32, i32_of(OP, "max_pages", max_pages)?, i32_of(OP, "N", n)?, nh as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let (qp, kp, cp, bt, rs, rp, op) = (q.ptr(), kv.ptr(), cache.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), out.ptr());
    dev.launch(
        MLA_PREFILL,
        "mla_prefill_attend",
        (gx, gy, 1),
        (128, 1, 1),
        smem as u32,
        &mut kargs![qp, kp, cp, rb, po, bt, mp, rs, rp, n32, nh32, scale_log2, op],
    )
}
