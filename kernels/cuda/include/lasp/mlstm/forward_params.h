// Parameters and launch geometry of the mLSTM forward (mlstm/forward.cu): xLSTM's matrix LSTM in
// mlstm_kernels' mLSTMexp semantics. C: bindgen generates the host's struct and constants from
// this file (kernels/build.rs); the host's plan (core/src/ops/mlstm/plan.rs) uses the same formulas.
//
// Maths (per batch b, head h; row vectors; sigma = scale; lf_t = logsigmoid(f_t)):
//   m_t = max(lf_t + m_{t-1}, i_t),  i'_t = e^{i_t - m_t},  f'_t = e^{lf_t + m_{t-1} - m_t}
//   C_t = f'_t C_{t-1} + i'_t k_t^T v_t,   n_t = f'_t n_{t-1} + i'_t k_t
//   h_t = sigma q_t C_t / (max(|sigma q_t . n_t|, e^{-m_t}) + eps)
// from (C_0, n_0, m_0), or (0, 0, 0) without an initial state (mlstm_kernels' zero state).
//
// Host call sequence (one stream, in this order; S = num_segments):
//   1. if S > 1: lasp_mlstm_states_dk{64,128}_dv{64,128}  grid (1, num_summaries*R, B*H),
//                  block lasp_mlstm_threads(Dv), smem lasp_mlstm_states_smem_bytes(Dk, Dv)
//   2. if S > 1: lasp_mlstm_fold  grid (ceil((Dk*Dv + Dk) / LASP_MLSTM_FOLD_THREADS), B*H),
//                  block LASP_MLSTM_FOLD_THREADS, smem 0
//   3.           lasp_mlstm_output_dk{64,128}_dv{64,128}  grid (1, S, B*H),
//                  block lasp_mlstm_threads(Dv), smem lasp_mlstm_output_smem_bytes(Dk, Dv)
// All take lasp_mlstm_params by value and need cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES).
//
// Supported: Dk, Dv in {64, 128}; T >= 1; B*H in [1, 65535]; q, k, v, o 16-byte aligned, the gates
// 4-byte aligned, states and workspace 8-byte aligned; gates finite; scale > 0, eps >= 0; the
// initial state all of (c0, n0, m0) or none, the final state likewise, not overlapping it.
// Same inputs -> bitwise same outputs (no atomics; every sum has a fixed order).
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define LASP_MLSTM_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP_MLSTM_FN static inline constexpr
#else
#define LASP_MLSTM_FN static inline
#endif

#define LASP_MLSTM_CHUNK 64         // tokens per chunk of the on-chip loop
#define LASP_MLSTM_TILE_V 64        // Dv columns per CTA
#define LASP_MLSTM_STAGES 2         // cp.async pipeline depth (chunks in flight)
#define LASP_MLSTM_FOLD_THREADS 256
#define LASP_MLSTM_BLOCK_SMEM (227 * 1024)  // the most shared memory a block may have (sm_90)

