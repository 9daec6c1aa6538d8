//! The C ABI (`core/include/lasp_shmem.h`): the runtime and the operations, forward and
//! backward, for a C, C++ or PyTorch caller that brings its own launcher, streams and device
//! pointers.
//!
//! A trainer started by torchrun already runs its own rendezvous on `MASTER_PORT`, so the
//! library does not bootstrap by itself there: rank 0 makes a unique id
//! ([`lasp_unique_id_create`]), the trainer hands it to every rank with its own collective
//! (`torch.distributed.broadcast`), and every rank initialises with it ([`lasp_runtime_init`]).
//! Programs started by lasp-run, mpirun or nvshmrun use [`lasp_runtime_init_from_env`].
//!
//! Every entry point returns a status ([`status`]); the message of a failure is
//! [`status::lasp_last_error`]. Raw pointers are checked before use: handles and out-pointers
//! for NULL, device pointers against the driver's record of their allocation ([`memory`]),
//! streams against the runtime's context. A handle may be used from any thread; calls on one
//! handle are serialised by a lock.

// Lint debt: this module is being rewritten; remove with the rewrite.
#![allow(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

pub mod memory;
pub mod status;

use crate::error::{Error, Result};
use crate::launch_env::{LaunchEnv, Rendezvous};
use crate::ops::lasp2::{ExchangeMode, Lasp2Backward, Lasp2Forward, Lasp2Layout};
use crate::ops::scalar_decay::{ForwardArgs, ForwardShape, ScalarDecayForward};
use crate::ops::scalar_decay_backward::{BackwardArgs, ScalarDecayBackward};
use crate::ops::{DeviceMut, DeviceRef};
use crate::rendezvous::ID_BYTES;
use crate::runtime::{Config, Runtime};
use cudarc::driver::{sys, CudaStream};
use status::{run, Status};
use std::ffi::{c_char, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `LASP_SHMEM_ABI_VERSION`: bumped whenever a struct or a signature of the header changes.
pub const ABI_VERSION: u32 = 1;

/// `lasp_runtime_options`.
#[repr(C)]
#[derive(Debug)]
pub struct RuntimeOptions {
    /// `LASP_SHMEM_ABI_VERSION` of the header the caller was compiled with.
    pub abi_version: u32,
    pub reserved: u32,
    /// Symmetric memory the program will allocate (0: 256 MiB); see
    /// [`lasp_lasp2_symmetric_bytes`].
    pub symmetric_heap_bytes: u64,
    /// Bound on every wait on another GPU (0: `LASP_WAIT_TIMEOUT_MS`, else 10 s).
    pub wait_timeout_ms: u64,
    /// An explicit `libnvshmem_host.so.3` (NULL: `NVSHMEM_HOME`, else the usual places).
    pub nvshmem_library: *const c_char,
}

/// `lasp_place`: this process's place in the job, as torchrun's variables give it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Place {
    pub rank: i32,
    pub world_size: i32,
    /// Selects the GPU (the ordinal among the visible GPUs).
    pub local_rank: i32,
    pub local_world_size: i32,
}

/// `lasp_unique_id`: NVSHMEM's bootstrap id, plain bytes to broadcast.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UniqueId {
    pub bytes: [u8; ID_BYTES],
}

/// `lasp_forward_args`: one call's tensors in fla's layout, contiguous.
#[repr(C)]
#[derive(Debug)]
pub struct ForwardArgsC {
    pub batch: i64,
    /// This rank's tokens per sequence (LASP-2: its shard; ranks may differ).
    pub tokens: i64,
    pub heads: i64,
    pub dk: i64,
    pub dv: i64,
    /// `[B, T, H, Dk]` bf16.
    pub q: *const c_void,
    /// `[B, T, H, Dk]` bf16.
    pub k: *const c_void,
    /// `[B, T, H, Dv]` bf16.
    pub v: *const c_void,
    /// `[B, T, H]` fp32 log-decays, finite and `<= 0`.
    pub g: *const f32,
    /// `[B, H, Dk, Dv]` fp32 initial state, or NULL for zero.
    pub h0: *const f32,
    /// `[B, T, H, Dv]` bf16 output.
    pub o: *mut c_void,
    /// `[B, H, Dk, Dv]` fp32 final state, or NULL (LASP-2: the last rank only).
    pub ht: *mut f32,
    /// `sigma` in `o_t = sigma q_t S_t`; 0 for `Dk^-1/2`.
    pub scale: f32,
    pub reserved: u32,
}

/// `lasp_backward_args`: one backward call's tensors in fla's layout, contiguous. The inputs
/// are the forward's and the gradients of its outputs; the `grad_*` outputs are written whole.
#[repr(C)]
#[derive(Debug)]
pub struct BackwardArgsC {
    pub batch: i64,
    pub tokens: i64,
    pub heads: i64,
    /// 64 or 128.
    pub dk: i64,
    /// 64 or 128.
    pub dv: i64,
    /// The forward's q, k `[B, T, H, Dk]` and v `[B, T, H, Dv]`, bf16.
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    /// The forward's `[B, T, H]` fp32 log-decays.
    pub g: *const f32,
    /// `[B, H, Dk, Dv]` fp32, or NULL for zero: the forward's initial state (LASP-2: the
    /// `start_state` that `lasp_lasp2_forward_saving` wrote on this rank).
    pub h0: *const f32,
    /// `[B, T, H, Dv]` bf16: the gradient of o.
    pub grad_o: *const c_void,
    /// `[B, H, Dk, Dv]` fp32 gradient of the final state, or NULL (LASP-2: last rank only).
    pub grad_ht: *const f32,
    /// `[B, T, H, Dk]`, `[B, T, H, Dk]`, `[B, T, H, Dv]` bf16 and `[B, T, H]` fp32.
    pub grad_q: *mut c_void,
    pub grad_k: *mut c_void,
    pub grad_v: *mut c_void,
    pub grad_g: *mut f32,
    /// `[B, H, Dk, Dv]` fp32 gradient of the initial state, or NULL (LASP-2: rank 0 only).
    pub grad_h0: *mut f32,
    /// The forward's `sigma`; 0 for `Dk^-1/2`.
    pub scale: f32,
    pub reserved: u32,
}

