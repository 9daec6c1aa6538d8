// Parameters and launch geometry of the Gated DeltaNet forward (gated_delta/forward.cu): the delta
// rule with a scalar decay. C: bindgen generates the host's struct and constants from this file
// (kernels/build.rs); the host (core/src/ops/gated_delta/forward.rs) uses the same formulas.
//
// Maths (per batch b, head h; row vectors; sigma = scale; a_t = g[b, t, h] <= 0, beta_t = beta[b, t, h]):
//   S_t = e^{a_t} (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t,   o_t = sigma q_t S_t.
// Per chunk of 64 tokens with chunk-local cumsum b and the strictly lower
// L_rj = beta_r e^{b_r - b_j} (k_r . k_j), the values the chunk writes are
//   u = (I + L)^{-1} diag(beta) (V - diag(e^b) K S_n),
// and with u in V's place the chunk is scalar decay's (kernels/docs/gated-delta.md).
//
// A sequence of N = ceil(T / 64) chunks runs as S >= 1 segments of whole chunks, one CTA per
// (segment, 64 columns of Dv, b*H+h). Segment s maps its start state affinely, S_end = A_s S_start +
// b_s (A_s [Dk x Dk]: the chunks' transitions; b_s [Dk x Dv]: its end state from zero), so the
// start of every segment comes from the summaries of the earlier ones (the fold).
//
// Host call sequence (one stream, in this order):
//   1.           lasp_gated_delta_wy_dk{64,128}       grid (N, B*H), block LASP_GDN_WY_THREADS,
//                                                    smem lasp_gdn_wy_smem_bytes(Dk): (I + L)^{-1} of every chunk
//   2. if S > 1: lasp_gated_delta_summary_dk{64,128}  grid (Dk/64 + Dv/64, S-1, B*H), block LASP_SD_THREADS,
//                                                    smem lasp_gdn_summary_smem_bytes(Dk): A_s, b_s of
//                                                    segments 0..S-2 (column tiles of A first, then of b;
//                                                    the CTAs in grid order, x then y, are the tiles
//                                                    segment by segment, so a grid with fewer CTAs in x
//                                                    leaves out the last tiles: the backward's,
//                                                    lasp/gated_delta/backward_params.h)
//   3. if S > 1: lasp_gated_delta_fold_dk{64,128}     grid (Dv/64, B*H), block LASP_GDN_FOLD_THREADS,
//                                                    smem 0 (static): P_0 = h0, P_{s+1} = A_s P_s + b_s
//                                                    into ws_p
//   4.           lasp_gated_delta_output_dk{64,128}   grid (Dv/64, S, B*H), block LASP_SD_THREADS,
//                                                    smem lasp_gdn_output_smem_bytes(Dk): O, and ht
// All take lasp_gated_delta_params by value; those with dynamic shared memory need
// cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES).
//
// Supported: Dk in {64, 128}; Dv a positive multiple of 64; T >= 1; B*H in [1, 65535]; q, k, v, o
// 16-byte aligned, g and beta 4-byte aligned, h0 / ht 8-byte aligned; g finite and <= 0; beta
// finite; scale > 0; ht must not overlap h0.
// Same inputs -> bitwise same outputs (no atomics; every sum has a fixed order).
#pragma once
#include <stdint.h>

#include "lasp/scalar_decay/forward_params.h"

#if defined(__CUDACC__)
#define LASP_GDN_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP_GDN_FN static inline constexpr
#else
#define LASP_GDN_FN static inline
#endif

#define LASP_GDN_WY_THREADS 128  // the WY kernel: four warps per (chunk, b*H+h), one per 16-row block
#define LASP_GDN_TRI_PITCH 72    // floats per row of the WY kernel's fp32 [64 x 64] X^T (8 banks apart:
                                 // its fragment accesses are conflict-free)
