// LASP-2 forward with scalar decay and a device-initiated state exchange, for sm_90a.
//
// PE `me` of `npes` holds T_local tokens of every sequence. Per (b, h):
//   M_me = local end state from zero, Lambda_me = sum of the shard's log-decays      (kernels 1, 2)
//   (M_me, Lambda_me) goes to every later PE: one put-with-signal per (tile, peer)    (kernel 2)
//   P_me = fold_{u < me} (P = e^{Lambda_u} P + M_u) from h0; segment s starts from
//   e^{Lambda_0 + .. + Lambda_{s-1}} P_me + L_s (L_s = the fold of segments < s from zero,
//   kernel 1b); the chunk loop of the single-GPU output kernel from that start        (kernel 3)
//
// Kernels (geometry, buffers and call order: lasp/scalar_decay/lasp2_params.h; protocol: kernels/docs/lasp2.md):
//   1. lasp_lasp2_states_dk{64,128}  every segment s of the shard: M_s from zero, Lambda_s
//   1b. lasp_lasp2_segment_prefix    per (Dv tile, b*H+h), S > 1: L_1 .. L_{S-1}
//   2. lasp_lasp2_fold_put           (scalar_decay/lasp2_fold_put.cu) per (Dv tile, b*H+h): M_me, Lambda_me into the own
//                                    slot; credits; LASP2_DEVICE_PUT: put the tile + signal to every later PE
//   3. lasp_lasp2_output_dk{64,128}  per (Dv tile, segment, b*H+h): prologue fold, chunk loop, O, ht,
//                                    and P_me for the backward (start_state)
//   4. lasp_lasp2_advance_epoch      (scalar_decay/lasp2_fold_put.cu) *epoch += 1
//
// Only the put / signal API touches remote memory, so the same code runs over NVLink and InfiniBand.
#include "lasp/scalar_decay/lasp2_summary.cuh"

namespace lasp {
namespace l2 {

// Kernel 3: the CTA's start state, then the single-GPU chunk loop.
//   P = h0 tile (or 0); for u < me ascending: P = e^{Lambda_u} P + M_u (slot [parity][u][bh][vt]);
//   s > 0: P = e^{Lambda_0 + .. + Lambda_{s-1}} P + L_s (ws_p slot s - 1). One tile read whatever s
//   is: folding the s earlier segments here instead cost the last segment's CTA s tile reads on
//   the critical path (+20-40 us per launch at S = 16, run A of 2026-11-21).
// The fold is the same in every mode; LASP2_DEVICE_PUT only adds the wait for the tiles' signals.
// L_s and the Lambdas before it are local (segment_prefix ran earlier on this stream), so their
// loads start before the wait; the slot tiles are staged after it, kStagedTiles - 1 at a time.
// Segment 0's CTA starts from P_me itself, which it stores to start_state when asked (the
// backward's dq pass starts from it).
template <int DK, class Schedule>
__device__ __forceinline__ void output(const lasp_lasp2_params& p) {
  const sd::SegmentArgs a = group_segment_args(p);
  const int seg = blockIdx.y;
  const int64_t tile_elems = (int64_t)DK * p.Dv;  // one (b, h) state
  const int col0 = a.vt * sd::kTileV;
  sd::run_segment_with<DK>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        extern __shared__ __align__(1024) uint8_t smem[];
        constexpr uint32_t kSegmentSlot = (kStagedTiles - 1) * staged_tile_bytes<DK>();
        const uint32_t sbase = smem_addr(smem);
        const uint64_t stamps = lasp2_timeline_output(a.bh, a.vt, seg, p.B, p.H, p.Dv, p.num_segments);
        stamp(p, stamps + 0);
        float lambda_before = 0.f;  // summed in segment order, as fold_put sums Lambda_me
        if (seg > 0) {
          const int64_t first = (int64_t)a.bh * p.num_segments;
          stage_tile<DK>(sbase + kSegmentSlot, p.ws_p + (first + seg - 1) * tile_elems + col0, p.Dv, false);
          cp_async_commit();
          for (int sp = 0; sp < seg; ++sp) lambda_before += p.ws_lambda[first + sp];
        }
        if (p.h0 && Schedule::starts_from_h0(p))
          sd::state_load<DK>(s, ln, p.h0 + a.bh * tile_elems + col0, p.Dv);
        else
          sd::state_zero<DK>(s, ln);
        if (!Schedule::wait(p, a.bh, a.vt)) {
          cp_async_wait<0>();  // no copy may land in the pipeline's stages later
          return false;        // the host reports p.diag
        }
        stamp(p, stamps + 1);
        fold_arrived_tiles<DK, Schedule>(p, s, ln, a.bh, a.vt, smem);
        if (seg > 0) {
          cp_async_wait<0>();
          __syncthreads();
          fold_staged<DK>(s, ln, smem + kSegmentSlot, lambda_before);
          __syncthreads();
        } else if (p.start_state) {
          sd::state_store<DK>(s, ln, p.start_state + a.bh * tile_elems + col0, p.Dv);
        }
        stamp(p, stamps + 2);
        return true;
      },
      [&](StateRegs<DK>& s, const StateLane& ln, float) {
        if (p.write_final_state && p.ht && seg == p.num_segments - 1)
          sd::state_store<DK>(s, ln, p.ht + a.bh * tile_elems + col0, p.Dv);
      });
}

}  // namespace l2
}  // namespace lasp

// Exported from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_lasp2_states_dk*  kernel 1 (shard_states): end states M_s (zero start) and log-decays Lambda_s
//                          of ALL S segments of the shard; grid lasp2_states_grid, block LASP2_THREADS,
//                          smem lasp2_states_smem_bytes(Dk)
//   lasp_lasp2_output_dk*  kernel 3 (output): outputs of the shard from P_me; PE npes-1's last segment
//                          writes ht if write_final_state; grid lasp2_output_grid, block LASP2_THREADS,
//                          smem lasp2_output_smem_bytes(Dk)

// Kernel 1b (S > 1), one CTA per (Dv tile vt, head bh = bh_begin + blockIdx.y): the shard-local
// prefixes L_{s+1} = fold_{s' <= s} (e^{Lambda_s'} L + M_s') from zero -> ws_p slot s, s < S - 1.
// grid lasp2_fold_put_grid, block LASP2_FOLD_THREADS, no smem.
extern "C" __global__ void __launch_bounds__(LASP2_FOLD_THREADS)
    lasp_lasp2_segment_prefix(const __grid_constant__ lasp_lasp2_params p) {
  const int vt = blockIdx.x, bh = p.bh_begin + blockIdx.y;
  const int64_t state_elems = (int64_t)p.Dk * p.Dv;
  float* const p0 = p.ws_p + (int64_t)bh * p.num_segments * state_elems + vt * LASP2_TILE_V;
  float4 acc[lasp::l2::FoldLane::kMaxRows];
  lasp::l2::fold_segments(p, bh, vt, p.num_segments - 1, acc, [&](int s, float4 x, int d, int c) {
    *reinterpret_cast<float4*>(p0 + s * state_elems + (int64_t)d * p.Dv + c) = x;
  });
}
