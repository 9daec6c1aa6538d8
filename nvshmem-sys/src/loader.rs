//! Finds and opens `libnvshmem_host.so.3` once per process.

use crate::NvshmemHost;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The library's SONAME. pip wheels ship only this name, not `libnvshmem_host.so`.
pub const LIBRARY_SONAME: &str = "libnvshmem_host.so.3";

/// Why the host library could not be opened.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LoadError {
    /// No place held a loadable library: every place tried, with the loader's reason, in order.
    NotFound { tried: Vec<(String, String)> },
    /// The process already loaded NVSHMEM's host library from another place; a process holds one
    /// NVSHMEM (its state is process-wide), so another path cannot be honoured.
    AlreadyLoaded { loaded: String, requested: PathBuf },
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NotFound { tried } => {
                write!(f, "could not load {LIBRARY_SONAME} (tried ")?;
                for (i, (place, reason)) in tried.iter().enumerate() {
                    let sep = if i == 0 { "" } else { "; " };
                    write!(f, "{sep}{place}: {reason}")?;
                }
                write!(
                    f,
                    "); install NVSHMEM 3.x (pip install nvidia-nvshmem-cu13==3.4.5) or set \
                     NVSHMEM_HOME to the folder that holds lib/{LIBRARY_SONAME}"
                )
            }
            LoadError::AlreadyLoaded { loaded, requested } => write!(
                f,
                "{LIBRARY_SONAME} was requested from {} but this process already loaded it from \
                 {loaded}, and a process can hold only one NVSHMEM; pass the same path (or none) \
                 on every call",
                requested.display()
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// The library this process loaded, and where from (a path, or the bare SONAME when the dynamic
/// loader's own search found it).
static LIBRARY: OnceLock<(PathBuf, NvshmemHost)> = OnceLock::new();

/// Opens the host library, or returns the one already open.
///
/// Where it looks, in order: `explicit` (a path to the library file) if given, else
/// `$NVSHMEM_HOME/lib/libnvshmem_host.so.3` if `NVSHMEM_HOME` is set; an override that fails is an
/// error, never silently replaced. Without an override: the dynamic loader's own search
/// (`LD_LIBRARY_PATH`, the ld.so cache), then the `nvidia.nvshmem` package of `python3` (a pip
/// install), then `/usr/local/nvshmem/lib` and `/opt/nvidia/nvshmem/lib`.
///
/// A process loads the library once. After that, a call without `explicit` returns it (whatever
/// `NVSHMEM_HOME` says by then), and a call with `explicit` returns it only if `explicit` is the
/// file it was loaded from; another path is [`LoadError::AlreadyLoaded`], never silently ignored.
pub fn load(explicit: Option<&Path>) -> Result<&'static NvshmemHost, LoadError> {
    if let Some((loaded, host)) = LIBRARY.get() {
        return check_same(loaded, explicit).map(|()| host);
    }
    let candidates = candidates(
        explicit,
        std::env::var_os("NVSHMEM_HOME").map(PathBuf::from),
        python_package_dir,
    );
    let mut tried = Vec::new();
    for path in candidates {
        match open(&path) {
            Ok(host) => {
                // Two threads may race to the first load: the first one stored wins, and the
                // other's request is checked against it like any later call.
                let (loaded, host) = LIBRARY.get_or_init(|| (path.clone(), host));
                return check_same(loaded, explicit).map(|()| host);
            }
            Err(reason) => tried.push((path.display().to_string(), reason)),
        }
    }
    Err(LoadError::NotFound { tried })
}

/// The host library another library of this process has already loaded (PyTorch's
/// SymmetricMemory NVSHMEM backend), found by its SONAME without loading anything: joining that
/// NVSHMEM must use its very copy (NVSHMEM's state is per library instance), wherever it came
/// from. [`LoadError::NotFound`] where the process holds none.
pub fn load_resident() -> Result<&'static NvshmemHost, LoadError> {
    if let Some((_, host)) = LIBRARY.get() {
        return Ok(host);
    }
    let not_loaded = |reason: String| LoadError::NotFound {
        tried: vec![(format!("{LIBRARY_SONAME} already in this process"), reason)],
    };
    // SAFETY: RTLD_NOLOAD opens nothing new: it only returns a handle to a library the process
    // has loaded (and initialised) already, or fails.
    let library = unsafe {
        libloading::os::unix::Library::open(
            Some(LIBRARY_SONAME),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL | libc::RTLD_NOLOAD,
        )
    }
    .map_err(|e| not_loaded(e.to_string()))?;
    // SAFETY: as in `open`.
    let host = unsafe { NvshmemHost::from_library(library) }
        .map_err(|e| not_loaded(format!("loaded, but it lacks a NVSHMEM 3.x symbol ({e})")))?;
    let (_, host) = LIBRARY.get_or_init(|| (PathBuf::from(LIBRARY_SONAME), host));
    Ok(host)
}

/// The places to try, in order: the override (`explicit`, else `$nvshmem_home/lib`) alone, or the
/// usual places (`python_dir` is called only then).
fn candidates(
    explicit: Option<&Path>,
    nvshmem_home: Option<PathBuf>,
    python_dir: impl FnOnce() -> Option<PathBuf>,
) -> Vec<PathBuf> {
    let overridden = explicit
        .map(Path::to_path_buf)
        .or_else(|| nvshmem_home.map(|home| home.join("lib").join(LIBRARY_SONAME)));
    match overridden {
        Some(path) => vec![path],
        None => {
            let mut c = vec![PathBuf::from(LIBRARY_SONAME)];
            c.extend(python_dir().map(|dir| dir.join("lib").join(LIBRARY_SONAME)));
            c.push(PathBuf::from("/usr/local/nvshmem/lib").join(LIBRARY_SONAME));
            c.push(PathBuf::from("/opt/nvidia/nvshmem/lib").join(LIBRARY_SONAME));
            c
        }
    }
}

