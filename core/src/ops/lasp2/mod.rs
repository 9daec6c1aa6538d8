//! LASP-2 of scalar-decay linear attention across PEs: the forward ([`Lasp2Forward`]) and the
//! backward ([`Lasp2Backward`]). Kernels: kernels/cuda/lasp2_{fwd,bwd,chain}.cu; protocol:
//! kernels/docs/lasp2.md.
//!
//! PE `w` holds the `w`-th slice of every sequence. Both directions are a chain
//! (`chain::StateChain`): every PE computes a tile per (b, h) from its own shard alone, puts it
//! (in [`ExchangeMode::Overlapped`], from the device, with a signal) to the PEs after it on the
//! chain, and folds the tiles of the PEs before it, `X = e^{Λ_u} X + tile_u`. The forward's chain
//! runs from PE 0 up (the prefix state entering each shard); the backward's from the last PE down
//! (the gradient with respect to the state leaving each shard). The sequential modes replace the
//! device puts by a host-driven all-gather between the same kernels; [`ExchangeMode::NoComm`]
//! drops the exchange (for timing). The fold and every other operation are the same in every
//! mode, so outputs are bit-identical across modes.

mod backward;
mod chain;
mod forward;

pub use backward::Lasp2Backward;
pub use forward::{Lasp2Forward, Lasp2Timeline, Lasp2Tuning};

use super::scalar_decay::{self, geometry as sd, ForwardShape};
use crate::error::Result;
use crate::kernel::LaunchShape;
use lasp_shmem_kernels::params as header;

/// How the memory states move between PEs. Every PE must use the same mode in a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeMode {
    /// Producer CTAs put their PE's tile (forward: `(M_w, Λ_w)`) into the slots of the PEs that
    /// fold it with signals; the consuming kernel waits on the signals (bounded) before its
    /// prologue. No host collective, no stream sync.
    Overlapped,
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
    pub const ALL: [ExchangeMode; 4] = [
        ExchangeMode::Overlapped,
        ExchangeMode::SequentialNccl,
        ExchangeMode::SequentialNvshmem,
        ExchangeMode::NoComm,
    ];

    /// `enum lasp2_exchange_mode`.
    pub(crate) fn kernel_mode(self) -> i32 {
        (match self {
            ExchangeMode::NoComm => header::LASP2_NO_COMM,
            ExchangeMode::Overlapped => header::LASP2_DEVICE_PUT,
            ExchangeMode::SequentialNccl | ExchangeMode::SequentialNvshmem => {
                header::LASP2_HOST_GATHERED
            }
        }) as i32
    }

    pub(crate) fn code(self) -> u64 {
        self.kernel_mode() as u64 * 2 + matches!(self, ExchangeMode::SequentialNvshmem) as u64
    }
}

/// The header's layout and launch formulas (`lasp2_params.h`): its constants (generated from it)
/// and a port of its helpers.
pub mod geometry {
    use super::{header, sd};

    /// `LASP2_FOLD_THREADS`.
    pub const FOLD_THREADS: u32 = header::LASP2_FOLD_THREADS;
    /// `LASP2_SLOT_TRAILER_FLOATS`: Λ and padding after a tile's `Dk*64` floats.
    pub const SLOT_TRAILER_FLOATS: u64 = header::LASP2_SLOT_TRAILER_FLOATS as u64;

