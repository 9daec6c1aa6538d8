// Parameters and launch geometry of the GLA backward (gla/backward.cu). C: bindgen generates the
// host's struct and constants from this file (kernels/build.rs); the host's plan
// (core/src/ops/gla/backward.rs) uses the same formulas.
//
// Maths (per batch b, head h; row vectors; sigma = scale; a_t = g[b, t, h, :] <= 0; chunks of 64
// tokens with chunk-local cumsums b_r, gamma = b_63):
//   forward   S_{n+1}  = diag(e^{gamma}) S_n + (K (.) e^{gamma - b})^T V,        S_0 = h0
//   reverse   dS_n     = diag(e^{gamma}) dS_{n+1} + sigma (Q (.) e^{b})^T dO,   dS_N = dht
// and per chunk, with dA = sigma [r >= j] dO V^T and A = sigma [r >= j] (scores of the forward):
//   dv = A^T dO + (K (.) e^{gamma - b}) dS_{n+1}
//   dk = e^{-b} (.) (dA^T (Q (.) e^{b})) + e^{gamma - b} (.) (V dS_{n+1}^T)
//   dq = e^{b} (.) (dA (K (.) e^{-b})) + sigma e^{b} (.) (dO S_n^T)
//   dg_t = sum_{s >= t} (q_s (.) dq_s - k_s (.) dk_s) (+ rowsum(S_T (.) dht)), where the part from
//          the chunks after t's is rowsum(S_{n+1} (.) dS_{n+1}) = e^{gamma} (.) rowsum(S_n (.)
//          dS_{n+1}) + sum_j k_j (.) dk_j^{inter} (the intra-chunk parts of q dq and k dk cancel
//          over a chunk), so every chunk is computed on its own;
//   dh0 = dS_0.
// The states S_n come from the forward (lasp_gla_params.chunk_states, written by its output pass,
// each row d scaled by e^{c_d}, the chunk's reference row, which the grads kernel forms again
// from the gates with the same bits); the backward walks the reverse recurrence for dS_{n+1},
// then computes every chunk's gradients.
//
// Host call sequence (one stream, in this order; S = num_segments, N = ceil(T / 64)):
//   1. if S > 1: lasp_gla_bwd_summary_dk{64,128}_dv{64,128}  grid (1, S-1, B*H),
//                                                 block lasp_gla_walk_threads(Dv), smem lasp_gla_walk_smem_bytes(Dk, Dv)
//        y: the reverse summary (M, Lambda) of segment y + 1 from zero, into slot (b*H+h, y).
//   2. if S > 1: lasp_gla_bwd_fold                grid (ceil(Dk*Dv/LASP_GLA_BWD_FOLD_THREADS), B*H),
//                                                 block LASP_GLA_BWD_FOLD_THREADS, smem 0
//        ws_p slot (bh, s) = the gradient of the state leaving segment s (from dht, descending).
//   3.           lasp_gla_bwd_walk_dk{64,128}_dv{64,128}  grid (1, S, B*H),
//                                                 block lasp_gla_walk_threads(Dv), smem lasp_gla_walk_smem_bytes(Dk, Dv)
//        y: segment y in reverse from the gradient leaving it, writing dh (dS_{n+1} of every
//        chunk n) and, for segment 0, dh0.
//   4.           lasp_gla_bwd_grads_dk{64,128}_dv{64,128}  grid (N, B*H), block
//                                                 lasp_gla_bwd_grads_threads(Dk, Dv),
//                                                 smem lasp_gla_bwd_grads_smem_bytes(Dk, Dv, packed)
//        chunk x of b*H+h = y: dq, dk, dv, dg of its tokens.
// The kernels with dynamic shared memory need cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES).
//
// Supported: as the forward (lasp/gla/forward_params.h); d_o like v; chunk_states, dq, dk, dv bf16
// and dg fp32 16-byte aligned; dht, dh0 fp32 8-byte aligned. Same inputs -> bitwise same outputs.
#pragma once
#include <stdint.h>

#include "lasp/gla/forward_params.h"

#define LASP_GLA_WALK_STAGES 3       // the walk's pipeline depth (chunks in flight)
#define LASP_GLA_BWD_FOLD_THREADS 256

