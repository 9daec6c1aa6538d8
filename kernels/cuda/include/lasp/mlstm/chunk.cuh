// Device building blocks of the mLSTM forward (mlstm/forward.cu): the gates of a chunk in the
// scalar-decay loop's form, the normaliser, and the segment loop (the fold of
// stabilised states: lasp/mlstm/fold.cuh).
//
// The chunk (kernels/docs/mlstm.md, "The chunk"): with b_r the chunk-local inclusive cumsum of the
// log forget gates, a_j = i_j - b_j and the running maximum M_r = max(m, max_{j<=r} a_j) over the
// state's stabiliser m and the chunk's tokens, the stabiliser of row r is m_r = b_r + M_r, and with
// the shift c = m (c = a_0 from the empty state, m = -inf)
//   row_r = c - M_r,   col_j = c - a_j,   gamma = row_63,   m' = b_63 + M_63
// make the scalar-decay chunk step (lasp/scalar_decay/chunk.cuh: weights e^{row_r - col_j} in the
// scores, e^{row_r} on the carried state, e^{gamma} and e^{gamma - col_j} in the update) the
// stabilised mLSTM step, term for term, every exponent <= 0. The normaliser is the same step with a
// column of ones for v, kept to fp32 or 16 significant bits: n carried in fp32 registers, its row
// term q_r . n on the tensor cores from n split into bf16 hi + lo, its score term the row sums of
// the weighted scores before their rounding.
#pragma once
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "lasp/documents/chunk_starts.cuh"
#include "lasp/mlstm/fold.cuh"
#include "lasp/mlstm/forward_params.h"
#include "lasp/scalar_decay/chunk.cuh"

namespace lasp {
namespace mlstm {

constexpr int kChunk = LASP_MLSTM_CHUNK;
constexpr int kTileV = LASP_MLSTM_TILE_V;
constexpr int kStages = LASP_MLSTM_STAGES;
static_assert(kChunk == sd::kChunk && kTileV == sd::kTileV, "the scalar-decay chunk step's fragment bookkeeping");
static_assert(kStages >= 2, "the pipeline needs at least two stages");

using chunk::exp_nonpos;
using chunk::StateLane;
using chunk::StateRegs;
using sd::ChunkGates;
using sd::FragOffsets;

// One chunk's gates for this lane: the scalar-decay step's ChunkGates (in a chunk that holds a
// document start, kMasked, its DocumentChunkGates: the masks at the starts), each fragment row's
// stabiliser, the pair values the normaliser's update shuffles, and what the chunk hands on.
template <bool kMasked>
struct ChunkStep {
  using Gates = typename std::conditional<kMasked, sd::DocumentChunkGates, ChunkGates>::type;
  Gates cg;
  float m_row[2];      // m_r of this lane's fragment rows r = 16 warp + 8 hh + g
  float key_weight[2]; // e^{gamma - col_j} of tokens j = 2 lane, 2 lane + 1 (0 before the last start)
  float m_next;        // the stabiliser of the state leaving the chunk
  float log_forget;    // b_63: the chunk's summed log forget gate (-inf where a document starts in it)
};

// A lane's tokens j = 2 lane, 2 lane + 1 in the chunk step's terms (the file's head): row_j,
// col_j, the stabiliser m_j = b_j + M_j, and b of the odd token.
struct PairGates {
  float row_even, row_odd, col_even, col_odd, m_even, m_odd, b_odd;
};

// The lane's forget and input gates as log forget gates and input gates (tokens >= valid are not
// tokens: no decay, no contribution).
struct PairInputs {
  float lf0, lf1, in0, in1;
  bool ok0, ok1;
};
__device__ __forceinline__ PairInputs pair_inputs(const float* s_f, const float* s_i, int valid, int lane) {
  const float2 f = reinterpret_cast<const float2*>(s_f)[lane];
  const float2 in = reinterpret_cast<const float2*>(s_i)[lane];
  const bool ok0 = 2 * lane < valid, ok1 = 2 * lane + 1 < valid;
  return {ok0 ? log_sigmoid(f.x) : 0.f, ok1 ? log_sigmoid(f.y) : 0.f, in.x, in.y, ok0, ok1};
}

// The chunk without documents, entered with stabiliser m_prev (-inf: the empty state).
__device__ __forceinline__ PairGates pair_gates(const float* s_f, const float* s_i, int valid, float m_prev,
                                                int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const PairInputs x = pair_inputs(s_f, s_i, valid, lane);
  const sd::GatePair b = sd::scan_gate_pairs(make_float2(x.lf0, x.lf1), lane);
  const float a0 = x.ok0 ? x.in0 - b.even : -INFINITY;
  const float a1 = x.ok1 ? x.in1 - b.odd : -INFINITY;
  // Running maximum of a over the chunk (a warp scan over pairs).
  float run = fmaxf(a0, a1);
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float y = __shfl_up_sync(kAll, run, off);
    if (lane >= off) run = fmaxf(run, y);
  }
  float before = __shfl_up_sync(kAll, run, 1);
  if (lane == 0) before = -INFINITY;
  const float max_even = fmaxf(m_prev, fmaxf(before, a0));  // M_{2 lane}
  const float max_odd = fmaxf(m_prev, run);                 // M_{2 lane + 1}
  const float shift = m_prev > -INFINITY ? m_prev : __shfl_sync(kAll, a0, 0);
  return {shift - max_even, shift - max_odd, shift - a0, shift - a1, b.even + max_even, b.odd + max_odd, b.odd};
}

// A warp's inclusive segmented scan over its lanes' pairs: `v` combined with the lanes before it
// by `op` back to the nearest lane whose pair holds a start (`starts`: that lane's value only).
template <class Op>
__device__ __forceinline__ float segmented_scan(float v, bool starts, int lane, Op op) {
  constexpr unsigned kAll = 0xffffffffu;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float y = __shfl_up_sync(kAll, v, off);
    const bool y_starts = __shfl_up_sync(kAll, starts, off);
    if (lane >= off) {
      if (!starts) v = op(y, v);
      starts = starts || y_starts;
    }
  }
  return v;
}

