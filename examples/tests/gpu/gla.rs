//! The GLA forward (`ops::gla`) against the CPU f64 reference, on one GPU.
//!
//! Inputs come from `reference::Inputs::generate` for the GLA family, rounded to bf16 (q, k, v)
//! and f32 (g, h0, scale), so the GPU sees exactly the values the reference computes with. For
//! every case: o and ht are poisoned before each run and must be fully overwritten;
//! `||x - ref|| / ||ref|| <= 5e-3` for o and the final state; a second run gives bitwise identical
//! o and ht; g and h0 are left unchanged. The gate regimes cover every path of the kernels: the
//! usual gates (every chunk's scores one tensor-core product), gates at 0, gates at -30 per token
//! (every chunk steep: its scores term by term) and a mix within a chunk. Calls that must be
//! rejected are checked to fail before any launch.

use cudarc::driver::CudaStream;
use lasp_shmem::ops::gla::{GlaArgs, GlaForward, GlaPlan};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{gla, Family, InputSpec, Inputs, Regime, Shape};
use lasp_shmem::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{
    compare, err, is_small, on_one_gpu, unwritten, CheckResult, ForwardBuffers, Report,
    POISON_BF16, POISON_F32,
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

impl Case {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "gla_B{}_H{}_T{}_Dk{}_Dv{}_{:?}{}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
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
            scale: Some(scale),
        }
    }
}

/// One run on poisoned outputs: the bits of o and ht, and the plan.
fn run_once(
    fwd: &mut GlaForward,
    stream: &Arc<CudaStream>,
    dev: &mut ForwardBuffers,
    shape: ForwardShape,
    scale: f32,
) -> std::result::Result<(Vec<u16>, Vec<u32>, GlaPlan), String> {
    dev.poison(stream)?;
    let plan = fwd
        .launch(stream, dev.args(shape, scale))
        .map_err(|e| format!("launch: {e}"))?;
    stream
        .synchronize()
        .map_err(|e| format!("kernel execution: {e}"))?;
    let o = stream.clone_dtoh(&dev.o).map_err(err)?;
    let ht = stream.clone_dtoh(&dev.ht).map_err(err)?;
    Ok((
        o.iter().map(|x| x.to_bits()).collect(),
        ht.iter().map(|x| x.to_bits()).collect(),
        plan,
    ))
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
        let mut dev = ForwardBuffers::upload(stream, &inputs)?;
        let (o1, ht1, plan) = run_once(fwd, stream, &mut dev, shape, scale)?;
        let (o2, ht2, _) = run_once(fwd, stream, &mut dev, shape, scale)?;
        let mut problems = Vec::new();
        if let Err(e) = unwritten(&o1, POISON_BF16, "o", &case.shape.v()) {
            problems.push(e);
        }
        if let Err(e) = unwritten(&ht1, POISON_F32, "ht", &case.shape.state()) {
            problems.push(e);
        }
        let differ = o1.iter().zip(&o2).filter(|(x, y)| x != y).count()
            + ht1.iter().zip(&ht2).filter(|(x, y)| x != y).count();
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
        let o: Vec<f64> = o1.iter().map(|&b| bf16::from_bits(b).to_f64()).collect();
        let ht: Vec<f64> = ht1.iter().map(|&b| f64::from(f32::from_bits(b))).collect();
        let mut error_of = |what: &str, got: &[f64], want| {
            compare(what, got, want, TOL).unwrap_or_else(|e| {
                problems.push(e);
                f64::NAN
            })
        };
        let e_o = error_of("o", &o, &want.o);
        let e_ht = error_of("ht", &ht, &want.final_state);
        let summary = format!(
            "S={} cps={} R={} rel err o {e_o:.2e} ht {e_ht:.2e}",
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
            let t0 = Instant::now();
            let result = run_case(fwd, stream, &case);
            report.record(&case.name(), result, t0.elapsed().as_secs_f64());
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