/// `lasp_runtime`.
pub struct RuntimeHandle {
    runtime: Runtime,
}

/// An operation behind a C handle: the runtime it keeps alive and the operation, locked per
/// call so that a handle may be used from any thread.
pub struct OpHandle<T> {
    runtime: Runtime,
    op: Mutex<T>,
}

/// `lasp_lasp2`: the LASP-2 forward.
pub type Lasp2Handle = OpHandle<Lasp2Forward>;
/// `lasp_lasp2_grad`: the LASP-2 backward.
pub type Lasp2GradHandle = OpHandle<Lasp2Backward>;
/// `lasp_scalar_decay`: the single-GPU forward.
pub type ScalarDecayHandle = OpHandle<ScalarDecayForward>;
/// `lasp_scalar_decay_grad`: the single-GPU backward.
pub type ScalarDecayGradHandle = OpHandle<ScalarDecayBackward>;

/// What the C ABI calls on both LASP-2 operations, whose ranks meet through one state chain
/// each: the collective mode switch, the completion check, graph replays and the collective
/// free.
trait ChainOp: Sized {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()>;
    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()>;
    fn note_replayed_calls(&mut self, calls: u64);
    fn free(self) -> Result<()>;
}

macro_rules! chain_op {
    ($op:ty) => {
        impl ChainOp for $op {
            fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
                <$op>::set_mode(self, mode)
            }
            fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
                <$op>::finish(self, stream)
            }
            fn note_replayed_calls(&mut self, calls: u64) {
                <$op>::note_replayed_calls(self, calls)
            }
            fn free(self) -> Result<()> {
                <$op>::free(self)
            }
        }
    };
}
chain_op!(Lasp2Forward);
chain_op!(Lasp2Backward);

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// `*ptr` for a pointer the caller passed, or an error naming the argument.
///
/// # Safety
/// A non-NULL `ptr` must point at a live, properly aligned `T` for `'a`.
unsafe fn arg<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller's contract.
    unsafe { ptr.as_ref() }.ok_or_else(|| invalid(format!("{name} is NULL")))
}

/// Writes `value` to an out-pointer the caller passed.
///
/// # Safety
/// A non-NULL `ptr` must point at writable memory for a `T`.
unsafe fn put<T>(ptr: *mut T, name: &str, value: T) -> Result<()> {
    if ptr.is_null() {
        return Err(invalid(format!(
            "{name} is NULL; pass where to store the result"
        )));
    }
    // SAFETY: the caller's contract; `write` does not drop the uninitialised old value.
    unsafe { ptr.write(value) };
    Ok(())
}

/// Fails unless `out` can receive a handle; checked before the work that makes the handle, so
/// that a NULL out-pointer leaks nothing.
fn check_out<T>(out: *mut *mut T, name: &str) -> Result<()> {
    if out.is_null() {
        return Err(invalid(format!(
            "{name} is NULL; pass where to store the handle"
        )));
    }
    Ok(())
}

/// Hands `value` to the caller as a new handle at `*out` (checked by [`check_out`]).
///
/// # Safety
/// `out` points at writable memory for a pointer.
unsafe fn store_handle<T>(out: *mut *mut T, name: &str, value: T) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { put(out, name, Box::into_raw(Box::new(value))) }
}

/// Takes back a handle the caller gives up.
///
/// # Safety
/// A non-NULL `handle` came from [`store_handle`] and is not used by the caller afterwards.
unsafe fn take_handle<T>(handle: *mut T, name: &str) -> Result<Box<T>> {
    if handle.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { Box::from_raw(handle) })
}

/// A count the caller passed as a signed C integer, as a `usize`; `name` goes into the error.
fn count<T: TryInto<usize> + Copy + std::fmt::Display>(name: &str, v: T) -> Result<usize> {
    v.try_into()
        .map_err(|_| invalid(format!("{name} = {v} is negative")))
}

