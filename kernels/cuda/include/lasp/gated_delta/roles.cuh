// Gated DeltaNet's warp-specialised output loop (kernels/docs/gated-delta.md, "The WY form in
// three warpgroups"): the values of chunk n in the WY form,
//   u = U - W S_n,   U = (I + L)^{-1} diag(beta) V,   W = (I + L)^{-1} diag(beta e^b) K,
// where U and W depend on the chunk's inputs only, so they are computed beside the state's chain
// and the chain keeps two products per chunk (W S_n, then the state update). Per chunk i:
//   state warpgroup     u_i = T_u V_i + (-W_i) S_i in one accumulator (T_u = (I + L)^{-1}
//                       diag(beta), from V_i and S_i's bf16 copy), u_i over the stage's V tile and
//                       diag(e^{gamma - b}) u_i into a tile of its own; hands chunk i to the output
//                       warpgroup; S_{i+1} = e^gamma S_i + K^T diag(e^{gamma - b}) u_i and its bf16
//                       copy
//   WY warpgroup        T_u and -W of chunk i + 1 (its (I + L)^{-1} tile with the columns scaled
//                       by beta and beta e^b; -W from the latter times its K tile) while the state
//                       warpgroup runs chunk i; it copies the (I + L)^{-1} tiles and betas
//                       (cp.async, two chunks ahead)
//   output warpgroup    O_i = sigma (diag(e^b) Q S_i + (Q K^T ⊙ D) u_i), beside chunk i + 1's chain,
//                       written by a tensor copy from a staging tile (measured, stores of its
//                       own held the warpgroup at its next named barrier)
//   loading warp        Q, K, V tiles and the gates by tensor copies, kRolesDepth chunks in
//                       flight; a stage is filled again once the three warpgroups have released it
// Everything one warpgroup hands another in shared memory is read by the tensor cores (the bf16
// copies of S, u, T_u, -W). A chunk's gates come with its tiles, in a box of 64 tokens x 4 heads
// (the least a tensor copy's row takes) beside the stage: measured, a role's own loads from
// global memory held it at its next named barrier (0.2 us a chunk at B=4 T=8K). Where g cannot be
// mapped so (H not a multiple of 4), each role reads a chunk's 64 gates from global memory after
// the chunk has landed. The stages' gate slots of scalar decay's layout stay unused.
// The loading warp's warpgroup gives its registers to the other three (setmaxnreg).
#pragma once
#include <stdint.h>

#include "lasp/gated_delta/forward_params.h"
#include "lasp/scalar_decay/chunk.cuh"
#include "lasp/tma.cuh"

