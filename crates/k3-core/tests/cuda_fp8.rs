//! Parity suite for the FP8 caches on the GPU (`cuda::mla` and `cuda::dsa` over U8 caches)
//! against their CPU definition, k3-core `fp8` (`LatentFp8`, `KeyFp8`).
//!
//! Shapes: N packed rows, nh heads, r latent, dr rope (W = r + dr), ih / id index heads / dim;
//! FP8 caches U8 `[pages, 64, row_bytes]` with non-contiguous page ids. Random inputs (seed
//! printed; `K3_TEST_SEED=N` replays); caches and outputs poisoned first.
//! - **Append** (latent and indexer key): the GPU's bytes decode (on the CPU) to within half an
//!   E4M3 step of the f32 normed values, the scales are powers of two that put each tile's
//!   largest magnitude in E4M3's top binade, `k_pe` is bit-exact BF16, and at least 99 % of the
//!   bytes equal `fp8::LatentFp8::encode` of the CPU's normed row (summation order may move a
//!   value across a rounding boundary).
//! - **Attend**: FP8 cache = the BF16 kernel over the dequantized cache (every dequantized value
//!   is exact in BF16), dense and selected, decode and multi-row, several splits: bit-identical.
//! - **Index scores**: FP8 keys = the F32 kernel over the dequantized keys (relative L2 1e-6).
//!
//! Timings (printed, never asserted): one decode row at K3's dims, contexts 4096 and 131072,
//! BF16 vs FP8 cache. Without a GPU every test prints `skipped` and passes (fails with
//! `K3_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod cuda_common;
use cuda_common::{device, paging, poisoned, prefill_rows, rel_l2, rng, rvec, say, slot, time_attend, up, up_i32};

use k3_core::cuda::dsa::{index_key_append, index_scores};
use k3_core::cuda::mla::{mla_attend, mla_cache_append, PagedBatch, PAGE};
use k3_core::cuda::CudaTensor;
use k3_core::fp8::{e4m3_value, KeyFp8, LatentFp8, TILE};
use k3_core::DType;
use rand::Rng;

