//! Device-initiated exchange: an all-gather whose puts and signals are issued by the kernel's own
//! warps, and a device ping-pong. Kernels in kernels/cuda/exchange/transport.cu; parameter structs from
//! kernels/cuda/include/lasp/exchange/transport_params.h (`lasp_shmem_kernels::params`).

use crate::diagnostics::WaitDiagnostics;
use crate::error::{CudaCall, Error, Result};
use crate::gpu::ContextSync;
use crate::kernel::{Kernel, LaunchShape};
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lasp_shmem_kernels::params as header;
use std::sync::Arc;

type AllGatherParams = header::lasp_allgather_params;
type PatternParams = header::lasp_allgather_pattern_params;
type PingPongParams = header::lasp_pingpong_params;

/// Words of `lasp_allgather_params::counters` for `npes` PEs (`LASP_ALLGATHER_COUNTERS`): the
/// launch-wide counters, then one per peer group.
fn counter_words(npes: usize) -> usize {
    header::LASP_COUNTER_PEER_GROUP as usize + npes
}

/// Threads per CTA unless [`AllGather::set_threads`] says otherwise (the best of the CTA sweeps
/// on the 4x H200 node).
const ALLGATHER_THREADS: u32 = 512;
/// The kernels are compiled with `__launch_bounds__(1024)`.
const MAX_THREADS: u32 = 1024;
/// Every CTA of a round must be resident at once (the last one waits for the others' puts): one
/// CTA of up to 1024 threads fits per SM, and Hopper parts have at least 114 SMs.
const MAX_CTAS: u32 = 112;

/// How a round's puts are spread over CTAs and who signals the peers. Every variant runs the same
/// protocol (epochs, parity slots) through NVSHMEM's put / signal API; the kernels in
/// kernels/cuda/exchange/transport.cu describe each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllGatherVariant {
    /// Each CTA moves its slice to every peer in turn; the last CTA signals all peers.
    CtaLoop,
    /// A fixed group of CTAs per peer; the last CTA of a group signals that peer at once.
    PeerMajor,
    /// Chunks handed out from a counter, so fast CTAs take more and the round ends evenly.
    Dynamic,
}

impl AllGatherVariant {
    /// The variant a new [`AllGather`] uses: on the 4x H200 node (measured with
    /// scripts/exchange-sweep.sh) dynamic was the only one at >= 300 GB/s egress at 8 MiB per
    /// rank with 64 CTAs (303.5 and 304.1 GB/s in two runs; 299.7-308.8 with 16-128 KiB items;
    /// cta-loop 291.2-295.1), and within 3 % of cta-loop at 1 and 4 MiB.
    pub const DEFAULT: AllGatherVariant = AllGatherVariant::Dynamic;

    /// Every variant, the default first.
    pub const ALL: [AllGatherVariant; 3] = [
        AllGatherVariant::Dynamic,
        AllGatherVariant::CtaLoop,
        AllGatherVariant::PeerMajor,
    ];

    /// The name programs accept and print.
    pub fn name(self) -> &'static str {
        match self {
            AllGatherVariant::CtaLoop => "cta-loop",
            AllGatherVariant::PeerMajor => "peer-major",
            AllGatherVariant::Dynamic => "dynamic",
        }
    }

    /// The variant called `name` (see [`AllGatherVariant::name`]).
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == name)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown all-gather variant {name:?}; use one of {}",
                    Self::ALL.map(|v| v.name()).join(", ")
                ))
            })
    }

    fn kernel_name(self) -> &'static str {
        match self {
            AllGatherVariant::CtaLoop => "lasp_allgather",
            AllGatherVariant::PeerMajor => "lasp_allgather_peer_major",
            AllGatherVariant::Dynamic => "lasp_allgather_dynamic",
        }
    }

    /// CTAs actually launched for `planned`: peer-major needs whole groups, one per peer, so it
    /// rounds down to a multiple of npes - 1 (at least one group each).
    fn launch_ctas(self, planned: u32, npes: usize) -> u32 {
        let peers = npes.saturating_sub(1).max(1) as u32;
        match self {
            AllGatherVariant::PeerMajor => (planned / peers).max(1) * peers,
            _ => planned,
        }
    }
}

/// CTAs for an all-gather of `bytes` per PE: one per 16 KiB, at least 4 and at most 64. On the
/// 4x H200 reference node 64 CTAs were best or within 2% of best from 1 MiB to 32 MiB
/// (scripts/exchange-sweep.sh's CTA sweep).
pub fn allgather_ctas(bytes: usize) -> u32 {
    (bytes.div_ceil(16 << 10)).clamp(4, 64) as u32
}

