// The short causal depthwise convolution (fla's ShortConvolution) on LASP-2 shards, forward and
// backward, with its halo exchanged from the device (lasp/short_conv/short_conv_params.h).
//
//   y_t = act(z_t),  z_t = bias + sum_{i<K} w[i] x_{t-K+1+i}   (per channel; x before token 0 of
//   the whole sequence is zero, and before token 0 of a shard it is the halo: the K - 1 tokens
//   before it, which belong to the PEs before it)
//
// Packed documents (p.starts): x before the start of token t's document counts as zero in z_t, as
// if every document were a sequence of its own. The window of earlier tokens is cleared at every
// start, and in the backward a token's dx takes only the outputs of its own document.
//
// A call's kernels, in stream order:
//   forward:  convolve, advance
//   backward: convolve_grad, reduce_params (d_weight, d_bias in a fixed order), advance
// The halo travels from inside the convolution: for each sequence and channel tile, the CTA that
// holds the tail (the forward's last token group, scheduled first; the backward's first) builds
// its tile's part of what the neighbour needs, puts it and sets the tile's signal, then convolves
// its own tokens; the CTAs that read what the neighbour put (the first tokens in the forward, the
// last in the backward) wait for their tile's signal, bounded, and are placed last in the grid, so
// every other CTA has been placed before any of them waits. A shard shorter than K - 1 relays: its
// tail then includes part of its own halo, so its sending CTA (the only one: one token group)
// waits for that halo first.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#include <stdint.h>

#include "lasp/mma.cuh"
#include "lasp/short_conv/short_conv_params.h"
#include "lasp/wait.cuh"

namespace {

// L consecutive channels of one token, in fp32 (L = 8: one 16-byte load of bf16; L = 4: 8 bytes).
template <int L>
struct Lanes {
  float v[L];
};

// The same channels as loaded, still bf16 pairs: what a prefetched token holds in registers.
template <int L>
struct __align__(2 * L) Packed {
  uint32_t w[L / 2];
};

template <int L>
__device__ __forceinline__ Lanes<L> zero_lanes() {
  Lanes<L> r;
#pragma unroll
  for (int j = 0; j < L; ++j) r.v[j] = 0.f;
  return r;
}

template <int L>
__device__ __forceinline__ Packed<L> load_packed(const uint16_t* src) {
  Packed<L> r;
  if constexpr (L == 8) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
    r.w[0] = raw.x, r.w[1] = raw.y, r.w[2] = raw.z, r.w[3] = raw.w;
  } else {
    static_assert(L == 4, "8 or 4 channels per thread");
    const uint2 raw = __ldg(reinterpret_cast<const uint2*>(src));
    r.w[0] = raw.x, r.w[1] = raw.y;
  }
  return r;
}

template <int L>
__device__ __forceinline__ Lanes<L> unpack(const Packed<L>& a) {
  Lanes<L> r;
#pragma unroll
  for (int j = 0; j < L / 2; ++j) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&a.w[j]));
    r.v[2 * j] = f.x;
    r.v[2 * j + 1] = f.y;
  }
  return r;
}

template <int L>
__device__ __forceinline__ Lanes<L> load_bf16(const uint16_t* src) {
  return unpack<L>(load_packed<L>(src));
}

template <int L>
__device__ __forceinline__ void store_bf16(uint16_t* dst, const Lanes<L>& a) {
  uint32_t w[L / 2];
#pragma unroll
  for (int j = 0; j < L / 2; ++j) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a.v[2 * j], a.v[2 * j + 1]);
    w[j] = *reinterpret_cast<const uint32_t*>(&h);
  }
  if constexpr (L == 8)
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  else
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
}

// A slot another GPU wrote: read through L2 (the CTA's L1 may hold nothing of it, but never a stale
// copy either way).
template <int L>
__device__ __forceinline__ Lanes<L> load_landed(const float* src) {
  Lanes<L> r;
#pragma unroll
  for (int q = 0; q < L / 4; ++q) {
    const float4 a = __ldcg(reinterpret_cast<const float4*>(src) + q);
    r.v[4 * q] = a.x, r.v[4 * q + 1] = a.y, r.v[4 * q + 2] = a.z, r.v[4 * q + 3] = a.w;
  }
  return r;
}

