//! Packed documents (`cu_seqlens`) for scalar and vector gates: the packed token-by-token
//! reference against each document run on its own through the unpacked reference, its gradients
//! against finite differences, its LASP-2 decomposition against it for W = 2, 3, 4 with documents
//! and shards cut every way that matters, and the rejection of malformed `cu_seqlens`. For the
//! delta rule (Gated DeltaNet) and the mLSTM, the packed LASP-2 forward and backward against each
//! document run on its own.
//!
//! Tolerance 1e-10 relative: both sides are f64 and differ only in summation order (chunkwise
//! local passes against the token-by-token sweep, shard cuts moving chunk boundaries), ~1e-14;
//! the finite differences use reference_gradients.rs's step and bounds.

use lasp_shmem::reference::lasp2::{self, Carry, Decay};
use lasp_shmem::reference::mlstm::{
    self, MlstmGradient, MlstmInputs, MlstmPackedInputs, MlstmRegime, MlstmSpec,
};
use lasp_shmem::reference::packed::{self, PackedInputs};
use lasp_shmem::reference::{
    assert_close_to_scale, assert_rel_close, delta_rule, gla, rel_err, scalar_decay, Cotangents,
    Family, Forward, GateKind, Grads, InputSpec, Inputs, ReferenceError, Regime, Shape, SplitMix64,
    Tensor,
};

const TOL: f64 = 1e-10;

/// Selects the input tensor a finite difference perturbs.
type Pick = fn(&mut PackedInputs) -> &mut Tensor;
const CHUNK: usize = 16;
const SUB_CHUNK: usize = 5;

/// Documents of 65, 1, 63, 64, 1, 40 and 30 tokens: T = 264.
const CU_SEQLENS: [usize; 8] = [0, 65, 66, 129, 193, 194, 234, 264];

/// Shard lengths, each summing to T = 264, and what each set exercises.
const SHARDS: [&[usize]; 5] = [
    // Doc [66, 129) ends exactly on the boundary and doc [129, 193) starts on it.
    &[129, 135],
    // Both boundaries mid-document.
    &[100, 164],
    // Doc [0, 65) is exactly shard 0; shard 1 opens with a 1-token doc and ends mid-document.
    &[65, 100, 99],
    // Doc [66, 129) spans three shards; shard 1 holds no document start (it only carries).
    &[70, 30, 50, 114],
    // 1-token shards: the last token of doc 0, then the 1-token doc [65, 66) as a whole shard.
    &[64, 1, 1, 198],
];

fn shape(t: usize) -> Shape {
    Shape {
        b: 2,
        t,
        h: 2,
        dk: 5,
        dv: 4,
    }
}

fn family(gates: GateKind) -> Family {
    match gates {
        GateKind::Scalar => Family::ScalarDecay,
        GateKind::Vector => Family::Gla,
    }
}

/// A tensor of standard normals (per-document states and their cotangents).
fn normal(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = SplitMix64::new(seed);
    let data = (0..shape.iter().product()).map(|_| rng.normal()).collect();
    Tensor::from_vec(shape, data).unwrap()
}

/// Packed inputs over `cu_seqlens` with a random initial state per document, and cotangents with
/// a random final-state gradient per document.
fn generate(
    gates: GateKind,
    regime: Regime,
    cu_seqlens: &[usize],
    seed: u64,
) -> (PackedInputs, Tensor, Tensor) {
    let shape = shape(*cu_seqlens.last().unwrap());
    let spec = InputSpec {
        shape,
        family: family(gates),
        regime,
        seed,
        round_to_bf16: false,
        initial_state: false,
    };
    let inputs = Inputs::generate(&spec).unwrap();
    let mut packed = PackedInputs {
        inputs,
        cu_seqlens: cu_seqlens.to_vec(),
        h0: None,
    };
    let states = packed.document_states_shape();
    packed.h0 = Some(normal(&states, seed + 100));
    let d_o = Cotangents::generate(shape, seed + 200, false, false)
        .unwrap()
        .d_o;
    (packed, d_o, normal(&states, seed + 300))
}

