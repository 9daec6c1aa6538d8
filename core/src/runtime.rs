//! The process-wide NVSHMEM runtime: explicit init, the kernel module, symmetric allocation,
//! barriers, and an explicit collective shutdown.
//!
//! Order: GPU context first; NVSHMEM_* settings before the
//! library reads them; host library and version check; bootstrap and `hostlib_init_attr`; init
//! status checked; cubin loaded and registered with `nvshmemx_cumodule_init`. Shutdown reverses
//! it: synchronise, free symmetric memory (collective, newest first), unregister and unload the
//! module, finalize.

use crate::error::{Error, Result};
use crate::kernel::Module;
use crate::launch_env::{Bootstrap, LaunchEnv, Rendezvous};
use crate::rendezvous::ID_BYTES;
use crate::{gpu, rendezvous};
use cudarc::driver::{CudaContext, CudaStream};
use nvshmem_sys::NvshmemHost;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Settings of [`Runtime::init`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Symmetric memory the program will allocate, in bytes. NVSHMEM reserves its heap once at
    /// init, so this sizes `NVSHMEM_SYMMETRIC_SIZE` (with headroom for NVSHMEM's own buffers)
    /// unless the environment already sets it.
    pub symmetric_heap_bytes: usize,
    /// Bound on every device-side wait on another PE; an expired wait becomes
    /// [`Error::PeerTimeout`]. Default: `LASP_WAIT_TIMEOUT_MS`, else 10 s.
    pub wait_timeout: Duration,
    /// Bound on the bootstrap rendezvous. Default: 120 s.
    pub rendezvous_timeout: Duration,
    /// An explicit `libnvshmem_host.so.3` (else `NVSHMEM_HOME`, else the usual places).
    pub nvshmem_library: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        let wait_ms = std::env::var("LASP_WAIT_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(10_000);
        Config {
            symmetric_heap_bytes: 256 << 20,
            wait_timeout: Duration::from_millis(wait_ms),
            rendezvous_timeout: Duration::from_secs(120),
            nvshmem_library: None,
        }
    }
}

/// NVSHMEM's own symmetric allocations (teams, collectives' scratch) on top of ours.
const HEAP_HEADROOM: usize = 256 << 20;

/// Only one NVSHMEM world can exist per process: a second init with other ranks would be
/// silently ignored by NVSHMEM (NVIDIA/nvshmem issue #68), so it is refused here.
static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// A handle to the initialised runtime. Clones share it; [`Runtime::shutdown`] needs the last one.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) lib: &'static NvshmemHost,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) env: LaunchEnv,
    pub(crate) module: Module,
    /// Symmetric allocations still live, oldest first (freed newest first at shutdown).
    pub(crate) allocations: Mutex<Vec<u64>>,
    pub(crate) wait_timeout: Duration,
    finalized: AtomicBool,
}

impl Runtime {
    /// Initialises NVSHMEM for this process, as the launch environment describes it
    /// ([`LaunchEnv::from_process_env`]). Collective: every rank must call it.
    pub fn init(config: Config) -> Result<Self> {
        Self::init_with(config, LaunchEnv::from_process_env()?)
    }

