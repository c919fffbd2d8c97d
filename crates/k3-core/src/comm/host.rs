//! [`HostGroup`]: N ranks as threads of one process, exchanging host f32 buffers.
//!
//! Every collective is one *round*: each rank deposits its buffer; the last to arrive combines
//! them (sums in rank order 0, 1, …, so the result is the same bits on every rank and does not
//! depend on arrival order), publishes the result and wakes the others. A round also checks
//! that every rank called the same verb with compatible lengths. Point-to-point messages go
//! through per-pair queues. Waiting is bounded: past the group's timeout a rank aborts the
//! group with an error naming the verb and the ranks that never came, so a dead or stuck rank
//! makes every rank fail instead of hang.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{check_counts, Group};
use crate::{CoreError, Result};

/// How long a rank waits for its peers before it gives up (overridable per group).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast(usize),
    Barrier,
}

impl Verb {
    fn name(self) -> &'static str {
        match self {
            Verb::AllReduce => "all_reduce_sum",
            Verb::AllGather => "all_gather",
            Verb::ReduceScatter => "reduce_scatter",
            Verb::Broadcast(_) => "broadcast",
            Verb::Barrier => "barrier",
        }
    }
}

#[derive(Default)]
struct State {
    /// Completed rounds.
    round: u64,
    /// This round's deposits, by rank.
    slots: Vec<Option<(Verb, Vec<f32>)>>,
    /// The last completed round's result: one buffer, or one per rank for gathers.
    result: Option<std::result::Result<Arc<Vec<Vec<f32>>>, String>>,
    mail: HashMap<(usize, usize), VecDeque<Vec<f32>>>,
    aborted: Option<String>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank's handle on an in-process group (create all of them with [`HostGroup::create`] and
/// move one into each rank's thread).
#[derive(Clone)]
pub struct HostGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl HostGroup {
    /// The `world` handles of one group, rank 0 first, waiting at most [`DEFAULT_TIMEOUT`].
    pub fn create(world: usize) -> Vec<HostGroup> {
        Self::with_timeout(world, DEFAULT_TIMEOUT)
    }

