// LASP-2 forward with scalar decay and a device-initiated state exchange, for sm_90a.
//
// PE `me` of `npes` holds T_local tokens of every sequence. Per (b, h):
//   M_me = local end state from zero, Lambda_me = sum of the shard's log-decays       (kernel 1)
//   (M_me, Lambda_me) goes to every later PE: one put-with-signal per (tile, peer),
//   issued by the tile's last states CTA while other tiles are still being computed    (kernel 1)
//   P_me = fold_{u < me} (P = e^{Lambda_u} P + M_u) from h0; output segment j starts from
//   e^{Lambda before j} P_me + L_j (L_j = the fold of the state segments before j from zero,
//   also written by the tile's last states CTA); then the chunk loop of the single-GPU output
//   kernel from that start                                                              (kernel 2)
//
// Kernels (geometry, buffers and call order: lasp/lasp2_params.h; protocol: LASP2_NOTES.md):
//   1. lasp_lasp2_states_dk{64,128}  per (Dv tile, state segment, b*H+h): the segment's end state
//                                    from zero; the tile's last CTA folds, writes the own slot and
//                                    the prefixes, and (LASP2_DEVICE_PUT) puts the tile to every later PE
//   2. lasp_lasp2_output_dk{64,128}  per (Dv tile, output segment, b*H+h): prologue fold, chunk loop, O, ht
//   3. lasp_lasp2_advance_epoch      *epoch += 1
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

// The tile (b*H+h, Dv tile) a CTA works on: its row in the per-tile arrays.
__device__ __forceinline__ int64_t tile_index(const lasp_lasp2_params& p, int bh, int vt) {
  return (int64_t)bh * lasp2_num_vtiles(p.Dv) + vt;
}

// Called by every thread of a states CTA after its segment's state is stored: counts the CTA in on
// its tile. True, in every thread, in the tile's last CTA, which then sees every other CTA's stores
// (each CTA fences them before it counts itself in) and returns the counter to 0 for the next call.
__device__ __forceinline__ bool last_of_tile(const lasp_lasp2_params& p, int64_t tile) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(p.arrivals + tile, 1u) == static_cast<uint32_t>(p.state_segments) - 1u;
    if (last) p.arrivals[tile] = 0;
    __threadfence();
  }
  __syncthreads();
  return last != 0;
}

// The tile's last states CTA (LASP2_THREADS threads): folds the tile's S_st state segments from
// zero in ascending order, acc = e^{Lambda_s} acc + M_s, and writes
//   - after the state segments of output segments < j (j = 1 .. S-1): L_j -> ws_p slot j-1 and
//     their summed log-decay -> ws_lambda_p slot j-1 (the output kernel's shard-local prefixes);
//   - after all of them: M_me -> the own slot tile [parity][me][bh][vt], rows of 64 floats, then
//     the trailer (Lambda_me = the sum of every Lambda_s in s order, 0, 0, 0).
// Thread i owns float4 columns (i % 16) of rows i / 16 + 8 j: every load of a state segment is
// issued before any of its fold steps, so a thread keeps kPerThread loads in flight.
template <int DK>
__device__ __forceinline__ void fold_tile(const lasp_lasp2_params& p, int bh, int vt, int64_t tile, float* own) {
  constexpr int kRowFloat4s = LASP2_TILE_V / 4;
  constexpr int kPerThread = DK * kRowFloat4s / LASP2_THREADS;
  constexpr int kRowStep = LASP2_THREADS / kRowFloat4s;
  const int S_st = p.state_segments;
  const int splits = p.chunks_per_segment / p.chunks_per_state_segment;
  const int64_t state_elems = (int64_t)DK * p.Dv;
  const int row0 = threadIdx.x / kRowFloat4s, col = (threadIdx.x % kRowFloat4s) * 4;
  const float* const m0 = p.ws_m + (int64_t)bh * S_st * state_elems + vt * LASP2_TILE_V + (int64_t)row0 * p.Dv + col;
  float* const p0 = p.ws_p + (int64_t)bh * p.num_segments * state_elems + vt * LASP2_TILE_V + (int64_t)row0 * p.Dv + col;
  const float* const lambdas = p.ws_lambda + tile * S_st;

  float4 acc[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < S_st; ++s) {
    const float* const m = m0 + s * state_elems;
    float4 x[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) x[i] = __ldcg(reinterpret_cast<const float4*>(m + (int64_t)i * kRowStep * p.Dv));
    const float l = __ldcg(lambdas + s);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      acc[i].x = sd::fold_step(acc[i].x, l, x[i].x);
      acc[i].y = sd::fold_step(acc[i].y, l, x[i].y);
      acc[i].z = sd::fold_step(acc[i].z, l, x[i].z);
      acc[i].w = sd::fold_step(acc[i].w, l, x[i].w);
    }
    if ((s + 1) % splits == 0 && s + 1 < S_st) {
      float* const dst = p0 + (int64_t)((s + 1) / splits - 1) * state_elems;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) *reinterpret_cast<float4*>(dst + (int64_t)i * kRowStep * p.Dv) = acc[i];
    }
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
    *reinterpret_cast<float4*>(own + (row0 + i * kRowStep) * LASP2_TILE_V + col) = acc[i];

  if (threadIdx.x == 0) {
    float lambda = 0.f;
    for (int s = 0; s < S_st; ++s) {
      if (s > 0 && s % splits == 0) p.ws_lambda_p[tile * p.num_segments + s / splits - 1] = lambda;
      lambda += __ldcg(lambdas + s);
    }
    *reinterpret_cast<float4*>(own + DK * LASP2_TILE_V) = make_float4(lambda, 0.f, 0.f, 0.f);
  }
}

