// Parameters, symmetric-buffer layouts and launch geometry of the LASP-2 forward with scalar decay
// (lasp2_fwd.cu). C layout, mirrored by a #[repr(C)] Rust struct: keep field order, types and the
// helpers in sync. Design, protocol and host sequence: kernels/cuda/LASP2_NOTES.md.
//
// Maths (research/kernel-anchors.md §5.4), per (b, h), PE `me` of `npes` holding T_local tokens:
//   M_me = local end state from a ZERO start (fp32 [Dk, Dv]),  Lambda_me = sum_t a_t over the shard
//   P_0 = h0 (or 0);  P_{u+1} = e^{Lambda_u} P_u + M_u  (fp32, ascending u < me)
//   outputs of the shard = the single-GPU forward started from P_me; the final state of the whole
//   sequence (PE npes-1 only) = the state after the shard's last token = e^{Lambda_me} P_me + M_me.
//
// Segments: the output kernel cuts each shard into S segments of whole chunks (S from the
// single-GPU policy, for its CTAs per SM); the states kernel cuts every segment further into
// `splits` = chunks_per_segment / chunks_per_state_segment state segments of whole chunks, so it
// runs S_st = state_segments CTAs per Dv tile, in several waves when splits > 1. Its CTAs run tile
// by tile (grid x = Dv tile, y = state segment, z = b*H+h: a tile's CTAs are adjacent in launch
// order), so tiles finish one wave after another: the last CTA of a tile folds the tile's state
// segments, writes the own slot and the output segments' prefixes, and puts the tile to the later
// PEs at once, while the next waves still compute. Only the last wave's puts remain after the
// states pass (the exchange no longer waits for a separate kernel or for SMs).
//
// Host call sequence per layer call:
//   1. lasp_lasp2_states_dk{64,128}  grid lasp2_states_grid(B*H, Dv, S_st), block LASP2_THREADS,
//                                    smem lasp2_states_smem_bytes(Dk)
//   1b. LASP2_HOST_GATHERED only:    all-gather of slot half [epoch & 1] (lasp2_gather_* helpers)
//   2. lasp_lasp2_output_dk{64,128}  grid lasp2_output_grid(B*H, Dv, S), block LASP2_THREADS,
//                                    smem lasp2_output_smem_bytes(Dk)
//   3. lasp_lasp2_advance_epoch      grid (1, 1, 1), block (1, 1, 1), smem 0
// All on one stream, all taking the same lasp_lasp2_params by value. The two big kernels need
// cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem) once (> 48 KiB).
// Every kernel of a call uses epoch = *epoch + 1 (device memory, so a captured graph replays) and
// slot/signal parity = epoch & 1; kernel 3 then stores the new epoch.
//
// Supported: Dk in {64, 128}; Dv a positive multiple of 64; T_local >= 1 (may differ between PEs;
// B, H, Dk, Dv, npes must be equal on every PE: they fix the symmetric layouts); B*H in [1, 65535];
// q, k, v, o 16-byte aligned; h0, ht, workspace, slots 16-byte aligned; g finite and <= 0.
// Same inputs -> bitwise same outputs in every exchange mode (the arrival counter only picks which
// CTA folds a tile; every fold has a fixed order).
#pragma once
#include <stdint.h>

#include "lasp/scalar_decay_params.h"
#include "lasp/wait_diagnostics.h"

#if defined(__CUDACC__)
#define LASP2_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP2_FN static inline constexpr
#else
#define LASP2_FN static inline
#endif

#define LASP2_CHUNK LASP_SD_CHUNK      // 64 tokens per chunk
#define LASP2_TILE_V LASP_SD_TILE_V    // 64 Dv columns per CTA / per exchanged tile
#define LASP2_THREADS LASP_SD_THREADS  // 128: states and output kernels
#define LASP2_SLOT_TRAILER_FLOATS 4    // after a tile's Dk*64 floats: [0] = Lambda, [1..3] = 0

