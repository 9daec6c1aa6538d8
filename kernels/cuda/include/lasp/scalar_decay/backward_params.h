// Scalar-decay linear attention, backward: parameters and launch formulas of the kernels in
// scalar_decay/backward.cu, shared by the CUDA sources and the host (bindgen generates the struct and
// constants from this file; core/src/ops/scalar_decay/backward.rs ports the formulas).
//
// The backward is three passes of the forward's chunkwise kernels with the roles of the tensors
// exchanged (sigma = scale; states [Dk, Dv] as in the forward):
//   dq pass   (in order):  q' = dO, k' = V, v' = K, h0' = h0^T          -> dq,  block states S^T
//   dv pass   (reversed):  q' = K,  k' = Q, v' = dO, h0' = dht / sigma  -> dv,  block states dH / sigma,
//                                                                          final state dH_0 / sigma
//   dk pass   (reversed):  q' = V,  k' = dO, v' = Q, h0' = dht^T / sigma -> dk
// A reversed pass reads token t as token T-1-t with log-decay a_{T-t} (a_T := 0; lasp::sd::TimeAxis),
// so its prefix sums are the suffix sums dH_s = sigma sum_{t >= s} e^{G_t - G_s} q_t^T do_t +
// e^{G_{T-1} - G_s} dht.
// Both reversed passes run in the same S segments, and the dk pass's segment states are the
// transposes of the dv pass's (both are the sums of e^{..} q_t^T do_t over the segment), so one
// reversed states pass over Q and dO (the forward's lasp_scalar_decay_states_reversed with the dv
// pass's roles; LASP-2 has its own) serves both, and the passes run their output kernels only.
// Then the kernels here:
//   lasp_sd_bwd_state_inputs  h0^T (the dq pass's start state)
//   lasp_sd_bwd_reversed_starts  the dv pass's start states: segment 0's dht / sigma, segment s + 1's
//                             P_{s+1} = e^{Lambda_s} P_s + R_s (R_s, Lambda_s: the reversed states
//                             pass's), and their transposes, the dk pass's
//   lasp_sd_bwd_gate_terms_dk{64,128}  per (Dv tile, block, b*H+h): the gate gradient's terms of the
//                             block's tokens (below)
//   lasp_sd_bwd_gate_grad     per (block, b*H+h): dg of the block's tokens, and dh0 = sigma e^{a_0} dH_0
//
// Gate gradient. With S_t the state after token t (S_{-1} = h0) and dH_t = dL/dS_t (dH_{T-1} includes
// dht), dL/da_t = e^{a_t} <S_{t-1}, dH_t>: the sum of sigma (q_u . k_j)(do_u . v_j) e^{G_u - G_j} over the
// pairs j < t <= u that straddle t (h0 as j = -1, dht as u = T, G_T := G_{T-1}). No term cancels another,
// so the sum keeps the accuracy of its terms. (The form dg_t = sum_{u >= t} (q_u . dq_u - k_u . dk_u)
// sums the pairs on both sides of t and lets them cancel; from bf16 gradients that left 2-50 % of
// error where the decay is strong.) The sequence is cut into blocks of LASP_SD_BLOCK_CHUNKS chunks
// [s0, s1); the backward's dq pass writes S_{s0-1} (as S^T) entering each block and its dv pass
// dH_{s1} / sigma leaving it (lasp_sd_block_slot; the reversed loops put their chunk boundaries on the
// in-order ones, lasp::sd::TimeAxis), as the bf16 hi + lo tiles the gate kernel's products read
// (lasp::sd::state_store_tiles). For t in a block, the straddling pairs are
//   Z     j < s0,  u >= s1:   e^{G_{s1} - G_{s0-1}} <S_{s0-1}, dH_{s1}>             (fp64 sum)
//   x_q   j < s0,  t <= u < s1:  sum_u sigma e^{G_u - G_{s0-1}} q_u S_{s0-1} do_u^T
//   x_k   s0 <= j < t,  u >= s1:  sum_j e^{G_{s1} - G_j} k_j dH_{s1} v_j^T
//   A     s0 <= j < t <= u < s1:  from the block's pair matrix A_uj, in fp32 from the bf16 inputs
// The states enter the products as bf16 hi + lo pairs (16 significant bits); the exponents are sums of
// chunk-local cumsums, each part <= 0. For A, per token u the row sum R_u = sum_{s0 <= j < u} A_uj and
// column sum C_u = sum_{u < i < s1} A_iu give the straddling sum as the suffix sum of R - C (the same
// fp32 values on both sides, so only fp32 rounding is left of what cancels). gate_terms writes x_q,
// x_k, R and C per token and Dv tile (the (do . v) factor is split over the tiles) and each tile's
// part of Z; gate_grad adds the tiles in order and scans the block in fp64. Every order is fixed: the
// same bits on every run.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define LASP_SDB_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP_SDB_FN static inline constexpr
#else
#define LASP_SDB_FN static inline
#endif

