//! The device-initiated all-gather against NCCL's all-gather of the same bytes, in one run, plus
//! the device ping-pong. Run under a launcher on every GPU of a node:
//!
//! ```text
//! lasp-run -n 4 target/release/exchange_bench --out benches/results/exchange.json
//! ```
//!
//! Each timed iteration is: an on-stream barrier, a start event, the collective, an end event.
//! Per rank the median over iterations is taken; the reported time is the maximum over ranks of
//! those medians (the collective is done when its slowest rank is).
//!
//! Options: `--sizes 32K,1M` (bytes per rank), `--sweep-ctas 16,32,64` (also time these CTA
//! counts), `--variant NAME` (dynamic, the default, cta-loop or peer-major), `--threads N`
//! (threads per CTA), `--chunk BYTES` (the dynamic variant's work item), and two diagnostics that
//! add to the output without changing the numbers above:
//!  - `--floor`: time a kernel that does nothing, launched with a round's shape and parameters in
//!    the same harness: the harness's and the launch's own cost under every round;
//!  - `--batch N`: also time N back-to-back rounds between one pair of events, with no barrier
//!    between them (as nccl-tests do), for both ours and NCCL; per round = total / N.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaStream, DevicePtr};
use lasp_shmem::exchange::{AllGather, AllGatherVariant, PingPong};
use lasp_shmem::launch_env::LaunchEnv;
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::units::{format_bytes, parse_byte_list};
use lasp_shmem::{Config, Error, Result, Runtime};
use std::sync::Arc;

const WARMUP: usize = 10;
const ITERATIONS: usize = 100;
/// Repetitions of a `--batch` measurement (each one barrier, then N rounds).
const BATCH_REPETITIONS: usize = 20;

struct Options {
    out: Option<String>,
    sizes: Vec<usize>,
    sweep: Vec<u32>,
    variant: AllGatherVariant,
    threads: Option<u32>,
    chunk_bytes: Option<usize>,
    floor: bool,
    batch: Option<usize>,
}

