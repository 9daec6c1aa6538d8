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

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaStream, DevicePtr};
use lasp_shmem::exchange::{AllGather, PingPong};
use lasp_shmem::launch_env::LaunchEnv;
use lasp_shmem::nccl::NcclComm;
use lasp_shmem::units::{format_bytes, parse_byte_list};
use lasp_shmem::{Config, Error, Result, Runtime};
use std::sync::Arc;

const WARMUP: usize = 10;
const ITERATIONS: usize = 100;

struct Row {
    bytes: usize,
    ours_us: f64,
    nccl_us: f64,
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

/// NCCL's in-place all-gather (send buffer = this rank's block of the receive buffer), which,
/// like ours, moves only the peers' bytes.
fn nccl_in_place_all_gather_us(
    rt: &Runtime,
    comm: &NcclComm,
    stream: &Arc<CudaStream>,
    bytes: usize,
) -> Result<f64> {
    let recv = stream.alloc_zeros::<u8>(bytes * rt.npes())?;
    let base = recv.device_ptr(stream).0;
    // SAFETY: `recv` holds npes blocks of `bytes` and outlives the timed calls.
    time_collective(rt, stream, || unsafe {
        comm.all_gather_in_place(base, bytes)
    })
}

fn run() -> Result<()> {
    let mut out = None;
    let mut sizes = parse_byte_list("32K,256K,1M,2M,4M,8M,32M")?;
    let mut sweep: Vec<u32> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next()) {
            ("--out", Some(path)) => out = Some(path),
            ("--sizes", Some(list)) => sizes = parse_byte_list(&list)?,
            ("--sweep-ctas", Some(list)) => {
                sweep = list
                    .split(',')
                    .map(|v| v.parse().map_err(|_| Error::InvalidArgument(format!("--sweep-ctas {list}: not numbers"))))
                    .collect::<Result<_>>()?
            }
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "usage: exchange_bench [--out FILE] [--sizes 32K,1M] [--sweep-ctas 16,32,64] (got {flag})"
                )))
            }
        }
    }
    let npes = LaunchEnv::from_process_env()?.world_size;
    let largest = sizes.iter().copied().max().unwrap_or(1);
    let rt = Runtime::init(Config {
        symmetric_heap_bytes: AllGather::symmetric_bytes(largest, npes) + (1 << 20),
        ..Config::default()
    })?;
    let stream = rt.stream().clone();
    let comm = NcclComm::new(&rt, &stream)?;

    let mut rows = Vec::new();
    for &bytes in &sizes {
        let mut gather = AllGather::new(&rt, bytes)?;
        gather.fill_pattern(&stream)?;
        let ours = time_collective(&rt, &stream, || gather.launch(&stream))?;
        gather.finish(&stream)?;
        for &ctas in &sweep {
            gather.set_ctas(ctas)?;
            let us = time_collective(&rt, &stream, || gather.launch(&stream))?;
            gather.finish(&stream)?;
            let us = comm.max_f64(us)?;
            if rt.pe() == 0 {
                println!(
                    "sweep {:>7}/rank {ctas:>3} CTAs: {us:8.1} us",
                    format_bytes(bytes)
                );
            }
        }
        gather.free()?;

        let nccl = nccl_in_place_all_gather_us(&rt, &comm, &stream, bytes)?;
        let row = Row {
            bytes,
            ours_us: comm.max_f64(ours)?,
            nccl_us: comm.max_f64(nccl)?,
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
        let json = results_json(&rt, &rows, pingpong_us)?;
        match &out {
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

fn results_json(rt: &Runtime, rows: &[Row], pingpong_us: Option<f64>) -> Result<String> {
    let at = |size: usize| rows.iter().find(|r| r.bytes == size);
    let num = |v: Option<f64>| v.map_or("null".to_string(), |v| format!("{v:.4}"));
    let device = rt.context().name()?;
    let rows_json: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"bytes_per_rank\": {}, \"device_us\": {:.3}, \"nccl_us\": {:.3}, \"speedup_vs_nccl\": {:.4}, \"egress_gbps\": {:.2}}}",
                r.bytes, r.ours_us, r.nccl_us, r.nccl_us / r.ours_us, egress_gbps(r.bytes, rt.npes(), r.ours_us)
            )
        })
        .collect();
    Ok(format!(
        "{{\n  \"device\": \"{} x{}\",\n  \"commit\": \"{}\",\n  \"date\": \"{}\",\n  \"W\": {},\n  \"method\": \"in-place all-gather on both sides (own block not copied); per rank median of {ITERATIONS} iterations after {WARMUP} warm-up, each after an on-stream barrier, CUDA events; max over ranks\",\n  \"gbps_egress_8MiB\": {},\n  \"pingpong_rtt_us\": {},\n  \"speedup_vs_nccl_1MiB\": {},\n  \"speedup_vs_nccl_4MiB\": {},\n  \"rows\": [\n{}\n  ]\n}}\n",
        device,
        rt.npes(),
        std::env::var("LASP_COMMIT").unwrap_or_else(|_| "unknown".into()),
        std::env::var("LASP_DATE").unwrap_or_else(|_| "unknown".into()),
        rt.npes(),
        num(at(8 << 20).map(|r| egress_gbps(r.bytes, rt.npes(), r.ours_us))),
        num(pingpong_us),
        num(at(1 << 20).map(|r| r.nccl_us / r.ours_us)),
        num(at(4 << 20).map(|r| r.nccl_us / r.ours_us)),
        rows_json.join(",\n")
    ))
}

fn main() {
    if let Err(e) = run() {
        eprintln!("exchange_bench: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}
