//! Unit tests of GLA's host side: the shared-memory formulas against the header's, the plans
//! (segments, states pieces, launches, workspace) and the argument checks, of the forward and of
//! the backward.

use super::backward::{grads_smem_bytes, grads_threads, walk_smem_bytes, walk_threads};
use super::forward::check_gate_values;
use super::plan::{output_smem_bytes, states_smem_bytes};
use super::*;
use crate::error::Error;
use crate::ops::documents::{DocumentOffsets, Documents};
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef};

fn shape(b: usize, t: usize, h: usize, dk: usize, dv: usize) -> ForwardShape {
    ForwardShape { b, t, h, dk, dv }
}

#[test]
fn shared_memory_fits_one_cta_per_sm_and_the_states_kernel_two() {
    // Two stages of Q, K, V (16 KiB each) and gates (32 KiB), K^, two bf16 state tiles, three
    // vectors of Dk and 8 bytes of scan totals per thread.
    assert_eq!(
        output_smem_bytes(128, 128),
        2 * 81_920 + 16_384 + 32_768 + 1_536 + 2_048
    );
    assert!(output_smem_bytes(128, 128) <= 227 * 1024);
    assert_eq!(
        states_smem_bytes(128),
        2 * (16_384 + 8_192 + 32_768) + 1_024
    );
    assert!(2 * states_smem_bytes(128) <= 228 * 1024);
}

#[test]
fn plans_fill_the_sms_once_and_cut_the_states_pass_into_pieces() {
    // B=4, H=16, T=8K on 132 SMs: two segments of 64 chunks (128 output CTAs), the states pass of
    // segment 0 in two pieces (2 Dv tiles x 2 pieces x 64 heads = 256 CTAs, two per SM).
    let p = GlaPlan::new(&shape(4, 8192, 16, 128, 128), 132, None, None).unwrap();
    assert_eq!(
        (p.num_segments, p.chunks_per_segment, p.states_splits),
        (2, 64, 2)
    );
    assert_eq!(p.output.grid, (1, 2, 64));
    assert_eq!(p.output.block, (256, 1, 1));
    assert_eq!(p.states.unwrap().grid, (2, 2, 64));
    let tile = 128 * 128 * 4;
    assert_eq!(p.workspace_offsets(), (64 * 2 * tile, 64 * 3 * tile));
    assert_eq!(p.workspace_bytes, 64 * 3 * tile + 64 * 2 * 128 * 4);
    // B*H >= SMs: one segment, no states pass, no workspace.
    let p = GlaPlan::new(&shape(4, 200, 64, 64, 64), 132, None, None).unwrap();
    assert_eq!(
        (p.num_segments, p.states, p.fold, p.workspace_bytes),
        (1, None, None, 0)
    );
    assert_eq!(p.output.block, (128, 1, 1));
    // Forced: 5 segments of 16 chunks -> 4 of 4; pieces clamp to a segment's chunks.
    let p = GlaPlan::new(&shape(1, 1000, 1, 128, 128), 132, Some(5), Some(9)).unwrap();
    assert_eq!(
        (p.num_segments, p.chunks_per_segment, p.states_splits),
        (4, 4, 4)
    );
    // One chunk: one segment whatever is asked.
    let p = GlaPlan::new(&shape(1, 63, 1, 128, 128), 132, Some(4), None).unwrap();
    assert_eq!(p.num_segments, 1);
}

#[test]
fn shard_plans_cover_every_segment_with_states_pieces() {
    use super::lasp2::ShardPlan;
    let plan = |b, h, t| {
        let p = ShardPlan::new(b, h, t, 128, 132);
        (p.segments, p.chunks_per_segment, p.splits)
    };
    // LASP-2's states pass covers every segment of the shard (the last one too): S pieces x R.
    assert_eq!(plan(4, 16, 8192), (2, 64, 1));
    assert_eq!(plan(1, 16, 32768), (8, 64, 1));
    assert_eq!(plan(8, 16, 2048), (1, 32, 1));
    // Few heads: 128 chunks over 66 wanted segments round to 64 of 2 chunks; one chunk per
    // segment leaves nothing to cut.
    assert_eq!(plan(1, 2, 8192), (64, 2, 1));
    assert_eq!(plan(1, 1, 4000), (63, 1, 1));
    // 1563 chunks: 131 segments of 12 (130 would leave 3 chunks over); one Dv tile, so two
    // pieces per segment fill the SMs at two states CTAs each.
    let p = ShardPlan::new(1, 1, 100_000, 64, 132);
    assert_eq!((p.segments, p.chunks_per_segment, p.splits), (131, 12, 2));
}

