//! `LASP_FAMILY_MLSTM`: xLSTM's matrix LSTM with mlstm_kernels' gradient, on one GPU
//! ([`MlstmForward`], [`MlstmBackward`]) or across the ranks ([`MlstmLasp2Forward`],
//! [`MlstmLasp2Backward`]).
//!
//! Its gates are two pre-activations per token and head: the input gate in `LASP_SLOT_I_GATE`,
//! the forget gate in `LASP_SLOT_G` (their gradients in `LASP_SLOT_DI_GATE` and `LASP_SLOT_DG`).
//! A state is `(C, n, m)` in one fp32 tensor ([`Layout::MlstmState`]); the forward saves every
//! token's stabiliser and denominator for the backward (`LASP_SLOT_SAVED_ROWS`), and with LASP-2
//! the states entering and leaving this rank's shard (`LASP_SLOT_START_STATE`,
//! `LASP_SLOT_EXIT_STATE`). The final state's gradient is `dC_T` alone (`LASP_SLOT_DHT`, [B, H,
//! Dk, Dv]), as is the initial state's (`LASP_SLOT_DH0`): under this gradient n and m get none.
//! Packed documents (`LASP_SLOT_CU_SEQLENS`) go to the ops, whose kernels mask at the starts; the
//! forwards also write each document's final state where `LASP_SLOT_DOCUMENT_HT` is given
//! ([`Layout::MlstmDocumentStates`]: C, n and m of every document back to back).

use super::abi::Dtype::{Bf16, F32, I32};
use super::abi::Slot;
use super::args::invalid;
use super::families::{chains_symmetric_bytes, AbiFamily, Direction, FamilyOp};
use super::pairs::{AbiCall, Lasp2Pair, SingleGpuPair};
use super::spec::{Kind, OpSpec};
use super::tensors::Layout::{
    Gates, MlstmDocumentStates, MlstmState, Offsets, Qk, SavedRows, State, V,
};
use super::tensors::Role::{Input, OptionalInput, OptionalOutput, Output};
use super::tensors::{CheckedCall, SlotUse};
use crate::error::Result;
use crate::family::Family;
use crate::ops::mlstm::{
    Mlstm, MlstmArgs, MlstmBackward, MlstmBackwardArgs, MlstmBoundaryMut, MlstmBoundaryRef,
    MlstmFinalCotangent, MlstmForward, MlstmLasp2Backward, MlstmLasp2Forward, MlstmSavedMut,
    MlstmSavedRef, MlstmStateMut, MlstmStateRef,
};
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{DeviceMut, DeviceRef};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

static SINGLE_GPU_FORWARD: [SlotUse; 11] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::IGate, Input, F32, Gates),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, MlstmState),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, MlstmState),
    SlotUse::new(Slot::SavedRows, OptionalOutput, F32, SavedRows),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, MlstmDocumentStates),
];

/// The single-GPU forward's slots, and the states entering and leaving this rank's shard, which
/// the backward takes.
static LASP2_FORWARD: [SlotUse; 13] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::IGate, Input, F32, Gates),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, MlstmState),
    SlotUse::new(Slot::O, Output, Bf16, V),
    SlotUse::new(Slot::Ht, OptionalOutput, F32, MlstmState),
    SlotUse::new(Slot::SavedRows, OptionalOutput, F32, SavedRows),
    SlotUse::new(Slot::StartState, OptionalOutput, F32, MlstmState),
    SlotUse::new(Slot::ExitState, OptionalOutput, F32, MlstmState),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
    SlotUse::new(Slot::DocumentHt, OptionalOutput, F32, MlstmDocumentStates),
];

