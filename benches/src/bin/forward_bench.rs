//! Times the scalar-decay forward (`ops::scalar_decay`) on one GPU and dumps its inputs and
//! output for the comparison with fla (`benches/fla_forward.py`); `scripts/forward-bench.sh`
//! runs both in sequence.
//!
//! ```text
//! forward_bench --dump /tmp/fwd                    # B=4,T=8K / B=1,T=32K / B=1,T=128K, H=16, D=128
//! forward_bench --shapes 2x4096x16x128,1x65536x16x64 --iters 100
//! forward_bench --segments 8                       # force S (tuning), --target-ctas 264
//! forward_bench --probes --out probes.json         # + the output kernel alone and its probes
//! ```
//!
//! Inputs: q, k, v ~ N(0, 1) rounded to bf16, g = logsigmoid(N(0, 1)) / 16 in fp32 (fla's
//! benchmark gates), scale D^-1/2, no h0, no ht; a fixed-seed host PRNG, so every run and the
//! Python side see the same values. Timing: 10 warm-up calls, then 50 calls enqueued back to
//! back, each between two CUDA events; the median is reported. When the inputs fit in twice the
//! L2 cache, the calls rotate over enough input sets to exceed it.
//!
//! With `--dump DIR`, each shape gets `DIR/B{B}_T{T}_H{H}_D{D}/` with raw little-endian
//! `q.bin k.bin v.bin` (bf16 `[B, T, H, D]`), `g.bin` (fp32 `[B, T, H]`), `o.bin` (our bf16
//! output) and `meta.json`; `DIR/ours.json` lists them with the device and our timings. The
//! HBM floor is (q, k, v read once + o written once) / 4.3e12 B/s: the device-to-device copy
//! rate measured on the reference H200 image (reads + writes counted).
//!
//! With `--probes`, each shape also times, the same way and on the same input sets, the output
//! kernel alone (`output_ms`: the forward without its states pass and fold) and its timed
//! variants (`probe_memory_ms`, `probe_compute_ms`, `probe_no_exp_ms`; `ops::scalar_decay::OutputProbe`,
//! kernels/docs/scalar-decay.md "Probes" says how to read them). The probes overwrite o;
//! the dumped o is from a real forward run after them.
//!
//! With `--backward`, each shape also times the backward (`ops::scalar_decay_backward`) on the
//! same input sets with dO ~ N(0, 1) in bf16 (no h0, no dht, no dh0): `backward_ms`, and its HBM
//! floor (q, k, v, dO read once + dq, dk, dv written once) / 4.3e12 B/s.

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use lasp_shmem::ops::scalar_decay::{
    ForwardArgs, ForwardPlan, ForwardShape, OutputProbe, ScalarDecayForward,
};
use lasp_shmem::ops::scalar_decay_backward::{BackwardArgs, ScalarDecayBackward};
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::SplitMix64;
use lasp_shmem::{Config, Error, Result, Runtime};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Device-to-device copy rate of the reference H200 image, bytes read + written per second
/// (/work/.library/device/KINDS.md: "about 4.3 TB/s counting bytes read and written").
const HBM_BYTES_PER_S: f64 = 4.3e12;
const SEED: u64 = 0x5EED_F0D0;

struct Options {
    shapes: Vec<(usize, usize, usize, usize)>,
    dump: Option<PathBuf>,
    out: Option<PathBuf>,
    warmup: usize,
    iters: usize,
    segments: Option<u32>,
    target_ctas: Option<u32>,
    timeout_s: u64,
    probes: bool,
    backward: bool,
}

fn usage(problem: &str) -> Error {
    Error::InvalidArgument(format!(
        "{problem}; usage: forward_bench [--dump DIR] [--out FILE] [--shapes BxTxHxD,...] \
         [--warmup N] [--iters N] [--segments S] [--target-ctas N] [--timeout SECONDS] [--probes] \
         [--backward]"
    ))
}

