//! How the disk tier reads one expert (`cache.rs` decides when): where each of its tensors lies
//! in the checkpoint's shards ([`Place`], from the safetensors headers, around-backbone §1.2),
//! the nearby ones of a shard coalesced into one `pread`, O_DIRECT into a page-aligned part of
//! the buffer where the file system takes it (the tail past the last whole page, and a file
//! that refuses it, read buffered), the tensors then `Tensor::shared` views of that buffer and
//! the expert's [`Matrix`]es built over them (MXFP4 scale bytes checked). Errors name the file
//! and the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;

use k3_core::kernels::cpu::matmul::Matrix;
use k3_core::{DType, Tensor};

use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};
use crate::layers::moe::Expert;

/// One tensor's bytes in the files.
#[derive(Clone, Debug)]
pub(super) struct Span {
    pub(super) name: String,
    pub(super) shard: usize,
    pub(super) start: u64,
    pub(super) len: u64,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
}

/// One weight of an expert.
#[derive(Clone, Debug)]
pub(super) enum Part {
    Mxfp4 { packed: Span, scale: Span },
    Dense(Span),
}

/// Where one expert's `w1`, `w3`, `w2` are.
#[derive(Clone, Debug)]
pub(super) struct Place {
    pub(super) parts: [Part; 3],
}

impl Place {
    /// Where expert `e` of layer `l` is in `ck`, each tensor checked for presence, shape and
    /// dtype (whole experts: `moe_intermediate_size` rows); an error names the first bad one.
    pub(super) fn of(ck: &Checkpoint, l: usize, e: usize) -> Result<Place> {
        let t = &ck.config.text;
        let (lat, fi) = (t.routed_expert_hidden_size, t.moe_intermediate_size);
        let span = |name: String, shape: &[usize], dtypes: &[DType]| -> Result<Span> {
            let x =
                ck.entry(&name).ok_or_else(|| ModelError::Tensor { name: name.clone(), msg: format!("missing from the checkpoint (expected {shape:?})") })?;
            if x.shape != shape || !dtypes.contains(&x.dtype) {
                return Err(ModelError::Tensor { name, msg: format!("is {} {:?}, expected {:?} {shape:?}", x.dtype, x.shape, dtypes) });
            }
            Ok(Span { name, shard: x.shard, start: x.start as u64, len: x.len as u64, dtype: x.dtype, shape: x.shape.clone() })
        };
        let part = |p: String, rows: usize, cols: usize| -> Result<Part> {
            Ok(if ck.config.experts_mxfp4() {
                Part::Mxfp4 {
                    packed: span(format!("{p}weight_packed"), &[rows, cols / 2], &[DType::U8])?,
                    scale: span(format!("{p}weight_scale"), &[rows, cols / 32], &[DType::U8])?,
                }
            } else {
                Part::Dense(span(format!("{p}weight"), &[rows, cols], &[DType::F32, DType::BF16, DType::F16])?)
            })
        };
        let q = format!("{}block_sparse_moe.experts.{e}.", crate::weights::layer_prefix(l));
        Ok(Place { parts: [part(format!("{q}w1."), fi, lat)?, part(format!("{q}w3."), fi, lat)?, part(format!("{q}w2."), lat, fi)?] })
    }

    pub(super) fn spans(&self) -> Vec<&Span> {
        self.parts
            .iter()
            .flat_map(|p| match p {
                Part::Mxfp4 { packed, scale } => vec![packed, scale],
                Part::Dense(w) => vec![w],
            })
            .collect()
    }
    /// Bytes of the expert as stored.
    pub(super) fn bytes(&self) -> u64 {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Mxfp4 { packed, scale } => packed.len + scale.len,
                Part::Dense(w) => w.len,
            })
            .sum()
    }
}

/// One shard of the checkpoint, opened buffered and (where the file system takes it) O_DIRECT.
pub(super) struct ShardFile {
    pub(super) path: PathBuf,
    pub(super) buffered: File,
    pub(super) direct: Option<File>,
}

/// The alignment O_DIRECT reads keep (offsets, lengths, buffer addresses).
pub(super) const PAGE: u64 = 4096;
/// Tensors of one shard closer than this are read in one `pread` (the gap read and dropped).
const COALESCE_GAP: u64 = 1 << 20;

#[cfg(target_os = "linux")]
pub(super) fn open_direct(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path)
}

#[cfg(not(target_os = "linux"))]
pub(super) fn open_direct(_path: &std::path::Path) -> std::io::Result<File> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "O_DIRECT is Linux-only here"))
}

