// The mLSTM's LASP-2 forward with a device-initiated exchange of the shards' stabilised summaries,
// for sm_90a; the backward's dv pass exchanges its states through the same kernels on a
// descending chain (lasp/mlstm/backward_params.h, "LASP-2"). The chunk passes are the single-GPU
// forward's (mlstm/forward.cu); this file adds the shard's summary (its pieces folded into the
// exchanged tile) and the fold of the earlier PEs' summaries into the shard's start state, both on
// lasp/mlstm/fold.cuh; the protocol around them (epochs, credits, puts, bounded waits) is the
// generic exchange's (lasp/exchange/chain.cuh).
// Kernels and call order: lasp/mlstm/lasp2_params.h.
#include "lasp/exchange/chain.cuh"
#include "lasp/mlstm/fold.cuh"
#include "lasp/mlstm/lasp2_params.h"

namespace lasp {
namespace mlstm {

// Element e of a head's state (lasp/mlstm/fold.cuh's layout: C[d][c] at d * Dv + c, then n) as an
// index into column tile (e % Dv) / 64 of the exchanged tiles (C [Dk][64], then n).
__device__ __forceinline__ int64_t tile_index(const lasp_mlstm_lasp2_params& p, int64_t e) {
  const int64_t nc = (int64_t)p.Dk * p.Dv;
  return e < nc ? (e / p.Dv) * LASP2_TILE_V + e % LASP2_TILE_V : (int64_t)lasp_mlstm_lasp2_tile_n(p.Dk) + (e - nc);
}

// The global initial state P_0: h0, or mlstm_kernels' zero state (0, 0, m = 0); its stabiliser and
// element e.
__device__ __forceinline__ float initial_stabiliser(const lasp_mlstm_lasp2_params& p, int64_t bh) {
  return p.h0_m ? __ldg(p.h0_m + bh) : 0.f;
}
__device__ __forceinline__ float initial_element(const lasp_mlstm_lasp2_params& p, int64_t bh, int64_t e) {
  const int64_t nc = (int64_t)p.Dk * p.Dv;
  if (!p.h0_c) return 0.f;
  return e < nc ? __ldg(p.h0_c + bh * nc + e) : __ldg(p.h0_n + bh * p.Dk + (e - nc));
}

// The tile element i of column tile vt as an element of the head's state (C[d][64 vt + c], or n[d]).
__device__ __forceinline__ int64_t head_element(const lasp_mlstm_lasp2_params& p, int vt, int i) {
  return i < p.Dk * LASP2_TILE_V ? (int64_t)(i / LASP2_TILE_V) * p.Dv + vt * LASP2_TILE_V + i % LASP2_TILE_V
                                 : (int64_t)p.Dk * p.Dv + (i - p.Dk * LASP2_TILE_V);
}

// The backward's decay dot on the chain's first PE: <dC_T, C_T> over column tile vt of head bh,
// every thread's share in fp64 in a fixed order, then the CTA's in thread order (all threads call).
__device__ __forceinline__ float tile_decay_dot(const lasp_mlstm_lasp2_params& p, int vt, int bh) {
  __shared__ double warp_sums[LASP_MLSTM_LASP2_THREADS / 32];
  const int64_t base = (int64_t)bh * p.Dk * p.Dv;
  double sum = 0.0;
  for (int i = threadIdx.x; i < p.Dk * LASP2_TILE_V; i += blockDim.x) {
    const int64_t e = base + head_element(p, vt, i);
    sum += (double)__ldg(p.decay_dc + e) * (double)__ldg(p.decay_c + e);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < LASP_MLSTM_LASP2_THREADS / 32; ++w) total += warp_sums[w];
  return static_cast<float>(total);
}

// Kernel 2, one CTA per (Dv tile, head): the shard's summary, its pieces folded from the empty state
// in order, into the own slot tile [parity][me][bh][vt], then published by the schedule. Under the
// pipelined chain the summary is then folded into the relayed prefix (the predecessor's tile,
// waited for only now, so that a hop costs one fold and one put; P_0 at the chain's first PE) and
// carries F = 0, so its successor starts from it as it is. The backward's dv pass
// (h0_first_pe_only): the chain's first PE folds P_0 (dC_T) in under every schedule, and the
// summary leaves the shard through token 0's forget gate (exit_f_gate).
template <class Schedule>
__device__ __forceinline__ void lasp2_summary(const lasp_mlstm_lasp2_params& p) {
  const lasp_mlstm_params& f = p.fwd;
  const uint64_t epoch = exchange::call_epoch(p);
  const int parity = static_cast<int>(epoch & 1);
  const int vt = blockIdx.x, bh = blockIdx.y;
  const bool sent_credits = Schedule::send_credits(p, epoch, bh, vt);
  const uint64_t tile_floats = lasp_mlstm_lasp2_tile_floats(p.Dk);
  float* const own = p.slots + lasp2_slot_tile_offset(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv, tile_floats);
  const int64_t first_piece = (int64_t)bh * f.num_summaries * f.states_splits;
  const int64_t end_piece = first_piece + (int64_t)f.num_summaries * f.states_splits;
  const int tile_elements = p.Dk * LASP2_TILE_V + p.Dk;
  // The summary's stabiliser and log forget sum, as every element's fold computes them.
  float m = -INFINITY, log_forget = 0.f;
  for (int64_t piece = first_piece; piece < end_piece; ++piece) {
    const float lf = __ldg(f.ws_f + piece);
    m = fold_rescale(m, lf, __ldg(f.ws_m + piece)).m;
    log_forget += lf;
  }
  if (p.exit_f_gate) {  // e^{lf_0} scales the state (a shift of its stabiliser) and joins F
    const float lf0 = log_sigmoid(__ldg(p.exit_f_gate + (int64_t)(bh / p.H) * f.T * p.H + bh % p.H));
    m += lf0;
    log_forget += lf0;
  }
  for (int i = threadIdx.x; i < tile_elements; i += blockDim.x) {
    float x = 0.f, m_e = -INFINITY, lf_e = 0.f;  // the empty state
    fold_pieces(f, head_element(p, vt, i), first_piece, end_piece, x, m_e, lf_e);
    own[i] = x;
  }
  const bool relays = exchange::relays_prefix(p);
  bool arrived = true;
  const float* const prefix = Schedule::relayed_prefix(p, bh, vt, tile_floats, arrived);
  const bool first = exchange::chain_position(p) == 0;
  const float decay = prefix ? __ldcg(prefix + lasp_mlstm_lasp2_tile_decay(p.Dk))
                             : (first && p.decay_c ? tile_decay_dot(p, vt, bh) : 0.f);
  if (prefix || ((relays || p.h0_first_pe_only) && first)) {
    const float m_start =
        prefix ? __ldcg(prefix + lasp_mlstm_lasp2_tile_m(p.Dk)) : initial_stabiliser(p, bh);
    const Rescale r = fold_rescale(m_start, log_forget, m);
    // Each thread refolds the elements it wrote: no barrier between.
    for (int i = threadIdx.x; i < tile_elements; i += blockDim.x) {
      const float start = prefix ? __ldcg(prefix + i) : initial_element(p, bh, head_element(p, vt, i));
      own[i] = fold_element(r, start, own[i]);
    }
    m = r.m;
  }
  if (threadIdx.x == 0) {
    own[lasp_mlstm_lasp2_tile_m(p.Dk)] = m;
    own[lasp_mlstm_lasp2_tile_f(p.Dk)] = relays ? 0.f : log_forget;
    own[lasp_mlstm_lasp2_tile_decay(p.Dk)] = decay;
    own[lasp_mlstm_lasp2_tile_decay(p.Dk) + 1] = 0.f;
  }
  __syncthreads();  // the tile is complete before it is published
  // A CTA whose predecessor never sent sends nothing: its successor then names this PE.
  if (!arrived) return;
  Schedule::publish(p, epoch, own, tile_floats * 4u, bh, vt, sent_credits);
}

// Kernel 3, one thread per element of a head's C or n: the state entering the shard, P_0 (or the
// empty state where the schedule relays it) and then the earlier PEs' tiles in chain order, into
// start_*, then the states entering the shard's segments. The same fold in every mode.
template <class Schedule>
__device__ __forceinline__ void lasp2_fold(const lasp_mlstm_lasp2_params& p) {
  const lasp_mlstm_params& f = p.fwd;
  const int64_t nc = (int64_t)p.Dk * p.Dv;
  const int64_t e = (int64_t)blockIdx.x * LASP_MLSTM_LASP2_THREADS + threadIdx.x;
  const bool mine = e < nc + p.Dk;  // threads past the head's elements still join the barriers
  const int64_t bh = blockIdx.y;
  const uint64_t tile_floats = lasp_mlstm_lasp2_tile_floats(p.Dk);
  float x = 0.f, m = -INFINITY;  // the empty state
  if (Schedule::starts_from_h0(p)) {
    m = initial_stabiliser(p, bh);
    if (mine) x = initial_element(p, bh, e);
  }
  for (int vt = 0; vt < p.Dv / LASP2_TILE_V; ++vt)
    if (!Schedule::wait(p, static_cast<int>(bh), vt)) return;  // the host reports p.diag
  // The tiles of the element's column tile: slots hold a head's column tiles one after another.
  const int64_t at = mine ? (e < nc ? (e % p.Dv) / LASP2_TILE_V : 0) * (int64_t)tile_floats + tile_index(p, e) : 0;
  const float* arrived = nullptr;
  float decay = 0.f;  // the backward's decay dot: the arrived tiles' shares, in chain order
  Schedule::fold_arrived(
      p, static_cast<int>(bh), 0, tile_floats, 1, [&](int, const float* tile) { arrived = tile; },
      [&](int) {
        if (e == 0 && p.decay_dot)
          for (int vt = 0; vt < p.Dv / LASP2_TILE_V; ++vt)
            decay += __ldcg(arrived + vt * tile_floats + lasp_mlstm_lasp2_tile_decay(p.Dk));
        if (!mine) return;
        const Rescale r = fold_rescale(m, __ldcg(arrived + lasp_mlstm_lasp2_tile_f(p.Dk)),
                                       __ldcg(arrived + lasp_mlstm_lasp2_tile_m(p.Dk)));
        x = fold_element(r, x, __ldcg(arrived + at));
        m = r.m;
      });
  if (!mine) return;
  if (e < nc)
    p.start_c[bh * nc + e] = x;
  else
    p.start_n[bh * p.Dk + (e - nc)] = x;
  if (e == 0) p.start_m[bh] = m;
  if (e == 0 && p.decay_dot) p.decay_dot[bh] = decay;
  fold_segment_prefixes(f, bh, e, x, m);
}

}  // namespace mlstm
}  // namespace lasp

extern "C" __global__ void __launch_bounds__(LASP_MLSTM_LASP2_THREADS)
    lasp_mlstm_lasp2_summary(const __grid_constant__ lasp_mlstm_lasp2_params p) {
  lasp::mlstm::lasp2_summary<lasp::exchange::Exchange>(p);
}

extern "C" __global__ void __launch_bounds__(LASP_MLSTM_LASP2_THREADS)
    lasp_mlstm_lasp2_fold(const __grid_constant__ lasp_mlstm_lasp2_params p) {
  lasp::mlstm::lasp2_fold<lasp::exchange::Exchange>(p);
}

// Launched last in every call (all modes): the call's epoch is complete on this PE.
extern "C" __global__ void lasp_mlstm_lasp2_advance_epoch(const __grid_constant__ lasp_mlstm_lasp2_params p) {
  lasp::exchange::advance_epoch(p);
}

// Re-synchronises the all-gather's credits after LASP2_NO_COMM calls (the host brackets it with
// barriers). grid (1, 1, 1), block (1, 1, 1).
extern "C" __global__ void lasp_mlstm_lasp2_grant_credits(const __grid_constant__ lasp_mlstm_lasp2_params p) {
  lasp::exchange::Exchange::grant_credits(p);
}
