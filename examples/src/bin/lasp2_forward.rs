//! LASP-2 forward of scalar-decay linear attention on every launched GPU, checked.
//!
//! ```text
//! lasp-run -n 4 target/release/lasp2_forward                      # checks, then times every mode
//! lasp-run -n 4 target/release/lasp2_forward --graph-calls 10000  # + a long graph replay
//! ```
//!
//! Each rank holds one slice of every sequence (the last rank's slice is shorter). The program
//! checks the outputs of every rank and the final state against the CPU f64 reference, that every
//! exchange mode gives bitwise the same outputs, that repeated calls and a captured CUDA graph
//! replayed `--graph-calls` times give them too, and prints the time of every mode at each
//! `--time BxTxHxD` (per-rank shard length T, repeatable; default 4x8192x16x128), as JSON rows
//! into `--json FILE` when given (benches/lasp2-bench.sh runs it for W = 1, 2, 4, ... up to the node's GPU count).
//! Fault drills: `--silent-rank K` (rank K never calls: the later ranks must fail naming it),
//! `--mismatch-rank K` (rank K sets up another H: every rank must refuse before any state moves).
//! Launch plan of the timed runs: `--groups G` head groups, `--ctas-per-sm K` (defaults:
//! `Lasp2Tuning::default()`); the checks also compare other groupings bitwise.
//! `--timeline PREFIX`: after timing a shape, one more overlapped call records `%globaltimer`
//! stamps; every rank writes `PREFIX.B{B}_T{T}.rank{R}.json` (ns since its first output CTA
//! started: puts issued / complete per tile, per output CTA start / data seen / loop start) and the
//! row gets `max_output_wait_us`, the longest any output CTA waited for data, over ranks.
//! `--plan`: at each timed shape the planner (`exchange::planner`) chooses a mode and launch plan
//! first, and its choice is timed in turns with the modes (`planner_ms`, `planner_choice`).
//! `--no-check`: only the timed calls (for a profiler, which then sees no checking launches
//! before them); the checks are what make the times mean anything, so run them once per build.

