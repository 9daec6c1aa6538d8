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

use clap::Parser;
use cudarc::driver::sys::CUevent_flags;
use lasp_shmem::exchange::transport::{AllGather, AllGatherVariant, PingPong};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::export_nvshmem_env;
use lasp_shmem_examples::units::{format_bytes, parse_bytes};
use std::time::Duration;

/// Device-initiated all-gather across every rank, verified, plus a device ping-pong.
#[derive(Parser, Debug)]
#[command(name = "exchange")]
struct Options {
    /// Bytes per rank to verify, comma-separated (K, M, G suffixes).
    #[arg(long, value_name = "LIST", value_parser = parse_bytes, value_delimiter = ',',
          default_values = ["32K", "256K", "1M", "4M", "8M", "32M"])]
    sizes: Vec<usize>,
    /// Back-to-back epoch stress rounds.
    #[arg(long, value_name = "N", default_value_t = 100)]
    rounds: u32,
    /// Device ping-pong round trips (0: none).
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    pingpong: u32,
    /// Fault drill: rank K never sends; every other rank must fail with an error naming it.
    #[arg(long, value_name = "K")]
    silent_rank: Option<usize>,
    /// The all-gather kernel: dynamic (the default), cta-loop or peer-major.
    #[arg(long, value_name = "NAME", value_parser = AllGatherVariant::from_name,
          default_value = AllGatherVariant::DEFAULT.name())]
    variant: AllGatherVariant,
    /// Threads per CTA.
    #[arg(long, value_name = "N")]
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

    /// The largest all-gather the program runs (the epoch stress uses 64 KiB).
    fn largest(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(0).max(64 << 10)
    }
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

fn run(options: Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
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
    let options = Options::parse();
    let prepared = lasp_shmem::launch_env::LaunchEnv::from_process_env()
        .and_then(|env| {
            Ok(Config {
                symmetric_heap_bytes: AllGather::symmetric_bytes(options.largest(), env.world_size),
                ..Config::from_env()?
            })
        })
        .and_then(|config| {
            // SAFETY: first thing in main: no thread has been started and no CUDA call made.
            unsafe { export_nvshmem_env(&config) }.map(|_| config)
        });
    if let Err(e) = prepared.and_then(|config| run(options, config)) {
        eprintln!("exchange: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_parses_with_the_old_defaults() {
        let o = Options::try_parse_from(["exchange"]).unwrap();
        assert_eq!(
            o.sizes,
            [32 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 32 << 20]
        );
        assert_eq!((o.rounds, o.pingpong), (100, 10_000));
        assert_eq!(o.variant, AllGatherVariant::DEFAULT);
        let o = Options::try_parse_from([
            "exchange",
            "--sizes",
            "64K",
            "--rounds",
            "10000",
            "--pingpong",
            "0",
            "--variant",
            "peer-major",
            "--threads",
            "1024",
            "--silent-rank",
            "1",
        ])
        .unwrap();
        assert_eq!(o.sizes, [64 << 10]);
        assert_eq!((o.rounds, o.pingpong, o.threads), (10000, 0, Some(1024)));
        assert_eq!(o.variant, AllGatherVariant::PeerMajor);
        assert_eq!(o.silent_rank, Some(1));
        assert_eq!(o.largest(), 64 << 10);
        let err = Options::try_parse_from(["exchange", "--variant", "ring"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("dynamic, cta-loop, peer-major"), "{err}");
        assert!(Options::try_parse_from(["exchange", "--sizes", "4X"]).is_err());
    }
}
