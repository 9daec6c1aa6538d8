//! The mLSTM's LASP-2 forward (`ops::mlstm::MlstmLasp2Forward`) on every GPU under `lasp-run`.
//!
//! ```text
//! lasp-run -n 2 mlstm_lasp2                            # the checks
//! lasp-run -n 4 mlstm_lasp2 --no-check --time 4x8192x16x128 --time 8x2048x16x128 --json out.json
//! lasp-run -n 4 mlstm_lasp2 --no-check --plan --time 8x2048x16x128 --json planned.json
//! ```
//!
//! Checks (every PE): the whole sequence's inputs from the f64 reference's generator
//! (`reference::mlstm::MlstmInputs`, q, k, v rounded to bf16, the gates and the initial state to
//! f32), cut into shards of unequal length (one of a single token, ragged chunks); this PE's h
//! against the reference's stabilised recurrence of the whole sequence (relative error <= 5e-3;
//! the final state's C, n and m on the last PE), in every exchange mode, each mode's outputs
//! bitwise equal to the overlapped mode's, a repeated call and `--graph-calls` replays of a
//! captured overlapped call bitwise equal; outputs poisoned before each call. The gate regimes
//! are the reference's: typical gates, input gates of hundreds (the stabiliser jumps across
//! shards), forget gates near zero. One line per case and PE; exit status 1 when any check
//! failed. Timing (`--time BxTxHxD`, T per GPU): the modes in turns (`time_in_turns`), the row is
//! the slowest rank's median. `--plan`: the planner (`exchange::planner`) chooses the mode first,
//! and its choice is timed in turns with the modes (`planner_ms`, `planner_choice`).

use clap::Parser;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::{ExchangeMode, Lasp2Layout};
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::mlstm::{Mlstm, MlstmArgs, MlstmLasp2Forward, MlstmStateMut, MlstmStateRef};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::mlstm::{recurrent_forward, MlstmInputs, MlstmRegime, MlstmSpec};
use lasp_shmem::reference::{rel_err, Shape};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::graph_replay::{replay, Outputs};
use lasp_shmem_examples::{
    bf16_bits, bf16s, f32_bits, f32s, lasp2_config, main_under_launcher, mode_of, parse_shape,
    planner_choice, round, run_cases, shard_rows, time_modes_and_plan, time_shapes, ModeCall,
    ModeRow, NamedCase, PlannerTimes,
};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(name = "mlstm_lasp2")]
struct Options {
    /// Time these per-GPU shapes (BxTxHxD, T per GPU) in every mode.
    #[arg(long = "time", value_name = "BxTxHxD", value_parser = parse_shape)]
    time: Vec<ForwardShape>,
    /// Skip the checks.
    #[arg(long)]
    no_check: bool,
    /// Graph replays of one captured overlapped call in each check.
    #[arg(long, default_value_t = 100)]
    graph_calls: u32,
    /// Write the timing rows here (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Run the planner at each timed shape and time its choice in turns with the modes
    /// (`planner_ms`, `planner_choice` in the row).
    #[arg(long)]
    plan: bool,
}

const TOL: f64 = 5e-3;
const POISON: u16 = 0xFFFF;

/// One check: dimensions, the shards' lengths (one per PE), the gates, the initial state, and
/// the segments and states pieces each shard is forced into (else the plan's).
struct Case {
    b: usize,
    h: usize,
    dk: usize,
    dv: usize,
    lengths: Vec<usize>,
    regime: MlstmRegime,
    initial_state: bool,
    segments: Option<u32>,
    splits: Option<u32>,
}

impl NamedCase for Case {
    fn name(&self) -> String {
        format!(
            "mlstm_B{}_H{}_Dk{}_Dv{}_{:?}_shards{:?}{}{}{}",
            self.b,
            self.h,
            self.dk,
            self.dv,
            self.regime,
            self.lengths,
            if self.initial_state { "_state0" } else { "" },
            self.segments.map_or(String::new(), |n| format!("_S{n}")),
            self.splits.map_or(String::new(), |n| format!("_R{n}"))
        )
    }
}

