//! The C ABI as a C or C++ caller sees it, on any machine (no GPU needed): the header compiles as
//! strict C11 and as C++17, the shared library links, and core/tests/c/abi_smoke.c runs its
//! argument checks against it. The GPU example (examples/c/lasp2_forward.c) is compiled too, so
//! a header change that breaks it fails here; it runs on a GPU node (scripts/gpu-test.sh).

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("core/ has a parent")
        .to_path_buf()
}

/// The folder holding this build's liblasp_shmem.so (the cdylib of the crate under test).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps/").to_path_buf();
    [
        deps.clone(),
        deps.parent().expect("profile dir").to_path_buf(),
    ]
    .into_iter()
    .find(|d| d.join("liblasp_shmem.so").exists())
    .unwrap_or_else(|| panic!("liblasp_shmem.so not found next to {}", exe.display()))
}

/// The CUDA runtime headers beside the toolchain's nvcc (scripts/toolchain.sh).
fn cuda_include() -> PathBuf {
    let nvcc = std::env::var_os("NVCC")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")))
        .unwrap_or_else(|| repo().join(".toolchain/python/nvidia/cu13/bin/nvcc"));
    let include = nvcc
        .parent()
        .and_then(Path::parent)
        .map(|root| root.join("include"));
    include
        .filter(|d| d.join("cuda_runtime_api.h").exists())
        .unwrap_or_else(|| {
            panic!(
                "no cuda_runtime_api.h beside {}; run the tests through scripts/test.sh, which \
                 installs the toolchain",
                nvcc.display()
            )
        })
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{text}",
        out.status
    );
    text
}

fn compiler() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

#[test]
fn c_callers_compile_link_and_get_checked_arguments() {
    let include = repo().join("core/include");
    let lib = library_dir();
    let exe = std::env::temp_dir().join(format!("lasp-abi-smoke-{}", std::process::id()));
    run(Command::new(compiler())
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(&include)
        .arg(repo().join("core/tests/c/abi_smoke.c"))
        .arg("-L")
        .arg(&lib)
        .arg("-llasp_shmem")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&exe));
    // No rank variables: the checks must not depend on the launcher that runs the tests.
    let output = run(Command::new(&exe)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE"));
    std::fs::remove_file(&exe).ok();
    assert!(output.contains("abi_smoke: 18 checks passed"), "{output}");
}

#[test]
fn the_header_is_valid_cpp() {
    let include = repo().join("core/include");
    run(Command::new(compiler())
        .args([
            "-x",
            "c++",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-I",
        ])
        .arg(&include)
        .arg(include.join("lasp_shmem.h")));
}

#[test]
fn the_gpu_example_compiles_against_the_header() {
    run(Command::new(compiler())
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-I",
        ])
        .arg(repo().join("core/include"))
        .arg("-I")
        .arg(cuda_include())
        .arg(repo().join("examples/c/lasp2_forward.c")));
}
