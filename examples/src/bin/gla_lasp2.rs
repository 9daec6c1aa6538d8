//! GLA's LASP-2 forward and backward (`ops::gla::GlaLasp2Forward`, `GlaLasp2Backward`) on every
//! GPU under `lasp-run`.
//!
//! ```text
//! lasp-run -n 2 gla_lasp2                            # the checks
//! lasp-run -n 4 gla_lasp2 --no-check --time 4x8192x16x128 --time 8x2048x16x128 --json out.json
//! lasp-run -n 2 gla_lasp2 --no-check --time 4x8192x16x128 --with-backward --json fb.json
//! ```
//!
//! Checks (every PE): the whole sequence's inputs from the f64 reference's generator (GLA gates,
//! q, k, v rounded to bf16), cut into shards of unequal length; this PE's outputs against the
//! reference's recurrent forward of the whole sequence (relative error <= 5e-3; the final state on
//! the last PE), in every exchange mode, each mode's outputs bitwise equal to the overlapped
//! mode's, and a repeated call bitwise equal; outputs poisoned before each call. Then the backward
//! from the forward's chunk states, with a random do (and dht on the last PE): dq, dk, dv (and
//! dh0 on PE 0) against the reference's chunkwise backward of the whole sequence (relative error
//! <= 5e-3), dg within 5e-3 of the sequence's gate-gradient scale, every mode and a repeat
//! bitwise equal. One line per
//! case and PE; exit status 1 when any check failed. Timing (`--time BxTxHxD`, T per GPU): the
//! modes in turns (`time_in_turns`), the row is the slowest rank's median; with
//! `--with-backward` a timed call is a training step's: the forward saving its chunk states, then
//! the backward from a random do.
//! `--plan` (the forward alone): the planner (`exchange::planner`) chooses the mode first, and its
//! choice is timed in turns with the modes (`planner_ms`, `planner_choice`).

use clap::Parser;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::{ExchangeMode, Lasp2Layout};
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::gla::{
    chunk_states_len, Gla, GlaArgs, GlaBackwardArgs, GlaLasp2Backward, GlaLasp2Forward,
};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::{
    assert_close_to_scale, gla, rel_err, Cotangents, Family, InputSpec, Inputs,
};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::grad_bits::{GradBits, GradBuffers};
use lasp_shmem_examples::mode_bits::bits_in_every_mode;
use lasp_shmem_examples::{
    bf16_bits, bf16_values, bf16s, f32_bits, f32_values, f32s, lasp2_config, main_under_launcher,
    mode_of, mode_times, parse_shape, planner_choice, round, run_cases, shard_cases, shard_rows,
    time_in_turns, time_modes_and_plan, time_shapes, ModeCall, ModeRow, PlannerTimes, ShardCase,
};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(name = "gla_lasp2")]
struct Options {
    /// Time these per-GPU shapes (BxTxHxD, T per GPU) in every mode.
    #[arg(long = "time", value_name = "BxTxHxD", value_parser = parse_shape)]
    time: Vec<ForwardShape>,
    /// Skip the checks.
    #[arg(long)]
    no_check: bool,
    /// Write the timing rows here (rank 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Time the forward and the backward together.
    #[arg(long)]
    with_backward: bool,
    /// Run the planner at each timed shape and time its choice in turns with the modes
    /// (`planner_ms`, `planner_choice` in the row; the forward alone).
    #[arg(long, conflicts_with = "with_backward")]
    plan: bool,
}

const TOL: f64 = 5e-3;
const POISON: u16 = 0xFFFF;

/// The (Dk, Dv) pairs the checks cover.
const WIDTHS: [(usize, usize); 4] = [(128, 128), (64, 64), (64, 128), (128, 64)];

/// One PE's shard on the device.
struct Shard {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    h0: Option<CudaSlice<f32>>,
    o: CudaSlice<bf16>,
    ht: Option<CudaSlice<f32>>,
    /// Saved by the forward where a backward follows.
    chunk_states: Option<CudaSlice<bf16>>,
}

