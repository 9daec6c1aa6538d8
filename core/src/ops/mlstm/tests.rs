//! Unit tests of mLSTM's host side: the shared-memory formulas against the header's, the plans
//! and the argument checks.

use super::backward::Offsets;
use super::forward::MlstmArgs;
use super::plan::{output_smem_bytes, states_smem_bytes};
use super::*;
use crate::ops::documents::{DocumentOffsets, Documents};
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef, Scope};

// Views of fake addresses for the argument checks: only measured, never launched.
fn view(addr: u64, len: usize) -> DeviceRef<'static, bf16> {
    // SAFETY: never launched; the checks read the address and the length only.
    unsafe { DeviceRef::from_raw(addr, len) }
}

fn floats(addr: u64, len: usize) -> DeviceRef<'static, f32> {
    // SAFETY: as in `view`.
    unsafe { DeviceRef::from_raw(addr, len) }
}

fn out(addr: u64, len: usize) -> DeviceMut<'static, bf16> {
    // SAFETY: as in `view`.
    unsafe { DeviceMut::from_raw(addr, len) }
}

fn out_f32(addr: u64, len: usize) -> DeviceMut<'static, f32> {
    // SAFETY: as in `view`.
    unsafe { DeviceMut::from_raw(addr, len) }
}

fn shape(b: usize, t: usize, h: usize, dk: usize, dv: usize) -> ForwardShape {
    ForwardShape { b, t, h, dk, dv }
}

#[test]
fn shared_memory_matches_the_header_and_fits_a_block() {
    // bindgen does not export the header's inline functions: their values worked out by hand.
    // Two stages of Q, K (16 KiB each), V (16 KiB at Dv 128) and both gates (512 B), two split
    // state copies (hi and lo, 32 KiB each at Dk = Dv = 128), two copies of n's two parts (one part
    // where a 128-thread CTA has Dk = 128): the most a block may have at Dk = Dv = 128.
    assert_eq!(
        output_smem_bytes(128, 128),
        2 * (3 * 16_384 + 512) + 4 * 32_768 + 2 * 1_024
    );
    assert_eq!(output_smem_bytes(128, 128), 227 * 1024);
    // Where a block has room, a start word per stage (the packed documents' twin lands them).
    assert_eq!(
        output_smem_bytes(64, 64),
        2 * (3 * 8_192 + 512) + 4 * 8_192 + 2 * 512 + 2 * 8
    );
    assert_eq!(
        output_smem_bytes(128, 64),
        2 * (2 * 16_384 + 8_192 + 512) + 4 * 16_384 + 2 * 512 + 2 * 8
    );
    assert_eq!(
        states_smem_bytes(128, 128),
        2 * (2 * 16_384 + 512) + 1_024 + 2 * 8
    );
}

#[test]
fn plans_fill_the_sms_once_and_size_the_workspace() {
    // B=4, H=16, T=8K on 132 SMs at Dv = 128 (one 256-thread CTA per SM): two segments of 64
    // chunks, the states pass of segment 0 in two pieces (128 CTAs).
    let p = MlstmPlan::new(
        &shape(4, 8192, 16, 128, 128),
        Scope::SingleGpu,
        132,
        None,
        None,
    )
    .unwrap();
    assert_eq!(
        (p.num_segments, p.chunks_per_segment, p.states_splits),
        (2, 64, 2)
    );
    assert_eq!(p.output.grid, (1, 2, 64));
    assert_eq!(p.output.block, (256, 1, 1));
    assert_eq!(p.states.unwrap().grid, (1, 2, 64));
    assert_eq!(p.fold.unwrap().grid, ((128 * 128 + 128) / 256 + 1, 64, 1));
    let (tile, vector) = (128 * 128 * 4, 128 * 4);
    let o = p.workspace_offsets();
    // 128 pieces, 64 boundaries.
    let (pc, n) = (128 * tile, 192 * tile);
    assert_eq!(
        (o.pc, o.n, o.pn, o.m, o.f, o.pm),
        (
            pc,
            n,
            n + 128 * vector,
            n + 192 * vector,
            n + 192 * vector + 512,
            n + 192 * vector + 1024
        )
    );
    assert_eq!(p.workspace_bytes, o.pm + 256);
    // B*H >= SMs: one segment, no states pass, no workspace.
    let p = MlstmPlan::new(
        &shape(4, 200, 64, 64, 64),
        Scope::SingleGpu,
        132,
        None,
        None,
    )
    .unwrap();
    assert_eq!(
        (p.num_segments, p.states, p.fold, p.workspace_bytes),
        (1, None, None, 0)
    );
    assert_eq!(p.output.block, (128, 1, 1));
    // Forced: 5 segments of 16 chunks -> 4 of 4; pieces clamp to a segment's chunks.
    let p = MlstmPlan::new(
        &shape(1, 1000, 1, 128, 128),
        Scope::SingleGpu,
        132,
        Some(5),
        Some(9),
    )
    .unwrap();
    assert_eq!(
        (p.num_segments, p.chunks_per_segment, p.states_splits),
        (4, 4, 4)
    );
    assert!(MlstmPlan::new(
        &shape(1, 1000, 1, 128, 128),
        Scope::SingleGpu,
        132,
        Some(0),
        None
    )
    .is_err());
}