namespace lasp {
namespace gdn {

using sd::kChunk;

// Chunks in flight: four stages (scalar decay's) do not fit beside the WY form's tiles.
constexpr int kRolesDepth = LASP_GDN_ROLES_STAGES;
// Slots of the (I + L)^{-1} tiles and betas: chunk j's lands while the WY warpgroup works on
// chunks j - 2 and j - 1.
constexpr int kTriSlots = 3;

// Shared-memory map: scalar decay's two-role loop at kRolesDepth stages and an mbarrier per stage
// for its tensor copies, then from the next 1024-byte boundary the (I + L)^{-1} slots, T_u and the
// scaled u (bf16 [64 x 64] each), -W (bf16 [64 x DK], Q's tile layout), O's staging tile (the
// layout of o's boxes), the betas' slots and the stages' gate boxes (fp32 [64 tokens x 4 heads]).
// Every bf16 tile is swizzled and 1024-byte aligned, as wgmma and the tensor copies use it.
template <int DK>
struct RolesMap {
  using Loop = sd::Layout<DK, true, kRolesDepth>;
  static constexpr uint32_t kLanded = Loop::kBytes;
  static constexpr uint32_t kTileBytes = kChunk * kChunk * 2;
  static constexpr uint32_t kTri = (kLanded + 8 * kRolesDepth + 1023) / 1024 * 1024;
  static constexpr uint32_t kTu = kTri + kTriSlots * kTileBytes;
  static constexpr uint32_t kUScaled = kTu + kTileBytes;
  static constexpr uint32_t kW = kUScaled + kTileBytes;
  static constexpr uint32_t kOStage = kW + kChunk * DK * 2;
  static constexpr uint32_t kBeta = kOStage + kTileBytes;
  static constexpr uint32_t kGateBoxBytes = kChunk * LASP_GDN_GATE_BOX_HEADS * 4;
  static constexpr uint32_t kGateBoxes = kBeta + kTriSlots * kChunk * 4;
  static constexpr uint32_t kBytes = kGateBoxes + kRolesDepth * kGateBoxBytes;
  static_assert(kGateBoxes % 128 == 0, "tensor copies land 128-byte aligned");
  static_assert(kBytes == lasp_gdn_roles_smem_bytes(DK), "shared-memory map and host formula disagree");
};

// Named barriers (0 is __syncthreads). Handed and SbfEmpty alternate by chunk parity: the state
// warpgroup may run one chunk ahead of the output warpgroup's wait. Released cycles through the
// stages: a role may run up to kRolesDepth - 1 chunks ahead of the loading warp's wait.
struct GdnRoleBarriers {
  static constexpr int kHanded = 1;              // + i % 2: u_i and S_i's copy ready (state -> output)
  static constexpr int kSbfEmpty = kHanded + 2;  // + i % 2: S_i's copy read (output -> state)
  static constexpr int kState = kSbfEmpty + 2;   // the state warpgroup's own
  static constexpr int kWy = kState + 1;         // the WY warpgroup's own
  static constexpr int kWyReady = kWy + 1;       // T_u, -W of the next chunk written (WY -> state)
  static constexpr int kWyFree = kWyReady + 1;   // T_u, -W read (state -> WY)
  static constexpr int kReleased = kWyFree + 1;  // + i % depth: stage of chunk i read (roles -> loading)
  static constexpr int kReleasedArrivals = 3 * sd::kThreads + 32;  // the three warpgroups and the loading warp
  static constexpr int kOStaged = kReleased + kRolesDepth;  // the output warpgroup's own: O's staging written / free
  static_assert(kOStaged < 16, "sixteen named barriers");
};

// Registers per thread after the hand-over: the loading warpgroup's go to the other three, most to
// the state warpgroup, whose state and u are live at once (128 x (24 + 176 + 152 + 160) = 65,536,
// what 512 threads x 128 started with; at Dk = 128 ptxas spills the state's loop with 160 and
// serialises the WY warpgroup's wgmmas with 152). ptxas honours setmaxnreg only outside
// relocatable device code (C7504): this kernel is built without -rdc.
constexpr int kLoadingRegisters = 24;
constexpr int kStateRegisters = 176;
constexpr int kOutputRegisters = 152;
constexpr int kWyRegisters = 160;
static_assert(kLoadingRegisters + kStateRegisters + kOutputRegisters + kWyRegisters <= 512, "the register file");

template <int kCount>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCount));
}
template <int kCount>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kCount));
}

// The column factors of the WY form for this lane's A-fragment columns j = 8 nt + 2 t + e of a
// chunk: beta_j (T_u) and beta_j e^{b_j} (W).
struct WyFactors {
  float u[8][2], w[8][2];
  __device__ __forceinline__ WyFactors(const float* s_beta, const sd::ChunkGates& cg, int t) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        u[nt][e] = s_beta[8 * nt + 2 * t + e];
        w[nt][e] = u[nt][e] * chunk::exp_nonpos(cg.col[nt][e]);
      }
  }
};

// A fragment of k-step kk of (I + L)^{-1} (this warp's 16 rows) with column j scaled by f[j]:
// registers 0, 1 hold columns 16 kk + 2 t + e, registers 2, 3 columns 16 kk + 8 + 2 t + e.
__device__ __forceinline__ void scale_columns(uint32_t (&dst)[4], const uint32_t (&src)[4], const float (&f)[8][2],
                                              int kk) {
  dst[0] = scale_bf16x2(src[0], f[2 * kk][0], f[2 * kk][1]);
  dst[1] = scale_bf16x2(src[1], f[2 * kk][0], f[2 * kk][1]);
  dst[2] = scale_bf16x2(src[2], f[2 * kk + 1][0], f[2 * kk + 1][1]);
  dst[3] = scale_bf16x2(src[3], f[2 * kk + 1][0], f[2 * kk + 1][1]);
}

// Arrives on Released + i % depth once the calling warpgroup is done with chunk i's stage, if the
// loading warp waits for it (a chunk i + depth exists).
__device__ __forceinline__ void release_stage(int i, int n_chunks) {
  using B = GdnRoleBarriers;
  if (i + kRolesDepth < n_chunks) named_barrier_arrive(B::kReleased + i % kRolesDepth, B::kReleasedArrivals);
}