fn check(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    assert_rel_close(what, got.data(), want.data(), TOL).unwrap();
}

fn check_grads(tag: &str, got: &Grads, want: &Grads) {
    check(&format!("{tag}: dq"), &got.dq, &want.dq);
    check(&format!("{tag}: dk"), &got.dk, &want.dk);
    check(&format!("{tag}: dv"), &got.dv, &want.dv);
    check(&format!("{tag}: dg"), &got.dg, &want.dg);
    check(&format!("{tag}: dh0"), &got.dh0, &want.dh0);
}

/// Document n's state `[B, H, Dk, Dv]` of a per-document tensor `[B, N, H, Dk, Dv]` (documents
/// sit on axis 1, as time does in per-token tensors).
fn document(states: &Tensor, n: usize) -> Tensor {
    let s = states.shape();
    let one = states.slice_time(n, 1);
    Tensor::from_vec(&[s[0], s[2], s[3], s[4]], one.data().to_vec()).unwrap()
}

/// Each document as unpacked inputs entered from its own initial state.
fn documents(packed: &PackedInputs, gates: GateKind) -> Vec<Inputs> {
    let lengths: Vec<usize> = packed.cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
    let mut docs = lasp2::split_shards(&packed.inputs, family(gates), &lengths).unwrap();
    for (n, doc) in docs.iter_mut().enumerate() {
        doc.h0 = Some(document(packed.h0.as_ref().unwrap(), n));
    }
    docs
}

fn unpacked_forward(gates: GateKind, doc: &Inputs) -> Forward {
    match gates {
        GateKind::Scalar => scalar_decay::recurrent_forward(doc),
        GateKind::Vector => gla::recurrent_forward(doc),
    }
    .unwrap()
}

fn unpacked_backward(gates: GateKind, doc: &Inputs, d_o: &Tensor, d_ht: &Tensor) -> Grads {
    match gates {
        GateKind::Scalar => scalar_decay::recurrent_backward(doc, d_o, Some(d_ht)),
        GateKind::Vector => gla::recurrent_backward(doc, d_o, Some(d_ht)),
    }
    .unwrap()
}

fn check_against_separate_documents(gates: GateKind) {
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let (packed, d_o, d_ht) = generate(gates, regime, &CU_SEQLENS, 10 + seed as u64);
        let fwd = packed::recurrent_forward(&packed, gates).unwrap();
        let grads = packed::recurrent_backward(&packed, gates, &d_o, Some(&d_ht)).unwrap();
        for (n, doc) in documents(&packed, gates).iter().enumerate() {
            let tag = format!("{gates:?} {regime:?} document {n}");
            let (start, len) = (packed.cu_seqlens[n], doc.shape.t);
            let want = unpacked_forward(gates, doc);
            check(&format!("{tag}: o"), &fwd.o.slice_time(start, len), &want.o);
            let final_state = document(&fwd.final_state, n);
            check(&format!("{tag}: S_n"), &final_state, &want.final_state);
            let d_o_doc = d_o.slice_time(start, len);
            let want = unpacked_backward(gates, doc, &d_o_doc, &document(&d_ht, n));
            let piece = |t: &Tensor| t.slice_time(start, len);
            check(&format!("{tag}: dq"), &piece(&grads.dq), &want.dq);
            check(&format!("{tag}: dk"), &piece(&grads.dk), &want.dk);
            check(&format!("{tag}: dv"), &piece(&grads.dv), &want.dv);
            check(&format!("{tag}: dg"), &piece(&grads.dg), &want.dg);
            check(&format!("{tag}: dh0"), &document(&grads.dh0, n), &want.dh0);
        }
    }
}

#[test]
fn scalar_packed_recurrent_equals_documents_run_separately() {
    check_against_separate_documents(GateKind::Scalar);
}

