// Scalar-decay linear attention, backward: the kernels around the three chunkwise passes
// (the passes and the maths: lasp/scalar_decay/backward_params.h; the reversed passes:
// lasp_scalar_decay_*_reversed_* in scalar_decay/forward.cu).
//
// The gate gradient's kernels (lasp_sd_bwd_gate_terms_dk*, lasp_sd_bwd_gate_grad) sum the pairs of
// tokens that straddle each token (the derivation and the split into Z, x_q, x_k and A:
// lasp/scalar_decay/backward_params.h).
#include <stdint.h>

#include "lasp/scalar_decay/chunk.cuh"
#include "lasp/scalar_decay/backward_params.h"

namespace {

constexpr unsigned kAll = 0xffffffffu;

// Inclusive scan of one double per thread over the CTA (blockDim.x a multiple of 32, at most
// 1024), in thread order; `total` receives the sum over the CTA; `warp_totals` holds 32 doubles.
// Ends with a barrier, so the caller may reuse warp_totals.
__device__ double block_inclusive_scan(double x, double* warp_totals, double& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const double y = __shfl_up_sync(kAll, x, m);
    if (lane >= m) x += y;
  }
  if (lane == 31) warp_totals[warp] = x;
  __syncthreads();
  if (warp == 0) {
    double w = lane < warps ? warp_totals[lane] : 0.0;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
      const double y = __shfl_up_sync(kAll, w, m);
      if (lane >= m) w += y;
    }
    if (lane < warps) warp_totals[lane] = w;
  }
  __syncthreads();
  const double before = warp > 0 ? warp_totals[warp - 1] : 0.0;
  total = warp_totals[warps - 1];
  __syncthreads();
  return x + before;
}

// A CTA of the state kernels below takes one 32 x 32 tile of a [Dk, Dv] state (rows d0.., columns
// c0..): each thread holds kRows elements of it (rows row + 8 i, column lane), reads and writes them
// in rows, and writes the transposed tile through shared memory (rows padded to 33 floats, so a
// warp's reads down a column hit 32 banks): every global access is a whole 128-byte line. (One
// thread per element, writing the transposes straight to global memory, put each store of a warp
// in its own line: 17 us per launch at B*H = 64, Dk = Dv = 128.)
struct StateTile {
  static constexpr int kTile = LASP_SDB_STATE_TILE, kRowsPerPass = LASP_SDB_STATE_THREADS / kTile;
  static constexpr int kRows = kTile / kRowsPerPass;
  int64_t base;  // the head's first element
  int Dk, Dv, d0, c0, lane, row;
  __device__ StateTile(const lasp_sd_bwd_params& p)
      : base((int64_t)blockIdx.y * p.Dk * p.Dv), Dk(p.Dk), Dv(p.Dv),
        d0(blockIdx.x / (p.Dv / kTile) * kTile), c0(blockIdx.x % (p.Dv / kTile) * kTile),
        lane(threadIdx.x % kTile), row(threadIdx.x / kTile) {}
  // Element i of the thread in a [Dk, Dv] state, and in its [Dv, Dk] transpose.
  __device__ int64_t at(int i) const { return (int64_t)(d0 + row + i * kRowsPerPass) * Dv + c0 + lane; }
  __device__ int64_t at_t(int i) const { return (int64_t)(c0 + row + i * kRowsPerPass) * Dk + d0 + lane; }
  // Writes x to the state at `rows` ([Dk, Dv], unless NULL) and its transpose to `cols` ([Dv, Dk]).
  __device__ void store(const float (&x)[kRows], float* rows, float* cols, float (*tile)[kTile + 1]) const {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      if (rows) rows[at(i)] = x[i];
      tile[row + i * kRowsPerPass][lane] = x[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kRows; ++i) cols[at_t(i)] = tile[lane][row + i * kRowsPerPass];
    __syncthreads();  // before the next store overwrites the tile
  }
};

}  // namespace

