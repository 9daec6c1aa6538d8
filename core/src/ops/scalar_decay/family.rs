//! Scalar decay as a [`Family`]: its summary tile (M, Λ) and the kernels of its exchange.

use super::lasp2::{geometry, Lasp2Params};
use super::ForwardShape;
use crate::error::Result;
use crate::exchange::Lasp2Layout;
use crate::family::{params_with_exchange_fields, ExchangeFields, Family, FamilyKind};
use lasp_shmem_kernels::instances;

/// Scalar-decay linear attention (simple GLA, RetNet, Lightning): one log-decay per token and
/// head; the summary is the shard's end state from zero M and its log-decay Λ, folded as
/// `e^Λ P + M`.
#[derive(Clone, Copy, Debug)]
pub struct ScalarDecay;

impl Family for ScalarDecay {
    const KIND: FamilyKind = FamilyKind::ScalarDecay;
    const NAME: &'static str = "scalar decay";
    type Lasp2Params = Lasp2Params;
    const SUMMARY_KERNEL: &'static str = instances::SD_LASP2_SUMMARY;
    const ADVANCE_EPOCH_KERNEL: &'static str = "lasp_lasp2_advance_epoch";
    const GRANT_CREDITS_KERNEL: &'static str = "lasp_lasp2_grant_credits";
    const SUMMARY_THREADS: u32 = geometry::FOLD_THREADS;
    const RELAYS_PREFIX: bool = true;

    fn summary_tile_floats(layout: &Lasp2Layout) -> u64 {
        geometry::slot_tile_floats(layout.dk as i32)
    }

    fn validate_layout(layout: &Lasp2Layout) -> Result<()> {
        ForwardShape {
            b: layout.b,
            t: 1,
            h: layout.h,
            dk: layout.dk,
            dv: layout.dv,
        }
        .validate()
    }

    fn lasp2_params(f: ExchangeFields) -> Lasp2Params {
        params_with_exchange_fields!(Lasp2Params, f)
    }
}
