//! The short causal depthwise convolution that GDN- and Mamba-style layers apply before the
//! attention (fla's `ShortConvolution`), on LASP-2 shards: [`ShortConv`].
//!
//! `y_t = act(bias + sum_{i<K} weight[c, i] x_{t-K+1+i})` per channel, with `act` the identity or
//! SiLU. Each PE holds a contiguous slice of the sequence (`[B, T_w, C]`, T_w may differ between
//! PEs); its first `K - 1` outputs read the tokens before its slice, its *halo*, which the PE
//! before it puts into its symmetric slots from the device, with a signal (a PE whose slice is
//! shorter than `K - 1` relays the part of its own halo its successor needs). The backward
//! returns the halo's gradient the same way to the PE the tokens came from. No host collective:
//! every wait is a bounded device wait that names the PE, the slot and the epoch, and a call can
//! be captured into a CUDA graph and replayed. On one PE it is the plain convolution. Over packed
//! documents (`documents`, fla's `cu_seqlens`) no tap reads across a document start.
//!
//! Kernels: `kernels/cuda/short_conv/short_conv.cu`; the exchange's protocol:
//! `lasp/short_conv/short_conv_params.h`.

mod args;
mod halo;
#[cfg(test)]
mod tests;

pub use args::{ShortConvArgs, ShortConvGradArgs};

use crate::error::{Error, Result};
use crate::gpu::ContextSync;
use crate::kernel::{Kernel, LaunchShape};
use crate::ops::documents::{DocumentStarts, Documents};
use crate::ops::{ensure_workspace, require_runtime_stream, sm_count, DeviceMut, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use halo::{Flow, HaloExchange};
use lasp_shmem_kernels::params::{
    lasp_halo_exchange, lasp_short_conv_params, LASP_SHORT_CONV_CHANNELS_PER_THREAD,
    LASP_SHORT_CONV_GRAD_CHANNELS_PER_THREAD, LASP_SHORT_CONV_IDENTITY, LASP_SHORT_CONV_MAX_K,
    LASP_SHORT_CONV_SILU, LASP_SHORT_CONV_THREADS,
};
use std::sync::Arc;

const FORWARD: &str = "short convolution forward";
const BACKWARD: &str = "short convolution backward";

/// The most waves of convolution CTAs a call is cut into (the fewer CTAs, the fewer partial
/// sums the backward reduces; whole waves, so the last one is not a fraction).
const MAX_WAVES: usize = 4;
/// The fewest tokens a CTA walks: each also reads the `K - 1` tokens before its first.
const MIN_TOKENS_PER_GROUP: usize = 64;
/// The grid's y dimension, `groups x B`, stays within CUDA's limit.
const MAX_GRID_Y: usize = 65_535;

/// The activation after the convolution and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Identity,
    /// `z sigma(z)` (fla's `activation='silu'`).
    Silu,
}

impl Activation {
    fn code(self) -> i32 {
        match self {
            Activation::Identity => LASP_SHORT_CONV_IDENTITY as i32,
            Activation::Silu => LASP_SHORT_CONV_SILU as i32,
        }
    }
}

/// What every PE passes alike when it creates the convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShortConvLayout {
    /// Sequences B.
    pub batch: usize,
    /// Channels C (e.g. H x D), a multiple of 8.
    pub channels: usize,
    /// Taps K, 1 to [`ShortConvLayout::MAX_KERNEL_SIZE`].
    pub kernel_size: usize,
}

impl ShortConvLayout {
    /// The largest kernel size the kernels are built for.
    pub const MAX_KERNEL_SIZE: usize = LASP_SHORT_CONV_MAX_K as usize;

    /// Checks B, C and K.
    pub fn validate(&self) -> Result<()> {
        let lanes = LASP_SHORT_CONV_CHANNELS_PER_THREAD as usize;
        let fail = |message: String| Err(Error::InvalidArgument(message));
        if self.batch == 0 || self.batch > MAX_GRID_Y {
            return fail(format!(
                "short convolution: B = {} sequences; use 1 to {MAX_GRID_Y} (split larger batches \
                 into several calls)",
                self.batch
            ));
        }
        if self.channels == 0 || self.channels % lanes != 0 || self.channels > i32::MAX as usize {
            return fail(format!(
                "short convolution: C = {} channels; use a positive multiple of {lanes} (the \
                 kernels move {lanes} bf16 channels per 16-byte load; pad the channels)",
                self.channels
            ));
        }
        if !(1..=Self::MAX_KERNEL_SIZE).contains(&self.kernel_size) {
            return fail(format!(
                "short convolution: kernel size K = {}; use 1 to {} (fla's default is 4)",
                self.kernel_size,
                Self::MAX_KERNEL_SIZE
            ));
        }
        Ok(())
    }

