//! An NCCL communicator over the runtime's PEs: the host-collective baseline the device-initiated
//! exchanges are compared with, and the all-gather of the sequential LASP-2 mode.
//!
//! Built on cudarc's `result` layer because its safe `Comm` exposes neither the raw handle nor an
//! in-place all-gather.

use crate::error::{CudaCall, Error, Result};
use crate::runtime::Runtime;
use cudarc::driver::{CudaStream, DevicePtr};
use cudarc::nccl::{result, sys};
use std::ffi::c_void;
use std::sync::Arc;

/// An NCCL communicator. The all-gather runs on the stream its caller orders it on; the small
/// host-value collectives on the stream given at creation.
pub struct NcclComm {
    raw: sys::ncclComm_t,
    stream: Arc<CudaStream>,
    rank: usize,
    nranks: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; NcclComm is not
// Sync, so its &self methods (which only enqueue work on streams of the communicator's context)
// never run on two threads at once.
unsafe impl Send for NcclComm {}

fn nccl_error(call: &'static str, e: result::NcclError) -> Error {
    Error::Nccl {
        call,
        detail: format!("{e:?}"),
    }
}

/// Loads and closes NCCL's library: whether cudarc will find it.
fn load_check() -> std::result::Result<(), libloading::Error> {
    // SAFETY: only loads and closes the library.
    unsafe { libloading::Library::new("libnccl.so") }.map(drop)
}

/// Whether this process can create an [`NcclComm`] (NCCL's library is found).
pub fn available() -> bool {
    load_check().is_ok()
}

impl NcclComm {
    /// Creates the communicator on every PE (collective). Rank 0's id travels over NVSHMEM, so
    /// this works under every launcher the runtime supports.
    pub fn new(runtime: &Runtime, stream: &Arc<CudaStream>) -> Result<Self> {
        // cudarc panics when it cannot find NCCL: look first, so the error says what to do.
        if let Err(e) = load_check() {
            return Err(Error::Nccl {
                call: "loading libnccl.so",
                detail: format!(
                    "not found ({e}): add NCCL's lib folder to LD_LIBRARY_PATH (pip's nvidia-nccl \
                     ships libnccl.so.2; scripts/gpu-env.sh links libnccl.so to it)"
                ),
            });
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if runtime.pe() == 0 {
            id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
        }
        let mut bytes = id.internal.map(|c| c as u8);
        runtime.broadcast_bytes(&mut bytes, 0)?;
        id.internal = bytes.map(|b| b as std::ffi::c_char);
        let mut raw = std::ptr::null_mut();
        runtime
            .context()
            .bind_to_thread()
            .cuda_call("cuCtxSetCurrent")?;
        // SAFETY: `raw` receives the new communicator; the id is rank 0's, broadcast above, and
        // every rank makes this call (collective by this fn's contract).
        unsafe { result::comm_init_rank(&mut raw, runtime.npes() as i32, id, runtime.pe() as i32) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(NcclComm {
            raw,
            stream: stream.clone(),
            rank: runtime.pe(),
            nranks: runtime.npes(),
        })
    }

    /// In-place all-gather of `bytes` per rank in the device range starting at `base`
    /// (`[nranks][bytes]`; this rank's block is the source), enqueued on `stream` (a stream of
    /// the communicator's context), after the work already there.
    ///
    /// # Safety
    /// `base .. base + nranks * bytes` must be device memory of this context that stays valid,
    /// and is not otherwise accessed, until the collective completes on `stream`.
    pub unsafe fn all_gather_in_place(
        &self,
        stream: &CudaStream,
        base: u64,
        bytes: usize,
    ) -> Result<()> {
        let send = base + (self.rank * bytes) as u64;
        // SAFETY: the caller's contract covers the range and its ordering; `raw` is a live
        // communicator of this context.
        unsafe {
            result::all_gather(
                send as *const c_void,
                base as *mut c_void,
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.raw,
                stream.cu_stream() as _,
            )
        }
        .map(|_| ())
        .map_err(|e| nccl_error("ncclAllGather", e))
    }

    /// Every rank's `value`, in rank order (collective; synchronises the stream).
    pub fn gather_f64(&self, value: f64) -> Result<Vec<f64>> {
        let mut values = vec![0.0f64; self.nranks];
        values[self.rank] = value;
        let buf = self
            .stream
            .clone_htod(&values)
            .cuda_call("cuMemcpyHtoDAsync")?;
        // SAFETY: `buf` holds one f64 per rank of the communicator, in this context, and outlives
        // the synchronisation below.
        unsafe {
            self.all_gather_in_place(
                &self.stream,
                buf.device_ptr(&self.stream).0,
                std::mem::size_of::<f64>(),
            )?;
        }
        self.stream.clone_dtoh(&buf).cuda_call("cuMemcpyDtoHAsync")
    }

    /// The maximum of `value` over all ranks (collective; synchronises the stream).
    pub fn max_f64(&self, value: f64) -> Result<f64> {
        let buf = self
            .stream
            .clone_htod(&[value])
            .cuda_call("cuMemcpyHtoDAsync")?;
        let ptr = buf.device_ptr(&self.stream).0;
        // SAFETY: in-place all-reduce of one f64 in `buf`, which outlives the synchronisation.
        unsafe {
            result::all_reduce(
                ptr as *const c_void,
                ptr as *mut c_void,
                1,
                sys::ncclDataType_t::ncclFloat64,
                sys::ncclRedOp_t::ncclMax,
                self.raw,
                self.stream.cu_stream() as _,
            )
        }
        .map_err(|e| nccl_error("ncclAllReduce", e))?;
        Ok(self
            .stream
            .clone_dtoh(&buf)
            .cuda_call("cuMemcpyDtoHAsync")?[0])
    }
}

/// Device memory registered with a communicator as a symmetric window (`NCCL_WIN_COLL_SYMMETRIC`,
/// NCCL 2.27 on): NCCL's collectives on it may take its symmetric kernels, which read and write
/// the peers' windows directly. The memory is NCCL's own (`ncclMemAlloc`, [`NcclComm::window`])
/// or the caller's ([`NcclComm::register_window`]: NVSHMEM's symmetric heap, for one).
/// Registration and [`NcclWindow::free`] are collective; a window dropped without `free` stays
/// registered (and NCCL's memory allocated) until the communicator is destroyed.
pub struct NcclWindow {
    ptr: u64,
    bytes: usize,
    win: sys::ncclWindow_t,
    /// Whether the memory is NCCL's, which `free` returns.
    owned: bool,
}

// SAFETY: the window handle is only an argument of NCCL calls made with its communicator, which
// is Send; nothing dereferences it on the host.
unsafe impl Send for NcclWindow {}

/// `NCCL_WIN_COLL_SYMMETRIC` of nccl.h (2.27 on), which cudarc's bindings do not carry.
const NCCL_WIN_COLL_SYMMETRIC: i32 = 0x01;

impl NcclWindow {
    /// The device address of the window's first byte (4096-byte aligned).
    pub fn addr(&self) -> u64 {
        self.ptr
    }

    /// The window's size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the window has no bytes (never: windows are made non-empty).
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Deregisters the window from `comm` and frees NCCL's memory (collective: every rank frees
    /// its window of the same registration, in the same order).
    pub fn free(self, comm: &NcclComm) -> Result<()> {
        comm.stream
            .context()
            .synchronize()
            .cuda_call("cuCtxSynchronize")?;
        // SAFETY: `win` was registered with this communicator by `NcclComm::window`, and the
        // synchronisation above finished every collective on it.
        let status = unsafe { sys::ncclCommWindowDeregister(comm.raw, self.win) };
        nccl_status("ncclCommWindowDeregister", status)?;
        if !self.owned {
            return Ok(());
        }
        // SAFETY: `ptr` came from ncclMemAlloc and nothing uses it any more.
        let status = unsafe { sys::ncclMemFree(self.ptr as *mut c_void) };
        nccl_status("ncclMemFree", status)
    }
}

fn nccl_status(call: &'static str, status: sys::ncclResult_t) -> Result<()> {
    if status == sys::ncclResult_t::ncclSuccess {
        Ok(())
    } else {
        Err(Error::Nccl {
            call,
            detail: format!("{status:?}"),
        })
    }
}

impl NcclComm {
    /// `bytes` (> 0) of device memory from `ncclMemAlloc`, zeroed, registered as a symmetric
    /// window (collective: every rank asks for the same size, in the same order). Fails where the
    /// loaded NCCL has no windows (before 2.27) or refuses the registration.
    pub fn window(&self, bytes: usize) -> Result<NcclWindow> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "NcclComm::window: 0 bytes; ask for the all-gather's whole buffer".into(),
            ));
        }
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `ptr` receives the allocation.
        nccl_status("ncclMemAlloc", unsafe {
            sys::ncclMemAlloc(&mut ptr, bytes)
        })?;
        // SAFETY: `ptr` holds `bytes` bytes of this context's device memory.
        unsafe {
            cudarc::driver::result::memset_d8_async(ptr as u64, 0, bytes, self.stream.cu_stream())
        }
        .cuda_call("cuMemsetD8Async")?;
        // SAFETY: `ptr` is a live allocation of `bytes` bytes; every rank makes this call.
        match unsafe { self.register_window(ptr as u64, bytes) } {
            Ok(window) => Ok(NcclWindow {
                owned: true,
                ..window
            }),
            Err(e) => {
                // SAFETY: unregistered, unused.
                let _ = unsafe { sys::ncclMemFree(ptr) };
                Err(e)
            }
        }
    }

    /// Registers the caller's `bytes` at `ptr` as a symmetric window (collective: every rank
    /// registers the same size, in the same order). `free` deregisters it and leaves the memory.
    ///
    /// # Safety
    /// `ptr .. ptr + bytes` must be device memory of this context that NCCL can map (cuMem
    /// allocations: `ncclMemAlloc`'s, NVSHMEM's symmetric heap), live until the window is freed.
    pub unsafe fn register_window(&self, ptr: u64, bytes: usize) -> Result<NcclWindow> {
        let mut win = std::ptr::null_mut();
        // SAFETY: the caller's contract covers the memory; `raw` is a live communicator.
        let status = unsafe {
            sys::ncclCommWindowRegister(
                self.raw,
                ptr as *mut c_void,
                bytes,
                &mut win,
                NCCL_WIN_COLL_SYMMETRIC,
            )
        };
        nccl_status("ncclCommWindowRegister", status)?;
        Ok(NcclWindow {
            ptr,
            bytes,
            win,
            owned: false,
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Pending collectives, on whichever stream, must finish before the communicator goes.
        let _ = self.stream.context().synchronize();
        // SAFETY: the handle came from ncclCommInitRank and is not used after this.
        let _ = unsafe { result::comm_destroy(self.raw) };
    }
}
