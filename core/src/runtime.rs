//! The process-wide NVSHMEM runtime: explicit init, the kernel module, symmetric allocation,
//! barriers, and an explicit collective shutdown.
//!
//! Order: the environment checked; GPU context first; host
//! library and version check; bootstrap and `hostlib_init_attr`; init status checked; cubin
//! loaded and registered with `nvshmemx_cumodule_init`. Shutdown reverses it: synchronise, free
//! symmetric memory (collective, newest first), unregister and unload the module, finalize.

use crate::error::{CudaCall, Error, Result};
use crate::exchange::emulated_links::LinkEmulation;
use crate::kernel::Module;
use crate::launch_env::{Bootstrap, LaunchEnv, Rendezvous};
use crate::nvshmem::Nvshmem;
use crate::rendezvous::ID_BYTES;
use crate::{gpu, rendezvous, settings};
use cudarc::driver::{CudaContext, CudaStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Settings of [`Runtime::init`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Symmetric memory the program will allocate, in bytes. NVSHMEM reserves its heap once at
    /// init, sized by `NVSHMEM_SYMMETRIC_SIZE` from the environment (1 GiB when unset), which
    /// lasp-shmem does not write: [`Config::nvshmem_env`] gives the value that fits this field
    /// (with headroom for NVSHMEM's own buffers), and [`Runtime::init`] refuses a field the
    /// default heap cannot hold when the variable is unset.
    pub symmetric_heap_bytes: usize,
    /// Bound on every device-side wait on another PE; an expired wait becomes
    /// [`Error::PeerTimeout`]. Default: `LASP_WAIT_TIMEOUT_MS`, else 10 s.
    pub wait_timeout: Duration,
    /// Bound on the bootstrap rendezvous. Default: 120 s.
    pub rendezvous_timeout: Duration,
    /// An explicit `libnvshmem_host.so.3` (else `NVSHMEM_HOME`, else the usual places).
    pub nvshmem_library: Option<PathBuf>,
    /// InfiniBand's rate and latency emulated between groups of PEs, for measuring the exchange
    /// across nodes on one node ([`LinkEmulation`]). Default: `LASP_EMULATE_LINKS`, else none
    /// (the real links).
    pub link_emulation: Option<LinkEmulation>,
    /// Whether the sequential NCCL mode gathers in a symmetric NCCL window where NCCL can
    /// register one (NCCL 2.27 on), else in plain memory: the faster and the classic NCCL
    /// baselines. Default: `LASP_NCCL_WINDOW` (1 or 0), else true.
    pub nccl_window: bool,
}

impl Config {
    /// The defaults, with `LASP_WAIT_TIMEOUT_MS` from the process environment; a malformed value
    /// is an [`Error::InvalidArgument`] that names it.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(process_env)
    }

    /// [`Config::from_env`] with the variables read through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let wait_timeout = settings::wait_timeout(&get)?.unwrap_or(settings::DEFAULT_WAIT_TIMEOUT);
        Ok(Config {
            symmetric_heap_bytes: 256 << 20,
            wait_timeout,
            rendezvous_timeout: Duration::from_secs(120),
            nvshmem_library: None,
            link_emulation: LinkEmulation::from_lookup(&get)?,
            nccl_window: settings::nccl_window(&get)?.unwrap_or(true),
        })
    }

    /// The symmetric heap NVSHMEM needs for this configuration: [`Config::symmetric_heap_bytes`]
    /// and NVSHMEM's own allocations.
    pub fn nvshmem_heap_bytes(&self) -> usize {
        self.symmetric_heap_bytes.saturating_add(HEAP_HEADROOM)
    }

    /// The `NVSHMEM_*` settings a process that runs with this configuration at `env` should
    /// start with, as `(name, value)`, leaving out those the process environment already sets
    /// ([`settings::nvshmem_defaults`]). NVSHMEM reads them once, from the environment, and
    /// lasp-shmem never writes it: put them there before the process starts its threads (a
    /// launcher's environment for its ranks, or the top of `main`).
    pub fn nvshmem_env(&self, env: &LaunchEnv) -> Vec<(&'static str, String)> {
        settings::nvshmem_defaults(
            Some(self.nvshmem_heap_bytes()),
            env.single_node(),
            Some(&env.bootstrap),
            process_env,
        )
    }
}