#[test]
fn a_shards_plan_summarises_every_segment_and_keeps_its_start_state() {
    // The B=4, H=16, T=8K shard: both segments summarised, each in one piece (128 CTAs); the fold
    // always runs; the start state (C, n, m per head) after each kind of array.
    let p = MlstmPlan::new(&shape(4, 8192, 16, 128, 128), Scope::Shard, 132, None, None).unwrap();
    assert_eq!(
        (p.num_segments, p.num_summaries, p.states_splits),
        (2, 2, 1)
    );
    assert_eq!(p.states.unwrap().grid, (1, 2, 64));
    let (tile, vector) = (128 * 128 * 4, 128 * 4);
    let o = p.workspace_offsets();
    // 128 pieces, 64 boundaries, 64 start states.
    assert_eq!((o.pc, o.start_c, o.n), (128 * tile, 192 * tile, 256 * tile));
    assert_eq!(
        (o.pn, o.start_n, o.m),
        (o.n + 128 * vector, o.n + 192 * vector, o.n + 256 * vector)
    );
    assert_eq!((o.f, o.pm, o.start_m), (o.m + 512, o.m + 1024, o.m + 1280));
    assert_eq!(p.workspace_bytes, o.start_m + 256);
    // One segment: still summarised and folded, as the shard's summary crosses GPUs.
    let p = MlstmPlan::new(&shape(4, 200, 64, 64, 64), Scope::Shard, 132, None, None).unwrap();
    assert_eq!((p.num_segments, p.num_summaries), (1, 1));
    assert!(p.states.is_some() && p.fold.is_some());
}

#[test]
fn shapes_the_kernels_lack_are_refused_with_what_to_do() {
    let err = MlstmPlan::new(
        &shape(1, 64, 1, 128, 256),
        Scope::SingleGpu,
        132,
        None,
        None,
    )
    .unwrap_err();
    assert!(err
        .to_string()
        .contains("split v into blocks of 128 columns"));
    let err =
        MlstmPlan::new(&shape(1, 64, 1, 96, 128), Scope::SingleGpu, 132, None, None).unwrap_err();
    assert!(err.to_string().contains("Dk"));
}

#[test]
fn gate_errors_name_the_gate_and_the_element() {
    let s = shape(2, 3, 2, 64, 64);
    let mut g = vec![0.5f32; 12];
    assert!(check_gate_values("i_gate", &g, &s).is_ok());
    g[7] = f32::NAN; // b = 1, t = 0, h = 1
    let err = check_gate_values("f_gate", &g, &s).unwrap_err().to_string();
    assert!(err.contains("f_gate[b=1, t=0, h=1]"), "{err}");
}

