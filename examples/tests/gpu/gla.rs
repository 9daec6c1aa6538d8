//! The GLA forward and backward (`ops::gla`) against the CPU f64 reference, on one GPU.
//!
//! Inputs come from `reference::Inputs::generate` for the GLA family, rounded to bf16 (q, k, v)
//! and f32 (g, h0, scale), so the GPU sees exactly the values the reference computes with. For
//! every case: o and ht are poisoned before each run and must be fully overwritten;
//! `||x - ref|| / ||ref|| <= 5e-3` for o and the final state; a second run gives bitwise identical
//! o and ht; g and h0 are left unchanged. The gate regimes cover every path of the kernels: the
//! usual gates (every chunk's scores one tensor-core product), gates at 0, gates at -30 per token
//! (every chunk steep: its scores term by term) and a mix within a chunk. Calls that must be
//! rejected are checked to fail before any launch.
//!
//! The backward gets the same inputs and a random d_o and dht (`reference::Cotangents`), and is
//! held to the chunkwise reference `reference::gla::backward` (chunks of 64, sub-chunks of 16):
//! dq, dk, dv and dh0 are poisoned before each run and must be fully overwritten, with
//! `||x - ref|| / ||ref|| <= 5e-3`; dg too, within `5e-3` of its scale
//! (`Grads::gate_grad_scale`: under steep gates its terms cancel to far below their size, so its
//! own norm is no measure). A second run gives bitwise identical gradients; g and h0 are left
//! unchanged.

use cudarc::driver::CudaSlice;
use cudarc::driver::CudaStream;
use lasp_shmem::ops::gla::{
    chunk_states_len, GlaArgs, GlaBackward, GlaBackwardArgs, GlaForward, GlaPlan,
};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{
    assert_close_to_scale, gla, Cotangents, Family, InputSpec, Inputs, Regime, Shape, Tensor,
};
use lasp_shmem::Error;
use lasp_shmem_examples::grad_bits::{GradBits, GradBuffers};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    bf16_values, bits_of_bf16, bits_of_f32, compare, err, f32_values, is_small, on_one_gpu,
    to_bf16, to_f32, unwritten, CheckResult, ForwardBuffers, Report, POISON_BF16, POISON_F32,
};

const TOL: f64 = 5e-3;

#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    regime: Regime,
    h0: bool,
    segments: Option<u32>,
    /// Forced states pieces per segment (else the plan's).
    splits: Option<u32>,
    seed: u64,
}

/// A case's name up to its gate regime: `{prefix}_B.._H.._T.._Dk.._Dv.._{regime}`.
fn shape_name(prefix: &str, s: &Shape, regime: Regime) -> String {
    format!(
        "{prefix}_B{}_H{}_T{}_Dk{}_Dv{}_{regime:?}",
        s.b, s.h, s.t, s.dk, s.dv
    )
}

impl Case {
    fn name(&self) -> String {
        format!(
            "{}{}{}{}",
            shape_name("gla", &self.shape, self.regime),
            if self.h0 { "_h0" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}")),
            self.splits.map_or(String::new(), |n| format!("_R{n}"))
        )
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 700;
    let mut add_split = |b, h, t, dk, dv, regime, h0, segments, splits| {
        seed += 1;
        out.push(Case {
            shape: Shape { b, t, h, dk, dv },
            regime,
            h0,
            segments,
            splits,
            seed,
        });
    };
    let mut add = |b, h, t, dk, dv, regime, h0, segments| {
        add_split(b, h, t, dk, dv, regime, h0, segments, None)
    };
    use Regime::*;
    // B*H = 1: ragged and whole chunks, every (Dk, Dv); the automatic plan splits T >= 65.
    for t in [1, 63, 64, 65, 1000] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, true, None);
        }
    }
    // Every gate regime, one segment and several.
    for regime in [NoDecay, StrongDecay, Mixed, LargeNorm] {
        for (dk, dv) in [(128, 128), (64, 64)] {
            add(1, 1, 1000, dk, dv, regime, true, None);
            add(1, 1, 1000, dk, dv, regime, false, Some(1));
        }
    }
    // Forced segment counts, an uneven last segment (128 chunks in 3).
    for s in [2, 5, 16] {
        add(1, 1, 1000, 128, 128, Mixed, true, Some(s));
    }
    add(1, 1, 8191, 128, 128, Typical, true, Some(3));
    add(1, 2, 8191, 128, 128, Typical, true, None);
    // Several batches and heads (the [B, T, H, D] indexing), and B*H = 256.
    add(2, 3, 1000, 128, 128, Typical, true, None);
    add(3, 5, 130, 64, 128, Mixed, true, Some(2));
    add(4, 64, 200, 64, 64, Typical, true, None);
    add(4, 64, 130, 128, 128, Mixed, true, Some(2));
    // States pieces: one per segment, and 4 over segments of 5 chunks (the last piece empty).
    add_split(1, 2, 1000, 128, 128, Mixed, true, Some(3), Some(1));
    add_split(1, 2, 1600, 64, 128, Typical, true, Some(5), Some(4));
    out
}

