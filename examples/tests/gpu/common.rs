//! What every GPU test shares: whether this machine has a GPU (a notice and a pass where it has
//! none), one test's checks in a process of its own, and the example programs run alone or under
//! `lasp-run` with a deadline, their output kept for the verdict.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::launch_env::LaunchEnv;
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::reference::{rel_err, Inputs, Shape, Tensor};
use lasp_shmem::{Config, Runtime};
use regex::Regex;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The result of one check: a detail line when it passed, what went wrong when it failed.
pub type CheckResult = std::result::Result<String, String>;

/// `e` as the text of a failed check.
pub fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Writes `NOTICE: {text}` straight to standard error: libtest captures only `eprintln!`, and a
/// skipped test must say so in every run, not only in a failing one.
fn notice(text: &str) {
    let _ = writeln!(std::io::stderr(), "NOTICE: {text}");
}

/// The name libtest runs the current test under (`forward::small_cases_...`): it names the
/// test's thread after it, with `--test-threads=1` too.
fn test_name() -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => name.to_string(),
        _ => panic!("the GPU tests must run under libtest, which names each test's thread"),
    }
}

/// The GPUs this process sees, or `None` after a notice that the current test is skipped. Only
/// a machine without a GPU is skipped (no driver library, CUDA_VISIBLE_DEVICES empty, or a driver
/// that finds no device); any other failure of the driver panics, because a GPU may well be
/// there and broken.
pub fn gpus_or_skip() -> Option<usize> {
    match visible_gpus() {
        Ok(count) => Some(count),
        Err(why) => {
            notice(&format!("skipped {}: no NVIDIA GPU ({why})", test_name()));
            None
        }
    }
}

/// [`gpus_or_skip`] for a test that needs two ranks or more: `None` with a notice on one GPU.
pub fn two_or_more_gpus_or_skip() -> Option<usize> {
    let gpus = gpus_or_skip()?;
    if gpus < 2 {
        notice(&format!(
            "skipped {}: needs 2 GPUs or more, this node shows {gpus}",
            test_name()
        ));
        return None;
    }
    Some(gpus)
}

/// The number of GPUs, or why there is none.
fn visible_gpus() -> std::result::Result<usize, String> {
    if std::env::var_os("CUDA_VISIBLE_DEVICES").is_some_and(|v| v.is_empty()) {
        return Err("CUDA_VISIBLE_DEVICES is empty".into());
    }
    // SAFETY: loads and closes the driver library, which runs none of our code; without it
    // cudarc's first driver call would panic instead of returning an error.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no driver library libcuda.so on this machine".into());
    }
    match cudarc::driver::result::init() {
        Ok(()) => {}
        Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => {
            return Err("the driver finds no device: cuInit gave CUDA_ERROR_NO_DEVICE".into())
        }
        Err(e) => panic!(
            "the NVIDIA driver is installed but cuInit failed ({e:?}); a GPU may be there, so \
             this is a failure, not a skip"
        ),
    }
    let count = cudarc::driver::result::device::get_count()
        .unwrap_or_else(|e| panic!("cuDeviceGetCount failed after cuInit succeeded: {e:?}"));
    match count {
        0 => Err("the driver shows 0 devices".into()),
        n => Ok(n as usize),
    }
}

/// The GPU tests take turns even where libtest runs tests in parallel: concurrent jobs on the
/// same GPUs would slow each other past the drills' timeouts.
static GPU_TURN: Mutex<()> = Mutex::new(());

fn take_gpu_turn() -> std::sync::MutexGuard<'static, ()> {
    // A test that failed while holding the turn leaves nothing behind that the next one needs.
    GPU_TURN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Set in the child process of a single-GPU test to the name of that test, which then runs its
/// checks in that process.
const CHILD_TEST_VAR: &str = "LASP_GPU_TEST_CHILD";
/// The last line of a child whose checks all passed (scripts/sanitize.sh looks for it too).
const CHILD_PASSED: &str = "gpu test child: every check passed";