// A chunk holding document starts (kernels/docs/packed.md, "mLSTM"): the cumsum b and the running
// maximum M restart at every start (`word`, not 0: bit j set where token j starts a document), each
// segment enters with its own stabiliser (m_prev before the first start, doc_entry from a start)
// and takes its own shift, so that every kept exponent is <= 0 and no difference spans two
// documents' stabilisers; the masks themselves act in the products (DocumentChunkGates).
__device__ __forceinline__ PairGates document_pair_gates(const float* s_f, const float* s_i, int valid, float m_prev,
                                                         float doc_entry, uint64_t word, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const PairInputs x = pair_inputs(s_f, s_i, valid, lane);
  const bool s0 = (word >> (2 * lane)) & 1, s1 = (word >> (2 * lane + 1)) & 1;
  const auto sum = [](float l, float r) { return l + r; };
  const auto max = [](float l, float r) { return fmaxf(l, r); };
  // b: the segmented cumsum of the log forget gates.
  const float b_pair = segmented_scan(s1 ? x.lf1 : x.lf0 + x.lf1, s0 || s1, lane, sum);
  float b_before = __shfl_up_sync(kAll, b_pair, 1);
  if (lane == 0) b_before = 0.f;
  const float b_even = s0 ? x.lf0 : b_before + x.lf0;
  const float b_odd = s1 ? x.lf1 : b_even + x.lf1;
  const float a0 = x.ok0 ? x.in0 - b_even : -INFINITY;
  const float a1 = x.ok1 ? x.in1 - b_odd : -INFINITY;
  // The segmented running maximum of a, then the segment's entering stabiliser.
  const float a_pair = segmented_scan(s1 ? a1 : fmaxf(a0, a1), s0 || s1, lane, max);
  float a_before = __shfl_up_sync(kAll, a_pair, 1);
  if (lane == 0) a_before = -INFINITY;
  const float run_even = s0 ? a0 : fmaxf(a_before, a0);
  const float run_odd = s1 ? a1 : fmaxf(run_even, a1);
  // f(j), the start of token j's document in the chunk (-1: the document entered it).
  const uint64_t through_even = word & (~0ull >> (63 - 2 * lane));
  const int f_even = through_even ? 63 - __clzll(static_cast<long long>(through_even)) : -1;
  const int f_odd = s1 ? 2 * lane + 1 : f_even;
  // A segment's shift: its entering stabiliser, or from the empty state its first token's a.
  const int src = f_even >= 0 ? f_even >> 1 : 0;
  const float start_a0 = __shfl_sync(kAll, a0, src), start_a1 = __shfl_sync(kAll, a1, src);
  const float a_start_even = f_even >= 0 && (f_even & 1) ? start_a1 : start_a0;
  const float a_start_odd = s1 ? a1 : a_start_even;
  const float enter_even = f_even >= 0 ? doc_entry : m_prev, enter_odd = f_odd >= 0 ? doc_entry : m_prev;
  const float shift_even = enter_even > -INFINITY ? enter_even : a_start_even;
  const float shift_odd = enter_odd > -INFINITY ? enter_odd : a_start_odd;
  const float max_even = fmaxf(enter_even, run_even), max_odd = fmaxf(enter_odd, run_odd);
  // The chunk's log forget sum is -inf: a start forgets the state entering the chunk.
  return {shift_even - max_even, shift_odd - max_odd, shift_even - a0,        shift_odd - a1,
          b_even + max_even,     b_odd + max_odd,     -INFINITY};
}

// DocumentChunkGates::starts of the chunk's start word (0 without a start) for the lane whose first
// fragment row is r0 (its second is r0 + 8).
__device__ __forceinline__ uint32_t start_bytes(uint64_t word, int r0) {
  uint32_t bytes = (64u - __clzll(static_cast<long long>(word))) << 16;  // the last start + 1
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const uint64_t through_r = word & (~0ull >> (63 - (r0 + 8 * hh)));
    bytes |= (through_r ? 64u - __clzll(static_cast<long long>(through_r)) : 0u) << (8 * hh);  // f(r) + 1
  }
  return bytes;
}

