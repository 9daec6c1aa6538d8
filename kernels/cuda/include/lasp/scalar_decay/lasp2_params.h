// Parameters, symmetric-buffer layouts and launch geometry of the LASP-2 forward with scalar decay
// (scalar_decay/lasp2_forward.cu). C: bindgen generates the host's struct and constants from this file
// (kernels/build.rs); keep the helpers in sync with their Rust port (core/src/ops/scalar_decay/lasp2/mod.rs,
// `geometry`). Design, protocol and host sequence: kernels/docs/lasp2.md.
//
// Maths (kernels/docs/maths.md, "LASP-2: forward"), per (b, h), PE `me` of `npes` holding T_local tokens:
//   M_me = local end state from a ZERO start (fp32 [Dk, Dv]),  Lambda_me = sum_t a_t over the shard
//   P_0 = h0 (or 0);  P_{u+1} = e^{Lambda_u} P_u + M_u  (fp32, ascending u < me)
//   outputs of the shard = the single-GPU forward started from P_me; the final state of the whole
//   sequence (PE npes-1 only) = the state after the shard's last token = e^{Lambda_me} P_me + M_me.
//
// Head groups: the B*H heads are cut into G contiguous groups (the host's plan; G = 1 is the plain
// sequence). Every kernel below covers one group: grid z (states, output) or y (fold_put) spans
// the group's heads and `bh_begin` is its first head. Per head the arithmetic does not depend on
// G, so every G gives the same bits. Groups let the exchange of group g overlap the compute of
// group g + 1 (host schedule in kernels/docs/lasp2.md, "Schedule").
//
// Host call sequence per layer call (S = num_segments of this PE, the same for every group):
//   for g = 0 .. G-1:
//     1. lasp_lasp2_states_dk{64,128}  grid lasp2_states_grid(group heads, Dv, S), block LASP2_THREADS,
//                                      smem lasp2_states_smem_bytes(Dk)
//     1b. if S > 1: lasp_lasp2_segment_prefix  grid lasp2_fold_put_grid(group heads, Dv),
//                                      block LASP2_FOLD_THREADS, smem 0 (main stream, before 3)
//     2. lasp_lasp2_fold_put           grid lasp2_fold_put_grid(group heads, Dv), block LASP2_FOLD_THREADS,
//                                      smem 0 (LASP2_DEVICE_PUT / NO_COMM: on a second stream that
//                                      waits for 1 of the same group, so it overlaps the next kernels)
//   2b. LASP2_HOST_GATHERED only:      all-gather of slot half [epoch & 1] (lasp2_gather_* helpers)
//   for g = 0 .. G-1:
//     3. lasp_lasp2_output_dk{64,128}  grid lasp2_output_grid(group heads, Dv, S), block LASP2_THREADS,
//                                      smem lasp2_output_smem_bytes(Dk)
//   4. lasp_lasp2_advance_epoch        grid (1, 1, 1), block (1, 1, 1), smem 0, after every kernel above
//                                      (the second stream joined back first)
// All take the same lasp_lasp2_params by value (bh_begin set per group). The two big kernels need
// cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) once (> 48 KiB).
// Every kernel of a call uses epoch = *epoch + 1 (device memory, so a captured graph replays) and
// slot/signal parity = epoch & 1; kernel 4 then stores the new epoch.
//
// Supported: Dk in {64, 128}; Dv a positive multiple of 64; T_local >= 1 (may differ between PEs;
// B, H, Dk, Dv, npes must be equal on every PE: they fix the symmetric layouts); B*H in [1, 65535];
// q, k, v, o 16-byte aligned; h0, ht, workspace, slots 16-byte aligned; g finite and <= 0.
// Same inputs -> bitwise same outputs in every exchange mode (no atomics; every fold has a fixed order).
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/scalar_decay/forward_params.h"
#include "lasp/wait_diagnostics.h"

#define LASP2_CHUNK LASP_SD_CHUNK      // 64 tokens per chunk
#define LASP2_THREADS LASP_SD_THREADS  // 128: states and output kernels
#define LASP2_FOLD_THREADS 512         // fold_put, segment_prefix
#define LASP2_FOLD_BATCH 4             // segments whose loads a fold issues together
#define LASP2_SLOT_TRAILER_FLOATS 4    // after a tile's Dk*64 floats: [0] = Lambda, [1..3] = 0

