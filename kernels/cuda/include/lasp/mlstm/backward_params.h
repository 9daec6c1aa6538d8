// Parameters and launch geometry of the mLSTM backward's own kernels (mlstm/backward.cu); its
// three gradient passes are the forward's chunk kernels in their kGradient form
// (lasp_mlstm_grad_*, lasp/mlstm/forward_params.h). C: bindgen generates the host's struct from
// this file (kernels/build.rs); core/src/ops/mlstm/backward.rs sizes the workspace.
//
// The gradient is mlstm_kernels' (TFLA's; reference::mlstm::MlstmGradient::Tfla): every
// stabiliser m_t and denominator den_t of the forward is a constant, so with dO'_t = dh_t / den_t,
// alpha_r = F_r - m_r, beta_j = i_j - F_j (F the inclusive cumsum of lf = logsigmoid(f)) and
// w_rj = e^{alpha_r + beta_j} <= 1 (j <= r):
//   dq_r = sigma sum_{j<=r} w_rj (dO'_r . v_j) k_j  + sigma e^{F_r + m_0 - m_r} dO'_r C_0^T
//   dk_j = sigma sum_{r>=j} w_rj (dO'_r . v_j) q_r  + e^{F_T - F_j + i_j - m_T} dC_T v_j
//   dv_j = sigma sum_{r>=j} w_rj (q_r . k_j) dO'_r  + e^{F_T - F_j + i_j - m_T} k_j dC_T
//   di_j = k_j . dk_j,   dlf_t = sum_{s>=t} (q_s . dq_s - k_s . dk_s),   df_t = dlf_t sigmoid(-f_t)
//   dC_0 = sigma sum_r e^{F_r + m_0 - m_r} q_r^T dO'_r + e^{F_T + m_0 - m_T} dC_T
// (dn_0 = dm_0 = 0; of the final state's cotangent only dC_T is taken.) Each product is a forward
// pass with the roles of the tensors exchanged and the input gate rewritten. Where dh / den_t
// goes decides what is rounded (kernels/docs/mlstm.md, "Backward"): into the log row weight
// u_t = -m_t - ln den_t where dh is an operand of a score (a bf16 copy of dh / den would round
// the score), into a bf16 copy dO' where dh is the value (the weights scale the keys in bf16,
// and q_r . k_j cancels where den_r is small: a stabiliser alone keeps the dominant key's weight
// exactly 1):
//   dq pass  (in order):  q' = dh, k' = V, v' = K, gates (i, f), from (C_0^T, m_0);
//                         row t scaled by e^{m'_t + u_t} (m' the pass's own stabiliser, the
//                         forward's where the pass's plan folds as the forward's did), dotted with q_t
//   dv pass  (reversed):  q' = K, k' = Q, v' = dO', input gate -m, forget gate f_{t+1} (+inf past
//                         the last token: lf = 0), from (dC_T / sigma, -m_T) or the empty state;
//                         row t scaled by e^{m'_t + i_t} <= 1; its final state (D, m'_end) gives
//                         dC_0 = sigma e^{lf_0 + m_0 + m'_end} D
//   dk pass  (reversed):  q' = V, k' = dh, v' = Q, input gate u, the same forget gate, from
//                         (dC_T^T / sigma, -m_T); row t scaled by e^{m'_t + i_t}, dotted with k_t
// In the reversed passes' loop form the weight of the pair (r, j) is e^{g_r + F_r - F_j - m'_j}
// with g the pass's input gate, so the scale e^{m'_j + i_j} = e^{max_{r>=j} (alpha_r + beta_j)}
// is <= 1 in the dv pass and at most 1 / eps in the dk pass (-ln den_r <= m_r: den_r >=
// e^{-m_r} + eps). No exponent overflows.
//
// Host call sequence (one stream):
//   1. lasp_mlstm_bwd_prepare_rows    grid ceil(B T H / (LASP_MLSTM_BWD_THREADS / (Dv / 8))), block
//                                     LASP_MLSTM_BWD_THREADS: dO', u, -m, the shifted forget gates
//   2. lasp_mlstm_bwd_prepare_states  grid (ceil(Dk Dv / LASP_MLSTM_BWD_THREADS), B*H), block
//                                     LASP_MLSTM_BWD_THREADS: C_0^T, dC_T / sigma and its transpose,
//                                     -m_T, the zero n_0
//   3. the dq, dv and dk passes (each: states, fold, output as the forward's plan for its shape)
//   4. lasp_mlstm_bwd_initial_state   (where dC_0 is asked for) grid and block as 2
//   5. lasp_mlstm_bwd_gate_tiles      grid (ceil(T / LASP_MLSTM_BWD_SCAN_TILE), B*H), block
//                                     LASP_MLSTM_BWD_THREADS: each tile's sum of q . dq - k . dk
//   6. lasp_mlstm_bwd_gates           grid and block as 5: di, df (the suffix sums)
// Same inputs -> bitwise same outputs (no atomics; every sum has a fixed order).
//
// LASP-2 (core/src/ops/mlstm/lasp2_backward.rs; reference::mlstm::lasp2_backward_tfla): PE w
// holds the shard [P_w, P_{w+1}), the state entering it (C_{P_w}, m_{P_w}; the forward's) and the
// state leaving it (C_{P_{w+1}}, m_{P_{w+1}}). With D_w = dL/dC_{P_{w+1}} (D_{W-1} = dC_T) the
// shard's gradients are the single-GPU backward's from the entering state with D_w as dC_T, and
// every dlf_t of the shard gains <D_w, C_{P_{w+1}}> - <dC_T, C_T> (the later shards' terms of its
// suffix sum). D_w comes down the chain as the dv pass's state: each PE's dv pass, summarised
// from the empty state and leaving the shard through token 0's forget gate, is the forward's
// mLSTM summary of the reversed pass, folded with the forward's LASP-2 kernels on the descending
// chain (lasp/mlstm/lasp2_params.h: h0 = (dC_T / sigma, -m_T) on the last PE, the empty state
// elsewhere). The fold's result (X, m') is the dv pass's start state, D_w = sigma e^{m' + m_{P_{w+1}}} X.
// Between the summary and the fold the dq pass runs (it needs nothing from the other PEs); then
//   lasp_mlstm_bwd_lasp2_exit   grid (B*H), block LASP_MLSTM_BWD_THREADS: X^T into rev_c_t, m'
//                               into lasp2_m (the dk pass's start), and where lf_carry is set the
//                               correction sigma e^{m' + m_{P_{w+1}}} <X, C_{P_{w+1}}> - decay_dot
// then the dv pass's output, the dk pass, dC_0 (PE 0) and the gates with lf_carry.
#pragma once
#include <stdint.h>