/// Bytes per work item of the dynamic variant: 16 KiB (one pass of a 512-thread CTA's 16-byte
/// copies), larger only where a round would otherwise overflow the kernel's 32-bit claim counter.
/// Small items end a round more evenly: on the 4x H200 node 16 KiB against the earlier "about 8
/// items per CTA" (32, 48 and 192 KiB at 4, 8 and 32 MiB per rank) took 45.8 / 46.2 us at 4 MiB
/// and 80.8 / 82.4 us at 8 MiB, and 291.7 / 303.1 us at 32 MiB in another job.
pub fn allgather_chunk_bytes(bytes: usize, npes: usize) -> usize {
    const GRAIN: usize = 16 << 10;
    let items_per_peer = MAX_WORK_ITEMS / npes.saturating_sub(1).max(1);
    bytes.div_ceil(items_per_peer).div_ceil(GRAIN).max(1) * GRAIN
}

/// Work items of one dynamic round: (npes - 1) peers times the chunks of a PE's bytes.
fn dynamic_work_items(bytes: usize, npes: usize, chunk_bytes: usize) -> usize {
    npes.saturating_sub(1) * bytes.div_ceil(chunk_bytes)
}

/// The dynamic kernel claims items with a 32-bit counter that also counts each CTA's one claim
/// past the end: keep rounds well inside it.
const MAX_WORK_ITEMS: usize = 1 << 30;

fn device_addr<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    slice.device_ptr(stream).0
}

/// A device-initiated, in-place all-gather of `bytes` per PE: after a round, slot `[e % 2][s]`
/// of every PE holds PE `s`'s source, except a PE's own slot (its data stays in its source). 64-bit
/// epoch signals and double-buffered slots (see exchange/transport_params.h for the protocol).
///
/// Each [`AllGather::launch`] is one round, enqueued on a stream with no host synchronisation;
/// rounds on one stream may follow each other back to back, or be captured in a CUDA graph.
///
/// End with [`AllGather::finish`] on the stream of the last round, then [`AllGather::free`]
/// (collective). Dropping it instead waits for the rounds in flight and leaks the symmetric
/// buffers (freeing them is collective).
pub struct AllGather {
    runtime: Runtime,
    bytes: usize,
    src: SymmetricBuffer<u8>,
    slots: SymmetricBuffer<u8>,
    data_signal: SymmetricBuffer<u64>,
    /// Before the round words: every round finishes before they are freed (they are used on the
    /// caller's stream).
    _rounds_done: ContextSync,
    epoch: CudaSlice<u64>,
    counters: CudaSlice<u32>,
    diag: CudaSlice<WaitDiagnostics>,
    mismatches: CudaSlice<u64>,
    variant: AllGatherVariant,
    round: Kernel,
    floor: Kernel,
    fill: Kernel,
    check: Kernel,
    ctas: u32,
    threads: u32,
    /// Set by [`AllGather::set_chunk_bytes`]; otherwise [`allgather_chunk_bytes`].
    chunk_bytes: Option<usize>,
}

impl AllGather {
    /// Symmetric bytes one all-gather of `bytes` per PE needs on each PE.
    pub fn symmetric_bytes(bytes: usize, npes: usize) -> usize {
        bytes * (1 + 2 * npes) + 8 * 2 * npes + 4096
    }

    /// Allocates the buffers (collective). `bytes` must be a positive multiple of 16.
    pub fn new(runtime: &Runtime, bytes: usize) -> Result<Self> {
        if bytes == 0 || bytes % 16 != 0 {
            return Err(Error::InvalidArgument(format!(
                "all-gather size {bytes} must be a positive multiple of 16 bytes (pad the buffer)"
            )));
        }
        let npes = runtime.npes();
        let stream = runtime.stream();
        let module = runtime.module();
        let gather = AllGather {
            runtime: runtime.clone(),
            bytes,
            src: runtime.alloc(bytes)?,
            slots: runtime.alloc(2 * npes * bytes)?,
            data_signal: runtime.alloc_zeroed(2 * npes)?,
            _rounds_done: ContextSync(runtime.context().clone()),
            epoch: stream.alloc_zeros(1).cuda_call("cuMemAllocAsync")?,
            counters: stream
                .alloc_zeros(counter_words(npes))
                .cuda_call("cuMemAllocAsync")?,
            diag: stream.alloc_zeros(1).cuda_call("cuMemAllocAsync")?,
            mismatches: stream.alloc_zeros(1).cuda_call("cuMemAllocAsync")?,
            variant: AllGatherVariant::DEFAULT,
            round: module.kernel(AllGatherVariant::DEFAULT.kernel_name())?,
            floor: module.kernel("lasp_allgather_floor")?,
            fill: module.kernel("lasp_allgather_fill")?,
            check: module.kernel("lasp_allgather_check")?,
            ctas: allgather_ctas(bytes),
            threads: ALLGATHER_THREADS,
            chunk_bytes: None,
        };
        // The device buffers are zeroed on the runtime's stream and used on the caller's: their
        // allocation must be complete first (event tracking is off, see gpu::open_gpu).
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        Ok(gather)
    }