#[test]
fn vector_packed_recurrent_equals_documents_run_separately() {
    check_against_separate_documents(GateKind::Vector);
}

/// The packed problem cut after its first `len` tokens: the documents before the cut, the last
/// one truncated there.
fn prefix(packed: &PackedInputs, len: usize) -> PackedInputs {
    let mut cu: Vec<usize> = packed
        .cu_seqlens
        .iter()
        .copied()
        .filter(|&c| c < len)
        .collect();
    cu.push(len);
    let inputs = &packed.inputs;
    let slice = |t: &Tensor| t.slice_time(0, len);
    PackedInputs {
        inputs: Inputs {
            shape: Shape {
                t: len,
                ..inputs.shape
            },
            q: slice(&inputs.q),
            k: slice(&inputs.k),
            v: slice(&inputs.v),
            g: slice(&inputs.g),
            beta: None,
            h0: None,
            scale: inputs.scale,
        },
        h0: packed.h0.as_ref().map(|h0| h0.slice_time(0, cu.len() - 1)),
        cu_seqlens: cu,
    }
}

fn check_decomposition(decay: Decay) {
    let gates = match decay {
        Decay::Scalar => GateKind::Scalar,
        Decay::Vector { .. } => GateKind::Vector,
    };
    for (seed, regime) in Regime::ALL.into_iter().enumerate() {
        let (packed, d_o, d_ht) = generate(gates, regime, &CU_SEQLENS, 50 + seed as u64);
        let want = packed::recurrent_forward(&packed, gates).unwrap();
        let want_grads = packed::recurrent_backward(&packed, gates, &d_o, Some(&d_ht)).unwrap();
        for lengths in SHARDS {
            let tag = format!("{gates:?} {regime:?} W={} {lengths:?}", lengths.len());
            let fwd = lasp2::packed_forward(&packed, decay, lengths, CHUNK).unwrap();
            check(&format!("{tag}: o"), &fwd.o, &want.o);
            check(&format!("{tag}: S_n"), &fwd.final_states, &want.final_state);
            let back =
                lasp2::packed_backward(&packed, decay, lengths, CHUNK, &d_o, Some(&d_ht)).unwrap();
            check_grads(&tag, &back.grads, &want_grads);
            check_intermediates(&tag, &packed, gates, lengths, &fwd, &back);
        }
    }
}

/// `sum_t a_t` over all the tokens: `[B, H]` (scalar gates) or `[B, H, Dk]` (vector gates), summed
/// here directly from `g [B, T, H(, Dk)]` rather than through the decomposition's own helper.
fn gate_total(tokens: &Inputs) -> Tensor {
    let g = tokens.g.shape();
    let (steps, per_token) = (g[1], g[2..].iter().product::<usize>());
    let shape: Vec<usize> = [g[0]].into_iter().chain(g[2..].iter().copied()).collect();
    let mut total = Tensor::zeros(&shape);
    for (i, a) in tokens.g.data().iter().enumerate() {
        let (b, within) = (i / (steps * per_token), i % per_token);
        total.data_mut()[b * per_token + within] += a;
    }
    total
}

