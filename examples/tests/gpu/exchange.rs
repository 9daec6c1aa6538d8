//! The device all-gather of `exchange` on every GPU of the node under `lasp-run`, and its fault
//! drills: a silent rank, a wrong NVSHMEM path, hidden GPUs and more ranks than GPUs must each end
//! in an error that names the cause.

use crate::common::{
    expect_failure, expect_success, gpus_or_skip, launch, launcher, program, run_on_gpus,
    two_or_more_gpus_or_skip,
};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The launcher's limit on a checking job.
const JOB_LIMIT: Duration = Duration::from_secs(300);
/// A drill must end within this: every wait on another rank is bounded.
const DRILL_LIMIT: Duration = Duration::from_secs(60);

fn exchange() -> PathBuf {
    program("exchange", None, Some(env!("CARGO_BIN_EXE_exchange")))
}

#[test]
fn every_size_is_verified_under_the_launcher() {
    let Some(gpus) = gpus_or_skip() else { return };
    let run = launch(gpus, JOB_LIMIT, &exchange(), &[], &[]);
    expect_success("exchange under lasp-run", &run);
}

#[test]
fn ten_thousand_back_to_back_epochs_stay_consistent() {
    let Some(gpus) = gpus_or_skip() else { return };
    let args = ["--sizes", "64K", "--rounds", "10000", "--pingpong", "0"];
    let run = launch(gpus, JOB_LIMIT, &exchange(), &args, &[]);
    expect_success("10,000 epochs", &run);
}

#[test]
fn a_silent_rank_is_named_with_its_epoch() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let run = launch(
        gpus,
        DRILL_LIMIT,
        &exchange(),
        &["--silent-rank", "1"],
        &[("LASP_WAIT_TIMEOUT_MS", "3000")],
    );
    expect_failure(
        "silent rank",
        "waited [0-9]+ ms for data from PE 1 .*epoch 1",
        &run,
    );
}

#[test]
fn a_wrong_nvshmem_path_is_named() {
    if gpus_or_skip().is_none() {
        return;
    }
    let mut alone = Command::new(exchange());
    alone
        .args(["--sizes", "32K"])
        .env("NVSHMEM_HOME", "/nonexistent");
    let run = run_on_gpus(&mut alone, DRILL_LIMIT);
    expect_failure(
        "wrong NVSHMEM path",
        "could not load libnvshmem_host.so.3 .*/nonexistent",
        &run,
    );
}

#[test]
fn hidden_gpus_are_reported() {
    if gpus_or_skip().is_none() {
        return;
    }
    let mut hidden = Command::new(exchange());
    hidden
        .args(["--sizes", "32K"])
        .env("CUDA_VISIBLE_DEVICES", "");
    let run = run_on_gpus(&mut hidden, DRILL_LIMIT);
    expect_failure(
        "no GPU visible",
        "CUDA .*(no GPU|CUDA_VISIBLE_DEVICES)",
        &run,
    );
}

#[test]
fn more_ranks_than_gpus_are_refused() {
    let Some(gpus) = gpus_or_skip() else { return };
    let mut too_many = Command::new(launcher());
    too_many
        .args(["-n", &(gpus + 1).to_string()])
        .arg(exchange());
    let run = run_on_gpus(&mut too_many, DRILL_LIMIT);
    expect_failure(
        "too many ranks",
        &format!(
            "asked for {} ranks but this node shows {gpus} GPU",
            gpus + 1
        ),
        &run,
    );
}
