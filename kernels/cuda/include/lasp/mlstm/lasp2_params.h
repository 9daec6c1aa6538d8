// Parameters of the mLSTM's LASP-2 forward (mlstm/lasp2_forward.cu), whose summary and fold also
// carry the backward's dv pass down the ranks, and its summary tile. C: bindgen
// generates the host's struct from this file (kernels/build.rs). The exchange's fields and buffers
// are the generic ones of lasp/exchange/chain_params.h; protocol: kernels/docs/lasp2.md.
//
// Maths, per (b, h), PE `me` of `npes` holding T_local tokens (kernels/docs/mlstm.md, "LASP-2"):
//   S_me = (C, n, m) the shard reaches from the empty state (m = -inf), F_me its summed log forget
//   gate;  P_0 = h0, or mlstm_kernels' zero state (0, 0, m = 0);
//   P_{u+1} = P_u folded with (S_u, F_u)  (lasp/mlstm/fold.cuh; ascending u < me)
//   the shard's outputs = the single-GPU forward started from P_me.
// Under the pipelined chain each PE's summary kernel folds its summary into its predecessor's
// relayed prefix (the chain's first PE: into P_0) and relays the result with F = 0; a consumer
// then starts from the empty state, and folding the relayed P_me onto it gives P_me exactly.
//
// Host call sequence per call (S segments of the shard, R states pieces per segment; kernels 1 and
// 4 are the single-GPU forward's, lasp/mlstm/forward_params.h, launched with `fwd`):
//   1. lasp_mlstm_states_dk*_dv*      grid (1, S*R, B*H) (fwd.num_summaries = S): every piece's
//                                     summary
//   2. lasp_mlstm_lasp2_summary       grid (Dv/64, B*H), block LASP_MLSTM_LASP2_THREADS, smem 0: the
//                                     pieces folded into the own slot tile, published by the
//                                     schedule (overlapped: on the exchange's second stream)
//   2b. sequential modes only:        the host all-gather of the slots
//   3. lasp_mlstm_lasp2_fold          grid (ceil((Dk*Dv + Dk) / LASP_MLSTM_LASP2_THREADS), B*H),
//                                     block LASP_MLSTM_LASP2_THREADS, smem 0: waits for the earlier
//                                     PEs' tiles of the head, folds them in chain order into P_me
//                                     (start_*, which fwd.c0, n0, m0 point to), then the states
//                                     entering the shard's segments 1..S-1 (fwd.ws_pc, ws_pn, ws_pm)
//   4. lasp_mlstm_output_dk*_dv*      the shard's outputs from them (the final state on the last PE)
//   5. lasp_mlstm_lasp2_advance_epoch grid (1, 1, 1), block (1, 1, 1), last
// On one PE (npes = 1) nothing is exchanged: every mode runs the single-GPU forward with `fwd`
// (c0, n0, m0 = h0; num_summaries = S - 1; lasp_mlstm_fold where S > 1), then kernel 5.
// Same inputs -> bitwise same outputs in every exchange mode.
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/mlstm/forward_params.h"
#include "lasp/wait_diagnostics.h"

#define LASP_MLSTM_LASP2_THREADS 256

typedef struct {
  lasp_mlstm_params fwd;        // the shard as a single-GPU call: T = T_local, c0, n0, m0 = start_*,
                                // c_t, n_t, m_t only on the last PE (else NULL), num_summaries = S
  const float* h0_c;            // fp32 [B, H, Dk, Dv] the global initial state (the same on every
                                // PE), or NULL (then h0_n, h0_m NULL too): the zero state
  const float* h0_n;            // fp32 [B, H, Dk]
  const float* h0_m;            // fp32 [B, H]
  float* start_c;               // fp32 [B, H, Dk, Dv]: P_me, the state entering the shard (the fold
                                // writes it)
  float* start_n;               // fp32 [B, H, Dk]
  float* start_m;               // fp32 [B, H]
  float* slots;                 // SYMMETRIC fp32 [2][npes][B*H][Dv/64][lasp_mlstm_lasp2_tile_floats(Dk)]
  uint64_t* signals;            // SYMMETRIC u64 [2][npes][B*H*(Dv/64)]
  uint64_t* credit;             // SYMMETRIC u64 [npes]
  uint64_t* epoch;              // device u64: the last completed epoch
  lasp_wait_diag* diag;         // device: the first expired bounded wait
  uint64_t* timeline;           // device u64 timeline stamps, or NULL
  lasp2_link_emulation* link;   // device: emulated links (lasp/exchange/chain_params.h), or NULL
  uint64_t timeout_ns;          // bound on every wait
  int32_t B;                    // the exchange's dimensions, equal to fwd's
  int32_t H;
  int32_t Dk;                   // 64 or 128
  int32_t Dv;                   // 64 or 128
  int32_t me;
  int32_t npes;
  int32_t exchange_mode;        // enum lasp2_exchange_mode
  int32_t chain;                // enum lasp2_chain (the forward: ascending)
  // The backward's dv pass runs its exchange through these kernels (descending chain; fwd the
  // pass's chunk params; lasp/mlstm/backward_params.h, "LASP-2"). In the forward: NULL and 0.
  int32_t h0_first_pe_only;     // 1: h0 is the chain's first PE's alone (the final state's
                                // cotangent; every other PE passes the empty state, m = -inf): that
                                // PE's summary folds it in under every schedule
  const float* exit_f_gate;     // fp32 [B, T, H] forget-gate pre-activations: the summary decays
                                // by logsigmoid of each sequence's token 0 after its pieces (the
                                // reversed pass leaves the shard through that gate)
  const float* decay_c;         // fp32 [B, H, Dk, Dv] on the chain's first PE: C_T (stabilised at
  const float* decay_dc;        // m_T) and dC_T, whose dot each column tile carries (tile_decay)
  float* decay_dot;             // fp32 [B, H]: the fold writes the arrived tiles' dots summed
} lasp_mlstm_lasp2_params;

// One exchanged tile (b*H+h, vt): C's columns 64 vt.. as [Dk][64], n [Dk] (in every column tile, so
// that each folds on its own), then m, F, the backward's decay dot (the column tile's share of
// <dC_T, C_T>, relayed unchanged; 0 in the forward) and one float of padding (16-byte tiles).
LASP2_FN uint64_t lasp_mlstm_lasp2_tile_n(int32_t Dk) { return (uint64_t)Dk * LASP2_TILE_V; }
LASP2_FN uint64_t lasp_mlstm_lasp2_tile_m(int32_t Dk) { return (uint64_t)Dk * (LASP2_TILE_V + 1); }
LASP2_FN uint64_t lasp_mlstm_lasp2_tile_f(int32_t Dk) { return lasp_mlstm_lasp2_tile_m(Dk) + 1; }
LASP2_FN uint64_t lasp_mlstm_lasp2_tile_decay(int32_t Dk) { return lasp_mlstm_lasp2_tile_m(Dk) + 2; }
LASP2_FN uint64_t lasp_mlstm_lasp2_tile_floats(int32_t Dk) { return lasp_mlstm_lasp2_tile_m(Dk) + 4; }