// Where the output kernel's (M_u, Lambda_u) tiles for u < me come from (same fold in every mode).
enum lasp2_exchange_mode {
  LASP2_NO_COMM = 0,        // no NVSHMEM call at all (no credits, puts or waits): folds whatever the
                            // slots hold; for timing the same kernels without communication
  LASP2_DEVICE_PUT = 1,     // a tile's last states CTA puts it to every later PE with a signal;
                            // the output kernel waits for the signals
  LASP2_HOST_GATHERED = 2,  // the host all-gathers slot half [parity] between states and output
};

typedef struct {
  const uint16_t* q;          // bf16 [B, T, H, Dk] (T = this PE's T_local), contiguous
  const uint16_t* k;          // bf16 [B, T, H, Dk]
  const uint16_t* v;          // bf16 [B, T, H, Dv]
  const float* g;             // fp32 [B, T, H]: per-token log-decay a_t <= 0 (natural log)
  uint16_t* o;                // bf16 [B, T, H, Dv]: output of this shard
  const float* h0;            // fp32 [B, H, Dk, Dv] global initial state (the same on every PE), or NULL
  float* ht;                  // fp32 [B, H, Dk, Dv] final state, or NULL; written only if write_final_state
  float* ws_m;                // device fp32 [B*H, S_st, Dk, Dv]: end state of state segment s from zero
  float* ws_lambda;           // device fp32 [B*H*Dv/64, S_st]: log-decay of state segment s, one row per
                              // tile (each tile's CTAs write their own row: no cross-tile reads)
  float* ws_p;                // device fp32 [B*H, S, Dk, Dv]: slot j-1 = L_j, the fold from ZERO of the
                              // state segments before output segment j (its shard-local prefix), j >= 1
  float* ws_lambda_p;         // device fp32 [B*H*Dv/64, S]: slot j-1 = the log-decay before output segment j
  uint32_t* arrivals;         // device u32 [B*H*Dv/64] (lasp2_arrivals_count), zero when allocated: states CTAs
                              // of the tile done in this call; the tile's last CTA resets it to 0
  float* slots;               // SYMMETRIC fp32 [2][npes][B*H][Dv/64][Dk*64 + 4] (lasp2_slots_bytes):
                              // tile [parity][u][bh][vt] = (M_u tile row-major [Dk][64], Lambda_u, 0, 0, 0)
  uint64_t* signals;          // SYMMETRIC u64 [2][npes][B*H*(Dv/64)] (lasp2_signals_count): word
                              // [parity][u][bh*ntiles + vt] on PE p = the epoch of u's tile that landed in p's slot
  uint64_t* credit;           // SYMMETRIC u64 [npes]: credit[r] on PE w = the last epoch reader r has
                              // finished reading, so w may overwrite r's copy of parity e & 1 at e + 2
  uint64_t* epoch;            // device u64, 1 word: the last completed epoch (starts at 0)
  lasp_wait_diag* diag;       // device: the first expired bounded wait (reset by the host after a failure)
  uint64_t* timeline;         // device u64 [lasp2_timeline_words], or NULL: %globaltimer stamps of the call
                              // (layout at lasp2_timeline_put / lasp2_timeline_output)
  uint64_t timeout_ns;        // bound on every wait (credit, data)
  int32_t B;                  // batch
  int32_t T;                  // T_local: tokens of this PE's shard (>= 1)
  int32_t H;                  // heads
  int32_t Dk;                 // 64 or 128 (must match the kernel's suffix)
  int32_t Dv;                 // multiple of 64
  int32_t num_segments;       // S >= 1 output segments for this PE: lasp_sd_num_segments(B, H, T, Dv, target)
  int32_t chunks_per_segment; // lasp_sd_chunks_per_segment(T, S)
  int32_t state_segments;     // S_st: lasp2_state_segments(T, chunks_per_state_segment)
  int32_t chunks_per_state_segment;  // chunks_per_segment / splits (a divisor of chunks_per_segment)
  float scale;                // sigma, usually Dk^-1/2
  int32_t me;                 // this PE (shard index: PE u holds the u-th slice of every sequence)
  int32_t npes;               // PEs taking part (>= 1)
  int32_t exchange_mode;      // enum lasp2_exchange_mode; the same on every PE in a call
  int32_t write_final_state;  // 1: this PE writes ht (set it on PE npes-1 only), 0: never
} lasp_lasp2_params;