// The gates of a chunk from its forget- and input-gate pre-activations in shared memory (64 each;
// tokens >= valid are not tokens: no decay, no contribution), entered with stabiliser m_prev
// (-inf: the empty state). kMasked: `word` holds the chunk's document starts (not 0) and a
// document enters from doc_entry (document_pair_gates). Every warp computes the same values with
// the same instructions, so every thread of the CTA holds the same bits without a barrier. warp:
// within the warpgroup.
template <bool kMasked>
__device__ __forceinline__ ChunkStep<kMasked> chunk_step(const float* s_f, const float* s_i, int valid, float m_prev,
                                                         float doc_entry, uint64_t word, int warp, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const PairGates pg = kMasked ? document_pair_gates(s_f, s_i, valid, m_prev, doc_entry, word, lane)
                               : pair_gates(s_f, s_i, valid, m_prev, lane);
  ChunkStep<kMasked> st;
  const int g = lane >> 2, t = lane & 3;
  if constexpr (kMasked) st.cg.starts = start_bytes(word, 16 * warp + g);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * warp + 8 * hh + g;
    const float re = __shfl_sync(kAll, pg.row_even, r >> 1), ro = __shfl_sync(kAll, pg.row_odd, r >> 1);
    const float me = __shfl_sync(kAll, pg.m_even, r >> 1), mo = __shfl_sync(kAll, pg.m_odd, r >> 1);
    st.cg.row[hh] = (r & 1) ? ro : re;
    st.m_row[hh] = (r & 1) ? mo : me;
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    st.cg.col[nt][0] = __shfl_sync(kAll, pg.col_even, 4 * nt + t);
    st.cg.col[nt][1] = __shfl_sync(kAll, pg.col_odd, 4 * nt + t);
  }
  st.cg.gamma = __shfl_sync(kAll, pg.row_odd, 31);
  const int key_first = sd::last_start(st.cg);
  st.key_weight[0] = exp_nonpos(2 * lane >= key_first ? st.cg.gamma - pg.col_even : -INFINITY);
  st.key_weight[1] = exp_nonpos(2 * lane + 1 >= key_first ? st.cg.gamma - pg.col_odd : -INFINITY);
  st.m_next = __shfl_sync(kAll, pg.m_odd, 31);
  st.log_forget = __shfl_sync(kAll, pg.b_odd, 31);
  return st;
}

// 1 / x to about an ulp (rcp.approx; 1 / inf = 0). Not the division operator: its IEEE slow path
// is a called subroutine, and any call in the output kernel makes ptxas serialise every wgmma of
// it (C7509).
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The bf16 at a shared-memory byte address, as fp32.
__device__ __forceinline__ float bf16_at(const uint8_t* at) {
  return __uint_as_float(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(at)) << 16);
}

// The normaliser n is carried in kParts partial vectors, one per range of the chunk's tokens, each
// in the registers of the threads part * DK + d (one per key dimension d): n = sum of the parts.
// Every part decays by the same e^{gamma}, so the sum stays n; the parts halve the dependent chain
// of each thread's update and spread it over both warpgroups.
template <int DK, int kThreads>
constexpr int normaliser_parts() {
  return kThreads >= 2 * DK ? 2 : 1;
}

// n_p' = e^{gamma} n_p + sum_{j in part p} e^{gamma - col_j} k_jd for key dimension d, K the chunk's
// swizzled [64 x DK] tile at `sK` (generic address), the weights as chunk_step left them per lane.
// Four accumulators: the chain is a quarter of the part's tokens long.
template <int DK, int kParts, bool kMasked>
__device__ __forceinline__ float normaliser_update(float n, const uint8_t* sK, int d, int part,
                                                   const ChunkStep<kMasked>& st) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kPairs = kChunk / 2 / kParts;  // token pairs of a part
  const uint8_t* column = sK + (d & 7) * 2;    // element d of a row, within its 16-byte chunk
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int p = part * kPairs + i;
    const float w0 = __shfl_sync(kAll, st.key_weight[0], p), w1 = __shfl_sync(kAll, st.key_weight[1], p);
    acc[(2 * i) & 3] = fmaf(w0, bf16_at(column + swizzle(2 * p, d >> 3, kChunk)), acc[(2 * i) & 3]);
    acc[(2 * i + 1) & 3] = fmaf(w1, bf16_at(column + swizzle(2 * p + 1, d >> 3, kChunk)), acc[(2 * i + 1) & 3]);
  }
  const float carry = exp_nonpos(sd::last_start(st.cg) < 0 ? st.cg.gamma : -INFINITY);
  return fmaf(carry, n, (acc[0] + acc[1]) + (acc[2] + acc[3]));
}

// sigma-free q_r . n for this lane's fragment rows r = 16 warp + 8 hh + g of the chunk's Q tile at
// `sQ` (shared address), n the sum of the kParts partial vectors at s_n (DK floats apart), on the
// tensor cores: per k-step one m16n8k16 of the warp's Q rows (the A fragments the scalar-decay
// step loads) by a B whose column 0 is bf16(n) and column 1 the residue n - bf16(n), so q . n
// comes out exact to 16 significant bits in fp32 (lanes t = 0 hold columns 0 and 1; the others
// take their rows' sums from them).
template <int DK, int kParts>
__device__ __forceinline__ void query_dot_normaliser(float (&qn)[2], uint32_t sQ, const float* s_n,
                                                     const FragOffsets<DK>& off, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const int g = lane >> 2, t = lane & 3;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    uint32_t qa[4];
    sd::row_fragment<DK>(qa, sQ, off, ks);
    // B rows k = 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of this k-step, column g.
    float2 lo_k = *reinterpret_cast<const float2*>(s_n + 16 * ks + 2 * t);
    float2 hi_k = *reinterpret_cast<const float2*>(s_n + 16 * ks + 2 * t + 8);
    if constexpr (kParts == 2) {
      const float2 u = *reinterpret_cast<const float2*>(s_n + DK + 16 * ks + 2 * t);
      const float2 w = *reinterpret_cast<const float2*>(s_n + DK + 16 * ks + 2 * t + 8);
      lo_k = make_float2(lo_k.x + u.x, lo_k.y + u.y);
      hi_k = make_float2(hi_k.x + w.x, hi_k.y + w.y);
    }
    const uint32_t b0_hi = pack_bf16x2(lo_k.x, lo_k.y), b1_hi = pack_bf16x2(hi_k.x, hi_k.y);
    const uint32_t b0_lo = pack_bf16x2(lo_k.x - __uint_as_float(b0_hi << 16),
                                       lo_k.y - __uint_as_float(b0_hi & 0xffff0000u));
    const uint32_t b1_lo = pack_bf16x2(hi_k.x - __uint_as_float(b1_hi << 16),
                                       hi_k.y - __uint_as_float(b1_hi & 0xffff0000u));
    const uint32_t b0 = g == 0 ? b0_hi : g == 1 ? b0_lo : 0u;
    const uint32_t b1 = g == 0 ? b1_hi : g == 1 ? b1_lo : 0u;
    mma_bf16(c, qa, b0, b1);
  }
  // c = (row g: columns 2t, 2t + 1; row g + 8: the same); at t = 0 the two columns are hi and lo.
  qn[0] = __shfl_sync(kAll, c[0] + c[1], lane & ~3);
  qn[1] = __shfl_sync(kAll, c[2] + c[3], lane & ~3);
}

