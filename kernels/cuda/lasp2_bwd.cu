// LASP-2 backward with scalar decay: the kernels of its exchange, for sm_90a. The rest of the
// backward is the single-GPU backward of the shard (scalar_decay_bwd.cu and the forward's chunk
// kernels), started from the shard's forward start state P_me and the carried gradient D_me.
//
// PE `me` of `npes` holds T_local tokens of every sequence. Per (b, h), with D_me the gradient with
// respect to the state leaving the shard (dht on the last PE):
//   dM_me = sigma e^{a_0} sum_t e^{G_t - G_0} q_t^T do_t (the gradient with respect to the state
//   entering the shard, from its own tokens), Lambda_me = sum of the shard's log-decays;
//   D_me = fold_{u > me, descending} (D = e^{Lambda_u} D + dM_u) from dht           (research/
//   kernel-anchors.md §5.4; reference::lasp2::backward's `suffixes`).
// That is the forward's chain run the other way (lasp2_params.h, LASP2_CHAIN_DESCENDING):
//   1. lasp_lasp2_states_reversed_dk{64,128}  every segment of the shard, tokens from last to first,
//                                   with k = Q and v = dO: R_s from zero, Lambda_s
//   2. lasp_lasp2_fold_put          (lasp2_chain.cu) dM_me, Lambda_me (the last PE: e^{Lambda} dht +
//                                   dM) into the own slot; credits; DEVICE_PUT: put + signal to
//                                   every EARLIER PE
//   3. lasp_lasp2_carry_in_dk{64,128}  per (Dv tile, b*H+h): waits for the later PEs' tiles, folds
//                                   them in chain order -> start_state = D_me
//   3b. lasp_lasp2_reversed_starts  per (32 x 32 tile, b*H+h): the start states of the shard's dv and
//                                   dk passes, from D_me and the R_s of kernel 1 (those passes then
//                                   run without states passes of their own)
//   4. lasp_lasp2_advance_epoch     (lasp2_chain.cu)
// The host runs the shard's dq pass (it needs P_me only) between 2 and 3, so the puts travel
// behind it.
#include "lasp/lasp2_chain.cuh"

