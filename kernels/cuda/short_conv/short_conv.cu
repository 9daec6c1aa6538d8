// The short causal depthwise convolution (fla's ShortConvolution) on LASP-2 shards, forward and
// backward, with its halo exchanged from the device (lasp/short_conv/short_conv_params.h).
//
//   y_t = act(z_t),  z_t = bias + sum_{i<K} w[i] x_{t-K+1+i}   (per channel; x before token 0 of
//   the whole sequence is zero, and before token 0 of a shard it is the halo: the K - 1 tokens
//   before it, which belong to the PEs before it)
//
// A call's kernels, in stream order:
//   forward:  send_halo (the shard's last K - 1 tokens to the next PE), convolve, advance
//   backward: send_halo_grad (the gradient of this shard's halo to the PE before), convolve_grad,
//             reduce_params (d_weight, d_bias in a fixed order), advance
// The convolution CTAs that read what another PE put (the first tokens in the forward, the last
// in the backward) wait for its signal, bounded; their grid positions come last, so every other
// CTA has been placed before any of them waits. A shard shorter than K - 1 relays: its tail then
// includes part of its own halo, so its send waits for that halo first.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>
#include <stdint.h>

#include "lasp/short_conv/short_conv_params.h"
#include "lasp/wait.cuh"

namespace {

constexpr int kLanes = LASP_SHORT_CONV_CHANNELS_PER_THREAD;

// Eight consecutive channels of one token, in fp32.
struct Lanes {
  float v[kLanes];
};

__device__ __forceinline__ Lanes zero_lanes() {
  Lanes r;
#pragma unroll
  for (int j = 0; j < kLanes; ++j) r.v[j] = 0.f;
  return r;
}

__device__ __forceinline__ Lanes load_bf16(const uint16_t* src) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src));
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  Lanes r;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
    r.v[2 * j] = f.x;
    r.v[2 * j + 1] = f.y;
  }
  return r;
}

__device__ __forceinline__ void store_bf16(uint16_t* dst, const Lanes& a) {
  uint32_t words[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a.v[2 * j], a.v[2 * j + 1]);
    words[j] = *reinterpret_cast<const uint32_t*>(&h);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
}

// A slot another GPU wrote: read through L2 (the CTA's L1 may hold nothing of it, but never a stale
// copy either way).
__device__ __forceinline__ Lanes load_landed(const float* src) {
  const float4 a = __ldcg(reinterpret_cast<const float4*>(src));
  const float4 b = __ldcg(reinterpret_cast<const float4*>(src) + 1);
  return {{a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}};
}

__device__ __forceinline__ void store_f32(float* dst, const Lanes& a) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(a.v[0], a.v[1], a.v[2], a.v[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(a.v[4], a.v[5], a.v[6], a.v[7]);
}

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + __expf(-z)); }

__device__ __forceinline__ float activate(int activation, float z) {
  return activation == LASP_SHORT_CONV_SILU ? z * sigmoid(z) : z;
}

// d act / d z.
__device__ __forceinline__ float activation_slope(int activation, float z) {
  if (activation != LASP_SHORT_CONV_SILU) return 1.f;
  const float s = sigmoid(z);
  return s * (1.f + z * (1.f - s));
}

// The filter of one thread's channels: w[i] for every tap, and the bias.
template <int K>
struct Filter {
  Lanes w[K];
  Lanes bias;

  __device__ __forceinline__ static Filter load(const lasp_short_conv_params& p, int c0) {
    Filter f;
#pragma unroll
    for (int j = 0; j < kLanes; ++j) {
#pragma unroll
      for (int i = 0; i < K; ++i) f.w[i].v[j] = __ldg(p.weight + (c0 + j) * K + i);
      f.bias.v[j] = p.bias ? __ldg(p.bias + c0 + j) : 0.f;
    }
    return f;
  }

