//! The tensors of one short-convolution call ([`ShortConvArgs`], [`ShortConvGradArgs`]) and
//! their checks against the layout, before anything is launched.

use super::{Activation, ShortConvLayout};
use crate::error::{Error, Result};
use crate::ops::documents::Documents;
use crate::ops::scalar_decay::TensorChecks;
use crate::ops::{bf16, DeviceMut, DeviceRef};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The forward's tensors on this PE; views from cudarc buffers or raw pointers, all in the
/// runtime's GPU context.
#[derive(Debug)]
pub struct ShortConvArgs<'a> {
    /// This PE's tokens per sequence (its shard of T; PEs may hold different counts), >= 1.
    pub tokens: usize,
    /// `[B, T, C]` bf16, contiguous, 16-byte aligned.
    pub x: DeviceRef<'a, bf16>,
    /// `[C, K]` fp32 (fla's conv1d weight `[C, 1, K]`); `weight[c, K-1]` multiplies the current
    /// token.
    pub weight: DeviceRef<'a, f32>,
    /// `[C]` fp32, or `None`.
    pub bias: Option<DeviceRef<'a, f32>>,
    pub activation: Activation,
    /// `[B, T, C]` bf16, 16-byte aligned: written.
    pub y: DeviceMut<'a, bf16>,
    /// `[B, K-1, C]` bf16, 16-byte aligned: the halo this call used (the `K - 1` tokens before
    /// the shard, zeros on the first PE), which the backward reads. `None` where no backward
    /// follows.
    pub saved_halo: Option<DeviceMut<'a, bf16>>,
    /// Packed documents: no tap reads across a document start (each document is convolved as a
    /// sequence of its own); `None`: one sequence.
    pub documents: Option<Documents<'a>>,
}

/// The backward's tensors on this PE (layouts as [`ShortConvArgs`]). The gradients are written,
/// not accumulated; `d_weight` and `d_bias` are this PE's sums (reduce them across ranks as
/// data parallelism does).
#[derive(Debug)]
pub struct ShortConvGradArgs<'a> {
    /// As in the forward.
    pub tokens: usize,
    /// The forward's input.
    pub x: DeviceRef<'a, bf16>,
    /// The forward's halo ([`ShortConvArgs::saved_halo`]); `None` stands for zeros, which only
    /// the first PE (or K = 1) may pass.
    pub halo: Option<DeviceRef<'a, bf16>>,
    pub weight: DeviceRef<'a, f32>,
    pub bias: Option<DeviceRef<'a, f32>>,
    pub activation: Activation,
    /// `[B, T, C]` bf16: the gradient of y.
    pub dy: DeviceRef<'a, bf16>,
    /// `[B, T, C]` bf16: written.
    pub dx: DeviceMut<'a, bf16>,
    /// `[C, K]` fp32: written.
    pub d_weight: DeviceMut<'a, f32>,
    /// `[C]` fp32, present exactly when `bias` is: written.
    pub d_bias: Option<DeviceMut<'a, f32>>,
    /// The forward's documents.
    pub documents: Option<Documents<'a>>,
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// The checks every call shares: T, the parameters, their lengths and alignments.
struct CallChecks<'a> {
    checks: TensorChecks<'a>,
    layout: ShortConvLayout,
    tokens: usize,
}

impl<'a> CallChecks<'a> {
    fn new(op: &'a str, layout: ShortConvLayout, tokens: usize) -> Result<Self> {
        if tokens == 0 || tokens > i32::MAX as usize {
            return Err(invalid(format!(
                "{op}: {tokens} tokens on this PE; every PE needs 1 to {} tokens per sequence",
                i32::MAX
            )));
        }
        let ShortConvLayout {
            batch,
            channels,
            kernel_size,
        } = layout;
        let dims = format!("B={batch}, T={tokens}, C={channels}, K={kernel_size}");
        Ok(CallChecks {
            checks: TensorChecks::with_dims(op, dims),
            layout,
            tokens,
        })
    }

    fn activations(&self) -> usize {
        self.layout.batch * self.tokens * self.layout.channels
    }

    /// A `[B, T, C]` bf16 tensor (16-byte loads and stores).
    fn activation(&self, name: &str, len: usize, addr: u64) -> Result<()> {
        self.checks
            .tensor(name, "[B, T, C]", (len, self.activations()), addr, 16)
    }

    /// A `[B, K-1, C]` bf16 halo.
    fn halo(&self, name: &str, len: usize, addr: u64) -> Result<()> {
        self.checks
            .tensor(name, "[B, K-1, C]", (len, self.layout.halo_len()), addr, 16)
    }

    fn parameters(
        &self,
        weight: (&str, usize, u64),
        bias: Option<(&str, usize, u64)>,
    ) -> Result<()> {
        let (c, k) = (self.layout.channels, self.layout.kernel_size);
        self.checks
            .tensor(weight.0, "[C, K]", (weight.1, c * k), weight.2, 4)?;
        if let Some((name, len, addr)) = bias {
            self.checks.tensor(name, "[C]", (len, c), addr, 4)?;
        }
        Ok(())
    }
}