/// Per rank: the carry forgets exactly when a document starts in the shard; the exchanged `M_w` is
/// the packed state at the shard's end when it does, the shard's state from zero otherwise, and
/// then `Lambda_w` is the shard's gate total (per key dimension for vector gates); `P_w` is the
/// packed state after the token before rank w; `D_{w-1}` is rank w's gradient with respect to
/// `P_w`; each document's final state and `dh0` come from the ranks holding its last and first
/// token.
fn check_intermediates(
    tag: &str,
    packed: &PackedInputs,
    gates: GateKind,
    lengths: &[usize],
    fwd: &lasp2::PackedLasp2Forward,
    back: &lasp2::PackedLasp2Backward,
) {
    let cu = &packed.cu_seqlens;
    let shards = lasp2::split_shards(&packed.inputs, family(gates), lengths).unwrap();
    let mut start = 0;
    for (w, &len) in lengths.iter().enumerate() {
        let end = start + len;
        let starts_inside = cu.iter().any(|&c| c >= start && c < end);
        let summary = &fwd.summaries[w];
        assert_eq!(
            summary.carry == Carry::Forget,
            starts_inside,
            "{tag}: carry of rank {w}"
        );
        let m_tag = format!("{tag}: M_{w}");
        match &summary.carry {
            Carry::Forget => {
                let through = packed::recurrent_forward(&prefix(packed, end), gates).unwrap();
                let n = through.final_state.shape()[1] - 1;
                check(&m_tag, &summary.m, &document(&through.final_state, n));
            }
            Carry::Decay { lambda } => {
                let from_zero = unpacked_forward(gates, &shards[w]);
                check(&m_tag, &summary.m, &from_zero.final_state);
                check(
                    &format!("{tag}: Lambda_{w}"),
                    lambda,
                    &gate_total(&shards[w]),
                );
            }
        }
        if w > 0 {
            let before = packed::recurrent_forward(&prefix(packed, start), gates).unwrap();
            let n = before.final_state.shape()[1] - 1;
            let want = document(&before.final_state, n);
            check(&format!("{tag}: P_{w}"), &fwd.prefixes[w], &want);
            let d = &back.suffixes[w - 1];
            check(
                &format!("{tag}: D_{} vs dL/dP_{w}", w - 1),
                d,
                &back.ranks[w].grads.dh0,
            );
        }
        let held = |range: &dyn Fn(usize) -> usize| -> Vec<usize> {
            (0..cu.len() - 1)
                .filter(|&n| (start..end).contains(&range(n)))
                .collect()
        };
        let finals: Vec<usize> = fwd.ranks[w].final_states.iter().map(|x| x.0).collect();
        assert_eq!(
            finals,
            held(&|n| cu[n + 1] - 1),
            "{tag}: finals on rank {w}"
        );
        for (n, state) in &fwd.ranks[w].final_states {
            check(
                &format!("{tag}: S_{n} on rank {w}"),
                state,
                &document(&fwd.final_states, *n),
            );
        }
        let firsts: Vec<usize> = back.ranks[w].dh0.iter().map(|x| x.0).collect();
        assert_eq!(firsts, held(&|n| cu[n]), "{tag}: dh0 on rank {w}");
        for (n, dh0) in &back.ranks[w].dh0 {
            check(
                &format!("{tag}: dh0_{n} on rank {w}"),
                dh0,
                &document(&back.grads.dh0, *n),
            );
        }
        start = end;
    }
}

#[test]
fn scalar_packed_decomposition_equals_packed_sequence() {
    check_decomposition(Decay::Scalar);
}

#[test]
fn vector_packed_decomposition_equals_packed_sequence() {
    check_decomposition(Decay::Vector {
        sub_chunk: SUB_CHUNK,
    });
}

