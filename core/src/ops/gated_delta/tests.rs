//! Unit tests of Gated DeltaNet's host side: the shared-memory and workspace formulas against the
//! headers', the plans, and the argument checks of the forward and the backward, which run before
//! anything is launched; and a model of the kernels' roundings against the f64 recurrence, which
//! says whether the GPU tests' tolerance is within the design's reach before a GPU runs them.

use super::backward::{
    backward_wy_smem_bytes, dh_smem_bytes, grads_smem_bytes, rows_elems, states_elems,
    summary_without_last_b,
};
use super::forward::{output_smem_bytes, roles_smem_bytes, summary_smem_bytes, wy_smem_bytes};
use super::{GatedDeltaArgs, GatedDeltaBackwardArgs, GatedDeltaBackwardPlan, GatedDeltaPlan};
use crate::error::Error;
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef, Scope};
use crate::reference::Inputs;

fn shape(b: usize, t: usize, h: usize, dk: usize, dv: usize) -> ForwardShape {
    ForwardShape { b, t, h, dk, dv }
}

#[test]
fn shared_memory_follows_the_header() {
    // Scalar decay's output loop at Dk 128 (two stages of Q, K, V tile and gates, two bf16 state
    // tiles: 115,200 bytes) rounded up to 1 KiB, then two (I + L)^{-1} tiles, the R tile and two
    // stages of betas.
    assert_eq!(
        output_smem_bytes(128),
        115_712 + 2 * 8_192 + 8_192 + 2 * 256
    );
    assert_eq!(output_smem_bytes(64), 66_560 + 2 * 8_192 + 8_192 + 2 * 256);
    assert!(output_smem_bytes(128) <= 227 * 1024);
    // The summary kernel's loop has no Q tiles (82,432 bytes at Dk 128, rounded up to 1 KiB): two
    // CTAs, each with its 1 KiB of reserved shared memory, fit the 228 KiB of an H100's SM.
    assert_eq!(
        summary_smem_bytes(128),
        82_944 + 2 * 8_192 + 8_192 + 2 * 256
    );
    assert!(2 * (summary_smem_bytes(128) + 1024) <= 228 * 1024);
    // The roles kernel: three stages of Q, K (16 KiB each) and the V tile (8 KiB), two state
    // copies, three stages of gates and mbarriers (122,880 + 32,768 + 768 + 24 bytes, rounded up
    // to 1 KiB), then three (I + L)^{-1} tiles, T_u, the scaled u, -W (16 KiB), O's staging
    // tile, three slots of betas and three gate boxes of 64 tokens x 4 heads.
    assert_eq!(
        roles_smem_bytes(128),
        156_672 + 3 * 8_192 + 2 * 8_192 + 16_384 + 8_192 + 3 * 256 + 3 * 1_024
    );
    assert_eq!(
        roles_smem_bytes(64),
        91_136 + 3 * 8_192 + 2 * 8_192 + 8_192 + 8_192 + 3 * 256 + 3 * 1_024
    );
    assert!(roles_smem_bytes(128) <= 227 * 1024);
    // The K tile, 64 gates and 64 betas, (I + L)^{-1} transposed as 64 rows of 72 floats.
    assert_eq!(wy_smem_bytes(128), 16_384 + 512 + 18_432);
    assert_eq!(wy_smem_bytes(64), 8_192 + 512 + 18_432);
}

#[test]
fn plans_fill_the_sms_once_with_segments_where_the_batch_is_short() {
    // B=4, H=16: 128 output CTAs already, one segment; the workspace is the inverses alone (64
    // heads x 128 chunks x 8 KiB).
    let p = GatedDeltaPlan::new(&shape(4, 8192, 16, 128, 128), 132, None, Scope::SingleGpu);
    assert_eq!((p.num_segments, p.chunks_per_segment), (1, 128));
    assert_eq!((p.summary, p.fold), (None, None));
    assert_eq!(p.output.grid, (2, 1, 64));
    assert_eq!(p.wy.grid, (128, 64, 1));
    assert_eq!(p.workspace_bytes, 64 * 128 * 8_192);
    // B=1, H=16, T=32K: 32 CTAs a segment, so four segments of 128 chunks; summaries of the first
    // three (A and b, two column tiles each), their fold per Dv tile.
    // The fold stores the state entering each of the four segments.
    let p = GatedDeltaPlan::new(&shape(1, 32768, 16, 128, 128), 132, None, Scope::SingleGpu);
    assert_eq!((p.num_segments, p.chunks_per_segment), (4, 128));
    assert_eq!(p.num_summaries, 3);
    assert_eq!(p.summary.unwrap().grid, (4, 3, 16));
    assert_eq!(p.fold.unwrap().grid, (2, 16, 1));
    assert_eq!(p.output.grid, (2, 4, 16));
    let tri = 16 * 512 * 8_192;
    let summary = 16 * 3 * 128 * 128 * 4;
    assert_eq!(
        p.summary_offsets,
        Some((tri, tri + summary, tri + 2 * summary))
    );
    assert_eq!(
        p.workspace_bytes,
        tri + 2 * summary + 16 * 4 * 128 * 128 * 4
    );
}

