//! The Gated DeltaNet forward and backward (`ops::gated_delta`) against the CPU f64 reference, on
//! one GPU.
//!
//! Inputs come from `reference::Inputs::generate` for the delta-rule family (unit-norm q and k,
//! `beta = sigmoid(x)`), rounded to bf16 (q, k, v) and f32 (g, beta, h0, scale), so the GPU sees
//! exactly the values the reference computes with; some cases then set every beta to 0 (no
//! writes: the state only decays) or to 1 (each token overwrites its key's direction). The
//! automatic plan cuts these short batches into many segments (their affine summaries and fold);
//! some cases force one segment or another count. For every case: o and ht are poisoned before each run and must be fully overwritten;
//! `||x - ref|| / ||ref|| <= 5e-3` against the token-by-token recurrence for o and the final
//! state; a second run gives bitwise identical o and ht; g, beta and h0 are left unchanged.
//!
//! The backward gets the same inputs and a random d_o and dht (`reference::Cotangents`), and is
//! held to the chunkwise reference `reference::delta_rule::chunkwise_backward` (chunks of 64): dq,
//! dk, dv, dg, dbeta and dh0 are poisoned before each run and must be fully overwritten, with
//! `||x - ref|| / ||ref|| <= 5e-3` for dq, dk, dv and dh0. dg and dbeta are each a sum of products
//! (`dg_t = <dP_t, P_t>` over the state, `dbeta_t = <du_t, r_t>`) that can cancel far below the
//! products, so they are held to their scale: the larger of their own norm and the l2 norm of those
//! products (`delta_rule::gate_and_beta_product_norms`), the size of the error that rounding the
//! products' operands leaves, with `||x - ref|| <= 1e-2 x scale`: the kernels keep the chunk states,
//! u and du in bf16 (as fla's do; fla's tests hold dg and dbeta to 2e-2). dg's scale also has a
//! floor, fp32's resolution (`f32::EPSILON`) of its chunk terms' size (`Grads::gate_grad_scale`):
//! under steep gates (a = -30) dg is ~1e-13 where those terms, which the kernels sum in fp32, are
//! O(1). A second run gives bitwise identical gradients; g, beta and h0 are left unchanged.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::gated_delta::{
    GatedDeltaArgs, GatedDeltaBackward, GatedDeltaBackwardArgs, GatedDeltaForward, GatedDeltaPlan,
};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{
    assert_close_to_scale, delta_rule, Cotangents, Family, InputSpec, Inputs, Regime, Shape,
};
use lasp_shmem_examples::grad_bits::{GradBits, GradBuffers};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{
    bf16_values, bits_of_bf16, bits_of_f32, compare, err, f32_values, is_small, on_one_gpu,
    to_bf16, to_f32, unwritten, CheckResult, ForwardBuffers, Report, POISON_BF16, POISON_F32,
};

const TOL: f64 = 5e-3;
/// dg and dbeta against their scale (the module doc).
const GATE_TOL: f64 = 1e-2;

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
    // H a multiple of 4: the roles kernel's gates come by tensor copy (small: the sanitizers
    // see them), ragged and in segments.
    add(1, 4, 700, 128, 128, Typical, Sigmoid, true, None);
    add(1, 4, 1000, 64, 64, Mixed, Sigmoid, true, Some(3));
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

