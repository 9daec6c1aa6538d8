//! Entry points of the runtime: the ABI version, the bootstrap id of rank 0, initialisation (with
//! that id or from the launch environment), this process's place, and the collective shutdown.

use super::abi::{Place, RuntimeOptions, UniqueId, ABI_VERSION};
use super::args::{arg, count, invalid, put, sized_arg, this_library};
use super::handles::{check_out, store_handle, take_handle, RuntimeHandle};
use super::status::{run, Status};
use crate::error::{Error, Result};
use crate::launch_env::{LaunchEnv, Rendezvous};
use crate::runtime::{Config, Runtime};
use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// The runtime settings of `options` (NULL: every default).
///
/// # Safety
/// `options` is NULL or points at a `lasp_runtime_options` whose `struct_size` is its size and
/// whose `nvshmem_library` is NULL or a NUL-terminated string.
pub(super) unsafe fn config_of(options: *const RuntimeOptions) -> Result<Config> {
    let mut config = Config::default();
    if options.is_null() {
        return Ok(config);
    }
    // SAFETY: the caller's contract.
    let o = unsafe { sized_arg(options, "options")? };
    if o.abi_version != ABI_VERSION {
        return Err(invalid(format!(
            "options.abi_version is {} but this library is {}; set it to \
             LASP_SHMEM_ABI_VERSION and compile against the lasp_shmem.h of this library",
            o.abi_version,
            this_library()
        )));
    }
    if o.symmetric_heap_bytes > 0 {
        config.symmetric_heap_bytes = usize::try_from(o.symmetric_heap_bytes)
            .map_err(|_| invalid("options.symmetric_heap_bytes does not fit".into()))?;
    }
    if o.wait_timeout_ms > 0 {
        config.wait_timeout = Duration::from_millis(o.wait_timeout_ms);
    }
    if !o.nvshmem_library.is_null() {
        // SAFETY: the caller's contract.
        let path = unsafe { CStr::from_ptr(o.nvshmem_library) };
        let path = path.to_str().map_err(|_| {
            invalid("options.nvshmem_library is not UTF-8; pass the library's path".into())
        })?;
        config.nvshmem_library = Some(PathBuf::from(path));
    }
    Ok(config)
}

fn launch_env(place: &Place, rendezvous: Rendezvous) -> Result<LaunchEnv> {
    LaunchEnv::explicit(
        count("place.rank", place.rank)?,
        count("place.world_size", place.world_size)?,
        count("place.local_rank", place.local_rank)?,
        count("place.local_world_size", place.local_world_size)?,
        rendezvous,
    )
}

/// `LASP_SHMEM_ABI_VERSION` of this library.
#[no_mangle]
pub extern "C" fn lasp_abi_version() -> u32 {
    ABI_VERSION
}

/// Rank 0 of a job the caller bootstraps: makes the id every rank passes to
/// [`lasp_runtime_init`]. Call it before any rank initialises, with rank 0's options and place.
///
/// # Safety
/// `options` is NULL or valid; `place` and `id` point at valid structs.
#[no_mangle]
pub unsafe extern "C" fn lasp_unique_id_create(
    options: *const RuntimeOptions,
    place: *const Place,
    id: *mut UniqueId,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let (config, place) = unsafe { (config_of(options)?, arg(place, "place")?) };
        let env = launch_env(place, Rendezvous::Alone)?;
        if env.rank != 0 {
            return Err(Error::Launch(format!(
                "rank {} asked for the unique id; only rank 0 makes it, the others receive it \
                 from rank 0 (torch.distributed.broadcast)",
                env.rank
            )));
        }
        let bytes = Runtime::create_unique_id(&config, env.single_node())?;
        // SAFETY: the caller's contract.
        unsafe { put(id, "id", UniqueId { bytes }) }
    })
}