#[test]
fn a_lasp2_shard_summarises_every_segment_and_always_folds() {
    // One segment: its summary is the shard's; the fold starts it from the exchanged prefix.
    let p = GatedDeltaPlan::new(&shape(4, 8192, 16, 128, 128), 132, None, Scope::Shard);
    assert_eq!((p.num_segments, p.num_summaries), (1, 1));
    assert_eq!(p.summary.unwrap().grid, (4, 1, 64));
    assert_eq!(p.fold.unwrap().grid, (2, 64, 1));
    let tri = 64 * 128 * 8_192;
    let state = 64 * 128 * 128 * 4;
    assert_eq!(p.summary_offsets, Some((tri, tri + state, tri + 2 * state)));
    assert_eq!(p.workspace_bytes, tri + 3 * state);
    // Four segments: four summaries, four prefixes.
    let p = GatedDeltaPlan::new(&shape(1, 32768, 16, 128, 128), 132, None, Scope::Shard);
    assert_eq!((p.num_segments, p.num_summaries), (4, 4));
    assert_eq!(p.summary.unwrap().grid, (4, 4, 16));
}

#[test]
fn forced_segment_counts_leave_no_segment_empty() {
    // 16 chunks in 5 segments: 4 chunks each, so 4 segments.
    let p = GatedDeltaPlan::new(&shape(1, 1000, 1, 64, 64), 132, Some(5), Scope::SingleGpu);
    assert_eq!((p.num_segments, p.chunks_per_segment), (4, 4));
    // More segments than chunks: one chunk each.
    let p = GatedDeltaPlan::new(&shape(1, 100, 1, 64, 64), 132, Some(100), Scope::SingleGpu);
    assert_eq!((p.num_segments, p.chunks_per_segment), (2, 1));
    // One token: one segment whatever the GPU.
    let p = GatedDeltaPlan::new(&shape(1, 1, 1, 64, 64), 132, None, Scope::SingleGpu);
    assert_eq!((p.num_segments, p.chunks_per_segment), (1, 1));
}

/// A view of `len` elements at the fake device address `addr`.
fn view<T>(addr: u64, len: usize) -> DeviceRef<'static, T> {
    // SAFETY: never dereferenced: these tests call only the checks, which launch nothing.
    unsafe { DeviceRef::from_raw(addr, len) }
}

/// A writable view of `len` elements at the fake device address `addr`.
fn view_mut<T>(addr: u64, len: usize) -> DeviceMut<'static, T> {
    // SAFETY: as for `view`.
    unsafe { DeviceMut::from_raw(addr, len) }
}

/// Tensor `i`'s fake address: 4 GiB apart, so that no two overlap and every one is aligned.
fn at(i: u64) -> u64 {
    i << 32
}

/// Well-formed arguments for `s` over fake addresses (the checks read only addresses and lengths).
fn fake_args(s: ForwardShape) -> GatedDeltaArgs<'static> {
    GatedDeltaArgs {
        shape: s,
        q: view::<bf16>(at(1), s.qk_len()),
        k: view::<bf16>(at(2), s.qk_len()),
        v: view::<bf16>(at(3), s.v_len()),
        g: view::<f32>(at(4), s.gate_len()),
        beta: view::<f32>(at(5), s.gate_len()),
        h0: Some(view::<f32>(at(6), s.state_len())),
        o: view_mut::<bf16>(at(7), s.v_len()),
        ht: Some(view_mut::<f32>(at(8), s.state_len())),
        scale: None,
    }
}

fn refused(args: GatedDeltaArgs<'_>, needle: &str) {
    match args.check("Gated DeltaNet forward") {
        Err(Error::InvalidArgument(msg)) => {
            assert!(msg.contains(needle), "{msg:?} does not say {needle:?}");
            assert!(msg.starts_with("Gated DeltaNet forward: "), "{msg:?}");
        }
        other => panic!("expected a refusal saying {needle:?}, got {other:?}"),
    }
}

#[test]
fn well_formed_arguments_pass_with_the_default_scale() {
    let scale = fake_args(shape(2, 100, 3, 128, 192))
        .check("Gated DeltaNet forward")
        .unwrap();
    assert_eq!(scale, (1.0 / 128f64.sqrt()) as f32);
}

#[test]
fn every_tensor_is_checked_before_any_launch() {
    let s = shape(2, 100, 3, 64, 64);
    let mut a = fake_args(s);
    a.beta = view(at(5), s.gate_len() - 1);
    refused(a, "beta has 599 elements but [B, T, H]");
    let mut a = fake_args(s);
    a.beta = view(at(5) + 2, s.gate_len());
    refused(a, "beta starts at device address");
    let mut a = fake_args(s);
    a.g = view(at(4), s.qk_len());
    refused(a, "g has 38400 elements but [B, T, H]");
    let mut a = fake_args(s);
    a.v = view(at(3) + 8, s.v_len());
    refused(a, "v starts at device address");
    let mut a = fake_args(s);
    a.o = view_mut(at(3), s.v_len());
    refused(a, "output o overlaps input v");
    let mut a = fake_args(s);
    a.ht = Some(view_mut(at(6), s.state_len()));
    refused(a, "output ht overlaps input h0");
    let mut a = fake_args(s);
    a.scale = Some(0.0);
    refused(a, "scale = 0 must be finite and > 0");
}

