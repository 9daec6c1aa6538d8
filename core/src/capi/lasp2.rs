//! Entry points of the LASP-2 operations, forward and backward: the symmetric memory one needs,
//! their collective creation, mode switch and free, the calls on this rank's shard, and the
//! completion check and graph replay count.

use super::abi::{BackwardArgsC, ForwardArgsC};
use super::args::{
    backward_views, borrowed_stream, call_inputs, count, device_views, invalid, put, DeviceTensors,
    Layout,
};
use super::handles::{
    create_op, free_op, with_op, Lasp2GradHandle, Lasp2Handle, OpHandle, RuntimeHandle,
};
use super::status::{run, Status};
use crate::error::Result;
use crate::family::Family;
use crate::ops::scalar_decay::lasp2::{ExchangeMode, Lasp2Backward, Lasp2Forward, Lasp2Layout};
use crate::ops::scalar_decay::ScalarDecay;
use crate::runtime::Runtime;
use cudarc::driver::{sys, CudaStream};
use std::sync::Arc;

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

pub(super) fn exchange_mode(mode: i32) -> Result<ExchangeMode> {
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
    ScalarDecay::validate_layout(&layout)?;
    Ok(layout)
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
        unsafe {
            put(
                bytes,
                "bytes",
                layout.symmetric_bytes::<ScalarDecay>(npes) as u64,
            )
        }
    })
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
