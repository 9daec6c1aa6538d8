//! What the example and benchmark programs share: shard lengths, shards of reference tensors and
//! the LASP-2 programs' checks, shape and size options, NVSHMEM's settings in the environment and
//! `main` under the launcher, JSON output, the timing of one operation's exchange modes in turns,
//! and the bits of a backward call's gradients.

pub mod documents;
pub mod grad_bits;
pub mod graph_replay;
pub mod mode_bits;
pub mod units;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::emulated_links::LinkEmulation;
use lasp_shmem::exchange::planner::{Candidate, Plan};
use lasp_shmem::exchange::Lasp2Layout;
use lasp_shmem::family::Family;
use lasp_shmem::launch_env::LaunchEnv;
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::scalar_decay::lasp2::ExchangeMode;
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::reference::{Regime, Shape, SplitMix64, Tensor};
use lasp_shmem::{Config, Error, Result, Runtime};
use serde::Serialize;
use std::path::Path;
use std::sync::Arc;

/// Puts the `NVSHMEM_*` settings `config` needs into this process's environment, each only where
/// the environment does not set it already ([`Config::nvshmem_env`]: the heap for
/// `config.symmetric_heap_bytes`, NVLink multicast off, the bootstrap plugin under mpirun, ...),
/// and returns the launch environment they were computed for. NVSHMEM reads them at
/// [`Runtime::init`]; the library itself never writes the environment.
///
/// # Safety
/// No other thread may run during the call or have been started before it (`setenv` races with
/// `getenv` on other threads): call it from `main` before anything starts a thread, the CUDA
/// driver included (no CUDA call may have been made yet).
pub unsafe fn export_nvshmem_env(config: &Config) -> Result<LaunchEnv> {
    let env = LaunchEnv::from_process_env()?;
    for (name, value) in config.nvshmem_env(&env) {
        // Edition 2021: set_var is a safe fn, but it has the same requirement as in edition 2024,
        // which this fn's caller discharges.
        std::env::set_var(name, value);
    }
    Ok(env)
}

/// `value` rounded to `digits` decimals, for JSON files that people read (`serde_json` writes
/// the shortest text that reads back as the rounded value).
pub fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// Writes `value` to `path` as pretty-printed JSON with a final newline.
pub fn write_json(path: impl AsRef<Path>, value: &impl Serialize) -> Result<()> {
    let path = path.as_ref();
    let text = to_json(value);
    std::fs::write(path, text)
        .map_err(|e| Error::State(format!("cannot write {}: {e}", path.display())))
}

/// `value` as pretty-printed JSON with a final newline.
pub fn to_json(value: &impl Serialize) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("plain data serialises");
    text.push('\n');
    text
}

