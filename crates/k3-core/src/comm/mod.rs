//! Communicators: the verbs the parallel model runs on, behind one trait, [`Group`].
//!
//! A group is the set of ranks that take part in one collective (a stage's tensor-parallel
//! ranks, a stage's expert-parallel ranks, the whole world for pipeline sends). Three kinds:
//! - [`Single`]: world 1. Every collective returns at once, so the sharded forward is the
//!   unsharded forward and no layer tests `world > 1`.
//! - [`host::HostGroup`]: N ranks as threads of one process, f32 sums in a fixed rank order so
//!   every rank holds the same bits. The CPU model runs tensor, expert and pipeline parallel on
//!   it, which is how CI checks the sharding plan without a GPU.
//! - `nccl` (feature `cuda`): NCCL on a device stream, for the GPU model.
//!
//! [`control`] is the control plane beside them: the TCP rendezvous that starts a world
//! (ranks, NCCL id, config digest) and the byte channel rank 0 sends each step on.
//!
//! Shapes: buffers are flat f32 slices; a collective's meaning is element-wise across ranks.
//! Failures are [`CoreError::Comm`](crate::CoreError::Comm) naming the call and the rank; a
//! rank that waits longer than its group's timeout gives up with an error, never a hang.

pub mod control;
pub mod host;
#[cfg(feature = "cuda")]
pub mod nccl;

use crate::Result;

pub use host::HostGroup;

/// The collectives and transfers of one group of ranks (host memory, f32).
pub trait Group: Send + Sync {
    /// This rank's index in the group, `0..world()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world(&self) -> usize;
    /// Element-wise sum over the ranks, in place. Every rank ends with the same values.
    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<()>;
    /// Every rank's `x`, in rank order (the lengths may differ between ranks).
    fn all_gather(&self, x: &[f32]) -> Result<Vec<Vec<f32>>>;
    /// The element-wise sum of every rank's `x` (all the same length), cut into `world()` parts
    /// of `counts[r]` values; returns this rank's part.
    fn reduce_scatter(&self, x: &[f32], counts: &[usize]) -> Result<Vec<f32>>;
    /// Root's `x` to every rank (`x` is replaced on the others).
    fn broadcast(&self, root: usize, x: &mut Vec<f32>) -> Result<()>;
    /// Sends `x` to rank `to` of this group (returns once queued).
    fn send(&self, to: usize, x: &[f32]) -> Result<()>;
    /// The next message from rank `from`, in the order it was sent.
    fn recv(&self, from: usize) -> Result<Vec<f32>>;
    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Makes every rank's pending and future calls fail with `why` (a rank that errors calls
    /// this so that its peers exit at once instead of waiting for it).
    fn abort(&self, why: &str);
}

/// The world-1 group: sums, gathers and broadcasts are the identity; there is no peer to
/// send to.
#[derive(Clone, Copy, Debug, Default)]
pub struct Single;

impl Group for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _x: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, x: &[f32]) -> Result<Vec<Vec<f32>>> {
        Ok(vec![x.to_vec()])
    }
    fn reduce_scatter(&self, x: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_counts("reduce_scatter", x.len(), counts, 1)?;
        Ok(x.to_vec())
    }
    fn broadcast(&self, _root: usize, _x: &mut Vec<f32>) -> Result<()> {
        Ok(())
    }
    fn send(&self, to: usize, _x: &[f32]) -> Result<()> {
        Err(no_peer("send", to))
    }
    fn recv(&self, from: usize) -> Result<Vec<f32>> {
        Err(no_peer("recv", from))
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
    fn abort(&self, _why: &str) {}
}

fn no_peer(op: &'static str, peer: usize) -> crate::CoreError {
    crate::CoreError::Comm { op, msg: format!("rank {peer} does not exist in a world-1 group") }
}

/// `counts` must have one entry per rank and add up to `len`.
pub(crate) fn check_counts(op: &'static str, len: usize, counts: &[usize], world: usize) -> Result<()> {
    if counts.len() != world || counts.iter().sum::<usize>() != len {
        return Err(crate::CoreError::Comm { op, msg: format!("counts {counts:?} do not split {len} values over {world} ranks") });
    }
    Ok(())
}

/// `[start, end)` of part `i` when `n` units are split into `parts` as evenly as possible
/// (the first `n % parts` parts get one more). The one partition rule of k3rs: heads, vocab
/// rows, FFN columns, experts and layers are all split by it.
pub fn part(n: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let (q, r) = (n / parts, n % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_covers_in_order() {
        for n in 0..20 {
            for parts in 1..9 {
                let mut next = 0;
                for i in 0..parts {
                    let p = part(n, parts, i);
                    assert_eq!(p.start, next);
                    assert!(p.len() == n / parts || p.len() == n / parts + 1);
                    next = p.end;
                }
                assert_eq!(next, n);
            }
        }
        assert_eq!(part(96, 8, 3), 36..48);
        assert_eq!(part(3, 2, 1), 2..3);
    }

    #[test]
    fn single_is_the_identity() {
        let g = Single;
        let mut x = vec![1.0, 2.0];
        g.all_reduce_sum(&mut x).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        assert_eq!(g.all_gather(&x).unwrap(), vec![vec![1.0, 2.0]]);
        assert!(g.send(1, &x).is_err());
        assert!(g.reduce_scatter(&x, &[3]).is_err());
    }
}
