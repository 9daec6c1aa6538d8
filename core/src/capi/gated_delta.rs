//! `LASP_FAMILY_GATED_DELTA`: the delta rule with a log-decay and a write strength per token and
//! head, on one GPU ([`GatedDeltaForward`], [`GatedDeltaBackward`]) or across the ranks
//! ([`GatedDeltaLasp2Forward`], [`GatedDeltaLasp2Backward`]).

use super::abi::Dtype::{Bf16, F32, I32};
use super::abi::Slot;
use super::documents::{with_documents, FinalStates};
use super::families::{chains_symmetric_bytes, AbiFamily, Direction, FamilyOp};
use super::pairs::{AbiCall, Lasp2Pair, SingleGpuPair};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{DocumentStates, Gates, Offsets, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::family::Family;
use crate::ops::gated_delta::{
    GatedDelta, GatedDeltaArgs, GatedDeltaBackward, GatedDeltaBackwardArgs, GatedDeltaForward,
    GatedDeltaLasp2Backward, GatedDeltaLasp2Forward,
};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

static SINGLE_GPU_FORWARD: [SlotUse; 10] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::Beta, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, DocumentStates),
];

/// The single-GPU forward's slots, and the state this rank's shard starts from (h0 folded with
/// the earlier ranks' summaries), which the backward starts from.
static LASP2_FORWARD: [SlotUse; 11] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::Beta, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::StartState, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, DocumentStates),
];

static SINGLE_GPU_BACKWARD: [SlotUse; 15] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::Beta, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::Dg, Output, F32, Gates),
    SlotUse::new(Slot::Dbeta, Output, F32, Gates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

/// The single-GPU backward's slots, starting from the state the forward saved on this rank
/// instead of the sequence's initial state. dht is given on the last rank only and dh0 written on
/// rank 0 only: the LASP-2 op refuses either elsewhere with a message naming the rank.
static LASP2_BACKWARD: [SlotUse; 15] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::Beta, Input, F32, Gates),
    SlotUse::new(Slot::StartState, Input, F32, State),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::Dg, Output, F32, Gates),
    SlotUse::new(Slot::Dbeta, Output, F32, Gates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

impl AbiFamily for GatedDelta {
    fn name(&self) -> &'static str {
        <Self as Family>::NAME
    }

    fn check(&self, spec: &OpSpec) -> Result<()> {
        <GatedDelta as Family>::validate_layout(&spec.layout)
    }

    fn slots(&self, spec: &OpSpec, direction: Direction) -> &'static [SlotUse] {
        match (spec.kind, direction) {
            (Kind::SingleGpu, Direction::Forward) => &SINGLE_GPU_FORWARD,
            (Kind::SingleGpu, Direction::Backward) => &SINGLE_GPU_BACKWARD,
            (Kind::Lasp2 { .. }, Direction::Forward) => &LASP2_FORWARD,
            (Kind::Lasp2 { .. }, Direction::Backward) => &LASP2_BACKWARD,
        }
    }

    fn lasp2_symmetric_bytes(&self, spec: &OpSpec, npes: usize) -> u64 {
        chains_symmetric_bytes::<GatedDelta>(spec, npes)
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        with_documents(
            runtime,
            FinalStates::GatedDelta {
                lasp2: matches!(spec.kind, Kind::Lasp2 { .. }),
            },
            || match spec.kind {
                Kind::SingleGpu => Ok(SingleGpuPair::boxed(
                    GatedDeltaForward::new(runtime)?,
                    spec.with_backward
                        .then(|| GatedDeltaBackward::new(runtime))
                        .transpose()?,
                )),
                Kind::Lasp2 { mode } => Lasp2Pair::boxed(
                    GatedDeltaLasp2Forward::new(runtime, spec.layout, mode)?,
                    spec.with_backward
                        .then_some(|| GatedDeltaLasp2Backward::new(runtime, spec.layout, mode)),
                ),
            },
        )
    }
}

/// The forward's views of a checked call.
fn forward_args<'a>(call: &mut CheckedCall<'a>) -> GatedDeltaArgs<'a> {
    GatedDeltaArgs {
        shape: call.shape,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        g: call.input(Slot::G),
        beta: call.input(Slot::Beta),
        h0: call.optional_input(Slot::H0),
        o: call.output(Slot::O),
        ht: call.optional_output(Slot::Ht),
        scale: call.scale,
    }
}

/// The backward's views of a checked call, starting from the state in `start`.
fn backward_args<'a>(call: &mut CheckedCall<'a>, start: Slot) -> GatedDeltaBackwardArgs<'a> {
    GatedDeltaBackwardArgs {
        shape: call.shape,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        g: call.input(Slot::G),
        beta: call.input(Slot::Beta),
        h0: call.optional_input(start),
        d_o: call.input(Slot::DO),
        dht: call.optional_input(Slot::Dht),
        dq: call.output(Slot::Dq),
        dk: call.output(Slot::Dk),
        dv: call.output(Slot::Dv),
        dg: call.output(Slot::Dg),
        dbeta: call.output(Slot::Dbeta),
        dh0: call.optional_output(Slot::Dh0),
        scale: call.scale,
    }
}

impl AbiCall for GatedDeltaForward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, forward_args(&mut call)).map(|_plan| ())
    }
}

impl AbiCall for GatedDeltaBackward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, backward_args(&mut call, Slot::H0))
            .map(|_plan| ())
    }
}

impl AbiCall for GatedDeltaLasp2Forward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let start_state = call.optional_output(Slot::StartState);
        let args = forward_args(&mut call);
        self.forward_saving(stream, args, start_state)
            .map(|_plan| ())
    }
}

impl AbiCall for GatedDeltaLasp2Backward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.backward(stream, backward_args(&mut call, Slot::StartState))
            .map(|_plan| ())
    }
}
