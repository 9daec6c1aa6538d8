//! The mLSTM's LASP-2 forward and backward (`ops::mlstm::MlstmLasp2Forward`,
//! `MlstmLasp2Backward`) on every GPU under `lasp-run`.
//!
//! ```text
//! lasp-run -n 2 mlstm_lasp2                            # the checks
//! lasp-run -n 4 mlstm_lasp2 --no-check --time 4x8192x16x128 --time 8x2048x16x128 --json out.json
//! lasp-run -n 4 mlstm_lasp2 --no-check --plan --time 8x2048x16x128 --json planned.json
//! lasp-run -n 4 mlstm_lasp2 --no-check --with-backward --time 4x8192x16x128 --json fb.json
//! ```
//!
//! Checks (every PE): the whole sequence's inputs from the f64 reference's generator
//! (`reference::mlstm::MlstmInputs`, q, k, v rounded to bf16, the gates and the initial state to
//! f32), cut into shards of unequal length (one of a single token, ragged chunks); this PE's h
//! against the reference's stabilised recurrence of the whole sequence (relative error <= 5e-3;
//! the final state's C, n and m on the last PE; a token whose normaliser cancels beyond 1e4,
//! `normaliser_conditioning`, is held apart to 5e-3 + kappa 2^-16 and takes no cotangent), in
//! every exchange mode, each mode's outputs
//! bitwise equal to the overlapped mode's, a repeated call and `--graph-calls` replays of a
//! captured overlapped call bitwise equal; outputs poisoned before each call. Then the backward
//! (mlstm_kernels' gradient) from the boundary states and saved rows the forward wrote, with dh
//! and (where the case asks) dC_T from the reference's generator: dq, dk, dv and PE 0's dC_0
//! against the reference's `recurrent_backward` of the whole sequence (relative error <= 5e-3),
//! the gate pre-activations' gradients against the terms' scale (`MlstmGrads::gate_grad_scale`
//! of the whole sequence, 5e-3), every mode, a repeat and the graph replays bitwise equal. The
//! gate regimes
//! are the reference's: typical gates, input gates of hundreds (the stabiliser jumps across
//! shards), forget gates near zero. Packed documents (`cu_seqlens`): the same checks over shards
//! of about 320 tokens holding documents of 1, 63, 64 and 65 tokens, one ending on a shard
//! boundary, one of a whole shard or spanning three (int32 offsets), and of 1 to 200 tokens in
//! turn (int64, typical and large input gates, and forced segments), against each document's
//! own recurrence and gradient (`packed_recurrent_forward`, `packed_recurrent_backward`; the gate
//! gradients against the documents' scale), the forget gate's gradient exactly 0 at every
//! start, every document's final state from the forward (`MlstmArgs::document_final_states`:
//! C, n and m of each document that ends in the shard within 5e-3, every other slot +0, in the
//! bits every mode and replay must repeat), the graph captured while the offsets held one
//! document and replayed after they were written. One line per case and PE; exit status 1 when any check failed. Timing (`--time BxTxHxD`, T per GPU): the modes in turns (`time_in_turns`), the row is
//! the slowest rank's median; with `--with-backward` a timed call is a training step's, the
//! forward saving what the backward reads, then the backward. `--plan`: the planner (`exchange::planner`) chooses the mode first,
//! and its choice is timed in turns with the modes (`planner_ms`, `planner_choice`).
//! `--packed-cost`: packed documents' cost instead (`lasp-run -n 4 mlstm_lasp2 --no-check
//! --packed-cost --time 1x32768x16x128 --json cost.json`): a training step and the forward alone
//! on documents of 64 to 8192 tokens (log-uniform) against the same tokens as whole sequences,
//! in turns, overlapped mode; the row is the slowest rank's median of each; then the packed
//! forward with every document's final state against it without, in turns (rank 0's medians).

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::{ExchangeMode, Lasp2Layout};
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::documents::{DocumentStarts, Documents};
use lasp_shmem::ops::mlstm::{
    Mlstm, MlstmArgs, MlstmBackwardArgs, MlstmBoundaryMut, MlstmBoundaryRef, MlstmFinalCotangent,
    MlstmLasp2Backward, MlstmLasp2Forward, MlstmSavedMut, MlstmSavedRef, MlstmStateMut,
    MlstmStateRef,
};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::mlstm::{
    normaliser_conditioning, packed_normaliser_conditioning, packed_recurrent_backward,
    packed_recurrent_forward, recurrent_backward, recurrent_forward, MlstmCotangents,
    MlstmGradient, MlstmInputs, MlstmPackedInputs, MlstmRegime, MlstmSpec, MlstmState,
};
use lasp_shmem::reference::{assert_close_to_scale, rel_err, Cotangents, Shape, Tensor};
use lasp_shmem::reference::{ReferenceError, SplitMix64};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::documents::{
    boundary_documents, mixed_documents, one_document, padded_offsets, starts_in_shard, Offsets,
    PackedCost, SPARE_OFFSETS,
};
use lasp_shmem_examples::grad_bits::qkv_rows;
use lasp_shmem_examples::graph_replay::{replay, replay_after, Outputs};
use lasp_shmem_examples::mode_bits::bits_in_every_mode;
use lasp_shmem_examples::{
    bf16_bits, bf16_values, bf16s, f32_bits, f32_values, f32s, lasp2_config, main_under_launcher,
    mode_of, mode_times, parse_shape, planner_choice, round, run_cases, shard_lengths, shard_rows,
    short_documents, time_in_turns, time_modes_and_plan, time_shapes, write_json, ModeCall,
    ModeRow, NamedCase, PlannerTimes,
};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(name = "mlstm_lasp2")]
struct Options {
    /// Time these per-GPU shapes (BxTxHxD, T per GPU) in every mode.
    #[arg(long = "time", value_name = "BxTxHxD", value_parser = parse_shape)]
    time: Vec<ForwardShape>,
    /// Skip the checks.
    #[arg(long)]
    no_check: bool,
    /// Graph replays of one captured overlapped call in each check.
    #[arg(long, default_value_t = 100)]
    graph_calls: u32,
    /// Write the timing rows here (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Run the planner at each timed shape and time its choice in turns with the modes
    /// (`planner_ms`, `planner_choice` in the row).
    #[arg(long)]
    plan: bool,
    /// Time the forward and the backward together.
    #[arg(long, conflicts_with = "plan")]
    with_backward: bool,
    /// Time packed documents' cost instead of the modes: a training step and the forward alone
    /// on documents of mixed lengths against the same tokens as whole sequences, in turns.
    #[arg(long, conflicts_with_all = ["plan", "with_backward"])]
    packed_cost: bool,
}

