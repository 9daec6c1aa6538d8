//! Packed documents in the C ABI (`LASP_SLOT_CU_SEQLENS`, `lasp_call.shard_start`) for the
//! families whose state forgets through one log-decay per token and head (scalar decay, Gated
//! DeltaNet): [`with_documents`] wraps such a family's op, whatever its kind, so that a call
//! naming documents runs the op on the log-decays that forget at every document start
//! ([`crate::ops::documents`]), and a backward's dg is 0 there. A call without documents goes to
//! the op as it came. A forward that fills `LASP_SLOT_DOCUMENT_HT` gets the documents' final
//! states ([`FinalStates`]) after the op's kernels, from the same forgetting log-decays (scalar
//! decay's on one GPU from the forward itself).

use super::abi::Slot;
use super::args::invalid;
use super::families::{Direction, FamilyOp};
use super::scalar_decay::forward_args;
use super::tensors::CheckedCall;
use crate::error::Result;
use crate::exchange::ExchangeMode;
use crate::gpu::ContextSync;
use crate::ops::documents::Documents;
use crate::ops::documents::{DocumentStarts, GateShape};
use crate::ops::gated_delta::{GatedDeltaDocumentStates, GatedDeltaDocumentStatesArgs};
use crate::ops::scalar_decay::{DocumentStatesArgs, ScalarDecayDocumentStates};
use crate::ops::{ensure_workspace, DeviceMut, DeviceRef};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// How a family's documents get their final states (`LASP_SLOT_DOCUMENT_HT`, which only the
/// families with a kernel for them declare); a LASP-2 op starts them from the
/// `LASP_SLOT_START_STATE` its forward writes.
pub(super) enum FinalStates {
    /// Scalar decay's ([`ScalarDecayDocumentStates`]).
    ScalarDecay { lasp2: bool },
    /// Gated DeltaNet's ([`GatedDeltaDocumentStates`]).
    GatedDelta { lasp2: bool },
}

/// A family's final states of packed documents (one per op: the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum FinalStatesOp {
    ScalarDecay(ScalarDecayDocumentStates),
    GatedDelta(GatedDeltaDocumentStates),
}

impl FinalStatesOp {
    /// The final states of the documents into `ht` after the op's forward, from the views of the
    /// call's inputs in `after` (the log-decays the forgetting ones), from `h0`.
    fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        after: &mut CheckedCall<'_>,
        documents: Documents<'_>,
        h0: Option<DeviceRef<'_, f32>>,
        ht: DeviceMut<'_, f32>,
    ) -> Result<()> {
        let shape = after.shape;
        let (k, v, g) = (
            after.input(Slot::K),
            after.input(Slot::V),
            after.input(Slot::G),
        );
        match self {
            FinalStatesOp::ScalarDecay(op) => op.launch(
                stream,
                DocumentStatesArgs {
                    shape,
                    k,
                    v,
                    g,
                    h0,
                    documents,
                    ht,
                },
            ),
            FinalStatesOp::GatedDelta(op) => op.launch(
                stream,
                GatedDeltaDocumentStatesArgs {
                    shape,
                    k,
                    v,
                    g,
                    beta: after.input(Slot::Beta),
                    h0,
                    documents,
                    ht,
                },
            ),
        }
    }
}

/// The op `make` makes (collective for LASP-2), taking packed documents in its calls. What the
/// documents need is made first, so that nothing is left to free when it fails.
pub(super) fn with_documents(
    runtime: &Runtime,
    final_states: FinalStates,
    make: impl FnOnce() -> Result<Box<dyn FamilyOp>>,
) -> Result<Box<dyn FamilyOp>> {
    let starts = DocumentStarts::new(runtime)?;
    let final_states = match final_states {
        FinalStates::ScalarDecay { lasp2 } => (
            FinalStatesOp::ScalarDecay(ScalarDecayDocumentStates::new(runtime)?),
            lasp2,
        ),
        FinalStates::GatedDelta { lasp2 } => (
            FinalStatesOp::GatedDelta(GatedDeltaDocumentStates::new(runtime)?),
            lasp2,
        ),
    };
    Ok(Box::new(Packed {
        _calls_done: ContextSync(runtime.context().clone()),
        op: make()?,
        starts,
        final_states,
        context: runtime.context().clone(),
        gates: None,
    }))
}

struct Packed {
    /// First: every call finishes before the workspace below is released.
    _calls_done: ContextSync,
    op: Box<dyn FamilyOp>,
    starts: DocumentStarts,
    /// The documents' final states, and whether they start from the op's start state (LASP-2).
    final_states: (FinalStatesOp, bool),
    context: Arc<CudaContext>,
    /// The forgetting log-decays of the latest call, grown on demand.
    gates: Option<CudaSlice<u8>>,
}

/// What a call over documents may not hold: states per document are not built.
const UNSUPPORTED: [(Slot, &str); 4] = [
    (Slot::H0, "an initial state"),
    (Slot::Ht, "a final state"),
    (Slot::Dht, "the final state's gradient"),
    (Slot::Dh0, "the initial state's gradient"),
];

