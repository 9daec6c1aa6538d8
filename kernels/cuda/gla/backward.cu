// GLA (per-key log-decays), backward, chunkwise (C = 64), for sm_90a (wgmma).
//
// The forward leaves the state entering every chunk (chunk_states); the backward walks the reverse
// recurrence for the state gradients and then computes every chunk's gradients on its own (the
// maths and the launch sequence: lasp/gla/backward_params.h):
//   lasp_gla_bwd_summary_dk*_dv*  every segment but the first, from zero: its gradient summary and
//                                 log-decay, so that the walks can start in parallel
//   lasp_gla_bwd_fold             the gradient leaving each segment
//   lasp_gla_bwd_walk_dk*_dv*     dS_{n+1} of every chunk into dh (bf16), and dh0
//   lasp_gla_bwd_grads_dk*_dv*    chunk by chunk, from q, k, v, dO, g, S_n and dS_{n+1}: dq, dk, dv, dg
// A chunk's gradients need nothing from another chunk beyond S_n and dS_{n+1} (the gate gradient's
// sum over later chunks is rowsum(S_{n+1} (.) dS_{n+1})), so the grads kernel runs one CTA per
// chunk with no order between them.
#include <math.h>
#include <stdint.h>

#include "lasp/gla/backward_params.h"
#include "lasp/gla/chunk.cuh"
#include "lasp/gla/walk.cuh"

