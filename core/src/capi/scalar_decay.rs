//! Entry points of the single-GPU scalar-decay operations, forward and backward: creation, the
//! call on one GPU's whole sequences, and free.

use super::abi::{BackwardArgsC, ForwardArgsC};
use super::args::{backward_views, call_inputs, device_views};
use super::handles::{
    create_op, free_op, with_op, RuntimeHandle, ScalarDecayGradHandle, ScalarDecayHandle,
};
use super::status::{run, Status};
use crate::error::Result;
use crate::ops::scalar_decay::ScalarDecayBackward;
use crate::ops::scalar_decay::ScalarDecayForward;
use cudarc::driver::sys;

/// Releases a single-GPU operation: dropping it frees its workspace after a context
/// synchronisation.
fn drop_op<T>(op: T) -> Result<()> {
    drop(op);
    Ok(())
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
///
/// [`lasp_lasp2_forward`]: super::lasp_lasp2_forward
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
///
/// [`lasp_lasp2_backward`]: super::lasp_lasp2_backward
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