  // z of the token whose K - 1 predecessors are `window` (oldest first) and whose own value is `x`.
  __device__ __forceinline__ Lanes pre_activation(const Lanes* window, const Lanes& x) const {
    Lanes z = bias;
#pragma unroll
    for (int i = 0; i + 1 < K; ++i)
#pragma unroll
      for (int j = 0; j < kLanes; ++j) z.v[j] = fmaf(w[i].v[j], window[i].v[j], z.v[j]);
#pragma unroll
    for (int j = 0; j < kLanes; ++j) z.v[j] = fmaf(w[K - 1].v[j], x.v[j], z.v[j]);
    return z;
  }
};

// Indexing of [B, T, C] tensors and of the [.][B][K-1][C] halo buffers.
__device__ __forceinline__ uint64_t token_index(const lasp_short_conv_params& p, int b, int t, int c) {
  return (static_cast<uint64_t>(b) * p.T + t) * p.C + c;
}
__device__ __forceinline__ uint64_t halo_index(const lasp_short_conv_params& p, int parity, int b, int j, int c) {
  return ((static_cast<uint64_t>(parity) * p.B + b) * (p.K - 1) + j) * p.C + c;
}

__device__ __forceinline__ uint64_t call_epoch(const lasp_halo_exchange& ex) { return *ex.epoch + 1; }

// The bounded wait for `source`'s put of `epoch` into this PE's slots, by thread 0; false on every
// thread of the CTA if it expired (the diagnostics name the source, the parity and the epoch).
__device__ __forceinline__ bool wait_for_source(const lasp_halo_exchange& ex, uint64_t epoch) {
  int ok = 1;
  if (threadIdx.x == 0) {
    const int parity = static_cast<int>(epoch & 1);
    const lasp::WaitSite site{ex.diag, ex.timeout_ns, ex.me};
    ok = lasp::wait_signal_ge(site, ex.signal + parity, epoch, ex.source, parity, LASP_WAIT_DATA);
  }
  return __syncthreads_and(ok);
}

// The halo kernels' first step: this PE has read every slot of epoch - 1 (the kernels that did
// precede this one on the stream), which it tells `source`, whose next put may then reuse them.
__device__ __forceinline__ void credit_source(const lasp_halo_exchange& ex, uint64_t epoch) {
  if (threadIdx.x == 0 && ex.source >= 0)
    nvshmemx_signal_op(ex.credit, epoch - 1, NVSHMEM_SIGNAL_SET, ex.source);
}

// The halo kernels' last step, by the whole CTA once `staging` is written: waits (bounded) for
// `dest`'s credit for epoch - 2, then puts the staging block into `dest`'s slots of this epoch's
// parity with their signal set to `epoch`. A CTA whose wait expired puts nothing: `dest` then times
// out on this epoch's data while this PE's diagnostics name `dest`.
__device__ __forceinline__ void put_to_dest(const lasp_short_conv_params& p, uint64_t epoch) {
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
  if (!__syncthreads_and(ok)) return;
  const uint64_t floats = static_cast<uint64_t>(p.B) * (p.K - 1) * p.C;
  nvshmemx_putmem_signal_block(ex.slots + parity * floats, ex.staging, floats * sizeof(float), ex.signal + parity,
                               epoch, NVSHMEM_SIGNAL_SET, ex.dest);
  if (threadIdx.x == 0) nvshmem_quiet();
}

// ---- Forward ----------------------------------------------------------------------------------

// The tail this PE sends: the last K - 1 tokens of (halo, x), from x where the shard is long enough.
template <int K>
__device__ void send_halo(const lasp_short_conv_params& p) {
  const lasp_halo_exchange& ex = p.exchange;
  const uint64_t epoch = call_epoch(ex);
  credit_source(ex, epoch);
  if (K == 1 || ex.dest < 0) {
    if (threadIdx.x == 0) nvshmem_quiet();
    return;
  }
  const int parity = static_cast<int>(epoch & 1);
  const bool relays = p.T < K - 1 && ex.source >= 0;
  if (relays && !wait_for_source(ex, epoch)) return;
  const int groups_of_channels = p.C / kLanes;
  for (int item = threadIdx.x; item < p.B * groups_of_channels; item += blockDim.x) {
    const int b = item / groups_of_channels, c = item % groups_of_channels * kLanes;
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      const int t = p.T - (K - 1) + j;  // relative to this shard; negative: its halo slot T + j
      Lanes v = zero_lanes();
      if (t >= 0)
        v = load_bf16(p.x + token_index(p, b, t, c));
      else if (ex.source >= 0)
        v = load_landed(ex.slots + halo_index(p, parity, b, p.T + j, c));
      store_f32(ex.staging + halo_index(p, 0, b, j, c), v);
    }
  }
  put_to_dest(p, epoch);
}

