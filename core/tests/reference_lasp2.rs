//! The W-rank LASP-2 decomposition against the single sequence, for W in {1, 2, 3, 4, 8} with
//! ragged shard lengths that are not multiples of the chunk size (including 1-token shards), for
//! scalar gates, vector gates and the delta rule, forward and backward.
//!
//! Tolerance 1e-12 relative, as for chunkwise vs recurrent (reference_forward.rs): both sides are
//! f64 and differ only in summation order (chunk boundaries move with the shard cuts and the fold
//! adds the prefix in a different order), which costs ~1e-14. That holds for the gate gradients
//! too: both sides sum straddling pairs, which do not cancel.

mod common;

use common::{check, check_forward, check_grads, prefix_state, SHAPE};
use lasp_shmem::reference::lasp2::{self, Decay};
use lasp_shmem::reference::{
    delta_rule, gla, scalar_decay, Cotangents, Family, InputSpec, Inputs, Regime, Tensor,
};

/// Chunk size of every local pass; no shard length below is a multiple of it except by accident.
const CHUNK: usize = 4;
const SUB_CHUNK: usize = 3;

/// Ragged shard lengths summing to T = 37, one set per W in {1, 2, 3, 4, 8}.
const SHARDS: [&[usize]; 5] = [
    &[37],
    &[13, 24],
    &[7, 13, 17],
    &[7, 13, 1, 16],
    &[7, 13, 1, 5, 2, 3, 4, 2],
];

/// Inputs with an initial state, and cotangents with a final-state one.
fn generate(family: Family, regime: Regime, seed: u64) -> (Inputs, Cotangents) {
    (
        common::generate(family, regime, seed),
        Cotangents::generate(SHAPE, seed + 500, true, false).unwrap(),
    )
}

/// `P_w` is the single sequence's state at rank w's first token, `D_{w-1}` equals rank w's
/// gradient with respect to its incoming state, and the last prefix is the final state.
fn check_intermediates(
    tag: &str,
    family: Family,
    inputs: &Inputs,
    lengths: &[usize],
    prefixes: &[Tensor],
    back: &lasp2::Lasp2Backward,
) {
    assert_eq!(prefixes.len(), lengths.len() + 1);
    assert_eq!(back.d_m.len(), lengths.len());
    assert_eq!(back.suffixes.len(), lengths.len());
    let mut start = 0;
    for (w, len) in lengths.iter().enumerate() {
        if w > 0 {
            let want = prefix_state(family, inputs, start);
            check(&format!("{tag}: P_{w}"), &prefixes[w], &want);
            check(
                &format!("{tag}: D_{} vs rank {w} dh0", w - 1),
                &back.suffixes[w - 1],
                &back.ranks[w].dh0,
            );
        }
        start += len;
    }
}

fn check_decay(decay: Decay) {
    let family = match decay {
        Decay::Scalar => Family::ScalarDecay,
        Decay::Vector { .. } => Family::Gla,
    };
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let (inputs, cot) = generate(family, regime, 300 + seed as u64);
        let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
        let (want, want_grads) = match decay {
            Decay::Scalar => (
                scalar_decay::chunkwise_forward(&inputs, CHUNK).unwrap(),
                scalar_decay::backward(&inputs, CHUNK, d_o, d_ht).unwrap(),
            ),
            Decay::Vector { sub_chunk } => (
                gla::chunkwise_forward(&inputs, CHUNK, sub_chunk).unwrap(),
                gla::backward(&inputs, CHUNK, sub_chunk, d_o, d_ht).unwrap(),
            ),
        };
        for lengths in SHARDS {
            let tag = format!("{family:?} {regime:?} W={} {lengths:?}", lengths.len());
            let fwd = lasp2::forward(&inputs, decay, lengths, CHUNK).unwrap();
            check_forward(&tag, &fwd.o, &fwd.final_state, &want);
            // The fold's public pieces reproduce the prefixes the forward used.
            for w in 0..lengths.len() {
                let p = lasp2::fold_prefix(&fwd.summaries[..=w], inputs.h0.as_ref()).unwrap();
                check(
                    &format!("{tag}: fold_prefix {}", w + 1),
                    &p,
                    &fwd.prefixes[w + 1],
                );
            }
            let shards = lasp2::split_shards(&inputs, family, lengths).unwrap();
            for (w, shard) in shards.iter().enumerate() {
                let summary = lasp2::local_state(shard, decay, CHUNK).unwrap();
                check(&format!("{tag}: M_{w}"), &summary.m, &fwd.summaries[w].m);
                check(
                    &format!("{tag}: Lambda_{w}"),
                    &summary.lambda,
                    &fwd.summaries[w].lambda,
                );
            }
            let back = lasp2::backward(&inputs, decay, lengths, CHUNK, d_o, d_ht).unwrap();
            check_grads(&tag, &back.grads, &want_grads);
            check_intermediates(&tag, family, &inputs, lengths, &fwd.prefixes, &back);
        }
    }
}

