//! The bits of one backward call's gradients, read back after the call: what the GPU tests and the
//! LASP-2 programs' checks compare bitwise across runs and exchange modes, and search for poison
//! left unwritten.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::bf16;
use lasp_shmem::Result;
use std::sync::Arc;

use crate::{bf16_bits, f32_bits};

/// Gated DeltaNet's gradients (`dh0` empty where the call had none).
#[derive(PartialEq)]
pub struct GatedDeltaGradBits {
    pub dq: Vec<u16>,
    pub dk: Vec<u16>,
    pub dv: Vec<u16>,
    pub dg: Vec<u32>,
    pub dbeta: Vec<u32>,
    pub dh0: Vec<u32>,
}

impl GatedDeltaGradBits {
    /// Copies the gradients to the host after the stream's work.
    pub fn read(
        stream: &Arc<CudaStream>,
        dq: &CudaSlice<bf16>,
        dk: &CudaSlice<bf16>,
        dv: &CudaSlice<bf16>,
        dg: &CudaSlice<f32>,
        dbeta: &CudaSlice<f32>,
        dh0: Option<&CudaSlice<f32>>,
    ) -> Result<Self> {
        Ok(GatedDeltaGradBits {
            dq: bf16_bits(stream, dq)?,
            dk: bf16_bits(stream, dk)?,
            dv: bf16_bits(stream, dv)?,
            dg: f32_bits(stream, Some(dg))?,
            dbeta: f32_bits(stream, Some(dbeta))?,
            dh0: f32_bits(stream, dh0)?,
        })
    }
}

/// GLA's gradients (`dh0` empty where the call had none).
#[derive(PartialEq)]
pub struct GlaGradBits {
    pub dq: Vec<u16>,
    pub dk: Vec<u16>,
    pub dv: Vec<u16>,
    pub dg: Vec<u32>,
    pub dh0: Vec<u32>,
}

impl GlaGradBits {
    /// Copies the gradients to the host after the stream's work.
    pub fn read(
        stream: &Arc<CudaStream>,
        dq: &CudaSlice<bf16>,
        dk: &CudaSlice<bf16>,
        dv: &CudaSlice<bf16>,
        dg: &CudaSlice<f32>,
        dh0: Option<&CudaSlice<f32>>,
    ) -> Result<Self> {
        Ok(GlaGradBits {
            dq: bf16_bits(stream, dq)?,
            dk: bf16_bits(stream, dk)?,
            dv: bf16_bits(stream, dv)?,
            dg: f32_bits(stream, Some(dg))?,
            dh0: f32_bits(stream, dh0)?,
        })
    }
}