/// Central finite differences of `L = sum(o * d_o) + sum_n <S_n, d_ht_n>` on a tiny packed
/// problem, for q, k, v, g and the per-document h0 (bounds as in reference_gradients.rs; the
/// forward rejects a positive gate, so this passing shows no step crossed 0).
/// Gated DeltaNet over the same documents and shard sets: the packed LASP-2 forward against each
/// document run on its own through the unpacked token-by-token recurrence (outputs and every
/// document's final state), its carries (`A_w = 0` exactly where a document starts in the shard,
/// the shard's transition elsewhere), and the packed backward's every gradient against each
/// document's own reverse sweep.
#[test]
fn delta_packed_decomposition_equals_documents_run_separately() {
    let t = *CU_SEQLENS.last().unwrap();
    let spec = InputSpec {
        shape: shape(t),
        family: Family::DeltaRule,
        regime: Regime::Typical,
        seed: 41,
        round_to_bf16: false,
        initial_state: false,
    };
    let mut packed = PackedInputs {
        inputs: Inputs::generate(&spec).unwrap(),
        cu_seqlens: CU_SEQLENS.to_vec(),
        h0: None,
    };
    packed.h0 = Some(normal(&packed.document_states_shape(), 141));
    let lengths: Vec<usize> = CU_SEQLENS.windows(2).map(|w| w[1] - w[0]).collect();
    let docs = lasp2::split_shards(&packed.inputs, Family::DeltaRule, &lengths).unwrap();
    let separate: Vec<Forward> = docs
        .into_iter()
        .enumerate()
        .map(|(n, doc)| {
            let doc = Inputs {
                h0: Some(document(packed.h0.as_ref().unwrap(), n)),
                ..doc
            };
            delta_rule::recurrent_forward(&doc).unwrap()
        })
        .collect();
    let want_o = Tensor::concat_time(&separate.iter().map(|f| f.o.clone()).collect::<Vec<_>>());
    let mut transitions = 0;
    for shards in SHARDS {
        let tag = format!("delta rule, shards {shards:?}");
        let got = lasp2::packed_delta_forward(&packed, shards, CHUNK).unwrap();
        check(&format!("{tag}: o"), &got.o, &want_o);
        for (n, doc) in separate.iter().enumerate() {
            let end = document(&got.final_states, n);
            check(&format!("{tag}: final state {n}"), &end, &doc.final_state);
        }
        let mut start = 0;
        for (w, (&len, summary)) in shards.iter().zip(&got.summaries).enumerate() {
            let holds_start = CU_SEQLENS[..lengths.len()]
                .iter()
                .any(|&c| (start..start + len).contains(&c));
            let forgets = summary.carry == lasp2::AffineCarry::Forget;
            assert_eq!(forgets, holds_start, "{tag}: rank {w}'s carry");
            start += len;
        }
        transitions += got
            .summaries
            .iter()
            .filter(|s| s.carry != lasp2::AffineCarry::Forget)
            .count();
    }
    // A shard inside one document (70..100 of the fourth set) carries its entering state by its
    // transition: the fold's matrix branch is exercised, not only the forgetting one.
    assert!(transitions > 0);

    // The backward: every gradient against each document's own reverse sweep with its d_ht.
    let d_o = Cotangents::generate(shape(t), 241, false, false)
        .unwrap()
        .d_o;
    let d_ht = normal(&packed.document_states_shape(), 341);
    let separate: Vec<Grads> = lasp2::split_shards(&packed.inputs, Family::DeltaRule, &lengths)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(n, doc)| {
            let (start, len) = (CU_SEQLENS[n], lengths[n]);
            let doc = Inputs {
                h0: Some(document(packed.h0.as_ref().unwrap(), n)),
                ..doc
            };
            let d_ht_n = document(&d_ht, n);
            delta_rule::recurrent_backward(&doc, &d_o.slice_time(start, len), Some(&d_ht_n))
                .unwrap()
        })
        .collect();
    let cat = |f: fn(&Grads) -> &Tensor| {
        Tensor::concat_time(&separate.iter().map(|g| f(g).clone()).collect::<Vec<_>>())
    };
    for shards in SHARDS {
        let tag = format!("delta rule backward, shards {shards:?}");
        let got = lasp2::packed_delta_backward(&packed, shards, CHUNK, &d_o, Some(&d_ht))
            .unwrap()
            .grads;
        check(&format!("{tag}: dq"), &got.dq, &cat(|g| &g.dq));
        check(&format!("{tag}: dk"), &got.dk, &cat(|g| &g.dk));
        check(&format!("{tag}: dv"), &got.dv, &cat(|g| &g.dv));
        check(&format!("{tag}: dg"), &got.dg, &cat(|g| &g.dg));
        check(
            &format!("{tag}: dbeta"),
            got.dbeta.as_ref().unwrap(),
            &cat(|g| g.dbeta.as_ref().unwrap()),
        );
        for (n, doc) in separate.iter().enumerate() {
            check(&format!("{tag}: dh0 {n}"), &document(&got.dh0, n), &doc.dh0);
        }
    }
}

