// Parameters and launch geometry of the scalar-decay linear-attention forward (scalar_decay/forward.cu).
// C: bindgen generates the host's struct and constants from this file (kernels/build.rs); keep the
// helpers in sync with their Rust port (core/src/ops/scalar_decay/geometry.rs).
//
// Maths (per batch b, head h; row vectors; sigma = scale):
//   S_t = e^{a_t} S_{t-1} + k_t^T v_t,   o_t = sigma q_t S_t,   a_t = g[b, t, h] <= 0 (natural log).
//
// Host call sequence (one stream, in this order; S = num_segments):
//   1. if S > 1: lasp_scalar_decay_states_dk{64,128}  grid lasp_sd_states_grid,  block LASP_SD_THREADS,
//                                                     smem lasp_sd_states_smem_bytes(Dk)
//   2. if S > 1: lasp_scalar_decay_fold                grid lasp_sd_fold_grid,    block LASP_SD_FOLD_THREADS,
//                                                     smem 0
//   3.           lasp_scalar_decay_output_dk{64,128}  grid lasp_sd_output_grid,  block LASP_SD_THREADS,
//                                                     smem lasp_sd_output_smem_bytes(Dk)
//      or, when S == 1 (one CTA per SM keeps every sequence whole):
//                lasp_scalar_decay_output_roles_dk{64,128}  grid lasp_sd_output_grid,
//                                                     block LASP_SD_ROLES_THREADS, smem lasp_sd_roles_smem_bytes(Dk)
// All take lasp_scalar_decay_params by value, the two-role kernel inside lasp_sd_roles_params (with
// tensor maps of q, k, v for its Tensor Memory Accelerator copies). The big kernels need
// cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) once (> 48 KiB).
//
// Supported: Dk in {64, 128}; Dv a positive multiple of 64; T >= 1; B*H in [1, 65535];
// q, k, v, o 16-byte aligned, h0 / ht / workspace 8-byte aligned; g finite and <= 0; scale > 0;
// ht must not overlap h0 (with S > 1 the last segment writes ht while segment 0 may still read h0).
// Same inputs -> bitwise same outputs (no atomics; every sum has a fixed order).
#pragma once
#include <stdint.h>

// Helpers: plain static inline functions in C; constexpr (and host+device under nvcc) in C++, so the
// kernels static_assert their shared-memory maps against the same formulas the host uses.
#if defined(__CUDACC__)
#define LASP_SD_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP_SD_FN static inline constexpr
#else
#define LASP_SD_FN static inline
#endif

#define LASP_SD_CHUNK 64        // tokens per chunk (C)
#define LASP_SD_TILE_V 64       // Dv columns per CTA
#define LASP_SD_THREADS 128     // 4 warps per CTA for the states and output kernels
#ifndef LASP_SD_STAGES
#define LASP_SD_STAGES 2        // cp.async pipeline depth (chunks in flight): 2 lets 2 output CTAs share an SM
                                // and was as fast as 4 at one CTA per SM (measured on H200)
#endif
#define LASP_SD_FOLD_THREADS 256
#define LASP_SD_ROLES_THREADS 288  // two-role output kernel: a state warpgroup, an output warpgroup, a loading warp
#define LASP_SD_ROLES_STAGES 4     // its pipeline depth: one CTA per SM, so it takes 4 chunks in flight
#define LASP_SD_STATES_STAGES 4    // the states kernels' pipeline depth: a stream of K and V, two CTAs per SM
#define LASP_SD_BLOCK_CHUNKS 4     // chunks per block of the backward's gate gradient (scalar_decay/backward.cu)

typedef struct {
  const uint16_t* q;          // bf16 [B, T, H, Dk], contiguous
  const uint16_t* k;          // bf16 [B, T, H, Dk], contiguous
  const uint16_t* v;          // bf16 [B, T, H, Dv], contiguous
  const float* g;             // fp32 [B, T, H]: per-token log-decay a_t <= 0
  uint16_t* o;                // bf16 [B, T, H, Dv]: output
  const float* h0;            // fp32 [B, H, Dk, Dv] initial state, or NULL for zero
  float* ht;                  // fp32 [B, H, Dk, Dv] final state, or NULL to skip
  float* ws_m;                // fp32 [B*H, S-1, Dk, Dv]: local end state M_s of segment s (zero start)
  float* ws_p;                // fp32 [B*H, S-1, Dk, Dv]: slot s holds the prefix P_{s+1} entering segment s+1
  float* ws_lambda;           // fp32 [B*H, S-1]: total log-decay Lambda_s of segment s
  void* block_states;         // [B*H, lasp_sd_num_blocks(T), 4 * Dk * Dv bytes]: the state at the block
                              // boundaries (lasp_sd_block_slot) as bf16 operand tiles of the backward's
                              // gate gradient (lasp::sd::state_store_tiles), written by the backward's dq
                              // and dv passes only (the *_block_states_* kernels); NULL elsewhere
  const int32_t* entry_slots; // [ceil(T / 64)]: per chunk, the packed document whose state entering it
                              // the *_document_entries_* kernels store, or -1 (lasp_document_entry_slots);
                              // NULL elsewhere
  float* document_states;     // fp32 [B, N, H, Dk, Dv]: where they store it (document n of row b)
  int32_t documents;          // N
  int32_t B;                  // batch
  int32_t T;                  // tokens per sequence (>= 1)
  int32_t H;                  // heads
  int32_t Dk;                 // key/query head dim: 64 or 128 (must match the kernel's suffix)
  int32_t Dv;                 // value head dim: multiple of 64
  int32_t num_segments;       // S >= 1: segments of whole chunks per (b, h), from lasp_sd_num_segments
  int32_t chunks_per_segment; // ceil(num_chunks / S), from lasp_sd_chunks_per_segment; no segment empty
  float scale;                // sigma, usually Dk^-1/2
} lasp_scalar_decay_params;

