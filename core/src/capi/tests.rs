//! Unit tests of the C ABI's host side, no GPU needed: the exported functions against the
//! header, the checks of options, descriptors, calls and tensor slots, and the entry points'
//! answers to arguments they refuse before using a runtime. (core/tests/c_abi.rs compiles the
//! header and compares the structs' layout and the codes' values with the mirrors here.)

use super::families::Direction;
use super::runtime::config_of;
use super::spec::{Kind, OpSpec};
use super::status::*;
use super::tensors::plan_call;
use super::*;
use crate::ops::scalar_decay::lasp2::ExchangeMode;
use std::collections::BTreeSet;
use std::ffi::CStr;
use std::path::PathBuf;
use std::time::Duration;

const HEADER: &str = include_str!("../../include/lasp_shmem.h");

fn last_error() -> String {
    // SAFETY: lasp_last_error returns a NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(lasp_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn the_header_declares_exactly_the_exported_functions() {
    let sources = [
        include_str!("mod.rs"),
        include_str!("abi.rs"),
        include_str!("args.rs"),
        include_str!("families.rs"),
        include_str!("handles.rs"),
        include_str!("op.rs"),
        include_str!("runtime.rs"),
        include_str!("scalar_decay.rs"),
        include_str!("spec.rs"),
        include_str!("status.rs"),
        include_str!("tensors.rs"),
    ];
    let exported: BTreeSet<&str> = sources
        .iter()
        .flat_map(|s| s.split("extern \"C\" fn ").skip(1))
        .map(|rest| rest.split('(').next().expect("a name"))
        .collect();
    // The identifier before each '(' of the header, where it names a lasp_ function.
    let declared: BTreeSet<&str> = HEADER
        .split('(')
        .filter_map(|before| {
            before
                .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
        })
        .filter(|w| w.starts_with("lasp_"))
        .collect();
    assert_eq!(exported, declared);
    assert_eq!(exported.len(), 18);
}

#[test]
fn options_are_read_and_checked() {
    // SAFETY: NULL stands for every default.
    let defaults = unsafe { config_of(std::ptr::null()) }.unwrap();
    assert_eq!(defaults.symmetric_heap_bytes, 256 << 20);
    let library = c"/opt/nvshmem/lib/libnvshmem_host.so.3";
    let options = RuntimeOptions {
        struct_size: size_of::<RuntimeOptions>() as u32,
        abi_version: ABI_VERSION,
        symmetric_heap_bytes: 1 << 30,
        wait_timeout_ms: 2500,
        nvshmem_library: library.as_ptr(),
    };
    // SAFETY: a valid struct with a NUL-terminated path.
    let config = unsafe { config_of(&options) }.unwrap();
    assert_eq!(config.symmetric_heap_bytes, 1 << 30);
    assert_eq!(config.wait_timeout, Duration::from_millis(2500));
    assert_eq!(
        config.nvshmem_library.unwrap(),
        PathBuf::from("/opt/nvshmem/lib/libnvshmem_host.so.3")
    );
    let msg = |o: RuntimeOptions| {
        // SAFETY: as the call above.
        unsafe { config_of(&o) }.unwrap_err().to_string()
    };
    let stale = msg(RuntimeOptions {
        abi_version: 1,
        ..options
    });
    assert!(
        stale.contains("abi_version is 1 but this library is lasp-shmem"),
        "{stale}"
    );
    let unsized_ = msg(RuntimeOptions {
        struct_size: 0,
        ..options
    });
    assert!(
        unsized_.contains("options.struct_size is 0; set it to sizeof(lasp_runtime_options)"),
        "{unsized_}"
    );
    let bigger = msg(RuntimeOptions {
        struct_size: 40,
        ..options
    });
    assert!(
        bigger.contains("options.struct_size is 40 but")
            && bigger.contains("knows lasp_runtime_options of 32 bytes"),
        "{bigger}"
    );
}

/// A valid descriptor of scalar decay: LASP-2 with its backward, B=2, H=3, Dk=Dv=64.
fn lasp2_desc() -> OpDesc {
    OpDesc {
        family: LASP_FAMILY_SCALAR_DECAY,
        kind: LASP_KIND_LASP2,
        batch: 2,
        heads: 3,
        dk: 64,
        dv: 64,
        flags: LASP_OP_WITH_BACKWARD,
        ..OpDesc::default()
    }
}

