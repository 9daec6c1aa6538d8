//! Gated DeltaNet's LASP-2 forward (`ops::gated_delta::GatedDeltaLasp2Forward`) on every GPU
//! under `lasp-run`.
//!
//! ```text
//! lasp-run -n 2 gated_delta_lasp2                    # the checks
//! lasp-run -n 4 gated_delta_lasp2 --no-check --time 4x8192x16x128 --time 8x2048x16x128 --json out.json
//! ```
//!
//! Checks (every PE): the whole sequence's inputs from the f64 reference's generator (the delta
//! rule's unit-norm keys, gates and betas; q, k, v rounded to bf16), cut into shards of unequal
//! length; this PE's outputs against the reference's token-by-token recurrence of the whole
//! sequence (relative error <= 5e-3; the final state on the last PE), in every exchange mode, each
//! mode's outputs bitwise equal to the overlapped mode's, a repeated call bitwise equal, and a
//! captured CUDA graph of one overlapped call replayed `--graph-calls` times bitwise equal too;
//! outputs poisoned before each call. One line per case and PE; exit status 1 when any check
//! failed. Timing (`--time BxTxHxD`, T per GPU): the modes in turns (`time_in_turns`), the row is
//! the slowest rank's median, on the inputs `benches/gated_delta_cp_peer.py` gives fla's context
//! parallelism (drawn per rank: q, v ~ N(0, 1), k ~ N(0, 1) with unit rows, g = logsigmoid(N(0,
//! 1)) / 16, beta = sigmoid(N(0, 1))).

use clap::Parser;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::exchange::{ExchangeMode, Lasp2Layout};
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::gated_delta::{GatedDelta, GatedDeltaArgs, GatedDeltaLasp2Forward};
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::{delta_rule, rel_err, Family, InputSpec, Inputs, SplitMix64};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::{
    bf16_bits, bf16s, f32_bits, f32s, lasp2_config, main_under_launcher, mode_times, parse_shape,
    round, run_cases, shard_cases, shard_rows, time_in_turns, time_shapes, ModeCall, ModeRow,
    ShardCase,
};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(name = "gated_delta_lasp2")]
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
}

const TOL: f64 = 5e-3;
const POISON: u16 = 0xFFFF;

/// The (Dk, Dv) pairs the checks cover: Dv >= Dk (one column block of A per tile) and Dv < Dk
/// (one tile carrying both), and a Dv of three tiles.
const WIDTHS: [(usize, usize); 5] = [(128, 128), (64, 64), (64, 128), (128, 64), (128, 192)];

/// One PE's shard on the device.
struct Shard {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    beta: CudaSlice<f32>,
    h0: Option<CudaSlice<f32>>,
    o: CudaSlice<bf16>,
    ht: Option<CudaSlice<f32>>,
    scale: Option<f32>,
}

