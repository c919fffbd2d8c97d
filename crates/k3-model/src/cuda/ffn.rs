//! The SiTU-GLU MLP on the GPU (text-backbone §7.4–7.6): `down(SiTU-GLU(gate x, up x))` with
//! BF16 weights through cuBLAS. Serves the dense FFN (`mlp.*`) and the shared experts
//! (`shared_experts.*`), as `layers/ffn.rs` does on the CPU.
//!
//! On a tensor-parallel rank `inter` is its share of the rows and the output a partial sum.
//!
//! Shapes: `x` BF16 `[N, H]` → F32 `[N, H]`; intermediate BF16 `[N, I]`.

use k3_core::cuda::ops::situ_glu;
use k3_core::cuda::{CudaDevice, CudaTensor};
use k3_core::DType;

use super::upload::matrix;
use super::{lin, lin_many};
use crate::error::Result;
use crate::source::Tensors;

pub struct Mlp {
    pub gate_proj: CudaTensor,
    pub up_proj: CudaTensor,
    pub down_proj: CudaTensor,
    pub beta: f32,
    pub linear_beta: f32,
}

impl Mlp {
    pub fn load<S: Tensors + ?Sized>(dev: &CudaDevice, ck: &S, p: &str, h: usize, inter: usize, beta: f32, linear_beta: f32, dt: DType) -> Result<Self> {
        Ok(Mlp {
            gate_proj: matrix(dev, ck, &format!("{p}gate_proj.weight"), inter, h, dt)?,
            up_proj: matrix(dev, ck, &format!("{p}up_proj.weight"), inter, h, dt)?,
            down_proj: matrix(dev, ck, &format!("{p}down_proj.weight"), h, inter, dt)?,
            beta,
            linear_beta,
        })
    }

    pub fn forward(&self, x: &CudaTensor) -> Result<CudaTensor> {
        let act = x.dtype(); // BF16, or F32 in the reference precision
        let [g, u] = lin_many(x, [(&self.gate_proj, act), (&self.up_proj, act)])?; // [N, I]
        self.down(&g, &u)
    }

    /// The second half of [`Mlp::forward`], for callers that computed the gate and up
    /// projections together with other products of the same input: SiTU-GLU in place in `g`,
    /// then `down_proj`. `g`, `u` BF16 `[N, I]` → F32 `[N, H]`.
    pub fn down(&self, g: &CudaTensor, u: &CudaTensor) -> Result<CudaTensor> {
        situ_glu(g, u, self.beta, self.linear_beta, g)?;
        lin(g, &self.down_proj, DType::F32)
    }

    pub fn weight_bytes(&self) -> u64 {
        (self.gate_proj.byte_len() + self.up_proj.byte_len() + self.down_proj.byte_len()) as u64
    }
}