// h0^T, the dq pass's start state. grid lasp_sdb_state_inputs_grid, block LASP_SDB_STATE_THREADS.
extern "C" __global__ void __launch_bounds__(LASP_SDB_STATE_THREADS)
    lasp_sd_bwd_state_inputs(const __grid_constant__ lasp_sd_bwd_params p) {
  __shared__ float tile[StateTile::kTile][StateTile::kTile + 1];
  const StateTile st(p);
  float x[StateTile::kRows];
#pragma unroll
  for (int i = 0; i < StateTile::kRows; ++i) x[i] = p.h0[st.base + st.at(i)];
  st.store(x, nullptr, p.h0_t + st.base, tile);
}

// The reversed passes' start states: P_0 = dht / sigma (zero without dht; written when dht, as
// dht_scaled), P_{s+1} = e^{Lambda_s} P_s + R_s for s < S - 1 (rev_m, rev_lambda; written to
// dv_starts slot s), and the transposes of all of them (dht_t_scaled, dk_starts), the dk pass's:
// the fold is elementwise, so they are exact. The fold is the forward's lasp_scalar_decay_fold,
// so the dv pass starts where it would have with a states pass and fold of its own.
// grid lasp_sdb_state_inputs_grid, block LASP_SDB_STATE_THREADS.
extern "C" __global__ void __launch_bounds__(LASP_SDB_STATE_THREADS)
    lasp_sd_bwd_reversed_starts(const __grid_constant__ lasp_sd_bwd_params p) {
  __shared__ float tile[StateTile::kTile][StateTile::kTile + 1];
  const StateTile st(p);
  const int64_t n = (int64_t)p.Dk * p.Dv, bh = blockIdx.y;
  const int later = p.rev_segments - 1;
  float x[StateTile::kRows];
#pragma unroll
  for (int i = 0; i < StateTile::kRows; ++i) x[i] = p.dht ? p.dht[st.base + st.at(i)] / p.scale : 0.f;
  if (p.dht) st.store(x, p.dht_scaled + st.base, p.dht_t_scaled + st.base, tile);
  // Slot s of head bh: R_s at rev_m + (bh * rev_slots + s) * n, the starts at (bh * (S-1) + s) * n.
  for (int s = 0; s < later; ++s) {
    const int64_t in = bh * p.rev_slots + s, out = (bh * later + s) * n;
    const float l = __ldg(p.rev_lambda + in);
    float m[StateTile::kRows];
#pragma unroll
    for (int i = 0; i < StateTile::kRows; ++i) m[i] = __ldg(p.rev_m + in * n + st.at(i));
#pragma unroll
    for (int i = 0; i < StateTile::kRows; ++i) x[i] = lasp::sd::fold_step(x[i], l, m[i]);
    st.store(x, p.dv_starts + out, p.dk_starts + out, tile);
  }
}


// ---------------------------------------------------------------------------------------------
// The gate gradient (lasp/scalar_decay/backward_params.h, "Gate gradient"): block [s0, s1) of
// LASP_SD_BLOCK_CHUNKS chunks, Z from the block states, x_q and x_k from the bf16 hi + lo copies of
// the states, the block's pair matrix A tile by tile.
// ---------------------------------------------------------------------------------------------
namespace {

using lasp::sd::exp_nonpos;
using lasp::sd::kChunk;
using lasp::sd::kTileV;
constexpr int kBlockChunks = LASP_SD_BLOCK_CHUNKS;

// The chunks of the block that holds chunk `chunk` (a multiple of kBlockChunks starts each block).
struct Block {
  int index;  // blocks before it in the sequence
  int first;  // its first chunk
  int n;      // its chunks (fewer in the last block)
  int s0, s1; // its tokens [s0, s1)
  __device__ __forceinline__ Block(int block, int T) {
    const int nc = lasp_sd_num_chunks(T);
    index = block;
    first = block * kBlockChunks;
    n = min(kBlockChunks, nc - first);
    s0 = first * kChunk;
    s1 = min(T, s0 + kBlockChunks * kChunk);
  }
};

// The block's gates: cum[m][r] = b^m_r, the inclusive cumsum of chunk m's log-decays (zero past T),
// decay[m] = gamma_m = b^m_63 for m < blk.n, and decay[kBlockChunks] = a_{s1} (0 when s1 = T). Warp
// m scans chunk m with the chunk loops' scan (lasp::sd::scan_gate_pairs). Ends with a barrier.
__device__ __forceinline__ void block_gates(const lasp_sd_bwd_params& p, const Block& blk, int b, int h, float* cum, float* decay) {
  for (int i = threadIdx.x; i < kBlockChunks * kChunk; i += blockDim.x) {
    const int tok = blk.s0 + i;
    cum[i] = i < blk.n * kChunk && tok < p.T ? p.g[((int64_t)b * p.T + tok) * p.H + h] : 0.f;
  }
  if (threadIdx.x == 0) decay[kBlockChunks] = blk.s1 < p.T ? p.g[((int64_t)b * p.T + blk.s1) * p.H + h] : 0.f;
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp < blk.n) {
    const lasp::sd::GatePair bp = lasp::sd::scan_gate_pairs(cum + warp * kChunk, lane);
    __syncwarp();
    cum[warp * kChunk + 2 * lane] = bp.even;
    cum[warp * kChunk + 2 * lane + 1] = bp.odd;
    if (lane == 31) decay[warp] = bp.odd;
  }
  __syncthreads();
}