fn parse_options() -> Result<Options> {
    let mut o = Options {
        shapes: vec![
            (4, 8192, 16, 128),
            (1, 32768, 16, 128),
            (1, 131072, 16, 128),
        ],
        dump: None,
        out: None,
        warmup: 10,
        iters: 50,
        segments: None,
        target_ctas: None,
        timeout_s: 480,
        probes: false,
        backward: false,
    };
    let mut args = std::env::args().skip(1);
    const FLAGS: [&str; 8] = [
        "--dump",
        "--out",
        "--warmup",
        "--iters",
        "--segments",
        "--target-ctas",
        "--timeout",
        "--shapes",
    ];
    while let Some(flag) = args.next() {
        if flag == "--probes" {
            o.probes = true;
            continue;
        }
        if flag == "--backward" {
            o.backward = true;
            continue;
        }
        if !FLAGS.contains(&flag.as_str()) {
            return Err(usage(&format!("unknown option {flag}")));
        }
        let value = args
            .next()
            .ok_or_else(|| usage(&format!("{flag} needs a value")))?;
        let number = |v: &str| {
            v.parse::<usize>()
                .map_err(|_| usage(&format!("{flag} {v}: not a number")))
        };
        match flag.as_str() {
            "--dump" => o.dump = Some(PathBuf::from(value)),
            "--out" => o.out = Some(PathBuf::from(value)),
            "--warmup" => o.warmup = number(&value)?,
            "--iters" => o.iters = number(&value)?.max(1),
            "--segments" => o.segments = Some(number(&value)? as u32),
            "--target-ctas" => o.target_ctas = Some(number(&value)? as u32),
            "--timeout" => o.timeout_s = number(&value)? as u64,
            "--shapes" => {
                o.shapes = value
                    .split(',')
                    .map(|s| {
                        let d: Vec<usize> = s
                            .split('x')
                            .map(|x| x.trim().parse::<usize>())
                            .collect::<std::result::Result<_, _>>()
                            .map_err(|_| usage(&format!("shape {s:?} is not BxTxHxD")))?;
                        match d[..] {
                            [b, t, h, dd] => Ok((b, t, h, dd)),
                            _ => Err(usage(&format!("shape {s:?} is not BxTxHxD"))),
                        }
                    })
                    .collect::<Result<_>>()?
            }
            _ => return Err(usage(&format!("unknown option {flag}"))),
        }
    }
    Ok(o)
}

/// One independent SplitMix64 stream per (tensor, block), so generation runs in parallel and gives
/// the same values for any thread count.
fn block_rng(tensor: u64, block: u64) -> SplitMix64 {
    SplitMix64::new(
        SEED ^ tensor.wrapping_mul(0xD1B5_4A32_D192_ED03)
            ^ block.wrapping_mul(0x9E37_79B9_7F4A_7C15),
    )
}

