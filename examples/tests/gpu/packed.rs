//! Packed documents (`cu_seqlens`) through LASP-2 for scalar decay, Gated DeltaNet and GLA under
//! `lasp-run`, on 1 to every GPU of the node: the program's own checks (every PE against the f64
//! reference's packed decomposition, forward and backward, every mode and a repeat bitwise equal,
//! graph replays with the documents written after the capture).

use crate::common::{gpus_or_skip, launch, program};
use crate::lasp2::expect_cases_passed;
use std::path::PathBuf;
use std::time::Duration;

const JOB_LIMIT: Duration = Duration::from_secs(600);
/// The program's cases (two document layouts for each of three families), each reported by every
/// PE.
const CASES: usize = 6;

fn packed_lasp2() -> PathBuf {
    program(
        "packed_lasp2",
        None,
        Some(env!("CARGO_BIN_EXE_packed_lasp2")),
    )
}

/// W = 1 up to every GPU, so W = 2, 3 and 4 on a 4-GPU node (documents spanning three shards at
/// W = 4).
#[test]
fn packed_documents_match_the_reference_on_every_team_size() {
    let Some(gpus) = gpus_or_skip() else { return };
    for ranks in 1..=gpus {
        let run = launch(ranks, JOB_LIMIT, &packed_lasp2(), &[], &[]);
        expect_cases_passed(&format!("packed_lasp2 on {ranks} PEs"), &run, ranks, CASES);
    }
}