#[test]
fn unsupported_widths_are_refused_with_what_to_do() {
    refused(
        fake_args(shape(1, 64, 1, 96, 64)),
        "Dk = 96 is not supported",
    );
    refused(
        fake_args(shape(1, 64, 1, 64, 96)),
        "Dv = 96 is not a positive multiple of 64",
    );
    refused(
        fake_args(shape(1, 0, 1, 64, 64)),
        "B, T and H must be at least 1",
    );
}

#[test]
fn backward_shared_memory_follows_the_header() {
    // WY: the forward's (35,328 bytes at Dk 128, 27,136 at Dk 64) rounded up to 1 KiB, then
    // (I + L)^{-1} as a bf16 tile.
    assert_eq!(backward_wy_smem_bytes(128), 35_840 + 8_192);
    assert_eq!(backward_wy_smem_bytes(64), 27_648 + 8_192);
    // The dS pass: two stages of Q, K, W (16 KiB each at Dk 128), dO and 1 KiB of gates; two bf16
    // copies of dS' [Dk x 64]; the du tile.
    assert_eq!(
        dh_smem_bytes(128),
        2 * (3 * 16_384 + 8_192 + 1_024) + 2 * 16_384 + 8_192
    );
    assert_eq!(
        dh_smem_bytes(64),
        2 * (3 * 8_192 + 8_192 + 1_024) + 2 * 8_192 + 8_192
    );
    // The gradient kernel: Q, K, W, dW; (I + L)^{-1}, dP and a scratch tile; two sets of dO, u,
    // du, V, S_n and dS' [Dk x 64]; 1 KiB of gates and betas and 3 KiB of row sums.
    assert_eq!(
        grads_smem_bytes(128),
        4 * 16_384 + 3 * 8_192 + 2 * (4 * 8_192 + 2 * 16_384) + 4_096
    );
    assert_eq!(
        grads_smem_bytes(64),
        4 * 8_192 + 3 * 8_192 + 2 * (4 * 8_192 + 2 * 8_192) + 4_096
    );
    for dk in [64, 128] {
        for bytes in [
            backward_wy_smem_bytes(dk),
            dh_smem_bytes(dk),
            grads_smem_bytes(dk),
        ] {
            assert!(bytes <= 227 * 1024, "Dk {dk}: {bytes} bytes");
        }
    }
}

#[test]
fn backward_workspace_rows_cover_whole_chunks() {
    // T = 100: two chunks, the second ragged, its virtual rows stored too; six heads.
    let s = shape(2, 100, 3, 128, 64);
    assert_eq!(rows_elems(&s, s.dk), 6 * 2 * 64 * 128);
    assert_eq!(rows_elems(&s, s.dv), 6 * 2 * 64 * 64);
    assert_eq!(states_elems(&s), 6 * 2 * 128 * 64);
    // One token: one chunk.
    let s = shape(1, 1, 1, 64, 128);
    assert_eq!(rows_elems(&s, s.dv), 64 * 128);
    assert_eq!(states_elems(&s), 64 * 128);
}

#[test]
fn backward_plans_run_the_forwards_segments_and_follow_its_workspace() {
    // B=4, H=16, T=8K: one segment (no summaries, no fold); the forward's part of the workspace is
    // the inverses alone, then W, u, du (128 chunks of 64 rows each) and the two states per chunk.
    let s = shape(4, 8192, 16, 128, 128);
    let p = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::SingleGpu);
    assert_eq!(
        p.forward,
        GatedDeltaPlan::new(&s, 132, None, Scope::SingleGpu)
    );
    assert_eq!((p.forward.summary, p.forward.fold), (None, None));
    let tri = 64 * 128 * 8_192;
    let rows = 64 * 128 * 64 * 128 * 2;
    let states = 64 * 128 * 128 * 128 * 2;
    assert_eq!(
        (p.ws_w, p.ws_u, p.ws_du, p.ws_h, p.ws_dh),
        (
            tri,
            tri + rows,
            tri + 2 * rows,
            tri + 3 * rows,
            tri + 3 * rows + states
        )
    );
    assert_eq!(p.workspace_bytes, tri + 3 * rows + 2 * states);
    assert_eq!(
        (p.wy.grid, p.wy.block, p.wy.shared_bytes),
        ((128, 64, 1), (128, 1, 1), backward_wy_smem_bytes(128))
    );
    assert_eq!(
        (p.states.grid, p.states.block, p.states.shared_bytes),
        ((2, 1, 64), (128, 1, 1), summary_smem_bytes(128))
    );
    assert_eq!(
        (p.dh.grid, p.dh.block, p.dh.shared_bytes),
        ((2, 1, 64), (128, 1, 1), dh_smem_bytes(128))
    );
    assert_eq!((p.dh_summary, p.dh_fold, p.ws_ds), (None, None, None));
    assert_eq!(
        (p.grads.grid, p.grads.block, p.grads.shared_bytes),
        ((128, 64, 1), (256, 1, 1), grads_smem_bytes(128))
    );
    // B=H=1, T=1000, Dk 64, Dv 128: 16 segments of one chunk, so the forward's summaries of all
    // 16 (A [64 x 64], b [64 x 128]: the dS chain takes A_s^T of segments 1..15) and the 16
    // prefixes come before the backward's parts, and the dS gradients entering the segments after.
    // The summary launch computes 15 x 3 tiles and the last segment's one A tile, not its b.
    let s = shape(1, 1000, 1, 64, 128);
    let p = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::SingleGpu);
    assert_eq!((p.forward.num_segments, p.forward.num_summaries), (16, 16));
    assert_eq!(p.forward.summary.unwrap().grid, (15 * 3 + 1, 1, 1));
    assert_eq!(p.forward.fold.unwrap().grid, (2, 1, 1));
    assert_eq!(p.states.grid, (2, 16, 1));
    assert_eq!(p.dh_summary.unwrap().grid, (2, 15, 1));
    assert_eq!(
        (p.dh_fold.unwrap().grid, p.dh_fold.unwrap().block),
        ((2, 1, 1), (256, 1, 1))
    );
    assert_eq!(p.dh.grid, (2, 16, 1));
    let forward = 16 * 8_192 + 16 * 64 * 64 * 4 + 16 * 64 * 128 * 4 + 16 * 64 * 128 * 4;
    assert_eq!(p.forward.workspace_bytes, forward);
    let (w, u) = (16 * 64 * 64 * 2, 16 * 64 * 128 * 2);
    let states = 16 * 64 * 128 * 2;
    assert_eq!(
        (p.ws_w, p.ws_u, p.ws_du, p.ws_h, p.ws_dh),
        (
            forward,
            forward + w,
            forward + w + u,
            forward + w + 2 * u,
            forward + w + 2 * u + states
        )
    );
    let ws_ds = forward + w + 2 * u + 2 * states;
    assert_eq!(p.ws_ds, Some(ws_ds));
    assert_eq!(p.workspace_bytes, ws_ds + 16 * 64 * 128 * 4);
    // A forced count: the forward's rounding (16 chunks in 3 segments: 6, 6, 4).
    let p = GatedDeltaBackwardPlan::new(&s, 132, Some(3), Scope::SingleGpu);
    assert_eq!(
        (p.forward.num_segments, p.forward.chunks_per_segment),
        (3, 6)
    );
    assert_eq!(p.states.grid, (2, 3, 1));
}

