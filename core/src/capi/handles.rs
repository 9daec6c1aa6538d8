//! The handles a caller holds (`lasp_runtime`, `lasp_op`): what each owns, how one is handed out
//! and taken back, and how an entry point runs the operation behind one.

use super::args::{arg, invalid, put};
use super::families::FamilyOp;
use super::spec::OpSpec;
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use std::sync::{Mutex, MutexGuard};

/// `lasp_runtime`.
pub struct RuntimeHandle {
    pub(super) runtime: Runtime,
}

/// `lasp_op`: the runtime it keeps alive, its checked descriptor and the family's operation,
/// locked per call so that a handle may be used from any thread.
pub struct OpHandle {
    pub(super) runtime: Runtime,
    pub(super) spec: OpSpec,
    op: Mutex<Box<dyn FamilyOp>>,
}

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

impl OpHandle {
    pub(super) fn new(runtime: Runtime, spec: OpSpec, op: Box<dyn FamilyOp>) -> OpHandle {
        OpHandle {
            runtime,
            spec,
            op: Mutex::new(op),
        }
    }

    /// The operation, locked, with its runtime's context current on this thread.
    pub(super) fn lock(&self) -> Result<MutexGuard<'_, Box<dyn FamilyOp>>> {
        self.runtime.context().bind_to_thread()?;
        self.op.lock().map_err(|_| {
            Error::State(
                "an earlier call on this op failed inside the library (a bug); free the op and \
                 create a new one"
                    .into(),
            )
        })
    }

    /// Releases the operation (collective for LASP-2), with its runtime's context current.
    pub(super) fn free(self) -> Result<()> {
        self.runtime.context().bind_to_thread()?;
        let op = self.op.into_inner().map_err(|_| {
            Error::State("the op was poisoned by an internal error; its buffers leak".into())
        })?;
        op.free()
    }
}

/// The operation behind a handle the caller passed.
///
/// # Safety
/// A non-NULL `op` is a live handle.
pub(super) unsafe fn op_arg<'a>(op: *const OpHandle) -> Result<&'a OpHandle> {
    // SAFETY: the caller's contract.
    unsafe { arg(op, "op") }
}