use clap::Parser;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::planner::{Candidate, LaunchPlans};
use lasp_shmem::ops::scalar_decay::lasp2::{ExchangeMode, Lasp2Forward, Lasp2Layout, Lasp2Tuning};
use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardShape};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{
    assert_rel_close, scalar_decay, Family, InputSpec, Inputs, Regime, Shape,
};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::{
    bf16_bits, bf16_values, config_with_heap, f32_bits, f32_values, links_label,
    main_under_launcher, mode_name, nccl_baseline, parse_shape, planner_choice, round,
    shard_lengths, time_modes_and_plan, write_json, ModeCall, ModeTimes, PlannerTimes,
};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Tolerance against the f64 reference with bf16 inputs and a bf16 output (the output's own
/// rounding is ~4e-3 relative at worst; fla's tests use 5e-3 likewise).
const TOL: f64 = 5e-3;

/// LASP-2 forward of scalar-decay linear attention on every launched GPU: checks against the
/// f64 reference, then times every exchange mode.
#[derive(Parser, Debug)]
#[command(name = "lasp2_forward")]
struct Options {
    /// Graph replays of one captured overlapped call in the checks.
    #[arg(long, value_name = "N", default_value_t = 100)]
    graph_calls: u32,
    /// Time every mode at this shape (per-rank shard length T; repeatable; default
    /// 4x8192x16x128).
    #[arg(long, value_name = "BxTxHxD", value_parser = parse_shape)]
    time: Vec<ForwardShape>,
    /// Time nothing (only the checks).
    #[arg(long)]
    no_time: bool,
    /// Skip the checks (only the timed calls, e.g. for a profiler).
    #[arg(long = "no-check")]
    skip_check: bool,
    /// Write the timed rows as a JSON array here (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Fault drill: rank K never calls; the later ranks must fail naming it.
    #[arg(long, value_name = "K")]
    silent_rank: Option<usize>,
    /// The fault drills' exchange: the pipelined chain instead of the all-gather.
    #[arg(long)]
    drill_chain: bool,
    /// Fault drill: rank K sets up another H; every rank must refuse before any state moves.
    #[arg(long, value_name = "K")]
    mismatch_rank: Option<usize>,
    /// Head groups of the timed runs (default: Lasp2Tuning::default()).
    #[arg(long = "groups", value_name = "G")]
    head_groups: Option<usize>,
    /// CTAs per SM of the timed runs (default: Lasp2Tuning::default()).
    #[arg(long, value_name = "K")]
    ctas_per_sm: Option<u32>,
    /// After timing a shape, record one overlapped call's timeline into
    /// PREFIX.B{B}_T{T}.rank{R}.json.
    #[arg(long, value_name = "PREFIX")]
    timeline: Option<String>,
    /// Run the planner at each timed shape and time its choice in turns with the modes
    /// (`planner_ms`, `planner_choice` in the row).
    #[arg(long)]
    plan: bool,
}

impl Options {
    /// The shapes to time: `--time`, else the default one, none with `--no-time`.
    fn shapes(&self) -> Vec<ForwardShape> {
        match (self.no_time, self.time.is_empty()) {
            (true, _) => Vec::new(),
            (false, true) => vec![parse_shape("4x8192x16x128").expect("a valid shape")],
            (false, false) => self.time.clone(),
        }
    }
}

/// This rank's tensors on the device, and its outputs.
struct Shard {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    h0: CudaSlice<f32>,
    o: CudaSlice<bf16>,
    ht: Option<CudaSlice<f32>>,
}

impl Shard {
    fn upload(
        stream: &Arc<CudaStream>,
        inputs: &Inputs,
        start: usize,
        len: usize,
        last: bool,
    ) -> Result<Self> {
        let s = inputs.shape;
        let to_bf16 = |t: &lasp_shmem::reference::Tensor| -> Vec<bf16> {
            t.slice_time(start, len)
                .data()
                .iter()
                .map(|&x| bf16::from_f64(x))
                .collect()
        };
        let shape = ForwardShape {
            b: s.b,
            t: len,
            h: s.h,
            dk: s.dk,
            dv: s.dv,
        };
        Ok(Shard {
            shape,
            q: stream.clone_htod(&to_bf16(&inputs.q))?,
            k: stream.clone_htod(&to_bf16(&inputs.k))?,
            v: stream.clone_htod(&to_bf16(&inputs.v))?,
            g: stream.clone_htod(
                &inputs
                    .g
                    .slice_time(start, len)
                    .data()
                    .iter()
                    .map(|&x| x as f32)
                    .collect::<Vec<_>>(),
            )?,
            h0: stream.clone_htod(
                &inputs
                    .h0
                    .as_ref()
                    .expect("generated with a state")
                    .data()
                    .iter()
                    .map(|&x| x as f32)
                    .collect::<Vec<_>>(),
            )?,
            o: stream.alloc_zeros(shape.v_len())?,
            ht: if last {
                Some(stream.alloc_zeros(shape.state_len())?)
            } else {
                None
            },
        })
    }

    /// Fills the outputs with NaN, so anything a call does not write shows.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memcpy_htod(&vec![bf16::from_bits(0xFFFF); self.o.len()], &mut self.o)?;
        if let Some(ht) = &mut self.ht {
            stream.memcpy_htod(&vec![f32::NAN; ht.len()], ht)?;
        }
        Ok(())
    }

    fn call(&mut self, op: &mut Lasp2Forward, stream: &Arc<CudaStream>) -> Result<()> {
        let args = ForwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: Some(DeviceRef::new(&self.h0)),
            o: DeviceMut::new(&mut self.o),
            ht: self.ht.as_mut().map(DeviceMut::new),
            scale: None,
        };
        op.forward(stream, args)
    }

    /// The outputs as raw bits (for bitwise comparison) after a poisoned call.
    fn run_checked(
        &mut self,
        op: &mut Lasp2Forward,
        stream: &Arc<CudaStream>,
    ) -> Result<(Vec<u16>, Vec<u32>)> {
        self.poison(stream)?;
        self.call(op, stream)?;
        op.finish(stream)?;
        let o = bf16_bits(stream, &self.o)?;
        let ht = f32_bits(stream, self.ht.as_ref())?;
        if o.iter().any(|&b| bf16::from_bits(b).is_nan())
            || ht.iter().any(|&b| f32::from_bits(b).is_nan())
        {
            return Err(Error::State(
                "an output element was not written (NaN poison left)".into(),
            ));
        }
        Ok((o, ht))
    }
}