#[test]
fn arguments_are_checked_against_the_shape_before_any_launch() {
    let s = shape(1, 64, 2, 64, 64);
    let (n, per_token) = (s.qk_len(), 128);
    let base = 1u64 << 32;
    let args = |i_len: usize, h_addr: u64, eps: Option<f32>| MlstmArgs {
        shape: s,
        q: view(base, n),
        k: view(base + 0x10_0000, n),
        v: view(base + 0x20_0000, n),
        i_gate: floats(base + 0x30_0000, i_len),
        f_gate: floats(base + 0x38_0000, per_token),
        initial_state: None,
        h: out(h_addr, n),
        saved: None,
        final_state: Some(MlstmStateMut {
            c: out_f32(base + 0x50_0000, 2 * 64 * 64),
            n: out_f32(base + 0x58_0000, 2 * 64),
            m: out_f32(base + 0x58_1000, 2),
        }),
        scale: None,
        eps,
        documents: None,
        document_final_states: None,
    };
    assert_eq!(
        args(per_token, base + 0x40_0000, None).check().unwrap(),
        (0.125, DEFAULT_EPS)
    );
    let err = |a: MlstmArgs<'_>| a.check().unwrap_err().to_string();
    assert!(err(args(64, base + 0x40_0000, None)).contains("i_gate has 64 elements"));
    assert!(err(args(per_token, base + 0x40_0000, Some(-1.0))).contains("eps = -1"));
    assert!(err(args(per_token, base + 0x10, None)).contains("output h overlaps input q"));
    // Packed documents start every document from the zero state: no final state with them (and
    // no initial state).
    let docs = documents(base + 0x70_0000);
    let msg = err(MlstmArgs {
        documents: Some(docs),
        ..args(per_token, base + 0x40_0000, None)
    });
    assert!(
        msg.contains("final_state was given with packed documents"),
        "{msg}"
    );
    assert!(msg.contains("pass final_state = None"), "{msg}");
    let packed = MlstmArgs {
        documents: Some(docs),
        final_state: None,
        ..args(per_token, base + 0x40_0000, None)
    };
    assert!(packed.check().is_ok());
    // Every document's final state: C [B, N, H, Dk, Dv], n [B, N, H, Dk], m [B, N, H] with
    // N = 2 (three offsets), only with documents.
    let document_states = |c_len: usize| MlstmStateMut {
        c: out_f32(base + 0x80_0000, c_len),
        n: out_f32(base + 0x88_0000, 2 * 2 * 64),
        m: out_f32(base + 0x88_1000, 2 * 2),
    };
    let with_states = |docs: Option<Documents<'static>>, c_len: usize| MlstmArgs {
        documents: docs,
        final_state: None,
        document_final_states: Some(document_states(c_len)),
        ..args(per_token, base + 0x40_0000, None)
    };
    assert!(with_states(Some(docs), 2 * 2 * 64 * 64).check().is_ok());
    let msg = err(with_states(None, 2 * 2 * 64 * 64));
    assert!(msg.contains("is given without documents"), "{msg}");
    let msg = err(with_states(Some(docs), 2 * 64 * 64));
    assert!(
        msg.contains("document_final_states.c has 8192 elements"),
        "{msg}"
    );
}

/// Three int32 offsets at device address `at` (never dereferenced).
fn documents(at: u64) -> Documents<'static> {
    // SAFETY: argument checks only read the view's address and length.
    let offsets = unsafe { DeviceRef::<i32>::from_raw(at, 3) };
    Documents {
        cu_seqlens: DocumentOffsets::I32(offsets),
        shard_start: 0,
    }
}

