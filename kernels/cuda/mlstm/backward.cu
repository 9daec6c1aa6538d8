// mLSTM backward, mlstm_kernels' gradient: the kernels around its three gradient passes (the
// maths, the passes and the call order: lasp/mlstm/backward_params.h; the passes themselves are
// the forward's chunk kernels, lasp_mlstm_grad_*).
#include <math.h>
#include <stdint.h>

#include "lasp/mlstm/backward_params.h"
#include "lasp/mma.cuh"

namespace {

constexpr int kThreads = LASP_MLSTM_BWD_THREADS;

__device__ __forceinline__ float log_sigmoid(float x) { return fminf(x, 0.f) - log1pf(expf(-fabsf(x))); }

}  // namespace

// Per 8 elements of dh: the dv pass's value dO' = dh / den in bf16; the first 8 of each row also
// write the token's log row weight u_t = -m_t - ln den_t (the dq pass's row scale, the dk pass's
// input gate), -m_t (the dv pass's input gate) and the reversed passes' forget gate f_{t+1} (+inf
// after the last token).
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_prepare_rows(const __grid_constant__ lasp_mlstm_bwd_params p) {
  const int per_row = p.Dv / 8;
  const int64_t vec = (int64_t)blockIdx.x * kThreads + threadIdx.x;
  if (vec >= (int64_t)p.B * p.T * p.H * per_row) return;
  const int64_t row = vec / per_row;  // (b, t, h)
  const float den = __ldg(p.row_den + row), inv = 1.f / den;
  const uint4 x = __ldg(reinterpret_cast<const uint4*>(p.d_h) + vec);
  const uint32_t in[4] = {x.x, x.y, x.z, x.w};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = lasp::pack_bf16x2(__uint_as_float(in[i] << 16) * inv, __uint_as_float(in[i] & 0xffff0000u) * inv);
  reinterpret_cast<uint4*>(p.d_h_scaled)[vec] = make_uint4(out[0], out[1], out[2], out[3]);
  if (vec % per_row == 0) {
    const float m = __ldg(p.row_m + row);
    p.neg_m[row] = -m;
    p.row_log_weight[row] = -(m + logf(den));
    const int t = (int)((row / p.H) % p.T);
    p.f_next[row] = t + 1 < p.T ? __ldg(p.f_gate + row + p.H) : INFINITY;
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

// The gates' gradients of head blockIdx.x: di_t = k_t . dk_t and dlf_t the suffix sum of
// q . dq - k . dk (fp64, in a fixed order), df_t = dlf_t sigmoid(-f_t). The CTA walks the tokens
// from the last in tiles of kThreads * kPer, each thread kPer consecutive ones.
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_BWD_THREADS)
    lasp_mlstm_bwd_gates(const __grid_constant__ lasp_mlstm_bwd_params p) {
  constexpr int kPer = LASP_MLSTM_BWD_SCAN_TOKENS, kTile = kThreads * kPer;
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ double warp_totals[kThreads / 32];
  const int64_t bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int64_t row0 = b * p.T * p.H + h;
  const int tiles = p.Dk / 64;  // dots per row
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  double carry = 0.0;  // the suffix sum after this tile
  for (int end = p.T; end > 0; end -= kTile) {
    // Reversed position r = threadIdx.x * kPer + i of this tile is token end - 1 - r.
    float kdk[kPer];
    double x[kPer], local = 0.0;
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
    // Exclusive scan of the threads' sums over the CTA, in thread order.
    double incl = local;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const double y = __shfl_up_sync(kAll, incl, off);
      if (lane >= off) incl += y;
    }
    if (lane == 31) warp_totals[warp] = incl;
    __syncthreads();
    double before = carry + incl - local;
    for (int w = 0; w < warp; ++w) before += warp_totals[w];
    double tile_total = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) tile_total += warp_totals[w];
    __syncthreads();  // before the next tile overwrites warp_totals
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int t = end - 1 - (threadIdx.x * kPer + i);
      before += x[i];
      if (t >= 0) {
        const int64_t row = row0 + (int64_t)t * p.H;
        const float dlf = (float)before;
        p.d_i[row] = kdk[i];
        p.d_f[row] = dlf / (1.f + expf(__ldg(p.f_gate + row)));  // sigmoid(-f) = 1 / (1 + e^f)
      }
    }
    carry += tile_total;
  }
}