/// `len` draws of N(0, 1) (Box-Muller from two uniforms in (0, 1]): the timed programs' inputs.
pub fn normals(rng: &mut SplitMix64, len: usize) -> Vec<f64> {
    let mut uniform = || ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    (0..len)
        .map(|_| (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos())
        .collect()
}

/// The timed programs' inputs of one shard, as `benches/gated_delta_cp_peer.py` gives fla's
/// context parallelism (drawn per rank): q, v ~ N(0, 1), k ~ N(0, 1) with unit rows,
/// g = logsigmoid(N(0, 1)) / 16, beta = sigmoid(N(0, 1)).
pub struct TimedInputs {
    pub q: Vec<bf16>,
    pub k: Vec<bf16>,
    pub v: Vec<bf16>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
}

/// `n` log-decays as the layers make them: logsigmoid(x) / 16 = -ln(1 + e^-x) / 16, x normal.
pub fn log_decays(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    normals(rng, n)
        .iter()
        .map(|x| (-(-x).exp().ln_1p() / 16.0) as f32)
        .collect()
}

impl TimedInputs {
    pub fn draw(rng: &mut SplitMix64, shape: ForwardShape) -> Self {
        let unit_rows = |mut x: Vec<f64>| -> Vec<f64> {
            for row in x.chunks_mut(shape.dk) {
                let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
                row.iter_mut().for_each(|v| *v /= norm);
            }
            x
        };
        let q = bf16s(&normals(rng, shape.qk_len()));
        let k = bf16s(&unit_rows(normals(rng, shape.qk_len())));
        let v = bf16s(&normals(rng, shape.v_len()));
        // beta = sigmoid(x).
        let g = log_decays(rng, shape.gate_len());
        let beta = normals(rng, shape.gate_len())
            .iter()
            .map(|x| (1.0 / (1.0 + (-x).exp())) as f32)
            .collect();
        TimedInputs { q, k, v, g, beta }
    }
}

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

/// fla's offsets of short documents over `total` tokens: 1, 63, 64, 65, 17, 200 tokens in turn
/// (the last cut at the end), so that starts fall on a chunk's first and last token, several in
/// one chunk and none in others.
pub fn short_documents(total: usize) -> Vec<usize> {
    let cycle = [1, 63, 64, 65, 17, 200];
    let mut out = vec![0];
    while *out.last().unwrap() < total {
        let next = out.last().unwrap() + cycle[(out.len() - 1) % cycle.len()];
        out.push(next.min(total));
    }
    out
}

/// Rows `[b][start .. start + len]` of a `[B, T, ...]` reference tensor (q, k, v `[B, T, H, D]`,
/// gates `[B, T, H]`), as `[B, len, ...]`: one PE's shard of every sequence.
pub fn shard_rows(t: &Tensor, start: usize, len: usize) -> Vec<f64> {
    let (b, tt) = (t.shape()[0], t.shape()[1]);
    let row: usize = t.shape()[2..].iter().product();
    let mut out = Vec::with_capacity(b * len * row);
    for bi in 0..b {
        let base = (bi * tt + start) * row;
        out.extend_from_slice(&t.data()[base..base + len * row]);
    }
    out
}

/// The bits of a bf16 device buffer (a copy to the host, after the stream's work).
pub fn bf16_bits(stream: &Arc<CudaStream>, x: &CudaSlice<bf16>) -> Result<Vec<u16>> {
    Ok(stream.clone_dtoh(x)?.iter().map(|v| v.to_bits()).collect())
}

/// bf16 bit patterns (a buffer's [`bf16_bits`]) as the values they hold.
pub fn bf16_values(bits: &[u16]) -> Vec<f64> {
    bits.iter().map(|&b| bf16::from_bits(b).to_f64()).collect()
}

/// fp32 bit patterns (a buffer's [`f32_bits`]) as the values they hold.
pub fn f32_values(bits: &[u32]) -> Vec<f64> {
    bits.iter().map(|&b| f64::from(f32::from_bits(b))).collect()
}

/// The bits of an fp32 device buffer, or none where there is no buffer.
pub fn f32_bits(stream: &Arc<CudaStream>, x: Option<&CudaSlice<f32>>) -> Result<Vec<u32>> {
    Ok(match x {
        Some(x) => stream.clone_dtoh(x)?.iter().map(|v| v.to_bits()).collect(),
        None => Vec::new(),
    })
}

/// Times every shape with `time(comm, shape)` (an NCCL communicator for the rows' slowest-rank
/// reduction) and, on PE 0, writes the rows to `json`.
pub fn time_shapes(
    rt: &Runtime,
    shapes: &[ForwardShape],
    json: Option<&Path>,
    mut time: impl FnMut(&NcclComm, ForwardShape) -> Result<ModeRow>,
) -> Result<()> {
    if shapes.is_empty() {
        return Ok(());
    }
    let comm = NcclComm::new(rt, rt.stream())?;
    let rows = shapes
        .iter()
        .map(|&shape| time(&comm, shape))
        .collect::<Result<Vec<_>>>()?;
    if let (Some(path), 0) = (json, rt.pe()) {
        write_json(path, &rows)?;
    }
    Ok(())
}

/// Reference values rounded to bf16.
pub fn bf16s(x: &[f64]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f64(v)).collect()
}

/// Reference values rounded to f32.
pub fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// One check of a family's LASP-2 program: dimensions, the shards' lengths (one per PE), the
/// gates, h0.
pub struct ShardCase {
    pub b: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
    pub lengths: Vec<usize>,
    pub regime: Regime,
    pub h0: bool,
}

/// A check a program runs on every PE: its name is the line the GPU tests count.
pub trait NamedCase {
    fn name(&self) -> String;
}