impl Packed {
    /// Runs `run` on `call`, over the forgetting log-decays where the call names documents, and
    /// clears a backward's dg at the document starts after it. A forward of one GPU that asks for
    /// the documents' final states runs instead the forward that writes the block states they
    /// start from, where `fused` gives what `run` would have returned.
    fn around<R>(
        &mut self,
        stream: &Arc<CudaStream>,
        direction: Direction,
        mut call: CheckedCall<'_>,
        run: impl FnOnce(&mut dyn FamilyOp, CheckedCall<'_>) -> Result<R>,
        fused: Option<R>,
    ) -> Result<R> {
        let Some(docs) = call.documents() else {
            return run(self.op.as_mut(), call);
        };
        let entry = direction.entry_point();
        if let Some((slot, what)) = UNSUPPORTED.iter().find(|(slot, _)| call.is_given(*slot)) {
            return Err(invalid(format!(
                "{entry}: {} is given with LASP_SLOT_CU_SEQLENS, but per-document states are not \
                 supported yet (every document starts from the zero state); leave {} ({what}) \
                 empty",
                slot.name(),
                slot.name()
            )));
        }
        let wants_states = direction == Direction::Forward && call.is_given(Slot::DocumentHt);
        let from_start_state = self.final_states.1;
        if wants_states && from_start_state && !call.is_given(Slot::StartState) {
            return Err(invalid(format!(
                "{entry}: LASP_SLOT_DOCUMENT_HT is given on a LASP-2 op without \
                 LASP_SLOT_START_STATE: the documents' final states start from the state \
                 entering this rank's tokens, which the forward writes there; give it a \
                 [B, H, Dk, Dv] fp32 buffer"
            )));
        }
        let s = call.shape;
        let shape = GateShape {
            b: s.b,
            t: s.t,
            h: s.h,
        };
        let len = s.gate_len();
        let bytes = (len * std::mem::size_of::<f32>()) as u64;
        let addr = ensure_workspace(&self.context, stream, &mut self.gates, bytes, entry)?;
        // SAFETY: the workspace holds `len` fp32 of this GPU (sized above); self owns it and
        // waits for the whole context before growing it (ensure_workspace) or freeing it
        // (_calls_done), so it outlives the kernels of this call, and only this call's kernels,
        // in stream order, write and read it.
        let forgetting = unsafe { DeviceMut::<f32>::from_raw(addr, len) };
        // The caller's gates, from a copy of the call: the op takes the slot, redirected.
        let gates = call.again().input(Slot::G);
        self.starts
            .forgetting_gates(stream, docs, gates, forgetting, shape)?;
        // SAFETY: as above; the gates are written before the op's kernels read them (one stream).
        unsafe { call.redirect_input(Slot::G, addr) };
        let mut after = call.again();
        if let (true, false, FinalStatesOp::ScalarDecay(states), Some(done)) = (
            wants_states,
            from_start_state,
            &mut self.final_states.0,
            fused,
        ) {
            // One GPU, scalar decay: the forward itself stores the states the final states start
            // from.
            // SAFETY: the op never saw this call, so no other view of its outputs exists.
            let ht = unsafe { after.output_again::<f32>(Slot::DocumentHt) }
                .expect("LASP_SLOT_DOCUMENT_HT was given");
            states.launch_forward(stream, forward_args(&mut call), docs, ht)?;
            return Ok(done);
        }
        let result = run(self.op.as_mut(), call)?;
        if wants_states {
            // SAFETY: the op's views of the call's tensors were dropped when it returned; the
            // start state (written by the op's kernels before these, in stream order) is read
            // through its only view.
            let h0 =
                unsafe { after.output_again::<f32>(Slot::StartState) }.filter(|_| from_start_state);
            // SAFETY: the op declares the slot but never takes a view of it.
            let ht = unsafe { after.output_again::<f32>(Slot::DocumentHt) }
                .expect("LASP_SLOT_DOCUMENT_HT was given");
            let h0 = h0.as_ref().map(DeviceMut::reader);
            self.final_states
                .0
                .launch(stream, &mut after, docs, h0, ht)?;
        }
        if direction == Direction::Backward {
            // SAFETY: the op's views of the call's tensors were dropped when it returned.
            if let Some(dg) = unsafe { after.output_again::<f32>(Slot::Dg) } {
                self.starts.clear_start_gradients(stream, docs, dg, shape)?;
            }
        }
        Ok(result)
    }
}

impl FamilyOp for Packed {
    fn forward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()> {
        self.around(
            stream,
            Direction::Forward,
            call,
            |op, call| op.forward(stream, call),
            Some(()),
        )
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()> {
        self.around(
            stream,
            Direction::Backward,
            call,
            |op, call| op.backward(stream, call),
            None,
        )
    }

    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.op.set_mode(mode)
    }

    fn plan(
        &mut self,
        runtime: &Runtime,
        stream: &Arc<CudaStream>,
        direction: Direction,
        call: CheckedCall<'_>,
    ) -> Result<ExchangeMode> {
        self.around(
            stream,
            direction,
            call,
            |op, call| op.plan(runtime, stream, direction, call),
            None,
        )
    }

    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }

    fn note_replayed_calls(&mut self, forward: u64, backward: u64) {
        self.op.note_replayed_calls(forward, backward);
    }

    fn free(self: Box<Self>) -> Result<()> {
        self.op.free()
    }
}
