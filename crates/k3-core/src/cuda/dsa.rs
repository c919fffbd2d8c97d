//! Launchers for K3.1's lightning indexer and top-k selection (text-backbone §5.3–5.6;
//! kernels in `kernels/cuda/dsa.cu`, CPU oracle k3-model `layers/dsa.rs`).
//!
//! Shape legend: `N` packed rows, `ih` index heads, `id` index head dim (multiple of 8),
//! `L` score-row length (> every `row_pos`), `k` = index_topk. The indexer-key cache of one
//! layer is F32 `[num_pages, PAGE, id]`, or FP8: U8 `[num_pages, PAGE, row_bytes]` (k3-core
//! `fp8::KeyFp8`, 132 B for K3.1), paged like the MLA latent cache ([`super::mla`]).
//! Every function here is CUDA-graph capturable (workspaces from [`CudaTensor::uninit`]).

use super::mla::{same_dev, PagedBatch, PAGE};
use super::{derr, kargs, CudaTensor};
use crate::fp8::KeyFp8;
use crate::kernels::cuda::DSA;
use crate::{CoreError, DType, Result};

const KEYS_PER_BLOCK: usize = 128;
/// Candidates per block of the top-k kernels.
const TOPK_CHUNK: usize = 4096;
const BINS: usize = 2048;
const DIGIT: usize = 11;
/// One launch per radix pass (histogram + digit choice by the row's last block) instead of two.
const FUSED_PASS: bool = true;

fn i32_of(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CoreError::Shape { op, detail: format!("{what} = {v} exceeds i32") })
}

/// The index dim `id` of a key cache and, for an FP8 one, its layout: F32 `[num_pages, PAGE, id]`,
/// or U8 `[num_pages, PAGE, KeyFp8 { id }.row_bytes()]` with `id` given by the caller (`id_of`:
/// the width of the other operand).
fn key_cache_dims(op: &'static str, kc: &CudaTensor, id_of: usize) -> Result<(usize, Option<KeyFp8>)> {
    let fp8 = kc.dtype() == DType::U8;
    if !(kc.dtype() == DType::F32 || fp8) || kc.shape().len() != 3 || kc.shape()[1] != PAGE {
        return Err(CoreError::Shape { op, detail: format!("key_cache {kc:?} must be F32 [num_pages, {PAGE}, id] or U8 [num_pages, {PAGE}, fp8 row bytes]") });
    }
    let id = if fp8 { id_of } else { kc.shape()[2] };
    if id == 0 || !id.is_multiple_of(8) {
        return Err(CoreError::Shape { op, detail: format!("index dim id = {id} must be a positive multiple of 8") });
    }
    if !fp8 {
        return Ok((id, None));
    }
    let lay = KeyFp8 { id };
    if kc.shape()[2] != lay.row_bytes() {
        return Err(CoreError::Shape { op, detail: format!("FP8 key_cache {kc:?} must be U8 [num_pages, {PAGE}, {}] for id = {id}", lay.row_bytes()) });
    }
    Ok((id, Some(lay)))
}

/// Appends `LayerNorm(k[i])` (gain `ln_w`, bias `ln_b`, `eps`; f32 statistics, biased variance)
/// to the indexer-key cache at `(row_seq[i], row_pos[i])`. `k` F32 or BF16 `[N, id]`,
/// `ln_w`/`ln_b` F32 `[id]`, `key_cache` F32 `[num_pages, PAGE, id]`.
pub fn index_key_append(k: &CudaTensor, ln_w: &CudaTensor, ln_b: &CudaTensor, eps: f32, batch: &PagedBatch, key_cache: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda index_key_append";
    let dev = k.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    same_dev(OP, dev, &[("ln_w", ln_w), ("ln_b", ln_b), ("key_cache", key_cache)])?;
    let (id, fp8) = key_cache_dims(OP, key_cache, ln_w.numel())?;
    for (name, t) in [("ln_w", ln_w), ("ln_b", ln_b)] {
        if t.dtype() != DType::F32 || t.shape() != [id] {
            return Err(CoreError::Shape { op: OP, detail: format!("{name} {t:?} must be F32 [id={id}]") });
        }
    }
    if k.shape() != [n, id] {
        return Err(CoreError::Shape { op: OP, detail: format!("k {k:?} must be [N={n}, id={id}]") });
    }
    let name = match (k.dtype(), fp8.is_some()) {
        (DType::F32, false) => "index_key_append_f32",
        (DType::BF16, false) => "index_key_append_bf16",
        (DType::F32, true) => "index_key_append_fp8_f32",
        (DType::BF16, true) => "index_key_append_fp8_bf16",
        (d, _) => return Err(CoreError::DType { op: OP, dtype: format!("k {d} (F32 or BF16 needed)") }),
    };
    if n == 0 {
        return Ok(());
    }
    let rows = u32::try_from(n).map_err(|_| CoreError::Shape { op: OP, detail: format!("{n} rows exceed the grid") })?;
    let (mp, id32) = (i32_of(OP, "max_pages", max_pages)?, id as i32);
    let (kp, wp, bp, bt, rs, rp, kc) = (k.ptr(), ln_w.ptr(), ln_b.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), key_cache.ptr());
    // 128 threads (fp8: exactly one value of every 128-value tile per thread, dsa.cu).
    match fp8 {
        Some(l) => {
            let kb = l.row_bytes() as i32;
            dev.launch(DSA, name, (rows, 1, 1), (crate::fp8::TILE as u32, 1, 1), 0, &mut kargs![kp, wp, bp, eps, bt, mp, rs, rp, kc, id32, kb])
        }
        None => dev.launch(DSA, name, (rows, 1, 1), (128, 1, 1), 0, &mut kargs![kp, wp, bp, eps, bt, mp, rs, rp, kc, id32]),
    }
}

