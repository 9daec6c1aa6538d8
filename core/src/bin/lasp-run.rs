//! `lasp-run -n N [--timeout SECONDS] [--] PROGRAM [ARGS...]`: runs N ranks of PROGRAM on this
//! node, one per GPU, with torchrun-style RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
//! MASTER_PORT set, and a fresh LASP_RENDEZVOUS_NONCE that ties the ranks' rendezvous to this
//! job. Output lines are prefixed with their rank; the first rank to fail ends the job.
//!
//! NVSHMEM reads its settings from the environment once, and lasp-shmem never writes the
//! environment, so lasp-run puts them into its ranks' environment: NVSHMEM_DISABLE_NVLS=1,
//! NVSHMEM_REMOTE_TRANSPORT=none and NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (from NCCL_SOCKET_IFNAME),
//! each only where lasp-run's own environment does not set it. NVSHMEM_* and NCCL_* (like the
//! rest of the environment) pass through to the ranks.

use clap::Parser;
use lasp_shmem::launcher::{run, LaunchPlan};
use std::ffi::OsString;
use std::time::Duration;

/// Runs N ranks of PROGRAM on this node, one per GPU (torchrun-style variables, unique-id
/// rendezvous); the first rank to fail ends the job.
#[derive(Parser, Debug)]
#[command(name = "lasp-run")]
struct Cli {
    /// Number of ranks (at most the GPUs this node shows).
    #[arg(short = 'n', long = "nproc", value_name = "N")]
    ranks: usize,
    /// Wall-clock limit for the whole job, in seconds (exit code 124 when it expires).
    #[arg(long, value_name = "SECONDS", value_parser = positive_seconds)]
    timeout: Option<Duration>,
    /// The program every rank runs, then its arguments: everything from PROGRAM on is passed
    /// on as it is, options included.
    #[arg(value_name = "PROGRAM [ARGS]", required = true, num_args = 1..,
          trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<OsString>,
}

fn positive_seconds(text: &str) -> Result<Duration, String> {
    text.parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0 && s.is_finite())
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{text:?} is not a positive number of seconds"))
}

impl Cli {
    fn plan(self) -> LaunchPlan {
        let mut command = self.command.into_iter();
        LaunchPlan {
            ranks: self.ranks,
            program: command.next().expect("clap requires PROGRAM").into(),
            args: command.collect(),
            timeout: self.timeout,
        }
    }
}

fn main() {
    // lasp-run is single-threaded until it starts the ranks; it never writes its own environment
    // (the ranks' variables go into their Commands).
    let plan = Cli::parse().plan();
    match run(&plan) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("lasp-run: {e}");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Result<LaunchPlan, clap::Error> {
        Cli::try_parse_from(std::iter::once("lasp-run").chain(args.iter().copied())).map(Cli::plan)
    }

    #[test]
    fn the_programs_own_options_pass_through() {
        let p = plan(&["-n", "4", "target/release/exchange", "--rounds", "10", "-x"]).unwrap();
        assert_eq!(p.ranks, 4);
        assert_eq!(p.program, std::path::Path::new("target/release/exchange"));
        assert_eq!(p.args, ["--rounds", "10", "-x"]);
        assert_eq!(p.timeout, None);
        // Options of lasp-run after the program belong to the program.
        let p = plan(&["--nproc", "2", "prog", "--timeout", "5", "-n", "1"]).unwrap();
        assert_eq!((p.ranks, p.timeout), (2, None));
        assert_eq!(p.args, ["--timeout", "5", "-n", "1"]);
    }

    #[test]
    fn timeout_and_the_double_dash() {
        let p = plan(&["--timeout", "90", "-n", "8", "--", "prog", "--help"]).unwrap();
        assert_eq!(p.timeout, Some(Duration::from_secs(90)));
        assert_eq!(p.ranks, 8);
        assert_eq!(p.program, std::path::Path::new("prog"));
        assert_eq!(p.args, ["--help"]);
        let p = plan(&["-n", "4", "--timeout", "0.5", "prog"]).unwrap();
        assert_eq!((p.ranks, p.timeout), (4, Some(Duration::from_millis(500))));
    }

    #[test]
    fn bad_command_lines_are_refused_and_help_is_not_an_error() {
        for bad in [
            &["prog"][..],                          // -n is required
            &["-n", "4"],                           // a program is required
            &["-n", "four", "prog"],                // not a number
            &["-n", "4", "--timeout", "0", "prog"], // not positive
            &["-n", "4", "--timeout", "soon", "prog"],
        ] {
            assert!(plan(bad).is_err(), "{bad:?}");
        }
        let help = plan(&["--help"]).unwrap_err();
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp);
        assert_eq!(help.exit_code(), 0);
    }
}
