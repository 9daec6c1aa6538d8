//! Times the mLSTM forward (`ops::mlstm`) on one GPU and dumps the inputs and outputs for the
//! comparison with mlstm_kernels' TFLA kernels (`benches/tfla_mlstm.py`);
//! `scripts/mlstm-bench.sh` runs both.
//!
//! ```text
//! mlstm_bench --dump /tmp/mlstm             # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
//! mlstm_bench --shapes 2x4096x16x64 --segments 4
//! ```
//!
//! Inputs: q, k, v ~ N(0, 1) rounded to bf16; input-gate pre-activations i ~ N(0, 1) and
//! forget-gate pre-activations f ~ 3 + N(0, 1) in fp32 (xLSTM's forget-gate bias); scale D^-1/2,
//! eps 1e-6, the zero initial state, no final state; a fixed-seed host PRNG. Timing: warm-up
//! calls, then calls enqueued back to back, each between two CUDA events; the median. With
//! `--dump DIR`: `DIR/<name>/{q,k,v,i,f,h}.bin` (raw little-endian; q, k `[B, T, H, Dk]`, v, h
//! `[B, T, H, Dv]` bf16, i, f `[B, T, H]` fp32) and `DIR/ours.json` (device, commit, per shape
//! its name, dimensions, scale, eps, `ours_fwd_ms`, the plan).

use clap::Parser;
use cudarc::driver::CudaSlice;
use half::bf16;
use lasp_shmem::ops::mlstm::{MlstmArgs, MlstmForward, DEFAULT_EPS};
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::{Config, Result, Runtime};
use lasp_shmem_benches::{generated, io_error, time_calls, write_raw, TimingOptions};
use lasp_shmem_examples::{round, to_json};
use serde::Serialize;

/// Times mLSTM's forward on one GPU; with --dump, writes what benches/tfla_mlstm.py compares with
/// mlstm_kernels' TFLA kernels.
#[derive(Parser, Debug)]
#[command(name = "mlstm_bench")]
struct Options {
    #[command(flatten)]
    timing: TimingOptions,
    /// Force the number of segments per sequence (tuning).
    #[arg(long, value_name = "S")]
    segments: Option<u32>,
    /// Force the number of pieces the states pass cuts each segment into (tuning).
    #[arg(long, value_name = "R")]
    splits: Option<u32>,
}

#[derive(Serialize)]
struct ShapeRow {
    name: String,
    #[serde(rename = "B")]
    b: usize,
    #[serde(rename = "T")]
    t: usize,
    #[serde(rename = "H")]
    h: usize,
    #[serde(rename = "Dk")]
    dk: usize,
    #[serde(rename = "Dv")]
    dv: usize,
    scale: f32,
    eps: f32,
    ours_fwd_ms: f64,
    ours_fwd_min_ms: f64,
    num_segments: u32,
    chunks_per_segment: u32,
    states_splits: u32,
}

#[derive(Serialize)]
struct Results {
    device: String,
    commit: String,
    method: String,
    inputs: &'static str,
    shapes: Vec<ShapeRow>,
}

fn run(opts: &Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
    let stream = rt.stream().clone();
    let device = rt.context().name()?;
    let mut fwd = MlstmForward::new(&rt)?;
    fwd.set_num_segments(opts.segments);
    fwd.set_states_splits(opts.splits);
    let mut rows = Vec::new();
    for &shape in &opts.timing.shapes {
        let name = format!("b{}_t{}_h{}_d{}", shape.b, shape.t, shape.h, shape.dk);
        let normal = |len: usize, tensor: u64| generated(len, tensor, bf16::from_f32);
        let per_token = shape.b * shape.t * shape.h;
        let (q, k, v) = (
            normal(shape.qk_len(), 1),
            normal(shape.qk_len(), 2),
            normal(shape.v_len(), 3),
        );
        let i_gate = generated(per_token, 4, |x| x);
        let f_gate = generated(per_token, 5, |x| 3.0 + x);
        let dq = stream.clone_htod(&q)?;
        let dk = stream.clone_htod(&k)?;
        let dv = stream.clone_htod(&v)?;
        let di = stream.clone_htod(&i_gate)?;
        let df = stream.clone_htod(&f_gate)?;
        let mut h: CudaSlice<bf16> = stream.alloc_zeros(shape.v_len())?;
        let mut plan = None;
        let (ms, min_ms) = time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
            let args = MlstmArgs {
                shape,
                q: DeviceRef::new(&dq),
                k: DeviceRef::new(&dk),
                v: DeviceRef::new(&dv),
                i_gate: DeviceRef::new(&di),
                f_gate: DeviceRef::new(&df),
                initial_state: None,
                h: DeviceMut::new(&mut h),
                final_state: None,
                scale: None,
                eps: None,
            };
            plan = Some(fwd.launch(&stream, args)?);
            Ok(())
        })?;
        let plan = plan.expect("at least one warm-up launch");
        // q, k, v read and h written once in bf16, both gates read once in fp32.
        let floor_bytes = (2 * (2 * shape.qk_len() + 2 * shape.v_len()) + 8 * per_token) as f64;
        println!(
            "{name}: ours {ms:.4} ms (min {min_ms:.4}, S={}, R={}), {:.1} GB/s of q, k, v, gates, h",
            plan.num_segments,
            plan.states_splits,
            floor_bytes / ms / 1e6,
        );
        if let Some(root) = &opts.timing.dump {
            let dir = root.join(&name);
            std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
            write_raw(&dir.join("q.bin"), &q)?;
            write_raw(&dir.join("k.bin"), &k)?;
            write_raw(&dir.join("v.bin"), &v)?;
            write_raw(&dir.join("i.bin"), &i_gate)?;
            write_raw(&dir.join("f.bin"), &f_gate)?;
            write_raw(&dir.join("h.bin"), &stream.clone_dtoh(&h)?)?;
        }
        rows.push(ShapeRow {
            name,
            b: shape.b,
            t: shape.t,
            h: shape.h,
            dk: shape.dk,
            dv: shape.dv,
            scale: shape.default_scale(),
            eps: DEFAULT_EPS,
            ours_fwd_ms: round(ms, 5),
            ours_fwd_min_ms: round(min_ms, 5),
            num_segments: plan.num_segments,
            chunks_per_segment: plan.chunks_per_segment,
            states_splits: plan.states_splits,
        });
    }
    let json = to_json(&Results {
        device,
        commit: std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        method: opts.timing.method(),
        inputs: "q, k, v ~ N(0, 1) in bf16; i ~ N(0, 1), f ~ 3 + N(0, 1) pre-activations in fp32; \
                 scale D^-1/2; eps 1e-6; zero initial state",
        shapes: rows,
    });
    opts.timing.write_results(&json)?;
    drop(fwd);
    rt.shutdown()
}

fn main() {
    let opts = Options::parse();
    lasp_shmem_benches::bench_main("mlstm_bench", opts.timing.timeout_s, |config| {
        run(&opts, config)
    });
}
