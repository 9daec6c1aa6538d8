// Scalar-decay linear attention, forward, chunkwise (C = 64), for sm_90a.
//
//   S_t = e^{a_t} S_{t-1} + k_t^T v_t,   o_t = sigma q_t S_t            (per batch b, head h)
//
// Per chunk n with chunk-local inclusive cumsum b_r and gamma = b_63:
//   O_n     = sigma ( diag(e^{b}) Q S_n  +  ((Q K^T) ⊙ D) V ),   D_rj = [r >= j] e^{b_r - b_j}
//   S_{n+1} = e^{gamma} S_n + (diag(e^{gamma - b}) K)^T V
//
// Three kernels (launch geometry and call order: lasp/scalar_decay/forward_params.h):
//   1. lasp_scalar_decay_states_dk*  segment s < S-1: its local end state M_s from zero, Lambda_s
//   2. lasp_scalar_decay_fold        P_0 = h0, P_{s+1} = e^{Lambda_s} P_s + M_s      (LASP-2 folds
//                                    the other ranks' (M_w, Lambda_w) with the same fold_step)
//   3. lasp_scalar_decay_output_dk*  segment s from P_s: O for every token, S kept on chip in fp32,
//                                    the last segment writes the final state
// With S == 1 only kernel 3 runs.
// Plus timed variants of kernel 3 for measurement (lasp_scalar_decay_output_dk*_probe_*, see
// lasp::sd::Probe): launched like it, never part of the forward.
//
// CTA = 4 warps, one (Dv tile of 64 columns, segment, b*H+h). Warp w owns output rows
// 16w..16w+15 of each chunk and state rows w*Dk/4 .. (w+1)*Dk/4-1 (all 64 columns of the tile).
// Tensor cores: wgmma m64n64k16 bf16 -> fp32 on sm_90a (mma.sync m16n8k16 elsewhere), operands
// from swizzled smem. Pipeline: cp.async, kStages chunks in flight, one __syncthreads per chunk (the
// two-role kernel: tensor copies by a loading warp, mbarriers; lasp::sd::run_roles_segment_with).
// The states kernel walks its segment from the last chunk to the first with kStatesStages chunks in
// flight and V weighted in smem, so its update is a plain product (lasp::sd::run_states_segment).
#include <math.h>
#include <stdint.h>

#include "lasp/mma.cuh"
#include "lasp/scalar_decay/chunk.cuh"
#include "lasp/scalar_decay/forward_params.h"