/// One PE's backward tensors: do, dht (the last PE), the gradients (dh0 on PE 0).
struct ShardGrads {
    d_o: CudaSlice<bf16>,
    dht: Option<CudaSlice<f32>>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dh0: Option<CudaSlice<f32>>,
}

impl Shard {
    /// One backward call on poisoned gradients; their bits.
    fn backward(
        &mut self,
        grads: &mut ShardGrads,
        op: &mut GlaLasp2Backward,
        stream: &Arc<CudaStream>,
    ) -> Result<GradBits> {
        for x in [&mut grads.dq, &mut grads.dk, &mut grads.dv] {
            stream.memcpy_htod(&vec![bf16::from_bits(POISON); x.len()], x)?;
        }
        for x in [Some(&mut grads.dg), grads.dh0.as_mut()]
            .into_iter()
            .flatten()
        {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); x.len()], x)?;
        }
        let states = self
            .chunk_states
            .as_ref()
            .expect("the checks' shards save their chunk states");
        op.backward(
            stream,
            GlaBackwardArgs {
                shape: self.shape,
                q: DeviceRef::new(&self.q),
                k: DeviceRef::new(&self.k),
                v: DeviceRef::new(&self.v),
                g: DeviceRef::new(&self.g),
                h0: self.h0.as_ref().map(DeviceRef::new),
                chunk_states: DeviceRef::new(states),
                d_o: DeviceRef::new(&grads.d_o),
                dht: grads.dht.as_ref().map(DeviceRef::new),
                dq: DeviceMut::new(&mut grads.dq),
                dk: DeviceMut::new(&mut grads.dk),
                dv: DeviceMut::new(&mut grads.dv),
                dg: DeviceMut::new(&mut grads.dg),
                dh0: grads.dh0.as_mut().map(DeviceMut::new),
                scale: None,
                documents: None,
            },
        )?;
        op.finish(stream)?;
        let grads = GradBuffers {
            dq: &grads.dq,
            dk: &grads.dk,
            dv: &grads.dv,
            dg: &grads.dg,
            dbeta: None,
            dh0: grads.dh0.as_ref(),
        };
        GradBits::read(stream, grads)
    }

    fn args(&mut self) -> GlaArgs<'_> {
        GlaArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: self.h0.as_ref().map(DeviceRef::new),
            o: DeviceMut::new(&mut self.o),
            ht: self.ht.as_mut().map(DeviceMut::new),
            chunk_states: self.chunk_states.as_mut().map(DeviceMut::new),
            scale: None,
            documents: None,
            document_ht: None,
        }
    }

    /// One call on poisoned outputs; the bits of o and ht.
    fn call(
        &mut self,
        op: &mut GlaLasp2Forward,
        stream: &Arc<CudaStream>,
    ) -> Result<(Vec<u16>, Vec<u32>)> {
        stream.memcpy_htod(&vec![bf16::from_bits(POISON); self.o.len()], &mut self.o)?;
        if let Some(ht) = self.ht.as_mut() {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); ht.len()], ht)?;
        }
        op.forward(stream, self.args())?;
        op.finish(stream)?;
        Ok((
            bf16_bits(stream, &self.o)?,
            f32_bits(stream, self.ht.as_ref())?,
        ))
    }
}