fn check(rt: &Runtime, graph_calls: u32) -> Result<()> {
    let (me, npes) = (rt.pe(), rt.npes());
    // A stream of the caller's own, as a trainer's would be: work the library puts on the
    // runtime's stream instead would not be ordered with it (every mode must follow it).
    let stream = rt.context().new_stream()?;
    // Ragged shards: 3 chunks and a bit per rank, the last rank 37 tokens shorter.
    let lengths = shard_lengths(npes, 3 * 64 + 11, 37);
    let start: usize = lengths[..me].iter().sum();
    let total: usize = lengths.iter().sum();
    for (dk, dv) in [(64, 64), (128, 128)] {
        let spec = InputSpec {
            shape: Shape {
                b: 2,
                t: total,
                h: 3,
                dk,
                dv,
            },
            family: Family::ScalarDecay,
            regime: Regime::Mixed,
            seed: 7 + dk as u64,
            round_to_bf16: true,
            initial_state: true,
        };
        let inputs = Inputs::generate(&spec).map_err(|e| Error::State(e.to_string()))?;
        let want =
            scalar_decay::recurrent_forward(&inputs).map_err(|e| Error::State(e.to_string()))?;
        let mut shard = Shard::upload(&stream, &inputs, start, lengths[me], me + 1 == npes)?;
        let mut op = Lasp2Forward::new(
            rt,
            Lasp2Layout { b: 2, h: 3, dk, dv },
            ExchangeMode::Overlapped,
        )?;

        let (o, ht) = shard.run_checked(&mut op, &stream)?;
        let got = bf16_values(&o);
        assert_rel_close(
            &format!("PE {me} o (Dk={dk})"),
            &got,
            want.o.slice_time(start, lengths[me]).data(),
            TOL,
        )
        .map_err(Error::State)?;
        if !ht.is_empty() {
            let got = f32_values(&ht);
            assert_rel_close("final state", &got, want.final_state.data(), TOL)
                .map_err(Error::State)?;
        }
        println!("PE {me}: Dk=Dv={dk}, shard {} of {total} tokens: matches the f64 reference (rel err <= {TOL})", lengths[me]);

        for mode in ExchangeMode::ALL {
            if mode == ExchangeMode::NoComm {
                continue; // not the LASP-2 result on PEs > 0
            }
            op.set_mode(mode)?;
            for _ in 0..2 {
                if shard.run_checked(&mut op, &stream)? != (o.clone(), ht.clone()) {
                    return Err(Error::State(format!(
                        "PE {me}: {mode:?} gave other bits than the first overlapped call"
                    )));
                }
            }
        }
        println!("PE {me}: overlapped, pipelined chain, sequential NCCL and sequential NVSHMEM give bitwise the same outputs, twice each");

        // Head groups change only which launch computes a head, never its arithmetic (S is
        // bounded by the shard's few chunks here, so it is the same for every grouping).
        let default_tuning = op.tuning();
        for mode in [ExchangeMode::Overlapped, ExchangeMode::PipelinedChain] {
            op.set_mode(mode)?;
            for head_groups in [1, 3, 6] {
                op.set_tuning(Some(Lasp2Tuning {
                    head_groups,
                    ..default_tuning
                }))?;
                if shard.run_checked(&mut op, &stream)? != (o.clone(), ht.clone()) {
                    return Err(Error::State(format!(
                        "PE {me}: {mode:?} with {head_groups} head groups gave other bits than \
                         the default plan"
                    )));
                }
            }
        }
        op.set_tuning(None)?;
        println!(
            "PE {me}: 1, 3 and 6 head groups give bitwise the same outputs as the default plan, overlapped and chained"
        );

        // A captured graph of one call in each device schedule, replayed: epochs advance on the
        // device and the outputs stay bitwise the same.
        for (mode, calls) in [
            (ExchangeMode::PipelinedChain, graph_calls.min(100)),
            (ExchangeMode::Overlapped, graph_calls),
        ] {
            let (before, after, replayed) =
                replay_graph(rt, &stream, &mut op, &mut shard, mode, calls)?;
            if after != before + calls as u64 || replayed != o {
                return Err(Error::State(format!("PE {me}: {mode:?} graph replay: epoch {before} -> {after} for {calls} replays, outputs {}", if replayed == o { "identical" } else { "DIFFER" })));
            }
            println!("PE {me}: {calls} graph-replayed calls, no error, {mode:?}, outputs bitwise identical at the end");
        }
        op.free()?;
    }
    Ok(())
}

