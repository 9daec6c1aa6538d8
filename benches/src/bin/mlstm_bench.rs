//! Times the mLSTM forward and backward (`ops::mlstm`) on one GPU and dumps the inputs and
//! outputs for the comparison with mlstm_kernels' TFLA kernels (`benches/tfla_mlstm.py`);
//! `scripts/mlstm-bench.sh` runs both.
//!
//! ```text
//! mlstm_bench --dump /tmp/mlstm             # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
//! mlstm_bench --shapes 2x4096x16x64 --segments 4
//! ```
//!
//! Inputs: q, k, v ~ N(0, 1) rounded to bf16; input-gate pre-activations i ~ N(0, 1) and
//! forget-gate pre-activations f ~ 3 + N(0, 1) in fp32 (xLSTM's forget-gate bias); scale D^-1/2,
//! eps 1e-6, the zero initial state, no final state; `dh ~ N(0, 1)` in bf16; a fixed-seed host
//! PRNG. Timed: the forward alone (`ours_fwd_ms`), the forward that saves its rows followed by the
//! backward (`ours_fwdbwd_ms`, what a training step pays), and the backward alone
//! (`ours_bwd_ms`). Timing: warm-up calls, then calls enqueued back to back, each between two
//! CUDA events; the median. With `--dump DIR`: `DIR/<name>/{q,k,v,i,f,h,dh,dq,dk,dv,di,df}.bin`
//! (raw little-endian; q, k, dq, dk `[B, T, H, Dk]`, v, h, dh, dv `[B, T, H, Dv]` bf16, i, f, di,
//! df `[B, T, H]` fp32) and `DIR/ours.json` (device, commit, per shape its name, dimensions,
//! scale, eps, the times, the plan).

use clap::Parser;
use cudarc::driver::CudaSlice;
use half::bf16;
use lasp_shmem::ops::mlstm::{
    MlstmArgs, MlstmBackward, MlstmBackwardArgs, MlstmForward, MlstmSavedMut, MlstmSavedRef,
    DEFAULT_EPS,
};
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::{Config, Result, Runtime};
use lasp_shmem_benches::{generated, io_error, time_calls, write_raw, TimingOptions};
use lasp_shmem_examples::{round, to_json};
use serde::Serialize;

