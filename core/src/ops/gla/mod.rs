//! GLA forward and backward, on one GPU and across GPUs (LASP-2): gated linear attention with a
//! log-decay per key dimension (fla's `chunk_gla`).
//!
//! Per batch `b` and head `h`, with row vectors and `sigma = scale`:
//! `S_t = diag(e^{a_t}) S_{t-1} + k_t^T v_t`, `o_t = sigma q_t S_t`, `a_t = g[b, t, h, :] <= 0`.
//! Tensors are in fla's layout: `q, k [B, T, H, Dk]`, `v, o [B, T, H, Dv]` bf16, `g [B, T, H, Dk]`
//! fp32 (natural-log decays), optional `h0` / `ht` fp32 `[B, H, Dk, Dv]`; Dk and Dv 64 or 128.
//!
//! The kernels are `kernels/cuda/gla/forward.cu` (the chunk maths: `lasp/gla/chunk.cuh`); the
//! parameter struct [`GlaParams`] and the shared-memory and workspace formulas come from
//! `lasp/gla/forward_params.h`. Call sequence (one stream): with `S > 1` segments per sequence,
//! the states kernel (end state and log-decays of every segment but the last), the fold (the
//! prefix entering every segment), then always the output kernel, one CTA per (segment, b*H+h)
//! with one warpgroup per 64 columns of Dv; in training it also saves the state entering every
//! chunk (`chunk_states`) for the backward. [`GlaLasp2Forward`] is the same forward across PEs
//! (LASP-2), with the summary (M, Λ per key dimension) exchanged from the device.
//!
//! [`GlaBackward`] returns the gradients of `o` (and `ht`) with respect to `q, k, v, g` (and
//! `h0`): `dq, dk, dv` bf16 and `dg, dh0` fp32, as fla's `chunk_gla` does, from the forward's
//! chunk states. Its kernels are `kernels/cuda/gla/backward.cu`, its parameters
//! [`GlaBackwardParams`] and formulas `lasp/gla/backward_params.h`. Call sequence (one stream):
//! with `S > 1` segments per sequence, the summary kernel (each segment's gradient from zero and
//! its log-decays, in reverse) and the fold (the gradient leaving every segment); then always the
//! walk (the reverse recurrence of every segment, storing the gradient leaving every chunk in the
//! workspace) and the grads kernel, one CTA per (chunk, b*H+h), which computes every chunk's
//! gradients on its own. [`GlaLasp2Backward`] is the same backward across PEs, the summaries
//! exchanged down the chain.
//!
//! Packed documents (`documents` in [`GlaArgs`] and [`GlaBackwardArgs`]): the kernels mask at
//! every document start, from one word per chunk of 64 tokens each call writes in its workspace
//! (`kernels/docs/packed.md`); every operation above takes them. The forwards also give each
//! document's final state where asked ([`GlaArgs::document_ht`]; `document_states.rs`).

mod backward;
mod document_states;
mod family;
mod forward;
mod lasp2;
mod lasp2_backward;
mod plan;
#[cfg(test)]
mod tests;

pub use backward::{GlaBackward, GlaBackwardArgs, GlaBackwardPlan, SegmentOffsets};
pub use family::Gla;
pub use forward::{check_gate_values, GlaArgs, GlaForward};
pub use lasp2::{GlaLasp2Forward, Lasp2Params};
pub use lasp2_backward::GlaLasp2Backward;
pub(crate) use plan::CHUNK_STATES_LAYOUT;
pub use plan::{chunk_states_len, GlaPlan};

/// The C struct `lasp_gla_params` of `lasp/gla/forward_params.h`, passed by value to every GLA
/// forward kernel. Pointer fields hold device addresses; NULL where a tensor is absent.
pub type GlaParams = lasp_shmem_kernels::params::lasp_gla_params;

/// The C struct `lasp_gla_bwd_params` of `lasp/gla/backward_params.h`, passed by value to every
/// GLA backward kernel. Pointer fields hold device addresses; NULL where a tensor is absent.
pub type GlaBackwardParams = lasp_shmem_kernels::params::lasp_gla_bwd_params;
