//! The scalar-decay backward (`ops::scalar_decay::backward`) against the CPU f64 reference
//! (`reference::scalar_decay::backward`), on one GPU.
//!
//! Inputs and output gradients come from `reference::Inputs::generate` and
//! `reference::Cotangents::generate`, rounded to bf16 / f32, so the GPU sees exactly the values the
//! reference computes with. For every case the gradients are filled with NaN bit patterns before
//! each run and must be fully overwritten; `||x - ref|| / ||ref|| <= 5e-3` for dq, dk, dv, dh0 and
//! dg (the gate gradient sums only terms that do not cancel, so its own norm is its scale); a
//! second run must give bitwise identical gradients. Arguments that must be rejected are checked
//! to fail before any launch.
//!
//! One `PASS`/`FAIL` line per case; a test fails when any of its cases does.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::scalar_decay::{BackwardArgs, ScalarDecayBackward};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{
    rel_err, scalar_decay, Cotangents, Family, InputSpec, Inputs, Regime, Shape, Tensor,
};
use lasp_shmem::Error;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    bf16_values, err, f32_values, is_small, on_one_gpu, to_bf16, to_f32, CheckResult, Report,
    POISON_BF16, POISON_F32,
};

/// dq, dk, dv (bf16), dh0 and dg: the forward kernel's tolerance; the passes are its kernels, and
/// fla's chunk_gla reaches 3e-4 .. 1.5e-3 on dg (benches/gradient_accuracy.py measures both).
const TOL: f64 = 5e-3;

#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    regime: Regime,
    h0: bool,
    d_ht: bool,
    segments: Option<u32>,
    seed: u64,
}

impl Case {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "bwd_B{}_H{}_T{}_Dk{}_Dv{}_{:?}{}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
            if self.h0 { "_h0" } else { "" },
            if self.d_ht { "_dht" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}"))
        )
    }
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 500;
    let mut add = |b, h, t, dk, dv, regime, h0, d_ht, segments| {
        seed += 1;
        out.push(Case {
            shape: Shape { b, t, h, dk, dv },
            regime,
            h0,
            d_ht,
            segments,
            seed,
        });
    };
    use Regime::*;
    // Ragged T, every (Dk, Dv); the automatic plan has S > 1 from T = 65 on at B*H = 1.
    for t in [1, 63, 64, 1000, 8191] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, true, true, None);
        }
    }
    for regime in [NoDecay, StrongDecay, Mixed, LargeNorm] {
        add(1, 1, 1000, 128, 128, regime, true, true, None);
        add(1, 1, 63, 64, 64, regime, true, true, None);
    }
    for (h0, d_ht) in [(false, true), (true, false), (false, false)] {
        add(1, 1, 1000, 128, 128, Mixed, h0, d_ht, None);
    }
    // One segment (the in-order pass on the two-role kernel), and uneven segments.
    add(1, 1, 1000, 128, 128, Typical, true, true, Some(1));
    add(1, 1, 8191, 128, 128, Mixed, true, true, Some(3));
    // Several batches and heads: the [B, T, H, D] indexing of every pass and kernel.
    add(2, 3, 1000, 128, 128, Typical, true, true, None);
    add(3, 5, 130, 64, 128, Mixed, true, true, None);
    add(4, 64, 200, 64, 64, Typical, true, true, None);
    add(2, 32, 300, 128, 128, Mixed, false, true, Some(2));
    // The gate gradient's blocks of 256 tokens: one whole block, a block and one token, two
    // whole blocks (reversed passes of one segment and of uneven ones), and long sequences.
    for t in [256, 257, 512] {
        add(1, 1, t, 128, 128, Typical, true, true, Some(1));
    }
    add(1, 1, 513, 64, 64, NoDecay, true, true, Some(3));
    add(1, 2, 20000, 64, 64, Mixed, true, true, None);
    add(2, 1, 16385, 64, 128, Typical, false, false, None);
    out
}

