//! `LASP_FAMILY_SCALAR_DECAY`: linear attention with one log-decay per token and head, on one GPU
//! ([`ScalarDecayForward`], [`ScalarDecayBackward`]) or across the ranks ([`Lasp2Forward`],
//! [`Lasp2Backward`]).

use super::abi::Dtype::{Bf16, F32, I32};
use super::abi::Slot;
use super::args::invalid;
use super::documents::{with_documents, FinalStates};
use super::families::{chains_symmetric_bytes, AbiFamily, Direction, FamilyOp};
use super::pairs::{AbiCall, Lasp2Pair, SingleGpuPair};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{DocumentStates, Gates, Offsets, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::family::Family;
use crate::ops::scalar_decay::lasp2::{Lasp2Backward, Lasp2Forward};
use crate::ops::scalar_decay::{
    BackwardArgs, ForwardArgs, ScalarDecay, ScalarDecayBackward, ScalarDecayForward,
};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

static SINGLE_GPU_FORWARD: [SlotUse; 9] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, DocumentStates),
];

/// The single-GPU forward's slots, and the state this rank's shard starts from.
static LASP2_FORWARD: [SlotUse; 10] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::StartState, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, DocumentStates),
];

static SINGLE_GPU_BACKWARD: [SlotUse; 13] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::Dg, Output, F32, Gates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

/// The single-GPU backward's slots, starting from the state the forward saved on this rank
/// instead of the sequence's initial state.
static LASP2_BACKWARD: [SlotUse; 13] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::StartState, Input, F32, State),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::Dg, Output, F32, Gates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

impl AbiFamily for ScalarDecay {
    fn name(&self) -> &'static str {
        <Self as Family>::NAME
    }

    fn check(&self, spec: &OpSpec) -> Result<()> {
        <ScalarDecay as Family>::validate_layout(&spec.layout)?;
        let dv = spec.layout.dv;
        if spec.with_backward && dv != 64 && dv != 128 {
            return Err(invalid(format!(
                "scalar decay: the backward takes Dv 64 or 128 (its dq and dk passes use Dv as \
                 their key width), not desc.dv = {dv}; split v into blocks of 64 or 128 columns \
                 with one op each, or create a forward-only op (no LASP_OP_WITH_BACKWARD)"
            )));
        }
        Ok(())
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
        chains_symmetric_bytes::<ScalarDecay>(spec, npes)
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        with_documents(
            runtime,
            FinalStates::ScalarDecay {
                lasp2: matches!(spec.kind, Kind::Lasp2 { .. }),
            },
            || match spec.kind {
                Kind::SingleGpu => Ok(SingleGpuPair::boxed(
                    ScalarDecayForward::new(runtime)?,
                    spec.with_backward
                        .then(|| ScalarDecayBackward::new(runtime))
                        .transpose()?,
                )),
                Kind::Lasp2 { mode } => Lasp2Pair::boxed(
                    Lasp2Forward::new(runtime, spec.layout, mode)?,
                    spec.with_backward
                        .then_some(|| Lasp2Backward::new(runtime, spec.layout, mode)),
                ),
            },
        )
    }
}

/// The forward's views of a checked call.
pub(super) fn forward_args<'a>(call: &mut CheckedCall<'a>) -> ForwardArgs<'a> {
    ForwardArgs {
        shape: call.shape,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        g: call.input(Slot::G),
        h0: call.optional_input(Slot::H0),
        o: call.output(Slot::O),
        ht: call.optional_output(Slot::Ht),
        scale: call.scale,
    }
}

/// The backward's views of a checked call, starting from the state in `start`.
fn backward_args<'a>(call: &mut CheckedCall<'a>, start: Slot) -> BackwardArgs<'a> {
    BackwardArgs {
        shape: call.shape,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        g: call.input(Slot::G),
        h0: call.optional_input(start),
        d_o: call.input(Slot::DO),
        d_ht: call.optional_input(Slot::Dht),
        dq: call.output(Slot::Dq),
        dk: call.output(Slot::Dk),
        dv: call.output(Slot::Dv),
        dg: call.output(Slot::Dg),
        dh0: call.optional_output(Slot::Dh0),
        scale: call.scale,
    }
}

impl AbiCall for ScalarDecayForward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, forward_args(&mut call)).map(|_plan| ())
    }
}

impl AbiCall for ScalarDecayBackward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, backward_args(&mut call, Slot::H0))
    }
}

impl AbiCall for Lasp2Forward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let start_state = call.optional_output(Slot::StartState);
        let args = forward_args(&mut call);
        self.forward_saving(stream, args, start_state)
    }
}

impl AbiCall for Lasp2Backward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.backward(stream, backward_args(&mut call, Slot::StartState))
    }
}
