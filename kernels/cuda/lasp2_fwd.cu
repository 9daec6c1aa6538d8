// LASP-2 forward with scalar decay and a device-initiated state exchange, for sm_90a.
//
// PE `me` of `npes` holds T_local tokens of every sequence. Per (b, h):
//   M_me = local end state from zero, Lambda_me = sum of the shard's log-decays      (kernels 1, 2)
//   (M_me, Lambda_me) goes to every later PE: one put-with-signal per (tile, peer)    (kernel 2)
//   P_me = fold_{u < me} (P = e^{Lambda_u} P + M_u) from h0; segment s starts from
//   e^{Lambda_0 + .. + Lambda_{s-1}} P_me + L_s (L_s = the fold of segments < s from zero,
//   kernel 1b); the chunk loop of the single-GPU output kernel from that start        (kernel 3)
//
// Kernels (geometry, buffers and call order: lasp/lasp2_params.h; protocol: LASP2_NOTES.md):
//   1. lasp_lasp2_states_dk{64,128}  every segment s of the shard: M_s from zero, Lambda_s
//   1b. lasp_lasp2_segment_prefix    per (Dv tile, b*H+h), S > 1: L_1 .. L_{S-1}
//   2. lasp_lasp2_fold_put           per (Dv tile, b*H+h): M_me, Lambda_me into the own slot; credits;
//                                    LASP2_DEVICE_PUT: put the tile + signal to every later PE
//   3. lasp_lasp2_output_dk{64,128}  per (Dv tile, segment, b*H+h): prologue fold, chunk loop, O, ht
//   4. lasp_lasp2_advance_epoch      *epoch += 1
//   (lasp_lasp2_grant_credits: only when a plan switches from LASP2_NO_COMM to a communicating mode)
//
// Only the put / signal API touches remote memory, so the same code runs over NVLink and InfiniBand.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "lasp/lasp2_params.h"
#include "lasp/scalar_decay.cuh"
#include "lasp/wait.cuh"