impl Default for Config {
    /// As [`Config::from_env`], except that a malformed `LASP_WAIT_TIMEOUT_MS` leaves the 10 s
    /// default here; [`Runtime::init`] then refuses to start with it.
    fn default() -> Self {
        Self::from_env().unwrap_or_else(|_| {
            Self::from_lookup(|_| None).expect("the defaults need no environment")
        })
    }
}

/// A variable of the process environment; a value that is not UTF-8 is read with its invalid
/// bytes replaced, so it shows up as malformed instead of as unset.
fn process_env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}

/// NVSHMEM's own symmetric allocations (teams, collectives' scratch) on top of ours.
const HEAP_HEADROOM: usize = 256 << 20;

/// Only one NVSHMEM world can exist per process: a second init with other ranks would be
/// silently ignored by NVSHMEM (NVIDIA/nvshmem issue #68), so it is refused here.
static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// A handle to the initialised runtime. Clones share it; [`Runtime::shutdown`] needs the last one.
///
/// # NVSHMEM's settings come from the environment
///
/// NVSHMEM reads its `NVSHMEM_*` variables (heap size, transports, bootstrap plugin) from the
/// process environment once, at init; its init attribute carries none of them. lasp-shmem never
/// writes the environment (a `setenv` races with `getenv` on every other thread), so they must be
/// set before the process starts threads: `lasp-run` sets the launcher's share for its ranks
/// ([`settings::launcher_nvshmem_defaults`]), [`Config::nvshmem_env`] lists what a given
/// configuration needs, and [`Runtime::init`] checks what it can ([`settings::check_environment`]):
/// a malformed `LASP_WAIT_TIMEOUT_MS` or `NVSHMEM_SYMMETRIC_SIZE`, a heap larger than NVSHMEM's
/// default with no `NVSHMEM_SYMMETRIC_SIZE`, or an MPI job without `NVSHMEM_BOOTSTRAP` are errors
/// that name what to set.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) nvshmem: Nvshmem,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) env: LaunchEnv,
    pub(crate) module: Module,
    /// Symmetric allocations still live, oldest first (freed newest first at shutdown).
    pub(crate) allocations: Mutex<Vec<u64>>,
    pub(crate) wait_timeout: Duration,
    link_emulation: Option<LinkEmulation>,
    nccl_window: bool,
    finalized: AtomicBool,
    /// Whether this runtime initialised NVSHMEM (and so finalizes it), or joined the NVSHMEM
    /// another library of the process initialised ([`Runtime::attach`]), which stays theirs.
    owns_nvshmem: bool,
}

impl Runtime {
    /// Initialises NVSHMEM for this process, as the launch environment describes it
    /// ([`LaunchEnv::from_process_env`]). Collective: every rank must call it. See the type's
    /// documentation for the `NVSHMEM_*` settings it expects in the environment.
    pub fn init(config: Config) -> Result<Self> {
        Self::init_with(config, LaunchEnv::from_process_env()?)
    }

    /// Initialises NVSHMEM for this process at the place in the job `env` gives (for a caller
    /// with its own launcher: [`LaunchEnv::explicit`] with the id of
    /// [`Runtime::create_unique_id`], handed to every rank by the caller's own collective).
    /// Collective: every rank must call it.
    pub fn init_with(config: Config, env: LaunchEnv) -> Result<Self> {
        settings::check_environment(config.nvshmem_heap_bytes(), &env.bootstrap, process_env)?;
        if INITIALIZED.swap(true, Ordering::SeqCst) {
            return Err(Error::State(
                "lasp-shmem is already initialised in this process; share the Runtime handle (it is Clone) instead of initialising twice".into(),
            ));
        }
        let result = Self::init_once(config, env);
        if result.is_err() {
            INITIALIZED.store(false, Ordering::SeqCst);
        }
        result
    }

