//! The tensors of one call ([`ForwardArgs`]) and their checks before anything is launched:
//! lengths, alignment, scale and overlaps against the shape, and the gate contract.

use super::{invalid, ForwardShape};
use crate::error::Result;
use crate::ops::{bf16, ranges_overlap, DeviceMut, DeviceRef};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// The tensors of one call. Views come from cudarc buffers ([`DeviceRef::new`],
/// [`DeviceMut::new`]) or raw pointers; all must live in the runtime's GPU context.
#[derive(Debug)]
pub struct ForwardArgs<'a> {
    /// The dimensions every tensor must agree with.
    pub shape: ForwardShape,
    /// Queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// Keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Log-decays `[B, T, H]`, fp32, finite and `<= 0` (the caller's contract: checked in debug
    /// builds, and on request by [`ScalarDecayForward::validate_gates`]).
    ///
    /// [`ScalarDecayForward::validate_gates`]: super::ScalarDecayForward::validate_gates
    pub g: DeviceRef<'a, f32>,
    /// Initial state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// Output `[B, T, H, Dv]`, bf16, 16-byte aligned; every element is written.
    pub o: DeviceMut<'a, bf16>,
    /// Final state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` to skip it. Must not overlap h0.
    pub ht: Option<DeviceMut<'a, f32>>,
    /// `sigma` in `o_t = sigma q_t S_t`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
}

impl<'a> ForwardArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(crate) fn homes(&self) -> [Option<&'a Arc<CudaStream>>; 7] {
        [
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.g.home(),
            self.h0.and_then(|h0| h0.home()),
            self.o.home(),
            self.ht.as_ref().and_then(DeviceMut::home),
        ]
    }
}

/// Checks lengths, alignment, scale and overlaps against the (validated) shape; returns the
/// scale to use.
pub(crate) fn check_args(args: &ForwardArgs<'_>) -> Result<f32> {
    check_args_of("scalar-decay forward", args)
}

/// The length and alignment checks of one call's tensors; `op` names the operation in errors.
pub(crate) struct TensorChecks<'a> {
    op: &'a str,
    dims: String,
}

impl<'a> TensorChecks<'a> {
    pub(crate) fn new(op: &'a str, s: &ForwardShape) -> Self {
        let dims = format!("B={}, T={}, H={}, Dk={}, Dv={}", s.b, s.t, s.h, s.dk, s.dv);
        Self::with_dims(op, dims)
    }

    /// Checks for an operation whose dimensions `dims` ("B=4, T=8192, ...") are not a
    /// [`ForwardShape`]'s.
    pub(crate) fn with_dims(op: &'a str, dims: String) -> Self {
        TensorChecks { op, dims }
    }

    /// `got` elements where `layout` needs `want`.
    pub(crate) fn length(&self, name: &str, layout: &str, got: usize, want: usize) -> Result<()> {
        if got == want {
            return Ok(());
        }
        Err(invalid(format!(
            "{}: {name} has {got} elements but {layout} with {} needs {want}; pass the shape the \
             tensors were made with (fla layout, contiguous)",
            self.op, self.dims
        )))
    }

    /// The scale to use: `scale`, or `Dk^-1/2` for `None`; finite and > 0.
    pub(crate) fn scale(&self, scale: Option<f32>, s: &ForwardShape) -> Result<f32> {
        let scale = scale.unwrap_or_else(|| s.default_scale());
        if scale.is_finite() && scale > 0.0 {
            return Ok(scale);
        }
        Err(invalid(format!(
            "{}: scale = {scale} must be finite and > 0; pass None for the default Dk^-1/2",
            self.op
        )))
    }

