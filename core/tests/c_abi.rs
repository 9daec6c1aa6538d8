//! The C ABI as a C or C++ caller sees it, on any machine (no GPU needed): the header compiles as
//! strict C11 and as C++17, its structs and codes are what the Rust mirrors say (as the C
//! compiler lays them out), the shared library links, and core/tests/c/abi_smoke.c runs its
//! argument checks against it. The GPU example (examples/c/lasp2_forward.c) is compiled too, so
//! a header change that breaks it fails here; it runs on a GPU node (scripts/gpu-test.sh).

use lasp_shmem::capi::status::*;
use lasp_shmem::capi::*;
use std::mem::{offset_of, size_of};
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
    assert!(output.contains("abi_smoke: 60 checks passed"), "{output}");
}

/// `sizeof` of a struct and `offsetof` of each of its fields, as C expressions with the Rust
/// mirror's values (the fields have the header's names).
macro_rules! layout {
    ($rust:ty, $c:literal, [$($field:ident),+]) => {{
        let mut numbers = vec![(format!("sizeof({})", $c), size_of::<$rust>() as i64)];
        $(numbers.push((
            format!("offsetof({}, {})", $c, stringify!($field)),
            offset_of!($rust, $field) as i64,
        ));)+
        numbers
    }};
}

/// Every number the header and the Rust side must agree on, as (C expression, Rust value).
fn abi_numbers() -> Vec<(String, i64)> {
    let mut numbers = [
        layout!(
            RuntimeOptions,
            "lasp_runtime_options",
            [
                struct_size,
                abi_version,
                symmetric_heap_bytes,
                wait_timeout_ms,
                nvshmem_library
            ]
        ),
        layout!(
            Place,
            "lasp_place",
            [rank, world_size, local_rank, local_world_size]
        ),
        layout!(UniqueId, "lasp_unique_id", [bytes]),
        layout!(
            OpDesc,
            "lasp_op_desc",
            [
                struct_size,
                abi_version,
                family,
                kind,
                schedule,
                mode,
                batch,
                heads,
                dk,
                dv,
                tokens,
                flags,
                reserved
            ]
        ),
        layout!(
            Call,
            "lasp_call",
            [struct_size, scale, tokens, shard_start, reserved]
        ),
        layout!(Tensor, "lasp_tensor", [data, numel, dtype, reserved]),
        layout!(Tensors, "lasp_tensors", [struct_size, reserved, slot]),
    ]
    .concat();
    let codes: [(&str, i64); 33] = [
        ("LASP_SHMEM_ABI_VERSION", ABI_VERSION.into()),
        ("LASP_FAMILY_SCALAR_DECAY", LASP_FAMILY_SCALAR_DECAY.into()),
        ("LASP_FAMILY_GLA", LASP_FAMILY_GLA.into()),
        ("LASP_FAMILY_GATED_DELTA", LASP_FAMILY_GATED_DELTA.into()),
        ("LASP_FAMILY_MLSTM", LASP_FAMILY_MLSTM.into()),
        ("LASP_KIND_SINGLE_GPU", LASP_KIND_SINGLE_GPU.into()),
        ("LASP_KIND_LASP2", LASP_KIND_LASP2.into()),
        ("LASP_SCHEDULE_AUTO", LASP_SCHEDULE_AUTO.into()),
        ("LASP_SCHEDULE_ALL_GATHER", LASP_SCHEDULE_ALL_GATHER.into()),
        (
            "LASP_SCHEDULE_PIPELINED_CHAIN",
            LASP_SCHEDULE_PIPELINED_CHAIN.into(),
        ),
        ("LASP_MODE_OVERLAPPED", LASP_MODE_OVERLAPPED.into()),
        (
            "LASP_MODE_SEQUENTIAL_NCCL",
            LASP_MODE_SEQUENTIAL_NCCL.into(),
        ),
        (
            "LASP_MODE_SEQUENTIAL_NVSHMEM",
            LASP_MODE_SEQUENTIAL_NVSHMEM.into(),
        ),
        ("LASP_MODE_NO_COMM", LASP_MODE_NO_COMM.into()),
        (
            "LASP_MODE_PIPELINED_CHAIN",
            LASP_MODE_PIPELINED_CHAIN.into(),
        ),
        ("LASP_OP_WITH_BACKWARD", LASP_OP_WITH_BACKWARD as i64),
        ("LASP_DIRECTION_FORWARD", LASP_DIRECTION_FORWARD.into()),
        ("LASP_DIRECTION_BACKWARD", LASP_DIRECTION_BACKWARD.into()),
        ("LASP_SLOT_COUNT", Slot::ALL.len() as i64),
        ("LASP_SLOT_CAPACITY", SLOT_CAPACITY as i64),
        ("LASP_OK", LASP_OK.into()),
        (
            "LASP_ERROR_INVALID_ARGUMENT",
            LASP_ERROR_INVALID_ARGUMENT.into(),
        ),
        ("LASP_ERROR_LAUNCH", LASP_ERROR_LAUNCH.into()),
        ("LASP_ERROR_CUDA", LASP_ERROR_CUDA.into()),
        ("LASP_ERROR_NVSHMEM", LASP_ERROR_NVSHMEM.into()),
        ("LASP_ERROR_PEER_TIMEOUT", LASP_ERROR_PEER_TIMEOUT.into()),
        ("LASP_ERROR_STATE", LASP_ERROR_STATE.into()),
        ("LASP_ERROR_INTERNAL", LASP_ERROR_INTERNAL.into()),
        ("LASP_ERROR_NCCL", LASP_ERROR_NCCL.into()),
        ("LASP_ERROR_KERNEL_FAULT", LASP_ERROR_KERNEL_FAULT.into()),
        ("LASP_ERROR_KERNEL_LAUNCH", LASP_ERROR_KERNEL_LAUNCH.into()),
        ("LASP_ERROR_BUILD", LASP_ERROR_BUILD.into()),
        ("sizeof(lasp_status)", size_of::<Status>() as i64),
    ];
    numbers.extend(codes.map(|(name, value)| (name.to_string(), value)));
    numbers.extend(Slot::ALL.map(|s| (s.name().to_string(), s as i64)));
    numbers.extend(Dtype::ALL.map(|d| (d.name().to_string(), d as i64)));
    numbers
}

#[test]
fn the_header_lays_out_structs_and_codes_as_the_rust_mirrors() {
    let numbers = abi_numbers();
    let prints: String = numbers
        .iter()
        .map(|(expr, _)| format!("  printf(\"%lld\\n\", (long long)({expr}));\n"))
        .collect();
    let program = format!(
        "#include \"lasp_shmem.h\"\n#include <stddef.h>\n#include <stdio.h>\n\
         int main(void) {{\n{prints}  return 0;\n}}\n"
    );
    let dir = std::env::temp_dir().join(format!("lasp-abi-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary folder");
    let (source, exe) = (dir.join("layout.c"), dir.join("layout"));
    std::fs::write(&source, program).expect("write layout.c");
    run(Command::new(compiler())
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(repo().join("core/include"))
        .arg(&source)
        .arg("-o")
        .arg(&exe));
    let output = run(&mut Command::new(&exe));
    std::fs::remove_dir_all(&dir).ok();
    let values: Vec<&str> = output.lines().collect();
    assert_eq!(values.len(), numbers.len(), "{output}");
    for ((expr, rust), c) in numbers.iter().zip(values) {
        assert_eq!(
            c,
            rust.to_string(),
            "{expr}: the header says {c}, Rust {rust}"
        );
    }
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