fn cases(npes: usize) -> Vec<Case> {
    // Whole and ragged chunks, the last shard 37 tokens short.
    let ragged = |base: usize| -> Vec<usize> {
        (0..npes)
            .map(|r| base + 64 * r - if r + 1 == npes { 37 } else { 0 })
            .collect()
    };
    // A one-token shard, then 63, 65 and 130 tokens.
    let tiny: Vec<usize> = [1, 63, 65, 130].into_iter().cycle().take(npes).collect();
    let case = |dk, dv, lengths, regime, initial_state| Case {
        b: 1,
        h: 2,
        dk,
        dv,
        lengths,
        regime,
        initial_state,
        segments: None,
        splits: None,
    };
    use MlstmRegime::*;
    let mut out: Vec<Case> = [(128, 128), (64, 64), (64, 128), (128, 64)]
        .into_iter()
        .map(|(dk, dv)| case(dk, dv, ragged(200), Typical, true))
        .collect();
    for (regime, initial_state) in [(LargeInputGate, true), (ForgetNearZero, false)] {
        out.push(Case {
            b: 2,
            ..case(128, 128, ragged(300), regime, initial_state)
        });
    }
    out.push(case(128, 128, tiny, LargeInputGate, false));
    // Every shard in three segments of two pieces each (some empty).
    out.push(Case {
        segments: Some(3),
        splits: Some(2),
        ..case(128, 128, ragged(400), Typical, true)
    });
    out
}

/// One PE's shard on the device.
struct Shard {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    i_gate: CudaSlice<f32>,
    f_gate: CudaSlice<f32>,
    /// The sequence's initial state (C, n, m), the same on every PE.
    state0: Option<[CudaSlice<f32>; 3]>,
    h: CudaSlice<bf16>,
    /// The final state, on the last PE.
    state_t: Option<[CudaSlice<f32>; 3]>,
    scale: Option<f32>,
    eps: Option<f32>,
}

/// The bits one call left in h and (on the last PE) the final state.
#[derive(PartialEq)]
struct Bits {
    h: Vec<u16>,
    state: Vec<Vec<u32>>,
}

impl Shard {
    fn args(&mut self) -> MlstmArgs<'_> {
        MlstmArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            i_gate: DeviceRef::new(&self.i_gate),
            f_gate: DeviceRef::new(&self.f_gate),
            initial_state: self.state0.as_ref().map(|[c, n, m]| MlstmStateRef {
                c: DeviceRef::new(c),
                n: DeviceRef::new(n),
                m: DeviceRef::new(m),
            }),
            h: DeviceMut::new(&mut self.h),
            saved: None,
            final_state: self.state_t.as_mut().map(|[c, n, m]| MlstmStateMut {
                c: DeviceMut::new(c),
                n: DeviceMut::new(n),
                m: DeviceMut::new(m),
            }),
            scale: self.scale,
            eps: self.eps,
        }
    }

    /// One call on poisoned outputs; their bits.
    fn call(&mut self, op: &mut MlstmLasp2Forward, stream: &Arc<CudaStream>) -> Result<Bits> {
        self.poison(stream)?;
        op.forward(stream, self.args())?;
        op.finish(stream)?;
        self.bits(stream)
    }
}

impl Outputs for Shard {
    /// The bits of h and (on the last PE) the final state.
    type Bits = Bits;

    /// h and the final state filled with poison bit patterns.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memcpy_htod(&vec![bf16::from_bits(POISON); self.h.len()], &mut self.h)?;
        for x in self.state_t.iter_mut().flatten() {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); x.len()], x)?;
        }
        Ok(())
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> Result<Bits> {
        let mut state = Vec::new();
        for x in self.state_t.iter().flatten() {
            state.push(f32_bits(stream, Some(x))?);
        }
        Ok(Bits {
            h: bf16_bits(stream, &self.h)?,
            state,
        })
    }
}

