//! LASP-2 forward and backward on every GPU of the node, under `lasp-run`: the programs'
//! own checks (every rank against the f64 reference, every exchange mode bitwise the same, long
//! graph replays), then their fault drills (a silent rank named by the ranks that wait for it, a
//! layout mismatch refused before any state moves).

use crate::common::{
    expect_failure, expect_success, gpus_or_skip, launch, program, two_or_more_gpus_or_skip,
    Finished,
};
use regex::Regex;
use std::path::PathBuf;
use std::time::Duration;

/// The launcher's limit on a checking job.
const JOB_LIMIT: Duration = Duration::from_secs(300);
/// A drill must end within this: every wait on another rank is bounded.
pub(crate) const DRILL_LIMIT: Duration = Duration::from_secs(60);
/// The drills' bound on every wait (the default 10 s would make them slow).
pub(crate) const DRILL_WAIT: (&str, &str) = ("LASP_WAIT_TIMEOUT_MS", "3000");

fn lasp2_forward() -> PathBuf {
    program(
        "lasp2_forward",
        None,
        Some(env!("CARGO_BIN_EXE_lasp2_forward")),
    )
}

fn lasp2_backward() -> PathBuf {
    program(
        "lasp2_backward",
        None,
        Some(env!("CARGO_BIN_EXE_lasp2_backward")),
    )
}

fn mlstm_lasp2() -> PathBuf {
    program("mlstm_lasp2", None, Some(env!("CARGO_BIN_EXE_mlstm_lasp2")))
}

fn gla_lasp2() -> PathBuf {
    program("gla_lasp2", None, Some(env!("CARGO_BIN_EXE_gla_lasp2")))
}

fn gated_delta_lasp2() -> PathBuf {
    program(
        "gated_delta_lasp2",
        None,
        Some(env!("CARGO_BIN_EXE_gated_delta_lasp2")),
    )
}

/// Every rank reported `cases` passed cases (lasp-run prefixes each line with `[rank R]`).
pub(crate) fn expect_cases_passed(what: &str, run: &Finished, ranks: usize, cases: usize) {
    expect_success(what, run);
    for rank in 0..ranks {
        let passed = format!("[rank {rank}] PE {rank}: PASS");
        let count = run
            .output
            .lines()
            .filter(|l| l.starts_with(&passed))
            .count();
        assert_eq!(
            count, cases,
            "{what}: rank {rank} passed {count} of {cases} cases"
        );
    }
}

/// The programs exit 1 when a check fails; this also makes sure every rank got as far as the
/// graph replay, the last of its checks (lasp-run prefixes each line with `[rank R]`).
fn expect_checks_passed(what: &str, run: &Finished, ranks: usize, graph_calls: u32) {
    expect_success(what, run);
    for rank in 0..ranks {
        let replayed = format!("[rank {rank}] PE {rank}");
        let done = format!(": {graph_calls} graph-replayed calls, no error");
        assert!(
            run.output
                .lines()
                .any(|line| line.starts_with(&replayed) && line.contains(&done)),
            "{what}: rank {rank} never reported its {graph_calls} graph-replayed calls"
        );
    }
}

#[test]
fn forward_matches_the_reference_in_every_mode_and_graph_replay() {
    let Some(gpus) = gpus_or_skip() else { return };
    let graph_calls = 10_000;
    let calls = graph_calls.to_string();
    let args = ["--graph-calls", &calls, "--no-time"];
    let run = launch(gpus, JOB_LIMIT, &lasp2_forward(), &args, &[]);
    expect_checks_passed("lasp2_forward", &run, gpus, graph_calls);
}

/// GLA: every rank's shard against the f64 reference of the whole sequence, every exchange mode
/// bitwise equal (the program's eight cases, each reported by every rank).
#[test]
fn gla_forward_matches_the_reference_in_every_mode() {
    let Some(gpus) = gpus_or_skip() else { return };
    let run = launch(gpus, JOB_LIMIT, &gla_lasp2(), &[], &[]);
    expect_cases_passed("gla_lasp2", &run, gpus, 8);
}

/// Gated DeltaNet: every rank's shard, forward and backward, against the f64 reference of the
/// whole sequence, every exchange mode and 100 graph replays of each direction bitwise equal (the
/// program's nine cases, each reported by every rank).
#[test]
fn gated_delta_forward_and_backward_match_the_reference_in_every_mode() {
    let Some(gpus) = gpus_or_skip() else { return };
    let run = launch(gpus, JOB_LIMIT, &gated_delta_lasp2(), &[], &[]);
    expect_cases_passed("gated_delta_lasp2", &run, gpus, 9);
}

