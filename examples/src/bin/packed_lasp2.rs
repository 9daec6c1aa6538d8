//! Packed documents (`cu_seqlens`) through LASP-2 for scalar decay, Gated DeltaNet and GLA on
//! every GPU under `lasp-run`: `ops::documents::DocumentStarts` gives the first two families'
//! LASP-2 forward and backward the log-decays that forget at every document start; GLA's take the
//! documents themselves and mask at the starts.
//!
//! ```text
//! lasp-run -n 4 packed_lasp2                                       # the checks
//! lasp-run -n 4 packed_lasp2 --no-check --time 1x32768x16x128 --json cost.json   # the cost
//! lasp-run -n 4 packed_lasp2 --family gla                         # one family's checks
//! ```
//!
//! Checks (every PE): the whole packed sequence's inputs from the f64 reference's generator (q, k,
//! v rounded to bf16), cut into unequal shards, over two document layouts: documents of 1, 63, 64
//! and 65 tokens, one ending exactly on a shard boundary, one of a whole shard (W = 3), one
//! spanning three shards (W >= 4), the rest one document (int32 offsets); and short documents of
//! 1 to 200 tokens over the whole sequence (int64 offsets). Both buffers have room for two more
//! offsets, padded with the total. This PE's outputs against the reference's packed LASP-2
//! decomposition (`reference::lasp2::packed_forward`, `packed_delta_forward`; relative error <=
//! 5e-3) in every exchange mode, each bitwise equal to the overlapped mode's and a repeat; a CUDA
//! graph of the marks (GLA: its start words) and the forward, captured while the offsets held one document and replayed
//! `--graph-calls` times after the documents were written, bitwise equal too. Then the backward
//! (random do) from the state (GLA: the chunk states) the forward saved: dq, dk, dv against the
//! reference's packed backward (5e-3), dg (and Gated DeltaNet's dbeta) against the shard's norm
//! of theirs (scalar decay and GLA 5e-3, Gated DeltaNet 1e-2, as its unpacked checks), dg exactly 0
//! at every document start,
//! every mode and a repeat bitwise equal. The documents' final states (scalar decay's and Gated
//! DeltaNet's `ScalarDecayDocumentStates`, `GatedDeltaDocumentStates` from the state the forward
//! saved; GLA's from its forward, `GlaArgs::document_ht`): each document that ends in the shard
//! against the reference's (5e-3), every other slot +0, a repeat bitwise equal. Outputs,
//! gradients and states are poisoned before each call.
//! One line per case and PE; exit status 1 when any check failed; `--json` (rank 0) gets one row
//! per case with the PEs' largest errors.
//!
//! Cost (`--time BxTxHxD`, T per GPU): a training step (forward saving the state entering the
//! shard, then the backward), and the forward alone, on documents of mixed lengths (64 to 8192
//! tokens, log-uniform) and on the same tokens as whole sequences, in turns, overlapped mode; the
//! row is the slowest rank's median of each; also the documents' final states (rank 0's median
//! of 30 calls): after the packed forward (scalar decay, Gated DeltaNet), or the packed forward
//! with them against it without (GLA).

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::{ExchangeMode, Lasp2Layout, Lasp2Operation};
use lasp_shmem::ops::documents::document_states_len;
use lasp_shmem::ops::documents::{DocumentStarts, Documents, GateShape};
use lasp_shmem::ops::gated_delta::{
    GatedDelta, GatedDeltaArgs, GatedDeltaBackwardArgs, GatedDeltaDocumentStates,
    GatedDeltaDocumentStatesArgs, GatedDeltaLasp2Backward, GatedDeltaLasp2Forward,
};
use lasp_shmem::ops::gla::{
    chunk_states_len, Gla, GlaArgs, GlaBackwardArgs, GlaLasp2Backward, GlaLasp2Forward,
};
use lasp_shmem::ops::scalar_decay::lasp2::{Lasp2Backward, Lasp2Forward};
use lasp_shmem::ops::scalar_decay::{
    BackwardArgs, DocumentStatesArgs, ForwardArgs, ForwardShape, ScalarDecay,
    ScalarDecayDocumentStates, ScalarDecayForward,
};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::lasp2::{self, Decay};
use lasp_shmem::reference::packed::PackedInputs;
use lasp_shmem::reference::{
    rel_err, Cotangents, Family, Grads, InputSpec, Inputs, Regime, Shape, SplitMix64, Tensor,
};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::documents::{
    boundary_documents, max_over_pes, mixed_documents, one_document, padded_offsets,
    starts_in_shard, Offsets, PackedCost,
};
use lasp_shmem_examples::grad_bits::{qkv_rows, GradBits, GradBuffers};
use lasp_shmem_examples::graph_replay::{replay_after, Outputs};
use lasp_shmem_examples::mode_bits::bits_in_every_mode;
use lasp_shmem_examples::{
    bf16_bits, bf16_values, bf16s, f32_values, f32s, heap_config, log_decays, main_under_launcher,
    normals, parse_shape, run_cases, shard_lengths, shard_rows, short_documents, write_json,
    ModeCall, NamedCase, TimedInputs,
};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(name = "packed_lasp2")]
struct Options {
    /// Time a training step at these per-GPU shapes (BxTxHxD, T per GPU), packed and unpacked.
    #[arg(long = "time", value_name = "BxTxHxD", value_parser = parse_shape)]
    time: Vec<ForwardShape>,
    /// Skip the checks.
    #[arg(long)]
    no_check: bool,
    /// Graph replays in each check.
    #[arg(long, default_value_t = 20)]
    graph_calls: u32,
    /// The families to check and time (all three where none is given).
    #[arg(long = "family", value_enum)]
    families: Vec<PackedFamily>,
    /// Write the checks' and the timings' rows here (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

const TOL: f64 = 5e-3;
/// Gated DeltaNet's dg and dbeta against the shard's norm of theirs (its unpacked checks' bound).
const GDN_GATE_TOL: f64 = 1e-2;
const POISON: u16 = 0xFFFF;

/// The families, each through its own LASP-2 operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
enum PackedFamily {
    ScalarDecay,
    GatedDelta,
    Gla,
}

const FAMILIES: [PackedFamily; 3] = [
    PackedFamily::ScalarDecay,
    PackedFamily::GatedDelta,
    PackedFamily::Gla,
];

impl PackedFamily {
    fn reference_family(self) -> Family {
        match self {
            PackedFamily::ScalarDecay => Family::ScalarDecay,
            PackedFamily::GatedDelta => Family::DeltaRule,
            PackedFamily::Gla => Family::Gla,
        }
    }

