// Device-initiated all-gather and ping-pong over NVSHMEM.
//
// Every transfer goes through NVSHMEM's put / signal API, so the same code runs over NVLink (the
// put is a copy by the calling threads into the peer's mapped heap) and over InfiniBand (the put
// is posted to the proxy or to the NIC). Signals are 64-bit epochs that never wrap: one word per
// (source PE, parity slot), set with NVSHMEM_SIGNAL_SET and waited on with >=.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "lasp/exchange/transport_params.h"
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

// This launch's round. The puts may start at once, with no handshake: they overwrite, on every
// peer, the parity that peer last read at epoch - 2, and every peer has finished with that
// epoch's data. This PE completed epoch - 1 (stream order) only after every peer's data of
// epoch - 1 had arrived, which that peer sent from its round epoch - 1, launched (stream order
// again) after whatever read its slots of epoch - 2: a peer's data signal of epoch - 1 is also its
// "done reading" for epoch - 2, so no separate credit is sent. The other parity, epoch - 1's, may
// still be in use on a peer that is slower to finish; nothing of this round touches it.
struct Round {
  uint64_t epoch;
  int parity;
};
__device__ __forceinline__ Round this_round(const lasp_allgather_params& p) {
  const uint64_t epoch = *p.epoch + 1;
  return {epoch, static_cast<int>(epoch & 1)};
}

// Where this PE's contribution lands on every peer: its slot of the round's parity.
__device__ __forceinline__ uint8_t* own_slot(const lasp_allgather_params& p, int parity) {
  return p.slots + (static_cast<uint64_t>(parity) * p.npes + p.me) * p.bytes;
}

// Called by every thread once the CTA's puts are issued: completes them (visible at their
// targets: nvshmem_quiet waits for the NIC where one moves the data and ends, on every transport,
// in a system-scope fence by this thread, which after the barrier covers every thread's stores),
// then counts the CTA in on `counter`. True, in every thread, in the CTA whose arrival makes it
// `arrivals`; that CTA returns the counter to 0 for the next launch. The fences are cumulative, so
// whatever the last CTA signals after its own fence orders after every counted CTA's puts.
__device__ bool last_to_arrive(uint32_t* counter, uint32_t arrivals) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    nvshmem_quiet();
    is_last = atomicAdd(counter, 1u) == arrivals - 1;
    if (is_last) {
      *counter = 0;
      __threadfence_system();
    }
  }
  __syncthreads();
  return is_last != 0;
}

// False once a wait of this launch or of an earlier one on this all-gather has expired.
__device__ __forceinline__ bool no_wait_failed(const lasp_allgather_params& p) {
  return *(volatile uint32_t*)&p.diag->failed == 0;
}

// Tells `pe` that this PE's data of the round has landed in its slots.
__device__ __forceinline__ void signal_data(const lasp_allgather_params& p, const Round& round, int pe) {
  nvshmemx_signal_op(p.data_signal + round.parity * p.npes + p.me, round.epoch, NVSHMEM_SIGNAL_SET, pe);
}

// Waits for `source`'s data of the round; false (recorded in p.diag) if it never came.
__device__ __forceinline__ bool wait_data(const lasp_allgather_params& p, const lasp::WaitSite& site,
                                          const Round& round, int source) {
  const int slot = round.parity * p.npes + source;
  return lasp::wait_signal_ge(site, p.data_signal + slot, round.epoch, source, slot, LASP_WAIT_DATA);
}

// End of a round in the one CTA that saw every CTA's puts complete: signal every peer, wait for
// every source (one thread each), publish the epoch. A wait of this round that expires (or one of
// an earlier round, which makes every later wait fail at once) leaves the epoch unpublished.
__device__ void signal_all_then_publish(const lasp_allgather_params& p, const lasp::WaitSite& site,
                                        const Round& round) {
  for (int pe = threadIdx.x; pe < p.npes; pe += blockDim.x)
    if (pe != p.me) signal_data(p, round, pe);
  __shared__ int all_arrived;
  if (threadIdx.x == 0) all_arrived = 1;
  __syncthreads();
  for (int source = threadIdx.x; source < p.npes; source += blockDim.x)
    if (source != p.me && !wait_data(p, site, round, source)) all_arrived = 0;
  __syncthreads();
  if (threadIdx.x == 0 && all_arrived) *p.epoch = round.epoch;
}

}  // namespace

// Three kernels run the same protocol (exchange/transport_params.h) and differ only in how the puts are
// spread over CTAs and who signals; the host picks one (core/src/exchange/transport.rs,
// AllGatherVariant). All of them need every CTA of a launch resident at once (a CTA waits for the
// others), so the host launches at most one CTA per SM; up to 1024 threads per CTA.

// "cta-loop": CTA c moves slice c of `src` to every peer in turn (each CTA starting at a
// different peer so every link is busy from the first byte); the last CTA to finish its puts
// signals every PE, then waits for every PE's signal and publishes the new epoch.
extern "C" __global__ void __launch_bounds__(1024) lasp_allgather(const __grid_constant__ lasp_allgather_params p) {
  const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
  const Round round = this_round(p);
  const Slice slice = cta_slice(p.bytes, blockIdx.x, gridDim.x);
  uint8_t* const slot = own_slot(p, round.parity);
  // In place: this PE's own contribution stays in `src`, only the peers' copies move.
  for (int k = 0; k < p.npes - 1 && slice.end > slice.begin; ++k) {
    const int pe = (p.me + 1 + (blockIdx.x + k) % (p.npes - 1)) % p.npes;
    nvshmemx_putmem_nbi_block(slot + slice.begin, p.src + slice.begin, slice.end - slice.begin, pe);
  }
  if (last_to_arrive(p.counters + LASP_COUNTER_CTAS_DONE, gridDim.x)) signal_all_then_publish(p, site, round);
}