/// Captures one call of `op` in `mode` into a CUDA graph and replays it `calls` times over a
/// poisoned output: the epochs before and after, and the output's bits.
fn replay_graph(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    op: &mut Lasp2Forward,
    shard: &mut Shard,
    mode: ExchangeMode,
    calls: u32,
) -> Result<(u64, u64, Vec<u16>)> {
    op.set_mode(mode)?;
    shard.poison(stream)?;
    let before = op.epoch(stream)?;
    rt.barrier_on_stream(stream)?;
    stream.synchronize()?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = shard.call(op, stream);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
    captured?;
    let graph = graph.ok_or_else(|| Error::State("the capture recorded nothing".into()))?;
    for _ in 0..calls {
        graph.launch()?;
    }
    op.note_replayed_calls(calls as u64);
    op.finish(stream)?;
    let after = op.epoch(stream)?;
    let replayed = stream
        .clone_dtoh(&shard.o)?
        .iter()
        .map(|x| x.to_bits())
        .collect();
    Ok((before, after, replayed))
}

/// The forward of one shard, as the timing loop drives it: the modes at the program's launch
/// plan, and the planner's choice where it ran.
struct Timed<'a> {
    op: &'a mut Lasp2Forward,
    shard: &'a mut Shard,
    tuning: Lasp2Tuning,
    plan: Option<Candidate<Lasp2Tuning>>,
}

impl ModeCall for Timed<'_> {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.op.set_launch(self.tuning)?;
        self.op.set_mode(mode)
    }
    fn use_plan(&mut self) -> Result<()> {
        let plan = planner_choice(self.plan)?;
        self.op.set_launch(plan.launch)?;
        self.op.set_mode(plan.mode)
    }
    fn has_chain(&self) -> bool {
        self.op.supports(ExchangeMode::PipelinedChain)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.shard.call(self.op, stream)
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }
}

/// One timed shape, as a row of the `--json` file.
#[derive(Serialize)]
struct Row {
    #[serde(rename = "W")]
    w: usize,
    #[serde(rename = "B")]
    b: usize,
    #[serde(rename = "T_local")]
    t_local: usize,
    #[serde(rename = "H")]
    h: usize,
    #[serde(rename = "D")]
    d: usize,
    head_groups: usize,
    ctas_per_sm: u32,
    #[serde(flatten)]
    modes: ModeTimes,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    planner: Option<PlannerTimes>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_wait_us: Option<f64>,
    /// "nvlink" or the emulated links' label ([`links_label`]).
    link: String,
    /// Where the sequential NCCL mode gathered ([`nccl_baseline`]).
    nccl_baseline: &'static str,
}

/// How the rows name a candidate of the planner.
fn describe(c: &Candidate<Lasp2Tuning>) -> String {
    format!(
        "{}, {} head group(s), {} CTA/SM",
        mode_name(c.mode),
        c.launch.head_groups,
        c.launch.ctas_per_sm
    )
}

