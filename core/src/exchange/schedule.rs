//! Exchange schedules: how the summaries of one LASP-2 call travel between PEs, with the
//! symmetric buffers each needs and its host-driven form for the sequential modes.
//!
//! A schedule is independent of the family: it moves summary tiles of the family's size and the
//! family folds whatever arrives, in chain order. Its device side is a type of
//! `lasp/exchange/chain.cuh` (`lasp::exchange::Exchange`: `send_credits`, `publish`, `wait`,
//! `fold_arrived`, `grant_credits`) that the families' kernels take as a template parameter, with
//! a row per kernel in `kernels/instances.rs`.

use super::{geometry, ExchangeMode, Lasp2Layout};
use crate::error::Result;
use crate::nccl::NcclComm;
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// How summaries travel. Part of the layout every PE agrees on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Schedule {
    /// Every PE puts its summary tile to every PE after it on the chain (one put and one signal
    /// per tile and reader); each PE folds all earlier summaries in chain order. One hop of
    /// latency; the last PE takes in `W - 1` summaries.
    AllGather = 0,
}

impl Schedule {
    /// Symmetric bytes the schedule allocates on each PE for summary tiles of `tile_floats`
    /// floats: the slots, the gather staging, the signals and credits, and 64 KiB of allocator
    /// slack.
    pub fn symmetric_bytes(self, layout: &Lasp2Layout, npes: usize, tile_floats: u64) -> usize {
        let (b, h, _, dv) = layout.dims();
        let n = npes as i32;
        (geometry::slots_bytes(n, b, h, dv, tile_floats)
            + geometry::gather_bytes(b, h, dv, tile_floats)
            + 8 * (geometry::signals_count(n, b, h, dv) + npes as u64)) as usize
            + (64 << 10)
    }
}

/// The symmetric buffers of the all-gather schedule (`lasp/exchange/chain_params.h`): slots
/// `[2][npes][B*H][Dv/64]` tiles, signals `[2][npes][B*H*(Dv/64)]`, credits `[npes]`, and the
/// staging block of the NVSHMEM all-gather.
pub(crate) struct AllGatherBuffers {
    layout: Lasp2Layout,
    tile_floats: u64,
    pub(crate) slots: SymmetricBuffer<f32>,
    pub(crate) signals: SymmetricBuffer<u64>,
    pub(crate) credit: SymmetricBuffer<u64>,
    staging: SymmetricBuffer<u8>,
}

impl AllGatherBuffers {
    /// Allocates the buffers, zeroed where the protocol needs it (collective).
    pub(crate) fn new(runtime: &Runtime, layout: Lasp2Layout, tile_floats: u64) -> Result<Self> {
        let (b, h, _, dv) = layout.dims();
        let n = runtime.npes() as i32;
        Ok(AllGatherBuffers {
            layout,
            tile_floats,
            slots: runtime
                .alloc_zeroed((geometry::slots_bytes(n, b, h, dv, tile_floats) / 4) as usize)?,
            signals: runtime.alloc_zeroed(geometry::signals_count(n, b, h, dv) as usize)?,
            credit: runtime.alloc_zeroed(runtime.npes())?,
            staging: runtime.alloc(geometry::gather_bytes(b, h, dv, tile_floats) as usize)?,
        })
    }

    /// Bytes of the slots (both parities).
    pub(crate) fn slots_bytes(&self) -> usize {
        cudarc::driver::DeviceSlice::len(&self.slots) * std::mem::size_of::<f32>()
    }

    /// The sequential modes' host-driven all-gather of slot half `parity` of the slots at
    /// `slots` (these buffers' own, or the NCCL mode's window of the same layout), on `stream`
    /// after the call's summaries are in this PE's own slot; nothing in the other modes.
    pub(crate) fn gather_on_host(
        &self,
        runtime: &Runtime,
        nccl: Option<&NcclComm>,
        mode: ExchangeMode,
        stream: &Arc<CudaStream>,
        parity: i32,
        slots: u64,
    ) -> Result<()> {
        let (b, h, _, dv) = self.layout.dims();
        let tile = self.tile_floats;
        let (me, npes) = (runtime.pe() as i32, runtime.npes() as i32);
        let bytes = geometry::gather_bytes(b, h, dv, tile);
        let base = slots;
        let send = base + geometry::gather_send_offset(parity, me, npes, b, h, dv, tile);
        let recv = base + geometry::gather_recv_offset(parity, npes, b, h, dv, tile);
        match mode {
            ExchangeMode::Overlapped | ExchangeMode::PipelinedChain | ExchangeMode::NoComm => {
                Ok(())
            }
            ExchangeMode::SequentialNccl => {
                let comm = nccl.expect("the chain creates NCCL when it enters this mode");
                // SAFETY: the parity half of `slots` (these buffers' or the chain's NCCL window
                // of the same layout), [npes][bytes], owned by self or the chain; on the caller's
                // stream, after this call's summaries.
                unsafe { comm.all_gather_in_place(stream, recv, bytes as usize) }
            }
            ExchangeMode::SequentialNvshmem => {
                // fcollect's source may not overlap its destination: stage this PE's block.
                // SAFETY: both ranges are `bytes` long inside symmetric buffers owned by self.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        self.staging.raw(),
                        send,
                        bytes as usize,
                        stream.cu_stream(),
                    )
                }?;
                // SAFETY: `staging` and the parity half of `slots` are distinct symmetric
                // buffers owned by self, of `bytes` and npes x `bytes` from `recv`; every PE
                // makes this call in the same mode and order; on the caller's stream.
                unsafe {
                    runtime.fcollect_on_stream(stream, recv, self.staging.raw(), bytes as usize)
                }
            }
        }
    }

    /// Frees the buffers (collective).
    pub(crate) fn free(self, runtime: &Runtime) -> Result<()> {
        runtime.free(self.staging)?;
        runtime.free(self.credit)?;
        runtime.free(self.signals)?;
        runtime.free(self.slots)
    }
}