/// The PASS and FAIL lines of one test's checks, printed as they come.
#[derive(Default)]
pub struct Report {
    passed: usize,
    failed: Vec<String>,
}

impl Report {
    /// Runs `check` and records its result under `name` with the seconds it took.
    pub fn timed(&mut self, name: &str, check: impl FnOnce() -> CheckResult) {
        let t0 = Instant::now();
        let result = check();
        self.record(name, result, t0.elapsed().as_secs_f64());
    }

    /// Prints `PASS name (seconds) detail` or `FAIL ...` and counts it.
    pub fn record(&mut self, name: &str, result: CheckResult, seconds: f64) {
        match result {
            Ok(detail) => {
                self.passed += 1;
                println!("PASS {name} ({seconds:.2} s) {detail}");
            }
            Err(detail) => {
                self.failed.push(name.to_string());
                println!("FAIL {name} ({seconds:.2} s) {detail}");
            }
        }
    }
}

/// The single-GPU cases small enough for compute-sanitizer (the `--quick` set of the former check
/// programs): scripts/sanitize.sh runs the `small_cases` and `bad_arguments` tests under it.
pub fn is_small(shape: &Shape) -> bool {
    shape.t * shape.b * shape.h <= 4096
}

/// The runtime of the single-GPU checks: a small symmetric heap (they allocate none of it).
fn single_gpu_config() -> Config {
    Config {
        symmetric_heap_bytes: 1 << 20,
        ..Config::default()
    }
}

/// Runs `checks` on GPU 0 in a child process of this test executable, which fails when it runs
/// past `limit`; skips with a notice where there is no GPU.
///
/// NVSHMEM can be initialised once per process, and its exit handlers crash a process that exits
/// without finalizing it: a process per test gives each its own runtime, shut down before exit.
pub fn on_one_gpu(limit: Duration, checks: impl FnOnce(&Runtime, &mut Report)) {
    let test = test_name();
    if std::env::var(CHILD_TEST_VAR).is_ok_and(|child| child == test) {
        run_checks_here(limit, checks);
        return;
    }
    if gpus_or_skip().is_none() {
        return;
    }
    let _turn = take_gpu_turn();
    let env = LaunchEnv::from_process_env().unwrap_or_else(|e| panic!("launch environment: {e}"));
    let mut child = Command::new(std::env::current_exe().expect("the test executable's path"));
    child
        .args(["--exact", &test, "--nocapture", "--test-threads=1"])
        .env(CHILD_TEST_VAR, &test)
        // NVSHMEM reads its settings once, from the environment: the child starts with what
        // this configuration needs (NVLink multicast off among them), as the programs do.
        .envs(single_gpu_config().nvshmem_env(&env));
    // The child's own watchdog ends it at `limit`; this deadline only catches a child that
    // cannot even do that.
    let run = run_until(&mut child, limit + Duration::from_secs(60));
    print_indented(&run.output);
    let status = run.status_text();
    assert!(
        run.succeeded(),
        "{test}: its child process {status}:\n{}",
        run.fail_lines_and_tail()
    );
    assert!(
        run.output.lines().any(|l| l == CHILD_PASSED),
        "{test}: the child process exited 0 without running the test (was it renamed?):\n{}",
        run.tail(15)
    );
}

/// The child's part of [`on_one_gpu`]: a runtime, the checks, the collective shutdown, then the
/// verdict.
fn run_checks_here(limit: Duration, checks: impl FnOnce(&Runtime, &mut Report)) {
    // A hung kernel must not hang the suite (and compute-sanitizer runs this part directly).
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        // The limits are set for release builds: the CPU f64 reference of the large cases runs
        // about 25 times slower without optimisation.
        let build = if cfg!(debug_assertions) {
            "; this is a debug build, use cargo test --release"
        } else {
            ""
        };
        println!(
            "FAIL watchdog: still running after {} s (a kernel hung, or the machine is far slower than expected{build})",
            limit.as_secs()
        );
        lasp_shmem::runtime::exit_after_error(1);
    });
    let rt = Runtime::init(single_gpu_config()).unwrap_or_else(|e| panic!("runtime_init: {e}"));
    let mut report = Report::default();
    checks(&rt, &mut report);
    if let Err(e) = rt.shutdown() {
        report.record("runtime_shutdown", Err(e.to_string()), 0.0);
    }
    let Report { passed, failed } = report;
    println!("{passed} passed, {} failed", failed.len());
    assert!(
        failed.is_empty(),
        "{} of {} checks failed: {}",
        failed.len(),
        passed + failed.len(),
        failed.join(", ")
    );
    assert!(passed > 0, "no check ran");
    println!("{CHILD_PASSED}");
}