namespace lasp {
namespace l2 {

using sd::StateLane;
using sd::StateRegs;

// The epoch every kernel of the current call works on (the advance kernel runs last).
__device__ __forceinline__ uint64_t call_epoch(const lasp_lasp2_params& p) { return *p.epoch + 1; }

// Timeline stamp (thread 0 of a CTA; no-op without a timeline buffer).
__device__ __forceinline__ void stamp(const lasp_lasp2_params& p, uint64_t word) {
  if (p.timeline && threadIdx.x == 0) p.timeline[word] = global_ns();
}

// Kernel 1: segment s's end state from zero -> ws_m [bh][s], its log-decay -> ws_lambda [bh][s].
// The CTA's segment; grid z spans the launch's head group, which starts at head p.bh_begin.
__device__ __forceinline__ sd::SegmentArgs group_segment_args(const lasp_lasp2_params& p) {
  sd::SegmentArgs a = sd::segment_args(p);
  a.bh += p.bh_begin;
  return a;
}

template <int DK>
__device__ __forceinline__ void states(const lasp_lasp2_params& p) {
  const sd::SegmentArgs a = group_segment_args(p);
  const int64_t slot = (int64_t)a.bh * p.num_segments + blockIdx.y;
  sd::run_states_segment<DK>(a, [&](StateRegs<DK>& s, const StateLane& ln, float lambda) {
    sd::state_store<DK>(s, ln, p.ws_m + slot * DK * p.Dv + a.vt * sd::kTileV, p.Dv);
    if (a.vt == 0 && threadIdx.x == 0) p.ws_lambda[slot] = lambda;
  });
}

// The output kernel's prologue tiles go through shared memory, which is free until the chunk
// pipeline starts: cp.async puts a whole batch of tiles in flight at once, so a batch costs about one
// L2 round trip, where folding from registers paid one round trip per tile (the last PE at W = 4
// folds three slot tiles and a segment tile: ~6 us before its chunk loop against ~2 us on PE 0,
// run 12 timelines). Staged rows are padded to 72 floats: the 4 rows a half-warp's float2 reads
// touch then start 8 banks apart, so the reads are free of bank conflicts (4-way unpadded). A slot
// tile's 16-byte trailer (Lambda_u, 0, 0, 0) follows its rows.
constexpr int kStagedLd = sd::kTileV + 8;  // floats per staged row
constexpr int kStagedTiles = 3;            // staged slots; the last one holds the segment tile
template <int DK>
constexpr uint32_t staged_tile_bytes() {
  return DK * kStagedLd * 4 + 16;
}
static_assert(kStagedTiles * staged_tile_bytes<128>() <= lasp2_output_smem_bytes(128), "staged tiles exceed smem");
static_assert(kStagedTiles * staged_tile_bytes<64>() <= lasp2_output_smem_bytes(64), "staged tiles exceed smem");

// Starts copying rows [0, DK) x columns [0, 64) of an fp32 tile (row stride `ld` floats) into the
// staged slot at `slot` (every thread takes part; commit and wait are the caller's). `trailer`: also
// the 16 bytes after the last row, contiguous with the rows in a slot tile.
template <int DK>
__device__ __forceinline__ void stage_tile(uint32_t slot, const float* rows, int64_t ld, bool trailer) {
  constexpr int kPiecesPerRow = sd::kTileV / 4;  // 16-byte pieces
#pragma unroll 4
  for (int i = threadIdx.x; i < DK * kPiecesPerRow; i += sd::kThreads) {
    const int row = i / kPiecesPerRow, piece = i % kPiecesPerRow;
    cp_async_16(slot + (row * kStagedLd + 4 * piece) * 4, rows + row * ld + 4 * piece, true);
  }
  if (trailer && threadIdx.x == 0) cp_async_16(slot + DK * kStagedLd * 4, rows + DK * ld, true);
}

// s = e^{lambda} s + the staged tile at `slot` (fold_step per element, as sd::state_fold).
template <int DK>
__device__ __forceinline__ void fold_staged(StateRegs<DK>& s, const StateLane& ln, const uint8_t* slot, float lambda) {
  sd::state_fold<DK>(s, ln, reinterpret_cast<const float*>(slot), kStagedLd, lambda);
}

// Lambda_u of a staged slot tile (its trailer's first float).
template <int DK>
__device__ __forceinline__ float staged_lambda(const uint8_t* slot) {
  return *reinterpret_cast<const float*>(slot + DK * kStagedLd * 4);
}

// Kernel 3: the CTA's start state, then the single-GPU chunk loop.
//   P = h0 tile (or 0); for u < me ascending: P = e^{Lambda_u} P + M_u (slot [parity][u][bh][vt]);
//   s > 0: P = e^{Lambda_0 + .. + Lambda_{s-1}} P + L_s (ws_p slot s - 1). One tile read whatever s
//   is: folding the s earlier segments here instead cost the last segment's CTA s tile reads on
//   the critical path (+20-40 us per launch at S = 16, run A of 2026-11-21).
// The fold is the same in every mode; LASP2_DEVICE_PUT only adds the wait for the tiles' signals.
// L_s and the Lambdas before it are local (segment_prefix ran earlier on this stream), so their
// loads start before the wait; the slot tiles are staged after it, kStagedTiles - 1 at a time.
template <int DK>
__device__ __forceinline__ void output(const lasp_lasp2_params& p) {
  const sd::SegmentArgs a = group_segment_args(p);
  const int seg = blockIdx.y;
  const int64_t tile_elems = (int64_t)DK * p.Dv;  // one (b, h) state
  const int col0 = a.vt * sd::kTileV;
  sd::run_segment_with<DK>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        extern __shared__ __align__(1024) uint8_t smem[];
        constexpr uint32_t kTileBytes = staged_tile_bytes<DK>();
        constexpr uint32_t kSegmentSlot = (kStagedTiles - 1) * kTileBytes;
        const uint32_t sbase = smem_addr(smem);
        const uint64_t stamps = lasp2_timeline_output(a.bh, a.vt, seg, p.B, p.H, p.Dv, p.num_segments);
        stamp(p, stamps + 0);
        const uint64_t epoch = call_epoch(p);
        const int parity = static_cast<int>(epoch & 1);
        float lambda_before = 0.f;  // summed in segment order, as fold_put sums Lambda_me
        if (seg > 0) {
          const int64_t first = (int64_t)a.bh * p.num_segments;
          stage_tile<DK>(sbase + kSegmentSlot, p.ws_p + (first + seg - 1) * tile_elems + col0, p.Dv, false);
          cp_async_commit();
          for (int sp = 0; sp < seg; ++sp) lambda_before += p.ws_lambda[first + sp];
        }
        if (p.h0)
          sd::state_load<DK>(s, ln, p.h0 + a.bh * tile_elems + col0, p.Dv);
        else
          sd::state_zero<DK>(s, ln);

        if (p.exchange_mode == LASP2_DEVICE_PUT && p.me > 0) {
          // One thread per earlier PE waits for its tile of this epoch; the barrier then orders
          // the acquire before every thread's copies of the slots (cp.async.cg reads through L2).
          const WaitSite site{p.diag, p.timeout_ns, p.me};
          int ok = 1;
          for (int u = threadIdx.x; u < p.me; u += blockDim.x) {
            const uint64_t idx = lasp2_signal_index(parity, u, a.bh, a.vt, p.npes, p.B, p.H, p.Dv);
            ok &= wait_signal_ge(site, p.signals + idx, epoch, u, static_cast<int32_t>(idx), LASP_WAIT_DATA);
          }
          if (!__syncthreads_and(ok)) {
            cp_async_wait<0>();  // no copy may land in the pipeline's stages later
            return false;        // the host reports p.diag
          }
        }
        stamp(p, stamps + 1);

        for (int u0 = 0; u0 < p.me; u0 += kStagedTiles - 1) {
          const int batch = min(kStagedTiles - 1, p.me - u0);
          for (int j = 0; j < batch; ++j) {
            const float* tile = p.slots + lasp2_slot_tile_offset(parity, u0 + j, a.bh, a.vt, p.npes, p.B, p.H, DK, p.Dv);
            stage_tile<DK>(sbase + j * kTileBytes, tile, sd::kTileV, true);
          }
          cp_async_commit();
          cp_async_wait<0>();
          __syncthreads();
          for (int j = 0; j < batch; ++j) {
            const uint8_t* slot = smem + j * kTileBytes;
            fold_staged<DK>(s, ln, slot, staged_lambda<DK>(slot));
          }
          __syncthreads();  // before the next batch, or the chunk pipeline, overwrites the slots
        }
        if (seg > 0) {
          cp_async_wait<0>();
          __syncthreads();
          fold_staged<DK>(s, ln, smem + kSegmentSlot, lambda_before);
          __syncthreads();
        }
        stamp(p, stamps + 2);
        return true;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float) {
        if (p.write_final_state && p.ht && seg == p.num_segments - 1)
          sd::state_store<DK>(s, ln, p.ht + a.bh * tile_elems + col0, p.Dv);
      });
}

