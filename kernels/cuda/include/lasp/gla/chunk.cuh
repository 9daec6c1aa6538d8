// Device building blocks of the GLA forward (gla/forward.cu): the per-key gate work of a chunk
// (column cumsums of the [64 x Dk] log-gates and the decayed Q and K tiles it weighs), the states
// loop and the output loop, and the fold of segment summaries.
//
// Per chunk, b_r in R^Dk is the chunk-local inclusive cumsum of the gates, gamma = b_63, and
//   O       = sigma ( (Q (.) e^{b}) S_n + A V ),   A_rj = [r >= j] sum_d q_rd k_jd e^{b_rd - b_jd}
//   S_{n+1} = diag(e^{gamma}) S_n + (K (.) e^{gamma - b})^T V.
// A per-key decay does not factor out of the scores as a scalar mask does, and e^{b_r} e^{-b_j}
// overflows once -b_j is large. The scores are one tensor-core product anyway: with a reference row
// c in R^Dk (the cumsum after the chunk's first half, row 31),
//   A_rj = sum_d (q_rd e^{b_rd - c_d}) (k_jd e^{c_d - b_jd}),
// whose positive exponents are at most the log-decay of one half of the chunk: for rows r < 32,
// b_r - c <= b_0 - c, and for keys j >= 32, c - b_j <= c - gamma; every unmasked term (r >= j) has
// b_r - b_j <= 0 in every dimension. Where both half-chunk spans are <= kSpanLimit in every dimension
// (log-decays above -1 per token on average: every chunk of the usual GLA gates) the factored
// product is exact up to bf16 rounding. A chunk where some dimension decays faster (a "steep"
// chunk) computes its scores term by term in fp32 instead (exact_scores: correct for any gates,
// about ten times the cost of the chunk). The inter-chunk term uses the same decayed queries:
// (Q (.) e^{b - c}) (diag(e^{c}) S_n), the reference folded into the bf16 copy of the state.
//
// Packed documents (kernels/docs/packed.md) mask at the starts, with the chunk's cumsums kept: with
// f(r) the last start at or before row r, a score keeps only keys j >= f(r), the entering state
// reaches only rows below the chunk's first start, only keys from its last start on reach the
// leaving state, and a chunk holding a start carries nothing of the entering state (its decay, and
// a segment's log-decay from there back, is zero: Lambda = -inf).
#pragma once
#include <math.h>
#include <stdint.h>

#include "lasp/chunk/state_tile.cuh"
#include "lasp/chunk/tile_copy.cuh"
#include "lasp/documents/chunk_starts.cuh"
#include "lasp/gla/forward_params.h"
#include "lasp/mma.cuh"
#include "lasp/wgmma.cuh"

namespace lasp {
namespace gla {

using chunk::exp_nonpos;
using chunk::for_each_state_pair;
using chunk::kChunk;
using chunk::StateLane;
using chunk::StateRegs;
using documents::ChunkStarts;
static_assert(kChunk == LASP_GLA_CHUNK, "one chunk size");

// Bound on the positive exponents of the factored scores (natural log): e^64 |q| stays far from
// the bf16 / fp32 range, and the masked scores above the diagonal (at most e^128 |q||k|) may
// overflow to inf only where the mask discards them.
constexpr float kSpanLimit = 64.f;
constexpr float kLog2e = 1.4426950408889634f;
constexpr uint32_t kRow16 = 16 * 128;           // bytes of 16 rows of a swizzled tile
constexpr uint32_t kBlockBytes = kChunk * 128;  // one 64-column block of a [64 x D] tile

// Rewrites an accumulator's registers by a product with `one` (1, but opaque to the compiler, so
// the product is not folded away; see the output loop).
__device__ __forceinline__ void redefine(float (&d)[8][4], float one) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) d[i][e] *= one;
}

// e^x for x of either sign (the callers bound it).
__device__ __forceinline__ float exp_any(float x) { return ex2_approx(x * kLog2e); }

// The fold of segment (or rank) prefixes, one element of row d: P = diag(e^{Lambda}) P + M.
__device__ __forceinline__ float fold_step(float prefix, float lambda_d, float m) {
  return fmaf(expf(fminf(lambda_d, 0.f)), prefix, m);
}

