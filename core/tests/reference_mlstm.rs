//! The mLSTM reference ("mLSTMexp"): every stabilised evaluation against the recurrent definition,
//! and the definition against the unstabilised form.
//!
//! Tolerances: two f64 evaluations of the same sums in different orders agree to ~1e-14
//! relative; the stabilisers `m_t` agree to a few ulps of `|m_t|` (up to ~1e3 here), which moves
//! the rescaled states by ~1e-13 relative. 1e-10 leaves margin without hiding a wrong term (any
//! real error is O(1)).

use lasp_shmem::reference::mlstm::{
    chunkwise_forward, recurrent_forward, unstabilised_forward, MlstmForward, MlstmInputs,
    MlstmRegime, MlstmSpec,
};
use lasp_shmem::reference::{assert_rel_close, Shape, Tensor};

const TOL: f64 = 1e-10;
const SHAPE: Shape = Shape {
    b: 2,
    t: 37,
    h: 2,
    dk: 5,
    dv: 4,
};

fn generate(regime: MlstmRegime, seed: u64, initial_state: bool) -> MlstmInputs {
    let spec = MlstmSpec {
        shape: SHAPE,
        regime,
        seed,
        initial_state,
    };
    MlstmInputs::generate(&spec).unwrap()
}

fn check(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    assert_rel_close(what, got.data(), want.data(), TOL).unwrap();
}

fn check_forward(tag: &str, got: &MlstmForward, want: &MlstmForward) {
    check(&format!("{tag}: h"), &got.h, &want.h);
    check(
        &format!("{tag}: C_T"),
        &got.final_state.c,
        &want.final_state.c,
    );
    check(
        &format!("{tag}: n_T"),
        &got.final_state.n,
        &want.final_state.n,
    );
    check(
        &format!("{tag}: m_T"),
        &got.final_state.m,
        &want.final_state.m,
    );
}

#[test]
fn stabilised_equals_unstabilised_on_moderate_gates() {
    for initial_state in [false, true] {
        for seed in 0..3 {
            let mut inputs = generate(MlstmRegime::Typical, seed, initial_state);
            inputs.eps = 0.0;
            let stabilised = recurrent_forward(&inputs).unwrap();
            let plain = unstabilised_forward(&inputs).unwrap();
            let tag = format!("seed {seed}, initial state {initial_state}");
            check(&format!("{tag}: h"), &stabilised.h, &plain.h);
            let lifted = stabilised.final_state.unstabilised();
            check(&format!("{tag}: e^m C"), &lifted.c, &plain.final_state.c);
            check(&format!("{tag}: e^m n"), &lifted.n, &plain.final_state.n);
        }
    }
}

#[test]
fn stabiliser_is_the_largest_log_weight() {
    // m_T = max(m_0 + sum_s lf_s, max_j (i_j + sum_{s > j} lf_s)), per head.
    let inputs = generate(MlstmRegime::LargeInputGate, 4, true);
    let got = recurrent_forward(&inputs).unwrap().final_state.m;
    let (i, lf) = (&inputs.input_gate, inputs.log_forget_gate());
    let m0 = &inputs.initial_state.as_ref().unwrap().m;
    for b in 0..SHAPE.b {
        for h in 0..SHAPE.h {
            let decay_after = |j: usize| (j..SHAPE.t).map(|s| lf.get(&[b, s, h])).sum::<f64>();
            let want = (0..SHAPE.t)
                .map(|j| i.get(&[b, j, h]) + decay_after(j + 1))
                .fold(m0.get(&[b, h]) + decay_after(0), f64::max);
            let err = (got.get(&[b, h]) - want).abs();
            assert!(err <= 1e-12 * want.abs().max(1.0), "({b}, {h}): {err:.3e}");
        }
    }
}

#[test]
fn large_input_gates_overflow_only_the_unstabilised_form() {
    let mut inputs = generate(MlstmRegime::LargeInputGate, 5, false);
    inputs.eps = 0.0;
    let stabilised = recurrent_forward(&inputs).unwrap();
    assert!(stabilised.h.first_non_finite().is_none());
    assert!(stabilised.final_state.c.first_non_finite().is_none());
    let plain = unstabilised_forward(&inputs).unwrap();
    assert!(plain.h.first_non_finite().is_some());
}

/// How many (token, head) pairs have `|sigma q_t . n~_t| < 1`, i.e. take the denominator's floor
/// `e^{-m_t}` in the stabilised form (no initial state: `n~_0 = 0`).
fn floored_tokens(inputs: &MlstmInputs) -> usize {
    let lf = inputs.log_forget_gate();
    let mut count = 0;
    for b in 0..SHAPE.b {
        for h in 0..SHAPE.h {
            let mut n = [0.0; SHAPE.dk];
            for t in 0..SHAPE.t {
                let (forget, input) = (
                    lf.get(&[b, t, h]).exp(),
                    inputs.input_gate.get(&[b, t, h]).exp(),
                );
                let mut qn = 0.0;
                for (d, x) in n.iter_mut().enumerate() {
                    *x = forget * *x + input * inputs.k.get(&[b, t, h, d]);
                    qn += inputs.scale * inputs.q.get(&[b, t, h, d]) * *x;
                }
                count += usize::from(qn.abs() < 1.0);
            }
        }
    }
    count
}

#[test]
fn stabilised_equals_unstabilised_where_the_denominator_floor_is_active() {
    let mut inputs = generate(MlstmRegime::ForgetNearZero, 6, false);
    inputs.eps = 0.0;
    let floored = floored_tokens(&inputs);
    let all = SHAPE.b * SHAPE.h * SHAPE.t;
    assert!(0 < floored && floored < all, "{floored} of {all} floored");
    let stabilised = recurrent_forward(&inputs).unwrap();
    let plain = unstabilised_forward(&inputs).unwrap();
    check("h", &stabilised.h, &plain.h);
}

#[test]
fn chunkwise_equals_recurrent() {
    for regime in MlstmRegime::ALL {
        for initial_state in [false, true] {
            let inputs = generate(regime, 11, initial_state);
            let want = recurrent_forward(&inputs).unwrap();
            for chunk in [1, 4, 16, 37, 64] {
                let got = chunkwise_forward(&inputs, chunk).unwrap();
                check_forward(
                    &format!("{regime:?}, initial state {initial_state}, chunk {chunk}"),
                    &got,
                    &want,
                );
            }
        }
    }
}

#[test]
fn validation_rejects_bad_inputs() {
    let mut inputs = generate(MlstmRegime::Typical, 7, true);
    inputs.eps = -1.0;
    assert!(recurrent_forward(&inputs).is_err());
    let mut inputs = generate(MlstmRegime::Typical, 7, true);
    inputs.forget_gate = Tensor::zeros(&[1, 2, 3]);
    assert!(recurrent_forward(&inputs).is_err());
    let mut inputs = generate(MlstmRegime::Typical, 7, true);
    inputs.input_gate.data_mut()[3] = f64::NAN;
    assert!(recurrent_forward(&inputs).is_err());
    let inputs = generate(MlstmRegime::Typical, 7, true);
    assert!(chunkwise_forward(&inputs, 0).is_err());
}