// One CTA's segment, Dv tile a.vt of b*H+h = a.bh, from the state `start` fills (state warpgroup);
// `end` gets the end state. Needs the Tensor Memory Accelerator and wgmma (sm_90a).
// o_map: o's map in the boxes of v's; gate_map: g's map in boxes of 64 tokens x 4 heads, or null:
// each role then reads the gates from global memory.
template <int DK, class Start, class End>
__device__ __forceinline__ void run_roles_segment(const lasp_gated_delta_params& p, const sd::SegmentArgs& a,
                                                  const sd::QkvMaps& maps, const lasp_tensor_map& o_map,
                                                  const lasp_tensor_map* gate_map, Start&& start, End&& end) {
#if LASP_SD_WGMMA
  using M = RolesMap<DK>;
  using L = typename M::Loop;
  using F = sd::FragOffsets<DK>;
  using B = GdnRoleBarriers;
  constexpr int kPair = 2 * sd::kThreads;         // arrivals of the barriers between two warpgroups
  constexpr uint32_t kBlockBytes = kChunk * 128;  // one box: 64 tokens x 64 columns
  constexpr uint32_t kLandedArrivals = 1;  // the issuing lane's, with the byte count

  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int group = tid >> 7;  // 0 state, 1 output, 2 WY, 3 loading
  const bool loading_warp = tid >= 384 && tid < 416;
  const int g = lane >> 2, t = lane & 3;
  const int T = a.T, n_chunks = a.n_chunks;
  const int b = a.bh / a.H, h = a.bh % a.H;
  const int64_t row_bt0 = (int64_t)b * T * a.H + h;  // token 0 of (b, h)
  const chunk::StateLane ln{16 * warp, g, t};
  const F off(warp, lane);
  auto sbf = [](int i) { return L::kSbf + (i & 1) * L::kSbfBytes; };  // bf16 copy of S_i
  auto landed_bar = [&](int i) { return sbase + M::kLanded + 8 * (i % kRolesDepth); };
  auto wait_landed = [&](int i) { tma::wait(landed_bar(i), static_cast<uint32_t>(i / kRolesDepth) & 1u); };
  // Segment chunk i's gates a_{2 lane}, a_{2 lane + 1} (0 past T), as scan_gates takes them, once
  // the chunk has landed: from its stage's gate box (head h % 4 of the box's four), or from
  // global memory.
  const bool gates_in_box = gate_map != nullptr;
  auto chunk_gates = [&](int i) {
    if (gates_in_box) {
      const float* box = reinterpret_cast<const float*>(smem + M::kGateBoxes + (i % kRolesDepth) * M::kGateBoxBytes);
      const int at = 2 * lane * LASP_GDN_GATE_BOX_HEADS + h % LASP_GDN_GATE_BOX_HEADS;
      return make_float2(box[at], box[at + LASP_GDN_GATE_BOX_HEADS]);
    }
    const int tok = (a.c_begin + i) * kChunk + 2 * lane;
    const float* at = a.g + row_bt0 + (int64_t)tok * a.H;
    return make_float2(tok < T ? __ldg(at) : 0.f, tok + 1 < T ? __ldg(at + a.H) : 0.f);
  };

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kRolesDepth; ++i) tma::init(landed_bar(i), kLandedArrivals);
    tma::fence_init();
    tma::prefetch_map(maps.q);
    tma::prefetch_map(maps.k);
    tma::prefetch_map(maps.v);
    tma::prefetch_map(o_map);
    if (gates_in_box) tma::prefetch_map(*gate_map);
  }
  __syncthreads();

  if (group == 3) {
    release_registers<kLoadingRegisters>();
    if (!loading_warp) return;  // the group's other warps only gave their registers
    for (int i = 0; i < n_chunks; ++i) {  // chunk i's Q, K, V tile
      // Stage i % depth last held chunk i - depth: every role must have released it.
      if (i >= kRolesDepth) named_barrier_sync(B::kReleased + i % kRolesDepth, B::kReleasedArrivals);
      const uint32_t stage = sbase + L::stage(i);
      const int tok0 = (a.c_begin + i) * kChunk;
      if (lane == 0) {
        sd::load_chunk_tiles<DK, L>(stage, landed_bar(i), maps, a.vt, h, tok0, b,
                                    gates_in_box ? M::kGateBoxBytes : 0);
        if (gates_in_box)
          tma::load_3d(sbase + M::kGateBoxes + (i % kRolesDepth) * M::kGateBoxBytes, *gate_map,
                       h - h % LASP_GDN_GATE_BOX_HEADS, tok0, b, landed_bar(i));
      }
    }
    return;
  }

  const int wg_tid = tid & 127;  // thread of its warpgroup
  if (group == 0) {
    claim_registers<kStateRegisters>();
    float s[DK / 64][8][4];
    start(s, ln);
    sd::store_state_bf16<DK>(smem, sbf(0), s, ln);
    float lambda = 0.f;  // segment log-decay, summed over chunks in order (deterministic)
    for (int i = 0; i < n_chunks; ++i) {
      wait_landed(i);
      const sd::ChunkGates cg = sd::scan_gates(chunk_gates(i), warp, lane);
      wg::fence_proxy_async();  // S_i's copy visible to wgmma
      named_barrier_sync(B::kState, sd::kThreads);
      const uint32_t stage = sbase + L::stage(i);
      lambda += cg.gamma;

      // u_i = T_u V_i + (-W_i) S_i in one accumulator.
      float acc[8][4];
      named_barrier_sync(B::kWyReady, kPair);
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wg::mma_ss<wg::Major::kMN>(acc, wg::desc_sw128(sbase + M::kTu + 32 * kk),
                                   wg::desc_sw128(stage + L::kV + kk * F::kRow16), kk > 0);
#pragma unroll
      for (int ks = 0; ks < DK / 16; ++ks)
        wg::mma_ss<wg::Major::kMN>(acc, wg::desc_sw128(sbase + M::kW + kBlockBytes * (ks >> 2) + 32 * (ks & 3)),
                                   wg::desc_sw128(sbase + sbf(i) + ks * F::kRow16), true);
      wg::commit();
      sd::scale_state<DK>(s, cg);  // e^gamma S_i, beside the products
      wg::wait<0>();
      wg::fence_operands(acc);
      if (i + 1 < n_chunks) named_barrier_arrive(B::kWyFree, kPair);

      // u_i over the V tile for the output, diag(e^{gamma - b}) u_i for the update (bf16 both).
      const float one[2] = {1.f, 1.f};
      const float to_end[2] = {chunk::exp_nonpos(cg.gamma - cg.row[0]), chunk::exp_nonpos(cg.gamma - cg.row[1])};
      sd::store_rows_bf16(smem + L::stage(i) + L::kV, acc, one, warp, g, t);
      sd::store_rows_bf16(smem + M::kUScaled, acc, to_end, warp, g, t);
      wg::fence_proxy_async();
      named_barrier_sync(B::kState, sd::kThreads);
      named_barrier_arrive(B::kHanded + i % 2, kPair);  // S_i's copy and u_i for the output warpgroup

      // S_{i+1} = e^gamma S_i + K^T diag(e^{gamma - b}) u_i: A = K^T (the K tile, MN-major).
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int mt = 0; mt < DK / 64; ++mt)
          wg::mma_ss<wg::Major::kMN, wg::Major::kMN>(s[mt],
                                                     wg::desc_sw128(stage + L::kK + mt * kBlockBytes + kk * F::kRow16),
                                                     wg::desc_sw128(sbase + M::kUScaled + kk * F::kRow16), true);
      wg::commit();
      wg::wait<0>();
#pragma unroll
      for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
      release_stage(i, n_chunks);
      if (i + 1 < n_chunks) {
        // S_{i+1}'s buffer last held S_{i-1}: the output warpgroup must be done reading it.
        if (i >= 1) named_barrier_sync(B::kSbfEmpty + (i + 1) % 2, kPair);
        sd::store_state_bf16<DK>(smem, sbf(i + 1), s, ln);
      }
    }
    end(s, ln, lambda);
  } else if (group == 2) {
    claim_registers<kWyRegisters>();
    // (I + L)^{-1} and betas of segment chunk j (sequence chunk c_begin + j) into slot j % kTriSlots.
    auto issue_tri = [&](int j) {
      const int chunk_id = a.c_begin + j, slot = j % kTriSlots;
      const int tok0 = chunk_id * kChunk;
      const uint16_t* tri = p.ws_tri + ((int64_t)a.bh * lasp_gdn_num_chunks(p.T) + chunk_id) * kChunk * kChunk;
      chunk::copy_tile_async<kChunk / 8, sd::kThreads>(sbase + M::kTri + slot * M::kTileBytes, tri, kChunk, kChunk,
                                                       wg_tid);
      if (wg_tid < kChunk) {
        const bool ok = tok0 + wg_tid < T;
        const float* beta = p.beta + ((int64_t)b * p.T + tok0 + wg_tid) * p.H + h;  // [b, tok0 + wg_tid, h]
        cp_async_4(sbase + M::kBeta + (slot * kChunk + wg_tid) * 4, ok ? beta : p.beta, ok);
      }
    };
    issue_tri(0);
    cp_async_commit();
    if (n_chunks > 1) issue_tri(1);
    cp_async_commit();
    for (int j = 0; j < n_chunks; ++j) {
      // T_u and -W of chunk j into their tiles, once the state warpgroup has read chunk j - 1's.
      cp_async_wait<1>();  // this thread's copies of chunk j's (I + L)^{-1} and betas (one group per chunk)
      wait_landed(j);
      const float2 gates_j = chunk_gates(j);
      named_barrier_sync(B::kWy, sd::kThreads);  // every thread's copies; slot (j + 2) % 3 read
      if (j + 2 < n_chunks) issue_tri(j + 2);
      cp_async_commit();
      const uint32_t stage = sbase + L::stage(j);
      uint32_t tu[4][4], tw[4][4];
      {
        const sd::ChunkGates cg = sd::scan_gates(gates_j, warp, lane);
        const WyFactors f(reinterpret_cast<const float*>(smem + M::kBeta) + (j % kTriSlots) * kChunk, cg, t);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t ta[4];
          ldsm_x4(ta, sbase + M::kTri + (j % kTriSlots) * M::kTileBytes + off.q[kk]);
          scale_columns(tu[kk], ta, f.u, kk);
          scale_columns(tw[kk], ta, f.w, kk);
        }
      }
      float w[DK / 64][8][4];  // written by the first k-step (no accumulate)
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int nb = 0; nb < DK / 64; ++nb)
          wg::mma_rs<wg::Major::kMN>(w[nb], tw[kk],
                                     wg::desc_sw128(stage + L::kK + nb * kBlockBytes + kk * F::kRow16), kk > 0);
      wg::commit();
      wg::wait<0>();
