//! Status codes of the C ABI and the message of the last failed call on each thread.
//!
//! Every entry point runs its body through [`run`]: an [`Error`] becomes a status code and a
//! message that [`lasp_last_error`] returns, and a panic (a bug of ours) becomes
//! [`LASP_ERROR_INTERNAL`] instead of unwinding into C, which would abort the process.

use crate::error::Error;
use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// `lasp_status`: what every entry point returns.
pub type Status = i32;

pub const LASP_OK: Status = 0;
/// A shape, pointer, mode or handle was rejected; nothing was enqueued and no communication
/// started.
pub const LASP_ERROR_INVALID_ARGUMENT: Status = 1;
/// The launch environment or the bootstrap rendezvous is inconsistent.
pub const LASP_ERROR_LAUNCH: Status = 2;
/// A CUDA driver call failed: no driver or no usable GPU (the message says to check
/// `nvidia-smi`), or another driver call failed (out of memory, a bad handle). Kernel faults and
/// refused launches have their own codes.
pub const LASP_ERROR_CUDA: Status = 3;
/// NVSHMEM could not be loaded, is of another version, or one of its calls failed.
pub const LASP_ERROR_NVSHMEM: Status = 4;
/// A bounded wait on another GPU expired; the message names the PE, the slot and the epoch.
pub const LASP_ERROR_PEER_TIMEOUT: Status = 5;
/// A call came in the wrong order (initialised twice, shut down with live handles).
pub const LASP_ERROR_STATE: Status = 6;
/// A bug in lasp-shmem (a panic was caught); the message says where.
pub const LASP_ERROR_INTERNAL: Status = 7;
/// An NCCL call failed (the sequential NCCL exchange mode).
pub const LASP_ERROR_NCCL: Status = 8;
/// A kernel faulted on the GPU (illegal address, device-side assert), here or at an earlier
/// call: the CUDA context is unusable and the process must exit. A bug to report.
pub const LASP_ERROR_KERNEL_FAULT: Status = 9;
/// The driver refused to launch a kernel (shape or shared memory too large for this GPU);
/// nothing was enqueued. A bug to report.
pub const LASP_ERROR_KERNEL_LAUNCH: Status = 10;
/// The library was built without a kernel this call needs, or without kernels for this GPU's
/// architecture: rebuild it.
pub const LASP_ERROR_BUILD: Status = 11;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// The status code of an error.
pub fn status_of(error: &Error) -> Status {
    match error {
        Error::InvalidArgument(_) => LASP_ERROR_INVALID_ARGUMENT,
        Error::Launch(_) | Error::Rendezvous(_) => LASP_ERROR_LAUNCH,
        Error::Cuda { .. } | Error::DriverUnavailable { .. } => LASP_ERROR_CUDA,
        Error::NvshmemLoad(_) | Error::Nvshmem { .. } | Error::VersionMismatch { .. } => {
            LASP_ERROR_NVSHMEM
        }
        Error::PeerTimeout { .. } => LASP_ERROR_PEER_TIMEOUT,
        Error::State(_) => LASP_ERROR_STATE,
        Error::Nccl { .. } => LASP_ERROR_NCCL,
        Error::KernelFault { .. } => LASP_ERROR_KERNEL_FAULT,
        Error::KernelLaunch { .. } => LASP_ERROR_KERNEL_LAUNCH,
        Error::MissingKernel { .. } | Error::UnsupportedGpu { .. } => LASP_ERROR_BUILD,
    }
}

fn remember(message: String) {
    // Interior NULs would cut the C string short: show them instead.
    let message = CString::new(message.replace('\0', "\\0")).expect("NULs were replaced");
    LAST_ERROR.with(|last| *last.borrow_mut() = message);
}

/// Runs one entry point's body: `Ok` is [`LASP_OK`]; an error or a panic is remembered for
/// [`lasp_last_error`] and turned into its status code.
pub fn run(body: impl FnOnce() -> crate::Result<()>) -> Status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => LASP_OK,
        Ok(Err(error)) => {
            remember(format!("lasp-shmem: {error}"));
            status_of(&error)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            remember(format!(
                "lasp-shmem: internal error ({what}); this is a bug in lasp-shmem, please report \
                 it with this message"
            ));
            LASP_ERROR_INTERNAL
        }
    }
}

