//! GLA over packed documents (`cu_seqlens`) on one GPU: `GlaForward` and `GlaBackward` with
//! `documents`, against the reference's token-by-token recurrence run document by document
//! (`reference::packed`).
//!
//! The documents are 1, 63, 64, 65, 17 and 200 tokens in turn, so starts fall on a chunk's first
//! and last token, several in one chunk and none in others; each case runs with one segment per
//! sequence and with segments and states pieces forced, so that the states pass, its fold and the
//! backward's summaries cross starts too. o, dq, dk, dv within 5e-3 of the reference (relative to
//! their norms), dg within 5e-3 of its scale, dg exactly 0 at every start; outputs and gradients
//! are poisoned before the run, and a second run is bitwise equal.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::documents::{DocumentOffsets, Documents};
use lasp_shmem::ops::gla::{chunk_states_len, GlaArgs, GlaBackward, GlaBackwardArgs, GlaForward};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::packed::{recurrent_backward, recurrent_forward, PackedInputs};
use lasp_shmem::reference::{
    assert_close_to_scale, Cotangents, Family, GateKind, InputSpec, Inputs, Regime, Shape,
};
use lasp_shmem_examples::short_documents;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    bf16_values, bits_of_bf16, bits_of_f32, compare, err, f32_values, on_one_gpu, to_bf16, to_f32,
    CheckResult, POISON_BF16, POISON_F32,
};

const TOL: f64 = 5e-3;
const LIMIT: Duration = Duration::from_secs(300);

struct Case {
    shape: Shape,
    /// Forced segments per sequence (forward and backward) and states pieces per segment.
    segments: Option<u32>,
    splits: Option<u32>,
}

/// The outputs and gradients of one forward and backward, as bits.
#[derive(PartialEq)]
struct RunBits {
    o: Vec<u16>,
    dq: Vec<u16>,
    dk: Vec<u16>,
    dv: Vec<u16>,
    dg: Vec<u32>,
}

struct Buffers {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    d_o: CudaSlice<bf16>,
    o: CudaSlice<bf16>,
    states: CudaSlice<bf16>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    offsets: CudaSlice<i32>,
}

fn run(
    fwd: &mut GlaForward,
    bwd: &mut GlaBackward,
    stream: &Arc<CudaStream>,
    shape: ForwardShape,
    x: &mut Buffers,
) -> std::result::Result<RunBits, String> {
    for buf in [&mut x.o, &mut x.states, &mut x.dq, &mut x.dk, &mut x.dv] {
        let poison = vec![bf16::from_bits(POISON_BF16); buf.len()];
        stream.memcpy_htod(&poison, buf).map_err(err)?;
    }
    let poison = vec![f32::from_bits(POISON_F32); x.dg.len()];
    stream.memcpy_htod(&poison, &mut x.dg).map_err(err)?;
    let docs = Documents {
        cu_seqlens: DocumentOffsets::I32(DeviceRef::new(&x.offsets)),
        shard_start: 0,
    };
    let (q, k, v, g) = (
        DeviceRef::new(&x.q),
        DeviceRef::new(&x.k),
        DeviceRef::new(&x.v),
        DeviceRef::new(&x.g),
    );
    let args = GlaArgs {
        shape,
        q,
        k,
        v,
        g,
        h0: None,
        o: DeviceMut::new(&mut x.o),
        ht: None,
        chunk_states: Some(DeviceMut::new(&mut x.states)),
        scale: None,
        documents: Some(docs),
        document_ht: None,
    };
    fwd.launch(stream, args)
        .map_err(|e| format!("forward: {e}"))?;
    let args = GlaBackwardArgs {
        shape,
        q,
        k,
        v,
        g,
        h0: None,
        chunk_states: DeviceRef::new(&x.states),
        d_o: DeviceRef::new(&x.d_o),
        dht: None,
        dq: DeviceMut::new(&mut x.dq),
        dk: DeviceMut::new(&mut x.dk),
        dv: DeviceMut::new(&mut x.dv),
        dg: DeviceMut::new(&mut x.dg),
        dh0: None,
        scale: None,
        documents: Some(docs),
    };
    bwd.launch(stream, args)
        .map_err(|e| format!("backward: {e}"))?;
    stream.synchronize().map_err(|e| format!("kernels: {e}"))?;
    Ok(RunBits {
        o: bits_of_bf16(stream, &x.o)?,
        dq: bits_of_bf16(stream, &x.dq)?,
        dk: bits_of_bf16(stream, &x.dk)?,
        dv: bits_of_bf16(stream, &x.dv)?,
        dg: bits_of_f32(stream, &x.dg)?,
    })
}