/// `scores[i, s] = Σ_h a[i,h] · ReLU(q[i,h,:] · key[s])` for `s in 0..=row_pos[i]`; entries
/// beyond are left untouched. `q` F32 `[N, ih, id]`, `a` F32 `[N, ih]` (already scaled),
/// `scores` F32 `[N, L]` with `L > max row_pos` (not checked on the device).
pub fn index_scores(q: &CudaTensor, a: &CudaTensor, key_cache: &CudaTensor, batch: &PagedBatch, scores: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda index_scores";
    let dev = q.cuda_device();
    let (n, max_pages) = batch.check(OP, dev)?;
    same_dev(OP, dev, &[("a", a), ("key_cache", key_cache), ("scores", scores)])?;
    let (id, fp8) = key_cache_dims(OP, key_cache, q.shape().get(2).copied().unwrap_or(0))?;
    if q.dtype() != DType::F32 || q.shape().len() != 3 || q.shape()[0] != n || q.shape()[2] != id {
        return Err(CoreError::Shape { op: OP, detail: format!("q {q:?} must be F32 [N={n}, ih, id={id}]") });
    }
    let ih = q.shape()[1];
    if a.dtype() != DType::F32 || a.shape() != [n, ih] {
        return Err(CoreError::Shape { op: OP, detail: format!("a {a:?} must be F32 [N={n}, ih={ih}]") });
    }
    if scores.dtype() != DType::F32 || scores.shape().len() != 2 || scores.shape()[0] != n {
        return Err(CoreError::Shape { op: OP, detail: format!("scores {scores:?} must be F32 [N={n}, L]") });
    }
    if !q.ptr().is_multiple_of(16) || !key_cache.ptr().is_multiple_of(16) {
        return Err(CoreError::Shape { op: OP, detail: "q and key_cache must start on 16-byte boundaries".into() });
    }
    let l = scores.shape()[1];
    if n == 0 || l == 0 || ih == 0 {
        return Ok(());
    }
    let smem = (KEYS_PER_BLOCK * (id + 4) + ih * id + ih) * 4;
    if smem > 227 * 1024 {
        return Err(CoreError::Shape { op: OP, detail: format!("ih={ih}, id={id} need {smem} bytes of shared memory (> 227 KiB)") });
    }
    let name = if fp8.is_some() { "dsa_index_scores_fp8" } else { "dsa_index_scores" };
    let f = dev.function(DSA, name)?;
    use cudarc::driver::sys::CUfunction_attribute_enum as A;
    f.set_attribute(A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(derr("raising the shared-memory limit of dsa_index_scores"))?;
    let rows =
        u32::try_from(n).ok().filter(|&v| v <= 65535).ok_or_else(|| CoreError::Shape { op: OP, detail: format!("{n} rows exceed 65535 (split the call)") })?;
    let gx = u32::try_from(l.div_ceil(KEYS_PER_BLOCK)).map_err(|_| CoreError::Shape { op: OP, detail: format!("L = {l} too large") })?;
    let (mp, l64, ih32, id32) = (i32_of(OP, "max_pages", max_pages)?, l as i64, i32_of(OP, "ih", ih)?, id as i32);
    let (qp, ap, kc, bt, rs, rp, sp) = (q.ptr(), a.ptr(), key_cache.ptr(), batch.block_table.ptr(), batch.row_seq.ptr(), batch.row_pos.ptr(), scores.ptr());
    let (grid, block) = ((gx, rows, 1), (KEYS_PER_BLOCK as u32, 1, 1));
    match fp8 {
        Some(lay) => {
            let kb = lay.row_bytes() as i32;
            dev.launch(DSA, name, grid, block, smem as u32, &mut kargs![qp, ap, kc, bt, mp, rs, rp, sp, l64, ih32, id32, kb])
        }
        None => dev.launch(DSA, name, grid, block, smem as u32, &mut kargs![qp, ap, kc, bt, mp, rs, rp, sp, l64, ih32, id32]),
    }
}

/// Per row i with `n = row_pos[i]+1` candidates (`scores[i, 0..n]`): if `n <= k`,
/// `idx[i, 0..n] = 0..n` and `count[i] = n`; otherwise the `k` positions with the largest
/// score, ties going to the LARGER position (+0.0 and −0.0 tie; exactly `select_topk` of
/// `layers/dsa.rs`), written in increasing position order, `count[i] = k`. Deterministic.
/// `scores` F32 `[N, L]`, `idx` I32 `[N, k]`, `count` I32 `[N]`. Multi-block radix select
/// over `(score, position)` keys: `passes + 3` launches, passes = ⌈(32 + bits(L−1)) / 11⌉
/// (5 for L up to 2^23).
pub fn topk(scores: &CudaTensor, batch: &PagedBatch, k: usize, idx: &CudaTensor, count: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda topk";
    let dev = scores.cuda_device();
    let (n, _) = batch.check(OP, dev)?;
    same_dev(OP, dev, &[("idx", idx), ("count", count)])?;
    if scores.dtype() != DType::F32 || scores.shape().len() != 2 || scores.shape()[0] != n {
        return Err(CoreError::Shape { op: OP, detail: format!("scores {scores:?} must be F32 [N={n}, L]") });
    }
    if idx.dtype() != DType::I32 || idx.shape() != [n, k] || count.dtype() != DType::I32 || count.shape() != [n] {
        return Err(CoreError::Shape { op: OP, detail: format!("idx {idx:?} / count {count:?} must be I32 [N={n}, k={k}] / I32 [N]") });
    }
    let l = scores.shape()[1];
    if n == 0 {
        return Ok(());
    }
    if k == 0 || l == 0 {
        return count.fill_bytes(0);
    }
    let rows =
        u32::try_from(n).ok().filter(|&v| v <= 65535).ok_or_else(|| CoreError::Shape { op: OP, detail: format!("{n} rows exceed 65535 (split the call)") })?;
    let k32 = i32_of(OP, "k", k)?;
    i32_of(OP, "L", l)?;
    let nblk = l.div_ceil(TOPK_CHUNK);
    let hist = CudaTensor::uninit(dev, DType::I32, vec![n, BINS])?;
    let state = CudaTensor::uninit(dev, DType::I32, vec![n, 4])?; // u64 [N, 2]: prefix, remaining rank
    let counts = CudaTensor::uninit(dev, DType::I32, vec![n, nblk])?;
    let done = CudaTensor::uninit(dev, DType::I32, vec![n])?;
    let (sp, rp, hp, stp, cp, ip, cnt, dp) = (scores.ptr(), batch.row_pos.ptr(), hist.ptr(), state.ptr(), counts.ptr(), idx.ptr(), count.ptr(), done.ptr());
    let (l64, nb32, ch32) = (l as i64, nblk as i32, TOPK_CHUNK as i32);
    dev.launch(DSA, "dsa_topk_init", (rows, 1, 1), (256, 1, 1), 0, &mut kargs![hp, stp, k32, dp])?;
    // Key = ordered score << pb | position: 32 + pb bits, resolved 11 at a time from the top.
    let pb = ((usize::BITS - (l - 1).leading_zeros()) as i32).max(1);
    let mut hi = 32 + pb;
    while hi > 0 {
        let lo = (hi - DIGIT as i32).max(0);
        let (shift, width) = (lo, hi - lo);
        if FUSED_PASS {
            dev.launch(DSA, "dsa_topk_pass", (nblk as u32, rows, 1), (256, 1, 1), 0, &mut kargs![sp, l64, rp, k32, hp, stp, dp, shift, width, ch32, pb])?;
        } else {
            dev.launch(DSA, "dsa_topk_hist", (nblk as u32, rows, 1), (256, 1, 1), 0, &mut kargs![sp, l64, rp, k32, hp, stp, shift, width, ch32, pb])?;
            dev.launch(DSA, "dsa_topk_select", (rows, 1, 1), (1024, 1, 1), 0, &mut kargs![hp, stp, rp, k32, shift, width])?;
        }
        hi = lo;
    }
    dev.launch(DSA, "dsa_topk_count", (nblk as u32, rows, 1), (256, 1, 1), 0, &mut kargs![sp, l64, rp, k32, stp, cp, nb32, ch32, pb])?;
    dev.launch(DSA, "dsa_topk_write", (nblk as u32, rows, 1), (256, 1, 1), 0, &mut kargs![sp, l64, rp, k32, stp, cp, nb32, ch32, ip, cnt, pb])
}