fn check_case(
    rt: &Runtime,
    case: &Case,
    seed: u64,
    graph_calls: u32,
) -> Result<std::result::Result<String, String>> {
    let (me, npes) = (rt.pe(), rt.npes());
    let whole = Shape {
        b: case.b,
        t: case.lengths.iter().sum(),
        h: case.h,
        dk: case.dk,
        dv: case.dv,
    };
    let inputs = MlstmInputs::generate(&MlstmSpec {
        shape: whole,
        regime: case.regime,
        seed,
        round_to_bf16: true,
        initial_state: case.initial_state,
    })
    .map_err(|e| Error::State(format!("input generation: {e}")))?;
    let want = recurrent_forward(&inputs).map_err(|e| Error::State(format!("reference: {e}")))?;
    let start: usize = case.lengths[..me].iter().sum();
    let len = case.lengths[me];
    let last = me + 1 == npes;
    let stream = rt.stream().clone();
    let shape = ForwardShape {
        t: len,
        ..ForwardShape::from(whole)
    };
    let state0 = match &inputs.initial_state {
        Some(st) => Some([
            stream.clone_htod(&f32s(st.c.data()))?,
            stream.clone_htod(&f32s(st.n.data()))?,
            stream.clone_htod(&f32s(st.m.data()))?,
        ]),
        None => None,
    };
    let state_t = if last {
        Some([
            stream.alloc_zeros(shape.state_len())?,
            stream.alloc_zeros(shape.b * shape.h * shape.dk)?,
            stream.alloc_zeros(shape.b * shape.h)?,
        ])
    } else {
        None
    };
    let mut shard = Shard {
        shape,
        q: stream.clone_htod(&bf16s(&shard_rows(&inputs.q, start, len)))?,
        k: stream.clone_htod(&bf16s(&shard_rows(&inputs.k, start, len)))?,
        v: stream.clone_htod(&bf16s(&shard_rows(&inputs.v, start, len)))?,
        i_gate: stream.clone_htod(&f32s(&shard_rows(&inputs.input_gate, start, len)))?,
        f_gate: stream.clone_htod(&f32s(&shard_rows(&inputs.forget_gate, start, len)))?,
        state0,
        h: stream.alloc_zeros(shape.v_len())?,
        state_t,
        scale: Some(inputs.scale as f32),
        eps: Some(inputs.eps as f32),
    };
    let mut op = MlstmLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?;
    op.set_num_segments(case.segments);
    op.set_states_splits(case.splits);
    let first = shard.call(&mut op, &stream)?;
    let mut problems = Vec::new();
    if shard.call(&mut op, &stream)? != first {
        problems.push("a repeated call gave other bits".to_string());
    }
    for mode in [
        ExchangeMode::SequentialNccl,
        ExchangeMode::SequentialNvshmem,
        ExchangeMode::PipelinedChain,
    ] {
        op.set_mode(mode)?;
        if shard.call(&mut op, &stream)? != first {
            problems.push(format!("{mode:?} differs from Overlapped"));
        }
    }
    let replayed = replay(
        rt,
        &mut op,
        &mut shard,
        graph_calls,
        &first,
        |shard, op, stream| op.forward(stream, shard.args()).map(|_| ()),
    )?;
    problems.extend(replayed.err());
    op.free()?;
    let mut errors = Vec::new();
    let mut check = |what: &str, got: Vec<f64>, want: &[f64]| {
        let e = rel_err(&got, want);
        if e.is_nan() || e > TOL {
            problems.push(format!("{what}: rel err {e:.3e} > {TOL:.0e}"));
        }
        errors.push(format!("{what} {e:.2e}"));
    };
    let h: Vec<f64> = first
        .h
        .iter()
        .map(|&x| bf16::from_bits(x).to_f64())
        .collect();
    check("h", h, &shard_rows(&want.h, start, len));
    let st = &want.final_state;
    for ((what, bits), want) in ["C_t", "n_t", "m_t"]
        .into_iter()
        .zip(&first.state)
        .zip([&st.c, &st.n, &st.m])
    {
        let got = bits.iter().map(|&x| f64::from(f32::from_bits(x))).collect();
        check(what, got, want.data());
    }
    let detail = format!("rel err {}", errors.join(" "));
    Ok(if problems.is_empty() {
        Ok(format!(
            "{detail}, every mode and {graph_calls} graph replays bitwise equal"
        ))
    } else {
        Err(format!("{detail}: {}", problems.join("; ")))
    })
}

/// The operation over one random shard, as `time_in_turns` drives it.
struct Timed {
    op: MlstmLasp2Forward,
    shard: Shard,
    /// The planner's choice, where it ran.
    planned: Option<ExchangeMode>,
}

impl ModeCall for Timed {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.op.set_mode(mode)
    }
    fn use_plan(&mut self) -> Result<()> {
        let mode = planner_choice(self.planned)?;
        self.op.set_mode(mode)
    }
    fn has_chain(&self) -> bool {
        self.op.supports(ExchangeMode::PipelinedChain)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.forward(stream, self.shard.args()).map(|_| ())
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }
}

