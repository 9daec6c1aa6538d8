// Gated DeltaNet's LASP-2 backward, for sm_90a: the forward's exchange run down the chain
// (LASP2_CHAIN_DESCENDING). Its chunk passes are the single-GPU backward's (gated_delta/backward.cu)
// and its summary kernel the forward's (gated_delta/lasp2_forward.cu, which composes the dS chain's
// c' on this chain); this file adds the fold of the later PEs' summaries into the gradient of the
// state leaving the shard. Maths and call order: lasp/gated_delta/lasp2_params.h.
#include "lasp/gated_delta/lasp2_fold.cuh"

namespace lasp {
namespace gdn {

// Kernel 7, one CTA per (Dv tile vt, head): E = dht (on the last PE, else 0), then E = A_u^T E + c_u
// for the later PEs in chain order, into ws_e (the single-GPU passes' dht), then the dS entering the
// shard's segments 1..S-1 over their c_s in ws_ds. The same fold in every mode.
template <int DK, class Schedule>
__device__ __forceinline__ void lasp2_bwd_fold(const lasp_gated_delta_lasp2_params& p) {
  __shared__ __align__(16) float s_tile[DK * 64];
  const lasp_gated_delta_params& f = p.fwd;
  const int vt = blockIdx.x, bh = blockIdx.y;
  const int64_t state = (int64_t)DK * f.Dv;
  AffineTile<DK> tile(s_tile);
  tile.load(p.dht ? p.dht + bh * state + vt * 64 : nullptr, f.Dv);
  if (!fold_landed<DK, Schedule, true>(p, tile, bh, vt)) return;  // the host reports p.diag
  tile.store(p.ws_e + bh * state + vt * 64, f.Dv);
  fold_segments_down<DK>(f, p.ws_ds, tile, bh, vt);
}

}  // namespace gdn
}  // namespace lasp

// The templated kernel is instantiated from kernels/instances.rs (geometry:
// lasp/gated_delta/lasp2_params.h): lasp_gated_delta_lasp2_bwd_fold_dk* (all-gather schedule).
