// Scalar-decay linear attention, forward, chunkwise (C = 64), for sm_90a.
//
//   S_t = e^{a_t} S_{t-1} + k_t^T v_t,   o_t = sigma q_t S_t            (per batch b, head h)
//
// Per chunk n with chunk-local inclusive cumsum b_r and gamma = b_63:
//   O_n     = sigma ( diag(e^{b}) Q S_n  +  ((Q K^T) ⊙ D) V ),   D_rj = [r >= j] e^{b_r - b_j}
//   S_{n+1} = e^{gamma} S_n + (diag(e^{gamma - b}) K)^T V
//
// Three kernels (launch geometry and call order: lasp/scalar_decay_params.h):
//   1. lasp_scalar_decay_states_dk*  segment s < S-1: its local end state M_s from zero, Lambda_s
//   2. lasp_scalar_decay_fold        P_0 = h0, P_{s+1} = e^{Lambda_s} P_s + M_s      (LASP-2 folds
//                                    the other ranks' (M_w, Lambda_w) with the same fold_step)
//   3. lasp_scalar_decay_output_dk*  segment s from P_s: O for every token, S kept on chip in fp32,
//                                    the last segment writes the final state
// With S == 1 only kernel 3 runs.
//
// CTA = 4 warps, one (Dv tile of 64 columns, segment, b*H+h). Warp w owns output rows
// 16w..16w+15 of each chunk and state rows w*Dk/4 .. (w+1)*Dk/4-1 (all 64 columns of the tile).
// Tensor cores: mma.sync m16n8k16 bf16 -> fp32, operands through ldmatrix from swizzled smem.
// Pipeline: cp.async, kStages chunks in flight, one __syncthreads per chunk.
#include <math.h>
#include <stdint.h>

#include "lasp/mma.cuh"
#include "lasp/scalar_decay.cuh"
#include "lasp/scalar_decay_params.h"

namespace lasp {
namespace sd {

// Runs one CTA's segment. kOutput = false: the states kernel (K, V, gates only; writes M_s, Lambda_s).
// kOutput = true: the output kernel (starts from P_s, writes O and, for the last segment, ht).
template <int DK, bool kOutput>
__device__ __forceinline__ void run_segment(const lasp_scalar_decay_params& p) {
  using L = Layout<DK, kOutput>;
  constexpr int kMT = DK / 64;            // 16-row m-tiles of the state per warp (DK/4 rows)
  constexpr int kKS = DK / 16;            // k-steps of 16 over Dk
  constexpr int kQKChunks = DK / 8;       // 16-byte chunks per Q/K row
  constexpr int kVChunks = kTileV / 8;    // 16-byte chunks per V-tile / state-tile row
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;  // fragment row group / column pair of this lane
  const int vt = blockIdx.x, seg = blockIdx.y, bh = blockIdx.z;
  const int b = bh / p.H, h = bh % p.H;
  const int T = p.T, Dv = p.Dv;
  const int n_seg_slots = p.num_segments - 1;  // workspace slots per (b, h)
  const int c_begin = seg * p.chunks_per_segment;
  const int n_chunks = min(p.chunks_per_segment, lasp_sd_num_chunks(T) - c_begin);  // >= 1 by the host's S

  // Token 0 of (b, h) and strides (elements) between consecutive tokens; fla layout [B, T, H, D].
  const int64_t row_bt0 = (int64_t)b * T * p.H + h;  // (b*T + 0)*H + h
  const int64_t qk_stride = (int64_t)p.H * DK, v_stride = (int64_t)p.H * Dv;
  const uint16_t* q = p.q + row_bt0 * DK;
  const uint16_t* k = p.k + row_bt0 * DK;
  const uint16_t* v = p.v + row_bt0 * Dv + vt * kTileV;
  const float* gate = p.g + row_bt0;

  // Chunk i of this segment -> stage i % kStages.
  auto issue_chunk = [&](int i) {
    const uint32_t stage = sbase + (i % kStages) * L::kStageBytes;
    const int tok0 = (c_begin + i) * kChunk;
    const int valid = min(kChunk, T - tok0);
    if constexpr (kOutput) copy_tile_async<kQKChunks>(stage + L::kQ, q + tok0 * qk_stride, qk_stride, valid, tid);
    copy_tile_async<kQKChunks>(stage + L::kK, k + tok0 * qk_stride, qk_stride, valid, tid);
    copy_tile_async<kVChunks>(stage + L::kV, v + tok0 * v_stride, v_stride, valid, tid);
    if (tid < kChunk) {
      const bool ok = tid < valid;
      cp_async_4(stage + L::kG + 4 * tid, ok ? gate + (int64_t)(tok0 + tid) * p.H : gate, ok);
    }
  };

  // This warp's fp32 state rows: s[mt][nt][2*hh + e] = S[d][c], d = d_warp + 16*mt + 8*hh + g,
  // c = 8*nt + 2*t + e (column within the Dv tile).
  const int d_warp = warp * (DK / 4);
  float s[kMT][8][4];
  auto state_elem_offset = [&](int mt, int nt, int hh) {
    return (int64_t)(d_warp + 16 * mt + 8 * hh + g) * Dv + vt * kTileV + 8 * nt + 2 * t;
  };

  // Start state: P_s for the output kernel (h0 or zero for s = 0), zero for the states kernel.
  {
    const float* src = nullptr;
    if constexpr (kOutput)
      src = seg > 0 ? p.ws_p + ((int64_t)bh * n_seg_slots + seg - 1) * DK * Dv
                    : p.h0 ? p.h0 + (int64_t)bh * DK * Dv : nullptr;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const float2 x = src ? *reinterpret_cast<const float2*>(src + state_elem_offset(mt, nt, hh))
                               : make_float2(0.f, 0.f);
          s[mt][nt][2 * hh] = x.x;
          s[mt][nt][2 * hh + 1] = x.y;
        }
  }

