//! The settings lasp-shmem takes from the process environment, checked, and the NVSHMEM settings
//! it relies on.
//!
//! # The environment is read, never written
//!
//! NVSHMEM reads its `NVSHMEM_*` variables from the process environment, once, when it
//! initialises, and its init attribute (`nvshmemx_init_attr_t`) carries only the bootstrap's
//! arguments (unique id, rank, size, an MPI communicator), none of these settings. Writing the
//! environment from a library is unsound once other threads may run (`setenv` races with every
//! `getenv`; PyTorch, for one, runs several threads before any user code), so lasp-shmem never
//! does: the settings must be in the environment before the process starts its threads.
//!
//! - `lasp-run` puts [`launcher_nvshmem_defaults`] into the environment of the ranks it starts.
//! - A job script or another launcher exports them itself (`mpirun -x`, `srun --export`).
//! - A Rust program may put [`nvshmem_defaults`] for its own [`crate::Config`] into its
//!   environment at the top of `main`, before it starts any thread
//!   ([`crate::Config::nvshmem_env`] lists them).
//!
//! Every default gives way to a value the environment already has. [`crate::Runtime::init`]
//! checks what it reads ([`check_environment`]): a malformed value, a heap NVSHMEM's default
//! cannot hold or an MPI job without NVSHMEM's MPI bootstrap is an error that names the variable
//! and what to set, never a silent fallback.

use crate::error::{Error, Result};
use crate::launch_env::Bootstrap;
use std::time::Duration;

/// The bound on device waits, in milliseconds (a positive integer).
pub const WAIT_TIMEOUT_VAR: &str = "LASP_WAIT_TIMEOUT_MS";
/// The bound on device waits when [`WAIT_TIMEOUT_VAR`] is unset.
pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether the sequential NCCL mode gathers in a symmetric NCCL window ("1", the default) or in
/// plain memory ("0"): the two NCCL baselines a benchmark times.
pub const NCCL_WINDOW_VAR: &str = "LASP_NCCL_WINDOW";

/// `LASP_NCCL_WINDOW` as `get` reads it: `None` when unset, an error naming the variable and its
/// value when it is neither 0 nor 1.
pub fn nccl_window(get: impl Fn(&str) -> Option<String>) -> Result<Option<bool>> {
    let Some(text) = get(NCCL_WINDOW_VAR) else {
        return Ok(None);
    };
    match text.trim() {
        "1" => Ok(Some(true)),
        "0" => Ok(Some(false)),
        _ => Err(Error::InvalidArgument(format!(
            "{NCCL_WINDOW_VAR}={text:?}: give 1 (the sequential NCCL mode gathers in a symmetric \
             NCCL window, the default) or 0 (in plain memory), or unset it"
        ))),
    }
}

/// NVSHMEM's symmetric heap size per PE.
pub const SYMMETRIC_SIZE_VAR: &str = "NVSHMEM_SYMMETRIC_SIZE";
/// NVSHMEM's symmetric heap when [`SYMMETRIC_SIZE_VAR`] is unset (1 GiB, NVSHMEM 3.x).
pub const NVSHMEM_DEFAULT_HEAP_BYTES: usize = 1 << 30;
/// The bootstrap plugin NVSHMEM uses when not initialised by unique id (default `PMI`).
pub const BOOTSTRAP_VAR: &str = "NVSHMEM_BOOTSTRAP";

/// `LASP_WAIT_TIMEOUT_MS` as `get` reads it: `None` when unset, an error naming the variable, its
/// value and the expected form when it is not a positive integer.
pub fn wait_timeout(get: impl Fn(&str) -> Option<String>) -> Result<Option<Duration>> {
    let Some(text) = get(WAIT_TIMEOUT_VAR) else {
        return Ok(None);
    };
    match text.trim().parse::<u64>() {
        Ok(ms) if ms > 0 => Ok(Some(Duration::from_millis(ms))),
        _ => Err(Error::InvalidArgument(format!(
            "{WAIT_TIMEOUT_VAR}={text:?} is not a timeout: give a positive whole number of \
             milliseconds (e.g. {WAIT_TIMEOUT_VAR}=10000 for 10 s), or unset it for the default \
             of {} ms",
            DEFAULT_WAIT_TIMEOUT.as_millis()
        ))),
    }
}

/// A size as NVSHMEM reads `NVSHMEM_SYMMETRIC_SIZE`: a non-negative number (integer or decimal),
/// optionally followed by one of the binary multipliers k, m, g, t (either case), after which
/// anything is ignored; `None` for anything NVSHMEM would reject.
pub fn parse_nvshmem_size(text: &str) -> Option<usize> {
    let text = text.trim_start();
    // The longest prefix that reads as a number (as C's `%lf` takes it).
    let (value, rest) = (1..=text.len())
        .rev()
        .filter(|&end| text.is_char_boundary(end))
        .find_map(|end| {
            let number = &text[..end];
            let first = number.as_bytes()[0];
            // Rust also reads "inf" and "nan"; NVSHMEM's sizes are plain numbers.
            (first.is_ascii_digit() || first == b'.')
                .then(|| number.parse::<f64>().ok())
                .flatten()
                .map(|v| (v, &text[end..]))
        })?;
    let shift = match rest.chars().next() {
        None => 0,
        Some('k' | 'K') => 10,
        Some('m' | 'M') => 20,
        Some('g' | 'G') => 30,
        Some('t' | 'T') => 40,
        Some(_) => return None,
    };
    let bytes = (value * (1u64 << shift) as f64).ceil();
    (bytes.is_finite() && bytes >= 0.0 && bytes <= usize::MAX as f64).then_some(bytes as usize)
}

