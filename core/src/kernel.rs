//! The embedded kernel module: loading it for this GPU, registering it with NVSHMEM, launching
//! its kernels. This is the one place that holds raw `CUmodule`/`CUfunction` handles.

use crate::error::{classify, describe_driver_error, CudaCall, DriverErrorClass, Error, Result};
use crate::nvshmem::Nvshmem;
use cudarc::driver::{result as cu, sys, CudaContext, CudaStream};
use std::ffi::{c_void, CString};
use std::sync::Arc;

/// The cubin of `lasp-shmem-kernels` loaded into this GPU's primary context and registered with
/// NVSHMEM (its `nvshmemi_device_state_d` holds this process's NVSHMEM state), and beside it the
/// standalone cubins (kernels built without `-rdc`, which call no NVSHMEM function).
pub struct Module {
    handle: sys::CUmodule,
    standalone: Vec<sys::CUmodule>,
    ctx: Arc<CudaContext>,
}

// SAFETY: CUDA driver handles are not tied to a thread: a CUmodule may be used from any thread
// while its context is current there, and every method of Module binds `ctx` before it uses the
// handle. The driver serialises calls on one context internally.
unsafe impl Send for Module {}
// SAFETY: as for Send; no method mutates the handle (the driver owns the module's state).
unsafe impl Sync for Module {}

/// A kernel of the module. Every kernel takes one by-value parameter struct.
///
/// Valid while the [`Module`] it came from is loaded (the runtime keeps it until shutdown).
#[derive(Clone, Copy)]
pub struct Kernel {
    function: sys::CUfunction,
    /// The module's context (the device's primary context): bound before every use.
    ctx: sys::CUcontext,
    name: &'static str,
}

// SAFETY: as for Module: the handles may be used from any thread while their context is current,
// and every method binds `ctx` first (bind_context).
unsafe impl Send for Kernel {}
// SAFETY: as for Send; the handles are only read.
unsafe impl Sync for Kernel {}

impl Module {
    /// Loads the cubin for `ctx`'s GPU and registers it with NVSHMEM.
    pub(crate) fn load(nvshmem: Nvshmem, ctx: &Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx
            .compute_capability()
            .cuda_call("cuDeviceGetAttribute(COMPUTE_CAPABILITY)")?;
        let cubin =
            lasp_shmem_kernels::cubin_for(major, minor).ok_or_else(|| Error::UnsupportedGpu {
                compute_capability: (major, minor),
                built: lasp_shmem_kernels::CUBINS.iter().map(|c| c.arch).collect(),
            })?;
        ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        // SAFETY: the image is a complete executable cubin (checked by the kernels crate's tests)
        // that lives for the whole program; the context is current (bound above).
        let handle = unsafe { cu::module::load_data(cubin.image.as_ptr() as *const c_void) }
            .cuda_call("cuModuleLoadData")?;
        // SAFETY: NVSHMEM is initialised (the runtime loads the module after init) and the module
        // is loaded in the current context.
        if let Err(e) = unsafe { nvshmem.cumodule_init(handle) } {
            // SAFETY: the module was loaded above and nothing uses it.
            let _ = unsafe { cu::module::unload(handle) };
            return Err(e);
        }
        let mut standalone = Vec::with_capacity(cubin.standalone.len());
        for image in cubin.standalone {
            // SAFETY: as for the main image; these carry no NVSHMEM state to register.
            match unsafe { cu::module::load_data(image.as_ptr() as *const c_void) } {
                Ok(module) => standalone.push(module),
                Err(e) => {
                    for module in standalone {
                        // SAFETY: loaded above; nothing uses it.
                        let _ = unsafe { cu::module::unload(module) };
                    }
                    // SAFETY: registered and loaded above; nothing has launched from it.
                    let _ = unsafe { nvshmem.cumodule_finalize(handle) };
                    // SAFETY: as above; the handle is not used after this.
                    let _ = unsafe { cu::module::unload(handle) };
                    return Err(Error::from_driver("cuModuleLoadData(standalone cubin)", &e));
                }
            }
        }
        Ok(Module {
            handle,
            standalone,
            ctx: ctx.clone(),
        })
    }

    /// The kernel `name`, which must be one of `lasp_shmem_kernels::KERNEL_NAMES`; a name the
    /// module lacks is [`Error::MissingKernel`] (a build problem).
    pub fn kernel(&self, name: &'static str) -> Result<Kernel> {
        self.ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        let c_name = CString::new(name).expect("kernel names have no NUL");
        let mut not_found = None;
        for &module in std::iter::once(&self.handle).chain(&self.standalone) {
            // SAFETY: the module is loaded in the current context (bound above).
            match unsafe { cu::module::get_function(module, c_name.clone()) } {
                Ok(function) => {
                    return Ok(Kernel {
                        function,
                        ctx: self.ctx.cu_ctx(),
                        name,
                    })
                }
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_FOUND => not_found = Some(e),
                Err(e) => {
                    return Err(Error::from_driver(
                        format!("cuModuleGetFunction({name})"),
                        &e,
                    ))
                }
            }
        }
        let e = not_found.expect("the main module was searched");
        Err(Error::MissingKernel {
            kernel: name.into(),
            detail: describe_driver_error(&e),
        })
    }