namespace lasp {
namespace gla {

// The workspace slot (b*H+h, s) of the summaries and the fold, s < S-1.
__device__ __forceinline__ int64_t summary_slot(const lasp_gla_bwd_params& p, int64_t bh, int s) {
  return bh * (p.num_segments - 1) + s;
}

// Summary y (grid y): segment y + 1 from a zero gradient at its end into slot (b*H+h, y).
template <int DK, int DV, bool kPacked>
__device__ __forceinline__ void bwd_summary(const lasp_gla_bwd_params& p) {
  const int slot = blockIdx.y, col = 64 * (threadIdx.x >> 7);
  const Segment sg = segment_of(p, (slot + 1) * p.chunks_per_segment, p.chunks_per_segment);
  const StateLane ln = walk_lane();
  StateRegs<DK> s;
  chunk::state_zero<DK>(s, ln);
  float2 lambda;
  run_walk<DK, DV, kPacked>(p, sg, s, nullptr, lambda);
  const int64_t at = summary_slot(p, blockIdx.z, slot);
  chunk::state_store<DK>(s, ln, p.ws_m + at * DK * DV + col, DV);
  const GateLane<DK, WalkLayout<DK, DV>::kThreads> gl(threadIdx.x);
  if (gl.first == 0) reinterpret_cast<float2*>(p.ws_lambda + at * DK)[gl.pair] = lambda;
}

// Walk y (grid y): segment y from the gradient leaving it (dht, or the fold's) into dh; segment
// 0 also writes dh0.
template <int DK, int DV, bool kPacked>
__device__ __forceinline__ void bwd_walk(const lasp_gla_bwd_params& p) {
  const int S = p.num_segments, seg = blockIdx.y, col = 64 * (threadIdx.x >> 7);
  const int64_t bh = blockIdx.z, tile = (int64_t)DK * DV;
  const Segment sg = segment_of(p, seg * p.chunks_per_segment, p.chunks_per_segment);
  const StateLane ln = walk_lane();
  const float* leaving = seg < S - 1 ? p.ws_p + summary_slot(p, bh, seg) * tile : p.dht ? p.dht + bh * tile : nullptr;
  StateRegs<DK> s;
  if (leaving)
    chunk::state_load<DK>(s, ln, leaving + col, DV);
  else
    chunk::state_zero<DK>(s, ln);
  float2 lambda;
  run_walk<DK, DV, kPacked>(p, sg, s, p.dh + bh * lasp_gla_num_chunks(p.T) * tile, lambda);
  if (seg == 0 && p.dh0) chunk::state_store<DK>(s, ln, p.dh0 + bh * tile + col, DV);
}

// ---------------------------------------------------------------------------------------------
// The gradients of one chunk: one CTA per (chunk, b*H+h), one warpgroup per 64 columns of
// max(Dk, Dv); warpgroup w owns the columns [64 w, 64 w + 64) of dq and dk (if w < Dk/64) and of
// dv (if w < Dv/64).
//
// As in the forward, the intra-chunk terms are tensor-core products of decayed tiles. Per key
// dimension, with a Q-side reference c and a K-side reference c':
//   Q~ = Q (.) e^{b - c},  K^ = K (.) e^{c' - b},  S_c = diag(e^{c}) S_n,  dS' = diag(e^{gamma - c'}) dS_{n+1}
//   A^T = sigma [j <= r] K^ Q~^T,  dA = sigma [r >= j] dO V^T (and its transpose, as a product too)
//   dv  = A^T dO + K^ dS'
//   dk  = e^{c' - b} (.) (V dS'^T + dA^T Q~)
//   dq  = e^{b - c} (.) (sigma dO S_c^T + dA K^)
// A flat column (both half-chunk log-decays >= -kSpanLimit) takes c = c' = b_31, the forward's
// reference: every exponent is bounded. A steep column takes c = 0 and c' = gamma, which keeps the
// state terms exact (every exponent <= 0) but not the intra-chunk ones: a chunk with a steep column
// computes A^T and the intra-chunk parts of dq and dk term by term in fp32 instead.
//
// The gate gradient: dg_t = carry + sum_{s >= t in the chunk} (q (.) dq - k (.) dk)_s, with the
// carry (the part of the chunks after this one) e^{gamma} (.) rowsum(S_n (.) dS_{n+1}) +
// sum_j k_j (.) dk_j^{inter}, where dk^{inter} = e^{c' - b} (.) (V dS'^T) is taken from the dk
// accumulator before the intra-chunk product is added to it.
//
// Packed documents (the forward's masks, lasp/gla/chunk.cuh): scores keep only pairs of one
// document; dS_{n+1} reaches only keys from the chunk's last start on (dv's and dk's state terms),
// S_n only rows below its first start (dq's), and a chunk holding a start has no carry. A row's
// gate gradient sums only its own document's rows, U_r - U_{end(r)} with U the chunk's suffix sums
// and end(r) the next start; the part from later chunks reaches only the document leaving the
// chunk; a start's own gate, which nothing reads, gets 0.
// ---------------------------------------------------------------------------------------------
template <int DK, int DV>
struct GradsLayout {
  static constexpr int kGroups = (DK > DV ? DK : DV) / 64;
  static constexpr int kThreads = 128 * kGroups;
  static constexpr uint32_t kQ = 0;                            // Q, then Q~
  static constexpr uint32_t kK = kQ + kChunk * DK * 2;         // K, then K^
  static constexpr uint32_t kV = kK + kChunk * DK * 2;
  static constexpr uint32_t kDo = kV + kChunk * DV * 2;
  static constexpr uint32_t kS = kDo + kChunk * DV * 2;        // S_c as saved: [DK/64] blocks of [64 x DV]
  static constexpr uint32_t kDs = kS + DK * DV * 2;            // dS_{n+1}, then dS'
  static constexpr uint32_t kGates = kDs + DK * DV * 2;        // gates, then their cumsums b
  static constexpr uint32_t kDa = kGates + kChunk * DK * 4;    // fp32 [64][64]: dA (steep chunks)
  static constexpr uint32_t kRefQ = kDa + kChunk * kChunk * 4; // fp32 [DK]: c
  static constexpr uint32_t kRefK = kRefQ + DK * 4;            // fp32 [DK]: c'
  static constexpr uint32_t kCarry = kRefK + DK * 4;           // fp32 [DK]: gamma, then e^{gamma} rowsum(S_n dS_{n+1})
  static constexpr uint32_t kColsK = kCarry + DK * 4;          // fp32 [4 warps][DK]: sum_j k dk^{inter}
  static constexpr uint32_t kColsG = kColsK + 4 * DK * 4;      // fp32 [4 warps][DK]: the warps' sums of dG
  static constexpr uint32_t kTotals = kColsG + 4 * DK * 4;     // float2 [row block][pair]
  static constexpr uint32_t kBytes = kTotals + kThreads * 8;
  // Packed documents: K^ without the keys below the chunk's last start, for dv's state term.
  static constexpr uint32_t kKeysLeaving = (kBytes + 1023) / 1024 * 1024;
  static constexpr uint32_t kPackedBytes = kKeysLeaving + kChunk * DK * 2;
  static constexpr uint32_t kStateBlock = kChunk * DV * 2;     // 64 rows of a [DK x DV] state tile
  static_assert(kS % 1024 == 0 && kDs % 1024 == 0 && kGates % 1024 == 0, "tiles stay 1024-byte aligned");
};

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// The two bf16 of row `row`, columns (col, col + 1) of a [T-strided] tensor as floats (zero past T).
__device__ __forceinline__ float2 load_pair(const uint16_t* base, int64_t stride, int row, int valid, int col) {
  if (row >= valid) return make_float2(0.f, 0.f);
  const uint32_t w = __ldg(reinterpret_cast<const unsigned int*>(base + row * stride + col));
  return make_float2(bf16_lo(w), bf16_hi(w));
}

// A steep chunk's transposed scores, term by term in fp32: a[j][r] = sum_d q_rd k_jd e^{b_rd - b_jd}
// for this lane's entries (j = 16 warp + 8 hh + g, r = 8 nt + 2 t + e) with j <= r, zero above
// (the forward's exact_scores, transposed). q and k come from global memory (their tiles hold the
// decayed copies), the cumsums b from the gate tile.
template <int DK>
__device__ __forceinline__ void exact_scores_t(float (&a)[8][4], const uint16_t* q, const uint16_t* k, int64_t stride,
                                               const float* s_b, int valid, int warp, int g, int t) {
  auto bf = [&](const uint16_t* base, int row, int d) {
    return row < valid ? __uint_as_float(static_cast<uint32_t>(__ldg(base + row * stride + d)) << 16) : 0.f;
  };
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[nt][e] = 0.f;
  for (int d = 0; d < DK; ++d) {
    float kv[2], bj[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = 16 * warp + 8 * hh + g;
      kv[hh] = bf(k, j, d);
      bj[hh] = s_b[j * DK + d];
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 8 * nt + 2 * t + e;
        const float qv = bf(q, r, d), br = s_b[r * DK + d];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int j = 16 * warp + 8 * hh + g;
          if (j <= r) a[nt][2 * hh + e] = fmaf(qv * kv[hh], exp_nonpos(br - bj[hh]), a[nt][2 * hh + e]);
        }
      }
  }
}

// A steep chunk's intra-chunk parts of dq and dk, term by term in fp32, added to this lane's
// entries (rows 16 warp + 8 hh + g, key columns col + 8 nt + 2 t + e):
//   dq[r][c] += sum_{j <= r} dA[r][j] k_jc e^{b_rc - b_jc},  dk[j][c] += sum_{r >= j} dA[r][j] q_rc e^{b_rc - b_jc}
// with dA (sigma and the mask applied) from shared memory.
template <int DK>
__device__ __forceinline__ void exact_intra(float (&dq)[8][4], float (&dk)[8][4], const uint16_t* q, const uint16_t* k,
                                            int64_t stride, const float* s_b, const float* s_da, int valid, int col,
                                            int warp, int g, int t) {
  for (int m = 0; m < kChunk; ++m) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int c = col + 8 * nt + 2 * t;
      const float2 km = load_pair(k, stride, m, valid, c), qm = load_pair(q, stride, m, valid, c);
      const float bm[2] = {s_b[m * DK + c], s_b[m * DK + c + 1]};
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = 16 * warp + 8 * hh + g;
        const float to_q = m <= row ? s_da[row * kChunk + m] : 0.f;  // dA[row][m], m as the key
        const float to_k = m >= row ? s_da[m * kChunk + row] : 0.f;  // dA[m][row], m as the query
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float br = s_b[row * DK + c + e];
          const float kme = e ? km.y : km.x, qme = e ? qm.y : qm.x;
          dq[nt][2 * hh + e] = fmaf(to_q * kme, exp_nonpos(br - bm[e]), dq[nt][2 * hh + e]);
          dk[nt][2 * hh + e] = fmaf(to_k * qme, exp_nonpos(bm[e] - br), dk[nt][2 * hh + e]);
        }
      }
    }
  }
}