// Async copy of a chunk's [64 x DK] fp32 gates (rows of the fla layout [B, T, H, Dk], `stride`
// floats apart) into a plain row-major tile at dst; rows >= valid_rows are zero (a = 0 changes
// neither the cumsums nor the state).
template <int DK, int kThreads>
__device__ __forceinline__ void copy_gates_async(uint32_t dst, const float* row0, int64_t stride, int valid_rows,
                                                 int tid) {
  constexpr int kRowChunks = DK / 4;
  static_assert((kChunk * kRowChunks) % kThreads == 0, "whole rounds of 16-byte copies");
#pragma unroll
  for (int i = tid; i < kChunk * kRowChunks; i += kThreads) {
    const int r = i / kRowChunks, c = i % kRowChunks;
    const bool ok = r < valid_rows;
    cp_async_16(dst + r * DK * 4 + c * 16, ok ? row0 + r * stride + 4 * c : row0, ok);
  }
}

// Which gate elements a thread owns in the chunk's gate work: the column pair (2 pair, 2 pair + 1)
// of row block `block`, rows [first, first + kRows). A warp's 32 consecutive pairs cover one
// 128-byte row of a swizzled bf16 tile and 256 contiguous bytes of the gate tile: no bank conflicts.
template <int DK, int kThreads>
struct GateLane {
  static constexpr int kPairs = DK / 2;
  static constexpr int kRowBlocks = kThreads / kPairs;
  static constexpr int kRows = kChunk / kRowBlocks;
  static_assert(kThreads % kPairs == 0 && kChunk % kRowBlocks == 0, "whole row blocks");
  static_assert(kRows <= kChunk / 2, "the reference row ends a row block");
  int pair, block, first;
  __device__ __forceinline__ explicit GateLane(int tid)
      : pair(tid % kPairs), block(tid / kPairs), first((tid / kPairs) * kRows) {}
  // Byte offset of the pair in row r of a swizzled [64 x DK] bf16 tile.
  __device__ __forceinline__ uint32_t tile_offset(int r) const {
    return swizzle(r, pair / 4, kChunk) + 4 * (pair % 4);
  }
};

__device__ __forceinline__ float2 add2(float2 x, float2 y) { return make_float2(x.x + y.x, x.y + y.y); }

// The gate row r of a thread's column pair.
template <int DK>
__device__ __forceinline__ float2& gate_pair(float* s_gates, int r, int pair) {
  return reinterpret_cast<float2*>(s_gates + r * DK)[pair];
}

// Zeroes this thread's pairs of the rows [from, to) of a swizzled [64 x DK] bf16 tile (a packed
// chunk's masks, applied after the gate work's loop so that the loop is the one without documents).
template <int DK, int kThreads>
__device__ __forceinline__ void clear_rows(uint8_t* tile, const GateLane<DK, kThreads>& gl, int from, int to) {
#pragma unroll
  for (int i = 0; i < GateLane<DK, kThreads>::kRows; ++i) {
    const int r = gl.first + i;
    if (r >= from && r < to) *reinterpret_cast<uint32_t*>(tile + gl.tile_offset(r)) = 0u;
  }
}

// Column scan, part 1: the sum of this thread's rows (in order) into `totals` ([row block][pair]).
template <int DK, int kThreads>
__device__ __forceinline__ void scan_row_block(float* s_gates, float2* totals, const GateLane<DK, kThreads>& gl) {
  float2 sum = make_float2(0.f, 0.f);
#pragma unroll
  for (int i = 0; i < GateLane<DK, kThreads>::kRows; ++i) sum = add2(sum, gate_pair<DK>(s_gates, gl.first + i, gl.pair));
  totals[gl.block * GateLane<DK, kThreads>::kPairs + gl.pair] = sum;
}

// Column scan, part 2 (once every block's total is written): the cumsums the gate work needs for
// this thread's pair. Every thread adds the block totals in block order, so each value has the
// same bits in every thread that forms it.
struct ColumnScan {
  float2 before;  // b at row first - 1 (0 for first = 0)
  float2 half;    // b at row 31: the reference row c
  float2 head;    // b at row 0
  float2 gamma;   // b at row 63
};

template <int DK, int kThreads>
__device__ __forceinline__ ColumnScan scan_columns(float* s_gates, const float2* totals,
                                                   const GateLane<DK, kThreads>& gl) {
  using G = GateLane<DK, kThreads>;
  ColumnScan cs;
  float2 run = make_float2(0.f, 0.f);
  cs.before = cs.half = run;
#pragma unroll
  for (int k = 0; k < G::kRowBlocks; ++k) {
    if (k == gl.block) cs.before = run;
    if (k * G::kRows == kChunk / 2) cs.half = run;
    run = add2(run, totals[k * G::kPairs + gl.pair]);
  }
  cs.gamma = run;
  cs.head = gate_pair<DK>(s_gates, 0, gl.pair);
  return cs;
}

