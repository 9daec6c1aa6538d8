//! LASP-2 backward of scalar-decay linear attention on every launched GPU, checked.
//!
//! ```text
//! lasp-run -n 2 target/release/lasp2_backward                      # checks, then times every mode
//! lasp-run -n 2 target/release/lasp2_backward --graph-calls 10000  # + a long graph replay
//! ```
//!
//! Each rank holds one slice of every sequence (the last rank's slice is shorter). Per case
//! (shards of several segments for each (Dk, Dv) in (64, 64), (128, 128), (64, 128); shards of
//! one segment at (128, 64)) the program runs the LASP-2 forward, saving each shard's start state, then the LASP-2
//! backward from it, and checks against the CPU f64 reference (`reference::lasp2`): the start
//! state, every rank's dq, dk, dv, dg (rel err <= 5e-3) and PE 0's dh0. Gradients are poisoned before every call. Every
//! exchange mode must give bitwise the same gradients, twice each, and a captured CUDA graph
//! replayed `--graph-calls` times must give them too. Then it times every mode of the backward
//! at each `--time BxTxHxD` (per-rank shard length T, repeatable; default 4x8192x16x128), as
//! JSON rows into `--json FILE` when given (benches/lasp2-backward-bench.sh runs it at W = 1, 2,
//! 4). Fault drill: `--silent-rank K` (rank K never calls the backward: every earlier rank, which
//! waits for its tile, must fail naming it).
//! `--plan`: at each timed shape the planner (`exchange::planner`) chooses a mode first, and its
//! choice is timed in turns with the modes (`planner_ms`, `planner_choice`).
//! `--no-check`: only the timed calls (for a profiler, which then sees no checking launches
//! before them); the checks are what make the times mean anything, so run them once per build.

use clap::Parser;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::scalar_decay::lasp2::{
    ExchangeMode, Lasp2Backward, Lasp2Forward, Lasp2Layout,
};
use lasp_shmem::ops::scalar_decay::BackwardArgs;
use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardShape};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::lasp2::{self, Decay};
use lasp_shmem::reference::{
    rel_err, Cotangents, Family, InputSpec, Inputs, Regime, Shape, Tensor,
};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::{
    bf16_bits, bf16_values, config_with_heap, f32_bits, f32_values, main_under_launcher, mode_of,
    parse_shape, planner_choice, shard_lengths, time_modes_and_plan, write_json, ModeCall, ModeRow,
    PlannerTimes,
};
use std::path::PathBuf;
use std::sync::Arc;

/// Tolerance of dq, dk, dv, dh0 and the start state against the f64 reference (bf16 inputs and
/// bf16 gradients, as the single-GPU backward tests), and of dg against its scale.
const TOL: f64 = 5e-3;
const POISON_BF16: u16 = 0xFFFF;