// Zeroes an accumulator's rows (16 warp + 8 hh + g) below `row`, or from `row` on.
__device__ __forceinline__ void zero_rows_below(float (&acc)[8][4], int row, int warp, int g) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
    if (16 * warp + 8 * hh + g < row)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) acc[nt][2 * hh] = acc[nt][2 * hh + 1] = 0.f;
}
__device__ __forceinline__ void zero_rows_from(float (&acc)[8][4], int row, int warp, int g) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
    if (16 * warp + 8 * hh + g >= row)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) acc[nt][2 * hh] = acc[nt][2 * hh + 1] = 0.f;
}

// Packs an accumulator (rows 16 warp + 8 hh + g, columns 8 nt + 2 t + e) into mma_rs A fragments,
// times sigma, keeping the entries with keep(hh, row, col).
template <class Keep>
__device__ __forceinline__ void pack_masked(uint32_t (&pa)[4][4], const float (&acc)[8][4], float sigma, int warp,
                                            int g, int t, Keep&& keep) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g, c = 8 * nt + 2 * t;
      const float x0 = keep(hh, r, c) ? sigma * acc[nt][2 * hh] : 0.f;
      const float x1 = keep(hh, r, c + 1) ? sigma * acc[nt][2 * hh + 1] : 0.f;
      pa[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(x0, x1);
    }
}

