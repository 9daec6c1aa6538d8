// Gated DeltaNet, backward, chunkwise (C = 64), for sm_90a: the maths and the call sequence are in
// lasp/gated_delta/backward_params.h.
//
//   1. lasp_gated_delta_bwd_wy_dk*      the forward's (I + L)^{-1} of every chunk (same code, same
//                                       bits) and W = (I + L)^{-1} diag(beta e^b) K (lasp/gated_delta/wy.cuh)
//   2. (S > 1) the forward's segment summaries (all but the last segment's b, which nothing reads)
//              and fold: every segment's start state
//   3. lasp_gated_delta_bwd_states_dk*  the forward's chain again (the segment loop without O and
//                                       the values step), storing each chunk's entry state S_n and u
//   4. (S > 1) lasp_gated_delta_bwd_dh_summary_dk*  each later segment's dS chain from zero, c_s
//   5. (S > 1) lasp_gated_delta_bwd_fold_dk*        the dS entering every segment, A_s^T down the chain
//   6. lasp_gated_delta_bwd_dh_dk*      the chain of dS from the segment's last chunk to its first, one
//                                       CTA per 64 columns of Dv, segment and b*H+h: du and dS' of
//                                       every chunk, dh0
//   7. lasp_gated_delta_bwd_grads_dk*   every chunk at once: dq, dk, dv, dg, dbeta from the tiles the
//                                       passes stored
// The products are warpgroup-level wgmma on swizzled shared-memory tiles (lasp/chunk/tile_wgmma.cuh).
#include <math.h>
#include <stdint.h>

#include "lasp/chunk/tile_wgmma.cuh"
#include "lasp/gated_delta/affine.cuh"
#include "lasp/gated_delta/backward_params.h"
#include "lasp/gated_delta/values.cuh"
#include "lasp/gated_delta/wy.cuh"
#include "lasp/scalar_decay/chunk.cuh"