/// LASP-2 backward of scalar-decay linear attention on every launched GPU: checks against the
/// f64 reference, then times every exchange mode.
#[derive(Parser, Debug)]
#[command(name = "lasp2_backward")]
struct Options {
    /// Graph replays of one captured call in the checks.
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
    /// Fault drill: rank K never calls the backward; every earlier rank must fail naming it.
    #[arg(long, value_name = "K")]
    silent_rank: Option<usize>,
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

fn state_err(e: impl std::fmt::Display) -> Error {
    Error::State(e.to_string())
}

/// This rank's tensors on the device: the forward's inputs and outputs (with the start state it
/// saves), the output gradients, and the gradients.
struct Shard {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    h0: Option<CudaSlice<f32>>,
    o: CudaSlice<bf16>,
    start: CudaSlice<f32>,
    d_o: CudaSlice<bf16>,
    d_ht: Option<CudaSlice<f32>>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dh0: Option<CudaSlice<f32>>,
}

/// The gradients' bits after a call (dh0 empty off PE 0).
#[derive(Clone, PartialEq)]
struct GradBits {
    dq: Vec<u16>,
    dk: Vec<u16>,
    dv: Vec<u16>,
    dg: Vec<u32>,
    dh0: Vec<u32>,
}

impl Shard {
    /// Tokens `[start, start + len)` of `inputs` and `cot`; `h0` and `dh0` on every rank and PE 0
    /// respectively, `d_ht` on the last rank.
    fn upload(
        stream: &Arc<CudaStream>,
        inputs: &Inputs,
        cot: &Cotangents,
        (start, len): (usize, usize),
        (first, last): (bool, bool),
    ) -> Result<Self> {
        let shape = ForwardShape {
            t: len,
            ..ForwardShape::from(inputs.shape)
        };
        let bf = |t: &Tensor| -> Vec<bf16> {
            t.slice_time(start, len)
                .data()
                .iter()
                .map(|&x| bf16::from_f64(x))
                .collect()
        };
        let f32s = |t: &Tensor| -> Vec<f32> { t.data().iter().map(|&x| x as f32).collect() };
        Ok(Shard {
            shape,
            q: stream.clone_htod(&bf(&inputs.q))?,
            k: stream.clone_htod(&bf(&inputs.k))?,
            v: stream.clone_htod(&bf(&inputs.v))?,
            g: stream.clone_htod(&f32s(&inputs.g.slice_time(start, len)))?,
            h0: inputs
                .h0
                .as_ref()
                .map(|h0| stream.clone_htod(&f32s(h0)))
                .transpose()?,
            o: stream.alloc_zeros(shape.v_len())?,
            start: stream.alloc_zeros(shape.state_len())?,
            d_o: stream.clone_htod(&bf(&cot.d_o))?,
            d_ht: match (&cot.d_ht, last) {
                (Some(d), true) => Some(stream.clone_htod(&f32s(d))?),
                _ => None,
            },
            dq: stream.alloc_zeros(shape.qk_len())?,
            dk: stream.alloc_zeros(shape.qk_len())?,
            dv: stream.alloc_zeros(shape.v_len())?,
            dg: stream.alloc_zeros(shape.gate_len())?,
            dh0: if first {
                Some(stream.alloc_zeros(shape.state_len())?)
            } else {
                None
            },
        })
    }

    /// Benchmark tensors of `shape`: a random block repeated over each tensor (timing does not
    /// depend on the values; gates are log-sigmoids of normals / 16 as in fla's benchmark).
    fn benchmark(
        stream: &Arc<CudaStream>,
        shape: ForwardShape,
        (first, last): (bool, bool),
    ) -> Result<Self> {
        let block_shape = Shape {
            b: 1,
            t: 64,
            h: 1,
            dk: shape.dk,
            dv: shape.dv,
        };
        let spec = InputSpec {
            shape: block_shape,
            family: Family::ScalarDecay,
            regime: Regime::Typical,
            seed: 11,
            round_to_bf16: true,
            initial_state: true,
        };
        let block = Inputs::generate(&spec).map_err(state_err)?;
        let cot = Cotangents::generate(block_shape, 11, true, true).map_err(state_err)?;
        fn cycle(t: &Tensor, n: usize) -> impl Iterator<Item = f64> + '_ {
            t.data().iter().copied().cycle().take(n)
        }
        let bf = |t: &Tensor, n: usize| -> Result<CudaSlice<bf16>> {
            Ok(stream.clone_htod(&cycle(t, n).map(bf16::from_f64).collect::<Vec<_>>())?)
        };
        let f32s = |t: &Tensor, n: usize| -> Result<CudaSlice<f32>> {
            Ok(stream.clone_htod(&cycle(t, n).map(|x| x as f32).collect::<Vec<_>>())?)
        };
        let h0 = block.h0.as_ref().expect("generated with a state");
        let d_ht = cot
            .d_ht
            .as_ref()
            .expect("generated with a final-state gradient");
        Ok(Shard {
            shape,
            q: bf(&block.q, shape.qk_len())?,
            k: bf(&block.k, shape.qk_len())?,
            v: bf(&block.v, shape.v_len())?,
            g: f32s(&block.g, shape.gate_len())?,
            h0: Some(f32s(h0, shape.state_len())?),
            o: stream.alloc_zeros(shape.v_len())?,
            start: stream.alloc_zeros(shape.state_len())?,
            d_o: bf(&cot.d_o, shape.v_len())?,
            d_ht: if last {
                Some(f32s(d_ht, shape.state_len())?)
            } else {
                None
            },
            dq: stream.alloc_zeros(shape.qk_len())?,
            dk: stream.alloc_zeros(shape.qk_len())?,
            dv: stream.alloc_zeros(shape.v_len())?,
            dg: stream.alloc_zeros(shape.gate_len())?,
            dh0: if first {
                Some(stream.alloc_zeros(shape.state_len())?)
            } else {
                None
            },
        })
    }

