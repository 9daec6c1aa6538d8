// Scalar-decay linear attention, backward: the kernels around the three chunkwise passes
// (the passes and the maths: lasp/scalar_decay_bwd_params.h; the reversed passes:
// lasp_scalar_decay_*_reversed_* in scalar_decay_fwd.cu).
//
// Gate gradient. Every log-decay enters through G_t = a_0 + ... + a_t, in e^{G_t - G_s} (query t,
// key s), e^{G_t} (h0) and e^{G_{T-1} - G_s} (the final state), so
//   dL/dG_t = q_t . dq_t - k_t . dk_t (+ <ht, dht> at t = T-1),   dL/da_t = sum_{u >= t} dL/dG_u.
// dq and dk are the passes' bf16 outputs; the per-token dots accumulate in fp32 and the suffix sums
// over up to 2^31 tokens in fp64, in a fixed order (the same bits on every run).
#include <stdint.h>

#include "lasp/scalar_decay.cuh"
#include "lasp/scalar_decay_bwd_params.h"

namespace {

constexpr unsigned kAll = 0xffffffffu;

// A 16-byte piece of a bf16 row: 8 values.
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  const uint32_t x[4] = {a.x, a.y, a.z, a.w}, y[4] = {b.x, b.y, b.z, b.w};
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sum = fmaf(__uint_as_float(x[i] << 16), __uint_as_float(y[i] << 16), sum);
    sum = fmaf(__uint_as_float(x[i] & 0xffff0000u), __uint_as_float(y[i] & 0xffff0000u), sum);
  }
  return sum;
}

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

// dG_t = q_t . dq_t - k_t . dk_t for every row (b, t, h) into gate_terms [B, H, T]. A row takes
// Dk / 8 consecutive lanes, one 16-byte piece of each of q, dq, k, dk per lane, and every thread
// takes LASP_SDB_TERM_ROWS_PER_THREAD rows, so that many loads are in flight per thread.
// grid lasp_sdb_gate_terms_grid, block LASP_SDB_TERM_THREADS.
extern "C" __global__ void __launch_bounds__(LASP_SDB_TERM_THREADS)
    lasp_sd_bwd_gate_terms(const __grid_constant__ lasp_sd_bwd_params p) {
  const int lanes = p.Dk / 8;  // per row: 8 or 16, a power of two dividing 32
  const int piece = threadIdx.x % lanes;
  const int64_t rows = (int64_t)p.B * p.T * p.H;
  const int64_t row0 = (int64_t)blockIdx.x * lasp_sdb_term_rows_per_cta(p.Dk) + threadIdx.x / lanes;
  constexpr int kRows = LASP_SDB_TERM_ROWS_PER_THREAD;
  const int64_t stride = LASP_SDB_TERM_THREADS / lanes;  // rows between a thread's rows
  uint4 q[kRows], dq[kRows], k[kRows], dk[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t row = min(row0 + i * stride, rows - 1);  // past the end: a valid row, not stored
    const int64_t at = row * (p.Dk / 8) + piece;
    q[i] = __ldg(reinterpret_cast<const uint4*>(p.q) + at);
    dq[i] = __ldg(reinterpret_cast<const uint4*>(p.dq) + at);
    k[i] = __ldg(reinterpret_cast<const uint4*>(p.k) + at);
    dk[i] = __ldg(reinterpret_cast<const uint4*>(p.dk) + at);
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    float qdq = dot8(q[i], dq[i]), kdk = dot8(k[i], dk[i]);
    // Butterfly over the row's lanes (aligned groups of `lanes`), the same order in every lane.
    for (int m = lanes / 2; m >= 1; m >>= 1) {
      qdq += __shfl_xor_sync(kAll, qdq, m);
      kdk += __shfl_xor_sync(kAll, kdk, m);
    }
    const int64_t row = row0 + i * stride;
    if (piece == 0 && row < rows) {
      const int64_t h = row % p.H, bt = row / p.H;
      const int64_t t = bt % p.T, b = bt / p.T;
      p.gate_terms[(b * p.H + h) * p.T + t] = qdq - kdk;
    }
  }
}