// ---------------------------------------------------------------------------------------------
// The states loop: a segment's end state from zero M = sum_t diag(e^{Lambda - B_t}) k_t^T v_t and
// its log-decay Lambda = sum_t a_t (per key dimension), walking the segment's chunks from the last
// to the first so that each key's weight to the segment's end, e^{E + gamma - b_t} (E: the
// log-decay of the chunks after it), is known when its chunk arrives (exponent <= 0). The weights
// scale K in shared memory and the update is a plain K~^T V on the tensor cores, never rescaled.
// A document start ends the walk's reach: keys before a chunk's last start weigh 0, and from a
// chunk holding one back E = -inf (so are the earlier chunks' weights, and Lambda).
// One warpgroup per (64 Dv columns, segment, b*H+h).
// ---------------------------------------------------------------------------------------------
constexpr int kStatesThreads = LASP_GLA_STATES_THREADS;
constexpr int kStatesStages = LASP_GLA_STATES_STAGES;

template <int DK>
struct StatesLayout {
  static constexpr uint32_t kK = 0;
  static constexpr uint32_t kV = kChunk * DK * 2;
  static constexpr uint32_t kGates = kV + kChunk * 64 * 2;
  static constexpr uint32_t kStageBytes = kGates + kChunk * DK * 4;
  static constexpr uint32_t kTotals = kStatesStages * kStageBytes;  // float2 [row block][pair]
  static constexpr uint32_t kBytes = kTotals + kStatesThreads * 8;
  static_assert(kV % 1024 == 0 && kGates % 1024 == 0 && kStageBytes % 1024 == 0, "tiles stay 1024-byte aligned");
  static __device__ __forceinline__ uint32_t stage(int i) { return (i % kStatesStages) * kStageBytes; }
};

// What one CTA walks: (b, h)'s rows of the fla layout and its chunks [c_begin, c_begin + n_chunks).
struct Segment {
  int T, H, Dv;
  int b, h;
  int c_begin, n_chunks;
};

// Chunks [c_begin, c_begin + min(limit, what is left)) of (b, h) = grid z (p: GLA's T, H, Dv).
template <class P>
__device__ __forceinline__ Segment segment_of(const P& p, int c_begin, int limit) {
  Segment sg;
  sg.T = p.T;
  sg.H = p.H;
  sg.Dv = p.Dv;
  sg.b = blockIdx.z / p.H;
  sg.h = blockIdx.z % p.H;
  sg.c_begin = c_begin;
  sg.n_chunks = max(0, min(limit, lasp_gla_num_chunks(p.T) - c_begin));
  return sg;
}

// Piece u of the states pass: piece u % R of segment u / R, ceil(chunks_per_segment / R) chunks
// (the segment's last pieces may be short or empty: the identity summary).
template <class P>
__device__ __forceinline__ Segment piece_of(const P& p, int u) {
  const int R = p.states_splits, per_piece = (p.chunks_per_segment + R - 1) / R;
  const int seg_begin = (u / R) * p.chunks_per_segment, in_seg = (u % R) * per_piece;
  return segment_of(p, seg_begin + in_seg, max(0, min(per_piece, p.chunks_per_segment - in_seg)));
}

