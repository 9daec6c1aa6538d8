// mLSTM (xLSTM's matrix LSTM, mlstm_kernels' mLSTMexp), forward, chunkwise (C = 64 on chip, the
// sequence cut into segments of whole chunks), for sm_90a.
//
// Three kernels (launch geometry and call order: lasp/mlstm/forward_params.h):
//   1. lasp_mlstm_states_dk*_dv*   segment s < num_summaries: its summary from the empty state
//                                  (C_s, n_s, m_s) and its summed log forget gate F_s, in pieces
//   2. lasp_mlstm_fold             P_0 = (c0, n0, m0) or (0, 0, 0); P_{s+1} = P_s folded with
//                                  segment s's pieces (lasp/mlstm/fold.cuh)
//   3. lasp_mlstm_output_dk*_dv*   segment s from P_s: h for every token, the state on chip in fp32;
//                                  the last segment writes the final state
// With S == 1 only kernel 3 runs. The chunk maths: lasp/mlstm/chunk.cuh.
#include <math.h>
#include <stdint.h>

#include "lasp/mlstm/chunk.cuh"
#include "lasp/mlstm/forward_params.h"

namespace lasp {
namespace mlstm {

// The chunks [c_begin, c_begin + n_chunks) of (b, h) = blockIdx.z.
__device__ __forceinline__ SegmentArgs segment_args(const lasp_mlstm_params& p, int c_begin, int n_chunks) {
  SegmentArgs a;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.i_gate = p.i_gate;
  a.f_gate = p.f_gate;
  a.o = p.o;
  a.row_m = p.row_m;
  a.row_den = p.row_den;
  a.row_log_scale = p.row_log_scale;
  a.row_dot_with = p.row_dot_with;
  a.row_dots = p.row_dots;
  a.reversed = p.reversed != 0;
  a.T = p.T;
  a.H = p.H;
  a.Dv = p.Dv;
  a.c_begin = c_begin;
  a.n_chunks = n_chunks;
  a.bh = blockIdx.z;
  a.scale = p.scale;
  a.eps = p.eps;
  a.starts = p.starts;
  a.entry_slots = p.entry_slots;
  a.document_c = p.document_c;
  a.document_n = p.document_n;
  a.entry_m = p.entry_m;
  a.documents = p.documents;
  return a;
}

// Kernel 1: piece u = blockIdx.y (piece r of segment s = u / R, s < S-1) from the empty state into
// workspace slot (b*H+h, u). A piece past its segment's end has no chunks: the identity summary
// (C = n = 0, m = -inf, F = 0). kGradient: a backward pass's (no normaliser: n stays 0). kPacked:
// over packed documents (p.starts); a piece holding a start sums to F = -inf and ends in its last
// document's state.
template <int DK, int DV, bool kGradient = false, bool kPacked = false>
__device__ __forceinline__ void run_states(const lasp_mlstm_params& p) {
  const int u = blockIdx.y, R = p.states_splits;
  const int per_piece = lasp_mlstm_chunks_per_piece(p.chunks_per_segment, R);
  const int seg_begin = (u / R) * p.chunks_per_segment;
  // The last segment (a LASP-2 shard's summary includes it) may hold fewer chunks.
  const int seg_chunks = min(p.chunks_per_segment, lasp_mlstm_num_chunks(p.T) - seg_begin);
  const int first = (u % R) * per_piece;  // within the segment
  const SegmentArgs a = segment_args(p, seg_begin + first, max(0, min(per_piece, seg_chunks - first)));
  const int64_t slot = (int64_t)a.bh * p.num_summaries * R + u;
  run_segment<DK, DV / kTileV, false, kGradient, kPacked>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln, int, float&) {
        chunk::state_zero<DK>(s, ln);
        return -INFINITY;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, int group, float n, float m, float log_forget) {
        chunk::state_store<DK>(s, ln, p.ws_c + slot * DK * DV + group * kTileV, DV);
        if (threadIdx.x < DK) p.ws_n[slot * DK + threadIdx.x] = n;
        if (threadIdx.x == 0) {
          p.ws_m[slot] = m;
          p.ws_f[slot] = log_forget;
        }
      });
}