#[test]
fn a_shard_backward_plan_summarises_every_segment_and_keeps_the_gradient_leaving_it() {
    // B=4 T=8K H=16 on 132 SMs: one segment, as on one GPU, but a LASP-2 shard still summarises
    // it (A_0 and c_0 make the shard's summary: A's two column tiles, not b's) and its fold writes
    // E into ws_e.
    let s = shape(4, 8192, 16, 128, 128);
    let one = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::SingleGpu);
    let p = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::Shard);
    assert_eq!((p.forward.num_segments, p.forward.num_summaries), (1, 1));
    assert_eq!(p.forward.summary.unwrap().grid, (2, 1, 64));
    assert_eq!(p.forward.fold.unwrap().grid, (2, 64, 1));
    assert_eq!(p.ds_summary_from, 0);
    assert_eq!(p.dh_summary.unwrap().grid, (2, 1, 64));
    assert_eq!(p.dh_fold.unwrap().grid, (2, 64, 1));
    assert_eq!(
        (p.dh, p.grads, p.wy, p.states),
        (one.dh, one.grads, one.wy, one.states)
    );
    let state = 64 * 128 * 128 * 4;
    let ws_ds = p.ws_dh + (64 * 128 * 128 * 128 * 2);
    assert_eq!(p.ws_ds, Some(ws_ds));
    assert_eq!(p.ws_e, Some(ws_ds + state));
    assert_eq!(p.workspace_bytes, ws_ds + 2 * state);
    // B=H=1, T=1000, Dk 64, Dv 128: 16 segments, all 16 dS-chain summaries (one GPU: 15).
    let s = shape(1, 1000, 1, 64, 128);
    let one = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::SingleGpu);
    let p = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::Shard);
    assert_eq!(p.forward, one.forward);
    assert_eq!((one.ds_summary_from, p.ds_summary_from), (1, 0));
    assert_eq!(
        (one.dh_summary.unwrap().grid, p.dh_summary.unwrap().grid),
        ((2, 15, 1), (2, 16, 1))
    );
    assert_eq!((one.ws_e, p.ws_ds), (None, one.ws_ds));
    let state = 64 * 128 * 4;
    assert_eq!(p.ws_e, Some(one.workspace_bytes));
    assert_eq!(p.workspace_bytes, one.workspace_bytes + state);
}

/// The summary tiles a launch of `grid` computes, as (b*H+h, segment, tile) in the order the CTAs
/// are numbered: the kernel's decoding (`summary_tile` in gated_delta/forward.cu) of CTA
/// (x, y, z) into segment `i / tiles` and tile `i % tiles` of `i = y * grid.x + x`, tiles below
/// `Dk/64` A's column blocks and the others b's Dv tiles.
fn summary_tiles(s: &ForwardShape, grid: (u32, u32, u32)) -> Vec<(u32, u32, u32)> {
    let tiles = ((s.dk + s.dv) / 64) as u32;
    let mut out = Vec::new();
    for z in 0..grid.2 {
        for y in 0..grid.1 {
            for x in 0..grid.0 {
                let i = y * grid.0 + x;
                out.push((z, i / tiles, i % tiles));
            }
        }
    }
    out
}

