//! The one error type of the crate. Every message says what went wrong and what to do about it.

use std::fmt;

/// Errors of lasp-shmem's host calls.
#[derive(Debug)]
pub enum Error {
    /// The CUDA driver could not be used (no driver, no GPU, or a driver call failed).
    Cuda { call: String, detail: String },
    /// `libnvshmem_host.so.3` could not be opened.
    NvshmemLoad(nvshmem_sys::LoadError),
    /// An NVSHMEM host call failed.
    Nvshmem { call: &'static str, detail: String },
    /// NVSHMEM's host library and the device code linked into the cubin are incompatible.
    VersionMismatch {
        host: (i32, i32, i32),
        device: (u32, u32, u32),
    },
    /// The launch environment is inconsistent (ranks, world size, GPU count).
    Launch(String),
    /// Exchanging the bootstrap id between ranks failed.
    Rendezvous(String),
    /// A wait on another GPU expired: the peer never sent what was expected.
    PeerTimeout {
        waiting_pe: i32,
        peer_pe: i32,
        slot: i32,
        what: &'static str,
        expected_epoch: u64,
        seen_epoch: u64,
        waited_ms: f64,
    },
    /// An argument was rejected before any communication started.
    InvalidArgument(String),
    /// The runtime was used after shutdown or before init.
    State(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Cuda { call, detail } => write!(
                f,
                "CUDA {call} failed: {detail}; check that an NVIDIA driver is installed and \
                 `nvidia-smi` lists the GPU this rank was given (CUDA_VISIBLE_DEVICES, LOCAL_RANK)"
            ),
            Error::NvshmemLoad(e) => write!(f, "{e}"),
            Error::Nvshmem { call, detail } => write!(
                f,
                "NVSHMEM {call} failed: {detail}; rerun with NVSHMEM_DEBUG=WARN for NVSHMEM's own \
                 diagnostics"
            ),
            Error::VersionMismatch { host, device } => write!(
                f,
                "NVSHMEM host library {}.{}.{} cannot run device code built against {}.{}.{} (the \
                 major versions must match and the host minor must be >= the device minor); \
                 install nvidia-nvshmem-cu13=={}.{}.{} on this machine or rebuild lasp-shmem \
                 against the host's NVSHMEM (NVSHMEM_HOME)",
                host.0, host.1, host.2, device.0, device.1, device.2, device.0, device.1, device.2
            ),
            Error::Launch(msg) | Error::Rendezvous(msg) | Error::InvalidArgument(msg) => {
                write!(f, "{msg}")
            }
            Error::PeerTimeout {
                waiting_pe,
                peer_pe,
                slot,
                what,
                expected_epoch,
                seen_epoch,
                waited_ms,
            } => {
                write!(
                    f,
                    "PE {waiting_pe} waited {waited_ms:.0} ms for {what} from PE {peer_pe} (signal \
                     slot {slot}, epoch {expected_epoch}, last seen {seen_epoch}); PE {peer_pe} \
                     never sent it: check that rank {peer_pe} is alive and makes the same \
                     sequence of calls, or raise the timeout (LASP_WAIT_TIMEOUT_MS)"
                )
            }
            Error::State(msg) => write!(f, "{msg}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<nvshmem_sys::LoadError> for Error {
    fn from(e: nvshmem_sys::LoadError) -> Self {
        Error::NvshmemLoad(e)
    }
}

/// "description (CUDA_ERROR_NAME)" of a driver error.
pub(crate) fn describe_driver_error(e: &cudarc::driver::DriverError) -> String {
    match (e.error_string(), e.error_name()) {
        (Ok(text), Ok(name)) => format!("{} ({})", text.to_string_lossy(), name.to_string_lossy()),
        _ => format!("{e:?}"),
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::Cuda {
            call: "driver call".into(),
            detail: describe_driver_error(&e),
        }
    }
}
