//! Compute operations on caller streams, with validated arguments and launch plans.
//!
//! * [`scalar_decay::ScalarDecayForward`]: the chunkwise forward of scalar-decay linear attention
//!   (simple GLA / RetNet / Lightning) on one GPU.
//! * [`scalar_decay::ScalarDecayBackward`]: its backward (dq, dk, dv, dg, dh0) on one GPU.
//! * [`scalar_decay::lasp2::Lasp2Forward`] and [`scalar_decay::lasp2::Lasp2Backward`]: both
//!   across GPUs (LASP-2), on the family-generic exchange of [`crate::exchange`].
//! * [`gla`], [`gated_delta`]: GLA and Gated DeltaNet, forward and backward, on one GPU and
//!   across GPUs; [`mlstm::MlstmForward`], [`mlstm::MlstmBackward`] and
//!   [`mlstm::MlstmLasp2Forward`], [`mlstm::MlstmLasp2Backward`]: the mLSTM forward and backward
//!   on one GPU and across GPUs.
//! * [`short_conv::ShortConv`]: the short causal convolution before the attention, on LASP-2
//!   shards with the halo exchanged from the device, forward and backward.
//! * [`documents::DocumentStarts`]: packed documents (`cu_seqlens`) for scalar decay and Gated
//!   DeltaNet, on one GPU and across GPUs, through the gates those operations take.
//!
//! Tensors are passed as [`DeviceRef`] (read) and [`DeviceMut`] (written) views: a device address,
//! an element count and a borrow of the buffer they came from, so the borrow checker keeps an
//! output from aliasing anything else the call reads. Build them from cudarc buffers
//! ([`DeviceRef::new`], [`DeviceMut::new`]) or, behind `unsafe`, from raw device pointers (a C
//! ABI, a PyTorch tensor's `data_ptr()`).
//!
//! Ordering: an operation enqueues its kernels on the stream it is given. A view made from a
//! cudarc buffer remembers the buffer's own stream (where cudarc frees it, stream-ordered, when
//! it is dropped); where that differs from the call's stream, the call makes its stream wait for
//! the buffer's (the buffer is ready) and the buffer's stream wait for the call's work (a drop
//! right after the call frees it only after the kernels that use it). That is cudarc's event
//! tracking, which the runtime turns off, done once per call and only across streams: a call
//! whose buffers live on its own stream records no event. Under CUDA graph capture every such
//! buffer must live on the capturing stream. Views made from raw addresses (the C ABI, a
//! PyTorch tensor) carry no stream: ordering them is the caller's contract
//! ([`DeviceRef::from_raw`]).

use crate::error::{Error, Result};
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::marker::PhantomData;
use std::sync::Arc;

pub mod documents;
pub mod gated_delta;
pub mod gla;
pub mod mlstm;
pub mod scalar_decay;
pub mod short_conv;

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
/// from the buffer it came from for `'a`, and that buffer's stream.
#[derive(Debug)]
pub struct DeviceRef<'a, T> {
    addr: u64,
    len: usize,
    home: Option<&'a Arc<CudaStream>>,
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
            home: Some(buf.stream()),
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
            home: None,
            _borrow: PhantomData,
        }
    }

    /// The stream of the buffer the view was made from (none for a raw view).
    pub(crate) fn home(&self) -> Option<&'a Arc<CudaStream>> {
        self.home
    }

    /// The first `mid` elements and the rest, as two views of the same buffer.
    ///
    /// # Panics
    /// If `mid > self.len()`.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        assert!(
            mid <= self.len,
            "split_at({mid}) of a view of {} elements",
            self.len
        );
        let rest = DeviceRef {
            addr: self.addr + (mid * std::mem::size_of::<T>()) as u64,
            len: self.len - mid,
            ..self
        };
        (DeviceRef { len: mid, ..self }, rest)
    }

    view_accessors!();
}