/// The message of the last call on this thread that did not return `LASP_OK` ("" if none). The
/// pointer stays valid until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn lasp_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: lasp_last_error returns a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(lasp_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn errors_and_panics_become_codes_and_messages() {
        assert_eq!(run(|| Ok(())), LASP_OK);
        let code = run(|| Err(Error::InvalidArgument("q is NULL; pass a tensor".into())));
        assert_eq!(code, LASP_ERROR_INVALID_ARGUMENT);
        assert_eq!(last(), "lasp-shmem: q is NULL; pass a tensor");
        // A success leaves the last failure's message in place (as errno does).
        assert_eq!(run(|| Ok(())), LASP_OK);
        assert_eq!(last(), "lasp-shmem: q is NULL; pass a tensor");
        let code = run(|| panic!("index out of bounds"));
        assert_eq!(code, LASP_ERROR_INTERNAL);
        assert!(
            last().contains("internal error (index out of bounds)"),
            "{}",
            last()
        );
        assert_eq!(run(|| Err(Error::State("a\0b".into()))), LASP_ERROR_STATE);
        assert_eq!(last(), "lasp-shmem: a\\0b");
    }

    #[test]
    fn every_error_kind_has_its_own_code() {
        let timeout = Error::PeerTimeout {
            waiting_pe: 1,
            peer_pe: 0,
            slot: 2,
            what: "data",
            expected_epoch: 3,
            seen_epoch: 2,
            waited_ms: 10.0,
        };
        let cases = [
            (
                Error::InvalidArgument(String::new()),
                LASP_ERROR_INVALID_ARGUMENT,
            ),
            (Error::Launch(String::new()), LASP_ERROR_LAUNCH),
            (Error::Rendezvous(String::new()), LASP_ERROR_LAUNCH),
            (
                Error::Cuda {
                    call: String::new(),
                    detail: String::new(),
                },
                LASP_ERROR_CUDA,
            ),
            (
                Error::Nvshmem {
                    call: "x",
                    detail: String::new(),
                },
                LASP_ERROR_NVSHMEM,
            ),
            (
                Error::VersionMismatch {
                    host: (3, 3, 0),
                    device: (3, 4, 5),
                },
                LASP_ERROR_NVSHMEM,
            ),
            (timeout, LASP_ERROR_PEER_TIMEOUT),
            (Error::State(String::new()), LASP_ERROR_STATE),
            (
                Error::DriverUnavailable {
                    call: String::new(),
                    detail: String::new(),
                },
                LASP_ERROR_CUDA,
            ),
            (
                Error::Nccl {
                    call: "ncclAllGather",
                    detail: String::new(),
                },
                LASP_ERROR_NCCL,
            ),
            (
                Error::KernelFault {
                    call: String::new(),
                    detail: String::new(),
                },
                LASP_ERROR_KERNEL_FAULT,
            ),
            (
                Error::KernelLaunch {
                    kernel: String::new(),
                    detail: String::new(),
                },
                LASP_ERROR_KERNEL_LAUNCH,
            ),
            (
                Error::MissingKernel {
                    kernel: String::new(),
                    detail: String::new(),
                },
                LASP_ERROR_BUILD,
            ),
            (
                Error::UnsupportedGpu {
                    compute_capability: (8, 0),
                    built: Vec::new(),
                },
                LASP_ERROR_BUILD,
            ),
        ];
        for (error, code) in cases {
            assert_eq!(status_of(&error), code, "{error:?}");
        }
    }

    /// Every status code, as the header must define it.
    const CODES: [(&str, Status); 12] = [
        ("LASP_OK", LASP_OK),
        ("LASP_ERROR_INVALID_ARGUMENT", LASP_ERROR_INVALID_ARGUMENT),
        ("LASP_ERROR_LAUNCH", LASP_ERROR_LAUNCH),
        ("LASP_ERROR_CUDA", LASP_ERROR_CUDA),
        ("LASP_ERROR_NVSHMEM", LASP_ERROR_NVSHMEM),
        ("LASP_ERROR_PEER_TIMEOUT", LASP_ERROR_PEER_TIMEOUT),
        ("LASP_ERROR_STATE", LASP_ERROR_STATE),
        ("LASP_ERROR_INTERNAL", LASP_ERROR_INTERNAL),
        ("LASP_ERROR_NCCL", LASP_ERROR_NCCL),
        ("LASP_ERROR_KERNEL_FAULT", LASP_ERROR_KERNEL_FAULT),
        ("LASP_ERROR_KERNEL_LAUNCH", LASP_ERROR_KERNEL_LAUNCH),
        ("LASP_ERROR_BUILD", LASP_ERROR_BUILD),
    ];

    #[test]
    fn the_header_defines_every_code_with_its_value_and_codes_only_grow() {
        const HEADER: &str = include_str!("../../include/lasp_shmem.h");
        for (i, (name, value)) in CODES.into_iter().enumerate() {
            // Codes are appended, never renumbered: C callers compiled against an older header
            // keep meaning the same thing.
            assert_eq!(value, i as Status, "{name}");
            let defined = HEADER
                .lines()
                .filter_map(|line| line.strip_prefix("#define "))
                .find_map(|rest| {
                    let mut words = rest.split_whitespace();
                    (words.next() == Some(name)).then(|| words.next().map(str::parse::<Status>))
                })
                .flatten()
                .unwrap_or_else(|| panic!("{name} is not defined in lasp_shmem.h"));
            assert_eq!(defined, Ok(value), "{name}");
        }
    }
}