// A CUtensorMap (CUDA 13's cuda.h): 128 opaque bytes, 128-byte aligned, encoded on the host by
// cuTensorMapEncodeTiled and read by the Tensor Memory Accelerator from the kernel's parameters.
#if defined(__cplusplus)
#define LASP_ALIGN_128 alignas(128)
#else
#define LASP_ALIGN_128 _Alignas(128)
#endif
typedef struct {
  LASP_ALIGN_128 uint64_t opaque[16];
} lasp_tensor_map;

// Parameters of the two-role output kernel (lasp_scalar_decay_output_roles_dk*), 768 bytes: the
// forward's parameters and tensor maps of q, k, v (read) and o (written), each viewed as bf16
// [B][T][H][D] (dimensions innermost first: D, H, T, B) with a box of 64 columns x 1 head x 64
// tokens x 1 sequence, 128-byte swizzle, zero fill outside the tensor (the ragged last chunk; o's
// rows there are not written).
typedef struct {
  lasp_scalar_decay_params p;
  lasp_tensor_map q, k, v, o;
} lasp_sd_roles_params;

typedef struct {
  uint32_t x, y, z;
} lasp_sd_dim3;

LASP_SD_FN int32_t lasp_sd_num_chunks(int32_t T) {
  return (T + LASP_SD_CHUNK - 1) / LASP_SD_CHUNK;
}

LASP_SD_FN int32_t lasp_sd_num_vtiles(int32_t Dv) { return Dv / LASP_SD_TILE_V; }

// Blocks of LASP_SD_BLOCK_CHUNKS chunks per sequence (the last may hold fewer). The backward's gate
// gradient meets the two time directions' states at their boundaries.
LASP_SD_FN int32_t lasp_sd_num_blocks(int32_t T) {
  return (lasp_sd_num_chunks(T) + LASP_SD_BLOCK_CHUNKS - 1) / LASP_SD_BLOCK_CHUNKS;
}

// The block_states slot of the state entering loop chunk `chunk` of a pass over a sequence of
// `num_chunks` chunks, or -1. In order, loop chunk c starts at token 64 c, and the state entering
// block j (h0 for j = 0) goes to slot j. Reversed (lasp::sd::TimeAxis), loop chunk c starts at
// token 64 (num_chunks - c), where the state is the gradient with respect to the state after the
// token before it: at the end of block j (for the last block, the end of the sequence: dht) it
// goes to slot j.
LASP_SD_FN int32_t lasp_sd_block_slot(int32_t num_chunks, int32_t chunk, int32_t reversed) {
  if (!reversed) return chunk % LASP_SD_BLOCK_CHUNKS == 0 ? chunk / LASP_SD_BLOCK_CHUNKS : -1;
  const int32_t boundary = num_chunks - chunk;  // in chunks of the tensors
  return (boundary % LASP_SD_BLOCK_CHUNKS == 0 || chunk == 0) && boundary > 0
             ? (boundary + LASP_SD_BLOCK_CHUNKS - 1) / LASP_SD_BLOCK_CHUNKS - 1
             : -1;
}

// Segments per (b, h): enough CTAs of the output kernel (B*H*S*Dv/64) to fill the machine once,
// never a second partial wave, never an empty segment. target_ctas: the host's policy (Rust
// geometry::target_ctas): the multiprocessor count when B*H*Dv/64 fills it, else two per SM
// (2 output CTAs fit an SM with LASP_SD_STAGES 2).
LASP_SD_FN int32_t lasp_sd_num_segments(int32_t B, int32_t H, int32_t T, int32_t Dv, int32_t target_ctas) {
  const int32_t base = B * H * lasp_sd_num_vtiles(Dv);
  const int32_t nc = lasp_sd_num_chunks(T);
  int32_t s = target_ctas / base;
  if (s < 1) s = 1;
  if (s > nc) s = nc;
  const int32_t cps = (nc + s - 1) / s;
  return (nc + cps - 1) / cps;
}

