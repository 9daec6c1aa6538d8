// Device side of the exchange, the same for every family (lasp/exchange/chain_params.h): the
// call's epoch, timeline stamps, the chain's positions, and the schedules (Exchange: the
// all-gather and the pipelined chain): the bounded wait for the summaries a PE folds, their fold in
// chain order (the family supplies how a tile is staged and folded), and the publication of this
// PE's own tile (credits, puts, signals).
//
// Every function takes the family's LASP-2 params struct `P` by reference; it reads only the
// exchange fields that chain_params.h lists, so a family's struct adds its own tensors freely.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>
#include <stdint.h>

#include "lasp/exchange/chain_params.h"
#include "lasp/mma.cuh"
#include "lasp/wait.cuh"

namespace lasp {
namespace exchange {

// The epoch every kernel of the current call works on (the advance kernel runs last).
template <class P>
__device__ __forceinline__ uint64_t call_epoch(const P& p) {
  return *p.epoch + 1;
}

// Timeline stamp (thread 0 of a CTA; no-op without a timeline buffer).
template <class P>
__device__ __forceinline__ void stamp(const P& p, uint64_t word) {
  if (p.timeline && threadIdx.x == 0) p.timeline[word] = global_ns();
}

// This PE's position on the chain, and the PE at position `pos`.
template <class P>
__device__ __forceinline__ int chain_position(const P& p) {
  return lasp2_chain_position(p.chain, p.me, p.npes);
}
template <class P>
__device__ __forceinline__ int chain_pe(const P& p, int pos) {
  return lasp2_chain_pe(p.chain, pos, p.npes);
}

// Emulated links (lasp2_link_emulation): holds the calling thread until `bytes` sent to other
// emulated nodes would have arrived, i.e. the PE's emulated NIC's busy time for them, queued after
// what it already carries, plus one latency. Nothing without emulation or without such bytes.
template <class P>
__device__ __forceinline__ void hold_for_emulated_link(const P& p, uint64_t bytes) {
  if (p.link == nullptr || bytes == 0) return;
  const uint64_t busy_ns = bytes * p.link->ps_per_byte / 1000;
  auto* free_at = reinterpret_cast<unsigned long long*>(&p.link->free_at_ns);
  const unsigned long long now = global_ns();
  unsigned long long seen = atomicAdd(free_at, 0ull), done;
  for (;;) {  // done = max(now, free_at) + busy_ns, claimed atomically against the other CTAs
    done = (seen > now ? seen : now) + busy_ns;
    const unsigned long long before = atomicCAS(free_at, seen, done);
    if (before == seen) break;
    seen = before;
  }
  const uint64_t arrives = done + p.link->latency_ns;
  while (global_ns() < arrives) __nanosleep(500);
}

// Whether the call's kernels put and wait on the device (the two device schedules), and whether it
// relays the prefix along the chain (LASP2_DEVICE_CHAIN).
template <class P>
__device__ __forceinline__ bool device_puts(const P& p) {
  return p.exchange_mode == LASP2_DEVICE_PUT || p.exchange_mode == LASP2_DEVICE_CHAIN;
}
template <class P>
__device__ __forceinline__ bool relays_prefix(const P& p) {
  return p.exchange_mode == LASP2_DEVICE_CHAIN;
}

// The schedules: how the summaries of one call travel, as the static functions the families'
// kernels call (templates on this type, instantiated from kernels/instances.rs), chosen per call
// by p.exchange_mode:
//   send_credits(p, epoch, bh, vt)   before the summary is computed: the readers' credits it owes
//   relayed_prefix(p, bh, vt, ...)   the summary kernel under the chain: the prefix it folds its
//                                    own summary into (waits for it)
//   publish(p, epoch, own, bytes, ...) the summary kernel's own tile, written: send it on
//   starts_from_h0(p)                whether a consumer starts from h0 (else from zero)
//   wait(p, bh, vt)                  a consuming CTA: bounded wait for what it folds
//   fold_arrived(p, bh, vt, ...)     fold what arrived, in chain order, with the family's stage and
//                                    fold of one tile
//   grant_credits(p)                 re-arm the credits after no-communication calls
//
// All-gather (LASP2_DEVICE_PUT, and the host-gathered modes): every PE puts its own summary tile
// to every PE after it on the chain (one put and one signal per tile and reader); each PE folds
// all earlier PEs' tiles, in chain order, from h0. One hop of latency; the last PE takes in W - 1
// tiles.
// Pipelined chain (LASP2_DEVICE_CHAIN): the summary kernel of the PE at position i > 0 waits for
// its predecessor's tile, which holds the prefix P_i (everything before it folded, from h0), folds
// its own summary into it with the family's fold and puts P_{i + 1}, with a zero log-decay, to its
// successor only; position 0 folds its summary into h0. Each tile travels as soon as its CTA has
// folded it, so the tiles of one state pipeline through the chain, and every PE takes in and
// sends one state whatever W is. A consumer at position i > 0 folds the one arrived tile from
// zero: fold(0, P_i) with a zero log-decay is P_i, so it starts from the same bits the
// all-gather's fold of every earlier tile gives (the same folds of the same operands, made one
// per PE). Credits are the all-gather's (every reader credits every earlier PE), so the two
// schedules alternate freely; under the chain a PE only waits for its successor's.
struct Exchange {
  // The first chain position whose tile this PE folds: all before it (all-gather) or only its
  // predecessor (chain).
  template <class P>
  static __device__ __forceinline__ int first_folded(const P& p) {
    const int position = chain_position(p);
    return relays_prefix(p) ? max(position - 1, 0) : 0;
  }