impl NamedCase for ShardCase {
    fn name(&self) -> String {
        format!(
            "B{}_H{}_Dk{}_Dv{}_{:?}_shards{:?}{}",
            self.b,
            self.h,
            self.dk,
            self.dv,
            self.regime,
            self.lengths,
            if self.h0 { "_h0" } else { "" }
        )
    }
}

impl ShardCase {
    /// The reference's dimensions of the whole sequence.
    pub fn shape(&self) -> Shape {
        Shape {
            b: self.b,
            t: self.lengths.iter().sum(),
            h: self.h,
            dk: self.dk,
            dv: self.dv,
        }
    }
}

/// The checks of a family's LASP-2 program on `npes` PEs, over unequal shards (every PE 200 + 64 r
/// tokens, the last 37 fewer: ragged chunks everywhere): each of `widths` (Dk, Dv) at B=1, H=2;
/// three gate regimes at B=2, H=2, Dk = Dv = 128; and long shards (several segments per shard).
pub fn shard_cases(npes: usize, widths: &[(usize, usize)]) -> Vec<ShardCase> {
    let ragged = |base: usize| -> Vec<usize> {
        (0..npes)
            .map(|r| base + 64 * r - if r + 1 == npes { 37 } else { 0 })
            .collect()
    };
    let mut out = Vec::new();
    for &(dk, dv) in widths {
        out.push(ShardCase {
            b: 1,
            h: 2,
            dk,
            dv,
            lengths: ragged(200),
            regime: Regime::Typical,
            h0: true,
        });
    }
    for regime in [Regime::Mixed, Regime::StrongDecay, Regime::NoDecay] {
        out.push(ShardCase {
            b: 2,
            h: 2,
            dk: 128,
            dv: 128,
            lengths: ragged(300),
            regime,
            h0: regime != Regime::NoDecay,
        });
    }
    out.push(ShardCase {
        b: 1,
        h: 1,
        dk: 128,
        dv: 128,
        lengths: ragged(2000),
        regime: Regime::Typical,
        h0: true,
    });
    out
}

/// Runs `check(case, seed)` on every case (seeds `first_seed`, `first_seed + 1`, ...) and prints
/// one PASS or FAIL line per case with this PE's number (the GPU tests count them); returns how
/// many failed.
pub fn run_cases<C: NamedCase>(
    rt: &Runtime,
    cases: &[C],
    first_seed: u64,
    mut check: impl FnMut(&C, u64) -> Result<std::result::Result<String, String>>,
) -> Result<usize> {
    let mut failed = 0;
    for (i, case) in cases.iter().enumerate() {
        let name = case.name();
        match check(case, first_seed + i as u64)? {
            Ok(detail) => println!("PE {}: PASS {name}: {detail}", rt.pe()),
            Err(detail) => {
                failed += 1;
                println!("PE {}: FAIL {name}: {detail}", rt.pe());
            }
        }
    }
    Ok(failed)
}

/// The settings of a program whose largest LASP-2 operation takes `heap` symmetric bytes: that
/// heap and 64 MiB for NVSHMEM's own allocations, everything else from the environment.
pub fn config_with_heap(heap: usize) -> Result<Config> {
    Ok(Config {
        symmetric_heap_bytes: heap + (64 << 20),
        ..Config::from_env()?
    })
}

/// The settings of a program with one LASP-2 forward of family `F` at a time on `npes` PEs: a heap
/// for the largest of its `timed` shapes and of the layout its `checks` need.
pub fn lasp2_config<F: Family>(
    timed: &[ForwardShape],
    checks: Lasp2Layout,
    npes: usize,
) -> Result<Config> {
    heap_config(timed, checks, |layout| layout.symmetric_bytes::<F>(npes))
}

/// The settings of a program whose LASP-2 operations at one layout take `bytes(layout)` symmetric
/// bytes: a heap for the largest of its `timed` shapes and of the layout its `checks` need.
pub fn heap_config(
    timed: &[ForwardShape],
    checks: Lasp2Layout,
    bytes: impl Fn(Lasp2Layout) -> usize,
) -> Result<Config> {
    let heap = timed
        .iter()
        .map(|s| s.layout())
        .chain([checks])
        .map(bytes)
        .max()
        .unwrap_or(0);
    config_with_heap(heap)
}

