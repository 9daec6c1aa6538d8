//! Opening this rank's GPU, with one-line errors where cudarc would panic.

use crate::error::{describe_driver_error, Error, Result};
use cudarc::driver::CudaContext;
use std::sync::Arc;

/// The number of GPUs this process can see, or an error that says why it sees none.
pub fn visible_gpu_count() -> Result<usize> {
    // cudarc panics when it cannot find the driver library: look for it first.
    // SAFETY: loading the driver library runs no code of ours; it is closed again at once.
    if let Err(e) = unsafe { libloading::Library::new("libcuda.so.1") } {
        return Err(Error::Cuda {
            call: "loading libcuda.so.1".into(),
            detail: format!("no NVIDIA driver on this machine ({e})"),
        });
    }
    CudaContext::device_count()
        .map(|n| n as usize)
        .map_err(|e| Error::Cuda {
            call: "cuInit/cuDeviceGetCount".into(),
            detail: format!(
                "{}: no GPU is usable (is CUDA_VISIBLE_DEVICES empty or wrong?)",
                describe_driver_error(&e)
            ),
        })
}

/// Retains the primary context of GPU `local_rank` and binds it to this thread. The primary
/// context is the one NVSHMEM and the CUDA runtime adopt, so it must be current before init.
pub fn open_gpu(local_rank: usize) -> Result<Arc<CudaContext>> {
    let count = visible_gpu_count()?;
    if count == 0 {
        return Err(Error::Cuda {
            call: "cuDeviceGetCount".into(),
            detail: "no GPU is visible".into(),
        });
    }
    if local_rank >= count {
        return Err(Error::Launch(format!(
            "local rank {local_rank} needs GPU {local_rank} but this node shows {count} GPU(s); start at most {count} ranks per node (check CUDA_VISIBLE_DEVICES)"
        )));
    }
    let ctx = CudaContext::new(local_rank)?;
    // Ordering is ours to keep (one stream per operation, explicit events); cudarc's per-buffer
    // event tracking would add an event record to every launch on the hot path.
    // SAFETY: no cudarc buffer exists on this context yet.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}
