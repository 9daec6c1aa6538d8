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

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaStream, DevicePtr};
use lasp_shmem::exchange::transport::{AllGather, AllGatherVariant, PingPong};
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::units::{format_bytes, parse_bytes};
use lasp_shmem_examples::{export_nvshmem_env, round, to_json};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

const WARMUP: usize = 10;
const ITERATIONS: usize = 100;
/// Repetitions of a `--batch` measurement (each one barrier, then N rounds).
const BATCH_REPETITIONS: usize = 20;

/// The device-initiated all-gather against NCCL's all-gather of the same bytes, plus the device
/// ping-pong; JSON results to --out (else standard output).
#[derive(Parser, Debug)]
#[command(name = "exchange_bench")]
struct Options {
    /// Write the JSON results here (rank 0) instead of printing them.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Bytes per rank, comma-separated (K, M, G suffixes).
    #[arg(long, value_name = "LIST", value_parser = parse_bytes, value_delimiter = ',',
          default_values = ["32K", "256K", "1M", "2M", "4M", "8M", "32M"])]
    sizes: Vec<usize>,
    /// Also time these CTA counts, comma-separated.
    #[arg(long = "sweep-ctas", value_name = "LIST", value_delimiter = ',')]
    sweep: Vec<u32>,
    /// The all-gather kernel: dynamic (the default), cta-loop or peer-major.
    #[arg(long, value_name = "NAME", value_parser = AllGatherVariant::from_name,
          default_value = AllGatherVariant::DEFAULT.name())]
    variant: AllGatherVariant,
    /// Threads per CTA.
    #[arg(long, value_name = "N")]
    threads: Option<u32>,
    /// The dynamic variant's work item (one size, K, M, G suffixes).
    #[arg(long = "chunk", value_name = "BYTES", value_parser = parse_bytes)]
    chunk_bytes: Option<usize>,
    /// Also time an empty kernel of a round's shape and parameters in the same harness.
    #[arg(long)]
    floor: bool,
    /// Also time N back-to-back rounds between one pair of events (per round = total / N).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    batch: Option<u64>,
}

struct Row {
    bytes: usize,
    /// (CTAs, threads per CTA) of our rounds.
    shape: (u32, u32),
    ours_us: f64,
    nccl_us: f64,
    /// NCCL's in-place all-gather on a registered symmetric window of its own memory, and of the
    /// device all-gather's NVSHMEM slots (None where NCCL refuses).
    nccl_window_us: Option<f64>,
    nccl_nvshmem_window_us: Option<f64>,
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
    batch: Option<u64>,
) -> Result<(f64, Option<f64>)> {
    let recv = stream.alloc_zeros::<u8>(bytes * rt.npes())?;
    let base = recv.device_ptr(stream).0;
    // SAFETY: `recv` holds npes blocks of `bytes` and outlives the timed calls.
    let mut all_gather = || unsafe { comm.all_gather_in_place(stream, base, bytes) };
    let single = time_collective(rt, stream, &mut all_gather)?;
    let batched = batch
        .map(|rounds| time_batch(rt, stream, rounds as usize, &mut all_gather))
        .transpose()?;
    Ok((single, batched))
}