/// The mLSTM over the same documents and shard sets: the packed LASP-2 forward (chunkwise runs,
/// the stabilised fold) against the stabilised recurrence run document by document, with and
/// without per-document initial states, typical gates and input gates of hundreds (the
/// stabiliser jumps at every document start); its carries (forgetting exactly where a document
/// starts in the shard); and the packed backward's full gradient against each document's own
/// reverse sweep.
#[test]
fn mlstm_packed_decomposition_equals_documents_run_separately() {
    let t = *CU_SEQLENS.last().unwrap();
    let documents = CU_SEQLENS.len() - 1;
    let mut transitions = 0;
    for (regime, with_states) in [
        (MlstmRegime::Typical, true),
        (MlstmRegime::LargeInputGate, false),
    ] {
        let spec = MlstmSpec {
            shape: shape(t),
            regime,
            seed: 43,
            round_to_bf16: false,
            initial_state: false,
        };
        let states = with_states.then(|| {
            (0..documents)
                .map(|n| {
                    let per_doc = MlstmSpec {
                        initial_state: true,
                        seed: 500 + n as u64,
                        ..spec
                    };
                    MlstmInputs::generate(&per_doc)
                        .unwrap()
                        .initial_state
                        .unwrap()
                })
                .collect()
        });
        let packed = MlstmPackedInputs {
            inputs: MlstmInputs::generate(&spec).unwrap(),
            cu_seqlens: CU_SEQLENS.to_vec(),
            initial_states: states,
        };
        let want = mlstm::packed_recurrent_forward(&packed).unwrap();
        for shards in SHARDS {
            let tag = format!("mLSTM {regime:?}, shards {shards:?}");
            let got = mlstm::packed_lasp2_forward(&packed, shards, CHUNK).unwrap();
            check(&format!("{tag}: h"), &got.h, &want.h);
            for (n, (got, want)) in got.final_states.iter().zip(&want.final_states).enumerate() {
                check(&format!("{tag}: C of document {n}"), &got.c, &want.c);
                check(&format!("{tag}: n of document {n}"), &got.n, &want.n);
                check(&format!("{tag}: m of document {n}"), &got.m, &want.m);
            }
            let mut start = 0;
            for (w, (&len, summary)) in shards.iter().zip(&got.summaries).enumerate() {
                let holds_start = CU_SEQLENS[..documents]
                    .iter()
                    .any(|&c| (start..start + len).contains(&c));
                let forgets = summary.carry == mlstm::MlstmCarry::Forget;
                assert_eq!(forgets, holds_start, "{tag}: rank {w}'s carry");
                transitions += usize::from(!forgets);
                start += len;
            }
        }
    }
    assert!(transitions > 0);
    // The backward (full gradient) against each document's own reverse sweep.
    let spec = MlstmSpec {
        shape: shape(t),
        regime: MlstmRegime::Typical,
        seed: 53,
        round_to_bf16: false,
        initial_state: false,
    };
    let state = |seed: u64| {
        let with_state = MlstmSpec {
            initial_state: true,
            seed,
            ..spec
        };
        MlstmInputs::generate(&with_state)
            .unwrap()
            .initial_state
            .unwrap()
    };
    let packed = MlstmPackedInputs {
        inputs: MlstmInputs::generate(&spec).unwrap(),
        cu_seqlens: CU_SEQLENS.to_vec(),
        initial_states: Some((0..documents).map(|n| state(600 + n as u64)).collect()),
    };
    let d_h = normal(&shape(t).v(), 653);
    let d_finals: Vec<_> = (0..documents).map(|n| state(700 + n as u64)).collect();
    // Each document's own reverse sweep.
    let separate =
        mlstm::packed_recurrent_backward(&packed, &d_h, Some(&d_finals), MlstmGradient::Full)
            .unwrap();
    let want = &separate.grads;
    // The gate gradients cancel terms of their scale (reference_mlstm.rs, GRAD_TOL); the
    // documents' scale is below the whole sequence's (their suffix sums stop at their ends).
    let gate_scale = separate.gate_scale;
    assert!(gate_scale > 0.0 && gate_scale < want.gate_grad_scale(&packed.inputs));
    for shards in SHARDS {
        let tag = format!("mLSTM backward, shards {shards:?}");
        let got =
            mlstm::packed_lasp2_backward(&packed, shards, CHUNK, &d_h, Some(&d_finals)).unwrap();
        for (name, got, want) in [
            ("dq", &got.grads.dq, &want.dq),
            ("dk", &got.grads.dk, &want.dk),
            ("dv", &got.grads.dv, &want.dv),
        ] {
            assert_rel_close(&format!("{tag}: {name}"), got.data(), want.data(), 1e-9).unwrap();
        }
        for (name, got, want) in [
            ("d_input_gate", &got.grads.d_input_gate, &want.d_input_gate),
            (
                "d_forget_gate",
                &got.grads.d_forget_gate,
                &want.d_forget_gate,
            ),
        ] {
            let what = format!("{tag}: {name}");
            assert_close_to_scale(&what, got.data(), want.data(), gate_scale, 1e-9).unwrap();
        }
        for (n, (got, want)) in got
            .d_initial_states
            .iter()
            .zip(&separate.d_initial_states)
            .enumerate()
        {
            let what = |x: &str| format!("{tag}: document {n}: {x}");
            assert_rel_close(&what("dC_0"), got.c.data(), want.c.data(), 1e-9).unwrap();
            assert_rel_close(&what("dn_0"), got.n.data(), want.n.data(), 1e-9).unwrap();
            assert_close_to_scale(&what("dm_0"), got.m.data(), want.m.data(), gate_scale, 1e-9)
                .unwrap();
        }
    }
    // One document's hidden states against the unpacked recurrence directly.
    let spec = MlstmSpec {
        shape: shape(t),
        regime: MlstmRegime::Typical,
        seed: 47,
        round_to_bf16: false,
        initial_state: false,
    };
    let inputs = MlstmInputs::generate(&spec).unwrap();
    let packed = MlstmPackedInputs {
        inputs: inputs.clone(),
        cu_seqlens: vec![0, t],
        initial_states: None,
    };
    let whole = mlstm::recurrent_forward(&inputs).unwrap();
    check(
        "mLSTM one document: h",
        &mlstm::packed_recurrent_forward(&packed).unwrap().h,
        &whole.h,
    );
}

