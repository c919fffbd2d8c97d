//! The host side of staged copies between pageable host memory and a device (`cuda/pinned.rs`
//! `Staging`): the host slices of one transfer are cut into pieces of at most [`PIECE`] bytes,
//! grouped into windows that fill a bounce buffer ([`windows`]), and each window's pieces are
//! copied into or out of the buffer by rayon tasks ([`gather`], [`scatter`]) — the copies and the
//! first-touch page faults of fresh destination memory spread over threads. CPU only, so it is
//! tested and timed without a GPU (`k3-vision` `bench_tower --host-only`).
//!
//! Shape legend: a transfer is the concatenation of its slices, in order; a window is
//! `(first, end, bytes)`: pieces `first..end`, their total bytes.

use rayon::prelude::*;

/// Host pieces of at most this many bytes are copied by one rayon task.
pub const PIECE: usize = 1 << 20;

/// A bounce buffer size that keeps the link busy (64 MB take ~2.6 ms at 25 GB/s) without
/// pinning much host memory (the vision tower's, `k3-vision` `cuda.rs`).
pub const BUFFER_BYTES: usize = 64 << 20;

/// The slices `parts` cut into pieces of at most [`PIECE`] bytes, in order.
pub fn pieces<'a>(parts: &[&'a [u8]]) -> Vec<&'a [u8]> {
    parts.iter().flat_map(|p| p.chunks(PIECE)).collect()
}

/// The slices `outs` cut into pieces of at most [`PIECE`] bytes, in order.
pub fn pieces_mut<'a>(outs: &'a mut [&mut [u8]]) -> Vec<&'a mut [u8]> {
    outs.iter_mut().flat_map(|o| o.chunks_mut(PIECE)).collect()
}

/// Consecutive runs of the pieces of lengths `lens` (each at most `cap`), each run as many whole
/// pieces as fit in `cap` bytes.
pub fn windows(lens: &[usize], cap: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let (mut first, mut bytes) = (0, 0);
    for (k, &n) in lens.iter().enumerate() {
        if bytes + n > cap && k > first {
            out.push((first, k, bytes));
            (first, bytes) = (k, 0);
        }
        bytes += n;
    }
    if lens.len() > first {
        out.push((first, lens.len(), bytes));
    }
    out
}

/// `len` zeros to be overwritten by [`scatter`]: fresh memory, whose pages (on Linux) are asked
/// to be transparent huge pages (`madvise(MADV_HUGEPAGE)`; the kernel may decline), so the
/// first touch faults once per 2 MiB instead of once per 4 KiB — the faults, not the copy, were
/// most of the host time of a large download into fresh `Vec`s.
pub fn fresh_f32(len: usize) -> Vec<f32> {
    let v = vec![0f32; len];
    #[cfg(target_os = "linux")]
    if len * 4 >= 4 * HUGE {
        let start = (v.as_ptr() as usize).next_multiple_of(HUGE);
        let end = (v.as_ptr() as usize + len * 4) / HUGE * HUGE;
        if end > start {
            // SAFETY: an advice on whole huge pages inside the Vec's allocation; it changes
            // how pages are backed, never their contents (zero until written).
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
        }
    }
    v
}

/// A transparent huge page (x86-64 and most aarch64 kernels).
#[cfg(target_os = "linux")]
const HUGE: usize = 2 << 20;

/// Copies `pieces` side by side into the start of `buf` (which must hold them), in parallel.
pub fn gather(buf: &mut [u8], pieces: &[&[u8]]) {
    let mut rest = buf;
    let mut dst = Vec::with_capacity(pieces.len());
    for p in pieces {
        let (a, b) = rest.split_at_mut(p.len());
        dst.push(a);
        rest = b;
    }
    dst.into_par_iter().zip(pieces).for_each(|(d, p)| d.copy_from_slice(p));
}

/// Copies the start of `buf` (which must hold them) into `pieces`, side by side, in parallel.
pub fn scatter(buf: &[u8], pieces: &mut [&mut [u8]]) {
    let mut offs = Vec::with_capacity(pieces.len());
    let mut at = 0;
    for p in pieces.iter() {
        offs.push(at);
        at += p.len();
    }
    pieces.par_iter_mut().zip(offs).for_each(|(p, o)| p.copy_from_slice(&buf[o..o + p.len()]));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_every_piece_once_within_the_cap() {
        assert_eq!(windows(&[], 8), vec![]);
        assert_eq!(windows(&[8], 8), vec![(0, 1, 8)]);
        assert_eq!(windows(&[4, 4, 4, 1, 3, 8, 2], 8), vec![(0, 2, 8), (2, 5, 8), (5, 6, 8), (6, 7, 2)]);
        assert_eq!(windows(&[3, 3, 3], 8), vec![(0, 2, 6), (2, 3, 3)]);
    }

    /// Uneven slices (empty, under, at and over one piece) through a buffer of 3 pieces, in and
    /// back out, as `Staging` moves them: the bytes arrive unchanged and in order.
    #[test]
    fn gather_then_scatter_through_a_small_buffer_is_the_identity() {
        let lens = [0, 5, PIECE, 3 * PIECE + 7, 1, 2 * PIECE - 1];
        let src: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7) as u8).collect()).collect();
        let parts: Vec<&[u8]> = src.iter().map(|v| v.as_slice()).collect();
        let mut dev = Vec::new();
        let mut buf = vec![0u8; 3 * PIECE];
        let ins = pieces(&parts);
        let lens_in: Vec<usize> = ins.iter().map(|p| p.len()).collect();
        for (i, j, len) in windows(&lens_in, buf.len()) {
            gather(&mut buf, &ins[i..j]);
            dev.extend_from_slice(&buf[..len]);
        }
        assert_eq!(dev, parts.concat());
        let mut back: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
        let mut outs: Vec<&mut [u8]> = back.iter_mut().map(|v| v.as_mut_slice()).collect();
        let mut outs = pieces_mut(&mut outs);
        let lens_out: Vec<usize> = outs.iter().map(|p| p.len()).collect();
        let mut at = 0;
        for (i, j, len) in windows(&lens_out, buf.len()) {
            buf[..len].copy_from_slice(&dev[at..at + len]);
            scatter(&buf, &mut outs[i..j]);
            at += len;
        }
        assert_eq!(back, src);
        // Fresh download targets, large enough for the huge-page advice: zeros of the length.
        let z = fresh_f32(3 * PIECE + 1);
        assert!(z.len() == 3 * PIECE + 1 && z.iter().all(|&x| x.to_bits() == 0));
    }
}