/// Reads one expert: its tensors grouped into runs of nearby spans per shard, one `pread`
/// (loop) per run. Returns the expert and whether every read went through O_DIRECT.
pub(super) fn read_expert(files: &[ShardFile], place: &Place) -> std::result::Result<(Expert, bool), String> {
    let mut spans = place.spans();
    spans.sort_by_key(|s| (s.shard, s.start));
    let mut tensors: HashMap<&str, Tensor> = HashMap::new();
    let mut all_direct = true;
    let mut i = 0;
    while i < spans.len() {
        let mut j = i + 1;
        let mut end = spans[i].start + spans[i].len;
        while j < spans.len() && spans[j].shard == spans[i].shard && spans[j].start <= end + COALESCE_GAP {
            end = end.max(spans[j].start + spans[j].len);
            j += 1;
        }
        let (words, base, direct) = read_range(&files[spans[i].shard], spans[i].start, end, &spans[i].name)?;
        all_direct &= direct;
        for s in &spans[i..j] {
            let off = base + (s.start - spans[i].start) as usize;
            let t = Tensor::shared(s.dtype, s.shape.clone(), words.clone(), off, s.len as usize).map_err(|e| format!("tensor `{}`: {e}", s.name))?;
            tensors.insert(&s.name, t);
        }
        i = j;
    }
    let matrix = |p: &Part| -> std::result::Result<Matrix, String> {
        match p {
            Part::Mxfp4 { packed, scale } => Matrix::mxfp4(tensors[packed.name.as_str()].clone(), tensors[scale.name.as_str()].clone())
                .map_err(|e| format!("tensor `{}` ({}): {e}", scale.name, files[scale.shard].path.display())),
            Part::Dense(w) => Matrix::dense(tensors[w.name.as_str()].clone()).map_err(|e| format!("tensor `{}`: {e}", w.name)),
        }
    };
    let [w1, w3, w2] = &place.parts;
    Ok((Expert { w1: matrix(w1)?, w3: matrix(w3)?, w2: matrix(w2)? }, all_direct))
}

/// Reads into `buf` from `at` until it is full, the file ends or (`page_steps`) a read returns
/// less than whole pages (O_DIRECT at the end of a file): the bytes read.
fn fill(f: &File, buf: &mut [u8], at: u64, page_steps: bool) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => break,
            Ok(k) => {
                done += k;
                if page_steps && !(k as u64).is_multiple_of(PAGE) {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Bytes `[start, end)` of a shard into a new word buffer: `(buffer, byte offset of start in
/// it, through O_DIRECT)`. O_DIRECT reads whole pages into a page-aligned part of the buffer
/// (what it leaves at the end of a file is read buffered); a file that refuses it is read
/// buffered.
fn read_range(f: &ShardFile, start: u64, end: u64, first: &str) -> std::result::Result<(Arc<Vec<u64>>, usize, bool), String> {
    let fail = |e: std::io::Error| format!("{}: reading tensor `{first}` (bytes {start}..{end}): {e}", f.path.display());
    let short = |got: usize| {
        format!(
            "{}: reading tensor `{first}` (bytes {start}..{end}) got {got} of {} bytes: the file is truncated or changed since it was opened",
            f.path.display(),
            end - start
        )
    };
    if let Some(d) = &f.direct {
        let (a0, a1) = (start / PAGE * PAGE, end.div_ceil(PAGE) * PAGE);
        let n = (a1 - a0) as usize;
        let mut words = vec![0u64; (n + PAGE as usize) / 8];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
        let pad = (PAGE as usize - (bytes.as_ptr() as usize % PAGE as usize)) % PAGE as usize;
        let (lead, need) = ((start - a0) as usize, (end - a0) as usize);
        match fill(d, &mut bytes[pad..pad + n], a0, true) {
            Ok(mut done) => {
                if done < need {
                    done += fill(&f.buffered, &mut bytes[pad + done..pad + need], a0 + done as u64, false).map_err(fail)?;
                }
                if done < need {
                    return Err(short(done.saturating_sub(lead)));
                }
                return Ok((Arc::new(words), pad + lead, true));
            }
            // The file system refuses O_DIRECT for this read: buffered below.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(fail(e)),
        }
    }
    let n = (end - start) as usize;
    let mut words = vec![0u64; n.div_ceil(8)];
    let done = fill(&f.buffered, &mut bytemuck::cast_slice_mut(&mut words)[..n], start, false).map_err(fail)?;
    if done < n {
        return Err(short(done));
    }
    Ok((Arc::new(words), 0, false))
}