namespace lasp {
namespace gdn {

using chunk::exp_nonpos;
using chunk::publish;
using chunk::wg_issue;
using chunk::wg_settle;
using chunk::wg_tiles;
using chunk::StateLane;
using chunk::StateRegs;
using chunk::Tile;

constexpr unsigned kAll = 0xffffffffu;

// Kernel 1: chunk blockIdx.x of b*H+h = blockIdx.y.
template <int DK>
__device__ __forceinline__ void bwd_wy(const lasp_gated_delta_bwd_params& p) {
  run_wy<DK, true>(p.fwd, p.ws_w);
}

// The values step's store of u into ws_u (segment chunk i of segment blockIdx.y, Dv tile blockIdx.x).
struct StoreU {
  const lasp_gated_delta_bwd_params& p;
  __device__ __forceinline__ void operator()(int i, int warp, int g, int t, const float (&u)[8][4]) const {
    const int chunk = blockIdx.y * p.fwd.chunks_per_segment + i;
    const int64_t Dv = p.fwd.Dv;
    uint16_t* rows =
        p.ws_u + ((int64_t)blockIdx.z * lasp_gdn_num_chunks(p.fwd.T) + chunk) * kChunk * Dv + blockIdx.x * 64 + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        *reinterpret_cast<uint32_t*>(rows + r * Dv + 8 * nt) = pack_bf16x2(u[nt][2 * hh], u[nt][2 * hh + 1]);
    }
  }
};

// Kernel 3: Dv tile blockIdx.x of segment blockIdx.y of b*H+h = blockIdx.z, from the segment's start
// state (as the forward's output kernel): each chunk's entry state into ws_h and its u into ws_u.
template <int DK>
__device__ __forceinline__ void bwd_states(const lasp_gated_delta_bwd_params& p) {
  const lasp_gated_delta_params& f = p.fwd;
  const sd::SegmentArgs a = sd::segment_args(f);
  sd::run_segment_with<DK, sd::Probe::kNone, false, false>(
      a,
      [&](StateRegs<DK>& s, const StateLane& ln) {
        load_segment_start<DK>(f, blockIdx.z, blockIdx.y, blockIdx.x, s, ln);
        return true;
      },
      [](StateRegs<DK>&, const StateLane&, float) {},
      [&](StateRegs<DK>& s, const StateLane& ln, int c) {
        const int64_t Dv = f.Dv;
        uint16_t* tile =
            p.ws_h + ((int64_t)blockIdx.z * lasp_gdn_num_chunks(f.T) + c) * DK * Dv + blockIdx.x * sd::kTileV;
        chunk::state_store_bf16<DK>(s, ln, tile, Dv);
      },
      Values<DK, false, ValuesLayout<DK, false>, StoreU>{f, StoreU{p}});
}

// Kernels 4 and 6: Dv tile blockIdx.x of b*H+h = blockIdx.z, segment blockIdx.y (+ ds_summary_from
// in the summary kernel). The CTA holds dS (fp32, the forward's state layout) and walks the segment's
// chunks from the last to the first, two stages of Q, K, W, dO and gates in flight. Per chunk c,
// with dS' = dS leaving it (warp w: rows 16w.. of du; the state as the forward's loop splits it):
//   du  = diag(e^{gamma - b}) K dS' + P^T dO,   P^T_jr = sigma [r >= j] e^{b_r - b_j} (k_j . q_r)
//   dS' -> ws_dh[c], du -> ws_du[c], then dS = e^gamma dS' + (sigma diag(e^b) Q)^T dO - W^T du.
// kSummary: from zero, nothing stored but the segment's start, c_s, into ws_ds slot s (the dS
// chain is affine: dS entering segment s = A_s^T (dS leaving it) + c_s).
template <int DK, bool kSummary>
__device__ __forceinline__ void bwd_dh(const lasp_gated_delta_bwd_params& p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const lasp_gated_delta_params& f = p.fwd;
  constexpr uint32_t kRows = kChunk * DK * 2, kTile = kChunk * 64 * 2, kStateCopy = DK * 64 * 2;
  constexpr uint32_t kStage = lasp_gdn_bwd_dh_stage_bytes(DK);
  constexpr uint32_t kQ = 0, kK = kRows, kW = 2 * kRows, kDo = 3 * kRows, kGates = 3 * kRows + kTile;
  constexpr uint32_t kCopies = 2 * kStage, kDu = kCopies + 2 * kStateCopy;
  static_assert(kGates + 64 * 4 <= kStage && kDu + kTile == lasp_gdn_bwd_dh_smem_bytes(DK),
                "shared-memory map and host formula disagree");
  const uint32_t sbase = smem_addr(smem);
  const int vt = blockIdx.x, bh = blockIdx.z, b = bh / f.H, h = bh % f.H;
  const int segment = blockIdx.y + (kSummary ? p.ds_summary_from : 0);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int N = lasp_gdn_num_chunks(f.T);
  const int c_end = min(N, (segment + 1) * f.chunks_per_segment), n = c_end - segment * f.chunks_per_segment;
  const int64_t Dv = f.Dv, state = (int64_t)DK * Dv;

  // Chunk c_end-1-i into stage i % 2.
  auto issue = [&](int i) {
    const int c = c_end - 1 - i, tok0 = c * kChunk, valid = min(kChunk, f.T - tok0);
    const uint32_t st = sbase + (i & 1) * kStage;
    const int64_t row0 = ((int64_t)b * f.T + tok0) * f.H + h;
    sd::copy_tile_async<DK / 8>(st + kQ, f.q + row0 * DK, (int64_t)f.H * DK, valid, tid);
    sd::copy_tile_async<DK / 8>(st + kK, f.k + row0 * DK, (int64_t)f.H * DK, valid, tid);
    sd::copy_tile_async<DK / 8>(st + kW, p.ws_w + ((int64_t)bh * N + c) * kChunk * DK, DK, kChunk, tid);
    sd::copy_tile_async<8>(st + kDo, p.d_o + row0 * Dv + vt * 64, f.H * Dv, valid, tid);
    if (tid < kChunk) {
      const bool ok = tid < valid;
      cp_async_4(st + kGates + 4 * tid, ok ? f.g + row0 + (int64_t)tid * f.H : f.g, ok);
    }
  };

  const StateLane ln{16 * warp, lane >> 2, lane & 3};
  float s[DK / 64][8][4];
  const bool last = segment == f.num_segments - 1;
  if (!kSummary && !last)
    chunk::state_load<DK>(s, ln, segment_ds_tile<DK>(f, p.ws_ds, bh, segment + 1, vt), Dv);
  else if (!kSummary && p.dht)
    chunk::state_load<DK>(s, ln, p.dht + bh * state + vt * 64, Dv);
  else
    chunk::state_zero<DK>(s, ln);
  issue(0);
  cp_async_commit();
  sd::store_state_bf16<DK>(smem, kCopies, s, ln);

  const Tile du_tile{sbase + kDu, kChunk};
  for (int i = 0; i < n; ++i) {
    const int c = c_end - 1 - i;
    cp_async_wait<0>();
    // Chunk i and the copy of dS' are in place; every warp is done with chunk i-1's stage and tiles.
    publish();
    if (i + 1 < n) issue(i + 1);
    cp_async_commit();

    const uint32_t st = sbase + (i & 1) * kStage;
    const Tile q{st + kQ, kChunk}, k{st + kK, kChunk}, w{st + kW, kChunk}, d_o{st + kDo, kChunk};
    const Tile ds{sbase + kCopies + (i & 1) * kStateCopy, DK};
    const float* s_gates = reinterpret_cast<const float*>(smem + (i & 1) * kStage + kGates);
    const sd::ChunkGates cg = sd::scan_gates(s_gates, warp, lane);
    const int g = lane >> 2, t = lane & 3;

    // du for rows j = 16 warp + g (+ 8).
    float du[8][4] = {}, scores[8][4] = {};
    wg::fence();
    wg_issue<DK, 64, false, false>(du, k, 0, 0, ds, 0, 0);      // K dS'
    wg_issue<DK, 64, false, true>(scores, k, 0, 0, q, 0, 0);    // K Q^T
    wg::commit();
    wg_settle(du, scores);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int j = 16 * warp + 8 * hh + g;
        const float to_end = exp_nonpos(cg.gamma - cg.row[hh]);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int r = 8 * nt + 2 * t + e;
          du[nt][2 * hh + e] *= to_end;
          scores[nt][2 * hh + e] *= r >= j ? f.scale * exp_nonpos(cg.col[nt][e] - cg.row[hh]) : 0.f;
        }
      }
    uint32_t pt[4][4];
    chunk::acc_to_a(pt, scores);
    wg::fence();
    chunk::wg_issue_regs<64>(du, pt, d_o, 0, 0);
    wg::commit();
    wg_settle(du);