    /// No output may share a byte with an input or with another output (kernels read the
    /// inputs while other CTAs write the outputs). Byte ranges by name.
    pub(crate) fn disjoint(
        &self,
        inputs: &[(&str, (u64, u64))],
        outputs: &[(&str, (u64, u64))],
    ) -> Result<()> {
        let op = self.op;
        for (i, (out_name, out)) in outputs.iter().enumerate() {
            for (in_name, input) in inputs {
                if ranges_overlap(*out, *input) {
                    return Err(invalid(format!(
                        "{op}: output {out_name} overlaps input {in_name} (the kernels \
                         read {in_name} while other CTAs write {out_name}); give {out_name} its \
                         own buffer{}",
                        if *out_name == "ht" && *in_name == "h0" {
                            " (copy ht into h0 after the call if you want it in place)"
                        } else {
                            ""
                        }
                    )));
                }
            }
            for (other_name, other) in &outputs[i + 1..] {
                if ranges_overlap(*out, *other) {
                    return Err(invalid(format!(
                        "{op}: {out_name} and {other_name} overlap; give each its own buffer"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Tensor `name`: `len` elements where `layout` needs `want`, starting at `addr`, a multiple
    /// of `to` bytes ([`TensorChecks::length`], then [`TensorChecks::aligned`]).
    pub(crate) fn tensor(
        &self,
        name: &str,
        layout: &str,
        (len, want): (usize, usize),
        addr: u64,
        to: u64,
    ) -> Result<()> {
        self.length(name, layout, len, want)?;
        self.aligned(name, addr, to)
    }

    /// `addr` must be a multiple of `to` bytes.
    pub(crate) fn aligned(&self, name: &str, addr: u64, to: u64) -> Result<()> {
        if addr % to == 0 {
            return Ok(());
        }
        Err(invalid(format!(
            "{}: {name} starts at device address {addr:#x}, which is not {to}-byte aligned; pass \
             a tensor whose data starts on a {to}-byte boundary (e.g. a .contiguous() copy instead \
             of a view at an odd offset)",
            self.op
        )))
    }
}

/// [`check_args`] with `op` naming the operation in errors (the backward checks its inputs so).
pub(crate) fn check_args_of(op: &str, args: &ForwardArgs<'_>) -> Result<f32> {
    let s = &args.shape;
    let checks = TensorChecks::new(op, s);
    let length =
        |name: &str, layout: &str, got: usize, want: usize| checks.length(name, layout, got, want);
    let aligned = |name: &str, addr: u64, to: u64| checks.aligned(name, addr, to);
    length("q", "[B, T, H, Dk]", args.q.len(), s.qk_len())?;
    length("k", "[B, T, H, Dk]", args.k.len(), s.qk_len())?;
    length("v", "[B, T, H, Dv]", args.v.len(), s.v_len())?;
    length("g", "[B, T, H]", args.g.len(), s.gate_len())?;
    length("o", "[B, T, H, Dv]", args.o.len(), s.v_len())?;
    if let Some(h0) = &args.h0 {
        length("h0", "[B, H, Dk, Dv]", h0.len(), s.state_len())?;
    }
    if let Some(ht) = &args.ht {
        length("ht", "[B, H, Dk, Dv]", ht.len(), s.state_len())?;
    }
    aligned("q", args.q.addr(), 16)?;
    aligned("k", args.k.addr(), 16)?;
    aligned("v", args.v.addr(), 16)?;
    aligned("o", args.o.addr(), 16)?;
    aligned("g", args.g.addr(), 4)?;
    if let Some(h0) = &args.h0 {
        aligned("h0", h0.addr(), 8)?;
    }
    if let Some(ht) = &args.ht {
        aligned("ht", ht.addr(), 8)?;
    }
    let scale = checks.scale(args.scale, s)?;
    let mut inputs = vec![
        ("q", args.q.byte_range()),
        ("k", args.k.byte_range()),
        ("v", args.v.byte_range()),
        ("g", args.g.byte_range()),
    ];
    if let Some(h0) = &args.h0 {
        inputs.push(("h0", h0.byte_range()));
    }
    let mut outputs = vec![("o", args.o.byte_range())];
    if let Some(ht) = &args.ht {
        outputs.push(("ht", ht.byte_range()));
    }
    checks.disjoint(&inputs, &outputs)?;
    Ok(scale)
}

/// The first gate that breaks the contract (finite and `<= 0`), as an error naming `[b, t, h]`.
pub fn check_gate_values(g: &[f32], shape: &ForwardShape) -> Result<()> {
    let Some(pos) = g.iter().position(|x| !(x.is_finite() && *x <= 0.0)) else {
        return Ok(());
    };
    let x = g[pos];
    let (h, bt) = (pos % shape.h.max(1), pos / shape.h.max(1));
    let (t, b) = (bt % shape.t.max(1), bt / shape.t.max(1));
    let what = if x.is_finite() {
        "positive: gates are natural-log decays a_t <= 0; pass log(decay), e.g. logsigmoid(x) \
         or -softplus(x), not the decay factor itself"
            .to_string()
    } else {
        format!(
            "not finite ({x}): find where the gate computation produced it (log(0) = -inf from a \
             zero decay: clamp the decay away from 0, e.g. logsigmoid instead of log(sigmoid))"
        )
    };
    Err(invalid(format!(
        "scalar-decay forward: gate g[b={b}, t={t}, h={h}] (flat index {pos}) = {x} is {what}"
    )))
}
