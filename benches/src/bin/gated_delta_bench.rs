//! Times the Gated DeltaNet forward and backward (`ops::gated_delta`) on one GPU and dumps the
//! forward's inputs and output for the comparison with fla's `chunk_gated_delta_rule`
//! (`benches/fla_gated_delta.py`).
//!
//! ```text
//! gated_delta_bench --dump /tmp/gdn          # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
//! gated_delta_bench --shapes 2x4096x16x64
//! ```
//!
//! Inputs: q, v ~ N(0, 1) and k ~ N(0, 1) with every row scaled to unit norm (the model's l2
//! normalisation), rounded to bf16; g = logsigmoid(N(0, 1)) / 16 and beta = sigmoid(N(0, 1)) per
//! token and head in fp32; do ~ N(0, 1) in bf16 for the backward; scale D^-1/2, no h0, ht, dht or
//! dh0; a fixed-seed host PRNG. Timing: warm-up calls, then calls enqueued back to back, each
//! between two CUDA events; the median; the backward on its own (it needs nothing of the
//! forward's). The HBM floors at the spec bandwidth of the device (H100 SXM 3.35e12, H200 4.8e12
//! B/s): the forward's q, k, v, o in bf16 and g, beta in fp32 moved once; the backward's q, k, v,
//! do read and dq, dk, dv written in bf16, g, beta read and dg, dbeta written in fp32. With
//! `--dump DIR`:
//! `DIR/<name>/{q,k,v,g,beta,o}.bin` (raw little-endian; q, k `[B, T, H, Dk]`, v, o `[B, T, H,
//! Dv]`, g, beta `[B, T, H]`) and `DIR/ours.json`.

use clap::Parser;
use cudarc::driver::CudaSlice;
use half::bf16;
use lasp_shmem::ops::gated_delta::{
    GatedDeltaArgs, GatedDeltaBackward, GatedDeltaBackwardArgs, GatedDeltaForward,
};
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::{Config, Result, Runtime};
use lasp_shmem_benches::{generated, io_error, logsigmoid, time_calls, write_raw, TimingOptions};
use lasp_shmem_examples::{round, to_json};
use serde::Serialize;

/// Times Gated DeltaNet's forward on one GPU against its HBM floor; with --dump, writes what
/// benches/fla_gated_delta.py compares with fla's chunk_gated_delta_rule.
#[derive(Parser, Debug)]
#[command(name = "gated_delta_bench")]
struct Options {
    #[command(flatten)]
    timing: TimingOptions,
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
    #[serde(rename = "D")]
    d: usize,
    ours_fwd_ms: f64,
    ours_fwd_min_ms: f64,
    num_segments: u32,
    hbm_floor_fwd_ms: f64,
    floor_fraction_fwd: f64,
    ours_bwd_ms: f64,
    ours_bwd_min_ms: f64,
    hbm_floor_bwd_ms: f64,
    floor_fraction_bwd: f64,
}

#[derive(Serialize)]
struct Results {
    device: String,
    commit: String,
    method: String,
    inputs: &'static str,
    hbm_bytes_per_s: f64,
    shapes: Vec<ShapeRow>,
}

/// The spec HBM bandwidth of the device, by name.
fn hbm_bytes_per_s(device: &str) -> f64 {
    if device.contains("H200") {
        4.8e12
    } else {
        3.35e12
    }
}

/// `len / d` rows of `d` normal values, each scaled to unit norm, in bf16.
fn unit_rows(len: usize, d: usize, tensor: u64) -> Vec<bf16> {
    generated(len, tensor, |v| v)
        .chunks(d)
        .flat_map(|row| {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
            row.iter().map(move |v| bf16::from_f32(v / norm))
        })
        .collect()
}

