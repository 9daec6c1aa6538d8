//! The mLSTM reference ("mLSTMexp"): every stabilised evaluation against the recurrent definition,
//! and the definition against the unstabilised form; the chunkwise and LASP-2 backwards against
//! the recurrent backward, and that against finite differences; mlstm_kernels' (TFLA's) gradient
//! against a transcription of its formulas and against the full derivative.
//!
//! Tolerances: two f64 evaluations of the same sums in different orders agree to ~1e-14
//! relative; the stabilisers `m_t` agree to a few ulps of `|m_t|` (up to ~1e3 here), which moves
//! the rescaled states by ~1e-13 relative. 1e-10 leaves margin without hiding a wrong term (any
//! real error is O(1)). Gradients: see [`GRAD_TOL`].

use lasp_shmem::reference::mlstm::{
    chunkwise_backward, chunkwise_forward, fold, fold_backward, lasp2_backward,
    lasp2_backward_tfla, lasp2_forward, loop_form_forward, normaliser_conditioning,
    recurrent_backward, recurrent_forward, unstabilised_forward, MlstmCotangents, MlstmForward,
    MlstmGradient::{Full, Tfla},
    MlstmGrads, MlstmInputs, MlstmRegime, MlstmSpec, MlstmState, ShardSummary,
};
use lasp_shmem::reference::{
    assert_close_to_scale, assert_rel_close, rel_err, Shape, SplitMix64, Tensor,
};

const TOL: f64 = 1e-10;
const SHAPE: Shape = Shape {
    b: 2,
    t: 37,
    h: 2,
    dk: 5,
    dv: 4,
};

fn generate(regime: MlstmRegime, seed: u64, initial_state: bool) -> MlstmInputs {
    generate_shape(SHAPE, regime, seed, initial_state)
}

fn generate_shape(
    shape: Shape,
    regime: MlstmRegime,
    seed: u64,
    initial_state: bool,
) -> MlstmInputs {
    let spec = MlstmSpec {
        shape,
        regime,
        seed,
        round_to_bf16: false,
        initial_state,
    };
    MlstmInputs::generate(&spec).unwrap()
}

fn normal(rng: &mut SplitMix64, shape: &[usize]) -> Tensor {
    let data = (0..shape.iter().product()).map(|_| rng.normal()).collect();
    Tensor::from_vec(shape, data).unwrap()
}