// Folds the segment states of tile (bh, vt) from zero, s ascending, for s < count:
// acc = e^{Lambda_s} acc + M_s, and calls step(s, acc, d, c) after each s with the float4 of rows d,
// columns c..c+3 of the tile. Thread i owns float4 columns (i % 16) of rows i / 16 + 16 j; fold_put
// and segment_prefix share this loop, so M_me and the prefixes L_s are the same fold.
// A thread loads all its rows of a segment at once, so it waits about one memory round trip per
// segment; walking its rows one at a time, as before run 52, waited one per (row, segment), 8 (S - 1)
// round trips at Dk = 128 (the loads of the next row could not pass the stores of `step`).
template <class Step>
__device__ __forceinline__ void fold_segments(const lasp_lasp2_params& p, int bh, int vt, int count, Step&& step) {
  constexpr int kCols = LASP2_TILE_V / 4;               // float4 columns of a tile row
  constexpr int kRowStep = LASP2_FOLD_THREADS / kCols;  // rows between a thread's rows
  constexpr int kMaxRows = 128 / kRowStep;              // a thread's rows at Dk = 128 (the largest Dk)
  const int rows = p.Dk / kRowStep;
  const int64_t state_elems = (int64_t)p.Dk * p.Dv;
  const int d0 = threadIdx.x / kCols, c = (threadIdx.x % kCols) * 4;
  const float* const m0 =
      p.ws_m + (int64_t)bh * p.num_segments * state_elems + vt * LASP2_TILE_V + (int64_t)d0 * p.Dv + c;
  const float* const lam = p.ws_lambda + (int64_t)bh * p.num_segments;
  float4 acc[kMaxRows];
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < count; ++s) {
    float4 m[kMaxRows];
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j)
      if (j < rows) m[j] = __ldg(reinterpret_cast<const float4*>(m0 + s * state_elems + (int64_t)j * kRowStep * p.Dv));
    const float l = __ldg(lam + s);
