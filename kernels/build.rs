//! Compiles every `.cu` under `cuda/` with nvcc as relocatable device code, device-links the objects
//! with NVSHMEM's device archive into one executable cubin per target architecture, and embeds the
//! bytes (`OUT_DIR/cubins.rs`) together with the list of kernels the sources declare. The
//! `STANDALONE_SOURCES` of `instances.rs` are compiled each into an executable cubin of its own
//! instead, without `-rdc`, and embedded beside it. Reads the
//! kernels' parameter headers with bindgen into `OUT_DIR/params.rs` (the crate's `params`).
//!
//! The templated kernels come from one table, `instances.rs`: each source is compiled as a unit
//! that includes it and then defines the `extern "C"` wrappers of its rows, and
//! `OUT_DIR/instances.rs` names every instance for the host (`lasp_shmem_kernels::instances`).
//!
//! Where the tools come from, first match wins: `NVCC`, else `CUDA_HOME/bin/nvcc`, else the
//! project's own toolchain (`.toolchain/python`, installed by `scripts/toolchain.sh`);
//! `NVSHMEM_HOME` and `CUTLASS_HOME` likewise. Architectures: sm_90a, plus any listed in
//! `LASP_EXTRA_CUDA_ARCHS` (comma-separated, e.g. `sm_100a`).

use std::path::{Path, PathBuf};
use std::process::Command;

include!("instances.rs");

const SETUP_HINT: &str =
    "run `bash scripts/test.sh` (or `source scripts/toolchain.sh`) to install the pinned CUDA \
     toolchain, or set NVCC/CUDA_HOME and NVSHMEM_HOME to your own installs";

fn fail(message: String) -> ! {
    eprintln!("error: lasp-shmem-kernels: {message}; {SETUP_HINT}");
    println!("cargo::error=lasp-shmem-kernels: {message}; {SETUP_HINT}");
    std::process::exit(1);
}