const TOL: f64 = 5e-3;
/// Beyond this conditioning (`normaliser_conditioning`) a token's normaliser cancels so far that
/// fp32 operands determine its h only to kappa times their rounding: input gates of hundreds over
/// short documents make a few such tokens (one dominant key almost orthogonal to the query, h in
/// the 1e5). Their h is held to `TOL + kappa QN_ROUNDING` on its own and their cotangent is 0, so
/// that they neither hide the other rows' errors under their norm nor fail a correct kernel.
const CANCELLING: f64 = 1e4;
/// The kernels keep `q . n` to 16 significant bits of its terms.
const QN_ROUNDING: f64 = 1.0 / 65536.0;
/// Below this norm a gradient is all fp32 subnormals or zeros.
const UNDERFLOW: f64 = 1e-30;
const POISON: u16 = 0xFFFF;

/// One check: dimensions, the shards' lengths (one per PE), the gates, the initial state, and
/// the segments and states pieces each shard is forced into (else the plan's).
struct Case {
    b: usize,
    h: usize,
    dk: usize,
    dv: usize,
    lengths: Vec<usize>,
    regime: MlstmRegime,
    initial_state: bool,
    /// A cotangent for the final state's C.
    d_final: bool,
    segments: Option<u32>,
    splits: Option<u32>,
    /// Packed documents over the whole sequence (no initial state, no final-state cotangent).
    documents: Option<CaseDocuments>,
}

/// fla's offsets of a case's documents, `[0, ..., total]`, and their width on the device.
struct CaseDocuments {
    cu_seqlens: Vec<usize>,
    int64: bool,
}

impl CaseDocuments {
    /// The offsets as the device buffer holds them: padded with the total.
    fn padded(&self) -> Vec<usize> {
        padded_offsets(&self.cu_seqlens)
    }

    /// A buffer of the same capacity holding one document: what a graph is captured with.
    fn one_document(&self) -> Vec<usize> {
        let total = *self.cu_seqlens.last().expect("offsets end with the total");
        one_document(self.cu_seqlens.len() + SPARE_OFFSETS, total)
    }
}

impl NamedCase for Case {
    fn name(&self) -> String {
        format!(
            "mlstm_B{}_H{}_Dk{}_Dv{}_{:?}_shards{:?}{}{}{}{}{}",
            self.b,
            self.h,
            self.dk,
            self.dv,
            self.regime,
            self.lengths,
            if self.initial_state { "_state0" } else { "" },
            if self.d_final { "_dCT" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}")),
            self.splits.map_or(String::new(), |n| format!("_R{n}")),
            self.documents.as_ref().map_or(String::new(), |d| format!(
                "_{}docs_{}",
                d.cu_seqlens.len() - 1,
                if d.int64 { "int64" } else { "int32" }
            ))
        )
    }
}

fn cases(npes: usize) -> Vec<Case> {
    // Whole and ragged chunks, the last shard 37 tokens short.
    let ragged = |base: usize| -> Vec<usize> {
        (0..npes)
            .map(|r| base + 64 * r - if r + 1 == npes { 37 } else { 0 })
            .collect()
    };
    // A one-token shard, then 63, 65 and 130 tokens.
    let tiny: Vec<usize> = [1, 63, 65, 130].into_iter().cycle().take(npes).collect();
    let case = |dk, dv, lengths, regime, initial_state| Case {
        b: 1,
        h: 2,
        dk,
        dv,
        lengths,
        regime,
        initial_state,
        d_final: dk == dv,
        segments: None,
        splits: None,
        documents: None,
    };
    use MlstmRegime::*;
    let mut out: Vec<Case> = [(128, 128), (64, 64), (64, 128), (128, 64)]
        .into_iter()
        .map(|(dk, dv)| case(dk, dv, ragged(200), Typical, true))
        .collect();
    for (regime, initial_state) in [(LargeInputGate, true), (ForgetNearZero, false)] {
        out.push(Case {
            b: 2,
            ..case(128, 128, ragged(300), regime, initial_state)
        });
    }
    out.push(case(128, 128, tiny, LargeInputGate, false));
    // Every shard in three segments of two pieces each (some empty).
    out.push(Case {
        segments: Some(3),
        splits: Some(2),
        ..case(128, 128, ragged(400), Typical, true)
    });
    // Packed documents: 1, 63, 64 and 65 tokens, one ending on a shard boundary, one of a whole
    // shard or spanning three, the rest (int32 offsets); and 1 to 200 tokens in turn (int64),
    // under large input gates too, and with every shard in three segments of two pieces.
    let lengths = shard_lengths(npes, 320, 37);
    let total = lengths.iter().sum();
    let packed = |cu_seqlens, int64, regime, segments: Option<u32>| Case {
        b: 2,
        segments,
        splits: segments.map(|_| 2),
        documents: Some(CaseDocuments { cu_seqlens, int64 }),
        d_final: false,
        ..case(128, 128, lengths.clone(), regime, false)
    };
    out.push(packed(boundary_documents(&lengths), false, Typical, None));
    out.push(packed(short_documents(total), true, LargeInputGate, None));
    out.push(packed(short_documents(total), false, Typical, Some(3)));
    out
}

/// One PE's shard on the device.
struct Shard {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    i_gate: CudaSlice<f32>,
    f_gate: CudaSlice<f32>,
    /// The sequence's initial state (C, n, m), the same on every PE.
    state0: Option<[CudaSlice<f32>; 3]>,
    h: CudaSlice<bf16>,
    /// What the forward saves for the backward: the rows (m, den) and the states entering and
    /// leaving the shard (C, n, m each; on the last PE the latter is the final state).
    saved: [CudaSlice<f32>; 2],
    entry: [CudaSlice<f32>; 3],
    exit: [CudaSlice<f32>; 3],
    scale: Option<f32>,
    eps: Option<f32>,
    /// Packed documents: fla's offsets on the device and the sequence's index of token 0.
    offsets: Option<Offsets>,
    shard_start: usize,
    /// Whether the calls take the documents (the cost's unpacked turns do not).
    packed: bool,
    /// With documents, where the forward writes every document's final state (C, n, m:
    /// `[B, N, H, ...]` each), N the padded offsets' entries less one.
    document_states: Option<[CudaSlice<f32>; 3]>,
}

