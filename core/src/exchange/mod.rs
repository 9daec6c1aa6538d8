//! The exchange of shard summaries between PEs, written once for every model family:
//!
//! * [`chain`]: one LASP-2 operation's exchange (epochs, modes, credits, the side stream, bounded
//!   waits' diagnostics, the layout every PE agrees on), generic over the [`Family`] whose
//!   summaries it moves;
//! * [`schedule`]: the symmetric buffers and host-side collectives of the exchange
//!   ([`Schedule::AllGather`]'s, which both device schedules use: the all-gather and the
//!   pipelined chain, each an [`ExchangeMode`]);
//! * [`planner`]: picks an operation's mode and launch plan by timing them on the caller's call;
//! * [`transport`]: the device-initiated all-gather and ping-pong primitives, standalone (the
//!   exchange benchmark measures them against NCCL).
//!
//! The device side is `kernels/cuda/include/lasp/exchange/` (chain_params.h, chain.cuh); the
//! protocol is kernels/docs/lasp2.md.
//!
//! [`Family`]: crate::family::Family

pub mod chain;
pub mod emulated_links;
pub mod planner;
pub mod schedule;
pub mod transport;

pub use schedule::Schedule;

/// What every LASP-2 operation (either direction, every family) does through its state chain,
/// for code that drives any of them: switching modes, waiting, counting graph replays, freeing.
/// Each operation also has these as its own methods ([`chain_methods!`]), so callers of one
/// operation need not import the trait.
pub trait Lasp2Operation: Sized {
    /// The layout every PE agreed on.
    fn layout(&self) -> Lasp2Layout;
    /// Switches every PE to `mode` (collective).
    fn set_mode(&mut self, mode: ExchangeMode) -> crate::error::Result<()>;
    /// Whether the operation runs in `mode` (the pipelined chain needs its family's support).
    fn supports(&self, mode: ExchangeMode) -> bool;
    /// Waits for `stream`, then returns the error of the first expired wait, if any.
    fn finish(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> crate::error::Result<()>;
    /// Completed calls (the device epoch; synchronises `stream`).
    fn epoch(
        &self,
        stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> crate::error::Result<u64>;
    /// Records `calls` calls replayed from a captured CUDA graph.
    fn note_replayed_calls(&mut self, calls: u64);
    /// Frees the symmetric buffers (collective).
    fn free(self) -> crate::error::Result<()>;
}

/// The methods a LASP-2 operation `$op` (a struct with a [`chain::StateChain`] field `chain`)
/// passes through to its chain: `layout`, `set_mode`, `finish`, `epoch`, `note_replayed_calls`
/// and `free`, as its own methods and as its [`Lasp2Operation`] implementation, and `plan`.
/// `chain_methods!(Op)` also gives `Op` a single launch plan; `chain_methods!(Op,
/// own_launch_plans)` leaves [`planner::LaunchPlans`] to `Op`.
macro_rules! chain_methods {
    ($op:ty) => {
        $crate::exchange::chain_methods!($op, own_launch_plans);

        impl $crate::exchange::planner::LaunchPlans for $op {
            type Launch = ();
            fn launch(&self) {}
            fn launch_plans(&self) -> Vec<()> {
                vec![()]
            }
            fn same_bits(&self, _: (), _: usize) -> bool {
                true
            }
            fn set_launch(&mut self, _: ()) -> $crate::error::Result<()> {
                Ok(())
            }
        }
    };
    ($op:ty, own_launch_plans) => {
        impl $op {
            /// Times the communicating modes and the launch plans that keep the bits on `call`
            /// (this PE's call, on a shard of `t_local` tokens), switches every PE to the fastest
            /// and returns what was measured (collective: every PE passes its own shard of the
            /// same layout). See [`planner`](crate::exchange::planner).
            pub fn plan(
                &mut self,
                stream: &::std::sync::Arc<::cudarc::driver::CudaStream>,
                t_local: usize,
                call: impl FnMut(
                    &mut Self,
                    &::std::sync::Arc<::cudarc::driver::CudaStream>,
                ) -> $crate::error::Result<()>,
            ) -> $crate::error::Result<
                $crate::exchange::planner::Plan<
                    <Self as $crate::exchange::planner::LaunchPlans>::Launch,
                >,
            > {
                let runtime = self.chain.runtime().clone();
                $crate::exchange::planner::plan(self, &runtime, stream, t_local, call)
            }
        }

        impl $op {
            /// The layout every PE agreed on.
            pub fn layout(&self) -> $crate::exchange::Lasp2Layout {
                self.chain.layout()
            }

            /// Switches every PE to `mode` (collective: checks that all PEs ask for the same
            /// mode, sets up NCCL on first use, and re-arms the credits when leaving
            /// [`ExchangeMode::NoComm`](crate::exchange::ExchangeMode::NoComm)).
            pub fn set_mode(
                &mut self,
                mode: $crate::exchange::ExchangeMode,
            ) -> $crate::error::Result<()> {
                self.chain.set_mode(mode)
            }

            /// Whether the operation runs in `mode` (the pipelined chain needs its family's
            /// support; every other mode runs everywhere).
            pub fn supports(&self, mode: $crate::exchange::ExchangeMode) -> bool {
                self.chain.supports(mode)
            }

            /// Whether the sequential NCCL mode, once entered, gathers in a symmetric NCCL
            /// window (NCCL 2.27 on: its symmetric kernels) rather than in plain memory.
            pub fn nccl_window(&self) -> bool {
                self.chain.nccl_window()
            }

            /// Waits for `stream`, then returns the error of the first expired wait, if any
            /// (naming the PE that never sent, the signal slot and the epoch).
            pub fn finish(
                &self,
                stream: &::std::sync::Arc<::cudarc::driver::CudaStream>,
            ) -> $crate::error::Result<()> {
                self.chain.finish(stream)
            }

            /// Completed calls (the device epoch, one per call, graph replays included;
            /// synchronises `stream`).
            pub fn epoch(
                &self,
                stream: &::std::sync::Arc<::cudarc::driver::CudaStream>,
            ) -> $crate::error::Result<u64> {
                self.chain.epoch(stream)
            }

            /// Records `calls` calls replayed from a captured CUDA graph, so host-side gathers
            /// of later calls use the right parity.
            pub fn note_replayed_calls(&mut self, calls: u64) {
                self.chain.note_replayed_calls(calls);
            }

            /// Frees the symmetric buffers (collective).
            pub fn free(self) -> $crate::error::Result<()> {
                self.chain.free()
            }
        }

        impl $crate::exchange::Lasp2Operation for $op {
            fn layout(&self) -> $crate::exchange::Lasp2Layout {
                <$op>::layout(self)
            }
            fn set_mode(
                &mut self,
                mode: $crate::exchange::ExchangeMode,
            ) -> $crate::error::Result<()> {
                <$op>::set_mode(self, mode)
            }
            fn supports(&self, mode: $crate::exchange::ExchangeMode) -> bool {
                <$op>::supports(self, mode)
            }
            fn finish(
                &self,
                stream: &::std::sync::Arc<::cudarc::driver::CudaStream>,
            ) -> $crate::error::Result<()> {
                <$op>::finish(self, stream)
            }
            fn epoch(
                &self,
                stream: &::std::sync::Arc<::cudarc::driver::CudaStream>,
            ) -> $crate::error::Result<u64> {
                <$op>::epoch(self, stream)
            }
            fn note_replayed_calls(&mut self, calls: u64) {
                <$op>::note_replayed_calls(self, calls)
            }
            fn free(self) -> $crate::error::Result<()> {
                <$op>::free(self)
            }
        }
    };
}
pub(crate) use chain_methods;

use crate::family::Family;
use lasp_shmem_kernels::params as header;

/// How the summaries move between PEs. Every PE must use the same mode in a call; every mode
/// gives bitwise the same outputs (the fold and every other operation are the same).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeMode {
    /// Producer CTAs put their PE's tile (forward: `(M_w, Λ_w)`) into the slots of the PEs that
    /// fold it with signals; the consuming kernel waits on the signals (bounded) before its
    /// prologue. No host collective, no stream sync. The all-gather schedule: the last PE takes
    /// in `W - 1` tiles.
    Overlapped,
    /// The overlapped mode with the pipelined chain schedule: each PE's summary kernel waits for
    /// its predecessor's prefix tile by tile, folds its own summary in and puts the result to its
    /// successor only, so every PE takes in and sends one state whatever W is, at the price of
    /// `W - 1` hops of latency. The same folds of the same operands as the all-gather, so the
    /// same bits. Only for families whose summary kernel relays the prefix
    /// ([`Family::RELAYS_PREFIX`]).
    PipelinedChain,
    /// The same kernels with NCCL's all-gather of the slots between them.
    SequentialNccl,
    /// The same kernels with NVSHMEM's on-stream all-gather (`fcollect`) between them.
    SequentialNvshmem,
    /// The same kernels with no exchange at all: the cost of the compute alone. Outputs of PEs
    /// other than the chain's first (forward: PE 0, backward: the last PE) are then not the
    /// LASP-2 result.
    NoComm,
}

impl ExchangeMode {
    /// All modes, in benchmark order.
    pub const ALL: [ExchangeMode; 5] = [
        ExchangeMode::Overlapped,
        ExchangeMode::SequentialNccl,
        ExchangeMode::SequentialNvshmem,
        ExchangeMode::NoComm,
        ExchangeMode::PipelinedChain,
    ];

