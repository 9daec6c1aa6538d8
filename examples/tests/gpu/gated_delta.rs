//! The Gated DeltaNet forward (`ops::gated_delta`) against the CPU f64 reference, on one GPU.
//!
//! Inputs come from `reference::Inputs::generate` for the delta-rule family (unit-norm q and k,
//! `beta = sigmoid(x)`), rounded to bf16 (q, k, v) and f32 (g, beta, h0, scale), so the GPU sees
//! exactly the values the reference computes with; some cases then set every beta to 0 (no
//! writes: the state only decays) or to 1 (each token overwrites its key's direction). The
//! automatic plan cuts these short batches into many segments (their affine summaries and fold);
//! some cases force one segment or another count. For every case: o and ht are poisoned before each run and must be fully overwritten;
//! `||x - ref|| / ||ref|| <= 5e-3` against the token-by-token recurrence for o and the final
//! state; a second run gives bitwise identical o and ht; g, beta and h0 are left unchanged.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::gated_delta::{GatedDeltaArgs, GatedDeltaForward, GatedDeltaPlan};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::{delta_rule, Family, InputSpec, Inputs, Regime, Shape};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{
    bf16_values, bits_of_bf16, bits_of_f32, compare, err, f32_values, is_small, on_one_gpu, to_f32,
    unwritten, CheckResult, ForwardBuffers, Report, POISON_BF16, POISON_F32,
};

const TOL: f64 = 5e-3;

/// What a case does to the generated betas.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Betas {
    Sigmoid,
    AllZero,
    AllOne,
}

#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    regime: Regime,
    betas: Betas,
    h0: bool,
    /// Forced segments per sequence (else the plan's).
    segments: Option<u32>,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "gated_delta_B{}_H{}_T{}_Dk{}_Dv{}_{:?}_{:?}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
            self.betas,
            if self.h0 { "_h0" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}"))
        )
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 900;
    let mut add = |b, h, t, dk, dv, regime, betas, h0, segments| {
        seed += 1;
        out.push(Case {
            shape: Shape { b, t, h, dk, dv },
            regime,
            betas,
            h0,
            segments,
            seed,
        });
    };
    use Betas::*;
    use Regime::*;
    // B*H = 1: ragged and whole chunks, every (Dk, Dv).
    for t in [1, 63, 64, 65, 1000] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, Sigmoid, true, None);
        }
    }
    // Every gate regime, with and without h0.
    for regime in [NoDecay, StrongDecay, Mixed, LargeNorm] {
        for (dk, dv) in [(128, 128), (64, 64)] {
            add(1, 1, 1000, dk, dv, regime, Sigmoid, true, None);
            add(1, 1, 1000, dk, dv, regime, Sigmoid, false, None);
        }
    }
    // beta at 0 and at 1.
    for betas in [AllZero, AllOne] {
        add(1, 2, 300, 128, 128, Typical, betas, true, None);
        add(1, 2, 300, 64, 64, Mixed, betas, true, None);
    }
    // Forced segment counts: one (the whole sequence in one CTA), a few, one chunk each.
    for segments in [1, 2, 5, 16] {
        add(1, 1, 1000, 128, 128, Mixed, Sigmoid, true, Some(segments));
    }
    add(1, 2, 1000, 64, 128, Typical, Sigmoid, false, Some(3));
    // Several batches and heads (the [B, T, H, D] indexing), three Dv tiles, and B*H = 256.
    add(2, 3, 1000, 128, 128, Typical, Sigmoid, true, None);
    add(1, 2, 300, 128, 192, Typical, Sigmoid, true, None);
    add(4, 64, 200, 64, 64, Typical, Sigmoid, true, None);
    add(1, 1, 8191, 128, 128, Typical, Sigmoid, true, None);
    out
}

/// The forward's inputs and outputs on the device: the shared forward buffers and beta.
struct Buffers {
    fwd: ForwardBuffers,
    beta: CudaSlice<f32>,
}

impl Buffers {
    fn args(&mut self, shape: ForwardShape, scale: f32) -> GatedDeltaArgs<'_> {
        let d = &mut self.fwd;
        GatedDeltaArgs {
            shape,
            q: DeviceRef::new(&d.q),
            k: DeviceRef::new(&d.k),
            v: DeviceRef::new(&d.v),
            g: DeviceRef::new(&d.g),
            beta: DeviceRef::new(&self.beta),
            h0: d.h0.as_ref().map(DeviceRef::new),
            o: DeviceMut::new(&mut d.o),
            ht: Some(DeviceMut::new(&mut d.ht)),
            scale: Some(scale),
        }
    }
}

