//! The bits of one backward call's gradients, read back after the call: what the GPU tests and the
//! LASP-2 programs' checks compare bitwise across runs and exchange modes, and search for poison
//! left unwritten.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::bf16;
use lasp_shmem::Result;
use std::sync::Arc;

use crate::{bf16_bits, bf16_values, f32_bits, shard_rows};
use lasp_shmem::reference::Tensor;

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

/// What a PE's check compares of dq, dk and dv, in that order: each name, the values of its bits
/// and the reference's rows of this PE's shard (`want`: the whole sequence's `[B, T, ...]`
/// gradients; the shard holds tokens `[start, start + len)`).
pub fn qkv_rows(
    got: [&[u16]; 3],
    want: [&Tensor; 3],
    start: usize,
    len: usize,
) -> Vec<(&'static str, Vec<f64>, Vec<f64>)> {
    ["dq", "dk", "dv"]
        .into_iter()
        .zip(got.into_iter().zip(want))
        .map(|(name, (got, want))| (name, bf16_values(got), shard_rows(want, start, len)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qkv_rows_pair_each_gradient_with_the_shards_reference_rows() {
        // [B = 2, T = 3, 1]: values 10 b + t; the shard holds token 1 and 2.
        let whole = |offset: f64| {
            let data = (0..2)
                .flat_map(|b| (0..3).map(move |t| offset + 10.0 * b as f64 + t as f64))
                .collect();
            Tensor::from_vec(&[2, 3, 1], data).unwrap()
        };
        let (dq, dk, dv) = (whole(0.0), whole(100.0), whole(200.0));
        let bits = |x: f32| bf16::from_f32(x).to_bits();
        let got = [vec![bits(1.0); 4], vec![bits(2.0); 4], vec![bits(3.0); 4]];
        let rows = qkv_rows([&got[0], &got[1], &got[2]], [&dq, &dk, &dv], 1, 2);
        let names: Vec<&str> = rows.iter().map(|r| r.0).collect();
        assert_eq!(names, ["dq", "dk", "dv"]);
        assert_eq!(rows[0].1, vec![1.0; 4]);
        assert_eq!(rows[1].2, vec![101.0, 102.0, 111.0, 112.0]);
        assert_eq!(rows[2].2, vec![201.0, 202.0, 211.0, 212.0]);
    }
}
