// Device-initiated all-gather and ping-pong over NVSHMEM.
//
// Every transfer goes through NVSHMEM's put / signal API, so the same code runs over NVLink (the
// put is a copy by the calling threads into the peer's mapped heap) and over InfiniBand (the put
// is posted to the proxy or to the NIC). Signals are 64-bit epochs that never wrap: one word per
// (source PE, parity slot), set with NVSHMEM_SIGNAL_SET and waited on with >=.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "lasp/exchange_params.h"
#include "lasp/wait.cuh"

namespace {

// Byte range [begin, end) of a buffer that CTA `cta` of `ctas` moves, in 16-byte units so every
// copy is vectorised.
struct Slice {
  uint64_t begin, end;
};
__device__ __forceinline__ Slice cta_slice(uint64_t bytes, uint32_t cta, uint32_t ctas) {
  const uint64_t units = bytes / 16;
  const uint64_t per_cta = (units + ctas - 1) / ctas;
  const uint64_t begin = min(units, per_cta * cta);
  const uint64_t end = min(units, begin + per_cta);
  return {begin * 16, end * 16};
}

__device__ __forceinline__ uint32_t pattern_word(int32_t source, uint64_t epoch, uint64_t index) {
  // A 32-bit finaliser (murmur3) over the three coordinates: cheap, and any two of them differing
  // changes the word.
  uint32_t h = static_cast<uint32_t>(source) * 0x9E3779B1u ^ static_cast<uint32_t>(epoch) * 0x85EBCA77u ^
               static_cast<uint32_t>(epoch >> 32) * 0x27D4EB2Fu ^ static_cast<uint32_t>(index) * 0xC2B2AE3Du;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

}  // namespace

// One round of the all-gather. Roles inside the grid:
//  - every CTA copies its slice of `src` into slot [parity][me] of every other PE, once the reader
//    of that slot has returned its credit for the round two epochs back (in place: slot
//    [parity][me] of this PE is not written, its data stays in `src`);
//  - the last CTA to finish its puts signals every PE, then waits for every PE's signal and
//    publishes the new epoch.
// Launch with at most as many CTAs as fit on the device at once (the host plans <= 64).
extern "C" __global__ void __launch_bounds__(512) lasp_allgather(const __grid_constant__ lasp_allgather_params p) {
  const uint64_t epoch = *p.epoch + 1;
  const int parity = static_cast<int>(epoch & 1);
  const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
  __shared__ int peer_ready;
  __shared__ int is_last_cta;

  // Whatever consumed epochs < `epoch` on this PE ran before this launch (stream order), so every
  // source may now reuse the slots this PE reads.
  if (blockIdx.x == 0) {
    for (int pe = threadIdx.x; pe < p.npes; pe += blockDim.x)
      nvshmemx_signal_op(p.credit + p.me, epoch - 1, NVSHMEM_SIGNAL_SET, pe);
  }

  // The slots this round overwrites were last read at epoch - 2: wait for every reader's credit
  // for it, all peers in parallel (one thread each), before the first put.
  if (threadIdx.x == 0) peer_ready = 1;
  __syncthreads();
  if (epoch > 2) {
    for (int pe = threadIdx.x; pe < p.npes; pe += blockDim.x)
      if (pe != p.me && !lasp::wait_signal_ge(site, p.credit + pe, epoch - 2, pe, pe, LASP_WAIT_CREDIT))
        peer_ready = 0;
    __syncthreads();
  }

  const Slice slice = cta_slice(p.bytes, blockIdx.x, gridDim.x);
  uint8_t* const my_slot = p.slots + (static_cast<uint64_t>(parity) * p.npes + p.me) * p.bytes;
  // In place: this PE's own contribution stays in `src`, only the peers' copies move. Each CTA
  // starts at a different peer so every link is busy from the first byte.
  for (int k = 0; k < p.npes - 1 && peer_ready && slice.end > slice.begin; ++k) {
    const int pe = (p.me + 1 + (blockIdx.x + k) % (p.npes - 1)) % p.npes;
    nvshmemx_putmem_nbi_block(my_slot + slice.begin, p.src + slice.begin, slice.end - slice.begin, pe);
  }

  // Completion of this CTA's puts, then count it in. The fences make the puts visible before the
  // counter, and so before the last CTA's signals (fences are cumulative).
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_quiet();
    __threadfence_system();
    is_last_cta = atomicAdd(p.arrived, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_cta) return;

  if (threadIdx.x == 0) {
    *p.arrived = 0;
    __threadfence_system();
  }
  __syncthreads();
  // A CTA that gave up on a credit skipped its puts: signalling would hand peers torn data, so
  // they are left to time out on this epoch instead, naming this PE.
  const bool complete = *(volatile uint32_t*)&p.diag->failed == 0;
  if (complete) {
    for (int pe = threadIdx.x; pe < p.npes; pe += blockDim.x)
      if (pe != p.me) nvshmemx_signal_op(p.data_signal + parity * p.npes + p.me, epoch, NVSHMEM_SIGNAL_SET, pe);
  }
  __shared__ int all_arrived;
  if (threadIdx.x == 0) all_arrived = complete;
  __syncthreads();
  for (int source = threadIdx.x; source < p.npes && complete; source += blockDim.x) {
    if (source == p.me) continue;
    const int slot = parity * p.npes + source;
    if (!lasp::wait_signal_ge(site, p.data_signal + slot, epoch, source, slot, LASP_WAIT_DATA))
      all_arrived = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0 && all_arrived) *p.epoch = epoch;
}

// Writes this PE's contribution for the next epoch.
extern "C" __global__ void lasp_allgather_fill(const __grid_constant__ lasp_allgather_pattern_params p) {
  const uint64_t epoch = *p.epoch + 1;
  uint32_t* const words = reinterpret_cast<uint32_t*>(p.src);
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.bytes / 4; i += gridDim.x * blockDim.x)
    words[i] = pattern_word(p.me, epoch, i);
}