#pragma unroll
    for (int j = 0; j < kMaxRows; ++j) {
      if (j >= rows) continue;
      acc[j].x = sd::fold_step(acc[j].x, l, m[j].x);
      acc[j].y = sd::fold_step(acc[j].y, l, m[j].y);
      acc[j].z = sd::fold_step(acc[j].z, l, m[j].z);
      acc[j].w = sd::fold_step(acc[j].w, l, m[j].w);
      step(s, acc[j], d0 + j * kRowStep, c);
    }
  }
}

}  // namespace l2
}  // namespace lasp

// Kernel 1: end states M_s (zero start) and log-decays Lambda_s of ALL S segments of the shard.
// grid lasp2_states_grid, block LASP2_THREADS, smem lasp2_states_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_states_dk64(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::states<64>(p);
}
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_states_dk128(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::states<128>(p);
}

// Kernel 1b (S > 1), one CTA per (Dv tile vt, head bh = bh_begin + blockIdx.y): the shard-local
// prefixes L_{s+1} = fold_{s' <= s} (e^{Lambda_s'} L + M_s') from zero -> ws_p slot s, s < S - 1.
// grid lasp2_fold_put_grid, block LASP2_FOLD_THREADS, no smem.
extern "C" __global__ void __launch_bounds__(LASP2_FOLD_THREADS)
    lasp_lasp2_segment_prefix(const __grid_constant__ lasp_lasp2_params p) {
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int64_t state_elems = (int64_t)p.Dk * p.Dv;
  float* const p0 = p.ws_p + (int64_t)bh * p.num_segments * state_elems + vt * LASP2_TILE_V;
  lasp::l2::fold_segments(p, bh, vt, p.num_segments - 1, [&](int s, float4 acc, int d, int c) {
    *reinterpret_cast<float4*>(p0 + s * state_elems + (int64_t)d * p.Dv + c) = acc;
  });
}

