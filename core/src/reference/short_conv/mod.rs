//! The short causal depthwise convolution that GDN- and Mamba-style layers apply to q, k and v
//! before the attention (fla's `ShortConvolution`), forward and backward, on one sequence, on
//! LASP-2 shards with a halo ([`sharded`]) and on packed documents ([`packed_forward`],
//! [`packed_backward`]).
//!
//! # Conventions
//! * `x, y [B, T, C]`, weight `[C, K]` (K the kernel size, typically 4), optional bias `[C]`.
//! * `y_{t,c} = act(bias_c + sum_{i=0}^{K-1} w_{c,i} x_{t-K+1+i, c})`, with `x` zero before the
//!   first token: the last weight `w_{c,K-1}` multiplies the current token and `w_{c,0}` the
//!   oldest one. This is the index order of fla's `causal_conv1d_fwd_kernel`
//!   (fla/modules/convolution.py: the token at offset `i_w - (W-1)`, `i_w` in `0..W`, is scaled by
//!   `weight[:, i_w]`), itself PyTorch's `conv1d` with `K - 1` left padding.
//! * `act` is the identity or SiLU `z sigma(z)`, applied after the bias, as fla does.
//! * Backward functions return the gradient of `L = sum(y * d_y)`.
//!
//! Every function takes a *halo* underneath: the `K - 1` tokens before the first one, which the
//! unsharded sequence has as zeros and a LASP-2 shard receives from the ranks before it.

pub mod sharded;

use super::error::ReferenceError;
use super::packed::check_cu_seqlens;
use super::tensor::Tensor;
use super::validate::{check_finite, check_shape};

/// The activation applied after the convolution and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// No activation.
    Identity,
    /// SiLU (fla's `'silu'` / `'swish'`): `z sigma(z)`.
    Silu,
}

impl Activation {
    fn apply(self, z: f64) -> f64 {
        match self {
            Activation::Identity => z,
            Activation::Silu => z * sigmoid(z),
        }
    }

    fn derivative(self, z: f64) -> f64 {
        match self {
            Activation::Identity => 1.0,
            Activation::Silu => {
                let s = sigmoid(z);
                s * (1.0 + z * (1.0 - s))
            }
        }
    }
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// The convolution's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct ShortConv {
    /// `[C, K]`; `weight[c, K-1]` multiplies the current token.
    pub weight: Tensor,
    /// `[C]`, or `None` for no bias.
    pub bias: Option<Tensor>,
    /// Applied after the bias.
    pub activation: Activation,
}

/// The gradients of `L = sum(y * d_y)`.
#[derive(Clone, Debug, PartialEq)]
pub struct ConvGrads {
    /// `[B, T, C]`.
    pub dx: Tensor,
    /// `[C, K]`.
    pub d_weight: Tensor,
    /// `[C]`, present exactly when the convolution has a bias.
    pub d_bias: Option<Tensor>,
}

impl ShortConv {
    /// The kernel size K.
    pub fn kernel_size(&self) -> usize {
        self.weight.shape().get(1).copied().unwrap_or(0)
    }

    /// The number of channels C.
    pub fn channels(&self) -> usize {
        self.weight.shape().first().copied().unwrap_or(0)
    }

    /// The halo a sequence (or shard) of B rows needs: `[B, K-1, C]`.
    pub fn halo_shape(&self, b: usize) -> Vec<usize> {
        vec![b, self.kernel_size().saturating_sub(1), self.channels()]
    }

    /// Checks the weight `[C, K]` (C, K >= 1), the bias `[C]` and their finiteness.
    pub fn validate(&self) -> Result<(), ReferenceError> {
        if self.weight.shape().len() != 2 {
            return Err(ReferenceError::WrongRank {
                tensor: "weight",
                layout: "[C, K]",
                got: self.weight.shape().to_vec(),
            });
        }
        for (name, n) in [("C", self.channels()), ("K", self.kernel_size())] {
            if n == 0 {
                return Err(ReferenceError::ZeroConvDimension { name });
            }
        }
        check_finite("weight", &self.weight)?;
        if let Some(bias) = &self.bias {
            check_shape("bias", "[C]", vec![self.channels()], bias)?;
            check_finite("bias", bias)?;
        }
        Ok(())
    }