    /// `enum lasp2_exchange_mode`.
    pub(crate) fn kernel_mode(self) -> i32 {
        (match self {
            ExchangeMode::NoComm => header::LASP2_NO_COMM,
            ExchangeMode::Overlapped => header::LASP2_DEVICE_PUT,
            ExchangeMode::PipelinedChain => header::LASP2_DEVICE_CHAIN,
            ExchangeMode::SequentialNccl | ExchangeMode::SequentialNvshmem => {
                header::LASP2_HOST_GATHERED
            }
        }) as i32
    }

    /// A number per mode, for checking that every PE asked for the same one.
    pub(crate) fn code(self) -> u64 {
        self.kernel_mode() as u64 * 2 + matches!(self, ExchangeMode::SequentialNvshmem) as u64
    }
}

/// Which way the summaries travel (`enum lasp2_chain`): the PE at chain position `i` folds the
/// summaries of positions `0..i` in that order and sends its own to positions `i+1..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// The forward: position = PE; the prefix state toward every later PE.
    Ascending = header::LASP2_CHAIN_ASCENDING as isize,
    /// The backward: position = `npes - 1 - PE`; the state gradient toward every earlier PE
    /// (through the transposed transition).
    Descending = header::LASP2_CHAIN_DESCENDING as isize,
}

