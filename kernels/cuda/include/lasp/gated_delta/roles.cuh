// Gated DeltaNet's two-role output loop (kernels/docs/gated-delta.md, "The next build"): scalar
// decay's two-role kernel (lasp::sd::run_roles_segment_with) with the delta rule's values step in
// its state warpgroup. Per chunk i:
//   state warpgroup   values step (K S_i, R, u_i over the stage's V tile), hands chunk i to the
//                     output warpgroup (S_i's copy and u_i ready), then S_{i+1} = e^gamma S_i +
//                     K~^T u_i and S_{i+1}'s bf16 copy; it also copies the chunks' (I + L)^{-1}
//                     tiles and betas (cp.async, one chunk ahead)
//   output warpgroup  O = sigma (diag(e^b) Q S_i + (Q K^T ⊙ D) u_i), beside the state warpgroup's
//                     update of chunk i and values step of chunk i + 1
//   loading warp      Q, K, V tiles by tensor copies and the gates, kRolesDepth chunks in flight
// The loading warp's warpgroup gives its registers to the other two (setmaxnreg), whose loops need
// more than the 168 a 384-thread CTA starts with.
#pragma once
#include <stdint.h>

#include "lasp/gated_delta/forward_params.h"
#include "lasp/gated_delta/values.cuh"
#include "lasp/scalar_decay/chunk.cuh"
#include "lasp/tma.cuh"

namespace lasp {
namespace gdn {

// Chunks in flight: four stages (scalar decay's) do not fit beside the values step's tiles.
constexpr int kRolesDepth = LASP_GDN_ROLES_STAGES;

// Shared-memory map: scalar decay's two-role loop at kRolesDepth stages, its mbarriers, then from
// the next 1024-byte boundary the values step's tiles and betas (kRolesDepth slots each).
template <int DK>
struct RolesMap {
  using Loop = sd::Layout<DK, true, kRolesDepth>;
  static constexpr int kDepth = kRolesDepth;
  static constexpr uint32_t kLanded = Loop::kBytes;  // one mbarrier per stage
  static constexpr uint32_t kTileBytes = kChunk * kChunk * 2;
  static constexpr uint32_t kTri = (kLanded + 8 * kRolesDepth + 1023) / 1024 * 1024;
  static constexpr uint32_t kR = kTri + kRolesDepth * kTileBytes;
  static constexpr uint32_t kBeta = kR + kTileBytes;
  static constexpr uint32_t kBytes = kBeta + kRolesDepth * kChunk * 4;
  static_assert(kBytes == lasp_gdn_roles_smem_bytes(DK), "shared-memory map and host formula disagree");
};

// Named barriers (0 is __syncthreads): chunk i handed over (by i % 2), S_i's copy read (by i % 2),
// and the state warpgroup's own.
struct GdnRoleBarriers {
  static constexpr int kHanded = 1;
  static constexpr int kSbfEmpty = kHanded + 2;
  static constexpr int kState = kSbfEmpty + 2;
};

// Registers per thread after the hand-over: the loading warpgroup's go to the other two (128 x
// (24 + 2 x 240) = 64,512, what 384 threads x 168 started with). ptxas honours setmaxnreg only
// outside relocatable device code (C7504): built with -rdc this kernel spills at Dk = 128, without
// it none at either width.
constexpr int kLoadingRegisters = 24;
constexpr int kComputeRegisters = 240;

template <int kCount>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
}
template <int kCount>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
}

// The state warpgroup's barrier, for the values step.
struct StateGroupSync {
  __device__ __forceinline__ void operator()() const { named_barrier_sync(GdnRoleBarriers::kState, sd::kThreads); }
};

