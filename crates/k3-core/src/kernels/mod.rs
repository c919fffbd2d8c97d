//! Kernels: `cpu` (always built; the oracle every other backend is checked against) and
//! `cuda` (feature `cuda`). A file stem names the same op family in every backend.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
