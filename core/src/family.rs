//! Model families: the host side of what differs between linear-RNN families in LASP-2. A family
//! implements [`Family`] in its own folder under `ops/` (scalar decay:
//! [`ScalarDecay`](crate::ops::scalar_decay::ScalarDecay)); the exchange
//! (`exchange::chain::StateChain`), its schedules, epochs, credits, modes, bounded waits
//! and diagnostics are generic over it. The shard summaries per family
//! (kernels/docs/maths.md, "LASP-2"):
//!
//! | family | summary that crosses GPUs | fold of the prefix P |
//! |---|---|---|
//! | scalar decay | M [Dk x Dv], Λ | e^Λ P + M |
//! | GLA | M, Λ \[Dk\] | diag(e^Λ) P + M |
//! | Gated DeltaNet | A [Dk x Dk], b [Dk x Dv] | A P + b |
//! | mLSTM | C, n \[Dk\], stabiliser m, log forget sum F | both rescaled to max(F + m_P, m), added |

use crate::error::Result;
use crate::exchange::Lasp2Layout;

/// The families the C ABI and the layout fingerprint know, by code (`LASP_FAMILY_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FamilyKind {
    ScalarDecay = 1,
    Gla = 2,
    GatedDeltaNet = 3,
    Mlstm = 4,
}

/// The exchange fields of a family's LASP-2 parameter struct: the ones
/// `lasp/exchange/chain_params.h` lists, which the exchange's device code reads. The exchange
/// fills them; the family fills the rest (its tensors, its workspace, its shapes).
#[derive(Clone, Copy, Debug, Default)]
pub struct ExchangeFields {
    pub slots: u64,
    pub signals: u64,
    pub credit: u64,
    pub epoch: u64,
    pub diag: u64,
    /// The emulated links' device struct, or 0 for the real links.
    pub link: u64,
    pub timeout_ns: u64,
    pub b: i32,
    pub h: i32,
    pub dk: i32,
    pub dv: i32,
    pub me: i32,
    pub npes: i32,
    pub exchange_mode: i32,
    pub chain: i32,
}

/// A family's LASP-2 params struct `$params` (generated from its header, whose exchange fields
/// carry the names `lasp/exchange/chain_params.h` lists) with the exchange's fields from the
/// [`ExchangeFields`] `$fields` and every other field zero (NULL): the body of every
/// [`Family::lasp2_params`].
macro_rules! params_with_exchange_fields {
    ($params:path, $fields:expr) => {{
        let f: $crate::family::ExchangeFields = $fields;
        // Device addresses into the struct's pointer fields.
        $params {
            slots: f.slots as _,
            signals: f.signals as _,
            credit: f.credit as _,
            epoch: f.epoch as _,
            diag: f.diag as _,
            link: f.link as _,
            timeout_ns: f.timeout_ns,
            B: f.b,
            H: f.h,
            Dk: f.dk,
            Dv: f.dv,
            me: f.me,
            npes: f.npes,
            exchange_mode: f.exchange_mode,
            chain: f.chain,
            ..Default::default()
        }
    }};
}
pub(crate) use params_with_exchange_fields;

/// One family's side of LASP-2 on the host.
pub trait Family {
    /// Its code in the C ABI and the layout fingerprint.
    const KIND: FamilyKind;
    /// Its name in messages ("scalar decay").
    const NAME: &'static str;
    /// The C parameter struct its LASP-2 kernels take (by value).
    type Lasp2Params: Copy;
    /// The kernel that computes the PE's summary tile into its own slot and publishes it
    /// (the schedule's `send_credits` and `publish`), per (Dv tile, head).
    const SUMMARY_KERNEL: &'static str;
    /// `lasp::exchange::advance_epoch` for its params struct.
    const ADVANCE_EPOCH_KERNEL: &'static str;
    /// `lasp::exchange::grant_credits` for its params struct.
    const GRANT_CREDITS_KERNEL: &'static str;
    /// Threads per CTA of the summary kernel.
    const SUMMARY_THREADS: u32;
    /// Whether its summary kernel relays the prefix under the pipelined chain
    /// ([`ExchangeMode::PipelinedChain`](crate::exchange::ExchangeMode::PipelinedChain): folds
    /// its own summary into the tile its predecessor sent, with the schedule's
    /// `relayed_prefix`) and its consumers start from h0 only where the schedule says so.
    const RELAYS_PREFIX: bool;

    /// Floats of one summary tile (one head, 64 Dv columns) of `layout`, a multiple of 4.
    fn summary_tile_floats(layout: &Lasp2Layout) -> u64;

    /// Checks that the family's kernels support `layout`.
    fn validate_layout(layout: &Lasp2Layout) -> Result<()>;

    /// Its params struct with the exchange's fields set and everything else zero (NULL).
    fn lasp2_params(fields: ExchangeFields) -> Self::Lasp2Params;
}