    /// dg's (and dbeta's) bound against the shard's norm.
    fn gate_tol(self) -> f64 {
        match self {
            PackedFamily::ScalarDecay | PackedFamily::Gla => TOL,
            PackedFamily::GatedDelta => GDN_GATE_TOL,
        }
    }

    /// Gate values per token and head: GLA's are per key dimension.
    fn gates_per_head(self, dk: usize) -> usize {
        match self {
            PackedFamily::Gla => dk,
            _ => 1,
        }
    }

    /// The reference's packed LASP-2 outputs and gradients of the whole sequence.
    fn reference(
        self,
        packed: &PackedInputs,
        lengths: &[usize],
        d_o: &Tensor,
    ) -> Result<(Tensor, Grads)> {
        let fail =
            |e: lasp_shmem::reference::ReferenceError| Error::State(format!("reference: {e}"));
        Ok(match self {
            PackedFamily::ScalarDecay => (
                lasp2::packed_forward(packed, Decay::Scalar, lengths, 64)
                    .map_err(fail)?
                    .o,
                lasp2::packed_backward(packed, Decay::Scalar, lengths, 64, d_o, None)
                    .map_err(fail)?
                    .grads,
            ),
            PackedFamily::GatedDelta => (
                lasp2::packed_delta_forward(packed, lengths, 64)
                    .map_err(fail)?
                    .o,
                lasp2::packed_delta_backward(packed, lengths, 64, d_o, None)
                    .map_err(fail)?
                    .grads,
            ),
            PackedFamily::Gla => {
                let decay = Decay::Vector { sub_chunk: 16 };
                (
                    lasp2::packed_forward(packed, decay, lengths, 64)
                        .map_err(fail)?
                        .o,
                    lasp2::packed_backward(packed, decay, lengths, 64, d_o, None)
                        .map_err(fail)?
                        .grads,
                )
            }
        })
    }
}

/// A family's LASP-2 forward and backward (one value per case: the variants' sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum Ops {
    ScalarDecay(Lasp2Forward, Lasp2Backward),
    GatedDelta(GatedDeltaLasp2Forward, GatedDeltaLasp2Backward),
    Gla(GlaLasp2Forward, GlaLasp2Backward),
}

impl Ops {
    fn new(rt: &Runtime, family: PackedFamily, layout: Lasp2Layout) -> Result<Self> {
        let mode = ExchangeMode::Overlapped;
        Ok(match family {
            PackedFamily::ScalarDecay => Ops::ScalarDecay(
                Lasp2Forward::new(rt, layout, mode)?,
                Lasp2Backward::new(rt, layout, mode)?,
            ),
            PackedFamily::GatedDelta => Ops::GatedDelta(
                GatedDeltaLasp2Forward::new(rt, layout, mode)?,
                GatedDeltaLasp2Backward::new(rt, layout, mode)?,
            ),
            PackedFamily::Gla => Ops::Gla(
                GlaLasp2Forward::new(rt, layout, mode)?,
                GlaLasp2Backward::new(rt, layout, mode)?,
            ),
        })
    }
}

/// The forward and the backward as one operation: they switch modes together, and the forward's
/// epoch counts the calls (a graph replays the forward).
impl Lasp2Operation for Ops {
    fn layout(&self) -> Lasp2Layout {
        match self {
            Ops::ScalarDecay(f, _) => f.layout(),
            Ops::GatedDelta(f, _) => f.layout(),
            Ops::Gla(f, _) => f.layout(),
        }
    }

    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        match self {
            Ops::ScalarDecay(f, b) => f.set_mode(mode).and_then(|_| b.set_mode(mode)),
            Ops::GatedDelta(f, b) => f.set_mode(mode).and_then(|_| b.set_mode(mode)),
            Ops::Gla(f, b) => f.set_mode(mode).and_then(|_| b.set_mode(mode)),
        }
    }

    fn supports(&self, mode: ExchangeMode) -> bool {
        match self {
            Ops::ScalarDecay(f, b) => f.supports(mode) && b.supports(mode),
            Ops::GatedDelta(f, b) => f.supports(mode) && b.supports(mode),
            Ops::Gla(f, b) => f.supports(mode) && b.supports(mode),
        }
    }

    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        match self {
            Ops::ScalarDecay(f, b) => f.finish(stream).and_then(|_| b.finish(stream)),
            Ops::GatedDelta(f, b) => f.finish(stream).and_then(|_| b.finish(stream)),
            Ops::Gla(f, b) => f.finish(stream).and_then(|_| b.finish(stream)),
        }
    }

    fn epoch(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        match self {
            Ops::ScalarDecay(f, _) => f.epoch(stream),
            Ops::GatedDelta(f, _) => f.epoch(stream),
            Ops::Gla(f, _) => f.epoch(stream),
        }
    }

    fn note_replayed_calls(&mut self, calls: u64) {
        match self {
            Ops::ScalarDecay(f, _) => f.note_replayed_calls(calls),
            Ops::GatedDelta(f, _) => f.note_replayed_calls(calls),
            Ops::Gla(f, _) => f.note_replayed_calls(calls),
        }
    }

    fn free(self) -> Result<()> {
        match self {
            Ops::ScalarDecay(f, b) => f.free().and_then(|_| b.free()),
            Ops::GatedDelta(f, b) => f.free().and_then(|_| b.free()),
            Ops::Gla(f, b) => f.free().and_then(|_| b.free()),
        }
    }
}

