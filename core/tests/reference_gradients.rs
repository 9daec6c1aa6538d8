//! Analytic gradients against central finite differences of
//! `L = sum(o * d_o) + <S_T, d_ht>`, for every input (q, k, v, g, h0, and beta for the delta rule)
//! of every family, in every regime.
//!
//! Step and tolerance: the central difference `(L(x + h) - L(x - h)) / 2h` has truncation error
//! `h^2 |L'''| / 6` and rounding error `~ eps |L| / h`. With h = 1e-5 and f64 (eps = 2.2e-16) both
//! are ~1e-10 per element for O(1) derivatives, giving norm-wise relative errors ~1e-8 to 1e-9;
//! we require 1e-6. L is linear in each of q, k, v separately for the decay families, so their
//! differences are exact up to rounding; the gates (through `exp`) and the delta rule (nonlinear
//! in k and beta) carry the truncation term. A gate within h of 0 cannot be moved up (positive
//! gates are rejected), so there the one-sided second-order stencil
//! `(3 L(x) - 4 L(x - h) + L(x - 2h)) / 2h` is used, with the same error orders.
//!
//! Under strong decay (a = -30) the gate gradient is ~1e-12 while the rounding noise of the
//! difference is ~eps |L| / h ~ 1e-10, so each comparison also allows an absolute
//! `1e-9 (1 + |L|)` per element (norm-wise: times sqrt(n)): the noise floor, far below any real
//! gradient.

use lasp_shmem::reference::{
    delta_rule, gla, rel_err, scalar_decay, Cotangents, Family, Forward, Grads, InputSpec, Inputs,
    ReferenceError, Regime, Shape, Tensor,
};

const STEP: f64 = 1e-5;
const REL_TOL: f64 = 1e-6;
const ABS_TOL: f64 = 1e-9;
/// Chunk sizes that do not divide T, so partial chunks are differentiated too.
const CHUNK: usize = 4;
const SUB_CHUNK: usize = 3;
/// B * H = 4, T = 13: four chunks of 4 with a partial last one, small enough that the ~4,000
/// finite differences per family (five regimes) take about a second in a debug build.
const SHAPE: Shape = Shape {
    b: 2,
    t: 13,
    h: 2,
    dk: 4,
    dv: 3,
};

fn forward(family: Family, inputs: &Inputs) -> Result<Forward, ReferenceError> {
    match family {
        Family::ScalarDecay => scalar_decay::recurrent_forward(inputs),
        Family::Gla => gla::recurrent_forward(inputs),
        Family::DeltaRule => delta_rule::recurrent_forward(inputs),
    }
}

/// The analytic gradients under test: the chunkwise backward for the decay families (the
/// recurrent one is checked against it in reference_forward.rs), reverse mode for the delta rule.
fn analytic(family: Family, inputs: &Inputs, cot: &Cotangents) -> Grads {
    let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
    match family {
        Family::ScalarDecay => scalar_decay::backward(inputs, CHUNK, d_o, d_ht),
        Family::Gla => gla::backward(inputs, CHUNK, SUB_CHUNK, d_o, d_ht),
        Family::DeltaRule => delta_rule::recurrent_backward(inputs, d_o, d_ht),
    }
    .unwrap()
}

fn loss(family: Family, inputs: &Inputs, cot: &Cotangents) -> f64 {
    forward(family, inputs)
        .unwrap()
        .loss(&cot.d_o, cot.d_ht.as_ref())
}

/// Finite-difference gradient with respect to the tensor `pick` selects.
fn numeric(
    family: Family,
    inputs: &Inputs,
    cot: &Cotangents,
    pick: fn(&mut Inputs) -> &mut Tensor,
    is_gate: bool,
) -> Vec<f64> {
    let mut x = inputs.clone();
    let n = pick(&mut x).len();
    let mut eval = |i: usize, delta: f64| {
        let original = pick(&mut x).data()[i];
        pick(&mut x).data_mut()[i] = original + delta;
        let l = loss(family, &x, cot);
        pick(&mut x).data_mut()[i] = original;
        l
    };
    (0..n)
        .map(|i| {
            let value = pick(&mut inputs.clone()).data()[i];
            if is_gate && value + STEP > 0.0 {
                let (l0, l1, l2) = (eval(i, 0.0), eval(i, -STEP), eval(i, -2.0 * STEP));
                (3.0 * l0 - 4.0 * l1 + l2) / (2.0 * STEP)
            } else {
                (eval(i, STEP) - eval(i, -STEP)) / (2.0 * STEP)
            }
        })
        .collect()
}