#include "lasp/scalar_decay/forward_params.h"

#define LASP_SDB_STATE_TILE 32       // lasp_sd_bwd_state_inputs and _reversed_starts: one CTA per
#define LASP_SDB_STATE_THREADS 256   // 32 x 32 tile of a state (32 columns x 8 rows of threads)
#define LASP_SDB_TERM_THREADS 256    // lasp_sd_bwd_gate_terms: two warpgroups per (Dv tile, block, b*H+h)
#define LASP_SDB_GRAD_THREADS (LASP_SD_BLOCK_CHUNKS * LASP_SD_CHUNK)  // lasp_sd_bwd_gate_grad: a thread per token

typedef struct {
  const uint16_t* q;        // bf16 [B, T, H, Dk]
  const uint16_t* k;        // bf16 [B, T, H, Dk]
  const uint16_t* v;        // bf16 [B, T, H, Dv]
  const uint16_t* d_o;      // bf16 [B, T, H, Dv]: the gradient of o
  const float* g;           // fp32 [B, T, H]: log-decays
  const float* h0;          // fp32 [B, H, Dk, Dv] or NULL
  const float* dht;         // fp32 [B, H, Dk, Dv] or NULL (then the passes start from zero)
  float* h0_t;              // fp32 [B, H, Dv, Dk]: h0^T (written when h0)
  float* dht_scaled;        // fp32 [B, H, Dk, Dv]: dht / sigma (written when dht)
  float* dht_t_scaled;      // fp32 [B, H, Dv, Dk]: dht^T / sigma (written when dht)
  const float* rev_m;       // fp32 [B*H][rev_slots][Dk, Dv]: R_s of the reversed states pass, s < S-1 read
  const float* rev_lambda;  // fp32 [B*H][rev_slots]: its log-decays Lambda_s
  float* dv_starts;         // fp32 [B*H][S-1][Dk, Dv]: the dv pass's starts of segments 1 .. S-1
  float* dk_starts;         // fp32 [B*H][S-1][Dv, Dk]: their transposes, the dk pass's
  const float* dh0_scaled;  // fp32 [B, H, Dk, Dv]: the dv pass's final state dH_0 / sigma (read when dh0)
  void* fwd_blocks;         // [B*H][blocks][4 Dk Dv bytes]: S^T entering each block (the dq pass's)
  void* rev_blocks;         // [B*H][blocks][4 Dk Dv bytes]: dH / sigma leaving each block (the dv pass's)
                            // (both laid out by lasp::sd::state_store_tiles)
  float* gate_rows;         // fp32 [Dv/64][4][B*H][T]: per Dv tile, x_q, x_k, R and C of every token
  float* gate_z;            // fp32 [Dv/64][B*H][blocks]: per Dv tile, Z / e^{G_{s1} - G_{s0-1}} of every block
  float* dg;                // fp32 [B, T, H]: the log-decays' gradient
  float* dh0;               // fp32 [B, H, Dk, Dv] or NULL to skip
  int32_t B;
  int32_t T;
  int32_t H;
  int32_t Dk;               // 64 or 128
  int32_t Dv;               // 64 or 128
  float scale;              // sigma
  int32_t rev_segments;     // S, the reversed passes' segments (>= 1)
  int32_t rev_slots;        // segment states per head in rev_m: S - 1 (this backward's states pass)
                            // or S (LASP-2's, which covers the last segment too)
} lasp_sd_bwd_params;

typedef struct {
  uint32_t x, y, z;
} lasp_sdb_dim3;

LASP_SDB_FN lasp_sdb_dim3 lasp_sdb_state_inputs_grid(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  lasp_sdb_dim3 d = {(uint32_t)((Dk / LASP_SDB_STATE_TILE) * (Dv / LASP_SDB_STATE_TILE)), (uint32_t)(B * H), 1u};
  return d;
}