struct Row {
    bytes: usize,
    /// (CTAs, threads per CTA) of our rounds.
    shape: (u32, u32),
    ours_us: f64,
    nccl_us: f64,
    floor_us: Option<f64>,
    ours_batch_us: Option<f64>,
    nccl_batch_us: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median microseconds of `op` over ITERATIONS, each after an on-stream barrier.
fn time_collective(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    mut op: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..WARMUP {
        rt.barrier_on_stream(stream)?;
        op()?;
    }
    let mut samples = Vec::with_capacity(ITERATIONS);
    for _ in 0..ITERATIONS {
        rt.barrier_on_stream(stream)?;
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        op()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        samples.push(start.elapsed_ms(&end)? as f64 * 1e3);
    }
    Ok(median(samples))
}

/// Median microseconds per call of `rounds` back-to-back calls of `op` between one pair of
/// events (a barrier before each repetition, none between the calls): what a stream of
/// collectives costs per call once launch gaps and rank skew overlap with the previous call.
fn time_batch(
    rt: &Runtime,
    stream: &Arc<CudaStream>,
    rounds: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<f64> {
    rt.barrier_on_stream(stream)?;
    for _ in 0..rounds {
        op()?;
    }
    let mut samples = Vec::with_capacity(BATCH_REPETITIONS);
    for _ in 0..BATCH_REPETITIONS {
        rt.barrier_on_stream(stream)?;
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for _ in 0..rounds {
            op()?;
        }
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        samples.push(start.elapsed_ms(&end)? as f64 * 1e3 / rounds as f64);
    }
    Ok(median(samples))
}

/// NCCL's in-place all-gather (send buffer = this rank's block of the receive buffer), which,
/// like ours, moves only the peers' bytes: single-shot microseconds, and per call in batches of
/// `batch` if asked.
fn nccl_in_place_all_gather_us(
    rt: &Runtime,
    comm: &NcclComm,
    stream: &Arc<CudaStream>,
    bytes: usize,
    batch: Option<usize>,
) -> Result<(f64, Option<f64>)> {
    let recv = stream.alloc_zeros::<u8>(bytes * rt.npes())?;
    let base = recv.device_ptr(stream).0;
    // SAFETY: `recv` holds npes blocks of `bytes` and outlives the timed calls.
    let mut all_gather = || unsafe { comm.all_gather_in_place(stream, base, bytes) };
    let single = time_collective(rt, stream, &mut all_gather)?;
    let batched = batch
        .map(|rounds| time_batch(rt, stream, rounds, &mut all_gather))
        .transpose()?;
    Ok((single, batched))
}

fn parse_options() -> Result<Options> {
    let mut o = Options {
        out: None,
        sizes: parse_byte_list("32K,256K,1M,2M,4M,8M,32M")?,
        sweep: Vec::new(),
        variant: AllGatherVariant::DEFAULT,
        threads: None,
        chunk_bytes: None,
        floor: false,
        batch: None,
    };
    let usage = "usage: exchange_bench [--out FILE] [--sizes 32K,1M] [--sweep-ctas 16,32,64] \
                 [--variant cta-loop|peer-major|dynamic] [--threads N] [--chunk BYTES] [--floor] [--batch N]";
    let number = |flag: &str, v: &str| {
        v.parse::<u32>()
            .map_err(|_| Error::InvalidArgument(format!("{flag} {v}: not a number")))
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--floor" {
            o.floor = true;
            continue;
        }
        let Some(value) = args.next() else {
            return Err(Error::InvalidArgument(format!(
                "{usage} ({flag} needs a value)"
            )));
        };
        match flag.as_str() {
            "--out" => o.out = Some(value),
            "--sizes" => o.sizes = parse_byte_list(&value)?,
            "--sweep-ctas" => {
                o.sweep = value
                    .split(',')
                    .map(|v| number(&flag, v))
                    .collect::<Result<_>>()?
            }
            "--variant" => o.variant = AllGatherVariant::from_name(&value)?,
            "--threads" => o.threads = Some(number(&flag, &value)?),
            "--chunk" => {
                let chunk = parse_byte_list(&value)?;
                o.chunk_bytes = chunk.first().copied().filter(|_| chunk.len() == 1);
                if o.chunk_bytes.is_none() {
                    return Err(Error::InvalidArgument(format!("--chunk {value}: one size")));
                }
            }
            "--batch" => match number(&flag, &value)? {
                0 => {
                    return Err(Error::InvalidArgument(
                        "--batch 0: give at least 1 round".into(),
                    ))
                }
                rounds => o.batch = Some(rounds as usize),
            },
            _ => return Err(Error::InvalidArgument(format!("{usage} (got {flag})"))),
        }
    }
    Ok(o)
}

/// An all-gather of `bytes` per rank with the kernel and shape the options ask for.
fn all_gather(rt: &Runtime, o: &Options, bytes: usize) -> Result<AllGather> {
    let mut gather = AllGather::new(rt, bytes)?;
    gather.set_variant(o.variant)?;
    if let Some(threads) = o.threads {
        gather.set_threads(threads)?;
    }
    if let Some(chunk) = o.chunk_bytes {
        gather.set_chunk_bytes(chunk)?;
    }
    Ok(gather)
}

fn run() -> Result<()> {
    let o = parse_options()?;
    let npes = LaunchEnv::from_process_env()?.world_size;
    let largest = o.sizes.iter().copied().max().unwrap_or(1);
    let rt = Runtime::init(Config {
        symmetric_heap_bytes: AllGather::symmetric_bytes(largest, npes) + (1 << 20),
        ..Config::default()
    })?;
    let stream = rt.stream().clone();
    let comm = NcclComm::new(&rt, &stream)?;
    let non_default_kernel =
        o.variant != AllGatherVariant::DEFAULT || o.threads.is_some() || o.chunk_bytes.is_some();
    if rt.pe() == 0 && non_default_kernel {
        println!(
            "variant {}, {} threads per CTA{}",
            o.variant.name(),
            o.threads.map_or("default".to_string(), |t| t.to_string()),
            o.chunk_bytes.map_or(String::new(), |c| format!(
                ", chunks of {}",
                format_bytes(c)
            ))
        );
    }

    let mut rows = Vec::new();
    for &bytes in &o.sizes {
        let mut gather = all_gather(&rt, &o, bytes)?;
        gather.fill_pattern(&stream)?;
        let shape = gather.launch_shape();
        let ours = time_collective(&rt, &stream, || gather.launch(&stream))?;
        let floor = o
            .floor
            .then(|| time_collective(&rt, &stream, || gather.launch_floor(&stream)))
            .transpose()?;
        let ours_batch = o
            .batch
            .map(|rounds| time_batch(&rt, &stream, rounds, || gather.launch(&stream)))
            .transpose()?;
        gather.finish(&stream)?;
        for &ctas in &o.sweep {
            gather.set_ctas(ctas)?;
            let (launched, _) = gather.launch_shape();
            let us = time_collective(&rt, &stream, || gather.launch(&stream))?;
            gather.finish(&stream)?;
            let us = comm.max_f64(us)?;
            if rt.pe() == 0 {
                println!(
                    "sweep {:>7}/rank {ctas:>3} CTAs ({launched} launched): {us:8.1} us ({:6.1} GB/s egress)",
                    format_bytes(bytes),
                    egress_gbps(bytes, rt.npes(), us)
                );
            }
        }
        gather.free()?;

        let (nccl, nccl_batch) = nccl_in_place_all_gather_us(&rt, &comm, &stream, bytes, o.batch)?;
        let max_over_ranks = |v: Option<f64>| v.map(|v| comm.max_f64(v)).transpose();
        let row = Row {
            bytes,
            shape,
            ours_us: comm.max_f64(ours)?,
            nccl_us: comm.max_f64(nccl)?,
            floor_us: max_over_ranks(floor)?,
            ours_batch_us: max_over_ranks(ours_batch)?,
            nccl_batch_us: max_over_ranks(nccl_batch)?,
        };
        if rt.pe() == 0 {
            println!(
                "all-gather {:>7}/rank: device {:8.1} us ({:6.1} GB/s egress)  NCCL {:8.1} us  speedup {:.2}x",
                format_bytes(bytes),
                row.ours_us,
                egress_gbps(bytes, rt.npes(), row.ours_us),
                row.nccl_us,
                row.nccl_us / row.ours_us
            );
            if let Some(floor) = row.floor_us {
                println!(
                    "  harness floor {floor:6.1} us (empty kernel, {} CTAs x {} threads); device above it {:6.1} us",
                    shape.0,
                    shape.1,
                    row.ours_us - floor
                );
            }
            if let (Some(ours), Some(nccl), Some(rounds)) =
                (row.ours_batch_us, row.nccl_batch_us, o.batch)
            {
                println!(
                    "  batch of {rounds}: device {ours:8.1} us/round ({:6.1} GB/s egress)  NCCL {nccl:8.1} us/round  speedup {:.2}x",
                    egress_gbps(bytes, rt.npes(), ours),
                    nccl / ours
                );
            }
        }
        rows.push(row);
    }

    let pingpong_us = if rt.npes() >= 2 {
        let pp = PingPong::new(&rt)?;
        let rounds = 10_000;
        pp.launch(&stream, 100)?;
        let mut samples = Vec::new();
        for _ in 0..5 {
            rt.barrier_on_stream(&stream)?;
            let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            pp.launch(&stream, rounds)?;
            let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
            pp.finish(&stream)?;
            samples.push(start.elapsed_ms(&end)? as f64 * 1e3 / rounds as f64);
        }
        pp.free()?;
        let rtt = median(samples);
        if rt.pe() == 0 {
            println!("device ping-pong PE 0 <-> PE 1: {rtt:.2} us round trip");
        }
        Some(rtt)
    } else {
        None
    };

    if rt.pe() == 0 {
        let device = format!("{} x{}", rt.context().name()?, rt.npes());
        let json = results_json(&device, rt.npes(), &o, &rows, pingpong_us);
        match &o.out {
            Some(path) => std::fs::write(path, &json)
                .map_err(|e| Error::State(format!("cannot write {path}: {e}")))?,
            None => println!("{json}"),
        }
    }
    drop(comm);
    rt.shutdown()
}

fn egress_gbps(bytes: usize, npes: usize, us: f64) -> f64 {
    (bytes * (npes - 1)) as f64 / (us * 1e-6) / 1e9
}

/// `"key": value` pairs of the optional diagnostics, each with a leading comma (empty when the
/// diagnostic was not asked for).
fn optional_fields(fields: &[(&str, Option<f64>)]) -> String {
    fields
        .iter()
        .filter_map(|(key, value)| value.map(|v| format!(", \"{key}\": {v:.3}")))
        .collect()
}

/// The results file: `device` names the GPUs ("NVIDIA H200 x4"), `npes` the ranks.
fn results_json(
    device: &str,
    npes: usize,
    o: &Options,
    rows: &[Row],
    pingpong_us: Option<f64>,
) -> String {
    let at = |size: usize| rows.iter().find(|r| r.bytes == size);
    let num = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.4}"));
    let rows_json: Vec<String> = rows
        .iter()
        .map(|r| {
            let batch_speedup = r.ours_batch_us.zip(r.nccl_batch_us).map(|(ours, nccl)| nccl / ours);
            format!(
                "    {{\"bytes_per_rank\": {}, \"device_us\": {:.3}, \"nccl_us\": {:.3}, \"speedup_vs_nccl\": {:.4}, \"egress_gbps\": {:.2}, \"ctas\": {}{}}}",
                r.bytes,
                r.ours_us,
                r.nccl_us,
                r.nccl_us / r.ours_us,
                egress_gbps(r.bytes, npes, r.ours_us),
                r.shape.0,
                optional_fields(&[
                    ("harness_floor_us", r.floor_us),
                    ("device_batch_us", r.ours_batch_us),
                    ("nccl_batch_us", r.nccl_batch_us),
                    ("speedup_vs_nccl_batch", batch_speedup),
                ])
            )
        })
        .collect();
    // The floor under the largest round: its launch is the shape the big sizes use.
    let floor_of_largest = rows.iter().max_by_key(|r| r.bytes).and_then(|r| r.floor_us);
    let mut method = format!(
        "in-place all-gather on both sides (own block not copied); per rank median of {ITERATIONS} iterations after {WARMUP} warm-up, each after an on-stream barrier, CUDA events; max over ranks"
    );
    if o.floor {
        method.push_str("; harness_floor_us: an empty kernel of the round's shape and parameters in the same harness (top level: at the largest size)");
    }
    if let Some(rounds) = o.batch {
        method.push_str(&format!("; *_batch_us: {rounds} back-to-back calls between one pair of events, no barrier between them, per call, median of {BATCH_REPETITIONS} repetitions each after a barrier, max over ranks"));
    }
    format!(
        "{{\n  \"device\": \"{device}\",\n  \"commit\": \"{}\",\n  \"date\": \"{}\",\n  \"W\": {},\n  \"variant\": \"{}\",\n  \"threads_per_cta\": {},\n  \"method\": \"{method}\",\n  \"gbps_egress_8MiB\": {},\n  \"pingpong_rtt_us\": {},\n  \"speedup_vs_nccl_1MiB\": {},\n  \"speedup_vs_nccl_4MiB\": {},{}{}\n  \"rows\": [\n{}\n  ]\n}}\n",
        std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        std::env::var("LASP_DATE").unwrap_or_else(|_| "unknown".into()),
        npes,
        o.variant.name(),
        rows.first().map_or(0, |r| r.shape.1),
        num(at(8 << 20).map(|r| egress_gbps(r.bytes, npes, r.ours_us))),
        num(pingpong_us),
        num(at(1 << 20).map(|r| r.nccl_us / r.ours_us)),
        num(at(4 << 20).map(|r| r.nccl_us / r.ours_us)),
        floor_of_largest.map_or(String::new(), |v| format!("\n  \"harness_floor_us\": {v:.3},")),
        o.batch.map_or(String::new(), |n| format!("\n  \"batch_rounds\": {n},")),
        rows_json.join(",\n")
    )
}

