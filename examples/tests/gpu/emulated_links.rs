//! LASP-2 under emulated links (`LASP_EMULATE_LINKS`: InfiniBand's rate and latency between
//! emulated nodes of one GPU each): the programs' own checks still pass in every mode (the
//! emulation moves when readers see the tiles, never what they read), the overlapped exchange is
//! held to the emulated rate, and a silent rank is still named within the bound.

use crate::common::{expect_success, launch, program, two_or_more_gpus_or_skip};
use crate::lasp2::forward_silent_rank_drill;
use lasp_shmem::exchange::{geometry, Lasp2Layout};
use lasp_shmem::family::Family;
use lasp_shmem::ops::scalar_decay::ScalarDecay;
use std::time::Duration;

/// One GPU per emulated node, 3 us per message, 25 GB/s per GPU.
const LINKS: (&str, &str) = (
    "LASP_EMULATE_LINKS",
    "gpus_per_node=1,latency_us=3,gb_per_s=25",
);
const EMULATED_BYTES_PER_SECOND: f64 = 25e9;
const JOB_LIMIT: Duration = Duration::from_secs(300);

fn lasp2_forward() -> std::path::PathBuf {
    program(
        "lasp2_forward",
        None,
        Some(env!("CARGO_BIN_EXE_lasp2_forward")),
    )
}

/// Scalar decay's forward and backward and Gated DeltaNet's (the affine summary, both chains):
/// every rank against the f64 reference, every mode bitwise equal, graph replays.
#[test]
fn every_mode_still_matches_the_reference_under_emulated_links() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    for (name, built_at, args) in [
        (
            "lasp2_forward",
            env!("CARGO_BIN_EXE_lasp2_forward"),
            &["--graph-calls", "100", "--no-time"][..],
        ),
        (
            "lasp2_backward",
            env!("CARGO_BIN_EXE_lasp2_backward"),
            &["--graph-calls", "100", "--no-time"][..],
        ),
        (
            "gated_delta_lasp2",
            env!("CARGO_BIN_EXE_gated_delta_lasp2"),
            &[][..],
        ),
    ] {
        let run = launch(
            gpus,
            JOB_LIMIT,
            &program(name, None, Some(built_at)),
            args,
            &[LINKS],
        );
        expect_success(&format!("{name} under emulated links"), &run);
    }
}

/// The overlapped call's exchange takes at least what the emulated links need for it: the first
/// PE's NIC sends its state to W - 1 readers, and the last PE's output waits for all of it. The
/// no-communication time of the same kernels is the compute (rows from `lasp2_forward --json`).
#[test]
fn the_overlapped_exchange_is_held_to_the_emulated_rate() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let json = std::env::temp_dir().join(format!("lasp-emulated-{}.json", std::process::id()));
    let json_arg = json.display().to_string();
    let (b, t, h, d) = (4usize, 4096usize, 16usize, 128usize);
    let shape = format!("{b}x{t}x{h}x{d}");
    let run = launch(
        gpus,
        JOB_LIMIT,
        &lasp2_forward(),
        &["--no-check", "--time", &shape, "--json", &json_arg],
        &[LINKS],
    );
    expect_success("lasp2_forward timed under emulated links", &run);
    let text = std::fs::read_to_string(&json).expect("the timed rows");
    let _ = std::fs::remove_file(&json);
    let rows: serde_json::Value = serde_json::from_str(&text).expect("JSON rows");
    let row = &rows[0];
    assert!(
        row["link"]
            .as_str()
            .unwrap_or("")
            .starts_with("ib-emulated"),
        "the row does not name the emulated links: {row}"
    );
    let ms = |key: &str| row[key].as_f64().unwrap_or(f64::NAN);
    // One PE's summary: the bytes of its slot (B*H*(D/64) tiles of scalar decay's tile floats).
    let layout = Lasp2Layout { b, h, dk: d, dv: d };
    let tile_floats = ScalarDecay::summary_tile_floats(&layout);
    let state_bytes =
        (geometry::slot_pe_floats(b as i32, h as i32, d as i32, tile_floats) * 4) as f64;
    let paced_ms = (gpus - 1) as f64 * state_bytes / EMULATED_BYTES_PER_SECOND * 1e3;
    let exposed_ms = ms("overlapped_ms") - ms("no_comm_ms");
    println!(
        "W={gpus} {shape}: overlapped {:.4} ms, no-comm {:.4}, exposed {exposed_ms:.4} against \
         {paced_ms:.4} ms at the emulated rate",
        ms("overlapped_ms"),
        ms("no_comm_ms")
    );
    assert!(
        exposed_ms >= 0.7 * paced_ms && exposed_ms <= 1.5 * paced_ms + 0.1,
        "the overlapped call exposes {exposed_ms:.4} ms over no-comm; the emulated links need \
         {paced_ms:.4} ms for the first PE's {} states",
        gpus - 1
    );
    // The pipelined chain sends one state per PE: from three PEs on it must expose clearly less.
    let chain_exposed_ms = ms("pipelined_chain_ms") - ms("no_comm_ms");
    println!("pipelined chain exposes {chain_exposed_ms:.4} ms");
    if gpus >= 3 {
        assert!(
            chain_exposed_ms < 0.75 * exposed_ms,
            "the pipelined chain exposes {chain_exposed_ms:.4} ms, the all-gather {exposed_ms:.4}: \
             the chain should move one state per PE over the emulated links"
        );
    }
}

/// A silent rank under emulated links: the later ranks still name it within the bound.
#[test]
fn a_silent_rank_is_named_under_emulated_links() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    forward_silent_rank_drill(
        "LASP-2 forward under emulated links, silent rank",
        gpus,
        &[],
        &[LINKS],
    );
}
