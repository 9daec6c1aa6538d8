// The fold of the summary tiles other PEs sent, for Gated DeltaNet's LASP-2 forward and backward
// (gated_delta/lasp2_forward.cu, gated_delta/lasp2_backward.cu): the tile layout of
// lasp/gated_delta/lasp2_params.h read where it landed, folded on lasp/gated_delta/affine.cuh.
#pragma once
#include "lasp/exchange/chain.cuh"
#include "lasp/gated_delta/affine.cuh"
#include "lasp/gated_delta/lasp2_params.h"

namespace lasp {
namespace gdn {

// A's column block jb in the tiles of a head that landed from one PE, `landed` its tile for Dv tile
// vt: the head's tiles are consecutive, so tile t is (t - vt) tiles away.
template <int DK>
__device__ __forceinline__ const float* landed_a_block(const lasp_gated_delta_lasp2_params& p, const float* landed,
                                                       int vt, int jb) {
  const int vtiles = p.Dv / 64;
  return landed + (jb % vtiles - vt) * (int64_t)lasp_gdn_lasp2_tile_floats(DK, p.Dv) + (1 + jb / vtiles) * DK * 64;
}

// Waits (bounded) for every tile of head bh from the PEs before this one on the chain (the fold of
// column tile vt reads A from all of them), then folds them into P in chain order: P = A_u P + b_u on
// the forward's chain, P = A_u^T P + c_u on the backward's (kTransposed). False on every thread if a
// wait expired (p.diag names the PE, slot and epoch).
template <int DK, class Schedule, bool kTransposed>
__device__ __forceinline__ bool fold_landed(const lasp_gated_delta_lasp2_params& p, AffineTile<DK>& tile, int bh,
                                            int vt) {
  for (int t = 0; t < p.Dv / 64; ++t)
    if (!Schedule::wait(p, bh, t)) return false;
  const float* arrived = nullptr;
  Schedule::fold_arrived(
      p, bh, vt, lasp_gdn_lasp2_tile_floats(DK, p.Dv), 1, [&](int, const float* landed) { arrived = landed; },
      [&](int) {
        auto a_block = [&](int jb) { return landed_a_block<DK>(p, arrived, vt, jb); };
        if constexpr (kTransposed)
          tile.template apply_transposed<Source::kLanded>(a_block, arrived, 64);
        else
          tile.template apply<Source::kLanded>(a_block, arrived, 64);
      });
  return true;
}

}  // namespace gdn
}  // namespace lasp