/// Two standard normals in f32 (Box-Muller, both branches: the bench fills gigabytes).
fn normal_pair(rng: &mut SplitMix64) -> (f32, f32) {
    let u1 = ((rng.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
    let u2 = ((rng.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32;
    let r = (-2.0 * u1.ln()).sqrt();
    let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
    (r * c, r * s)
}

const BLOCK: usize = 1 << 16;

/// Fills `out` block by block on every core: `f(value index, normal)`.
fn fill_parallel<T: Send>(out: &mut [T], tensor: u64, f: impl Fn(f32) -> T + Sync) {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per_thread = out.len().div_ceil(threads).div_ceil(BLOCK) * BLOCK;
    std::thread::scope(|scope| {
        for (t, part) in out.chunks_mut(per_thread.max(BLOCK)).enumerate() {
            let f = &f;
            scope.spawn(move || {
                for (i, block) in part.chunks_mut(BLOCK).enumerate() {
                    let block_index = (t * per_thread.max(BLOCK) / BLOCK + i) as u64;
                    let mut rng = block_rng(tensor, block_index);
                    for pair in block.chunks_mut(2) {
                        let (a, b) = normal_pair(&mut rng);
                        pair[0] = f(a);
                        if pair.len() > 1 {
                            pair[1] = f(b);
                        }
                    }
                }
            });
        }
    });
}

fn logsigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

struct HostInputs {
    q: Vec<bf16>,
    k: Vec<bf16>,
    v: Vec<bf16>,
    g: Vec<f32>,
}

fn generate(shape: &ForwardShape, set: u64) -> HostInputs {
    let mk = |len: usize, tensor: u64| {
        let mut x = vec![bf16::ZERO; len];
        fill_parallel(&mut x, tensor + 16 * set, bf16::from_f32);
        x
    };
    let mut g = vec![0f32; shape.gate_len()];
    fill_parallel(&mut g, 4 + 16 * set, |x| logsigmoid(x) / 16.0);
    HostInputs {
        q: mk(shape.qk_len(), 1),
        k: mk(shape.qk_len(), 2),
        v: mk(shape.v_len(), 3),
        g,
    }
}

struct DeviceSet {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    o: CudaSlice<bf16>,
    /// With --backward: dO and the gradients.
    grads: Option<GradSet>,
}

struct GradSet {
    d_o: CudaSlice<bf16>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
}

impl GradSet {
    /// dO drawn like q (tensor 5 of input set `set`), zeroed gradients.
    fn new(stream: &Arc<CudaStream>, shape: &ForwardShape, set: u64) -> Result<Self> {
        let mut d_o = vec![bf16::ZERO; shape.v_len()];
        fill_parallel(&mut d_o, 5 + 16 * set, bf16::from_f32);
        Ok(GradSet {
            d_o: stream.clone_htod(&d_o)?,
            dq: stream.alloc_zeros(shape.qk_len())?,
            dk: stream.alloc_zeros(shape.qk_len())?,
            dv: stream.alloc_zeros(shape.v_len())?,
            dg: stream.alloc_zeros(shape.gate_len())?,
        })
    }
}

/// The backward's arguments over one input set: no h0, no dht, no dh0, the default scale.
fn backward_args(shape: ForwardShape, set: &mut DeviceSet) -> BackwardArgs<'_> {
    let grads = set.grads.as_mut().expect("allocated with --backward");
    BackwardArgs {
        shape,
        q: DeviceRef::new(&set.q),
        k: DeviceRef::new(&set.k),
        v: DeviceRef::new(&set.v),
        g: DeviceRef::new(&set.g),
        h0: None,
        d_o: DeviceRef::new(&grads.d_o),
        d_ht: None,
        dq: DeviceMut::new(&mut grads.dq),
        dk: DeviceMut::new(&mut grads.dk),
        dv: DeviceMut::new(&mut grads.dv),
        dg: DeviceMut::new(&mut grads.dg),
        dh0: None,
        scale: None,
    }
}

/// The forward's arguments over one input set: no h0, no ht, the default scale.
fn forward_args(shape: ForwardShape, set: &mut DeviceSet) -> ForwardArgs<'_> {
    ForwardArgs {
        shape,
        q: DeviceRef::new(&set.q),
        k: DeviceRef::new(&set.k),
        v: DeviceRef::new(&set.v),
        g: DeviceRef::new(&set.g),
        h0: None,
        o: DeviceMut::new(&mut set.o),
        ht: None,
        scale: None,
    }
}

/// `opts.warmup` calls (at least one), then `opts.iters` calls enqueued back to back, each between
/// two CUDA events; `call(i)` enqueues call i. Returns (median, minimum) in ms.
fn time_calls(
    stream: &Arc<CudaStream>,
    opts: &Options,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<(f64, f64)> {
    for i in 0..opts.warmup.max(1) {
        call(i)?;
    }
    stream.synchronize()?;
    let mut events = Vec::with_capacity(opts.iters);
    for i in 0..opts.iters {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        call(i)?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        events.push((start, end));
    }
    stream.synchronize()?;
    let samples: Vec<f64> = events
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).map(f64::from))
        .collect::<std::result::Result<_, _>>()?;
    let min_ms = samples.iter().copied().fold(f64::INFINITY, f64::min);
    Ok((median(samples), min_ms))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::State(format!(
        "cannot write {}: {e}; check that the dump directory's disk has room (the 128K shape \
         needs about 2.2 GB)",
        path.display()
    ))
}

/// Writes the raw little-endian bytes of a bf16 or f32 buffer.
fn write_raw<T: Copy>(path: &Path, data: &[T]) -> Result<()> {
    const { assert!(cfg!(target_endian = "little")) };
    // SAFETY: bf16 and f32 are plain old data without padding; the bytes are their
    // little-endian representation on this (little-endian) host.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
    };
    let mut f = std::fs::File::create(path).map_err(|e| io_error(path, e))?;
    f.write_all(bytes).map_err(|e| io_error(path, e))
}

struct Row {
    shape: ForwardShape,
    dir: String,
    ours_ms: f64,
    min_ms: f64,
    hbm_floor_ms: f64,
    plan: ForwardPlan,
    sets: usize,
    /// With --probes: the median ms of each OutputProbe variant, in OutputProbe::ALL order.
    probes_ms: Vec<(OutputProbe, f64)>,
    /// With --backward: the backward's (median, minimum, HBM floor) ms.
    backward_ms: Option<(f64, f64, f64)>,
}