// Shared-memory map of lasp_sd_bwd_gate_terms (byte offsets). Every bf16 tile is stored as wgmma
// reads it (lasp::swizzle, 64-column blocks) and starts 1024-byte aligned, as its 128-byte swizzle
// needs. K and the V tile of every chunk of the block stay (the pair tiles of a chunk read those of
// every earlier chunk); Q and the dO tile go through two buffers (chunk I + 1's land while chunk I
// is computed). The block's two boundary states arrive as the dq and dv passes laid them out
// (lasp::sd::state_store_tiles): S^T's rows e of this Dv tile (K-major, the B of Q S) and dH's
// columns e of this Dv tile (MN-major, the B of K dH), each as hi and lo.
template <int DK>
struct TermsLayout {
  static constexpr uint32_t kQKTile = kChunk * DK * 2;      // Q or K of a chunk
  static constexpr uint32_t kVTile = kChunk * kTileV * 2;   // the 64 columns of V or dO of a chunk
  static constexpr uint32_t kStateTile = DK * kTileV * 2;   // a state's tile, DK x 64 bf16
  static constexpr uint32_t kK = 0;                         // [kBlockChunks] K tiles
  static constexpr uint32_t kV = kK + kBlockChunks * kQKTile;   // [kBlockChunks] V tiles
  static constexpr uint32_t kQ = kV + kBlockChunks * kVTile;    // [2] Q tiles
  static constexpr uint32_t kDo = kQ + 2 * kQKTile;             // [2] dO tiles
  static constexpr uint32_t kSHi = kDo + 2 * kVTile;            // S_{s0-1}^T as bf16 hi + lo
  static constexpr uint32_t kSLo = kSHi + kStateTile;
  static constexpr uint32_t kDHi = kSLo + kStateTile;           // dH_{s1} / sigma as bf16 hi + lo
  static constexpr uint32_t kDLo = kDHi + kStateTile;
  static constexpr uint32_t kCum = kDLo + kStateTile;           // block_gates' cum
  static constexpr uint32_t kDecay = kCum + kBlockChunks * kChunk * 4;  // block_gates' decay
  static constexpr uint32_t kCols = kDecay + 64;  // float [4 warps][kBlockChunks][64]: column sums, per warp
  static constexpr uint32_t kColDecay = kCols + 4 * kBlockChunks * kChunk * 4;  // float [kBlockChunks][64]
  static constexpr uint32_t kBytes = kColDecay + kBlockChunks * kChunk * 4;
  static_assert(kQKTile % 1024 == 0 && kVTile % 1024 == 0 && kStateTile % 1024 == 0, "tiles stay 1024-byte aligned");
  static_assert((kBlockChunks + 1) * 4 <= 64, "decay fits its slot");
};