// The gate gradient of a chunk holding a document start (the file's head), from this lane's rows'
// sums down to the end of their warp (dgv) and the warps' totals: U_r goes to the warpgroup's own
// columns of s_b (the cumsums, read no more), then each row subtracts U at its document's end.
template <int DK>
__device__ __forceinline__ void packed_gate_gradients(float (&dgv)[8][4], float* dg_dst, int64_t stride,
                                                      const ChunkStarts& starts, float* s_b, const float* carry,
                                                      const float* cols_k, const float* cols_g, int valid, int col,
                                                      int warp, int g, int t) {
  float tail[8][2];  // the part from later chunks, for the document leaving the chunk
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = col + 8 * nt + 2 * t + e;
      float x = carry[c], below = 0.f;
#pragma unroll
      for (int w = 0; w < 4; ++w) x += cols_k[w * DK + c];
      for (int w = 3; w > warp; --w) below += cols_g[w * DK + c];
      tail[nt][e] = x;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        dgv[nt][2 * hh + e] += below;
        s_b[(16 * warp + 8 * hh + g) * DK + c] = dgv[nt][2 * hh + e];
      }
    }
  named_barrier_sync(1 + (col / 64), 128);  // the warpgroup's suffix sums U are in s_b
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * warp + 8 * hh + g;
    if (r >= valid) continue;
    const int end = starts.document_end(r);
    const bool is_start = (starts.word >> r) & 1ull;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float u = dgv[nt][2 * hh + e];
        x[e] = is_start ? 0.f : end < kChunk ? u - s_b[end * DK + col + 8 * nt + 2 * t + e] : u + tail[nt][e];
      }
      *reinterpret_cast<float2*>(dg_dst + r * stride + 8 * nt) = make_float2(x[0], x[1]);
    }
  }
}