/// The case's tensors on the device.
struct Device {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    h0: Option<CudaSlice<f32>>,
    d_o: CudaSlice<bf16>,
    d_ht: Option<CudaSlice<f32>>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dh0: CudaSlice<f32>,
}

/// The gradients' bits after one run.
#[derive(PartialEq)]
struct Bits {
    dq: Vec<u16>,
    dk: Vec<u16>,
    dv: Vec<u16>,
    dg: Vec<u32>,
    dh0: Vec<u32>,
}

impl Device {
    fn upload(
        stream: &Arc<CudaStream>,
        inputs: &Inputs,
        cot: &Cotangents,
    ) -> std::result::Result<Self, String> {
        let s = ForwardShape::from(inputs.shape);
        let up_f32 = |t: &Tensor| stream.clone_htod(&to_f32(t)).map_err(err);
        let dev = Device {
            q: stream.clone_htod(&to_bf16(&inputs.q)).map_err(err)?,
            k: stream.clone_htod(&to_bf16(&inputs.k)).map_err(err)?,
            v: stream.clone_htod(&to_bf16(&inputs.v)).map_err(err)?,
            g: up_f32(&inputs.g)?,
            h0: inputs.h0.as_ref().map(up_f32).transpose()?,
            d_o: stream.clone_htod(&to_bf16(&cot.d_o)).map_err(err)?,
            d_ht: cot.d_ht.as_ref().map(up_f32).transpose()?,
            dq: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dk: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dv: stream.alloc_zeros(s.v_len()).map_err(err)?,
            dg: stream.alloc_zeros(s.gate_len()).map_err(err)?,
            dh0: stream.alloc_zeros(s.state_len()).map_err(err)?,
        };
        stream.synchronize().map_err(err)?;
        Ok(dev)
    }

