//! The mLSTM forward (`ops::mlstm`) against the CPU f64 reference, on one GPU.
//!
//! Inputs come from `reference::mlstm::MlstmInputs::generate`, rounded to bf16 (q, k, v) and f32
//! (gates, initial state, scale, eps), so the GPU sees exactly the values the reference computes
//! with; the reference is the stabilised recurrence token by token. For every case: h and the
//! final state are poisoned before each run and must be fully overwritten;
//! `||x - ref|| / ||ref|| <= 5e-3` for h, C, n and m; a second run gives bitwise identical
//! outputs; the gates and the initial state are left unchanged. The gate regimes cover the
//! stabiliser's work: typical gates, input gates of hundreds (most tokens' weights underflow, the
//! stabiliser jumps within a chunk) and forget gates near zero (the state nearly resets every
//! token and the denominator's floor e^{-m} is active). Calls that must be rejected are checked
//! to fail before any launch.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::mlstm::{MlstmArgs, MlstmForward, MlstmPlan, MlstmStateMut, MlstmStateRef};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::mlstm::{recurrent_forward, MlstmInputs, MlstmRegime, MlstmSpec};
use lasp_shmem::reference::{Shape, Tensor};
use lasp_shmem::Error;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    bf16_values, bits_of_bf16, bits_of_f32, compare, err, f32_values, is_small, on_one_gpu,
    to_bf16, to_f32, unwritten, CheckResult, Report, POISON_BF16, POISON_F32,
};

const TOL: f64 = 5e-3;

#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    regime: MlstmRegime,
    initial_state: bool,
    segments: Option<u32>,
    /// Forced states pieces per segment (else the plan's).
    splits: Option<u32>,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "mlstm_B{}_H{}_T{}_Dk{}_Dv{}_{:?}{}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
            if self.initial_state { "_state0" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}")),
            self.splits.map_or(String::new(), |n| format!("_R{n}"))
        )
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 3500;
    let mut add_split = |b, h, t, dk, dv, regime, initial_state, segments, splits| {
        seed += 1;
        out.push(Case {
            shape: Shape { b, t, h, dk, dv },
            regime,
            initial_state,
            segments,
            splits,
            seed,
        });
    };
    let mut add = |b, h, t, dk, dv, regime, initial_state, segments| {
        add_split(b, h, t, dk, dv, regime, initial_state, segments, None)
    };
    use MlstmRegime::*;
    // B*H = 1: ragged and whole chunks, every (Dk, Dv); the automatic plan splits T >= 65.
    for t in [1, 63, 64, 65, 1000] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, true, None);
        }
    }
    // Every gate regime, from the zero state and from a drawn one, one segment and several.
    for regime in MlstmRegime::ALL {
        for (dk, dv) in [(128, 128), (64, 64)] {
            add(1, 1, 1000, dk, dv, regime, true, None);
            add(1, 1, 1000, dk, dv, regime, false, Some(1));
            add(1, 1, 1000, dk, dv, regime, false, None);
        }
    }
    // Forced segment counts, an uneven last segment (128 chunks in 3).
    for s in [2, 5, 16] {
        add(1, 1, 1000, 128, 128, LargeInputGate, true, Some(s));
    }
    add(1, 2, 8191, 128, 128, Typical, true, Some(3));
    // Several batches and heads (the [B, T, H, D] indexing), and B*H = 256.
    add(2, 3, 1000, 128, 128, Typical, true, None);
    add(3, 5, 130, 64, 128, ForgetNearZero, true, Some(2));
    add(4, 64, 200, 64, 64, Typical, true, None);
    add(4, 64, 130, 128, 128, LargeInputGate, false, Some(2));
    // States pieces: one per segment, and 4 over segments of 5 chunks (the last piece empty).
    add_split(1, 2, 1000, 128, 128, LargeInputGate, true, Some(3), Some(1));
    add_split(1, 2, 1600, 64, 128, Typical, true, Some(5), Some(4));
    out
}

