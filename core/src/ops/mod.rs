//! Compute operations on caller streams, with validated arguments and launch plans.
//!
//! * [`scalar_decay::ScalarDecayForward`]: the chunkwise forward of scalar-decay linear attention
//!   (simple GLA / RetNet / Lightning) on one GPU.
//! * [`scalar_decay::ScalarDecayBackward`]: its backward (dq, dk, dv, dg, dh0) on one GPU.
//! * [`scalar_decay::lasp2::Lasp2Forward`] and [`scalar_decay::lasp2::Lasp2Backward`]: both
//!   across GPUs (LASP-2), on the family-generic exchange of [`crate::exchange`].
//!
//! Tensors are passed as [`DeviceRef`] (read) and [`DeviceMut`] (written) views: a device address,
//! an element count and a borrow of the buffer they came from, so the borrow checker keeps an
//! output from aliasing anything else the call reads. Build them from cudarc buffers
//! ([`DeviceRef::new`], [`DeviceMut::new`]) or, behind `unsafe`, from raw device pointers (a C
//! ABI, a PyTorch tensor's `data_ptr()`).
//!
//! Ordering is the caller's: an operation enqueues its kernels on the stream it is given and adds
//! no event waits (the runtime turns cudarc's event tracking off), so every buffer must be ready
//! on that stream when the call is made.

// Lint debt: this module is being rewritten; remove with the rewrite.
#![allow(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

use crate::error::{Error, Result};
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::marker::PhantomData;
use std::sync::Arc;

pub mod scalar_decay;

/// bfloat16, the element type of activations (`half::bf16`, which cudarc's `f16` feature also
/// uses, so `CudaSlice<bf16>` works as is).
pub use half::bf16;

/// The accessors [`DeviceRef`] and [`DeviceMut`] share, for an `impl<T>` block of a view with
/// `addr` and `len` fields.
macro_rules! view_accessors {
    () => {
        /// The device address of element 0.
        pub fn addr(&self) -> u64 {
            self.addr
        }

        /// The number of elements.
        pub fn len(&self) -> usize {
            self.len
        }

        /// Whether the view has no elements.
        pub fn is_empty(&self) -> bool {
            self.len == 0
        }

        /// The byte range `[start, end)` the view covers.
        pub fn byte_range(&self) -> (u64, u64) {
            byte_range::<T>(self.addr, self.len)
        }
    };
}

/// A device tensor an operation reads: its base address and length in elements of `T`, borrowed
/// from the buffer it came from for `'a`.
#[derive(Debug)]
pub struct DeviceRef<'a, T> {
    addr: u64,
    len: usize,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for DeviceRef<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DeviceRef<'_, T> {}

impl<'a, T> DeviceRef<'a, T> {
    /// A view of a whole `CudaSlice` or `CudaView`.
    pub fn new<S: DevicePtr<T>>(buf: &'a S) -> Self {
        let (addr, _no_events) = buf.device_ptr(buf.stream());
        DeviceRef {
            addr,
            len: buf.len(),
            _borrow: PhantomData,
        }
    }

    /// A view of `len` elements of `T` at device address `addr`.
    ///
    /// # Safety
    /// The memory must be a live allocation of this GPU's context holding at least `len`
    /// elements of `T`, must stay valid until every operation given the view has completed on
    /// its stream, and must not be written by anything while those operations run.
    pub unsafe fn from_raw(addr: u64, len: usize) -> Self {
        DeviceRef {
            addr,
            len,
            _borrow: PhantomData,
        }
    }

    view_accessors!();
}

/// A device tensor an operation writes: its base address and length in elements of `T`,
/// borrowed mutably from the buffer it came from for `'a`.
#[derive(Debug)]
pub struct DeviceMut<'a, T> {
    addr: u64,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T> DeviceMut<'a, T> {
    /// A view of a whole `CudaSlice` or `CudaViewMut`.
    pub fn new<S: DevicePtrMut<T>>(buf: &'a mut S) -> Self {
        let stream = buf.stream().clone();
        let len = buf.len();
        let (addr, _no_events) = buf.device_ptr_mut(&stream);
        DeviceMut {
            addr,
            len,
            _borrow: PhantomData,
        }
    }

    /// A view of `len` elements of `T` at device address `addr`.
    ///
    /// # Safety
    /// The memory must be a live allocation of this GPU's context holding at least `len`
    /// elements of `T`, must stay valid until every operation given the view has completed on
    /// its stream, and must not be read or written by anything else while those operations run.
    pub unsafe fn from_raw(addr: u64, len: usize) -> Self {
        DeviceMut {
            addr,
            len,
            _borrow: PhantomData,
        }
    }

    view_accessors!();
}

/// The GPU's streaming multiprocessors (at least 1): what launch plans aim their CTA counts at.
pub(crate) fn sm_count(ctx: &CudaContext) -> Result<u32> {
    Ok(ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?
        .max(1) as u32)
}

/// Makes `workspace` hold at least `bytes` bytes (`op` names the operation in errors). Growing
/// it waits for the whole context first (earlier calls, on any stream, may still use the old
/// one) and for `stream` after the allocation (so the new one is usable from any stream). Neither
/// can be captured into a CUDA graph, so growing is refused, saying what to do, while `stream`
/// is being captured.
pub(crate) fn ensure_workspace(
    ctx: &CudaContext,
    stream: &Arc<CudaStream>,
    workspace: &mut Option<CudaSlice<u8>>,
    bytes: u64,
    op: &str,
) -> Result<()> {
    if bytes <= workspace.as_ref().map_or(0, |w| w.len() as u64) {
        return Ok(());
    }
    if stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(Error::InvalidArgument(format!(
            "{op}: this call needs a larger workspace, which cannot be allocated while the stream \
             is captured into a CUDA graph; make one call of the same shape before the capture \
             (it sizes the workspace), then capture"
        )));
    }
    let len = usize::try_from(bytes).map_err(|_| {
        Error::InvalidArgument(format!(
            "{op}: workspace of {bytes} bytes does not fit this host"
        ))
    })?;
    ctx.synchronize()?;
    *workspace = None;
    *workspace = Some(stream.alloc_zeros::<u8>(len)?);
    stream.synchronize()?;
    Ok(())
}

fn byte_range<T>(addr: u64, len: usize) -> (u64, u64) {
    let bytes = (len as u64).saturating_mul(std::mem::size_of::<T>() as u64);
    (addr, addr.saturating_add(bytes))
}

/// Whether two byte ranges share at least one byte (empty ranges overlap nothing).
pub(crate) fn ranges_overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < a.1 && b.0 < b.1 && a.0 < b.1 && b.0 < a.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_of_byte_ranges() {
        assert!(ranges_overlap((0, 16), (8, 24)));
        assert!(ranges_overlap((8, 24), (0, 16)));
        assert!(ranges_overlap((0, 16), (0, 16)));
        assert!(!ranges_overlap((0, 16), (16, 32)));
        assert!(!ranges_overlap((16, 32), (0, 16)));
        assert!(!ranges_overlap((0, 0), (0, 16)));
        // SAFETY: views of fake addresses are only measured, never launched.
        let v = unsafe { DeviceRef::<f32>::from_raw(256, 10) };
        assert_eq!(v.byte_range(), (256, 296));
        let m = unsafe { DeviceMut::<bf16>::from_raw(512, 10) };
        assert_eq!(m.byte_range(), (512, 532));
    }
}