/// A device tensor an operation writes: its base address and length in elements of `T`,
/// borrowed mutably from the buffer it came from for `'a`.
#[derive(Debug)]
pub struct DeviceMut<'a, T> {
    addr: u64,
    len: usize,
    home: Option<&'a Arc<CudaStream>>,
    _borrow: PhantomData<&'a mut [T]>,
}

impl<'a, T> DeviceMut<'a, T> {
    /// A view of a whole `CudaSlice` or `CudaViewMut`.
    pub fn new<S: DevicePtrMut<T>>(buf: &'a mut S) -> Self {
        let stream = buf.stream().clone();
        let len = buf.len();
        // The guard records nothing (tracking is off); it ends its borrow of `buf` here.
        let addr = buf.device_ptr_mut(&stream).0;
        // The exclusive borrow stays with the view (nothing else can reach the buffer for 'a);
        // through it, the view keeps the buffer's stream.
        let buf: &'a S = buf;
        DeviceMut {
            addr,
            len,
            home: Some(buf.stream()),
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
            home: None,
            _borrow: PhantomData,
        }
    }

    /// The stream of the buffer the view was made from (none for a raw view).
    pub(crate) fn home(&self) -> Option<&'a Arc<CudaStream>> {
        self.home
    }

    /// A view that reads what this one writes, for as long as it borrows this one.
    pub fn reader(&self) -> DeviceRef<'_, T> {
        DeviceRef {
            addr: self.addr,
            len: self.len,
            home: self.home,
            _borrow: PhantomData,
        }
    }

    /// The first `mid` elements and the rest, as two disjoint views that write the same buffer.
    ///
    /// # Panics
    /// If `mid > self.len()`.
    pub fn split_at(self, mid: usize) -> (Self, Self) {
        assert!(
            mid <= self.len,
            "split_at({mid}) of a view of {} elements",
            self.len
        );
        let rest = DeviceMut {
            addr: self.addr + (mid * std::mem::size_of::<T>()) as u64,
            len: self.len - mid,
            home: self.home,
            _borrow: PhantomData,
        };
        (DeviceMut { len: mid, ..self }, rest)
    }

    view_accessors!();
}

/// Orders the streams of one call's buffers around its work on the call's stream (see the module
/// documentation): [`StreamOrder::around`] the call's launches.
pub(crate) struct StreamOrder {
    stream: Arc<CudaStream>,
    homes: Vec<Arc<CudaStream>>,
}

impl StreamOrder {
    /// Runs `enqueue` (the call's launches on `stream`) between [`StreamOrder::enter`] and
    /// [`StreamOrder::exit`]; the exit runs also when `enqueue` failed, since what it enqueued
    /// before failing still uses the buffers.
    pub(crate) fn around<'a, T>(
        stream: &Arc<CudaStream>,
        homes: impl IntoIterator<Item = Option<&'a Arc<CudaStream>>>,
        op: &str,
        enqueue: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let order = Self::enter(stream, homes, op)?;
        let enqueued = enqueue();
        order.exit()?;
        enqueued
    }

    /// Makes `stream` wait for every buffer stream in `homes` that is not `stream` itself.
    /// Refused, naming `op`, while `stream` is captured and a buffer lives on another stream.
    fn enter<'a>(
        stream: &Arc<CudaStream>,
        homes: impl IntoIterator<Item = Option<&'a Arc<CudaStream>>>,
        op: &str,
    ) -> Result<Self> {
        let mut others: Vec<Arc<CudaStream>> = Vec::new();
        for home in homes.into_iter().flatten() {
            let same = |s: &Arc<CudaStream>| s.cu_stream() == home.cu_stream();
            if !same(stream) && !others.iter().any(same) {
                others.push(home.clone());
            }
        }
        if !others.is_empty() {
            if stream.capture_status()? != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
                return Err(Error::InvalidArgument(format!(
                    "{op}: a buffer lives on another stream than the one being captured; a \
                     captured call cannot order other streams, so allocate the buffers on the \
                     capturing stream (or make the call outside the capture)"
                )));
            }
            for home in &others {
                stream.join(home)?;
            }
        }
        Ok(StreamOrder {
            stream: stream.clone(),
            homes: others,
        })
    }

    /// Makes every buffer stream wait for what the call enqueued on its stream.
    fn exit(self) -> Result<()> {
        if self.homes.is_empty() {
            return Ok(());
        }
        let done = self.stream.record_event(None)?;
        for home in &self.homes {
            home.wait(&done)?;
        }
        Ok(())
    }
}

