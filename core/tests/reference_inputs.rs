//! The seeded generator, the comparison helpers, NaN/Inf-freedom in every regime, and the
//! rejection of bad inputs with messages that say what is wrong.

use lasp_shmem::reference::lasp2::{self, Decay};
use lasp_shmem::reference::{
    assert_close_to_scale, assert_rel_close, delta_rule, gla, rel_err, scalar_decay, Cotangents,
    Family, GateKind, InputSpec, Inputs, ReferenceError, Regime, Shape, Tensor,
};

const SHAPE: Shape = Shape {
    b: 1,
    t: 16,
    h: 2,
    dk: 4,
    dv: 3,
};

fn spec(family: Family, regime: Regime) -> InputSpec {
    InputSpec {
        shape: SHAPE,
        family,
        regime,
        seed: 42,
        round_to_bf16: false,
        initial_state: true,
    }
}

fn generate(family: Family, regime: Regime) -> Inputs {
    Inputs::generate(&spec(family, regime)).unwrap()
}

#[test]
fn generator_is_deterministic_and_seeded() {
    let s = spec(Family::Gla, Regime::Mixed);
    assert_eq!(Inputs::generate(&s).unwrap(), Inputs::generate(&s).unwrap());
    let other = Inputs::generate(&InputSpec { seed: 43, ..s }).unwrap();
    assert_ne!(other.q, generate(Family::Gla, Regime::Mixed).q);
    // Each tensor has its own stream: the regime changes only the gates.
    let typical = generate(Family::Gla, Regime::Typical);
    for regime in [Regime::NoDecay, Regime::StrongDecay, Regime::Mixed] {
        let x = generate(Family::Gla, regime);
        assert_eq!(
            (&x.q, &x.k, &x.v, &x.h0),
            (&typical.q, &typical.k, &typical.v, &typical.h0)
        );
    }
    let a = Cotangents::generate(SHAPE, 1, true, false).unwrap();
    assert_eq!(a, Cotangents::generate(SHAPE, 1, true, false).unwrap());
    assert!(Cotangents::generate(SHAPE, 1, false, false)
        .unwrap()
        .d_ht
        .is_none());
}

#[test]
fn regimes_have_their_documented_values() {
    for family in [Family::ScalarDecay, Family::Gla, Family::DeltaRule] {
        let typical = generate(family, Regime::Typical);
        assert_eq!(typical.g.shape(), SHAPE.gate(family.gate_kind()).as_slice());
        assert!(
            typical.g.data().iter().all(|&a| a < 0.0 && a > -1.0),
            "logsigmoid(x)/16"
        );
        assert!(generate(family, Regime::NoDecay)
            .g
            .data()
            .iter()
            .all(|&a| a == 0.0));
        assert!(generate(family, Regime::StrongDecay)
            .g
            .data()
            .iter()
            .all(|&a| a == -30.0));
        let mixed = generate(family, Regime::Mixed);
        assert!(mixed.g.data().contains(&0.0) && mixed.g.data().contains(&-30.0));
        assert!(mixed.g.data().iter().any(|&a| a < 0.0 && a > -30.0));
        assert_eq!(typical.scale, 0.5, "Dk^-1/2 with Dk = 4");
        assert_eq!(typical.beta.is_some(), family == Family::DeltaRule);
        let large = generate(family, Regime::LargeNorm);
        let ratio = large.q.data()[0] / typical.q.data()[0];
        assert!(
            (ratio - 16.0).abs() < 1e-12,
            "LargeNorm scales q by 16, got {ratio}"
        );
    }
    let delta = generate(Family::DeltaRule, Regime::Typical);
    for row in delta.k.data().chunks(SHAPE.dk) {
        let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            (norm - 1.0).abs() < 1e-12,
            "delta-rule keys are unit-norm, got {norm}"
        );
    }
    assert!(delta
        .beta
        .unwrap()
        .data()
        .iter()
        .all(|&b| b > 0.0 && b < 1.0));
    assert_eq!(Family::Gla.gate_kind(), GateKind::Vector);
}