/// A finished (or stopped) program: its exit status, `None` when it ran past its deadline and
/// was killed, and everything it wrote to standard output and error, interleaved.
pub struct Finished {
    status: Option<ExitStatus>,
    pub output: String,
}

impl Finished {
    fn succeeded(&self) -> bool {
        self.status.is_some_and(|s| s.success())
    }

    fn status_text(&self) -> String {
        match self.status {
            Some(status) => format!("ended with {status}"),
            None => "ran past its deadline and was killed".into(),
        }
    }

    /// The last `n` lines of the output.
    fn tail(&self, n: usize) -> String {
        let lines: Vec<&str> = self.output.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// The `FAIL` lines of a child's checks (the first 40), then its last lines.
    fn fail_lines_and_tail(&self) -> String {
        let fails: Vec<&str> = self
            .output
            .lines()
            .filter(|l| l.starts_with("FAIL "))
            .take(40)
            .collect();
        if fails.is_empty() {
            return self.tail(15);
        }
        format!("{}\n...\n{}", fails.join("\n"), self.tail(15))
    }
}

/// Prints `text` indented, so that a child's own libtest lines (`test result: ...`) are not
/// taken for this executable's.
fn print_indented(text: &str) {
    for line in text.lines() {
        println!("    {line}");
    }
}

/// Runs `command` to its end, or kills it at `deadline`. Its output goes through a file, which
/// nothing blocks on, also when a killed program's own children keep writing.
fn run_until(command: &mut Command, deadline: Duration) -> Finished {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "lasp-gpu-test-{}-{}.log",
        std::process::id(),
        RUNS.fetch_add(1, Ordering::SeqCst)
    ));
    let log =
        File::create(&path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    let log_too = log.try_clone().expect("a second handle to the log");
    let mut child = command
        .stdout(log)
        .stderr(log_too)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {command:?}: {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break Some(status);
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = std::fs::read(&path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()));
    let _ = std::fs::remove_file(&path);
    Finished { status, output }
}

/// The program `name` of this workspace: beside this test executable as scripts/bundle.sh lays
/// them out (`.bundle/tests/gpu`, `.bundle/bin/NAME`), else in cargo's target folder
/// (`target/<profile>/deps/gpu-<hash>`, `target/<profile>/NAME`), else `built_at` (cargo's
/// `CARGO_BIN_EXE_<name>`, for this package's programs). The variable `override_var`, when
/// set, wins.
pub fn program(name: &str, override_var: Option<&str>, built_at: Option<&str>) -> PathBuf {
    if let Some(path) = override_var.and_then(std::env::var_os) {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "{} = {} is not a file",
            override_var.unwrap_or_default(),
            path.display()
        );
        return path;
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let here = exe.parent().unwrap_or(Path::new("."));
    let mut candidates = vec![here.join("../bin").join(name), here.join("..").join(name)];
    candidates.extend(built_at.map(PathBuf::from));
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "{name} not found; looked at {candidates:?}. Build it (cargo build --release \
                 --workspace --bins){}",
                override_var.map_or(String::new(), |v| format!(" or set {v} to its path"))
            )
        })
}

/// `lasp-run`, the launcher: the core crate's program, so cargo gives no path for it here.
pub fn launcher() -> PathBuf {
    program("lasp-run", Some("LASP_RUN"), None)
}