namespace lasp {
namespace l2 {

// Kernel 3: start_state tile = h0 tile (dht, on the last PE) or 0, folded with the tiles of the
// PEs before this one on the chain, in chain order (the same fold as the output kernel's prologue).
template <int DK>
__device__ __forceinline__ void carry_in(const lasp_lasp2_params& p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const StateLane ln{16 * warp, lane >> 2, lane & 3};
  const int64_t tile = (int64_t)bh * DK * p.Dv + vt * sd::kTileV;
  StateRegs<DK> s;
  if (p.h0)
    sd::state_load<DK>(s, ln, p.h0 + tile, p.Dv);
  else
    sd::state_zero<DK>(s, ln);
  if (!wait_chain_tiles(p, bh, vt)) return;  // the host reports p.diag
  fold_chain_tiles<DK>(p, s, ln, bh, vt, smem);
  sd::state_store<DK>(s, ln, p.start_state + tile, p.Dv);
}

// Kernel 3b: the dv pass (tokens from last to first, K, Q, dO in the roles of q, k, v) starts
// segment 0 from D_me / sigma and segment s + 1 from P_{s+1} = e^{Lambda_s} P_s + R_s, where R_s,
// Lambda_s are kernel 1's (the same loop over the same tokens and segments as that pass's own
// states kernel, Q and dO in the same roles); the dk pass (V, dO, Q) starts from the transposes.
// The fold is elementwise, so the transposes are exact. Each thread folds 4 elements of the tile
// (rows row + 8 i, column lane) and writes them in rows; the transposes go through shared memory
// (rows padded to 33 floats), so that every global access is a whole 128-byte line.
__device__ __forceinline__ void reversed_starts(const lasp_lasp2_params& p) {
  constexpr int kTile = LASP2_STARTS_TILE, kRowsPerPass = LASP2_STARTS_THREADS / kTile;
  constexpr int kRows = kTile / kRowsPerPass;  // elements per thread
  __shared__ float tile[kTile][kTile + 1];
  const int bh = p.bh_begin + blockIdx.y, S = p.num_segments;
  const int64_t n = (int64_t)p.Dk * p.Dv;
  const int tiles_per_row = p.Dv / kTile;
  const int d0 = blockIdx.x / tiles_per_row * kTile, c0 = blockIdx.x % tiles_per_row * kTile;
  const int lane = threadIdx.x % kTile, row = threadIdx.x / kTile;
  const float* const carry = p.start_state + bh * n;
  float* const dht_scaled = p.start_state + lasp2_starts_dht_scaled(p.B, p.H, p.Dk, p.Dv) + bh * n;
  float* const dht_t_scaled = p.start_state + lasp2_starts_dht_t_scaled(p.B, p.H, p.Dk, p.Dv) + bh * n;
  float* const dv_prefixes = p.start_state + lasp2_starts_dv_prefixes(p.B, p.H, p.Dk, p.Dv) + bh * (S - 1) * n;
  float* const dk_prefixes = p.start_state + lasp2_starts_dk_prefixes(p.B, p.H, S, p.Dk, p.Dv) + bh * (S - 1) * n;
  const float* const r = p.ws_m + (int64_t)bh * S * n;  // R_s at r + s * n
  const float* const lam = p.ws_lambda + (int64_t)bh * S;

  auto at = [&](int i) { return (int64_t)(d0 + row + i * kRowsPerPass) * p.Dv + c0 + lane; };
  auto at_t = [&](int i) { return (int64_t)(c0 + row + i * kRowsPerPass) * p.Dk + d0 + lane; };
  // x: this thread's elements of the tile; writes them to `rows` and their transposes to `cols`.
  auto store = [&](const float (&x)[kRows], float* rows, float* cols) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      rows[at(i)] = x[i];
      tile[row + i * kRowsPerPass][lane] = x[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRows; ++i) cols[at_t(i)] = tile[lane][row + i * kRowsPerPass];
    __syncthreads();  // before the next store overwrites the tile
  };

  float x[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) x[i] = carry[at(i)] / p.scale;  // as lasp_sd_bwd_state_inputs
  store(x, dht_scaled, dht_t_scaled);
  for (int s = 0; s + 1 < S; ++s) {
    float m[kRows];
    const float l = __ldg(lam + s);
#pragma unroll
    for (int i = 0; i < kRows; ++i) m[i] = __ldg(r + s * n + at(i));
#pragma unroll
    for (int i = 0; i < kRows; ++i) x[i] = sd::fold_step(x[i], l, m[i]);
    store(x, dv_prefixes + s * n, dk_prefixes + s * n);
  }
}

}  // namespace l2
}  // namespace lasp

// Kernel 3b. grid lasp2_reversed_starts_grid, block LASP2_STARTS_THREADS, no dynamic smem.
extern "C" __global__ void __launch_bounds__(LASP2_STARTS_THREADS)
    lasp_lasp2_reversed_starts(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::reversed_starts(p);
}

// Kernel 1: R_s (zero start) and Lambda_s of ALL S segments of the shard, tokens from last to first
// (the host passes q as k and dO as v). grid lasp2_states_grid, block LASP2_THREADS,
// smem lasp2_states_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_states_reversed_dk64(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::shard_states<64, true>(p);
}
extern "C" __global__ void __launch_bounds__(LASP2_THREADS, 1)
    lasp_lasp2_states_reversed_dk128(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::shard_states<128, true>(p);
}

// Kernel 3. grid lasp2_fold_put_grid, block LASP2_THREADS, smem lasp2_carry_in_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP2_THREADS)
    lasp_lasp2_carry_in_dk64(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::carry_in<64>(p);
}
extern "C" __global__ void __launch_bounds__(LASP2_THREADS)
    lasp_lasp2_carry_in_dk128(const __grid_constant__ lasp_lasp2_params p) {
  lasp::l2::carry_in<128>(p);
}
