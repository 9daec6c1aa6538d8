//! A local launcher: N ranks of one program on this node, bootstrapped through the unique-id
//! rendezvous (torchrun-style variables), with rank-prefixed output, fail-fast and a timeout.
//!
//! The plan (which ranks, which variables each gets) is plain data, built and checked by
//! [`LaunchPlan::check`] and [`LaunchPlan::rank_commands`] without a GPU; [`run`] adds the
//! node's GPU count, a free port, a fresh job nonce and the processes.

use crate::error::{Error, Result};
use crate::gpu;
use crate::rendezvous::{JobNonce, NONCE_VAR};
use crate::settings;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What to launch.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchPlan {
    /// Number of ranks, one per GPU.
    pub ranks: usize,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Wall-clock limit for the whole job.
    pub timeout: Option<Duration>,
}

/// One rank's process: the plan's program and arguments, and the variables the launcher adds to
/// the environment it inherits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankCommand {
    pub rank: usize,
    pub env: Vec<(String, String)>,
}

impl LaunchPlan {
    /// Whether the plan fits a node that shows `gpus` GPUs: at least one rank, at most one per
    /// GPU.
    pub fn check(&self, gpus: usize) -> Result<()> {
        self.check_ranks()?;
        if self.ranks > gpus {
            return Err(Error::Launch(format!(
                "asked for {} ranks but this node shows {gpus} GPU(s); use -n {gpus} or fewer (check CUDA_VISIBLE_DEVICES)",
                self.ranks
            )));
        }
        Ok(())
    }

    /// Whether the plan has at least one rank (checked before the GPUs are counted).
    fn check_ranks(&self) -> Result<()> {
        if self.ranks == 0 {
            return Err(Error::Launch("lasp-run needs -n of at least 1".into()));
        }
        Ok(())
    }

    /// Every rank's variables: torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`, `MASTER_ADDR` (this host) and `MASTER_PORT` (`port`), the job's
    /// `LASP_RENDEZVOUS_NONCE`, and NVSHMEM's settings for a single node
    /// ([`settings::launcher_nvshmem_defaults`]) where the launcher's own environment, read
    /// through `get`, does not set them. The ranks read the settings at init; the launcher sets
    /// them here, in the children's environment, so that no rank has to write its own.
    pub fn rank_commands(
        &self,
        port: u16,
        nonce: &JobNonce,
        get: impl Fn(&str) -> Option<String>,
    ) -> Vec<RankCommand> {
        let nvshmem = settings::launcher_nvshmem_defaults(get);
        (0..self.ranks)
            .map(|rank| {
                let mut env = vec![
                    ("RANK".to_string(), rank.to_string()),
                    ("WORLD_SIZE".into(), self.ranks.to_string()),
                    ("LOCAL_RANK".into(), rank.to_string()),
                    ("LOCAL_WORLD_SIZE".into(), self.ranks.to_string()),
                    ("MASTER_ADDR".into(), "127.0.0.1".into()),
                    ("MASTER_PORT".into(), port.to_string()),
                    (NONCE_VAR.into(), nonce.as_str().into()),
                ];
                env.extend(nvshmem.iter().map(|(k, v)| (k.to_string(), v.clone())));
                RankCommand { rank, env }
            })
            .collect()
    }
}

/// How long ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Runs the plan and returns the job's exit code: 0 if every rank exited 0; otherwise the first
/// failing rank's code (128 + signal for a killed rank), 124 on timeout, 130 when interrupted.
/// The other ranks are stopped as soon as one fails.
pub fn run(plan: &LaunchPlan) -> Result<i32> {
    plan.check_ranks()?;
    plan.check(gpu::visible_gpu_count()?)?;
    // Probe on the address rank 0 will listen on (all interfaces): a port that is free on the
    // loopback only can still be taken on another interface (seen on the GPU node: "rank 0
    // cannot listen on port ..." between two jobs of a sweep).
    let port = TcpListener::bind("0.0.0.0:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::Launch(format!("no free local TCP port for the rendezvous: {e}")))?
        .port();
    let nonce = JobNonce::generate()?;
    let commands = plan.rank_commands(port, &nonce, |name| {
        std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
    });
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    let mut children = Vec::with_capacity(plan.ranks);
    let mut pumps = Vec::new();
    for command in commands {
        let rank = command.rank;
        let mut cmd = Command::new(&plan.program);
        cmd.args(&plan.args)
            .envs(command.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so stopping a rank also stops what it started.
            .process_group(0);
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                stop(&mut children);
                return Err(Error::Launch(format!(
                    "cannot start {}: {e}",
                    plan.program.display()
                )));
            }
        };
        pumps.push(pump(child.stdout.take().unwrap(), rank, false));
        pumps.push(pump(child.stderr.take().unwrap(), rank, true));
        children.push(Some(child));
    }

    let started = Instant::now();
    let code = loop {
        if INTERRUPTED.load(Ordering::SeqCst) {
            eprintln!("lasp-run: interrupted; stopping all ranks");
            stop(&mut children);
            break 130;
        }
        if plan.timeout.is_some_and(|t| started.elapsed() > t) {
            eprintln!(
                "lasp-run: timed out after {:.0} s; stopping all ranks",
                started.elapsed().as_secs_f64()
            );
            stop(&mut children);
            break 124;
        }
        let mut failure = None;
        for (rank, slot) in children.iter_mut().enumerate() {
            if let Some(child) = slot {
                if let Ok(Some(status)) = child.try_wait() {
                    *slot = None;
                    if !status.success() {
                        failure = Some((rank, status));
                        break;
                    }
                }
            }
        }
        if let Some((rank, status)) = failure {
            eprintln!(
                "lasp-run: rank {rank} {}; stopping the other ranks",
                describe(status)
            );
            stop(&mut children);
            break exit_code(status);
        }
        if children.iter().all(Option::is_none) {
            break 0;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    for pump in pumps {
        let _ = pump.join();
    }
    Ok(code)
}

/// Copies a rank's output to ours line by line, prefixed with the rank.
fn pump(
    stream: impl Read + Send + 'static,
    rank: usize,
    is_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).split(b'\n').map_while(|l| l.ok()) {
            let text = String::from_utf8_lossy(&line);
            let _ = if is_stderr {
                writeln!(std::io::stderr().lock(), "[rank {rank}] {text}")
            } else {
                writeln!(std::io::stdout().lock(), "[rank {rank}] {text}")
            };
        }
    })
}

