//! The mLSTM reference ("mLSTMexp"): every stabilised evaluation against the recurrent definition,
//! and the definition against the unstabilised form; the chunkwise and LASP-2 backwards against
//! the recurrent backward, and that against finite differences.
//!
//! Tolerances: two f64 evaluations of the same sums in different orders agree to ~1e-14
//! relative; the stabilisers `m_t` agree to a few ulps of `|m_t|` (up to ~1e3 here), which moves
//! the rescaled states by ~1e-13 relative. 1e-10 leaves margin without hiding a wrong term (any
//! real error is O(1)). Gradients: see [`GRAD_TOL`].

use lasp_shmem::reference::mlstm::{
    chunkwise_backward, chunkwise_forward, fold, fold_backward, lasp2_backward, lasp2_forward,
    recurrent_backward, recurrent_forward, unstabilised_forward, MlstmCotangents, MlstmForward,
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
    assert!(chunkwise_backward(&inputs, 0, &cot).is_err());
    let short = cotangents(Shape { t: 36, ..SHAPE }, 1, true);
    assert!(chunkwise_backward(&inputs, 4, &short).is_err());
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
                    let want = recurrent_backward(&inputs, &cot).unwrap();
                    for &chunk in chunks {
                        let got = chunkwise_backward(&inputs, chunk, &cot).unwrap();
                        let tag = format!(
                            "T {}, {regime:?}, initial state {initial_state}, \
                             final-state cotangent {final_state}, chunk {chunk}",
                            shape.t
                        );
                        check_grads(&tag, &inputs, &got, &want);
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
        let want = recurrent_backward(&inputs, &cot).unwrap();
        for chunk in [3, 16] {
            let got = chunkwise_backward(&inputs, chunk, &cot).unwrap();
            let tag = format!("{regime:?}, eps 0.5, chunk {chunk}");
            check_grads(&tag, &inputs, &got, &want);
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
                let want = recurrent_backward(&inputs, &cot).unwrap();
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
    let grads = recurrent_backward(&part, &part_cot).unwrap();
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
                let grads = recurrent_backward(&inputs, &cot).unwrap();
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