/// The `NVSHMEM_*` settings lasp-shmem relies on, as `(name, value)`, leaving out every variable
/// `get` finds set (the environment's value wins):
///
/// - `NVSHMEM_DISABLE_NVLS=1`: NVLink multicast can map huge ranges and has taken shared nodes
///   out of service;
/// - `NVSHMEM_SYMMETRIC_SIZE=heap_bytes` when given: the heap is reserved once, at init;
/// - `NVSHMEM_REMOTE_TRANSPORT=none` when every rank runs on this node: no network transport is
///   needed, and probing for one fails noisily on hosts without HCAs;
/// - `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME` = `NCCL_SOCKET_IFNAME` when that is set;
/// - `NVSHMEM_BOOTSTRAP=MPI` or `PMI` for those bootstraps.
pub fn nvshmem_defaults(
    heap_bytes: Option<usize>,
    single_node: bool,
    bootstrap: Option<&Bootstrap>,
    get: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String)> {
    let mut wanted = vec![("NVSHMEM_DISABLE_NVLS", "1".to_string())];
    if let Some(bytes) = heap_bytes {
        wanted.push((SYMMETRIC_SIZE_VAR, bytes.to_string()));
    }
    if single_node {
        wanted.push(("NVSHMEM_REMOTE_TRANSPORT", "none".into()));
    }
    if let Some(ifname) = get("NCCL_SOCKET_IFNAME") {
        wanted.push(("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", ifname));
    }
    match bootstrap {
        Some(Bootstrap::Mpi) => wanted.push((BOOTSTRAP_VAR, "MPI".into())),
        Some(Bootstrap::Pmi) => wanted.push((BOOTSTRAP_VAR, "PMI".into())),
        Some(Bootstrap::UniqueId(_) | Bootstrap::Guest) | None => {}
    }
    wanted.retain(|(name, _)| get(name).is_none());
    wanted
}

/// What a launcher that starts every rank on this node with the unique-id bootstrap (`lasp-run`)
/// puts into its ranks' environment: [`nvshmem_defaults`] without the heap size, which only the
/// program knows (NVSHMEM's default, [`NVSHMEM_DEFAULT_HEAP_BYTES`], applies unless the program
/// or the caller sets it).
pub fn launcher_nvshmem_defaults(
    get: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, String)> {
    nvshmem_defaults(None, true, None, get)
}