/// Initialises the runtime on every rank with rank 0's id (collective).
///
/// # Safety
/// `options` is NULL or valid; `place`, `id` and `runtime` point at valid structs.
#[no_mangle]
pub unsafe extern "C" fn lasp_runtime_init(
    options: *const RuntimeOptions,
    place: *const Place,
    id: *const UniqueId,
    runtime: *mut *mut RuntimeHandle,
) -> Status {
    run(|| {
        check_out(runtime, "runtime")?;
        // SAFETY: the caller's contract.
        let (config, place, id) =
            unsafe { (config_of(options)?, arg(place, "place")?, arg(id, "id")?) };
        let env = launch_env(place, Rendezvous::Given(id.bytes))?;
        let handle = RuntimeHandle {
            runtime: Runtime::init_with(config, env)?,
        };
        // SAFETY: the caller's contract.
        unsafe { store_handle(runtime, "runtime", handle) }
    })
}

/// Initialises the runtime from the launch environment (lasp-run, mpirun, nvshmrun, or
/// torchrun's variables when no other library serves `MASTER_PORT`). Collective.
///
/// # Safety
/// `options` is NULL or valid; `runtime` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_runtime_init_from_env(
    options: *const RuntimeOptions,
    runtime: *mut *mut RuntimeHandle,
) -> Status {
    run(|| {
        check_out(runtime, "runtime")?;
        // SAFETY: the caller's contract.
        let config = unsafe { config_of(options)? };
        let handle = RuntimeHandle {
            runtime: Runtime::init(config)?,
        };
        // SAFETY: the caller's contract.
        unsafe { store_handle(runtime, "runtime", handle) }
    })
}

/// Joins the NVSHMEM another library of this process has initialised, on CUDA device `device`
/// ([`Runtime::attach`]). Collective over NVSHMEM's PEs.
///
/// # Safety
/// `options` is NULL or valid; `runtime` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_runtime_attach(
    options: *const RuntimeOptions,
    device: i32,
    runtime: *mut *mut RuntimeHandle,
) -> Status {
    run(|| {
        check_out(runtime, "runtime")?;
        // SAFETY: the caller's contract.
        let config = unsafe { config_of(options)? };
        let device = usize::try_from(device).map_err(|_| {
            Error::InvalidArgument(format!(
                "device {device} is negative; pass the process's CUDA device index"
            ))
        })?;
        let handle = RuntimeHandle {
            runtime: Runtime::attach(config, device)?,
        };
        // SAFETY: the caller's contract.
        unsafe { store_handle(runtime, "runtime", handle) }
    })
}

/// This process's place: rank (= PE), world size, local rank (its GPU), ranks on its node.
///
/// # Safety
/// `runtime` is a live handle; `place` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_runtime_place(
    runtime: *const RuntimeHandle,
    place: *mut Place,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let env = unsafe { arg(runtime, "runtime")? }.runtime.launch_env();
        let value = Place {
            rank: env.rank as i32,
            world_size: env.world_size as i32,
            local_rank: env.local_rank as i32,
            local_world_size: env.local_world_size as i32,
        };
        // SAFETY: the caller's contract.
        unsafe { put(place, "place", value) }
    })
}

/// Collective shutdown: frees the runtime and finalizes NVSHMEM. Every operation handle must
/// be freed first; if one is alive the call fails and `runtime` stays valid.
///
/// # Safety
/// `runtime` is a live handle, not used again after `LASP_OK`.
#[no_mangle]
pub unsafe extern "C" fn lasp_runtime_shutdown(runtime: *mut RuntimeHandle) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let handle = unsafe { arg(runtime, "runtime")? };
        let others = Arc::strong_count(&handle.runtime.inner) - 1;
        if others > 0 {
            return Err(Error::State(format!(
                "{others} operations (or buffers) still use the runtime; free them on every \
                 rank (lasp_op_free) before the shutdown"
            )));
        }
        // SAFETY: the caller gives the handle up (nothing else uses it, checked above).
        unsafe { take_handle(runtime, "runtime")? }
            .runtime
            .shutdown()
    })
}
