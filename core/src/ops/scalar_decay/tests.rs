//! Unit tests of the forward's host side: the geometry formulas' values, plans, shape and argument
//! checks, and the gate contract.

use super::geometry as g;
use super::*;
use crate::error::{Error, Result};
use crate::ops::{DeviceMut, DeviceRef};

#[test]
fn every_probe_kernel_is_in_the_cubin_at_its_dk_index() {
    assert_eq!(OutputProbe::Output.probe_kernel_names(), None);
    for probe in OutputProbe::ALL {
        let Some(names) = probe.probe_kernel_names() else {
            continue;
        };
        for (name, dk) in names.into_iter().zip([64, 128]) {
            assert!(
                name.starts_with(&format!("lasp_scalar_decay_output_dk{dk}_probe_")),
                "{name} is not the Dk {dk} kernel of {}",
                probe.label()
            );
            assert!(
                lasp_shmem_kernels::KERNEL_NAMES.contains(&name),
                "{name} is not declared by the kernels"
            );
        }
    }
}

#[test]
fn two_ctas_per_sm_only_where_one_per_tile_leaves_sms_idle() {
    // B=4, H=16, Dv=128: one CTA per SM keeps sequences whole; a second would add a states pass.
    assert_eq!(g::target_ctas(4, 16, 8192, 128, 132), 132);
    assert_eq!(g::num_segments(4, 16, 8192, 128, 132), 1);
    // B=1: one per SM already splits into 4 segments, so two per SM and 8 segments.
    assert_eq!(g::target_ctas(1, 16, 32768, 128, 132), 264);
    assert_eq!(g::num_segments(1, 16, 32768, 128, 264), 8);
    // A sequence of one chunk cannot be split: one per SM.
    assert_eq!(g::target_ctas(1, 1, 64, 64, 132), 132);
}

#[test]
fn shared_memory_and_workspace_formulas() {
    // 2 stages x (Q, K, V tile, gates) + 2 bf16 state tiles; two Dk=128 output CTAs fit the
    // 228 KiB of an H100/H200 SM (with 1 KiB reserved per CTA).
    assert_eq!(g::output_smem_bytes(128), 115_200);
    assert_eq!(g::output_smem_bytes(64), 66_048);
    // 4 stages x (K, V tile, gates): two Dk=128 states CTAs per SM.
    assert_eq!(g::states_smem_bytes(128), 99_328);
    assert_eq!(g::states_smem_bytes(64), 66_560);
    assert!(2 * (g::states_smem_bytes(128) + 1024) <= 228 * 1024);
    assert!(2 * (g::output_smem_bytes(128) + 1024) <= 228 * 1024);
    // 4 stages x (Q, K, V tile, gates) + 2 bf16 state tiles + mbarriers, rounded up to 1 KiB, then
    // O's staging tile: one two-role CTA per SM.
    assert_eq!(g::roles_smem_bytes(128), 198_656 + 8_192);
    assert_eq!(g::roles_smem_bytes(64), 116_736 + 8_192);
    assert!(g::roles_smem_bytes(128) + 1024 <= 228 * 1024);
    // B*H*(S-1)*(2*Dk*Dv + 1)*4, with the values gcc computed from the header.
    assert_eq!(g::workspace_bytes(1, 1, 1, 128, 128), 0);
    assert_eq!(g::workspace_bytes(1, 1, 2, 128, 128), 131_076);
    assert_eq!(g::workspace_bytes(1, 1, 16, 128, 128), 1_966_140);
    assert_eq!(g::workspace_bytes(1, 16, 4, 128, 128), 6_291_648);
    assert_eq!(g::workspace_bytes(1, 1, 64, 128, 128), 8_257_788);
    for (b, h, s, dk, dv) in [(2, 3, 5, 64, 192), (1, 16, 4, 128, 128)] {
        let state = g::ws_state_bytes(b, h, s, dk, dv);
        assert_eq!(state, (b * h * (s - 1) * dk * dv * 4) as u64);
        assert_eq!(g::ws_p_offset(b, h, s, dk, dv), state);
        assert_eq!(g::ws_lambda_offset(b, h, s, dk, dv), 2 * state);
        assert_eq!(
            g::workspace_bytes(b, h, s, dk, dv),
            (b * h * (s - 1) * (2 * dk * dv + 1) * 4) as u64
        );
    }
}

#[test]
fn segment_formula_matches_the_header_values() {
    // (B, H, T, Dv, target) -> (S, chunks per segment), as gcc computed them from the header.
    let cases = [
        ((1, 1, 1, 128, 132), (1, 1)),
        ((1, 1, 64, 128, 132), (1, 1)),
        ((1, 1, 65, 128, 132), (2, 1)),
        ((1, 256, 65, 128, 132), (1, 2)),
        ((1, 1, 1000, 128, 132), (16, 1)),
        ((1, 16, 1000, 128, 132), (4, 4)),
        ((1, 1, 8191, 128, 132), (64, 2)),
        ((1, 16, 8192, 128, 132), (4, 32)),
        ((1, 16, 32768, 128, 132), (4, 128)),
        ((1, 16, 131072, 128, 132), (4, 512)),
        ((4, 16, 8192, 128, 132), (1, 128)),
        ((1, 1, 131072, 128, 132), (64, 32)),
    ];
    for ((b, h, t, dv, target), want) in cases {
        let s = g::num_segments(b, h, t, dv, target);
        assert_eq!((s, g::chunks_per_segment(t, s)), want, "B={b} H={h} T={t}");
    }
    assert_eq!(g::output_grid(1, 16, 128, 4), (2, 4, 16));
    assert_eq!(g::states_grid(1, 16, 128, 4), (2, 3, 16));
    assert_eq!(g::fold_grid(1, 16, 128, 128), (64, 16, 1));
    assert_eq!(g::fold_grid(2, 3, 64, 192), (48, 6, 1));
}

