//! Chunkwise forms against the token-by-token definition, for all three families.
//!
//! Tolerance: both sides are f64 evaluations of the same sums in different orders. Every output
//! is a sum of at most T * Dk products with relative rounding ~1e-16 each, T * Dk <= 37 * 5, so
//! the expected norm-wise relative difference is ~1e-14; 1e-12 leaves 100x headroom yet catches
//! any real formula slip (a wrong decay exponent or a dropped term gives >= 1e-3).
//!
//! The chunkwise backward takes its gate gradient from the token-by-token sweep (the straddling
//! pairs, `reference::recurrent`): the chunkwise rule `sum_{u >= t} (q_u . dq_u - k_u . dk_u)`
//! sums terms that cancel under strong decay (a = -30 gives ||dg|| ~ 1e-12 from O(1) terms) and
//! keeps only their accuracy. So dg is not compared here; reference_gradients.rs checks it against
//! finite differences.

mod common;

use common::{check, check_forward, check_grads_but_dg, generate, prefix_state, SHAPE, TOL};
use lasp_shmem::reference::{
    assert_rel_close, delta_rule, gla, lasp2, scalar_decay, Cotangents, Family, Regime,
};

#[test]
fn scalar_decay_chunkwise_matches_recurrent() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let inputs = generate(Family::ScalarDecay, regime, seed as u64);
        let want = scalar_decay::recurrent_forward(&inputs).unwrap();
        // 1 (every token its own chunk), divisors and non-divisors of T, and a chunk > T.
        for chunk in [1, 3, 7, 16, 64] {
            let got = scalar_decay::chunkwise_forward(&inputs, chunk).unwrap();
            let tag = format!("{regime:?} chunk {chunk}");
            check_forward(&tag, &got.o, &got.final_state, &want);
        }
    }
}

#[test]
fn gla_chunkwise_with_secondary_chunking_matches_recurrent() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let inputs = generate(Family::Gla, regime, 10 + seed as u64);
        let want = gla::recurrent_forward(&inputs).unwrap();
        // Sub-chunks that divide the chunk, that do not, equal to it, and larger than it.
        for (chunk, sub) in [
            (1, 1),
            (8, 3),
            (16, 4),
            (16, 16),
            (7, 100),
            (64, 16),
            (10, 1),
        ] {
            let got = gla::chunkwise_forward(&inputs, chunk, sub).unwrap();
            let tag = format!("{regime:?} chunk {chunk} sub {sub}");
            check_forward(&tag, &got.o, &got.final_state, &want);
        }
    }
}

#[test]
fn delta_rule_chunkwise_matches_recurrent() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let inputs = generate(Family::DeltaRule, regime, 20 + seed as u64);
        let want = delta_rule::recurrent_forward(&inputs).unwrap();
        for chunk in [1, 5, 16, 64] {
            let got = delta_rule::chunkwise_forward(&inputs, chunk).unwrap();
            let tag = format!("{regime:?} chunk {chunk}");
            check_forward(&tag, &got.o, &got.final_state, &want);
        }
    }
}

/// The chunkwise backward against the token-by-token reverse mode: two independent derivations of
/// dq, dk, dv and dh0 (both take dg from `<dS_t, e^{a_t} S_{t-1}>`).
#[test]
fn chunkwise_backward_matches_recurrent_backward() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let cot = Cotangents::generate(SHAPE, 100 + seed as u64, true, false).unwrap();
        let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
        let scalar = generate(Family::ScalarDecay, regime, 30 + seed as u64);
        let want = scalar_decay::recurrent_backward(&scalar, d_o, d_ht).unwrap();
        let vector = generate(Family::Gla, regime, 40 + seed as u64);
        let want_gla = gla::recurrent_backward(&vector, d_o, d_ht).unwrap();
        for chunk in [1, 6, 16, 64] {
            let got = scalar_decay::backward(&scalar, chunk, d_o, d_ht).unwrap();
            let got_gla = gla::backward(&vector, chunk, 4, d_o, d_ht).unwrap();
            let cases = [("scalar", &got, &want), ("gla", &got_gla, &want_gla)];
            for (family, got, want) in cases {
                let tag = format!("{family} {regime:?} chunk {chunk}");
                check_grads_but_dg(&tag, got, want);
                assert!(got.dbeta.is_none(), "{tag}: only the delta rule has dbeta");
            }
        }
    }
}

/// The delta rule's affine summary: `A h0 + h` (summary from a zero state) is the final state
/// reached from h0.
#[test]
fn delta_rule_affine_summary_maps_initial_state_to_final_state() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let inputs = generate(Family::DeltaRule, regime, 50 + seed as u64);
        let want = delta_rule::recurrent_forward(&inputs).unwrap().final_state;
        for chunk in [1, 5, 64] {
            let summary = lasp2::local_affine(&inputs, chunk).unwrap();
            let folded = lasp2::fold_affine_prefixes(&[summary], inputs.h0.as_ref())
                .unwrap()
                .pop()
                .unwrap();
            check(
                &format!("{regime:?} chunk {chunk}: A h0 + h"),
                &folded,
                &want,
            );
        }
    }
}

/// Entry n of `chunk_states` is the recurrent state after the first `n * chunk` tokens (from h0).
#[test]
fn chunk_states_are_the_recurrent_states_at_chunk_starts() {
    let chunk = 8;
    let n_chunks = SHAPE.t.div_ceil(chunk);
    for family in [Family::ScalarDecay, Family::Gla, Family::DeltaRule] {
        let inputs = generate(family, Regime::Mixed, 60);
        let states = match family {
            Family::ScalarDecay => scalar_decay::chunk_states(&inputs, chunk),
            Family::Gla => gla::chunk_states(&inputs, chunk),
            Family::DeltaRule => delta_rule::chunk_states(&inputs, chunk),
        }
        .unwrap();
        let s = SHAPE;
        assert_eq!(states.shape(), &[s.b, n_chunks, s.h, s.dk, s.dv]);
        for c in 0..n_chunks {
            let want = if c == 0 {
                inputs.h0.clone().unwrap()
            } else {
                prefix_state(family, &inputs, c * chunk)
            };
            let mut got = Vec::new();
            for b in 0..s.b {
                for h in 0..s.h {
                    for i in 0..s.dk {
                        for j in 0..s.dv {
                            got.push(states.get(&[b, c, h, i, j]));
                        }
                    }
                }
            }
            assert_rel_close(&format!("{family:?} h[{c}]"), &got, want.data(), TOL).unwrap();
        }
    }
}
