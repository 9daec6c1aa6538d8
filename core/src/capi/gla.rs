//! `LASP_FAMILY_GLA`: linear attention with a log-decay per key dimension, on one GPU
//! ([`GlaForward`], [`GlaBackward`]) or, forward only, across the ranks ([`GlaLasp2Forward`]).

use super::abi::Dtype::{Bf16, F32};
use super::abi::Slot;
use super::args::invalid;
use super::families::{AbiFamily, Direction, FamilyOp};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{ChunkStates, KeyGates, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::exchange::ExchangeMode;
use crate::family::Family;
use crate::ops::gla::{Gla, GlaArgs, GlaBackward, GlaBackwardArgs, GlaForward, GlaLasp2Forward};
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

/// The forward's slots on one GPU with the backward: also the state entering every chunk, which
/// the backward reads instead of recomputing it (optional: a forward that no backward follows,
/// such as inference, leaves it empty and writes nothing more).
static SAVING_FORWARD: [SlotUse; 8] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, KeyGates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::ChunkStates, OptionalOutput, Bf16, ChunkStates),
];

/// The single-GPU backward's slots: the forward's inputs, the chunk states it saved, the
/// gradients of its outputs and the gradients to write.
static BACKWARD: [SlotUse; 13] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, KeyGates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::ChunkStates, Input, Bf16, ChunkStates),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::Dg, Output, F32, KeyGates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
];

impl AbiFamily for Gla {
    fn name(&self) -> &'static str {
        <Self as Family>::NAME
    }

    fn check(&self, spec: &OpSpec) -> Result<()> {
        <Gla as Family>::validate_layout(&spec.layout)?;
        if spec.with_backward && matches!(spec.kind, Kind::Lasp2 { .. }) {
            return Err(invalid(
                "GLA: this build has GLA's backward on one GPU only; create the LASP_KIND_LASP2 \
                 op without LASP_OP_WITH_BACKWARD (forward only, e.g. for prefill), or train on \
                 whole sequences with a LASP_KIND_SINGLE_GPU op"
                    .into(),
            ));
        }
        Ok(())
    }

    fn slots(&self, spec: &OpSpec, direction: Direction) -> &'static [SlotUse] {
        match (spec.with_backward, direction) {
            (false, Direction::Forward) => &FORWARD,
            // check() lets only single-GPU ops have the backward.
            (true, Direction::Forward) => &SAVING_FORWARD,
            (true, Direction::Backward) => &BACKWARD,
            // plan_call refuses a backward call of an op created without the backward.
            (false, Direction::Backward) => &[],
        }
    }

    fn lasp2_symmetric_bytes(&self, spec: &OpSpec, npes: usize) -> u64 {
        spec.layout.symmetric_bytes::<Gla>(npes) as u64
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        Ok(match spec.kind {
            Kind::SingleGpu => Box::new(SingleGpu {
                forward: GlaForward::new(runtime)?,
                backward: spec
                    .with_backward
                    .then(|| GlaBackward::new(runtime))
                    .transpose()?,
            }),
            Kind::Lasp2 { mode } => {
                Box::new(Lasp2(GlaLasp2Forward::new(runtime, spec.layout, mode)?))
            }
        })
    }
}

/// The forward's views of a checked call (the chunk states where the slot is declared and
/// given).
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
        chunk_states: call.optional_output(Slot::ChunkStates),
        scale: call.scale,
    }
}

/// The backward's views of a checked call.
fn backward_args<'a>(call: &mut CheckedCall<'a>) -> GlaBackwardArgs<'a> {
    GlaBackwardArgs {
        shape: call.shape,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        g: call.input(Slot::G),
        h0: call.optional_input(Slot::H0),
        chunk_states: call.input(Slot::ChunkStates),
        d_o: call.input(Slot::DO),
        dht: call.optional_input(Slot::Dht),
        dq: call.output(Slot::Dq),
        dk: call.output(Slot::Dk),
        dv: call.output(Slot::Dv),
        dg: call.output(Slot::Dg),
        dh0: call.optional_output(Slot::Dh0),
        scale: call.scale,
    }
}

const CREATED_WITH_BACKWARD: &str = "lasp_op_backward runs only on ops created with the backward";

/// Whole sequences on one GPU.
struct SingleGpu {
    forward: GlaForward,
    backward: Option<GlaBackward>,
}

impl FamilyOp for SingleGpu {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let args = forward_args(&mut call);
        self.forward.launch(stream, args).map(|_plan| ())
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
        backward
            .launch(stream, backward_args(&mut call))
            .map(|_plan| ())
    }
}

/// A shard of every sequence on each rank.
struct Lasp2(GlaLasp2Forward);

impl FamilyOp for Lasp2 {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.0.forward(stream, forward_args(&mut call))
    }

    fn backward(&mut self, _stream: &Arc<CudaStream>, _call: CheckedCall<'_>) -> Result<()> {
        // check() refuses LASP-2 GLA ops with the backward, and plan_call refuses backward
        // calls of ops without it.
        unreachable!("LASP-2 GLA ops are created without the backward")
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