/// The runtime settings of `options` (NULL: every default).
///
/// # Safety
/// `options` is NULL or points at a `lasp_runtime_options` whose `nvshmem_library` is NULL or
/// a NUL-terminated string.
unsafe fn config_of(options: *const RuntimeOptions) -> Result<Config> {
    let mut config = Config::default();
    // SAFETY: the caller's contract.
    let Some(o) = (unsafe { options.as_ref() }) else {
        return Ok(config);
    };
    if o.abi_version != ABI_VERSION {
        return Err(invalid(format!(
            "options.abi_version is {} but this library implements ABI {ABI_VERSION}; set it to \
             LASP_SHMEM_ABI_VERSION and compile against the lasp_shmem.h of this library",
            o.abi_version
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

/// The caller's stream, checked to belong to the runtime's context.
fn borrowed_stream(runtime: &Runtime, stream: sys::CUstream) -> Result<Arc<CudaStream>> {
    let ctx = runtime.context();
    ctx.bind_to_thread()?;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one CUcontext; an invalid stream handle is reported, not dereferenced
    // (the driver validates handles it was given).
    let rc = unsafe { sys::cuStreamGetCtx(stream, &mut owner) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(invalid(format!(
            "stream {stream:p} is not a CUDA stream the driver knows ({rc:?}); pass a stream of \
             GPU {} (torch.cuda.current_stream().cuda_stream)",
            ctx.ordinal()
        )));
    }
    if owner != ctx.cu_ctx() {
        return Err(invalid(format!(
            "stream {stream:p} belongs to another CUDA context than the runtime's (the primary \
             context of GPU {}); create the stream on that GPU",
            ctx.ordinal()
        )));
    }
    // SAFETY: the stream belongs to this context (checked above); the caller keeps it alive
    // during the call and orders its own work on it, which is the ABI's contract.
    Ok(unsafe { ctx.wrap_borrowed_stream(stream) })
}

/// The shape a call's arguments give, validated.
fn call_shape(batch: i64, tokens: i64, heads: i64, dk: i64, dv: i64) -> Result<ForwardShape> {
    let shape = ForwardShape {
        b: count("args.batch", batch)?,
        t: count("args.tokens", tokens)?,
        h: count("args.heads", heads)?,
        dk: count("args.dk", dk)?,
        dv: count("args.dv", dv)?,
    };
    shape.validate()?;
    Ok(shape)
}

/// The layouts of a call's tensors: what the message of a failed check calls them, and how many
/// elements the shape gives them.
#[derive(Clone, Copy)]
enum Layout {
    /// q, k and their gradients.
    Qk,
    /// v, o and their gradients.
    V,
    /// g and its gradient.
    Gates,
    /// h0, ht and their gradients, LASP-2's start state.
    State,
}

/// Checks raw device pointers against the driver's record of one GPU's allocations and one
/// call's shape, and turns them into views.
struct DeviceTensors {
    shape: ForwardShape,
    ordinal: usize,
}

impl DeviceTensors {
    /// `ptr` holds a tensor of `layout` on this GPU (see [`memory::check_device_range`]);
    /// returns its element count.
    fn check<T>(&self, name: &str, layout: Layout, ptr: *const c_void) -> Result<usize> {
        let s = &self.shape;
        let (what, elems) = match layout {
            Layout::Qk => ("[B, T, H, Dk] bf16", s.qk_len()),
            Layout::V => ("[B, T, H, Dv] bf16", s.v_len()),
            Layout::Gates => ("[B, T, H] fp32", s.gate_len()),
            Layout::State => ("[B, H, Dk, Dv] fp32", s.state_len()),
        };
        let bytes = (elems * std::mem::size_of::<T>()) as u64;
        memory::check_device_range(name, what, ptr as u64, bytes, self.ordinal)?;
        Ok(elems)
    }

    /// A checked input.
    ///
    /// # Safety
    /// The memory stays valid, and unwritten by others, until the enqueued kernels complete.
    unsafe fn input<'a, T>(
        &self,
        name: &str,
        layout: Layout,
        ptr: *const c_void,
    ) -> Result<DeviceRef<'a, T>> {
        let elems = self.check::<T>(name, layout, ptr)?;
        // SAFETY: device memory of this GPU holding the elements (checked above); the rest is
        // the caller's contract.
        Ok(unsafe { DeviceRef::from_raw(ptr as u64, elems) })
    }

    /// A checked output.
    ///
    /// # Safety
    /// As [`DeviceTensors::input`], and nothing else reads or writes the memory meanwhile.
    unsafe fn output<'a, T>(
        &self,
        name: &str,
        layout: Layout,
        ptr: *mut c_void,
    ) -> Result<DeviceMut<'a, T>> {
        let elems = self.check::<T>(name, layout, ptr.cast_const())?;
        // SAFETY: as in `input`.
        Ok(unsafe { DeviceMut::from_raw(ptr as u64, elems) })
    }

    /// [`DeviceTensors::input`] where NULL stands for "none".
    ///
    /// # Safety
    /// As [`DeviceTensors::input`].
    unsafe fn optional_input<'a, T>(
        &self,
        name: &str,
        layout: Layout,
        ptr: *const c_void,
    ) -> Result<Option<DeviceRef<'a, T>>> {
        // SAFETY: the caller's contract.
        (!ptr.is_null())
            .then(|| unsafe { self.input(name, layout, ptr) })
            .transpose()
    }

    /// [`DeviceTensors::output`] where NULL stands for "not wanted".
    ///
    /// # Safety
    /// As [`DeviceTensors::output`].
    unsafe fn optional_output<'a, T>(
        &self,
        name: &str,
        layout: Layout,
        ptr: *mut c_void,
    ) -> Result<Option<DeviceMut<'a, T>>> {
        // SAFETY: the caller's contract.
        (!ptr.is_null())
            .then(|| unsafe { self.output(name, layout, ptr) })
            .transpose()
    }
}

