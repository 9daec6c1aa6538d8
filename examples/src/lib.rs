//! What the LASP-2 example programs share: shard lengths, shape options, and the timing of one
//! operation's exchange modes in turns.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::ops::lasp2::ExchangeMode;
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::{Error, Result, Runtime};
use std::sync::Arc;

/// Shard lengths: equal slices of `per_rank` tokens, the last rank's shorter by `short`.
pub fn shard_lengths(npes: usize, per_rank: usize, short: usize) -> Vec<usize> {
    (0..npes)
        .map(|r| {
            if r + 1 == npes {
                per_rank - short
            } else {
                per_rank
            }
        })
        .collect()
}

/// A `BxTxHxD` option (Dk = Dv = D).
pub fn parse_shape(text: &str) -> Result<ForwardShape> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| {
            d.parse()
                .map_err(|_| Error::InvalidArgument(format!("shape {text:?}: use BxTxHxD")))
        })
        .collect::<Result<_>>()?;
    match dims[..] {
        [b, t, h, d] => Ok(ForwardShape {
            b,
            t,
            h,
            dk: d,
            dv: d,
        }),
        _ => Err(Error::InvalidArgument(format!(
            "shape {text:?}: use BxTxHxD"
        ))),
    }
}

/// One LASP-2 operation on one rank's shard, as the timing loop drives it.
pub trait ModeCall {
    /// Switches the operation's exchange mode (collective).
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()>;
    /// Enqueues one call on `stream`.
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
    /// Waits for `stream` and reports an expired wait.
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
}

/// Timing schedule: ROUNDS rounds; in each, every mode in turn gets WARM_CALLS untimed calls (the
/// mode switch is a host collective that leaves the GPU idle for milliseconds) and then
/// CALLS_PER_VISIT timed ones: ROUNDS x CALLS_PER_VISIT samples per mode.
const ROUNDS: usize = 6;
const WARM_CALLS: usize = 2;
const CALLS_PER_VISIT: usize = 5;

/// Ms of one call after an on-stream barrier (CUDA events around the call only).
pub fn time_call(rt: &Runtime, op: &mut impl ModeCall) -> Result<f64> {
    let stream = rt.stream().clone();
    rt.barrier_on_stream(&stream)?;
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    op.call(&stream)?;
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    end.synchronize()?;
    Ok(start.elapsed_ms(&end)? as f64)
}

/// Median ms per mode (in `ExchangeMode::ALL` order) on this rank. The modes take turns in
/// rounds, so every mode sees the same clocks and temperature: timed one after the other, the
/// mode timed last was up to 7 % slower at T_local = 128K even at W = 1, where the modes'
/// kernels are identical; timed in turns, within 1.3 %. Switching mode every call instead left
/// the GPU idle between all calls and made every mode 2-6 % slower.
pub fn time_in_turns(rt: &Runtime, op: &mut impl ModeCall) -> Result<[f64; 4]> {
    let stream = rt.stream().clone();
    let mut samples: [Vec<f64>; 4] = Default::default();
    for _ in 0..ROUNDS {
        for (mode, times) in ExchangeMode::ALL.into_iter().zip(samples.iter_mut()) {
            op.set_mode(mode)?;
            for _ in 0..WARM_CALLS {
                time_call(rt, op)?;
            }
            for _ in 0..CALLS_PER_VISIT {
                times.push(time_call(rt, op)?);
            }
        }
    }
    op.finish(&stream)?;
    Ok(samples.map(|mut v| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }))
}

/// Mode names as the JSON rows spell them, in `ExchangeMode::ALL` order.
const MODE_NAMES: [&str; 4] = [
    "overlapped",
    "sequential_nccl",
    "sequential_nvshmem",
    "no_comm",
];

/// Every rank's medians per mode (from [`time_in_turns`]) as text to append: ` {mode}_ms X` to
/// the printed line and `, "{mode}_ms": X` plus `"per_rank_ms"` to the JSON row. A mode's time
/// is its slowest rank's median: the call takes as long as that rank, and which rank it is (the
/// chain's last folds the most tiles) says where the time over W = 1 goes. Collective.
pub fn mode_columns(comm: &NcclComm, medians: [f64; 4]) -> Result<(String, String)> {
    let (mut line, mut row) = (String::new(), String::new());
    let mut per_rank = Vec::new();
    for (median, mode) in medians.into_iter().zip(MODE_NAMES) {
        let ranks = comm.gather_f64(median)?;
        let ms = ranks.iter().copied().fold(f64::MIN, f64::max);
        line += &format!(" {mode}_ms {ms:.4}");
        row += &format!(", \"{mode}_ms\": {ms:.5}");
        let list: Vec<String> = ranks.iter().map(|v| format!("{v:.5}")).collect();
        per_rank.push(format!("\"{mode}\": [{}]", list.join(", ")));
    }
    row += &format!(", \"per_rank_ms\": {{{}}}", per_rank.join(", "));
    Ok((line, row))
}
