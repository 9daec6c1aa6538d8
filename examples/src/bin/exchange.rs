//! Device-initiated all-gather across every rank, verified, plus a device ping-pong.
//!
//! ```text
//! lasp-run -n 4 target/release/exchange                 # every size 32 KiB .. 32 MiB, verified
//! lasp-run -n 4 target/release/exchange --rounds 10000  # back-to-back epochs, each checked
//! mpirun -np 4 target/release/exchange
//! nvshmrun -np 4 target/release/exchange
//! ```
//!
//! Options: `--sizes 32K,1M` (bytes per rank), `--rounds N` (epoch stress rounds, default 100),
//! `--pingpong N` (round trips, default 10000), `--silent-rank K` (fault drill: rank K never
//! sends, every other rank must fail with an error naming it), `--variant NAME` (the all-gather
//! kernel: dynamic, the default, cta-loop or peer-major), `--threads N` (threads per CTA).

use cudarc::driver::sys::CUevent_flags;
use lasp_shmem::exchange::{AllGather, AllGatherVariant, PingPong};
use lasp_shmem::launch_env::LaunchEnv;
use lasp_shmem::units::{format_bytes, parse_byte_list};
use lasp_shmem::{Config, Error, Result, Runtime};
use std::time::Duration;

struct Options {
    sizes: Vec<usize>,
    rounds: u32,
    pingpong: u32,
    silent_rank: Option<usize>,
    variant: AllGatherVariant,
    threads: Option<u32>,
}

impl Options {
    /// An all-gather of `bytes` per rank with the chosen kernel and shape.
    fn all_gather(&self, rt: &Runtime, bytes: usize) -> Result<AllGather> {
        let mut gather = AllGather::new(rt, bytes)?;
        gather.set_variant(self.variant)?;
        if let Some(threads) = self.threads {
            gather.set_threads(threads)?;
        }
        Ok(gather)
    }
}

fn parse_options() -> Result<Options> {
    let mut o = Options {
        sizes: parse_byte_list("32K,256K,1M,4M,8M,32M")?,
        rounds: 100,
        pingpong: 10_000,
        silent_rank: None,
        variant: AllGatherVariant::DEFAULT,
        threads: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| Error::InvalidArgument(format!("{flag} needs a value")))
        };
        let number = |v: String| {
            v.parse::<u32>()
                .map_err(|_| Error::InvalidArgument(format!("{v:?} is not a number")))
        };
        match flag.as_str() {
            "--sizes" => o.sizes = parse_byte_list(&value()?)?,
            "--rounds" => o.rounds = number(value()?)?,
            "--pingpong" => o.pingpong = number(value()?)?,
            "--silent-rank" => o.silent_rank = Some(number(value()?)? as usize),
            "--variant" => o.variant = AllGatherVariant::from_name(&value()?)?,
            "--threads" => o.threads = Some(number(value()?)?),
            other => {
                return Err(Error::InvalidArgument(format!(
                    "unknown option {other}; see the header of examples/src/bin/exchange.rs"
                )))
            }
        }
    }
    Ok(o)
}

/// One patterned round per size: fill, all-gather, check every word from every rank.
fn verify_sizes(rt: &Runtime, o: &Options) -> Result<()> {
    let stream = rt.stream().clone();
    for &bytes in &o.sizes {
        let mut gather = o.all_gather(rt, bytes)?;
        for _ in 0..3 {
            gather.fill_pattern(&stream)?;
            gather.launch(&stream)?;
            gather.check_pattern(&stream)?;
        }
        gather.finish(&stream)?;
        let bad = gather.mismatches(&stream)?;
        if bad != 0 {
            return Err(Error::State(format!(
                "all-gather of {} per rank: {bad} words differ from what their source wrote",
                format_bytes(bytes)
            )));
        }
        println!(
            "all-gather {:>7} per rank x {} ranks ({}, {:?} CTAs x threads): 3 rounds, every word verified",
            format_bytes(bytes),
            rt.npes(),
            gather.variant().name(),
            gather.launch_shape()
        );
        gather.free()?;
    }
    Ok(())
}

/// `rounds` back-to-back rounds with no host synchronisation; each writes data derived from its
/// epoch and checks what it received, so a stale or torn slot shows up as a mismatch.
fn epoch_stress(rt: &Runtime, o: &Options) -> Result<()> {
    let stream = rt.stream().clone();
    let bytes = 64 << 10;
    let rounds = o.rounds;
    let mut gather = o.all_gather(rt, bytes)?;
    for _ in 0..rounds {
        gather.fill_pattern(&stream)?;
        gather.launch(&stream)?;
        gather.check_pattern(&stream)?;
    }
    gather.finish(&stream)?;
    let (epoch, bad) = (gather.epoch(&stream)?, gather.mismatches(&stream)?);
    if epoch != rounds as u64 || bad != 0 {
        return Err(Error::State(format!(
            "epoch stress: reached epoch {epoch} of {rounds}, {bad} mismatching words"
        )));
    }
    println!(
        "epoch stress ({}): {rounds} back-to-back rounds of {} per rank, no stale or torn data",
        gather.variant().name(),
        format_bytes(bytes)
    );
    gather.free()
}

fn pingpong(rt: &Runtime, rounds: u32) -> Result<()> {
    let stream = rt.stream().clone();
    let pp = PingPong::new(rt)?;
    pp.launch(&stream, 100)?; // warm-up
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    pp.launch(&stream, rounds)?;
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    pp.finish(&stream)?;
    if rt.pe() == 0 {
        let us = start.elapsed_ms(&end)? as f64 * 1e3 / rounds as f64;
        println!("device ping-pong PE 0 <-> PE 1: {us:.2} us round trip ({rounds} rounds)");
    }
    pp.free()
}

fn silent_rank_drill(rt: &Runtime, o: &Options, silent: usize) -> Result<()> {
    let stream = rt.stream().clone();
    let gather = o.all_gather(rt, 64 << 10)?;
    if rt.pe() == silent {
        println!("rank {silent} stays silent (fault drill)");
        std::thread::sleep(rt.wait_timeout() + Duration::from_secs(10));
        return Err(Error::State(
            "the fault drill expected the other ranks to fail first".into(),
        ));
    }
    gather.launch(&stream)?;
    gather.finish(&stream)
}

fn run() -> Result<()> {
    let options = parse_options()?;
    let largest = options
        .sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(64 << 10);
    let npes = LaunchEnv::from_process_env()?.world_size;
    let rt = Runtime::init(Config {
        symmetric_heap_bytes: AllGather::symmetric_bytes(largest, npes),
        ..Config::default()
    })?;
    println!(
        "PE {} of {} on GPU {} ({:?})",
        rt.pe(),
        rt.npes(),
        rt.launch_env().local_rank,
        rt.launch_env().bootstrap
    );
    if let Some(silent) = options.silent_rank {
        silent_rank_drill(&rt, &options, silent)?;
    } else {
        verify_sizes(&rt, &options)?;
        epoch_stress(&rt, &options)?;
        if rt.npes() >= 2 && options.pingpong > 0 {
            pingpong(&rt, options.pingpong)?;
        }
    }
    rt.shutdown()
}

fn main() {
    if let Err(e) = run() {
        eprintln!("exchange: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}