#[test]
fn packed_gradients_match_finite_differences() {
    const STEP: f64 = 1e-5;
    const REL_TOL: f64 = 1e-6;
    let cu = [0, 1, 4, 5, 9];
    for gates in [GateKind::Scalar, GateKind::Vector] {
        let (packed, d_o, d_ht) = generate(gates, Regime::Typical, &cu, 7);
        let grads = packed::recurrent_backward(&packed, gates, &d_o, Some(&d_ht)).unwrap();
        let loss = |p: &PackedInputs| {
            packed::recurrent_forward(p, gates)
                .unwrap()
                .loss(&d_o, Some(&d_ht))
        };
        let picks: [(&str, Pick, &Tensor); 5] = [
            ("dq", |p| &mut p.inputs.q, &grads.dq),
            ("dk", |p| &mut p.inputs.k, &grads.dk),
            ("dv", |p| &mut p.inputs.v, &grads.dv),
            ("dg", |p| &mut p.inputs.g, &grads.dg),
            ("dh0", |p| p.h0.as_mut().unwrap(), &grads.dh0),
        ];
        for (what, pick, analytic) in picks {
            let mut x = packed.clone();
            let numeric: Vec<f64> = (0..analytic.len())
                .map(|i| {
                    let original = pick(&mut x).data()[i];
                    pick(&mut x).data_mut()[i] = original + STEP;
                    let up = loss(&x);
                    pick(&mut x).data_mut()[i] = original - STEP;
                    let down = loss(&x);
                    pick(&mut x).data_mut()[i] = original;
                    (up - down) / (2.0 * STEP)
                })
                .collect();
            let err = rel_err(analytic.data(), &numeric);
            assert!(err <= REL_TOL, "{gates:?} {what}: relative error {err:.3e}");
        }
    }
}