fn time_shape(rt: &Runtime, comm: &NcclComm, shape: ForwardShape, plan: bool) -> Result<ModeRow> {
    let stream = rt.stream().clone();
    let mut rng = lasp_shmem::reference::SplitMix64::new(11 + rt.pe() as u64);
    let mut uniform = move || rng.next_u64() as f64 / u64::MAX as f64;
    let mut normal = |len: usize| -> Vec<bf16> {
        (0..len)
            .map(|_| bf16::from_f64(uniform() * 2.0 - 1.0))
            .collect()
    };
    let (q, k, v) = (
        normal(shape.qk_len()),
        normal(shape.qk_len()),
        normal(shape.v_len()),
    );
    let tokens = shape.b * shape.t * shape.h;
    // mlstm_kernels' benchmark gates: input pre-activations around 0, forget around 3 (sigmoid
    // 0.95).
    let mut rng = lasp_shmem::reference::SplitMix64::new(17 + rt.pe() as u64);
    let mut gate = |centre: f32| -> Vec<f32> {
        (0..tokens)
            .map(|_| centre + (rng.next_u64() as f64 / u64::MAX as f64) as f32 * 2.0 - 1.0)
            .collect()
    };
    let (i_gate, f_gate) = (gate(0.0), gate(3.0));
    let shard = Shard {
        shape,
        q: stream.clone_htod(&q)?,
        k: stream.clone_htod(&k)?,
        v: stream.clone_htod(&v)?,
        i_gate: stream.clone_htod(&i_gate)?,
        f_gate: stream.clone_htod(&f_gate)?,
        state0: None,
        h: stream.alloc_zeros(shape.v_len())?,
        state_t: None,
        scale: None,
        eps: None,
    };
    let mut timed = Timed {
        op: MlstmLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
        shard,
        planned: None,
    };
    let plan = if plan {
        let Timed { op, shard, .. } = &mut timed;
        Some(op.plan(&stream, shape.t, |op, stream| {
            op.forward(stream, shard.args()).map(|_| ())
        })?)
    } else {
        None
    };
    timed.planned = plan.as_ref().map(|p| p.chosen.mode);
    let (modes, planner) = time_modes_and_plan(rt, comm, &mut timed, plan.as_ref(), mode_of)?;
    timed.op.free()?;
    let row = ModeRow {
        planner,
        ..ModeRow::new(rt, shape, modes)
    };
    if rt.pe() == 0 {
        let chain = row
            .modes
            .pipelined_chain_ms
            .map_or(String::new(), |ms| format!(", chain {:.4}", round(ms, 4)));
        println!(
            "W={} B={} T_local={} H={} D={}: overlapped {:.4} ms, sequential NCCL {:.4}, sequential NVSHMEM {:.4}, no-comm {:.4}{chain}{}",
            row.w,
            row.b,
            row.t_local,
            row.h,
            row.d,
            round(row.modes.overlapped_ms, 4),
            round(row.modes.sequential_nccl_ms, 4),
            round(row.modes.sequential_nvshmem_ms, 4),
            round(row.modes.no_comm_ms, 4),
            row.planner.as_ref().map_or(String::new(), PlannerTimes::line)
        );
    }
    Ok(row)
}

fn run(options: Options, config: Config) -> Result<bool> {
    let rt = Runtime::init(config)?;
    let mut failed = 0;
    if !options.no_check {
        failed = run_cases(&rt, &cases(rt.npes()), 5100, |case, seed| {
            check_case(&rt, case, seed, options.graph_calls)
        })?;
    }
    time_shapes(
        &rt,
        &options.time,
        options.json.as_deref(),
        |comm, shape| time_shape(&rt, comm, shape, options.plan),
    )?;
    rt.shutdown()?;
    Ok(failed == 0)
}

/// A heap for the largest timed layout or the checks' largest.
fn config(options: &Options, npes: usize) -> Result<Config> {
    let checks = Lasp2Layout {
        b: 2,
        h: 2,
        dk: 128,
        dv: 128,
    };
    lasp2_config::<Mlstm>(&options.time, checks, npes)
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe { main_under_launcher("mlstm_lasp2", Options::parse(), config, run) }
}