// Counts words of the last completed epoch's slots that differ from what their source wrote.
extern "C" __global__ void lasp_allgather_check(const __grid_constant__ lasp_allgather_pattern_params p) {
  const uint64_t epoch = *p.epoch;
  const uint64_t parity = epoch & 1;
  const uint64_t words_per_pe = p.bytes / 4;
  const uint32_t* const slots = reinterpret_cast<const uint32_t*>(p.slots) + parity * p.npes * words_per_pe;
  unsigned long long bad = 0;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < p.npes * words_per_pe; i += gridDim.x * blockDim.x) {
    const int32_t source = static_cast<int32_t>(i / words_per_pe);
    if (source == p.me) continue;  // in place: this PE's data is in `src`, not in its slot
    bad += slots[i] != pattern_word(source, epoch, i % words_per_pe);
  }
  for (int offset = 16; offset > 0; offset /= 2) bad += __shfl_down_sync(0xffffffffu, bad, offset);
  if ((threadIdx.x & 31) == 0 && bad) atomicAdd(p.mismatches, bad);
}

// Round trips between two PEs, one thread each: the latency of a signal over the transport.
extern "C" __global__ void lasp_pingpong(const __grid_constant__ lasp_pingpong_params p) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
  const uint64_t base = *p.round;
  for (int r = 1; r <= p.rounds; ++r) {
    const uint64_t epoch = base + r;
    if (p.initiator) {
      nvshmemx_signal_op(p.flags + 0, epoch, NVSHMEM_SIGNAL_SET, p.peer);
      if (!lasp::wait_signal_ge(site, p.flags + 1, epoch, p.peer, 1, LASP_WAIT_PINGPONG)) return;
    } else {
      if (!lasp::wait_signal_ge(site, p.flags + 0, epoch, p.peer, 0, LASP_WAIT_PINGPONG)) return;
      nvshmemx_signal_op(p.flags + 1, epoch, NVSHMEM_SIGNAL_SET, p.peer);
    }
  }
  *p.round = base + p.rounds;
}