  // Whether a consumer starts from h0 (every PE with the all-gather; under the chain only the
  // chain's first PE, since the relayed prefix already holds h0).
  template <class P>
  static __device__ __forceinline__ bool starts_from_h0(const P& p) {
    return !relays_prefix(p) || chain_position(p) == 0;
  }

  // Device schedules: waits (bounded) until tile (bh, vt) of this epoch has landed from every PE
  // this one folds, one thread per such PE; the barrier then orders the acquires before every
  // thread's copies of the slots (cp.async.cg reads through L2). False on every thread if a wait
  // expired (p.diag names the PE). Other modes: true at once.
  template <class P>
  static __device__ __forceinline__ bool wait(const P& p, int bh, int vt) {
    if (!device_puts(p)) return true;
    const uint64_t epoch = call_epoch(p);
    const int parity = static_cast<int>(epoch & 1);
    const WaitSite site{p.diag, p.timeout_ns, p.me};
    int ok = 1;
    for (int pos = first_folded(p) + threadIdx.x; pos < chain_position(p); pos += blockDim.x) {
      const int u = chain_pe(p, pos);
      const uint64_t idx = lasp2_signal_index(parity, u, bh, vt, p.npes, p.B, p.H, p.Dv);
      ok &= wait_signal_ge(site, p.signals + idx, epoch, u, static_cast<int32_t>(idx), LASP_WAIT_DATA);
    }
    return __syncthreads_and(ok);
  }

  // The summary kernel's CTA of tile (bh, vt) under the chain at a position with a predecessor and
  // a successor: waits (bounded) for the predecessor's tile of this epoch and returns it (slot
  // [parity][predecessor][bh][vt], to be read through L2: it was written by another GPU). nullptr
  // under the all-gather, at position 0, and at the chain's last PE, which sends nothing (its
  // output kernel waits for the same tile; a summary CTA spinning there would only hold an SM).
  // `ok` false on every thread if the wait expired (the CTA must then send nothing, and its
  // successor names this PE).
  template <class P>
  static __device__ __forceinline__ const float* relayed_prefix(const P& p, int bh, int vt, uint64_t tile_floats,
                                                                bool& ok) {
    ok = true;
    const int position = chain_position(p);
    if (!relays_prefix(p) || position == 0 || position == p.npes - 1) return nullptr;
    ok = wait(p, bh, vt);
    const int parity = static_cast<int>(call_epoch(p) & 1);
    const int u = chain_pe(p, position - 1);
    return p.slots + lasp2_slot_tile_offset(parity, u, bh, vt, p.npes, p.B, p.H, p.Dv, tile_floats);
  }

