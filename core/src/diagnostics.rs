//! The record a bounded device wait leaves when it expires, and its translation into an error.

use crate::error::{Error, Result};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

/// Mirror of `lasp_wait_diag` (kernels/cuda/include/lasp/wait_diagnostics.h).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitDiagnostics {
    pub failed: u32,
    pub kind: u32,
    pub waiting_pe: i32,
    pub peer_pe: i32,
    pub slot: i32,
    pub reserved: i32,
    pub expected: u64,
    pub seen: u64,
    pub waited_ns: u64,
}

// SAFETY: a #[repr(C)] struct of integers only (layout checked against the C struct below), so
// copying its bytes to and from the device is valid for any bit pattern.
unsafe impl DeviceRepr for WaitDiagnostics {}
// SAFETY: integers only: all zero bits is a valid value (the "no wait expired" record).
unsafe impl ValidAsZeroBits for WaitDiagnostics {}

impl WaitDiagnostics {
    /// `Ok` if no wait expired, else the error naming the PE, slot and epoch.
    pub fn into_result(self) -> Result<()> {
        if self.failed == 0 {
            return Ok(());
        }
        let what = match self.kind {
            1 => "data",
            2 => "a slot credit",
            3 => "a ping-pong signal",
            _ => "a signal",
        };
        Err(Error::PeerTimeout {
            waiting_pe: self.waiting_pe,
            peer_pe: self.peer_pe,
            slot: self.slot,
            what,
            expected_epoch: self.expected,
            seen_epoch: self.seen,
            waited_ms: self.waited_ns as f64 / 1e6,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_c_struct() {
        assert_eq!(std::mem::size_of::<WaitDiagnostics>(), 48);
        assert_eq!(std::mem::offset_of!(WaitDiagnostics, expected), 24);
    }

    #[test]
    fn an_expired_wait_names_pe_slot_and_epoch() {
        assert!(WaitDiagnostics::default().into_result().is_ok());
        let d = WaitDiagnostics {
            failed: 1,
            kind: 1,
            waiting_pe: 0,
            peer_pe: 3,
            slot: 7,
            expected: 42,
            seen: 41,
            waited_ns: 5_000_000_000,
            ..Default::default()
        };
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