  // bf16 copy of the state tile for the Q S product: this warp writes its rows into buffer `buf`.
  auto store_state_bf16 = [&](uint32_t buf) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int d = d_warp + 16 * mt + 8 * hh + g;
          *reinterpret_cast<uint32_t*>(smem + buf + swizzle(d, nt, kVChunks) + 4 * t) =
              pack_bf16x2(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]);
        }
  };

  // Per-lane ldmatrix row offsets (swizzled). Every fragment load below is a buffer base + one of
  // these + a compile-time constant: moving a row by 16 keeps row % 8, and moving a chunk index by 8
  // leaves its low 3 bits (the swizzled ones) alone. Lane l addresses row (l & 7) + 8 * (one of its
  // bits 3, 4) and chunk + (the other bit) of its 8x8 matrix l / 8.
  const int l_row = lane & 7, l_b3 = (lane >> 3) & 1, l_b4 = lane >> 4;
  uint32_t off_q[4];   // Q A-fragment,  rows 16w + .., chunk 2m (+ 8 per 4 k-steps)
  uint32_t off_k[4];   // K B-fragment,  rows 0.. (+ 16 per key n-tile pair), chunk 2m (+ 8 per 4 k-steps)
  uint32_t off_v[4];   // V / state B-fragment (.trans), rows 0.. (+ 16 per k-step), chunk 2m = n-tile pair m
  uint32_t off_kt[kMT];  // K^T A-fragment (.trans), rows 0.. (+ 16 per k-step), chunks of state rows d_warp + 16 mt
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    off_q[m] = swizzle(16 * warp + l_row + 8 * l_b3, 2 * m + l_b4, kQKChunks);
    off_k[m] = swizzle(l_row + 8 * l_b4, 2 * m + l_b3, kQKChunks);
    off_v[m] = swizzle(l_row + 8 * l_b3, 2 * m + l_b4, kVChunks);
  }
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) off_kt[mt] = swizzle(l_row + 8 * l_b4, (d_warp + 16 * mt) / 8 + l_b3, kQKChunks);
  constexpr uint32_t kQKRow16 = 16 * kQKChunks * 16;  // bytes of 16 rows of a Q/K tile
  constexpr uint32_t kVRow16 = 16 * kVChunks * 16;    // bytes of 16 rows of a V / state tile

  // Prologue: chunks 0 .. kStages-2 in flight (one commit group each, empty ones included, so the
  // wait count below is uniform).
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n_chunks) issue_chunk(i);
    cp_async_commit();
  }
  if constexpr (kOutput) store_state_bf16(L::kSbf);

  float lambda = 0.f;  // segment log-decay, summed over chunks in order (deterministic)
  for (int i = 0; i < n_chunks; ++i) {
    cp_async_wait<kStages - 2>();
    // After this barrier: chunk i is in smem for every thread; every warp is done with chunk i-1,
    // so its stage can be refilled and the bf16 state buffer it read can be rewritten.
    __syncthreads();
    if (i + kStages - 1 < n_chunks) issue_chunk(i + kStages - 1);
    cp_async_commit();

    const uint32_t stage = (i % kStages) * L::kStageBytes;
    const uint32_t sK = sbase + stage + L::kK;
    const uint32_t sV = sbase + stage + L::kV;
    const ChunkGates cg = scan_gates(reinterpret_cast<const float*>(smem + stage + L::kG), warp, lane);
    lambda += cg.gamma;

    // ---- Output, part 1: inter term Q S_n and the scores Q K^T (rows 16w..16w+15) ----
    float o[8][4] = {};     // O rows of this warp, 64 columns (8 n-tiles)
    uint32_t pa[4][4] = {};  // A fragments of sigma (Q K^T ⊙ D), one per 16-token k-step
    if constexpr (kOutput) {
      const uint32_t sQ = sbase + stage + L::kQ;
      const uint32_t sS = sbase + L::kSbf + (i & 1) * L::kSbfBytes;
      // Every warp computes all 64 key columns, although columns j > 16w+15 are masked: the warps then
      // run identical, branch-free instruction streams with 8 independent accumulator chains per
      // k-step, and the critical path (warp 3, which needs every column) is unchanged.
      float a[8][4] = {};
#pragma unroll
      for (int ks = 0; ks < kKS; ++ks) {
        uint32_t qa[4];
        ldsm_x4(qa, sQ + off_q[ks & 3] + 128 * (ks >> 2));
        // o += Q S_n (bf16 state from smem; B[k = d][n = c] stored row-major -> ldmatrix.trans).
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t sb[4];
          ldsm_x4_trans(sb, sS + off_v[np] + ks * kVRow16);
          mma_bf16(o[2 * np], qa, sb[0], sb[1]);
          mma_bf16(o[2 * np + 1], qa, sb[2], sb[3]);
        }
        // a += Q K^T (B[k = d][n = j] = K[j][d]: K stored [j][d] is B's transpose -> plain ldmatrix).
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t kb[4];
          ldsm_x4(kb, sK + off_k[ks & 3] + 128 * (ks >> 2) + np * kQKRow16);
          mma_bf16(a[2 * np], qa, kb[0], kb[1]);
          mma_bf16(a[2 * np + 1], qa, kb[2], kb[3]);
        }
      }

      // Row r of the inter term gets sigma e^{b_r}; scores get sigma [r >= j] e^{b_r - b_j}, then
      // become bf16 A fragments in place (accumulator layout of n-tiles 2kk, 2kk+1 = A layout of kk).
      const float row_scale[2] = {p.scale * exp_nonpos(cg.row[0]), p.scale * exp_nonpos(cg.row[1])};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          o[nt][2 * hh] *= row_scale[hh];
          o[nt][2 * hh + 1] *= row_scale[hh];
          const int r = 16 * warp + 8 * hh + g;
          const int j = 8 * nt + 2 * t;
          // Mask before the exp (-inf -> 0), so no branch and no inf reaches a product.
          const float d0 = exp_nonpos(j <= r ? cg.row[hh] - cg.col[nt][0] : -INFINITY);
          const float d1 = exp_nonpos(j + 1 <= r ? cg.row[hh] - cg.col[nt][1] : -INFINITY);
          const float x0 = p.scale * a[nt][2 * hh] * d0;
          const float x1 = p.scale * a[nt][2 * hh + 1] * d1;
          pa[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(x0, x1);
        }
    }

    // ---- Output, part 2 (intra term (QK^T ⊙ D) V) and the state update, sharing the V fragments ----
    // S <- e^gamma S + (diag(e^{gamma - b}) K)^T V: A[m = d][k = j] = K[j][d] (ldmatrix.trans), each
    // k column j scaled by e^{gamma - b_j} in fp32 before rounding to bf16.
    const float decay = exp_nonpos(cg.gamma);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] *= decay;
    float wk[8][2];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) wk[nt][e] = exp_nonpos(cg.gamma - cg.col[nt][e]);