typedef struct {
  const uint16_t* q;          // bf16 [B, T, H, Dk] (T = this PE's T_local), contiguous
  const uint16_t* k;          // bf16 [B, T, H, Dk]
  const uint16_t* v;          // bf16 [B, T, H, Dv]
  const float* g;             // fp32 [B, T, H]: per-token log-decay a_t <= 0 (natural log)
  uint16_t* o;                // bf16 [B, T, H, Dv]: output of this shard
  const float* h0;            // fp32 [B, H, Dk, Dv] or NULL. Ascending: the global initial state (the same on
                              // every PE). Descending: the chain's start (dht), on position 0 only
  float* ht;                  // fp32 [B, H, Dk, Dv] final state, or NULL; written only if write_final_state
  float* ws_m;                // device fp32 [B*H, S, Dk, Dv]: end state M_s of segment s from zero
  float* ws_lambda;           // device fp32 [B*H, S]: log-decay Lambda_s of segment s
  float* ws_p;                // device fp32 [B*H, S, Dk, Dv]: slot s < S-1 = L_{s+1}, the fold of segments
                              // 0..s from ZERO (the shard-local prefix at segment s+1's start)
  float* slots;               // SYMMETRIC fp32 [2][npes][B*H][Dv/64][Dk*64 + 4] (lasp2_slots_bytes):
                              // tile [parity][u][bh][vt] = (M_u tile row-major [Dk][64], Lambda_u, 0, 0, 0)
  uint64_t* signals;          // SYMMETRIC u64 [2][npes][B*H*(Dv/64)] (lasp2_signals_count): word
                              // [parity][u][bh*ntiles + vt] on PE p = the epoch of u's tile that landed in p's slot
  uint64_t* credit;           // SYMMETRIC u64 [npes]: credit[r] on PE w = the last epoch reader r has
                              // finished reading, so w may overwrite r's copy of parity e & 1 at e + 2
  uint64_t* epoch;            // device u64, 1 word: the last completed epoch (starts at 0)
  lasp_wait_diag* diag;       // device: the first expired bounded wait (reset by the host after a failure)
  uint64_t* timeline;         // device u64 [lasp2_timeline_words], or NULL: %globaltimer stamps of the call
  lasp2_link_emulation* link; // device: emulated links (lasp/exchange/chain_params.h), or NULL
                              // (layout at lasp2_timeline_put / lasp2_timeline_output)
  float* start_state;         // fp32 [B, H, Dk, Dv], or NULL: the state this PE's shard starts from, after
                              // the fold of the earlier PEs' tiles (output kernel: P_me, which the
                              // backward's dq pass starts from; carry_in kernel: the folded carry)
  uint64_t timeout_ns;        // bound on every wait (credit, data)
  int32_t B;                  // batch
  int32_t T;                  // T_local: tokens of this PE's shard (>= 1)
  int32_t H;                  // heads
  int32_t Dk;                 // 64 or 128 (must match the kernel's suffix)
  int32_t Dv;                 // multiple of 64
  int32_t num_segments;       // S >= 1 for this PE: lasp_sd_num_segments(B, H, T, Dv, target_ctas)
  int32_t chunks_per_segment; // lasp_sd_chunks_per_segment(T, S)
  float scale;                // sigma, usually Dk^-1/2
  int32_t me;                 // this PE (shard index: PE u holds the u-th slice of every sequence)
  int32_t npes;               // PEs taking part (>= 1)
  int32_t exchange_mode;      // enum lasp2_exchange_mode; the same on every PE in a call
  int32_t write_final_state;  // 1: this PE writes ht (set it on PE npes-1 only), 0: never
  int32_t bh_begin;           // first b*H+h of this launch's head group: a launch covers heads
                              // [bh_begin, bh_begin + its grid's head extent) (see "Head groups")
  int32_t chain;              // enum lasp2_chain: which way the tiles travel
} lasp_lasp2_params;