    /// `lasp2_slot_tile_floats`.
    pub const fn slot_tile_floats(dk: i32) -> u64 {
        dk as u64 * sd::TILE_V as u64 + SLOT_TRAILER_FLOATS
    }
    /// `lasp2_slot_pe_floats`: one PE's slot in one parity.
    pub const fn slot_pe_floats(b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * sd::num_vtiles(dv) as u64 * slot_tile_floats(dk)
    }
    /// `lasp2_slots_bytes`.
    pub const fn slots_bytes(npes: i32, b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        2 * npes as u64 * slot_pe_floats(b, h, dk, dv) * 4
    }
    /// `lasp2_signals_count`.
    pub const fn signals_count(npes: i32, b: i32, h: i32, dv: i32) -> u64 {
        2 * npes as u64 * b as u64 * h as u64 * sd::num_vtiles(dv) as u64
    }
    /// `lasp2_gather_bytes`.
    pub const fn gather_bytes(b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        slot_pe_floats(b, h, dk, dv) * 4
    }
    /// `lasp2_gather_recv_offset`.
    pub const fn gather_recv_offset(
        parity: i32,
        npes: i32,
        b: i32,
        h: i32,
        dk: i32,
        dv: i32,
    ) -> u64 {
        parity as u64 * npes as u64 * gather_bytes(b, h, dk, dv)
    }
    /// `lasp2_gather_send_offset`.
    pub const fn gather_send_offset(
        parity: i32,
        me: i32,
        npes: i32,
        b: i32,
        h: i32,
        dk: i32,
        dv: i32,
    ) -> u64 {
        (parity as u64 * npes as u64 + me as u64) * gather_bytes(b, h, dk, dv)
    }
    /// `lasp2_ws_m_bytes` (= `lasp2_ws_lambda_offset`).
    pub const fn ws_m_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * s as u64 * dk as u64 * dv as u64 * 4
    }
    /// `lasp2_timeline_words`.
    pub const fn timeline_words(b: i32, h: i32, dv: i32, s: i32) -> u64 {
        let (put, output) = (
            header::LASP2_TIMELINE_PUT_STAMPS as u64,
            header::LASP2_TIMELINE_OUTPUT_STAMPS as u64,
        );
        b as u64 * h as u64 * sd::num_vtiles(dv) as u64 * (put + s as u64 * output)
    }
    /// `lasp2_ws_p_offset` (16-byte aligned).
    pub const fn ws_p_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        (ws_m_bytes(b, h, s, dk, dv) + b as u64 * h as u64 * s as u64 * 4).div_ceil(16) * 16
    }
    /// `lasp2_workspace_bytes`.
    pub const fn workspace_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        ws_p_offset(b, h, s, dk, dv) + ws_m_bytes(b, h, s, dk, dv)
    }
    /// `lasp2_states_grid` (all S segments) and `lasp2_output_grid`, for a group of `heads`.
    pub const fn segments_grid(heads: i32, dv: i32, s: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, s as u32, heads as u32)
    }
    /// `lasp2_carry_in_smem_bytes`: two staged slot tiles of `Dk` rows of 72 floats, and their
    /// 16-byte trailers.
    pub const fn carry_in_smem_bytes(dk: i32) -> u32 {
        2 * (dk as u32 * 72 * 4 + 16)
    }
    /// `lasp2_fold_put_grid` (also the backward's carry_in grid), for a group of `heads`.
    pub const fn fold_put_grid(heads: i32, dv: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, heads as u32, 1)
    }
}

/// The C struct `lasp_lasp2_params`, generated from its header, passed by value to every LASP-2
/// kernel. Pointer fields hold device addresses; NULL where a buffer is absent.
pub(crate) type Lasp2Params = header::lasp_lasp2_params;

/// Which way the tiles travel (`enum lasp2_chain`): the PE at chain position `i` folds the tiles
/// of positions `0..i` in that order and puts its own to positions `i+1..`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Chain {
    /// The forward: position = PE; `(M_u, Λ_u)` to every later PE.
    Ascending = header::LASP2_CHAIN_ASCENDING as isize,
    /// The backward: position = `npes - 1 - PE`; the gradient's carry to every earlier PE.
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

    /// Checks that the kernels support the layout (as [`ForwardShape::validate`] for any T).
    pub fn validate(&self) -> Result<()> {
        ForwardShape {
            b: self.b,
            t: 1,
            h: self.h,
            dk: self.dk,
            dv: self.dv,
        }
        .validate()
    }

    /// Symmetric bytes one instance allocates on each PE (size the runtime's heap with it).
    pub fn symmetric_bytes(&self, npes: usize) -> usize {
        let (b, h, dk, dv) = self.dims();
        let n = npes as i32;
        (geometry::slots_bytes(n, b, h, dk, dv)
            + geometry::gather_bytes(b, h, dk, dv)
            + 8 * (geometry::signals_count(n, b, h, dv) + npes as u64)) as usize
            + (64 << 10)
    }

    /// A 64-bit digest of the layout, the PE count, the chain and the kernels' interface
    /// version.
    pub(crate) fn fingerprint(&self, npes: usize, chain: Chain) -> u64 {
        // FNV-1a over the fields: stable across builds and platforms (unlike std's hasher).
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for v in [
            self.b,
            self.h,
            self.dk,
            self.dv,
            npes,
            chain as usize,
            std::mem::size_of::<Lasp2Params>(),
        ] {
            for byte in (v as u64).to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h
    }
}