/// The `main` of a program under `lasp-run`: `config(&options, world size)` gives the runtime's
/// settings, which go into NVSHMEM's environment before anything else runs; then `run(options,
/// config)`. Exits with 1 when `run` reports failed checks (`Ok(false)`), and after an error,
/// which it prints prefixed with `program`.
///
/// # Safety
/// As [`export_nvshmem_env`]: call it first thing in `main`, before any thread or CUDA call.
pub unsafe fn main_under_launcher<O>(
    program: &str,
    options: O,
    config: impl FnOnce(&O, usize) -> Result<Config>,
    run: impl FnOnce(O, Config) -> Result<bool>,
) {
    let prepared = LaunchEnv::from_process_env()
        .and_then(|env| config(&options, env.world_size))
        .and_then(|config| {
            // SAFETY: the caller's contract.
            unsafe { export_nvshmem_env(&config) }.map(|_| config)
        });
    match prepared.and_then(|config| run(options, config)) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("{program}: {e}");
            lasp_shmem::runtime::exit_after_error(1);
        }
    }
}

/// A `BxTxHxD` option (Dk = Dv = D).
pub fn parse_shape(text: &str) -> Result<ForwardShape> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| {
            d.trim()
                .parse()
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
    /// Switches the operation's exchange mode (collective), at the program's launch plan.
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()>;
    /// Switches to the planner's choice (collective; only where the program ran the planner:
    /// see [`planner_choice`]).
    fn use_plan(&mut self) -> Result<()> {
        Err(Error::InvalidArgument(
            "this program times no planner's choice".into(),
        ))
    }
    /// Whether the operation also runs the pipelined chain ([`ExchangeMode::PipelinedChain`]),
    /// which the timing loop then times as a fifth mode.
    fn has_chain(&self) -> bool {
        false
    }
    /// Enqueues one call on `stream`.
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
    /// Waits for `stream` and reports an expired wait.
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()>;
}

/// The planner's choice a [`ModeCall::use_plan`] switches to, or the error that it did not run.
pub fn planner_choice<T: Copy>(chosen: Option<T>) -> Result<T> {
    chosen.ok_or_else(|| Error::State("the planner did not run".into()))
}

/// What one visit of the timing loop switches to.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Visit {
    Mode(ExchangeMode),
    Planned,
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

/// The modes every family's operation runs, in the rows' order; the pipelined chain
/// ([`ModeCall::has_chain`]) comes after them.
pub const COMMON_MODES: [ExchangeMode; 4] = [
    ExchangeMode::Overlapped,
    ExchangeMode::SequentialNccl,
    ExchangeMode::SequentialNvshmem,
    ExchangeMode::NoComm,
];

/// One rank's median ms per mode: [`COMMON_MODES`] in order, and the chain's where timed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnMedians {
    pub modes: [f64; 4],
    pub chain: Option<f64>,
}

/// The modes `op` is timed in: [`COMMON_MODES`], then the chain where it has one.
fn timed_modes(op: &impl ModeCall) -> Vec<Visit> {
    let chain = op.has_chain().then_some(ExchangeMode::PipelinedChain);
    COMMON_MODES
        .into_iter()
        .chain(chain)
        .map(Visit::Mode)
        .collect()
}

/// The medians of the visits of [`timed_modes`], in that order.
fn turn_medians(medians: &[f64]) -> TurnMedians {
    TurnMedians {
        modes: medians[..4].try_into().expect("one median per common mode"),
        chain: medians.get(4).copied(),
    }
}

/// Median ms per mode on this rank. The modes take turns in rounds, so every mode sees the same
/// clocks and temperature: timed one after the other, the mode timed last was up to 7 % slower
/// at T_local = 128K even at W = 1, where the modes' kernels are identical; timed in turns,
/// within 1.3 %. Switching mode every call instead left the GPU idle between all calls and made
/// every mode 2-6 % slower.
pub fn time_in_turns(rt: &Runtime, op: &mut impl ModeCall) -> Result<TurnMedians> {
    let visits = timed_modes(op);
    Ok(turn_medians(&time_visits(rt, op, &visits)?))
}