// One CTA: LASP_SHORT_CONV_THREADS x 8 channels of one sequence, over one group of tokens.
template <int K>
__device__ void convolve(const lasp_short_conv_params& p) {
  const lasp_halo_exchange& ex = p.exchange;
  const int b = blockIdx.y % p.B;
  const int group = p.groups - 1 - static_cast<int>(blockIdx.y) / p.B;  // the halo's readers last
  const int per_group = (p.T + p.groups - 1) / p.groups;
  const int t0 = group * per_group, t1 = min(p.T, t0 + per_group);
  const uint64_t epoch = call_epoch(ex);
  const int parity = static_cast<int>(epoch & 1);
  const bool remote_halo = K > 1 && t0 < K - 1 && ex.source >= 0;
  if (remote_halo && !wait_for_source(ex, epoch)) return;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * kLanes;
  if (c >= p.C || t0 >= t1) return;

  const Filter<K> filter = Filter<K>::load(p, c);
  Lanes window[K > 1 ? K - 1 : 1];  // x of the K - 1 tokens before the current one, oldest first
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int t = t0 - (K - 1) + j;
    if (t >= 0)
      window[j] = load_bf16(p.x + token_index(p, b, t, c));
    else
      window[j] = remote_halo ? load_landed(ex.slots + halo_index(p, parity, b, K - 1 + t, c)) : zero_lanes();
  }
  if (p.saved_halo && t0 == 0)
#pragma unroll
    for (int j = 0; j < K - 1; ++j) store_bf16(p.saved_halo + halo_index(p, 0, b, j, c), window[j]);

#pragma unroll 4
  for (int t = t0; t < t1; ++t) {
    const Lanes x = load_bf16(p.x + token_index(p, b, t, c));
    Lanes y = filter.pre_activation(window, x);
#pragma unroll
    for (int j = 0; j < kLanes; ++j) y.v[j] = activate(p.activation, y.v[j]);
    store_bf16(p.out + token_index(p, b, t, c), y);
#pragma unroll
    for (int i = 0; i + 2 < K; ++i) window[i] = window[i + 1];
    if (K > 1) window[K > 1 ? K - 2 : 0] = x;
  }
}

// ---- Backward ---------------------------------------------------------------------------------
// g_s = dy_s act'(z_s) is the pre-activation's gradient; output s read tokens s - K + 1 + i with
// w[i], so dx_t = sum_i w[i] g_{t+K-1-i}, d_weight[i] = sum_s g_s x_{s-K+1+i}, d_bias = sum_s g_s,
// and the halo slot j (token j - (K - 1)) gets sum_{s <= j} w[j - s] g_s. The last K - 1 tokens'
// dx also take the successor's halo gradient, which it put into this PE's slots.

// x of token t (relative to the shard, t >= -(K - 1)): the forward's saved halo before 0.
template <int K>
__device__ __forceinline__ Lanes input_at(const lasp_short_conv_params& p, int b, int t, int c) {
  if (t >= 0) return load_bf16(p.x + token_index(p, b, t, c));
  return p.halo ? load_bf16(p.halo + halo_index(p, 0, b, K - 1 + t, c)) : zero_lanes();
}

