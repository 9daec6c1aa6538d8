// Parameters of Gated DeltaNet's LASP-2 forward (gated_delta/lasp2_forward.cu) and backward
// (gated_delta/lasp2_backward.cu) and their summary tile. C: bindgen generates the host's struct from
// this file (kernels/build.rs). The exchange's fields and buffers are the generic ones of
// lasp/exchange/chain_params.h; protocol: kernels/docs/lasp2.md.
//
// Forward maths, per (b, h), PE `me` of `npes` holding T_local tokens (kernels/docs/gated-delta.md,
// "LASP-2"):
//   (A_me, b_me) = the shard's affine map, S_end = A_me S_start + b_me: the composition of its
//                  segments' maps (A_me [Dk x Dk] the chunks' transitions, b_me its end state from zero)
//   P_0 = h0 (or 0);  P_{u+1} = A_u P_u + b_u  (fp32, ascending u < me, lasp/gated_delta/affine.cuh)
//   the shard's outputs = the single-GPU forward started from P_me (saved in start_state for the
//   backward).
//
// Backward maths (LASP2_CHAIN_DESCENDING), with E_w the gradient of the state leaving shard w. The
// dS chain is affine: dS entering shard w = A_w^T E_w + c_w, c_w the shard's dS chain from zero at its
// end (the composition of its segments' c_s: c_w = c_0 + A_0^T (c_1 + A_1^T (...))). So
//   E_{npes-1} = dht;  E_{u-1} = A_u^T E_u + c_u  (fp32, descending u > me)
//   the shard's gradients = the single-GPU backward from start_state with dht = E_me (in ws_e).
// The last PE starts its tile's c from dht (c' = A^T dht + c), so every other PE starts from zero.
//
// The pipelined chain (LASP2_DEVICE_CHAIN): the summary kernel of the PE at chain position i folds
// its map into the prefix its predecessor relayed, P_{i+1} = A_me P_i + b_me (the backward:
// E_out = A_me^T E_in + c'_me), with the all-gather consumer's own fold (lasp/gated_delta/affine.cuh)
// over every column block of A_me (composed again per CTA into ws_relay_a), and sends that in place
// of b_me (c'_me); position 0 folds h0 in (the backward's position 0, the last PE, has dht in its
// c' already). A consumer after position 0 starts from zero, where A 0 + P is P: the same bits as
// the all-gather's fold of every earlier tile.
//
// Exchanged tile (b*H+h, vt), lasp_gdn_lasp2_tile_floats(Dk, Dv) floats: b_me's columns 64 vt.. (the
// backward: c'_me's) as [Dk][64], then A_me's column blocks jb = vt, vt + Dv/64, ... (jb < Dk/64) as
// [Dk][64] each. A PE's fold of column tile vt reads A from every tile of the head, so it waits for
// all of them.
//
// Forward host call sequence per call (S segments of the shard; kernels 1, 2 and 5 are the
// single-GPU forward's, lasp/gated_delta/forward_params.h, launched with `fwd`):
//   1. lasp_gated_delta_wy_dk{64,128}        (I + L)^{-1} of every chunk of the shard
//   2. lasp_gated_delta_summary_dk{64,128}   grid (Dk/64 + Dv/64, S, B*H): every segment's A_s, b_s
//                                            (kernel 3 composes b_{S-1} into the shard's b too)
//   3. lasp_gated_delta_lasp2_summary        grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS, smem 0
//                                            (static): the segments' maps composed into the own slot
//                                            tile, published by the schedule (overlapped: on the
//                                            exchange's second stream)
//   3b. sequential modes only:               the host all-gather of the slots
//   4. lasp_gated_delta_lasp2_fold_dk*       grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS, smem 0
//                                            (static): waits for the earlier PEs' tiles of the head,
//                                            P_me from h0 in chain order (into start_state where
//                                            set),
//                                            then the states entering the shard's segments, into
//                                            fwd.ws_p
//   5. lasp_gated_delta_output_dk{64,128}    the shard's outputs from fwd.ws_p (ht on the last PE)
//   6. lasp_gated_delta_lasp2_advance_epoch  grid (1, 1, 1), block (1, 1, 1), last
//
// Backward host call sequence per call (the single-GPU backward's kernels,
// lasp/gated_delta/backward_params.h, with `bwd`: fwd.h0 = the saved start_state, dht = ws_e,
// num_summaries = S, ws_ds with S slots, ds_summary_from = 0):
//   1. lasp_gated_delta_bwd_wy_dk*           (I + L)^{-1} and W of every chunk
//   2. lasp_gated_delta_summary_dk*          grid ((S-1)(Dk/64 + Dv/64) + Dk/64, 1, B*H): every
//                                            segment's A_s, and b_s of segments 0..S-2 for kernel
//                                            5's fold (kernel 4 composes A_s and c_s: no kernel
//                                            reads b_{S-1}, so its Dv/64 tiles are left out)
//   3. lasp_gated_delta_bwd_dh_summary_dk*   grid (Dv/64, S, B*H): every segment's c_s into ws_ds
//   4. lasp_gated_delta_lasp2_summary        as forward kernel 3, on the descending chain: c'_me and
//                                            A_me into the own slot tile, published (on the caller's
//                                            stream in every mode: beside kernel 6 it slowed it)
//   4b. sequential modes only:               the host all-gather of the slots
//   5. lasp_gated_delta_fold_dk*             the states entering the segments from start_state (ws_p)
//   6. lasp_gated_delta_bwd_states_dk*       every chunk's entry state and u (while the later PEs'
//                                            summaries arrive)
//   7. lasp_gated_delta_lasp2_bwd_fold_dk*   grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS, smem 0
//                                            (static): waits for the later PEs' tiles of the head,
//                                            E_me from dht (last PE) or 0 in chain order into ws_e,
//                                            then the dS entering the shard's segments 1..S-1 over
//                                            their c_s in ws_ds
//   8. lasp_gated_delta_bwd_dh_dk*           per segment: du, dS' of every chunk; dh0 on PE 0
//   9. lasp_gated_delta_bwd_grads_dk*        dq, dk, dv, dg, dbeta of every chunk
//  10. lasp_gated_delta_lasp2_advance_epoch  last
// On one PE (npes = 1) nothing is exchanged: the forward runs the single-GPU plan (kernels 1 and 2
// for segments 0..S-2, kernel 4 only with segments, else a copy of h0 or zeros into start_state,
// then 5 and 6) and the backward the single-GPU backward from start_state, then kernel 10.
// Same inputs -> bitwise same outputs and gradients in every exchange mode.
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/gated_delta/forward_params.h"
#include "lasp/wait_diagnostics.h"

