//! Scalar-decay linear attention forward on one GPU (simple GLA, RetNet, Lightning attention).
//!
//! Per batch `b` and head `h`, with row vectors and `sigma = scale`:
//! `S_t = e^{a_t} S_{t-1} + k_t^T v_t`, `o_t = sigma q_t S_t`, `a_t = g[b, t, h] <= 0`.
//! Tensors are in fla's layout: `q, k [B, T, H, Dk]`, `v, o [B, T, H, Dv]` bf16, `g [B, T, H]`
//! fp32 (natural-log decays), optional `h0` / `ht` fp32 `[B, H, Dk, Dv]`.
//!
//! ```no_run
//! use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardShape, ScalarDecayForward};
//! use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
//! use lasp_shmem::{Config, Runtime};
//!
//! let rt = Runtime::init(Config::default())?;
//! let stream = rt.stream().clone();
//! let shape = ForwardShape { b: 1, t: 4096, h: 16, dk: 128, dv: 128 };
//! let q = stream.alloc_zeros::<bf16>(shape.qk_len())?;
//! let k = stream.alloc_zeros::<bf16>(shape.qk_len())?;
//! let v = stream.alloc_zeros::<bf16>(shape.v_len())?;
//! let g = stream.alloc_zeros::<f32>(shape.gate_len())?;
//! let mut o = stream.alloc_zeros::<bf16>(shape.v_len())?;
//! let mut forward = ScalarDecayForward::new(&rt)?;
//! forward.launch(
//!     &stream,
//!     ForwardArgs {
//!         shape,
//!         q: DeviceRef::new(&q),
//!         k: DeviceRef::new(&k),
//!         v: DeviceRef::new(&v),
//!         g: DeviceRef::new(&g),
//!         h0: None,
//!         o: DeviceMut::new(&mut o),
//!         ht: None,
//!         scale: None, // Dk^-1/2
//!     },
//! )?;
//! stream.synchronize()?;
//! # drop(forward);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The kernels are `kernels/cuda/scalar_decay/forward.cu`; [`geometry`] ports the launch, shared
//! memory and workspace formulas of `kernels/cuda/include/lasp/scalar_decay/forward_params.h` (with its
//! constants), and [`ScalarDecayParams`] is its parameter struct, generated from it.
//! Call sequence (one stream): with `S > 1` segments per sequence, the states kernel (local end
//! state of every segment but the last), the fold (prefix state entering every segment), then
//! always the output kernel: one warpgroup per CTA at two CTAs per SM when `S > 1`, two
//! warpgroups (a state role one chunk ahead of an output role) at one CTA per SM when `S = 1`.

use crate::error::Error;

mod args;
pub mod backward;
mod document_states;
mod family;
mod forward;
pub mod geometry;
pub mod lasp2;
mod params;
mod plan;
mod probe;
mod shape;
#[cfg(test)]
mod tests;

pub(crate) use args::{check_args, check_args_of, TensorChecks};
pub use args::{check_gate_values, ForwardArgs};
pub use backward::{BackwardArgs, ScalarDecayBackward};
pub use document_states::{DocumentStatesArgs, ScalarDecayDocumentStates};
pub use family::ScalarDecay;
pub use forward::ScalarDecayForward;
pub(crate) use forward::{segment_kernels, SegmentStarts};
use params::roles_params;
pub use params::{RolesParams, ScalarDecayParams};
pub use plan::ForwardPlan;
pub use probe::OutputProbe;
pub use shape::{ForwardShape, MAX_BH, MAX_T};

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}