fn bench_shape(
    fwd: &mut ScalarDecayForward,
    bwd: Option<&mut ScalarDecayBackward>,
    stream: &Arc<CudaStream>,
    shape: ForwardShape,
    opts: &Options,
    l2_bytes: usize,
) -> Result<Row> {
    shape.validate()?;
    let dir = format!("B{}_T{}_H{}_D{}", shape.b, shape.t, shape.h, shape.dk);
    let mut bytes_in_out = 2 * (2 * shape.qk_len() + 2 * shape.v_len()) + 4 * shape.gate_len();
    if bwd.is_some() {
        bytes_in_out += 2 * (2 * shape.qk_len() + 2 * shape.v_len()) + 4 * shape.gate_len();
    }
    let sets = if bytes_in_out < 2 * l2_bytes {
        (2 * l2_bytes).div_ceil(bytes_in_out) + 1
    } else {
        1
    };
    let t0 = Instant::now();
    let mut host0 = None;
    let mut device = Vec::with_capacity(sets);
    for set in 0..sets {
        let host = generate(&shape, set as u64);
        device.push(DeviceSet {
            q: stream.clone_htod(&host.q)?,
            k: stream.clone_htod(&host.k)?,
            v: stream.clone_htod(&host.v)?,
            g: stream.clone_htod(&host.g)?,
            o: stream.alloc_zeros(shape.v_len())?,
            grads: bwd
                .is_some()
                .then(|| GradSet::new(stream, &shape, set as u64))
                .transpose()?,
        });
        if set == 0 {
            host0 = Some(host);
        }
    }
    stream.synchronize()?;
    let setup_s = t0.elapsed().as_secs_f64();

    let mut plan = None;
    let (ours_ms, min_ms) = time_calls(stream, opts, |i| {
        plan = Some(fwd.launch(stream, forward_args(shape, &mut device[i % sets]))?);
        Ok(())
    })?;
    let mut probes_ms = Vec::new();
    if opts.probes {
        for probe in OutputProbe::ALL {
            let (ms, _) = time_calls(stream, opts, |i| {
                let args = forward_args(shape, &mut device[i % sets]);
                fwd.launch_output_probe(stream, args, probe).map(drop)
            })?;
            probes_ms.push((probe, ms));
        }
    }
    let backward_ms = match bwd {
        Some(bwd) => {
            let (ms, min_ms) = time_calls(stream, opts, |i| {
                bwd.launch(stream, backward_args(shape, &mut device[i % sets]))
            })?;
            let dg: Vec<f32> =
                stream.clone_dtoh(&device[0].grads.as_ref().expect("--backward").dg)?;
            if let Some(pos) = dg.iter().position(|x| !x.is_finite()) {
                return Err(Error::State(format!(
                    "{dir}: dg element {pos} is {} (not finite): run backward_check",
                    dg[pos]
                )));
            }
            let floor_bytes = 2.0 * (4 * shape.qk_len() + 3 * shape.v_len()) as f64;
            Some((ms, min_ms, floor_bytes / HBM_BYTES_PER_S * 1e3))
        }
        None => None,
    };

    // Set 0's output (every run of the same inputs gives the same bits).
    fwd.launch(stream, forward_args(shape, &mut device[0]))?;
    let o: Vec<bf16> = stream.clone_dtoh(&device[0].o)?;
    if let Some(pos) = o.iter().position(|x| !x.to_f32().is_finite()) {
        return Err(Error::State(format!(
            "{dir}: output element {pos} is {} (not finite): run forward_check",
            o[pos]
        )));
    }
    let floor_bytes = 2.0 * (2 * shape.qk_len() + 2 * shape.v_len()) as f64;
    let row = Row {
        shape,
        dir,
        ours_ms,
        min_ms,
        hbm_floor_ms: floor_bytes / HBM_BYTES_PER_S * 1e3,
        plan: plan.expect("at least one warm-up launch"),
        sets,
        probes_ms,
        backward_ms,
    };
    if let Some(root) = &opts.dump {
        let t1 = Instant::now();
        write_dump(root, &row, host0.as_ref().expect("set 0 was generated"), &o)?;
        eprintln!(
            "forward_bench: {}: inputs {setup_s:.1} s, dump {:.1} s",
            row.dir,
            t1.elapsed().as_secs_f64()
        );
    }
    Ok(row)
}

