//! The NVSHMEM host calls of lasp-shmem, as thin wrappers over `nvshmem-sys` that turn NVSHMEM's
//! return codes and null pointers into [`Result`]s.
//!
//! A wrapper is `unsafe` exactly when the call it wraps has a precondition the types cannot
//! check (NVSHMEM initialised, a collective every PE makes, device ranges that must be
//! symmetric); its `# Safety` section says which. The runtime, the symmetric heap and the kernel
//! module call NVSHMEM only through here.

use crate::error::{Error, Result};
use crate::rendezvous::ID_BYTES;
use cudarc::driver::{sys, CudaStream};
use nvshmem_sys::{nvshmemx_uniqueid_t, NvshmemHost};

// The id travels between ranks as plain bytes.
const _: () = assert!(std::mem::size_of::<nvshmemx_uniqueid_t>() == ID_BYTES);

/// `Ok` for NVSHMEM's success code 0, else the error naming `call` and the code.
pub(crate) fn check(call: &'static str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Nvshmem {
            call,
            detail: format!("returned {rc}"),
        })
    }
}

/// The loaded host library.
#[derive(Clone, Copy)]
pub(crate) struct Nvshmem {
    lib: &'static NvshmemHost,
}

impl Nvshmem {
    pub(crate) fn new(lib: &'static NvshmemHost) -> Self {
        Nvshmem { lib }
    }

    /// The host library's version, (major, minor, patch). Callable before init.
    pub(crate) fn version(self) -> (i32, i32, i32) {
        let (mut major, mut minor, mut patch) = (0, 0, 0);
        // SAFETY: callable before init; writes three ints that outlive the call.
        unsafe {
            self.lib
                .nvshmemx_vendor_get_version_info(&mut major, &mut minor, &mut patch)
        };
        (major, minor, patch)
    }

    /// NVSHMEM's (PE, number of PEs) where it is already initialised in this process (by another
    /// library: PyTorch's SymmetricMemory NVSHMEM backend), else `None`.
    pub(crate) fn initialized_place(self) -> Option<(usize, usize)> {
        // SAFETY: a plain query, callable at any time.
        let status = unsafe { self.lib.nvshmemx_init_status() };
        if status < nvshmem_sys::nvshmemx_init_status_t_NVSHMEM_STATUS_IS_INITIALIZED as i32 {
            return None;
        }
        // SAFETY: plain queries of an initialised NVSHMEM.
        let (pe, npes) = unsafe { (self.lib.nvshmem_my_pe(), self.lib.nvshmem_n_pes()) };
        Some((pe.max(0) as usize, npes.max(0) as usize))
    }

    /// A fresh unique id (rank 0 of a unique-id bootstrap), as plain bytes. Callable before init.
    pub(crate) fn unique_id(self) -> Result<[u8; ID_BYTES]> {
        let mut id = nvshmem_sys::uniqueid_initializer();
        // SAFETY: `id` is a valid, version-stamped nvshmemx_uniqueid_t that outlives the call.
        let rc = unsafe { self.lib.nvshmemx_get_uniqueid(&mut id) };
        check("nvshmemx_get_uniqueid", rc)?;
        // SAFETY: nvshmemx_uniqueid_t is ID_BYTES (asserted above) of plain data.
        Ok(unsafe { std::mem::transmute::<nvshmemx_uniqueid_t, [u8; ID_BYTES]>(id) })
    }