template <int L>
__device__ __forceinline__ void store_f32(float* dst, const Lanes<L>& a) {
#pragma unroll
  for (int q = 0; q < L / 4; ++q)
    reinterpret_cast<float4*>(dst)[q] = make_float4(a.v[4 * q], a.v[4 * q + 1], a.v[4 * q + 2], a.v[4 * q + 3]);
}

// The approximate division (2 ulp) instead of the IEEE one, whose range checks cost more issue
// slots than the rest of a token's arithmetic: the kernels issue instructions, not bytes, at
// their limit. Where e^{-z} overflows, the quotient is 0, as sigma(z) rounds to in fp32.
__device__ __forceinline__ float sigmoid(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }

__device__ __forceinline__ float activate(int activation, float z) {
  return activation == LASP_SHORT_CONV_SILU ? z * sigmoid(z) : z;
}

// d act / d z.
__device__ __forceinline__ float activation_slope(int activation, float z) {
  if (activation != LASP_SHORT_CONV_SILU) return 1.f;
  const float s = sigmoid(z);
  return s * (1.f + z * (1.f - s));
}

// The filter of one thread's L channels: w[i] for every tap, and the bias.
template <int K, int L>
struct Filter {
  Lanes<L> w[K];
  Lanes<L> bias;

  __device__ __forceinline__ static Filter load(const lasp_short_conv_params& p, int c0) {
    Filter f;
#pragma unroll
    for (int j = 0; j < L; ++j) {
#pragma unroll
      for (int i = 0; i < K; ++i) f.w[i].v[j] = __ldg(p.weight + (c0 + j) * K + i);
      f.bias.v[j] = p.bias ? __ldg(p.bias + c0 + j) : 0.f;
    }
    return f;
  }

  // z of the token whose K - 1 predecessors are `window` (oldest first) and whose own value is `x`.
  __device__ __forceinline__ Lanes<L> pre_activation(const Lanes<L>* window, const Lanes<L>& x) const {
    Lanes<L> z = bias;
#pragma unroll
    for (int i = 0; i + 1 < K; ++i)
#pragma unroll
      for (int j = 0; j < L; ++j) z.v[j] = fmaf(w[i].v[j], window[i].v[j], z.v[j]);
#pragma unroll
    for (int j = 0; j < L; ++j) z.v[j] = fmaf(w[K - 1].v[j], x.v[j], z.v[j]);
    return z;
  }
};

// The sliding window of the K - 1 tokens before the current one (oldest first): push the current
// one once it has been used.
template <int K, int L>
__device__ __forceinline__ void push(Lanes<L>* window, const Lanes<L>& x) {
#pragma unroll
  for (int i = 0; i + 2 < K; ++i) window[i] = window[i + 1];
  if constexpr (K > 1) window[K - 2] = x;
}

// Whether token t of the shard (t >= -(K - 1)) starts a document. kPacked: the call has
// documents (p.starts); the bodies are instantiated for both, so that a call without documents
// runs the code it ran before documents existed.
template <bool kPacked>
__device__ __forceinline__ bool starts_document(const lasp_short_conv_params& p, int t) {
  if constexpr (!kPacked) return false;
  return __ldg(p.starts + t + p.K - 1) != 0.f;
}

// How far back the window of token t0 (the K - 1 tokens before it, oldest first, window[j] token
// t0 - (K - 1) + j) stays in t0's document, counting the starts before t0 only (the caller's loop
// sees t0's own): clears the entries before the last such start and returns t0 - 1 - (that start),
// K - 1 where there is none within the window.
template <int K, int L, bool kPacked>
__device__ __forceinline__ int clear_before_starts(const lasp_short_conv_params& p, Lanes<L>* window, int t0) {
  int since = K - 1;
  for (int u = t0 - (K - 1) + 1; u < t0; ++u) {
    if (starts_document<kPacked>(p, u)) {
#pragma unroll
      for (int j = 0; j < K - 1; ++j)
        if (t0 - (K - 1) + j < u) window[j] = zero_lanes<L>();
      since = 0;
    } else {
      since = min(since + 1, K - 1);
    }
  }
  return since;
}

