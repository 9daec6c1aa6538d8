//! Entry points of `lasp_op`, one set for every family: the symmetric memory an op needs, its
//! creation from a descriptor, the forward and backward calls, the check of a call without a GPU,
//! the mode switch, the completion check, graph replays and the free.

use super::abi::{Call, OpDesc, Tensors, LASP_DIRECTION_BACKWARD, LASP_DIRECTION_FORWARD};
use super::args::{arg, borrowed_stream, invalid, put, sized_arg};
use super::families::Direction;
use super::handles::{check_out, op_arg, store_handle, take_handle, OpHandle, RuntimeHandle};
use super::spec::{exchange_mode, mode_code, OpSpec};
use super::status::{run, Status};
use super::tensors::{plan_call, CallPlan};
use crate::error::Result;
use cudarc::driver::sys;

/// The checked descriptor the caller passed.
///
/// # Safety
/// `desc` is NULL or points at a `lasp_op_desc` whose `struct_size` is its size.
unsafe fn spec_of(desc: *const OpDesc) -> Result<OpSpec> {
    // SAFETY: the caller's contract.
    OpSpec::of(unsafe { sized_arg(desc, "desc")? })
}

/// A call's scalars and tensors checked against `spec`, up to the device pointers.
///
/// # Safety
/// `call` and `tensors` are NULL or point at their structs, whose `struct_size` is their size.
unsafe fn plan_of(
    spec: &OpSpec,
    direction: Direction,
    call: *const Call,
    tensors: *const Tensors,
) -> Result<CallPlan> {
    // SAFETY: the caller's contract.
    let (call, tensors) = unsafe { (sized_arg(call, "call")?, sized_arg(tensors, "tensors")?) };
    plan_call(spec, direction, call, tensors)
}

/// Symmetric bytes per rank that [`lasp_op_create`] of `desc` allocates on `npes` ranks (0 on
/// one GPU), to size `options.symmetric_heap_bytes` before init. Checks `desc` as
/// [`lasp_op_create`] does.
///
/// # Safety
/// `desc` is NULL or valid; `bytes` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_symmetric_bytes(
    desc: *const OpDesc,
    npes: i32,
    bytes: *mut u64,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let spec = unsafe { spec_of(desc)? };
        let npes = usize::try_from(npes)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("npes = {npes} must be at least 1")))?;
        // SAFETY: the caller's contract.
        unsafe { put(bytes, "bytes", spec.symmetric_bytes(npes)) }
    })
}

/// Creates the operation `desc` describes (collective for LASP-2: every rank passes the same
/// descriptor, or every rank gets an error naming the ranks that differ). The descriptor is
/// checked before the runtime is used.
///
/// # Safety
/// `runtime` is NULL or a live handle; `desc` is NULL or valid; `op` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_create(
    runtime: *const RuntimeHandle,
    desc: *const OpDesc,
    op: *mut *mut OpHandle,
) -> Status {
    run(|| {
        check_out(op, "op")?;
        // SAFETY: the caller's contract.
        let spec = unsafe { spec_of(desc)? };
        // SAFETY: the caller's contract.
        let runtime = unsafe { arg(runtime, "runtime")? }.runtime.clone();
        runtime.context().bind_to_thread()?;
        let family_op = spec.family.create(&runtime, &spec)?;
        // SAFETY: the caller's contract (and `op` is not NULL, checked above).
        unsafe { store_handle(op, "op", OpHandle::new(runtime, spec, family_op)) }
    })
}

/// Enqueues one call of `direction` on `stream`, every argument checked first.
///
/// # Safety
/// As [`lasp_op_forward`].
unsafe fn enqueue(
    op: *const OpHandle,
    stream: sys::CUstream,
    call: *const Call,
    tensors: *const Tensors,
    direction: Direction,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let handle = unsafe { op_arg(op)? };
        // SAFETY: the caller's contract.
        let plan = unsafe { plan_of(&handle.spec, direction, call, tensors)? };
        let mut family_op = handle.lock()?;
        let stream = borrowed_stream(&handle.runtime, stream)?;
        // SAFETY: the tensors stay valid and untouched by others until the call completes on
        // `stream` (the caller's contract); the views do not outlive this call's enqueueing.
        let checked = unsafe { plan.check_device(handle.runtime.context().ordinal())? };
        match direction {
            Direction::Forward => family_op.forward(&stream, checked),
            Direction::Backward => family_op.backward(&stream, checked),
        }
    })
}

/// Enqueues one forward on `stream` (not collective; in the overlapped mode the ranks meet only
/// through device signals). Every argument is checked before anything is enqueued.
///
/// # Safety
/// `op` is NULL or a live handle; `call` and `tensors` are NULL or valid structs whose tensors
/// stay valid, and are not written by anything else, until the call completes on `stream`.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_forward(
    op: *const OpHandle,
    stream: sys::CUstream,
    call: *const Call,
    tensors: *const Tensors,
) -> Status {
    // SAFETY: the caller's contract.
    unsafe { enqueue(op, stream, call, tensors, Direction::Forward) }
}