    /// [`HostGroup::create`] with another bound on how long a rank waits for its peers.
    pub fn with_timeout(world: usize, timeout: Duration) -> Vec<HostGroup> {
        let state = State { slots: vec![None; world.max(1)], ..State::default() };
        let shared = Arc::new(Shared { world: world.max(1), timeout, state: Mutex::new(state), cv: Condvar::new() });
        (0..world.max(1)).map(|rank| HostGroup { rank, shared: shared.clone() }).collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn err(op: &'static str, msg: String) -> CoreError {
        CoreError::Comm { op, msg }
    }

    /// Waits on the condition variable until `done` holds; errors on abort or timeout (which
    /// also aborts the group, naming `missing()`).
    fn wait_until<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        op: &'static str,
        mut done: impl FnMut(&State) -> bool,
        missing: impl Fn(&State) -> String,
    ) -> Result<MutexGuard<'a, State>> {
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if let Some(why) = &st.aborted {
                return Err(Self::err(op, format!("rank {} of {}: the group was aborted: {why}", self.rank, self.shared.world)));
            }
            if done(&st) {
                return Ok(st);
            }
            let now = Instant::now();
            if now >= deadline {
                let why = format!("rank {} waited {:.0} s in {op} for {}", self.rank, self.shared.timeout.as_secs_f64(), missing(&st));
                st.aborted = Some(why.clone());
                self.shared.cv.notify_all();
                return Err(Self::err(op, why));
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// One collective round: deposit `x`, wait for the round to complete, return its result.
    fn round(&self, verb: Verb, x: Vec<f32>) -> Result<Arc<Vec<Vec<f32>>>> {
        let op = verb.name();
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(Self::err(op, format!("rank {}: the group was aborted: {why}", self.rank)));
        }
        let my_round = st.round;
        st.slots[self.rank] = Some((verb, x));
        if st.slots.iter().all(Option::is_some) {
            let deposits: Vec<(Verb, Vec<f32>)> = st.slots.iter_mut().map(|s| s.take().expect("checked")).collect();
            st.result = Some(combine(deposits));
            st.round += 1;
            self.shared.cv.notify_all();
        }
        let missing = |s: &State| {
            let m: Vec<String> = s.slots.iter().enumerate().filter(|(_, d)| d.is_none()).map(|(r, _)| r.to_string()).collect();
            format!("rank(s) {} of {}", m.join(", "), self.shared.world)
        };
        let st = self.wait_until(st, op, |s| s.round > my_round, missing)?;
        match st.result.as_ref().expect("a completed round has a result") {
            Ok(r) => Ok(r.clone()),
            Err(why) => Err(Self::err(op, why.clone())),
        }
    }
}

/// Combines one round's deposits: checks that every rank called the same verb, then sums (in
/// rank order), gathers or picks the root's buffer.
fn combine(deposits: Vec<(Verb, Vec<f32>)>) -> std::result::Result<Arc<Vec<Vec<f32>>>, String> {
    let verb = deposits[0].0;
    if let Some((r, (v, _))) = deposits.iter().enumerate().find(|(_, (v, _))| *v != verb) {
        return Err(format!("rank 0 called {} while rank {r} called {}: the ranks ran different programs", verb.name(), v.name()));
    }
    let lens: Vec<usize> = deposits.iter().map(|(_, x)| x.len()).collect();
    let same_len = lens.iter().all(|&n| n == lens[0]);
    match verb {
        Verb::AllReduce | Verb::ReduceScatter => {
            if !same_len {
                return Err(format!("{}: the ranks passed buffers of {lens:?} values", verb.name()));
            }
            let mut it = deposits.into_iter().map(|(_, x)| x);
            let mut sum = it.next().unwrap_or_default();
            for x in it {
                sum.iter_mut().zip(&x).for_each(|(a, b)| *a += b);
            }
            Ok(Arc::new(vec![sum]))
        }
        Verb::AllGather => Ok(Arc::new(deposits.into_iter().map(|(_, x)| x).collect())),
        Verb::Broadcast(root) => Ok(Arc::new(vec![deposits.into_iter().nth(root).map(|(_, x)| x).unwrap_or_default()])),
        Verb::Barrier => Ok(Arc::new(Vec::new())),
    }
}

impl Group for HostGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.shared.world
    }
    fn all_reduce_sum(&self, x: &mut [f32]) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let r = self.round(Verb::AllReduce, x.to_vec())?;
        x.copy_from_slice(&r[0]);
        Ok(())
    }
    fn all_gather(&self, x: &[f32]) -> Result<Vec<Vec<f32>>> {
        if self.shared.world == 1 {
            return Ok(vec![x.to_vec()]);
        }
        Ok(self.round(Verb::AllGather, x.to_vec())?.as_ref().clone())
    }
    fn reduce_scatter(&self, x: &[f32], counts: &[usize]) -> Result<Vec<f32>> {
        check_counts("reduce_scatter", x.len(), counts, self.shared.world)?;
        let r = if self.shared.world == 1 { Arc::new(vec![x.to_vec()]) } else { self.round(Verb::ReduceScatter, x.to_vec())? };
        let start: usize = counts[..self.rank].iter().sum();
        Ok(r[0][start..start + counts[self.rank]].to_vec())
    }
    fn broadcast(&self, root: usize, x: &mut Vec<f32>) -> Result<()> {
        if root >= self.shared.world {
            return Err(Self::err("broadcast", format!("root {root} is outside a group of {}", self.shared.world)));
        }
        if self.shared.world == 1 {
            return Ok(());
        }
        let mine = if self.rank == root { x.clone() } else { Vec::new() };
        let r = self.round(Verb::Broadcast(root), mine)?;
        if self.rank != root {
            *x = r[0].clone();
        }
        Ok(())
    }
    fn send(&self, to: usize, x: &[f32]) -> Result<()> {
        if to >= self.shared.world || to == self.rank {
            return Err(Self::err("send", format!("rank {} cannot send to rank {to} of a group of {}", self.rank, self.shared.world)));
        }
        let mut st = self.lock();
        if let Some(why) = &st.aborted {
            return Err(Self::err("send", format!("rank {}: the group was aborted: {why}", self.rank)));
        }
        st.mail.entry((self.rank, to)).or_default().push_back(x.to_vec());
        self.shared.cv.notify_all();
        Ok(())
    }
    fn recv(&self, from: usize) -> Result<Vec<f32>> {
        if from >= self.shared.world || from == self.rank {
            return Err(Self::err("recv", format!("rank {} cannot receive from rank {from} of a group of {}", self.rank, self.shared.world)));
        }
        let key = (from, self.rank);
        let st = self.lock();
        let mut st = self.wait_until(st, "recv", |s| s.mail.get(&key).is_some_and(|q| !q.is_empty()), |_| format!("a message from rank {from}"))?;
        Ok(st.mail.get_mut(&key).and_then(VecDeque::pop_front).expect("checked non-empty"))
    }
    fn barrier(&self) -> Result<()> {
        if self.shared.world == 1 {
            return Ok(());
        }
        self.round(Verb::Barrier, Vec::new()).map(|_| ())
    }
    fn abort(&self, why: &str) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(format!("rank {}: {why}", self.rank));
        }
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send + 'static>(world: usize, f: impl Fn(HostGroup) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let hs: Vec<_> = HostGroup::create(world)
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    }

    #[test]
    fn all_reduce_is_the_same_bits_on_every_rank() {
        let out = run(4, |g| {
            let mut x: Vec<f32> = (0..5).map(|i| 0.1 * (i + 1) as f32 * (g.rank() + 1) as f32).collect();
            g.all_reduce_sum(&mut x).unwrap();
            x
        });
        // Fixed rank order: ((x0 + x1) + x2) + x3.
        let want: Vec<f32> = (0..5)
            .map(|i| {
                let v = |r: usize| 0.1 * (i + 1) as f32 * (r + 1) as f32;
                ((v(0) + v(1)) + v(2)) + v(3)
            })
            .collect();
        for x in out {
            assert_eq!(x, want);
        }
    }

    #[test]
    fn gather_scatter_broadcast_and_mail() {
        let out = run(3, |g| {
            let r = g.rank();
            let gathered = g.all_gather(&vec![r as f32; r + 1]).unwrap();
            let part = g.reduce_scatter(&[1.0, 2.0, 3.0, 4.0], &[1, 2, 1]).unwrap();
            let mut b = if r == 2 { vec![7.0, 8.0] } else { vec![] };
            g.broadcast(2, &mut b).unwrap();
            let next = (r + 1) % 3;
            g.send(next, &[r as f32, 10.0]).unwrap();
            g.send(next, &[r as f32, 20.0]).unwrap();
            let prev = (r + 2) % 3;
            let m = (g.recv(prev).unwrap(), g.recv(prev).unwrap());
            g.barrier().unwrap();
            (gathered, part, b, m)
        });
        for (r, (gathered, part, b, (m1, m2))) in out.into_iter().enumerate() {
            assert_eq!(gathered, vec![vec![0.0], vec![1.0, 1.0], vec![2.0, 2.0, 2.0]]);
            let sums = [3.0, 6.0, 9.0, 12.0];
            let want: &[f32] = match r {
                0 => &sums[0..1],
                1 => &sums[1..3],
                _ => &sums[3..4],
            };
            assert_eq!(part, want);
            assert_eq!(b, vec![7.0, 8.0]);
            let prev = ((r + 2) % 3) as f32;
            assert_eq!((m1, m2), (vec![prev, 10.0], vec![prev, 20.0]));
        }
    }

    #[test]
    fn mismatched_verbs_fail_on_every_rank() {
        let out = run(2, |g| if g.rank() == 0 { g.barrier().map(|_| ()) } else { g.all_reduce_sum(&mut [1.0]).map(|_| ()) });
        for r in out {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("different programs"), "{e}");
        }
    }

    #[test]
    fn a_missing_rank_times_out_and_an_abort_wakes_the_others() {
        let gs = HostGroup::with_timeout(3, Duration::from_millis(200));
        let t0 = Instant::now();
        let e = gs[0].all_reduce_sum(&mut [1.0]).unwrap_err().to_string();
        assert!(e.contains("rank(s) 1, 2 of 3"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        // The group is now aborted: later calls of the other ranks fail at once.
        let e = gs[1].barrier().unwrap_err().to_string();
        assert!(e.contains("aborted"), "{e}");

        let gs = HostGroup::create(2);
        let g1 = gs[1].clone();
        let h = std::thread::spawn(move || g1.recv(0));
        std::thread::sleep(Duration::from_millis(50));
        gs[0].abort("rank 0 failed to load its shard");
        let e = h.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("failed to load its shard"), "{e}");
    }
}