fn desc_error(desc: OpDesc) -> String {
    match OpSpec::of(&desc) {
        Ok(_) => panic!("{desc:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn descriptors_are_checked_field_by_field() {
    let spec = OpSpec::of(&lasp2_desc()).unwrap();
    assert_eq!(
        spec.kind,
        Kind::Lasp2 {
            mode: ExchangeMode::Overlapped
        }
    );
    assert!(spec.with_backward && spec.tokens.is_none());
    let cases: [(OpDesc, &str); 13] = [
        (
            OpDesc {
                abi_version: 1,
                ..lasp2_desc()
            },
            "desc.abi_version is 1 but this library is lasp-shmem",
        ),
        (
            OpDesc {
                reserved: [0, 0, 5, 0, 0, 0, 0, 0],
                ..lasp2_desc()
            },
            "desc.reserved[2] is 0x5; reserved fields must be 0",
        ),
        (
            OpDesc {
                flags: 6,
                ..lasp2_desc()
            },
            "desc.flags has bits 0x6 that",
        ),
        (
            OpDesc {
                family: 0,
                ..lasp2_desc()
            },
            "desc.family is 0",
        ),
        (
            OpDesc {
                family: LASP_FAMILY_MLSTM,
                dv: 256,
                ..lasp2_desc()
            },
            "mLSTM forward: Dv = 256 is not supported",
        ),
        (
            OpDesc {
                family: 99,
                ..lasp2_desc()
            },
            "desc.family 99 is not a LASP_FAMILY_* value",
        ),
        (
            OpDesc {
                kind: 7,
                ..lasp2_desc()
            },
            "desc.kind 7 is not one of LASP_KIND_SINGLE_GPU (1), LASP_KIND_LASP2 (2)",
        ),
        (
            OpDesc {
                schedule: LASP_SCHEDULE_PIPELINED_CHAIN,
                ..lasp2_desc()
            },
            "schedule LASP_SCHEDULE_PIPELINED_CHAIN is not available at creation",
        ),
        (
            OpDesc {
                schedule: 9,
                ..lasp2_desc()
            },
            "desc.schedule 9 is not one of",
        ),
        (
            OpDesc {
                mode: 5,
                ..lasp2_desc()
            },
            "exchange mode 5 is not one of LASP_MODE_OVERLAPPED (0)",
        ),
        (
            OpDesc {
                kind: LASP_KIND_SINGLE_GPU,
                mode: LASP_MODE_SEQUENTIAL_NCCL,
                ..lasp2_desc()
            },
            "a LASP_KIND_SINGLE_GPU op exchanges nothing; leave both 0",
        ),
        (
            OpDesc {
                dk: 96,
                ..lasp2_desc()
            },
            "Dk = 96 is not supported",
        ),
        (
            OpDesc {
                dv: 192,
                ..lasp2_desc()
            },
            "the backward takes Dv 64 or 128",
        ),
    ];
    for (desc, fragment) in cases {
        let msg = desc_error(desc);
        assert!(msg.contains(fragment), "{fragment:?} not in {msg:?}");
    }
    assert!(desc_error(OpDesc {
        heads: -1,
        ..lasp2_desc()
    })
    .contains("desc.heads = -1 is negative"));
    // A forward-only op takes any multiple of 64.
    let wide = OpDesc {
        dv: 192,
        flags: 0,
        ..lasp2_desc()
    };
    assert!(OpSpec::of(&wide).is_ok());
    // The all-gather schedule by name, and every mode, are accepted.
    for mode in [
        LASP_MODE_OVERLAPPED,
        LASP_MODE_SEQUENTIAL_NCCL,
        LASP_MODE_SEQUENTIAL_NVSHMEM,
        LASP_MODE_NO_COMM,
        LASP_MODE_PIPELINED_CHAIN,
    ] {
        let desc = OpDesc {
            schedule: LASP_SCHEDULE_ALL_GATHER,
            mode,
            ..lasp2_desc()
        };
        assert!(OpSpec::of(&desc).is_ok(), "mode {mode}");
    }
}

#[test]
fn symmetric_bytes_count_both_chains_and_nothing_on_one_gpu() {
    let bytes = |desc: OpDesc| {
        let mut out = 0u64;
        // SAFETY: a valid descriptor and out-pointer.
        let status = unsafe { lasp_op_symmetric_bytes(&desc, 4, &mut out) };
        assert_eq!(status, LASP_OK, "{}", last_error());
        out
    };
    let forward_only = bytes(OpDesc {
        flags: 0,
        ..lasp2_desc()
    });
    assert!(forward_only > 0);
    assert_eq!(bytes(lasp2_desc()), 2 * forward_only);
    let single = OpDesc {
        kind: LASP_KIND_SINGLE_GPU,
        ..lasp2_desc()
    };
    assert_eq!(bytes(single), 0);
    let mut out = 0u64;
    // SAFETY: as above.
    let status = unsafe { lasp_op_symmetric_bytes(&lasp2_desc(), 0, &mut out) };
    assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
    assert!(last_error().contains("npes = 0 must be at least 1"));
}

/// A tensor of `numel` elements of `dtype` at a made-up device address (never dereferenced: the
/// checks before the driver look at the numbers only).
fn tensor(dtype: Dtype, numel: usize) -> Tensor {
    Tensor {
        data: 0x7000_0000_0000 + numel as u64 * 0x100,
        numel: numel as i64,
        dtype: dtype as i32,
        reserved: 0,
    }
}

/// The forward's slots of a LASP-2 call of `lasp2_desc` with `t` tokens.
fn forward_tensors(t: usize) -> Tensors {
    let (qk, v, gates, state) = (2 * t * 3 * 64, 2 * t * 3 * 64, 2 * t * 3, 2 * 3 * 64 * 64);
    let mut tensors = Tensors::default();
    for (slot, dtype, numel) in [
        (Slot::Q, Dtype::Bf16, qk),
        (Slot::K, Dtype::Bf16, qk),
        (Slot::V, Dtype::Bf16, v),
        (Slot::G, Dtype::F32, gates),
        (Slot::O, Dtype::Bf16, v),
        (Slot::StartState, Dtype::F32, state),
    ] {
        tensors.slot[slot as usize] = tensor(dtype, numel);
    }
    tensors
}

fn call(tokens: i64) -> Call {
    Call {
        tokens,
        ..Call::default()
    }
}

fn plan_error(desc: OpDesc, direction: Direction, call: Call, tensors: Tensors) -> String {
    let spec = OpSpec::of(&desc).unwrap();
    match plan_call(&spec, direction, &call, &tensors) {
        Ok(plan) => panic!("accepted: {plan:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn calls_take_their_tokens_from_the_call_or_the_descriptor() {
    let spec = OpSpec::of(&lasp2_desc()).unwrap();
    let forward = |spec: &OpSpec, tokens| {
        plan_call(
            spec,
            Direction::Forward,
            &call(tokens),
            &forward_tensors(10),
        )
    };
    assert!(forward(&spec, 10).is_ok());
    let msg = forward(&spec, 0).unwrap_err().to_string();
    assert!(
        msg.contains("call.tokens is 0 and so is desc.tokens"),
        "{msg}"
    );
    let msg = forward(&spec, -2).unwrap_err().to_string();
    assert!(msg.contains("call.tokens = -2 is negative"), "{msg}");
    let fixed = OpSpec::of(&OpDesc {
        tokens: 10,
        ..lasp2_desc()
    })
    .unwrap();
    assert!(forward(&fixed, 0).is_ok() && forward(&fixed, 10).is_ok());
    let msg = forward(&fixed, 11).unwrap_err().to_string();
    assert!(
        msg.contains("call.tokens is 11 but the op was created with desc.tokens = 10"),
        "{msg}"
    );
    let reserved = Call {
        reserved: [0, 0, 0, 0, 1],
        ..call(10)
    };
    let msg = plan_call(&spec, Direction::Forward, &reserved, &forward_tensors(10))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("call.reserved[4] is 0x1"), "{msg}");
}

#[test]
fn slots_are_checked_against_what_the_family_reads() {
    let forward =
        |tensors: Tensors| plan_error(lasp2_desc(), Direction::Forward, call(10), tensors);
    let with = |slot: Slot, t: Tensor| {
        let mut tensors = forward_tensors(10);
        tensors.slot[slot as usize] = t;
        tensors
    };
    let cases = [
        (
            with(Slot::Q, Tensor::default()),
            "LASP_SLOT_Q is empty but lasp_op_forward of scalar decay (LASP-2) needs it: \
             [B, T, H, Dk] bf16",
        ),
        (
            with(Slot::Q, tensor(Dtype::F32, 2 * 10 * 3 * 64)),
            "LASP_SLOT_Q is LASP_DTYPE_F32 but must be LASP_DTYPE_BF16 ([B, T, H, Dk] bf16); \
             convert the tensor (torch: .bfloat16())",
        ),
        (
            with(
                Slot::G,
                Tensor {
                    dtype: 42,
                    ..tensor(Dtype::F32, 60)
                },
            ),
            "LASP_SLOT_G has dtype 42, not a LASP_DTYPE_* value",
        ),
        (
            with(Slot::V, tensor(Dtype::Bf16, 100)),
            "LASP_SLOT_V has 100 elements but [B, T, H, Dv] with B=2, T=10, H=3, Dk=64, Dv=64 \
             needs 3840",
        ),
        (
            with(
                Slot::H0,
                Tensor {
                    data: 0,
                    ..tensor(Dtype::F32, 24576)
                },
            ),
            "LASP_SLOT_H0 has data 0 but numel 24576",
        ),
        (
            with(
                Slot::O,
                Tensor {
                    reserved: 3,
                    ..tensor(Dtype::Bf16, 3840)
                },
            ),
            "LASP_SLOT_O.reserved is 0x3",
        ),
        (
            with(Slot::Dq, tensor(Dtype::Bf16, 3840)),
            "LASP_SLOT_DQ is filled but lasp_op_forward of scalar decay (LASP-2) does not use it \
             (lasp_op_backward reads it); leave it empty",
        ),
        (
            with(Slot::Beta, tensor(Dtype::F32, 60)),
            "LASP_SLOT_BETA is filled but lasp_op_forward of scalar decay (LASP-2) does not use \
             it; leave it empty",
        ),
    ];
    for (tensors, fragment) in cases {
        let msg = forward(tensors);
        assert!(msg.contains(fragment), "{fragment:?} not in {msg:?}");
    }
    let mut beyond = forward_tensors(10);
    beyond.slot[25] = tensor(Dtype::F32, 1);
    let msg = forward(beyond);
    assert!(
        msg.contains("tensors.slot[25] is filled but lasp-shmem")
            && msg.contains("knows slots 0 to 23 (LASP_SLOT_COUNT = 24)"),
        "{msg}"
    );
    let reserved = Tensors {
        reserved: 1,
        ..forward_tensors(10)
    };
    assert!(forward(reserved).contains("tensors.reserved is 0x1"));
}

#[test]
fn each_kind_and_direction_reads_its_own_slots() {
    let state = 2 * 3 * 64 * 64;
    // The LASP-2 backward starts from the saved start state, not from H0.
    let mut backward = forward_tensors(10);
    backward.slot[Slot::O as usize] = Tensor::default();
    for (slot, dtype, numel) in [
        (Slot::DO, Dtype::Bf16, 3840),
        (Slot::Dq, Dtype::Bf16, 3840),
        (Slot::Dk, Dtype::Bf16, 3840),
        (Slot::Dv, Dtype::Bf16, 3840),
        (Slot::Dg, Dtype::F32, 60),
    ] {
        backward.slot[slot as usize] = tensor(dtype, numel);
    }
    let spec = OpSpec::of(&lasp2_desc()).unwrap();
    assert!(plan_call(&spec, Direction::Backward, &call(10), &backward).is_ok());
    let mut with_h0 = backward;
    with_h0.slot[Slot::H0 as usize] = tensor(Dtype::F32, state);
    let msg = plan_error(lasp2_desc(), Direction::Backward, call(10), with_h0);
    assert!(
        msg.contains("LASP_SLOT_H0 is filled but lasp_op_backward of scalar decay (LASP-2)"),
        "{msg}"
    );
    let mut unsaved = backward;
    unsaved.slot[Slot::StartState as usize] = Tensor::default();
    let msg = plan_error(lasp2_desc(), Direction::Backward, call(10), unsaved);
    assert!(msg.contains("LASP_SLOT_START_STATE is empty but"), "{msg}");

    // One GPU: the backward starts from H0 (optional) and the forward saves no start state.
    let single = OpDesc {
        kind: LASP_KIND_SINGLE_GPU,
        ..lasp2_desc()
    };
    let mut single_backward = unsaved;
    let single_spec = OpSpec::of(&single).unwrap();
    assert!(plan_call(
        &single_spec,
        Direction::Backward,
        &call(10),
        &single_backward
    )
    .is_ok());
    single_backward.slot[Slot::H0 as usize] = tensor(Dtype::F32, state);
    assert!(plan_call(
        &single_spec,
        Direction::Backward,
        &call(10),
        &single_backward
    )
    .is_ok());
    let msg = plan_error(single, Direction::Forward, call(10), forward_tensors(10));
    assert!(
        msg.contains(
            "LASP_SLOT_START_STATE is filled but lasp_op_forward of scalar decay (one GPU)"
        ),
        "{msg}"
    );

    // A forward-only op has no backward.
    let forward_only = OpDesc {
        flags: 0,
        ..lasp2_desc()
    };
    let msg = plan_error(forward_only, Direction::Backward, call(10), backward);
    assert!(
        msg.contains("the op was created without LASP_OP_WITH_BACKWARD"),
        "{msg}"
    );
}

#[test]
fn gated_delta_calls_take_beta_and_give_dbeta() {
    let desc = OpDesc {
        family: LASP_FAMILY_GATED_DELTA,
        ..lasp2_desc()
    };
    let spec = OpSpec::of(&desc).unwrap();
    let gates = 2 * 10 * 3;
    // Scalar decay's forward slots lack beta.
    let mut tensors = forward_tensors(10);
    let msg = plan_error(desc, Direction::Forward, call(10), tensors);
    assert!(msg.contains("LASP_SLOT_BETA"), "{msg}");
    tensors.slot[Slot::Beta as usize] = tensor(Dtype::F32, gates);
    assert!(plan_call(&spec, Direction::Forward, &call(10), &tensors).is_ok());
    // The backward starts from the saved start state and writes dbeta as beta.
    let mut backward = tensors;
    backward.slot[Slot::O as usize] = Tensor::default();
    for (slot, dtype, numel) in [
        (Slot::DO, Dtype::Bf16, 3840),
        (Slot::Dq, Dtype::Bf16, 3840),
        (Slot::Dk, Dtype::Bf16, 3840),
        (Slot::Dv, Dtype::Bf16, 3840),
        (Slot::Dg, Dtype::F32, gates),
    ] {
        backward.slot[slot as usize] = tensor(dtype, numel);
    }
    let msg = plan_error(desc, Direction::Backward, call(10), backward);
    assert!(msg.contains("LASP_SLOT_DBETA"), "{msg}");
    backward.slot[Slot::Dbeta as usize] = tensor(Dtype::Bf16, gates);
    let msg = plan_error(desc, Direction::Backward, call(10), backward);
    assert!(msg.contains("LASP_SLOT_DBETA is LASP_DTYPE_BF16"), "{msg}");
    backward.slot[Slot::Dbeta as usize] = tensor(Dtype::F32, gates);
    assert!(plan_call(&spec, Direction::Backward, &call(10), &backward).is_ok());
    // One GPU: h0 instead of the start state.
    let one_gpu = OpDesc {
        kind: LASP_KIND_SINGLE_GPU,
        ..desc
    };
    let msg = plan_error(one_gpu, Direction::Backward, call(10), backward);
    assert!(msg.contains("LASP_SLOT_START_STATE is filled"), "{msg}");
    // Dv a multiple of 64 (192 too), Dk 64 or 128.
    assert!(OpSpec::of(&OpDesc { dv: 192, ..desc }).is_ok());
    let msg = desc_error(OpDesc { dk: 96, ..desc });
    assert!(msg.contains("Dk = 96"), "{msg}");
}

#[test]
fn packed_documents_come_as_offsets_and_a_shard_start() {
    let spec = OpSpec::of(&lasp2_desc()).unwrap();
    let mut tensors = forward_tensors(10);
    let with_start = |shard_start| Call {
        shard_start,
        ..call(10)
    };
    // A shard start without documents is a mistake.
    let msg = plan_error(lasp2_desc(), Direction::Forward, with_start(5), tensors);
    assert!(msg.contains("LASP_SLOT_CU_SEQLENS is empty"), "{msg}");
    // Offsets of either integer width, at least two of them, any count past that.
    for (dtype, numel) in [(Dtype::I32, 2), (Dtype::I64, 9)] {
        tensors.slot[Slot::CuSeqlens as usize] = tensor(dtype, numel);
        assert!(plan_call(&spec, Direction::Forward, &with_start(5), &tensors).is_ok());
    }
    tensors.slot[Slot::CuSeqlens as usize] = tensor(Dtype::F32, 4);
    let msg = plan_error(lasp2_desc(), Direction::Forward, call(10), tensors);
    assert!(
        msg.contains("LASP_SLOT_CU_SEQLENS is LASP_DTYPE_F32"),
        "{msg}"
    );
    assert!(msg.contains("int32 or int64"), "{msg}");
    tensors.slot[Slot::CuSeqlens as usize] = tensor(Dtype::I32, 1);
    let msg = plan_error(lasp2_desc(), Direction::Forward, call(10), tensors);
    assert!(msg.contains("has 1 elements"), "{msg}");
    tensors.slot[Slot::CuSeqlens as usize] = tensor(Dtype::I32, 3);
    let msg = plan_error(lasp2_desc(), Direction::Forward, with_start(-1), tensors);
    assert!(msg.contains("at least 0"), "{msg}");
    // GLA and mLSTM take documents too (their kernels mask at the starts).
    let gla = OpDesc {
        family: LASP_FAMILY_GLA,
        ..lasp2_desc()
    };
    tensors.slot[Slot::G as usize] = tensor(Dtype::F32, 2 * 10 * 3 * 64);
    tensors.slot[Slot::StartState as usize] = Tensor::default();
    let gla_spec = OpSpec::of(&gla).unwrap();
    assert!(plan_call(&gla_spec, Direction::Forward, &call(10), &tensors).is_ok());
    let mlstm = OpDesc {
        family: LASP_FAMILY_MLSTM,
        ..lasp2_desc()
    };
    tensors.slot[Slot::G as usize] = tensor(Dtype::F32, 2 * 10 * 3);
    tensors.slot[Slot::IGate as usize] = tensor(Dtype::F32, 2 * 10 * 3);
    let mlstm_spec = OpSpec::of(&mlstm).unwrap();
    assert!(plan_call(&mlstm_spec, Direction::Forward, &call(10), &tensors).is_ok());
}

#[test]
fn document_final_states_need_documents_and_one_state_per_offset() {
    let spec = OpSpec::of(&lasp2_desc()).unwrap();
    let mut tensors = forward_tensors(10);
    let state = 2 * 3 * 64 * 64; // B * H * Dk * Dv
    tensors.slot[Slot::DocumentHt as usize] = tensor(Dtype::F32, 4 * state);
    let msg = plan_error(lasp2_desc(), Direction::Forward, call(10), tensors);
    assert!(msg.contains("LASP_SLOT_CU_SEQLENS is empty"), "{msg}");
    // Five offsets (padding included): four documents, one state each per batch row.
    tensors.slot[Slot::CuSeqlens as usize] = tensor(Dtype::I64, 5);
    assert!(plan_call(&spec, Direction::Forward, &call(10), &tensors).is_ok());
    tensors.slot[Slot::DocumentHt as usize] = tensor(Dtype::F32, 5 * state);
    let msg = plan_error(lasp2_desc(), Direction::Forward, call(10), tensors);
    assert!(msg.contains("needs 98304") && msg.contains("N=4"), "{msg}");
    // Only the log-decay families' forwards declare them.
    let msg = plan_error(lasp2_desc(), Direction::Backward, call(10), tensors);
    assert!(msg.contains("does not use it"), "{msg}");
    tensors.slot[Slot::DocumentHt as usize] = tensor(Dtype::F32, 4 * state);
    let gdn = OpDesc {
        family: LASP_FAMILY_GATED_DELTA,
        ..lasp2_desc()
    };
    tensors.slot[Slot::Beta as usize] = tensor(Dtype::F32, 2 * 10 * 3);
    let gdn_spec = OpSpec::of(&gdn).unwrap();
    assert!(plan_call(&gdn_spec, Direction::Forward, &call(10), &tensors).is_ok());
    tensors.slot[Slot::Beta as usize] = Tensor::default();
    let gla = OpDesc {
        family: LASP_FAMILY_GLA,
        ..lasp2_desc()
    };
    tensors.slot[Slot::G as usize] = tensor(Dtype::F32, 2 * 10 * 3 * 64);
    // GLA's forward writes them itself: no start state with them.
    tensors.slot[Slot::StartState as usize] = Tensor::default();
    let gla_spec = OpSpec::of(&gla).unwrap();
    assert!(plan_call(&gla_spec, Direction::Forward, &call(10), &tensors).is_ok());
    // mLSTM's forward writes them itself too, C, n and m of every state back to back.
    let mlstm = OpDesc {
        family: LASP_FAMILY_MLSTM,
        ..lasp2_desc()
    };
    tensors.slot[Slot::G as usize] = tensor(Dtype::F32, 2 * 10 * 3);
    tensors.slot[Slot::IGate as usize] = tensor(Dtype::F32, 2 * 10 * 3);
    let mlstm_spec = OpSpec::of(&mlstm).unwrap();
    let msg = plan_error(mlstm, Direction::Forward, call(10), tensors);
    assert!(
        msg.contains("needs 99864") && msg.contains("[B, N, H, Dk]"),
        "{msg}"
    );
    let mlstm_state = 2 * 3 * (64 * 64 + 64 + 1); // B * H * (Dk * Dv + Dk + 1)
    tensors.slot[Slot::DocumentHt as usize] = tensor(Dtype::F32, 4 * mlstm_state);
    assert!(plan_call(&mlstm_spec, Direction::Forward, &call(10), &tensors).is_ok());
}

#[test]
fn mlstm_calls_take_two_gates_and_whole_states() {
    let desc = OpDesc {
        family: LASP_FAMILY_MLSTM,
        ..lasp2_desc()
    };
    let spec = OpSpec::of(&desc).unwrap();
    let (qk, gates) = (2 * 10 * 3 * 64, 2 * 10 * 3);
    // A state is C, n and m back to back: B*H*(Dk*Dv + Dk + 1).
    let state = 2 * 3 * (64 * 64 + 64 + 1);
    let mut tensors = forward_tensors(10);
    tensors.slot[Slot::StartState as usize] = Tensor::default();
    // Scalar decay's forward lacks the input gate.
    let msg = plan_error(desc, Direction::Forward, call(10), tensors);
    assert!(msg.contains("LASP_SLOT_I_GATE is empty"), "{msg}");
    tensors.slot[Slot::IGate as usize] = tensor(Dtype::F32, gates);
    assert!(plan_call(&spec, Direction::Forward, &call(10), &tensors).is_ok());
    // The boundary states are whole mLSTM states, not [B, H, Dk, Dv].
    tensors.slot[Slot::StartState as usize] = tensor(Dtype::F32, 2 * 3 * 64 * 64);
    let msg = plan_error(desc, Direction::Forward, call(10), tensors);
    assert!(
        msg.contains("[B, H, Dk, Dv] + [B, H, Dk] + [B, H]"),
        "{msg}"
    );
    for slot in [Slot::StartState, Slot::ExitState] {
        tensors.slot[slot as usize] = tensor(Dtype::F32, state);
    }
    tensors.slot[Slot::SavedRows as usize] = tensor(Dtype::F32, 2 * gates);
    assert!(plan_call(&spec, Direction::Forward, &call(10), &tensors).is_ok());
    // The backward reads the boundary and the saved rows and writes both gates' gradients.
    let mut backward = tensors;
    backward.slot[Slot::O as usize] = Tensor::default();
    for (slot, dtype, numel) in [
        (Slot::DO, Dtype::Bf16, qk),
        (Slot::Dq, Dtype::Bf16, qk),
        (Slot::Dk, Dtype::Bf16, qk),
        (Slot::Dv, Dtype::Bf16, qk),
        (Slot::Dg, Dtype::F32, gates),
    ] {
        backward.slot[slot as usize] = tensor(dtype, numel);
    }
    let msg = plan_error(desc, Direction::Backward, call(10), backward);
    assert!(msg.contains("LASP_SLOT_DI_GATE is empty"), "{msg}");
    backward.slot[Slot::DIGate as usize] = tensor(Dtype::F32, gates);
    assert!(plan_call(&spec, Direction::Backward, &call(10), &backward).is_ok());
    backward.slot[Slot::SavedRows as usize] = Tensor::default();
    let msg = plan_error(desc, Direction::Backward, call(10), backward);
    assert!(msg.contains("LASP_SLOT_SAVED_ROWS is empty"), "{msg}");
    // One GPU: H0 and HT instead of the boundary.
    let one_gpu = OpDesc {
        kind: LASP_KIND_SINGLE_GPU,
        ..desc
    };
    let msg = plan_error(one_gpu, Direction::Forward, call(10), tensors);
    assert!(msg.contains("LASP_SLOT_START_STATE is filled"), "{msg}");
    // Dk and Dv 64 or 128.
    let msg = desc_error(OpDesc { dv: 192, ..desc });
    assert!(msg.contains("Dv = 192 is not supported"), "{msg}");
}

#[test]
fn gla_calls_take_gates_per_key_dimension_and_no_start_state() {
    let desc = OpDesc {
        family: LASP_FAMILY_GLA,
        flags: 0,
        ..lasp2_desc()
    };
    let spec = OpSpec::of(&desc).unwrap();
    let mut tensors = forward_tensors(10);
    tensors.slot[Slot::StartState as usize] = Tensor::default();
    // [B, T, H] gates are scalar decay's: GLA wants one per key dimension.
    let msg = plan_error(desc, Direction::Forward, call(10), tensors);
    assert!(msg.contains("[B, T, H, Dk]"), "{msg}");
    tensors.slot[Slot::G as usize] = tensor(Dtype::F32, 2 * 10 * 3 * 64);
    assert!(plan_call(&spec, Direction::Forward, &call(10), &tensors).is_ok());
    // GLA's forward saves no start state.
    tensors.slot[Slot::StartState as usize] = tensor(Dtype::F32, 2 * 3 * 64 * 64);
    let msg = plan_error(desc, Direction::Forward, call(10), tensors);
    assert!(msg.contains("LASP_SLOT_START_STATE is filled"), "{msg}");
    // Dv 192 has no GLA kernel.
    let msg = desc_error(OpDesc { dv: 192, ..desc });
    assert!(msg.contains("Dv = 192 is not supported"), "{msg}");
}

/// The forward's slots of a single-GPU GLA call of `lasp2_desc`'s layout with `t` tokens and
/// the chunk states saved.
fn gla_saving_forward_tensors(t: usize) -> Tensors {
    let (qk, v) = (2 * t * 3 * 64, 2 * t * 3 * 64);
    let mut tensors = Tensors::default();
    for (slot, dtype, numel) in [
        (Slot::Q, Dtype::Bf16, qk),
        (Slot::K, Dtype::Bf16, qk),
        (Slot::V, Dtype::Bf16, v),
        (Slot::G, Dtype::F32, qk),
        (Slot::O, Dtype::Bf16, v),
        (Slot::ChunkStates, Dtype::Bf16, gla_chunk_states(t)),
    ] {
        tensors.slot[slot as usize] = tensor(dtype, numel);
    }
    tensors
}

/// Elements of the chunk states of `lasp2_desc`'s layout with `t` tokens: B*H*ceil(T/64)*Dk*Dv.
fn gla_chunk_states(t: usize) -> usize {
    2 * 3 * t.div_ceil(64) * 64 * 64
}

/// The backward's slots of a single-GPU GLA call of `lasp2_desc`'s layout with `t` tokens, from
/// zero (no h0, dht or dh0).
fn gla_backward_tensors(t: usize) -> Tensors {
    let (qk, v) = (2 * t * 3 * 64, 2 * t * 3 * 64);
    let mut tensors = Tensors::default();
    for (slot, dtype, numel) in [
        (Slot::Q, Dtype::Bf16, qk),
        (Slot::K, Dtype::Bf16, qk),
        (Slot::V, Dtype::Bf16, v),
        (Slot::G, Dtype::F32, qk),
        (Slot::ChunkStates, Dtype::Bf16, gla_chunk_states(t)),
        (Slot::DO, Dtype::Bf16, v),
        (Slot::Dq, Dtype::Bf16, qk),
        (Slot::Dk, Dtype::Bf16, qk),
        (Slot::Dv, Dtype::Bf16, v),
        (Slot::Dg, Dtype::F32, qk),
    ] {
        tensors.slot[slot as usize] = tensor(dtype, numel);
    }
    tensors
}

/// What a GLA op with the backward (`desc`, `kind` as its messages name it: "one GPU" or
/// "LASP-2") and its forward-only twin accept at T = 130 (three chunks, the last partial): the
/// forward's chunk states optional, the backward's h0, dht and dh0 optional and its chunk states
/// required (by plan_call and through the entry point), no backward without the flag. Returns the
/// forward's and the backward's tensors (every optional slot of the backward filled).
fn check_gla_chunk_states(desc: OpDesc, kind: &str) -> (Tensors, Tensors) {
    let spec = OpSpec::of(&desc).unwrap();
    let accepted =
        |direction, tensors: &Tensors| plan_call(&spec, direction, &call(130), tensors).map(|_| ());
    // The chunk states are optional: a forward that no backward follows writes none.
    let forward = gla_saving_forward_tensors(130);
    accepted(Direction::Forward, &forward).unwrap();
    let mut inference = forward;
    inference.slot[Slot::ChunkStates as usize] = Tensor::default();
    accepted(Direction::Forward, &inference).unwrap();

    let mut backward = gla_backward_tensors(130);
    accepted(Direction::Backward, &backward).unwrap();
    for slot in [Slot::H0, Slot::Dht, Slot::Dh0] {
        backward.slot[slot as usize] = tensor(Dtype::F32, GLA_STATE);
    }
    accepted(Direction::Backward, &backward).unwrap();
    let mut unsaved = backward;
    unsaved.slot[Slot::ChunkStates as usize] = Tensor::default();
    let msg = plan_error(desc, Direction::Backward, call(130), unsaved);
    assert!(
        msg.contains(&format!(
            "LASP_SLOT_CHUNK_STATES is empty but lasp_op_backward of GLA ({kind}) needs it: \
             [B*H, ceil(T / 64), Dk, Dv] bf16"
        )),
        "{msg}"
    );

    // A forward-only op writes no chunk states (nothing would read them) and has no backward.
    let forward_only = OpDesc { flags: 0, ..desc };
    let msg = plan_error(forward_only, Direction::Forward, call(130), forward);
    assert!(
        msg.contains(&format!(
            "LASP_SLOT_CHUNK_STATES is filled but lasp_op_forward of GLA ({kind})"
        )),
        "{msg}"
    );
    let msg = plan_error(forward_only, Direction::Backward, call(130), backward);
    assert!(
        msg.contains("the op was created without LASP_OP_WITH_BACKWARD"),
        "{msg}"
    );

    // The same checks through the entry point, as a binding's tests call it.
    // SAFETY: every pointer points at a live struct of its type.
    unsafe {
        let status = lasp_op_check_call(
            &desc,
            LASP_DIRECTION_BACKWARD,
            &call(130),
            &gla_backward_tensors(130),
        );
        assert_eq!(status, LASP_OK, "{}", last_error());
        let status = lasp_op_check_call(&desc, LASP_DIRECTION_BACKWARD, &call(130), &unsaved);
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("LASP_SLOT_CHUNK_STATES is empty"));
    }
    (forward, backward)
}

/// Elements of one [B, H, Dk, Dv] state of the GLA tensors above.
const GLA_STATE: usize = 2 * 3 * 64 * 64;

#[test]
fn gla_on_one_gpu_saves_chunk_states_for_its_backward() {
    let desc = OpDesc {
        family: LASP_FAMILY_GLA,
        kind: LASP_KIND_SINGLE_GPU,
        ..lasp2_desc()
    };
    let (forward, backward) = check_gla_chunk_states(desc, "one GPU");
    let mut per_token = forward;
    per_token.slot[Slot::ChunkStates as usize] = tensor(Dtype::Bf16, 2 * 3 * 130 * 64 * 64);
    let msg = plan_error(desc, Direction::Forward, call(130), per_token);
    assert!(
        msg.contains(
            "LASP_SLOT_CHUNK_STATES has 3194880 elements but [B*H, ceil(T / 64), Dk, Dv] with \
             B=2, T=130, H=3, Dk=64, Dv=64 needs 73728"
        ),
        "{msg}"
    );
    let mut fp32 = forward;
    fp32.slot[Slot::ChunkStates as usize] = tensor(Dtype::F32, gla_chunk_states(130));
    let msg = plan_error(desc, Direction::Forward, call(130), fp32);
    assert!(
        msg.contains("LASP_SLOT_CHUNK_STATES is LASP_DTYPE_F32 but must be LASP_DTYPE_BF16"),
        "{msg}"
    );
    // dg is per key dimension, like g.
    let mut scalar_dg = backward;
    scalar_dg.slot[Slot::Dg as usize] = tensor(Dtype::F32, 2 * 130 * 3);
    let msg = plan_error(desc, Direction::Backward, call(130), scalar_dg);
    assert!(
        msg.contains("LASP_SLOT_DG has 780 elements but [B, T, H, Dk]"),
        "{msg}"
    );
    let mut with_start_state = backward;
    with_start_state.slot[Slot::StartState as usize] = tensor(Dtype::F32, GLA_STATE);
    let msg = plan_error(desc, Direction::Backward, call(130), with_start_state);
    assert!(msg.contains("LASP_SLOT_START_STATE is filled"), "{msg}");
}

#[test]
fn gla_across_the_ranks_saves_chunk_states_for_its_backward() {
    let desc = OpDesc {
        family: LASP_FAMILY_GLA,
        ..lasp2_desc()
    };
    // h0, dht and dh0 are optional here too: which rank may pass dht (the last) and dh0 (rank 0)
    // is the op's check, on the device's rank.
    let (forward, backward) = check_gla_chunk_states(desc, "LASP-2");
    // The chunk states hold the earlier ranks' prefix: there is no start state to save or read.
    let mut with_start_state = forward;
    with_start_state.slot[Slot::StartState as usize] = tensor(Dtype::F32, GLA_STATE);
    let msg = plan_error(desc, Direction::Forward, call(130), with_start_state);
    assert!(
        msg.contains("LASP_SLOT_START_STATE is filled but lasp_op_forward of GLA (LASP-2)"),
        "{msg}"
    );
    let mut from_start_state = backward;
    from_start_state.slot[Slot::StartState as usize] = tensor(Dtype::F32, GLA_STATE);
    let msg = plan_error(desc, Direction::Backward, call(130), from_start_state);
    assert!(
        msg.contains("LASP_SLOT_START_STATE is filled but lasp_op_backward of GLA (LASP-2)"),
        "{msg}"
    );

    // The backward's chain doubles the symmetric memory, as scalar decay's does.
    let forward_only = OpDesc { flags: 0, ..desc };
    let bytes = |desc: OpDesc| {
        let mut out = 0u64;
        // SAFETY: a valid descriptor and out-pointer.
        let status = unsafe { lasp_op_symmetric_bytes(&desc, 4, &mut out) };
        assert_eq!(status, LASP_OK, "{}", last_error());
        out
    };
    assert!(bytes(forward_only) > 0);
    assert_eq!(bytes(desc), 2 * bytes(forward_only));
}

#[test]
fn entry_points_answer_with_a_status_and_a_message() {
    let desc = lasp2_desc();
    let tensors = forward_tensors(10);
    let good = call(10);
    // SAFETY: every pointer below is NULL or points at a live struct of its type.
    unsafe {
        let status = lasp_op_check_call(&desc, LASP_DIRECTION_FORWARD, &good, &tensors);
        assert_eq!(status, LASP_OK, "{}", last_error());
        let status = lasp_op_check_call(&desc, 2, &good, &tensors);
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("direction 2 is not LASP_DIRECTION_FORWARD"));
        let short_call = Call {
            struct_size: 16,
            ..good
        };
        let status = lasp_op_check_call(&desc, LASP_DIRECTION_FORWARD, &short_call, &tensors);
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("call.struct_size is 16 but"));
        let status = lasp_op_check_call(&desc, LASP_DIRECTION_FORWARD, &good, std::ptr::null());
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("tensors is NULL"));

        let mut op = std::ptr::null_mut();
        let status = lasp_op_create(std::ptr::null(), &desc, &mut op);
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("runtime is NULL"));
        // The descriptor is checked before the runtime.
        let mlstm = OpDesc {
            family: LASP_FAMILY_MLSTM,
            dv: 256,
            ..desc
        };
        assert_eq!(
            lasp_op_create(std::ptr::null(), &mlstm, &mut op),
            LASP_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("Dv = 256 is not supported"));
        assert!(op.is_null());

        let status = lasp_op_forward(std::ptr::null(), std::ptr::null_mut(), &good, &tensors);
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("op is NULL"));
        for status in [
            lasp_op_set_mode(std::ptr::null(), LASP_MODE_OVERLAPPED),
            lasp_op_finish(std::ptr::null(), std::ptr::null_mut()),
            lasp_op_note_replayed_calls(std::ptr::null(), 1, 1),
            lasp_op_free(std::ptr::null_mut()),
        ] {
            assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
            assert!(last_error().contains("op is NULL"));
        }

        // Guest mode checks its arguments before it looks for NVSHMEM or a GPU.
        let mut runtime = std::ptr::null_mut();
        let status = lasp_runtime_attach(std::ptr::null(), -1, &mut runtime);
        assert_eq!(status, LASP_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("device -1 is negative"));
        assert!(runtime.is_null());
    }
}