/// An error (naming `op`) for a forced segment count of 0.
pub(crate) fn check_forced_segments(segments: Option<u32>, op: &str) -> Result<()> {
    if segments == Some(0) {
        return Err(Error::InvalidArgument(format!(
            "{op}: a forced segment count must be at least 1 (use None for the automatic plan)"
        )));
    }
    Ok(())
}

/// What a plan's segment summaries serve (the families that cut a sequence into segments joined
/// by a fold: Gated DeltaNet, mLSTM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The whole sequence on one GPU: the summaries of segments 0..S-2 give the states entering
    /// segments 1..S-1 (no kernel needs the last one's); no fold when S == 1 (segment 0 starts from
    /// the initial state).
    SingleGpu,
    /// A LASP-2 shard: every segment's summary (the shard's, which crosses GPUs, is made of them),
    /// and the fold always runs (segment 0 starts from the state the exchange gives).
    Shard,
}

/// Cuts `chunks` chunks into segments of whole chunks: `force` segments, else `auto`, clamped to
/// [1, chunks] and rounded so that none is empty. Returns (segments, chunks per segment); an
/// error (naming `op`) past `max`, the kernels' grid limit.
pub(crate) fn split_into_segments(
    chunks: usize,
    force: Option<u32>,
    auto: usize,
    max: usize,
    op: &str,
) -> Result<(usize, usize)> {
    check_forced_segments(force, op)?;
    let want = force.map_or(auto, |s| s as usize).clamp(1, chunks);
    let per_segment = chunks.div_ceil(want);
    let segments = chunks.div_ceil(per_segment);
    if segments > max {
        return Err(Error::InvalidArgument(format!(
            "{op}: {segments} segments per sequence exceed {max} (the kernels' grid limit); \
             force fewer segments"
        )));
    }
    Ok((segments, per_segment))
}

/// The values of `view` on the host: an ordered copy on `stream`, which is synchronised (the
/// operations' gate checks and the documents' offset checks, which read what the kernels will
/// read).
pub(crate) fn copy_to_host<T: Copy + Default>(
    ctx: &CudaContext,
    stream: &Arc<CudaStream>,
    view: DeviceRef<'_, T>,
) -> Result<Vec<T>> {
    let mut host = vec![T::default(); view.len()];
    ctx.bind_to_thread()?;
    // SAFETY: the view is a live device allocation of at least view.len() T (DeviceRef's
    // contract); the copy completes before `host` is read (stream synchronised below).
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(&mut host, view.addr(), stream.cu_stream())
    }?;
    stream.synchronize()?;
    Ok(host)
}

/// The GPU's streaming multiprocessors (at least 1): what launch plans aim their CTA counts at.
pub(crate) fn sm_count(ctx: &CudaContext) -> Result<u32> {
    Ok(ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?
        .max(1) as u32)
}

/// An error (naming `op`) where this GPU cannot give a block `need` bytes of shared memory, the
/// most any of the operation's kernels launches with.
pub(crate) fn require_shared_memory(
    runtime: &crate::runtime::Runtime,
    op: &str,
    need: u32,
) -> Result<()> {
    let ctx = runtime.context();
    ctx.bind_to_thread()?;
    let optin = ctx
        .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as u32;
    if optin < need {
        return Err(Error::Launch(format!(
            "{op}: the kernels need {need} bytes of shared memory per block but this GPU ({}) \
             allows {optin}; run on an H100/H200 (sm_90)",
            ctx.name().unwrap_or_default()
        )));
    }
    Ok(())
}

