//! Graph replay checks of the LASP-2 programs: one overlapped call captured into a CUDA graph and
//! replayed many times must advance the exchange's epoch once per replay and leave the same bits.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaStream;
use lasp_shmem::exchange::{ExchangeMode, Lasp2Operation};
use lasp_shmem::{Error, Result, Runtime};
use std::sync::Arc;

/// The outputs of one direction's calls: poisoned before a call, read back as bits after it.
pub trait Outputs {
    type Bits: PartialEq;
    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
    fn bits(&self, stream: &Arc<CudaStream>) -> Result<Self::Bits>;
}

/// A captured graph of one overlapped call (`call` on `outputs`), replayed `calls` times on
/// poisoned outputs: epochs advance on the device. Whether they advanced by `calls` and the last
/// replay's bits equal `want`.
pub fn replay<O: Lasp2Operation, S: Outputs>(
    rt: &Runtime,
    op: &mut O,
    outputs: &mut S,
    calls: u32,
    want: &S::Bits,
    call: impl FnOnce(&mut S, &mut O, &Arc<CudaStream>) -> Result<()>,
) -> Result<std::result::Result<(), String>> {
    replay_after(rt, op, outputs, calls, want, call, |_, _| Ok(()))
}

/// [`replay`], with `between(outputs, stream)` run after the capture and before the replays (to
/// write other metadata, such as documents' offsets, into the buffers the graph reads).
pub fn replay_after<O: Lasp2Operation, S: Outputs>(
    rt: &Runtime,
    op: &mut O,
    outputs: &mut S,
    calls: u32,
    want: &S::Bits,
    call: impl FnOnce(&mut S, &mut O, &Arc<CudaStream>) -> Result<()>,
    between: impl FnOnce(&mut S, &Arc<CudaStream>) -> Result<()>,
) -> Result<std::result::Result<(), String>> {
    let stream = rt.stream().clone();
    op.set_mode(ExchangeMode::Overlapped)?;
    outputs.poison(&stream)?;
    let before = op.epoch(&stream)?;
    rt.barrier_on_stream(&stream)?;
    stream.synchronize()?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = call(outputs, op, &stream);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
    captured?;
    let graph = graph.ok_or_else(|| Error::State("the capture recorded nothing".into()))?;
    between(outputs, &stream)?;
    stream.synchronize()?;
    for _ in 0..calls {
        graph.launch()?;
    }
    op.note_replayed_calls(u64::from(calls));
    op.finish(&stream)?;
    let after = op.epoch(&stream)?;
    Ok(if after != before + u64::from(calls) {
        Err(format!(
            "graph replay: epoch {before} -> {after} for {calls} replays"
        ))
    } else if &outputs.bits(&stream)? != want {
        Err(format!("{calls} graph replays gave other bits"))
    } else {
        Ok(())
    })
}