fn main() {
    if let Err(e) = run() {
        eprintln!("exchange_bench: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(floor: bool, batch: Option<usize>) -> Options {
        Options {
            out: None,
            sizes: vec![1 << 20, 8 << 20],
            sweep: Vec::new(),
            variant: AllGatherVariant::PeerMajor,
            threads: None,
            chunk_bytes: None,
            floor,
            batch,
        }
    }

    fn row(bytes: usize, diagnostics: bool) -> Row {
        Row {
            bytes,
            shape: (63, 512),
            ours_us: 20.0,
            nccl_us: 40.0,
            floor_us: diagnostics.then_some(5.0),
            ours_batch_us: diagnostics.then_some(16.0),
            nccl_batch_us: diagnostics.then_some(32.0),
        }
    }

    #[test]
    fn default_results_have_no_diagnostic_fields() {
        let rows = [row(1 << 20, false), row(8 << 20, false)];
        let json = results_json("GPU x4", 4, &options(false, None), &rows, Some(1.8));
        for absent in ["harness_floor_us", "batch"] {
            assert!(!json.contains(absent), "{absent} in {json}");
        }
        assert!(json.contains("\"speedup_vs_nccl_1MiB\": 2.0000"), "{json}");
        assert!(json.contains("\"variant\": \"peer-major\""), "{json}");
        assert!(json.contains("\"ctas\": 63}"), "{json}");
        // 3 x 8 MiB in 20 us.
        assert!(json.contains("\"gbps_egress_8MiB\": 1258.2912"), "{json}");
    }

    #[test]
    fn floor_and_batch_add_fields_without_changing_the_single_shot_numbers() {
        let rows = [row(1 << 20, true), row(8 << 20, true)];
        let json = results_json("GPU x4", 4, &options(true, Some(20)), &rows, None);
        for present in [
            "\"harness_floor_us\": 5.000,",
            "\"batch_rounds\": 20,",
            "\"device_us\": 20.000",
            "\"device_batch_us\": 16.000, \"nccl_batch_us\": 32.000, \"speedup_vs_nccl_batch\": 2.000}",
            "\"pingpong_rtt_us\": null",
        ] {
            assert!(json.contains(present), "{present} not in {json}");
        }
        // Balanced braces and brackets, and no trailing comma before a closing one.
        let depth = json.chars().fold(0i32, |d, c| match c {
            '{' | '[' => d + 1,
            '}' | ']' => d - 1,
            _ => d,
        });
        assert_eq!(depth, 0);
        assert!(!json.contains(",\n  ]") && !json.contains(",}") && !json.contains(", }"));
    }
}
