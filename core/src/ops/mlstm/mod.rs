//! mLSTM, xLSTM's matrix LSTM (mlstm_kernels' "mLSTMexp": exponential input gate, sigmoid forget
//! gate, normaliser and max-state stabiliser), on one GPU.
//!
//! Per batch `b` and head `h`, with row vectors, `sigma = scale` and `lf_t = logsigmoid(f_t)`:
//! ```text
//! m_t = max(lf_t + m_{t-1}, i_t),   i'_t = e^{i_t - m_t},   f'_t = e^{lf_t + m_{t-1} - m_t}
//! C_t = f'_t C_{t-1} + i'_t k_t^T v_t,   n_t = f'_t n_{t-1} + i'_t k_t
//! h_t = sigma q_t C_t / (max(|sigma q_t . n_t|, e^{-m_t}) + eps)
//! ```
//! Tensors are in fla's layout: `q, k [B, T, H, Dk]`, `v, h [B, T, H, Dv]` bf16, the gate
//! pre-activations `i, f [B, T, H]` fp32, the optional initial and final states
//! `(C [B, H, Dk, Dv], n [B, H, Dk], m [B, H])` fp32; Dk and Dv 64 or 128.
//!
//! The kernels are `kernels/cuda/mlstm/forward.cu` (the chunk maths: `lasp/mlstm/chunk.cuh`,
//! which runs each 64-token chunk in the scalar-decay chunk step with the stabilised gates);
//! the parameter struct [`MlstmParams`] and the shared-memory formulas come from
//! `lasp/mlstm/forward_params.h`. Call sequence (one stream): with `S > 1` segments per
//! sequence, the states kernel (every segment's summary but the last's, from the empty state),
//! the fold (the stabilised state entering every segment), then always the output kernel, one
//! CTA per (segment, b*H+h) with a warpgroup per 64 columns of Dv.
//!
//! The backward, [`MlstmBackward`], is mlstm_kernels' gradient (the forward's stabilisers and
//! denominators held constant, which the forward saves through [`MlstmArgs::saved`]): three
//! runs of the same chunk passes without the normaliser, with the roles of the tensors
//! exchanged and, for dk and dv, time reversed (`lasp/mlstm/backward_params.h`).
//!
//! Across GPUs, [`MlstmLasp2Forward`] runs the same chunk passes on each PE's shard from the
//! state its earlier PEs' summaries fold into (LASP-2; the summary and the fold:
//! `kernels/cuda/mlstm/lasp2_forward.cu`).
//!
//! Packed documents (`documents` in [`MlstmArgs`] and [`MlstmBackwardArgs`]; fla's `cu_seqlens`):
//! every document starts from mlstm_kernels' zero state and nothing crosses a start. The chunk
//! passes' twins read one start word per chunk of 64 tokens that each call writes into its
//! workspace, restart their chunk-local scans at the starts and mask the products there
//! (`kernels/docs/packed.md`, "mLSTM"); every operation above takes them. The forwards also give
//! each document's final state where asked ([`MlstmArgs::document_final_states`];
//! `document_states.rs`).

mod backward;
mod document_states;
mod family;
mod forward;
mod lasp2;
mod lasp2_backward;
mod plan;
#[cfg(test)]
mod tests;

pub use backward::{
    MlstmBackward, MlstmBackwardArgs, MlstmBackwardPlan, MlstmBwdParams, MlstmFinalCotangent,
};
pub use family::Mlstm;
pub use forward::{
    check_gate_values, MlstmArgs, MlstmBoundaryMut, MlstmBoundaryRef, MlstmForward, MlstmSavedMut,
    MlstmSavedRef, MlstmStateMut, MlstmStateRef, DEFAULT_EPS,
};
pub use lasp2::{Lasp2Params, MlstmLasp2Forward};
pub use lasp2_backward::MlstmLasp2Backward;
pub use plan::{MlstmPlan, WorkspaceOffsets};

/// The C struct `lasp_mlstm_params` of `lasp/mlstm/forward_params.h`, passed by value to every
/// mLSTM forward kernel. Pointer fields hold device addresses; NULL where a tensor is absent.
pub type MlstmParams = lasp_shmem_kernels::params::lasp_mlstm_params;