typedef struct {
  const uint16_t* q;   // bf16 [B, T, H, Dk], contiguous
  const uint16_t* k;   // bf16 [B, T, H, Dk], contiguous
  const uint16_t* v;   // bf16 [B, T, H, Dv], contiguous
  const float* g;      // fp32 [B, T, H, Dk]: per-key log-decays a_t <= 0
  const uint16_t* d_o; // bf16 [B, T, H, Dv]: the gradient of o
  const float* h0;     // fp32 [B, H, Dk, Dv] initial state, or NULL for zero
  const float* dht;    // fp32 [B, H, Dk, Dv] gradient of the final state, or NULL for zero
  uint16_t* dq;        // bf16 [B, T, H, Dk]
  uint16_t* dk;        // bf16 [B, T, H, Dk]
  uint16_t* dv;        // bf16 [B, T, H, Dv]
  float* dg;           // fp32 [B, T, H, Dk]
  float* dh0;          // fp32 [B, H, Dk, Dv], or NULL to skip
  const uint16_t* chunk_states;  // bf16 [B*H, N, Dk, Dv]: diag(e^{c}) S_n entering chunk n (the forward's)
  const uint64_t* starts;  // u64 [ceil(T / 64)]: where documents start in every chunk (packed
                          // documents, lasp/documents/chunk_starts.cuh), or NULL for one sequence
  // The workspace (one allocation; core/src/ops/gla/backward.rs sizes it): dh at byte 0, then
  // (only when S > 1) ws_m, ws_p, ws_lambda.
  uint16_t* dh;        // bf16 [B*H, N, Dk, Dv]: dS_{n+1}, the gradient of the state leaving chunk n
  float* ws_m;         // fp32 [B*H, S-1, Dk, Dv]: the reverse summaries of segments 1..S-1
  float* ws_p;         // fp32 [B*H, S-1, Dk, Dv]: the gradient leaving segments 0..S-2 (step 2)
  float* ws_lambda;    // fp32 [B*H, S-1, Dk]: the summaries' log-decays per key dimension
  int32_t B;           // batch
  int32_t T;           // tokens per sequence (>= 1)
  int32_t H;           // heads
  int32_t Dk;          // 64 or 128 (must match the kernels' suffix)
  int32_t Dv;          // 64 or 128 (must match the grads kernel's suffix)
  int32_t num_segments;        // S >= 1 segments of whole chunks per (b, h) for the walk
  int32_t chunks_per_segment;  // ceil(N / S); no segment empty
  float scale;                 // sigma
} lasp_gla_bwd_params;

// The walk and its summaries: one warpgroup per 64 columns of Dv.
LASP_GLA_FN int32_t lasp_gla_walk_threads(int32_t Dv) { return 128 * (Dv / 64); }

// The walk: STAGES x (Q [64 x Dk] and dO [64 x Dv] bf16, the [64 x Dk] fp32 gates) + the gate
// scan's row-block totals (8 bytes per thread): 198,656 bytes at Dk = Dv = 128. The bf16 state of
// a store goes where the chunk's gates were, e^{gamma} where the totals were, once read.
LASP_GLA_FN uint32_t lasp_gla_walk_smem_bytes(int32_t Dk, int32_t Dv) {
  const uint32_t stage = LASP_GLA_CHUNK * Dk * 2u + LASP_GLA_CHUNK * Dv * 2u + LASP_GLA_CHUNK * Dk * 4u;
  return LASP_GLA_WALK_STAGES * stage + 8u * (uint32_t)lasp_gla_walk_threads(Dv);
}

// The grads kernel: one warpgroup per 64 columns of max(Dk, Dv).
LASP_GLA_FN int32_t lasp_gla_bwd_grads_threads(int32_t Dk, int32_t Dv) { return 128 * ((Dk > Dv ? Dk : Dv) / 64); }

// The grads kernel: Q, K, V, dO, S_n, dS_{n+1} (bf16) + the gates (fp32) + dA (fp32 [64 x 64], for
// a steep chunk's exact terms) + five fp32 vectors of Dk (e^{c}, e^{gamma - c'}, the carry, and
// per-warp column sums: 4 x Dk twice) + the gate scan's row-block totals.
// With packed documents, one more [64 x Dk] bf16 tile (1024-byte aligned): K^ without the keys of
// a document that ends in the chunk.
LASP_GLA_FN uint32_t lasp_gla_bwd_grads_smem_bytes(int32_t Dk, int32_t Dv, int32_t packed) {
  const uint32_t tiles = 2u * LASP_GLA_CHUNK * Dk * 2u + 2u * LASP_GLA_CHUNK * Dv * 2u + 2u * Dk * Dv * 2u;
  const uint32_t bytes = tiles + LASP_GLA_CHUNK * Dk * 4u + LASP_GLA_CHUNK * LASP_GLA_CHUNK * 4u + 11u * Dk * 4u +
                         8u * (uint32_t)lasp_gla_bwd_grads_threads(Dk, Dv);
  return packed ? (bytes + 1023u) / 1024u * 1024u + LASP_GLA_CHUNK * Dk * 2u : bytes;
}
