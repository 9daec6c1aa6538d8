//! The short convolution on LASP-2 shards under `lasp-run`, on 1 to every GPU of the node: the
//! program's own checks (every PE against the f64 reference of the whole sequence, the halo
//! exact, repeats and graph replays bitwise equal), then its fault drill (a silent PE named by
//! the PEs beside it).

use crate::common::{expect_failure, gpus_or_skip, launch, program, two_or_more_gpus_or_skip};
use crate::lasp2::{expect_cases_passed, pes_named_in_drill_errors, DRILL_LIMIT, DRILL_WAIT};
use std::path::PathBuf;
use std::time::Duration;

const JOB_LIMIT: Duration = Duration::from_secs(300);
/// The program's cases, each reported by every PE.
const CASES: usize = 10;

fn short_conv() -> PathBuf {
    program("short_conv", None, Some(env!("CARGO_BIN_EXE_short_conv")))
}

/// W = 1 (the plain convolution) up to every GPU, so W = 2, 3 and 4 on a 4-GPU node.
#[test]
fn short_conv_matches_the_reference_on_every_team_size() {
    let Some(gpus) = gpus_or_skip() else { return };
    for ranks in 1..=gpus {
        let run = launch(ranks, JOB_LIMIT, &short_conv(), &[], &[]);
        expect_cases_passed(&format!("short_conv on {ranks} PEs"), &run, ranks, CASES);
    }
}

/// The silent PE's successor misses its halo and its predecessor the halo's gradient: both must
/// name it within the bound, and nobody another PE.
#[test]
fn short_conv_silent_rank_is_named_by_its_neighbours() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let silent = if gpus >= 3 { 1 } else { 0 };
    let silent_arg = silent.to_string();
    let run = launch(
        gpus,
        DRILL_LIMIT,
        &short_conv(),
        &["--silent-rank", &silent_arg],
        &[DRILL_WAIT],
    );
    expect_failure(
        "short convolution, silent rank",
        &format!("waited [0-9]+ ms for data from PE {silent} "),
        &run,
    );
    let named = pes_named_in_drill_errors(&run);
    assert!(
        !named.is_empty() && named.iter().all(|&pe| pe == silent),
        "the PEs beside PE {silent} named {named:?}"
    );
}