// Copies `bytes` (a multiple of 16 x the warpgroup) from global `src` to shared `dst` as they are.
__device__ __forceinline__ void copy_bytes_async(uint32_t dst, const uint8_t* src, uint32_t bytes, int tid) {
  for (uint32_t at = 16 * tid; at < bytes; at += 16 * lasp::sd::kThreads) lasp::cp_async_16(dst + at, src + at, true);
}

#if LASP_SD_WGMMA
// out[hh] = sum_c acc[r][c] X[r][c] for this lane's rows r = 16 warp + 8 hh + g, X a [64][64] bf16 tile
// at `tile`; summed over the row's four lanes (the same bits in each).
__device__ __forceinline__ void row_dots(float (&out)[2], const float (&acc)[8][4], const uint8_t* tile, int warp,
                                         int g, int t) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * warp + 8 * hh + g;
    float x = 0.f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(tile + lasp::swizzle(r, nt, kChunk) + 4 * t);
      x = fmaf(acc[nt][2 * hh], __uint_as_float(w << 16), x);
      x = fmaf(acc[nt][2 * hh + 1], __uint_as_float(w & 0xffff0000u), x);
    }
    x += __shfl_xor_sync(kAll, x, 1);
    x += __shfl_xor_sync(kAll, x, 2);
    out[hh] = x;
  }
}

__device__ __forceinline__ float bf16_at(const uint8_t* p) {
  return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}

