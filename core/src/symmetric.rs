//! Typed buffers in NVSHMEM's symmetric heap, usable with cudarc copies.

use crate::error::{CudaCall, Error, Result};
use crate::runtime::Runtime;
use cudarc::driver::{
    sys, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop,
};
use std::marker::PhantomData;
use std::sync::Arc;

/// `len` elements of `T` at the same offset of every PE's symmetric heap.
///
/// Allocation and freeing are collective (every PE, same order, same sizes). Dropping a buffer
/// does not free it (that would be a collective on one rank's drop path); its memory returns at
/// [`Runtime::free`] or [`Runtime::shutdown`], which synchronise the runtime's stream only: work
/// that uses the buffer on another stream must be finished (synchronised) before either.
pub struct SymmetricBuffer<T> {
    runtime: Runtime,
    ptr: sys::CUdeviceptr,
    len: usize,
    _element: PhantomData<T>,
}

impl<T: DeviceRepr> SymmetricBuffer<T> {
    /// The device address on this PE (the same offset is valid on every PE for NVSHMEM calls).
    /// Reading it is safe; using it (in a kernel's parameters, an NVSHMEM call) is `unsafe` there.
    pub fn raw(&self) -> sys::CUdeviceptr {
        self.ptr
    }
}

impl Runtime {
    /// Allocates `len` elements of `T` on every PE (collective). Contents are undefined.
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<SymmetricBuffer<T>> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "cannot allocate {len} elements of {} bytes in the symmetric heap",
                    std::mem::size_of::<T>()
                ))
            })?;
        self.inner
            .ctx
            .bind_to_thread()
            .cuda_call("cuCtxSetCurrent")?;
        // SAFETY: NVSHMEM is initialised (self exists); allocation is collective by this fn's
        // contract: every PE calls it with the same size, in the same order.
        let ptr = unsafe { self.inner.nvshmem.malloc(bytes)? };
        self.inner.allocations.lock().unwrap().push(ptr);
        Ok(SymmetricBuffer {
            runtime: self.clone(),
            ptr,
            len,
            _element: PhantomData,
        })
    }

    /// Allocates and zeroes on every PE, then barriers, so no peer can signal into the buffer
    /// before every PE has zeroed its copy (collective; returns after the barrier completed).
    pub fn alloc_zeroed<T: DeviceRepr>(&self, len: usize) -> Result<SymmetricBuffer<T>> {
        let buffer = self.alloc::<T>(len)?;
        let stream = self.stream();
        // SAFETY: the range is this PE's allocation, just made; no peer writes to it before the
        // barrier below, which is ordered after the memset on the same stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                buffer.ptr,
                0,
                len * std::mem::size_of::<T>(),
                stream.cu_stream(),
            )
        }
        .cuda_call("cuMemsetD8Async")?;
        self.barrier_on_stream(stream)?;
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        Ok(buffer)
    }

    /// Frees a buffer on every PE (collective; every PE frees the same buffers in the same order).
    pub fn free<T>(&self, buffer: SymmetricBuffer<T>) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .cuda_call("cuCtxSetCurrent")?;
        self.stream()
            .synchronize()
            .cuda_call("cuStreamSynchronize")?;
        let mut allocations = self.inner.allocations.lock().unwrap();
        let index = allocations
            .iter()
            .rposition(|&p| p == buffer.ptr)
            .ok_or_else(|| Error::State("this buffer was already freed".into()))?;
        allocations.remove(index);
        // SAFETY: a pointer nvshmem_malloc returned (it was in `allocations`); the buffer is
        // consumed, and the runtime's stream synchronised above (work on other streams is the
        // caller's to finish first, as the type's docs say); freeing is collective by this fn's
        // contract.
        unsafe { self.inner.nvshmem.free(buffer.ptr) };
        Ok(())
    }
}

impl<T> DeviceSlice<T> for SymmetricBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.runtime.inner.stream
    }
}

impl<T> DevicePtr<T> for SymmetricBuffer<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        // Ordering across streams is the caller's (event tracking is off for this context).
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for SymmetricBuffer<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}
