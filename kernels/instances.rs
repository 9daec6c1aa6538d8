// The one table of kernel instantiations: every templated kernel the cubin exports, by the
// source that defines its body. `build.rs` includes this file to write the `extern "C"` wrappers
// (appended to their source's compilation unit) and the Rust constants that name them
// (`lasp_shmem_kernels::instances`), so the host never spells a kernel's name by hand.
//
// A row with `{dk}` in its name is instantiated once per key width in `DK_WIDTHS`, with `{dk}`
// replaced in the name, in `bounds` and in `call`; its constant is then an array indexed like `DK_WIDTHS`.

/// Sources compiled on their own into a cubin of their own per architecture, without `-rdc` and
/// without NVSHMEM's device archive: their kernels call no NVSHMEM function and hand registers
/// between warpgroups with `setmaxnreg`, which ptxas ignores in relocatable device code (C7504).
pub const STANDALONE_SOURCES: &[&str] = &[GDN_FORWARD_ROLES];

/// Key widths every per-Dk kernel is built for.
pub const DK_WIDTHS: [u32; 2] = [64, 128];

/// One exported kernel (or one per key width).
pub struct Instance {
    /// The Rust constant that names it (upper case).
    pub constant: &'static str,
    /// The exported name; `{dk}` is the key width.
    pub name: &'static str,
    /// The source (relative to `kernels/cuda`) whose compilation unit defines the body.
    pub source: &'static str,
    /// `__launch_bounds__` arguments.
    pub bounds: &'static str,
    /// The C parameter struct, passed by value as a `__grid_constant__`.
    pub params: &'static str,
    /// The body: a call with the parameters named `p`.
    pub call: &'static str,
}

const fn row(
    constant: &'static str,
    name: &'static str,
    source: &'static str,
    bounds: &'static str,
    params: &'static str,
    call: &'static str,
) -> Instance {
    Instance {
        constant,
        name,
        source,
        bounds,
        params,
        call,
    }
}

const SD_FORWARD: &str = "scalar_decay/forward.cu";
const SD_BACKWARD: &str = "scalar_decay/backward.cu";
const SD_DOCUMENT_STATES: &str = "scalar_decay/document_states.cu";
/// Every family's final-states kernel of packed documents takes these.
const DOCUMENT_STATES_PARAMS: &str = "lasp_document_states_params";
const SD_LASP2_FORWARD: &str = "scalar_decay/lasp2_forward.cu";
const SD_LASP2_BACKWARD: &str = "scalar_decay/lasp2_backward.cu";
const SD_LASP2_SUMMARY: &str = "scalar_decay/lasp2_fold_put.cu";
const SD_PARAMS: &str = "lasp_scalar_decay_params";
const SD_ROLES_PARAMS: &str = "lasp_sd_roles_params";
const SD_THREADS: &str = "LASP_SD_THREADS, 1";
const SD_ROLES_THREADS: &str = "LASP_SD_ROLES_THREADS, 1";
const L2_PARAMS: &str = "lasp_lasp2_params";
const GLA_FORWARD: &str = "gla/forward.cu";
const GLA_PARAMS: &str = "lasp_gla_params";
const GLA_DOCUMENT_STATES: &str = "gla/document_states.cu";
const GLA_LASP2: &str = "gla/lasp2_forward.cu";
const GLA_L2_PARAMS: &str = "lasp_gla_lasp2_params";
const GLA_BACKWARD: &str = "gla/backward.cu";
const GLA_LASP2_BACKWARD: &str = "gla/lasp2_backward.cu";
const GLA_BWD_PARAMS: &str = "lasp_gla_bwd_params";
const GDN_FORWARD: &str = "gated_delta/forward.cu";
const GDN_FORWARD_ROLES: &str = "gated_delta/forward_roles.cu";
const GDN_DOCUMENT_STATES: &str = "gated_delta/document_states.cu";
const GDN_PARAMS: &str = "lasp_gated_delta_params";
const GDN_LASP2: &str = "gated_delta/lasp2_forward.cu";
const GDN_L2_PARAMS: &str = "lasp_gated_delta_lasp2_params";
const GDN_BACKWARD: &str = "gated_delta/backward.cu";
const GDN_LASP2_BACKWARD: &str = "gated_delta/lasp2_backward.cu";
const GDN_BWD_PARAMS: &str = "lasp_gated_delta_bwd_params";
const MLSTM_FORWARD: &str = "mlstm/forward.cu";
const MLSTM_PARAMS: &str = "lasp_mlstm_params";
const MLSTM_DOCUMENT_STATES: &str = "mlstm/document_states.cu";