fn check(what: &str, got: &Tensor, want: &[f64], l: f64) {
    let diff = got
        .data()
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt();
    let norm = want.iter().map(|b| b * b).sum::<f64>().sqrt();
    let allowed = REL_TOL * norm + ABS_TOL * (1.0 + l.abs()) * (want.len() as f64).sqrt();
    assert!(
        diff <= allowed,
        "{what}: ||analytic - numeric|| = {diff:.3e} > {allowed:.3e} (relative {:.3e})",
        rel_err(got.data(), want)
    );
}

/// The delta rule's chunkwise backward (through the WY form), chunk size 3 of T = 13: five chunks,
/// the last one token.
fn delta_rule_chunkwise(_: Family, inputs: &Inputs, cot: &Cotangents) -> Grads {
    delta_rule::chunkwise_backward(inputs, SUB_CHUNK, &cot.d_o, cot.d_ht.as_ref()).unwrap()
}

/// Every gradient `analytic` returns for `family` against finite differences, in every regime.
fn check_family(family: Family, analytic: fn(Family, &Inputs, &Cotangents) -> Grads) {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let spec = InputSpec {
            shape: SHAPE,
            family,
            regime,
            seed: 1000 + seed as u64,
            round_to_bf16: false,
            initial_state: true,
        };
        let inputs = Inputs::generate(&spec).unwrap();
        let cot = Cotangents::generate(SHAPE, 2000 + seed as u64, true, false).unwrap();
        let grads = analytic(family, &inputs, &cot);
        let l = loss(family, &inputs, &cot);
        let tag = format!("{family:?} {regime:?}");
        let fd = |pick, is_gate| numeric(family, &inputs, &cot, pick, is_gate);
        check(
            &format!("{tag}: dq"),
            &grads.dq,
            &fd(|x| &mut x.q, false),
            l,
        );
        check(
            &format!("{tag}: dk"),
            &grads.dk,
            &fd(|x| &mut x.k, false),
            l,
        );
        check(
            &format!("{tag}: dv"),
            &grads.dv,
            &fd(|x| &mut x.v, false),
            l,
        );
        check(&format!("{tag}: dg"), &grads.dg, &fd(|x| &mut x.g, true), l);
        check(
            &format!("{tag}: dh0"),
            &grads.dh0,
            &fd(|x| x.h0.as_mut().unwrap(), false),
            l,
        );
        match family {
            Family::DeltaRule => {
                let dbeta = grads.dbeta.as_ref().expect("the delta rule returns dbeta");
                check(
                    &format!("{tag}: dbeta"),
                    dbeta,
                    &fd(|x| x.beta.as_mut().unwrap(), false),
                    l,
                );
            }
            _ => assert!(grads.dbeta.is_none()),
        }
    }
}

#[test]
fn scalar_decay_gradients_match_finite_differences() {
    check_family(Family::ScalarDecay, analytic);
}

#[test]
fn gla_gradients_match_finite_differences() {
    check_family(Family::Gla, analytic);
}

#[test]
fn delta_rule_gradients_match_finite_differences() {
    check_family(Family::DeltaRule, analytic);
}

#[test]
fn delta_rule_chunkwise_gradients_match_finite_differences() {
    check_family(Family::DeltaRule, delta_rule_chunkwise);
}

/// Without a final-state gradient and initial state the loss is `sum(o * d_o)` alone; the
/// gradient with respect to the (zero) initial state is still returned, as LASP-2 needs it.
#[test]
fn gradients_without_optional_tensors() {
    let spec = InputSpec {
        shape: SHAPE,
        family: Family::ScalarDecay,
        regime: Regime::Typical,
        seed: 3,
        round_to_bf16: false,
        initial_state: false,
    };
    let inputs = Inputs::generate(&spec).unwrap();
    let cot = Cotangents::generate(SHAPE, 4, false, false).unwrap();
    let grads = analytic(Family::ScalarDecay, &inputs, &cot);
    let l = loss(Family::ScalarDecay, &inputs, &cot);
    check(
        "dg",
        &grads.dg,
        &numeric(Family::ScalarDecay, &inputs, &cot, |x| &mut x.g, true),
        l,
    );
    let mut with_zero_h0 = inputs.clone();
    with_zero_h0.h0 = Some(Tensor::zeros(&SHAPE.state()));
    let fd_h0 = numeric(
        Family::ScalarDecay,
        &with_zero_h0,
        &cot,
        |x| x.h0.as_mut().unwrap(),
        false,
    );
    check("dh0", &grads.dh0, &fd_h0, l);
}
