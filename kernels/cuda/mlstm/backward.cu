// mLSTM backward, mlstm_kernels' gradient: the kernels around its three gradient passes (the
// maths, the passes and the call order: lasp/mlstm/backward_params.h; the passes themselves are
// the forward's chunk kernels, lasp_mlstm_grad_*).
#include <math.h>
#include <stdint.h>

#include "lasp/mlstm/backward_params.h"
#include "lasp/mlstm/chunk.cuh"
#include "lasp/mma.cuh"

namespace {

constexpr int kThreads = LASP_MLSTM_BWD_THREADS;
using lasp::mlstm::log_sigmoid;

}  // namespace

// Rows [blockIdx.x * rows, + rows) of dh, rows = kThreads / (Dv / 8), a thread per 8 elements:
// the dv pass's value dO' = dh / den in bf16; the first thread of each row also writes the
// token's log row weight u_t = -m_t - ln den_t (the dq pass's row scale, the dk pass's input
// gate), -m_t (the dv pass's input gate) and the reversed passes' forget gate f_{t+1} (+inf after
// the last token).
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_prepare_rows(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int shift = p.Dv == 128 ? 4 : 3;  // log2 of the threads per row
  const int64_t row = (int64_t)blockIdx.x * (kThreads >> shift) + (threadIdx.x >> shift);  // (b, t, h)
  if (row >= (int64_t)p.B * p.T * p.H) return;
  const int64_t vec = (row << shift) + (threadIdx.x & ((1 << shift) - 1));
  const float den = __ldg(p.row_den + row), inv = 1.f / den;
  const uint4 x = __ldg(reinterpret_cast<const uint4*>(p.d_h) + vec);
  const uint32_t in[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = lasp::pack_bf16x2(__uint_as_float(in[i] << 16) * inv, __uint_as_float(in[i] & 0xffff0000u) * inv);
  reinterpret_cast<uint4*>(p.d_h_scaled)[vec] = make_uint4(out[0], out[1], out[2], out[3]);
  if ((threadIdx.x & ((1 << shift) - 1)) == 0) {
    const float m = __ldg(p.row_m + row);
    p.neg_m[row] = -m;
    p.row_log_weight[row] = -(m + logf(den));
    const bool last = (row / p.H) % p.T == p.T - 1;
    p.f_next[row] = last ? INFINITY : __ldg(p.f_gate + row + p.H);
  }
}

// Per element (d, c) of head blockIdx.y's [Dk, Dv]: the gradient passes' start states.
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_prepare_states(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int e = blockIdx.x * kThreads + threadIdx.x;
  const int64_t bh = blockIdx.y, n = (int64_t)p.Dk * p.Dv;
  if (e < max(p.Dk, p.Dv)) p.zero_n[bh * max(p.Dk, p.Dv) + e] = 0.f;
  if (e == 0) p.rev_m[bh] = p.dc_t ? -p.m_t[bh] : -INFINITY;
  if (e >= n) return;
  const int d = e / p.Dv, c = e % p.Dv;
  const int64_t at = bh * n + e, at_t = bh * n + (int64_t)c * p.Dk + d;
  const float x = p.dc_t ? p.dc_t[at] / p.scale : 0.f;
  p.rev_c[at] = x;
  p.rev_c_t[at_t] = x;
  if (p.c0) p.c0_t[at_t] = p.c0[at];
}

// dC_0 = sigma e^{lf_0 + m_0 + m'_end} D per element of head blockIdx.y (m_0 = 0 for the zero
// state): the dv pass's final state, whose weights stop short of token 0's forget gate.
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_initial_state(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int e = blockIdx.x * kThreads + threadIdx.x;
  const int64_t bh = blockIdx.y, n = (int64_t)p.Dk * p.Dv;
  if (e >= n) return;
  const int64_t b = bh / p.H, h = bh % p.H;
  const float lf0 = log_sigmoid(p.f_gate[b * p.T * p.H + h]);
  const float m0 = p.c0 ? p.m0[bh] : 0.f;
  p.dc0[bh * n + e] = p.scale * expf(lf0 + m0 + p.end_m[bh]) * p.end_c[bh * n + e];
}

// The gate gradient's scan (lasp_mlstm_bwd_gate_tiles, then lasp_mlstm_bwd_gates): x_t =
// q_t . dq_t - k_t . dk_t over tiles of kTile tokens, each CTA kTile consecutive ones of one head,
// a thread kPer of them; every sum in fp64 and in a fixed order.
namespace {

constexpr int kPer = LASP_MLSTM_BWD_SCAN_TOKENS, kTile = LASP_MLSTM_BWD_SCAN_TILE;
static_assert(kTile == kThreads * kPer, "a thread per kPer tokens of a tile");
constexpr unsigned kAll = 0xffffffffu;

// The tile's tokens of this thread, the last first: x_t into x, k . dk into kdk; returns their sum.
__device__ __forceinline__ double tile_terms(const lasp_mlstm_bwd_params& p, int64_t row0, int end, double (&x)[kPer],
                                             float (&kdk)[kPer]) {
  const int tiles = p.Dk / 64;  // dots per row
  double local = 0.0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int t = end - 1 - (threadIdx.x * kPer + i);
    float qdq = 0.f;
    kdk[i] = 0.f;
    if (t >= 0) {
      const int64_t row = row0 + (int64_t)t * p.H;
      for (int c = 0; c < tiles; ++c) {
        qdq += __ldg(p.q_dots + row * tiles + c);
        kdk[i] += __ldg(p.k_dots + row * tiles + c);
      }
    }
    x[i] = (double)qdq - (double)kdk[i];
    local += x[i];
  }
  return local;
}

// Inclusive scan of one double per thread over the CTA in thread order; total gets the CTA's sum.
__device__ __forceinline__ double block_scan(double v, double& total) {
  __shared__ double warp_totals[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double incl = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const double y = __shfl_up_sync(kAll, incl, off);
    if (lane >= off) incl += y;
  }
  if (lane == 31) warp_totals[warp] = incl;
  __syncthreads();
  double before = 0.0;
  total = 0.0;
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += warp_totals[w];
    total += warp_totals[w];
  }
  return before + incl;
}