/// Times every mode at `shape`; returns its row (on every PE; PE 0 prints it).
fn time_modes(
    rt: &Runtime,
    comm: &lasp_shmem::nccl::NcclComm,
    shape: ForwardShape,
    options: &Options,
) -> Result<Row> {
    let stream = rt.stream().clone();
    let mut shard = benchmark_inputs(&stream, &shape)?;
    let mut op = Lasp2Forward::new(
        rt,
        Lasp2Layout {
            b: shape.b,
            h: shape.h,
            dk: shape.dk,
            dv: shape.dv,
        },
        ExchangeMode::Overlapped,
    )?;
    let default = op.tuning();
    let tuning = Lasp2Tuning {
        head_groups: options.head_groups.unwrap_or(default.head_groups),
        ctas_per_sm: options.ctas_per_sm.unwrap_or(default.ctas_per_sm),
    };
    if tuning != default {
        op.set_tuning(Some(tuning))?;
    }
    let (w, b, t, h, d) = (rt.npes(), shape.b, shape.t, shape.h, shape.dk);
    let (groups, ctas) = (tuning.head_groups, tuning.ctas_per_sm);
    let mut line =
        format!("W={w} B={b} T_local={t} H={h} D={d} (head groups {groups}, {ctas} CTA/SM):");
    let plan = if options.plan {
        Some(op.plan(&stream, t, |op, stream| shard.call(op, stream))?)
    } else {
        None
    };
    let mut timed = Timed {
        op: &mut op,
        shard: &mut shard,
        tuning,
        plan: plan.as_ref().map(|p| p.chosen),
    };
    let (modes, planner) = time_modes_and_plan(rt, comm, &mut timed, plan.as_ref(), describe)?;
    timed.op.set_launch(tuning)?;
    line += &modes.line();
    if let Some(p) = &planner {
        line += &p.line();
    }
    let mut max_output_wait_us = None;
    if let Some(prefix) = &options.timeline {
        let wait_us = comm.max_f64(record_timeline(rt, &mut op, &mut shard, prefix)?)?;
        line += &format!(" max_output_wait_us {wait_us:.2}");
        max_output_wait_us = Some(round(wait_us, 3));
    }
    if rt.pe() == 0 {
        println!("{line}");
    }
    op.free()?;
    Ok(Row {
        w,
        b,
        t_local: t,
        h,
        d,
        head_groups: groups,
        ctas_per_sm: ctas,
        modes,
        planner,
        max_output_wait_us,
        link: links_label(rt),
        nccl_baseline: nccl_baseline(rt),
    })
}

/// One rank's `--timeline` file.
#[derive(Serialize)]
struct TimelineFile {
    rank: usize,
    segments: usize,
    clock: &'static str,
    max_output_wait_ns: u64,
    /// Per tile: puts issued, puts complete.
    puts: Vec<[i64; 2]>,
    /// Per output CTA: start, data seen, loop start.
    outputs: Vec<[i64; 3]>,
}

/// One overlapped call with the timeline on; writes this rank's stamps and returns the longest
/// wait (µs) of an output CTA for the earlier ranks' tiles.
fn record_timeline(
    rt: &Runtime,
    op: &mut Lasp2Forward,
    shard: &mut Shard,
    prefix: &str,
) -> Result<f64> {
    let stream = rt.stream().clone();
    op.set_mode(ExchangeMode::Overlapped)?;
    op.record_timeline(true);
    rt.barrier_on_stream(&stream)?;
    shard.call(op, &stream)?;
    op.finish(&stream)?;
    op.record_timeline(false);
    let t = op
        .timeline(&stream)?
        .ok_or_else(|| Error::State("no timeline was recorded".into()))?;
    let origin = t.outputs.iter().map(|o| o[0]).min().unwrap_or(0);
    let rel = |x: u64| x as i64 - origin as i64;
    let waits = t.output_waits_ns();
    let max_wait = waits.iter().copied().max().unwrap_or(0);
    let s = &shard.shape;
    let path = format!("{prefix}.B{}_T{}.rank{}.json", s.b, s.t, rt.pe());
    let file = TimelineFile {
        rank: rt.pe(),
        segments: t.segments,
        clock: "ns since this rank's first output CTA started (this GPU's globaltimer)",
        max_output_wait_ns: max_wait,
        puts: t.puts.iter().map(|p| [rel(p[0]), rel(p[1])]).collect(),
        outputs: t
            .outputs
            .iter()
            .map(|o| [rel(o[0]), rel(o[1]), rel(o[2])])
            .collect(),
    };
    write_json(&path, &file)?;
    Ok(max_wait as f64 * 1e-3)
}

