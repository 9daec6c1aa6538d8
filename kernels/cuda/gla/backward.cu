// GLA backward (skeleton: bodies in progress).
#include <math.h>
#include <stdint.h>

#include "lasp/gla/backward_params.h"
#include "lasp/gla/chunk.cuh"

namespace lasp {
namespace gla {
template <int DK>
__device__ __forceinline__ void bwd_summary(const lasp_gla_bwd_params&) { __trap(); }
template <int DK>
__device__ __forceinline__ void bwd_walk(const lasp_gla_bwd_params&) { __trap(); }
template <int DK, int DV>
__device__ __forceinline__ void bwd_grads(const lasp_gla_bwd_params&) { __trap(); }
}  // namespace gla
}  // namespace lasp

extern "C" __global__ void __launch_bounds__(LASP_GLA_BWD_FOLD_THREADS)
    lasp_gla_bwd_fold(const __grid_constant__ lasp_gla_bwd_params p) { __trap(); }
