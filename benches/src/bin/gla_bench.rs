//! Times the GLA forward and forward+backward (`ops::gla`) on one GPU and dumps the inputs and
//! outputs for the comparison with fla's `chunk_gla` (`benches/fla_gla.py`);
//! `scripts/gla-bench.sh` runs both.
//!
//! ```text
//! gla_bench --dump /tmp/gla                 # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
//! gla_bench --shapes 2x4096x16x64 --segments 4
//! ```
//!
//! Inputs: q, k, v, do ~ N(0, 1) rounded to bf16, g = logsigmoid(N(0, 1)) / 16 per key dimension
//! in fp32 (fla's GLA layer and benchmark gates), scale D^-1/2, no h0, ht or dht; a fixed-seed
//! host PRNG. Timing: warm-up calls, then calls enqueued back to back, each between two CUDA
//! events; the median. A forward+backward call is the forward, which then also writes the chunk
//! states the backward takes, then the backward (dq, dk, dv, dg from do). With `--dump DIR`: `DIR/<name>/{q,k,v,g,o,do,dq,dk,dv,dg}.bin` (raw little-endian;
//! q, k, g, dq, dk, dg `[B, T, H, Dk]`, v, o, do, dv `[B, T, H, Dv]`) and `DIR/ours.json`
//! (device, commit, per shape its name, dimensions, scale, `ours_fwd_ms`, `ours_fwdbwd_ms`, the
//! plans).

use clap::Parser;
use cudarc::driver::CudaSlice;
use half::bf16;
use lasp_shmem::ops::gla::{chunk_states_len, GlaArgs, GlaBackward, GlaBackwardArgs, GlaForward};
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::{Config, Result, Runtime};
use lasp_shmem_benches::{generated, io_error, logsigmoid, time_calls, write_raw, TimingOptions};
use lasp_shmem_examples::{round, to_json};
use serde::Serialize;

