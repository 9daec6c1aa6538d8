//! What every family's per-document final states share: the layout `[B, N, H, Dk, Dv]`
//! ([`document_states_len`]), the table that names, per chunk of 64 tokens, the document whose
//! state entering the chunk the family's chunk loop stores in that document's slot
//! (`lasp_document_entry_slots`), the launch of the family's states kernel, which adds the
//! document's tokens of its last chunk to that state (both in [`DocumentTails`]), and the checks
//! of a call's tensors.

use super::{check, DocumentStarts, Documents, GateShape};
use crate::error::{Error, Result};
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::{bf16, DeviceMut, DeviceRef};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::params::{lasp_document_states_params, LASP_DOCUMENT_STATES_THREADS};
use std::sync::Arc;

/// Elements of the final states of `documents` over `shape`: `B * N * H * Dk * Dv`.
pub fn document_states_len(shape: &ForwardShape, documents: &Documents<'_>) -> usize {
    let docs = documents.cu_seqlens.len().saturating_sub(1);
    shape.b * docs * shape.h * shape.dk * shape.dv
}

/// Where the chunk loops store the states the documents' final states start from, as device
/// addresses: per chunk the document whose slot takes the state entering it, or -1 (`slots`,
/// int32 `[ceil(T / 64)]`), and the slots (`states`, fp32 `[B, documents, H, Dk, Dv]`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DocumentEntries {
    pub(crate) slots: u64,
    pub(crate) states: u64,
    pub(crate) documents: usize,
}

/// What every family's final states of packed documents hold: the entry slots of its calls, in a
/// workspace of its own (grown on demand, freed after a context synchronisation when it is
/// dropped), and its states kernel (`lasp_document_states_params`,
/// `lasp/documents/final_states_params.h`), which adds each document's tokens of its last chunk to
/// the state the family's chunk loop stored on entering that chunk.
pub(crate) struct DocumentTails {
    ctx: Arc<CudaContext>,
    starts: DocumentStarts,
    slots: Option<CudaSlice<u8>>,
    /// Indexed by Dk: [64, 128].
    kernels: [Kernel; 2],
}

impl DocumentTails {
    /// `kernels`: the family's states kernel per Dk.
    pub(crate) fn new(runtime: &Runtime, kernels: [&'static str; 2]) -> Result<Self> {
        Ok(DocumentTails {
            ctx: runtime.context().clone(),
            starts: DocumentStarts::new(runtime)?,
            slots: None,
            kernels: runtime.module().kernels_per_width(kernels)?,
        })
    }

    /// Writes on `stream` the slots of `documents` for a shard of `t` tokens, and returns them
    /// with `states` (the call's checked output) as where the chunk loop stores. The caller orders
    /// `stream` after the offsets' buffer.
    pub(crate) fn entries(
        &mut self,
        stream: &Arc<CudaStream>,
        documents: Documents<'_>,
        t: usize,
        states: &DeviceMut<'_, f32>,
        op: &str,
    ) -> Result<DocumentEntries> {
        let bytes = (DocumentStarts::words_len(t) * std::mem::size_of::<i32>()) as u64;
        let slots = crate::ops::ensure_workspace(&self.ctx, stream, &mut self.slots, bytes, op)?;
        // SAFETY: the workspace holds one i32 per chunk of the shard (sized above), owned by self
        // and freed only after a context synchronisation; only this call's kernels, in stream
        // order, write and read it.
        unsafe { self.starts.entry_slots(stream, documents, t, slots) }?;
        Ok(DocumentEntries {
            slots,
            states: states.addr(),
            documents: documents.cu_seqlens.len() - 1,
        })
    }

    /// Enqueues the states kernel: one CTA per (document slot, b*H+h, 64 columns of Dv), a grid
    /// fixed by the capacity of `cu_seqlens`.
    ///
    /// # Safety
    /// `inputs` and `ht` were checked against the shape and the documents (lengths, alignment,
    /// overlaps), are of the runtime's context and stay live until the work on `stream`
    /// completes; the chunk loop that stores the entering states into `ht`, where the slots of
    /// [`DocumentTails::entries`] name them, was enqueued before on `stream`.
    pub(crate) unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &StatesInputs<'_>,
        ht: &DeviceMut<'_, f32>,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.enqueue(stream, inputs, ht, None) }
    }

