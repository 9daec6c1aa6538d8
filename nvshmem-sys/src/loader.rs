//! Finds and opens `libnvshmem_host.so.3` once per process.

use crate::NvshmemHost;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The library's SONAME. pip wheels ship only this name, not `libnvshmem_host.so`.
pub const LIBRARY_SONAME: &str = "libnvshmem_host.so.3";

/// Why the host library could not be opened: every place tried, with the loader's reason.
#[derive(Debug, Clone)]
pub struct LoadError {
    /// (place, reason) in the order they were tried.
    pub tried: Vec<(String, String)>,
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "could not load {LIBRARY_SONAME} (tried ")?;
        for (i, (place, reason)) in self.tried.iter().enumerate() {
            let sep = if i == 0 { "" } else { "; " };
            write!(f, "{sep}{place}: {reason}")?;
        }
        write!(
            f,
            "); install NVSHMEM 3.x (pip install nvidia-nvshmem-cu13==3.4.5) or set NVSHMEM_HOME \
             to the folder that holds lib/{LIBRARY_SONAME}"
        )
    }
}

impl std::error::Error for LoadError {}

static LIBRARY: OnceLock<NvshmemHost> = OnceLock::new();

/// Opens the host library, or returns the one already open.
///
/// Where it looks, in order: `explicit` (a path to the library file) if given, else
/// `$NVSHMEM_HOME/lib/libnvshmem_host.so.3` if `NVSHMEM_HOME` is set; an override that fails is an
/// error, never silently replaced. Without an override: the dynamic loader's own search
/// (`LD_LIBRARY_PATH`, the ld.so cache), then the `nvidia.nvshmem` package of `python3` (a pip
/// install), then `/usr/local/nvshmem/lib` and `/opt/nvidia/nvshmem/lib`.
pub fn load(explicit: Option<&Path>) -> Result<&'static NvshmemHost, LoadError> {
    if let Some(host) = LIBRARY.get() {
        return Ok(host);
    }
    let mut tried = Vec::new();
    let overridden = explicit.map(Path::to_path_buf).or_else(|| {
        std::env::var_os("NVSHMEM_HOME")
            .map(|home| PathBuf::from(home).join("lib").join(LIBRARY_SONAME))
    });
    let candidates: Vec<PathBuf> = match overridden {
        Some(path) => vec![path],
        None => {
            let mut c = vec![PathBuf::from(LIBRARY_SONAME)];
            c.extend(python_package_dir().map(|dir| dir.join("lib").join(LIBRARY_SONAME)));
            c.push(PathBuf::from("/usr/local/nvshmem/lib").join(LIBRARY_SONAME));
            c.push(PathBuf::from("/opt/nvidia/nvshmem/lib").join(LIBRARY_SONAME));
            c
        }
    };
    for path in candidates {
        match open(&path) {
            Ok(host) => return Ok(LIBRARY.get_or_init(|| host)),
            Err(reason) => tried.push((path.display().to_string(), reason)),
        }
    }
    Err(LoadError { tried })
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
    fn a_wrong_explicit_path_is_reported_with_the_path_and_what_to_do() {
        let err = match load(Some(Path::new("/nonexistent/libnvshmem_host.so.3"))) {
            Err(e) => e,
            Ok(_) => return, // a library was already loaded by another test in this process
        };
        let msg = err.to_string();
        assert!(
            msg.contains("/nonexistent/libnvshmem_host.so.3: no such file"),
            "{msg}"
        );
        assert!(msg.contains("NVSHMEM_HOME"), "{msg}");
        assert!(!msg.contains('\n'), "one line: {msg}");
    }
}
