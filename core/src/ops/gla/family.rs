//! GLA as a [`Family`]: its summary tile (M, Λ per key dimension) and the kernels of its exchange.

use super::plan::validate;
use super::Lasp2Params;
use crate::error::Result;
use crate::exchange::Lasp2Layout;
use crate::family::{params_with_exchange_fields, ExchangeFields, Family, FamilyKind};
use crate::ops::scalar_decay::ForwardShape;
use lasp_shmem_kernels::{instances, params as header};

/// Gated linear attention with a log-decay per key dimension: the summary is the shard's end
/// state from zero M and its log-decay Λ in R^Dk, folded as `diag(e^Λ) P + M`.
#[derive(Clone, Copy, Debug)]
pub struct Gla;

impl Family for Gla {
    const KIND: FamilyKind = FamilyKind::Gla;
    const NAME: &'static str = "GLA";
    type Lasp2Params = Lasp2Params;
    const SUMMARY_KERNEL: &'static str = instances::GLA_LASP2_SUMMARY;
    const ADVANCE_EPOCH_KERNEL: &'static str = "lasp_gla_lasp2_advance_epoch";
    const GRANT_CREDITS_KERNEL: &'static str = "lasp_gla_lasp2_grant_credits";
    const SUMMARY_THREADS: u32 = header::LASP_GLA_LASP2_SUMMARY_THREADS;
    const RELAYS_PREFIX: bool = true;

    /// `lasp_gla_lasp2_tile_floats`: M's `[Dk][64]` block and Λ's Dk floats.
    fn summary_tile_floats(layout: &Lasp2Layout) -> u64 {
        let dk = layout.dk as u64;
        dk * header::LASP2_TILE_V as u64 + dk
    }

    fn validate_layout(layout: &Lasp2Layout) -> Result<()> {
        validate(&ForwardShape {
            b: layout.b,
            t: 1,
            h: layout.h,
            dk: layout.dk,
            dv: layout.dv,
        })
    }

    fn lasp2_params(f: ExchangeFields) -> Lasp2Params {
        params_with_exchange_fields!(Lasp2Params, f)
    }
}
