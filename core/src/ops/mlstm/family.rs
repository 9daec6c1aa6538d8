//! mLSTM as a [`Family`]: its summary tile (C, n, the stabiliser m and the log forget sum F) and
//! the kernels of its exchange.

use super::plan::validate;
use super::Lasp2Params;
use crate::error::Result;
use crate::exchange::Lasp2Layout;
use crate::family::{params_with_exchange_fields, ExchangeFields, Family, FamilyKind};
use crate::ops::scalar_decay::ForwardShape;
use lasp_shmem_kernels::params as header;

/// xLSTM's matrix LSTM: the summary is the stabilised state `(C, n, m)` the shard reaches from the
/// empty state and its summed log forget gate `F`, folded by rescaling both states to the larger
/// stabiliser (`lasp/mlstm/fold.cuh`).
#[derive(Clone, Copy, Debug)]
pub struct Mlstm;

impl Family for Mlstm {
    const KIND: FamilyKind = FamilyKind::Mlstm;
    const NAME: &'static str = "mLSTM";
    type Lasp2Params = Lasp2Params;
    const SUMMARY_KERNEL: &'static str = "lasp_mlstm_lasp2_summary";
    const ADVANCE_EPOCH_KERNEL: &'static str = "lasp_mlstm_lasp2_advance_epoch";
    const GRANT_CREDITS_KERNEL: &'static str = "lasp_mlstm_lasp2_grant_credits";
    const SUMMARY_THREADS: u32 = header::LASP_MLSTM_LASP2_THREADS;
    const RELAYS_PREFIX: bool = true;

    /// `lasp_mlstm_lasp2_tile_floats`: C's `[Dk][64]` block, n's Dk floats, m, F and two of
    /// padding.
    fn summary_tile_floats(layout: &Lasp2Layout) -> u64 {
        let dk = layout.dk as u64;
        dk * (header::LASP2_TILE_V as u64 + 1) + 4
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