    /// The LASP-2 forward, saving the shard's start state.
    fn forward(&mut self, op: &mut Lasp2Forward, stream: &Arc<CudaStream>) -> Result<()> {
        let args = ForwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: self.h0.as_ref().map(DeviceRef::new),
            o: DeviceMut::new(&mut self.o),
            ht: None,
            scale: None,
        };
        op.forward_saving(stream, args, Some(DeviceMut::new(&mut self.start)))
    }

    /// The LASP-2 backward from the saved start state.
    fn backward(&mut self, op: &mut Lasp2Backward, stream: &Arc<CudaStream>) -> Result<()> {
        let args = BackwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: Some(DeviceRef::new(&self.start)),
            d_o: DeviceRef::new(&self.d_o),
            d_ht: self.d_ht.as_ref().map(DeviceRef::new),
            dq: DeviceMut::new(&mut self.dq),
            dk: DeviceMut::new(&mut self.dk),
            dv: DeviceMut::new(&mut self.dv),
            dg: DeviceMut::new(&mut self.dg),
            dh0: self.dh0.as_mut().map(DeviceMut::new),
            scale: None,
        };
        op.backward(stream, args)
    }

    /// Fills the gradients with NaN, so anything a call does not write shows.
    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        for t in [&mut self.dq, &mut self.dk, &mut self.dv] {
            stream.memcpy_htod(&vec![bf16::from_bits(POISON_BF16); t.len()], t)?;
        }
        stream.memcpy_htod(&vec![f32::NAN; self.dg.len()], &mut self.dg)?;
        if let Some(dh0) = &mut self.dh0 {
            stream.memcpy_htod(&vec![f32::NAN; dh0.len()], dh0)?;
        }
        Ok(())
    }

    /// The gradients' bits; an error if any poison is left.
    fn grads(&self, stream: &Arc<CudaStream>) -> Result<GradBits> {
        let bf = |t: &CudaSlice<bf16>| bf16_bits(stream, t);
        let f = |t: &CudaSlice<f32>| f32_bits(stream, Some(t));
        let bits = GradBits {
            dq: bf(&self.dq)?,
            dk: bf(&self.dk)?,
            dv: bf(&self.dv)?,
            dg: f(&self.dg)?,
            dh0: self.dh0.as_ref().map(f).transpose()?.unwrap_or_default(),
        };
        let nan16 = |v: &[u16]| v.iter().any(|&b| bf16::from_bits(b).is_nan());
        let nan32 = |v: &[u32]| v.iter().any(|&b| f32::from_bits(b).is_nan());
        if nan16(&bits.dq) || nan16(&bits.dk) || nan16(&bits.dv) || nan32(&bits.dg) {
            return Err(Error::State(
                "a gradient element was not written (NaN poison left)".into(),
            ));
        }
        if nan32(&bits.dh0) {
            return Err(Error::State("dh0 was not written (NaN poison left)".into()));
        }
        Ok(bits)
    }

    /// One poisoned backward call, finished; its gradients' bits.
    fn run_checked(
        &mut self,
        op: &mut Lasp2Backward,
        stream: &Arc<CudaStream>,
    ) -> Result<GradBits> {
        self.poison(stream)?;
        self.backward(op, stream)?;
        op.finish(stream)?;
        self.grads(stream)
    }
}

/// `rel err <= TOL` or an error naming `what`.
fn close(what: &str, got: &[f64], want: &Tensor) -> Result<f64> {
    let e = rel_err(got, want.data());
    if e.is_nan() || e > TOL {
        return Err(Error::State(format!("{what}: rel err {e:.3e} > {TOL:.0e}")));
    }
    Ok(e)
}