/// [`time_in_turns`] with the planner's choice ([`ModeCall::use_plan`]) as one more turn: every
/// mode's median and the choice's, measured side by side.
fn time_in_turns_with_plan(rt: &Runtime, op: &mut impl ModeCall) -> Result<(TurnMedians, f64)> {
    let mut visits = timed_modes(op);
    visits.push(Visit::Planned);
    let mut medians = time_visits(rt, op, &visits)?;
    let planned = medians.pop().expect("the planned visit's median");
    Ok((turn_medians(&medians), planned))
}

/// Median ms per visit, the visits taking turns in rounds.
fn time_visits(rt: &Runtime, op: &mut impl ModeCall, visits: &[Visit]) -> Result<Vec<f64>> {
    let stream = rt.stream().clone();
    let mut samples = vec![Vec::with_capacity(ROUNDS * CALLS_PER_VISIT); visits.len()];
    for _ in 0..ROUNDS {
        for (visit, times) in visits.iter().zip(samples.iter_mut()) {
            match *visit {
                Visit::Mode(mode) => op.set_mode(mode)?,
                Visit::Planned => op.use_plan()?,
            }
            for _ in 0..WARM_CALLS {
                time_call(rt, op)?;
            }
            for _ in 0..CALLS_PER_VISIT {
                times.push(time_call(rt, op)?);
            }
        }
    }
    op.finish(&stream)?;
    Ok(samples
        .into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect())
}

/// The planner's choice beside the modes in a row: its time measured in the same turns (the
/// slowest rank's median), what it chose, and what it measured itself while choosing.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlannerTimes {
    pub planner_ms: f64,
    pub planner_choice: String,
    /// Each candidate the planner timed and its slowest rank's median, in the order timed.
    pub planner_measured_ms: Vec<(String, f64)>,
}

impl PlannerTimes {
    /// From the planner's `plan` and its choice's median on every rank, timed in turns with the
    /// modes.
    pub fn new<L: Copy + std::fmt::Debug + PartialEq>(
        plan: &Plan<L>,
        every_rank_ms: &[f64],
        describe: impl Fn(&Candidate<L>) -> String,
    ) -> Self {
        PlannerTimes {
            planner_ms: round(every_rank_ms.iter().copied().fold(f64::MIN, f64::max), 5),
            planner_choice: describe(&plan.chosen),
            planner_measured_ms: plan
                .timed
                .iter()
                .map(|t| (describe(&t.candidate), round(t.slowest_ms, 5)))
                .collect(),
        }
    }

    /// ` planner_ms X (choice)`, for the printed line.
    pub fn line(&self) -> String {
        format!(
            " planner_ms {:.4} ({})",
            self.planner_ms, self.planner_choice
        )
    }
}

/// Every mode's times (collective), timed in turns, with the planner's choice as a fifth turn
/// where `plan` is given (`op` then switches to it in [`ModeCall::use_plan`]).
pub fn time_modes_and_plan<L: Copy + std::fmt::Debug + PartialEq>(
    rt: &Runtime,
    comm: &NcclComm,
    op: &mut impl ModeCall,
    plan: Option<&Plan<L>>,
    describe: impl Fn(&Candidate<L>) -> String,
) -> Result<(ModeTimes, Option<PlannerTimes>)> {
    let (medians, planner) = match plan {
        None => (time_in_turns(rt, op)?, None),
        Some(plan) => {
            let (medians, planned) = time_in_turns_with_plan(rt, op)?;
            let every_rank = comm.gather_f64(planned)?;
            (
                medians,
                Some(PlannerTimes::new(plan, &every_rank, describe)),
            )
        }
    };
    Ok((mode_times(comm, medians)?, planner))
}

/// How the rows name a candidate of an operation with one launch plan: its mode.
pub fn mode_of(candidate: &Candidate<()>) -> String {
    mode_name(candidate.mode).to_string()
}

/// A mode's name as the rows spell it.
pub fn mode_name(mode: ExchangeMode) -> &'static str {
    match mode {
        ExchangeMode::PipelinedChain => "pipelined_chain",
        common => {
            let i = COMMON_MODES
                .iter()
                .position(|&m| m == common)
                .expect("every other mode is common");
            MODE_NAMES[i]
        }
    }
}