// The row sums of the weighted scores sigma (Q K^T ⊙ D) in fp32, before their rounding to bf16 for
// the products: this lane's share of its two fragment rows (sum_rows adds the four lanes of a row).
// The denominator cancels (the scores' signs are q . k's) where the numerator need not, so its sum
// must not carry the bf16 rounding the numerator's product takes (TFLA sums in fp32 likewise).
struct ScoreRowSums {
  float* sums;  // [2], zeroed by the caller
  __device__ __forceinline__ void operator()(int hh, float x) const { sums[hh] += x; }
};

__device__ __forceinline__ void sum_rows(float (&sums)[2]) {
  constexpr unsigned kAll = 0xffffffffu;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    sums[hh] += __shfl_xor_sync(kAll, sums[hh], 1);
    sums[hh] += __shfl_xor_sync(kAll, sums[hh], 2);
  }
}

// What the mLSTM output step adds to the scalar-decay chunk step (lasp::sd::NoChunkExtras lists
// the members): the state's lo copy and the scores' row sums.
struct OutputExtras {
  static constexpr bool kStateLo = true;
  uint32_t state_lo;
  ScoreRowSums row_sink;
};

// The backward's gradient passes keep the lo copy (their carried term is as exact as the
// forward's) and divide by no normaliser, so they need no row sums.
struct GradientExtras {
  static constexpr bool kStateLo = true;
  uint32_t state_lo;
  sd::NoRowSink row_sink;
};

// The state as the inter term's operand, split: hi = bf16(S) at byte offset `hi`, lo = bf16(S - hi)
// `lo_offset` bytes further, both in the layout of lasp::sd::store_state_bf16. The output divides
// by q . n, which is kept in fp32; a bf16 copy of S alone puts a relative error of 2^-9 into each
// element of q S, which does not cancel against the normaliser and is amplified where q . k of the
// dominant token is small against |q| |k| (one token holds the state once input gates are large):
// h then errs by percents. With the residue, q S is exact to 16 significant bits.
template <int DK>
__device__ __forceinline__ void store_state_split(uint8_t* smem, uint32_t hi, uint32_t lo_offset, StateRegs<DK>& s,
                                                  const StateLane& ln) {
  chunk::for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const uint32_t h = pack_bf16x2(x0, x1);
    const uint32_t at = hi + swizzle(d, c / 8, DK) + 4 * ln.t;
    *reinterpret_cast<uint32_t*>(smem + at) = h;
    *reinterpret_cast<uint32_t*>(smem + at + lo_offset) =
        pack_bf16x2(x0 - __uint_as_float(h << 16), x1 - __uint_as_float(h & 0xffff0000u));
  });
}

// ---------------------------------------------------------------------------------------------
// The segment loop: one CTA per (segment, b*H+h) walks the chunks of its segment with the state on
// chip, one warpgroup per 64 columns of Dv (kGroups = Dv / 64), so the gates, the normaliser and
// the Q and K tiles of a chunk serve every column.
// ---------------------------------------------------------------------------------------------

// What one CTA runs.
struct SegmentArgs {
  const uint16_t* q;  // bf16 [B, T, H, DK] (unused without O)
  const uint16_t* k;  // bf16 [B, T, H, DK]
  const uint16_t* v;  // bf16 [B, T, H, Dv]
  const float* i_gate;
  const float* f_gate;  // fp32 [B, T, H]
  uint16_t* o;          // bf16 [B, T, H, Dv] (unused without O)
  float* row_m;         // the forward's saved rows, or NULL (lasp_mlstm_params)
  float* row_den;
  const float* row_log_scale;    // the gradient passes' row scales (lasp_mlstm_params)
  const uint16_t* row_dot_with;  // and row dots, or NULL
  float* row_dots;
  int T, H, Dv;
  int c_begin, n_chunks;  // the segment's first chunk and its chunk count (>= 1)
  int bh;
  bool reversed;  // loop token p is token T-1-p
  float scale, eps;
  // With documents (kPacked): one start word per loop chunk (lasp/documents/chunk_starts.cuh; a
  // reversed pass's words mark the tokens whose successor starts a document).
  const uint64_t* starts;
  // Packed documents' final states (kEntries): the entering states' slots (lasp_mlstm_params).
  const int32_t* entry_slots;
  float* document_c;
  float* document_n;
  float* entry_m;
  int documents;
  // The tensors' token of loop token p (< T).
  __device__ __forceinline__ int token(int p) const { return reversed ? T - 1 - p : p; }
  // The stabiliser a document enters with: in order (the forward and the dq pass, whose m must be
  // the forward's) mlstm_kernels' zero state, m = 0; reversed (the dv and dk passes, whose
  // stabiliser only keeps exponents <= 0) the empty state.
  __device__ __forceinline__ float doc_entry() const { return reversed ? -INFINITY : 0.f; }
};

