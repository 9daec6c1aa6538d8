//! The embedded kernel module: loading it for this GPU, registering it with NVSHMEM, launching
//! its kernels. This is the one place that holds raw `CUmodule`/`CUfunction` handles.

use crate::error::{describe_driver_error, Error, Result};
use cudarc::driver::{result as cu, sys, CudaContext, CudaStream};
use nvshmem_sys::NvshmemHost;
use std::ffi::{c_void, CString};
use std::sync::Arc;

/// The cubin of `lasp-shmem-kernels` loaded into this GPU's primary context and registered with
/// NVSHMEM (its `nvshmemi_device_state_d` holds this process's NVSHMEM state).
pub struct Module {
    handle: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUmodule may be used from any thread once its context is current there; every use
// binds the context first.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

/// A kernel of the module. Every kernel takes one by-value parameter struct.
#[derive(Clone, Copy)]
pub struct Kernel {
    function: sys::CUfunction,
    name: &'static str,
}

// SAFETY: see Module.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Module {
    pub(crate) fn load(lib: &NvshmemHost, ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability()?;
        let cubin = lasp_shmem_kernels::cubin_for(major, minor).ok_or_else(|| {
            Error::Launch(format!(
                "no kernels were built for this GPU (compute capability {major}.{minor}; built: {:?}); rebuild with LASP_EXTRA_CUDA_ARCHS=sm_{major}{minor}a",
                lasp_shmem_kernels::CUBINS.iter().map(|c| c.arch).collect::<Vec<_>>()
            ))
        })?;
        ctx.bind_to_thread()?;
        // SAFETY: the image is a complete executable cubin (checked by the kernels crate's tests).
        let handle = unsafe { cu::module::load_data(cubin.image.as_ptr() as *const c_void) }?;
        // SAFETY: NVSHMEM is initialised and the module is loaded in the current context.
        let rc = unsafe { lib.nvshmemx_cumodule_init(handle as _) };
        if rc != 0 {
            // SAFETY: the module was loaded above and is not in use.
            let _ = unsafe { cu::module::unload(handle) };
            return Err(Error::Nvshmem {
                call: "nvshmemx_cumodule_init",
                detail: format!("returned {rc}: the cubin's NVSHMEM device library does not match the host library"),
            });
        }
        Ok(Module {
            handle,
            ctx: ctx.clone(),
        })
    }

    /// The kernel `name`, which must be one of `lasp_shmem_kernels::KERNEL_NAMES`.
    pub fn kernel(&self, name: &'static str) -> Result<Kernel> {
        self.ctx.bind_to_thread()?;
        let c_name = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: the module is loaded in the current context.
        let function = unsafe { cu::module::get_function(self.handle, c_name) }.map_err(|e| {
            Error::State(format!(
                "kernel {name} is not in the module ({})",
                describe_driver_error(&e)
            ))
        })?;
        Ok(Kernel { function, name })
    }

    pub(crate) fn finalize(&self, lib: &NvshmemHost) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: no kernel of the module is running (the caller synchronised).
        let rc = unsafe { lib.nvshmemx_cumodule_finalize(self.handle as _) };
        crate::runtime::nvshmem_ok("nvshmemx_cumodule_finalize", rc)?;
        // SAFETY: as above; the handle is not used after this.
        unsafe { cu::module::unload(self.handle) }?;
        Ok(())
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl Kernel {
    /// The kernel's name in the module.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Raises the kernel's dynamic shared-memory limit (needed above 48 KiB).
    pub fn set_max_dynamic_shared_bytes(&self, bytes: u32) -> Result<()> {
        // SAFETY: a valid function handle and attribute.
        unsafe {
            cu::function::set_function_attribute(
                self.function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }?;
        Ok(())
    }

    /// Enqueues the kernel on `stream` with `params` as its single by-value argument.
    ///
    /// # Safety
    /// `P` must have the C layout of the kernel's parameter struct, and every device pointer in
    /// it must stay valid, and be used by nothing else in a conflicting way, until the kernel
    /// completes.
    pub unsafe fn launch<P: Copy>(
        &self,
        stream: &CudaStream,
        shape: LaunchShape,
        params: &P,
    ) -> Result<()> {
        let mut args = [params as *const P as *mut c_void];
        cu::launch_kernel(
            self.function,
            shape.grid,
            shape.block,
            shape.shared_bytes,
            stream.cu_stream(),
            &mut args,
        )
        .map_err(|e| Error::Cuda {
            call: format!("launching {}", self.name),
            detail: describe_driver_error(&e),
        })
    }
}