/// GLA's arguments over the shared forward buffers.
trait GlaArgsOf {
    fn args(&mut self, shape: ForwardShape, scale: f32) -> GlaArgs<'_>;
}

impl GlaArgsOf for ForwardBuffers {
    fn args(&mut self, shape: ForwardShape, scale: f32) -> GlaArgs<'_> {
        GlaArgs {
            shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: self.h0.as_ref().map(DeviceRef::new),
            o: DeviceMut::new(&mut self.o),
            ht: Some(DeviceMut::new(&mut self.ht)),
            chunk_states: None,
            scale: Some(scale),
            documents: None,
            document_ht: None,
        }
    }
}

/// The bits one forward run left in o, ht and the chunk states.
struct ForwardBits {
    o: Vec<u16>,
    ht: Vec<u32>,
    states: Vec<u16>,
}

/// One run on poisoned outputs: their bits, and the plan.
fn run_once(
    fwd: &mut GlaForward,
    stream: &Arc<CudaStream>,
    dev: &mut ForwardBuffers,
    states: &mut CudaSlice<bf16>,
    shape: ForwardShape,
    scale: f32,
) -> std::result::Result<(ForwardBits, GlaPlan), String> {
    dev.poison(stream)?;
    let poison = vec![bf16::from_bits(POISON_BF16); states.len()];
    stream.memcpy_htod(&poison, states).map_err(err)?;
    let mut args = dev.args(shape, scale);
    args.chunk_states = Some(DeviceMut::new(states));
    let plan = fwd
        .launch(stream, args)
        .map_err(|e| format!("launch: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("kernel execution: {e}"))?;
    let bits = ForwardBits {
        o: bits_of_bf16(stream, &dev.o)?,
        ht: bits_of_f32(stream, &dev.ht)?,
        states: bits_of_bf16(stream, states)?,
    };
    Ok((bits, plan))
}

/// The reference's chunk states `[B, N, H, Dk, Dv]` as the forward stores them: in the order
/// `[B, H, N, Dk, Dv]`, each row d scaled by e^{c_d}, the chunk's reference row (the gates' cumsum
/// after its first 32 tokens; 0 in a steep column, whose half-chunk log-decays pass -64).
fn stored_states(states: &Tensor, inputs: &Inputs) -> Vec<f64> {
    let s = &inputs.shape;
    let (n, tile) = (s.t.div_ceil(64), s.dk * s.dv);
    let gate = |b: usize, t: usize, h: usize, d: usize| {
        if t < s.t {
            inputs.g.get(&[b, t, h, d])
        } else {
            0.0
        }
    };
    let mut out = vec![0.0; s.b * s.h * n * tile];
    for (i, chunk) in states.data().chunks(tile).enumerate() {
        let (h, rest) = (i % s.h, i / s.h);
        let (c, b) = (rest % n, rest / n);
        let at = ((b * s.h + h) * n + c) * tile;
        for d in 0..s.dk {
            let cum = |rows: usize| (0..rows).map(|r| gate(b, 64 * c + r, h, d)).sum::<f64>();
            let (head, half, gamma) = (cum(1), cum(32), cum(64));
            let flat = head - half <= 64.0 && half - gamma <= 64.0;
            let scale = if flat { half.exp() } else { 1.0 };
            for e in 0..s.dv {
                out[at + d * s.dv + e] = chunk[d * s.dv + e] * scale;
            }
        }
    }
    out
}

fn run_case(fwd: &mut GlaForward, stream: &Arc<CudaStream>, case: &Case) -> CheckResult {
    let spec = InputSpec {
        shape: case.shape,
        family: Family::Gla,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.h0,
    };
    let inputs = Inputs::generate(&spec).map_err(err)?;
    let scale = inputs.scale as f32;
    let shape = ForwardShape::from(case.shape);
    fwd.set_num_segments(case.segments).map_err(err)?;
    fwd.set_states_splits(case.splits);
    std::thread::scope(|scope| {
        let reference = scope.spawn(|| gla::recurrent_forward(&inputs));
        let reference_states = scope.spawn(|| gla::chunk_states(&inputs, 64));
        let mut dev = ForwardBuffers::upload(stream, &inputs)?;
        let mut states = stream
            .alloc_zeros::<bf16>(chunk_states_len(&shape))
            .map_err(err)?;
        let (first, plan) = run_once(fwd, stream, &mut dev, &mut states, shape, scale)?;
        let (second, _) = run_once(fwd, stream, &mut dev, &mut states, shape, scale)?;
        let mut problems = Vec::new();
        let s = &case.shape;
        let n = s.t.div_ceil(64);
        for check in [
            unwritten(&first.o, POISON_BF16, "o", &s.v()),
            unwritten(&first.ht, POISON_F32, "ht", &s.state()),
            unwritten(
                &first.states,
                POISON_BF16,
                "chunk_states",
                &[s.b * s.h, n, s.dk, s.dv],
            ),
        ] {
            problems.extend(check.err());
        }
        let differ = first
            .o
            .iter()
            .zip(&second.o)
            .filter(|(x, y)| x != y)
            .count()
            + first
                .ht
                .iter()
                .zip(&second.ht)
                .filter(|(x, y)| x != y)
                .count()
            + first
                .states
                .iter()
                .zip(&second.states)
                .filter(|(x, y)| x != y)
                .count();
        if differ > 0 {
            problems.push(format!(
                "not deterministic: {differ} elements differ between two runs"
            ));
        }
        problems.extend(dev.modified_inputs(stream, &inputs)?);
        let want = reference
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let want_states = reference_states
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let want_states = Tensor::from_vec(
            &[s.b * s.h, n, s.dk, s.dv],
            stored_states(&want_states, &inputs),
        )
        .map_err(err)?;
        let o = bf16_values(&first.o);
        let ht = f32_values(&first.ht);
        let states = bf16_values(&first.states);
        let mut error_of = |what: &str, got: &[f64], want| {
            compare(what, got, want, TOL).unwrap_or_else(|e| {
                problems.push(e);
                f64::NAN
            })
        };
        let e_o = error_of("o", &o, &want.o);
        let e_ht = error_of("ht", &ht, &want.final_state);
        let e_states = error_of("chunk_states", &states, &want_states);
        let summary = format!(
            "S={} cps={} R={} rel err o {e_o:.2e} ht {e_ht:.2e} chunk states {e_states:.2e}",
            plan.num_segments, plan.chunks_per_segment, plan.states_splits
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// Calls that must fail with `InvalidArgument` before any launch (o stays poisoned).
fn rejection_checks(fwd: &mut GlaForward, stream: &Arc<CudaStream>) -> Vec<(String, CheckResult)> {
    let shape = ForwardShape {
        b: 1,
        t: 100,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let inputs = Inputs::generate(&InputSpec {
        shape: Shape {
            b: 1,
            t: 100,
            h: 2,
            dk: 64,
            dv: 64,
        },
        family: Family::Gla,
        regime: Regime::Typical,
        seed: 7,
        round_to_bf16: true,
        initial_state: true,
    });
    let mut dev = match inputs
        .map_err(err)
        .and_then(|inputs| ForwardBuffers::upload(stream, &inputs))
    {
        Ok(dev) => dev,
        Err(e) => return vec![("rejection_setup".into(), Err(e))],
    };
    let mut out = Vec::new();
    let mut check = |name: &str,
                     want: &str,
                     fwd: &mut GlaForward,
                     dev: &mut ForwardBuffers,
                     edit: &dyn Fn(&mut GlaArgs<'_>)| {
        let result = (|| {
            stream
                .memcpy_htod(&vec![bf16::from_bits(POISON_BF16); dev.o.len()], &mut dev.o)
                .map_err(err)?;
            stream.synchronize().map_err(err)?;
            let mut args = dev.args(shape, 0.125);
            edit(&mut args);
            let result = fwd.launch(stream, args);
            stream.synchronize().map_err(err)?;
            let untouched = stream
                .clone_dtoh(&dev.o)
                .map_err(err)?
                .iter()
                .all(|x| x.to_bits() == POISON_BF16);
            match result {
                Ok(plan) => Err(format!("accepted (plan {plan:?}) but must be rejected")),
                Err(Error::InvalidArgument(msg)) if !untouched => {
                    Err(format!("rejected ({msg}) but o was written"))
                }
                Err(Error::InvalidArgument(msg)) if msg.contains(want) => Ok(msg),
                Err(e) => Err(format!("wrong error (want one mentioning {want:?}): {e}")),
            }
        })();
        out.push((format!("gla_rejects_{name}"), result));
    };
    check("dv_192", "Dv = 192", fwd, &mut dev, &|a| a.shape.dv = 192);
    check("dk_96", "Dk = 96", fwd, &mut dev, &|a| a.shape.dk = 96);
    check("short_g", "g has", fwd, &mut dev, &|a| {
        // SAFETY: only the length is wrong; the call must refuse before reading it.
        a.g = unsafe { DeviceRef::from_raw(a.g.addr(), a.g.len() - 1) };
    });
    check("misaligned_g", "16-byte", fwd, &mut dev, &|a| {
        // SAFETY: as above; the call must refuse before reading it.
        a.g = unsafe { DeviceRef::from_raw(a.g.addr() + 4, a.g.len()) };
    });
    check("bad_scale", "scale", fwd, &mut dev, &|a| {
        a.scale = Some(-1.0)
    });
    out
}

/// Ends a GLA test's process when it runs longer: a hung kernel fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(300);

fn with_forward(checks: impl FnOnce(&mut GlaForward, &Arc<CudaStream>, &mut Report)) {
    on_one_gpu(LIMIT, |rt, report| match GlaForward::new(rt) {
        Err(e) => report.record("gla_init", Err(e.to_string()), 0.0),
        Ok(mut fwd) => checks(&mut fwd, rt.stream(), report),
    });
}

fn check_cases(select: impl Fn(&Case) -> bool) {
    with_forward(|fwd, stream, report| {
        for case in cases().into_iter().filter(|case| select(case)) {
            report.timed(&case.name(), || run_case(fwd, stream, &case));
        }
    });
}

#[test]
fn gla_small_cases_match_the_f64_reference() {
    check_cases(|case| is_small(&case.shape));
}

#[test]
fn gla_large_cases_match_the_f64_reference() {
    check_cases(|case| !is_small(&case.shape));
}

#[test]
fn gla_bad_arguments_are_rejected_before_any_launch() {
    with_forward(|fwd, stream, report| {
        for (name, result) in rejection_checks(fwd, stream) {
            report.record(&name, result, 0.0);
        }
    });
}

/// One backward case.
#[derive(Clone, Debug)]
struct BackwardCase {
    shape: Shape,
    regime: Regime,
    h0: bool,
    dht: bool,
    segments: Option<u32>,
    seed: u64,
}

impl BackwardCase {
    fn name(&self) -> String {
        format!(
            "{}{}{}{}",
            shape_name("gla_bwd", &self.shape, self.regime),
            if self.h0 { "_h0" } else { "" },
            if self.dht { "_dht" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}"))
        )
    }
}

/// The backward's cases: about 33K tokens in all, so that the f64 reference takes a few seconds.
fn backward_cases() -> Vec<BackwardCase> {
    let mut out = Vec::new();
    let mut seed = 900;
    let mut add = |b, h, t, dk, dv, regime, h0, dht, segments| {
        seed += 1;
        out.push(BackwardCase {
            shape: Shape { b, t, h, dk, dv },
            regime,
            h0,
            dht,
            segments,
            seed,
        });
    };
    use Regime::*;
    // B*H = 1: ragged and whole chunks, every (Dk, Dv); the automatic plan has S > 1 from T = 65
    // on.
    for t in [1, 63, 64, 65, 1000] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, true, true, None);
        }
    }
    // Every gate regime the forward test uses, with several segments and with one, h0 and dht
    // present and absent.
    for regime in [NoDecay, StrongDecay, Mixed] {
        add(1, 1, 1000, 128, 128, regime, true, true, None);
        add(1, 1, 130, 64, 64, regime, false, false, Some(1));
    }
    add(1, 1, 1000, 128, 128, Mixed, false, true, None);
    add(1, 1, 1000, 64, 128, Typical, true, false, None);
    // Forced segment counts: one walk per direction, two, and an uneven last segment (16 chunks
    // in 3).
    for s in [1, 2, 3] {
        add(1, 1, 1000, 128, 128, Mixed, true, true, Some(s));
    }
    // Several batches and heads (the [B, T, H, D] indexing), B*H = 256, and a long sequence.
    add(2, 3, 200, 128, 64, Typical, true, true, None);
    add(4, 64, 40, 64, 64, Mixed, true, true, None);
    add(1, 1, 8191, 128, 128, Typical, true, true, None);
    out
}

/// A backward case's tensors on the device: the forward's inputs and outputs (with the chunk
/// states the backward takes), d_o and dht, the gradients.
struct BackwardBuffers {
    inputs: ForwardBuffers,
    chunk_states: CudaSlice<bf16>,
    d_o: CudaSlice<bf16>,
    dht: Option<CudaSlice<f32>>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dh0: CudaSlice<f32>,
}

impl BackwardBuffers {
    /// Uploads the inputs and runs the forward for its chunk states.
    fn upload(
        fwd: &mut GlaForward,
        stream: &Arc<CudaStream>,
        inputs: &Inputs,
        cot: &Cotangents,
    ) -> std::result::Result<Self, String> {
        let s = ForwardShape::from(inputs.shape);
        let mut dev = BackwardBuffers {
            inputs: ForwardBuffers::upload(stream, inputs)?,
            chunk_states: stream.alloc_zeros(chunk_states_len(&s)).map_err(err)?,
            d_o: stream.clone_htod(&to_bf16(&cot.d_o)).map_err(err)?,
            dht: match &cot.d_ht {
                Some(d) => Some(stream.clone_htod(&to_f32(d)).map_err(err)?),
                None => None,
            },
            dq: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dk: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dv: stream.alloc_zeros(s.v_len()).map_err(err)?,
            dg: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dh0: stream.alloc_zeros(s.state_len()).map_err(err)?,
        };
        let mut args = dev.inputs.args(s, inputs.scale as f32);
        args.chunk_states = Some(DeviceMut::new(&mut dev.chunk_states));
        fwd.launch(stream, args)
            .map_err(|e| format!("forward launch: {e}"))?;
        stream.synchronize().map_err(err)?;
        Ok(dev)
    }

    fn args(&mut self, shape: ForwardShape, scale: f32) -> GlaBackwardArgs<'_> {
        let i = &self.inputs;
        GlaBackwardArgs {
            shape,
            q: DeviceRef::new(&i.q),
            k: DeviceRef::new(&i.k),
            v: DeviceRef::new(&i.v),
            g: DeviceRef::new(&i.g),
            h0: i.h0.as_ref().map(DeviceRef::new),
            chunk_states: DeviceRef::new(&self.chunk_states),
            d_o: DeviceRef::new(&self.d_o),
            dht: self.dht.as_ref().map(DeviceRef::new),
            dq: DeviceMut::new(&mut self.dq),
            dk: DeviceMut::new(&mut self.dk),
            dv: DeviceMut::new(&mut self.dv),
            dg: DeviceMut::new(&mut self.dg),
            dh0: Some(DeviceMut::new(&mut self.dh0)),
            scale: Some(scale),
            documents: None,
        }
    }

    /// Every gradient filled with the poison bit patterns.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> std::result::Result<(), String> {
        for buf in [&mut self.dq, &mut self.dk, &mut self.dv] {
            let poison = vec![bf16::from_bits(POISON_BF16); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        for buf in [&mut self.dg, &mut self.dh0] {
            let poison = vec![f32::from_bits(POISON_F32); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        stream.synchronize().map_err(err)
    }

    /// One run on poisoned gradients: their bits.
    fn run(
        &mut self,
        bwd: &mut GlaBackward,
        stream: &Arc<CudaStream>,
        shape: ForwardShape,
        scale: f32,
    ) -> std::result::Result<GradBits, String> {
        self.poison(stream)?;
        bwd.launch(stream, self.args(shape, scale))
            .map_err(|e| format!("launch: {e}"))?;
        stream
            .synchronize()
            .map_err(|e| format!("kernel execution: {e}"))?;
        let grads = GradBuffers {
            dq: &self.dq,
            dk: &self.dk,
            dv: &self.dv,
            dg: &self.dg,
            dbeta: None,
            dh0: Some(&self.dh0),
        };
        GradBits::read(stream, grads).map_err(err)
    }
}

fn run_backward_case(
    fwd: &mut GlaForward,
    bwd: &mut GlaBackward,
    stream: &Arc<CudaStream>,
    case: &BackwardCase,
) -> CheckResult {
    let spec = InputSpec {
        shape: case.shape,
        family: Family::Gla,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.h0,
    };
    let inputs = Inputs::generate(&spec).map_err(err)?;
    let cot = Cotangents::generate(case.shape, case.seed, case.dht, true).map_err(err)?;
    let scale = inputs.scale as f32;
    let shape = ForwardShape::from(case.shape);
    bwd.set_num_segments(case.segments).map_err(err)?;
    let plan = bwd.plan(&shape).map_err(err)?;
    std::thread::scope(|scope| {
        let reference = scope.spawn(|| gla::backward(&inputs, 64, 16, &cot.d_o, cot.d_ht.as_ref()));
        let mut dev = BackwardBuffers::upload(fwd, stream, &inputs, &cot)?;
        let first = dev.run(bwd, stream, shape, scale)?;
        let second = dev.run(bwd, stream, shape, scale)?;
        let s = &case.shape;
        let mut problems: Vec<String> = [
            unwritten(&first.dq, POISON_BF16, "dq", &s.qk()),
            unwritten(&first.dk, POISON_BF16, "dk", &s.qk()),
            unwritten(&first.dv, POISON_BF16, "dv", &s.v()),
            unwritten(&first.dg, POISON_F32, "dg", &s.qk()),
            unwritten(&first.dh0, POISON_F32, "dh0", &s.state()),
        ]
        .into_iter()
        .filter_map(|r| r.err())
        .collect();
        if first != second {
            problems.push("not deterministic: two runs gave different bits".into());
        }
        problems.extend(dev.inputs.modified_inputs(stream, &inputs)?);
        let want = reference
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let mut errors = Vec::new();
        for (what, got, want) in [
            ("dq", bf16_values(&first.dq), &want.dq),
            ("dk", bf16_values(&first.dk), &want.dk),
            ("dv", bf16_values(&first.dv), &want.dv),
            ("dh0", f32_values(&first.dh0), &want.dh0),
        ] {
            match compare(what, &got, want, TOL) {
                Ok(e) => errors.push(format!("{what} {e:.2e}")),
                Err(e) => problems.push(e),
            }
        }
        let dg = f32_values(&first.dg);
        let dg_scale = want.gate_grad_scale(&inputs);
        match assert_close_to_scale("dg", &dg, want.dg.data(), dg_scale, TOL) {
            Ok(()) => errors.push(format!(
                "dg {:.2e} of its scale",
                diff_norm(&dg, &want.dg) / dg_scale
            )),
            Err(e) => problems.push(e),
        }
        let summary = format!(
            "S={} cps={} rel err {}",
            plan.num_segments,
            plan.chunks_per_segment,
            errors.join(", ")
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// `||got - want||`.
fn diff_norm(got: &[f64], want: &Tensor) -> f64 {
    got.iter()
        .zip(want.data())
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt()
}

/// A change that makes a valid backward call invalid.
type Edit = dyn Fn(&mut GlaBackwardArgs<'_>);

/// Backward calls that must fail with `InvalidArgument` before any launch (dq stays poisoned):
/// a d_o one element short, chunk states one row short, and Dv = 96.
fn backward_rejection_checks(
    fwd: &mut GlaForward,
    bwd: &mut GlaBackward,
    stream: &Arc<CudaStream>,
) -> std::result::Result<Vec<(String, CheckResult)>, String> {
    bwd.set_num_segments(None).map_err(err)?;
    let shape = Shape {
        b: 1,
        t: 100,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let inputs = Inputs::generate(&InputSpec {
        shape,
        family: Family::Gla,
        regime: Regime::Typical,
        seed: 7,
        round_to_bf16: true,
        initial_state: true,
    })
    .map_err(err)?;
    let cot = Cotangents::generate(shape, 7, true, true).map_err(err)?;
    let mut dev = BackwardBuffers::upload(fwd, stream, &inputs, &cot)?;
    let valid = ForwardShape::from(shape);
    let mut out = Vec::new();
    let edits: [(&str, &str, &Edit); 3] = [
        ("short_d_o", "d_o has", &|a| {
            // SAFETY: only the length is wrong; the call must refuse before reading it.
            a.d_o = unsafe { DeviceRef::from_raw(a.d_o.addr(), a.d_o.len() - 1) };
        }),
        ("short_chunk_states", "chunk_states has", &|a| {
            let states = a.chunk_states;
            // SAFETY: as above.
            a.chunk_states = unsafe { DeviceRef::from_raw(states.addr(), states.len() - 64) };
        }),
        ("dv_96", "Dv = 96", &|a| a.shape.dv = 96),
    ];
    for (name, want, edit) in edits {
        dev.poison(stream)?;
        let mut args = dev.args(valid, inputs.scale as f32);
        edit(&mut args);
        let result = bwd.launch(stream, args);
        stream.synchronize().map_err(err)?;
        let untouched = bits_of_bf16(stream, &dev.dq)?
            .iter()
            .all(|&x| x == POISON_BF16);
        let verdict = match result {
            Ok(plan) => Err(format!("accepted (plan {plan:?}) but must be rejected")),
            Err(Error::InvalidArgument(m)) if !untouched => {
                Err(format!("rejected ({m}) but dq was written: a kernel ran"))
            }
            Err(Error::InvalidArgument(m)) if m.contains(want) => Ok(m),
            Err(e) => Err(format!(
                "wrong error (want InvalidArgument mentioning {want:?}): {e}"
            )),
        };
        out.push((format!("gla_bwd_rejects_{name}"), verdict));
    }
    Ok(out)
}

/// Runs `checks` with a forward (for the chunk states) and a backward on the one GPU.
fn with_backward(
    checks: impl FnOnce(&mut GlaForward, &mut GlaBackward, &Arc<CudaStream>, &mut Report),
) {
    on_one_gpu(LIMIT, |rt, report| {
        match GlaForward::new(rt).and_then(|fwd| Ok((fwd, GlaBackward::new(rt)?))) {
            Err(e) => report.record("gla_bwd_init", Err(e.to_string()), 0.0),
            Ok((mut fwd, mut bwd)) => checks(&mut fwd, &mut bwd, rt.stream(), report),
        }
    });
}

#[test]
fn gla_backward_matches_the_reference() {
    with_backward(|fwd, bwd, stream, report| {
        for case in backward_cases() {
            report.timed(&case.name(), || run_backward_case(fwd, bwd, stream, &case));
        }
    });
}

#[test]
fn gla_backward_bad_arguments_are_rejected_before_any_launch() {
    with_backward(
        |fwd, bwd, stream, report| match backward_rejection_checks(fwd, bwd, stream) {
            Ok(checks) => checks
                .into_iter()
                .for_each(|(name, result)| report.record(&name, result, 0.0)),
            Err(e) => report.record("gla_bwd_rejection_setup", Err(e), 0.0),
        },
    );
}