fn check_case(
    rt: &Runtime,
    case: &ShardCase,
    seed: u64,
) -> Result<std::result::Result<String, String>> {
    let (me, npes) = (rt.pe(), rt.npes());
    let inputs = Inputs::generate(&InputSpec {
        shape: case.shape(),
        family: Family::Gla,
        regime: case.regime,
        seed,
        round_to_bf16: true,
        initial_state: case.h0,
    })
    .map_err(|e| Error::State(format!("input generation: {e}")))?;
    let want =
        gla::recurrent_forward(&inputs).map_err(|e| Error::State(format!("reference: {e}")))?;
    let start: usize = case.lengths[..me].iter().sum();
    let len = case.lengths[me];
    let last = me + 1 == npes;
    let stream = rt.stream().clone();
    let shape = ForwardShape {
        b: case.b,
        t: len,
        h: case.h,
        dk: case.dk,
        dv: case.dv,
    };
    let mut shard = Shard {
        shape,
        q: stream.clone_htod(&bf16s(&shard_rows(&inputs.q, start, len)))?,
        k: stream.clone_htod(&bf16s(&shard_rows(&inputs.k, start, len)))?,
        v: stream.clone_htod(&bf16s(&shard_rows(&inputs.v, start, len)))?,
        g: stream.clone_htod(&f32s(&shard_rows(&inputs.g, start, len)))?,
        h0: match &inputs.h0 {
            Some(h0) => Some(stream.clone_htod(&f32s(h0.data()))?),
            None => None,
        },
        o: stream.alloc_zeros(shape.v_len())?,
        ht: if last {
            Some(stream.alloc_zeros(shape.state_len())?)
        } else {
            None
        },
        chunk_states: Some(stream.alloc_zeros(chunk_states_len(&shape))?),
    };
    let layout = Lasp2Layout {
        b: case.b,
        h: case.h,
        dk: case.dk,
        dv: case.dv,
    };
    let mut op = GlaLasp2Forward::new(rt, layout, ExchangeMode::Overlapped)?;
    let ((o, ht), mut problems) =
        bits_in_every_mode(&mut op, "forward", |op| shard.call(op, &stream))?;
    op.free()?;
    // The backward, from the chunk states the last forward call saved (every mode's are equal).
    let grad_check = check_backward(rt, case, seed, &inputs, &mut shard, start, len)?;
    let got = bf16_values(&o);
    let e_o = rel_err(&got, &shard_rows(&want.o, start, len));
    if e_o.is_nan() || e_o > TOL {
        problems.push(format!("o: rel err {e_o:.3e} > {TOL:.0e}"));
    }
    let mut detail = format!("rel err o {e_o:.2e}");
    if last {
        let got = f32_values(&ht);
        let e_ht = rel_err(&got, want.final_state.data());
        if e_ht.is_nan() || e_ht > TOL {
            problems.push(format!("ht: rel err {e_ht:.3e} > {TOL:.0e}"));
        }
        detail += &format!(" ht {e_ht:.2e}");
    }
    match grad_check {
        Ok(grads) => detail += &format!("; {grads}"),
        Err(e) => problems.push(e),
    }
    Ok(if problems.is_empty() {
        Ok(format!("{detail}, every mode bitwise equal"))
    } else {
        Err(format!("{detail}: {}", problems.join("; ")))
    })
}