    /// Bytes each PE contributes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// This PE's contribution (write it before [`AllGather::launch`]).
    pub fn source_mut(&mut self) -> &mut SymmetricBuffer<u8> {
        &mut self.src
    }

    /// All PEs' slots: `[2 parities][npes][bytes]`; epoch e lands in parity e % 2.
    pub fn slots(&self) -> &SymmetricBuffer<u8> {
        &self.slots
    }

    /// Overrides the planned number of CTAs (for benchmarks that sweep it).
    pub fn set_ctas(&mut self, ctas: u32) -> Result<()> {
        if ctas == 0 || ctas > MAX_CTAS {
            return Err(Error::InvalidArgument(format!(
                "{ctas} CTAs: use 1 to {MAX_CTAS} so every CTA is resident at once"
            )));
        }
        self.ctas = ctas;
        Ok(())
    }

    /// Chooses how rounds spread their puts (every PE must choose the same before its next
    /// round; the default is [`AllGatherVariant::DEFAULT`]).
    pub fn set_variant(&mut self, variant: AllGatherVariant) -> Result<()> {
        self.round = self.runtime.module().kernel(variant.kernel_name())?;
        self.variant = variant;
        Ok(())
    }

    /// The variant rounds use.
    pub fn variant(&self) -> AllGatherVariant {
        self.variant
    }

    /// Overrides the threads per CTA (a multiple of 32 up to 1024; default 512).
    pub fn set_threads(&mut self, threads: u32) -> Result<()> {
        if threads == 0 || threads % 32 != 0 || threads > MAX_THREADS {
            return Err(Error::InvalidArgument(format!(
                "{threads} threads per CTA: use a multiple of 32 up to {MAX_THREADS}"
            )));
        }
        self.threads = threads;
        Ok(())
    }

    /// Overrides the dynamic variant's work-item size (a positive multiple of 16 bytes).
    pub fn set_chunk_bytes(&mut self, chunk_bytes: usize) -> Result<()> {
        if chunk_bytes == 0 || chunk_bytes % 16 != 0 {
            return Err(Error::InvalidArgument(format!(
                "chunk of {chunk_bytes} bytes: use a positive multiple of 16"
            )));
        }
        if dynamic_work_items(self.bytes, self.runtime.npes(), chunk_bytes) > MAX_WORK_ITEMS {
            return Err(Error::InvalidArgument(format!(
                "chunk of {chunk_bytes} bytes: too many work items for {} bytes per PE",
                self.bytes
            )));
        }
        self.chunk_bytes = Some(chunk_bytes);
        Ok(())
    }

