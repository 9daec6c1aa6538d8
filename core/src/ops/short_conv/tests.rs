//! The layout's and the arguments' checks, and the token groups' plan (no GPU: the views are
//! fake addresses that are only measured).

use super::*;
use crate::ops::{bf16, DeviceMut, DeviceRef};

const LAYOUT: ShortConvLayout = ShortConvLayout {
    batch: 2,
    channels: 64,
    kernel_size: 4,
};
const T: usize = 100;

fn message(result: Result<()>) -> String {
    result.expect_err("the check must refuse this").to_string()
}

#[test]
fn layouts_outside_the_kernels_are_refused() {
    for k in 1..=ShortConvLayout::MAX_KERNEL_SIZE {
        let layout = ShortConvLayout {
            kernel_size: k,
            ..LAYOUT
        };
        layout.validate().unwrap();
    }
    for (layout, says) in [
        (ShortConvLayout { batch: 0, ..LAYOUT }, "B = 0"),
        (
            ShortConvLayout {
                channels: 60,
                ..LAYOUT
            },
            "multiple of 8",
        ),
        (
            ShortConvLayout {
                kernel_size: 0,
                ..LAYOUT
            },
            "K = 0",
        ),
        (
            ShortConvLayout {
                kernel_size: 5,
                ..LAYOUT
            },
            "use 1 to 4",
        ),
    ] {
        let text = message(layout.validate());
        assert!(text.contains(says), "{says:?} not in {text}");
    }
}

#[test]
fn token_groups_cover_every_token_in_whole_waves() {
    for (batch, tiles) in [(1, 1), (4, 2), (8, 8), (64, 1), (1000, 4)] {
        let layout = ShortConvLayout {
            batch,
            channels: 8,
            kernel_size: 4,
        };
        for resident in [132, 396, 1056] {
            for tokens in [1, 2, 63, 64, 65, 100, 1000, 8191, 131_072] {
                let groups = layout.token_groups(tokens, tiles, resident);
                let per_group = tokens.div_ceil(groups);
                assert!(groups >= 1 && groups * batch <= MAX_GRID_Y);
                assert!(
                    groups * per_group >= tokens,
                    "T={tokens}: {groups} x {per_group}"
                );
                assert!(
                    (groups - 1) * per_group < tokens,
                    "T={tokens}: an empty group"
                );
                assert!(groups == 1 || per_group >= MIN_TOKENS_PER_GROUP);
                assert!(groups * tiles * batch <= (MAX_WAVES * resident).max(tiles * batch));
            }
        }
    }
    // B = 4, 2 channel tiles, 396 resident CTAs: two whole waves of 99 groups.
    let layout = ShortConvLayout {
        batch: 4,
        channels: 2048,
        kernel_size: 4,
    };
    assert_eq!(layout.token_groups(8192, 2, 396), 99);
    // A long sequence: four waves.
    assert_eq!(layout.token_groups(131_072, 2, 396), 198);
}

/// Fake views of `len` elements at distinct, aligned addresses.
struct Fake {
    next: u64,
}

impl Fake {
    fn new() -> Self {
        Fake { next: 1 << 20 }
    }

    fn bump<T>(&mut self, len: usize) -> u64 {
        let addr = self.next;
        self.next += ((len * std::mem::size_of::<T>()) as u64).div_ceil(256) * 256 + 256;
        addr
    }

    fn r<T>(&mut self, len: usize) -> DeviceRef<'static, T> {
        let addr = self.bump::<T>(len);
        // SAFETY: never launched; the checks only read the address and the length.
        unsafe { DeviceRef::from_raw(addr, len) }
    }

    fn w<T>(&mut self, len: usize) -> DeviceMut<'static, T> {
        let addr = self.bump::<T>(len);
        // SAFETY: as above.
        unsafe { DeviceMut::from_raw(addr, len) }
    }
}

fn activations() -> usize {
    LAYOUT.batch * T * LAYOUT.channels
}