/// One PE's shard on the device: the caller's log-decays `g` and the forgetting ones the
/// log-decay families' operations take.
struct Shard {
    family: PackedFamily,
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    forgetting_g: CudaSlice<f32>,
    beta: Option<CudaSlice<f32>>,
    o: CudaSlice<bf16>,
    /// What the forward saves for the backward: the state entering the shard (the log-decay
    /// families) or the state entering every chunk (GLA).
    start_state: CudaSlice<f32>,
    chunk_states: CudaSlice<bf16>,
    offsets: Offsets,
    shard_start: usize,
}

/// One PE's backward tensors.
struct ShardGrads {
    d_o: CudaSlice<bf16>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dbeta: Option<CudaSlice<f32>>,
}

impl ShardGrads {
    fn new(stream: &Arc<CudaStream>, shard: &Shard, d_o: &[bf16]) -> Result<Self> {
        let s = shard.shape;
        Ok(ShardGrads {
            d_o: stream.clone_htod(d_o)?,
            dq: stream.alloc_zeros(s.qk_len())?,
            dk: stream.alloc_zeros(s.qk_len())?,
            dv: stream.alloc_zeros(s.v_len())?,
            dg: stream.alloc_zeros(shard.g.len())?,
            dbeta: match shard.beta {
                Some(_) => Some(stream.alloc_zeros(s.gate_len())?),
                None => None,
            },
        })
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        for x in [&mut self.dq, &mut self.dk, &mut self.dv] {
            stream.memcpy_htod(&vec![bf16::from_bits(POISON); x.len()], x)?;
        }
        for x in [Some(&mut self.dg), self.dbeta.as_mut()]
            .into_iter()
            .flatten()
        {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); x.len()], x)?;
        }
        Ok(())
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> Result<GradBits> {
        GradBits::read(
            stream,
            GradBuffers {
                dq: &self.dq,
                dk: &self.dk,
                dv: &self.dv,
                dg: &self.dg,
                dbeta: self.dbeta.as_ref(),
                dh0: None,
            },
        )
    }
}

impl Shard {
    /// Allocates the shard of `family` at `shape` with its inputs and documents; the outputs and
    /// saved states zeroed.
    #[allow(clippy::too_many_arguments)]
    fn new(
        stream: &Arc<CudaStream>,
        family: PackedFamily,
        shape: ForwardShape,
        [q, k, v]: [&[bf16]; 3],
        g: &[f32],
        beta: Option<&[f32]>,
        offsets: Offsets,
        shard_start: usize,
    ) -> Result<Self> {
        let chunk_states = match family {
            PackedFamily::Gla => chunk_states_len(&shape),
            _ => 1,
        };
        Ok(Shard {
            family,
            shape,
            q: stream.clone_htod(q)?,
            k: stream.clone_htod(k)?,
            v: stream.clone_htod(v)?,
            g: stream.clone_htod(g)?,
            forgetting_g: stream.alloc_zeros(g.len())?,
            beta: beta.map(|b| stream.clone_htod(b)).transpose()?,
            o: stream.alloc_zeros(shape.v_len())?,
            start_state: stream.alloc_zeros(shape.state_len())?,
            chunk_states: stream.alloc_zeros(chunk_states)?,
            offsets,
            shard_start,
        })
    }

    fn gate_shape(&self) -> GateShape {
        GateShape {
            b: self.shape.b,
            t: self.shape.t,
            h: self.shape.h,
        }
    }