#ifdef __cplusplus
static_assert(sizeof(lasp_lasp2_params) == 208, "lasp_lasp2_params layout changed: update the Rust mirror");
#endif

typedef struct {
  uint32_t x, y, z;
} lasp2_dim3;

LASP2_FN int32_t lasp2_num_vtiles(int32_t Dv) { return Dv / LASP2_TILE_V; }

// ---- Symmetric buffers (identical sizes and offsets on every PE) -------------------------------

// Floats of one exchanged tile: the [Dk][64] block of M_u and the 4-float trailer (Lambda_u at [0]).
// (Dk*64 + 4) * 4 bytes is a multiple of 16, so every tile starts 16-byte aligned.
LASP2_FN uint64_t lasp2_slot_tile_floats(int32_t Dk) {
  return (uint64_t)Dk * LASP2_TILE_V + LASP2_SLOT_TRAILER_FLOATS;
}
// Floats of one PE's slot in one parity: [B*H][Dv/64] tiles.
LASP2_FN uint64_t lasp2_slot_pe_floats(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * lasp2_num_vtiles(Dv) * lasp2_slot_tile_floats(Dk);
}
LASP2_FN uint64_t lasp2_slots_bytes(int32_t npes, int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return 2u * (uint64_t)npes * lasp2_slot_pe_floats(B, H, Dk, Dv) * 4u;
}
// Float offset of tile [parity][pe][bh][vt] in `slots`.
LASP2_FN uint64_t lasp2_slot_tile_offset(int32_t parity, int32_t pe, int32_t bh, int32_t vt, int32_t npes, int32_t B,
                                         int32_t H, int32_t Dk, int32_t Dv) {
  return ((uint64_t)parity * npes + pe) * lasp2_slot_pe_floats(B, H, Dk, Dv) +
         ((uint64_t)bh * lasp2_num_vtiles(Dv) + vt) * lasp2_slot_tile_floats(Dk);
}
// Signal words: [2][npes][B*H*(Dv/64)] u64 (zero before the first call).
LASP2_FN uint64_t lasp2_signals_count(int32_t npes, int32_t B, int32_t H, int32_t Dv) {
  return 2u * (uint64_t)npes * B * H * lasp2_num_vtiles(Dv);
}
LASP2_FN uint64_t lasp2_signal_index(int32_t parity, int32_t pe, int32_t bh, int32_t vt, int32_t npes, int32_t B,
                                     int32_t H, int32_t Dv) {
  return ((uint64_t)parity * npes + pe) * ((uint64_t)B * H * lasp2_num_vtiles(Dv)) +
         (uint64_t)bh * lasp2_num_vtiles(Dv) + vt;
}
// Credit words: [npes] u64 (zero before the first call).
LASP2_FN uint64_t lasp2_credit_count(int32_t npes) { return (uint64_t)npes; }

