//! The LASP-2 forward (kernels/cuda/scalar_decay/lasp2_forward.cu; protocol in kernels/docs/lasp2.md).
//!
//! Per call and per (b, h): the states kernel computes every segment's local end state;
//! `fold_put` folds them into the shard's state `M_w` (from zero) and decay `Λ_w` and, in
//! [`ExchangeMode::Overlapped`], puts that tile into every later PE's slot with a signal, from the
//! device; the output kernel waits for the earlier PEs' tiles, folds the prefix
//! `P_w = fold_{u<w}(e^{Λ_u} P + M_u)` and runs the chunkwise forward of the shard from it.
//!
//! The heads can be cut into groups ([`Lasp2Tuning::head_groups`]; one by default) and every
//! kernel runs once per group: states of every group, then outputs of every group. In the
//! overlapped mode each group's `fold_put` runs on a second, high-priority stream as soon as that
//! group's states are done, so with two or more groups group 0's exchange travels while group 1's
//! states are computed and the last group's while group 0's outputs are.

use super::super::{
    check_args, geometry as sd, segment_kernels, ForwardArgs, ScalarDecay, TensorChecks,
};
use super::{geometry, ExchangeMode, Lasp2Layout, Lasp2Params};
use crate::error::{Error, Result};
use crate::exchange::chain::StateChain;
use crate::exchange::planner::LaunchPlans;
use crate::exchange::Direction;
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::sm_count;
use crate::ops::{ranges_overlap, DeviceMut, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

/// `%globaltimer` stamps (ns, this GPU's clock) of one call, recorded on request
/// ([`Lasp2Forward::record_timeline`]). Tile `i = bh * (Dv/64) + vt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lasp2Timeline {
    /// Per tile: the fold_put CTA is about to put (credits granted), and its puts are complete.
    pub puts: Vec<[u64; 2]>,
    /// Per (tile, segment), index `i * segments + s`: output CTA start, earlier PEs' tiles seen
    /// (signals), chunk loop start (prefix folded).
    pub outputs: Vec<[u64; 3]>,
    pub segments: usize,
}

impl Lasp2Timeline {
    fn from_words(words: &[u64], tiles: usize, segments: usize) -> Self {
        let (puts, outputs) = words.split_at(2 * tiles);
        Lasp2Timeline {
            puts: puts.chunks_exact(2).map(|c| [c[0], c[1]]).collect(),
            outputs: outputs
                .chunks_exact(3)
                .map(|c| [c[0], c[1], c[2]])
                .collect(),
            segments,
        }
    }

    /// Nanoseconds each output CTA spent waiting for the earlier PEs' tiles (0 where the data
    /// was there when the CTA started): the part of the exchange left on the critical path.
    pub fn output_waits_ns(&self) -> Vec<u64> {
        self.outputs
            .iter()
            .map(|o| o[1].saturating_sub(o[0]))
            .collect()
    }
}

/// How a call is cut into launches. Per head the arithmetic depends only on the segment count S
/// (chunk boundaries and fold order), never on the groups, so any tuning gives the same bits as
/// long as S is unchanged; every mode of a PE uses the same plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lasp2Tuning {
    /// Head groups G (at most B*H). With 2 or more, group g's exchange overlaps group g + 1's
    /// states pass and the last group's exchange overlaps group 0's output pass; 1 puts the whole
    /// exchange between the states and the output passes.
    pub head_groups: usize,
    /// CTAs per SM that one group's states or output launch aims for (segments are cut to reach
    /// it). 2 hides latency inside the kernels; 1 leaves more room beside them for the
    /// `fold_put` CTAs of the exchange stream but places the compute CTAs unevenly when those
    /// take SMs first (measured slower at every shape at W = 4).
    pub ctas_per_sm: u32,
}

/// The plan a call gets unless one was set ([`Lasp2Forward::set_tuning`]): one head group, two
/// CTAs per SM. Two or more groups were slower at every shape measured on H200 NVLink, also where
/// the exchange is the largest share of a call's bytes: W = 4 (plan sweep on 4x H200: B=4,
/// T_local=8K 0.397 ms with one group against 0.424 with two; 32K 0.368 / 0.444; 128K 1.312 /
/// 1.389) and W = 8, B=4, T_local=8K, where the busiest PE's egress is 5.5 % of the q, k, v, o
/// bytes (8x H200, two passes: 0.4037, 0.4009 ms with one group; 0.4134, 0.4178 with two;
/// 0.4762, 0.4791 with four). The grouping costs launches and doubles S (no-comm 0.3117 ms with
/// one group, 0.3490 with two), and the output CTAs still waited up to 74 us for their tiles
/// (timeline of the 8-GPU benchmark), so it does not buy back its cost there. Where S stays the
/// same, the planner ([`Lasp2Forward::plan`]) tries two and four groups too: at B=16, T_local=1K
/// (W = 4, 4x H100) two groups took 0.3387 ms against 0.3610 with one.
impl Default for Lasp2Tuning {
    fn default() -> Self {
        Lasp2Tuning {
            head_groups: 1,
            ctas_per_sm: 2,
        }
    }
}