/// `meta.json` of one shape's dump folder.
fn meta_json(r: &Row) -> String {
    let s = &r.shape;
    format!(
        "{{\"B\": {}, \"T\": {}, \"H\": {}, \"D\": {}, \"Dk\": {}, \"Dv\": {}, \"scale\": {:e}, \
         \"dtype_qkvo\": \"bf16\", \"dtype_g\": \"f32\", \"layout\": \"q, k, v, o [B, T, H, D]; g [B, T, H]\", \
         \"ours_ms\": {:.5}, \"ours_min_ms\": {:.5}, \"hbm_floor_ms\": {:.5}, \"num_segments\": {}, \
         \"chunks_per_segment\": {}, \"sets\": {}}}\n",
        s.b,
        s.t,
        s.h,
        s.dk,
        s.dk,
        s.dv,
        s.default_scale(),
        r.ours_ms,
        r.min_ms,
        r.hbm_floor_ms,
        r.plan.num_segments,
        r.plan.chunks_per_segment,
        r.sets
    )
}

/// Writes `root/<row.dir>/{q,k,v,g,o}.bin` and `meta.json`.
fn write_dump(root: &Path, row: &Row, host: &HostInputs, o: &[bf16]) -> Result<()> {
    let path = root.join(&row.dir);
    std::fs::create_dir_all(&path).map_err(|e| io_error(&path, e))?;
    write_raw(&path.join("q.bin"), &host.q)?;
    write_raw(&path.join("k.bin"), &host.k)?;
    write_raw(&path.join("v.bin"), &host.v)?;
    write_raw(&path.join("g.bin"), &host.g)?;
    write_raw(&path.join("o.bin"), o)?;
    let meta = path.join("meta.json");
    std::fs::write(&meta, meta_json(row)).map_err(|e| io_error(&meta, e))
}

fn results_json(device: &str, sm_count: u32, warmup: usize, iters: usize, rows: &[Row]) -> String {
    let rows_json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"dir\": \"{}\", \"B\": {}, \"T\": {}, \"H\": {}, \"D\": {}, \"ours_ms\": {:.5}, \
                 \"ours_min_ms\": {:.5}, \"hbm_floor_ms\": {:.5}, \"floor_fraction\": {:.4}, \
                 \"num_segments\": {}, \"chunks_per_segment\": {}, \"workspace_bytes\": {}, \"sets\": {}{}}}",
                r.dir,
                r.shape.b,
                r.shape.t,
                r.shape.h,
                r.shape.dk,
                r.ours_ms,
                r.min_ms,
                r.hbm_floor_ms,
                r.hbm_floor_ms / r.ours_ms,
                r.plan.num_segments,
                r.plan.chunks_per_segment,
                r.plan.workspace_bytes,
                r.sets,
                r.probes_ms
                    .iter()
                    .map(|(probe, ms)| format!(", \"{}_ms\": {ms:.5}", probe.label()))
                    .chain(r.backward_ms.map(|(ms, min_ms, floor_ms)| format!(
                        ", \"backward_ms\": {ms:.5}, \"backward_min_ms\": {min_ms:.5}, \
                         \"backward_hbm_floor_ms\": {floor_ms:.5}"
                    )))
                    .collect::<String>()
            )
        })
        .collect();
    let probes_note = if rows.iter().any(|r| !r.probes_ms.is_empty()) {
        "  \"probes\": \"output_ms: the output kernel alone (no states pass, no fold); probe_memory_ms: its loads and O stores without math; probe_compute_ms: its math on pipeline stages loaded once (no input HBM traffic); probe_no_exp_ms: probe_compute without the gate exponentials, mask and scalings; same launch shape, timing method and input sets as ours_ms (kernels/docs/scalar-decay.md, Probes)\",\n"
    } else {
        ""
    };
    format!(
        "{{\n  \"device\": \"{device}\",\n  \"sm_count\": {sm_count},\n  \"commit\": \"{}\",\n  \"date\": \"{}\",\n  \
         \"hbm_bytes_per_s\": {HBM_BYTES_PER_S:e},\n  \"hbm_floor\": \"(q, k, v read once + o written once, bf16) / 4.3e12 B/s, the device-to-device copy rate measured on the reference H200 image; gates (0.4%) not counted\",\n  \
         \"method\": \"{} warm-up calls, then {} calls enqueued back to back on one stream, each between two CUDA events; median\",\n{probes_note}  \
         \"shapes\": [\n{}\n  ]\n}}\n",
        std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        std::env::var("LASP_DATE").unwrap_or_else(|_| "unknown".into()),
        warmup,
        iters,
        rows_json.join(",\n")
    )
}

