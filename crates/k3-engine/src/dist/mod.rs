//! Ranks, launch and the per-step message: everything that makes several model shards act as
//! one model lives here, behind the engine's runner interface (`docs/parallel.md`).
//!
//! - [`step`]: the commands rank 0 sends every rank — the per-step message (the planned
//!   sequences, their new tokens and own input rows, the released sequences), the verify forward
//!   and rollback of speculative decoding, the capture and restore of the prefix cache — and
//!   their byte form.
//! - [`layout_state`]: a sequence state of a layout, rank by rank: every rank's captured part
//!   joined into the prefix cache's one stored state, a stored state cut into the ranks' parts.
//! - [`kept`]: the prefix cache on a multi-process layout: every rank keeps its own part of
//!   each stored cell and snapshot in its own process, under a key rank 0's cache holds.
//! - [`runner`]: the runner interface the engine drives; [`worker`]: one CPU rank's model and
//!   sequence states as the runner drives them; [`draft`]: a separate draft model's states
//!   beside them (`--speculative draft`, one rank).
//! - [`threads`]: ranks as threads on the CPU (`k3 run --tp N --device cpu`), each step sent
//!   to every rank; on a pipeline layout successive steps overlap across the stages.
//! - `engine_step.rs` (a part of the engine): pipelined scheduling, a step per stage in flight.
//! - [`process`]: ranks as processes: rank 0's runner over the control plane, the workers'
//!   loop, and `launch`, which `k3 run` / `k3 serve` call to take their part.
//! - [`loading`]: a world's loading: the workers' progress and "loaded" replies, rank 0's bar.
//! - [`monitor`]: rank 0's watch over the workers' links during a step (a dead worker
//!   aborts the step at once).
//! - [`launch`]: one process per GPU: the world from flags or the torchrun/Slurm environment,
//!   local ranks started by the node's first process, the TCP rendezvous (digest check, NCCL
//!   ids), and the NCCL groups of a rank.

pub mod draft;
pub mod kept;
pub mod launch;
pub mod layout_state;
pub mod loading;
pub mod monitor;
pub mod process;
pub mod runner;
pub mod step;
pub mod threads;
pub mod worker;