/// The forward's inputs and saved rows, the final state (its m) where DHT is given.
static SINGLE_GPU_BACKWARD: [SlotUse; 17] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::IGate, Input, F32, Gates),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::H0, OptionalInput, F32, MlstmState),
    SlotUse::new(Slot::Ht, OptionalInput, F32, MlstmState),
    SlotUse::new(Slot::SavedRows, Input, F32, SavedRows),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::DIGate, Output, F32, Gates),
    SlotUse::new(Slot::Dg, Output, F32, Gates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

/// As on one GPU, from the states the forward wrote on this rank instead of H0 and HT; DHT on the
/// last rank only and DH0 on rank 0 only (the op refuses either elsewhere, naming the rank).
static LASP2_BACKWARD: [SlotUse; 17] = [
    SlotUse::new(Slot::Q, Input, Bf16, Qk),
    SlotUse::new(Slot::K, Input, Bf16, Qk),
    SlotUse::new(Slot::V, Input, Bf16, V),
    SlotUse::new(Slot::IGate, Input, F32, Gates),
    SlotUse::new(Slot::G, Input, F32, Gates),
    SlotUse::new(Slot::StartState, Input, F32, MlstmState),
    SlotUse::new(Slot::ExitState, Input, F32, MlstmState),
    SlotUse::new(Slot::SavedRows, Input, F32, SavedRows),
    SlotUse::new(Slot::DO, Input, Bf16, V),
    SlotUse::new(Slot::Dht, OptionalInput, F32, State),
    SlotUse::new(Slot::Dq, Output, Bf16, Qk),
    SlotUse::new(Slot::Dk, Output, Bf16, Qk),
    SlotUse::new(Slot::Dv, Output, Bf16, V),
    SlotUse::new(Slot::DIGate, Output, F32, Gates),
    SlotUse::new(Slot::Dg, Output, F32, Gates),
    SlotUse::new(Slot::Dh0, OptionalOutput, F32, State),
    SlotUse::new(Slot::CuSeqlens, OptionalInput, I32, Offsets),
];

impl AbiFamily for Mlstm {
    fn name(&self) -> &'static str {
        <Self as Family>::NAME
    }

    fn check(&self, spec: &OpSpec) -> Result<()> {
        <Mlstm as Family>::validate_layout(&spec.layout)
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
        chains_symmetric_bytes::<Mlstm>(spec, npes)
    }

    fn create(&self, runtime: &Runtime, spec: &OpSpec) -> Result<Box<dyn FamilyOp>> {
        match spec.kind {
            Kind::SingleGpu => Ok(SingleGpuPair::boxed(
                MlstmForward::new(runtime)?,
                spec.with_backward
                    .then(|| MlstmBackward::new(runtime))
                    .transpose()?,
            )),
            Kind::Lasp2 { mode } => Lasp2Pair::boxed(
                MlstmLasp2Forward::new(runtime, spec.layout, mode)?,
                spec.with_backward
                    .then_some(|| MlstmLasp2Backward::new(runtime, spec.layout, mode)),
            ),
        }
    }
}

/// The pieces of a [`MlstmState`] tensor, read.
fn state_ref<'a>(x: DeviceRef<'a, f32>, s: &ForwardShape) -> MlstmStateRef<'a> {
    let (c, rest) = x.split_at(s.state_len());
    let (n, m) = rest.split_at(s.b * s.h * s.dk);
    MlstmStateRef { c, n, m }
}

/// The pieces of a [`MlstmState`] tensor, written.
fn state_mut<'a>(x: DeviceMut<'a, f32>, s: &ForwardShape) -> MlstmStateMut<'a> {
    let (c, rest) = x.split_at(s.state_len());
    let (n, m) = rest.split_at(s.b * s.h * s.dk);
    MlstmStateMut { c, n, m }
}

/// The pieces of a [`MlstmDocumentStates`] tensor (one state per document), written.
fn document_states_mut<'a>(x: DeviceMut<'a, f32>, s: &ForwardShape) -> MlstmStateMut<'a> {
    // B * N * H states of Dk * Dv + Dk + 1 elements (checked against the offsets).
    let states = x.len() / (s.dk * s.dv + s.dk + 1);
    let (c, rest) = x.split_at(states * s.dk * s.dv);
    let (n, m) = rest.split_at(states * s.dk);
    MlstmStateMut { c, n, m }
}