#[test]
fn bf16_rounding_makes_device_copies_exact() {
    for family in [Family::ScalarDecay, Family::Gla, Family::DeltaRule] {
        let s = InputSpec {
            round_to_bf16: true,
            ..spec(family, Regime::Mixed)
        };
        let x = Inputs::generate(&s).unwrap();
        for t in [&x.q, &x.k, &x.v] {
            assert!(t
                .data()
                .iter()
                .all(|&v| half::bf16::from_f64(v).to_f64() == v));
        }
        for t in [Some(&x.g), x.beta.as_ref(), x.h0.as_ref()]
            .into_iter()
            .flatten()
        {
            assert!(t.data().iter().all(|&v| f64::from(v as f32) == v));
        }
        assert_eq!(f64::from(x.scale as f32), x.scale);
        let unrounded = generate(family, Regime::Mixed);
        // Rounding moves q by at most bf16's relative precision 2^-8.
        assert!(rel_err(x.q.data(), unrounded.q.data()) < 1.0 / 256.0);
    }
    let cot = Cotangents::generate(SHAPE, 5, true, true).unwrap();
    assert!(cot
        .d_o
        .data()
        .iter()
        .all(|&v| half::bf16::from_f64(v).to_f64() == v));
}

#[test]
fn comparison_helpers() {
    let y = [3.0, 4.0];
    assert_eq!(rel_err(&y, &y), 0.0);
    assert!((rel_err(&[3.0, 4.5], &y) - 0.1).abs() < 1e-15);
    assert_eq!(rel_err(&[1.0], &[0.0]), f64::INFINITY);
    assert!(assert_rel_close("o", &[3.0, 4.5], &y, 0.11).is_ok());
    let err = assert_rel_close("o", &[3.0, 4.5], &y, 0.01).unwrap_err();
    assert!(
        err.contains("o: relative error 1.000e-1") && err.contains("flat index 1"),
        "{err}"
    );
    assert!(assert_rel_close("o", &[f64::NAN, 4.0], &y, 1.0)
        .unwrap_err()
        .contains("not finite"));
    assert!(assert_rel_close("o", &[1.0], &y, 1.0)
        .unwrap_err()
        .contains("got 1 values"));
    assert!(assert_close_to_scale("dg", &[1e-3], &[0.0], 1.0, 1e-2).is_ok());
    assert!(assert_close_to_scale("dg", &[1e-3], &[0.0], 1.0, 1e-4).is_err());
}