fn run(opts: &Options) -> Result<()> {
    let rt = Runtime::init(Config {
        symmetric_heap_bytes: 1 << 20,
        ..Config::default()
    })?;
    let stream = rt.stream().clone();
    let device = rt.context().name()?;
    let l2_bytes = rt
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?
        .max(0) as usize;
    let mut fwd = ScalarDecayForward::new(&rt)?;
    fwd.set_num_segments(opts.segments)?;
    let mut bwd = opts
        .backward
        .then(|| ScalarDecayBackward::new(&rt))
        .transpose()?;
    if let Some(bwd) = bwd.as_mut() {
        bwd.forward_mut().set_num_segments(opts.segments)?;
        if let Some(ctas) = opts.target_ctas {
            bwd.forward_mut().set_target_ctas(ctas)?;
        }
    }
    if let Some(ctas) = opts.target_ctas {
        fwd.set_target_ctas(ctas)?;
    }
    println!(
        "forward_bench: {device}, {} SMs, L2 {} MB",
        fwd.sm_count(),
        l2_bytes >> 20
    );
    let mut rows = Vec::new();
    for &(b, t, h, d) in &opts.shapes {
        let shape = ForwardShape {
            b,
            t,
            h,
            dk: d,
            dv: d,
        };
        let row = bench_shape(&mut fwd, bwd.as_mut(), &stream, shape, opts, l2_bytes)?;
        println!(
            "B={b} T={t} H={h} D={d}: ours {:.4} ms (min {:.4}, S={}, {} output kernel, {} input set(s)), HBM floor {:.4} ms = {:.2} of ours",
            row.ours_ms,
            row.min_ms,
            row.plan.num_segments,
            row.plan.output_kind(),
            row.sets,
            row.hbm_floor_ms,
            row.hbm_floor_ms / row.ours_ms
        );
        if !row.probes_ms.is_empty() {
            let probes: Vec<String> = row
                .probes_ms
                .iter()
                .map(|(probe, ms)| format!("{} {ms:.4} ms", probe.label()))
                .collect();
            println!("  {}", probes.join(", "));
        }
        if let Some((ms, min_ms, floor_ms)) = row.backward_ms {
            println!(
                "  backward {ms:.4} ms (min {min_ms:.4}), {:.2}x the forward, HBM floor {floor_ms:.4} ms = {:.2} of it",
                ms / row.ours_ms,
                floor_ms / ms
            );
        }
        rows.push(row);
    }
    let json = results_json(&device, fwd.sm_count(), opts.warmup, opts.iters, &rows);
    if let Some(root) = &opts.dump {
        let path = root.join("ours.json");
        std::fs::write(&path, &json).map_err(|e| io_error(&path, e))?;
    }
    match &opts.out {
        Some(path) => std::fs::write(path, &json).map_err(|e| io_error(path, e))?,
        None if opts.dump.is_none() => print!("{json}"),
        None => {}
    }
    drop(bwd);
    drop(fwd);
    rt.shutdown()
}