#define LASP_GDN_FOLD_THREADS 256  // the fold: one CTA per (64 columns of Dv, b*H+h)
#define LASP_GDN_ROLES_THREADS 512  // the output kernel with roles: state, output, WY and loading warpgroups
#define LASP_GDN_ROLES_STAGES 3     // its chunks in flight (lasp/gated_delta/roles.cuh)
#define LASP_GDN_GATE_BOX_HEADS 4   // heads per box of the roles kernel's gate copies (16 bytes,
                                    // the least a box row takes)

typedef struct {
  const uint16_t* q;   // bf16 [B, T, H, Dk], contiguous
  const uint16_t* k;   // bf16 [B, T, H, Dk], contiguous (l2-normalised by the caller if the model does)
  const uint16_t* v;   // bf16 [B, T, H, Dv], contiguous
  const float* g;      // fp32 [B, T, H]: log-decays a_t <= 0
  const float* beta;   // fp32 [B, T, H]: the delta rule's write strengths
  uint16_t* o;         // bf16 [B, T, H, Dv]: output
  const float* h0;     // fp32 [B, H, Dk, Dv] initial state, or NULL for zero
  float* ht;           // fp32 [B, H, Dk, Dv] final state, or NULL to skip
  // The workspace (one allocation; its layout: core/src/ops/gated_delta/forward.rs): ws_tri always,
  // the segment summaries and prefixes only where the fold runs (S > 1, and every LASP-2 call).
  // A [Dk x Dk] matrix is stored as Dk/64 column blocks [Dk][64], the fold's unit of work.
  uint16_t* ws_tri;    // bf16 [B*H, N, 64, 64]: (I + L)^{-1} of every chunk, row-major
  float* ws_a;         // fp32 [B*H, num_summaries, Dk/64, Dk, 64]: A_s of segments 0..num_summaries-1
  float* ws_b;         // fp32 [B*H, num_summaries, Dk, Dv]: b_s of the same segments
  float* ws_p;         // fp32 [B*H, S, Dk, Dv]: slot s holds the state entering segment s (written by
                       // the fold); NULL when S == 1 and no fold runs: segment 0 then starts from h0
  const int32_t* entry_slots;  // [ceil(T / 64)]: per chunk, the packed document whose state entering it
                               // the document-entries walk stores, or -1 (lasp_document_entry_slots);
                               // NULL elsewhere
  float* document_states;      // fp32 [B, N, H, Dk, Dv]: where it stores them (document n of row b)
  int32_t documents;           // N
  int32_t B;           // batch
  int32_t T;           // tokens per sequence (>= 1)
  int32_t H;           // heads
  int32_t Dk;          // key/query head dim: 64 or 128 (must match the kernels' suffix)
  int32_t Dv;          // value head dim: a multiple of 64
  int32_t num_segments;        // S >= 1 segments of whole chunks per (b, h)
  int32_t chunks_per_segment;  // ceil(N / S); no segment empty
  int32_t num_summaries;       // segments with a summary: S - 1 (the fold needs the earlier ones), or S
                               // in LASP-2 (the shard's summary composes all of them)
  float scale;                 // sigma, usually Dk^-1/2
} lasp_gated_delta_params;

LASP_GDN_FN int32_t lasp_gdn_num_chunks(int32_t T) { return (T + LASP_SD_CHUNK - 1) / LASP_SD_CHUNK; }

// Elements of the workspace: one bf16 [64 x 64] tile per chunk and b*H+h.
LASP_GDN_FN uint64_t lasp_gdn_tri_elems(int32_t B, int32_t H, int32_t T) {
  return (uint64_t)B * H * lasp_gdn_num_chunks(T) * LASP_SD_CHUNK * LASP_SD_CHUNK;
}

// WY kernel: the CTAs per SM its registers leave room for (__launch_bounds__'s minimum,
// kernels/instances.rs), the most that compile without spills: five at Dk = 128 (94-96 registers),
// four at Dk = 64 (up to 128); and its shared memory: the K tile, the chunk's gates and betas, and
// (I + L)^{-1} transposed in fp32 (its diagonal squares hold those of -L until they are inverted;
// lasp/gated_delta/tri_inverse.cuh).
LASP_GDN_FN int32_t lasp_gdn_wy_min_ctas(int32_t Dk) { return Dk == 128 ? 5 : 4; }
LASP_GDN_FN uint32_t lasp_gdn_wy_smem_bytes(int32_t Dk) {
  return LASP_SD_CHUNK * Dk * 2u + 2u * LASP_SD_CHUNK * 4u + LASP_SD_CHUNK * LASP_GDN_TRI_PITCH * 4u;
}