fn check(rt: &Runtime, graph_calls: u32) -> Result<()> {
    let (me, npes) = (rt.pe(), rt.npes());
    let stream = rt.context().new_stream()?;
    // Ragged shards: 3 chunks and a bit per rank, the last rank 37 tokens shorter (several
    // segments per shard); then shards of less than a chunk (one segment: the reversed passes
    // start from the carry alone).
    for (per_rank, dk, dv) in [
        (3 * 64 + 11, 64, 64),
        (3 * 64 + 11, 128, 128),
        (3 * 64 + 11, 64, 128),
        (50, 128, 64),
    ] {
        let lengths = shard_lengths(npes, per_rank, 37);
        let start: usize = lengths[..me].iter().sum();
        let total: usize = lengths.iter().sum();
        let shape = Shape {
            b: 2,
            t: total,
            h: 3,
            dk,
            dv,
        };
        let spec = InputSpec {
            shape,
            family: Family::ScalarDecay,
            regime: Regime::Mixed,
            seed: 17 + dk as u64 + dv as u64,
            round_to_bf16: true,
            initial_state: true,
        };
        let inputs = Inputs::generate(&spec).map_err(state_err)?;
        let cot = Cotangents::generate(shape, spec.seed, true, true).map_err(state_err)?;
        let forward_ref =
            lasp2::forward(&inputs, Decay::Scalar, &lengths, 64).map_err(state_err)?;
        let want = lasp2::backward(
            &inputs,
            Decay::Scalar,
            &lengths,
            64,
            &cot.d_o,
            cot.d_ht.as_ref(),
        )
        .map_err(state_err)?;
        let mine = &want.ranks[me];
        let mut shard = Shard::upload(
            &stream,
            &inputs,
            &cot,
            (start, lengths[me]),
            (me == 0, me + 1 == npes),
        )?;
        let layout = Lasp2Layout { b: 2, h: 3, dk, dv };
        let mut fwd = Lasp2Forward::new(rt, layout, ExchangeMode::Overlapped)?;
        let mut bwd = Lasp2Backward::new(rt, layout, ExchangeMode::Overlapped)?;
        let tag = format!("PE {me} (Dk={dk}, Dv={dv})");

        stream.memcpy_htod(&vec![f32::NAN; shard.start.len()], &mut shard.start)?;
        shard.forward(&mut fwd, &stream)?;
        fwd.finish(&stream)?;
        let start_state: Vec<f64> = stream
            .clone_dtoh(&shard.start)?
            .iter()
            .map(|&x| x as f64)
            .collect();
        let e_start = close(
            &format!("{tag} start state"),
            &start_state,
            &forward_ref.prefixes[me],
        )?;

        let bits = shard.run_checked(&mut bwd, &stream)?;
        let mut report = vec![format!("start state {e_start:.2e}")];
        for (what, got, want) in [
            ("dq", bf16_values(&bits.dq), &mine.dq),
            ("dk", bf16_values(&bits.dk), &mine.dk),
            ("dv", bf16_values(&bits.dv), &mine.dv),
            ("dg", f32_values(&bits.dg), &mine.dg),
        ] {
            let e = close(&format!("{tag} {what}"), &got, want)?;
            report.push(format!("{what} {e:.2e}"));
        }
        if me == 0 {
            let e = close(
                &format!("{tag} dh0"),
                &f32_values(&bits.dh0),
                &want.grads.dh0,
            )?;
            report.push(format!("dh0 {e:.2e}"));
        }
        println!(
            "{tag}, shard {} of {total} tokens: matches the f64 reference (rel err {})",
            lengths[me],
            report.join(", ")
        );

        for mode in [
            ExchangeMode::SequentialNccl,
            ExchangeMode::SequentialNvshmem,
            ExchangeMode::PipelinedChain,
            ExchangeMode::Overlapped,
        ] {
            bwd.set_mode(mode)?;
            for _ in 0..2 {
                if shard.run_checked(&mut bwd, &stream)? != bits {
                    return Err(Error::State(format!(
                        "{tag}: {mode:?} gave other gradient bits than the first overlapped call"
                    )));
                }
            }
        }
        println!("{tag}: overlapped, pipelined chain, sequential NCCL and sequential NVSHMEM give bitwise the same gradients, twice each");

        // A captured graph of one overlapped backward call, replayed: epochs advance on the device.
        shard.poison(&stream)?;
        let before = bwd.epoch(&stream)?;
        rt.barrier_on_stream(&stream)?;
        stream.synchronize()?;
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = shard.backward(&mut bwd, &stream);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
        captured?;
        let graph = graph.ok_or_else(|| Error::State("the capture recorded nothing".into()))?;
        for _ in 0..graph_calls {
            graph.launch()?;
        }
        bwd.note_replayed_calls(graph_calls as u64);
        bwd.finish(&stream)?;
        let after = bwd.epoch(&stream)?;
        let replayed = shard.grads(&stream)?;
        if after != before + graph_calls as u64 || replayed != bits {
            return Err(Error::State(format!(
                "{tag}: graph replay: epoch {before} -> {after} for {graph_calls} replays, \
                 gradients {}",
                if replayed == bits {
                    "identical"
                } else {
                    "DIFFER"
                }
            )));
        }
        println!("{tag}: {graph_calls} graph-replayed calls, no error, gradients bitwise identical at the end");
        drop(graph);
        bwd.free()?;
        fwd.free()?;
    }
    Ok(())
}

