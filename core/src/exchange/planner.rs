//! The planner: picks a LASP-2 operation's exchange mode and launch plan by timing the candidates
//! on the caller's own call, with the same choice on every PE.
//!
//! The choice is measured rather than predicted. The exchange's cost depends on how the summary
//! kernel's copies share SMs, HBM and links with the compute, and that changes with the shape. On
//! 4x H100 at W = 4 the overlapped all-gather is 1.13x faster than the sequential NCCL
//! composition at B=16 T_local=1K and 1.24-1.51x slower at B=8 T_local=2K (between runs), and two
//! head groups beat one by 5 % at B=16 T_local=1K (kernels/docs/lasp2.md, "The planner").
//!
//! Every candidate gives the same bits. The modes, the pipelined chain among them, make the same
//! folds of the same operands in the same order, and a launch plan is offered only where it keeps
//! the current plan's arithmetic ([`LaunchPlans::same_bits`]). So
//! the choice changes the time of a call, never its result, and a rerun that chooses otherwise
//! still reproduces every output.

use super::{ExchangeMode, Lasp2Operation};
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;
use std::fmt::Debug;
use std::sync::Arc;

/// Timing schedule: one untimed round, then `ROUNDS` rounds. In each round every candidate in
/// turn gets `WARM_CALLS` untimed calls, then `TIMED_CALLS` timed ones. The turns give every
/// candidate the same clocks: under the power cap an H100's clock moves between 1845 and 1980 MHz
/// within a run. The untimed round takes the first calls of each candidate out of the medians:
/// without it the overlapped mode measured 0.465 ms where its later turns took 0.366-0.387 (4x
/// H100, W = 4, B=8 T_local=2K), and the planner chose the sequential mode at W = 2, where the
/// overlapped one then ran 1.13x faster.
const ROUNDS: usize = 3;
const WARM_CALLS: usize = 2;
const TIMED_CALLS: usize = 3;

/// The current plan stays unless another candidate is faster by more than this fraction. A plan
/// that changes with the noise between runs would still give the same bits, but its time would
/// not be repeatable.
const KEEP_MARGIN: f64 = 0.01;

/// Launch plans an operation offers beside the exchange modes.
pub trait LaunchPlans {
    /// One launch plan (`()` for an operation with a single plan).
    type Launch: Copy + Debug + PartialEq;
    /// The plan calls use now.
    fn launch(&self) -> Self::Launch;
    /// Every plan the planner may try, in the same order on every PE.
    fn launch_plans(&self) -> Vec<Self::Launch>;
    /// Whether `launch` gives bitwise the same results as the current plan for a call on a shard
    /// of `t_local` tokens. Only such plans are tried.
    fn same_bits(&self, launch: Self::Launch, t_local: usize) -> bool;
    /// Makes calls use `launch` (not collective: the planner applies the same plan on every PE).
    fn set_launch(&mut self, launch: Self::Launch) -> Result<()>;
}

/// One configuration the planner times.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate<L> {
    pub mode: ExchangeMode,
    pub launch: L,
}

/// A timed candidate: the median of its timed calls on the PE where that median is the largest.
/// A call takes as long as its slowest PE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timed<L> {
    pub candidate: Candidate<L>,
    pub slowest_ms: f64,
}

/// What the planner chose and what it measured, the same on every PE.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan<L> {
    pub chosen: Candidate<L>,
    /// Every candidate in the order timed; the first one is the plan in use before planning.
    pub timed: Vec<Timed<L>>,
}

impl<L: Copy + PartialEq> Plan<L> {
    /// The chosen candidate's time.
    pub fn chosen_ms(&self) -> f64 {
        self.timed
            .iter()
            .find(|t| t.candidate == self.chosen)
            .map_or(f64::NAN, |t| t.slowest_ms)
    }
}