#[test]
fn the_backward_summary_computes_every_a_and_no_b_of_the_last_segment() {
    // (B, T, H, Dk, Dv, forced segments, scope): one segment in a shard (the common LASP-2 case),
    // several on one GPU and in a shard, Dk below and above Dv, a ragged last segment.
    let cases = [
        (4, 8192, 16, 128, 128, None, Scope::Shard),
        (1, 32768, 16, 128, 128, None, Scope::Shard),
        (1, 32768, 16, 128, 128, None, Scope::SingleGpu),
        (1, 1000, 1, 64, 128, None, Scope::SingleGpu),
        (2, 1000, 3, 128, 64, Some(3), Scope::Shard),
        (1, 100, 2, 64, 192, Some(2), Scope::SingleGpu),
    ];
    for (b, t, h, dk, dv, forced, scope) in cases {
        let s = shape(b, t, h, dk, dv);
        let p = GatedDeltaBackwardPlan::new(&s, 132, forced, scope);
        let forward = GatedDeltaPlan::new(&s, 132, forced, Scope::Shard);
        let segments = p.forward.num_segments;
        assert_eq!(
            (segments, p.forward.num_summaries),
            (forward.num_segments, segments)
        );
        let (a_tiles, tiles, bh) = ((dk / 64) as u32, ((dk + dv) / 64) as u32, (b * h) as u32);
        // The forward's launch, decoded the same way, is every tile of every segment.
        let full = forward.summary.unwrap();
        let mut every = Vec::new();
        for z in 0..bh {
            for seg in 0..segments {
                every.extend((0..tiles).map(|tile| (z, seg, tile)));
            }
        }
        assert_eq!(summary_tiles(&s, full.grid), every);
        // The backward's: the same tiles in the same order, less the last segment's b.
        let launch = p.forward.summary.unwrap();
        assert_eq!(Some(launch), summary_without_last_b(&s, &forward));
        assert_eq!(
            (launch.block, launch.shared_bytes),
            (full.block, full.shared_bytes)
        );
        let wanted: Vec<_> = every
            .into_iter()
            .filter(|&(_, seg, tile)| seg + 1 < segments || tile < a_tiles)
            .collect();
        assert_eq!(summary_tiles(&s, launch.grid), wanted);
        assert_eq!(
            wanted.len() as u32,
            bh * (segments * tiles - (dv / 64) as u32)
        );
    }
    // No summary, no launch: one GPU, one segment.
    let s = shape(4, 8192, 16, 128, 128);
    let p = GatedDeltaBackwardPlan::new(&s, 132, None, Scope::SingleGpu);
    assert_eq!(p.forward.summary, None);
    assert_eq!(summary_without_last_b(&s, &p.forward), None);
}

/// Well-formed backward arguments for `s` over fake addresses, h0, dht and dh0 present.
fn fake_backward_args(s: ForwardShape) -> GatedDeltaBackwardArgs<'static> {
    GatedDeltaBackwardArgs {
        shape: s,
        q: view::<bf16>(at(1), s.qk_len()),
        k: view::<bf16>(at(2), s.qk_len()),
        v: view::<bf16>(at(3), s.v_len()),
        g: view::<f32>(at(4), s.gate_len()),
        beta: view::<f32>(at(5), s.gate_len()),
        h0: Some(view::<f32>(at(6), s.state_len())),
        d_o: view::<bf16>(at(7), s.v_len()),
        dht: Some(view::<f32>(at(8), s.state_len())),
        dq: view_mut::<bf16>(at(9), s.qk_len()),
        dk: view_mut::<bf16>(at(10), s.qk_len()),
        dv: view_mut::<bf16>(at(11), s.v_len()),
        dg: view_mut::<f32>(at(12), s.gate_len()),
        dbeta: view_mut::<f32>(at(13), s.gate_len()),
        dh0: Some(view_mut::<f32>(at(14), s.state_len())),
        scale: None,
    }
}

fn backward_refused(args: GatedDeltaBackwardArgs<'_>, needle: &str) {
    match args.check("Gated DeltaNet backward") {
        Err(Error::InvalidArgument(msg)) => {
            assert!(msg.contains(needle), "{msg:?} does not say {needle:?}");
            assert!(msg.starts_with("Gated DeltaNet backward: "), "{msg:?}");
        }
        other => panic!("expected a refusal saying {needle:?}, got {other:?}"),
    }
}

#[test]
fn well_formed_backward_arguments_pass_with_or_without_the_optional_states() {
    let s = shape(2, 100, 3, 128, 192);
    let scale = fake_backward_args(s)
        .check("Gated DeltaNet backward")
        .unwrap();
    assert_eq!(scale, (1.0 / 128f64.sqrt()) as f32);
    let mut a = fake_backward_args(s);
    (a.h0, a.dht, a.dh0, a.scale) = (None, None, None, Some(0.5));
    assert_eq!(a.check("Gated DeltaNet backward").unwrap(), 0.5);
}