    /// Elements of a halo `[B, K-1, C]`.
    pub fn halo_len(&self) -> usize {
        self.batch * (self.kernel_size - 1) * self.channels
    }

    /// FNV-1a of the fields and the PE count, which every PE must share.
    fn fingerprint(&self, npes: usize) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for v in [self.batch, self.channels, self.kernel_size, npes] {
            for byte in (v as u64).to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h
    }

    /// Token groups per sequence for `tokens` tokens, where a token group is `channel_tiles`
    /// x B CTAs and `resident` CTAs fit on the GPU at once: the most whole waves, up to
    /// [`MAX_WAVES`], whose groups keep [`MIN_TOKENS_PER_GROUP`] tokens or more (fewer only where
    /// T is short), and no empty group.
    pub(crate) fn token_groups(
        &self,
        tokens: usize,
        channel_tiles: usize,
        resident: usize,
    ) -> usize {
        let most = (tokens / MIN_TOKENS_PER_GROUP)
            .min(MAX_GRID_Y / self.batch)
            .max(1);
        let ctas_per_group = channel_tiles * self.batch;
        let in_waves = |waves: usize| (waves * resident / ctas_per_group).max(1);
        let groups = (1..=MAX_WAVES)
            .rev()
            .map(in_waves)
            .find(|&groups| groups <= most)
            .unwrap_or(most);
        tokens.div_ceil(tokens.div_ceil(groups))
    }
}

/// One convolution kernel and its launch geometry.
struct Convolution {
    kernel: Kernel,
    /// Channels per thread.
    lanes: usize,
    /// CTAs of it that fit on the GPU at once.
    resident: usize,
}

impl Convolution {
    fn new(runtime: &Runtime, name: &'static str, lanes: u32) -> Result<Self> {
        let kernel = runtime.module().kernel(name)?;
        let block = LaunchShape {
            grid: (1, 1, 1),
            block: (LASP_SHORT_CONV_THREADS, 1, 1),
            shared_bytes: 0,
        };
        let per_sm = kernel.resident_ctas_per_sm(block)?;
        Ok(Convolution {
            kernel,
            lanes: lanes as usize,
            resident: (per_sm * sm_count(runtime.context())?) as usize,
        })
    }

    fn channel_tiles(&self, layout: &ShortConvLayout) -> usize {
        layout
            .channels
            .div_ceil(self.lanes * LASP_SHORT_CONV_THREADS as usize)
    }

    /// (token groups, launch shape) for `tokens` tokens.
    fn plan(&self, layout: &ShortConvLayout, tokens: usize) -> (usize, LaunchShape) {
        let tiles = self.channel_tiles(layout);
        let groups = layout.token_groups(tokens, tiles, self.resident);
        let shape = LaunchShape {
            grid: (tiles as u32, (groups * layout.batch) as u32, 1),
            block: (LASP_SHORT_CONV_THREADS, 1, 1),
            shared_bytes: 0,
        };
        (groups, shape)
    }
}

/// The kernels of short_conv.cu.
struct Kernels {
    forward: Convolution,
    backward: Convolution,
    reduce_params: Kernel,
    advance: Kernel,
}

/// The short convolution on this PE's shard, with the halo exchanged from the device. Create it
/// on every PE with the same layout (collective), call [`ShortConv::forward`] and
/// [`ShortConv::backward`] on any stream of the runtime's GPU (no host synchronisation; every PE
/// makes the same sequence of calls of each direction), [`ShortConv::finish`] to learn of an
/// expired wait, and [`ShortConv::free`] at the end (collective; dropping it instead leaks the
/// symmetric buffers).
pub struct ShortConv {
    /// First: every call finishes before the buffers below are released.
    _calls_done: ContextSync,
    runtime: Runtime,
    layout: ShortConvLayout,
    forward_halo: HaloExchange,
    backward_halo: HaloExchange,
    kernels: Kernels,
    /// The backward's per-CTA parameter sums, grown on demand.
    partials: Option<CudaSlice<u8>>,
    /// Packed documents: which tokens start one.
    starts: DocumentStarts,
    /// The start flags of the latest call over documents, `[K - 1 + T]` fp32, grown on demand.
    start_flags: Option<CudaSlice<u8>>,
}