/// The modes the planner tries: the overlapped mode with every launch plan that keeps the bits,
/// the pipelined chain likewise where the operation's family relays the prefix (`with_chain`),
/// then the sequential modes with the current plan (their kernels run in line on one stream, so
/// the head groups only add launches there); NCCL's only where every PE can load it. Under
/// emulated links (`LASP_EMULATE_LINKS`) only the device schedules' puts are held to the emulated
/// rates; the host-driven gathers of the sequential modes still move at NVLink's, so they are no
/// candidates there.
fn candidates<L: Copy>(
    current: L,
    same_bits_plans: &[L],
    with_chain: bool,
    with_nccl: bool,
    emulated_links: bool,
) -> Vec<Candidate<L>> {
    let device = [ExchangeMode::Overlapped, ExchangeMode::PipelinedChain]
        .into_iter()
        .filter(|&mode| with_chain || mode != ExchangeMode::PipelinedChain)
        .flat_map(|mode| {
            same_bits_plans
                .iter()
                .map(move |&launch| Candidate { mode, launch })
        });
    let sequential = [
        ExchangeMode::SequentialNccl,
        ExchangeMode::SequentialNvshmem,
    ]
    .into_iter()
    .filter(move |&mode| !emulated_links && (with_nccl || mode != ExchangeMode::SequentialNccl))
    .map(move |mode| Candidate {
        mode,
        launch: current,
    });
    device.chain(sequential).collect()
}

/// The plans every PE accepts: `accepted[pe]` has bit i set where PE `pe` keeps its bits under
/// plan i (bits past the plans are ignored).
fn agreed_plans<L: Copy>(plans: &[L], accepted: &[u64]) -> Vec<L> {
    let all = accepted.iter().fold(u64::MAX, |acc, &m| acc & m);
    plans
        .iter()
        .enumerate()
        .filter(|&(i, _)| all >> i & 1 == 1)
        .map(|(_, &l)| l)
        .collect()
}

/// The index of the candidate to use: the fastest, unless the first (the plan in use) is within
/// [`KEEP_MARGIN`] of it.
fn choose(slowest_ms: &[f64]) -> usize {
    let fastest = (0..slowest_ms.len())
        .min_by(|&a, &b| slowest_ms[a].total_cmp(&slowest_ms[b]))
        .expect("at least one candidate");
    if slowest_ms[0] <= slowest_ms[fastest] * (1.0 + KEEP_MARGIN) {
        0
    } else {
        fastest
    }
}

/// Ms of one call after an on-stream barrier (CUDA events around the call only).
fn time_call<Op>(
    runtime: &Runtime,
    stream: &Arc<CudaStream>,
    op: &mut Op,
    call: &mut impl FnMut(&mut Op, &Arc<CudaStream>) -> Result<()>,
) -> Result<f64> {
    runtime.barrier_on_stream(stream)?;
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    call(op, stream)?;
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    end.synchronize()?;
    Ok(start.elapsed_ms(&end)? as f64)
}