/// The bits one forward call left in h, the saved rows, the boundary states and the documents'
/// final states.
#[derive(PartialEq)]
struct Bits {
    h: Vec<u16>,
    saved: Vec<Vec<u32>>,
}

/// The documents `offsets` hold for a shard from token `shard_start` of the packed sequence.
fn documents_of(offsets: Option<&Offsets>, shard_start: usize) -> Option<Documents<'_>> {
    offsets.map(|offsets| Documents {
        cu_seqlens: offsets.view(),
        shard_start,
    })
}

fn state_ref([c, n, m]: &[CudaSlice<f32>; 3]) -> MlstmStateRef<'_> {
    MlstmStateRef {
        c: DeviceRef::new(c),
        n: DeviceRef::new(n),
        m: DeviceRef::new(m),
    }
}

fn state_mut([c, n, m]: &mut [CudaSlice<f32>; 3]) -> MlstmStateMut<'_> {
    MlstmStateMut {
        c: DeviceMut::new(c),
        n: DeviceMut::new(n),
        m: DeviceMut::new(m),
    }
}

impl Shard {
    /// Uploads this PE's rows of `inputs` from token `start` on (`shape.t` of them).
    fn upload(
        stream: &Arc<CudaStream>,
        inputs: &MlstmInputs,
        shape: ForwardShape,
        start: usize,
    ) -> Result<Self> {
        let len = shape.t;
        let rows = |t: &Tensor| shard_rows(t, start, len);
        let state0 = match &inputs.initial_state {
            Some(st) => Some([
                stream.clone_htod(&f32s(st.c.data()))?,
                stream.clone_htod(&f32s(st.n.data()))?,
                stream.clone_htod(&f32s(st.m.data()))?,
            ]),
            None => None,
        };
        let bf16_rows = |x: &Tensor| stream.clone_htod(&bf16s(&rows(x)));
        let f32_rows = |x: &Tensor| stream.clone_htod(&f32s(&rows(x)));
        let qkv = [
            bf16_rows(&inputs.q)?,
            bf16_rows(&inputs.k)?,
            bf16_rows(&inputs.v)?,
        ];
        let gates = [
            f32_rows(&inputs.input_gate)?,
            f32_rows(&inputs.forget_gate)?,
        ];
        let shard = Shard::assemble(stream, shape, qkv, gates, state0)?;
        Ok(Shard {
            scale: Some(inputs.scale as f32),
            eps: Some(inputs.eps as f32),
            shard_start: start,
            ..shard
        })
    }

    /// A shard of these inputs (q, k, v; the input and forget gates; the initial state), with
    /// zeroed outputs, saved rows and boundary states, the default scale and eps.
    fn assemble(
        stream: &Arc<CudaStream>,
        shape: ForwardShape,
        [q, k, v]: [CudaSlice<bf16>; 3],
        [i_gate, f_gate]: [CudaSlice<f32>; 2],
        state0: Option<[CudaSlice<f32>; 3]>,
    ) -> Result<Self> {
        let per_token = shape.b * shape.t * shape.h;
        let state = || -> Result<[CudaSlice<f32>; 3]> {
            Ok([
                stream.alloc_zeros(shape.state_len())?,
                stream.alloc_zeros(shape.b * shape.h * shape.dk)?,
                stream.alloc_zeros(shape.b * shape.h)?,
            ])
        };
        Ok(Shard {
            shape,
            q,
            k,
            v,
            i_gate,
            f_gate,
            state0,
            h: stream.alloc_zeros(shape.v_len())?,
            saved: [
                stream.alloc_zeros(per_token)?,
                stream.alloc_zeros(per_token)?,
            ],
            entry: state()?,
            exit: state()?,
            scale: None,
            eps: None,
            offsets: None,
            shard_start: 0,
            packed: true,
            document_states: None,
        })
    }

    /// The documents the shard's calls take, if any.
    fn documents(&self) -> Option<Documents<'_>> {
        documents_of(
            self.offsets.as_ref().filter(|_| self.packed),
            self.shard_start,
        )
    }

    /// Overwrites the offsets' buffer (as many entries as it holds).
    fn write_offsets(&mut self, stream: &Arc<CudaStream>, offsets: &[usize]) -> Result<()> {
        match &mut self.offsets {
            Some(buffer) => buffer.write(stream, offsets),
            None => Err(Error::State("the shard holds no documents".into())),
        }
    }

    /// Enqueues the forward of the shard, saving what the backward reads.
    fn forward(&mut self, op: &mut MlstmLasp2Forward, stream: &Arc<CudaStream>) -> Result<()> {
        let [row_m, row_den] = &mut self.saved;
        let args = MlstmArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            i_gate: DeviceRef::new(&self.i_gate),
            f_gate: DeviceRef::new(&self.f_gate),
            initial_state: self.state0.as_ref().map(state_ref),
            h: DeviceMut::new(&mut self.h),
            saved: Some(MlstmSavedMut {
                m: DeviceMut::new(row_m),
                den: DeviceMut::new(row_den),
            }),
            final_state: None,
            scale: self.scale,
            eps: self.eps,
            documents: documents_of(
                self.offsets.as_ref().filter(|_| self.packed),
                self.shard_start,
            ),
            document_final_states: self
                .document_states
                .as_mut()
                .filter(|_| self.packed)
                .map(state_mut),
        };
        let boundary = MlstmBoundaryMut {
            entry: state_mut(&mut self.entry),
            exit: state_mut(&mut self.exit),
        };
        op.forward_saving(stream, args, Some(boundary)).map(|_| ())
    }

    /// One call on poisoned outputs; their bits.
    fn call(&mut self, op: &mut MlstmLasp2Forward, stream: &Arc<CudaStream>) -> Result<Bits> {
        self.poison(stream)?;
        self.forward(op, stream)?;
        op.finish(stream)?;
        self.bits(stream)
    }

    /// Enqueues the backward of the shard from what the forward saved.
    fn backward(
        &self,
        grads: &mut ShardGrads,
        op: &mut MlstmLasp2Backward,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let [d_i, d_f] = &mut grads.d_gates;
        let args = MlstmBackwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            i_gate: DeviceRef::new(&self.i_gate),
            f_gate: DeviceRef::new(&self.f_gate),
            initial_state: None,
            saved: MlstmSavedRef {
                m: DeviceRef::new(&self.saved[0]),
                den: DeviceRef::new(&self.saved[1]),
            },
            d_h: DeviceRef::new(&grads.d_h),
            d_final: grads.d_c_t.as_ref().map(|d_c| MlstmFinalCotangent {
                d_c: DeviceRef::new(d_c),
                m: DeviceRef::new(&self.exit[2]),
            }),
            dq: DeviceMut::new(&mut grads.dq),
            dk: DeviceMut::new(&mut grads.dk),
            dv: DeviceMut::new(&mut grads.dv),
            d_i_gate: DeviceMut::new(d_i),
            d_f_gate: DeviceMut::new(d_f),
            d_initial_c: grads.d_c0.as_mut().map(DeviceMut::new),
            scale: self.scale,
            documents: self.documents(),
        };
        let boundary = MlstmBoundaryRef {
            entry: state_ref(&self.entry),
            exit: state_ref(&self.exit),
        };
        op.backward(stream, args, boundary).map(|_| ())
    }

    /// One backward call on poisoned gradients; their bits.
    fn backward_bits(
        &self,
        grads: &mut ShardGrads,
        op: &mut MlstmLasp2Backward,
        stream: &Arc<CudaStream>,
    ) -> Result<GradBits> {
        grads.poison(stream)?;
        self.backward(grads, op, stream)?;
        op.finish(stream)?;
        grads.bits(stream)
    }
}