    fn documents(&self) -> Documents<'_> {
        Documents {
            cu_seqlens: self.offsets.view(),
            shard_start: self.shard_start,
        }
    }

    /// Enqueues the forgetting log-decays of the documents the offsets hold (GLA's operations
    /// write their start words themselves).
    fn mark(&mut self, starts: &DocumentStarts, stream: &Arc<CudaStream>) -> Result<()> {
        if self.family == PackedFamily::Gla {
            return Ok(());
        }
        let docs = Documents {
            cu_seqlens: self.offsets.view(),
            shard_start: self.shard_start,
        };
        let shape = self.gate_shape();
        starts.forgetting_gates(
            stream,
            docs,
            DeviceRef::new(&self.g),
            DeviceMut::new(&mut self.forgetting_g),
            shape,
        )
    }

    /// Enqueues the forward (saving the state entering the shard) with the forgetting log-decays
    /// where `packed`, else with the caller's (the same tokens as whole sequences). GLA's forward
    /// also writes the documents' final states into `document_ht` where given (the other
    /// families' come after the forward: [`DocumentStatesOp`]).
    fn forward(
        &mut self,
        ops: &mut Ops,
        stream: &Arc<CudaStream>,
        packed: bool,
        document_ht: Option<DeviceMut<'_, f32>>,
    ) -> Result<()> {
        if document_ht.is_some() && self.family != PackedFamily::Gla {
            return Err(Error::State(
                "only GLA's forward writes the documents' final states".into(),
            ));
        }
        let forgets = packed && self.family != PackedFamily::Gla;
        let g = DeviceRef::new(if forgets { &self.forgetting_g } else { &self.g });
        let documents = packed.then(|| Documents {
            cu_seqlens: self.offsets.view(),
            shard_start: self.shard_start,
        });
        let (q, k, v) = (
            DeviceRef::new(&self.q),
            DeviceRef::new(&self.k),
            DeviceRef::new(&self.v),
        );
        let start_state = Some(DeviceMut::new(&mut self.start_state));
        let o = DeviceMut::new(&mut self.o);
        match ops {
            Ops::ScalarDecay(op, _) => {
                let args = ForwardArgs {
                    shape: self.shape,
                    q,
                    k,
                    v,
                    g,
                    h0: None,
                    o,
                    ht: None,
                    scale: None,
                };
                op.forward_saving(stream, args, start_state)
            }
            Ops::GatedDelta(op, _) => {
                let beta = self
                    .beta
                    .as_ref()
                    .ok_or_else(|| Error::State("no beta".into()))?;
                let args = GatedDeltaArgs {
                    shape: self.shape,
                    q,
                    k,
                    v,
                    g,
                    beta: DeviceRef::new(beta),
                    h0: None,
                    o,
                    ht: None,
                    scale: None,
                };
                op.forward_saving(stream, args, start_state).map(|_| ())
            }
            Ops::Gla(op, _) => {
                let args = GlaArgs {
                    shape: self.shape,
                    q,
                    k,
                    v,
                    g,
                    h0: None,
                    o,
                    ht: None,
                    chunk_states: Some(DeviceMut::new(&mut self.chunk_states)),
                    scale: None,
                    documents,
                    document_ht,
                };
                op.forward(stream, args)
            }
        }
    }

    /// Enqueues the backward from what the forward saved (`packed` as in [`Shard::forward`]),
    /// then, for the log-decay families, clears dg at the document starts where `packed` (GLA's
    /// kernels write 0 there).
    fn backward(
        &self,
        grads: &mut ShardGrads,
        ops: &mut Ops,
        starts: &DocumentStarts,
        stream: &Arc<CudaStream>,
        packed: bool,
    ) -> Result<()> {
        let forgets = packed && self.family != PackedFamily::Gla;
        let g = DeviceRef::new(if forgets { &self.forgetting_g } else { &self.g });
        let (q, k, v) = (
            DeviceRef::new(&self.q),
            DeviceRef::new(&self.k),
            DeviceRef::new(&self.v),
        );
        let h0 = Some(DeviceRef::new(&self.start_state));
        let d_o = DeviceRef::new(&grads.d_o);
        let (dq, dk, dv, dg) = (
            DeviceMut::new(&mut grads.dq),
            DeviceMut::new(&mut grads.dk),
            DeviceMut::new(&mut grads.dv),
            DeviceMut::new(&mut grads.dg),
        );
        match ops {
            Ops::ScalarDecay(_, op) => {
                let args = BackwardArgs {
                    shape: self.shape,
                    q,
                    k,
                    v,
                    g,
                    h0,
                    d_o,
                    d_ht: None,
                    dq,
                    dk,
                    dv,
                    dg,
                    dh0: None,
                    scale: None,
                };
                op.backward(stream, args)?;
            }
            Ops::GatedDelta(_, op) => {
                let (beta, dbeta) = match (&self.beta, &mut grads.dbeta) {
                    (Some(beta), Some(dbeta)) => (DeviceRef::new(beta), DeviceMut::new(dbeta)),
                    _ => return Err(Error::State("no beta".into())),
                };
                let args = GatedDeltaBackwardArgs {
                    shape: self.shape,
                    q,
                    k,
                    v,
                    g,
                    beta,
                    h0,
                    d_o,
                    dht: None,
                    dq,
                    dk,
                    dv,
                    dg,
                    dbeta,
                    dh0: None,
                    scale: None,
                };
                op.backward(stream, args).map(|_| ())?;
            }
            Ops::Gla(_, op) => {
                let args = GlaBackwardArgs {
                    shape: self.shape,
                    q,
                    k,
                    v,
                    g,
                    h0: None,
                    chunk_states: DeviceRef::new(&self.chunk_states),
                    d_o,
                    dht: None,
                    dq,
                    dk,
                    dv,
                    dg,
                    dh0: None,
                    scale: None,
                    documents: packed.then(|| self.documents()),
                };
                op.backward(stream, args)?;
            }
        }
        if forgets {
            let dg = DeviceMut::new(&mut grads.dg);
            starts.clear_start_gradients(stream, self.documents(), dg, self.gate_shape())?;
        }
        Ok(())
    }
}

impl Outputs for Shard {
    type Bits = Vec<u16>;

    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memcpy_htod(&vec![bf16::from_bits(POISON); self.o.len()], &mut self.o)?;
        Ok(())
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> Result<Vec<u16>> {
        bf16_bits(stream, &self.o)
    }
}

/// A check: a family, its dimensions, the shards and the documents.
struct PackedCase {
    family: PackedFamily,
    b: usize,
    h: usize,
    dk: usize,
    dv: usize,
    lengths: Vec<usize>,
    /// fla's offsets of the whole sequence, `[0, ..., total]`.
    cu_seqlens: Vec<usize>,
    int64: bool,
}

impl NamedCase for PackedCase {
    fn name(&self) -> String {
        format!(
            "{:?}_B{}_H{}_Dk{}_Dv{}_shards{:?}_{}docs_{}",
            self.family,
            self.b,
            self.h,
            self.dk,
            self.dv,
            self.lengths,
            self.cu_seqlens.len() - 1,
            if self.int64 { "int64" } else { "int32" }
        )
    }
}

impl PackedCase {
    fn shape(&self) -> Shape {
        Shape {
            b: self.b,
            t: self.lengths.iter().sum(),
            h: self.h,
            dk: self.dk,
            dv: self.dv,
        }
    }