/// Times every candidate on `call` (this PE's call; `t_local` its shard length), switches every
/// PE to the fastest and returns what was measured (collective; every PE must call it with its
/// own shard of the same layout). Calls write the operation's outputs like any other call.
pub fn plan<Op: Lasp2Operation + LaunchPlans>(
    op: &mut Op,
    runtime: &Runtime,
    stream: &Arc<CudaStream>,
    t_local: usize,
    mut call: impl FnMut(&mut Op, &Arc<CudaStream>) -> Result<()>,
) -> Result<Plan<Op::Launch>> {
    let current = op.launch();
    let plans = op.launch_plans();
    if plans.len() > 63 || plans.first() != Some(&current) {
        return Err(Error::State(format!(
            "the planner needs the plan in use first and at most 63 plans, got {plans:?} \
             (current {current:?}); this is a library bug, please report it"
        )));
    }
    let mine = plans.iter().enumerate().fold(0u64, |mask, (i, &l)| {
        mask | (op.same_bits(l, t_local) as u64) << i
    });
    // Bit 63: this PE can load NCCL (the plans use bits 0..62).
    let nccl_bit = 1u64 << 63;
    let accepted = runtime.all_gather_u64(
        mine | if crate::nccl::available() {
            nccl_bit
        } else {
            0
        },
    )?;
    let with_nccl = accepted.iter().all(|&m| m & nccl_bit != 0);
    let agreed = agreed_plans(&plans, &accepted);
    let emulated_links = runtime.link_emulation().is_some();
    let with_chain = op.supports(ExchangeMode::PipelinedChain);
    let candidates = candidates(current, &agreed, with_chain, with_nccl, emulated_links);
    let mut samples = vec![Vec::with_capacity(ROUNDS * TIMED_CALLS); candidates.len()];
    for round in 0..=ROUNDS {
        for (c, times) in candidates.iter().zip(samples.iter_mut()) {
            op.set_mode(c.mode)?;
            op.set_launch(c.launch)?;
            for _ in 0..WARM_CALLS {
                time_call(runtime, stream, op, &mut call)?;
            }
            for _ in 0..TIMED_CALLS {
                let ms = time_call(runtime, stream, op, &mut call)?;
                if round > 0 {
                    times.push(ms);
                }
            }
        }
    }
    op.finish(stream)?;
    let mut slowest_ms = Vec::with_capacity(candidates.len());
    for mut times in samples {
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let every_pe = runtime.all_gather_u64(median.to_bits())?;
        slowest_ms.push(
            every_pe
                .into_iter()
                .map(f64::from_bits)
                .fold(f64::MIN, f64::max),
        );
    }
    let chosen = candidates[choose(&slowest_ms)];
    op.set_mode(chosen.mode)?;
    op.set_launch(chosen.launch)?;
    let timed = candidates
        .into_iter()
        .zip(slowest_ms)
        .map(|(candidate, slowest_ms)| Timed {
            candidate,
            slowest_ms,
        })
        .collect();
    Ok(Plan { chosen, timed })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plans_every_pe_accepts_are_tried_and_sequential_modes_keep_the_current_plan() {
        let plans = [1, 2, 4];
        assert_eq!(agreed_plans(&plans, &[0b111, 0b101]), vec![1, 4]);
        assert_eq!(agreed_plans(&plans, &[0b001]), vec![1]);
        let c = candidates(1, &[1, 4], true, true, false);
        let modes: Vec<_> = c.iter().map(|c| (c.mode, c.launch)).collect();
        assert_eq!(
            modes,
            vec![
                (ExchangeMode::Overlapped, 1),
                (ExchangeMode::Overlapped, 4),
                (ExchangeMode::PipelinedChain, 1),
                (ExchangeMode::PipelinedChain, 4),
                (ExchangeMode::SequentialNccl, 1),
                (ExchangeMode::SequentialNvshmem, 1),
            ]
        );
        let without_chain = candidates(1, &[1], false, true, false);
        assert!(without_chain
            .iter()
            .all(|c| c.mode != ExchangeMode::PipelinedChain));
        assert!(c.iter().all(|c| c.mode != ExchangeMode::NoComm));
        let without_nccl = candidates(1, &[1], false, false, false);
        assert!(without_nccl
            .iter()
            .all(|c| c.mode != ExchangeMode::SequentialNccl));
        assert_eq!(without_nccl.len(), 2);
        let emulated = candidates(1, &[1, 4], true, true, true);
        assert!(emulated.iter().all(|c| matches!(
            c.mode,
            ExchangeMode::Overlapped | ExchangeMode::PipelinedChain
        )));
        assert_eq!(emulated.len(), 4);
    }

    #[test]
    fn the_current_plan_stays_unless_another_is_clearly_faster() {
        assert_eq!(choose(&[1.0, 0.995, 1.2]), 0);
        assert_eq!(choose(&[1.0, 0.98, 0.97]), 2);
        assert_eq!(choose(&[0.5, 0.6]), 0);
    }

    #[test]
    fn the_chosen_time_is_the_chosen_candidates() {
        let c = |mode| Candidate { mode, launch: () };
        let plan = Plan {
            chosen: c(ExchangeMode::SequentialNccl),
            timed: vec![
                Timed {
                    candidate: c(ExchangeMode::Overlapped),
                    slowest_ms: 0.37,
                },
                Timed {
                    candidate: c(ExchangeMode::SequentialNccl),
                    slowest_ms: 0.30,
                },
            ],
        };
        assert_eq!(plan.chosen_ms(), 0.30);
    }
}