  // Folds the tiles (slot [parity][u][bh][vt], `tile_floats` floats each) of the chain positions
  // from first_folded to this PE's, in chain order, `batch` at a time: stage(j, tile) starts the
  // cp.async copy of the batch's j-th tile into the family's staging slot j, fold(j) folds staging
  // slot j into the family's accumulator. A batch's copies land before its folds start (one L2 round trip per batch,
  // not per tile); the barriers keep the staging slots free until they are folded. Call after
  // wait.
  template <class P, class Stage, class Fold>
  static __device__ __forceinline__ void fold_arrived(const P& p, int bh, int vt, uint64_t tile_floats, int batch,
                                                     Stage&& stage, Fold&& fold) {
    const int parity = static_cast<int>(call_epoch(p) & 1);
    const int before = chain_position(p);
    for (int pos0 = first_folded(p); pos0 < before; pos0 += batch) {
      const int count = min(batch, before - pos0);
      for (int j = 0; j < count; ++j) {
        const int u = chain_pe(p, pos0 + j);
        stage(j, p.slots + lasp2_slot_tile_offset(parity, u, bh, vt, p.npes, p.B, p.H, p.Dv, tile_floats));
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int j = 0; j < count; ++j) fold(j);
      __syncthreads();  // before the next batch, or a chunk pipeline, overwrites the slots
    }
  }

  // The call's credits, before this PE's summary is computed: one thread of the call's first CTA
  // (head 0, Dv tile 0) sets credit[me] = epoch - 1 on every PE before this one on the chain (this
  // PE finished reading epoch - 1: the kernels that read it precede this call's). Communicating
  // modes only, every schedule alike (the chain's predecessor needs only its own). `epoch` is
  // call_epoch(p), read once per kernel. True on the thread that sent them (it quiets them, with
  // its puts if any, in publish).
  template <class P>
  static __device__ __forceinline__ bool send_credits(const P& p, uint64_t epoch, int bh, int vt) {
    const int position = chain_position(p);
    const bool sends =
        p.exchange_mode != LASP2_NO_COMM && bh == 0 && vt == 0 && threadIdx.x == 0 && position > 0;
    if (sends)
      for (int pos = 0; pos < position; ++pos)
        nvshmemx_signal_op(p.credit + p.me, epoch - 1, NVSHMEM_SIGNAL_SET, chain_pe(p, pos));
    return sends;
  }

