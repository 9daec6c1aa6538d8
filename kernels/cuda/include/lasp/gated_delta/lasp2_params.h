// Parameters of Gated DeltaNet's LASP-2 forward (gated_delta/lasp2_forward.cu) and its summary
// tile. C: bindgen generates the host's struct from this file (kernels/build.rs). The exchange's
// fields and buffers are the generic ones of lasp/exchange/chain_params.h; protocol:
// kernels/docs/lasp2.md.
//
// Maths, per (b, h), PE `me` of `npes` holding T_local tokens (kernels/docs/gated-delta.md, "LASP-2"):
//   (A_me, b_me) = the shard's affine map, S_end = A_me S_start + b_me: the composition of its
//                  segments' maps (A_me [Dk x Dk] the chunks' transitions, b_me its end state from zero)
//   P_0 = h0 (or 0);  P_{u+1} = A_u P_u + b_u  (fp32, ascending u < me, lasp/gated_delta/affine.cuh)
//   the shard's outputs = the single-GPU forward started from P_me.
//
// Exchanged tile (b*H+h, vt), lasp_gdn_lasp2_tile_floats(Dk, Dv) floats: b_me's columns 64 vt.. as
// [Dk][64], then A_me's column blocks jb = vt, vt + Dv/64, ... (jb < Dk/64) as [Dk][64] each. A
// PE's fold of column tile vt reads A from every tile of the head, so it waits for all of them.
//
// Host call sequence per call (S segments of the shard; kernels 1, 2 and 5 are the single-GPU
// forward's, lasp/gated_delta/forward_params.h, launched with `fwd`):
//   1. lasp_gated_delta_wy_dk{64,128}        (I + L)^{-1} of every chunk of the shard
//   2. lasp_gated_delta_summary_dk{64,128}   grid (Dk/64 + Dv/64, S, B*H): every segment's A_s, b_s
//   3. lasp_gated_delta_lasp2_summary        grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS, smem 0
//                                            (static): the segments' maps composed into the own slot
//                                            tile, published by the schedule (overlapped: on the
//                                            exchange's second stream)
//   3b. sequential modes only:               the host all-gather of the slots
//   4. lasp_gated_delta_lasp2_fold_dk*       grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS, smem 0
//                                            (static): waits for the earlier PEs' tiles of the head,
//                                            P_me from h0 in chain order, then the states entering
//                                            the shard's segments, into fwd.ws_p
//   5. lasp_gated_delta_output_dk{64,128}    the shard's outputs from fwd.ws_p (ht on the last PE)
//   6. lasp_gated_delta_lasp2_advance_epoch  grid (1, 1, 1), block (1, 1, 1), last
// Same inputs -> bitwise same outputs in every exchange mode.
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/gated_delta/forward_params.h"
#include "lasp/wait_diagnostics.h"

typedef struct {
  lasp_gated_delta_params fwd;  // the shard as a single-GPU call: T = T_local, h0 the global initial
                                // state (the same on every PE), ht only on the last PE (else NULL),
                                // num_summaries = S and ws_p set (the fold always runs)
  float* slots;                 // SYMMETRIC fp32 [2][npes][B*H][Dv/64][lasp_gdn_lasp2_tile_floats(Dk, Dv)]
  uint64_t* signals;            // SYMMETRIC u64 [2][npes][B*H*(Dv/64)]
  uint64_t* credit;             // SYMMETRIC u64 [npes]
  uint64_t* epoch;              // device u64: the last completed epoch
  lasp_wait_diag* diag;         // device: the first expired bounded wait
  uint64_t* timeline;           // device u64 timeline stamps, or NULL
  uint64_t timeout_ns;          // bound on every wait
  int32_t B;                    // the exchange's dimensions, equal to fwd's
  int32_t H;
  int32_t Dk;                   // 64 or 128
  int32_t Dv;                   // a multiple of 64
  int32_t me;
  int32_t npes;
  int32_t exchange_mode;        // enum lasp2_exchange_mode
  int32_t chain;                // enum lasp2_chain (the forward: ascending)
} lasp_gated_delta_lasp2_params;

// [Dk][64] blocks of one exchanged tile: b's columns, then A's column blocks vt, vt + Dv/64, ...
// (as many as the tile with the most of them carries).
LASP2_FN uint64_t lasp_gdn_lasp2_tile_blocks(int32_t Dk, int32_t Dv) {
  return 1u + (uint64_t)(Dk / 64 + Dv / 64 - 1) / (uint64_t)(Dv / 64);
}
LASP2_FN uint64_t lasp_gdn_lasp2_tile_floats(int32_t Dk, int32_t Dv) {
  return lasp_gdn_lasp2_tile_blocks(Dk, Dv) * (uint64_t)Dk * 64u;
}