/// The checks [`crate::Runtime::init`] makes of the environment `get` reads, before NVSHMEM
/// reads it: the settings are well formed, the symmetric heap can hold `heap_bytes`, and an MPI
/// bootstrap is selected for NVSHMEM too.
pub fn check_environment(
    heap_bytes: usize,
    bootstrap: &Bootstrap,
    get: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    wait_timeout(&get)?;
    crate::exchange::emulated_links::LinkEmulation::from_lookup(&get)?;
    match get(SYMMETRIC_SIZE_VAR) {
        Some(text) => {
            // A value the caller set is theirs, even if smaller than `heap_bytes` (allocations
            // past it fail with a message that says so); it must only be readable.
            parse_nvshmem_size(&text).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{SYMMETRIC_SIZE_VAR}={text:?} is not a size: give bytes as a number with an \
                     optional k, m, g or t suffix (e.g. {SYMMETRIC_SIZE_VAR}=2G)"
                ))
            })?;
        }
        None if heap_bytes > NVSHMEM_DEFAULT_HEAP_BYTES => {
            return Err(Error::InvalidArgument(format!(
                "the symmetric heap needs {heap_bytes} bytes (Config::symmetric_heap_bytes plus \
                 NVSHMEM's own buffers), more than NVSHMEM's default of {NVSHMEM_DEFAULT_HEAP_BYTES}; \
                 NVSHMEM reads the size from the environment once and lasp-shmem does not write \
                 the environment: start the process with {SYMMETRIC_SIZE_VAR}={heap_bytes} (or more)"
            )));
        }
        None => {}
    }
    if *bootstrap == Bootstrap::Mpi && get(BOOTSTRAP_VAR).is_none() {
        return Err(Error::Launch(format!(
            "this rank was started by mpirun (or LASP_BOOTSTRAP=mpi), but NVSHMEM uses its MPI \
             bootstrap only when {BOOTSTRAP_VAR}=MPI is in the environment, and lasp-shmem does \
             not write the environment: start the ranks with it (mpirun -x {BOOTSTRAP_VAR}=MPI)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch_env::Rendezvous;
    use std::collections::HashMap;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn a_malformed_wait_timeout_is_an_error_that_names_it() {
        assert_eq!(wait_timeout(lookup(&[])).unwrap(), None);
        assert_eq!(
            wait_timeout(lookup(&[(WAIT_TIMEOUT_VAR, "2500")])).unwrap(),
            Some(Duration::from_millis(2500))
        );
        for bad in ["10s", "", "-5", "0", "1.5"] {
            let msg = wait_timeout(lookup(&[(WAIT_TIMEOUT_VAR, bad)]))
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(&format!("LASP_WAIT_TIMEOUT_MS={bad:?}"))
                    && msg.contains("positive whole number of milliseconds"),
                "{msg}"
            );
        }
    }

    #[test]
    fn the_nccl_window_setting_is_one_or_zero() {
        assert_eq!(nccl_window(lookup(&[])).unwrap(), None);
        assert_eq!(
            nccl_window(lookup(&[(NCCL_WINDOW_VAR, "0")])).unwrap(),
            Some(false)
        );
        assert_eq!(
            nccl_window(lookup(&[(NCCL_WINDOW_VAR, " 1")])).unwrap(),
            Some(true)
        );
        for bad in ["yes", "", "2"] {
            let msg = nccl_window(lookup(&[(NCCL_WINDOW_VAR, bad)]))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(&format!("LASP_NCCL_WINDOW={bad:?}")), "{msg}");
        }
    }

    #[test]
    fn sizes_read_as_nvshmem_reads_them() {
        assert_eq!(parse_nvshmem_size("1073741824"), Some(1 << 30));
        assert_eq!(parse_nvshmem_size("20m"), Some(20 << 20));
        assert_eq!(parse_nvshmem_size("2G"), Some(2 << 30));
        assert_eq!(parse_nvshmem_size("3.1M"), Some(3250586));
        assert_eq!(parse_nvshmem_size(".5m"), Some(1 << 19));
        assert_eq!(parse_nvshmem_size("20kk"), Some(20 << 10));
        assert_eq!(parse_nvshmem_size("1t"), Some(1 << 40));
        for bad in ["", "10s", "k", "-1", "inf", "nan", "G2"] {
            assert_eq!(parse_nvshmem_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn defaults_give_way_to_the_environment() {
        let uid = Bootstrap::UniqueId(Rendezvous::Alone);
        let all = nvshmem_defaults(Some(512 << 20), true, Some(&uid), lookup(&[]));
        assert_eq!(
            all,
            vec![
                ("NVSHMEM_DISABLE_NVLS", "1".to_string()),
                ("NVSHMEM_SYMMETRIC_SIZE", (512usize << 20).to_string()),
                ("NVSHMEM_REMOTE_TRANSPORT", "none".to_string()),
            ]
        );
        let set = lookup(&[
            ("NVSHMEM_DISABLE_NVLS", "0"),
            ("NCCL_SOCKET_IFNAME", "eth1"),
        ]);
        assert_eq!(
            nvshmem_defaults(None, false, Some(&Bootstrap::Mpi), set),
            vec![
                ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "eth1".to_string()),
                ("NVSHMEM_BOOTSTRAP", "MPI".to_string()),
            ]
        );
        assert_eq!(
            launcher_nvshmem_defaults(lookup(&[("NVSHMEM_REMOTE_TRANSPORT", "ibrc")])),
            vec![("NVSHMEM_DISABLE_NVLS", "1".to_string())]
        );
    }

    #[test]
    fn the_environment_is_checked_before_nvshmem_reads_it() {
        let uid = Bootstrap::UniqueId(Rendezvous::Alone);
        assert!(check_environment(512 << 20, &uid, lookup(&[])).is_ok());
        let msg = check_environment(2 << 30, &uid, lookup(&[]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("NVSHMEM_SYMMETRIC_SIZE=2147483648"), "{msg}");
        // A size the caller set is theirs; it only has to be readable.
        assert!(check_environment(2 << 30, &uid, lookup(&[(SYMMETRIC_SIZE_VAR, "1G")])).is_ok());
        let msg = check_environment(1, &uid, lookup(&[(SYMMETRIC_SIZE_VAR, "lots")]))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("NVSHMEM_SYMMETRIC_SIZE=\"lots\" is not a size"),
            "{msg}"
        );
        let msg = check_environment(1, &uid, lookup(&[(WAIT_TIMEOUT_VAR, "10s")]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("LASP_WAIT_TIMEOUT_MS=\"10s\""), "{msg}");
        let msg = check_environment(1, &Bootstrap::Mpi, lookup(&[]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("NVSHMEM_BOOTSTRAP=MPI"), "{msg}");
        assert!(check_environment(1, &Bootstrap::Mpi, lookup(&[(BOOTSTRAP_VAR, "MPI")])).is_ok());
        assert!(check_environment(1, &Bootstrap::Pmi, lookup(&[])).is_ok());
    }
}