impl Outputs for Shard {
    /// The bits of h, the saved rows and the boundary states.
    type Bits = Bits;

    /// Everything the forward writes filled with poison bit patterns.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memcpy_htod(&vec![bf16::from_bits(POISON); self.h.len()], &mut self.h)?;
        for x in self
            .saved
            .iter_mut()
            .chain(&mut self.entry)
            .chain(&mut self.exit)
            .chain(self.document_states.iter_mut().flatten())
        {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); x.len()], x)?;
        }
        Ok(())
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> Result<Bits> {
        let mut saved = Vec::new();
        for x in self
            .saved
            .iter()
            .chain(&self.entry)
            .chain(&self.exit)
            .chain(self.document_states.iter().flatten())
        {
            saved.push(f32_bits(stream, Some(x))?);
        }
        Ok(Bits {
            h: bf16_bits(stream, &self.h)?,
            saved,
        })
    }
}

/// One PE's backward tensors: dh, dC_T (the last PE, where the case asks), the gradients (dC_0 on
/// PE 0).
struct ShardGrads {
    d_h: CudaSlice<bf16>,
    d_c_t: Option<CudaSlice<f32>>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    d_gates: [CudaSlice<f32>; 2],
    d_c0: Option<CudaSlice<f32>>,
}

/// The bits one backward call left in the gradients.
#[derive(PartialEq)]
struct GradBits {
    dq: Vec<u16>,
    dk: Vec<u16>,
    dv: Vec<u16>,
    d_i: Vec<u32>,
    d_f: Vec<u32>,
    d_c0: Vec<u32>,
}

impl ShardGrads {
    fn new(
        stream: &Arc<CudaStream>,
        shape: ForwardShape,
        d_h: &[bf16],
        d_c_t: Option<&[f32]>,
        d_c0: bool,
    ) -> Result<Self> {
        let per_token = shape.b * shape.t * shape.h;
        Ok(ShardGrads {
            d_h: stream.clone_htod(d_h)?,
            d_c_t: d_c_t.map(|d| stream.clone_htod(d)).transpose()?,
            dq: stream.alloc_zeros(shape.qk_len())?,
            dk: stream.alloc_zeros(shape.qk_len())?,
            dv: stream.alloc_zeros(shape.v_len())?,
            d_gates: [
                stream.alloc_zeros(per_token)?,
                stream.alloc_zeros(per_token)?,
            ],
            d_c0: if d_c0 {
                Some(stream.alloc_zeros(shape.state_len())?)
            } else {
                None
            },
        })
    }
}

impl Outputs for ShardGrads {
    type Bits = GradBits;

    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        for x in [&mut self.dq, &mut self.dk, &mut self.dv] {
            stream.memcpy_htod(&vec![bf16::from_bits(POISON); x.len()], x)?;
        }
        let [d_i, d_f] = &mut self.d_gates;
        for x in [Some(d_i), Some(d_f), self.d_c0.as_mut()]
            .into_iter()
            .flatten()
        {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); x.len()], x)?;
        }
        Ok(())
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> Result<GradBits> {
        Ok(GradBits {
            dq: bf16_bits(stream, &self.dq)?,
            dk: bf16_bits(stream, &self.dk)?,
            dv: bf16_bits(stream, &self.dv)?,
            d_i: f32_bits(stream, Some(&self.d_gates[0]))?,
            d_f: f32_bits(stream, Some(&self.d_gates[1]))?,
            d_c0: f32_bits(stream, self.d_c0.as_ref())?,
        })
    }
}

