//! Device-initiated exchange: an all-gather whose puts and signals are issued by the kernel's own
//! warps, and a device ping-pong. Kernels in kernels/cuda/exchange.cu; parameter structs mirror
//! kernels/cuda/include/lasp/exchange_params.h.

use crate::diagnostics::WaitDiagnostics;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, LaunchShape};
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

#[repr(C)]
#[derive(Clone, Copy)]
struct AllGatherParams {
    src: u64,
    slots: u64,
    data_signal: u64,
    credit: u64,
    epoch: u64,
    arrived: u64,
    diag: u64,
    bytes: u64,
    timeout_ns: u64,
    me: i32,
    npes: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct PatternParams {
    src: u64,
    slots: u64,
    epoch: u64,
    mismatches: u64,
    bytes: u64,
    me: i32,
    npes: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct PingPongParams {
    flags: u64,
    round: u64,
    diag: u64,
    timeout_ns: u64,
    me: i32,
    peer: i32,
    initiator: i32,
    rounds: i32,
}

const ALLGATHER_THREADS: u32 = 512;
/// Every CTA of a round must be resident at once (the last one waits for the others' puts): one
/// 512-thread CTA fits per SM, and Hopper parts have at least 114 SMs.
const MAX_CTAS: u32 = 112;

/// CTAs for an all-gather of `bytes` per PE: one per 16 KiB, at least 4 and at most 64. On the
/// 4x H200 reference node 64 CTAs were best or within 2% of best from 1 MiB to 32 MiB
/// (benches/results/raw/2026-11-21-h200x4-exchange-sweep.txt).
pub fn allgather_ctas(bytes: usize) -> u32 {
    (bytes.div_ceil(16 << 10)).clamp(4, 64) as u32
}

fn device_addr<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    slice.device_ptr(stream).0
}

/// A device-initiated, in-place all-gather of `bytes` per PE: after a round, slot `[e % 2][s]`
/// of every PE holds PE `s`'s source, except a PE's own slot (its data stays in its source). 64-bit
/// epoch signals, double-buffered slots and credits (see exchange_params.h for the protocol).
///
/// Each [`AllGather::launch`] is one round, enqueued on a stream with no host synchronisation;
/// rounds on one stream may follow each other back to back, or be captured in a CUDA graph.
pub struct AllGather {
    runtime: Runtime,
    bytes: usize,
    src: SymmetricBuffer<u8>,
    slots: SymmetricBuffer<u8>,
    data_signal: SymmetricBuffer<u64>,
    credit: SymmetricBuffer<u64>,
    epoch: CudaSlice<u64>,
    arrived: CudaSlice<u32>,
    diag: CudaSlice<WaitDiagnostics>,
    mismatches: CudaSlice<u64>,
    round: Kernel,
    fill: Kernel,
    check: Kernel,
    ctas: u32,
}

impl AllGather {
    /// Symmetric bytes one all-gather of `bytes` per PE needs on each PE.
    pub fn symmetric_bytes(bytes: usize, npes: usize) -> usize {
        bytes * (1 + 2 * npes) + 8 * 3 * npes + 4096
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
            credit: runtime.alloc_zeroed(npes)?,
            epoch: stream.alloc_zeros(1)?,
            arrived: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
            mismatches: stream.alloc_zeros(1)?,
            round: module.kernel("lasp_allgather")?,
            fill: module.kernel("lasp_allgather_fill")?,
            check: module.kernel("lasp_allgather_check")?,
            ctas: allgather_ctas(bytes),
        };
        stream.synchronize()?;
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

    /// Enqueues one round on `stream`.
    pub fn launch(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let params = AllGatherParams {
            src: self.src.raw(),
            slots: self.slots.raw(),
            data_signal: self.data_signal.raw(),
            credit: self.credit.raw(),
            epoch: device_addr(&self.epoch, stream),
            arrived: device_addr(&self.arrived, stream),
            diag: device_addr(&self.diag, stream),
            bytes: self.bytes as u64,
            timeout_ns: self.runtime.wait_timeout().as_nanos() as u64,
            me: self.runtime.pe() as i32,
            npes: self.runtime.npes() as i32,
        };
        let shape = LaunchShape {
            grid: (self.ctas, 1, 1),
            block: (ALLGATHER_THREADS, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: every pointer is owned by self and outlives the launch (self is borrowed until
        // the caller synchronises through `finish`, or drops self only after synchronising).
        unsafe { self.round.launch(stream, shape, &params) }
    }

    fn pattern_params(&mut self, stream: &Arc<CudaStream>) -> PatternParams {
        PatternParams {
            src: self.src.raw(),
            slots: self.slots.raw(),
            epoch: device_addr(&self.epoch, stream),
            mismatches: device_addr(&self.mismatches, stream),
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
        // SAFETY: pointers owned by self.
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
        // SAFETY: pointers owned by self.
        unsafe { self.check.launch(stream, shape, &params) }
    }

    /// Waits for `stream`, then returns the error of the first expired wait, if any.
    pub fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize()?;
        stream.clone_dtoh(&self.diag)?[0].into_result()
    }

    /// The last completed epoch (synchronises `stream`).
    pub fn epoch(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream.clone_dtoh(&self.epoch)?[0])
    }

    /// Mismatching words counted by [`AllGather::check_pattern`] so far (synchronises `stream`).
    pub fn mismatches(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream.clone_dtoh(&self.mismatches)?[0])
    }

    /// Frees the symmetric buffers (collective).
    pub fn free(self) -> Result<()> {
        let rt = self.runtime.clone();
        rt.free(self.credit)?;
        rt.free(self.data_signal)?;
        rt.free(self.slots)?;
        rt.free(self.src)
    }
}

/// Device ping-pong between PE 0 and PE 1: the round-trip latency of a signal.
pub struct PingPong {
    runtime: Runtime,
    flags: SymmetricBuffer<u64>,
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
        Ok(PingPong {
            runtime: runtime.clone(),
            flags: runtime.alloc_zeroed(2)?,
            round: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
            kernel: runtime.module().kernel("lasp_pingpong")?,
        })
    }

    /// Enqueues `rounds` round trips on `stream` (PEs other than 0 and 1 enqueue nothing).
    pub fn launch(&self, stream: &Arc<CudaStream>, rounds: u32) -> Result<()> {
        let me = self.runtime.pe();
        if me > 1 {
            return Ok(());
        }
        let params = PingPongParams {
            flags: self.flags.raw(),
            round: device_addr(&self.round, stream),
            diag: device_addr(&self.diag, stream),
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
        // SAFETY: pointers owned by self.
        unsafe { self.kernel.launch(stream, shape, &params) }
    }

    /// Waits for `stream`, then returns the error of an expired wait, if any.
    pub fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize()?;
        stream.clone_dtoh(&self.diag)?[0].into_result()
    }

    /// Frees the flags (collective).
    pub fn free(self) -> Result<()> {
        self.runtime.free(self.flags)
    }
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
    fn params_have_the_c_layout() {
        // lasp_allgather_params: 9 eight-byte fields, then two ints.
        assert_eq!(std::mem::size_of::<AllGatherParams>(), 80);
        assert_eq!(std::mem::size_of::<PatternParams>(), 48);
        assert_eq!(std::mem::size_of::<PingPongParams>(), 48);
    }
}