// One CTA: block `blk` of head bh, Dv tile vt (every (do . v) and every state column below is over
// the tile's 64 columns; gate_grad adds the tiles), as two warpgroups with roles:
//   state products (warps 0-3): load every chunk (cp.async, chunk I + 1's landing while chunk I is
//     computed) and the two states, then per chunk x_q(u) and x_k(u) (32 wgmma at Dk 128), and
//     the tile's part of <S_{s0-1}, dH_{s1}>;
//   pair tiles (warps 4-7): per chunk I the tiles (I, J) for J = 0 .. I (12 wgmma each at Dk 128):
//     R(u) = sum over j < u of the block of A_uj, and each thread's column sums in registers over
//     the whole block, which give C(u) = sum over i > u of the block of A_iu at the end. A tile
//     below the diagonal weighs its pairs by a row factor times a column factor (both e^{<= 0}, the
//     column factors computed once per block), so it takes two exponentials per thread, not 32,
//     and no shuffle or shared-memory store until the block ends.
// The two roles meet at one barrier per chunk (it has landed) and one after it (its buffers are
// free): a chunk costs the longer role's work instead of both in sequence.
template <int DK>
__device__ __forceinline__ void gate_terms(const lasp_sd_bwd_params& p) {
  using L = TermsLayout<DK>;
  static_assert(L::kBytes == lasp_sdb_gate_terms_smem_bytes(DK), "shared-memory map and host formula disagree");
  static_assert(LASP_SDB_TERM_THREADS == 2 * lasp::sd::kThreads, "two warpgroups; the first loads with the chunk "
                                                                 "loops' copies");
  constexpr uint32_t kBlockBytes = kChunk * 128, kRow16 = 16 * 128;
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = lasp::smem_addr(smem);
  const bool products = threadIdx.x < lasp::sd::kThreads;  // else the pair tiles
  const int tid = threadIdx.x % lasp::sd::kThreads, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2,
            t = lane & 3;
  const int vt = blockIdx.x;
  const int64_t bh = blockIdx.z, heads = (int64_t)p.B * p.H;
  const int b = (int)bh / p.H, h = (int)bh % p.H, T = p.T;
  const Block blk(blockIdx.y, T);
  float* const cum = reinterpret_cast<float*>(smem + L::kCum);
  float* const decay = reinterpret_cast<float*>(smem + L::kDecay);
  float* const cols = reinterpret_cast<float*>(smem + L::kCols) + warp * kBlockChunks * kChunk;  // this warp's
  float* const col_decay = reinterpret_cast<float*>(smem + L::kColDecay);  // [m][j] = e^{gamma_m - b^m_j}

  // Chunk c of the block: K and the V tile to their slots, Q and the dO tile to buffer c % 2.
  // Token tok of (b, h) is row (b T + tok) H + h of the [B, T, H, D] tensors.
  const int64_t row0 = (int64_t)b * T * p.H + h, qk_stride = (int64_t)p.H * DK, v_stride = (int64_t)p.H * p.Dv;
  auto issue_chunk = [&](int c) {
    const int tok = blk.s0 + c * kChunk;
    const int64_t row = row0 + (int64_t)tok * p.H;
    lasp::sd::copy_tile_async<DK / 8>(sbase + L::kK + c * L::kQKTile, p.k + row * DK, qk_stride, T - tok, tid);
    lasp::sd::copy_tile_async<DK / 8>(sbase + L::kQ + (c & 1) * L::kQKTile, p.q + row * DK, qk_stride, T - tok, tid);
    const int64_t v_col = row * p.Dv + vt * kTileV;
    lasp::sd::copy_tile_async<kTileV / 8>(sbase + L::kV + c * L::kVTile, p.v + v_col, v_stride, T - tok, tid);
    lasp::sd::copy_tile_async<kTileV / 8>(sbase + L::kDo + (c & 1) * L::kVTile, p.d_o + v_col, v_stride, T - tok,
                                          tid);
  };
  if (products) {
    // The block's boundary states (slot blk.index of each direction: the dq pass's S^T entering the
    // block, the dv pass's dH / sigma leaving it), this Dv tile's part, hi then lo.
    const int64_t state_bytes = 4ll * p.Dk * p.Dv, slot = bh * lasp_sd_num_blocks(T) + blk.index;
    const uint8_t* const s_state = static_cast<const uint8_t*>(p.fwd_blocks) + slot * state_bytes;
    const uint8_t* const d_state = static_cast<const uint8_t*>(p.rev_blocks) + slot * state_bytes;
    const int64_t tile = (int64_t)vt * L::kStateTile, lo = state_bytes / 2;
    copy_bytes_async(sbase + L::kSHi, s_state + tile, L::kStateTile, tid);
    copy_bytes_async(sbase + L::kSLo, s_state + lo + tile, L::kStateTile, tid);
    copy_bytes_async(sbase + L::kDHi, d_state + tile, L::kStateTile, tid);
    copy_bytes_async(sbase + L::kDLo, d_state + lo + tile, L::kStateTile, tid);
    issue_chunk(0);
    lasp::cp_async_commit();
    if (blk.n > 1) issue_chunk(1);
    lasp::cp_async_commit();
  }
  block_gates(p, blk, b, h, cum, decay);
  for (int i = threadIdx.x; i < blk.n * kChunk; i += blockDim.x) col_decay[i] = exp_nonpos(decay[i / kChunk] - cum[i]);
  __syncthreads();  // col_decay, for the pair tiles

  float* const rows = p.gate_rows + ((int64_t)vt * 4 * heads + bh) * T;  // x_q; x_k, R and C follow
  auto store_rows = [&](int which, int tok0, const float (&x)[2], auto&& weight) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
      if (t == 0 && tok0 + r < T) rows[which * heads * T + tok0 + r] = x[hh] * weight(r);
    }
  };
  const float a_next = decay[kBlockChunks];
  float col_sums[kBlockChunks][8][2] = {};  // the pair tiles' column sums of this thread's rows, per chunk
  for (int ci = 0; ci < blk.n; ++ci) {
    if (products) {
      if (ci + 1 < blk.n)
        lasp::cp_async_wait<1>();
      else
        lasp::cp_async_wait<0>();
      lasp::wg::fence_proxy_async();  // this thread's landed tiles, visible to wgmma
    }
    __syncthreads();  // chunk ci (and the states) have landed, for both roles
    const uint32_t s_q = sbase + L::kQ + (ci & 1) * L::kQKTile;
    const uint32_t s_do = sbase + L::kDo + (ci & 1) * L::kVTile;
    const float* const cum_i = cum + ci * kChunk;
    const int tok0 = blk.s0 + ci * kChunk;
    if (products) {
      // x_q: pairs (j < s0, u in chunk ci): sigma e^{G_u - G_{s0-1}} q_u S_{s0-1} do_u^T; x_k: pairs
      // (j in chunk ci, u >= s1): e^{G_{s1} - G_j} k_j dH_{s1} v_j^T. One group for both, the states
      // as hi + lo: acc_q = Q (S^T)^T (B K-major), acc_k = K (dH / sigma) (B MN-major).
      float before = 0.f, after = 0.f;  // log-decay of the block's chunks before ci (E_I) and after it
      for (int m = 0; m < ci; ++m) before += decay[m];
      for (int m = ci + 1; m < blk.n; ++m) after += decay[m];
      const float gamma_i = decay[ci];
      float acc_q[8][4], acc_k[8][4];
      const uint32_t s_k = sbase + L::kK + ci * L::kQKTile;
      lasp::wg::fence();
#pragma unroll
      for (int ks = 0; ks < DK / 16; ++ks) {
        const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
        const uint64_t q_desc = lasp::wg::desc_sw128(s_q + k_step), k_desc = lasp::wg::desc_sw128(s_k + k_step);
        lasp::wg::mma_ss<lasp::wg::Major::kK>(acc_q, q_desc, lasp::wg::desc_sw128(sbase + L::kSHi + k_step), ks > 0);
        lasp::wg::mma_ss<lasp::wg::Major::kK>(acc_q, q_desc, lasp::wg::desc_sw128(sbase + L::kSLo + k_step), true);
        lasp::wg::mma_ss<lasp::wg::Major::kMN>(acc_k, k_desc, lasp::wg::desc_sw128(sbase + L::kDHi + ks * kRow16),
                                               ks > 0);
        lasp::wg::mma_ss<lasp::wg::Major::kMN>(acc_k, k_desc, lasp::wg::desc_sw128(sbase + L::kDLo + ks * kRow16),
                                               true);
      }
      lasp::wg::commit();
      lasp::wg::wait<0>();
      lasp::wg::fence_operands(acc_q);
      lasp::wg::fence_operands(acc_k);
      float xq[2], xk[2];
      row_dots(xq, acc_q, smem + L::kDo + (ci & 1) * L::kVTile, warp, g, t);
      row_dots(xk, acc_k, smem + L::kV + ci * L::kVTile, warp, g, t);
      store_rows(0, tok0, xq, [&](int r) { return p.scale * exp_nonpos(before + cum_i[r]); });
      store_rows(1, tok0, xk, [&](int r) { return p.scale * exp_nonpos((gamma_i - cum_i[r]) + after + a_next); });
    } else {
      // A: tile pairs (ci, cj) for cj = 0 .. ci. R(u) adds the row sums in that order; the column
      // sums of chunk cj add those of (cj, cj), (cj + 1, cj), .. in that order (ci ascends), per
      // thread (its two rows of each tile) in col_sums[cj], unrolled so that cj indexes registers.
      float r_part[2] = {0.f, 0.f};
#pragma unroll
      for (int cj = 0; cj < kBlockChunks; ++cj) {
        if (cj > ci) break;
        const uint32_t s_kj = sbase + L::kK + cj * L::kQKTile, s_vj = sbase + L::kV + cj * L::kVTile;
        float qk[8][4], dov[8][4];  // Q_I K_J^T (over Dk), dO_I V_J^T (over the tile's 64 columns)
        lasp::wg::fence();
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
          const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
          lasp::wg::mma_ss<lasp::wg::Major::kK>(qk, lasp::wg::desc_sw128(s_q + k_step),
                                                lasp::wg::desc_sw128(s_kj + k_step), ks > 0);
        }
#pragma unroll
        for (int ks = 0; ks < kTileV / 16; ++ks)
          lasp::wg::mma_ss<lasp::wg::Major::kK>(dov, lasp::wg::desc_sw128(s_do + 32 * ks),
                                                lasp::wg::desc_sw128(s_vj + 32 * ks), ks > 0);
        lasp::wg::commit();
        lasp::wg::wait<0>();
        lasp::wg::fence_operands(qk);
        lasp::wg::fence_operands(dov);

        // A_uj = sigma qk dov e^{G_u - G_j}: within the chunk (cj = ci), for j < u, e^{b^I_u - b^I_j}
        // per pair; below it, e^{b^I_u + (gammas strictly between J and I)} for the row times
        // e^{gamma_J - b^J_j} (col_decay) for the column, each <= 1.
        auto add_pairs = [&](auto&& weigh) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) {
                const float x = weigh(qk[nt][2 * hh + e] * dov[nt][2 * hh + e], 16 * warp + 8 * hh + g,
                                      8 * nt + 2 * t + e, hh);
                r_part[hh] += x;
                col_sums[cj][nt][e] += x;
              }
        };
        if (cj < ci) {
          float between = 0.f;
          for (int m = cj + 1; m < ci; ++m) between += decay[m];
          float row_w[2];
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) row_w[hh] = p.scale * exp_nonpos(cum_i[16 * warp + 8 * hh + g] + between);
          const float* const col_w = col_decay + cj * kChunk;
          add_pairs([&](float pair, int, int j, int hh) { return pair * (row_w[hh] * col_w[j]); });
        } else {
          add_pairs([&](float pair, int r, int j, int) {
            return j < r ? p.scale * pair * exp_nonpos(cum_i[r] - cum_i[j]) : 0.f;
          });
        }
      }
      float r_sum[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        r_sum[hh] = r_part[hh];
        r_sum[hh] += __shfl_xor_sync(kAll, r_sum[hh], 1);
        r_sum[hh] += __shfl_xor_sync(kAll, r_sum[hh], 2);
      }
      store_rows(2, tok0, r_sum, [](int) { return 1.f; });
    }
    __syncthreads();  // both roles are done with chunk ci's Q and dO buffer: chunk ci + 2 goes there
    if (products && ci + 2 < blk.n) {
      issue_chunk(ci + 2);
      lasp::cp_async_commit();
    }
  }
  if (products) {
    // Z's part of this Dv tile: sum over d < DK, e of S[d][e] dH[d][e] / sigma, each as hi + lo
    // (S^T K-major: (e, d) at [d / 64][e][..]; dH MN-major: (d, e) at [d][..]), in a fixed order.
    float part = 0.f;
    for (int i = tid; i < DK * kTileV; i += lasp::sd::kThreads) {
      const int d = i / kTileV, e = i % kTileV;
      const uint32_t at_s = (d / 64) * kBlockBytes + lasp::swizzle(e, (d % 64) / 8, kChunk) + 2 * (d % 8);
      const uint32_t at_d = lasp::swizzle(d, e / 8, DK) + 2 * (e % 8);
      const float sv = bf16_at(smem + L::kSHi + at_s) + bf16_at(smem + L::kSLo + at_s);
      const float dv = bf16_at(smem + L::kDHi + at_d) + bf16_at(smem + L::kDLo + at_d);
      part = fmaf(sv, dv, part);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) part += __shfl_xor_sync(kAll, part, m);
    float* const warp_parts = reinterpret_cast<float*>(smem + L::kCum);  // cum is read no more
    if (lane == 0) warp_parts[warp] = part;
    lasp::named_barrier_sync(1, lasp::sd::kThreads);  // the products' warps only
    if (tid == 0)
      p.gate_z[((int64_t)vt * heads + bh) * lasp_sd_num_blocks(T) + blk.index] =
          p.scale * (warp_parts[0] + warp_parts[1] + warp_parts[2] + warp_parts[3]);
  } else {
    // C: each warp's column sums over its 16 rows of every tile, then the warps' in warp order.
#pragma unroll
    for (int cj = 0; cj < kBlockChunks; ++cj)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float col = col_sums[cj][nt][e];
          col += __shfl_xor_sync(kAll, col, 4);
          col += __shfl_xor_sync(kAll, col, 8);
          col += __shfl_xor_sync(kAll, col, 16);
          if (g == 0) cols[cj * kChunk + 8 * nt + 2 * t + e] = col;
        }
    lasp::named_barrier_sync(2, lasp::sd::kThreads);  // the pair tiles' warps only
    const float* const all = reinterpret_cast<const float*>(smem + L::kCols);
    for (int i = tid; i < blk.n * kChunk; i += lasp::sd::kThreads) {
      constexpr int kWarpStride = kBlockChunks * kChunk;
      const float c = all[i] + all[kWarpStride + i] + all[2 * kWarpStride + i] + all[3 * kWarpStride + i];
      if (blk.s0 + i < T) rows[3 * heads * T + blk.s0 + i] = c;
    }
  }
}
#else
// The gate terms' products are written for wgmma (sm_90a); the host launches the backward nowhere
// else (the chunk kernels' shared memory already needs an H100 / H200).
template <int DK>
__device__ __forceinline__ void gate_terms(const lasp_sd_bwd_params&) {
  __trap();
}
#endif

}  // namespace