#[test]
fn every_backward_tensor_is_checked_before_any_launch() {
    let s = shape(2, 100, 3, 64, 64);
    let mut a = fake_backward_args(s);
    a.beta = view(at(5), s.gate_len() + 1);
    backward_refused(a, "beta has 601 elements but [B, T, H]");
    let mut a = fake_backward_args(s);
    a.d_o = view(at(7), s.v_len() - 1);
    backward_refused(a, "d_o has 38399 elements but [B, T, H, Dv]");
    let mut a = fake_backward_args(s);
    a.d_o = view(at(7) + 8, s.v_len());
    backward_refused(a, "d_o starts at device address");
    let mut a = fake_backward_args(s);
    a.dht = Some(view(at(8) + 4, s.state_len()));
    backward_refused(a, "dht starts at device address");
    let mut a = fake_backward_args(s);
    a.dq = view_mut(at(9), s.v_len() + 64);
    backward_refused(a, "dq has 38464 elements but [B, T, H, Dk]");
    let mut a = fake_backward_args(s);
    a.dk = view_mut(at(10) + 2, s.qk_len());
    backward_refused(a, "dk starts at device address");
    let mut a = fake_backward_args(s);
    a.dv = view_mut(at(11) + 8, s.v_len());
    backward_refused(a, "dv starts at device address");
    let mut a = fake_backward_args(s);
    a.dg = view_mut(at(12), s.qk_len());
    backward_refused(a, "dg has 38400 elements but [B, T, H]");
    let mut a = fake_backward_args(s);
    a.dbeta = view_mut(at(13) + 2, s.gate_len());
    backward_refused(a, "dbeta starts at device address");
    let mut a = fake_backward_args(s);
    a.dh0 = Some(view_mut(at(14) + 4, s.state_len()));
    backward_refused(a, "dh0 starts at device address");
    let mut a = fake_backward_args(s);
    a.scale = Some(f32::NAN);
    backward_refused(a, "scale = NaN must be finite and > 0");
}

#[test]
fn backward_outputs_overlap_no_input_and_no_other_output() {
    let s = shape(1, 64, 2, 64, 64);
    let mut a = fake_backward_args(s);
    a.dv = view_mut(at(7), s.v_len());
    backward_refused(a, "output dv overlaps input d_o");
    let mut a = fake_backward_args(s);
    a.dh0 = Some(view_mut(at(8), s.state_len()));
    backward_refused(a, "output dh0 overlaps input dht");
    let mut a = fake_backward_args(s);
    a.dg = view_mut(at(5), s.gate_len());
    backward_refused(a, "output dg overlaps input beta");
    let mut a = fake_backward_args(s);
    a.dbeta = view_mut(at(12) + 4 * 64, s.gate_len());
    backward_refused(a, "dg and dbeta overlap");
}

#[test]
fn unsupported_backward_widths_are_refused_with_what_to_do() {
    backward_refused(
        fake_backward_args(shape(1, 64, 1, 192, 64)),
        "Dk = 192 is not supported",
    );
    backward_refused(
        fake_backward_args(shape(1, 64, 1, 64, 100)),
        "Dv = 100 is not a positive multiple of 64",
    );
}