/// The backward of one shard, as the timing loop drives it, with the planner's choice of mode
/// where it ran.
struct Timed<'a> {
    op: &'a mut Lasp2Backward,
    shard: &'a mut Shard,
    planned: Option<ExchangeMode>,
}

impl ModeCall for Timed<'_> {
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
        self.shard.backward(self.op, stream)
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }
}

/// Times every mode of the backward at `shape`; returns its row (PE 0 prints it).
fn time_modes(
    rt: &Runtime,
    comm: &lasp_shmem::nccl::NcclComm,
    shape: ForwardShape,
    plan: bool,
) -> Result<ModeRow> {
    let stream = rt.stream().clone();
    let (me, npes) = (rt.pe(), rt.npes());
    let mut shard = Shard::benchmark(&stream, shape, (me == 0, me + 1 == npes))?;
    let layout = Lasp2Layout {
        b: shape.b,
        h: shape.h,
        dk: shape.dk,
        dv: shape.dv,
    };
    let mut fwd = Lasp2Forward::new(rt, layout, ExchangeMode::Overlapped)?;
    shard.forward(&mut fwd, &stream)?;
    fwd.finish(&stream)?;
    let mut bwd = Lasp2Backward::new(rt, layout, ExchangeMode::Overlapped)?;
    let plan = if plan {
        Some(bwd.plan(&stream, shape.t, |op, stream| shard.backward(op, stream))?)
    } else {
        None
    };
    let mut timed = Timed {
        op: &mut bwd,
        shard: &mut shard,
        planned: plan.as_ref().map(|p| p.chosen.mode),
    };
    let (modes, planner) = time_modes_and_plan(rt, comm, &mut timed, plan.as_ref(), mode_of)?;
    let (b, t, h, d) = (shape.b, shape.t, shape.h, shape.dk);
    if me == 0 {
        println!(
            "backward W={npes} B={b} T_local={t} H={h} D={d}:{}{}",
            modes.line(),
            planner.as_ref().map_or(String::new(), PlannerTimes::line)
        );
    }
    bwd.free()?;
    fwd.free()?;
    Ok(ModeRow {
        planner,
        ..ModeRow::new(rt, shape, modes)
    })
}

