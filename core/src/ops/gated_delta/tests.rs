//! Unit tests of Gated DeltaNet's host side: the shared-memory and workspace formulas against the
//! header's, and the argument checks, which run before anything is launched.

use super::forward::{fold_smem_bytes, output_smem_bytes, wy_smem_bytes};
use super::{GatedDeltaArgs, GatedDeltaPlan};
use crate::error::Error;
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef};

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
    // The K tile, 64 gates and 64 betas, L as 64 rows of 65 floats.
    assert_eq!(wy_smem_bytes(128), 16_384 + 512 + 16_640);
    assert_eq!(wy_smem_bytes(64), 8_192 + 512 + 16_640);
    assert_eq!(fold_smem_bytes(128), 32_768);
}

#[test]
fn plans_fill_the_sms_once_with_segments_where_the_batch_is_short() {
    // B=4, H=16: 128 output CTAs already, one segment; the workspace is the inverses alone (64
    // heads x 128 chunks x 8 KiB).
    let p = GatedDeltaPlan::new(&shape(4, 8192, 16, 128, 128), 132, None);
    assert_eq!((p.num_segments, p.chunks_per_segment), (1, 128));
    assert_eq!((p.summary, p.fold), (None, None));
    assert_eq!(p.output.grid, (2, 1, 64));
    assert_eq!(p.wy.grid, (128, 64, 1));
    assert_eq!(p.workspace_bytes, 64 * 128 * 8_192);
    // B=1, H=16, T=32K: 32 CTAs a segment, so four segments of 128 chunks; summaries of the first
    // three (A and b, two column tiles each), their fold per Dv tile.
    let p = GatedDeltaPlan::new(&shape(1, 32768, 16, 128, 128), 132, None);
    assert_eq!((p.num_segments, p.chunks_per_segment), (4, 128));
    assert_eq!(p.summary.unwrap().grid, (4, 3, 16));
    assert_eq!(p.fold.unwrap().grid, (2, 16, 1));
    assert_eq!(p.output.grid, (2, 4, 16));
    let tri = 16 * 512 * 8_192;
    let summary = 16 * 3 * 128 * 128 * 4;
    assert_eq!(p.summary_offsets, (tri, tri + summary, tri + 2 * summary));
    assert_eq!(p.workspace_bytes, tri + 3 * summary);
}

#[test]
fn forced_segment_counts_leave_no_segment_empty() {
    // 16 chunks in 5 segments: 4 chunks each, so 4 segments.
    let p = GatedDeltaPlan::new(&shape(1, 1000, 1, 64, 64), 132, Some(5));
    assert_eq!((p.num_segments, p.chunks_per_segment), (4, 4));
    // More segments than chunks: one chunk each.
    let p = GatedDeltaPlan::new(&shape(1, 100, 1, 64, 64), 132, Some(100));
    assert_eq!((p.num_segments, p.chunks_per_segment), (2, 1));
    // One token: one segment whatever the GPU.
    let p = GatedDeltaPlan::new(&shape(1, 1, 1, 64, 64), 132, None);
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
    match args.check() {
        Err(Error::InvalidArgument(msg)) => {
            assert!(msg.contains(needle), "{msg:?} does not say {needle:?}");
            assert!(msg.starts_with("Gated DeltaNet forward: "), "{msg:?}");
        }
        other => panic!("expected a refusal saying {needle:?}, got {other:?}"),
    }
}

#[test]
fn well_formed_arguments_pass_with_the_default_scale() {
    let scale = fake_args(shape(2, 100, 3, 128, 192)).check().unwrap();
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