/// `Ok` when a request for `requested` may be served by the library loaded from `loaded`: no
/// path was requested, or the same file (compared after resolving links where both exist).
fn check_same(loaded: &Path, requested: Option<&Path>) -> Result<(), LoadError> {
    let Some(requested) = requested else {
        return Ok(());
    };
    let same = requested == loaded
        || matches!(
            (std::fs::canonicalize(requested), std::fs::canonicalize(loaded)),
            (Ok(a), Ok(b)) if a == b
        );
    if same {
        Ok(())
    } else {
        Err(LoadError::AlreadyLoaded {
            loaded: if loaded.components().count() > 1 {
                loaded.display().to_string()
            } else {
                format!("{} (the dynamic loader's search)", loaded.display())
            },
            requested: requested.to_path_buf(),
        })
    }
}

fn open(path: &Path) -> Result<NvshmemHost, String> {
    if path.components().count() > 1 && !path.exists() {
        return Err("no such file".into());
    }
    // SAFETY: opening a shared library runs its initialisers; NVSHMEM's only set up static state.
    let library = unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    }
    .map_err(|e| e.to_string())?;
    // SAFETY: the symbols are resolved with the signatures bindgen read from the same headers.
    unsafe { NvshmemHost::from_library(library) }
        .map_err(|e| format!("opened, but it lacks a NVSHMEM 3.x symbol ({e})"))
}

/// The folder of the `nvidia.nvshmem` Python package, if `python3` has one.
fn python_package_dir() -> Option<PathBuf> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.nvshmem as m; print(list(m.__path__)[0])",
        ])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let dir = dir.trim();
    (out.status.success() && !dir.is_empty()).then(|| PathBuf::from(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_override_is_the_only_place_tried() {
        let never = || -> Option<PathBuf> { panic!("python is not asked when overridden") };
        assert_eq!(
            candidates(Some(Path::new("/x/lib.so")), Some("/home".into()), never),
            [PathBuf::from("/x/lib.so")]
        );
        assert_eq!(
            candidates(None, Some("/home".into()), never),
            [PathBuf::from("/home/lib/libnvshmem_host.so.3")]
        );
        let usual = candidates(None, None, || Some("/py/nvshmem".into()));
        assert_eq!(
            usual,
            [
                PathBuf::from("libnvshmem_host.so.3"),
                "/py/nvshmem/lib/libnvshmem_host.so.3".into(),
                "/usr/local/nvshmem/lib/libnvshmem_host.so.3".into(),
                "/opt/nvidia/nvshmem/lib/libnvshmem_host.so.3".into(),
            ]
        );
    }

    #[test]
    fn a_wrong_explicit_path_is_reported_with_the_path_and_what_to_do() {
        let missing = Path::new("/nonexistent/libnvshmem_host.so.3");
        // Whatever this process loaded before (nothing, in this crate's tests), a path that does
        // not exist is never served: either it is tried and fails, or it is refused as another
        // library than the loaded one.
        let msg = match load(Some(missing)) {
            Ok(_) => panic!("a missing library was reported as loaded"),
            Err(LoadError::NotFound { tried }) => {
                assert_eq!(tried.len(), 1, "{tried:?}");
                LoadError::NotFound { tried }.to_string()
            }
            Err(e @ LoadError::AlreadyLoaded { .. }) => e.to_string(),
        };
        assert!(msg.contains("/nonexistent/libnvshmem_host.so.3"), "{msg}");
        assert!(!msg.contains('\n'), "one line: {msg}");
        // The failure itself, independent of the process's state.
        let msg = LoadError::NotFound {
            tried: vec![(missing.display().to_string(), open(missing).err().unwrap())],
        }
        .to_string();
        assert!(
            msg.contains("/nonexistent/libnvshmem_host.so.3: no such file"),
            "{msg}"
        );
        assert!(msg.contains("NVSHMEM_HOME"), "{msg}");
    }

    #[test]
    fn after_the_first_load_another_path_is_an_error_not_ignored() {
        let loaded = Path::new("/opt/a/libnvshmem_host.so.3");
        assert!(check_same(loaded, None).is_ok());
        assert!(check_same(loaded, Some(loaded)).is_ok());
        let err = check_same(loaded, Some(Path::new("/opt/b/libnvshmem_host.so.3"))).unwrap_err();
        assert!(matches!(err, LoadError::AlreadyLoaded { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("requested from /opt/b/")
                && msg.contains("already loaded it from /opt/a/"),
            "{msg}"
        );
        // A link to the loaded file is the same library.
        let dir = std::env::temp_dir().join(format!("nvshmem-sys-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let real = dir.join("real.so");
        let link = dir.join("link.so");
        std::fs::write(&real, b"").unwrap();
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(check_same(&real, Some(&link)).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
        // Found by the dynamic loader's search: said so.
        let msg = check_same(Path::new(LIBRARY_SONAME), Some(loaded))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("(the dynamic loader's search)"), "{msg}");
    }
}