// gate_terms<DK> is exported as lasp_sd_bwd_gate_terms_dk{64,128} (kernels/instances.rs): grid
// lasp_sdb_gate_terms_grid, block LASP_SDB_TERM_THREADS, smem lasp_sdb_gate_terms_smem_bytes(Dk).

// Per (block, b*H+h), a thread per token u of the block: dg_u = Z + sum_{i >= u} (x_q + R - C)_i +
// sum_{j < u} x_k(j), the Dv tiles' parts added in order and the block's sums in fp64; and the CTAs
// of (b, h) share the writing of dh0 = sigma e^{a_0} (dH_0 / sigma).
// grid lasp_sdb_gate_grad_grid, block LASP_SDB_GRAD_THREADS.
extern "C" __global__ void __launch_bounds__(LASP_SDB_GRAD_THREADS)
    lasp_sd_bwd_gate_grad(const __grid_constant__ lasp_sd_bwd_params p) {
  __shared__ float cum[kBlockChunks * kChunk];
  __shared__ float decay[16];
  __shared__ double warp_totals[32];
  const int64_t bh = blockIdx.y, heads = (int64_t)p.B * p.H;
  const int b = (int)bh / p.H, h = (int)bh % p.H, T = p.T;
  const Block blk(blockIdx.x, T);
  block_gates(p, blk, b, h, cum, decay);

  // Z: the pairs (j < s0, u >= s1), e^{G_{s1} - G_{s0-1}} <S_{s0-1}, dH_{s1}>, from the Dv tiles' parts.
  float log_decay = decay[kBlockChunks];  // G_{s1} - G_{s0-1}
  for (int m = 0; m < blk.n; ++m) log_decay += decay[m];
  double z = 0.0;
  for (int vt = 0; vt < lasp_sd_num_vtiles(p.Dv); ++vt)
    z += (double)p.gate_z[((int64_t)vt * heads + bh) * lasp_sd_num_blocks(T) + blk.index];
  z *= (double)exp_nonpos(log_decay);

  const int tok = blk.s0 + threadIdx.x;
  const bool valid = tok < blk.s1;
  double a = 0.0, bk = 0.0;  // x_q + R - C and x_k of this token
  if (valid) {
    for (int vt = 0; vt < lasp_sd_num_vtiles(p.Dv); ++vt) {
      const float* rows = p.gate_rows + ((int64_t)vt * 4 * heads + bh) * T + tok;
      a += (double)rows[0] + (double)rows[2 * heads * T] - (double)rows[3 * heads * T];
      bk += (double)rows[heads * T];
    }
  }
  double total_a, total_b;
  const double incl_a = block_inclusive_scan(a, warp_totals, total_a);
  const double incl_b = block_inclusive_scan(bk, warp_totals, total_b);
  if (valid) p.dg[((int64_t)b * T + tok) * p.H + h] = (float)(z + (total_a - incl_a + a) + (incl_b - bk));

  if (p.dh0) {
    const int64_t n = (int64_t)p.Dk * p.Dv, stride = (int64_t)gridDim.x * blockDim.x;
    const float factor = p.scale * expf(fminf(p.g[(int64_t)b * T * p.H + h], 0.f));  // sigma e^{a_0}
    const float* const src = p.dh0_scaled + bh * n;
    float* const dst = p.dh0 + bh * n;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) dst[e] = factor * src[e];
  }
}
