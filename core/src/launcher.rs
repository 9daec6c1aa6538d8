//! A local launcher: N ranks of one program on this node, bootstrapped through the unique-id
//! rendezvous (torchrun-style variables), with rank-prefixed output, fail-fast and a timeout.

use crate::error::{Error, Result};
use crate::gpu;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchPlan {
    /// Number of ranks, one per GPU.
    pub ranks: usize,
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Wall-clock limit for the whole job.
    pub timeout: Option<Duration>,
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
    if plan.ranks == 0 {
        return Err(Error::Launch("lasp-run needs -n of at least 1".into()));
    }
    let gpus = gpu::visible_gpu_count()?;
    if plan.ranks > gpus {
        return Err(Error::Launch(format!(
            "asked for {} ranks but this node shows {gpus} GPU(s); use -n {gpus} or fewer (check CUDA_VISIBLE_DEVICES)",
            plan.ranks
        )));
    }
    // Probe on the address rank 0 will listen on (all interfaces): a port that is free on the
    // loopback only can still be taken on another interface (seen on the GPU node: "rank 0
    // cannot listen on port ..." between two jobs of a sweep).
    let port = TcpListener::bind("0.0.0.0:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| Error::Launch(format!("no free local TCP port for the rendezvous: {e}")))?
        .port();
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }

    let mut children = Vec::with_capacity(plan.ranks);
    let mut pumps = Vec::new();
    for rank in 0..plan.ranks {
        let mut cmd = Command::new(&plan.program);
        cmd.args(&plan.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", plan.ranks.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", plan.ranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
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
            // SAFETY: signalling the child's own process group.
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

fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
        .max(1)
}