/// Every templated kernel. Template arguments of `run_segment`: key width, output pass, probe,
/// two roles, reversed time axis, block states (lasp/scalar_decay/chunk.cuh). The LASP-2 kernels
/// that exchange take the schedule (lasp/exchange/chain.cuh): a schedule adds its rows here.
pub const INSTANCES: &[Instance] = &[
    // The scalar-decay forward (single GPU) and the time-reversed builds its backward uses.
    row("SD_STATES", "lasp_scalar_decay_states_dk{dk}", SD_FORWARD, SD_THREADS, SD_PARAMS,
        "lasp::sd::run_segment<{dk}, false>(p)"),
    row("SD_OUTPUT", "lasp_scalar_decay_output_dk{dk}", SD_FORWARD, SD_THREADS, SD_PARAMS,
        "lasp::sd::run_segment<{dk}, true>(p)"),
    row("SD_STATES_REVERSED", "lasp_scalar_decay_states_reversed_dk{dk}", SD_FORWARD, SD_THREADS,
        SD_PARAMS, "lasp::sd::run_segment<{dk}, false, lasp::sd::Probe::kNone, false, true>(p)"),
    row("SD_OUTPUT_REVERSED", "lasp_scalar_decay_output_reversed_dk{dk}", SD_FORWARD, SD_THREADS,
        SD_PARAMS, "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kNone, false, true>(p)"),
    row("SD_OUTPUT_BLOCK_STATES", "lasp_scalar_decay_output_block_states_dk{dk}", SD_FORWARD,
        SD_THREADS, SD_PARAMS,
        "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kNone, false, false, true>(p)"),
    row("SD_OUTPUT_REVERSED_BLOCK_STATES", "lasp_scalar_decay_output_reversed_block_states_dk{dk}",
        SD_FORWARD, SD_THREADS, SD_PARAMS,
        "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kNone, false, true, true>(p)"),
    row("SD_OUTPUT_ROLES", "lasp_scalar_decay_output_roles_dk{dk}", SD_FORWARD, SD_ROLES_THREADS,
        SD_ROLES_PARAMS, "lasp::sd::run_roles_output<{dk}, false>(p)"),
    row("SD_OUTPUT_ROLES_BLOCK_STATES", "lasp_scalar_decay_output_roles_block_states_dk{dk}",
        SD_FORWARD, SD_ROLES_THREADS, SD_ROLES_PARAMS, "lasp::sd::run_roles_output<{dk}, true>(p)"),
    row("SD_OUTPUT_DOCUMENT_ENTRIES", "lasp_scalar_decay_output_document_entries_dk{dk}", SD_FORWARD,
        SD_THREADS, SD_PARAMS,
        "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kNone, false, false, false, true>(p)"),
    row("SD_OUTPUT_ROLES_DOCUMENT_ENTRIES", "lasp_scalar_decay_output_roles_document_entries_dk{dk}",
        SD_FORWARD, SD_ROLES_THREADS, SD_ROLES_PARAMS, "lasp::sd::run_roles_output<{dk}, false, true>(p)"),
    row("SD_DOCUMENT_ENTRIES_WALK", "lasp_scalar_decay_document_entries_dk{dk}", SD_FORWARD, SD_THREADS,
        SD_PARAMS, "lasp::sd::run_document_entries_walk<{dk}>(p)"),
    row("SD_DOCUMENT_STATES", "lasp_scalar_decay_document_states_dk{dk}", SD_DOCUMENT_STATES,
        "LASP_DOCUMENT_STATES_THREADS, 1", DOCUMENT_STATES_PARAMS,
        "lasp::sd::document_states<{dk}>(p)"),
    row("SD_OUTPUT_PROBE_MEMORY", "lasp_scalar_decay_output_dk{dk}_probe_memory", SD_FORWARD,
        SD_THREADS, SD_PARAMS, "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kMemory>(p)"),
    row("SD_OUTPUT_PROBE_COMPUTE", "lasp_scalar_decay_output_dk{dk}_probe_compute", SD_FORWARD,
        SD_THREADS, SD_PARAMS, "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kCompute>(p)"),
    row("SD_OUTPUT_PROBE_NO_EXP", "lasp_scalar_decay_output_dk{dk}_probe_no_exp", SD_FORWARD,
        SD_THREADS, SD_PARAMS, "lasp::sd::run_segment<{dk}, true, lasp::sd::Probe::kNoExp>(p)"),
    // Its backward's gate terms.
    row("SD_BWD_GATE_TERMS", "lasp_sd_bwd_gate_terms_dk{dk}", SD_BACKWARD,
        "LASP_SDB_TERM_THREADS", "lasp_sd_bwd_params", "gate_terms<{dk}>(p)"),
    // Its LASP-2 forward and backward, on the all-gather schedule.
    row("SD_LASP2_STATES", "lasp_lasp2_states_dk{dk}", SD_LASP2_FORWARD, "LASP2_THREADS, 1",
        L2_PARAMS, "lasp::l2::shard_states<{dk}, false>(p)"),
    row("SD_LASP2_SUMMARY", "lasp_lasp2_fold_put", SD_LASP2_SUMMARY, "LASP2_FOLD_THREADS",
        L2_PARAMS, "lasp::l2::fold_put<lasp::exchange::Exchange>(p)"),
    row("SD_LASP2_OUTPUT", "lasp_lasp2_output_dk{dk}", SD_LASP2_FORWARD, "LASP2_THREADS, 1",
        L2_PARAMS, "lasp::l2::output<{dk}, lasp::exchange::Exchange>(p)"),
    row("SD_LASP2_STATES_REVERSED", "lasp_lasp2_states_reversed_dk{dk}", SD_LASP2_BACKWARD,
        "LASP2_THREADS, 1", L2_PARAMS, "lasp::l2::shard_states<{dk}, true>(p)"),
    row("SD_LASP2_CARRY_IN", "lasp_lasp2_carry_in_dk{dk}", SD_LASP2_BACKWARD, "LASP2_THREADS",
        L2_PARAMS, "lasp::l2::carry_in<{dk}, lasp::exchange::Exchange>(p)"),
    // GLA's forward (single GPU): its states pass, and its output pass per value width. Every GLA
    // kernel with a chunk loop has a twin for packed documents (_PACKED: the masks at the starts),
    // so that the loops without documents compile with no mask in them.
    row("GLA_STATES", "lasp_gla_states_dk{dk}", GLA_FORWARD, "LASP_GLA_STATES_THREADS, 1",
        GLA_PARAMS, "lasp::gla::run_states<{dk}, false>(p)"),
    row("GLA_STATES_PACKED", "lasp_gla_states_dk{dk}_packed", GLA_FORWARD, "LASP_GLA_STATES_THREADS, 1",
        GLA_PARAMS, "lasp::gla::run_states<{dk}, true>(p)"),
    row("GLA_OUTPUT_DV64", "lasp_gla_output_dk{dk}_dv64", GLA_FORWARD, "128, 1", GLA_PARAMS,
        "lasp::gla::run_output<{dk}, 64, false>(p)"),
    row("GLA_OUTPUT_DV64_PACKED", "lasp_gla_output_dk{dk}_dv64_packed", GLA_FORWARD, "128, 1", GLA_PARAMS,
        "lasp::gla::run_output<{dk}, 64, true>(p)"),
    row("GLA_OUTPUT_DV128", "lasp_gla_output_dk{dk}_dv128", GLA_FORWARD, "256, 1", GLA_PARAMS,
        "lasp::gla::run_output<{dk}, 128, false>(p)"),
    row("GLA_OUTPUT_DV128_PACKED", "lasp_gla_output_dk{dk}_dv128_packed", GLA_FORWARD, "256, 1", GLA_PARAMS,
        "lasp::gla::run_output<{dk}, 128, true>(p)"),
    // The final states of packed documents: the packed output loops that also store the states
    // entering the documents' last chunks (_ENTRIES), and the kernel that adds their tokens.
    row("GLA_OUTPUT_DV64_ENTRIES", "lasp_gla_output_dk{dk}_dv64_entries", GLA_FORWARD, "128, 1", GLA_PARAMS,
        "lasp::gla::run_output<{dk}, 64, true, true>(p)"),
    row("GLA_OUTPUT_DV128_ENTRIES", "lasp_gla_output_dk{dk}_dv128_entries", GLA_FORWARD, "256, 1", GLA_PARAMS,
        "lasp::gla::run_output<{dk}, 128, true, true>(p)"),
    row("GLA_DOCUMENT_STATES", "lasp_gla_document_states_dk{dk}", GLA_DOCUMENT_STATES,
        "LASP_DOCUMENT_STATES_THREADS, 1", DOCUMENT_STATES_PARAMS,
        "lasp::gla::document_states<{dk}>(p)"),
    // GLA's LASP-2 forward, on the all-gather schedule.
    row("GLA_LASP2_STATES", "lasp_gla_lasp2_states_dk{dk}", GLA_LASP2, "LASP_GLA_STATES_THREADS, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_states<{dk}, false>(p)"),
    row("GLA_LASP2_STATES_PACKED", "lasp_gla_lasp2_states_dk{dk}_packed", GLA_LASP2, "LASP_GLA_STATES_THREADS, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_states<{dk}, true>(p)"),
    row("GLA_LASP2_SUMMARY", "lasp_gla_lasp2_summary", GLA_LASP2, "LASP_GLA_LASP2_SUMMARY_THREADS",
        GLA_L2_PARAMS, "lasp::gla::lasp2_summary<lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_OUTPUT_DV64", "lasp_gla_lasp2_output_dk{dk}_dv64", GLA_LASP2, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_output<{dk}, 64, false, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_OUTPUT_DV64_PACKED", "lasp_gla_lasp2_output_dk{dk}_dv64_packed", GLA_LASP2, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_output<{dk}, 64, true, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_OUTPUT_DV128", "lasp_gla_lasp2_output_dk{dk}_dv128", GLA_LASP2, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_output<{dk}, 128, false, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_OUTPUT_DV128_PACKED", "lasp_gla_lasp2_output_dk{dk}_dv128_packed", GLA_LASP2, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_output<{dk}, 128, true, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_OUTPUT_DV64_ENTRIES", "lasp_gla_lasp2_output_dk{dk}_dv64_entries", GLA_LASP2, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_output<{dk}, 64, true, lasp::exchange::Exchange, true>(p)"),
    row("GLA_LASP2_OUTPUT_DV128_ENTRIES", "lasp_gla_lasp2_output_dk{dk}_dv128_entries", GLA_LASP2, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_output<{dk}, 128, true, lasp::exchange::Exchange, true>(p)"),
    // GLA's LASP-2 backward: the shard's segment summaries and its walk, per value width (the
    // summary and advance kernels are the forward's; the gradients the single-GPU grads kernel).
    row("GLA_LASP2_BWD_STATES_DV64", "lasp_gla_lasp2_bwd_states_dk{dk}_dv64", GLA_LASP2_BACKWARD, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_states<{dk}, 64, false>(p)"),
    row("GLA_LASP2_BWD_STATES_DV64_PACKED", "lasp_gla_lasp2_bwd_states_dk{dk}_dv64_packed", GLA_LASP2_BACKWARD, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_states<{dk}, 64, true>(p)"),
    row("GLA_LASP2_BWD_STATES_DV128", "lasp_gla_lasp2_bwd_states_dk{dk}_dv128", GLA_LASP2_BACKWARD, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_states<{dk}, 128, false>(p)"),
    row("GLA_LASP2_BWD_STATES_DV128_PACKED", "lasp_gla_lasp2_bwd_states_dk{dk}_dv128_packed", GLA_LASP2_BACKWARD, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_states<{dk}, 128, true>(p)"),
    row("GLA_LASP2_BWD_WALK_DV64", "lasp_gla_lasp2_bwd_walk_dk{dk}_dv64", GLA_LASP2_BACKWARD, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_walk<{dk}, 64, false, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_BWD_WALK_DV64_PACKED", "lasp_gla_lasp2_bwd_walk_dk{dk}_dv64_packed", GLA_LASP2_BACKWARD, "128, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_walk<{dk}, 64, true, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_BWD_WALK_DV128", "lasp_gla_lasp2_bwd_walk_dk{dk}_dv128", GLA_LASP2_BACKWARD, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_walk<{dk}, 128, false, lasp::exchange::Exchange>(p)"),
    row("GLA_LASP2_BWD_WALK_DV128_PACKED", "lasp_gla_lasp2_bwd_walk_dk{dk}_dv128_packed", GLA_LASP2_BACKWARD, "256, 1",
        GLA_L2_PARAMS, "lasp::gla::lasp2_bwd_walk<{dk}, 128, true, lasp::exchange::Exchange>(p)"),
    // GLA's backward (single GPU): the walks' summaries, the walks, the gradients per value width.
    row("GLA_BWD_SUMMARY_DV64", "lasp_gla_bwd_summary_dk{dk}_dv64", GLA_BACKWARD, "128, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_summary<{dk}, 64, false>(p)"),
    row("GLA_BWD_SUMMARY_DV64_PACKED", "lasp_gla_bwd_summary_dk{dk}_dv64_packed", GLA_BACKWARD, "128, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_summary<{dk}, 64, true>(p)"),
    row("GLA_BWD_SUMMARY_DV128", "lasp_gla_bwd_summary_dk{dk}_dv128", GLA_BACKWARD, "256, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_summary<{dk}, 128, false>(p)"),
    row("GLA_BWD_SUMMARY_DV128_PACKED", "lasp_gla_bwd_summary_dk{dk}_dv128_packed", GLA_BACKWARD, "256, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_summary<{dk}, 128, true>(p)"),
    row("GLA_BWD_WALK_DV64", "lasp_gla_bwd_walk_dk{dk}_dv64", GLA_BACKWARD, "128, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_walk<{dk}, 64, false>(p)"),
    row("GLA_BWD_WALK_DV64_PACKED", "lasp_gla_bwd_walk_dk{dk}_dv64_packed", GLA_BACKWARD, "128, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_walk<{dk}, 64, true>(p)"),
    row("GLA_BWD_WALK_DV128", "lasp_gla_bwd_walk_dk{dk}_dv128", GLA_BACKWARD, "256, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_walk<{dk}, 128, false>(p)"),
    row("GLA_BWD_WALK_DV128_PACKED", "lasp_gla_bwd_walk_dk{dk}_dv128_packed", GLA_BACKWARD, "256, 1", GLA_BWD_PARAMS,
        "lasp::gla::bwd_walk<{dk}, 128, true>(p)"),
    row("GLA_BWD_GRADS_DV64", "lasp_gla_bwd_grads_dk{dk}_dv64", GLA_BACKWARD,
        "lasp_gla_bwd_grads_threads({dk}, 64), 1", GLA_BWD_PARAMS, "lasp::gla::bwd_grads<{dk}, 64, false>(p)"),
    row("GLA_BWD_GRADS_DV64_PACKED", "lasp_gla_bwd_grads_dk{dk}_dv64_packed", GLA_BACKWARD,
        "lasp_gla_bwd_grads_threads({dk}, 64), 1", GLA_BWD_PARAMS, "lasp::gla::bwd_grads<{dk}, 64, true>(p)"),
    row("GLA_BWD_GRADS_DV128", "lasp_gla_bwd_grads_dk{dk}_dv128", GLA_BACKWARD,
        "lasp_gla_bwd_grads_threads({dk}, 128), 1", GLA_BWD_PARAMS, "lasp::gla::bwd_grads<{dk}, 128, false>(p)"),
    row("GLA_BWD_GRADS_DV128_PACKED", "lasp_gla_bwd_grads_dk{dk}_dv128_packed", GLA_BACKWARD,
        "lasp_gla_bwd_grads_threads({dk}, 128), 1", GLA_BWD_PARAMS, "lasp::gla::bwd_grads<{dk}, 128, true>(p)"),
    // Gated DeltaNet's forward (single GPU): the chunks' (I + L)^{-1}, the segments' affine
    // summaries and their fold, then scalar decay's output loop with the delta rule's values step.
    row("GDN_WY", "lasp_gated_delta_wy_dk{dk}", GDN_FORWARD, "LASP_GDN_WY_THREADS, lasp_gdn_wy_min_ctas({dk})",
        GDN_PARAMS, "lasp::gdn::run_wy<{dk}>(p)"),
    row("GDN_SUMMARY", "lasp_gated_delta_summary_dk{dk}", GDN_FORWARD, SD_THREADS, GDN_PARAMS,
        "lasp::gdn::run_summary<{dk}>(p)"),
    row("GDN_FOLD", "lasp_gated_delta_fold_dk{dk}", GDN_FORWARD, "LASP_GDN_FOLD_THREADS", GDN_PARAMS,
        "lasp::gdn::run_fold<{dk}>(p)"),
    row("GDN_DOCUMENT_ENTRIES_WALK", "lasp_gated_delta_document_entries_dk{dk}", GDN_FORWARD, SD_THREADS,
        GDN_PARAMS, "lasp::gdn::run_document_entries_walk<{dk}>(p)"),
    row("GDN_DOCUMENT_STATES", "lasp_gated_delta_document_states_dk{dk}", GDN_DOCUMENT_STATES,
        "LASP_DOCUMENT_STATES_THREADS, 1", DOCUMENT_STATES_PARAMS,
        "lasp::gdn::document_states<{dk}>(p)"),
    row("GDN_OUTPUT", "lasp_gated_delta_output_dk{dk}", GDN_FORWARD, SD_THREADS, GDN_PARAMS,
        "lasp::gdn::run_output<{dk}>(p)"),
    row("GDN_OUTPUT_ROLES", "lasp_gated_delta_output_roles_dk{dk}", GDN_FORWARD_ROLES, "LASP_GDN_ROLES_THREADS, 1",
        "lasp_gdn_roles_params", "lasp::gdn::run_output_roles<{dk}>(p)"),
    // Gated DeltaNet's backward (single GPU): the forward's (I + L)^{-1} again with W, the chain
    // again storing every chunk's state and u, the reversed chain of dS (per segment, after the
    // segments' summaries of it and their fold), then every chunk's gradients.
    row("GDN_BWD_WY", "lasp_gated_delta_bwd_wy_dk{dk}", GDN_BACKWARD,
        "LASP_GDN_WY_THREADS, lasp_gdn_wy_min_ctas({dk})", GDN_BWD_PARAMS, "lasp::gdn::bwd_wy<{dk}>(p)"),
    row("GDN_BWD_STATES", "lasp_gated_delta_bwd_states_dk{dk}", GDN_BACKWARD, SD_THREADS, GDN_BWD_PARAMS,
        "lasp::gdn::bwd_states<{dk}>(p)"),
    row("GDN_BWD_DH_SUMMARY", "lasp_gated_delta_bwd_dh_summary_dk{dk}", GDN_BACKWARD, SD_THREADS, GDN_BWD_PARAMS,
        "lasp::gdn::bwd_dh<{dk}, true>(p)"),
    row("GDN_BWD_FOLD", "lasp_gated_delta_bwd_fold_dk{dk}", GDN_BACKWARD, "LASP_GDN_FOLD_THREADS", GDN_BWD_PARAMS,
        "lasp::gdn::bwd_fold<{dk}>(p)"),
    row("GDN_BWD_DH", "lasp_gated_delta_bwd_dh_dk{dk}", GDN_BACKWARD, SD_THREADS, GDN_BWD_PARAMS,
        "lasp::gdn::bwd_dh<{dk}, false>(p)"),
    row("GDN_BWD_GRADS", "lasp_gated_delta_bwd_grads_dk{dk}", GDN_BACKWARD, "LASP_GDN_BWD_GRADS_THREADS, 1",
        GDN_BWD_PARAMS, "lasp::gdn::bwd_grads<{dk}>(p)"),
    // Gated DeltaNet's LASP-2 forward, on the all-gather schedule: the shard's summary and the fold
    // of the exchanged ones (its chunk passes are the single-GPU forward's).
    row("GDN_LASP2_SUMMARY", "lasp_gated_delta_lasp2_summary", GDN_LASP2, "LASP_GDN_FOLD_THREADS",
        GDN_L2_PARAMS, "lasp::gdn::lasp2_summary<lasp::exchange::Exchange>(p)"),
    row("GDN_LASP2_FOLD", "lasp_gated_delta_lasp2_fold_dk{dk}", GDN_LASP2, "LASP_GDN_FOLD_THREADS",
        GDN_L2_PARAMS, "lasp::gdn::lasp2_fold<{dk}, lasp::exchange::Exchange>(p)"),
    // Gated DeltaNet's LASP-2 backward: the fold of the later PEs' summaries into the gradient
    // leaving the shard (its summary is the forward's kernel; its chunk passes the single-GPU
    // backward's).
    row("GDN_LASP2_BWD_FOLD", "lasp_gated_delta_lasp2_bwd_fold_dk{dk}", GDN_LASP2_BACKWARD,
        "LASP_GDN_FOLD_THREADS", GDN_L2_PARAMS, "lasp::gdn::lasp2_bwd_fold<{dk}, lasp::exchange::Exchange>(p)"),
    // mLSTM's forward (single GPU): its states and output passes per value width (one warpgroup
    // per 64 columns of Dv); its backward's gradient passes are the same kernels without the
    // normaliser, rows scaled and dotted (lasp/mlstm/backward_params.h). Each has a twin for
    // packed documents (_PACKED: the masks at the starts).
    row("MLSTM_STATES_DV64", "lasp_mlstm_states_dk{dk}_dv64", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 64>(p)"),
    row("MLSTM_STATES_DV64_PACKED", "lasp_mlstm_states_dk{dk}_dv64_packed", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 64, false, true>(p)"),
    row("MLSTM_STATES_DV128", "lasp_mlstm_states_dk{dk}_dv128", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 128>(p)"),
    row("MLSTM_STATES_DV128_PACKED", "lasp_mlstm_states_dk{dk}_dv128_packed", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 128, false, true>(p)"),
    row("MLSTM_OUTPUT_DV64", "lasp_mlstm_output_dk{dk}_dv64", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 64>(p)"),
    row("MLSTM_OUTPUT_DV64_PACKED", "lasp_mlstm_output_dk{dk}_dv64_packed", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 64, false, true>(p)"),
    row("MLSTM_OUTPUT_DV128", "lasp_mlstm_output_dk{dk}_dv128", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 128>(p)"),
    row("MLSTM_OUTPUT_DV128_PACKED", "lasp_mlstm_output_dk{dk}_dv128_packed", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 128, false, true>(p)"),
    // The final states of packed documents: the packed output loops that also store the states
    // entering the documents' last chunks (_ENTRIES), and the kernel that adds their tokens.
    row("MLSTM_OUTPUT_DV64_ENTRIES", "lasp_mlstm_output_dk{dk}_dv64_entries", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 64, false, true, true>(p)"),
    row("MLSTM_OUTPUT_DV128_ENTRIES", "lasp_mlstm_output_dk{dk}_dv128_entries", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 128, false, true, true>(p)"),
    row("MLSTM_DOCUMENT_STATES", "lasp_mlstm_document_states_dk{dk}", MLSTM_DOCUMENT_STATES,
        "LASP_DOCUMENT_STATES_THREADS, 1", DOCUMENT_STATES_PARAMS,
        "lasp::mlstm::document_states<{dk}>(p)"),
    row("MLSTM_GRAD_STATES_DV64", "lasp_mlstm_grad_states_dk{dk}_dv64", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 64, true>(p)"),
    row("MLSTM_GRAD_STATES_DV64_PACKED", "lasp_mlstm_grad_states_dk{dk}_dv64_packed", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 64, true, true>(p)"),
    row("MLSTM_GRAD_STATES_DV128", "lasp_mlstm_grad_states_dk{dk}_dv128", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 128, true>(p)"),
    row("MLSTM_GRAD_STATES_DV128_PACKED", "lasp_mlstm_grad_states_dk{dk}_dv128_packed", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_states<{dk}, 128, true, true>(p)"),
    row("MLSTM_GRAD_OUTPUT_DV64", "lasp_mlstm_grad_output_dk{dk}_dv64", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 64, true>(p)"),
    row("MLSTM_GRAD_OUTPUT_DV64_PACKED", "lasp_mlstm_grad_output_dk{dk}_dv64_packed", MLSTM_FORWARD, "128, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 64, true, true>(p)"),
    row("MLSTM_GRAD_OUTPUT_DV128", "lasp_mlstm_grad_output_dk{dk}_dv128", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 128, true>(p)"),
    row("MLSTM_GRAD_OUTPUT_DV128_PACKED", "lasp_mlstm_grad_output_dk{dk}_dv128_packed", MLSTM_FORWARD, "256, 1", MLSTM_PARAMS,
        "lasp::mlstm::run_output<{dk}, 128, true, true>(p)"),
];
