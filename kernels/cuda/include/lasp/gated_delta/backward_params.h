// Parameters and launch geometry of the Gated DeltaNet backward (gated_delta/backward.cu). C: bindgen
// generates the host's struct and constants from this file (kernels/build.rs); the host
// (core/src/ops/gated_delta/backward.rs) uses the same formulas.
//
// Maths (per chunk of 64 tokens; the forward's notation, lasp/gated_delta/forward_params.h; the
// derivation: core/src/reference/delta_rule/chunk_backward.rs). With A = (I + L)^{-1},
// W = A diag(beta e^b) K and u = A diag(beta) V - W S_n (the values the forward's chunk writes),
//   O_r     = sigma (e^{b_r} q_r S_n + sum_{j <= r} e^{b_r - b_j} (q_r . k_j) u_j),
//   S_{n+1} = e^gamma S_n + sum_j e^{gamma - b_j} k_j^T u_j.
// Reverse mode, with dS' = dL/dS_{n+1}:
//   du     = sigma (K Q^T ⊙ D^T) dO + diag(e^{gamma - b}) K dS'          (D_rj = [j <= r] e^{b_r - b_j})
//   dS_n   = e^gamma dS' + sigma (diag(e^b) Q)^T dO - W^T du
//   dP     = sigma (dO u^T ⊙ D)
//   dq     = sigma diag(e^b) dO S_n^T + dP K
//   dk     = dP^T Q + diag(e^{gamma - b}) u dS'^T + diag(beta e^b) A^T dW + (the terms of L)
//   dW     = -du S_n^T,   dv = diag(beta) A^T du
//   dA~    = du (diag(beta) V)^T + dW (diag(beta e^b) K)^T,   dL = -tril(A^T dA~ A^T, -1)
// and L_rj = beta_r e^{b_r - b_j} (k_r . k_j) passes dL on to dk, dbeta and the gates. Every gate
// enters through a factor e^{b_r - b_j}, e^{b_r}, e^{gamma - b_j} or e^gamma: the chunk-local
// db_r collects the log-derivatives of the terms at r, and dg_t = sum_{r >= t} db_r in the chunk.
//
// Host call sequence (one stream, in this order):
//   1.           lasp_gated_delta_bwd_wy_dk{64,128}      grid (N, B*H), block LASP_GDN_WY_THREADS,
//                                                       smem lasp_gdn_bwd_wy_smem_bytes(Dk): the
//                                                       forward's (I + L)^{-1} (same bits) and W
//   2. if S > 1: the forward's summary and fold kernels, with `fwd` (lasp/gated_delta/forward_params.h)
//                with a summary for every segment (num_summaries = S: the dS chain takes A_s^T of
//                segments 1..S-1). The summary's grid is ((S-1)(Dk/64 + Dv/64) + Dk/64, 1, B*H):
//                every tile of segments 0..S-2, only A's of segment S-1. The fold reads b_s of
//                segments 0..S-2 and no other backward kernel reads b (the LASP-2 backward's shard
//                summary composes A_s and c_s), so b_{S-1} is not computed (its ws_b slot unwritten)
//   3.           lasp_gated_delta_bwd_states_dk{64,128}  grid (Dv/64, S, B*H), block LASP_SD_THREADS,
//                                                       smem lasp_gdn_summary_smem_bytes(Dk): the
//                                                       forward's chain again, storing S_n and u
//   4. if S > 1: lasp_gated_delta_bwd_dh_summary_dk{64,128}  grid (Dv/64, S-1, B*H), block
//                                                       LASP_SD_THREADS, smem lasp_gdn_bwd_dh_smem_bytes(Dk):
//                                                       segment s >= ds_summary_from's dS chain from
//                                                       zero at its end, c_s, into ws_ds slot s
//   5. if S > 1: lasp_gated_delta_bwd_fold_dk{64,128}    grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS,
//                                                       smem 0: from E = dht down the segments,
//                                                       E <- A_s^T E + c_s (the dS entering segment
//                                                       s) into ws_ds slot s, s = S-1..1
//   6.           lasp_gated_delta_bwd_dh_dk{64,128}      grid (Dv/64, S, B*H), block LASP_SD_THREADS,
//                                                       smem lasp_gdn_bwd_dh_smem_bytes(Dk): per
//                                                       segment from the dS leaving it (ws_ds slot
//                                                       s + 1, or dht), du and dS' of its chunks from
//                                                       the last to the first; segment 0 writes dh0
//   7.           lasp_gated_delta_bwd_grads_dk{64,128}   grid (N, B*H), block LASP_GDN_BWD_GRADS_THREADS,
//                                                       smem lasp_gdn_bwd_grads_smem_bytes(Dk):
//                                                       dq, dk, dv, dg, dbeta of one chunk
// All take lasp_gated_delta_bwd_params by value; those with dynamic shared memory need
// cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES).
//
// Supported: the forward's (Dk in {64, 128}; Dv a positive multiple of 64; T >= 1; B*H in
// [1, 65535]); d_o, dq, dk, dv 16-byte aligned, dg and dbeta 4-byte aligned, dht and dh0 8-byte
// aligned. Same inputs -> bitwise same outputs (no atomics; every sum has a fixed order).
#pragma once
#include <stdint.h>