    fn doc_lengths(&self) -> Vec<usize> {
        self.cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// The checks on `npes` PEs: unequal shards of 320 tokens (the last 37 fewer), both layouts of
/// documents, each of `families`.
fn packed_cases(npes: usize, families: &[PackedFamily]) -> Vec<PackedCase> {
    let lengths = shard_lengths(npes, 320, 37);
    let total = lengths.iter().sum();
    let mut out = Vec::new();
    for &family in families {
        for (cu_seqlens, int64) in [
            (boundary_documents(&lengths), false),
            (short_documents(total), true),
        ] {
            out.push(PackedCase {
                family,
                b: 2,
                h: 2,
                dk: 128,
                dv: 128,
                lengths: lengths.clone(),
                cu_seqlens,
                int64,
            });
        }
    }
    out
}

/// What a case measured on one PE, for the JSON rows.
#[derive(Clone, Copy, Default)]
struct CaseErrors {
    o: f64,
    /// The documents' final states, against the reference's.
    final_states: Option<f64>,
    grads: f64,
    bitwise: bool,
}

fn check_case(
    rt: &Runtime,
    case: &PackedCase,
    seed: u64,
    graph_calls: u32,
    errors: &mut CaseErrors,
) -> Result<std::result::Result<String, String>> {
    let me = rt.pe();
    let family = case.family;
    let inputs = Inputs::generate(&InputSpec {
        shape: case.shape(),
        family: family.reference_family(),
        regime: Regime::Typical,
        seed,
        round_to_bf16: true,
        initial_state: false,
    })
    .map_err(|e| Error::State(format!("input generation: {e}")))?;
    let cot = Cotangents::generate(inputs.shape, seed, false, true)
        .map_err(|e| Error::State(format!("cotangent generation: {e}")))?;
    let packed = PackedInputs {
        inputs,
        cu_seqlens: case.cu_seqlens.clone(),
        h0: None,
    };
    let (want_o, want) = family.reference(&packed, &case.lengths, &cot.d_o)?;
    let inputs = &packed.inputs;
    let start: usize = case.lengths[..me].iter().sum();
    let len = case.lengths[me];
    let stream = rt.stream().clone();
    let shape = ForwardShape {
        b: case.b,
        t: len,
        h: case.h,
        dk: case.dk,
        dv: case.dv,
    };
    let offsets = padded_offsets(&case.cu_seqlens);
    let rows = |x: &Tensor| bf16s(&shard_rows(x, start, len));
    let beta = inputs
        .beta
        .as_ref()
        .map(|b| f32s(&shard_rows(b, start, len)));
    let mut shard = Shard::new(
        &stream,
        family,
        shape,
        [&rows(&inputs.q), &rows(&inputs.k), &rows(&inputs.v)],
        &f32s(&shard_rows(&inputs.g, start, len)),
        beta.as_deref(),
        Offsets::upload(&stream, &offsets, case.int64)?,
        start,
    )?;
    let starts = DocumentStarts::new(rt)?;
    starts.validate(&stream, shard.documents(), len, case.shape().t)?;
    let mut ops = Ops::new(rt, family, shape.layout())?;
    // Forward: every mode and a repeat.
    let (first, mut problems) = bits_in_every_mode(&mut ops, "forward", |ops| {
        shard.poison(&stream)?;
        shard.mark(&starts, &stream)?;
        shard.forward(ops, &stream, true, None)?;
        ops.finish(&stream)?;
        shard.bits(&stream)
    })?;
    // A graph of the marks and the forward, captured while the offsets held one document (the
    // whole sequence) and replayed after the documents were written into the same buffer.
    let total = *offsets.last().expect("offsets end with the total");
    shard
        .offsets
        .write(&stream, &one_document(offsets.len(), total))?;
    let replayed = replay_after(
        rt,
        &mut ops,
        &mut shard,
        graph_calls,
        &first,
        |shard, ops, stream| {
            shard
                .mark(&starts, stream)
                .and_then(|_| shard.forward(ops, stream, true, None))
        },
        |shard, stream| shard.offsets.write(stream, &offsets),
    )?;
    problems.extend(
        replayed
            .err()
            .map(|e| format!("{e} (captured before the documents were written)")),
    );
    let e_o = rel_err(&bf16_values(&first), &shard_rows(&want_o, start, len));
    if e_o.is_nan() || e_o > TOL {
        problems.push(format!("o: rel err {e_o:.3e} > {TOL:.0e}"));
    }
    let (e_ht, ht_problems) =
        check_document_states(rt, &mut shard, &mut ops, &packed, case, start, len)?;
    problems.extend(ht_problems);
    let e_ht = Some(e_ht);
    // Backward, from the state the last forward saved.
    let d_o = bf16s(&shard_rows(&cot.d_o, start, len));
    let mut grads = ShardGrads::new(&stream, &shard, &d_o)?;
    let (grad_bits, grad_problems) = bits_in_every_mode(&mut ops, "backward", |ops| {
        grads.poison(&stream)?;
        shard.backward(&mut grads, ops, &starts, &stream, true)?;
        ops.finish(&stream)?;
        grads.bits(&stream)
    })?;
    problems.extend(grad_problems);
    ops.free()?;
    let f32_err =
        |got: &[u32], want: &Tensor| rel_err(&f32_values(got), &shard_rows(want, start, len));
    let got = [&grad_bits.dq[..], &grad_bits.dk, &grad_bits.dv];
    let mut grad_errs: Vec<_> = qkv_rows(got, [&want.dq, &want.dk, &want.dv], start, len)
        .into_iter()
        .map(|(name, got, want)| (name, rel_err(&got, &want), TOL))
        .collect();
    grad_errs.push(("dg", f32_err(&grad_bits.dg, &want.dg), family.gate_tol()));
    if let Some(want_dbeta) = &want.dbeta {
        let e = f32_err(&grad_bits.dbeta, want_dbeta);
        grad_errs.push(("dbeta", e, family.gate_tol()));
    }
    for (name, e, tol) in &grad_errs {
        if e.is_nan() || e > tol {
            problems.push(format!("{name}: rel err {e:.3e} > {tol:.0e}"));
        }
    }
    let per_head = family.gates_per_head(case.dk);
    let nonzero_at_starts = starts_in_shard(&case.cu_seqlens, start, len)
        .flat_map(|t| {
            (0..case.b).flat_map(move |b| (0..case.h).map(move |h| (b * len + t) * case.h + h))
        })
        .flat_map(|row| &grad_bits.dg[row * per_head..(row + 1) * per_head])
        .filter(|&&bits| bits != 0)
        .count();
    if nonzero_at_starts > 0 {
        problems.push(format!(
            "dg: {nonzero_at_starts} values at document starts are not +0"
        ));
    }
    let grad_max = grad_errs.iter().map(|(_, e, _)| *e).fold(0.0, f64::max);
    *errors = CaseErrors {
        o: e_o,
        final_states: e_ht,
        grads: grad_max,
        bitwise: !problems
            .iter()
            .any(|p| p.contains("bits") || p.contains("differs")),
    };
    let ht_detail = e_ht.map_or(String::new(), |e| {
        format!(", document final states {e:.2e}")
    });
    let detail = format!(
        "rel err o {e_o:.2e}{ht_detail}; {}",
        grad_errs
            .iter()
            .map(|(n, e, _)| format!("{n} {e:.2e}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    Ok(if problems.is_empty() {
        Ok(format!(
            "{detail}; every mode, a repeat and {graph_calls} graph replays with the documents \
             written after the capture bitwise equal"
        ))
    } else {
        Err(format!("{detail}: {}", problems.join("; ")))
    })
}

/// A log-decay family's final states of packed documents (one value per case: the variants'
/// sizes do not matter).
#[allow(clippy::large_enum_variant)]
enum DocumentStatesOp {
    ScalarDecay(ScalarDecayDocumentStates),
    GatedDelta(GatedDeltaDocumentStates),
    /// GLA's LASP-2 forward writes them itself.
    Gla,
}

impl DocumentStatesOp {
    fn new(rt: &Runtime, family: PackedFamily) -> Result<Self> {
        Ok(match family {
            PackedFamily::GatedDelta => {
                DocumentStatesOp::GatedDelta(GatedDeltaDocumentStates::new(rt)?)
            }
            PackedFamily::Gla => DocumentStatesOp::Gla,
            PackedFamily::ScalarDecay => {
                DocumentStatesOp::ScalarDecay(ScalarDecayDocumentStates::new(rt)?)
            }
        })
    }

    /// The final states of `shard`'s documents into `ht`: from the state its forward saved, or
    /// (GLA) by the packed forward itself, with `ops`.
    fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        shard: &mut Shard,
        ops: &mut Ops,
        ht: DeviceMut<'_, f32>,
    ) -> Result<()> {
        if let DocumentStatesOp::Gla = self {
            shard.forward(ops, stream, true, Some(ht))?;
            return ops.finish(stream);
        }
        let (k, v, g) = (
            DeviceRef::new(&shard.k),
            DeviceRef::new(&shard.v),
            DeviceRef::new(&shard.forgetting_g),
        );
        let h0 = Some(DeviceRef::new(&shard.start_state));
        match self {
            DocumentStatesOp::ScalarDecay(op) => op.launch(
                stream,
                DocumentStatesArgs {
                    shape: shard.shape,
                    k,
                    v,
                    g,
                    h0,
                    documents: shard.documents(),
                    ht,
                },
            ),
            DocumentStatesOp::GatedDelta(op) => {
                let beta = shard
                    .beta
                    .as_ref()
                    .ok_or_else(|| Error::State("no beta".into()))?;
                op.launch(
                    stream,
                    GatedDeltaDocumentStatesArgs {
                        shape: shard.shape,
                        k,
                        v,
                        g,
                        beta: DeviceRef::new(beta),
                        h0,
                        documents: shard.documents(),
                        ht,
                    },
                )
            }
            DocumentStatesOp::Gla => unreachable!("GLA's states come from its forward, above"),
        }
    }
}

/// The final state of every document (scalar decay, Gated DeltaNet: from the state the forward
/// saved as entering the shard; GLA: by the packed forward itself): each document that ends in
/// the shard against the reference's packed LASP-2 decomposition (`TOL`), every other slot (the
/// padding's empty documents too) exactly +0, poisoned before each call, a repeat bitwise equal.
/// Returns the relative error and the problems.
fn check_document_states(
    rt: &Runtime,
    shard: &mut Shard,
    ops: &mut Ops,
    packed: &PackedInputs,
    case: &PackedCase,
    start: usize,
    len: usize,
) -> Result<(f64, Vec<String>)> {
    let stream = rt.stream().clone();
    let fail = |e: lasp_shmem::reference::ReferenceError| Error::State(format!("reference: {e}"));
    let want = match case.family {
        PackedFamily::GatedDelta => {
            lasp2::packed_delta_forward(packed, &case.lengths, 64)
                .map_err(fail)?
                .final_states
        }
        PackedFamily::Gla => {
            lasp2::packed_forward(packed, Decay::Vector { sub_chunk: 16 }, &case.lengths, 64)
                .map_err(fail)?
                .final_states
        }
        PackedFamily::ScalarDecay => {
            lasp2::packed_forward(packed, Decay::Scalar, &case.lengths, 64)
                .map_err(fail)?
                .final_states
        }
    };
    let block = case.h * case.dk * case.dv;
    let states_len = document_states_len(&shard.shape, &shard.documents());
    let slots = states_len / (case.b * block);
    let mut ht = stream.alloc_zeros::<f32>(states_len)?;
    let mut states = DocumentStatesOp::new(rt, case.family)?;
    let mut run = |ht: &mut CudaSlice<f32>| -> Result<Vec<u32>> {
        stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); ht.len()], ht)?;
        states.launch(&stream, shard, ops, DeviceMut::new(ht))?;
        Ok(stream
            .clone_dtoh(ht)?
            .into_iter()
            .map(f32::to_bits)
            .collect())
    };
    let first = run(&mut ht)?;
    let again = run(&mut ht)?;
    let mut problems = Vec::new();
    if first != again {
        problems.push("document final states: a repeat differs in its bits".to_string());
    }
    let (mut got, mut reference, mut not_zero) = (Vec::new(), Vec::new(), 0);
    for b in 0..case.b {
        for n in 0..slots {
            let at = (b * slots + n) * block;
            let values = &first[at..at + block];
            let ends_here = n + 1 < case.cu_seqlens.len()
                && case.cu_seqlens[n + 1] > start
                && case.cu_seqlens[n + 1] <= start + len;
            if ends_here {
                let docs = case.cu_seqlens.len() - 1;
                let from = (b * docs + n) * block;
                got.extend(values.iter().map(|&x| f64::from(f32::from_bits(x))));
                reference.extend_from_slice(&want.data()[from..from + block]);
            } else {
                not_zero += values.iter().filter(|&&x| x != 0).count();
            }
        }
    }
    let e = rel_err(&got, &reference);
    if e.is_nan() || e > TOL {
        problems.push(format!(
            "document final states: rel err {e:.3e} > {TOL:.0e}"
        ));
    }
    if not_zero > 0 {
        problems.push(format!(
            "document final states: {not_zero} values of documents that end on other PEs are not +0"
        ));
    }
    Ok((e, problems))
}