#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 16-token k-steps of the chunk
      uint32_t vb[4][4];             // B fragments of V rows 16kk.., n-tiles 2np, 2np+1
#pragma unroll
      for (int np = 0; np < 4; ++np)
        ldsm_x4_trans(vb[np], sV + off_v[np] + kk * kVRow16);
      if constexpr (kOutput) {  // (k-steps kk > warp hold only masked zeros; kept for a branch-free stream)
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          mma_bf16(o[2 * np], pa[kk], vb[np][0], vb[np][1]);
          mma_bf16(o[2 * np + 1], pa[kk], vb[np][2], vb[np][3]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        uint32_t ka[4];
        ldsm_x4_trans(ka, sK + off_kt[mt] + kk * kQKRow16);
        ka[0] = scale_bf16x2(ka[0], wk[2 * kk][0], wk[2 * kk][1]);          // j = 16kk + 2t + {0,1}
        ka[1] = scale_bf16x2(ka[1], wk[2 * kk][0], wk[2 * kk][1]);
        ka[2] = scale_bf16x2(ka[2], wk[2 * kk + 1][0], wk[2 * kk + 1][1]);  // j = 16kk + 8 + 2t + {0,1}
        ka[3] = scale_bf16x2(ka[3], wk[2 * kk + 1][0], wk[2 * kk + 1][1]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          mma_bf16(s[mt][2 * np], ka, vb[np][0], vb[np][1]);
          mma_bf16(s[mt][2 * np + 1], ka, vb[np][2], vb[np][3]);
        }
      }
    }

    if constexpr (kOutput) {
      // O rows beyond T (ragged last chunk) are not stored.
      const int tok0 = (c_begin + i) * kChunk;
      uint16_t* o_tile = p.o + row_bt0 * Dv + vt * kTileV + 2 * t;
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
      if (i + 1 < n_chunks) store_state_bf16(L::kSbf + ((i + 1) & 1) * L::kSbfBytes);
    }
  }

  // Epilogue: the fp32 end state of the segment.
  float* dst = nullptr;
  if constexpr (kOutput) {
    if (seg == p.num_segments - 1) dst = p.ht ? p.ht + (int64_t)bh * DK * Dv : nullptr;
  } else {
    const int64_t slot = (int64_t)bh * n_seg_slots + seg;
    dst = p.ws_m + slot * DK * Dv;
    if (vt == 0 && tid == 0) p.ws_lambda[slot] = lambda;
  }
  if (dst) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
          *reinterpret_cast<float2*>(dst + state_elem_offset(mt, nt, hh)) =
              make_float2(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]);
  }
}

}  // namespace sd
}  // namespace lasp