#ifdef __cplusplus
static_assert(sizeof(lasp_lasp2_params) == 208, "lasp_lasp2_params layout changed");
#endif

// ---- Symmetric buffers: the exchange's layouts (lasp/exchange/chain_params.h) at this family's tile

// Floats of one exchanged tile: the [Dk][64] block of M_u and the 4-float trailer (Lambda_u at [0]).
// (Dk*64 + 4) * 4 bytes is a multiple of 16, so every tile starts 16-byte aligned.
LASP2_FN uint64_t lasp2_slot_tile_floats(int32_t Dk) {
  return (uint64_t)Dk * LASP2_TILE_V + LASP2_SLOT_TRAILER_FLOATS;
}

// ---- Per-PE workspace (plain device memory): ws_m at byte 0, ws_lambda at lasp2_ws_lambda_offset,
// ws_p at lasp2_ws_p_offset ----------------------------------------------------------------------

LASP2_FN uint64_t lasp2_ws_m_bytes(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * (uint64_t)S * Dk * Dv * 4u;
}
LASP2_FN uint64_t lasp2_ws_lambda_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return lasp2_ws_m_bytes(B, H, S, Dk, Dv);
}
// 16-byte aligned (the prefix kernel moves float4s).
LASP2_FN uint64_t lasp2_ws_p_offset(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return (lasp2_ws_m_bytes(B, H, S, Dk, Dv) + (uint64_t)B * H * (uint64_t)S * 4u + 15u) / 16u * 16u;
}
LASP2_FN uint64_t lasp2_workspace_bytes(int32_t B, int32_t H, int32_t S, int32_t Dk, int32_t Dv) {
  return lasp2_ws_p_offset(B, H, S, Dk, Dv) + lasp2_ws_m_bytes(B, H, S, Dk, Dv);
}

// ---- Launch geometry ----------------------------------------------------------------------------

// Segments per (b, h) of this PE: the single-GPU policy on the local shard (T = T_local).
LASP2_FN int32_t lasp2_num_segments(int32_t B, int32_t H, int32_t T_local, int32_t Dv, int32_t target_ctas) {
  return lasp_sd_num_segments(B, H, T_local, Dv, target_ctas);
}
LASP2_FN int32_t lasp2_chunks_per_segment(int32_t T_local, int32_t S) {
  return lasp_sd_chunks_per_segment(T_local, S);
}

// All S segments (the last one's end state is part of M_me) of the group's `heads` heads. Always
// launched, also for S == 1.
LASP2_FN lasp2_dim3 lasp2_states_grid(int32_t heads, int32_t Dv, int32_t S) {
  lasp2_dim3 d = {(uint32_t)lasp2_num_vtiles(Dv), (uint32_t)S, (uint32_t)heads};
  return d;
}
// One CTA per (Dv tile, head of the group): folds the segments, writes the own slot tile, puts it.
LASP2_FN lasp2_dim3 lasp2_fold_put_grid(int32_t heads, int32_t Dv) {
  lasp2_dim3 d = {(uint32_t)lasp2_num_vtiles(Dv), (uint32_t)heads, 1u};
  return d;
}
// One CTA per (Dv tile, segment, head of the group), as the single-GPU output kernel.
LASP2_FN lasp2_dim3 lasp2_output_grid(int32_t heads, int32_t Dv, int32_t S) {
  lasp2_dim3 d = {(uint32_t)lasp2_num_vtiles(Dv), (uint32_t)S, (uint32_t)heads};
  return d;
}

LASP2_FN uint32_t lasp2_states_smem_bytes(int32_t Dk) { return lasp_sd_states_smem_bytes(Dk); }
LASP2_FN uint32_t lasp2_output_smem_bytes(int32_t Dk) { return lasp_sd_output_smem_bytes(Dk); }
// The backward's carry_in (scalar_decay/lasp2_backward.cu; grid lasp2_fold_put_grid, block LASP2_THREADS): two staged
// slot tiles of Dk rows padded to 72 floats, and their 16-byte trailers (exchange/chain.cuh).
LASP2_FN uint32_t lasp2_carry_in_smem_bytes(int32_t Dk) { return 2u * ((uint32_t)Dk * 72u * 4u + 16u); }