impl Shard {
    fn args(&mut self) -> GatedDeltaArgs<'_> {
        GatedDeltaArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            beta: DeviceRef::new(&self.beta),
            h0: self.h0.as_ref().map(DeviceRef::new),
            o: DeviceMut::new(&mut self.o),
            ht: self.ht.as_mut().map(DeviceMut::new),
            scale: self.scale,
        }
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memcpy_htod(&vec![bf16::from_bits(POISON); self.o.len()], &mut self.o)?;
        if let Some(ht) = self.ht.as_mut() {
            stream.memcpy_htod(&vec![f32::from_bits(u32::MAX); ht.len()], ht)?;
        }
        Ok(())
    }

    /// The bits of o and ht.
    fn bits(&self, stream: &Arc<CudaStream>) -> Result<(Vec<u16>, Vec<u32>)> {
        Ok((
            bf16_bits(stream, &self.o)?,
            f32_bits(stream, self.ht.as_ref())?,
        ))
    }

    /// One call on poisoned outputs; the bits of o and ht.
    fn call(
        &mut self,
        op: &mut GatedDeltaLasp2Forward,
        stream: &Arc<CudaStream>,
    ) -> Result<(Vec<u16>, Vec<u32>)> {
        self.poison(stream)?;
        op.forward(stream, self.args())?;
        op.finish(stream)?;
        self.bits(stream)
    }

    /// A captured graph of one overlapped call, replayed `calls` times on poisoned outputs: epochs
    /// advance on the device. Whether the last replay's bits equal `want`.
    fn replay(
        &mut self,
        op: &mut GatedDeltaLasp2Forward,
        rt: &Runtime,
        calls: u32,
        want: &(Vec<u16>, Vec<u32>),
    ) -> Result<std::result::Result<(), String>> {
        let stream = rt.stream().clone();
        op.set_mode(ExchangeMode::Overlapped)?;
        self.poison(&stream)?;
        let before = op.epoch(&stream)?;
        rt.barrier_on_stream(&stream)?;
        stream.synchronize()?;
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = op.forward(&stream, self.args());
        let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
        captured?;
        let graph = graph.ok_or_else(|| Error::State("the capture recorded nothing".into()))?;
        for _ in 0..calls {
            graph.launch()?;
        }
        op.note_replayed_calls(u64::from(calls));
        op.finish(&stream)?;
        let after = op.epoch(&stream)?;
        let bits = self.bits(&stream)?;
        Ok(if after != before + u64::from(calls) {
            Err(format!(
                "graph replay: epoch {before} -> {after} for {calls} replays"
            ))
        } else if &bits != want {
            Err(format!("{calls} graph replays gave other bits"))
        } else {
            Ok(())
        })
    }
}

fn check_case(
    rt: &Runtime,
    case: &ShardCase,
    seed: u64,
    graph_calls: u32,
) -> Result<std::result::Result<String, String>> {
    let (me, npes) = (rt.pe(), rt.npes());
    let inputs = Inputs::generate(&InputSpec {
        shape: case.shape(),
        family: Family::DeltaRule,
        regime: case.regime,
        seed,
        round_to_bf16: true,
        initial_state: case.h0,
    })
    .map_err(|e| Error::State(format!("input generation: {e}")))?;
    let want = delta_rule::recurrent_forward(&inputs)
        .map_err(|e| Error::State(format!("reference: {e}")))?;
    let beta = inputs
        .beta
        .as_ref()
        .ok_or_else(|| Error::State("the delta rule's inputs have no beta".into()))?;
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
        beta: stream.clone_htod(&f32s(&shard_rows(beta, start, len)))?,
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
        scale: Some(inputs.scale as f32),
    };
    let layout = shape.layout();
    let mut op = GatedDeltaLasp2Forward::new(rt, layout, ExchangeMode::Overlapped)?;
    let first = shard.call(&mut op, &stream)?;
    let mut problems = Vec::new();
    if shard.call(&mut op, &stream)? != first {
        problems.push("a repeated call gave other bits".to_string());
    }
    for mode in [
        ExchangeMode::SequentialNccl,
        ExchangeMode::SequentialNvshmem,
    ] {
        op.set_mode(mode)?;
        if shard.call(&mut op, &stream)? != first {
            problems.push(format!("{mode:?} differs from Overlapped"));
        }
    }
    problems.extend(shard.replay(&mut op, rt, graph_calls, &first)?.err());
    op.free()?;
    let (o, ht) = first;
    let got: Vec<f64> = o.iter().map(|&x| bf16::from_bits(x).to_f64()).collect();
    let e_o = rel_err(&got, &shard_rows(&want.o, start, len));
    if e_o.is_nan() || e_o > TOL {
        problems.push(format!("o: rel err {e_o:.3e} > {TOL:.0e}"));
    }
    let mut detail = format!("rel err o {e_o:.2e}");
    if last {
        let got: Vec<f64> = ht.iter().map(|&x| f64::from(f32::from_bits(x))).collect();
        let e_ht = rel_err(&got, want.final_state.data());
        if e_ht.is_nan() || e_ht > TOL {
            problems.push(format!("ht: rel err {e_ht:.3e} > {TOL:.0e}"));
        }
        detail += &format!(" ht {e_ht:.2e}");
    }
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
    op: GatedDeltaLasp2Forward,
    shard: Shard,
}

