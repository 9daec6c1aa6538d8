//! `LASP_FAMILY_GLA`: linear attention with a log-decay per key dimension, on one GPU
//! ([`GlaForward`], [`GlaBackward`]) or across the ranks ([`GlaLasp2Forward`],
//! [`GlaLasp2Backward`]); packed documents (`LASP_SLOT_CU_SEQLENS`) go to the ops, whose kernels
//! mask at the starts.

use super::abi::Dtype::{Bf16, F32, I32};
use super::abi::Slot;
use super::families::{chains_symmetric_bytes, AbiFamily, Direction, FamilyOp};
use super::pairs::{AbiCall, Lasp2Pair, SingleGpuPair};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{ChunkStates, DocumentStates, KeyGates, Offsets, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::family::Family;
use crate::ops::gla::{
    Gla, GlaArgs, GlaBackward, GlaBackwardArgs, GlaForward, GlaLasp2Backward, GlaLasp2Forward,
};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The forward's slots, on one GPU and across the ranks (h0 is the sequence's initial state on
/// every rank; ht only on the last).
static FORWARD: [SlotUse; 9] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, KeyGates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, DocumentStates),
];

/// The forward's slots with the backward, on one GPU and across the ranks: also the state entering
/// every chunk of the rank's tokens, which the backward reads instead of recomputing it (across
/// the ranks these states already hold the earlier ranks' prefix, so the backward needs no start
/// state). Optional: a forward that no backward follows, such as inference, leaves it empty and
/// writes nothing more.
static SAVING_FORWARD: [SlotUse; 10] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, KeyGates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::ChunkStates, OptionalOutput, Bf16, ChunkStates),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, DocumentStates),
];

/// The backward's slots, on one GPU and across the ranks: the forward's inputs, the chunk states
/// it saved on this rank, the gradients of its outputs and the gradients to write. Across the
/// ranks, dht is given on the last rank only and dh0 written on rank 0 only: the LASP-2 op
/// refuses either elsewhere with a message naming the rank, which the call returns as it is.
static BACKWARD: [SlotUse; 14] = [
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
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

impl AbiFamily for Gla {
    fn name(&self) -> &'static str {
        <Self as Family>::NAME
    }

    fn check(&self, spec: &OpSpec) -> Result<()> {
        <Gla as Family>::validate_layout(&spec.layout)
    }

    fn slots(&self, spec: &OpSpec, direction: Direction) -> &'static [SlotUse] {
        // The same slots on one GPU and across the ranks: only the ops' checks of dht, dh0 and
        // ht differ (which ranks may pass them).
        match (spec.with_backward, direction) {
            (false, Direction::Forward) => &FORWARD,
            (true, Direction::Forward) => &SAVING_FORWARD,
            (true, Direction::Backward) => &BACKWARD,
            // plan_call refuses a backward call of an op created without the backward.
            (false, Direction::Backward) => &[],
        }
    }

    fn lasp2_symmetric_bytes(&self, spec: &OpSpec, npes: usize) -> u64 {
        chains_symmetric_bytes::<Gla>(spec, npes)
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        match spec.kind {
            Kind::SingleGpu => Ok(SingleGpuPair::boxed(
                GlaForward::new(runtime)?,
                spec.with_backward
                    .then(|| GlaBackward::new(runtime))
                    .transpose()?,
            )),
            Kind::Lasp2 { mode } => Lasp2Pair::boxed(
                GlaLasp2Forward::new(runtime, spec.layout, mode)?,
                spec.with_backward
                    .then_some(|| GlaLasp2Backward::new(runtime, spec.layout, mode)),
            ),
        }
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
        documents: call.documents(),
        document_ht: call.optional_output(Slot::DocumentHt),
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
        documents: call.documents(),
    }
}

impl AbiCall for GlaForward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, forward_args(&mut call)).map(|_plan| ())
    }
}

impl AbiCall for GlaBackward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, backward_args(&mut call))
            .map(|_plan| ())
    }
}

impl AbiCall for GlaLasp2Forward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.forward(stream, forward_args(&mut call))
    }
}

impl AbiCall for GlaLasp2Backward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.backward(stream, backward_args(&mut call))
    }
}