/// `d_h ~ N(0, 1)` and, when `final_state`, a final-state cotangent ~ N(0, 1) (`dm_T` included).
fn cotangents(s: Shape, seed: u64, final_state: bool) -> MlstmCotangents {
    let mut rng = SplitMix64::new(seed);
    MlstmCotangents {
        d_h: normal(&mut rng, &s.v()),
        d_final_state: final_state.then(|| MlstmState {
            c: normal(&mut rng, &s.state()),
            n: normal(&mut rng, &[s.b, s.h, s.dk]),
            m: normal(&mut rng, &[s.b, s.h]),
        }),
    }
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

/// The kernels' arithmetic (the scalar-decay loop with mLSTM's gate transform) is the chunkwise
/// form, in every regime, from the zero and a given initial state.
#[test]
fn the_loop_form_equals_the_chunkwise_form() {
    for regime in MlstmRegime::ALL {
        for initial_state in [false, true] {
            let inputs = generate(regime, 13, initial_state);
            for chunk in [1, 16, 64] {
                let want = chunkwise_forward(&inputs, chunk).unwrap();
                let got = loop_form_forward(&inputs, chunk).unwrap();
                check_forward(
                    &format!("{regime:?}, initial state {initial_state}, chunk {chunk}"),
                    &got,
                    &want,
                );
            }
        }
    }
    assert!(loop_form_forward(&generate(MlstmRegime::ALL[0], 1, false), 0).is_err());
}

/// The first `len` tokens of `inputs` as a problem of their own, with the same initial state.
fn prefix_tokens(inputs: &MlstmInputs, len: usize) -> MlstmInputs {
    MlstmInputs {
        shape: Shape {
            t: len,
            ..inputs.shape
        },
        q: inputs.q.slice_time(0, len),
        k: inputs.k.slice_time(0, len),
        v: inputs.v.slice_time(0, len),
        input_gate: inputs.input_gate.slice_time(0, len),
        forget_gate: inputs.forget_gate.slice_time(0, len),
        ..inputs.clone()
    }
}

/// Ragged shard layouts of T = 37, from one rank to one token per rank at the ends.
const LAYOUTS: [&[usize]; 4] = [&[37], &[7, 20, 10], &[1, 35, 1], &[5, 5, 5, 5, 5, 5, 7]];

#[test]
fn lasp2_equals_one_sequence() {
    for regime in MlstmRegime::ALL {
        for initial_state in [false, true] {
            let inputs = generate(regime, 13, initial_state);
            let want = recurrent_forward(&inputs).unwrap();
            for shards in LAYOUTS {
                for chunk in [1, 4, 16] {
                    let tag =
                        format!("{regime:?}, initial {initial_state}, {shards:?}, chunk {chunk}");
                    let got = lasp2_forward(&inputs, shards, chunk).unwrap();
                    check(&format!("{tag}: h"), &got.h, &want.h);
                    let last = &got.final_state;
                    check(&format!("{tag}: C_T"), &last.c, &want.final_state.c);
                    check(&format!("{tag}: n_T"), &last.n, &want.final_state.n);
                    check(&format!("{tag}: m_T"), &last.m, &want.final_state.m);
                }
            }
        }
    }
}

#[test]
fn lasp2_prefixes_are_the_states_at_shard_starts() {
    for regime in MlstmRegime::ALL {
        let inputs = generate(regime, 17, true);
        let shards = [7, 20, 10];
        let got = lasp2_forward(&inputs, &shards, 4).unwrap();
        assert_eq!(got.prefixes.len(), shards.len());
        assert_eq!(got.prefixes[0], *inputs.initial_state.as_ref().unwrap());
        let mut start = 0;
        for (w, len) in shards.iter().enumerate().take(shards.len() - 1) {
            start += len;
            let want = recurrent_forward(&prefix_tokens(&inputs, start))
                .unwrap()
                .final_state;
            let tag = format!("{regime:?}, P_{}", w + 1);
            check(&format!("{tag}: C"), &got.prefixes[w + 1].c, &want.c);
            check(&format!("{tag}: n"), &got.prefixes[w + 1].n, &want.n);
            check(&format!("{tag}: m"), &got.prefixes[w + 1].m, &want.m);
        }
    }
}

#[test]
fn fold_reproduces_the_prefixes_in_rank_order() {
    let inputs = generate(MlstmRegime::LargeInputGate, 19, true);
    let got = lasp2_forward(&inputs, &[5, 5, 5, 5, 5, 5, 7], 3).unwrap();
    let mut prefix = inputs.initial_state.clone().unwrap();
    for (w, summary) in got.summaries.iter().enumerate() {
        prefix = fold(SHAPE, &prefix, summary).unwrap();
        let want = got.prefixes.get(w + 1).unwrap_or(&got.final_state);
        assert_eq!(&prefix, want, "P_{}", w + 1);
    }
}

#[test]
fn shard_summary_is_stabilised_by_its_largest_log_weight() {
    // m_w = max_j (i_j + sum_{s > j in shard} lf_s), F_w = sum_{s in shard} lf_s.
    let inputs = generate(MlstmRegime::LargeInputGate, 23, false);
    let shards = [7, 20, 10];
    let got = lasp2_forward(&inputs, &shards, 4).unwrap();
    let (i, lf) = (&inputs.input_gate, inputs.log_forget_gate());
    let mut start = 0;
    for (summary, len) in got.summaries.iter().zip(shards) {
        for b in 0..SHAPE.b {
            for h in 0..SHAPE.h {
                let decay_after =
                    |j: usize| (j..start + len).map(|s| lf.get(&[b, s, h])).sum::<f64>();
                let m = (start..start + len)
                    .map(|j| i.get(&[b, j, h]) + decay_after(j + 1))
                    .fold(f64::NEG_INFINITY, f64::max);
                let close = |x: f64, y: f64| (x - y).abs() <= 1e-12 * y.abs().max(1.0);
                assert!(close(summary.state.m.get(&[b, h]), m));
                assert!(close(
                    summary.log_forget_total.get(&[b, h]),
                    decay_after(start)
                ));
            }
        }
        start += len;
    }
}

#[test]
fn bf16_rounding_makes_device_copies_exact() {
    let spec = MlstmSpec {
        shape: SHAPE,
        regime: MlstmRegime::LargeInputGate,
        seed: 3,
        round_to_bf16: true,
        initial_state: true,
    };
    let x = MlstmInputs::generate(&spec).unwrap();
    let is_bf16 = |t: &Tensor| {
        t.data()
            .iter()
            .all(|&v| half::bf16::from_f64(v).to_f64() == v)
    };
    let is_f32 = |t: &Tensor| t.data().iter().all(|&v| f64::from(v as f32) == v);
    assert!([&x.q, &x.k, &x.v].into_iter().all(is_bf16));
    let state = x.initial_state.as_ref().unwrap();
    assert!(
        [&x.input_gate, &x.forget_gate, &state.c, &state.n, &state.m]
            .into_iter()
            .all(is_f32)
    );
    assert_eq!(f64::from(x.scale as f32), x.scale);
    assert_eq!(f64::from(x.eps as f32), x.eps);
    // The same draws, rounded: bf16 moves q by at most its relative precision 2^-8.
    let unrounded = generate(MlstmRegime::LargeInputGate, 3, true);
    assert!(rel_err(x.q.data(), unrounded.q.data()) < 1.0 / 256.0);
    assert!(rel_err(x.input_gate.data(), unrounded.input_gate.data()) < 1e-7);
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
    assert!(lasp2_forward(&inputs, &[10, 10], 4).is_err());
    assert!(lasp2_forward(&inputs, &[37, 0], 4).is_err());
    let cot = cotangents(SHAPE, 1, true);
    assert!(chunkwise_backward(&inputs, 0, &cot, Full).is_err());
    let short = cotangents(Shape { t: 36, ..SHAPE }, 1, true);
    assert!(chunkwise_backward(&inputs, 4, &short, Full).is_err());
}

/// Two f64 backwards through different stabilised forms sum the same terms in different orders
/// and cancel the stabiliser's terms differently. dq, dk, dv and the initial state's C, n are
/// compared relative to their own norm; the gate gradients and `dm_0` relative to the terms they
/// cancel from ([`MlstmGrads::gate_grad_scale`]). Either way a wrong or missing term is O(1).
const GRAD_TOL: f64 = 1e-9;

fn check_grads(tag: &str, inputs: &MlstmInputs, got: &MlstmGrads, want: &MlstmGrads) {
    let (g, w) = (&got.d_initial_state, &want.d_initial_state);
    for (name, got, want) in [
        ("dq", &got.dq, &want.dq),
        ("dk", &got.dk, &want.dk),
        ("dv", &got.dv, &want.dv),
        ("dC_0", &g.c, &w.c),
        ("dn_0", &g.n, &w.n),
    ] {
        assert_eq!(got.shape(), want.shape(), "{tag}: {name}: shapes differ");
        assert_rel_close(&format!("{tag}: {name}"), got.data(), want.data(), GRAD_TOL).unwrap();
    }
    let terms = want.gate_grad_scale(inputs);
    for (name, got, want) in [
        ("d_input_gate", &got.d_input_gate, &want.d_input_gate),
        ("d_forget_gate", &got.d_forget_gate, &want.d_forget_gate),
        ("dm_0", &g.m, &w.m),
    ] {
        assert_eq!(got.shape(), want.shape(), "{tag}: {name}: shapes differ");
        let what = format!("{tag}: {name}");
        let scale = terms + norm(want);
        assert_close_to_scale(&what, got.data(), want.data(), scale, GRAD_TOL).unwrap();
    }
}

/// T = 100 with wider heads: chunk sizes 16 and 64 leave a short last chunk.
const LONG_SHAPE: Shape = Shape {
    b: 1,
    t: 100,
    h: 2,
    dk: 8,
    dv: 6,
};

#[test]
fn chunkwise_backward_equals_recurrent_backward() {
    for (shape, chunks) in [(SHAPE, &[1, 4, 16, 37, 64][..]), (LONG_SHAPE, &[1, 16, 64])] {
        for regime in MlstmRegime::ALL {
            for initial_state in [false, true] {
                let inputs = generate_shape(shape, regime, 41, initial_state);
                for final_state in [false, true] {
                    let cot = cotangents(shape, 43, final_state);
                    for gradient in [Full, Tfla] {
                        let want = recurrent_backward(&inputs, &cot, gradient).unwrap();
                        for &chunk in chunks {
                            let got = chunkwise_backward(&inputs, chunk, &cot, gradient).unwrap();
                            let tag = format!(
                                "T {}, {regime:?}, initial state {initial_state}, \
                                 final-state cotangent {final_state}, {gradient:?}, chunk {chunk}",
                                shape.t
                            );
                            check_grads(&tag, &inputs, &got, &want);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn chunkwise_backward_with_the_denominator_floor_and_large_eps() {
    // eps = 0.5 makes the eps-dependence on m_t visible; the forget-near-zero regime has many rows
    // on the floor e^{-m_t}.
    for regime in [MlstmRegime::ForgetNearZero, MlstmRegime::LargeInputGate] {
        let mut inputs = generate(regime, 47, true);
        inputs.eps = 0.5;
        let cot = cotangents(SHAPE, 53, true);
        for gradient in [Full, Tfla] {
            let want = recurrent_backward(&inputs, &cot, gradient).unwrap();
            for chunk in [3, 16] {
                let got = chunkwise_backward(&inputs, chunk, &cot, gradient).unwrap();
                let tag = format!("{regime:?}, eps 0.5, {gradient:?}, chunk {chunk}");
                check_grads(&tag, &inputs, &got, &want);
            }
        }
    }
}

/// Ragged layouts of T = 37 on W = 1 to 4 ranks, single-token shards included.
const BACKWARD_LAYOUTS: [&[usize]; 5] =
    [&[37], &[30, 7], &[7, 20, 10], &[1, 35, 1], &[5, 13, 1, 18]];

#[test]
fn lasp2_backward_equals_one_sequence() {
    for regime in MlstmRegime::ALL {
        for initial_state in [false, true] {
            let inputs = generate(regime, 59, initial_state);
            for final_state in [false, true] {
                let cot = cotangents(SHAPE, 61, final_state);
                let want = recurrent_backward(&inputs, &cot, Full).unwrap();
                for shards in BACKWARD_LAYOUTS {
                    for chunk in [1, 4, 16] {
                        let got = lasp2_backward(&inputs, shards, chunk, &cot).unwrap();
                        let tag = format!(
                            "{regime:?}, initial {initial_state}, final {final_state}, \
                             {shards:?}, chunk {chunk}"
                        );
                        check_grads(&tag, &inputs, &got.grads, &want);
                    }
                }
            }
        }
    }
}

#[test]
fn lasp2_backward_of_tflas_gradient_equals_one_sequence() {
    for regime in MlstmRegime::ALL {
        for initial_state in [false, true] {
            let inputs = generate(regime, 67, initial_state);
            for final_state in [false, true] {
                let cot = cotangents(SHAPE, 71, final_state);
                let want = recurrent_backward(&inputs, &cot, Tfla).unwrap();
                for shards in BACKWARD_LAYOUTS {
                    for chunk in [1, 4, 16] {
                        let got = lasp2_backward_tfla(&inputs, shards, chunk, &cot).unwrap();
                        let tag = format!(
                            "{regime:?}, initial {initial_state}, final {final_state}, \
                             {shards:?}, chunk {chunk}"
                        );
                        check_grads(&tag, &inputs, &got.grads, &want);
                        // The last rank's exit cotangent is dC_T, and it adds nothing to its gates.
                        let last = shards.len() - 1;
                        let d_c_t = cot
                            .d_final_state
                            .as_ref()
                            .map_or_else(|| Tensor::zeros(&SHAPE.state()), |d| d.c.clone());
                        assert_eq!(got.exit_state_grads[last], d_c_t, "{tag}");
                        let scale = want.gate_grad_scale(&inputs).max(1.0);
                        let tail = got.log_forget_corrections[last].data();
                        assert!(
                            tail.iter().all(|x| x.abs() <= 1e-9 * scale),
                            "{tag}: {tail:?}"
                        );
                    }
                }
            }
        }
    }
}

/// Tokens `[start, start + len)` of `inputs` and `cot` as a problem of their own, entered from
/// `initial`; the final-state cotangent is kept only when the tokens run to the end.
fn tokens(
    inputs: &MlstmInputs,
    cot: &MlstmCotangents,
    start: usize,
    len: usize,
    initial: &MlstmState,
) -> (MlstmInputs, MlstmCotangents) {
    let slice = |t: &Tensor| t.slice_time(start, len);
    let part = MlstmInputs {
        shape: Shape {
            t: len,
            ..inputs.shape
        },
        q: slice(&inputs.q),
        k: slice(&inputs.k),
        v: slice(&inputs.v),
        input_gate: slice(&inputs.input_gate),
        forget_gate: slice(&inputs.forget_gate),
        initial_state: Some(initial.clone()),
        ..inputs.clone()
    };
    let to_end = start + len == inputs.shape.t;
    let part_cot = MlstmCotangents {
        d_h: slice(&cot.d_h),
        d_final_state: cot.d_final_state.clone().filter(|_| to_end),
    };
    (part, part_cot)
}

fn norm(t: &Tensor) -> f64 {
    t.data().iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Compares state cotangents as [`check_grads`] does: C and n relative to their own norm, m
/// against `m_scale`, the scale of the terms it cancels from.
fn check_state_grad(tag: &str, got: &MlstmState, want: &MlstmState, m_scale: f64) {
    let rel = |name: &str, got: &Tensor, want: &Tensor| {
        assert_rel_close(&format!("{tag}: {name}"), got.data(), want.data(), GRAD_TOL).unwrap()
    };
    rel("C", &got.c, &want.c);
    rel("n", &got.n, &want.n);
    let (what, scale) = (format!("{tag}: m"), m_scale + norm(&want.m));
    assert_close_to_scale(&what, got.m.data(), want.m.data(), scale, GRAD_TOL).unwrap();
}

/// The one-sequence gradient of the tokens `[start, start + len)` entered from `initial`, and
/// their gate scale.
fn part_backward(
    inputs: &MlstmInputs,
    cot: &MlstmCotangents,
    start: usize,
    len: usize,
    initial: &MlstmState,
) -> (MlstmState, f64) {
    let (part, part_cot) = tokens(inputs, cot, start, len, initial);
    let grads = recurrent_backward(&part, &part_cot, Full).unwrap();
    let scale = grads.gate_grad_scale(&part);
    (grads.d_initial_state, scale)
}

#[test]
fn lasp2_backward_exchanges_the_state_gradients_of_the_one_sequence() {
    // E_w: the gradient of shard w's outputs alone with respect to its entry state P_w;
    // D_w: the gradient of everything after shard w with respect to the state there.
    for regime in MlstmRegime::ALL {
        let inputs = generate(regime, 67, true);
        let cot = cotangents(SHAPE, 71, true);
        let shards = [5, 13, 1, 18];
        let forward = lasp2_forward(&inputs, &shards, 4).unwrap();
        let got = lasp2_backward(&inputs, &shards, 4, &cot).unwrap();
        let own = MlstmCotangents {
            d_final_state: None,
            ..cot.clone()
        };
        let mut start = 0;
        for (w, len) in shards.into_iter().enumerate() {
            let (want, scale) = part_backward(&inputs, &own, start, len, &forward.prefixes[w]);
            let tag = format!("{regime:?}, E_{w}");
            check_state_grad(&tag, &got.output_state_grads[w], &want, scale);
            start += len;
            let tag = format!("{regime:?}, D_{w}");
            let got = &got.exit_state_grads[w];
            if start == SHAPE.t {
                assert_eq!(got, cot.d_final_state.as_ref().unwrap(), "{tag}");
            } else {
                let exit = &forward.prefixes[w + 1];
                let (want, scale) = part_backward(&inputs, &cot, start, SHAPE.t - start, exit);
                check_state_grad(&tag, got, &want, scale);
            }
        }
    }
}

/// `fold_input_mut(prefix, summary, name)`: the named argument of [`fold`].
fn fold_input_mut<'a>(
    prefix: &'a mut MlstmState,
    summary: &'a mut ShardSummary,
    name: &str,
) -> &'a mut Tensor {
    match name {
        "C_P" => &mut prefix.c,
        "n_P" => &mut prefix.n,
        "m_P" => &mut prefix.m,
        "C_w" => &mut summary.state.c,
        "n_w" => &mut summary.state.n,
        "m_w" => &mut summary.state.m,
        "F_w" => &mut summary.log_forget_total,
        _ => unreachable!("no fold argument {name}"),
    }
}

#[test]
fn fold_backward_matches_finite_differences() {
    // Central differences of <fold(P, summary), D>; the fold is smooth away from the max's tie,
    // so step 1e-6 leaves only rounding, ~1e-16 |L| / 1e-6 per element.
    const STEP: f64 = 1e-6;
    let inputs = generate(MlstmRegime::Typical, 73, true);
    let lasp = lasp2_forward(&inputs, &[7, 20, 10], 4).unwrap();
    let d = cotangents(SHAPE, 79, true).d_final_state.unwrap();
    let loss = |p: &MlstmState, w: &ShardSummary| {
        let f = fold(SHAPE, p, w).unwrap();
        let dot = |a: &Tensor, b: &Tensor| -> f64 {
            a.data().iter().zip(b.data()).map(|(x, y)| x * y).sum()
        };
        dot(&f.c, &d.c) + dot(&f.n, &d.n) + dot(&f.m, &d.m)
    };
    // The summary's stabiliser 5 below, then 5 above, the prefix's decayed one: each side wins.
    for shift in [-5.0, 5.0] {
        let prefix = lasp.prefixes[1].clone();
        let mut summary = lasp.summaries[1].clone();
        let decayed: Vec<f64> = (prefix.m.data().iter())
            .zip(summary.log_forget_total.data())
            .map(|(m, f)| m + f + shift)
            .collect();
        summary.state.m = Tensor::from_vec(&[SHAPE.b, SHAPE.h], decayed).unwrap();
        let got = fold_backward(SHAPE, &prefix, &summary, &d).unwrap();
        for (name, analytic) in [
            ("C_P", &got.d_prefix.c),
            ("n_P", &got.d_prefix.n),
            ("m_P", &got.d_prefix.m),
            ("C_w", &got.d_summary.state.c),
            ("n_w", &got.d_summary.state.n),
            ("m_w", &got.d_summary.state.m),
            ("F_w", &got.d_summary.log_forget_total),
        ] {
            let (mut p, mut w) = (prefix.clone(), summary.clone());
            let len = fold_input_mut(&mut p, &mut w, name).len();
            let numeric: Vec<f64> = (0..len)
                .map(|i| {
                    let original = fold_input_mut(&mut p, &mut w, name).data()[i];
                    fold_input_mut(&mut p, &mut w, name).data_mut()[i] = original + STEP;
                    let up = loss(&p, &w);
                    fold_input_mut(&mut p, &mut w, name).data_mut()[i] = original - STEP;
                    let down = loss(&p, &w);
                    fold_input_mut(&mut p, &mut w, name).data_mut()[i] = original;
                    (up - down) / (2.0 * STEP)
                })
                .collect();
            let what = format!("shift {shift}: d{name}");
            let scale = numeric.iter().map(|x| x * x).sum::<f64>().sqrt() + loss(&p, &w).abs();
            assert_close_to_scale(&what, analytic.data(), &numeric, scale, 1e-7).unwrap();
        }
    }
}

/// Central finite differences of `MlstmForward::loss` (recurrent forward) for every input value,
/// against the analytic backward. Step 1e-5: truncation `h^2 |L'''| / 6` and rounding
/// `eps |L| / h` are both ~1e-10 per element here; norm-wise 1e-6 relative leaves margin (a
/// missing term is O(1)), plus the rounding floor `1e-9 (1 + |L|)` per element for gradients that
/// are themselves that small (`dn_0` once large input gates swamp the initial state). Inputs are
/// random, so no max and no `|qn|` sits at its kink.
mod finite_differences {
    use super::*;

    const STEP: f64 = 1e-5;
    const REL_TOL: f64 = 1e-6;
    const ABS_TOL: f64 = 1e-9;
    const FD_SHAPE: Shape = Shape {
        b: 1,
        t: 9,
        h: 2,
        dk: 3,
        dv: 2,
    };

    /// The named input tensor of `inputs`, mutably.
    fn input_mut<'a>(inputs: &'a mut MlstmInputs, name: &str) -> &'a mut Tensor {
        let state = inputs.initial_state.as_mut().unwrap();
        match name {
            "q" => &mut inputs.q,
            "k" => &mut inputs.k,
            "v" => &mut inputs.v,
            "input_gate" => &mut inputs.input_gate,
            "forget_gate" => &mut inputs.forget_gate,
            "C_0" => &mut state.c,
            "n_0" => &mut state.n,
            "m_0" => &mut state.m,
            _ => unreachable!("no input {name}"),
        }
    }

    /// `dL/dx` by central differences for every element of input `name`.
    fn numeric_gradient(inputs: &MlstmInputs, cot: &MlstmCotangents, name: &str) -> Vec<f64> {
        let loss = |x: &MlstmInputs| recurrent_forward(x).unwrap().loss(cot);
        let mut x = inputs.clone();
        (0..input_mut(&mut x, name).len())
            .map(|i| {
                let original = input_mut(&mut x, name).data()[i];
                input_mut(&mut x, name).data_mut()[i] = original + STEP;
                let up = loss(&x);
                input_mut(&mut x, name).data_mut()[i] = original - STEP;
                let down = loss(&x);
                input_mut(&mut x, name).data_mut()[i] = original;
                (up - down) / (2.0 * STEP)
            })
            .collect()
    }

    #[test]
    fn recurrent_backward_matches_finite_differences() {
        for regime in MlstmRegime::ALL {
            for eps in [0.0, 1e-6, 0.5] {
                let spec = MlstmSpec {
                    shape: FD_SHAPE,
                    regime,
                    seed: 29,
                    round_to_bf16: false,
                    initial_state: true,
                };
                let mut inputs = MlstmInputs::generate(&spec).unwrap();
                inputs.eps = eps;
                if regime == MlstmRegime::LargeInputGate {
                    // Keep the loss O(1) in the region finite differences can resolve: large
                    // gates (and the stabiliser's max switching sides), but a bounded m_T.
                    inputs.input_gate = inputs.input_gate.map(|x| x / 20.0);
                }
                let cot = cotangents(FD_SHAPE, 31, true);
                let grads = recurrent_backward(&inputs, &cot, Full).unwrap();
                let loss = recurrent_forward(&inputs).unwrap().loss(&cot);
                let state = &grads.d_initial_state;
                for (name, analytic) in [
                    ("q", &grads.dq),
                    ("k", &grads.dk),
                    ("v", &grads.dv),
                    ("input_gate", &grads.d_input_gate),
                    ("forget_gate", &grads.d_forget_gate),
                    ("C_0", &state.c),
                    ("n_0", &state.n),
                    ("m_0", &state.m),
                ] {
                    let numeric = numeric_gradient(&inputs, &cot, name);
                    let what = format!("{regime:?}, eps {eps}: d{name}");
                    let norm = numeric.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let floor = ABS_TOL * (1.0 + loss.abs()) * (numeric.len() as f64).sqrt();
                    let allowed = REL_TOL * norm + floor;
                    assert_close_to_scale(&what, analytic.data(), &numeric, allowed, 1.0).unwrap();
                }
            }
        }
    }
}

/// mlstm_kernels' (TFLA's) gradient, `MlstmGradient::Tfla` (the reference's module doc, "TFLA's
/// gradient"): against a transcription of mlstm_kernels' formulas, and against the full
/// derivative where the terms it drops vanish and where they do not.
mod tfla_gradient {
    use super::*;

    fn dot(x: &[f64], y: &[f64]) -> f64 {
        x.iter().zip(y).map(|(a, b)| a * b).sum()
    }

    /// `x <- x - (<x, y> / <y, y>) y`: `x` orthogonal to `y`.
    fn project_out(x: &mut [f64], y: &[f64]) {
        let along = dot(x, y) / dot(y, y);
        if along.is_finite() {
            x.iter_mut().zip(y).for_each(|(a, b)| *a -= along * b);
        }
    }

    /// Cotangents under which the terms TFLA drops vanish: every row of `d_h` orthogonal to its
    /// `h_t` (what a scale-invariant norm of each head's output passes back), `dC_T` orthogonal
    /// to `C_T` per head, `dn_T = dm_T = 0`.
    fn norm_invariant_cotangents(inputs: &MlstmInputs, seed: u64) -> MlstmCotangents {
        let s = inputs.shape;
        let forward = recurrent_forward(inputs).unwrap();
        let mut cot = cotangents(s, seed, true);
        let rows = forward.h.data().chunks(s.dv);
        cot.d_h
            .data_mut()
            .chunks_mut(s.dv)
            .zip(rows)
            .for_each(|(d, h)| project_out(d, h));
        let d = cot.d_final_state.as_mut().unwrap();
        let states = forward.final_state.c.data().chunks(s.dk * s.dv);
        d.c.data_mut()
            .chunks_mut(s.dk * s.dv)
            .zip(states)
            .for_each(|(d, c)| project_out(d, c));
        d.n = d.n.map(|_| 0.0);
        d.m = d.m.map(|_| 0.0);
        cot
    }

    fn field<'a>(g: &'a MlstmGrads, name: &str) -> &'a Tensor {
        match name {
            "dq" => &g.dq,
            "dk" => &g.dk,
            "dv" => &g.dv,
            "d_input_gate" => &g.d_input_gate,
            "d_forget_gate" => &g.d_forget_gate,
            "dC_0" => &g.d_initial_state.c,
            "dn_0" => &g.d_initial_state.n,
            "dm_0" => &g.d_initial_state.m,
            _ => unreachable!("no gradient {name}"),
        }
    }

    #[test]
    fn tfla_is_the_full_derivative_where_the_dropped_terms_vanish() {
        for regime in MlstmRegime::ALL {
            for initial_state in [false, true] {
                for eps in [1e-6, 0.5] {
                    let mut inputs = generate(regime, 71, initial_state);
                    inputs.eps = eps;
                    if regime == MlstmRegime::ForgetNearZero && !initial_state {
                        assert!(floored_tokens(&inputs) > 0, "the floor is never active");
                    }
                    let cot = norm_invariant_cotangents(&inputs, 73);
                    let full = recurrent_backward(&inputs, &cot, Full).unwrap();
                    let tfla = recurrent_backward(&inputs, &cot, Tfla).unwrap();
                    let tag = format!("{regime:?}, initial state {initial_state}, eps {eps}");
                    for name in ["dq", "dk", "dv", "dC_0"] {
                        let (got, want) = (field(&tfla, name).data(), field(&full, name).data());
                        assert_rel_close(&format!("{tag}: {name}"), got, want, GRAD_TOL).unwrap();
                    }
                    let gates = full.gate_grad_scale(&inputs);
                    for name in ["d_input_gate", "d_forget_gate"] {
                        let (got, want) = (field(&tfla, name).data(), field(&full, name).data());
                        let (what, scale) =
                            (format!("{tag}: {name}"), gates + norm(field(&full, name)));
                        assert_close_to_scale(&what, got, want, scale, GRAD_TOL).unwrap();
                    }
                    // The full dn_0 is sum_t sigma q_t <d_h_t, h_t> (...): zero up to the rounding
                    // of <d_h_t, h_t>, so it is measured against dC_0, the same sum of
                    // sigma q_t d_h_t / den_t without that factor.
                    let (what, scale) = (format!("{tag}: dn_0"), norm(&full.d_initial_state.c));
                    let (got, want) =
                        (tfla.d_initial_state.n.data(), full.d_initial_state.n.data());
                    assert_close_to_scale(&what, got, want, scale, GRAD_TOL).unwrap();
                    // m_0 scales C_0: the full derivative's dm_0 is <dC_0, C_0>; TFLA's is 0.
                    let block = SHAPE.dk * SHAPE.dv;
                    let c_0 = inputs.initial_state.as_ref().map_or_else(
                        || vec![0.0; full.d_initial_state.c.len()],
                        |state| state.c.data().to_vec(),
                    );
                    let d_c_0 = full.d_initial_state.c.data().chunks(block);
                    let want_m_0: Vec<f64> = d_c_0
                        .zip(c_0.chunks(block))
                        .map(|(d, c)| dot(d, c))
                        .collect();
                    let full_m_0 = full.d_initial_state.m.data();
                    let what = format!("{tag}: full dm_0");
                    assert_close_to_scale(&what, full_m_0, &want_m_0, gates, GRAD_TOL).unwrap();
                    let tfla_m_0 = tfla.d_initial_state.m.data();
                    assert!(
                        tfla_m_0.iter().all(|&x| x == 0.0),
                        "{tag}: TFLA's dm_0 {tfla_m_0:?}"
                    );
                }
            }
        }
    }

    /// A relative difference this large is a term, not rounding.
    const MEASURABLE: f64 = 1e-3;

    #[test]
    fn tfla_differs_from_the_full_derivative_where_they_do_not() {
        for regime in MlstmRegime::ALL {
            let inputs = generate(regime, 79, true);
            // A generic d_h reaches the normaliser, the floor and eps e^{m_t}; a generic dC_T
            // (with d_h orthogonal to h) reaches m_T and the dropped e^{G_T}, both only through
            // the gates (d_input_gate only at the stabiliser's winner, so it is left out).
            let generic_d_h = cotangents(SHAPE, 83, false);
            let mut generic_d_c = norm_invariant_cotangents(&inputs, 89);
            let d_c = normal(&mut SplitMix64::new(97), &SHAPE.state());
            generic_d_c.d_final_state.as_mut().unwrap().c = d_c;
            let cases = [
                (
                    "generic d_h",
                    generic_d_h,
                    &["dv", "dC_0"][..],
                    &["dq", "dk", "d_input_gate", "d_forget_gate", "dn_0", "dm_0"][..],
                ),
                (
                    "generic dC_T",
                    generic_d_c,
                    &["dq", "dk", "dv", "dC_0"][..],
                    &["d_forget_gate", "dm_0"][..],
                ),
            ];
            for (case, cot, same, different) in cases {
                let full = recurrent_backward(&inputs, &cot, Full).unwrap();
                let tfla = recurrent_backward(&inputs, &cot, Tfla).unwrap();
                for name in same {
                    let what = format!("{regime:?}, {case}: {name}");
                    let (got, want) = (field(&tfla, name).data(), field(&full, name).data());
                    assert_rel_close(&what, got, want, GRAD_TOL).unwrap();
                }
                for name in different {
                    let err = rel_err(field(&tfla, name).data(), field(&full, name).data());
                    let what = format!("{regime:?}, {case}: {name}");
                    assert!(
                        err > MEASURABLE,
                        "{what}: relative difference only {err:.1e}"
                    );
                }
            }
        }
    }

    /// One head's gradients as mlstm_kernels computes them, from the zero initial state with the
    /// whole sequence as one chunk: `dq, dk, dv, di, df`. The rows as `mlstm_parallel_bw`
    /// (mlstm_kernels/torch/parallel/native/bw.py) forms them, `dC_T` through the keys and values
    /// with `vecAbar` as `_mlstm_chunkwise__parallel_bw_dQKV` (torch/chunkwise/native/bw.py), the
    /// gates as `compute_gate_grads_vecDeltaI_vecDeltaF`
    /// (torch/chunkwise/triton_xl_chunk/chunkwise_gates.py). `m_t` and the denominators are the
    /// forward's (its chunkwise form starts from `m = 0`, as mlstm_kernels' does).
    fn transcribed_head(
        inputs: &MlstmInputs,
        d_h: &Tensor,
        d_c_t: &[f64],
        b: usize,
        h: usize,
    ) -> [Vec<f64>; 5] {
        let (s, sigma, eps) = (inputs.shape, inputs.scale, inputs.eps);
        let lf = inputs.log_forget_gate();
        let q = |t: usize| -> Vec<f64> { (0..s.dk).map(|d| inputs.q.get(&[b, t, h, d])).collect() };
        let k = |t: usize| -> Vec<f64> { (0..s.dk).map(|d| inputs.k.get(&[b, t, h, d])).collect() };
        let v = |t: usize| -> Vec<f64> { (0..s.dv).map(|d| inputs.v.get(&[b, t, h, d])).collect() };
        let i = |t: usize| inputs.input_gate.get(&[b, t, h]);
        let g: Vec<f64> = (0..s.t)
            .scan(0.0, |sum, t| {
                *sum += lf.get(&[b, t, h]);
                Some(*sum)
            })
            .collect();
        let m: Vec<f64> = (0..s.t)
            .map(|t| (0..=t).map(|j| i(j) + g[t] - g[j]).fold(g[t], f64::max))
            .collect();
        let d = |t: usize, j: usize| (i(j) + g[t] - g[j] - m[t]).exp();
        let score = |t: usize, j: usize| sigma * dot(&q(t), &k(j));
        let den: Vec<f64> = (0..s.t)
            .map(|t| {
                let qn: f64 = (0..=t).map(|j| d(t, j) * score(t, j)).sum();
                qn.abs().max((-m[t]).exp()) + eps
            })
            .collect();
        let d_h_n =
            |t: usize| -> Vec<f64> { (0..s.dv).map(|e| d_h.get(&[b, t, h, e]) / den[t]).collect() };
        let (mut dq, mut dk, mut dv) = (
            vec![vec![0.0; s.dk]; s.t],
            vec![vec![0.0; s.dk]; s.t],
            vec![vec![0.0; s.dv]; s.t],
        );
        for (t, dq_t) in dq.iter_mut().enumerate() {
            for j in 0..=t {
                let p = dot(&d_h_n(t), &v(j)) * d(t, j);
                dq_t.iter_mut()
                    .zip(k(j))
                    .for_each(|(x, y)| *x += sigma * p * y);
                dk[j]
                    .iter_mut()
                    .zip(q(t))
                    .for_each(|(x, y)| *x += sigma * p * y);
                let w = score(t, j) * d(t, j);
                dv[j]
                    .iter_mut()
                    .zip(d_h_n(t))
                    .for_each(|(x, y)| *x += w * y);
            }
        }
        let last = s.t - 1;
        for j in 0..s.t {
            let a_bar = (g[last] - g[j] + i(j) - m[last]).exp();
            for (r, x) in dk[j].iter_mut().enumerate() {
                *x += a_bar * dot(&d_c_t[r * s.dv..(r + 1) * s.dv], &v(j));
            }
            for (c, x) in dv[j].iter_mut().enumerate() {
                *x += a_bar
                    * (0..s.dk)
                        .map(|r| k(j)[r] * d_c_t[r * s.dv + c])
                        .sum::<f64>();
            }
        }
        let di: Vec<f64> = (0..s.t).map(|t| dot(&k(t), &dk[t])).collect();
        let mut df = vec![0.0; s.t];
        let mut suffix = 0.0;
        for t in (0..s.t).rev() {
            suffix += dot(&q(t), &dq[t]) - dot(&k(t), &dk[t]);
            df[t] = suffix / (1.0 + inputs.forget_gate.get(&[b, t, h]).exp());
        }
        [dq.concat(), dk.concat(), dv.concat(), di, df]
    }

    #[test]
    fn tfla_is_mlstm_kernels_gradient() {
        for regime in MlstmRegime::ALL {
            for eps in [1e-6, 0.5] {
                let mut inputs = generate(regime, 101, false);
                inputs.eps = eps;
                // dn_T and dm_T too: mlstm_kernels ignores them.
                let cot = cotangents(SHAPE, 103, true);
                let got = recurrent_backward(&inputs, &cot, Tfla).unwrap();
                let scale = got.gate_grad_scale(&inputs);
                let d_final = cot.d_final_state.as_ref().unwrap();
                let block = SHAPE.dk * SHAPE.dv;
                for b in 0..SHAPE.b {
                    for h in 0..SHAPE.h {
                        let head = b * SHAPE.h + h;
                        let d_c_t = &d_final.c.data()[head * block..(head + 1) * block];
                        let want = transcribed_head(&inputs, &cot.d_h, d_c_t, b, h);
                        let per_token = |t: &Tensor, width: usize| -> Vec<f64> {
                            (0..SHAPE.t)
                                .flat_map(|s| (0..width).map(move |e| (s, e)))
                                .map(|(s, e)| {
                                    t.data()[((b * SHAPE.t + s) * SHAPE.h + h) * width + e]
                                })
                                .collect()
                        };
                        let tag = format!("{regime:?}, eps {eps}, head ({b}, {h})");
                        for (name, got, want) in [
                            ("dq", per_token(&got.dq, SHAPE.dk), &want[0]),
                            ("dk", per_token(&got.dk, SHAPE.dk), &want[1]),
                            ("dv", per_token(&got.dv, SHAPE.dv), &want[2]),
                        ] {
                            assert_rel_close(&format!("{tag}: {name}"), &got, want, GRAD_TOL)
                                .unwrap();
                        }
                        for (name, got, want) in [
                            ("d_input_gate", per_token(&got.d_input_gate, 1), &want[3]),
                            ("d_forget_gate", per_token(&got.d_forget_gate, 1), &want[4]),
                        ] {
                            let what = format!("{tag}: {name}");
                            assert_close_to_scale(&what, &got, want, scale, GRAD_TOL).unwrap();
                        }
                    }
                }
            }
        }
    }

    /// TFLA's gradient depends on where calls split the sequence: with the state handed from one
    /// call to the next (the second call's `dC_0` as the first's `dC_T`), the first call's log
    /// forget gates lack `<dC_P, P>` (the handed-over state `P`'s `e^{G}`), and nothing else
    /// changes. A LASP-2 backward built from TFLA's per-shard backward must add it back.
    #[test]
    fn tfla_split_into_two_calls_lacks_the_handover_decay() {
        let split = 20;
        for regime in MlstmRegime::ALL {
            let inputs = generate(regime, 111, true);
            let cot = cotangents(SHAPE, 113, false);
            let one_call = recurrent_backward(&inputs, &cot, Tfla).unwrap();
            let initial = inputs.initial_state.as_ref().unwrap();
            let (first, first_cot) = tokens(&inputs, &cot, 0, split, initial);
            let handover = recurrent_forward(&first).unwrap().final_state;
            let (second, second_cot) = tokens(&inputs, &cot, split, SHAPE.t - split, &handover);
            let second_grads = recurrent_backward(&second, &second_cot, Tfla).unwrap();
            let d_handover = second_grads.d_initial_state.clone();
            let first_cot = MlstmCotangents {
                d_final_state: Some(d_handover.clone()),
                ..first_cot
            };
            let first_grads = recurrent_backward(&first, &first_cot, Tfla).unwrap();
            let block = SHAPE.dk * SHAPE.dv;
            let decays: Vec<f64> = d_handover
                .c
                .data()
                .chunks(block)
                .zip(handover.c.data().chunks(block))
                .map(|(d, c)| dot(d, c))
                .collect();
            // One call's gradients of each part, less the decay on the first part's gates.
            let part = |t: &Tensor, start: usize, len: usize| t.slice_time(start, len);
            let mut want_first_df = part(&one_call.d_forget_gate, 0, split);
            for (index, d) in want_first_df.data_mut().iter_mut().enumerate() {
                let [b, t, h] = [
                    index / (split * SHAPE.h),
                    index / SHAPE.h % split,
                    index % SHAPE.h,
                ];
                let sigmoid_minus_f = 1.0 / (1.0 + inputs.forget_gate.get(&[b, t, h]).exp());
                *d -= decays[b * SHAPE.h + h] * sigmoid_minus_f;
            }
            let scale = one_call.gate_grad_scale(&inputs);
            for (tag, grads, start, len) in [
                ("first call", &first_grads, 0, split),
                ("second call", &second_grads, split, SHAPE.t - split),
            ] {
                for name in ["dq", "dk", "dv"] {
                    let what = format!("{regime:?}, {tag}: {name}");
                    let want = part(field(&one_call, name), start, len);
                    let got = field(grads, name).data();
                    assert_rel_close(&what, got, want.data(), GRAD_TOL).unwrap();
                }
                for name in ["d_input_gate", "d_forget_gate"] {
                    let what = format!("{regime:?}, {tag}: {name}");
                    let want = if (tag, name) == ("first call", "d_forget_gate") {
                        want_first_df.clone()
                    } else {
                        part(field(&one_call, name), start, len)
                    };
                    let got = field(grads, name).data();
                    assert_close_to_scale(&what, got, want.data(), scale, GRAD_TOL).unwrap();
                }
            }
        }
    }
}

#[test]
fn normaliser_conditioning_is_the_cancellation_of_q_dot_n() {
    // One token, input gate 50 (so m = 50 and n = k, e^{-m} far below |q . n|): kappa is
    // sum |q_d k_d| / |q . k| exactly, 2047 for q = (1, 2^-10 - 1), k = (1, 1).
    let shape = Shape {
        b: 1,
        t: 1,
        h: 1,
        dk: 2,
        dv: 1,
    };
    let tensor = |shape: &[usize], data: Vec<f64>| Tensor::from_vec(shape, data).unwrap();
    let inputs = MlstmInputs {
        shape,
        q: tensor(&shape.qk(), vec![1.0, 2f64.powi(-10) - 1.0]),
        k: tensor(&shape.qk(), vec![1.0, 1.0]),
        v: tensor(&shape.v(), vec![1.0]),
        input_gate: tensor(&shape.per_token(), vec![50.0]),
        forget_gate: tensor(&shape.per_token(), vec![0.0]),
        initial_state: None,
        scale: 0.5,
        eps: 0.0,
    };
    let got = normaliser_conditioning(&inputs).unwrap().get(&[0, 0, 0]);
    assert_eq!(got, 2047.0);
    // Random queries and keys: tens at most, and every value finite and positive.
    let typical = normaliser_conditioning(&generate(MlstmRegime::Typical, 3, true)).unwrap();
    let median = {
        let mut v = typical.data().to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    assert!(typical.data().iter().all(|k| k.is_finite() && *k > 0.0));
    assert!((0.5..100.0).contains(&median), "median kappa {median}");
}