// One chunk's rows of a gradient pass (kGradient): row r of this lane's fragments (token
// a.token(tok0 + r)) times e^{m_r + row_log_scale}, stored in bf16, and its dot with the same row of
// row_dot_with, summed over the warpgroup's 64 columns in fp32, stored per column tile. The
// chunk's row_log_scale values come staged in shared memory at `s_scale` (64 floats).
template <int kGroups, bool kMasked>
__device__ __forceinline__ void store_gradient_rows(const SegmentArgs& a, const float (&o)[8][4],
                                                    const ChunkStep<kMasked>& st,
                                                    const float* s_scale, int tok0, int64_t row_bt0, int group,
                                                    int warp, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const int g = lane >> 2, t = lane & 3;
  const int64_t col = group * kTileV + 2 * t;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int pos = tok0 + 16 * warp + 8 * hh + g;
    const bool is_token = pos < a.T;
    const int64_t row = row_bt0 + (int64_t)a.token(is_token ? pos : 0) * a.H;  // [B, T, H] index
    const float w = is_token ? expf(st.m_row[hh] + s_scale[16 * warp + 8 * hh + g]) : 0.f;
    float dot = 0.f;
    if (is_token) {
      uint16_t* dst = a.o + row * a.Dv + col;
      const uint16_t* with = a.row_dot_with ? a.row_dot_with + row * a.Dv + col : nullptr;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float x0 = o[nt][2 * hh] * w, x1 = o[nt][2 * hh + 1] * w;
        *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack_bf16x2(x0, x1);
        if (with) {
          const uint32_t y = __ldg(reinterpret_cast<const unsigned int*>(with + 8 * nt));
          dot = fmaf(x0, __uint_as_float(y << 16), fmaf(x1, __uint_as_float(y & 0xffff0000u), dot));
        }
      }
    }
    if (a.row_dot_with) {
      dot += __shfl_xor_sync(kAll, dot, 1);
      dot += __shfl_xor_sync(kAll, dot, 2);
      if (is_token && t == 0) a.row_dots[row * kGroups + group] = dot;
    }
  }
}

// Shared-memory map (byte offsets): kStages stages of [Q] K and kGroups V tiles (bf16, swizzled),
// then with O two split copies (store_state_split) of every warpgroup's state tile, then the stages' gates (forget,
// input: 64 fp32 each), then the partial vectors of n (normaliser_parts; with O two copies, one
// read this chunk and one written for the next; the states pass adds them up there at its end).
// Every tile starts 1024-byte aligned.
template <int DK, int kGroups, bool kStoreO>
struct Layout {
  static constexpr uint32_t kQKBytes = kChunk * DK * 2;
  static constexpr uint32_t kVBytes = kChunk * kTileV * 2;
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kStoreO ? kQKBytes : 0;
  static constexpr uint32_t kV = kK + kQKBytes;
  static constexpr uint32_t kStageBytes = kV + kGroups * kVBytes;
  static constexpr uint32_t kSbf = kStages * kStageBytes;
  static constexpr uint32_t kSbfBytes = DK * kTileV * 2;  // one warpgroup's copy (hi or lo)
  static constexpr uint32_t kGates = kSbf + (kStoreO ? 4 * kGroups * kSbfBytes : 0);
  static constexpr uint32_t kGateBytes = 2 * kChunk * 4;
  static constexpr uint32_t kN = kGates + kStages * kGateBytes;
  static constexpr int kParts = normaliser_parts<DK, 128 * kGroups>();
  static constexpr uint32_t kNBytes = kParts * DK * 4;  // the partial vectors of n
  static constexpr uint32_t kTiles = kN + (kStoreO ? 2 : 1) * kNBytes;
  // Packed documents: each stage's start word lands after the tiles where a block has room (all
  // but the output loop at Dk = Dv = 128), else, in a gradient pass, beside its row scales.
  static constexpr bool kWordsAfterTiles = kTiles + kStages * 8 <= LASP_MLSTM_BLOCK_SMEM;
  static constexpr uint32_t kBytes = kTiles + (kWordsAfterTiles ? kStages * 8 : 0);
  static __device__ __forceinline__ uint32_t stage(int i) { return (i % kStages) * kStageBytes; }
  static __device__ __forceinline__ uint32_t forget(int i) { return kGates + (i % kStages) * kGateBytes; }
  static __device__ __forceinline__ uint32_t input(int i) { return forget(i) + kChunk * 4; }
  // Warpgroup w's bf16 state copy for chunk i (hi; lo kSbfBytes after it).
  static __device__ __forceinline__ uint32_t state_copy(int w, int i) {
    return kSbf + 2 * ((i & 1) * kGroups + w) * kSbfBytes;
  }
  static __device__ __forceinline__ uint32_t normaliser(int i) { return kN + (kStoreO ? (i & 1) * kNBytes : 0); }
  // A gradient pass's output kernel has no normaliser: each stage's row scales (64 fp32) sit
  // where the copies of n would, then each stage's start word (packed documents).
  static __device__ __forceinline__ uint32_t row_scale(int i) { return kN + (i % kStages) * kChunk * 4; }
  static __device__ __forceinline__ uint32_t start_word(int i) {
    return (kWordsAfterTiles ? kTiles : kN + kStages * kChunk * 4) + (i % kStages) * 8;
  }
  static_assert(kStageBytes % 1024 == 0 && kSbfBytes % 1024 == 0, "tiles stay 1024-byte aligned");
  static_assert(!kStoreO || kStages * (kChunk * 4 + 8) <= 2 * kNBytes,
                "the row scales and start words fit where n's copies would");
};