template <int DK, int DV, bool kPacked>
__device__ __forceinline__ void bwd_grads(const lasp_gla_bwd_params& p) {
  using L = GradsLayout<DK, DV>;
  constexpr int kThreads = L::kThreads;
  // The chunk's cumsums, formed by as many threads in the same row blocks as the forward's output
  // pass forms them: the same bits, hence the same reference row c as the one the forward scaled
  // the chunk states with.
  constexpr int kScanThreads = lasp_gla_output_threads(DV);
  using G = GateLane<DK, kScanThreads>;
  static_assert(kScanThreads <= kThreads, "the scan's threads are the CTA's first");
  static_assert((kPacked ? L::kPackedBytes : L::kBytes) == lasp_gla_bwd_grads_smem_bytes(DK, DV, kPacked),
                "shared-memory map and host formula disagree");
  static_assert(kThreads == lasp_gla_bwd_grads_threads(DK, DV), "one warpgroup per 64 columns");
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31, group = tid >> 7;
  const int g = lane >> 2, t = lane & 3;
  const int n = blockIdx.x;
  const int64_t bh = blockIdx.y;
  const int b = (int)(bh / p.H), h = (int)(bh % p.H), T = p.T;
  const int tok0 = n * kChunk, valid = min(kChunk, T - tok0);
  const int64_t row0 = ((int64_t)b * T + tok0) * p.H + h;  // the chunk's first token of (b, h)
  const int64_t qk_stride = (int64_t)p.H * DK, v_stride = (int64_t)p.H * DV;
  const uint16_t* q = p.q + row0 * DK;
  const uint16_t* k = p.k + row0 * DK;
  const int64_t state = ((int64_t)bh * lasp_gla_num_chunks(T) + n) * DK * DV;
  float* s_b = reinterpret_cast<float*>(smem + L::kGates);
  float* ref_q = reinterpret_cast<float*>(smem + L::kRefQ);
  float* ref_k = reinterpret_cast<float*>(smem + L::kRefK);
  float* carry = reinterpret_cast<float*>(smem + L::kCarry);
  float* cols_k = reinterpret_cast<float*>(smem + L::kColsK);
  float* cols_g = reinterpret_cast<float*>(smem + L::kColsG);
  float* s_da = reinterpret_cast<float*>(smem + L::kDa);
  const ChunkStarts starts = ChunkStarts::load<kPacked>(p.starts, n);

  // The copies in three groups, in the order of use: the gates, Q and K (the gate work); V and dO
  // (the score products); the two states (their scaling pass runs under the score products).
  copy_gates_async<DK, kThreads>(sbase + L::kGates, p.g + row0 * DK, qk_stride, valid, tid);
  chunk::copy_tile_async<DK / 8, kThreads>(sbase + L::kQ, q, qk_stride, valid, tid);
  chunk::copy_tile_async<DK / 8, kThreads>(sbase + L::kK, k, qk_stride, valid, tid);
  cp_async_commit();
  chunk::copy_tile_async<DV / 8, kThreads>(sbase + L::kV, p.v + row0 * DV, v_stride, valid, tid);
  chunk::copy_tile_async<DV / 8, kThreads>(sbase + L::kDo, p.d_o + row0 * DV, v_stride, valid, tid);
  cp_async_commit();
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) {
    chunk::copy_tile_async<DV / 8, kThreads>(sbase + L::kS + mt * L::kStateBlock, p.chunk_states + state + mt * 64 * DV, DV,
                                             kChunk, tid);
    chunk::copy_tile_async<DV / 8, kThreads>(sbase + L::kDs + mt * L::kStateBlock, p.dh + state + mt * 64 * DV, DV,
                                             kChunk, tid);
  }
  cp_async_commit();
  cp_async_wait<2>();
  __syncthreads();  // the gates, Q and K have landed

  // Gate work, part 1: the scan and the references (the forward's flat test and reference row).
  const bool scans = tid < kScanThreads;
  const G gl(tid);
  float2* totals = reinterpret_cast<float2*>(smem + L::kTotals);
  if (scans) scan_row_block(s_b, totals, gl);
  __syncthreads();
  ColumnScan cs{};
  bool flat = true;
  float2 rq{}, rk{};
  if (scans) {
    cs = scan_columns(s_b, totals, gl);
    const bool flat_x = cs.head.x - cs.half.x <= kSpanLimit && cs.half.x - cs.gamma.x <= kSpanLimit;
    const bool flat_y = cs.head.y - cs.half.y <= kSpanLimit && cs.half.y - cs.gamma.y <= kSpanLimit;
    flat = flat_x && flat_y;
    rq = make_float2(flat_x ? cs.half.x : 0.f, flat_y ? cs.half.y : 0.f);
    rk = make_float2(flat_x ? cs.half.x : cs.gamma.x, flat_y ? cs.half.y : cs.gamma.y);
    if (gl.first == 0) {
      reinterpret_cast<float2*>(ref_q)[gl.pair] = rq;
      reinterpret_cast<float2*>(ref_k)[gl.pair] = rk;
      reinterpret_cast<float2*>(carry)[gl.pair] = cs.gamma;
    }
  }
  const bool steep = __syncthreads_or(!flat);

  // Gate work, part 2: Q~ and K^ in place, the cumsums in place of the gates.
  if (scans) {
    float2 run = cs.before;
    constexpr int kBatch = 8;
    static_assert(G::kRows % kBatch == 0, "whole batches of rows");
#pragma unroll
    for (int j0 = 0; j0 < G::kRows; j0 += kBatch) {
      float2 a[kBatch];
      uint32_t qw[kBatch], kw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int r = gl.first + j0 + j;
        a[j] = gate_pair<DK>(s_b, r, gl.pair);
        qw[j] = *reinterpret_cast<const uint32_t*>(smem + L::kQ + gl.tile_offset(r));
        kw[j] = *reinterpret_cast<const uint32_t*>(smem + L::kK + gl.tile_offset(r));
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int r = gl.first + j0 + j;
        run = add2(run, a[j]);
        gate_pair<DK>(s_b, r, gl.pair) = run;
        *reinterpret_cast<uint32_t*>(smem + L::kQ + gl.tile_offset(r)) =
            scale_bf16x2(qw[j], exp_any(fminf(run.x - rq.x, kSpanLimit)), exp_any(fminf(run.y - rq.y, kSpanLimit)));
        *reinterpret_cast<uint32_t*>(smem + L::kK + gl.tile_offset(r)) =
            scale_bf16x2(kw[j], exp_any(fminf(rk.x - run.x, kSpanLimit)), exp_any(fminf(rk.y - run.y, kSpanLimit)));
      }
    }
    // Packed documents: the copy of K^ that dv's state term takes in a chunk holding a start, whose
    // keys below the last start (a document that ends in the chunk) are zero. A copy, and not a
    // split of dv's products around a mask of its rows, keeps the products one unbroken group.
    if (kPacked && starts.any()) {
#pragma unroll
      for (int i = 0; i < G::kRows; ++i) {
        const int r = gl.first + i;
        const uint32_t off = gl.tile_offset(r);
        *reinterpret_cast<uint32_t*>(smem + L::kKeysLeaving + off) =
            r < starts.last() ? 0u : *reinterpret_cast<const uint32_t*>(smem + L::kK + off);
      }
    }
  }
  cp_async_wait<1>();
  wg::fence_proxy_async();  // Q~, K^ and the landed V, dO visible to wgmma's async proxy
  __syncthreads();          // ... for every thread; the references and gamma are written

  const uint32_t sQ = sbase + L::kQ, sK = sbase + L::kK, sV = sbase + L::kV, sDo = sbase + L::kDo;
  const uint32_t sS = sbase + L::kS, sDs = sbase + L::kDs;
  const float sigma = p.scale;

  // The score products, every warpgroup its own copy: A^T (rows j, columns r), dA^T, dA. They run
  // while the states are scaled below.
  float at[8][4], dat[8][4], da[8][4];
  wg::fence();
  if (!steep) {
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
      wg::mma_ss<wg::Major::kK>(at, wg::desc_sw128(sK + k_step), wg::desc_sw128(sQ + k_step), ks > 0);
    }
  }