/// Enqueues one backward on `stream`, on an op created with `LASP_OP_WITH_BACKWARD` (not
/// collective, as the forward: every rank calls it once per forward call, in the same order).
///
/// # Safety
/// As [`lasp_op_forward`].
#[no_mangle]
pub unsafe extern "C" fn lasp_op_backward(
    op: *const OpHandle,
    stream: sys::CUstream,
    call: *const Call,
    tensors: *const Tensors,
) -> Status {
    // SAFETY: the caller's contract.
    unsafe { enqueue(op, stream, call, tensors, Direction::Backward) }
}

/// Checks a call against `desc` as [`lasp_op_forward`] (`LASP_DIRECTION_FORWARD`) or
/// [`lasp_op_backward`] (`LASP_DIRECTION_BACKWARD`) do, up to the device pointers and the
/// stream, with no runtime or GPU.
///
/// # Safety
/// `desc`, `call` and `tensors` are NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_check_call(
    desc: *const OpDesc,
    direction: i32,
    call: *const Call,
    tensors: *const Tensors,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let spec = unsafe { spec_of(desc)? };
        let direction = direction_of(direction)?;
        // SAFETY: the caller's contract.
        unsafe { plan_of(&spec, direction, call, tensors) }.map(drop)
    })
}

/// The direction of a `LASP_DIRECTION_*`.
fn direction_of(direction: i32) -> Result<Direction> {
    match direction {
        LASP_DIRECTION_FORWARD => Ok(Direction::Forward),
        LASP_DIRECTION_BACKWARD => Ok(Direction::Backward),
        other => Err(invalid(format!(
            "direction {other} is not LASP_DIRECTION_FORWARD (0) or LASP_DIRECTION_BACKWARD (1)"
        ))),
    }
}

/// Times the exchange modes (and the launch plans that keep the bits) on this call of
/// `direction`, switches every rank's op of that direction to the fastest and writes its
/// `LASP_MODE_*` to `mode` (collective, LASP-2: every rank passes its own tensors of the same
/// layout; the calls write the outputs as the forward or backward does).
///
/// # Safety
/// As [`lasp_op_forward`]; `mode` points at writable memory.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_plan(
    op: *const OpHandle,
    stream: sys::CUstream,
    direction: i32,
    call: *const Call,
    tensors: *const Tensors,
    mode: *mut i32,
) -> Status {
    run(|| {
        // Before the planner's collectives, so that no rank leaves them for a bad argument.
        if mode.is_null() {
            return Err(invalid(
                "mode is NULL; pass where to store the chosen LASP_MODE_*".into(),
            ));
        }
        let direction = direction_of(direction)?;
        // SAFETY: the caller's contract.
        let handle = unsafe { op_arg(op)? };
        // SAFETY: the caller's contract.
        let plan = unsafe { plan_of(&handle.spec, direction, call, tensors)? };
        let mut family_op = handle.lock()?;
        let stream = borrowed_stream(&handle.runtime, stream)?;
        // SAFETY: as in `enqueue`: the tensors stay valid and untouched by others until the
        // planner's calls complete (it synchronises before it returns).
        let checked = unsafe { plan.check_device(handle.runtime.context().ordinal())? };
        let chosen = family_op.plan(&handle.runtime, &stream, direction, checked)?;
        // SAFETY: the caller's contract (and `mode` is not NULL, checked above).
        unsafe { put(mode, "mode", mode_code(chosen)) }
    })
}

/// Switches every rank's forward and backward to another exchange mode (collective; LASP-2).
///
/// # Safety
/// `op` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_set_mode(op: *const OpHandle, mode: i32) -> Status {
    run(|| {
        let mode = exchange_mode(mode)?;
        // SAFETY: the caller's contract.
        unsafe { op_arg(op)? }.lock()?.set_mode(mode)
    })
}

/// Waits for `stream` and returns `LASP_ERROR_PEER_TIMEOUT`, naming the rank that never sent,
/// the slot and the epoch, if a wait of an earlier call expired.
///
/// # Safety
/// `op` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_finish(op: *const OpHandle, stream: sys::CUstream) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let handle = unsafe { op_arg(op)? };
        let family_op = handle.lock()?;
        family_op.finish(&borrowed_stream(&handle.runtime, stream)?)
    })
}

/// Tells the operation how many forward and backward calls captured CUDA graphs replayed since
/// the last report (the sequential modes pick their slot half on the host).
///
/// # Safety
/// `op` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn lasp_op_note_replayed_calls(
    op: *const OpHandle,
    forward_calls: u64,
    backward_calls: u64,
) -> Status {
    run(|| {
        // SAFETY: the caller's contract.
        let handle = unsafe { op_arg(op)? };
        if backward_calls > 0 && !handle.spec.with_backward {
            return Err(invalid(format!(
                "backward_calls is {backward_calls} but the op was created without \
                 LASP_OP_WITH_BACKWARD, so no backward call could have been captured; pass 0"
            )));
        }
        handle
            .lock()?
            .note_replayed_calls(forward_calls, backward_calls);
        Ok(())
    })
}

/// Frees the operation (collective for LASP-2: its symmetric buffers are freed on every rank).
///
/// # Safety
/// `op` is NULL or a live handle, not used again afterwards (whatever the status).
#[no_mangle]
pub unsafe extern "C" fn lasp_op_free(op: *mut OpHandle) -> Status {
    // SAFETY: the caller's contract.
    run(|| unsafe { take_handle(op, "op") }?.free())
}