fn check_case(
    rt: &Runtime,
    case: &Case,
    seed: u64,
    graph_calls: u32,
) -> Result<std::result::Result<String, String>> {
    let (me, npes) = (rt.pe(), rt.npes());
    let whole = Shape {
        b: case.b,
        t: case.lengths.iter().sum(),
        h: case.h,
        dk: case.dk,
        dv: case.dv,
    };
    let inputs = MlstmInputs::generate(&MlstmSpec {
        shape: whole,
        regime: case.regime,
        seed,
        round_to_bf16: true,
        initial_state: case.initial_state,
    })
    .map_err(|e| Error::State(format!("input generation: {e}")))?;
    let fail = |e: ReferenceError| Error::State(format!("reference: {e}"));
    let packed = case.documents.as_ref().map(|d| MlstmPackedInputs {
        inputs: inputs.clone(),
        cu_seqlens: d.cu_seqlens.clone(),
        initial_states: None,
    });
    let conditioning = match &packed {
        Some(packed) => packed_normaliser_conditioning(packed),
        None => normaliser_conditioning(&inputs),
    }
    .map_err(fail)?;
    // The state leaving the last shard: the final state, or the last document's; with documents
    // every document's final state.
    let (want_h, want_final, want_documents) = match &packed {
        Some(packed) => {
            let want = packed_recurrent_forward(packed).map_err(fail)?;
            let last = want.final_states.last().expect("a document").clone();
            (want.h, last, want.final_states)
        }
        None => {
            let want = recurrent_forward(&inputs).map_err(fail)?;
            (want.h, want.final_state, Vec::new())
        }
    };
    let start: usize = case.lengths[..me].iter().sum();
    let len = case.lengths[me];
    let last = me + 1 == npes;
    let stream = rt.stream().clone();
    let shape = ForwardShape {
        t: len,
        ..ForwardShape::from(whole)
    };
    let mut shard = Shard::upload(&stream, &inputs, shape, start)?;
    if let Some(d) = &case.documents {
        shard.offsets = Some(Offsets::upload(&stream, &d.padded(), d.int64)?);
        let per_state = whole.b * (d.padded().len() - 1) * whole.h;
        shard.document_states = Some([
            stream.alloc_zeros(per_state * whole.dk * whole.dv)?,
            stream.alloc_zeros(per_state * whole.dk)?,
            stream.alloc_zeros(per_state)?,
        ]);
        let starts = DocumentStarts::new(rt)?;
        let docs = shard.documents().expect("just uploaded");
        starts.validate(&stream, docs, len, whole.t)?;
    }
    let mut op = MlstmLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?;
    op.set_num_segments(case.segments);
    op.set_states_splits(case.splits);
    let (first, mut problems) =
        bits_in_every_mode(&mut op, "forward", |op| shard.call(op, &stream))?;
    // With documents the graph is captured while the offsets hold one, and replayed after they
    // were written: the start words come from the offsets on the device.
    if let Some(d) = &case.documents {
        shard.write_offsets(&stream, &d.one_document())?;
    }
    let replayed = replay_after(
        rt,
        &mut op,
        &mut shard,
        graph_calls,
        &first,
        |shard, op, stream| shard.forward(op, stream),
        |shard, stream| match &case.documents {
            Some(d) => shard.write_offsets(stream, &d.padded()),
            None => Ok(()),
        },
    )?;
    problems.extend(replayed.err());
    op.free()?;
    let h = HRows::split(
        &bf16_values(&first.h),
        &shard_rows(&want_h, start, len),
        &shard_rows(&conditioning, start, len),
        case.dv,
    );
    let mut errors = Vec::new();
    let mut check = |what: &str, got: Vec<f64>, want: &[f64]| {
        let e = rel_err(&got, want);
        if e.is_nan() || e > TOL {
            problems.push(format!("{what}: rel err {e:.3e} > {TOL:.0e}"));
        }
        errors.push(format!("{what} {e:.2e}"));
    };
    check("h", h.got, &h.want);
    if last {
        // The state leaving the last shard: saved[5..8] hold C, n, m.
        let st = &want_final;
        for ((what, bits), want) in ["C_t", "n_t", "m_t"]
            .into_iter()
            .zip(&first.saved[5..])
            .zip([&st.c, &st.n, &st.m])
        {
            check(what, f32_values(bits), want.data());
        }
    }
    if let Some(d) = &case.documents {
        // saved[8..11] hold every document's C, n and m.
        let outcome = DocumentStates::compare(
            &first.saved[8..11],
            &want_documents,
            &d.padded(),
            start..start + len,
            whole,
        );
        problems.extend(outcome.problems);
        if let Some(e) = outcome.worst {
            errors.push(format!(
                "document states {e:.2e} ({} here)",
                outcome.ending_here
            ));
        }
    }
    problems.extend(h.cancelling_problems);
    if h.cancelling > 0 {
        errors.push(format!("({} cancelling rows apart)", h.cancelling));
    }
    let backward = check_backward(
        rt,
        case,
        &inputs,
        packed.as_ref(),
        &conditioning,
        &shard,
        seed,
        start,
        graph_calls,
    )?;
    let detail = format!("rel err {}", errors.join(" "));
    Ok(match (problems.is_empty(), backward) {
        (true, Ok(grads)) => Ok(format!(
            "{detail}, {grads}, every mode and {graph_calls} graph replays bitwise equal"
        )),
        (_, Ok(grads)) => Err(format!("{detail}, {grads}: {}", problems.join("; "))),
        (_, Err(grads)) => {
            problems.push(grads);
            Err(format!("{detail}: {}", problems.join("; ")))
        }
    })
}

/// A shard's per-document final states against the reference: each document whose last token is
/// in the shard (its C, n and m within [`TOL`]), every other slot +0.
struct DocumentStates {
    /// The largest relative error, where some document ends in the shard.
    worst: Option<f64>,
    ending_here: usize,
    problems: Vec<String>,
}

impl DocumentStates {
    /// `got`: the bits of C `[B, N, H, Dk, Dv]`, n `[B, N, H, Dk]` and m `[B, N, H]`, N the
    /// `padded` offsets' entries less one; `want`: the reference's states of the real documents.
    fn compare(
        got: &[Vec<u32>],
        want: &[MlstmState],
        padded: &[usize],
        shard: std::ops::Range<usize>,
        whole: Shape,
    ) -> DocumentStates {
        let docs = padded.len() - 1;
        let per_head = [whole.dk * whole.dv, whole.dk, 1];
        let mut out = DocumentStates {
            worst: None,
            ending_here: 0,
            problems: Vec::new(),
        };
        for n in 0..docs {
            let (first, end) = (padded[n], padded[n + 1]);
            let ends_here = end > first && end > shard.start && end <= shard.end;
            out.ending_here += usize::from(ends_here);
            for (part, ((bits, &per), name)) in
                got.iter().zip(&per_head).zip(["C", "n", "m"]).enumerate()
            {
                let block = whole.h * per; // (b, n): H heads of `per` elements
                let values: Vec<u32> = (0..whole.b)
                    .flat_map(|b| bits[(b * docs + n) * block..][..block].iter().copied())
                    .collect();
                if !ends_here {
                    if values.iter().any(|&x| x != 0) {
                        out.problems
                            .push(format!("document {n}'s {name} is not +0 on this PE"));
                    }
                    continue;
                }
                let st = &want[n];
                let reference = [&st.c, &st.n, &st.m][part];
                let e = rel_err(&f32_values(&values), reference.data());
                if e.is_nan() || e > TOL {
                    out.problems.push(format!(
                        "document {n}'s {name}: rel err {e:.3e} > {TOL:.0e}"
                    ));
                }
                out.worst = Some(out.worst.map_or(e, |w: f64| w.max(e)));
            }
        }
        out
    }
}