// LASP2_HOST_GATHERED: after the states kernel, every PE's own slot [parity][me] (lasp2_gather_bytes bytes at
// byte lasp2_gather_send_offset) goes to slot [parity][me] of every PE; the receive region is the
// whole parity half, [npes][per PE] contiguous at byte lasp2_gather_recv_offset. That is exactly an
// in-place all-gather (ncclAllGather(sendbuff = slots + send_offset, recvbuff = slots + recv_offset,
// count = gather_bytes, ncclUint8 or count / 4 with ncclFloat32), or nvshmemx_fcollectmem_on_stream).
LASP2_FN uint64_t lasp2_gather_bytes(int32_t B, int32_t H, int32_t Dk, int32_t Dv) {
  return lasp2_slot_pe_floats(B, H, Dk, Dv) * 4u;
}
LASP2_FN uint64_t lasp2_gather_recv_offset(int32_t parity, int32_t npes, int32_t B, int32_t H, int32_t Dk,
                                           int32_t Dv) {
  return (uint64_t)parity * npes * lasp2_gather_bytes(B, H, Dk, Dv);
}
LASP2_FN uint64_t lasp2_gather_send_offset(int32_t parity, int32_t me, int32_t npes, int32_t B, int32_t H,
                                           int32_t Dk, int32_t Dv) {
  return ((uint64_t)parity * npes + me) * lasp2_gather_bytes(B, H, Dk, Dv);
}

// ---- Timeline (optional, per PE, plain device memory) -----------------------------------------
// Nanosecond %globaltimer stamps of one call, to show when the exchange lands relative to when the
// output CTAs need it (stamps of different GPUs come from different clocks: compare within a PE).
// Tile i = bh * (Dv/64) + vt.
//   put stamps, 2 per tile: [0] the tile's last states CTA is about to put (credits granted),
//                           [1] its puts quiet'ed
//   output stamps, 3 per (tile, segment s): [0] CTA start, [1] earlier PEs' tiles seen (signals),
//                                           [2] prologue done: the chunk loop starts from P
#define LASP2_TIMELINE_PUT_STAMPS 2
#define LASP2_TIMELINE_OUTPUT_STAMPS 3
LASP2_FN uint64_t lasp2_timeline_put(int32_t bh, int32_t vt, int32_t Dv) {
  return ((uint64_t)bh * lasp2_num_vtiles(Dv) + vt) * LASP2_TIMELINE_PUT_STAMPS;
}
LASP2_FN uint64_t lasp2_timeline_output(int32_t bh, int32_t vt, int32_t s, int32_t B, int32_t H, int32_t Dv,
                                        int32_t S) {
  return (uint64_t)B * H * lasp2_num_vtiles(Dv) * LASP2_TIMELINE_PUT_STAMPS +
         (((uint64_t)bh * lasp2_num_vtiles(Dv) + vt) * S + s) * LASP2_TIMELINE_OUTPUT_STAMPS;
}
LASP2_FN uint64_t lasp2_timeline_words(int32_t B, int32_t H, int32_t Dv, int32_t S) {
  return (uint64_t)B * H * lasp2_num_vtiles(Dv) * (LASP2_TIMELINE_PUT_STAMPS + (uint64_t)S * LASP2_TIMELINE_OUTPUT_STAMPS);
}

// ---- Per-PE buffers (plain device memory) -------------------------------------------------------
// The arrival counters live in their own buffer: the workspace's offsets change with the plan, the
// counters must stay zero between calls whatever the plan.
// Workspace, in this order, each part 16-byte aligned (contents need no initialisation):
// ws_m [B*H][S_st][Dk][Dv], ws_p [B*H][S][Dk][Dv], ws_lambda [tiles][S_st], ws_lambda_p [tiles][S].

