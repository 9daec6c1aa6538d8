// What a bounded wait on another PE leaves behind when it expires. Shared with the host (C; bindgen
// generates its struct from this file, wrapped by `WaitDiagnostics` in core/src/diagnostics.rs),
// which turns it into an error naming the PE that never sent, the signal slot and the epoch.
#pragma once
#include <stdint.h>

enum lasp_wait_kind {
  LASP_WAIT_NONE = 0,
  LASP_WAIT_DATA = 1,    // a data signal: the peer's put of this epoch has not arrived
  LASP_WAIT_CREDIT = 2,  // a credit: the peer has not released the slot it must read first
  LASP_WAIT_PINGPONG = 3,
};

typedef struct {
  uint32_t failed;      // 0 while every wait succeeded; the first expired wait sets it to 1
  uint32_t kind;        // enum lasp_wait_kind
  int32_t waiting_pe;   // the PE that waited
  int32_t peer_pe;      // the PE whose signal never came
  int32_t slot;         // index of the signal word in its array
  int32_t reserved;
  uint64_t expected;    // the epoch waited for (the wait is `signal >= expected`)
  uint64_t seen;        // the last value read before giving up
  uint64_t waited_ns;   // how long it waited
} lasp_wait_diag;
