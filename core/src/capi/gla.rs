//! `LASP_FAMILY_GLA`: linear attention with a log-decay per key dimension, on one GPU
//! ([`GlaForward`], [`GlaBackward`]) or across the ranks ([`GlaLasp2Forward`],
//! [`GlaLasp2Backward`]).

use super::abi::Dtype::{Bf16, F32};
use super::abi::Slot;
use super::families::{AbiFamily, Direction, FamilyOp};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{ChunkStates, KeyGates, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::exchange::ExchangeMode;
use crate::family::Family;
use crate::ops::gla::{
    Gla, GlaArgs, GlaBackward, GlaBackwardArgs, GlaForward, GlaLasp2Backward, GlaLasp2Forward,
};
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

/// The forward's slots with the backward, on one GPU and across the ranks: also the state entering
/// every chunk of the rank's tokens, which the backward reads instead of recomputing it (across
/// the ranks these states already hold the earlier ranks' prefix, so the backward needs no start
/// state). Optional: a forward that no backward follows, such as inference, leaves it empty and
/// writes nothing more.
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

/// The backward's slots, on one GPU and across the ranks: the forward's inputs, the chunk states
/// it saved on this rank, the gradients of its outputs and the gradients to write. Across the
/// ranks, dht is given on the last rank only and dh0 written on rank 0 only: the LASP-2 op
/// refuses either elsewhere with a message naming the rank, which the call returns as it is.
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
        // The backward's chain has buffers of the same layout as the forward's.
        let chains = if spec.with_backward { 2 } else { 1 };
        chains * spec.layout.symmetric_bytes::<Gla>(npes) as u64
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        match spec.kind {
            Kind::SingleGpu => Ok(Box::new(SingleGpu {
                forward: GlaForward::new(runtime)?,
                backward: spec
                    .with_backward
                    .then(|| GlaBackward::new(runtime))
                    .transpose()?,
            })),
            Kind::Lasp2 { mode } => {
                let forward = GlaLasp2Forward::new(runtime, spec.layout, mode)?;
                if !spec.with_backward {
                    return Ok(Box::new(Lasp2 {
                        forward,
                        backward: None,
                    }));
                }
                match GlaLasp2Backward::new(runtime, spec.layout, mode) {
                    Ok(backward) => Ok(Box::new(Lasp2 {
                        forward,
                        backward: Some(backward),
                    })),
                    Err(error) => {
                        // What makes the backward fail (its layout, kernels or symmetric heap)
                        // is the same on every rank, so every rank frees the forward's
                        // symmetric buffers here together.
                        forward.free()?;
                        Err(error)
                    }
                }
            }
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

/// A shard of every sequence on each rank: one state chain per direction.
struct Lasp2 {
    forward: GlaLasp2Forward,
    backward: Option<GlaLasp2Backward>,
}

impl FamilyOp for Lasp2 {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.forward.forward(stream, forward_args(&mut call))
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
        backward.backward(stream, backward_args(&mut call))
    }

    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.forward.set_mode(mode)?;
        match &mut self.backward {
            Some(backward) => backward.set_mode(mode),
            None => Ok(()),
        }
    }

    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.forward.finish(stream)?;
        match &self.backward {
            Some(backward) => backward.finish(stream),
            None => Ok(()),
        }
    }

    fn note_replayed_calls(&mut self, forward: u64, backward: u64) {
        self.forward.note_replayed_calls(forward);
        if let Some(op) = &mut self.backward {
            op.note_replayed_calls(backward);
        }
    }

    /// Frees both chains (collective), the backward's even where the forward's free failed.
    fn free(self: Box<Self>) -> Result<()> {
        let forward = self.forward.free();
        let backward = self.backward.map_or(Ok(()), GlaLasp2Backward::free);
        forward.and(backward)
    }
}