// One CTA's segment, Dv tile a.vt of b*H+h = a.bh, from the state `start` fills (state warpgroup);
// `end` gets the end state. Needs the Tensor Memory Accelerator (sm_90 and later).
template <int DK, class Start, class End>
__device__ __forceinline__ void run_roles_segment(const lasp_gated_delta_params& p, const sd::SegmentArgs& a,
                                                  const sd::QkvMaps& maps, Start&& start, End&& end) {
#if __CUDA_ARCH__ >= 900
  using M = RolesMap<DK>;
  using L = typename M::Loop;
  using B = GdnRoleBarriers;
  constexpr int kPair = 2 * sd::kThreads;      // arrivals per phase of kSbfEmpty: the two warpgroups
  constexpr int kAll = 2 * sd::kThreads + 32;  // of kHanded: the two warpgroups and the loading warp
  constexpr uint32_t kBlockBytes = kChunk * 128;  // one box: 64 tokens x 64 columns
  constexpr uint32_t kChunkBoxBytes = (2 * DK / 64 + 1) * kBlockBytes;  // Q, K and the V tile
  constexpr uint32_t kLandedArrivals = 1 + 32;  // the issuing lane's byte count and the warp's gate copies

  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const bool state_group = tid < 128, loading_group = tid >= 256, loading_warp = tid >= 256 && tid < 288;
  const int g = lane >> 2, t = lane & 3;
  const int T = a.T, n_chunks = a.n_chunks;
  const int b = a.bh / a.H, h = a.bh % a.H;
  const int64_t row_bt0 = (int64_t)b * T * a.H + h;  // token 0 of (b, h)
  const chunk::StateLane ln{16 * warp, g, t};
  const sd::FragOffsets<DK> off(warp, lane);
  const Values<DK, false, M> values{p};
  auto sbf = [](int i) { return L::kSbf + (i & 1) * L::kSbfBytes; };  // bf16 copy of S_i
  auto landed_bar = [&](int i) { return sbase + M::kLanded + 8 * (i % kRolesDepth); };
  auto wait_landed = [&](int i) { tma::wait(landed_bar(i), static_cast<uint32_t>(i / kRolesDepth) & 1u); };

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kRolesDepth; ++i) tma::init(landed_bar(i), kLandedArrivals);
    tma::fence_init();
    tma::prefetch_map(maps.q);
    tma::prefetch_map(maps.k);
    tma::prefetch_map(maps.v);
  }
  __syncthreads();

  const float* gate = a.g + row_bt0;
  auto issue_chunk = [&](int i) {  // by the loading warp: chunk i's Q, K, V tile and gates
    const uint32_t stage = sbase + L::stage(i), bar = landed_bar(i);
    const int tok0 = (a.c_begin + i) * kChunk;
    if (lane == 0) {
      tma::arrive_expect_bytes(bar, kChunkBoxBytes);
#pragma unroll
      for (int kb = 0; kb < DK / 64; ++kb) {
        tma::load_4d(stage + L::kQ + kb * kBlockBytes, maps.q, 64 * kb, h, tok0, b, bar);
        tma::load_4d(stage + L::kK + kb * kBlockBytes, maps.k, 64 * kb, h, tok0, b, bar);
      }
      tma::load_4d(stage + L::kV, maps.v, a.vt * sd::kTileV, h, tok0, b, bar);
    }
#pragma unroll
    for (int r = lane; r < kChunk; r += 32) {
      const bool ok = tok0 + r < T;
      cp_async_4(sbase + L::gates(i) + 4 * r, ok ? gate + (int64_t)(tok0 + r) * a.H : gate, ok);
    }
    tma::arrive_after_cp_async(bar);
  };
  if (loading_group) {
    release_registers<kLoadingRegisters>();
    if (!loading_warp) return;  // the group's other warps only gave their registers
    for (int i = 0; i < kRolesDepth && i < n_chunks; ++i) issue_chunk(i);
    // Chunk i handed over means the state warpgroup is done with chunk i - 1's stage (its update
    // of chunk i - 1 ended before the values step of chunk i), and the phase completes only once
    // the output warpgroup has reached chunk i, past chunk i - 1: chunk i + kRolesDepth - 1 goes
    // there.
    for (int i = 0; i < n_chunks; ++i) {
      named_barrier_sync(B::kHanded + i % 2, kAll);
      if (i >= 1 && i + kRolesDepth - 1 < n_chunks) issue_chunk(i + kRolesDepth - 1);
    }
    return;
  }

  claim_registers<kComputeRegisters>();
  if (state_group) {
    float s[DK / 64][8][4];
    start(s, ln);
    sd::store_state_bf16<DK>(smem, sbf(0), s, ln);
    // (I + L)^{-1} and betas of segment chunk i (sequence chunk c_begin + i), one commit group each.
    auto issue_values = [&](int i) {
      const int tok0 = (a.c_begin + i) * kChunk;
      values.issue(sbase, i, a.c_begin + i, tok0, min(kChunk, T - tok0), tid);
    };
    issue_values(0);
    cp_async_commit();
    float lambda = 0.f;  // segment log-decay, summed over chunks in order (deterministic)
    for (int i = 0; i < n_chunks; ++i) {
      if (i + 1 < n_chunks) issue_values(i + 1);
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of chunk i's tile and betas
      wait_landed(i);
      wg::fence_proxy_async();  // S_i's copy (and the tile) visible to wgmma
      StateGroupSync{}();       // every state thread's copies of chunk i have landed
      const uint32_t stage = sbase + L::stage(i);
      const sd::ChunkGates cg = sd::scan_gates(reinterpret_cast<const float*>(smem + L::gates(i)), warp, lane);
      lambda += cg.gamma;
      values.template apply<DK>(sbase, i, stage + L::kK, stage + L::kV, sbase + sbf(i), off, cg, warp, lane,
                                StateGroupSync{});
      named_barrier_arrive(B::kHanded + i % 2, kAll);  // S_i's copy and u_i for the output warpgroup
      sd::state_chunk<DK>(s, stage + L::kK, stage + L::kV, off, cg);
      if (i + 1 < n_chunks) {
        // S_{i+1}'s buffer last held S_{i-1}: the output warpgroup must be done reading it.
        if (i >= 1) named_barrier_sync(B::kSbfEmpty + (i + 1) % 2, kPair);
        sd::store_state_bf16<DK>(smem, sbf(i + 1), s, ln);
      }
    }
    end(s, ln, lambda);
  } else {
    uint16_t* o_tile = a.o + row_bt0 * a.Dv + a.vt * sd::kTileV + 2 * t;
    const int64_t v_stride = (int64_t)a.H * a.Dv;
    for (int i = 0; i < n_chunks; ++i) {
      wait_landed(i);
      named_barrier_sync(B::kHanded + i % 2, kAll);
      const uint32_t stage = sbase + L::stage(i);
      const sd::ChunkGates cg = sd::scan_gates(reinterpret_cast<const float*>(smem + L::gates(i)), warp, lane);
      // S_i's buffer is written again (with S_{i+2}) only if there is a chunk i + 2.
      auto sbf_read = [&] {
        if (i + 2 < n_chunks) named_barrier_arrive(B::kSbfEmpty + i % 2, kPair);
      };
      float o[8][4];  // O rows of this warp, 64 columns
      sd::output_role_chunk<DK>(o, stage + L::kQ, stage + L::kK, stage + L::kV, sbase + sbf(i), off, cg, warp, g, t,
                                a.scale, sbf_read);
      const int tok0 = (a.c_begin + i) * kChunk;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int tok = tok0 + 16 * warp + 8 * hh + g;
        if (tok < T) {
          uint16_t* dst = o_tile + tok * v_stride;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
            *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack_bf16x2(o[nt][2 * hh], o[nt][2 * hh + 1]);
        }
      }
    }
  }
#else
  __trap();
#endif
}

}  // namespace gdn
}  // namespace lasp