// kEntries: the state entering the chunk into the slots of document `doc` >= 0 of row b
// (lasp_mlstm_params: document_c, document_n, entry_m): C from the warpgroups' split copies the
// chunk's products read (store_state_split: hi at `hi`, lo `lo_offset` bytes further; hi + lo is
// C to 16 significant bits), n as its parts at `parts`, and m. From shared memory, not from the
// state's registers: the output loop at Dk = 128, Dv = 64 has none to spare (a store from the
// registers spilled 12 bytes). The slots' address comes from the grid index read by a volatile
// move here, so that no loop-invariant part of it is hoisted and held across the loop.
template <int DK, int DV, int kParts>
__device__ __forceinline__ void store_document_entry(const SegmentArgs& a, int doc, const uint8_t* hi,
                                                     uint32_t lo_offset, int group, float m, const float* parts) {
  uint32_t z;  // b*H+h
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
  // 32-bit: a 64-bit remainder is a called subroutine, and any call in the output kernel makes
  // ptxas serialise every wgmma of it (C7509; the loop took 16 % longer).
  const int h = static_cast<int>(z) % a.H, b = static_cast<int>(z) / a.H;
  const int64_t slot = ((int64_t)b * a.documents + doc) * a.H + h;  // (b, doc, h)
  float* c = a.document_c + slot * DK * DV + group * kTileV;
  // Each warpgroup its 64 columns: 16 bytes (8 columns) of hi and of lo per thread and step.
  for (int e = threadIdx.x % 128; e < DK * (kTileV / 8); e += 128) {
    const int d = e / (kTileV / 8), c8 = e % (kTileV / 8);
    const uint32_t at = swizzle(d, c8, DK);
    const uint4 x_hi = *reinterpret_cast<const uint4*>(hi + at);
    const uint4 x_lo = *reinterpret_cast<const uint4*>(hi + at + lo_offset);
    const uint32_t h2[4] = {x_hi.x, x_hi.y, x_hi.z, x_hi.w}, l2[4] = {x_lo.x, x_lo.y, x_lo.z, x_lo.w};
    float y[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      y[2 * q] = __uint_as_float(h2[q] << 16) + __uint_as_float(l2[q] << 16);
      y[2 * q + 1] = __uint_as_float(h2[q] & 0xffff0000u) + __uint_as_float(l2[q] & 0xffff0000u);
    }
    float4* out = reinterpret_cast<float4*>(c + (int64_t)d * DV + 8 * c8);
    out[0] = make_float4(y[0], y[1], y[2], y[3]);
    out[1] = make_float4(y[4], y[5], y[6], y[7]);
  }
  const int tid = threadIdx.x;
  if (tid < DK) a.document_n[slot * DK + tid] = kParts == 2 ? parts[tid] + parts[DK + tid] : parts[tid];
  if (tid == 0) a.entry_m[slot] = m;
}

// The state a CTA starts or ends its segment with: every warpgroup's C tile in registers, n in
// registers of the threads d < DK (n_mine, dimension d = thread index), m in every thread.
//   start(s, ln, group, n_mine) -> m: fills the group's C tile and (threads < DK) n_d; returns m
//                                     (-inf: the empty state, C = n = 0)
//   end(s, ln, group, n_mine, m, log_forget): the state leaving the segment and its summed log
//                                     forget gate
// kStoreO = false: a states pass (no Q, no O; each chunk only updates the state).
// kGradient: a pass of the backward (lasp/mlstm/backward_params.h): no normaliser, each output row
// scaled by e^{m_r + row_log_scale} and dotted with row_dot_with (store_gradient_rows).
// kPacked: over packed documents (a.starts): a chunk holding a start runs with the masks at its
// starts (chunk_step<true>, DocumentChunkGates), every other chunk as without documents.
// kEntries (the forward's packed output loop): also the states entering the documents' last
// chunks (store_document_entry); instances of their own, so that the packed loop without final
// states stays as it was.
template <int DK, int kGroups, bool kStoreO, bool kGradient = false, bool kPacked = false, bool kEntries = false,
          class Start, class End>
