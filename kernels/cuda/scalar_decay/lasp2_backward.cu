// LASP-2 backward with scalar decay: the kernels of its exchange, for sm_90a. The rest of the
// backward is the single-GPU backward of the shard (scalar_decay/backward.cu and the forward's chunk
// kernels), started from the shard's forward start state P_me and the carried gradient D_me.
//
// PE `me` of `npes` holds T_local tokens of every sequence. Per (b, h), with D_me the gradient with
// respect to the state leaving the shard (dht on the last PE):
//   dM_me = sigma e^{a_0} sum_t e^{G_t - G_0} q_t^T do_t (the gradient with respect to the state
//   entering the shard, from its own tokens), Lambda_me = sum of the shard's log-decays;
//   D_me = fold_{u > me, descending} (D = e^{Lambda_u} D + dM_u) from dht           (kernels/docs/
//   maths.md, "LASP-2: backward"; reference::lasp2::backward's `suffixes`).
// That is the forward's chain run the other way (lasp/exchange/chain_params.h, LASP2_CHAIN_DESCENDING):
//   1. lasp_lasp2_states_reversed_dk{64,128}  every segment of the shard, tokens from last to first,
//                                   with k = Q and v = dO: R_s from zero, Lambda_s
//   2. lasp_lasp2_fold_put          (scalar_decay/lasp2_fold_put.cu) dM_me, Lambda_me (the last PE: e^{Lambda} dht +
//                                   dM) into the own slot; credits; DEVICE_PUT: put + signal to
//                                   every EARLIER PE
//   3. lasp_lasp2_carry_in_dk{64,128}  per (Dv tile, b*H+h): waits for the later PEs' tiles, folds
//                                   them in chain order -> start_state = D_me
//   4. lasp_lasp2_advance_epoch     (scalar_decay/lasp2_fold_put.cu)
// The host runs the shard's dq pass (it needs P_me only) between 2 and 3, so the puts travel
// behind it. Kernel 1's R_s are also the segment states of the shard's dv pass (and transposed, of
// its dk pass): the shard's backward folds its reversed passes' starts from them
// (lasp_sd_bwd_reversed_starts) instead of running a states pass of its own.
#include "lasp/scalar_decay/lasp2_summary.cuh"

namespace lasp {
namespace l2 {

// Kernel 3: start_state tile = h0 tile (dht, on the last PE) or 0, folded with the tiles of the
// PEs before this one on the chain, in chain order (the same fold as the output kernel's prologue;
// under the pipelined chain the one relayed tile).
template <int DK, class Schedule>
__device__ __forceinline__ void carry_in(const lasp_lasp2_params& p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const StateLane ln{16 * warp, lane >> 2, lane & 3};
  const int64_t tile = (int64_t)bh * DK * p.Dv + vt * sd::kTileV;
  StateRegs<DK> s;
  if (p.h0 && Schedule::starts_from_h0(p))
    sd::state_load<DK>(s, ln, p.h0 + tile, p.Dv);
  else
    sd::state_zero<DK>(s, ln);
  if (!Schedule::wait(p, bh, vt)) return;  // the host reports p.diag
  fold_arrived_tiles<DK, Schedule>(p, s, ln, bh, vt, smem);
  sd::state_store<DK>(s, ln, p.start_state + tile, p.Dv);
}

}  // namespace l2
}  // namespace lasp

// Exported from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_lasp2_states_reversed_dk*  kernel 1 (shard_states, reversed): R_s (zero start) and Lambda_s of
//                                   ALL S segments, tokens from last to first (the host passes q as k
//                                   and dO as v); grid lasp2_states_grid, block LASP2_THREADS, smem
//                                   lasp2_states_smem_bytes(Dk)
//   lasp_lasp2_carry_in_dk*         kernel 3 (carry_in): grid lasp2_fold_put_grid, block LASP2_THREADS,
//                                   smem lasp2_carry_in_smem_bytes(Dk)