/// The backward of this PE's shard in every mode against the reference's backward of the whole
/// sequence: the relative errors, or what failed.
fn check_backward(
    rt: &Runtime,
    case: &ShardCase,
    seed: u64,
    inputs: &Inputs,
    shard: &mut Shard,
    start: usize,
    len: usize,
) -> Result<std::result::Result<String, String>> {
    let (me, npes) = (rt.pe(), rt.npes());
    let stream = rt.stream().clone();
    let cot = Cotangents::generate(inputs.shape, seed, true, true)
        .map_err(|e| Error::State(format!("cotangent generation: {e}")))?;
    let want = gla::backward(inputs, 64, 16, &cot.d_o, cot.d_ht.as_ref())
        .map_err(|e| Error::State(format!("reference backward: {e}")))?;
    let shape = shard.shape;
    let mut grads = ShardGrads {
        d_o: stream.clone_htod(&bf16s(&shard_rows(&cot.d_o, start, len)))?,
        dht: match (&cot.d_ht, me + 1 == npes) {
            (Some(d), true) => Some(stream.clone_htod(&f32s(d.data()))?),
            _ => None,
        },
        dq: stream.alloc_zeros(shape.qk_len())?,
        dk: stream.alloc_zeros(shape.qk_len())?,
        dv: stream.alloc_zeros(shape.v_len())?,
        dg: stream.alloc_zeros(shape.qk_len())?,
        dh0: if me == 0 {
            Some(stream.alloc_zeros(shape.state_len())?)
        } else {
            None
        },
    };
    let layout = Lasp2Layout {
        b: case.b,
        h: case.h,
        dk: case.dk,
        dv: case.dv,
    };
    let mut op = GlaLasp2Backward::new(rt, layout, ExchangeMode::Overlapped)?;
    let (first, mut problems) = bits_in_every_mode(&mut op, "backward", |op| {
        shard.backward(&mut grads, op, &stream)
    })?;
    op.free()?;
    let mut errors = Vec::new();
    for (what, got, want) in [
        ("dq", bf16_values(&first.dq), &want.dq),
        ("dk", bf16_values(&first.dk), &want.dk),
        ("dv", bf16_values(&first.dv), &want.dv),
    ] {
        let e = rel_err(&got, &shard_rows(want, start, len));
        if e.is_nan() || e > TOL {
            problems.push(format!("{what}: rel err {e:.3e} > {TOL:.0e}"));
        }
        errors.push(format!("{what} {e:.2e}"));
    }
    let dg = f32_values(&first.dg);
    if let Err(e) = assert_close_to_scale(
        "dg",
        &dg,
        &shard_rows(&want.dg, start, len),
        want.gate_grad_scale(inputs),
        TOL,
    ) {
        problems.push(e);
    }
    if me == 0 {
        let got = f32_values(&first.dh0);
        let e = rel_err(&got, want.dh0.data());
        if e.is_nan() || e > TOL {
            problems.push(format!("dh0: rel err {e:.3e} > {TOL:.0e}"));
        }
        errors.push(format!("dh0 {e:.2e}"));
    }
    let detail = format!("grads rel err {}", errors.join(" "));
    Ok(if problems.is_empty() {
        Ok(detail)
    } else {
        Err(format!("{detail}: {}", problems.join("; ")))
    })
}

/// The operation over one random shard, as `time_in_turns` drives it.
struct Timed {
    op: GlaLasp2Forward,
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
        self.op.forward(stream, self.shard.args())
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }
}

/// A training step over one random shard (the forward saving its chunk states, then the
/// backward), as `time_in_turns` drives it.
struct TimedStep {
    forward: Timed,
    backward: GlaLasp2Backward,
    grads: ShardGrads,
}

impl ModeCall for TimedStep {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.forward.set_mode(mode)?;
        self.backward.set_mode(mode)
    }
    fn has_chain(&self) -> bool {
        self.forward.has_chain() && self.backward.supports(ExchangeMode::PipelinedChain)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.forward.call(stream)?;
        let shard = &mut self.forward.shard;
        let states = shard
            .chunk_states
            .as_ref()
            .expect("a timed step's shard saves its chunk states");
        let grads = &mut self.grads;
        self.backward.backward(
            stream,
            GlaBackwardArgs {
                shape: shard.shape,
                q: DeviceRef::new(&shard.q),
                k: DeviceRef::new(&shard.k),
                v: DeviceRef::new(&shard.v),
                g: DeviceRef::new(&shard.g),
                h0: None,
                chunk_states: DeviceRef::new(states),
                d_o: DeviceRef::new(&grads.d_o),
                dht: None,
                dq: DeviceMut::new(&mut grads.dq),
                dk: DeviceMut::new(&mut grads.dk),
                dv: DeviceMut::new(&mut grads.dv),
                dg: DeviceMut::new(&mut grads.dg),
                dh0: None,
                scale: None,
                documents: None,
            },
        )
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.forward.finish(stream)?;
        self.backward.finish(stream)
    }
}