    uint16_t* du_rows = p.ws_du + ((int64_t)bh * N + c) * kChunk * Dv + vt * 64;
    chunk::for_each_acc_pair<64>(du, 16 * warp, 0, lane, [&](float& x0, float& x1, int r, int col) {
      if constexpr (!kSummary) *reinterpret_cast<uint32_t*>(du_rows + r * Dv + col) = pack_bf16x2(x0, x1);
      chunk::tile_pair(smem, sbase, du_tile, r, col) = pack_bf16x2(-x0, -x1);  // -du: the update adds W^T (-du)
    });
    if constexpr (!kSummary) chunk::state_store_bf16<DK>(s, ln, p.ws_dh + ((int64_t)bh * N + c) * state + vt * 64, Dv);
    publish();  // -du complete

    // dS <- e^gamma dS' + (sigma diag(e^b) Q)^T dO + W^T (-du): the query weights of this lane's
    // k indices 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-token step.
    sd::scale_state<DK>(s, cg);
    float wq[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int x = 0; x < 4; ++x) wq[ks][x] = f.scale * exp_nonpos(cg.col[2 * ks + (x >> 1)][x & 1]);
    uint32_t weighted_qt[DK / 64][4][4];
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt)
      chunk::weighted_a_fragments<64, true>(weighted_qt[mt], q, 64 * mt + 16 * warp, 0, wq, lane);
    wg::fence();
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt) {
      chunk::wg_issue_regs<64>(s[mt], weighted_qt[mt], d_o, 0, 0);
      wg_issue<64, 64, true, false>(s[mt], w, 64 * mt, 0, du_tile, 0, 0);
    }
    wg::commit();
    wg::wait<0>();
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
    if (i + 1 < n) sd::store_state_bf16<DK>(smem, kCopies + ((i + 1) & 1) * kStateCopy, s, ln);
  }
  if constexpr (kSummary)
    chunk::state_store<DK>(s, ln, segment_ds_tile<DK>(f, p.ws_ds, bh, segment, vt), Dv);
  else if (segment == 0 && p.dh0)
    chunk::state_store<DK>(s, ln, p.dh0 + bh * state + vt * 64, Dv);
}