    /// Initialises NVSHMEM for this process at the place in the job `env` gives (for a caller
    /// with its own launcher: [`LaunchEnv::explicit`] with the id of
    /// [`Runtime::create_unique_id`], handed to every rank by the caller's own collective).
    /// Collective: every rank must call it.
    pub fn init_with(config: Config, env: LaunchEnv) -> Result<Self> {
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

    /// Rank 0's part of a bootstrap by unique id that the caller distributes itself: the id
    /// every rank then passes to [`Runtime::init_with`] in a
    /// [`Rendezvous::Given`]. Call it on rank 0 only,
    /// before any rank initialises, with the `config` rank 0 will initialise with and whether
    /// every rank runs on this node (NVSHMEM may read its settings here already).
    pub fn create_unique_id(config: &Config, single_node: bool) -> Result<[u8; ID_BYTES]> {
        apply_nvshmem_settings(config, single_node, &Bootstrap::UniqueId(Rendezvous::Alone));
        let lib = nvshmem_sys::load(config.nvshmem_library.as_deref())?;
        check_versions(lib)?;
        new_unique_id(lib)
    }

    fn init_once(config: Config, env: LaunchEnv) -> Result<Self> {
        let ctx = gpu::open_gpu(env.local_rank)?;
        apply_nvshmem_settings(&config, env.single_node(), &env.bootstrap);
        let lib = nvshmem_sys::load(config.nvshmem_library.as_deref())?;
        check_versions(lib)?;

        let mut attr = nvshmem_sys::init_attr_initializer();
        // The unique id must outlive the init call: NVSHMEM keeps a pointer to it.
        let uid: nvshmem_sys::nvshmemx_uniqueid_t;
        let flags = match &env.bootstrap {
            Bootstrap::UniqueId(rdv) => {
                let bytes = rendezvous::share_id(
                    rdv,
                    env.rank,
                    env.world_size,
                    config.rendezvous_timeout,
                    || new_unique_id(lib),
                )?;
                // SAFETY: the bytes came from an nvshmemx_uniqueid_t on rank 0.
                uid = unsafe {
                    std::mem::transmute::<[u8; ID_BYTES], nvshmem_sys::nvshmemx_uniqueid_t>(bytes)
                };
                // SAFETY: uid and attr are valid; uid lives until init returns.
                let rc = unsafe {
                    lib.nvshmemx_set_attr_uniqueid_args(
                        env.rank as i32,
                        env.world_size as i32,
                        &uid,
                        &mut attr,
                    )
                };
                nvshmem_ok("nvshmemx_set_attr_uniqueid_args", rc)?;
                nvshmem_sys::flags_NVSHMEMX_INIT_WITH_UNIQUEID as u32
            }
            // NVSHMEM_BOOTSTRAP (set by apply_nvshmem_settings) selects the plugin.
            Bootstrap::Pmi | Bootstrap::Mpi => 0,
        };
        // SAFETY: attr is version-stamped; the primary context is current on this thread.
        let rc = unsafe { lib.nvshmemx_hostlib_init_attr(flags, &mut attr) };
        nvshmem_ok("nvshmemx_hostlib_init_attr", rc)?;
        // init can return 0 while only bootstrapped (it swallows some failures): check the state.
        // SAFETY: plain query.
        let status = unsafe { lib.nvshmemx_init_status() };
        if status < nvshmem_sys::nvshmemx_init_status_t_NVSHMEM_STATUS_IS_INITIALIZED as i32 {
            return Err(Error::Nvshmem {
                call: "nvshmemx_hostlib_init_attr",
                detail: format!("NVSHMEM is not initialised after init (status {status})"),
            });
        }
        // SAFETY: plain queries after init.
        let (pe, npes) = unsafe { (lib.nvshmem_my_pe(), lib.nvshmem_n_pes()) };
        if pe as usize != env.rank || npes as usize != env.world_size {
            return Err(Error::Launch(format!(
                "NVSHMEM made this process PE {pe} of {npes}, but the launcher said rank {} of {}; every rank must be started by the same launcher",
                env.rank, env.world_size
            )));
        }
        ctx.bind_to_thread()?;
        let stream = ctx.new_stream()?;
        let module = Module::load(lib, &ctx)?;
        Ok(Runtime {
            inner: Arc::new(Inner {
                lib,
                ctx,
                stream,
                env,
                module,
                allocations: Mutex::new(Vec::new()),
                wait_timeout: config.wait_timeout,
                finalized: AtomicBool::new(false),
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

    /// The kernel module loaded for this GPU.
    pub fn module(&self) -> &Module {
        &self.inner.module
    }

    /// A barrier across all PEs, ordered on `stream` (no host synchronisation).
    pub fn barrier_on_stream(&self, stream: &CudaStream) -> Result<()> {
        self.inner.ctx.bind_to_thread()?;
        // SAFETY: the stream belongs to this runtime's context.
        unsafe {
            self.inner
                .lib
                .nvshmemx_barrier_all_on_stream(stream.cu_stream() as _)
        };
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
            stream.memcpy_htod(bytes, &mut scratch)?;
        }
        self.barrier_on_stream(&stream)?;
        if self.pe() != root {
            // SAFETY: scratch is symmetric and holds bytes.len() bytes on every PE.
            unsafe {
                self.inner.lib.nvshmemx_getmem_on_stream(
                    scratch.raw() as _,
                    scratch.raw() as _,
                    bytes.len(),
                    root as i32,
                    stream.cu_stream() as _,
                )
            };
        }
        stream.memcpy_dtoh(&scratch, bytes)?;
        stream.synchronize()?;
        self.free(scratch)
    }

    /// Every PE's `value`, indexed by PE (collective; returns on every PE after the exchange).
    /// For agreeing on host-side facts such as plan fingerprints before any data moves.
    pub fn all_gather_u64(&self, value: u64) -> Result<Vec<u64>> {
        let npes = self.npes();
        let mut mine = self.alloc::<u64>(1)?;
        let all = self.alloc::<u64>(npes)?;
        let stream = self.stream().clone();
        stream.memcpy_htod(&[value], &mut mine)?;
        self.fcollect_on_stream(&stream, all.raw(), mine.raw(), 8)?;
        let mut values = vec![0u64; npes];
        stream.memcpy_dtoh(&all, &mut values)?;
        stream.synchronize()?;
        self.free(all)?;
        self.free(mine)?;
        Ok(values)
    }

    /// NVSHMEM's on-stream all-gather of `bytes` per PE from symmetric `src` into symmetric
    /// `dest` (`[npes][bytes]`), ordered on `stream` (collective; the ranges must not overlap).
    pub fn fcollect_on_stream(
        &self,
        stream: &CudaStream,
        dest: u64,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        // SAFETY: the caller passes symmetric ranges of the sizes fcollect needs.
        let rc = unsafe {
            self.inner.lib.nvshmemx_fcollectmem_on_stream(
                nvshmem_sys::nvshmem_team_id_t_NVSHMEM_TEAM_WORLD,
                dest as _,
                src as _,
                bytes,
                stream.cu_stream() as _,
            )
        };
        nvshmem_ok("nvshmemx_fcollectmem_on_stream", rc)
    }

    /// Collective shutdown: synchronises, frees every symmetric buffer still allocated (newest
    /// first, on every PE in the same order), unregisters and unloads the kernel module, and
    /// finalizes NVSHMEM. Every PE must call it, after dropping every other handle (buffers and
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
        self.ctx.bind_to_thread()?;
        self.stream.synchronize()?;
        // SAFETY: collective; every PE frees the same allocations in the same order.
        unsafe { self.lib.nvshmem_barrier_all() };
        let mut allocations = self.allocations.lock().unwrap();
        while let Some(ptr) = allocations.pop() {
            // SAFETY: ptr came from nvshmem_malloc and no live buffer refers to it any more.
            unsafe { self.lib.nvshmem_free(ptr as _) };
        }
        self.module.finalize(self.lib)?;
        // SAFETY: all NVSHMEM resources of this process are released above.
        unsafe { self.lib.nvshmemx_hostlib_finalize() };
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.finalized.load(Ordering::SeqCst) {
            // Finalizing is collective: doing it here, on one rank's unwind path, could hang
            // the others. The process exit releases the GPU resources.
            eprintln!("lasp-shmem: runtime dropped without shutdown(); NVSHMEM was not finalized on PE {}", self.env.rank);
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

/// A fresh NVSHMEM unique id (rank 0 of a unique-id bootstrap), as plain bytes.
fn new_unique_id(lib: &NvshmemHost) -> Result<[u8; ID_BYTES]> {
    let mut id = nvshmem_sys::uniqueid_initializer();
    // SAFETY: `id` is a valid, version-stamped nvshmemx_uniqueid_t.
    let rc = unsafe { lib.nvshmemx_get_uniqueid(&mut id) };
    nvshmem_ok("nvshmemx_get_uniqueid", rc)?;
    // SAFETY: nvshmemx_uniqueid_t is 128 bytes of plain data.
    Ok(unsafe { std::mem::transmute::<nvshmem_sys::nvshmemx_uniqueid_t, [u8; ID_BYTES]>(id) })
}

pub(crate) fn nvshmem_ok(call: &'static str, rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Nvshmem {
            call,
            detail: format!("returned {rc}"),
        })
    }
}

/// NVSHMEM reads its NVSHMEM_* variables once, at its first call: set ours before that, never
/// overriding what the user set.
fn apply_nvshmem_settings(config: &Config, single_node: bool, bootstrap: &Bootstrap) {
    let set_default = |name: &str, value: String| {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    };
    // NVLink multicast can map huge ranges and has taken shared nodes out of service.
    set_default("NVSHMEM_DISABLE_NVLS", "1".into());
    set_default(
        "NVSHMEM_SYMMETRIC_SIZE",
        (config.symmetric_heap_bytes + HEAP_HEADROOM).to_string(),
    );
    if single_node {
        // No network transport is needed, and probing for one fails noisily on hosts without HCAs.
        set_default("NVSHMEM_REMOTE_TRANSPORT", "none".into());
    }
    if let Ok(ifname) = std::env::var("NCCL_SOCKET_IFNAME") {
        set_default("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", ifname);
    }
    match bootstrap {
        Bootstrap::Mpi => set_default("NVSHMEM_BOOTSTRAP", "MPI".into()),
        Bootstrap::Pmi => set_default("NVSHMEM_BOOTSTRAP", "PMI".into()),
        Bootstrap::UniqueId(_) => {}
    }
}

/// The host library must be able to run the device code linked into our cubins: same major,
/// host minor >= device minor (NVSHMEM's own rule, checked here with both numbers in the error).
fn check_versions(lib: &NvshmemHost) -> Result<()> {
    let (mut major, mut minor, mut patch) = (0, 0, 0);
    // SAFETY: callable before init; writes three ints.
    unsafe { lib.nvshmemx_vendor_get_version_info(&mut major, &mut minor, &mut patch) };
    let device = lasp_shmem_kernels::NVSHMEM_DEVICE_VERSION;
    if !versions_compatible((major, minor, patch), device) {
        return Err(Error::VersionMismatch {
            host: (major, minor, patch),
            device,
        });
    }
    Ok(())
}

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
}