fn forward_args(fake: &mut Fake) -> ShortConvArgs<'static> {
    ShortConvArgs {
        tokens: T,
        x: fake.r::<bf16>(activations()),
        weight: fake.r::<f32>(LAYOUT.channels * LAYOUT.kernel_size),
        bias: Some(fake.r::<f32>(LAYOUT.channels)),
        activation: Activation::Silu,
        y: fake.w::<bf16>(activations()),
        saved_halo: Some(fake.w::<bf16>(LAYOUT.halo_len())),
        documents: None,
    }
}

fn backward_args(fake: &mut Fake) -> ShortConvGradArgs<'static> {
    ShortConvGradArgs {
        tokens: T,
        x: fake.r::<bf16>(activations()),
        halo: Some(fake.r::<bf16>(LAYOUT.halo_len())),
        weight: fake.r::<f32>(LAYOUT.channels * LAYOUT.kernel_size),
        bias: Some(fake.r::<f32>(LAYOUT.channels)),
        activation: Activation::Identity,
        dy: fake.r::<bf16>(activations()),
        dx: fake.w::<bf16>(activations()),
        d_weight: fake.w::<f32>(LAYOUT.channels * LAYOUT.kernel_size),
        d_bias: Some(fake.w::<f32>(LAYOUT.channels)),
        documents: None,
    }
}

#[test]
fn forward_arguments_are_checked_before_any_launch() {
    let mut fake = Fake::new();
    forward_args(&mut fake).check(FORWARD, LAYOUT).unwrap();

    let mut args = forward_args(&mut fake);
    args.tokens = 0;
    assert!(message(args.check(FORWARD, LAYOUT)).contains("0 tokens"));

    let mut args = forward_args(&mut fake);
    args.x = fake.r::<bf16>(activations() - 8);
    let text = message(args.check(FORWARD, LAYOUT));
    assert!(
        text.contains("x has") && text.contains("[B, T, C]"),
        "{text}"
    );

    let mut args = forward_args(&mut fake);
    // SAFETY: as in Fake.
    args.y = unsafe { DeviceMut::from_raw(fake.bump::<bf16>(activations()) + 2, activations()) };
    assert!(message(args.check(FORWARD, LAYOUT)).contains("16-byte aligned"));

    let mut args = forward_args(&mut fake);
    // SAFETY: as in Fake; y over x, which the check must refuse.
    args.y = unsafe { DeviceMut::from_raw(args.x.addr(), activations()) };
    assert!(message(args.check(FORWARD, LAYOUT)).contains("output y overlaps input x"));

    let mut args = forward_args(&mut fake);
    args.saved_halo = Some(fake.w::<bf16>(LAYOUT.halo_len() + 8));
    assert!(message(args.check(FORWARD, LAYOUT)).contains("[B, K-1, C]"));
}

#[test]
fn backward_arguments_are_checked_before_any_launch() {
    let mut fake = Fake::new();
    backward_args(&mut fake)
        .check(BACKWARD, LAYOUT, true)
        .unwrap();

    let mut args = backward_args(&mut fake);
    args.halo = None;
    assert!(message(args.check(BACKWARD, LAYOUT, true)).contains("pass the forward's saved_halo"));
    // The first PE's halo is zeros: None is fine there, and with K = 1 everywhere.
    args.check(BACKWARD, LAYOUT, false).unwrap();

    let mut args = backward_args(&mut fake);
    args.d_bias = None;
    assert!(message(args.check(BACKWARD, LAYOUT, true)).contains("d_bias missing"));

    let mut args = backward_args(&mut fake);
    args.d_weight = fake.w::<f32>(LAYOUT.channels * 3);
    assert!(message(args.check(BACKWARD, LAYOUT, true)).contains("[C, K]"));

    let mut args = backward_args(&mut fake);
    // SAFETY: as in Fake; dx over dy, which the check must refuse.
    args.dx = unsafe { DeviceMut::from_raw(args.dy.addr(), activations()) };
    assert!(message(args.check(BACKWARD, LAYOUT, true)).contains("output dx overlaps input dy"));
}