/// The launches of one call: S segments per head (the same for every group) and the head groups
/// as `(first b*H+h, heads)`, contiguous and ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct CallPlan {
    pub(super) segments: i32,
    pub(super) chunks_per_segment: i32,
    pub(super) groups: Vec<(i32, i32)>,
}

impl CallPlan {
    pub(super) fn new(bh: i32, t: i32, dv: i32, sm_count: u32, tuning: Lasp2Tuning) -> Self {
        let g = (tuning.head_groups.max(1) as i32).min(bh);
        let groups: Vec<(i32, i32)> = (0..g)
            .map(|i| {
                let begin = (i as i64 * bh as i64 / g as i64) as i32;
                let end = ((i + 1) as i64 * bh as i64 / g as i64) as i32;
                (begin, end - begin)
            })
            .collect();
        let widest = groups.iter().map(|&(_, n)| n).max().expect("g >= 1");
        let target = (sm_count.max(1) * tuning.ctas_per_sm.max(1)) as i32;
        let segments = sd::num_segments(1, widest, t, dv, target);
        CallPlan {
            segments,
            chunks_per_segment: sd::chunks_per_segment(t, segments),
            groups,
        }
    }
}

/// The LASP-2 forward on one PE: owns its chain's symmetric slots and signals, the epoch counter
/// and the workspace. Creating it and switching modes are collective; each call is not (in the
/// overlapped mode, it synchronises with the other PEs only through device signals).
pub struct Lasp2Forward {
    /// First: fields drop in order, and the chain's drop waits for every call before the
    /// workspace (used on the callers' streams) is freed.
    chain: StateChain<ScalarDecay>,
    states: [Kernel; 2],
    output: [Kernel; 2],
    segment_prefix: Kernel,
    workspace: Option<CudaSlice<u8>>,
    sm_count: u32,
    /// The user's plan, or `None` for [`Lasp2Tuning::default`].
    tuning: Option<Lasp2Tuning>,
    /// Stamps of the last call when recording ([`Lasp2Forward::record_timeline`]), with the
    /// segment count it was recorded at.
    timeline: Option<(CudaSlice<u64>, usize)>,
    record_timeline: bool,
}

crate::exchange::chain_methods!(Lasp2Forward, own_launch_plans);

/// Head groups the planner tries: 2 and 4 hid the exchange behind the next group's states pass
/// at state-heavy shapes; more groups only added launches.
const PLANNED_HEAD_GROUPS: [usize; 3] = [1, 2, 4];

/// The planner's launch plans are head groupings at the current CTAs per SM, tried only where
/// they keep the segment count (the groups change S where a group alone cannot fill the GPU).
impl LaunchPlans for Lasp2Forward {
    type Launch = Lasp2Tuning;

    fn launch(&self) -> Lasp2Tuning {
        self.tuning()
    }

    fn launch_plans(&self) -> Vec<Lasp2Tuning> {
        let current = self.tuning();
        let groupings = PLANNED_HEAD_GROUPS.map(|head_groups| Lasp2Tuning {
            head_groups,
            ..current
        });
        let others = groupings.into_iter().filter(|&t| t != current);
        std::iter::once(current).chain(others).collect()
    }

    fn same_bits(&self, launch: Lasp2Tuning, t_local: usize) -> bool {
        let segments = |tuning| self.plan_with(t_local as i32, tuning).segments;
        segments(launch) == segments(self.tuning())
    }

    fn set_launch(&mut self, launch: Lasp2Tuning) -> Result<()> {
        self.set_tuning(Some(launch))
    }
}