// The tile's last states CTA, after fold_tile: in LASP2_DEVICE_PUT, waits for every later PE's
// credit for epoch - 2 (bounded), then one put-with-signal of the contiguous own tile per later PE
// (same offset; signal [parity][me][bh*ntiles + vt] := epoch), then nvshmem_quiet.
__device__ __forceinline__ void put_tile(const lasp_lasp2_params& p, int bh, int vt, const float* own,
                                         uint64_t epoch) {
  const uint64_t stamps = lasp2_timeline_put(bh, vt, p.Dv);
  if (p.exchange_mode != LASP2_DEVICE_PUT || p.me >= p.npes - 1) {
    stamp(p, stamps + 0);
    stamp(p, stamps + 1);
    return;
  }
  // The tile is complete in this PE's memory before any thread (or the NIC, over InfiniBand)
  // reads it for the puts.
  __threadfence_system();
  int ok = 1;
  if (epoch > 2) {
    // Slot [parity] of PE pe was last read at epoch - 2: wait for pe's credit, one thread per peer.
    const WaitSite site{p.diag, p.timeout_ns, p.me};
    for (int pe = p.me + 1 + threadIdx.x; pe < p.npes; pe += blockDim.x)
      ok &= wait_signal_ge(site, p.credit + pe, epoch - 2, pe, pe, LASP_WAIT_CREDIT);
  }
  // A CTA that gave up on a credit sends nothing: the readers then time out on this epoch's data,
  // and this PE's diag names the peer whose credit never came.
  if (!__syncthreads_and(ok)) return;
  stamp(p, stamps + 0);

  const int parity = static_cast<int>(epoch & 1);
  const uint64_t bytes = lasp2_slot_tile_floats(p.Dk) * 4u;
  uint64_t* const sig = p.signals + lasp2_signal_index(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv);
  const int later = p.npes - 1 - p.me;
  const int first = static_cast<int>((bh * lasp2_num_vtiles(p.Dv) + vt) % later);  // every link busy at once
  for (int k = 0; k < later; ++k) {
    const int pe = p.me + 1 + (first + k) % later;
    nvshmemx_putmem_signal_nbi_block(const_cast<float*>(own), own, bytes, sig, epoch, NVSHMEM_SIGNAL_SET, pe);
  }
  __syncthreads();
  if (threadIdx.x == 0) nvshmem_quiet();
  stamp(p, stamps + 1);
}

// Kernel 1: state segment s's end state from zero -> ws_m [bh][s], its log-decay -> ws_lambda
// [tile][s]; the tile's last CTA then folds and puts (fold_tile, put_tile). Block (0, 0, 0) of a
// communicating mode first sends the credits: credit[me] = epoch - 1 on every earlier PE (this PE
// has finished reading every epoch <= epoch - 1: its output kernel of epoch - 1 precedes on the
// stream), and quiets them at its end.
template <int DK>
__device__ __forceinline__ void states(const lasp_lasp2_params& p) {
  sd::SegmentArgs a = sd::segment_args(p);
  a.c_begin = blockIdx.y * p.chunks_per_state_segment;
  a.n_chunks = min(p.chunks_per_state_segment, lasp_sd_num_chunks(p.T) - a.c_begin);  // >= 1 by the host's S_st
  const uint64_t epoch = call_epoch(p);
  const bool sends_credits = p.exchange_mode != LASP2_NO_COMM && p.me > 0 && threadIdx.x == 0 &&
                             blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
  if (sends_credits)
    for (int u = 0; u < p.me; ++u) nvshmemx_signal_op(p.credit + p.me, epoch - 1, NVSHMEM_SIGNAL_SET, u);

  const int64_t tile = tile_index(p, a.bh, a.vt);
  const int64_t state = (int64_t)a.bh * p.state_segments + blockIdx.y;
  sd::run_segment_with<DK, false>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        sd::state_zero<DK>(s, ln);
        return true;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float lambda) {
        sd::state_store<DK>(s, ln, p.ws_m + state * DK * p.Dv + a.vt * sd::kTileV, p.Dv);
        if (threadIdx.x == 0) p.ws_lambda[tile * p.state_segments + blockIdx.y] = lambda;
      });
  if (last_of_tile(p, tile)) {
    const int parity = static_cast<int>(epoch & 1);
    float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, a.bh, a.vt, p.npes, p.B, p.H, DK, p.Dv);
    fold_tile<DK>(p, a.bh, a.vt, tile, own);
    put_tile(p, a.bh, a.vt, own, epoch);
  }
  if (sends_credits) nvshmem_quiet();
}