fn time_shape(
    rt: &Runtime,
    comm: &NcclComm,
    shape: ForwardShape,
    with_backward: bool,
    plan: bool,
) -> Result<ModeRow> {
    let stream = rt.stream().clone();
    let normal = |len: usize, seed: u64| -> Vec<bf16> {
        let mut rng = lasp_shmem::reference::SplitMix64::new(seed ^ rt.pe() as u64);
        (0..len)
            .map(|_| bf16::from_f64(rng.next_u64() as f64 / u64::MAX as f64 * 2.0 - 1.0))
            .collect()
    };
    let mut rng = lasp_shmem::reference::SplitMix64::new(7 + rt.pe() as u64);
    let gates: Vec<f32> = (0..shape.qk_len())
        .map(|_| -((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32) / 8.0)
        .collect();
    let shard = Shard {
        shape,
        q: stream.clone_htod(&normal(shape.qk_len(), 1))?,
        k: stream.clone_htod(&normal(shape.qk_len(), 2))?,
        v: stream.clone_htod(&normal(shape.v_len(), 3))?,
        g: stream.clone_htod(&gates)?,
        h0: None,
        o: stream.alloc_zeros(shape.v_len())?,
        ht: None,
        chunk_states: if with_backward {
            Some(stream.alloc_zeros(chunk_states_len(&shape))?)
        } else {
            None
        },
    };
    let layout = shape.layout();
    let timed = Timed {
        op: GlaLasp2Forward::new(rt, layout, ExchangeMode::Overlapped)?,
        shard,
        planned: None,
    };
    let (modes, planner) = if with_backward {
        let mut step = TimedStep {
            forward: timed,
            backward: GlaLasp2Backward::new(rt, layout, ExchangeMode::Overlapped)?,
            grads: ShardGrads {
                d_o: stream.clone_htod(&normal(shape.v_len(), 4))?,
                dht: None,
                dq: stream.alloc_zeros(shape.qk_len())?,
                dk: stream.alloc_zeros(shape.qk_len())?,
                dv: stream.alloc_zeros(shape.v_len())?,
                dg: stream.alloc_zeros(shape.qk_len())?,
                dh0: None,
            },
        };
        let medians = time_in_turns(rt, &mut step)?;
        step.backward.free()?;
        step.forward.op.free()?;
        (mode_times(comm, medians)?, None)
    } else {
        let mut timed = timed;
        let plan = if plan {
            let Timed { op, shard, .. } = &mut timed;
            Some(op.plan(&stream, shape.t, |op, stream| {
                op.forward(stream, shard.args())
            })?)
        } else {
            None
        };
        timed.planned = plan.as_ref().map(|p| p.chosen.mode);
        let times = time_modes_and_plan(rt, comm, &mut timed, plan.as_ref(), mode_of)?;
        timed.op.free()?;
        times
    };
    let row = ModeRow {
        planner,
        ..ModeRow::new(rt, shape, modes)
    };
    if rt.pe() == 0 {
        println!(
            "W={} B={} T_local={} H={} D={}{}: overlapped {:.4} ms, sequential NCCL {:.4}, sequential NVSHMEM {:.4}, no-comm {:.4}{}",
            row.w,
            row.b,
            row.t_local,
            row.h,
            row.d,
            if with_backward { " forward+backward" } else { "" },
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
    let failed = if options.no_check {
        0
    } else {
        run_cases(&rt, &shard_cases(rt.npes(), &WIDTHS), 900, |case, seed| {
            check_case(&rt, case, seed)
        })?
    };
    time_shapes(
        &rt,
        &options.time,
        options.json.as_deref(),
        |comm, shape| time_shape(&rt, comm, shape, options.with_backward, options.plan),
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
    lasp2_config::<Gla>(&options.time, checks, npes)
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe { main_under_launcher("gla_lasp2", Options::parse(), config, run) }
}