/// The first build's forward as its kernels round it, in f64 elsewhere: `(o, ht)` of every
/// (b, h), o `[B, T, H, Dv]` and ht `[B, H, Dk, Dv]` flattened. Rounded to bf16 where the kernels
/// hold bf16: the inputs (already), the inverse `(I + L)^{-1}`, the state copy the products read,
/// `R`, `u`, the scores, the weighted keys of the update and o; the state itself and the gates'
/// cumsums in fp32.
fn first_build_forward(inputs: &Inputs) -> (Vec<f64>, Vec<f64>) {
    let s = inputs.shape;
    let (dk, dv) = (s.dk, s.dv);
    let bf = |x: f64| bf16::from_f64(x).to_f64();
    let f32r = |x: f64| x as f32 as f64;
    let beta = inputs
        .beta
        .as_ref()
        .expect("the delta rule's inputs have beta");
    let mut o = vec![0.0; s.b * s.t * s.h * dv];
    let mut ht = vec![0.0; s.b * s.h * dk * dv];
    for (b, h) in (0..s.b).flat_map(|b| (0..s.h).map(move |h| (b, h))) {
        let mut state: Vec<f64> = (0..dk * dv)
            .map(|i| {
                inputs
                    .h0
                    .as_ref()
                    .map_or(0.0, |h0| h0.get(&[b, h, i / dv, i % dv]))
            })
            .collect();
        for c0 in (0..s.t).step_by(64) {
            // The chunk's rows, virtual ones (past T) zero.
            let row = |t: usize, f: &dyn Fn(usize) -> f64| if t < s.t { f(t) } else { 0.0 };
            let k: Vec<Vec<f64>> = (c0..c0 + 64)
                .map(|t| {
                    (0..dk)
                        .map(|d| row(t, &|t| inputs.k.get(&[b, t, h, d])))
                        .collect()
                })
                .collect();
            let q: Vec<Vec<f64>> = (c0..c0 + 64)
                .map(|t| {
                    (0..dk)
                        .map(|d| row(t, &|t| inputs.q.get(&[b, t, h, d])))
                        .collect()
                })
                .collect();
            let v: Vec<Vec<f64>> = (c0..c0 + 64)
                .map(|t| {
                    (0..dv)
                        .map(|e| row(t, &|t| inputs.v.get(&[b, t, h, e])))
                        .collect()
                })
                .collect();
            let betas: Vec<f64> = (c0..c0 + 64)
                .map(|t| row(t, &|t| beta.get(&[b, t, h])))
                .collect();
            let mut cum = Vec::with_capacity(64);
            let mut acc = 0f32;
            for t in c0..c0 + 64 {
                acc += row(t, &|t| inputs.g.get(&[b, t, h])) as f32;
                cum.push(f64::from(acc));
            }
            let gamma = cum[63];
            let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(a, b)| a * b).sum::<f64>();
            // (I + L)^{-1} in fp32, stored in bf16.
            let mut x: Vec<Vec<f64>> = Vec::with_capacity(64);
            for r in 0..64 {
                let l: Vec<f64> = (0..r)
                    .map(|j| f32r(betas[r] * (cum[r] - cum[j]).exp() * dot(&k[r], &k[j])))
                    .collect();
                let next = (0..64)
                    .map(|c| {
                        let diagonal = if r == c { 1.0 } else { 0.0 };
                        f32r(diagonal - l.iter().zip(&x).map(|(l, x)| l * x[c]).sum::<f64>())
                    })
                    .collect();
                x.push(next);
            }
            let tri: Vec<Vec<f64>> = x
                .iter()
                .map(|r| r.iter().map(|&v| bf(v)).collect())
                .collect();
            let state_bf: Vec<f64> = state.iter().map(|&v| bf(v)).collect();
            let times_state =
                |a: &[f64], e: usize| (0..dk).map(|d| a[d] * state_bf[d * dv + e]).sum::<f64>();
            // R, then u.
            let r: Vec<Vec<f64>> = (0..64)
                .map(|t| {
                    (0..dv)
                        .map(|e| bf(betas[t] * (v[t][e] - cum[t].exp() * times_state(&k[t], e))))
                        .collect()
                })
                .collect();
            let u: Vec<Vec<f64>> = (0..64)
                .map(|t| {
                    (0..dv)
                        .map(|e| bf((0..64).map(|j| tri[t][j] * r[j][e]).sum()))
                        .collect()
                })
                .collect();
            // O.
            for t in 0..64.min(s.t - c0) {
                let p: Vec<f64> = (0..64)
                    .map(|j| {
                        if j <= t {
                            bf(inputs.scale * dot(&q[t], &k[j]) * (cum[t] - cum[j]).exp())
                        } else {
                            0.0
                        }
                    })
                    .collect();
                for e in 0..dv {
                    let inter = inputs.scale * cum[t].exp() * times_state(&q[t], e);
                    let intra: f64 = (0..64).map(|j| p[j] * u[j][e]).sum();
                    o[((b * s.t + c0 + t) * s.h + h) * dv + e] = bf(inter + intra);
                }
            }
            // S <- e^gamma S + K~^T u.
            for d in 0..dk {
                for e in 0..dv {
                    let update: f64 = (0..64)
                        .map(|j| bf((gamma - cum[j]).exp() * k[j][d]) * u[j][e])
                        .sum();
                    state[d * dv + e] = f32r(gamma.exp() * state[d * dv + e] + update);
                }
            }
        }
        ht[(b * s.h + h) * dk * dv..][..dk * dv].copy_from_slice(&state);
    }
    (o, ht)
}

#[test]
fn the_first_builds_roundings_keep_the_gpu_tests_tolerance() {
    // The GPU tests hold o and ht to 5e-3 of the f64 recurrence: a model of the kernels'
    // roundings must stay inside that on their cases, every gate regime and beta at its ends.
    use crate::reference::{delta_rule, rel_err, Family, InputSpec, Regime, Shape};
    let cases = [
        (Regime::Typical, None, 128),
        (Regime::Mixed, None, 128),
        (Regime::StrongDecay, None, 64),
        (Regime::NoDecay, None, 64),
        (Regime::LargeNorm, None, 64),
        (Regime::Typical, Some(1.0), 128),
        (Regime::Mixed, Some(0.0), 64),
    ];
    for (seed, (regime, fill, d)) in cases.into_iter().enumerate() {
        let spec = InputSpec {
            shape: Shape {
                b: 1,
                t: 300,
                h: 1,
                dk: d,
                dv: d,
            },
            family: Family::DeltaRule,
            regime,
            seed: 40 + seed as u64,
            round_to_bf16: true,
            initial_state: true,
        };
        let mut inputs = crate::reference::Inputs::generate(&spec).unwrap();
        if let (Some(x), Some(beta)) = (fill, inputs.beta.as_mut()) {
            beta.data_mut().fill(x);
        }
        let want = delta_rule::recurrent_forward(&inputs).unwrap();
        let (o, ht) = first_build_forward(&inputs);
        let (e_o, e_ht) = (
            rel_err(&o, want.o.data()),
            rel_err(&ht, want.final_state.data()),
        );
        println!("{regime:?} beta {fill:?} D={d}: rel err o {e_o:.2e}, ht {e_ht:.2e}");
        assert!(
            e_o <= 5e-3 && e_ht <= 5e-3,
            "{regime:?} beta {fill:?}: o {e_o:.2e}, ht {e_ht:.2e}"
        );
    }
}