// At token t: a start clears the window (no earlier token reads into t's document); returns how
// many tokens before t are t's document's, at most K - 1.
template <int K, int L, bool kPacked>
__device__ __forceinline__ int enter_token(const lasp_short_conv_params& p, Lanes<L>* window, int t, int since) {
  if (!starts_document<kPacked>(p, t)) return min(since + 1, K - 1);
#pragma unroll
  for (int j = 0; j < K - 1; ++j) window[j] = zero_lanes<L>();
  return 0;
}

// Indexing of [B, T, C] tensors and of the [.][B][K-1][C] halo buffers.
__device__ __forceinline__ uint64_t token_index(const lasp_short_conv_params& p, int b, int t, int c) {
  return (static_cast<uint64_t>(b) * p.T + t) * p.C + c;
}
__device__ __forceinline__ uint64_t halo_index(const lasp_short_conv_params& p, int parity, int b, int j, int c) {
  return ((static_cast<uint64_t>(parity) * p.B + b) * (p.K - 1) + j) * p.C + c;
}

__device__ __forceinline__ uint64_t call_epoch(const lasp_halo_exchange& ex) { return *ex.epoch + 1; }

// The signal word of sequence b and this CTA's channel tile (blockIdx.x) at `parity`: one per
// sending CTA, [2][B][channel tiles].
__device__ __forceinline__ uint64_t signal_index(const lasp_short_conv_params& p, int parity, int b) {
  return (static_cast<uint64_t>(parity) * p.B + b) * gridDim.x + blockIdx.x;
}

// The bounded wait for `source`'s put of `epoch` of this CTA's (sequence, channel tile), by thread
// 0; false on every thread of the CTA if it expired (the diagnostics name the source, the signal
// word and the epoch).
__device__ __forceinline__ bool wait_for_source(const lasp_short_conv_params& p, uint64_t epoch, int b) {
  int ok = 1;
  if (threadIdx.x == 0) {
    const lasp_halo_exchange& ex = p.exchange;
    const uint64_t idx = signal_index(p, static_cast<int>(epoch & 1), b);
    const lasp::WaitSite site{ex.diag, ex.timeout_ns, ex.me};
    ok = lasp::wait_signal_ge(site, ex.signal + idx, epoch, ex.source, static_cast<int32_t>(idx), LASP_WAIT_DATA);
  }
  return __syncthreads_and(ok);
}

// The call's first step, by one thread of the grid: this PE has read every slot of epoch - 1 (the
// kernels that did precede this one on the stream), which it tells `source`, whose next puts may
// then reuse them.
__device__ __forceinline__ void credit_source(const lasp_halo_exchange& ex, uint64_t epoch) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && ex.source >= 0) {
    nvshmemx_signal_op(ex.credit, epoch - 1, NVSHMEM_SIGNAL_SET, ex.source);
    nvshmem_quiet();
  }
}

// A sending CTA's step, by all its threads once they have written their channels of `staging`
// (rows [b][j][c_first, c_first + channels)): waits (bounded) for `dest`'s credit for epoch - 2,
// then puts the rows into `dest`'s slots of this epoch's parity and sets the tile's signal to
// `epoch` (put, quiet, signal: the signal follows the data on every transport). False if the wait
// expired: the CTA puts nothing, `dest` then times out on this epoch's data, and this PE's
// diagnostics name `dest`.
__device__ __forceinline__ bool put_tile(const lasp_short_conv_params& p, uint64_t epoch, int b, int c_first,
                                         int channels) {
  const lasp_halo_exchange& ex = p.exchange;
  const int parity = static_cast<int>(epoch & 1);
  // Over InfiniBand the NIC reads the staging block: it must be in memory first. A peer reached by
  // load/store gets its copy from this CTA's threads, after the barrier below.
  if (nvshmem_ptr(ex.staging, ex.dest) == nullptr) __threadfence_system();
  int ok = 1;
  if (threadIdx.x == 0 && epoch > 2) {
    const lasp::WaitSite site{ex.diag, ex.timeout_ns, ex.me};
    ok = lasp::wait_signal_ge(site, ex.credit, epoch - 2, ex.dest, 0, LASP_WAIT_CREDIT);
  }
  if (!__syncthreads_and(ok)) return false;
  for (int j = 0; j < p.K - 1; ++j)
    nvshmemx_putmem_nbi_block(ex.slots + halo_index(p, parity, b, j, c_first),
                              ex.staging + halo_index(p, 0, b, j, c_first), channels * sizeof(float), ex.dest);
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_quiet();  // the rows have landed: the signal may follow
    nvshmemx_signal_op(ex.signal + signal_index(p, parity, b), epoch, NVSHMEM_SIGNAL_SET, ex.dest);
    nvshmem_quiet();
  }
  return true;
}