typedef struct {
  const uint16_t* q;        // bf16 [B, T, H, Dk]
  const uint16_t* k;        // bf16 [B, T, H, Dk]
  const uint16_t* v;        // bf16 [B, T, H, Dv]
  const float* i_gate;      // fp32 [B, T, H]: input-gate pre-activations i_t
  const float* f_gate;      // fp32 [B, T, H]: forget-gate pre-activations f_t
  uint16_t* o;              // bf16 [B, T, H, Dv]: h
  const float* c0;          // fp32 [B, H, Dk, Dv], or NULL (then n0 and m0 are NULL too): zero state
  const float* n0;          // fp32 [B, H, Dk]
  const float* m0;          // fp32 [B, H]
  float* c_t;               // fp32 [B, H, Dk, Dv] final state, or NULL (then n_t, m_t NULL too)
  float* n_t;               // fp32 [B, H, Dk]
  float* m_t;               // fp32 [B, H]
  // Saved by the output kernel for the backward where non-NULL (lasp/mlstm/backward_params.h):
  // every token's stabiliser m_t and denominator max(|sigma q_t . n_t|, e^{-m_t}) + eps.
  float* row_m;             // fp32 [B, T, H]
  float* row_den;           // fp32 [B, T, H]
  // The backward's gradient passes only (lasp_mlstm_grad_*; unused by the forward's kernels):
  // output row t is the product's row times e^{m_t + row_log_scale_t} (m_t the pass's own
  // stabiliser) instead of divided by the denominator, and its dot with row t of row_dot_with
  // (fp32, before the rounding to bf16) goes to row_dots per 64 output columns.
  const float* row_log_scale;    // fp32 [B, T, H]
  const uint16_t* row_dot_with;  // bf16 [B, T, H, Dv], or NULL: no dots
  float* row_dots;               // fp32 [B, T, H, Dv / 64]
  int32_t reversed;         // nonzero: loop token p is token T-1-p (every tensor, gates included)
  // Packed documents (the _packed kernels only; NULL for the others): the start word of every
  // loop chunk (lasp/documents/chunk_starts.cuh), bit i of word c set where loop token 64 c + i
  // starts a document; a reversed pass's words mark the tokens whose successor starts one (the
  // shard's last token where the next shard opens with a start). A document enters from m = 0
  // in order, from the empty state reversed (kernels/docs/packed.md, "mLSTM").
  const uint64_t* starts;
  // Packed documents' final states (the output kernels *_entries only; NULL for the others):
  // where entry_slots[c] = n >= 0 (document n began before loop chunk c and ends in it:
  // lasp_document_entry_slots), the state entering chunk c goes to n's slots, C into document_c
  // [B, N, H, Dk, Dv], n into document_n [B, N, H, Dk] and m into entry_m [B, N, H]; then
  // mlstm/document_states.cu adds the chunk's tokens of the document (lasp/mlstm/
  // document_states_params.h). N = documents.
  const int32_t* entry_slots;
  float* document_c;
  float* document_n;
  float* entry_m;
  // The workspace (one allocation, none on one GPU when S == 1; core/src/ops/mlstm/plan.rs sizes
  // it), per (b*H+h): the summary of every piece u of segments 0..num_summaries-1 from the empty
  // state (ws_c, ws_n, ws_m, and its log forget sum ws_f), and the prefix entering every segment
  // s+1 (ws_pc, ws_pn, ws_pm). N = num_summaries * R pieces.
  float* ws_c;              // fp32 [B*H, N, Dk, Dv]
  float* ws_pc;             // fp32 [B*H, S-1, Dk, Dv]
  float* ws_n;              // fp32 [B*H, N, Dk]
  float* ws_pn;             // fp32 [B*H, S-1, Dk]
  float* ws_m;              // fp32 [B*H, N]
  float* ws_f;              // fp32 [B*H, N]
  float* ws_pm;             // fp32 [B*H, S-1]
  int32_t B;
  int32_t T;                // tokens per sequence (>= 1)
  int32_t H;
  int32_t Dk;               // 64 or 128 (must match the kernel's suffix)
  int32_t Dv;               // 64 or 128
  int32_t num_segments;        // S >= 1 segments of whole chunks per (b, h)
  int32_t chunks_per_segment;  // ceil(num_chunks / S); no segment empty
  int32_t num_summaries;       // segments the states pass summarises: S - 1 on one GPU (the last
                               // segment's summary is not needed), S in a LASP-2 shard (whose
                               // summary crosses GPUs: lasp/mlstm/lasp2_params.h)
  int32_t states_splits;       // R >= 1: the states pass cuts each of those segments into R pieces
                               // of lasp_mlstm_chunks_per_piece chunks (the last may be short or
                               // empty), one CTA each, so that it fills the GPU where S is small
  int32_t documents;           // N, the documents the entering states' slots are for (or 0)
  float scale;              // sigma, usually Dk^-1/2
  float eps;                // added to the denominator after the max (mlstm_kernels: 1e-6)
} lasp_mlstm_params;

LASP_MLSTM_FN int32_t lasp_mlstm_num_chunks(int32_t T) { return (T + LASP_MLSTM_CHUNK - 1) / LASP_MLSTM_CHUNK; }

LASP_MLSTM_FN int32_t lasp_mlstm_chunks_per_piece(int32_t chunks_per_segment, int32_t R) {
  return (chunks_per_segment + R - 1) / R;
}

// Per stage: Q (output kernel only), K, Dv / 64 V tiles (bf16) and both gates of a chunk (fp32).
LASP_MLSTM_FN uint32_t lasp_mlstm_stage_bytes(int32_t Dk, int32_t Dv, int32_t with_q) {
  return (with_q ? 2u : 1u) * LASP_MLSTM_CHUNK * Dk * 2u + LASP_MLSTM_CHUNK * Dv * 2u + 2u * LASP_MLSTM_CHUNK * 4u;
}

// The normaliser's partial vectors: two where the CTA has two threads per key dimension.
LASP_MLSTM_FN uint32_t lasp_mlstm_normaliser_bytes(int32_t Dk, int32_t Dv) {
  return (128 * (Dv / LASP_MLSTM_TILE_V) >= 2 * Dk ? 2u : 1u) * Dk * 4u;
}

// Output kernel: STAGES stages, two copies of the state split into bf16 hi and lo (one read this
// chunk, one written for the next), two copies of the normaliser's parts likewise, then where a
// block has room (every shape but Dk = Dv = 128) a start word per stage (packed documents' twin).
LASP_MLSTM_FN uint32_t lasp_mlstm_output_smem_bytes(int32_t Dk, int32_t Dv) {
  const uint32_t tiles = LASP_MLSTM_STAGES * lasp_mlstm_stage_bytes(Dk, Dv, 1) + 4u * Dk * Dv * 2u +
                         2u * lasp_mlstm_normaliser_bytes(Dk, Dv);
  const uint32_t words = LASP_MLSTM_STAGES * 8u;
  return tiles + words <= LASP_MLSTM_BLOCK_SMEM ? tiles + words : tiles;
}

// States kernel: STAGES stages without Q, one copy of the normaliser's parts (added up at the end),
// a start word per stage (packed documents' twin).
LASP_MLSTM_FN uint32_t lasp_mlstm_states_smem_bytes(int32_t Dk, int32_t Dv) {
  return LASP_MLSTM_STAGES * lasp_mlstm_stage_bytes(Dk, Dv, 0) + lasp_mlstm_normaliser_bytes(Dk, Dv) +
         LASP_MLSTM_STAGES * 8u;
}

// Threads of the states and output kernels: one warpgroup per 64 columns of Dv.
LASP_MLSTM_FN int32_t lasp_mlstm_threads(int32_t Dv) { return 128 * (Dv / LASP_MLSTM_TILE_V); }
