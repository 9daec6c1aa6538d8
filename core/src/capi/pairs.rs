//! The operations a family makes for `lasp_op`: its forward and, where the op was created with
//! it, its backward, as one [`FamilyOp`]. What a pair does the same way for every family (the
//! backward's absence, a LASP-2 pair's collectives on both of its state chains, freeing the
//! forward's chain when the backward cannot be made) is here once; a family supplies how each of
//! its ops takes a checked call ([`AbiCall`]); its LASP-2 ops' collectives are their
//! [`Lasp2Operation`]s.

use super::families::{Direction, FamilyOp};
use super::tensors::CheckedCall;
use crate::error::Result;
use crate::exchange::planner::{self, LaunchPlans};
use crate::exchange::{ExchangeMode, Lasp2Operation};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// One direction of a family's op, as the C ABI calls it: the op's arguments taken from the
/// checked call's slots, then the op enqueued on `stream`.
pub(super) trait AbiCall: Send + 'static {
    fn call(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()>;
}

/// A LASP-2 op of one direction, as the C ABI calls it: its checked calls, the collectives of
/// its state chain, and the launch plans its planner may choose.
pub(super) trait Chained: AbiCall + Lasp2Operation + LaunchPlans {}

impl<T: AbiCall + Lasp2Operation + LaunchPlans> Chained for T {}

/// Plans `op` on `call` (collective) and returns the mode it chose.
fn plan_one<O: Chained>(
    op: &mut O,
    runtime: &Runtime,
    stream: &Arc<CudaStream>,
    call: CheckedCall<'_>,
) -> Result<ExchangeMode> {
    let t_local = call.shape.t;
    let plan = planner::plan(op, runtime, stream, t_local, |op, stream| {
        op.call(stream, call.again())
    })?;
    Ok(plan.chosen.mode)
}

const CREATED_WITH_BACKWARD: &str = "lasp_op_backward runs only on ops created with the backward";

/// Whole sequences on one GPU.
pub(super) struct SingleGpuPair<F, B> {
    forward: F,
    backward: Option<B>,
}

impl<F: AbiCall, B: AbiCall> SingleGpuPair<F, B> {
    pub(super) fn boxed(forward: F, backward: Option<B>) -> Box<dyn FamilyOp> {
        Box::new(SingleGpuPair { forward, backward })
    }
}

impl<F: AbiCall, B: AbiCall> FamilyOp for SingleGpuPair<F, B> {
    fn forward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()> {
        self.forward.call(stream, call)
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()> {
        let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
        backward.call(stream, call)
    }
}

/// A shard of every sequence on each rank: one state chain per direction.
pub(super) struct Lasp2Pair<F, B> {
    forward: F,
    backward: Option<B>,
}

impl<F: Chained, B: Chained> Lasp2Pair<F, B> {
    /// `forward`, and the backward `make_backward` makes where it is given (collective). Where
    /// the backward fails, every rank frees the forward's symmetric buffers here together: what
    /// makes it fail (its layout, kernels or symmetric heap) is the same on every rank.
    pub(super) fn boxed(
        forward: F,
        make_backward: Option<impl FnOnce() -> Result<B>>,
    ) -> Result<Box<dyn FamilyOp>> {
        let backward = match make_backward.map(|make| make()).transpose() {
            Ok(backward) => backward,
            Err(error) => {
                forward.free()?;
                return Err(error);
            }
        };
        Ok(Box::new(Lasp2Pair { forward, backward }))
    }
}

impl<F: Chained, B: Chained> FamilyOp for Lasp2Pair<F, B> {
    fn forward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()> {
        self.forward.call(stream, call)
    }

    fn backward(&mut self, stream: &Arc<CudaStream>, call: CheckedCall<'_>) -> Result<()> {
        let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
        backward.call(stream, call)
    }

    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.forward.set_mode(mode)?;
        match &mut self.backward {
            Some(backward) => backward.set_mode(mode),
            None => Ok(()),
        }
    }

    fn plan(
        &mut self,
        runtime: &Runtime,
        stream: &Arc<CudaStream>,
        direction: Direction,
        call: CheckedCall<'_>,
    ) -> Result<ExchangeMode> {
        match direction {
            Direction::Forward => plan_one(&mut self.forward, runtime, stream, call),
            Direction::Backward => {
                let backward = self.backward.as_mut().expect(CREATED_WITH_BACKWARD);
                plan_one(backward, runtime, stream, call)
            }
        }
    }

    fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.forward.finish(stream)?;
        match &self.backward {
            Some(backward) => backward.finish(stream),
            None => Ok(()),
        }
    }

    fn note_replayed_calls(&mut self, forward: u64, backward: u64) {
        self.forward.note_replayed_calls(forward);
        if let Some(op) = &mut self.backward {
            op.note_replayed_calls(backward);
        }
    }

    /// Frees both chains (collective), the backward's even where the forward's free failed.
    fn free(self: Box<Self>) -> Result<()> {
        let forward = self.forward.free();
        let backward = self.backward.map_or(Ok(()), B::free);
        forward.and(backward)
    }
}