/// An error naming `op` unless `stream` belongs to `ctx`, the runtime's context, where the op's
/// kernels and workspace live.
pub(crate) fn require_runtime_stream(
    stream: &CudaStream,
    ctx: &Arc<CudaContext>,
    op: &str,
) -> Result<()> {
    if Arc::ptr_eq(stream.context(), ctx) {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{op}: the stream belongs to another CUDA context; launch on a stream of the runtime's GPU \
         (runtime.stream() or runtime.context().new_stream())"
    )))
}

/// Alignment of every part of an operation's workspace ([`ensure_workspace`]): each part starts
/// on a multiple of this many bytes from the allocation's start.
pub(crate) const WORKSPACE_PART_ALIGN: u64 = 256;

/// Makes `workspace` hold at least `bytes` bytes (`op` names the operation in errors) and
/// returns its device address (0 while none was ever needed). Growing it waits for the whole
/// context first (earlier calls, on any stream, may still use the old one) and for `stream` after
/// the allocation (so the new one is usable from any stream). Neither can be captured into a
/// CUDA graph, so growing is refused, saying what to do, while `stream` is being captured.
pub(crate) fn ensure_workspace(
    ctx: &CudaContext,
    stream: &Arc<CudaStream>,
    workspace: &mut Option<CudaSlice<u8>>,
    bytes: u64,
    op: &str,
) -> Result<u64> {
    // The runtime turns cudarc's event tracking off, so the address comes without a guard.
    let address = |w: &Option<CudaSlice<u8>>| w.as_ref().map_or(0, |w| w.device_ptr(stream).0);
    if bytes <= workspace.as_ref().map_or(0, |w| w.len() as u64) {
        return Ok(address(workspace));
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
    Ok(address(workspace))
}

/// Enqueues on `stream` a copy of `src` into `dst`, or zeros into `dst` where `src` is `None`;
/// `dst.len()` elements either way (the caller checked that `src` has as many).
pub(crate) fn copy_or_zero(
    stream: &CudaStream,
    src: Option<DeviceRef<'_, f32>>,
    dst: &DeviceMut<'_, f32>,
) -> Result<()> {
    let bytes = dst.len() * std::mem::size_of::<f32>();
    // SAFETY: the views' contracts keep both allocations live, of this context, with at least
    // `dst.len()` elements, until the work enqueued on their streams completes; the caller
    // orders `stream` after their buffers' streams (StreamOrder).
    unsafe {
        match src {
            Some(src) => cudarc::driver::result::memcpy_dtod_async(
                dst.addr(),
                src.addr(),
                bytes,
                stream.cu_stream(),
            ),
            None => {
                cudarc::driver::result::memset_d8_async(dst.addr(), 0, bytes, stream.cu_stream())
            }
        }
    }?;
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
        // SAFETY: as above.
        let m = unsafe { DeviceMut::<bf16>::from_raw(512, 10) };
        assert_eq!(m.byte_range(), (512, 532));
    }

    #[test]
    fn a_view_splits_into_two_that_cover_it() {
        // SAFETY: views of fake addresses are only measured, never launched.
        let v = unsafe { DeviceRef::<f32>::from_raw(256, 10) };
        let (head, tail) = v.split_at(4);
        assert_eq!(
            (head.byte_range(), tail.byte_range()),
            ((256, 272), (272, 296))
        );
        // SAFETY: as above.
        let m = unsafe { DeviceMut::<bf16>::from_raw(512, 10) };
        assert_eq!(m.reader().byte_range(), (512, 532));
        let (head, tail) = m.split_at(10);
        assert_eq!((head.len(), tail.len(), tail.addr()), (10, 0, 532));
        let result = std::panic::catch_unwind(|| {
            // SAFETY: as above.
            unsafe { DeviceRef::<f32>::from_raw(0, 3) }.split_at(4)
        });
        assert!(result.is_err(), "a split past the end panics");
    }
}