/// Benchmark inputs: a random block repeated over each tensor (timing does not depend on the
/// values; gates are log-sigmoids of normals / 16 as in fla's benchmark).
fn benchmark_inputs(stream: &Arc<CudaStream>, shape: &ForwardShape) -> Result<Shard> {
    let spec = InputSpec {
        shape: Shape {
            b: 1,
            t: 64,
            h: 1,
            dk: shape.dk,
            dv: shape.dv,
        },
        family: Family::ScalarDecay,
        regime: Regime::Typical,
        seed: 11,
        round_to_bf16: true,
        initial_state: false,
    };
    let block = Inputs::generate(&spec).map_err(|e| Error::State(e.to_string()))?;
    let tile = |t: &lasp_shmem::reference::Tensor, n: usize| -> Vec<f64> {
        t.data().iter().copied().cycle().take(n).collect()
    };
    let bf = |v: Vec<f64>| -> Vec<bf16> { v.into_iter().map(bf16::from_f64).collect() };
    Ok(Shard {
        shape: *shape,
        q: stream.clone_htod(&bf(tile(&block.q, shape.qk_len())))?,
        k: stream.clone_htod(&bf(tile(&block.k, shape.qk_len())))?,
        v: stream.clone_htod(&bf(tile(&block.v, shape.v_len())))?,
        g: stream.clone_htod(
            &tile(&block.g, shape.gate_len())
                .into_iter()
                .map(|x| x as f32)
                .collect::<Vec<_>>(),
        )?,
        h0: stream.alloc_zeros(shape.state_len())?,
        o: stream.alloc_zeros(shape.v_len())?,
        ht: None,
    })
}

fn drill(rt: &Runtime, options: &Options) -> Result<()> {
    let stream = rt.stream().clone();
    let (b, h) = (
        1,
        if options.mismatch_rank == Some(rt.pe()) {
            3
        } else {
            2
        },
    );
    let mut op = Lasp2Forward::new(
        rt,
        Lasp2Layout {
            b,
            h,
            dk: 64,
            dv: 64,
        },
        if options.drill_chain {
            ExchangeMode::PipelinedChain
        } else {
            ExchangeMode::Overlapped
        },
    )?;
    let spec = InputSpec {
        shape: Shape {
            b,
            t: 256,
            h,
            dk: 64,
            dv: 64,
        },
        family: Family::ScalarDecay,
        regime: Regime::Typical,
        seed: 3,
        round_to_bf16: true,
        initial_state: true,
    };
    let inputs = Inputs::generate(&spec).map_err(|e| Error::State(e.to_string()))?;
    let mut shard = Shard::upload(&stream, &inputs, 0, 256, false)?;
    if options.silent_rank == Some(rt.pe()) {
        println!("rank {} stays silent (fault drill)", rt.pe());
        std::thread::sleep(rt.wait_timeout() + Duration::from_secs(10));
        return Err(Error::State(
            "the fault drill expected the later ranks to fail first".into(),
        ));
    }
    let result = shard
        .call(&mut op, &stream)
        .and_then(|()| op.finish(&stream));
    if let (Err(e), Some(_)) = (&result, options.silent_rank) {
        // Every rank after the silent one times out at about the same moment; the launcher stops
        // the others once the first exits, so each prints what it names before lingering.
        println!("rank {} drill error: {e}", rt.pe());
        std::thread::sleep(Duration::from_secs(3));
    }
    result
}

fn run(options: Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
    if options.silent_rank.is_some() || options.mismatch_rank.is_some() {
        return drill(&rt, &options).and_then(|()| rt.shutdown());
    }
    if !options.skip_check {
        check(&rt, options.graph_calls)?;
    }
    let shapes = options.shapes();
    if !shapes.is_empty() {
        let comm = lasp_shmem::nccl::NcclComm::new(&rt, rt.stream())?;
        let rows = shapes
            .iter()
            .map(|&shape| time_modes(&rt, &comm, shape, &options))
            .collect::<Result<Vec<_>>>()?;
        if let (Some(path), 0) = (&options.json, rt.pe()) {
            write_json(path, &rows)?;
        }
    }
    rt.shutdown()
}

