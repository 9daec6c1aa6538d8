//! The mLSTM backward (`ops::mlstm::MlstmBackward`) against the CPU f64 reference's
//! `recurrent_backward` with mlstm_kernels' gradient (`MlstmGradient::Tfla`), on one GPU.
//!
//! Each case runs the forward with its saved rows and final state, then the backward from random
//! cotangents `dh` and `dC_T` (`reference::Cotangents`). Gradients are poisoned before each run
//! and must be fully overwritten; dq, dk, dv and dC_0 within 5e-3 of the reference
//! (`||x - ref|| / ||ref||`); the gate pre-activations' gradients within 5e-3 of
//! `MlstmGrads::gate_grad_scale` (their terms cancel: the scale they are measured against); a
//! second run gives bitwise identical gradients; the inputs (dh and the forward's saved rows
//! included) are left unchanged. Calls that must be rejected are checked to fail before any
//! launch. The gate regimes
//! are the forward test's (`mlstm.rs`), where the stabiliser jumps and the exponents of the
//! reversed passes span hundreds.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::mlstm::{
    MlstmBackward, MlstmBackwardArgs, MlstmBackwardPlan, MlstmFinalCotangent, MlstmForward,
    MlstmSavedMut, MlstmSavedRef, MlstmStateRef, DEFAULT_EPS,
};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::mlstm::{
    recurrent_backward, MlstmCotangents, MlstmGradient, MlstmInputs, MlstmRegime, MlstmSpec,
    MlstmState,
};
use lasp_shmem::reference::{assert_close_to_scale, Cotangents, Shape, Tensor};
use lasp_shmem::Error;
use std::sync::Arc;

use crate::common::{
    bf16_values, bits_of_bf16, bits_of_f32, compare, err, f32_values, is_small, on_one_gpu,
    to_bf16, to_f32, unwritten, CheckResult, Report, POISON_BF16, POISON_F32,
};
use crate::mlstm::{Buffers, LIMIT};

const TOL: f64 = 5e-3;
/// Below this norm a gradient is all fp32 subnormals or zeros.
const TINY: f64 = 1e-30;

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    regime: MlstmRegime,
    initial_state: bool,
    /// A cotangent for the final state's C.
    d_final: bool,
    segments: Option<u32>,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "mlstm_bwd_B{}_H{}_T{}_Dk{}_Dv{}_{:?}{}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
            if self.initial_state { "_state0" } else { "" },
            if self.d_final { "_dCT" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}"))
        )
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 3600;
    let mut add = |b, h, t, (dk, dv), regime, initial_state, d_final, segments| {
        seed += 1;
        out.push(Case {
            shape: Shape { b, t, h, dk, dv },
            regime,
            initial_state,
            d_final,
            segments,
            seed,
        });
    };
    use MlstmRegime::*;
    const PAIRS: [(usize, usize); 4] = [(64, 64), (128, 128), (64, 128), (128, 64)];
    // B*H = 1: ragged and whole chunks, every (Dk, Dv).
    for t in [1, 63, 64, 65, 1000] {
        for dims in PAIRS {
            add(1, 1, t, dims, Typical, true, true, None);
        }
    }
    // Every gate regime, with and without the initial state and the final state's cotangent,
    // one segment and several.
    for regime in MlstmRegime::ALL {
        for dims in [(128, 128), (64, 64)] {
            add(1, 1, 1000, dims, regime, true, true, None);
            add(1, 1, 1000, dims, regime, false, false, Some(1));
            add(1, 1, 1000, dims, regime, false, true, None);
        }
    }
    // Forced segment counts (an uneven last segment), and a long sequence.
    for s in [2, 5] {
        add(1, 1, 1000, (128, 128), LargeInputGate, true, true, Some(s));
    }
    add(1, 2, 8191, (128, 128), Typical, true, true, Some(3));
    // Several batches and heads, and B*H = 256.
    add(2, 3, 1000, (128, 128), Typical, true, true, None);
    add(3, 5, 130, (64, 128), ForgetNearZero, true, true, Some(2));
    add(4, 64, 200, (64, 64), Typical, true, false, None);
    add(4, 64, 130, (128, 128), LargeInputGate, false, true, Some(2));
    out
}