/// One row of the JSON: a case's largest errors over the PEs.
#[derive(Serialize)]
struct CaseRow {
    family: PackedFamily,
    w: usize,
    shard_lengths: Vec<usize>,
    doc_lengths: Vec<usize>,
    rel_err_vs_f64: f64,
    /// The documents' final states.
    #[serde(skip_serializing_if = "Option::is_none")]
    final_state_rel_err_vs_f64: Option<f64>,
    grad_rel_err_vs_f64: f64,
    modes_bitwise: bool,
}

/// One timed shape: a training step on packed documents against the same tokens unpacked.
#[derive(Serialize)]
struct CostRow {
    family: PackedFamily,
    #[serde(flatten)]
    cost: PackedCost,
    /// The documents' final states.
    #[serde(skip_serializing_if = "Option::is_none")]
    document_states: Option<DocumentStatesCost>,
}

#[derive(Serialize)]
struct Report {
    cases: Vec<CaseRow>,
    cost: Vec<CostRow>,
}

/// A training step (or its forward alone) on one PE's shard, on its documents or unpacked.
struct Step<'a> {
    shard: &'a mut Shard,
    grads: &'a mut ShardGrads,
    ops: &'a mut Ops,
    starts: &'a DocumentStarts,
    packed: bool,
    forward_only: bool,
}