  // Publishes this PE's own slot tile `own` (`bytes` long, already written by the CTA's threads)
  // of tile (bh, vt). Device schedules: waits for every reader's credit for epoch - 2 (bounded),
  // then puts the tile to every reader (same offset: the all-gather's readers are every later PE
  // on the chain, the chain's its successor), one nvshmem_quiet for all of them, and the signals
  // [parity][me][bh*ntiles + vt] := epoch (held for emulated links where the params carry them).
  // Other modes: only the stamps. Called by every thread of the CTA.
  template <class P>
  static __device__ __forceinline__ void publish(const P& p, uint64_t epoch, float* own, uint64_t bytes, int bh, int vt,
                                                bool sent_credits) {
    const int parity = static_cast<int>(epoch & 1);
    const int tid = threadIdx.x;
    const int position = chain_position(p);
    const uint64_t stamps = lasp2_timeline_put(bh, vt, p.Dv);
    // The readers: the PEs after this one on the chain, or only the next.
    const int later = relays_prefix(p) ? min(1, p.npes - 1 - position) : p.npes - 1 - position;
    if (!device_puts(p) || later == 0) {
      if (sent_credits) nvshmem_quiet();
      stamp(p, stamps + 0);
      stamp(p, stamps + 1);
      return;
    }
    auto reader = [&](int k) { return chain_pe(p, position + 1 + k); };  // k < later
    // The tile is complete in this PE's memory before the NIC (over InfiniBand) reads it for the
    // puts. A peer NVSHMEM reaches by load/store gets its copy from this CTA's threads, for which
    // the barrier below is enough; skipping the fence there matters, because a system-scope fence
    // waits tens of microseconds while the GPUs stream the kernels' traffic (kernels/docs/lasp2.md).
    bool nic_reads = false;
    for (int k = 0; k < later; ++k) nic_reads |= nvshmem_ptr(own, reader(k)) == nullptr;
    if (nic_reads) __threadfence_system();
    int ok = 1;
    if (epoch > 2) {
      // Slot [parity] of reader pe was last read at epoch - 2: wait for its credit, one thread per reader.
      const WaitSite site{p.diag, p.timeout_ns, p.me};
      for (int k = tid; k < later; k += blockDim.x) {
        const int pe = reader(k);
        ok &= wait_signal_ge(site, p.credit + pe, epoch - 2, pe, pe, LASP_WAIT_CREDIT);
      }
    }
    // A CTA that gave up on a credit sends nothing: the readers then time out on this epoch's data,
    // and this PE's diag names the peer whose credit never came.
    if (!__syncthreads_and(ok)) return;
    stamp(p, stamps + 0);

    // Every put first, then one quiet for all of them, then the signals: a put-with-signal per peer
    // would wait for its own completion (a system-scope fence) before the next peer's copy starts,
    // and such a fence waits long while the GPUs stream the output kernel's traffic.
    uint64_t* const sig = p.signals + lasp2_signal_index(parity, p.me, bh, vt, p.npes, p.B, p.H, p.Dv);
    const int first = (blockIdx.y * gridDim.x + blockIdx.x) % later;  // staggered: every link busy at once
    auto peer = [&](int k) { return reader((first + k) % later); };
    for (int k = 0; k < later; ++k) nvshmemx_putmem_nbi_block(own, own, bytes, peer(k));
    __syncthreads();
    if (tid == 0) {
      nvshmem_quiet();  // the CTA's puts have landed: the signals may follow
      if (p.link) {
        int remote = 0;
        for (int k = 0; k < later; ++k) remote += !lasp2_same_node(p.link->gpus_per_node, p.me, peer(k));
        hold_for_emulated_link(p, static_cast<uint64_t>(remote) * bytes);
      }
      for (int k = 0; k < later; ++k) nvshmemx_signal_op(sig, epoch, NVSHMEM_SIGNAL_SET, peer(k));
      stamp(p, stamps + 1);
      nvshmem_quiet();
    }
  }

  // Re-synchronises credits after LASP2_NO_COMM calls (which send none), before the first call of a
  // communicating mode: credit[me] = *epoch (every epoch so far is finished here) on every PE before
  // this one on the chain.
  // Host: nvshmemx_barrier_all_on_stream; this kernel (grid (1, 1, 1), block (1, 1, 1));
  // nvshmemx_barrier_all_on_stream (every credit is in place before any writer waits for one).
  template <class P>
  static __device__ __forceinline__ void grant_credits(const P& p) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t done = *p.epoch;
    for (int pos = 0; pos < chain_position(p); ++pos)
      nvshmemx_signal_op(p.credit + p.me, done, NVSHMEM_SIGNAL_SET, chain_pe(p, pos));
    nvshmem_quiet();
  }
};

// Launched last in every call (all modes): the call's epoch is complete on this PE.
// grid (1, 1, 1), block (1, 1, 1).
template <class P>
__device__ __forceinline__ void advance_epoch(const P& p) {
  if (threadIdx.x == 0 && blockIdx.x == 0) *p.epoch += 1;
}

}  // namespace exchange
}  // namespace lasp