#[test]
fn tensor_helpers() {
    let t = Tensor::from_vec(&[2, 3, 1], (0..6).map(f64::from).collect()).unwrap();
    assert_eq!(t.get(&[1, 2, 0]), 5.0);
    assert_eq!(t.unravel(4), vec![1, 1, 0]);
    let parts = [t.slice_time(0, 1), t.slice_time(1, 2)];
    assert_eq!(parts[1].data(), &[1.0, 2.0, 4.0, 5.0]);
    assert_eq!(Tensor::concat_time(&parts), t);
    let err = Tensor::from_vec(&[2, 2], vec![0.0; 3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "a tensor of shape [2, 2] needs 4 values but the buffer holds 3"
    );
}

/// Every regime, every family, forward and backward, single sequence and LASP-2 at T = 64 (the
/// strong-decay cumsum reaches -1920, where `e^{-G}` would overflow f64): no NaN or Inf.
#[test]
fn every_regime_is_finite() {
    let shape = Shape {
        b: 1,
        t: 64,
        h: 2,
        dk: 8,
        dv: 8,
    };
    let lengths = [9, 30, 1, 24];
    for family in [Family::ScalarDecay, Family::Gla, Family::DeltaRule] {
        for regime in Regime::ALL {
            let s = InputSpec {
                shape,
                ..spec(family, regime)
            };
            let x = Inputs::generate(&s).unwrap();
            let cot = Cotangents::generate(shape, 7, true, false).unwrap();
            let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
            let mut outputs = Vec::new();
            match family {
                Family::ScalarDecay => {
                    let f = scalar_decay::chunkwise_forward(&x, 16).unwrap();
                    let g = scalar_decay::backward(&x, 16, d_o, d_ht).unwrap();
                    let l = lasp2::backward(&x, Decay::Scalar, &lengths, 16, d_o, d_ht).unwrap();
                    outputs.extend([f.o, f.final_state, g.dq, g.dk, g.dv, g.dg, g.dh0]);
                    outputs.extend([l.grads.dq, l.grads.dk, l.grads.dv, l.grads.dg, l.grads.dh0]);
                }
                Family::Gla => {
                    let f = gla::chunkwise_forward(&x, 16, 4).unwrap();
                    let g = gla::backward(&x, 16, 4, d_o, d_ht).unwrap();
                    let decay = Decay::Vector { sub_chunk: 4 };
                    let l = lasp2::backward(&x, decay, &lengths, 16, d_o, d_ht).unwrap();
                    outputs.extend([f.o, f.final_state, g.dq, g.dk, g.dv, g.dg, g.dh0]);
                    outputs.extend([l.grads.dq, l.grads.dk, l.grads.dv, l.grads.dg, l.grads.dh0]);
                }
                Family::DeltaRule => {
                    let f = delta_rule::chunkwise_forward(&x, 16).unwrap();
                    let g = delta_rule::recurrent_backward(&x, d_o, d_ht).unwrap();
                    let l = lasp2::delta_backward(&x, &lengths, 16, d_o, d_ht).unwrap();
                    outputs.extend([f.o, f.final_state, g.dq, g.dk, g.dv, g.dg, g.dh0]);
                    outputs.extend([g.dbeta.unwrap(), l.grads.dq, l.grads.dg, l.grads.dh0]);
                }
            }
            for (i, t) in outputs.iter().enumerate() {
                assert_eq!(
                    t.first_non_finite(),
                    None,
                    "{family:?} {regime:?} output {i}"
                );
            }
        }
    }
}

fn message(err: ReferenceError) -> String {
    err.to_string()
}

#[test]
fn positive_gates_are_rejected_with_their_index() {
    let mut x = generate(Family::ScalarDecay, Regime::Typical);
    x.g.data_mut()[2 * SHAPE.h + 1] = 0.25; // [b = 0, t = 2, h = 1]
    let err = scalar_decay::chunkwise_forward(&x, 4).unwrap_err();
    assert_eq!(
        err,
        ReferenceError::PositiveGate {
            index: vec![0, 2, 1],
            value: 0.25
        }
    );
    let msg = message(err);
    assert!(
        msg.contains("g[0, 2, 1] = 0.25 is positive") && msg.contains("<= 0"),
        "{msg}"
    );
    let mut v = generate(Family::Gla, Regime::Typical);
    v.g.data_mut()[5] = 1e-3;
    assert!(matches!(
        gla::backward(&v, 4, 2, &v.v, None),
        Err(ReferenceError::PositiveGate { .. })
    ));
    let mut d = generate(Family::DeltaRule, Regime::Typical);
    d.g.data_mut()[0] = 2.0;
    assert!(matches!(
        lasp2::delta_forward(&d, &[8, 8], 4),
        Err(ReferenceError::PositiveGate { .. })
    ));
}

#[test]
fn mismatched_shapes_are_rejected() {
    let x = generate(Family::ScalarDecay, Regime::Typical);
    let mut bad_k = x.clone();
    bad_k.k = Tensor::zeros(&[1, 16, 2, 5]);
    let msg = message(scalar_decay::recurrent_forward(&bad_k).unwrap_err());
    assert!(msg.contains("k has shape [1, 16, 2, 5] but must be [B, T, H, Dk] = [1, 16, 2, 4]"));
    // Scalar gates handed to the vector-gate family, and the other way round.
    let msg = message(gla::recurrent_forward(&x).unwrap_err());
    assert!(
        msg.contains("g has shape [1, 16, 2]") && msg.contains("vector gates"),
        "{msg}"
    );
    let v = generate(Family::Gla, Regime::Typical);
    let msg = message(scalar_decay::chunkwise_forward(&v, 4).unwrap_err());
    assert!(msg.contains("[B, T, H] (scalar gates)"), "{msg}");
    let mut bad_h0 = x.clone();
    bad_h0.h0 = Some(Tensor::zeros(&[1, 2, 3, 4]));
    assert!(
        message(scalar_decay::recurrent_forward(&bad_h0).unwrap_err()).contains("h0 has shape")
    );
    let bad_do = Tensor::zeros(&[1, 15, 2, 3]);
    let msg = message(scalar_decay::backward(&x, 4, &bad_do, None).unwrap_err());
    assert!(msg.contains("d_o has shape [1, 15, 2, 3]"), "{msg}");
    let bad_dht = Tensor::zeros(&[1, 2, 3, 3]);
    let err = lasp2::backward(&x, Decay::Scalar, &[16], 4, &x.v, Some(&bad_dht)).unwrap_err();
    assert!(message(err).contains("d_ht has shape"));
    let mut no_beta = generate(Family::DeltaRule, Regime::Typical);
    no_beta.beta = None;
    let msg = message(delta_rule::chunkwise_forward(&no_beta, 4).unwrap_err());
    assert!(msg.contains("needs beta"), "{msg}");
    let mut nan = x.clone();
    nan.v.data_mut()[3] = f64::NAN;
    let msg = message(scalar_decay::recurrent_forward(&nan).unwrap_err());
    assert!(msg.contains("v[0, 0, 1, 0] = NaN is not finite"), "{msg}");
    let mut inf_scale = x.clone();
    inf_scale.scale = f64::INFINITY;
    assert!(message(scalar_decay::recurrent_forward(&inf_scale).unwrap_err()).contains("scale"));
    let empty = Shape { t: 0, ..SHAPE };
    let err = Inputs::generate(&InputSpec {
        shape: empty,
        ..spec(Family::Gla, Regime::Typical)
    });
    assert_eq!(
        err.unwrap_err(),
        ReferenceError::ZeroDimension { name: "T" }
    );
}

#[test]
fn bad_chunk_sizes_are_rejected() {
    let x = generate(Family::ScalarDecay, Regime::Typical);
    let msg = message(scalar_decay::chunkwise_forward(&x, 0).unwrap_err());
    assert!(
        msg.starts_with("chunk = 0; chunk sizes must be at least 1"),
        "{msg}"
    );
    assert!(scalar_decay::backward(&x, 0, &x.v, None).is_err());
    let v = generate(Family::Gla, Regime::Typical);
    let err = gla::chunkwise_forward(&v, 16, 0).unwrap_err();
    assert_eq!(
        err,
        ReferenceError::ZeroChunk {
            parameter: "sub_chunk"
        }
    );
    let err = lasp2::forward(&v, Decay::Vector { sub_chunk: 0 }, &[16], 4).unwrap_err();
    assert_eq!(
        err,
        ReferenceError::ZeroChunk {
            parameter: "sub_chunk"
        }
    );
    let d = generate(Family::DeltaRule, Regime::Typical);
    assert!(delta_rule::chunkwise_forward(&d, 0).is_err());
    assert!(lasp2::delta_backward(&d, &[16], 0, &d.v, None).is_err());
}

#[test]
fn bad_shard_lengths_are_rejected() {
    let x = generate(Family::ScalarDecay, Regime::Typical);
    let err = lasp2::forward(&x, Decay::Scalar, &[5, 11, 0], 4).unwrap_err();
    assert_eq!(err, ReferenceError::ZeroLengthShard { rank: 2 });
    assert!(message(err).contains("shard 2 has length 0"));
    let err = lasp2::forward(&x, Decay::Scalar, &[5, 10], 4).unwrap_err();
    assert_eq!(
        message(err),
        "shard lengths sum to 15 but the sequence has T = 16 tokens; they must sum to T"
    );
    assert_eq!(
        lasp2::forward(&x, Decay::Scalar, &[], 4).unwrap_err(),
        ReferenceError::NoShards
    );
    let d = generate(Family::DeltaRule, Regime::Typical);
    assert!(matches!(
        lasp2::delta_backward(&d, &[0, 16], 4, &d.v, None),
        Err(ReferenceError::ZeroLengthShard { rank: 0 })
    ));
    assert!(lasp2::split_time(&x.q, &[8, 9]).is_err());
    // The folds check what they are given, e.g. device intermediates converted to f64.
    let fwd = lasp2::forward(&x, Decay::Scalar, &[8, 8], 4).unwrap();
    let err = lasp2::fold_suffixes(&fwd.summaries, &[Tensor::zeros(&SHAPE.state())], None);
    assert!(message(err.unwrap_err()).contains("d_m has 1 entries but there are 2 ranks"));
    assert_eq!(
        lasp2::fold_prefixes(&[], None).unwrap_err(),
        ReferenceError::NoShards
    );
    let mut bad = fwd.summaries.clone();
    bad[1].lambda = Tensor::zeros(&[1, 2, 3]);
    assert!(message(lasp2::fold_prefix(&bad, None).unwrap_err()).contains("Lambda_w has shape"));
}