fn run_case(
    fwd: &mut GlaForward,
    bwd: &mut GlaBackward,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> CheckResult {
    let s = case.shape;
    let inputs = Inputs::generate(&InputSpec {
        shape: s,
        family: Family::Gla,
        regime: Regime::Typical,
        seed: 91 + s.t as u64,
        round_to_bf16: true,
        initial_state: false,
    })
    .map_err(err)?;
    let cot = Cotangents::generate(s, 17, false, true).map_err(err)?;
    let cu_seqlens = short_documents(s.t);
    let packed = PackedInputs {
        inputs,
        cu_seqlens: cu_seqlens.clone(),
        h0: None,
    };
    let want = recurrent_forward(&packed, GateKind::Vector).map_err(err)?;
    let want_grads = recurrent_backward(&packed, GateKind::Vector, &cot.d_o, None).map_err(err)?;
    let inputs = &packed.inputs;
    let shape = ForwardShape {
        b: s.b,
        t: s.t,
        h: s.h,
        dk: s.dk,
        dv: s.dv,
    };
    fwd.set_num_segments(case.segments).map_err(err)?;
    fwd.set_states_splits(case.splits);
    bwd.set_num_segments(case.segments).map_err(err)?;
    let offsets: Vec<i32> = cu_seqlens.iter().map(|&o| o as i32).collect();
    let mut x = Buffers {
        q: stream.clone_htod(&to_bf16(&inputs.q)).map_err(err)?,
        k: stream.clone_htod(&to_bf16(&inputs.k)).map_err(err)?,
        v: stream.clone_htod(&to_bf16(&inputs.v)).map_err(err)?,
        g: stream.clone_htod(&to_f32(&inputs.g)).map_err(err)?,
        d_o: stream.clone_htod(&to_bf16(&cot.d_o)).map_err(err)?,
        o: stream.alloc_zeros(shape.v_len()).map_err(err)?,
        states: stream.alloc_zeros(chunk_states_len(&shape)).map_err(err)?,
        dq: stream.alloc_zeros(shape.qk_len()).map_err(err)?,
        dk: stream.alloc_zeros(shape.qk_len()).map_err(err)?,
        dv: stream.alloc_zeros(shape.v_len()).map_err(err)?,
        dg: stream.alloc_zeros(shape.qk_len()).map_err(err)?,
        offsets: stream.clone_htod(&offsets).map_err(err)?,
    };
    let first = run(fwd, bwd, stream, shape, &mut x)?;
    let e_o = compare("o", &bf16_values(&first.o), &want.o, TOL)?;
    let e_dq = compare("dq", &bf16_values(&first.dq), &want_grads.dq, TOL)?;
    let e_dk = compare("dk", &bf16_values(&first.dk), &want_grads.dk, TOL)?;
    let e_dv = compare("dv", &bf16_values(&first.dv), &want_grads.dv, TOL)?;
    let dg = f32_values(&first.dg);
    assert_close_to_scale(
        "dg",
        &dg,
        want_grads.dg.data(),
        want_grads.gate_grad_scale(inputs),
        TOL,
    )?;
    let row = s.dk;
    let at_starts = cu_seqlens[..cu_seqlens.len() - 1]
        .iter()
        .flat_map(|&t| (0..s.b).flat_map(move |b| (0..s.h).map(move |h| (b * s.t + t) * s.h + h)))
        .flat_map(|r| &first.dg[r * row..(r + 1) * row])
        .filter(|&&bits| bits != 0)
        .count();
    if at_starts > 0 {
        return Err(format!(
            "dg: {at_starts} values at document starts are not +0"
        ));
    }
    if run(fwd, bwd, stream, shape, &mut x)? != first {
        return Err("a second run gave other bits".into());
    }
    Ok(format!(
        "{} documents; rel err o {e_o:.2e} dq {e_dq:.2e} dk {e_dk:.2e} dv {e_dv:.2e}, dg within \
         {TOL:.0e} of its scale and 0 at the starts; a repeat bitwise equal",
        cu_seqlens.len() - 1
    ))
}

#[test]
fn gla_packed_documents_match_the_reference() {
    on_one_gpu(LIMIT, |rt, report| {
        let (mut fwd, mut bwd) = match (GlaForward::new(rt), GlaBackward::new(rt)) {
            (Ok(f), Ok(b)) => (f, b),
            (Err(e), _) | (_, Err(e)) => return report.record("gla_init", Err(e.to_string()), 0.0),
        };
        let shape = |b, t, dk, dv| Shape { b, t, h: 2, dk, dv };
        let cases = [
            (shape(2, 700, 128, 128), None, None),
            (shape(2, 700, 128, 128), Some(3), Some(2)),
            (shape(1, 1000, 64, 128), Some(4), Some(3)),
            (shape(1, 513, 128, 64), None, None),
        ];
        for (shape, segments, splits) in cases {
            let case = Case {
                shape,
                segments,
                splits,
            };
            let name = format!(
                "gla_packed_B{}_T{}_Dk{}_Dv{}_segments{:?}_splits{:?}",
                shape.b, shape.t, shape.dk, shape.dv, segments, splits
            );
            report.timed(&name, || run_case(&mut fwd, &mut bwd, rt.stream(), &case));
        }
    });
}