impl Lasp2Forward {
    /// Allocates the symmetric buffers, checks that every PE has the same layout and sets the
    /// exchange mode (collective). Calls are then not collective: only [`Lasp2Forward::set_mode`]
    /// and [`Lasp2Forward::free`] are, so a PE that stops calling cannot block the others in a
    /// host collective; their calls end in a bounded wait that names it.
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let chain = StateChain::new(
            runtime,
            layout,
            mode,
            Direction::Ascending,
            "LASP-2 forward",
        )?;
        let (states, output) = segment_kernels(
            runtime,
            instances::SD_LASP2_STATES,
            instances::SD_LASP2_OUTPUT,
        )?;
        let sm_count = sm_count(runtime.context())?;
        Ok(Lasp2Forward {
            chain,
            states,
            output,
            segment_prefix: runtime.module().kernel("lasp_lasp2_segment_prefix")?,
            workspace: None,
            sm_count,
            tuning: None,
            timeline: None,
            record_timeline: false,
        })
    }

    /// Fixes the launch plan's knobs, or with `None` returns to [`Lasp2Tuning::default`] (not
    /// collective: the plan changes neither the symmetric layout nor the protocol). A plan with
    /// another segment count S changes the rounding of the outputs (bits are equal across
    /// modes and head groupings at one S).
    pub fn set_tuning(&mut self, tuning: Option<Lasp2Tuning>) -> Result<()> {
        if let Some(t) = tuning {
            if t.head_groups == 0 || t.ctas_per_sm == 0 {
                return Err(self.chain.invalid(format!(
                    "{t:?}: head_groups and ctas_per_sm must be at least 1"
                )));
            }
        }
        self.tuning = tuning;
        Ok(())
    }

    /// Records `%globaltimer` stamps of every following call (puts, data seen, loop start per
    /// CTA), read back with [`Lasp2Forward::timeline`]. Costs a few stores per CTA.
    pub fn record_timeline(&mut self, on: bool) {
        self.record_timeline = on;
    }

    /// The stamps of the last call made while recording (synchronises `stream`), or `None`.
    pub fn timeline(&self, stream: &Arc<CudaStream>) -> Result<Option<Lasp2Timeline>> {
        let Some((buffer, segments)) = &self.timeline else {
            return Ok(None);
        };
        let l = self.layout();
        let tiles = l.b * l.h * (l.dv / sd::TILE_V as usize);
        let words = stream.clone_dtoh(buffer)?;
        let used = crate::exchange::geometry::timeline_words(
            l.b as i32,
            l.h as i32,
            l.dv as i32,
            *segments as i32,
        );
        Ok(Some(Lasp2Timeline::from_words(
            &words[..used as usize],
            tiles,
            *segments,
        )))
    }

    /// The plan knobs every call uses.
    pub fn tuning(&self) -> Lasp2Tuning {
        self.tuning.unwrap_or_default()
    }

    fn call_plan(&self, t: i32) -> CallPlan {
        self.plan_with(t, self.tuning())
    }

    /// The launches of a call on a shard of `t` tokens under `tuning`.
    fn plan_with(&self, t: i32, tuning: Lasp2Tuning) -> CallPlan {
        let l = self.layout();
        CallPlan::new((l.b * l.h) as i32, t, l.dv as i32, self.sm_count, tuning)
    }

    /// Enqueues one LASP-2 forward of this PE's shard on `stream` in the current mode.
    /// `args.shape.t` is this PE's shard length (it may differ between PEs); `h0` is the global
    /// initial state (the same on every PE); `ht`, the final state of the whole sequence, is
    /// written by the last PE only and must be `None` elsewhere. Everything is validated before
    /// the first launch.
    pub fn forward(&mut self, stream: &Arc<CudaStream>, args: ForwardArgs<'_>) -> Result<()> {
        self.forward_saving(stream, args, None)
    }

    /// [`Lasp2Forward::forward`], also writing `start_state` `[B, H, Dk, Dv]` fp32: the state this
    /// PE's shard starts from (`h0` folded with the earlier PEs' tiles), which
    /// [`Lasp2Backward`](super::Lasp2Backward) takes as the shard's `h0`.
    pub fn forward_saving(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        start_state: Option<DeviceMut<'_, f32>>,
    ) -> Result<()> {
        let homes = args.homes().into_iter();
        let homes = homes.chain([start_state.as_ref().and_then(DeviceMut::home)]);
        StreamOrder::around(stream, homes, "LASP-2 forward", || {
            self.enqueue(stream, args, start_state)
        })
    }

    /// The body of [`Lasp2Forward::forward_saving`], with the buffers' streams already ordered.
    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        start_state: Option<DeviceMut<'_, f32>>,
    ) -> Result<()> {
        let s = args.shape;
        s.validate()?;
        self.chain.check_call(stream, s.layout())?;
        let l = self.layout();
        let scale = check_args(&args)?;
        let (me, npes) = (self.chain.runtime().pe(), self.chain.runtime().npes());
        let last = me + 1 == npes;
        self.chain.check_final_state(args.ht.is_some())?;
        if let Some(start) = &start_state {
            check_start_state(start, &args)?;
        }
        let (b, h, dk, dv) = l.dims();
        let t = s.t as i32;
        let plan = self.call_plan(t);
        let segments = plan.segments;
        let ws_bytes = geometry::workspace_bytes(b, h, segments, dk, dv);
        let ws = crate::ops::ensure_workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            ws_bytes,
            "LASP-2 forward",
        )?;
        let timeline = self.prepare_timeline(stream, segments)?;
        let params = Lasp2Params {
            q: args.q.addr() as _,
            k: args.k.addr() as _,
            v: args.v.addr() as _,
            g: args.g.addr() as _,
            o: args.o.addr() as _,
            h0: args.h0.map_or(0, |x| x.addr()) as _,
            ht: args.ht.as_ref().map_or(0, |x| x.addr()) as _,
            ws_m: ws as _,
            ws_lambda: (ws + geometry::ws_m_bytes(b, h, segments, dk, dv)) as _,
            ws_p: (ws + geometry::ws_p_offset(b, h, segments, dk, dv)) as _,
            start_state: start_state.as_ref().map_or(0, |x| x.addr()) as _,
            T: t,
            num_segments: segments,
            chunks_per_segment: plan.chunks_per_segment,
            scale,
            write_final_state: (last && args.ht.is_some()) as i32,
            timeline: timeline as _,
            ..self.chain.base_params(stream)
        };
        let i = width_index(l.dk);
        let group_params = |bh_begin| Lasp2Params { bh_begin, ..params };
        let segments_launch = |heads, smem| LaunchShape {
            grid: geometry::segments_grid(heads, dv, segments),
            block: (sd::THREADS, 1, 1),
            shared_bytes: smem,
        };
        self.chain.context().bind_to_thread()?;
        for (g, &(bh_begin, heads)) in plan.groups.iter().enumerate() {
            let p = group_params(bh_begin);
            // SAFETY: Lasp2Params is lasp_lasp2_params, generated from the header; the shape,
            // lengths, alignment and overlaps were checked above; views borrow their buffers for
            // the call; symmetric buffers, epoch, diag and workspace are owned by self. A group's
            // fold_put reads only its own heads' workspace, written by its states kernel, which
            // it follows; the next call's states kernels follow the end of this call.
            unsafe {
                self.states[i].launch(
                    stream,
                    segments_launch(heads, sd::states_smem_bytes(dk)),
                    &p,
                )?;
                self.chain.launch_summary(stream, g, heads, &p, true)?;
                // The group's shard-local segment prefixes, for its output kernel (reads the
                // workspace as fold_put does; writes only ws_p).
                if segments > 1 {
                    self.segment_prefix
                        .launch(stream, super::fold_launch(heads, dv), &p)?;
                }
            }
        }
        self.chain.gather_slots(stream)?;
        for &(bh_begin, heads) in &plan.groups {
            // SAFETY: as above; outputs of different groups write disjoint heads.
            unsafe {
                self.output[i].launch(
                    stream,
                    segments_launch(heads, sd::output_smem_bytes(dk)),
                    &group_params(bh_begin),
                )?;
            }
        }
        self.chain.end_call(stream, &params)
    }

    /// The timeline buffer of this call, zeroed on `stream` (0 = not recording).
    fn prepare_timeline(&mut self, stream: &Arc<CudaStream>, segments: i32) -> Result<u64> {
        if !self.record_timeline {
            return Ok(0);
        }
        let (b, h, _, dv) = self.layout().dims();
        let words = crate::exchange::geometry::timeline_words(b, h, dv, segments) as usize;
        if self.timeline.as_ref().is_none_or(|(t, _)| t.len() < words) {
            // An earlier call may still write the old buffer.
            self.chain.context().synchronize()?;
            self.timeline = Some((stream.alloc_zeros(words)?, 0));
        }
        let (buffer, recorded_segments) = self.timeline.as_mut().expect("allocated above");
        *recorded_segments = segments as usize;
        stream.memset_zeros(buffer)?;
        Ok(buffer.device_ptr(stream).0)
    }
}

