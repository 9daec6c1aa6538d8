//! Checks of what a caller passes, before anything uses it: pointers to its structs and
//! out-pointers, counts, its stream, and the device pointers of a call's tensors, checked against
//! the driver's record and the shape and turned into views.

// Lint debt: this module is being rewritten; remove with the rewrite.
#![allow(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

use super::abi::{BackwardArgsC, ForwardArgsC};
use super::memory;
use crate::error::{Error, Result};
use crate::ops::scalar_decay::BackwardArgs;
use crate::ops::scalar_decay::{ForwardArgs, ForwardShape};
use crate::ops::{DeviceMut, DeviceRef};
use crate::runtime::Runtime;
use cudarc::driver::{sys, CudaStream};
use std::ffi::c_void;
use std::sync::Arc;

pub(super) fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// `*ptr` for a pointer the caller passed, or an error naming the argument.
///
/// # Safety
/// A non-NULL `ptr` must point at a live, properly aligned `T` for `'a`.
pub(super) unsafe fn arg<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller's contract.
    unsafe { ptr.as_ref() }.ok_or_else(|| invalid(format!("{name} is NULL")))
}

/// Writes `value` to an out-pointer the caller passed.
///
/// # Safety
/// A non-NULL `ptr` must point at writable memory for a `T`.
pub(super) unsafe fn put<T>(ptr: *mut T, name: &str, value: T) -> Result<()> {
    if ptr.is_null() {
        return Err(invalid(format!(
            "{name} is NULL; pass where to store the result"
        )));
    }
    // SAFETY: the caller's contract; `write` does not drop the uninitialised old value.
    unsafe { ptr.write(value) };
    Ok(())
}

/// A count the caller passed as a signed C integer, as a `usize`; `name` goes into the error.
pub(super) fn count<T: TryInto<usize> + Copy + std::fmt::Display>(
    name: &str,
    v: T,
) -> Result<usize> {
    v.try_into()
        .map_err(|_| invalid(format!("{name} = {v} is negative")))
}

/// The caller's stream, checked to belong to the runtime's context.
pub(super) fn borrowed_stream(runtime: &Runtime, stream: sys::CUstream) -> Result<Arc<CudaStream>> {
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
pub(super) enum Layout {
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
pub(super) struct DeviceTensors {
    pub(super) shape: ForwardShape,
    pub(super) ordinal: usize,
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
    pub(super) unsafe fn output<'a, T>(
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
pub(super) unsafe fn device_views<'a>(a: &ForwardArgsC, ordinal: usize) -> Result<ForwardArgs<'a>> {
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
pub(super) unsafe fn backward_views<'a>(
    a: &BackwardArgsC,
    ordinal: usize,
) -> Result<BackwardArgs<'a>> {
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
pub(super) unsafe fn call_inputs<A, V>(
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