#[test]
fn malformed_cu_seqlens_are_rejected() {
    let (good, _, _) = generate(GateKind::Scalar, Regime::Typical, &[0, 3, 9], 1);
    let with = |cu: &[usize]| PackedInputs {
        cu_seqlens: cu.to_vec(),
        h0: None,
        ..good.clone()
    };
    let cases: [(&[usize], ReferenceError); 5] = [
        (&[], ReferenceError::CuSeqlensTooShort { len: 0 }),
        (&[0], ReferenceError::CuSeqlensTooShort { len: 1 }),
        (&[1, 9], ReferenceError::CuSeqlensFirst { first: 1 }),
        (&[0, 3, 8], ReferenceError::CuSeqlensLast { last: 8, t: 9 }),
        (
            &[0, 3, 3, 9],
            ReferenceError::CuSeqlensNotIncreasing {
                index: 2,
                previous: 3,
                value: 3,
            },
        ),
    ];
    for (cu, want) in cases {
        let got = packed::recurrent_forward(&with(cu), GateKind::Scalar).unwrap_err();
        assert_eq!(got, want, "cu_seqlens {cu:?}");
        let got = lasp2::packed_forward(&with(cu), Decay::Scalar, &[4, 5], CHUNK).unwrap_err();
        assert_eq!(got, want, "cu_seqlens {cu:?} (LASP-2)");
    }
    let mut unpacked_h0 = good.clone();
    unpacked_h0.inputs.h0 = Some(Tensor::zeros(&good.inputs.shape.state()));
    assert_eq!(
        packed::recurrent_forward(&unpacked_h0, GateKind::Scalar).unwrap_err(),
        ReferenceError::InitialStateNotPerDocument
    );
    let mut wrong_h0 = good.clone();
    wrong_h0.h0 = Some(Tensor::zeros(&good.inputs.shape.state()));
    assert!(matches!(
        packed::recurrent_forward(&wrong_h0, GateKind::Scalar).unwrap_err(),
        ReferenceError::ShapeMismatch { tensor: "h0", .. }
    ));
}

/// The mLSTM's normaliser conditioning over packed documents: each document's rows are those of
/// the document run alone from the zero state.
#[test]
fn mlstm_packed_conditioning_is_each_documents_own() {
    let t = *CU_SEQLENS.last().unwrap();
    let inputs = MlstmInputs::generate(&MlstmSpec {
        shape: shape(t),
        regime: MlstmRegime::LargeInputGate,
        seed: 44,
        round_to_bf16: false,
        initial_state: false,
    })
    .unwrap();
    let packed = MlstmPackedInputs {
        inputs: inputs.clone(),
        cu_seqlens: CU_SEQLENS.to_vec(),
        initial_states: None,
    };
    let got = mlstm::packed_normaliser_conditioning(&packed).unwrap();
    for doc in CU_SEQLENS.windows(2) {
        let (first, len) = (doc[0], doc[1] - doc[0]);
        let alone = MlstmInputs {
            shape: shape(len),
            q: inputs.q.slice_time(first, len),
            k: inputs.k.slice_time(first, len),
            v: inputs.v.slice_time(first, len),
            input_gate: inputs.input_gate.slice_time(first, len),
            forget_gate: inputs.forget_gate.slice_time(first, len),
            ..inputs.clone()
        };
        let want = mlstm::normaliser_conditioning(&alone).unwrap();
        assert_eq!(got.slice_time(first, len), want, "document at {first}");
    }
}
