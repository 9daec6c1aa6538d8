//! The delta rule's chunkwise backward (through each chunk's WY form) against its token-by-token
//! reverse mode: two independent derivations of `dq, dk, dv, dg, dbeta, dh0`.
//!
//! Tolerance: both are f64 evaluations of the same derivative through different sums (the
//! chunkwise one through the triangular solves of up to 64 rows), each term with relative
//! rounding ~1e-16; norm-wise differences are ~1e-14, and 1e-10 catches any formula slip (a wrong
//! decay exponent or a dropped term gives >= 1e-3). dg is compared like the rest: both sides add
//! each decay term to the gates it straddles, with nothing cancelling, so even under strong decay
//! it keeps f64's relative accuracy.

use lasp_shmem::reference::{
    assert_rel_close, delta_rule, Cotangents, Family, Grads, InputSpec, Inputs, Regime, Shape,
    Tensor,
};

const TOL: f64 = 1e-10;
/// Chunk sizes: one token, one that divides nothing here, and two of fla's (64 > T: one ragged
/// chunk).
const CHUNKS: [usize; 4] = [1, 3, 16, 64];
/// T = 37 is a multiple of none of the chunk sizes above 1.
const SHAPE: Shape = Shape {
    b: 2,
    t: 37,
    h: 2,
    dk: 5,
    dv: 4,
};
/// A log-decay far past the generator's strong one (-30): products of a few such decays reach
/// 1e-260, short of the subnormal range, so both sides stay exact to f64's relative accuracy.
const VERY_NEGATIVE_GATE: f64 = -200.0;

/// A named fill: the value to put at each flat index of a tensor.
type Pattern = (&'static str, fn(usize) -> f64);

fn generate(regime: Regime, seed: u64, initial_state: bool) -> Inputs {
    let spec = InputSpec {
        shape: SHAPE,
        family: Family::DeltaRule,
        regime,
        seed,
        round_to_bf16: false,
        initial_state,
    };
    Inputs::generate(&spec).unwrap()
}

fn check(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    assert_rel_close(what, got.data(), want.data(), TOL).unwrap();
}

/// Every chunk size against the recurrent backward, every gradient to its own norm.
fn check_chunkwise_against_recurrent(tag: &str, inputs: &Inputs, cot: &Cotangents) {
    let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
    let want = delta_rule::recurrent_backward(inputs, d_o, d_ht).unwrap();
    for chunk in CHUNKS {
        let got: Grads = delta_rule::chunkwise_backward(inputs, chunk, d_o, d_ht).unwrap();
        let tag = format!("{tag} chunk {chunk}");
        check(&format!("{tag}: dq"), &got.dq, &want.dq);
        check(&format!("{tag}: dk"), &got.dk, &want.dk);
        check(&format!("{tag}: dv"), &got.dv, &want.dv);
        check(&format!("{tag}: dg"), &got.dg, &want.dg);
        check(&format!("{tag}: dh0"), &got.dh0, &want.dh0);
        let dbeta = |g: &Grads| g.dbeta.clone().expect("the delta rule returns dbeta");
        check(&format!("{tag}: dbeta"), &dbeta(&got), &dbeta(&want));
    }
}

/// Every regime (gates typical, 0, -30, mixed, large norms), with and without h0 and d_ht.
#[test]
fn chunkwise_backward_matches_recurrent_in_every_regime() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let seed = seed as u64;
        for (initial_state, final_state_grad) in [(true, true), (true, false), (false, true)] {
            let inputs = generate(regime, 300 + seed, initial_state);
            let cot = Cotangents::generate(SHAPE, 400 + seed, final_state_grad, false).unwrap();
            let tag = format!("{regime:?} h0 {initial_state} d_ht {final_state_grad}");
            check_chunkwise_against_recurrent(&tag, &inputs, &cot);
        }
        let inputs = generate(regime, 500 + seed, false);
        let cot = Cotangents::generate(SHAPE, 600 + seed, false, false).unwrap();
        check_chunkwise_against_recurrent(&format!("{regime:?} neither"), &inputs, &cot);
    }
}