// Kernel 5: Dv tile blockIdx.x of b*H+h = blockIdx.y: E = dht (or 0), then for s = S-1 .. 1,
// E <- A_s^T E + c_s, the dS entering segment s, over c_s in ws_ds slot s (lasp/gated_delta/affine.cuh).
template <int DK>
__device__ __forceinline__ void bwd_fold(const lasp_gated_delta_bwd_params& p) {
  __shared__ __align__(16) float s_ds[DK * 64];
  const int64_t bh = blockIdx.y;
  const int vt = blockIdx.x;
  AffineTile<DK> tile(s_ds);
  tile.load(p.dht ? p.dht + bh * DK * p.fwd.Dv + vt * 64 : nullptr, p.fwd.Dv);
  fold_segments_down<DK>(p.fwd, p.ws_ds, tile, bh, vt);
}

// Kernel 7: chunk blockIdx.x of b*H+h = blockIdx.y, 256 threads. Warp w computes rows 16 (w % 4)..
// of every [64 x n] product and, of its columns, the half w / 4 (32 of 64 tokens or Dv columns,
// Dk / 2 keys). Dv is walked in tiles of 64 (dO, u, du, V, S_n, dS'), the next tiles landing in a
// second set while the warps work on one; what is summed over Dv (dP, the Dk-wide products, du
// V^T) stays in registers, dv is written per tile. Then, in order:
// dP and dW into tiles, dq, the parts of dk, A^T dW, dA~, A^T dA~ A^T, the terms of L; the row sums
// of the gate and beta gradients go through shared memory in a fixed order.
template <int DK>
__device__ __forceinline__ void bwd_grads(const lasp_gated_delta_bwd_params& p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const lasp_gated_delta_params& f = p.fwd;
  constexpr int kThreads = LASP_GDN_BWD_GRADS_THREADS, kHalfK = DK / 2;
  constexpr uint32_t kRows = kChunk * DK * 2, kTile = kChunk * 64 * 2, kState = DK * 64 * 2;
  // Two sets of the value tiles (dO, u, du, V, S_n, dS' of 64 Dv columns): one computed on while
  // the next one lands.
  constexpr uint32_t kSetDo = 0, kSetU = kTile, kSetDu = 2 * kTile, kSetV = 3 * kTile, kSetS = 4 * kTile,
                     kSetDs = 4 * kTile + kState, kSet = 4 * kTile + 2 * kState;
  constexpr uint32_t kQ = 0, kK = kRows, kW = 2 * kRows, kDw = 3 * kRows, kA = 4 * kRows, kT1 = kA + kTile,
                     kT2 = kT1 + kTile, kValues = kT2 + kTile, kGates = kValues + 2 * kSet, kSums = kGates + 1024;
  static_assert(kSums + 3072 == lasp_gdn_bwd_grads_smem_bytes(DK), "shared-memory map and host formula disagree");
  static_assert(kThreads == 256, "two warpgroups: 4 row blocks x 2 column halves");

  const uint32_t sbase = smem_addr(smem);
  const int chunk = blockIdx.x, bh = blockIdx.y, b = bh / f.H, h = bh % f.H;
  const int N = lasp_gdn_num_chunks(f.T);
  const int64_t Dv = f.Dv, H = f.H;
  const int tok0 = chunk * kChunk, valid = min(kChunk, f.T - tok0);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int m0 = 16 * (warp & 3), half = warp >> 2;
  const int n_key = kHalfK * half, n_col = 32 * half;  // this warp's key / token-or-value columns
  const int64_t row0 = ((int64_t)b * f.T + tok0) * f.H + h;  // token tok0 of (b, h) in [B, T, H]
  const int64_t ws_row0 = ((int64_t)bh * N + chunk) * kChunk;
  const int64_t ws_state0 = ((int64_t)bh * N + chunk) * DK * Dv;

  const Tile q_t{sbase + kQ, kChunk}, k_t{sbase + kK, kChunk}, w_t{sbase + kW, kChunk}, dw_t{sbase + kDw, kChunk};
  const Tile a_t{sbase + kA, kChunk}, t1{sbase + kT1, kChunk}, t2{sbase + kT2, kChunk};
  float* s_gate = reinterpret_cast<float*>(smem + kGates);
  float* s_beta = s_gate + kChunk;
  float* s_b = s_beta + kChunk;  // chunk-local cumsum
  float* s_row_db = reinterpret_cast<float*>(smem + kSums);  // [2 halves][64]
  float* s_row_dbeta = s_row_db + 2 * kChunk;                 // [2][64]
  float* s_col_db = s_row_dbeta + 2 * kChunk;                 // [4 row blocks][64]
  float* s_warp = s_col_db + 4 * kChunk;                      // [8 warps][2]
  float* s_db = s_warp + 16;                                  // [64]

  chunk::copy_tile_async<DK / 8, kThreads>(sbase + kQ, f.q + row0 * DK, H * DK, valid, tid);
  chunk::copy_tile_async<DK / 8, kThreads>(sbase + kK, f.k + row0 * DK, H * DK, valid, tid);
  chunk::copy_tile_async<DK / 8, kThreads>(sbase + kW, p.ws_w + ws_row0 * DK, DK, kChunk, tid);
  chunk::copy_tile_async<8, kThreads>(sbase + kA, f.ws_tri + ws_row0 * kChunk, kChunk, kChunk, tid);
  if (tid < kChunk) {
    const bool ok = tid < valid;
    cp_async_4(sbase + kGates + 4 * tid, ok ? f.g + row0 + tid * H : f.g, ok);
    cp_async_4(sbase + kGates + 4 * (kChunk + tid), ok ? f.beta + row0 + tid * H : f.beta, ok);
  }
  const int vtiles = Dv / 64;
  // Step i of the two walks over Dv: the tiles of columns 64 (i % vtiles).. into set i % 2 (u and
  // dS' in the first walk only), one commit group.
  auto issue_value_tiles = [&](int i) {
    const bool first_walk = i < vtiles;
    const int64_t col = (i % vtiles) * 64;
    const uint32_t set = sbase + kValues + (i & 1) * kSet;
    chunk::copy_tile_async<8, kThreads>(set + kSetDo, p.d_o + row0 * Dv + col, H * Dv, valid, tid);
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt) {
      const int64_t at = ws_state0 + 64 * mt * Dv + col;
      chunk::copy_tile_async<8, kThreads>(set + kSetS + mt * kTile, p.ws_h + at, Dv, kChunk, tid);
      if (first_walk) chunk::copy_tile_async<8, kThreads>(set + kSetDs + mt * kTile, p.ws_dh + at, Dv, kChunk, tid);
    }
    if (first_walk) chunk::copy_tile_async<8, kThreads>(set + kSetU, p.ws_u + ws_row0 * Dv + col, Dv, kChunk, tid);
    chunk::copy_tile_async<8, kThreads>(set + kSetDu, p.ws_du + ws_row0 * Dv + col, Dv, kChunk, tid);
    chunk::copy_tile_async<8, kThreads>(set + kSetV, f.v + row0 * Dv + col, H * Dv, valid, tid);
    cp_async_commit();
  };
  // Waits for step i's tiles (every earlier group) and, after the barrier that also says every
  // warp is done with step i - 1's set, starts step i + 1's copies into it.
  struct ValueTiles {
    Tile d_o, u, du, v, s, ds;
  };
  auto value_tiles = [&](int i) {
    cp_async_wait<0>();
    publish();
    if (i + 1 < 2 * vtiles) issue_value_tiles(i + 1);
    const uint32_t set = sbase + kValues + (i & 1) * kSet;
    return ValueTiles{Tile{set + kSetDo, kChunk}, Tile{set + kSetU, kChunk}, Tile{set + kSetDu, kChunk},
                      Tile{set + kSetV, kChunk},  Tile{set + kSetS, DK},     Tile{set + kSetDs, DK}};
  };
  cp_async_commit();
  issue_value_tiles(0);
  cp_async_wait<1>();
  publish();
  if (warp == 0) {
    const sd::GatePair bp = sd::scan_gate_pairs(s_gate, lane);
    s_b[2 * lane] = bp.even;
    s_b[2 * lane + 1] = bp.odd;
  }
  __syncthreads();
  const float gamma = s_b[kChunk - 1];
  float b_row[2], beta_row[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) b_row[hh] = s_b[m0 + g + 8 * hh], beta_row[hh] = s_beta[m0 + g + 8 * hh];

  // Row sums: *_rows are whole rows' values (the same in the quad's 4 lanes), *_part this lane's
  // columns only (reduced over the quad at the end).
  float db_rows[2] = {0.f, 0.f}, dbeta_rows[2] = {0.f, 0.f}, db_part[2] = {0.f, 0.f}, dbeta_part[2] = {0.f, 0.f};
  float state_dot = 0.f;   // this thread's share of <dS', S_n>
  float to_gamma = 0.f;    // sum_j k_j . dk_j of the transition, the quad's leader only

  // First walk over Dv: what needs u or dS', and dW and dA~'s du V^T (two walks keep the sums over
  // Dv that are live at once within the register file).
  float dp[4][4] = {}, da_v[4][4] = {};
  float du_s[kHalfK / 8][4] = {}, dk[kHalfK / 8][4] = {};
  for (int vt = 0; vt < vtiles; ++vt) {
    const ValueTiles v = value_tiles(vt);
    // Four independent products in one group; <dS', S_n> on the CUDA cores meanwhile.
    wg::fence();
    wg_issue<64, 32, false, true>(dp, v.d_o, 0, 0, v.u, n_col, 0);        // dO u^T
    wg_issue<64, kHalfK, false, true>(du_s, v.du, 0, 0, v.s, n_key, 0);  // du S_n^T = -dW
    wg_issue<64, kHalfK, false, true>(dk, v.u, 0, 0, v.ds, n_key, 0);    // u dS'^T
    wg_issue<64, 32, false, true>(da_v, v.du, 0, 0, v.v, n_col, 0);      // du V^T
    wg::commit();
    const uint8_t* s_tile = smem + (v.s.base - sbase);
    const uint8_t* ds_tile = smem + (v.ds.base - sbase);
#pragma unroll 1
    for (int i = tid; i < DK * 64 / 2; i += kThreads) {  // same positions of both tiles: any order of pairs
      const uint32_t x = *reinterpret_cast<const uint32_t*>(s_tile + 4 * i);
      const uint32_t y = *reinterpret_cast<const uint32_t*>(ds_tile + 4 * i);
      state_dot += __uint_as_float(x << 16) * __uint_as_float(y << 16) +
                   __uint_as_float(x & 0xffff0000u) * __uint_as_float(y & 0xffff0000u);
    }
    wg_settle(dp, du_s, dk, da_v);
  }

  // dP = sigma [j <= r] e^{b_r - b_j} dO u^T into t1; dW = -du S_n^T into dw_t; the transition's
  // u dS'^T gets e^{gamma - b_j} (this warp's rows are j there).
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = m0 + g + 8 * hh, j = n_col + 8 * nt + 2 * t;
      const float x0 = j <= r ? f.scale * exp_nonpos(b_row[hh] - s_b[j]) * dp[nt][2 * hh] : 0.f;
      const float x1 = j + 1 <= r ? f.scale * exp_nonpos(b_row[hh] - s_b[j + 1]) * dp[nt][2 * hh + 1] : 0.f;
      chunk::tile_pair(smem, sbase, t1, r, j) = pack_bf16x2(x0, x1);
    }
  chunk::for_each_acc_pair<kHalfK>(du_s, m0, n_key, lane, [&](float& x0, float& x1, int r, int col) {
    chunk::tile_pair(smem, sbase, dw_t, r, col) = pack_bf16x2(-x0, -x1);
  });