#pragma unroll
  for (int ks = 0; ks < DV / 16; ++ks) {
    const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
    wg::mma_ss<wg::Major::kK>(dat, wg::desc_sw128(sV + k_step), wg::desc_sw128(sDo + k_step), ks > 0);
    wg::mma_ss<wg::Major::kK>(da, wg::desc_sw128(sDo + k_step), wg::desc_sw128(sV + k_step), ks > 0);
  }
  wg::commit();
  cp_async_wait<0>();
  __syncthreads();  // the states have landed

  // The state tiles: S_c = diag(e^{c}) S_n arrives so (the forward's chunk states); dS' =
  // diag(e^{gamma - c'}) dS_{n+1} in place, and carry = e^{gamma} rowsum(S_n (.) dS_{n+1}) =
  // e^{gamma - c} rowsum(S_c (.) dS_{n+1}). The 16-byte pieces of a row are DV/8 consecutive
  // threads, which add their parts with shuffles.
  {
    constexpr int kRowPieces = DV / 8;
    static_assert((DK * kRowPieces) % kThreads == 0 && 32 % kRowPieces == 0, "whole rows per warp");
#pragma unroll 2
    for (int i = tid; i < DK * kRowPieces; i += kThreads) {
      const int d = i / kRowPieces, piece = i % kRowPieces;
      const uint32_t at = (d / 64) * L::kStateBlock + swizzle(d % 64, piece, kChunk);
      const uint4 sw = *reinterpret_cast<const uint4*>(smem + L::kS + at);
      uint4 dw = *reinterpret_cast<const uint4*>(smem + L::kDs + at);
      const float gamma = carry[d];
      const float d_scale = exp_nonpos(gamma - ref_k[d]);
      float dot = 0.f;
      const uint32_t* sv = reinterpret_cast<const uint32_t*>(&sw);
      uint32_t* dv = reinterpret_cast<uint32_t*>(&dw);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dot = fmaf(bf16_lo(sv[e]), bf16_lo(dv[e]), dot);
        dot = fmaf(bf16_hi(sv[e]), bf16_hi(dv[e]), dot);
        dv[e] = scale_bf16x2(dv[e], d_scale, d_scale);
      }
      *reinterpret_cast<uint4*>(smem + L::kDs + at) = dw;
#pragma unroll
      for (int m = 1; m < kRowPieces; m <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
      if (piece == 0) carry[d] = starts.any() ? 0.f : exp_nonpos(gamma - ref_q[d]) * dot;
    }
  }
  wg::fence_proxy_async();
  __syncthreads();  // every decayed tile is complete

  uint32_t p_at[4][4], p_dat[4][4], p_da[4][4];
  {
    wg::wait<0>();
    wg::fence_operands(at);
    wg::fence_operands(dat);
    wg::fence_operands(da);
    if (steep) {
      exact_scores_t<DK>(at, q, k, qk_stride, s_b, valid, warp, g, t);
      if (group == 0) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int r = 16 * warp + 8 * hh + g, j = 8 * nt + 2 * t + e;
              s_da[r * kChunk + j] = j <= r && j >= starts.start_at_or_before(r) ? sigma * da[nt][2 * hh + e] : 0.f;
            }
      }
      __syncthreads();
    }
    // Pairs of one document: query r < end(j) for a row j of keys, key j >= f(r) for a row r of
    // queries (in a chunk without a start end = 64 and f = -1: the causal masks alone). Bounds per
    // accumulator row and no branch: a branch between the plain and the masked packs slowed every
    // chunk of the twin (its grads kernel 1.16 -> 1.25 ms).
    int row_end[2] = {kChunk, kChunk}, row_start[2] = {-1, -1};
    if constexpr (kPacked) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        row_end[hh] = starts.document_end(16 * warp + 8 * hh + g);
        row_start[hh] = starts.start_at_or_before(16 * warp + 8 * hh + g);
      }
    }
    const auto to_queries = [&](int hh, int j, int r) { return j <= r && r < row_end[hh]; };
    pack_masked(p_at, at, sigma, warp, g, t, to_queries);
    pack_masked(p_dat, dat, sigma, warp, g, t, to_queries);
    pack_masked(p_da, da, sigma, warp, g, t, [&](int hh, int r, int j) { return j <= r && j >= row_start[hh]; });
  }

  const bool owns_v = group < DV / 64, owns_k = group < DK / 64;
  const int col = 64 * group;  // this warpgroup's first column of dq, dk and dv
  float dv[8][4], dk[8][4], dq[8][4];
  wg::fence();
  if (owns_v) {
    // dv = K^ dS' + A^T dO (this warpgroup's 64 columns; the first product starts the accumulator).
    // Packed documents: keys of a document that ends in the chunk have no state term.
    const uint32_t sK_state = kPacked && starts.any() ? sbase + L::kKeysLeaving : sK;
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks)
      wg::mma_ss<wg::Major::kMN>(dv, wg::desc_sw128(sK_state + kBlockBytes * (ks >> 2) + 32 * (ks & 3)),
                                 wg::desc_sw128(sDs + (ks >> 2) * L::kStateBlock + group * kBlockBytes +
                                                (ks & 3) * kRow16),
                                 ks > 0);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wg::mma_rs<wg::Major::kMN>(dv, p_at[kk], wg::desc_sw128(sDo + group * kBlockBytes + kk * kRow16));
  }
  if (owns_k) {
    // dk's state term V dS'^T and dq's sigma^-1 dO S_c^T (this warpgroup's 64 key columns).
#pragma unroll
    for (int ks = 0; ks < DV / 16; ++ks) {
      const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
      wg::mma_ss<wg::Major::kK>(dk, wg::desc_sw128(sV + k_step),
                                wg::desc_sw128(sDs + group * L::kStateBlock + k_step), ks > 0);
      wg::mma_ss<wg::Major::kK>(dq, wg::desc_sw128(sDo + k_step),
                                wg::desc_sw128(sS + group * L::kStateBlock + k_step), ks > 0);
    }
  }
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(dv);
  wg::fence_operands(dk);
  wg::fence_operands(dq);

  if (owns_v) {
    uint16_t* dst = p.dv + row0 * DV + col + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
      if (r < valid) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          *reinterpret_cast<uint32_t*>(dst + r * v_stride + 8 * nt) = pack_bf16x2(dv[nt][2 * hh], dv[nt][2 * hh + 1]);
      }
    }
  }
  if (!owns_k) return;
  if (starts.any()) {  // the state terms' reach (the dv product's above)
    zero_rows_below(dk, starts.last(), warp, g);
    zero_rows_from(dq, starts.first(), warp, g);
  }

  // sum_j k_j (.) dk_j^{inter} over this warp's rows, per column, into cols_k[warp].
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float part[2] = {0.f, 0.f};
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int j = 16 * warp + 8 * hh + g, c = col + 8 * nt + 2 * t;
      const float2 kv = load_pair(k, qk_stride, j, valid, c);
      part[0] = fmaf(kv.x * exp_any(fminf(ref_k[c] - s_b[j * DK + c], kSpanLimit)), dk[nt][2 * hh], part[0]);
      part[1] = fmaf(kv.y * exp_any(fminf(ref_k[c + 1] - s_b[j * DK + c + 1], kSpanLimit)), dk[nt][2 * hh + 1], part[1]);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float x = part[e];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g == 0) cols_k[warp * DK + col + 8 * nt + 2 * t + e] = x;
    }
  }

  // The intra-chunk products (flat chunks): dk += dA^T Q~, dq = sigma (dO S_c^T) + dA K^.
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[nt][e] *= sigma;
  if (!steep) {
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wg::mma_rs<wg::Major::kMN>(dk, p_dat[kk], wg::desc_sw128(sQ + group * kBlockBytes + kk * kRow16));
      wg::mma_rs<wg::Major::kMN>(dq, p_da[kk], wg::desc_sw128(sK + group * kBlockBytes + kk * kRow16));
    }
    wg::commit();
    wg::wait<0>();
    wg::fence_operands(dk);
    wg::fence_operands(dq);
  }
  // Out of the reference frames: dk = e^{c' - b} (.) dk, dq = e^{b - c} (.) dq.
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int r = 16 * warp + 8 * hh + g, c = col + 8 * nt + 2 * t + e;
        const float br = s_b[r * DK + c];
        dk[nt][2 * hh + e] *= exp_any(fminf(ref_k[c] - br, kSpanLimit));
        dq[nt][2 * hh + e] *= exp_any(fminf(br - ref_q[c], kSpanLimit));
      }
  if (steep) exact_intra<DK>(dq, dk, q, k, qk_stride, s_b, s_da, valid, col, warp, g, t);

  // dG = q (.) dq - k (.) dk; the stores of dq and dk.
  float dgv[8][4];
  uint16_t* dq_dst = p.dq + row0 * DK + col + 2 * t;
  uint16_t* dk_dst = p.dk + row0 * DK + col + 2 * t;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * warp + 8 * hh + g;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float2 qv = load_pair(q, qk_stride, r, valid, col + 8 * nt + 2 * t);
      const float2 kv = load_pair(k, qk_stride, r, valid, col + 8 * nt + 2 * t);
      dgv[nt][2 * hh] = qv.x * dq[nt][2 * hh] - kv.x * dk[nt][2 * hh];
      dgv[nt][2 * hh + 1] = qv.y * dq[nt][2 * hh + 1] - kv.y * dk[nt][2 * hh + 1];
      if (r < valid) {
        *reinterpret_cast<uint32_t*>(dq_dst + r * qk_stride + 8 * nt) = pack_bf16x2(dq[nt][2 * hh], dq[nt][2 * hh + 1]);
        *reinterpret_cast<uint32_t*>(dk_dst + r * qk_stride + 8 * nt) = pack_bf16x2(dk[nt][2 * hh], dk[nt][2 * hh + 1]);
      }
    }
  }
  // Suffix sums down the chunk's rows: within the warp's 8-row halves (lanes 4 apart), across
  // its two halves, then across the warps through shared memory.
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float x = dgv[nt][i];
#pragma unroll
      for (int m = 1; m < 8; m <<= 1) {
        const float y = __shfl_down_sync(0xffffffffu, x, 4 * m);
        if (g + m < 8) x += y;
      }
      dgv[nt][i] = x;
    }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float lower = __shfl_sync(0xffffffffu, dgv[nt][2 + e], t);  // rows 8..15 of the warp, summed
      dgv[nt][e] += lower;
      const float warp_total = __shfl_sync(0xffffffffu, dgv[nt][e], t);
      if (g == 0) cols_g[warp * DK + col + 8 * nt + 2 * t + e] = warp_total;
    }
  named_barrier_sync(1 + group, 128);  // this warpgroup's cols_k and cols_g are written
  float* dg_dst = p.dg + row0 * DK + col + 2 * t;
  if (starts.any()) {
    packed_gate_gradients<DK>(dgv, dg_dst, qk_stride, starts, s_b, carry, cols_k, cols_g, valid, col, warp, g, t);
    return;
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float add[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = col + 8 * nt + 2 * t + e;
      float x = carry[c];
#pragma unroll
      for (int w = 0; w < 4; ++w) x += cols_k[w * DK + c];
      for (int w = 3; w > warp; --w) x += cols_g[w * DK + c];
      add[e] = x;
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
      if (r < valid)
        *reinterpret_cast<float2*>(dg_dst + r * qk_stride + 8 * nt) =
            make_float2(dgv[nt][2 * hh] + add[0], dgv[nt][2 * hh + 1] + add[1]);
    }
  }
}

}  // namespace gla
}  // namespace lasp