// The tile of this CTA: (b, h) = blockIdx.y, tokens [end - kTile, end), the last tile first.
__device__ __forceinline__ int tile_end(const lasp_mlstm_bwd_params& p) { return p.T - blockIdx.x * kTile; }

// Packed documents: the scan runs over the tokens from the last down (element e is token T-1-e,
// the order of the reversed passes' start words, p.rev_starts) and restarts at every element whose
// successor starts a document (a cut: dlf_t sums x over t's own document only).
__device__ __forceinline__ bool cut_at(const lasp_mlstm_bwd_params& p, int64_t e) {
  return (__ldg(p.rev_starts + e / 64) >> (e % 64)) & 1;
}

// A stretch of the scan: x summed from its last cut on (or over all of it), and whether it holds
// a cut. Followed by `later`, a stretch hands on `later.v + v` where it holds no cut, else `v`.
struct Stretch {
  double v;
  bool cut;
};
__device__ __forceinline__ Stretch then(const Stretch& earlier, const Stretch& later) {
  return later.cut ? later : Stretch{earlier.v + later.v, earlier.cut};
}

// This thread's kPer elements as a stretch (x as tile_terms left them, the first element first).
__device__ __forceinline__ Stretch thread_stretch(const lasp_mlstm_bwd_params& p, const double (&x)[kPer],
                                                  int64_t e0) {
  Stretch st{0.0, false};
#pragma unroll
  for (int i = 0; i < kPer; ++i) st = then(st, Stretch{x[i], e0 + i < p.T && cut_at(p, e0 + i)});
  return st;
}

// The CTA's segmented scan of one stretch per thread in thread order: what the threads before
// this one hand on (exclusive), and the whole CTA's stretch in total.
__device__ __forceinline__ Stretch block_segmented_scan(Stretch own, Stretch& total) {
  __shared__ double warp_v[kThreads / 32];
  __shared__ bool warp_cut[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  Stretch incl = own;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const Stretch y{__shfl_up_sync(kAll, incl.v, off), static_cast<bool>(__shfl_up_sync(kAll, incl.cut, off))};
    if (lane >= off) incl = then(y, incl);
  }
  Stretch before{__shfl_up_sync(kAll, incl.v, 1), static_cast<bool>(__shfl_up_sync(kAll, incl.cut, 1))};
  if (lane == 0) before = Stretch{0.0, false};
  if (lane == 31) {
    warp_v[warp] = incl.v;
    warp_cut[warp] = incl.cut;
  }
  __syncthreads();
  Stretch warps{0.0, false};
  total = Stretch{0.0, false};
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) warps = then(warps, Stretch{warp_v[w], warp_cut[w]});
    total = then(total, Stretch{warp_v[w], warp_cut[w]});
  }
  return then(warps, before);
}

