//! The short causal convolution (`reference::short_conv`): fla's weight order pinned on one-hot
//! kernels, the backward against central finite differences (halo included), the sharded
//! forward and backward against the unsharded ones for W = 2, 3, 4 with ragged shards, some
//! shorter than the halo, the packed-documents variant against per-document runs, and the
//! rejection of malformed inputs.
//!
//! Tolerances: sharded and packed against unsharded differ only in summation order, so 1e-12
//! relative; finite differences of step 1e-5 on a smooth loss agree to ~1e-9, checked at 1e-7.

use lasp_shmem::reference::short_conv::{self, sharded, Activation, ConvGrads, ShortConv};
use lasp_shmem::reference::{assert_rel_close, ReferenceError, SplitMix64, Tensor};

const TOL: f64 = 1e-12;
const FD_TOL: f64 = 1e-7;
const FD_STEP: f64 = 1e-5;
const B: usize = 2;
const T: usize = 13;
const C: usize = 3;
const K: usize = 4;

fn random(shape: &[usize], rng: &mut SplitMix64) -> Tensor {
    let data = (0..shape.iter().product()).map(|_| rng.normal()).collect();
    Tensor::from_vec(shape, data).unwrap()
}

fn conv(activation: Activation, bias: bool, rng: &mut SplitMix64) -> ShortConv {
    ShortConv {
        weight: random(&[C, K], rng),
        bias: bias.then(|| random(&[C], rng)),
        activation,
    }
}

/// Every combination of activation and bias.
fn convs(rng: &mut SplitMix64) -> Vec<ShortConv> {
    [Activation::Identity, Activation::Silu]
        .into_iter()
        .flat_map(|act| [false, true].map(|bias| (act, bias)))
        .map(|(act, bias)| conv(act, bias, rng))
        .collect()
}

fn loss(y: &Tensor, d_y: &Tensor) -> f64 {
    y.data().iter().zip(d_y.data()).map(|(a, b)| a * b).sum()
}

fn check(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    assert_rel_close(what, got.data(), want.data(), tol).unwrap();
}

fn check_grads(tag: &str, got: &ConvGrads, want: &ConvGrads) {
    check(&format!("{tag}: dx"), &got.dx, &want.dx, TOL);
    check(
        &format!("{tag}: d_weight"),
        &got.d_weight,
        &want.d_weight,
        TOL,
    );
    match (&got.d_bias, &want.d_bias) {
        (Some(got), Some(want)) => check(&format!("{tag}: d_bias"), got, want, TOL),
        (None, None) => {}
        _ => panic!("{tag}: d_bias present on one side only"),
    }
}

/// Central differences of `loss` with respect to every entry of `tensor`.
fn finite_differences(tensor: &Tensor, loss: impl Fn(&Tensor) -> f64) -> Tensor {
    let mut grad = Tensor::zeros(tensor.shape());
    for i in 0..tensor.len() {
        let mut plus = tensor.clone();
        plus.data_mut()[i] += FD_STEP;
        let mut minus = tensor.clone();
        minus.data_mut()[i] -= FD_STEP;
        grad.data_mut()[i] = (loss(&plus) - loss(&minus)) / (2.0 * FD_STEP);
    }
    grad
}

fn one_hot_conv(tap: usize) -> ShortConv {
    let mut weight = Tensor::zeros(&[C, K]);
    for c in 0..C {
        weight.data_mut()[c * K + tap] = 1.0;
    }
    ShortConv {
        weight,
        bias: None,
        activation: Activation::Identity,
    }
}

/// fla's order: `weight[:, K-1]` multiplies the current token and `weight[:, i]` the token
/// `K-1-i` steps back, with zeros before token 0.
#[test]
fn weight_index_k_minus_1_is_the_current_token() {
    let x = random(&[B, T, C], &mut SplitMix64::new(1));
    for tap in 0..K {
        let y = short_conv::forward(&one_hot_conv(tap), &x).unwrap();
        let lag = K - 1 - tap;
        for b in 0..B {
            for t in 0..T {
                for c in 0..C {
                    let want = if t >= lag {
                        x.get(&[b, t - lag, c])
                    } else {
                        0.0
                    };
                    assert_eq!(y.get(&[b, t, c]), want, "tap {tap}, [{b}, {t}, {c}]");
                }
            }
        }
    }
}

#[test]
fn silu_is_applied_after_the_bias() {
    let mut rng = SplitMix64::new(2);
    let x = random(&[B, T, C], &mut rng);
    let mut silu = conv(Activation::Silu, true, &mut rng);
    let plain = ShortConv {
        activation: Activation::Identity,
        ..silu.clone()
    };
    let z = short_conv::forward(&plain, &x).unwrap();
    let want = z.map(|z| z / (1.0 + (-z).exp()));
    check("silu", &short_conv::forward(&silu, &x).unwrap(), &want, TOL);
    silu.bias = None;
    assert_ne!(short_conv::forward(&silu, &x).unwrap(), want);
}