// ---- Forward ----------------------------------------------------------------------------------

// Channels per thread of the forward (one 16-byte load of bf16 per token).
constexpr int kLanes = LASP_SHORT_CONV_CHANNELS_PER_THREAD;
// The backward's: its thread keeps five times as many running sums, so half the channels keep
// four of its CTAs on an SM.
constexpr int kGradLanes = LASP_SHORT_CONV_GRAD_CHANNELS_PER_THREAD;
// Tokens a thread has in flight: each thread streams its own channels of one token after another
// through a ring of this many slots in shared memory (cp.async, one commit group per token), so
// the loads of the next tokens are in flight while it computes one, without holding registers.
// Only the thread that wrote a slot reads it: no barrier.
constexpr int kStages = 8;

// One thread's ring of kStages tokens of L channels, in a CTA's [kStages][threads] array (the
// threads of a stage side by side: conflict-free).
template <int L>
struct TokenRing {
  Packed<L> (*slots)[LASP_SHORT_CONV_THREADS];
  const uint16_t* row;  // token t of this thread's channels at row + t * C
  int64_t C;
  int t0, t1;           // the tokens fetched; the ring holds t0 + stage slot

  // Starts the copy of token t into its slot (zeros past t1), as one commit group.
  __device__ __forceinline__ void fetch(int t) const {
    const bool valid = t < t1;
    const uint16_t* src = row + static_cast<int64_t>(valid ? t : t0) * C;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(&slots[(t - t0) % kStages][threadIdx.x]));
    if constexpr (L == 8)
      lasp::cp_async_16(dst, src, valid);
    else
      lasp::cp_async_8(dst, src, valid);
  }

  __device__ __forceinline__ void start() const {
    for (int d = 0; d < kStages; ++d) {
      fetch(t0 + d);
      lasp::cp_async_commit();
    }
  }

  // Token t, once its copy has landed (every earlier token's slot has been refilled since).
  __device__ __forceinline__ Packed<L> take(int t) const {
    return slots[(t - t0) % kStages][threadIdx.x];
  }

  // Token t's slot is read (its value used): refill it with token t + kStages.
  __device__ __forceinline__ void refill(int t) const {
    fetch(t + kStages);
    lasp::cp_async_commit();
  }
};

// The CTA's rings: declared in plain functions, so that every kernel size's body shares one
// allocation (a __shared__ array in the templated bodies would be one per instance).
__device__ __forceinline__ Packed<kLanes> (*forward_slots())[LASP_SHORT_CONV_THREADS] {
  __shared__ Packed<kLanes> slots[kStages][LASP_SHORT_CONV_THREADS];
  return slots;
}
__device__ __forceinline__ Packed<kGradLanes> (*backward_x_slots())[LASP_SHORT_CONV_THREADS] {
  __shared__ Packed<kGradLanes> slots[kStages][LASP_SHORT_CONV_THREADS];
  return slots;
}
__device__ __forceinline__ Packed<kGradLanes> (*backward_dy_slots())[LASP_SHORT_CONV_THREADS] {
  __shared__ Packed<kGradLanes> slots[kStages][LASP_SHORT_CONV_THREADS];
  return slots;
}