#pragma unroll
  for (int nt = 0; nt < kHalfK / 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int e = 0; e < 2; ++e) dk[nt][2 * hh + e] *= exp_nonpos(gamma - b_row[hh]);
  {
    const float2 kd = chunk::row_dots<kHalfK>(dk, smem, sbase, k_t, m0, n_key, lane);
    db_rows[0] -= kd.x, db_rows[1] -= kd.y;
    if (t == 0) to_gamma += kd.x + kd.y;
  }
  publish();  // dP and dW are in their tiles
  {
    // dA~ = du (diag(beta) V)^T + dW (diag(beta e^b) K)^T into t2 (rows r, columns j).
    float dw_k[4][4] = {};
    wg_tiles<DK, 32, false, true>(dw_k, dw_t, 0, 0, k_t, n_col, 0);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = m0 + g + 8 * hh, j = n_col + 8 * nt + 2 * t;
        float x[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          x[e] = s_beta[j + e] * (da_v[nt][2 * hh + e] + exp_nonpos(s_b[j + e]) * dw_k[nt][2 * hh + e]);
        chunk::tile_pair(smem, sbase, t2, r, j) = pack_bf16x2(x[0], x[1]);
      }
  }

  // Second walk: dq's dO S_n^T; dv = diag(beta) A^T du per tile. Then dq = sigma diag(e^b) dO S_n^T
  // + dP K and the gate's q . dq.
  float dq[kHalfK / 8][4] = {};
  for (int vt = 0; vt < vtiles; ++vt) {
    const ValueTiles v = value_tiles(vtiles + vt);
    wg_tiles<64, kHalfK, false, true>(dq, v.d_o, 0, 0, v.s, n_key, 0);
    {
      float yu[4][4] = {};  // A^T du: dv = diag(beta) A^T du, dbeta += (A^T du) . v
      wg_tiles<64, 32, true, false>(yu, a_t, 0, 0, v.du, n_col, 0);
      const float2 yv = chunk::row_dots<32>(yu, smem, sbase, v.v, m0, n_col, lane);
      dbeta_rows[0] += yv.x, dbeta_rows[1] += yv.y;
      chunk::for_each_acc_pair<32>(yu, m0, n_col, lane, [&](float& x0, float& x1, int r, int col) {
        const float beta = s_beta[r];
        if (r < valid)
          *reinterpret_cast<uint32_t*>(p.dv + (row0 + r * H) * Dv + vt * 64 + col) = pack_bf16x2(beta * x0, beta * x1);
      });
    }
  }
