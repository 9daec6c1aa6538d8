//! Gated DeltaNet as a [`Family`]: its summary tile (the shard's affine map, b and A's column
//! blocks) and the kernels of its exchange.

use super::Lasp2Params;
use crate::error::Result;
use crate::exchange::Lasp2Layout;
use crate::family::{params_with_exchange_fields, ExchangeFields, Family, FamilyKind};
use crate::ops::scalar_decay::ForwardShape;
use lasp_shmem_kernels::{instances, params as header};

/// The delta rule with a scalar decay per token and head: the summary is the shard's affine map
/// `S_end = A S_start + b` (A `[Dk x Dk]`, b `[Dk x Dv]`), folded as `A P + b`.
#[derive(Clone, Copy, Debug)]
pub struct GatedDelta;

impl Family for GatedDelta {
    const KIND: FamilyKind = FamilyKind::GatedDeltaNet;
    const NAME: &'static str = "Gated DeltaNet";
    type Lasp2Params = Lasp2Params;
    const SUMMARY_KERNEL: &'static str = instances::GDN_LASP2_SUMMARY;
    const ADVANCE_EPOCH_KERNEL: &'static str = "lasp_gated_delta_lasp2_advance_epoch";
    const GRANT_CREDITS_KERNEL: &'static str = "lasp_gated_delta_lasp2_grant_credits";
    const SUMMARY_THREADS: u32 = header::LASP_GDN_FOLD_THREADS;
    const RELAYS_PREFIX: bool = true;

    /// `lasp_gdn_lasp2_tile_floats`: b's `[Dk][64]` block, then the tile's column blocks of A.
    fn summary_tile_floats(layout: &Lasp2Layout) -> u64 {
        let (dk, dv) = (layout.dk as u64, layout.dv as u64);
        (1 + (dk / 64).div_ceil(dv / 64)) * dk * 64
    }

    fn validate_layout(layout: &Lasp2Layout) -> Result<()> {
        ForwardShape {
            b: layout.b,
            t: 1,
            h: layout.h,
            dk: layout.dk,
            dv: layout.dv,
        }
        .validate_as("Gated DeltaNet LASP-2")
    }

    fn lasp2_params(f: ExchangeFields) -> Lasp2Params {
        params_with_exchange_fields!(Lasp2Params, f)
    }
}