/// The validated views of one forward call's tensors.
///
/// # Safety
/// The pointers of `a` stay valid until the enqueued kernels complete (the ABI's contract); the
/// checks here make sure they are GPU memory of this device, long enough for the shape.
unsafe fn device_views<'a>(a: &ForwardArgsC, ordinal: usize) -> Result<ForwardArgs<'a>> {
    let shape = call_shape(a.batch, a.tokens, a.heads, a.dk, a.dv)?;
    let t = DeviceTensors { shape, ordinal };
    use Layout::{Gates, Qk, State, V};
    // SAFETY (every view below): checked against the driver's record; validity until
    // completion and the absence of concurrent writers are the caller's.
    unsafe {
        Ok(ForwardArgs {
            shape,
            q: t.input("q", Qk, a.q)?,
            k: t.input("k", Qk, a.k)?,
            v: t.input("v", V, a.v)?,
            g: t.input("g", Gates, a.g.cast())?,
            o: t.output("o", V, a.o)?,
            h0: t.optional_input("h0", State, a.h0.cast())?,
            ht: t.optional_output("ht", State, a.ht.cast())?,
            scale: (a.scale != 0.0).then_some(a.scale),
        })
    }
}

/// The validated views of one backward call's tensors.
///
/// # Safety
/// As [`device_views`].
unsafe fn backward_views<'a>(a: &BackwardArgsC, ordinal: usize) -> Result<BackwardArgs<'a>> {
    let shape = call_shape(a.batch, a.tokens, a.heads, a.dk, a.dv)?;
    let t = DeviceTensors { shape, ordinal };
    use Layout::{Gates, Qk, State, V};
    // SAFETY: as in `device_views`.
    unsafe {
        Ok(BackwardArgs {
            shape,
            q: t.input("q", Qk, a.q)?,
            k: t.input("k", Qk, a.k)?,
            v: t.input("v", V, a.v)?,
            g: t.input("g", Gates, a.g.cast())?,
            h0: t.optional_input("h0", State, a.h0.cast())?,
            d_o: t.input("grad_o", V, a.grad_o)?,
            d_ht: t.optional_input("grad_ht", State, a.grad_ht.cast())?,
            dq: t.output("grad_q", Qk, a.grad_q)?,
            dk: t.output("grad_k", Qk, a.grad_k)?,
            dv: t.output("grad_v", V, a.grad_v)?,
            dg: t.output("grad_g", Gates, a.grad_g.cast())?,
            dh0: t.optional_output("grad_h0", State, a.grad_h0.cast())?,
            scale: (a.scale != 0.0).then_some(a.scale),
        })
    }
}

/// The caller's stream and the checked views of a call's arguments, for an operation of
/// `runtime`.
///
/// # Safety
/// `args` is NULL or points at a valid struct whose tensors stay valid until the enqueued
/// kernels complete (see [`device_views`]).
unsafe fn call_inputs<A, V>(
    runtime: &Runtime,
    stream: sys::CUstream,
    args: *const A,
    views: unsafe fn(&A, usize) -> Result<V>,
) -> Result<(Arc<CudaStream>, V)> {
    // SAFETY: the caller's contract.
    let args = unsafe { arg(args, "args")? };
    let stream = borrowed_stream(runtime, stream)?;
    // SAFETY: the caller's contract covers the tensors' lifetime.
    let views = unsafe { views(args, runtime.context().ordinal())? };
    Ok((stream, views))
}

fn exchange_mode(mode: i32) -> Result<ExchangeMode> {
    match mode {
        0 => Ok(ExchangeMode::Overlapped),
        1 => Ok(ExchangeMode::SequentialNccl),
        2 => Ok(ExchangeMode::SequentialNvshmem),
        3 => Ok(ExchangeMode::NoComm),
        other => Err(invalid(format!(
            "exchange mode {other} is not one of LASP_MODE_OVERLAPPED (0), \
             LASP_MODE_SEQUENTIAL_NCCL (1), LASP_MODE_SEQUENTIAL_NVSHMEM (2), LASP_MODE_NO_COMM (3)"
        ))),
    }
}

fn layout(b: i64, h: i64, dk: i64, dv: i64) -> Result<Lasp2Layout> {
    let layout = Lasp2Layout {
        b: count("batch", b)?,
        h: count("heads", h)?,
        dk: count("dk", dk)?,
        dv: count("dv", dv)?,
    };
    layout.validate()?;
    Ok(layout)
}

fn lock<T>(m: &Mutex<T>) -> Result<std::sync::MutexGuard<'_, T>> {
    m.lock().map_err(|_| {
        Error::State(
            "an earlier call on this handle failed inside the library (a bug); free the handle \
             and create a new one"
                .into(),
        )
    })
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
        // SAFETY: the caller\'s contract.
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
        // SAFETY: the caller\'s contract.
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
                "{others} operation handles (or buffers) still use the runtime; free them on \
                 every rank (lasp_lasp2_free, lasp_lasp2_grad_free, lasp_scalar_decay_free, \
                 lasp_scalar_decay_grad_free) before the shutdown"
            )));
        }
        // SAFETY: the caller gives the handle up (nothing else uses it, checked above).
        unsafe { take_handle(runtime, "runtime")? }
            .runtime
            .shutdown()
    })
}

/// Symmetric bytes one LASP-2 operation of this layout allocates per rank, to size
/// `options.symmetric_heap_bytes` before init.
///
/// # Safety
/// `bytes` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_symmetric_bytes(
    batch: i64,
    heads: i64,
    dk: i64,
    dv: i64,
    world_size: i32,
    bytes: *mut u64,
) -> Status {
    run(|| {
        let layout = layout(batch, heads, dk, dv)?;
        let npes = usize::try_from(world_size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("world_size = {world_size} must be at least 1")))?;
        // SAFETY: the caller's contract.
        unsafe { put(bytes, "bytes", layout.symmetric_bytes(npes) as u64) }
    })
}

