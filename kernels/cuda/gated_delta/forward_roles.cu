// Gated DeltaNet's forward output kernel with roles (lasp/gated_delta/roles.cuh), for sm_90a: the
// output kernel of gated_delta/forward.cu in the WY form, its chain, its WY products and its output
// products in warpgroups of their own. Built without -rdc into a module of its own (kernels/instances.rs,
// STANDALONE_SOURCES): it hands registers between its warpgroups with setmaxnreg.
#include "lasp/gated_delta/affine.cuh"
#include "lasp/gated_delta/forward_params.h"
#include "lasp/gated_delta/roles.cuh"

namespace lasp {
namespace gdn {

using chunk::StateLane;
using chunk::StateRegs;

// Segment blockIdx.y of Dv tile blockIdx.x of b*H+h = blockIdx.z, from the state the fold left in
// ws_p (without a fold: h0 or zero); the last segment writes ht.
template <int DK>
__device__ __forceinline__ void run_output_roles(const lasp_gdn_roles_params& rp) {
  const lasp_gated_delta_params& p = rp.p;
  run_roles_segment<DK>(
      p, sd::segment_args(p), sd::QkvMaps{rp.q, rp.k, rp.v}, rp.o, rp.gates_by_tma ? &rp.g : nullptr,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        load_segment_start<DK>(p, blockIdx.z, blockIdx.y, blockIdx.x, s, ln);
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float) {
        if (blockIdx.y == p.num_segments - 1 && p.ht)
          chunk::state_store<DK>(s, ln, p.ht + (int64_t)blockIdx.z * DK * p.Dv + blockIdx.x * sd::kTileV, p.Dv);
      });
}

}  // namespace gdn
}  // namespace lasp

// Instantiated from kernels/instances.rs: lasp_gated_delta_output_roles_dk{64,128}, grid (Dv/64, S,
// B*H), block LASP_GDN_ROLES_THREADS, smem lasp_gdn_roles_smem_bytes(Dk).
