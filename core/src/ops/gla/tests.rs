//! Unit tests of GLA's host side: the shared-memory formulas against the header's, the plans
//! (segments, states pieces, launches, workspace) and the argument checks.

use super::forward::check_gate_values;
use super::plan::{output_smem_bytes, states_smem_bytes};
use super::*;
use crate::error::Error;
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
        scale,
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
}
