// Parameters of GLA's LASP-2 forward (gla/lasp2_forward.cu) and its summary tile. C: bindgen
// generates the host's struct from this file (kernels/build.rs). The exchange's fields and
// buffers are the generic ones of lasp/exchange/chain_params.h; protocol: kernels/docs/lasp2.md.
//
// Maths, per (b, h), PE `me` of `npes` holding T_local tokens (kernels/docs/maths.md, "LASP-2"):
//   M_me = the shard's end state from a ZERO start, Lambda_me = the shard's log-decay per key dim
//   P_0 = h0 (or 0);  P_{u+1} = diag(e^{Lambda_u}) P_u + M_u  (fp32, ascending u < me)
//   the shard's outputs = the single-GPU forward started from P_me.
//
// Host call sequence per call (S segments of the shard, R pieces per segment):
//   1. lasp_gla_lasp2_states_dk{64,128}   grid (Dv/64, S*R, B*H), block LASP_GLA_STATES_THREADS,
//                                         smem lasp_gla_states_smem_bytes(Dk): every piece's (M, Lambda)
//   2. lasp_gla_lasp2_summary             grid (Dv/64, B*H), block LASP_GLA_LASP2_SUMMARY_THREADS, smem 0:
//                                         the pieces folded into the own slot tile, published by the
//                                         schedule (overlapped: on the exchange's second stream)
//   2b. sequential modes only:            the host all-gather of the slots
//   3. lasp_gla_lasp2_output_dk*_dv*      grid (1, S, B*H), block lasp_gla_output_threads(Dv),
//                                         smem lasp_gla_output_smem_bytes(Dk, Dv): waits for the earlier
//                                         PEs' tiles, folds them and its own earlier pieces, then the
//                                         single-GPU chunk loop
//   4. lasp_gla_lasp2_advance_epoch       grid (1, 1, 1), block (1, 1, 1), last
// Same inputs -> bitwise same outputs in every exchange mode.
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/gla/forward_params.h"
#include "lasp/wait_diagnostics.h"

#define LASP_GLA_LASP2_SUMMARY_THREADS 256

typedef struct {
  const uint16_t* q;          // bf16 [B, T, H, Dk] (T = this PE's T_local), contiguous
  const uint16_t* k;          // bf16 [B, T, H, Dk]
  const uint16_t* v;          // bf16 [B, T, H, Dv]
  const float* g;             // fp32 [B, T, H, Dk]: per-key log-decays <= 0
  uint16_t* o;                // bf16 [B, T, H, Dv]: this shard's output
  const float* h0;            // fp32 [B, H, Dk, Dv] global initial state (the same on every PE), or NULL
  float* ht;                  // fp32 [B, H, Dk, Dv] final state, or NULL; written only if write_final_state
  float* ws_m;                // device fp32 [B*H, S*R, Dk, Dv]: end state of every piece of the shard from zero
  float* ws_lambda;           // device fp32 [B*H, S*R, Dk]: its log-decay per key dimension
  float* slots;               // SYMMETRIC fp32 [2][npes][B*H][Dv/64][lasp_gla_lasp2_tile_floats(Dk)]:
                              // tile = (M_u rows [Dk][64], Lambda_u [Dk])
  uint64_t* signals;          // SYMMETRIC u64 [2][npes][B*H*(Dv/64)]
  uint64_t* credit;           // SYMMETRIC u64 [npes]
  uint64_t* epoch;            // device u64: the last completed epoch
  lasp_wait_diag* diag;       // device: the first expired bounded wait
  uint64_t* timeline;         // device u64 timeline stamps, or NULL
  uint64_t timeout_ns;        // bound on every wait
  int32_t B;
  int32_t T;                  // T_local (>= 1; may differ between PEs)
  int32_t H;
  int32_t Dk;                 // 64 or 128
  int32_t Dv;                 // 64 or 128
  int32_t num_segments;       // S >= 1 of this PE's shard
  int32_t chunks_per_segment;
  int32_t states_splits;      // R >= 1 pieces per segment in the states pass
  float scale;
  int32_t me;
  int32_t npes;
  int32_t exchange_mode;      // enum lasp2_exchange_mode
  int32_t write_final_state;  // 1 on the PE that writes ht (the last), else 0
  int32_t chain;              // enum lasp2_chain (the forward: ascending)
} lasp_gla_lasp2_params;

// Floats of one exchanged tile: M_u's [Dk][64] block, then Lambda_u's Dk floats (a multiple of 4).
LASP2_FN uint64_t lasp_gla_lasp2_tile_floats(int32_t Dk) { return (uint64_t)Dk * LASP2_TILE_V + Dk; }