    /// Joins the NVSHMEM that another library of this process has initialised (PyTorch's
    /// SymmetricMemory NVSHMEM backend), on GPU `device` (the process's current CUDA device),
    /// instead of initialising it: the PEs are NVSHMEM's, the symmetric heap and its settings are
    /// the other library's, and [`Runtime::shutdown`] releases only what lasp-shmem allocated and
    /// registered, never finalizing NVSHMEM. Collective over NVSHMEM's PEs (the module
    /// registration and later symmetric allocations are).
    ///
    /// The process must hold exactly the NVSHMEM release the kernels were built with (both are
    /// named otherwise): the other library's host library runs lasp-shmem's device code.
    pub fn attach(config: Config, device: usize) -> Result<Self> {
        if INITIALIZED.swap(true, Ordering::SeqCst) {
            return Err(Error::State(
                "lasp-shmem is already initialised in this process; share the Runtime handle (it is Clone) instead of initialising twice".into(),
            ));
        }
        let result = Self::attach_once(config, device);
        if result.is_err() {
            INITIALIZED.store(false, Ordering::SeqCst);
        }
        result
    }

    fn attach_once(config: Config, device: usize) -> Result<Self> {
        let ctx = gpu::open_gpu(device)?;
        // The other library's copy of NVSHMEM, wherever it was loaded from: a second copy would
        // be a second, uninitialised NVSHMEM. `config.nvshmem_library` does not apply.
        let nvshmem = Nvshmem::new(nvshmem_sys::load_resident()?);
        let (host, built) = (
            nvshmem.version(),
            lasp_shmem_kernels::NVSHMEM_DEVICE_VERSION,
        );
        if (host.0 as u32, host.1 as u32, host.2 as u32) != built {
            return Err(Error::State(format!(
                "this process runs NVSHMEM {}.{}.{} (initialised by another library), but                  lasp-shmem's kernels were built with NVSHMEM {}.{}.{}; joining it needs the same                  release: install nvidia-nvshmem-cu13=={}.{}.{} for both, or rebuild lasp-shmem                  against the process's NVSHMEM (NVSHMEM_HOME)",
                host.0, host.1, host.2, built.0, built.1, built.2, built.0, built.1, built.2
            )));
        }
        let Some((pe, npes)) = nvshmem.initialized_place() else {
            return Err(Error::State(
                "NVSHMEM is not initialised in this process, so there is nothing to join; start                  it with Runtime::init (or lasp_runtime_init) instead"
                    .into(),
            ));
        };
        ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        let stream = ctx.new_stream().cuda_call("cuStreamCreate")?;
        let module = Module::load(nvshmem, &ctx)?;
        let gpus = gpu::visible_gpu_count()?;
        Ok(Runtime {
            inner: Arc::new(Inner {
                nvshmem,
                ctx,
                stream,
                env: LaunchEnv {
                    rank: pe,
                    world_size: npes,
                    local_rank: device,
                    local_world_size: gpus.min(npes),
                    bootstrap: Bootstrap::Guest,
                },
                module,
                allocations: Mutex::new(Vec::new()),
                wait_timeout: config.wait_timeout,
                link_emulation: config.link_emulation,
                nccl_window: config.nccl_window,
                finalized: AtomicBool::new(false),
                owns_nvshmem: false,
            }),
        })
    }

    /// Rank 0's part of a bootstrap by unique id that the caller distributes itself: the id
    /// every rank then passes to [`Runtime::init_with`] in a
    /// [`Rendezvous::Given`]. Call it on rank 0 only,
    /// before any rank initialises, with the `config` rank 0 will initialise with (NVSHMEM may
    /// read its settings here already). `single_node` is not needed any more: the settings come
    /// from the environment (see [`Runtime`]).
    pub fn create_unique_id(config: &Config, single_node: bool) -> Result<[u8; ID_BYTES]> {
        let _ = single_node;
        settings::check_environment(
            config.nvshmem_heap_bytes(),
            &Bootstrap::UniqueId(Rendezvous::Alone),
            process_env,
        )?;
        let nvshmem = load_checked(config)?;
        nvshmem.unique_id()
    }

