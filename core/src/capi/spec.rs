//! The descriptor of an operation (`lasp_op_desc`) and the scalars of a call (`lasp_call`),
//! checked once for every family: sizes, versions, reserved fields, codes and dimensions.

use super::abi::{
    Call, OpDesc, ABI_VERSION, LASP_KIND_LASP2, LASP_KIND_SINGLE_GPU, LASP_MODE_NO_COMM,
    LASP_MODE_OVERLAPPED, LASP_MODE_PIPELINED_CHAIN, LASP_MODE_SEQUENTIAL_NCCL,
    LASP_MODE_SEQUENTIAL_NVSHMEM, LASP_OP_WITH_BACKWARD, LASP_SCHEDULE_ALL_GATHER,
    LASP_SCHEDULE_AUTO, LASP_SCHEDULE_PIPELINED_CHAIN,
};
use super::args::{check_reserved, count, invalid, this_library};
use super::families::{family, AbiFamily};
use crate::error::Result;
use crate::exchange::{ExchangeMode, Lasp2Layout};
use crate::ops::scalar_decay::ForwardShape;

/// Where an operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Whole sequences on this rank's GPU.
    SingleGpu,
    /// A shard of every sequence on each rank, the states exchanged in `mode` (the all-gather
    /// schedule, the only one this build has).
    Lasp2 { mode: ExchangeMode },
}

/// A checked `lasp_op_desc`.
#[derive(Clone, Copy)]
pub(super) struct OpSpec {
    pub(super) family: &'static dyn AbiFamily,
    pub(super) kind: Kind,
    pub(super) layout: Lasp2Layout,
    /// T of every call, or `None` where each call gives its own.
    pub(super) tokens: Option<usize>,
    pub(super) with_backward: bool,
}

impl OpSpec {
    /// The descriptor checked: everything but its family's shape limits ([`Family::check`]).
    pub(super) fn of(desc: &OpDesc) -> Result<OpSpec> {
        if desc.abi_version != ABI_VERSION {
            return Err(invalid(format!(
                "desc.abi_version is {} but this library is {}; set it to \
                 LASP_SHMEM_ABI_VERSION and compile against the lasp_shmem.h of this library",
                desc.abi_version,
                this_library()
            )));
        }
        check_reserved("desc.reserved", &desc.reserved)?;
        let unknown_flags = desc.flags & !LASP_OP_WITH_BACKWARD;
        if unknown_flags != 0 {
            return Err(invalid(format!(
                "desc.flags has bits {unknown_flags:#x} that {} does not define; the only flag \
                 is LASP_OP_WITH_BACKWARD ({LASP_OP_WITH_BACKWARD:#x})",
                this_library()
            )));
        }
        let spec = OpSpec {
            family: family(desc.family)?,
            kind: kind(desc)?,
            layout: Lasp2Layout {
                b: count("desc.batch", desc.batch)?,
                h: count("desc.heads", desc.heads)?,
                dk: count("desc.dk", desc.dk)?,
                dv: count("desc.dv", desc.dv)?,
            },
            tokens: match count("desc.tokens", desc.tokens)? {
                0 => None,
                t => Some(t),
            },
            with_backward: desc.flags & LASP_OP_WITH_BACKWARD != 0,
        };
        spec.family.check(&spec)?;
        Ok(spec)
    }

    /// The shape and scale of one call, checked against the descriptor and the kernels' limits.
    pub(super) fn call_shape(&self, call: &Call) -> Result<(ForwardShape, Option<f32>)> {
        check_reserved("call.reserved", &call.reserved)?;
        let t = match (count("call.tokens", call.tokens)?, self.tokens) {
            (0, Some(t)) => t,
            (0, None) => {
                return Err(invalid(
                    "call.tokens is 0 and so is desc.tokens; set call.tokens to this call's \
                     tokens per sequence (LASP-2: this rank's shard)"
                        .into(),
                ))
            }
            (t, None) => t,
            (t, Some(fixed)) if t == fixed => t,
            (t, Some(fixed)) => {
                return Err(invalid(format!(
                    "call.tokens is {t} but the op was created with desc.tokens = {fixed}; pass \
                     0 (or {fixed}), or create the op with desc.tokens = 0 to give T per call"
                )))
            }
        };
        let Lasp2Layout { b, h, dk, dv } = self.layout;
        let shape = ForwardShape { b, t, h, dk, dv };
        shape.validate()?;
        Ok((shape, (call.scale != 0.0).then_some(call.scale)))
    }