// The fold: ws_p slot (bh, s) = the gradient leaving segment s, from dht (or 0) leaving segment
// S-1, descending through the reverse summaries of segments S-1 .. s+1 (slot s holds segment
// s+1's): G <- diag(e^{Lambda}) G + M. One thread per state element (d, c) per b*H+h; only when
// S > 1.
extern "C" __global__ void __launch_bounds__(LASP_GLA_BWD_FOLD_THREADS)
    lasp_gla_bwd_fold(const __grid_constant__ lasp_gla_bwd_params p) {
  const int64_t n = (int64_t)p.Dk * p.Dv;
  const int64_t e = (int64_t)blockIdx.x * LASP_GLA_BWD_FOLD_THREADS + threadIdx.x;
  if (e >= n) return;
  const int64_t bh = blockIdx.y;
  const int d = static_cast<int>(e / p.Dv), slots = p.num_segments - 1;
  float leaving = p.dht ? p.dht[bh * n + e] : 0.f;
  for (int s = slots - 1; s >= 0; --s) {
    const int64_t slot = lasp::gla::summary_slot(p, bh, s);
    leaving = lasp::gla::fold_step(leaving, __ldg(p.ws_lambda + slot * p.Dk + d), __ldg(p.ws_m + slot * n + e));
    p.ws_p[slot * n + e] = leaving;
  }
}