impl ShortConv {
    /// Checks the layout, that every PE passed the same, and allocates the halo buffers
    /// (collective).
    pub fn new(runtime: &Runtime, layout: ShortConvLayout) -> Result<Self> {
        layout.validate()?;
        let npes = runtime.npes();
        let prints = runtime.all_gather_u64(layout.fingerprint(npes))?;
        let differ: Vec<usize> = (0..npes)
            .filter(|&p| prints[p] != prints[runtime.pe()])
            .collect();
        if !differ.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "short convolution: PEs {differ:?} passed another layout than PE {} ({layout:?}); \
                 every PE must pass the same B, C and K",
                runtime.pe()
            )));
        }
        let module = runtime.module();
        let halo_floats = layout.halo_len().max(1);
        let forward = Convolution::new(
            runtime,
            "lasp_short_conv_forward",
            LASP_SHORT_CONV_CHANNELS_PER_THREAD,
        )?;
        let backward = Convolution::new(
            runtime,
            "lasp_short_conv_backward",
            LASP_SHORT_CONV_GRAD_CHANNELS_PER_THREAD,
        )?;
        // A signal per sequence and channel tile of the kernel that sends and reads the halo.
        let signals = |conv: &Convolution| layout.batch * conv.channel_tiles(&layout);
        let conv = ShortConv {
            _calls_done: ContextSync(runtime.context().clone()),
            runtime: runtime.clone(),
            layout,
            forward_halo: HaloExchange::new(runtime, Flow::ToNext, halo_floats, signals(&forward))?,
            backward_halo: HaloExchange::new(
                runtime,
                Flow::ToPrevious,
                halo_floats,
                signals(&backward),
            )?,
            kernels: Kernels {
                forward,
                backward,
                reduce_params: module.kernel("lasp_short_conv_reduce_params")?,
                advance: module.kernel("lasp_short_conv_advance")?,
            },
            partials: None,
            starts: DocumentStarts::new(runtime)?,
            start_flags: None,
        };
        // The epoch and diagnostics words were zeroed on the runtime's stream; calls may come on
        // any stream.
        runtime.stream().synchronize()?;
        Ok(conv)
    }

    /// The layout every PE agreed on.
    pub fn layout(&self) -> ShortConvLayout {
        self.layout
    }

    /// `y` of this PE's shard; writes the halo it used to `saved_halo` where given. Everything
    /// is checked before anything is enqueued.
    pub fn forward(&mut self, stream: &Arc<CudaStream>, args: ShortConvArgs<'_>) -> Result<()> {
        require_runtime_stream(stream, self.runtime.context(), FORWARD)?;
        args.check(FORWARD, self.layout)?;
        StreamOrder::around(stream, args.homes(), FORWARD, || {
            let (groups, grid) = self.kernels.forward.plan(&self.layout, args.tokens);
            let starts = self.start_flags(stream, args.documents, args.tokens, FORWARD)?;
            let exchange = self.forward_halo.params(&self.runtime, stream);
            let p = lasp_short_conv_params {
                x: args.x.addr() as _,
                weight: args.weight.addr() as _,
                bias: args.bias.map_or(0, |b| b.addr()) as _,
                out: args.y.addr() as _,
                saved_halo: args.saved_halo.as_ref().map_or(0, |h| h.addr()) as _,
                starts: starts as _,
                ..self.params(exchange, args.tokens, groups, args.activation)
            };
            self.enqueue(
                stream,
                &p,
                &[
                    (&self.kernels.forward.kernel, grid),
                    (&self.kernels.advance, Self::SINGLE),
                ],
            )
        })
    }

    /// dx, d_weight and d_bias of this PE's shard, for the forward call whose `saved_halo` is
    /// `args.halo`. Every PE's backward calls must pair with its successor's, in the same order.
    pub fn backward(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ShortConvGradArgs<'_>,
    ) -> Result<()> {
        require_runtime_stream(stream, self.runtime.context(), BACKWARD)?;
        let reads_halo = self.forward_halo.has_source(&self.runtime);
        args.check(BACKWARD, self.layout, reads_halo)?;
        StreamOrder::around(stream, args.homes(), BACKWARD, || {
            let (groups, grid) = self.kernels.backward.plan(&self.layout, args.tokens);
            let (b, c, k) = self.dims();
            let partial_bytes = (b * groups * c * (k + 1) * std::mem::size_of::<f32>()) as u64;
            let partials = ensure_workspace(
                self.runtime.context(),
                stream,
                &mut self.partials,
                partial_bytes,
                BACKWARD,
            )?;
            let starts = self.start_flags(stream, args.documents, args.tokens, BACKWARD)?;
            let exchange = self.backward_halo.params(&self.runtime, stream);
            let p = lasp_short_conv_params {
                starts: starts as _,
                x: args.x.addr() as _,
                weight: args.weight.addr() as _,
                bias: args.bias.map_or(0, |b| b.addr()) as _,
                halo: args.halo.map_or(0, |h| h.addr()) as _,
                dy: args.dy.addr() as _,
                out: args.dx.addr() as _,
                partials: partials as _,
                d_weight: args.d_weight.addr() as _,
                d_bias: args.d_bias.as_ref().map_or(0, |b| b.addr()) as _,
                ..self.params(exchange, args.tokens, groups, args.activation)
            };
            let sums = (c * (k + 1)).div_ceil(256) as u32;
            let reduce = LaunchShape {
                grid: (sums, 1, 1),
                block: (256, 1, 1),
                shared_bytes: 0,
            };
            self.enqueue(
                stream,
                &p,
                &[
                    (&self.kernels.backward.kernel, grid),
                    (&self.kernels.reduce_params, reduce),
                    (&self.kernels.advance, Self::SINGLE),
                ],
            )
        })
    }

    /// Waits for `stream`, then returns the error of the first expired wait of either direction
    /// (naming the PE that never sent, the slot and the epoch), if any.
    pub fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize()?;
        self.forward_halo.check_waits(stream)?;
        self.backward_halo.check_waits(stream)
    }

    /// Completed forward and backward calls on this PE (the device epochs, graph replays
    /// included; synchronises `stream`).
    pub fn calls(&self, stream: &Arc<CudaStream>) -> Result<(u64, u64)> {
        Ok((
            self.forward_halo.epoch(stream)?,
            self.backward_halo.epoch(stream)?,
        ))
    }

    /// Frees the symmetric buffers (collective).
    pub fn free(self) -> Result<()> {
        // Calls still in flight on the callers' streams use the buffers.
        self.runtime.context().synchronize()?;
        self.forward_halo.free(&self.runtime)?;
        self.backward_halo.free(&self.runtime)
    }

    /// The device address of the call's start flags (`lasp_short_conv_params::starts`), written
    /// on `stream`, or 0 without documents.
    fn start_flags(
        &mut self,
        stream: &Arc<CudaStream>,
        documents: Option<Documents<'_>>,
        tokens: usize,
        op: &str,
    ) -> Result<u64> {
        let Some(docs) = documents else {
            return Ok(0);
        };
        let before = self.layout.kernel_size - 1;
        let len = before + tokens;
        let bytes = (len * std::mem::size_of::<f32>()) as u64;
        let ctx = self.runtime.context();
        let addr = ensure_workspace(ctx, stream, &mut self.start_flags, bytes, op)?;
        // SAFETY: the workspace holds `len` fp32 of this GPU (sized above); self owns it and
        // waits for the whole context before growing it (ensure_workspace) or freeing it
        // (_calls_done), and only this call's kernels, in stream order, touch it.
        let flags = unsafe { DeviceMut::<f32>::from_raw(addr, len) };
        self.starts.start_flags(stream, docs, before, &flags)?;
        Ok(addr)
    }

    /// One thread: the epoch's advance.
    const SINGLE: LaunchShape = LaunchShape {
        grid: (1, 1, 1),
        block: (1, 1, 1),
        shared_bytes: 0,
    };

    fn dims(&self) -> (usize, usize, usize) {
        let l = self.layout;
        (l.batch, l.channels, l.kernel_size)
    }

    /// The parameters every kernel of a call shares; the call adds its tensors.
    fn params(
        &self,
        exchange: lasp_halo_exchange,
        tokens: usize,
        groups: usize,
        activation: Activation,
    ) -> lasp_short_conv_params {
        let (b, c, k) = self.dims();
        lasp_short_conv_params {
            exchange,
            B: b as i32,
            T: tokens as i32,
            C: c as i32,
            K: k as i32,
            groups: groups as i32,
            activation: activation.code(),
            ..Default::default()
        }
    }

    fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        p: &lasp_short_conv_params,
        launches: &[(&Kernel, LaunchShape)],
    ) -> Result<()> {
        for (kernel, shape) in launches {
            // SAFETY: `p` is the kernels' lasp_short_conv_params, generated from their header.
            // Its tensors were checked against the layout (lengths, alignment, no output
            // overlapping anything else) and are kept alive and unaliased by the views'
            // contracts until the call completes on `stream`, which StreamOrder orders after
            // their buffers' streams; the halo buffers, epoch and workspace are owned by self,
            // which synchronises the context before releasing them.
            unsafe { kernel.launch(stream, *shape, p) }?;
        }
        Ok(())
    }
}