/// The backward's cotangents and gradients on the device, with what the forward saved.
struct GradBuffers {
    d_h: CudaSlice<bf16>,
    d_c_t: Option<CudaSlice<f32>>,
    saved: [CudaSlice<f32>; 2],
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    d_gates: [CudaSlice<f32>; 2],
    d_c0: CudaSlice<f32>,
}

/// The bits of dh and the saved rows, which the backward must not change.
#[derive(PartialEq)]
struct ReadOnlyBits {
    d_h: Vec<u16>,
    saved: [Vec<u32>; 2],
}

/// An edit of a call that must be rejected.
type Edit = dyn Fn(&mut MlstmBackwardArgs<'_>);

/// The bits one backward run left in the gradients.
#[derive(PartialEq)]
struct GradBits {
    dq: Vec<u16>,
    dk: Vec<u16>,
    dv: Vec<u16>,
    d_i: Vec<u32>,
    d_f: Vec<u32>,
    d_c0: Vec<u32>,
}

impl GradBuffers {
    fn upload(
        stream: &Arc<CudaStream>,
        shape: ForwardShape,
        cot: &MlstmCotangents,
    ) -> std::result::Result<Self, String> {
        let zeros_f32 = |n: usize| stream.alloc_zeros::<f32>(n).map_err(err);
        let zeros_bf16 = |n: usize| stream.alloc_zeros::<bf16>(n).map_err(err);
        let per_token = shape.b * shape.t * shape.h;
        let d_c_t = match &cot.d_final_state {
            Some(d) => Some(stream.clone_htod(&to_f32(&d.c)).map_err(err)?),
            None => None,
        };
        Ok(GradBuffers {
            d_h: stream.clone_htod(&to_bf16(&cot.d_h)).map_err(err)?,
            d_c_t,
            saved: [zeros_f32(per_token)?, zeros_f32(per_token)?],
            dq: zeros_bf16(shape.qk_len())?,
            dk: zeros_bf16(shape.qk_len())?,
            dv: zeros_bf16(shape.v_len())?,
            d_gates: [zeros_f32(per_token)?, zeros_f32(per_token)?],
            d_c0: zeros_f32(shape.state_len())?,
        })
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) -> std::result::Result<(), String> {
        for buf in [&mut self.dq, &mut self.dk, &mut self.dv] {
            let poison = vec![bf16::from_bits(POISON_BF16); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        let [d_i, d_f] = &mut self.d_gates;
        for buf in [d_i, d_f, &mut self.d_c0] {
            let poison = vec![f32::from_bits(POISON_F32); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        stream.synchronize().map_err(err)
    }

    /// The bits of what the backward only reads: dh and the saved rows.
    fn read_only_bits(
        &self,
        stream: &Arc<CudaStream>,
    ) -> std::result::Result<ReadOnlyBits, String> {
        Ok(ReadOnlyBits {
            d_h: bits_of_bf16(stream, &self.d_h)?,
            saved: [
                bits_of_f32(stream, &self.saved[0])?,
                bits_of_f32(stream, &self.saved[1])?,
            ],
        })
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> std::result::Result<GradBits, String> {
        Ok(GradBits {
            dq: bits_of_bf16(stream, &self.dq)?,
            dk: bits_of_bf16(stream, &self.dk)?,
            dv: bits_of_bf16(stream, &self.dv)?,
            d_i: bits_of_f32(stream, &self.d_gates[0])?,
            d_f: bits_of_f32(stream, &self.d_gates[1])?,
            d_c0: bits_of_f32(stream, &self.d_c0)?,
        })
    }
}

/// The forward with its saved rows and final state (the backward reads m_T).
fn run_forward(
    fwd: &mut MlstmForward,
    stream: &Arc<CudaStream>,
    dev: &mut Buffers,
    grads: &mut GradBuffers,
    shape: ForwardShape,
    scale: f32,
) -> std::result::Result<(), String> {
    let [row_m, row_den] = &mut grads.saved;
    let mut args = dev.args(shape, scale, DEFAULT_EPS);
    args.saved = Some(MlstmSavedMut {
        m: DeviceMut::new(row_m),
        den: DeviceMut::new(row_den),
    });
    fwd.launch(stream, args)
        .map_err(|e| format!("forward: {e}"))?;
    stream.synchronize().map_err(err)
}

/// One backward run on poisoned gradients: their bits.
fn run_backward(
    bwd: &mut MlstmBackward,
    stream: &Arc<CudaStream>,
    dev: &Buffers,
    grads: &mut GradBuffers,
    shape: ForwardShape,
    scale: f32,
) -> std::result::Result<(GradBits, MlstmBackwardPlan), String> {
    grads.poison(stream)?;
    let plan = bwd
        .launch(stream, backward_args(dev, grads, shape, scale))
        .map_err(|e| format!("backward: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("kernel execution: {e}"))?;
    Ok((grads.bits(stream)?, plan))
}

/// The backward's arguments over one case's buffers.
fn backward_args<'a>(
    dev: &'a Buffers,
    grads: &'a mut GradBuffers,
    shape: ForwardShape,
    scale: f32,
) -> MlstmBackwardArgs<'a> {
    let [d_i, d_f] = &mut grads.d_gates;
    MlstmBackwardArgs {
        shape,
        q: DeviceRef::new(&dev.q),
        k: DeviceRef::new(&dev.k),
        v: DeviceRef::new(&dev.v),
        i_gate: DeviceRef::new(&dev.i_gate),
        f_gate: DeviceRef::new(&dev.f_gate),
        initial_state: dev.state0.as_ref().map(|[c, n, m]| MlstmStateRef {
            c: DeviceRef::new(c),
            n: DeviceRef::new(n),
            m: DeviceRef::new(m),
        }),
        saved: MlstmSavedRef {
            m: DeviceRef::new(&grads.saved[0]),
            den: DeviceRef::new(&grads.saved[1]),
        },
        d_h: DeviceRef::new(&grads.d_h),
        d_final: grads.d_c_t.as_ref().map(|d_c| MlstmFinalCotangent {
            d_c: DeviceRef::new(d_c),
            m: DeviceRef::new(&dev.state_t[2]),
        }),
        dq: DeviceMut::new(&mut grads.dq),
        dk: DeviceMut::new(&mut grads.dk),
        dv: DeviceMut::new(&mut grads.dv),
        d_i_gate: DeviceMut::new(d_i),
        d_f_gate: DeviceMut::new(d_f),
        d_initial_c: Some(DeviceMut::new(&mut grads.d_c0)),
        scale: Some(scale),
        documents: None,
    }
}

/// The reference's cotangents: `dh ~ N(0, 1)` and, where the case asks, `dC_T ~ N(0, 1)` (this
/// gradient takes no `dn_T`, `dm_T`).
fn cotangents(case: &Case) -> std::result::Result<MlstmCotangents, String> {
    let cot = Cotangents::generate(case.shape, case.seed, case.d_final, true).map_err(err)?;
    let s = &case.shape;
    Ok(MlstmCotangents {
        d_h: cot.d_o,
        d_final_state: cot.d_ht.map(|c| MlstmState {
            c,
            n: Tensor::zeros(&[s.b, s.h, s.dk]),
            m: Tensor::zeros(&[s.b, s.h]),
        }),
    })
}

fn run_case(
    fwd: &mut MlstmForward,
    bwd: &mut MlstmBackward,
    stream: &Arc<CudaStream>,
    case: &Case,
) -> CheckResult {
    let spec = MlstmSpec {
        shape: case.shape,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.initial_state,
    };
    let inputs = MlstmInputs::generate(&spec).map_err(err)?;
    let cot = cotangents(case)?;
    let shape = ForwardShape::from(case.shape);
    let scale = inputs.scale as f32;
    fwd.set_num_segments(case.segments);
    fwd.set_states_splits(None);
    bwd.set_num_segments(case.segments);
    std::thread::scope(|scope| {
        let reference = scope.spawn(|| recurrent_backward(&inputs, &cot, MlstmGradient::Tfla));
        let mut dev = Buffers::upload(stream, &inputs)?;
        let mut grads = GradBuffers::upload(stream, shape, &cot)?;
        run_forward(fwd, stream, &mut dev, &mut grads, shape, scale)?;
        let read_only = grads.read_only_bits(stream)?;
        let (first, plan) = run_backward(bwd, stream, &dev, &mut grads, shape, scale)?;
        let (second, _) = run_backward(bwd, stream, &dev, &mut grads, shape, scale)?;
        let s = &case.shape;
        let per_token = [s.b, s.t, s.h];
        let mut problems: Vec<String> = [
            unwritten(&first.dq, POISON_BF16, "dq", &s.qk()),
            unwritten(&first.dk, POISON_BF16, "dk", &s.qk()),
            unwritten(&first.dv, POISON_BF16, "dv", &s.v()),
            unwritten(&first.d_i, POISON_F32, "d_i_gate", &per_token),
            unwritten(&first.d_f, POISON_F32, "d_f_gate", &per_token),
            unwritten(&first.d_c0, POISON_F32, "d_initial_c", &s.state()),
        ]
        .into_iter()
        .filter_map(|r| r.err())
        .collect();
        if first != second {
            problems.push("not deterministic: two runs gave different bits".into());
        }
        problems.extend(dev.modified_inputs(stream, &inputs)?);
        if grads.read_only_bits(stream)? != read_only {
            problems.push("dh or the forward's saved rows were modified".into());
        }
        let want = reference
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let mut errors = Vec::new();
        let mut compared = vec![
            ("dq", bf16_values(&first.dq), &want.dq),
            ("dk", bf16_values(&first.dk), &want.dk),
            ("dv", bf16_values(&first.dv), &want.dv),
        ];
        let d_c0 = f32_values(&first.d_c0);
        let want_c0 = &want.d_initial_state.c;
        if norm(want_c0.data()) >= TINY {
            compared.push(("dC0", d_c0, want_c0));
        } else if norm(&d_c0) >= TINY {
            // The zero state's m_0 = 0 against stabilisers of hundreds: every weight of C_0 is
            // e^{-hundreds}, below fp32's range, and so is the gradient.
            problems.push(format!(
                "dC0: ||got|| = {:.3e} where ||want|| = {:.3e} underflows fp32",
                norm(&d_c0),
                norm(want_c0.data())
            ));
        }
        for (what, got, want) in compared {
            match compare(what, &got, want, TOL) {
                Ok(e) => errors.push(format!("{what} {e:.2e}")),
                Err(e) => problems.push(e),
            }
        }
        let gate_scale = want.gate_grad_scale(&inputs);
        for (what, got, want) in [
            ("d_i_gate", f32_values(&first.d_i), &want.d_input_gate),
            ("d_f_gate", f32_values(&first.d_f), &want.d_forget_gate),
        ] {
            match assert_close_to_scale(what, &got, want.data(), gate_scale, TOL) {
                Ok(()) => {
                    let diff: Vec<f64> = got.iter().zip(want.data()).map(|(a, b)| a - b).collect();
                    errors.push(format!("{what} {:.2e} of scale", norm(&diff) / gate_scale));
                }
                Err(e) => problems.push(e),
            }
        }
        let summary = format!(
            "S(dq,dv,dk)=({},{},{}) rel err {}",
            plan.dq.num_segments,
            plan.dv.num_segments,
            plan.dk.num_segments,
            errors.join(", ")
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// Calls that must fail with `InvalidArgument` before any launch: the gradients stay poisoned.
fn rejection_checks(
    fwd: &mut MlstmForward,
    bwd: &mut MlstmBackward,
    stream: &Arc<CudaStream>,
) -> Vec<(String, CheckResult)> {
    let case = Case {
        shape: Shape {
            b: 1,
            t: 100,
            h: 2,
            dk: 64,
            dv: 64,
        },
        regime: MlstmRegime::Typical,
        initial_state: false,
        d_final: true,
        segments: None,
        seed: 3599,
    };
    let prepared = (|| {
        let spec = MlstmSpec {
            shape: case.shape,
            regime: case.regime,
            seed: case.seed,
            round_to_bf16: true,
            initial_state: false,
        };
        let inputs = MlstmInputs::generate(&spec).map_err(err)?;
        let shape = ForwardShape::from(case.shape);
        let mut dev = Buffers::upload(stream, &inputs)?;
        let mut grads = GradBuffers::upload(stream, shape, &cotangents(&case)?)?;
        fwd.set_num_segments(None);
        bwd.set_num_segments(None);
        run_forward(fwd, stream, &mut dev, &mut grads, shape, 0.125)?;
        Ok::<_, String>((dev, grads, shape))
    })();
    let (dev, mut grads, shape) = match prepared {
        Ok(x) => x,
        Err(e) => return vec![("mlstm_bwd_rejections".into(), Err(e))],
    };
    let edits: [(&str, &str, &Edit); 4] = [
        ("wide_values", "Dv = 256", &|a| a.shape.dv = 256),
        ("zero_scale", "scale = 0", &|a| a.scale = Some(0.0)),
        ("short_saved_rows", "saved.den has", &|a| {
            // SAFETY: the view covers the first half of a live buffer and is never launched.
            a.saved.den = unsafe { DeviceRef::from_raw(a.saved.den.addr(), a.saved.den.len() / 2) };
        }),
        ("short_final_m", "d_final.m has", &|a| {
            if let Some(d) = &mut a.d_final {
                // SAFETY: as above.
                d.m = unsafe { DeviceRef::from_raw(d.m.addr(), 1) };
            }
        }),
    ];
    let mut out = Vec::new();
    for (name, pattern, edit) in edits {
        let result = (|| {
            grads.poison(stream)?;
            let mut args = backward_args(&dev, &mut grads, shape, 0.125);
            edit(&mut args);
            match bwd.launch(stream, args) {
                Ok(_) => Err("accepted".to_string()),
                Err(Error::InvalidArgument(m)) if m.contains(pattern) => {
                    stream.synchronize().map_err(err)?;
                    if bits_of_bf16(stream, &grads.dq)?
                        .iter()
                        .all(|&x| x == POISON_BF16)
                    {
                        Ok(m)
                    } else {
                        Err("dq written before the rejection".to_string())
                    }
                }
                Err(e) => Err(format!("wrong error: {e}")),
            }
        })();
        out.push((format!("mlstm_bwd_rejects_{name}"), result));
    }
    out
}

fn check_cases(select: impl Fn(&Case) -> bool) {
    on_one_gpu(LIMIT, |rt, report: &mut Report| {
        let (mut fwd, mut bwd) = match (MlstmForward::new(rt), MlstmBackward::new(rt)) {
            (Ok(f), Ok(b)) => (f, b),
            (Err(e), _) | (_, Err(e)) => {
                return report.record("mlstm_bwd_init", Err(e.to_string()), 0.0)
            }
        };
        for case in cases().into_iter().filter(|case| select(case)) {
            report.timed(&case.name(), || {
                run_case(&mut fwd, &mut bwd, rt.stream(), &case)
            });
        }
    });
}

#[test]
fn mlstm_backward_small_cases_match_the_f64_reference() {
    check_cases(|case| is_small(&case.shape));
}

#[test]
fn mlstm_backward_large_cases_match_the_f64_reference() {
    check_cases(|case| !is_small(&case.shape));
}

#[test]
fn mlstm_backward_bad_arguments_are_rejected_before_any_launch() {
    on_one_gpu(LIMIT, |rt, report: &mut Report| {
        let (mut fwd, mut bwd) = match (MlstmForward::new(rt), MlstmBackward::new(rt)) {
            (Ok(f), Ok(b)) => (f, b),
            (Err(e), _) | (_, Err(e)) => {
                return report.record("mlstm_bwd_init", Err(e.to_string()), 0.0)
            }
        };
        for (name, result) in rejection_checks(&mut fwd, &mut bwd, rt.stream()) {
            report.record(&name, result, 0.0);
        }
    });
}