// g of output s.
template <int K>
__device__ __forceinline__ Lanes pre_activation_grad(const lasp_short_conv_params& p, const Filter<K>& filter,
                                                     const Lanes* window, const Lanes& x, int b, int s, int c) {
  const Lanes z = filter.pre_activation(window, x);
  Lanes g = load_bf16(p.dy + token_index(p, b, s, c));
#pragma unroll
  for (int j = 0; j < kLanes; ++j) g.v[j] *= activation_slope(p.activation, z.v[j]);
  return g;
}

template <int K>
__device__ void send_halo_grad(const lasp_short_conv_params& p) {
  const lasp_halo_exchange& ex = p.exchange;
  const uint64_t epoch = call_epoch(ex);
  credit_source(ex, epoch);
  if (K == 1 || ex.dest < 0) {
    if (threadIdx.x == 0) nvshmem_quiet();
    return;
  }
  const int parity = static_cast<int>(epoch & 1);
  const bool relays = p.T < K - 1 && ex.source >= 0;
  if (relays && !wait_for_source(ex, epoch)) return;
  const int groups_of_channels = p.C / kLanes;
  for (int item = threadIdx.x; item < p.B * groups_of_channels; item += blockDim.x) {
    const int b = item / groups_of_channels, c = item % groups_of_channels * kLanes;
    const Filter<K> filter = Filter<K>::load(p, c);
    Lanes window[K > 1 ? K - 1 : 1];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) window[j] = input_at<K>(p, b, j - (K - 1), c);
    Lanes d_halo[K > 1 ? K - 1 : 1];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) d_halo[j] = zero_lanes();
#pragma unroll
    for (int s = 0; s < K - 1; ++s) {
      if (s >= p.T) break;
      const Lanes x = load_bf16(p.x + token_index(p, b, s, c));
      const Lanes g = pre_activation_grad<K>(p, filter, window, x, b, s, c);
#pragma unroll
      for (int j = s; j < K - 1; ++j)
#pragma unroll
        for (int l = 0; l < kLanes; ++l) d_halo[j].v[l] = fmaf(filter.w[j - s].v[l], g.v[l], d_halo[j].v[l]);
#pragma unroll
      for (int i = 0; i + 2 < K; ++i) window[i] = window[i + 1];
      window[K > 1 ? K - 2 : 0] = x;
    }
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      // The successor's halo gradient for slot j - T (token j - (K - 1), before this shard).
      if (relays && j >= p.T) {
        const Lanes in = load_landed(ex.slots + halo_index(p, parity, b, j - p.T, c));
#pragma unroll
        for (int l = 0; l < kLanes; ++l) d_halo[j].v[l] += in.v[l];
      }
      store_f32(ex.staging + halo_index(p, 0, b, j, c), d_halo[j]);
    }
  }
  put_to_dest(p, epoch);
}

// One CTA: LASP_SHORT_CONV_THREADS x 8 channels of one sequence, over one group of tokens; dx of
// its tokens and its sums of d_weight and d_bias in `partials`.
template <int K>
__device__ void convolve_grad(const lasp_short_conv_params& p) {
  const lasp_halo_exchange& ex = p.exchange;
  const int b = blockIdx.y % p.B;
  const int group = static_cast<int>(blockIdx.y) / p.B;  // the last tokens, which wait, last
  const int per_group = (p.T + p.groups - 1) / p.groups;
  const int t0 = group * per_group, t1 = min(p.T, t0 + per_group);
  const uint64_t epoch = call_epoch(ex);
  const int parity = static_cast<int>(epoch & 1);
  const int tail = p.T - (K - 1);  // the first token whose dx takes the successor's halo gradient
  const bool remote_grad = K > 1 && t1 > tail && ex.source >= 0;
  if (remote_grad && !wait_for_source(ex, epoch)) return;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * kLanes;
  if (c >= p.C) return;

  const Filter<K> filter = Filter<K>::load(p, c);
  Lanes window[K > 1 ? K - 1 : 1];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) window[j] = input_at<K>(p, b, t0 - (K - 1) + j, c);
  // pending[i]: dx of token s - (K - 1) + i so far; token s - (K - 1) is complete after output s.
  Lanes pending[K];