#[test]
fn a_lasp2_boundary_is_checked_against_the_call() {
    let s = shape(1, 64, 2, 64, 64);
    let (n, per_token) = (s.qk_len(), 128);
    let base = 1u64 << 32;
    let args = MlstmArgs {
        shape: s,
        q: view(base, n),
        k: view(base + 0x10_0000, n),
        v: view(base + 0x20_0000, n),
        i_gate: floats(base + 0x30_0000, per_token),
        f_gate: floats(base + 0x38_0000, per_token),
        initial_state: None,
        h: out(base + 0x40_0000, n),
        saved: None,
        final_state: None,
        scale: None,
        eps: None,
        documents: None,
        document_final_states: None,
    };
    let state = |at: u64, c_len: usize| MlstmStateMut {
        c: out_f32(at, c_len),
        n: out_f32(at + 0x8_0000, 2 * 64),
        m: out_f32(at + 0x8_1000, 2),
    };
    let boundary = |entry_at: u64, exit_c_len: usize| MlstmBoundaryMut {
        entry: state(entry_at, 2 * 64 * 64),
        exit: state(base + 0x60_0000, exit_c_len),
    };
    assert!(boundary(base + 0x50_0000, 2 * 64 * 64).check(&args).is_ok());
    let err = |b: MlstmBoundaryMut<'_>| b.check(&args).unwrap_err().to_string();
    let msg = err(boundary(base + 0x50_0000, 64));
    assert!(msg.contains("exit.c has 64 elements"), "{msg}");
    let msg = err(boundary(base + 0x40_0000, 2 * 64 * 64));
    assert!(msg.contains("h and entry.c overlap"), "{msg}");
    let msg = err(boundary(base + 0x60_0000, 2 * 64 * 64));
    assert!(msg.contains("entry.c and exit.c overlap"), "{msg}");
    let msg = err(boundary(base + 0x20_0000, 2 * 64 * 64));
    assert!(msg.contains("output entry.c overlaps input v"), "{msg}");
}

#[test]
fn an_exchanged_tile_holds_c_n_m_and_f_and_bad_layouts_are_refused() {
    use crate::exchange::Lasp2Layout;
    use crate::family::Family;
    let layout = |dk, dv| Lasp2Layout { b: 2, h: 4, dk, dv };
    // C's [Dk][64] block, n's Dk floats, m, F, the backward's decay dot and one of padding:
    // whole 16-byte vectors.
    for dk in [64, 128] {
        let floats = Mlstm::summary_tile_floats(&layout(dk, 128));
        assert_eq!(floats, (dk * 64 + dk + 4) as u64);
        assert_eq!(floats % 4, 0);
    }
    assert!(Mlstm::validate_layout(&layout(128, 64)).is_ok());
    for (dk, dv) in [(96, 128), (128, 256), (32, 64)] {
        let err = Mlstm::validate_layout(&layout(dk, dv)).unwrap_err();
        assert!(
            err.to_string().contains("not supported"),
            "Dk {dk}, Dv {dv}: {err}"
        );
    }
}

#[test]
fn backward_plans_exchange_the_widths_and_keep_their_parts_apart() {
    // Dk = 128, Dv = 64: the dq and dk passes run with the widths exchanged (their states are
    // [Dv, Dk]), the dv pass with the forward's.
    let s = shape(2, 1000, 3, 128, 64);
    let plan = MlstmBackwardPlan::new(&s, Scope::SingleGpu, 132, None).unwrap();
    for pass in [plan.dq, plan.dk] {
        assert_eq!((pass.shape.dk, pass.shape.dv), (64, 128));
    }
    assert_eq!((plan.dv.shape.dk, plan.dv.shape.dv), (128, 64));
    let o: Offsets = plan.offsets();
    let (tokens, bh, state) = (2 * 1000 * 3u64, 6u64, 6 * 128 * 64 * 4u64);
    // Every part 256-byte aligned, in order, after the dv pass's workspace, none too short: the
    // dq and dk passes' first (they share it), apart from the dv pass's.
    let dq_dk = plan.dq.workspace_bytes.max(plan.dk.workspace_bytes);
    let parts = [
        (o.dq_dk_passes, dq_dk),
        (o.d_h_scaled, tokens * 64 * 2),
        (o.row_log_weight, tokens * 4),
        (o.neg_m, tokens * 4),
        (o.f_next, tokens * 4),
        (o.q_dots, tokens * 2 * 4),
        (o.k_dots, tokens * 2 * 4),
        (o.tile_sums, bh * 8),
        (o.c0_t, state),
        (o.rev_c, state),
        (o.rev_c_t, state),
        (o.end_c, state),
        (o.rev_m, bh * 4),
        (o.end_m, bh * 4),
        (o.end_n, bh * 128 * 4),
        (o.zero_n, bh * 128 * 4),
        (o.lasp2_m, bh * 4),
        (o.decay_dot, bh * 4),
        (o.lf_carry, bh * 8),
    ];
    assert!(o.dq_dk_passes >= plan.dv.workspace_bytes);
    for pair in parts.windows(2) {
        let ((at, len), (next, _)) = (pair[0], pair[1]);
        assert_eq!(at % 256, 0);
        assert!(at + len <= next, "{at} + {len} > {next}");
    }
    let (last, len) = parts[parts.len() - 1];
    assert_eq!(o.end, last + len);
    assert_eq!(plan.workspace_bytes, o.end);
    // Forced segments reach every pass.
    let forced = MlstmBackwardPlan::new(&s, Scope::SingleGpu, 132, Some(3)).unwrap();
    assert!([forced.dq, forced.dv, forced.dk]
        .iter()
        .all(|p| p.num_segments == 3));
    // A LASP-2 shard: the dv pass summarises every segment and always folds; the others are as
    // on one GPU.
    let shard = MlstmBackwardPlan::new(&s, Scope::Shard, 132, Some(3)).unwrap();
    assert_eq!(shard.dv.scope, Scope::Shard);
    assert_eq!(shard.dv.num_summaries, 3);
    assert!(shard.dv.fold.is_some());
    assert_eq!((shard.dq, shard.dk), (forced.dq, forced.dk));
    let err = MlstmBackwardPlan::new(&shape(1, 64, 1, 128, 256), Scope::SingleGpu, 132, None)
        .unwrap_err();
    assert!(
        err.to_string().contains("mLSTM backward: Dv = 256"),
        "{err}"
    );
}

