//! The families of linear attention behind `lasp_op`: what a family declares (its shape limits,
//! the slots each direction reads and writes, its symmetric memory) and the operation it makes.
//! Everything else (struct sizes, reserved fields, codes, slots, dtypes, element counts, device
//! pointers, streams) is checked once, for every family, before a family sees a call.
//!
//! A new family implements [`AbiFamily`] (on the same type that implements
//! [`crate::family::Family`]) in a module of its own, where its ops take checked calls
//! ([`super::pairs::AbiCall`]) and [`AbiFamily::create`] pairs them ([`super::pairs`]), and adds
//! one arm to [`family`].

use super::abi::{
    LASP_FAMILY_GATED_DELTA, LASP_FAMILY_GLA, LASP_FAMILY_MLSTM, LASP_FAMILY_SCALAR_DECAY,
};
use super::args::{invalid, this_library};
use super::spec::OpSpec;
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::exchange::ExchangeMode;
use crate::ops::gated_delta::GatedDelta;
use crate::ops::gla::Gla;
use crate::ops::mlstm::Mlstm;
use crate::ops::scalar_decay::ScalarDecay;
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The family of a `LASP_FAMILY_*` code: the one place a new family is added.
pub(super) fn family(code: i32) -> Result<&'static dyn AbiFamily> {
    match code {
        LASP_FAMILY_SCALAR_DECAY => Ok(&ScalarDecay),
        LASP_FAMILY_GLA => Ok(&Gla),
        LASP_FAMILY_GATED_DELTA => Ok(&GatedDelta),
        LASP_FAMILY_MLSTM => Ok(&Mlstm),
        0 => Err(invalid(
            "desc.family is 0; set it to a LASP_FAMILY_* value (LASP_FAMILY_SCALAR_DECAY)".into(),
        )),
        other => Err(invalid(format!(
            "desc.family {other} is not a LASP_FAMILY_* value of {}; the families are \
             LASP_FAMILY_SCALAR_DECAY (1), LASP_FAMILY_GLA (2), LASP_FAMILY_GATED_DELTA (3), \
             LASP_FAMILY_MLSTM (4)",
            this_library()
        ))),
    }
}

/// Which call of an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Direction {
    Forward,
    Backward,
}

impl Direction {
    /// The entry point of this direction, which messages name.
    pub(super) fn entry_point(self) -> &'static str {
        match self {
            Direction::Forward => "lasp_op_forward",
            Direction::Backward => "lasp_op_backward",
        }
    }

    pub(super) fn other(self) -> Direction {
        match self {
            Direction::Forward => Direction::Backward,
            Direction::Backward => Direction::Forward,
        }
    }
}

/// Symmetric bytes per rank of a LASP-2 op of family `F` and `spec` on `npes` ranks: one state
/// chain's, twice with the backward (whose chain has buffers of the same layout).
pub(super) fn chains_symmetric_bytes<F: crate::family::Family>(spec: &OpSpec, npes: usize) -> u64 {
    let chains = if spec.with_backward { 2 } else { 1 };
    chains * spec.layout.symmetric_bytes::<F>(npes) as u64
}

/// A family of linear attention: a stateless description that makes operations.
pub(super) trait AbiFamily: Sync {
    /// How messages name the family.
    fn name(&self) -> &'static str;

    /// Fails where the family's kernels do not support the descriptor's layout (the generic
    /// checks of [`OpSpec::of`] have passed).
    fn check(&self, spec: &OpSpec) -> Result<()>;

    /// The slots a call of `direction` reads and writes; every other slot must be empty.
    fn slots(&self, spec: &OpSpec, direction: Direction) -> &'static [SlotUse];

    /// Symmetric bytes per rank of a LASP-2 op of `spec` on `npes` ranks.
    fn lasp2_symmetric_bytes(&self, spec: &OpSpec, npes: usize) -> u64;

    /// Makes the operation (collective for LASP-2), with the runtime's context current.
    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>>;
}

/// An operation of one family, kind and layout, forward and (where created with it) backward.
/// Calls arrive checked: every slot of [`AbiFamily::slots`] that must be given is, with the right
/// dtype and element count, on the runtime's GPU.
pub(super) trait FamilyOp: Send {
    fn forward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()>;

    /// Only called on an op created with the backward.
    fn backward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()>;

    /// Switches every rank to `mode` (collective). The default is a single-GPU op's answer: it
    /// exchanges nothing, so it has no mode.
    fn set_mode(&mut self, _mode: ExchangeMode) -> Result<()> {
        Err(invalid(
            "lasp_op_set_mode: a LASP_KIND_SINGLE_GPU op exchanges nothing, so it has no mode; \
             modes are for LASP_KIND_LASP2 ops"
                .into(),
        ))
    }

    /// Times the exchange modes (and the launch plans that keep the bits) on `call` of
    /// `direction`, switches every rank's op of that direction to the fastest and returns its
    /// mode (collective). The default is a single-GPU op's answer: it has no mode.
    fn plan(
        &mut self,
        _runtime: &Runtime,
        _stream: &Arc<CudaStream>,
        _direction: Direction,
        _call: CheckedCall<'_>,
    ) -> Result<ExchangeMode> {
        Err(invalid(
            "lasp_op_plan: a LASP_KIND_SINGLE_GPU op exchanges nothing, so it has no mode to \
             plan; the planner is for LASP_KIND_LASP2 ops"
                .into(),
        ))
    }

    /// Synchronises `stream` and reports an expired wait of an earlier call (a single-GPU op
    /// waits for nothing else).
    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        Ok(stream.synchronize()?)
    }

    /// Counts calls replayed from captured CUDA graphs (a single-GPU op picks nothing on the
    /// host by call parity, so it counts nothing).
    fn note_replayed_calls(&mut self, _forward: u64, _backward: u64) {}

    /// Releases the operation (collective for LASP-2; a single-GPU op frees its workspaces when
    /// dropped, after a context synchronisation).
    fn free(self: Box<Self>) -> Result<()> {
        drop(self);
        Ok(())
    }
}
