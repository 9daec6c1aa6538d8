//! `lasp-run -n N [--timeout SECONDS] [--] PROGRAM [ARGS...]`: runs N ranks of PROGRAM on this
//! node, one per GPU, with torchrun-style RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
//! MASTER_PORT set. Output lines are prefixed with their rank; the first rank to fail ends the
//! job. NVSHMEM_* and NCCL_* (like the rest of the environment) pass through to the ranks.

use lasp_shmem::launcher::{run, LaunchPlan};
use std::ffi::OsString;
use std::time::Duration;

const USAGE: &str = "usage: lasp-run -n N [--timeout SECONDS] [--] PROGRAM [ARGS...]";

fn parse(mut args: impl Iterator<Item = OsString>) -> Result<LaunchPlan, String> {
    let (mut ranks, mut timeout) = (None, None);
    let program = loop {
        let arg = args.next().ok_or_else(|| USAGE.to_string())?;
        match arg.to_str() {
            Some("-n") | Some("--nproc") => {
                let v = args
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or(USAGE)?;
                ranks = Some(
                    v.parse::<usize>()
                        .map_err(|_| format!("-n {v}: not a number; {USAGE}"))?,
                );
            }
            Some("--timeout") => {
                let v = args
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or(USAGE)?;
                let secs = v
                    .parse::<f64>()
                    .ok()
                    .filter(|s| *s > 0.0)
                    .ok_or(format!("--timeout {v}: not a positive number of seconds"))?;
                timeout = Some(Duration::from_secs_f64(secs));
            }
            Some("--") => break args.next().ok_or_else(|| USAGE.to_string())?,
            Some("-h") | Some("--help") => return Err(USAGE.into()),
            _ => break arg,
        }
    };
    Ok(LaunchPlan {
        ranks: ranks.ok_or_else(|| format!("-n is required; {USAGE}"))?,
        program: program.into(),
        args: args.collect(),
        timeout,
    })
}

fn main() {
    let plan = match parse(std::env::args_os().skip(1)) {
        Ok(plan) => plan,
        Err(msg) => {
            eprintln!("lasp-run: {msg}");
            std::process::exit(2);
        }
    };
    match run(&plan) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("lasp-run: {e}");
            std::process::exit(2);
        }
    }
}
