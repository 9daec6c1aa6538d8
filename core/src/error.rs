//! The one error type of the crate. Every message says what went wrong and what to do about it.
//!
//! Failed CUDA driver calls are sorted by what the caller can do about them:
//!
//! - [`Error::DriverUnavailable`]: no driver, no (usable) GPU, a driver too old for the toolkit.
//!   A setup problem of the machine or the job (`nvidia-smi`, `CUDA_VISIBLE_DEVICES`).
//! - [`Error::KernelFault`]: a kernel faulted (an illegal address, a device-side assert, ...).
//!   The driver reports it at the next call that waits on the stream, usually a synchronise, and
//!   from then on every call on the context fails: the process must exit. A bug to report.
//! - [`Error::KernelLaunch`]: the driver refused to enqueue a kernel (too much shared memory, too
//!   many threads). Nothing ran; a bug in the launch plan to report.
//! - [`Error::Cuda`]: any other failed driver call (out of memory, a bad handle, ...).
//!
//! Call sites name the driver call that failed with [`CudaCall::cuda_call`]; a bare `?` on a
//! cudarc error still sorts it into the right variant, but can only say "a CUDA driver call".

use cudarc::driver::{sys, DriverError};
use std::fmt;
use std::sync::OnceLock;

/// Errors of lasp-shmem's host calls.
///
/// New variants may be added as the library grows (new model families, new transports): match
/// with a wildcard arm.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA driver call failed for a reason other than the ones with their own variant below
    /// (out of memory, an invalid handle or value, ...).
    Cuda { call: String, detail: String },
    /// The CUDA driver or the GPU cannot be used at all: no `libcuda.so.1`, no GPU visible, a
    /// driver too old for the toolkit, a GPU in a state that refuses work.
    DriverUnavailable { call: String, detail: String },
    /// A kernel faulted on the device (illegal address, device-side assert, illegal instruction,
    /// ...), or the context holds such a fault from an earlier kernel (CUDA errors of this kind
    /// are "sticky"). The context is unusable from now on: every later call fails too.
    KernelFault { call: String, detail: String },
    /// The driver refused to enqueue a kernel (its launch shape or shared memory does not fit
    /// this GPU). Nothing was enqueued.
    KernelLaunch { kernel: String, detail: String },
    /// The kernel module lacks a kernel this call needs: the library was built from other kernel
    /// sources than the Rust code expects (a build problem).
    MissingKernel { kernel: String, detail: String },
    /// No kernels were built for this GPU's architecture.
    UnsupportedGpu {
        compute_capability: (i32, i32),
        built: Vec<&'static str>,
    },
    /// An NCCL call failed.
    Nccl { call: &'static str, detail: String },
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
    /// An argument or a setting (a `LASP_*` or `NVSHMEM_*` variable) was rejected before any
    /// communication started.
    InvalidArgument(String),
    /// The runtime was used after shutdown or before init, or calls came in the wrong order.
    State(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Cuda { call, detail } => write!(f, "CUDA {call} failed: {detail}"),
            Error::DriverUnavailable { call, detail } => write!(
                f,
                "CUDA {call} failed: {detail}; check that an NVIDIA driver is installed and \
                 `nvidia-smi` lists the GPU this rank was given (CUDA_VISIBLE_DEVICES, LOCAL_RANK)"
            ),
            Error::KernelFault { call, detail } => write!(
                f,
                "CUDA {call} failed: {detail}: a kernel faulted on the GPU, so this process's CUDA \
                 context is unusable (every later call fails too) and the process must exit; \
                 this is a bug to report with this message. To find the kernel, rerun with \
                 CUDA_LAUNCH_BLOCKING=1 (the error then surfaces at the faulting launch) or \
                 under compute-sanitizer"
            ),
            Error::KernelLaunch { kernel, detail } => write!(
                f,
                "CUDA refused to launch kernel {kernel}: {detail}; nothing was enqueued. This is \
                 a bug in lasp-shmem's launch plan for this GPU: please report it with this \
                 message and the output of nvidia-smi"
            ),
            Error::MissingKernel { kernel, detail } => write!(
                f,
                "kernel {kernel} is not in the embedded kernel module ({detail}): this build of \
                 lasp-shmem is inconsistent (kernel sources and Rust code of different \
                 versions); rebuild it from one checkout (cargo clean -p lasp-shmem-kernels)"
            ),
            Error::UnsupportedGpu {
                compute_capability: (major, minor),
                built,
            } => write!(
                f,
                "no kernels were built for this GPU (compute capability {major}.{minor}; built: \
                 {built:?}); rebuild with LASP_EXTRA_CUDA_ARCHS=sm_{major}{minor}a"
            ),
            Error::Nccl { call, detail } => write!(
                f,
                "NCCL {call} failed: {detail}; rerun with NCCL_DEBUG=WARN for NCCL's own \
                 diagnostics"
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

/// "description (CUDA_ERROR_NAME)" of a driver error; just the name where the driver library
/// cannot be loaded to describe it (cudarc would panic).
pub(crate) fn describe_driver_error(e: &DriverError) -> String {
    static DRIVER_PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens (and closes) the driver library, whose initialisers set up its own
    // state; no code of ours runs.
    let present = *DRIVER_PRESENT.get_or_init(|| unsafe { sys::is_culib_present() });
    match present.then(|| (e.error_string(), e.error_name())) {
        Some((Ok(text), Ok(name))) => {
            format!("{} ({})", text.to_string_lossy(), name.to_string_lossy())
        }
        _ => format!("{:?}", e.0),
    }
}

/// What a failed driver call means for the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DriverErrorClass {
    /// No driver, no usable GPU.
    Unavailable,
    /// A sticky error: a kernel faulted and the context is unusable.
    KernelFault,
    /// Anything else.
    Other,
}

/// Sorts a driver result code into a [`DriverErrorClass`].
pub(crate) fn classify(code: sys::CUresult) -> DriverErrorClass {
    use sys::CUresult::*;
    match code {
        CUDA_ERROR_NO_DEVICE
        | CUDA_ERROR_INVALID_DEVICE
        | CUDA_ERROR_DEVICE_NOT_LICENSED
        | CUDA_ERROR_DEVICE_UNAVAILABLE
        | CUDA_ERROR_NOT_INITIALIZED
        | CUDA_ERROR_DEINITIALIZED
        | CUDA_ERROR_STUB_LIBRARY
        | CUDA_ERROR_SHARED_OBJECT_INIT_FAILED
        | CUDA_ERROR_SYSTEM_NOT_READY
        | CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => DriverErrorClass::Unavailable,
        // The sticky errors of the CUDA driver API documentation: after one of them, "the
        // process must be terminated and relaunched".
        CUDA_ERROR_ILLEGAL_ADDRESS
        | CUDA_ERROR_LAUNCH_FAILED
        | CUDA_ERROR_LAUNCH_TIMEOUT
        | CUDA_ERROR_ASSERT
        | CUDA_ERROR_HARDWARE_STACK_ERROR
        | CUDA_ERROR_ILLEGAL_INSTRUCTION
        | CUDA_ERROR_MISALIGNED_ADDRESS
        | CUDA_ERROR_INVALID_ADDRESS_SPACE
        | CUDA_ERROR_INVALID_PC
        | CUDA_ERROR_ECC_UNCORRECTABLE
        | CUDA_ERROR_NVLINK_UNCORRECTABLE => DriverErrorClass::KernelFault,
        _ => DriverErrorClass::Other,
    }
}

impl Error {
    /// The error of driver call `call` that failed with `e`, in the variant its code belongs to.
    pub fn from_driver(call: impl Into<String>, e: &DriverError) -> Self {
        let (call, detail) = (call.into(), describe_driver_error(e));
        match classify(e.0) {
            DriverErrorClass::Unavailable => Error::DriverUnavailable { call, detail },
            DriverErrorClass::KernelFault => Error::KernelFault { call, detail },
            DriverErrorClass::Other => Error::Cuda { call, detail },
        }
    }

    /// Whether the CUDA context is unusable after this error (the process must exit).
    pub fn is_fatal_to_context(&self) -> bool {
        matches!(self, Error::KernelFault { .. })
    }
}

/// The call a bare `?` on a cudarc error names: the call site did not say which.
const UNNAMED_CALL: &str = "driver call";

impl From<DriverError> for Error {
    fn from(e: DriverError) -> Self {
        Error::from_driver(UNNAMED_CALL, &e)
    }
}

/// Names the driver call of a cudarc result, for the error: `stream.synchronize()
/// .cuda_call("cuStreamSynchronize")?`.
pub trait CudaCall<T> {
    /// The result, with a failure turned into an [`Error`] that names `call`.
    fn cuda_call(self, call: &str) -> Result<T>;
}

impl<T> CudaCall<T> for std::result::Result<T, DriverError> {
    fn cuda_call(self, call: &str) -> Result<T> {
        self.map_err(|e| Error::from_driver(call, &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::CUresult;

    #[test]
    fn driver_errors_are_sorted_by_what_to_do() {
        let err = |code| Error::from_driver("cuStreamSynchronize", &DriverError(code));
        let fault = err(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS);
        assert!(matches!(fault, Error::KernelFault { .. }), "{fault:?}");
        assert!(fault.is_fatal_to_context());
        let msg = fault.to_string();
        assert!(msg.starts_with("CUDA cuStreamSynchronize failed"), "{msg}");
        for part in [
            "unusable",
            "compute-sanitizer",
            "CUDA_LAUNCH_BLOCKING=1",
            "bug",
        ] {
            assert!(msg.contains(part), "{part:?} not in {msg}");
        }
        assert!(!msg.contains("nvidia-smi"), "{msg}");

        let missing = err(CUresult::CUDA_ERROR_NO_DEVICE);
        assert!(matches!(missing, Error::DriverUnavailable { .. }));
        assert!(!missing.is_fatal_to_context());
        assert!(missing.to_string().contains("nvidia-smi"), "{missing}");

        let oom = err(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert!(matches!(oom, Error::Cuda { .. }), "{oom:?}");
        assert!(!oom.to_string().contains("nvidia-smi"), "{oom}");
    }

    #[test]
    fn a_named_call_is_kept_and_a_bare_question_mark_says_driver_call() {
        let named: Result<()> =
            Err(DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)).cuda_call("cuModuleLoadData");
        match named.unwrap_err() {
            Error::Cuda { call, .. } => assert_eq!(call, "cuModuleLoadData"),
            other => panic!("{other:?}"),
        }
        let bare: Error = DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED).into();
        match bare {
            Error::KernelFault { call, .. } => assert_eq!(call, UNNAMED_CALL),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn build_problems_say_to_rebuild() {
        let msg = Error::MissingKernel {
            kernel: "lasp_x".into(),
            detail: "named symbol not found".into(),
        }
        .to_string();
        assert!(msg.contains("lasp_x") && msg.contains("rebuild"), "{msg}");
        let msg = Error::UnsupportedGpu {
            compute_capability: (8, 0),
            built: vec!["sm_90a"],
        }
        .to_string();
        assert!(
            msg.contains("8.0") && msg.contains("LASP_EXTRA_CUDA_ARCHS=sm_80a"),
            "{msg}"
        );
        let msg = Error::KernelLaunch {
            kernel: "lasp_allgather".into(),
            detail: "too many resources requested for launch".into(),
        }
        .to_string();
        assert!(
            msg.contains("lasp_allgather") && msg.contains("report"),
            "{msg}"
        );
    }
}