/// The forward's views of a checked call.
fn forward_args<'a>(call: &mut CheckedCall<'a>) -> MlstmArgs<'a> {
    let s = call.shape;
    MlstmArgs {
        shape: s,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        i_gate: call.input(Slot::IGate),
        f_gate: call.input(Slot::G),
        initial_state: call.optional_input(Slot::H0).map(|x| state_ref(x, &s)),
        h: call.output(Slot::O),
        final_state: call.optional_output(Slot::Ht).map(|x| state_mut(x, &s)),
        saved: call.optional_output(Slot::SavedRows).map(|x| {
            let (m, den) = x.split_at(s.gate_len());
            MlstmSavedMut { m, den }
        }),
        scale: call.scale,
        eps: None,
        documents: call.documents(),
        document_final_states: call
            .optional_output(Slot::DocumentHt)
            .map(|x| document_states_mut(x, &s)),
    }
}

/// The backward's views of a checked call; `initial_state` and the final state's stabiliser
/// come from the direction's own slots.
fn backward_args<'a>(
    call: &mut CheckedCall<'a>,
    initial_state: Option<MlstmStateRef<'a>>,
    m_t: Option<DeviceRef<'a, f32>>,
) -> Result<MlstmBackwardArgs<'a>> {
    let s = call.shape;
    let d_c = call.optional_input(Slot::Dht);
    let d_final =
        match (d_c, m_t) {
            (Some(d_c), Some(m)) => Some(MlstmFinalCotangent { d_c, m }),
            (Some(_), None) => return Err(invalid(
                "LASP_SLOT_DHT is given but LASP_SLOT_HT is empty: the mLSTM backward takes the \
                 final state's stabiliser from it; pass the final state the forward wrote"
                    .into(),
            )),
            (None, _) => None,
        };
    let (m, den) = call.input(Slot::SavedRows).split_at(s.gate_len());
    Ok(MlstmBackwardArgs {
        shape: s,
        q: call.input(Slot::Q),
        k: call.input(Slot::K),
        v: call.input(Slot::V),
        i_gate: call.input(Slot::IGate),
        f_gate: call.input(Slot::G),
        initial_state,
        saved: MlstmSavedRef { m, den },
        d_h: call.input(Slot::DO),
        d_final,
        dq: call.output(Slot::Dq),
        dk: call.output(Slot::Dk),
        dv: call.output(Slot::Dv),
        d_i_gate: call.output(Slot::DIGate),
        d_f_gate: call.output(Slot::Dg),
        d_initial_c: call.optional_output(Slot::Dh0),
        scale: call.scale,
        documents: call.documents(),
    })
}

impl AbiCall for MlstmForward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        self.launch(stream, forward_args(&mut call)).map(|_plan| ())
    }
}

impl AbiCall for MlstmBackward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let s = call.shape;
        let initial = call.optional_input(Slot::H0).map(|x| state_ref(x, &s));
        let m_t = call.optional_input(Slot::Ht).map(|x| state_ref(x, &s).m);
        let args = backward_args(&mut call, initial, m_t)?;
        self.launch(stream, args).map(|_plan| ())
    }
}

impl AbiCall for MlstmLasp2Forward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let s = call.shape;
        let entry = call.optional_output(Slot::StartState);
        let exit = call.optional_output(Slot::ExitState);
        let boundary = match (entry, exit) {
            (Some(entry), Some(exit)) => Some(MlstmBoundaryMut {
                entry: state_mut(entry, &s),
                exit: state_mut(exit, &s),
            }),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "the mLSTM LASP-2 forward writes LASP_SLOT_START_STATE and \
                     LASP_SLOT_EXIT_STATE together (the backward reads both); fill both, or \
                     neither where no backward follows"
                        .into(),
                ))
            }
        };
        let args = forward_args(&mut call);
        self.forward_saving(stream, args, boundary).map(|_plan| ())
    }
}

impl AbiCall for MlstmLasp2Backward {
    fn call(&mut self, stream: &Arc<CudaStream>, mut call: CheckedCall<'_>) -> Result<()> {
        let s = call.shape;
        let boundary = MlstmBoundaryRef {
            entry: state_ref(call.input(Slot::StartState), &s),
            exit: state_ref(call.input(Slot::ExitState), &s),
        };
        let args = backward_args(&mut call, None, Some(boundary.exit.m))?;
        self.backward(stream, args, boundary).map(|_plan| ())
    }
}