/// Times GLA's forward and forward+backward on one GPU; with --dump, writes what
/// benches/fla_gla.py compares with fla's chunk_gla.
#[derive(Parser, Debug)]
#[command(name = "gla_bench")]
struct Options {
    #[command(flatten)]
    timing: TimingOptions,
    /// Force the number of segments per sequence of the forward (tuning).
    #[arg(long, value_name = "S")]
    segments: Option<u32>,
    /// Force the number of segments per sequence of the backward's walks (tuning).
    #[arg(long, value_name = "S")]
    backward_segments: Option<u32>,
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
    ours_fwd_ms: f64,
    ours_fwd_min_ms: f64,
    ours_fwdbwd_ms: f64,
    ours_fwdbwd_min_ms: f64,
    num_segments: u32,
    chunks_per_segment: u32,
    states_splits: u32,
    backward_segments: u32,
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
    let mut fwd = GlaForward::new(&rt)?;
    fwd.set_num_segments(opts.segments)?;
    let mut bwd = GlaBackward::new(&rt)?;
    bwd.set_num_segments(opts.backward_segments)?;
    let mut rows = Vec::new();
    for &shape in &opts.timing.shapes {
        let name = format!("b{}_t{}_h{}_d{}", shape.b, shape.t, shape.h, shape.dk);
        let normal = |len: usize, tensor: u64| generated(len, tensor, bf16::from_f32);
        let (q, k, v) = (
            normal(shape.qk_len(), 1),
            normal(shape.qk_len(), 2),
            normal(shape.v_len(), 3),
        );
        let g = generated(shape.qk_len(), 4, |x| logsigmoid(x) / 16.0);
        let dq = stream.clone_htod(&q)?;
        let dk = stream.clone_htod(&k)?;
        let dv = stream.clone_htod(&v)?;
        let dg = stream.clone_htod(&g)?;
        let d_o = normal(shape.v_len(), 5);
        let d_do = stream.clone_htod(&d_o)?;
        let mut o: CudaSlice<bf16> = stream.alloc_zeros(shape.v_len())?;
        let mut grad_q: CudaSlice<bf16> = stream.alloc_zeros(shape.qk_len())?;
        let mut grad_k: CudaSlice<bf16> = stream.alloc_zeros(shape.qk_len())?;
        let mut grad_v: CudaSlice<bf16> = stream.alloc_zeros(shape.v_len())?;
        let mut grad_g: CudaSlice<f32> = stream.alloc_zeros(shape.qk_len())?;
        let mut chunk_states: CudaSlice<bf16> = stream.alloc_zeros(chunk_states_len(&shape))?;
        let mut plan = None;
        let (ms, min_ms) = time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
            let args = GlaArgs {
                shape,
                q: DeviceRef::new(&dq),
                k: DeviceRef::new(&dk),
                v: DeviceRef::new(&dv),
                g: DeviceRef::new(&dg),
                h0: None,
                o: DeviceMut::new(&mut o),
                ht: None,
                chunk_states: None,
                scale: None,
                documents: None,
                document_ht: None,
            };
            plan = Some(fwd.launch(&stream, args)?);
            Ok(())
        })?;
        let plan = plan.expect("at least one warm-up launch");
        let mut bwd_plan = None;
        let (fb_ms, fb_min_ms) =
            time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
                let args = GlaArgs {
                    shape,
                    q: DeviceRef::new(&dq),
                    k: DeviceRef::new(&dk),
                    v: DeviceRef::new(&dv),
                    g: DeviceRef::new(&dg),
                    h0: None,
                    o: DeviceMut::new(&mut o),
                    ht: None,
                    chunk_states: Some(DeviceMut::new(&mut chunk_states)),
                    scale: None,
                    documents: None,
                    document_ht: None,
                };
                fwd.launch(&stream, args)?;
                let args = GlaBackwardArgs {
                    shape,
                    q: DeviceRef::new(&dq),
                    k: DeviceRef::new(&dk),
                    v: DeviceRef::new(&dv),
                    g: DeviceRef::new(&dg),
                    h0: None,
                    chunk_states: DeviceRef::new(&chunk_states),
                    d_o: DeviceRef::new(&d_do),
                    dht: None,
                    dq: DeviceMut::new(&mut grad_q),
                    dk: DeviceMut::new(&mut grad_k),
                    dv: DeviceMut::new(&mut grad_v),
                    dg: DeviceMut::new(&mut grad_g),
                    dh0: None,
                    scale: None,
                    documents: None,
                };
                bwd_plan = Some(bwd.launch(&stream, args)?);
                Ok(())
            })?;
        let bwd_plan = bwd_plan.expect("at least one warm-up launch");
        let floor_bytes =
            (2 * (2 * shape.qk_len() + 2 * shape.v_len()) + 4 * shape.qk_len()) as f64;
        println!(
            "{name}: ours {ms:.4} ms (min {min_ms:.4}, S={}), {:.1} GB/s of q, k, v, g, o; \
             forward+backward {fb_ms:.4} ms (min {fb_min_ms:.4}, backward S={})",
            plan.num_segments,
            floor_bytes / ms / 1e6,
            bwd_plan.num_segments
        );
        if let Some(root) = &opts.timing.dump {
            let dir = root.join(&name);
            std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
            let o_host: Vec<bf16> = stream.clone_dtoh(&o)?;
            write_raw(&dir.join("q.bin"), &q)?;
            write_raw(&dir.join("k.bin"), &k)?;
            write_raw(&dir.join("v.bin"), &v)?;
            write_raw(&dir.join("g.bin"), &g)?;
            write_raw(&dir.join("o.bin"), &o_host)?;
            write_raw(&dir.join("do.bin"), &d_o)?;
            write_raw(&dir.join("dq.bin"), &stream.clone_dtoh(&grad_q)?)?;
            write_raw(&dir.join("dk.bin"), &stream.clone_dtoh(&grad_k)?)?;
            write_raw(&dir.join("dv.bin"), &stream.clone_dtoh(&grad_v)?)?;
            write_raw(&dir.join("dg.bin"), &stream.clone_dtoh(&grad_g)?)?;
        }
        rows.push(ShapeRow {
            name,
            b: shape.b,
            t: shape.t,
            h: shape.h,
            dk: shape.dk,
            dv: shape.dv,
            scale: shape.default_scale(),
            ours_fwd_ms: round(ms, 5),
            ours_fwd_min_ms: round(min_ms, 5),
            ours_fwdbwd_ms: round(fb_ms, 5),
            ours_fwdbwd_min_ms: round(fb_min_ms, 5),
            num_segments: plan.num_segments,
            chunks_per_segment: plan.chunks_per_segment,
            states_splits: plan.states_splits,
            backward_segments: bwd_plan.num_segments,
        });
    }
    let json = to_json(&Results {
        device,
        commit: std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        method: opts.timing.method(),
        inputs: "q, k, v, do ~ N(0, 1) in bf16; g = logsigmoid(N(0, 1)) / 16 per key dimension; scale D^-1/2",
        shapes: rows,
    });
    opts.timing.write_results(&json)?;
    drop(fwd);
    drop(bwd);
    rt.shutdown()
}

fn main() {
    let opts = Options::parse();
    lasp_shmem_benches::bench_main("gla_bench", opts.timing.timeout_s, |config| {
        run(&opts, config)
    });
}
