//! The handles a caller holds: what each owns, how one is handed out and taken back, and how an
//! entry point makes, runs or frees the operation behind one.

use super::args::{arg, invalid, put};
use crate::error::{Error, Result};
use crate::ops::scalar_decay::lasp2::{Lasp2Backward, Lasp2Forward};
use crate::ops::scalar_decay::ScalarDecayBackward;
use crate::ops::scalar_decay::ScalarDecayForward;
use crate::runtime::Runtime;
use std::sync::Mutex;

/// `lasp_runtime`.
pub struct RuntimeHandle {
    pub(super) runtime: Runtime,
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

/// Fails unless `out` can receive a handle; checked before the work that makes the handle, so
/// that a NULL out-pointer leaks nothing.
pub(super) fn check_out<T>(out: *mut *mut T, name: &str) -> Result<()> {
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
pub(super) unsafe fn store_handle<T>(out: *mut *mut T, name: &str, value: T) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { put(out, name, Box::into_raw(Box::new(value))) }
}

/// Takes back a handle the caller gives up.
///
/// # Safety
/// A non-NULL `handle` came from [`store_handle`] and is not used by the caller afterwards.
pub(super) unsafe fn take_handle<T>(handle: *mut T, name: &str) -> Result<Box<T>> {
    if handle.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: the caller's contract.
    Ok(unsafe { Box::from_raw(handle) })
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

/// Makes an operation with the runtime behind `runtime` and hands it to the caller at `*out`.
///
/// # Safety
/// `runtime` is a live handle; `out` points at writable memory.
pub(super) unsafe fn create_op<T>(
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
pub(super) unsafe fn with_op<T, R>(
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
pub(super) unsafe fn free_op<T>(
    op: *mut OpHandle<T>,
    release: impl FnOnce(T) -> Result<()>,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let handle = unsafe { take_handle(op, "op")? };
    handle.runtime.context().bind_to_thread()?;
    let op = handle.op.into_inner().map_err(|_| {
        Error::State("the operation was poisoned by an internal error; its buffers leak".into())
    })?;
    release(op)
}