// Kernel 3: segment blockIdx.y from its prefix; the last segment writes the final state.
// kGradient: a backward pass's (lasp/mlstm/backward_params.h). kPacked: over packed documents.
// kEntries (with kPacked): also the states entering the documents' last chunks (p.entry_slots).
template <int DK, int DV, bool kGradient = false, bool kPacked = false, bool kEntries = false>
__device__ __forceinline__ void run_output(const lasp_mlstm_params& p) {
  const int seg = blockIdx.y;
  const int c_begin = seg * p.chunks_per_segment;
  const SegmentArgs a =
      segment_args(p, c_begin, min(p.chunks_per_segment, lasp_mlstm_num_chunks(p.T) - c_begin));  // >= 1
  const int64_t bh = a.bh;
  const int64_t slot = bh * (p.num_segments - 1) + seg - 1;  // the prefix's, for seg > 0
  run_segment<DK, DV / kTileV, true, kGradient, kPacked, kEntries>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln, int group, float& n) {
        const float* c = seg > 0 ? p.ws_pc + slot * DK * DV : p.c0 ? p.c0 + bh * DK * DV : nullptr;
        if (!c) {
          chunk::state_zero<DK>(s, ln);
          return 0.f;  // mlstm_kernels' zero state: m_0 = 0
        }
        chunk::state_load<DK>(s, ln, c + group * kTileV, DV);
        const float* n0 = seg > 0 ? p.ws_pn + slot * DK : p.n0 + bh * DK;
        if (threadIdx.x < DK) n = n0[threadIdx.x];
        return seg > 0 ? p.ws_pm[slot] : p.m0[bh];
      },
      [&](StateRegs<DK>& s, const StateLane& ln, int group, float n, float m, float) {
        if (seg != p.num_segments - 1 || !p.c_t) return;
        chunk::state_store<DK>(s, ln, p.c_t + bh * DK * DV + group * kTileV, DV);
        if (threadIdx.x < DK) p.n_t[bh * DK + threadIdx.x] = n;
        if (threadIdx.x == 0) p.m_t[bh] = m;
      });
}

}  // namespace mlstm
}  // namespace lasp

// Kernel 2: slot s of (ws_pc, ws_pn, ws_pm) = P_{s+1}, the pieces of segments 0..s folded in order
// onto P_0 (lasp/mlstm/fold.cuh). One thread per element of C (e < Dk*Dv) or n (the next Dk) per
// b*H+h; every thread folds the stabilisers itself (same operations, same bits). Only when S > 1.
extern "C" __global__ void __launch_bounds__(LASP_MLSTM_FOLD_THREADS)
    lasp_mlstm_fold(const __grid_constant__ lasp_mlstm_params p) {
  const int64_t nc = (int64_t)p.Dk * p.Dv;
  const int64_t e = (int64_t)blockIdx.x * LASP_MLSTM_FOLD_THREADS + threadIdx.x;
  if (e >= nc + p.Dk) return;
  const int64_t bh = blockIdx.y;
  float x = 0.f, m = 0.f;  // mlstm_kernels' zero state
  if (p.c0) {
    x = lasp::mlstm::is_c_element(p, e) ? p.c0[bh * nc + e] : p.n0[bh * p.Dk + (e - nc)];
    m = p.m0[bh];
  }
  lasp::mlstm::fold_segment_prefixes(p, bh, e, x, m);
}

// The templated kernels are instantiated from kernels/instances.rs:
//   lasp_mlstm_states_dk*_dv{64,128}  kernel 1, grid (1, num_summaries*R, B*H), block lasp_mlstm_threads(Dv)
//   lasp_mlstm_output_dk*_dv{64,128}  kernel 3, grid (1, S, B*H), block lasp_mlstm_threads(Dv)
//   lasp_mlstm_grad_{states,output}_dk*_dv{64,128}  kernels 1 and 3 of the backward's gradient
//                                     passes (kGradient; lasp/mlstm/backward_params.h), launched alike
//   each with a twin *_packed for packed documents (kPacked: the masks at p.starts)
//   lasp_mlstm_output_dk*_dv{64,128}_entries  kernel 3's twin that also stores the states entering
//                                     the documents' last chunks (packed documents' final states)