// Whether tile `tile`'s elements hold a cut.
__device__ __forceinline__ bool tile_has_cut(const lasp_mlstm_bwd_params& p, int tile) {
  const int64_t first = (int64_t)tile * kTile / 64, end = min((int64_t)(tile + 1) * kTile / 64, (int64_t)(p.T + 63) / 64);
  uint64_t any = 0;
  for (int64_t w = first; w < end; ++w) any |= __ldg(p.rev_starts + w);
  return any != 0;
}

}  // namespace

// Per (tile, b*H+h): the tile's sum of x into tile_sums.
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_gate_tiles(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int64_t bh = blockIdx.y, row0 = bh / p.H * p.T * p.H + bh % p.H;
  double x[kPer];
  float kdk[kPer];
  double total;
  const double local = tile_terms(p, row0, tile_end(p), x, kdk);
  if (p.rev_starts) {  // packed documents: what the tile hands on, from its last cut on
    Stretch whole;
    block_segmented_scan(thread_stretch(p, x, (int64_t)blockIdx.x * kTile + threadIdx.x * kPer), whole);
    total = whole.v;
  } else {
    block_scan(local, total);
  }
  if (threadIdx.x == 0) p.tile_sums[bh * gridDim.x + blockIdx.x] = total;
}

// Per (tile, b*H+h): di_t = k_t . dk_t, dlf_t = the suffix sum of x from t (the later tiles' sums
// added in order, then the tile's own scan), df_t = dlf_t sigmoid(-f_t).
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_gates(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int64_t bh = blockIdx.y, row0 = bh / p.H * p.T * p.H + bh % p.H;
  const int end = tile_end(p);
  double x[kPer];
  float kdk[kPer];
  const double local = tile_terms(p, row0, end, x, kdk);
  double later = p.lf_carry ? p.lf_carry[bh] : 0.0;  // the later shards, then this shard's later tiles, nearest last
  double suffix;  // x summed over the tokens after this thread's (of their documents, with documents)
  const int64_t e0 = (int64_t)blockIdx.x * kTile + threadIdx.x * kPer;  // this thread's first element
  if (p.rev_starts) {
    Stretch handed{later, false};  // the later tiles in order, each from its last cut on
    for (int tile = 0; tile < blockIdx.x; ++tile)
      handed = then(handed, Stretch{p.tile_sums[bh * gridDim.x + tile], tile_has_cut(p, tile)});
    Stretch whole;
    suffix = then(handed, block_segmented_scan(thread_stretch(p, x, e0), whole)).v;
  } else {
    for (int tile = blockIdx.x - 1; tile >= 0; --tile) later += p.tile_sums[bh * gridDim.x + tile];
    double total;
    suffix = later + block_scan(local, total) - local;
  }
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int t = end - 1 - (threadIdx.x * kPer + i);
    suffix = p.rev_starts && t >= 0 && cut_at(p, e0 + i) ? x[i] : suffix + x[i];
    if (t >= 0) {
      const int64_t row = row0 + (int64_t)t * p.H;
      const bool starts = p.starts && ((__ldg(p.starts + t / 64) >> (t % 64)) & 1);
      p.d_i[row] = kdk[i];
      p.d_f[row] = starts ? 0.f : (float)suffix / (1.f + expf(__ldg(p.f_gate + row)));  // sigmoid(-f) = 1 / (1 + e^f)
    }
  }
}

// LASP-2, per head blockIdx.x, after the exchange's fold: the dk pass's start state X^T and m',
// and (with lf_carry) the later shards' share of every dlf, sigma e^{m' + m_exit} <X, C_exit> -
// <dC_T, C_T>, the dot in fp64 in a fixed order.
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_lasp2_exit(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int64_t bh = blockIdx.x, n = (int64_t)p.Dk * p.Dv;
  const float* const x = p.lasp2_start_c + bh * n;
  double dot = 0.0;
  for (int64_t e = threadIdx.x; e < n; e += kThreads) {
    const int64_t d = e / p.Dv, c = e % p.Dv;
    const float xe = x[e];
    p.rev_c_t[bh * n + c * p.Dk + d] = xe;
    if (p.lf_carry) dot += (double)xe * (double)__ldg(p.exit_c + bh * n + e);
  }
  const float m_start = p.lasp2_start_m[bh];
  if (threadIdx.x == 0) p.lasp2_m[bh] = m_start;
  if (!p.lf_carry) return;
  double total;
  block_scan(dot, total);
  if (threadIdx.x == 0) {
    const double weight = (double)p.scale * exp((double)m_start + (double)__ldg(p.exit_m + bh));
    p.lf_carry[bh] = total * weight - (double)__ldg(p.decay_dot + bh);
  }
}
