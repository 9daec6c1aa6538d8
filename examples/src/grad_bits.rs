//! The bits of one backward call's gradients, read back after the call: what the GPU tests and the
//! LASP-2 programs' checks compare bitwise across runs and exchange modes, and search for poison
//! left unwritten.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::bf16;
use lasp_shmem::Result;
use std::sync::Arc;

use crate::{bf16_bits, f32_bits};

/// A backward call's gradients; `dbeta` and `dh0` empty where the family or the call has none
/// (GLA has no beta).
#[derive(PartialEq)]
pub struct GradBits {
    pub dq: Vec<u16>,
    pub dk: Vec<u16>,
    pub dv: Vec<u16>,
    pub dg: Vec<u32>,
    pub dbeta: Vec<u32>,
    pub dh0: Vec<u32>,
}

/// The device buffers of a backward call's gradients.
pub struct GradBuffers<'a> {
    pub dq: &'a CudaSlice<bf16>,
    pub dk: &'a CudaSlice<bf16>,
    pub dv: &'a CudaSlice<bf16>,
    pub dg: &'a CudaSlice<f32>,
    pub dbeta: Option<&'a CudaSlice<f32>>,
    pub dh0: Option<&'a CudaSlice<f32>>,
}

impl GradBits {
    /// Copies the gradients to the host after the stream's work.
    pub fn read(stream: &Arc<CudaStream>, grads: GradBuffers<'_>) -> Result<Self> {
        Ok(GradBits {
            dq: bf16_bits(stream, grads.dq)?,
            dk: bf16_bits(stream, grads.dk)?,
            dv: bf16_bits(stream, grads.dv)?,
            dg: f32_bits(stream, Some(grads.dg))?,
            dbeta: f32_bits(stream, grads.dbeta)?,
            dh0: f32_bits(stream, grads.dh0)?,
        })
    }
}