#[test]
fn shapes_the_kernels_lack_are_refused_with_what_to_do() {
    let msg = |s: ForwardShape| match GlaPlan::new(&s, 132, None, None) {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("{s:?}: {other:?}"),
    };
    assert!(msg(shape(1, 10, 1, 128, 192)).contains("GLA forward: Dv = 192 is not supported"));
    assert!(msg(shape(1, 10, 1, 96, 128)).contains("GLA forward: Dk = 96 is not supported"));
    assert!(msg(shape(1, 0, 1, 64, 64)).contains("GLA forward: B, T and H must be at least 1"));
    assert!(matches!(
        GlaPlan::new(&shape(1, 10, 1, 64, 64), 132, Some(0), None),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn gate_errors_name_the_element_and_say_what_gates_are() {
    let s = shape(2, 3, 2, 64, 64);
    let mut g = vec![-0.1f32; s.qk_len()];
    assert!(check_gate_values(&g, &s).is_ok());
    // [b=1, t=2, h=0, d=5]
    g[((3 + 2) * 2) * 64 + 5] = 0.5;
    let msg = check_gate_values(&g, &s).unwrap_err().to_string();
    assert!(msg.contains("g[b=1, t=2, h=0, d=5] = 0.5"), "{msg}");
    assert!(msg.contains("natural-log decays"), "{msg}");
}

#[test]
fn arguments_are_checked_against_the_shape_before_any_launch() {
    let s = shape(1, 64, 2, 64, 64);
    let n = s.qk_len();
    // SAFETY: views of fake addresses are only measured, never launched.
    let view = |addr: u64, len: usize| unsafe { DeviceRef::<bf16>::from_raw(addr, len) };
    // SAFETY: as above.
    let gates = |addr: u64, len: usize| unsafe { DeviceRef::<f32>::from_raw(addr, len) };
    // SAFETY: as above.
    let out = |addr: u64, len: usize| unsafe { DeviceMut::<bf16>::from_raw(addr, len) };
    let base = 1u64 << 32;
    let args = |g_len: usize, o_addr: u64, scale: Option<f32>| GlaArgs {
        shape: s,
        q: view(base, n),
        k: view(base + 0x10_0000, n),
        v: view(base + 0x20_0000, n),
        g: gates(base + 0x30_0000, g_len),
        h0: None,
        o: out(o_addr, n),
        ht: None,
        chunk_states: None,
        scale,
        documents: None,
        document_ht: None,
    };
    assert_eq!(
        args(n, base + 0x40_0000, None)
            .check("GLA forward")
            .unwrap(),
        0.125
    );
    let err = |a: GlaArgs<'_>| a.check("GLA forward").unwrap_err().to_string();
    assert!(err(args(64 * 2 * 64 / 64, base + 0x40_0000, None)).contains("g has 128 elements"));
    assert!(err(args(n, base + 0x40_0000, Some(0.0))).contains("scale = 0 must be finite"));
    assert!(err(args(n, base + 0x10, None)).contains("output o overlaps input q"));
    // Packed documents start every document from zero: no h0 or ht with them.
    // SAFETY: as above.
    let offsets = unsafe { DeviceRef::<i32>::from_raw(base + 0x50_0000, 3) };
    let docs = Documents {
        cu_seqlens: DocumentOffsets::I32(offsets),
        shard_start: 0,
    };
    let packed = GlaArgs {
        documents: Some(docs),
        ..args(n, base + 0x40_0000, None)
    };
    assert!(packed.check("GLA forward").is_ok());
    // SAFETY: as above.
    let state = unsafe { DeviceRef::<f32>::from_raw(base + 0x60_0000, s.state_len()) };
    let msg = err(GlaArgs {
        documents: Some(docs),
        h0: Some(state),
        ..args(n, base + 0x40_0000, None)
    });
    assert!(msg.contains("h0 was given with packed documents"), "{msg}");
    assert!(msg.contains("pass h0 = None"), "{msg}");
    // One final state per document: [B, N, H, Dk, Dv], only with documents.
    let per_document = 2 * s.state_len();
    // SAFETY: as above.
    let document_ht = |len: usize| unsafe { DeviceMut::<f32>::from_raw(base + 0x70_0000, len) };
    let with_states = |documents, len| GlaArgs {
        documents,
        document_ht: Some(document_ht(len)),
        ..args(n, base + 0x40_0000, None)
    };
    assert!(with_states(Some(docs), per_document)
        .check("GLA forward")
        .is_ok());
    let msg = err(with_states(None, per_document));
    assert!(msg.contains("without documents"), "{msg}");
    let msg = err(with_states(Some(docs), per_document - 1));
    assert!(msg.contains("document_ht"), "{msg}");
}

#[test]
fn backward_shared_memory_matches_the_header() {
    // bindgen does not export the header's inline functions: their values worked out by hand.
    // The walk: a warpgroup per 64 columns of Dv; three stages of a [64 x Dk] and a [64 x Dv]
    // bf16 tile and the [64 x Dk] fp32 gates, 8 bytes of scan totals per thread.
    assert_eq!((walk_threads(64), walk_threads(128)), (128, 256));
    assert_eq!(
        walk_smem_bytes(64, 64),
        3 * (8_192 + 8_192 + 16_384) + 1_024
    );
    assert_eq!(
        walk_smem_bytes(64, 128),
        3 * (8_192 + 16_384 + 16_384) + 2_048
    );
    assert_eq!(
        walk_smem_bytes(128, 64),
        3 * (16_384 + 8_192 + 32_768) + 1_024
    );
    assert_eq!(
        walk_smem_bytes(128, 128),
        3 * (16_384 + 16_384 + 32_768) + 2_048
    );
    // The grads kernel: a warpgroup per 64 columns of max(Dk, Dv).
    let threads = [
        (64, 64, 128),
        (64, 128, 256),
        (128, 64, 256),
        (128, 128, 256),
    ];
    for (dk, dv, want) in threads {
        assert_eq!(grads_threads(dk, dv), want, "Dk={dk} Dv={dv}");
    }
    // Q, K, V, dO, S_n, dS_{n+1} (bf16), the gates, dA, 11 vectors of Dk, 8 bytes per thread.
    let smem = [
        (64, 64, 85_760),
        (64, 128, 119_552),
        (128, 64, 138_752),
        (128, 128, 187_904),
    ];
    for (dk, dv, want) in smem {
        let tiles = 2 * 64 * dk * 2 + 2 * 64 * dv * 2 + 2 * dk * dv * 2;
        let by_parts =
            tiles + 64 * dk * 4 + 64 * 64 * 4 + 11 * dk * 4 + 8 * grads_threads(dk, dv) as usize;
        assert_eq!(by_parts, want, "Dk={dk} Dv={dv}");
        assert_eq!(
            grads_smem_bytes(dk, dv, false),
            want as u32,
            "Dk={dk} Dv={dv}"
        );
        // Within one block's opt-in limit on sm_90 (227 KiB).
        assert!(grads_smem_bytes(dk, dv, true) <= 227 * 1024);
    }
    // The twin for packed documents: one more [64 x Dk] bf16 tile, 1024-byte aligned.
    assert_eq!(grads_smem_bytes(128, 128, false), 187_904);
    assert_eq!(grads_smem_bytes(128, 128, true), 188_416 + 16_384);
    assert!(walk_smem_bytes(128, 128) <= 227 * 1024);
}

#[test]
fn backward_plans_cut_sequences_into_segments_for_the_walk() {
    // B*H = 1: 132 segments wanted (a walk per SM), 16 chunks -> one chunk per segment.
    let p = GlaBackwardPlan::new(&shape(1, 1000, 1, 128, 128), 132, None).unwrap();
    assert_eq!((p.num_segments, p.chunks_per_segment), (16, 1));
    let walk = p.walk;
    assert_eq!(walk.grid, (1, 16, 1));
    assert_eq!(walk.block, (256, 1, 1));
    assert_eq!(walk.shared_bytes, walk_smem_bytes(128, 128));
    assert_eq!(p.summary.unwrap().grid, (1, 15, 1));
    assert_eq!(p.summary.unwrap().shared_bytes, walk_smem_bytes(128, 128));
    let fold = p.fold.unwrap();
    assert_eq!(
        (fold.grid, fold.block, fold.shared_bytes),
        ((64, 1, 1), (256, 1, 1), 0)
    );
    assert_eq!(p.grads.grid, (16, 1, 1));
    assert_eq!(p.grads.block, (256, 1, 1));
    assert_eq!(p.grads.shared_bytes, grads_smem_bytes(128, 128, false));
    // dh: 16 chunks of a bf16 [128 x 128] gradient; then ws_m and ws_p, 15 fp32 states each;
    // then ws_lambda, 15 x 128 floats.
    let states = 16 * 128 * 128 * 2;
    let summaries = 15 * 128 * 128 * 4;
    assert_eq!(
        p.segment_offsets,
        Some(SegmentOffsets {
            ws_m: states,
            ws_p: states + summaries,
            ws_lambda: states + 2 * summaries,
        })
    );
    assert_eq!(p.workspace_bytes, states + 2 * summaries + 15 * 128 * 4);

    // B*H = 16, Dv 64: 132 / 16 = 8 segments of 16 chunks.
    let p = GlaBackwardPlan::new(&shape(1, 8192, 16, 128, 64), 132, None).unwrap();
    assert_eq!((p.num_segments, p.chunks_per_segment), (8, 16));
    assert_eq!(p.walk.grid, (1, 8, 16));
    assert_eq!(p.walk.block, (128, 1, 1));
    assert_eq!(p.summary.unwrap().grid, (1, 7, 16));
    assert_eq!(p.fold.unwrap().grid, (32, 16, 1));
    assert_eq!(p.grads.grid, (128, 16, 1));

    // B*H = 64: walks on half the SMs draw the bandwidth; one segment, no summary.
    let p = GlaBackwardPlan::new(&shape(4, 8192, 16, 128, 64), 132, None).unwrap();
    assert_eq!((p.num_segments, p.chunks_per_segment), (1, 128));
    assert_eq!(p.walk.grid, (1, 1, 64));
    assert_eq!((p.summary, p.fold), (None, None));
    assert_eq!(p.grads.grid, (128, 64, 1));
    assert_eq!(p.grads.block, (256, 1, 1));

    // B*H >= SMs: one segment, no summary or fold, a workspace of dh only.
    let p = GlaBackwardPlan::new(&shape(4, 200, 64, 64, 64), 132, None).unwrap();
    assert_eq!((p.num_segments, p.chunks_per_segment), (1, 4));
    assert_eq!((p.summary, p.fold, p.segment_offsets), (None, None, None));
    assert_eq!(p.workspace_bytes, 256 * 4 * 64 * 64 * 2);
    assert_eq!(p.walk.grid, (1, 1, 256));
    assert_eq!(p.grads.grid, (4, 256, 1));
    assert_eq!(p.grads.block, (128, 1, 1));
    assert_eq!(p.grads.shared_bytes, grads_smem_bytes(64, 64, false));
}

#[test]
fn backward_plans_take_forced_segments_and_keep_none_empty() {
    let segments = |t, force| {
        let p = GlaBackwardPlan::new(&shape(1, t, 1, 64, 128), 132, force).unwrap();
        (p.num_segments, p.chunks_per_segment)
    };
    // 16 chunks: 5 segments asked -> 4 of 4; 3 -> 3 of 6 (the last of 4); more than chunks ->
    // one chunk each; one chunk -> one segment whatever is asked.
    assert_eq!(segments(1000, Some(5)), (4, 4));
    assert_eq!(segments(1000, Some(3)), (3, 6));
    assert_eq!(segments(1000, Some(1)), (1, 16));
    assert_eq!(segments(1000, Some(100)), (16, 1));
    assert_eq!(segments(63, Some(4)), (1, 1));
    assert_eq!(segments(1, None), (1, 1));
    assert!(matches!(
        GlaBackwardPlan::new(&shape(1, 10, 1, 64, 64), 132, Some(0)),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn backward_workspace_parts_are_256_byte_aligned_and_disjoint() {
    for (b, t, h, dk, dv) in [
        (1, 1, 1, 64, 64),
        (1, 65, 3, 64, 128),
        (2, 1000, 3, 128, 64),
        (1, 8191, 1, 128, 128),
        (3, 777, 5, 64, 64),
    ] {
        for force in [None, Some(1), Some(2), Some(3), Some(7)] {
            let p = GlaBackwardPlan::new(&shape(b, t, h, dk, dv), 132, force).unwrap();
            let states = (b * h * t.div_ceil(64) * dk * dv * 2) as u64;
            let end = match p.segment_offsets {
                None => {
                    assert_eq!(p.num_segments, 1);
                    p.workspace_bytes
                }
                Some(o) => {
                    let slots = (b * h * (p.num_segments as usize - 1)) as u64;
                    let summaries = slots * (dk * dv * 4) as u64;
                    assert!(o.ws_m >= states);
                    assert!(o.ws_p >= o.ws_m + summaries);
                    assert!(o.ws_lambda >= o.ws_p + summaries);
                    for part in [o.ws_m, o.ws_p, o.ws_lambda] {
                        assert_eq!(part % 256, 0, "{p:?}");
                    }
                    assert_eq!(p.workspace_bytes, o.ws_lambda + slots * dk as u64 * 4);
                    o.ws_m
                }
            };
            assert!(end >= states, "{p:?}");
        }
    }
}

#[test]
fn backward_shapes_the_kernels_lack_are_refused_with_what_to_do() {
    let msg = |s: ForwardShape| match GlaBackwardPlan::new(&s, 132, None) {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("{s:?}: {other:?}"),
    };
    let m = msg(shape(1, 10, 1, 128, 192));
    assert!(m.contains("GLA backward: Dv = 192 is not supported"), "{m}");
    assert!(m.contains("add the blocks' dq, dk and dg"), "{m}");
    assert!(msg(shape(1, 10, 1, 64, 96)).contains("GLA backward: Dv = 96"));
    assert!(msg(shape(1, 10, 1, 96, 128)).contains("GLA backward: Dk = 96 is not supported"));
}

#[test]
fn backward_arguments_are_checked_against_the_shape_before_any_launch() {
    let s = shape(1, 64, 2, 64, 64);
    let n = s.qk_len();
    // SAFETY: views of fake addresses are only measured, never launched.
    let view = |addr: u64, len: usize| unsafe { DeviceRef::<bf16>::from_raw(addr, len) };
    // SAFETY: as above.
    let floats = |addr: u64, len: usize| unsafe { DeviceRef::<f32>::from_raw(addr, len) };
    // SAFETY: as above.
    let out = |addr: u64, len: usize| unsafe { DeviceMut::<bf16>::from_raw(addr, len) };
    // SAFETY: as above.
    let out_f32 = |addr: u64, len: usize| unsafe { DeviceMut::<f32>::from_raw(addr, len) };
    let base = 1u64 << 32;
    let at = |i: u64| base + i * 0x10_0000;
    let args = |d_o_len: usize, dg_addr: u64, dh0_addr: u64| GlaBackwardArgs {
        shape: s,
        q: view(at(0), n),
        k: view(at(1), n),
        v: view(at(2), n),
        g: floats(at(3), n),
        h0: Some(floats(at(4), s.state_len())),
        d_o: view(at(5), d_o_len),
        chunk_states: view(at(12), chunk_states_len(&s)),
        dht: Some(floats(at(6), s.state_len())),
        dq: out(at(7), n),
        dk: out(at(8), n),
        dv: out(at(9), n),
        dg: out_f32(dg_addr, n),
        dh0: Some(out_f32(dh0_addr, s.state_len())),
        scale: None,
        documents: None,
    };
    assert_eq!(
        args(n, at(10), at(11)).check("GLA backward").unwrap(),
        0.125
    );
    let err = |a: GlaBackwardArgs<'_>| a.check("GLA backward").unwrap_err().to_string();
    assert!(err(args(n - 1, at(10), at(11))).contains("d_o has 8191 elements"));
    assert!(err(args(n, at(12) + 32, at(11))).contains("output dg overlaps input chunk_states"));
    assert!(err(args(n, at(0) + 16, at(11))).contains("output dg overlaps input q"));
    assert!(err(args(n, at(10), at(6))).contains("output dh0 overlaps input dht"));
    assert!(err(args(n, at(10) + 8, at(11))).contains("dg starts at device address"));
    assert!(err(args(n, at(10), at(11) + 4)).contains("not 8-byte aligned"));
}