/// A shard's h against the reference: the rows whose normaliser cancels beyond [`CANCELLING`]
/// apart from the others, each held to its own bound.
struct HRows {
    got: Vec<f64>,
    want: Vec<f64>,
    cancelling: usize,
    cancelling_problems: Vec<String>,
}

impl HRows {
    /// `got` and `want` hold rows of `dv`, one per entry of `conditioning`.
    fn split(got: &[f64], want: &[f64], conditioning: &[f64], dv: usize) -> HRows {
        let mut rows = HRows {
            got: Vec::with_capacity(got.len()),
            want: Vec::with_capacity(want.len()),
            cancelling: 0,
            cancelling_problems: Vec::new(),
        };
        for ((got, want), &kappa) in got.chunks(dv).zip(want.chunks(dv)).zip(conditioning) {
            if kappa <= CANCELLING {
                rows.got.extend_from_slice(got);
                rows.want.extend_from_slice(want);
                continue;
            }
            rows.cancelling += 1;
            let (e, bound) = (rel_err(got, want), TOL + kappa * QN_ROUNDING);
            if e.is_nan() || e > bound {
                rows.cancelling_problems.push(format!(
                    "h of a row cancelling {kappa:.1e}: rel err {e:.3e} > {bound:.1e}"
                ));
            }
        }
        rows
    }
}

/// The reference's cotangents of the whole sequence: `dh ~ N(0, 1)` (0 on the rows whose
/// normaliser cancels beyond [`CANCELLING`]) and, where the case asks, `dC_T ~ N(0, 1)`
/// (mlstm_kernels' gradient takes no `dn_T`, `dm_T`).
fn cotangents(
    case: &Case,
    whole: Shape,
    conditioning: &Tensor,
    seed: u64,
) -> Result<MlstmCotangents> {
    let mut cot = Cotangents::generate(whole, seed, case.d_final, true)
        .map_err(|e| Error::State(format!("cotangent generation: {e}")))?;
    for (row, &kappa) in cot
        .d_o
        .data_mut()
        .chunks_mut(whole.dv)
        .zip(conditioning.data())
    {
        if kappa > CANCELLING {
            row.fill(0.0);
        }
    }
    Ok(MlstmCotangents {
        d_h: cot.d_o,
        d_final_state: cot.d_ht.map(|c| MlstmState {
            c,
            n: Tensor::zeros(&[whole.b, whole.h, whole.dk]),
            m: Tensor::zeros(&[whole.b, whole.h]),
        }),
    })
}

/// The backward of this PE's shard in every mode against the reference's backward of the whole
/// sequence (of each of its documents, where `packed`): the errors, or what failed.
#[allow(clippy::too_many_arguments)]
fn check_backward(
    rt: &Runtime,
    case: &Case,
    inputs: &MlstmInputs,
    packed: Option<&MlstmPackedInputs>,
    conditioning: &Tensor,
    shard: &Shard,
    seed: u64,
    start: usize,
    graph_calls: u32,
) -> Result<std::result::Result<String, String>> {
    let (me, npes) = (rt.pe(), rt.npes());
    let stream = rt.stream().clone();
    let cot = cotangents(case, inputs.shape, conditioning, seed)?;
    let fail = |e: ReferenceError| Error::State(format!("reference backward: {e}"));
    let (want, gate_scale) = match packed {
        Some(packed) => {
            let want = packed_recurrent_backward(packed, &cot.d_h, None, MlstmGradient::Tfla)
                .map_err(fail)?;
            (want.grads, want.gate_scale)
        }
        None => {
            let want = recurrent_backward(inputs, &cot, MlstmGradient::Tfla).map_err(fail)?;
            let scale = want.gate_grad_scale(inputs);
            (want, scale)
        }
    };
    let (shape, len) = (shard.shape, shard.shape.t);
    let d_c_t = match (&cot.d_final_state, me + 1 == npes) {
        (Some(d), true) => Some(f32s(d.c.data())),
        _ => None,
    };
    let d_h = bf16s(&shard_rows(&cot.d_h, start, len));
    let with_dc0 = me == 0 && packed.is_none();
    let mut grads = ShardGrads::new(&stream, shape, &d_h, d_c_t.as_deref(), with_dc0)?;
    let mut op = MlstmLasp2Backward::new(rt, shape.layout(), ExchangeMode::Overlapped)?;
    op.set_num_segments(case.segments);
    let (first, mut problems) = bits_in_every_mode(&mut op, "backward", |op| {
        shard.backward_bits(&mut grads, op, &stream)
    })?;
    let replayed = replay(
        rt,
        &mut op,
        &mut grads,
        graph_calls,
        &first,
        |grads, op, stream| shard.backward(grads, op, stream),
    )?;
    problems.extend(replayed.err().map(|e| format!("backward: {e}")));
    op.free()?;
    let mut errors = Vec::new();
    let got = [&first.dq[..], &first.dk, &first.dv];
    let mut relative = qkv_rows(got, [&want.dq, &want.dk, &want.dv], start, len);
    if with_dc0 {
        relative.push((
            "dC0",
            f32_values(&first.d_c0),
            want.d_initial_state.c.data().to_vec(),
        ));
    }
    let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
    for (what, got, want) in relative {
        // Under input gates of hundreds a shard's gradient (or the zero state's dC_0, m_0 = 0)
        // can be e^{-hundreds} of its terms: below fp32's and bf16's range, so it must come out
        // as (near) zero.
        if norm(&want) < UNDERFLOW {
            if norm(&got) >= UNDERFLOW {
                problems.push(format!(
                    "{what}: ||got|| = {:.3e} where ||want|| = {:.3e} underflows fp32",
                    norm(&got),
                    norm(&want)
                ));
            }
            errors.push(format!("{what} underflows"));
            continue;
        }
        let e = rel_err(&got, &want);
        if e.is_nan() || e > TOL {
            problems.push(format!(
                "{what}: rel err {e:.3e} > {TOL:.0e} (||got|| {:.3e}, ||want|| {:.3e})",
                norm(&got),
                norm(&want)
            ));
        }
        errors.push(format!("{what} {e:.2e}"));
    }
    for (what, got, want) in [
        ("d_i_gate", f32_values(&first.d_i), &want.d_input_gate),
        ("d_f_gate", f32_values(&first.d_f), &want.d_forget_gate),
    ] {
        let want = shard_rows(want, start, len);
        match assert_close_to_scale(what, &got, &want, gate_scale, TOL) {
            Ok(()) => {
                let diff = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b) * (a - b))
                    .sum::<f64>();
                errors.push(format!("{what} {:.2e} of scale", diff.sqrt() / gate_scale));
            }
            Err(e) => problems.push(e),
        }
    }
    if let Some(packed) = packed {
        // A start's own forget gate decays the zero state: its gradient is exactly 0.
        let nonzero = starts_in_shard(&packed.cu_seqlens, start, len)
            .flat_map(|t| {
                (0..case.b).flat_map(move |b| (0..case.h).map(move |h| (b * len + t) * case.h + h))
            })
            .filter(|&row| first.d_f[row] != 0)
            .count();
        if nonzero > 0 {
            problems.push(format!(
                "d_f_gate: {nonzero} values at document starts are not +0"
            ));
        }
    }
    let detail = format!("grads rel err {}", errors.join(" "));
    Ok(if problems.is_empty() {
        Ok(detail)
    } else {
        Err(format!("{detail}: {}", problems.join("; ")))
    })
}