fn range<T>(name: &'static str, view: &DeviceRef<'_, T>) -> (&'static str, (u64, u64)) {
    (name, view.byte_range())
}

fn range_mut<T>(name: &'static str, view: &DeviceMut<'_, T>) -> (&'static str, (u64, u64)) {
    (name, view.byte_range())
}

impl<'a> ShortConvArgs<'a> {
    pub(super) fn homes(&self) -> Vec<Option<&'a Arc<CudaStream>>> {
        let mut homes = vec![self.x.home(), self.weight.home(), self.y.home()];
        homes.extend(self.bias.as_ref().map(|b| b.home()));
        homes.extend(self.saved_halo.as_ref().map(|h| h.home()));
        homes.extend(self.documents.map(|d| d.cu_seqlens.home()));
        homes
    }

    /// Checks T, lengths, alignments and overlaps against `layout`.
    pub(super) fn check(&self, op: &str, layout: ShortConvLayout) -> Result<()> {
        let call = CallChecks::new(op, layout, self.tokens)?;
        call.activation("x", self.x.len(), self.x.addr())?;
        call.activation("y", self.y.len(), self.y.addr())?;
        call.parameters(
            ("weight", self.weight.len(), self.weight.addr()),
            self.bias.as_ref().map(|b| ("bias", b.len(), b.addr())),
        )?;
        if let Some(halo) = &self.saved_halo {
            call.halo("saved_halo", halo.len(), halo.addr())?;
        }
        let mut inputs = vec![range("x", &self.x), range("weight", &self.weight)];
        inputs.extend(self.bias.as_ref().map(|b| range("bias", b)));
        let mut outputs = vec![range_mut("y", &self.y)];
        outputs.extend(self.saved_halo.as_ref().map(|h| range_mut("saved_halo", h)));
        call.checks.disjoint(&inputs, &outputs)
    }
}

impl<'a> ShortConvGradArgs<'a> {
    pub(super) fn homes(&self) -> Vec<Option<&'a Arc<CudaStream>>> {
        let mut homes = vec![
            self.x.home(),
            self.weight.home(),
            self.dy.home(),
            self.dx.home(),
            self.d_weight.home(),
        ];
        homes.extend(self.halo.as_ref().map(|h| h.home()));
        homes.extend(self.bias.as_ref().map(|b| b.home()));
        homes.extend(self.d_bias.as_ref().map(|b| b.home()));
        homes.extend(self.documents.map(|d| d.cu_seqlens.home()));
        homes
    }

    /// Checks T, lengths, alignments, overlaps and the halo against `layout`; `reads_halo`: this
    /// PE's forward read a halo another PE sent.
    pub(super) fn check(&self, op: &str, layout: ShortConvLayout, reads_halo: bool) -> Result<()> {
        let call = CallChecks::new(op, layout, self.tokens)?;
        call.activation("x", self.x.len(), self.x.addr())?;
        call.activation("dy", self.dy.len(), self.dy.addr())?;
        call.activation("dx", self.dx.len(), self.dx.addr())?;
        call.parameters(
            ("weight", self.weight.len(), self.weight.addr()),
            self.bias.as_ref().map(|b| ("bias", b.len(), b.addr())),
        )?;
        call.parameters(
            ("d_weight", self.d_weight.len(), self.d_weight.addr()),
            self.d_bias.as_ref().map(|b| ("d_bias", b.len(), b.addr())),
        )?;
        if self.bias.is_some() != self.d_bias.is_some() {
            return Err(invalid(format!(
                "{op}: pass d_bias exactly when the convolution has a bias ({} here, d_bias {})",
                if self.bias.is_some() {
                    "it has one"
                } else {
                    "it has none"
                },
                if self.d_bias.is_some() {
                    "given"
                } else {
                    "missing"
                }
            )));
        }
        match &self.halo {
            Some(halo) => call.halo("halo", halo.len(), halo.addr())?,
            None if reads_halo && layout.kernel_size > 1 => {
                return Err(invalid(format!(
                    "{op}: this PE's shard starts after another PE's, so its first outputs read \
                     the tokens before it; pass the forward's saved_halo as halo"
                )))
            }
            None => {}
        }
        let mut inputs = vec![
            range("x", &self.x),
            range("weight", &self.weight),
            range("dy", &self.dy),
        ];
        inputs.extend(self.halo.as_ref().map(|h| range("halo", h)));
        inputs.extend(self.bias.as_ref().map(|b| range("bias", b)));
        let mut outputs = vec![
            range_mut("dx", &self.dx),
            range_mut("d_weight", &self.d_weight),
        ];
        outputs.extend(self.d_bias.as_ref().map(|b| range_mut("d_bias", b)));
        call.checks.disjoint(&inputs, &outputs)
    }
}