#define LASP_MLSTM_BWD_THREADS 256
#define LASP_MLSTM_BWD_SCAN_TOKENS 8  // tokens per thread of the gate gradient's scan
#define LASP_MLSTM_BWD_SCAN_TILE (LASP_MLSTM_BWD_THREADS * LASP_MLSTM_BWD_SCAN_TOKENS)  // per CTA

typedef struct {
  const uint16_t* d_h;     // bf16 [B, T, H, Dv]: dL/dh
  const float* i_gate;     // fp32 [B, T, H]
  const float* f_gate;     // fp32 [B, T, H]
  const float* row_m;      // fp32 [B, T, H]: the forward's stabilisers (lasp_mlstm_params.row_m)
  const float* row_den;    // fp32 [B, T, H]: and denominators
  const float* c0;         // fp32 [B, H, Dk, Dv], or NULL: the zero state (m_0 = 0)
  const float* m0;         // fp32 [B, H] (with c0)
  const float* dc_t;       // fp32 [B, H, Dk, Dv], or NULL: dL/dC_T
  const float* m_t;        // fp32 [B, H]: the forward's final stabiliser (with dc_t)
  // Workspace (core/src/ops/mlstm/backward.rs lays it out):
  uint16_t* d_h_scaled;    // bf16 [B, T, H, Dv]: dO'_t = dh_t / den_t
  float* row_log_weight;   // fp32 [B, T, H]: u_t = -m_t - ln den_t
  float* neg_m;            // fp32 [B, T, H]: -m_t
  float* f_next;           // fp32 [B, T, H]: f_{t+1}; +inf at t = T-1
  float* c0_t;             // fp32 [B, H, Dv, Dk]: C_0^T (with c0)
  float* rev_c;            // fp32 [B, H, Dk, Dv]: dC_T / sigma (zero without dc_t)
  float* rev_c_t;          // fp32 [B, H, Dv, Dk]: its transpose
  float* rev_m;            // fp32 [B, H]: -m_T, or -inf (the empty state) without dc_t
  float* zero_n;           // fp32 [B, H, max(Dk, Dv)]: the gradient passes' n_0 (unused by them)
  const float* end_c;      // fp32 [B, H, Dk, Dv]: the dv pass's final state D
  const float* end_m;      // fp32 [B, H]: its stabiliser m'_end
  const float* q_dots;     // fp32 [B, T, H, Dk / 64]: q_t . dq_t per 64 columns (the dq pass's)
  const float* k_dots;     // fp32 [B, T, H, Dk / 64]: k_t . dk_t per 64 columns (the dk pass's)
  double* tile_sums;       // fp64 [B*H, ceil(T / LASP_MLSTM_BWD_SCAN_TILE)]: the scan's tile sums
  // Packed documents, or NULL: the start words of the in-order and the reversed passes
  // (lasp_mlstm_params.starts): bit t of `starts` set where token t starts a document, bit e of
  // `rev_starts` where token T-1-e is followed by a start. The gate gradient's suffix sums then
  // restart at every document's last token (a tile hands on only x from its last such token on),
  // lf_carry reaches only the tokens whose document continues past the shard, and a start's own
  // forget gate gets 0 (it decays the zero state; the stabilisers are constants here).
  const uint64_t* starts;
  const uint64_t* rev_starts;
  // LASP-2 (NULL on one GPU; see above):
  const float* lasp2_start_c;  // fp32 [B, H, Dk, Dv]: X, the dv pass's start state from the exchange
  const float* lasp2_start_m;  // fp32 [B, H]: its stabiliser m'
  float* lasp2_m;              // fp32 [B, H]: m' kept for the dk pass
  const float* exit_c;         // fp32 [B, H, Dk, Dv]: C_{P_{w+1}}, the forward's state leaving the
  const float* exit_m;         // fp32 [B, H]: shard, and its m_{P_{w+1}} (with lf_carry)
  const float* decay_dot;      // fp32 [B, H]: <dC_T, C_T> as the exchange brought it (with lf_carry)
  double* lf_carry;            // fp64 [B, H]: what every dlf of the shard gains, or NULL (the last PE)
  // Gradients:
  float* d_i;              // fp32 [B, T, H]
  float* d_f;              // fp32 [B, T, H]
  float* dc0;              // fp32 [B, H, Dk, Dv], or NULL to skip
  int32_t B;
  int32_t T;
  int32_t H;
  int32_t Dk;              // 64 or 128
  int32_t Dv;              // 64 or 128
  float scale;             // sigma
} lasp_mlstm_bwd_params;