fn env_path(name: &str) -> Option<PathBuf> {
    println!("cargo::rerun-if-env-changed={name}");
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn require_dir(what: &str, dir: PathBuf, marker: &str) -> PathBuf {
    if !dir.join(marker).exists() {
        fail(format!(
            "{what} not found: {} has no {marker}",
            dir.display()
        ));
    }
    dir
}

fn main() {
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let toolchain = manifest_dir.join("../.toolchain/python");
    let nvcc = env_path("NVCC")
        .or_else(|| env_path("CUDA_HOME").map(|home| home.join("bin/nvcc")))
        .unwrap_or_else(|| toolchain.join("nvidia/cu13/bin/nvcc"));
    if !nvcc.exists() {
        fail(format!("nvcc not found at {}", nvcc.display()));
    }
    let nvshmem = require_dir(
        "NVSHMEM",
        env_path("NVSHMEM_HOME").unwrap_or_else(|| toolchain.join("nvidia/nvshmem")),
        "lib/libnvshmem_device.a",
    );
    let cutlass = require_dir(
        "CUTLASS/CuTe headers",
        env_path("CUTLASS_HOME").unwrap_or_else(|| toolchain.join("cutlass_library/source")),
        "include/cute/tensor.hpp",
    );
    let mut archs = vec!["sm_90a".to_string()];
    if let Some(extra) = std::env::var("LASP_EXTRA_CUDA_ARCHS")
        .ok()
        .filter(|v| !v.is_empty())
    {
        archs.extend(extra.split(',').map(|a| a.trim().to_string()));
    }
    println!("cargo::rerun-if-env-changed=LASP_EXTRA_CUDA_ARCHS");

    let cuda_dir = manifest_dir.join("cuda");
    println!("cargo::rerun-if-changed={}", cuda_dir.display());
    println!("cargo::rerun-if-changed=instances.rs");
    let mut sources = Vec::new();
    find_sources(&cuda_dir, &mut sources);
    sources.sort();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").unwrap());
    generate_params(&cuda_dir.join("include"), &toolchain, &out_dir);
    let units = write_units(&cuda_dir, &sources, &out_dir);
    let mut embedded = String::new();
    for arch in &archs {
        let gencode = format!("-gencode=arch=compute_{0},code={arch}", &arch[3..]);
        // Compile the sources in parallel: each nvcc run is single-threaded and takes seconds.
        // The standalone ones become executable cubins of their own; the others relocatable
        // objects for the device link.
        let outputs: Vec<(bool, PathBuf)> = std::thread::scope(|scope| {
            let jobs: Vec<_> = units
                .iter()
                .map(|(source, standalone)| {
                    let stem = source.file_stem().unwrap().to_string_lossy();
                    let output = out_dir.join(if *standalone {
                        format!("{stem}.{arch}.cubin")
                    } else {
                        format!("{stem}.{arch}.o")
                    });
                    let (nvcc, gencode, standalone) = (&nvcc, &gencode, *standalone);
                    let includes = [
                        cuda_dir.join("include"),
                        nvshmem.join("include"),
                        cutlass.join("include"),
                    ];
                    scope.spawn(move || {
                        let mut cmd = Command::new(nvcc);
                        // ptxas's report (-v) names the kernels whose wgmma it serialises.
                        cmd.args(["-std=c++17", "-O3", "-lineinfo", "-Xptxas", "-v"])
                            .args(if standalone {
                                ["-cubin"]
                            } else {
                                ["-rdc=true"]
                            })
                            .args(["--expt-relaxed-constexpr", gencode.as_str()])
                            .args(includes.iter().map(|dir| format!("-I{}", dir.display())));
                        if !standalone {
                            cmd.arg("-c");
                        }
                        cmd.arg(source).arg("-o").arg(&output);
                        let what = format!("compiling {}", source.display());
                        refuse_serialised_wgmma(&run(cmd, &what), &what);
                        (standalone, output)
                    })
                })
                .collect();
            jobs.into_iter().map(|job| job.join().unwrap()).collect()
        });
        let objects: Vec<&PathBuf> = outputs.iter().filter(|(s, _)| !s).map(|(_, o)| o).collect();
        let standalone: String = outputs
            .iter()
            .filter(|(s, _)| *s)
            .map(|(_, cubin)| format!("include_bytes!({:?}), ", cubin.display().to_string()))
            .collect();
        let cubin = out_dir.join(format!("lasp_kernels.{arch}.cubin"));
        let mut link = Command::new(&nvcc);
        link.args(["-dlink", "-cubin", gencode.as_str()])
            .args(&objects)
            .arg(format!("-L{}", nvshmem.join("lib").display()))
            .args(["-lnvshmem_device", "-o"])
            .arg(&cubin);
        run(link, "device-linking the cubin with libnvshmem_device.a");
        embedded.push_str(&format!(
            "    Cubin {{ arch: {arch:?}, image: include_bytes!({:?}), standalone: &[{standalone}] }},\n",
            cubin.display().to_string()
        ));
    }

    // The sources declare the plain kernels, the units add the table's wrappers.
    let unit_paths: Vec<PathBuf> = units.iter().map(|(unit, _)| unit.clone()).collect();
    let kernels = declared_kernels(&[sources.as_slice(), unit_paths.as_slice()].concat());
    std::fs::write(out_dir.join("instances.rs"), instance_constants()).unwrap();
    let version = nvshmem_version(&nvshmem);
    let generated = format!(
        "/// One executable cubin per target architecture.\n\
         pub static CUBINS: &[Cubin] = &[\n{embedded}];\n\n\
         /// Every `extern \"C\" __global__` kernel the CUDA sources declare.\n\
         pub static KERNEL_NAMES: &[&str] = &{kernels:?};\n\n\
         /// The NVSHMEM version whose device archive is linked into the cubins.\n\
         pub const NVSHMEM_DEVICE_VERSION: (u32, u32, u32) = {version:?};\n"
    );
    std::fs::write(out_dir.join("cubins.rs"), generated).unwrap();
}

/// `stdint.h` for bindgen: the fixed-width types from clang's predefined macros for the target.
/// libclang's wheel ships no resource headers, and the build must not depend on the system's.
const STDINT_SHIM: &str = "#pragma once
typedef __INT8_TYPE__ int8_t;
typedef __INT16_TYPE__ int16_t;
typedef __INT32_TYPE__ int32_t;
typedef __INT64_TYPE__ int64_t;
typedef __UINT8_TYPE__ uint8_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT64_TYPE__ uint64_t;
";

/// Writes `out_dir/params.rs`: the structs, enums and constants of every parameter header
/// (`*_params.h`, `wait_diagnostics.h`, wherever they sit under `include_dir`), read by bindgen
/// as a C compiler lays them out, so the host passes the kernels the headers' own types.
fn generate_params(include_dir: &Path, toolchain: &Path, out_dir: &Path) {
    // clang-sys looks where LIBCLANG_PATH says, then in the system's folders.
    let toolchain_libclang = toolchain.join("clang/native");
    if env_path("LIBCLANG_PATH").is_none() && toolchain_libclang.join("libclang.so").exists() {
        std::env::set_var("LIBCLANG_PATH", &toolchain_libclang);
    }
    if let Err(e) = clang_sys::load() {
        fail(format!(
            "no libclang for bindgen to read the kernels' parameter headers with (set \
             LIBCLANG_PATH to the folder holding libclang.so): {e}"
        ));
    }
    let mut headers = Vec::new();
    find_param_headers(include_dir, &mut headers);
    headers.sort();
    if headers.is_empty() {
        fail(format!("no *_params.h under {}", include_dir.display()));
    }
    let wrapper: String = headers
        .iter()
        .map(|header| format!("#include \"{}\"\n", header.display()))
        .collect();
    let shim_dir = out_dir.join("bindgen-include");
    std::fs::create_dir_all(&shim_dir).unwrap();
    std::fs::write(shim_dir.join("stdint.h"), STDINT_SHIM).unwrap();
    let bindings = bindgen::Builder::default()
        .header_contents("lasp_params.h", &wrapper)
        .clang_arg("-nostdinc")
        .clang_arg(format!("-isystem{}", shim_dir.display()))
        .clang_arg(format!("-I{}", include_dir.display()))
        .detect_include_paths(false)
        .allowlist_type("lasp2?_.*")
        // No -D here, as none for nvcc: the constants (LASP_SD_STAGES) are the kernels' own.
        .allowlist_var("LASP2?_.*")
        // The return type of the header's launch helpers; the host computes its grids in Rust.
        .blocklist_type("lasp2?_.*dim3")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .generate()
        .unwrap_or_else(|e| fail(format!("bindgen could not read the parameter headers: {e}")));
    let generated = out_dir.join("params.rs");
    bindings
        .write_to_file(&generated)
        .unwrap_or_else(|e| fail(format!("cannot write {}: {e}", generated.display())));
}

/// Every `*_params.h` and `wait_diagnostics.h` in `dir` and its subfolders.
fn find_param_headers(dir: &Path, headers: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| fail(format!("cannot read {}: {e}", dir.display())));
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() {
            find_param_headers(&path, headers);
        } else if name.ends_with("_params.h") || name == "wait_diagnostics.h" {
            headers.push(path);
        }
    }
}