// Kernel 2, one CTA per (Dv tile vt, head bh = bh_begin + blockIdx.y of the launch's group):
//  - block (0, 0) of the group with bh_begin == 0 (once per call), communicating modes:
//    credit[me] = epoch - 1 on every earlier PE (this PE finished reading epoch - 1: its output
//    kernels precede this call's states kernel, which this launch follows);
//  - M_me tile = fold over s ascending of (M_s, Lambda_s) from ZERO, Lambda_me = sum_s Lambda_s
//    -> own slot tile [parity][me][bh][vt] (+ trailer);
//  - LASP2_DEVICE_PUT: wait for every later PE's credit for epoch - 2 (bounded), then a put of
//    the contiguous tile to every later PE (same offset), one nvshmem_quiet for all of them, and
//    the signals [parity][me][bh*ntiles + vt] := epoch.
// grid lasp2_fold_put_grid, block LASP2_FOLD_THREADS, no smem.
extern "C" __global__ void __launch_bounds__(LASP2_FOLD_THREADS)
    lasp_lasp2_fold_put(const __grid_constant__ lasp_lasp2_params p) {
  const uint64_t epoch = lasp::l2::call_epoch(p);
  const int parity = static_cast<int>(epoch & 1);
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int tid = threadIdx.x;
  const int S = p.num_segments;
  const bool comm = p.exchange_mode != LASP2_NO_COMM;

  // One thread sends the credits and later quiets them (with this CTA's puts, if any).
  const bool sends_credits = comm && bh == 0 && vt == 0 && tid == 0 && p.me > 0;
  if (sends_credits)
    for (int u = 0; u < p.me; ++u) nvshmemx_signal_op(p.credit + p.me, epoch - 1, NVSHMEM_SIGNAL_SET, u);

  // M_me: the fold of all S segments from zero, into the own slot tile (rows of 64 floats).
  float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dk, p.Dv);
  lasp::l2::fold_segments(p, bh, vt, S, [&](int s, float4 acc, int d, int c) {
    if (s == S - 1) *reinterpret_cast<float4*>(own + d * LASP2_TILE_V + c) = acc;
  });
  if (tid == 0) {
    float lambda = 0.f;
    const float* const lam = p.ws_lambda + (int64_t)bh * S;
    for (int s = 0; s < S; ++s) lambda += lam[s];
    *reinterpret_cast<float4*>(own + p.Dk * LASP2_TILE_V) = make_float4(lambda, 0.f, 0.f, 0.f);
  }

  const uint64_t stamps = lasp2_timeline_put(bh, vt, p.Dv);
  if (p.exchange_mode != LASP2_DEVICE_PUT || p.me >= p.npes - 1) {
    if (sends_credits) nvshmem_quiet();
    lasp::l2::stamp(p, stamps + 0);
    lasp::l2::stamp(p, stamps + 1);
    return;
  }

  // The tile is complete in this PE's memory before the NIC (over InfiniBand) reads it for the
  // puts. A peer NVSHMEM reaches by load/store gets its copy from this CTA's threads, for which
  // the barrier below is enough; skipping the fence there matters, because a system-scope fence
  // waits tens of microseconds while the GPUs stream the kernels' traffic (LASP2_NOTES.md).
  bool nic_reads = false;
  for (int pe = p.me + 1; pe < p.npes; ++pe) nic_reads |= nvshmem_ptr(own, pe) == nullptr;
  if (nic_reads) __threadfence_system();
  int ok = 1;
  if (epoch > 2) {
    // Slot [parity] of PE pe was last read at epoch - 2: wait for pe's credit, one thread per peer.
    const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
    for (int pe = p.me + 1 + tid; pe < p.npes; pe += blockDim.x)
      ok &= lasp::wait_signal_ge(site, p.credit + pe, epoch - 2, pe, pe, LASP_WAIT_CREDIT);
  }
  // A CTA that gave up on a credit sends nothing: the readers then time out on this epoch's data,
  // and this PE's diag names the peer whose credit never came.
  if (!__syncthreads_and(ok)) return;
  lasp::l2::stamp(p, stamps + 0);

  // Every put first, then one quiet for all of them, then the signals: a put-with-signal per peer
  // would wait for its own completion (a system-scope fence) before the next peer's copy starts,
  // and such a fence waits long while the GPUs stream the output kernel's traffic.
  const uint64_t bytes = lasp2_slot_tile_floats(p.Dk) * 4u;
  uint64_t* const sig = p.signals + lasp2_signal_index(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv);
  const int later = p.npes - 1 - p.me;
  const int first = (blockIdx.y * gridDim.x + blockIdx.x) % later;  // staggered: every link busy at once
  auto peer = [&](int k) { return p.me + 1 + (first + k) % later; };
  for (int k = 0; k < later; ++k) nvshmemx_putmem_nbi_block(own, own, bytes, peer(k));
  __syncthreads();
  if (tid == 0) {
    nvshmem_quiet();  // the CTA's puts have landed: the signals may follow
    for (int k = 0; k < later; ++k) nvshmemx_signal_op(sig, epoch, NVSHMEM_SIGNAL_SET, peer(k));
    lasp::l2::stamp(p, stamps + 1);
    nvshmem_quiet();
  }
}

// Kernel 3: outputs of the shard from P_me (see lasp::l2::output); PE npes-1's last segment writes
// ht if write_final_state. grid lasp2_output_grid, block LASP2_THREADS, smem lasp2_output_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_output_dk64(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::output<64>(p);
}
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_output_dk128(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::output<128>(p);
}

// Kernel 4, launched last in every call (all modes): the call's epoch is complete on this PE.
// grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_lasp2_advance_epoch(const __grid_constant__ lasp_lasp2_params p) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *p.epoch += 1;
}

// Re-synchronises credits after LASP2_NO_COMM calls (which send none), before the first call of a
// communicating mode: credit[me] = *epoch (every epoch so far is finished here) on every earlier PE.
// Host: nvshmemx_barrier_all_on_stream; this kernel (grid (1, 1, 1), block (1, 1, 1));
// nvshmemx_barrier_all_on_stream (every credit is in place before any writer waits for one).
extern "C" __global__ void lasp_lasp2_grant_credits(const __grid_constant__ lasp_lasp2_params p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t done = *p.epoch;
  for (int u = 0; u < p.me; ++u) nvshmemx_signal_op(p.credit + p.me, done, NVSHMEM_SIGNAL_SET, u);
  nvshmem_quiet();
}
