//! Element types k3rs reads from checkpoints and computes with.
//!
//! `U8` carries MXFP4 bytes (`weight_packed`: two e2m1 nibbles per byte; `weight_scale`: one
//! E8M0 exponent per 32 weights) — see around-backbone §2.2 and `kernels::cpu::mxfp4`.

use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    U8,
    I32,
    I64,
}

impl DType {
    pub fn size_in_bytes(&self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
            DType::I32 => 4,
            DType::I64 => 8,
        }
    }

    /// The name safetensors uses in its header.
    pub fn safetensors_name(&self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::U8 => "U8",
            DType::I32 => "I32",
            DType::I64 => "I64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.safetensors_name())
    }
}