// The suffix sums of dG. Block j of a sequence holds the LASP_SDB_GRAD_BLOCK tokens before
// T - j * LASP_SDB_GRAD_BLOCK (fewer in the last block). Both gate kernels copy their block to shared
// memory (coalesced) and cut it into runs: thread i sums the i-th run of LASP_SDB_GRAD_PER_THREAD
// tokens counted from the block's end, from its last token back; the CTA scans the runs' sums in
// thread order. The sum of block j and the suffix sums inside it therefore have the same bits in
// both kernels, and the same bits as when one CTA walked a whole sequence block by block.
namespace {

struct GradBlock {
  float* tokens;  // shared memory: dG of the block's tokens, in token order
  int64_t begin;  // first token of the block in the sequence
  int lo, hi;     // this thread's run: tokens [lo, hi) of the block (empty when hi <= 0)
};

__device__ GradBlock load_grad_block(const lasp_sd_bwd_params& p, int64_t bh, int j, float* tokens) {
  const int64_t end = (int64_t)p.T - (int64_t)j * LASP_SDB_GRAD_BLOCK;
  const int64_t begin = end > LASP_SDB_GRAD_BLOCK ? end - LASP_SDB_GRAD_BLOCK : 0;
  const int count = (int)(end - begin);
  const float* terms = p.gate_terms + bh * p.T;
  for (int i = threadIdx.x; i < count; i += LASP_SDB_GRAD_THREADS) tokens[i] = terms[begin + i];
  __syncthreads();
  const int hi = count - (int)threadIdx.x * LASP_SDB_GRAD_PER_THREAD;
  return {tokens, begin, hi > LASP_SDB_GRAD_PER_THREAD ? hi - LASP_SDB_GRAD_PER_THREAD : 0, hi};
}

// <ht, dht> of head bh (0 without dht), over the CTA in a fixed order. ht^T, the dq pass's final
// state, is [Dv][Dk] and dht is [Dk][Dv]: the CTA reads both in rows (whole 128-byte lines per warp)
// and meets them in `scratch`, kDotRows rows of ht^T per round, padded to Dk + 1 floats so that a
// warp's reads down a column hit 32 banks. Every load of every round is issued before the first
// barrier. (Reading ht^T down its columns put each load of a warp in a line of its own: gate_grad
// took 35 us instead of 16 at B*H = 64, Dk = Dv = 128.)
constexpr int kDotRows = 32;                                      // rows of ht^T per round
constexpr int kDotRounds = 128 / kDotRows;                        // at most (Dv <= 128)
constexpr int kDotPerRound = kDotRows * 128 / LASP_SDB_GRAD_THREADS;  // per thread, at most (Dk <= 128)
constexpr int kDotScratchFloats = kDotRows * (128 + 1);

__device__ double ht_dht_dot(const lasp_sd_bwd_params& p, int64_t bh, double* warp_totals, float* scratch) {
  double dot = 0.0;
  if (!p.dht) return dot;
  const int64_t n = (int64_t)p.Dk * p.Dv;
  const float* const ht_t = p.ht_t + bh * n;
  const float* const dht = p.dht + bh * n;
  const int rounds = p.Dv / kDotRows, per_round = p.Dk * kDotRows / LASP_SDB_GRAD_THREADS;
  // Element i of round r: ht^T[kDotRows r + i / Dk][i % Dk] (contiguous in i), and the dht element
  // it pairs with for the thread that takes i: dht[i / kDotRows][kDotRows r + i % kDotRows]. The
  // ht^T loads of all rounds go first; a round's dht loads fly while its tile goes to shared memory
  // (all of them at once spilled at 1024 threads' 64 registers).
  float ht[kDotRounds][kDotPerRound];
#pragma unroll
  for (int r = 0; r < kDotRounds; ++r)
#pragma unroll
    for (int k = 0; k < kDotPerRound; ++k)
      if (r < rounds && k < per_round)
        ht[r][k] = ht_t[(int64_t)r * kDotRows * p.Dk + threadIdx.x + k * LASP_SDB_GRAD_THREADS];
  double part = 0.0;
#pragma unroll
  for (int r = 0; r < kDotRounds; ++r) {
    if (r >= rounds) continue;
    float dh[kDotPerRound];
#pragma unroll
    for (int k = 0; k < kDotPerRound; ++k) {
      const int i = threadIdx.x + k * LASP_SDB_GRAD_THREADS;
      if (k < per_round) {
        dh[k] = dht[(int64_t)(i / kDotRows) * p.Dv + r * kDotRows + i % kDotRows];
        scratch[(i / p.Dk) * (p.Dk + 1) + i % p.Dk] = ht[r][k];
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kDotPerRound; ++k) {
      const int i = threadIdx.x + k * LASP_SDB_GRAD_THREADS;
      if (k < per_round) part += (double)scratch[(i % kDotRows) * (p.Dk + 1) + i / kDotRows] * (double)dh[k];
    }
    __syncthreads();
  }
  block_inclusive_scan(part, warp_totals, dot);
  return dot;
}
static_assert(kDotScratchFloats <= LASP_SDB_GRAD_BLOCK, "the dot's scratch is the block's token buffer");

__device__ double run_sum(const GradBlock& blk) {
  double run = 0.0;
  for (int i = blk.hi - 1; i >= blk.lo; --i) run += (double)blk.tokens[i];
  return run;
}

}  // namespace

// Per (block j, b*H+h): the block's sum of dG into block_totals[bh][1 + j]; block 0's CTA also
// writes <ht, dht> (0 without dht) into block_totals[bh][0]. Launched only where T is longer than
// one block: with one block, lasp_sd_bwd_gate_grad needs neither.
// grid lasp_sdb_gate_grad_grid, block LASP_SDB_GRAD_THREADS.
extern "C" __global__ void __launch_bounds__(LASP_SDB_GRAD_THREADS)
    lasp_sd_bwd_gate_block_sums(const __grid_constant__ lasp_sd_bwd_params p) {
  __shared__ double warp_totals[32];
  __shared__ float tokens[LASP_SDB_GRAD_BLOCK];
  const int j = blockIdx.x;
  const int64_t bh = blockIdx.y;
  double* totals = p.block_totals + bh * (1 + (int64_t)gridDim.x);

  if (j == 0) {
    const double dot = ht_dht_dot(p, bh, warp_totals, tokens);
    if (threadIdx.x == 0) totals[0] = dot;
  }

  const GradBlock blk = load_grad_block(p, bh, j, tokens);
  double total;
  block_inclusive_scan(run_sum(blk), warp_totals, total);
  if (threadIdx.x == 0) totals[1 + j] = total;
}

// Per (block j, b*H+h): dg_t = sum_{u >= t} dG_u + <ht, dht> (fp64 sums, written as fp32) for the
// block's tokens, starting from <ht, dht> plus the sums of blocks 0 .. j-1 added in that order
// (from block_totals; with one block, the CTA takes <ht, dht> itself and block_totals is not read);
// the CTAs of (b, h) share the writing of dh0 = sigma e^{a_0} (dH_0 / sigma).
// grid lasp_sdb_gate_grad_grid, block LASP_SDB_GRAD_THREADS.
extern "C" __global__ void __launch_bounds__(LASP_SDB_GRAD_THREADS)
    lasp_sd_bwd_gate_grad(const __grid_constant__ lasp_sd_bwd_params p) {
  __shared__ double warp_totals[32];
  __shared__ float tokens[LASP_SDB_GRAD_BLOCK];
  const int j = blockIdx.x;
  const int64_t bh = blockIdx.y;
  const int64_t b = bh / p.H, h = bh % p.H;
  const double* totals = p.block_totals + bh * (1 + (int64_t)gridDim.x);

  double after_blocks = gridDim.x == 1 ? ht_dht_dot(p, bh, warp_totals, tokens) : totals[0];
  for (int i = 0; i < j; ++i) after_blocks += totals[1 + i];

  const GradBlock blk = load_grad_block(p, bh, j, tokens);
  const double run = run_sum(blk);
  double total;
  double after = after_blocks + block_inclusive_scan(run, warp_totals, total) - run;
  for (int i = blk.hi - 1; i >= blk.lo; --i) {
    after += (double)blk.tokens[i];
    p.dg[(b * p.T + blk.begin + i) * p.H + h] = (float)after;
  }

  if (p.dh0) {
    // kDh0Batch loads in flight per thread before the stores: one element per round trip took
    // ~12 us of gate_grad at B*H = 64, Dk = Dv = 128 (16 elements per thread).
    constexpr int kDh0Batch = 8;
    const int64_t n = (int64_t)p.Dk * p.Dv, stride = (int64_t)gridDim.x * LASP_SDB_GRAD_THREADS;
    const float factor = p.scale * expf(fminf(p.g[b * p.T * p.H + h], 0.f));  // sigma e^{a_0}
    const float* const src = p.dh0_scaled + bh * n;
    float* const dst = p.dh0 + bh * n;
    for (int64_t e0 = (int64_t)j * LASP_SDB_GRAD_THREADS + threadIdx.x; e0 < n; e0 += kDh0Batch * stride) {
      float x[kDh0Batch];
#pragma unroll
      for (int i = 0; i < kDh0Batch; ++i)
        if (e0 + i * stride < n) x[i] = src[e0 + i * stride];
#pragma unroll
      for (int i = 0; i < kDh0Batch; ++i)
        if (e0 + i * stride < n) dst[e0 + i * stride] = factor * x[i];
    }
  }
}
