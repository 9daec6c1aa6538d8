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
// With chunk_states set, step 3 also saves the shard's chunk states for the backward.
//
// The backward (gla/lasp2_backward.cu) is the forward's chain run the other way
// (LASP2_CHAIN_DESCENDING), per (b, h), with dS the gradient of the state:
//   M'_me = the gradient entering the shard from a ZERO gradient leaving it (the shard's own
//   tokens), Lambda_me as above;  D_{W-1} = dht;  D_{u-1} = diag(e^{Lambda_u}) D_u + M'_u
//   (descending u > me): the gradient leaving the shard is D_me, and the shard's gradients are
//   the single-GPU backward's (lasp/gla/backward_params.h) from its chunk states and D_me.
// Host call sequence per backward call (S segments of the shard, one piece each):
//   1. lasp_gla_lasp2_bwd_states_dk*_dv*  grid (1, S, B*H), block lasp_gla_walk_threads(Dv),
//                                         smem lasp_gla_walk_smem_bytes(Dk, Dv): every segment's
//                                         (M', Lambda) into ws_m / ws_lambda piece S-1-s, so that
//                                         the pieces in ascending order run down the shard
//   2. lasp_gla_lasp2_summary             as the forward's: the pieces folded (from dht on the last
//                                         PE) into the own slot tile, published to every EARLIER PE
//   2b. sequential modes only:            the host all-gather of the slots
//   3. lasp_gla_lasp2_bwd_walk_dk*_dv*    grid (1, S, B*H), block lasp_gla_walk_threads(Dv), smem
//                                         lasp_gla_walk_smem_bytes(Dk, Dv): segment s from dht (last
//                                         PE) or 0, the later PEs' tiles in chain order, then the
//                                         shard's pieces of the segments after s; its walk writes dh
//                                         (and on PE 0 segment 0, dh0)
//   4. lasp_gla_bwd_grads_dk*_dv*         the single-GPU grads kernel (lasp_gla_bwd_params) on the
//                                         shard, from chunk_states and dh
//   5. lasp_gla_lasp2_advance_epoch       last
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
  uint16_t* chunk_states;     // bf16 [B*H, N, Dk, Dv] (N = ceil(T / 64)): the forward saves the shard's
                              // chunk states here (lasp/gla/forward_params.h), or NULL
  const uint64_t* starts;  // u64 [ceil(T / 64)]: where documents start in every chunk (packed
                          // documents, lasp/documents/chunk_starts.cuh), or NULL for one sequence
  const int32_t* entry_slots;  // the documents' entering states, as lasp_gla_params (NULL: none)
  float* document_states;
  int32_t documents;
  // The backward's tensors (NULL in the forward):
  const uint16_t* d_o;        // bf16 [B, T, H, Dv]: the gradient of the shard's output
  const float* dht;           // fp32 [B, H, Dk, Dv]: the final state's gradient, on the last PE, or NULL
  float* dh0;                 // fp32 [B, H, Dk, Dv]: the initial state's gradient, on PE 0, or NULL
  uint16_t* dh;               // device bf16 [B*H, N, Dk, Dv]: the gradient leaving every chunk
  float* ws_m;                // device fp32 [B*H, S*R, Dk, Dv]: end state of every piece of the shard from zero
                              // (the backward: the gradient entering every segment, segments descending)
  float* ws_lambda;           // device fp32 [B*H, S*R, Dk]: its log-decay per key dimension
  float* slots;               // SYMMETRIC fp32 [2][npes][B*H][Dv/64][lasp_gla_lasp2_tile_floats(Dk)]:
                              // tile = (M_u rows [Dk][64], Lambda_u [Dk])
  uint64_t* signals;          // SYMMETRIC u64 [2][npes][B*H*(Dv/64)]
  uint64_t* credit;           // SYMMETRIC u64 [npes]
  uint64_t* epoch;            // device u64: the last completed epoch
  lasp_wait_diag* diag;       // device: the first expired bounded wait
  uint64_t* timeline;         // device u64 timeline stamps, or NULL
  lasp2_link_emulation* link; // device: emulated links (lasp/exchange/chain_params.h), or NULL
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
  int32_t chain;              // enum lasp2_chain (the forward: ascending; the backward: descending)
} lasp_gla_lasp2_params;

// Floats of one exchanged tile: M_u's [Dk][64] block, then Lambda_u's Dk floats (a multiple of 4).
LASP2_FN uint64_t lasp_gla_lasp2_tile_floats(int32_t Dk) { return (uint64_t)Dk * LASP2_TILE_V + Dk; }