#[test]
fn backward_matches_finite_differences() {
    let mut rng = SplitMix64::new(3);
    for conv in convs(&mut rng) {
        let tag = format!("{:?}, bias {}", conv.activation, conv.bias.is_some());
        let x = random(&[B, T, C], &mut rng);
        let d_y = random(&[B, T, C], &mut rng);
        let grads = short_conv::backward(&conv, &x, &d_y).unwrap();

        let dx = finite_differences(&x, |x| loss(&short_conv::forward(&conv, x).unwrap(), &d_y));
        check(&format!("{tag}: dx"), &grads.dx, &dx, FD_TOL);
        let d_weight = finite_differences(&conv.weight, |w| {
            let conv = ShortConv {
                weight: w.clone(),
                ..conv.clone()
            };
            loss(&short_conv::forward(&conv, &x).unwrap(), &d_y)
        });
        check(
            &format!("{tag}: d_weight"),
            &grads.d_weight,
            &d_weight,
            FD_TOL,
        );
        assert_eq!(grads.d_bias.is_some(), conv.bias.is_some(), "{tag}");
        if let (Some(bias), Some(got)) = (&conv.bias, &grads.d_bias) {
            let d_bias = finite_differences(bias, |bias| {
                let conv = ShortConv {
                    bias: Some(bias.clone()),
                    ..conv.clone()
                };
                loss(&short_conv::forward(&conv, &x).unwrap(), &d_y)
            });
            check(&format!("{tag}: d_bias"), got, &d_bias, FD_TOL);
        }
    }
}

/// The halo's gradient, which the sharded backward sends back to earlier ranks, is the gradient
/// with respect to the halo's values.
#[test]
fn halo_gradient_matches_finite_differences() {
    let mut rng = SplitMix64::new(4);
    for conv in convs(&mut rng) {
        let tag = format!("{:?}, bias {}", conv.activation, conv.bias.is_some());
        // Shorter than the halo, so the halo reaches outputs past the first.
        for t in [2, T] {
            let x = random(&[B, t, C], &mut rng);
            let halo = random(&[B, K - 1, C], &mut rng);
            let d_y = random(&[B, t, C], &mut rng);
            let (grads, d_halo) = short_conv::backward_with_halo(&conv, &halo, &x, &d_y).unwrap();
            let want = finite_differences(&halo, |halo| {
                loss(
                    &short_conv::forward_with_halo(&conv, halo, &x).unwrap(),
                    &d_y,
                )
            });
            check(&format!("{tag}, T {t}: d_halo"), &d_halo, &want, FD_TOL);
            let dx = finite_differences(&x, |x| {
                loss(
                    &short_conv::forward_with_halo(&conv, &halo, x).unwrap(),
                    &d_y,
                )
            });
            check(&format!("{tag}, T {t}: dx"), &grads.dx, &dx, FD_TOL);
        }
    }
}

/// Shard lengths summing to T = 13 for W = 2, 3, 4: ragged, 1-token shards, and runs of shards
/// shorter than K - 1 = 3, so a halo spans several earlier ranks or reaches before token 0.
const SHARDS: [&[usize]; 7] = [
    &[6, 7],
    &[1, 12],
    &[12, 1],
    &[2, 1, 10],
    &[5, 1, 7],
    &[1, 1, 1, 10],
    &[4, 2, 1, 6],
];

#[test]
fn sharded_forward_and_backward_equal_unsharded() {
    let mut rng = SplitMix64::new(5);
    for conv in convs(&mut rng) {
        let x = random(&[B, T, C], &mut rng);
        let d_y = random(&[B, T, C], &mut rng);
        let y = short_conv::forward(&conv, &x).unwrap();
        let grads = short_conv::backward(&conv, &x, &d_y).unwrap();
        for lengths in SHARDS {
            let tag = format!(
                "{:?}, bias {}, shards {lengths:?}",
                conv.activation,
                conv.bias.is_some()
            );
            let fwd = sharded::forward(&conv, &x, lengths).unwrap();
            check(&format!("{tag}: y"), &fwd.y, &y, TOL);
            let bwd = sharded::backward(&conv, &x, lengths, &d_y).unwrap();
            check_grads(&tag, &bwd.grads, &grads);
            assert_eq!(bwd.d_halos.len(), lengths.len(), "{tag}");
        }
    }
}

/// Rank w's halo is exactly tokens `start_w - 3 .. start_w`, zero before token 0.
#[test]
fn halos_hold_the_tokens_before_each_shard() {
    let x = random(&[B, T, C], &mut SplitMix64::new(6));
    let conv = one_hot_conv(K - 1);
    for lengths in SHARDS {
        let fwd = sharded::forward(&conv, &x, lengths).unwrap();
        let mut start = 0;
        for (w, halo) in fwd.halos.iter().enumerate() {
            assert_eq!(halo.shape(), &[B, K - 1, C]);
            for b in 0..B {
                for j in 0..K - 1 {
                    for c in 0..C {
                        let want = match (start + j).checked_sub(K - 1) {
                            Some(p) => x.get(&[b, p, c]),
                            None => 0.0,
                        };
                        assert_eq!(halo.get(&[b, j, c]), want, "{lengths:?} rank {w}");
                    }
                }
            }
            start += lengths[w];
        }
    }
}