/// `lasp-run --timeout LIMIT -n RANKS PROGRAM ARGS` with `env` added, its turn on the GPUs taken.
pub fn launch(
    ranks: usize,
    limit: Duration,
    program: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    let mut command = Command::new(launcher());
    command
        .arg("--timeout")
        .arg(limit.as_secs().to_string())
        .arg("-n")
        .arg(ranks.to_string())
        .arg(program)
        .args(args)
        .envs(env.iter().copied());
    run_on_gpus(&mut command, limit)
}

/// Runs `command` in its turn on the GPUs; it may run for `limit` and a little more (the
/// launcher's own timeout ends a job first, stopping its ranks).
pub fn run_on_gpus(command: &mut Command, limit: Duration) -> Finished {
    let _turn = take_gpu_turn();
    run_until(command, limit + Duration::from_secs(30))
}

/// A job that must succeed: panics with its last lines otherwise, and prints its output.
pub fn expect_success(what: &str, run: &Finished) {
    print_indented(&run.output);
    assert!(
        run.succeeded(),
        "{what}: {}; last lines:\n{}",
        run.status_text(),
        run.tail(15)
    );
}

/// A job that must fail with a line matching `pattern`, as the fault drills do: it must not
/// succeed, no rank may crash (SIGSEGV) instead of exiting with its error, and some line must
/// match. Returns the first matching line.
pub fn expect_failure(what: &str, pattern: &str, run: &Finished) -> String {
    print_indented(&run.output);
    let pattern = Regex::new(pattern).expect("a valid pattern");
    assert!(!run.succeeded(), "{what}: succeeded but should have failed");
    assert!(
        !run.output.contains("killed by signal 11"),
        "{what}: a rank crashed (SIGSEGV) instead of exiting with its error:\n{}",
        run.tail(10)
    );
    let line = run
        .output
        .lines()
        .find(|line| pattern.is_match(line))
        .unwrap_or_else(|| {
            panic!(
                "{what}: no line matching '{pattern}'; last lines:\n{}",
                run.tail(10)
            )
        });
    println!(
        "PASS {what}: {}",
        line.chars().take(220).collect::<String>()
    );
    line.to_string()
}

/// The bit pattern written into every bf16 output before a run (a NaN), so that an element the
/// kernels never write is caught.
pub const POISON_BF16: u16 = 0xFFFF;
/// The same for f32 outputs.
pub const POISON_F32: u32 = 0xFFFF_FFFF;

/// The values of a reference tensor as the bf16 the GPU gets.
pub fn to_bf16(t: &Tensor) -> Vec<bf16> {
    t.data().iter().map(|&x| bf16::from_f64(x)).collect()
}

/// The values of a reference tensor as the f32 the GPU gets.
pub fn to_f32(t: &Tensor) -> Vec<f32> {
    t.data().iter().map(|&x| x as f32).collect()
}

pub use lasp_shmem_examples::{bf16_values, f32_values};

/// The bits of a device buffer of bf16, read back for bitwise comparisons
/// (`lasp_shmem_examples::bf16_bits` with the tests' error type).
pub fn bits_of_bf16(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<bf16>,
) -> std::result::Result<Vec<u16>, String> {
    lasp_shmem_examples::bf16_bits(stream, buf).map_err(err)
}

/// The bits of a device buffer of f32, read back for bitwise comparisons
/// (`lasp_shmem_examples::f32_bits` with the tests' error type).
pub fn bits_of_f32(
    stream: &Arc<CudaStream>,
    buf: &CudaSlice<f32>,
) -> std::result::Result<Vec<u32>, String> {
    lasp_shmem_examples::f32_bits(stream, Some(buf)).map_err(err)
}

/// An error naming the elements of `what` that still hold the poison written before the run.
pub fn unwritten<T: PartialEq + Copy>(
    bits: &[T],
    poison: T,
    what: &str,
    shape: &[usize],
) -> CheckResult {
    let count = bits.iter().filter(|&&x| x == poison).count();
    if count == 0 {
        return Ok(String::new());
    }
    let first = bits.iter().position(|&x| x == poison).unwrap();
    let index = Tensor::zeros(shape).unravel(first);
    Err(format!(
        "{count} of {} elements of {what} were never written (first at {index:?})",
        bits.len()
    ))
}