    /// [`DocumentTails::launch`] for the mLSTM: `c` takes the states' C, `rest` their n and m.
    ///
    /// # Safety
    /// As [`DocumentTails::launch`]; `rest`'s tensors were checked alike, and the output loop
    /// enqueued before on `stream` stores the entering n into `rest.n` and the entering
    /// stabilisers at `rest.entry_m` (fp32 `[B, N, H]`, live until the work on `stream`
    /// completes).
    pub(crate) unsafe fn launch_stabilised(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &StatesInputs<'_>,
        c: &DeviceMut<'_, f32>,
        rest: &Stabilised<'_, '_>,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.enqueue(stream, inputs, c, Some(rest)) }
    }

    /// # Safety
    /// As [`DocumentTails::launch_stabilised`].
    unsafe fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &StatesInputs<'_>,
        ht: &DeviceMut<'_, f32>,
        stabilised: Option<&Stabilised<'_, '_>>,
    ) -> Result<()> {
        let (s, docs) = (inputs.shape, inputs.documents);
        let p = lasp_document_states_params {
            cu_seqlens: docs.cu_seqlens.addr() as _,
            offsets_are_int64: i32::from(docs.cu_seqlens.is_int64()),
            num_offsets: docs.cu_seqlens.len() as i32,
            shard_start: docs.shard_start as i64,
            k: inputs.k.addr() as _,
            v: inputs.v.addr() as _,
            g: inputs.g.addr() as _,
            beta: inputs.beta.map_or(0, |x| x.addr()) as _,
            ht: ht.addr() as _,
            i_gate: stabilised.map_or(0, |x| x.i_gate.addr()) as _,
            ht_n: stabilised.map_or(0, |x| x.n.addr()) as _,
            ht_m: stabilised.map_or(0, |x| x.m.addr()) as _,
            entry_m: stabilised.map_or(0, |x| x.entry_m) as _,
            B: s.b as i32,
            T: s.t as i32,
            H: s.h as i32,
            Dk: s.dk as i32,
            Dv: s.dv as i32,
        };
        let launch = LaunchShape {
            grid: (
                (docs.cu_seqlens.len() - 1) as u32,
                (s.b * s.h) as u32,
                (s.dv / 64) as u32,
            ),
            block: (LASP_DOCUMENT_STATES_THREADS, 1, 1),
            shared_bytes: 0,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: `p` is the kernels' lasp_document_states_params, generated from its header; the
        // caller's contract covers the tensors and the order after the entering states.
        unsafe { self.kernels[width_index(s.dk)].launch(stream, launch, &p) }
    }
}

/// The tensors every family's final states read and write, checked against the shard's `shape`:
/// k, v and the per-token `rows` (`[B, T, H]` fp32 each: log-decays, write strengths), the state
/// entering the shard `h0`, the documents, and `ht` `[B, N, H, Dk, Dv]`. Returns the checks for
/// more.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_final_states<'c>(
    op: &'c str,
    shape: &ForwardShape,
    documents: &Documents<'_>,
    k: DeviceRef<'_, bf16>,
    v: DeviceRef<'_, bf16>,
    rows: &[(&str, DeviceRef<'_, f32>)],
    h0: Option<DeviceRef<'_, f32>>,
    ht: &DeviceMut<'_, f32>,
) -> Result<TensorChecks<'c>> {
    let s = shape;
    s.validate()?;
    let gates = GateShape {
        b: s.b,
        t: s.t,
        h: s.h,
    };
    let checks = check(op, documents, gates)?;
    checks.tensor("k", "[B, T, H, Dk]", (k.len(), s.qk_len()), k.addr(), 16)?;
    checks.tensor("v", "[B, T, H, Dv]", (v.len(), s.v_len()), v.addr(), 16)?;
    let mut inputs = vec![("k", k.byte_range()), ("v", v.byte_range())];
    for (name, x) in rows {
        checks.tensor(name, "[B, T, H]", (x.len(), s.gate_len()), x.addr(), 4)?;
        inputs.push((name, x.byte_range()));
    }
    if let Some(h0) = &h0 {
        checks.tensor(
            "h0",
            "[B, H, Dk, Dv]",
            (h0.len(), s.state_len()),
            h0.addr(),
            8,
        )?;
        inputs.push(("h0", h0.byte_range()));
    }
    let want = document_states_len(s, documents);
    checks.tensor("ht", "[B, N, H, Dk, Dv]", (ht.len(), want), ht.addr(), 8)?;
    checks.disjoint(&inputs, &[("ht", ht.byte_range())])?;
    Ok(checks)
}

/// The documents of a call that gives per-document final states in `name` (`sequence_state`: the
/// argument for the whole sequence's final state instead), or the error that says they are missing.
pub(crate) fn documents_of_states<'d, 'a>(
    op: &str,
    name: &str,
    sequence_state: &str,
    documents: Option<&'d Documents<'a>>,
) -> Result<&'d Documents<'a>> {
    documents.ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{op}: {name} (one final state per packed document) is given without documents; \
             pass cu_seqlens, or use {sequence_state} for the sequence's final state"
        ))
    })
}

/// What a family's states kernel reads, checked by the caller against the shape and the
/// documents: the shard's keys, values and log-decays (`[B, T, H]`, GLA's `[B, T, H, Dk]`, the
/// mLSTM's forget-gate pre-activations) and, for Gated DeltaNet, its write strengths.
pub(crate) struct StatesInputs<'a> {
    pub(crate) shape: ForwardShape,
    pub(crate) documents: Documents<'a>,
    pub(crate) k: DeviceRef<'a, bf16>,
    pub(crate) v: DeviceRef<'a, bf16>,
    pub(crate) g: DeviceRef<'a, f32>,
    pub(crate) beta: Option<DeviceRef<'a, f32>>,
}

/// What the mLSTM's states kernel takes beyond the other families': its input-gate
/// pre-activations (`[B, T, H]` fp32; its forget gates' are [`StatesInputs::g`]), its states' n
/// (`[B, N, H, Dk]`, in: the entering ones, out: the final ones) and m (`[B, N, H]`, out), and
/// the device address of the stabilisers entering the chunks (fp32 `[B, N, H]`, a workspace the
/// output loop stores into).
pub(crate) struct Stabilised<'b, 'a> {
    pub(crate) i_gate: DeviceRef<'a, f32>,
    pub(crate) n: &'b DeviceMut<'a, f32>,
    pub(crate) m: &'b DeviceMut<'a, f32>,
    pub(crate) entry_m: u64,
}