/// Makes an operation with the runtime behind `runtime` and hands it to the caller at `*out`.
///
/// # Safety
/// `runtime` is a live handle; `out` points at writable memory.
unsafe fn create_op<T>(
    runtime: *const RuntimeHandle,
    out: *mut *mut OpHandle<T>,
    make: impl FnOnce(&Runtime) -> Result<T>,
) -> Result<()> {
    check_out(out, "op")?;
    // SAFETY: the caller's contract.
    let runtime = unsafe { arg(runtime, "runtime")? }.runtime.clone();
    runtime.context().bind_to_thread()?;
    let op = Mutex::new(make(&runtime)?);
    // SAFETY: the caller's contract.
    unsafe { store_handle(out, "op", OpHandle { runtime, op }) }
}

/// Runs `f` on the operation behind `op` (locked), with its runtime's context current.
///
/// # Safety
/// `op` is a live handle.
unsafe fn with_op<T, R>(
    op: *const OpHandle<T>,
    f: impl FnOnce(&Runtime, &mut T) -> Result<R>,
) -> Result<R> {
    // SAFETY: the caller's contract.
    let handle = unsafe { arg(op, "op")? };
    handle.runtime.context().bind_to_thread()?;
    f(&handle.runtime, &mut *lock(&handle.op)?)
}

/// Takes back the handle the caller gives up and releases its operation with `release`.
///
/// # Safety
/// `op` is a live handle, not used by the caller afterwards.
unsafe fn free_op<T>(op: *mut OpHandle<T>, release: impl FnOnce(T) -> Result<()>) -> Result<()> {
    // SAFETY: the caller's contract.
    let handle = unsafe { take_handle(op, "op")? };
    handle.runtime.context().bind_to_thread()?;
    let op = handle.op.into_inner().map_err(|_| {
        Error::State("the operation was poisoned by an internal error; its buffers leak".into())
    })?;
    release(op)
}

/// Releases a single-GPU operation: dropping it frees its workspace after a context
/// synchronisation.
fn drop_op<T>(op: T) -> Result<()> {
    drop(op);
    Ok(())
}

/// A LASP-2 operation of one layout and mode (collective).
///
/// # Safety
/// As [`create_op`].
unsafe fn create_chain_op<T>(
    runtime: *const RuntimeHandle,
    (batch, heads, dk, dv): (i64, i64, i64, i64),
    mode: i32,
    out: *mut *mut OpHandle<T>,
    make: impl FnOnce(&Runtime, Lasp2Layout, ExchangeMode) -> Result<T>,
) -> Status {
    run(|| {
        let (layout, mode) = (layout(batch, heads, dk, dv)?, exchange_mode(mode)?);
        // SAFETY: the caller's contract.
        unsafe { create_op(runtime, out, |rt| make(rt, layout, mode)) }
    })
}

/// # Safety
/// `op` is a live handle.
unsafe fn set_mode_of<T: ChainOp>(op: *const OpHandle<T>, mode: i32) -> Status {
    run(|| {
        let mode = exchange_mode(mode)?;
        // SAFETY: the caller's contract.
        unsafe { with_op(op, |_, op| op.set_mode(mode)) }
    })
}

/// # Safety
/// `op` is a live handle.
unsafe fn finish_of<T: ChainOp>(op: *const OpHandle<T>, stream: sys::CUstream) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe { with_op(op, |rt, op| op.finish(&borrowed_stream(rt, stream)?)) }
    })
}

/// # Safety
/// `op` is a live handle.
unsafe fn note_replayed_calls_of<T: ChainOp>(op: *const OpHandle<T>, calls: u64) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe {
            with_op(op, |_, op| {
                op.note_replayed_calls(calls);
                Ok(())
            })
        }
    })
}

/// # Safety
/// `op` is a live handle, not used again afterwards (whatever the status).
unsafe fn free_chain_op<T: ChainOp>(op: *mut OpHandle<T>) -> Status {
    // SAFETY: the caller's contract.
    run(|| unsafe { free_op(op, T::free) })
}

/// Creates the LASP-2 forward of one layout (collective: every rank passes the same B, H, Dk,
/// Dv and mode, or every rank gets an error naming the ranks that differ).
///
/// # Safety
/// `runtime` is a live handle; `op` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_create(
    runtime: *const RuntimeHandle,
    batch: i64,
    heads: i64,
    dk: i64,
    dv: i64,
    mode: i32,
    op: *mut *mut Lasp2Handle,
) -> Status {
    let dims = (batch, heads, dk, dv);
    // SAFETY: the caller's contract.
    unsafe { create_chain_op(runtime, dims, mode, op, Lasp2Forward::new) }
}

/// Switches every rank to another exchange mode (collective).
///
/// # Safety
/// `op` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_set_mode(op: *const Lasp2Handle, mode: i32) -> Status {
    // SAFETY: the caller's contract.
    unsafe { set_mode_of(op, mode) }
}