/// `||got - want|| / ||want|| <= tol`, with the largest difference named where it is not.
pub fn compare(
    what: &str,
    got: &[f64],
    want: &Tensor,
    tol: f64,
) -> std::result::Result<f64, String> {
    if let Some(pos) = got.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "{what}: {} at {:?} is not finite",
            got[pos],
            want.unravel(pos)
        ));
    }
    let e = rel_err(got, want.data());
    if e <= tol {
        return Ok(e);
    }
    let (worst, diff) = got
        .iter()
        .zip(want.data())
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0.0), |m, (i, d)| if d > m.1 { (i, d) } else { m });
    Err(format!(
        "{what}: rel err {e:.3e} > {tol:.0e}; largest difference {diff:.3e} at {:?}: got {}, want {}",
        want.unravel(worst),
        got[worst],
        want.data()[worst]
    ))
}

/// A forward's inputs (from the f64 reference's generator, rounded as the GPU sees them) and its
/// outputs o and ht on the device, for any family whose forward takes q, k, v, g, h0.
pub struct ForwardBuffers {
    pub q: CudaSlice<bf16>,
    pub k: CudaSlice<bf16>,
    pub v: CudaSlice<bf16>,
    pub g: CudaSlice<f32>,
    pub h0: Option<CudaSlice<f32>>,
    pub o: CudaSlice<bf16>,
    pub ht: CudaSlice<f32>,
}

impl ForwardBuffers {
    pub fn upload(stream: &Arc<CudaStream>, inputs: &Inputs) -> std::result::Result<Self, String> {
        let shape = ForwardShape::from(inputs.shape);
        let dev = ForwardBuffers {
            q: stream.clone_htod(&to_bf16(&inputs.q)).map_err(err)?,
            k: stream.clone_htod(&to_bf16(&inputs.k)).map_err(err)?,
            v: stream.clone_htod(&to_bf16(&inputs.v)).map_err(err)?,
            g: stream.clone_htod(&to_f32(&inputs.g)).map_err(err)?,
            h0: match &inputs.h0 {
                Some(h0) => Some(stream.clone_htod(&to_f32(h0)).map_err(err)?),
                None => None,
            },
            o: stream.alloc_zeros(shape.v_len()).map_err(err)?,
            ht: stream.alloc_zeros(shape.state_len()).map_err(err)?,
        };
        stream.synchronize().map_err(err)?;
        Ok(dev)
    }

    /// The inputs the kernels only read (g, h0) whose device bits no longer match `inputs`.
    pub fn modified_inputs(
        &self,
        stream: &Arc<CudaStream>,
        inputs: &Inputs,
    ) -> std::result::Result<Vec<String>, String> {
        let mut modified = Vec::new();
        let same = |device: &CudaSlice<f32>, want: &Tensor| -> std::result::Result<bool, String> {
            let now: Vec<f32> = stream.clone_dtoh(device).map_err(err)?;
            Ok(now
                .iter()
                .zip(to_f32(want))
                .all(|(a, b)| a.to_bits() == b.to_bits()))
        };
        if !same(&self.g, &inputs.g)? {
            modified.push("g was modified".to_string());
        }
        if let (Some(h0_dev), Some(h0)) = (&self.h0, &inputs.h0) {
            if !same(h0_dev, h0)? {
                modified.push("h0 was modified".to_string());
            }
        }
        Ok(modified)
    }

    /// o and ht filled with the poison bit patterns.
    pub fn poison(&mut self, stream: &Arc<CudaStream>) -> std::result::Result<(), String> {
        let o = vec![bf16::from_bits(POISON_BF16); self.o.len()];
        let ht = vec![f32::from_bits(POISON_F32); self.ht.len()];
        stream.memcpy_htod(&o, &mut self.o).map_err(err)?;
        stream.memcpy_htod(&ht, &mut self.ht).map_err(err)?;
        stream.synchronize().map_err(err)
    }
}