// The tail this PE sends, for one thread's channels: the last K - 1 tokens of (halo, x), from x
// where the shard is long enough, into `staging`.
template <int K>
__device__ void stage_tail(const lasp_short_conv_params& p, int parity, int b, int c) {
  const lasp_halo_exchange& ex = p.exchange;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int t = p.T - (K - 1) + j;  // relative to this shard; negative: its halo slot T + j
    Lanes<kLanes> v = zero_lanes<kLanes>();
    if (t >= 0)
      v = load_bf16<kLanes>(p.x + token_index(p, b, t, c));
    else if (ex.source >= 0)
      v = load_landed<kLanes>(ex.slots + halo_index(p, parity, b, p.T + j, c));
    store_f32(ex.staging + halo_index(p, 0, b, j, c), v);
  }
}

// What one CTA of either direction works on: sequence b, tokens [t0, t1) of token group `group`,
// channels [c_first, + threads x L) of which this thread's start at c, in the call's epoch (its
// parity picks the halo slots); the call's credit to its halo source is given here. The CTAs
// that wait on the other PE's halo run last: in the forward the first group's (halo_readers_last),
// in the backward the last group's.
struct CtaWork {
  int b, group, t0, t1, c_first, c, parity;
  uint64_t epoch;
};
template <int L>
__device__ __forceinline__ CtaWork cta_work(const lasp_short_conv_params& p, bool halo_readers_last) {
  CtaWork w;
  w.b = blockIdx.y % p.B;
  const int rank = static_cast<int>(blockIdx.y) / p.B;
  w.group = halo_readers_last ? p.groups - 1 - rank : rank;
  const int per_group = (p.T + p.groups - 1) / p.groups;
  w.t0 = w.group * per_group;
  w.t1 = min(p.T, w.t0 + per_group);
  w.epoch = call_epoch(p.exchange);
  w.parity = static_cast<int>(w.epoch & 1);
  credit_source(p.exchange, w.epoch);
  w.c_first = blockIdx.x * blockDim.x * L;
  w.c = w.c_first + threadIdx.x * L;
  return w;
}

// One CTA: LASP_SHORT_CONV_THREADS x 8 channels of one sequence, over one group of tokens.
template <int K, bool kPacked>
__device__ void convolve(const lasp_short_conv_params& p) {
  constexpr int L = kLanes;
  const lasp_halo_exchange& ex = p.exchange;
  const CtaWork w = cta_work<L>(p, /*halo_readers_last=*/true);  // the first tokens' CTAs last
  const int b = w.b, t0 = w.t0, t1 = w.t1, parity = w.parity, c_first = w.c_first, c = w.c;
  const uint64_t epoch = w.epoch;
  const bool remote_halo = K > 1 && t0 < K - 1 && ex.source >= 0;
  const bool sends = K > 1 && t1 == p.T && ex.dest >= 0;
  const bool relays = sends && p.T < K - 1 && ex.source >= 0;  // then one group: it reads too
  if (relays && !wait_for_source(p, epoch, b)) return;
  if (sends) {
    if (c < p.C) stage_tail<K>(p, parity, b, c);
    if (!put_tile(p, epoch, b, c_first, min(p.C - c_first, LASP_SHORT_CONV_THREADS * L))) return;
  }
  if (remote_halo && !relays && !wait_for_source(p, epoch, b)) return;
  if (c >= p.C || t0 >= t1) return;

  const Filter<K, L> filter = Filter<K, L>::load(p, c);
  Lanes<L> window[K > 1 ? K - 1 : 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int t = t0 - (K - 1) + j;
    if (t >= 0)
      window[j] = load_bf16<L>(p.x + token_index(p, b, t, c));
    else
      window[j] = remote_halo ? load_landed<L>(ex.slots + halo_index(p, parity, b, K - 1 + t, c)) : zero_lanes<L>();
  }
  if (p.saved_halo && t0 == 0)
#pragma unroll
    for (int j = 0; j < K - 1; ++j) store_bf16(p.saved_halo + halo_index(p, 0, b, j, c), window[j]);
  int since = clear_before_starts<K, L, kPacked>(p, window, t0);

  const TokenRing<L> ring{forward_slots(), p.x + token_index(p, b, 0, c), p.C, t0, t1};
  ring.start();
  for (int t = t0; t < t1; ++t) {
    lasp::cp_async_wait<kStages - 1>();
    const Lanes<L> x = unpack<L>(ring.take(t));
    since = enter_token<K, L, kPacked>(p, window, t, since);
    Lanes<L> y = filter.pre_activation(window, x);
    ring.refill(t);  // after x's first use: the slot's read has completed
#pragma unroll
    for (int j = 0; j < L; ++j) y.v[j] = activate(p.activation, y.v[j]);
    store_bf16(p.out + token_index(p, b, t, c), y);
    push<K>(window, x);
  }
  lasp::cp_async_wait<0>();  // no copy may land in a CTA that has exited
}