/// mLSTM: every rank's shard, forward and backward, against the f64 reference of the whole
/// sequence (the stabilised recurrence; mlstm_kernels' gradient), every exchange mode and 100
/// graph replays of each direction bitwise equal (the program's eight cases, each reported by
/// every rank).
#[test]
fn mlstm_forward_and_backward_match_the_reference_in_every_mode() {
    let Some(gpus) = gpus_or_skip() else { return };
    let run = launch(gpus, JOB_LIMIT, &mlstm_lasp2(), &[], &[]);
    expect_cases_passed("mlstm_lasp2", &run, gpus, 8);
}

#[test]
fn backward_matches_the_reference_in_every_mode_and_graph_replay() {
    let Some(gpus) = gpus_or_skip() else { return };
    let graph_calls = 1000;
    let calls = graph_calls.to_string();
    let args = ["--graph-calls", &calls, "--no-time"];
    let run = launch(gpus, JOB_LIMIT, &lasp2_backward(), &args, &[]);
    expect_checks_passed("lasp2_backward", &run, gpus, graph_calls);
}

/// The forward's silent-rank drill on `gpus` ranks with `args` and `env` added: the silent rank
/// (1 where ranks come after it, so that a rank before it runs on too) and the job, which must
/// have failed with a rank naming it within the bound.
pub(crate) fn forward_silent_rank_drill(
    what: &str,
    gpus: usize,
    args: &[&str],
    env: &[(&str, &str)],
) -> (usize, Finished) {
    let silent = if gpus >= 3 { 1 } else { 0 };
    let silent_arg = silent.to_string();
    let args: Vec<&str> = ["--silent-rank", &silent_arg]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let env: Vec<(&str, &str)> = [DRILL_WAIT]
        .into_iter()
        .chain(env.iter().copied())
        .collect();
    let run = launch(gpus, DRILL_LIMIT, &lasp2_forward(), &args, &env);
    expect_failure(
        what,
        &format!("waited [0-9]+ ms for data from PE {silent} "),
        &run,
    );
    (silent, run)
}

/// The PEs that the ranks' drill errors name as the one whose data never came, one per error line.
pub(crate) fn pes_named_in_drill_errors(run: &Finished) -> Vec<usize> {
    let drill_error = Regex::new(r"drill error: .*for data from PE ([0-9]+) ").expect("a pattern");
    run.output
        .lines()
        .filter_map(|line| drill_error.captures(line))
        .map(|c| c[1].parse().expect("a PE number"))
        .collect()
}

/// Every PE after the silent one waits for its tiles: each must name it, and none another PE.
#[test]
fn forward_silent_rank_is_named_by_every_later_rank() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let (silent, run) = forward_silent_rank_drill("LASP-2 forward, silent rank", gpus, &[], &[]);
    let named = pes_named_in_drill_errors(&run);
    let later_ranks = gpus - 1 - silent;
    let naming_it = named.iter().filter(|&&pe| pe == silent).count();
    assert!(
        naming_it == later_ranks && naming_it == named.len(),
        "{naming_it} of {later_ranks} later ranks name PE {silent}, {} name another PE",
        named.len() - naming_it
    );
}

/// Under the pipelined chain a PE waits only for its predecessor: the silent PE's successor names
/// it, and every later PE fails within the bound too (naming the PE before it, which never sent).
#[test]
fn forward_silent_rank_under_the_chain_is_named_by_its_successor() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let (silent, run) = forward_silent_rank_drill(
        "LASP-2 forward along the pipelined chain, silent rank",
        gpus,
        &["--drill-chain"],
        &[],
    );
    let drill_error = Regex::new(r"\[rank ([0-9]+)\].*drill error: .*for data from PE ([0-9]+) ")
        .expect("a pattern");
    let named: Vec<(usize, usize)> = run
        .output
        .lines()
        .filter_map(|line| drill_error.captures(line))
        .map(|c| (c[1].parse().expect("a rank"), c[2].parse().expect("a PE")))
        .collect();
    for rank in silent + 1..gpus {
        assert!(
            named.contains(&(rank, rank - 1)),
            "rank {rank} did not name PE {} (its predecessor): {named:?}",
            rank - 1
        );
    }
}

/// The backward's chain runs the other way: every rank before the silent one waits for its tile.
#[test]
fn backward_silent_rank_is_named() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let silent = if gpus >= 3 { 1 } else { gpus - 1 };
    let run = launch(
        gpus,
        DRILL_LIMIT,
        &lasp2_backward(),
        &["--silent-rank", &silent.to_string()],
        &[DRILL_WAIT],
    );
    expect_failure(
        "LASP-2 backward, silent rank",
        &format!("waited [0-9]+ ms for data from PE {silent} "),
        &run,
    );
}

#[test]
fn forward_layout_mismatch_is_caught_before_any_state_moves() {
    let Some(gpus) = two_or_more_gpus_or_skip() else {
        return;
    };
    let run = launch(
        gpus,
        DRILL_LIMIT,
        &lasp2_forward(),
        &["--mismatch-rank", "1"],
        &[],
    );
    expect_failure(
        "LASP-2 forward, layout mismatch",
        r"PEs \[1\] set up a different layout",
        &run,
    );
}