/// The operation over one random shard, as `time_in_turns` drives it.
struct Timed {
    op: MlstmLasp2Forward,
    shard: Shard,
    /// The planner's choice, where it ran.
    planned: Option<ExchangeMode>,
}

impl ModeCall for Timed {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.op.set_mode(mode)
    }
    fn use_plan(&mut self) -> Result<()> {
        let mode = planner_choice(self.planned)?;
        self.op.set_mode(mode)
    }
    fn has_chain(&self) -> bool {
        self.op.supports(ExchangeMode::PipelinedChain)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.shard.forward(&mut self.op, stream)
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }
}

/// A training step over one random shard (the forward saving what the backward reads, then the
/// backward), as `time_in_turns` drives it.
struct TimedStep {
    forward: MlstmLasp2Forward,
    backward: MlstmLasp2Backward,
    shard: Shard,
    grads: ShardGrads,
}

impl ModeCall for TimedStep {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.forward.set_mode(mode)?;
        self.backward.set_mode(mode)
    }
    fn has_chain(&self) -> bool {
        self.forward.supports(ExchangeMode::PipelinedChain)
            && self.backward.supports(ExchangeMode::PipelinedChain)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.shard.forward(&mut self.forward, stream)?;
        self.shard
            .backward(&mut self.grads, &mut self.backward, stream)
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.forward.finish(stream)?;
        self.backward.finish(stream)
    }
}

impl Shard {
    /// A random shard of `shape` on this PE: q, k, v uniform in [-1, 1) and mlstm_kernels'
    /// benchmark gates (input pre-activations around 0, forget around 3: sigmoid 0.95).
    fn random(stream: &Arc<CudaStream>, shape: ForwardShape, pe: usize) -> Result<Self> {
        let mut rng = lasp_shmem::reference::SplitMix64::new(11 + pe as u64);
        let mut uniform = move || rng.next_u64() as f64 / u64::MAX as f64;
        let mut values = |len: usize, centre: f64, to: &mut dyn FnMut(f64)| {
            (0..len).for_each(|_| to(centre + uniform() * 2.0 - 1.0))
        };
        let mut bf16_tensor = |len: usize| -> Result<CudaSlice<bf16>> {
            let mut x = Vec::with_capacity(len);
            values(len, 0.0, &mut |v| x.push(bf16::from_f64(v)));
            Ok(stream.clone_htod(&x)?)
        };
        let (q, k, v) = (
            bf16_tensor(shape.qk_len())?,
            bf16_tensor(shape.qk_len())?,
            bf16_tensor(shape.v_len())?,
        );
        let tokens = shape.b * shape.t * shape.h;
        let mut gate = |centre: f64| -> Result<CudaSlice<f32>> {
            let mut x = Vec::with_capacity(tokens);
            values(tokens, centre, &mut |v| x.push(v as f32));
            Ok(stream.clone_htod(&x)?)
        };
        let (i_gate, f_gate) = (gate(0.0)?, gate(3.0)?);
        Shard::assemble(stream, shape, [q, k, v], [i_gate, f_gate], None)
    }
}

fn time_shape(
    rt: &Runtime,
    comm: &NcclComm,
    shape: ForwardShape,
    plan: bool,
    with_backward: bool,
) -> Result<ModeRow> {
    let stream = rt.stream().clone();
    let (me, npes) = (rt.pe(), rt.npes());
    let shard = Shard::random(&stream, shape, me)?;
    let row = if with_backward {
        let d_h: Vec<bf16> = (0..shape.v_len())
            .map(|i| bf16::from_f32(((i % 97) as f32 - 48.0) / 48.0))
            .collect();
        let d_c_t = (me + 1 == npes).then(|| vec![0.01f32; shape.state_len()]);
        let mut step = TimedStep {
            forward: MlstmLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
            backward: MlstmLasp2Backward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
            grads: ShardGrads::new(&stream, shape, &d_h, d_c_t.as_deref(), me == 0)?,
            shard,
        };
        let medians = time_in_turns(rt, &mut step)?;
        step.forward.free()?;
        step.backward.free()?;
        ModeRow::new(rt, shape, mode_times(comm, medians)?)
    } else {
        let mut timed = Timed {
            op: MlstmLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
            shard,
            planned: None,
        };
        let plan = if plan {
            let Timed { op, shard, .. } = &mut timed;
            Some(op.plan(&stream, shape.t, |op, stream| shard.forward(op, stream))?)
        } else {
            None
        };
        timed.planned = plan.as_ref().map(|p| p.chosen.mode);
        let (modes, planner) = time_modes_and_plan(rt, comm, &mut timed, plan.as_ref(), mode_of)?;
        timed.op.free()?;
        ModeRow {
            planner,
            ..ModeRow::new(rt, shape, modes)
        }
    };
    if rt.pe() == 0 {
        let chain = row
            .modes
            .pipelined_chain_ms
            .map_or(String::new(), |ms| format!(", chain {:.4}", round(ms, 4)));
        println!(
            "W={} B={} T_local={} H={} D={}{}: overlapped {:.4} ms, sequential NCCL {:.4}, sequential NVSHMEM {:.4}, no-comm {:.4}{chain}{}",
            row.w,
            row.b,
            row.t_local,
            row.h,
            row.d,
            if with_backward { " fwd+bwd" } else { "" },
            round(row.modes.overlapped_ms, 4),
            round(row.modes.sequential_nccl_ms, 4),
            round(row.modes.sequential_nvshmem_ms, 4),
            round(row.modes.no_comm_ms, 4),
            row.planner.as_ref().map_or(String::new(), PlannerTimes::line)
        );
    }
    Ok(row)
}