// ---- Backward ---------------------------------------------------------------------------------
// g_s = dy_s act'(z_s) is the pre-activation's gradient; output s read tokens s - K + 1 + i with
// w[i], so dx_t = sum_i w[i] g_{t+K-1-i}, d_weight[i] = sum_s g_s x_{s-K+1+i}, d_bias = sum_s g_s,
// and the halo slot j (token j - (K - 1)) gets sum_{s <= j} w[j - s] g_s. The last K - 1 tokens'
// dx also take the successor's halo gradient, which it put into this PE's slots.

// x of token t (relative to the shard, t >= -(K - 1)): the forward's saved halo before 0.
template <int K, int L>
__device__ __forceinline__ Lanes<L> input_at(const lasp_short_conv_params& p, int b, int t, int c) {
  if (t >= 0) return load_bf16<L>(p.x + token_index(p, b, t, c));
  return p.halo ? load_bf16<L>(p.halo + halo_index(p, 0, b, K - 1 + t, c)) : zero_lanes<L>();
}

// g of the output whose input window is (`window`, `x`) and whose output gradient is `dy`.
template <int K, int L>
__device__ __forceinline__ Lanes<L> pre_activation_grad(const lasp_short_conv_params& p, const Filter<K, L>& filter,
                                                        const Lanes<L>* window, const Lanes<L>& x, Lanes<L> dy) {
  const Lanes<L> z = filter.pre_activation(window, x);
#pragma unroll
  for (int j = 0; j < L; ++j) dy.v[j] *= activation_slope(p.activation, z.v[j]);
  return dy;
}

// This shard's halo gradient for one thread's channels, into `staging`: sum_{s <= j} w[j - s] g_s
// for slot j, plus, where the shard relays, the successor's halo gradient for the slots before it.
template <int K, bool kPacked>
__device__ void stage_halo_grad(const lasp_short_conv_params& p, int parity, int b, int c, bool relays) {
  constexpr int L = kGradLanes;
  const lasp_halo_exchange& ex = p.exchange;
  const Filter<K, L> filter = Filter<K, L>::load(p, c);
  Lanes<L> window[K > 1 ? K - 1 : 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) window[j] = input_at<K, L>(p, b, j - (K - 1), c);
  int since = clear_before_starts<K, L, kPacked>(p, window, 0);
  Lanes<L> d_halo[K > 1 ? K - 1 : 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) d_halo[j] = zero_lanes<L>();
#pragma unroll
  for (int s = 0; s < K - 1; ++s) {
    if (s >= p.T) break;
    const Lanes<L> x = load_bf16<L>(p.x + token_index(p, b, s, c));
    const Lanes<L> dy = load_bf16<L>(p.dy + token_index(p, b, s, c));
    since = enter_token<K, L, kPacked>(p, window, s, since);
    const Lanes<L> g = pre_activation_grad<K, L>(p, filter, window, x, dy);
    // Slot j (token j - (K - 1)) is tap j - s of output s: in s's document where j - s >= K - 1 -
    // since.
#pragma unroll
    for (int j = s; j < K - 1; ++j)
      if (j - s >= K - 1 - since)
#pragma unroll
        for (int l = 0; l < L; ++l) d_halo[j].v[l] = fmaf(filter.w[j - s].v[l], g.v[l], d_halo[j].v[l]);
    push<K>(window, x);
  }
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    // The successor's halo gradient for slot j - T (token j - (K - 1), before this shard).
    if (relays && j >= p.T) {
      const Lanes<L> in = load_landed<L>(ex.slots + halo_index(p, parity, b, j - p.T, c));
#pragma unroll
      for (int l = 0; l < L; ++l) d_halo[j].v[l] += in.v[l];
    }
    store_f32(ex.staging + halo_index(p, 0, b, j, c), d_halo[j]);
  }
}