#[test]
fn no_segment_is_ever_empty() {
    for nc in 1..300 {
        let t = nc * 64 - 5;
        for target in [1, 7, 64, 132, 264, 1000] {
            for bh in [1, 3, 16] {
                let s = g::num_segments(1, bh, t, 64, target);
                let cps = g::chunks_per_segment(t, s);
                assert!(
                    s >= 1 && (s - 1) * cps < nc && s * cps >= nc,
                    "nc={nc} s={s}"
                );
            }
        }
        for want in 1..=(nc as u32 + 3) {
            let shape = ForwardShape {
                b: 1,
                t: t as usize,
                h: 1,
                dk: 64,
                dv: 64,
            };
            let p = ForwardPlan::new(&shape, 132, Some(want)).unwrap();
            let (s, cps) = (p.num_segments as i32, p.chunks_per_segment as i32);
            assert!(s <= want as i32 && (s - 1) * cps < nc && s * cps >= nc);
            assert_eq!(cps, g::chunks_per_segment(t, s));
        }
    }
}

#[test]
fn plan_launches_and_forced_segments() {
    let shape = ForwardShape {
        b: 1,
        t: 1000,
        h: 1,
        dk: 128,
        dv: 128,
    };
    let auto = ForwardPlan::new(&shape, 132, None).unwrap();
    assert_eq!(
        (auto.num_chunks, auto.num_segments, auto.chunks_per_segment),
        (16, 16, 1)
    );
    assert_eq!(auto.states.unwrap().grid, (2, 15, 1));
    assert_eq!(auto.states.unwrap().shared_bytes, 99_328);
    assert_eq!(auto.fold.unwrap().grid, (64, 1, 1));
    assert_eq!(auto.output.grid, (2, 16, 1));
    assert_eq!(auto.output.shared_bytes, 115_200);
    assert_eq!((auto.output.block, auto.output_roles), ((128, 1, 1), false));
    assert_eq!(auto.workspace_bytes, 1_966_140);
    assert_eq!(auto.workspace_offsets(), (15 * 65536, 30 * 65536));
    let five = ForwardPlan::new(&shape, 132, Some(5)).unwrap();
    assert_eq!((five.num_segments, five.chunks_per_segment), (4, 4));
    let one = ForwardPlan::new(&shape, 132, Some(1)).unwrap();
    assert_eq!((one.num_segments, one.workspace_bytes), (1, 0));
    assert!(one.states.is_none() && one.fold.is_none());
    assert_eq!(one.output.grid, (2, 1, 1));
    // One segment: the two-role output kernel.
    assert_eq!((one.output.block, one.output_roles), ((288, 1, 1), true));
    assert_eq!(one.output.shared_bytes, 198_656 + 8_192);
    let many = ForwardPlan::new(&shape, 132, Some(1000)).unwrap();
    assert_eq!(many.num_segments, 16);
    let long = ForwardShape {
        t: 70_000 * 64,
        ..shape
    };
    let msg = err_text(ForwardPlan::new(&long, 132, Some(70_000)));
    assert!(msg.contains("70000 segments"), "{msg}");
    // 70000 chunks over 65535 requested segments: 2 chunks each, so 35000 segments.
    let p = ForwardPlan::new(&long, 132, Some(65_535)).unwrap();
    assert_eq!((p.num_segments, p.chunks_per_segment), (35_000, 2));
    assert!(ForwardPlan::new(&shape, 132, Some(0)).is_err());
}

fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
    match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn unsupported_shapes_are_rejected_with_advice() {
    let ok = ForwardShape {
        b: 2,
        t: 100,
        h: 4,
        dk: 64,
        dv: 192,
    };
    ok.validate().unwrap();
    let msg = err_text(ForwardShape { dk: 96, ..ok }.validate());
    assert!(msg.contains("Dk = 96") && msg.contains("pad"), "{msg}");
    let msg = err_text(ForwardShape { dv: 100, ..ok }.validate());
    assert!(
        msg.contains("Dv = 100") && msg.contains("multiple of 64"),
        "{msg}"
    );
    let msg = err_text(ForwardShape { t: 0, ..ok }.validate());
    assert!(msg.contains("T=0"), "{msg}");
    let msg = err_text(
        ForwardShape {
            b: 1024,
            h: 128,
            ..ok
        }
        .validate(),
    );
    assert!(
        msg.contains("65535") && msg.contains("511 sequences"),
        "{msg}"
    );
    let msg = err_text(ForwardShape { t: MAX_T + 1, ..ok }.validate());
    assert!(msg.contains("ht -> h0"), "{msg}");
}