LASP2_FN uint64_t lasp2_align16(uint64_t bytes) { return (bytes + 15u) / 16u * 16u; }
LASP2_FN uint64_t lasp2_ws_states_bytes(int32_t B, int32_t H, int32_t segments, int32_t Dk, int32_t Dv) {
  return (uint64_t)B * H * (uint64_t)segments * Dk * Dv * 4u;
}
LASP2_FN uint64_t lasp2_ws_tiles(int32_t B, int32_t H, int32_t Dv) { return (uint64_t)B * H * lasp2_num_vtiles(Dv); }
LASP2_FN uint64_t lasp2_ws_p_offset(int32_t B, int32_t H, int32_t S_st, int32_t Dk, int32_t Dv) {
  return lasp2_ws_states_bytes(B, H, S_st, Dk, Dv);
}
LASP2_FN uint64_t lasp2_ws_lambda_offset(int32_t B, int32_t H, int32_t S, int32_t S_st, int32_t Dk, int32_t Dv) {
  return lasp2_ws_p_offset(B, H, S_st, Dk, Dv) + lasp2_ws_states_bytes(B, H, S, Dk, Dv);
}
LASP2_FN uint64_t lasp2_ws_lambda_p_offset(int32_t B, int32_t H, int32_t S, int32_t S_st, int32_t Dk, int32_t Dv) {
  return lasp2_ws_lambda_offset(B, H, S, S_st, Dk, Dv) + lasp2_align16(lasp2_ws_tiles(B, H, Dv) * S_st * 4u);
}
LASP2_FN uint64_t lasp2_workspace_bytes(int32_t B, int32_t H, int32_t S, int32_t S_st, int32_t Dk, int32_t Dv) {
  return lasp2_ws_lambda_p_offset(B, H, S, S_st, Dk, Dv) + lasp2_align16(lasp2_ws_tiles(B, H, Dv) * S * 4u);
}
LASP2_FN uint64_t lasp2_arrivals_count(int32_t B, int32_t H, int32_t Dv) { return lasp2_ws_tiles(B, H, Dv); }

// ---- Launch geometry ----------------------------------------------------------------------------

// Output segments per (b, h) of this PE: the single-GPU policy on the local shard (T = T_local).
LASP2_FN int32_t lasp2_num_segments(int32_t B, int32_t H, int32_t T_local, int32_t Dv, int32_t target_ctas) {
  return lasp_sd_num_segments(B, H, T_local, Dv, target_ctas);
}
LASP2_FN int32_t lasp2_chunks_per_segment(int32_t T_local, int32_t S) {
  return lasp_sd_chunks_per_segment(T_local, S);
}
// Chunks per state segment for up to `splits` state segments per output segment: the largest
// divisor of chunks_per_segment that cuts it into at most `splits` parts (so the state segments
// nest in the output segments and none is empty).
LASP2_FN int32_t lasp2_chunks_per_state_segment(int32_t chunks_per_segment, int32_t splits) {
  int32_t k = splits < 1 ? 1 : splits;
  if (k > chunks_per_segment) k = chunks_per_segment;
  while (chunks_per_segment % k != 0) --k;
  return chunks_per_segment / k;
}
LASP2_FN int32_t lasp2_state_segments(int32_t T_local, int32_t chunks_per_state_segment) {
  return (lasp_sd_num_chunks(T_local) + chunks_per_state_segment - 1) / chunks_per_state_segment;
}

// Every state segment (the last one's end state is part of M_me). Always launched, also for S == 1.
LASP2_FN lasp2_dim3 lasp2_states_grid(int32_t heads, int32_t Dv, int32_t S_st) {
  lasp2_dim3 d = {(uint32_t)lasp2_num_vtiles(Dv), (uint32_t)S_st, (uint32_t)heads};
  return d;
}
// One CTA per (Dv tile, output segment, head), as the single-GPU output kernel.
LASP2_FN lasp2_dim3 lasp2_output_grid(int32_t heads, int32_t Dv, int32_t S) {
  lasp2_dim3 d = {(uint32_t)lasp2_num_vtiles(Dv), (uint32_t)S, (uint32_t)heads};
  return d;
}

LASP2_FN uint32_t lasp2_states_smem_bytes(int32_t Dk) { return lasp_sd_states_smem_bytes(Dk); }
LASP2_FN uint32_t lasp2_output_smem_bytes(int32_t Dk) { return lasp_sd_output_smem_bytes(Dk); }