/// One CTA of `LASP2_FOLD_THREADS` per (Dv tile, head) of a group of `heads`: the launch of
/// fold_put and of the forward's segment_prefix.
fn fold_launch(heads: i32, dv: i32) -> LaunchShape {
    LaunchShape {
        grid: geometry::fold_put_grid(heads, dv),
        block: (geometry::FOLD_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

fn single_thread() -> LaunchShape {
    LaunchShape {
        grid: (1, 1, 1),
        block: (1, 1, 1),
        shared_bytes: 0,
    }
}

/// The scalar-decay shape of one PE's shard (re-exported for callers of [`Lasp2Forward::forward`]).
pub type ShardShape = scalar_decay::ForwardShape;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_worked_example_of_the_notes() {
        // B=4, H=16, Dk=Dv=128, 4 PEs: 4,196,352 B per PE and parity; 1,024 signal words.
        assert_eq!(geometry::gather_bytes(4, 16, 128, 128), 4_196_352);
        assert_eq!(geometry::slots_bytes(4, 4, 16, 128, 128), 33_570_816);
        assert_eq!(geometry::signals_count(4, 4, 16, 128), 1024);
        // ws_m 4,194,304 B + 64 Λ floats = 4,194,560 (16-aligned), then ws_p of ws_m's size.
        assert_eq!(geometry::ws_p_offset(4, 16, 1, 128, 128), 4_194_560);
        assert_eq!(geometry::workspace_bytes(4, 16, 1, 128, 128), 8_388_864);
        // 3 heads x 1 segment x 64 x 64 floats + 3 Λ floats = 49,164 B, rounded up to 49,168.
        assert_eq!(geometry::ws_p_offset(1, 3, 1, 64, 64), 49_168);
        assert_eq!(
            geometry::gather_send_offset(1, 2, 4, 4, 16, 128, 128),
            6 * 4_196_352
        );
        assert_eq!(geometry::slot_tile_floats(64) * 4, 16_400);
        // Two staged tiles of 128 rows x 72 floats plus trailers.
        assert_eq!(geometry::carry_in_smem_bytes(128), 73_760);
        // Per tile 2 put stamps, and 3 output stamps per segment.
        assert_eq!(geometry::timeline_words(1, 2, 128, 3), 4 * (2 + 3 * 3));
    }

    #[test]
    fn modes_and_fingerprints_distinguish_what_must_agree() {
        let codes: std::collections::HashSet<u64> =
            ExchangeMode::ALL.iter().map(|m| m.code()).collect();
        assert_eq!(codes.len(), 4);
        let a = Lasp2Layout {
            b: 4,
            h: 16,
            dk: 128,
            dv: 128,
        };
        let up = Chain::Ascending;
        assert_ne!(a.fingerprint(4, up), a.fingerprint(2, up));
        assert_ne!(
            a.fingerprint(4, up),
            Lasp2Layout { h: 8, ..a }.fingerprint(4, up)
        );
        assert_ne!(a.fingerprint(4, up), a.fingerprint(4, Chain::Descending));
        assert_eq!(a.fingerprint(4, up), a.fingerprint(4, up));
    }
}