/// A training step (or its forward alone) of a random shard, on its documents or unpacked.
struct CostStep {
    forward: MlstmLasp2Forward,
    backward: MlstmLasp2Backward,
    shard: Shard,
    grads: ShardGrads,
    forward_only: bool,
}

impl ModeCall for CostStep {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.forward.set_mode(mode)?;
        self.backward.set_mode(mode)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.shard.forward(&mut self.forward, stream)?;
        if self.forward_only {
            return Ok(());
        }
        self.shard
            .backward(&mut self.grads, &mut self.backward, stream)
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.forward.finish(stream)?;
        self.backward.finish(stream)
    }
}

/// A row of `--packed-cost`: packed documents' cost, and that of their final states.
#[derive(Serialize)]
struct PackedCostRow {
    #[serde(flatten)]
    cost: PackedCost,
    /// The packed forward (saving what the backward reads) that also writes every document's
    /// final state, and the same forward without them, in turns: rank 0's medians of 30 calls.
    forward_with_document_states_ms: f64,
    forward_without_document_states_ms: f64,
}

/// The packed forward with every document's final state and without, in turns (rank 0's
/// medians of 30 calls after 5 untimed).
fn time_document_states(rt: &Runtime, step: &mut CostStep, documents: usize) -> Result<(f64, f64)> {
    let stream = rt.stream().clone();
    let s = step.shard.shape;
    let states = s.b * documents * s.h;
    let mut spare = Some([
        stream.alloc_zeros(states * s.dk * s.dv)?,
        stream.alloc_zeros(states * s.dk)?,
        stream.alloc_zeros(states)?,
    ]);
    step.shard.packed = true;
    let mut times = [Vec::new(), Vec::new()];
    for call in 0..35 {
        for (with_states, times) in [true, false].into_iter().zip(times.iter_mut()) {
            step.shard.document_states = if with_states { spare.take() } else { None };
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            step.shard.forward(&mut step.forward, &stream)?;
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            end.synchronize()?;
            step.forward.finish(&stream)?;
            if with_states {
                spare = step.shard.document_states.take();
            }
            if call >= 5 {
                times.push(start.elapsed_ms(&end)? as f64);
            }
        }
    }
    let [with, without] = times.map(|mut t| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    });
    Ok((with, without))
}

/// Packed documents' cost at `shape` per GPU (overlapped mode): documents of mixed lengths (64
/// to 8192 tokens, log-uniform, the same on every PE) against the same tokens unpacked; the row
/// is the slowest PE's median of each. Then the documents' final states
/// ([`time_document_states`]).
fn time_packed_cost(rt: &Runtime, shape: ForwardShape) -> Result<PackedCostRow> {
    let stream = rt.stream().clone();
    let (me, npes) = (rt.pe(), rt.npes());
    let cu_seqlens = mixed_documents(npes * shape.t, &mut SplitMix64::new(5));
    let mut shard = Shard::random(&stream, shape, me)?;
    shard.offsets = Some(Offsets::upload(&stream, &cu_seqlens, false)?);
    shard.shard_start = me * shape.t;
    let d_h: Vec<bf16> = (0..shape.v_len())
        .map(|i| bf16::from_f32(((i % 97) as f32 - 48.0) / 48.0))
        .collect();
    let mut step = CostStep {
        forward: MlstmLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
        backward: MlstmLasp2Backward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
        grads: ShardGrads::new(&stream, shape, &d_h, None, false)?,
        shard,
        forward_only: false,
    };
    let cost = PackedCost::measure(
        rt,
        shape,
        cu_seqlens.len() - 1,
        &mut step,
        |step, packed, forward_only| {
            step.shard.packed = packed;
            step.forward_only = forward_only;
        },
    )?;
    let (with, without) = time_document_states(rt, &mut step, cu_seqlens.len() - 1)?;
    step.forward.free()?;
    step.backward.free()?;
    if me == 0 {
        println!("{}", cost.line("Mlstm"));
        println!(
            "  the documents' final states: the packed forward {with:.4} ms with them, \
             {without:.4} ms without ({:.3}x)",
            with / without
        );
    }
    Ok(PackedCostRow {
        cost,
        forward_with_document_states_ms: round(with, 4),
        forward_without_document_states_ms: round(without, 4),
    })
}

fn run(options: Options, config: Config) -> Result<bool> {
    let rt = Runtime::init(config)?;
    let mut failed = 0;
    if !options.no_check {
        failed = run_cases(&rt, &cases(rt.npes()), 5100, |case, seed| {
            check_case(&rt, case, seed, options.graph_calls)
        })?;
    }
    if options.packed_cost {
        let rows = options
            .time
            .iter()
            .map(|&shape| time_packed_cost(&rt, shape))
            .collect::<Result<Vec<_>>>()?;
        if let (Some(path), 0) = (&options.json, rt.pe()) {
            write_json(path, &rows)?;
        }
        rt.shutdown()?;
        return Ok(failed == 0);
    }
    time_shapes(
        &rt,
        &options.time,
        options.json.as_deref(),
        |comm, shape| time_shape(&rt, comm, shape, options.plan, options.with_backward),
    )?;
    rt.shutdown()?;
    Ok(failed == 0)
}

/// A heap for the largest timed layout or the checks' largest.
fn config(options: &Options, npes: usize) -> Result<Config> {
    let checks = Lasp2Layout {
        b: 2,
        h: 2,
        dk: 128,
        dv: 128,
    };
    lasp2_config::<Mlstm>(&options.time, checks, npes)
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe { main_under_launcher("mlstm_lasp2", Options::parse(), config, run) }
}
