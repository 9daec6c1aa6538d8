// The exchange's device-side contract, the same for every family: exchange modes, the chain (the
// order in which PEs fold each other's summaries), and the symmetric layouts of slots, signals and
// credits, plus the optional timeline. A family's LASP-2 params struct (e.g.
// lasp/scalar_decay/lasp2_params.h) carries the fields that lasp/exchange/chain.cuh reads:
// slots, signals, credit, epoch, diag, timeline, link, timeout_ns, B, H, Dv, me, npes, exchange_mode,
// chain. Protocol: kernels/docs/lasp2.md.
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define LASP2_FN static inline constexpr __host__ __device__
#elif defined(__cplusplus)
#define LASP2_FN static inline constexpr
#else
#define LASP2_FN static inline
#endif

#define LASP2_TILE_V 64  // Dv columns of one exchanged tile (and of one compute CTA)

// Where the output kernel's (M_u, Lambda_u) tiles for u < me come from (same fold in every mode).
enum lasp2_exchange_mode {
  LASP2_NO_COMM = 0,        // no NVSHMEM call at all (no credits, puts or waits): folds whatever the
                            // slots hold; for timing the same kernels without communication
  LASP2_DEVICE_PUT = 1,     // fold_put puts its tile to every later PE with a signal; output waits
  LASP2_HOST_GATHERED = 2,  // the host all-gathers slot half [parity] between fold_put and output
  LASP2_DEVICE_CHAIN = 3,   // the pipelined chain: each summary kernel waits for its predecessor's
                            // prefix, folds its own summary in and puts the result to its successor;
                            // the output waits for that one tile (lasp/exchange/chain.cuh, Exchange)
};

// ---- The chain: the order in which PEs fold each other's tiles -------------------------------
// Position 0 is the chain's first PE; the PE at position i folds the tiles of positions 0 .. i-1,
// in that order, and puts its own tile to positions i+1 .. npes-1. Slots and signals stay indexed
// by the sending PE's number (so the host all-gather of the sequential modes is the same for
// both chains), credits by the reading PE's.
enum lasp2_chain {
  LASP2_CHAIN_ASCENDING = 0,   // the forward: PE u's (M_u, Lambda_u) to every later PE; position = PE
  LASP2_CHAIN_DESCENDING = 1,  // the backward (scalar_decay/lasp2_backward.cu): the gradient's carry to every EARLIER PE;
                               // position = npes - 1 - PE
};
// The position of PE `pe`, and the PE at position `pos` (the same map: it is an involution).
LASP2_FN int32_t lasp2_chain_position(int32_t chain, int32_t pe, int32_t npes) {
  return chain == LASP2_CHAIN_DESCENDING ? npes - 1 - pe : pe;
}
LASP2_FN int32_t lasp2_chain_pe(int32_t chain, int32_t pos, int32_t npes) {
  return lasp2_chain_position(chain, pos, npes);
}

// ---- Emulated links (optional): InfiniBand's rates on NVLink hardware ------------------------
// For measuring the schedules across nodes on one node. The PEs form emulated nodes of
// `gpus_per_node` consecutive PEs; a PE's puts to PEs of another node pass through one emulated
// NIC per PE: each summary tile's bytes to those readers occupy it for bytes x ps_per_byte, after
// whatever it was sending, and its signals go out `latency_ns` after that transfer ends. The data
// itself still moves over NVLink at once, so only the signals, which readers wait for, are held:
// a reader sees a tile when the emulated link would have delivered it. The sending CTA holds its
// SM meanwhile, as a CTA does whose quiet waits for a NIC. Egress only: in LASP-2's all-gather
// the first PE's egress, (W - 1) tiles, is also the last PE's ingress, and a chain sends one tile
// per hop. Credits and puts within a node are not held. NULL `link` in the params: real links.
typedef struct {
  uint64_t free_at_ns;   // device-mutable: the %globaltimer when this PE's emulated NIC is next idle
  uint64_t latency_ns;   // added to every transfer to another node
  uint64_t ps_per_byte;  // 1e12 / the NIC's bytes per second (25 GB/s: 40, 50 GB/s: 20)
  int32_t gpus_per_node;  // >= 1
  int32_t reserved;      // 0
} lasp2_link_emulation;

