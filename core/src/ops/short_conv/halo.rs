//! One direction of the short convolution's halo exchange: the symmetric slots, staging block,
//! signals and credit of `lasp_halo_exchange` (kernels/cuda/include/lasp/short_conv/
//! short_conv_params.h, where the protocol is), the direction's epoch and its wait diagnostics.

use crate::diagnostics::WaitDiagnostics;
use crate::error::Result;
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lasp_shmem_kernels::params::lasp_halo_exchange;
use std::sync::Arc;

/// Which way a halo travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Flow {
    /// Each PE's last tokens to the next PE (the forward's halo).
    ToNext,
    /// Each PE's halo gradient back to the previous PE (the backward's).
    ToPrevious,
}

/// The buffers of one direction; every PE allocates the same (collective).
pub(super) struct HaloExchange {
    flow: Flow,
    slots: SymmetricBuffer<f32>,
    staging: SymmetricBuffer<f32>,
    signal: SymmetricBuffer<u64>,
    credit: SymmetricBuffer<u64>,
    epoch: CudaSlice<u64>,
    diag: CudaSlice<WaitDiagnostics>,
}

impl HaloExchange {
    /// Slots for `halo_floats` (B (K - 1) C, at least 1) floats per parity and `signals` signal
    /// words per parity (one per sending CTA: B x the convolution's channel tiles) (collective).
    pub(super) fn new(
        runtime: &Runtime,
        flow: Flow,
        halo_floats: usize,
        signals: usize,
    ) -> Result<Self> {
        let stream = runtime.stream();
        Ok(HaloExchange {
            flow,
            slots: runtime.alloc_zeroed(2 * halo_floats)?,
            staging: runtime.alloc(halo_floats)?,
            signal: runtime.alloc_zeroed(2 * signals)?,
            credit: runtime.alloc_zeroed(1)?,
            epoch: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
        })
    }

    /// The kernels' view of this direction for PE `me` of `npes`.
    pub(super) fn params(&self, runtime: &Runtime, stream: &Arc<CudaStream>) -> lasp_halo_exchange {
        let (me, npes) = (runtime.pe() as i32, runtime.npes() as i32);
        let (previous, next) = (
            if me > 0 { me - 1 } else { -1 },
            if me + 1 < npes { me + 1 } else { -1 },
        );
        let (source, dest) = match self.flow {
            Flow::ToNext => (previous, next),
            Flow::ToPrevious => (next, previous),
        };
        lasp_halo_exchange {
            slots: self.slots.raw() as _,
            staging: self.staging.raw() as _,
            signal: self.signal.raw() as _,
            credit: self.credit.raw() as _,
            epoch: self.epoch.device_ptr(stream).0 as _,
            diag: self.diag.device_ptr(stream).0 as _,
            timeout_ns: runtime.wait_timeout().as_nanos() as u64,
            me,
            source,
            dest,
            reserved: 0,
        }
    }

    /// Whether this PE reads a halo another PE puts (it has a source in this direction).
    pub(super) fn has_source(&self, runtime: &Runtime) -> bool {
        match self.flow {
            Flow::ToNext => runtime.pe() > 0,
            Flow::ToPrevious => runtime.pe() + 1 < runtime.npes(),
        }
    }

    /// The first expired wait of this direction, if any (synchronises `stream`).
    pub(super) fn check_waits(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let diag = stream.clone_dtoh(&self.diag)?;
        diag[0].into_result()
    }

    /// Completed calls of this direction (synchronises `stream`).
    pub(super) fn epoch(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream.clone_dtoh(&self.epoch)?[0])
    }

    /// Frees the symmetric buffers (collective).
    pub(super) fn free(self, runtime: &Runtime) -> Result<()> {
        runtime.free(self.credit)?;
        runtime.free(self.signal)?;
        runtime.free(self.staging)?;
        runtime.free(self.slots)
    }
}