// One CTA: LASP_SHORT_CONV_THREADS x 4 channels of one sequence, over one group of tokens; dx of
// its tokens and its sums of d_weight and d_bias in `partials`.
template <int K, bool kPacked>
__device__ void convolve_grad(const lasp_short_conv_params& p) {
  constexpr int L = kGradLanes;
  const lasp_halo_exchange& ex = p.exchange;
  const CtaWork w = cta_work<L>(p, /*halo_readers_last=*/false);  // the last tokens' CTAs last
  const int b = w.b, t0 = w.t0, t1 = w.t1, parity = w.parity, c_first = w.c_first, c = w.c;
  const int group = w.group;
  const uint64_t epoch = w.epoch;
  const int tail = p.T - (K - 1);  // the first token whose dx takes the successor's halo gradient
  const bool remote_grad = K > 1 && t1 > tail && ex.source >= 0;
  const bool sends = K > 1 && group == 0 && ex.dest >= 0;
  const bool relays = sends && p.T < K - 1 && ex.source >= 0;  // then one group: it reads too
  if (relays && !wait_for_source(p, epoch, b)) return;
  if (sends) {
    if (c < p.C) stage_halo_grad<K, kPacked>(p, parity, b, c, relays);
    if (!put_tile(p, epoch, b, c_first, min(p.C - c_first, LASP_SHORT_CONV_THREADS * L))) return;
  }
  if (remote_grad && !relays && !wait_for_source(p, epoch, b)) return;
  if (c >= p.C) return;

  const Filter<K, L> filter = Filter<K, L>::load(p, c);
  Lanes<L> window[K > 1 ? K - 1 : 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) window[j] = input_at<K, L>(p, b, t0 - (K - 1) + j, c);
  int since = clear_before_starts<K, L, kPacked>(p, window, t0);
  // pending[i]: dx of token s - (K - 1) + i so far; token s - (K - 1) is complete after output s.
  Lanes<L> pending[K];
#pragma unroll
  for (int i = 0; i < K; ++i) pending[i] = zero_lanes<L>();
  Lanes<L> d_weight[K], d_bias = zero_lanes<L>();
#pragma unroll
  for (int i = 0; i < K; ++i) d_weight[i] = zero_lanes<L>();

  // Outputs s in [t0, t1 + K - 1): those past t1 only complete the dx of this group's last tokens.
  const int s_end = t1 + K - 1, loaded_end = min(s_end, p.T);
  const TokenRing<L> xs{backward_x_slots(), p.x + token_index(p, b, 0, c), p.C, t0, loaded_end};
  const TokenRing<L> dys{backward_dy_slots(), p.dy + token_index(p, b, 0, c), p.C, t0, loaded_end};
  for (int d = 0; d < kStages; ++d) {
    xs.fetch(t0 + d);
    dys.fetch(t0 + d);
    lasp::cp_async_commit();
  }
  for (int s = t0; s < s_end; ++s) {
#pragma unroll
    for (int i = 0; i + 1 < K; ++i) pending[i] = pending[i + 1];
    pending[K - 1] = zero_lanes<L>();
    if (s < p.T) {
      lasp::cp_async_wait<kStages - 1>();
      const Lanes<L> x = unpack<L>(xs.take(s)), dy = unpack<L>(dys.take(s));
      since = enter_token<K, L, kPacked>(p, window, s, since);
      const Lanes<L> g = pre_activation_grad<K, L>(p, filter, window, x, dy);
      // After x's and dy's first use: the slots' reads have completed.
      xs.fetch(s + kStages);
      dys.fetch(s + kStages);
      lasp::cp_async_commit();
      // Tap i reads token s - (K - 1) + i: in s's document where i >= K - 1 - since.
#pragma unroll
      for (int i = 0; i < K; ++i)
        if (i >= K - 1 - since)
#pragma unroll
          for (int l = 0; l < L; ++l) pending[i].v[l] = fmaf(filter.w[i].v[l], g.v[l], pending[i].v[l]);
      if (s < t1) {
#pragma unroll
        for (int l = 0; l < L; ++l) {
#pragma unroll
          for (int i = 0; i + 1 < K; ++i) d_weight[i].v[l] = fmaf(g.v[l], window[i].v[l], d_weight[i].v[l]);
          d_weight[K - 1].v[l] = fmaf(g.v[l], x.v[l], d_weight[K - 1].v[l]);
          d_bias.v[l] += g.v[l];
        }
      }
      push<K>(window, x);
    }
    const int t = s - (K - 1);
    if (t < t0) continue;
    Lanes<L> dx = pending[0];
    if (remote_grad && t >= tail) {
      const Lanes<L> in = load_landed<L>(ex.slots + halo_index(p, parity, b, t - tail, c));
#pragma unroll
      for (int l = 0; l < L; ++l) dx.v[l] += in.v[l];
    }
    store_bf16(p.out + token_index(p, b, t, c), dx);
  }
  lasp::cp_async_wait<0>();  // no copy may land in a CTA that has exited

  float* const sums = p.partials + ((static_cast<uint64_t>(b) * p.groups + group) * p.C + c) * (K + 1);
#pragma unroll
  for (int l = 0; l < L; ++l) {
#pragma unroll
    for (int i = 0; i < K; ++i) sums[l * (K + 1) + i] = d_weight[i].v[l];
    sums[l * (K + 1) + K] = d_bias.v[l];
  }
}

