//! The bitwise checks of the LASP-2 programs: a call repeated, and the same call in every other
//! exchange mode the operation runs, must leave the bits of the first.

use lasp_shmem::exchange::{ExchangeMode, Lasp2Operation};
use lasp_shmem::Result;

/// The modes a check compares with the overlapped one (those the operation supports).
const OTHER_MODES: [ExchangeMode; 3] = [
    ExchangeMode::SequentialNccl,
    ExchangeMode::SequentialNvshmem,
    ExchangeMode::PipelinedChain,
];

/// What a bitwise check switches between modes: one LASP-2 operation, or a program's pair of
/// them that switch together.
pub trait ModeSwitch {
    /// Switches the exchange mode (collective).
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()>;
    /// Whether the operation runs in `mode`.
    fn supports(&self, mode: ExchangeMode) -> bool;
}

impl<O: Lasp2Operation> ModeSwitch for O {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        Lasp2Operation::set_mode(self, mode)
    }

    fn supports(&self, mode: ExchangeMode) -> bool {
        Lasp2Operation::supports(self, mode)
    }
}

/// `call` (one call of `op`, made in the overlapped mode, on poisoned outputs: their bits), then
/// again, then once in each other mode `op` supports (collective switches): the first call's
/// bits and what differed from them, each problem naming `what` (the direction).
pub fn bits_in_every_mode<O: ModeSwitch, B: PartialEq>(
    op: &mut O,
    what: &str,
    mut call: impl FnMut(&mut O) -> Result<B>,
) -> Result<(B, Vec<String>)> {
    let first = call(op)?;
    let mut problems = Vec::new();
    if call(op)? != first {
        problems.push(format!("{what}: a repeated call gave other bits"));
    }
    for mode in OTHER_MODES {
        if !op.supports(mode) {
            continue;
        }
        op.set_mode(mode)?;
        if call(op)? != first {
            problems.push(format!("{what}: {mode:?} differs from Overlapped"));
        }
    }
    Ok((first, problems))
}