/// Times mLSTM's forward and backward on one GPU; with --dump, writes what benches/tfla_mlstm.py compares with
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
    ours_fwdbwd_ms: f64,
    ours_fwdbwd_min_ms: f64,
    ours_bwd_ms: f64,
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
    let mut bwd = MlstmBackward::new(&rt)?;
    fwd.set_num_segments(opts.segments);
    fwd.set_states_splits(opts.splits);
    bwd.set_num_segments(opts.segments);
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
        let d_h = generated(shape.v_len(), 6, bf16::from_f32);
        let d_h_dev = stream.clone_htod(&d_h)?;
        let mut row_m: CudaSlice<f32> = stream.alloc_zeros(per_token)?;
        let mut row_den: CudaSlice<f32> = stream.alloc_zeros(per_token)?;
        let mut grads_qk: [CudaSlice<bf16>; 2] = [
            stream.alloc_zeros(shape.qk_len())?,
            stream.alloc_zeros(shape.qk_len())?,
        ];
        let mut grad_v: CudaSlice<bf16> = stream.alloc_zeros(shape.v_len())?;
        let mut grad_gates: [CudaSlice<f32>; 2] = [
            stream.alloc_zeros(per_token)?,
            stream.alloc_zeros(per_token)?,
        ];
        // The forward, saving its rows for the backward where `saved` says where.
        let mut forward = |h: &mut CudaSlice<bf16>, saved: Option<MlstmSavedMut<'_>>| {
            let args = MlstmArgs {
                shape,
                q: DeviceRef::new(&dq),
                k: DeviceRef::new(&dk),
                v: DeviceRef::new(&dv),
                i_gate: DeviceRef::new(&di),
                f_gate: DeviceRef::new(&df),
                initial_state: None,
                h: DeviceMut::new(h),
                saved,
                final_state: None,
                scale: None,
                eps: None,
                documents: None,
                document_final_states: None,
            };
            fwd.launch(&stream, args)
        };
        let mut plan = None;
        let (ms, min_ms) = time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
            plan = Some(forward(&mut h, None)?);
            Ok(())
        })?;
        let plan = plan.expect("at least one warm-up launch");
        let mut backward = |m: &CudaSlice<f32>,
                            den: &CudaSlice<f32>,
                            [g_q, g_k]: &mut [CudaSlice<bf16>; 2],
                            g_v: &mut CudaSlice<bf16>,
                            [g_i, g_f]: &mut [CudaSlice<f32>; 2]| {
            let args = MlstmBackwardArgs {
                shape,
                q: DeviceRef::new(&dq),
                k: DeviceRef::new(&dk),
                v: DeviceRef::new(&dv),
                i_gate: DeviceRef::new(&di),
                f_gate: DeviceRef::new(&df),
                initial_state: None,
                saved: MlstmSavedRef {
                    m: DeviceRef::new(m),
                    den: DeviceRef::new(den),
                },
                d_h: DeviceRef::new(&d_h_dev),
                d_final: None,
                dq: DeviceMut::new(g_q),
                dk: DeviceMut::new(g_k),
                dv: DeviceMut::new(g_v),
                d_i_gate: DeviceMut::new(g_i),
                d_f_gate: DeviceMut::new(g_f),
                d_initial_c: None,
                scale: None,
                documents: None,
            };
            bwd.launch(&stream, args).map(|_| ())
        };
        let (fb_ms, fb_min_ms) =
            time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
                let saved = MlstmSavedMut {
                    m: DeviceMut::new(&mut row_m),
                    den: DeviceMut::new(&mut row_den),
                };
                forward(&mut h, Some(saved))?;
                backward(
                    &row_m,
                    &row_den,
                    &mut grads_qk,
                    &mut grad_v,
                    &mut grad_gates,
                )
            })?;
        let (bwd_ms, _) = time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
            backward(
                &row_m,
                &row_den,
                &mut grads_qk,
                &mut grad_v,
                &mut grad_gates,
            )
        })?;
        // q, k, v read and h written once in bf16, both gates read once in fp32.
        let floor_bytes = (2 * (2 * shape.qk_len() + 2 * shape.v_len()) + 8 * per_token) as f64;
        println!(
            "{name}: ours {ms:.4} ms (min {min_ms:.4}, S={}, R={}), {:.1} GB/s of q, k, v, gates, h; \
             fwd+bwd {fb_ms:.4} ms, bwd {bwd_ms:.4} ms",
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
            write_raw(&dir.join("dh.bin"), &d_h)?;
            write_raw(&dir.join("dq.bin"), &stream.clone_dtoh(&grads_qk[0])?)?;
            write_raw(&dir.join("dk.bin"), &stream.clone_dtoh(&grads_qk[1])?)?;
            write_raw(&dir.join("dv.bin"), &stream.clone_dtoh(&grad_v)?)?;
            write_raw(&dir.join("di.bin"), &stream.clone_dtoh(&grad_gates[0])?)?;
            write_raw(&dir.join("df.bin"), &stream.clone_dtoh(&grad_gates[1])?)?;
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
            ours_fwdbwd_ms: round(fb_ms, 5),
            ours_fwdbwd_min_ms: round(fb_min_ms, 5),
            ours_bwd_ms: round(bwd_ms, 5),
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
                 scale D^-1/2; eps 1e-6; zero initial state; dh ~ N(0, 1) in bf16",
        shapes: rows,
    });
    opts.timing.write_results(&json)?;
    drop(fwd);
    drop(bwd);
    rt.shutdown()
}

fn main() {
    let opts = Options::parse();
    lasp_shmem_benches::bench_main("mlstm_bench", opts.timing.timeout_s, |config| {
        run(&opts, config)
    });
}