/// Mode names as the JSON rows spell them, in [`COMMON_MODES`] order.
pub const MODE_NAMES: [&str; 4] = [
    "overlapped",
    "sequential_nccl",
    "sequential_nvshmem",
    "no_comm",
];

/// The time of every mode, as the JSON rows of `lasp2_forward` and `lasp2_backward` hold it
/// (flattened into the row): `{mode}_ms`, the slowest rank's median, and `per_rank_ms`, every
/// rank's median per mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModeTimes {
    pub overlapped_ms: f64,
    pub sequential_nccl_ms: f64,
    pub sequential_nvshmem_ms: f64,
    pub no_comm_ms: f64,
    /// The pipelined chain's, where the operation has one (null otherwise).
    pub pipelined_chain_ms: Option<f64>,
    pub per_rank_ms: PerRankMs,
}

/// Every rank's median per mode, indexed by rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PerRankMs {
    pub overlapped: Vec<f64>,
    pub sequential_nccl: Vec<f64>,
    pub sequential_nvshmem: Vec<f64>,
    pub no_comm: Vec<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipelined_chain: Option<Vec<f64>>,
}

impl ModeTimes {
    /// From every rank's medians, `per_rank_by_mode[mode][rank]` (modes in [`COMMON_MODES`]
    /// order). A mode's time is its slowest rank's median: the call takes as long as that rank.
    pub fn from_per_rank(per_rank_by_mode: [Vec<f64>; 4]) -> Self {
        let [o, n, s, c] = &per_rank_by_mode;
        ModeTimes {
            overlapped_ms: slowest_of(o),
            sequential_nccl_ms: slowest_of(n),
            sequential_nvshmem_ms: slowest_of(s),
            no_comm_ms: slowest_of(c),
            pipelined_chain_ms: None,
            per_rank_ms: PerRankMs {
                overlapped: rounded(o),
                sequential_nccl: rounded(n),
                sequential_nvshmem: rounded(s),
                no_comm: rounded(c),
                pipelined_chain: None,
            },
        }
    }

    /// With the pipelined chain's medians, `per_rank[rank]`.
    pub fn with_chain(mut self, per_rank: &[f64]) -> Self {
        self.pipelined_chain_ms = Some(slowest_of(per_rank));
        self.per_rank_ms.pipelined_chain = Some(rounded(per_rank));
        self
    }

    /// The slowest rank's time per mode, in [`COMMON_MODES`] order.
    pub fn slowest(&self) -> [f64; 4] {
        [
            self.overlapped_ms,
            self.sequential_nccl_ms,
            self.sequential_nvshmem_ms,
            self.no_comm_ms,
        ]
    }

    /// ` {mode}_ms X` per mode, for the printed line.
    pub fn line(&self) -> String {
        let chain = self.pipelined_chain_ms.map(|ms| ("pipelined_chain", ms));
        MODE_NAMES
            .into_iter()
            .zip(self.slowest())
            .chain(chain)
            .map(|(mode, ms)| format!(" {mode}_ms {ms:.4}"))
            .collect()
    }
}

/// Every rank's medians, rounded for the rows.
fn rounded(per_rank: &[f64]) -> Vec<f64> {
    per_rank.iter().map(|&x| round(x, 5)).collect()
}

/// Where the sequential NCCL mode gathers on `rt`, as the rows name it: "window" (a symmetric
/// NCCL window, where NCCL registers one) or "plain" (`LASP_NCCL_WINDOW=0`).
pub fn nccl_baseline(rt: &Runtime) -> &'static str {
    if rt.nccl_window() {
        "window"
    } else {
        "plain"
    }
}

/// The slowest rank's median: a call takes as long as that rank.
fn slowest_of(per_rank: &[f64]) -> f64 {
    round(per_rank.iter().copied().fold(f64::MIN, f64::max), 5)
}

/// One timed LASP-2 shape (per-GPU dimensions, Dk = Dv = D) and its modes, as a row of a
/// program's `--json` file.
#[derive(Debug, Serialize)]
pub struct ModeRow {
    #[serde(rename = "W")]
    pub w: usize,
    #[serde(rename = "B")]
    pub b: usize,
    #[serde(rename = "T_local")]
    pub t_local: usize,
    #[serde(rename = "H")]
    pub h: usize,
    #[serde(rename = "D")]
    pub d: usize,
    #[serde(flatten)]
    pub modes: ModeTimes,
    /// The planner's choice, where the program ran it (`--plan`).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub planner: Option<PlannerTimes>,
    /// The links the exchange ran over: "nvlink", or the emulated links' label
    /// (`LASP_EMULATE_LINKS`; only the device schedules' puts are held to their rates).
    pub link: String,
    /// Where the sequential NCCL mode gathered ([`nccl_baseline`]).
    pub nccl_baseline: &'static str,
}