    /// Initialises NVSHMEM: by unique id when `unique_id` is given (rank `rank` of `nranks`,
    /// every rank passing rank 0's id), else through the bootstrap plugin `NVSHMEM_BOOTSTRAP`
    /// selects (PMI, MPI). Returns NVSHMEM's (PE, number of PEs).
    ///
    /// # Safety
    /// At most one initialisation per process is live; the CUDA context NVSHMEM is to use (the
    /// device's primary context) is current on this thread.
    pub(crate) unsafe fn init(
        self,
        unique_id: Option<(&[u8; ID_BYTES], usize, usize)>,
    ) -> Result<(usize, usize)> {
        let mut attr = nvshmem_sys::init_attr_initializer();
        // The id must outlive the init call: NVSHMEM keeps a pointer to it until then.
        let uid: nvshmemx_uniqueid_t;
        let flags = match unique_id {
            Some((bytes, rank, nranks)) => {
                let to_int = |what: &str, v: usize| {
                    i32::try_from(v).map_err(|_| {
                        Error::InvalidArgument(format!("{what} {v} does not fit NVSHMEM's int"))
                    })
                };
                let (rank, nranks) = (to_int("rank", rank)?, to_int("world size", nranks)?);
                // SAFETY: the bytes came from an nvshmemx_uniqueid_t (unique_id above, on rank 0)
                // and the type is plain data of that size.
                uid = unsafe { std::mem::transmute::<[u8; ID_BYTES], nvshmemx_uniqueid_t>(*bytes) };
                // SAFETY: uid and attr are valid and live until init returns below.
                let rc = unsafe {
                    self.lib
                        .nvshmemx_set_attr_uniqueid_args(rank, nranks, &uid, &mut attr)
                };
                check("nvshmemx_set_attr_uniqueid_args", rc)?;
                nvshmem_sys::flags_NVSHMEMX_INIT_WITH_UNIQUEID as u32
            }
            None => 0,
        };
        // SAFETY: attr is version-stamped; the caller's contract covers the context and the
        // single initialisation.
        let rc = unsafe { self.lib.nvshmemx_hostlib_init_attr(flags, &mut attr) };
        check("nvshmemx_hostlib_init_attr", rc)?;
        // init can return 0 while only bootstrapped (it swallows some failures): check the state.
        // SAFETY: a plain query.
        let status = unsafe { self.lib.nvshmemx_init_status() };
        if status < nvshmem_sys::nvshmemx_init_status_t_NVSHMEM_STATUS_IS_INITIALIZED as i32 {
            return Err(Error::Nvshmem {
                call: "nvshmemx_hostlib_init_attr",
                detail: format!("NVSHMEM is not initialised after init (status {status})"),
            });
        }
        // SAFETY: plain queries, after a successful init.
        let (pe, npes) = unsafe { (self.lib.nvshmem_my_pe(), self.lib.nvshmem_n_pes()) };
        Ok((pe.max(0) as usize, npes.max(0) as usize))
    }

    /// Releases NVSHMEM.
    ///
    /// # Safety
    /// NVSHMEM is initialised; every PE calls it; no NVSHMEM resource of this process (symmetric
    /// memory, registered module) is used after it.
    pub(crate) unsafe fn finalize(self) {
        // SAFETY: the caller's contract.
        unsafe { self.lib.nvshmemx_hostlib_finalize() }
    }

    /// `bytes` of symmetric memory (collective), or an error that says how to make room.
    ///
    /// # Safety
    /// NVSHMEM is initialised and every PE makes the same allocation in the same order.
    pub(crate) unsafe fn malloc(self, bytes: usize) -> Result<sys::CUdeviceptr> {
        // SAFETY: the caller's contract.
        let ptr = unsafe { self.lib.nvshmem_malloc(bytes) } as sys::CUdeviceptr;
        if ptr == 0 {
            return Err(Error::Nvshmem {
                call: "nvshmem_malloc",
                detail: format!(
                    "no room for {bytes} bytes in the symmetric heap; raise \
                     Config::symmetric_heap_bytes and NVSHMEM_SYMMETRIC_SIZE (NVSHMEM reads it \
                     from the environment once: set it before the process starts)"
                ),
            });
        }
        Ok(ptr)
    }

    /// Frees symmetric memory (collective).
    ///
    /// # Safety
    /// `ptr` came from [`Nvshmem::malloc`] and is not used after this; every PE frees the same
    /// allocations in the same order.
    pub(crate) unsafe fn free(self, ptr: sys::CUdeviceptr) {
        // SAFETY: the caller's contract.
        unsafe { self.lib.nvshmem_free(ptr as _) }
    }