/// One case's tensors on the device (the backward's checks run the forward from them too).
pub(crate) struct Buffers {
    pub(crate) q: CudaSlice<bf16>,
    pub(crate) k: CudaSlice<bf16>,
    pub(crate) v: CudaSlice<bf16>,
    pub(crate) i_gate: CudaSlice<f32>,
    pub(crate) f_gate: CudaSlice<f32>,
    pub(crate) state0: Option<[CudaSlice<f32>; 3]>,
    pub(crate) h: CudaSlice<bf16>,
    pub(crate) state_t: [CudaSlice<f32>; 3],
}

impl Buffers {
    pub(crate) fn upload(
        stream: &Arc<CudaStream>,
        x: &MlstmInputs,
    ) -> std::result::Result<Self, String> {
        let s = ForwardShape::from(x.shape);
        let up_bf16 = |t: &Tensor| stream.clone_htod(&to_bf16(t)).map_err(err);
        let up_f32 = |t: &Tensor| stream.clone_htod(&to_f32(t)).map_err(err);
        let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(err);
        let state0 = match &x.initial_state {
            Some(st) => Some([up_f32(&st.c)?, up_f32(&st.n)?, up_f32(&st.m)?]),
            None => None,
        };
        let dev = Buffers {
            q: up_bf16(&x.q)?,
            k: up_bf16(&x.k)?,
            v: up_bf16(&x.v)?,
            i_gate: up_f32(&x.input_gate)?,
            f_gate: up_f32(&x.forget_gate)?,
            state0,
            h: stream.alloc_zeros(s.v_len()).map_err(err)?,
            state_t: [
                zeros(s.state_len())?,
                zeros(s.b * s.h * s.dk)?,
                zeros(s.b * s.h)?,
            ],
        };
        stream.synchronize().map_err(err)?;
        Ok(dev)
    }

    pub(crate) fn args(&mut self, shape: ForwardShape, scale: f32, eps: f32) -> MlstmArgs<'_> {
        let [c_t, n_t, m_t] = &mut self.state_t;
        MlstmArgs {
            shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            i_gate: DeviceRef::new(&self.i_gate),
            f_gate: DeviceRef::new(&self.f_gate),
            initial_state: self.state0.as_ref().map(|[c, n, m]| MlstmStateRef {
                c: DeviceRef::new(c),
                n: DeviceRef::new(n),
                m: DeviceRef::new(m),
            }),
            h: DeviceMut::new(&mut self.h),
            saved: None,
            final_state: Some(MlstmStateMut {
                c: DeviceMut::new(c_t),
                n: DeviceMut::new(n_t),
                m: DeviceMut::new(m_t),
            }),
            scale: Some(scale),
            eps: Some(eps),
            documents: None,
            document_final_states: None,
        }
    }

    /// h and the final state filled with the poison bit patterns.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> std::result::Result<(), String> {
        let h = vec![bf16::from_bits(POISON_BF16); self.h.len()];
        stream.memcpy_htod(&h, &mut self.h).map_err(err)?;
        for buf in &mut self.state_t {
            let poison = vec![f32::from_bits(POISON_F32); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        stream.synchronize().map_err(err)
    }

    /// The inputs the kernels only read (gates, initial state) whose bits no longer match `x`.
    pub(crate) fn modified_inputs(
        &self,
        stream: &Arc<CudaStream>,
        x: &MlstmInputs,
    ) -> std::result::Result<Vec<String>, String> {
        let mut read_only = vec![
            ("i_gate", &self.i_gate, &x.input_gate),
            ("f_gate", &self.f_gate, &x.forget_gate),
        ];
        if let (Some([c, n, m]), Some(st)) = (&self.state0, &x.initial_state) {
            read_only.extend([("c0", c, &st.c), ("n0", n, &st.n), ("m0", m, &st.m)]);
        }
        let mut modified = Vec::new();
        for (name, device, want) in read_only {
            let now = bits_of_f32(stream, device)?;
            if now.iter().zip(to_f32(want)).any(|(a, b)| *a != b.to_bits()) {
                modified.push(format!("{name} was modified"));
            }
        }
        Ok(modified)
    }
}