    /// The dynamic variant's work-item size in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
            .unwrap_or_else(|| allgather_chunk_bytes(self.bytes, self.runtime.npes()))
    }

    /// The launch shape of a round: (CTAs, threads per CTA).
    pub fn launch_shape(&self) -> (u32, u32) {
        (
            self.variant.launch_ctas(self.ctas, self.runtime.npes()),
            self.threads,
        )
    }

    /// Enqueues one round on `stream`.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.launch_kernel(&self.round, stream)
    }

    /// Enqueues a kernel of a round's shape and parameters that does nothing: timed like a round,
    /// it measures the harness's and the launch's own cost. Moves no data and no epoch.
    pub fn launch_floor(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.launch_kernel(&self.floor, stream)
    }

    fn launch_kernel(&self, kernel: &Kernel, stream: &Arc<CudaStream>) -> Result<()> {
        let params = AllGatherParams {
            src: self.src.raw() as _,
            slots: self.slots.raw() as _,
            data_signal: self.data_signal.raw() as _,
            epoch: device_addr(&self.epoch, stream) as _,
            counters: device_addr(&self.counters, stream) as _,
            diag: device_addr(&self.diag, stream) as _,
            bytes: self.bytes as u64,
            chunk_bytes: self.chunk_bytes() as u64,
            timeout_ns: self.runtime.wait_timeout().as_nanos() as u64,
            me: self.runtime.pe() as i32,
            npes: self.runtime.npes() as i32,
        };
        let (ctas, threads) = self.launch_shape();
        let shape = LaunchShape {
            grid: (ctas, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: the parameters are lasp_allgather_params, generated from the header, and point
        // into buffers owned by self. They outlive the kernel as long as the caller
        // keeps its documented obligation: `finish` (or `free`, which synchronises the device)
        // before dropping self. The types do not enforce it (see gpu::open_gpu).
        unsafe { kernel.launch(stream, shape, &params) }
    }

    fn pattern_params(&mut self, stream: &Arc<CudaStream>) -> PatternParams {
        PatternParams {
            src: self.src.raw() as _,
            slots: self.slots.raw() as _,
            epoch: device_addr(&self.epoch, stream) as _,
            mismatches: device_addr(&self.mismatches, stream) as _,
            bytes: self.bytes as u64,
            me: self.runtime.pe() as i32,
            npes: self.runtime.npes() as i32,
        }
    }

    /// Writes this PE's patterned contribution for the next round: every word a function of
    /// (PE, epoch, index).
    pub fn fill_pattern(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let params = self.pattern_params(stream);
        let shape = LaunchShape {
            grid: (132, 1, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: lasp_allgather_pattern_params, generated from the header; pointers into buffers
        // owned by self, which outlive the kernel under the same obligation as `launch`.
        unsafe { self.fill.launch(stream, shape, &params) }
    }

    /// Compares every PE's slot of the last completed round with the pattern its source wrote,
    /// adding mismatching words to a counter read by [`AllGather::mismatches`].
    pub fn check_pattern(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let params = self.pattern_params(stream);
        let shape = LaunchShape {
            grid: (132, 1, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: as in fill_pattern.
        unsafe { self.check.launch(stream, shape, &params) }
    }

    /// Waits for `stream`, then returns the error of the first expired wait, if any.
    pub fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        read_diagnostics(stream, &self.diag)
    }

    /// The last completed epoch (synchronises `stream`).
    pub fn epoch(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream
            .clone_dtoh(&self.epoch)
            .cuda_call("cuMemcpyDtoHAsync")?[0])
    }

    /// Mismatching words counted by [`AllGather::check_pattern`] so far (synchronises `stream`).
    pub fn mismatches(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream
            .clone_dtoh(&self.mismatches)
            .cuda_call("cuMemcpyDtoHAsync")?[0])
    }

    /// Frees the buffers (collective). Waits for the whole device first, so rounds still in
    /// flight on any stream finish before their memory goes.
    pub fn free(self) -> Result<()> {
        let rt = self.runtime.clone();
        rt.context().synchronize().cuda_call("cuCtxSynchronize")?;
        rt.free(self.data_signal)?;
        rt.free(self.slots)?;
        rt.free(self.src)
    }
}

/// Device ping-pong between PE 0 and PE 1: the round-trip latency of a signal.
pub struct PingPong {
    runtime: Runtime,
    flags: SymmetricBuffer<u64>,
    /// Before the round words (see [`AllGather`]'s).
    _rounds_done: ContextSync,
    round: CudaSlice<u64>,
    diag: CudaSlice<WaitDiagnostics>,
    kernel: Kernel,
}

impl PingPong {
    /// Allocates the flags (collective; needs at least 2 PEs).
    pub fn new(runtime: &Runtime) -> Result<Self> {
        if runtime.npes() < 2 {
            return Err(Error::InvalidArgument(
                "ping-pong needs at least 2 PEs".into(),
            ));
        }
        let stream = runtime.stream();
        let pingpong = PingPong {
            runtime: runtime.clone(),
            flags: runtime.alloc_zeroed(2)?,
            _rounds_done: ContextSync(runtime.context().clone()),
            round: stream.alloc_zeros(1).cuda_call("cuMemAllocAsync")?,
            diag: stream.alloc_zeros(1).cuda_call("cuMemAllocAsync")?,
            kernel: runtime.module().kernel("lasp_pingpong")?,
        };
        // Zeroed on the runtime's stream, used on the caller's: complete the allocation first.
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        Ok(pingpong)
    }

    /// Enqueues `rounds` round trips on `stream` (PEs other than 0 and 1 enqueue nothing).
    pub fn launch(&self, stream: &Arc<CudaStream>, rounds: u32) -> Result<()> {
        let me = self.runtime.pe();
        if me > 1 {
            return Ok(());
        }
        let params = PingPongParams {
            flags: self.flags.raw() as _,
            round: device_addr(&self.round, stream) as _,
            diag: device_addr(&self.diag, stream) as _,
            timeout_ns: self.runtime.wait_timeout().as_nanos() as u64,
            me: me as i32,
            peer: 1 - me as i32,
            initiator: (me == 0) as i32,
            rounds: rounds as i32,
        };
        let shape = LaunchShape {
            grid: (1, 1, 1),
            block: (32, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: lasp_pingpong_params, generated from the header; pointers into buffers owned by
        // self, which outlive the kernel as long as the caller calls `finish` or `free` before
        // dropping self.
        unsafe { self.kernel.launch(stream, shape, &params) }
    }

    /// Waits for `stream`, then returns the error of an expired wait, if any.
    pub fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        read_diagnostics(stream, &self.diag)
    }

    /// Frees the buffers (collective). Waits for the whole device first, so round trips still
    /// in flight on any stream finish before their memory goes.
    pub fn free(self) -> Result<()> {
        self.runtime
            .context()
            .synchronize()
            .cuda_call("cuCtxSynchronize")?;
        self.runtime.free(self.flags)
    }
}

/// The wait record in `diag`, read after `stream` (synchronises it), as a result.
fn read_diagnostics(stream: &Arc<CudaStream>, diag: &CudaSlice<WaitDiagnostics>) -> Result<()> {
    stream.clone_dtoh(diag).cuda_call("cuMemcpyDtoHAsync")?[0].into_result()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cta_plan_grows_with_size_and_stays_resident() {
        assert_eq!(allgather_ctas(32 << 10), 4);
        assert_eq!(allgather_ctas(256 << 10), 16);
        assert_eq!(allgather_ctas(8 << 20), 64);
    }

    #[test]
    fn variants_round_trip_by_name_and_reject_others() {
        for v in AllGatherVariant::ALL {
            assert_eq!(AllGatherVariant::from_name(v.name()).unwrap(), v);
        }
        let err = AllGatherVariant::from_name("ring").unwrap_err().to_string();
        assert!(err.contains("dynamic, cta-loop, peer-major"), "{err}");
    }

    #[test]
    fn peer_major_launches_whole_peer_groups() {
        let v = AllGatherVariant::PeerMajor;
        assert_eq!(v.launch_ctas(64, 4), 63);
        assert_eq!(v.launch_ctas(112, 4), 111);
        assert_eq!(v.launch_ctas(2, 4), 3); // one CTA per peer at least
        assert_eq!(v.launch_ctas(64, 2), 64);
        assert_eq!(v.launch_ctas(4, 1), 4); // a single PE: no peers to group by
        assert_eq!(AllGatherVariant::CtaLoop.launch_ctas(64, 4), 64);
        assert_eq!(AllGatherVariant::Dynamic.launch_ctas(64, 4), 64);
    }

    #[test]
    fn dynamic_chunks_are_16k_unless_the_claim_counter_needs_more() {
        assert_eq!(allgather_chunk_bytes(8 << 20, 4), 16 << 10);
        assert_eq!(allgather_chunk_bytes(32 << 10, 4), 16 << 10);
        // A single PE still gets a valid chunk.
        assert_eq!(allgather_chunk_bytes(32 << 10, 1), 16 << 10);
        // Even a 4 GiB round stays far inside the kernel's 32-bit claim counter at 16 KiB.
        assert_eq!(allgather_chunk_bytes(4 << 30, 4), 16 << 10);
        assert_eq!(dynamic_work_items(4 << 30, 4, 16 << 10), 3 << 18);
        // Past 2^30 items the chunk grows, in 16 KiB steps, to keep the count inside the limit.
        let huge = 1usize << 46;
        let chunk = allgather_chunk_bytes(huge, 4);
        assert!(chunk > 16 << 10 && chunk % (16 << 10) == 0);
        assert!(dynamic_work_items(huge, 4, chunk) <= MAX_WORK_ITEMS);
        assert!(dynamic_work_items(16 << 30, 4, 16) > MAX_WORK_ITEMS);
        assert_eq!(dynamic_work_items(1 << 20, 1, 16 << 10), 0);
    }

    #[test]
    fn counters_are_three_launch_wide_words_then_one_per_peer_group() {
        assert_eq!(counter_words(4), 7);
    }
}