/// What every PE must agree on: it fixes the symmetric layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lasp2Layout {
    pub b: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
}

impl Lasp2Layout {
    pub(crate) fn dims(&self) -> (i32, i32, i32, i32) {
        (self.b as i32, self.h as i32, self.dk as i32, self.dv as i32)
    }

    /// Symmetric bytes one LASP-2 operation of family `F` allocates on each PE with the
    /// all-gather schedule (size the runtime's heap with the sum over the operations).
    pub fn symmetric_bytes<F: Family>(&self, npes: usize) -> usize {
        Schedule::AllGather.symmetric_bytes(self, npes, F::summary_tile_floats(self))
    }

    /// A 64-bit digest of the family, the layout, the PE count, the direction, the schedule and
    /// the size of the kernels' parameter struct: what every PE's instance must agree on.
    pub(crate) fn fingerprint<F: Family>(
        &self,
        npes: usize,
        direction: Direction,
        schedule: Schedule,
    ) -> u64 {
        // FNV-1a over the fields: stable across builds and platforms (unlike std's hasher).
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for v in [
            F::KIND as usize,
            self.b,
            self.h,
            self.dk,
            self.dv,
            npes,
            direction as usize,
            schedule as usize,
            std::mem::size_of::<F::Lasp2Params>(),
        ] {
            for byte in (v as u64).to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h
    }
}

/// The exchange's layouts and launch formulas (`lasp/exchange/chain_params.h`), for a family's
/// summary tile of `tile_floats` floats.
pub mod geometry {
    use super::header;

    /// `LASP2_TILE_V`: Dv columns of one exchanged tile.
    pub const TILE_V: i32 = header::LASP2_TILE_V as i32;

