//! The short convolution on LASP-2 shards: W ranks each hold a contiguous slice of T, and rank w
//! needs the `K - 1` tokens before its slice (its *halo*) to convolve its first tokens.
//!
//! Forward: every rank receives its halo from the ranks before it (several of them when shards
//! are shorter than `K - 1`; zeros before token 0) and convolves its slice locally.
//! Backward: every rank returns the gradient of its halo along with its local gradients; the halo
//! gradient is added to the `dx` of the ranks the halo came from, and `d_weight`, `d_bias` are
//! summed over the ranks (the all-reduce of data parallelism).

use std::ops::Range;

use super::super::error::ReferenceError;
use super::super::packed::shard_ranges;
use super::super::tensor::Tensor;
use super::super::validate::check_shard_lengths;
use super::{backward_with_halo, forward_with_halo, sum_parameter_grads, ConvGrads, ShortConv};

/// The sharded forward with what the ranks exchange.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedForward {
    /// Rank w's halo `[B, K-1, C]`: tokens `start_w - (K-1) .. start_w`, zero before token 0.
    pub halos: Vec<Tensor>,
    /// `[B, T, C]`, the ranks' outputs concatenated.
    pub y: Tensor,
}

/// The sharded backward with what the ranks exchange.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedBackward {
    /// Rank w's halo gradient `[B, K-1, C]`, sent back to the ranks its halo came from; the
    /// entries of slots before token 0 belong to no rank and are dropped.
    pub d_halos: Vec<Tensor>,
    /// The gradients of the whole sequence, after the halo gradients are added and the parameter
    /// gradients summed.
    pub grads: ConvGrads,
}

/// Global token of halo slot j of a shard starting at `start`, `None` before token 0.
fn halo_token(start: usize, k: usize, j: usize) -> Option<usize> {
    (start + j).checked_sub(k - 1)
}

/// Rank `rank`'s halo, assembled only from the slices of the ranks before it, as it would be
/// received.
fn gather_halo(
    conv: &ShortConv,
    shards: &[Tensor],
    ranges: &[Range<usize>],
    rank: usize,
) -> Tensor {
    let (batch, channels) = (shards[rank].shape()[0], conv.channels());
    let k = conv.kernel_size();
    let mut halo = Tensor::zeros(&conv.halo_shape(batch));
    for j in 0..k - 1 {
        let Some(p) = halo_token(ranges[rank].start, k, j) else {
            continue;
        };
        let source = ranges[..rank]
            .iter()
            .position(|r| r.contains(&p))
            .expect("a token before rank's start is owned by an earlier rank");
        for b in 0..batch {
            for c in 0..channels {
                let value = shards[source].get(&[b, p - ranges[source].start, c]);
                halo.data_mut()[(b * (k - 1) + j) * channels + c] = value;
            }
        }
    }
    halo
}

fn split(x: &Tensor, ranges: &[Range<usize>]) -> Vec<Tensor> {
    ranges
        .iter()
        .map(|r| x.slice_time(r.start, r.len()))
        .collect()
}

/// Convolves `x [B, T, C]` split into shards of `lengths` (any positive lengths summing to T,
/// shorter than `K - 1` included), each rank with its halo.
pub fn forward(
    conv: &ShortConv,
    x: &Tensor,
    lengths: &[usize],
) -> Result<ShardedForward, ReferenceError> {
    conv.validate_input(x)?;
    check_shard_lengths(lengths, x.shape()[1])?;
    let ranges = shard_ranges(lengths);
    let shards = split(x, &ranges);
    let halos: Vec<Tensor> = (0..shards.len())
        .map(|w| gather_halo(conv, &shards, &ranges, w))
        .collect();
    let y = shards
        .iter()
        .zip(&halos)
        .map(|(shard, halo)| forward_with_halo(conv, halo, shard))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ShardedForward {
        halos,
        y: Tensor::concat_time(&y),
    })
}

/// The gradients of [`forward`] for `d_y [B, T, C]`: each rank's local backward with its halo,
/// then the halo gradients returned to their owners.
pub fn backward(
    conv: &ShortConv,
    x: &Tensor,
    lengths: &[usize],
    d_y: &Tensor,
) -> Result<ShardedBackward, ReferenceError> {
    conv.validate_input(x)?;
    check_shard_lengths(lengths, x.shape()[1])?;
    ShortConv::validate_cotangent(x, d_y)?;
    let ranges = shard_ranges(lengths);
    let shards = split(x, &ranges);
    let d_y_shards = split(d_y, &ranges);
    let mut local = Vec::with_capacity(shards.len());
    let mut d_halos = Vec::with_capacity(shards.len());
    for (w, (shard, d_y_shard)) in shards.iter().zip(&d_y_shards).enumerate() {
        let halo = gather_halo(conv, &shards, &ranges, w);
        let (grads, d_halo) = backward_with_halo(conv, &halo, shard, d_y_shard)?;
        local.push(grads);
        d_halos.push(d_halo);
    }
    for (w, d_halo) in d_halos.iter().enumerate() {
        return_halo_grad(conv, d_halo, &ranges, w, &mut local);
    }
    Ok(ShardedBackward {
        d_halos,
        grads: sum_parameter_grads(local),
    })
}

/// Adds rank `rank`'s halo gradient to the `dx` of the earlier ranks that own its tokens.
fn return_halo_grad(
    conv: &ShortConv,
    d_halo: &Tensor,
    ranges: &[Range<usize>],
    rank: usize,
    local: &mut [ConvGrads],
) {
    let (batch, channels) = (d_halo.shape()[0], conv.channels());
    let k = conv.kernel_size();
    for j in 0..k - 1 {
        let Some(p) = halo_token(ranges[rank].start, k, j) else {
            continue;
        };
        let owner = ranges[..rank]
            .iter()
            .position(|r| r.contains(&p))
            .expect("a token before rank's start is owned by an earlier rank");
        let (t, len) = (p - ranges[owner].start, ranges[owner].len());
        for b in 0..batch {
            for c in 0..channels {
                local[owner].dx.data_mut()[(b * len + t) * channels + c] += d_halo.get(&[b, j, c]);
            }
        }
    }
}