// Output kernel: scalar decay's output loop (lasp_sd_output_smem_bytes), then, from the next
// 1024-byte boundary, the values step's (lasp/gated_delta/values.cuh): STAGES x (I + L)^{-1} tiles,
// the bf16 tile of diag(beta) (V - diag(e^b) K S_n), and STAGES x 64 betas. The summary kernel runs
// the loop without Q (lasp_sd_update_smem_bytes): 106 KiB at Dk = 128, two CTAs per SM.
LASP_GDN_FN uint32_t lasp_gdn_values_offset(int32_t Dk, int32_t with_q) {
  return ((with_q ? lasp_sd_output_smem_bytes(Dk) : lasp_sd_update_smem_bytes(Dk)) + 1023u) / 1024u * 1024u;
}
LASP_GDN_FN uint32_t lasp_gdn_values_smem_bytes(int32_t Dk, int32_t with_q) {
  const uint32_t tile = LASP_SD_CHUNK * LASP_SD_CHUNK * 2u;
  return lasp_gdn_values_offset(Dk, with_q) + LASP_SD_STAGES * tile + tile + LASP_SD_STAGES * LASP_SD_CHUNK * 4u;
}
LASP_GDN_FN uint32_t lasp_gdn_output_smem_bytes(int32_t Dk) { return lasp_gdn_values_smem_bytes(Dk, 1); }
LASP_GDN_FN uint32_t lasp_gdn_summary_smem_bytes(int32_t Dk) { return lasp_gdn_values_smem_bytes(Dk, 0); }

// Output kernel with roles (lasp/gated_delta/roles.cuh): scalar decay's two-role loop at
// LASP_GDN_ROLES_STAGES stages (Q, K, V tile, gates; two bf16 state copies) and an 8-byte mbarrier
// per stage, then from the next 1024-byte boundary the WY form's tiles: three (I + L)^{-1} slots,
// T_u and the scaled u (bf16 [64 x 64] each), -W (bf16 [64 x Dk]), the O tile's staging (bf16
// [64 x 64]), three slots of betas, and a gate box per stage (fp32 [64 tokens x
// LASP_GDN_GATE_BOX_HEADS heads]).
LASP_GDN_FN uint32_t lasp_gdn_roles_smem_bytes(int32_t Dk) {
  const uint32_t tile = LASP_SD_CHUNK * LASP_SD_CHUNK * 2u;
  const uint32_t stage = 2u * LASP_SD_CHUNK * Dk * 2u + LASP_SD_CHUNK * LASP_SD_TILE_V * 2u;
  const uint32_t loop = LASP_GDN_ROLES_STAGES * stage + 2u * Dk * LASP_SD_TILE_V * 2u +
                        LASP_GDN_ROLES_STAGES * LASP_SD_CHUNK * 4u + 8u * LASP_GDN_ROLES_STAGES;
  return (loop + 1023u) / 1024u * 1024u + 6u * tile + LASP_SD_CHUNK * Dk * 2u + 3u * LASP_SD_CHUNK * 4u +
         LASP_GDN_ROLES_STAGES * LASP_SD_CHUNK * LASP_GDN_GATE_BOX_HEADS * 4u;
}

// The roles kernel's parameters: the forward's, the tensor maps of q, k and v its copies read
// through and of o its copies write through, and where gates_by_tma is 1 the map of g (fp32 [B, T,
// H] in boxes of 64 tokens x LASP_GDN_GATE_BOX_HEADS heads: H must be a multiple of it and g
// 16-byte aligned); else each role reads the gates from global memory itself.
typedef struct {
  lasp_gated_delta_params p;
  lasp_tensor_map q, k, v, o, g;
  int32_t gates_by_tma;
} lasp_gdn_roles_params;