/// The bits one run left in h and the final state.
#[derive(PartialEq)]
struct Bits {
    h: Vec<u16>,
    state: [Vec<u32>; 3],
}

fn run_once(
    fwd: &mut MlstmForward,
    stream: &Arc<CudaStream>,
    dev: &mut Buffers,
    shape: ForwardShape,
    (scale, eps): (f32, f32),
) -> std::result::Result<(Bits, MlstmPlan), String> {
    dev.poison(stream)?;
    let plan = fwd
        .launch(stream, dev.args(shape, scale, eps))
        .map_err(|e| format!("launch: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("kernel execution: {e}"))?;
    let [c, n, m] = &dev.state_t;
    let bits = Bits {
        h: bits_of_bf16(stream, &dev.h)?,
        state: [
            bits_of_f32(stream, c)?,
            bits_of_f32(stream, n)?,
            bits_of_f32(stream, m)?,
        ],
    };
    Ok((bits, plan))
}

fn run_case(fwd: &mut MlstmForward, stream: &Arc<CudaStream>, case: &Case) -> CheckResult {
    let spec = MlstmSpec {
        shape: case.shape,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.initial_state,
    };
    let inputs = MlstmInputs::generate(&spec).map_err(err)?;
    let shape = ForwardShape::from(case.shape);
    let scalars = (inputs.scale as f32, inputs.eps as f32);
    fwd.set_num_segments(case.segments);
    fwd.set_states_splits(case.splits);
    std::thread::scope(|scope| {
        let reference = scope.spawn(|| recurrent_forward(&inputs));
        let mut dev = Buffers::upload(stream, &inputs)?;
        let (first, plan) = run_once(fwd, stream, &mut dev, shape, scalars)?;
        let (second, _) = run_once(fwd, stream, &mut dev, shape, scalars)?;
        let mut problems = Vec::new();
        let s = &case.shape;
        let state_shapes = [s.state(), vec![s.b, s.h, s.dk], vec![s.b, s.h]];
        problems.extend(unwritten(&first.h, POISON_BF16, "h", &s.v()).err());
        for ((bits, name), dims) in first
            .state
            .iter()
            .zip(["c_t", "n_t", "m_t"])
            .zip(&state_shapes)
        {
            problems.extend(unwritten(bits, POISON_F32, name, dims).err());
        }
        if first != second {
            problems.push("not deterministic: two runs differ".to_string());
        }
        problems.extend(dev.modified_inputs(stream, &inputs)?);
        let want = reference
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let mut error_of = |what: &str, got: &[f64], want| {
            compare(what, got, want, TOL).unwrap_or_else(|e| {
                problems.push(e);
                f64::NAN
            })
        };
        let e_h = error_of("h", &bf16_values(&first.h), &want.h);
        let st = &want.final_state;
        let e_c = error_of("c_t", &f32_values(&first.state[0]), &st.c);
        let e_n = error_of("n_t", &f32_values(&first.state[1]), &st.n);
        let e_m = error_of("m_t", &f32_values(&first.state[2]), &st.m);
        let summary = format!(
            "S={} cps={} R={} rel err h {e_h:.2e} C {e_c:.2e} n {e_n:.2e} m {e_m:.2e}",
            plan.num_segments, plan.chunks_per_segment, plan.states_splits
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// Calls that must fail with `InvalidArgument` before any launch (h stays poisoned).
fn rejection_checks(
    fwd: &mut MlstmForward,
    stream: &Arc<CudaStream>,
) -> Vec<(String, CheckResult)> {
    let case_shape = Shape {
        b: 1,
        t: 100,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let spec = MlstmSpec {
        shape: case_shape,
        regime: MlstmRegime::Typical,
        seed: 3499,
        round_to_bf16: true,
        initial_state: false,
    };
    let mut out = Vec::new();
    let inputs = match MlstmInputs::generate(&spec) {
        Ok(x) => x,
        Err(e) => return vec![("mlstm_rejections".into(), Err(err(e)))],
    };
    let mut dev = match Buffers::upload(stream, &inputs) {
        Ok(d) => d,
        Err(e) => return vec![("mlstm_rejections".into(), Err(e))],
    };
    let shape = ForwardShape::from(case_shape);
    fwd.set_num_segments(None);
    fwd.set_states_splits(None);
    let mut expect =
        |dev: &mut Buffers, name: &str, pattern: &str, edit: &dyn Fn(&mut MlstmArgs<'_>)| {
            let result = reject(fwd, stream, dev, shape, pattern, edit);
            out.push((format!("mlstm_rejects_{name}"), result));
        };
    expect(&mut dev, "wide_values", "Dv = 256", &|a| a.shape.dv = 256);
    expect(&mut dev, "negative_eps", "eps = -1", &|a| {
        a.eps = Some(-1.0)
    });
    expect(&mut dev, "zero_scale", "scale = 0", &|a| {
        a.scale = Some(0.0)
    });
    expect(&mut dev, "short_gate", "f_gate has", &|a| {
        // SAFETY: the view covers the first half of a live buffer and is never launched.
        a.f_gate = unsafe { DeviceRef::from_raw(a.f_gate.addr(), a.f_gate.len() / 2) };
    });
    // A non-finite gate, found by the debug builds' check (release builds take the contract).
    if cfg!(debug_assertions) {
        let mut bad = to_f32(&inputs.input_gate);
        bad[37] = f32::INFINITY; // b = 0, t = 18, h = 1
        match stream.memcpy_htod(&bad, &mut dev.i_gate) {
            Err(e) => out.push(("mlstm_rejects_infinite_gate".into(), Err(err(e)))),
            Ok(()) => expect(&mut dev, "infinite_gate", "i_gate[b=0, t=18, h=1]", &|_| {}),
        }
    }
    out
}

/// One call edited by `edit` must fail with `InvalidArgument` containing `pattern`, leaving h
/// poisoned.
fn reject(
    fwd: &mut MlstmForward,
    stream: &Arc<CudaStream>,
    dev: &mut Buffers,
    shape: ForwardShape,
    pattern: &str,
    edit: &dyn Fn(&mut MlstmArgs<'_>),
) -> CheckResult {
    dev.poison(stream)?;
    let mut args = dev.args(shape, 0.125, 1e-6);
    edit(&mut args);
    match fwd.launch(stream, args) {
        Ok(_) => Err("accepted".to_string()),
        Err(Error::InvalidArgument(m)) if m.contains(pattern) => {
            stream.synchronize().map_err(err)?;
            let h = bits_of_bf16(stream, &dev.h)?;
            if h.iter().all(|&x| x == POISON_BF16) {
                Ok(m)
            } else {
                Err("h written before the rejection".to_string())
            }
        }
        Err(e) => Err(format!("wrong error: {e}")),
    }
}

/// Ends an mLSTM test's process when it runs longer: a hung kernel fails instead of hanging.
pub(crate) const LIMIT: Duration = Duration::from_secs(300);

fn with_forward(checks: impl FnOnce(&mut MlstmForward, &Arc<CudaStream>, &mut Report)) {
    on_one_gpu(LIMIT, |rt, report| match MlstmForward::new(rt) {
        Err(e) => report.record("mlstm_init", Err(e.to_string()), 0.0),
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
fn mlstm_small_cases_match_the_f64_reference() {
    check_cases(|case| is_small(&case.shape));
}

#[test]
fn mlstm_large_cases_match_the_f64_reference() {
    check_cases(|case| !is_small(&case.shape));
}

#[test]
fn mlstm_bad_arguments_are_rejected_before_any_launch() {
    with_forward(|fwd, stream, report| {
        for (name, result) in rejection_checks(fwd, stream) {
            report.record(&name, result, 0.0);
        }
    });
}
