// The fold of GLA's exchanged and local summary tiles into a warpgroup's state registers
// (gla/lasp2_forward.cu, gla/lasp2_backward.cu): s = diag(e^{Lambda}) s + M.
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/gla/chunk.cuh"

namespace lasp {
namespace gla {

// s = diag(e^{Lambda}) s + M for an exchanged tile (M rows [d][64], then Lambda [d]) in global
// memory, read through L2 (ld.global.cg: another PE wrote it).
template <int DK>
__device__ __forceinline__ void fold_landed_tile(StateRegs<DK>& s, const StateLane& ln, const float* tile) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const float2 m = __ldcg(reinterpret_cast<const float2*>(tile + d * LASP2_TILE_V + c));
    const float l = __ldcg(tile + DK * LASP2_TILE_V + d);
    x0 = fold_step(x0, l, m.x);
    x1 = fold_step(x1, l, m.y);
  });
}

// s = diag(e^{Lambda}) s + M for a tile of rows [d][ld] (fp32) and Lambda [d].
template <int DK>
__device__ __forceinline__ void fold_tile(StateRegs<DK>& s, const StateLane& ln, const float* rows, int64_t ld,
                                          const float* lambda) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const float2 m = *reinterpret_cast<const float2*>(rows + d * ld + c);
    const float l = lambda[d];
    x0 = fold_step(x0, l, m.x);
    x1 = fold_step(x1, l, m.y);
  });
}

}  // namespace gla
}  // namespace lasp
