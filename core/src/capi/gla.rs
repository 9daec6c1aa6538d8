//! `LASP_FAMILY_GLA`: linear attention with a log-decay per key dimension, forward only, on one
//! GPU ([`GlaForward`]) or across the ranks ([`GlaLasp2Forward`]).

use super::abi::Dtype::{Bf16, F32};
use super::abi::Slot;
use super::args::invalid;
use super::families::{AbiFamily, Direction, FamilyOp};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{KeyGates, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::exchange::ExchangeMode;
use crate::family::Family;
use crate::ops::gla::{Gla, GlaArgs, GlaForward, GlaLasp2Forward};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The forward's slots, on one GPU and across the ranks (h0 is the sequence's initial state on
/// every rank; ht only on the last).
static FORWARD: [SlotUse; 7] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, KeyGates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
];

impl AbiFamily for Gla {
    fn name(&self) -> &'static str {
        <Self as Family>::NAME
    }

    fn check(&self, spec: &OpSpec) -> Result<()> {
        <Gla as Family>::validate_layout(&spec.layout)?;
        if spec.with_backward {
            return Err(invalid(
                "GLA: this build has GLA's forward only; create the op without \
                 LASP_OP_WITH_BACKWARD (and compute the gradients elsewhere, e.g. fla's chunk_gla)"
                    .into(),
            ));
        }
        Ok(())
    }

    fn slots(&self, _spec: &OpSpec, direction: Direction) -> &'static [SlotUse] {
        match direction {
            Direction::Forward => &FORWARD,
            // check() refuses ops with the backward, so no backward call reaches a GLA op.
            Direction::Backward => &[],
        }
    }

    fn lasp2_symmetric_bytes(&self, spec: &OpSpec, npes: usize) -> u64 {
        spec.layout.symmetric_bytes::<Gla>(npes) as u64
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        Ok(match spec.kind {
            Kind::SingleGpu => Box::new(SingleGpu(GlaForward::new(runtime)?)),
            Kind::Lasp2 { mode } => {
                Box::new(Lasp2(GlaLasp2Forward::new(runtime, spec.layout, mode)?))
            }
        })
    }
}

/// The forward's views of a checked call.
fn forward_args<'a>(call: &mut CheckedCall<'a>) -> GlaArgs<'a> {
    GlaArgs {
        shape: call.shape,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        g: call.input(Slot::G),
        h0: call.optional_input(Slot::H0),
        o: call.output(Slot::O),
        ht: call.optional_output(Slot::Ht),
        chunk_states: None,
        scale: call.scale,
    }
}

const FORWARD_ONLY: &str =
    "GLA ops are created without the backward, so no backward call reaches one";

/// Whole sequences on one GPU.
struct SingleGpu(GlaForward);

impl FamilyOp for SingleGpu {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.0
            .launch(stream, forward_args(&mut call))
            .map(|_plan| ())
    }

    fn backward(&mut self, _stream: &Arc<CudaStream>, _call: CheckedCall<'_>) -> Result<()> {
        unreachable!("{FORWARD_ONLY}")
    }
}

/// A shard of every sequence on each rank.
struct Lasp2(GlaLasp2Forward);

impl FamilyOp for Lasp2 {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.0.forward(stream, forward_args(&mut call))
    }

    fn backward(&mut self, _stream: &Arc<CudaStream>, _call: CheckedCall<'_>) -> Result<()> {
        unreachable!("{FORWARD_ONLY}")
    }

    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.0.set_mode(mode)
    }

    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.0.finish(stream)
    }

    fn note_replayed_calls(&mut self, forward: u64, _backward: u64) {
        self.0.note_replayed_calls(forward);
    }

    /// Frees the chain's symmetric buffers (collective).
    fn free(self: Box<Self>) -> Result<()> {
        self.0.free()
    }
}
