//! What the benchmark programs share: the inputs they generate (a fixed-seed host PRNG, filled
//! in parallel), how they time a call (CUDA events around each of many back-to-back calls, the
//! median), the options of the per-family timing programs and where they write their results,
//! and how they write raw tensors for the Python side to read.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::reference::SplitMix64;
use lasp_shmem::{Config, Error, Result};
use lasp_shmem_examples::parse_shape;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const SEED: u64 = 0x5EED_F0D0;

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
pub fn fill_parallel<T: Send>(out: &mut [T], tensor: u64, f: impl Fn(f32) -> T + Sync) {
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

/// `len` values `f(normal)` of tensor `tensor`, filled by [`fill_parallel`].
pub fn generated<T: Default + Clone + Send>(
    len: usize,
    tensor: u64,
    f: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    let mut out = vec![T::default(); len];
    fill_parallel(&mut out, tensor, f);
    out
}

/// `log(sigmoid(x))` without overflow: fla's benchmark gates are `logsigmoid(N(0, 1)) / 16`.
pub fn logsigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

/// The options of a family's single-GPU timing program (`gla_bench`, `gated_delta_bench`), for
/// its `#[command(flatten)]`.
#[derive(clap::Args, Debug)]
pub struct TimingOptions {
    /// Shapes to time, comma-separated (Dk = Dv = D).
    #[arg(long, value_name = "BxTxHxD,...", value_parser = parse_shape, value_delimiter = ',',
          default_values = ["4x8192x16x128", "1x32768x16x128", "1x131072x16x128"])]
    pub shapes: Vec<ForwardShape>,
    /// Dump each shape's inputs and outputs under DIR, and DIR/ours.json.
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
    /// Write the results JSON here (else DIR/ours.json with --dump, else standard output).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Untimed calls first (at least one runs).
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub warmup: usize,
    /// Timed calls (0 counts as 1).
    #[arg(long, value_name = "N", default_value_t = 50)]
    iters: usize,
    /// Give up (exit 1) after this many seconds (a kernel hung?).
    #[arg(long = "timeout", value_name = "SECONDS", default_value_t = 480)]
    pub timeout_s: u64,
}

impl TimingOptions {
    /// Timed calls, at least one.
    pub fn iters(&self) -> usize {
        self.iters.max(1)
    }

    /// The results' `method`: how each value was timed.
    pub fn method(&self) -> String {
        format!(
            "{} warm-up calls, then {} calls enqueued back to back on one stream, each between two \
             CUDA events; median",
            self.warmup.max(1),
            self.iters()
        )
    }

    /// Writes the results JSON to --out, else to DIR/ours.json with --dump, else to standard
    /// output.
    pub fn write_results(&self, json: &str) -> Result<()> {
        let path = match (&self.out, &self.dump) {
            (Some(path), _) => path.clone(),
            (None, Some(root)) => root.join("ours.json"),
            (None, None) => {
                print!("{json}");
                return Ok(());
            }
        };
        std::fs::write(&path, json).map_err(|e| io_error(&path, e))
    }
}

/// `warmup` calls (at least one), then `iters` calls enqueued back to back, each between two CUDA
/// events; `call(i)` enqueues call i. Returns (median, minimum) in ms.
pub fn time_calls(
    stream: &Arc<CudaStream>,
    warmup: usize,
    iters: usize,
    mut call: impl FnMut(usize) -> Result<()>,
) -> Result<(f64, f64)> {
    for i in 0..warmup.max(1) {
        call(i)?;
    }
    stream.synchronize()?;
    let mut events = Vec::with_capacity(iters);
    for i in 0..iters {
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

/// The median of `v` (the mean of the two middle values for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// An error naming the file that could not be written.
pub fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::State(format!(
        "cannot write {}: {e}; check that the dump directory's disk has room (the 128K shape \
         needs about 2.2 GB)",
        path.display()
    ))
}

/// Writes the raw little-endian bytes of a bf16 or f32 buffer.
pub fn write_raw<T: Copy>(path: &Path, data: &[T]) -> Result<()> {
    const { assert!(cfg!(target_endian = "little")) };
    // SAFETY: bf16 and f32 are plain old data without padding; the bytes are their
    // little-endian representation on this (little-endian) host.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
    };
    let mut f = std::fs::File::create(path).map_err(|e| io_error(path, e))?;
    f.write_all(bytes).map_err(|e| io_error(path, e))
}

/// The body of a single-GPU benchmark program's `main`: the runtime's settings from the
/// environment with a small symmetric heap (the programs exchange nothing), exported to NVSHMEM
/// first; a watchdog that ends the process after `timeout_s` (a kernel hung?); then `run`.
/// Exits 2 on bad settings and 1 when `run` fails, naming `program`.
pub fn bench_main(program: &str, timeout_s: u64, run: impl FnOnce(Config) -> Result<()>) {
    let config = Config::from_env().and_then(|base| {
        let config = Config {
            symmetric_heap_bytes: 1 << 20,
            ..base
        };
        // SAFETY: called first thing in main, before the watchdog thread below: no thread has
        // been started and no CUDA call made.
        unsafe { lasp_shmem_examples::export_nvshmem_env(&config) }.map(|_| config)
    });
    let config = match config {
        Ok(config) => config,
        Err(e) => {
            eprintln!("{program}: {e}");
            std::process::exit(2);
        }
    };
    let name = program.to_string();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(timeout_s));
        eprintln!("{name}: still running after {timeout_s} s (a kernel hung?); giving up");
        lasp_shmem::runtime::exit_after_error(1);
    });
    if let Err(e) = run(config) {
        eprintln!("{program}: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}
