//! LASP-2 of scalar-decay linear attention across PEs: the forward ([`Lasp2Forward`]) and the
//! backward ([`Lasp2Backward`]). Kernels: kernels/cuda/scalar_decay/lasp2_{forward,backward,
//! fold_put}.cu; the exchange they run on: [`crate::exchange`]; protocol: kernels/docs/lasp2.md.
//!
//! PE `w` holds the `w`-th slice of every sequence. Both directions are a chain
//! (`exchange::chain::StateChain`): every PE computes a tile per (b, h) from
//! its own shard alone, sends it (in [`ExchangeMode::Overlapped`], from the device, with a
//! signal) to the PEs after it on the chain, and folds the tiles of the PEs before it,
//! `X = e^{Λ_u} X + tile_u`. The forward's chain runs from PE 0 up (the prefix state entering each
//! shard); the backward's from the last PE down (the gradient with respect to the state leaving
//! each shard). The sequential modes replace the device puts by a host-driven all-gather between
//! the same kernels; [`ExchangeMode::NoComm`] drops the exchange (for timing). The fold and every
//! other operation are the same in every mode, so outputs are bit-identical across modes.

mod backward;
mod forward;

pub use backward::Lasp2Backward;
pub use forward::{Lasp2Forward, Lasp2Timeline, Lasp2Tuning};

pub use crate::exchange::{ExchangeMode, Lasp2Layout};

use super::geometry as sd;
use crate::kernel::LaunchShape;
use lasp_shmem_kernels::params as header;

/// The family's layout and launch formulas (`lasp/scalar_decay/lasp2_params.h`): its constants
/// (generated from it) and a port of its helpers.
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
    /// `lasp2_ws_m_bytes` (= `lasp2_ws_lambda_offset`).
    pub const fn ws_m_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * s as u64 * dk as u64 * dv as u64 * 4
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
}

/// The C struct `lasp_lasp2_params`, generated from its header, passed by value to every LASP-2
/// kernel. Pointer fields hold device addresses; NULL where a buffer is absent.
pub type Lasp2Params = header::lasp_lasp2_params;

/// One CTA of `LASP2_FOLD_THREADS` per (Dv tile, head) of a group of `heads`: the launch of the
/// forward's segment_prefix (the summary kernel's, which the exchange launches).
fn fold_launch(heads: i32, dv: i32) -> LaunchShape {
    LaunchShape {
        grid: crate::exchange::geometry::tile_grid(heads, dv),
        block: (geometry::FOLD_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_matches_the_worked_example_of_the_notes() {
        // ws_m 4,194,304 B + 64 Λ floats = 4,194,560 (16-aligned), then ws_p of ws_m's size.
        assert_eq!(geometry::ws_p_offset(4, 16, 1, 128, 128), 4_194_560);
        assert_eq!(geometry::workspace_bytes(4, 16, 1, 128, 128), 8_388_864);
        // 3 heads x 1 segment x 64 x 64 floats + 3 Λ floats = 49,164 B, rounded up to 49,168.
        assert_eq!(geometry::ws_p_offset(1, 3, 1, 64, 64), 49_168);
        assert_eq!(geometry::slot_tile_floats(64) * 4, 16_400);
        // Two staged tiles of 128 rows x 72 floats plus trailers.
        assert_eq!(geometry::carry_in_smem_bytes(128), 73_760);
    }
}