#pragma unroll
      for (int nb = 0; nb < DK / 64; ++nb) wg::fence_operands(w[nb]);
      release_stage(j, n_chunks);  // its K tile is read
      if (j >= 1) named_barrier_sync(B::kWyFree, kPair);
      // T_u in the A-fragment layout: register e of k-step kk is row 16 warp + g (+ 8 for e odd),
      // columns 16 kk + 8 (e / 2) + 2 t (+1).
      uint8_t* tu_tile = smem + M::kTu;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          *reinterpret_cast<uint32_t*>(tu_tile + swizzle(16 * warp + g + 8 * (e & 1), 2 * kk + (e >> 1), kChunk) +
                                       4 * t) = tu[kk][e];
      const float minus[2] = {-1.f, -1.f};
#pragma unroll
      for (int nb = 0; nb < DK / 64; ++nb) sd::store_rows_bf16(smem + M::kW + nb * kBlockBytes, w[nb], minus, warp, g, t);
      wg::fence_proxy_async();  // T_u and -W are read by the state warpgroup's wgmma
      named_barrier_arrive(B::kWyReady, kPair);
    }
  } else {
    claim_registers<kOutputRegisters>();
    const bool o_issuer = (tid & 127) == 0;  // the thread that copies O out
    for (int i = 0; i < n_chunks; ++i) {
      wait_landed(i);
      const sd::ChunkGates cg = sd::scan_gates(chunk_gates(i), warp, lane);
      named_barrier_sync(B::kHanded + i % 2, kPair);
      const uint32_t stage = sbase + L::stage(i);
      // S_i's buffer is written again (with S_{i+2}) only if there is a chunk i + 2.
      auto sbf_read = [&] {
        if (i + 2 < n_chunks) named_barrier_arrive(B::kSbfEmpty + i % 2, kPair);
      };
      float o[8][4];  // O rows of this warp, 64 columns
      sd::output_role_chunk<DK>(o, stage + L::kQ, stage + L::kK, stage + L::kV, sbase + sbf(i), off, cg, warp, g, t,
                                a.scale, sbf_read);
      release_stage(i, n_chunks);
      sd::store_o_staged(o, smem + M::kOStage, sbase + M::kOStage, B::kOStaged, o_issuer, o_map, a.vt * sd::kTileV,
                         h, (a.c_begin + i) * kChunk, b, warp, g, t);
    }
    if (o_issuer) tma::store_wait_all();
  }
#else
  __trap();
#endif
}

}  // namespace gdn
}  // namespace lasp