    /// Checks the parameters and that `x` is a finite, non-empty `[B, T, C]` with this C.
    fn validate_input(&self, x: &Tensor) -> Result<(), ReferenceError> {
        self.validate()?;
        if x.shape().len() != 3 {
            return Err(ReferenceError::WrongRank {
                tensor: "x",
                layout: "[B, T, C]",
                got: x.shape().to_vec(),
            });
        }
        for (name, n) in [("B", x.shape()[0]), ("T", x.shape()[1])] {
            if n == 0 {
                return Err(ReferenceError::ZeroConvDimension { name });
            }
        }
        check_shape(
            "x",
            "[B, T, C]",
            vec![x.shape()[0], x.shape()[1], self.channels()],
            x,
        )?;
        check_finite("x", x)
    }

    fn validate_halo(&self, x: &Tensor, halo: &Tensor) -> Result<(), ReferenceError> {
        check_shape("halo", "[B, K-1, C]", self.halo_shape(x.shape()[0]), halo)?;
        check_finite("halo", halo)
    }

    fn validate_cotangent(x: &Tensor, d_y: &Tensor) -> Result<(), ReferenceError> {
        check_shape("d_y", "[B, T, C]", x.shape().to_vec(), d_y)?;
        check_finite("d_y", d_y)
    }

    fn zero_halo(&self, x: &Tensor) -> Tensor {
        Tensor::zeros(&self.halo_shape(x.shape()[0]))
    }
}

/// `y [B, T, C]` of one sequence, with zeros before its first token.
pub fn forward(conv: &ShortConv, x: &Tensor) -> Result<Tensor, ReferenceError> {
    conv.validate_input(x)?;
    Ok(convolve(conv, &conv.zero_halo(x), x))
}

/// `y [B, T, C]` of a sequence whose `K - 1` preceding tokens are `halo [B, K-1, C]`.
pub fn forward_with_halo(
    conv: &ShortConv,
    halo: &Tensor,
    x: &Tensor,
) -> Result<Tensor, ReferenceError> {
    conv.validate_input(x)?;
    conv.validate_halo(x, halo)?;
    Ok(convolve(conv, halo, x))
}

/// The gradients of one sequence, with zeros before its first token.
pub fn backward(conv: &ShortConv, x: &Tensor, d_y: &Tensor) -> Result<ConvGrads, ReferenceError> {
    conv.validate_input(x)?;
    ShortConv::validate_cotangent(x, d_y)?;
    // The zero halo is a constant, so its gradient is dropped.
    Ok(convolve_backward(conv, &conv.zero_halo(x), x, d_y).0)
}

/// The gradients of a sequence whose preceding tokens are `halo`, and the halo's own gradient
/// `[B, K-1, C]`, which belongs to the tokens the halo was copied from.
pub fn backward_with_halo(
    conv: &ShortConv,
    halo: &Tensor,
    x: &Tensor,
    d_y: &Tensor,
) -> Result<(ConvGrads, Tensor), ReferenceError> {
    conv.validate_input(x)?;
    conv.validate_halo(x, halo)?;
    ShortConv::validate_cotangent(x, d_y)?;
    Ok(convolve_backward(conv, halo, x, d_y))
}

/// `y` of packed documents (fla's `cu_seqlens`, same for every batch row): each document is
/// convolved as a sequence of its own, so no output reads a token of an earlier document.
pub fn packed_forward(
    conv: &ShortConv,
    x: &Tensor,
    cu_seqlens: &[usize],
) -> Result<Tensor, ReferenceError> {
    conv.validate_input(x)?;
    check_cu_seqlens(cu_seqlens, x.shape()[1])?;
    let documents: Vec<Tensor> = cu_seqlens
        .windows(2)
        .map(|d| {
            let doc = x.slice_time(d[0], d[1] - d[0]);
            convolve(conv, &conv.zero_halo(&doc), &doc)
        })
        .collect();
    Ok(Tensor::concat_time(&documents))
}

/// The gradients of [`packed_forward`]: per-document `dx`, and `d_weight`, `d_bias` summed over
/// the documents.
pub fn packed_backward(
    conv: &ShortConv,
    x: &Tensor,
    cu_seqlens: &[usize],
    d_y: &Tensor,
) -> Result<ConvGrads, ReferenceError> {
    conv.validate_input(x)?;
    check_cu_seqlens(cu_seqlens, x.shape()[1])?;
    ShortConv::validate_cotangent(x, d_y)?;
    let per_document: Vec<ConvGrads> = cu_seqlens
        .windows(2)
        .map(|d| {
            let doc = x.slice_time(d[0], d[1] - d[0]);
            let d_y_doc = d_y.slice_time(d[0], d[1] - d[0]);
            convolve_backward(conv, &conv.zero_halo(&doc), &doc, &d_y_doc).0
        })
        .collect();
    Ok(sum_parameter_grads(per_document))
}

