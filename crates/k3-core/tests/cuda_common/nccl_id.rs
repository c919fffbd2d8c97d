//! How the NCCL test and bench processes share rank 0's NCCL id: rank 0 writes it to a file in
//! a folder they all know (write, then rename), the others poll for it. Included by
//! `tests/cuda_comm.rs` (through `cuda_common`) and `examples/comm_bench.rs` (by path).

use std::path::Path;
use std::time::{Duration, Instant};

use k3_core::comm::nccl::nccl_unique_id;

/// Rank 0 makes the id and publishes it; the others wait for the file (at most 120 s).
pub fn exchange_id(rank: usize, dir: &Path) -> [u8; 128] {
    let path = dir.join("nccl.id");
    if rank == 0 {
        let id = nccl_unique_id().expect("nccl id");
        std::fs::write(dir.join("nccl.id.tmp"), id).unwrap();
        std::fs::rename(dir.join("nccl.id.tmp"), &path).unwrap();
        return id;
    }
    let t0 = Instant::now();
    loop {
        if let Ok(b) = std::fs::read(&path) {
            return b.try_into().expect("128 bytes");
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "rank {rank}: no NCCL id from rank 0");
        std::thread::sleep(Duration::from_millis(10));
    }
}
