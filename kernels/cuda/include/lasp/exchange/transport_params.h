// Parameters of the device-initiated all-gather and ping-pong kernels (exchange/transport.cu). C, so that
// bindgen generates the host's structs from this file (kernels/build.rs).
#pragma once
#include <stdint.h>
#include "lasp/wait_diagnostics.h"

// Symmetric layout of one all-gather: every PE holds `slots` = [2 parities][npes][bytes], where
// slot [parity][s] receives PE s's `src` (in place: a PE's own slot is not written). The
// round with epoch e uses parity e % 2, so a round can start while readers still use the previous
// one. It needs no credits from the readers of the parity it overwrites: every PE's round waits for
// data from every other PE, so a PE that completed epoch e - 1 knows each peer had started it, and
// with it (stream order) finished reading epoch e - 2 (exchange/transport.cu, this_round).
typedef struct {
  const uint8_t* src;      // symmetric, `bytes`: this PE's contribution
  uint8_t* slots;          // symmetric, 2 * npes * bytes
  uint64_t* data_signal;   // symmetric, [2][npes]: set to e on PE p when source s's data of epoch e
                           // (parity e % 2) has landed in p's slots
  uint64_t* epoch;         // device, 1 word: the last completed epoch; advanced by the kernel so a
                           // captured graph replays correctly
  uint32_t* counters;      // device, LASP_ALLGATHER_COUNTERS(npes) words, zero between launches:
                           // arrivals and work claims within one launch (lasp_allgather_counter)
  lasp_wait_diag* diag;    // device: the first expired wait
  uint64_t bytes;          // per PE, a multiple of 16
  uint64_t chunk_bytes;    // lasp_allgather_dynamic only: bytes per claimed work item, a multiple
                           // of 16
  uint64_t timeout_ns;     // bound on every wait
  int32_t me;
  int32_t npes;
} lasp_allgather_params;

// Words of lasp_allgather_params::counters. Each is returned to 0 by the CTA that uses it last in
// a launch, so the next launch on the stream starts from zero.
enum lasp_allgather_counter {
  LASP_COUNTER_CTAS_DONE = 0,    // CTAs done with their puts (lasp_allgather, _dynamic)
  LASP_COUNTER_WORK_CLAIMED = 1, // work items handed out (lasp_allgather_dynamic)
  LASP_COUNTER_PEERS_DONE = 2,   // peer groups done sending and receiving (_peer_major)
  LASP_COUNTER_PEER_GROUP = 3,   // first of npes words: CTAs of peer group g done (_peer_major)
};
#define LASP_ALLGATHER_COUNTERS(npes) (LASP_COUNTER_PEER_GROUP + (npes))

// Patterned data for the epoch checks: every 32-bit word a function of (source PE, epoch, index),
// so a stale round, a torn copy or a wrong slot shows up as a mismatch.
typedef struct {
  uint8_t* src;            // symmetric, `bytes`: filled for the next epoch
  const uint8_t* slots;    // symmetric, the all-gather's slots: checked for the last epoch
  const uint64_t* epoch;   // device: the all-gather's epoch counter
  unsigned long long* mismatches;  // device, 1 word: accumulated over checks
  uint64_t bytes;
  int32_t me;
  int32_t npes;
} lasp_allgather_pattern_params;

// Device ping-pong between PE `me` and PE `peer`: `rounds` round trips, each a signal set and a
// bounded wait for the answer. Signals are epochs continued from `*round`, so repeated launches
// need no reset.
typedef struct {
  uint64_t* flags;        // symmetric, 2 words: [0] written by the initiator, [1] by the responder
  uint64_t* round;        // device, 1 word: round trips completed by earlier launches
  lasp_wait_diag* diag;
  uint64_t timeout_ns;
  int32_t me;
  int32_t peer;
  int32_t initiator;      // 1 on the PE that sends first
  int32_t rounds;
} lasp_pingpong_params;