/// Concatenates the `dx` of consecutive pieces of one sequence and sums their parameter
/// gradients (the weights are shared by every token).
pub(crate) fn sum_parameter_grads(pieces: Vec<ConvGrads>) -> ConvGrads {
    let dx: Vec<Tensor> = pieces.iter().map(|g| g.dx.clone()).collect();
    let mut pieces = pieces.into_iter();
    let mut total = pieces.next().expect("at least one piece");
    total.dx = Tensor::concat_time(&dx);
    for piece in pieces {
        add_into(&mut total.d_weight, &piece.d_weight);
        if let (Some(sum), Some(d_bias)) = (&mut total.d_bias, &piece.d_bias) {
            add_into(sum, d_bias);
        }
    }
    total
}

pub(crate) fn add_into(sum: &mut Tensor, term: &Tensor) {
    for (s, t) in sum.data_mut().iter_mut().zip(term.data()) {
        *s += t;
    }
}

/// The pre-activation `z_{b,t,c} = bias_c + sum_i w_{c,i} xe_{b,t+i,c}`, where `xe` is the halo
/// followed by `x` (so `xe` index `t + i` is token `t - (K-1) + i`).
fn pre_activation(conv: &ShortConv, xe: &Extended, b: usize, t: usize, c: usize) -> f64 {
    let bias = conv.bias.as_ref().map_or(0.0, |bias| bias.data()[c]);
    (0..conv.kernel_size()).fold(bias, |z, i| {
        z + conv.weight.get(&[c, i]) * xe.get(b, t + i, c)
    })
}

fn convolve(conv: &ShortConv, halo: &Tensor, x: &Tensor) -> Tensor {
    let xe = Extended { halo, x };
    let mut y = Tensor::zeros(x.shape());
    let (t_len, channels) = (x.shape()[1], x.shape()[2]);
    for (flat, out) in y.data_mut().iter_mut().enumerate() {
        let (b, t, c) = (
            flat / (t_len * channels),
            flat / channels % t_len,
            flat % channels,
        );
        *out = conv.activation.apply(pre_activation(conv, &xe, b, t, c));
    }
    y
}

/// `(grads, d_halo)`: every output scatters its pre-activation gradient `g = d_y act'(z)` back to
/// the K tokens and weights it read and to the bias.
fn convolve_backward(
    conv: &ShortConv,
    halo: &Tensor,
    x: &Tensor,
    d_y: &Tensor,
) -> (ConvGrads, Tensor) {
    let xe = Extended { halo, x };
    let (batch, t_len, channels) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let k = conv.kernel_size();
    let mut d_halo = Tensor::zeros(halo.shape());
    let mut dx = Tensor::zeros(x.shape());
    let mut d_weight = Tensor::zeros(conv.weight.shape());
    let mut d_bias = conv.bias.as_ref().map(|bias| Tensor::zeros(bias.shape()));
    for b in 0..batch {
        for t in 0..t_len {
            for c in 0..channels {
                let z = pre_activation(conv, &xe, b, t, c);
                let g = d_y.get(&[b, t, c]) * conv.activation.derivative(z);
                if let Some(d_bias) = &mut d_bias {
                    d_bias.data_mut()[c] += g;
                }
                for i in 0..k {
                    d_weight.data_mut()[c * k + i] += g * xe.get(b, t + i, c);
                    let w = conv.weight.get(&[c, i]);
                    let j = t + i;
                    if j < k - 1 {
                        d_halo.data_mut()[(b * (k - 1) + j) * channels + c] += g * w;
                    } else {
                        dx.data_mut()[(b * t_len + j - (k - 1)) * channels + c] += g * w;
                    }
                }
            }
        }
    }
    let grads = ConvGrads {
        dx,
        d_weight,
        d_bias,
    };
    (grads, d_halo)
}

/// The halo followed by the sequence, read without copying either.
struct Extended<'a> {
    halo: &'a Tensor,
    x: &'a Tensor,
}

impl Extended<'_> {
    fn get(&self, b: usize, j: usize, c: usize) -> f64 {
        let halo_len = self.halo.shape()[1];
        if j < halo_len {
            self.halo.get(&[b, j, c])
        } else {
            self.x.get(&[b, j - halo_len, c])
        }
    }
}