#pragma unroll
  for (int i = 0; i < K; ++i) pending[i] = zero_lanes();
  Lanes d_weight[K], d_bias = zero_lanes();
#pragma unroll
  for (int i = 0; i < K; ++i) d_weight[i] = zero_lanes();

  for (int s = t0; s < t1 + K - 1; ++s) {
#pragma unroll
    for (int i = 0; i + 1 < K; ++i) pending[i] = pending[i + 1];
    pending[K - 1] = zero_lanes();
    if (s < p.T) {
      const Lanes x = load_bf16(p.x + token_index(p, b, s, c));
      const Lanes g = pre_activation_grad<K>(p, filter, window, x, b, s, c);
#pragma unroll
      for (int i = 0; i < K; ++i)
#pragma unroll
        for (int l = 0; l < kLanes; ++l) pending[i].v[l] = fmaf(filter.w[i].v[l], g.v[l], pending[i].v[l]);
      if (s < t1) {
#pragma unroll
        for (int l = 0; l < kLanes; ++l) {
#pragma unroll
          for (int i = 0; i + 1 < K; ++i) d_weight[i].v[l] = fmaf(g.v[l], window[i].v[l], d_weight[i].v[l]);
          d_weight[K - 1].v[l] = fmaf(g.v[l], x.v[l], d_weight[K - 1].v[l]);
          d_bias.v[l] += g.v[l];
        }
      }
#pragma unroll
      for (int i = 0; i + 2 < K; ++i) window[i] = window[i + 1];
      if (K > 1) window[K > 1 ? K - 2 : 0] = x;
    }
    const int t = s - (K - 1);
    if (t < t0) continue;
    Lanes dx = pending[0];
    if (remote_grad && t >= tail) {
      const Lanes in = load_landed(ex.slots + halo_index(p, parity, b, t - tail, c));
#pragma unroll
      for (int l = 0; l < kLanes; ++l) dx.v[l] += in.v[l];
    }
    store_bf16(p.out + token_index(p, b, t, c), dx);
  }

  float* const sums = p.partials + ((static_cast<uint64_t>(b) * p.groups + group) * p.C + c) * (K + 1);
#pragma unroll
  for (int l = 0; l < kLanes; ++l) {
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

template <int K> struct SendHalo { static __device__ void run(const lasp_short_conv_params& p) { send_halo<K>(p); } };
template <int K> struct Convolve { static __device__ void run(const lasp_short_conv_params& p) { convolve<K>(p); } };
template <int K> struct SendHaloGrad { static __device__ void run(const lasp_short_conv_params& p) { send_halo_grad<K>(p); } };
template <int K> struct ConvolveGrad { static __device__ void run(const lasp_short_conv_params& p) { convolve_grad<K>(p); } };

}  // namespace

// grid (1), block (LASP_SHORT_CONV_SEND_THREADS).
extern "C" __global__ void __launch_bounds__(LASP_SHORT_CONV_SEND_THREADS)
    lasp_short_conv_send_halo(const __grid_constant__ lasp_short_conv_params p) {
  with_kernel_size<SendHalo>(p);
}

// grid (ceil(C / (8 x LASP_SHORT_CONV_THREADS)), groups x B), block (LASP_SHORT_CONV_THREADS).
extern "C" __global__ void __launch_bounds__(LASP_SHORT_CONV_THREADS)
    lasp_short_conv_forward(const __grid_constant__ lasp_short_conv_params p) {
  with_kernel_size<Convolve>(p);
}

// grid (1), block (LASP_SHORT_CONV_SEND_THREADS).
extern "C" __global__ void __launch_bounds__(LASP_SHORT_CONV_SEND_THREADS)
    lasp_short_conv_send_halo_grad(const __grid_constant__ lasp_short_conv_params p) {
  with_kernel_size<SendHaloGrad>(p);
}

// grid (ceil(C / (8 x LASP_SHORT_CONV_THREADS)), groups x B), block (LASP_SHORT_CONV_THREADS).
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
