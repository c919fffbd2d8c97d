//! The SiTU-GLU MLP (text-backbone §7.4–7.6): `down( SiTU-GLU(gate x, up x) )`. Used for the
//! dense FFN of layer 0 (`mlp.*`) and for the fused shared experts (`shared_experts.*`).

use k3_core::kernels::cpu::act::situ_glu_slice;
use k3_core::kernels::cpu::matmul::Matrix;

use super::{lin, matrix};
use crate::error::Result;
use crate::source::Tensors;

pub struct Mlp {
    pub gate_proj: Matrix,
    pub up_proj: Matrix,
    pub down_proj: Matrix,
    pub beta: f32,
    pub linear_beta: f32,
}

impl Mlp {
    /// Loads `{p}gate_proj`, `{p}up_proj` `[inter, h]` and `{p}down_proj` `[h, inter]` (`inter`
    /// is this rank's share of the columns; the partial outputs of the ranks add up).
    pub fn load<S: Tensors + ?Sized>(ck: &S, p: &str, h: usize, inter: usize, beta: f32, linear_beta: f32) -> Result<Self> {
        Ok(Mlp {
            gate_proj: matrix(ck, &format!("{p}gate_proj.weight"), inter, h)?,
            up_proj: matrix(ck, &format!("{p}up_proj.weight"), inter, h)?,
            down_proj: matrix(ck, &format!("{p}down_proj.weight"), h, inter)?,
            beta,
            linear_beta,
        })
    }

    /// `x` `[T, h]` → `[T, h]`.
    pub fn forward(&self, x: &[f32], t: usize) -> Result<Vec<f32>> {
        let g = lin(x, t, &self.gate_proj)?; // [T, inter]
        let u = lin(x, t, &self.up_proj)?;
        let mut a = vec![0f32; g.len()];
        situ_glu_slice(&g, &u, &mut a, self.beta, self.linear_beta);
        lin(&a, t, &self.down_proj)
    }
}
