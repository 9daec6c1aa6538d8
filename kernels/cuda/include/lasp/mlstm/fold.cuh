// The fold of stabilised mLSTM states (kernels/docs/mlstm.md, "Plan"): a state (C, n, m)
// followed by a stretch of tokens whose summary from the empty state is (C_w, n_w, m_w) with log
// forget sum F. Used by the single-GPU forward's fold (mlstm/forward.cu) and by LASP-2's summary and
// fold (mlstm/lasp2_forward.cu), one thread per element of C or n, so that every fold of the same
// operands in the same order gives the same bits wherever it runs.
#pragma once
#include <math.h>
#include <stdint.h>

#include "lasp/chunk/state_tile.cuh"
#include "lasp/mlstm/forward_params.h"

namespace lasp {
namespace mlstm {

// logsigmoid(x) = min(x, 0) - log(1 + e^{-|x|}): no overflow for either sign.
__device__ __forceinline__ float log_sigmoid(float x) { return fminf(x, 0.f) - log1pf(expf(-fabsf(x))); }

// Per element x of C or n with the summary's element y: m' = max(F + m, m_w),
// x' = e^{F + m - m'} x + e^{m_w - m'} y. The empty state (m = -inf, C = n = 0) folded with a
// finite summary gives the summary exactly (factors 0 and 1); a finite state folded with an empty
// stretch's summary (m_w = -inf, F = 0) is itself.
struct Rescale {
  float prefix, summary, m;  // the two factors and m'
};
__device__ __forceinline__ Rescale fold_rescale(float m_prefix, float log_forget, float m_summary) {
  const float carried = log_forget + m_prefix;
  const float m = fmaxf(carried, m_summary);
  return {chunk::exp_nonpos(carried - m), chunk::exp_nonpos(m_summary - m), m};
}
__device__ __forceinline__ float fold_element(const Rescale& r, float x, float y) {
  return fmaf(r.prefix, x, r.summary * y);
}

// Element e of a head's state in the workspace's layout: C[d][c] at e = d * Dv + c (e < Dk * Dv),
// else n[e - Dk * Dv].
__device__ __forceinline__ bool is_c_element(const lasp_mlstm_params& p, int64_t e) {
  return e < (int64_t)p.Dk * p.Dv;
}

// Folds the states pass's pieces [begin, end) (workspace slots, in order) onto (x, m) for element
// e, adding their log forget gates to `log_forget` in the same order.
__device__ __forceinline__ void fold_pieces(const lasp_mlstm_params& p, int64_t e, int64_t begin, int64_t end,
                                            float& x, float& m, float& log_forget) {
  const int64_t nc = (int64_t)p.Dk * p.Dv;
  for (int64_t piece = begin; piece < end; ++piece) {
    const float f = __ldg(p.ws_f + piece);
    const Rescale r = fold_rescale(m, f, __ldg(p.ws_m + piece));
    const float y = is_c_element(p, e) ? __ldg(p.ws_c + piece * nc + e) : __ldg(p.ws_n + piece * p.Dk + (e - nc));
    x = fold_element(r, x, y);
    m = r.m;
    log_forget += f;
  }
}

// From the state (x, m) entering segment 0 of head bh: the state entering each segment s + 1 < S,
// the pieces of segments 0..s folded in order, into slot s of (ws_pc, ws_pn, ws_pm).
__device__ __forceinline__ void fold_segment_prefixes(const lasp_mlstm_params& p, int64_t bh, int64_t e, float x,
                                                      float m) {
  const int64_t nc = (int64_t)p.Dk * p.Dv;
  const int R = p.states_splits;
  const int64_t first_piece = bh * p.num_summaries * R;
  const int slots = p.num_segments - 1;
  for (int s = 0; s < slots; ++s) {
    float log_forget = 0.f;
    fold_pieces(p, e, first_piece + (int64_t)s * R, first_piece + (int64_t)(s + 1) * R, x, m, log_forget);
    const int64_t slot = bh * slots + s;
    if (is_c_element(p, e))
      p.ws_pc[slot * nc + e] = x;
    else
      p.ws_pn[slot * p.Dk + (e - nc)] = x;
    if (e == 0) p.ws_pm[slot] = m;
  }
}

}  // namespace mlstm
}  // namespace lasp
