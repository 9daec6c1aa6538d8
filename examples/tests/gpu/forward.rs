//! The scalar-decay forward (`ops::scalar_decay`) against the CPU f64 reference, on one GPU.
//!
//! Inputs come from `reference::Inputs::generate` rounded to bf16 (q, k, v) and f32 (g, h0,
//! scale), so the GPU sees exactly the values the reference computes with. For every case:
//! o and ht are filled with NaN bit patterns (0xFFFF / 0xFFFFFFFF) before each run and must be
//! fully overwritten; `||x - ref|| / ||ref|| <= 5e-3` for o and for the final state; a second
//! run of the same inputs must give bitwise identical o and ht, and so must the one-warpgroup
//! output kernel where the plan runs the two-role one; h0 and g must be left unchanged.
//! Shapes and arguments that must be rejected are checked to fail before any launch.
//!
//! One `PASS`/`FAIL` line per case; a test fails when any of its cases does.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardPlan, ForwardShape, ScalarDecayForward};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{scalar_decay, Family, InputSpec, Inputs, Regime, Shape};
use lasp_shmem::Error;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    compare, err, is_small, on_one_gpu, unwritten, CheckResult, ForwardBuffers, Report,
    POISON_BF16, POISON_F32,
};

const TOL_O: f64 = 5e-3;
const TOL_HT: f64 = 5e-3;

#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    regime: Regime,
    h0: bool,
    ht: bool,
    segments: Option<u32>,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "B{}_H{}_T{}_Dk{}_Dv{}_{:?}{}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
            if self.h0 { "_h0" } else { "" },
            if self.ht { "_ht" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}"))
        )
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 100;
    let mut add = |b, h, t, dk, dv, regime, h0, ht, segments| {
        seed += 1;
        out.push(Case {
            shape: Shape { b, t, h, dk, dv },
            regime,
            h0,
            ht,
            segments,
            seed,
        });
    };
    use Regime::*;
    // B*H = 1: every T, every (Dk, Dv); the automatic plan gives S > 1 from T = 65 on.
    for t in [1, 63, 64, 1000, 8191] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, true, true, None);
        }
    }
    // Gate regimes.
    for regime in [NoDecay, StrongDecay, Mixed] {
        for t in [1000, 8191] {
            for (dk, dv) in [(128, 128), (64, 64)] {
                add(1, 1, t, dk, dv, regime, true, true, None);
            }
        }
        add(1, 1, 63, 128, 128, regime, true, true, None);
    }
    // With and without h0 / ht.
    for (h0, ht) in [(false, true), (true, false), (false, false)] {
        add(1, 1, 1000, 128, 128, Typical, h0, ht, None);
        add(1, 1, 1000, 128, 128, Mixed, h0, ht, Some(1));
    }
    // Forced segment counts: S = 1, 2, 5 (-> 4 of 4 chunks), one chunk per segment, an uneven
    // last segment (8191 tokens: 128 chunks, S = 3 -> 43 + 43 + 42).
    for s in [1, 2, 5, 16] {
        add(1, 1, 1000, 128, 128, Mixed, true, true, Some(s));
    }
    add(1, 1, 1000, 64, 64, Typical, true, true, Some(3));
    add(1, 1, 8191, 128, 128, Typical, true, true, Some(1));
    add(1, 1, 8191, 128, 128, Mixed, true, true, Some(3));
    add(1, 1, 63, 128, 128, Typical, true, true, Some(4)); // one chunk: S = 1
                                                           // Several batches and heads (the [B, T, H, D] indexing), Dv = 192.
    add(2, 3, 1000, 128, 128, Typical, true, true, None);
    add(3, 5, 130, 64, 192, Mixed, true, true, None);
    add(3, 5, 130, 128, 192, Typical, true, true, Some(3));
    // B*H = 256: the automatic plan is S = 1 there; forced S > 1 too.
    add(4, 64, 64, 64, 64, Typical, true, true, None);
    add(4, 64, 200, 64, 64, Mixed, true, true, None);
    add(2, 128, 200, 64, 64, Typical, true, true, Some(2));
    add(2, 128, 200, 64, 64, StrongDecay, false, true, Some(4));
    add(4, 64, 200, 64, 64, NoDecay, true, false, Some(4));
    add(4, 64, 64, 128, 128, Typical, true, true, None);
    add(16, 16, 130, 128, 128, Mixed, true, true, Some(3));
    add(4, 64, 1000, 128, 128, Typical, true, true, None);
    out
}

/// What one run returns: the bits of o and (if requested) ht, and the plan used.
struct RunOutput {
    o: Vec<u16>,
    ht: Option<Vec<u32>>,
    plan: ForwardPlan,
}