namespace lasp {
namespace sd {

// One CTA's segment of the single-GPU forward: the shared segment loops with this forward's
// prologue and epilogue. kOutput = false: the states kernel (run_states_segment; writes M_s,
// Lambda_s). kOutput = true: the output kernel (run_segment_with; starts from P_s, writes O and, for
// the last segment, ht), with kRoles as two warpgroups and a loading warp (run_roles_segment_with,
// loading through `maps`), or with kProbe one of its timed variants (lasp::sd::Probe). kReversed:
// the time-reversed pass of the backward (lasp::sd::TimeAxis; the tensor maps of the two-role
// kernel address tokens in order only, so it has no reversed form). kBlockStates: the output kernel
// also writes its state at every block boundary of its segment to p.block_states (the backward's dq
// and dv passes, for the gate gradient: lasp_sd_block_slot, lasp::sd::state_store_tiles).
// kDocumentEntries: it also writes the state entering every chunk that p.entry_slots names
// (store_document_entry; the final states of packed documents).
template <int DK, bool kOutput, Probe kProbe = Probe::kNone, bool kRoles = false, bool kReversed = false,
          bool kBlockStates = false, bool kDocumentEntries = false>
__device__ __forceinline__ void run_segment(const lasp_scalar_decay_params& p, const QkvMaps* maps = nullptr,
                                            const lasp_tensor_map* o_map = nullptr) {
  static_assert(!(kRoles && kReversed), "the two-role kernel reads tokens in order only");
  static_assert(kOutput || !(kBlockStates || kDocumentEntries), "the states kernels write no states");
  static_assert(!(kReversed && kDocumentEntries), "documents' entry states are in order");
  const int seg = blockIdx.y;
  const SegmentArgs a = segment_args(p);
  const int n_seg_slots = p.num_segments - 1;  // workspace slots per (b, h)
  const int64_t tile_elems = (int64_t)DK * p.Dv;  // one (b, h) state
  const int col0 = a.vt * kTileV;
  if constexpr (kOutput) {
    auto start = [&](StateRegs<DK>& s, const StateLane& ln) {
      // P_s: the fold's prefix for s > 0, h0 (or zero) for s = 0.
      const float* src = seg > 0 ? p.ws_p + ((int64_t)a.bh * n_seg_slots + seg - 1) * tile_elems
                                 : p.h0 ? p.h0 + a.bh * tile_elems : nullptr;
      if (src)
        state_load<DK>(s, ln, src + col0, p.Dv);
      else
        state_zero<DK>(s, ln);
      return true;
    };
    auto end = [&](StateRegs<DK>& s, const StateLane& ln, float) {
      if (seg == p.num_segments - 1 && p.ht) state_store<DK>(s, ln, p.ht + a.bh * tile_elems + col0, p.Dv);
    };
    const int num_chunks = lasp_sd_num_chunks(p.T);
    const int64_t block_slots = lasp_sd_num_blocks(p.T);  // per (b, h)
    auto block_states = [&](StateRegs<DK>& s, const StateLane& ln, int chunk) {
      if constexpr (kBlockStates) {
        const int slot = lasp_sd_block_slot(num_chunks, chunk, kReversed);
        if (slot >= 0) {
          uint8_t* base = static_cast<uint8_t*>(p.block_states) + (a.bh * block_slots + slot) * tile_elems * 4;
          state_store_tiles<DK, !kReversed>(s, ln, base, a.vt, p.Dv / kTileV);
        }
      }
      if constexpr (kDocumentEntries) store_document_entry<DK>(p, a, s, ln, chunk);
    };
    if constexpr (kRoles)
      run_roles_segment_with<DK>(a, *maps, *o_map, start, end, block_states);
    else
      run_segment_with<DK, kProbe, kReversed>(a, start, end, block_states);
  } else {
    const int64_t slot = (int64_t)a.bh * n_seg_slots + seg;
    run_states_segment<DK, kReversed>(a, [&](StateRegs<DK>& s, const StateLane& ln, float lambda) {
      state_store<DK>(s, ln, p.ws_m + slot * tile_elems + col0, p.Dv);
      if (a.vt == 0 && threadIdx.x == 0) p.ws_lambda[slot] = lambda;
    });
  }
}

// The in-order walk of one segment from P_s (as the output kernel starts) that writes only the
// states store_document_entry takes: no Q is read and no O written (run_segment_with without O).
// For LASP-2 shards, from the state the forward saved as entering the shard (h0). Same grid as the
// one-warpgroup output kernel, block LASP_SD_THREADS, smem lasp_sd_update_smem_bytes(Dk).
template <int DK>
__device__ __forceinline__ void run_document_entries_walk(const lasp_scalar_decay_params& p) {
  const int seg = blockIdx.y;
  const SegmentArgs a = segment_args(p);
  const int64_t tile_elems = (int64_t)DK * p.Dv;
  const int col0 = a.vt * kTileV;
  run_segment_with<DK, Probe::kNone, false, false>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        const float* src = seg > 0 ? p.ws_p + ((int64_t)a.bh * (p.num_segments - 1) + seg - 1) * tile_elems
                                   : p.h0 ? p.h0 + a.bh * tile_elems : nullptr;
        if (src)
          state_load<DK>(s, ln, src + col0, p.Dv);
        else
          state_zero<DK>(s, ln);
        return true;
      },
      [](StateRegs<DK>&, const StateLane&, float) {},
      [&](StateRegs<DK>& s, const StateLane& ln, int chunk) { store_document_entry<DK>(p, a, s, ln, chunk); });
}