/// Rank `silent` never calls the backward; the others call it once and report what `finish` says.
fn drill(rt: &Runtime, silent: usize) -> Result<()> {
    let stream = rt.stream().clone();
    let (me, npes) = (rt.pe(), rt.npes());
    let shape = ForwardShape {
        b: 1,
        t: 256,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let layout = Lasp2Layout {
        b: 1,
        h: 2,
        dk: 64,
        dv: 64,
    };
    let mut shard = Shard::benchmark(&stream, shape, (me == 0, me + 1 == npes))?;
    let mut bwd = Lasp2Backward::new(rt, layout, ExchangeMode::Overlapped)?;
    if me == silent {
        println!("rank {me} stays silent (fault drill)");
        std::thread::sleep(rt.wait_timeout() + std::time::Duration::from_secs(10));
        return Err(Error::State(
            "the fault drill expected the earlier ranks to fail first".into(),
        ));
    }
    let result = shard
        .backward(&mut bwd, &stream)
        .and_then(|()| bwd.finish(&stream));
    if let Err(e) = &result {
        // Every rank before the silent one times out at about the same moment; the launcher stops
        // the others once the first exits, so each prints what it names before lingering.
        println!("rank {me} drill error: {e}");
        std::thread::sleep(std::time::Duration::from_secs(3));
    }
    result
}

fn run(options: Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
    if let Some(silent) = options.silent_rank {
        return drill(&rt, silent).and_then(|()| rt.shutdown());
    }
    if !options.skip_check {
        check(&rt, options.graph_calls)?;
    }
    let shapes = options.shapes();
    if !shapes.is_empty() {
        let comm = lasp_shmem::nccl::NcclComm::new(&rt, rt.stream())?;
        let rows = shapes
            .iter()
            .map(|&shape| time_modes(&rt, &comm, shape, options.plan))
            .collect::<Result<Vec<_>>>()?;
        if let (Some(path), 0) = (&options.json, rt.pe()) {
            write_json(path, &rows)?;
        }
    }
    rt.shutdown()
}

/// The runtime's settings for `options`: a forward and a backward live at once, each with its
/// own symmetric buffers, for the largest timed layout.
fn config(options: &Options, npes: usize) -> Result<Config> {
    let heap = options
        .shapes()
        .iter()
        .map(|s| {
            2 * Lasp2Layout {
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
            "lasp2_backward",
            Options::parse(),
            config,
            |options, config| run(options, config).map(|()| true),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lasp_shmem_examples::ModeTimes;

    #[test]
    fn every_flag_parses() {
        let o = Options::try_parse_from(["lasp2_backward"]).unwrap();
        assert_eq!((o.graph_calls, o.shapes().len()), (100, 1));
        let o = Options::try_parse_from([
            "lasp2_backward",
            "--graph-calls",
            "1000",
            "--no-time",
            "--no-check",
            "--json",
            "x.json",
            "--silent-rank",
            "1",
        ])
        .unwrap();
        assert_eq!(o.graph_calls, 1000);
        assert!(o.shapes().is_empty() && o.skip_check);
        assert_eq!(o.silent_rank, Some(1));
        let o = Options::try_parse_from(["lasp2_backward", "--time", "2x4096x8x64"]).unwrap();
        assert_eq!(o.shapes()[0].dk, 64);
        assert!(Options::try_parse_from(["lasp2_backward", "--graph-calls", "x"]).is_err());
    }

    #[test]
    fn rows_have_the_field_names_the_report_reads() {
        let row = ModeRow {
            w: 4,
            b: 1,
            t_local: 4096,
            h: 8,
            d: 64,
            modes: ModeTimes::from_per_rank([vec![1.0], vec![2.0], vec![3.0], vec![0.5]]),
            planner: None,
            link: "nvlink".into(),
            nccl_baseline: "window",
        };
        let json: serde_json::Value =
            serde_json::from_str(&lasp_shmem_examples::to_json(&vec![row])).unwrap();
        let keys: Vec<&str> = json[0]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        for key in [
            "W",
            "B",
            "T_local",
            "H",
            "D",
            "overlapped_ms",
            "sequential_nccl_ms",
            "sequential_nvshmem_ms",
            "no_comm_ms",
            "per_rank_ms",
            "link",
            "nccl_baseline",
        ] {
            assert!(keys.contains(&key), "{key} not in {keys:?}");
        }
        assert_eq!(json[0]["sequential_nvshmem_ms"], 3.0);
        assert!(
            !keys.contains(&"planner_ms"),
            "no planner field where it did not run"
        );
    }
}