/// SIGTERM to every running rank's process group, SIGKILL to those still there after GRACE.
fn stop(children: &mut [Option<Child>]) {
    let signal_all = |children: &mut [Option<Child>], sig| {
        for child in children.iter_mut().flatten() {
            // SAFETY: kill has no memory effects; the target is the process group the child was
            // started in (process_group(0)), which it leads and we have not reaped yet.
            unsafe { libc::kill(-(child.id() as libc::pid_t), sig) };
        }
    };
    signal_all(children, libc::SIGTERM);
    let deadline = Instant::now() + GRACE;
    while Instant::now() < deadline {
        for slot in children.iter_mut() {
            if slot
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))))
            {
                *slot = None;
            }
        }
        if children.iter().all(Option::is_none) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(children, libc::SIGKILL);
    for child in children.iter_mut().flatten() {
        let _ = child.wait();
    }
}

/// How a rank ended, for the launcher's message.
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

/// The job's exit code after a rank ended with `status`: its code, 128 + signal for a killed
/// rank, and never 0 (a rank that failed must fail the job).
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn plan(ranks: usize) -> LaunchPlan {
        LaunchPlan {
            ranks,
            program: "/bin/prog".into(),
            args: vec!["--x".into()],
            timeout: None,
        }
    }

    #[test]
    fn a_plan_needs_a_rank_and_a_gpu_for_each() {
        assert!(plan(4).check(4).is_ok());
        let msg = plan(5).check(4).unwrap_err().to_string();
        assert!(
            msg.contains("asked for 5 ranks but this node shows 4 GPU(s); use -n 4"),
            "{msg}"
        );
        let msg = plan(0).check(8).unwrap_err().to_string();
        assert!(msg.contains("-n of at least 1"), "{msg}");
    }

    #[test]
    fn every_rank_gets_its_place_the_rendezvous_and_the_job_nonce() {
        let nonce = JobNonce::new("n0nce").unwrap();
        let commands = plan(3).rank_commands(29500, &nonce, |_| None);
        assert_eq!(commands.len(), 3);
        for (rank, command) in commands.iter().enumerate() {
            assert_eq!(command.rank, rank);
            let env: HashMap<&str, &str> = command
                .env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let rank = rank.to_string();
            for (name, value) in [
                ("RANK", rank.as_str()),
                ("LOCAL_RANK", &rank),
                ("WORLD_SIZE", "3"),
                ("LOCAL_WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("LASP_RENDEZVOUS_NONCE", "n0nce"),
                // What the runtime used to set inside every rank, now set by the launcher.
                ("NVSHMEM_DISABLE_NVLS", "1"),
                ("NVSHMEM_REMOTE_TRANSPORT", "none"),
            ] {
                assert_eq!(env.get(name), Some(&value), "{name} of rank {rank}");
            }
            // Only the program knows its heap; the launcher leaves it to the program.
            assert!(!env.contains_key("NVSHMEM_SYMMETRIC_SIZE"));
        }
    }

    #[test]
    fn the_launchers_own_settings_pass_through_unchanged() {
        let nonce = JobNonce::new("n").unwrap();
        let outer: HashMap<&str, &str> = [
            ("NVSHMEM_DISABLE_NVLS", "0"),
            ("NCCL_SOCKET_IFNAME", "eth1"),
        ]
        .into();
        let commands =
            plan(1).rank_commands(1, &nonce, |name| outer.get(name).map(|v| v.to_string()));
        let names: Vec<&str> = commands[0].env.iter().map(|(k, _)| k.as_str()).collect();
        // Not overridden (the child inherits the launcher's value), and derived where asked.
        assert!(!names.contains(&"NVSHMEM_DISABLE_NVLS"), "{names:?}");
        assert!(commands[0]
            .env
            .contains(&("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME".into(), "eth1".into())));
    }

    #[test]
    fn exit_codes_say_how_a_rank_ended() {
        // Wait statuses as waitpid reports them: code << 8, or the signal number.
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        let killed = |signal: i32| ExitStatus::from_raw(signal);
        assert_eq!(exit_code(exited(3)), 3);
        assert_eq!(describe(exited(3)), "exited with code 3");
        assert_eq!(exit_code(killed(libc::SIGKILL)), 128 + 9);
        assert_eq!(describe(killed(libc::SIGSEGV)), "was killed by signal 11");
        // A failure never turns into success.
        assert_eq!(exit_code(exited(0)), 1);
    }
}