/// Every `.cu` file under `dir`, recursively.
fn find_sources(dir: &Path, sources: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| fail(format!("cannot read {}: {e}", dir.display())));
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            find_sources(&path, sources);
        } else if path.extension().is_some_and(|ext| ext == "cu") {
            sources.push(path);
        }
    }
}

/// `name` (a table row's name or call) for key width `dk`.
fn for_dk(text: &str, dk: u32) -> String {
    text.replace("{dk}", &dk.to_string())
}

/// The widths a row is built for: every one of `DK_WIDTHS` if its name has `{dk}`, else one.
fn widths(instance: &Instance) -> Vec<u32> {
    if instance.name.contains("{dk}") {
        DK_WIDTHS.to_vec()
    } else {
        vec![0]
    }
}

/// One compilation unit per source, `OUT_DIR/units/<path with '_' for '/'>.cu`: the source itself
/// (by absolute path), then the wrappers of its rows in `INSTANCES`; with whether it is one of
/// `STANDALONE_SOURCES`. Rows or standalone entries naming a source that does not exist stop the
/// build.
fn write_units(cuda_dir: &Path, sources: &[PathBuf], out_dir: &Path) -> Vec<(PathBuf, bool)> {
    for standalone in STANDALONE_SOURCES {
        if !sources.iter().any(|s| s.ends_with(standalone)) {
            fail(format!(
                "instances.rs: STANDALONE_SOURCES names {standalone}, which is not under {}",
                cuda_dir.display()
            ));
        }
    }
    for instance in INSTANCES {
        if !sources.iter().any(|s| s.ends_with(instance.source)) {
            fail(format!(
                "instances.rs: {} names the source {}, which is not under {}",
                instance.name,
                instance.source,
                cuda_dir.display()
            ));
        }
    }
    let units_dir = out_dir.join("units");
    std::fs::create_dir_all(&units_dir).unwrap();
    sources
        .iter()
        .map(|source| {
            let relative = source.strip_prefix(cuda_dir).unwrap();
            let mut text = format!("#include \"{}\"\n", source.display());
            for instance in INSTANCES.iter().filter(|i| relative == Path::new(i.source)) {
                for dk in widths(instance) {
                    text.push_str(&format!(
                        "extern \"C\" __global__ void __launch_bounds__({})\n    {}(const __grid_constant__ {} p) {{\n  {};\n}}\n",
                        for_dk(instance.bounds, dk),
                        for_dk(instance.name, dk),
                        instance.params,
                        for_dk(instance.call, dk)
                    ));
                }
            }
            let unit = units_dir.join(relative.to_string_lossy().replace('/', "_"));
            // Unchanged text keeps the file's time, so nvcc reruns only where something changed.
            if std::fs::read_to_string(&unit).ok().as_deref() != Some(text.as_str()) {
                std::fs::write(&unit, text).unwrap();
            }
            let standalone = STANDALONE_SOURCES.iter().any(|s| relative == Path::new(s));
            (unit, standalone)
        })
        .collect()
}