// Kernel 2: the CTA's start state, then the single-GPU chunk loop.
//   P = h0 tile (or 0); for u < me ascending: P = e^{Lambda_u} P + M_u (slot [parity][u][bh][vt]);
//   j > 0: P = e^{Lambda before j} P + L_j (ws_lambda_p, ws_p slot j - 1). One tile read whatever j
//   is: folding the earlier segments here instead cost the last segment's CTA j tile reads on
//   the critical path (+20-40 us per launch at S = 16, run A of 2026-11-21).
// The fold is the same in every mode; LASP2_DEVICE_PUT only adds the wait for the tiles' signals.
template <int DK>
__device__ __forceinline__ void output(const lasp_lasp2_params& p) {
  const sd::SegmentArgs a = sd::segment_args(p);
  const int seg = blockIdx.y;
  const int64_t tile_elems = (int64_t)DK * p.Dv;  // one (b, h) state
  const int col0 = a.vt * sd::kTileV;
  sd::run_segment_with<DK, true>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        const uint64_t stamps = lasp2_timeline_output(a.bh, a.vt, seg, p.B, p.H, p.Dv, p.num_segments);
        stamp(p, stamps + 0);
        const uint64_t epoch = call_epoch(p);
        const int parity = static_cast<int>(epoch & 1);
        if (p.h0)
          sd::state_load<DK>(s, ln, p.h0 + a.bh * tile_elems + col0, p.Dv);
        else
          sd::state_zero<DK>(s, ln);

        if (p.exchange_mode == LASP2_DEVICE_PUT && p.me > 0) {
          // One thread per earlier PE waits for its tile of this epoch; the barrier then orders
          // the acquire before every thread's reads of the slots (read through L2: __ldcg).
          const WaitSite site{p.diag, p.timeout_ns, p.me};
          int ok = 1;
          for (int u = threadIdx.x; u < p.me; u += blockDim.x) {
            const uint64_t idx = lasp2_signal_index(parity, u, a.bh, a.vt, p.npes, p.B, p.H, p.Dv);
            ok &= wait_signal_ge(site, p.signals + idx, epoch, u, static_cast<int32_t>(idx), LASP_WAIT_DATA);
          }
          if (!__syncthreads_and(ok)) return false;  // the host reports p.diag
        }
        stamp(p, stamps + 1);

        for (int u = 0; u < p.me; ++u) {
          const float* tile = p.slots + lasp2_slot_tile_offset(parity, u, a.bh, a.vt, p.npes, p.B, p.H, DK, p.Dv);
          const float lambda_u = __ldcg(tile + DK * sd::kTileV);
          sd::state_fold<DK, true>(s, ln, tile, sd::kTileV, lambda_u);
        }
        if (seg > 0) {
          const float lambda_before = p.ws_lambda_p[tile_index(p, a.bh, a.vt) * p.num_segments + seg - 1];
          const int64_t prefix = (int64_t)a.bh * p.num_segments + seg - 1;
          sd::state_fold<DK, false>(s, ln, p.ws_p + prefix * tile_elems + col0, p.Dv, lambda_before);
        }
        stamp(p, stamps + 2);
        return true;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float) {
        if (p.write_final_state && p.ht && seg == p.num_segments - 1)
          sd::state_store<DK>(s, ln, p.ht + a.bh * tile_elems + col0, p.Dv);
      });
}

}  // namespace l2
}  // namespace lasp

// Kernel 1: end states of every state segment from zero; each tile's last CTA folds them, writes
// the own slot and the output segments' prefixes, and puts the tile (lasp::l2::states).
// grid lasp2_states_grid, block LASP2_THREADS, smem lasp2_states_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_states_dk64(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::states<64>(p);
}
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_states_dk128(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::states<128>(p);
}

// Kernel 2: outputs of the shard from P_me (see lasp::l2::output); PE npes-1's last segment writes
// ht if write_final_state. grid lasp2_output_grid, block LASP2_THREADS, smem lasp2_output_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_output_dk64(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::output<64>(p);
}
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_output_dk128(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::output<128>(p);
}

// Kernel 3, launched last in every call (all modes): the call's epoch is complete on this PE.
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