typedef struct {
  lasp_gated_delta_params fwd;  // the shard as a single-GPU call: T = T_local, h0 the global initial
                                // state (the same on every PE), ht only on the last PE (else NULL),
                                // num_summaries = S and ws_p set (the fold always runs); in
                                // the backward, bwd.fwd
  float* start_state;           // fp32 [B, H, Dk, Dv]: the forward's fold writes P_me here (the state
                                // entering the shard, the backward's h0), or NULL to skip it
  const float* dht;             // the backward's summary and fold: the sequence's dL/dht on the last
                                // PE, else NULL (the forward: NULL)
  float* ws_ds;                 // the backward: bwd.ws_ds (c_s of every segment; the fold writes the
                                // dS entering segments 1..S-1 over them)
  float* ws_e;                  // the backward: fp32 [B*H, Dk, Dv], E_me (bwd.dht)
  float* ws_relay_a;            // under the pipelined chain: fp32 [B*H, Dv/64, Dk/64, Dk, 64], each
                                // summary CTA's copy of every column block of the composed A (its
                                // fold of the relayed prefix reads them all); NULL in other modes
  float* slots;                 // SYMMETRIC fp32 [2][npes][B*H][Dv/64][lasp_gdn_lasp2_tile_floats(Dk, Dv)]
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
  int32_t Dv;                   // a multiple of 64
  int32_t me;
  int32_t npes;
  int32_t exchange_mode;        // enum lasp2_exchange_mode
  int32_t chain;                // enum lasp2_chain (the forward: ascending; the backward: descending)
} lasp_gated_delta_lasp2_params;

// [Dk][64] blocks of one exchanged tile: b's columns, then A's column blocks vt, vt + Dv/64, ...
// (as many as the tile with the most of them carries).
LASP2_FN uint64_t lasp_gdn_lasp2_tile_blocks(int32_t Dk, int32_t Dv) {
  return 1u + (uint64_t)(Dk / 64 + Dv / 64 - 1) / (uint64_t)(Dv / 64);
}
LASP2_FN uint64_t lasp_gdn_lasp2_tile_floats(int32_t Dk, int32_t Dv) {
  return lasp_gdn_lasp2_tile_blocks(Dk, Dv) * (uint64_t)Dk * 64u;
}