/// NCCL's in-place all-gather on `bytes` per rank of a symmetric window: NCCL's own memory
/// (`NcclComm::window`), or the first parity of the device all-gather's NVSHMEM slots where
/// `nvshmem` is given, where NCCL's symmetric kernels may serve it: single-shot microseconds, or
/// None (with the reason on rank 0) where this NCCL cannot register it.
fn nccl_window_all_gather_us(
    rt: &Runtime,
    comm: &NcclComm,
    stream: &Arc<CudaStream>,
    bytes: usize,
    nvshmem: Option<&AllGather>,
) -> Result<Option<f64>> {
    let window = match nvshmem {
        // SAFETY: the slots are NVSHMEM's symmetric heap (cuMem), [2][npes][bytes], and outlive
        // the window (freed below, before the all-gather).
        Some(gather) => unsafe { comm.register_window(gather.slots().raw(), bytes * rt.npes()) },
        None => comm.window(bytes * rt.npes()),
    };
    let window = match window {
        Ok(window) => window,
        Err(e) => {
            if rt.pe() == 0 {
                println!("  NCCL window: {e}");
            }
            return Ok(None);
        }
    };
    let base = window.addr();
    // SAFETY: the window holds npes blocks of `bytes` and is freed only after the timed calls.
    let us = time_collective(rt, stream, || unsafe {
        comm.all_gather_in_place(stream, base, bytes)
    });
    window.free(comm)?;
    us.map(Some)
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

fn run(o: Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
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
            .map(|rounds| time_batch(&rt, &stream, rounds as usize, || gather.launch(&stream)))
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
        let nccl_nvshmem_window =
            nccl_window_all_gather_us(&rt, &comm, &stream, bytes, Some(&gather))?;
        gather.free()?;

        let (nccl, nccl_batch) = nccl_in_place_all_gather_us(&rt, &comm, &stream, bytes, o.batch)?;
        let nccl_window = nccl_window_all_gather_us(&rt, &comm, &stream, bytes, None)?;
        let max_over_ranks = |v: Option<f64>| v.map(|v| comm.max_f64(v)).transpose();
        let row = Row {
            bytes,
            shape,
            ours_us: comm.max_f64(ours)?,
            nccl_us: comm.max_f64(nccl)?,
            nccl_window_us: max_over_ranks(nccl_window)?,
            nccl_nvshmem_window_us: max_over_ranks(nccl_nvshmem_window)?,
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
            for (memory, window) in [
                ("its own memory", row.nccl_window_us),
                ("NVSHMEM's heap", row.nccl_nvshmem_window_us),
            ] {
                if let Some(us) = window {
                    println!(
                        "  NCCL on a symmetric window of {memory}: {us:8.1} us ({:.2}x the device all-gather's time)",
                        us / row.ours_us
                    );
                }
            }
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
        let json = to_json(&results(&device, rt.npes(), &o, &rows, pingpong_us));
        match &o.out {
            Some(path) => std::fs::write(path, &json)
                .map_err(|e| Error::State(format!("cannot write {}: {e}", path.display())))?,
            None => print!("{json}"),
        }
    }
    drop(comm);
    rt.shutdown()
}

fn egress_gbps(bytes: usize, npes: usize, us: f64) -> f64 {
    (bytes * (npes - 1)) as f64 / (us * 1e-6) / 1e9
}

/// The results file (top level).
#[derive(Serialize)]
struct Results {
    /// The GPUs ("NVIDIA H200 x4").
    device: String,
    commit: String,
    date: String,
    #[serde(rename = "W")]
    w: usize,
    variant: &'static str,
    threads_per_cta: u32,
    method: String,
    #[serde(rename = "gbps_egress_8MiB")]
    gbps_egress_8mib: Option<f64>,
    pingpong_rtt_us: Option<f64>,
    #[serde(rename = "speedup_vs_nccl_1MiB")]
    speedup_vs_nccl_1mib: Option<f64>,
    #[serde(rename = "speedup_vs_nccl_4MiB")]
    speedup_vs_nccl_4mib: Option<f64>,
    /// The floor under the largest round: its launch is the shape the big sizes use.
    #[serde(skip_serializing_if = "Option::is_none")]
    harness_floor_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_rounds: Option<u64>,
    rows: Vec<ResultRow>,
}

/// One size of the results file.
#[derive(Serialize)]
struct ResultRow {
    bytes_per_rank: usize,
    device_us: f64,
    nccl_us: f64,
    speedup_vs_nccl: f64,
    egress_gbps: f64,
    ctas: u32,
    /// NCCL's all-gather on a symmetric window of its own memory (`NcclComm::window`), and of
    /// NVSHMEM's heap, where NCCL registers them.
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_window_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_nvshmem_window_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    harness_floor_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_batch_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nccl_batch_us: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    speedup_vs_nccl_batch: Option<f64>,
}

/// The results file: `device` names the GPUs ("NVIDIA H200 x4"), `npes` the ranks.
fn results(
    device: &str,
    npes: usize,
    o: &Options,
    rows: &[Row],
    pingpong_us: Option<f64>,
) -> Results {
    let at = |size: usize| rows.iter().find(|r| r.bytes == size);
    let speedup_at = |size: usize| at(size).map(|r| round(r.nccl_us / r.ours_us, 4));
    let result_rows = rows
        .iter()
        .map(|r| ResultRow {
            bytes_per_rank: r.bytes,
            device_us: round(r.ours_us, 3),
            nccl_us: round(r.nccl_us, 3),
            speedup_vs_nccl: round(r.nccl_us / r.ours_us, 4),
            egress_gbps: round(egress_gbps(r.bytes, npes, r.ours_us), 2),
            ctas: r.shape.0,
            nccl_window_us: r.nccl_window_us.map(|v| round(v, 3)),
            nccl_nvshmem_window_us: r.nccl_nvshmem_window_us.map(|v| round(v, 3)),
            harness_floor_us: r.floor_us.map(|v| round(v, 3)),
            device_batch_us: r.ours_batch_us.map(|v| round(v, 3)),
            nccl_batch_us: r.nccl_batch_us.map(|v| round(v, 3)),
            speedup_vs_nccl_batch: r
                .ours_batch_us
                .zip(r.nccl_batch_us)
                .map(|(ours, nccl)| round(nccl / ours, 3)),
        })
        .collect();
    let floor_of_largest = rows.iter().max_by_key(|r| r.bytes).and_then(|r| r.floor_us);
    let mut method = format!(
        "in-place all-gather on both sides (own block not copied); per rank median of {ITERATIONS} iterations after {WARMUP} warm-up, each after an on-stream barrier, CUDA events; max over ranks; nccl_window_us, nccl_nvshmem_window_us: NCCL's on ncclMemAlloc memory or on the device all-gather's NVSHMEM slots registered as a symmetric window (NCCL_WIN_COLL_SYMMETRIC), where NCCL registers them"
    );
    if o.floor {
        method.push_str("; harness_floor_us: an empty kernel of the round's shape and parameters in the same harness (top level: at the largest size)");
    }
    if let Some(rounds) = o.batch {
        method.push_str(&format!("; *_batch_us: {rounds} back-to-back calls between one pair of events, no barrier between them, per call, median of {BATCH_REPETITIONS} repetitions each after a barrier, max over ranks"));
    }
    Results {
        device: device.into(),
        commit: std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        date: std::env::var("LASP_DATE").unwrap_or_else(|_| "unknown".into()),
        w: npes,
        variant: o.variant.name(),
        threads_per_cta: rows.first().map_or(0, |r| r.shape.1),
        method,
        gbps_egress_8mib: at(8 << 20).map(|r| round(egress_gbps(r.bytes, npes, r.ours_us), 4)),
        pingpong_rtt_us: pingpong_us.map(|v| round(v, 4)),
        speedup_vs_nccl_1mib: speedup_at(1 << 20),
        speedup_vs_nccl_4mib: speedup_at(4 << 20),
        harness_floor_us: floor_of_largest.map(|v| round(v, 3)),
        batch_rounds: o.batch,
        rows: result_rows,
    }
}

fn main() {
    let o = Options::parse();
    let prepared = lasp_shmem::launch_env::LaunchEnv::from_process_env()
        .and_then(|env| {
            let largest = o.sizes.iter().copied().max().unwrap_or(1);
            Ok(Config {
                symmetric_heap_bytes: AllGather::symmetric_bytes(largest, env.world_size)
                    + (1 << 20),
                ..Config::from_env()?
            })
        })
        .and_then(|config| {
            // SAFETY: first thing in main: no thread has been started and no CUDA call made.
            unsafe { export_nvshmem_env(&config) }.map(|_| config)
        });
    if let Err(e) = prepared.and_then(|config| run(o, config)) {
        eprintln!("exchange_bench: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn options(args: &[&str]) -> Options {
        Options::try_parse_from(std::iter::once("exchange_bench").chain(args.iter().copied()))
            .unwrap()
    }

    fn row(bytes: usize, diagnostics: bool) -> Row {
        Row {
            bytes,
            shape: (63, 512),
            ours_us: 20.0,
            nccl_us: 40.0,
            nccl_window_us: None,
            nccl_nvshmem_window_us: None,
            floor_us: diagnostics.then_some(5.0),
            ours_batch_us: diagnostics.then_some(16.0),
            nccl_batch_us: diagnostics.then_some(32.0),
        }
    }

    fn json(o: &Options, rows: &[Row], pingpong_us: Option<f64>) -> Value {
        serde_json::from_str(&to_json(&results("GPU x4", 4, o, rows, pingpong_us))).unwrap()
    }

    #[test]
    fn every_flag_parses_with_the_old_defaults() {
        let o = options(&[]);
        assert_eq!(o.sizes.len(), 7);
        assert_eq!(o.sizes[3], 2 << 20);
        assert_eq!(o.variant, AllGatherVariant::DEFAULT);
        assert!(o.out.is_none() && o.sweep.is_empty() && !o.floor && o.batch.is_none());
        let o = options(&[
            "--out",
            "x.json",
            "--sizes",
            "1M,8M",
            "--sweep-ctas",
            "16,32,64",
            "--variant",
            "cta-loop",
            "--threads",
            "1024",
            "--chunk",
            "32K",
            "--floor",
            "--batch",
            "20",
        ]);
        assert_eq!(o.sizes, [1 << 20, 8 << 20]);
        assert_eq!(o.sweep, [16, 32, 64]);
        assert_eq!(o.variant, AllGatherVariant::CtaLoop);
        assert_eq!(
            (o.threads, o.chunk_bytes, o.batch),
            (Some(1024), Some(32 << 10), Some(20))
        );
        assert!(o.floor);
        for bad in [
            &["--batch", "0"][..],
            &["--chunk", "1K,2K"],
            &["--sizes", "4X"],
        ] {
            assert!(
                Options::try_parse_from(
                    std::iter::once("exchange_bench").chain(bad.iter().copied())
                )
                .is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn default_results_have_no_diagnostic_fields() {
        let rows = [row(1 << 20, false), row(8 << 20, false)];
        let o = options(&["--variant", "peer-major"]);
        let json = json(&o, &rows, Some(1.8));
        let top = json.as_object().unwrap();
        for absent in ["harness_floor_us", "batch_rounds"] {
            assert!(!top.contains_key(absent), "{absent} in {json}");
        }
        for row in json["rows"].as_array().unwrap() {
            // (serde_json's Value sorts keys.)
            let keys: Vec<&String> = row.as_object().unwrap().keys().collect();
            assert_eq!(
                keys,
                [
                    "bytes_per_rank",
                    "ctas",
                    "device_us",
                    "egress_gbps",
                    "nccl_us",
                    "speedup_vs_nccl",
                ]
            );
        }
        assert_eq!(json["speedup_vs_nccl_1MiB"], 2.0);
        assert_eq!(json["speedup_vs_nccl_4MiB"], Value::Null);
        assert_eq!(json["variant"], "peer-major");
        assert_eq!(json["W"], 4);
        assert_eq!(json["rows"][1]["ctas"], 63);
        assert_eq!(json["pingpong_rtt_us"], 1.8);
        // 3 x 8 MiB in 20 us.
        assert_eq!(json["gbps_egress_8MiB"], 1258.2912);
        for key in ["device", "commit", "date", "threads_per_cta", "method"] {
            assert!(top.contains_key(key), "{key}");
        }
    }

    #[test]
    fn floor_and_batch_add_fields_without_changing_the_single_shot_numbers() {
        let rows = [row(1 << 20, true), row(8 << 20, true)];
        let o = options(&["--floor", "--batch", "20"]);
        let json = json(&o, &rows, None);
        assert_eq!(json["harness_floor_us"], 5.0);
        assert_eq!(json["batch_rounds"], 20);
        assert_eq!(json["pingpong_rtt_us"], Value::Null);
        let row = &json["rows"][0];
        assert_eq!(row["device_us"], 20.0);
        assert_eq!(row["nccl_us"], 40.0);
        assert_eq!(row["device_batch_us"], 16.0);
        assert_eq!(row["nccl_batch_us"], 32.0);
        assert_eq!(row["speedup_vs_nccl_batch"], 2.0);
        let method = json["method"].as_str().unwrap();
        assert!(method.contains("harness_floor_us") && method.contains("20 back-to-back"));
    }
}