/// Enqueues one LASP-2 forward of this rank's shard on `stream` (not collective; in the
/// overlapped mode the ranks meet only through device signals). Every argument is checked
/// before anything is enqueued.
///
/// # Safety
/// `op` is a live handle; `args` points at a valid struct whose tensors stay valid, and are
/// not written by anything else, until the call completes on `stream`.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_forward(
    op: *const Lasp2Handle,
    stream: sys::CUstream,
    args: *const ForwardArgsC,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe {
            with_op(op, |rt, forward| {
                let (stream, views) = call_inputs(rt, stream, args, device_views)?;
                forward.forward(&stream, views)
            })
        }
    })
}

/// [`lasp_lasp2_forward`], also writing `start_state` `[B, H, Dk, Dv]` fp32: the state this
/// rank's shard starts from, which the backward takes as its `h0` (keep it for
/// [`lasp_lasp2_backward`]).
///
/// # Safety
/// As [`lasp_lasp2_forward`]; `start_state` is written by the call and must not be read or
/// written by anything else until it completes.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_forward_saving(
    op: *const Lasp2Handle,
    stream: sys::CUstream,
    args: *const ForwardArgsC,
    start_state: *mut f32,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe {
            with_op(op, |rt, forward| {
                let (stream, views) = call_inputs(rt, stream, args, device_views)?;
                let tensors = DeviceTensors {
                    shape: views.shape,
                    ordinal: rt.context().ordinal(),
                };
                let start = tensors.output("start_state", Layout::State, start_state.cast())?;
                forward.forward_saving(&stream, views, Some(start))
            })
        }
    })
}

/// Waits for `stream` and returns `LASP_ERROR_PEER_TIMEOUT`, naming the rank that never sent,
/// the slot and the epoch, if a wait of an earlier call expired.
///
/// # Safety
/// `op` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_finish(
    op: *const Lasp2Handle,
    stream: sys::CUstream,
) -> Status {
    // SAFETY: the caller's contract.
    unsafe { finish_of(op, stream) }
}

/// Tells the operation that a captured CUDA graph holding one call was replayed `calls` times
/// (the sequential modes pick their slot half on the host).
///
/// # Safety
/// `op` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_note_replayed_calls(
    op: *const Lasp2Handle,
    calls: u64,
) -> Status {
    // SAFETY: the caller's contract.
    unsafe { note_replayed_calls_of(op, calls) }
}

/// Frees the operation (collective: its symmetric buffers are freed on every rank).
///
/// # Safety
/// `op` is a live handle, not used again afterwards (whatever the status).
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_free(op: *mut Lasp2Handle) -> Status {
    // SAFETY: the caller's contract.
    unsafe { free_chain_op(op) }
}

/// Creates the LASP-2 backward of one layout (collective, as [`lasp_lasp2_create`]; Dv 64 or
/// 128). It allocates `lasp_lasp2_symmetric_bytes` of its own.
///
/// # Safety
/// `runtime` is a live handle; `op` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_grad_create(
    runtime: *const RuntimeHandle,
    batch: i64,
    heads: i64,
    dk: i64,
    dv: i64,
    mode: i32,
    op: *mut *mut Lasp2GradHandle,
) -> Status {
    let dims = (batch, heads, dk, dv);
    // SAFETY: the caller's contract.
    unsafe { create_chain_op(runtime, dims, mode, op, Lasp2Backward::new) }
}

/// Switches every rank's backward to another exchange mode (collective).
///
/// # Safety
/// `op` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_grad_set_mode(op: *const Lasp2GradHandle, mode: i32) -> Status {
    // SAFETY: the caller's contract.
    unsafe { set_mode_of(op, mode) }
}

/// Enqueues the backward of this rank's shard on `stream` (not collective, as the forward).
/// `args.h0` is the `start_state` of this rank's forward call; `grad_ht` is given on the last
/// rank only and `grad_h0` written on rank 0 only (NULL elsewhere). Every argument is checked
/// before anything is enqueued.
///
/// # Safety
/// `op` is a live handle; `args` points at a valid struct whose tensors stay valid, and are
/// not written by anything else, until the call completes on `stream`.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_backward(
    op: *const Lasp2GradHandle,
    stream: sys::CUstream,
    args: *const BackwardArgsC,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe {
            with_op(op, |rt, backward| {
                let (stream, views) = call_inputs(rt, stream, args, backward_views)?;
                backward.backward(&stream, views)
            })
        }
    })
}

/// As [`lasp_lasp2_finish`], for the backward.
///
/// # Safety
/// `op` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_grad_finish(
    op: *const Lasp2GradHandle,
    stream: sys::CUstream,
) -> Status {
    // SAFETY: the caller's contract.
    unsafe { finish_of(op, stream) }
}

/// As [`lasp_lasp2_note_replayed_calls`], for the backward.
///
/// # Safety
/// `op` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_grad_note_replayed_calls(
    op: *const Lasp2GradHandle,
    calls: u64,
) -> Status {
    // SAFETY: the caller's contract.
    unsafe { note_replayed_calls_of(op, calls) }
}

/// Frees the backward (collective).
///
/// # Safety
/// `op` is a live handle, not used again afterwards (whatever the status).
#[no_mangle]
pub unsafe extern "C" fn lasp_lasp2_grad_free(op: *mut Lasp2GradHandle) -> Status {
    // SAFETY: the caller's contract.
    unsafe { free_chain_op(op) }
}

/// Creates the single-GPU scalar-decay forward (not collective).
///
/// # Safety
/// `runtime` is a live handle; `op` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_scalar_decay_create(
    runtime: *const RuntimeHandle,
    op: *mut *mut ScalarDecayHandle,
) -> Status {
    // SAFETY: the caller's contract.
    run(|| unsafe { create_op(runtime, op, ScalarDecayForward::new) })
}