/// The bits one run on poisoned outputs left in o and ht.
fn run_once(
    fwd: &mut GatedDeltaForward,
    stream: &Arc<CudaStream>,
    dev: &mut Buffers,
    shape: ForwardShape,
    scale: f32,
) -> std::result::Result<(Vec<u16>, Vec<u32>, GatedDeltaPlan), String> {
    dev.fwd.poison(stream)?;
    let plan = fwd
        .launch(stream, dev.args(shape, scale))
        .map_err(|e| format!("launch: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("kernel execution: {e}"))?;
    Ok((
        bits_of_bf16(stream, &dev.fwd.o)?,
        bits_of_f32(stream, &dev.fwd.ht)?,
        plan,
    ))
}

fn run_case(fwd: &mut GatedDeltaForward, stream: &Arc<CudaStream>, case: &Case) -> CheckResult {
    let spec = InputSpec {
        shape: case.shape,
        family: Family::DeltaRule,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.h0,
    };
    let mut inputs = Inputs::generate(&spec).map_err(err)?;
    let fill = match case.betas {
        Betas::Sigmoid => None,
        Betas::AllZero => Some(0.0),
        Betas::AllOne => Some(1.0),
    };
    let beta = inputs
        .beta
        .as_mut()
        .ok_or("the delta rule's inputs have no beta")?;
    if let Some(x) = fill {
        beta.data_mut().fill(x);
    }
    let beta_host = to_f32(beta);
    let scale = inputs.scale as f32;
    let shape = ForwardShape::from(case.shape);
    fwd.set_num_segments(case.segments).map_err(err)?;
    std::thread::scope(|scope| {
        let reference = scope.spawn(|| delta_rule::recurrent_forward(&inputs));
        let mut dev = Buffers {
            fwd: ForwardBuffers::upload(stream, &inputs)?,
            beta: stream.clone_htod(&beta_host).map_err(err)?,
        };
        let (o, ht, plan) = run_once(fwd, stream, &mut dev, shape, scale)?;
        let (o2, ht2, _) = run_once(fwd, stream, &mut dev, shape, scale)?;
        // One segment: the two-role output kernel, which must give the one-warpgroup kernel's bits.
        let one_warpgroup = if plan.output_roles.is_some() {
            fwd.set_two_role_output(false);
            let bits = run_once(fwd, stream, &mut dev, shape, scale);
            fwd.set_two_role_output(true);
            Some(bits?)
        } else {
            None
        };
        let s = &case.shape;
        let mut problems = Vec::new();
        for check in [
            unwritten(&o, POISON_BF16, "o", &s.v()),
            unwritten(&ht, POISON_F32, "ht", &s.state()),
        ] {
            problems.extend(check.err());
        }
        let differ = o.iter().zip(&o2).filter(|(x, y)| x != y).count()
            + ht.iter().zip(&ht2).filter(|(x, y)| x != y).count();
        if differ > 0 {
            problems.push(format!(
                "not deterministic: {differ} elements differ between two runs"
            ));
        }
        if let Some((o1, ht1, _)) = &one_warpgroup {
            if *o1 != o || *ht1 != ht {
                problems
                    .push("the two-role output kernel differs from the one-warpgroup one".into());
            }
        }
        problems.extend(dev.fwd.modified_inputs(stream, &inputs)?);
        let beta_bits: Vec<u32> = beta_host.iter().map(|x| x.to_bits()).collect();
        if bits_of_f32(stream, &dev.beta)? != beta_bits {
            problems.push("beta was modified".into());
        }
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
        let e_o = error_of("o", &bf16_values(&o), &want.o);
        let e_ht = error_of("ht", &f32_values(&ht), &want.final_state);
        let summary = format!(
            "S={} cps={}{} rel err o {e_o:.2e} ht {e_ht:.2e}",
            plan.num_segments,
            plan.chunks_per_segment,
            if one_warpgroup.is_some() {
                " two-role"
            } else {
                ""
            }
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// Ends a test's process when it runs longer: a hung kernel fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(300);

fn check_cases(select: impl Fn(&Case) -> bool) {
    on_one_gpu(
        LIMIT,
        |rt, report: &mut Report| match GatedDeltaForward::new(rt) {
            Err(e) => report.record("gated_delta_init", Err(e.to_string()), 0.0),
            Ok(mut fwd) => {
                for case in cases().into_iter().filter(|case| select(case)) {
                    let t0 = Instant::now();
                    let result = run_case(&mut fwd, rt.stream(), &case);
                    report.record(&case.name(), result, t0.elapsed().as_secs_f64());
                }
            }
        },
    );
}

#[test]
fn gated_delta_small_cases_match_the_f64_reference() {
    check_cases(|case| is_small(&case.shape));
}

#[test]
fn gated_delta_large_cases_match_the_f64_reference() {
    check_cases(|case| !is_small(&case.shape));
}
