// GLA (gated linear attention with a log-decay per key dimension), forward, chunkwise (C = 64),
// for sm_90a (wgmma).
//
//   S_t = diag(e^{a_t}) S_{t-1} + k_t^T v_t,   o_t = sigma q_t S_t      (per batch b, head h)
//
// Three kernels (launch geometry and call order: lasp/gla/forward_params.h):
//   1. lasp_gla_states_dk*        each of R pieces of segment s < S-1: its local end state M from
//                                 zero and its log-decay Lambda in R^Dk (lasp::gla::run_states_segment)
//   2. lasp_gla_fold              P_0 = h0, P <- diag(e^{Lambda}) P + M over the pieces in order
//   3. lasp_gla_output_dk*_dv*    segment s from P_s: O for every token, S on chip in fp32, the last
//                                 segment writes the final state (lasp::gla::run_output_segment);
//                                 in training, the bf16 state entering every chunk (chunk_states)
// With S == 1 only kernel 3 runs. The chunk maths, and how the scores stay a tensor-core product
// under per-key decays: lasp/gla/chunk.cuh.
#include <math.h>
#include <stdint.h>

#include "lasp/gla/chunk.cuh"
#include "lasp/gla/forward_params.h"

namespace lasp {
namespace gla {

// Kernel 1: piece u = blockIdx.y (piece r of segment s = u / R) into workspace slot (b*H+h, u);
// Dv tile blockIdx.x. An empty piece writes the identity (M = 0, Lambda = 0).
template <int DK, bool kPacked>
__device__ __forceinline__ void run_states(const lasp_gla_params& p) {
  const int u = blockIdx.y;
  const Segment sg = piece_of(p, u);
  const int64_t slot = (int64_t)blockIdx.z * (p.num_segments - 1) * p.states_splits + u;
  const int vt = blockIdx.x;
  const auto end = [&](StateRegs<DK>& s, const StateLane& ln, float2 lambda, const auto& gl) {
    chunk::state_store<DK>(s, ln, p.ws_m + slot * DK * p.Dv + vt * 64, p.Dv);
    if (vt == 0 && gl.first == 0) reinterpret_cast<float2*>(p.ws_lambda + slot * DK)[gl.pair] = lambda;
  };
  run_states_segment<DK, kPacked>(p, sg, vt, end);
}

// Kernel 3: segment blockIdx.y from its prefix; the last segment writes ht. kEntries: also the
// states entering the packed documents' last chunks (lasp/gla/chunk.cuh).
template <int DK, int DV, bool kPacked, bool kEntries = false>
__device__ __forceinline__ void run_output(const lasp_gla_params& p) {
  const Segment sg = segment_of(p, blockIdx.y * p.chunks_per_segment, p.chunks_per_segment);  // never empty
  const int seg = blockIdx.y;
  const int64_t bh = blockIdx.z;
  const int64_t tile = (int64_t)DK * DV;
  const float* prefix = seg > 0 ? p.ws_p + (bh * (p.num_segments - 1) + seg - 1) * tile
                                : p.h0 ? p.h0 + bh * tile : nullptr;
  uint16_t* chunk_states = p.chunk_states ? p.chunk_states + bh * lasp_gla_num_chunks(p.T) * tile : nullptr;
  const auto start = [&](StateRegs<DK>& s, const StateLane& ln, int group) {
    if (prefix)
      chunk::state_load<DK>(s, ln, prefix + group * 64, DV);
    else
      chunk::state_zero<DK>(s, ln);
    return true;
  };
  const auto end = [&](StateRegs<DK>& s, const StateLane& ln, int group) {
    if (seg == p.num_segments - 1 && p.ht) chunk::state_store<DK>(s, ln, p.ht + bh * tile + group * 64, DV);
  };
  run_output_segment<DK, DV, kPacked, kEntries>(p, sg, chunk_states, start, end);
}

}  // namespace gla
}  // namespace lasp

// Kernel 2: ws_p slot s = P_{s+1}, the fold P <- diag(e^{Lambda_u}) P + M_u over the pieces u of
// segments 0..s in ascending order, from P_0 = h0 (or 0). One thread per state element (d, c) per
// b*H+h; only when S > 1.
extern "C" __global__ void __launch_bounds__(LASP_GLA_FOLD_THREADS)
    lasp_gla_fold(const __grid_constant__ lasp_gla_params p) {
  const int64_t n = (int64_t)p.Dk * p.Dv;
  const int64_t e = (int64_t)blockIdx.x * LASP_GLA_FOLD_THREADS + threadIdx.x;
  if (e >= n) return;
  const int64_t bh = blockIdx.y;
  const int d = static_cast<int>(e / p.Dv);
  const int slots = p.num_segments - 1, R = p.states_splits;
  float prefix = p.h0 ? p.h0[bh * n + e] : 0.f;
  for (int s = 0; s < slots; ++s) {
    for (int r = 0; r < R; ++r) {
      const int64_t piece = (bh * slots + s) * R + r;
      prefix = lasp::gla::fold_step(prefix, __ldg(p.ws_lambda + piece * p.Dk + d), __ldg(p.ws_m + piece * n + e));
    }
    p.ws_p[(bh * slots + s) * n + e] = prefix;
  }
}

// The templated kernels are instantiated from kernels/instances.rs:
//   lasp_gla_states_dk*           kernel 1, grid (Dv/64, (S-1)*R, B*H), block LASP_GLA_STATES_THREADS
//   lasp_gla_output_dk*_dv{64,128} kernel 3, grid (1, S, B*H), block lasp_gla_output_threads(Dv)
//   (_packed: over packed documents; _entries: also the states their final states start from)