    /// The kernels of one row of the instantiation table, one per key width
    /// (`lasp_shmem_kernels::instances::DK_WIDTHS`).
    pub fn kernels_per_width(&self, names: [&'static str; 2]) -> Result<[Kernel; 2]> {
        Ok([self.kernel(names[0])?, self.kernel(names[1])?])
    }

    /// Unregisters the module from NVSHMEM and unloads it.
    pub(crate) fn finalize(&self, nvshmem: Nvshmem) -> Result<()> {
        self.ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        // SAFETY: no kernel of the module is running (the caller synchronised) and none is
        // launched after this (the runtime is shutting down); the context is current.
        unsafe { nvshmem.cumodule_finalize(self.handle)? };
        // SAFETY: as above; the handles are not used after this.
        unsafe { cu::module::unload(self.handle) }.cuda_call("cuModuleUnload")?;
        for &module in &self.standalone {
            // SAFETY: as above.
            unsafe { cu::module::unload(module) }.cuda_call("cuModuleUnload(standalone)")?;
        }
        Ok(())
    }
}

/// The index of a key or value width (64 or 128) in the arrays of kernels per width
/// ([`Module::kernels_per_width`], `lasp_shmem_kernels::instances::DK_WIDTHS`).
pub(crate) fn width_index(d: usize) -> usize {
    usize::from(d == 128)
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

    /// Makes the kernel's context current on this thread (a no-op where it already is).
    fn bind_context(&self) -> Result<()> {
        if cu::ctx::get_current().cuda_call("cuCtxGetCurrent")? != Some(self.ctx) {
            // SAFETY: `ctx` is the primary context the module was loaded in, retained by the
            // runtime for as long as its module (and so this kernel) is usable.
            unsafe { cu::ctx::set_current(self.ctx) }.cuda_call("cuCtxSetCurrent")?;
        }
        Ok(())
    }

    /// Raises the kernel's dynamic shared-memory limit (needed above 48 KiB).
    pub fn set_max_dynamic_shared_bytes(&self, bytes: u32) -> Result<()> {
        self.bind_context()?;
        let bytes = i32::try_from(bytes).map_err(|_| {
            Error::InvalidArgument(format!("{bytes} bytes of shared memory for {}", self.name))
        })?;
        // SAFETY: a valid function handle of the current context, and a valid attribute.
        unsafe {
            cu::function::set_function_attribute(
                self.function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes,
            )
        }
        .cuda_call(&format!("cuFuncSetAttribute({})", self.name))?;
        Ok(())
    }

    /// Asks the driver for the largest shared-memory carveout of the L1 (a hint it may override),
    /// for a kernel whose CTAs fit several to an SM only with it.
    pub fn prefer_max_shared_memory(&self) -> Result<()> {
        self.bind_context()?;
        // SAFETY: a valid function handle of the current context, and a valid attribute (a
        // percentage).
        unsafe {
            cu::function::set_function_attribute(
                self.function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
        }
        .cuda_call(&format!("cuFuncSetAttribute({})", self.name))?;
        Ok(())
    }

    /// How many CTAs of `shape`'s block and dynamic shared memory fit on one SM at once (at
    /// least 1: a launch that fits none fails at launch, naming the kernel).
    pub fn resident_ctas_per_sm(&self, shape: LaunchShape) -> Result<u32> {
        self.bind_context()?;
        let threads = shape.block.0 * shape.block.1 * shape.block.2;
        // SAFETY: a valid function handle of the current context (bound above).
        let ctas = unsafe {
            cu::occupancy::max_active_block_per_multiprocessor(
                self.function,
                threads as i32,
                shape.shared_bytes as usize,
            )
        }
        .cuda_call(&format!(
            "cuOccupancyMaxActiveBlocksPerMultiprocessor({})",
            self.name
        ))?;
        Ok(ctas.max(1) as u32)
    }

    /// Enqueues the kernel on `stream` with `params` as its single by-value argument.
    ///
    /// A launch the driver refuses is [`Error::KernelLaunch`]; a fault of an earlier kernel that
    /// the driver reports here is [`Error::KernelFault`].
    ///
    /// # Safety
    /// `P` must have the C layout of the kernel's parameter struct, and every device pointer in
    /// it must stay valid, and be used by nothing else in a conflicting way, until the kernel
    /// completes. `stream` must belong to the module's context.
    pub unsafe fn launch<P: Copy>(
        &self,
        stream: &CudaStream,
        shape: LaunchShape,
        params: &P,
    ) -> Result<()> {
        self.bind_context()?;
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: the function is of the current context, `args` holds one pointer to a value of
        // the kernel's parameter type that outlives the call (the driver copies it at launch);
        // the caller's contract covers the pointers inside it and the stream.
        unsafe {
            cu::launch_kernel(
                self.function,
                shape.grid,
                shape.block,
                shape.shared_bytes,
                stream.cu_stream(),
                &mut args,
            )
        }
        .map_err(|e| match classify(e.0) {
            DriverErrorClass::Other => Error::KernelLaunch {
                kernel: self.name.into(),
                detail: format!("{} with {shape:?}", describe_driver_error(&e)),
            },
            _ => Error::from_driver(format!("cuLaunchKernel({})", self.name), &e),
        })
    }
}