/// Enqueues the chunkwise forward of one GPU's whole sequences on `stream`.
///
/// # Safety
/// As [`lasp_lasp2_forward`].
#[no_mangle]
pub unsafe extern "C" fn lasp_scalar_decay_forward(
    op: *const ScalarDecayHandle,
    stream: sys::CUstream,
    args: *const ForwardArgsC,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe {
            with_op(op, |rt, forward| {
                let (stream, views) = call_inputs(rt, stream, args, device_views)?;
                forward.launch(&stream, views).map(|_plan| ())
            })
        }
    })
}

/// Frees the operation (after the GPU has finished with its workspace).
///
/// # Safety
/// `op` is a live handle, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn lasp_scalar_decay_free(op: *mut ScalarDecayHandle) -> Status {
    // SAFETY: the caller's contract.
    run(|| unsafe { free_op(op, drop_op) })
}

/// Creates the single-GPU scalar-decay backward (not collective).
///
/// # Safety
/// `runtime` is a live handle; `op` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_scalar_decay_grad_create(
    runtime: *const RuntimeHandle,
    op: *mut *mut ScalarDecayGradHandle,
) -> Status {
    // SAFETY: the caller's contract.
    run(|| unsafe { create_op(runtime, op, ScalarDecayBackward::new) })
}

/// Enqueues the backward of one GPU's whole sequences on `stream`: `args.h0` and `grad_ht` as
/// the forward's `h0` and the gradient of its `ht` (NULL for zero), `grad_h0` written unless
/// NULL. Dv 64 or 128.
///
/// # Safety
/// As [`lasp_lasp2_backward`].
#[no_mangle]
pub unsafe extern "C" fn lasp_scalar_decay_backward(
    op: *const ScalarDecayGradHandle,
    stream: sys::CUstream,
    args: *const BackwardArgsC,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        unsafe {
            with_op(op, |rt, backward| {
                let (stream, views) = call_inputs(rt, stream, args, backward_views)?;
                backward.launch(&stream, views)
            })
        }
    })
}

/// Frees the backward (after the GPU has finished with its workspace).
///
/// # Safety
/// `op` is a live handle, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn lasp_scalar_decay_grad_free(op: *mut ScalarDecayGradHandle) -> Status {
    // SAFETY: the caller's contract.
    run(|| unsafe { free_op(op, drop_op) })
}

#[cfg(test)]
mod tests {
    use super::status::*;
    use super::*;
    use std::collections::BTreeSet;
    use std::mem::{offset_of, size_of};

    const HEADER: &str = include_str!("../../include/lasp_shmem.h");