fn f32_at(b: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Checks one tile-quantized vector (`q` e4m3 bytes, scales at `sc`) against the f32 values `x`;
/// returns how many bytes equal the CPU encoding `cpu`.
fn check_tiles(what: &str, q: &[u8], scales: &[f32], x: &[f32], cpu: &[u8]) -> usize {
    for (t, s) in scales.iter().enumerate() {
        let xt = &x[t * TILE..((t + 1) * TILE).min(x.len())];
        let amax = xt.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{what} tile {t}: scale {s} is not a power of two");
        assert!(amax == 0.0 || (amax / s > 224.0 * 0.999 && amax / s <= 448.0 * 1.001), "{what} tile {t}: amax {amax} scale {s}");
        for (j, (b, v)) in q[t * TILE..][..xt.len()].iter().zip(xt).enumerate() {
            let back = e4m3_value(*b) * s;
            assert!((back - v).abs() <= v.abs() / 15.0 + s * 2f32.powi(-9), "{what} tile {t} value {j}: {v} reads back as {back}");
        }
    }
    q.iter().zip(cpu).filter(|(a, b)| a == b).count()
}

#[test]
fn latent_append_writes_fp8_ds_mla() {
    let Some(dev) = device("latent_append_writes_fp8_ds_mla") else { return };
    let mut r = rng("latent_append_writes_fp8_ds_mla");
    for &(rr, dr) in &[(512usize, 64usize), (24, 8), (200, 16)] {
        let (w, lay) = (rr + dr, LatentFp8 { r: rr, dr });
        let rb = lay.row_bytes();
        let lens = [1usize, 64, 65, 130];
        let (bt, mp, pages) = paging(&mut r, &lens);
        let (rs, rp) = prefill_rows(&lens);
        let n = rs.len();
        let ckv = rvec(&mut r, n * w, 0.01, 2.0);
        let kv_norm: Vec<f32> = (0..rr).map(|_| r.random_range(0.5f32..1.5)).collect();
        let eps = 1e-6f32;
        let (btt, rst, rpt) = (up_i32(&dev, vec![lens.len(), mp], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        for dt in [DType::F32, DType::BF16] {
            let cache = poisoned(&dev, DType::U8, vec![pages, PAGE, rb]);
            mla_cache_append(&up(&dev, dt, vec![n, w], &ckv), &up(&dev, DType::F32, vec![rr], &kv_norm), eps, &batch, &cache).expect("append");
            let got = cache.to_bytes().expect("read");
            let (mut same, mut total) = (0usize, 0usize);
            for i in 0..n {
                let x = &ckv[i * w..(i + 1) * w];
                let inv = 1.0 / (x[..rr].iter().map(|v| v * v).sum::<f32>() / rr as f32 + eps).sqrt();
                let want: Vec<f32> = (0..w).map(|d| if d < rr { x[d] * inv * kv_norm[d] } else { x[d] }).collect();
                let row = &got[slot(&bt, mp, rs[i] as usize, rp[i] as usize) * rb..][..rb];
                let mut cpu = vec![0u8; rb];
                lay.encode(&want, &mut cpu);
                let scales: Vec<f32> = (0..lay.tiles()).map(|t| f32_at(row, rr + 4 * t)).collect();
                same += check_tiles(&format!("r={rr} {dt} row {i}"), &row[..rr], &scales, &want[..rr], &cpu[..rr]);
                total += rr;
                assert_eq!(&row[rr + 4 * lay.tiles()..lay.pe_offset()], &cpu[rr + 4 * lay.tiles()..lay.pe_offset()], "padding is zero");
                assert_eq!(&row[lay.pe_offset()..], &cpu[lay.pe_offset()..], "r={rr} {dt} row {i}: k_pe (bf16) and the tail");
            }
            let frac = same as f64 / total as f64;
            say(&format!("  latent append r={rr} dr={dr} ({rb} B/token) {dt}: {frac:.4} of {total} e4m3 bytes equal the CPU encoding"));
            assert!(frac >= 0.99, "too many bytes differ from the CPU encoding: {frac}");
        }
    }
}

#[test]
fn index_key_append_writes_fp8_keys() {
    let Some(dev) = device("index_key_append_writes_fp8_keys") else { return };
    let mut r = rng("index_key_append_writes_fp8_keys");
    for &id in &[128usize, 16, 200] {
        let lay = KeyFp8 { id };
        let kb = lay.row_bytes();
        let lens = [1usize, 64, 65, 300];
        let (bt, mp, pages) = paging(&mut r, &lens);
        let (rs, rp) = prefill_rows(&lens);
        let n = rs.len();
        let k = rvec(&mut r, n * id, 0.01, 2.0);
        let lw = rvec(&mut r, id, 0.5, 1.5);
        let lb = rvec(&mut r, id, 0.0, 0.3);
        let eps = 1e-6f32;
        let (btt, rst, rpt) = (up_i32(&dev, vec![lens.len(), mp], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let kc = poisoned(&dev, DType::U8, vec![pages, PAGE, kb]);
        index_key_append(&up(&dev, DType::BF16, vec![n, id], &k), &up(&dev, DType::F32, vec![id], &lw), &up(&dev, DType::F32, vec![id], &lb), eps, &batch, &kc)
            .expect("append");
        let got = kc.to_bytes().expect("read");
        let (mut same, mut total) = (0usize, 0usize);
        for i in 0..n {
            let x = &k[i * id..(i + 1) * id];
            let mu = x.iter().sum::<f32>() / id as f32;
            let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / id as f32;
            let inv = 1.0 / (var + eps).sqrt();
            let want: Vec<f32> = (0..id).map(|d| (x[d] - mu) * inv * lw[d] + lb[d]).collect();
            let row = &got[slot(&bt, mp, rs[i] as usize, rp[i] as usize) * kb..][..kb];
            let mut cpu = vec![0u8; kb];
            lay.encode(&want, &mut cpu);
            let scales: Vec<f32> = (0..lay.tiles()).map(|t| f32_at(row, id + 4 * t)).collect();
            same += check_tiles(&format!("id={id} row {i}"), &row[..id], &scales, &want, &cpu[..id]);
            total += id;
            assert_eq!(&row[id + 4 * lay.tiles()..], &cpu[id + 4 * lay.tiles()..], "padding is zero");
        }
        let frac = same as f64 / total as f64;
        say(&format!("  index key append id={id} ({kb} B/token): {frac:.4} of {total} e4m3 bytes equal the CPU encoding"));
        assert!(frac >= 0.99);
    }
}

/// A random paged FP8 latent cache (CPU-encoded) and its dequantized values.
fn fp8_cache(r: &mut impl Rng, lay: LatentFp8, pages: usize) -> (Vec<u8>, Vec<f32>) {
    let (w, rb) = (lay.r + lay.dr, lay.row_bytes());
    let vals = rvec(r, pages * PAGE * w, 0.02, 1.5);
    let mut bytes = vec![0u8; pages * PAGE * rb];
    let mut back = vec![0f32; pages * PAGE * w];
    for ((v, b), o) in vals.chunks(w).zip(bytes.chunks_mut(rb)).zip(back.chunks_mut(w)) {
        lay.encode(v, b);
        lay.decode(b, o);
    }
    (bytes, back)
}

#[test]
fn attend_over_fp8_equals_bf16_over_the_dequantized_cache() {
    let Some(dev) = device("attend_over_fp8_equals_bf16_over_the_dequantized_cache") else { return };
    let mut r = rng("attend_over_fp8_equals_bf16_over_the_dequantized_cache");
    // (nh, r, dr, lens, rows per sequence, selected): K3 decode and prefill rows, small widths,
    // a long context (several splits), a selection (DSA).
    type Case<'a> = (usize, usize, usize, &'a [usize], usize, bool);
    let cases: &[Case] = &[
        (96, 512, 64, &[1, 100, 700], 1, false),
        (20, 512, 64, &[300, 65], 5, false),
        (3, 24, 8, &[1, 9, 130], 4, false),
        (96, 512, 64, &[5000], 1, false),
        (16, 512, 64, &[400, 90], 2, true),
    ];
    for &(nh, rr, dr, lens, per, select) in cases {
        let (w, lay) = (rr + dr, LatentFp8 { r: rr, dr });
        let (bt, mp, pages) = paging(&mut r, lens);
        let (bytes, back) = fp8_cache(&mut r, lay, pages);
        let mut rows = Vec::new();
        for (b, &l) in lens.iter().enumerate() {
            for pos in l.saturating_sub(per)..l {
                rows.push((b as i32, pos as i32));
            }
        }
        let n = rows.len();
        let (rs, rp): (Vec<i32>, Vec<i32>) = rows.iter().copied().unzip();
        let (btt, rst, rpt) = (up_i32(&dev, vec![lens.len(), mp], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let sel = select.then(|| {
            let k = 48;
            let mut idx = vec![i32::MAX; n * k];
            let mut cnt = vec![0i32; n];
            for (i, &(_, pos)) in rows.iter().enumerate() {
                let c = r.random_range(1..=k.min(pos as usize + 1));
                let mut s: Vec<i32> = (0..c).map(|_| r.random_range(0..=pos)).collect();
                s.sort_unstable();
                s.dedup();
                idx[i * k..i * k + s.len()].copy_from_slice(&s);
                cnt[i] = s.len() as i32;
            }
            (up_i32(&dev, vec![n, k], &idx), up_i32(&dev, vec![n], &cnt))
        });
        let sel = sel.as_ref().map(|(a, b)| (a, b));
        let q = up(&dev, DType::BF16, vec![n, nh, w], &rvec(&mut r, n * nh * w, 0.05, 1.0));
        let scale = 1.0 / ((128 + dr) as f32).sqrt();
        let c8 = CudaTensor::from_pod(&dev, DType::U8, vec![pages, PAGE, lay.row_bytes()], &bytes).expect("upload");
        let c16 = up(&dev, DType::BF16, vec![pages, PAGE, w], &back);
        let (o8, o16) = (poisoned(&dev, DType::BF16, vec![n, nh, rr]), poisoned(&dev, DType::BF16, vec![n, nh, rr]));
        mla_attend(&q, &c8, &batch, sel, rr, scale, &o8).expect("attend fp8");
        mla_attend(&q, &c16, &batch, sel, rr, scale, &o16).expect("attend bf16");
        let (a, b) = (o8.to_bytes().expect("read"), o16.to_bytes().expect("read"));
        let diff = a.chunks(2).zip(b.chunks(2)).filter(|(x, y)| x != y).count();
        say(&format!(
            "  attend nh={nh} r={rr} dr={dr} lens={lens:?} rows={n} sel={select}: {diff} of {} outputs differ from bf16 over the dequantized cache",
            a.len() / 2
        ));
        assert_eq!(diff, 0, "the FP8 attend must equal the BF16 attend over the dequantized cache");
        assert!(o8.to_f32_vec().expect("read").iter().all(|v| v.is_finite()));
    }
}

#[test]
fn index_scores_over_fp8_keys_equal_f32_over_the_dequantized_keys() {
    let Some(dev) = device("index_scores_over_fp8_keys_equal_f32_over_the_dequantized_keys") else { return };
    let mut r = rng("index_scores_over_fp8_keys_equal_f32_over_the_dequantized_keys");
    for &(ih, id) in &[(32usize, 128usize), (8, 16), (40, 200)] {
        let lay = KeyFp8 { id };
        let lens = [1usize, 64, 65, 300];
        let (bt, mp, pages) = paging(&mut r, &lens);
        let vals = rvec(&mut r, pages * PAGE * id, 0.01, 2.0);
        let mut bytes = vec![0u8; pages * PAGE * lay.row_bytes()];
        let mut back = vec![0f32; vals.len()];
        for ((v, b), o) in vals.chunks(id).zip(bytes.chunks_mut(lay.row_bytes())).zip(back.chunks_mut(id)) {
            lay.encode(v, b);
            lay.decode(b, o);
        }
        let rows: Vec<(i32, i32)> = lens.iter().enumerate().map(|(b, &l)| (b as i32, l as i32 - 1)).collect();
        let n = rows.len();
        let (rs, rp): (Vec<i32>, Vec<i32>) = rows.iter().copied().unzip();
        let (btt, rst, rpt) = (up_i32(&dev, vec![lens.len(), mp], &bt), up_i32(&dev, vec![n], &rs), up_i32(&dev, vec![n], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let l = 310;
        let q = up(&dev, DType::F32, vec![n, ih, id], &rvec(&mut r, n * ih * id, 0.05, 1.0));
        let a = up(&dev, DType::F32, vec![n, ih], &rvec(&mut r, n * ih, 0.01, 0.2));
        let k8 = CudaTensor::from_pod(&dev, DType::U8, vec![pages, PAGE, lay.row_bytes()], &bytes).expect("upload");
        let k32 = up(&dev, DType::F32, vec![pages, PAGE, id], &back);
        let (s8, s32) = (poisoned(&dev, DType::F32, vec![n, l]), poisoned(&dev, DType::F32, vec![n, l]));
        index_scores(&q, &a, &k8, &batch, &s8).expect("scores fp8");
        index_scores(&q, &a, &k32, &batch, &s32).expect("scores f32");
        let (g, w) = (s8.to_f32_vec().expect("read"), s32.to_f32_vec().expect("read"));
        for (i, &(_, pos)) in rows.iter().enumerate() {
            let m = pos as usize + 1;
            let e = rel_l2(&g[i * l..i * l + m], &w[i * l..i * l + m]);
            assert!(e <= 1e-6, "ih={ih} id={id} row {i}: rel L2 {e:.2e}");
            assert!(g[i * l + m..(i + 1) * l].iter().all(|v| v.is_nan()), "entries past row_pos stay untouched");
        }
        say(&format!("  index scores ih={ih} id={id} ({} B/token): fp8 = f32 over the dequantized keys", lay.row_bytes()));
    }
}

#[test]
fn attend_decode_timing_fp8_vs_bf16() {
    let Some(dev) = device("attend_decode_timing_fp8_vs_bf16") else { return };
    let mut r = rng("attend_decode_timing_fp8_vs_bf16");
    let (nh, rr, dr) = (96usize, 512usize, 64usize);
    let (w, lay) = (rr + dr, LatentFp8 { r: rr, dr });
    for &(ctx, b) in &[(4096usize, 1usize), (131072, 1), (131072, 8)] {
        let lens = vec![ctx; b];
        let (bt, mp, pages) = paging(&mut r, &lens);
        let (bytes, back) = fp8_cache(&mut r, lay, pages);
        let rs: Vec<i32> = (0..b as i32).collect();
        let rp = vec![ctx as i32 - 1; b];
        let (btt, rst, rpt) = (up_i32(&dev, vec![b, mp], &bt), up_i32(&dev, vec![b], &rs), up_i32(&dev, vec![b], &rp));
        let batch = PagedBatch { block_table: &btt, row_seq: &rst, row_pos: &rpt };
        let q = up(&dev, DType::BF16, vec![b, nh, w], &rvec(&mut r, b * nh * w, 0.05, 1.0));
        let out = poisoned(&dev, DType::BF16, vec![b, nh, rr]);
        let c8 = CudaTensor::from_pod(&dev, DType::U8, vec![pages, PAGE, lay.row_bytes()], &bytes).expect("upload");
        let c16 = up(&dev, DType::BF16, vec![pages, PAGE, w], &back);
        let (t8, t16) = (time_attend(&dev, &q, &c8, &batch, rr, &out, 50), time_attend(&dev, &q, &c16, &batch, rr, &out, 50));
        let (b8, b16) = ((b * ctx * lay.row_bytes()) as f64, (b * ctx * 2 * w) as f64);
        say(&format!(
            "  attend decode B={b} ctx={ctx}: bf16 {t16:.1} us ({:.0} GB/s of cache), fp8 {t8:.1} us ({:.0} GB/s), fp8 / bf16 {:.2}",
            b16 / t16 / 1e3,
            b8 / t8 / 1e3,
            t8 / t16
        ));
    }
}