impl ModeCall for Step<'_> {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.ops.set_mode(mode)
    }

    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.packed {
            self.shard.mark(self.starts, stream)?;
        }
        self.shard.forward(self.ops, stream, self.packed, None)?;
        if self.forward_only {
            return Ok(());
        }
        self.shard
            .backward(self.grads, self.ops, self.starts, stream, self.packed)
    }

    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.ops.finish(stream)
    }
}

/// A training step of `family` at `shape` per GPU (inputs as gated_delta_lasp2 times them), on
/// mixed documents and unpacked, in turns.
fn time_cost(rt: &Runtime, family: PackedFamily, shape: ForwardShape) -> Result<CostRow> {
    let (me, npes) = (rt.pe(), rt.npes());
    let stream = rt.stream().clone();
    let mut rng = SplitMix64::new(11 + me as u64);
    let TimedInputs { q, k, v, g, beta } = TimedInputs::draw(&mut rng, shape);
    // GLA's gates per key dimension, drawn as the others.
    let g = match family {
        PackedFamily::Gla => log_decays(&mut rng, shape.qk_len()),
        _ => g,
    };
    // Every PE draws the same documents.
    let cu_seqlens = mixed_documents(npes * shape.t, &mut SplitMix64::new(5));
    let mut shard = Shard::new(
        &stream,
        family,
        shape,
        [&q, &k, &v],
        &g,
        (family == PackedFamily::GatedDelta).then_some(&beta[..]),
        Offsets::upload(&stream, &cu_seqlens, false)?,
        me * shape.t,
    )?;
    let d_o = bf16s(&normals(&mut rng, shape.v_len()));
    let mut grads = ShardGrads::new(&stream, &shard, &d_o)?;
    let starts = DocumentStarts::new(rt)?;
    let mut ops = Ops::new(rt, family, shape.layout())?;
    let mut step = Step {
        shard: &mut shard,
        grads: &mut grads,
        ops: &mut ops,
        starts: &starts,
        packed: false,
        forward_only: false,
    };
    let cost = PackedCost::measure(
        rt,
        shape,
        cu_seqlens.len() - 1,
        &mut step,
        |step, packed, forward_only| {
            step.packed = packed;
            step.forward_only = forward_only;
        },
    )?;
    // The packed forward once more, so that the start state and the forgetting log-decays are
    // the documents'.
    shard.mark(&starts, &stream)?;
    shard.forward(&mut ops, &stream, true, None)?;
    ops.finish(&stream)?;
    let document_states = Some(time_document_states(rt, &mut shard, &mut ops)?);
    ops.free()?;
    if me == 0 {
        let states = document_states.map_or(String::new(), |c| {
            let mut parts = Vec::new();
            if let Some(after) = c.after_forward_ms {
                parts.push(format!("after the forward {after:.4} ms"));
            }
            if let (Some(with), Some(plain)) = (c.forward_with_states_ms, c.single_gpu_forward_ms) {
                parts.push(format!(
                    "the single-GPU forward with them {with:.4} ms against it alone {plain:.4} ms"
                ));
            }
            if let (Some(with), Some(plain)) = (c.lasp2_forward_with_states_ms, c.lasp2_forward_ms)
            {
                parts.push(format!(
                    "the LASP-2 forward with them {with:.4} ms against it alone {plain:.4} ms"
                ));
            }
            format!("; the documents' final states: {}", parts.join(", "))
        });
        println!("{}{states}", cost.line(&format!("{family:?}")));
    }
    Ok(CostRow {
        family,
        cost,
        document_states,
    })
}