/// Runs the op once on poisoned outputs.
fn run_once(
    fwd: &mut ScalarDecayForward,
    stream: &Arc<CudaStream>,
    dev: &mut ForwardBuffers,
    case: &Case,
    scale: f32,
) -> std::result::Result<RunOutput, String> {
    dev.poison(stream)?;
    let shape = ForwardShape::from(case.shape);
    let plan = fwd
        .launch(
            stream,
            ForwardArgs {
                shape,
                q: DeviceRef::new(&dev.q),
                k: DeviceRef::new(&dev.k),
                v: DeviceRef::new(&dev.v),
                g: DeviceRef::new(&dev.g),
                h0: dev.h0.as_ref().map(DeviceRef::new),
                o: DeviceMut::new(&mut dev.o),
                ht: case.ht.then(|| DeviceMut::new(&mut dev.ht)),
                scale: Some(scale),
            },
        )
        .map_err(|e| format!("launch: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("kernel execution: {e}"))?;
    let o: Vec<u16> = stream
        .clone_dtoh(&dev.o)
        .map_err(err)?
        .iter()
        .map(|x| x.to_bits())
        .collect();
    let ht = if case.ht {
        Some(
            stream
                .clone_dtoh(&dev.ht)
                .map_err(err)?
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        )
    } else {
        // Not requested: must stay poisoned (the kernel must not write through a NULL ht).
        let untouched = stream
            .clone_dtoh(&dev.ht)
            .map_err(err)?
            .iter()
            .all(|x| x.to_bits() == POISON_F32);
        if !untouched {
            return Err("ht was not requested but its buffer changed".into());
        }
        None
    };
    Ok(RunOutput { o, ht, plan })
}

fn run_case(fwd: &mut ScalarDecayForward, stream: &Arc<CudaStream>, case: &Case) -> CheckResult {
    let spec = InputSpec {
        shape: case.shape,
        family: Family::ScalarDecay,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.h0,
    };
    let inputs = Inputs::generate(&spec).map_err(err)?;
    let scale = inputs.scale as f32;
    fwd.set_num_segments(case.segments).map_err(err)?;
    std::thread::scope(|scope| {
        // The f64 reference runs on the CPU while the GPU works.
        let reference = scope.spawn(|| scalar_decay::recurrent_forward(&inputs));
        let mut dev = ForwardBuffers::upload(stream, &inputs)?;
        let RunOutput {
            o: o1,
            ht: ht1,
            plan,
        } = run_once(fwd, stream, &mut dev, case, scale)?;
        let RunOutput { o: o2, ht: ht2, .. } = run_once(fwd, stream, &mut dev, case, scale)?;
        let mut problems = Vec::new();
        if let Err(e) = unwritten(&o1, POISON_BF16, "o", &case.shape.v()) {
            problems.push(e);
        }
        if let Some(ht) = &ht1 {
            if let Err(e) = unwritten(ht, POISON_F32, "ht", &case.shape.state()) {
                problems.push(e);
            }
        }
        // Elements of o and ht whose bits differ between two runs.
        let bit_differences = |o_b: &[u16], ht_b: &Option<Vec<u32>>| {
            o1.iter().zip(o_b).filter(|(x, y)| x != y).count()
                + match (&ht1, ht_b) {
                    (Some(a), Some(b)) => a.iter().zip(b).filter(|(x, y)| x != y).count(),
                    _ => 0,
                }
        };
        let differ = bit_differences(&o2, &ht2);
        if differ > 0 {
            problems.push(format!(
                "not deterministic: {differ} elements differ between two runs"
            ));
        }
        // The two-role output kernel must give the one-warpgroup kernel's bits.
        if plan.output_roles {
            fwd.set_two_role_output(false);
            let one = run_once(fwd, stream, &mut dev, case, scale);
            fwd.set_two_role_output(true);
            let RunOutput { o: o3, ht: ht3, .. } = one?;
            let differ = bit_differences(&o3, &ht3);
            if differ > 0 {
                problems.push(format!(
                    "the two-role and one-warpgroup output kernels differ in {differ} elements"
                ));
            }
        }
        // Inputs must be left alone.
        problems.extend(dev.modified_inputs(stream, &inputs)?);
        let want = reference
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let o: Vec<f64> = o1.iter().map(|&b| bf16::from_bits(b).to_f64()).collect();
        let e_o = compare("o", &o, &want.o, TOL_O).unwrap_or_else(|e| {
            problems.push(e);
            f64::NAN
        });
        let e_ht = match &ht1 {
            Some(ht) => {
                let ht: Vec<f64> = ht.iter().map(|&b| f64::from(f32::from_bits(b))).collect();
                compare("ht", &ht, &want.final_state, TOL_HT).unwrap_or_else(|e| {
                    problems.push(e);
                    f64::NAN
                })
            }
            None => f64::NAN,
        };
        let summary = format!(
            "S={} cps={} {} rel err o {e_o:.2e} ht {e_ht:.2e}",
            plan.num_segments,
            plan.chunks_per_segment,
            plan.output_kind()
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// A call that must fail with `InvalidArgument` before any launch (o stays poisoned).
fn expect_rejected(
    stream: &Arc<CudaStream>,
    o: &mut CudaSlice<bf16>,
    want_in_message: &str,
    call: impl FnOnce(&mut CudaSlice<bf16>) -> lasp_shmem::Result<ForwardPlan>,
) -> CheckResult {
    let poison = vec![bf16::from_bits(POISON_BF16); o.len()];
    stream.memcpy_htod(&poison, o).map_err(err)?;
    stream.synchronize().map_err(err)?;
    let result = call(o);
    stream.synchronize().map_err(err)?;
    let untouched = stream
        .clone_dtoh(o)
        .map_err(err)?
        .iter()
        .all(|x| x.to_bits() == POISON_BF16);
    match result {
        Ok(plan) => Err(format!("accepted (plan {plan:?}) but must be rejected")),
        Err(Error::InvalidArgument(msg)) if !untouched => {
            Err(format!("rejected ({msg}) but o was written: a kernel ran"))
        }
        Err(Error::InvalidArgument(msg)) if msg.contains(want_in_message) => Ok(msg),
        Err(e) => Err(format!(
            "wrong error (want InvalidArgument mentioning {want_in_message:?}): {e}"
        )),
    }
}

/// Valid inputs of the rejection checks; each check changes one thing.
struct Valid {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    h0: CudaSlice<f32>,
}

impl Valid {
    fn args<'a>(&'a self, o: &'a mut CudaSlice<bf16>) -> ForwardArgs<'a> {
        ForwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: Some(DeviceRef::new(&self.h0)),
            o: DeviceMut::new(o),
            ht: None,
            scale: None,
        }
    }
}

fn rejection_checks(
    fwd: &mut ScalarDecayForward,
    stream: &Arc<CudaStream>,
) -> std::result::Result<Vec<(String, CheckResult)>, String> {
    let mut out = Vec::new();
    fwd.set_num_segments(None).map_err(err)?;
    let shape = ForwardShape {
        b: 1,
        t: 200,
        h: 2,
        dk: 128,
        dv: 128,
    };
    let bf = |n: usize| stream.alloc_zeros::<bf16>(n).map_err(err);
    let fp = |n: usize| stream.alloc_zeros::<f32>(n).map_err(err);
    let ok = Valid {
        shape,
        q: bf(shape.qk_len())?,
        k: bf(shape.qk_len())?,
        v: bf(shape.v_len())?,
        g: fp(shape.gate_len())?,
        h0: fp(shape.state_len())?,
    };
    let mut o = bf(shape.v_len())?;

    // Dk = 96: q and k sized for it, the shape itself is refused.
    let s96 = ForwardShape { dk: 96, ..shape };
    let (q96, k96) = (bf(s96.qk_len())?, bf(s96.qk_len())?);
    out.push((
        "reject_dk96".to_string(),
        expect_rejected(stream, &mut o, "Dk = 96", |o| {
            let mut a = ok.args(o);
            a.shape = s96;
            a.q = DeviceRef::new(&q96);
            a.k = DeviceRef::new(&k96);
            a.h0 = None;
            fwd.launch(stream, a)
        }),
    ));
    // q one element short (a view of the right buffer with the wrong length).
    out.push((
        "reject_q_length".to_string(),
        expect_rejected(stream, &mut o, "q has", |o| {
            let short = ok.q.slice(0..shape.qk_len() - 1);
            let mut a = ok.args(o);
            a.q = DeviceRef::new(&short);
            fwd.launch(stream, a)
        }),
    ));
    // g with one element too many.
    out.push((
        "reject_g_length".to_string(),
        expect_rejected(stream, &mut o, "g has", |o| {
            let long = ok.h0.slice(0..shape.gate_len() + 1);
            let mut a = ok.args(o);
            a.g = DeviceRef::new(&long);
            fwd.launch(stream, a)
        }),
    ));
    // h0 of another shape.
    out.push((
        "reject_h0_length".to_string(),
        expect_rejected(stream, &mut o, "h0 has", |o| {
            let half = ok.h0.slice(0..shape.state_len() / 2);
            let mut a = ok.args(o);
            a.h0 = Some(DeviceRef::new(&half));
            fwd.launch(stream, a)
        }),
    ));
    // v starting 2 bytes into a buffer (right length, misaligned).
    let v_big = bf(shape.v_len() + 8)?;
    out.push((
        "reject_misaligned_v".to_string(),
        expect_rejected(stream, &mut o, "16-byte aligned", |o| {
            let odd = v_big.slice(1..1 + shape.v_len());
            let mut a = ok.args(o);
            a.v = DeviceRef::new(&odd);
            fwd.launch(stream, a)
        }),
    ));
    // ht in place of h0.
    out.push((
        "reject_ht_overlapping_h0".to_string(),
        expect_rejected(stream, &mut o, "ht overlaps input h0", |o| {
            let (addr, _no_events) = ok.h0.device_ptr(stream);
            // SAFETY: a view of h0's own allocation; the call is rejected before any launch (and
            // would only write h0's memory if it were not).
            let alias = unsafe { DeviceMut::<f32>::from_raw(addr, ok.h0.len()) };
            let mut a = ok.args(o);
            a.ht = Some(alias);
            fwd.launch(stream, a)
        }),
    ));
    // Non-positive scale.
    out.push((
        "reject_scale_zero".to_string(),
        expect_rejected(stream, &mut o, "scale = 0", |o| {
            let mut a = ok.args(o);
            a.scale = Some(0.0);
            fwd.launch(stream, a)
        }),
    ));
    // The valid set really is valid (each rejection above is about what it changed).
    out.push((
        "accept_valid_args".to_string(),
        fwd.launch(stream, ok.args(&mut o))
            .map_err(err)
            .and_then(|plan| {
                stream.synchronize().map_err(err)?;
                Ok(format!("S={}", plan.num_segments))
            }),
    ));
    // validate_gates names a planted positive and a planted NaN gate.
    let mut gates = vec![-0.1f32; shape.gate_len()];
    gates[2 * 57 + 1] = 0.5; // [b=0, t=57, h=1]
    let planted = stream.clone_htod(&gates).map_err(err)?;
    out.push((
        "validate_gates_positive".to_string(),
        match fwd.validate_gates(stream, DeviceRef::new(&planted), &shape) {
            Err(Error::InvalidArgument(m)) if m.contains("g[b=0, t=57, h=1]") => Ok(m),
            other => Err(format!(
                "want an error naming g[b=0, t=57, h=1], got {other:?}"
            )),
        },
    ));
    gates[2 * 57 + 1] = -0.1;
    gates[2 * 199] = f32::NAN; // [b=0, t=199, h=0]
    let planted = stream.clone_htod(&gates).map_err(err)?;
    out.push((
        "validate_gates_nan".to_string(),
        match fwd.validate_gates(stream, DeviceRef::new(&planted), &shape) {
            Err(Error::InvalidArgument(m)) if m.contains("g[b=0, t=199, h=0]") => Ok(m),
            other => Err(format!(
                "want an error naming g[b=0, t=199, h=0], got {other:?}"
            )),
        },
    ));
    gates[2 * 199] = 0.0;
    let fine = stream.clone_htod(&gates).map_err(err)?;
    out.push((
        "validate_gates_accepts_valid".to_string(),
        fwd.validate_gates(stream, DeviceRef::new(&fine), &shape)
            .map(|_| String::new())
            .map_err(err),
    ));
    Ok(out)
}

/// Ends a forward test's process when it runs longer: a hung kernel fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(300);

/// Runs `checks` with the forward operation of a fresh runtime on GPU 0, in a process of its own.
fn with_forward(checks: impl FnOnce(&mut ScalarDecayForward, &Arc<CudaStream>, &mut Report)) {
    on_one_gpu(LIMIT, |rt, report| match ScalarDecayForward::new(rt) {
        Err(e) => report.record("op_init", Err(e.to_string()), 0.0),
        Ok(mut fwd) => {
            println!(
                "forward: {} ({} SMs)",
                rt.context().name().unwrap_or_default(),
                fwd.sm_count()
            );
            checks(&mut fwd, rt.stream(), report);
        }
    });
}

/// Every case that `select` keeps, against the reference.
fn check_cases(select: impl Fn(&Case) -> bool) {
    with_forward(|fwd, stream, report| {
        for case in cases().into_iter().filter(|case| select(case)) {
            report.timed(&case.name(), || run_case(fwd, stream, &case));
        }
    });
}

#[test]
fn small_cases_match_the_f64_reference() {
    check_cases(|case| is_small(&case.shape));
}

#[test]
fn large_cases_match_the_f64_reference() {
    check_cases(|case| !is_small(&case.shape));
}

#[test]
fn bad_arguments_are_rejected_before_any_launch() {
    with_forward(|fwd, stream, report| match rejection_checks(fwd, stream) {
        Ok(checks) => {
            for (name, result) in checks {
                report.record(&name, result, 0.0);
            }
        }
        Err(e) => report.record("rejection_checks_setup", Err(e), 0.0),
    });
}