LASP_SD_FN int32_t lasp_sd_chunks_per_segment(int32_t T, int32_t S) {
  const int32_t nc = lasp_sd_num_chunks(T);
  return (nc + S - 1) / S;
}

// Dynamic shared memory: STAGES x (Q, K, V-tile, gates) + 2 bf16 copies of the state tile.
LASP_SD_FN uint32_t lasp_sd_output_smem_bytes(int32_t Dk) {
  const uint32_t stage = 2u * LASP_SD_CHUNK * Dk * 2u + LASP_SD_CHUNK * LASP_SD_TILE_V * 2u + LASP_SD_CHUNK * 4u;
  return LASP_SD_STAGES * stage + 2u * Dk * LASP_SD_TILE_V * 2u;
}

// Dynamic shared memory of the output loop run without O (lasp::sd::run_segment_with, kStoreO =
// false): STAGES x (K, V-tile, gates) + 2 bf16 copies of the state tile.
LASP_SD_FN uint32_t lasp_sd_update_smem_bytes(int32_t Dk) {
  const uint32_t stage = LASP_SD_CHUNK * Dk * 2u + LASP_SD_CHUNK * LASP_SD_TILE_V * 2u + LASP_SD_CHUNK * 4u;
  return LASP_SD_STAGES * stage + 2u * Dk * LASP_SD_TILE_V * 2u;
}

// Dynamic shared memory of the two-role output kernel: ROLES_STAGES x (Q, K, V-tile, gates) + 2 bf16
// copies of the state tile + one 8-byte mbarrier per stage, then from the next 1024-byte boundary
// O's staging tile (bf16 [64 x TILE_V]).
LASP_SD_FN uint32_t lasp_sd_roles_smem_bytes(int32_t Dk) {
  const uint32_t stage = 2u * LASP_SD_CHUNK * Dk * 2u + LASP_SD_CHUNK * LASP_SD_TILE_V * 2u + LASP_SD_CHUNK * 4u;
  const uint32_t loop = LASP_SD_ROLES_STAGES * (stage + 8u) + 2u * Dk * LASP_SD_TILE_V * 2u;
  return (loop + 1023u) / 1024u * 1024u + LASP_SD_CHUNK * LASP_SD_TILE_V * 2u;
}

// Dynamic shared memory: STATES_STAGES x (K, V-tile, gates).
LASP_SD_FN uint32_t lasp_sd_states_smem_bytes(int32_t Dk) {
  const uint32_t stage = LASP_SD_CHUNK * Dk * 2u + LASP_SD_CHUNK * LASP_SD_TILE_V * 2u + LASP_SD_CHUNK * 4u;
  return LASP_SD_STATES_STAGES * stage;
}

// One CTA per (Dv tile, segment, b*H+h); x fastest so the Dv tiles of one (b, h, s) share Q/K in L2.
LASP_SD_FN lasp_sd_dim3 lasp_sd_output_grid(int32_t B, int32_t H, int32_t Dv, int32_t S) {
  lasp_sd_dim3 d = {(uint32_t)lasp_sd_num_vtiles(Dv), (uint32_t)S, (uint32_t)(B * H)};
  return d;
}

// Segments 0..S-2 only (the last segment's end state is never folded). Launch only when S > 1.
LASP_SD_FN lasp_sd_dim3 lasp_sd_states_grid(int32_t B, int32_t H, int32_t Dv, int32_t S) {
  lasp_sd_dim3 d = {(uint32_t)lasp_sd_num_vtiles(Dv), (uint32_t)(S - 1), (uint32_t)(B * H)};
  return d;
}

// One thread per state element (Dk*Dv of them) per b*H+h. Launch only when S > 1.
LASP_SD_FN lasp_sd_dim3 lasp_sd_fold_grid(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  lasp_sd_dim3 d = {(uint32_t)((Dk * Dv + LASP_SD_FOLD_THREADS - 1) / LASP_SD_FOLD_THREADS), (uint32_t)(B * H), 1u};
  return d;
}

// Workspace (one allocation): ws_m at byte 0, ws_p at lasp_sd_ws_p_offset, ws_lambda at
// lasp_sd_ws_lambda_offset. Zero bytes when S == 1 (pass NULL pointers then).
LASP_SD_FN uint64_t lasp_sd_ws_state_bytes(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * (uint64_t)(S - 1) * Dk * Dv * 4u;
}
LASP_SD_FN uint64_t lasp_sd_ws_p_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return lasp_sd_ws_state_bytes(B, H, S, Dk, Dv);
}
LASP_SD_FN uint64_t lasp_sd_ws_lambda_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return 2u * lasp_sd_ws_state_bytes(B, H, S, Dk, Dv);
}
LASP_SD_FN uint64_t lasp_scalar_decay_workspace_bytes(int32_t B, int32_t H, int32_t S, int32_t Dk,
                                                                    int32_t Dv) {
  return 2u * lasp_sd_ws_state_bytes(B, H, S, Dk, Dv) + (uint64_t)B * H * (uint64_t)(S - 1) * 4u;
}