#pragma unroll
  for (int nt = 0; nt < kHalfK / 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int e = 0; e < 2; ++e) dq[nt][2 * hh + e] *= f.scale * exp_nonpos(b_row[hh]);
  float out[kHalfK / 8][4] = {};  // dP^T Q, the output's part of dk (rows j)
  wg::fence();
  wg_issue<64, kHalfK, false, false>(dq, t1, 0, 0, k_t, n_key, 0);
  wg_issue<64, kHalfK, true, false>(out, t1, 0, 0, q_t, n_key, 0);
  wg::commit();
  wg_settle(dq, out);
  {
    const float2 qd = chunk::row_dots<kHalfK>(dq, smem, sbase, q_t, m0, n_key, lane);
    db_rows[0] += qd.x, db_rows[1] += qd.y;
    chunk::for_each_acc_pair<kHalfK>(dq, m0, n_key, lane, [&](float& x0, float& x1, int r, int col) {
      if (r < valid) *reinterpret_cast<uint32_t*>(p.dq + (row0 + r * H) * DK + col) = pack_bf16x2(x0, x1);
    });
  }
  {
    const float2 kd = chunk::row_dots<kHalfK>(out, smem, sbase, k_t, m0, n_key, lane);
    db_rows[0] -= kd.x, db_rows[1] -= kd.y;
#pragma unroll
    for (int nt = 0; nt < kHalfK / 8; ++nt)
#pragma unroll
      for (int x = 0; x < 4; ++x) dk[nt][x] += out[nt][x];
  }
  {
    float yw[kHalfK / 8][4] = {};  // A^T dW: W = A diag(beta e^b) K
    wg_tiles<64, kHalfK, true, false>(yw, a_t, 0, 0, dw_t, n_key, 0);
    const float2 kw = chunk::row_dots<kHalfK>(yw, smem, sbase, k_t, m0, n_key, lane);
    const float kw_row[2] = {kw.x, kw.y};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float decay = exp_nonpos(b_row[hh]);
      dbeta_rows[hh] += decay * kw_row[hh];
      db_rows[hh] += beta_row[hh] * decay * kw_row[hh];
#pragma unroll
      for (int nt = 0; nt < kHalfK / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) dk[nt][2 * hh + e] += beta_row[hh] * decay * yw[nt][2 * hh + e];
    }
  }
  publish();  // dA~ is in t2; dP in t1 is no longer read
  {
    float x1[4][4] = {};  // A^T dA~ into t1
    wg_tiles<64, 32, true, false>(x1, a_t, 0, 0, t2, n_col, 0);
    chunk::for_each_acc_pair<32>(x1, m0, n_col, lane, [&](float& x0, float& y0, int r, int col) {
      chunk::tile_pair(smem, sbase, t1, r, col) = pack_bf16x2(x0, y0);
    });
  }
  publish();  // A^T dA~ is in t1; t2 is no longer read
  {
    // dL = -(A^T dA~ A^T) below the diagonal; L_rj = beta_r e^{b_r - b_j} (k_r . k_j) passes it on:
    // E = dL beta_r e^{b_r - b_j} into t2 (dk += E K + E^T K), dbeta_r and the gates directly.
    float x2[4][4] = {}, kk[4][4] = {};
    wg::fence();
    wg_issue<64, 32, false, true>(x2, t1, 0, 0, a_t, n_col, 0);
    wg_issue<DK, 32, false, true>(kk, k_t, 0, 0, k_t, n_col, 0);
    wg::commit();
    wg_settle(x2, kk);
    float col_part[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) col_part[nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int r = m0 + g + 8 * hh;
        float ev[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = n_col + 8 * nt + 2 * t + e;
          const float decay = exp_nonpos(b_row[hh] - s_b[j]);
          const float dl = j < r ? -x2[nt][2 * hh + e] : 0.f;
          const float ell_dl = dl * beta_row[hh] * decay * kk[nt][2 * hh + e];
          db_part[hh] += ell_dl;
          col_part[nt][e] -= ell_dl;
          dbeta_part[hh] += dl * decay * kk[nt][2 * hh + e];
          ev[e] = dl * beta_row[hh] * decay;
        }
        chunk::tile_pair(smem, sbase, t2, r, n_col + 8 * nt + 2 * t) = pack_bf16x2(ev[0], ev[1]);
      }
    // Column sums over the warp's 16 rows (the lanes of one t), then by row block.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = col_part[nt][e];
        x += __shfl_xor_sync(kAll, x, 4);
        x += __shfl_xor_sync(kAll, x, 8);
        x += __shfl_xor_sync(kAll, x, 16);
        if (g == 0) s_col_db[(warp & 3) * kChunk + n_col + 8 * nt + 2 * t + e] = x;
      }
  }
  // This thread's <dS', S_n> share and the transition's sum, reduced over the warp.
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    state_dot += __shfl_xor_sync(kAll, state_dot, m);
    to_gamma += __shfl_xor_sync(kAll, to_gamma, m);
  }
  if (lane == 0) s_warp[2 * warp] = state_dot, s_warp[2 * warp + 1] = to_gamma;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    db_part[hh] += __shfl_xor_sync(kAll, db_part[hh], 1);
    db_part[hh] += __shfl_xor_sync(kAll, db_part[hh], 2);
    dbeta_part[hh] += __shfl_xor_sync(kAll, dbeta_part[hh], 1);
    dbeta_part[hh] += __shfl_xor_sync(kAll, dbeta_part[hh], 2);
    if (t == 0) {
      s_row_db[half * kChunk + m0 + g + 8 * hh] = db_rows[hh] + db_part[hh];
      s_row_dbeta[half * kChunk + m0 + g + 8 * hh] = dbeta_rows[hh] + dbeta_part[hh];
    }
  }
  publish();  // E is in t2; the row and column sums are in place

  wg::fence();
  wg_issue<64, kHalfK, false, false>(dk, t2, 0, 0, k_t, n_key, 0);  // E K   (rows r)
  wg_issue<64, kHalfK, true, false>(dk, t2, 0, 0, k_t, n_key, 0);   // E^T K (rows j)
  wg::commit();
  wg_settle(dk);
  chunk::for_each_acc_pair<kHalfK>(dk, m0, n_key, lane, [&](float& x0, float& x1, int r, int col) {
    if (r < valid) *reinterpret_cast<uint32_t*>(p.dk + (row0 + r * H) * DK + col) = pack_bf16x2(x0, x1);
  });

  // db_r, with gamma's d/dgamma = e^gamma <dS', S_n> + sum_j k_j . dk_j (transition) at r = 63,
  // then dg_t = sum_{r >= t} db_r; dbeta.
  // (b, tok0 + r, h) in [B, T, H] formed afresh from the grid: row0 would have to live across
  // every product above.
  auto gate_index = [&](int r) {
    return ((int64_t)(blockIdx.y / f.H) * f.T + blockIdx.x * kChunk + r) * f.H + blockIdx.y % f.H;
  };
  if (tid < kChunk) {
    const int r = tid;
    float db = s_row_db[r] + s_row_db[kChunk + r];
#pragma unroll
    for (int rb = 0; rb < 4; ++rb) db += s_col_db[rb * kChunk + r];
    if (r == kChunk - 1) {
      float dot = 0.f, terms = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) dot += s_warp[2 * w], terms += s_warp[2 * w + 1];
      db += exp_nonpos(gamma) * dot + terms;
    }
    s_db[r] = db;
    if (r < valid) p.dbeta[gate_index(r)] = s_row_dbeta[r] + s_row_dbeta[kChunk + r];
  }
  __syncthreads();
  if (tid < valid) {
    float dg = 0.f;
    for (int r = kChunk - 1; r >= tid; --r) dg += s_db[r];
    p.dg[gate_index(tid)] = dg;
  }
}

}  // namespace gdn
}  // namespace lasp

// The templated kernels are instantiated from kernels/instances.rs (per Dk in {64, 128}); their
// grids, blocks and shared memory: lasp/gated_delta/backward_params.h.
