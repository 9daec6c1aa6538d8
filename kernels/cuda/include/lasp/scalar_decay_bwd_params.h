// Scalar-decay linear attention, backward: parameters and launch formulas of the kernels in
// scalar_decay_bwd.cu, shared by the CUDA sources and the host (core/src/ops/scalar_decay_backward.rs
// mirrors the struct and the formulas; its unit tests compare them with this file).
//
// The backward is three passes of the forward's chunkwise kernels with the roles of the tensors
// exchanged (sigma = scale; states [Dk, Dv] as in the forward):
//   dq pass   (in order):  q' = dO, k' = V, v' = K, h0' = h0^T          -> dq,  final state ht^T
//   dv pass   (reversed):  q' = K,  k' = Q, v' = dO, h0' = dht / sigma  -> dv,  final state dH_0 / sigma
//   dk pass   (reversed):  q' = V,  k' = dO, v' = Q, h0' = dht^T / sigma -> dk
// A reversed pass reads token t as token T-1-t with log-decay a_{T-t} (a_T := 0), so its prefix
// sums are the suffix sums dH_s = sigma sum_{t >= s} e^{G_t - G_s} q_t^T do_t + e^{G_{T-1} - G_s} dht.
// Both reversed passes run in the same S segments, and the dk pass's segment states are the
// transposes of the dv pass's (both are the sums of e^{..} q_t^T do_t over the segment), so one
// reversed states pass over Q and dO (the forward's lasp_scalar_decay_states_reversed with the dv
// pass's roles; LASP-2 has its own) serves both, and the passes run their output kernels only.
// Then the kernels here:
//   lasp_sd_bwd_state_inputs  h0^T (the dq pass's start state)
//   lasp_sd_bwd_reversed_starts  the dv pass's start states: segment 0's dht / sigma, segment s + 1's
//                             P_{s+1} = e^{Lambda_s} P_s + R_s (R_s, Lambda_s: the reversed states
//                             pass's), and their transposes, the dk pass's
//   lasp_sd_bwd_gate_terms    dG_t = q_t . dq_t - k_t . dk_t        (per token and head)
//   lasp_sd_bwd_gate_block_sums  <ht, dht> and the sum of dG over every block of tokens (only
//                             where T is longer than one block)
//   lasp_sd_bwd_gate_grad     dg_t = sum_{u >= t} dG_u + <ht, dht>, dh0 = sigma e^{a_0} (dH_0 / sigma)
// The suffix sums run over blocks of LASP_SDB_GRAD_BLOCK tokens counted from the end (block 0 ends
// at T; the last block starts at 0 and may be shorter), one CTA per (block, b*H+h) in both gate
// kernels, so that a long sequence is spread over the GPU instead of walked by one CTA per head.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define LASP_SDB_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP_SDB_FN static inline constexpr
#else
#define LASP_SDB_FN static inline
#endif

#define LASP_SDB_STATE_TILE 32       // lasp_sd_bwd_state_inputs and _reversed_starts: one CTA per
#define LASP_SDB_STATE_THREADS 256   // 32 x 32 tile of a state (32 columns x 8 rows of threads)
#define LASP_SDB_TERM_THREADS 256    // lasp_sd_bwd_gate_terms: Dk / 8 lanes per (b, t, h) row
#define LASP_SDB_TERM_ROWS_PER_THREAD 4
#define LASP_SDB_GRAD_THREADS 1024   // the two gate kernels: one CTA per (block, b*H+h)
#define LASP_SDB_GRAD_PER_THREAD 8    // tokens per thread and block
#define LASP_SDB_GRAD_BLOCK (LASP_SDB_GRAD_THREADS * LASP_SDB_GRAD_PER_THREAD)

typedef struct {
  const uint16_t* q;        // bf16 [B, T, H, Dk]
  const uint16_t* k;        // bf16 [B, T, H, Dk]
  const uint16_t* dq;       // bf16 [B, T, H, Dk]: the dq pass's output
  const uint16_t* dk;       // bf16 [B, T, H, Dk]: the dk pass's output
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
  const float* ht_t;        // fp32 [B, H, Dv, Dk]: the dq pass's final state ht^T (read when dht)
  const float* dh0_scaled;  // fp32 [B, H, Dk, Dv]: the dv pass's final state dH_0 / sigma (read when dh0)
  float* gate_terms;        // fp32 [B, H, T]: dG_t
  double* block_totals;     // fp64 [B*H][1 + lasp_sdb_grad_blocks(T)]: <ht, dht> (0 without dht),
                            // then the sum of dG over block 0, 1, ... (from the end)
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

// Rows (b, t, h) per CTA of lasp_sd_bwd_gate_terms: Dk / 8 lanes per row, several rows per thread.
LASP_SDB_FN int32_t lasp_sdb_term_rows_per_cta(int32_t Dk) {
  return LASP_SDB_TERM_THREADS / (Dk / 8) * LASP_SDB_TERM_ROWS_PER_THREAD;
}

LASP_SDB_FN lasp_sdb_dim3 lasp_sdb_gate_terms_grid(int32_t B, int32_t T, int32_t H, int32_t Dk) {
  const int64_t rows = (int64_t)B * T * H;
  const int64_t per_cta = lasp_sdb_term_rows_per_cta(Dk);
  lasp_sdb_dim3 d = {(uint32_t)((rows + per_cta - 1) / per_cta), 1u, 1u};
  return d;
}

// Blocks of the gate kernels' suffix sums per sequence.
LASP_SDB_FN int32_t lasp_sdb_grad_blocks(int32_t T) {
  return (int32_t)(((int64_t)T + LASP_SDB_GRAD_BLOCK - 1) / LASP_SDB_GRAD_BLOCK);
}

// Both gate kernels: lasp_sd_bwd_gate_block_sums and lasp_sd_bwd_gate_grad.
LASP_SDB_FN lasp_sdb_dim3 lasp_sdb_gate_grad_grid(int32_t B, int32_t T, int32_t H) {
  lasp_sdb_dim3 d = {(uint32_t)lasp_sdb_grad_blocks(T), (uint32_t)(B * H), 1u};
  return d;
}

// Workspace (bytes, 16-aligned parts): h0_t, dht_scaled, dht_t_scaled, ht_t, dh0_scaled (one
// [B, H, Dk, Dv] fp32 state each), then gate_terms [B, H, T] fp32, then block_totals.
LASP_SDB_FN uint64_t lasp_sdb_state_bytes(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * (uint64_t)Dk * Dv * 4u;
}
LASP_SDB_FN uint64_t lasp_sdb_gate_terms_offset(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return 5u * lasp_sdb_state_bytes(B, H, Dk, Dv);
}
LASP_SDB_FN uint64_t lasp_sdb_block_totals_offset(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  return lasp_sdb_gate_terms_offset(B, H, Dk, Dv) + (((uint64_t)B * H * (uint64_t)T * 4u + 15u) / 16u) * 16u;
}
LASP_SDB_FN uint64_t lasp_sdb_workspace_bytes(int32_t B, int32_t T, int32_t H, int32_t Dk, int32_t Dv) {
  return lasp_sdb_block_totals_offset(B, T, H, Dk, Dv) +
         (((uint64_t)B * H * (1u + (uint64_t)lasp_sdb_grad_blocks(T)) * 8u + 15u) / 16u) * 16u;
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
