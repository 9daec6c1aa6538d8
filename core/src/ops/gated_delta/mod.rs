//! Gated DeltaNet forward and backward on one GPU: the delta rule with a scalar decay per token
//! and head (fla's `chunk_gated_delta_rule`, with q and k taken as given: l2-normalised by the
//! caller where the model normalises them).
//!
//! Per batch `b` and head `h`, with row vectors and `sigma = scale`:
//! `S_t = e^{a_t} (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t`, `o_t = sigma q_t S_t`,
//! `a_t = g[b, t, h] <= 0`, `beta_t = beta[b, t, h]`. Tensors are in fla's layout: `q, k [B, T, H,
//! Dk]`, `v, o [B, T, H, Dv]` bf16, `g, beta [B, T, H]` fp32, optional `h0` / `ht` fp32 `[B, H, Dk,
//! Dv]`; Dk 64 or 128, Dv a multiple of 64.
//!
//! The kernels are `kernels/cuda/gated_delta/forward.cu` (the design: `kernels/docs/gated-delta.md`);
//! the parameter struct [`GatedDeltaParams`] and the shared-memory and workspace formulas come from
//! `lasp/gated_delta/forward_params.h`. Call sequence (one stream): the WY kernel, `(I + L)^{-1}` of
//! every chunk into the workspace; with `S > 1` segments per sequence (so that short batches
//! still fill the SMs), the summary kernel (each segment's affine map `A_s S + b_s` but the
//! last's) and the fold (the state entering every segment); then the output kernel, scalar
//! decay's output loop with the delta rule's values step, one CTA per (64 columns of Dv,
//! segment, b*H+h). [`GatedDeltaLasp2Forward`] is the same forward across PEs (LASP-2), with
//! the shard's affine summary (A, b) exchanged from the device.
//!
//! [`GatedDeltaBackward`] returns the gradients of `o` (and `ht`) with respect to `q, k, v, g,
//! beta` (and `h0`): `dq, dk, dv` bf16 and `dg, dbeta, dh0` fp32, from the forward's inputs alone.
//! Its kernels are `kernels/cuda/gated_delta/backward.cu`, its parameters
//! [`GatedDeltaBackwardParams`] and formulas `lasp/gated_delta/backward_params.h`. Call sequence
//! (one stream), on the forward's segments: the WY kernel (`(I + L)^{-1}` and W of every chunk);
//! with `S > 1`, the forward's summary kernel (every segment's) and fold; the states kernel (the
//! forward's chain again, storing the state entering every chunk and u); with `S > 1`, the dS
//! chain's summaries (each later segment's from zero) and their fold through `A_s^T`; the dS pass
//! per segment (du and the state gradient of every chunk, from the last to the first, and dh0);
//! then the gradient kernel, one CTA per (chunk, b*H+h). [`GatedDeltaLasp2Backward`] is the same
//! backward across PEs, the shards' dS-chain summaries (`A_w`, `c_w`) exchanged down the chain.

mod backward;
mod document_states;
mod family;
mod forward;
mod lasp2;
mod lasp2_backward;
#[cfg(test)]
mod tests;

pub use backward::{GatedDeltaBackward, GatedDeltaBackwardArgs, GatedDeltaBackwardPlan};
pub use document_states::{GatedDeltaDocumentStates, GatedDeltaDocumentStatesArgs};
pub use family::GatedDelta;
pub use forward::{GatedDeltaArgs, GatedDeltaForward, GatedDeltaPlan};
pub use lasp2::{GatedDeltaLasp2Forward, Lasp2Params};
pub use lasp2_backward::GatedDeltaLasp2Backward;

/// The C struct `lasp_gated_delta_params` of `lasp/gated_delta/forward_params.h`, passed by value
/// to both forward kernels. Pointer fields hold device addresses; NULL where a tensor is absent.
pub type GatedDeltaParams = lasp_shmem_kernels::params::lasp_gated_delta_params;

/// The C struct `lasp_gated_delta_bwd_params` of `lasp/gated_delta/backward_params.h`, passed by
/// value to the backward's own kernels (the forward's summary kernel and fold take its `fwd`).
/// Pointer fields hold device addresses; NULL where a tensor is absent.
pub type GatedDeltaBackwardParams = lasp_shmem_kernels::params::lasp_gated_delta_bwd_params;