/// The delta rule's inputs of `shape` from the reference's generator, with the betas `betas`
/// asks for, and beta as the GPU gets it.
fn generate(
    shape: Shape,
    regime: Regime,
    betas: Betas,
    h0: bool,
    seed: u64,
) -> std::result::Result<(Inputs, Vec<f32>), String> {
    let spec = InputSpec {
        shape,
        family: Family::DeltaRule,
        regime,
        seed,
        round_to_bf16: true,
        initial_state: h0,
    };
    let mut inputs = Inputs::generate(&spec).map_err(err)?;
    let fill = match betas {
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
    Ok((inputs, beta_host))
}

/// Problems if beta's device bits no longer match what was uploaded.
fn beta_modified(
    stream: &Arc<CudaStream>,
    device: &CudaSlice<f32>,
    uploaded: &[f32],
) -> std::result::Result<Option<String>, String> {
    let bits: Vec<u32> = uploaded.iter().map(|x| x.to_bits()).collect();
    Ok((bits_of_f32(stream, device)? != bits).then(|| "beta was modified".to_string()))
}

fn run_case(fwd: &mut GatedDeltaForward, stream: &Arc<CudaStream>, case: &Case) -> CheckResult {
    let (inputs, beta_host) = generate(case.shape, case.regime, case.betas, case.h0, case.seed)?;
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
        // Where the plan has the output kernel with roles (u in the WY form, T_u V - W S_n), the
        // one-warpgroup kernel ((I + L)^{-1} R) too: their roundings differ, both are held to the
        // reference.
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
        if let Some((o1, _, _)) = &one_warpgroup {
            problems.extend(unwritten(o1, POISON_BF16, "one-warpgroup o", &s.v()).err());
        }
        let differ = o.iter().zip(&o2).filter(|(x, y)| x != y).count()
            + ht.iter().zip(&ht2).filter(|(x, y)| x != y).count();
        if differ > 0 {
            problems.push(format!(
                "not deterministic: {differ} elements differ between two runs"
            ));
        }
        problems.extend(dev.fwd.modified_inputs(stream, &inputs)?);
        problems.extend(beta_modified(stream, &dev.beta, &beta_host)?);
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
        if let Some((o1, ht1, _)) = &one_warpgroup {
            error_of("one-warpgroup o", &bf16_values(o1), &want.o);
            error_of("one-warpgroup ht", &f32_values(ht1), &want.final_state);
        }
        let summary = format!(
            "S={} cps={}{} rel err o {e_o:.2e} ht {e_ht:.2e}",
            plan.num_segments,
            plan.chunks_per_segment,
            if one_warpgroup.is_some() {
                " roles"
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
                    report.timed(&case.name(), || run_case(&mut fwd, rt.stream(), &case));
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

#[derive(Clone, Debug)]
struct BackwardCase {
    shape: Shape,
    regime: Regime,
    betas: Betas,
    h0: bool,
    dht: bool,
    /// Forced segments per sequence (else the plan's).
    segments: Option<u32>,
    seed: u64,
}

impl BackwardCase {
    fn name(&self) -> String {
        let s = &self.shape;
        format!(
            "gated_delta_bwd_B{}_H{}_T{}_Dk{}_Dv{}_{:?}_{:?}{}{}{}",
            s.b,
            s.h,
            s.t,
            s.dk,
            s.dv,
            self.regime,
            self.betas,
            if self.h0 { "_h0" } else { "" },
            if self.dht { "_dht" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}"))
        )
    }
}

/// The backward's cases: about 26K (token, head) pairs in all, so that the f64 reference takes
/// seconds, not minutes.
fn backward_cases() -> Vec<BackwardCase> {
    let mut out = Vec::new();
    let mut seed = 1300;
    let mut add = |b, h, t, dk, dv, regime, betas, h0, dht, segments| {
        seed += 1;
        out.push(BackwardCase {
            shape: Shape { b, t, h, dk, dv },
            regime,
            betas,
            h0,
            dht,
            segments,
            seed,
        });
    };
    use Betas::*;
    use Regime::*;
    // B*H = 1: ragged and whole chunks, every (Dk, Dv); the automatic plan has S > 1 from T = 65
    // on (one chunk per segment).
    for t in [1, 63, 64, 200, 1000] {
        for (dk, dv) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            add(1, 1, t, dk, dv, Typical, Sigmoid, true, true, None);
        }
    }
    // Gates at 0, at -30 and a mix within a chunk, with h0 and dht and without either.
    for regime in [NoDecay, StrongDecay, Mixed] {
        add(1, 1, 1000, 128, 128, regime, Sigmoid, true, true, None);
        add(1, 1, 200, 64, 64, regime, Sigmoid, false, false, None);
    }
    // One of h0 and dht.
    add(1, 1, 1000, 64, 128, Typical, Sigmoid, true, false, None);
    add(1, 1, 1000, 128, 64, Mixed, Sigmoid, false, true, None);
    // beta at 0 and at 1.
    for betas in [AllZero, AllOne] {
        add(1, 2, 200, 128, 128, Typical, betas, true, true, None);
        add(1, 2, 200, 64, 64, Mixed, betas, true, false, None);
    }
    // Forced segment counts: one (no summaries, no fold) and an uneven last segment (16 chunks in
    // 3), besides the automatic plan's 16 of the cases above.
    add(1, 1, 1000, 128, 128, Mixed, Sigmoid, true, true, Some(1));
    add(1, 1, 1000, 128, 128, Mixed, Sigmoid, true, true, Some(3));
    add(1, 2, 1000, 64, 128, Typical, Sigmoid, false, true, Some(3));
    // Several batches and heads (the [B, T, H, D] indexing), and B*H = 256.
    add(2, 3, 200, 128, 64, Typical, Sigmoid, true, true, None);
    add(4, 64, 40, 64, 64, Typical, Sigmoid, true, true, None);
    out
}

/// A backward case's tensors on the device: the forward's inputs (with beta), d_o and dht, the
/// gradients.
struct BackwardBuffers {
    inputs: ForwardBuffers,
    beta: CudaSlice<f32>,
    d_o: CudaSlice<bf16>,
    dht: Option<CudaSlice<f32>>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dbeta: CudaSlice<f32>,
    dh0: CudaSlice<f32>,
}

impl BackwardBuffers {
    fn upload(
        stream: &Arc<CudaStream>,
        inputs: &Inputs,
        beta: &[f32],
        cot: &Cotangents,
    ) -> std::result::Result<Self, String> {
        let s = ForwardShape::from(inputs.shape);
        let dev = BackwardBuffers {
            inputs: ForwardBuffers::upload(stream, inputs)?,
            beta: stream.clone_htod(beta).map_err(err)?,
            d_o: stream.clone_htod(&to_bf16(&cot.d_o)).map_err(err)?,
            dht: match &cot.d_ht {
                Some(d) => Some(stream.clone_htod(&to_f32(d)).map_err(err)?),
                None => None,
            },
            dq: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dk: stream.alloc_zeros(s.qk_len()).map_err(err)?,
            dv: stream.alloc_zeros(s.v_len()).map_err(err)?,
            dg: stream.alloc_zeros(s.gate_len()).map_err(err)?,
            dbeta: stream.alloc_zeros(s.gate_len()).map_err(err)?,
            dh0: stream.alloc_zeros(s.state_len()).map_err(err)?,
        };
        stream.synchronize().map_err(err)?;
        Ok(dev)
    }

    fn args(&mut self, shape: ForwardShape, scale: f32) -> GatedDeltaBackwardArgs<'_> {
        let i = &self.inputs;
        GatedDeltaBackwardArgs {
            shape,
            q: DeviceRef::new(&i.q),
            k: DeviceRef::new(&i.k),
            v: DeviceRef::new(&i.v),
            g: DeviceRef::new(&i.g),
            beta: DeviceRef::new(&self.beta),
            h0: i.h0.as_ref().map(DeviceRef::new),
            d_o: DeviceRef::new(&self.d_o),
            dht: self.dht.as_ref().map(DeviceRef::new),
            dq: DeviceMut::new(&mut self.dq),
            dk: DeviceMut::new(&mut self.dk),
            dv: DeviceMut::new(&mut self.dv),
            dg: DeviceMut::new(&mut self.dg),
            dbeta: DeviceMut::new(&mut self.dbeta),
            dh0: Some(DeviceMut::new(&mut self.dh0)),
            scale: Some(scale),
        }
    }

    /// Every gradient filled with the poison bit patterns.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> std::result::Result<(), String> {
        for buf in [&mut self.dq, &mut self.dk, &mut self.dv] {
            let poison = vec![bf16::from_bits(POISON_BF16); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        for buf in [&mut self.dg, &mut self.dbeta, &mut self.dh0] {
            let poison = vec![f32::from_bits(POISON_F32); buf.len()];
            stream.memcpy_htod(&poison, buf).map_err(err)?;
        }
        stream.synchronize().map_err(err)
    }

    /// One run on poisoned gradients: their bits.
    fn run(
        &mut self,
        bwd: &mut GatedDeltaBackward,
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
            dbeta: Some(&self.dbeta),
            dh0: Some(&self.dh0),
        };
        GradBits::read(stream, grads).map_err(err)
    }
}

fn run_backward_case(
    bwd: &mut GatedDeltaBackward,
    stream: &Arc<CudaStream>,
    case: &BackwardCase,
) -> CheckResult {
    let (inputs, beta_host) = generate(case.shape, case.regime, case.betas, case.h0, case.seed)?;
    let cot = Cotangents::generate(case.shape, case.seed, case.dht, true).map_err(err)?;
    let scale = inputs.scale as f32;
    let shape = ForwardShape::from(case.shape);
    bwd.set_num_segments(case.segments).map_err(err)?;
    let plan = bwd.plan(&shape).map_err(err)?;
    std::thread::scope(|scope| {
        let reference = scope.spawn(|| {
            let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
            let grads = delta_rule::chunkwise_backward(&inputs, 64, d_o, d_ht)?;
            let product_norms = delta_rule::gate_and_beta_product_norms(&inputs, d_o, d_ht)?;
            Ok::<_, lasp_shmem::reference::ReferenceError>((grads, product_norms))
        });
        let mut dev = BackwardBuffers::upload(stream, &inputs, &beta_host, &cot)?;
        let first = dev.run(bwd, stream, shape, scale)?;
        let second = dev.run(bwd, stream, shape, scale)?;
        let s = &case.shape;
        let mut problems: Vec<String> = [
            unwritten(&first.dq, POISON_BF16, "dq", &s.qk()),
            unwritten(&first.dk, POISON_BF16, "dk", &s.qk()),
            unwritten(&first.dv, POISON_BF16, "dv", &s.v()),
            unwritten(&first.dg, POISON_F32, "dg", &s.per_token()),
            unwritten(&first.dbeta, POISON_F32, "dbeta", &s.per_token()),
            unwritten(&first.dh0, POISON_F32, "dh0", &s.state()),
        ]
        .into_iter()
        .filter_map(|r| r.err())
        .collect();
        if first != second {
            problems.push("not deterministic: two runs gave different bits".into());
        }
        problems.extend(dev.inputs.modified_inputs(stream, &inputs)?);
        problems.extend(beta_modified(stream, &dev.beta, &beta_host)?);
        let (want, (dg_products, dbeta_products)) = reference
            .join()
            .map_err(|_| "the reference panicked".to_string())?
            .map_err(err)?;
        let want_dbeta = want
            .dbeta
            .as_ref()
            .ok_or("the delta rule's reference returns no dbeta")?;
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
        let dg_floor = f64::from(f32::EPSILON) * want.gate_grad_scale(&inputs);
        for (what, got, want, products, floor) in [
            (
                "dg",
                f32_values(&first.dg),
                want.dg.data(),
                dg_products,
                dg_floor,
            ),
            (
                "dbeta",
                f32_values(&first.dbeta),
                want_dbeta.data(),
                dbeta_products,
                0.0,
            ),
        ] {
            let scale = norm(want).max(products).max(floor);
            match assert_close_to_scale(what, &got, want, scale, GATE_TOL) {
                Ok(()) => errors.push(format!(
                    "{what} {:.2e} of its scale ({:.2e} of its norm)",
                    diff_norm(&got, want) / scale,
                    diff_norm(&got, want) / norm(want)
                )),
                Err(e) => problems.push(e),
            }
        }
        let summary = format!(
            "S={} cps={} rel err {}",
            plan.forward.num_segments,
            plan.forward.chunks_per_segment,
            errors.join(", ")
        );
        if problems.is_empty() {
            Ok(summary)
        } else {
            Err(format!("{summary}: {}", problems.join("; ")))
        }
    })
}

/// `||x||`.
fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// `||got - want||`.
fn diff_norm(got: &[f64], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn gated_delta_backward_matches_the_f64_reference() {
    on_one_gpu(
        LIMIT,
        |rt, report: &mut Report| match GatedDeltaBackward::new(rt) {
            Err(e) => report.record("gated_delta_bwd_init", Err(e.to_string()), 0.0),
            Ok(mut bwd) => {
                for case in backward_cases() {
                    report.timed(&case.name(), || {
                        run_backward_case(&mut bwd, rt.stream(), &case)
                    });
                }
            }
        },
    );
}