// One CTA per (Dv tile, block, b*H+h); x fastest, so the Dv tiles of a block share Q and K in L2.
LASP_SDB_FN lasp_sdb_dim3 lasp_sdb_gate_terms_grid(int32_t B, int32_t T, int32_t H, int32_t Dv) {
  lasp_sdb_dim3 d = {(uint32_t)lasp_sd_num_vtiles(Dv), (uint32_t)lasp_sd_num_blocks(T), (uint32_t)(B * H)};
  return d;
}

// Dynamic shared memory of lasp_sd_bwd_gate_terms_dk*: K and the V tile of every chunk of a block, two
// buffers of Q and the dO tile, the hi and lo bf16 tiles of two states (Dk x 64 each), the block's
// chunk-local cumsums (+ the chunks' total log-decays and the next token's), the column sums of
// each of the pair role's four warps, and the column factors e^{gamma_m - b^m_j} of the block's pairs.
LASP_SDB_FN uint32_t lasp_sdb_gate_terms_smem_bytes(int32_t Dk) {
  const uint32_t qk = LASP_SD_CHUNK * Dk * 2u, vtile = LASP_SD_CHUNK * LASP_SD_TILE_V * 2u;
  return LASP_SD_BLOCK_CHUNKS * (qk + vtile) + 2u * (qk + vtile) + 4u * Dk * LASP_SD_TILE_V * 2u +
         LASP_SD_BLOCK_CHUNKS * LASP_SD_CHUNK * 4u + 64u + 4u * LASP_SD_BLOCK_CHUNKS * LASP_SD_CHUNK * 4u +
         LASP_SD_BLOCK_CHUNKS * LASP_SD_CHUNK * 4u;
}

// One CTA per (block, b*H+h).
LASP_SDB_FN lasp_sdb_dim3 lasp_sdb_gate_grad_grid(int32_t B, int32_t T, int32_t H) {
  lasp_sdb_dim3 d = {(uint32_t)lasp_sd_num_blocks(T), (uint32_t)(B * H), 1u};
  return d;
}

// Workspace (bytes, 16-aligned parts): h0_t, dht_scaled, dht_t_scaled, dh0_scaled (one [B, H, Dk, Dv]
// fp32 state each), the two directions' block states (fwd_blocks, rev_blocks), gate_rows, gate_z.
LASP_SDB_FN uint64_t lasp_sdb_state_bytes(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * (uint64_t)Dk * Dv * 4u;
}
LASP_SDB_FN uint64_t lasp_sdb_block_states_bytes(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  return (uint64_t)lasp_sd_num_blocks(T) * lasp_sdb_state_bytes(B, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_fwd_blocks_offset(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return 4u * lasp_sdb_state_bytes(B, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_rev_blocks_offset(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  return lasp_sdb_fwd_blocks_offset(B, H, Dk, Dv) + lasp_sdb_block_states_bytes(B, T, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_gate_rows_offset(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  return lasp_sdb_rev_blocks_offset(B, T, H, Dk, Dv) + lasp_sdb_block_states_bytes(B, T, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_gate_z_offset(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  const uint64_t rows = (uint64_t)lasp_sd_num_vtiles(Dv) * 4u * B * H * (uint64_t)T * 4u;
  return lasp_sdb_gate_rows_offset(B, T, H, Dk, Dv) + (rows + 15u) / 16u * 16u;
}
LASP_SDB_FN uint64_t lasp_sdb_workspace_bytes(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  return lasp_sdb_gate_z_offset(B, T, H, Dk, Dv) +
         (uint64_t)lasp_sd_num_vtiles(Dv) * B * H * (uint64_t)lasp_sd_num_blocks(T) * 4u;
}

// The reversed passes' workspace (a second allocation; none when S == 1): dv_starts at 0, dk_starts,
// then rev_m and rev_lambda where this backward runs the reversed states pass itself (a caller that
// gives its own states, LASP-2, needs only the starts: lasp_sdb_rev_m_offset bytes).
LASP_SDB_FN uint64_t lasp_sdb_dk_starts_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return (uint64_t)(S - 1) * lasp_sdb_state_bytes(B, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_rev_m_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return 2u * (uint64_t)(S - 1) * lasp_sdb_state_bytes(B, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_rev_lambda_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return 3u * (uint64_t)(S - 1) * lasp_sdb_state_bytes(B, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_reversed_bytes(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return lasp_sdb_rev_lambda_offset(B, H, S, Dk, Dv) + (((uint64_t)B * H * (uint64_t)(S - 1) * 4u + 15u) / 16u) * 16u;
}