fn run(opts: &Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
    let stream = rt.stream().clone();
    let device = rt.context().name()?;
    let bandwidth = hbm_bytes_per_s(&device);
    let mut fwd = GatedDeltaForward::new(&rt)?;
    let mut bwd = GatedDeltaBackward::new(&rt)?;
    let mut rows = Vec::new();
    for &shape in &opts.timing.shapes {
        let name = format!("b{}_t{}_h{}_d{}", shape.b, shape.t, shape.h, shape.dk);
        let normal = |len: usize, tensor: u64| generated(len, tensor, bf16::from_f32);
        let (q, k, v) = (
            normal(shape.qk_len(), 1),
            unit_rows(shape.qk_len(), shape.dk, 2),
            normal(shape.v_len(), 3),
        );
        let g = generated(shape.gate_len(), 4, |x| logsigmoid(x) / 16.0);
        let beta = generated(shape.gate_len(), 5, |x| logsigmoid(x).exp());
        let (dq, dk, dv) = (
            stream.clone_htod(&q)?,
            stream.clone_htod(&k)?,
            stream.clone_htod(&v)?,
        );
        let (dg, dbeta) = (stream.clone_htod(&g)?, stream.clone_htod(&beta)?);
        let mut o: CudaSlice<bf16> = stream.alloc_zeros(shape.v_len())?;
        let mut plan = None;
        let (ms, min_ms) = time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
            let args = GatedDeltaArgs {
                shape,
                q: DeviceRef::new(&dq),
                k: DeviceRef::new(&dk),
                v: DeviceRef::new(&dv),
                g: DeviceRef::new(&dg),
                beta: DeviceRef::new(&dbeta),
                h0: None,
                o: DeviceMut::new(&mut o),
                ht: None,
                scale: None,
            };
            plan = Some(fwd.launch(&stream, args)?);
            Ok(())
        })?;
        let segments = plan.map_or(0, |p| p.num_segments);
        let floor_bytes =
            (2 * (2 * shape.qk_len() + 2 * shape.v_len()) + 8 * shape.gate_len()) as f64;
        let floor_ms = floor_bytes / bandwidth * 1e3;
        println!(
            "{name}: ours {ms:.4} ms (min {min_ms:.4}, S={segments}), HBM floor {floor_ms:.4} ms \
             ({:.0} % of it)",
            100.0 * floor_ms / ms
        );
        let d_o = stream.clone_htod(&normal(shape.v_len(), 6))?;
        let mut grad_q: CudaSlice<bf16> = stream.alloc_zeros(shape.qk_len())?;
        let mut grad_k: CudaSlice<bf16> = stream.alloc_zeros(shape.qk_len())?;
        let mut grad_v: CudaSlice<bf16> = stream.alloc_zeros(shape.v_len())?;
        let mut grad_g: CudaSlice<f32> = stream.alloc_zeros(shape.gate_len())?;
        let mut grad_beta: CudaSlice<f32> = stream.alloc_zeros(shape.gate_len())?;
        let mut bwd_plan = None;
        let (bwd_ms, bwd_min_ms) =
            time_calls(&stream, opts.timing.warmup, opts.timing.iters(), |_| {
                let args = GatedDeltaBackwardArgs {
                    shape,
                    q: DeviceRef::new(&dq),
                    k: DeviceRef::new(&dk),
                    v: DeviceRef::new(&dv),
                    g: DeviceRef::new(&dg),
                    beta: DeviceRef::new(&dbeta),
                    h0: None,
                    d_o: DeviceRef::new(&d_o),
                    dht: None,
                    dq: DeviceMut::new(&mut grad_q),
                    dk: DeviceMut::new(&mut grad_k),
                    dv: DeviceMut::new(&mut grad_v),
                    dg: DeviceMut::new(&mut grad_g),
                    dbeta: DeviceMut::new(&mut grad_beta),
                    dh0: None,
                    scale: None,
                };
                bwd_plan = Some(bwd.launch(&stream, args)?);
                Ok(())
            })?;
        let bwd_segments = bwd_plan.map_or(0, |p| p.forward.num_segments);
        let bwd_floor_bytes =
            (2 * (4 * shape.qk_len() + 3 * shape.v_len()) + 16 * shape.gate_len()) as f64;
        let bwd_floor_ms = bwd_floor_bytes / bandwidth * 1e3;
        println!(
            "{name}: backward {bwd_ms:.4} ms (min {bwd_min_ms:.4}, S={bwd_segments}), HBM floor \
             {bwd_floor_ms:.4} ms ({:.0} % of it)",
            100.0 * bwd_floor_ms / bwd_ms
        );
        if let Some(root) = &opts.timing.dump {
            let dir = root.join(&name);
            std::fs::create_dir_all(&dir).map_err(|e| io_error(&dir, e))?;
            write_raw(&dir.join("q.bin"), &q)?;
            write_raw(&dir.join("k.bin"), &k)?;
            write_raw(&dir.join("v.bin"), &v)?;
            write_raw(&dir.join("g.bin"), &g)?;
            write_raw(&dir.join("beta.bin"), &beta)?;
            write_raw(&dir.join("o.bin"), &stream.clone_dtoh(&o)?)?;
        }
        rows.push(ShapeRow {
            name,
            b: shape.b,
            t: shape.t,
            h: shape.h,
            d: shape.dk,
            ours_fwd_ms: round(ms, 5),
            ours_fwd_min_ms: round(min_ms, 5),
            num_segments: segments,
            hbm_floor_fwd_ms: round(floor_ms, 5),
            floor_fraction_fwd: round(floor_ms / ms, 4),
            ours_bwd_ms: round(bwd_ms, 5),
            ours_bwd_min_ms: round(bwd_min_ms, 5),
            hbm_floor_bwd_ms: round(bwd_floor_ms, 5),
            floor_fraction_bwd: round(bwd_floor_ms / bwd_ms, 4),
        });
    }
    let json = to_json(&Results {
        device,
        commit: std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        method: opts.timing.method(),
        inputs:
            "q, v ~ N(0, 1), k ~ N(0, 1) with unit-norm rows, in bf16; g = logsigmoid(N(0, 1)) \
                 / 16 and beta = sigmoid(N(0, 1)) per token and head; do ~ N(0, 1) in bf16; \
                 scale D^-1/2",
        hbm_bytes_per_s: bandwidth,
        shapes: rows,
    });
    opts.timing.write_results(&json)?;
    drop(fwd);
    drop(bwd);
    rt.shutdown()
}

fn main() {
    let opts = Options::parse();
    lasp_shmem_benches::bench_main("gated_delta_bench", opts.timing.timeout_s, |config| {
        run(&opts, config)
    });
}