fn main() {
    let opts = match parse_options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("forward_bench: {e}");
            std::process::exit(2);
        }
    };
    let timeout_s = opts.timeout_s;
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(timeout_s));
        eprintln!("forward_bench: still running after {timeout_s} s (a kernel hung?); giving up");
        lasp_shmem::runtime::exit_after_error(1);
    });
    if let Err(e) = run(&opts) {
        eprintln!("forward_bench: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lasp_shmem::reference::{scalar_decay, Inputs, Shape, Tensor};

    /// The dump a GPU run writes, with the CPU reference standing in for our output: checks the
    /// writer (files, sizes, JSON) and, with FORWARD_BENCH_TEST_DUMP=DIR set, leaves the dump
    /// there so benches/fla_forward.py can be exercised against it.
    #[test]
    fn dump_layout_and_inputs() {
        let shape = ForwardShape {
            b: 2,
            t: 130,
            h: 3,
            dk: 64,
            dv: 64,
        };
        let host = generate(&shape, 0);
        assert_eq!(host.q, generate(&shape, 0).q, "generation is deterministic");
        assert_ne!(host.q, generate(&shape, 1).q, "input sets differ");
        assert!(host.g.iter().all(|g| g.is_finite() && *g <= 0.0));
        let mean_g = host.g.iter().sum::<f32>() / host.g.len() as f32;
        // E[logsigmoid(N(0,1))] / 16 = -0.0503 ± sampling noise.
        assert!((mean_g + 0.0503).abs() < 0.01, "mean gate {mean_g}");
        let q: Vec<f64> = host.q.iter().map(|x| x.to_f64()).collect();
        let var = q.iter().map(|x| x * x).sum::<f64>() / q.len() as f64;
        assert!((var - 1.0).abs() < 0.05, "var(q) = {var}");

        let rs = Shape {
            b: shape.b,
            t: shape.t,
            h: shape.h,
            dk: shape.dk,
            dv: shape.dv,
        };
        let tensor = |dims: Vec<usize>, data: Vec<f64>| Tensor::from_vec(&dims, data).unwrap();
        let inputs = Inputs {
            shape: rs,
            q: tensor(rs.qk(), q),
            k: tensor(rs.qk(), host.k.iter().map(|x| x.to_f64()).collect()),
            v: tensor(rs.v(), host.v.iter().map(|x| x.to_f64()).collect()),
            g: tensor(
                rs.per_token(),
                host.g.iter().map(|&x| f64::from(x)).collect(),
            ),
            beta: None,
            h0: None,
            scale: f64::from(shape.default_scale()),
        };
        let want = scalar_decay::chunkwise_forward(&inputs, 64).unwrap();
        let o: Vec<bf16> = want.o.data().iter().map(|&x| bf16::from_f64(x)).collect();

        let row = Row {
            shape,
            dir: "B2_T130_H3_D64".into(),
            ours_ms: 0.5,
            min_ms: 0.4,
            hbm_floor_ms: 0.25,
            plan: ForwardPlan::new(&shape, 132, None).unwrap(),
            sets: 1,
            probes_ms: vec![(OutputProbe::Output, 0.3), (OutputProbe::Memory, 0.2)],
            backward_ms: Some((1.25, 1.2, 0.5)),
        };
        let keep = std::env::var_os("FORWARD_BENCH_TEST_DUMP").map(PathBuf::from);
        let root = keep.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("forward-bench-test-{}", std::process::id()))
        });
        write_dump(&root, &row, &host, &o).unwrap();
        let json = results_json("test device", 132, 10, 50, std::slice::from_ref(&row));
        std::fs::write(root.join("ours.json"), &json).unwrap();
        let size = |name: &str| {
            std::fs::metadata(root.join(&row.dir).join(name))
                .unwrap()
                .len()
        };
        assert_eq!(size("q.bin"), 2 * shape.qk_len() as u64);
        assert_eq!(size("v.bin"), 2 * shape.v_len() as u64);
        assert_eq!(size("g.bin"), 4 * shape.gate_len() as u64);
        assert_eq!(size("o.bin"), 2 * shape.v_len() as u64);
        // Raw little-endian: the first q value's bytes.
        let bytes = std::fs::read(root.join(&row.dir).join("q.bin")).unwrap();
        assert_eq!(
            u16::from_le_bytes([bytes[0], bytes[1]]),
            host.q[0].to_bits()
        );
        let meta = std::fs::read_to_string(root.join(&row.dir).join("meta.json")).unwrap();
        for text in [&meta, &json] {
            assert_eq!(text.matches('{').count(), text.matches('}').count());
            assert!(!text.contains("NaN") && !text.contains("inf"), "{text}");
        }
        assert!(
            meta.contains("\"B\": 2, \"T\": 130, \"H\": 3, \"D\": 64"),
            "{meta}"
        );
        assert!(json.contains("\"dir\": \"B2_T130_H3_D64\""), "{json}");
        assert!(
            json.contains(
                "\"backward_ms\": 1.25000, \"backward_min_ms\": 1.20000, \"backward_hbm_floor_ms\": 0.50000"
            ),
            "{json}"
        );
        assert!(
            json.contains("\"sets\": 1, \"output_ms\": 0.30000, \"probe_memory_ms\": 0.20000, ")
                && json.contains("\"probes\": "),
            "{json}"
        );
        if keep.is_none() {
            std::fs::remove_dir_all(&root).unwrap();
        }
    }
}