// Pass 1: local end states of segments 0..S-2 (zero start) and their log-decays.
// grid lasp_sd_states_grid, block LASP_SD_THREADS, smem lasp_sd_states_smem_bytes(Dk); only when S > 1.
extern "C" __global__ void __launch_bounds__(LASP_SD_THREADS, 1)
    lasp_scalar_decay_states_dk64(const __grid_constant__ lasp_scalar_decay_params p) {
  lasp::sd::run_segment<64, false>(p);
}
extern "C" __global__ void __launch_bounds__(LASP_SD_THREADS, 1)
    lasp_scalar_decay_states_dk128(const __grid_constant__ lasp_scalar_decay_params p) {
  lasp::sd::run_segment<128, false>(p);
}

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
    prefix = lasp::sd::fold_step(prefix, p.ws_lambda[slot], p.ws_m[slot * n + e]);
    p.ws_p[slot * n + e] = prefix;
  }
}

// Pass 2: outputs of every segment from its prefix state; the last segment writes ht (if non-NULL).
// grid lasp_sd_output_grid, block LASP_SD_THREADS, smem lasp_sd_output_smem_bytes(Dk).
extern "C" __global__ void __launch_bounds__(LASP_SD_THREADS, 1)
    lasp_scalar_decay_output_dk64(const __grid_constant__ lasp_scalar_decay_params p) {
  lasp::sd::run_segment<64, true>(p);
}
extern "C" __global__ void __launch_bounds__(LASP_SD_THREADS, 1)
    lasp_scalar_decay_output_dk128(const __grid_constant__ lasp_scalar_decay_params p) {
  lasp::sd::run_segment<128, true>(p);
}