// Pass 2 as two warpgroups and a loading warp (run_roles_segment_with), for plans with S == 1:
// the host launches it instead of the one-warpgroup output kernel when one CTA per SM keeps every
// sequence whole. Its parameters add the tensor maps of q, k, v to the forward's
// (lasp_sd_roles_params); with kBlockStates it is the backward's dq pass, with kDocumentEntries the
// forward that also writes the states the documents' final states start from.
template <int DK, bool kBlockStates, bool kDocumentEntries = false>
__device__ __forceinline__ void run_roles_output(const lasp_sd_roles_params& rp) {
  const QkvMaps maps{rp.q, rp.k, rp.v};
  run_segment<DK, true, Probe::kNone, true, false, kBlockStates, kDocumentEntries>(rp.p, &maps, &rp.o);
}

}  // namespace sd
}  // namespace lasp

// Fold: ws_p slot s = P_{s+1} = e^{Lambda_s} P_s + M_s, ascending s, P_0 = h0 (or 0).
// grid lasp_sd_fold_grid, block LASP_SD_FOLD_THREADS, no smem; only when S > 1.
extern "C" __global__ void __launch_bounds__(LASP_SD_FOLD_THREADS)
    lasp_scalar_decay_fold(const __grid_constant__ lasp_scalar_decay_params p) {
  const int64_t n = (int64_t)p.Dk * p.Dv;
  const int64_t e = (int64_t)blockIdx.x * LASP_SD_FOLD_THREADS + threadIdx.x;
  if (e >= n) return;
  const int64_t bh = blockIdx.y;
  const int slots = p.num_segments - 1;
  float prefix = p.h0 ? p.h0[bh * n + e] : 0.f;
  for (int s = 0; s < slots; ++s) {
    const int64_t slot = bh * slots + s;
    // Read-only loads (the states kernel wrote ws_m and ws_lambda), so the compiler may issue them
    // ahead of the ws_p stores instead of one round trip per segment.
    prefix = lasp::sd::fold_step(prefix, __ldg(p.ws_lambda + slot), __ldg(p.ws_m + slot * n + e));
    p.ws_p[slot * n + e] = prefix;
  }
}

// The templated kernels are instantiated from kernels/instances.rs (per Dk in {64, 128}):
//   lasp_scalar_decay_states_dk*        pass 1: local end states of segments 0..S-2 (zero start) and
//                                       their log-decays; grid lasp_sd_states_grid, block
//                                       LASP_SD_THREADS, smem lasp_sd_states_smem_bytes(Dk); S > 1 only
//   lasp_scalar_decay_output_dk*        pass 2: outputs of every segment from its prefix state; the last
//                                       segment writes ht (if non-NULL); grid lasp_sd_output_grid, block
//                                       LASP_SD_THREADS, smem lasp_sd_output_smem_bytes(Dk)
//   lasp_scalar_decay_output_roles_dk*  pass 2 on two warpgroups (run_roles_output), block
//                                       LASP_SD_ROLES_THREADS, smem lasp_sd_roles_smem_bytes(Dk)
//   *_reversed_*                        the backward's time-reversed passes
//                                       (lasp/scalar_decay/backward_params.h): the tokens from last to
//                                       first, token t taking the log-decay a_{T-t} (0 for t = 0); same
//                                       grids, blocks and shared memory; the fold is direction-free
//   *_block_states_*                    the backward's dq pass (in order) and dv pass (reversed), also
//                                       writing the block states the gate gradient takes
//   *_document_entries_*                the output kernels that also write the states entering the
//                                       chunks p.entry_slots names (the final states of packed
//                                       documents), and the walk that writes only those
//                                       (run_document_entries_walk)
//   lasp_scalar_decay_output_dk*_probe_{memory,compute,no_exp}
//                                       probes of pass 2 (Probe; kernels/docs/scalar-decay.md,
//                                       "Probes"): launched like it to time parts of its work; their O
//                                       is not the forward's output
