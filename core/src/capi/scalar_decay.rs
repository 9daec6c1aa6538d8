//! `LASP_FAMILY_SCALAR_DECAY`: linear attention with one log-decay per token and head, on one GPU
//! ([`ScalarDecayForward`], [`ScalarDecayBackward`]) or across the ranks ([`Lasp2Forward`],
//! [`Lasp2Backward`]).

use super::abi::Dtype::{Bf16, F32};
use super::abi::Slot;
use super::args::invalid;
use super::families::{AbiFamily, Direction, FamilyOp};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{Gates, Qk, State, V};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::family::Family;
use crate::ops::scalar_decay::lasp2::{ExchangeMode, Lasp2Backward, Lasp2Forward};
use crate::ops::scalar_decay::{
    BackwardArgs, ForwardArgs, ScalarDecay, ScalarDecayBackward, ScalarDecayForward,
};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

static SINGLE_GPU_FORWARD: [SlotUse; 7] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
];

/// The single-GPU forward's slots, and the state this rank's shard starts from.
static LASP2_FORWARD: [SlotUse; 8] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, State),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, State),
    SlotUse::new(Slot::StartState, OptionalOutput, F32, State),
];

static SINGLE_GPU_BACKWARD: [SlotUse; 12] = [
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
];

/// The single-GPU backward's slots, starting from the state the forward saved on this rank
/// instead of the sequence's initial state.
static LASP2_BACKWARD: [SlotUse; 12] = [
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
        // The backward's chain has buffers of the same layout as the forward's.
        let chains = if spec.with_backward { 2 } else { 1 };
        chains * spec.layout.symmetric_bytes::<ScalarDecay>(npes) as u64
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        match spec.kind {
            Kind::SingleGpu => Ok(Box::new(SingleGpu {
                forward: ScalarDecayForward::new(runtime)?,
                backward: spec
                    .with_backward
                    .then(|| ScalarDecayBackward::new(runtime))
                    .transpose()?,
            })),
            Kind::Lasp2 { mode } => {
                let forward = Lasp2Forward::new(runtime, spec.layout, mode)?;
                if !spec.with_backward {
                    return Ok(Box::new(Lasp2 {
                        forward,
                        backward: None,
                    }));
                }
                match Lasp2Backward::new(runtime, spec.layout, mode) {
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

/// The forward's views of a checked call.
fn forward_args<'a>(call: &mut CheckedCall<'a>) -> ForwardArgs<'a> {
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

const CREATED_WITH_BACKWARD: &str = "lasp_op_backward runs only on ops created with the backward";

/// Whole sequences on one GPU.
struct SingleGpu {
    forward: ScalarDecayForward,
    backward: Option<ScalarDecayBackward>,
}

impl FamilyOp for SingleGpu {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let args = forward_args(&mut call);
        self.forward.launch(stream, args).map(|_plan| ())
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
        backward.launch(stream, backward_args(&mut call, Slot::H0))
    }
}

/// A shard of every sequence on each rank: one state chain per direction.
struct Lasp2 {
    forward: Lasp2Forward,
    backward: Option<Lasp2Backward>,
}

impl FamilyOp for Lasp2 {
    fn forward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let start_state = call.optional_output(Slot::StartState);
        let args = forward_args(&mut call);
        self.forward.forward_saving(stream, args, start_state)
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
        backward.backward(stream, backward_args(&mut call, Slot::StartState))
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
        let backward = self.backward.map_or(Ok(()), Lasp2Backward::free);
        forward.and(backward)
    }
}