impl ModeRow {
    /// The row of `shape` (T is T_local) timed on every rank of `rt`, over its links.
    pub fn new(rt: &Runtime, shape: ForwardShape, modes: ModeTimes) -> Self {
        ModeRow {
            w: rt.npes(),
            b: shape.b,
            t_local: shape.t,
            h: shape.h,
            d: shape.dk,
            modes,
            planner: None,
            link: links_label(rt),
            nccl_baseline: nccl_baseline(rt),
        }
    }
}

/// What the rows call the links `rt` exchanges over: the emulated links' label where it emulates
/// them (`LASP_EMULATE_LINKS`), else "nvlink".
pub fn links_label(rt: &Runtime) -> String {
    rt.link_emulation()
        .map_or_else(|| "nvlink".to_string(), LinkEmulation::label)
}

/// Every rank's medians per mode (from [`time_in_turns`]) gathered on every rank. Collective.
/// Which rank is slowest (the chain's last folds the most tiles) says where the time over W = 1
/// goes.
pub fn mode_times(comm: &NcclComm, medians: TurnMedians) -> Result<ModeTimes> {
    let mut per_mode: [Vec<f64>; 4] = Default::default();
    for (median, ranks) in medians.modes.into_iter().zip(per_mode.iter_mut()) {
        *ranks = comm.gather_f64(median)?;
    }
    let times = ModeTimes::from_per_rank(per_mode);
    Ok(match medians.chain {
        Some(median) => times.with_chain(&comm.gather_f64(median)?),
        None => times,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_times_are_the_slowest_rank_and_every_rank_in_json() {
        let times = ModeTimes::from_per_rank([
            vec![1.0, 1.25],
            vec![2.0, 1.5],
            vec![3.0, 3.123456789],
            vec![0.5, 0.25],
        ]);
        assert_eq!(times.slowest(), [1.25, 2.0, 3.12346, 0.5]);
        let json: serde_json::Value = serde_json::from_str(&to_json(&times)).unwrap();
        assert_eq!(json["overlapped_ms"], 1.25);
        assert_eq!(json["sequential_nvshmem_ms"], 3.12346);
        assert_eq!(json["per_rank_ms"]["sequential_nccl"][1], 1.5);
        assert_eq!(json["per_rank_ms"]["no_comm"].as_array().unwrap().len(), 2);
        assert_eq!(
            times.line(),
            " overlapped_ms 1.2500 sequential_nccl_ms 2.0000 sequential_nvshmem_ms 3.1235 no_comm_ms 0.5000"
        );
        assert!(json["pipelined_chain_ms"].is_null());
        let chained = times.with_chain(&[0.75, 1.0]);
        assert_eq!(chained.pipelined_chain_ms, Some(1.0));
        assert!(chained.line().ends_with(" pipelined_chain_ms 1.0000"));
        let json: serde_json::Value = serde_json::from_str(&to_json(&chained)).unwrap();
        assert_eq!(json["per_rank_ms"]["pipelined_chain"][0], 0.75);
        assert_eq!(mode_name(ExchangeMode::PipelinedChain), "pipelined_chain");
        assert_eq!(mode_name(ExchangeMode::NoComm), "no_comm");
    }

    #[test]
    fn shapes_and_rounding() {
        let s = parse_shape("4x8192x16x128").unwrap();
        assert_eq!((s.b, s.t, s.h, s.dk, s.dv), (4, 8192, 16, 128, 128));
        assert!(parse_shape("4x8192x16").is_err());
        assert!(parse_shape("4xTx16x128").is_err());
        assert_eq!(round(0.123456, 3), 0.123);
        assert_eq!(
            serde_json::to_string(&round(1.0 / 3.0, 5)).unwrap(),
            "0.33333"
        );
    }
}