// Whether PEs a and b sit on the same emulated node.
LASP2_FN int32_t lasp2_same_node(int32_t gpus_per_node, int32_t a, int32_t b) {
  return a / gpus_per_node == b / gpus_per_node;
}

typedef struct {
  uint32_t x, y, z;
} lasp2_dim3;

LASP2_FN int32_t lasp2_num_vtiles(int32_t Dv) { return Dv / LASP2_TILE_V; }

// ---- Symmetric buffers (identical sizes and offsets on every PE) -------------------------------
// Slots hold one summary tile per (parity, sending PE, head, Dv tile); a family fixes the floats of
// a tile (a multiple of 4, so every tile starts 16-byte aligned) and passes them as `tile_floats`.

// Floats of one PE's slot in one parity: [B*H][Dv/64] tiles.
LASP2_FN uint64_t lasp2_slot_pe_floats(int32_t B, int32_t H, int32_t Dv, uint64_t tile_floats) {
  return (uint64_t)B * H * lasp2_num_vtiles(Dv) * tile_floats;
}
LASP2_FN uint64_t lasp2_slots_bytes(int32_t npes, int32_t B, int32_t H, int32_t Dv, uint64_t tile_floats) {
  return 2u * (uint64_t)npes * lasp2_slot_pe_floats(B, H, Dv, tile_floats) * 4u;
}
// Float offset of tile [parity][pe][bh][vt] in `slots`.
LASP2_FN uint64_t lasp2_slot_tile_offset(int32_t parity, int32_t pe, int32_t bh, int32_t vt, int32_t npes, int32_t B,
                                         int32_t H, int32_t Dv, uint64_t tile_floats) {
  return ((uint64_t)parity * npes + pe) * lasp2_slot_pe_floats(B, H, Dv, tile_floats) +
         ((uint64_t)bh * lasp2_num_vtiles(Dv) + vt) * tile_floats;
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

// LASP2_HOST_GATHERED: after fold_put, every PE's own slot [parity][me] (lasp2_gather_bytes bytes at
// byte lasp2_gather_send_offset) goes to slot [parity][me] of every PE; the receive region is the
// whole parity half, [npes][per PE] contiguous at byte lasp2_gather_recv_offset. That is exactly an
// in-place all-gather (ncclAllGather(sendbuff = slots + send_offset, recvbuff = slots + recv_offset,
// count = gather_bytes, ncclUint8 or count / 4 with ncclFloat32), or nvshmemx_fcollectmem_on_stream).
LASP2_FN uint64_t lasp2_gather_bytes(int32_t B, int32_t H, int32_t Dv, uint64_t tile_floats) {
  return lasp2_slot_pe_floats(B, H, Dv, tile_floats) * 4u;
}
LASP2_FN uint64_t lasp2_gather_recv_offset(int32_t parity, int32_t npes, int32_t B, int32_t H, int32_t Dv,
                                           uint64_t tile_floats) {
  return (uint64_t)parity * npes * lasp2_gather_bytes(B, H, Dv, tile_floats);
}
LASP2_FN uint64_t lasp2_gather_send_offset(int32_t parity, int32_t me, int32_t npes, int32_t B, int32_t H, int32_t Dv,
                                           uint64_t tile_floats) {
  return ((uint64_t)parity * npes + me) * lasp2_gather_bytes(B, H, Dv, tile_floats);
}

// ---- Timeline (optional, per PE, plain device memory) -----------------------------------------
// Nanosecond %globaltimer stamps of one call, to show when the exchange lands relative to when the
// output CTAs need it (stamps of different GPUs come from different clocks: compare within a PE).
// Tile i = bh * (Dv/64) + vt.
//   put stamps, 2 per tile: [0] fold_put about to put (credits granted), [1] its puts complete, signals issued
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