#include "lasp/gated_delta/forward_params.h"

#define LASP_GDN_BWD_GRADS_THREADS 256  // two warpgroups: rows 16 (w % 4).., columns half w / 4

typedef struct {
  // The forward's inputs and the parts of the workspace its kernels use (o and ht unused: NULL).
  lasp_gated_delta_params fwd;
  const uint16_t* d_o;  // bf16 [B, T, H, Dv]: dL/do
  const float* dht;     // fp32 [B, H, Dk, Dv]: dL/dht, or NULL for zero
  uint16_t* dq;         // bf16 [B, T, H, Dk]
  uint16_t* dk;         // bf16 [B, T, H, Dk]
  uint16_t* dv;         // bf16 [B, T, H, Dv]
  float* dg;            // fp32 [B, T, H]
  float* dbeta;         // fp32 [B, T, H]
  float* dh0;           // fp32 [B, H, Dk, Dv], or NULL to skip it
  // The backward's own workspace, per b*H+h, in rows of 64 per chunk (N = ceil(T / 64); the rows of
  // a ragged chunk's virtual tokens are written and hold zeros):
  uint16_t* ws_w;   // bf16 [B*H, N*64, Dk]: W of every chunk
  uint16_t* ws_u;   // bf16 [B*H, N*64, Dv]: u of every chunk
  uint16_t* ws_du;  // bf16 [B*H, N*64, Dv]: dL/du
  uint16_t* ws_h;   // bf16 [B*H, N, Dk, Dv]: the state entering every chunk
  uint16_t* ws_dh;  // bf16 [B*H, N, Dk, Dv]: dL/dS of the state leaving every chunk
  float* ws_ds;     // fp32 [B*H, S, Dk, Dv]: slot s >= 1, dL/dS of the state entering segment s
                    // (first c_s, then the fold's value); NULL when S == 1 (one GPU)
  int32_t ds_summary_from;  // kernel 4's first segment (blockIdx.y + this): 1 on one GPU; 0 in LASP-2,
                            // whose shard summary takes c_0 too (slot 0; lasp/gated_delta/lasp2_params.h)
} lasp_gated_delta_bwd_params;

// Elements of the workspace's token rows (ws_w with D = Dk; ws_u, ws_du with D = Dv) and states.
LASP_GDN_FN uint64_t lasp_gdn_bwd_rows_elems(int32_t B, int32_t H, int32_t T, int32_t D) {
  return (uint64_t)B * H * lasp_gdn_num_chunks(T) * LASP_SD_CHUNK * D;
}
LASP_GDN_FN uint64_t lasp_gdn_bwd_states_elems(int32_t B, int32_t H, int32_t T, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * lasp_gdn_num_chunks(T) * Dk * Dv;
}

// WY kernel: the forward's, then, from the next 1024-byte boundary, (I + L)^{-1} as a bf16 tile
// (diag(beta e^b) K is written over the K tile).
LASP_GDN_FN uint32_t lasp_gdn_bwd_wy_tri_offset(int32_t Dk) { return (lasp_gdn_wy_smem_bytes(Dk) + 1023u) / 1024u * 1024u; }
LASP_GDN_FN uint32_t lasp_gdn_bwd_wy_smem_bytes(int32_t Dk) {
  return lasp_gdn_bwd_wy_tri_offset(Dk) + LASP_SD_CHUNK * LASP_SD_CHUNK * 2u;
}

// dS pass: two stages of Q, K, W [64 x Dk], dO [64 x 64] and the 64 gates (1024 bytes, keeping the
// tiles 1024-byte aligned); two bf16 copies of dS' [Dk x 64]; the du tile [64 x 64].
LASP_GDN_FN uint32_t lasp_gdn_bwd_dh_stage_bytes(int32_t Dk) {
  return 3u * LASP_SD_CHUNK * Dk * 2u + LASP_SD_CHUNK * 64u * 2u + 1024u;
}
LASP_GDN_FN uint32_t lasp_gdn_bwd_dh_smem_bytes(int32_t Dk) {
  return 2u * lasp_gdn_bwd_dh_stage_bytes(Dk) + 2u * Dk * 64u * 2u + LASP_SD_CHUNK * 64u * 2u;
}

// Gradient kernel: Q, K, W, dW [64 x Dk]; (I + L)^{-1}, dP, and one scratch [64 x 64] tile; two
// sets of 64 columns of Dv: dO, u, du, V [64 x 64] and S_n, dS' [Dk x 64]; then 1024 bytes of the
// chunk's gates and betas and 3072 of row sums.
LASP_GDN_FN uint32_t lasp_gdn_bwd_grads_smem_bytes(int32_t Dk) {
  return 4u * LASP_SD_CHUNK * Dk * 2u + 3u * LASP_SD_CHUNK * 64u * 2u +
         2u * (4u * LASP_SD_CHUNK * 64u * 2u + 2u * Dk * 64u * 2u) + 1024u + 3072u;
}