    /// Poisons the gradients, runs the backward, returns their bits.
    fn run(
        &mut self,
        bwd: &mut ScalarDecayBackward,
        stream: &Arc<CudaStream>,
        shape: ForwardShape,
        scale: f32,
    ) -> std::result::Result<Bits, String> {
        for buf in [&mut self.dq, &mut self.dk, &mut self.dv] {
            let poison = vec![bf16::from_bits(POISON_BF16); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        for buf in [&mut self.dg, &mut self.dh0] {
            let poison = vec![f32::from_bits(POISON_F32); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        bwd.launch(
            stream,
            BackwardArgs {
                shape,
                q: DeviceRef::new(&self.q),
                k: DeviceRef::new(&self.k),
                v: DeviceRef::new(&self.v),
                g: DeviceRef::new(&self.g),
                h0: self.h0.as_ref().map(DeviceRef::new),
                d_o: DeviceRef::new(&self.d_o),
                d_ht: self.d_ht.as_ref().map(DeviceRef::new),
                dq: DeviceMut::new(&mut self.dq),
                dk: DeviceMut::new(&mut self.dk),
                dv: DeviceMut::new(&mut self.dv),
                dg: DeviceMut::new(&mut self.dg),
                dh0: Some(DeviceMut::new(&mut self.dh0)),
                scale: Some(scale),
            },
        )
        .map_err(|e| format!("launch: {e}"))?;
        stream
            .synchronize()
            .map_err(|e| format!("kernel execution: {e}"))?;
        let bf = |b: &CudaSlice<bf16>| -> std::result::Result<Vec<u16>, String> {
            Ok(stream
                .clone_dtoh(b)
                .map_err(err)?
                .iter()
                .map(|x| x.to_bits())
                .collect())
        };
        let f = |b: &CudaSlice<f32>| -> std::result::Result<Vec<u32>, String> {
            Ok(stream
                .clone_dtoh(b)
                .map_err(err)?
                .iter()
                .map(|x| x.to_bits())
                .collect())
        };
        Ok(Bits {
            dq: bf(&self.dq)?,
            dk: bf(&self.dk)?,
            dv: bf(&self.dv)?,
            dg: f(&self.dg)?,
            dh0: f(&self.dh0)?,
        })
    }
}

fn unwritten<T: PartialEq + Copy>(bits: &[T], poison: T, what: &str) -> Option<String> {
    let count = bits.iter().filter(|&&x| x == poison).count();
    (count > 0).then(|| {
        let first = bits.iter().position(|&x| x == poison).unwrap();
        format!(
            "{count} of {} elements of {what} were never written (first at flat index {first})",
            bits.len()
        )
    })
}

fn run_case(bwd: &mut ScalarDecayBackward, stream: &Arc<CudaStream>, case: &Case) -> CheckResult {
    let spec = InputSpec {
        shape: case.shape,
        family: Family::ScalarDecay,
        regime: case.regime,
        seed: case.seed,
        round_to_bf16: true,
        initial_state: case.h0,
    };
    let inputs = Inputs::generate(&spec).map_err(err)?;
    let cot = Cotangents::generate(case.shape, case.seed, case.d_ht, true).map_err(err)?;
    let scale = inputs.scale as f32;
    bwd.forward_mut()
        .set_num_segments(case.segments)
        .map_err(err)?;
    std::thread::scope(|scope| {
        let reference =
            scope.spawn(|| scalar_decay::backward(&inputs, 64, &cot.d_o, cot.d_ht.as_ref()));
        let shape = ForwardShape::from(case.shape);
        let mut dev = Device::upload(stream, &inputs, &cot)?;
        let first = dev.run(bwd, stream, shape, scale)?;
        let second = dev.run(bwd, stream, shape, scale)?;
        let mut problems: Vec<String> = [
            unwritten(&first.dq, POISON_BF16, "dq"),
            unwritten(&first.dk, POISON_BF16, "dk"),
            unwritten(&first.dv, POISON_BF16, "dv"),
            unwritten(&first.dg, POISON_F32, "dg"),
            unwritten(&first.dh0, POISON_F32, "dh0"),
        ]
        .into_iter()
        .flatten()
        .collect();
        if first != second {
            problems.push("not deterministic: two runs gave different bits".into());
        }
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
            ("dg", f32_values(&first.dg), &want.dg),
        ] {
            let e = rel_err(&got, want.data());
            errors.push(format!("{what} {e:.2e}"));
            // NaN (a non-finite gradient) never passes.
            if e.is_nan() || e > TOL {
                problems.push(format!("{what}: rel err {e:.3e} > {TOL:.0e}"));
            }
        }
        let summary = format!("rel err {}", errors.join(", "));
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// The verdict on a call that must fail with `InvalidArgument` mentioning `want` before any
/// launch: `dq` was poisoned before it and must still be.
fn verdict(
    stream: &Arc<CudaStream>,
    dq: &CudaSlice<bf16>,
    want: &str,
    result: lasp_shmem::Result<()>,
) -> CheckResult {
    stream.synchronize().map_err(err)?;
    let untouched = stream
        .clone_dtoh(dq)
        .map_err(err)?
        .iter()
        .all(|x| x.to_bits() == POISON_BF16);
    match result {
        Ok(()) => Err("accepted but must be rejected".into()),
        Err(Error::InvalidArgument(m)) if !untouched => {
            Err(format!("rejected ({m}) but dq was written: a kernel ran"))
        }
        Err(Error::InvalidArgument(m)) if m.contains(want) => Ok(m),
        Err(e) => Err(format!(
            "wrong error (want InvalidArgument mentioning {want:?}): {e}"
        )),
    }
}

/// Arguments that must be rejected before anything runs. Each check changes one thing of a
/// valid call: the shape (Dv = 192, which the dq pass cannot take as its key width), dq's length,
/// and dg placed on top of q.
fn rejection_checks(
    bwd: &mut ScalarDecayBackward,
    stream: &Arc<CudaStream>,
) -> std::result::Result<Vec<(String, CheckResult)>, String> {
    bwd.forward_mut().set_num_segments(None).map_err(err)?;
    let shape = Shape {
        b: 1,
        t: 100,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let spec = InputSpec {
        shape,
        family: Family::ScalarDecay,
        regime: Regime::Typical,
        seed: 7,
        round_to_bf16: true,
        initial_state: true,
    };
    let inputs = Inputs::generate(&spec).map_err(err)?;
    let cot = Cotangents::generate(shape, 7, true, true).map_err(err)?;
    let mut d = Device::upload(stream, &inputs, &cot)?;
    let valid = ForwardShape::from(shape);
    let mut out = Vec::new();
    for (name, want) in [
        ("bwd_reject_dv192", "Dv = 192 is not supported"),
        ("bwd_reject_short_dq", "dq has"),
        ("bwd_reject_dg_on_q", "dg overlaps q"),
    ] {
        let poison = vec![bf16::from_bits(POISON_BF16); d.dq.len()];
        stream.memcpy_htod(&poison, &mut d.dq).map_err(err)?;
        let q = DeviceRef::new(&d.q);
        let shape = if name.ends_with("dv192") {
            ForwardShape { dv: 192, ..valid }
        } else {
            valid
        };
        let dq = DeviceMut::new(&mut d.dq);
        let dq = if name.ends_with("short_dq") {
            // SAFETY: a shorter view of dq's own memory.
            unsafe { DeviceMut::from_raw(dq.addr(), dq.len() - 1) }
        } else {
            dq
        };
        let dg = if name.ends_with("dg_on_q") {
            // SAFETY: a deliberate alias of q, which the backward must refuse before any launch,
            // so nothing writes through it.
            unsafe { DeviceMut::<f32>::from_raw(q.addr(), d.dg.len()) }
        } else {
            DeviceMut::new(&mut d.dg)
        };
        let result = bwd.launch(
            stream,
            BackwardArgs {
                shape,
                q,
                k: DeviceRef::new(&d.k),
                v: DeviceRef::new(&d.v),
                g: DeviceRef::new(&d.g),
                h0: d.h0.as_ref().map(DeviceRef::new),
                d_o: DeviceRef::new(&d.d_o),
                d_ht: d.d_ht.as_ref().map(DeviceRef::new),
                dq,
                dk: DeviceMut::new(&mut d.dk),
                dv: DeviceMut::new(&mut d.dv),
                dg,
                dh0: None,
                scale: None,
            },
        );
        out.push((name.to_string(), verdict(stream, &d.dq, want, result)));
    }
    Ok(out)
}

/// Ends a backward test's process when it runs longer: a hung kernel fails instead of hanging.
const LIMIT: Duration = Duration::from_secs(600);

/// Runs `checks` with the backward operation of a fresh runtime on GPU 0, in a process of its
/// own.
fn with_backward(checks: impl FnOnce(&mut ScalarDecayBackward, &Arc<CudaStream>, &mut Report)) {
    on_one_gpu(LIMIT, |rt, report| match ScalarDecayBackward::new(rt) {
        Err(e) => report.record("op_init", Err(e.to_string()), 0.0),
        Ok(mut bwd) => {
            println!("backward: {}", rt.context().name().unwrap_or_default());
            checks(&mut bwd, rt.stream(), report);
        }
    });
}

/// Every case that `select` keeps, against the reference.
fn check_cases(select: impl Fn(&Case) -> bool) {
    with_backward(|bwd, stream, report| {
        for case in cases().into_iter().filter(|case| select(case)) {
            report.timed(&case.name(), || run_case(bwd, stream, &case));
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
    with_backward(|bwd, stream, report| match rejection_checks(bwd, stream) {
        Ok(checks) => checks
            .into_iter()
            .for_each(|(name, result)| report.record(&name, result, 0.0)),
        Err(e) => report.record("bwd_rejection_setup", Err(e), 0.0),
    });
}
