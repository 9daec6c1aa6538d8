//! [`OutputProbe`]: the timed variants of the output kernel that `forward_bench --probes`
//! measures, and the names of their kernels.

use lasp_shmem_kernels::instances;

/// A timed variant of the output kernel, for [`ScalarDecayForward::launch_output_probe`].
///
/// A measurement tool (`forward_bench --probes`; `kernels/docs/scalar-decay.md`, "Probes"),
/// not an API for users: only [`OutputProbe::Output`] computes the forward's output, and only
/// after a full [`ScalarDecayForward::launch`] of the same inputs has left the segment prefixes in
/// the workspace. Every variant runs with the output kernel's grid, block, shared memory and
/// params; the probe kernels are `lasp::sd::Probe` in `scalar_decay/chunk.cuh`.
///
/// [`ScalarDecayForward::launch_output_probe`]: super::ScalarDecayForward::launch_output_probe
/// [`ScalarDecayForward::launch`]: super::ScalarDecayForward::launch
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputProbe {
    /// The production output kernel alone: the forward without its states pass and fold.
    Output,
    /// The output kernel's loads (every chunk's q, k, v, g through the same cp.async pipeline)
    /// and O stores, without its math.
    Memory,
    /// The output kernel's math with no HBM traffic for inputs: each pipeline stage is loaded
    /// once and reused for every chunk; O stores go to the segment's first chunk (L2).
    Compute,
    /// [`OutputProbe::Compute`] without the gate exponentials, causal mask and scalings.
    NoExp,
}

impl OutputProbe {
    /// Every variant, the production kernel first.
    pub const ALL: [OutputProbe; 4] = [
        OutputProbe::Output,
        OutputProbe::Memory,
        OutputProbe::Compute,
        OutputProbe::NoExp,
    ];

    /// A short name for reports (`output`, `probe_memory`, `probe_compute`, `probe_no_exp`).
    pub fn label(self) -> &'static str {
        match self {
            OutputProbe::Output => "output",
            OutputProbe::Memory => "probe_memory",
            OutputProbe::Compute => "probe_compute",
            OutputProbe::NoExp => "probe_no_exp",
        }
    }

    /// The probe kernels, indexed by Dk `[64, 128]` (`None` for the production kernel).
    pub(super) fn probe_kernel_names(self) -> Option<[&'static str; 2]> {
        match self {
            OutputProbe::Output => None,
            OutputProbe::Memory => Some(instances::SD_OUTPUT_PROBE_MEMORY),
            OutputProbe::Compute => Some(instances::SD_OUTPUT_PROBE_COMPUTE),
            OutputProbe::NoExp => Some(instances::SD_OUTPUT_PROBE_NO_EXP),
        }
    }
}