    /// `#define NAME VALUE` lines of the header (VALUE without a `u` suffix).
    fn header_define(name: &str) -> u32 {
        HEADER
            .lines()
            .filter_map(|l| l.strip_prefix("#define "))
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some(name)).then(|| words.next().expect("a value"))
            })
            .unwrap_or_else(|| panic!("{name} is not defined in lasp_shmem.h"))
            .trim_end_matches('u')
            .parse()
            .expect("a number")
    }

    #[test]
    fn structs_have_the_layout_the_header_asserts() {
        assert_eq!(size_of::<RuntimeOptions>(), 32);
        assert_eq!(offset_of!(RuntimeOptions, symmetric_heap_bytes), 8);
        assert_eq!(offset_of!(RuntimeOptions, nvshmem_library), 24);
        assert_eq!(size_of::<Place>(), 16);
        assert_eq!(size_of::<UniqueId>(), 128);
        assert_eq!(size_of::<ForwardArgsC>(), 104);
        assert_eq!(offset_of!(ForwardArgsC, q), 40);
        assert_eq!(offset_of!(ForwardArgsC, ht), 88);
        assert_eq!(offset_of!(ForwardArgsC, scale), 96);
        assert_eq!(size_of::<BackwardArgsC>(), 144);
        assert_eq!(offset_of!(BackwardArgsC, q), 40);
        assert_eq!(offset_of!(BackwardArgsC, grad_o), 80);
        assert_eq!(offset_of!(BackwardArgsC, grad_q), 96);
        assert_eq!(offset_of!(BackwardArgsC, grad_h0), 128);
        assert_eq!(offset_of!(BackwardArgsC, scale), 136);
        for (name, size) in [
            ("lasp_runtime_options", 32),
            ("lasp_place", 16),
            ("lasp_unique_id", 128),
            ("lasp_forward_args", 104),
            ("lasp_backward_args", 144),
        ] {
            let assertion = format!("_Static_assert(sizeof({name}) == {size},");
            assert!(HEADER.contains(&assertion), "the header lacks {assertion}");
        }
    }

    #[test]
    fn the_header_defines_the_codes_and_modes_of_the_library() {
        assert_eq!(header_define("LASP_SHMEM_ABI_VERSION"), ABI_VERSION);
        for (name, code) in [
            ("LASP_OK", LASP_OK),
            ("LASP_ERROR_INVALID_ARGUMENT", LASP_ERROR_INVALID_ARGUMENT),
            ("LASP_ERROR_LAUNCH", LASP_ERROR_LAUNCH),
            ("LASP_ERROR_CUDA", LASP_ERROR_CUDA),
            ("LASP_ERROR_NVSHMEM", LASP_ERROR_NVSHMEM),
            ("LASP_ERROR_PEER_TIMEOUT", LASP_ERROR_PEER_TIMEOUT),
            ("LASP_ERROR_STATE", LASP_ERROR_STATE),
            ("LASP_ERROR_INTERNAL", LASP_ERROR_INTERNAL),
        ] {
            assert_eq!(header_define(name) as Status, code, "{name}");
        }
        for (name, mode) in [
            ("LASP_MODE_OVERLAPPED", ExchangeMode::Overlapped),
            ("LASP_MODE_SEQUENTIAL_NCCL", ExchangeMode::SequentialNccl),
            (
                "LASP_MODE_SEQUENTIAL_NVSHMEM",
                ExchangeMode::SequentialNvshmem,
            ),
            ("LASP_MODE_NO_COMM", ExchangeMode::NoComm),
        ] {
            assert_eq!(
                exchange_mode(header_define(name) as i32).unwrap(),
                mode,
                "{name}"
            );
        }
        assert!(exchange_mode(4).is_err() && exchange_mode(-1).is_err());
    }

    #[test]
    fn the_header_declares_exactly_the_exported_functions() {
        let sources = [include_str!("mod.rs"), include_str!("status.rs")];
        let exported: BTreeSet<&str> = sources
            .iter()
            .flat_map(|s| s.split("extern \"C\" fn ").skip(1))
            .map(|rest| rest.split('(').next().expect("a name"))
            .collect();
        // The identifier before each '(' of the header, where it names a lasp_ function.
        let declared: BTreeSet<&str> = HEADER
            .split('(')
            .filter_map(|before| {
                before
                    .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                    .next()
            })
            .filter(|w| w.starts_with("lasp_"))
            .collect();
        assert_eq!(exported, declared);
        assert_eq!(exported.len(), 27);
    }

    #[test]
    fn options_are_read_and_checked() {
        assert_eq!(
            unsafe { config_of(std::ptr::null()) }
                .unwrap()
                .symmetric_heap_bytes,
            256 << 20
        );
        let library = c"/opt/nvshmem/lib/libnvshmem_host.so.3";
        let options = RuntimeOptions {
            abi_version: ABI_VERSION,
            reserved: 0,
            symmetric_heap_bytes: 1 << 30,
            wait_timeout_ms: 2500,
            nvshmem_library: library.as_ptr(),
        };
        // SAFETY: a valid struct with a NUL-terminated path.
        let config = unsafe { config_of(&options) }.unwrap();
        assert_eq!(config.symmetric_heap_bytes, 1 << 30);
        assert_eq!(config.wait_timeout, Duration::from_millis(2500));
        assert_eq!(
            config.nvshmem_library.unwrap(),
            PathBuf::from("/opt/nvshmem/lib/libnvshmem_host.so.3")
        );
        let stale = RuntimeOptions {
            abi_version: 0,
            ..options
        };
        // SAFETY: as above.
        let msg = unsafe { config_of(&stale) }.unwrap_err().to_string();
        assert!(
            msg.contains("abi_version is 0 but this library implements ABI 1"),
            "{msg}"
        );
    }

    #[test]
    fn forward_arguments_are_checked_before_the_driver_is_asked() {
        let args = |dk: i64, tokens: i64| ForwardArgsC {
            batch: 1,
            tokens,
            heads: 2,
            dk,
            dv: 64,
            q: std::ptr::null(),
            k: std::ptr::null(),
            v: std::ptr::null(),
            g: std::ptr::null(),
            h0: std::ptr::null(),
            o: std::ptr::null_mut(),
            ht: std::ptr::null_mut(),
            scale: 0.0,
            reserved: 0,
        };
        // SAFETY: only the shape and NULL pointers are looked at: no device memory is touched.
        let msg = |a: ForwardArgsC| unsafe { device_views(&a, 0) }.unwrap_err().to_string();
        assert!(msg(args(128, -1)).contains("args.tokens = -1 is negative"));
        assert!(msg(args(32, 8)).contains("Dk = 32 is not supported"));
        assert!(msg(args(64, 0)).contains("B, T and H must be at least 1"));
        assert!(msg(args(64, 8)).starts_with("q is NULL; pass the device pointer"));
    }

    #[test]
    fn backward_arguments_are_checked_before_the_driver_is_asked() {
        let args = |dv: i64, heads: i64| BackwardArgsC {
            batch: 2,
            tokens: 100,
            heads,
            dk: 128,
            dv,
            q: std::ptr::null(),
            k: std::ptr::null(),
            v: std::ptr::null(),
            g: std::ptr::null(),
            h0: std::ptr::null(),
            grad_o: std::ptr::null(),
            grad_ht: std::ptr::null(),
            grad_q: std::ptr::null_mut(),
            grad_k: std::ptr::null_mut(),
            grad_v: std::ptr::null_mut(),
            grad_g: std::ptr::null_mut(),
            grad_h0: std::ptr::null_mut(),
            scale: 0.0,
            reserved: 0,
        };
        // SAFETY: only the shape and NULL pointers are looked at: no device memory is touched.
        let msg = |a: BackwardArgsC| unsafe { backward_views(&a, 0) }.unwrap_err().to_string();
        assert!(msg(args(64, -3)).contains("args.heads = -3 is negative"));
        assert!(msg(args(64, 0)).contains("B, T and H must be at least 1"));
        assert!(msg(args(64, 4)).starts_with("q is NULL; pass the device pointer"));
    }
}