impl ModeCall for Timed {
    fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        self.op.set_mode(mode)
    }
    fn call(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.forward(stream, self.shard.args()).map(|_| ())
    }
    fn finish(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.op.finish(stream)
    }
}

/// `len` draws of N(0, 1) (Box-Muller from two uniforms in (0, 1]).
fn normals(rng: &mut SplitMix64, len: usize) -> Vec<f64> {
    let mut uniform = || ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    (0..len)
        .map(|_| (-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos())
        .collect()
}

fn time_shape(rt: &Runtime, comm: &NcclComm, shape: ForwardShape) -> Result<ModeRow> {
    let stream = rt.stream().clone();
    let mut rng = SplitMix64::new(7 + rt.pe() as u64);
    let unit_rows = |mut x: Vec<f64>| -> Vec<f64> {
        for row in x.chunks_mut(shape.dk) {
            let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            row.iter_mut().for_each(|v| *v /= norm);
        }
        x
    };
    let q = bf16s(&normals(&mut rng, shape.qk_len()));
    let k = bf16s(&unit_rows(normals(&mut rng, shape.qk_len())));
    let v = bf16s(&normals(&mut rng, shape.v_len()));
    // g = logsigmoid(x) / 16 = -ln(1 + e^-x) / 16, beta = sigmoid(x).
    let g: Vec<f32> = normals(&mut rng, shape.gate_len())
        .iter()
        .map(|x| (-(-x).exp().ln_1p() / 16.0) as f32)
        .collect();
    let beta: Vec<f32> = normals(&mut rng, shape.gate_len())
        .iter()
        .map(|x| (1.0 / (1.0 + (-x).exp())) as f32)
        .collect();
    let shard = Shard {
        shape,
        q: stream.clone_htod(&q)?,
        k: stream.clone_htod(&k)?,
        v: stream.clone_htod(&v)?,
        g: stream.clone_htod(&g)?,
        beta: stream.clone_htod(&beta)?,
        h0: None,
        o: stream.alloc_zeros(shape.v_len())?,
        ht: None,
        scale: None,
    };
    let mut timed = Timed {
        op: GatedDeltaLasp2Forward::new(rt, shape.layout(), ExchangeMode::Overlapped)?,
        shard,
    };
    let medians = time_in_turns(rt, &mut timed)?;
    timed.op.free()?;
    let row = ModeRow::new(rt.npes(), shape, mode_times(comm, medians)?);
    if rt.pe() == 0 {
        println!(
            "W={} B={} T_local={} H={} D={}: overlapped {:.4} ms, sequential NCCL {:.4}, sequential NVSHMEM {:.4}, no-comm {:.4}",
            row.w,
            row.b,
            row.t_local,
            row.h,
            row.d,
            round(row.modes.overlapped_ms, 4),
            round(row.modes.sequential_nccl_ms, 4),
            round(row.modes.sequential_nvshmem_ms, 4),
            round(row.modes.no_comm_ms, 4)
        );
    }
    Ok(row)
}

fn run(options: Options, config: Config) -> Result<bool> {
    let rt = Runtime::init(config)?;
    let failed = if options.no_check {
        0
    } else {
        run_cases(&rt, &shard_cases(rt.npes(), &WIDTHS), 1900, |case, seed| {
            check_case(&rt, case, seed, options.graph_calls)
        })?
    };
    time_shapes(
        &rt,
        &options.time,
        options.json.as_deref(),
        |comm, shape| time_shape(&rt, comm, shape),
    )?;
    rt.shutdown()?;
    Ok(failed == 0)
}

/// A heap for the largest timed layout or the checks' largest (Dk = 128, Dv = 192).
fn config(options: &Options, npes: usize) -> Result<Config> {
    let checks = Lasp2Layout {
        b: 2,
        h: 2,
        dk: 128,
        dv: 192,
    };
    lasp2_config::<GatedDelta>(&options.time, checks, npes)
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe { main_under_launcher("gated_delta_lasp2", Options::parse(), config, run) }
}