// Runs the states loop over the tensors of `p` (any params struct with GLA's q, k, v, g and
// starts fields; kPacked: p.starts holds the chunks' start words); end(s, lane, lambda, gate_lane)
// gets M in the state registers and, in each thread, Lambda of the gate lane's column pair.
template <int DK, bool kPacked, class P, class End>
__device__ __forceinline__ void run_states_segment(const P& p, const Segment& sg, int vt, End&& end) {
  using L = StatesLayout<DK>;
  using G = GateLane<DK, kStatesThreads>;
  static_assert(L::kBytes == lasp_gla_states_smem_bytes(DK), "shared-memory map and host formula disagree");
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int64_t row0 = (int64_t)sg.b * sg.T * sg.H + sg.h;  // token 0 of (b, h)
  const int64_t k_stride = (int64_t)sg.H * DK, v_stride = (int64_t)sg.H * sg.Dv;
  const uint16_t* k = p.k + row0 * DK;
  const uint16_t* v = p.v + row0 * sg.Dv + vt * 64;
  const float* gate = p.g + row0 * DK;

  auto issue_step = [&](int j) {  // step j takes chunk n_chunks - 1 - j of the segment
    const uint32_t stage = sbase + L::stage(j);
    const int tok0 = (sg.c_begin + sg.n_chunks - 1 - j) * kChunk;
    const int valid = min(kChunk, sg.T - tok0);
    chunk::copy_tile_async<DK / 8, kStatesThreads>(stage + L::kK, k + tok0 * k_stride, k_stride, valid, tid);
    chunk::copy_tile_async<8, kStatesThreads>(stage + L::kV, v + tok0 * v_stride, v_stride, valid, tid);
    copy_gates_async<DK, kStatesThreads>(stage + L::kGates, gate + tok0 * k_stride, k_stride, valid, tid);
  };

  const StateLane ln{16 * warp, lane >> 2, lane & 3};
  StateRegs<DK> s;
  chunk::state_zero<DK>(s, ln);
  const G gl(tid);
#pragma unroll
  for (int j = 0; j < kStatesStages - 1; ++j) {
    if (j < sg.n_chunks) issue_step(j);
    cp_async_commit();
  }
  float2 after = make_float2(0.f, 0.f);  // E: log-decay of the chunks after this step's, per column
  auto words = ChunkStarts::Ahead<kPacked>::first(p.starts, sg.c_begin + sg.n_chunks - 1, sg.n_chunks > 0);
  for (int j = 0; j < sg.n_chunks; ++j) {
    cp_async_wait<kStatesStages - 2>();
    __syncthreads();  // step j's chunk has landed, for every thread
    const uint32_t stage = L::stage(j);
    float* s_gates = reinterpret_cast<float*>(smem + stage + L::kGates);
    float2* totals = reinterpret_cast<float2*>(smem + L::kTotals);
    const ChunkStarts starts = words.next(p.starts, sg.c_begin + sg.n_chunks - 2 - j, j + 1 < sg.n_chunks);
    const int leaving_from = starts.last();  // keys below it are in a document that ends in the chunk
    scan_row_block(s_gates, totals, gl);
    __syncthreads();  // every row block's total is written
    const ColumnScan cs = scan_columns(s_gates, totals, gl);
    // K~ = K (.) e^{E + gamma - b}, in place, eight rows at a time with their loads first.
    float2 run = cs.before;
    constexpr int kBatch = 8;
    static_assert(G::kRows % kBatch == 0, "whole batches of rows");
#pragma unroll
    for (int i0 = 0; i0 < G::kRows; i0 += kBatch) {
      float2 a[kBatch];
      uint32_t kw[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = gl.first + i0 + i;
        a[i] = gate_pair<DK>(s_gates, r, gl.pair);
        kw[i] = *reinterpret_cast<const uint32_t*>(smem + stage + L::kK + gl.tile_offset(r));
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = gl.first + i0 + i;
        run = add2(run, a[i]);
        const float2 w = make_float2(exp_nonpos(after.x + (cs.gamma.x - run.x)), exp_nonpos(after.y + (cs.gamma.y - run.y)));
        *reinterpret_cast<uint32_t*>(smem + stage + L::kK + gl.tile_offset(r)) = scale_bf16x2(kw[i], w.x, w.y);
      }
    }
    // Packed documents: keys below the chunk's last start weigh 0, cleared after the loop (which
    // stays the loop without documents) and only in a chunk holding a start.
    if (kPacked && starts.any()) clear_rows(smem + stage + L::kK, gl, 0, leaving_from);
    after = starts.any() ? make_float2(-INFINITY, -INFINITY) : add2(after, cs.gamma);
    wg::fence_proxy_async();  // K~ visible to wgmma's async proxy
    wg::wait<0>();            // step j-1's products are done with its stage
    __syncthreads();          // K~ complete; no warp reads step j-1's stage any more: refill it
    if (j + kStatesStages - 1 < sg.n_chunks) issue_step(j + kStatesStages - 1);
    cp_async_commit();
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int mt = 0; mt < DK / 64; ++mt)
        wg::mma_ss<wg::Major::kMN, wg::Major::kMN>(s[mt], wg::desc_sw128(sbase + stage + L::kK + mt * kBlockBytes + kk * kRow16),
                                                   wg::desc_sw128(sbase + stage + L::kV + kk * kRow16), true);
    wg::commit();
  }
  wg::wait<0>();
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
  end(s, ln, after, gl);
}

// ---------------------------------------------------------------------------------------------
// The output loop: one CTA per (segment, b*H+h) with one warpgroup per 64 columns of Dv, each
// holding its fp32 state tile [Dk x 64] in registers. Per chunk:
//   gate work (all threads)    column cumsums; Q~ = Q (.) e^{b - c} and K^ = K (.) e^{c - b} for the
//                              scores, K- = K (.) e^{gamma - b} for the update; e^{c}, e^{gamma}
//   warpgroup (its 64 columns)
//     group 1                  a = Q~ K^^T                        (wgmma, shared memory)
//                              S_bf = bf16(diag(e^{c}) S_n) meanwhile; S <- diag(e^{gamma}) S
//     group 2                  o = Q~ S_bf                        (wgmma, shared memory)
//     group 3                  S += K-^T V                        (wgmma, shared memory)
//     wait for groups 1, 2     (steep chunk: a term by term); P = sigma [r >= j] a, o *= sigma
//                              (packed documents: the masks of the file's head)
//     group 4                  o += P V                           (P from registers)
// cp.async brings chunk i+1 while chunk i computes (LASP_GLA_STAGES = 2: the gates take as many
// bytes as Q, K and V together). Four CTA barriers per chunk (landed, row-block totals written,
// gate scan done and whether the chunk is steep, tiles written) and one per warpgroup (its state
// copy written).
// ---------------------------------------------------------------------------------------------
constexpr int kStages = LASP_GLA_STAGES;