__device__ __forceinline__ void run_segment(const SegmentArgs& a, Start&& start, End&& end) {
  static_assert(!kEntries || (kStoreO && !kGradient && kPacked), "the forward's packed output loop stores them");
  using L = Layout<DK, kGroups, kStoreO>;
  static_assert(L::kBytes == (kStoreO ? lasp_mlstm_output_smem_bytes(DK, kGroups * kTileV)
                                      : lasp_mlstm_states_smem_bytes(DK, kGroups * kTileV)),
                "shared-memory map and host formula disagree");
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");
  constexpr int kThreads = 128 * kGroups;

  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, group = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int b = a.bh / a.H, h = a.bh % a.H;
  const int T = a.T, Dv = a.Dv;
  const int64_t row_bt0 = (int64_t)b * T * a.H + h;  // token 0 of (b, h)
  const int64_t qk_stride = (int64_t)a.H * DK, v_stride = (int64_t)a.H * Dv;
  const uint16_t* q = a.q + row_bt0 * DK;
  const uint16_t* k = a.k + row_bt0 * DK;
  const uint16_t* v = a.v + row_bt0 * Dv;
  // A chunk's rows run down the tensors (in order) or up them (reversed).
  const int64_t dir = a.reversed ? -1 : 1;

  // With documents, each chunk's start word lands with the chunk's tiles (L::start_word), so
  // that no chunk waits on a load at its head; the forward's output loop at Dk = Dv = 128, which
  // has no byte of shared memory left, holds it a chunk ahead in a register instead.
  constexpr bool kWordLands = L::kWordsAfterTiles || kGradient;
  auto issue_chunk = [&](int i) {
    const uint32_t stage = sbase + L::stage(i);
    const int tok0 = (a.c_begin + i) * kChunk;
    const int valid = min(kChunk, T - tok0);
    const int64_t first = a.token(tok0);
    if constexpr (kStoreO)
      chunk::copy_tile_async<DK / 8, kThreads>(stage + L::kQ, q + first * qk_stride, dir * qk_stride, valid, tid);
    chunk::copy_tile_async<DK / 8, kThreads>(stage + L::kK, k + first * qk_stride, dir * qk_stride, valid, tid);
#pragma unroll
    for (int w = 0; w < kGroups; ++w)
      chunk::copy_tile_async<kTileV / 8, kThreads>(stage + L::kV + w * L::kVBytes, v + first * v_stride + w * kTileV,
                                                   dir * v_stride, valid, tid);
    if (tid < 2 * kChunk) {
      const int r = tid & (kChunk - 1);
      const float* gate = (tid < kChunk ? a.f_gate : a.i_gate) + row_bt0;
      const bool ok = r < valid;
      cp_async_4(sbase + L::forget(i) + 4 * tid, ok ? gate + (int64_t)a.token(tok0 + r) * a.H : gate, ok);
    }
    if constexpr (kWordLands) {
      if (tid == 0) documents::ChunkStarts::copy_async<kPacked>(sbase + L::start_word(i), a.starts, a.c_begin + i);
    }
    if constexpr (kStoreO && kGradient) {
      if (tid < kChunk) {
        const float* scale = a.row_log_scale + row_bt0;
        const bool ok = tid < valid;
        cp_async_4(sbase + L::row_scale(i) + 4 * tid, ok ? scale + (int64_t)a.token(tok0 + tid) * a.H : scale, ok);
      }
    }
  };

  const StateLane ln{16 * warp, g, t};
  StateRegs<DK> s;
  // This thread's part of n (normaliser_parts): threads part * DK + d, d < DK.
  constexpr int kParts = L::kParts;
  const bool carries_n = tid < kParts * DK;
  const int n_dim = tid % DK, n_part = tid / DK;
  float n_mine = 0.f;
  float m = start(s, ln, group, n_mine);  // threads < DK: n_0 (part 0); the other parts start at 0
  auto publish_n = [&](int i) {
    if (carries_n) reinterpret_cast<float*>(smem + L::normaliser(i))[tid] = n_mine;
  };
  if constexpr (kStoreO && !kGradient) publish_n(0);
  const FragOffsets<DK> off(warp, lane);
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < a.n_chunks) issue_chunk(i);
    cp_async_commit();
  }
  if constexpr (kStoreO) store_state_split<DK>(smem, L::state_copy(group, 0), L::kSbfBytes, s, ln);

  float log_forget = 0.f;  // summed over the chunks in order
  auto starts = documents::ChunkStarts::Ahead<kPacked && !kWordLands>::first(a.starts, a.c_begin, a.n_chunks > 0);
  for (int i = 0; i < a.n_chunks; ++i) {
    cp_async_wait<kStages - 2>();
#if LASP_SD_WGMMA
    wg::fence_proxy_async();  // the landed chunk and this thread's state copy, for wgmma's async proxy
#endif
    // Chunk i has landed for every thread; every warp is done with chunk i-1, its stage, its state
    // copies and the n copy it read.
    __syncthreads();
    if (i + kStages - 1 < a.n_chunks) issue_chunk(i + kStages - 1);
    cp_async_commit();
    if constexpr (kEntries) {
      // Only a chunk that a document enters (its token 0 starts none) and leaves (a later token
      // starts one, or the shard ends in it) can be that document's last with a state entering
      // it: the table is read there alone (a read in every chunk, its latency exposed, made the
      // forward 1.2 to 1.4 times as long). C's split copy and n's parts entering the chunk were
      // written at the end of the last chunk (or before the loop) and are visible since the
      // barrier.
      const int c = a.c_begin + i;
      // The chunk's word read again here, not held from below: held, it pushed the loop at
      // Dk = 128, Dv = 64 past 255 registers.
      const uint64_t starts_here =
          kWordLands ? documents::ChunkStarts::landed<kPacked>(smem + L::start_word(i)).word : starts.word;
      if (!(starts_here & 1) && (starts_here != 0 || c == lasp_mlstm_num_chunks(T) - 1)) {
        const int entry_doc = a.entry_slots[c];
        if (entry_doc >= 0)
          store_document_entry<DK, kGroups * kTileV, L::kParts>(
              a, entry_doc, smem + L::state_copy(group, i), L::kSbfBytes, group, m,
              reinterpret_cast<const float*>(smem + L::normaliser(i)));
      }
    }

    const int tok0 = (a.c_begin + i) * kChunk;
    const uint32_t stage = L::stage(i);
    const uint64_t word = kWordLands ? documents::ChunkStarts::landed<kPacked>(smem + L::start_word(i)).word
                                     : starts.next(a.starts, a.c_begin + i + 1, i + 1 < a.n_chunks).word;
    const float* const s_f = reinterpret_cast<const float*>(smem + L::forget(i));
    const float* const s_i = reinterpret_cast<const float*>(smem + L::input(i));
    // The output passes' fragments live out here, not in run_chunk: declared inside it, they changed
    // how nvcc optimises the plain kernels (other instructions, 3 % slower); out here every plain
    // kernel compiles to the instructions it had without the twins' dispatch below.
    float o[8][4];
    float qn[2];
    float score_sums[2];
    // The chunk's products and outputs, with the plain gates (st: ChunkStep<false>) or with the
    // masks at its document starts (ChunkStep<true>).
    auto run_chunk = [&](const auto& st) {
      log_forget += st.log_forget;
      const uint32_t sK = sbase + stage + L::kK;
      const uint32_t sV = sbase + stage + L::kV + group * L::kVBytes;
      auto update_n = [&] {
        if (carries_n) n_mine = normaliser_update<DK, kParts>(n_mine, smem + stage + L::kK, n_dim, n_part, st);
      };
      if constexpr (kStoreO && kGradient) {
        const uint32_t copy = sbase + L::state_copy(group, i);
        const GradientExtras extras{copy + L::kSbfBytes, {}};
        sd::output_chunk<DK, sd::Probe::kNone>(o, s, sbase + stage + L::kQ, sK, sV, copy, off, st.cg, warp, g, t,
                                               a.scale, extras);
        store_gradient_rows<kGroups>(a, o, st, reinterpret_cast<const float*>(smem + L::row_scale(i)), tok0, row_bt0,
                                     group, warp, lane);
        if (i + 1 < a.n_chunks) store_state_split<DK>(smem, L::state_copy(group, i + 1), L::kSbfBytes, s, ln);
      } else if constexpr (kStoreO) {
        score_sums[0] = score_sums[1] = 0.f;
        const uint32_t copy = sbase + L::state_copy(group, i);
        // Before the products, not beside them: run while the tensor cores work, the normaliser's
        // registers pushed the kernel past 255 (spills) and the pass took 8 % longer.
        query_dot_normaliser<DK, kParts>(qn, sbase + stage + L::kQ,
                                         reinterpret_cast<const float*>(smem + L::normaliser(i)), off, lane);
        update_n();
        const OutputExtras extras{copy + L::kSbfBytes, ScoreRowSums{score_sums}};
        sd::output_chunk<DK, sd::Probe::kNone>(o, s, sbase + stage + L::kQ, sK, sV, copy, off, st.cg, warp, g, t,
                                               a.scale, extras);
        sum_rows(score_sums);
        uint16_t* o_tile = a.o + row_bt0 * Dv + group * kTileV + 2 * t;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          // The row's q . n as the products weigh the state's term: sigma e^{row_r} (0 in a row the
          // carried state does not reach).
          const int r = 16 * warp + 8 * hh + g;
          const float inter = a.scale * exp_nonpos(sd::document_start(st.cg, hh) < 0 ? st.cg.row[hh] : -INFINITY);
          const float qn_r = fmaf(inter, qn[hh], score_sums[hh]);
          const float den = fmaxf(fabsf(qn_r), expf(-st.m_row[hh])) + a.eps;
          const float inv = rcp_approx(den);
          const int tok = tok0 + r;
          if (tok < T) {
            uint16_t* dst = o_tile + (int64_t)tok * v_stride;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
              *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack_bf16x2(o[nt][2 * hh] * inv, o[nt][2 * hh + 1] * inv);
            if (a.row_m && group == 0 && t == 0) {
              a.row_m[row_bt0 + (int64_t)tok * a.H] = st.m_row[hh];
              a.row_den[row_bt0 + (int64_t)tok * a.H] = den;
            }
          }
        }
        if (i + 1 < a.n_chunks) store_state_split<DK>(smem, L::state_copy(group, i + 1), L::kSbfBytes, s, ln);
        publish_n(i + 1);
      } else {
        if constexpr (!kGradient) update_n();
        sd::state_chunk<DK>(s, sK, sV, off, st.cg);
      }
      m = st.m_next;
    };
    // Most chunks of packed documents hold no start: a uniform branch runs them as chunks without
    // documents, so that only the chunks holding a start pay for the segmented scans and masks.
    if constexpr (kPacked) {
      if (word != 0)
        run_chunk(chunk_step<true>(s_f, s_i, T - tok0, m, a.doc_entry(), word, warp, lane));
      else
        run_chunk(chunk_step<false>(s_f, s_i, T - tok0, m, a.doc_entry(), word, warp, lane));
    } else {
      run_chunk(chunk_step<false>(s_f, s_i, T - tok0, m, a.doc_entry(), word, warp, lane));
    }
  }
  // n leaving the segment: its parts added up (the states pass publishes them only now). A
  // gradient pass has none (n stays 0), and its output kernel keeps row scales there.
  if constexpr (!kStoreO) publish_n(0);
  __syncthreads();
  if (!(kStoreO && kGradient) && tid < DK) {
    const float* parts = reinterpret_cast<const float*>(smem + L::normaliser(kStoreO ? a.n_chunks : 0));
    n_mine = parts[tid];
    if constexpr (kParts == 2) n_mine += parts[DK + tid];
  }
  end(s, ln, group, n_mine, m, log_forget);
}

}  // namespace mlstm
}  // namespace lasp