    fn init_once(config: Config, env: LaunchEnv) -> Result<Self> {
        let ctx = gpu::open_gpu(env.local_rank)?;
        let nvshmem = load_checked(&config)?;
        let unique_id =
            match &env.bootstrap {
                Bootstrap::UniqueId(rdv) => Some(rendezvous::share_id(
                    rdv,
                    env.rank,
                    env.world_size,
                    config.rendezvous_timeout,
                    || nvshmem.unique_id(),
                )?),
                // NVSHMEM_BOOTSTRAP in the environment selects the plugin (checked in init_with).
                Bootstrap::Pmi | Bootstrap::Mpi => None,
                Bootstrap::Guest => return Err(Error::Launch(
                    "this launch environment describes a runtime that joined another library's \
                     NVSHMEM; such a runtime comes from Runtime::attach, not from init"
                        .into(),
                )),
            };
        ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        // SAFETY: INITIALIZED admits one initialisation per process; the primary context is
        // current on this thread (open_gpu bound it, and it is bound again just above).
        let (pe, npes) =
            unsafe { nvshmem.init(unique_id.as_ref().map(|id| (id, env.rank, env.world_size)))? };
        if pe != env.rank || npes != env.world_size {
            return Err(Error::Launch(format!(
                "NVSHMEM made this process PE {pe} of {npes}, but the launcher said rank {} of {}; every rank must be started by the same launcher",
                env.rank, env.world_size
            )));
        }
        ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        let stream = ctx.new_stream().cuda_call("cuStreamCreate")?;
        let module = Module::load(nvshmem, &ctx)?;
        Ok(Runtime {
            inner: Arc::new(Inner {
                nvshmem,
                ctx,
                stream,
                env,
                module,
                allocations: Mutex::new(Vec::new()),
                wait_timeout: config.wait_timeout,
                link_emulation: config.link_emulation,
                nccl_window: config.nccl_window,
                finalized: AtomicBool::new(false),
                owns_nvshmem: true,
            }),
        })
    }

    /// This process's PE (= rank).
    pub fn pe(&self) -> usize {
        self.inner.env.rank
    }

    /// The number of PEs.
    pub fn npes(&self) -> usize {
        self.inner.env.world_size
    }

    /// The launch environment this runtime was initialised from.
    pub fn launch_env(&self) -> &LaunchEnv {
        &self.inner.env
    }

    /// The GPU context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The runtime's own stream: collectives of the runtime run on it, and symmetric buffers
    /// report it to cudarc.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Bound on device waits, as configured.
    pub fn wait_timeout(&self) -> Duration {
        self.inner.wait_timeout
    }

    /// The emulated links between groups of PEs, if configured ([`Config::link_emulation`]).
    pub fn link_emulation(&self) -> Option<&LinkEmulation> {
        self.inner.link_emulation.as_ref()
    }

    /// Whether the sequential NCCL mode gathers in a symmetric NCCL window where NCCL can register
    /// one ([`Config::nccl_window`]).
    pub fn nccl_window(&self) -> bool {
        self.inner.nccl_window
    }

    /// The kernel module loaded for this GPU.
    pub fn module(&self) -> &Module {
        &self.inner.module
    }

    /// A barrier across all PEs, ordered on `stream` (no host synchronisation). Collective.
    pub fn barrier_on_stream(&self, stream: &CudaStream) -> Result<()> {
        self.check_stream(stream)?;
        // SAFETY: NVSHMEM is initialised (self exists); the stream belongs to its context
        // (checked above); every PE makes the same collective calls (this fn's contract, which
        // a missing PE breaks only into a hang bounded by nothing but the job's timeout).
        unsafe { self.inner.nvshmem.barrier_all_on_stream(stream) };
        Ok(())
    }