/// The runtime's settings for `options`: a symmetric heap for the largest timed layout.
fn config(options: &Options, npes: usize) -> Result<Config> {
    let heap = options
        .shapes()
        .iter()
        .map(|s| {
            Lasp2Layout {
                b: s.b,
                h: s.h,
                dk: s.dk,
                dv: s.dv,
            }
            .symmetric_bytes::<lasp_shmem::ops::scalar_decay::ScalarDecay>(npes)
        })
        .max()
        .unwrap_or(0);
    config_with_heap(heap)
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe {
        main_under_launcher(
            "lasp2_forward",
            Options::parse(),
            config,
            |options, config| run(options, config).map(|()| true),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_parses_and_the_default_shape_is_timed() {
        let o = Options::try_parse_from(["lasp2_forward"]).unwrap();
        assert_eq!(o.graph_calls, 100);
        assert_eq!(o.shapes().len(), 1);
        let o = Options::try_parse_from([
            "lasp2_forward",
            "--graph-calls",
            "10000",
            "--time",
            "4x8192x16x128",
            "--time",
            "1x32768x16x64",
            "--no-check",
            "--json",
            "out.json",
            "--groups",
            "3",
            "--ctas-per-sm",
            "2",
            "--timeline",
            "tl",
        ])
        .unwrap();
        assert_eq!(o.graph_calls, 10000);
        assert_eq!(
            o.shapes().iter().map(|s| s.t).collect::<Vec<_>>(),
            [8192, 32768]
        );
        assert!(o.skip_check && o.json.is_some());
        assert_eq!((o.head_groups, o.ctas_per_sm), (Some(3), Some(2)));
        let o =
            Options::try_parse_from(["lasp2_forward", "--no-time", "--silent-rank", "1"]).unwrap();
        assert!(o.shapes().is_empty());
        assert_eq!((o.silent_rank, o.mismatch_rank), (Some(1), None));
        assert!(Options::try_parse_from(["lasp2_forward", "--mismatch-rank", "1"]).is_ok());
        assert!(Options::try_parse_from(["lasp2_forward", "--time", "4x8192"]).is_err());
        assert!(Options::try_parse_from(["lasp2_forward", "--bogus"]).is_err());
    }

    #[test]
    fn rows_have_the_field_names_the_report_reads() {
        let row = Row {
            w: 2,
            b: 4,
            t_local: 8192,
            h: 16,
            d: 128,
            head_groups: 1,
            ctas_per_sm: 2,
            modes: ModeTimes::from_per_rank([
                vec![1.0, 1.5],
                vec![2.0, 2.0],
                vec![2.5, 2.0],
                vec![0.5, 0.75],
            ]),
            planner: Some(PlannerTimes {
                planner_ms: 1.25,
                planner_choice: "overlapped, 2 head group(s), 2 CTA/SM".into(),
                planner_measured_ms: vec![("overlapped, 1 head group(s), 2 CTA/SM".into(), 1.5)],
            }),
            max_output_wait_us: None,
            link: "nvlink".into(),
            nccl_baseline: "window",
        };
        let json: serde_json::Value =
            serde_json::from_str(&lasp_shmem_examples::to_json(&vec![row])).unwrap();
        let r = &json[0];
        for (key, value) in [
            ("W", 2.0),
            ("B", 4.0),
            ("T_local", 8192.0),
            ("H", 16.0),
            ("D", 128.0),
            ("head_groups", 1.0),
            ("ctas_per_sm", 2.0),
            ("overlapped_ms", 1.5),
            ("sequential_nccl_ms", 2.0),
            ("sequential_nvshmem_ms", 2.5),
            ("no_comm_ms", 0.75),
            ("planner_ms", 1.25),
        ] {
            assert_eq!(r[key].as_f64(), Some(value), "{key}");
        }
        assert_eq!(r["planner_choice"], "overlapped, 2 head group(s), 2 CTA/SM");
        assert_eq!(r["planner_measured_ms"][0][1], 1.5);
        assert_eq!(r["per_rank_ms"]["overlapped"][1], 1.5);
        assert!(r.get("max_output_wait_us").is_none());
        assert_eq!(r["link"], "nvlink");
    }
}
