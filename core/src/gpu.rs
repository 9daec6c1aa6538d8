//! Opening this rank's GPU, with one-line errors where cudarc would panic.

use crate::error::{describe_driver_error, CudaCall, Error, Result};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// The number of GPUs this process can see, or an error that says why it sees none.
pub fn visible_gpu_count() -> Result<usize> {
    // cudarc panics when it cannot find the driver library: look for it first.
    // SAFETY: loading the driver library runs no code of ours; it is closed again at once.
    if let Err(e) = unsafe { libloading::Library::new("libcuda.so.1") } {
        return Err(Error::DriverUnavailable {
            call: "loading libcuda.so.1".into(),
            detail: format!("no NVIDIA driver on this machine ({e})"),
        });
    }
    CudaContext::device_count()
        .map(|n| n as usize)
        .map_err(|e| Error::DriverUnavailable {
            call: "cuInit/cuDeviceGetCount".into(),
            detail: format!(
                "{}: no GPU is usable (is CUDA_VISIBLE_DEVICES empty or wrong?)",
                describe_driver_error(&e)
            ),
        })
}

/// Retains the primary context of GPU `local_rank` and binds it to this thread. The primary
/// context is the one NVSHMEM and the CUDA runtime adopt, so it must be current before init.
/// Waits for the whole context when dropped. Declared before device memory that kernels on other
/// streams may still use (fields drop in declaration order), it puts that memory's free, which
/// cudarc orders only on the memory's own stream, after every such kernel.
pub(crate) struct ContextSync(pub(crate) Arc<CudaContext>);

impl Drop for ContextSync {
    fn drop(&mut self) {
        let _ = self.0.synchronize();
    }
}

pub fn open_gpu(local_rank: usize) -> Result<Arc<CudaContext>> {
    let count = visible_gpu_count()?;
    if count == 0 {
        return Err(Error::DriverUnavailable {
            call: "cuDeviceGetCount".into(),
            detail: "no GPU is visible".into(),
        });
    }
    if local_rank >= count {
        return Err(Error::Launch(format!(
            "local rank {local_rank} needs GPU {local_rank} but this node shows {count} GPU(s); start at most {count} ranks per node (check CUDA_VISIBLE_DEVICES)"
        )));
    }
    let ctx = CudaContext::new(local_rank).cuda_call("cuDevicePrimaryCtxRetain")?;
    // Ordering is ours to keep, once per call and only across streams: cudarc's per-buffer
    // event tracking would record an event per buffer on every launch of the hot path.
    //
    // SAFETY: this only switches tracking off for the CudaSlices allocated on this context from
    // now on (none exists yet, so none is left half-tracked). It hands cudarc's obligations for
    // each such slice to whoever uses it on more than one stream: (1) it is not freed (dropped)
    // before every use on another stream has finished, (2) it is not used on another stream
    // before its allocation on the allocating stream has finished, (3) it is not written by two
    // streams at once. They are discharged:
    // - for slices callers pass to the operations as `DeviceRef` / `DeviceMut`, by the operation
    //   (`ops::StreamOrder`): where the slice's stream is not the call's, the call's stream
    //   waits for the slice's before the first launch (2, 3) and the slice's stream waits for
    //   the call's work after the last (1: cudarc frees the slice on its own stream); the view
    //   borrows the slice for the call (3: no safe code writes it meanwhile);
    // - for the slices the operations and the exchange own and use on callers' streams (the
    //   chain's epoch and diagnostics, the workspaces, the transport's round words), by a
    //   `ContextSync` declared before them, which synchronises the context when it drops
    //   (`StateChain`, `AllGather`, `PingPong`; the LASP-2 operations' workspaces drop after
    //   their chain, which comes first), and
    //   by synchronising before a workspace is replaced (`ops::ensure_workspace`);
    // - for the runtime's own scratch (`broadcast_bytes`, `all_gather_u64`), by synchronising
    //   the runtime's stream before freeing.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}