#[test]
fn backward_arguments_are_checked_against_the_shape_before_any_launch() {
    let s = shape(1, 64, 2, 64, 64);
    let (n, per_token) = (s.qk_len(), 128);
    let base = 1u64 << 32;
    let args = |den_len: usize, dq_addr: u64, d_c0_len: usize| MlstmBackwardArgs {
        shape: s,
        q: view(base, n),
        k: view(base + 0x10_0000, n),
        v: view(base + 0x20_0000, n),
        i_gate: floats(base + 0x30_0000, per_token),
        f_gate: floats(base + 0x31_0000, per_token),
        initial_state: None,
        saved: MlstmSavedRef {
            m: floats(base + 0x32_0000, per_token),
            den: floats(base + 0x33_0000, den_len),
        },
        d_h: view(base + 0x40_0000, n),
        d_final: Some(MlstmFinalCotangent {
            d_c: floats(base + 0x50_0000, 2 * 64 * 64),
            m: floats(base + 0x58_0000, 2),
        }),
        dq: out(dq_addr, n),
        dk: out(base + 0x70_0000, n),
        dv: out(base + 0x80_0000, n),
        d_i_gate: out_f32(base + 0x90_0000, per_token),
        d_f_gate: out_f32(base + 0x91_0000, per_token),
        d_initial_c: Some(out_f32(base + 0xa0_0000, d_c0_len)),
        scale: None,
        documents: None,
    };
    let (ok_dq, state) = (base + 0x60_0000, 2 * 64 * 64);
    assert_eq!(args(per_token, ok_dq, state).check().unwrap(), 0.125);
    let err = |a: MlstmBackwardArgs<'_>| a.check().unwrap_err().to_string();
    assert!(err(args(per_token - 1, ok_dq, state)).contains("saved.den has 127 elements"));
    assert!(err(args(per_token, base + 0x40_0010, state)).contains("output dq overlaps input d_h"));
    assert!(err(args(per_token, ok_dq, state / 2)).contains("d_initial_c has 4096 elements"));
    // Packed documents: no cotangent of a final state, no gradient of an initial state.
    let packed = |a: MlstmBackwardArgs<'static>| MlstmBackwardArgs {
        documents: Some(documents(base + 0xb0_0000)),
        ..a
    };
    let msg = err(packed(args(per_token, ok_dq, state)));
    assert!(
        msg.contains("d_final was given with packed documents"),
        "{msg}"
    );
    let msg = err(packed(MlstmBackwardArgs {
        d_final: None,
        ..args(per_token, ok_dq, state)
    }));
    assert!(
        msg.contains("d_initial_c was given with packed documents"),
        "{msg}"
    );
    let plain = packed(MlstmBackwardArgs {
        d_final: None,
        d_initial_c: None,
        ..args(per_token, ok_dq, state)
    });
    assert_eq!(plain.check().unwrap(), 0.125);
}