/// The documents' final states on this PE: for scalar decay and Gated DeltaNet after the forward,
/// from the state it saved, and for scalar decay on one PE also the forward that stores the
/// entering states followed by them (`launch_forward`) and the plain single-GPU forward; for GLA
/// the packed LASP-2 forward with them and without. Each in turn with the others, 30 calls after
/// 5 unrecorded, CUDA events around each call, the medians.
fn time_document_states(
    rt: &Runtime,
    shard: &mut Shard,
    ops: &mut Ops,
) -> Result<DocumentStatesCost> {
    #[derive(Clone, Copy, PartialEq)]
    enum Turn {
        AfterForward,
        ForwardWithStates,
        Forward,
        Lasp2ForwardWithStates,
        Lasp2Forward,
    }
    let stream = rt.stream().clone();
    let mut ht =
        stream.alloc_zeros::<f32>(document_states_len(&shard.shape, &shard.documents()))?;
    let mut after = DocumentStatesOp::new(rt, shard.family)?;
    let mut states = ScalarDecayDocumentStates::new(rt)?;
    let mut plain = ScalarDecayForward::new(rt)?;
    let turns: &[Turn] = match shard.family {
        PackedFamily::Gla => &[Turn::Lasp2ForwardWithStates, Turn::Lasp2Forward],
        PackedFamily::ScalarDecay if rt.npes() == 1 => {
            &[Turn::AfterForward, Turn::ForwardWithStates, Turn::Forward]
        }
        _ => &[Turn::AfterForward],
    };
    let mut times = vec![Vec::new(); turns.len()];
    for call in 0..35 {
        for (&turn, times) in turns.iter().zip(times.iter_mut()) {
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            let documents = Documents {
                cu_seqlens: shard.offsets.view(),
                shard_start: shard.shard_start,
            };
            let (k, v, g) = (
                DeviceRef::new(&shard.k),
                DeviceRef::new(&shard.v),
                DeviceRef::new(&shard.forgetting_g),
            );
            let forward = ForwardArgs {
                shape: shard.shape,
                q: DeviceRef::new(&shard.q),
                k,
                v,
                g,
                h0: None,
                o: DeviceMut::new(&mut shard.o),
                ht: None,
                scale: None,
            };
            match turn {
                Turn::ForwardWithStates => {
                    states.launch_forward(&stream, forward, documents, DeviceMut::new(&mut ht))?
                }
                Turn::Forward => plain.launch(&stream, forward).map(|_| ())?,
                Turn::AfterForward => after.launch(&stream, shard, ops, DeviceMut::new(&mut ht))?,
                Turn::Lasp2ForwardWithStates => {
                    shard.forward(ops, &stream, true, Some(DeviceMut::new(&mut ht)))?
                }
                Turn::Lasp2Forward => shard.forward(ops, &stream, true, None)?,
            }
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            end.synchronize()?;
            ops.finish(&stream)?;
            if call >= 5 {
                times.push(start.elapsed_ms(&end)? as f64);
            }
        }
    }
    let medians: Vec<f64> = times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect();
    let turn = |want: Turn| turns.iter().position(|&t| t == want).map(|i| medians[i]);
    Ok(DocumentStatesCost {
        after_forward_ms: turn(Turn::AfterForward),
        forward_with_states_ms: turn(Turn::ForwardWithStates),
        single_gpu_forward_ms: turn(Turn::Forward),
        lasp2_forward_with_states_ms: turn(Turn::Lasp2ForwardWithStates),
        lasp2_forward_ms: turn(Turn::Lasp2Forward),
    })
}

/// What the documents' final states cost, rank 0's medians.
#[derive(Clone, Copy, Serialize)]
struct DocumentStatesCost {
    /// From the state the packed forward saved: the walk and the states kernel (scalar decay,
    /// Gated DeltaNet).
    #[serde(skip_serializing_if = "Option::is_none")]
    after_forward_ms: Option<f64>,
    /// One GPU: the forward that stores the entering states, then the states kernel.
    #[serde(skip_serializing_if = "Option::is_none")]
    forward_with_states_ms: Option<f64>,
    /// One GPU: the single-GPU forward alone (ScalarDecayForward), timed in turn with the above.
    #[serde(skip_serializing_if = "Option::is_none")]
    single_gpu_forward_ms: Option<f64>,
    /// GLA: the packed LASP-2 forward that stores the entering states, then the states kernel.
    #[serde(skip_serializing_if = "Option::is_none")]
    lasp2_forward_with_states_ms: Option<f64>,
    /// GLA: the packed LASP-2 forward alone, timed in turn with the above.
    #[serde(skip_serializing_if = "Option::is_none")]
    lasp2_forward_ms: Option<f64>,
}

fn run(options: Options, config: Config) -> Result<bool> {
    let rt = Runtime::init(config)?;
    let families = if options.families.is_empty() {
        FAMILIES.to_vec()
    } else {
        options.families.clone()
    };
    let mut case_rows = Vec::new();
    let failed = if options.no_check {
        0
    } else {
        let cases = packed_cases(rt.npes(), &families);
        let mut errors = Vec::new();
        let failed = run_cases(&rt, &cases, 3800, |case, seed| {
            let mut e = CaseErrors::default();
            let verdict = check_case(&rt, case, seed, options.graph_calls, &mut e);
            errors.push(e);
            verdict
        })?;
        for (case, e) in cases.iter().zip(errors) {
            case_rows.push(CaseRow {
                family: case.family,
                w: rt.npes(),
                shard_lengths: case.lengths.clone(),
                doc_lengths: case.doc_lengths(),
                rel_err_vs_f64: max_over_pes(&rt, e.o)?,
                final_state_rel_err_vs_f64: e
                    .final_states
                    .map(|x| max_over_pes(&rt, x))
                    .transpose()?,
                grad_rel_err_vs_f64: max_over_pes(&rt, e.grads)?,
                modes_bitwise: max_over_pes(&rt, if e.bitwise { 0.0 } else { 1.0 })? == 0.0,
            });
        }
        failed
    };
    let mut cost = Vec::new();
    for &shape in &options.time {
        for &family in &families {
            cost.push(time_cost(&rt, family, shape)?);
        }
    }
    if let (Some(path), 0) = (&options.json, rt.pe()) {
        write_json(
            path,
            &Report {
                cases: case_rows,
                cost,
            },
        )?;
    }
    rt.shutdown()?;
    Ok(failed == 0)
}

/// A heap for a forward and a backward exchange of the largest layout, timed or checked (one
/// family's operations at a time).
fn config(options: &Options, npes: usize) -> Result<Config> {
    let checks = Lasp2Layout {
        b: 2,
        h: 2,
        dk: 128,
        dv: 128,
    };
    heap_config(&options.time, checks, |l| {
        let one_family = l
            .symmetric_bytes::<ScalarDecay>(npes)
            .max(l.symmetric_bytes::<GatedDelta>(npes))
            .max(l.symmetric_bytes::<Gla>(npes));
        2 * one_family
    })
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe { main_under_launcher("packed_lasp2", Options::parse(), config, run) }
}