/// Checks the optional `start_state` output: its length and alignment, and that it overlaps none
/// of the call's other tensors.
fn check_start_state(start: &DeviceMut<'_, f32>, args: &ForwardArgs<'_>) -> Result<()> {
    const OP: &str = "LASP-2 forward";
    let checks = TensorChecks::new(OP, &args.shape);
    checks.length(
        "start_state",
        "[B, H, Dk, Dv]",
        start.len(),
        args.shape.state_len(),
    )?;
    checks.aligned("start_state", start.addr(), 8)?;
    let others = [
        ("q", Some(args.q.byte_range())),
        ("k", Some(args.k.byte_range())),
        ("v", Some(args.v.byte_range())),
        ("g", Some(args.g.byte_range())),
        ("h0", args.h0.map(|x| x.byte_range())),
        ("o", Some(args.o.byte_range())),
        ("ht", args.ht.as_ref().map(|x| x.byte_range())),
    ];
    match others
        .into_iter()
        .find(|(_, r)| r.is_some_and(|r| ranges_overlap(start.byte_range(), r)))
    {
        Some((name, _)) => Err(Error::InvalidArgument(format!(
            "{OP}: start_state overlaps {name}; give start_state its own buffer"
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_words_split_into_puts_and_output_ctas() {
        // B=1, H=2, Dv=128 (2 tiles per head), S=3: 4 tiles x 2 put stamps, 12 CTAs x 3 stamps.
        assert_eq!(
            crate::exchange::geometry::timeline_words(1, 2, 128, 3),
            8 + 36
        );
        let words: Vec<u64> = (0..44).collect();
        let t = Lasp2Timeline::from_words(&words, 4, 3);
        assert_eq!(t.puts.len(), 4);
        assert_eq!(t.puts[3], [6, 7]);
        assert_eq!(t.outputs.len(), 12);
        // CTA (tile 1, segment 2) is output index 1 * 3 + 2 = 5: words 8 + 15 ..
        assert_eq!(t.outputs[5], [23, 24, 25]);
        assert_eq!(t.output_waits_ns(), vec![1; 12]);
    }

    #[test]
    fn the_planner_tries_groupings_only_where_they_keep_the_segment_count() {
        let (sms, default) = (132, Lasp2Tuning::default());
        let groups = |head_groups| Lasp2Tuning {
            head_groups,
            ..default
        };
        let segments = |bh, t, tuning| CallPlan::new(bh, t, 128, sms, tuning).segments;
        // B=8 T=2K, H=16: 256 tiles fill 264 CTA slots with S = 1; half the heads need S = 2,
        // which changes the rounding, so two groups are not offered there.
        assert_eq!(segments(128, 2048, default), 1);
        assert_eq!(segments(128, 2048, groups(2)), 2);
        // B=16 T=1K: 512 tiles; two groups of 256 keep S = 1, four groups of 64 heads do not.
        assert_eq!(segments(256, 1024, groups(2)), 1);
        assert_eq!(segments(256, 1024, groups(4)), 2);
    }

    #[test]
    fn plans_cut_heads_into_contiguous_groups_with_one_segment_count() {
        let sms = 132;
        let two = Lasp2Tuning {
            head_groups: 2,
            ctas_per_sm: 1,
        };
        // B=4, H=16, D=128, T=8K: 64 heads -> 2 groups of 32 (64 tiles each); S = 2 for 128
        // CTAs per group launch (one per SM).
        let p = CallPlan::new(64, 8192, 128, sms, two);
        assert_eq!(p.groups, vec![(0, 32), (32, 32)]);
        assert_eq!((p.segments, p.chunks_per_segment), (2, 64));
        // B=1, H=16, T=32K: 8 heads per group, S = 8.
        let p = CallPlan::new(16, 32768, 128, sms, two);
        assert_eq!(p.groups, vec![(0, 8), (8, 8)]);
        assert_eq!(p.segments, 8);
        // Odd head counts: groups differ by at most one head and S fits the wider one.
        let p = CallPlan::new(
            5,
            4096,
            64,
            sms,
            Lasp2Tuning {
                head_groups: 3,
                ..two
            },
        );
        assert_eq!(p.groups, vec![(0, 1), (1, 2), (3, 2)]);
        assert_eq!(p.segments, sd::num_segments(1, 2, 4096, 64, 132));
        // More groups than heads: one head per group.
        let p = CallPlan::new(1, 100, 64, sms, two);
        assert_eq!(p.groups, vec![(0, 1)]);
        // One group is the ungrouped plan of the single-GPU policy at one CTA per SM.
        let one = Lasp2Tuning {
            head_groups: 1,
            ctas_per_sm: 1,
        };
        let p = CallPlan::new(64, 8192, 128, sms, one);
        assert_eq!((p.groups.clone(), p.segments), (vec![(0, 64)], 1));
        // Two CTAs per SM double the segments where the sequence allows it.
        let p = CallPlan::new(
            64,
            8192,
            128,
            sms,
            Lasp2Tuning {
                ctas_per_sm: 2,
                ..two
            },
        );
        assert_eq!(p.segments, 4);
    }
}