// "peer-major": the grid is (npes - 1) groups of CTAs, group g serving one peer only (CTA c is in
// group c % (npes - 1) and moves slice c / (npes - 1) of `src`), so every link gets the same
// number of CTAs for the whole round and no CTA walks over peers. The last CTA of a group signals
// its peer as soon as that peer's bytes are out, without waiting for the other groups, then waits
// for the data of one source (the peer whose group of the same index sends to this PE); the last
// group to finish publishes the epoch. The host launches a multiple of npes - 1 CTAs.
extern "C" __global__ void __launch_bounds__(1024) lasp_allgather_peer_major(const __grid_constant__ lasp_allgather_params p) {
  const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
  const Round round = this_round(p);
  const int peers = p.npes - 1;
  if (peers == 0) {  // a single PE has nothing to move
    if (blockIdx.x == 0 && threadIdx.x == 0) *p.epoch = round.epoch;
    return;
  }
  const int group = blockIdx.x % peers;
  const uint32_t group_ctas = gridDim.x / peers;
  const int pe = (p.me + 1 + group) % p.npes;
  const Slice slice = cta_slice(p.bytes, blockIdx.x / peers, group_ctas);
  if (slice.end > slice.begin)
    nvshmemx_putmem_nbi_block(own_slot(p, round.parity) + slice.begin, p.src + slice.begin, slice.end - slice.begin, pe);
  if (!last_to_arrive(p.counters + LASP_COUNTER_PEER_GROUP + group, group_ctas)) return;

  // Every byte for `pe` is out: signal it, then wait for the source that sends to this PE from
  // its own group `group` (PE s's group g serves PE s + 1 + g). An expired wait is recorded in
  // p.diag, which the publisher below checks.
  if (threadIdx.x == 0) {
    const int source = (p.me + p.npes - 1 - group) % p.npes;
    signal_data(p, round, pe);
    wait_data(p, site, round, source);
  }
  if (last_to_arrive(p.counters + LASP_COUNTER_PEERS_DONE, peers) && threadIdx.x == 0 && no_wait_failed(p))
    *p.epoch = round.epoch;
}

// "dynamic": the round's (npes - 1) * ceil(bytes / chunk_bytes) puts (the host keeps that far
// below 2^32) are handed out one at a time from a counter, so a CTA that runs faster (a less loaded
// SM or link) takes more of them and the round ends with all CTAs within one item of each other
// instead of waiting for the slowest static slice. A CTA's first item is its own index, so the
// first puts wait for no claim; each later claim is issued before the current put so its latency
// overlaps the copy. Completion as in cta-loop.
// The items go peer by peer: all of them for PE me + 1 first, then me + 2, ...; while the PEs keep
// pace every phase is a permutation, one sender per receiver. Against items interleaved over the
// peers (every PE sending to, and receiving from, all at once) that moved 0.4 us less at 4 MiB per
// rank and 1.2 us less at 8 MiB (measured on 4x H200).
extern "C" __global__ void __launch_bounds__(1024) lasp_allgather_dynamic(const __grid_constant__ lasp_allgather_params p) {
  const lasp::WaitSite site{p.diag, p.timeout_ns, p.me};
  const Round round = this_round(p);
  const uint64_t peers = p.npes - 1;
  const uint64_t chunks_per_peer = (p.bytes + p.chunk_bytes - 1) / p.chunk_bytes;
  const uint64_t items = peers * chunks_per_peer;
  uint32_t* const claims = p.counters + LASP_COUNTER_WORK_CLAIMED;
  uint8_t* const slot = own_slot(p, round.parity);
  // Claims alternate between two words, so thread 0 may publish the next one while others still
  // read the last: a word is rewritten only after the barrier that follows its reads.
  __shared__ uint32_t claimed[2];
  uint32_t item = blockIdx.x;
  for (int turn = 0; item < items; turn ^= 1) {
    uint32_t next = 0;
    if (threadIdx.x == 0) next = gridDim.x + atomicAdd(claims, 1u);
    const int pe = (p.me + 1 + static_cast<int>(item / chunks_per_peer)) % p.npes;
    const uint64_t begin = (item % chunks_per_peer) * p.chunk_bytes;
    const uint64_t end = min(p.bytes, begin + p.chunk_bytes);
    nvshmemx_putmem_nbi_block(slot + begin, p.src + begin, end - begin, pe);
    if (threadIdx.x == 0) claimed[turn] = next;
    __syncthreads();
    item = claimed[turn];
  }
  if (!last_to_arrive(p.counters + LASP_COUNTER_CTAS_DONE, gridDim.x)) return;
  // Every CTA has stopped claiming (each counted itself in after its last claim).
  if (threadIdx.x == 0) *claims = 0;
  signal_all_then_publish(p, site, round);
}

// Launched with a round's shape and parameters, does nothing: what a launch costs in whatever
// harness times it, the floor under every round's time.
extern "C" __global__ void __launch_bounds__(1024) lasp_allgather_floor(const __grid_constant__ lasp_allgather_params) {}

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