/// The Rust constants of `INSTANCES`: a `&str` per plain row, `[&str; DK_WIDTHS.len()]` (indexed
/// like `DK_WIDTHS`) per `{dk}` row.
fn instance_constants() -> String {
    let mut text = format!(
        "/// Key widths every per-Dk kernel is built for.\npub const DK_WIDTHS: [u32; {}] = {DK_WIDTHS:?};\n",
        DK_WIDTHS.len()
    );
    for instance in INSTANCES {
        let names: Vec<String> = widths(instance)
            .into_iter()
            .map(|dk| for_dk(instance.name, dk))
            .collect();
        let doc = format!("/// `{}` (`{}`).\n", instance.name, instance.source);
        if instance.name.contains("{dk}") {
            text.push_str(&format!(
                "{doc}pub const {}: [&str; {}] = {names:?};\n",
                instance.constant,
                names.len()
            ));
        } else {
            text.push_str(&format!(
                "{doc}pub const {}: &str = {:?};\n",
                instance.constant, names[0]
            ));
        }
    }
    text
}

/// (major, minor, patch) from the NVSHMEM headers the cubins were built with.
fn nvshmem_version(nvshmem: &std::path::Path) -> (u32, u32, u32) {
    let header = nvshmem.join("include/non_abi/nvshmem_version.h");
    let text = std::fs::read_to_string(&header)
        .unwrap_or_else(|e| fail(format!("cannot read {}: {e}", header.display())));
    let field = |name: &str| -> u32 {
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("#define NVSHMEM_VENDOR_{name}_VERSION ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| {
                fail(format!(
                    "{} has no NVSHMEM_VENDOR_{name}_VERSION",
                    header.display()
                ))
            })
    };
    (field("MAJOR"), field("MINOR"), field("PATCH"))
}

/// Runs `cmd` to success; its stderr.
fn run(mut cmd: Command, what: &str) -> String {
    let output = cmd.output().unwrap_or_else(|e| {
        fail(format!(
            "{what}: could not start {:?}: {e}",
            cmd.get_program()
        ))
    });
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stdout));
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        eprintln!("error: lasp-shmem-kernels: {what} failed: {cmd:?}");
        std::process::exit(1);
    }
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Fails the build where ptxas serialises a kernel's wgmma (C7509): it does so for any call to a
/// subroutine in the kernel (a 64-bit division or remainder, the IEEE division operator, printf),
/// and the kernel's products then run one after another (a packed output loop took 16 % longer).
fn refuse_serialised_wgmma(ptxas_report: &str, what: &str) {
    let serialised: Vec<&str> = ptxas_report
        .lines()
        .filter(|line| line.contains("C7509"))
        .collect();
    if !serialised.is_empty() {
        let message = format!(
            "{what}: ptxas serialises wgmma: {}; remove the call from the kernel (a 64-bit division \
             or remainder in 32 bits, 1 / x as rcp.approx, no printf)",
            serialised.join(" | ")
        );
        eprintln!("error: lasp-shmem-kernels: {message}");
        println!("cargo::error=lasp-shmem-kernels: {message}");
        std::process::exit(1);
    }
}

/// Names of the `extern "C" __global__` functions defined in the sources (with or without
/// `__launch_bounds__` between the qualifiers and the name).
fn declared_kernels(sources: &[PathBuf]) -> Vec<String> {
    let mut names = Vec::new();
    for source in sources {
        let text = std::fs::read_to_string(source).unwrap();
        for (start, _) in text.match_indices("extern \"C\" __global__") {
            let rest = &text[start..];
            let Some(open) = rest.find('(') else { continue };
            let head = &rest[..open];
            // The name is the last identifier before the parameter list; skip `__launch_bounds__(…)`.
            let head = match head.find("__launch_bounds__") {
                Some(bounds) => {
                    let close = rest[bounds..].find(')').unwrap() + bounds;
                    let after = &rest[close + 1..];
                    &after[..after.find('(').unwrap()]
                }
                None => head,
            };
            if let Some(name) = head.split_whitespace().last() {
                names.push(name.to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}