template <int DK, int DV>
struct OutputLayout {
  static constexpr int kGroups = DV / 64;
  static constexpr int kThreads = 128 * kGroups;
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kChunk * DK * 2;
  static constexpr uint32_t kV = 2 * kK;
  static constexpr uint32_t kGates = kV + kChunk * DV * 2;
  static constexpr uint32_t kStageBytes = kGates + kChunk * DK * 4;
  static constexpr uint32_t kKhat = kStages * kStageBytes;
  static constexpr uint32_t kSbf = kKhat + kChunk * DK * 2;  // per warpgroup: DK * 64 * 2 bytes
  static constexpr uint32_t kSbfBytes = DK * 64 * 2;
  static constexpr uint32_t kRefScale = kSbf + kGroups * kSbfBytes;  // fp32 [DK]: e^{c}
  static constexpr uint32_t kDecay = kRefScale + DK * 4;               // fp32 [DK]: e^{gamma}
  static constexpr uint32_t kWords = kDecay + DK * 4;                  // u64 [stage]: start words
  static constexpr uint32_t kTotals = kDecay + 2 * DK * 4;             // float2 [row block][pair]
  static constexpr uint32_t kBytes = kTotals + kThreads * 8;
  static_assert(kWords + kStages * 8 <= kTotals, "the start words fit beside e^{gamma}");
  static_assert(kStageBytes % 1024 == 0 && kKhat % 1024 == 0 && kSbfBytes % 1024 == 0, "tiles stay 1024-byte aligned");
  static __device__ __forceinline__ uint32_t stage(int i) { return (i % kStages) * kStageBytes; }
};

// The steep chunk's scores, term by term in fp32: a[r][j] = sum_d q_rd k_jd e^{b_rd - b_jd} for
// this lane's entries (r = 16 warp + 8 hh + g, j = 8 nt + 2 t + e) with j <= r, zero above the
// diagonal. Q and K come again from global memory (their tiles hold the decayed copies), the
// cumsums b from the gate tile (where the gate work left them).
template <int DK>
__device__ __forceinline__ void exact_scores(float (&a)[8][4], const uint16_t* q, const uint16_t* k, int64_t stride,
                                             const float* s_b, int tok0, int T, int warp, int g, int t) {
  auto bf = [](uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); };
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) a[nt][e] = 0.f;
  for (int d = 0; d < DK; ++d) {
    float qv[2], br[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
      qv[hh] = tok0 + r < T ? bf(q[(int64_t)(tok0 + r) * stride + d]) : 0.f;
      br[hh] = s_b[r * DK + d];
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 8 * nt + 2 * t + e;
        const float kv = tok0 + j < T ? bf(k[(int64_t)(tok0 + j) * stride + d]) : 0.f;
        const float bj = s_b[j * DK + d];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 16 * warp + 8 * hh + g;
          if (j <= r) a[nt][2 * hh + e] = fmaf(qv[hh] * kv, exp_nonpos(br[hh] - bj), a[nt][2 * hh + e]);
        }
      }
  }
}