/// beta at its ends: 0 (no write: the state only decays, u = 0), 1 (a full overwrite along k) and
/// the two alternating, under typical and no decay.
#[test]
fn chunkwise_backward_matches_recurrent_at_extreme_beta() {
    let patterns: [Pattern; 3] = [
        ("beta 0", |_| 0.0),
        ("beta 1", |_| 1.0),
        ("beta 0/1", |i| (i % 2) as f64),
    ];
    for (seed, regime) in [Regime::Typical, Regime::NoDecay].into_iter().enumerate() {
        for (name, beta_at) in patterns {
            let mut inputs = generate(regime, 700 + seed as u64, true);
            let beta = inputs.beta.as_mut().unwrap().data_mut();
            beta.iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = beta_at(i));
            let cot = Cotangents::generate(SHAPE, 800 + seed as u64, true, false).unwrap();
            check_chunkwise_against_recurrent(&format!("{regime:?} {name}"), &inputs, &cot);
        }
    }
}

/// Gates of exactly 0 next to very negative ones, so some chunks hold decays of 1 and of e^-200
/// side by side, and some tokens' dg is ~e^-200 of its neighbours'.
#[test]
fn chunkwise_backward_matches_recurrent_at_extreme_gates() {
    let patterns: [Pattern; 2] = [
        ("all very negative", |_| VERY_NEGATIVE_GATE),
        ("0 and very negative", |i| {
            if i % 3 == 1 {
                VERY_NEGATIVE_GATE
            } else {
                0.0
            }
        }),
    ];
    for (seed, (name, gate_at)) in patterns.into_iter().enumerate() {
        let mut inputs = generate(Regime::Typical, 900 + seed as u64, true);
        let gates = inputs.g.data_mut();
        gates
            .iter_mut()
            .enumerate()
            .for_each(|(i, a)| *a = gate_at(i));
        let cot = Cotangents::generate(SHAPE, 1000 + seed as u64, true, false).unwrap();
        check_chunkwise_against_recurrent(name, &inputs, &cot);
    }
}

/// The product norms bound the sums they measure (Cauchy-Schwarz per token: `|dg_t| <= sqrt(n)
/// ||products_t||`), and with one key and one value column each sum is a single product, whose
/// norm is its absolute value.
#[test]
fn product_norms_measure_the_terms_of_dg_and_dbeta() {
    let inputs = generate(Regime::Typical, 11, true);
    let cot = Cotangents::generate(SHAPE, 11, true, false).unwrap();
    let want = delta_rule::recurrent_backward(&inputs, &cot.d_o, cot.d_ht.as_ref()).unwrap();
    let (dg_norm, dbeta_norm) =
        delta_rule::gate_and_beta_product_norms(&inputs, &cot.d_o, cot.d_ht.as_ref()).unwrap();
    let l2 = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
    let dbeta = want.dbeta.as_ref().unwrap();
    assert!(l2(want.dg.data()) <= ((SHAPE.dk * SHAPE.dv) as f64).sqrt() * dg_norm);
    assert!(l2(dbeta.data()) <= (SHAPE.dv as f64).sqrt() * dbeta_norm);
    assert!(dg_norm > 0.0 && dbeta_norm > 0.0);

    let one = Shape {
        dk: 1,
        dv: 1,
        ..SHAPE
    };
    let spec = InputSpec {
        shape: one,
        family: Family::DeltaRule,
        regime: Regime::Typical,
        seed: 12,
        round_to_bf16: false,
        initial_state: true,
    };
    let inputs = Inputs::generate(&spec).unwrap();
    let cot = Cotangents::generate(one, 12, true, false).unwrap();
    let want = delta_rule::recurrent_backward(&inputs, &cot.d_o, cot.d_ht.as_ref()).unwrap();
    let (dg_norm, dbeta_norm) =
        delta_rule::gate_and_beta_product_norms(&inputs, &cot.d_o, cot.d_ht.as_ref()).unwrap();
    let rel = |a: f64, b: f64| (a - b).abs() / b;
    assert!(rel(l2(want.dg.data()), dg_norm) < 1e-12);
    assert!(rel(l2(want.dbeta.as_ref().unwrap().data()), dbeta_norm) < 1e-12);
}