/// Args over fake, well-separated, aligned addresses (only checked, never launched).
fn fake_args(shape: ForwardShape, h0: bool, ht: bool) -> ForwardArgs<'static> {
    let region = |i: u64| i << 36;
    // SAFETY: never dereferenced.
    unsafe {
        ForwardArgs {
            shape,
            q: DeviceRef::from_raw(region(1), shape.qk_len()),
            k: DeviceRef::from_raw(region(2), shape.qk_len()),
            v: DeviceRef::from_raw(region(3), shape.v_len()),
            g: DeviceRef::from_raw(region(4), shape.gate_len()),
            h0: h0.then(|| DeviceRef::from_raw(region(5), shape.state_len())),
            o: DeviceMut::from_raw(region(6), shape.v_len()),
            ht: ht.then(|| DeviceMut::from_raw(region(7), shape.state_len())),
            scale: None,
        }
    }
}

#[test]
fn argument_checks() {
    let shape = ForwardShape {
        b: 2,
        t: 100,
        h: 3,
        dk: 128,
        dv: 64,
    };
    let scale = check_args(&fake_args(shape, true, true)).unwrap();
    assert_eq!(scale, (1.0f64 / 128f64.sqrt()) as f32);
    check_args(&fake_args(shape, false, false)).unwrap();

    let mut a = fake_args(shape, true, true);
    // SAFETY: a view of a fake address, only checked, never launched.
    a.q = unsafe { DeviceRef::from_raw(a.q.addr(), a.q.len() - 1) };
    let msg = err_text(check_args(&a));
    assert!(
        msg.contains("q has 76799 elements") && msg.contains("76800"),
        "{msg}"
    );

    let mut a = fake_args(shape, true, true);
    // SAFETY: a view of a fake address, only checked, never launched.
    a.ht = Some(unsafe { DeviceMut::from_raw(1 << 40, 5) });
    assert!(err_text(check_args(&a)).contains("ht has 5 elements"));

    let mut a = fake_args(shape, true, true);
    // SAFETY: a view of a fake address, only checked, never launched.
    a.v = unsafe { DeviceRef::from_raw(a.v.addr() + 2, a.v.len()) };
    let msg = err_text(check_args(&a));
    assert!(
        msg.contains("v starts at") && msg.contains("16-byte"),
        "{msg}"
    );

    let mut a = fake_args(shape, true, true);
    // SAFETY: a view of a fake address, only checked, never launched.
    a.h0 = Some(unsafe { DeviceRef::from_raw((5 << 36) + 4, shape.state_len()) });
    assert!(err_text(check_args(&a)).contains("8-byte"));

    let mut a = fake_args(shape, true, true);
    a.scale = Some(0.0);
    assert!(err_text(check_args(&a)).contains("scale = 0"));
    a.scale = Some(f32::NAN);
    assert!(err_text(check_args(&a)).contains("finite"));

    // ht overlapping h0 (in place) is refused with advice.
    let mut a = fake_args(shape, true, true);
    let h0 = a.h0.unwrap();
    // SAFETY: a view of a fake address, only checked, never launched.
    a.ht = Some(unsafe { DeviceMut::from_raw(h0.addr(), h0.len()) });
    let msg = err_text(check_args(&a));
    assert!(
        msg.contains("ht overlaps input h0") && msg.contains("copy ht"),
        "{msg}"
    );

    // o overlapping q.
    let mut a = fake_args(shape, true, true);
    // SAFETY: a view of a fake address, only checked, never launched.
    a.o = unsafe { DeviceMut::from_raw(a.q.addr() + 64, shape.v_len()) };
    assert!(err_text(check_args(&a)).contains("o overlaps input q"));

    // o overlapping ht.
    let mut a = fake_args(shape, true, true);
    // SAFETY: a view of a fake address, only checked, never launched.
    a.ht = Some(unsafe { DeviceMut::from_raw(a.o.addr() + 1024, shape.state_len()) });
    assert!(err_text(check_args(&a)).contains("o and ht overlap"));
}

#[test]
fn gate_contract_names_the_first_bad_gate() {
    let shape = ForwardShape {
        b: 2,
        t: 5,
        h: 3,
        dk: 64,
        dv: 64,
    };
    let mut g = vec![-0.5f32; shape.gate_len()];
    g[0] = 0.0;
    check_gate_values(&g, &shape).unwrap();
    // flat = (b*T + t)*H + h = (1*5 + 2)*3 + 1 = 22
    g[22] = 0.25;
    let msg = err_text(check_gate_values(&g, &shape));
    assert!(
        msg.contains("g[b=1, t=2, h=1]") && msg.contains("positive"),
        "{msg}"
    );
    g[22] = -0.5;
    g[29] = f32::NEG_INFINITY;
    let msg = err_text(check_gate_values(&g, &shape));
    assert!(
        msg.contains("g[b=1, t=4, h=2]") && msg.contains("not finite"),
        "{msg}"
    );
}