    /// `lasp2_num_vtiles`.
    pub const fn num_vtiles(dv: i32) -> i32 {
        dv / TILE_V
    }
    /// `lasp2_slot_pe_floats`: one PE's slot in one parity.
    pub const fn slot_pe_floats(b: i32, h: i32, dv: i32, tile_floats: u64) -> u64 {
        b as u64 * h as u64 * num_vtiles(dv) as u64 * tile_floats
    }
    /// `lasp2_slots_bytes`.
    pub const fn slots_bytes(npes: i32, b: i32, h: i32, dv: i32, tile_floats: u64) -> u64 {
        2 * npes as u64 * slot_pe_floats(b, h, dv, tile_floats) * 4
    }
    /// One CTA per (Dv tile, head) of a group of `heads` (a family header's
    /// `lasp2_fold_put_grid`): the launch of the summary kernels and of every other per-tile
    /// kernel of a chain.
    pub const fn tile_grid(heads: i32, dv: i32) -> (u32, u32, u32) {
        (num_vtiles(dv) as u32, heads as u32, 1)
    }
    /// `lasp2_signals_count`.
    pub const fn signals_count(npes: i32, b: i32, h: i32, dv: i32) -> u64 {
        2 * npes as u64 * b as u64 * h as u64 * num_vtiles(dv) as u64
    }
    /// `lasp2_gather_bytes`.
    pub const fn gather_bytes(b: i32, h: i32, dv: i32, tile_floats: u64) -> u64 {
        slot_pe_floats(b, h, dv, tile_floats) * 4
    }
    /// `lasp2_gather_recv_offset`.
    pub const fn gather_recv_offset(
        parity: i32,
        npes: i32,
        b: i32,
        h: i32,
        dv: i32,
        tile_floats: u64,
    ) -> u64 {
        parity as u64 * npes as u64 * gather_bytes(b, h, dv, tile_floats)
    }
    /// `lasp2_gather_send_offset`.
    pub const fn gather_send_offset(
        parity: i32,
        me: i32,
        npes: i32,
        b: i32,
        h: i32,
        dv: i32,
        tile_floats: u64,
    ) -> u64 {
        (parity as u64 * npes as u64 + me as u64) * gather_bytes(b, h, dv, tile_floats)
    }
    /// `lasp2_timeline_words`.
    pub const fn timeline_words(b: i32, h: i32, dv: i32, s: i32) -> u64 {
        let (put, output) = (
            header::LASP2_TIMELINE_PUT_STAMPS as u64,
            header::LASP2_TIMELINE_OUTPUT_STAMPS as u64,
        );
        b as u64 * h as u64 * num_vtiles(dv) as u64 * (put + s as u64 * output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::scalar_decay::ScalarDecay;

    #[test]
    fn layouts_match_the_worked_example_of_the_notes() {
        // B=4, H=16, Dk=Dv=128, 4 PEs, scalar decay (128 x 64 + 4 floats a tile): 4,196,352 B
        // per PE and parity; 1,024 signal words.
        let tile = 128 * 64 + 4;
        assert_eq!(geometry::gather_bytes(4, 16, 128, tile), 4_196_352);
        assert_eq!(geometry::slots_bytes(4, 4, 16, 128, tile), 33_570_816);
        assert_eq!(geometry::signals_count(4, 4, 16, 128), 1024);
        assert_eq!(
            geometry::gather_send_offset(1, 2, 4, 4, 16, 128, tile),
            6 * 4_196_352
        );
    }

    #[test]
    fn modes_and_fingerprints_distinguish_what_must_agree() {
        let codes: std::collections::HashSet<u64> =
            ExchangeMode::ALL.iter().map(|m| m.code()).collect();
        assert_eq!(codes.len(), ExchangeMode::ALL.len());
        let a = Lasp2Layout {
            b: 4,
            h: 16,
            dk: 128,
            dv: 128,
        };
        let (up, all) = (Direction::Ascending, Schedule::AllGather);
        let print = |l: Lasp2Layout, npes, d| l.fingerprint::<ScalarDecay>(npes, d, all);
        assert_ne!(print(a, 4, up), print(a, 2, up));
        assert_ne!(print(a, 4, up), print(Lasp2Layout { h: 8, ..a }, 4, up));
        assert_ne!(print(a, 4, up), print(a, 4, Direction::Descending));
        assert_eq!(print(a, 4, up), print(a, 4, up));
    }
}