/// Documents of 5, 1, 2 and 5 tokens: two shorter than the kernel.
const CU_SEQLENS: [usize; 5] = [0, 5, 6, 8, 13];

#[test]
fn packed_documents_do_not_see_each_other() {
    let mut rng = SplitMix64::new(7);
    for conv in convs(&mut rng) {
        let tag = format!("{:?}, bias {}", conv.activation, conv.bias.is_some());
        let x = random(&[B, T, C], &mut rng);
        let d_y = random(&[B, T, C], &mut rng);
        let y = short_conv::packed_forward(&conv, &x, &CU_SEQLENS).unwrap();
        let grads = short_conv::packed_backward(&conv, &x, &CU_SEQLENS, &d_y).unwrap();
        for d in CU_SEQLENS.windows(2) {
            let doc = x.slice_time(d[0], d[1] - d[0]);
            let want = short_conv::forward(&conv, &doc).unwrap();
            check(
                &format!("{tag}, doc {d:?}: y"),
                &y.slice_time(d[0], d[1] - d[0]),
                &want,
                TOL,
            );
        }
        let dx = finite_differences(&x, |x| {
            loss(
                &short_conv::packed_forward(&conv, x, &CU_SEQLENS).unwrap(),
                &d_y,
            )
        });
        check(&format!("{tag}: dx"), &grads.dx, &dx, FD_TOL);
        let d_weight = finite_differences(&conv.weight, |w| {
            let conv = ShortConv {
                weight: w.clone(),
                ..conv.clone()
            };
            loss(
                &short_conv::packed_forward(&conv, &x, &CU_SEQLENS).unwrap(),
                &d_y,
            )
        });
        check(
            &format!("{tag}: d_weight"),
            &grads.d_weight,
            &d_weight,
            FD_TOL,
        );
        if let (Some(got), Some(bias)) = (&grads.d_bias, &conv.bias) {
            let d_bias = finite_differences(bias, |bias| {
                let conv = ShortConv {
                    bias: Some(bias.clone()),
                    ..conv.clone()
                };
                loss(
                    &short_conv::packed_forward(&conv, &x, &CU_SEQLENS).unwrap(),
                    &d_y,
                )
            });
            check(&format!("{tag}: d_bias"), got, &d_bias, FD_TOL);
        }
    }
}

#[test]
fn malformed_inputs_are_rejected() {
    let mut rng = SplitMix64::new(8);
    let good = conv(Activation::Silu, true, &mut rng);
    let x = random(&[B, T, C], &mut rng);
    let d_y = random(&[B, T, C], &mut rng);

    let no_taps = ShortConv {
        weight: Tensor::zeros(&[C, 0]),
        ..good.clone()
    };
    assert_eq!(
        short_conv::forward(&no_taps, &x),
        Err(ReferenceError::ZeroConvDimension { name: "K" })
    );
    let flat_weight = ShortConv {
        weight: Tensor::zeros(&[C * K]),
        ..good.clone()
    };
    assert!(matches!(
        short_conv::forward(&flat_weight, &x),
        Err(ReferenceError::WrongRank {
            tensor: "weight",
            ..
        })
    ));
    let long_bias = ShortConv {
        bias: Some(Tensor::zeros(&[C + 1])),
        ..good.clone()
    };
    assert!(matches!(
        short_conv::forward(&long_bias, &x),
        Err(ReferenceError::ShapeMismatch { tensor: "bias", .. })
    ));
    assert!(matches!(
        short_conv::forward(&good, &Tensor::zeros(&[B, T, C + 1])),
        Err(ReferenceError::ShapeMismatch { tensor: "x", .. })
    ));
    assert_eq!(
        short_conv::forward(&good, &Tensor::zeros(&[B, 0, C])),
        Err(ReferenceError::ZeroConvDimension { name: "T" })
    );
    assert!(matches!(
        short_conv::forward_with_halo(&good, &Tensor::zeros(&[B, K, C]), &x),
        Err(ReferenceError::ShapeMismatch { tensor: "halo", .. })
    ));
    assert!(matches!(
        short_conv::backward(&good, &x, &Tensor::zeros(&[B, T - 1, C])),
        Err(ReferenceError::ShapeMismatch { tensor: "d_y", .. })
    ));
    let mut nan = x.clone();
    nan.data_mut()[4] = f64::NAN;
    assert!(matches!(
        short_conv::forward(&good, &nan),
        Err(ReferenceError::NonFinite { tensor: "x", .. })
    ));
    assert_eq!(
        sharded::forward(&good, &x, &[6, 0, 7]),
        Err(ReferenceError::ZeroLengthShard { rank: 1 })
    );
    assert_eq!(
        sharded::backward(&good, &x, &[6, 6], &d_y),
        Err(ReferenceError::ShardLengthSum { sum: 12, t: T })
    );
    assert_eq!(
        short_conv::packed_forward(&good, &x, &[0, 5, 5, T]),
        Err(ReferenceError::CuSeqlensNotIncreasing {
            index: 2,
            previous: 5,
            value: 5
        })
    );
}