    /// A host-blocking barrier over all PEs that also completes every PE's outstanding NVSHMEM
    /// operations.
    ///
    /// # Safety
    /// NVSHMEM is initialised and every PE calls it.
    pub(crate) unsafe fn barrier_all(self) {
        // SAFETY: the caller's contract.
        unsafe { self.lib.nvshmem_barrier_all() }
    }

    /// A barrier over all PEs, ordered on `stream`.
    ///
    /// # Safety
    /// NVSHMEM is initialised, every PE calls it, and `stream` belongs to the context NVSHMEM
    /// was initialised in.
    pub(crate) unsafe fn barrier_all_on_stream(self, stream: &CudaStream) {
        // SAFETY: the caller's contract.
        unsafe {
            self.lib
                .nvshmemx_barrier_all_on_stream(stream.cu_stream() as _)
        }
    }

    /// All-gathers `bytes` per PE from `src` into `dest` (`[npes][bytes]`) on every PE, ordered
    /// on `stream` (collective, NVSHMEM_TEAM_WORLD).
    ///
    /// # Safety
    /// As [`Nvshmem::barrier_all_on_stream`], and: `src .. src + bytes` and `dest .. dest +
    /// npes * bytes` are ranges of the symmetric heap that do not overlap, stay allocated and
    /// are not otherwise accessed until the collective completes on `stream`.
    pub(crate) unsafe fn fcollect_on_stream(
        self,
        stream: &CudaStream,
        dest: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        let rc = unsafe {
            self.lib.nvshmemx_fcollectmem_on_stream(
                nvshmem_sys::nvshmem_team_id_t_NVSHMEM_TEAM_WORLD,
                dest as _,
                src as _,
                bytes,
                stream.cu_stream() as _,
            )
        };
        check("nvshmemx_fcollectmem_on_stream", rc)
    }

    /// Copies `bytes` from symmetric `src` on PE `pe` to `dest` on this PE, ordered on `stream`.
    ///
    /// # Safety
    /// NVSHMEM is initialised; `stream` belongs to its context; `src .. src + bytes` is symmetric
    /// memory allocated on `pe`, `dest .. dest + bytes` device memory of this PE, both valid and
    /// not otherwise written until the copy completes on `stream`.
    pub(crate) unsafe fn getmem_on_stream(
        self,
        stream: &CudaStream,
        dest: sys::CUdeviceptr,
        src: sys::CUdeviceptr,
        bytes: usize,
        pe: usize,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            self.lib.nvshmemx_getmem_on_stream(
                dest as _,
                src as _,
                bytes,
                pe as i32,
                stream.cu_stream() as _,
            )
        }
    }

    /// Registers a loaded module's NVSHMEM device state with this process's NVSHMEM.
    ///
    /// # Safety
    /// NVSHMEM is initialised and `module` is loaded in the current context.
    pub(crate) unsafe fn cumodule_init(self, module: sys::CUmodule) -> Result<()> {
        // SAFETY: the caller's contract.
        let rc = unsafe { self.lib.nvshmemx_cumodule_init(module as _) };
        check("nvshmemx_cumodule_init", rc).map_err(|_| Error::Nvshmem {
            call: "nvshmemx_cumodule_init",
            detail: format!(
                "returned {rc}: the cubin's NVSHMEM device library does not match the host library"
            ),
        })
    }

    /// Unregisters a module registered with [`Nvshmem::cumodule_init`].
    ///
    /// # Safety
    /// No kernel of the module is running or will run; its context is current.
    pub(crate) unsafe fn cumodule_finalize(self, module: sys::CUmodule) -> Result<()> {
        // SAFETY: the caller's contract.
        let rc = unsafe { self.lib.nvshmemx_cumodule_finalize(module as _) };
        check("nvshmemx_cumodule_finalize", rc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonzero_code_names_the_call_and_the_code() {
        assert!(check("nvshmemx_get_uniqueid", 0).is_ok());
        let msg = check("nvshmemx_get_uniqueid", 7).unwrap_err().to_string();
        assert!(
            msg.contains("NVSHMEM nvshmemx_get_uniqueid failed: returned 7"),
            "{msg}"
        );
        assert!(msg.contains("NVSHMEM_DEBUG=WARN"), "{msg}");
    }
}