#[test]
fn scalar_gates_decomposition_equals_single_sequence() {
    check_decay(Decay::Scalar);
}

#[test]
fn vector_gates_decomposition_equals_single_sequence() {
    check_decay(Decay::Vector {
        sub_chunk: SUB_CHUNK,
    });
}

#[test]
fn delta_rule_decomposition_equals_single_sequence() {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let (inputs, cot) = generate(Family::DeltaRule, regime, 400 + seed as u64);
        let (d_o, d_ht) = (&cot.d_o, cot.d_ht.as_ref());
        let want = delta_rule::chunkwise_forward(&inputs, CHUNK).unwrap();
        let want_grads = delta_rule::recurrent_backward(&inputs, d_o, d_ht).unwrap();
        for lengths in SHARDS {
            let tag = format!("DeltaRule {regime:?} W={} {lengths:?}", lengths.len());
            let fwd = lasp2::delta_forward(&inputs, lengths, CHUNK).unwrap();
            check_forward(&tag, &fwd.o, &fwd.final_state, &want);
            let back = lasp2::delta_backward(&inputs, lengths, CHUNK, d_o, d_ht).unwrap();
            check_grads(&tag, &back.grads, &want_grads);
            check_intermediates(
                &tag,
                Family::DeltaRule,
                &inputs,
                lengths,
                &fwd.prefixes,
                &back,
            );
            let suffixes = lasp2::fold_affine_suffixes(&fwd.summaries, &back.d_m, d_ht).unwrap();
            for (w, d) in suffixes.iter().enumerate() {
                check(&format!("{tag}: D_{w}"), d, &back.suffixes[w]);
            }
        }
    }
}

/// Rank 0's local pass from a zero state is the whole answer when there is no initial state,
/// and every rank's `o_local` is its shard's zero-state chunkwise output.
#[test]
fn local_outputs_are_zero_state_passes() {
    let spec = InputSpec {
        shape: SHAPE,
        family: Family::ScalarDecay,
        regime: Regime::Typical,
        seed: 9,
        round_to_bf16: false,
        initial_state: false,
    };
    let inputs = Inputs::generate(&spec).unwrap();
    let lengths = SHARDS[3];
    let fwd = lasp2::forward(&inputs, Decay::Scalar, lengths, CHUNK).unwrap();
    check("rank 0", &fwd.ranks[0].o, &fwd.ranks[0].o_local);
    let shards = lasp2::split_shards(&inputs, Family::ScalarDecay, lengths).unwrap();
    for (w, shard) in shards.iter().enumerate() {
        let local = scalar_decay::chunkwise_forward(shard, CHUNK).unwrap();
        check(&format!("o_local {w}"), &fwd.ranks[w].o_local, &local.o);
    }
    let pieces = lasp2::split_time(&fwd.o, lengths).unwrap();
    for (w, piece) in pieces.iter().enumerate() {
        check(&format!("split_time {w}"), piece, &fwd.ranks[w].o);
    }
}
