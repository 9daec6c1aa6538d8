// Parameters and launch geometry of the GLA forward (gla/forward.cu): linear attention with a decay
// per key dimension. C: bindgen generates the host's struct and constants from this file
// (kernels/build.rs); the host's plan (core/src/ops/gla/plan.rs) uses the same formulas.
//
// Maths (per batch b, head h; row vectors; sigma = scale; a_t = g[b, t, h, :] in R^Dk, <= 0):
//   S_t = diag(e^{a_t}) S_{t-1} + k_t^T v_t,   o_t = sigma q_t S_t.
//
// Host call sequence (one stream, in this order; S = num_segments):
//   1. if S > 1: lasp_gla_states_dk{64,128}         grid (Dv/64, (S-1)*R, B*H), block LASP_GLA_STATES_THREADS,
//                                                  smem lasp_gla_states_smem_bytes(Dk)
//   2. if S > 1: lasp_gla_fold                      grid (ceil(Dk*Dv/LASP_GLA_FOLD_THREADS), B*H),
//                                                  block LASP_GLA_FOLD_THREADS, smem 0
//   3.           lasp_gla_output_dk{64,128}_dv{64,128}  grid (1, S, B*H), block lasp_gla_output_threads(Dv),
//                                                  smem lasp_gla_output_smem_bytes(Dk, Dv)
// All take lasp_gla_params by value and need cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES).
//
// Supported: Dk, Dv in {64, 128}; T >= 1; B*H in [1, 65535]; q, k, v, o 16-byte aligned, g 16-byte
// aligned, h0 / ht / workspace 8-byte aligned, chunk_states 16-byte aligned; g finite and <= 0; scale > 0; ht must not overlap h0.
// Same inputs -> bitwise same outputs (no atomics; every sum has a fixed order).
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define LASP_GLA_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP_GLA_FN static inline constexpr
#else
#define LASP_GLA_FN static inline
#endif

#define LASP_GLA_CHUNK 64           // tokens per chunk
#define LASP_GLA_STAGES 2           // the output kernel's cp.async pipeline depth (chunks in flight)
#define LASP_GLA_STATES_THREADS 128 // the states kernel: one warpgroup per (64 Dv columns, segment, b*H+h)
#define LASP_GLA_STATES_STAGES 2    // its pipeline depth: two CTAs per SM
#define LASP_GLA_FOLD_THREADS 256

typedef struct {
  const uint16_t* q;   // bf16 [B, T, H, Dk], contiguous
  const uint16_t* k;   // bf16 [B, T, H, Dk], contiguous
  const uint16_t* v;   // bf16 [B, T, H, Dv], contiguous
  const float* g;      // fp32 [B, T, H, Dk]: per-key log-decays a_t <= 0
  uint16_t* o;         // bf16 [B, T, H, Dv]: output
  const float* h0;     // fp32 [B, H, Dk, Dv] initial state, or NULL for zero
  float* ht;           // fp32 [B, H, Dk, Dv] final state, or NULL to skip
  uint16_t* chunk_states;  // bf16 [B*H, N, Dk, Dv] (N = ceil(T / 64)): the state entering every
                           // chunk n, each row d scaled by e^{c_d} (the chunk's reference row,
                           // lasp/gla/chunk.cuh), which the backward takes; or NULL
  const uint64_t* starts;  // u64 [ceil(T / 64)]: where documents start in every chunk (packed
                          // documents, lasp/documents/chunk_starts.cuh), or NULL for one sequence
  const int32_t* entry_slots;  // [ceil(T / 64)]: per chunk, the packed document whose state entering it
                               // the output loop stores, or -1 (lasp_document_entry_slots); NULL
                               // where no document's final state is asked for
  float* document_states;      // fp32 [B, N, H, Dk, Dv]: where it stores them (document n of row b;
                               // gla/document_states.cu adds the chunk's tokens)
  int32_t documents;           // N
  // The workspace (one allocation, none when S == 1): ws_m at byte 0, ws_p after it, ws_lambda
  // after both (core/src/ops/gla/plan.rs sizes it).
  float* ws_m;         // fp32 [B*H, (S-1)*R, Dk, Dv]: local end state M_u of states piece u (zero start)
  float* ws_p;         // fp32 [B*H, S-1, Dk, Dv]: slot s holds the prefix P_{s+1} entering segment s+1
  float* ws_lambda;    // fp32 [B*H, (S-1)*R, Dk]: log-decay Lambda_u of piece u per key dimension
  int32_t B;           // batch
  int32_t T;           // tokens per sequence (>= 1)
  int32_t H;           // heads
  int32_t Dk;          // key/query head dim: 64 or 128 (must match the kernel's suffix)
  int32_t Dv;          // value head dim: 64 or 128 (must match the output kernel's suffix)
  int32_t num_segments;        // S >= 1 segments of whole chunks per (b, h)
  int32_t chunks_per_segment;  // ceil(num_chunks / S); no segment empty
  int32_t states_splits;       // R >= 1: the states pass cuts each of segments 0..S-2 into R pieces of
                               // ceil(chunks_per_segment / R) chunks (the last ones may be short or
                               // empty), one CTA each, so that it fills the GPU where S is small
  float scale;                 // sigma, usually Dk^-1/2
} lasp_gla_params;

LASP_GLA_FN int32_t lasp_gla_num_chunks(int32_t T) { return (T + LASP_GLA_CHUNK - 1) / LASP_GLA_CHUNK; }

// The output kernel: one warpgroup per 64 columns of Dv, all of them in one CTA, so the gate work
// of a chunk (the cumsums and the decayed Q and K tiles) is done once per (b, h) and chunk.
LASP_GLA_FN int32_t lasp_gla_output_threads(int32_t Dv) { return 128 * (Dv / 64); }

// Output kernel: STAGES x (Q, K, V, gates) + the key tile of the intra-chunk scores + one bf16
// state tile per warpgroup + three fp32 vectors of Dk (reference row, its and the chunk's decays)
// + the gate scan's row-block totals (8 bytes per thread).
LASP_GLA_FN uint32_t lasp_gla_output_smem_bytes(int32_t Dk, int32_t Dv) {
  const uint32_t stage = 2u * LASP_GLA_CHUNK * Dk * 2u + LASP_GLA_CHUNK * Dv * 2u + LASP_GLA_CHUNK * Dk * 4u;
  return LASP_GLA_STAGES * stage + LASP_GLA_CHUNK * Dk * 2u + Dk * Dv * 2u + 3u * Dk * 4u +
         8u * (uint32_t)lasp_gla_output_threads(Dv);
}

// States kernel: STATES_STAGES x (K, V tile of 64 columns, gates) + the row-block totals.
LASP_GLA_FN uint32_t lasp_gla_states_smem_bytes(int32_t Dk) {
  const uint32_t stage = LASP_GLA_CHUNK * Dk * 2u + LASP_GLA_CHUNK * 64u * 2u + LASP_GLA_CHUNK * Dk * 4u;
  return LASP_GLA_STATES_STAGES * stage + 8u * LASP_GLA_STATES_THREADS;
}
