//! The record a bounded device wait leaves when it expires, and its translation into an error.

use crate::error::{Error, Result};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use lasp_shmem_kernels::params::{
    lasp_wait_diag, LASP_WAIT_CREDIT, LASP_WAIT_DATA, LASP_WAIT_PINGPONG,
};

/// The C struct `lasp_wait_diag` (kernels/cuda/include/lasp/wait_diagnostics.h), as the device
/// leaves it. A wrapper, so that the device-copy traits of cudarc can be implemented for it.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default)]
pub struct WaitDiagnostics(pub lasp_wait_diag);

// SAFETY: the C struct of integers only, unchanged by the transparent wrapper, so copying its
// bytes to and from the device is valid for any bit pattern.
unsafe impl DeviceRepr for WaitDiagnostics {}
// SAFETY: integers only: all zero bits is a valid value (the "no wait expired" record).
unsafe impl ValidAsZeroBits for WaitDiagnostics {}

impl WaitDiagnostics {
    /// `Ok` if no wait expired, else the error naming the PE, slot and epoch.
    pub fn into_result(self) -> Result<()> {
        let diag = self.0;
        if diag.failed == 0 {
            return Ok(());
        }
        let what = match diag.kind {
            LASP_WAIT_DATA => "data",
            LASP_WAIT_CREDIT => "a slot credit",
            LASP_WAIT_PINGPONG => "a ping-pong signal",
            _ => "a signal",
        };
        Err(Error::PeerTimeout {
            waiting_pe: diag.waiting_pe,
            peer_pe: diag.peer_pe,
            slot: diag.slot,
            what,
            expected_epoch: diag.expected,
            seen_epoch: diag.seen,
            waited_ms: diag.waited_ns as f64 / 1e6,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_wait_names_pe_slot_and_epoch() {
        assert!(WaitDiagnostics::default().into_result().is_ok());
        let d = WaitDiagnostics(lasp_wait_diag {
            failed: 1,
            kind: LASP_WAIT_DATA,
            waiting_pe: 0,
            peer_pe: 3,
            slot: 7,
            expected: 42,
            seen: 41,
            waited_ns: 5_000_000_000,
            ..Default::default()
        });
        let msg = d.into_result().unwrap_err().to_string();
        for part in [
            "PE 0 waited 5000 ms for data from PE 3",
            "signal slot 7",
            "epoch 42",
            "last seen 41",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
    }
}
