//! Unit tests of Gated DeltaNet's host side: the shared-memory and workspace formulas against the
//! header's, and the argument checks, which run before anything is launched.

use super::forward::{output_smem_bytes, workspace_bytes, wy_smem_bytes};
use super::GatedDeltaArgs;
use crate::error::Error;
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef};

fn shape(b: usize, t: usize, h: usize, dk: usize, dv: usize) -> ForwardShape {
    ForwardShape { b, t, h, dk, dv }
}

#[test]
fn shared_memory_and_workspace_follow_the_header() {
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
    // One bf16 [64 x 64] tile per chunk and head: B=4, T=8K, H=16 is 64 heads x 128 chunks.
    assert_eq!(
        workspace_bytes(&shape(4, 8192, 16, 128, 128)),
        64 * 128 * 8_192
    );
    // A ragged last chunk has its tile too.
    assert_eq!(workspace_bytes(&shape(1, 65, 1, 64, 64)), 2 * 8_192);
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
