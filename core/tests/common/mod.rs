//! What the tests of one f64 evaluation against another share (reference_forward.rs,
//! reference_lasp2.rs): the problem, the tolerance and the comparisons.

use lasp_shmem::reference::{
    assert_rel_close, delta_rule, gla, lasp2, scalar_decay, Family, Forward, Grads, InputSpec,
    Inputs, Regime, Shape, Tensor,
};

/// Relative tolerance between two f64 evaluations of the same sums in different orders (each
/// test file's header says why 1e-12).
pub const TOL: f64 = 1e-12;
pub const SHAPE: Shape = Shape {
    b: 2,
    t: 37,
    h: 2,
    dk: 5,
    dv: 4,
};

/// Inputs of the given family and regime, with an initial state.
pub fn generate(family: Family, regime: Regime, seed: u64) -> Inputs {
    let spec = InputSpec {
        shape: SHAPE,
        family,
        regime,
        seed,
        round_to_bf16: false,
        initial_state: true,
    };
    Inputs::generate(&spec).unwrap()
}

pub fn check(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    assert_rel_close(what, got.data(), want.data(), TOL).unwrap();
}

pub fn check_forward(tag: &str, o: &Tensor, final_state: &Tensor, want: &Forward) {
    check(&format!("{tag}: o"), o, &want.o);
    check(&format!("{tag}: S_T"), final_state, &want.final_state);
}

/// Every gradient, each relative to its own norm: the gate gradients of the references are sums
/// of straddling pairs (`reference::recurrent`), with nothing to cancel, so f64's accuracy holds
/// for them too, even under strong decay. (Each test binary compiles this module; reference_lasp2.rs
/// uses this one.)
#[allow(dead_code)]
pub fn check_grads(tag: &str, got: &Grads, want: &Grads) {
    check_grads_but_dg(tag, got, want);
    check(&format!("{tag}: dg"), &got.dg, &want.dg);
}

/// [`check_grads`] without dg, for two evaluations whose dg comes from the same computation.
pub fn check_grads_but_dg(tag: &str, got: &Grads, want: &Grads) {
    check(&format!("{tag}: dq"), &got.dq, &want.dq);
    check(&format!("{tag}: dk"), &got.dk, &want.dk);
    check(&format!("{tag}: dv"), &got.dv, &want.dv);
    check(&format!("{tag}: dh0"), &got.dh0, &want.dh0);
    match (&got.dbeta, &want.dbeta) {
        (Some(got), Some(want)) => check(&format!("{tag}: dbeta"), got, want),
        (None, None) => {}
        _ => panic!("{tag}: dbeta present on one side only"),
    }
}

/// The recurrent state after the prefix `[0, len)` of the sequence (from h0): what enters the
/// chunk or rank that starts at token `len`.
pub fn prefix_state(family: Family, inputs: &Inputs, len: usize) -> Tensor {
    let mut head =
        lasp2::split_shards(inputs, family, &[len, inputs.shape.t - len]).unwrap()[0].clone();
    head.h0 = inputs.h0.clone();
    match family {
        Family::ScalarDecay => scalar_decay::recurrent_forward(&head),
        Family::Gla => gla::recurrent_forward(&head),
        Family::DeltaRule => delta_rule::recurrent_forward(&head),
    }
    .unwrap()
    .final_state
}