// Dispatches on the kernel size (each size is its own fully unrolled body).
template <template <int> class Body>
__device__ __forceinline__ void with_kernel_size(const lasp_short_conv_params& p) {
  switch (p.K) {
    case 1: Body<1>::run(p); break;
    case 2: Body<2>::run(p); break;
    case 3: Body<3>::run(p); break;
    case 4: Body<4>::run(p); break;
    default: break;  // the host accepts 1 .. LASP_SHORT_CONV_MAX_K only
  }
}

template <int K> struct Convolve {
  static __device__ void run(const lasp_short_conv_params& p) {
    if (p.starts)
      convolve<K, true>(p);
    else
      convolve<K, false>(p);
  }
};
template <int K> struct ConvolveGrad {
  static __device__ void run(const lasp_short_conv_params& p) {
    if (p.starts)
      convolve_grad<K, true>(p);
    else
      convolve_grad<K, false>(p);
  }
};

}  // namespace

// grid (ceil(C / (8 x LASP_SHORT_CONV_THREADS)), groups x B), block (LASP_SHORT_CONV_THREADS).
extern "C" __global__ void __launch_bounds__(LASP_SHORT_CONV_THREADS)
    lasp_short_conv_forward(const __grid_constant__ lasp_short_conv_params p) {
  with_kernel_size<Convolve>(p);
}

// grid (ceil(C / (4 x LASP_SHORT_CONV_THREADS)), groups x B), block (LASP_SHORT_CONV_THREADS).
extern "C" __global__ void __launch_bounds__(LASP_SHORT_CONV_THREADS)
    lasp_short_conv_backward(const __grid_constant__ lasp_short_conv_params p) {
  with_kernel_size<ConvolveGrad>(p);
}

// d_weight[c][i] and d_bias[c]: every CTA's sums in (b, group) order, so repeated calls give the
// same bits. One thread per (c, i) of [C][K + 1]; grid (ceil(C (K + 1) / 256)), block (256).
extern "C" __global__ void __launch_bounds__(256)
    lasp_short_conv_reduce_params(const __grid_constant__ lasp_short_conv_params p) {
  const int stride = p.C * (p.K + 1);
  const int f = blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= stride) return;
  float sum = 0.f;
  const int rows = p.B * p.groups;
  for (int r = 0; r < rows; ++r) sum += p.partials[static_cast<uint64_t>(r) * stride + f];
  const int c = f / (p.K + 1), i = f % (p.K + 1);
  if (i < p.K)
    p.d_weight[c * p.K + i] = sum;
  else if (p.d_bias)
    p.d_bias[c] = sum;
}

// Launched last in every call: the call's epoch is complete on this PE. grid (1), block (1).
extern "C" __global__ void lasp_short_conv_advance(const __grid_constant__ lasp_short_conv_params p) {
  *p.exchange.epoch += 1;
}