    /// Binds the runtime's context and checks that `stream` belongs to it.
    fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .cuda_call("cuCtxSetCurrent")?;
        if stream.context().cu_ctx() != self.inner.ctx.cu_ctx() {
            return Err(Error::InvalidArgument(
                "the stream belongs to another CUDA context than the runtime's; create it with \
                 runtime.context().new_stream()"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Broadcasts `bytes` of PE `root` to every PE (collective; every PE passes a buffer of the
    /// same length and receives root's contents). For small host values such as NCCL ids.
    pub fn broadcast_bytes(&self, bytes: &mut [u8], root: usize) -> Result<()> {
        if root >= self.npes() {
            return Err(Error::InvalidArgument(format!(
                "broadcast root {root} is not a PE (there are {})",
                self.npes()
            )));
        }
        let mut scratch = self.alloc::<u8>(bytes.len())?;
        let stream = self.stream().clone();
        if self.pe() == root {
            stream
                .memcpy_htod(bytes, &mut scratch)
                .cuda_call("cuMemcpyHtoDAsync")?;
        }
        self.barrier_on_stream(&stream)?;
        if self.pe() != root {
            // SAFETY: scratch is symmetric and holds bytes.len() bytes on every PE; root wrote
            // its copy before the barrier above and nothing writes it until the free below,
            // which synchronises the stream first.
            unsafe {
                self.inner.nvshmem.getmem_on_stream(
                    &stream,
                    scratch.raw(),
                    scratch.raw(),
                    bytes.len(),
                    root,
                )
            };
        }
        stream
            .memcpy_dtoh(&scratch, bytes)
            .cuda_call("cuMemcpyDtoHAsync")?;
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        self.free(scratch)
    }

    /// Every PE's `value`, indexed by PE (collective; returns on every PE after the exchange).
    /// For agreeing on host-side facts such as plan fingerprints before any data moves.
    pub fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>> {
        let npes = self.npes();
        let mut mine = self.alloc::<u64>(1)?;
        let all = self.alloc::<u64>(npes)?;
        let stream = self.stream().clone();
        stream
            .memcpy_htod(&[value], &mut mine)
            .cuda_call("cuMemcpyHtoDAsync")?;
        // SAFETY: `mine` (8 bytes) and `all` (npes x 8) are distinct symmetric buffers that every
        // PE allocated in the same order; nothing else touches them, and they are freed only
        // after the stream is synchronised below.
        unsafe { self.fcollect_on_stream(&stream, all.raw(), mine.raw(), 8)? };
        let mut values = vec![0u64; npes];
        stream
            .memcpy_dtoh(&all, &mut values)
            .cuda_call("cuMemcpyDtoHAsync")?;
        stream.synchronize().cuda_call("cuStreamSynchronize")?;
        self.free(all)?;
        self.free(mine)?;
        Ok(values)
    }

    /// NVSHMEM's on-stream all-gather of `bytes` per PE from `src` into `dest` (`[npes][bytes]`),
    /// ordered on `stream` (collective).
    ///
    /// # Safety
    /// Every PE makes the same call with the same offsets. `src .. src + bytes` and `dest ..
    /// dest + npes * bytes` lie inside symmetric buffers of this runtime (from [`Runtime::alloc`],
    /// the same offsets on every PE), do not overlap, stay allocated, and are not otherwise
    /// accessed (on any stream, on any PE) until the collective has completed on `stream`.
    /// Freeing a buffer synchronises only the runtime's stream, so a caller that enqueues on
    /// another stream must synchronise that one before freeing.
    pub unsafe fn fcollect_on_stream(
        &self,
        stream: &CudaStream,
        dest: u64,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        self.check_stream(stream)?;
        // SAFETY: the caller's contract covers the ranges, the collective and the ordering;
        // NVSHMEM is initialised (self exists) and the stream is of its context (checked above).
        unsafe {
            self.inner
                .nvshmem
                .fcollect_on_stream(stream, dest, src, bytes)
        }
    }

    /// Collective shutdown: synchronises, frees every symmetric buffer still allocated (newest
    /// first, on every PE in the same order), unregisters and unloads the kernel module, and
    /// finalizes NVSHMEM where this runtime initialised it (not after [`Runtime::attach`]). Every PE must call it, after dropping every other handle (buffers and
    /// operations hold one).
    pub fn shutdown(self) -> Result<()> {
        let inner = Arc::try_unwrap(self.inner).map_err(|inner| {
            Error::State(format!(
                "{} other handles to the runtime are alive (symmetric buffers, operations): drop them before shutdown",
                Arc::strong_count(&inner) - 1
            ))
        })?;
        inner.finalize()
    }
}

impl Inner {
    fn finalize(&self) -> Result<()> {
        if self.finalized.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.ctx.bind_to_thread().cuda_call("cuCtxSetCurrent")?;
        self.stream.synchronize().cuda_call("cuStreamSynchronize")?;
        // SAFETY: NVSHMEM is initialised; shutdown is collective, so every PE is here.
        unsafe { self.nvshmem.barrier_all() };
        let mut allocations = self.allocations.lock().unwrap();
        while let Some(ptr) = allocations.pop() {
            // SAFETY: ptr came from nvshmem_malloc; no live buffer refers to it any more (the
            // runtime's last handle is being shut down, and buffers hold one); every PE frees
            // the same allocations newest first.
            unsafe { self.nvshmem.free(ptr) };
        }
        self.module.finalize(self.nvshmem)?;
        if self.owns_nvshmem {
            // SAFETY: collective (as above); every NVSHMEM resource of this process was released
            // above and none is used after this.
            unsafe { self.nvshmem.finalize() };
        }
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.finalized.load(Ordering::SeqCst) {
            // Finalizing is collective: doing it here, on one rank's unwind path, could hang
            // the others. The process exit releases the GPU resources.
            let what = if self.owns_nvshmem {
                "NVSHMEM was not finalized"
            } else {
                "its symmetric buffers and kernel module stay registered with NVSHMEM"
            };
            eprintln!(
                "lasp-shmem: runtime dropped without shutdown(); {what} on PE {}",
                self.env.rank
            );
        }
    }
}

/// Ends the process with `code` after an error, without running exit handlers.
///
/// NVSHMEM registers process-exit handlers that crash (SIGSEGV) when the library was initialised
/// but not finalized, and a rank that fails cannot finalize: finalizing is collective. `_exit`
/// skips those handlers, so a failing rank exits with its own code and message. Standard output
/// and error are flushed first.
pub fn exit_after_error(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: ends the process at once; no Rust code runs after it.
    unsafe { libc::_exit(code) }
}

/// The host library, loaded and checked against the device code linked into our cubins.
fn load_checked(config: &Config) -> Result<Nvshmem> {
    let nvshmem = Nvshmem::new(nvshmem_sys::load(config.nvshmem_library.as_deref())?);
    let (host, device) = (
        nvshmem.version(),
        lasp_shmem_kernels::NVSHMEM_DEVICE_VERSION,
    );
    if !versions_compatible(host, device) {
        return Err(Error::VersionMismatch { host, device });
    }
    Ok(nvshmem)
}

/// The host library must be able to run the device code linked into our cubins: same major,
/// host minor >= device minor (NVSHMEM's own rule, checked here with both numbers in the error).
pub(crate) fn versions_compatible(host: (i32, i32, i32), device: (u32, u32, u32)) -> bool {
    host.0 as u32 == device.0 && host.1 as u32 >= device.1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvshmem_version_rule_and_message() {
        assert!(versions_compatible((3, 4, 5), (3, 4, 5)));
        assert!(versions_compatible((3, 5, 0), (3, 4, 5)));
        assert!(!versions_compatible((3, 3, 9), (3, 4, 5)));
        assert!(!versions_compatible((4, 4, 5), (3, 4, 5)));
        let msg = Error::VersionMismatch {
            host: (3, 3, 9),
            device: (3, 4, 5),
        }
        .to_string();
        assert!(msg.contains("3.3.9") && msg.contains("3.4.5"), "{msg}");
    }

    #[test]
    fn a_malformed_wait_timeout_is_an_error_not_the_default() {
        let config = |value: &str| {
            let value = value.to_string();
            Config::from_lookup(move |name| (name == "LASP_WAIT_TIMEOUT_MS").then(|| value.clone()))
        };
        assert_eq!(
            config("2500").unwrap().wait_timeout,
            Duration::from_millis(2500)
        );
        let msg = config("10s").unwrap_err().to_string();
        assert!(
            msg.contains("LASP_WAIT_TIMEOUT_MS=\"10s\"") && msg.contains("milliseconds"),
            "{msg}"
        );
        let defaults = Config::from_lookup(|_| None).unwrap();
        assert_eq!(defaults.wait_timeout, Duration::from_secs(10));
        assert_eq!(defaults.nvshmem_heap_bytes(), 512 << 20);
    }
}