// Runs one CTA's segment of the output loop over the tensors of `p` (GLA's q, k, v, g, o, scale,
// starts; kPacked: p.starts holds the chunks' start words).
//   start(s, lane, group) -> bool: the fp32 start state of the group's 64 columns (every thread
//                   calls it; it may hold barriers). False on every thread: the CTA stops there.
//   end(s, lane, group): the epilogue, given the segment's end state.
// Unless `chunk_states` is NULL, the bf16 copy of the state entering chunk c of (b, h) that the
// chunk's products read, diag(e^{ref}) S_c, goes to chunk_states + c * DK * DV (row-major
// [DK, DV]), for the backward, which forms the same reference row from the same gates.
// kEntries (packed documents' final states; with kPacked): the fp32 state entering chunk c also
// goes to document n's slot of p.document_states where n = p.entry_slots[c] >= 0 (n began before
// the chunk and ends in it; gla/document_states.cu adds its tokens there). Instances of their own,
// so that the packed loop without final states stays as it was (with the store in it, its LASP-2
// forward took 3 % longer).
template <int DK, int DV, bool kPacked, bool kEntries = false, class P, class Start, class End>
__device__ __forceinline__ void run_output_segment(const P& p, const Segment& sg, uint16_t* chunk_states,
                                                   Start&& start, End&& end) {
  using L = OutputLayout<DK, DV>;
  using G = GateLane<DK, L::kThreads>;
  constexpr int kThreads = L::kThreads;
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");
  static_assert(L::kBytes == lasp_gla_output_smem_bytes(DK, DV), "shared-memory map and host formula disagree");
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31, group = tid >> 7;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row0 = (int64_t)sg.b * sg.T * sg.H + sg.h;
  const int64_t qk_stride = (int64_t)sg.H * DK, v_stride = (int64_t)sg.H * DV;
  const uint16_t* q = p.q + row0 * DK;
  const uint16_t* k = p.k + row0 * DK;
  const uint16_t* v = p.v + row0 * DV;
  const float* gate = p.g + row0 * DK;
  float* ref_scale = reinterpret_cast<float*>(smem + L::kRefScale);
  float* decay = reinterpret_cast<float*>(smem + L::kDecay);

  auto issue_chunk = [&](int i) {
    const uint32_t stage = sbase + L::stage(i);
    const int tok0 = (sg.c_begin + i) * kChunk;
    const int valid = min(kChunk, sg.T - tok0);
    chunk::copy_tile_async<DK / 8, kThreads>(stage + L::kQ, q + tok0 * qk_stride, qk_stride, valid, tid);
    chunk::copy_tile_async<DK / 8, kThreads>(stage + L::kK, k + tok0 * qk_stride, qk_stride, valid, tid);
    chunk::copy_tile_async<DV / 8, kThreads>(stage + L::kV, v + tok0 * v_stride, v_stride, valid, tid);
    copy_gates_async<DK, kThreads>(stage + L::kGates, gate + tok0 * qk_stride, qk_stride, valid, tid);
    if (tid == 0) ChunkStarts::copy_async<kPacked>(sbase + L::kWords + (i % kStages) * 8, p.starts, sg.c_begin + i);
  };

  const StateLane ln{16 * warp, g, t};
  StateRegs<DK> s;
  if (!start(s, ln, group)) return;
  // kEntries: the fp32 state entering chunk c into the slot of the document that began before it
  // and ends in it, if any (a uniform load and branch). Called where the chunk's fragments are
  // dead. The slot's address
  // comes from the grid index read by a volatile move inside the branch, so that no
  // loop-invariant part of it can be hoisted and held across the loop: with blockIdx.z instead,
  // the LASP-2 output kernel at Dk = Dv = 128 spilled 8 bytes.
  const auto store_document_entry = [&](int c) {
    static_assert(kPacked || !kEntries, "the entering states are packed documents'");
    if constexpr (kEntries) {
      const int n = p.entry_slots[c];
      if (n >= 0) {
        uint32_t z;  // b*H+h
        asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
        // 32-bit: a 64-bit remainder is a called subroutine, and any call in the kernel makes
        // ptxas serialise every wgmma of it (C7509).
        const int h = static_cast<int>(z) % p.H, b = static_cast<int>(z) / p.H;
        chunk::state_store<DK>(
            s, ln, p.document_states + (((int64_t)b * p.documents + n) * p.H + h) * DK * DV + group * 64, DV);
      }
    }
  };
  store_document_entry(sg.c_begin);
  float one;  // 1.0f through an opaque move (redefine)
  asm volatile("mov.b32 %0, 0x3f800000;" : "=f"(one));
  const G gl(tid);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < sg.n_chunks) issue_chunk(i);
    cp_async_commit();
  }

  for (int i = 0; i < sg.n_chunks; ++i) {
    cp_async_wait<kStages - 2>();
    // Chunk i has landed for every thread; every warp is done with chunk i-1 (its stage, K^, the
    // bf16 states and the vectors may be rewritten).
    __syncthreads();
    if (i + kStages - 1 < sg.n_chunks) issue_chunk(i + kStages - 1);
    cp_async_commit();
    const uint32_t stage = L::stage(i);
    float* s_gates = reinterpret_cast<float*>(smem + stage + L::kGates);
    const int tok0 = (sg.c_begin + i) * kChunk;
    // Packed documents: the chunk's start word, landed with its tiles; read from shared memory
    // where it is used (so that it is held in no register across the chunk).
    const uint8_t* word = smem + L::kWords + (i % kStages) * 8;

    // Gate work, part 1: the scan, the reference row, the vectors.
    float2* totals = reinterpret_cast<float2*>(smem + L::kTotals);
    scan_row_block(s_gates, totals, gl);
    __syncthreads();  // every row block's total is written
    const ColumnScan cs = scan_columns(s_gates, totals, gl);
    const bool flat_x = cs.head.x - cs.half.x <= kSpanLimit && cs.half.x - cs.gamma.x <= kSpanLimit;
    const bool flat_y = cs.head.y - cs.half.y <= kSpanLimit && cs.half.y - cs.gamma.y <= kSpanLimit;
    const bool flat = flat_x && flat_y;
    // Keys below the chunk's last start f(63) are in a document that ends in the chunk.
    const int leaving_from = ChunkStarts::landed<kPacked>(word).last();
    // A steep column takes the chunk start as its reference: its Q~ and S_bf stay exact, and its
    // K^ (clamped, finite) is not used, since the chunk's scores are then computed term by term.
    const float2 ref = make_float2(flat_x ? cs.half.x : 0.f, flat_y ? cs.half.y : 0.f);
    if (gl.first == 0) {
      reinterpret_cast<float2*>(ref_scale)[gl.pair] = make_float2(exp_nonpos(ref.x), exp_nonpos(ref.y));
      reinterpret_cast<float2*>(decay)[gl.pair] = kPacked && leaving_from >= 0
                                                      ? make_float2(0.f, 0.f)
                                                      : make_float2(exp_nonpos(cs.gamma.x), exp_nonpos(cs.gamma.y));
    }
    // Every thread has read the totals and row 0 (so the gates may become cumsums), and the
    // vectors are written.
    const bool steep = __syncthreads_or(!flat);

    // Gate work, part 2: the decayed tiles and the cumsums, in place (K^ in its own tile). In a
    // flat column e^{c - b} <= e^{kSpanLimit}, so K- = K (.) e^{c - b} e^{gamma - c} costs a
    // product instead of an exponential.
    const float2 to_end = make_float2(exp_nonpos(cs.gamma.x - ref.x), exp_nonpos(cs.gamma.y - ref.y));
    float2 run = cs.before;
    // Eight rows at a time, their loads first: the in-place stores would otherwise keep the compiler
    // from moving the next row's loads above them.
    constexpr int kBatch = 8;
    static_assert(G::kRows % kBatch == 0, "whole batches of rows");
#pragma unroll
    for (int j0 = 0; j0 < G::kRows; j0 += kBatch) {
      float2 a[kBatch];
      uint32_t qw[kBatch], kw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int r = gl.first + j0 + j;
        const uint32_t off = gl.tile_offset(r);
        a[j] = gate_pair<DK>(s_gates, r, gl.pair);
        qw[j] = *reinterpret_cast<const uint32_t*>(smem + stage + L::kQ + off);
        kw[j] = *reinterpret_cast<const uint32_t*>(smem + stage + L::kK + off);
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int r = gl.first + j0 + j;
        const uint32_t off = gl.tile_offset(r);
        run = add2(run, a[j]);
        gate_pair<DK>(s_gates, r, gl.pair) = run;
        float2 khat, kbar;
        if (flat) {
          khat = make_float2(exp_any(ref.x - run.x), exp_any(ref.y - run.y));
          kbar = make_float2(khat.x * to_end.x, khat.y * to_end.y);
        } else {
          khat = make_float2(exp_any(fminf(ref.x - run.x, kSpanLimit)), exp_any(fminf(ref.y - run.y, kSpanLimit)));
          kbar = make_float2(exp_nonpos(cs.gamma.x - run.x), exp_nonpos(cs.gamma.y - run.y));
        }
        *reinterpret_cast<uint32_t*>(smem + stage + L::kQ + off) =
            scale_bf16x2(qw[j], exp_any(run.x - ref.x), exp_any(run.y - ref.y));
        *reinterpret_cast<uint32_t*>(smem + L::kKhat + off) = scale_bf16x2(kw[j], khat.x, khat.y);
        *reinterpret_cast<uint32_t*>(smem + stage + L::kK + off) = scale_bf16x2(kw[j], kbar.x, kbar.y);
      }
    }
    // Packed documents: K- keeps no key below the chunk's last start (cleared after the loop, which
    // stays the loop without documents, and only in a chunk holding a start).
    if (kPacked && leaving_from > 0) clear_rows(smem + stage + L::kK, gl, 0, leaving_from);
    wg::fence_proxy_async();
    __syncthreads();  // the tiles of chunk i are complete

    const uint32_t sQ = sbase + stage + L::kQ, sK = sbase + stage + L::kK, sKh = sbase + L::kKhat;
    const uint32_t sV = sbase + stage + L::kV + group * kBlockBytes;
    const uint32_t s_bf = L::kSbf + group * L::kSbfBytes;
    float o[8][4], acc[8][4];
    // Group 1: a = Q~ K^^T, which needs no state; the bf16 state copy is written meanwhile.
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
      wg::mma_ss<wg::Major::kK>(acc, wg::desc_sw128(sQ + k_step), wg::desc_sw128(sKh + k_step), ks > 0);
    }
    wg::commit();
    // This warpgroup's bf16 state copy, scaled by e^{c} per row, then S <- diag(e^{gamma}) S.
    for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
      const float w = ref_scale[d];
      *reinterpret_cast<uint32_t*>(smem + s_bf + swizzle(d, c / 8, DK) + 4 * ln.t) = pack_bf16x2(x0 * w, x1 * w);
    });
    wg::fence_proxy_async();
    named_barrier_sync(1 + group, 128);  // the warpgroup's state copy is complete
    if (chunk_states) {
      // The copy as it is, for the backward, in whole 16-byte pieces of its rows.
      uint16_t* entering = chunk_states + (int64_t)(sg.c_begin + i) * DK * DV + group * 64;
      for (int piece = tid % 128; piece < DK * 8; piece += 128) {
        const int d = piece / 8, c16 = piece % 8;
        *reinterpret_cast<uint4*>(entering + d * DV + 8 * c16) =
            *reinterpret_cast<const uint4*>(smem + s_bf + swizzle(d, c16, DK));
      }
    }
    for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int) {
      const float w = decay[d];
      x0 *= w, x1 *= w;
    });
    // Group 2: o = Q~ S_bf. Group 3: S += K-^T V.
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      const uint32_t k_step = kBlockBytes * (ks >> 2) + 32 * (ks & 3);
      wg::mma_ss<wg::Major::kMN>(o, wg::desc_sw128(sQ + k_step), wg::desc_sw128(sbase + s_bf + ks * kRow16), ks > 0);
    }
    wg::commit();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int mt = 0; mt < DK / 64; ++mt)
        wg::mma_ss<wg::Major::kMN, wg::Major::kMN>(s[mt], wg::desc_sw128(sK + mt * kBlockBytes + kk * kRow16),
                                                   wg::desc_sw128(sV + kk * kRow16), true);
    wg::commit();
    wg::wait<1>();
    wg::fence_operands(o);
    wg::fence_operands(acc);
    if (steep) exact_scores<DK>(acc, q, k, qk_stride, s_gates, tok0, sg.T, warp, g, t);
    // P = sigma [r >= j] a, o *= sigma. Packed documents, in a chunk holding a start: row r keeps
    // the keys of its document, j >= f(r), and the entering state reaches it only where its
    // document entered the chunk (f(r) = -1).
    uint32_t pa[4][4];
    const auto pack_scores = [&](const int (&doc_start)[2]) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 16 * warp + 8 * hh + g, j = 8 * nt + 2 * t;
          const float x0 = j <= r && j >= doc_start[hh] ? p.scale * acc[nt][2 * hh] : 0.f;
          const float x1 = j + 1 <= r && j + 1 >= doc_start[hh] ? p.scale * acc[nt][2 * hh + 1] : 0.f;
          pa[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(x0, x1);
          const float inter = doc_start[hh] >= 0 ? 0.f : p.scale;
          o[nt][2 * hh] *= inter;
          o[nt][2 * hh + 1] *= inter;
        }
    };
    if (kPacked && leaving_from >= 0) {
      const ChunkStarts starts = ChunkStarts::landed<kPacked>(word);
      pack_scores({starts.start_at_or_before(16 * warp + g), starts.start_at_or_before(16 * warp + 8 + g)});
    } else {
      pack_scores({-1, -1});
    }
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wg::mma_rs<wg::Major::kMN>(o, pa[kk], wg::desc_sw128(sV + kk * kRow16));
    wg::commit();
    wg::wait<0>();
    wg::fence_operands(o);
    // The state registers pass through a move, so that ptxas no longer counts them as written by
    // a tensor-core product: it would otherwise wait for the next chunk's first group before the
    // bf16 state copy reads them, which is meant to run beside that group.
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt) redefine(s[mt], one);

    uint16_t* o_rows = p.o + row0 * DV + group * 64 + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int tok = tok0 + 16 * warp + 8 * hh + g;
      if (tok < sg.T) {
        uint16_t* dst = o_rows + tok * v_stride;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack_bf16x2(o[nt][2 * hh], o[nt][2 * hh + 1]);
      }
    }
    if (i + 1 < sg.n_chunks) store_document_entry(sg.c_begin + i + 1);
  }
  end(s, ln, group);
}

}  // namespace gla
}  // namespace lasp