    /// Symmetric bytes per rank of an op of this spec on `npes` ranks.
    pub(super) fn symmetric_bytes(&self, npes: usize) -> u64 {
        match self.kind {
            Kind::SingleGpu => 0,
            Kind::Lasp2 { .. } => self.family.lasp2_symmetric_bytes(self, npes),
        }
    }
}

fn kind(desc: &OpDesc) -> Result<Kind> {
    match desc.kind {
        LASP_KIND_SINGLE_GPU => {
            if desc.schedule != 0 || desc.mode != 0 {
                return Err(invalid(format!(
                    "desc.schedule is {} and desc.mode {}, but a LASP_KIND_SINGLE_GPU op \
                     exchanges nothing; leave both 0",
                    desc.schedule, desc.mode
                )));
            }
            Ok(Kind::SingleGpu)
        }
        LASP_KIND_LASP2 => {
            match desc.schedule {
                LASP_SCHEDULE_AUTO | LASP_SCHEDULE_ALL_GATHER => {}
                LASP_SCHEDULE_PIPELINED_CHAIN => {
                    return Err(invalid(format!(
                        "schedule LASP_SCHEDULE_PIPELINED_CHAIN is not available at creation \
                         ({}): the schedules are exchange modes; create with \
                         LASP_SCHEDULE_ALL_GATHER (or LASP_SCHEDULE_AUTO) and set \
                         LASP_MODE_PIPELINED_CHAIN (desc.mode or lasp_op_set_mode), or let \
                         lasp_op_plan choose",
                        this_library()
                    )))
                }
                other => {
                    return Err(invalid(format!(
                        "desc.schedule {other} is not one of LASP_SCHEDULE_AUTO (0), \
                         LASP_SCHEDULE_ALL_GATHER (1), LASP_SCHEDULE_PIPELINED_CHAIN (2)"
                    )))
                }
            }
            Ok(Kind::Lasp2 {
                mode: exchange_mode(desc.mode)?,
            })
        }
        0 => Err(invalid(
            "desc.kind is 0; set it to LASP_KIND_SINGLE_GPU or LASP_KIND_LASP2".into(),
        )),
        other => Err(invalid(format!(
            "desc.kind {other} is not one of LASP_KIND_SINGLE_GPU ({LASP_KIND_SINGLE_GPU}), \
             LASP_KIND_LASP2 ({LASP_KIND_LASP2})"
        ))),
    }
}

/// The `LASP_MODE_*` of `mode`.
pub(super) fn mode_code(mode: ExchangeMode) -> i32 {
    match mode {
        ExchangeMode::Overlapped => LASP_MODE_OVERLAPPED,
        ExchangeMode::SequentialNccl => LASP_MODE_SEQUENTIAL_NCCL,
        ExchangeMode::SequentialNvshmem => LASP_MODE_SEQUENTIAL_NVSHMEM,
        ExchangeMode::NoComm => LASP_MODE_NO_COMM,
        ExchangeMode::PipelinedChain => LASP_MODE_PIPELINED_CHAIN,
    }
}

/// The exchange mode of a `LASP_MODE_*` code.
pub(super) fn exchange_mode(mode: i32) -> Result<ExchangeMode> {
    match mode {
        LASP_MODE_OVERLAPPED => Ok(ExchangeMode::Overlapped),
        LASP_MODE_SEQUENTIAL_NCCL => Ok(ExchangeMode::SequentialNccl),
        LASP_MODE_SEQUENTIAL_NVSHMEM => Ok(ExchangeMode::SequentialNvshmem),
        LASP_MODE_NO_COMM => Ok(ExchangeMode::NoComm),
        LASP_MODE_PIPELINED_CHAIN => Ok(ExchangeMode::PipelinedChain),
        other => Err(invalid(format!(
            "exchange mode {other} is not one of LASP_MODE_OVERLAPPED (0), \
             LASP_MODE_SEQUENTIAL_NCCL (1), LASP_MODE_SEQUENTIAL_NVSHMEM (2), LASP_MODE_NO_COMM \
             (3), LASP_MODE_PIPELINED_CHAIN (4)"
        ))),
    }
}