/// `(I - N)^{-1}` of a strictly lower `[64 x 64]` N (row-major) as the WY kernel computes it
/// (lasp/gated_delta/wy.cuh), in f64 and in the kernel's order: the diagonal 16 x 16 blocks
/// `D_k = (I - N_kk)^{-1}` by forward substitution (column c: `x_r = [r == c] + sum_{j < r}
/// N_kk[r][j] x_j`, j ascending), then the blocks below them by levels d = 1, 2, 3, each level's
/// blocks from the earlier levels': `X_{i,j} = D_i S` with `S = sum_{k=j}^{i-1} N_{i,k} X_{k,j}`,
/// `j = i - d`.
fn blocked_inverse(n: &[f64]) -> Vec<f64> {
    let at = |r: usize, c: usize| r * 64 + c;
    let mut x = vec![0.0; 64 * 64];
    for k in 0..4 {
        let o = 16 * k;
        for c in 0..16 {
            for r in 0..16 {
                let mut acc = if r == c { 1.0 } else { 0.0 };
                for j in 0..r {
                    acc += n[at(o + r, o + j)] * x[at(o + j, o + c)];
                }
                x[at(o + r, o + c)] = acc;
            }
        }
    }
    for d in 1..4 {
        for i in d..4 {
            let j = i - d;
            let mut s = [[0.0; 16]; 16];
            for k in j..i {
                for (r, row) in s.iter_mut().enumerate() {
                    for (c, e) in row.iter_mut().enumerate() {
                        *e += (0..16)
                            .map(|m| n[at(16 * i + r, 16 * k + m)] * x[at(16 * k + m, 16 * j + c)])
                            .sum::<f64>();
                    }
                }
            }
            for r in 0..16 {
                for c in 0..16 {
                    x[at(16 * i + r, 16 * j + c)] = (0..16)
                        .map(|m| x[at(16 * i + r, 16 * i + m)] * s[m][c])
                        .sum();
                }
            }
        }
    }
    x
}

#[test]
fn the_wy_kernels_blocked_inverse_is_the_substitutions() {
    // N = -L of a chunk as the kernel builds it (unit keys, beta in [0, 1), gates <= 0), its last
    // rows virtual tokens (k = 0, beta = 0: zero rows), against the whole-column substitution
    // X[r][c] = [r == c] + sum_{j < r} N[r][j] X[j][c].
    use crate::reference::SplitMix64;
    let mut rng = SplitMix64::new(0x5759_424c_4f43_4b53);
    for (valid, decay) in [(64, 0.05), (64, 1.0), (45, 0.2), (1, 0.1)] {
        let keys: Vec<Vec<f64>> = (0..64)
            .map(|t| {
                let k: Vec<f64> = (0..32).map(|_| rng.normal()).collect();
                let norm = k.iter().map(|x| x * x).sum::<f64>().sqrt();
                k.iter()
                    .map(|x| if t < valid { x / norm } else { 0.0 })
                    .collect()
            })
            .collect();
        let beta: Vec<f64> = (0..64)
            .map(|t| if t < valid { rng.uniform() } else { 0.0 })
            .collect();
        let mut b = [0.0f64; 64];
        let mut acc = 0.0;
        for (t, bt) in b.iter_mut().enumerate() {
            acc -= if t < valid {
                decay * rng.uniform()
            } else {
                0.0
            };
            *bt = acc;
        }
        let mut n = vec![0.0; 64 * 64];
        for r in 0..64 {
            for j in 0..r {
                let dot: f64 = keys[r].iter().zip(&keys[j]).map(|(x, y)| x * y).sum();
                n[r * 64 + j] = -beta[r] * (b[r] - b[j]).exp() * dot;
            }
        }
        let mut want = vec![0.0; 64 * 64];
        for r in 0..64 {
            for c in 0..64 {
                let diagonal = if r == c { 1.0 } else { 0.0 };
                want[r * 64 + c] = diagonal
                    + (0..r)
                        .map(|j| n[r * 64 + j] * want[j * 64 + c])
                        .sum::<f64>();
            }
        }
        let got = blocked_inverse(&n);
        let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f64, |m, (g, w)| m.max((g - w).abs()));
        assert!(
            err <= 1e-13 * scale,
            "{valid} valid tokens, decay {decay}: max error {err:.2e} of {scale:.2e}"
        );
        for r in valid..64 {
            for c in 0..64 {
                let identity = if r == c { 1.0 } else { 0.0 };
                assert_eq!(got[r * 64 + c], identity, "virtual row {r}, column {c}");
            }
        }
    }
}

#[test]
fn an_exchanged_tile_holds_b_and_its_share_of_a() {
    use crate::exchange::Lasp2Layout;
    use crate::family::Family;
    let floats =
        |dk, dv| super::GatedDelta::summary_tile_floats(&Lasp2Layout { b: 1, h: 1, dk, dv });
    // Dv >= Dk: b's block and at most one column block of A per tile.
    assert_eq!(floats(128, 128), 2 * 128 * 64);
    assert_eq!(floats(64, 128), 2 * 64 * 64);
    assert_eq!(floats(128, 192), 2 * 128 * 64);
    // One Dv tile at Dk = 128: it carries both column blocks of A.
    assert_eq!(floats(128, 64), 3 * 128 * 64);
    assert_eq!(floats(64, 64), 2 * 64 * 64);
}
